//! A small seeded generator (SplitMix64) so inputs and row samples are reproducible from `--seed`
//! on every platform, without a dependency.

/// The SplitMix64 generator: its state is a 64-bit counter.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

impl SplitMix64 {
    /// The generator of `seed` (any value, 0 included).
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }
    /// The generator of `seed` after `draws` calls of `next_u64`, in O(1): SplitMix64's state is
    /// a counter, so a stream can be cut into chunks generated in parallel with the same values.
    pub fn skipped(seed: u64, draws: u64) -> Self {
        SplitMix64(seed.wrapping_add(draws.wrapping_mul(GAMMA)))
    }
    /// The next 64 uniformly random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.next_f64(); // (0, 1]
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;
    pub fn reproducible_and_roughly_normal() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        assert_eq!(a.next_u64(), b.next_u64());
        let xs: Vec<f64> = (0..20000).map(|_| a.normal()).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!(mean.abs() < 0.03 && (var - 1.0).abs() < 0.05, "{mean} {var}");
    }

    pub fn skipped_continues_the_same_stream() {
        let mut a = SplitMix64::new(42);
        for _ in 0..1001 {
            a.next_u64();
        }
        let mut b = SplitMix64::skipped(42, 1001);
        assert_eq!((a.next_u64(), a.normal()), (b.next_u64(), b.normal()));
    }
}
