//! `flash_bwd_*_f32`: the backward of fused attention, f32 SIMT (FlashAttention-2's backward,
//! Dao 2023, Algorithm 2), in three kernels launched in order on one stream.
//!
//! 1. **Preprocess** (`flash_bwd_pre_f32`): per query row `D = rowsum(dO ∘ O)` (f32, laid out
//!    like LSE), and (atomic mode) the row of the f32 dQ accumulator set to 0.
//! 2. **Main** (`flash_bwd_f32_d*`): a block owns `BC` keys of one K/V head at a time and keeps
//!    their k, v, dK and dV in registers. For every query head that reads the K/V head (GQA: the
//!    group's gradients are summed here, without atomics on dK/dV) and every query tile of `BR`
//!    rows that meets the block's keys it stages Q, dO, LSE and D in shared memory, then per row:
//!    recomputes the score `s` and `P = exp(s - LSE)` (no `N x N` buffer: P comes back from the
//!    saved LSE), `dV += P dO`, `dP = dO · v`, `dS = P (dP - D) · ds/dx` (the scale, and with a
//!    soft cap `1 - tanh²`), `dK += dS q`. The tile's dS goes to shared memory and `dS K` goes
//!    to dQ. Atomic mode: one f32 accumulator, added to with `red.global.add.f32` (the order of
//!    the adds, and so the last bits of dQ, vary run to run). Deterministic mode: key block `x`
//!    stores its partial `dS K` into its own slice `x` of `[n_key_blocks][.. q's shape ..]`, no
//!    atomics.
//! 3. **Convert** (`flash_bwd_dq_f32`): dQ = the accumulator, or the slices of the key blocks
//!    the row sees summed in key order, into the caller's strides; with sinks, also
//!    `d_sink[h] = -Σ_rows exp(sink[h] - LSE) · D` (one warp per head, a fixed summation order).
//!
//! Sinks need nothing more in the main kernel: LSE includes the sink, so P is already right.
//!
//! Shapes: Q, O, dO, dQ `[batch, seq_q, heads, D]`, K, V, dK, dV `[batch, seq_kv, heads_kv, D]`,
//! strided ([`crate::abi::Strides`]); LSE, D `[batch, heads, seq_q]`; the dQ slices
//! `[dq_splits][batch, seq_q, heads, D]` f32 ([`crate::abi::BwdParams`]). Varlen: per sequence, as the
//! forward (`device::sequence_of`).
//!
//! Tiles ([`crate::tiles::FLASH_BWD_F32_D32`] ... [`crate::tiles::FLASH_BWD_F32_D256`],
//! [`crate::tiles::BWD_ROWS`]): BC keys x TPK lanes per key, 12 or 16 dims per lane:
//! d32 32 x 2 (64 threads), BR 32; d64 32 x 4 (128), BR 32; d96 32 x 8 (256), BR 16; d128 32 x 8
//! (256), BR 16; d192 16 x 16 (256), BR 16; d256 16 x 16 (256), BR 8. Shared memory: K
//! `[BC][D]`, Q and dO `[BR][D]`, dS `[BR][BC]`, LSE and D `[BR]`, f32 (16.25 to 37.1 KiB, under
//! 48 KiB). ptxas: 148 to 180 registers, 0 spills (`kernels-gpu/ptx/ptxas-report.json`).
//!
//! Thread mapping (main): thread `t` serves key `t / TPK` of the block and owns dims
//! `t % TPK + TPK * k`; a row's partial dot products are summed over the key's `TPK` lanes
//! with `shfl.sync.bfly`. Reads of a Q or dO row broadcast (every key reads the same row).
//! For `dQ += dS K` the mapping changes to one element of the tile per thread (row `e / D`,
//! dim `e % D`): the dS value broadcasts and consecutive lanes read consecutive K words.
//! Keys past `seq_kv` compute on zeros, contribute P = 0 and store nothing, so every lane
//! reaches every barrier and shuffle. Rows a key does not see (the window rule,
//! [`crate::mask::key_range`]; LSE = -inf rows see nothing) contribute nothing.
//!
//! # Safety
//! All pointers in the parameters must be valid for their shapes and strides, the dQ
//! accumulator and D private to the call, and the kernels launched in the order above with the
//! variants' launch geometry.

