//! Fused runs of `ld.shared.b32` + `fma.rn.f32` pairs: the inner loops of the f32 kernels (a
//! third of their instructions are such loads, a third the `fma`s that consume them) run as one
//! step of the dispatch loop instead of two per pair.
//!
//! A run is a sequence of unguarded pairs
//!
//! ```text
//! ld.shared.b32  x_i, [a + off_i];
//! fma.rn.f32     d_i, p_i, q_i, r_i;
//! ```
//!
//! with one base register `a` that no instruction of the run writes and offsets that agree
//! modulo 4 ([`runs`] finds them when the program is decoded). The executor takes a run in one
//! step only when the result cannot differ from running its instructions one by one: the warp
//! is converged (all 32 lanes), no trace, bank-conflict count or `wgmma` bookkeeping is on, the
//! CPU has AVX-512F, every byte of the shared window has been written (so initcheck has nothing
//! to say), every lane's every address of the run lies in the window and is aligned, and
//! racecheck can queue the reads without looking at other warps' stamps (no other warp has stored
//! in the barrier interval; the words of each load are evenly spaced). Otherwise it declines
//! before touching anything, and the instructions run one by one as always, reporting whatever
//! they report. The same read stamps are queued in the same order, and the counters (thread and
//! warp instructions, the warp's issue count for the budget and the time limit) advance as they
//! would.

use crate::ir::{Inst, Op, Slot, Space, NONE};
use crate::memcheck::SharedMem;

/// Pairs in one fused step at most (bounds the work between two budget checks).
const MAX_PAIRS: u16 = 1024;

/// Per instruction index: the number of fusable pairs in the run that starts there (0: none).
pub(crate) fn runs(insts: &[Inst]) -> Vec<u16> {
    let mut out = vec![0u16; insts.len()];
    // (base, offset, loaded register, fma's destination) of the pair at `pc`.
    let pair = |pc: usize| -> Option<(Slot, i64, Slot, Slot)> {
        let (ld, fma) = (insts.get(pc)?, insts.get(pc + 1)?);
        if ld.guard != NONE || fma.guard != NONE {
            return None;
        }
        match (&ld.op, &fma.op) {
            (Op::Ld { sp: Space::Shared, size: 4, n: 1, sext: false, ds, a, off, .. }, Op::FmaF32 { d, .. })
                if ds[0] != *a && *d != *a =>
            {
                Some((*a, *off, ds[0], *d))
            }
            _ => None,
        }
    };
    for pc in (0..insts.len()).rev() {
        let Some((a, off, _, _)) = pair(pc) else { continue };
        let mut n = 1u16;
        if let Some((a2, off2, _, _)) = pair(pc + 2) {
            if a2 == a && (off2 - off) % 4 == 0 && out[pc + 2] < MAX_PAIRS {
                n += out[pc + 2];
            }
        }
        out[pc] = n;
    }
    out
}

/// Runs `n` pairs starting at `pc` as one step if nothing can differ from running them one by
/// one (see the module's text); returns false, having changed nothing, otherwise. The caller
/// checked the warp (converged, no trace or other per-instruction bookkeeping), the counters'
/// limits and `crate::exec::avx512()`.
#[inline(never)]
pub(crate) fn run(r: &mut [[u64; 32]], shared: &mut SharedMem, insts: &[Inst], pc: u32, n: usize) -> bool {
    if !shared.all_written() {
        return false;
    }
    let pairs = &insts[pc as usize..pc as usize + 2 * n];
    let Op::Ld { a, off: off0, .. } = pairs[0].op else { return false };
    let (mut lo, mut hi) = (off0, off0);
    for p in pairs.iter().step_by(2) {
        if let Op::Ld { off, .. } = p.op {
            lo = lo.min(off);
            hi = hi.max(off);
        }
    }
    // Every lane: `a + off0` aligned, `a + lo >= 0`, `a + hi + 4 <= window` (no wrapping).
    let window = shared.bytes.len() as i128;
    let av = &r[a as usize];
    let mut idx = [0i32; 32];
    for l in 0..32 {
        let base = av[l] as i128;
        if base > i32::MAX as i128
            || (base + off0 as i128) % 4 != 0
            || base + (lo as i128) < 0
            || base + hi as i128 + 4 > window
        {
            return false;
        }
        idx[l] = base as i32;
    }
    let words0: [u32; 32] = std::array::from_fn(|l| ((av[l] as i64 + off0) / 4) as u32);
    if shared.racecheck_on()
        && !shared.race.queue_read_run(
            &words0,
            pairs.iter().step_by(2).enumerate().map(|(i, p)| {
                let Op::Ld { off, .. } = p.op else { unreachable!("a run's loads") };
                (pc + 2 * i as u32, ((off - off0) / 4) as u32)
            }),
        )
    {
        return false;
    }
    let bytes = shared.bytes.as_ptr();
    // How the lanes' words lie, the same for every pair of the run (one base register): one
    // word for all (a broadcast), consecutive words (one row of 128 bytes), or anything else
    // (a gather).
    let step = idx[1].wrapping_sub(idx[0]);
    let even = (0..32).all(|l| idx[l] == idx[0].wrapping_add(step.wrapping_mul(l as i32)));
    // SAFETY: every lane's 4 bytes at `idx + off` lie in the window for every pair (checked
    // above), so do the 128 consecutive bytes of 32 consecutive words; the caller checked
    // AVX-512F; the slots index the register file (decoded program).
    #[cfg(target_arch = "x86_64")]
    unsafe {
        match (even, step) {
            (true, 0) => pairs_avx512::<BROADCAST>(bytes, &idx, r, pairs),
            (true, 4) => pairs_avx512::<ROW>(bytes, &idx, r, pairs),
            _ => pairs_avx512::<GATHER>(bytes, &idx, r, pairs),
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (bytes, even, step);
        unreachable!("avx512() is false");
    }
    shared.race.pc = pc + 2 * n as u32 - 1;
    true
}

/// How [`pair_avx512`] loads the lanes' words.
const GATHER: u8 = 0;
/// Every lane the same word.
const BROADCAST: u8 = 1;
/// Lane `l` the word after lane `l - 1`'s.
const ROW: u8 = 2;

/// The pairs of a run (checked by [`run`]) one after the other, `LOAD` saying how the lanes'
/// words lie.
///
/// # Safety
/// As [`pair_avx512`] for every pair's offset.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pairs_avx512<const LOAD: u8>(bytes: *const u8, idx: &[i32; 32], r: &mut [[u64; 32]], pairs: &[Inst]) {
    for p in pairs.chunks_exact(2) {
        let (Op::Ld { ds, off, .. }, Op::FmaF32 { d, a: x, b: y, c: z }) = (p[0].op, p[1].op) else {
            unreachable!("a run's pairs")
        };
        // SAFETY: the caller's.
        unsafe { pair_avx512::<LOAD>(bytes.wrapping_offset(off as isize), idx, r, ds[0], d, [x, y, z]) };
    }
}

