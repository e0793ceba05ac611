//! Verification of device outputs against the f64 reference.
//!
//! One acceptance rule for every attention output: the prefill's ([`verify`]) and decode's
//! ([`crate::decode::verify_decode`]) are judged by the same function, under the same bounds per
//! dtype (below; decode caps its row bounds at its former fixed ones, see
//! [`crate::decode::DecodeReference::tolerance`]).
//!
//! For O: max absolute error, max relative error and relative RMS error `‖o − ref‖ / ‖ref‖` over
//! the checked rows. For LSE: the same over finite reference values; a `-inf` reference (fully
//! masked row) must be exactly `-inf` on the device. Outputs are poisoned with NaN before every
//! launch, so any element the kernel did not write is NaN and fails the check (it is counted in
//! `unwritten`).
//!
//! # Bounds
//!
//! **Every row on its own.** Besides the whole-tensor statistics below, each checked row `r` is
//! measured against its own scale `a_r = Σ_j P_j |v_j|` ([`Reference::o_abs`]): relative RMS
//! `‖o_r − ref_r‖ / ‖a_r‖`, max abs `max |o_r − ref_r| / max a_r` and LSE `|lse_r − ref_r| /
//! max(1, |ref_r|)` ([`row_errors`]), with the bounds `row_rel_rms`, `row_max_abs` and
//! `lse_row_max_abs` of [`Tolerance`]: 1e-5, 1e-4, 1e-4 for f32; for bf16/f16 twice the
//! naive-in-dtype baseline's worst row (floors `u`, `2u`, 1e-4). So no row's error can hide behind
//! another row's magnitude: a whole-tensor relative RMS is dominated by the largest rows, and a
//! max abs bound scaled by the tensor's largest value is loose for every other row.
//!
//! **f32**: [`crate::dtype::Dtype::tolerance`]: relative RMS errors of 1e-5, and max abs errors
//! of 1e-4 *per unit of magnitude*: the absolute bounds are multiplied by `max(1, max |ref|)` of
//! the tensor (O or finite LSE), because an f32 value of magnitude M carries M·2^-24 of rounding.
//! The scores behind O carry `|s|`-proportional error too, which no fixed bound covers: the
//! relative bounds are at least `e` = [`f32_score_rounding`] (`8 · 2^-24 · (max |lse| + ln
//! seq_kv)`, the max abs ones `2e`), which the default scale keeps below 1e-5 and a large scale
//! (LSE in the hundreds) raises to 1e-4 (docs/semantics.md, "Accuracy", has the derivation).
//!
//! **bf16 / f16**: a 16-bit result cannot match an f64 reference to f32 bounds; how close it can
//! get depends on the dtype and on the inputs. So the bound is measured on the same inputs and
//! rows: [`naive_in_dtype`] computes attention the plain way in that dtype —
//!
//! 1. scores `s_j = scale · (q · k_j)` in f32 from the rounded 16-bit inputs,
//! 2. softmax in f32: `m = max s_j`, `e_j = exp(s_j − m)`, `l = Σ e_j`, `LSE = m + ln l`,
//! 3. `P_j = e_j / l` rounded to the dtype (the probabilities a 16-bit pipeline hands to its
//!    P·V matmul),
//! 4. `O = Σ P_j v_j` accumulated in f32, then rounded to the dtype (the output tensor);
//!
//! its errors against the f64 reference (computed from the same rounded inputs) are the
//! *baseline*. A kernel passes when its O relative RMS and max abs errors are at most **2× the
//! baseline's** ([`tolerance_for`]). Two floors keep a baseline that happens to be (nearly)
//! exact — tiny problems, outputs that are exactly representable — from failing a correct kernel:
//! the O relative RMS bound is at least the dtype's unit roundoff `u` (2^-8 bf16, 2^-11 f16: what
//! rounding an exact output to the dtype may cost), and the O max abs bound is at least `2u ·
//! max |ref|` (one ulp of the largest output). LSE is f32 in every kernel (the row sum is kept in
//! f32, before P is rounded), so its bounds are the f32 ones, or 2× the baseline's LSE error when
//! that is larger. The run reports the bounds used, the baseline's errors and the ratio
//! kernel / baseline; for bf16 the O relative RMS error is expected around 1e-3..1e-2.
//!
//! The backward's 16-bit gradients are judged the same way, against a naive backward in the
//! dtype: [`grad`].

pub mod grad;

use crate::dtype::{Dtype, Tolerance};
use crate::inputs::Qkv;
use crate::problem::Problem;
use crate::reference::{rows_on_cores, weighted_keys, KeysByDim, Reference, RowId, RowRules, WeightedKeys};

/// Error statistics of one tensor.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct ErrorStats {
    /// Largest `|got − ref|` over the elements compared.
    pub max_abs_err: f64,
    /// Largest `|got − ref| / max(|ref|, f64::MIN_POSITIVE)`.
    pub max_rel_err: f64,
    /// `‖got − ref‖ / ‖ref‖` (the absolute RMS norm when the reference is all zeros).
    pub rel_rms_err: f64,
    /// Elements compared.
    pub compared: u64,
}

/// The result of comparing O and LSE with the reference.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Verification {
    /// Every bound of `tolerance` held and no failure was found (`failures` empty).
    pub passed: bool,
    /// The errors of O's finite elements over the checked rows (beyond what underflow may lose).
    pub o: ErrorStats,
    /// The errors of LSE over the checked rows where both values are finite.
    pub lse: ErrorStats,
    /// Checked elements still NaN (never written) or otherwise non-finite where the reference is
    /// finite.
    pub unwritten: u64,
    /// Rows whose reference LSE is `-inf` but the device's is not, or vice versa.
    pub lse_inf_mismatches: u64,
    /// Query rows compared with the reference.
    pub checked_rows: u64,
    /// Query rows of the problem (`checked_rows` is fewer when a sample was checked).
    pub total_rows: u64,
    /// The bounds the run was judged against.
    pub tolerance: Tolerance,
    /// Human reasons for a failure (empty when passed).
    pub failures: Vec<String>,
    /// The checked row closest to (or furthest over) its bounds, with its errors relative to its
    /// own scale (`null` when no row was checked).
    pub worst_row: Option<WorstRow>,
}

