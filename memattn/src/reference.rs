//! CPU reference: naive attention accumulated in f64, producing O and LSE per query row. One
//! routine computes a row (`attention_row`); the decode reference ([`crate::decode::reference`])
//! calls it too, so a decode step and the prefill of the same rows give the same bits.
//!
//! Problems too large to check fully are checked on a seeded random sample of query rows; the
//! report always says how many rows were checked, so nothing is skipped silently.

pub mod grad;

use crate::inputs::Qkv;
use crate::problem::Problem;
use crate::rng::SplitMix64;

/// One query row: batch, head, query index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct RowId {
    /// The sequence's index in the batch.
    pub b: u32,
    /// The query head.
    pub h: u32,
    /// The query row within the sequence.
    pub i: u32,
}

/// Which query rows to check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowSelection {
    /// Every row.
    All,
    /// `count` distinct rows drawn with `seed` (all rows when `count` >= the total).
    Sample {
        /// Rows to draw.
        count: u64,
        /// The sample's seed.
        seed: u64,
    },
    /// All rows when the reference costs at most `max_macs` multiply-adds, else a sample sized to
    /// that budget (at least `min_rows` rows).
    Auto {
        /// The budget in multiply-adds.
        max_macs: u64,
        /// The fewest rows a sample has.
        min_rows: u64,
        /// The sample's seed.
        seed: u64,
    },
}

/// Default budget of the reference: 2^28 multiply-adds (well under a second).
pub const DEFAULT_REFERENCE_MACS: u64 = 1 << 28;

impl RowSelection {
    /// `Auto` with the default budget ([`DEFAULT_REFERENCE_MACS`]) and at least 256 rows.
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
        // Varlen: row r is packed query t = r % total_q of head r / total_q, in the sequence
        // whose prefix sums bracket t.
        let cu = p.varlen.map(|v| crate::problem::Varlen::cu(v.seqlens_q));
        let total_q = p.total_q();
        let to_row = |r: u64| match &cu {
            Some(cu) => {
                let (h, t) = ((r / total_q) as u32, (r % total_q) as u32);
                let b = cu.partition_point(|&c| c <= t) - 1;
                RowId { b: b as u32, h, i: t - cu[b] }
            }
            None => {
                let i = (r % p.seq_q as u64) as u32;
                let bh = r / p.seq_q as u64;
                RowId { b: (bh / p.heads as u64) as u32, h: (bh % p.heads as u64) as u32, i }
            }
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
    /// The rows computed, in the order of `o` and `lse`.
    pub rows: Vec<RowId>,
    /// `rows.len() * head_dim` values, row-major.
    pub o: Vec<f64>,
    /// One LSE per row (`-inf` for a fully masked row).
    pub lse: Vec<f64>,
    /// `Σ_j P_j |v_j|` per element, like `o`: the row-local magnitude O's rounding error scales
    /// with (`|o| <= o_abs` elementwise; a row whose V values cancel has a small `o` but not a
    /// small `o_abs`). The verification bounds of each row are relative to it.
    pub o_abs: Vec<f64>,
    /// `Σ_j P_j |v_j|` per element like `o_abs`, over only the keys whose weight relative to the
    /// row's largest (`e^(s_j - m)`, `m` the max of the scores and the sink) is below
    /// [`UNDERFLOW_WEIGHT`]: the part of `o` an f32 kernel may lose to underflow, correctly
    /// (`ex2.approx.ftz` flushes results below 2^-126 to 0). With a sink far above the scores
    /// (say 100) every key is there and `O` is 0 in f32 while the reference is about 1e-44.
    pub o_under: Vec<f64>,
    /// Rows in the problem.
    pub total_rows: u64,
}

/// Weights `e^(s_j - m)` below this (2^-100) may underflow in an f32 kernel: `ex2.approx.ftz`
/// flushes below 2^-126, and the lazy rescale lets a kernel's exponent base trail the row max by
/// up to 2^8, so 2^-100 keeps a margin of 2^18. No f32 bound is near 2^-100 of a row's scale.
pub const UNDERFLOW_WEIGHT: f64 = 7.888609052210118e-31;

/// Whether query `i` sees key `j`, straight from the rule of `docs/semantics.md` (written here
/// independently of the kernels' and the problem's range arithmetic): with `off = seq_kv - seq_q`,
/// `i + off - left <= j <= i + off + right`, a side of `-1` unbounded, causal meaning `right = 0`.
pub fn visible(p: &Problem, i: u32, j: u32) -> bool {
    visible_in(p, p.seq_q, p.seq_kv, i, j)
}

/// [`visible`] in a sequence of `seq_q` queries and `seq_kv` keys (varlen: each sequence's own).
pub fn visible_in(p: &Problem, seq_q: u32, seq_kv: u32, i: u32, j: u32) -> bool {
    Mask::of(p).visible(seq_q, seq_kv, i, j)
}

/// The keys query `i` of a `seq_q` × `seq_kv` sequence sees: one range, since the causal and
/// window bounds each cut the keys at one end (empty when it sees none). Read off the per-key
/// rule [`visible_in`], not the kernels' `key_range`, so the reference stays independent of them.
/// (The rows call [`Mask::keys`] directly; this is the tests' view of it.)
#[cfg(feature = "unit-tests")]
pub(crate) fn visible_keys(p: &Problem, seq_q: u32, seq_kv: u32, i: u32) -> std::ops::Range<usize> {
    Mask::of(p).keys(seq_q, seq_kv, i)
}

/// The mask of `docs/semantics.md`, as the references apply it key by key: causal and a window
/// `(left, right)`, both bottom-right aligned in the row's own sequence (`off = seq_kv - seq_q`:
/// query `i` sees key `j` iff `i + off - left <= j <= i + off + right`, a side of `-1` unbounded,
/// causal meaning `right = 0`). A prefill problem and a decode problem carry the same two fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mask {
    /// Causal: the window's right side is 0.
    pub(crate) causal: bool,
    /// `(left, right)`, `-1` unbounded.
    pub(crate) window: (i32, i32),
}

