//! Lesson 9: a transpose that reads and writes whole sectors, `y[j][i] = x[i][j]`.
//!
//! `x` is `rows x cols` f32, row by row; `y` is `cols x rows`. A warp's global access is served
//! in 32-byte sectors: when the 32 lanes (consecutive `tid_x()`) touch neighbouring floats, a
//! warp moves 128 bytes in 4 sectors; when they touch a column, each lane needs a sector of its
//! own (32 sectors, 12.5 % of the bytes used). A transpose reads x along rows or writes y along
//! rows, never both, unless it turns the data in shared memory. The checker counts the sectors
//! of every global load and store (the VM's counters) and wants each at 50 % or better.
//!
//! The launch: blocks of 32 x 32 threads; block (ctaid_x(), ctaid_y()) handles the 32 x 32 tile
//! of x at rows `ctaid_y() * 32 ..`, columns `ctaid_x() * 32 ..` (a grid of `cols / 32` x
//! `rows / 32`, rounded up: the edge tiles are partial). 4224 bytes of dynamic shared memory
//! (`dynamic_smem_f32()`): the tile, 32 rows of 33 floats (the 33rd is padding, see step 3).
//!
//! Steps (tx = tid_x(), ty = tid_y()):
//! 1. Read along a row of x: r = ctaid_y() * 32 + ty, c = ctaid_x() * 32 + tx; if r < rows and
//!    c < cols, store x[r * cols + c] in the tile at ty * 33 + tx.
//! 2. sync_threads(): step 3 reads what other warps stored. Every thread reaches it (no
//!    `return` before it, also not for the threads past the edge).
//! 3. Write along a row of y: j = ctaid_x() * 32 + ty, i = ctaid_y() * 32 + tx; if j < cols
//!    and i < rows, y[j * rows + i] = x[i][j], which thread (ty, tx) stored at tx * 33 + ty.
//!    Reading that column of the tile, the lanes' words are 33 apart: 32 different banks (with
//!    rows of 32 floats all 32 lanes would wait for one bank).
//!
//! Check it: `cargo xtask lesson 9`; the reference solution is `solution.rs`.

#[allow(unused_imports)]
use crate::gpu::*;

/// # Safety
/// `x` must point to `rows * cols` f32s and `y` to `cols * rows` f32s in device memory; blocks of
/// 32 x 32 threads, a grid of `cols.div_ceil(32)` x `rows.div_ceil(32)` blocks, 4224 bytes of
/// dynamic shared memory.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn transpose_f32(rows: u32, cols: u32, x: *const f32, y: *mut f32) {
    // let tile = dynamic_smem_f32();
    // let (tx, ty) = (tid_x(), tid_y());
    // Step 1: let (r, c) = (...); if r < rows && c < cols { ... }
    // Step 2: sync_threads();
    // Step 3: let (j, i) = (...); if j < cols && i < rows { ... }
    let _ = (rows, cols, x, y);
}
