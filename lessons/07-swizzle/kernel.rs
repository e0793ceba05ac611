//! Lesson 7: a swizzled shared tile. The kernel below is correct: it stages a 64 x 64 bf16 tile
//! `K` (row-major, `u16` bit patterns) in shared memory and reads it back with `ldmatrix_x4`, as
//! the tensor-core kernel stages K and V. But it is slow: the checker counts the shared-memory
//! wavefronts of every `ldmatrix` and finds an 8-way bank conflict. Make it conflict-free.
//!
//! Shared memory has 32 banks of 4 bytes; byte `a` is in bank `(a / 4) % 32`. A row of the tile
//! is 128 bytes, 8 chunks of 16 bytes (8 bf16). One `ldmatrix` phase reads 8 rows of 16 bytes,
//! here the same chunk of 8 consecutive rows: 128 bytes apart, so all 8 fall in the same 4
//! banks, and the phase takes 8 wavefronts instead of 1.
//!
//! Steps:
//! 1. Change `slot()` to the XOR swizzle: chunk `c` of row `r` goes to chunk position
//!    `c ^ (r % 8)` of its row. The 8 rows of a phase then use 8 different chunk positions,
//!    32 different banks. Nothing else has to change: the copy and the `ldmatrix` both find a
//!    chunk through `slot()`.
//! 2. (Already done.) `ldmatrix_x4` for 8 row groups `rg` and 2 halves: lane `l` names row
//!    `rg * 8 + l % 8`, chunk `half * 4 + l / 8`; matrix `m` is chunk `half * 4 + m`.
//! 3. (Already done.) Store the registers: `frag[((rg * 2 + half) * 32 + lane) * 4 + m] = r[m]`.
//!
//! Check it: `cargo xtask lesson 7`: the checker compares every register with the layout, then
//! prints the wavefronts per line and the minimum. The reference solution is `solution.rs`; the
//! project's own swizzle is `kernels-gpu/src/swizzle.rs` (guide chapter 4).

#[allow(unused_imports)]
use crate::gpu::mma::{cp_async_16, cp_async_commit, cp_async_wait_all, global_addr, ldmatrix_x4, smem_addr};
#[allow(unused_imports)]
use crate::gpu::*;

/// Where chunk `chunk` (16 bytes, 8 bf16) of row `row` lies in the shared tile, in chunks.
fn slot(row: usize, chunk: usize) -> usize {
    // Step 1: the XOR swizzle.
    row * 8 + chunk
}

/// # Safety
/// The pointers must be valid for the shapes above; one block of one warp, 8192 bytes of
/// dynamic shared memory.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn swizzle_tile_bf16(k: *const u16, frag: *mut u32) {
    let lane = tid_x() as usize;
    let k_s = dynamic_smem_u16();
    // 512 chunks of 16 bytes, 16 per lane; consecutive lanes copy consecutive chunks.
    for i in 0..16 {
        let c = i * 32 + lane;
        let (row, chunk) = (c / 8, c % 8);
        unsafe { cp_async_16(smem_addr(k_s.add(slot(row, chunk) * 8)), global_addr(k.add(c * 8) as u64), 16) };
    }
    cp_async_commit();
    cp_async_wait_all();
    sync_threads();
    // Step 2.
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
