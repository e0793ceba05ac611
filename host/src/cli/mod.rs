//! The `memattn` command line: argument definitions and one function per subcommand.

pub mod args;
mod check;
mod compare;
mod doctor;
mod run;
mod sweep;
mod trace;

use args::{Cli, Command, ProblemArgs};
use memattn::device::{self, DeviceOptions};
use memattn::error::Error;
use memattn::problem::{KernelKind, Problem};
use memattn::ptx::PtxSource;
use memattn::reference::RowSelection;
use memattn::runner::RunSpec;
use memattn::safetensors_io::FileShape;
use std::time::Duration;

/// Runs the parsed command; returns the exit code.
pub fn dispatch(cli: &Cli) -> Result<i32, Error> {
    // An unwritable evidence file is reported before any measurement, not after it.
    if let Some(path) = &cli.save {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| Error::Usage(format!("cannot open evidence file {}: {e}", path.display())))?;
    }
    match &cli.command {
        Command::Run(a) => run::run(cli, a),
        Command::Compare(a) => compare::compare(cli, a),
        Command::Sweep(a) => sweep::sweep(cli, a),
        Command::Doctor => doctor::doctor(cli),
        Command::Kernels => doctor::kernels(cli),
        Command::Trace(a) => trace::trace(cli, a),
        Command::Check(a) => check::check(cli, a),
    }
}

/// The PTX to load: `--ptx FILE` or the embedded module.
pub fn load_ptx(cli: &Cli) -> Result<PtxSource, Error> {
    match &cli.ptx {
        None => Ok(PtxSource::embedded()),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| Error::Usage(format!("cannot read PTX file {}: {e}", path.display())))?;
            Ok(PtxSource::from_file(path, text))
        }
    }
}

pub fn device_options(cli: &Cli) -> Result<DeviceOptions, Error> {
    let mut o = DeviceOptions::new(cli.backend, load_ptx(cli)?);
    if !(cli.nvml_interval_ms.is_finite() && cli.nvml_interval_ms > 0.0) {
        return Err(Error::Usage(format!("--nvml-interval-ms must be > 0 (got {})", cli.nvml_interval_ms)));
    }
    o.nvml_interval = Duration::from_secs_f64(cli.nvml_interval_ms * 1e-3);
    if let Some(mib) = cli.vm_memory_mib {
        if mib == 0 {
            return Err(Error::Usage("--vm-memory-mib must be at least 1".into()));
        }
        o.vm_memory_bytes = Some(mib.saturating_mul(1 << 20));
    }
    if cli.vm_workers == Some(0) {
        return Err(Error::Usage("--vm-workers must be at least 1".into()));
    }
    o.vm_workers = cli.vm_workers;
    o.vm_initcheck = !cli.vm_allow.contains(&args::VmCheck::Initcheck);
    o.vm_racecheck = !cli.vm_allow.contains(&args::VmCheck::Racecheck);
    Ok(o)
}

/// Opens the device and says which one and why (stderr, human mode only).
pub fn open_device(cli: &Cli) -> Result<(Box<dyn device::Device>, String), Error> {
    let opened = device::open(&device_options(cli)?)?;
    if !cli.json {
        eprintln!("backend: {} - {} ({})", opened.device.backend(), opened.device.name(), opened.reason);
    }
    Ok((opened.device, opened.reason))
}

