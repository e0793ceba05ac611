//! `flash_fwd_{bf16,f16}_sm90_d{64,128,256}`: the fused forward for Hopper (`sm_90a`) in
//! FlashAttention-3's structure — TMA tile loads signalled through `mbarrier`s, a producer
//! warpgroup and two consumer warpgroups, `wgmma` for both products. Built into the second PTX
//! module (`memattn_kernels_sm90.ptx`, `cfg(memattn_sm90)`); the host launches it on compute
//! capability 9.x only.
//!
//! Block: 384 threads = three warpgroups, `BR = 128` query rows, key tiles of `BC` (128 at
//! D = 64 and 128, 64 at D = 256), `STAGES = 2` K/V buffers.
//! - Warpgroup 0, the producer, gives registers back (`setmaxnreg.dec 40`); one elected thread
//!   issues the TMA copies: Q once, then per key tile K into stage `i % 2` and V into its stage,
//!   each after waiting for the consumers to release that stage (`empty` barriers) and with the
//!   tile's byte count announced on its `full` barrier (`arrive.expect_tx`).
//! - Warpgroups 1 and 2, the consumers (`setmaxnreg.inc 232`), own query rows `64(wg - 1)..`
//!   of the block. Per key tile: wait for K; `S = Q Kᵀ` as `D / 16` `wgmma` k-steps (Q and K
//!   from shared memory, 128-byte swizzled, K-major); release K; scale, mask, online softmax on
//!   the S registers (each thread holds rows `l / 4` and `l / 4 + 8` of its warp's 16, as in
//!   `mma.sync`'s accumulator; row statistics over the 4 lanes of a quad); P packed to 16 bits
//!   in registers; wait for V; `O += P V` as `BC / 16` `wgmma` k-steps with P from registers
//!   and V from shared memory (MN-major, `imm-trans-b`); release V. Finally `O /= l`, LSE.
//!
//! Ping-pong, FlashAttention-3's scheduling of the two consumers: named barriers (`bar.sync` /
//! `bar.arrive` on ids 1 and 2, 256 threads) make them take turns issuing `Q Kᵀ`, so one
//! warpgroup's softmax runs while the other's GEMMs hold the tensor cores. FlashAttention-3's
//! intra-warpgroup overlap (the next tile's `Q Kᵀ` issued before this tile's softmax, a second
//! S accumulator) is not done here.
//!
//! Shared memory (dynamic, rounded up to 1024 bytes for the swizzle pattern): Q (`D / 64` slabs
//! of `BR` rows × 128 bytes), then `STAGES` K tiles and `STAGES` V tiles (`D / 64` slabs of `BC`
//! rows × 128 bytes each), then the barriers. A slab holds 64 columns of the tile; TMA writes it
//! with the 128-byte swizzle (16-byte chunk `c` of row `r` at `c ^ (r % 8)`), the layout the
//! `wgmma` descriptors name (`crate::hopper::desc_sw128`): K-major (Q, K) with 1024 bytes between
//! 8-row groups and the k-step's 32 bytes added to the start address inside the 128-byte row;
//! MN-major (V) with 1024 bytes between 8-key groups and one slab between 64-column groups.
//!
//! Tensor maps: three 128-byte CUDA tensor maps (Q, K, V) in global memory at
//! [`crate::abi::Sm90Params::tensor_maps`], each 4-d `(D, heads, seq, batch)` with box
//! `(64, 1, rows, 1)` (`(D, seq, heads, batch)` when the tensor's head stride is the larger, as
//! in `[batch, heads, seq, d]`), 128-byte swizzle, out-of-bounds elements zero; varlen tensors are mapped
//! as one sequence of `total` rows (batch 1), so a tile that runs past its sequence reads the
//! next one's rows, which the mask removes (keys) or nobody stores (queries).
//!
//! Semantics as [`crate::flash_fwd_mma`] (FlashAttention-2's): GQA, causal and windows
//! bottom-right ([`crate::mask::key_range`]), soft cap, sinks, varlen. Not in this kernel (the
//! host uses the sm_80 kernels for them): ALiBi, a paged or cached K/V (`seqused_k`).
//!
//! # Safety
//! As [`crate::flash_fwd_mma`], plus: the tensor maps must describe the same tensors as the
//! parameters, 16-byte aligned base addresses and strides; launch with the variant's geometry on
//! an sm_90a device.

