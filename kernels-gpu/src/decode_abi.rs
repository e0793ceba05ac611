//! The ABI of the KV-cache decode kernels: [`DecodeParams`] (split-KV decode forward and cache
//! append) and [`MergeParams`] (the combine kernel `merge_states`), and the split plan's index
//! math, shared by host and device.
//!
//! Semantics follow FlashAttention-2's `flash_attn_with_kvcache`:
//! - Q, O `[batch, seq_q, heads, head_dim]`, contiguous (BSHD), element type of the kernel.
//! - KV cache, contiguous: `[batch, seq_cache, heads_kv, head_dim]` (`block_table == 0`); paged:
//!   `[num_pages, page_size, heads_kv, head_dim]` with `block_table` `[batch, max_pages]` u32 (key
//!   `j` of sequence `b` lives in page `block_table[b * max_pages + j / page_size]`, row
//!   `j % page_size`). Any `page_size >= 1`.
//! - `cache_seqlens[batch]` u32: keys in the cache *before* the append. Optional `k_new`, `v_new`
//!   `[batch, seq_new, heads_kv, head_dim]` are written into the cache at
//!   `cache_seqlens[b] .. cache_seqlens[b] + seq_new` (kernel `decode_append_*`) before attention;
//!   the sequence then has `seqlen_k = cache_seqlens[b] + seq_new` keys. `cache_seqlens` itself is
//!   not changed (the caller advances it, as with FlashAttention-2).
//! - Contiguous cache only, as in FlashAttention-2: `cache_batch_idx[batch]` u32 (optional) is
//!   the cache slot of each sequence (the cache's first dimension may exceed `batch`), and
//!   `cache_leftpad[batch]` u32 (optional) the row where each sequence's keys begin: the keys of
//!   sequence `b` are cache rows `cache_leftpad[b] .. cache_seqlens[b] + seq_new` of slot
//!   `cache_batch_idx[b]`, so `seqlen_k = cache_seqlens[b] - cache_leftpad[b] + seq_new`, and key
//!   `j` of the sequence is row `cache_leftpad[b] + j` ([`DecodeParams::slot`]).
//! - GQA: query head `h` reads KV head `h / (heads / heads_kv)`.
//! - Masking is bottom-right aligned (FlashAttention-2): with `diag = i + seqlen_k - seq_q`,
//!   query `i` sees key `j` iff `j >= diag - window_left` (when `window_left >= 0`) and
//!   `j <= diag + window_right` (when `window_right >= 0`); causal is `window_right = 0`; `-1`: all.
//!   A row that sees no key gives `O = 0`, `LSE = -inf`. LSE is natural log, `[batch, heads,
//!   seq_q]` f32 ([`key_range`]).
//! - FP8 cache (rows of element type `fp8_e4m3` / `fp8_e5m2`): Q, O, `k_new` and `v_new` are
//!   bf16, the cache one byte per element in that format ([`crate::fp8`]), with f32 scales per KV
//!   head for K and for V (`k_scale`, `v_scale`, `[heads_kv]`): the append stores
//!   `encode(x / scale)` (nearest even, saturating), the decode reads `decode(byte) * scale`.
//! - Split-KV: split `s` of `num_splits` covers key tiles `[s * tps, (s + 1) * tps)` of its
//!   sequence, `tps = ceil(ceil(seqlen_k / BC) / num_splits)` ([`split_range`]), and writes f32
//!   partial O (normalised by its own sum) and partial LSE (`-inf` for an empty split) into
//!   `o_part` `[num_splits, batch, heads, seq_q, head_dim]` and `lse_part` `[num_splits, batch,
//!   heads, seq_q]`; `merge_states` combines them. With `num_splits == 1` the decode kernel
//!   writes O and LSE directly and the workspace is unused.

