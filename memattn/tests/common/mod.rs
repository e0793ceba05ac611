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

/// `flash_attn_into` of host tensors shaped by `p` (q `[b, seq_q, heads, d]`, k and v `[b, seq_kv,
/// heads_kv, d]`, in `p.dtype`) into NaN-poisoned O and LSE on `kernels`' device; O and LSE read
/// back as f32.
pub fn flash_into(
    kernels: &memattn::attn::Kernels,
    p: &memattn::Problem,
    (q, k, v): (&[f32], &[f32], &[f32]),
    opts: &memattn::attn::AttnOpts<'_>,
) -> (Vec<f32>, Vec<f32>) {
    use memattn::attn::{LseViewMut, TensorView, TensorViewMut};
    let dt = p.dtype;
    let (b, sq, skv) = (p.batch as usize, p.seq_q as usize, p.seq_kv as usize);
    let (h, hk, d) = (p.heads as usize, p.kv_heads() as usize, p.head_dim as usize);
    let up = |x: &[f32]| kernels.vm_upload_as(dt, x).unwrap();
    let (qb, kb, vb) = (up(q), up(k), up(v));
    let ob = kernels.vm_upload_as(dt, &vec![f32::NAN; q.len()]).unwrap();
    let lb = kernels.vm_upload(&vec![f32::NAN; b * h * sq]).unwrap();
    let (qs, ks) = ([b, sq, h, d], [b, skv, hk, d]);
    kernels
        .flash_attn_into(
            &TensorView::vm(&qb, dt, qs).unwrap(),
            &TensorView::vm(&kb, dt, ks).unwrap(),
            &TensorView::vm(&vb, dt, ks).unwrap(),
            &mut TensorViewMut::vm(&ob, dt, qs).unwrap(),
            &mut LseViewMut::vm(&lb, b, h, sq).unwrap(),
            opts,
        )
        .unwrap();
    (ob.read_f32(dt, q.len()).unwrap(), lb.read_f32(memattn::Dtype::F32, b * h * sq).unwrap())
}