#[cfg(target_arch = "nvptx64")]
use crate::abi::BwdParams;
#[cfg(target_arch = "nvptx64")]
use crate::device::*;
#[cfg(target_arch = "nvptx64")]
use crate::softmax::{tanh, LOG2E};

/// Preprocess: `D = rowsum(dO ∘ O)` (O and dO of element type `E`: f32, or bf16/f16 for the
/// tensor-core backward, [`crate::flash_bwd_mma`]) and, in atomic mode, the row of the dQ accumulator zeroed
/// (deterministic mode zeroes nothing: the convert reads only slices that were written); one
/// warp per row, `ROWS` rows per block.
///
/// # Safety
/// As the module's safety section.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn preprocess<E: Elem, const ROWS: usize>(bp: &BwdParams) {
    let seq = unsafe { sequence_of(&bp.attn, ctaid_z()) };
    let (p, b, q_row0) = (&seq.p, seq.b, seq.q0);
    let (t, lane) = (tid_x() as usize, tid_x() as usize % 32);
    let qi = ctaid_x() as usize * ROWS + t / 32;
    let h = ctaid_y() as u64;
    if qi >= p.seq_q as usize {
        return; // no barrier or shuffle below spans warps; a warp's lanes agree on qi
    }
    let row = q_row0 + qi as u64;
    let (oa, da) =
        (p.o + E::BYTES * p.o_strides.offset(b, row, h), bp.d_o + E::BYTES * bp.d_o_strides.offset(b, row, h));
    let acc = bp.dq_accum + 4 * bp.dq_accum_strides.offset(b, row, h);
    let atomic = bp.dq_split_stride == 0;
    let mut part = 0.0f32;
    let mut c = lane;
    while c < p.head_dim as usize {
        unsafe { part = fma(E::load(oa + E::BYTES * c as u64), E::load(da + E::BYTES * c as u64), part) };
        if atomic {
            unsafe { st_f32(acc + 4 * c as u64, 0.0) };
        }
        c += 32;
    }
    let mut w = 1;
    while w < 32 {
        part += shfl_xor(part, w);
        w <<= 1;
    }
    if lane == 0 {
        unsafe { st_f32(bp.delta + 4 * p.lse_offset(b, h, row), part) };
    }
}

/// Convert: dQ = the dQ slices summed in key-block order, rounded to `E` (f32, bf16, f16), into
/// the caller's strides; one warp
/// per row. With `dsinks` set, warp 0 of block `(0, h, 0)` first writes
/// `d_sink[h] = -Σ_rows exp(sink[h] - LSE) · D` over every row of every sequence (lane `l`
/// sums rows `l, l + 32, ...`, then a butterfly: a fixed order, so the result is the same run
/// to run). The main kernel has finished, and D was written by the preprocess.
///
/// # Safety
/// As the module's safety section.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn convert_dq<E: Elem, const ROWS: usize>(bp: &BwdParams) {
    let (t, lane) = (tid_x() as usize, tid_x() as usize % 32);
    let h = ctaid_y() as u64;
    if bp.dsinks != 0 && ctaid_x() == 0 && ctaid_z() == 0 && t < 32 {
        unsafe { sink_gradient(bp, h, lane) };
    }
    let seq = unsafe { sequence_of(&bp.attn, ctaid_z()) };
    let (p, b, q_row0) = (&seq.p, seq.b, seq.q0);
    let qi = ctaid_x() as usize * ROWS + t / 32;
    if qi >= p.seq_q as usize {
        return;
    }
    let row = q_row0 + qi as u64;
    let acc = bp.dq_accum + 4 * bp.dq_accum_strides.offset(b, row, h);
    let dq = bp.dq + E::BYTES * bp.dq_strides.offset(b, row, h);
    // Atomic mode: slice 0. Deterministic: the slices of the key blocks the row sees, in key
    // order (each of them processed the row's query tile, so each was written; a row that sees
    // no key sums nothing and gets 0).
    let (s0, s1) = if bp.dq_split_stride == 0 {
        (0, 1)
    } else {
        let (rs, re) = p.key_range(qi as u32);
        let bc = bp.key_block as i64;
        if re > rs {
            (rs / bc, (re + bc - 1) / bc)
        } else {
            (0, 0)
        }
    };
    let mut c = lane;
    while c < p.head_dim as usize {
        let mut sum = 0.0f32;
        let mut s = s0 as u64;
        while s < s1 as u64 {
            sum += unsafe { ld_f32(acc + 4 * (s * bp.dq_split_stride + c as u64)) };
            s += 1;
        }
        unsafe { E::store(dq + E::BYTES * c as u64, sum) };
        c += 32;
    }
}

