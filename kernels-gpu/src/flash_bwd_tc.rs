//! `flash_bwd_{bf16,f16}_d{64,128}`: the backward of fused attention on tensor cores with
//! FlashAttention-2's two-dimensional warp layout (Dao 2023, Algorithm 2; the structure of
//! `flash_bwd_kernel.h`): 16-bit Q, K, V, O, dO and gradients, f32 accumulation.
//!
//! It is the main kernel of the three the backward launches, like [`crate::flash_bwd_mma`]
//! (whose one-warp-per-16-keys layout stays for d32 and as the compact kernel of GPUs with at
//! most 99 KiB of shared memory per block); the preprocess and the convert are
//! [`crate::flash_bwd_f32`]'s.
//!
//! Algorithm: a block of 8 warps owns `BC` keys of one K/V head (K and V staged once) and walks
//! the query tiles of `BR = 128` rows of every query head that reads the K/V head (GQA: the
//! group's gradients are summed in registers, no atomics on dK/dV). Per query tile, with Q and dO
//! staged:
//! 1. **P and dS** (warp `w`: query rows `32 (w % 4)..+32`, keys `BC/2 (w / 4)..+BC/2` in
//!    passes of 32 keys): `S = Q Kᵀ` and `dP = dO Vᵀ` (2 m-tiles x 4 n-tiles each, A = Q or
//!    dO rows, B = K or V rows, the forward's operand shapes), `P = 2^(s·log2 e − LSE·log2 e)`
//!    (no `N x N` buffer: P comes back from the saved LSE), `dS = P ∘ (dP − D) · ds/dx`, keys a
//!    row may not see 0 (only in tiles that need it); P and dS go to shared memory in 16 bits
//!    (`[BR][BC]`, as FlashAttention-2 rounds them). LSE and D of the warp's rows are read from
//!    global memory into registers.
//! 2. **dV += Pᵀ dO, dK += dSᵀ Q** (warp `w`: keys `32 (w % WKK)..+32`, head-dim columns
//!    `8 NKD (w / WKK)..`): A = Pᵀ or dSᵀ read transposed from P or dS (`ldmatrix.trans`), B =
//!    dO or Q through `ldmatrix.trans`; the f32 accumulators stay in registers for the whole
//!    block.
//! 3. **dQ += dS K** (warp `w`: query rows `32 (w % 4)..+32`, columns `8 NQD (w / 4)..`): A =
//!    dS rows, B = K through `ldmatrix.trans`; atomic mode adds each element to the f32
//!    accumulator with `red.global.add.f32`, deterministic mode stores into key block `x`'s own
//!    slice.
//!
//! Every warp's tile is 32 x 32 (dQ at d128: 32 x 64), so every shared-memory operand is read
//! by two to four warps instead of by every warp (the one-warp-per-16-keys kernel reads Q and dO
//! in all of them). Two barriers per query tile: after the P/dS stores and before the next tile
//! overwrites Q, dO, P and dS.
//!
//! Masking: a (key block, query tile) pair is skipped when no row of the tile sees a key of the
//! block; masked element by element only when some row does not see every key of the block;
//! otherwise nothing is masked. Query rows past `seq_q` are zero-filled with LSE `+inf`, so their
//! P is exactly 0. Every lane reaches every barrier, `ldmatrix` and `mma`.
//!
//! Shapes, strides, varlen and the dQ accumulator as [`crate::flash_bwd_mma`].
//!
//! Tiles ([`crate::tiles::FLASH_BWD_TC_D64`], [`crate::tiles::FLASH_BWD_TC_D128`]): 8 warps,
//! Br 128; Bc 128 at d64, 64 at d128. Shared memory (swizzled like the forward's,
//! [`crate::swizzle`]): K, V `[BC][D]`, Q, dO `[BR][D]`, P, dS `[BR][BC]`, all 16-bit: 128 KiB
//! at both head dims (opt-in; sm_80 and sm_90 allow 163 and 227 KiB per block).
//!
//! # Safety
//! As [`crate::flash_bwd_mma`]'s: all pointers valid for their shapes and strides; Q, K, V and
//! dO rows 16-byte aligned, dK and dV rows 4-byte aligned; the dQ accumulator and D private to
//! the call; `seq_kv < 2^31`; launched after the preprocess and before the convert, with the
//! variant's launch geometry and dynamic shared memory, on sm_80 or newer.

