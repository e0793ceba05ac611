//! `flash_fwd_{bf16,f16}_d{32,64,96,128,192,256}`: fused attention forward on tensor cores (`mma.sync`
//! m16n8k16), 16-bit inputs and output, f32 accumulation and softmax.
//!
//! Algorithm (FlashAttention-2 forward): a block of warps (the tile's `warps`: 4 at D = 32 and
//! 64 and 128, 2 in the `_window` tile, 6 at D = 96 and 192, 8 at D = 256) owns `BR` query rows,
//! `MT` 16-row `mma` tiles per warp (the tile's `rows_per_warp`: 32 at D = 32, 64 and 96, 16 at
//! D = 128, 192 and 256; with 32 every K and V fragment loaded by `ldmatrix` feeds twice the
//! `mma`s), and walks the keys in tiles of `BC`: from the
//! last tile back to the first at `keys_backward` tiles (as FlashAttention-2 does: the one tile
//! that can reach past the last key is loaded before the loop, so the loop's loads carry no
//! bounds checks), else from the first. Q is staged once; the A fragments of its first
//! `q_reg_ksteps` k-steps stay in registers, the others are reloaded from shared memory in
//! every k-step. Per key tile: (1) wait for K, start loading V; (2) `S = Q Kᵀ` on tensor cores
//! into f32 accumulator fragments; (3) mask (and, in the soft-cap instantiation, cap); (4) take
//! the running row max on the raw scores with `max.f32`; only when some row of the warp has
//! grown by more than 2^8 (a warp vote; [`crate::softmax::must_rescale`]) raise the rows'
//! exponent bases and rescale the running sum and the output accumulator by
//! `2^((m_old - m_new)·c)` (`c` = scale · log2 e), so once the max settles a tile skips the
//! `O` rescale; (5)
//! `P = 2^(s·c - m·c)`, one FFMA into `ex2` per score, packed to 16 bits in registers — the
//! accumulator layout of one `mma` is the A-operand layout of the next, so P never touches shared
//! memory; (6) wait for V, start loading the next K, `O += P V`. Finally `O /= l` and
//! `LSE = ln 2 * (m·c + log2 l)`. A negative scale negates Q once in shared memory (exact) so the
//! max is always a max; a zero scale is raised to the smallest normal float. The soft cap is a
//! separate instantiation of the whole body, so the common key loop has no tanh; ALiBi is a third
//! (which takes the soft cap at run time), so the common loop has no bias either.
//!
//! Chunked prefill over a KV cache ([`crate::abi::AttnParams::seqused_k`]: each sequence has
//! its own key count): a fourth instantiation of the loop reads K and V from the cache, paged
//! (`[num_pages, page_size, heads_kv, D]` through
//! [`crate::abi::AttnParams::block_table`], any page size: each copy looks up its key row's
//! page) or contiguous; rows past the sequence's keys are zero-filled. The cache loop reloads every Q fragment from shared memory and starts the next K after
//! `P V` (its lookups need the registers), takes the soft cap at run time and has no ALiBi; only
//! the rows of 4 or more warps have it (a paged launch of a narrow-window row traps).
//!
//! Shapes: Q, O `[batch, seq_q, heads, D]`, K, V `[batch, seq_kv, heads_kv, D]`, bf16 or f16 (the
//! pointers in [`crate::abi::AttnParams`] point at 2-byte elements), strided in elements (see
//! [`crate::abi::Strides`]); LSE `[batch, heads, seq_q]` f32, natural log.
//!
//! Tiles ([`crate::tiles::FLASH_MMA_D64`], [`crate::tiles::FLASH_MMA_D128`],
//! [`crate::tiles::FLASH_MMA_D32`], the narrow-window tiles such as [`crate::tiles::FLASH_MMA_D128_WINDOW`],
//! [`crate::tiles::FLASH_MMA_D96`], [`crate::tiles::FLASH_MMA_D192`],
//! [`crate::tiles::FLASH_MMA_D256`]; shared memory `(BR + 2 BC) · D · 2` bytes, above 48 KiB
//! only with the opt-in, which the hosts request per kernel) are described at their items.
//! K and V each have one buffer, and the loads overlap compute as in FlashAttention-2: V of
//! tile `j` streams in while `S_j` and the softmax are computed, K of tile `j + 1` while
//! `P_j V_j` is. Both are `cp.async` copies of 16-byte chunks; rows past the end of a tensor are
//! zero-filled (source size 0), so they contribute exact zeros, never stale data. A copy pass of
//! 4 mod 8 rows (D = 192 at 3 or 9 warps, D = 256 at 4; no tile of the table has one today)
//! alternates between two swizzled destinations;
//! rows of 64 + 128n bytes (D = 32, 96) use the 4-chunk swizzle ([`crate::swizzle::TileLane`]
//! picks the lane addresses for either). Each thread
//! keeps one global pointer per tensor (`TileLoader`), moved by `BC` rows per tile; only the
//! tile that reaches past the last key checks rows (walking backward, it is loaded before the
//! loop).
//!
//! Shared-memory layout ([`crate::swizzle`]): each tile is row-major, one row = `D * 2` bytes =
//! `D / 8` chunks of 16 bytes. Chunk `c` of row `r` is stored at chunk position `c ^ (r % 8)`. An
//! `ldmatrix` phase reads the same logical chunk of 8 consecutive rows; the XOR puts those 8
//! chunks on 8 distinct 16-byte bank groups (all 32 banks), so `ldmatrix` is free of bank
//! conflicts, and the XOR permutes chunks within a row, so the `cp.async` stores of one row stay
//! conflict-free too.
//!
//! The running max (raw scores) and sum are kept per row a lane holds and finished by
//! [`crate::softmax::OnlineSoftmax::finish_with_sink`]; entry points are generated from the rows
//! of [`crate::variants`].
//!
//! Thread mapping: grid `(ceil(seq_q / BR), heads, batch)`, `THREADS = 32 * warps`. Warp `w`
//! owns rows `16 MT w..16 MT (w + 1)` of the block, m-tile `m` its rows `16m..16m + 16`; in every
//! fragment lane `l` (group `g = l / 4`, `t = l % 4`) holds rows `g` and `g + 8` of each m-tile
//! and, of every 8-column tile, columns `2t, 2t + 1` (see [`crate::mma`]; the index math, the
//! `ldmatrix` lane addresses and the fragment steps of the softmax are [`crate::frag`]'s,
//! shared with [`crate::decode_mma`]). A row's statistics are reduced over the 4 lanes of its
//! group with `shfl.sync.bfly` 1 and 2; the running sum `l` is kept per lane and reduced once at
//! the end. Tile loads: thread `i` copies chunk `i % (D / 8)` of rows
//! `i / (D / 8) + k * (THREADS / (D / 8))`.
//!
//! Semantics (`docs/semantics.md`): K/V head `h / (heads / heads_kv)` (GQA/MQA); window
//! `(left, right)` bottom-right aligned, causal = right 0 ([`crate::mask::key_range`]);
//! soft cap `c · tanh(scale · q·k / c)` ([`crate::softmax::softcap2`]); ALiBi's
//! `-slope · |i + seq_kv - seq_q - j|` after it ([`crate::abi::AttnParams::alibi_slopes`]); a
//! per-head sink logit in the denominator only ([`crate::softmax::OnlineSoftmax::finish_with_sink`]).
//!
//! Masking: keys outside a row's window `[start, end)` (and past `seq_kv`) score `-inf`. The
//! block visits only the key tiles that meet `[start of its first row, end of its last row)`
//! (cost scales with the window, not `seq_kv`), and each warp computes only the tiles that meet
//! its own rows' windows (the others are `-inf` for all of its rows: the block still loads them
//! for the other warps); a warp masks only the tiles that reach past its first row's end or
//! begin before its last row's start. A row that
//! sees no key gives `O = 0` and `LSE = -inf` (with a sink: `O = 0`, `LSE = sink`): while a
//! row's max is `-inf` the exponent base is 0,
//! so every `2^(-inf)` is 0 and never NaN. Rows past `seq_q` compute on zeros and store nothing;
//! every lane reaches every barrier, `ldmatrix` and `mma`.
//!
//! # Safety
//! All pointers in `p` must be valid for the shapes and strides in `p`; Q, K and V rows must be
//! 16-byte aligned (base pointers 16-byte aligned, `seq`, `head` and `batch` strides multiples of
//! 8 elements), O rows 4-byte aligned; `seq_kv < 2^31`; `softmax_scale` must be finite. The launch must use
//! the variant's `launch` (block size and dynamic shared memory, [`crate::variants::Variant::launch`]) on sm_80 or newer.

