//! Lesson 6: one tile of scores on the tensor cores, `S = Q Kᵀ`, with one
//! `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` (bf16 inputs, f32 accumulation).
//!
//! `Q` is `[16, 16]` and `K` is `[8, 16]` (8 keys, head dimension 16), row-major bf16 (`u16` bit
//! patterns); `S` is `[16, 8]` f32. One block of one warp (32 lanes); 768 bytes of dynamic shared
//! memory (`dynamic_smem_u16()`): Q (values 0..256) then K (values 256..384). The lanes hold the
//! operands as fragments, lane `l` in group `g = l / 4` with `t = l % 4`; a register holds two
//! bf16, the smaller column in its low half:
//! - A (Q): `a0` = Q[g, 2t..2t+1], `a1` = Q[g+8, 2t..2t+1], `a2` = Q[g, 2t+8..2t+9],
//!   `a3` = Q[g+8, 2t+8..2t+9];
//! - B (Kᵀ, 16 x 8): `b0` = K[g, 2t..2t+1], `b1` = K[g, 2t+8..2t+9];
//! - D (S, f32): `d0` = S[g, 2t], `d1` = S[g, 2t+1], `d2` = S[g+8, 2t], `d3` = S[g+8, 2t+1].
//!
//! Steps (the helpers are memattn's own, `kernels-gpu/src/mma.rs` and `frag.rs`, as
//! `crate::gpu::mma` and `crate::gpu::frag`):
//! 1. Copy Q and K into shared memory, as `u32` words (two bf16 each): 128 words of Q and 64 of K,
//!    word `w * 32 + lane` for each lane; then `sync_threads()`.
//! 2. A: `let (row, chunk) = ldsm_a_lane(lane)`; `a = ldmatrix_x4(smem_addr(q_s + row * 16 +
//!    chunk * 8))`: each lane names one 16-byte row, and `ldmatrix` deals the four 8 x 8
//!    matrices out to the lanes in the layout above.
//! 3. B: `let (key, chunk) = ldsm_b_lane(lane)`; `ldmatrix_x4` at `k_s + (key % 8) * 16 +
//!    chunk * 8` gives `b0 = r[0]`, `b1 = r[1]` (the helper addresses two 8-key tiles; with one,
//!    lanes 16-31 repeat lanes 0-15 and `r[2]`, `r[3]` are not used).
//! 4. `let mut d = [0.0f32; 4]; Bf16::mma(&mut d, &a, b0, b1)`: every lane executes it together.
//! 5. Store the fragments for the checker, `frag_a[lane * 4 + r] = a[r]`,
//!    `frag_b[lane * 2 + r] = b[r]`, and `S[g + 8 * (e / 2), 2t + e % 2] = d[e]`
//!    (`frag::acc_row`, `frag::acc_col`).
//!
//! Check it: `cargo xtask lesson 6`; the checker compares every lane's registers with the
//! layout and names the first lane and register that differ. The reference solution is
//! `solution.rs`; the project's tensor-core kernel (`kernels-gpu/src/flash_fwd_mma.rs`, chapter
//! 4 of the guide) computes S this way, 16 query rows per warp.

#[allow(unused_imports)]
use crate::gpu::frag::{acc_col, acc_row, ldsm_a_lane, ldsm_b_lane};
#[allow(unused_imports)]
use crate::gpu::mma::{ldmatrix_x4, smem_addr, Bf16, Half16};
#[allow(unused_imports)]
use crate::gpu::*;

/// # Safety
/// The pointers must be valid for the shapes above; one block of one warp.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn qk_mma_bf16(
    q: *const u16,
    k: *const u16,
    s: *mut f32,
    frag_a: *mut u32,
    frag_b: *mut u32,
) {
    // let lane = tid_x() as usize;
    // let q_s = dynamic_smem_u16();
    // let k_s = unsafe { q_s.add(256) };
    // Steps 1-5.
    let _ = (q, k, s, frag_a, frag_b);
}
