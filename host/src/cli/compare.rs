//! `memattn compare`: one option varied, everything else fixed, results side by side.

use super::args::{Cli, CompareArgs};
use super::{open_device, parse_vary, print_json, resolve_problem, run_spec};
use memattn_cli::device::Device;
use memattn_cli::error::{exit, Error};
use memattn_cli::memory::AnalyticBytes;
use memattn_cli::problem::{KernelKind, Problem, ProblemError};
use memattn_cli::report::{describe_problem, entries_label, human_bytes, table};
use memattn_cli::runner::RunReport;
use serde::Serialize;

/// One measured point, or why it could not run.
#[derive(Clone, Debug, Serialize)]
pub struct Point {
    pub value: String,
    pub kernel: KernelKind,
    pub ran: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub report: Option<RunReport>,
    /// Set when the run did not fit: the analytic bytes it would need.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub would_need_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Runs one point; a problem that does not fit in device memory (or hits another device limit)
/// becomes a point that did not run, with the bytes it would need.
pub fn measure(
    dev: &mut dyn Device,
    a: &super::args::ProblemArgs,
    value: &str,
    problem: Problem,
    kernel: KernelKind,
) -> Result<Point, Error> {
    let spec = run_spec(a, problem, kernel)?;
    match memattn_cli::runner::run(dev, &spec, None) {
        Ok(r) => {
            Ok(Point { value: value.into(), kernel, ran: true, report: Some(r), would_need_bytes: None, reason: None })
        }
        Err(Error::Problem(
            e @ (ProblemError::OutOfDeviceMemory { .. }
            | ProblemError::GridLimit { .. }
            | ProblemError::SharedMemory { .. }),
        )) => Ok(Point {
            value: value.into(),
            kernel,
            ran: false,
            report: None,
            would_need_bytes: Some(AnalyticBytes::new(&problem, kernel).total),
            reason: Some(e.to_string()),
        }),
        Err(e) => Err(e),
    }
}

fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 && a.is_finite() {
        format!("{:.2}x", a / b)
    } else {
        "-".into()
    }
}

pub fn compare(cli: &Cli, a: &CompareArgs) -> Result<i32, Error> {
    if a.backward {
        return compare_backward(cli, a);
    }
    let vary = parse_vary(&a.vary)?;
    super::check_vary_conflict(&vary.key, &a.problem, a.kernel.is_some())?;
    let base = resolve_problem(&a.problem, None, Problem::default())?;
    let base_kernel = a.kernel.unwrap_or(KernelKind::Flash);
    let mut variants = Vec::new();
    for value in &vary.values {
        let (mut p, mut k) = (base, base_kernel);
        super::apply_vary_run(&vary.key, value, &a.problem, &mut p, &mut k)?;
        if let Err(e @ ProblemError::UnsupportedDtype { .. }) = p.validate_shape(k) {
            let hint = if vary.key == "kernel" {
                format!(
                    "to compare {} with f32, vary the dtype on the flash kernel: --vary dtype=f32,{}",
                    p.dtype, p.dtype
                )
            } else {
                format!("drop --kernel {k}: the runs then use flash, which exists in every dtype")
            };
            return Err(Error::Usage(format!(
                "compare --vary {}={}: the run {}={value} would need a {k} kernel in {}, which does not exist: {e}; {hint}",
                vary.key,
                vary.values.join(","),
                vary.key,
                p.dtype
            )));
        }
        p.validate_shape(k)?;
        variants.push((value.clone(), p, k));
    }
    super::evidence::expect(serde_json::json!({
        "runs": variants.iter().map(|(value, p, k)| serde_json::json!({
            "value": value, "kernel": k, "analytic_bytes": AnalyticBytes::new(p, *k).total,
        })).collect::<Vec<_>>(),
    }));
    let (mut dev, reason) = open_device(cli)?;
    if !cli.json {
        println!("compare: --vary {}={} on {}", vary.key, vary.values.join(","), describe_problem(&base));
    }
    let mut points = Vec::new();
    for (value, p, k) in &variants {
        if !cli.json {
            eprintln!("running {}={value} ({})", vary.key, describe_problem(p));
        }
        points.push(measure(dev.as_mut(), &a.problem, value, *p, *k)?);
    }
    // Verified means: at least one point ran, and every point that ran verified.
    let any_ran = points.iter().any(|p| p.ran);
    let all_ok = any_ran && points.iter().all(|p| p.report.as_ref().is_none_or(|r| r.verified));
    // Comparisons of every point with the first.
    let mut comparisons = Vec::new();
    if let Some(Some(first)) = points.first().map(|p| p.report.as_ref()) {
        for pt in points.iter().skip(1) {
            if let Some(r) = &pt.report {
                comparisons.push(serde_json::json!({
                    "baseline": points[0].value,
                    "value": pt.value,
                    "memory_saved_bytes": first.peak_device_bytes as i64 - r.peak_device_bytes as i64,
                    "memory_ratio": first.peak_device_bytes as f64 / r.peak_device_bytes.max(1) as f64,
                    "analytic_saved_bytes": first.analytic_bytes.total as i64 - r.analytic_bytes.total as i64,
                    "speedup": first.time_ms / r.time_ms,
                }));
            }
        }
    }
    let v = serde_json::json!({
        "command": "compare",
        "backend": dev.backend().name(),
        "backend_reason": reason,
        "vary": vary.key,
        "values": vary.values,
        "runs": points,
        "comparisons": comparisons,
        "verified": all_ok,
    });
    super::save_evidence(cli, &v)?;
    if cli.json {
        print_json(&v);
    } else {
        print!("{}", compare_table(&vary.key, &points));
    }
    if !any_ran {
        eprintln!("error: no run of the comparison fit the device (see the reasons above); nothing was verified");
        return Ok(exit::BAD_INPUT);
    }
    Ok(if all_ok { exit::SUCCESS } else { exit::VERIFICATION_FAILED })
}