/// Parameters of the decode forward (`decode_fwd_*`) and cache-append (`decode_append_*`)
/// kernels, passed by value (`.param .align 8 .b8 ..._param_0[264]`). Pointers are device
/// addresses, 0 where unused (`block_table` 0: contiguous cache; `k_new`/`v_new` with
/// `seq_new == 0`; `o_part`/`lse_part` with `num_splits == 1`). `q`, `k_cache` and `v_cache` must
/// be 16-byte aligned (both decode forwards read them in 16-byte chunks; allocations are).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DecodeParams {
    pub q: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub k_new: u64,
    pub v_new: u64,
    pub block_table: u64,
    pub cache_seqlens: u64,
    pub o: u64,
    pub lse: u64,
    pub o_part: u64,
    pub lse_part: u64,
    pub batch: u32,
    pub heads: u32,
    pub heads_kv: u32,
    pub seq_q: u32,
    pub head_dim: u32,
    /// Contiguous cache: keys per sequence the cache holds (its second dimension).
    pub seq_cache: u32,
    /// Paged cache: keys per page (>= 1).
    pub page_size: u32,
    /// Paged cache: entries per row of `block_table`.
    pub max_pages: u32,
    pub seq_new: u32,
    pub num_splits: u32,
    /// 0 or 1.
    pub causal: u32,
    /// Multiplies QKᵀ before the softmax (usually 1/sqrt(head_dim)).
    pub softmax_scale: f32,
    /// Keys left of the diagonal a query sees (`-1`: all).
    pub window_left: i32,
    /// Keys right of the diagonal a query sees (`-1`: all; causal forces 0).
    pub window_right: i32,
    /// Score soft-capping (Gemma-2, FlashAttention-2's `softcap`): a score `s = scale * q.k`
    /// becomes `softcap * tanh(s / softcap)` before the softmax; 0 turns it off.
    pub softcap: f32,
    /// `decode_check_*` only: the first dimension of the cache (paged: its pages; contiguous:
    /// its slots), the bound of every block-table entry or `cache_batch_idx` entry.
    pub cache_slots: u32,
    /// Attention sinks: `heads` f32 logits, one per query head, that join the softmax
    /// denominator only (`docs/semantics.md`); 0: none. The decode kernels count a sink in split
    /// 0 only (split 0 always exists), so `merge_states` sums it exactly once.
    pub sinks: u64,
    /// FP8 cache (the `fp8` rows): `heads_kv` f32 scales of the K cache, one per KV head (a
    /// per-tensor scale is the same value in every slot); the cache holds `encode(k / scale)`
    /// ([`crate::fp8`]) and the kernels read `decode(byte) * scale`. 0 for other caches.
    pub k_scale: u64,
    /// FP8 cache: `heads_kv` f32 scales of the V cache, as `k_scale`.
    pub v_scale: u64,
    /// Contiguous cache: `batch` u32 cache slots, the first dimension index of each sequence's
    /// keys (FlashAttention-2's `cache_batch_idx`); 0: sequence `b` is slot `b`.
    pub cache_batch_idx: u64,
    /// Contiguous cache: `batch` u32 rows of left padding (FlashAttention-2's `cache_leftpad`):
    /// sequence `b`'s keys begin at cache row `cache_leftpad[b]`; 0: at row 0.
    pub cache_leftpad: u64,
    /// Rotary embedding (`decode_rotary_*` only): `[seqlen_ro, rotary_dim / 2]` cosines and sines
    /// in the kernel's element type (FlashAttention-2's `rotary_cos`, `rotary_sin`); 0: none.
    pub rotary_cos: u64,
    pub rotary_sin: u64,
    /// `decode_rotary_*`: where the rotated `q` and `k_new` go (same shapes as `q`, `k_new`).
    pub q_rot: u64,
    pub k_rot: u64,
    /// Leading dims of each head that rotate (even, at most `head_dim`); the rest are copied.
    pub rotary_dim: u32,
    /// 1: pairs `(2i, 2i + 1)` (GPT-J, FlashAttention-2's `rotary_interleaved=True`); 0: pairs
    /// `(i, i + rotary_dim / 2)` (GPT-NeoX).
    pub rotary_interleaved: u32,
    /// Rows of `rotary_cos` and `rotary_sin` (the host checks every position is below it).
    pub seqlen_ro: u32,
    /// 1: query token `i` is at position `cache_seqlens[b] + i` (causal or windowed calls); 0:
    /// every query token is at `cache_seqlens[b]` (FlashAttention-2's rule).
    pub rotary_q_per_token: u32,
    /// ALiBi (FlashAttention-2's `alibi_slopes`): f32 slopes, slope of sequence `b`, query head
    /// `h` at `b * alibi_batch_stride + h`; the score of query token `i` and key `j` gains
    /// `-slope * |i + seqlen_k - seq_q - j|`; 0: none.
    pub alibi_slopes: u64,
    /// `heads` for `[batch, heads]` slopes, 0 for one `[heads]` row.
    pub alibi_batch_stride: u32,
    pub _pad2: u32,
    /// Device-checked indices ([`crate::kv_check`]): the address of the call's status words, or
    /// 0 (indices checked on the host). When non-zero, every kernel of the call returns at once
    /// if status word 0 is set (a violation found by `decode_check_*` of this or an earlier
    /// call), so no index that failed the check is ever used.
    pub status: u64,
}

