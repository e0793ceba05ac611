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

/// Deterministic inputs in [-1, 1) (xorshift), rounded to `dtype`.
pub fn data(n: usize, seed: u64, dtype: memattn::Dtype) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut x: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    dtype.round_all(&mut x);
    x
}
