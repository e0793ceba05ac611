//! Chapter 8 of the guide, step 0 of the ladder: `ladder`, the scores `S = Q Kᵀ` of `n` queries
//! and `m` keys of dimension `d` (row-major f32), one thread per score, blocks of 16 × 16
//! threads over a grid of `ceil(m / 16) × ceil(n / 16)`: thread `(tx, ty)` computes
//! `S[i, j]` with `i = ctaid_y() * 16 + ty`, `j = ctaid_x() * 16 + tx`.
//!
//! Step 0 reads every operand from global memory: the 16 lanes of a half-warp read 16 different
//! rows of `K`, `d` floats apart. `ladder_1.rs` makes the one change of step 1.
//!
//! `cargo xtask lesson new ladder` makes the scratch crate whose `kernel.rs` this file replaces.
#![no_std]
#![feature(abi_ptx)]

use memattn_lessons::gpu::*;

/// The tile edge.
const T: u32 = 16;

/// # Safety
/// `q` must point to `n * d`, `k` to `m * d` and `s` to `n * m` f32s; blocks of 16 × 16 threads
/// and 2176 bytes of dynamic shared memory (used from step 1 on).
#[no_mangle]
pub unsafe extern "ptx-kernel" fn ladder(n: u32, m: u32, d: u32, q: *const f32, k: *const f32, s: *mut f32) {
    let (tx, ty) = (tid_x(), tid_y());
    let i = ctaid_y() * T + ty;
    let j = ctaid_x() * T + tx;
    if i < n && j < m {
        let mut acc = 0.0f32;
        for c in 0..d {
            acc = fma(unsafe { *q.add((i * d + c) as usize) }, unsafe { *k.add((j * d + c) as usize) }, acc);
        }
        unsafe { *s.add((i * m + j) as usize) = acc };
    }
}
