//! The bound of a 16-bit backward: FlashAttention's rule for bf16/f16 gradients. Each gradient's
//! error against the f64 reference ([`crate::reference::grad`]) may be at most twice the error of
//! a *naive* backward computed in the same dtype on the same inputs, never less than a small
//! floor ([`check_against_baseline`]); the whole tensor and every row on its own.
//!
//! [`naive_backward_in_dtype`] is that naive backward, written the way a plain 16-bit pipeline
//! (materialised P, autograd through softmax) rounds its intermediates, per query row of each head:
//!
//! 1. the inputs q, k, v, dO rounded to the dtype;
//! 2. scores `s_j = scale · (q · k_j)` in f32 (soft cap: `c · tanh(scale · q·k_j / c)`), softmax
//!    in f32 with the sink in the denominator: `m`, `l`, `LSE = m + ln l`;
//! 3. `P_j = exp(s_j − m) / l` rounded to the dtype (the matrix a 16-bit pipeline materialises);
//! 4. `O = Σ P_j v_j` accumulated in f32, rounded to the dtype;
//! 5. `dP_j = dO · v_j` accumulated in f32, rounded to the dtype (the output of the dO·Vᵀ matmul);
//! 6. `D = Σ_j P_j dP_j` in f32 (softmax's backward over the rounded P and dP), and
//!    `dS_j = P_j (dP_j − D) · ds_j/dx_j` in f32, rounded to the dtype (the operand of the dQ and
//!    dK matmuls);
//! 7. `dV_j += P_j dO`, `dQ += dS_j k_j`, `dK_j += dS_j q` accumulated in f32 (over every row
//!    and, with GQA, every query head of the group), each rounded to the dtype once at the end;
//!    `d_sink[h] = −Σ_rows P_sink · D` in f32 (sinks are f32 whatever the dtype).
//!
//! A row that sees no key (no sink) has O = 0, LSE = −inf and no gradient.

use crate::dtype::Dtype;
use crate::problem::Problem;

/// Output of [`naive_backward_in_dtype`], laid out as [`crate::reference::grad::Grads`]: `o`,
/// `dq` like q, `dk`, `dv` like k (values of the dtype), `lse` `[batch, heads, seq_q]` (varlen
/// `[heads, total_q]`, f32), `dsinks` `[heads]` (f32, empty without sinks).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NaiveGrads {
    /// O, like q (values of the dtype).
    pub o: Vec<f32>,
    /// LSE, `[batch, heads, seq_q]` (varlen `[heads, total_q]`), f32.
    pub lse: Vec<f32>,
    /// dq, like q (values of the dtype).
    pub dq: Vec<f32>,
    /// dk, like k (values of the dtype).
    pub dk: Vec<f32>,
    /// dv, like v (values of the dtype).
    pub dv: Vec<f32>,
    /// The sinks' gradient, `[heads]` f32 (empty without sinks).
    pub dsinks: Vec<f32>,
}

