//! Host-side tensors: Q, K, V in the logical `[batch, seq, heads, head_dim]` (BSHD) order, random
//! or loaded from a file, and conversion to and from the device layout.

use crate::problem::{Layout, Problem};
use crate::rng::SplitMix64;

/// Q, K and V of one problem, BSHD, as f32 values (for a 16-bit problem: values of the dtype); K
/// and V have `heads_kv` heads. `sinks`: one f32 logit per query head, or empty for none.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Qkv {
    /// Q, `[batch, seq_q, heads, head_dim]` (varlen: `[total_q, heads, head_dim]`).
    pub q: Vec<f32>,
    /// K, `[batch, seq_kv, heads_kv, head_dim]` (varlen: `[total_kv, heads_kv, head_dim]`).
    pub k: Vec<f32>,
    /// V, shaped as K.
    pub v: Vec<f32>,
    /// One sink logit per query head; empty for none.
    pub sinks: Vec<f32>,
}

impl Qkv {
    /// Standard-normal inputs from `seed` (Q, K, V drawn in that order), drawn in f32 and rounded
    /// to `p.dtype` (nearest, ties to even), so the host holds exactly what the device gets.
    ///
    /// The values are those of one sequential stream (Q's normals, then K's, then V's; two
    /// uniforms per normal); large tensors are generated in parallel chunks cut from that stream,
    /// so the result does not depend on the number of threads. The stream's first 4 Mi values of
    /// the last seed drawn are kept for the process (16 MiB): another problem from the same seed
    /// copies them instead of drawing them again.
    pub fn random(p: &Problem, seed: u64) -> Qkv {
        let (nq, nkv) = (p.q_elems(), p.kv_elems());
        let q = normals(p.dtype, seed, 0, nq);
        let k = normals(p.dtype, seed, nq, nkv);
        let v = normals(p.dtype, seed, nq + nkv, nkv);
        // Sinks (f32 whatever the dtype): the next `heads` normals of the stream, plus 1, so a
        // sink weighs about as much as a typical key.
        let sinks = if p.sinks {
            normals(crate::dtype::Dtype::F32, seed, nq + 2 * nkv, p.heads as u64).into_iter().map(|x| x + 1.0).collect()
        } else {
            Vec::new()
        };
        Qkv { q, k, v, sinks }
    }

    /// True when every value is exactly representable in `dtype`.
    pub fn representable_in(&self, dtype: crate::dtype::Dtype) -> bool {
        [&self.q, &self.k, &self.v]
            .into_iter()
            .all(|t| t.iter().all(|&x| x.is_nan() || dtype.round(x).to_bits() == x.to_bits()))
    }
}

/// Normals `first .. first + n` of the stream of `seed` (those `SplitMix64::new(seed)` gives
/// after `first` calls of `normal`), rounded to `dt`.
///
/// The stream's first [`KEPT_NORMALS`] values of the last seed drawn from the start are kept (as
/// f32, before the dtype's rounding, which is where they are rounded either way): a sweep of
/// shapes from one seed (`memattn check`, the tests) draws the same prefix for every case, and
/// the libm `ln` and `cos` of Box-Muller were a fifth of such a sweep's work. A draw that would
/// not continue the kept prefix (another seed past its start, a gap, or past the limit) is drawn
/// as before and leaves the kept values alone, so no call draws a value it did not ask for.
pub(crate) fn normals(dt: crate::dtype::Dtype, seed: u64, first: u64, n: u64) -> Vec<f32> {
    use std::sync::Mutex;
    static KEPT: Mutex<(u64, Vec<f32>)> = Mutex::new((0, Vec::new()));
    let end = first.saturating_add(n);
    if end <= KEPT_NORMALS {
        // A panic while the lock is held leaves a prefix that is still the stream's own.
        let mut kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
        let (kept_seed, values) = &mut *kept;
        if *kept_seed != seed && first == 0 {
            (*kept_seed, *values) = (seed, Vec::new());
        }
        let have = values.len() as u64;
        if *kept_seed == seed && first <= have {
            if end > have {
                values.extend(normals_f32(seed, have, end - have));
            }
            return values[first as usize..end as usize].iter().map(|&x| dt.round(x)).collect();
        }
    }
    let mut out = normals_f32(seed, first, n);
    dt.round_all(&mut out);
    out
}

/// How many of the stream's first normals [`normals`] keeps (16 MiB as f32): more than every
/// shape of `memattn check` draws.
const KEPT_NORMALS: u64 = 1 << 22;

/// Normals `first .. first + n` of the stream of `seed`, as f32; spread over the cores.
fn normals_f32(seed: u64, first: u64, n: u64) -> Vec<f32> {
    // Chunks of 2^14 values (about half a millisecond of work): big enough to amortise a thread,
    // small enough that the shapes of `memattn check` spread over the cores.
    const CHUNK: usize = 1 << 14;
    let mut out = vec![0.0f32; n as usize];
    let fill = |start: usize, chunk: &mut [f32]| {
        let mut rng = SplitMix64::skipped(seed, 2 * (first + start as u64));
        for x in chunk.iter_mut() {
            *x = rng.normal() as f32;
        }
    };
    let threads = std::thread::available_parallelism().map(|t| t.get()).unwrap_or(1);
    if out.len() <= CHUNK || threads == 1 {
        fill(0, &mut out);
        return out;
    }
    let chunks: Vec<(usize, &mut [f32])> = out.chunks_mut(CHUNK).enumerate().map(|(i, c)| (i * CHUNK, c)).collect();
    let per_thread = chunks.len().div_ceil(threads);
    let mut groups: Vec<Vec<(usize, &mut [f32])>> = Vec::new();
    let mut it = chunks.into_iter().peekable();
    while it.peek().is_some() {
        groups.push(it.by_ref().take(per_thread).collect());
    }
    std::thread::scope(|s| {
        for group in groups {
            s.spawn(|| {
                for (start, chunk) in group {
                    fill(start, chunk);
                }
            });
        }
    });
    out
}

