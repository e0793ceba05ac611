//! `decode_append_{f32,bf16,f16,fp8_e4m3,fp8_e5m2}`: writes the new keys and values `k_new`, `v_new` into the KV
//! cache at `cache_seqlens`, in place, before the decode forward attends over them
//! (FlashAttention-2's `flash_attn_with_kvcache` with `k`/`v` given).
//!
//! Algorithm: a copy. Token `t` of sequence `b` goes to cache row `cache_seqlens[b] + t` (of slot
//! `cache_batch_idx[b]` when given), through the block table when the cache is paged (see
//! [`crate::decode_abi`]). The elements pass through
//! f32 unchanged (bf16 and f16 widen to f32 exactly and narrow back to the same bits). An FP8
//! cache (bf16 `k_new`, `v_new`) is quantised here: the byte stored is
//! `encode(x / scale[hk])` ([`crate::fp8::encode`]: nearest even, saturating to the finite
//! range; vLLM's `stored = round(value / scale)`), with the K or V scale of the element's KV
//! head.
//!
//! Shapes: `k_new`, `v_new` `[batch, seq_new, heads_kv, D]`, the cache contiguous or paged.
//!
//! Tile ([`crate::tiles::APPEND`]): one block per `(token, sequence)`, grid `(seq_new, batch, 1)`;
//! its 128 threads stride over the `heads_kv * D` elements of the token (coalesced on both
//! sides: a cache row's heads are contiguous). No shared memory.
//!
//! # Safety
//! The pointers in `p` must be valid for the shapes in `p`, and `cache_seqlens[b] + seq_new` must
//! be within the cache (the host checks both against the pages or capacity it allocated).

#[cfg(target_arch = "nvptx64")]
use crate::decode_abi::DecodeParams;
#[cfg(target_arch = "nvptx64")]
use crate::device::*;

/// How a cache type stores one element of `k_new`/`v_new`.
#[cfg(target_arch = "nvptx64")]
pub(crate) trait AppendElem {
    /// Element type of `k_new` and `v_new`.
    type New: Elem;
    /// Bytes per cache element.
    const BYTES: u64;
    /// Stores `x` at `dst`; `scales` are the `heads_kv` f32 scales of this cache (FP8 only).
    ///
    /// # Safety
    /// `dst` must be a valid device address of one cache element; for FP8 `scales` valid for
    /// `heads_kv` f32.
    unsafe fn put(dst: u64, x: f32, scales: u64, hk: u64);
}

#[cfg(target_arch = "nvptx64")]
impl<E: Elem> AppendElem for E {
    type New = E;
    const BYTES: u64 = E::BYTES;
    #[inline(always)]
    unsafe fn put(dst: u64, x: f32, _scales: u64, _hk: u64) {
        unsafe { E::store(dst, x) }
    }
}

#[cfg(target_arch = "nvptx64")]
impl AppendElem for crate::fp8::Fp8E4m3 {
    type New = crate::mma::Bf16;
    const BYTES: u64 = 1;
    #[inline(always)]
    unsafe fn put(dst: u64, x: f32, scales: u64, hk: u64) {
        unsafe { put_fp8(crate::fp8::Fp8Format::E4m3, dst, x, scales, hk) }
    }
}

#[cfg(target_arch = "nvptx64")]
impl AppendElem for crate::fp8::Fp8E5m2 {
    type New = crate::mma::Bf16;
    const BYTES: u64 = 1;
    #[inline(always)]
    unsafe fn put(dst: u64, x: f32, scales: u64, hk: u64) {
        unsafe { put_fp8(crate::fp8::Fp8Format::E5m2, dst, x, scales, hk) }
    }
}

/// `encode(x / scale[hk])` stored as one byte (a true division, as the host's reference does).
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
unsafe fn put_fp8(f: crate::fp8::Fp8Format, dst: u64, x: f32, scales: u64, hk: u64) {
    unsafe {
        let s = ld_f32(scales + 4 * hk);
        *(dst as *mut u8) = crate::fp8::encode(f, x / s);
    }
}

/// The generic body; `THREADS` threads per block.
///
/// # Safety
/// As the module's safety section.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn append<E: AppendElem, const THREADS: u32>(p: &DecodeParams) {
    let tok = ctaid_x() as u64;
    let b = ctaid_y() as u64;
    let (hkv, d) = (p.heads_kv as u64, p.head_dim as u64);
    // Cache row cache_seqlens[b] + tok of the sequence's slot (left padding is below it).
    let j = unsafe { ld_u32(p.cache_seqlens + 4 * b) } as u64 + tok;
    let (slot, _) = unsafe { p.slot_of(b as u32) };
    let src_row = (b * p.seq_new as u64 + tok) * hkv * d;
    let mut e = tid_x() as u64;
    while e < hkv * d {
        let (hk, c) = (e / d, e % d);
        let dst = unsafe { p.cache_row_of(slot, j as u32, hk as u32) } as u64 * d + c;
        let nb = <E::New as Elem>::BYTES;
        unsafe {
            E::put(p.k_cache + E::BYTES * dst, E::New::load(p.k_new + nb * (src_row + e)), p.k_scale, hk);
            E::put(p.v_cache + E::BYTES * dst, E::New::load(p.v_new + nb * (src_row + e)), p.v_scale, hk);
        }
        e += THREADS as u64;
    }
}