impl Mask {
    /// The mask of a prefill problem.
    pub(crate) fn of(p: &Problem) -> Mask {
        Mask { causal: p.causal, window: p.window }
    }

    /// Whether query `i` of a `seq_q` × `seq_kv` sequence sees key `j`.
    pub(crate) fn visible(&self, seq_q: u32, seq_kv: u32, i: u32, j: u32) -> bool {
        let off = seq_kv as i64 - seq_q as i64;
        let (i, j) = (i as i64, j as i64);
        let left = self.window.0 as i64;
        let right = if self.causal { 0 } else { self.window.1 as i64 };
        (left < 0 || j >= i + off - left) && (right < 0 || j <= i + off + right)
    }

    /// The keys query `i` sees, one range read off [`Mask::visible`] (empty when none).
    pub(crate) fn keys(&self, seq_q: u32, seq_kv: u32, i: u32) -> std::ops::Range<usize> {
        let seen = |j: &usize| self.visible(seq_q, seq_kv, i, *j as u32);
        let Some(first) = (0..seq_kv as usize).find(seen) else { return 0..0 };
        first..(first..seq_kv as usize).find(|j| !seen(j)).unwrap_or(seq_kv as usize)
    }
}

/// Everything one query row's f64 attention depends on besides its query, keys and values: the
/// mask and the score rules (`docs/semantics.md`). Score of key `j`: `t = scale · q·k_j`, soft
/// capped to `softcap · tanh(t / softcap)` when `softcap > 0`, then `- slope · |i + off - j|`
/// (ALiBi); `sink` joins the softmax denominator only (`-inf`: no sink). Built per row by the
/// prefill reference ([`RowRules::prefill`]) and the decode reference alike, so both reach
/// [`attention_row`] with the same description.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct RowRules {
    /// Which keys the row sees.
    pub(crate) mask: Mask,
    /// The softmax scale.
    pub(crate) scale: f64,
    /// The soft cap (0: off).
    pub(crate) softcap: f64,
    /// The row's ALiBi slope (0: off).
    pub(crate) slope: f64,
    /// The row's sink logit (`-inf`: none).
    pub(crate) sink: f64,
}

impl RowRules {
    /// The rules of `row` of a prefill problem with these ALiBi slopes (`[heads]`,
    /// `[batch, heads]` or empty) and `x`'s sinks.
    #[inline(always)]
    pub(crate) fn prefill(p: &Problem, x: &Qkv, row: &RowId, slopes: &[f32]) -> RowRules {
        let (hh, h) = (p.heads as usize, row.h as usize);
        RowRules {
            mask: Mask::of(p),
            scale: p.softmax_scale() as f64,
            softcap: p.softcap as f64,
            slope: alibi_slope(slopes, hh, row.b as usize, h),
            sink: if p.sinks { x.sinks[h] as f64 } else { f64::NEG_INFINITY },
        }
    }
}

/// The ALiBi slope of head `h` of sequence `b` from `slopes`: `[heads]` for every sequence,
/// `[batch, heads]` per sequence, or empty for none (0).
#[inline(always)]
pub(crate) fn alibi_slope(slopes: &[f32], heads: usize, b: usize, h: usize) -> f64 {
    match slopes.len() {
        0 => 0.0,
        n if n == heads => slopes[h] as f64,
        _ => slopes[b * heads + h] as f64,
    }
}

/// The keys of one (sequence, KV head), stored dimension by dimension (`[head_dim][keys]`), so
/// that one query's dot products with a run of keys go across the keys in the vector units while
/// each key still sums its terms in dimension order. Held for the rows of one KV head after the
/// other (rows come head by head: the copy is made once per head, or per group of heads).
#[derive(Default)]
pub(crate) struct KeysByDim {
    of: Option<(u32, u32)>,
    keys: usize,
    kt: Vec<f32>,
}

