//! `memattn sweep`: naive and flash over a range of one option, table + SVG plot.

use super::args::{Cli, SweepArgs};
use super::compare::{measure, Point};
use super::{open_device, parse_vary, print_json, resolve_problem, save_evidence};
use memattn_cli::charts;
use memattn_cli::device::Backend;
use memattn_cli::error::{exit, Error};
use memattn_cli::problem::{KernelKind, Problem};
use memattn_cli::report::{human_bytes, table};
use memattn_cli::runner::RunReport;

pub fn sweep(cli: &Cli, a: &SweepArgs) -> Result<i32, Error> {
    let base = resolve_problem(&a.problem, None, Problem::default())?;
    let mut kernels = Vec::new();
    let explicit = a.kernels.is_some();
    for k in a.kernels.as_deref().unwrap_or("naive,flash").split(',').map(str::trim).filter(|s| !s.is_empty()) {
        kernels.push(k.parse::<KernelKind>().map_err(|e| Error::Usage(format!("--kernels: {e}")))?);
    }
    if kernels.is_empty() {
        return Err(Error::Usage("--kernels is empty".into()));
    }
    // Check an explicit --vary and the plot path before opening a device.
    if let Some(v) = &a.vary {
        super::check_vary_conflict(&parse_vary(v)?.key, &a.problem, false)?;
    } else {
        // The default sweep varies seq.
        super::check_vary_conflict("seq", &a.problem, false)?;
    }
    if !a.no_plot {
        super::check_output(cli, "--plot", &a.plot, &[])?;
    }
    let (mut dev, reason) = open_device(cli)?;
    let vary = match &a.vary {
        Some(v) => parse_vary(v)?,
        None => parse_vary(match dev.backend() {
            Backend::Vm => "seq=64,128,256",
            Backend::Cuda => "seq=1024,2048,4096,8192,16384",
        })?,
    };
    if vary.key == "kernel" {
        return Err(Error::Usage(
            "sweep runs every kernel of --kernels at each point; vary another key (or use compare)".into(),
        ));
    }
    let mut plan = Vec::new();
    let mut skipped = Vec::new();
    for value in &vary.values {
        for &k in &kernels {
            let (mut p, mut kk) = (base, k);
            super::apply_vary_run(&vary.key, value, &a.problem, &mut p, &mut kk)?;
            if !explicit && !kk.supports(p.dtype) {
                // Default kernel list: run only the kernels that exist in this dtype.
                skipped.push(format!("{}={value} {kk}: no {kk} kernel in {}", vary.key, p.dtype));
                continue;
            }
            p.validate_shape(kk)?;
            plan.push((value.clone(), p, kk));
        }
    }
    if !skipped.is_empty() && !cli.json {
        eprintln!("sweep: skipped (no kernel in that dtype): {}", skipped.join("; "));
    }
    super::evidence::expect(serde_json::json!({
        "runs": plan.iter().map(|(value, p, k)| serde_json::json!({
            "value": value, "kernel": k, "analytic_bytes": memattn_cli::memory::AnalyticBytes::new(p, *k).total,
        })).collect::<Vec<_>>(),
    }));
    let bar = indicatif::ProgressBar::new(plan.len() as u64);
    if cli.json || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    } else if let Ok(style) = indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed}]") {
        bar.set_style(style);
    }
    let mut points: Vec<Point> = Vec::new();
    for (value, p, k) in &plan {
        bar.set_message(format!("{}={value} {k}", vary.key));
        let r = measure(dev.as_mut(), &a.problem, value, *p, *k);
        bar.inc(1);
        points.push(r.inspect_err(|_| bar.abandon())?);
    }
    bar.finish_and_clear();
    // Verified means: at least one point ran, and every point that ran verified.
    let any_ran = points.iter().any(|p| p.ran);
    let all_ok = any_ran && points.iter().all(|p| p.report.as_ref().is_none_or(|r| r.verified));

    let mut plot_path = None;
    let mut plot_error = None;
    let mut plot_exit = exit::BAD_INPUT;
    if !a.no_plot && all_ok {
        // The picture is written atomically: a write that fails leaves any old plot whole, and the
        // results are still printed.
        let limit = dev.caps()?.total_memory_bytes;
        match render_plot(&a.plot, &vary.key, &base, &points, &kernels, dev.backend(), limit) {
            Ok(()) => plot_path = Some(a.plot.display().to_string()),
            Err(e) => {
                eprintln!("error: {e}");
                // A host resource limit (ulimit -f, a full disk) is exit 3, as for every writer.
                plot_exit = e.exit_code();
                plot_error = Some(e.to_string());
            }
        }
    } else if !a.no_plot {
        eprintln!("not writing the plot {}: the sweep did not verify", a.plot.display());
    }
    let v = serde_json::json!({
        "command": "sweep",
        "backend": dev.backend().name(),
        "backend_reason": reason,
        "vary": vary.key,
        "values": vary.values,
        "points": points,
        "skipped": skipped,
        "plot": plot_path,
        "plot_error": plot_error,
        "verified": all_ok,
    });
    save_evidence(cli, &v)?;
    if cli.json {
        print_json(&v);
    } else {
        let mut header = vec![vary.key.clone()];
        for k in &kernels {
            header.push(format!("{k} peak"));
            header.push(format!("{k} ms"));
            header.push(format!("{k} ok"));
            if a.bytes {
                header.push(format!("{k} read"));
                header.push(format!("{k} written"));
            }
        }
        let mut rows = Vec::new();
        for value in &vary.values {
            let mut row = vec![value.clone()];
            for k in &kernels {
                let pt = points.iter().find(|p| &p.value == value && p.kernel == *k);
                let bytes = |f: fn(&RunReport) -> Option<u64>| match pt {
                    Some(Point { report: Some(r), .. }) => f(r).map(human_bytes).unwrap_or_else(|| "-".into()),
                    _ => "-".into(),
                };
                let (read, written) = (bytes(|r| r.vm_global_bytes_read), bytes(|r| r.vm_global_bytes_written));
                match pt {
                    Some(Point { report: Some(r), .. }) => {
                        row.push(human_bytes(r.peak_device_bytes));
                        row.push(format!("{:.3}", r.time_ms));
                        row.push(if r.verified { "PASS".into() } else { "FAIL".into() });
                    }
                    Some(Point { would_need_bytes: Some(n), .. }) => {
                        row.push(format!("needs {}", human_bytes(*n)));
                        row.push("did not run".into());
                        row.push("-".into());
                    }
                    _ => row.extend(["-".to_string(), "-".to_string(), "-".to_string()]),
                }
                if a.bytes {
                    row.extend([read, written]);
                }
            }
            rows.push(row);
        }
        print!("{}", table(&header, &rows));
        for p in points.iter().filter(|p| !p.ran) {
            println!("{}={} {}: {}", vary.key, p.value, p.kernel, p.reason.as_deref().unwrap_or(""));
        }
        if let Some(path) = &plot_path {
            println!("plot: {path}");
        }
    }
    if !any_ran {
        eprintln!("error: no point of the sweep ran (see the reasons above); nothing was verified");
        return Ok(exit::BAD_INPUT);
    }
    if plot_error.is_some() {
        return Ok(plot_exit);
    }
    Ok(if all_ok { exit::SUCCESS } else { exit::VERIFICATION_FAILED })
}

