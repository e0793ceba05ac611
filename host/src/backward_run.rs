//! One measured backward run (`memattn run --backward`, each case of `memattn check
//! --backward` and each side of `compare --backward`): the forward, then the backward of the loss
//! `Σ dO ∘ O` on the same inputs, by the flash kernels or (`--kernel naive`) the naive ones, every
//! gradient verified against the f64 reference gradients ([`crate::reference::grad`]); packed
//! sequences (varlen) through [`Kernels::flash_attn_varlen_backward_into`], verified per
//! sequence as well as whole. The naive backward ([`Kernels::naive_attn_backward_into`])
//! allocates P and dS ([`memattn::attn::naive_attn_backward_workspace`]) instead of the flash
//! workspace; it does not compute the sinks' gradient (sinks still enter dq, dk and dv through
//! LSE).
//!
//! Order of events: refuse what the backward kernels do not support (nothing allocated yet) →
//! state the expected bytes → allocate and upload q, k, v and `dO` → poison O and LSE, run the
//! forward ([`Kernels::flash_attn_into`]) → for each warm-up and measured repetition: poison dQ,
//! dK, dV (and d_sink) with NaN, run [`Kernels::flash_attn_backward_into_with`], time it (in
//! deterministic mode also compare dQ's bits with the first repetition's) → download → free →
//! measure memory → verify O, LSE, dQ, dK, dV (and d_sink) against the f64 reference. The
//! repetitions, the timed forward, the memory bracket and the timing are the
//! [`crate::harness`]'s; this module says what to allocate, poison and launch.
//!
//! Bounds: an f32 run holds every tensor to [`GRAD_REL_TOL`] of its scale. A bf16/f16 run (once
//! the library has a backward in that dtype; [`check_supported`] asks the kernel table) is held
//! to FlashAttention's rule: each tensor's error, whole and per row, at most twice that of a
//! naive backward in the same dtype ([`memattn::verify::grad`]).
//!
//! Memory: besides the tensors the caller holds (q, k, v, dO, the sinks, with varlen the two
//! cu_seqlens; O and LSE of the forward; dQ, dK, dV, d_sink), the backward allocates a workspace
//! ([`memattn::attn::flash_attn_backward_workspace`]): the f32 dQ accumulator (`4 · batch · seq_q
//! · heads · head_dim` bytes; deterministic mode one per key block) and `D = rowsum(dO ∘ O)`
//! (`4 · batch · heads · seq_q`). No `N x N` buffer exists; the VM's allocator measures the peak
//! exactly. Next to it the report states what a naive backward keeps alive, P and dS
//! (`2 · 4 · batch · heads · seq_q · seq_kv` bytes), by the rule the forward's report uses for
//! the naive score matrix.

use crate::backward_sample::{checked_slices, SliceSample};
use crate::device::Device;
use crate::error::Error;
use crate::harness::{allocated, measure, poison, repeat, time_once, Body, Repetitions, POISON};
use crate::inputs::{from_layout, to_layout, Qkv};
use crate::memory::MeasuredMemory;
use crate::problem::Varlen;
use crate::problem::{KernelKind, Problem, ShapeJson};
use crate::reference::grad::{attention_backward, Grads};
use crate::runner::{check_finite_inputs, check_score_range, probe_host_memory, LaunchRecord};
use crate::safetensors_io::InputError;
use crate::timing::Timing;
use memattn::attn::{
    AttnOpts, BwdOpts, DeviceBuffer, Kernels, LseView, LseViewMut, SinksView, SinksViewMut, TensorView, TensorViewMut,
};
use memattn::verify::grad::{check_against_baseline, naive_backward_in_dtype, BaselineCheck, NaiveGrads};
use memattn::Dtype;
use serde::Serialize;
use std::path::Path;

/// The bound every tensor is checked against: `max |got - ref| <= GRAD_REL_TOL · max(max |ref|,
/// 1e-3)` (the reference's largest magnitude of that tensor, floored so an all-zero tensor is
/// not held to 0 exactly). For dq and dk the scale is also at least the largest magnitude of the
/// terms an element sums ([`Grads::dq_abs`], 2 to 5 times `max |ref|` on random inputs): where
/// each row sees one key, the exact dq and dk are 0 but a kernel's are rounding noise of that
/// size. f32 sums of at most a few thousand terms per element measure 1e-7 to
/// 1e-6 of the tensor's scale; 2e-5 leaves a factor of about 20, and a real bug (a dropped `D`,
/// a missing GQA sum, an unwritten element) is off by 1e-2 or more.
pub const GRAD_REL_TOL: f64 = 2e-5;

/// Floor of the scale in [`GRAD_REL_TOL`]'s bound.
pub const SCALE_FLOOR: f64 = 1e-3;

/// The rule in words (printed and in `--json`).
pub const RULE: &str = "max |got - ref| <= t * max(max |ref|, 1e-3) per tensor, against the f64 reference, with \
                        t = max(2e-5, 16 * 2^-24 * (max|lse| + ln seq_kv)) (the scores' own f32 rounding) \
                        (dq, dk: the scale at least the magnitude of the terms summed); every element checked, \
                        NaN (an unwritten, poisoned element) fails";

/// The rule of a bf16/f16 run in words ([`memattn::verify::grad::check_against_baseline`]).
pub const RULE_16BIT: &str = "per tensor, against the f64 reference: max |got - ref| <= max(2 x that of a naive \
                              backward in the same dtype, u * max|ref|), and every row's max error over its own \
                              scale <= max(2 x the naive backward's worst row, u) (u: the dtype's unit roundoff; \
                              2e-5 for the f32 tensors lse, d_sinks); NaN (an unwritten, poisoned element) fails";

/// The rule of a run in `dtype`.
pub fn rule_of(dtype: Dtype) -> &'static str {
    if dtype.is_16bit() {
        RULE_16BIT
    } else {
        RULE
    }
}

/// What the backward can run now, checked before anything is allocated. Each refusal names the
/// limit (exit 2).
pub fn check_supported(p: &Problem, kernel: KernelKind) -> Result<(), Error> {
    let refuse = |why: String| Err(Error::Usage(format!("--backward: {why}")));
    if p.alibi {
        return refuse(
            "ALiBi runs in the forward and decode kernels only; the backward has no ALiBi (leave out --alibi)".into(),
        );
    }
    if kernel == KernelKind::Naive {
        if p.dtype != Dtype::F32 {
            return refuse(format!(
                "the naive backward's kernels are f32 only; got --dtype {}, use --dtype f32 with --kernel naive",
                p.dtype
            ));
        }
        if p.varlen.is_some() {
            return refuse(
                "packed sequences (--seqlens-q/--seqlens-kv, cu_seqlens) run the flash backward only; leave out --kernel naive"
                    .into(),
            );
        }
        let max = kernels_gpu::tiles::NAIVE_MAX_HEAD_DIM;
        if p.head_dim == 0 || p.head_dim > max {
            return refuse(format!("head_dim {}: the naive backward accepts 1..={max}", p.head_dim));
        }
        return Ok(());
    }
    // The kernel table says which dtypes and head dims have backward kernels, so a dtype whose
    // kernels are added is accepted here without a change.
    let dims = kernels_gpu::KernelId::flash_bwd_head_dims(p.dtype.elem());
    if dims.is_empty() {
        let with: Vec<&str> = Dtype::ALL
            .iter()
            .filter(|d| !kernels_gpu::KernelId::flash_bwd_head_dims(d.elem()).is_empty())
            .map(|d| d.name())
            .collect();
        return refuse(format!(
            "there is no {} backward kernel: the backward kernels are {} only; got --dtype {}, use --dtype {}",
            p.dtype,
            with.join("/"),
            p.dtype,
            with.join(" or --dtype ")
        ));
    }
    if kernels_gpu::KernelId::flash_bwd(p.dtype.elem(), p.head_dim).is_none() {
        return refuse(format!(
            "head_dim {} has no backward kernel; the {} backward is compiled for head_dim {} (any other \
             multiple of 8 below the largest runs on the next of them, padded)",
            p.head_dim,
            p.dtype,
            crate::problem::list_and(&dims)
        ));
    }
    Ok(())
}

