//! Chapter 8 of the guide, step 2 of the ladder: the same `ladder` as `ladder_1.rs`
//! (`S = Q Kᵀ` through 16 × 16 tiles in shared memory), with ONE change: a tile row is 17 floats
//! long instead of 16 (`TS`). Lane `tx` then reads word `tx * 17 + kk` of the `K` tile: 16
//! different banks for the 16 lanes of a half-warp, where step 1 had two.
//!
//! Nothing else changes: the global accesses, the barriers and the result are step 1's. It is
//! the last step of the chapter.
#![no_std]
#![feature(abi_ptx)]

use memattn_lessons::gpu::*;

/// The tile edge.
const T: u32 = 16;
/// The length of a tile row in shared memory, in floats.
const TS: u32 = 17;

/// # Safety
/// `q` must point to `n * d`, `k` to `m * d` and `s` to `n * m` f32s; blocks of 16 × 16 threads
/// and 2176 bytes of dynamic shared memory (two tiles of 16 rows of 17 floats, from step 2 on).
#[no_mangle]
pub unsafe extern "ptx-kernel" fn ladder(n: u32, m: u32, d: u32, q: *const f32, k: *const f32, s: *mut f32) {
    let (tx, ty) = (tid_x(), tid_y());
    let i = ctaid_y() * T + ty;
    let j = ctaid_x() * T + tx;
    let kr = ctaid_x() * T + ty; // the K row this thread loads
    let qs = dynamic_smem_f32();
    let ks = unsafe { qs.add((T * TS) as usize) };
    let mut acc = 0.0f32;
    let mut c0 = 0;
    while c0 < d {
        let c = c0 + tx;
        let qv = if i < n && c < d { unsafe { *q.add((i * d + c) as usize) } } else { 0.0 };
        let kv = if kr < m && c < d { unsafe { *k.add((kr * d + c) as usize) } } else { 0.0 };
        unsafe {
            *qs.add((ty * TS + tx) as usize) = qv;
            *ks.add((ty * TS + tx) as usize) = kv;
        }
        sync_threads();
        for kk in 0..T {
            acc = fma(unsafe { *qs.add((ty * TS + kk) as usize) }, unsafe { *ks.add((tx * TS + kk) as usize) }, acc);
        }
        sync_threads();
        c0 += T;
    }
    if i < n && j < m {
        unsafe { *s.add((i * m + j) as usize) = acc };
    }
}