#[cfg(target_arch = "nvptx64")]
use crate::abi::AttnParams;
#[cfg(target_arch = "nvptx64")]
use crate::device::*;
#[cfg(target_arch = "nvptx64")]
use crate::frag::{
    ldsm_a_lane, ldsm_b_lane, ldsm_bt_lane, mask_outside, pack_a, quad_max, quad_sum, row_max, scale_row,
};
#[cfg(target_arch = "nvptx64")]
use crate::mma::*;
#[cfg(target_arch = "nvptx64")]
use crate::softmax::{must_rescale, softcap2, OnlineSoftmax, LOG2E};
#[cfg(target_arch = "nvptx64")]
#[cfg(target_arch = "nvptx64")]
use crate::staging::{stage_tile, Rows, SmemChunk};
#[cfg(target_arch = "nvptx64")]
use crate::swizzle::{copy_group_rows, copy_phases, copy_slot, swizzled_offset, LaneAddrs, TileLane, CHUNK};
use crate::timeline::{stamp, Phase};

/// One thread's share of the `cp.async` loads of successive `BC`-row tiles of K or V: one
/// global pointer (this thread's chunk of its first row of the next tile), moved by the uniform
/// `BC × stride` after each tile, forward or (`keys_backward` tiles) backward; the rows of one
/// tile are `rows_per_pass × stride` apart. Only the tile that reaches past the last row checks
/// rows (and zero-fills those past it); every other tile copies unconditionally.
#[cfg(target_arch = "nvptx64")]
#[derive(Clone, Copy)]
struct TileLoader {
    /// `.global` address of this thread's chunk in its first row of the next tile.
    next: u64,
    /// Bytes between consecutive rows.
    stride: u64,
    /// This thread's shared-memory offset within a tile (its chunk of its first row), a
    /// multiple of 16; in the backward walk bit 0 is set for a chunk past a head dim below `D`,
    /// whose copies ([`TileLoader::copy`]) then read nothing and zero-fill (so no other register
    /// is live through the key loop for it, and no copy branches on it). The forward walk's
    /// copies of such a chunk are the checked ones (its `left` is never positive).
    dst: u32,
    /// The same for its odd copy passes, when a pass is 4 mod 8 rows (the swizzle alternates).
    dst_odd: u32,
    /// Rows that exist minus this thread's first row of the next tile (negative: none left).
    left: i32,
}

#[cfg(target_arch = "nvptx64")]
impl TileLoader {
    /// The loader of `src` from row `row0` on, for thread `tid`.
    #[inline(always)]
    fn new<const D: usize, const THREADS: usize, const BACK: bool>(src: Rows, row0: usize, tid: usize) -> Self {
        let (r, c) = copy_slot(D, THREADS, tid, 0);
        let phases = const { copy_phases(D, THREADS) };
        TileLoader {
            next: src.base + (row0 + r) as u64 * src.stride + (c * CHUNK) as u64,
            stride: src.stride,
            // The backward walk's copies read bit 0; the forward walk's checked copies zero-fill
            // such a chunk by `left` alone, and its `dst` stays as it is. (Several phases: each
            // phase's copies check their own chunk against `dst_odd`.)
            dst: swizzled_offset(D, r, c) as u32 | if BACK && phases == 1 && !src.chunk_exists(c) { 1 } else { 0 },
            dst_odd: if phases == 1 {
                let rpp = const { copy_group_rows(D, THREADS) };
                (swizzled_offset(D, r + rpp, c) - rpp * D * 2) as u32
            } else {
                // Several phases (whole swizzle periods apart, no odd passes): the chunks of a
                // row that exist.
                src.cols.div_ceil((CHUNK / 2) as u32)
            },
            // A chunk past the head dim has no rows: `left <= 0` through the walk, so the forward
            // walk's copies of it are the checked ones, all zero-filled. (Several phases: the
            // rows past this thread's phase-0 row, whatever its chunk.)
            left: if phases > 1 || src.chunk_exists(c) { src.len as i32 } else { 0 } - (row0 + r) as i32,
        }
    }