/// Builds the problem from the options, the defaults and (if given) the shape of an input file.
pub fn resolve_problem(a: &ProblemArgs, file: Option<FileShape>, base: Problem) -> Result<Problem, Error> {
    let mut p = base;
    if let Some(f) = file {
        let check = |name: &str, given: Option<u32>, inf: u32| -> Result<(), Error> {
            match given {
                Some(g) if g != inf => Err(Error::Usage(format!(
                    "--{name} {g} contradicts the input file, whose tensors have {name} {inf} (leave it out to use the file's shape)"
                ))),
                _ => Ok(()),
            }
        };
        check("batch", a.batch, f.batch)?;
        check("heads", a.heads, f.heads)?;
        check("seq-q", a.seq_q.or(a.seq), f.seq_q)?;
        check("seq-kv", a.seq_kv.or(a.seq), f.seq_kv)?;
        check("head-dim", a.head_dim, f.head_dim)?;
        check("heads-kv", a.heads_kv, f.heads_kv)?;
        if f.varlen.is_some() && (a.seqlens_q.is_some() || a.batch.is_some()) {
            return Err(Error::Usage(
                "the input file is varlen (it has cu_seqlens_q): leave out --seqlens-q/--batch, the lengths come from the file"
                    .into(),
            ));
        }
        p.heads_kv = Some(f.heads_kv);
        p.batch = f.batch;
        p.heads = f.heads;
        p.seq_q = f.seq_q;
        p.seq_kv = f.seq_kv;
        p.head_dim = f.head_dim;
    } else {
        p.batch = a.batch.unwrap_or(p.batch);
        p.heads = a.heads.unwrap_or(p.heads);
        let sq = a.seq.or(a.seq_q).unwrap_or(p.seq_q);
        p.seq_kv = a.seq.or(a.seq_kv).unwrap_or(sq);
        p.seq_q = sq;
        p.head_dim = a.head_dim.unwrap_or(p.head_dim);
        p.heads_kv = a.heads_kv.or(p.heads_kv);
    }
    if let Some(w) = &a.window {
        p.window = parse_window(w, "--window", ',')?;
    }
    if let Some(w) = a.sliding_window {
        p.window = sliding_window(w)?;
        p.causal = true;
    }
    if let Some(c) = a.softcap {
        p.softcap = c;
    }
    p.sinks = a.sinks || p.sinks;
    if let Some(q) = &a.seqlens_q {
        let kv = a.seqlens_kv.clone().unwrap_or_else(|| q.clone());
        p = Problem::varlen(p, q, &kv)?;
    }
    if let Some(v) = file.and_then(|f| f.varlen) {
        p = Problem::varlen(p, v.seqlens_q, v.seqlens_kv)?;
    }
    p.dtype = a.dtype.unwrap_or(p.dtype);
    p.causal = a.causal || p.causal;
    p.scale = a.scale.or(p.scale);
    p.layout = a.layout.unwrap_or(p.layout);
    Ok(p)
}

pub fn row_selection(a: &ProblemArgs) -> Result<RowSelection, Error> {
    match a.check_rows.to_ascii_lowercase().as_str() {
        "auto" => Ok(RowSelection::auto(a.seed)),
        "all" => Ok(RowSelection::All),
        n => match n.parse::<u64>() {
            Ok(0) | Err(_) => Err(Error::Usage(format!(
                "--check-rows must be `all`, `auto` or a positive number of rows (got `{}`)",
                a.check_rows
            ))),
            Ok(count) => Ok(RowSelection::Sample { count, seed: a.seed }),
        },
    }
}

pub fn run_spec(a: &ProblemArgs, problem: Problem, kernel: KernelKind) -> Result<RunSpec, Error> {
    if a.repeats == Some(0) {
        return Err(Error::Usage("--repeats must be at least 1".into()));
    }
    Ok(RunSpec { problem, kernel, seed: a.seed, warmup: a.warmup, repeats: a.repeats, check: row_selection(a)? })
}

/// `KEY=A,B,C` of `--vary`.
#[derive(Clone, Debug, PartialEq)]
pub struct Vary {
    pub key: String,
    pub values: Vec<String>,
}

pub const VARY_KEYS: &str = "kernel, dtype, batch, heads, seq, seq-q, seq-kv, head-dim, causal, layout, \
                             heads-kv, window, sliding-window, softcap, sinks, seqlens-q, seqlens-kv";

