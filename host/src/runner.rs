//! One measured run of one kernel on one device, verified against the CPU reference.
//!
//! Order of events: validate the problem against the device (nothing allocated yet) → state the
//! analytic bytes → allocate and upload → for each warm-up and measured repetition: poison O, LSE
//! (and S) with NaN, launch, time → download → free → measure memory → verify. The repetitions,
//! the memory bracket and the timing are the [`crate::harness`]'s; this module says what to
//! allocate, poison and launch, and verifies O and LSE.

use crate::device::Device;
use crate::dtype::Tolerance;
use crate::error::Error;
use crate::harness::{allocated, measure, repeat, Body, Repetitions};
use crate::inputs::{from_layout, to_layout, Qkv};
use crate::memory::{AnalyticBytes, MeasuredMemory};
use crate::problem::{KernelKind, Problem, ShapeJson, Varlen};
use crate::reference::{reference, RowSelection};
use crate::timing::{tflops, Timing};
use crate::verify::{tolerance_for, verify, ErrorStats, Verification};
use memattn::attn::{AttnError, AttnOpts, DeviceBuffer, Kernels, LseViewMut, SinksView, TensorView, TensorViewMut};
use memattn::Dtype;
use serde::Serialize;

pub use crate::harness::{
    bank_lines, poison, sector_lines, sector_report, BankLine, LaunchRecord, SectorLine, MAX_LAUNCHES, POISON,
    POISON_16,
};

/// What to run.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSpec {
    pub problem: Problem,
    pub kernel: KernelKind,
    /// Seed of the random inputs (ignored when inputs are given).
    pub seed: u64,
    /// None: the device's default.
    pub warmup: Option<u32>,
    pub repeats: Option<u32>,
    pub check: RowSelection,
    /// VM only, flash only, not varlen: launch only the blocks that hold the checked rows (the
    /// others write nothing and stay poisoned; the VM counts are of the blocks that ran). For
    /// shapes too large to run whole in the VM (`memattn check --large`).
    pub sampled_blocks: bool,
    /// Compute the f64 reference (and the dtype's naive baseline) on another thread while the
    /// kernel runs, instead of after it. The results are the same; the wall-clock time is shorter
    /// on a machine with idle cores, but the VM's interpreter timings then share the cores with
    /// the reference. `memattn check` sets it (it reports no timings); `run` and `compare` do not.
    pub reference_alongside: bool,
}

impl RunSpec {
    pub fn new(problem: Problem, kernel: KernelKind) -> Self {
        RunSpec {
            problem,
            kernel,
            seed: 0,
            warmup: None,
            repeats: None,
            check: RowSelection::auto(0),
            sampled_blocks: false,
            reference_alongside: false,
        }
    }
}

/// The blocks of the flash launch that hold the rows `spec.check` selects
/// ([`RunSpec::sampled_blocks`]), and the run's warning saying so.
fn checked_blocks(
    p: &Problem,
    spec: &RunSpec,
    arch: memattn::problem::Target,
) -> Result<(memattn::device::BlockSubset, String), Error> {
    if spec.kernel != KernelKind::Flash || p.varlen.is_some() {
        return Err(Error::Usage("a sampled launch runs the flash kernel of a dense (not varlen) problem".into()));
    }
    let launches = p.launches_on(KernelKind::Flash, arch)?;
    let [l] = launches.as_slice() else {
        return Err(Error::Usage("a sampled launch needs a single-kernel flash problem".into()));
    };
    let br = l.kernel.variant().block_rows();
    let rows = spec.check.rows(p);
    let mut blocks: Vec<[u32; 3]> = rows.iter().map(|r| [r.i / br, r.h, r.b]).collect();
    blocks.dedup();
    let total: u64 = l.dims.grid.iter().map(|&g| g as u64).product();
    let warning = format!(
        "sampled launch: {} of {total} blocks of {} ran, those of the {} checked rows; the other rows are not \
         computed, and the VM counts are of the blocks that ran",
        blocks.len(),
        l.kernel.name(),
        rows.len()
    );
    Ok((memattn::device::BlockSubset { kernel: l.kernel.name().to_string(), blocks }, warning))
}

/// Device outputs of the last repetition, BSHD O (values of the problem's dtype) and
/// `[batch, heads, seq_q]` LSE.
#[derive(Clone, Debug, PartialEq)]
pub struct RunOutputs {
    pub o: Vec<f32>,
    pub lse: Vec<f32>,
}

