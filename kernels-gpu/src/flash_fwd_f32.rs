//! `flash_fwd_f32_d{32,64,96,128,192,256}`: fused memory-efficient attention forward, f32 SIMT.
//!
//! Algorithm (FlashAttention-2 forward, online softmax): a block owns `BR` query rows and walks the
//! keys in tiles of `BC`. Per tile it (1) stages K and V in shared memory, (2) computes the scores
//! of its rows in the log2 domain (`log2 e` is folded into the softmax scale once, so every
//! exponential is one `ex2`), (3) raises the running row max and (4) rescales the running sum
//! and output accumulator by `2^(m_old - m_new)`, both only when some row of the warp has grown
//! by more than 2^8 ([`crate::softmax::must_rescale`], the policy of every fused kernel),
//! (5) accumulates `P V`. At the end the accumulator is
//! divided by the running sum and `LSE = ln 2 * (m + log2 l)` is written. Steps 3-5 and the end are
//! the methods of [`crate::softmax::OnlineSoftmax`]. No `N x N` buffer exists:
//! the extra memory is LSE only, `4 * batch * heads * seq_q` bytes.
//!
//! Shapes: Q, O `[batch, seq_q, heads, D]`, K, V `[batch, seq_kv, heads_kv, D]`, all f32 and strided
//! (see [`crate::abi::Strides`]); LSE `[batch, heads, seq_q]` f32.
//!
//! Tiles ([`crate::tiles::FLASH_F32_D32`], [`crate::tiles::FLASH_F32_D64`],
//! [`crate::tiles::FLASH_F32_D96`], [`crate::tiles::FLASH_F32_D128`],
//! [`crate::tiles::FLASH_F32_D192`], [`crate::tiles::FLASH_F32_D256`]), 128 threads each:
//! D=32 and 64: BR=32, BC=64, 4 lanes/row; D=96 and 128: BR=16, BC=32, 8 lanes/row; D=192:
//! BR=8, BC=32, 16 lanes/row; D=256: BR=8, BC=16, 16 lanes/row. Shared memory: K tile then V
//! tile, row-major `[BC][D]` f32, `2 * BC * D * 4` bytes (16, 32, 24, 32, 48 and 32 KiB).
//!
//! Thread mapping: grid `(ceil(seq_q / BR), heads, batch)`. Thread `t` serves query row
//! `t / TPR` of the tile and owns dims `t % TPR + TPR * k` (`k < D / TPR`) of q and of the
//! accumulator. The `TPR` lanes of a row are consecutive lanes of one warp, so a score's partial
//! dot products are summed with `shfl.sync.bfly`. Interleaved dims put the lanes of a row on
//! consecutive banks and rows of the same key read the same word (broadcast): conflict-free.
//! Rows past `seq_q` compute on zeros and store nothing, so every lane reaches every barrier and
//! shuffle.
//!
//! Semantics (`docs/semantics.md`): K/V head `h / (heads / heads_kv)` (GQA/MQA); window
//! `(left, right)` bottom-right aligned, causal = right 0 ([`crate::mask::key_range`]);
//! soft cap `c · tanh(scale · q·k / c)` ([`crate::softmax::softcap2`]); ALiBi's
//! `-slope · |i + seq_kv - seq_q - j|` after it ([`crate::abi::AttnParams::alibi_slopes`]); a
//! per-head sink logit in the denominator only ([`crate::softmax::OnlineSoftmax::finish_with_sink`]).
//!
//! Masking: keys outside a row's window `[start, end)` (and past `seq_kv`) score `-inf`. A block
//! visits only the key tiles that meet `[start of its first row, end of its last row)`: tiles
//! wholly outside the window are never loaded, so the cost scales with the window, not
//! `seq_kv`. A fully masked row gives `O = 0` and `LSE = -inf` (with a sink: `O = 0`,
//! `LSE = sink`), never NaN: while a row's max is `-inf` the exponent base is 0.
//!
//! # Safety
//! All pointers in `p` must be valid for the shapes and strides in `p`; the launch must use
//! the variant's `launch` (block size and dynamic shared memory, [`crate::variants::Variant::launch`]).

#[cfg(target_arch = "nvptx64")]
use crate::abi::AttnParams;
#[cfg(target_arch = "nvptx64")]
use crate::device::*;
#[cfg(target_arch = "nvptx64")]
use crate::softmax::{softcap2, OnlineSoftmax, LOG2E};

