//! `memattn run`.

use super::args::{Cli, RunArgs};
use super::{check_output, open_device, print_json, resolve_problem, run_spec, save_evidence};
use memattn_cli::error::{exit, Error};
use memattn_cli::memory::AnalyticBytes;
use memattn_cli::problem::{KernelKind, Problem};
use memattn_cli::report::{describe_problem, expected_memory, run_summary};
use memattn_cli::safetensors_io::{read_qkv_as, write_outputs, FileShape};
use std::path::Path;

/// `run --backward` (flattened into `run`'s options).
#[derive(Debug, clap::Args)]
pub struct BackwardArgs {
    /// Training: forward, then backward (dq, dk, dv of the loss sum(dO * O)), every gradient
    /// verified against the f64 reference; f32 at head_dim 32, 64, 96, 128, 192 or 256, bf16/f16 at 32, 64 or 128,
    /// and any other multiple of 8 up to the largest of them on the next (padded).
    ///
    /// The backward is FlashAttention-2's: P is recomputed from the forward's LSE, so no
    /// N x N buffer exists. O, LSE, dq, dk and dv are checked against the f64 reference
    /// gradients, every element (max |got - ref| <= 2e-5 * max(max |ref|, 1e-3) per tensor;
    /// a NaN-poisoned element that was not written fails). dO is drawn from --seed, or read
    /// from a tensor `do` (in q's dtype, shaped like q) in the --inputs file. Packed sequences
    /// (--seqlens-q/--seqlens-kv, or cu_seqlens in --inputs) run the varlen backward, and every
    /// sequence's dq, dk and dv are also checked on their own (O and LSE by the forward's rule,
    /// as `run` judges them, every row on its own scale). The measured peak memory
    /// is printed against the expected bytes: q, k, v, dO, O, LSE, dq, dk, dv and the
    /// backward's workspace, the f32 dQ accumulator (4 B per element of q) and
    /// D = rowsum(dO * O) (4 B per query row), next to the bytes a naive backward would keep
    /// alive, P and dS (2 x 4 B x batch x heads x seq_q x seq_kv). With --sinks the gradient
    /// of the sink logits, d_sinks = -sum over rows of exp(sink - LSE) * D, is checked too.
    /// --output writes o, lse, dq, dk, dv (and d_sinks) (F32). Supported: causal, windows,
    /// soft cap, GQA/MQA, sinks, either layout, packed sequences; f32 at head dims 32, 64, 96,
    /// 128, 192 and 256, bf16 and f16 (tensor cores; held to twice the error of a naive
    /// backward in the same dtype) at 32, 64 and 128; any other multiple of 8 up to the
    /// largest runs on the next of them, its head dim padded (nothing copied). With --kernel naive the naive forward and
    /// the naive backward run instead (f32): P and dS materialised (2 x 4 B x batch x heads x
    /// seq_q x seq_kv, allocated), head_dim 1 to 256, no d_sinks (sinks still enter dq, dk, dv
    /// through LSE); `memattn compare --backward` runs both side by side. Refused (exit 2): other
    /// head dims, packed sequences or --deterministic with --kernel naive. Exit 0 when every
    /// tensor verified, 1 when one did not.
    ///
    /// Example: memattn run --backward --heads 4 --heads-kv 2 --seq-q 45 --seq-kv 20 --causal
    ///
    /// Example: memattn run --backward --heads 2 --seqlens-q 7,0,30 --seqlens-kv 3,5,45 --causal
    #[arg(long)]
    pub backward: bool,
    /// With --backward: sum dQ deterministically. Each key block of the backward kernel writes
    /// its part of dQ to an f32 copy of q of its own (no atomic adds) and the copies are summed
    /// in key order, so dq is bitwise the same on every run; the run checks that every
    /// repetition wrote the same bits (exit 1 if not). Costs workspace: one accumulator per
    /// key block (32 keys at head_dim <= 128, 16 above), printed with the expected memory.
    #[arg(long, requires = "backward")]
    pub deterministic: bool,
}

