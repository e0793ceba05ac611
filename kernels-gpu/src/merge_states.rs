//! `merge_states_{f32,bf16,f16}`: combines partial attention results by their log-sum-exp (the
//! split-KV combine; also the building block of cascade and ring attention).
//!
//! Algorithm, per output row, over the `S` partial states `(O_s, LSE_s)` (natural log):
//! `m = max_s LSE_s` (0 if all are `-inf`), `w_s = e^(LSE_s - m)`, `W = Σ_s w_s`,
//! `LSE = m + ln W`, `O = Σ_s (w_s / W) O_s`. A row whose every split is `-inf` (no visible key)
//! gives `O = 0` and `LSE = -inf`, never NaN; a NaN (or `+inf`) `LSE_s` gives NaN in O and LSE
//! (NaN in, NaN out: the host cannot see device values before the launch). Exponentials are `ex2` of `log2 e` times the
//! difference (the same [`crate::softmax::LOG2E`] as the forward kernels).
//!
//! Shapes: see [`crate::decode_abi::MergeParams`]: f32 partials `[S, batch, heads, seq_q, D]` and
//! `[S, batch, heads, seq_q]`, O in the entry's element type with strides, LSE `[batch, heads,
//! seq_q]` f32. Any `head_dim` and any `S >= 1` (both loops run at run time).
//!
//! Tile ([`crate::tiles::MERGE`]): one warp per row, 4 rows per block (128 threads); the lanes
//! stride over the head dim by 32 (coalesced), every lane of a row reads the same `LSE_s`
//! (a broadcast). No shared memory. Grid `(ceil(batch * heads * seq_q / 4), 1, 1)`. The row guard
//! is warp-uniform.
//!
//! # Safety
//! The pointers in `p` must be valid for the shapes in `p`.

#[cfg(target_arch = "nvptx64")]
use crate::decode_abi::MergeParams;
#[cfg(target_arch = "nvptx64")]
use crate::device::*;
#[cfg(target_arch = "nvptx64")]
use crate::softmax::{LN2, LOG2E};

/// The generic body; `ROWS` rows (warps) per block.
///
/// # Safety
/// As the module's safety section.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn merge_states<E: Elem, const ROWS: u32>(p: &MergeParams) {
    let lane = tid_x() % 32;
    let row = ctaid_x() as u64 * ROWS as u64 + (tid_x() / 32) as u64;
    let rows = p.rows();
    if row >= rows {
        return;
    }
    let d = p.head_dim as u64;
    let lse_at = |s: u32| unsafe { ld_f32(p.lse_part + 4 * (s as u64 * rows + row)) };

    let mut m = f32::NEG_INFINITY;
    for s in 0..p.splits {
        m = fmax(m, lse_at(s));
    }
    let base = if m == f32::NEG_INFINITY { 0.0 } else { m };
    let mut w_sum = 0.0f32;
    for s in 0..p.splits {
        w_sum += exp2((lse_at(s) - base) * LOG2E);
    }
    // (b, h, i) of the row, for the strided O.
    let (i, bh) = (row % p.seq_q as u64, row / p.seq_q as u64);
    let (h, b) = (bh % p.heads as u64, bh / p.heads as u64);
    let oa = p.o + E::BYTES * p.o_strides.offset(b, i, h);
    // A NaN LSE (or +inf, whose weight is inf - inf) makes `w_sum` NaN: the row is then
    // written through the same path, so its O and LSE come out NaN, as FlashAttention's combine
    // gives, rather than as the `O = 0, LSE = -inf` of a row that saw no key.
    if w_sum > 0.0 || w_sum.is_nan() {
        let inv = 1.0 / w_sum;
        let mut c = lane as u64;
        while c < d {
            let mut o = 0.0f32;
            for s in 0..p.splits {
                let w = exp2((lse_at(s) - base) * LOG2E) * inv;
                o = fma(w, unsafe { ld_f32(p.o_part + 4 * ((s as u64 * rows + row) * d + c)) }, o);
            }
            unsafe { E::store(oa + E::BYTES * c, o) };
            c += 32;
        }
        if lane == 0 {
            unsafe { st_f32(p.lse + 4 * row, base + log2(w_sum) * LN2) };
        }
    } else {
        let mut c = lane as u64;
        while c < d {
            unsafe { E::store(oa + E::BYTES * c, 0.0) };
            c += 32;
        }
        if lane == 0 {
            unsafe { st_f32(p.lse + 4 * row, f32::NEG_INFINITY) };
        }
    }
}
