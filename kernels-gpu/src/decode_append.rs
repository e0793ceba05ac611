//! `decode_append_{f32,bf16,f16}`: writes the new keys and values `k_new`, `v_new` into the KV
//! cache at `cache_seqlens`, in place, before the decode forward attends over them
//! (FlashAttention-2's `flash_attn_with_kvcache` with `k`/`v` given).
//!
//! Algorithm: a copy. Token `t` of sequence `b` goes to cache row `cache_seqlens[b] + t`, through
//! the block table when the cache is paged (see [`crate::decode_abi`]). The elements pass through
//! f32 unchanged (bf16 and f16 widen to f32 exactly and narrow back to the same bits).
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

/// The generic body; `THREADS` threads per block.
///
/// # Safety
/// As the module's safety section.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn append<E: Elem, const THREADS: u32>(p: &DecodeParams) {
    let tok = ctaid_x() as u64;
    let b = ctaid_y() as u64;
    let (hkv, d) = (p.heads_kv as u64, p.head_dim as u64);
    let j = unsafe { ld_u32(p.cache_seqlens + 4 * b) } as u64 + tok;
    let src_row = (b * p.seq_new as u64 + tok) * hkv * d;
    let mut e = tid_x() as u64;
    while e < hkv * d {
        let (hk, c) = (e / d, e % d);
        let dst = unsafe { p.cache_row_of(b as u32, j as u32, hk as u32) } as u64 * d + c;
        unsafe {
            E::store(p.k_cache + E::BYTES * dst, E::load(p.k_new + E::BYTES * (src_row + e)));
            E::store(p.v_cache + E::BYTES * dst, E::load(p.v_new + E::BYTES * (src_row + e)));
        }
        e += THREADS as u64;
    }
}
