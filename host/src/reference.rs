//! CPU reference: naive attention accumulated in f64, producing O and LSE per query row.
//!
//! Problems too large to check fully are checked on a seeded random sample of query rows; the
//! report always says how many rows were checked, so nothing is skipped silently.

use crate::inputs::Qkv;
use crate::problem::Problem;
use crate::rng::SplitMix64;
use serde::Serialize;

/// One query row: batch, head, query index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct RowId {
    pub b: u32,
    pub h: u32,
    pub i: u32,
}

/// Which query rows to check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowSelection {
    /// Every row.
    All,
    /// `count` distinct rows drawn with `seed` (all rows when `count` >= the total).
    Sample { count: u64, seed: u64 },
    /// All rows when the reference costs at most `max_macs` multiply-adds, else a sample sized to
    /// that budget (at least `min_rows` rows).
    Auto { max_macs: u64, min_rows: u64, seed: u64 },
}

/// Default budget of the reference: 2^28 multiply-adds (well under a second).
pub const DEFAULT_REFERENCE_MACS: u64 = 1 << 28;

impl RowSelection {
    pub fn auto(seed: u64) -> Self {
        RowSelection::Auto { max_macs: DEFAULT_REFERENCE_MACS, min_rows: 256, seed }
    }

    /// The rows to check, sorted.
    pub fn rows(&self, p: &Problem) -> Vec<RowId> {
        let total = p.rows();
        let pick = match *self {
            RowSelection::All => None,
            RowSelection::Sample { count, seed } => (count < total).then_some((count, seed)),
            RowSelection::Auto { max_macs, min_rows, seed } => {
                let per_row = 2 * p.seq_kv as u64 * p.head_dim as u64;
                let affordable = (max_macs / per_row.max(1)).max(min_rows);
                (affordable < total).then_some((affordable, seed))
            }
        };
        let to_row = |r: u64| {
            let i = (r % p.seq_q as u64) as u32;
            let bh = r / p.seq_q as u64;
            RowId { b: (bh / p.heads as u64) as u32, h: (bh % p.heads as u64) as u32, i }
        };
        match pick {
            None => (0..total).map(to_row).collect(),
            Some((count, seed)) => {
                // Floyd's algorithm: `count` distinct indices without materialising 0..total.
                let mut rng = SplitMix64::new(seed ^ 0x005E_ED0F_F00D);
                let mut chosen = std::collections::BTreeSet::new();
                for j in (total - count)..total {
                    let t = rng.below(j + 1);
                    if !chosen.insert(t) {
                        chosen.insert(j);
                    }
                }
                chosen.into_iter().map(to_row).collect()
            }
        }
    }
}

/// Reference outputs for the selected rows.
#[derive(Clone, Debug, PartialEq)]
pub struct Reference {
    pub rows: Vec<RowId>,
    /// `rows.len() * head_dim` values, row-major.
    pub o: Vec<f64>,
    /// One LSE per row (`-inf` for a fully masked row).
    pub lse: Vec<f64>,
    /// `Σ_j P_j |v_j|` per element, like `o`: the row-local magnitude O's rounding error scales
    /// with (`|o| <= o_abs` elementwise; a row whose V values cancel has a small `o` but not a
    /// small `o_abs`). The verification bounds of each row are relative to it.
    pub o_abs: Vec<f64>,
    /// Rows in the problem.
    pub total_rows: u64,
}

/// Computes O and LSE in f64 for the selected rows. Inputs are BSHD.
pub fn reference(p: &Problem, x: &Qkv, selection: &RowSelection) -> Reference {
    let rows = selection.rows(p);
    let (hh, d) = (p.heads as usize, p.head_dim as usize);
    let (nq, nk) = (p.seq_q as usize, p.seq_kv as usize);
    let scale = p.softmax_scale() as f64;
    let mut o = vec![0.0f64; rows.len() * d];
    let mut o_abs = vec![0.0f64; rows.len() * d];
    let mut lse = vec![0.0f64; rows.len()];
    let mut scores = vec![0.0f64; nk];
    for (r, row) in rows.iter().enumerate() {
        let (b, h, i) = (row.b as usize, row.h as usize, row.i as usize);
        let q = &x.q[((b * nq + i) * hh + h) * d..][..d];
        let seen = p.keys_seen(row.i) as usize;
        if seen == 0 {
            lse[r] = f64::NEG_INFINITY; // O stays 0
            continue;
        }
        let mut m = f64::NEG_INFINITY;
        for (j, s) in scores.iter_mut().enumerate().take(seen) {
            let k = &x.k[((b * nk + j) * hh + h) * d..][..d];
            let dot: f64 = q.iter().zip(k).map(|(&a, &c)| a as f64 * c as f64).sum();
            *s = dot * scale;
            m = m.max(*s);
        }
        let mut l = 0.0f64;
        for s in scores.iter_mut().take(seen) {
            *s = (*s - m).exp();
            l += *s;
        }
        let orow = &mut o[r * d..(r + 1) * d];
        let arow = &mut o_abs[r * d..(r + 1) * d];
        for (j, &pj) in scores.iter().enumerate().take(seen) {
            let v = &x.v[((b * nk + j) * hh + h) * d..][..d];
            for ((acc, abs), &vv) in orow.iter_mut().zip(arow.iter_mut()).zip(v) {
                *acc += pj * vv as f64;
                *abs += pj * (vv as f64).abs();
            }
        }
        for (acc, abs) in orow.iter_mut().zip(arow.iter_mut()) {
            *acc /= l;
            *abs /= l;
        }
        lse[r] = m + l.ln();
    }
    Reference { rows, o, lse, o_abs, total_rows: p.rows() }
}