/// One pair for all 32 lanes: `r[ld] = zext(bytes[idx[l]..][..4])`, then
/// `r[d] = fma(r[s0], r[s1], r[s2])` on the low 32 bits, zero-extended. With `LOAD` =
/// [`BROADCAST`] every `idx[l]` is `idx[0]`, with [`ROW`] `idx[l]` is `idx[0] + 4 l`.
///
/// # Safety
/// Every `base + idx[l] .. + 4` is readable; the slots are inside `r`; the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn pair_avx512<const LOAD: u8>(
    base: *const u8,
    idx: &[i32; 32],
    r: &mut [[u64; 32]],
    ld: Slot,
    d: Slot,
    s: [Slot; 3],
) {
    use std::arch::x86_64::*;
    let rp = r.as_mut_ptr();
    // SAFETY: the caller's bounds (every lane's word is readable, slots inside `r`).
    unsafe {
        let g = match LOAD {
            BROADCAST => {
                let w = _mm512_set1_epi32(base.add(idx[0] as usize).cast::<i32>().read_unaligned());
                [w, w]
            }
            ROW => {
                let p = base.add(idx[0] as usize);
                [_mm512_loadu_si512(p.cast()), _mm512_loadu_si512(p.add(64).cast())]
            }
            _ => [
                _mm512_i32gather_epi32::<1>(_mm512_loadu_si512(idx.as_ptr().cast()), base.cast()),
                _mm512_i32gather_epi32::<1>(_mm512_loadu_si512(idx.as_ptr().add(16).cast()), base.cast()),
            ],
        };
        let lp = rp.add(ld as usize).cast::<u64>();
        for (h, gv) in g.iter().enumerate() {
            _mm512_storeu_si512(lp.add(16 * h).cast(), _mm512_cvtepu32_epi64(_mm512_castsi512_si256(*gv)));
            _mm512_storeu_si512(lp.add(16 * h + 8).cast(), _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64::<1>(*gv)));
        }
        // (A macro, not a closure: the compiler may leave a closure out of line, without the
        // function's target features.)
        macro_rules! load {
            ($slot:expr, $h:expr) => {{
                let (slot, h): (Slot, usize) = ($slot, $h);
                if slot == ld {
                    _mm512_castsi512_ps(g[h])
                } else {
                    let p = rp.add(slot as usize).cast::<u64>().add(16 * h);
                    let lo = _mm512_cvtepi64_epi32(_mm512_loadu_si512(p.cast()));
                    let hi = _mm512_cvtepi64_epi32(_mm512_loadu_si512(p.add(8).cast()));
                    _mm512_castsi512_ps(_mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi))
                }
            }};
        }
        // Both halves' sources are read before `d` is written (it may be a source).
        let v = [
            _mm512_castps_si512(_mm512_fmadd_ps(load!(s[0], 0), load!(s[1], 0), load!(s[2], 0))),
            _mm512_castps_si512(_mm512_fmadd_ps(load!(s[0], 1), load!(s[1], 1), load!(s[2], 1))),
        ];
        let dp = rp.add(d as usize).cast::<u64>();
        for (h, vv) in v.iter().enumerate() {
            _mm512_storeu_si512(dp.add(16 * h).cast(), _mm512_cvtepu32_epi64(_mm512_castsi512_si256(*vv)));
            _mm512_storeu_si512(dp.add(16 * h + 8).cast(), _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64::<1>(*vv)));
        }
    }
}
