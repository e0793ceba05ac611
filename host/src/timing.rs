//! Timing: medians of repeated launches and throughput.

use serde::Serialize;

/// Times of the measured repetitions of one run (warm-up excluded).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Timing {
    pub warmup: u32,
    pub repeats: u32,
    /// How the time was taken: "cuda events" or "host wall clock (VM)".
    pub clock: String,
    pub samples_ms: Vec<f64>,
    pub median_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
}

impl Timing {
    pub fn new(warmup: u32, clock: &str, samples_ms: Vec<f64>) -> Timing {
        let median_ms = median(&samples_ms);
        let min_ms = samples_ms.iter().copied().fold(f64::INFINITY, f64::min);
        let max_ms = samples_ms.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        Timing { warmup, repeats: samples_ms.len() as u32, clock: clock.into(), samples_ms, median_ms, min_ms, max_ms }
    }
}

/// Median (mean of the middle two for an even count; NaN for none).
pub fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// TFLOP/s for `flops` in `ms` milliseconds.
pub fn tflops(flops: f64, ms: f64) -> f64 {
    if ms > 0.0 {
        flops / (ms * 1e-3) / 1e12
    } else {
        0.0
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;
    pub fn medians() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!((tflops(2e12, 1000.0) - 2.0).abs() < 1e-12);
    }
}
