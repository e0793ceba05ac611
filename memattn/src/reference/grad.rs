//! Reference gradients: the backward of attention, analytically in f64.
//!
//! For the loss `L = Σ dO ∘ O` (any upstream gradient `dO` shaped like `O`), with the forward of
//! `docs/semantics.md`, FlashAttention-2's conventions give, per query row `i` of head `h`:
//!
//! - `P_ij = exp(s_ij - LSE_i)` over the keys the row sees (LSE includes the sink, if any);
//! - `D_i = Σ_d dO_i ∘ O_i` (equal to `Σ_j P_ij dP_ij`);
//! - `dV_j += P_ij dO_i`, `dP_ij = dO_i · v_j`, `dS_ij = P_ij (dP_ij - D_i)`;
//! - with `x_ij = q_i · k_j` and `s = scale · x` (or, soft-capped, `s = c · tanh(scale · x / c)`,
//!   whose derivative is `scale · (1 - tanh²)`): `dQ_i += dS_ij s'(x_ij) k_j`,
//!   `dK_j += dS_ij s'(x_ij) q_i`;
//! - GQA: dK and dV of a K/V head are summed over the query heads that read it;
//! - sinks: `d_sink[h] = -Σ_i P_sink,i D_i` with `P_sink,i = exp(sink[h] - LSE_i)`;
//! - a row that sees no key (LSE = -inf) contributes nothing (with a sink it sees the sink only,
//!   `O = 0`, `D = 0`: nothing either).
//!
//! Next to dq and dk it sums the magnitudes of their terms ([`Grads::dq_abs`],
//! [`Grads::dk_abs`]), the scale their rounding error has: a row that sees a single key has
//! `dP = D` and so an exact dq of 0, but a kernel's `dP - D` is a difference of two rounded
//! sums.
//!
//! The forward here is its own f64 restatement (inputs in f64, so finite differences in f64 can
//! check the analytic gradients to 1e-6); its key rule is the reference's [`super::visible_in`].

use crate::problem::Problem;

/// Gradients of `Σ dO ∘ O`, plus the forward quantities they were computed from.
#[derive(Clone, Debug, PartialEq)]
pub struct Grads {
    /// Like q (BSHD, or packed `[total_q, heads, d]` with varlen).
    pub dq: Vec<f64>,
    /// Like k (`heads_kv` heads).
    pub dk: Vec<f64>,
    /// Like v.
    pub dv: Vec<f64>,
    /// One per query head (empty without sinks).
    pub dsinks: Vec<f64>,
    /// The forward's output, like q.
    pub o: Vec<f64>,
    /// The forward's LSE, `[batch, heads, seq_q]` (varlen `[heads, total_q]`), natural log.
    pub lse: Vec<f64>,
    /// `D = rowsum(dO ∘ O)`, laid out like `lse`.
    pub delta: Vec<f64>,
    /// The magnitude of the terms each element of dq sums, `Σ_j P_ij (|dP|_ij + |D|_i) |s'_ij|
    /// |k_j|` (like dq), with `|dP|_ij = Σ_c |dO_ic v_jc|` and `|D|_i = Σ_c |dO_ic O_ic|` the
    /// sizes of the products those dot products sum: the scale of its rounding error. Where the
    /// exact dq cancels to 0 (a row that sees one key: `dP = D`), this is not 0, and neither is
    /// any kernel's rounding error; a kernel that takes `D` from its 16-bit O (FlashAttention-2's
    /// preprocess) errs by up to `u |D|_i`, however small `D` itself is.
    pub dq_abs: Vec<f64>,
    /// The same for dk, `Σ_i P_ij (|dP|_ij + |D|_i) |s'_ij| |q_i|` (like dk).
    pub dk_abs: Vec<f64>,
    /// The same for d_sinks, `Σ_i exp(sink - LSE_i) |D|_i` (like d_sinks).
    pub dsinks_abs: Vec<f64>,
}

/// f64 inputs of one problem: `q` `[.., heads, d]`, `k`, `v` `[.., heads_kv, d]`, `sinks` `[heads]`.
#[derive(Clone, Copy, Debug)]
pub struct Inputs64<'a> {
    /// Q, `[.., heads, d]`.
    pub q: &'a [f64],
    /// K, `[.., heads_kv, d]`.
    pub k: &'a [f64],
    /// V, `[.., heads_kv, d]`.
    pub v: &'a [f64],
    /// One sink logit per query head (read only when the problem has sinks).
    pub sinks: &'a [f64],
}