/// The naive backward of `Σ dO ∘ O` in `p.dtype` (see the module documentation), from f32 host
/// tensors shaped as the reference takes them (BSHD or packed varlen; `sinks` `[heads]` when
/// `p.sinks`). With `p.dtype == F32` nothing is rounded: an f32 naive backward. An input of the
/// wrong length is an error naming it.
pub fn naive_backward_in_dtype(
    p: &Problem,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d_o: &[f32],
    sinks: &[f32],
) -> Result<NaiveGrads, String> {
    for (name, got, want) in [
        ("q", q.len(), p.q_elems()),
        ("k", k.len(), p.kv_elems()),
        ("v", v.len(), p.kv_elems()),
        ("d_o", d_o.len(), p.q_elems()),
    ] {
        if got as u64 != want {
            return Err(format!("{name} has {got} elements, the problem's shape needs {want}"));
        }
    }
    if p.sinks && sinks.len() != p.heads as usize {
        return Err(format!("{} sink logits for {} heads (one per head)", sinks.len(), p.heads));
    }
    let dt = p.dtype;
    let rounded = |x: &[f32]| -> Vec<f32> { x.iter().map(|&a| dt.round(a)).collect() };
    let (q, k, v, d_o) = (rounded(q), rounded(k), rounded(v), rounded(d_o));
    let (hh, hk, d) = (p.heads as usize, p.kv_heads() as usize, p.head_dim as usize);
    let group = (hh / hk.max(1)).max(1);
    let scale = p.softmax_scale();
    let cap = p.softcap;

    let mut o = vec![0f32; q.len()];
    let mut lse = vec![f32::NEG_INFINITY; p.rows() as usize];
    let mut dq = vec![0f32; q.len()];
    let (mut dk, mut dv) = (vec![0f32; k.len()], vec![0f32; v.len()]);
    let mut dsinks = vec![0f32; if p.sinks { hh } else { 0 }];
    // Per row: the visible keys' index, score, derivative of the score, P and dP.
    let mut keys: Vec<(usize, f32, f32)> = Vec::new();
    let (mut pr, mut dp) = (Vec::new(), Vec::new());
    let mut acc = vec![0f32; d];
    for b in 0..p.batch {
        let (sq, sk) = p.seq_lens(b);
        let k0 = p.kv_row(b, 0) as usize;
        for h in 0..hh {
            let kh = h / group;
            let sink = if p.sinks { sinks[h] } else { f32::NEG_INFINITY };
            for i in 0..sq {
                let at = (p.q_row(b, i) as usize * hh + h) * d;
                let qrow = &q[at..at + d];
                keys.clear();
                for j in 0..sk {
                    if !crate::reference::visible_in(p, sq, sk, i, j) {
                        continue;
                    }
                    let kat = ((k0 + j as usize) * hk + kh) * d;
                    let x: f32 = qrow.iter().zip(&k[kat..kat + d]).map(|(a, c)| a * c).sum();
                    let (s, ds) = if cap > 0.0 {
                        let t = (scale * x / cap).tanh();
                        (cap * t, scale * (1.0 - t * t))
                    } else {
                        (scale * x, scale)
                    };
                    keys.push((kat, s, ds));
                }
                let m = keys.iter().fold(sink, |m, &(_, s, _)| m.max(s));
                if m == f32::NEG_INFINITY {
                    continue; // no key and no sink: O = 0, LSE = -inf, no gradient
                }
                let l = (sink - m).exp() + keys.iter().map(|&(_, s, _)| (s - m).exp()).sum::<f32>();
                lse[p.lse_index(b, h as u32, i) as usize] = m + l.ln();
                pr.clear();
                pr.extend(keys.iter().map(|&(_, s, _)| dt.round((s - m).exp() / l)));
                acc.fill(0.0);
                for (&(kat, ..), &pj) in keys.iter().zip(&pr) {
                    for (a, &vv) in acc.iter_mut().zip(&v[kat..kat + d]) {
                        *a += pj * vv;
                    }
                }
                for (dst, &a) in o[at..at + d].iter_mut().zip(&acc) {
                    *dst = dt.round(a);
                }
                let dorow = &d_o[at..at + d];
                dp.clear();
                dp.extend(
                    keys.iter().map(|&(kat, ..)| {
                        dt.round(dorow.iter().zip(&v[kat..kat + d]).map(|(a, c)| a * c).sum::<f32>())
                    }),
                );
                // The sink has no value vector: its dP is 0, so it adds nothing to D.
                let delta: f32 = pr.iter().zip(&dp).map(|(a, c)| a * c).sum();
                if p.sinks {
                    dsinks[h] -= (sink - m).exp() / l * delta;
                }
                acc.fill(0.0);
                for ((&(kat, _, dsdx), &pj), &dpj) in keys.iter().zip(&pr).zip(&dp) {
                    let ds = dt.round(pj * (dpj - delta) * dsdx);
                    let (krow, dkrow) = (&k[kat..kat + d], &mut dk[kat..kat + d]);
                    for c in 0..d {
                        acc[c] += ds * krow[c];
                        dkrow[c] += ds * qrow[c];
                    }
                    for (g, &x) in dv[kat..kat + d].iter_mut().zip(dorow) {
                        *g += pj * x;
                    }
                }
                dq[at..at + d].copy_from_slice(&acc);
            }
        }
    }
    for t in [&mut o, &mut dq, &mut dk, &mut dv] {
        dt.round_all(t);
    }
    Ok(NaiveGrads { o, lse, dq, dk, dv, dsinks })
}

