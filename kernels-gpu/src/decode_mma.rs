//! `decode_mma_{bf16,f16,fp8_e4m3,fp8_e5m2}_d{64,128}`: split-KV (flash-decoding) attention over a KV cache on
//! tensor cores (`mma.sync` m16n8k16), 16-bit Q, cache and O, f32 accumulation and softmax.
//!
//! Algorithm: the split-KV decode of [`crate::decode_fwd`] (same grid, same split ranges, same
//! partial outputs) with `Q Kᵀ` and `P V` on tensor cores. A block owns one split of the keys of
//! one sequence and one KV head, and one 16-row `mma` m-tile of packed query rows: row `r` is
//! token `r / group`, query head `hk * group + r % group` (`group = heads / heads_kv`; packed GQA,
//! FlashAttention-2's `seqlenq_ngroups_swapped`, FlashAttention-3's pack-GQA), so a decode step
//! of a GQA group of 4 or 8 fills 4 or 8 of the 16 rows instead of 1. The 4 warps share the
//! m-tile and split every key tile among them (FlashDecoding): warp `w` takes keys `16w..16w+16`
//! of each 64-key tile and runs its own online softmax over them, exactly the steps of
//! [`crate::flash_fwd_mma`] (scores into the log2 domain, raise the max and rescale lazily,
//! [`crate::softmax::must_rescale`], `P = 2^(S - m)`
//! packed to 16 bits in registers as the A operand of `P V`). After the last tile the 4 warps'
//! states are merged in shared memory in a fixed order (`m = max_w m_w`, `l = Σ 2^(m_w - m) l_w`,
//! `acc = Σ 2^(m_w - m) acc_w`), so every run gives the same bits. The split's `O_s = acc / l`
//! and `LSE_s` (natural log) go to the f32 workspace exactly as `decode_fwd` writes them, or,
//! with one split, `O` (element type) and `LSE` directly; `merge_states` combines the splits.
//!
//! Shapes and layout: see [`crate::decode_abi`] (Q/O BSHD; contiguous or paged cache with any
//! `page_size >= 1`; `cache_seqlens`; keys `j < cache_seqlens[b] + seq_new`, the appended ones
//! written beforehand by `decode_append`).
//!
//! Tiles ([`crate::tiles::DECODE_MMA_D64`], [`crate::tiles::DECODE_MMA_D128`]): 4 warps, 16
//! packed rows, `BC = 64` keys per step (16 per warp), `STAGES = 2`. Shared memory: Q `16 x D`,
//! then rings of `STAGES` K and `STAGES` V buffers of `BC x D`, 16-bit, each row-major and
//! XOR-swizzled as in [`crate::swizzle`] (34 KiB at d=64, 68 KiB at d=128). The copies run
//! `STAGES` tiles ahead of the compute: one commit group per K or V tile, issued in the order
//! K_0, V_0, K_1, V_1, ...; at tile `j` the block waits for K_j (`cp.async.wait_group 2 *
//! STAGES - 2`: V_j, K_{j+1}, ... stay in flight), and after the barrier (every warp is done
//! with `P_{j-1} V_{j-1}`) starts V_{j+STAGES-1} in that slot; it computes `S_j` and the
//! softmax, waits for V_j, and after the barrier (every warp is done with `Q K_jᵀ`) starts
//! K_{j+STAGES} in K_j's slot, then `P_j V_j`. So with 2 stages a block has the next tile's K
//! and V in flight while it computes one, and its split is a chain of about one load latency
//! per tile instead of two; `STAGES = 1` is the single-buffered loop (V of tile `j`
//! streams in while `S_j` runs, K of `j + 1` while `P_j V_j` does). Every row of a tile is one
//! `cp.async` per 16-byte chunk from the row's own address in
//! the cache — for a paged cache one block-table read per row, so any page size works and a
//! tile may span pages; rows past the block's last key are zero-filled (source size 0), never
//! read. After the loop the K and V area holds the warps' f32 accumulators `[4][16][D]` and the
//! Q area their row statistics `[4][16]` (max, sum) for the merge.
//!
//! FP8 cache (`fp8_*` rows, bf16 Q and O): the tiles are copied to shared memory as they are,
//! one byte per element (rows of `D` bytes, swizzled as 16-bit rows of `D / 2`), so a tile is
//! half the `cp.async` copies and half the `ldmatrix` loads of a 16-bit one. Each fragment word
//! is widened to f16 right after its `ldmatrix`, exactly (`MmaCache::widen2`); the products run
//! on f16 tensor cores with Q converted to f16, and the K and V scales (times `2^8` for e4m3) are
//! applied to the score factor and to `1 / l`. One `ldmatrix` word holds 4 bytes of a row, so
//! the k index of `Q Kᵀ` is permuted within each 16-wide k-step (Q's fragments are loaded to
//! match) and `P V`'s output columns interleave even and odd d (undone when the accumulators
//! are stored for the merge).
//!
//! Thread mapping: grid `(num_splits, ceil(seq_q * group / 16), heads_kv * batch)`, 128 threads.
//! In every fragment lane `l` (group `g = l / 4`, `t = l % 4`) holds packed rows `g` and `g + 8`
//! (see [`crate::mma`]). Tile loads: thread `i` copies chunk `i % (D / 8)` of rows `i / (D / 8) +
//! k * (128 / (D / 8))`; it computes those rows' cache offsets once when it stages K and reuses
//! them for V. The merge: thread `i` combines packed row `i / 8`, columns `(i % 8) * D / 8 ..`.
//!
//! Masking: keys outside the split, past `seqlen_k`, or outside the row's bottom-right aligned
//! window ([`crate::mask::key_range`]; causal is `window_right = 0`) score `-inf`; the block
//! starts at the tile of its first row's window start and stops at the last key its last row can
//! see; only tiles that reach past the first row's end or begin before the last row's start are
//! masked. Rows past `seq_q * group` compute on zeros and store nothing; every lane reaches every
//! barrier, `ldmatrix` and `mma`. An empty split or a row that sees nothing gives `O_s = 0`,
//! `LSE_s = -inf`.
//!
//! Soft-capping (`softcap > 0`): each score becomes `softcap * tanh(scale * q.k / softcap)`
//! ([`crate::softmax::softcap2`]); ALiBi (`alibi_slopes != 0`) then adds `-slope * |i + seqlen_k -
//! seq_q - j|` (each packed row its own token and head). Sinks (`sinks != 0`): the head's sink logit joins the
//! denominator of split 0 only ([`crate::softmax::OnlineSoftmax::finish_with_sink`]; split 0
//! always exists), so after the merge it is counted exactly once.
//!
//! # Safety
//! All pointers in `p` must be valid for the shapes in `p` (the host validates `block_table`
//! entries and the cache's capacity before it launches); `q`, `k_cache` and `v_cache` must be
//! 16-byte aligned (their rows are then too: `D * 2` bytes is a multiple of 16); `heads` must be a
//! multiple of `heads_kv`; the launch must use [`crate::tiles::DecodeMmaTile::launch`] on sm_80 or
//! newer.

