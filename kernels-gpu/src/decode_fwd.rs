//! `decode_fwd_{f32,bf16,f16}_d{64,128}`: split-KV (flash-decoding) attention over a KV cache,
//! SIMT, f32 arithmetic.
//!
//! Algorithm: FlashAttention-2's split-KV forward (`flash_fwd_splitkv_kernel`). A block owns one
//! split of the keys of one sequence and one KV head, and a tile of `BR` packed query rows: the
//! `group = heads / heads_kv` query heads that share the KV head, for each of the `seq_q` query
//! tokens, stacked as rows (row `r` is token `r / group`, head `hk * group + r % group`; packed
//! GQA, FlashAttention-2's `seqlenq_ngroups_swapped`), so one K/V tile staged in shared memory
//! serves every query head that reads it. Per key tile it runs the online softmax of
//! [`crate::softmax::OnlineSoftmax`] exactly as `flash_fwd_f32` does (scores in the log2 domain,
//! raise the max and rescale lazily, [`crate::softmax::must_rescale`], accumulate `P V`). At the end the split's `O_s = acc / l` and `LSE_s`
//! (natural log) go to the f32 workspace, or, with one split, `O` (element type) and `LSE`
//! directly. `merge_states` combines the splits.
//!
//! Shapes and layout: see [`crate::decode_abi`] (Q/O BSHD; contiguous or paged cache;
//! `cache_seqlens`; keys `j < cache_seqlens[b] + seq_new`, the appended ones written beforehand by
//! `decode_append`).
//!
//! Tiles ([`crate::tiles::DECODE_D64`], [`crate::tiles::DECODE_D128`]): 128 threads, `TPR` lanes
//! per row, `BR = 128 / TPR` rows, `BC = 32` keys per step. Shared memory: the K tile then the V
//! tile, row-major `[BC][D]` f32 (16-bit caches are widened on staging): `2 * 32 * D * 4` bytes,
//! 16 KiB at d=64, 32 KiB at d=128. The tiles are staged in 16-byte chunks (4 f32 or 8 16-bit
//! values, one vector load and one cache-row lookup each).
//!
//! Thread mapping: grid `(num_splits, ceil(seq_q * group / BR), heads_kv * batch)`; thread `t`
//! serves packed row `t / TPR` and owns dims `t % TPR + TPR * k` (`k < D / TPR`); a row's lanes are
//! consecutive lanes of one warp and sum a score's partial dot products with `shfl.sync.bfly`.
//! Rows past `seq_q * group` compute on zeros and store nothing, so every lane reaches every
//! barrier and shuffle. Each thread stages 16-byte chunks `t, t + 128, ...` of the K and V tiles.
//!
//! Soft-capping (`softcap > 0`): each score becomes `softcap * tanh(scale * q.k / softcap)` before
//! masking and the softmax; ALiBi (`alibi_slopes != 0`) then adds `-slope * |i + seqlen_k - seq_q
//! - j|`. Sinks (`sinks != 0`): the head's sink logit joins the denominator of
//! split 0 only ([`crate::softmax::OnlineSoftmax::finish_with_sink`]; split 0 always exists), so
//! after the merge it is counted exactly once.
//!
//! Masking: keys outside the split, past `seqlen_k`, or outside the row's bottom-right aligned
//! window ([`crate::mask::key_range`]; causal is `window_right = 0`) score `-inf`; a block
//! starts at the tile of its first row's window start and stops at the last key its last row can
//! see. An empty split or a row that sees nothing gives `O_s = 0`, `LSE_s = -inf`.
//!
//! # Safety
//! All pointers in `p` must be valid for the shapes in `p` (the host validates `block_table`
//! entries against the pages allocated and `cache_seqlens[b] + seq_new` against the cache's
//! capacity before it launches); `k_cache` and `v_cache` must be 16-byte aligned; `heads` must be
//! a multiple of `heads_kv`; the launch must use [`crate::tiles::DecodeTile::launch`].

#[cfg(target_arch = "nvptx64")]
use crate::decode_abi::{split_range, DecodeParams};
#[cfg(target_arch = "nvptx64")]
use crate::device::*;
#[cfg(target_arch = "nvptx64")]
use crate::mask::key_range;
#[cfg(target_arch = "nvptx64")]
use crate::softmax::{tanh, OnlineSoftmax, LOG2E};

/// The cache element types the decode rows of [`crate::variants`] name.
#[cfg(target_arch = "nvptx64")]
pub(crate) mod elem {
    pub(crate) use crate::device::{Bf16, F16, F32};
    pub(crate) use crate::fp8::{Fp8E4m3, Fp8E5m2};
}

