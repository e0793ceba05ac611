//! Global-memory coalescing: how many 32-byte sectors a warp's global access touches.
//!
//! A GPU serves a warp's global load or store in 32-byte sectors (the unit L1 and L2 move).
//! Lanes that ask for neighbouring bytes share sectors: 32 lanes reading consecutive f32 values
//! need 128 bytes, 4 sectors. Lanes 128 bytes apart each need a sector of their own, 32 sectors
//! (1024 bytes moved) for the same 128 bytes. The *efficiency* of an access is the bytes the
//! lanes asked for over the bytes of the sectors touched, `useful / (32 · sectors)`: 100 % when
//! every byte of every sector is used, 12.5 % for the strided read. Bytes two lanes both ask for
//! (a broadcast) count once, so the efficiency never exceeds 100 %. There is no cache model: a
//! sector touched again by a later instruction counts again.

use crate::ir::{Op, Space};
use crate::memory::{MODULE_BASE, PARAM_WINDOW};

/// Bytes of a sector.
pub const SECTOR: u64 = 32;

/// Per instruction: warp-wide executions, useful bytes, sectors.
pub(crate) type Count = [u64; 3];

/// The global address of a lane's access in `sp`, or `None` when it is not global memory.
#[inline]
fn global_addr(sp: Space, addr: u64) -> Option<u64> {
    match sp {
        Space::Global => Some(addr),
        Space::Generic if (MODULE_BASE..PARAM_WINDOW).contains(&addr) => Some(addr),
        _ => None,
    }
}

/// (useful bytes, sectors) of one warp access: `lane(l)` is lane `l`'s (address, width), `None`
/// when it does not access global memory. `None` when no lane does.
pub(crate) fn access(lane: impl Fn(usize) -> Option<(u64, u64)>) -> Option<(u64, u64)> {
    // At most 32 lanes of at most 16 bytes: 32 spans, each in one or two sectors.
    let mut spans = [(0u64, 0u64); 32];
    let mut n = 0;
    for l in 0..32 {
        if let Some((a, w)) = lane(l) {
            spans[n] = (a, a + w.max(1));
            n += 1;
        }
    }
    if n == 0 {
        return None;
    }
    let spans = &mut spans[..n];
    spans.sort_unstable();
    let (mut useful, mut end) = (0u64, 0u64);
    let mut sectors = [0u64; 64];
    let mut k = 0;
    for &(a, b) in spans.iter() {
        let a2 = a.max(end);
        if b > a2 {
            useful += b - a2;
        }
        end = end.max(b);
        for s in a / SECTOR..=(b - 1) / SECTOR {
            if k < sectors.len() {
                sectors[k] = s;
                k += 1;
            }
        }
    }
    let sectors = &mut sectors[..k];
    sectors.sort_unstable();
    let distinct = 1 + sectors.windows(2).filter(|w| w[0] != w[1]).count() as u64;
    Some((useful, distinct))
}

/// (useful bytes, sectors) of `op` when it is a global `ld`, `st` or the global source of a
/// `cp.async` (generic addresses count when they resolve to global memory).
pub(crate) fn of_op(op: &Op, r: &[[u64; 32]], exec: u32) -> Option<(u64, u64)> {
    let on = |l: usize| exec >> l & 1 == 1;
    match *op {
        Op::Ld { sp, size, n, a, off, .. } | Op::St { sp, size, n, a, off, .. }
            if matches!(sp, Space::Global | Space::Generic) =>
        {
            let av = &r[a as usize];
            let width = size as u64 * n as u64;
            access(|l| if on(l) { global_addr(sp, av[l].wrapping_add(off as u64)).map(|g| (g, width)) } else { None })
        }
        Op::CpAsync { size, a, aoff, .. } => {
            let av = &r[a as usize];
            access(|l| {
                if on(l) {
                    global_addr(Space::Global, av[l].wrapping_add(aoff as i64 as u64)).map(|g| (g, size as u64))
                } else {
                    None
                }
            })
        }
        _ => None,
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    pub fn a_stride_of_32_f32_is_one_sector_per_lane_and_unit_stride_is_four() {
        // Stride 32 f32 elements (128 bytes): each lane its own sector, 32 sectors of 32 B for
        // 128 useful bytes, 12.5 %.
        assert_eq!(access(|l| Some((0x1000 + 128 * l as u64, 4))), Some((128, 32)));
        // Unit stride: 128 consecutive bytes, 4 sectors, 100 %.
        assert_eq!(access(|l| Some((0x1000 + 4 * l as u64, 4))), Some((128, 4)));
        // Misaligned by 4 bytes: the same 128 bytes straddle 5 sectors.
        assert_eq!(access(|l| Some((0x1004 + 4 * l as u64, 4))), Some((128, 5)));
        // A broadcast: 32 lanes, one word, one sector; the word is useful once.
        assert_eq!(access(|_| Some((0x1000, 4))), Some((4, 1)));
        // 16 bytes per lane, consecutive: 512 bytes, 16 sectors.
        assert_eq!(access(|l| Some((0x1000 + 16 * l as u64, 16))), Some((512, 16)));
        // Half the lanes active, unit stride: 64 bytes, 2 sectors.
        assert_eq!(access(|l| (l < 16).then(|| (0x1000 + 4 * l as u64, 4))), Some((64, 2)));
        assert_eq!(access(|_| None), None);
    }
}
