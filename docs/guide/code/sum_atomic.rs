//! Chapter 9 of the guide: `sum_atomic`, `total += x[0] + ... + x[n - 1]` with one atomic add per
//! element, launched with any number of blocks of any size.
//!
//! A grid-stride loop: thread `g` of the grid adds `x[g]`, `x[g + threads]`, ... to `total`
//! itself. Every add goes to the same address, so on a GPU they wait for each other: `n` atomic
//! adds in a row. `sum_tree.rs` is the fix.
//!
//! `cargo xtask lesson new sum_atomic` makes the scratch crate whose `kernel.rs` this file
//! replaces.
#![no_std]
#![feature(abi_ptx)]

use memattn_lessons::gpu::*;

/// # Safety
/// `x` must point to `n` f32s and `total` to one f32 in device memory.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn sum_atomic(n: u32, x: *const f32, total: *mut f32) {
    let mut i = ctaid_x() * ntid_x() + tid_x();
    while i < n {
        // One atomic add per element, all to one address.
        unsafe { red_add_f32(total, *x.add(i as usize)) };
        i += ntid_x() * nctaid_x();
    }
}