    /// Starts the copies of the next tile into the swizzled tile at shared address `tile`
    /// (checking rows only if it reaches past the last one) and moves on to the tile after it.
    #[inline(always)]
    unsafe fn stage<const D: usize, const BC: usize, const THREADS: usize>(&mut self, tile: u32) {
        let rows_per_pass = const { copy_group_rows(D, THREADS) };
        // The furthest row this thread copies in the tile, past its phase-0 row: the last pass's
        // `BC - rows_per_pass`, and with several phases at most `ceil(THREADS (phases - 1) / CPR)`
        // more for the later phases' rows.
        let cpr = D * 2 / CHUNK;
        let reach = BC - rows_per_pass + (THREADS * (const { copy_phases(D, THREADS) } - 1)).div_ceil(cpr);
        if self.left >= (reach + 1) as i32 {
            // Every row of the tile exists (the common case): no checks.
            unsafe { self.copy_advance::<D, BC, THREADS, false>(tile) };
        } else {
            unsafe { self.copy_advance::<D, BC, THREADS, true>(tile) };
        }
        self.left -= BC as i32;
    }

    /// Starts the copies of the next tile with row checks, for the last tile, loaded before the
    /// loop of a `keys_backward` tile, and moves back a tile.
    #[inline(always)]
    unsafe fn stage_last<const D: usize, const BC: usize, const THREADS: usize>(&mut self, tile: u32) {
        unsafe { self.copy::<D, BC, THREADS, true>(tile) };
        self.back::<BC>();
    }

    /// Starts the copies of the next tile, every row of which exists (a tile before the last),
    /// and moves back a tile.
    #[inline(always)]
    unsafe fn stage_full<const D: usize, const BC: usize, const THREADS: usize>(&mut self, tile: u32) {
        unsafe { self.copy::<D, BC, THREADS, false>(tile) };
        self.back::<BC>();
    }

    /// Moves to the tile before (past the first, the address is formed but never read).
    #[inline(always)]
    fn back<const BC: usize>(&mut self) {
        self.next = self.next.wrapping_sub(BC as u64 * self.stride);
        self.left += BC as i32;
    }

    /// The copies of one tile; `CHECKED`: rows at or past the end are zero-filled (source size
    /// 0, naming the would-be address: nothing is read).
    #[inline(always)]
    unsafe fn copy<const D: usize, const BC: usize, const THREADS: usize, const CHECKED: bool>(&self, tile: u32) {
        if const { copy_phases(D, THREADS) } > 1 {
            unsafe { self.copy_phased::<D, BC, THREADS, CHECKED>(tile) };
            return;
        }
        let rows_per_pass = const { copy_group_rows(D, THREADS) };
        const { assert!(copy_group_rows(D, THREADS) % 4 == 0, "a thread's rows take one or two swizzles") };
        let tile = opaque_u32(tile);
        // Read through `opaque_u32` so that the mask and `fill` stay in the loop (hoisted, they
        // would be two more registers live through it).
        let own = opaque_u32(self.dst);
        let fill = ((own & 1) ^ 1) * CHUNK as u32;
        let (dst, dst_odd) = (tile + (own & !1), tile + self.dst_odd);
        let step = rows_per_pass as u64 * self.stride;
        unroll8!(k in 0..(BC / const { copy_group_rows(D, THREADS) }) => {
            let bytes = if !CHECKED || ((k * rows_per_pass) as i32) < self.left { fill } else { 0 };
            let addr = self.next + k as u64 * step;
            let base = if rows_per_pass % 8 == 0 || k % 2 == 0 { dst } else { dst_odd };
            unsafe { cp_async_16(base + (k * rows_per_pass * D * 2) as u32, addr, bytes) };
        });
    }

    /// [`TileLoader::copy`] with several copy phases ([`copy_phases`]): each phase's row and
    /// chunk are recomputed from `%tid.x` (a few integer instructions per tile instead of
    /// registers held through the key loop), relative to phase 0's, which `next`, `dst` and
    /// `left` describe; a chunk at or past `dst_odd` (the row's chunks that exist) is
    /// zero-filled.
    #[inline(always)]
    unsafe fn copy_phased<const D: usize, const BC: usize, const THREADS: usize, const CHECKED: bool>(
        &self,
        tile: u32,
    ) {
        let rows_per_pass = const { copy_group_rows(D, THREADS) };
        // (Instantiated for one-phase tiles too, where it is never called.)
        const {
            assert!(copy_phases(D, THREADS) == 1 || copy_group_rows(D, THREADS) % 8 == 0, "one swizzle per phase");
            assert!(BC % copy_group_rows(D, THREADS) == 0, "whole groups of rows per tile");
        };
        let tile = opaque_u32(tile);
        let tid = tid_x_fresh() as usize;
        let (r0, c0) = copy_slot(D, THREADS, tid, 0);
        let step = rows_per_pass as u64 * self.stride;
        unroll4!(j in 0..(const { copy_phases(D, THREADS) }) => {
            let (r, c) = copy_slot(D, THREADS, tid, j);
            let dst = tile + swizzled_offset(D, r, c) as u32;
            let fill = if (c as u32) < self.dst_odd { CHUNK as u32 } else { 0 };
            let left = self.left - (r - r0) as i32;
            let first = self
                .next
                .wrapping_add((r - r0) as u64 * self.stride)
                .wrapping_add(((c as i64 - c0 as i64) * CHUNK as i64) as u64);
            unroll8!(k in 0..(BC / const { copy_group_rows(D, THREADS) }) => {
                let bytes = if !CHECKED || ((k * rows_per_pass) as i32) < left { fill } else { 0 };
                unsafe { cp_async_16(dst + (k * rows_per_pass * D * 2) as u32, first + k as u64 * step, bytes) };
            });
        });
    }