impl KeysByDim {
    /// Holds the `keys` rows `k[j * stride..][..d]` as those of `of` (a (sequence, KV head)
    /// pair); nothing to do when they are held already. (The tests' entry; the rows call
    /// [`KeysByDim::hold_rows`].)
    #[cfg(feature = "unit-tests")]
    #[inline(always)]
    pub(crate) fn hold(&mut self, of: (u32, u32), k: &[f32], stride: usize, d: usize, keys: usize) {
        self.hold_rows(of, d, keys, |j| &k[j * stride..][..d]);
    }

    /// Holds the `keys` rows `k_row(0..keys)` (`d` values each; a paged cache's rows are
    /// anywhere) as those of `of`; nothing to do when they are held already.
    #[inline(always)]
    pub(crate) fn hold_rows<'a>(&mut self, of: (u32, u32), d: usize, keys: usize, k_row: impl Fn(usize) -> &'a [f32]) {
        if self.of == Some(of) && self.kt.len() == d * keys {
            return;
        }
        self.kt.clear();
        self.kt.resize(d * keys, 0.0);
        for j in 0..keys {
            for (t, &v) in k_row(j)[..d].iter().enumerate() {
                self.kt[t * keys + j] = v;
            }
        }
        (self.of, self.keys) = (Some(of), keys);
    }

    /// `out[i] = Σ_t q[t] · k_{first + i}[t]` for the held keys `first..first + out.len()`, each
    /// summed in `t` order in `T` (f64 for the reference, f32 for naive attention in f32), so
    /// every value has exactly the bits of
    /// `q.iter().zip(k_j).map(|(&a, &c)| T::from(a) * T::from(c)).sum::<T>()`.
    #[inline(always)]
    pub(crate) fn dots<T>(&self, q: &[f32], first: usize, out: &mut [T])
    where
        T: Copy + std::ops::Add<Output = T> + std::ops::Mul<Output = T> + From<f32>,
    {
        // `Sum` for floats starts at -0.0 (the sum of nothing, and the identity for a -0.0 term).
        let zero = T::from(-0.0);
        // 32 keys per pass through the dimensions, their sums in registers (four AVX-512
        // vectors of f64); the keys left over after the last whole block, one pass of their own.
        const BLOCK: usize = 32;
        let whole = out.len() / BLOCK * BLOCK;
        let mut blocks = out.chunks_exact_mut(BLOCK);
        for (b, o) in blocks.by_ref().enumerate() {
            let at = first + b * BLOCK;
            let mut acc = [zero; BLOCK];
            for (t, &qt) in q.iter().enumerate() {
                let qt = T::from(qt);
                let col: &[f32; BLOCK] = self.kt[t * self.keys + at..][..BLOCK].try_into().expect("a block");
                for (a, &k) in acc.iter_mut().zip(col) {
                    *a = *a + qt * T::from(k);
                }
            }
            o.copy_from_slice(&acc);
        }
        let rest = blocks.into_remainder();
        let (at, n) = (first + whole, rest.len());
        rest.fill(zero);
        for (t, &qt) in q.iter().enumerate() {
            let qt = T::from(qt);
            for (o, &k) in rest.iter_mut().zip(&self.kt[t * self.keys + at..][..n]) {
                *o = *o + qt * T::from(k);
            }
        }
    }
}

/// A run of keys for a loop over a row of O that adds four keys per pass ([`weighted_keys`]).
pub(crate) enum WeightedKeys {
    /// Keys `j..j + 4`, each of nonzero weight.
    Four(usize),
    /// Key `j` alone, of nonzero weight.
    One(usize),
}

/// The keys of `seen` whose weight in `w` is not zero, in order: four at a time where four
/// consecutive keys all weigh something, else one at a time. A key of weight 0 is left out: its
/// term (±0) leaves a sum that started at +0 as it is.
#[inline(always)]
pub(crate) fn weighted_keys<T: Copy + PartialEq + Default>(
    w: &[T],
    seen: std::ops::Range<usize>,
) -> impl Iterator<Item = WeightedKeys> + '_ {
    let (mut j, zero) = (seen.start, T::default());
    std::iter::from_fn(move || loop {
        if j >= seen.end {
            return None;
        }
        if j + 4 <= seen.end && w[j..j + 4].iter().all(|&x| x != zero) {
            j += 4;
            return Some(WeightedKeys::Four(j - 4));
        }
        j += 1;
        if w[j - 1] != zero {
            return Some(WeightedKeys::One(j - 1));
        }
    })
}

