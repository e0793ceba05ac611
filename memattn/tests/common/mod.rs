//! Helpers shared by the library's integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

/// `libvm_cuda.so` (the VM-backed CUDA driver), which cargo builds next to these tests (a
/// dev-dependency of memattn).
pub fn vm_cuda() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    [deps, deps.parent().unwrap()]
        .iter()
        .map(|d| d.join("libvm_cuda.so"))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("libvm_cuda.so is not next to {}", exe.display()))
}