#[cfg(target_arch = "nvptx64")]
use crate::abi::BwdParams;
#[cfg(target_arch = "nvptx64")]
use crate::device::*;
#[cfg(target_arch = "nvptx64")]
use crate::staging::{stage_tile, Rows, SmemChunk};
#[cfg(target_arch = "nvptx64")]
use crate::frag::{ldsm_a_lane, ldsm_b_lane, ldsm_bt_lane};
#[cfg(target_arch = "nvptx64")]
use crate::mma::*;
#[cfg(target_arch = "nvptx64")]
use crate::softmax::{tanh, LOG2E};
#[cfg(target_arch = "nvptx64")]
use crate::swizzle::{swizzled_offset, TileLane};

/// Query rows per tile.
pub const BR: usize = 128;
/// Threads per block (8 warps).
pub const THREADS: usize = 256;

/// The generic body, instantiated by the rows of [`crate::variants`] with their tile's
/// constants: `KD = D / 16` k-steps of S and dP, `NSK = BC / 64` passes of 32 keys per warp in
/// step 1, `WKK = BC / 32` warps over the keys of dK and dV (and `8 / WKK` over their head dim,
/// `NKD` 8-column tiles each), `NQD = D / 16` 8-column tiles of dQ per warp. The soft cap is a
/// separate instantiation, so the common loop has no tanh.
///
/// # Safety
/// As the module's safety section.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn flash_bwd<
    E: Half16,
    const D: usize,
    const BC: usize,
    const KD: usize,
    const NSK: usize,
    const WKK: usize,
    const NKD: usize,
    const NQD: usize,
>(
    bp: &BwdParams,
) {
    if bp.attn.softcap > 0.0 {
        unsafe { body::<E, D, BC, KD, NSK, WKK, NKD, NQD, true>(bp) }
    } else {
        unsafe { body::<E, D, BC, KD, NSK, WKK, NKD, NQD, false>(bp) }
    }
}

#[cfg(target_arch = "nvptx64")]
#[inline(always)]
unsafe fn body<
    E: Half16,
    const D: usize,
    const BC: usize,
    const KD: usize,
    const NSK: usize,
    const WKK: usize,
    const NKD: usize,
    const NQD: usize,
    const SOFTCAP: bool,
