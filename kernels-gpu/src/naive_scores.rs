//! `naive_scores_{f32,bf16,f16}`: step 1 of naive attention, `S = scale * Q Kᵀ` (materialised).
//!
//! Algorithm: every score is an independent dot product over `head_dim`, read straight from global
//! memory and accumulated in f32 (fma); scores outside the query's window (causal = right 0,
//! `docs/semantics.md`) are stored as `-inf` so the softmax needs no mask; with a soft cap `c > 0`
//! the score is `c · tanh(scale · q·k / c)`; ALiBi adds `-slope · |i + seq_kv - seq_q - j|`. Query head `h` reads K head `h / (heads / heads_kv)`.
//! Shapes: Q `[batch, seq_q, heads, d]`, K `[batch, seq_kv, heads_kv, d]` in the entry's element type
//! (strided, see [`crate::abi::Strides`]); S `[batch, heads, seq_q, seq_kv]` **f32** for every
//! element type, contiguous — the `4 * batch * heads * seq_q * seq_kv` bytes that memory-efficient
//! attention avoids.
//! Thread mapping ([`crate::tiles::NAIVE_SCORES`]): grid `(seq_q, ceil(seq_kv / 128), batch * heads)`,
//! block 128; block `(i, jt, bh)` computes `S[bh, i, jt*128 + tid]`. No shared memory.
//!
//! # Safety
//! All pointers in `p` must be valid for the shapes and strides in `p`, aligned to the element.

#[cfg(target_arch = "nvptx64")]
use crate::abi::AttnParams;
#[cfg(target_arch = "nvptx64")]
use crate::device::*;
#[cfg(target_arch = "nvptx64")]
use crate::softmax::{softcap2, LN2, LOG2E};

/// The generic body; `THREADS` keys of one query row per block (the tile item).
///
/// # Safety
/// As the module's safety section.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn scores<E: Elem, const THREADS: u32>(p: &AttnParams) {
    let i = ctaid_x();
    let j = ctaid_y() * THREADS + tid_x();
    let bh = ctaid_z();
    if i >= p.seq_q || j >= p.seq_kv || p.heads == 0 {
        return;
    }
    // S is [batch, heads, seq_q, seq_kv] with the longest lengths (varlen too); the sequence's own
    // view addresses Q and K and masks.
    let out = p.scores + 4 * ((bh as u64 * p.seq_q as u64 + i as u64) * p.seq_kv as u64 + j as u64);
    let seq = unsafe { sequence_of(p, bh / p.heads) };
    let (p, b) = (&seq.p, seq.b);
    let h = (bh % p.heads) as u64;
    if i >= p.seq_q || j >= p.seq_kv {
        return; // past this sequence: never read
    }
    let (start, end) = p.key_range(i);
    let s = if (j as i64) >= start && (j as i64) < end {
        let q = p.q + E::BYTES * p.q_strides.offset(b, seq.q0 + i as u64, h);
        let k = p.k + E::BYTES * p.k_strides.offset(b, seq.k0 + j as u64, p.kv_head(h as u32) as u64);
        let mut acc = 0.0f32;
        let mut d = 0u64;
        while d < p.head_dim as u64 {
            acc = fma(unsafe { E::load(q + E::BYTES * d) }, unsafe { E::load(k + E::BYTES * d) }, acc);
            d += 1;
        }
        let s = if p.softcap > 0.0 {
            softcap2(acc * (p.softmax_scale / p.softcap), p.softcap * LOG2E) * LN2
        } else {
            acc * p.softmax_scale
        };
        // ALiBi: -slope · |i + seq_kv - seq_q - j|.
        let slope = unsafe { alibi_slope(p.alibi_slopes, p.alibi_batch_stride, bh / p.heads, h as u32) };
        fma(-slope, alibi_distance(i as i32 + p.seq_kv as i32 - p.seq_q as i32, j as i32), s)
    } else {
        f32::NEG_INFINITY
    };
    unsafe { st_f32(out, s) };
}