#[cfg(memattn_sm90)]
use crate::abi::Sm90Params;
#[cfg(memattn_sm90)]
use crate::device::*;
#[cfg(memattn_sm90)]
use crate::frag::{acc_col, acc_row, quad_max, quad_sum, scale_row, Acc};
#[cfg(memattn_sm90)]
use crate::hopper::*;
#[cfg(memattn_sm90)]
use crate::mma::{smem_addr, Half16};
#[cfg(memattn_sm90)]
use crate::softmax::{softcap2, OnlineSoftmax, LOG2E};
#[cfg(memattn_sm90)]
use crate::timeline::{stamp, Phase};

/// Query rows per block (two consumer warpgroups of 64).
#[cfg(memattn_sm90)]
const BR: usize = crate::tiles::FlashSm90Tile::BR as usize;
/// K/V buffers.
#[cfg(memattn_sm90)]
const STAGES: usize = 2;
/// The first of the consumers' two ping-pong named barriers (id 0 is `bar.sync 0`).
#[cfg(memattn_sm90)]
const PINGPONG: u32 = 1;

#[cfg(memattn_sm90)]
#[repr(C, align(1024))]
pub(crate) struct SmemAtom([u8; 1024]);

/// The kernel body (`NS = BC / 8` slices of S, `ND = D / 8` of O).
///
/// # Safety
/// As the module's safety section.
#[cfg(memattn_sm90)]
#[inline(always)]
#[allow(unconditional_panic)]
pub(crate) unsafe fn flash_fwd_sm90<
    E: Half16 + WgmmaElem,
    const D: usize,
    const BC: usize,
    const NS: usize,
    const ND: usize,
