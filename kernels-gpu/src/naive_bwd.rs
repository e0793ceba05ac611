//! `naive_bwd_*_f32`: the backward of naive attention, with P and dS materialised (`N x N` per
//! head, f32), the baseline the fused backward ([`crate::flash_bwd_f32`]) is measured against.
//! Four kernels launched in order on one stream, each a plain loop over global memory:
//!
//! 1. **P** (`naive_bwd_p_f32`): `P_ij = exp(s_ij - LSE_i)` from the forward's LSE (natural
//!    log, the sink included), the score `s` recomputed from q and k as the forward computes it
//!    (scale, soft cap `c · tanh(scale · q·k / c)`); 0 where row `i` does not see key `j` (the
//!    window rule [`crate::mask::key_range`], bottom-right aligned) and in a row whose LSE is
//!    `-inf` (it sees no key and has no sink).
//! 2. **dS** (`naive_bwd_ds_f32`): per row `D_i = rowsum(dO_i ∘ O_i)`, then per key
//!    `dS_ij = P_ij (dO_i · v_j - D_i)`, stored times `ds/dx` (the scale, with a soft cap
//!    `scale · (1 - tanh²)`, the raw dot product recomputed for it): the gradient of
//!    `x_ij = q_i · k_j`. An entry with `P_ij = 0` is 0 without its dot product.
//! 3. **dQ** (`naive_bwd_dq_f32`): `dQ_i = Σ_j dS_ij k_j`.
//! 4. **dK, dV** (`naive_bwd_dkv_f32`): `dK_j = Σ_h Σ_i dS_hij q_hi` and
//!    `dV_j = Σ_h Σ_i P_hij dO_hi`, the sums over `h` the query heads that read K/V head
//!    `hk` (GQA: `h / (heads / heads_kv) = hk`), so no atomics.
//!
//! Sinks need nothing more: LSE includes the sink, so P is right (the sink's own gradient is
//! not computed here; the library refuses to be asked for it).
//!
//! Shapes: Q, O, dO, dQ `[batch, seq_q, heads, d]`, K, V, dK, dV `[batch, seq_kv, heads_kv,
//! d]`, f32, strided ([`crate::abi::Strides`]); LSE `[batch, heads, seq_q]`; P and dS
//! `[batch, heads, seq_q, seq_kv]` f32, contiguous ([`crate::abi::NaiveBwdParams`]): the
//! `2 · 4 · batch · heads · seq_q · seq_kv` bytes the fused backward avoids. Varlen: per sequence
//! (`device::sequence_of`), the matrices padded to the longest lengths as the forward's scores.
//!
//! Thread mapping (tile items [`crate::tiles::NAIVE_BWD_P`], [`crate::tiles::NAIVE_BWD_DS`],
//! [`crate::tiles::NAIVE_BWD_DQ`], [`crate::tiles::NAIVE_BWD_DKV`]; no shared memory):
//! P: grid `(seq_q, ceil(seq_kv / 128), batch * heads)`, one thread per element. dS: one warp
//! per row (each lane sums D itself, lanes stride over the keys), 4 rows per block, grid
//! `(ceil(seq_q / 4), 1, batch * heads)`. dQ: grid `(seq_q, 1, batch * heads)`, 64 threads
//! striding over d (P-like rows broadcast, K reads coalesced). dK, dV: grid
//! `(seq_kv, 1, batch * heads_kv)`, 64 threads striding over d, the column `j` of P and dS
//! broadcast.
//!
//! # Safety
//! All pointers in the parameters must be valid for their shapes and strides, P and dS private
//! to the call, and the kernels launched in the order above with the variants' launch geometry.

#[cfg(target_arch = "nvptx64")]
use crate::abi::{AttnParams, NaiveBwdParams, Sequence};
#[cfg(target_arch = "nvptx64")]
use crate::device::*;
#[cfg(target_arch = "nvptx64")]
use crate::softmax::{tanh, LOG2E};

