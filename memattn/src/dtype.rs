//! Element types of Q, K, V and O: `f32` (SIMT kernels), `bf16` and `f16` (tensor-core kernels).
//!
//! On the host every tensor is held as `f32`. A 16-bit tensor is held as the `f32` values of its
//! 16-bit elements (rounding to the dtype is done once, when inputs are made or read, with the
//! `half` crate's round-to-nearest-even), so the host-side value is exactly what the device sees;
//! [`Dtype::encode`] and [`Dtype::decode`] convert to and from the device bytes without loss.

use std::fmt;
use std::str::FromStr;

/// Element type of Q, K, V and O. LSE is always f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum Dtype {
    /// IEEE 754 single precision (4 bytes).
    F32,
    /// bfloat16: 8 exponent bits, 8 significant bits (2 bytes).
    Bf16,
    /// IEEE 754 half precision: 5 exponent bits, 11 significant bits (2 bytes).
    F16,
}

impl Dtype {
    /// The three dtypes, f32 first.
    pub const ALL: [Dtype; 3] = [Dtype::F32, Dtype::Bf16, Dtype::F16];

    /// The lowercase name (`f32`, `bf16`, `f16`), as `Display` writes it.
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }

    /// Bytes per element: 4 for f32, 2 for bf16 and f16.
    pub const fn size_bytes(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }

    /// The kernels' element type (the column of the variant table, [`kernels_gpu::variants`]).
    pub const fn elem(self) -> kernels_gpu::Elem {
        match self {
            Dtype::F32 => kernels_gpu::Elem::F32,
            Dtype::Bf16 => kernels_gpu::Elem::Bf16,
            Dtype::F16 => kernels_gpu::Elem::F16,
        }
    }

    /// True for the 16-bit types that run on tensor cores.
    pub const fn is_16bit(self) -> bool {
        matches!(self, Dtype::Bf16 | Dtype::F16)
    }

    /// Unit roundoff `u` of round-to-nearest: half the distance from 1 to the next value
    /// (`2^-24` f32 with 24 significant bits, `2^-8` bf16 with 8, `2^-11` f16 with 11).
    pub fn unit_roundoff(self) -> f64 {
        match self {
            Dtype::F32 => (-24f64).exp2(),
            Dtype::Bf16 => (-8f64).exp2(),
            Dtype::F16 => (-11f64).exp2(),
        }
    }

    /// `x` rounded to this dtype (nearest, ties to even), as an f32. Identity for f32.
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        match self {
            Dtype::F32 => x,
            Dtype::Bf16 => half::bf16::from_f32(x).to_f32(),
            Dtype::F16 => half::f16::from_f32(x).to_f32(),
        }
    }

    /// Every element rounded to this dtype.
    pub fn round_all(self, x: &mut [f32]) {
        if self != Dtype::F32 {
            for v in x {
                *v = self.round(*v);
            }
        }
    }

    /// Little-endian device bytes of `x` in this dtype (16-bit types round each value).
    pub fn encode(self, x: &[f32]) -> Vec<u8> {
        match self {
            Dtype::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Dtype::Bf16 => x.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect(),
            Dtype::F16 => x.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect(),
        }
    }

    /// Values of little-endian device bytes in this dtype (exact: every 16-bit value is an f32).
    pub fn decode(self, bytes: &[u8]) -> Vec<f32> {
        match self {
            Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::Bf16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        }
    }

    /// The fixed pass/fail bounds of f32 runs (see the `memattn` command's `verify` module). The 16-bit types are
    /// judged against a baseline measured on the same inputs, `memattn_cli::verify::tolerance_for`;
    /// their fixed part is only the LSE bound, which is computed in f32 by every kernel.
    pub const fn tolerance(self) -> Tolerance {
        // f32 kernels accumulate in f32 and use `ex2.approx` (2 ulp); against an f64 reference
        // the relative RMS error is ~1e-7..1e-6 for the shapes tested, so 1e-5 leaves a margin
        // of 10x while still catching any indexing or masking bug (those give errors ~1).
        // The max abs bounds are per unit of magnitude: `verify::tolerance_for` multiplies them
        // by max(1, max |ref|) of the tensor.
        Tolerance {
            rel_rms: 1e-5,
            max_abs: 1e-4,
            lse_rel_rms: 1e-5,
            lse_max_abs: 1e-4,
            row_rel_rms: 1e-5,
            row_max_abs: 1e-4,
            lse_row_max_abs: 1e-4,
            rule: "f32: rel RMS max(1e-5, e); max abs max(1e-4, 2e) x max(1, max|ref|); every row: rel RMS max(1e-5, e) and max abs max(1e-4, 2e) of its own scale; e = 8 * 2^-24 * (max|lse| + ln seq_kv), the scores' own f32 rounding",
            baseline_rel_rms_err: None,
            baseline_max_abs_err: None,
        }
    }
}

