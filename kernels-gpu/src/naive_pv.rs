//! `naive_pv_f32`: step 3 of naive attention, `O = P V`.
//!
//! Algorithm: `O[b, i, h, d] = sum_j P[b, h, i, j] * V[b, j, h, d]` with P read from the
//! materialised workspace written by `naive_softmax_f32`.
//! Shapes: P `[batch, heads, seq_q, seq_kv]` f32; V `[batch, seq_kv, heads, d]` and
//! O `[batch, seq_q, heads, d]` strided.
//! Thread mapping: grid `(seq_q, 1, batch * heads)`, block 64; block `(i, bh)` owns output row
//! `i` of head `bh`, thread `t` computes dims `t, t + 64, ...` (coalesced V reads, P broadcast).
//!
//! # Safety
//! All pointers in `p` must be valid for the shapes and strides in `p`.

use crate::abi::AttnParams;
use crate::device::*;
use crate::tiles::NAIVE_PV_THREADS;

#[no_mangle]
pub unsafe extern "ptx-kernel" fn naive_pv_f32(p: AttnParams) {
    let i = ctaid_x();
    let bh = ctaid_z();
    if i >= p.seq_q {
        return;
    }
    if p.heads == 0 {
        return;
    }
    let (b, h) = ((bh / p.heads) as u64, (bh % p.heads) as u64);
    let prow = p.scores + 4 * (bh as u64 * p.seq_q as u64 + i as u64) * p.seq_kv as u64;
    let o = p.o + 4 * p.o_strides.offset(b, i as u64, h);
    let mut d = tid_x();
    while d < p.head_dim {
        let mut acc = 0.0f32;
        let mut j = 0u32;
        while j < p.seq_kv {
            let v = p.v + 4 * (p.v_strides.offset(b, j as u64, h) + d as u64);
            acc = fma(unsafe { ld_f32(prow + 4 * j as u64) }, unsafe { ld_f32(v) }, acc);
            j += 1;
        }
        unsafe { st_f32(o + 4 * d as u64, acc) };
        d += NAIVE_PV_THREADS;
    }
}
