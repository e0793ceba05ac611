//! Which part of a backward run is checked against the f64 reference.
//!
//! The reference gradients cost about `9 · head_dim` multiply-adds per visible query-key pair
//! (the forward, then dP, D, dS and the three gradients, plus the naive backward in the dtype for
//! a 16-bit run), on the host. Every pair of a training-sized problem (batch 4, heads 32,
//! seq 4096: 2·10^9 pairs) would keep the host busy for many minutes after a kernel that took
//! milliseconds. A dense problem past the budget is therefore checked on a sample of whole
//! slices: a set of batches times a set of KV heads, each slice with every query row of its
//! group of query heads and every key. dK and dV of a KV head sum over all of its query rows,
//! so a slice is the smallest part whose gradients the reference can compute in full; inside
//! a checked slice every element of O, LSE, dQ, dK and dV is held to the run's rule, exactly as
//! in a whole check.
//!
//! With sinks every batch is in the sample (d_sinks of a head sums over all batches); varlen
//! problems are always checked whole (their per-sequence checks need every sequence).

use crate::inputs::Qkv;
use crate::problem::Problem;
use crate::reference::RowSelection;
use memattn::rng::SplitMix64;

/// Multiply-adds the backward's reference may cost before `--check-rows auto` samples slices:
/// 2^34, 64 times the forward's budget ([`crate::reference::DEFAULT_REFERENCE_MACS`]: a backward
/// check is rarer, and every gradient of a slice needs all of its pairs). About 10 seconds on
/// one core of a 2024 server (batch 2, heads 8, seq 1000, d 64 is checked whole).
pub const BACKWARD_REFERENCE_MACS: u64 = 1 << 34;

/// Multiply-adds of the reference per visible query-key pair and head-dim element (the f64
/// forward and backward, and the naive backward in the dtype).
const MACS_PER_PAIR_ELEMENT: u64 = 9;

/// The checked slices of a backward run: every (batch, KV head) pair of `batches` × `kv_heads`,
/// each sorted and distinct.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SliceSample {
    pub batches: Vec<u32>,
    pub kv_heads: Vec<u32>,
}

impl SliceSample {
    /// Query rows in the sample (each checked slice holds `group · seq_q`).
    pub fn rows(&self, p: &Problem) -> u64 {
        let group = (p.heads / p.kv_heads().max(1)).max(1) as u64;
        self.batches.len() as u64 * self.kv_heads.len() as u64 * group * p.seq_q as u64
    }

    /// The sample as a problem of its own: the sampled batches, the sampled KV heads and their
    /// query heads, everything else as in `p`.
    pub fn problem(&self, p: &Problem) -> Problem {
        let group = (p.heads / p.kv_heads().max(1)).max(1);
        let nk = self.kv_heads.len() as u32;
        Problem { batch: self.batches.len() as u32, heads: nk * group, heads_kv: Some(nk), ..*p }
    }

    /// `q`-like tensor `[batch, seq_q, heads, d]` (BSHD) of `p` → the sample's.
    pub fn gather_q<T: Copy>(&self, p: &Problem, t: &[T]) -> Vec<T> {
        let (h, d, g) = (p.heads as usize, p.head_dim as usize, self.group(p));
        let sq = p.seq_q as usize;
        let mut out = Vec::with_capacity(self.rows(p) as usize * d);
        for &b in &self.batches {
            for i in 0..sq {
                let row = (b as usize * sq + i) * h;
                for &kh in &self.kv_heads {
                    let at = (row + kh as usize * g) * d;
                    out.extend_from_slice(&t[at..at + g * d]);
                }
            }
        }
        out
    }

    /// `k`-like tensor `[batch, seq_kv, heads_kv, d]` of `p` → the sample's.
    pub fn gather_kv<T: Copy>(&self, p: &Problem, t: &[T]) -> Vec<T> {
        let (hk, d, skv) = (p.kv_heads() as usize, p.head_dim as usize, p.seq_kv as usize);
        let mut out = Vec::with_capacity(self.batches.len() * skv * self.kv_heads.len() * d);
        for &b in &self.batches {
            for j in 0..skv {
                let row = (b as usize * skv + j) * hk;
                for &kh in &self.kv_heads {
                    let at = (row + kh as usize) * d;
                    out.extend_from_slice(&t[at..at + d]);
                }
            }
        }
        out
    }