fn compare_table(key: &str, points: &[Point]) -> String {
    let mut header = vec![key.to_string()];
    header.extend(points.iter().map(|p| p.value.clone()));
    let first = points.first().and_then(|p| p.report.as_ref());
    if points.len() >= 2 {
        for p in points.iter().skip(1) {
            header.push(format!("{}/{}", points[0].value, p.value));
        }
    }
    let get = |f: &dyn Fn(&RunReport) -> String| -> Vec<String> {
        points.iter().map(|p| p.report.as_ref().map(f).unwrap_or_else(|| "did not run".into())).collect()
    };
    let ratios = |f: &dyn Fn(&RunReport) -> f64| -> Vec<String> {
        points
            .iter()
            .skip(1)
            .map(|p| match (first, &p.report) {
                (Some(a), Some(b)) => ratio(f(a), f(b)),
                _ => "-".into(),
            })
            .collect()
    };
    let row = |name: &str, vals: Vec<String>, rats: Vec<String>| {
        let mut r = vec![name.to_string()];
        r.extend(vals);
        if points.len() >= 2 {
            r.extend(if rats.is_empty() { vec![String::new(); points.len() - 1] } else { rats });
        }
        r
    };
    let mut rows = vec![
        row("kernel", get(&|r| r.kernel.to_string()), vec![]),
        row("dtype", get(&|r| r.dtype.to_string()), vec![]),
        row("entry", get(&|r| entries_label(r.launches.iter().map(|l| l.kernel.as_str()))), vec![]),
        row("verified", get(&|r| if r.verified { "PASS".into() } else { "FAIL".into() }), vec![]),
        row("checked rows", get(&|r| format!("{}/{}", r.verification.checked_rows, r.verification.total_rows)), vec![]),
        row("O rel RMS err", get(&|r| format!("{:.2e}", r.rel_rms_err)), vec![]),
        row("  bound", get(&|r| format!("{:.2e}", r.tolerance.rel_rms)), vec![]),
        row(
            "  naive-in-dtype",
            get(&|r| r.baseline_rel_rms_err.map(|b| format!("{b:.2e}")).unwrap_or_else(|| "-".into())),
            vec![],
        ),
        row("  err/naive", get(&|r| r.error_ratio.map(|x| format!("{x:.2}")).unwrap_or_else(|| "-".into())), vec![]),
        row("O max abs err", get(&|r| format!("{:.2e}", r.max_abs_err)), vec![]),
        row("LSE rel RMS err", get(&|r| format!("{:.2e}", r.lse_err.rel_rms_err)), vec![]),
        row("time (ms, median)", get(&|r| format!("{:.3}", r.time_ms)), ratios(&|r| r.time_ms)),
        row("TFLOP/s", get(&|r| format_tflops(r.tflops)), vec![]),
        row(
            "expected bytes",
            get(&|r| human_bytes(r.analytic_bytes.total)),
            ratios(&|r| r.analytic_bytes.total as f64),
        ),
        row("  inputs", get(&|r| human_bytes(r.analytic_bytes.inputs)), vec![]),
        row("  outputs", get(&|r| human_bytes(r.analytic_bytes.outputs)), vec![]),
        row(
            "  workspace",
            get(&|r| human_bytes(r.analytic_bytes.workspace)),
            ratios(&|r| r.analytic_bytes.workspace as f64),
        ),
        row("measured peak", get(&|r| human_bytes(r.peak_device_bytes)), ratios(&|r| r.peak_device_bytes as f64)),
        row(
            "measured - expected",
            get(&|r| format!("{} B", r.peak_device_bytes as i128 - r.analytic_bytes.total as i128)),
            vec![],
        ),
        row(
            "VM thread instr.",
            get(&|r| r.vm_thread_instructions.map(|n| n.to_string()).unwrap_or_else(|| "-".into())),
            vec![],
        ),
        row(
            "VM global read",
            get(&|r| r.vm_global_bytes_read.map(human_bytes).unwrap_or_else(|| "-".into())),
            ratios(&|r| r.vm_global_bytes_read.unwrap_or(0) as f64),
        ),
        row(
            "VM global written",
            get(&|r| r.vm_global_bytes_written.map(human_bytes).unwrap_or_else(|| "-".into())),
            ratios(&|r| r.vm_global_bytes_written.unwrap_or(0) as f64),
        ),
    ];
    if key == "kernel" {
        rows.remove(0); // already the header
    } else if key == "dtype" {
        rows.remove(1);
    }
    let mut s = table(&header, &rows);
    for p in points {
        if let (false, Some(need), Some(why)) = (p.ran, p.would_need_bytes, &p.reason) {
            s.push_str(&format!("{key}={}: did not run, would need {} ({why})\n", p.value, human_bytes(need)));
        }
    }
    if let Some(a) = first {
        for p in points.iter().skip(1) {
            if let Some(b) = &p.report {
                let saved = a.peak_device_bytes as i128 - b.peak_device_bytes as i128;
                let (word, amount) = if saved >= 0 { ("less", saved) } else { ("more", -saved) };
                s.push_str(&format!(
                    "{key}={} uses {} {word} device memory than {key}={} ({} vs {} measured peak; {}); time ratio {} ({})\n",
                    p.value,
                    human_bytes(amount as u64),
                    points[0].value,
                    human_bytes(b.peak_device_bytes),
                    human_bytes(a.peak_device_bytes),
                    ratio(a.peak_device_bytes as f64, b.peak_device_bytes as f64),
                    ratio(a.time_ms, b.time_ms),
                    a.timing.clock
                ));
            }
        }
    }
    s
}