/// `L<sep>R` of a window (`-1` = unbounded); each side must be `-1` or a key count `>= 0`.
pub fn parse_window(s: &str, what: &str, sep: char) -> Result<(i32, i32), Error> {
    let usage = || {
        Error::Usage(format!(
            "{what} `{s}`: expected L{sep}R, two integers, each -1 (unbounded) or a number of keys >= 0 \
             (e.g. 4095{sep}0); query i sees key j iff i + seq_kv - seq_q - L <= j <= i + seq_kv - seq_q + R"
        ))
    };
    let (l, r) = s.split_once(sep).ok_or_else(usage)?;
    let l: i32 = l.trim().parse().map_err(|_| usage())?;
    let r: i32 = r.trim().parse().map_err(|_| usage())?;
    for (side, v) in [("left", l), ("right", r)] {
        if v < -1 {
            return Err(Error::Usage(format!(
                "{what} `{s}`: the {side} side is {v}; each side must be -1 (unbounded) or a number of keys >= 0"
            )));
        }
    }
    Ok((l, r))
}

/// `sliding_window = W` (a model config's convention) as a window: `(W - 1, 0)`.
pub fn sliding_window(w: u32) -> Result<(i32, i32), Error> {
    if w == 0 || w > i32::MAX as u32 {
        return Err(Error::Usage(format!(
            "--sliding-window {w}: W must be at least 1 (it counts the query itself: W = 1 sees only the diagonal, \
             the same as --window 0,0 --causal)"
        )));
    }
    Ok((w as i32 - 1, 0))
}

fn parse_bool(key: &str, value: &str) -> Result<bool, Error> {
    match value.to_ascii_lowercase().as_str() {
        "true" | "1" | "on" | "yes" => Ok(true),
        "false" | "0" | "off" | "no" => Ok(false),
        _ => Err(Error::Usage(format!("--vary {key}: `{value}` is not true/false"))),
    }
}

pub fn parse_vary(s: &str) -> Result<Vary, Error> {
    let Some((k, v)) = s.split_once('=') else {
        return Err(Error::Usage(format!("--vary expects KEY=A,B[,...] (got `{s}`); keys: {VARY_KEYS}")));
    };
    let key = k.trim().to_ascii_lowercase().replace('_', "-");
    let values: Vec<String> = v.split(',').map(|x| x.trim().to_string()).filter(|x| !x.is_empty()).collect();
    if values.is_empty() {
        return Err(Error::Usage(format!("--vary {key}= has no values")));
    }
    // Validate every value now, so a typo fails before any run.
    let mut p = Problem::default();
    let mut kernel = KernelKind::Flash;
    for value in &values {
        if key == "seqlens-kv" {
            // Needs the run's --seqlens-q; checked per run. Here: the numbers.
            for n in value.split(':') {
                n.parse::<u32>()
                    .map_err(|_| Error::Usage(format!("--vary {key}: `{n}` is not a non-negative integer")))?;
            }
            continue;
        }
        apply_vary(&key, value, &mut p, &mut kernel)?;
    }
    Ok(Vary { key, values })
}