/// `d_sink[h]` by one warp (see [`convert_dq`]).
///
/// # Safety
/// As the module's safety section; `bp.attn.sinks` and `bp.dsinks` valid for `heads` f32.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
unsafe fn sink_gradient(bp: &BwdParams, h: u64, lane: usize) {
    let sink = unsafe { ld_f32(bp.attn.sinks + 4 * h) } * LOG2E;
    let mut part = 0.0f32;
    let mut z = 0u32;
    while z < bp.attn.batch {
        let seq = unsafe { sequence_of(&bp.attn, z) };
        let mut i = lane as u64;
        while i < seq.p.seq_q as u64 {
            let at = seq.p.lse_offset(seq.b, h, seq.q0 + i);
            let (l, dd) = unsafe { (ld_f32(bp.attn.lse + 4 * at) * LOG2E, ld_f32(bp.delta + 4 * at)) };
            part = fma(exp2(sink - l), dd, part);
            i += 32;
        }
        z += 1;
    }
    let mut w = 1;
    while w < 32 {
        part += shfl_xor(part, w);
        w <<= 1;
    }
    if lane == 0 {
        unsafe { st_f32(bp.dsinks + 4 * h, -part) };
    }
}

/// The main kernel's generic body, instantiated by the rows of [`crate::variants`] with their
/// tile's constants (`TPK` lanes per key, `DPT = D / TPK` dims per lane).
///
/// # Safety
/// As the module's safety section.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn flash_bwd<const D: usize, const BR: usize, const BC: usize, const TPK: usize, const DPT: usize>(
    bp: &BwdParams,
) {
    let seq = unsafe { sequence_of(&bp.attn, ctaid_z()) };
    let p = &seq.p;
    let seq_kv = p.seq_kv as usize;
    let hk = ctaid_y();
    let group = if p.heads_kv != 0 && p.heads_kv <= p.heads { p.heads / p.heads_kv } else { 1 };

    let smem = dynamic_smem_f32();
    let k_s = smem;
    let q_s = unsafe { k_s.add(BC * D) };
    let do_s = unsafe { q_s.add(BR * D) };
    let ds_s = unsafe { do_s.add(BR * D) };
    let lse_s = unsafe { ds_s.add(BR * BC) };
    let dd_s = unsafe { lse_s.add(BR) };

    // s = scale · x (x = q·k), or with a soft cap s = c · tanh(scale · x / c); ds/dx is
    // `scale` or `scale · (1 - tanh²)`. P = 2^((s - LSE) · log2 e).
    let softcap = p.softcap > 0.0;
    let scale = p.softmax_scale;
    let cap_arg = if softcap { scale / p.softcap } else { 0.0 };
    // Deterministic mode: slice `x` belongs to key block `x` alone.
    let atomic = bp.dq_split_stride == 0;
    let dq_slice = if atomic { bp.dq_accum } else { bp.dq_accum + 4 * ctaid_x() as u64 * bp.dq_split_stride };

    // One key block per block. (A loop over several key blocks per block, which would bound the
    // deterministic mode's slices, measured 168 -> 219 registers: the loop keeps the per-block
    // addresses live across it.) The test is uniform over the block, before any barrier.
    let kv0 = ctaid_x() as usize * BC;
    if kv0 < seq_kv {
        let smem = [k_s, q_s, do_s, ds_s, lse_s, dd_s];
        let score = (scale, cap_arg, softcap);
        unsafe { key_block::<D, BR, BC, TPK, DPT>(bp, &seq, kv0, hk, group, smem, score, atomic, dq_slice) };
    }
}

