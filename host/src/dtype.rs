//! Element types. Only `f32` has kernels today; the enum leaves room for `f16`/`bf16`.

use serde::Serialize;
use std::fmt;
use std::str::FromStr;

/// Element type of Q, K, V and O. LSE is always f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
}

impl Dtype {
    pub const ALL: [Dtype; 1] = [Dtype::F32];

    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
        }
    }

    pub const fn size_bytes(self) -> u64 {
        match self {
            Dtype::F32 => 4,
        }
    }

    /// The safetensors dtype tensors of this type are stored as.
    pub fn safetensors(self) -> safetensors::Dtype {
        match self {
            Dtype::F32 => safetensors::Dtype::F32,
        }
    }

    /// Pass/fail bounds of the verification (see [`crate::verify`]).
    pub const fn tolerance(self) -> Tolerance {
        match self {
            // f32 kernels accumulate in f32 and use `ex2.approx` (2 ulp); against an f64 reference
            // the relative RMS error is ~1e-7..1e-6 for the shapes tested, so 1e-5 leaves a margin
            // of 10x while still catching any indexing or masking bug (those give errors ~1).
            Dtype::F32 => Tolerance { rel_rms: 1e-5, max_abs: 1e-4, lse_rel_rms: 1e-5, lse_max_abs: 1e-4 },
        }
    }
}

/// Verification bounds for one dtype. An output passes when every bound holds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Tolerance {
    /// Bound on ‖o − ref‖ / ‖ref‖ over all checked elements of O.
    pub rel_rms: f64,
    /// Bound on max |o − ref| over all checked elements of O.
    pub max_abs: f64,
    /// Bound on the relative RMS error of the finite LSE values.
    pub lse_rel_rms: f64,
    /// Bound on max |lse − ref| over the finite LSE values.
    pub lse_max_abs: f64,
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unsupported dtype `{0}` (supported: f32; f16/bf16 need the tensor-core kernels, which do not exist yet)")]
pub struct UnknownDtype(pub String);

impl FromStr for Dtype {
    type Err = UnknownDtype;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(Dtype::F32),
            _ => Err(UnknownDtype(s.to_string())),
        }
    }
}