/// The worst row of a verification.
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct WorstRow {
    /// Which row.
    pub row: RowId,
    /// `‖o_r − ref_r‖ / ‖a_r‖` (see [`row_errors`]).
    pub rel_rms_err: f64,
    /// `max |o_r − ref_r| / max a_r`.
    pub max_abs_err: f64,
    /// `|lse_r − ref_r| / max(1, |ref_r|)`.
    pub lse_err: f64,
    /// Largest error / bound of the row (passes at <= 1).
    pub bound_ratio: f64,
}

/// Tracks the row with the largest error / bound ratio.
#[derive(Default)]
struct RowWorst {
    ratio: f64,
    row: RowId,
    errors: [f64; 3],
    failing: u64,
    last_failing: Option<RowId>,
    any: bool,
}

impl RowWorst {
    fn add(&mut self, row: RowId, ratio: f64, errors: [f64; 3]) {
        let ratio = if ratio.is_nan() { f64::INFINITY } else { ratio };
        if ratio > 1.0 && self.last_failing != Some(row) {
            self.failing += 1;
            self.last_failing = Some(row);
        }
        if !self.any || ratio > self.ratio {
            self.ratio = ratio;
            self.row = row;
            self.errors = errors;
            self.any = true;
        }
    }
    fn row_json(&self) -> Option<WorstRow> {
        self.any.then_some(WorstRow {
            row: self.row,
            rel_rms_err: self.errors[0],
            max_abs_err: self.errors[1],
            lse_err: self.errors[2],
            bound_ratio: self.ratio,
        })
    }
}

/// Accumulates error statistics.
#[derive(Default)]
struct Acc {
    max_abs: f64,
    max_rel: f64,
    diff2: f64,
    ref2: f64,
    n: u64,
}

impl Acc {
    fn add(&mut self, got: f64, want: f64) {
        self.add_beyond(got, want, 0.0);
    }
    /// As [`Acc::add`], counting only the error beyond `slack` (what underflow may lose,
    /// [`Reference::o_under`]).
    fn add_beyond(&mut self, got: f64, want: f64, slack: f64) {
        let diff = ((got - want).abs() - slack).max(0.0);
        self.max_abs = self.max_abs.max(diff);
        // Relative error against max(|ref|, tiny) so exact zeros do not blow it up to infinity.
        let rel = diff / want.abs().max(f64::MIN_POSITIVE);
        self.max_rel = self.max_rel.max(rel);
        self.diff2 += diff * diff;
        self.ref2 += want * want;
        self.n += 1;
    }
    fn stats(&self) -> ErrorStats {
        let rel_rms = if self.ref2 > 0.0 { (self.diff2 / self.ref2).sqrt() } else { self.diff2.sqrt() };
        ErrorStats { max_abs_err: self.max_abs, max_rel_err: self.max_rel, rel_rms_err: rel_rms, compared: self.n }
    }
}

/// Naive attention in `p.dtype` for the rows of `reference` (see the module documentation):
/// O (`rows × head_dim`, values of the dtype) and LSE (f32, `-inf` for a fully masked row).
pub fn naive_in_dtype(p: &Problem, x: &Qkv, reference: &Reference) -> (Vec<f32>, Vec<f32>) {
    let d = p.head_dim as usize;
    let slopes = if p.alibi { crate::problem::alibi_slopes(p.heads) } else { vec![0.0; p.heads as usize] };
    let ([o], lse) =
        rows_on_cores(&reference.rows, p.seq_kv as usize * d, d, (0.0, f32::NEG_INFINITY), |rs, [oc], lc| {
            naive_rows(p, x, rs, &slopes, oc, lc)
        });
    (o, lse)
}

widest_vectors! {
    /// The rows `rs` of [`naive_in_dtype`] one after the other: O into `oc` (`head_dim` values
    /// per row, left as they are for a row that sees nothing), the LSE into `lc`.
    fn naive_rows / naive_rows_baseline(
        p: &Problem,
        x: &Qkv,
        rs: &[RowId],
        slopes: &[f32],
        oc: &mut [f32],
        lc: &mut [f32],
    ) {
        let d = p.head_dim as usize;
        let (mut e, mut acc) = (vec![0f32; p.seq_kv as usize], vec![0f32; d]);
        let mut keys = KeysByDim::default();
        for (k, row) in rs.iter().enumerate() {
            if let Some(l) = naive_row(p, x, row, slopes, &mut keys, &mut e, &mut acc) {
                oc[k * d..(k + 1) * d].copy_from_slice(&acc);
                lc[k] = l;
            }
        }
    }
}

/// One row of [`naive_in_dtype`]: the row's rules, query, keys and values handed to
/// [`naive_attention_row`].
#[inline(always)]
fn naive_row(
    p: &Problem,
    x: &Qkv,
    row: &RowId,
    slopes: &[f32],
    keys: &mut KeysByDim,
    e: &mut [f32],
    acc: &mut [f32],
) -> Option<f32> {
    let (hh, d) = (p.heads as usize, p.head_dim as usize);
    let hk = p.kv_heads() as usize;
    let kh = row.h as usize / (hh / hk);
    let (sq, sk) = p.seq_lens(row.b);
    let k0 = p.kv_row(row.b, 0) as usize;
    let q = &x.q[(p.q_row(row.b, row.i) as usize * hh + row.h as usize) * d..][..d];
    let at = move |j: usize| ((k0 + j) * hk + kh) * d;
    let (k_row, v_row) = (|j| &x.k[at(j)..][..d], |j| &x.v[at(j)..][..d]);
    let rules = RowRules::prefill(p, x, row, slopes);
    naive_attention_row(p.dtype, &rules, (sq, sk), row.i, q, keys, (row.b, kh as u32), k_row, v_row, e, acc)
}

