//! Lesson 3: scores with tiles in shared memory, `S[i, j] = scale * sum_c Q[i, c] * K[j, c]`.
//!
//! `Q` is `[n, d]`, `K` is `[m, d]`, `S` is `[n, m]`, all row-major f32; `n`, `m` and `d` are
//! arbitrary (not multiples of 16). A block of 16 x 16 threads computes a 16 x 16 tile of `S`:
//! thread `(tx, ty)` = `(tid_x(), tid_y())` computes `S[i, j]` with
//! `i = ctaid_y() * 16 + ty` and `j = ctaid_x() * 16 + tx`; `grid = (ceil(m / 16), ceil(n / 16))`.
//! The launch gives 2 KiB of dynamic shared memory (`dynamic_smem_f32()`): a 16 x 16 tile of `Q`
//! (floats 0..256) followed by a 16 x 16 tile of `K` (floats 256..512).
//!
//! Steps, for each chunk of 16 dimensions `c0 = 0, 16, 32, ...` while `c0 < d`:
//! 1. Every thread loads one element of each tile: `Qs[ty][tx] = Q[i, c0 + tx]` and
//!    `Ks[ty][tx] = K[ctaid_x() * 16 + ty, c0 + tx]`, or `0.0` where the index is past `n`, `m` or
//!    `d` (those zeros add nothing to the sum).
//! 2. `sync_threads()`: wait until the whole tile is written before anyone reads it.
//! 3. Accumulate `acc += Qs[ty][k] * Ks[tx][k]` for `k` in `0..16`.
//! 4. `sync_threads()` again: nobody may overwrite the tiles with the next chunk while others
//!    still read them.
//!
//! Finally threads with `i < n` and `j < m` store `scale * acc`. Every thread — also those past
//! the edge — must take part in every barrier.
//!
//! Check it: `cargo xtask lesson 3`; the reference solution is `solution.rs`.

#[allow(unused_imports)]
use crate::gpu::*;

/// # Safety
/// `q` must point to `n * d`, `k` to `m * d` and `s` to `n * m` f32s.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn qk_tiled_f32(
    n: u32,
    m: u32,
    d: u32,
    scale: f32,
    q: *const f32,
    k: *const f32,
    s: *mut f32,
) {
    // let (tx, ty) = (tid_x(), tid_y());
    // let i = ctaid_y() * 16 + ty;
    // let j = ctaid_x() * 16 + tx;
    // let qs = dynamic_smem_f32();                 // 16 x 16 tile of Q
    // let ks = unsafe { qs.add(256) };       // 16 x 16 tile of K
    // let mut acc = 0.0f32;
    // Steps 1-4 for every chunk of 16 dimensions, then the store.
    let _ = (n, m, d, scale, q, k, s);
}
