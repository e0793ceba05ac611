//! `naive_softmax_f32`: step 2 of naive attention, numerically stable row softmax of S in place.
//!
//! Algorithm: per row, `m = max_j S`, `l = sum_j exp(S - m)`, `P = exp(S - m) / l`, and
//! `LSE = m + ln l`; exp is computed as `ex2((S - m) * log2 e)`. A row whose scores are all `-inf`
//! (fully masked) becomes all zeros with `LSE = -inf`. With sinks (`p.sinks != 0`) the head's
//! sink logit joins the max and the denominator only: `m = max(max_j S, sink)`,
//! `l = Σ_j exp(S - m) + exp(sink - m)`, `LSE = m + ln l`; a row whose scores are all `-inf` then
//! becomes zeros with `LSE = sink`.
//! Shapes: S/P `[batch, heads, seq_q, seq_kv]` f32 in place; LSE `[batch, heads, seq_q]` f32.
//! Thread mapping ([`crate::tiles::NAIVE_SOFTMAX`]): one warp per row, lanes stride over the row by 32 and reduce with
//! `shfl.sync.bfly`; grid `(ceil(seq_q / 4), 1, batch * heads)`, block 128 (4 rows). The row
//! guard is warp-uniform, so the shuffles always see all 32 lanes.
//!
//! # Safety
//! `p.scores` and `p.lse` must be valid for the shapes in `p`.

#[cfg(target_arch = "nvptx64")]
use crate::abi::AttnParams;
#[cfg(target_arch = "nvptx64")]
use crate::device::*;

#[cfg(target_arch = "nvptx64")]
use crate::softmax::{LN2, LOG2E};

#[cfg(target_arch = "nvptx64")]
#[inline(always)]
fn warp_max(mut x: f32) -> f32 {
    let mut m = 16;
    while m > 0 {
        x = fmax(x, shfl_xor(x, m));
        m >>= 1;
    }
    x
}

#[cfg(target_arch = "nvptx64")]
#[inline(always)]
fn warp_sum(mut x: f32) -> f32 {
    let mut m = 16;
    while m > 0 {
        x += shfl_xor(x, m);
        m >>= 1;
    }
    x
}

/// The generic body; `ROWS` rows (warps) per block (the tile item).
///
/// # Safety
/// As the module's safety section.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn softmax<const ROWS: u32>(p: &AttnParams) {
    let lane = tid_x() % 32;
    let i = ctaid_x() * ROWS + tid_x() / 32;
    let bh = ctaid_z() as u64;
    if i >= p.seq_q {
        return;
    }
    let row_idx = bh * p.seq_q as u64 + i as u64;
    let row = p.scores + 4 * row_idx * p.seq_kv as u64;
    // Varlen: the sequence's lengths and LSE layout `[heads, total_q]`; warp-uniform guard.
    let seq = unsafe { sequence_of(p, (bh / p.heads.max(1) as u64) as u32) };
    let (p, b) = (&seq.p, seq.b);
    if i >= p.seq_q {
        return;
    }
    let n = p.seq_kv;

    let mut m = f32::NEG_INFINITY;
    let mut j = lane;
    while j < n {
        m = fmax(m, unsafe { ld_f32(row + 4 * j as u64) });
        j += 32;
    }
    let m = warp_max(m);
    let sink = if p.sinks != 0 && p.heads != 0 {
        unsafe { ld_f32(p.sinks + 4 * (bh % p.heads as u64)) }
    } else {
        f32::NEG_INFINITY
    };
    let m = fmax(m, sink);

    let lse_addr = p.lse + 4 * p.lse_offset(b, bh % p.heads.max(1) as u64, seq.q0 + i as u64);
    if m == f32::NEG_INFINITY {
        let mut j = lane;
        while j < n {
            unsafe { st_f32(row + 4 * j as u64, 0.0) };
            j += 32;
        }
        if lane == 0 {
            unsafe { st_f32(lse_addr, f32::NEG_INFINITY) };
        }
        return;
    }

    let m2 = m * LOG2E;
    let mut l = 0.0f32;
    let mut j = lane;
    while j < n {
        l += exp2(unsafe { ld_f32(row + 4 * j as u64) } * LOG2E - m2);
        j += 32;
    }
    let l = warp_sum(l) + exp2(sink * LOG2E - m2);
    let inv_l = 1.0 / l;
    let mut j = lane;
    while j < n {
        let a = row + 4 * j as u64;
        unsafe { st_f32(a, exp2(ld_f32(a) * LOG2E - m2) * inv_l) };
        j += 32;
    }
    if lane == 0 {
        unsafe { st_f32(lse_addr, m + log2(l) * LN2) };
    }
}