    /// LSE `[batch, heads, seq_q]` of `p` → the sample's.
    pub fn gather_lse<T: Copy>(&self, p: &Problem, t: &[T]) -> Vec<T> {
        let (h, g, sq) = (p.heads as usize, self.group(p), p.seq_q as usize);
        let mut out = Vec::with_capacity(self.rows(p) as usize);
        for &b in &self.batches {
            for &kh in &self.kv_heads {
                let at = (b as usize * h + kh as usize * g) * sq;
                out.extend_from_slice(&t[at..at + g * sq]);
            }
        }
        out
    }

    /// A per-query-head tensor `[heads]` (sinks, d_sinks) → the sample's; empty stays empty.
    pub fn gather_heads<T: Copy>(&self, p: &Problem, t: &[T]) -> Vec<T> {
        if t.is_empty() {
            return Vec::new();
        }
        let g = self.group(p);
        self.kv_heads.iter().flat_map(|&kh| t[kh as usize * g..(kh as usize + 1) * g].iter().copied()).collect()
    }

    /// The inputs of the sample.
    pub fn gather_inputs(&self, p: &Problem, x: &Qkv) -> Qkv {
        Qkv {
            q: self.gather_q(p, &x.q),
            k: self.gather_kv(p, &x.k),
            v: self.gather_kv(p, &x.v),
            sinks: self.gather_heads(p, &x.sinks),
        }
    }

    fn group(&self, p: &Problem) -> usize {
        (p.heads / p.kv_heads().max(1)).max(1) as usize
    }
}

/// The slices a backward run of `p` checks under `sel`, or `None` for every row: `all`; a
/// varlen problem; a problem whose reference fits the budget (`auto`) or whose rows are not
/// more than the number asked for. `--check-rows N` checks at least N query rows, in whole
/// slices; `auto` as many slices as [`BACKWARD_REFERENCE_MACS`] pays for, at least one.
pub fn checked_slices(p: &Problem, sel: &RowSelection) -> Option<SliceSample> {
    if p.varlen.is_some() {
        return None;
    }
    let (nb, nk) = (p.batch as u64, p.kv_heads() as u64);
    let slices = nb * nk;
    let group = (p.heads as u64 / nk.max(1)).max(1);
    let slice_rows = group * p.seq_q as u64;
    let (wanted, seed) = match *sel {
        RowSelection::All => return None,
        RowSelection::Sample { count, seed } => (count.div_ceil(slice_rows.max(1)), seed),
        RowSelection::Auto { seed, .. } => {
            // p.flops() counts 4 · head_dim per visible pair of every head.
            let macs = (p.flops() / 4.0 * MACS_PER_PAIR_ELEMENT as f64) as u64;
            if macs <= BACKWARD_REFERENCE_MACS {
                return None;
            }
            let per_slice = (macs / slices.max(1)).max(1);
            (BACKWARD_REFERENCE_MACS / per_slice, seed)
        }
    };
    let wanted = wanted.max(1);
    if wanted >= slices {
        return None;
    }
    let (take_b, take_k) = if p.sinks {
        // d_sinks of a head sums over every batch.
        (nb, (wanted / nb).clamp(1, nk))
    } else if wanted >= nk {
        ((wanted / nk).clamp(1, nb), nk)
    } else {
        (1, wanted)
    };
    if take_b == nb && take_k == nk {
        return None;
    }
    Some(SliceSample { batches: pick(take_b, nb, seed ^ 0xBA7C), kv_heads: pick(take_k, nk, seed ^ 0x4EAD) })
}