/// Computes O and LSE in f64 for the selected rows. Inputs are BSHD (K and V with `heads_kv`
/// heads; query head `h` reads K/V head `h / (heads / heads_kv)`). Soft cap:
/// `s = c · tanh(scale · q·k / c)`. A sink logit joins the denominator only; LSE includes it.
pub fn reference(p: &Problem, x: &Qkv, selection: &RowSelection) -> Reference {
    let slopes = if p.alibi { crate::problem::alibi_slopes(p.heads) } else { Vec::new() };
    reference_with_slopes(p, x, selection, &slopes)
}

/// [`reference()`] with these ALiBi slopes (whatever `p.alibi` says): `[heads]` for every
/// sequence, `[batch, heads]` per sequence, or empty for none. The score of query `i` and key
/// `j` (of the row's sequence) gains `-slope · |i + seq_kv - seq_q - j|` after the soft cap.
pub fn reference_with_slopes(p: &Problem, x: &Qkv, selection: &RowSelection, slopes: &[f32]) -> Reference {
    let rows = selection.rows(p);
    let d = p.head_dim as usize;
    let ([o, o_abs, o_under], lse) =
        rows_on_cores(&rows, p.seq_kv as usize * d, d, (0.0, 0.0), |rs, [oc, ac, uc], lc| {
            reference_rows(p, x, rs, slopes, oc, ac, uc, lc)
        });
    Reference { rows, o, lse, o_abs, o_under, total_rows: p.rows() }
}

/// Rows per chunk when `rows` rows of `work_per_row` multiply-adds each are spread over the
/// host's cores: all rows in one chunk (no thread) below about 130 000 multiply-adds.
pub(crate) fn row_chunk(rows: usize, work_per_row: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let threads = if rows.saturating_mul(work_per_row) < 1 << 17 { 1 } else { cores.min(rows).max(1) };
    rows.div_ceil(threads).max(1)
}

/// Computes `rows` (independent, `work_per_row` multiply-adds each) in contiguous chunks on the
/// host's cores ([`row_chunk`]): `body` gets a chunk of rows, its part of `W` outputs of `d`
/// values per row and of one output of a value per row (filled with `fill` first), and writes
/// them. Each row is computed exactly as on one thread, so the values do not depend on the split.
pub(crate) fn rows_on_cores<T: Copy + Send, const W: usize>(
    rows: &[RowId],
    work_per_row: usize,
    d: usize,
    fill: (T, T),
    body: impl Fn(&[RowId], [&mut [T]; W], &mut [T]) + Sync,
) -> ([Vec<T>; W], Vec<T>) {
    let mut wide: [Vec<T>; W] = std::array::from_fn(|_| vec![fill.0; rows.len() * d]);
    let mut narrow = vec![fill.1; rows.len()];
    let chunk = row_chunk(rows.len(), work_per_row);
    let mut wide_parts = wide.each_mut().map(|v| v.chunks_mut(chunk * d.max(1)));
    let body = &body;
    std::thread::scope(|s| {
        let mut parts = rows.chunks(chunk).zip(narrow.chunks_mut(chunk)).peekable();
        while let Some((rs, nc)) = parts.next() {
            let wc = wide_parts.each_mut().map(|c| c.next().unwrap_or_default());
            let work = move || body(rs, wc, nc);
            if parts.peek().is_some() {
                s.spawn(work);
            } else {
                work();
            }
        }
    });
    (wide, narrow)
}

widest_vectors! {
    /// The rows `rs` of [`reference_with_slopes`] one after the other: O, its scale and its
    /// underflow margin into `oc`, `ac`, `uc` (`head_dim` values per row), the LSE into `lc`.
    fn reference_rows / reference_rows_baseline(
        p: &Problem,
        x: &Qkv,
        rs: &[RowId],
        slopes: &[f32],
        oc: &mut [f64],
        ac: &mut [f64],
        uc: &mut [f64],
        lc: &mut [f64],
    ) {
        let d = p.head_dim as usize;
        let mut scores = vec![f64::NEG_INFINITY; p.seq_kv as usize];
        let mut keys = KeysByDim::default();
        for (k, row) in rs.iter().enumerate() {
            let at = k * d..(k + 1) * d;
            let out = RowOut { o: &mut oc[at.clone()], abs: &mut ac[at.clone()], under: &mut uc[at] };
            lc[k] = reference_row(p, x, row, slopes, &mut keys, &mut scores, out);
        }
    }
}