>(
    params: &Sm90Params,
) {
    const { assert!(NS == BC / 8 && ND == D / 8 && D % 64 == 0 && BC % 16 == 0) };
    let p0 = &params.attn;
    let seq = unsafe { sequence_of(p0, ctaid_z()) };
    let (p, b, q_row0, k_row0) = (&seq.p, seq.b, seq.q0, seq.k0);
    let q0 = ctaid_x() as usize * BR;
    if q0 >= p.seq_q as usize {
        return; // uniform over the block, before any barrier
    }
    stamp(Phase::Prologue);
    let tid = tid_x() as usize;
    let wg = tid / 128;
    let h = ctaid_y();
    let hk = p.kv_head(h);
    let seq_q = p.seq_q as usize;

    // Shared memory, aligned up to the 128-byte swizzle's 1024-byte pattern.
    let base = smem_addr(core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<SmemAtom>());
    let base = (base + 1023) & !1023;
    let slabs = D / 64;
    let q_s = base;
    let k_s = q_s + (BR * D * 2) as u32;
    let v_s = k_s + (STAGES * BC * D * 2) as u32;
    let bars = v_s + (STAGES * BC * D * 2) as u32;
    // Barriers: full_q, full_k[2], full_v[2], empty_k[2], empty_v[2] (8 bytes each).
    let full_q = bars;
    let full_k = |s: usize| bars + 8 + 8 * s as u32;
    let full_v = |s: usize| bars + 24 + 8 * s as u32;
    let empty_k = |s: usize| bars + 40 + 8 * s as u32;
    let empty_v = |s: usize| bars + 56 + 8 * s as u32;
    let stage_k = |s: usize| k_s + (s * BC * D * 2) as u32;
    let stage_v = |s: usize| v_s + (s * BC * D * 2) as u32;

    // The key tiles of the block: those meeting [first row's window start, last row's end).
    let last_row = core::cmp::min(q0 + BR, seq_q) - 1;
    let (first_row_start, _) = p.key_range(q0 as u32);
    let (_, last_row_end) = p.key_range(last_row as u32);
    let j_first = first_row_start as u32 / BC as u32;
    let n_tiles = (core::cmp::max(last_row_end, 0) as u32).div_ceil(BC as u32);
    let tiles = n_tiles.saturating_sub(j_first) as usize;

    if tid == 0 {
        unsafe {
            mbar_init(full_q, 1);
            for s in 0..STAGES {
                mbar_init(full_k(s), 1);
                mbar_init(full_v(s), 1);
                // One arrival per consumer warp.
                mbar_init(empty_k(s), 8);
                mbar_init(empty_v(s), 8);
            }
        }
        fence_barrier_init();
    }
    stamp(Phase::Barrier);
    sync_threads();

    if wg == 0 {
        setmaxnreg_dec_40();
        if tid == 0 {
            stamp(Phase::LoadKv);
            let (q_map, k_map, v_map) = (params.tensor_maps, params.tensor_maps + 128, params.tensor_maps + 256);
            unsafe {
                fence_tensormap(q_map);
                fence_tensormap(k_map);
                fence_tensormap(v_map);
                mbar_arrive_expect_tx(full_q, (BR * D * 2) as u32);
                for c in 0..slabs {
                    let at = coords(&p.q_strides, 64 * c as i32, h as i32, (q_row0 as usize + q0) as i32, b as i32);
                    tma_load_4d(q_s + (c * BR * 128) as u32, q_map, at, full_q);
                }
                for i in 0..tiles {
                    let (s, ph) = (i % STAGES, ((i / STAGES) & 1) as u32);
                    let row = (k_row0 as usize + (j_first as usize + i) * BC) as i32;
                    stamp(Phase::WaitSlot);
                    mbar_wait(empty_k(s), ph ^ 1);
                    stamp(Phase::LoadKv);
                    mbar_arrive_expect_tx(full_k(s), (BC * D * 2) as u32);
                    for c in 0..slabs {
                        let dst = stage_k(s) + (c * BC * 128) as u32;
                        tma_load_4d(
                            dst,
                            k_map,
                            coords(&p.k_strides, 64 * c as i32, hk as i32, row, b as i32),
                            full_k(s),
                        );
                    }
                    stamp(Phase::WaitSlot);
                    mbar_wait(empty_v(s), ph ^ 1);
                    stamp(Phase::LoadKv);
                    mbar_arrive_expect_tx(full_v(s), (BC * D * 2) as u32);
                    for c in 0..slabs {
                        let dst = stage_v(s) + (c * BC * 128) as u32;
                        tma_load_4d(
                            dst,
                            v_map,
                            coords(&p.v_strides, 64 * c as i32, hk as i32, row, b as i32),
                            full_v(s),
                        );
                    }
                }
            }
        }
        stamp(Phase::End);
        return;
    }

    // A consumer warpgroup: rows 64 (wg - 1).. of the block. Two instantiations of its loop:
    // the common one (positive scale, no soft cap) takes the row max on the raw scores and
    // applies the scale inside the exponent (one FFMA per score into `ex2`); the other scales
    // (or caps) every score first.
    setmaxnreg_inc_232();
    let smem = Smem { q_s, k_s, v_s, bars };
    let fast = !(p.softcap > 0.0) && p.softmax_scale > 0.0;
    if fast {
        unsafe { consume::<E, D, BC, NS, ND, true>(p, &smem, b, q_row0, q0, h, tid, j_first, tiles) }
    } else {
        unsafe { consume::<E, D, BC, NS, ND, false>(p, &smem, b, q_row0, q0, h, tid, j_first, tiles) }
    }
}