/// Everything a run measured. Field names are the `--json` contract.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunReport {
    pub backend: String,
    pub device: String,
    pub kernel: KernelKind,
    pub dtype: crate::dtype::Dtype,
    pub shape: ShapeJson,
    pub inputs: String,
    pub verified: bool,
    pub max_abs_err: f64,
    pub max_rel_err: f64,
    pub rel_rms_err: f64,
    pub lse_err: ErrorStats,
    pub verification: Verification,
    /// The bounds O and LSE were checked against, and how they were set.
    pub tolerance: Tolerance,
    /// bf16/f16: relative RMS error of O of naive attention computed in the dtype on the same
    /// inputs and rows (see [`crate::verify`]); `null` for f32.
    pub baseline_rel_rms_err: Option<f64>,
    /// bf16/f16: `rel_rms_err / baseline_rel_rms_err` (passes at <= 2, unless under the floor).
    pub error_ratio: Option<f64>,
    /// Median over the measured repetitions of one run (all launches of the kernel).
    pub time_ms: f64,
    pub timing: Timing,
    pub flops: f64,
    pub tflops: f64,
    pub analytic_bytes: AnalyticBytes,
    /// Measured: device bytes the run added at its peak.
    pub peak_device_bytes: u64,
    pub memory: MeasuredMemory,
    /// VM only: instructions executed (per thread) by one run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vm_thread_instructions: Option<u64>,
    /// VM only: bytes one run's threads read from global memory (no cache model: L2 and HBM
    /// together), the traffic a kernel's tiling decides.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vm_global_bytes_read: Option<u64>,
    /// VM only: bytes one run's threads wrote to global memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vm_global_bytes_written: Option<u64>,
    pub launches: Vec<LaunchRecord>,
    pub ptx_sha256: String,
    /// Warnings about the inputs (e.g. scores that may overflow f32 on unchecked rows).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    #[serde(skip)]
    pub outputs: RunOutputs,
    #[serde(skip)]
    pub trace: Vec<ptx_vm::TraceEntry>,
}

/// Refuses NaN and ±inf inputs before anything runs: the kernels' result would be undefined and
/// the verification could only report it as a confusing mismatch. Names the tensor and its first
/// non-finite element (BSHD index).
pub fn check_finite_inputs(p: &Problem, x: &Qkv) -> Result<(), Error> {
    for (name, t, seq) in [("q", &x.q, p.seq_q), ("k", &x.k, p.seq_kv), ("v", &x.v, p.seq_kv)] {
        if let Some(e) = t.iter().position(|v| !v.is_finite()) {
            let count = t.iter().filter(|v| !v.is_finite()).count();
            let (d, h) = (p.head_dim as usize, p.heads as usize);
            let (dd, rest) = (e % d, e / d);
            let (hh, rest) = (rest % h, rest / h);
            let (ss, bb) = (rest % seq as usize, rest / seq as usize);
            return Err(Error::Usage(format!(
                "input tensor `{name}` has a non-finite value {} at element {e} = [batch {bb}, seq {ss}, head {hh}, dim {dd}] \
                     ({count} non-finite in all); NaN and +-inf inputs are refused",
                t[e]
            )));
        }
    }
    Ok(())
}

/// Scores the kernels compute in f32 (`scale · q·k`, also `q·k` alone, and the exp2 argument,
/// `log2(e)` times larger) must stay under this, or they overflow to inf.
pub const MAX_SCORE: f64 = f32::MAX as f64 / 2.0;