/// One row of [`reference_with_slopes`]: the row's rules, query, keys and values (its sequence's,
/// its KV head's) handed to [`attention_row`]. `keys` holds the row's keys or is made to;
/// `scores` holds `seq_kv` values.
#[inline(always)]
fn reference_row(
    p: &Problem,
    x: &Qkv,
    row: &RowId,
    slopes: &[f32],
    keys: &mut KeysByDim,
    scores: &mut [f64],
    out: RowOut<'_>,
) -> f64 {
    let (hh, d) = (p.heads as usize, p.head_dim as usize);
    let hk = p.kv_heads() as usize;
    let kh = row.h as usize / (hh / hk.max(1));
    // Varlen: the row's own sequence (its lengths, its packed rows); else batch b.
    let (sq, sk) = p.seq_lens(row.b);
    let q = &x.q[(p.q_row(row.b, row.i) as usize * hh + row.h as usize) * d..][..d];
    let k0 = p.kv_row(row.b, 0) as usize;
    let at = move |j: usize| ((k0 + j) * hk + kh) * d;
    let (k_row, v_row) = (|j| &x.k[at(j)..][..d], |j| &x.v[at(j)..][..d]);
    let rules = RowRules::prefill(p, x, row, slopes);
    attention_row(&rules, (sq, sk), row.i, q, keys, (row.b, kh as u32), k_row, v_row, scores, out)
}

/// Where [`attention_row`] writes one row: `head_dim` values each, any values on entry.
pub(crate) struct RowOut<'a> {
    /// O.
    pub(crate) o: &'a mut [f64],
    /// `Σ_j P_j |v_j|` ([`Reference::o_abs`]).
    pub(crate) abs: &'a mut [f64],
    /// The part of O an f32 kernel may lose to underflow ([`Reference::o_under`]).
    pub(crate) under: &'a mut [f64],
}

/// One query row of attention in f64: the routine behind both the prefill reference
/// ([`reference_with_slopes`]) and the decode reference (`crate::decode::reference`), so the two
/// agree bit for bit on the same row. Query `i` (`q`, `head_dim` values) of a sequence of `sq`
/// queries and `sk` keys, key `j`'s K and V rows `k_row(j)`, `v_row(j)` (wherever they are held:
/// a packed tensor, a paged cache), scored, masked and softmaxed by `rules`. Writes O, its
/// absolute-value scale and its underflow margin into `out` and returns the LSE (`-inf`, O = 0
/// for a row that sees no key and has no sink; a sink and no key: O = 0, LSE = the sink).
///
/// Scores are summed in dimension order ([`KeysByDim::dots`]), O as `Σ_j e^(s_j - m) v_j / l`
/// in key order, `l = e^(sink - m) + Σ_j e^(s_j - m)` (the sink first), `m` the max of the scores
/// and the sink. `keys` holds the row's keys as those of `of` or is made to; `scores` holds at
/// least `sk` values.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_row<'a>(
    rules: &RowRules,
    (sq, sk): (u32, u32),
    i: u32,
    q: &[f32],
    keys: &mut KeysByDim,
    of: (u32, u32),
    k_row: impl Fn(usize) -> &'a [f32],
    v_row: impl Fn(usize) -> &'a [f32],
    scores: &mut [f64],
    out: RowOut<'_>,
) -> f64 {
    let d = q.len();
    let RowOut { o: orow, abs: arow, under: urow } = out;
    let (scale, cap, slope, sink) = (rules.scale, rules.softcap, rules.slope, rules.sink);
    let scores = &mut scores[..sk as usize];
    // Written before anything reads them: a page of a fresh allocation read first is mapped to
    // the kernel's zero page, and the write after it costs a copy and a TLB flush on every core.
    for out in [&mut *orow, &mut *arow, &mut *urow] {
        out.fill(0.0);
    }
    let diag = i as f64 + sk as f64 - sq as f64;
    let seen = rules.mask.keys(sq, sk, i);
    if !seen.is_empty() {
        keys.hold_rows(of, d, sk as usize, &k_row);
        keys.dots(q, seen.start, &mut scores[seen.clone()]);
    }
    let mut m = sink;
    for (j, s) in scores.iter_mut().enumerate() {
        *s = if seen.contains(&j) {
            let dot = *s;
            let s = if cap > 0.0 { cap * (dot * scale / cap).tanh() } else { dot * scale };
            s - slope * (diag - j as f64).abs()
        } else {
            f64::NEG_INFINITY
        };
        m = m.max(*s);
    }
    if m == f64::NEG_INFINITY {
        return f64::NEG_INFINITY; // no key, no sink: O stays 0
    }
    // The keys outside `seen` weigh exp(-inf) = 0: they add nothing to l, O or its scale.
    let mut l = (sink - m).exp();
    for s in &mut scores[seen.clone()] {
        *s = (*s - m).exp();
        l += *s;
    }
    // Each element of O and of its scale adds its keys' terms in key order; the loop over the
    // row's elements is what the vector units take (8 at a time with AVX-512), four keys per
    // pass so the sums stay in registers between them.
    for keys in weighted_keys(scores, seen.clone()) {
        match keys {
            WeightedKeys::Four(j) => {
                let p = [scores[j], scores[j + 1], scores[j + 2], scores[j + 3]];
                let terms = v_row(j).iter().zip(v_row(j + 1)).zip(v_row(j + 2)).zip(v_row(j + 3));
                for ((o, a), (((&v0, &v1), &v2), &v3)) in orow.iter_mut().zip(arow.iter_mut()).zip(terms) {
                    let (mut oo, mut aa) = (*o, *a);
                    for (pj, v) in p.into_iter().zip([v0, v1, v2, v3]) {
                        let v = v as f64;
                        oo += pj * v;
                        aa += pj * v.abs();
                    }
                    (*o, *a) = (oo, aa);
                }
            }
            WeightedKeys::One(j) => {
                let pj = scores[j];
                for ((o, a), &v) in orow.iter_mut().zip(arow.iter_mut()).zip(v_row(j)) {
                    let v = v as f64;
                    *o += pj * v;
                    *a += pj * v.abs();
                }
            }
        }
    }
    for j in seen {
        let pj = scores[j];
        if pj != 0.0 && pj < UNDERFLOW_WEIGHT {
            for (u, &vv) in urow.iter_mut().zip(v_row(j)) {
                *u += pj * (vv as f64).abs();
            }
        }
    }
    for ((acc, abs), u) in orow.iter_mut().zip(arow.iter_mut()).zip(urow.iter_mut()) {
        *acc /= l;
        *abs /= l;
        *u /= l;
    }
    m + l.ln()
}