    /// [`TileLoader::copy`] for the forward walk, moving on to the next tile: one add of the
    /// pass's `rows_per_pass × stride` per copy, the last reaching the next tile, so no
    /// `k × step` or `BC × stride` products stay in registers through the key loop.
    #[inline(always)]
    unsafe fn copy_advance<const D: usize, const BC: usize, const THREADS: usize, const CHECKED: bool>(
        &mut self,
        tile: u32,
    ) {
        if const { copy_phases(D, THREADS) } > 1 {
            unsafe { self.copy_phased::<D, BC, THREADS, CHECKED>(tile) };
            self.next = self.next.wrapping_add(BC as u64 * self.stride);
            return;
        }
        let rows_per_pass = const { copy_group_rows(D, THREADS) };
        let tile = opaque_u32(tile);
        let (dst, dst_odd) = (tile + self.dst, tile + self.dst_odd);
        let step = rows_per_pass as u64 * self.stride;
        let mut addr = self.next;
        unroll8!(k in 0..(BC / const { copy_group_rows(D, THREADS) }) => {
            let bytes = if !CHECKED || ((k * rows_per_pass) as i32) < self.left { CHUNK as u32 } else { 0 };
            let base = if rows_per_pass % 8 == 0 || k % 2 == 0 { dst } else { dst_odd };
            unsafe { cp_async_16(base + (k * rows_per_pass * D * 2) as u32, addr, bytes) };
            addr = opaque_u64(addr + step);
        });
        self.next = addr;
    }
}

/// The `cp.async` loads of K and V tiles from a paged cache
/// ([`crate::abi::AttnParams::block_table`]), the whole state of both tensors in a few
/// registers (the key loop of the widest tiles has none to spare): per row, one block-table
/// read gives the page (any page size, so a tile may span pages); rows at or past the
/// sequence's last key are zero-filled (source size 0), never read. K and V share their page
/// and row strides (the host checks).
#[cfg(target_arch = "nvptx64")]
#[derive(Clone, Copy)]
struct PagedKv {
    /// `.global` addresses of row 0 of page 0 of the block's K and V head.
    k_base: u64,
    v_base: u64,
    /// Generic address of the sequence's block-table row (`max_pages` u32); 0 for a contiguous
    /// cache (its `page_size` is then 2^31, so every key is in page 0 at `k_base`).
    table: u64,
    /// Bytes between pages and between the rows of a page.
    page_stride: u32,
    row_stride: u32,
    page_size: u32,
    /// The sequence's keys.
    len: u32,
    /// Head columns that exist (the kernel parameter itself, read where it is used, so no
    /// register holds it through the loop); a thread's chunk past them zero-fills every row.
    cols: u32,
}

#[cfg(target_arch = "nvptx64")]
impl PagedKv {
    /// Starts the copies of the `BC`-row tile from key `row0` of the tensor at `base` into the
    /// swizzled tile at shared address `tile`: thread `tid` copies chunk `tid % CPR` of every
    /// `THREADS / CPR`-th row from `tid / CPR`, as [`TileLoader`] does.
    #[inline(always)]
    unsafe fn copy<const D: usize, const BC: usize, const THREADS: usize>(&self, tile: u32, base: u64, row0: u32) {
        let rows_per_pass = const { copy_group_rows(D, THREADS) };
        const { assert!(copy_group_rows(D, THREADS) % 4 == 0, "a thread's rows take one or two swizzles") };
        const { assert!(copy_phases(D, THREADS) == 1 || copy_group_rows(D, THREADS) % 8 == 0, "one swizzle per phase") };
        let tid = tid_x_fresh() as usize;
        let tile = opaque_u32(tile);
        unroll4!(ph in 0..(const { copy_phases(D, THREADS) }) => {
            let (r, c) = copy_slot(D, THREADS, tid, ph);
            let dst = tile + swizzled_offset(D, r, c) as u32;
            let dst_odd = tile + (swizzled_offset(D, r + rows_per_pass, c) - rows_per_pass * D * 2) as u32;
            let base = base + (c * CHUNK) as u64;
            let first = row0 + r as u32;
            let len = if ((c * (CHUNK / 2)) as u32) < self.cols { self.len } else { 0 };
            unroll8!(k in 0..(BC / const { copy_group_rows(D, THREADS) }) => {
                let j = first + (k * rows_per_pass) as u32;
                let (addr, bytes) = if j < len {
                    let (slot, within) = crate::decode_abi::page_slot(self.page_size, j);
                    let page = if self.table != 0 { unsafe { ld_u32(self.table + 4 * slot as u64) } } else { 0 };
                    let off = page as u64 * self.page_stride as u64 + within as u64 * self.row_stride as u64;
                    (base + off, CHUNK as u32)
                } else {
                    (base, 0) // zero-fill: nothing is read
                };
                let d = if rows_per_pass % 8 == 0 || k % 2 == 0 { dst } else { dst_odd };
                unsafe { cp_async_16(d + (k * rows_per_pass * D * 2) as u32, addr, bytes) };
            });
        });
    }
}

/// `ld.shared.v4.b32` / `st.shared.v4.b32` of one 16-byte chunk with every 16-bit value's sign
/// flipped (`xor 0x80008000`): negates a staged chunk of Q in place.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
unsafe fn negate_chunk(addr: u32) {
    unsafe {
        core::arch::asm!(
            "{{ .reg .b32 t<4>;",
            "ld.shared.v4.b32 {{t0, t1, t2, t3}}, [{a}];",
            "xor.b32 t0, t0, -2147450880;",
            "xor.b32 t1, t1, -2147450880;",
            "xor.b32 t2, t2, -2147450880;",
            "xor.b32 t3, t3, -2147450880;",
            "st.shared.v4.b32 [{a}], {{t0, t1, t2, t3}}; }}",
            a = in(reg32) addr, options(nostack));
    }
}

