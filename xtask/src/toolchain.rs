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

/// `rustc -V` of the kernel toolchain, after making sure it and `rust-src` are installed. Both
/// modules' builds call it at once (one thread each): the first call checks and installs, the
/// others wait for it and reuse its answer (two `rustup component add` at once download to the
/// same file, and one of them fails).
pub fn ensure() -> Result<String, String> {
    static DONE: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);
    let mut done = DONE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(version) = done.as_ref() {
        return Ok(version.clone());
    }
    let version = ensure_once()?;
    *done = Some(version.clone());
    Ok(version)
}

fn rust_src_installed() -> Result<bool, String> {
    let comps = command("rustup")
        .args(["component", "list", "--installed", "--toolchain", KERNEL_TOOLCHAIN])
        .output()
        .map_err(|e| format!("cannot run rustup: {e}"))?;
    Ok(String::from_utf8_lossy(&comps.stdout).lines().any(|l| l.trim().starts_with("rust-src")))
}

fn ensure_once() -> Result<String, String> {
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

    if !rust_src_installed()? {
        println!(
            "xtask: adding the rust-src component to the {KERNEL_TOOLCHAIN} toolchain (needed by -Zbuild-std=core)"
        );
        // Another process (a second xtask) may be adding it at the same moment, and then one of
        // the two downloads fails: a failed add counts when the component is still missing after
        // a second try.
        for attempt in 0..2 {
            let st = command("rustup")
                .args(["component", "add", "rust-src", "--toolchain", KERNEL_TOOLCHAIN])
                .status()
                .map_err(|e| format!("cannot run rustup: {e}"))?;
            if st.success() || rust_src_installed()? {
                break;
            }
            if attempt == 1 {
                return Err(format!(
                    "`rustup component add rust-src --toolchain {KERNEL_TOOLCHAIN}` failed twice; run it by hand and retry"
                ));
            }
            std::thread::sleep(std::time::Duration::from_secs(2));
        }
    }
    Ok(version)
}

/// Line tables for the kernel build: rustc writes `.file`/`.loc` into the PTX, so the VM can name
/// the Rust line of every finding and trace entry. Measured on all fourteen kernels (ptxas 13.5,
/// sm_80 and sm_90): the same PTX instructions, the same registers, no spills, no stack, with and
/// without it; the PTX grows from 435 kB to 587 kB and the build takes about 1 s longer.
pub const LINE_INFO_FLAGS: &[&str] = &["-C", "debuginfo=line-tables-only"];

/// The kernel toolchain's sysroot (where `rust-src` lives, for the `.file` paths of libcore).
pub fn sysroot() -> Result<String, String> {
    let out = command("rustc")
        .arg(format!("+{KERNEL_TOOLCHAIN}"))
        .args(["--print", "sysroot"])
        .output()
        .map_err(|e| format!("cannot run rustc +{KERNEL_TOOLCHAIN} --print sysroot: {e}"))?;
    if !out.status.success() {
        return Err(format!("rustc +{KERNEL_TOOLCHAIN} --print sysroot failed"));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Turns rustc's debug PTX into PTX with line information only, the way `nvcc -lineinfo` writes
/// it: keeps `.file`/`.loc`, drops the DWARF `.section .debug_*` blocks at the end of the module
/// (ptxas 13.5 rejects the ones LLVM 22 writes: "Parsing error near '$L__sec_end0'") and the
/// `, debug` of `.target` (which would ask ptxas for full device debug information), and makes
/// the `.file` paths machine-independent: `kernels-gpu/src/...` relative to the workspace and
/// `<rust>/library/...` for libcore, so the committed PTX is the same on every machine.
pub fn keep_line_info_only(ptx: &str, root: &std::path::Path, sysroot: &str) -> String {
    let root = format!("{}/", root.display());
    let rust_src = format!("{sysroot}/lib/rustlib/src/rust/");
    let mut out = String::with_capacity(ptx.len());
    for line in ptx.lines() {
        let t = line.trim_start();
        if t.starts_with(".section") && t.contains(".debug_") {
            break;
        }
        if let Some(rest) = t.strip_prefix(".target ") {
            out.push_str(".target ");
            out.push_str(rest.trim_end_matches(", debug"));
        } else if t.starts_with(".file") {
            out.push_str(&normalise_dots(&line.replace(&root, "").replace(&rust_src, "<rust>/")));
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// `a/b/../c` -> `a/c` inside a `.file` line (rustc writes `lessons/src/../01-scale/kernel.rs`
/// for a `#[path]` module and `core/src/../../stdarch/...` for libcore's intrinsics).
fn normalise_dots(line: &str) -> String {
    let (Some(a), Some(b)) = (line.find('"'), line.rfind('"')) else { return line.to_string() };
    if b <= a {
        return line.to_string();
    }
    let mut parts: Vec<&str> = Vec::new();
    for p in line[a + 1..b].split('/') {
        if p == ".." && parts.last().is_some_and(|l| *l != ".." && !l.is_empty()) {
            parts.pop();
        } else {
            parts.push(p);
        }
    }
    format!("{}\"{}\"{}", &line[..a], parts.join("/"), &line[b + 1..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_info_only_keeps_loc_and_file_drops_dwarf_and_debug_target_and_relativises_paths() {
        let ptx = "\
.version 7.0
.target sm_80, debug
.address_size 64
.visible .entry k()
{
\t.loc\t1 3 0
\tret;
}
\t.file\t1 \"/home/u/memattn/lessons/src/../01-scale/kernel.rs\"
\t.file\t2 \"/sys/root/lib/rustlib/src/rust/library/core/src/../../stdarch/crates/x.rs\"
\t.section\t.debug_abbrev
\t{
.b8 1
\t}
$L__sec_end0:
";
        let out = keep_line_info_only(ptx, std::path::Path::new("/home/u/memattn"), "/sys/root");
        assert!(out.contains(".target sm_80\n") && !out.contains("debug"), "{out}");
        assert!(out.contains("\t.loc\t1 3 0\n"), "{out}");
        assert!(out.contains("\t.file\t1 \"lessons/01-scale/kernel.rs\"\n"), "{out}");
        assert!(out.contains("\t.file\t2 \"<rust>/library/stdarch/crates/x.rs\"\n"), "{out}");
        assert!(!out.contains(".section") && !out.contains("$L__sec_end0"), "{out}");
    }
}