#[cfg(target_arch = "nvptx64")]
use crate::decode_abi::{split_range, DecodeParams};
#[cfg(target_arch = "nvptx64")]
use crate::device::*;
#[cfg(target_arch = "nvptx64")]
use crate::frag::{
    ldsm_a_lane, ldsm_b_lane, ldsm_bt_lane, mask_outside, pack_a, quad_max, quad_sum, row_max, scale_row,
};
#[cfg(target_arch = "nvptx64")]
use crate::mask::key_range;
#[cfg(target_arch = "nvptx64")]
use crate::mma::*;
#[cfg(target_arch = "nvptx64")]
use crate::softmax::{fmax, softcap2, OnlineSoftmax, LOG2E};
#[cfg(target_arch = "nvptx64")]
use crate::swizzle::{swizzled_offset, LaneAddrs, CHUNK};

/// 16-byte unit of dynamic shared memory: `cp.async` and `ldmatrix` need 16-byte alignment.
#[cfg(target_arch = "nvptx64")]
#[repr(C, align(16))]
struct SmemChunk([u8; CHUNK]);

/// Threads of a block (4 warps).
#[cfg(target_arch = "nvptx64")]
const THREADS: usize = 128;
/// Packed rows of a block: one m16 tile.
#[cfg(target_arch = "nvptx64")]
const ROWS: usize = 16;

/// Starts the `cp.async` copies of the `BC` cache rows whose row indices this thread holds in
/// `rows` (`u32::MAX`: past the block's keys, zero-filled) into the swizzled tile at `tile`: rows
/// of `D * bytes` bytes (`bytes` 2 for a 16-bit cache, 1 for FP8), laid out as rows of
/// `D * bytes / 2` 16-bit elements, so `PASSES * bytes / 2` of the `PASSES` entries are used.
/// In global memory a cache row is `d` elements (`d <= D`, the problem's head dim); a thread
/// whose chunk is past it holds only `u32::MAX` rows ([`decode_mma`]'s `my_rows`).
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
unsafe fn stage_rows<const D: usize, const PASSES: usize>(
    tile: u32,
    cache: u64,
    rows: &[u32; PASSES],
    tid: usize,
    bytes: usize,
    d: u32,
) {
    let row_bytes = D * bytes;
    let cpr = row_bytes / CHUNK;
    let rows_per_pass = THREADS / cpr;
    let (c, r) = (tid % cpr, tid / cpr);
    let dst = opaque_u32(tile) + swizzled_offset(row_bytes / 2, r, c) as u32;
    unroll8!(k in 0..PASSES => {
        if k < PASSES * bytes / 2 {
            // Selects, not branches: a branch per row costs a `mov` more on each path.
            let valid = rows[k] != u32::MAX;
            let at = cache + rows[k] as u64 * (d as usize * bytes) as u64 + (c * CHUNK) as u64;
            let (addr, n) = (core::hint::select_unpredictable(valid, at, cache), if valid { CHUNK as u32 } else { 0 });
            unsafe { cp_async_16(dst + (k * rows_per_pass * row_bytes) as u32, addr, n) };
        }
    });
}