/// The shared-memory layout of a block (byte addresses in the shared window).
#[cfg(memattn_sm90)]
struct Smem {
    q_s: u32,
    k_s: u32,
    v_s: u32,
    bars: u32,
}

/// One consumer warpgroup's key loop and epilogue (`FAST`: no soft cap and a positive scale).
///
/// # Safety
/// As the module's safety section; called by the 256 consumer threads of a block.
#[cfg(memattn_sm90)]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn consume<
    E: Half16 + WgmmaElem,
    const D: usize,
    const BC: usize,
    const NS: usize,
    const ND: usize,
    const FAST: bool,
>(
    p: &crate::abi::AttnParams,
    smem: &Smem,
    b: u64,
    q_row0: u64,
    q0: usize,
    h: u32,
    tid: usize,
    j_first: u32,
    tiles: usize,
) {
    let (q_s, bars) = (smem.q_s, smem.bars);
    let full_q = bars;
    let full_k = |s: usize| bars + 8 + 8 * s as u32;
    let full_v = |s: usize| bars + 24 + 8 * s as u32;
    let empty_k = |s: usize| bars + 40 + 8 * s as u32;
    let empty_v = |s: usize| bars + 56 + 8 * s as u32;
    let stage_k = |s: usize| smem.k_s + (s * BC * D * 2) as u32;
    let stage_v = |s: usize| smem.v_s + (s * BC * D * 2) as u32;
    let seq_q = p.seq_q as usize;
    let wg = tid / 128;
    let (warp, lane) = ((tid % 128) / 32, tid % 32);
    let (g, t) = (lane / 4, lane % 4);
    let wrow0 = 64 * (wg - 1);
    // This lane's two rows (block-relative + q0): g and g + 8 of the warp's 16.
    let row_a = q0 + wrow0 + 16 * warp + g;
    let rows = [row_a, row_a + 8];

    let softcap_on = !FAST && p.softcap > 0.0;
    let scale = if softcap_on { p.softmax_scale / p.softcap } else { p.softmax_scale * LOG2E };
    let cap2 = p.softcap * LOG2E;

    let mut o = [[0.0f32; 4]; ND];
    let mut st = [OnlineSoftmax::new(), OnlineSoftmax::new()];
    let mut lsum = [0.0f32; 2];

    stamp(Phase::WaitKv);
    unsafe { mbar_wait(full_q, 0) };
    // Q's descriptor for k-step kk: slab kk / 4, 32 bytes per k-step inside the 128-byte row.
    let q_desc0 = desc_sw128(q_s + (wrow0 * 128) as u32, 16, 1024);
    // A descriptor plus `bytes` (the start address field is in 16-byte units; every address
    // here is below 256 KiB, so the field never carries into the next).
    let at = |desc: u64, bytes: usize| desc + (bytes >> 4) as u64;

    // Ping-pong (FlashAttention-3's warp-scheduler barriers): a consumer issues a tile's
    // `Q Kᵀ` only after the other consumer has issued its own for the previous step, so the two
    // take turns on the tensor cores and one's softmax runs while the other's GEMM does. Named
    // barrier `PINGPONG + c` (256 threads: this warpgroup's sync and the other's arrive) is
    // consumer `c`'s turn; consumer 1 hands consumer 0 the first one, and skips its last
    // hand-over, so every arrival is matched by a sync.
    let c = (wg - 1) as u32;
    if c == 1 && tiles > 0 {
        named_bar_arrive(PINGPONG, 256);
    }
    let mut i = 0;
    while i < tiles {
        let (s, ph) = (i % STAGES, ((i / STAGES) & 1) as u32);
        let j = j_first as usize + i;
        let key0 = j * BC;
        let mut sacc = [[0.0f32; 4]; NS];
        stamp(Phase::WaitKv);
        unsafe { mbar_wait(full_k(s), ph) };
        stamp(Phase::Barrier);
        named_bar_sync(PINGPONG + c, 256);
        stamp(Phase::Qk);
        wgmma_fence(&mut sacc);
        // One base descriptor per operand per tile, steps added at each k-step (opaque: the
        // compiler would otherwise keep all D / 16 Q descriptors live through the loop).
        let (qd, kd) = (opaque_u64(q_desc0), desc_sw128(stage_k(s), 16, 1024));
        unroll!(kk in 0..D / 16, max 32 => {
            let step = 32 * (kk % 4);
            let qa = at(qd, (kk / 4) * BR * 128 + step);
            let ka = at(kd, (kk / 4) * BC * 128 + step);
            unsafe { E::qk::<NS>(&mut sacc, qa, ka, (kk > 0) as u32) };
        });
        wgmma_commit();
        if c == 0 || i + 1 < tiles {
            named_bar_arrive(PINGPONG + 1 - c, 256);
        }
        wgmma_wait_all(&mut sacc);
        if lane == 0 {
            unsafe { mbar_arrive(empty_k(s)) };
        }

        stamp(Phase::Softmax);
        // Scores in the log2 domain (the fast loop keeps them raw and scales in the exponent).
        if !FAST {
            unroll!(n in 0..NS, max 32 => {
                unroll4!(e in 0..4 => {
                    sacc[n][e] = if softcap_on { softcap2(sacc[n][e] * scale, cap2) } else { sacc[n][e] * scale };
                });
            });
        }
        // Keys outside each row's window (and past seq_kv) are -inf; columns are relative to
        // this lane's first column, key0 + 2t.
        let c0 = (key0 + 2 * t) as i64;
        let (s0, e0) = p.key_range(rows[0] as u32);
        let (s1, e1) = p.key_range(rows[1] as u32);
        let clamp = |x: i64| x.clamp(i32::MIN as i64, i32::MAX as i64) as i32;
        if s0 > key0 as i64 || s1 > key0 as i64 || e0 < (key0 + BC) as i64 || e1 < (key0 + BC) as i64 {
            mask_outside(&mut sacc, [clamp(s0 - c0), clamp(s1 - c0)], [clamp(e0 - c0), clamp(e1 - c0)]);
        }
        // Online softmax: raise each row's max, rescale its running sum and O.
        unroll2!(r in 0..2 => {
            let m = quad_max(row_max(&sacc, r));
            // The fast loop's max is of raw scores; the scale is positive, so scaling it
            // gives the max of the scaled ones (-inf stays -inf).
            let rs = st[r].raise_max(if FAST { m * scale } else { m });
            lsum[r] *= rs.alpha;
            scale_row(&mut o, r, rs.alpha);
            unroll!(n in 0..NS, max 32 => {
                unroll2!(e in 0..2 => {
                    let x = if FAST {
                        exp2(fma(sacc[n][2 * r + e], scale, -rs.base))
                    } else {
                        exp2(sacc[n][2 * r + e] - rs.base)
                    };
                    lsum[r] += x;
                    sacc[n][2 * r + e] = x;
                });
            });
        });
        let mut pf = pack_a(&sacc, E::pack);

        stamp(Phase::WaitKv);
        unsafe { mbar_wait(full_v(s), ph) };
        stamp(Phase::Pv);
        fence_a_operands(&mut pf, BC / 16);
        wgmma_fence(&mut o);
        let vd = desc_sw128(stage_v(s), (BC * 128) as u32, 1024);
        unroll!(kk in 0..BC / 16, max 32 => {
            // Keys 16kk..16kk + 16: two 8-key groups 1024 bytes apart, one slab per 64 columns.
            unsafe { E::pv::<ND>(&mut o, &pf[kk], at(vd, kk * 16 * 128)) };
        });
        wgmma_commit();
        wgmma_wait_all(&mut o);
        if lane == 0 {
            unsafe { mbar_arrive(empty_v(s)) };
        }
        i += 1;
    }

    stamp(Phase::Epilogue);
    // O = acc / l, LSE (natural log); rows past seq_q store nothing.
    let hh = h as u64;
    let o_base = p.o + 2 * (b * p.o_strides.batch + hh * p.o_strides.head + q_row0 * p.o_strides.seq);
    let sink2 = if p.sinks != 0 { (unsafe { ld_f32(p.sinks + 4 * hh) }) * LOG2E } else { f32::NEG_INFINITY };
    unroll2!(r in 0..2 => {
        let l = quad_sum(lsum[r]);
        let row = rows[r];
        if row < seq_q {
            let (inv_l, lse) = OnlineSoftmax { m: st[r].m, l }.finish_with_sink(l, sink2);
            let o_row = o_base + 2 * row as u64 * p.o_strides.seq;
            unroll!(n in 0..ND, max 32 => {
                let pair = E::pack(o[n][2 * r] * inv_l, o[n][2 * r + 1] * inv_l);
                unsafe { st_u32(o_row + 2 * (8 * n + 2 * t) as u64, pair) };
            });
            if t == 0 {
                let la = p.lse + 4 * p.lse_offset(b, hh, q_row0 + row as u64);
                unsafe { st_f32(la, lse) };
            }
        }
    });
    stamp(Phase::End);
}

