//! Shared-memory address math of the tensor-core kernels: the XOR swizzle and the per-lane
//! `ldmatrix` row addresses.
//!
//! A staged tile is row-major, one row = `D * 2` bytes = `D / 8` chunks of 16 bytes (8 16-bit
//! values, the unit of `cp.async` and of an `ldmatrix` row). When a row is a multiple of 128
//! bytes (`D % 64 == 0`: 64, 128, 192, 256), chunk `c` of row `r` is stored at chunk position
//! `c ^ (r % 8)`. One `ldmatrix` phase reads the same logical chunk of 8 consecutive rows;
//! without the XOR those 8 chunks are `D * 2` bytes apart — a multiple of 128 bytes — and all
//! fall on the same 4 of the 32 banks (an 8-way conflict). With it they land on 8 distinct 16-byte
//! bank groups, covering all 32 banks once.
//!
//! When a row is 64 bytes more than a multiple of 128 (`D % 64 == 32`: 32, 96), rows `2i` and
//! `2i + 1` already fall on opposite halves of a 128-byte line (a 4-way conflict unswizzled), so
//! only the low 2 bits of the chunk are XORed, with `(r / 2) % 4`: the 4 row pairs of a phase
//! take the 4 chunk positions of each half (FlashAttention-2 swizzles its 32-element smem blocks
//! the same way). Either XOR only permutes chunks within a row (within aligned groups of
//! [`swizzle_group`] chunks), so the `cp.async` stores of one row stay conflict-free too, and
//! both repeat every 8 rows.
//!
//! Pure code, compiled for the host as well; the unit tests check the bank groups.

/// Bytes of one chunk: 8 16-bit values.
pub const CHUNK: usize = 16;

/// Chunks the XOR permutes among, for rows of `d` 16-bit values: 8 when a row is a multiple of
/// 128 bytes (`d % 64 == 0`), 4 when it is 64 bytes more (`d % 64 == 32`). A tile's rows must hold
/// whole groups (`d % 32 == 0`).
pub const fn swizzle_group(d: usize) -> usize {
    if d.is_multiple_of(64) {
        8
    } else {
        4
    }
}

/// Byte offset of logical chunk `chunk` of row `row` in a swizzled tile with rows of `d` 16-bit
/// values.
#[inline(always)]
pub const fn swizzled_offset(d: usize, row: usize, chunk: usize) -> usize {
    let x = if d.is_multiple_of(64) { row % 8 } else { (row / 2) % 4 };
    row * d * 2 + ((chunk ^ x) * CHUNK)
}

/// A lane's `ldmatrix` row addresses in a swizzled tile, for a lane that addresses row
/// `row + 8i` (`i` a constant) and logical chunk `2k + hi` (`k` a constant).
///
/// The swizzle XORs only the low 3 (or 2, see [`swizzle_group`]) bits of the chunk with a
/// function of `row % 8`, so with `G` chunks per group the address of chunk `G a + b` is
/// `base[b / 2] + 16 G a`: four (or two) per-lane bases, everything else an immediate offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaneAddrs<const D: usize> {
    pub base: [u32; 4],
}

impl<const D: usize> LaneAddrs<D> {
    /// The four bases for this lane's `row` and `hi` (0 or 1) in the tile at shared address
    /// `tile`.
    #[inline(always)]
    pub fn new(tile: u32, row: usize, hi: usize) -> Self {
        let at = |k: usize| tile + swizzled_offset(D, row, 2 * k + hi) as u32;
        LaneAddrs { base: [at(0), at(1), at(2), at(3)] }
    }

    /// Address of row `row + rows` (`rows` a multiple of 8), chunk `2k + hi`.
    #[inline(always)]
    pub fn at(&self, rows: usize, k: usize) -> u32 {
        let pairs = swizzle_group(D) / 2; // chunk pairs per swizzle group: bases in use
        self.base[k % pairs] + ((k / pairs) * 2 * pairs * CHUNK + rows * D * 2) as u32
    }
}

/// A lane's `ldmatrix` row address in a swizzled tile as one register: for a lane that addresses
/// row `row + 8i` and logical chunk `2k + hi + 8a`, the address is `base ^ (32 (k % 4))` plus an
/// immediate. The swizzle XORs chunk bits 0-2 (address bits 4-6) with `row % 8`; chunk `2k + hi`
/// of `k < 4` differs from chunk `hi` only in bits 1-2, so one XOR with an immediate gives it.
/// Needs a 128-byte aligned tile and rows of a multiple of 128 bytes (`D % 64 == 0`), so that
/// bits 4-6 of `base` are exactly the swizzled chunk `hi ^ (row % 8)`. Costs one `LOP3` per
/// distinct `k % 4` where [`LaneAddrs`] holds four registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XorLaneAddr<const D: usize> {
    pub base: u32,
}

impl<const D: usize> XorLaneAddr<D> {
    /// The address of this lane's `row`, chunk `hi` (0 or 1) in the tile at shared address `tile`
    /// (128-byte aligned).
    #[inline(always)]
    pub fn new(tile: u32, row: usize, hi: usize) -> Self {
        const { assert!((D * 2).is_multiple_of(128), "rows of whole 128-byte lines") };
        XorLaneAddr { base: tile + (row * D * 2 + (hi ^ (row % 8)) * CHUNK) as u32 }
    }