pub fn run(cli: &Cli, a: &RunArgs) -> Result<i32, Error> {
    let kernel = a.kernel.unwrap_or(KernelKind::Flash);
    // The output is checked before anything runs, so a run is never lost to an unwritable path
    // and never overwrites its own inputs or the evidence.
    if let Some(out) = &a.output {
        check_output(cli, "--output", out, &[("--inputs", a.inputs.as_deref())])?;
    }
    if let (Some(save), Some(inputs)) = (&cli.save, &a.inputs) {
        memattn_cli::files::check_distinct("--save", save, &[("--inputs", Some(inputs.as_path()))])?;
    }
    // With --inputs and no --dtype, the file's dtype is used; with --dtype the file must match it.
    let (file_shape, file_dtype, inputs) = match &a.inputs {
        Some(path) => {
            let (shape, dtype, x) = read_qkv_as(path, a.problem.dtype)?;
            (Some(shape), Some(dtype), Some(x))
        }
        None => (None, None, None),
    };
    let mut problem = resolve_problem(&a.problem, file_shape, Problem::default())?;
    if let Some(d) = file_dtype {
        problem.dtype = d;
    }
    // A file's `sinks` tensor turns sinks on; --sinks with a file needs that tensor.
    if let Some(x) = &inputs {
        if problem.sinks && x.sinks.is_empty() {
            return Err(Error::Usage(
                "--sinks with --inputs needs a `sinks` tensor ([heads] F32) in the input file".into(),
            ));
        }
        problem.sinks = !x.sinks.is_empty();
    }
    problem.validate_shape(kernel)?;
    if let Some(path) = &a.timeline {
        check_timeline(cli, a, kernel, path)?;
    }
    if a.cp.cp.is_some() {
        return super::cp::run(cli, a, kernel, problem, inputs);
    }
    if a.backward.backward {
        return backward(cli, a, kernel, problem, inputs);
    }
    super::evidence::expect(serde_json::json!({
        "problem": problem.shape_json(), "dtype": problem.dtype, "kernel": kernel,
        "analytic_bytes": AnalyticBytes::new(&problem, kernel),
    }));
    let spec = run_spec(&a.problem, problem, kernel)?;
    let (mut dev, reason) = if a.timeline.is_some() {
        // The timeline modules in place of the committed ones.
        super::open_device_with(cli, |o| {
            o.ptx = memattn_cli::timeline::ptx_source();
            o.ptx_sm90 = memattn_cli::ptx::PtxSource::embedded_timeline_sm90();
        })?
    } else {
        open_device(cli)?
    };
    if !cli.json {
        println!("problem: {}", describe_problem(&problem));
        println!("{}", expected_memory(kernel, &AnalyticBytes::on(&problem, kernel, dev.target()?)));
    }
    let mut timeline_written = None;
    let report = match &a.timeline {
        Some(path) => {
            let (report, files) = run_timeline(cli, a, dev.as_mut(), &spec, inputs.as_ref(), path)?;
            timeline_written = Some(files);
            report
        }
        None => memattn_cli::runner::run(dev.as_mut(), &spec, inputs.as_ref())?,
    };
    let write = |path: &Path| -> Result<String, Error> {
        let shape = FileShape {
            batch: problem.batch,
            heads: problem.heads,
            seq_q: problem.seq_q,
            seq_kv: problem.seq_kv,
            head_dim: problem.head_dim,
            heads_kv: problem.kv_heads(),
            varlen: problem.varlen,
        };
        write_outputs(path, shape, problem.dtype, &report.outputs.o, &report.outputs.lse)?;
        let (o_shape, lse_shape) = match problem.varlen {
            Some(_) => {
                let t = problem.total_q() as u32;
                (vec![t, shape.heads, shape.head_dim], vec![shape.heads, t])
            }
            None => (
                vec![shape.batch, shape.seq_q, shape.heads, shape.head_dim],
                vec![shape.batch, shape.heads, shape.seq_q],
            ),
        };
        Ok(format!("wrote o {o_shape:?} {} and lse {lse_shape:?} f32 to {}", problem.dtype, path.display()))
    };
    let mut v = serde_json::to_value(&report).unwrap_or_default();
    v["backend_reason"] = reason.into();
    if let Some((trace, picture, summary)) = &timeline_written {
        v["timeline_file"] = trace.display().to_string().into();
        v["timeline_picture"] = picture.display().to_string().into();
        v["timeline"] = summary.clone();
    }
    finish(cli, a.output.as_deref(), report.verified, v, write, || run_summary(&report))
}