/// Device bytes the backward run allocates, each term named. On the VM the measured peak equals
/// `total_bytes` exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct BackwardBytes {
    /// The backward these bytes are of: the flash kernels or the naive ones.
    pub kernel: KernelKind,
    /// q, k, v and the upstream gradient dO (in the problem's dtype), the sinks (`4 · heads`)
    /// with sinks, and with varlen the two cu_seqlens (`4 · (sequences + 1)` each).
    pub inputs_bytes: u64,
    /// The forward's O (in the dtype) and LSE (f32), inputs of the backward.
    pub forward_outputs_bytes: u64,
    /// dQ, dK, dV (in the dtype), and (flash) d_sink (`4 · heads`) with sinks.
    pub gradients_bytes: u64,
    /// Flash: dQ accumulators, 1 or in deterministic mode one per key block of the main
    /// kernel. Naive: 0.
    pub dq_slices: u64,
    /// Flash: the f32 dQ accumulators, `dq_slices · 4 · batch · seq_q · heads · head_dim`
    /// (varlen: `total_q` rows).
    pub dq_accum_bytes: u64,
    /// Flash: `D = rowsum(dO ∘ O)`, `4 · batch · heads · seq_q`.
    pub delta_bytes: u64,
    /// Naive: P and dS, allocated, `2 · 4 · batch · heads · seq_q · seq_kv`. Flash: 0.
    pub p_ds_bytes: u64,
    /// What the backward adds beyond its inputs and outputs: flash `dq_accum_bytes +
    /// delta_bytes`, naive `p_ds_bytes`.
    pub workspace_bytes: u64,
    /// Everything at the peak (all of the above are alive during the backward).
    pub total_bytes: u64,
    /// Not allocated: what a naive backward would keep alive instead of the workspace, P and dS
    /// (`N x N` per head, f32): `2 · 4 · batch · heads · seq_q · seq_kv` (twice the naive
    /// forward's score matrix, by the same rule).
    pub naive_p_ds_bytes: u64,
}

impl BackwardBytes {
    /// The bytes of `p`'s flash backward run; `deterministic` as [`BwdOpts::deterministic`]. A
    /// head dim without a backward kernel, or a byte count past `u64`, is an error.
    pub fn new(p: &Problem, deterministic: bool) -> Result<Self, Error> {
        Self::of(p, KernelKind::Flash, deterministic)
    }

    /// The bytes of `p`'s backward run by `kernel` (`deterministic` applies to flash only).
    pub fn of(p: &Problem, kernel: KernelKind, deterministic: bool) -> Result<Self, Error> {
        Self::on(p, kernel, deterministic, u32::MAX)
    }

    /// [`BackwardBytes::of`] on a device whose blocks may opt in to `max_smem_bytes` of shared
    /// memory: the main kernel is the one it allows (`KernelId::flash_bwd_for` of the kernel table), whose
    /// key block sets the deterministic workspace.
    pub fn on(p: &Problem, kernel: KernelKind, deterministic: bool, max_smem_bytes: u32) -> Result<Self, Error> {
        let es = p.dtype.size_bytes();
        let (qn, kn, rows) = (p.q_elems() * es, p.kv_elems() * es, p.rows() * 4);
        let sinks = if p.sinks { 4 * p.heads as u64 } else { 0 };
        let cu_seqlens = if p.varlen.is_some() { 2 * 4 * (p.batch as u64 + 1) } else { 0 };
        let inputs_bytes = 2 * qn + 2 * kn + sinks + cu_seqlens;
        let forward_outputs_bytes = qn + rows;
        // Varlen: one packed batch of total_q rows; the key blocks of the longest sequence.
        let (vb, sq) = match p.varlen {
            Some(_) => (1, p.total_q() as usize),
            None => (p.batch as usize, p.seq_q as usize),
        };
        let q_shape = [vb, sq, p.heads as usize, p.head_dim as usize];
        let naive_p_ds_bytes = memattn::memory::AnalyticBytes::new(p, KernelKind::Naive).scores.saturating_mul(2);
        let (gradients_bytes, dq_slices, dq_accum_bytes, delta_bytes, p_ds_bytes) = match kernel {
            KernelKind::Flash => {
                let ws = memattn::attn::flash_attn_backward_workspace_on(
                    p.dtype,
                    q_shape,
                    p.seq_kv as usize,
                    deterministic,
                    max_smem_bytes,
                )?;
                (qn + 2 * kn + sinks, ws.dq_slices, ws.dq_accum_bytes, ws.delta_bytes, 0)
            }
            KernelKind::Naive => {
                let ws = memattn::attn::naive_attn_backward_workspace(q_shape, p.seq_kv as usize)?;
                (qn + 2 * kn, 0, 0, 0, ws.total_bytes)
            }
        };
        let workspace_bytes = dq_accum_bytes + delta_bytes + p_ds_bytes;
        let total = [inputs_bytes, forward_outputs_bytes, gradients_bytes, workspace_bytes]
            .iter()
            .try_fold(0u64, |t, x| t.checked_add(*x))
            .ok_or_else(|| Error::Usage("the backward's device bytes overflow a 64-bit count".into()))?;
        Ok(BackwardBytes {
            kernel,
            inputs_bytes,
            forward_outputs_bytes,
            gradients_bytes,
            dq_slices,
            dq_accum_bytes,
            delta_bytes,
            p_ds_bytes,
            workspace_bytes,
            total_bytes: total,
            naive_p_ds_bytes,
        })
    }
}

/// One tensor compared with the f64 reference.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TensorCheck {
    pub tensor: &'static str,
    pub max_abs_err: f64,
    /// `max_abs_err` over the tensor's scale, `max(max |ref|, 1e-3)` (dq, dk: at least the
    /// magnitude of the terms summed).
    pub max_rel_err: f64,
    pub max_abs_ref: f64,
    /// The bound on `max_abs_err`.
    pub bound: f64,
    /// Elements that are NaN or infinite where the reference is finite (or that disagree on
    /// `-inf`, for LSE): unwritten elements keep the NaN poison.
    pub mismatched_non_finite: u64,
    pub passed: bool,
    /// bf16/f16 runs: the 2x rule's figures (the naive backward's errors, the row bound, the
    /// worst row); `bound` is then its whole-tensor bound.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub two_x: Option<BaselineCheck>,
}

/// Compares `got` with `want` under [`GRAD_REL_TOL`]. Equal infinities (LSE's `-inf` of a row
/// that sees no key) agree; any other non-finite value is a mismatch.
pub fn check_tensor(tensor: &'static str, got: &[f32], want: &[f64]) -> TensorCheck {
    check_tensor_scaled(tensor, got, want, &[])
}

/// [`check_tensor`] with the scale at least the largest of `magnitude` (the terms' magnitude of
/// dq or dk, [`Grads::dq_abs`]; empty for none).
pub fn check_tensor_scaled(tensor: &'static str, got: &[f32], want: &[f64], magnitude: &[f64]) -> TensorCheck {
    check_tensor_with(tensor, got, want, magnitude, GRAD_REL_TOL)
}

/// [`check_tensor_scaled`] with the relative bound `rel_tol` (at least [`GRAD_REL_TOL`]: an
/// f32 run's, grown with the scores' magnitude, [`memattn::verify::f32_score_rounding`]).
pub fn check_tensor_with(
    tensor: &'static str,
    got: &[f32],
    want: &[f64],
    magnitude: &[f64],
    rel_tol: f64,
) -> TensorCheck {
    let rel_tol = rel_tol.max(GRAD_REL_TOL);
    let max_abs_ref = want.iter().filter(|w| w.is_finite()).fold(0f64, |m, w| m.max(w.abs()));
    let scale = memattn::verify::grad::scale_of(want, magnitude, SCALE_FLOOR);
    let (mut max_abs_err, mut bad) = (0f64, (got.len() != want.len()) as u64);
    for (&g, &w) in got.iter().zip(want) {
        let g = g as f64;
        if !w.is_finite() || !g.is_finite() {
            bad += (g != w) as u64;
            continue;
        }
        max_abs_err = max_abs_err.max((g - w).abs());
    }
    let bound = rel_tol * scale;
    TensorCheck {
        tensor,
        max_abs_err,
        max_rel_err: max_abs_err / scale,
        max_abs_ref,
        bound,
        mismatched_non_finite: bad,
        passed: bad == 0 && max_abs_err <= bound,
        two_x: None,
    }
}