/// A tile's TMA coordinates `(column, head, row, batch)` in the order of its tensor map's
/// dimensions: `(D, heads, seq, batch)`, or `(D, seq, heads, batch)` when the head stride is the
/// larger (the host's `memattn::tma::forward_maps` orders the dimensions by the same rule).
#[cfg(memattn_sm90)]
#[inline(always)]
fn coords(s: &crate::abi::Strides, col: i32, head: i32, row: i32, batch: i32) -> [i32; 4] {
    if s.head > s.seq {
        [col, row, head, batch]
    } else {
        [col, head, row, batch]
    }
}

// `crate::frag`'s helpers spell out at most 8 slices; these take the 16 of a 128-key tile.

/// The largest of this lane's elements of row `r` (0: `g`, 1: `g + 8`) in `N` slices.
#[cfg(memattn_sm90)]
#[inline(always)]
fn row_max<const N: usize>(s: &[Acc; N], r: usize) -> f32 {
    let mut x = f32::NEG_INFINITY;
    unroll!(n in 0..N, max 32 => { x = max_f32(x, max_f32(s[n][2 * r], s[n][2 * r + 1])); });
    x
}

/// `-inf` for each element of row `r` whose column (relative to the lane's first) is outside
/// `[lo[r], hi[r])`.
#[cfg(memattn_sm90)]
#[inline(always)]
fn mask_outside<const N: usize>(s: &mut [Acc; N], lo: [i32; 2], hi: [i32; 2]) {
    unroll!(n in 0..N, max 32 => {
        unroll4!(e in 0..4 => {
            let c = acc_col(n, e) as i32;
            if c < lo[acc_row(e)] || c >= hi[acc_row(e)] {
                s[n][e] = f32::NEG_INFINITY;
            }
        });
    });
}

/// The register A operands of `P V`: k-step `kc` from slices `2kc` and `2kc + 1`.
#[cfg(memattn_sm90)]
#[inline(always)]
fn pack_a<const N: usize>(s: &[Acc; N], pack: impl Fn(f32, f32) -> u32) -> [[u32; 4]; N] {
    let mut pf = [[0u32; 4]; N];
    unroll!(kc in 0..N / 2, max 32 => {
        pf[kc] = [
            pack(s[2 * kc][0], s[2 * kc][1]),
            pack(s[2 * kc][2], s[2 * kc][3]),
            pack(s[2 * kc + 1][0], s[2 * kc + 1][1]),
            pack(s[2 * kc + 1][2], s[2 * kc + 1][3]),
        ];
    });
    pf
}