/// `(s, ds/dx)` of query row `i` (of the sequence) against key `j`, head `h`: `s = scale · x`
/// and `ds/dx = scale`, or with a soft cap `s = c · tanh(scale · x / c)` and
/// `ds/dx = scale · (1 - tanh²)`, for `x = q_i · k_j` accumulated in f32 (fma), as the
/// forward's scores.
///
/// # Safety
/// As the module's safety section.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
unsafe fn score(seq: &Sequence, h: u64, i: u32, j: u32) -> (f32, f32) {
    let (p, b): (&AttnParams, u64) = (&seq.p, seq.b);
    let q = p.q + 4 * p.q_strides.offset(b, seq.q0 + i as u64, h);
    let k = p.k + 4 * p.k_strides.offset(b, seq.k0 + j as u64, p.kv_head(h as u32) as u64);
    let mut x = 0.0f32;
    let mut d = 0u64;
    while d < p.head_dim as u64 {
        x = fma(unsafe { ld_f32(q + 4 * d) }, unsafe { ld_f32(k + 4 * d) }, x);
        d += 1;
    }
    let scale = p.softmax_scale;
    if p.softcap > 0.0 {
        let th = tanh(x * (scale / p.softcap));
        (p.softcap * th, scale * (1.0 - th * th))
    } else {
        (x * scale, scale)
    }
}

/// Element `(bh, i, j)` of a `[batch, heads, seq_q, seq_kv]` matrix (the grid's longest
/// lengths), as a byte offset.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
fn matrix_offset(p: &AttnParams, bh: u64, i: u32, j: u32) -> u64 {
    4 * ((bh * p.seq_q as u64 + i as u64) * p.seq_kv as u64 + j as u64)
}

/// Step 1: `P_ij = exp(s_ij - LSE_i)`, 0 where the row does not see the key or sees nothing.
///
/// # Safety
/// As the module's safety section.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn probs<const THREADS: u32>(np: &NaiveBwdParams) {
    let p0 = &np.bwd.attn;
    let i = ctaid_x();
    let j = ctaid_y() * THREADS + tid_x();
    let bh = ctaid_z();
    if i >= p0.seq_q || j >= p0.seq_kv || p0.heads == 0 {
        return;
    }
    let out = p0.scores + matrix_offset(p0, bh as u64, i, j);
    let seq = unsafe { sequence_of(p0, bh / p0.heads) };
    let p = &seq.p;
    let h = (bh % p.heads) as u64;
    if i >= p.seq_q || j >= p.seq_kv {
        return; // past this sequence: never read
    }
    let (start, end) = p.key_range(i);
    let pr = if (j as i64) >= start && (j as i64) < end {
        let lse = unsafe { ld_f32(p.lse + 4 * p.lse_offset(seq.b, h, seq.q0 + i as u64)) };
        if lse == f32::NEG_INFINITY {
            0.0
        } else {
            let (s, _) = unsafe { score(&seq, h, i, j) };
            exp2(s * LOG2E - lse * LOG2E)
        }
    } else {
        0.0
    };
    unsafe { st_f32(out, pr) };
}

/// Step 2: `D_i`, then the row's `dS_ij · ds/dx`, one warp per row.
///
/// # Safety
/// As the module's safety section; step 1 has finished.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn ds<const ROWS: u32>(np: &NaiveBwdParams) {
    let (bp, p0) = (&np.bwd, &np.bwd.attn);
    let lane = tid_x() % 32;
    let i = ctaid_x() * ROWS + tid_x() / 32;
    let bh = ctaid_z() as u64;
    if i >= p0.seq_q || p0.heads == 0 {
        return;
    }
    let (prow, dsrow) = (p0.scores + matrix_offset(p0, bh, i, 0), np.ds + matrix_offset(p0, bh, i, 0));
    let seq = unsafe { sequence_of(p0, (bh / p0.heads as u64) as u32) };
    let (p, b) = (&seq.p, seq.b);
    if i >= p.seq_q {
        return;
    }
    let h = bh % p.heads as u64;
    let hk = p.kv_head(h as u32) as u64;
    let row = seq.q0 + i as u64;
    let oa = p.o + 4 * p.o_strides.offset(b, row, h);
    let da = bp.d_o + 4 * bp.d_o_strides.offset(b, row, h);
    // D by every lane, in the order of the dot products `dO · v` below: where O is one value
    // row (a row that sees one key), `dP - D` is then exactly 0, as it is analytically, instead
    // of a rounding difference of two summation orders (measured 4e-5 of dq's scale at seq 1).
    let mut dd = 0.0f32;
    let mut c = 0u64;
    while c < p.head_dim as u64 {
        dd = unsafe { fma(ld_f32(da + 4 * c), ld_f32(oa + 4 * c), dd) };
        c += 1;
    }
    let mut j = lane;
    while j < p.seq_kv {
        let pr = unsafe { ld_f32(prow + 4 * j as u64) };
        let g = if pr == 0.0 {
            0.0
        } else {
            let va = p.v + 4 * p.v_strides.offset(b, seq.k0 + j as u64, hk);
            let mut dp = 0.0f32;
            let mut c = 0u64;
            while c < p.head_dim as u64 {
                dp = unsafe { fma(ld_f32(da + 4 * c), ld_f32(va + 4 * c), dp) };
                c += 1;
            }
            let dsdx = if p.softcap > 0.0 { unsafe { score(&seq, h, i, j) }.1 } else { p.softmax_scale };
            pr * (dp - dd) * dsdx
        };
        unsafe { st_f32(dsrow + 4 * j as u64, g) };
        j += 32;
    }
}