/// Compares `got` with `want` by the 2x rule of a 16-bit run against `baseline`, the naive
/// backward's tensor ([`check_against_baseline`]); `magnitude` as in [`check_tensor_scaled`],
/// `row_len` elements per row, `floor` relative.
pub fn check_tensor_2x(t: Tensor<'_>) -> TensorCheck {
    let Tensor { name: tensor, got, want, baseline, magnitude, row_len, floor } = t;
    let c = check_against_baseline(tensor, got, want, baseline, magnitude, row_len, floor);
    TensorCheck {
        tensor,
        max_abs_err: c.max_abs_err,
        max_rel_err: c.max_abs_err / c.scale,
        max_abs_ref: want.iter().filter(|w| w.is_finite()).fold(0f64, |m, w| m.max(w.abs())),
        bound: c.bound,
        mismatched_non_finite: c.mismatched_non_finite,
        passed: c.passed,
        two_x: Some(c),
    }
}

/// One packed sequence of a varlen run, checked on its own: its rows of O, LSE, dq and its keys'
/// rows of dk, dv, each against its own scale (a short sequence's gradients cannot hide behind a
/// long one's magnitude).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SequenceCheck {
    pub sequence: u32,
    pub seq_q: u32,
    pub seq_kv: u32,
    /// dq, dk, dv of this sequence (O and LSE are judged once, by the forward's rule, whose
    /// per-row bounds cover every sequence).
    pub checks: Vec<TensorCheck>,
    pub passed: bool,
}

/// Device outputs, BSHD: O, LSE `[batch, heads, seq_q]`, dQ (like q), dK and dV (like k).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct BackwardOutputs {
    pub o: Vec<f32>,
    pub lse: Vec<f32>,
    pub dq: Vec<f32>,
    pub dk: Vec<f32>,
    pub dv: Vec<f32>,
    /// `[heads]`, empty without sinks.
    pub d_sinks: Vec<f32>,
}

/// Everything a backward run measured. Field names are the `--json` contract of
/// `run --backward`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BackwardReport {
    pub backend: String,
    pub device: String,
    pub kernel: KernelKind,
    pub dtype: crate::dtype::Dtype,
    pub shape: ShapeJson,
    pub inputs: String,
    /// Where dO came from: "random normal (seed N)" or "given (tensor `do`)".
    pub d_o: String,
    /// True when O, LSE, dQ, dK, dV (and d_sink) all passed and, in deterministic mode, every
    /// repetition's dQ had the same bits.
    pub verified: bool,
    /// Whether dQ was summed deterministically (`--deterministic`).
    pub deterministic: bool,
    /// Deterministic mode: whether every repetition (warm-up included) wrote bitwise the same
    /// dQ, dK, dV and d_sink; `None` in atomic mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bitwise_reproducible: Option<bool>,
    /// Repetitions compared for `bitwise_reproducible`.
    pub repetitions: u64,
    /// Query rows whose O, LSE and dQ were checked (with the dK and dV of their keys): every row,
    /// or past the reference's budget those of [`BackwardReport::checked_slices`].
    pub checked_rows: u64,
    pub total_rows: u64,
    /// The (batch, KV head) slices checked whole, when not every slice was
    /// ([`crate::backward_sample`]; `--check-rows all` checks every one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checked_slices: Option<SliceSample>,
    /// O, LSE, dq, dk, dv (and d_sinks) in that order (of the checked slices).
    pub checks: Vec<TensorCheck>,
    /// Varlen: every sequence checked on its own (empty otherwise).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sequences: Vec<SequenceCheck>,
    pub rule: &'static str,
    /// The forward, one launch (milliseconds).
    pub forward_time_ms: f64,
    /// Median of the backward's measured repetitions (its three launches).
    pub backward_time_ms: f64,
    pub timing: Timing,
    /// FLOPs of the backward's five matrix products (`2.5 ×` the forward's).
    pub backward_flops: f64,
    pub expected_bytes: BackwardBytes,
    /// Measured: device bytes the run added at its peak.
    pub peak_device_bytes: u64,
    /// `peak_device_bytes == expected_bytes.total_bytes` (exact on the VM).
    pub memory_as_expected: bool,
    pub memory: MeasuredMemory,
    /// The backward's launches of the last repetition (preprocess, main, dQ convert).
    pub launches: Vec<LaunchRecord>,
    pub ptx_sha256: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    #[serde(skip)]
    pub outputs: BackwardOutputs,
}

/// The upstream gradient of a run without a `do` tensor: the normals that follow q, k and v in
/// the stream of `seed` (so changing the seed changes all four), rounded to the problem's dtype
/// (so the host holds exactly what the device gets).
pub fn random_d_o(p: &Problem, seed: u64) -> Vec<f32> {
    // After q, k, v and the sinks' normals.
    let first = p.q_elems() + 2 * p.kv_elems() + if p.sinks { p.heads as u64 } else { 0 };
    let mut rng = memattn::rng::SplitMix64::skipped(seed, 2 * first);
    (0..p.q_elems()).map(|_| p.dtype.round(rng.normal() as f32)).collect()
}

/// The shape of q-like tensors in files: `[batch, seq_q, heads, head_dim]`, varlen `[total_q,
/// heads, head_dim]`.
fn q_file_shape(p: &Problem) -> Vec<usize> {
    let (h, d) = (p.heads as usize, p.head_dim as usize);
    match p.varlen {
        Some(_) => vec![p.total_q() as usize, h, d],
        None => vec![p.batch as usize, p.seq_q as usize, h, d],
    }
}

/// The shape of k-like tensors in files: `[batch, seq_kv, heads_kv, head_dim]`, varlen
/// `[total_kv, heads_kv, head_dim]`.
fn kv_file_shape(p: &Problem) -> Vec<usize> {
    let (hk, d) = (p.kv_heads() as usize, p.head_dim as usize);
    match p.varlen {
        Some(_) => vec![p.total_kv() as usize, hk, d],
        None => vec![p.batch as usize, p.seq_kv as usize, hk, d],
    }
}

/// Reads the optional upstream gradient `do` (in the problem's dtype, shaped like `q`: `[batch,
/// seq_q, heads, head_dim]`, varlen `[total_q, heads, head_dim]`) from the `--inputs` file.
pub fn read_d_o(path: &Path, p: &Problem) -> Result<Option<Vec<f32>>, Error> {
    use crate::safetensors_io::SafetensorsDtype;
    let bytes = crate::files::read_regular(path, crate::files::MAX_INPUT_BYTES, "input file")?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| InputError::Malformed { path: path.into(), message: e.to_string() })?;
    let Ok(t) = st.tensor("do") else { return Ok(None) };
    let want = q_file_shape(p);
    if t.dtype() != p.dtype.safetensors() {
        return Err(InputError::WrongShape {
            path: path.into(),
            name: "do",
            got: t.shape().to_vec(),
            expected: format!(
                "{:?} {want:?} (got dtype {:?}; dO is in the dtype of q, {})",
                p.dtype.safetensors(),
                t.dtype(),
                p.dtype
            ),
        }
        .into());
    }
    if t.shape() != want {
        return Err(InputError::WrongShape {
            path: path.into(),
            name: "do",
            got: t.shape().to_vec(),
            expected: format!("{want:?}, the shape of q (the upstream gradient of O)"),
        }
        .into());
    }
    let d_o = p.dtype.decode(t.data());
    if let Some(e) = d_o.iter().position(|v| !v.is_finite()) {
        return Err(Error::Usage(format!(
            "input tensor `do` has a non-finite value {} at element {e}; NaN and +-inf are refused",
            d_o[e]
        )));
    }
    Ok(Some(d_o))
}

