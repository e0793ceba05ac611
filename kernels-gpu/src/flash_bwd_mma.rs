//! `flash_bwd_{bf16,f16}_d{32,64,128}`: the backward of fused attention on tensor cores
//! (`mma.sync` m16n8k16), 16-bit Q, K, V, O, dO and gradients, f32 accumulation (FlashAttention-2's
//! backward, Dao 2023, Algorithm 2).
//!
//! It is the main kernel of the three the backward launches; the preprocess (`D = rowsum(dO ∘
//! O)`, the dQ accumulator zeroed) and the convert (dQ accumulator, or the deterministic mode's
//! slices summed in key order, to the 16-bit dQ; the sinks' gradient) are
//! [`crate::flash_bwd_f32`]'s, instantiated for bf16 and f16.
//!
//! Algorithm: a block of `W` warps owns `BC = 16 W / S` keys of one K/V head (`S` the tile's
//! `kv_splits`); the `S` warps of row group `kw` own keys `16kw..16kw + 16`, and warp part `hw`
//! of them keeps columns `D hw / S..D (hw + 1) / S` of their dK and dV (f32 accumulator
//! fragments) in registers (`S = 2` at d128, where one warp's `16 x 128` dK and dV spilled; both
//! warps of a group then compute its Sᵀ and dPᵀ). K and V are staged once. For every query head that reads the K/V head (GQA: the
//! group's gradients are summed in those registers, no atomics on dK/dV) and every query tile
//! of `BR` rows that meets the block's keys, Q, dO, LSE (log2 domain) and D are staged, then each
//! warp, for its 16 keys:
//! 1. `Sᵀ = K Qᵀ` and `dPᵀ = V dOᵀ` (16 x `BR`, f32): A = the warp's K or V rows, B = Q or dO
//!    rows, exactly the operand shapes of the forward's `S = Q Kᵀ`;
//! 2. `P = 2^(s·log2 e − LSE·log2 e)` per element (no `N x N` buffer: P comes back from the
//!    saved LSE; keys a row may not see, [`crate::mask::key_range`], give 0), and
//!    `dS = P ∘ (dP − D) · ds/dx` (`ds/dx` = the scale, with a soft cap `scale · (1 − tanh²)`);
//! 3. `dV += Pᵀ dO`, `dK += dSᵀ Q`: the accumulator layout of `Sᵀ` is the A-operand layout of the
//!    next `mma` ([`crate::frag::pack_a`]), so P and dS go from registers to tensor cores in 16
//!    bits (as FlashAttention-2 rounds them), B = dO or Q through `ldmatrix.trans`;
//! 4. dSᵀ to shared memory (16 bits), a barrier, then `dQ += dS K` split over the warps (16 query
//!    rows times `NDQ` 8-column tiles each: [`crate::tiles::FlashBwdMmaTile::dq_parts`]); A = dS
//!    read transposed from dSᵀ by `ldmatrix.trans`, B = K through `ldmatrix.trans`. Atomic mode:
//!    each element added to the f32 accumulator with `red.global.add.f32`; deterministic mode:
//!    stored into key block `x`'s own slice.
//!
//! Finally dK and dV are rounded to 16 bits and stored (keys past `seq_kv` store nothing).
//!
//! Masking: a (key tile, query tile) pair is skipped when no row of the tile sees a key of the
//! block; masked element by element only when some row does not see every key of the block (the
//! tile meets a window edge, the causal diagonal or `seq_kv`); otherwise nothing is masked.
//! Query rows past `seq_q` are zero-filled with LSE `+inf`, so their P is exactly 0. Every lane
//! reaches every barrier, `ldmatrix` and `mma`.
//!
//! Shapes: Q, O, dO, dQ `[batch, seq_q, heads, D]`, K, V, dK, dV `[batch, seq_kv, heads_kv, D]`
//! (2-byte elements, strided, [`crate::abi::Strides`]); LSE, D `[batch, heads, seq_q]` f32; the
//! dQ accumulator f32 (`[dq_splits][.. q's shape ..]`, [`crate::abi::BwdParams`]). Varlen: per
//! sequence (`device::sequence_of`, as the forward).
//!
//! Tiles ([`crate::tiles::FLASH_BWD_MMA_D32`], [`crate::tiles::FLASH_BWD_MMA_D64`],
//! [`crate::tiles::FLASH_BWD_MMA_D128`]): Bc 64; 4 warps at d32 and d64, 8 (2 per row group)
//! at d128; Br 64 at d32, 32 at d64 and d128.
//! Shared memory (swizzled like the forward's, [`crate::swizzle`]): K, V `[BC][D]`, Q, dO
//! `[BR][D]`, dSᵀ `[BC][BR]`, 16-bit; LSE, D `[BR]` f32.
//!
//! Thread mapping: grid `(ceil(seq_kv / BC), heads_kv, batch)`, `THREADS = 32 W`. In every
//! fragment lane `l` (group `g = l / 4`, `t = l % 4`) holds rows `g`, `g + 8` (keys of the warp
//! in `Sᵀ`, dK, dV; query rows in dQ) and columns `2t, 2t + 1` of each 8-column tile.
//!
//! # Safety
//! All pointers in the parameters must be valid for their shapes and strides; Q, K, V and dO rows
//! 16-byte aligned (base pointers 16-byte aligned, strides multiples of 8 elements), dK and dV
//! rows 4-byte aligned; the dQ accumulator and D private to the call; `seq_kv < 2^31`; launched
//! after the preprocess and before the convert, with the variant's launch geometry and dynamic
//! shared memory, on sm_80 or newer.

