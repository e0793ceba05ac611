//! The online softmax (FlashAttention's running max and sum) and its one rescale policy, shared
//! by every fused kernel (both flash forwards and both decode forwards).
//!
//! A row's scores arrive a tile at a time. The state keeps the running max `m` and the running sum
//! `l = Σ 2^(s - m)` of the scores seen so far, in the log2 domain (`log2 e` is folded into the
//! softmax scale once, [`LOG2E`], so every exponential is one `ex2`). Per tile the kernel:
//! 1. computes the tile's scores and their max;
//! 2. lazily ([`must_rescale`], [`OnlineSoftmax::must_raise`]): only when some row of the warp
//!    has grown by more than [`RESCALE_THRESHOLD`] does the warp [`OnlineSoftmax::raise_max`]:
//!    raise `m` to cover the tile and rescale `l` by `alpha = 2^(m_old - m_new)`, and the kernel
//!    its output accumulator by the same `alpha`; otherwise the tile keeps the base
//!    ([`OnlineSoftmax::keep`]) and skips the rescale;
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

/// Lazy rescaling (log2 domain), the one rescale policy of every fused kernel: a row's
/// exponent base is raised only when a tile's max exceeds it by more than this, so once the max
/// has settled tiles skip rescaling the output accumulator. The kernels vote over the warp
/// (`warp_any`): a warp rescales all its rows or none, so the branch is uniform. Until then the base may trail the true running max by up to 8, so probabilities
/// `2^(s - base)` stay at most `2^8 = 256`: exact in f32, bf16 and f16 (whose relative precision
/// does not depend on magnitude) and far from overflow in `l` and `O`. The result is the same
/// softmax: `O = Σ 2^(s - base) v / Σ 2^(s - base)` and `LSE = ln 2 · (base + log2 l)` hold for
/// any base.
pub const RESCALE_THRESHOLD: f32 = 8.0;

/// Whether a row whose exponent base is `base2` (log2 domain; `-inf` before its first visible
/// key) must raise it for a tile whose max score, the running max included, is `max2`: when the
/// max has grown by more than [`RESCALE_THRESHOLD`], or on the row's first visible key. Never
/// for a row that has still seen only masked keys (`max2 = -inf`).
#[inline(always)]
pub fn must_rescale(base2: f32, max2: f32) -> bool {
    max2 > base2 + RESCALE_THRESHOLD
}