/// Writes o, lse, dq, dk, dv (all F32: a 16-bit value is an f32 exactly; BSHD, lse `[batch,
/// heads, seq_q]`; varlen packed, `[total, heads, head_dim]` and lse `[heads, total_q]`) and with
/// sinks d_sinks (`[heads]`, when the run computed it: not the naive backward) atomically
/// ([`crate::files::write_atomic`]): an existing file is
/// replaced whole or not at all.
pub fn write_outputs(path: &Path, p: &Problem, out: &BackwardOutputs) -> Result<(), Error> {
    let err = |e: safetensors::SafeTensorError| InputError::Write { path: path.into(), message: e.to_string() };
    let (b, h) = (p.batch as usize, p.heads as usize);
    let (qs, ks) = (q_file_shape(p), kv_file_shape(p));
    let lse_shape = match p.varlen {
        Some(_) => vec![h, p.total_q() as usize],
        None => vec![b, h, p.seq_q as usize],
    };
    let enc = |x: &[f32]| Dtype::F32.encode(x);
    let (ob, lb, qb, kb, vb) = (enc(&out.o), enc(&out.lse), enc(&out.dq), enc(&out.dk), enc(&out.dv));
    let f32t = safetensors::Dtype::F32;
    let view = |shape: Vec<usize>, data| safetensors::tensor::TensorView::new(f32t, shape, data).map_err(err);
    let sb = enc(&out.d_sinks);
    let mut tensors = vec![
        ("o", view(qs.clone(), &ob)?),
        ("lse", view(lse_shape, &lb)?),
        ("dq", view(qs, &qb)?),
        ("dk", view(ks.clone(), &kb)?),
        ("dv", view(ks, &vb)?),
    ];
    // Shaped by what the run computed: the naive backward computes no d_sinks, so none is
    // written (the report says so), rather than failing after a verified run.
    if p.sinks && out.d_sinks.len() == h {
        tensors.push(("d_sinks", view(vec![h], &sb)?));
    }
    let bytes = safetensors::serialize(tensors, None).map_err(err)?;
    crate::files::write_atomic(path, &bytes, "output file")?;
    Ok(())
}

/// Runs the forward and the backward of `spec` on `dev`, with `inputs` (BSHD) or random inputs
/// from `spec.seed`, and `d_o` (BSHD, like q) or a random upstream gradient. The launches go
/// through the library's entry points on kernels lent `dev` for the run ([`Kernels::scoped`]).
/// `deterministic`: [`BwdOpts::deterministic`].
pub fn run_backward(
    dev: &mut dyn Device,
    spec: &crate::runner::RunSpec,
    inputs: Option<&Qkv>,
    d_o: Option<&[f32]>,
    deterministic: bool,
) -> Result<BackwardReport, Error> {
    let p = spec.problem;
    let kernel = spec.kernel;
    check_supported(&p, kernel)?;
    if kernel == KernelKind::Naive && deterministic {
        return Err(Error::Usage(
            "--deterministic is for the flash backward's dQ sum; the naive backward has no atomic adds \
             (it is the same bits run to run): leave out --deterministic or --kernel naive"
                .into(),
        ));
    }
    let caps = dev.caps()?;
    p.validate(kernel, &caps)?;
    let expected = BackwardBytes::on(&p, kernel, deterministic, caps.max_dynamic_smem_bytes)?;
    if let Some(x) = inputs {
        if x.q.len() as u64 != p.q_elems() || x.k.len() as u64 != p.kv_elems() || x.v.len() as u64 != p.kv_elems() {
            return Err(Error::Usage(format!(
                "input tensors have {}/{}/{} elements, the problem needs {}/{}/{}",
                x.q.len(),
                x.k.len(),
                x.v.len(),
                p.q_elems(),
                p.kv_elems(),
                p.kv_elems()
            )));
        }
    }
    if let Some(x) = inputs {
        if p.sinks && x.sinks.len() != p.heads as usize {
            return Err(Error::Usage(format!("{} sink logits for {} heads (one per head)", x.sinks.len(), p.heads)));
        }
    }
    if let Some(g) = d_o {
        if g.len() as u64 != p.q_elems() {
            return Err(Error::Usage(format!("dO has {} elements, q has {}", g.len(), p.q_elems())));
        }
    }
    // Host copies at the peak: inputs and dO in f32 (twice: given and device layout), the f64
    // reference (q, k, v, dO, O, dq, dk, dv and its working copies), the five downloads, and
    // for 16-bit the naive backward's rounded copies and outputs.
    let elems = (2 * p.q_elems()).saturating_add(2 * p.kv_elems());
    let naive = if p.dtype.is_16bit() { 8 } else { 0 };
    let host_bytes = elems.saturating_mul(4 + 4 + 8 + 8 + 8 + naive).saturating_add(expected.total_bytes);
    probe_host_memory(host_bytes, "the host copies of the backward problem")?;
    let generated;
    let (x, inputs_desc) = match inputs {
        Some(x) => (x, "given".to_string()),
        None => {
            generated = Qkv::random(&p, spec.seed);
            (&generated, format!("random normal (seed {})", spec.seed))
        }
    };
    let drawn;
    let (d_o, d_o_desc) = match d_o {
        Some(g) => (g, "given (tensor `do`)".to_string()),
        None => {
            drawn = random_d_o(&p, spec.seed);
            (drawn.as_slice(), format!("random normal (seed {}, after q, k, v)", spec.seed))
        }
    };
    check_finite_inputs(&p, x)?;
    let mut warnings = Vec::new();
    warnings.extend(check_score_range(&p, x, &spec.check)?);

    let reps = Repetitions::resolve(dev, spec.warmup, spec.repeats)?;
    let m = measure(dev, reps, None, |k| launch_measured(k, kernel, &p, x, d_o, reps, deterministic))?;
    let (forward_ms, out, same_bits) = m.out;
    let (timing, memory) = (m.timing, m.memory);

    // Past the reference's budget a dense problem is checked on whole (batch, KV head) slices.
    let sample = checked_slices(&p, &spec.check);
    let gathered;
    let (vp, vx, vd_o, vout) = match &sample {
        Some(s) => {
            gathered = (s.gather_inputs(&p, x), s.gather_q(&p, d_o), sampled_outputs(s, &p, &out));
            (s.problem(&p), &gathered.0, gathered.1.as_slice(), &gathered.2)
        }
        None => (p, x, d_o, &out),
    };
    let (want, baseline) = reference_and_baseline(&vp, vx, vd_o)?;
    let mut checks = verify(&vp, vout, &want, baseline.as_ref());
    if kernel == KernelKind::Naive && p.sinks {
        checks.retain(|c| c.tensor != "d_sinks");
        warnings.push("the naive backward does not compute d_sinks (the sinks enter dq, dk and dv through LSE)".into());
    }
    // One verdict per output: O and LSE are the forward's outputs, judged by the forward's rule
    // (`memattn::verify`, what `run` applies to the same inputs: whole tensor and every row on its
    // own scale, which covers each sequence), not again by the gradients' rule.
    let forward = forward_verdict(&vp, vx, vout);
    for c in checks.iter_mut().filter(|c| matches!(c.tensor, "o" | "lse")) {
        c.passed = forward.passed;
    }
    if !forward.passed {
        warnings.extend(forward.failures.iter().map(|f| format!("forward (O, LSE): {f}")));
    }
    let mut sequences = verify_sequences(&vp, vout, &want, baseline.as_ref());
    for s in &mut sequences {
        s.checks.retain(|c| !matches!(c.tensor, "o" | "lse"));
        s.passed = s.checks.iter().all(|c| c.passed);
    }
    let bitwise_reproducible = deterministic.then_some(same_bits);
    let verified =
        checks.iter().all(|c| c.passed) && sequences.iter().all(|s| s.passed) && bitwise_reproducible != Some(false);
    Ok(BackwardReport {
        backend: dev.backend().name().to_string(),
        device: dev.name(),
        kernel,
        dtype: p.dtype,
        shape: p.shape_json(),
        inputs: inputs_desc,
        d_o: d_o_desc,
        verified,
        deterministic,
        bitwise_reproducible,
        repetitions: reps.total(),
        checked_rows: sample.as_ref().map_or(p.rows(), |s| s.rows(&p)),
        total_rows: p.rows(),
        checked_slices: sample,
        checks,
        sequences,
        rule: rule_of(p.dtype),
        forward_time_ms: forward_ms,
        backward_time_ms: timing.median_ms,
        timing,
        backward_flops: 2.5 * p.flops(),
        expected_bytes: expected,
        peak_device_bytes: memory.peak_delta_bytes,
        memory_as_expected: memory.peak_delta_bytes == expected.total_bytes,
        memory,
        launches: m.launches,
        ptx_sha256: dev.ptx().sha256.clone(),
        warnings,
        outputs: out,
    })
}

