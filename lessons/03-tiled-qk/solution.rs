//! Lesson 3, reference solution: `S = scale * Q Kᵀ` with 16 x 16 tiles in shared memory.

use crate::gpu::*;

const T: u32 = 16;

/// # Safety
/// `q` must point to `n * d`, `k` to `m * d` and `s` to `n * m` f32s.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn qk_tiled_f32(
    n: u32,
    m: u32,
    d: u32,
    scale: f32,
    q: *const f32,
    k: *const f32,
    s: *mut f32,
) {
    let (tx, ty) = (tid_x(), tid_y());
    let i = ctaid_y() * T + ty;
    let j = ctaid_x() * T + tx;
    let kr = ctaid_x() * T + ty; // the K row this thread loads
    let qs = dynamic_smem_f32();
    let ks = unsafe { qs.add((T * T) as usize) };
    let mut acc = 0.0f32;
    let mut c0 = 0;
    while c0 < d {
        // Step 1: one element of each tile per thread, zero past the edges.
        let c = c0 + tx;
        let qv = if i < n && c < d { unsafe { *q.add((i * d + c) as usize) } } else { 0.0 };
        let kv = if kr < m && c < d { unsafe { *k.add((kr * d + c) as usize) } } else { 0.0 };
        unsafe {
            *qs.add((ty * T + tx) as usize) = qv;
            *ks.add((ty * T + tx) as usize) = kv;
        }
        // Step 2.
        sync_threads();
        // Step 3.
        for kk in 0..T {
            acc = fma(unsafe { *qs.add((ty * T + kk) as usize) }, unsafe { *ks.add((tx * T + kk) as usize) }, acc);
        }
        // Step 4.
        sync_threads();
        c0 += T;
    }
    if i < n && j < m {
        unsafe { *s.add((i * m + j) as usize) = scale * acc };
    }
}
