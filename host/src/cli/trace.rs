//! `memattn trace`: the instruction trace of one VM thread.

use super::args::{Cli, TraceArgs};
use super::{device_options, print_json, resolve_problem, run_spec};
use memattn::device::vm::VmDevice;
use memattn::device::BackendChoice;
use memattn::error::{exit, Error};
use memattn::problem::{KernelKind, Problem};
use memattn::report::describe_problem;

fn parse_dim3(what: &str, s: &str) -> Result<[u32; 3], Error> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    if parts.is_empty() || parts.len() > 3 {
        return Err(Error::Usage(format!("--{what} expects X[,Y[,Z]] (got `{s}`)")));
    }
    let mut out = [0u32; 3];
    for (i, p) in parts.iter().enumerate() {
        out[i] = p.parse().map_err(|_| Error::Usage(format!("--{what}: `{p}` is not a non-negative integer")))?;
    }
    Ok(out)
}

pub fn trace(cli: &Cli, a: &TraceArgs) -> Result<i32, Error> {
    if cli.backend == BackendChoice::Cuda {
        return Err(Error::Usage("trace runs in the VM only (use --backend vm or auto)".into()));
    }
    let kernel = a.kernel.unwrap_or(KernelKind::Flash);
    // A small default problem: the trace is for reading, not measuring.
    let small = Problem { heads: 1, seq_q: 64, seq_kv: 64, ..Problem::default() };
    let problem = resolve_problem(&a.problem, None, small)?;
    problem.validate_shape(kernel)?;
    let planned = problem.launches(kernel)?;
    let entry = match kernel {
        KernelKind::Flash if a.step.is_some() => {
            return Err(Error::Usage(
                "--step chooses one of the three naive launches; flash is a single fused launch (drop --step, or add --kernel naive)".into(),
            ))
        }
        KernelKind::Flash => planned[0].kernel,
        // The three naive launches in order: scores, softmax, P·V (in the problem's dtype).
        KernelKind::Naive => match a.step.as_deref().unwrap_or("scores") {
            "scores" => planned[0].kernel,
            "softmax" => planned[1].kernel,
            "pv" => planned[2].kernel,
            s => return Err(Error::Usage(format!("--step must be scores, softmax or pv (got `{s}`)"))),
        },
    };
    let dims = planned.iter().find(|l| l.kernel == entry).map(|l| l.dims).expect("planned launch");
    let block = parse_dim3("block", &a.block)?;
    let thread = parse_dim3("thread", &a.thread)?;
    for i in 0..3 {
        if block[i] >= dims.grid[i] {
            return Err(Error::Usage(format!(
                "--block {:?} is outside the grid {:?} of `{}`",
                block,
                dims.grid,
                entry.name()
            )));
        }
        if thread[i] >= dims.block[i] {
            return Err(Error::Usage(format!(
                "--thread {:?} is outside the block {:?} of `{}`",
                thread,
                dims.block,
                entry.name()
            )));
        }
    }
    let mut opts = device_options(cli)?;
    opts.backend = BackendChoice::Vm;
    let mut dev = VmDevice::new(&opts)?;
    dev.request_trace(entry.name(), ptx_vm::TraceRequest { block, thread, max_entries: a.max_entries });
    let spec = run_spec(&a.problem, problem, kernel)?;
    let report = memattn::runner::run(&mut dev, &spec, None)?;
    let entries: Vec<serde_json::Value> = report
        .trace
        .iter()
        .map(|t| {
            serde_json::json!({
                "line": t.line,
                "text": t.text,
                "executed": t.executed,
                "writes": t.writes.iter().map(|(r, v)| serde_json::json!({"reg": r, "bits": format!("{v:#x}")})).collect::<Vec<_>>(),
            })
        })
        .collect();
    if cli.json {
        print_json(&serde_json::json!({
            "command": "trace",
            "kernel": entry.name(),
            "shape": problem.shape_json(),
            "block": block,
            "thread": thread,
            "grid": dims.grid,
            "block_dim": dims.block,
            "entries": entries,
            "verified": report.verified,
        }));
    } else {
        println!(
            "trace of `{}` block {:?} thread {:?} (grid {:?}, block {:?}) on {}",
            entry.name(),
            block,
            thread,
            dims.grid,
            dims.block,
            describe_problem(&problem)
        );
        for t in &report.trace {
            let writes: Vec<String> = t.writes.iter().map(|(r, v)| format_write(&t.text, r, *v)).collect();
            println!("{:>6} {} {:<60} {}", t.line, if t.executed { " " } else { "-" }, t.text, writes.join(" "));
        }
        println!(
            "{} instructions shown (\"-\": guard predicate false); run verified: {}",
            report.trace.len(),
            if report.verified { "PASS" } else { "FAIL" }
        );
    }
    Ok(if report.verified { exit::SUCCESS } else { exit::VERIFICATION_FAILED })
}

/// A written register as the value the instruction's type suggests, plus its bits.
fn format_write(text: &str, reg: &str, v: u64) -> String {
    let op = text.split_whitespace().next().unwrap_or("");
    if reg.starts_with("%p") {
        format!("{reg}={}", v != 0)
    } else if op.ends_with(".f32") && v <= u32::MAX as u64 {
        format!("{reg}={} ({v:#x})", f32::from_bits(v as u32))
    } else if op.ends_with(".f64") {
        format!("{reg}={} ({v:#x})", f64::from_bits(v))
    } else {
        format!("{reg}={v} ({v:#x})")
    }
}