/// Keys scored per online-softmax step (the score row held in registers).
#[cfg(target_arch = "nvptx64")]
const KC: usize = 8;

/// A cache element type: 16 bytes of a cache row, read with one vector load and widened into
/// f32 shared memory, and the element type of Q and O that goes with it.
#[cfg(target_arch = "nvptx64")]
pub(crate) trait Stage16 {
    /// Element type of Q and O (the cache's own type, bf16 for an FP8 cache).
    type Qo: Elem;
    /// Bytes per cache element.
    const BYTES: u64;
    /// Loads the 16 bytes at `src` (`16 / BYTES` elements) and stores them as f32 at `dst`.
    ///
    /// # Safety
    /// `src` must be a valid, 16-byte aligned global address; `dst` valid for `16 / BYTES` f32.
    unsafe fn stage16(src: u64, dst: *mut f32);
    /// The scale of KV head `hk` of the cache whose `heads_kv` scales are at `scales` (FP8), 1
    /// for the other types.
    ///
    /// # Safety
    /// For FP8, `scales` must be a valid device address of `heads_kv` f32.
    #[inline(always)]
    unsafe fn scale(_scales: u64, _hk: u64) -> f32 {
        1.0
    }
}

/// 16 bytes as four 32-bit words (`ld.global.v4.u32`).
#[cfg(target_arch = "nvptx64")]
#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct Words4([u32; 4]);

#[cfg(target_arch = "nvptx64")]
#[inline(always)]
unsafe fn ld16(src: u64) -> [u32; 4] {
    unsafe { (*(src as *const Words4)).0 }
}

#[cfg(target_arch = "nvptx64")]
impl Stage16 for F32 {
    type Qo = F32;
    const BYTES: u64 = 4;
    #[inline(always)]
    unsafe fn stage16(src: u64, dst: *mut f32) {
        let w = unsafe { ld16(src) };
        for (i, x) in w.iter().enumerate() {
            unsafe { *dst.add(i) = f32::from_bits(*x) };
        }
    }
}

#[cfg(target_arch = "nvptx64")]
impl Stage16 for crate::mma::Bf16 {
    type Qo = Self;
    const BYTES: u64 = 2;
    /// bf16 is the top half of an f32: the low value of a word shifted up, the high one masked.
    #[inline(always)]
    unsafe fn stage16(src: u64, dst: *mut f32) {
        let w = unsafe { ld16(src) };
        for (i, x) in w.iter().enumerate() {
            unsafe {
                *dst.add(2 * i) = f32::from_bits(x << 16);
                *dst.add(2 * i + 1) = f32::from_bits(x & 0xffff_0000);
            }
        }
    }
}

#[cfg(target_arch = "nvptx64")]
impl Stage16 for crate::mma::F16 {
    type Qo = Self;
    const BYTES: u64 = 2;
    /// `cvt.f32.f16` (exact) of each half of each word.
    #[inline(always)]
    unsafe fn stage16(src: u64, dst: *mut f32) {
        let w = unsafe { ld16(src) };
        for (i, x) in w.iter().enumerate() {
            let (lo, hi): (f32, f32);
            unsafe {
                core::arch::asm!("cvt.f32.f16 {lo}, {l};", "cvt.f32.f16 {hi}, {h};",
                    lo = out(reg32) lo, hi = out(reg32) hi, l = in(reg16) *x as u16, h = in(reg16) (*x >> 16) as u16,
                    options(pure, nomem, nostack));
                *dst.add(2 * i) = lo;
                *dst.add(2 * i + 1) = hi;
            }
        }
    }
}

/// An FP8 cache: 16 one-byte codes per load, each widened with [`crate::fp8::decode_finite`]
/// (about six integer operations and one exact multiply). The per-head scales are not applied
/// here but folded into the kernel's two f32 factors: `k_scale` into the query's score factor
/// (`q . (decode(k) * s) = (s * q) . decode(k)`), `v_scale` into the final `1 / l`.
#[cfg(target_arch = "nvptx64")]
impl<F: crate::fp8::Fp8Kind> Stage16 for F {
    type Qo = crate::mma::Bf16;
    const BYTES: u64 = 1;
    #[inline(always)]
    unsafe fn stage16(src: u64, dst: *mut f32) {
        let w = unsafe { ld16(src) };
        for (i, x) in w.iter().enumerate() {
            unroll4!(k in 0..4 => {
                unsafe { *dst.add(4 * i + k) = crate::fp8::decode_finite(F::FORMAT, x >> (8 * k)) };
            });
        }
    }
    #[inline(always)]
    unsafe fn scale(scales: u64, hk: u64) -> f32 {
        unsafe { ld_f32(scales + 4 * hk) }
    }
}

