//! Lesson 2, reference solution: row softmax, one warp per row, reductions with shuffles.

use crate::gpu::*;

#[inline(always)]
fn warp_max(mut v: f32) -> f32 {
    let mut m = 16;
    while m > 0 {
        v = max_f32(v, shfl_xor(v, m));
        m >>= 1;
    }
    v
}

#[inline(always)]
fn warp_sum(mut v: f32) -> f32 {
    let mut m = 16;
    while m > 0 {
        v += shfl_xor(v, m);
        m >>= 1;
    }
    v
}

/// # Safety
/// `x` and `y` must point to `rows * cols` f32s.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn row_softmax_f32(rows: u32, cols: u32, x: *const f32, y: *mut f32) {
    // Step 1: the row test is the same for all 32 lanes of a warp.
    let lane = tid_x() % 32;
    let row = ctaid_x() * 4 + tid_x() / 32;
    if row >= rows {
        return;
    }
    let x = unsafe { x.add((row * cols) as usize) };
    let y = unsafe { y.add((row * cols) as usize) };
    // Step 2.
    let mut m = f32::NEG_INFINITY;
    let mut j = lane;
    while j < cols {
        m = max_f32(m, unsafe { *x.add(j as usize) });
        j += 32;
    }
    let m = warp_max(m);
    // Step 3.
    let mut l = 0.0f32;
    let mut j = lane;
    while j < cols {
        l += exp2((unsafe { *x.add(j as usize) } - m) * LOG2E);
        j += 32;
    }
    let inv_l = 1.0 / warp_sum(l);
    // Step 4.
    let mut j = lane;
    while j < cols {
        unsafe { *y.add(j as usize) = exp2((*x.add(j as usize) - m) * LOG2E) * inv_l };
        j += 32;
    }
}
