//! Chapter 7 of the guide: `transpose_naive`, a transpose of an `n × n` f32 matrix,
//! `y[r][c] = x[c][r]`, launched with blocks of 32 × 32 threads over a grid of
//! `ceil(n / 32) × ceil(n / 32)`.
//!
//! The 32 lanes of a warp (consecutive `tid_x`) write 32 neighbouring floats of `y` but read a
//! column of `x`, `n` floats apart: one 32-byte sector per lane for 4 useful bytes.
//! `transpose_tiled.rs` is the fix.
//!
//! `cargo xtask lesson new transpose_naive` makes the scratch crate whose `kernel.rs` this file
//! replaces.
#![no_std]
#![feature(abi_ptx)]

use memattn_lessons::gpu::*;

/// The tile edge: one warp's lanes along x.
const T: u32 = 32;

/// # Safety
/// `x` and `y` must point to at least `n * n` f32s in device memory; blocks of 32 × 32 threads.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn transpose_naive(n: u32, x: *const f32, y: *mut f32) {
    let row = ctaid_y() * T + tid_y();
    let col = ctaid_x() * T + tid_x();
    if row < n && col < n {
        // The lanes read x[col .. col + 32][row], n floats apart ...
        let v = unsafe { *x.add((col * n + row) as usize) };
        // ... and write y[row][col .. col + 32], neighbours.
        unsafe { *y.add((row * n + col) as usize) = v };
    }
}