/// `compare --backward`: the naive and the flash backward on one problem, side by side.
fn compare_backward(cli: &Cli, a: &CompareArgs) -> Result<i32, Error> {
    use memattn_cli::backward_run::{check_supported, run_backward, BackwardBytes};
    let vary = parse_vary(&a.vary)?;
    let mut kernels = Vec::new();
    if vary.key == "kernel" && a.kernel.is_none() {
        for v in &vary.values {
            kernels.push(v.parse::<KernelKind>().map_err(|e| Error::Usage(format!("--vary kernel: {e}")))?);
        }
    }
    if kernels.is_empty() || kernels.iter().any(|k| kernels.iter().filter(|x| *x == k).count() > 1) {
        return Err(Error::Usage(format!(
            "compare --backward compares the naive and the flash backward of one problem: --vary kernel=naive,flash \
             (the default) or kernel=flash,naive, without --kernel; got --vary {}{}",
            a.vary,
            a.kernel.map(|k| format!(" --kernel {k}")).unwrap_or_default()
        )));
    }
    let p = resolve_problem(&a.problem, None, Problem::default())?;
    let mut expected = Vec::new();
    for &k in &kernels {
        p.validate_shape(k)?;
        check_supported(&p, k)?;
        expected.push(BackwardBytes::of(&p, k, false)?);
    }
    super::evidence::expect(serde_json::json!({
        "problem": p.shape_json(), "backward": true,
        "runs": kernels.iter().zip(&expected).map(|(k, e)| serde_json::json!({"kernel": k, "expected_bytes": e}))
            .collect::<Vec<_>>(),
    }));
    let (mut dev, reason) = open_device(cli)?;
    if !cli.json {
        println!("compare --backward: {} on {}", vary.values.join(" vs "), describe_problem(&p));
        for e in &expected {
            println!("expected device memory, {}: {} ({} B)", e.kernel, human_bytes(e.total_bytes), e.total_bytes);
        }
    }
    let mut reports = Vec::new();
    for &k in &kernels {
        if !cli.json {
            eprintln!("running the {k} forward and backward");
        }
        let spec = run_spec(&a.problem, p, k)?;
        reports.push(run_backward(dev.as_mut(), &spec, None, None, false)?);
    }
    let verified = reports.iter().all(|r| r.verified);
    let (first, rest) = (&reports[0], &reports[1..]);
    let comparisons: Vec<_> = rest
        .iter()
        .map(|r| {
            serde_json::json!({
                "baseline": first.kernel,
                "kernel": r.kernel,
                "memory_saved_bytes": first.peak_device_bytes as i64 - r.peak_device_bytes as i64,
                "memory_ratio": first.peak_device_bytes as f64 / r.peak_device_bytes.max(1) as f64,
                "workspace_ratio": first.expected_bytes.workspace_bytes as f64
                    / r.expected_bytes.workspace_bytes.max(1) as f64,
                "backward_speedup": first.backward_time_ms / r.backward_time_ms,
            })
        })
        .collect();
    let v = serde_json::json!({
        "command": "compare",
        "backward": true,
        "backend": dev.backend().name(),
        "backend_reason": reason,
        "vary": "kernel",
        "values": vary.values,
        "runs": reports,
        "comparisons": comparisons,
        "verified": verified,
    });
    super::save_evidence(cli, &v)?;
    if cli.json {
        print_json(&v);
    } else {
        print!("{}", backward_table(&reports));
    }
    Ok(if verified { exit::SUCCESS } else { exit::VERIFICATION_FAILED })
}