    /// Address of row `row + rows` (`rows` a multiple of 8), chunk `2k + hi`.
    #[inline(always)]
    pub fn at(&self, rows: usize, k: usize) -> u32 {
        (self.base ^ ((k % 4) * 2 * CHUNK) as u32) + ((k / 4) * 8 * CHUNK + rows * D * 2) as u32
    }
}

/// A lane's `ldmatrix` row addresses for either swizzle: [`XorLaneAddr`]'s one register when a
/// row is a multiple of 128 bytes (`D % 64 == 0`), [`LaneAddrs`]' bases otherwise (the 4-chunk
/// swizzle of `D` = 32, 96). The choice is made at compile time; unused bases are dead code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileLane<const D: usize> {
    pub base: [u32; 4],
}

impl<const D: usize> TileLane<D> {
    /// The addresses of this lane's `row`, chunk `hi` (0 or 1) in the tile at shared address
    /// `tile` (128-byte aligned).
    #[inline(always)]
    pub fn new(tile: u32, row: usize, hi: usize) -> Self {
        if D.is_multiple_of(64) {
            // XorLaneAddr::new without its const assert, which the other branch would trip.
            TileLane { base: [tile + (row * D * 2 + (hi ^ (row % 8)) * CHUNK) as u32, 0, 0, 0] }
        } else {
            TileLane { base: LaneAddrs::<D>::new(tile, row, hi).base }
        }
    }

    /// Address of row `row + rows` (`rows` a multiple of 8), chunk `2k + hi`.
    #[inline(always)]
    pub fn at(&self, rows: usize, k: usize) -> u32 {
        if D.is_multiple_of(64) {
            XorLaneAddr::<D> { base: self.base[0] }.at(rows, k)
        } else {
            LaneAddrs::<D> { base: self.base }.at(rows, k)
        }
    }
}

/// The copy plan of a staged tile: `threads` threads copy rows of `d` 16-bit values, `d / 8`
/// chunks of 16 bytes each, one chunk per thread per pass. Thread `t` of phase `j` copies chunk
/// [`copy_slot`]`(d, threads, t, j)` and the same chunk of every [`copy_group_rows`]-th row
/// after it. When `threads` is a multiple of the chunks per row (d = 32, 64, 128, 256) there is
/// one phase and a thread keeps its chunk column; when it is not (d = 96 or 192 at 128 threads:
/// 12 or 24 chunks a row) the `lcm(threads, d / 8)` chunks of [`copy_group_rows`] whole rows are
/// copied in [`copy_phases`] passes, each thread taking a different chunk in each (thread `t`
/// of phase `j` takes chunk `t + threads j` of the group, in row-major order).
pub const fn copy_phases(d: usize, threads: usize) -> usize {
    let cpr = d * 2 / CHUNK;
    cpr / gcd(threads, cpr)
}

/// Rows a thread's copies of one phase are apart (see [`copy_phases`]): `threads / (d / 8)` with
/// one phase, `lcm(threads, d / 8) / (d / 8)` with several.
pub const fn copy_group_rows(d: usize, threads: usize) -> usize {
    let cpr = d * 2 / CHUNK;
    threads / gcd(threads, cpr)
}

/// The row (within a group of [`copy_group_rows`]) and the chunk column thread `tid` copies in
/// phase `phase` of [`copy_phases`].
#[inline(always)]
pub const fn copy_slot(d: usize, threads: usize, tid: usize, phase: usize) -> (usize, usize) {
    let cpr = d * 2 / CHUNK;
    let i = tid + threads * phase;
    (i / cpr, i % cpr)
}

/// Greatest common divisor (for the copy plan's constants).
const fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The 16-byte bank group (0..8) of a shared-memory byte address: 32 banks of 4 bytes make 8
/// groups of 16 bytes per 128-byte line.
pub const fn bank_group(addr: u32) -> u32 {
    (addr / CHUNK as u32) % 8
}

