//! `naive_pv_{f32,bf16,f16}`: step 3 of naive attention, `O = P V`.
//!
//! Algorithm: `O[b, i, h, d] = sum_j P[b, h, i, j] * V[b, j, h, d]` with P (f32) read from the
//! materialised workspace written by `naive_softmax_f32`, accumulated in f32 and stored in the
//! entry's element type (rounded to nearest even).
//! Shapes: P `[batch, heads, seq_q, seq_kv]` f32; V `[batch, seq_kv, heads_kv, d]` (query head
//! `h` reads V head `h / (heads / heads_kv)`) and
//! O `[batch, seq_q, heads, d]` strided, in the element type.
//! Thread mapping ([`crate::tiles::NAIVE_PV`]): grid `(seq_q, 1, batch * heads)`, block 64; block `(i, bh)` owns output row
//! `i` of head `bh`, thread `t` computes dims `t, t + 64, ...` (coalesced V reads, P broadcast).
//!
//! # Safety
//! All pointers in `p` must be valid for the shapes and strides in `p`, aligned to the element.

#[cfg(target_arch = "nvptx64")]
use crate::abi::AttnParams;
#[cfg(target_arch = "nvptx64")]
use crate::device::*;

/// The generic body; `THREADS` threads stride over the head dim (the tile item).
///
/// # Safety
/// As the module's safety section.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn pv<E: Elem, const THREADS: u32>(p: &AttnParams) {
    let i = ctaid_x();
    let bh = ctaid_z();
    if i >= p.seq_q || p.heads == 0 {
        return;
    }
    let prow = p.scores + 4 * (bh as u64 * p.seq_q as u64 + i as u64) * p.seq_kv as u64;
    // Varlen: the sequence's own view (its rows of O, its keys of V).
    let seq = unsafe { sequence_of(p, bh / p.heads) };
    let (p, b) = (&seq.p, seq.b);
    if i >= p.seq_q {
        return;
    }
    let h = (bh % p.heads) as u64;
    let hk = p.kv_head(h as u32) as u64;
    let o = p.o + E::BYTES * p.o_strides.offset(b, seq.q0 + i as u64, h);
    let mut d = tid_x();
    while d < p.head_dim {
        let mut acc = 0.0f32;
        let mut j = 0u32;
        while j < p.seq_kv {
            let v = p.v + E::BYTES * (p.v_strides.offset(b, seq.k0 + j as u64, hk) + d as u64);
            acc = fma(unsafe { ld_f32(prow + 4 * j as u64) }, unsafe { E::load(v) }, acc);
            j += 1;
        }
        unsafe { E::store(o + E::BYTES * d as u64, acc) };
        d += THREADS;
    }
}