/// Checks the lengths of the inputs against the problem.
fn check(p: &Problem, x: &Inputs64<'_>, d_o: Option<&[f64]>) -> Result<(), String> {
    let mut lens = vec![("q", x.q.len(), p.q_elems()), ("k", x.k.len(), p.kv_elems()), ("v", x.v.len(), p.kv_elems())];
    if let Some(d_o) = d_o {
        lens.push(("d_o", d_o.len(), p.q_elems()));
    }
    for (name, got, want) in lens {
        if got as u64 != want {
            return Err(format!("{name} has {got} elements, the problem's shape needs {want}"));
        }
    }
    if p.sinks && x.sinks.len() != p.heads as usize {
        return Err(format!("{} sink logits for {} heads (one per head)", x.sinks.len(), p.heads));
    }
    Ok(())
}

/// Scores of one row: `(s_j, ds_j/dx_j)` for every key of its sequence (`-inf`, 0 when masked).
fn row_scores(p: &Problem, x: &Inputs64<'_>, b: u32, h: usize, i: u32, out: &mut Vec<(f64, f64)>) {
    let (hh, d) = (p.heads as usize, p.head_dim as usize);
    let hk = p.kv_heads() as usize;
    let kh = h / (hh / hk.max(1)).max(1);
    let scale = p.softmax_scale() as f64;
    let cap = p.softcap as f64;
    let (sq, sk) = p.seq_lens(b);
    let q = &x.q[(p.q_row(b, i) as usize * hh + h) * d..][..d];
    let k0 = p.kv_row(b, 0) as usize;
    out.clear();
    for j in 0..sk {
        if !super::visible_in(p, sq, sk, i, j) {
            out.push((f64::NEG_INFINITY, 0.0));
            continue;
        }
        let k = &x.k[((k0 + j as usize) * hk + kh) * d..][..d];
        let dot: f64 = q.iter().zip(k).map(|(a, c)| a * c).sum();
        out.push(if cap > 0.0 {
            let t = (dot * scale / cap).tanh();
            (cap * t, scale * (1.0 - t * t))
        } else {
            (dot * scale, scale)
        });
    }
}

/// Every row of the problem as `(b, h, i)`.
fn all_rows(p: &Problem) -> impl Iterator<Item = (u32, usize, u32)> + '_ {
    (0..p.batch).flat_map(move |b| {
        let sq = p.seq_lens(b).0;
        (0..p.heads as usize).flat_map(move |h| (0..sq).map(move |i| (b, h, i)))
    })
}

/// The forward in f64: `(o, lse)`, laid out as [`Grads::o`] and [`Grads::lse`].
pub fn forward64(p: &Problem, x: &Inputs64<'_>) -> Result<(Vec<f64>, Vec<f64>), String> {
    check(p, x, None)?;
    let (hh, d) = (p.heads as usize, p.head_dim as usize);
    let hk = p.kv_heads() as usize;
    let kh_of = |h: usize| h / (hh / hk.max(1)).max(1);
    let mut o = vec![0.0; p.q_elems() as usize];
    let mut lse = vec![f64::NEG_INFINITY; p.rows() as usize];
    let mut s = Vec::new();
    for (b, h, i) in all_rows(p) {
        row_scores(p, x, b, h, i, &mut s);
        let sink = if p.sinks { x.sinks[h] } else { f64::NEG_INFINITY };
        let m = s.iter().fold(sink, |m, &(v, _)| m.max(v));
        if m == f64::NEG_INFINITY {
            continue; // no key, no sink: O = 0, LSE = -inf
        }
        let l = (sink - m).exp() + s.iter().map(|&(v, _)| (v - m).exp()).sum::<f64>();
        let row_lse = m + l.ln();
        lse[p.lse_index(b, h as u32, i) as usize] = row_lse;
        let orow = &mut o[(p.q_row(b, i) as usize * hh + h) * d..][..d];
        let k0 = p.kv_row(b, 0) as usize;
        for (j, &(v, _)) in s.iter().enumerate() {
            let pj = (v - row_lse).exp();
            if pj == 0.0 {
                continue;
            }
            let vrow = &x.v[((k0 + j) * hk + kh_of(h)) * d..][..d];
            for (a, &vv) in orow.iter_mut().zip(vrow) {
                *a += pj * vv;
            }
        }
    }
    Ok((o, lse))
}