/// Size in bytes of [`DecodeParams`] as the kernels see it.
pub const DECODE_PARAMS_BYTES: usize = 264;
const _: () = assert!(core::mem::size_of::<DecodeParams>() == DECODE_PARAMS_BYTES);
const _: () = assert!(core::mem::align_of::<DecodeParams>() == 8);

impl DecodeParams {
    /// The struct as the bytes a launch passes for parameter 0 (little-endian, as on the GPU).
    pub fn to_bytes(&self) -> [u8; DECODE_PARAMS_BYTES] {
        let mut out = [0u8; DECODE_PARAMS_BYTES];
        let mut at = 0;
        for p in [
            self.q,
            self.k_cache,
            self.v_cache,
            self.k_new,
            self.v_new,
            self.block_table,
            self.cache_seqlens,
            self.o,
            self.lse,
            self.o_part,
            self.lse_part,
        ] {
            out[at..at + 8].copy_from_slice(&p.to_le_bytes());
            at += 8;
        }
        for x in [
            self.batch,
            self.heads,
            self.heads_kv,
            self.seq_q,
            self.head_dim,
            self.seq_cache,
            self.page_size,
            self.max_pages,
            self.seq_new,
            self.num_splits,
            self.causal,
            self.softmax_scale.to_bits(),
            self.window_left as u32,
            self.window_right as u32,
            self.softcap.to_bits(),
            self.cache_slots,
        ] {
            out[at..at + 4].copy_from_slice(&x.to_le_bytes());
            at += 4;
        }
        for p in [
            self.sinks,
            self.k_scale,
            self.v_scale,
            self.cache_batch_idx,
            self.cache_leftpad,
            self.rotary_cos,
            self.rotary_sin,
            self.q_rot,
            self.k_rot,
        ] {
            out[at..at + 8].copy_from_slice(&p.to_le_bytes());
            at += 8;
        }
        for x in [self.rotary_dim, self.rotary_interleaved, self.seqlen_ro, self.rotary_q_per_token] {
            out[at..at + 4].copy_from_slice(&x.to_le_bytes());
            at += 4;
        }
        out[at..at + 8].copy_from_slice(&self.alibi_slopes.to_le_bytes());
        at += 8;
        for x in [self.alibi_batch_stride, self._pad2] {
            out[at..at + 4].copy_from_slice(&x.to_le_bytes());
            at += 4;
        }
        out[at..at + 8].copy_from_slice(&self.status.to_le_bytes());
        at += 8;
        debug_assert_eq!(at, DECODE_PARAMS_BYTES);
        out
    }

