//! Lesson 7, reference solution: a 64 x 64 bf16 tile staged in shared memory with the XOR
//! swizzle, read back with `ldmatrix` without bank conflicts.

use crate::gpu::mma::{cp_async_16, cp_async_commit, cp_async_wait_all, global_addr, ldmatrix_x4, smem_addr};
use crate::gpu::*;

/// Where chunk `chunk` (16 bytes, 8 bf16) of row `row` lies in the shared tile, in chunks.
fn slot(row: usize, chunk: usize) -> usize {
    row * 8 + (chunk ^ (row % 8))
}

/// # Safety
/// The pointers must be valid for the shapes in `kernel.rs`; one block of one warp.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn swizzle_tile_bf16(k: *const u16, frag: *mut u32) {
    let lane = tid_x() as usize;
    let k_s = dynamic_smem_u16();
    // Step 1: 512 chunks of 16 bytes, 16 per lane; consecutive lanes copy consecutive chunks.
    for i in 0..16 {
        let c = i * 32 + lane;
        let (row, chunk) = (c / 8, c % 8);
        unsafe { cp_async_16(smem_addr(k_s.add(slot(row, chunk) * 8)), global_addr(k.add(c * 8) as u64), 16) };
    }
    cp_async_commit();
    cp_async_wait_all();
    sync_threads();
    // Step 2: 8 row groups x 2 halves; lane l names row rg * 8 + l % 8, chunk half * 4 + l / 8.
    for rg in 0..8 {
        for half in 0..2 {
            let (row, chunk) = (rg * 8 + lane % 8, half * 4 + lane / 8);
            let r = unsafe { ldmatrix_x4(smem_addr(k_s.add(slot(row, chunk) * 8))) };
            // Step 3.
            for (m, x) in r.iter().enumerate() {
                unsafe { *frag.add(((rg * 2 + half) * 32 + lane) * 4 + m) = *x };
            }
        }
    }
}