/// Floor of the scale a tensor's and a row's errors are measured against, as a fraction of the
/// tensor's largest reference magnitude: an all-zero tensor or row (a masked row's dq, the dk of
/// keys no query sees) is held to `1e-3 · max|ref|`, not to 0, so rounding noise on it is not an
/// infinite relative error.
pub const SCALE_FLOOR: f64 = 1e-3;

/// One tensor judged by the 2× rule ([`check_against_baseline`]).
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct BaselineCheck {
    /// The tensor's name.
    pub tensor: &'static str,
    /// `max |got − ref|` over the whole tensor (finite elements).
    pub max_abs_err: f64,
    /// The same for the naive-in-dtype baseline.
    pub baseline_max_abs_err: f64,
    /// `max(2 · baseline_max_abs_err, floor · scale)`.
    pub bound: f64,
    /// `max(max |ref|, max magnitude, 1e-3)`: the tensor's scale.
    pub scale: f64,
    /// The worst row's `max |got_r − ref_r| / scale_r` (`scale_r = max(max |ref_r|, max
    /// magnitude_r, 1e-3 · scale)`), and which row (in the tensor's row order: `[.., heads, d]` rows of `row_len`).
    pub worst_row_err: f64,
    /// The index of that worst row.
    pub worst_row: usize,
    /// The baseline's worst row by the same measure.
    pub baseline_worst_row_err: f64,
    /// `max(2 · baseline_worst_row_err, floor)`: every row's bound.
    pub row_bound: f64,
    /// Rows over `row_bound`.
    pub rows_over: u64,
    /// Elements that are NaN or infinite where the reference is finite, or that disagree on an
    /// infinity (LSE's −inf of a row that sees no key); a poisoned element that was not written
    /// is one.
    pub mismatched_non_finite: u64,
    /// `max_abs_err <= bound`, no row over `row_bound` and no mismatched non-finite element.
    pub passed: bool,
}

/// The largest finite magnitude of `want` and of `magnitude` (empty: none), at least `floor`.
pub fn scale_of(want: &[f64], magnitude: &[f64], floor: f64) -> f64 {
    want.iter().chain(magnitude).filter(|a| a.is_finite()).fold(floor, |m, a| m.max(a.abs()))
}

/// Max error of `x` against `want` per row of `row_len` and over the whole tensor, with the
/// count of non-finite mismatches: `(max abs err, per-row err / row scale, non-finite)`.
fn errors(x: &[f32], want: &[f64], magnitude: &[f64], row_len: usize, scale: f64) -> (f64, Vec<f64>, u64) {
    let mut bad = (x.len() != want.len()) as u64;
    let n = row_len.max(1);
    let (mut max_err, mut rows) = (0f64, Vec::with_capacity(want.len() / n));
    for (r, (g, w)) in x.chunks(n).zip(want.chunks(n)).enumerate() {
        let m = magnitude.get(r * n..(r + 1) * n).unwrap_or(&[]);
        let row_scale = scale_of(w, m, SCALE_FLOOR * scale);
        let mut row_err = 0f64;
        for (&g, &w) in g.iter().zip(w) {
            let g = g as f64;
            if !g.is_finite() || !w.is_finite() {
                bad += (g != w) as u64;
                continue;
            }
            row_err = row_err.max((g - w).abs());
        }
        max_err = max_err.max(row_err);
        rows.push(row_err / row_scale);
    }
    (max_err, rows, bad)
}

