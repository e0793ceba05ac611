//! Verification of device outputs against the f64 reference.
//!
//! For O: max absolute error, max relative error and relative RMS error `‖o − ref‖ / ‖ref‖` over
//! the checked rows. For LSE: the same over finite reference values; a `-inf` reference (fully
//! masked row) must be exactly `-inf` on the device. Outputs are poisoned with NaN before every
//! launch, so any element the kernel did not write is NaN and fails the check (it is counted in
//! `unwritten`). Bounds per dtype: [`crate::dtype::Dtype::tolerance`].

use crate::dtype::Tolerance;
use crate::problem::Problem;
use crate::reference::Reference;
use serde::Serialize;

/// Error statistics of one tensor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ErrorStats {
    pub max_abs_err: f64,
    pub max_rel_err: f64,
    pub rel_rms_err: f64,
    /// Elements compared.
    pub compared: u64,
}

/// The result of comparing O and LSE with the reference.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Verification {
    pub passed: bool,
    pub o: ErrorStats,
    pub lse: ErrorStats,
    /// Checked elements still NaN (never written) or otherwise non-finite where the reference is
    /// finite.
    pub unwritten: u64,
    /// Rows whose reference LSE is `-inf` but the device's is not, or vice versa.
    pub lse_inf_mismatches: u64,
    pub checked_rows: u64,
    pub total_rows: u64,
    pub tolerance: Tolerance,
    /// Human reasons for a failure (empty when passed).
    pub failures: Vec<String>,
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
        let diff = (got - want).abs();
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

/// Compares device O (BSHD, f32) and LSE (`[batch, heads, seq_q]`, f32) with `reference`.
pub fn verify(p: &Problem, o: &[f32], lse: &[f32], reference: &Reference, tol: &Tolerance) -> Verification {
    let (hh, d, nq) = (p.heads as usize, p.head_dim as usize, p.seq_q as usize);
    let (mut oa, mut la) = (Acc::default(), Acc::default());
    let mut unwritten = 0u64;
    let mut inf_mismatch = 0u64;
    for (r, row) in reference.rows.iter().enumerate() {
        let (b, h, i) = (row.b as usize, row.h as usize, row.i as usize);
        let got = &o[((b * nq + i) * hh + h) * d..][..d];
        let want = &reference.o[r * d..(r + 1) * d];
        for (&g, &w) in got.iter().zip(want) {
            if !g.is_finite() {
                unwritten += 1;
                continue;
            }
            oa.add(g as f64, w);
        }
        let g = lse[(b * hh + h) * nq + i];
        let w = reference.lse[r];
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
    let within = |err: f64, bound: f64| err <= bound || approx::abs_diff_eq!(err, bound, epsilon = f64::EPSILON);
    if !within(os.rel_rms_err, tol.rel_rms) {
        failures.push(format!("O relative RMS error {:.3e} > {:.0e}", os.rel_rms_err, tol.rel_rms));
    }
    if !within(os.max_abs_err, tol.max_abs) {
        failures.push(format!("O max abs error {:.3e} > {:.0e}", os.max_abs_err, tol.max_abs));
    }
    if !within(ls.rel_rms_err, tol.lse_rel_rms) {
        failures.push(format!("LSE relative RMS error {:.3e} > {:.0e}", ls.rel_rms_err, tol.lse_rel_rms));
    }
    if !within(ls.max_abs_err, tol.lse_max_abs) {
        failures.push(format!("LSE max abs error {:.3e} > {:.0e}", ls.max_abs_err, tol.lse_max_abs));
    }
    if os.compared == 0 && unwritten == 0 {
        failures.push("no output element was compared".into());
    }
    Verification {
        passed: failures.is_empty(),
        o: os,
        lse: ls,
        unwritten,
        lse_inf_mismatches: inf_mismatch,
        checked_rows: reference.rows.len() as u64,
        total_rows: reference.total_rows,
        tolerance: *tol,
        failures,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;
    use crate::inputs::Qkv;
    use crate::reference::{reference, RowSelection};

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

    #[test]
    fn exact_copy_passes_and_masked_row_is_minus_inf() {
        let (p, r, o, lse) = setup();
        assert!(r.lse.contains(&f64::NEG_INFINITY)); // seq_q > seq_kv, causal: row 0 is empty
        let v = verify(&p, &o, &lse, &r, &Dtype::F32.tolerance());
        assert!(v.passed, "{:?}", v.failures);
        assert!(v.o.rel_rms_err < 1e-7 && v.o.compared == 30);
    }

    #[test]
    fn nan_unwritten_inf_and_wrong_values_fail() {
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
}
