//! Lesson 4: the online-softmax update. For every row `r`, in ONE pass over the scores:
//! `O[r, :] = sum_j softmax(S[r, :])_j * V[j, :]` and `LSE[r] = ln sum_j exp(S[r, j])`.
//!
//! `S` is `[rows, n]`, `V` is `[n, 4]`, `O` is `[rows, 4]`, `LSE` is `[rows]`, all f32. One
//! thread per row, blocks of 64 threads, `grid.x = ceil(rows / 64)`. Scores can be `-inf`
//! (masked keys); some rows are masked completely.
//!
//! Keep three running values while walking `j = 0..n` (work in base 2: `s2 = S[r, j] * LOG2E`):
//! - `m`, the largest `s2` so far (start at `-inf`);
//! - `l`, the sum of `2^(s2 - m)` so far (start at 0);
//! - `acc[0..4]`, the sum of `2^(s2 - m) * V[j, :]` so far (start at 0).
//!
//! Steps for each score:
//! 1. `m_new = max_f32(m, s2)`. While `m_new` is still `-inf` (nothing seen yet) use 0 as the base:
//!    `-inf - (-inf)` would be NaN.
//! 2. Rescale: `alpha = 2^(m - base)`; `l *= alpha`; `acc *= alpha` (what was summed under the
//!    old maximum is too large by that factor).
//! 3. Accumulate: `p = 2^(s2 - base)`; `l += p`; `acc += p * V[j, :]`; `m = m_new`.
//!
//! Finally `O[r, :] = acc / l` and `LSE[r] = ln 2 * (m + log2 l)`. A row that saw no key (`l` is
//! 0) must give `O = 0` and `LSE = -inf`, not NaN — the rule every kernel in memattn follows.
//!
//! Check it: `cargo xtask lesson 4`; the reference solution is `solution.rs`.

#[allow(unused_imports)]
use crate::gpu::*;

/// # Safety
/// `s` must point to `rows * n`, `v` to `n * 4`, `o` to `rows * 4` and `lse` to `rows` f32s.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn online_softmax_pv_f32(
    rows: u32,
    n: u32,
    s: *const f32,
    v: *const f32,
    o: *mut f32,
    lse: *mut f32,
) {
    // let r = ctaid_x() * ntid_x() + tid_x();
    // if r >= rows { return; }
    // let (mut m, mut l, mut acc) = (f32::NEG_INFINITY, 0.0f32, [0.0f32; 4]);
    // for j in 0..n { steps 1-3 }
    // finalise O and LSE
    let _ = (rows, n, s, v, o, lse);
}
