//! The one place that says which toolchain builds the kernels.

use std::process::Command;

/// The installed rustup toolchain that builds the PTX. Only this build uses nightly: it needs
/// `-Zbuild-std=core` (no rust-std ships for nvptx64) and the unstable `abi_ptx`,
/// `stdarch_nvptx`, `asm_experimental_arch` and `gpu_launch_sized_workgroup_mem` features.
/// Verified with rustc 1.97.0-nightly (e50aa6fba 2026-05-19), LLVM 22.1.4.
pub const KERNEL_TOOLCHAIN: &str = "nightly";
pub const TARGET: &str = "nvptx64-nvidia-cuda";
/// PTX built for sm_80 JIT-compiles on sm_80 .. sm_90 (A100, H100, H200).
pub const TARGET_CPU: &str = "sm_80";

/// A `rustup`/`cargo` command with the variables that would pin the stable toolchain removed.
pub fn command(program: &str) -> Command {
    let mut c = Command::new(program);
    for v in [
        "RUSTUP_TOOLCHAIN",
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTDOC",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
    ] {
        c.env_remove(v);
    }
    c
}

/// `rustc -V` of the kernel toolchain, after making sure it and `rust-src` are installed.
pub fn ensure() -> Result<String, String> {
    let out = command("rustc")
        .arg(format!("+{KERNEL_TOOLCHAIN}"))
        .arg("-V")
        .output()
        .map_err(|e| format!("cannot run rustc (is rustup on PATH?): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "the `{KERNEL_TOOLCHAIN}` toolchain is not installed; the kernels need it for -Zbuild-std.\n  \
             fix: rustup toolchain install {KERNEL_TOOLCHAIN} --profile minimal --component rust-src\n  \
             rustc said: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let version = String::from_utf8_lossy(&out.stdout).trim().to_string();

    let comps = command("rustup")
        .args(["component", "list", "--installed", "--toolchain", KERNEL_TOOLCHAIN])
        .output()
        .map_err(|e| format!("cannot run rustup: {e}"))?;
    let installed = String::from_utf8_lossy(&comps.stdout);
    if !installed.lines().any(|l| l.trim().starts_with("rust-src")) {
        println!(
            "xtask: adding the rust-src component to the {KERNEL_TOOLCHAIN} toolchain (needed by -Zbuild-std=core)"
        );
        let st = command("rustup")
            .args(["component", "add", "rust-src", "--toolchain", KERNEL_TOOLCHAIN])
            .status()
            .map_err(|e| format!("cannot run rustup: {e}"))?;
        if !st.success() {
            return Err(format!(
                "`rustup component add rust-src --toolchain {KERNEL_TOOLCHAIN}` failed; run it by hand and retry"
            ));
        }
    }
    Ok(version)
}