/// The table of `compare --backward`: one column per kernel, then the ratios to the first.
fn backward_table(reports: &[memattn_cli::backward_run::BackwardReport]) -> String {
    use memattn_cli::backward_run::BackwardReport;
    let mut header = vec!["backward".to_string()];
    header.extend(reports.iter().map(|r| r.kernel.to_string()));
    for r in &reports[1..] {
        header.push(format!("{}/{}", reports[0].kernel, r.kernel));
    }
    let n = reports.len();
    let row = |name: &str, f: &dyn Fn(&BackwardReport) -> String, ratio_of: Option<&dyn Fn(&BackwardReport) -> f64>| {
        let mut r = vec![name.to_string()];
        r.extend(reports.iter().map(f));
        for b in &reports[1..] {
            r.push(ratio_of.map(|g| ratio(g(&reports[0]), g(b))).unwrap_or_default());
        }
        debug_assert_eq!(r.len(), 2 * n);
        r
    };
    let err = |t: &'static str| {
        move |r: &BackwardReport| {
            r.checks
                .iter()
                .find(|c| c.tensor == t)
                .map(|c| format!("{:.2e}", c.max_rel_err))
                .unwrap_or_else(|| "-".into())
        }
    };
    let launches_sum = |f: fn(&memattn_cli::runner::LaunchRecord) -> Option<u64>| {
        move |r: &BackwardReport| r.launches.iter().map(f).sum::<Option<u64>>()
    };
    let instr = launches_sum(|l| l.thread_instructions);
    let read = launches_sum(|l| l.global_bytes_read);
    let written = launches_sum(|l| l.global_bytes_written);
    let opt = |x: Option<u64>, human: bool| match x {
        Some(b) if human => human_bytes(b),
        Some(b) => b.to_string(),
        None => "-".into(),
    };
    let workspace = |r: &BackwardReport| {
        let e = &r.expected_bytes;
        match r.kernel {
            KernelKind::Naive => format!("P + dS {}", human_bytes(e.p_ds_bytes)),
            KernelKind::Flash => {
                format!("dQ acc {} + D {}", human_bytes(e.dq_accum_bytes), human_bytes(e.delta_bytes))
            }
        }
    };
    let rows = vec![
        row("entries", &|r| entries_label(r.launches.iter().map(|l| l.kernel.as_str())), None),
        row("verified", &|r| if r.verified { "PASS".into() } else { "FAIL".into() }, None),
        row("dq max rel err", &err("dq"), None),
        row("dk max rel err", &err("dk"), None),
        row("dv max rel err", &err("dv"), None),
        row("  bound", &|_| format!("{:.0e}", memattn_cli::backward_run::GRAD_REL_TOL), None),
        row("forward time (ms)", &|r| format!("{:.3}", r.forward_time_ms), Some(&|r| r.forward_time_ms)),
        row("backward time (ms)", &|r| format!("{:.3}", r.backward_time_ms), Some(&|r| r.backward_time_ms)),
        row(
            "expected bytes",
            &|r| human_bytes(r.expected_bytes.total_bytes),
            Some(&|r| r.expected_bytes.total_bytes as f64),
        ),
        row("  q, k, v, dO", &|r| human_bytes(r.expected_bytes.inputs_bytes), None),
        row("  forward O, LSE", &|r| human_bytes(r.expected_bytes.forward_outputs_bytes), None),
        row("  dq, dk, dv", &|r| human_bytes(r.expected_bytes.gradients_bytes), None),
        row(
            "  backward workspace",
            &|r| human_bytes(r.expected_bytes.workspace_bytes),
            Some(&|r| r.expected_bytes.workspace_bytes as f64),
        ),
        row("    of which", &workspace, None),
        row("measured peak", &|r| human_bytes(r.peak_device_bytes), Some(&|r| r.peak_device_bytes as f64)),
        row(
            "measured - expected",
            &|r| format!("{} B", r.peak_device_bytes as i128 - r.expected_bytes.total_bytes as i128),
            None,
        ),
        row("VM thread instr.", &|r| opt(instr(r), false), Some(&|r| instr(r).unwrap_or(0) as f64)),
        row("VM global read", &|r| opt(read(r), true), Some(&|r| read(r).unwrap_or(0) as f64)),
        row("VM global written", &|r| opt(written(r), true), Some(&|r| written(r).unwrap_or(0) as f64)),
    ];
    let mut s = table(&header, &rows);
    for r in reports {
        let e = &r.expected_bytes;
        let shape = &r.shape;
        let (b, h, sq, skv, d) = (shape.batch, shape.heads, shape.seq_q, shape.seq_kv, shape.head_dim);
        match r.kernel {
            KernelKind::Flash => s.push_str(&format!(
                "flash backward workspace: dQ accumulator 4 x batch {b} x seq_q {sq} x heads {h} x d {d} = {} B + D 4 x \
                 {b} x {h} x {sq} = {} B = {} B, O(N*d)\n",
                e.dq_accum_bytes, e.delta_bytes, e.workspace_bytes
            )),
            KernelKind::Naive => s.push_str(&format!(
                "naive backward workspace: P + dS 2 x 4 x batch {b} x heads {h} x seq_q {sq} x seq_kv {skv} = {} B, \
                 O(N^2)\n",
                e.p_ds_bytes
            )),
        }
    }
    for r in &reports[1..] {
        let a = &reports[0];
        let saved = a.peak_device_bytes as i128 - r.peak_device_bytes as i128;
        let (word, amount) = if saved >= 0 { ("less", saved) } else { ("more", -saved) };
        s.push_str(&format!(
            "{} uses {} {word} device memory than {} ({} vs {} measured peak, {}; workspace {}); backward time ratio {} \
             ({})\n",
            r.kernel,
            human_bytes(amount as u64),
            a.kernel,
            human_bytes(r.peak_device_bytes),
            human_bytes(a.peak_device_bytes),
            ratio(a.peak_device_bytes as f64, r.peak_device_bytes as f64),
            ratio(a.expected_bytes.workspace_bytes as f64, r.expected_bytes.workspace_bytes as f64),
            ratio(a.backward_time_ms, r.backward_time_ms),
            a.timing.clock
        ));
    }
    for r in reports {
        for w in &r.warnings {
            s.push_str(&format!("warning ({}): {w}\n", r.kernel));
        }
        if !r.memory_as_expected {
            s.push_str(&format!("{}: the measured peak differs from the expected bytes\n", r.kernel));
        }
    }
    s.push_str(if reports.iter().all(|r| r.verified) { "verified\n" } else { "NOT VERIFIED\n" });
    s
}

/// TFLOP/s with enough digits for the VM's tiny rates.
pub fn format_tflops(t: f64) -> String {
    if t >= 0.01 {
        format!("{t:.3}")
    } else {
        format!("{t:.2e}")
    }
}