#[cfg(target_arch = "nvptx64")]
use crate::abi::BwdParams;
#[cfg(target_arch = "nvptx64")]
use crate::device::*;
#[cfg(target_arch = "nvptx64")]
use crate::staging::{stage_tile, Rows, SmemChunk};
#[cfg(target_arch = "nvptx64")]
use crate::frag::{ldsm_a_lane, ldsm_b_lane, ldsm_bt_lane, pack_a};
#[cfg(target_arch = "nvptx64")]
use crate::mma::*;
#[cfg(target_arch = "nvptx64")]
use crate::softmax::{tanh, LOG2E};
#[cfg(target_arch = "nvptx64")]
use crate::swizzle::{swizzled_offset, TileLane};

/// `ld.shared.v2.f32 {lo, hi}, [addr];` (8-byte aligned).
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
unsafe fn ld_shared_f32x2(addr: u32) -> [f32; 2] {
    let (lo, hi): (f32, f32);
    unsafe {
        core::arch::asm!("ld.shared.v2.f32 {{{lo}, {hi}}}, [{a}];", lo = out(reg32) lo, hi = out(reg32) hi,
                         a = in(reg32) addr, options(readonly, nostack))
    };
    [lo, hi]
}

/// `st.shared.f32 [addr], x;`
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
unsafe fn st_shared_f32(addr: u32, x: f32) {
    unsafe { core::arch::asm!("st.shared.f32 [{a}], {x};", a = in(reg32) addr, x = in(reg32) x, options(nostack)) };
}

/// The generic body, instantiated by the rows of [`crate::variants`] with their tile's
/// constants: `KD = D / 16` k-steps of `Sᵀ`, `ND = D / 8` column tiles of dK and dV, `NQ = BR /
/// 8` (query) column tiles of `Sᵀ`, `NDQ` column tiles of dQ per warp. The soft cap is a separate
/// instantiation, so the common loop has no tanh.
///
/// # Safety
/// As the module's safety section.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub(crate) unsafe fn flash_bwd<
    E: Half16,
    const D: usize,
    const BR: usize,
    const BC: usize,
    const THREADS: usize,
    const KD: usize,
    const ND: usize,
    const NQ: usize,
    const NDQ: usize,
    const NDH: usize,
>(
    bp: &BwdParams,
) {
    if bp.attn.softcap > 0.0 {
        unsafe { body::<E, D, BR, BC, THREADS, KD, ND, NQ, NDQ, NDH, true>(bp) }
    } else {
        unsafe { body::<E, D, BR, BC, THREADS, KD, ND, NQ, NDQ, NDH, false>(bp) }
    }
}

