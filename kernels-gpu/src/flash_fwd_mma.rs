//! `flash_fwd_{bf16,f16}_d{32,64,96,128,192,256}`: fused attention forward on tensor cores (`mma.sync`
//! m16n8k16), 16-bit inputs and output, f32 accumulation and softmax.
//!
//! Algorithm (FlashAttention-2 forward): a block owns `BR = 64` query rows, one 16-row `mma` tile
//! per warp, and walks the keys in tiles of `BC`. Q is staged once and its A fragments stay in
//! registers. Per key tile: (1) wait for K, start loading V; (2) `S = Q Kᵀ` on tensor cores into
//! f32 accumulator fragments; (3) scale into the log2 domain (`log2 e` folded into the softmax
//! scale once) and mask; (4) raise the running row max, rescale the running sum and the output
//! accumulator by `2^(m_old - m_new)`; (5) `P = 2^(S - m)`, packed to 16 bits in registers — the
//! accumulator layout of one `mma` is the A-operand layout of the next, so P never touches shared
//! memory; (6) wait for V, start loading the next K, `O += P V`. Finally `O /= l` and
//! `LSE = ln 2 * (m + log2 l)`.
//!
//! Shapes: Q, O `[batch, seq_q, heads, D]`, K, V `[batch, seq_kv, heads_kv, D]`, bf16 or f16 (the
//! pointers in [`crate::abi::AttnParams`] point at 2-byte elements), strided in elements (see
//! [`crate::abi::Strides`]); LSE `[batch, heads, seq_q]` f32, natural log.
//!
//! Tiles ([`crate::tiles::FLASH_MMA_D64`], [`crate::tiles::FLASH_MMA_D128`],
//! [`crate::tiles::FLASH_MMA_D64_WINDOW`]), 4 warps:
//! D=64: BR=64, BC=128, smem Q 8 KiB + K 16 KiB + V 16 KiB = 40 KiB;
//! D=128: BR=64, BC=64, smem Q 16 KiB + K 16 KiB + V 16 KiB = 48 KiB;
//! D=64 for narrow windows (`flash_fwd_*_d64_window`, chosen by the row's
//! [`crate::variants::WindowRule`]): BR=64, BC=64, smem Q 8 KiB + K 8 KiB + V 8 KiB = 24 KiB.
//! D=32, 96, 192, 256: [`crate::tiles::FLASH_MMA_D32`] and the items after it (6 warps at D=96,
//! 3 at D=192; at D=256 the Q fragments are reloaded from shared memory at every k-step).
//! K and V each have one buffer, and the loads overlap compute as in FlashAttention-2: V of
//! tile `j` streams in while `S_j` and the softmax are computed, K of tile `j + 1` while
//! `P_j V_j` is. Both are `cp.async` copies of 16-byte chunks; rows past the end of a tensor are
//! zero-filled (source size 0), so they contribute exact zeros, never stale data.
//!
//! Shared-memory layout ([`crate::swizzle`]): each tile is row-major, one row = `D * 2` bytes =
//! `D / 8` chunks of 16 bytes. Chunk `c` of row `r` is stored at chunk position `c ^ (r % 8)`. An
//! `ldmatrix` phase reads the same logical chunk of 8 consecutive rows; the XOR puts those 8
//! chunks on 8 distinct 16-byte bank groups (all 32 banks), so `ldmatrix` is free of bank
//! conflicts, and the XOR permutes chunks within a row, so the `cp.async` stores of one row stay
//! conflict-free too.
//!
//! The running max and sum are [`crate::softmax::OnlineSoftmax`] states, one per row a lane
//! holds; entry points are generated from the rows of [`crate::variants`].
//!
//! Thread mapping: grid `(ceil(seq_q / BR), heads, batch)`, `THREADS = 32 * warps` (128). Warp `w` owns rows
//! `16w..16w+16` of the block; in every fragment lane `l` (group `g = l / 4`, `t = l % 4`) holds
//! rows `g` and `g + 8` and, of every 8-column tile, columns `2t, 2t + 1` (see [`crate::mma`]).
//! A row's statistics are reduced over the 4 lanes of its group with `shfl.sync.bfly` 1 and 2;
//! the running sum `l` is kept per lane and reduced once at the end. Tile loads: thread `i`
//! copies chunk `i % (D / 8)` of rows `i / (D / 8) + k * (128 / (D / 8))`.
//!
//! Semantics (`docs/semantics.md`): K/V head `h / (heads / heads_kv)` (GQA/MQA); window
//! `(left, right)` bottom-right aligned, causal = right 0 ([`crate::abi::AttnParams::key_range`]);
//! soft cap `c · tanh(scale · q·k / c)` ([`crate::softmax::softcap2`]); a per-head sink logit in
//! the denominator only ([`crate::softmax::OnlineSoftmax::finish_with_sink`]).
//!
//! Masking: keys outside a row's window `[start, end)` (and past `seq_kv`) score `-inf`. The
//! block visits only the key tiles that meet `[start of its first row, end of its last row)`
//! (cost scales with the window, not `seq_kv`); only tiles that reach past the first row's end
//! or begin before the last row's start are masked. A row that
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
use crate::mma::*;
#[cfg(target_arch = "nvptx64")]
use crate::softmax::{fmax, softcap2, OnlineSoftmax, LOG2E};
#[cfg(target_arch = "nvptx64")]
use crate::swizzle::{swizzled_offset, LaneAddrs, CHUNK};

