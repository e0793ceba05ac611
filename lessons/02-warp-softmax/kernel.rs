//! Lesson 2: row softmax with warp shuffles, `y[r, :] = softmax(x[r, :])`.
//!
//! `x` and `y` are `[rows, cols]`, row-major f32. One warp (32 threads) computes one row; a block
//! of 128 threads computes 4 rows, `grid.x = ceil(rows / 4)`. `cols` can be any length, also
//! more than 32 and not a multiple of 32.
//!
//! Steps:
//! 1. `lane = tid_x() % 32`, `row = ctaid_x() * 4 + tid_x() / 32`. A warp whose row is
//!    past `rows` returns (the whole warp together, so the shuffles below always see 32 lanes).
//! 2. Row maximum: each lane takes the max over columns `lane, lane + 32, lane + 64, ...`; then
//!    the 32 lanes combine their values with `shfl_xor(v, 16)`, `8`, `4`, `2`, `1`
//!    (`v = max_f32(v, shfl_xor(v, m))`): afterwards every lane holds the row's maximum.
//! 3. Sum of `exp(x - max)` the same way (use `exp2((x - max) * LOG2E)`).
//!    Subtracting the maximum keeps `exp` from overflowing to infinity for large inputs.
//! 4. Each lane writes `exp(x - max) / sum` for its columns.
//!
//! Check it: `cargo xtask lesson 2`; the reference solution is `solution.rs`.

#[allow(unused_imports)]
use crate::gpu::*;

/// # Safety
/// `x` and `y` must point to `rows * cols` f32s.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn row_softmax_f32(rows: u32, cols: u32, x: *const f32, y: *mut f32) {
    // Step 1: let lane = ...; let row = ...; if row >= rows { return; }
    // Step 2: let mut m = f32::NEG_INFINITY; ... warp reduction with shfl_xor ...
    // Step 3: let mut l = 0.0; ...
    // Step 4: *y.add(...) = ...;
    let _ = (rows, cols, x, y);
}