/// `count` distinct values below `total`, sorted (Floyd's algorithm, seeded).
fn pick(count: u64, total: u64, seed: u64) -> Vec<u32> {
    let mut rng = SplitMix64::new(seed);
    let mut chosen = std::collections::BTreeSet::new();
    for j in (total - count)..total {
        let t = rng.below(j + 1);
        if !chosen.insert(t) {
            chosen.insert(j);
        }
    }
    chosen.into_iter().map(|v| v as u32).collect()
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;
    use crate::Dtype;
    use memattn::rng::SplitMix64;

    fn problem(batch: u32, heads: u32, heads_kv: u32, seq: u32, d: u32) -> Problem {
        Problem {
            batch,
            heads,
            heads_kv: Some(heads_kv),
            seq_q: seq,
            seq_kv: seq,
            head_dim: d,
            dtype: Dtype::Bf16,
            ..Problem::default()
        }
    }

    pub fn small_problems_varlen_and_all_are_checked_whole() {
        let auto = RowSelection::auto(0);
        assert_eq!(checked_slices(&problem(2, 8, 2, 1000, 64), &auto), None);
        assert_eq!(checked_slices(&problem(4, 32, 32, 4096, 64), &RowSelection::All), None);
        // Asking for as many rows as there are: whole.
        let p = problem(2, 4, 2, 100, 64);
        assert_eq!(checked_slices(&p, &RowSelection::Sample { count: p.rows(), seed: 0 }), None);
    }

    pub fn a_training_sized_problem_is_sampled_within_the_budget() {
        // batch 4, heads 32, seq 4096, d64: one slice is 4096^2 pairs x 64 x 9 = 9.7e9 MACs,
        // more than half the budget: one slice.
        let p = problem(4, 32, 32, 4096, 64);
        let s = checked_slices(&p, &RowSelection::auto(7)).expect("sampled");
        assert_eq!((s.batches.len(), s.kv_heads.len()), (1, 1), "{s:?}");
        assert!(s.batches[0] < 4 && s.kv_heads[0] < 32);
        assert_eq!(s.rows(&p), 4096);
        // Another seed, another slice somewhere; the same seed, the same slice.
        assert_eq!(checked_slices(&p, &RowSelection::auto(7)), Some(s));
        // seq 1024: 16 x cheaper, 28 slices, fewer than a batch's 32 heads.
        let p = problem(16, 32, 32, 1024, 64);
        let s = checked_slices(&p, &RowSelection::auto(0)).unwrap();
        assert_eq!((s.batches.len(), s.kv_heads.len()), (1, 28), "{s:?}");
        // seq 512: 113 slices, more than a batch's heads: 3 whole batches.
        let p = problem(16, 32, 32, 512, 64);
        let s = checked_slices(&p, &RowSelection::auto(0)).unwrap();
        assert_eq!((s.batches.len(), s.kv_heads.len()), (3, 32), "{s:?}");
        assert!(s.batches.windows(2).all(|w| w[0] < w[1]));
    }

    pub fn a_row_count_is_met_in_whole_slices_and_sinks_keep_every_batch() {
        // GQA group 4, seq 100: a slice holds 400 rows; 401 rows need 2 slices.
        let p = problem(3, 8, 2, 100, 64);
        let s = checked_slices(&p, &RowSelection::Sample { count: 401, seed: 1 }).unwrap();
        assert_eq!((s.batches.len(), s.kv_heads.len(), s.rows(&p)), (1, 2, 800));
        let s = checked_slices(&p, &RowSelection::Sample { count: 1, seed: 1 }).unwrap();
        assert_eq!(s.rows(&p), 400);
        let p = Problem { sinks: true, ..p };
        let s = checked_slices(&p, &RowSelection::Sample { count: 1, seed: 1 }).unwrap();
        assert_eq!((s.batches, s.kv_heads.len()), (vec![0, 1, 2], 1));
    }

    pub fn gathered_tensors_are_the_sampled_slices() {
        // Every element's value encodes its own index, so a wrong stride shows.
        let p = Problem { sinks: true, ..problem(3, 6, 2, 5, 4) };
        let s = SliceSample { batches: vec![0, 2], kv_heads: vec![1] };
        let sp = s.problem(&p);
        assert_eq!((sp.batch, sp.heads, sp.kv_heads(), sp.seq_q), (2, 3, 1, 5));
        let iota = |n: u64| (0..n).map(|i| i as f32).collect::<Vec<f32>>();
        let q = s.gather_q(&p, &iota(p.q_elems()));
        assert_eq!(q.len() as u64, sp.q_elems());
        let (sq, h, d) = (5usize, 6usize, 4usize);
        for (bi, &b) in [0usize, 2].iter().enumerate() {
            for i in 0..sq {
                for g in 0..3 {
                    for c in 0..d {
                        let want = (((b * sq + i) * h + 3 + g) * d + c) as f32;
                        assert_eq!(q[((bi * sq + i) * 3 + g) * d + c], want);
                    }
                }
            }
        }
        let k = s.gather_kv(&p, &iota(p.kv_elems()));
        assert_eq!(k.len() as u64, sp.kv_elems());
        assert_eq!(k[sq * d], ((2 * sq * 2 + 1) * d) as f32, "batch 2, key 0, kv head 1");
        let lse = s.gather_lse(&p, &iota(p.rows()));
        assert_eq!(lse.len() as u64, sp.rows());
        assert_eq!(lse[..sq * 3], iota(p.rows())[3 * sq..6 * sq]);
        assert_eq!(lse[sq * 3], ((2 * h + 3) * sq) as f32);
        assert_eq!(s.gather_heads(&p, &iota(6)), vec![3.0, 4.0, 5.0]);
        assert!(s.gather_heads::<f32>(&p, &[]).is_empty());
    }

    pub fn the_reference_of_a_sample_is_the_whole_reference_there() {
        // GQA group 2, causal with more queries than keys, sinks: the sample's own f64 gradients
        // are the whole problem's at the sampled slices (d_sinks too: every batch is sampled).
        let p = Problem { causal: true, sinks: true, seq_q: 9, seq_kv: 7, dtype: Dtype::F32, ..problem(3, 6, 3, 7, 8) };
        let mut rng = SplitMix64::new(5);
        let mut draw = |n: u64| (0..n).map(|_| rng.normal() as f32).collect::<Vec<f32>>();
        let x = Qkv { q: draw(p.q_elems()), k: draw(p.kv_elems()), v: draw(p.kv_elems()), sinks: draw(6) };
        let d_o = draw(p.q_elems());
        let s = checked_slices(&p, &RowSelection::Sample { count: 1, seed: 3 }).unwrap();
        assert_eq!((s.batches.len(), s.kv_heads.len()), (3, 1));
        let grad = crate::reference::grad::attention_backward;
        let whole = grad(&p, &x.q, &x.k, &x.v, &d_o, &x.sinks).unwrap();
        let sx = s.gather_inputs(&p, &x);
        let sp = s.problem(&p);
        let part = grad(&sp, &sx.q, &sx.k, &sx.v, &s.gather_q(&p, &d_o), &sx.sinks).unwrap();
        let close = |a: &[f64], b: &[f64], what: &str| {
            assert_eq!(a.len(), b.len(), "{what}");
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert!((x - y).abs() <= 1e-12 * (1.0 + x.abs()) || x == y, "{what}[{i}]: {x} vs {y}");
            }
        };
        close(&s.gather_q(&p, &whole.dq), &part.dq, "dq");
        close(&s.gather_kv(&p, &whole.dk), &part.dk, "dk");
        close(&s.gather_kv(&p, &whole.dv), &part.dv, "dv");
        close(&s.gather_q(&p, &whole.o), &part.o, "o");
        close(&s.gather_lse(&p, &whole.lse), &part.lse, "lse");
        close(&s.gather_heads(&p, &whole.dsinks), &part.dsinks, "d_sinks");
        assert!(part.dk.iter().any(|&v| v != 0.0), "a real gradient, not zeros");
    }
}
