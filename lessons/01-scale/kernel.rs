//! Lesson 1: a scaled copy, `y[i] = a * x[i]` for `i < n`.
//!
//! The launch: blocks of 256 threads, as many blocks as needed to cover `n`
//! (`grid.x = ceil(n / 256)`), so the last block may have threads past the end.
//!
//! Steps:
//! 1. Compute this thread's element index `i` from its block index (`ctaid_x()`), the block size
//!    (`ntid_x()`) and its index in the block (`tid_x()`).
//! 2. Threads with `i >= n` must do nothing: they would read and write past the end of `x` and `y`.
//! 3. Store `a * x[i]` into `y[i]` (`*y.add(i as usize) = ...`).
//!
//! Check it: `cargo xtask lesson 1`. The reference solution is in `solution.rs` next to this file
//! (`cargo xtask lesson 1 --solution` runs it).

#[allow(unused_imports)]
use crate::gpu::*;

/// # Safety
/// `x` and `y` must point to at least `n` f32s in device memory.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn scale_f32(n: u32, a: f32, x: *const f32, y: *mut f32) {
    // Step 1: let i = ...;
    // Step 2: if i < n { ... }
    // Step 3: unsafe { *y.add(i as usize) = a * *x.add(i as usize) };
    let _ = (n, a, x, y);
}