/// A cache element type of the tensor-core decode: its size, which `mma` type its products run
/// in, how its shared-memory bytes become `mma` operands, and the factors that undo that.
#[cfg(target_arch = "nvptx64")]
pub(crate) trait MmaCache {
    /// The `mma` operand type of Q, K, V and P.
    type Mma: Half16;
    /// The element type of Q and O in global memory.
    type Qo: Half16;
    /// Bytes per cache element: 2, or 1 for FP8.
    const BYTES: usize = 2;
    /// One word of a Q fragment (two `Qo` values) as two `Mma` values.
    fn q_word(x: u32) -> u32 {
        x
    }
    /// FP8: two fragment words from one `ldmatrix` word `x`, each two of its bytes (picked by the
    /// `prmt` selectors `a` and `b` into the high bytes of two 16-bit halves) as two `Mma` values
    /// (exact; times `2^-8` for e4m3 widened with integer operations). Not used for 16-bit caches.
    fn widen2(x: u32, _a: u32, _b: u32) -> (u32, u32) {
        (x, x)
    }
    /// The factor of head `hk`'s staged K (or V) values to their true values: the FP8 scale
    /// times the widening's power of two; 1 for a 16-bit cache.
    ///
    /// # Safety
    /// For FP8, `scales` must be a valid device address of `heads_kv` f32.
    unsafe fn factor(_scales: u64, _hk: u32) -> f32 {
        1.0
    }
}

#[cfg(target_arch = "nvptx64")]
impl MmaCache for Bf16 {
    type Mma = Bf16;
    type Qo = Bf16;
}

#[cfg(target_arch = "nvptx64")]
impl MmaCache for F16 {
    type Mma = F16;
    type Qo = F16;
}

/// An FP8 cache on f16 tensor cores (sm_80 has no FP8 `mma`): the tiles stay FP8 in shared
/// memory (half the bytes, half the `cp.async` copies and `ldmatrix` loads of a 16-bit cache)
/// and each fragment word is widened to f16 right after its `ldmatrix`, exactly, with integer
/// operations: e5m2 is the top byte of an f16 (same exponent bias 15), one `prmt` per two
/// values; e4m3's seven magnitude bits at bits 7..13 of an f16 read as the value times `2^-8` (bias 15
/// instead of 7, subnormals included) with its sign at bit 15 (one `prmt` that puts the sign byte
/// above each byte, a shift and a mask per two values), so its factor holds `2^8`. Q (bf16) is converted to f16 once per block
/// (exact for `2^-14 <= |q| <= 65504`).
#[cfg(target_arch = "nvptx64")]
impl<F: crate::fp8::Fp8Kind> MmaCache for F {
    type Mma = F16;
    type Qo = Bf16;
    const BYTES: usize = 1;
    #[inline(always)]
    fn q_word(x: u32) -> u32 {
        F16::pack(f32::from_bits(x << 16), f32::from_bits(x & 0xffff_0000))
    }
    /// The integer widening; the `sm_90a` build (sm_89+) converts e4m3 with
    /// `cvt.rn.f16x2.e4m3x2` instead: the bytes of word `a` (the nibbles 1 and 3 of its selector)
    /// and of word `b` are gathered into the low and high 16 bits (no permute when they already
    /// are: K), split, and each half converted.
    #[inline(always)]
    fn widen2(x: u32, a: u32, b: u32) -> (u32, u32) {
        let e4m3 = matches!(F::FORMAT, crate::fp8::Fp8Format::E4m3);
        #[cfg(memattn_sm90)]
        if e4m3 {
            let pick = |s: u32| ((s >> 4) & 0xf) | ((s >> 8) & 0xf0);
            let sel = pick(a) | pick(b) << 8;
            let y = if sel == 0x3210 { x } else { prmt(x, sel) };
            let (lo, hi): (u32, u32);
            unsafe {
                core::arch::asm!(
                    "{{ .reg .b16 l, h;",
                    "mov.b32 {{l, h}}, {y};",
                    "cvt.rn.f16x2.e4m3x2 {lo}, l;",
                    "cvt.rn.f16x2.e4m3x2 {hi}, h; }}",
                    y = in(reg32) y, lo = out(reg32) lo, hi = out(reg32) hi, options(pure, nomem, nostack))
            };
            return (lo, hi);
        }
        let widen = |sel: u32| {
            if e4m3 {
                // Each half as [sign byte, byte] (prmt's sign-replicate selectors 8..11) shifted
                // left by 7: the magnitude lands in bits 7..13, the sign in 15 (and 14, cleared).
                let b1 = (sel >> 4) & 0xf;
                let b3 = (sel >> 12) & 0xf;
                (prmt(x, b1 | (b1 | 8) << 4 | b3 << 8 | (b3 | 8) << 12) << 7) & 0xbf80_bf80
            } else {
                prmt(x, sel)
            }
        };
        (widen(a), widen(b))
    }
    #[inline(always)]
    unsafe fn factor(scales: u64, hk: u32) -> f32 {
        // The integer widening of e4m3 gives the value times 2^-8; `cvt` (sm_90a) the value.
        let pow2 = if matches!(F::FORMAT, crate::fp8::Fp8Format::E4m3) && !cfg!(memattn_sm90) { 256.0 } else { 1.0 };
        unsafe { ld_f32(scales + 4 * hk as u64) * pow2 }
    }
}

