//! `memattn trace`: the instruction trace of one VM thread, of the naive or flash kernels (on a
//! problem, verified) or of any entry of a PTX module (`--entry`, with `launch`'s buffers and
//! arguments).

use super::args::{Cli, TraceArgs};
use super::{device_options, load_ptx, parse_dim3, print_json, resolve_problem, run_spec};
use memattn_cli::device::vm::VmDevice;
use memattn_cli::device::{BackendChoice, DeviceError};
use memattn_cli::error::{exit, Error};
use memattn_cli::problem::{KernelKind, Problem};
use memattn_cli::report::describe_problem;

/// Tracing your own kernel: any entry of the loaded PTX, launched as `memattn launch` does.
#[derive(Debug, clap::Args)]
#[command(next_help_heading = "Any entry point (--entry): the launch, as `memattn launch` takes it")]
pub struct EntryArgs {
    /// Trace this entry point of the loaded PTX (`--ptx FILE`, e.g. a lesson's
    /// `target/lessons/lesson1.ptx`) instead of the naive or flash kernel. The launch is given
    /// as for `memattn launch`: --grid, --block-dim (the block size: --block and --thread choose
    /// the traced thread), --smem, --buf and --arg. Nothing is verified: the trace is the result.
    #[arg(long, value_name = "NAME")]
    pub entry: Option<String>,
    /// With --entry: grid size x[,y[,z]] [default: 1].
    #[arg(long, value_name = "X[,Y[,Z]]", requires = "entry")]
    pub grid: Option<String>,
    /// With --entry: block size x[,y[,z]] (`launch --block`) [default: 1].
    #[arg(long, value_name = "X[,Y[,Z]]", requires = "entry")]
    pub block_dim: Option<String>,
    /// With --entry: dynamic shared memory in bytes.
    #[arg(long, value_name = "BYTES", requires = "entry")]
    pub smem: Option<u32>,
    /// With --entry: a device buffer NAME=TYPE:LEN[:INIT], as for `launch`. Repeatable.
    #[arg(long, value_name = "NAME=TYPE:LEN[:INIT]", requires = "entry")]
    pub buf: Vec<String>,
    /// With --entry: a kernel argument TYPE=VALUE in parameter order, as for `launch`. Repeatable.
    #[arg(long, value_name = "TYPE=VALUE", allow_hyphen_values = true, requires = "entry")]
    pub arg: Vec<String>,
    /// With --entry: stop the launch after this many seconds, as `launch --max-seconds` (a
    /// kernel that never ends is reported as a hang, with the trace up to there). 0: no limit.
    #[arg(long, default_value_t = 20.0, value_name = "SECONDS", requires = "entry", allow_negative_numbers = true,
          value_parser = super::args::limit_seconds)]
    pub max_seconds: f64,
}

pub fn trace(cli: &Cli, a: &TraceArgs) -> Result<i32, Error> {
    if cli.backend == BackendChoice::Cuda {
        return Err(Error::Usage("trace runs in the VM only (use --backend vm or auto)".into()));
    }
    if let Some(entry) = &a.own.entry {
        return trace_entry(cli, a, entry);
    }
    if cli.ptx.is_some() {
        own_kernel_hint(cli)?;
    }
    let kernel = a.kernel.unwrap_or(KernelKind::Flash);
    // A small default problem: the trace is for reading, not measuring.
    let small = Problem { heads: 1, seq_q: 64, seq_kv: 64, ..Problem::default() };
    let problem = resolve_problem(&a.problem, None, small)?;
    problem.validate_shape(kernel)?;
    // The kernels of the generation the VM models (`--vm-arch`, with MEMATTN_HOPPER's choice),
    // as the run will launch them.
    let hopper = memattn_cli::choice::HopperPolicy::from_env().map_err(Error::Usage)?;
    let planned = problem.launches_on(kernel, memattn_cli::choice::Target::new(cli.vm_arch, hopper))?;
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
    a.lines.as_deref().map(parse_lines).transpose()?;
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
    let defaults_note = differing_defaults(&a.problem);
    let about = About {
        kernel: entry.name().to_string(),
        block,
        thread,
        grid: dims.grid,
        block_dim: dims.block,
        on: describe_problem(&problem),
        json: serde_json::json!({ "shape": problem.shape_json(), "defaults_differ_from_run": defaults_note }),
        note: defaults_note.clone(),
    };
    show(cli, a, &about, &trace, verified, error, packed)
}

/// What was traced, for the header line and the JSON object.
struct About {
    kernel: String,
    block: [u32; 3],
    thread: [u32; 3],
    grid: [u32; 3],
    block_dim: [u32; 3],
    /// "on ..." of the header: the problem, or the PTX file.
    on: String,
    /// Fields added to the JSON object.
    json: serde_json::Value,
    note: Option<String>,
}

