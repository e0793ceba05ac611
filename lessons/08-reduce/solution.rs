//! Lesson 8, reference solution: `total += sum of x[0..n]`, one atomic add per block.

use crate::gpu::*;

/// Threads per block: the launch's block size and the length of the shared array.
const B: u32 = 256;

/// # Safety
/// `x` must point to `n` f32s and `total` to one f32 in device memory; blocks of 256 threads and
/// 1 KiB of dynamic shared memory.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn block_sum_f32(n: u32, x: *const f32, total: *mut f32) {
    let t = tid_x();
    // Step 1: a grid-stride loop; the stride is every thread of the grid.
    let mut i = ctaid_x() * B + t;
    let mut acc = 0.0f32;
    while i < n {
        acc += unsafe { *x.add(i as usize) };
        i += B * nctaid_x();
    }
    // Step 2.
    let s = dynamic_smem_f32();
    unsafe { *s.add(t as usize) = acc };
    sync_threads();
    // Step 3: halve the active threads each round; every thread reaches every barrier.
    let mut half = B / 2;
    while half > 0 {
        if t < half {
            unsafe { *s.add(t as usize) += *s.add((t + half) as usize) };
        }
        sync_threads();
        half /= 2;
    }
    // Step 4: one atomic add per block.
    if t == 0 {
        unsafe { red_add_f32(total, *s) };
    }
}
