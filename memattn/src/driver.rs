//! Which CUDA driver library the process uses: the system's, or one chosen by path (the
//! `MEMATTN_CUDA_DRIVER` variable or [`use_driver_library`], e.g. `vm-cuda`'s VM-backed driver).
//! A leaf module, so both the CUDA backend and NVML can ask without importing each other.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Environment variable naming a CUDA driver library to load instead of the system's.
pub const DRIVER_ENV: &str = "MEMATTN_CUDA_DRIVER";

/// The driver library chosen by [`use_driver_library`] or [`DRIVER_ENV`], loaded by its path
/// (kept loaded for the life of the process).
pub(crate) static CHOSEN: OnceLock<Result<(PathBuf, libloading::Library), String>> = OnceLock::new();

/// Loads the driver library at `path` in place of the system's, before the first CUDA call (the
/// first choice of the process wins). Its ELF soname must be `libcuda.so` — the first name cudarc
/// asks the loader for — so that cudarc gets this library; `vm-cuda`'s is.
pub fn use_driver_library(path: &Path) -> Result<&'static Path, String> {
    let chosen = CHOSEN.get_or_init(|| {
        // The loader opens what it is given: a FIFO or a device would block it (or worse)
        // before it could say the file is no library. A name that is not a path is the
        // loader's to look up.
        if let Ok(m) = std::fs::metadata(path)
            && !m.is_file()
        {
            return Err(format!("{DRIVER_ENV}: {} is not a regular file (a driver library is one)", path.display()));
        }
        // SAFETY: loading a driver library runs its initialisers; that is what is asked for.
        unsafe { libloading::Library::new(path) }
            .map(|lib| (path.to_path_buf(), lib))
            .map_err(|e| format!("{DRIVER_ENV}: cannot load {}: {e}", path.display()))
    });
    match chosen {
        Ok((p, _)) => Ok(p.as_path()),
        Err(e) => Err(e.clone()),
    }
}

/// The driver library in use instead of the system's, if any ([`DRIVER_ENV`] is read once).
pub fn driver_library() -> Result<Option<&'static Path>, String> {
    if let Some(chosen) = CHOSEN.get() {
        return chosen.as_ref().map(|(p, _)| Some(p.as_path())).map_err(Clone::clone);
    }
    match std::env::var_os(DRIVER_ENV) {
        Some(p) if !p.is_empty() => use_driver_library(Path::new(&p)).map(Some),
        _ => Ok(None),
    }
}