/// Keys scored per online-softmax step (the score row held in registers).
#[cfg(target_arch = "nvptx64")]
const KC: usize = 8;

/// The generic body, instantiated by the rows of [`crate::variants`] with their tile's constants
/// (`TPR` lanes per row, `DPT = D / TPR` dims per lane). A head dim below `D` (padded to this
/// kernel's) runs a second instantiation whose loads and stores check columns, so the common
/// one runs the instructions it ran before (the kernel's registers are the larger body's: 128
/// at d64 on sm_80, 96 before).
///
/// # Safety
/// As the module's safety section.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn flash_fwd<const D: usize, const BR: usize, const BC: usize, const TPR: usize, const DPT: usize>(
    p: &AttnParams,
) {
    if p.head_dim as usize == D {
        unsafe { flash_fwd_body::<D, BR, BC, TPR, DPT, false>(p) }
    } else {
        unsafe { flash_fwd_body::<D, BR, BC, TPR, DPT, true>(p) }
    }
}

/// [`flash_fwd`]'s body; `PAD`: columns `p.head_dim..D` are zero in Q, K and V and not stored.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
unsafe fn flash_fwd_body<
    const D: usize,
    const BR: usize,
    const BC: usize,
    const TPR: usize,
    const DPT: usize,
    const PAD: bool,