/// The analytic gradients of `Σ d_o ∘ O` in f64 (see the module docs), for every option of
/// [`Problem`] (GQA, causal, window, soft cap, sinks, varlen).
pub fn backward64(p: &Problem, x: &Inputs64<'_>, d_o: &[f64]) -> Result<Grads, String> {
    check(p, x, Some(d_o))?;
    let (o, lse) = forward64(p, x)?;
    let (hh, d) = (p.heads as usize, p.head_dim as usize);
    let hk = p.kv_heads() as usize;
    let kh_of = |h: usize| h / (hh / hk.max(1)).max(1);
    let mut dq = vec![0.0; x.q.len()];
    let mut dk = vec![0.0; x.k.len()];
    let mut dv = vec![0.0; x.v.len()];
    let mut dsinks = vec![0.0; if p.sinks { hh } else { 0 }];
    let mut dsinks_abs = vec![0.0; if p.sinks { hh } else { 0 }];
    let mut delta = vec![0.0; lse.len()];
    let (mut dq_abs, mut dk_abs) = (vec![0.0; x.q.len()], vec![0.0; x.k.len()]);
    let mut s = Vec::new();
    for (b, h, i) in all_rows(p) {
        let li = p.lse_index(b, h as u32, i) as usize;
        let row_lse = lse[li];
        if row_lse == f64::NEG_INFINITY {
            continue; // a row that sees nothing has no gradient
        }
        let at = (p.q_row(b, i) as usize * hh + h) * d;
        let (orow, dorow) = (&o[at..at + d], &d_o[at..at + d]);
        let di: f64 = orow.iter().zip(dorow).map(|(a, c)| a * c).sum();
        let di_abs: f64 = orow.iter().zip(dorow).map(|(a, c)| (a * c).abs()).sum();
        delta[li] = di;
        if p.sinks {
            dsinks[h] -= (x.sinks[h] - row_lse).exp() * di;
            dsinks_abs[h] += (x.sinks[h] - row_lse).exp() * di_abs;
        }
        row_scores(p, x, b, h, i, &mut s);
        let qrow = &x.q[at..at + d];
        let k0 = p.kv_row(b, 0) as usize;
        for (j, &(sj, dsdx)) in s.iter().enumerate() {
            if sj == f64::NEG_INFINITY {
                continue;
            }
            let pj = (sj - row_lse).exp();
            let kv_at = ((k0 + j) * hk + kh_of(h)) * d;
            let (krow, vrow) = (&x.k[kv_at..kv_at + d], &x.v[kv_at..kv_at + d]);
            let dp: f64 = dorow.iter().zip(vrow).map(|(a, c)| a * c).sum();
            let dp_abs: f64 = dorow.iter().zip(vrow).map(|(a, c)| (a * c).abs()).sum();
            let ds = pj * (dp - di) * dsdx;
            let ds_abs = pj * (dp_abs + di_abs) * dsdx.abs();
            for c in 0..d {
                dv[kv_at + c] += pj * dorow[c];
                dq[at + c] += ds * krow[c];
                dk[kv_at + c] += ds * qrow[c];
                dq_abs[at + c] += ds_abs * krow[c].abs();
                dk_abs[kv_at + c] += ds_abs * qrow[c].abs();
            }
        }
    }
    Ok(Grads { dq, dk, dv, dsinks, o, lse, delta, dq_abs, dk_abs, dsinks_abs })
}