/// One query row of naive attention in `dt` (steps 1-4 of the module documentation), with the
/// inputs of [`crate::reference::attention_row`] (the same rules, the rows of K and V wherever
/// they are held): O (values of the dtype) into `acc` and the LSE, or `None` for a row that
/// sees no key and no sink (O = 0, LSE = -inf). `keys` holds the row's keys as those of `of`
/// or is made to; `e` holds at least `sk` values. The rules' f64 values are f32 ones widened, so
/// they narrow back exactly.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn naive_attention_row<'a>(
    dt: Dtype,
    rules: &RowRules,
    (sq, sk): (u32, u32),
    i: u32,
    q: &[f32],
    keys: &mut KeysByDim,
    of: (u32, u32),
    k_row: impl Fn(usize) -> &'a [f32],
    v_row: impl Fn(usize) -> &'a [f32],
    e: &mut [f32],
    acc: &mut [f32],
) -> Option<f32> {
    let d = q.len();
    // GQA/MQA, window, soft cap and sinks as in the reference (`docs/semantics.md`).
    let (scale, cap, slope, sink) = (rules.scale as f32, rules.softcap as f32, rules.slope as f32, rules.sink as f32);
    let e = &mut e[..sk as usize];
    let seen = rules.mask.keys(sq, sk, i);
    if !seen.is_empty() {
        keys.hold_rows(of, d, sk as usize, &k_row);
        keys.dots(q, seen.start, &mut e[seen.clone()]);
    }
    let mut m = sink;
    for (j, s) in e.iter_mut().enumerate() {
        *s = if seen.contains(&j) {
            let dot = *s;
            let s = if cap > 0.0 { cap * (dot * scale / cap).tanh() } else { dot * scale };
            let dist = (i as i64 + sk as i64 - sq as i64 - j as i64).unsigned_abs() as f32;
            s - slope * dist
        } else {
            f32::NEG_INFINITY
        };
        m = m.max(*s);
    }
    if m == f32::NEG_INFINITY {
        return None;
    }
    // The keys outside `seen` weigh exp(-inf) = 0: they add nothing to l or to O.
    let mut l = (sink - m).exp();
    for s in &mut e[seen.clone()] {
        *s = (*s - m).exp();
        l += *s;
    }
    for s in &mut e[seen.clone()] {
        *s = dt.round(*s / l);
    }
    // Each element of O adds its keys' terms in key order; the loop over the row's elements is
    // what the vector units take, four keys per pass so the sums stay in registers between them.
    acc.fill(0.0);
    for keys in weighted_keys(e, seen.clone()) {
        match keys {
            WeightedKeys::Four(j) => {
                let (p0, p1, p2, p3) = (e[j], e[j + 1], e[j + 2], e[j + 3]);
                let terms = v_row(j).iter().zip(v_row(j + 1)).zip(v_row(j + 2)).zip(v_row(j + 3));
                for (o, (((&v0, &v1), &v2), &v3)) in acc.iter_mut().zip(terms) {
                    *o = (((*o + p0 * v0) + p1 * v1) + p2 * v2) + p3 * v3;
                }
            }
            WeightedKeys::One(j) => {
                let pj = e[j];
                for (o, &v) in acc.iter_mut().zip(v_row(j)) {
                    *o += pj * v;
                }
            }
        }
    }
    for a in acc.iter_mut() {
        *a = dt.round(*a);
    }
    Some(m + l.ln())
}

/// One row's errors relative to its own scale: `‖o_r − ref_r‖ / ‖a_r‖`, `max |o_r − ref_r| /
/// max a_r` (`a_r` = [`Reference::o_abs`]; a row of scale 0 must match exactly) and the LSE error
/// `|lse_r − ref_r| / max(1, |ref_r|)` (0 for a `-inf` reference). Non-finite values count as
/// infinite error. An element's error counts only beyond what f32 underflow may correctly lose
/// ([`Reference::o_under`]): a sink far above the scores (about 88 to 745) makes every key's
/// weight underflow, so O is 0 in f32 where the reference is about 1e-44, and the row's own scale
/// is that small too.
pub fn row_errors(o: &[f32], lse: f32, reference: &Reference, r: usize, d: usize) -> (f64, f64, f64) {
    row_errors_of(o, lse, &RefRow::of(reference, r, d))
}

/// One row of an f64 reference, wherever it is held: O, its scale ([`Reference::o_abs`]), its
/// underflow part ([`Reference::o_under`]) (`head_dim` values each) and the LSE.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RefRow<'a> {
    pub(crate) o: &'a [f64],
    pub(crate) abs: &'a [f64],
    pub(crate) under: &'a [f64],
    pub(crate) lse: f64,
}

impl<'a> RefRow<'a> {
    /// Row `r` of `reference` (`d` values per row).
    pub(crate) fn of(reference: &'a Reference, r: usize, d: usize) -> RefRow<'a> {
        let at = r * d..(r + 1) * d;
        RefRow {
            o: &reference.o[at.clone()],
            abs: &reference.o_abs[at.clone()],
            under: &reference.o_under[at],
            lse: reference.lse[r],
        }
    }
}

/// One row to judge: which row, what the device wrote (O's `head_dim` values, the LSE) and the
/// reference's row.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowPair<'a> {
    pub(crate) row: RowId,
    pub(crate) o: &'a [f32],
    pub(crate) lse: f32,
    pub(crate) want: RefRow<'a>,
}