/// Dense attention in f64 on host tensors, for checking results in your own tests: `q` is
/// `[batch, seq_q, heads, head_dim]`, `k` and `v` are `[batch, seq_kv, heads, head_dim]`, all
/// contiguous (BSHD) f32; `p` gives the sizes, `causal` and `scale` (its `dtype` and `layout` are
/// not used). Returns `o` in q's layout and `lse` as `[batch, heads, seq_q]`, natural log (`-inf`
/// for a row that sees no key). An input of the wrong length is an error naming the length.
///
/// ```
/// use memattn::{reference, Problem};
/// let p = Problem { batch: 1, heads: 1, seq_q: 1, seq_kv: 2, head_dim: 1, scale: Some(1.0), ..Problem::default() };
/// let (o, lse) = reference::attention(&p, &[1.0], &[0.0, 1.0], &[10.0, 20.0]).unwrap();
/// let e = std::f64::consts::E;
/// assert!((o[0] - (10.0 + 20.0 * e) / (1.0 + e)).abs() < 1e-12);
/// assert!((lse[0] - (1.0 + e).ln()).abs() < 1e-12);
/// ```
pub fn attention(p: &Problem, q: &[f32], k: &[f32], v: &[f32]) -> Result<(Vec<f64>, Vec<f64>), String> {
    for (name, got, want) in [("q", q.len(), p.q_elems()), ("k", k.len(), p.kv_elems()), ("v", v.len(), p.kv_elems())] {
        if got as u64 != want {
            return Err(format!("{name} has {got} elements, the problem's shape needs {want}"));
        }
    }
    let x = Qkv { q: q.to_vec(), k: k.to_vec(), v: v.to_vec() };
    let r = reference(p, &x, &RowSelection::All);
    let d = p.head_dim as usize;
    let (hh, nq) = (p.heads as usize, p.seq_q as usize);
    let mut o = vec![0.0f64; r.o.len()];
    for (n, row) in r.rows.iter().enumerate() {
        let (b, h, i) = (row.b as usize, row.h as usize, row.i as usize);
        o[((b * nq + i) * hh + h) * d..][..d].copy_from_slice(&r.o[n * d..(n + 1) * d]);
    }
    Ok((o, r.lse))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::Problem;

    #[test]
    fn hand_computed_two_keys() {
        // d = 1, one query q = 1, keys 0 and ln 3 (scale 1): p = (1/4, 3/4), v = (4, 8) -> o = 7,
        // lse = ln(1 + 3) = ln 4.
        let p =
            Problem { batch: 1, heads: 1, seq_q: 1, seq_kv: 2, head_dim: 1, scale: Some(1.0), ..Problem::default() };
        let x = Qkv { q: vec![1.0], k: vec![0.0, 3f32.ln()], v: vec![4.0, 8.0] };
        let r = reference(&p, &x, &RowSelection::All);
        assert!((r.o[0] - 7.0).abs() < 1e-6, "{}", r.o[0]);
        assert!((r.lse[0] - 4f64.ln()).abs() < 1e-7);
    }

    #[test]
    fn causal_bottom_right_masks_and_empty_rows() {
        // seq_q 3 > seq_kv 2: row 0 sees nothing, row 1 sees key 0, row 2 sees keys 0 and 1.
        let p = Problem {
            batch: 1,
            heads: 1,
            seq_q: 3,
            seq_kv: 2,
            head_dim: 1,
            causal: true,
            scale: Some(1.0),
            ..Problem::default()
        };
        let x = Qkv { q: vec![1.0, 1.0, 1.0], k: vec![0.0, 0.0], v: vec![2.0, 6.0] };
        let r = reference(&p, &x, &RowSelection::All);
        assert_eq!(r.lse[0], f64::NEG_INFINITY);
        assert_eq!(r.o[0], 0.0);
        assert!((r.o[1] - 2.0).abs() < 1e-12 && r.lse[1].abs() < 1e-12);
        assert!((r.o[2] - 4.0).abs() < 1e-12 && (r.lse[2] - 2f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn sample_is_distinct_sorted_and_seeded() {
        let p = Problem { batch: 2, heads: 3, seq_q: 1000, ..Problem::default() };
        let a = RowSelection::Sample { count: 50, seed: 1 }.rows(&p);
        let b = RowSelection::Sample { count: 50, seed: 1 }.rows(&p);
        let c = RowSelection::Sample { count: 50, seed: 2 }.rows(&p);
        assert_eq!(a.len(), 50);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(RowSelection::All.rows(&p).len(), 6000);
    }
}