#[cfg(target_arch = "nvptx64")]
#[inline(always)]
unsafe fn body<
    E: Half16,
    const D: usize,
    const BR: usize,
    const BC: usize,
    const THREADS: usize,
    const KD: usize,
    const ND: usize,
    const NQ: usize,
    const NDQ: usize,
    const NDH: usize,
    const SOFTCAP: bool,
>(
    bp: &BwdParams,
) {
    const {
        assert!(KD == D / 16 && ND == D / 8 && NQ == BR / 8 && ND % NDH == 0);
        assert!(BC * (ND / NDH) == 16 * (THREADS / 32), "16 keys per group of ND / NDH warps");
        assert!((THREADS / 32) % (BR / 16) == 0 && NDQ * ((THREADS / 32) / (BR / 16)) == ND);
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
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t) = (lane / 4, lane % 4);

    // Shared memory: K, V, Q, dO, dSᵀ (16-bit, swizzled), then LSE and D (f32).
    let smem = core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<SmemChunk>();
    let k_s = smem_addr(smem);
    let v_s = k_s + (BC * D * 2) as u32;
    let q_s = v_s + (BC * D * 2) as u32;
    let do_s = q_s + (BR * D * 2) as u32;
    let ds_s = do_s + (BR * D * 2) as u32;
    let lse_s = ds_s + (BC * BR * 2) as u32;
    let dd_s = lse_s + (BR * 4) as u32;

    let slice = |ptr: u64, s: &crate::abi::Strides, head: u64, row0: u64, len: u32| Rows {
        base: global_addr(ptr) + 2 * (b * s.batch + head * s.head + row0 * s.seq),
        stride: 2 * s.seq,
        len: len as usize,
        cols: p.head_dim,
    };
    unsafe {
        stage_tile::<D, BC, THREADS>(k_s, slice(p.k, &p.k_strides, hk, k_row0, p.seq_kv), kv0, tid);
        stage_tile::<D, BC, THREADS>(v_s, slice(p.v, &p.v_strides, hk, k_row0, p.seq_kv), kv0, tid);
    }
    cp_async_commit(); // waited for with the first query tile

    // s = scale · x (x = q·k), or with a soft cap s = c · tanh(scale · x / c); ds/dx is `scale`
    // or `scale · (1 - tanh²)`. P = 2^(s · log2 e - LSE · log2 e).
    let scale = p.softmax_scale;
    let c2 = scale * LOG2E;
    let cap_arg = if SOFTCAP { scale / p.softcap } else { 0.0 };
    let cap2 = p.softcap * LOG2E;
    let kv_end = core::cmp::min(kv0 + BC, seq_kv);

    // dQ: warp w computes query rows 16 mq.. of the tile, column tiles NDQ pd.. (a part starts
    // on a swizzle group when there are several, `FlashBwdMmaTile::check`).
    let mq = warp % (BR / 16);
    let pd = if NDQ == ND { 0 } else { warp / (BR / 16) };
    // This warp's 16 keys (row group kw) and its part hw of their dK, dV columns (column tiles
    // NDH hw..); with one part per group, kw is the warp.
    let (kw, hw) = (warp % (BC / 16), warp / (BC / 16));
    // This lane's keys: rows g and g + 8 of the warp's group.
    let key0 = kv0 + 16 * kw + g;

    let mut dk = [[0.0f32; 4]; NDH];
    let mut dv = [[0.0f32; 4]; NDH];
    let mut h = hk * group;
    while h < (hk + 1) * group {
        let mut q0 = 0usize;
        while q0 < seq_q {
            // Query tiles whose rows see none of the block's keys are skipped (uniform); a tile
            // whose every row sees every key of the block (all of them < seq_kv) is not masked.
            let last = core::cmp::min(q0 + BR, seq_q) - 1;
            let (first_start, first_end) = p.key_range(q0 as u32);
            let (last_start, last_end) = p.key_range(last as u32);
            if last_end <= kv0 as i64 || first_start >= kv_end as i64 {
                q0 += BR;
                continue;
            }
            let full = last_start <= kv0 as i64 && first_end >= (kv0 + BC) as i64;
            let nrows = last + 1 - q0;
            // The tile's first row through an opaque move: the addresses below are computed
            // from it in every tile, not carried from tile to tile (as induction variables, one
            // 64-bit register pair per copy pass and per dQ row, they would fill the registers).
            let qa = opaque_u32(q0 as u32) as usize;

            // Every warp is done with the previous tile's Q, dO, dSᵀ, LSE and D.
            sync_threads();
            // The head's rows from an opaque copy of h: formed per tile, not held through the loop.
            let ho = opaque_u64(h);
            let q_rows = slice(p.q, &p.q_strides, ho, q_row0, p.seq_q);
            let do_rows = slice(bp.d_o, &bp.d_o_strides, ho, q_row0, p.seq_q);
            unsafe {
                stage_tile::<D, BR, THREADS>(q_s, q_rows, qa, tid);
                stage_tile::<D, BR, THREADS>(do_s, do_rows, qa, tid);
            }
            cp_async_commit();
            if tid < BR {
                let (l, dd) = if tid < nrows {
                    let at = p.lse_offset(b, h, q_row0 + (qa + tid) as u64);
                    unsafe { (ld_f32(p.lse + 4 * at) * LOG2E, ld_f32(bp.delta + 4 * at)) }
                } else {
                    (f32::INFINITY, 0.0) // rows past seq_q: P = 2^(s - inf) = 0
                };
                unsafe {
                    st_shared_f32(opaque_u32(lse_s) + 4 * tid as u32, l);
                    st_shared_f32(opaque_u32(dd_s) + 4 * tid as u32, dd);
                }
            }
            cp_async_wait_all();
            sync_threads();

            // Lane addresses, formed from opaque tile bases in every tile (so the swizzle's
            // variants are not held in registers through the loop). A operands of the warp's
            // 16 keys (K, V rows); B operands of Qᵀ, dOᵀ (Q, dO rows, as the forward's K); B
            // operands of dO, Q, K through `.trans` (as the forward's V); the A operand of dS
            // read transposed from dSᵀ (its rows are keys, as a B operand's of K).
            let (a_r, a_c) = ldsm_a_lane(lane);
            let k_a = TileLane::<D>::new(opaque_u32(k_s), 16 * kw + a_r, a_c);
            let v_a = TileLane::<D>::new(opaque_u32(v_s), 16 * kw + a_r, a_c);
            let (b_r, b_c) = ldsm_b_lane(lane);
            let q_b = TileLane::<D>::new(opaque_u32(q_s), b_r, b_c);
            let do_b = TileLane::<D>::new(opaque_u32(do_s), b_r, b_c);

            // (1) Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for the warp's 16 keys.
            let mut s = [[0.0f32; 4]; NQ];
            let mut dp = [[0.0f32; 4]; NQ];
            unroll!(kk in 0..KD => {
                let ka = unsafe { ldmatrix_x4(k_a.at(0, kk)) };
                let va = unsafe { ldmatrix_x4(v_a.at(0, kk)) };
                unroll4!(np in 0..NQ / 2 => {
                    let r = unsafe { ldmatrix_x4(q_b.at(16 * np, kk)) };
                    E::mma(&mut s[2 * np], &ka, r[0], r[1]);
                    E::mma(&mut s[2 * np + 1], &ka, r[2], r[3]);
                    let r = unsafe { ldmatrix_x4(do_b.at(16 * np, kk)) };
                    E::mma(&mut dp[2 * np], &va, r[0], r[1]);
                    E::mma(&mut dp[2 * np + 1], &va, r[2], r[3]);
                });
            });

            // (2) P and dS for every element, then (in the few tiles that need it) 0 for the
            // keys a row may not see: element e of tile n is key key0 + 8 (e / 2), query column
            // 8n + 2t + e % 2 of the tile, whose offset from the row's diagonal is
            // `off0 + 8 (e / 2) - 8n - e % 2`. (A row that sees no key has LSE = -inf and an
            // infinite P here; the mask replaces it, a select, so nothing of it survives.)
            let (lse_l, dd_l) = (opaque_u32(lse_s) + 8 * t as u32, opaque_u32(dd_s) + 8 * t as u32);
            unroll8!(n in 0..NQ => {
                let lse2 = unsafe { ld_shared_f32x2(lse_l + 32 * n as u32) };
                let dd2 = unsafe { ld_shared_f32x2(dd_l + 32 * n as u32) };
                unroll4!(e in 0..4 => {
                    let x = s[n][e];
                    let (sv, dsdx) = if SOFTCAP {
                        let th = tanh(x * cap_arg);
                        (th * cap2, scale * (1.0 - th * th))
                    } else {
                        (x * c2, scale)
                    };
                    let pr = exp2(sv - lse2[e % 2]);
                    s[n][e] = pr;
                    dp[n][e] = pr * (dp[n][e] - dd2[e % 2]) * dsdx;
                });
            });
            if !full {
                // The mask as offsets from the diagonal: key j is seen by query row i iff
                // j < seq_kv and -left <= j - (i + seq_kv - seq_q) <= right (right 0 when causal;
                // an unbounded side never binds), the rule of `mask::key_range` in one
                // subtraction and two compares per element. Formed here from opaque copies, so
                // none of it is held in registers through the loop.
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
                let key0 = opaque_u32(key0 as u32) as i64;
                let off0 = key0 - (qa + 2 * t) as i64 - (skv - sq);
                let keys_left = skv - key0; // rows r with 8r < keys_left exist
                unroll8!(n in 0..NQ => {
                    unroll4!(e in 0..4 => {
                        let r = e / 2;
                        let off = off0 + (8 * r) as i64 - (8 * n + e % 2) as i64;
                        if !(off >= lo && off <= hi && ((8 * r) as i64) < keys_left) {
                            s[n][e] = 0.0;
                            dp[n][e] = 0.0;
                        }
                    });
                });
            }

            // (3) P and dS packed to 16 bits as A operands (16-query k-steps kc: S tiles 2kc,
            // 2kc + 1); dSᵀ to shared memory from the packed words: word 2 (n % 2) + r of step
            // n / 2 is the pair of query columns 8n + 2t, 8n + 2t + 1 of the warp's key row
            // g + 8r, one 32-bit word of chunk n of that row.
            let pf = pack_a(&s, E::pack);
            let dsf = pack_a(&dp, E::pack);
            // Chunk n of a row is chunk 0's position XOR 16n (the swizzle XORs the chunk bits;
            // the tile is 128-byte aligned), so each row takes one address register. One warp of
            // each row group stores it (the other computed the same values).
            if hw == 0 {
                unroll2!(r in 0..2 => {
                    let row = 16 * kw + g + 8 * r;
                    let at0 = opaque_u32(ds_s + (swizzled_offset(BR, row, 0) + 4 * t) as u32);
                    unroll8!(n in 0..NQ => {
                        unsafe { st_shared_u32(at0 ^ (16 * n) as u32, dsf[n / 2][2 * (n % 2) + r]) };
                    });
                });
            }

            // (4) dV += Pᵀ dO, dK += dSᵀ Q, dO and Q as B operands through `.trans`.
            let (bt_r, bt_c) = ldsm_bt_lane(lane);
            let q_bt = TileLane::<D>::new(opaque_u32(q_s), bt_r, bt_c + NDH * hw);
            let do_bt = TileLane::<D>::new(opaque_u32(do_s), bt_r, bt_c + NDH * hw);
            unroll4!(kc in 0..NQ / 2 => {
                unroll8!(np in 0..NDH / 2 => {
                    let r = unsafe { ldmatrix_x4_trans(do_bt.at(16 * kc, np)) };
                    E::mma(&mut dv[2 * np], &pf[kc], r[0], r[1]);
                    E::mma(&mut dv[2 * np + 1], &pf[kc], r[2], r[3]);
                    let r = unsafe { ldmatrix_x4_trans(q_bt.at(16 * kc, np)) };
                    E::mma(&mut dk[2 * np], &dsf[kc], r[0], r[1]);
                    E::mma(&mut dk[2 * np + 1], &dsf[kc], r[2], r[3]);
                });
            });

            sync_threads(); // dSᵀ of every warp is stored

            // (5) dQ += dS K for query rows 16 mq.. and the warp's NDQ column tiles.
            let (b_r, b_c) = ldsm_b_lane(lane);
            let ds_a = TileLane::<BR>::new(opaque_u32(ds_s), b_r, b_c + 2 * mq);
            let k_bt = TileLane::<D>::new(opaque_u32(k_s), bt_r, bt_c + NDQ * pd);
            let mut acc = [[0.0f32; 4]; NDQ];
            unroll4!(kc in 0..BC / 16 => {
                let a = unsafe { ldmatrix_x4_trans(ds_a.at(16 * kc, 0)) };
                unroll8!(j in 0..NDQ / 2 => {
                    let r = unsafe { ldmatrix_x4_trans(k_bt.at(16 * kc, j)) };
                    E::mma(&mut acc[2 * j], &a, r[0], r[1]);
                    E::mma(&mut acc[2 * j + 1], &a, r[2], r[3]);
                });
            });
            unroll2!(r in 0..2 => {
                let qr = 16 * mq + g + 8 * r;
                if qr < nrows {
                    let row = q_row0 + (qa + qr) as u64;
                    // One address per row; the columns 8 (NDQ pd + n) + 2t (+ 1) are immediates.
                    let first = (8 * NDQ * pd + 2 * t) as u64;
                    // Atomic mode: the one accumulator; deterministic: key block x's own slice
                    // (x read again, not held through the loop).
                    let slice0 = bp.dq_accum + 4 * ctaid_x_fresh() as u64 * bp.dq_split_stride;
                    let base = opaque_u64(slice0 + 4 * (bp.dq_accum_strides.offset(b, row, h) + first));
                    // Columns past a head dim below D are not stored.
                    unroll8!(n in 0..NDQ => {
                        let at = base + 32 * n as u64;
                        if ((8 * NDQ * pd + 8 * n) as u32) >= bp.attn.head_dim {
                        } else if bp.dq_split_stride == 0 {
                            unsafe {
                                red_add_f32(at, acc[n][2 * r]);
                                red_add_f32(at + 4, acc[n][2 * r + 1]);
                            }
                        } else {
                            // The block's own slice: written once.
                            unsafe {
                                st_f32(at, acc[n][2 * r]);
                                st_f32(at + 4, acc[n][2 * r + 1]);
                            }
                        }
                    });
                }
            });
            q0 += BR;
        }
        h += 1;
    }

    // dK and dV of the warp's keys, summed over the group's query heads, in 16 bits.
    // The block's sequence, K/V head and keys are read again (fresh special-register reads) rather
    // than kept in registers through the loops.
    cp_async_wait_all(); // K and V, when no query tile met the block
    let seq = unsafe { sequence_of(&bp.attn, ctaid_z_fresh()) };
    let (b, k_row0, seq_kv) = (seq.b, seq.k0, seq.p.seq_kv as usize);
    let hk = ctaid_y_fresh() as u64;
    let lane = tid_x_fresh() as usize % 32;
    let t = lane % 4;
    let warp = tid_x_fresh() as usize / 32;
    let key0 = ctaid_x_fresh() as usize * BC + 16 * (warp % (BC / 16)) + lane / 4;
    let first = 8 * NDH * (warp / (BC / 16));
    unroll2!(r in 0..2 => {
        let key = key0 + 8 * r;
        if key < seq_kv {
            let row = k_row0 + key as u64;
            let ka = bp.dk + 2 * bp.dk_strides.offset(b, row, hk);
            let va = bp.dv + 2 * bp.dv_strides.offset(b, row, hk);
            unroll!(n in 0..NDH => {
                let col = (first + 8 * n + 2 * t) as u64;
                if ((first + 8 * n) as u32) < bp.attn.head_dim {
                    unsafe {
                        st_u32(ka + 2 * col, E::pack(dk[n][2 * r], dk[n][2 * r + 1]));
                        st_u32(va + 2 * col, E::pack(dv[n][2 * r], dv[n][2 * r + 1]));
                    }
                }
            });
        }
    });
}
