//! Analytic device memory per kernel, stated before a run and compared with the measurement after.
//!
//! | buffer | bytes | naive | flash |
//! |---|---|---|---|
//! | Q | `batch·seq_q·heads·d·size` | input | input |
//! | K, V | `batch·seq_kv·heads_kv·d·size` each | input | input |
//! | sinks (with `--sinks`) | `4·heads` | input | input |
//! | ALiBi slopes (with `--alibi`) | `4·heads` | input | input |
//! | cu_seqlens q, kv (varlen) | `4·(batch+1)` each | input | input |
//!
//! Varlen: Q/K/V/O and LSE count the packed totals (`total_q`, `total_kv` rows), and naive's S
//! is `[batch, heads, longest seq_q, longest seq_kv]` (padded).
//! | O | `batch·seq_q·heads·d·size` | output | output |
//! | LSE | `4·batch·heads·seq_q` | workspace | workspace |
//! | S | `4·batch·heads·seq_q·seq_kv` | workspace | — |
//! | tensor maps (the Hopper forward) | 384 | — | workspace |
//!
//! LSE counts as workspace: it is what the fused kernel keeps instead of S (and what a backward
//! pass would need). The naive path also writes LSE (its softmax produces it).

use crate::caps::DeviceCaps;
use crate::problem::{KernelKind, Problem, ProblemError};
use crate::units::human_bytes;

/// Bytes a run allocates on the device, by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct AnalyticBytes {
    /// Q + K + V.
    pub inputs: u64,
    /// O.
    pub outputs: u64,
    /// LSE (both kernels) + S (naive only).
    pub workspace: u64,
    /// LSE alone.
    pub lse: u64,
    /// The naive score matrix S (0 for flash).
    pub scores: u64,
    /// The Hopper forward's three 128-byte TMA tensor maps, in device memory for the launch (0
    /// for every other kernel).
    pub tensor_maps: u64,
    /// `inputs + outputs + workspace`.
    pub total: u64,
}

impl AnalyticBytes {
    /// The bytes a run of `kernel` on `p` allocates, without the Hopper forward's tensor maps
    /// (see [`AnalyticBytes::on`]).
    pub fn new(p: &Problem, kernel: KernelKind) -> Self {
        let es = p.dtype.size_bytes();
        let q = p.q_elems() * es;
        let kv = p.kv_elems() * es;
        let lse = p.rows() * 4;
        let scores = match kernel {
            KernelKind::Naive => p.score_elems() * 4,
            KernelKind::Flash => 0,
        };
        let sinks = if p.sinks { 4 * p.heads as u64 } else { 0 };
        let alibi = if p.alibi { 4 * p.heads as u64 } else { 0 };
        let cu_seqlens = if p.varlen.is_some() { 2 * 4 * (p.batch as u64 + 1) } else { 0 };
        let inputs = q + 2 * kv + sinks + alibi + cu_seqlens;
        let outputs = q;
        let workspace = lse + scores;
        AnalyticBytes { inputs, outputs, workspace, lse, scores, tensor_maps: 0, total: inputs + outputs + workspace }
    }

    /// [`AnalyticBytes::new`] for the kernels a device that runs `target` launches: the Hopper
    /// forward adds its tensor maps to the workspace.
    pub fn on(p: &Problem, kernel: KernelKind, target: impl Into<crate::problem::Target>) -> Self {
        let mut a = AnalyticBytes::new(p, kernel);
        if kernel == KernelKind::Flash && target.into().forward(p.sm90_kernel(), p.dtype.elem(), p.head_dim).is_some() {
            a.tensor_maps = 3 * 128;
            a.workspace += a.tensor_maps;
            a.total += a.tensor_maps;
        }
        a
    }

