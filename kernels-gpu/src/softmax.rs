//! The online softmax (FlashAttention's running max and sum), shared by both fused kernels.
//!
//! A row's scores arrive a tile at a time. The state keeps the running max `m` and the running sum
//! `l = Σ 2^(s - m)` of the scores seen so far, in the log2 domain (`log2 e` is folded into the
//! softmax scale once, [`LOG2E`], so every exponential is one `ex2`). Per tile the kernel:
//! 1. computes the tile's scores and their max;
//! 2. [`OnlineSoftmax::raise_max`]: raises `m` to cover the tile and rescales `l` by
//!    `alpha = 2^(m_old - m_new)`; the kernel rescales its output accumulator by the same `alpha`;
//! 3. [`OnlineSoftmax::prob`]: turns each score into `p = 2^(s - m)`, adding it to `l`; the kernel
//!    accumulates `p · v`;
//! 4. at the end, [`OnlineSoftmax::finish`]: `O = acc / l` and `LSE = ln 2 · (m + log2 l)` (natural
//!    log).
//!
//! A row that has seen only masked (`-inf`) scores keeps `m = -inf`; its exponent base is then 0,
//! so every `2^(-inf - 0)` is 0 and no `-inf - (-inf)` = NaN appears. If it never sees a key, the
//! result is `O = 0` and `LSE = -inf`.
//!
//! Pure code: it compiles for the host too (with `f32::exp2`/`log2` in place of the PTX `ex2` /
//! `lg2` approximations), where its unit tests run.

/// `log2 e`: scores are multiplied by `scale · LOG2E` so that `e^x = 2^(x · log2 e)` is one `ex2`.
pub const LOG2E: f32 = core::f32::consts::LOG2_E;
/// `ln 2`: converts the log2-domain LSE back to natural log.
pub const LN2: f32 = core::f32::consts::LN_2;

#[cfg(target_arch = "nvptx64")]
use crate::device::{exp2, log2};

#[cfg(not(target_arch = "nvptx64"))]
#[inline(always)]
fn exp2(x: f32) -> f32 {
    x.exp2()
}
#[cfg(not(target_arch = "nvptx64"))]
#[inline(always)]
fn log2(x: f32) -> f32 {
    x.log2()
}

/// Maximum that treats -inf as the identity and never produces NaN from two non-NaN inputs.
#[inline(always)]
pub fn fmax(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// Running statistics of one query row (or, in the tensor-core kernel, one lane's share of a row's
/// sum: the lanes of a row then add their `l` before [`OnlineSoftmax::finish`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OnlineSoftmax {
    /// Running max of the log2-domain scores seen so far (`-inf` before the first visible key).
    pub m: f32,
    /// Running sum of `2^(s - m)`.
    pub l: f32,
}

/// What [`OnlineSoftmax::raise_max`] tells the kernel about the new tile.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rescale {
    /// Factor for everything accumulated under the old max: `2^(m_old - m_new)`.
    pub alpha: f32,
    /// Exponent base of this tile's probabilities: the new max, or 0 while it is `-inf`.
    pub base: f32,
}

impl Default for OnlineSoftmax {
    fn default() -> Self {
        Self::new()
    }
}

impl OnlineSoftmax {
    /// No score seen yet.
    #[inline(always)]
    pub const fn new() -> Self {
        OnlineSoftmax { m: f32::NEG_INFINITY, l: 0.0 }
    }

    /// Step 2: raise the running max to cover a tile whose max score is `tile_max` and rescale the
    /// running sum. The caller rescales its output accumulator by the returned `alpha`.
    #[inline(always)]
    pub fn raise_max(&mut self, tile_max: f32) -> Rescale {
        let m_new = fmax(self.m, tile_max);
        let base = if m_new == f32::NEG_INFINITY { 0.0 } else { m_new };
        let alpha = exp2(self.m - base);
        self.l *= alpha;
        self.m = m_new;
        Rescale { alpha, base }
    }