    /// Query heads per KV head (packed as rows of one tile).
    #[inline(always)]
    pub const fn group(&self) -> u32 {
        self.heads / self.heads_kv
    }

    /// The cache row of key (or value) `j` of sequence `b`, KV head `hk`, in units of
    /// `head_dim` elements (its element offset is `row * head_dim`): the page lookup, one rule
    /// for every decode kernel and the cache append.
    ///
    /// Contiguous (`block_table == 0`): `(b * seq_cache + j) * heads_kv + hk`. Paged: the key's
    /// block-table slot is `b * max_pages + j / page_size`, `page = block_table_entry(slot)` (a
    /// load on the device, `DecodeParams::cache_row_of`; an index into the table on the host),
    /// and the row `(page * page_size + j % page_size) * heads_kv + hk`.
    ///
    /// 32-bit: keys are below 2^31 (the host checks `cache_seqlens + seq_new`), and a cache row
    /// is at least 64 bytes (64 FP8 elements), so 2^32 of them would be 256 GiB, more than a
    /// device holds; 32-bit row math keeps the kernels' per-row bookkeeping in single registers.
    #[inline(always)]
    pub fn cache_row(&self, b: u32, j: u32, hk: u32, block_table_entry: impl FnOnce(u64) -> u32) -> u32 {
        let row = if self.block_table != 0 {
            let (slot, within) = page_slot(self.page_size, j);
            let page = block_table_entry(b as u64 * self.max_pages as u64 + slot as u64);
            page * self.page_size + within
        } else {
            b * self.seq_cache + j
        };
        row * self.heads_kv + hk
    }

    /// Sequence `b`'s cache slot and left padding, `(cache_batch_idx[b], cache_leftpad[b])`, each
    /// `(b, 0)` when its pointer is 0, read by `read(address)` (a load on the device,
    /// `DecodeParams::slot_of`). Its key `j` is then [`DecodeParams::cache_row`] of
    /// `(slot, leftpad + j)`: a paged cache has neither (the host refuses them), so there slot is
    /// `b` and leftpad 0.
    #[inline(always)]
    pub fn slot(&self, b: u32, read: impl Fn(u64) -> u32) -> (u32, u32) {
        let slot = if self.cache_batch_idx != 0 { read(self.cache_batch_idx + 4 * b as u64) } else { b };
        let pad = if self.cache_leftpad != 0 { read(self.cache_leftpad + 4 * b as u64) } else { 0 };
        (slot, pad)
    }

    /// [`DecodeParams::slot`] on the device.
    ///
    /// # Safety
    /// `cache_batch_idx` and `cache_leftpad` (when non-zero) must be valid device addresses of
    /// `batch` u32.
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    pub unsafe fn slot_of(&self, b: u32) -> (u32, u32) {
        self.slot(b, |addr| unsafe { crate::device::ld_u32(addr) })
    }

    /// [`DecodeParams::cache_row`] on the device, reading the block table (`u32` entries at
    /// `block_table`) from global memory.
    ///
    /// # Safety
    /// `block_table` (when non-zero) must be a valid device address of `[batch, max_pages]` u32.
    #[cfg(target_arch = "nvptx64")]
    #[inline(always)]
    pub unsafe fn cache_row_of(&self, b: u32, j: u32, hk: u32) -> u32 {
        self.cache_row(b, j, hk, |slot| unsafe { crate::device::ld_u32(self.block_table + 4 * slot) })
    }
}

/// The rotary rule, one for the kernel and the host's expected values: pair `i` (of
/// `rotary_dim / 2`) of a head is dims `(2i, 2i + 1)` when interleaved, else `(i, i +
/// rotary_dim / 2)`; with `c = cos[pos, i]`, `s = sin[pos, i]` it becomes `(x·c − y·s, x·s + y·c)`
/// in f32, each product rounded, then the sum (no fused multiply-add), and the result is
/// rounded to the element type by the store.
#[inline(always)]
pub const fn rotary_pair(i: u32, rotary_dim: u32, interleaved: bool) -> (u32, u32) {
    if interleaved {
        (2 * i, 2 * i + 1)
    } else {
        (i, i + rotary_dim / 2)
    }
}