/// The device's outputs restricted to the slices of `s`.
fn sampled_outputs(s: &SliceSample, p: &Problem, out: &BackwardOutputs) -> BackwardOutputs {
    BackwardOutputs {
        o: s.gather_q(p, &out.o),
        lse: s.gather_lse(p, &out.lse),
        dq: s.gather_q(p, &out.dq),
        dk: s.gather_kv(p, &out.dk),
        dv: s.gather_kv(p, &out.dv),
        d_sinks: s.gather_heads(p, &out.d_sinks),
    }
}

/// The f64 reference gradients of `p` and, for a 16-bit run, the naive backward in its dtype,
/// side by side on two threads.
fn reference_and_baseline(p: &Problem, x: &Qkv, d_o: &[f32]) -> Result<(Grads, Option<NaiveGrads>), Error> {
    let sinks: &[f32] = if p.sinks { &x.sinks } else { &[] };
    std::thread::scope(|s| {
        let naive = p.dtype.is_16bit().then(|| s.spawn(|| naive_backward_in_dtype(p, &x.q, &x.k, &x.v, d_o, sinks)));
        let want = attention_backward(p, &x.q, &x.k, &x.v, d_o, sinks).map_err(Error::Usage);
        let baseline = match naive {
            Some(h) => Some(h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)).map_err(Error::Usage)?),
            None => None,
        };
        Ok((want?, baseline))
    })
}

/// One tensor of a run to check: the device's values, the f64 reference, the naive backward's
/// values (16-bit runs; empty for f32), the terms' magnitude (dq, dk; else empty), the row
/// length and the 2x rule's relative floor.
#[derive(Clone, Copy)]
pub struct Tensor<'a> {
    pub name: &'static str,
    pub got: &'a [f32],
    pub want: &'a [f64],
    pub baseline: &'a [f32],
    pub magnitude: &'a [f64],
    pub row_len: usize,
    pub floor: f64,
}

/// O, LSE, the three gradients and with sinks d_sinks of a run.
fn tensors<'a>(
    p: &Problem,
    out: &'a BackwardOutputs,
    want: &'a Grads,
    base: Option<&'a NaiveGrads>,
) -> Vec<Tensor<'a>> {
    let d = p.head_dim as usize;
    // f32: GRAD_REL_TOL, grown like the forward's bounds with the scores' own f32 rounding (large
    // scores: a large scale); 16-bit: the dtype's floor.
    let f32_tol = GRAD_REL_TOL.max(2.0 * memattn::verify::f32_score_rounding(&want.lse, p.seq_kv));
    let u = memattn::verify::grad::floor_of(p.dtype, f32_tol);
    let b = |f: fn(&NaiveGrads) -> &Vec<f32>| base.map_or(&[][..], |n| f(n).as_slice());
    let t = |name, got: &'a [f32], want: &'a [f64], baseline, magnitude: &'a [f64], row_len, floor| Tensor {
        name,
        got,
        want,
        baseline,
        magnitude,
        row_len,
        floor,
    };
    let mut all = vec![
        t("o", &out.o, &want.o, b(|n| &n.o), &[], d, u),
        t("lse", &out.lse, &want.lse, b(|n| &n.lse), &[], 1, GRAD_REL_TOL),
        t("dq", &out.dq, &want.dq, b(|n| &n.dq), &want.dq_abs, d, u),
        t("dk", &out.dk, &want.dk, b(|n| &n.dk), &want.dk_abs, d, u),
        t("dv", &out.dv, &want.dv, b(|n| &n.dv), &[], d, u),
    ];
    if !want.dsinks.is_empty() {
        // f32, but a sum over the rows' D, which a 16-bit run computes from its 16-bit O: the
        // dtype's floor.
        all.push(t("d_sinks", &out.d_sinks, &want.dsinks, b(|n| &n.dsinks), &want.dsinks_abs, 1, u));
    }
    all
}

/// One tensor by the rule of the run: [`check_tensor_scaled`] (f32), or the 2x rule against the
/// naive backward (16-bit).
fn check_one(t: Tensor<'_>, sixteen: bool) -> TensorCheck {
    if sixteen {
        check_tensor_2x(t)
    } else {
        check_tensor_with(t.name, t.got, t.want, t.magnitude, t.floor)
    }
}

/// The forward's verdict on the backward run's O and LSE: [`memattn::verify::verify`] against
/// the f64 reference of every row, under [`memattn::verify::tolerance_for`] — the rule `run`
/// applies to the same inputs.
pub fn forward_verdict(p: &Problem, x: &Qkv, out: &BackwardOutputs) -> memattn::verify::Verification {
    let reference = memattn::reference::reference(p, x, &memattn::reference::RowSelection::All);
    let tol = memattn::verify::tolerance_for(p, x, &reference);
    memattn::verify::verify(p, &out.o, &out.lse, &reference, &tol)
}

/// O, LSE and the three gradients (and with sinks d_sinks) against the f64 reference; for a
/// 16-bit run (`baseline`, the naive backward in the dtype, given) by the 2x rule.
pub fn verify(p: &Problem, out: &BackwardOutputs, want: &Grads, baseline: Option<&NaiveGrads>) -> Vec<TensorCheck> {
    tensors(p, out, want, baseline).into_iter().map(|t| check_one(t, baseline.is_some())).collect()
}

/// Varlen: each sequence's rows of O, LSE, dq (and its keys' rows of dk, dv) checked on their
/// own, by the rule of [`verify`]; empty for a padded batch. (d_sinks sums over every sequence
/// and is checked whole only.)
pub fn verify_sequences<'a>(
    p: &Problem,
    out: &'a BackwardOutputs,
    want: &'a Grads,
    baseline: Option<&'a NaiveGrads>,
) -> Vec<SequenceCheck> {
    let Some(vl) = p.varlen else { return Vec::new() };
    let (h, hk, d) = (p.heads as usize, p.kv_heads() as usize, p.head_dim as usize);
    let total_q = p.total_q() as usize;
    let (cu_q, cu_k) = (crate::problem::Varlen::cu(vl.seqlens_q), crate::problem::Varlen::cu(vl.seqlens_kv));
    let mut seqs = Vec::new();
    for s in 0..p.batch as usize {
        let (q0, q1, k0, k1) = (cu_q[s] as usize, cu_q[s + 1] as usize, cu_k[s] as usize, cu_k[s + 1] as usize);
        // LSE is [heads, total_q]: the sequence's span of every head.
        let lse_idx: Vec<usize> = (0..h).flat_map(|hh| (q0..q1).map(move |i| hh * total_q + i)).collect();
        let gather_f = |x: &[f32]| lse_idx.iter().filter_map(|&i| x.get(i).copied()).collect::<Vec<f32>>();
        let gather_d = |x: &[f64]| lse_idx.iter().filter_map(|&i| x.get(i).copied()).collect::<Vec<f64>>();
        let mut checks = Vec::new();
        for t in tensors(p, out, want, baseline) {
            let (lo, hi) = match t.name {
                "o" | "dq" => (q0 * h * d, q1 * h * d),
                "dk" | "dv" => (k0 * hk * d, k1 * hk * d),
                "lse" => {
                    let (got, w, base) = (gather_f(t.got), gather_d(t.want), gather_f(t.baseline));
                    let one = Tensor { got: &got, want: &w, baseline: &base, ..t };
                    checks.push(check_one(one, baseline.is_some()));
                    continue;
                }
                _ => continue, // d_sinks: a sum over every sequence
            };
            let cut = |x: &'a [f32]| x.get(lo..hi).unwrap_or(&[]);
            let cut_d = |x: &'a [f64]| x.get(lo..hi).unwrap_or(&[]);
            let one = Tensor {
                got: cut(t.got),
                want: cut_d(t.want),
                baseline: cut(t.baseline),
                magnitude: cut_d(t.magnitude),
                ..t
            };
            checks.push(check_one(one, baseline.is_some()));
        }
        let passed = checks.iter().all(|c| c.passed);
        seqs.push(SequenceCheck {
            sequence: s as u32,
            seq_q: vl.seqlens_q[s],
            seq_kv: vl.seqlens_kv[s],
            checks,
            passed,
        });
    }
    seqs
}

