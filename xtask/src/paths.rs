//! Where the pipeline reads and writes.

use std::path::PathBuf;

/// Workspace root (the parent of `xtask/`).
pub fn root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().expect("xtask lives in the workspace root").to_path_buf()
}

/// The committed PTX module the host embeds.
pub fn ptx() -> PathBuf {
    root().join("kernels-gpu/ptx/memattn_kernels.ptx")
}

/// Which toolchain built the committed PTX.
pub fn build_info() -> PathBuf {
    root().join("kernels-gpu/ptx/build-info.json")
}

/// ptxas resources per kernel and arch.
pub fn ptxas_report() -> PathBuf {
    root().join("kernels-gpu/ptx/ptxas-report.json")
}

/// Cargo target dir for the kernel build (separate from the host builds, so the nightly and
/// stable artefacts never invalidate each other).
pub fn ptx_target_dir() -> PathBuf {
    root().join("target/ptx-build")
}

/// Where the ptxas wheel is unpacked.
pub fn ptxas_cache() -> PathBuf {
    root().join("target/ptxas-cache")
}

/// Relative path for messages.
pub fn rel(p: &std::path::Path) -> String {
    p.strip_prefix(root()).unwrap_or(p).display().to_string()
}