/// One rotation ([`rotary_pair`]).
#[inline(always)]
pub fn rotate(x: f32, y: f32, c: f32, s: f32) -> (f32, f32) {
    (x * c - y * s, x * s + y * c)
}

/// `(j / page_size, j % page_size)`: a shift and a mask when `page_size` is a power of two (a
/// uniform branch; the division is a long instruction sequence on the GPU), a division otherwise.
#[inline(always)]
pub const fn page_slot(page_size: u32, j: u32) -> (u32, u32) {
    if page_size & page_size.wrapping_sub(1) == 0 {
        (j >> page_size.trailing_zeros(), j & (page_size - 1))
    } else {
        (j / page_size, j % page_size)
    }
}

/// The window rule, [`crate::mask::key_range`], re-exported where the decode ABI is described:
/// with `seq_kv` the sequence's keys `cache_seqlens[b] + seq_new`.
pub use crate::mask::key_range;

/// Keys `[lo, hi)` that split `split` of `num_splits` covers in a sequence of `seqlen_k` keys,
/// for key tiles of `bc`: whole tiles, `ceil(tiles / num_splits)` per split, the last ones
/// possibly empty (`lo >= hi`). The same rule on host and device, so the host can state the plan.
#[inline(always)]
pub const fn split_range(seqlen_k: u32, num_splits: u32, split: u32, bc: u32) -> (u32, u32) {
    let tiles = seqlen_k.div_ceil(bc);
    let per = tiles.div_ceil(if num_splits == 0 { 1 } else { num_splits });
    let lo = split as u64 * per as u64 * bc as u64;
    let hi = lo + per as u64 * bc as u64;
    let lo = if lo > seqlen_k as u64 { seqlen_k } else { lo as u32 };
    let hi = if hi > seqlen_k as u64 { seqlen_k } else { hi as u32 };
    (lo, hi)
}

/// The status words of a KV-cache call with device-checked indices ([`DecodeParams::status`]):
/// [`kv_status::WORDS`] u32, zero while no violation was found. `decode_check_*` claims word 0
/// with the rule's code by a compare-and-swap (the first violation found wins), then writes the
/// sequence in word 1 and the rule's values in words 2.. (listed per code). Every kernel of a
/// call returns at once while word 0 is set; only the host clears the words (after reading
/// them).
pub mod kv_status {
    /// u32 words: code, sequence, up to six values.
    pub const WORDS: usize = 8;
    /// Contiguous cache: `cache_seqlens[b] + seq_new > seq_cache`. Values: `cache_seqlens[b]`,
    /// `seq_new`, `seq_cache`.
    pub const CAPACITY: u32 = 1;
    /// Paged cache: the sequence needs more pages than a block-table row holds. Values:
    /// `cache_seqlens[b]`, `seq_new`, pages needed, `page_size`, `max_pages`.
    pub const PAGES: u32 = 2;
    /// A used block-table entry `>= num_pages`. Values: its slot in the row, the entry,
    /// `num_pages`.
    pub const PAGE_PAST_END: u32 = 3;
    /// `cache_batch_idx[b] >=` the cache's slots. Values: the entry, the slots.
    pub const SLOT_PAST_END: u32 = 4;
    /// `cache_leftpad[b] > cache_seqlens[b]`. Values: the left padding, `cache_seqlens[b]`.
    pub const LEFTPAD: u32 = 5;
    /// Two sequences that append share a cache slot. Values: the slot, the other sequence.
    pub const SHARED_SLOT: u32 = 6;
    /// A page that receives new tokens is used twice. Values: the page.
    pub const SHARED_WRITTEN_PAGE: u32 = 7;
}