/// The generic body, instantiated by the rows of [`crate::variants`] (`TPR` lanes per row,
/// `DPT = D / TPR` dims per lane).
///
/// # Safety
/// As the module's safety section.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn decode_fwd<
    E: Stage16,
    const D: usize,
    const BR: usize,
    const BC: usize,
    const TPR: usize,
    const DPT: usize,
>(
    p: &DecodeParams,
) {
    let threads = BR * TPR;
    let t = tid_x() as usize;
    let lane = t % TPR;
    let split = ctaid_x();
    let group = p.group() as usize;
    let rows = p.seq_q as usize * group;
    let tile_start = ctaid_y() as usize * BR;
    let r = tile_start + t / TPR;
    let hk = (ctaid_z() % p.heads_kv) as u64;
    let b = (ctaid_z() / p.heads_kv) as u64;
    let row_valid = r < rows;
    let (qi, h) = if row_valid { (r / group, hk as usize * group + r % group) } else { (0, 0) };
    let causal = p.causal != 0;

    // The sequence's cache slot and left padding: its key j is cache row pad + j of the slot.
    let (slot, pad) = unsafe { p.slot_of(b as u32) };
    let seqlen_k = unsafe { ld_u32(p.cache_seqlens + 4 * b) } - pad + p.seq_new;
    let (k_lo, k_hi) = split_range(seqlen_k, p.num_splits, split, BC as u32);

    let smem = dynamic_smem_f32();
    let k_s = smem;
    let v_s = unsafe { smem.add(BC * D) };

    let (heads, seq_q) = (p.heads as u64, p.seq_q as u64);
    // The problem's head dim: D, or (a head dim padded to this kernel's) less. Q, O, the cache
    // and the partials are rows of `d` elements; columns `d..D` are zero in the tiles.
    let d = p.head_dim as u64;
    // Scores in the log2 domain (`log2 e` folded into q), except with a softcap, which needs the
    // natural score `scale * q.k` for its tanh; the factor is applied after it.
    let softcap = p.softcap;
    let scale2 = if softcap > 0.0 { p.softmax_scale } else { p.softmax_scale * LOG2E };
    let mut q = [0.0f32; DPT];
    if row_valid {
        let qa = p.q + E::Qo::BYTES * (((b * seq_q + qi as u64) * heads + h as u64) * d);
        // An FP8 cache's K scale joins the query's factor (see `Stage16::scale`).
        let qscale = scale2 * unsafe { E::scale(p.k_scale, hk) };
        // Columns past a head dim below D stay zero (so do K's and V's: they add nothing).
        unroll!(k in 0..DPT => {
            if ((lane + TPR * k) as u64) < d {
                q[k] = unsafe { <E::Qo as Elem>::load(qa + E::Qo::BYTES * (lane + TPR * k) as u64) } * qscale;
            }
        });
    }

    // Keys this row may see: [row_start, row_end) within the split; keys this block visits:
    // [block_start, block_end), from the first row's window start (rounded down to a whole tile)
    // to the last row's end.
    let (wl, wr) = (p.window_left, p.window_right);
    let (rs, re) = key_range(causal, wl, wr, qi as u32, p.seq_q, seqlen_k);
    let row_start = core::cmp::max(rs, k_lo as i64);
    let row_end = core::cmp::min(re, k_hi as i64);
    let last_row = core::cmp::min(tile_start + BR, rows) - 1;
    let first = key_range(causal, wl, wr, (tile_start / group) as u32, p.seq_q, seqlen_k).0;
    let last = key_range(causal, wl, wr, (last_row / group) as u32, p.seq_q, seqlen_k).1;
    let block_end = core::cmp::min(last, k_hi as i64);
    let block_end = if block_end > 0 { block_end as usize } else { 0 };
    let skip = if first > k_lo as i64 { (first as usize - k_lo as usize) / BC * BC } else { 0 };

    // ALiBi in the log2 domain: -slope · log2 e per key of distance from the row's diagonal.
    let alibi2 = -unsafe { alibi_slope(p.alibi_slopes, p.alibi_batch_stride, b as u32, h as u32) } * LOG2E;
    let row_diag = qi as i32 + seqlen_k as i32 - p.seq_q as i32;
    let mut row_sm = OnlineSoftmax::new();
    let mut acc = [0.0f32; DPT];

    let mut kv0 = k_lo as usize + skip;
    while kv0 < block_end {
        // Stage K and V rows kv0..kv0+BC in 16-byte chunks (one cache-row lookup and one vector
        // load per chunk); rows past block_end are zero (their scores are masked).
        sync_threads();
        let vec = 16 / E::BYTES as usize; // elements per chunk
        let mut ch = t;
        while ch < BC * D / vec {
            let e = ch * vec;
            let (rr, c) = (e / D, e % D);
            let j = kv0 + rr;
            if j < block_end && (c as u64) < d {
                let row = unsafe { p.cache_row_of(slot, pad + j as u32, hk as u32) } as u64 * d + c as u64;
                unsafe {
                    E::stage16(p.k_cache + E::BYTES * row, k_s.add(e));
                    E::stage16(p.v_cache + E::BYTES * row, v_s.add(e));
                }
            } else {
                for i in 0..vec {
                    unsafe {
                        *k_s.add(e + i) = 0.0;
                        *v_s.add(e + i) = 0.0;
                    }
                }
            }
            ch += threads;
        }
        sync_threads();

        let mut r0 = 0usize;
        while r0 < BC {
            let mut s = [0.0f32; KC];
            let mut chunk_max = f32::NEG_INFINITY;
            unroll!(c in 0..KC => {
                let rr = r0 + c;
                let mut part = 0.0f32;
                for (k, qk) in q.iter().enumerate() {
                    part = fma(*qk, unsafe { *k_s.add(rr * D + lane + TPR * k) }, part);
                }
                let mut w = 1;
                while w < TPR {
                    part += shfl_xor(part, w as u32);
                    w <<= 1;
                }
                if softcap > 0.0 {
                    part = softcap * tanh(part / softcap) * LOG2E;
                }
                let key = (kv0 + rr) as i64;
                s[c] = if key >= row_start && key < row_end { part } else { f32::NEG_INFINITY };
            });
            // ALiBi: one uniform branch per chunk (a masked -inf stays -inf).
            if alibi2 != 0.0 {
                unroll!(c in 0..KC => {
                    s[c] = fma(alibi2, alibi_distance(row_diag, (kv0 + r0 + c) as i32), s[c]);
                });
            }
            unroll!(c in 0..KC => { chunk_max = fmax(chunk_max, s[c]); });
            // Lazy rescale (`must_rescale`): only when some row of the warp has grown by more
            // than 2^8, a warp vote, so the branch is uniform (the shuffles after it need every
            // lane).
            let rescale = if warp_any(row_sm.must_raise(chunk_max)) {
                let rescale = row_sm.raise_max(chunk_max);
                for a in acc.iter_mut() {
                    *a *= rescale.alpha;
                }
                rescale
            } else {
                row_sm.keep()
            };
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

    if row_valid {
        // A sink joins the denominator of split 0 only, so the merge counts it once.
        let (inv_l, lse) = if p.sinks != 0 && split == 0 {
            row_sm.finish_with_sink(row_sm.l, unsafe { ld_f32(p.sinks + 4 * h as u64) } * LOG2E)
        } else {
            row_sm.finish(row_sm.l)
        };
        // Row (b, h, qi) of the [batch, heads, seq_q] LSE and of each split's partials.
        let row_idx = (b * heads + h as u64) * seq_q + qi as u64;
        // An FP8 cache's V scale joins the normaliser (see `Stage16::scale`).
        let inv_l = inv_l * unsafe { E::scale(p.v_scale, hk) };
        if p.num_splits == 1 {
            let oa = p.o + E::Qo::BYTES * (((b * seq_q + qi as u64) * heads + h as u64) * d);
            unroll!(k in 0..DPT => {
                if ((lane + TPR * k) as u64) < d {
                    unsafe { <E::Qo as Elem>::store(oa + E::Qo::BYTES * (lane + TPR * k) as u64, acc[k] * inv_l) };
                }
            });
            if lane == 0 {
                unsafe { st_f32(p.lse + 4 * row_idx, lse) };
            }
        } else {
            let part_row = split as u64 * p.batch as u64 * heads * seq_q + row_idx;
            let oa = p.o_part + 4 * part_row * d;
            unroll!(k in 0..DPT => {
                if ((lane + TPR * k) as u64) < d {
                    unsafe { st_f32(oa + 4 * (lane + TPR * k) as u64, acc[k] * inv_l) };
                }
            });
            if lane == 0 {
                unsafe { st_f32(p.lse_part + 4 * part_row, lse) };
            }
        }
    }
}