/// Dense attention in f64 on host tensors, for checking results in your own tests: `q` is
/// `[batch, seq_q, heads, head_dim]`, `k` and `v` are `[batch, seq_kv, heads_kv, head_dim]`, all
/// contiguous (BSHD) f32; `p` gives the sizes, `causal`, `scale`, `heads_kv`, `window` and
/// `softcap` (its `dtype` and `layout` are not used; sinks and varlen: [`attention_with_sinks`]). Returns `o` in q's layout and `lse` as `[batch, heads, seq_q]`, natural log (`-inf`
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
    attention_with_sinks(p, q, k, v, &[])
}

/// [`attention`] with every option of [`Problem`]: GQA (`k`, `v` with `heads_kv` heads), window,
/// soft cap, varlen (packed `[total, heads, head_dim]` tensors; `o` packed the same way and `lse`
/// `[heads, total_q]`), and, when `p.sinks` is set, one sink logit per head in `sinks`.
pub fn attention_with_sinks(
    p: &Problem,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    sinks: &[f32],
) -> Result<(Vec<f64>, Vec<f64>), String> {
    let slopes = if p.alibi { crate::problem::alibi_slopes(p.heads) } else { Vec::new() };
    attention_with_alibi(p, q, k, v, sinks, &slopes)
}

