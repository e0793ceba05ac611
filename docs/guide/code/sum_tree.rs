//! Chapter 9 of the guide: `sum_tree`, `total += x[0] + ... + x[n - 1]` with one atomic add per
//! block, launched with blocks of 256 threads and 1 KiB of dynamic shared memory (256 floats).
//!
//! Each thread sums its elements in a register (a grid-stride loop) and stores the sum in shared
//! memory. Two rounds of a tree halve the 256 values to 64, with a barrier after each; warp 0
//! then adds the last 64 in registers: two values per lane, then five warp shuffles (16, 8, 4,
//! 2, 1 lanes apart), without shared memory and without barriers. Lane 0 adds the block's sum to
//! `total`: one atomic add per block.
//!
//! `cargo xtask lesson new sum_tree` makes the scratch crate whose `kernel.rs` this file
//! replaces.
#![no_std]
#![feature(abi_ptx)]

use memattn_lessons::gpu::*;

/// Threads per block: the launch's block size and the length of the shared array.
const B: u32 = 256;

/// # Safety
/// `x` must point to `n` f32s and `total` to one f32 in device memory; blocks of 256 threads and
/// 1 KiB of dynamic shared memory.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn sum_tree(n: u32, x: *const f32, total: *mut f32) {
    let t = tid_x();
    let mut i = ctaid_x() * B + t;
    let mut acc = 0.0f32;
    while i < n {
        acc += unsafe { *x.add(i as usize) };
        i += B * nctaid_x();
    }
    let s = dynamic_smem_f32();
    unsafe { *s.add(t as usize) = acc };
    sync_threads();
    // 256 -> 128 -> 64 values in shared memory; every thread reaches every barrier.
    let mut half = B / 2;
    while half > 32 {
        if t < half {
            unsafe { *s.add(t as usize) += *s.add((t + half) as usize) };
        }
        sync_threads();
        half /= 2;
    }
    // The last 64 values: warp 0 alone (a warp-uniform branch, so all 32 lanes shuffle).
    if t < 32 {
        let mut v = unsafe { *s.add(t as usize) + *s.add((t + 32) as usize) };
        let mut lanes = 16;
        while lanes > 0 {
            v += shfl_xor(v, lanes);
            lanes /= 2;
        }
        if t == 0 {
            unsafe { red_add_f32(total, v) };
        }
    }
}