/// Parameters of `merge_states_*` (the split-KV combine), passed by value
/// (`.param .align 8 .b8 ..._param_0[88]`).
///
/// `o_part` `[splits, batch, heads, seq_q, head_dim]` f32 and `lse_part` `[splits, batch, heads,
/// seq_q]` f32 (natural log, `-inf` for a split that saw no key), contiguous; `o` is written in
/// the kernel's element type with `o_strides` (BSHD or BHSD, see [`crate::abi::Strides`]); `lse`
/// `[batch, heads, seq_q]` f32.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MergeParams {
    pub o_part: u64,
    pub lse_part: u64,
    pub o: u64,
    pub lse: u64,
    pub o_strides: crate::abi::Strides,
    pub splits: u32,
    pub batch: u32,
    pub heads: u32,
    pub seq_q: u32,
    pub head_dim: u32,
    pub _pad: u32,
    /// As [`DecodeParams::status`]: 0, or the status words whose word 0 set makes the kernel
    /// return at once.
    pub status: u64,
}

/// Size in bytes of [`MergeParams`] as the kernels see it.
pub const MERGE_PARAMS_BYTES: usize = 88;
const _: () = assert!(core::mem::size_of::<MergeParams>() == MERGE_PARAMS_BYTES);
const _: () = assert!(core::mem::align_of::<MergeParams>() == 8);

impl MergeParams {
    /// The struct as the bytes a launch passes for parameter 0.
    pub fn to_bytes(&self) -> [u8; MERGE_PARAMS_BYTES] {
        let mut out = [0u8; MERGE_PARAMS_BYTES];
        let mut at = 0;
        let s = self.o_strides;
        for p in [self.o_part, self.lse_part, self.o, self.lse, s.batch, s.seq, s.head] {
            out[at..at + 8].copy_from_slice(&p.to_le_bytes());
            at += 8;
        }
        for x in [self.splits, self.batch, self.heads, self.seq_q, self.head_dim, self._pad] {
            out[at..at + 4].copy_from_slice(&x.to_le_bytes());
            at += 4;
        }
        out[at..at + 8].copy_from_slice(&self.status.to_le_bytes());
        at += 8;
        debug_assert_eq!(at, MERGE_PARAMS_BYTES);
        out
    }

    /// Rows to merge: `batch * heads * seq_q`.
    pub const fn rows(&self) -> u64 {
        self.batch as u64 * self.heads as u64 * self.seq_q as u64
    }
}