/// Checks that no score overflows f32. Cheap bound first (Cauchy-Schwarz: `|scale|·max‖q‖·max‖k‖`
/// per head); only when it is over the limit are the scores of the checked rows computed
/// exactly. Returns an error when a checked row's score overflows, and a warning when only the
/// bound does (unchecked rows might).
pub fn check_score_range(p: &Problem, x: &Qkv, selection: &RowSelection) -> Result<Option<String>, Error> {
    let (hh, d) = (p.heads as usize, p.head_dim as usize);
    let (nq, nk) = (p.seq_q as usize, p.seq_kv as usize);
    let scale = (p.softmax_scale() as f64).abs();
    let norms = |t: &[f32], seq: usize| -> Vec<f64> {
        // max ‖row‖ per (batch, head)
        let mut m = vec![0f64; p.batch as usize * hh];
        for (r, row) in t.chunks_exact(d).enumerate() {
            let (h, b) = (r % hh, r / hh / seq);
            let n = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt();
            m[b * hh + h] = m[b * hh + h].max(n);
        }
        m
    };
    let (qn, kn) = (norms(&x.q, nq), norms(&x.k, nk));
    let bound = qn.iter().zip(&kn).map(|(a, b)| a * b * scale.max(1.0)).fold(0f64, f64::max);
    if bound < MAX_SCORE {
        return Ok(None);
    }
    for row in selection.rows(p) {
        let (b, h, i) = (row.b as usize, row.h as usize, row.i as usize);
        let q = &x.q[((b * nq + i) * hh + h) * d..][..d];
        for j in 0..p.keys_seen(row.i) as usize {
            let k = &x.k[((b * nk + j) * hh + h) * d..][..d];
            let dot: f64 = q.iter().zip(k).map(|(&a, &c)| a as f64 * c as f64).sum();
            let s = dot.abs() * scale.max(1.0);
            if s >= MAX_SCORE {
                return Err(Error::Usage(format!(
                    "scores overflow f32: |{}q.k| = {s:.3e} for batch {b} head {h} query {i} key {j} (softmax scale {}), \
                     over the limit {MAX_SCORE:.3e} (f32::MAX / 2, which leaves room for the kernels' log2(e) factor); \
                     use a smaller --scale or smaller inputs",
                    if scale > 1.0 { "scale*" } else { "" },
                    p.softmax_scale()
                )));
            }
        }
    }
    Ok(Some(format!(
        "scores may overflow f32 on rows that are not checked: |scale|*max|q|*max|k| = {bound:.3e} >= {MAX_SCORE:.3e} \
                     (the checked rows are fine; --check-rows all checks every row)"
    )))
}

/// Tries to reserve `bytes` of host memory (released at once), so a problem whose host-side
/// copies cannot fit is reported with its size instead of aborting the process later.
pub fn probe_host_memory(bytes: u64, what: &str) -> Result<(), Error> {
    crate::files::try_bytes(bytes, what)?;
    Ok(())
}