/// Verification bounds of one run. An output passes when every bound holds.
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Tolerance {
    /// Bound on ‖o − ref‖ / ‖ref‖ over all checked elements of O.
    pub rel_rms: f64,
    /// Bound on max |o − ref| over all checked elements of O.
    pub max_abs: f64,
    /// Bound on the relative RMS error of the finite LSE values.
    pub lse_rel_rms: f64,
    /// Bound on max |lse − ref| over the finite LSE values.
    pub lse_max_abs: f64,
    /// Bound on every checked row's `‖o_r − ref_r‖ / ‖a_r‖`, where `a_r = Σ_j P_j |v_j|` is the
    /// row's own scale ([`crate::reference::Reference::o_abs`]): no row's error can hide behind
    /// another row's magnitude.
    pub row_rel_rms: f64,
    /// Bound on every checked row's `max |o_r − ref_r| / max a_r`.
    pub row_max_abs: f64,
    /// Bound on every finite row's `|lse_r − ref_r| / max(1, |ref_r|)`.
    pub lse_row_max_abs: f64,
    /// How the bounds were set, in words.
    pub rule: &'static str,
    /// 16-bit runs: the errors of naive attention computed in the same dtype on the same inputs
    /// and rows (the baseline the O bounds are twice of).
    pub baseline_rel_rms_err: Option<f64>,
    /// 16-bit runs: the largest absolute error of that baseline on O (`None` for f32).
    pub baseline_max_abs_err: Option<f64>,
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A dtype name `FromStr` does not know (the string given).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unsupported dtype `{0}` (supported: f32, bf16, f16)")]
pub struct UnknownDtype(pub String);

impl FromStr for Dtype {
    type Err = UnknownDtype;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "fp32" => Ok(Dtype::F32),
            "bf16" | "bfloat16" => Ok(Dtype::Bf16),
            "f16" | "float16" | "fp16" | "half" => Ok(Dtype::F16),
            _ => Err(UnknownDtype(s.to_string())),
        }
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    /// `u` is half the gap after 1 by the dtype's own rounding: `1 + 1.01 u` rounds up to the
    /// next value, `1 + 0.99 u` back to 1.
    pub fn unit_roundoff_is_half_the_gap_after_one() {
        for dt in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            let u = dt.unit_roundoff();
            assert_eq!(dt.round((1.0 + 0.99 * u) as f32), 1.0, "{dt}");
            assert_eq!(dt.round((1.0 + 1.01 * u) as f32) as f64, 1.0 + 2.0 * u, "{dt}");
        }
    }

    pub fn rounding_and_bytes_round_trip() {
        // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties to even -> 1.
        assert_eq!(Dtype::Bf16.round(1.0 + 2f32.powi(-8)), 1.0);
        assert_eq!(Dtype::Bf16.round(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6));
        assert_eq!(Dtype::F16.round(1.0 + 2f32.powi(-12)), 1.0);
        assert_eq!(Dtype::F16.round(65520.0), f32::INFINITY);
        for d in Dtype::ALL {
            let x: Vec<f32> = (0..100).map(|i| d.round((i as f32 - 50.0) * 0.37)).collect();
            let b = d.encode(&x);
            assert_eq!(b.len() as u64, 100 * d.size_bytes());
            assert_eq!(d.decode(&b), x, "{d}");
            assert_eq!(d.name().parse::<Dtype>(), Ok(d));
        }
        // Bit patterns: bf16 1.0 = 0x3F80, f16 1.0 = 0x3C00.
        assert_eq!(Dtype::Bf16.encode(&[1.0]), vec![0x80, 0x3F]);
        assert_eq!(Dtype::F16.encode(&[1.0]), vec![0x00, 0x3C]);
        assert!("f8".parse::<Dtype>().unwrap_err().to_string().contains("bf16"));
    }
}