/// [`row_errors`] of one row against a reference row.
pub(crate) fn row_errors_of(o: &[f32], lse: f32, want: &RefRow<'_>) -> (f64, f64, f64) {
    let (mut diff2, mut scale2, mut max_diff, mut max_scale) = (0f64, 0f64, 0f64, 0f64);
    for (((&g, &w), &a), &u) in o.iter().zip(want.o).zip(want.abs).zip(want.under) {
        let diff = if g.is_finite() { ((g as f64 - w).abs() - u).max(0.0) } else { f64::INFINITY };
        diff2 += diff * diff;
        scale2 += a * a;
        max_diff = max_diff.max(diff);
        max_scale = max_scale.max(a);
    }
    let rel = |num: f64, den: f64| {
        if num == 0.0 {
            0.0
        } else if den > 0.0 {
            num / den
        } else {
            f64::INFINITY
        }
    };
    let w = want.lse;
    let lse_err = if w.is_finite() {
        if lse.is_finite() {
            (lse as f64 - w).abs() / w.abs().max(1.0)
        } else {
            f64::INFINITY
        }
    } else {
        0.0 // -inf rows are checked for an exact match separately
    };
    (rel(diff2.sqrt(), scale2.sqrt()), rel(max_diff, max_scale), lse_err)
}

/// The errors of a naive-in-dtype baseline: whole-tensor O and LSE, and the worst row's three
/// [`row_errors`].
pub(crate) type BaselineErrors = ((ErrorStats, ErrorStats), [f64; 3]);

/// Errors of naive attention's rows (`o`, `lse` in the order of `reference.rows`) against the
/// reference, (O, LSE), plus the worst row errors of the baseline ([`row_errors`]).
pub(crate) fn baseline_errors(o: &[f32], lse: &[f32], reference: &Reference, d: usize) -> BaselineErrors {
    let mut worst = [0f64; 3];
    for r in 0..reference.rows.len() {
        let e = row_errors(&o[r * d..(r + 1) * d], lse[r], reference, r, d);
        for (w, v) in worst.iter_mut().zip([e.0, e.1, e.2]) {
            *w = w.max(v);
        }
    }
    let (mut oa, mut la) = (Acc::default(), Acc::default());
    for ((&g, &w), &u) in o.iter().zip(&reference.o).zip(&reference.o_under) {
        oa.add_beyond(g as f64, w, u);
    }
    for (&g, &w) in lse.iter().zip(&reference.lse) {
        if w.is_finite() && g.is_finite() {
            la.add(g as f64, w);
        }
    }
    ((oa.stats(), la.stats()), worst)
}

/// The relative error that rounding the scores in f32 alone brings into a softmax weight, and so
/// into O (and P, dS, dV in the backward), for a problem whose reference LSE is `lse` over
/// `seq_kv` keys (docs/semantics.md, "Accuracy"): a score `s` reaches the exponent as
/// `s (1 + δ)`, `|δ|` a few units of 2^-24 (the dot product's last rounding, the scale, the
/// `log2 e` factor), and its weight then carries `e^(s δ) ≈ 1 + s δ`. The keys that carry weight
/// have scores within `ln seq_kv` of the row's LSE, so `|s| <= max |lse| + ln seq_kv`; 8 units of
/// 2^-24 cover the roundings (plain f32 attention, numpy's, measures 1 to 3 of them). With the
/// default scale `1/sqrt(d)` this stays below the fixed 1e-5; `--scale 10` makes it about 1e-4.
pub fn f32_score_rounding(lse: &[f64], seq_kv: u32) -> f64 {
    let max_lse = lse.iter().filter(|v| v.is_finite()).fold(0f64, |a, &v| a.max(v.abs()));
    8.0 * (max_lse + (seq_kv.max(1) as f64).ln()) * f64::powi(2.0, -24)
}

/// Bounds of a bf16/f16 run: 2× the naive-in-dtype baseline with the floors of the module
/// documentation. For f32, [`Dtype::tolerance`] grown with the scores' magnitude
/// ([`f32_score_rounding`]).
pub fn tolerance_for(p: &Problem, x: &Qkv, reference: &Reference) -> Tolerance {
    tolerance_rule(p.dtype, &reference.o, &reference.lse, p.seq_kv, || {
        let (o, lse) = naive_in_dtype(p, x, reference);
        baseline_errors(&o, &lse, reference, p.head_dim as usize)
    })
}

/// The limit rule, one per output dtype, for every attention output judged by [`judge`] (the
/// prefill's through [`tolerance_for`], decode's through `crate::decode::reference`): from the
/// reference's O and LSE (`ref_o`, `ref_lse`), the longest row's key count `seq_kv` and, for
/// bf16/f16 only, the errors of naive attention in the dtype on the same inputs and rows.
pub(crate) fn tolerance_rule(
    dtype: Dtype,
    ref_o: &[f64],
    ref_lse: &[f64],
    seq_kv: u32,
    baseline: impl FnOnce() -> BaselineErrors,
) -> Tolerance {
    let mut f32_tol = Dtype::F32.tolerance();
    // Absolute bounds per unit of magnitude (module documentation).
    let max_lse = ref_lse.iter().filter(|v| v.is_finite()).fold(0f64, |a, &v| a.max(v.abs()));
    f32_tol.lse_max_abs *= max_lse.max(1.0);
    if !dtype.is_16bit() {
        // Relative bounds at least what the scores' own f32 rounding costs (large scores: a
        // large scale, large q and k).
        let e = f32_score_rounding(ref_lse, seq_kv);
        f32_tol.rel_rms = f32_tol.rel_rms.max(e);
        f32_tol.row_rel_rms = f32_tol.row_rel_rms.max(e);
        f32_tol.max_abs = f32_tol.max_abs.max(2.0 * e);
        f32_tol.row_max_abs = f32_tol.row_max_abs.max(2.0 * e);
        let max_o = ref_o.iter().fold(0f64, |a, &v| a.max(v.abs()));
        f32_tol.max_abs *= max_o.max(1.0);
        return f32_tol;
    }
    let ((bo, bl), worst) = baseline();
    let u = dtype.unit_roundoff();
    let max_ref = ref_o.iter().fold(0f64, |a, &v| a.max(v.abs()));
    Tolerance {
        rel_rms: (2.0 * bo.rel_rms_err).max(u),
        max_abs: (2.0 * bo.max_abs_err).max(2.0 * u * max_ref),
        lse_rel_rms: (2.0 * bl.rel_rms_err).max(f32_tol.lse_rel_rms),
        lse_max_abs: (2.0 * bl.max_abs_err).max(f32_tol.lse_max_abs),
        // Per row, relative to the row's own scale: twice the baseline's worst row.
        row_rel_rms: (2.0 * worst[0]).max(u),
        row_max_abs: (2.0 * worst[1]).max(2.0 * u),
        lse_row_max_abs: (2.0 * worst[2]).max(f32_tol.lse_row_max_abs),
        rule: match dtype {
            Dtype::Bf16 => {
                "2x naive attention in bf16 (floors: rel RMS 2^-8, max abs 2^-7 * max|ref|); every row: 2x the baseline's worst row, relative to the row's own scale"
            }
            _ => {
                "2x naive attention in f16 (floors: rel RMS 2^-11, max abs 2^-10 * max|ref|); every row: 2x the baseline's worst row, relative to the row's own scale"
            }
        },
        baseline_rel_rms_err: Some(bo.rel_rms_err),
        baseline_max_abs_err: Some(bo.max_abs_err),
    }
}