/// [`attention_with_sinks`] with these ALiBi slopes (whatever `p.alibi` says): `[heads]` for
/// every sequence, `[batch, heads]` per sequence, or empty for none.
pub fn attention_with_alibi(
    p: &Problem,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    sinks: &[f32],
    slopes: &[f32],
) -> Result<(Vec<f64>, Vec<f64>), String> {
    for (name, got, want) in [("q", q.len(), p.q_elems()), ("k", k.len(), p.kv_elems()), ("v", v.len(), p.kv_elems())] {
        if got as u64 != want {
            return Err(format!("{name} has {got} elements, the problem's shape needs {want}"));
        }
    }
    if p.sinks && sinks.len() != p.heads as usize {
        return Err(format!("{} sink logits for {} heads (one per head)", sinks.len(), p.heads));
    }
    let h = p.heads as usize;
    if !slopes.is_empty() && slopes.len() != h && slopes.len() != p.batch as usize * h {
        return Err(format!(
            "{} ALiBi slopes for {} heads and {} sequences ([heads] or [batch, heads])",
            slopes.len(),
            h,
            p.batch
        ));
    }
    let x = Qkv { q: q.to_vec(), k: k.to_vec(), v: v.to_vec(), sinks: sinks.to_vec() };
    let r = reference_with_slopes(p, &x, &RowSelection::All, slopes);
    let d = p.head_dim as usize;
    let hh = p.heads as usize;
    let mut o = vec![0.0f64; r.o.len()];
    let mut lse = vec![0.0f64; r.lse.len()];
    for (n, row) in r.rows.iter().enumerate() {
        let at = p.q_row(row.b, row.i) as usize * hh + row.h as usize;
        o[at * d..][..d].copy_from_slice(&r.o[n * d..(n + 1) * d]);
        lse[p.lse_index(row.b, row.h, row.i) as usize] = r.lse[n];
    }
    Ok((o, lse))
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;
    use crate::problem::Problem;

    pub fn every_vector_level_gives_the_same_bits() {
        // The rows as the host's widest vectors compute them against the body compiled for the
        // baseline here (GQA, a soft cap, a window, sinks, ALiBi, a head dim that is not a multiple
        // of 8 or 16, sampled rows in several heads).
        for (d, softcap, alibi) in [(40u32, 0.0f32, false), (13, 5.0, true)] {
            let p = Problem {
                batch: 2,
                heads: 4,
                heads_kv: Some(2),
                seq_q: 37,
                seq_kv: 53,
                head_dim: d,
                window: (20, 3),
                softcap,
                sinks: true,
                alibi,
                ..Problem::default()
            };
            let x = Qkv::random(&p, 17);
            let rows = RowSelection::Sample { count: 100, seed: 3 }.rows(&p);
            let slopes = if alibi { crate::problem::alibi_slopes(p.heads) } else { Vec::new() };
            let n = rows.len() * d as usize;
            let run = |widest: bool| {
                let (mut o, mut a, mut u, mut l) =
                    (vec![f64::NAN; n], vec![f64::NAN; n], vec![f64::NAN; n], vec![0.0; rows.len()]);
                if widest {
                    reference_rows(&p, &x, &rows, &slopes, &mut o, &mut a, &mut u, &mut l);
                } else {
                    reference_rows_baseline(&p, &x, &rows, &slopes, &mut o, &mut a, &mut u, &mut l);
                }
                [o, a, u, l].map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<u64>>())
            };
            let (wide, base) = (run(true), run(false));
            assert!(wide[0].iter().any(|&b| f64::from_bits(b) != 0.0), "d {d}: O is all zeros");
            assert_eq!(wide, base, "d {d}");
        }
    }

    pub fn hand_computed_two_keys() {
        // d = 1, one query q = 1, keys 0 and ln 3 (scale 1): p = (1/4, 3/4), v = (4, 8) -> o = 7,
        // lse = ln(1 + 3) = ln 4.
        let p =
            Problem { batch: 1, heads: 1, seq_q: 1, seq_kv: 2, head_dim: 1, scale: Some(1.0), ..Problem::default() };
        let x = Qkv { q: vec![1.0], k: vec![0.0, 3f32.ln()], v: vec![4.0, 8.0], sinks: vec![] };
        let r = reference(&p, &x, &RowSelection::All);
        assert!((r.o[0] - 7.0).abs() < 1e-6, "{}", r.o[0]);
        assert!((r.lse[0] - 4f64.ln()).abs() < 1e-7);
    }

    pub fn dots_have_the_bits_of_a_plain_sum() {
        // Values with exact zeros of both signs (where the starting -0.0 shows) and a spread of
        // magnitudes (where the summation order shows); runs of keys of every length from every
        // first key, in f64 and f32.
        let mut rng = SplitMix64::new(11);
        let mut draw = || match rng.below(8) {
            0 => 0.0,
            1 => -0.0,
            _ => (rng.normal() * 10f64.powi(rng.below(7) as i32 - 3)) as f32,
        };
        let mut held = KeysByDim::default();
        for (n, (d, stride)) in [(1usize, 1usize), (7, 9), (64, 64), (64, 128), (3, 3)].into_iter().enumerate() {
            let q: Vec<f32> = (0..d).map(|_| draw()).collect();
            let zeros = vec![0.0f32; d];
            for keys in [0usize, 1, 7, 8, 9, 16, 19, 32, 33, 70] {
                let k: Vec<f32> = (0..keys * stride + d).map(|_| draw()).collect();
                held.hold((n as u32, keys as u32), &k, stride, d, keys);
                // Every first key of the short runs; of the long ones (blocks of 32 keys and
                // what is left after them), a few.
                let firsts: Vec<usize> = if keys <= 19 { (0..keys).collect() } else { vec![0, 1, 5, keys - 1] };
                for first in firsts {
                    for len in 0..=keys - first {
                        let mut o64 = vec![f64::NAN; len];
                        let mut o32 = vec![f32::NAN; len];
                        held.dots(&q, first, &mut o64);
                        held.dots(&q, first, &mut o32);
                        for (i, j) in (first..first + len).enumerate() {
                            let row = &k[j * stride..][..d];
                            let want64: f64 = q.iter().zip(row).map(|(&a, &c)| a as f64 * c as f64).sum();
                            let want32: f32 = q.iter().zip(row).map(|(&a, &c)| a * c).sum();
                            assert_eq!(o64[i].to_bits(), want64.to_bits(), "f64 d {d} key {j} of {keys}");
                            assert_eq!(o32[i].to_bits(), want32.to_bits(), "f32 d {d} key {j} of {keys}");
                        }
                    }
                }
                // A row of zeros sums to the plain sum's zero, sign included.
                let mut z = vec![f64::NAN; keys];
                let kz = vec![-0.0f32; keys * stride + d];
                let mut zero_keys = KeysByDim::default();
                zero_keys.hold((0, 0), &kz, stride, d, keys);
                zero_keys.dots(&zeros, 0, &mut z);
                let want: f64 = zeros.iter().map(|&a| a as f64 * -0.0).sum();
                assert!(z.iter().all(|v| v.to_bits() == want.to_bits()), "{z:?} {want}");
            }
        }
    }

    pub fn visible_keys_are_the_keys_the_rule_shows() {
        for (nq, nk) in [(1u32, 1u32), (5, 17), (17, 5), (70, 130)] {
            for window in [(-1, -1), (0, 0), (3, 0), (0, 4), (-1, 2), (7, -1), (200, 200)] {
                for causal in [false, true] {
                    let p = Problem { seq_q: nq, seq_kv: nk, window, causal, ..Problem::default() };
                    for i in 0..nq {
                        let want: Vec<usize> = (0..nk).filter(|&j| visible(&p, i, j)).map(|j| j as usize).collect();
                        let got: Vec<usize> = visible_keys(&p, nq, nk, i).collect();
                        assert_eq!(got, want, "{nq}x{nk} window {window:?} causal {causal} row {i}");
                    }
                }
            }
        }
    }

    pub fn window_ranges_match_the_rule_on_every_key() {
        // The problem's ranges (used for FLOPs and by tests), the kernels' `AttnParams::key_range`
        // and the reference's per-key rule must agree, for every window shape and seq_q vs seq_kv.
        for (nq, nk) in [(1u32, 1u32), (5, 17), (17, 5), (64, 64), (70, 130)] {
            for window in [(-1, -1), (0, 0), (3, 0), (0, 4), (-1, 2), (7, -1), (200, 200)] {
                for causal in [false, true] {
                    let p = Problem { seq_q: nq, seq_kv: nk, window, causal, ..Problem::default() };
                    // What the launch carries: the one builder's parameters.
                    let ap = p.attn_params(&Default::default());
                    let mut pairs = 0;
                    for i in 0..nq {
                        let seen: Vec<u32> = (0..nk).filter(|&j| visible(&p, i, j)).collect();
                        pairs += seen.len() as u64;
                        let (s, e) = p.key_range(i);
                        assert_eq!(seen, (s as u32..e as u32).collect::<Vec<_>>(), "{p:?} row {i}");
                        let (ks, ke) = ap.key_range(i);
                        assert_eq!((ks.max(0) as u64, ke.max(ks).max(0) as u64), (s, e), "{p:?} row {i}");
                    }
                    assert_eq!(p.unmasked_pairs_per_head(), pairs, "{p:?}");
                }
            }
        }
    }

    pub fn hand_computed_gqa_sinks_and_softcap() {
        // Two query heads share one K/V head (keys 0 and ln 3, values 4 and 8). Head 0's sink
        // ln 4: weights 1, 3, (4) -> O = 28 / 8, LSE = ln 8; head 1's sink ln 12: O = 28 / 16,
        // LSE = ln 16.
        let p = Problem {
            batch: 1,
            heads: 2,
            heads_kv: Some(1),
            seq_q: 1,
            seq_kv: 2,
            head_dim: 1,
            scale: Some(1.0),
            sinks: true,
            ..Problem::default()
        };
        let x =
            Qkv { q: vec![1.0, 1.0], k: vec![0.0, 3f32.ln()], v: vec![4.0, 8.0], sinks: vec![4f32.ln(), 12f32.ln()] };
        let r = reference(&p, &x, &RowSelection::All);
        assert!((r.o[0] - 3.5).abs() < 1e-6 && (r.lse[0] - 8f64.ln()).abs() < 1e-6, "{:?}", r);
        assert!((r.o[1] - 1.75).abs() < 1e-6 && (r.lse[1] - 16f64.ln()).abs() < 1e-6, "{:?}", r);
        // Soft cap 1 on scores 0 and 3: tanh caps 3 at tanh(3) = 0.99505; no sinks.
        let p = Problem { softcap: 1.0, sinks: false, ..p };
        let x = Qkv { k: vec![0.0, 3.0], sinks: vec![], ..x };
        let r = reference(&p, &x, &RowSelection::All);
        let w = 3f64.tanh().exp();
        assert!((r.o[0] - (4.0 + 8.0 * w) / (1.0 + w)).abs() < 1e-6 && (r.lse[0] - (1.0 + w).ln()).abs() < 1e-6);
    }

    pub fn causal_bottom_right_masks_and_empty_rows() {
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
        let x = Qkv { q: vec![1.0, 1.0, 1.0], k: vec![0.0, 0.0], v: vec![2.0, 6.0], sinks: vec![] };
        let r = reference(&p, &x, &RowSelection::All);
        assert_eq!(r.lse[0], f64::NEG_INFINITY);
        assert_eq!(r.o[0], 0.0);
        assert!((r.o[1] - 2.0).abs() < 1e-12 && r.lse[1].abs() < 1e-12);
        assert!((r.o[2] - 4.0).abs() < 1e-12 && (r.lse[2] - 2f64.ln()).abs() < 1e-12);
    }

    pub fn sample_is_distinct_sorted_and_seeded() {
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