/// Allocates and uploads the run's buffers on `k` (q, k, v, dO, O, dq, dk, dv in the problem's
/// dtype; LSE, the sinks and d_sinks f32; varlen: the two cu_seqlens); poisons O and LSE and
/// runs the forward once ([`time_once`]); then hands the harness ([`repeat`]) the backward's
/// steps: poison dQ, dK, dV (and d_sinks), run the backward, and in deterministic mode compare
/// the gradients' bits with the first repetition's (untimed). Downloads everything after the
/// last one: the forward's time, the outputs (BSHD), and whether every repetition's gradients
/// had the bits of the first. The buffers are freed when this returns.
fn launch_measured(
    k: &Kernels,
    kernel: KernelKind,
    p: &Problem,
    x: &Qkv,
    d_o: &[f32],
    reps: Repetitions,
    deterministic: bool,
) -> Body<(f64, BackwardOutputs, bool)> {
    let (b, h, hk, d) = (p.batch, p.heads, p.kv_heads(), p.head_dim);
    let (dt, es) = (p.dtype, p.dtype.size_bytes());
    let lay_q = |t: &[f32]| to_layout(t, p.layout, b, p.seq_q, h, d);
    let lay_k = |t: &[f32]| to_layout(t, p.layout, b, p.seq_kv, hk, d);
    let (q, kb, v, gb) = (
        k.upload_as(dt, &lay_q(&x.q))?,
        k.upload_as(dt, &lay_k(&x.k))?,
        k.upload_as(dt, &lay_k(&x.v))?,
        k.upload_as(dt, &lay_q(d_o))?,
    );
    let (qn, kn, rows) = (p.q_elems(), p.kv_elems(), p.rows());
    let o = k.alloc(qn * es)?;
    let lse = k.alloc(rows * 4)?;
    let (dq, dk, dv) = (k.alloc(qn * es)?, k.alloc(kn * es)?, k.alloc(kn * es)?);
    let hs = if p.sinks { p.heads as u64 } else { 0 };
    let sinks = if p.sinks { Some(k.upload_as(Dtype::F32, &x.sinks)?) } else { None };
    let d_sinks = if p.sinks && kernel == KernelKind::Flash { Some(k.alloc(hs * 4)?) } else { None };
    let cu = match p.varlen {
        Some(vl) => {
            Some((k.index_tensor(&Varlen::cu(vl.seqlens_q), None)?, k.index_tensor(&Varlen::cu(vl.seqlens_kv), None)?))
        }
        None => None,
    };
    allocated(k)?;

    let (h, hk, d) = (h as usize, hk as usize, d as usize);
    // Views: a padded batch, or varlen's one packed batch of total_q / total_kv rows.
    let (vb, sq, skv) = match p.varlen {
        Some(_) => (1, p.total_q() as usize, p.total_kv() as usize),
        None => (b as usize, p.seq_q as usize, p.seq_kv as usize),
    };
    let strides = |s: kernels_gpu::abi::Strides| [s.batch as usize, s.seq as usize, s.head as usize, 1];
    let (qst, kst) = (strides(p.q_strides()), strides(p.kv_strides()));
    let view = |buf, shape, st| TensorView::device(buf, dt, shape).map(|t| t.with_strides(st));
    let view_mut = |buf, shape, st| TensorViewMut::device(buf, dt, shape).map(|t| t.with_strides(st));
    let (qs, ks) = ([vb, sq, h, d], [vb, skv, hk, d]);
    let (qv, kv, vv, gv) = (view(&q, qs, qst)?, view(&kb, ks, kst)?, view(&v, ks, kst)?, view(&gb, qs, qst)?);
    let mut opts = AttnOpts::new().causal(p.causal).window_size(p.window.0, p.window.1);
    if let Some(scale) = p.scale {
        opts = opts.softmax_scale(scale);
    }
    if p.softcap != 0.0 {
        opts = opts.softcap(p.softcap);
    }
    let sinks_view = sinks.as_ref().map(|s| SinksView::vm(s, h)).transpose()?;
    if let Some(s) = &sinks_view {
        opts = opts.sinks(s);
    }
    // Varlen: the longest sequence's lengths, as the forward took them.
    let (max_q, max_kv) = (p.seq_q as usize, p.seq_kv as usize);

    let poison_forward = |k: &Kernels| {
        k.with_device(|dev| {
            poison(dev, o.ptr(), qn * es, dt)?;
            dev.fill_u32(lse.ptr(), rows, POISON)
        })
    };
    let forward = || {
        let (mut ov_w, mut lv_w) = (view_mut(&o, qs, qst)?, LseViewMut::vm(&lse, vb, h, sq)?);
        match &cu {
            None if kernel == KernelKind::Naive => {
                // The naive forward's score matrix lives for the forward only: freed before the
                // backward allocates P and dS (twice its size), so it adds nothing to the peak.
                let scores = k.alloc(p.score_elems() * 4)?;
                let mut sv = TensorViewMut::device(&scores, Dtype::F32, [vb, h, sq, skv])?;
                k.naive_attn_into(&qv, &kv, &vv, &mut ov_w, &mut lv_w, &mut sv, &opts)
            }
            None => k.flash_attn_into(&qv, &kv, &vv, &mut ov_w, &mut lv_w, &opts),
            Some((cq, ck)) => {
                k.flash_attn_varlen_into(&qv, &kv, &vv, cq, ck, max_q, max_kv, &mut ov_w, &mut lv_w, &opts)
            }
        }
    };
    let forward_ms = time_once(k, poison_forward, forward)?;

    let ov = view(&o, qs, qst)?;
    let lv = LseView::vm(&lse, vb, h, sq)?;
    let (mut dqv, mut dkv, mut dvv) = (view_mut(&dq, qs, qst)?, view_mut(&dk, ks, kst)?, view_mut(&dv, ks, kst)?);
    let read = |buf: &DeviceBuffer, dtype: Dtype, n: u64| buf.read_f32(dtype, n as usize);
    let poison_gradients = |k: &Kernels| {
        k.with_device(|dev| {
            for (buf, n) in [(&dq, qn), (&dk, kn), (&dv, kn)] {
                poison(dev, buf.ptr(), n * es, dt)?;
            }
            if let Some(ds) = &d_sinks {
                dev.fill_u32(ds.ptr(), hs, POISON)?;
            }
            Ok(())
        })
    };
    let backward = || {
        let mut bwd = BwdOpts::new().deterministic(deterministic);
        if let Some(ds) = &d_sinks {
            bwd = bwd.d_sinks(SinksViewMut::vm(ds, h)?);
        }
        match &cu {
            None if kernel == KernelKind::Naive => {
                k.naive_attn_backward_into(&qv, &kv, &vv, &ov, &lv, &gv, &mut dqv, &mut dkv, &mut dvv, &opts)
            }
            None => {
                k.flash_attn_backward_into_with(&qv, &kv, &vv, &ov, &lv, &gv, &mut dqv, &mut dkv, &mut dvv, &opts, &bwd)
            }
            Some((cq, ck)) => k.flash_attn_varlen_backward_into(
                &qv, &kv, &vv, cq, ck, max_q, max_kv, &ov, &lv, &gv, &mut dqv, &mut dkv, &mut dvv, &opts, &bwd,
            ),
        }
    };
    let (mut first_bits, mut same_bits) = (None, true);
    let compare_bits = |_: &Kernels| {
        if deterministic {
            // Outside the timed region: every repetition's gradients, bit for bit.
            let mut bits = Vec::new();
            for (buf, n) in [(&dq, qn), (&dk, kn), (&dv, kn)] {
                bits.extend(read(buf, dt, n)?.iter().map(|x| x.to_bits()));
            }
            if let Some(ds) = &d_sinks {
                bits.extend(read(ds, Dtype::F32, hs)?.iter().map(|x| x.to_bits()));
            }
            match &first_bits {
                None => first_bits = Some(bits),
                Some(f) => same_bits &= *f == bits,
            }
        }
        Ok(())
    };
    let repeated = repeat(k, reps, poison_gradients, backward, compare_bits)?;
    let back_q = |t: Vec<f32>| from_layout(&t, p.layout, b, p.seq_q, h as u32, d as u32);
    let back_k = |t: Vec<f32>| from_layout(&t, p.layout, b, p.seq_kv, hk as u32, d as u32);
    let out = BackwardOutputs {
        o: back_q(read(&o, dt, qn)?),
        lse: read(&lse, Dtype::F32, rows)?,
        dq: back_q(read(&dq, dt, qn)?),
        dk: back_k(read(&dk, dt, kn)?),
        dv: back_k(read(&dv, dt, kn)?),
        d_sinks: match &d_sinks {
            Some(ds) => read(ds, Dtype::F32, hs)?,
            None => Vec::new(),
        },
    };
    Ok((repeated, (forward_ms, out, same_bits)))
}