/// Reorders a BSHD tensor into `layout` (a copy for BHSD, unchanged for BSHD).
pub fn to_layout(x: &[f32], layout: Layout, batch: u32, seq: u32, heads: u32, d: u32) -> Vec<f32> {
    permute(x, layout, [batch, seq, heads, d], true)
}

/// Inverse of [`to_layout`]: brings a tensor in `layout` back to BSHD.
pub fn from_layout(x: &[f32], layout: Layout, batch: u32, seq: u32, heads: u32, d: u32) -> Vec<f32> {
    permute(x, layout, [batch, seq, heads, d], false)
}

/// Copies rows of `d` elements between BSHD and `layout` (`to`: BSHD -> layout, else back).
fn permute(x: &[f32], layout: Layout, [batch, seq, heads, d]: [u32; 4], to: bool) -> Vec<f32> {
    match layout {
        Layout::Bshd => x.to_vec(),
        Layout::Bhsd => {
            let (b_, s_, h_, d_) = (batch as usize, seq as usize, heads as usize, d as usize);
            let mut out = vec![0.0f32; x.len()];
            for b in 0..b_ {
                for s in 0..s_ {
                    for h in 0..h_ {
                        let bshd = ((b * s_ + s) * h_ + h) * d_;
                        let bhsd = ((b * h_ + h) * s_ + s) * d_;
                        let (src, dst) = if to { (bshd, bhsd) } else { (bhsd, bshd) };
                        out[dst..dst + d_].copy_from_slice(&x[src..src + d_]);
                    }
                }
            }
            out
        }
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;
    pub fn parallel_generation_is_the_sequential_stream() {
        use crate::dtype::Dtype;
        // Big enough for several chunks per tensor.
        let p = Problem {
            batch: 1,
            heads: 5,
            seq_q: 300,
            seq_kv: 170,
            head_dim: 64,
            dtype: Dtype::Bf16,
            ..Problem::default()
        };
        let x = Qkv::random(&p, 9);
        let mut rng = SplitMix64::new(9);
        let mut seq = |n: u64| (0..n).map(|_| Dtype::Bf16.round(rng.normal() as f32)).collect::<Vec<f32>>();
        assert_eq!(x.q, seq(p.q_elems()));
        assert_eq!(x.k, seq(p.kv_elems()));
        assert_eq!(x.v, seq(p.kv_elems()));
    }

    pub fn kept_normals_are_the_stream_in_any_order_of_draws() {
        use crate::dtype::Dtype;
        // Draws that extend the kept prefix, reuse it, skip past it, start another seed at 0 and
        // past 0, and end past the limit, in f32 and bf16, each against the stream drawn afresh.
        // Other tests draw too (the store is the process's), which only adds orders.
        let fresh = |dt: Dtype, seed: u64, first: u64, n: u64| {
            let mut rng = SplitMix64::skipped(seed, 2 * first);
            (0..n).map(|_| dt.round(rng.normal() as f32).to_bits()).collect::<Vec<u32>>()
        };
        let draws = [
            (Dtype::F32, 501, 0, 1000),
            (Dtype::Bf16, 501, 200, 1500),
            (Dtype::F32, 501, 5000, 10),
            (Dtype::F16, 502, 7, 100),
            (Dtype::Bf16, 501, 0, 40_000),
            (Dtype::F32, 502, 0, 30),
            (Dtype::F32, 501, 10, 30),
            (Dtype::Bf16, 502, 20, 50),
            (Dtype::F32, 502, KEPT_NORMALS - 5, 10),
            (Dtype::F32, 502, 0, 3),
        ];
        for (dt, seed, first, n) in draws {
            let got: Vec<u32> = normals(dt, seed, first, n).iter().map(|x| x.to_bits()).collect();
            assert_eq!(got, fresh(dt, seed, first, n), "{dt} seed {seed} from {first}, {n} values");
        }
    }

    pub fn bhsd_round_trip_and_strides_agree() {
        let (b, s, h, d) = (2u32, 3u32, 4u32, 5u32);
        let x: Vec<f32> = (0..(b * s * h * d)).map(|i| i as f32).collect();
        let y = to_layout(&x, Layout::Bhsd, b, s, h, d);
        assert_ne!(x, y);
        assert_eq!(from_layout(&y, Layout::Bhsd, b, s, h, d), x);
        // Element (1, 2, 3, 4) sits where the kernel's strides say it does.
        let st = Layout::Bhsd.strides(s as u64, h as u64, d as u64);
        let (b1, s2, h3, d4) = (1, 2, 3, 4);
        let logical = ((b1 * s + s2) * h + h3) * d + d4;
        assert_eq!(y[(st.offset(1, 2, 3) + 4) as usize], logical as f32);
    }
}