/// 16-byte unit of dynamic shared memory: `cp.async` and `ldmatrix` need 16-byte alignment.
#[cfg(target_arch = "nvptx64")]
#[repr(C, align(16))]
struct SmemChunk([u8; CHUNK]);

/// Global addresses of one `[seq, D]` slice (fixed batch and head) of a strided 2-byte tensor.
#[cfg(target_arch = "nvptx64")]
#[derive(Clone, Copy)]
struct Rows {
    /// `.global` address of row 0.
    base: u64,
    /// Bytes between consecutive rows.
    stride: u64,
    /// Rows that exist; rows at or past it are zero-filled.
    len: usize,
}

/// Starts the `cp.async` copies of `ROWS` rows `row0..row0 + ROWS` of `src` into the swizzled
/// tile at shared address `tile`; this thread copies chunk `tid % CPR` of every
/// `THREADS / CPR`-th row starting at `tid / CPR`.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
unsafe fn stage_tile<const D: usize, const ROWS: usize, const THREADS: usize>(
    tile: u32,
    src: Rows,
    row0: usize,
    tid: usize,
) {
    let cpr = D * 2 / CHUNK;
    let rows_per_pass = THREADS / cpr;
    const { assert!(THREADS % (D * 2 / CHUNK) == 0, "whole rows per copy pass") };
    const { assert!((THREADS / (D * 2 / CHUNK)) % 4 == 0, "a thread's rows take one or two swizzles") };
    // Passes of a multiple of 8 rows keep a thread's swizzle (one destination plus immediates);
    // passes of 4 mod 8 rows (d 192 at 3 warps, d 256 at 4) alternate between two.
    let one_swizzle = rows_per_pass % 8 == 0;
    let (c, r) = (tid % cpr, tid / cpr);
    let tile = opaque_u32(tile);
    let dst = tile + swizzled_offset(D, r, c) as u32;
    let dst_odd = tile + swizzled_offset(D, r + rows_per_pass, c) as u32 - (rows_per_pass * D * 2) as u32;
    // 32-bit row bookkeeping: fewer 64-bit registers live across the key loop.
    let rows_left = src.len.saturating_sub(row0 + r) as u32;
    let first = src.base + (row0 + r) as u64 * src.stride + (c * CHUNK) as u64;
    let mut k = 0;
    while k < ROWS / rows_per_pass {
        let (addr, bytes) = if ((k * rows_per_pass) as u32) < rows_left {
            (first + (k * rows_per_pass) as u64 * src.stride, CHUNK as u32)
        } else {
            (src.base, 0) // zero-fill: nothing is read
        };
        let base = if one_swizzle || k % 2 == 0 { dst } else { dst_odd };
        let to = base + (k * rows_per_pass * D * 2) as u32;
        unsafe { cp_async_16(to, addr, bytes) };
        k += 1;
    }
}