/// `cp.async.wait_group 2 * S - 2;`: waits until at most the `2 * S - 2` most recent commit
/// groups of this thread are pending (the pipeline of [`decode_mma`] with `S` stages; `S = 1`
/// waits for all).
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
fn cp_async_wait_group<const S: usize>() {
    unsafe { core::arch::asm!("cp.async.wait_group {n};", n = const 2 * S - 2, options(nostack)) };
}

/// `ld.shared.v2.b32`: the two words at `addr` (8-byte aligned).
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
unsafe fn ld_shared_v2(addr: u32) -> [u32; 2] {
    let (a, b): (u32, u32);
    unsafe {
        core::arch::asm!("ld.shared.v2.b32 {{{a}, {b}}}, [{s}];", a = out(reg32) a, b = out(reg32) b,
            s = in(reg32) addr, options(readonly, nostack));
    }
    [a, b]
}

/// `prmt.b32 d, x, 0, sel;`: byte `i` of `d` is byte `sel[4i..4i+4]` of `(0 << 32) | x`.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
fn prmt(x: u32, sel: u32) -> u32 {
    let d: u32;
    unsafe {
        core::arch::asm!("prmt.b32 {d}, {x}, 0, {s};", d = out(reg32) d, x = in(reg32) x, s = in(reg32) sel,
            options(pure, nomem, nostack))
    };
    d
}

/// The generic body, instantiated by the rows of [`crate::variants`]: `BC` keys per step,
/// `KD = D / 16` k-steps of `Q Kᵀ`, `ND = D / 8` column tiles of O, `NS = BC / 4 / 8` column
/// tiles of a warp's scores, `PASSES = BC * D / 8 / 128` rows a thread stages per tile.
///
/// # Safety
/// As the module's safety section.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn decode_mma<
    E: MmaCache,
    const D: usize,
    const BC: usize,
    const KD: usize,
    const ND: usize,
    const NS: usize,
    const PASSES: usize,
    const STAGES: usize,