/// The sweep picture (SVG or PNG by the file name): memory with the device limit, and time.
fn render_plot(
    path: &std::path::Path,
    key: &str,
    base: &Problem,
    points: &[Point],
    kernels: &[KernelKind],
    backend: Backend,
    limit: u64,
) -> Result<(), Error> {
    let rgb = |k: KernelKind| match k {
        KernelKind::Naive => (214, 39, 40),
        KernelKind::Flash => (31, 119, 180),
    };
    let series: Vec<charts::SweepSeries> = kernels
        .iter()
        .map(|&k| charts::SweepSeries {
            name: k.to_string(),
            rgb: rgb(k),
            points: points
                .iter()
                .filter(|p| p.kernel == k)
                .filter_map(|p| {
                    let x = p.value.parse::<f64>().ok()?;
                    let bytes = match &p.report {
                        Some(r) => r.peak_device_bytes as f64,
                        None => p.would_need_bytes? as f64,
                    };
                    Some((x, bytes, p.ran, p.report.as_ref().map(|r| r.time_ms)))
                })
                .collect(),
        })
        .collect();
    let seqs = match key {
        "seq" => String::new(),
        "seq-q" => format!(" seq_kv {}", base.seq_kv),
        "seq-kv" => format!(" seq_q {}", base.seq_q),
        _ => format!(" seq_q {} seq_kv {}", base.seq_q, base.seq_kv),
    };
    let shape = format!(
        "batch {} heads {}{seqs} head_dim {} {}{}",
        base.batch,
        base.heads,
        base.head_dim,
        base.dtype,
        if base.causal { " causal" } else { "" }
    );
    let title = format!(
        "memattn sweep over {key}: naive vs flash, {shape}, {backend} ({}), device limit {}",
        if backend == Backend::Vm { "VM wall clock" } else { "GPU, CUDA events" },
        human_bytes(limit)
    );
    Ok(charts::sweep_chart(path, &title, key, &series, Some(limit))?)
}
