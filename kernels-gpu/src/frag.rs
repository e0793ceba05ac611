//! Fragment helpers of the tensor-core kernels (`flash_fwd_mma`, `decode_mma`): the layout of an
//! `mma.sync` m16n8k16 f32 accumulator, the lanes' `ldmatrix` row addresses, and the softmax
//! steps done on fragments (a row's max, masking, packing P into A operands, rescaling O).
//!
//! Layout ([`crate::mma`]): in a 16 x 8 accumulator fragment ([`Acc`]) lane `l` (group
//! `g = l / 4`, `t = l % 4`) holds element `e` at row `g + 8 (e / 2)` ([`acc_row`]) and column
//! `2t + e % 2`; of `N` consecutive 8-column tiles `[Acc; N]`, element `e` of tile `n` is column
//! `2t + 8n + e % 2` ([`acc_col`] is the part without `2t`). A row's 8-column slices are spread
//! over the 4 lanes of its group, so a row statistic is reduced over the group
//! (`quad_max`, `quad_sum`, device code).
//!
//! The accumulator layout of two adjacent 8-key tiles of S is the A-operand layout of one
//! 16-key step of `P V` ([`pack_a`]), so P never touches shared memory.
//!
//! The pure helpers compile for the host too, where their tests pin the index math; the
//! shuffles are device code.

/// One lane's share of a 16 x 8 f32 accumulator fragment.
pub type Acc = [f32; 4];

/// Row of element `e` within the lane's two rows: 0 for row `g`, 1 for row `g + 8`.
#[inline(always)]
pub const fn acc_row(e: usize) -> usize {
    e / 2
}

/// Column of element `e` of 8-column tile `n`, relative to the lane's first column `2t`.
#[inline(always)]
pub const fn acc_col(n: usize, e: usize) -> usize {
    8 * n + e % 2
}

/// `(row, 16-byte chunk)` lane `lane` addresses for `ldmatrix.x4` of an A operand (Q): rows
/// 0-15 of the m-tile at chunk 0 (lanes 0-15) and chunk 1 (lanes 16-31), i.e. the four 8 x 8
/// matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
#[inline(always)]
pub const fn ldsm_a_lane(lane: usize) -> (usize, usize) {
    (lane % 16, lane / 16)
}

/// `(row, chunk)` for `ldmatrix.x4` of the B operands of two 8-key tiles of `Q Kᵀ` (K stored
/// `[key][d]`): matrices (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7),
/// (keys 8-15, d 8-15), so `r[0], r[1]` feed key tile 0 and `r[2], r[3]` key tile 1.
#[inline(always)]
pub const fn ldsm_b_lane(lane: usize) -> (usize, usize) {
    (lane % 8 + 8 * (lane / 16), (lane / 8) % 2)
}

/// `(row, chunk)` for `ldmatrix.x4.trans` of the B operands of two 8-column tiles of `P V`
/// (V stored `[key][d]`): matrices (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15),
/// (keys 8-15, d 8-15), so `r[0], r[1]` feed d tile 0 and `r[2], r[3]` d tile 1.
#[inline(always)]
pub const fn ldsm_bt_lane(lane: usize) -> (usize, usize) {
    (lane % 8 + 8 * ((lane / 8) % 2), lane / 16)
}

#[cfg(target_arch = "nvptx64")]
use crate::device::{max_f32, shfl_xor};

/// `max.f32` on the host: the larger of two non-NaN values.
#[cfg(not(target_arch = "nvptx64"))]
#[inline(always)]
fn max_f32(a: f32, b: f32) -> f32 {
    a.max(b)
}

/// The largest of `init` and this lane's elements of row `r` (0: row `g`, 1: `g + 8`) in `N`
/// tiles; `quad_max` then gives the row's max.
#[inline(always)]
pub fn row_max<const N: usize>(s: &[Acc; N], r: usize, init: f32) -> f32 {
    let mut x = init;
    unroll8!(n in 0..N => { x = max_f32(x, max_f32(s[n][2 * r], s[n][2 * r + 1])); });
    x
}

/// Sets to `-inf` every element of row `r` whose column (relative to the lane's first column,
/// [`acc_col`]) is below `lo[r]` or at or above `hi[r]`: keys outside the row's window. A bound
/// that is a constant `i32::MIN` / `i32::MAX` costs nothing (the compare folds away).
#[inline(always)]
pub fn mask_outside<const N: usize>(s: &mut [Acc; N], lo: [i32; 2], hi: [i32; 2]) {
    unroll8!(n in 0..N => {
        unroll4!(e in 0..4 => {
            let c = acc_col(n, e) as i32;
            if c < lo[acc_row(e)] || c >= hi[acc_row(e)] {
                s[n][e] = f32::NEG_INFINITY;
            }
        });
    });
}