/// Sets one varied option on a problem (or the kernel).
pub fn apply_vary(key: &str, value: &str, p: &mut Problem, kernel: &mut KernelKind) -> Result<(), Error> {
    let num = |v: &str| -> Result<u32, Error> {
        v.parse::<u32>().map_err(|_| Error::Usage(format!("--vary {key}: `{v}` is not a non-negative integer")))
    };
    if p.varlen.is_some() && matches!(key, "batch" | "seq" | "seq-q" | "seq-kv") {
        return Err(Error::Usage(format!(
            "--vary {key} with --seqlens-q: a varlen batch takes its batch and lengths from the lists; vary seqlens-q instead"
        )));
    }
    match key {
        "kernel" => {
            *kernel = value.parse().map_err(|e: memattn::problem::ParseEnumError| Error::Usage(e.to_string()))?
        }
        "dtype" => p.dtype = value.parse().map_err(|e: memattn::dtype::UnknownDtype| Error::Usage(e.to_string()))?,
        "batch" => p.batch = num(value)?,
        "heads" => p.heads = num(value)?,
        "seq" => {
            p.seq_q = num(value)?;
            p.seq_kv = p.seq_q;
        }
        "seq-q" => p.seq_q = num(value)?,
        "seq-kv" => p.seq_kv = num(value)?,
        "head-dim" => p.head_dim = num(value)?,
        "causal" => {
            p.causal = match value.to_ascii_lowercase().as_str() {
                "true" | "1" | "on" | "yes" => true,
                "false" | "0" | "off" | "no" => false,
                _ => return Err(Error::Usage(format!("--vary causal: `{value}` is not true/false"))),
            }
        }
        "layout" => {
            p.layout = value.parse().map_err(|e: memattn::problem::ParseEnumError| Error::Usage(e.to_string()))?
        }
        "heads-kv" => p.heads_kv = Some(num(value)?),
        "window" => p.window = parse_window(value, "--vary window", ':')?,
        "sliding-window" => {
            p.window = sliding_window(num(value)?)?;
            p.causal = true;
        }
        "softcap" => {
            p.softcap =
                value.parse::<f32>().map_err(|_| Error::Usage(format!("--vary softcap: `{value}` is not a number")))?;
            if !(p.softcap.is_finite() && p.softcap >= 0.0) {
                return Err(Error::Usage(format!(
                    "--vary softcap: {value} is invalid; it must be 0 (off) or a finite number > 0"
                )));
            }
        }
        "sinks" => p.sinks = parse_bool(key, value)?,
        "seqlens-q" | "seqlens-kv" => {
            let lens: Vec<u32> = value.split(':').map(num).collect::<Result<_, _>>()?;
            let (q, kv) = match (key, p.varlen) {
                ("seqlens-q", Some(v)) if v.seqlens_kv.len() == lens.len() && v.seqlens_kv != v.seqlens_q => {
                    (lens.clone(), v.seqlens_kv.to_vec())
                }
                ("seqlens-q", _) => (lens.clone(), lens.clone()),
                (_, Some(v)) => (v.seqlens_q.to_vec(), lens.clone()),
                (_, None) => {
                    return Err(Error::Usage(
                        "--vary seqlens-kv needs --seqlens-q (the query lengths of the same sequences)".into(),
                    ))
                }
            };
            *p = Problem::varlen(*p, &q, &kv)?;
        }
        _ => return Err(Error::Usage(format!("--vary: unknown key `{key}` (keys: {VARY_KEYS})"))),
    }
    Ok(())
}

/// Appends `result` to the `--save` evidence file as one JSON line, with the command line, the
/// time and the loaded PTX's hash, so a series of measurements can be compared later.
pub fn save_evidence(cli: &Cli, result: &serde_json::Value) -> Result<(), Error> {
    let Some(path) = &cli.save else { return Ok(()) };
    let recorded = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let ptx = load_ptx(cli)?;
    let line = serde_json::json!({
        "recorded_unix_s": recorded,
        "argv": std::env::args().collect::<Vec<_>>(),
        "memattn_version": env!("CARGO_PKG_VERSION"),
        "ptx": {"origin": ptx.origin, "sha256": ptx.sha256},
        "result": result,
    });
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| Error::Usage(format!("cannot open evidence file {}: {e}", path.display())))?;
    writeln!(f, "{line}").map_err(|e| Error::Usage(format!("cannot write evidence file {}: {e}", path.display())))?;
    if !cli.json {
        eprintln!("evidence appended to {}", path.display());
    }
    Ok(())
}

/// Prints a JSON value on stdout.
pub fn print_json(v: &serde_json::Value) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_else(|e| format!("{{\"error\": \"json: {e}\"}}")));
}