/// Runs `spec` on `dev`, with `inputs` (BSHD) or random inputs from `spec.seed`. The launches
/// go through the library's entry points ([`memattn::attn::Kernels::flash_attn_into`], its
/// varlen and naive forms) on kernels lent `dev` for the run ([`Kernels::scoped`]): the one
/// validation and the one launch path every program uses.
pub fn run(dev: &mut dyn Device, spec: &RunSpec, inputs: Option<&Qkv>) -> Result<RunReport, Error> {
    let p = spec.problem;
    let caps = dev.caps()?;
    // Refused before anything is allocated (the library checks the same again at the launch).
    p.validate(spec.kernel, &caps)?;
    let analytic = AnalyticBytes::on(&p, spec.kernel, dev.target()?);
    analytic.check_fits(spec.kernel, &caps)?;
    if let Some(x) = inputs {
        // Every path (rounded or not) uploads exactly these lengths, by the same count the buffers
        // are allocated with.
        let sinks_want = if p.sinks { p.heads as usize } else { 0 };
        if x.sinks.len() != sinks_want {
            return Err(Error::Usage(format!(
                "{} sink logits given, the problem needs {sinks_want} (one per query head with sinks, none without)",
                x.sinks.len()
            )));
        }
        if let Some(bad) = x.sinks.iter().find(|s| !s.is_finite()) {
            return Err(Error::Usage(format!("sink logit {bad} is not finite; sinks must be finite f32 logits")));
        }
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
    // Host copies held at the peak: the inputs as f32, their device-layout and encoded copies,
    // and O downloaded, decoded and reordered (each of the problem's size).
    let es = p.dtype.size_bytes();
    let host_bytes = (p.q_elems().saturating_add(2 * p.kv_elems()))
        .saturating_mul(4 + 4 + es)
        .saturating_add(p.q_elems().saturating_mul(es + 4 + 4));
    probe_host_memory(host_bytes, &format!("the host copies of the {} problem", spec.kernel))?;
    let generated;
    let rounded;
    let (x, inputs_desc) = match inputs {
        Some(x) if !x.representable_in(p.dtype) => {
            // The device gets the values rounded to the dtype; the reference must see the same.
            let mut r = x.clone();
            for t in [&mut r.q, &mut r.k, &mut r.v] {
                p.dtype.round_all(t);
            }
            rounded = r;
            (&rounded, format!("given (rounded to {})", p.dtype))
        }
        Some(x) => (x, "given".to_string()),
        None => {
            generated = Qkv::random(&p, spec.seed);
            let desc = if p.dtype.is_16bit() {
                format!("random normal (seed {}), drawn in f32 and rounded to {}", spec.seed, p.dtype)
            } else {
                format!("random normal (seed {})", spec.seed)
            };
            (&generated, desc)
        }
    };
    check_finite_inputs(&p, x)?;
    let mut warnings = Vec::new();
    warnings.extend(check_score_range(&p, x, &spec.check)?);
    let (b, h, d) = (p.batch, p.heads, p.head_dim);
    let qd = to_layout(&x.q, p.layout, b, p.seq_q, h, d);
    let kd = to_layout(&x.k, p.layout, b, p.seq_kv, p.kv_heads(), d);
    let vd = to_layout(&x.v, p.layout, b, p.seq_kv, p.kv_heads(), d);

    let reps = Repetitions::resolve(dev, spec.warmup, spec.repeats)?;

    let subset = if spec.sampled_blocks {
        let (subset, warning) = checked_blocks(&p, spec, dev.target()?)?;
        warnings.push(warning);
        Some(subset)
    } else {
        None
    };
    // The reference and the bounds it sets: the host's share of the check.
    let host_check = || {
        let reference = reference(&p, x, &spec.check);
        let tol = tolerance_for(&p, x, &reference);
        (reference, tol)
    };
    let (measured, checked) = std::thread::scope(|s| {
        let alongside = spec.reference_alongside.then(|| s.spawn(host_check));
        let measured = measure(dev, reps, subset, |k| launch_measured(k, &p, spec.kernel, x, [&qd, &kd, &vd], reps));
        let checked = alongside.map(|t| t.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)));
        (measured, checked)
    });
    let m = measured?;
    let (instr, read, written) = (m.vm_thread_instructions(), m.vm_global_bytes_read(), m.vm_global_bytes_written());
    let (o_dev, lse) = m.out;
    let o = from_layout(&o_dev, p.layout, b, p.seq_q, h, d);
    let (timing, memory, trace) = (m.timing, m.memory, m.trace);

    let (reference, tol) = checked.unwrap_or_else(host_check);
    let v = verify(&p, &o, &lse, &reference, &tol);
    let error_ratio = tol.baseline_rel_rms_err.filter(|&b| b > 0.0).map(|b| v.o.rel_rms_err / b);
    let flops = p.flops();
    Ok(RunReport {
        backend: dev.backend().name().to_string(),
        device: dev.name(),
        kernel: spec.kernel,
        dtype: p.dtype,
        shape: p.shape_json(),
        inputs: inputs_desc,
        verified: v.passed,
        max_abs_err: v.o.max_abs_err,
        max_rel_err: v.o.max_rel_err,
        rel_rms_err: v.o.rel_rms_err,
        lse_err: v.lse,
        tolerance: tol,
        baseline_rel_rms_err: tol.baseline_rel_rms_err,
        error_ratio,
        verification: v,
        time_ms: timing.median_ms,
        tflops: tflops(flops, timing.median_ms),
        timing,
        flops,
        analytic_bytes: analytic,
        peak_device_bytes: memory.peak_delta_bytes,
        memory,
        vm_thread_instructions: instr,
        vm_global_bytes_read: read,
        vm_global_bytes_written: written,
        launches: m.launches,
        ptx_sha256: dev.ptx().sha256.clone(),
        warnings,
        outputs: RunOutputs { o, lse },
        trace,
    })
}