/// The A fragments of `P V` from the probabilities in `N` 8-key tiles of S: key step `kc` takes
/// tiles `2kc` (keys `2t, 2t + 1` of rows `g`, `g + 8`) and `2kc + 1` (keys `8 + 2t, 9 + 2t`),
/// each pair packed to one register by `pack` (low half the smaller column). Steps `N / 2..`
/// of the result are unused.
#[inline(always)]
pub fn pack_a<const N: usize>(s: &[Acc; N], pack: impl Fn(f32, f32) -> u32) -> [[u32; 4]; N] {
    let mut pf = [[0u32; 4]; N];
    unroll4!(kc in 0..N / 2 => {
        pf[kc] = [
            pack(s[2 * kc][0], s[2 * kc][1]),
            pack(s[2 * kc][2], s[2 * kc][3]),
            pack(s[2 * kc + 1][0], s[2 * kc + 1][1]),
            pack(s[2 * kc + 1][2], s[2 * kc + 1][3]),
        ];
    });
    pf
}

/// Multiplies row `r` of `N` accumulator tiles (an O accumulator) by `alpha`.
#[inline(always)]
pub fn scale_row<const N: usize>(o: &mut [Acc; N], r: usize, alpha: f32) {
    unroll!(n in 0..N, max 32 => {
        o[n][2 * r] *= alpha;
        o[n][2 * r + 1] *= alpha;
    });
}

/// The max of `x` over the 4 lanes of a group (one row of a fragment): `shfl.sync.bfly` 1, 2.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub fn quad_max(x: f32) -> f32 {
    let x = max_f32(x, shfl_xor(x, 1));
    max_f32(x, shfl_xor(x, 2))
}

/// The sum of `x` over the 4 lanes of a group.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub fn quad_sum(x: f32) -> f32 {
    let x = x + shfl_xor(x, 1);
    x + shfl_xor(x, 2)
}

#[cfg(all(feature = "unit-tests", not(target_arch = "nvptx64")))]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    /// Element `e` of tile `n` of lane `(g, t)`: its (row, column) in the 16 x 8N tile.
    fn at(lane: usize, n: usize, e: usize) -> (usize, usize) {
        let (g, t) = (lane / 4, lane % 4);
        (g + 8 * acc_row(e), 2 * t + acc_col(n, e))
    }

    pub fn every_accumulator_element_is_held_once() {
        let mut seen = [[0u8; 16]; 16];
        for lane in 0..32 {
            for n in 0..2 {
                for e in 0..4 {
                    let (r, c) = at(lane, n, e);
                    seen[r][c] += 1;
                }
            }
        }
        assert!(seen.iter().flatten().all(|&k| k == 1));
    }

    pub fn ldmatrix_lanes_address_the_documented_matrices() {
        // Lanes 8i..8i+8 give the row addresses of matrix i.
        for lane in 0..32 {
            let i = lane / 8;
            assert_eq!(ldsm_a_lane(lane), (lane % 8 + 8 * (i % 2), i / 2), "A, lane {lane}");
            assert_eq!(ldsm_b_lane(lane), (lane % 8 + 8 * (i / 2), i % 2), "B, lane {lane}");
            assert_eq!(ldsm_bt_lane(lane), (lane % 8 + 8 * (i % 2), i / 2), "B trans, lane {lane}");
        }
    }

    pub fn row_max_mask_pack_and_scale_follow_the_layout() {
        // Tile n, element e holds 10n + e: distinct values that name their position.
        let mut s: [Acc; 4] = core::array::from_fn(|n| core::array::from_fn(|e| (10 * n + e) as f32));
        assert_eq!(row_max(&s, 0, f32::NEG_INFINITY), 31.0);
        assert_eq!(row_max(&s, 1, f32::NEG_INFINITY), 33.0);
        assert_eq!(row_max(&s, 1, 50.0), 50.0);
        // Row 0 keeps relative columns 1..=16 (tiles 0 e1, 1, 2 e0), row 1 keeps columns < 8.
        let mut m = s;
        mask_outside(&mut m, [1, i32::MIN], [17, 8]);
        let inf = f32::NEG_INFINITY;
        assert_eq!(m[0], [inf, 1.0, 2.0, 3.0]);
        assert_eq!(m[1], [10.0, 11.0, inf, inf]);
        assert_eq!(m[2], [20.0, inf, inf, inf]);
        assert_eq!(m[3], [inf; 4]);
        // Packing: step kc is (tile 2kc rows g, g+8), (tile 2kc+1 rows g, g+8).
        let pf = pack_a(&s, |lo, hi| (lo as u32) | (hi as u32) << 16);
        let w = |lo: u32, hi: u32| lo | hi << 16;
        assert_eq!(pf[0], [w(0, 1), w(2, 3), w(10, 11), w(12, 13)]);
        assert_eq!(pf[1], [w(20, 21), w(22, 23), w(30, 31), w(32, 33)]);
        assert_eq!(pf[2], [0; 4]);
        scale_row(&mut s, 1, 2.0);
        assert_eq!(s[3], [30.0, 31.0, 64.0, 66.0]);
    }
}
