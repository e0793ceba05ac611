//! Lesson 1, reference solution: a scaled copy, `y[i] = a * x[i]` for `i < n`.

use crate::gpu::*;

/// # Safety
/// `x` and `y` must point to at least `n` f32s in device memory.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn scale_f32(n: u32, a: f32, x: *const f32, y: *mut f32) {
    // Step 1: one thread per element.
    let i = ctaid_x() * ntid_x() + tid_x();
    // Step 2: the last block has threads past the end.
    if i < n {
        // Step 3.
        unsafe { *y.add(i as usize) = a * *x.add(i as usize) };
    }
}