/// The end of a measured run, the same for the forward and the backward. Only a verified result
/// replaces the output file (`write` writes it atomically and returns the line that says so); a
/// write that fails after all leaves the old file whole, the measured result is still printed and
/// saved, and the run exits with the write error's code (3 for the file-size limit or a full
/// disk, 2 for a path that cannot be written). Then the result `v` (with `output_file`, and
/// `output_error` after a failed write) goes to the evidence file and to stdout (`--json`, or
/// `summary`), and the exit code says whether it verified.
fn finish(
    cli: &Cli,
    output: Option<&Path>,
    verified: bool,
    mut v: serde_json::Value,
    write: impl FnOnce(&Path) -> Result<String, Error>,
    summary: impl FnOnce() -> String,
) -> Result<i32, Error> {
    let mut written = None;
    let mut write_error = None;
    if let Some(path) = output {
        if !verified {
            eprintln!("not writing {}: the result did not verify (an existing file is left as it was)", path.display());
        } else {
            match write(path) {
                Err(e) => {
                    eprintln!("error: {e}");
                    write_error = Some((e.to_string(), e.exit_code()));
                }
                Ok(line) => {
                    if !cli.json {
                        println!("{line}");
                    }
                    written = Some(path);
                }
            }
        }
        v["output_file"] = written.map(|p| p.display().to_string()).into();
    }
    if let Some((e, _)) = &write_error {
        v["output_error"] = e.clone().into();
    }
    save_evidence(cli, &v)?;
    if cli.json {
        print_json(&v);
    } else {
        print!("{}", summary());
    }
    Ok(if let Some((_, code)) = write_error {
        code
    } else if verified {
        exit::SUCCESS
    } else {
        exit::VERIFICATION_FAILED
    })
}

/// `run --timeline`: refused (exit 2) before anything runs where it does not apply, or where
/// its files cannot be written.
fn check_timeline(cli: &Cli, a: &RunArgs, kernel: KernelKind, path: &std::path::Path) -> Result<(), Error> {
    let refuse = |why: &str| Error::Usage(format!("{why}; {}", memattn_cli::timeline::supported()));
    if a.backward.backward {
        return Err(refuse("--timeline is for the forward, not --backward"));
    }
    if a.cp.cp.is_some() {
        return Err(refuse("--timeline runs on one device, not with --cp"));
    }
    if kernel != KernelKind::Flash {
        return Err(refuse("--timeline needs --kernel flash"));
    }
    if cli.ptx.is_some() {
        return Err(refuse("--timeline loads its own module (memattn_kernels_timeline.ptx), not --ptx"));
    }
    let others = [("--inputs", a.inputs.as_deref()), ("--output", a.output.as_deref())];
    check_output(cli, "--timeline", path, &others)?;
    let picture = timeline_picture(a, path);
    let mut others = others.to_vec();
    others.push(("--timeline", Some(path)));
    check_output(cli, "--timeline-picture", &picture, &others)?;
    match picture.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
        Some("svg" | "png") => Ok(()),
        _ => Err(Error::Usage(format!("--timeline-picture {}: the name must end in .svg or .png", picture.display()))),
    }
}

fn timeline_picture(a: &RunArgs, trace: &std::path::Path) -> std::path::PathBuf {
    a.timeline_picture.clone().unwrap_or_else(|| memattn_cli::timeline::picture_path(trace))
}

/// The files `run --timeline` wrote: the trace, the picture, and a summary for `--json`.
type TimelineFiles = (std::path::PathBuf, std::path::PathBuf, serde_json::Value);