#[cfg(all(feature = "unit-tests", not(target_arch = "nvptx64")))]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    /// The 8 rows one `ldmatrix` phase reads (rows `r0..r0 + 8`, one logical chunk) hit 8 distinct
    /// bank groups, for every head dim the kernels use, every row block and every chunk.
    fn check_phases<const D: usize>() {
        for r0 in (0..64).step_by(8) {
            for chunk in 0..D / 8 {
                let mut seen = [false; 8];
                for row in r0..r0 + 8 {
                    let g = bank_group(swizzled_offset(D, row, chunk) as u32) as usize;
                    assert!(!seen[g], "D={D} rows {r0}.. chunk {chunk}: bank group {g} twice");
                    seen[g] = true;
                }
            }
        }
        // Without the swizzle the same phase is an 8-way (rows of 128 n bytes) or 4-way (128 n +
        // 64 bytes) conflict: the check above can fail.
        let plain: Vec<u32> = (0..8).map(|row| bank_group((row * D * 2) as u32)).collect();
        let distinct = plain.iter().collect::<std::collections::BTreeSet<_>>().len();
        assert_eq!(distinct, if D.is_multiple_of(64) { 1 } else { 2 }, "D={D}: {plain:?}");
    }

    pub fn ldmatrix_phases_hit_eight_distinct_bank_groups() {
        check_phases::<32>();
        check_phases::<64>();
        check_phases::<96>();
        check_phases::<128>();
        check_phases::<192>();
        check_phases::<256>();
    }

    /// The copy plan covers every chunk of every row of a tile exactly once, for the tiles'
    /// (head dim, threads) pairs, one phase or several; a phase's rows of one thread are a whole
    /// number of swizzle periods apart where there are several phases.
    pub fn the_copy_plan_covers_every_chunk_once() {
        for (d, threads, rows) in [
            (32, 128, 128),
            (64, 128, 128),
            (96, 128, 64),
            (96, 96, 96),
            (96, 192, 192),
            (128, 128, 64),
            (192, 128, 64),
            (192, 192, 96),
            (256, 256, 128),
            (256, 128, 64),
        ] {
            let (phases, group) = (copy_phases(d, threads), copy_group_rows(d, threads));
            assert_eq!(rows % group, 0, "d {d} threads {threads}: {rows} rows, groups of {group}");
            assert!(phases == 1 || group % 8 == 0, "d {d} threads {threads}: {phases} phases, {group} rows");
            let cpr = d / 8;
            let mut seen = vec![0u32; rows * cpr];
            for tid in 0..threads {
                for j in 0..phases {
                    let (r, c) = copy_slot(d, threads, tid, j);
                    assert!(r < group && c < cpr, "d {d} tid {tid} phase {j}: ({r}, {c})");
                    for k in 0..rows / group {
                        seen[(r + k * group) * cpr + c] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "d {d} threads {threads}: {seen:?}");
        }
        assert_eq!((copy_phases(96, 128), copy_group_rows(96, 128)), (3, 32));
        assert_eq!((copy_phases(192, 128), copy_group_rows(192, 128)), (3, 16));
        assert_eq!((copy_phases(128, 128), copy_group_rows(128, 128)), (1, 8));
        assert_eq!(copy_slot(96, 128, 127, 0), (10, 7));
        assert_eq!(copy_slot(96, 128, 127, 2), (31, 11));
    }

    /// The precomputed bases plus immediate offsets give the swizzled address of every chunk.
    fn check_lanes<const D: usize>() {
        for row in 0..16 {
            for hi in 0..2 {
                let la = LaneAddrs::<D>::new(0x400, row, hi);
                for rows in [0, 8, 16, 48] {
                    for k in 0..D / 16 {
                        let want = 0x400 + swizzled_offset(D, row + rows, 2 * k + hi) as u32;
                        assert_eq!(la.at(rows, k), want, "D={D} row {row} hi {hi} +{rows} k {k}");
                    }
                }
            }
        }
    }

    pub fn xor_lane_addresses_agree_with_the_swizzle() {
        fn check<const D: usize>() {
            for row in 0..16 {
                for hi in 0..2 {
                    let la = XorLaneAddr::<D>::new(0x1080, row, hi);
                    for rows in [0, 8, 16, 48] {
                        for k in 0..D / 16 {
                            let want = 0x1080 + swizzled_offset(D, row + rows, 2 * k + hi) as u32;
                            assert_eq!(la.at(rows, k), want, "D={D} row {row} hi {hi} +{rows} k {k}");
                        }
                    }
                }
            }
        }
        check::<64>();
        check::<128>();
        check::<192>();
        check::<256>();
    }

    pub fn tile_lanes_agree_with_the_swizzle_at_every_head_dim() {
        fn check<const D: usize>() {
            for row in 0..16 {
                for hi in 0..2 {
                    let la = TileLane::<D>::new(0x1080, row, hi);
                    for rows in [0, 8, 16, 48] {
                        for k in 0..D / 16 {
                            let want = 0x1080 + swizzled_offset(D, row + rows, 2 * k + hi) as u32;
                            assert_eq!(la.at(rows, k), want, "D={D} row {row} hi {hi} +{rows} k {k}");
                        }
                    }
                }
            }
        }
        check::<32>();
        check::<64>();
        check::<96>();
        check::<128>();
        check::<192>();
        check::<256>();
    }

    pub fn lane_addresses_agree_with_the_swizzle() {
        check_lanes::<32>();
        check_lanes::<64>();
        check_lanes::<96>();
        check_lanes::<128>();
        check_lanes::<192>();
        check_lanes::<256>();
    }

    pub fn the_swizzle_permutes_chunks_within_a_row() {
        for d in [32, 64, 96, 128, 192, 256] {
            for row in 0..16 {
                let mut offs: Vec<usize> = (0..d / 8).map(|c| swizzled_offset(d, row, c)).collect();
                offs.sort_unstable();
                assert_eq!(offs, (0..d / 8).map(|c| row * d * 2 + c * 16).collect::<Vec<_>>(), "d={d}");
            }
        }
    }
}
