//! Where the pipeline reads and writes.

use kernels_gpu::variants::PtxModule;
use std::path::PathBuf;

/// Workspace root (the parent of `xtask/`).
pub fn root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().expect("xtask lives in the workspace root").to_path_buf()
}

/// A committed PTX module the host embeds.
pub fn ptx(module: PtxModule) -> PathBuf {
    root().join("kernels-gpu/ptx").join(module.file_name())
}

/// Which toolchain built a committed module (`build-info.json`, `build-info-sm90.json`).
pub fn build_info(module: PtxModule) -> PathBuf {
    root().join("kernels-gpu/ptx").join(match module {
        PtxModule::Sm80 => "build-info.json",
        PtxModule::Sm90a => "build-info-sm90.json",
    })
}

/// ptxas resources per kernel and arch.
pub fn ptxas_report(module: PtxModule) -> PathBuf {
    root().join("kernels-gpu/ptx").join(match module {
        PtxModule::Sm80 => "ptxas-report.json",
        PtxModule::Sm90a => "ptxas-report-sm90.json",
    })
}

/// Cargo target dir for a module's kernel build (separate from the host builds, so the nightly
/// and stable artefacts never invalidate each other, and one per module, so building one never
/// invalidates the other).
pub fn ptx_target_dir(module: PtxModule) -> PathBuf {
    root().join(match module {
        PtxModule::Sm80 => "target/ptx-build",
        PtxModule::Sm90a => "target/ptx-build-sm90",
    })
}

/// Where the ptxas wheel is unpacked.
pub fn ptxas_cache() -> PathBuf {
    root().join("target/ptxas-cache")
}

/// Relative path for messages.
pub fn rel(p: &std::path::Path) -> String {
    p.strip_prefix(root()).unwrap_or(p).display().to_string()
}