/// [`backward64`] on f32 host tensors (as the kernels take them): `q`, `d_o`
/// `[batch, seq_q, heads, d]` (varlen: packed), `k`, `v` with `heads_kv` heads, `sinks` `[heads]`
/// when `p.sinks`. An input of the wrong length is an error naming it.
///
/// ```
/// use memattn::{reference::grad, Problem};
/// // One query, one key: P = 1, so O = v, dV = dO, and dQ = dK = 0 (dS = P (dP - D) = 0).
/// let p = Problem { batch: 1, heads: 1, seq_q: 1, seq_kv: 1, head_dim: 2, ..Problem::default() };
/// let g = grad::attention_backward(&p, &[1.0, 2.0], &[3.0, 4.0], &[5.0, 6.0], &[0.5, -1.0], &[]).unwrap();
/// assert_eq!((g.dv.as_slice(), g.dq.as_slice(), g.dk.as_slice()), (&[0.5, -1.0][..], &[0.0, 0.0][..], &[0.0, 0.0][..]));
/// ```
pub fn attention_backward(
    p: &Problem,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d_o: &[f32],
    sinks: &[f32],
) -> Result<Grads, String> {
    let w = |x: &[f32]| x.iter().map(|&a| a as f64).collect::<Vec<f64>>();
    let (q, k, v, d_o, sinks) = (w(q), w(k), w(v), w(d_o), w(sinks));
    backward64(p, &Inputs64 { q: &q, k: &k, v: &v, sinks: &sinks }, &d_o)
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn draw(n: u64, rng: &mut SplitMix64) -> Vec<f64> {
        (0..n).map(|_| rng.below(2001) as f64 / 1000.0 - 1.0).collect()
    }

    /// Max |a - b| over max |b| (b's scale; at least 1e-3 so an all-zero gradient must match to
    /// 1e-9 absolute).
    fn rel_err(a: &[f64], b: &[f64]) -> f64 {
        let scale = b.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
        a.iter().zip(b).fold(0.0f64, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    /// Central finite differences of `L = Σ d_o ∘ O` against every input element, f64.
    fn finite_differences(p: &Problem, q: &[f64], k: &[f64], v: &[f64], sinks: &[f64], d_o: &[f64]) -> Grads {
        let loss = |q: &[f64], k: &[f64], v: &[f64], s: &[f64]| -> f64 {
            let (o, _) = forward64(p, &Inputs64 { q, k, v, sinks: s }).unwrap();
            o.iter().zip(d_o).map(|(a, b)| a * b).sum()
        };
        let h = 1e-5;
        let fd = |which: usize| -> Vec<f64> {
            let mut x = [q.to_vec(), k.to_vec(), v.to_vec(), sinks.to_vec()];
            (0..x[which].len())
                .map(|e| {
                    let orig = x[which][e];
                    x[which][e] = orig + h;
                    let up = loss(&x[0], &x[1], &x[2], &x[3]);
                    x[which][e] = orig - h;
                    let down = loss(&x[0], &x[1], &x[2], &x[3]);
                    x[which][e] = orig;
                    (up - down) / (2.0 * h)
                })
                .collect()
        };
        Grads {
            dq: fd(0),
            dk: fd(1),
            dv: fd(2),
            dsinks: fd(3),
            o: vec![],
            lse: vec![],
            delta: vec![],
            dq_abs: vec![],
            dk_abs: vec![],
            dsinks_abs: vec![],
        }
    }

    /// The analytic gradients against finite differences at ≤ 1e-6 relative error; returns the
    /// worst error seen.
    fn check_against_fd(p: &Problem, seed: u64) -> f64 {
        let mut rng = SplitMix64::new(seed);
        let (q, k, v) = (draw(p.q_elems(), &mut rng), draw(p.kv_elems(), &mut rng), draw(p.kv_elems(), &mut rng));
        let sinks: Vec<f64> = if p.sinks { draw(p.heads as u64, &mut rng) } else { vec![] };
        let d_o = draw(p.q_elems(), &mut rng);
        let g = backward64(p, &Inputs64 { q: &q, k: &k, v: &v, sinks: &sinks }, &d_o).unwrap();
        let f = finite_differences(p, &q, &k, &v, &sinks, &d_o);
        let mut worst = 0.0f64;
        for (name, a, b) in
            [("dq", &g.dq, &f.dq), ("dk", &g.dk, &f.dk), ("dv", &g.dv, &f.dv), ("dsinks", &g.dsinks, &f.dsinks)]
        {
            let e = rel_err(a, b);
            assert!(e <= 1e-6, "{p:?}: {name} relative error {e:.3e} against finite differences\n{a:?}\n{b:?}");
            worst = worst.max(e);
        }
        worst
    }

    fn tiny(seq_q: u32, seq_kv: u32) -> Problem {
        Problem { batch: 1, heads: 1, seq_q, seq_kv, head_dim: 3, scale: Some(0.7), ..Problem::default() }
    }

    pub fn finite_differences_agree_on_every_option() {
        let cases = [
            ("length 1", tiny(1, 1)),
            ("plain", Problem { batch: 2, ..tiny(3, 4) }),
            ("causal, seq_q > seq_kv: fully masked rows", Problem { causal: true, ..tiny(4, 2) }),
            ("causal, seq_q < seq_kv", Problem { causal: true, ..tiny(2, 5) }),
            ("window", Problem { window: (1, 0), ..tiny(4, 4) }),
            ("window wholly left of some rows", Problem { window: (0, 0), ..tiny(5, 2) }),
            ("softcap", Problem { softcap: 0.9, ..tiny(3, 4) }),
            ("GQA", Problem { heads: 4, heads_kv: Some(2), ..tiny(3, 3) }),
            ("MQA causal", Problem { heads: 3, heads_kv: Some(1), causal: true, ..tiny(3, 2) }),
            ("sinks", Problem { heads: 2, sinks: true, ..tiny(2, 3) }),
            ("sinks, fully masked rows", Problem { heads: 2, sinks: true, causal: true, ..tiny(3, 1) }),
            (
                "everything",
                Problem { heads: 4, heads_kv: Some(2), softcap: 1.5, sinks: true, window: (2, 1), ..tiny(4, 5) },
            ),
        ];
        for (seed, (what, p)) in cases.iter().enumerate() {
            let worst = check_against_fd(p, seed as u64 + 1);
            assert!(worst.is_finite(), "{what}");
        }
        // Varlen with an empty sequence, causal per sequence.
        let base = Problem { heads: 2, heads_kv: Some(1), causal: true, ..tiny(1, 1) };
        let p = Problem::varlen(base, &[2, 0, 3], &[3, 2, 1]).unwrap();
        check_against_fd(&p, 99);
    }

    pub fn a_wrong_derivative_is_caught() {
        // The check must be able to fail: drop D from dS (dS = P dP) and the same comparison
        // reports a large error.
        let p = Problem { heads: 2, heads_kv: Some(1), causal: true, ..tiny(3, 3) };
        let mut rng = SplitMix64::new(5);
        let (q, k, v) = (draw(p.q_elems(), &mut rng), draw(p.kv_elems(), &mut rng), draw(p.kv_elems(), &mut rng));
        let d_o = draw(p.q_elems(), &mut rng);
        let g = backward64(&p, &Inputs64 { q: &q, k: &k, v: &v, sinks: &[] }, &d_o).unwrap();
        let f = finite_differences(&p, &q, &k, &v, &[], &d_o);
        assert!(rel_err(&g.dq, &f.dq) <= 1e-6);
        // dS without D: recompute dq by hand from the forward.
        let (hh, d) = (2usize, 3usize);
        let mut dq_bad = vec![0.0; q.len()];
        let mut s = Vec::new();
        for (b, h, i) in all_rows(&p) {
            let lse = g.lse[p.lse_index(b, h as u32, i) as usize];
            row_scores(&p, &Inputs64 { q: &q, k: &k, v: &v, sinks: &[] }, b, h, i, &mut s);
            let at = (i as usize * hh + h) * d;
            for (j, &(sj, dsdx)) in s.iter().enumerate() {
                if sj == f64::NEG_INFINITY {
                    continue;
                }
                let dp: f64 = (0..d).map(|c| d_o[at + c] * v[j * d + c]).sum();
                let ds = (sj - lse).exp() * dp * dsdx;
                for c in 0..d {
                    dq_bad[at + c] += ds * k[j * d + c];
                }
            }
        }
        assert!(rel_err(&dq_bad, &f.dq) > 1e-2, "{}", rel_err(&dq_bad, &f.dq));
    }

    pub fn forward64_matches_the_reference() {
        let p = Problem { heads: 4, heads_kv: Some(2), softcap: 2.0, sinks: true, window: (3, 1), ..tiny(6, 9) };
        let mut rng = SplitMix64::new(3);
        let f = |n: u64, rng: &mut SplitMix64| draw(n, rng).iter().map(|&x| x as f32).collect::<Vec<f32>>();
        let (q, k, v, s) =
            (f(p.q_elems(), &mut rng), f(p.kv_elems(), &mut rng), f(p.kv_elems(), &mut rng), f(4, &mut rng));
        let (o_ref, lse_ref) = super::super::attention_with_sinks(&p, &q, &k, &v, &s).unwrap();
        let g = attention_backward(&p, &q, &k, &v, &q, &s).unwrap();
        assert!(rel_err(&g.o, &o_ref) < 1e-12 && rel_err(&g.lse, &lse_ref) < 1e-12);
        // D = rowsum(dO ∘ O), here with dO = q.
        let at = (2 * 4 + 1) * 3;
        let want: f64 = (0..3).map(|c| g.o[at + c] * q[at + c] as f64).sum();
        assert!((g.delta[p.lse_index(0, 1, 2) as usize] - want).abs() < 1e-12);
        assert!(attention_backward(&p, &q, &k, &v, &q[1..], &s).unwrap_err().contains("d_o"));
    }
}