/// `a / b` in words: "12.5x" or, below 1, "0.25x".
fn ratio(a: u64, b: u64) -> String {
    if b == 0 {
        return "n/a".into();
    }
    let x = a as f64 / b as f64;
    if x >= 10.0 {
        format!("{x:.0}x")
    } else {
        format!("{x:.2}x")
    }
}

/// The human summary of a backward run.
pub fn summary(r: &BackwardReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let e = &r.expected_bytes;
    let _ = writeln!(s, "inputs: {}; dO: {}", r.inputs, r.d_o);
    let _ = writeln!(s, "gradients vs the f64 reference ({})", r.rule);
    if let Some(sample) = &r.checked_slices {
        let list = |v: &[u32]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",");
        let _ = writeln!(
            s,
            "  checked {} of {} query rows: batches [{}] x KV heads [{}], each slice whole (--check-rows all: every one)",
            r.checked_rows,
            r.total_rows,
            list(&sample.batches),
            list(&sample.kv_heads)
        );
    }
    let _ = writeln!(s, "  tensor  max abs err   max rel err   bound        result");
    for c in &r.checks {
        let result = match (c.passed, c.mismatched_non_finite) {
            (true, _) => "pass".to_string(),
            (false, 0) => "FAIL".to_string(),
            (false, n) => format!("FAIL ({n} non-finite: unwritten or NaN)"),
        };
        let _ = writeln!(
            s,
            "  {:<6}  {:<12.3e}  {:<12.3e}  {:<11.3e}  {result}",
            c.tensor, c.max_abs_err, c.max_rel_err, c.bound
        );
    }
    if !r.sequences.is_empty() {
        let _ = writeln!(s, "  each sequence on its own (the worst tensor, error / bound):");
    }
    for q in &r.sequences {
        // The tensor closest to (or furthest over) its bound.
        let ratio =
            |c: &TensorCheck| if c.passed { c.max_abs_err / c.bound.max(f64::MIN_POSITIVE) } else { f64::INFINITY };
        let worst = q.checks.iter().max_by(|a, b| ratio(a).total_cmp(&ratio(b)));
        let what = match worst {
            Some(c) => format!("{:<6} {:.3e} / {:.3e}", c.tensor, c.max_abs_err, c.bound),
            None => "-".into(),
        };
        let failed: Vec<&str> = q.checks.iter().filter(|c| !c.passed).map(|c| c.tensor).collect();
        let result = if failed.is_empty() { "pass".to_string() } else { format!("FAIL ({})", failed.join(", ")) };
        let _ = writeln!(s, "  sequence {} (seq_q {}, seq_kv {}): {what}  {result}", q.sequence, q.seq_q, q.seq_kv);
    }
    let with_sinks = r.shape.sinks;
    let (sinks, d_sinks) = if with_sinks { (", sinks", ", d_sinks") } else { ("", "") };
    let d_sinks = if e.kernel == KernelKind::Naive { "" } else { d_sinks };
    let cu = if r.sequences.is_empty() { "" } else { ", cu_seqlens" };
    let workspace = match e.kernel {
        KernelKind::Naive => format!("P {} + dS {}", e.p_ds_bytes / 2, e.p_ds_bytes / 2),
        KernelKind::Flash if e.dq_slices > 1 => {
            format!("dQ accumulators {} x {} + D {}", e.dq_slices, e.dq_accum_bytes / e.dq_slices, e.delta_bytes)
        }
        KernelKind::Flash => format!("dQ accumulator {} + D {}", e.dq_accum_bytes, e.delta_bytes),
    };
    let _ = writeln!(
        s,
        "memory: expected {} B = inputs (q, k, v, dO{sinks}{cu}) {} + forward O, LSE {} + dq, dk, dv{d_sinks} {} + backward \
         workspace {} ({workspace}); measured peak {} B ({})",
        e.total_bytes,
        e.inputs_bytes,
        e.forward_outputs_bytes,
        e.gradients_bytes,
        e.workspace_bytes,
        r.peak_device_bytes,
        if r.memory_as_expected { "as expected" } else { "differs" }
    );
    if e.kernel == KernelKind::Flash {
        let _ = writeln!(
            s,
            "naive backward: P and dS (N x N per head, f32) would keep {} B alive, {} the flash backward's workspace of {} B",
            e.naive_p_ds_bytes,
            ratio(e.naive_p_ds_bytes, e.workspace_bytes),
            e.workspace_bytes
        );
    }
    match r.bitwise_reproducible {
        Some(true) => {
            let _ = writeln!(s, "deterministic: {} repetitions, gradients bitwise identical", r.repetitions);
        }
        Some(false) => {
            let _ = writeln!(s, "deterministic: the gradients' bits DIFFER between the {} repetitions", r.repetitions);
        }
        None => {}
    }
    let _ = writeln!(
        s,
        "time: forward {:.3} ms, backward {:.3} ms (median of {}, {})",
        r.forward_time_ms,
        r.backward_time_ms,
        r.timing.samples_ms.len(),
        r.timing.clock
    );
    for w in &r.warnings {
        let _ = writeln!(s, "warning: {w}");
    }
    let _ = writeln!(s, "{}", if r.verified { "verified" } else { "NOT VERIFIED" });
    s
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    pub fn a_tensor_passes_within_the_bound_and_fails_past_it_or_on_nan() {
        let want = [0.5f64, -2.0, 0.0];
        // Bound: 2e-5 * max|ref| = 4e-5.
        assert!(check_tensor("dq", &[0.5, -2.0 + 3e-5, 0.0], &want).passed);
        let c = check_tensor("dq", &[0.5, -2.0 + 6e-5, 0.0], &want);
        assert!(!c.passed && (c.max_abs_err - 6e-5).abs() < 1e-6 && (c.bound - 4e-5).abs() < 1e-12, "{c:?}");
        let c = check_tensor("dq", &[0.5, f32::NAN, 0.0], &want);
        assert!(!c.passed && c.mismatched_non_finite == 1, "{c:?}");
        // A missing element is a mismatch, not a silent pass.
        assert!(!check_tensor("dq", &[0.5, -2.0], &want).passed);
        // An all-zero reference is held to the floor, 2e-5 * 1e-3.
        assert!(check_tensor("dv", &[1e-8, 0.0], &[0.0, 0.0]).passed);
        assert!(!check_tensor("dv", &[1e-7, 0.0], &[0.0, 0.0]).passed);
    }

    pub fn lse_infinities_must_agree() {
        let want = [f64::NEG_INFINITY, 1.0];
        assert!(check_tensor("lse", &[f32::NEG_INFINITY, 1.0], &want).passed);
        assert!(!check_tensor("lse", &[0.0, 1.0], &want).passed);
        assert!(!check_tensor("lse", &[f32::NEG_INFINITY, f32::NEG_INFINITY], &want).passed);
    }

    pub fn expected_bytes_name_every_buffer() {
        // batch 2, heads 4 over 2 K/V heads, seq_q 3, seq_kv 5, d 64.
        let p = Problem { batch: 2, heads: 4, heads_kv: Some(2), seq_q: 3, seq_kv: 5, ..Problem::default() };
        let e = BackwardBytes::new(&p, false).unwrap();
        let (qn, kn, rows) = (2 * 3 * 4 * 64 * 4u64, 2 * 5 * 2 * 64 * 4u64, 2 * 4 * 3 * 4u64);
        assert_eq!(e.dq_accum_bytes, 6144);
        assert_eq!(e.delta_bytes, 96);
        assert_eq!(e.workspace_bytes, 6240);
        assert_eq!(e.total_bytes, 5 * qn + 4 * kn + 2 * rows);
        // P and dS: 2 x 4 B x batch 2 x heads 4 x 3 x 5.
        assert_eq!(e.naive_p_ds_bytes, 2 * 4 * 2 * 4 * 3 * 5);
        // Deterministic, 70 keys at d=64 (32 per key block): 3 accumulators; sinks add 4 B per
        // head to the inputs and to the gradients.
        let p = Problem { seq_kv: 70, sinks: true, ..p };
        let e = BackwardBytes::new(&p, true).unwrap();
        assert_eq!((e.dq_slices, e.dq_accum_bytes), (3, 3 * 6144));
        let kn = 2 * 70 * 2 * 64 * 4u64;
        assert_eq!(e.total_bytes, 5 * qn + 4 * kn + 2 * rows + 2 * 16 + 2 * 6144);
        // Naive: P and dS allocated instead of the dQ accumulator and D; no d_sinks.
        let n = BackwardBytes::of(&p, KernelKind::Naive, false).unwrap();
        let pds = 2 * 4 * 2 * 4 * 3 * 70;
        assert_eq!((n.p_ds_bytes, n.workspace_bytes, n.dq_accum_bytes, n.delta_bytes), (pds, pds, 0, 0));
        assert_eq!(n.gradients_bytes, qn + 2 * kn);
        assert_eq!(n.total_bytes, 4 * qn + 4 * kn + rows + 16 + pds);
        assert_eq!(n.p_ds_bytes, n.naive_p_ds_bytes);
    }

    /// Device-like outputs from the reference (rounded to f32, or `round`ed further).
    fn outputs_of(want: &Grads, round: impl Fn(f64) -> f32) -> BackwardOutputs {
        let r = |x: &[f64]| x.iter().map(|&v| round(v)).collect::<Vec<f32>>();
        BackwardOutputs {
            o: r(&want.o),
            lse: want.lse.iter().map(|&v| v as f32).collect(),
            dq: r(&want.dq),
            dk: r(&want.dk),
            dv: r(&want.dv),
            d_sinks: want.dsinks.iter().map(|&v| v as f32).collect(),
        }
    }

    pub fn a_short_sequence_is_held_to_its_own_scale() {
        // Sequence 1's dO is 1000x sequence 0's, so are its gradients: sequence 0's dq 1 % wrong
        // stays under the whole tensor's bound, not under its own.
        let base = Problem { heads: 2, heads_kv: Some(1), head_dim: 8, causal: true, ..Problem::default() };
        let p = Problem::varlen(base, &[3, 0, 6], &[4, 2, 6]).unwrap();
        let x = Qkv::random(&p, 3);
        let mut d_o = random_d_o(&p, 3);
        for g in &mut d_o[3 * 2 * 8..] {
            *g *= 1000.0;
        }
        let want = attention_backward(&p, &x.q, &x.k, &x.v, &d_o, &[]).unwrap();
        let mut out = outputs_of(&want, |v| v as f32);
        assert!(verify(&p, &out, &want, None).iter().all(|c| c.passed));
        assert!(verify_sequences(&p, &out, &want, None).iter().all(|s| s.passed));
        for g in &mut out.dq[..3 * 2 * 8] {
            *g *= 1.01;
        }
        assert!(verify(&p, &out, &want, None).iter().all(|c| c.passed), "the whole-tensor check alone passes");
        let seqs = verify_sequences(&p, &out, &want, None);
        assert_eq!(seqs.iter().map(|s| s.passed).collect::<Vec<_>>(), [false, true, true]);
        assert!(!seqs[0].checks.iter().find(|c| c.tensor == "dq").unwrap().passed);
        // A padded batch has no per-sequence check.
        assert!(verify_sequences(&base, &out, &want, None).is_empty());
    }

    pub fn a_16_bit_run_is_held_to_twice_the_naive_backward() {
        // bf16, GQA, sinks, fully masked rows, varlen: the exact gradients rounded to bf16 once
        // pass; the naive backward's errors times twelve fail, whole and per sequence.
        let base = Problem {
            heads: 4,
            heads_kv: Some(2),
            head_dim: 16,
            causal: true,
            sinks: true,
            dtype: Dtype::Bf16,
            ..Problem::default()
        };
        let p = Problem::varlen(base, &[9, 0, 20], &[4, 3, 25]).unwrap();
        let x = Qkv::random(&p, 8);
        let d_o = random_d_o(&p, 8);
        assert!(d_o.iter().all(|&g| Dtype::Bf16.round(g) == g), "dO is drawn in the dtype");
        let want = attention_backward(&p, &x.q, &x.k, &x.v, &d_o, &x.sinks).unwrap();
        let naive = naive_backward_in_dtype(&p, &x.q, &x.k, &x.v, &d_o, &x.sinks).unwrap();
        let good = outputs_of(&want, |v| Dtype::Bf16.round(v as f32));
        let checks = verify(&p, &good, &want, Some(&naive));
        assert!(checks.iter().all(|c| c.passed && c.two_x.is_some()), "{checks:?}");
        assert!(verify_sequences(&p, &good, &want, Some(&naive)).iter().all(|s| s.passed));
        // Twelve times: the floor `u · scale` (scale: the terms' magnitude, about 6x max |dq| at
        // d 16) lies above six times the naive error here; twelve times is over both bounds.
        let tripled = |g: &[f32], w: &[f64]| -> Vec<f32> {
            g.iter().zip(w).map(|(&a, &b)| (b + 12.0 * (a as f64 - b)) as f32).collect()
        };
        let bad = BackwardOutputs { dq: tripled(&naive.dq, &want.dq), ..good.clone() };
        let checks = verify(&p, &bad, &want, Some(&naive));
        let failed: Vec<&str> = checks.iter().filter(|c| !c.passed).map(|c| c.tensor).collect();
        assert_eq!(failed, ["dq"], "{checks:?}");
        assert!(verify_sequences(&p, &bad, &want, Some(&naive)).iter().any(|s| !s.passed));
    }

    pub fn refusals_name_the_limit() {
        let p = Problem::default();
        assert!(check_supported(&p, KernelKind::Flash).is_ok());
        // Packed sequences run the varlen backward.
        assert!(check_supported(&Problem::varlen(p, &[3, 0], &[2, 4]).unwrap(), KernelKind::Flash).is_ok());
        let msg = |p: Problem, k| check_supported(&p, k).unwrap_err().to_string();
        assert!(check_supported(&p, KernelKind::Naive).is_ok());
        assert!(check_supported(&Problem { head_dim: 80, ..p }, KernelKind::Naive).is_ok());
        assert!(msg(Problem { head_dim: 300, ..p }, KernelKind::Naive).contains("1..=256"));
        assert!(msg(Problem { dtype: Dtype::F16, ..p }, KernelKind::Naive).contains("f32 only"));
        // bf16/f16 on tensor cores at the head dims they have.
        assert!(check_supported(&Problem { dtype: Dtype::Bf16, ..p }, KernelKind::Flash).is_ok());
        assert!(msg(Problem { dtype: Dtype::F16, head_dim: 192, ..p }, KernelKind::Flash).contains("32, 64 and 128"));
        assert!(msg(Problem { head_dim: 84, ..p }, KernelKind::Flash).contains("32, 64, 96, 128, 192 and 256"));
        // Padded: the next compiled head dim; bf16/f16 have none past 128.
        assert!(check_supported(&Problem { head_dim: 80, ..p }, KernelKind::Flash).is_ok());
        assert!(check_supported(&Problem { dtype: Dtype::Bf16, head_dim: 120, ..p }, KernelKind::Flash).is_ok());
        assert!(msg(Problem { dtype: Dtype::Bf16, head_dim: 160, ..p }, KernelKind::Flash).contains("32, 64 and 128"));
        assert!(check_supported(&Problem { sinks: true, ..p }, KernelKind::Flash).is_ok());
    }
}