/// FlashAttention's 2× rule for one tensor: `got` (the kernel's) and `baseline` (the naive
/// backward in the same dtype, [`naive_backward_in_dtype`]) against the f64 `reference`, all in
/// the same layout, rows of `row_len` contiguous elements (`head_dim` for O and the gradients, 1
/// for LSE and d_sinks). `magnitude` (like `reference`, or empty) is the size of the terms each
/// element sums ([`crate::reference::grad::Grads::dq_abs`]): where the exact value cancels to 0,
/// it keeps the scale at the size of the rounding. It passes when there is no non-finite
/// mismatch and
///
/// - the whole tensor: `max |got − ref| ≤ max(2 · max |baseline − ref|, floor · scale)`, and
/// - every row `r`: `max |got_r − ref_r| / scale_r ≤ max(2 · (the baseline's worst such row),
///   ROW_FLOOR · floor)` ([`ROW_FLOOR`]),
///
/// with `scale = max(max |ref|, max magnitude, 1e-3)` and `scale_r = max(max |ref_r|, max
/// magnitude_r, 1e-3 · scale)`. `floor`
/// is relative: the dtype's unit roundoff for a tensor in that dtype (what rounding an exact
/// value to it costs: it keeps a baseline that happens to be exact, one key per row, from
/// failing a correctly rounded result), an f32 bound for the f32 tensors (LSE, d_sinks). The row bound is the
/// baseline's *worst* row doubled, as the forward's row bound is ([`super::tolerance_for`]): a
/// row's own error is a few elements' rounding, too noisy to hold each row to its naive twin.
///
/// ```
/// use memattn::verify::grad::check_against_baseline;
/// // Two rows of two; the baseline is off by 1e-3 at most, the kernel by 1.5e-3: it passes
/// // (bound max(2e-3, 2^-8 · 1)); off by 5e-3, it fails.
/// let reference = [1.0, -0.5, 0.25, 0.0];
/// let baseline = [1.001, -0.5, 0.25, 0.0];
/// let u = 2f64.powi(-8);
/// assert!(check_against_baseline("dq", &[1.0015, -0.5, 0.25, 0.0], &reference, &baseline, &[], 2, u).passed);
/// assert!(!check_against_baseline("dq", &[1.0, -0.5, 0.25, 0.005], &reference, &baseline, &[], 2, u).passed);
/// ```
pub fn check_against_baseline(
    tensor: &'static str,
    got: &[f32],
    reference: &[f64],
    baseline: &[f32],
    magnitude: &[f64],
    row_len: usize,
    floor: f64,
) -> BaselineCheck {
    let scale = scale_of(reference, magnitude, SCALE_FLOOR);
    let (max_abs_err, rows, bad) = errors(got, reference, magnitude, row_len, scale);
    let (base_err, base_rows, _) = errors(baseline, reference, magnitude, row_len, scale);
    let worst = |r: &[f64]| r.iter().enumerate().fold((0usize, 0f64), |w, (i, &e)| if e > w.1 { (i, e) } else { w });
    let (worst_row, worst_row_err) = worst(&rows);
    let baseline_worst_row_err = worst(&base_rows).1;
    let bound = (2.0 * base_err).max(floor * scale);
    let row_bound = (2.0 * baseline_worst_row_err).max(ROW_FLOOR * floor);
    let rows_over = rows.iter().filter(|&&e| e > row_bound).count() as u64;
    BaselineCheck {
        tensor,
        max_abs_err,
        baseline_max_abs_err: base_err,
        bound,
        scale,
        worst_row_err,
        worst_row,
        baseline_worst_row_err,
        row_bound,
        rows_over,
        mismatched_non_finite: bad,
        passed: bad == 0 && max_abs_err <= bound && rows_over == 0,
    }
}

/// The row bound's floor in units of `floor`: 4. A FlashAttention-style kernel computes
/// `D = rowsum(dO ∘ O)` from the 16-bit O of its forward, the naive backward `D = Σ P dP` from its
/// rounded P and dP. Where a row's exact gradient cancels (a row that sees one key: `dS = P (dP −
/// D)` is exactly 0), the naive's cancels exactly too and the kernel's keeps the rounding of O,
/// a few unit roundoffs of the row's terms; so a row is held to 4 u at least. A row off by 1 %
/// (5 u in bf16) still fails.
pub const ROW_FLOOR: f64 = 4.0;

