//! Lesson 6, reference solution: one tensor-core tile of scores, `S = Q Kᵀ` with one
//! `mma.sync.m16n8k16` (bf16 inputs, f32 accumulation), its operands loaded with `ldmatrix`.

use crate::gpu::frag::{acc_col, acc_row, ldsm_a_lane, ldsm_b_lane};
use crate::gpu::mma::{ldmatrix_x4, smem_addr, Bf16, Half16};
use crate::gpu::*;

/// # Safety
/// The pointers must be valid for the shapes in `kernel.rs`; one block of one warp.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn qk_mma_bf16(
    q: *const u16,
    k: *const u16,
    s: *mut f32,
    frag_a: *mut u32,
    frag_b: *mut u32,
) {
    let lane = tid_x() as usize;
    let q_s = dynamic_smem_u16();
    let k_s = unsafe { q_s.add(256) };
    // Step 1: Q is 128 words of two bf16, K 64: four and two words per lane.
    for w in 0..4 {
        let at = w * 32 + lane;
        unsafe { *(q_s as *mut u32).add(at) = *(q as *const u32).add(at) };
    }
    for w in 0..2 {
        let at = w * 32 + lane;
        unsafe { *(k_s as *mut u32).add(at) = *(k as *const u32).add(at) };
    }
    sync_threads();
    // Step 2: the A operand, four 8 x 8 matrices of Q.
    let (row, chunk) = ldsm_a_lane(lane);
    let a = unsafe { ldmatrix_x4(smem_addr(q_s.add(row * 16 + chunk * 8))) };
    // Step 3: the B operand; with one 8-key tile, lanes 16-31 repeat the rows of lanes 0-15.
    let (key, chunk) = ldsm_b_lane(lane);
    let b = unsafe { ldmatrix_x4(smem_addr(k_s.add((key % 8) * 16 + chunk * 8))) };
    // Step 4.
    let mut d = [0.0f32; 4];
    Bf16::mma(&mut d, &a, b[0], b[1]);
    // Step 5.
    for (r, x) in a.iter().enumerate() {
        unsafe { *frag_a.add(lane * 4 + r) = *x };
    }
    for r in 0..2 {
        unsafe { *frag_b.add(lane * 2 + r) = b[r] };
    }
    let (g, t) = (lane / 4, lane % 4);
    for (e, x) in d.iter().enumerate() {
        let (i, j) = (g + 8 * acc_row(e), 2 * t + acc_col(0, e));
        unsafe { *s.add(i * 8 + j) = *x };
    }
}
