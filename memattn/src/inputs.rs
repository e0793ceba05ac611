//! Host-side tensors: Q, K, V in the logical `[batch, seq, heads, head_dim]` (BSHD) order, random
//! or loaded from a file, and conversion to and from the device layout.

use crate::problem::{Layout, Problem};
use crate::rng::SplitMix64;

/// Q, K and V of one problem, BSHD, as f32 values (for a 16-bit problem: values of the dtype); K
/// and V have `heads_kv` heads. `sinks`: one f32 logit per query head, or empty for none.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Qkv {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub sinks: Vec<f32>,
}

impl Qkv {
    /// Standard-normal inputs from `seed` (Q, K, V drawn in that order), drawn in f32 and rounded
    /// to `p.dtype` (nearest, ties to even), so the host holds exactly what the device gets.
    ///
    /// The values are those of one sequential stream (Q's normals, then K's, then V's; two
    /// uniforms per normal); large tensors are generated in parallel chunks cut from that stream,
    /// so the result does not depend on the number of threads.
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
/// after `first` calls of `normal`), rounded to `dt`; spread over the cores.
pub(crate) fn normals(dt: crate::dtype::Dtype, seed: u64, first: u64, n: u64) -> Vec<f32> {
    // Chunks of 2^14 values (about half a millisecond of work): big enough to amortise a thread,
    // small enough that the shapes of `memattn check` spread over the cores.
    const CHUNK: usize = 1 << 14;
    let mut out = vec![0.0f32; n as usize];
    let fill = |start: usize, chunk: &mut [f32]| {
        let mut rng = SplitMix64::skipped(seed, 2 * (first + start as u64));
        for x in chunk.iter_mut() {
            *x = dt.round(rng.normal() as f32);
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

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn parallel_generation_is_the_sequential_stream() {
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

    #[test]
    fn bhsd_round_trip_and_strides_agree() {
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