/// The key block of [`flash_bwd`]: keys `kv0..kv0 + BC` of K/V head `hk`, their dK and dV
/// stored, their dQ contributions added to `dq_slice`.
///
/// # Safety
/// As the module's safety section; `smem` the shared-memory tiles of [`flash_bwd`].
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn key_block<const D: usize, const BR: usize, const BC: usize, const TPK: usize, const DPT: usize>(
    bp: &BwdParams,
    seq: &crate::abi::Sequence,
    kv0: usize,
    hk: u32,
    group: u32,
    smem: [*mut f32; 6],
    (scale, cap_arg, softcap): (f32, f32, bool),
    atomic: bool,
    dq_slice: u64,
) {
    let (p, b, q_row0, k_row0) = (&seq.p, seq.b, seq.q0, seq.k0);
    let [k_s, q_s, do_s, ds_s, lse_s, dd_s] = smem;
    let threads = BC * TPK;
    let t = tid_x() as usize;
    let lane = t % TPK;
    let (seq_q, seq_kv) = (p.seq_q as usize, p.seq_kv as usize);
    let kv_end = core::cmp::min(kv0 + BC, seq_kv);
    let jj = t / TPK;
    let j = kv0 + jj;
    let key_valid = j < seq_kv;

    // The block's K tile (for dQ) and this key's k and v (rows past seq_kv are zeros).
    let mut e = t;
    while e < BC * D {
        let (r, c) = (e / D, e % D);
        let x = if kv0 + r < seq_kv && (c as u32) < p.head_dim {
            unsafe { ld_f32(p.k + 4 * (p.k_strides.offset(b, k_row0 + (kv0 + r) as u64, hk as u64) + c as u64)) }
        } else {
            0.0
        };
        unsafe { *k_s.add(e) = x };
        e += threads;
    }
    let mut kr = [0.0f32; DPT];
    let mut vr = [0.0f32; DPT];
    if key_valid {
        let ka = p.k + 4 * p.k_strides.offset(b, k_row0 + j as u64, hk as u64);
        let va = p.v + 4 * p.v_strides.offset(b, k_row0 + j as u64, hk as u64);
        // Columns past a head dim below D stay zero in every staged tile and register: they add
        // nothing to q·k or dO·v, and their dQ, dK and dV are not stored.
        unroll!(k in 0..DPT => {
            let c = (lane + TPK * k) as u64;
            if (c as u32) < p.head_dim {
                unsafe {
                    kr[k] = ld_f32(ka + 4 * c);
                    vr[k] = ld_f32(va + 4 * c);
                }
            }
        });
    }
    let mut dk = [0.0f32; DPT];
    let mut dv = [0.0f32; DPT];

    let mut h = hk * group;
    while h < (hk + 1) * group {
        let mut q0 = 0usize;
        while q0 < seq_q {
            // Query tiles whose rows see none of the block's keys are skipped (uniform).
            let last = core::cmp::min(q0 + BR, seq_q) - 1;
            let (tile_start, tile_end) = (p.key_range(q0 as u32).0, p.key_range(last as u32).1);
            if tile_end <= kv0 as i64 || tile_start >= kv_end as i64 {
                q0 += BR;
                continue;
            }
            let nrows = last + 1 - q0;

            // Stage Q, dO (rows past seq_q zeros), LSE (log2 domain) and D.
            sync_threads();
            let mut e = t;
            while e < BR * D {
                let (r, c) = (e / D, e % D);
                let (qx, dx) = if r < nrows && (c as u32) < p.head_dim {
                    let row = q_row0 + (q0 + r) as u64;
                    unsafe {
                        (
                            ld_f32(p.q + 4 * (p.q_strides.offset(b, row, h as u64) + c as u64)),
                            ld_f32(bp.d_o + 4 * (bp.d_o_strides.offset(b, row, h as u64) + c as u64)),
                        )
                    }
                } else {
                    (0.0, 0.0)
                };
                unsafe {
                    *q_s.add(e) = qx;
                    *do_s.add(e) = dx;
                }
                e += threads;
            }
            if t < BR {
                let (l, dd) = if t < nrows {
                    let at = p.lse_offset(b, h as u64, q_row0 + (q0 + t) as u64);
                    unsafe { (ld_f32(p.lse + 4 * at) * LOG2E, ld_f32(bp.delta + 4 * at)) }
                } else {
                    (0.0, 0.0)
                };
                unsafe {
                    *lse_s.add(t) = l;
                    *dd_s.add(t) = dd;
                }
            }
            sync_threads();

            // Per row: P, dV, dP, dS, dK; the tile's dS to shared memory.
            let mut r = 0usize;
            while r < nrows {
                let mut x = 0.0f32;
                let mut dp = 0.0f32;
                for k in 0..DPT {
                    let c = r * D + lane + TPK * k;
                    unsafe {
                        x = fma(kr[k], *q_s.add(c), x);
                        dp = fma(vr[k], *do_s.add(c), dp);
                    }
                }
                let mut w = 1;
                while w < TPK {
                    x += shfl_xor(x, w as u32);
                    dp += shfl_xor(dp, w as u32);
                    w <<= 1;
                }
                let (rs, re) = p.key_range((q0 + r) as u32);
                let seen = key_valid && (j as i64) >= rs && (j as i64) < re;
                let (s, dsdx) = if softcap {
                    let th = tanh(x * cap_arg);
                    (p.softcap * th, scale * (1.0 - th * th))
                } else {
                    (x * scale, scale)
                };
                let pr = if seen { exp2(s * LOG2E - unsafe { *lse_s.add(r) }) } else { 0.0 };
                let ds = pr * (dp - unsafe { *dd_s.add(r) }) * dsdx;
                for k in 0..DPT {
                    let c = r * D + lane + TPK * k;
                    unsafe {
                        dv[k] = fma(pr, *do_s.add(c), dv[k]);
                        dk[k] = fma(ds, *q_s.add(c), dk[k]);
                    }
                }
                if lane == 0 {
                    unsafe { *ds_s.add(r * BC + jj) = ds };
                }
                r += 1;
            }
            sync_threads();

            // dQ += dS K for the tile's rows, one element per thread: added atomically (other
            // key blocks add to the same rows), or in deterministic mode to this block's slice.
            let mut e = t;
            while e < nrows * D {
                let (r, c) = (e / D, e % D);
                if c as u32 >= p.head_dim {
                    e += threads;
                    continue;
                }
                let mut acc = 0.0f32;
                for kk in 0..BC {
                    acc = fma(unsafe { *ds_s.add(r * BC + kk) }, unsafe { *k_s.add(kk * D + c) }, acc);
                }
                let row = q_row0 + (q0 + r) as u64;
                let at = dq_slice + 4 * (bp.dq_accum_strides.offset(b, row, h as u64) + c as u64);
                if atomic {
                    unsafe { red_add_f32(at, acc) };
                } else {
                    unsafe { st_f32(at, acc) }; // the block's own slice: written once
                }
                e += threads;
            }
            q0 += BR;
        }
        h += 1;
    }

    // dK and dV of this key, summed over the group's query heads.
    if key_valid {
        let ka = bp.dk + 4 * bp.dk_strides.offset(b, k_row0 + j as u64, hk as u64);
        let va = bp.dv + 4 * bp.dv_strides.offset(b, k_row0 + j as u64, hk as u64);
        unroll!(k in 0..DPT => {
            let c = (lane + TPK * k) as u64;
            if (c as u32) < p.head_dim {
                unsafe {
                    st_f32(ka + 4 * c, dk[k]);
                    st_f32(va + 4 * c, dv[k]);
                }
            }
        });
    }
}
