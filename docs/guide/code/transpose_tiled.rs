//! Chapter 7 of the guide: `transpose_tiled`, the same transpose as `transpose_naive.rs`
//! (`y[r][c] = x[c][r]`, `n × n` f32, blocks of 32 × 32 threads), through shared memory.
//!
//! The block reads a 32 × 32 tile of `x` along its rows into shared memory, waits at a barrier,
//! and writes `y` along its rows from the tile read across: both global accesses take whole
//! sectors. The tile's rows are 33 floats, so the read across the tile (lanes 33 words apart)
//! hits 32 different banks.
//!
//! `cargo xtask lesson new transpose_tiled` makes the scratch crate whose `kernel.rs` this file
//! replaces.
#![no_std]
#![feature(abi_ptx)]

use memattn_lessons::gpu::*;

/// The tile edge: one warp's lanes along x.
const T: u32 = 32;

/// # Safety
/// `x` and `y` must point to at least `n * n` f32s in device memory; blocks of 32 × 32 threads, launched with 32 · 33 · 4 = 4224 bytes of dynamic shared memory.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn transpose_tiled(n: u32, x: *const f32, y: *mut f32) {
    let tile = dynamic_smem_f32();
    let (tx, ty) = (tid_x(), tid_y());
    // The block writes the tile of y at (ctaid_y, ctaid_x), so it reads the tile of x at
    // (ctaid_x, ctaid_y): lanes along a row of x.
    let (r, c) = (ctaid_x() * T + ty, ctaid_y() * T + tx);
    if r < n && c < n {
        let v = unsafe { *x.add((r * n + c) as usize) };
        unsafe { *tile.add((ty * (T + 1) + tx) as usize) = v };
    }
    sync_threads();
    let (row, col) = (ctaid_y() * T + ty, ctaid_x() * T + tx);
    if row < n && col < n {
        // y[row][col] = x[col][row], which thread (ty, tx) stored at tile[tx][ty].
        let v = unsafe { *tile.add((tx * (T + 1) + ty) as usize) };
        unsafe { *y.add((row * n + col) as usize) = v };
    }
}
