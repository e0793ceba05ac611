//! Lesson 9, reference solution: `y = xᵀ`, both global accesses along rows, the turn in a
//! shared tile of 32 rows of 33 floats.

use crate::gpu::*;

/// The tile edge: a warp's 32 lanes along a row.
const T: u32 = 32;
/// A tile row in shared memory: 33 floats, so that a column of the tile lies in 32 banks.
const ROW: u32 = T + 1;

/// # Safety
/// `x` must point to `rows * cols` f32s and `y` to `cols * rows` f32s in device memory; blocks of
/// 32 x 32 threads, a grid of `cols.div_ceil(32)` x `rows.div_ceil(32)` blocks, 4224 bytes of
/// dynamic shared memory.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn transpose_f32(rows: u32, cols: u32, x: *const f32, y: *mut f32) {
    let tile = dynamic_smem_f32();
    let (tx, ty) = (tid_x(), tid_y());
    // Step 1: the lanes read neighbours in a row of x.
    let (r, c) = (ctaid_y() * T + ty, ctaid_x() * T + tx);
    if r < rows && c < cols {
        unsafe { *tile.add((ty * ROW + tx) as usize) = *x.add((r * cols + c) as usize) };
    }
    // Step 2: every thread, those past the edge too.
    sync_threads();
    // Step 3: the lanes write neighbours in a row of y, y[j][i] = x[i][j], read across the tile.
    let (j, i) = (ctaid_x() * T + ty, ctaid_y() * T + tx);
    if j < cols && i < rows {
        unsafe { *y.add((j * rows + i) as usize) = *tile.add((tx * ROW + ty) as usize) };
    }
}
