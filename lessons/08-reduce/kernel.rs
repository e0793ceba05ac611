//! Lesson 8: the sum of a large array, `total += x[0] + x[1] + ... + x[n - 1]`.
//!
//! The launch: blocks of 256 threads, fewer blocks than the data needs (a grid of `g` blocks for
//! any `n`), 1 KiB of dynamic shared memory (`dynamic_smem_f32()`: 256 floats). `total` holds 0
//! before the launch; the blocks add to it.
//!
//! Steps:
//! 1. Each thread sums its elements in a register `acc`: a grid-stride loop that starts at
//!    `i = ctaid_x() * 256 + tid_x()` and goes up by the number of threads in the grid,
//!    `256 * nctaid_x()`, while `i < n`.
//! 2. Store `acc` in the shared array at `tid_x()`, then `sync_threads()`: no thread may read a
//!    neighbour's value before it is written.
//! 3. A tree: for `half` = 128, 64, ..., 1, the threads with `tid_x() < half` add
//!    `s[tid_x() + half]` to `s[tid_x()]`; after each round, `sync_threads()` (every thread, not
//!    only the adding ones). At the end `s[0]` is the block's sum.
//! 4. Thread 0 adds `s[0]` to `total` with one atomic add, `red_add_f32(total, ...)`: the blocks
//!    run in any order, possibly at the same time, and a plain `*total += ...` would lose adds.
//!
//! Check it: `cargo xtask lesson 8`; the reference solution is `solution.rs`.

#[allow(unused_imports)]
use crate::gpu::*;

/// # Safety
/// `x` must point to `n` f32s and `total` to one f32 in device memory; blocks of 256 threads and
/// 1 KiB of dynamic shared memory.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn block_sum_f32(n: u32, x: *const f32, total: *mut f32) {
    // let t = tid_x();
    // Step 1: let mut acc = 0.0f32; let mut i = ...; while i < n { ... }
    // Step 2: let s = dynamic_smem_f32(); ...; sync_threads();
    // Step 3: let mut half = 128; while half > 0 { ...; sync_threads(); half /= 2; }
    // Step 4: if t == 0 { unsafe { red_add_f32(total, *s) }; }
    let _ = (n, x, total);
}