/// `run --timeline`: the run on the timeline module with the stamps' buffer, then the trace and
/// its picture.
fn run_timeline(
    cli: &Cli,
    a: &RunArgs,
    dev: &mut dyn memattn_cli::device::Device,
    spec: &memattn_cli::runner::RunSpec,
    inputs: Option<&memattn_cli::inputs::Qkv>,
    path: &std::path::Path,
) -> Result<(memattn_cli::runner::RunReport, TimelineFiles), Error> {
    use memattn_cli::timeline::{draw, supported, TimelineDevice};
    let problem = &spec.problem;
    let launches = problem.launches_on(spec.kernel, dev.target()?)?;
    let launch = match launches.as_slice() {
        [l] if kernels_gpu::timeline::TIMELINE_KERNELS.contains(&l.kernel) => *l,
        other => {
            let names: Vec<&str> = other.iter().map(|l| l.kernel.variant().name).collect();
            return Err(Error::Usage(format!("this run launches {}; {}", names.join(", "), supported())));
        }
    };
    let backend = dev.backend();
    let mut td = TimelineDevice::new(dev, launch.kernel, launch.dims)?;
    let report = memattn_cli::runner::run(&mut td, spec, inputs)?;
    let t = td.finish(backend)?;
    let trace = serde_json::to_vec(&t.chrome_trace()).map_err(|e| Error::Usage(e.to_string()))?;
    memattn_cli::files::write_atomic(path, &trace, "timeline")?;
    let picture = timeline_picture(a, path);
    let blocks = t.warps.iter().map(|w| w.block).collect::<std::collections::BTreeSet<_>>().len();
    let title = format!(
        "memattn timeline: {} ({}), {} warps of {blocks} blocks",
        launch.kernel.variant().name,
        if t.nanoseconds { "%globaltimer" } else { "ptx-vm instructions" },
        t.warps.len(),
    );
    draw(&t, &picture, &title)?;
    if !cli.json {
        println!(
            "wrote the timeline of {} warps ({} per block; ts in {}) to {} and its picture to {}",
            t.warps.len(),
            t.warps_per_block,
            t.unit_name(),
            path.display(),
            picture.display()
        );
    }
    if t.dropped() > 0 {
        eprintln!(
            "warning: {} stamps past {} per warp were dropped (the trace ends early for those warps)",
            t.dropped(),
            kernels_gpu::timeline::EVENTS_PER_WARP
        );
    }
    let summary = serde_json::json!({
        "kernel": launch.kernel.variant().name, "warps": t.warps.len(), "warps_per_block": t.warps_per_block,
        "blocks": blocks, "ts_unit": t.unit_name(), "dropped_stamps": t.dropped(),
    });
    Ok((report, (path.to_path_buf(), picture, summary)))
}

/// `run --backward`: refuse what the backward does not support, then forward and backward,
/// verified; `--output` gets o, lse, dq, dk, dv.
fn backward(
    cli: &Cli,
    a: &RunArgs,
    kernel: KernelKind,
    problem: Problem,
    inputs: Option<memattn_cli::inputs::Qkv>,
) -> Result<i32, Error> {
    use memattn_cli::backward_run::{check_supported, read_d_o, run_backward, summary, write_outputs, BackwardBytes};
    check_supported(&problem, kernel)?;
    if kernel == KernelKind::Naive && a.backward.deterministic {
        return Err(Error::Usage(
            "--deterministic is for the flash backward's dQ sum; the naive backward has no atomic adds \
             (it is the same bits run to run): leave out --deterministic or --kernel naive"
                .into(),
        ));
    }
    let d_o = match &a.inputs {
        Some(path) => read_d_o(path, &problem)?,
        None => None,
    };
    let deterministic = a.backward.deterministic;
    let expected = BackwardBytes::of(&problem, kernel, deterministic)?;
    super::evidence::expect(serde_json::json!({
        "problem": problem.shape_json(), "dtype": problem.dtype, "kernel": kernel, "backward": true,
        "expected_bytes": expected, "deterministic": deterministic,
    }));
    let spec = run_spec(&a.problem, problem, kernel)?;
    let (mut dev, reason) = open_device(cli)?;
    if !cli.json && kernel == KernelKind::Naive {
        println!("problem: {} (naive forward and backward)", describe_problem(&problem));
        println!(
            "expected device memory: {} B, of which the backward's workspace {} B (P {} B + dS {} B)",
            expected.total_bytes,
            expected.workspace_bytes,
            expected.p_ds_bytes / 2,
            expected.p_ds_bytes / 2
        );
    } else if !cli.json {
        println!("problem: {} (forward and backward)", describe_problem(&problem));
        println!(
            "expected device memory: {} B, of which the backward's workspace {} B (dQ accumulator{} {} B + D {} B)",
            expected.total_bytes,
            expected.workspace_bytes,
            if deterministic { format!("s, one per key block: {} x", expected.dq_slices) } else { String::new() },
            expected.dq_accum_bytes / expected.dq_slices.max(1),
            expected.delta_bytes
        );
    }
    let report = run_backward(dev.as_mut(), &spec, inputs.as_ref(), d_o.as_deref(), deterministic)?;
    let write = |path: &Path| -> Result<String, Error> {
        write_outputs(path, &problem, &report.outputs)?;
        let ds = if problem.sinks { ", d_sinks" } else { "" };
        Ok(format!("wrote o, lse, dq, dk, dv{ds} (F32) to {}", path.display()))
    };
    let mut v = serde_json::to_value(&report).unwrap_or_default();
    v["backend_reason"] = reason.into();
    finish(cli, a.output.as_deref(), report.verified, v, write, || summary(&report))
}