/// Prints the trace (filtered by --lines and --op) and returns the exit code: the run's error,
/// 0 (verified, or nothing to verify) or 1 (verification failed).
fn show(
    cli: &Cli,
    a: &TraceArgs,
    about: &About,
    trace: &[ptx_vm::TraceEntry],
    verified: Option<bool>,
    error: Option<Error>,
    packed: Option<memattn_cli::Dtype>,
) -> Result<i32, Error> {
    let lines = a.lines.as_deref().map(parse_lines).transpose()?;
    let shown: Vec<&ptx_vm::TraceEntry> = trace
        .iter()
        .filter(|t| t.finding.is_some() || lines.is_none_or(|(lo, hi)| (lo..=hi).contains(&t.line)))
        .filter(|t| t.finding.is_some() || a.op.as_deref().is_none_or(|op| opcode(&t.text).starts_with(op)))
        .collect();
    let recorded = trace.iter().filter(|t| t.finding.is_none()).count();
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
        let mut obj = serde_json::json!({
            "command": "trace",
            "kernel": about.kernel,
            "block": about.block,
            "thread": about.thread,
            "grid": about.grid,
            "block_dim": about.block_dim,
            "recorded": recorded,
            "entries": entries,
            "verified": verified,
            "error": error.as_ref().map(|e| e.to_string()),
            "exit_code": error.as_ref().map(|e| e.exit_code()),
        });
        if let (Some(o), Some(extra)) = (obj.as_object_mut(), about.json.as_object()) {
            o.extend(extra.clone());
        }
        print_json(&obj);
        // One JSON object on stdout, errors included: the finding is in it.
        if let Some(e) = &error {
            return Ok(e.exit_code());
        }
    } else {
        println!(
            "trace of `{}` block {:?} thread {:?} (grid {:?}, block {:?}) on {}",
            about.kernel, about.block, about.thread, about.grid, about.block_dim, about.on
        );
        if let Some(n) = &about.note {
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
            match (verified, &error) {
                (_, Some(_)) => "the run stopped with an error",
                (Some(true), _) => "run verified: PASS",
                (Some(false), _) => "run verified: FAIL",
                (None, None) => "the launch finished (nothing to verify: `memattn launch` prints the buffers)",
            }
        );
    }
    if let Some(e) = error {
        return Err(e);
    }
    Ok(if verified == Some(false) { exit::VERIFICATION_FAILED } else { exit::SUCCESS })
}

/// `--entry NAME`: one launch of any entry of the loaded PTX, thread `--thread` of block
/// `--block` traced.
fn trace_entry(cli: &Cli, a: &TraceArgs, entry: &str) -> Result<i32, Error> {
    let p = &a.problem;
    let problem_given = p.batch.is_some()
        || p.heads.is_some()
        || p.seq.is_some()
        || p.seq_q.is_some()
        || p.seq_kv.is_some()
        || p.head_dim.is_some()
        || p.dtype.is_some()
        || p.causal;
    if a.kernel.is_some() || a.step.is_some() || problem_given {
        return Err(Error::Usage(format!(
            "--entry {entry} traces a launch given by --grid, --block-dim, --smem, --buf and --arg; \
             --kernel, --step and the problem options (--heads, --seq, --dtype, ...) are for the naive and flash kernels"
        )));
    }
    let grid = super::launch::launch_dim3("grid", a.own.grid.as_deref().unwrap_or("1"))?;
    let block_dim = super::launch::launch_dim3("block-dim", a.own.block_dim.as_deref().unwrap_or("1"))?;
    let block = parse_dim3("block", &a.block)?;
    let thread = parse_dim3("thread", &a.thread)?;
    for i in 0..3 {
        if block[i] >= grid[i] {
            return Err(Error::Usage(format!(
                "--block {block:?} (the traced block's index) is outside the grid {grid:?}; \
                 the block size is --block-dim, the grid size --grid"
            )));
        }
        if thread[i] >= block_dim[i] {
            return Err(Error::Usage(format!(
                "--thread {thread:?} is outside the block {block_dim:?} (the block size is --block-dim)"
            )));
        }
    }
    a.lines.as_deref().map(parse_lines).transpose()?;
    let ptx = load_ptx(cli)?;
    let module = ptx
        .vm_module()
        .map_err(|e| Error::Device(DeviceError::PtxLoad { origin: ptx.origin.clone(), message: e.to_string() }))?;
    let config = ptx_vm::LaunchConfig {
        grid,
        block: block_dim,
        dynamic_shared_bytes: a.own.smem.unwrap_or(0),
        trace: Some(ptx_vm::TraceRequest { block, thread, max_entries: a.max_entries }),
        blocks: None,
    };
    let (trace, error) = super::launch::launch_traced(cli, &module, entry, &config, &a.own, a.problem.seed)?;
    let about = About {
        kernel: entry.to_string(),
        block,
        thread,
        grid,
        block_dim,
        on: ptx.origin.clone(),
        json: serde_json::json!({ "ptx": ptx.origin, "smem_bytes": config.dynamic_shared_bytes }),
        note: (!trace.iter().any(|t| t.source.is_some()) && !trace.is_empty()).then(|| {
            "the PTX has no line table (.file/.loc), so no Rust lines are shown; the lessons' build \
             (`cargo xtask lesson N`, `cargo xtask lesson new NAME`) adds one"
                .to_string()
        }),
    };
    show(cli, a, &about, &trace, None, error, None)
}

/// `--ptx FILE` without `--entry`: the naive and flash kernels need memattn's own module, so a
/// module without them (a lesson's, your own) is pointed at `--entry`.
fn own_kernel_hint(cli: &Cli) -> Result<(), Error> {
    let ptx = load_ptx(cli)?;
    if ptx.text.contains(".entry flash_fwd_") || ptx.text.contains(".entry naive_") {
        return Ok(());
    }
    let entries: Vec<&str> = ptx
        .text
        .lines()
        .filter_map(|l| l.split(".entry").nth(1))
        .filter_map(|r| r.split(|c: char| c == '(' || c.is_whitespace()).find(|w| !w.is_empty()))
        .collect();
    Err(Error::Usage(format!(
        "{} has no naive or flash kernel of memattn; to trace one of its entries ({}), add --entry NAME \
         and the launch: --grid, --block-dim, --buf, --arg (as for `memattn launch`)",
        ptx.origin,
        if entries.is_empty() { "none found".to_string() } else { entries.join(", ") }
    )))
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