>(
    p: &DecodeParams,
) {
    const {
        assert!(KD == D / 16 && ND == D / 8 && NS * 8 * 4 == BC && PASSES * THREADS * 8 == BC * D);
        assert!(STAGES >= 1 && STAGES <= 4);
    };
    let kw = BC / 4; // keys per warp per step
    let tid = tid_x() as usize;
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t) = (lane / 4, lane % 4);
    let split = ctaid_x();
    let group = p.group() as usize;
    let rows = p.seq_q as usize * group;
    let tile_start = ctaid_y() as usize * ROWS;
    let hk = ctaid_z() % p.heads_kv;
    let b = ctaid_z() / p.heads_kv;
    let causal = p.causal != 0;
    let (heads, seq_q) = (p.heads as u64, p.seq_q as u64);
    // The problem's head dim: D, or (a head dim padded to this kernel's) less. Q, O, the cache
    // and the partials are rows of `d` elements; columns `d..D` are zero in the tiles.
    let d = p.head_dim as u64;

    // The sequence's cache slot and left padding: its key j is cache row pad + j of the slot.
    let (slot, pad) = unsafe { p.slot_of(b) };
    let seqlen_k = unsafe { ld_u32(p.cache_seqlens + 4 * b as u64) } - pad + p.seq_new;
    let (k_lo, k_hi) = split_range(seqlen_k, p.num_splits, split, BC as u32);

    let smem = core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<SmemChunk>();
    let q_s = smem_addr(smem);
    // Rings of STAGES K and STAGES V buffers of 16-bit tiles (FP8 uses the first half of each).
    let tile_bytes = (BC * D * 2) as u32;
    let k_s = q_s + (ROWS * D * 2) as u32;
    let v_s = k_s + STAGES as u32 * tile_bytes;

    // The packed rows' tokens and heads; rows past `rows` are clamped to the last valid one for
    // the ranges (they store nothing) and read zeros for Q.
    let row_of = |r: usize| -> (usize, usize) {
        let r = core::cmp::min(tile_start + r, rows - 1);
        (r / group, hk as usize * group + r % group)
    };
    let (wl, wr) = (p.window_left, p.window_right);
    let range = |r: usize| -> (i64, i64) {
        let (rs, re) = key_range(causal, wl, wr, row_of(r).0 as u32, p.seq_q, seqlen_k);
        (core::cmp::max(rs, k_lo as i64), core::cmp::min(re, k_hi as i64))
    };
    let last_row = core::cmp::min(tile_start + ROWS, rows) - 1 - tile_start;
    let (first_row_start, first_row_end) = range(0);
    let (last_row_start, last_row_end) = range(last_row);
    let block_end = if last_row_end > 0 { last_row_end as usize } else { 0 };
    let skip = if first_row_start > k_lo as i64 { (first_row_start as usize - k_lo as usize) / BC * BC } else { 0 };
    let (r0s, r0e) = range(g);
    let (r1s, r1e) = range(g + 8);
    let row_start = [r0s as i32, r1s as i32];
    let row_end = [core::cmp::max(r0e, r0s) as i32, core::cmp::max(r1e, r1s) as i32];

    // Stage Q: chunk `tid % cpr` of packed rows `tid / cpr + k * (128 / cpr)`.
    let cpr = D / 8;
    {
        let mut k = 0;
        while k * THREADS < ROWS * cpr {
            let (c, r) = (tid % cpr, tid / cpr + k * (THREADS / cpr));
            let (qi, h) = row_of(r);
            let src = p.q + 2 * (((b as u64 * seq_q + qi as u64) * heads + h as u64) * d) + (c * CHUNK) as u64;
            // Rows past the tile and chunks past a head dim below D are zero-filled.
            let bytes = if tile_start + r < rows && ((8 * c) as u64) < d { CHUNK as u32 } else { 0 };
            unsafe { cp_async_16(q_s + swizzled_offset(D, r, c) as u32, global_addr(src), bytes) };
            k += 1;
        }
    }
    // This thread's cache rows of a tile starting at key `kv0` (`stage_rows`'s mapping).
    let cache_cpr = D * E::BYTES / CHUNK;
    let rows_per_pass = THREADS / cache_cpr;
    let my_rows = |kv0: usize| -> [u32; PASSES] {
        let mut out = [u32::MAX; PASSES];
        unroll8!(k in 0..PASSES => {
            let j = kv0 + tid / cache_cpr + k * rows_per_pass;
            let chunk_exists = (((tid % cache_cpr) * (CHUNK / E::BYTES)) as u64) < d;
            if k < PASSES * E::BYTES / 2 && j < block_end && chunk_exists {
                out[k] = unsafe { p.cache_row_of(slot, pad + j as u32, hk) };
            }
        });
        out
    };
    let (k_cache, v_cache) = (global_addr(p.k_cache), global_addr(p.v_cache));
    let mut kv0 = k_lo as usize + skip;
    // The pipeline: the copies are issued in the order K_0, V_0, K_1, V_1, ..., one commit group
    // each, STAGES tiles ahead (see the loop), so every wait leaves the `2 * STAGES - 2` groups
    // issued after the awaited one in flight. The prologue issues K_0 (with Q), V_0, ...,
    // K_{STAGES-1}; `tile_rows` always holds the rows of the last K issued, which the V of the
    // same tile reuses.
    let mut tile_rows = [u32::MAX; PASSES];
    unroll4!(i in 0..STAGES => {
        let at = kv0 + i * BC;
        if at < block_end {
            tile_rows = my_rows(at);
            unsafe { stage_rows::<D, PASSES>(k_s + i as u32 * tile_bytes, k_cache, &tile_rows, tid, E::BYTES, p.head_dim) };
        }
        cp_async_commit();
        if i + 1 < STAGES {
            if at < block_end {
                unsafe { stage_rows::<D, PASSES>(v_s + i as u32 * tile_bytes, v_cache, &tile_rows, tid, E::BYTES, p.head_dim) };
            }
            cp_async_commit();
        }
    });
    cp_async_wait_group::<STAGES>();
    sync_threads();
    let mut qf = [[0u32; 4]; KD];
    let (q_r, q_c) = ldsm_a_lane(lane);
    unroll8!(kk in 0..KD => {
        qf[kk] = if E::BYTES == 1 {
            // FP8: k-step kk's k index 2t + i (+ 8) is d 16kk + 4t + i (+ 2), the bytes one
            // `ldmatrix` word of a K row holds (see the products below): rows g and g + 8 each
            // give a0/a2 (a1/a3) in one 8-byte load.
            let at = |row: usize| q_s + (swizzled_offset(D, row, 2 * kk + t / 2) + (t % 2) * 8) as u32;
            let (r0, r1) = unsafe { (ld_shared_v2(at(g)), ld_shared_v2(at(g + 8))) };
            [r0[0], r1[0], r0[1], r1[1]]
        } else {
            unsafe { ldmatrix_x4(q_s + swizzled_offset(D, q_r, 2 * kk + q_c) as u32) }
        };
        unroll4!(w in 0..4 => { qf[kk][w] = E::q_word(qf[kk][w]); });
    });

    let softcap = p.softcap > 0.0;
    let (scale2, cap2) =
        if softcap { (p.softmax_scale / p.softcap, p.softcap * LOG2E) } else { (p.softmax_scale * LOG2E, 0.0) };
    // An FP8 cache's K factor joins the score factor (see `MmaCache::factor`).
    let scale2 = scale2 * unsafe { E::factor(p.k_scale, hk) };
    let mut row_sm = [OnlineSoftmax::new(); 2];
    let mut o = [[0.0f32; 4]; ND];
    let wk = warp * kw; // this warp's first key in a tile
                        // ALiBi in the log2 domain for the lane's rows g and g + 8 (each its own token and head):
                        // -slope · log2 e per key of distance from the row's diagonal, which is relative to key
                        // `wk + 2t` of a tile.
    let mut alibi2 = [0.0f32; 2];
    let mut diag = [0i32; 2];
    if p.alibi_slopes != 0 {
        unroll2!(r in 0..2 => {
            let (qi, h) = row_of(g + 8 * r);
            alibi2[r] = -unsafe { alibi_slope(p.alibi_slopes, p.alibi_batch_stride, b, h as u32) } * LOG2E;
            diag[r] = qi as i32 + seqlen_k as i32 - p.seq_q as i32 - (wk + 2 * t) as i32;
        });
    }

    // Ring slot of this tile's K and V.
    let mut cur = 0usize;
    while kv0 < block_end {
        let (k_cur, v_cur) = (k_s + cur as u32 * tile_bytes, v_s + cur as u32 * tile_bytes);
        // (1) K of this tile has landed and every warp is done reading the previous tile's V
        // (slot cur - 1): start loading V of tile + STAGES - 1 there.
        cp_async_wait_group::<STAGES>();
        sync_threads();
        let ahead_v = kv0 + (STAGES - 1) * BC;
        if ahead_v < block_end {
            let slot = if cur == 0 { STAGES - 1 } else { cur - 1 };
            unsafe {
                stage_rows::<D, PASSES>(v_s + slot as u32 * tile_bytes, v_cache, &tile_rows, tid, E::BYTES, p.head_dim)
            };
        }
        cp_async_commit();

        // (2) S = Q Kᵀ over this warp's keys.
        let mut s = [[0.0f32; 4]; NS];
        if E::BYTES == 1 {
            // FP8 rows of D bytes: one `ldmatrix.x4` (matrices keys 0-7 / 8-15 of d chunks 2kp
            // and 2kp + 1) gives each lane 4 bytes of one key per k-step, d 16kk + 4t .. + 3:
            // the B fragment's k 2t, 2t + 1 (bytes 0, 1) and 2t + 8, 2t + 9 (bytes 2, 3).
            let (k_r, k_c) = ldsm_bt_lane(lane);
            let k_tile = opaque_u32(k_cur);
            unroll4!(kp in 0..KD / 2 => {
                let r = unsafe { ldmatrix_x4(k_tile + swizzled_offset(D / 2, wk + k_r, 2 * kp + k_c) as u32) };
                unroll2!(c2 in 0..2 => {
                    unroll2!(nt in 0..NS => {
                        let (b01, b23) = E::widen2(r[2 * c2 + nt], 0x1404, 0x3424);
                        E::Mma::mma(&mut s[nt], &qf[2 * kp + c2], b01, b23);
                    });
                });
            });
        } else {
            let (k_r, k_c) = ldsm_b_lane(lane);
            let k_lane = LaneAddrs::<D>::new(opaque_u32(k_cur), wk + k_r, k_c);
            unroll8!(kk in 0..KD => {
                unroll2!(np in 0..NS / 2 => {
                    let r = unsafe { ldmatrix_x4(k_lane.at(16 * np, kk)) };
                    E::Mma::mma(&mut s[2 * np], &qf[kk], r[0], r[1]);
                    E::Mma::mma(&mut s[2 * np + 1], &qf[kk], r[2], r[3]);
                });
            });
        }

        // (3) Log2-domain scores; element e of tile n is row g + 8 (e / 2), key
        // kv0 + wk + 8n + 2t + e % 2.
        unroll2!(n in 0..NS => {
            unroll4!(e in 0..4 => { s[n][e] *= scale2; });
        });
        if softcap {
            unroll2!(n in 0..NS => {
                unroll4!(e in 0..4 => { s[n][e] = softcap2(s[n][e], cap2); });
            });
        }
        if p.alibi_slopes != 0 {
            unroll2!(n in 0..NS => {
                unroll4!(e in 0..4 => {
                    let r = e / 2;
                    s[n][e] = fma(alibi2[r], alibi_distance(diag[r] - kv0 as i32, (8 * n + e % 2) as i32), s[n][e]);
                });
            });
        }
        if (kv0 + BC) as i64 > first_row_end || (kv0 as i64) < last_row_start {
            let c0 = (kv0 + wk + 2 * t) as i32;
            mask_outside(&mut s, [row_start[0] - c0, row_start[1] - c0], [row_end[0] - c0, row_end[1] - c0]);
        }

        // (4) The tile's max per row (over the row's 4 lanes); raise the bases and rescale
        // lazily (`must_rescale`): only when some row of the warp has grown by more than 2^8 (a
        // warp vote: the branch is uniform, the mma after it needs every lane), so once the
        // maxima settle (most tiles of a long cache) the `4 * ND` multiplies are skipped.
        let mut mx = [f32::NEG_INFINITY; 2];
        let mut grow = false;
        unroll2!(r in 0..2 => {
            mx[r] = quad_max(row_max(&s, r, f32::NEG_INFINITY));
            grow |= row_sm[r].must_raise(mx[r]);
        });
        let mut rescale = [row_sm[0].keep(), row_sm[1].keep()];
        if warp_any(grow) {
            unroll2!(r in 0..2 => {
                rescale[r] = row_sm[r].raise_max(mx[r]);
                scale_row(&mut o, r, rescale[r].alpha);
            });
        }

        // (5) P = 2^(S - m), packed as the A fragments of P V.
        unroll2!(n in 0..NS => {
            unroll4!(e in 0..4 => { s[n][e] = row_sm[e / 2].prob(s[n][e], rescale[e / 2]); });
        });
        let pf = pack_a(&s, E::Mma::pack);

        // (6) V of this tile has landed and every warp is done reading its K: start loading K of
        // tile + STAGES into its slot, then O += P V over this warp's keys.
        cp_async_wait_group::<STAGES>();
        sync_threads();
        let ahead_k = kv0 + STAGES * BC;
        if ahead_k < block_end {
            tile_rows = my_rows(ahead_k);
            unsafe { stage_rows::<D, PASSES>(k_cur, k_cache, &tile_rows, tid, E::BYTES, p.head_dim) };
        }
        cp_async_commit();
        kv0 += BC;
        cur = if cur + 1 == STAGES { 0 } else { cur + 1 };
        let (v_r, v_c) = ldsm_bt_lane(lane);
        if E::BYTES == 1 {
            // FP8 rows of D bytes: `ldmatrix.x4.trans` of (keys 0-7 / 8-15) x (d chunks 2cp,
            // 2cp + 1) gives lane (g, t) keys 2t, 2t + 1 (+ 8) of d 16c + 2g and 16c + 2g + 1:
            // bytes 0, 2 feed O column tile 2c (d 16c + 2n for its column n), bytes 1, 3 tile
            // 2c + 1 (d 16c + 2n + 1).
            let v_tile = opaque_u32(v_cur);
            unroll4!(cp in 0..KD / 2 => {
                let r = unsafe { ldmatrix_x4_trans(v_tile + swizzled_offset(D / 2, wk + v_r, 2 * cp + v_c) as u32) };
                unroll2!(c2 in 0..2 => {
                    let (even_lo, odd_lo) = E::widen2(r[2 * c2], 0x2404, 0x3414);
                    let (even_hi, odd_hi) = E::widen2(r[2 * c2 + 1], 0x2404, 0x3414);
                    let n = 2 * (2 * cp + c2);
                    E::Mma::mma(&mut o[n], &pf[0], even_lo, even_hi);
                    E::Mma::mma(&mut o[n + 1], &pf[0], odd_lo, odd_hi);
                });
            });
        } else {
            let v_lane = LaneAddrs::<D>::new(opaque_u32(v_cur), wk + v_r, v_c);
            unroll2!(kc in 0..NS / 2 => {
                unroll8!(np in 0..ND / 2 => {
                    let r = unsafe { ldmatrix_x4_trans(v_lane.at(16 * kc, np)) };
                    E::Mma::mma(&mut o[2 * np], &pf[kc], r[0], r[1]);
                    E::Mma::mma(&mut o[2 * np + 1], &pf[kc], r[2], r[3]);
                });
            });
        }
    }

    // Merge the 4 warps' states: statistics into the Q area, accumulators into K and V.
    cp_async_wait_all();
    sync_threads();
    let stats = smem as *mut f32; // [2][4 warps][16 rows]: max, then sum
    let acc_s = unsafe { (smem as *mut u8).add(ROWS * D * 2) } as *mut f32; // [4 warps][16 rows][D]
    unroll2!(r in 0..2 => {
        let l = quad_sum(row_sm[r].l);
        let row = g + 8 * r;
        if t == 0 {
            unsafe {
                *stats.add(warp * ROWS + row) = row_sm[r].m;
                *stats.add(4 * ROWS + warp * ROWS + row) = l;
            }
        }
        // Column tile n's column 2t + j is d 8n + 2t + j, or for FP8 (see P V) d 16c + 2(2t + j)
        // + n % 2 of tile n = 2c + n % 2.
        let fp8 = E::BYTES == 1;
        let at = unsafe { acc_s.add((warp * ROWS + row) * D + if fp8 { 4 * t } else { 2 * t }) };
        unroll!(n in 0..ND => {
            unroll2!(j in 0..2 => {
                let col = if fp8 { 16 * (n / 2) + 2 * j + n % 2 } else { 8 * n + j };
                unsafe { *at.add(col) = o[n][2 * r + j] };
            });
        });
    });
    sync_threads();
    let per = D / (THREADS / ROWS); // columns per thread
    let (row, c0) = (tid / (THREADS / ROWS), (tid % (THREADS / ROWS)) * per);
    let mut m = [0.0f32; 4];
    let mut mx = f32::NEG_INFINITY;
    unroll4!(w in 0..4 => {
        m[w] = unsafe { *stats.add(w * ROWS + row) };
        mx = fmax(mx, m[w]);
    });
    let base = if mx == f32::NEG_INFINITY { 0.0 } else { mx };
    let mut a = [0.0f32; 4];
    let mut l = 0.0f32;
    unroll4!(w in 0..4 => {
        a[w] = exp2(m[w] - base);
        l += a[w] * unsafe { *stats.add(4 * ROWS + w * ROWS + row) };
    });
    let merged = OnlineSoftmax { m: mx, l };
    let sink2 = if p.sinks != 0 && split == 0 && tile_start + row < rows {
        (unsafe { ld_f32(p.sinks + 4 * row_of(row).1 as u64) }) * LOG2E
    } else {
        f32::NEG_INFINITY
    };
    let (inv_l, lse) = merged.finish_with_sink(l, sink2);
    // An FP8 cache's V factor joins the normaliser (see `MmaCache::factor`).
    let inv_l = inv_l * unsafe { E::factor(p.v_scale, hk) };
    if tile_start + row < rows {
        let (qi, h) = row_of(row);
        let row_idx = (b as u64 * heads + h as u64) * seq_q + qi as u64;
        let mut c = 0;
        while c < per {
            let mut v = [0.0f32; 2];
            unroll2!(e in 0..2 => {
                let mut x = 0.0f32;
                unroll4!(w in 0..4 => {
                    x = fma(a[w], unsafe { *acc_s.add((w * ROWS + row) * D + c0 + c + e) }, x);
                });
                v[e] = x * inv_l;
            });
            if ((c0 + c) as u64) >= d {
                // A column past a head dim below D: not stored.
            } else if p.num_splits == 1 {
                let oa = p.o + 2 * (((b as u64 * seq_q + qi as u64) * heads + h as u64) * d);
                unsafe { st_u32(oa + 2 * (c0 + c) as u64, E::Qo::pack(v[0], v[1])) };
            } else {
                let part_row = split as u64 * p.batch as u64 * heads * seq_q + row_idx;
                let oa = p.o_part + 4 * (part_row * d + (c0 + c) as u64);
                unsafe {
                    st_f32(oa, v[0]);
                    st_f32(oa + 4, v[1]);
                }
            }
            c += 2;
        }
        if tid % (THREADS / ROWS) == 0 {
            if p.num_splits == 1 {
                unsafe { st_f32(p.lse + 4 * row_idx, lse) };
            } else {
                let part_row = split as u64 * p.batch as u64 * heads * seq_q + row_idx;
                unsafe { st_f32(p.lse_part + 4 * part_row, lse) };
            }
        }
    }
}