/// The generic body, instantiated by the rows of [`crate::variants`] with their tile's constants.
/// `KD = D / 16` k-steps of `Q Kᵀ` (Q fragments), `ND = D / 8` column tiles of O, `NS = BC / 8`
/// column tiles of S.
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
>(
    p: &AttnParams,
) {
    const { assert!(KD == D / 16 && ND == D / 8 && NS == BC / 8 && BR == 16 * (THREADS / 32)) };
    // Varlen: this block's sequence as a batch-1 problem; a block past its end has no rows.
    let seq = unsafe { sequence_of(p, ctaid_z()) };
    let (p, b, q_row0, k_row0) = (&seq.p, seq.b, seq.q0, seq.k0);
    let tid = tid_x() as usize;
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t) = (lane / 4, lane % 4);
    let q0 = ctaid_x() as usize * BR;
    if q0 >= p.seq_q as usize {
        return; // uniform over the block: before any barrier
    }
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
    };
    let q_rows = slice(p.q, &p.q_strides, h, q_row0, p.seq_q);
    let k_rows = slice(p.k, &p.k_strides, hk, k_row0, p.seq_kv);
    let v_rows = slice(p.v, &p.v_strides, hk, k_row0, p.seq_kv);

    // Keys the block visits: the key tiles that meet [first row's window start, last row's
    // window end); tiles wholly outside the window are skipped, so the cost scales with the
    // window. A tile that reaches past the first row's end or starts before the last row's start
    // holds masked keys for some row; only those tiles are masked.
    let last_row = core::cmp::min(q0 + BR, seq_q) - 1;
    let (first_row_start, first_row_end) = p.key_range(q0 as u32);
    let (last_row_start, last_row_end) = p.key_range(last_row as u32);
    let block_end = core::cmp::max(last_row_end, 0) as usize;
    let j_first = first_row_start as usize / BC;
    let n_tiles = block_end.div_ceil(BC);
    let my_rows = [q0 + warp * 16 + g, q0 + warp * 16 + g + 8];
    // Per-row windows in 32 bits (0..=seq_kv): registers through the loop, not 64-bit pairs.
    let (r0s, r0e) = p.key_range(my_rows[0] as u32);
    let (r1s, r1e) = p.key_range(my_rows[1] as u32);
    let row_start = [r0s as i32, r1s as i32];
    let row_end = [core::cmp::max(r0e, 0) as i32, core::cmp::max(r1e, 0) as i32];

    // Q and the first K tile; Q's A fragments then stay in registers for the whole loop.
    unsafe {
        stage_tile::<D, BR, THREADS>(q_s, q_rows, q0, tid);
        stage_tile::<D, BC, THREADS>(k_s, k_rows, j_first * BC, tid);
    }
    cp_async_commit();
    cp_async_wait_all();
    sync_threads();
    // Q's A fragments stay in registers up to D = 192; at D = 256 they and the O accumulator
    // (64 + 128 registers) leave too few for the rest (ptxas spills), so Q stays staged in shared
    // memory and each k-step of `Q Kᵀ` reloads its fragment (one more ldmatrix.x4 per k-step).
    let q_in_regs = D <= 192;
    let q_lane = LaneAddrs::<D>::new(opaque_u32(q_s), warp * 16 + lane % 16, lane / 16);
    let mut qf = [[0u32; 4]; KD];
    if q_in_regs {
        unroll!(kk in 0..KD => {
            // Matrices: rows 0-7 / 8-15 of the warp's 16 at d 16kk, then the same at d 16kk + 8.
            let row = warp * 16 + lane % 16;
            qf[kk] = unsafe { ldmatrix_x4(q_s + swizzled_offset(D, row, 2 * kk + lane / 16) as u32) };
        });
    }

    // Scores into the log2 domain, or (soft cap) scale / cap, the argument of tanh.
    let softcap = p.softcap > 0.0;
    let (scale2, cap2) =
        if softcap { (p.softmax_scale / p.softcap, p.softcap * LOG2E) } else { (p.softmax_scale * LOG2E, 0.0) };
    // Rows g and g + 8: running max (log2 domain) and this lane's part of the running sum.
    let mut row_sm = [OnlineSoftmax::new(); 2];
    let mut o = [[0.0f32; 4]; ND];

    let mut j = j_first;
    while j < n_tiles {
        let kv0 = j * BC;
        // (1) K_j has landed and every warp is done reading V_{j-1}: start loading V_j.
        cp_async_wait_all();
        sync_threads();
        unsafe { stage_tile::<D, BC, THREADS>(v_s, v_rows, kv0, tid) };
        cp_async_commit();

        // (2) S = Q K_jᵀ. One ldmatrix.x4 gives the B fragments of two 8-key tiles for one k-step:
        // matrices (keys 16np.., d 16kk), (keys 16np.., d 16kk+8), (keys 16np+8.., d 16kk), ...
        let mut s = [[0.0f32; 4]; NS];
        let k_lane = LaneAddrs::<D>::new(opaque_u32(k_s), lane % 8 + 8 * (lane / 16), (lane / 8) % 2);
        unroll!(kk in 0..KD => {
            let a = if q_in_regs { qf[kk] } else { unsafe { ldmatrix_x4(q_lane.at(0, kk)) } };
            unroll!(np in 0..NS / 2 => {
                let r = unsafe { ldmatrix_x4(k_lane.at(16 * np, kk)) };
                E::mma(&mut s[2 * np], &a, r[0], r[1]);
                E::mma(&mut s[2 * np + 1], &a, r[2], r[3]);
            });
        });

        // (3) Log2-domain scores; keys a row may not see become -inf. Element e of tile n is
        // row g + 8 (e / 2), key kv0 + 8n + 2t + e % 2.
        unroll!(n in 0..NS => {
            unroll!(e in 0..4 => { s[n][e] *= scale2; });
        });
        if softcap {
            unroll!(n in 0..NS => {
                unroll!(e in 0..4 => { s[n][e] = softcap2(s[n][e], cap2); });
            });
        }
        // The end of the window (and seq_kv) only in tiles past the first row's end, its start
        // only in tiles before the last row's start: a tile inside every row's window is not
        // masked at all.
        let c0 = (kv0 + 2 * t) as i32;
        if (kv0 + BC) as i64 > first_row_end {
            let hi = [row_end[0] - c0, row_end[1] - c0];
            unroll!(n in 0..NS => {
                unroll!(e in 0..4 => {
                    if (8 * n + e % 2) as i32 >= hi[e / 2] {
                        s[n][e] = f32::NEG_INFINITY;
                    }
                });
            });
        }
        if (kv0 as i64) < last_row_start {
            let lo = [row_start[0] - c0, row_start[1] - c0];
            unroll!(n in 0..NS => {
                unroll!(e in 0..4 => {
                    if ((8 * n + e % 2) as i32) < lo[e / 2] {
                        s[n][e] = f32::NEG_INFINITY;
                    }
                });
            });
        }

        // (4) New running max per row (reduced over the row's 4 lanes); rescale what was
        // accumulated under the old one (see `OnlineSoftmax::raise_max`: while the max is -inf
        // the row has seen nothing and 0 is the base, so no -inf - -inf).
        let mut rescale = [crate::softmax::Rescale { alpha: 0.0, base: 0.0 }; 2];
        unroll!(r in 0..2 => {
            let mut mx = f32::NEG_INFINITY;
            unroll!(n in 0..NS => { mx = fmax(mx, fmax(s[n][2 * r], s[n][2 * r + 1])); });
            mx = fmax(mx, shfl_xor(mx, 1));
            mx = fmax(mx, shfl_xor(mx, 2));
            rescale[r] = row_sm[r].raise_max(mx);
            let alpha = rescale[r].alpha;
            unroll!(n in 0..ND, max 32 => {
                o[n][2 * r] *= alpha;
                o[n][2 * r + 1] *= alpha;
            });
        });

        // (5) P = 2^(S - m), summed into l and packed to 16 bits as the A fragments of P V_j:
        // key step kc takes S tiles 2kc (keys 2t, 2t+1) and 2kc + 1 (keys 8 + 2t, 9 + 2t).
        let mut pf = [[0u32; 4]; NS];
        unroll!(n in 0..NS => {
            unroll!(e in 0..4 => {
                s[n][e] = row_sm[e / 2].prob(s[n][e], rescale[e / 2]);
            });
        });
        unroll!(kc in 0..NS / 2 => {
            pf[kc] = [
                E::pack(s[2 * kc][0], s[2 * kc][1]),
                E::pack(s[2 * kc][2], s[2 * kc][3]),
                E::pack(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                E::pack(s[2 * kc + 1][2], s[2 * kc + 1][3]),
            ];
        });

        // (6) V_j has landed and every warp is done reading K_j: start loading K_{j+1}, then
        // O += P V_j. One ldmatrix.x4.trans gives the B fragments of two 8-wide d tiles for one
        // 16-key step: matrices (keys 16kc.., d 16np), (keys 16kc+8.., d 16np), (keys 16kc..,
        // d 16np+8), (keys 16kc+8.., d 16np+8).
        cp_async_wait_all();
        sync_threads();
        if j + 1 < n_tiles {
            unsafe { stage_tile::<D, BC, THREADS>(k_s, k_rows, kv0 + BC, tid) };
        }
        cp_async_commit();
        let v_lane = LaneAddrs::<D>::new(opaque_u32(v_s), lane % 8 + 8 * ((lane / 8) % 2), lane / 16);
        unroll!(kc in 0..NS / 2 => {
            unroll!(np in 0..ND / 2 => {
                let r = unsafe { ldmatrix_x4_trans(v_lane.at(16 * kc, np)) };
                E::mma(&mut o[2 * np], &pf[kc], r[0], r[1]);
                E::mma(&mut o[2 * np + 1], &pf[kc], r[2], r[3]);
            });
        });
        j += 1;
    }

    // Finalise: O = acc / l, LSE = ln2 * (m + log2 l); a row that saw nothing gives O = 0, -inf.
    let o_base = p.o + 2 * (b * p.o_strides.batch + h * p.o_strides.head + q_row0 * p.o_strides.seq);
    let sink2 = if p.sinks != 0 { (unsafe { ld_f32(p.sinks + 4 * h) }) * LOG2E } else { f32::NEG_INFINITY };
    unroll!(r in 0..2 => {
        let mut l = row_sm[r].l;
        l += shfl_xor(l, 1);
        l += shfl_xor(l, 2);
        let row = my_rows[r];
        if row < seq_q {
            let (inv_l, lse) = row_sm[r].finish_with_sink(l, sink2);
            let o_row = o_base + 2 * row as u64 * p.o_strides.seq;
            unroll!(n in 0..ND, max 32 => {
                let pair = E::pack(o[n][2 * r] * inv_l, o[n][2 * r + 1] * inv_l);
                unsafe { st_u32(o_row + 2 * (8 * n + 2 * t) as u64, pair) };
            });
            if t == 0 {
                let la = p.lse + 4 * p.lse_offset(b, h, q_row0 + row as u64);
                unsafe { st_f32(la, lse) };
            }
        }
    });
}
