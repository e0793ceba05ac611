//! `memattn trace`: the instruction trace of one VM thread.

use super::args::{Cli, TraceArgs};
use super::{device_options, parse_dim3, print_json, resolve_problem, run_spec};
use memattn_cli::device::vm::VmDevice;
use memattn_cli::device::BackendChoice;
use memattn_cli::error::{exit, Error};
use memattn_cli::problem::{KernelKind, Problem};
use memattn_cli::report::describe_problem;

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
    let lines = a.lines.as_deref().map(parse_lines).transpose()?;
    let mut opts = device_options(cli)?;
    opts.backend = BackendChoice::Vm;
    let mut dev = VmDevice::new(&opts)?;
    dev.request_trace(entry.name(), ptx_vm::TraceRequest { block, thread, max_entries: a.max_entries });
    let spec = run_spec(&a.problem, problem, kernel)?;
    let outcome = memattn_cli::runner::run(&mut dev, &spec, None);
    let (trace, verified, error) = match outcome {
        Ok(report) => (report.trace, Some(report.verified), None),
        // A finding stops the run: the trace up to the instruction that made it is kept.
        Err(e) => (dev.take_trace(), None, Some(e)),
    };
    let packed = if problem.dtype == memattn_cli::Dtype::F32 { None } else { Some(problem.dtype) };
    let shown: Vec<&ptx_vm::TraceEntry> = trace
        .iter()
        .filter(|t| t.finding.is_some() || lines.is_none_or(|(lo, hi)| (lo..=hi).contains(&t.line)))
        .filter(|t| t.finding.is_some() || a.op.as_deref().is_none_or(|op| opcode(&t.text).starts_with(op)))
        .collect();
    let recorded = trace.iter().filter(|t| t.finding.is_none()).count();
    let defaults_note = differing_defaults(&a.problem);
    if cli.json {
        let entries: Vec<serde_json::Value> = shown
            .iter()
            .map(|t| {
                serde_json::json!({
                    "line": t.line,
                    "text": t.text,
                    "source": t.source.as_ref().map(|s| s.to_string()),
                    "executed": t.executed,
                    "finding": t.finding,
                    "writes": t.writes.iter().map(|(r, v)| serde_json::json!({
                        "reg": r,
                        "bits": format!("{v:#x}"),
                        "value": typed_value(&t.text, r, *v, packed),
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        print_json(&serde_json::json!({
            "command": "trace",
            "kernel": entry.name(),
            "shape": problem.shape_json(),
            "defaults_differ_from_run": defaults_note,
            "block": block,
            "thread": thread,
            "grid": dims.grid,
            "block_dim": dims.block,
            "recorded": recorded,
            "entries": entries,
            "verified": verified,
            "error": error.as_ref().map(|e| e.to_string()),
            "exit_code": error.as_ref().map(|e| e.exit_code()),
        }));
        // One JSON object on stdout, errors included: the finding is in it.
        if let Some(e) = &error {
            return Ok(e.exit_code());
        }
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
        if let Some(n) = &defaults_note {
            println!("note: {n}");
        }
        let mut last_src = String::new();
        for t in &shown {
            if t.finding.is_some() && recorded >= a.max_entries {
                println!("   ... (recording stopped after {} instructions; --max-entries N shows more)", a.max_entries);
            }
            let src = t.source.as_ref().map(|s| s.to_string()).unwrap_or_default();
            if !src.is_empty() && src != last_src {
                println!("       -- {src}");
                last_src = src;
            }
            let writes: Vec<String> =
                t.writes.iter().map(|(r, v)| format!("{r}={}", typed_value(&t.text, r, *v, packed))).collect();
            let mark = if t.finding.is_some() {
                "!"
            } else if t.executed {
                " "
            } else {
                "-"
            };
            println!("{:>6} {mark} {:<60} {}", t.line, t.text, writes.join(" "));
            if let Some(kind) = &t.finding {
                println!("         ^ {kind}: this instruction did not complete (the error below has the details)");
            }
        }
        println!(
            "{} of {recorded} recorded instructions shown (\"-\": guard predicate false{}); {}",
            shown.len() - shown.iter().filter(|t| t.finding.is_some()).count(),
            if shown.iter().any(|t| t.finding.is_some()) {
                ", \"!\": the instruction that made the finding"
            } else {
                ""
            },
            match verified {
                Some(true) => "run verified: PASS",
                Some(false) => "run verified: FAIL",
                None => "the run stopped with an error",
            }
        );
    }
    if let Some(e) = error {
        return Err(e);
    }
    Ok(if verified == Some(true) { exit::SUCCESS } else { exit::VERIFICATION_FAILED })
}

/// `A-B` (or `A`) of `--lines`.
fn parse_lines(s: &str) -> Result<(usize, usize), Error> {
    let bad = || Error::Usage(format!("--lines expects A-B, two PTX line numbers (got `{s}`)"));
    let (a, b) = s.split_once('-').unwrap_or((s, s));
    let a: usize = a.trim().parse().map_err(|_| bad())?;
    let b: usize = b.trim().parse().map_err(|_| bad())?;
    if a > b {
        return Err(Error::Usage(format!("--lines {s}: the first line is after the last")));
    }
    Ok((a, b))
}

/// The trace's own defaults where the user did not set the option, as one sentence.
fn differing_defaults(p: &super::args::ProblemArgs) -> Option<String> {
    let mut d = Vec::new();
    if p.heads.is_none() {
        d.push("heads 1 (run: 4)");
    }
    if p.seq.is_none() && p.seq_q.is_none() {
        d.push("seq_q 64 (run: 256)");
    }
    if p.seq.is_none() && p.seq_kv.is_none() && p.seq_q.is_none() {
        d.push("seq_kv 64 (run: 256)");
    }
    if d.is_empty() {
        None
    } else {
        Some(format!(
            "trace uses a smaller default problem than `run`: {}; pass --heads/--seq to trace the same problem",
            d.join(", ")
        ))
    }
}

/// The opcode of an instruction's text (after a `@%p` guard).
fn opcode(text: &str) -> &str {
    let t = text.trim_start();
    let mut words = t.split_whitespace();
    let first = words.next().unwrap_or("");
    if first.starts_with('@') {
        words.next().unwrap_or("")
    } else {
        first
    }
}

/// The instruction's destination type: the first type suffix of its opcode (`cvt.rn.f32.f16` ->
/// f32, `mma....f32.bf16.bf16.f32` -> f32, `ld.shared.b32` -> b32).
fn dst_type(text: &str) -> &str {
    let op = opcode(text);
    const TYPES: [&str; 16] = [
        "f32", "f64", "f16", "bf16", "f16x2", "bf16x2", "u32", "s32", "b32", "u64", "s64", "b64", "u16", "s16", "b16",
        "pred",
    ];
    op.split('.').skip(1).find(|p| TYPES.contains(p)).unwrap_or("")
}

/// A written register as the type the instruction uses, e.g. `1.5`, `[0.25, -1] (bf16x2)`,
/// `42 (u32)`, `true`. 16-bit loads into 32-bit registers (`ldmatrix .b16`) are two elements of
/// the problem's dtype (`packed`).
fn typed_value(text: &str, reg: &str, v: u64, packed: Option<memattn_cli::Dtype>) -> String {
    let half = |bits: u16, bf: bool| -> f32 {
        if bf {
            f32::from_bits((bits as u32) << 16)
        } else {
            half::f16::from_bits(bits).to_f32()
        }
    };
    let pair =
        |bf: bool, name: &str| format!("[{}, {}] ({name}, {v:#x})", half(v as u16, bf), half((v >> 16) as u16, bf));
    if reg.starts_with("%p") {
        return format!("{}", v != 0);
    }
    let ty = dst_type(text);
    let is_rd = reg.starts_with("%rd") || reg.starts_with("%fd");
    let ty = match ty {
        "u32" if is_rd => "u64",
        "s32" if is_rd => "s64",
        t => t,
    };
    match ty {
        "f32" if !is_rd => format!("{}", f32::from_bits(v as u32)),
        "f64" => format!("{}", f64::from_bits(v)),
        "bf16x2" => pair(true, "bf16x2"),
        "f16x2" => pair(false, "f16x2"),
        "bf16" => format!("{} (bf16)", half(v as u16, true)),
        "f16" => format!("{} (f16)", half(v as u16, false)),
        "b16" if reg.starts_with("%r") && !reg.starts_with("%rs") => match packed {
            Some(memattn_cli::Dtype::Bf16) => pair(true, "bf16x2"),
            Some(memattn_cli::Dtype::F16) => pair(false, "f16x2"),
            _ => format!("{v:#x} (b16x2)"),
        },
        "s32" => format!("{} (s32)", v as u32 as i32),
        "s64" => format!("{} (s64)", v as i64),
        "b32" | "b64" if is_rd || ty == "b64" => format!("{v:#x} ({ty})"),
        "b32" => format!("{v:#x} (b32; as f32 {})", f32::from_bits(v as u32)),
        "" => format!("{v:#x}"),
        other => format!("{v} ({other})"),
    }
}
