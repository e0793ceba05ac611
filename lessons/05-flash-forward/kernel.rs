//! Lesson 5: a complete f32 flash-attention forward for one head, head dimension 32.
//!
//! `Q`, `O` are `[seq_q, 32]`, `K`, `V` are `[seq_kv, 32]`, row-major f32; `LSE` is `[seq_q]`.
//! Causal masking (when `causal != 0`) is bottom-right aligned, as everywhere in memattn: query
//! `i` sees key `j` iff `j <= i + seq_kv - seq_q`. A query that sees no key gets `O = 0` and
//! `LSE = -inf`.
//!
//! The launch: blocks of 64 threads (two warps), thread `t` of block `b` owns query row
//! `i = b * 64 + t`; `grid.x = ceil(seq_q / 64)`. 16 KiB of dynamic shared memory
//! (`dynamic_smem_f32()`): a tile of 64 K rows (floats 0..2048) and a tile of 64 V rows
//! (floats 2048..4096), each row 32 floats. Both warps fill the tiles and both read all of
//! them, so the two barriers of step 2a are what keeps one warp from reading rows the other has
//! not stored yet, or overwriting rows the other still reads: leave one out and the VM reports a
//! shared memory race with the Rust lines of both accesses.
//!
//! Steps:
//! 1. Load your query row into registers (`[f32; 32]`), multiplied by `scale * LOG2E` (base-2
//!    scores, as in lesson 4). Rows `i >= seq_q` use zeros and store nothing at the end, but
//!    still take part in every barrier.
//! 2. For each tile of keys `kv0 = 0, 64, 128, ...` while `kv0 < seq_kv`:
//!    a. `sync_threads()` (the previous tile is no longer read), then thread `t` copies K row
//!       `kv0 + t` and V row `kv0 + t` into the tiles (zeros past `seq_kv`), then
//!       `sync_threads()` (the tile is complete).
//!    b. For each key `r` of the tile: the score `s = q · K_tile[r]`, `-inf` if key `kv0 + r` is
//!       past `seq_kv` or masked; then the online-softmax update of lesson 4 with
//!       `acc += p * V_tile[r]` over 32 dimensions.
//! 3. Rows `i < seq_q` store `O[i, :] = acc / l` and `LSE[i] = ln 2 * (m + log2 l)` (or 0 and
//!    `-inf` for a row that saw nothing).
//!
//! Check it: `cargo xtask lesson 5`; the reference solution is `solution.rs`. The project's own
//! kernel (`kernels-gpu/src/flash_fwd_f32.rs`, chapter 3 of the guide) does the same with more
//! threads per row and bigger tiles.

#[allow(unused_imports)]
use crate::gpu::*;

/// # Safety
/// The pointers must be valid for the shapes above.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "ptx-kernel" fn flash_lesson_f32(
    seq_q: u32,
    seq_kv: u32,
    scale: f32,
    causal: u32,
    q: *const f32,
    k: *const f32,
    v: *const f32,
    o: *mut f32,
    lse: *mut f32,
) {
    // let t = tid_x();
    // let i = ctaid_x() * 64 + t;
    // let k_s = dynamic_smem_f32();
    // let v_s = unsafe { k_s.add(2048) };
    // Steps 1-3.
    let _ = (seq_q, seq_kv, scale, causal, q, k, v, o, lse);
}
