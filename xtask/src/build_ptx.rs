//! `cargo xtask build-ptx [--check]`.

use crate::paths;
use crate::toolchain::{self, KERNEL_TOOLCHAIN, TARGET, TARGET_CPU};
use kernels_gpu::artifacts::{sha256_hex, BuildInfo};
use std::time::Instant;

/// Builds the PTX into `out` and returns the rustc version that built it.
pub fn build_into(out: &std::path::Path) -> Result<String, String> {
    let version = toolchain::ensure()?;
    println!("xtask: building kernels-gpu for {TARGET} ({TARGET_CPU}) with {version}");
    let started = Instant::now();
    let status = toolchain::command("cargo")
        .current_dir(paths::root())
        .arg(format!("+{KERNEL_TOOLCHAIN}"))
        .args(["rustc", "--quiet", "-p", "kernels-gpu", "--profile", "ptx", "--crate-type", "staticlib"])
        .args(["--target", TARGET, "-Zbuild-std=core", "--target-dir"])
        .arg(paths::ptx_target_dir())
        // PTX ISA 7.4 (CUDA 11.4 drivers and newer): the first with cp.async's L2 prefetch hint.
        .args(["--", "-C", &format!("target-cpu={TARGET_CPU}"), "-C", "target-feature=+ptx74"])
        .args(toolchain::LINE_INFO_FLAGS)
        .arg(format!("--emit=asm={}", out.display()))
        .status()
        .map_err(|e| format!("cannot run cargo +{KERNEL_TOOLCHAIN}: {e}"))?;
    if !status.success() {
        return Err("the kernel build failed (see the compiler output above)".into());
    }
    let raw = std::fs::read_to_string(out).map_err(|e| format!("no PTX at {}: {e}", out.display()))?;
    let ptx = toolchain::keep_line_info_only(&raw, &paths::root(), &toolchain::sysroot()?);
    std::fs::write(out, &ptx).map_err(|e| format!("cannot write {}: {e}", out.display()))?;
    if let Some(line) = ptx.lines().find(|l| l.contains(".extern .func")) {
        return Err(format!(
            "the PTX still calls into an external function ({}); ptxas cannot resolve it. \
             Is the `ptx` profile's fat LTO in effect?",
            line.trim()
        ));
    }
    println!("xtask: built {} bytes of PTX in {:.1} s", ptx.len(), started.elapsed().as_secs_f64());
    Ok(version)
}

fn build_info_json(rustc: &str, ptx: &[u8]) -> String {
    BuildInfo {
        toolchain: KERNEL_TOOLCHAIN.into(),
        rustc: rustc.into(),
        target: TARGET.into(),
        cpu: TARGET_CPU.into(),
        ptx_sha256: sha256_hex(ptx),
    }
    .to_json()
}

pub fn run(check: bool) -> Result<(), String> {
    let tmp = paths::ptx_target_dir().join("memattn_kernels.ptx");
    std::fs::create_dir_all(paths::ptx_target_dir()).map_err(|e| e.to_string())?;
    let rustc = build_into(&tmp)?;
    let fresh = std::fs::read(&tmp).map_err(|e| e.to_string())?;
    let info = build_info_json(&rustc, &fresh);
    if check {
        let committed = std::fs::read(paths::ptx()).unwrap_or_default();
        let committed_info = std::fs::read_to_string(paths::build_info()).unwrap_or_default();
        if committed != fresh || committed_info != info {
            return Err(format!(
                "{} or {} is stale (the kernel sources or toolchain changed). fix: cargo xtask build-ptx && cargo xtask ptxas, then commit",
                paths::rel(&paths::ptx()),
                paths::rel(&paths::build_info())
            ));
        }
        println!("xtask: {} is up to date ({})", paths::rel(&paths::ptx()), sha256_hex(&fresh));
        return Ok(());
    }
    std::fs::write(paths::ptx(), &fresh).map_err(|e| e.to_string())?;
    std::fs::write(paths::build_info(), info).map_err(|e| e.to_string())?;
    println!("xtask: wrote {} and {}", paths::rel(&paths::ptx()), paths::rel(&paths::build_info()));
    Ok(())
}