/// Allocates and uploads the run's buffers on `k`, then hands the harness ([`repeat`]) its
/// steps: poison O, LSE (and the naive kernels' scores), launch through the library's entry
/// point. Downloads O (device layout, decoded) and LSE of the last repetition. The buffers are
/// freed when this returns.
fn launch_measured(
    k: &Kernels,
    p: &Problem,
    kind: KernelKind,
    x: &Qkv,
    [qd, kd, vd]: [&[f32]; 3],
    reps: Repetitions,
) -> Body<(Vec<f32>, Vec<f32>)> {
    let es = p.dtype.size_bytes();
    let upload = |data: &[f32]| -> Result<DeviceBuffer, AttnError> {
        let buf = k.alloc(data.len() as u64 * es)?;
        buf.write_bytes(&p.dtype.encode(data))?;
        Ok(buf)
    };
    let (q, kb, v) = (upload(qd)?, upload(kd)?, upload(vd)?);
    let o = k.alloc(p.q_elems() * es)?;
    let lse = k.alloc(p.rows() * 4)?;
    let scores = match kind {
        KernelKind::Naive => Some(k.alloc(p.score_elems() * 4)?),
        KernelKind::Flash => None,
    };
    let sinks = if p.sinks { Some(k.upload_as(Dtype::F32, &x.sinks)?) } else { None };
    let alibi = if p.alibi { Some(k.upload_as(Dtype::F32, &memattn::problem::alibi_slopes(p.heads))?) } else { None };
    let cu = match p.varlen {
        Some(vl) => {
            Some((k.index_tensor(&Varlen::cu(vl.seqlens_q), None)?, k.index_tensor(&Varlen::cu(vl.seqlens_kv), None)?))
        }
        None => None,
    };
    allocated(k)?;

    // Views in the problem's layout (varlen: one packed batch).
    let (h, hk, d) = (p.heads as usize, p.kv_heads() as usize, p.head_dim as usize);
    let (vb, sq, skv) = match p.varlen {
        Some(_) => (1, p.total_q() as usize, p.total_kv() as usize),
        None => (p.batch as usize, p.seq_q as usize, p.seq_kv as usize),
    };
    let strides = |s: kernels_gpu::abi::Strides| [s.batch as usize, s.seq as usize, s.head as usize, 1];
    let qv = TensorView::device(&q, p.dtype, [vb, sq, h, d])?.with_strides(strides(p.q_strides()));
    let kv = TensorView::device(&kb, p.dtype, [vb, skv, hk, d])?.with_strides(strides(p.kv_strides()));
    let vv = TensorView::device(&v, p.dtype, [vb, skv, hk, d])?.with_strides(strides(p.kv_strides()));
    let mut ov = TensorViewMut::device(&o, p.dtype, [vb, sq, h, d])?.with_strides(strides(p.q_strides()));
    let mut lv = LseViewMut::vm(&lse, vb, h, sq)?;
    let mut sv = match &scores {
        Some(s) => {
            Some(TensorViewMut::device(s, Dtype::F32, [p.batch as usize, h, p.seq_q as usize, p.seq_kv as usize])?)
        }
        None => None,
    };
    let sinks_view = match &sinks {
        Some(s) => Some(SinksView::vm(s, h)?),
        None => None,
    };
    let mut opts = AttnOpts::new().causal(p.causal).window_size(p.window.0, p.window.1);
    if let Some(scale) = p.scale {
        opts = opts.softmax_scale(scale);
    }
    if p.softcap != 0.0 {
        opts = opts.softcap(p.softcap);
    }
    if let Some(s) = &sinks_view {
        opts = opts.sinks(s);
    }
    let alibi_view = match &alibi {
        Some(a) => Some(memattn::attn::AlibiView::vm(a, None, h)?),
        None => None,
    };
    if let Some(a) = &alibi_view {
        opts = opts.alibi_slopes(a);
    }

    let poison_outputs = |k: &Kernels| {
        k.with_device(|dev| {
            poison(dev, o.ptr(), p.q_elems() * es, p.dtype)?;
            dev.fill_u32(lse.ptr(), p.rows(), POISON)?;
            if let Some(s) = &scores {
                dev.fill_u32(s.ptr(), p.score_elems(), POISON)?;
            }
            Ok(())
        })
    };
    let (mx_q, mx_kv) = (p.seq_q as usize, p.seq_kv as usize);
    let launch = || match (kind, &cu, sv.as_mut()) {
        (KernelKind::Flash, None, _) => k.flash_attn_into(&qv, &kv, &vv, &mut ov, &mut lv, &opts),
        (KernelKind::Flash, Some((cq, ck)), _) => {
            k.flash_attn_varlen_into(&qv, &kv, &vv, cq, ck, mx_q, mx_kv, &mut ov, &mut lv, &opts)
        }
        (KernelKind::Naive, None, Some(s)) => k.naive_attn_into(&qv, &kv, &vv, &mut ov, &mut lv, s, &opts),
        (KernelKind::Naive, Some((cq, ck)), Some(s)) => {
            k.naive_attn_varlen_into(&qv, &kv, &vv, cq, ck, mx_q, mx_kv, &mut ov, &mut lv, s, &opts)
        }
        (KernelKind::Naive, _, None) => unreachable!("the naive kernels' scores are allocated above"),
    };
    let repeated = repeat(k, reps, poison_outputs, launch, |_| Ok(()))?;
    let o_dev = p.dtype.decode(&o.read_bytes((p.q_elems() * es) as usize)?);
    let lse_host = lse.read_f32(Dtype::F32, p.rows() as usize)?;
    Ok((repeated, (o_dev, lse_host)))
}