/// The relative floor of [`check_against_baseline`] for a tensor of `dtype`: its unit roundoff
/// (2^-8 bf16, 2^-11 f16); for f32 tensors of a 16-bit run (LSE, d_sinks) `f32_floor`.
pub fn floor_of(dtype: Dtype, f32_floor: f64) -> f64 {
    if dtype.is_16bit() {
        dtype.unit_roundoff()
    } else {
        f32_floor
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;
    use crate::reference::grad::{attention_backward, Grads};
    use crate::rng::SplitMix64;

    fn draw(n: u64, dt: Dtype, rng: &mut SplitMix64) -> Vec<f32> {
        (0..n).map(|_| dt.round(rng.normal() as f32)).collect()
    }

    struct Case {
        p: Problem,
        x: [Vec<f32>; 4],
        sinks: Vec<f32>,
    }

    fn case(p: Problem, seed: u64) -> Case {
        let mut rng = SplitMix64::new(seed);
        let dt = p.dtype;
        let x = [
            draw(p.q_elems(), dt, &mut rng),
            draw(p.kv_elems(), dt, &mut rng),
            draw(p.kv_elems(), dt, &mut rng),
            draw(p.q_elems(), dt, &mut rng),
        ];
        let sinks = if p.sinks { draw(p.heads as u64, Dtype::F32, &mut rng) } else { vec![] };
        Case { p, x, sinks }
    }

    fn naive(c: &Case) -> NaiveGrads {
        naive_backward_in_dtype(&c.p, &c.x[0], &c.x[1], &c.x[2], &c.x[3], &c.sinks).unwrap()
    }

    fn reference(c: &Case) -> Grads {
        attention_backward(&c.p, &c.x[0], &c.x[1], &c.x[2], &c.x[3], &c.sinks).unwrap()
    }

    /// Max |a − b| over max(max |b|, 1e-3), NaN-propagating.
    fn rel(a: &[f32], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        let scale = b.iter().filter(|x| x.is_finite()).fold(1e-3f64, |m, x| m.max(x.abs()));
        a.iter().zip(b).fold(0f64, |m, (&x, &y)| {
            if y.is_finite() {
                let e = (x as f64 - y).abs();
                if e.is_nan() || m.is_nan() {
                    f64::NAN
                } else {
                    m.max(e)
                }
            } else {
                assert_eq!(x as f64, y, "an infinity must match");
                m
            }
        }) / scale
    }

    fn every_option() -> Vec<(&'static str, Problem)> {
        let base = Problem { batch: 1, heads: 2, seq_q: 9, seq_kv: 13, head_dim: 16, ..Problem::default() };
        let varlen = Problem::varlen(
            Problem { heads: 4, heads_kv: Some(2), causal: true, sinks: true, ..base },
            &[5, 0, 9],
            &[3, 4, 12],
        )
        .unwrap();
        vec![
            ("plain, two batches", Problem { batch: 2, ..base }),
            ("causal, seq_q > seq_kv: fully masked rows", Problem { causal: true, seq_q: 13, seq_kv: 6, ..base }),
            ("GQA, window, soft cap", Problem { heads: 4, heads_kv: Some(1), window: (3, 2), softcap: 2.0, ..base }),
            ("sinks, causal", Problem { sinks: true, causal: true, seq_q: 15, seq_kv: 7, ..base }),
            ("varlen, empty sequence, sinks", varlen),
        ]
    }

    pub fn in_f32_it_is_the_reference_to_f32_accuracy() {
        // Rounding to f32 is the identity, so the naive backward is an independent f32
        // implementation of the same gradients: it must match the f64 reference to f32 accuracy
        // on every option (a wrong D, GQA sum or sink term would be off by 1e-2 or more).
        for (seed, (what, p)) in every_option().into_iter().enumerate() {
            let c = case(p, seed as u64 + 1);
            let (n, r) = (naive(&c), reference(&c));
            for (name, a, b) in [
                ("o", &n.o, &r.o),
                ("lse", &n.lse, &r.lse),
                ("dq", &n.dq, &r.dq),
                ("dk", &n.dk, &r.dk),
                ("dv", &n.dv, &r.dv),
                ("dsinks", &n.dsinks, &r.dsinks),
            ] {
                let e = rel(a, b);
                assert!(e < 2e-6, "{what}: {name} relative error {e:.3e}");
            }
        }
    }

    pub fn in_bf16_and_f16_it_costs_what_16_bit_rounding_costs() {
        // Rounding P, dP, dS and the outputs to the dtype (u = 2^-8 bf16, 2^-11 f16) costs about
        // u relative; LSE and d_sinks stay f32-accurate in the row sums they come from, but d_sinks
        // is computed from the rounded P and dP, so it carries their error too.
        for dt in [Dtype::Bf16, Dtype::F16] {
            let u = dt.unit_roundoff();
            for (seed, (what, p)) in every_option().into_iter().enumerate() {
                let c = case(Problem { dtype: dt, ..p }, seed as u64 + 10);
                let (n, r) = (naive(&c), reference(&c));
                for (name, a, b) in
                    [("o", &n.o, &r.o), ("dq", &n.dq, &r.dq), ("dk", &n.dk, &r.dk), ("dv", &n.dv, &r.dv)]
                {
                    let e = rel(a, b);
                    assert!(e > 0.1 * u && e < 40.0 * u, "{dt} {what}: {name} relative error {e:.3e} (u {u:.1e})");
                }
                assert!(rel(&n.lse, &r.lse) < 1e-5, "{dt} {what}: lse");
                if !r.dsinks.is_empty() {
                    assert!(rel(&n.dsinks, &r.dsinks) < 40.0 * u, "{dt} {what}: dsinks");
                }
                // A row that sees nothing has no gradient, exactly.
                for (e, w) in n.dq.iter().zip(&r.dq) {
                    if *w == 0.0 {
                        assert_eq!(*e, 0.0, "{dt} {what}");
                    }
                }
            }
        }
    }

    pub fn wrong_lengths_are_named() {
        let c = case(every_option()[0].1, 1);
        let e = naive_backward_in_dtype(&c.p, &c.x[0], &c.x[1], &c.x[2], &c.x[3][1..], &[]).unwrap_err();
        assert!(e.contains("d_o"), "{e}");
        let p = Problem { sinks: true, ..c.p };
        let e = naive_backward_in_dtype(&p, &c.x[0], &c.x[1], &c.x[2], &c.x[3], &[0.0]).unwrap_err();
        assert!(e.contains("sink"), "{e}");
    }

    /// `reference` with each element's error against it scaled by `f`.
    fn scaled_error(baseline: &[f32], reference: &[f64], f: f64) -> Vec<f32> {
        baseline.iter().zip(reference).map(|(&b, &r)| (r + f * (b as f64 - r)) as f32).collect()
    }

    pub fn the_2x_rule_passes_a_good_16_bit_result_and_fails_a_bad_one() {
        let p = Problem { dtype: Dtype::Bf16, ..every_option()[2].1 };
        let c = case(p, 4);
        let (n, r) = (naive(&c), reference(&c));
        let (u, d) = (Dtype::Bf16.unit_roundoff(), p.head_dim as usize);
        for (name, base, want) in [("dq", &n.dq, &r.dq), ("dk", &n.dk, &r.dk), ("dv", &n.dv, &r.dv)] {
            // The baseline itself passes (ratio 1), and so does the exact gradient rounded to
            // bf16 once (what a kernel that accumulates in f32 writes).
            assert!(check_against_baseline(name, base, want, base, &[], d, u).passed, "{name}");
            let rounded: Vec<f32> = want.iter().map(|&w| Dtype::Bf16.round(w as f32)).collect();
            let c = check_against_baseline(name, &rounded, want, base, &[], d, u);
            assert!(c.passed, "{name}: {c:?}");
            // Six times the baseline's error, everywhere: over the bound (three times can stay
            // under the floor `u · scale` in bf16).
            let c = check_against_baseline(name, &scaled_error(base, want, 6.0), want, base, &[], d, u);
            assert!(!c.passed && c.max_abs_err > c.bound && c.rows_over > 0, "{name}: {c:?}");
            // One unwritten (NaN-poisoned) element.
            let mut poisoned = base.clone();
            poisoned[7] = f32::NAN;
            let c = check_against_baseline(name, &poisoned, want, base, &[], d, u);
            assert!(!c.passed && c.mismatched_non_finite == 1, "{name}: {c:?}");
        }
        // A tensor of the wrong length fails.
        assert!(!check_against_baseline("dq", &n.dq[1..], &r.dq, &n.dq, &[], d, u).passed);
    }

    pub fn a_wrong_small_row_fails_though_the_whole_tensor_passes() {
        // dO of head 0 is 128x that of head 1 (a power of two: still exact in bf16), and dq is linear in dO: head 0's rows dominate
        // dq's max. A row of head 1 10 % wrong stays under the whole-tensor bound but not under
        // the row bound.
        let p = Problem { dtype: Dtype::Bf16, heads: 2, seq_q: 8, seq_kv: 8, head_dim: 16, ..Problem::default() };
        let mut c = case(p, 6);
        let d = 16;
        for (e, g) in c.x[3].iter_mut().enumerate() {
            if (e / d).is_multiple_of(2) {
                *g *= 128.0;
            }
        }
        let (n, r) = (naive(&c), reference(&c));
        let mut got: Vec<f32> = r.dq.iter().map(|&w| Dtype::Bf16.round(w as f32)).collect();
        // The smallest row (by its largest value).
        let row_max = |i: usize| r.dq[i * d..(i + 1) * d].iter().fold(0f64, |m, x| m.max(x.abs()));
        let rows = r.dq.len() / d;
        let small = (0..rows).min_by(|&a, &b| row_max(a).total_cmp(&row_max(b))).unwrap();
        let big = (0..rows).map(row_max).fold(0f64, f64::max);
        assert!(row_max(small) < 0.05 * big, "{} vs {big}", row_max(small));
        for x in &mut got[small * d..(small + 1) * d] {
            *x *= 1.1;
        }
        let u = Dtype::Bf16.unit_roundoff();
        let ch = check_against_baseline("dq", &got, &r.dq, &n.dq, &[], d, u);
        assert!(ch.max_abs_err <= ch.bound, "the whole-tensor bound alone would pass: {ch:?}");
        assert!(!ch.passed && ch.worst_row == small && ch.rows_over == 1, "{ch:?}");
    }

    pub fn where_the_exact_gradient_cancels_the_terms_set_the_scale() {
        // One query, one key: P = 1 and dP = D, so the exact dq and dk are 0, and so are the
        // naive backward's in bf16 (P rounds to 1, D = P dP). A kernel's dP - D is a difference
        // of two rounded sums: noise of 1e-6 of the terms' size must pass, measured against the
        // magnitude of the terms; against the 1e-3 floor alone it would not.
        let p = Problem { dtype: Dtype::Bf16, heads: 1, seq_q: 1, seq_kv: 1, head_dim: 16, ..Problem::default() };
        let c = case(p, 9);
        let (n, r) = (naive(&c), reference(&c));
        assert!(r.dq.iter().all(|&x| x == 0.0) && n.dq.iter().all(|&x| x == 0.0));
        let m = r.dq_abs.iter().fold(0f64, |a, &x| a.max(x));
        assert!(m > 0.1, "{m}");
        let noisy: Vec<f32> = r.dq_abs.iter().map(|&x| (1e-6 * x) as f32).collect();
        let u = Dtype::Bf16.unit_roundoff();
        assert!(check_against_baseline("dq", &noisy, &r.dq, &n.dq, &r.dq_abs, 16, u).passed);
        assert!(!check_against_baseline("dq", &noisy, &r.dq, &n.dq, &[], 16, u).passed);
        // A real error, 1 % of the terms, still fails.
        let wrong: Vec<f32> = r.dq_abs.iter().map(|&x| (1e-2 * x) as f32).collect();
        assert!(!check_against_baseline("dq", &wrong, &r.dq, &n.dq, &r.dq_abs, 16, u).passed);
    }

    pub fn lse_infinities_must_agree() {
        let want = [f64::NEG_INFINITY, 1.0];
        let base = [f32::NEG_INFINITY, 1.0];
        assert!(check_against_baseline("lse", &base, &want, &base, &[], 1, 2e-5).passed);
        assert!(!check_against_baseline("lse", &[0.0, 1.0], &want, &base, &[], 1, 2e-5).passed);
    }
}