#[cfg(target_arch = "nvptx64")]
use crate::device::{exp2, log2, rcp};

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
#[cfg(not(target_arch = "nvptx64"))]
#[inline(always)]
fn rcp(x: f32) -> f32 {
    1.0 / x
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
    /// Exponent base (log2 domain): the running max of the scores seen so far as of the last
    /// rescale, so at most [`RESCALE_THRESHOLD`] below the true running max under the lazy
    /// policy (`-inf` before the first visible key).
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

    /// Step 2 of the lazy policy: whether this row must raise its base for a tile whose max
    /// score is `tile_max` ([`must_rescale`]); the warp raises every row's base
    /// ([`OnlineSoftmax::raise_max`]) when any row must, else keeps them ([`OnlineSoftmax::keep`]).
    #[inline(always)]
    pub fn must_raise(&self, tile_max: f32) -> bool {
        must_rescale(self.m, tile_max)
    }

    /// The tile's [`Rescale`] when the base is kept: `alpha = 1` (nothing to rescale) and the
    /// current base (0 while it is `-inf`).
    #[inline(always)]
    pub fn keep(&self) -> Rescale {
        Rescale { alpha: 1.0, base: if self.m == f32::NEG_INFINITY { 0.0 } else { self.m } }
    }

    /// Step 3: the probability `2^(s - base)` of one score of the tile, added to the running sum.
    #[inline(always)]
    pub fn prob(&mut self, s: f32, r: Rescale) -> f32 {
        let p = exp2(s - r.base);
        self.l += p;
        p
    }

    /// Step 4 with an attention sink: `sink2` is the head's sink logit in the log2 domain
    /// (`sink * LOG2E`; `-inf` for none). The sink joins the denominator only:
    /// `O = acc · 2^(m - m') / (l · 2^(m - m') + 2^(sink2 - m'))` with `m' = max(m, sink2)`.
    /// Returns `(factor for acc, LSE)`; a row that saw no key and has no sink gives `(0, -inf)`,
    /// a row that saw only the sink `(0, sink)`.
    #[inline(always)]
    pub fn finish_with_sink(&self, l_total: f32, sink2: f32) -> (f32, f32) {
        let m_new = fmax(self.m, sink2);
        if m_new == f32::NEG_INFINITY {
            return (0.0, f32::NEG_INFINITY);
        }
        let alpha = exp2(self.m - m_new); // 0 when the row saw no key
        let l = l_total * alpha + exp2(sink2 - m_new);
        (alpha / l, (m_new + log2(l)) * LN2)
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

/// Below this `|x|` [`tanh`] uses its odd polynomial; above it the `ex2` form, whose absolute
/// error (about 1e-7, from `ex2.approx`) is then at most about 3e-7 relative to `tanh(0.4) = 0.38`.
/// The polynomial's first omitted term, `(929569 / 638512875) x^15`, is below 4e-9 of `x` here.
const TANH_POLY_LIMIT: f32 = 0.4;

/// `tanh(x)` with a small relative error everywhere, the one tanh of every kernel's soft cap.
///
/// `1 - 2 · rcp(2^(2x·log2 e) + 1)` (one `ex2`, one approximate reciprocal: no IEEE division and
/// so no division slow path in a kernel's loop) saturates to ±1 for large `|x|` (`rcp(inf) = 0`,
/// never NaN), but for small `|x|` it subtracts two numbers near 1: its absolute error stays near
/// 1e-7 while `tanh(x) ≈ x` shrinks, so `cap · tanh(s / cap)` carried an error of about
/// `cap · 1e-7` whatever the score `s` (5e-2 at a cap of 1e6). Below `TANH_POLY_LIMIT` the
/// Taylor series to `x^13` is used instead (relative error near f32 rounding); both forms are
/// computed and one selected, so a warp does not diverge.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let big = 1.0 - 2.0 * rcp(exp2(x * (2.0 * LOG2E)) + 1.0);
    let u = x * x;
    let p = -1.0 / 3.0
        + u * (2.0 / 15.0
            + u * (-17.0 / 315.0 + u * (62.0 / 2835.0 + u * (-1382.0 / 155925.0 + u * (21844.0 / 6081075.0)))));
    let small = x + x * u * p;
    if x.abs() < TANH_POLY_LIMIT {
        small
    } else {
        big
    }
}

/// Soft-capped log2-domain score from `x = scale · q·k / cap`: `cap2 · tanh(x)` with
/// `cap2 = cap · LOG2E` ([`tanh`]).
#[inline(always)]
pub fn softcap2(x: f32, cap2: f32) -> f32 {
    cap2 * tanh(x)
}

#[cfg(all(feature = "unit-tests", not(target_arch = "nvptx64")))]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
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

    pub fn matches_the_two_pass_softmax_for_any_tiling() {
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

    /// The kernels' lazy rescaling, through the state's own steps: the base is raised only when
    /// [`OnlineSoftmax::must_raise`] says so, else kept. Returns the result and how many tiles
    /// rescaled.
    fn online_lazy(scores: &[f64], v: &[f64], tile: usize) -> (f64, f64, usize) {
        let (mut st, mut acc, mut rescales) = (OnlineSoftmax::new(), 0.0f32, 0);
        for (sc, vc) in scores.chunks(tile).zip(v.chunks(tile)) {
            let s2: Vec<f32> = sc.iter().map(|&s| s as f32 * LOG2E).collect();
            let mx = s2.iter().copied().fold(f32::NEG_INFINITY, fmax);
            let r = if st.must_raise(mx) {
                rescales += 1;
                let r = st.raise_max(mx);
                acc *= r.alpha;
                r
            } else {
                let r = st.keep();
                assert_eq!(r.alpha, 1.0);
                r
            };
            for (s, &x) in s2.iter().zip(vc) {
                let p = st.prob(*s, r);
                assert!(p <= 2f32.powf(RESCALE_THRESHOLD), "p {p} above 2^threshold");
                acc += p * x as f32;
            }
        }
        let (inv_l, lse) = st.finish(st.l);
        ((acc * inv_l) as f64, lse as f64, rescales)
    }

    pub fn lazy_rescaling_matches_the_two_pass_softmax_and_skips_small_rises() {
        // Scores rising by 0.5 per key (0.72 in log2): one key at a time the base trails by up
        // to 8 and is raised every 12th key (6 times in 64); a tile of 16 rises by 11.5, so every
        // tile rescales (4, 2 and 1 times in tiles of 16, 32, 64). Scores that barely rise
        // (0.03 per key plus a sine, a range under 6 in log2) after a masked prefix rescale only
        // at the first visible key.
        let rising: Vec<f64> = (0..64).map(|i| i as f64 * 0.5).collect();
        let slow: Vec<f64> =
            (0..64).map(|i| if i < 7 { f64::NEG_INFINITY } else { i as f64 * 0.03 + (i as f64).sin() }).collect();
        let v: Vec<f64> = (0..64).map(|i| (i as f64 * 1.3).cos() * 2.0 + 0.5).collect();
        for (scores, tiles_rescaling) in [(&rising, [6, 4, 2, 1]), (&slow, [1, 1, 1, 1])] {
            let (o_ref, lse_ref) = direct(scores, &v);
            for (tile, want) in [1, 16, 32, 64].into_iter().zip(tiles_rescaling) {
                let (o, lse, rescales) = online_lazy(scores, &v, tile);
                assert!((o - o_ref).abs() < 1e-5 * o_ref.abs().max(1.0), "tile {tile}: {o} vs {o_ref}");
                assert!((lse - lse_ref).abs() < 1e-5 * lse_ref.abs().max(1.0), "tile {tile}: {lse} vs {lse_ref}");
                assert_eq!(rescales, want, "tile {tile}: rescales");
            }
        }
        let (o, lse, rescales) = online_lazy(&[f64::NEG_INFINITY; 8], &[3.0; 8], 4);
        assert_eq!((o, lse, rescales), (0.0, f64::NEG_INFINITY, 0));
    }

    pub fn softcap_is_tanh_and_saturates() {
        for x in [-50.0f32, -3.0, -0.7, -1e-4, 0.0, 1e-4, 0.3, 2.5, 40.0, 1e30] {
            let want = 2.0 * (x as f64).tanh() * LOG2E as f64;
            let got = softcap2(x, 2.0 * LOG2E) as f64;
            assert!((got - want).abs() < 1e-6, "x {x}: {got} vs {want}");
        }
    }

    /// Relative error against f64 across the small-argument range, where `cap · tanh(s / cap)`
    /// needs it (a cap of 1e6 puts ordinary scores at `|x|` near 1e-6), through the switch to the
    /// `ex2` form, and saturation.
    pub fn tanh_has_a_small_relative_error_for_tiny_arguments() {
        let mut x = 1e-9f32;
        while x < 20.0 {
            for v in [x, -x] {
                let want = (v as f64).tanh();
                let got = tanh(v) as f64;
                assert!((got - want).abs() <= 4e-7 * want.abs(), "x {v}: {got} vs {want}");
            }
            x *= 1.37;
        }
        for x in [0.399f32, 0.4, 0.401] {
            let want = (x as f64).tanh();
            assert!((tanh(x) as f64 - want).abs() <= 4e-7 * want, "x {x}");
        }
        assert_eq!((tanh(0.0), tanh(1e30), tanh(-1e30)), (0.0, 1.0, -1.0));
        // The score itself: cap 1e6, score 1.5 (x = 1.5e-6) keeps its value to f32 rounding.
        let cap = 1e6f32;
        let s = softcap2(1.5 / cap, cap * LOG2E) / LOG2E;
        assert!((s as f64 - 1.5).abs() < 1e-6, "{s}");
    }

    pub fn a_sink_joins_the_denominator_only() {
        // Scores (natural log) 0 and ln 3 with values 4 and 8, sink ln 4: the probabilities are
        // 1/8 and 3/8 (the sink takes 4/8), O = (4 + 24) / 8 = 3.5, LSE = ln 8.
        let mut st = OnlineSoftmax::new();
        let s2 = [0.0f32, 3f32.ln() * LOG2E];
        let r = st.raise_max(s2[1]);
        let acc = st.prob(s2[0], r) * 4.0 + st.prob(s2[1], r) * 8.0;
        let (f, lse) = st.finish_with_sink(st.l, 4f32.ln() * LOG2E);
        assert!((acc * f - 3.5).abs() < 1e-5 && (lse - 8f32.ln()).abs() < 1e-6, "{} {lse}", acc * f);
        // No sink: the plain finish.
        let (f2, lse2) = st.finish_with_sink(st.l, f32::NEG_INFINITY);
        let (f1, lse1) = st.finish(st.l);
        assert!((f2 - f1).abs() < 1e-7 && (lse2 - lse1).abs() < 1e-6);
        // A row that saw only the sink: O = 0 and LSE = sink; a huge sink drives O to 0.
        let empty = OnlineSoftmax::new();
        assert_eq!(empty.finish_with_sink(0.0, 2.5 * LOG2E).0, 0.0);
        assert!((empty.finish_with_sink(0.0, 2.5 * LOG2E).1 - 2.5).abs() < 1e-6);
        assert_eq!(empty.finish_with_sink(0.0, f32::NEG_INFINITY), (0.0, f32::NEG_INFINITY));
        let (fh, lseh) = st.finish_with_sink(st.l, 1e30 * LOG2E);
        assert_eq!(fh, 0.0);
        assert!((lseh - 1e30).abs() < 1e24);
    }

    pub fn a_row_that_sees_nothing_gives_zero_and_minus_infinity() {
        let scores = [f64::NEG_INFINITY; 10];
        let (o, lse) = online(&scores, &[3.0; 10], 4);
        assert_eq!((o, lse), (0.0, f64::NEG_INFINITY));
        let mut st = OnlineSoftmax::new();
        let r = st.raise_max(f32::NEG_INFINITY);
        assert_eq!((r.alpha, r.base, st.m, st.l), (0.0, 0.0, f32::NEG_INFINITY, 0.0));
        assert_eq!(st.prob(f32::NEG_INFINITY, r), 0.0);
    }
}