    /// The memory plan against the device: the run is refused before anything is allocated when
    /// its buffers exceed the device's free memory (the error carries the estimate and its
    /// breakdown).
    pub fn check_fits(&self, kernel: KernelKind, caps: &DeviceCaps) -> Result<(), ProblemError> {
        if self.total > caps.free_memory_bytes {
            return Err(ProblemError::OutOfDeviceMemory {
                kernel,
                needed: self.total,
                needed_h: human_bytes(self.total),
                free: caps.free_memory_bytes,
                free_h: human_bytes(caps.free_memory_bytes),
                breakdown: self.breakdown(),
            });
        }
        Ok(())
    }

    /// `inputs X + outputs Y + workspace Z (S ..., LSE ...)`.
    pub fn breakdown(&self) -> String {
        let mut ws = if self.scores > 0 {
            format!("S {} + LSE {}", human_bytes(self.scores), human_bytes(self.lse))
        } else {
            format!("LSE {}", human_bytes(self.lse))
        };
        if self.tensor_maps > 0 {
            ws.push_str(&format!(" + tensor maps {}", human_bytes(self.tensor_maps)));
        }
        format!(
            "inputs {} + outputs {} + workspace {} ({ws})",
            human_bytes(self.inputs),
            human_bytes(self.outputs),
            human_bytes(self.workspace)
        )
    }
}

/// Device memory as measured around one run.
#[derive(Clone, Debug, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct MeasuredMemory {
    /// Where the figures come from: "vm allocator (exact)" or "nvml (sampled every N us)".
    pub source: String,
    /// Device bytes in use before the run's first allocation.
    pub before_bytes: u64,
    /// Highest device bytes in use during the run.
    pub peak_bytes: u64,
    /// Device bytes in use after the run's buffers were freed.
    pub after_bytes: u64,
    /// `peak - before`: what the run added (compare with the analytic total).
    pub peak_delta_bytes: u64,
    /// NVML only: samples taken, GPU utilisation (max/mean percent) while sampling.
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub samples: Option<u64>,
    /// NVML only: the highest GPU utilisation sampled, in percent.
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub gpu_util_max_percent: Option<u32>,
    /// NVML only: the mean GPU utilisation sampled, in percent.
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub gpu_util_mean_percent: Option<f64>,
    /// CUDA only: `cuMemGetInfo` free bytes before allocation and with all buffers allocated.
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub cuda_free_before_bytes: Option<u64>,
    /// CUDA only: `cuMemGetInfo` free bytes with all buffers allocated.
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub cuda_free_allocated_bytes: Option<u64>,
    /// Notes on how to read the figures (e.g. allocation granularity on CUDA).
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Vec::is_empty"))]
    pub notes: Vec<String>,
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    pub fn flash_workspace_is_lse_only() {
        let p = Problem { batch: 2, heads: 3, seq_q: 100, seq_kv: 70, head_dim: 64, ..Problem::default() };
        let f = AnalyticBytes::new(&p, KernelKind::Flash);
        let n = AnalyticBytes::new(&p, KernelKind::Naive);
        assert_eq!(f.workspace, 4 * 2 * 3 * 100);
        assert_eq!(f.inputs, 4 * (2 * 100 * 3 * 64 + 2 * 2 * 70 * 3 * 64));
        assert_eq!(n.workspace - f.workspace, 4 * 2 * 3 * 100 * 70);
        assert_eq!(n.total - f.total, n.scores);
    }

    pub fn sixteen_bit_tensors_take_two_bytes_lse_four() {
        let p = Problem { batch: 2, heads: 3, seq_q: 100, seq_kv: 70, head_dim: 64, ..Problem::default() };
        for d in [crate::Dtype::Bf16, crate::Dtype::F16] {
            let b = AnalyticBytes::new(&Problem { dtype: d, ..p }, KernelKind::Flash);
            assert_eq!(b.inputs, 2 * (2 * 100 * 3 * 64 + 2 * 2 * 70 * 3 * 64));
            assert_eq!(b.outputs, 2 * 2 * 100 * 3 * 64);
            assert_eq!(b.lse, 4 * 2 * 3 * 100);
            assert_eq!(b.total, b.inputs + b.outputs + b.lse);
        }
    }
}