/// Step 3: `dQ_i = Σ_j dS_ij k_j`, thread `t` owning dims `t, t + THREADS, ...`.
///
/// # Safety
/// As the module's safety section; step 2 has finished.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn dq<const THREADS: u32>(np: &NaiveBwdParams) {
    let (bp, p0) = (&np.bwd, &np.bwd.attn);
    let i = ctaid_x();
    let bh = ctaid_z();
    if i >= p0.seq_q || p0.heads == 0 {
        return;
    }
    let dsrow = np.ds + matrix_offset(p0, bh as u64, i, 0);
    let seq = unsafe { sequence_of(p0, bh / p0.heads) };
    let (p, b) = (&seq.p, seq.b);
    if i >= p.seq_q {
        return;
    }
    let h = (bh % p.heads) as u64;
    let hk = p.kv_head(h as u32) as u64;
    let out = bp.dq + 4 * bp.dq_strides.offset(b, seq.q0 + i as u64, h);
    let mut d = tid_x();
    while d < p.head_dim {
        let mut acc = 0.0f32;
        let mut j = 0u32;
        while j < p.seq_kv {
            let k = p.k + 4 * (p.k_strides.offset(b, seq.k0 + j as u64, hk) + d as u64);
            acc = unsafe { fma(ld_f32(dsrow + 4 * j as u64), ld_f32(k), acc) };
            j += 1;
        }
        unsafe { st_f32(out + 4 * d as u64, acc) };
        d += THREADS;
    }
}

/// Step 4: `dK_j = Σ_h Σ_i dS_hij q_hi`, `dV_j = Σ_h Σ_i P_hij dO_hi` over the query heads `h`
/// of K/V head `hk`, thread `t` owning dims `t, t + THREADS, ...`.
///
/// # Safety
/// As the module's safety section; step 2 has finished.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn dkv<const THREADS: u32>(np: &NaiveBwdParams) {
    let (bp, p0) = (&np.bwd, &np.bwd.attn);
    let j = ctaid_x();
    let bhk = ctaid_z();
    if j >= p0.seq_kv || p0.heads == 0 {
        return;
    }
    let heads_kv = if p0.heads_kv != 0 && p0.heads_kv <= p0.heads { p0.heads_kv } else { p0.heads };
    let group = p0.heads / heads_kv;
    let z = bhk / heads_kv; // the batch (varlen: sequence) index of the matrices
    let seq = unsafe { sequence_of(p0, z) };
    let (p, b) = (&seq.p, seq.b);
    if j >= p.seq_kv {
        return;
    }
    let hk = (bhk % heads_kv) as u64;
    let key = seq.k0 + j as u64;
    let (dka, dva) = (bp.dk + 4 * bp.dk_strides.offset(b, key, hk), bp.dv + 4 * bp.dv_strides.offset(b, key, hk));
    let mut d = tid_x();
    while d < p.head_dim {
        let (mut dk, mut dv) = (0.0f32, 0.0f32);
        let mut h = hk * group as u64;
        while h < (hk + 1) * group as u64 {
            let bh = z as u64 * p.heads as u64 + h;
            let mut i = 0u32;
            while i < p.seq_q {
                let e = matrix_offset(p0, bh, i, j);
                let row = seq.q0 + i as u64;
                let q = p.q + 4 * (p.q_strides.offset(b, row, h) + d as u64);
                let g = bp.d_o + 4 * (bp.d_o_strides.offset(b, row, h) + d as u64);
                unsafe {
                    dk = fma(ld_f32(np.ds + e), ld_f32(q), dk);
                    dv = fma(ld_f32(p.scores + e), ld_f32(g), dv);
                }
                i += 1;
            }
            h += 1;
        }
        unsafe {
            st_f32(dka + 4 * d as u64, dk);
            st_f32(dva + 4 * d as u64, dv);
        }
        d += THREADS;
    }
}
