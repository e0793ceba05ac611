//! Shared-memory bank conflicts: how many wavefronts a warp's shared-memory access takes.
//!
//! Shared memory has 32 banks of 4-byte words; word `w` is in bank `w % 32`. A warp's access is
//! served in phases: all 32 lanes for accesses of up to 4 bytes, half-warps for 8 bytes,
//! quarter-warps for 16 bytes, and one 8-lane phase per matrix for `ldmatrix` (each lane names a
//! 16-byte row). A phase takes as many wavefronts as the largest number of *distinct* words any
//! one bank is asked for (lanes reading the same word share it: a broadcast). The minimum is one
//! wavefront per phase that has an active lane; everything above it is a bank conflict.

use crate::ir::{Op, Space};
use crate::memory::{SHARED_WINDOW, WINDOW_SIZE};

/// Per instruction: warp-wide executions, wavefronts, and the minimum wavefronts.
pub(crate) type Count = [u64; 3];

/// The shared-memory offset of a lane's address in `sp`, or `None` when it is not shared memory.
#[inline]
fn shared_offset(sp: Space, addr: u64) -> Option<u64> {
    match sp {
        Space::Shared => Some(addr),
        Space::Generic if (SHARED_WINDOW..SHARED_WINDOW + WINDOW_SIZE).contains(&addr) => Some(addr - SHARED_WINDOW),
        _ => None,
    }
}

/// Wavefronts of one phase: `lanes` give (offset, width) of each active lane's access.
fn phase(accesses: &[(u64, u64)]) -> u64 {
    let mut words = [0u64; 128];
    let mut n = 0;
    for &(a, width) in accesses {
        let (first, last) = (a / 4, (a + width.max(1) - 1) / 4);
        for w in first..=last {
            if n < words.len() {
                words[n] = w;
                n += 1;
            }
        }
    }
    let words = &mut words[..n];
    words.sort_unstable();
    let mut per_bank = [0u64; 32];
    let mut prev = None;
    for &w in words.iter() {
        if prev != Some(w) {
            per_bank[(w % 32) as usize] += 1;
            prev = Some(w);
        }
    }
    per_bank.iter().copied().max().unwrap_or(0)
}

/// Wavefronts and minimum of a warp's shared access with per-lane `width` bytes.
fn access(exec: u32, width: u64, addr: impl Fn(usize) -> Option<u64>) -> Option<(u64, u64)> {
    let per_phase = if width <= 4 {
        32
    } else if width <= 8 {
        16
    } else {
        8
    };
    phases(32 / per_phase, per_phase, |l| if exec >> l & 1 == 1 { addr(l).map(|a| (a, width)) } else { None })
}

/// Wavefronts and minimum over `n` phases of `per_phase` consecutive lanes; `lane(l)` is lane
/// `l`'s (offset, width), `None` when it does not access shared memory. No allocation: this runs
/// on every shared access while counting is on.
fn phases(n: usize, per_phase: usize, lane: impl Fn(usize) -> Option<(u64, u64)>) -> Option<(u64, u64)> {
    let (mut waves, mut ideal) = (0, 0);
    let mut buf = [(0u64, 0u64); 32];
    for p in 0..n {
        let mut k = 0;
        for l in p * per_phase..(p + 1) * per_phase {
            if let Some(x) = lane(l) {
                buf[k] = x;
                k += 1;
            }
        }
        if k > 0 {
            waves += phase(&buf[..k]);
            ideal += 1;
        }
    }
    (ideal > 0).then_some((waves, ideal))
}

/// The wavefronts of `op` when it is a shared-memory `ld`, `st` or `ldmatrix` (generic
/// addresses count when they fall in the shared window), as (wavefronts, minimum).
pub(crate) fn of_op(op: &Op, r: &[[u64; 32]], exec: u32) -> Option<(u64, u64)> {
    match *op {
        Op::Ld { sp, size, n, a, off, .. } | Op::St { sp, size, n, a, off, .. }
            if matches!(sp, Space::Shared | Space::Generic) =>
        {
            let av = &r[a as usize];
            access(exec, size as u64 * n as u64, |l| shared_offset(sp, av[l].wrapping_add(off as u64)))
        }
        Op::Ldmatrix { num, sp, a, off, .. } => {
            // One phase per matrix: lanes 8m..8m+7 name its 8 rows of 16 bytes.
            let av = &r[a as usize];
            phases(num as usize, 8, |l| shared_offset(sp, av[l].wrapping_add(off as i64 as u64)).map(|a| (a, 16)))
        }
        _ => None,
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    pub fn consecutive_words_are_one_wavefront_and_a_stride_of_32_words_is_32() {
        assert_eq!(access(u32::MAX, 4, |l| Some(4 * l as u64)), Some((1, 1)));
        assert_eq!(access(u32::MAX, 4, |l| Some(128 * l as u64)), Some((32, 1)));
        // Every lane reading the same word: a broadcast.
        assert_eq!(access(u32::MAX, 4, |_| Some(64)), Some((1, 1)));
        // Stride 2 words: two lanes per bank, 2 wavefronts.
        assert_eq!(access(u32::MAX, 4, |l| Some(8 * l as u64)), Some((2, 1)));
    }

    pub fn wide_accesses_go_in_half_and_quarter_warps() {
        // 16 bytes per lane, consecutive: 4 quarter-warps of 128 bytes, no conflict.
        assert_eq!(access(u32::MAX, 16, |l| Some(16 * l as u64)), Some((4, 4)));
        // 16-byte rows of 128 bytes each (an unswizzled 64-column bf16 tile): 8 lanes per phase in
        // the same 4 banks, 8 wavefronts each.
        assert_eq!(access(u32::MAX, 16, |l| Some(128 * l as u64)), Some((32, 4)));
        // Row l's 16 bytes at chunk l % 8 of its row (what the XOR swizzle does to chunk 0):
        // 8 consecutive rows in 8 different groups of 4 banks.
        assert_eq!(access(u32::MAX, 16, |l| Some(128 * l as u64 + 16 * ((l % 8) as u64))), Some((4, 4)));
        assert_eq!(access(u32::MAX, 8, |l| Some(8 * l as u64)), Some((2, 2)));
        assert_eq!(access(0, 4, |l| Some(4 * l as u64)), None);
    }
}
