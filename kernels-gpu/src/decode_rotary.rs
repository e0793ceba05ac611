//! `decode_rotary_{f32,bf16,f16}`: FlashAttention-2's rotary embedding of a KV-cache call
//! (`rotary_cos`, `rotary_sin`, `rotary_interleaved`), as a pass before the append and the
//! decode forward: it writes rotated copies of `q` and `k_new` (`q_rot`, `k_rot`), which those
//! kernels then read in place of the originals; `v_new` is not rotated.
//!
//! Positions: new key `t` of sequence `b` is at `cache_seqlens[b] + t` (the cache row it is
//! appended to); query token `i` at `cache_seqlens[b] + i` when `rotary_q_per_token` (causal or
//! windowed calls), else every query token at `cache_seqlens[b]` (FlashAttention-2's rule).
//! Within a head, the pairs of [`crate::decode_abi::rotary_pair`] of the first `rotary_dim`
//! dims are rotated by [`crate::decode_abi::rotate`] with `cos[pos, i]`, `sin[pos, i]`; the
//! other dims are copied.
//!
//! Tile ([`crate::tiles::APPEND`]): one block per `(token, sequence)`, grid `(seq_q + seq_new,
//! batch, 1)`, tokens `0..seq_q` of q then `0..seq_new` of k_new; 128 threads stride over the
//! token's `heads * head_dim / 2` (or `heads_kv * ...`) dim pairs.
//!
//! # Safety
//! The pointers in `p` must be valid for the shapes in `p`, and every position must be below
//! `seqlen_ro` (the host checks it).

#[cfg(target_arch = "nvptx64")]
use crate::decode_abi::{rotary_pair, rotate, DecodeParams};
#[cfg(target_arch = "nvptx64")]
use crate::device::*;

/// The generic body; `THREADS` threads per block.
///
/// # Safety
/// As the module's safety section.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn rotary<E: Elem, const THREADS: u32>(p: &DecodeParams) {
    let tok = ctaid_x();
    let b = ctaid_y();
    let d = p.head_dim;
    let start = unsafe { ld_u32(p.cache_seqlens + 4 * b as u64) };
    // q tokens first, then the new keys.
    let (src, dst, heads, row, pos) = if tok < p.seq_q {
        let pos = start + if p.rotary_q_per_token != 0 { tok } else { 0 };
        (p.q, p.q_rot, p.heads, (b * p.seq_q + tok) as u64, pos)
    } else {
        let t = tok - p.seq_q;
        (p.k_new, p.k_rot, p.heads_kv, (b * p.seq_new + t) as u64, start + t)
    };
    let half = p.rotary_dim / 2;
    let inter = p.rotary_interleaved != 0;
    let base = row * heads as u64 * d as u64;
    // Work item e of heads * d / 2: head e / (d / 2), pair e % (d / 2); pairs past the rotary
    // ones copy two dims (2i, 2i + 1) of the unrotated tail.
    let pairs = d / 2;
    let mut e = tid_x();
    while e < heads * pairs {
        let (h, i) = (e / pairs, e % pairs);
        let at = base + (h * d) as u64;
        let (x0, x1) = if i < half { rotary_pair(i, p.rotary_dim, inter) } else { (2 * i, 2 * i + 1) };
        unsafe {
            let x = E::load(src + E::BYTES * (at + x0 as u64));
            let y = E::load(src + E::BYTES * (at + x1 as u64));
            let (u, v) = if i < half {
                let cs = (pos * half + i) as u64;
                rotate(x, y, E::load(p.rotary_cos + E::BYTES * cs), E::load(p.rotary_sin + E::BYTES * cs))
            } else {
                (x, y)
            };
            E::store(dst + E::BYTES * (at + x0 as u64), u);
            E::store(dst + E::BYTES * (at + x1 as u64), v);
        }
        e += THREADS;
    }
}