/// Compares device O (BSHD, f32) and LSE (`[batch, heads, seq_q]`, f32) with `reference`.
pub fn verify(p: &Problem, o: &[f32], lse: &[f32], reference: &Reference, tol: &Tolerance) -> Verification {
    let (hh, d) = (p.heads as usize, p.head_dim as usize);
    let pairs = reference.rows.iter().enumerate().map(|(r, row)| RowPair {
        row: *row,
        // Packed row and LSE index (varlen: `[total_q, heads, d]`, LSE `[heads, total_q]`).
        o: &o[(p.q_row(row.b, row.i) as usize * hh + row.h as usize) * d..][..d],
        lse: lse[p.lse_index(row.b, row.h, row.i) as usize],
        want: RefRow::of(reference, r, d),
    });
    judge(pairs, tol, reference.total_rows)
}

/// The acceptance rule of every attention output against its f64 reference, prefill
/// ([`verify`]) and decode (`crate::decode::verify_decode`) alike: each row's errors relative to
/// its own scale ([`row_errors`]) and the whole tensor's ([`ErrorStats`]), each within its bound
/// of `tol`; no element NaN or infinite where the reference is finite; LSE `-inf` exactly where
/// the reference's is. `pairs` are the checked rows, of `total_rows` in the problem.
pub(crate) fn judge<'a>(
    pairs: impl IntoIterator<Item = RowPair<'a>>,
    tol: &Tolerance,
    total_rows: u64,
) -> Verification {
    let (mut oa, mut la) = (Acc::default(), Acc::default());
    let mut unwritten = 0u64;
    let mut inf_mismatch = 0u64;
    let mut checked = 0u64;
    let mut rows = RowWorst::default();
    for RowPair { row, o: got, lse: g, want } in pairs {
        checked += 1;
        let (rel, abs, lse_rel) = row_errors_of(got, g, &want);
        rows.add(row, rel / tol.row_rel_rms, [rel, abs, lse_rel]);
        rows.add(row, abs / tol.row_max_abs, [rel, abs, lse_rel]);
        rows.add(row, lse_rel / tol.lse_row_max_abs, [rel, abs, lse_rel]);
        for ((&g, &w), &u) in got.iter().zip(want.o).zip(want.under) {
            if !g.is_finite() {
                unwritten += 1;
                continue;
            }
            oa.add_beyond(g as f64, w, u);
        }
        let w = want.lse;
        if g.is_nan() {
            unwritten += 1;
        } else if w == f64::NEG_INFINITY || g == f32::NEG_INFINITY {
            if !(w == f64::NEG_INFINITY && g == f32::NEG_INFINITY) {
                inf_mismatch += 1;
            }
        } else if !g.is_finite() {
            unwritten += 1;
        } else {
            la.add(g as f64, w);
        }
    }
    let (os, ls) = (oa.stats(), la.stats());
    let mut failures = Vec::new();
    if unwritten > 0 {
        failures.push(format!("{unwritten} checked elements are NaN/inf (unwritten: outputs are poisoned with NaN)"));
    }
    if inf_mismatch > 0 {
        failures.push(format!("{inf_mismatch} rows disagree on LSE = -inf (fully masked rows)"));
    }
    // `approx` does the per-bound comparisons: a value within `epsilon` of its bound passes.
    let within = |err: f64, bound: f64| err <= bound || (err - bound).abs() <= f64::EPSILON;
    if !within(os.rel_rms_err, tol.rel_rms) {
        failures.push(format!("O relative RMS error {:.3e} > {:.3e} ({})", os.rel_rms_err, tol.rel_rms, tol.rule));
    }
    if !within(os.max_abs_err, tol.max_abs) {
        failures.push(format!("O max abs error {:.3e} > {:.3e} ({})", os.max_abs_err, tol.max_abs, tol.rule));
    }
    if !within(ls.rel_rms_err, tol.lse_rel_rms) {
        failures.push(format!("LSE relative RMS error {:.3e} > {:.3e}", ls.rel_rms_err, tol.lse_rel_rms));
    }
    if !within(ls.max_abs_err, tol.lse_max_abs) {
        failures.push(format!("LSE max abs error {:.3e} > {:.3e}", ls.max_abs_err, tol.lse_max_abs));
    }
    // Unwritten elements are reported above; the row check names the worst row of the rest.
    if unwritten == 0 && rows.ratio > 1.0 && !within(rows.ratio, 1.0) {
        let (row, [rel, abs, lse_rel]) = (rows.row, rows.errors);
        failures.push(format!(
            "row (batch {}, head {}, query {}): rel RMS {rel:.3e} (bound {:.3e}), max abs {abs:.3e} (bound {:.3e}) of the \
             row's own scale, LSE {lse_rel:.3e} (bound {:.3e}); {} rows over their bounds",
            row.b, row.h, row.i, tol.row_rel_rms, tol.row_max_abs, tol.lse_row_max_abs, rows.failing
        ));
    }
    if os.compared == 0 && unwritten == 0 {
        failures.push("no output element was compared".into());
    }
    Verification {
        passed: failures.is_empty(),
        worst_row: rows.row_json(),
        o: os,
        lse: ls,
        unwritten,
        lse_inf_mismatches: inf_mismatch,
        checked_rows: checked,
        total_rows,
        tolerance: *tol,
        failures,
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;
    use crate::dtype::Dtype;
    use crate::inputs::Qkv;
    use crate::reference::{reference, RowSelection};

    pub fn naive_rows_give_the_same_bits_at_every_vector_level() {
        // As the reference's test: naive attention in bf16 as the widest vectors compute it
        // against the body compiled for the baseline.
        let p = Problem {
            batch: 2,
            heads: 4,
            heads_kv: Some(1),
            seq_q: 29,
            seq_kv: 45,
            head_dim: 24,
            causal: true,
            softcap: 4.0,
            sinks: true,
            dtype: Dtype::Bf16,
            ..Problem::default()
        };
        let x = Qkv::random(&p, 5);
        let rows = RowSelection::All.rows(&p);
        let slopes = crate::problem::alibi_slopes(p.heads);
        let n = rows.len() * 24;
        let run = |widest: bool| {
            let (mut o, mut l) = (vec![f32::NAN; n], vec![f32::NAN; rows.len()]);
            if widest {
                naive_rows(&p, &x, &rows, &slopes, &mut o, &mut l);
            } else {
                naive_rows_baseline(&p, &x, &rows, &slopes, &mut o, &mut l);
            }
            [o, l].map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>())
        };
        let (wide, base) = (run(true), run(false));
        assert!(wide[0].iter().any(|&b| f32::from_bits(b) != 0.0 && !f32::from_bits(b).is_nan()));
        assert_eq!(wide, base);
    }

    fn setup() -> (Problem, Reference, Vec<f32>, Vec<f32>) {
        let p = Problem { batch: 1, heads: 2, seq_q: 5, seq_kv: 4, head_dim: 3, causal: true, ..Problem::default() };
        let x = Qkv::random(&p, 3);
        let r = reference(&p, &x, &RowSelection::All);
        // Device-shaped copies of the reference (BSHD O, [b, h, s] LSE).
        let mut o = vec![0f32; p.q_elems() as usize];
        let mut lse = vec![0f32; p.rows() as usize];
        for (k, row) in r.rows.iter().enumerate() {
            let base = ((row.b * p.seq_q + row.i) * p.heads + row.h) as usize * 3;
            for dd in 0..3 {
                o[base + dd] = r.o[k * 3 + dd] as f32;
            }
            lse[((row.b * p.heads + row.h) * p.seq_q + row.i) as usize] = r.lse[k] as f32;
        }
        (p, r, o, lse)
    }

    pub fn exact_copy_passes_and_masked_row_is_minus_inf() {
        let (p, r, o, lse) = setup();
        assert!(r.lse.contains(&f64::NEG_INFINITY)); // seq_q > seq_kv, causal: row 0 is empty
        let v = verify(&p, &o, &lse, &r, &Dtype::F32.tolerance());
        assert!(v.passed, "{:?}", v.failures);
        assert!(v.o.rel_rms_err < 1e-7 && v.o.compared == 30);
    }

    pub fn nan_unwritten_inf_and_wrong_values_fail() {
        let (p, r, o, lse) = setup();
        let tol = Dtype::F32.tolerance();
        let mut bad = o.clone();
        bad[7] = f32::NAN;
        let v = verify(&p, &bad, &lse, &r, &tol);
        assert!(!v.passed && v.unwritten == 1);
        let mut bad = lse.clone();
        bad[0] = 0.0; // row 0 of head 0 must be -inf
        let v = verify(&p, &o, &bad, &r, &tol);
        assert!(!v.passed && v.lse_inf_mismatches == 1);
        let mut bad = o.clone();
        bad[20] += 1e-3;
        let v = verify(&p, &bad, &lse, &r, &tol);
        assert!(!v.passed && v.o.max_abs_err > 9e-4);
    }

    pub fn bf16_bound_is_twice_the_naive_in_dtype_baseline_with_floors() {
        let p = Problem {
            batch: 1,
            heads: 2,
            seq_q: 20,
            seq_kv: 37,
            head_dim: 64,
            dtype: Dtype::Bf16,
            ..Problem::default()
        };
        let x = Qkv::random(&p, 4);
        assert!(x.representable_in(Dtype::Bf16));
        let r = reference(&p, &x, &RowSelection::All);
        let tol = tolerance_for(&p, &x, &r);
        let base = tol.baseline_rel_rms_err.unwrap();
        // Rounding P and O to bf16 (u = 2^-8) costs ~1e-3 relative RMS.
        assert!(base > 2e-4 && base < 1e-2, "{base}");
        assert_eq!(tol.rel_rms, (2.0 * base).max(2f64.powi(-8)));
        assert!(tol.max_abs >= 2.0 * tol.baseline_max_abs_err.unwrap());
        assert_eq!(tol.lse_rel_rms, Dtype::F32.tolerance().lse_rel_rms.max(tol.lse_rel_rms));
        // The baseline itself, placed as device output, passes (ratio 1).
        let (bo, bl) = naive_in_dtype(&p, &x, &r);
        let mut o = vec![0f32; p.q_elems() as usize];
        let mut lse = vec![0f32; p.rows() as usize];
        for (k, row) in r.rows.iter().enumerate() {
            let base = ((row.b * p.seq_q + row.i) * p.heads + row.h) as usize * 64;
            o[base..base + 64].copy_from_slice(&bo[k * 64..(k + 1) * 64]);
            lse[((row.b * p.heads + row.h) * p.seq_q + row.i) as usize] = bl[k];
        }
        let v = verify(&p, &o, &lse, &r, &tol);
        assert!(v.passed, "{:?}", v.failures);
        // Three times the baseline's error fails.
        let mut bad = o.clone();
        for (k, row) in r.rows.iter().enumerate() {
            let base = ((row.b * p.seq_q + row.i) * p.heads + row.h) as usize * 64;
            for d in 0..64 {
                let want = r.o[k * 64 + d] as f32;
                bad[base + d] = want + 3.0 * (bo[k * 64 + d] - want);
            }
        }
        let v = verify(&p, &bad, &lse, &r, &tol);
        assert!(!v.passed && v.failures.iter().any(|f| f.contains("2x naive attention in bf16")), "{:?}", v.failures);
    }

    pub fn floor_keeps_an_exact_baseline_from_failing_a_rounded_result() {
        // One key: O = V exactly, so naive in bf16 is exact (baseline error 0); a kernel whose
        // output is off by one bf16 rounding step must still pass.
        let p =
            Problem { batch: 1, heads: 1, seq_q: 1, seq_kv: 1, head_dim: 64, dtype: Dtype::Bf16, ..Problem::default() };
        let x = Qkv::random(&p, 2);
        let r = reference(&p, &x, &RowSelection::All);
        let tol = tolerance_for(&p, &x, &r);
        assert_eq!(tol.baseline_rel_rms_err, Some(0.0));
        assert_eq!(tol.rel_rms, 2f64.powi(-8));
        let o: Vec<f32> = x.v.iter().map(|&v| v * (1.0 + 2f32.powi(-8))).collect();
        let lse = vec![r.lse[0] as f32];
        let v = verify(&p, &o, &lse, &r, &tol);
        assert!(v.passed, "{:?}", v.failures);
        // f32 runs keep the fixed relative bounds; the absolute ones scale with max |ref|.
        let f = Problem { dtype: Dtype::F32, ..p };
        let t = tolerance_for(&f, &x, &r);
        let fixed = Dtype::F32.tolerance();
        assert_eq!((t.rel_rms, t.lse_rel_rms), (fixed.rel_rms, fixed.lse_rel_rms));
        let max_v = x.v.iter().fold(0f64, |a, &v| a.max(v.abs() as f64));
        assert_eq!(t.max_abs, fixed.max_abs * max_v.max(1.0));
        assert_eq!(t.lse_max_abs, fixed.lse_max_abs * r.lse[0].abs().max(1.0));
    }

    pub fn f32_absolute_bounds_scale_with_magnitude() {
        // A large softmax scale puts LSE in the hundreds: an error of a few f32 ulps of LSE
        // (here 2^-21 relative) must pass, an error of 1e-3 relative must not.
        let p =
            Problem { batch: 1, heads: 1, seq_q: 8, seq_kv: 8, head_dim: 64, scale: Some(50.0), ..Problem::default() };
        let x = Qkv::random(&p, 3);
        let r = reference(&p, &x, &RowSelection::All);
        let tol = tolerance_for(&p, &x, &r);
        assert!(r.lse.iter().any(|l| l.abs() > 100.0), "{:?}", r.lse);
        let o: Vec<f32> = r.o.iter().map(|&v| v as f32).collect();
        let near: Vec<f32> = r.lse.iter().map(|&l| (l * (1.0 + 2f64.powi(-21))) as f32).collect();
        assert!(verify(&p, &o, &near, &r, &tol).passed);
        let far: Vec<f32> = r.lse.iter().map(|&l| (l * (1.0 + 1e-3)) as f32).collect();
        assert!(!verify(&p, &o, &far, &r, &tol).passed);
        // The fixed bound alone would have failed the near result.
        assert!(!verify(&p, &o, &near, &r, &Dtype::F32.tolerance()).passed);
    }

    /// The relative bounds grow with the scores: `8 · 2^-24 · (max |lse| + ln seq_kv)` (a known
    /// answer), at least the fixed 1e-5 at the default scale; an O perturbed by what the scores'
    /// rounding allows passes at a large scale, one 10x beyond it does not.
    pub fn f32_relative_bounds_grow_with_the_scores() {
        let e = f32_score_rounding(&[100.0, f64::NEG_INFINITY, -3.0], 1);
        assert!((e - 800.0 * 2f64.powi(-24)).abs() < 1e-15, "{e}");
        // One head: the reference rows are in O's order.
        let p = Problem { batch: 1, heads: 1, seq_q: 40, seq_kv: 70, head_dim: 64, ..Problem::default() };
        let x = Qkv::random(&p, 5);
        let r = reference(&p, &x, &RowSelection::All);
        assert_eq!(tolerance_for(&p, &x, &r).rel_rms, 1e-5, "the default scale keeps the fixed bound");
        let p = Problem { scale: Some(10.0), ..p };
        let r = reference(&p, &x, &RowSelection::All);
        let tol = tolerance_for(&p, &x, &r);
        let e = f32_score_rounding(&r.lse, p.seq_kv);
        assert!(e > 1e-5 && tol.rel_rms == e && tol.row_rel_rms == e, "{e} {tol:?}");
        // Every element off by the relative amount f (alternating sign): passes at half the
        // bound, fails at 10x it.
        let nudged = |f: f64| -> Vec<f32> {
            r.o.iter().enumerate().map(|(i, &v)| (v * (1.0 + if i % 2 == 0 { f } else { -f })) as f32).collect()
        };
        let lse: Vec<f32> = r.lse.iter().map(|&l| l as f32).collect();
        let v = verify(&p, &nudged(0.5 * e), &lse, &r, &tol);
        assert!(v.passed, "{:?} {e}", v.failures);
        assert!(!verify(&p, &nudged(10.0 * e), &lse, &r, &tol).passed);
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod underflow_tests {
    use super::*;
    use crate::inputs::Qkv;
    use crate::reference::{reference, RowSelection};

    /// Sinks far above the scores: the keys' weights (about e^-100 and e^-300) underflow in
    /// f32, so a correct kernel writes O = 0 while the reference is about 1e-44 or exactly 0. That
    /// passes, on every row and the whole tensor; an O wrong by more than the underflowed part
    /// (here 1e-30, far below any f32 rounding of an ordinary row) does not.
    pub fn a_correct_underflow_to_zero_passes_and_a_wrong_value_does_not() {
        let p = Problem { batch: 1, heads: 2, seq_q: 4, seq_kv: 6, head_dim: 8, sinks: true, ..Problem::default() };
        let mut x = Qkv::random(&p, 5);
        x.sinks = vec![100.0, 300.0];
        let r = reference(&p, &x, &RowSelection::All);
        let tol = tolerance_for(&p, &x, &r);
        assert!(r.o.iter().any(|&w| w != 0.0 && w.abs() < 1e-40), "head 0's O underflows in f32 only");
        let zero = vec![0f32; p.q_elems() as usize];
        let mut lse = vec![0f32; p.rows() as usize];
        for (k, row) in r.rows.iter().enumerate() {
            lse[((row.b * p.heads + row.h) * p.seq_q + row.i) as usize] = r.lse[k] as f32;
        }
        let v = verify(&p, &zero, &lse, &r, &tol);
        assert!(v.passed, "{:?}", v.failures);
        let mut off = zero.clone();
        off[3] = 1e-30;
        let v = verify(&p, &off, &lse, &r, &tol);
        assert!(!v.passed, "an error beyond the underflowed part passed");
        // Ordinary sinks: no key's weight is near underflow, and the allowance is 0.
        x.sinks = vec![0.5, -1.0];
        let r = reference(&p, &x, &RowSelection::All);
        assert!(r.o_under.iter().all(|&u| u == 0.0));
        assert!(!verify(&p, &zero, &lse, &r, &tolerance_for(&p, &x, &r)).passed);
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod row_local_tests {
    use super::*;
    use crate::inputs::Qkv;
    use crate::reference::{reference, RowSelection};

    /// Device-shaped O and LSE from per-row values.
    fn place(p: &Problem, r: &Reference, o_rows: &[f64]) -> (Vec<f32>, Vec<f32>) {
        let d = p.head_dim as usize;
        let mut o = vec![0f32; p.q_elems() as usize];
        let mut lse = vec![0f32; p.rows() as usize];
        for (k, row) in r.rows.iter().enumerate() {
            let base = ((row.b * p.seq_q + row.i) * p.heads + row.h) as usize * d;
            for dd in 0..d {
                o[base + dd] = o_rows[k * d + dd] as f32;
            }
            lse[((row.b * p.heads + row.h) * p.seq_q + row.i) as usize] = r.lse[k] as f32;
        }
        (o, lse)
    }

    pub fn one_large_head_does_not_hide_the_errors_of_the_others() {
        // Head 0 has V 10^4 times larger than heads 1..3. A result exact on head 0 and 1 % wrong
        // on the other heads has a whole-tensor relative RMS error of ~2e-6 (under the f32 bound
        // of 1e-5) and a max abs error far under 1e-4 * max|ref|: only row-local bounds fail it.
        let p = Problem { batch: 1, heads: 4, seq_q: 9, seq_kv: 13, head_dim: 8, ..Problem::default() };
        let mut x = Qkv::random(&p, 11);
        let d = p.head_dim as usize;
        for (e, v) in x.v.iter_mut().enumerate() {
            if (e / d).is_multiple_of(p.heads as usize) {
                *v *= 1e4;
            }
        }
        let r = reference(&p, &x, &RowSelection::All);
        let tol = tolerance_for(&p, &x, &r);
        let wrong: Vec<f64> =
            r.o.iter().enumerate().map(|(e, &w)| if r.rows[e / d].h == 0 { w } else { w * 1.01 }).collect();
        let (o, lse) = place(&p, &r, &wrong);
        let v = verify(&p, &o, &lse, &r, &tol);
        assert!(v.o.rel_rms_err < tol.rel_rms, "the whole-tensor bound alone would pass: {}", v.o.rel_rms_err);
        assert!(v.o.max_abs_err < tol.max_abs, "{} {}", v.o.max_abs_err, tol.max_abs);
        assert!(!v.passed, "a 1 % error on three heads passed");
        let worst = v.worst_row.unwrap();
        assert_ne!(worst.row.h, 0);
        assert!(worst.rel_rms_err > 1e-3 && v.failures.iter().any(|f| f.contains("row (batch 0, head")), "{v:?}");
        // The exact result passes, and so does one off by a few f32 ulps on every row.
        let near: Vec<f64> = r.o.iter().map(|&w| w * (1.0 + 3e-7)).collect();
        let (o, lse) = place(&p, &r, &near);
        let v = verify(&p, &o, &lse, &r, &tol);
        assert!(v.passed, "{:?}", v.failures);
        assert!(v.worst_row.unwrap().bound_ratio < 0.1);
    }

    pub fn row_scale_is_the_magnitude_of_the_values_averaged() {
        // One query, two keys with equal scores: O = (v0 + v1) / 2 = 0 when v1 = -v0, but the
        // rounding error scales with |v|, so the row's scale is (|v0| + |v1|) / 2 = 3.
        let p =
            Problem { batch: 1, heads: 1, seq_q: 1, seq_kv: 2, head_dim: 1, scale: Some(1.0), ..Problem::default() };
        let x = Qkv { q: vec![0.0], k: vec![1.0, 2.0], v: vec![3.0, -3.0], ..Qkv::default() };
        let r = reference(&p, &x, &RowSelection::All);
        assert_eq!(r.o[0], 0.0);
        assert_eq!(r.o_abs[0], 3.0);
        let (rel, abs, lse) = row_errors(&[3e-6], r.lse[0] as f32, &r, 0, 1);
        assert!((rel - 1e-6).abs() < 1e-12 && (abs - 1e-6).abs() < 1e-12, "{rel} {abs}");
        assert!(lse < 1e-7);
        // A row of scale 0 must match exactly.
        let x0 = Qkv { q: vec![0.0], k: vec![1.0, 2.0], v: vec![0.0, 0.0], ..Qkv::default() };
        let r0 = reference(&p, &x0, &RowSelection::All);
        assert_eq!(row_errors(&[0.0], r0.lse[0] as f32, &r0, 0, 1).0, 0.0);
        assert_eq!(row_errors(&[1e-30], r0.lse[0] as f32, &r0, 0, 1).0, f64::INFINITY);
    }
}