/// The generic body, instantiated by the rows of [`crate::variants`] with their tile's constants.
/// `KD = D / 16` k-steps of `Q Kᵀ`, `ND = D / 8` column tiles of O, `NS = BC / 8` column tiles
/// of S; `MT` 16-row m-tiles per warp (1: 16 rows per warp, 2: 32), which share every K and V
/// fragment loaded from shared memory; `QK`: the tile's `q_reg_ksteps`, the first k-steps whose
/// Q A fragments stay in registers for the whole loop (`KD`: all of Q); the others are reloaded
/// from shared memory in every k-step, as FlashAttention-2 reloads all of them;
/// `BACK`: the tile's `keys_backward`.
///
/// # Safety
/// As the module's safety section.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn flash_fwd<
    E: Half16,
    const D: usize,
    const BR: usize,
    const BC: usize,
    const THREADS: usize,
    const KD: usize,
    const ND: usize,
    const NS: usize,
    const MT: usize,
    const QK: usize,
    const BACK: bool,
>(
    p: &AttnParams,
) {
    // The soft cap, ALiBi and a paged K/V are separate instantiations of the whole loop: the
    // common loop has no tanh, no bias and no page lookups. The ALiBi and paged loops take the
    // soft cap at run time.
    if p.seqused_k != 0 {
        // A KV cache (paged or contiguous): every Q fragment reloaded from shared memory (as FlashAttention-2 does), so the
        // page lookups have the registers the Q fragments held. The narrow-window rows (fewer
        // than 4 warps: more copies per thread, more lookups live) have no paged loop; the hosts
        // launch the default rows over a cache, and such a launch of one of them traps rather
        // than read the cache as a dense tensor.
        if THREADS >= 128 {
            unsafe { flash_fwd_body::<E, D, BR, BC, THREADS, KD, ND, NS, MT, 0, BACK, { Body::PAGED }, true>(p) }
        } else {
            unsafe { core::arch::nvptx::trap() }
        }
    } else if p.alibi_slopes != 0 {
        unsafe { flash_fwd_body::<E, D, BR, BC, THREADS, KD, ND, NS, MT, QK, BACK, { Body::ALIBI }, false>(p) }
    } else if p.softcap > 0.0 {
        unsafe { flash_fwd_body::<E, D, BR, BC, THREADS, KD, ND, NS, MT, QK, BACK, { Body::SOFTCAP }, false>(p) }
    } else {
        unsafe { flash_fwd_body::<E, D, BR, BC, THREADS, KD, ND, NS, MT, QK, BACK, { Body::PLAIN }, false>(p) }
    }
}

/// ALiBi's slope of sequence `b`, head `h` as a bias per key of distance in the units of a
/// loop whose exponent is `2^(s·c − m·c)`: `-slope · log2 e / c`.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
fn alibi_raw(p: &AttnParams, b: u32, h: u32, c: f32) -> f32 {
    -unsafe { alibi_slope(p.alibi_slopes, p.alibi_batch_stride, b, h) } * LOG2E / c
}

/// Which loop [`flash_fwd_body`] is: its scores plain, soft-capped, or with ALiBi's bias (and
/// the soft cap when `softcap > 0`, a uniform branch at run time).
#[cfg(target_arch = "nvptx64")]
struct Body;

#[cfg(target_arch = "nvptx64")]
impl Body {
    const PLAIN: u32 = 0;
    const SOFTCAP: u32 = 1;
    const ALIBI: u32 = 2;
    /// K/V from a KV cache (through a block table, or contiguous), the soft cap at run time (no
    /// ALiBi: the host refuses it).
    const PAGED: u32 = 3;
}

// The per-row arrays hold 4 rows (2 per m-tile, at most 2 m-tiles); `unroll4!` spells out
// indices past `2 * MT` in branches removed at compile time, which the lint still sees.
#[cfg(target_arch = "nvptx64")]
#[allow(unconditional_panic)]
#[inline(always)]
unsafe fn flash_fwd_body<
    E: Half16,
    const D: usize,
    const BR: usize,
    const BC: usize,
    const THREADS: usize,
    const KD: usize,
    const ND: usize,
    const NS: usize,
    const MT: usize,
    const QK: usize,
    const BACK: bool,
    const BODY: u32,
    const PAGED: bool,