>(
    bp: &BwdParams,
) {
    const {
        assert!(KD == D / 16 && NSK * 64 == BC && WKK * 32 == BC && NKD * 8 * (8 / WKK) == D && NQD * 16 == D);
        assert!(D.is_multiple_of(64) && NKD.is_power_of_two() && NKD >= 2 && NQD.is_power_of_two());
    };
    let seq = unsafe { sequence_of(&bp.attn, ctaid_z()) };
    let (p, b, q_row0, k_row0) = (&seq.p, seq.b, seq.q0, seq.k0);
    let (seq_q, seq_kv) = (p.seq_q as usize, p.seq_kv as usize);
    let kv0 = ctaid_x() as usize * BC;
    if kv0 >= seq_kv {
        return; // uniform over the block: before any barrier
    }
    let hk = ctaid_y() as u64;
    let group = (if p.heads_kv != 0 && p.heads_kv <= p.heads { p.heads / p.heads_kv } else { 1 }) as u64;
    let tid = tid_x() as usize;

    // Shared memory: K, V, Q, dO, P, dS (16-bit, swizzled).
    let smem = core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<SmemChunk>();
    let k_s = smem_addr(smem);
    let v_s = k_s + (BC * D * 2) as u32;
    let q_s = v_s + (BC * D * 2) as u32;
    let do_s = q_s + (BR * D * 2) as u32;
    let p_s = do_s + (BR * D * 2) as u32;
    let ds_s = p_s + (BR * BC * 2) as u32;

    let slice = |ptr: u64, s: &crate::abi::Strides, b: u64, head: u64, row0: u64, len: u32| Rows {
        base: global_addr(ptr) + 2 * (b * s.batch + head * s.head + row0 * s.seq),
        stride: 2 * s.seq,
        len: len as usize,
        cols: p.head_dim,
    };
    unsafe {
        stage_tile::<D, BC, THREADS>(k_s, slice(p.k, &p.k_strides, b, hk, k_row0, p.seq_kv), kv0, tid);
        stage_tile::<D, BC, THREADS>(v_s, slice(p.v, &p.v_strides, b, hk, k_row0, p.seq_kv), kv0, tid);
    }
    cp_async_commit(); // waited for with the first query tile

    let kv_end = core::cmp::min(kv0 + BC, seq_kv);
    let (scale0, softcap0) = (p.softmax_scale, p.softcap);

    let mut dk = [[[0.0f32; 4]; NKD]; 2];
    let mut dv = [[[0.0f32; 4]; NKD]; 2];
    // 32-bit loop counters: fewer registers held through the loops.
    let (h_end, mut h) = ((hk as u32 + 1) * group as u32, hk as u32 * group as u32);
    while h < h_end {
        let mut q0 = 0u32;
        while q0 < p.seq_q {
            // Query tiles whose rows see none of the block's keys are skipped (uniform); a tile
            // whose every row sees every key of the block (all of them < seq_kv) is not masked.
            let last = core::cmp::min(q0 + BR as u32, p.seq_q) - 1;
            let (first_start, first_end) = p.key_range(q0);
            let (last_start, last_end) = p.key_range(last);
            if last_end <= kv0 as i64 || first_start >= kv_end as i64 {
                q0 += BR as u32;
                continue;
            }
            let full = last_start <= kv0 as i64 && first_end >= (kv0 + BC) as i64;
            let nrows = (last + 1 - q0) as usize;
            // The tile's first row through an opaque move: addresses are formed from it in every
            // tile, not carried from tile to tile as induction variables.
            let qa = opaque_u32(q0) as usize;

            // Every warp is done with the previous tile's Q, dO, P and dS.
            sync_threads();
            // The thread's indices from a fresh `%tid.x` in every tile: everything derived from
            // them (the lane addresses of six tiles, the mask's offsets) is formed here rather
            // than held in registers through the loops, which the accumulators fill.
            let tid = tid_x_fresh() as usize;
            let (warp, lane) = (tid / 32, tid % 32);
            let (g, t) = (lane / 4, lane % 4);
            // Steps 1 and 3: query rows 32 wq..; step 1: keys (BC / 2) wk..; step 3: dQ columns
            // 8 NQD wqd..; step 2: keys 32 wkk.., dK/dV columns 8 NKD wkd...
            let wq = warp % 4;
            let wk = warp / 4;
            let (wkk, wkd) = (warp % WKK, warp / WKK);
            let ho = opaque_u32(h) as u64;
            // s = scale · x (x = q·k), or with a soft cap s = c · tanh(scale · x / c); ds/dx is
            // `scale` or `scale · (1 - tanh²)`. P = 2^(s · log2 e - LSE · log2 e). Derived in
            // every tile from opaque copies (two registers through the loops, not four).
            let scale = f32::from_bits(opaque_u32(scale0.to_bits()));
            let c2 = scale * LOG2E;
            let softcap = f32::from_bits(opaque_u32(softcap0.to_bits()));
            let cap_arg = if SOFTCAP { scale / softcap } else { 0.0 };
            let cap2 = softcap * LOG2E;
            // The batch and first row through opaque moves too: the slices' row addresses are
            // formed here, not held through the loops.
            let (b, q_row0) = (opaque_u64(b), opaque_u64(q_row0));
            let q_rows = slice(p.q, &p.q_strides, b, ho, q_row0, p.seq_q);
            let do_rows = slice(bp.d_o, &bp.d_o_strides, b, ho, q_row0, p.seq_q);
            unsafe {
                stage_tile::<D, BR, THREADS>(q_s, q_rows, qa, tid);
                stage_tile::<D, BR, THREADS>(do_s, do_rows, qa, tid);
            }
            cp_async_commit();
            // LSE (log2 domain) and D of this lane's rows 32 wq + 16 i/2 + g + 8 (i % 2); rows
            // past seq_q: P = 2^(s - inf) = 0.
            let mut lse = [f32::INFINITY; 4];
            let mut dd = [0.0f32; 4];
            unroll4!(i in 0..4 => {
                let r = 32 * wq + 16 * (i / 2) + g + 8 * (i % 2);
                if r < nrows {
                    let at = p.lse_offset(b, ho, q_row0 + (qa + r) as u64);
                    unsafe {
                        lse[i] = ld_f32(p.lse + 4 * at) * LOG2E;
                        dd[i] = ld_f32(bp.delta + 4 * at);
                    }
                }
            });
            cp_async_wait_all();
            sync_threads();

            // (1) S, dP, then P and dS into shared memory, in passes of 32 keys.
            let (a_r, a_c) = ldsm_a_lane(lane);
            let q_a = TileLane::<D>::new(opaque_u32(q_s), 32 * wq + a_r, a_c);
            let do_a = TileLane::<D>::new(opaque_u32(do_s), 32 * wq + a_r, a_c);
            let (b_r, b_c) = ldsm_b_lane(lane);
            let k_b = TileLane::<D>::new(opaque_u32(k_s), (BC / 2) * wk + b_r, b_c);
            let v_b = TileLane::<D>::new(opaque_u32(v_s), (BC / 2) * wk + b_r, b_c);
            unroll4!(ps in 0..NSK => {
                let mut s = [[[0.0f32; 4]; 4]; 2];
                let mut dp = [[[0.0f32; 4]; 4]; 2];
                unroll8!(kk in 0..KD => {
                    let qa0 = unsafe { ldmatrix_x4(q_a.at(0, kk)) };
                    let qa1 = unsafe { ldmatrix_x4(q_a.at(16, kk)) };
                    unroll2!(np in 0..2 => {
                        let r = unsafe { ldmatrix_x4(k_b.at(32 * ps + 16 * np, kk)) };
                        E::mma(&mut s[0][2 * np], &qa0, r[0], r[1]);
                        E::mma(&mut s[0][2 * np + 1], &qa0, r[2], r[3]);
                        E::mma(&mut s[1][2 * np], &qa1, r[0], r[1]);
                        E::mma(&mut s[1][2 * np + 1], &qa1, r[2], r[3]);
                    });
                    let oa0 = unsafe { ldmatrix_x4(do_a.at(0, kk)) };
                    let oa1 = unsafe { ldmatrix_x4(do_a.at(16, kk)) };
                    unroll2!(np in 0..2 => {
                        let r = unsafe { ldmatrix_x4(v_b.at(32 * ps + 16 * np, kk)) };
                        E::mma(&mut dp[0][2 * np], &oa0, r[0], r[1]);
                        E::mma(&mut dp[0][2 * np + 1], &oa0, r[2], r[3]);
                        E::mma(&mut dp[1][2 * np], &oa1, r[0], r[1]);
                        E::mma(&mut dp[1][2 * np + 1], &oa1, r[2], r[3]);
                    });
                });

                // P and dS for every element: element e of n-tile n of m-tile mt is query row
                // 32 wq + 16 mt + g + 8 (e / 2), key (BC / 2) wk + 32 ps + 8 n + 2t + e % 2.
                unroll2!(mt in 0..2 => {
                    unroll4!(n in 0..4 => {
                        unroll4!(e in 0..4 => {
                            let i = 2 * mt + e / 2;
                            let x = s[mt][n][e];
                            let (sv, dsdx) = if SOFTCAP {
                                let th = tanh(x * cap_arg);
                                (th * cap2, scale * (1.0 - th * th))
                            } else {
                                (x * c2, scale)
                            };
                            let pr = exp2(sv - lse[i]);
                            s[mt][n][e] = pr;
                            dp[mt][n][e] = pr * (dp[mt][n][e] - dd[i]) * dsdx;
                        });
                    });
                });
                if !full {
                    // The mask as offsets from the diagonal: key j is seen by query row i iff
                    // j < seq_kv and -left <= j - (i + seq_kv - seq_q) <= right (right 0 when
                    // causal; an unbounded side never binds), `mask::key_range`'s rule. Formed
                    // here from opaque copies, so none of it is held through the loop. (A row
                    // that sees no key has LSE = -inf and an infinite P here; the select
                    // replaces it.)
                    let (wl, wr) = (opaque_u32(p.window_left as u32) as i32, opaque_u32(p.window_right as u32) as i32);
                    let unbounded = 1i64 << 40;
                    let lo = if wl >= 0 { -(wl as i64) } else { -unbounded };
                    let hi = if p.causal != 0 {
                        0
                    } else if wr >= 0 {
                        wr as i64
                    } else {
                        unbounded
                    };
                    let (sq, skv) = (opaque_u32(seq_q as u32) as i64, opaque_u32(seq_kv as u32) as i64);
                    let key0 = opaque_u32((kv0 + (BC / 2) * wk + 32 * ps + 2 * t) as u32) as i64;
                    let off0 = key0 - (qa + 32 * wq + g) as i64 - (skv - sq);
                    let keys_left = skv - key0; // columns c with c < keys_left exist
                    unroll2!(mt in 0..2 => {
                        unroll4!(n in 0..4 => {
                            unroll4!(e in 0..4 => {
                                let c = (8 * n + e % 2) as i64;
                                let off = off0 + c - (16 * mt + 8 * (e / 2)) as i64;
                                if !(off >= lo && off <= hi && c < keys_left) {
                                    s[mt][n][e] = 0.0;
                                    dp[mt][n][e] = 0.0;
                                }
                            });
                        });
                    });
                }

                // P and dS to shared memory: the pair of keys 8n + 2t, 8n + 2t + 1 of row
                // 32 wq + 16 mt + g + 8r is one 32-bit word of chunk n of the pass's four; chunk
                // n is chunk 0's position XOR 16n (the pass starts on a multiple of 4 chunks,
                // the tile is 128-byte aligned), so each row takes one address register.
                unroll2!(mt in 0..2 => {
                    unroll2!(r in 0..2 => {
                        let row = 32 * wq + 16 * mt + g + 8 * r;
                        let chunk0 = ((BC / 2) * wk + 32 * ps) / 8;
                        let off = opaque_u32((swizzled_offset(BC, row, chunk0) + 4 * t) as u32);
                        unroll4!(n in 0..4 => {
                            let at = off ^ (16 * n) as u32;
                            unsafe {
                                st_shared_u32(p_s + at, E::pack(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
                                st_shared_u32(ds_s + at, E::pack(dp[mt][n][2 * r], dp[mt][n][2 * r + 1]));
                            }
                        });
                    });
                });
            });

            sync_threads(); // P and dS of every warp are stored

            // (2) dV += Pᵀ dO, dK += dSᵀ Q over the tile's 128 query rows: A = Pᵀ, dSᵀ read
            // transposed (the warp's keys are columns 32 wkk.. of P and dS: chunk 4 wkk, its
            // second m-tile chunk 4 wkk + 2), B = dO, Q through `.trans`.
            let (bt_r, bt_c) = ldsm_bt_lane(lane);
            let p_at = TileLane::<BC>::new(opaque_u32(p_s), b_r, b_c + 4 * wkk);
            let ds_at = TileLane::<BC>::new(opaque_u32(ds_s), b_r, b_c + 4 * wkk);
            let do_bt = TileLane::<D>::new(opaque_u32(do_s), bt_r, bt_c + NKD * wkd);
            let q_bt = TileLane::<D>::new(opaque_u32(q_s), bt_r, bt_c + NKD * wkd);
            unroll8!(ks in 0..BR / 16 => {
                let pa0 = unsafe { ldmatrix_x4_trans(p_at.at(16 * ks, 0)) };
                let pa1 = unsafe { ldmatrix_x4_trans(p_at.at(16 * ks, 1)) };
                unroll4!(np in 0..NKD / 2 => {
                    let r = unsafe { ldmatrix_x4_trans(do_bt.at(16 * ks, np)) };
                    E::mma(&mut dv[0][2 * np], &pa0, r[0], r[1]);
                    E::mma(&mut dv[0][2 * np + 1], &pa0, r[2], r[3]);
                    E::mma(&mut dv[1][2 * np], &pa1, r[0], r[1]);
                    E::mma(&mut dv[1][2 * np + 1], &pa1, r[2], r[3]);
                });
                let da0 = unsafe { ldmatrix_x4_trans(ds_at.at(16 * ks, 0)) };
                let da1 = unsafe { ldmatrix_x4_trans(ds_at.at(16 * ks, 1)) };
                unroll4!(np in 0..NKD / 2 => {
                    let r = unsafe { ldmatrix_x4_trans(q_bt.at(16 * ks, np)) };
                    E::mma(&mut dk[0][2 * np], &da0, r[0], r[1]);
                    E::mma(&mut dk[0][2 * np + 1], &da0, r[2], r[3]);
                    E::mma(&mut dk[1][2 * np], &da1, r[0], r[1]);
                    E::mma(&mut dk[1][2 * np + 1], &da1, r[2], r[3]);
                });
            });

            // (3) dQ += dS K for query rows 32 wq.. and the warp's NQD column tiles.
            let wqd = warp / 4;
            let ds_a = TileLane::<BC>::new(opaque_u32(ds_s), 32 * wq + a_r, a_c);
            let k_bt = TileLane::<D>::new(opaque_u32(k_s), bt_r, bt_c + NQD * wqd);
            let mut acc = [[[0.0f32; 4]; NQD]; 2];
            unroll8!(ks in 0..BC / 16 => {
                let a0 = unsafe { ldmatrix_x4(ds_a.at(0, ks)) };
                let a1 = unsafe { ldmatrix_x4(ds_a.at(16, ks)) };
                unroll4!(j in 0..NQD / 2 => {
                    let r = unsafe { ldmatrix_x4_trans(k_bt.at(16 * ks, j)) };
                    E::mma(&mut acc[0][2 * j], &a0, r[0], r[1]);
                    E::mma(&mut acc[0][2 * j + 1], &a0, r[2], r[3]);
                    E::mma(&mut acc[1][2 * j], &a1, r[0], r[1]);
                    E::mma(&mut acc[1][2 * j + 1], &a1, r[2], r[3]);
                });
            });
            unroll2!(mt in 0..2 => {
                unroll2!(r in 0..2 => {
                    let qr = 32 * wq + 16 * mt + g + 8 * r;
                    if qr < nrows {
                        let row = q_row0 + (qa + qr) as u64;
                        // One address per row; the columns 8 (NQD wqd + n) + 2t (+ 1) are
                        // immediates from it.
                        let first = (8 * NQD * wqd + 2 * t) as u64;
                        // Atomic mode: the one accumulator; deterministic: key block x's own
                        // slice (x read again, not held through the loop).
                        let slice0 = bp.dq_accum + 4 * ctaid_x_fresh() as u64 * bp.dq_split_stride;
                        let base = opaque_u64(slice0 + 4 * (bp.dq_accum_strides.offset(b, row, ho) + first));
                        // Columns past a head dim below D are not stored.
                        unroll8!(n in 0..NQD => {
                            let at = base + 32 * n as u64;
                            if ((8 * NQD * wqd + 8 * n) as u32) >= bp.attn.head_dim {
                            } else if bp.dq_split_stride == 0 {
                                unsafe {
                                    red_add_f32(at, acc[mt][n][2 * r]);
                                    red_add_f32(at + 4, acc[mt][n][2 * r + 1]);
                                }
                            } else {
                                // The block's own slice: written once.
                                unsafe {
                                    st_f32(at, acc[mt][n][2 * r]);
                                    st_f32(at + 4, acc[mt][n][2 * r + 1]);
                                }
                            }
                        });
                    }
                });
            });
            q0 += BR as u32;
        }
        h += 1;
    }

    // dK and dV of the warp's keys and columns, summed over the group's query heads, in 16 bits.
    // The block's sequence, K/V head and keys are read again (fresh special-register reads)
    // rather than kept in registers through the loops.
    cp_async_wait_all(); // K and V, when no query tile met the block
    let seq = unsafe { sequence_of(&bp.attn, ctaid_z_fresh()) };
    let (b, k_row0, seq_kv) = (seq.b, seq.k0, seq.p.seq_kv as usize);
    let hk = ctaid_y_fresh() as u64;
    let lane = tid_x_fresh() as usize % 32;
    let t = lane % 4;
    let warp = tid_x_fresh() as usize / 32;
    let key0 = ctaid_x_fresh() as usize * BC + 32 * (warp % WKK) + lane / 4;
    let first = 8 * NKD * (warp / WKK);
    unroll2!(mt in 0..2 => {
        unroll2!(r in 0..2 => {
            let key = key0 + 16 * mt + 8 * r;
            if key < seq_kv {
                let row = k_row0 + key as u64;
                let ka = bp.dk + 2 * bp.dk_strides.offset(b, row, hk);
                let va = bp.dv + 2 * bp.dv_strides.offset(b, row, hk);
                unroll8!(n in 0..NKD => {
                    let col = (first + 8 * n + 2 * t) as u64;
                    if ((first + 8 * n) as u32) < bp.attn.head_dim {
                        unsafe {
                            st_u32(ka + 2 * col, E::pack(dk[mt][n][2 * r], dk[mt][n][2 * r + 1]));
                            st_u32(va + 2 * col, E::pack(dv[mt][n][2 * r], dv[mt][n][2 * r + 1]));
                        }
                    }
                });
            }
        });
    });
}