    /// Step 3: the probability `2^(s - base)` of one score of the tile, added to the running sum.
    #[inline(always)]
    pub fn prob(&mut self, s: f32, r: Rescale) -> f32 {
        let p = exp2(s - r.base);
        self.l += p;
        p
    }

    /// Step 4: `(1 / l, LSE)` for the row's total sum `l_total` (this state's `l`, or the sum of
    /// the lanes' shares); `(0, -inf)` for a row that saw no key, so `O = 0`, never NaN.
    #[inline(always)]
    pub fn finish(&self, l_total: f32) -> (f32, f32) {
        if l_total > 0.0 {
            (1.0 / l_total, (self.m + log2(l_total)) * LN2)
        } else {
            (0.0, f32::NEG_INFINITY)
        }
    }
}

#[cfg(all(test, not(target_arch = "nvptx64")))]
mod tests {
    use super::*;

    /// Online softmax over `tiles` of scores (natural-log domain) with values `v`, against the
    /// direct two-pass formula in f64.
    fn online(scores: &[f64], v: &[f64], tile: usize) -> (f64, f64) {
        let mut st = OnlineSoftmax::new();
        let mut acc = 0.0f32;
        for (sc, vc) in scores.chunks(tile).zip(v.chunks(tile)) {
            let s2: Vec<f32> = sc.iter().map(|&s| s as f32 * LOG2E).collect();
            let r = st.raise_max(s2.iter().copied().fold(f32::NEG_INFINITY, fmax));
            acc *= r.alpha;
            for (s, &x) in s2.iter().zip(vc) {
                acc += st.prob(*s, r) * x as f32;
            }
        }
        let (inv_l, lse) = st.finish(st.l);
        ((acc * inv_l) as f64, lse as f64)
    }

    fn direct(scores: &[f64], v: &[f64]) -> (f64, f64) {
        let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if m == f64::NEG_INFINITY {
            return (0.0, f64::NEG_INFINITY);
        }
        let l: f64 = scores.iter().map(|s| (s - m).exp()).sum();
        let o: f64 = scores.iter().zip(v).map(|(s, x)| (s - m).exp() * x).sum::<f64>() / l;
        (o, m + l.ln())
    }

    #[test]
    fn matches_the_two_pass_softmax_for_any_tiling() {
        // Scores rising across tiles (every tile rescales), a masked prefix, and large magnitudes.
        let scores: Vec<f64> = (0..37)
            .map(|i| if i < 5 { f64::NEG_INFINITY } else { (i as f64 * 0.37).sin() * 6.0 + i as f64 * 0.2 })
            .collect();
        let v: Vec<f64> = (0..37).map(|i| (i as f64 * 1.3).cos() * 2.0 + 0.5).collect();
        let (o_ref, lse_ref) = direct(&scores, &v);
        for tile in [1, 3, 8, 16, 64] {
            let (o, lse) = online(&scores, &v, tile);
            assert!((o - o_ref).abs() < 1e-5 * o_ref.abs().max(1.0), "tile {tile}: {o} vs {o_ref}");
            assert!((lse - lse_ref).abs() < 1e-5 * lse_ref.abs().max(1.0), "tile {tile}: {lse} vs {lse_ref}");
        }
    }

    #[test]
    fn a_row_that_sees_nothing_gives_zero_and_minus_infinity() {
        let scores = [f64::NEG_INFINITY; 10];
        let (o, lse) = online(&scores, &[3.0; 10], 4);
        assert_eq!((o, lse), (0.0, f64::NEG_INFINITY));
        let mut st = OnlineSoftmax::new();
        let r = st.raise_max(f32::NEG_INFINITY);
        assert_eq!((r.alpha, r.base, st.m, st.l), (0.0, 0.0, f32::NEG_INFINITY, 0.0));
        assert_eq!(st.prob(f32::NEG_INFINITY, r), 0.0);
    }
}