>(
    p: &AttnParams,
) {
    let alibi = BODY == Body::ALIBI;
    let softcap_on = BODY == Body::SOFTCAP || (BODY >= Body::ALIBI && p.softcap > 0.0);
    const {
        assert!(KD == D / 16 && ND == D / 8 && NS == BC / 8 && BR == 16 * MT * (THREADS / 32));
        assert!(MT >= 1 && MT <= 2, "one or two 16-row m-tiles per warp");
    };
    // Varlen: this block's sequence as a batch-1 problem; a block past its end has no rows.
    let p0 = p;
    let mut seq = unsafe { sequence_of(p, ctaid_z()) };
    if PAGED {
        // A KV cache: the sequence's own key count (`seqused_k`).
        seq.p.seq_kv = unsafe { ld_u32(p0.seqused_k + 4 * ctaid_z() as u64) } + p0.seqused_k_add;
    }
    let (p, b, q_row0, k_row0) = (&seq.p, seq.b, seq.q0, seq.k0);
    let tid = tid_x() as usize;
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t) = (lane / 4, lane % 4);
    let q0 = ctaid_x() as usize * BR;
    if q0 >= p.seq_q as usize {
        return; // uniform over the block: before any barrier
    }
    stamp(Phase::Prologue);
    let h = ctaid_y() as u64;
    let hk = p.kv_head(h as u32) as u64;
    let seq_q = p.seq_q as usize;

    let q_s = smem_addr(core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<SmemChunk>());
    let k_s = q_s + (BR * D * 2) as u32;
    let v_s = k_s + (BC * D * 2) as u32;

    let slice = |ptr: u64, s: &crate::abi::Strides, head: u64, row0: u64, len: u32| Rows {
        base: global_addr(ptr) + 2 * (b * s.batch + head * s.head + row0 * s.seq),
        stride: 2 * s.seq,
        len: len as usize,
        cols: p.head_dim,
    };
    let q_rows = slice(p.q, &p.q_strides, h, q_row0, p.seq_q);
    let k_rows = slice(p.k, &p.k_strides, hk, k_row0, p.seq_kv);
    let v_rows = slice(p.v, &p.v_strides, hk, k_row0, p.seq_kv);

    // Keys the block visits: the key tiles that meet [first row's window start, last row's
    // window end); tiles wholly outside the window are skipped, so the cost scales with the
    // window. A tile that reaches past the first row's end or starts before the last row's start
    // holds masked keys for some row; only those tiles are masked.
    let last_row = core::cmp::min(q0 + BR, seq_q) - 1;
    let (first_row_start, _) = p.key_range(q0 as u32);
    let (_, last_row_end) = p.key_range(last_row as u32);
    let block_end = core::cmp::max(last_row_end, 0) as u32;
    let j_first = first_row_start as u32 / BC as u32;
    let n_tiles = block_end.div_ceil(BC as u32);
    // The same per warp, on the warp's own rows: a tile outside `jw_lo..jw_hi` is -inf for every
    // row of the warp (so its S, softmax and P V are skipped: the block still stages it for the
    // other warps), and only a tile past the warp's first row's end or before its last row's
    // start is masked. A warp wholly past seq_q (the last block's tail) computes nothing.
    let w_first = q0 + warp * 16 * MT;
    let (jw_lo, jw_hi, first_row_end, last_row_start) = if w_first < seq_q {
        let w_last = core::cmp::min(w_first + 16 * MT, seq_q) - 1;
        let (w_start, w_first_end) = p.key_range(w_first as u32);
        let (w_last_start, w_end) = p.key_range(w_last as u32);
        let w_end = core::cmp::max(w_end, 0) as u32;
        // 32-bit loop state (0..=seq_kv): registers through the loop, not 64-bit pairs.
        (w_start as u32 / BC as u32, w_end.div_ceil(BC as u32), w_first_end as i32, w_last_start as i32)
    } else {
        (0, 0, 0, 0)
    };
    // This lane's rows: m-tile m, row g + 8r is row 2m + r of the lane. Their windows are
    // recomputed in the (few) masked tiles instead of being held in registers.
    let row0 = q0 + warp * 16 * MT + g;

    // Q and the first K tile; walking backward, the last K and V tiles (the only ones that can
    // reach past the last key), so the loop's loads need no checks.
    let j_last = if n_tiles > j_first { n_tiles - 1 } else { j_first };
    let row0_kv = if BACK { j_last } else { j_first } as usize * BC;
    // A KV cache: the sequence's block-table row and each tensor's head within a page; a
    // contiguous cache (no table) is one page per sequence, at the sequence's index. (The dense
    // loaders are then unused, and cost nothing.)
    let z = ctaid_z() as u64;
    let (table, first_page) =
        if p0.block_table != 0 { (p0.block_table + 4 * z * p0.max_pages as u64, 0) } else { (0, z) };
    let kv = PagedKv {
        k_base: global_addr(p.k) + 2 * (hk * p.k_strides.head + first_page * p.k_strides.batch),
        v_base: global_addr(p.v) + 2 * (hk * p.v_strides.head + first_page * p.v_strides.batch),
        table,
        page_stride: 2 * p.k_strides.batch as u32,
        row_stride: 2 * p.k_strides.seq as u32,
        page_size: p0.page_size,
        len: p.seq_kv,
        cols: p0.head_dim,
    };
    let mut k_load = TileLoader::new::<D, THREADS, BACK>(k_rows, row0_kv, tid);
    let mut v_load = TileLoader::new::<D, THREADS, BACK>(v_rows, row0_kv, tid);
    unsafe {
        stage_tile::<D, BR, THREADS>(q_s, q_rows, q0, tid);
        if PAGED {
            if !BACK {
                kv.copy::<D, BC, THREADS>(k_s, kv.k_base, row0_kv as u32);
            } else if n_tiles > j_first {
                kv.copy::<D, BC, THREADS>(k_s, kv.k_base, row0_kv as u32);
                kv.copy::<D, BC, THREADS>(v_s, kv.v_base, row0_kv as u32);
            }
        } else if !BACK {
            k_load.stage::<D, BC, THREADS>(k_s);
        } else if n_tiles > j_first {
            k_load.stage_last::<D, BC, THREADS>(k_s);
            v_load.stage_last::<D, BC, THREADS>(v_s);
        }
    }
    cp_async_commit();
    stamp(Phase::WaitKv);
    cp_async_wait_all();
    stamp(Phase::Barrier);
    sync_threads();
    stamp(Phase::Prologue);
    // A negative scale: Q is negated once in shared memory and the scale's magnitude used, so
    // the running max below is taken on raw scores of either sign (exact: a sign flip).
    let scale = if softcap_on { p.softmax_scale / p.softcap } else { p.softmax_scale * LOG2E };
    if scale < 0.0 {
        let group = const { copy_group_rows(D, THREADS) };
        unroll4!(ph in 0..(const { copy_phases(D, THREADS) }) => {
            let (r, c) = copy_slot(D, THREADS, tid, ph);
            let mut k = 0;
            while k < BR / group {
                unsafe { negate_chunk(q_s + swizzled_offset(D, r + k * group, c) as u32) };
                k += 1;
            }
        });
        sync_threads();
    }
    let scale = if scale < 0.0 { -scale } else { scale };
    // Softmax multiplier of the raw scores (log2 domain). Without a soft cap it is applied
    // inside the exponent, `2^(s·c − m·c)` as one FFMA; a zero scale is raised to the smallest
    // normal float so that masked (-inf) scores stay -inf and never become NaN.
    let c = if softcap_on {
        1.0
    } else if scale < f32::MIN_POSITIVE {
        f32::MIN_POSITIVE
    } else {
        scale
    };
    let cap2 = p.softcap * LOG2E;
    let bias = if alibi { alibi_raw(p0, ctaid_z(), h as u32, c) } else { 0.0 };

    // Q's A fragments: rows 0-7 / 8-15 of m-tile m at d 16kk, then the same at d 16kk + 8.
    let (q_r, q_c) = ldsm_a_lane(lane);
    let q_lane = LaneAddrs::<D>::new(q_s, warp * 16 * MT + q_r, q_c);
    let mut qf = [[[0u32; 4]; KD]; MT];
    unroll4!(m in 0..MT => {
        unroll!(kk in 0..KD => {
            if kk < QK {
                qf[m][kk] = unsafe { ldmatrix_x4(q_lane.at(16 * m, kk)) };
            }
        });
    });

    // Rows 2m + r: running max of the raw scores and this lane's part of the running sum.
    let mut row_m = [f32::NEG_INFINITY; 4];
    let mut row_l = [0.0f32; 4];
    let mut o = [[[0.0f32; 4]; ND]; MT];

    // Forward: tiles j_first..n_tiles. Backward: n_tiles - 1 down to j_first; the first tile of
    // that loop has its V already (a predicate, not one more register live through the loop).
    let mut j = if BACK { n_tiles } else { j_first };
    let mut v_staged = BACK;
    while if BACK { j > j_first } else { j < n_tiles } {
        if BACK {
            j -= 1;
        }
        let kv0 = j * BC as u32;
        // (1) K_j has landed and every warp is done reading the previous V: start loading V_j.
        stamp(Phase::WaitKv);
        cp_async_wait_all();
        stamp(Phase::Barrier);
        sync_threads();
        stamp(Phase::LoadKv);
        if PAGED {
            if !BACK || !v_staged {
                unsafe { kv.copy::<D, BC, THREADS>(v_s, kv.v_base, kv0) };
            }
        } else if !BACK {
            unsafe { v_load.stage::<D, BC, THREADS>(v_s) };
        } else if !v_staged {
            unsafe { v_load.stage_full::<D, BC, THREADS>(v_s) };
        }
        v_staged = false;
        cp_async_commit();

        // Steps (2) to (5) and the P V of (6) only in the warp's own tiles (`jw_lo..jw_hi`).
        let active = j >= jw_lo && j < jw_hi;
        // Written and read only when `active`: no zeroing of the fragments on the idle path.
        let mut pf = core::mem::MaybeUninit::<[[[u32; 4]; NS]; MT]>::uninit();
        if active {
            stamp(Phase::Qk);
            // (2) S = Q K_jᵀ. One ldmatrix.x4 gives the B fragments of two 8-key tiles for one k-step:
            // matrices (keys 16np.., d 16kk), (keys 16np.., d 16kk+8), (keys 16np+8.., d 16kk), ...;
            // every m-tile of the warp uses them.
            let mut s = [[[0.0f32; 4]; NS]; MT];
            let (k_r, k_c) = ldsm_b_lane(lane);
            let k_lane = TileLane::<D>::new(opaque_u32(k_s), k_r, k_c);
            // Reloaded Q fragments: rows 0-7 / 8-15 of m-tile m at d 16kk, then the same at d 16kk + 8
            // (one address register, as K's).
            let q_lane_j = TileLane::<D>::new(opaque_u32(q_s), warp * 16 * MT + q_r, q_c);
            unroll!(kk in 0..KD => {
                let mut qk = [[0u32; 4]; MT];
                unroll4!(m in 0..MT => {
                    qk[m] = if kk < QK {
                        qf[m][kk]
                    } else {
                        unsafe { ldmatrix_x4(q_lane_j.at(16 * m, kk)) }
                    };
                });
                unroll4!(np in 0..NS / 2 => {
                    let r = unsafe { ldmatrix_x4(k_lane.at(16 * np, kk)) };
                    unroll4!(m in 0..MT => {
                        E::mma(&mut s[m][2 * np], &qk[m], r[0], r[1]);
                        E::mma(&mut s[m][2 * np + 1], &qk[m], r[2], r[3]);
                    });
                });
            });

            stamp(Phase::Softmax);
            // (3) Soft cap (its own instantiation): log2-domain capped scores. Then keys a row may not
            // see become -inf. Element e of tile n of m-tile m is lane row 2m + e / 2, key
            // kv0 + 8n + 2t + e % 2.
            if softcap_on {
                unroll4!(m in 0..MT => {
                    unroll8!(n in 0..NS => {
                        unroll4!(e in 0..4 => { s[m][n][e] = softcap2(s[m][n][e] * scale, cap2); });
                    });
                });
            }
            // ALiBi (its own instantiation): -slope · |i + seq_kv - seq_q - j| in the units of
            // `s` (log2 domain over c), lane row 2m + r against key kv0 + 8n + 2t + e % 2.
            if alibi {
                let diag = p.seq_kv as i32 - p.seq_q as i32 - (kv0 + 2 * t as u32) as i32;
                unroll4!(m in 0..MT => {
                    unroll2!(r in 0..2 => {
                        let rd = (row0 + 16 * m + 8 * r) as i32 + diag;
                        unroll8!(n in 0..NS => {
                            unroll2!(e in 0..2 => {
                                let x = &mut s[m][n][2 * r + e];
                                *x = fma(bias, alibi_distance(rd, (8 * n + e) as i32), *x);
                            });
                        });
                    });
                });
            }
            // The end of the window (and seq_kv) only in tiles past the first row's end, its start
            // only in tiles before the last row's start: a tile inside every row's window is not
            // masked at all.
            let c0 = (kv0 + 2 * t as u32) as i32;
            if (kv0 + BC as u32) as i32 > first_row_end {
                unroll4!(m in 0..MT => {
                    let hi0 = core::cmp::max(p.key_range((row0 + 16 * m) as u32).1, 0) as i32 - c0;
                    let hi1 = core::cmp::max(p.key_range((row0 + 16 * m + 8) as u32).1, 0) as i32 - c0;
                    mask_outside(&mut s[m], [i32::MIN; 2], [hi0, hi1]);
                });
            }
            if (kv0 as i32) < last_row_start {
                unroll4!(m in 0..MT => {
                    let lo0 = p.key_range((row0 + 16 * m) as u32).0 as i32 - c0;
                    let lo1 = p.key_range((row0 + 16 * m + 8) as u32).0 as i32 - c0;
                    mask_outside(&mut s[m], [lo0, lo1], [i32::MAX; 2]);
                });
            }

            // (4) New running max per row on the raw scores (`max.f32`, reduced over the row's 4
            // lanes). The exponent base is raised lazily ([`must_rescale`]): only when some row of
            // the warp has grown by more than 8 in the log2 domain (or sees its first key) does the
            // warp rescale what was accumulated under the old base by 2^((m_old − m_new)·c); in the
            // steady state the max settles and the branch skips the O rescale. While a row's base
            // is -inf it has seen nothing and 0 is the base: no -inf − -inf.
            let mut mx = [f32::NEG_INFINITY; 4];
            let mut grow = false;
            unroll4!(m in 0..MT => {
                unroll2!(r in 0..2 => {
                    let i = 2 * m + r;
                    let x = quad_max(row_max(&s[m], r, row_m[i]));
                    grow |= must_rescale(row_m[i] * c, x * c);
                    mx[i] = x;
                });
            });
            if warp_any(grow) {
                unroll4!(m in 0..MT => {
                    unroll2!(r in 0..2 => {
                        let i = 2 * m + r;
                        let base = if mx[i] == f32::NEG_INFINITY { 0.0 } else { mx[i] };
                        let alpha = exp2(fma(row_m[i], c, -(base * c)));
                        row_m[i] = mx[i];
                        row_l[i] *= alpha;
                        scale_row(&mut o[m], r, alpha);
                    });
                });
            }
            let mut mc = [0.0f32; 4];
            unroll4!(i in 0..2 * MT => {
                mc[i] = if row_m[i] == f32::NEG_INFINITY { 0.0 } else { row_m[i] * c };
            });

            // (5) P = 2^(s·c − m·c) (one FFMA into ex2), summed into l and packed to 16 bits as the A
            // fragments of P V_j: key step kc takes S tiles 2kc (keys 2t, 2t+1) and 2kc + 1 (keys
            // 8 + 2t, 9 + 2t).
            let mut pa = [[[0u32; 4]; NS]; MT];
            unroll4!(m in 0..MT => {
                unroll8!(n in 0..NS => {
                    unroll4!(e in 0..4 => {
                        let i = 2 * m + e / 2;
                        let pr = exp2(fma(s[m][n][e], c, -mc[i]));
                        row_l[i] += pr;
                        s[m][n][e] = pr;
                    });
                });
                pa[m] = pack_a(&s[m], E::pack);
            });
            pf.write(pa);
        }

        // (6) V_j has landed and every warp is done reading K_j: start loading the next K, then
        // O += P V_j. One ldmatrix.x4.trans gives the B fragments of two 8-wide d tiles for one
        // 16-key step: matrices (keys 16kc.., d 16np), (keys 16kc+8.., d 16np), (keys 16kc..,
        // d 16np+8), (keys 16kc+8.., d 16np+8); every m-tile of the warp uses them.
        stamp(Phase::WaitKv);
        cp_async_wait_all();
        stamp(Phase::Barrier);
        sync_threads();
        stamp(Phase::LoadKv);
        if PAGED {
            // Paged: the next K is started after P V_j (below), when P is no longer live: the
            // page lookups need registers the widest tiles do not have during the products.
        } else if !BACK && j + 1 < n_tiles {
            unsafe { k_load.stage::<D, BC, THREADS>(k_s) };
        } else if BACK && j > j_first {
            unsafe { k_load.stage_full::<D, BC, THREADS>(k_s) };
        }
        cp_async_commit();
        if active {
            stamp(Phase::Pv);
            // SAFETY: written above under the same `active`.
            let pf = unsafe { pf.assume_init_ref() };
            let (v_r, v_c) = ldsm_bt_lane(lane);
            let v_lane = TileLane::<D>::new(opaque_u32(v_s), v_r, v_c);
            unroll4!(kc in 0..NS / 2 => {
                unroll!(np in 0..ND / 2 => {
                    let r = unsafe { ldmatrix_x4_trans(v_lane.at(16 * kc, np)) };
                    unroll4!(m in 0..MT => {
                        E::mma(&mut o[m][2 * np], &pf[m][kc], r[0], r[1]);
                        E::mma(&mut o[m][2 * np + 1], &pf[m][kc], r[2], r[3]);
                    });
                });
            });
        }
        if PAGED {
            if !BACK && j + 1 < n_tiles {
                unsafe { kv.copy::<D, BC, THREADS>(k_s, kv.k_base, kv0 + BC as u32) };
            } else if BACK && j > j_first {
                unsafe { kv.copy::<D, BC, THREADS>(k_s, kv.k_base, kv0 - BC as u32) };
            }
            cp_async_commit();
        }
        if !BACK {
            j += 1;
        }
    }

    stamp(Phase::Epilogue);
    // Finalise: O = acc / l, LSE = ln2 * (m·c + log2 l); a row that saw nothing gives O = 0, -inf.
    // The block's sequence, head and rows are read again rather than kept in registers through
    // the loop.
    let seq = unsafe { sequence_of(p0, ctaid_z_fresh()) };
    let (p, b, q_row0) = (&seq.p, seq.b, seq.q0);
    let h = ctaid_y_fresh() as u64;
    let seq_q = p.seq_q as usize;
    let row0 = ctaid_x_fresh() as usize * BR + warp * 16 * MT + g;
    let o_base = p.o + 2 * (b * p.o_strides.batch + h * p.o_strides.head + q_row0 * p.o_strides.seq);
    let sink2 = if p.sinks != 0 { (unsafe { ld_f32(p.sinks + 4 * h) }) * LOG2E } else { f32::NEG_INFINITY };
    unroll4!(i in 0..2 * MT => {
        let (m, r) = (i / 2, i % 2);
        let l = quad_sum(row_l[i]);
        let row = row0 + 16 * m + 8 * r;
        if row < seq_q {
            // The running max in the log2 domain, as the sum was computed against.
            let m2 = if row_m[i] == f32::NEG_INFINITY { f32::NEG_INFINITY } else { row_m[i] * c };
            let (inv_l, lse) = OnlineSoftmax { m: m2, l }.finish_with_sink(l, sink2);
            let o_row = o_base + 2 * row as u64 * p.o_strides.seq;
            // Columns past a head dim below D (zero in Q, K and V) are not stored.
            unroll!(n in 0..ND, max 32 => {
                let pair = E::pack(o[m][n][2 * r] * inv_l, o[m][n][2 * r + 1] * inv_l);
                if ((8 * n) as u32) < p.head_dim {
                    unsafe { st_u32(o_row + 2 * (8 * n + 2 * t) as u64, pair) };
                }
            });
            if t == 0 {
                let la = p.lse + 4 * p.lse_offset(b, h, q_row0 + row as u64);
                unsafe { st_f32(la, lse) };
            }
        }
    });
    stamp(Phase::End);
}