>(
    p: &AttnParams,
) {
    // Varlen: this block's sequence as a batch-1 problem; a block past its end has no rows.
    let seq = unsafe { sequence_of(p, ctaid_z()) };
    let (p, b, q_row0, k_row0) = (&seq.p, seq.b, seq.q0, seq.k0);
    let threads = BR * TPR;
    let t = tid_x() as usize;
    let lane = t % TPR;
    let q_tile_start = ctaid_x() as usize * BR;
    if q_tile_start >= p.seq_q as usize {
        return; // uniform over the block: before any barrier
    }
    let qi = q_tile_start + t / TPR;
    let h = ctaid_y() as u64;
    let hk = p.kv_head(h as u32) as u64;
    let row_valid = qi < p.seq_q as usize;
    let seq_kv = p.seq_kv as usize;

    let smem = dynamic_smem_f32();
    let k_s = smem;
    let v_s = unsafe { smem.add(BC * D) };

    // q pre-scaled into the log2 domain, or (soft cap) by scale / cap, the argument of tanh.
    let softcap = p.softcap > 0.0;
    let (qscale, cap2) =
        if softcap { (p.softmax_scale / p.softcap, p.softcap * LOG2E) } else { (p.softmax_scale * LOG2E, 0.0) };
    // ALiBi in the log2 domain: -slope · log2 e per key of distance from the row's diagonal.
    let alibi2 = -unsafe { alibi_slope(p.alibi_slopes, p.alibi_batch_stride, ctaid_z(), h as u32) } * LOG2E;
    let row_diag = qi as i32 + p.seq_kv as i32 - p.seq_q as i32;
    let mut q = [0.0f32; DPT];
    if row_valid {
        let qa = p.q + 4 * p.q_strides.offset(b, q_row0 + qi as u64, h);
        // Columns past a head dim below D stay zero (so do K's and V's: they add nothing).
        unroll!(k in 0..DPT => {
            if !PAD || ((lane + TPR * k) as u32) < p.head_dim {
                q[k] = unsafe { ld_f32(qa + 4 * (lane + TPR * k) as u64) } * qscale;
            }
        });
    }

    // Keys this row may see: [row_start, row_end) (32-bit: fewer registers through the loop);
    // key tiles this block must visit: those that meet [first row's start, last row's end).
    // Tiles wholly outside the window are skipped, so the cost scales with the window.
    let (rs, re) = p.key_range(qi as u32);
    let (row_start, row_end) = (rs as i32, re as i32);
    let last_row = core::cmp::min(q_tile_start + BR, p.seq_q as usize) - 1;
    let block_start = p.key_range(q_tile_start as u32).0 as usize;
    let block_end = p.key_range(last_row as u32).1;
    let block_end = if block_end > 0 { block_end as usize } else { 0 };

    let mut row_sm = OnlineSoftmax::new(); // running max (log2 domain) and sum of the row
    let mut acc = [0.0f32; DPT];

    let mut kv0 = block_start / BC * BC;
    while kv0 < block_end {
        // (1) Stage K and V rows kv0..kv0+BC; rows past seq_kv are zero (their scores are
        // masked), and so are columns past a head dim below D.
        sync_threads();
        let mut e = t;
        while e < BC * D {
            let (r, c) = (e / D, e % D);
            let j = kv0 + r;
            let (kx, vx) = if j < seq_kv && (!PAD || (c as u32) < p.head_dim) {
                let ka = p.k + 4 * (p.k_strides.offset(b, k_row0 + j as u64, hk) + c as u64);
                let va = p.v + 4 * (p.v_strides.offset(b, k_row0 + j as u64, hk) + c as u64);
                unsafe { (ld_f32(ka), ld_f32(va)) }
            } else {
                (0.0, 0.0)
            };
            unsafe {
                *k_s.add(e) = kx;
                *v_s.add(e) = vx;
            }
            e += threads;
        }
        sync_threads();

        // Steps (2)-(5) run on chunks of KC keys, so the score row is KC registers (fully
        // unrolled) instead of a BC-long array that would live in local memory.
        let mut r0 = 0usize;
        while r0 < BC {
            // (2) Scores of this row against KC keys, log2 domain (soft-capped when asked),
            // keys outside [row_start, row_end) masked as -inf.
            let mut s = [0.0f32; KC];
            let mut chunk_max = f32::NEG_INFINITY;
            unroll!(c in 0..KC => {
                let r = r0 + c;
                let mut part = 0.0f32;
                for (k, qk) in q.iter().enumerate() {
                    part = fma(*qk, unsafe { *k_s.add(r * D + lane + TPR * k) }, part);
                }
                let mut w = 1;
                while w < TPR {
                    part += shfl_xor(part, w as u32);
                    w <<= 1;
                }
                if softcap {
                    part = softcap2(part, cap2);
                }
                let j = (kv0 + r) as i32;
                s[c] = if j >= row_start && j < row_end { part } else { f32::NEG_INFINITY };
            });
            // ALiBi: one uniform branch per chunk (a masked -inf stays -inf).
            if alibi2 != 0.0 {
                unroll!(c in 0..KC => {
                    s[c] = fma(alibi2, alibi_distance(row_diag, (kv0 + r0 + c) as i32), s[c]);
                });
            }
            unroll!(c in 0..KC => { chunk_max = fmax(chunk_max, s[c]); });

            // (3) New running max and (4) rescale what was accumulated under the old one, lazily
            // (`must_rescale`): only when some row of the warp has grown by more than 2^8 (a
            // warp vote, so the branch is uniform); while the max is -inf the row has seen
            // nothing and 0 is the base.
            let rescale = if warp_any(row_sm.must_raise(chunk_max)) {
                let rescale = row_sm.raise_max(chunk_max);
                for a in acc.iter_mut() {
                    *a *= rescale.alpha;
                }
                rescale
            } else {
                row_sm.keep()
            };

            // (5) Accumulate P V.
            unroll!(c in 0..KC => {
                let pr = row_sm.prob(s[c], rescale);
                for (k, a) in acc.iter_mut().enumerate() {
                    *a = fma(pr, unsafe { *v_s.add((r0 + c) * D + lane + TPR * k) }, *a);
                }
            });
            r0 += KC;
        }
        kv0 += BC;
    }

    // Finalise: O = acc / l, LSE = ln2 * (m + log2 l); a row that saw nothing gives O = 0, -inf.
    // With a sink, its logit joins the denominator (`OnlineSoftmax::finish_with_sink`).
    if row_valid {
        let sink2 = if p.sinks != 0 { (unsafe { ld_f32(p.sinks + 4 * h) }) * LOG2E } else { f32::NEG_INFINITY };
        let (inv_l, lse) = row_sm.finish_with_sink(row_sm.l, sink2);
        let oa = p.o + 4 * p.o_strides.offset(b, q_row0 + qi as u64, h);
        unroll!(k in 0..DPT => {
            if !PAD || ((lane + TPR * k) as u32) < p.head_dim {
                unsafe { st_f32(oa + 4 * (lane + TPR * k) as u64, acc[k] * inv_l) };
            }
        });
        if lane == 0 {
            let la = p.lse + 4 * p.lse_offset(b, h, q_row0 + qi as u64);
            unsafe { st_f32(la, lse) };
        }
    }
}