#[cfg(all(feature = "unit-tests", not(target_arch = "nvptx64")))]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    pub fn splits_cover_every_key_once_in_whole_tiles() {
        for seqlen in [0u32, 1, 31, 32, 33, 200, 8192] {
            for n in [1u32, 2, 3, 7, 16, 64] {
                let mut next = 0;
                for s in 0..n {
                    let (lo, hi) = split_range(seqlen, n, s, 32);
                    if lo < hi {
                        assert_eq!(lo, next, "seqlen {seqlen} splits {n} split {s}");
                        assert!(lo.is_multiple_of(32));
                        next = hi;
                    }
                }
                assert_eq!(next, seqlen, "seqlen {seqlen} splits {n}");
            }
        }
        assert_eq!(split_range(100, 2, 0, 32), (0, 64));
        assert_eq!(split_range(100, 2, 1, 32), (64, 100));
        assert_eq!(split_range(40, 4, 3, 32), (40, 40));
    }

    pub fn params_serialise_in_field_order() {
        let p = DecodeParams { q: 1, lse_part: 11, batch: 3, softmax_scale: 0.5, ..Default::default() };
        let b = p.to_bytes();
        assert_eq!(&b[0..8], &1u64.to_le_bytes());
        assert_eq!(&b[80..88], &11u64.to_le_bytes());
        assert_eq!(&b[88..92], &3u32.to_le_bytes());
        assert_eq!(&b[132..136], &0.5f32.to_bits().to_le_bytes());
        let b = DecodeParams { window_left: -1, window_right: 7, ..Default::default() }.to_bytes();
        assert_eq!((&b[136..140], &b[140..144]), (&(-1i32).to_le_bytes()[..], &7i32.to_le_bytes()[..]));
        let b = DecodeParams { sinks: 0x1234, ..Default::default() }.to_bytes();
        assert_eq!(&b[152..160], &0x1234u64.to_le_bytes());
        let b = DecodeParams { k_scale: 0x55, v_scale: 0x66, ..Default::default() }.to_bytes();
        assert_eq!((&b[160..168], &b[168..176]), (&0x55u64.to_le_bytes()[..], &0x66u64.to_le_bytes()[..]));
        let b = DecodeParams { cache_batch_idx: 0x77, cache_leftpad: 0x88, ..Default::default() }.to_bytes();
        assert_eq!((&b[176..184], &b[184..192]), (&0x77u64.to_le_bytes()[..], &0x88u64.to_le_bytes()[..]));
        let b =
            DecodeParams { rotary_cos: 0x99, k_rot: 0xAA, rotary_dim: 32, rotary_q_per_token: 1, ..Default::default() }
                .to_bytes();
        assert_eq!((&b[192..200], &b[216..224]), (&0x99u64.to_le_bytes()[..], &0xAAu64.to_le_bytes()[..]));
        assert_eq!((&b[224..228], &b[236..240]), (&32u32.to_le_bytes()[..], &1u32.to_le_bytes()[..]));
        let b = DecodeParams { alibi_slopes: 0xBB, alibi_batch_stride: 5, ..Default::default() }.to_bytes();
        assert_eq!((&b[240..248], &b[248..252]), (&0xBBu64.to_le_bytes()[..], &5u32.to_le_bytes()[..]));
        let b = DecodeParams { cache_slots: 0x33, status: 0xCC, ..Default::default() }.to_bytes();
        assert_eq!((&b[148..152], &b[256..264]), (&0x33u32.to_le_bytes()[..], &0xCCu64.to_le_bytes()[..]));
        let m = MergeParams { lse: 4, splits: 9, _pad: 0, ..Default::default() };
        let b = m.to_bytes();
        assert_eq!(&b[24..32], &4u64.to_le_bytes());
        assert_eq!(&b[56..60], &9u32.to_le_bytes());
        assert_eq!(&MergeParams { status: 0xDD, ..m }.to_bytes()[80..88], &0xDDu64.to_le_bytes());
    }

    pub fn cache_rows_of_contiguous_and_paged_layouts() {
        let mut p = DecodeParams { heads_kv: 2, head_dim: 4, seq_cache: 10, ..Default::default() };
        let no_table = |_| panic!("a contiguous cache has no block table");
        assert_eq!(p.cache_row(1, 3, 1, no_table), (10 + 3) * 2 + 1);
        p.block_table = 8;
        p.max_pages = 4;
        // Page size 3 (a division): key 7 is row 1 of slot 2; sequence 1's slot 2 holds page 5.
        p.page_size = 3;
        let table = [9u32, 9, 9, 9, 0, 0, 5, 0];
        assert_eq!(p.cache_row(1, 7, 1, |s| table[s as usize]), (5 * 3 + 1) * 2 + 1);
        // Page size 4 (a shift and a mask): key 7 is row 3 of slot 1, page 9 for sequence 0.
        p.page_size = 4;
        assert_eq!(p.cache_row(0, 7, 0, |s| table[s as usize]), (9 * 4 + 3) * 2);
        for ps in 1..20u32 {
            for j in 0..100u32 {
                assert_eq!(page_slot(ps, j), (j / ps, j % ps), "page size {ps} key {j}");
            }
        }
    }
}
