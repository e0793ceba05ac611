//! The `memattn` command line: argument definitions and one function per subcommand.

pub mod args;
mod compare;
pub mod decode;
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
        Command::Decode(a) => decode::decode(cli, a),
    }
}

/// Checks an output path before anything runs: writable, and not the same file as an input, the
/// `--ptx` module or the `--save` evidence file (`inputs` adds the command's own inputs).
pub fn check_output(
    cli: &Cli,
    what: &'static str,
    path: &std::path::Path,
    inputs: &[(&'static str, Option<&std::path::Path>)],
) -> Result<(), Error> {
    let mut others: Vec<(&'static str, Option<&std::path::Path>)> =
        vec![("the --save evidence file", cli.save.as_deref()), ("the --ptx file", cli.ptx.as_deref())];
    others.extend_from_slice(inputs);
    memattn::files::check_distinct(what, path, &others)?;
    memattn::files::check_writable(path, what)?;
    Ok(())
}

/// The PTX to load: `--ptx FILE` or the embedded module.
pub fn load_ptx(cli: &Cli) -> Result<PtxSource, Error> {
    match &cli.ptx {
        None => Ok(PtxSource::embedded()),
        Some(path) => {
            // An unreadable path is bad input (2); bytes that are not PTX text do not load (3),
            // like text the VM or the driver cannot parse.
            let bytes = memattn::files::read_regular(path, memattn::files::MAX_PTX_BYTES, "PTX file")?;
            let text = String::from_utf8(bytes).map_err(|e| {
                Error::Device(memattn::device::DeviceError::PtxLoad {
                    origin: path.display().to_string(),
                    message: format!("not UTF-8 text (invalid byte at offset {})", e.utf8_error().valid_up_to()),
                })
            })?;
            Ok(PtxSource::from_file(path, text))
        }
    }
}

pub fn device_options(cli: &Cli) -> Result<DeviceOptions, Error> {
    let mut o = DeviceOptions::new(cli.backend, load_ptx(cli)?);
    const MAX_NVML_INTERVAL_MS: f64 = 60_000.0;
    if !(cli.nvml_interval_ms.is_finite() && cli.nvml_interval_ms > 0.0) {
        return Err(Error::Usage(format!("--nvml-interval-ms must be > 0 (got {:?})", cli.nvml_interval_ms)));
    }
    if cli.nvml_interval_ms > MAX_NVML_INTERVAL_MS {
        return Err(Error::Usage(format!(
            "--nvml-interval-ms must be at most {MAX_NVML_INTERVAL_MS} (got {:?})",
            cli.nvml_interval_ms
        )));
    }
    o.nvml_interval = Duration::try_from_secs_f64(cli.nvml_interval_ms * 1e-3)
        .map_err(|e| Error::Usage(format!("--nvml-interval-ms {}: {e}", cli.nvml_interval_ms)))?;
    if let Some(mib) = cli.vm_memory_mib {
        if mib == 0 {
            return Err(Error::Usage("--vm-memory-mib must be at least 1".into()));
        }
        o.vm_memory_bytes =
            Some(mib.checked_mul(1 << 20).ok_or_else(|| {
                Error::Usage(format!("--vm-memory-mib must be at most {} (got {mib})", u64::MAX >> 20))
            })?);
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
    for (name, v) in [("--warmup", a.warmup), ("--repeats", a.repeats)] {
        if let Some(n) = v.filter(|&n| n > memattn::runner::MAX_LAUNCHES) {
            return Err(Error::Usage(format!("{name} must be at most {} (got {n})", memattn::runner::MAX_LAUNCHES)));
        }
    }
    Ok(RunSpec { problem, kernel, seed: a.seed, warmup: a.warmup, repeats: a.repeats, check: row_selection(a)? })
}

/// `KEY=A,B,C` of `--vary`.
#[derive(Clone, Debug, PartialEq)]
pub struct Vary {
    pub key: String,
    pub values: Vec<String>,
}

pub const VARY_KEYS: &str = "kernel, dtype, batch, heads, seq, seq-q, seq-kv, head-dim, causal, layout";

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
        apply_vary(&key, value, &mut p, &mut kernel)?;
    }
    Ok(Vary { key, values })
}

/// Refuses a `--vary KEY` that would silently override an option given on the command line
/// (`--vary seq=...` with `--seq 128`): each run sets the varied option, so the other value would
/// be ignored. `kernel_given`: whether `--kernel` was given.
pub fn check_vary_conflict(key: &str, a: &ProblemArgs, kernel_given: bool) -> Result<(), Error> {
    let given: &[(&str, bool)] = &[
        ("--seq", a.seq.is_some()),
        ("--seq-q", a.seq_q.is_some()),
        ("--seq-kv", a.seq_kv.is_some()),
        ("--batch", a.batch.is_some()),
        ("--heads", a.heads.is_some()),
        ("--head-dim", a.head_dim.is_some()),
        ("--dtype", a.dtype.is_some()),
        ("--layout", a.layout.is_some()),
        ("--causal", a.causal),
        ("--kernel", kernel_given),
    ];
    let overridden: &[&str] = match key {
        "seq" => &["--seq", "--seq-q", "--seq-kv"],
        "seq-q" => &["--seq", "--seq-q"],
        "seq-kv" => &["--seq", "--seq-kv"],
        "batch" => &["--batch"],
        "heads" => &["--heads"],
        "head-dim" => &["--head-dim"],
        "dtype" => &["--dtype"],
        "layout" => &["--layout"],
        "causal" => &["--causal"],
        "kernel" => &["--kernel"],
        _ => &[],
    };
    for (flag, is_given) in given {
        if *is_given && overridden.contains(flag) {
            return Err(Error::Usage(format!(
                "--vary {key} sets what {flag} sets, so {flag} would be ignored: give one of them{}",
                match key {
                    "seq-q" => " (to hold seq_kv fixed, give --seq-kv)",
                    "seq-kv" => " (to hold seq_q fixed, give --seq-q)",
                    _ => "",
                }
            )));
        }
    }
    Ok(())
}

/// [`apply_vary`] for a run of `compare` or `sweep`: as on the command line, `seq_kv` follows a
/// varied `seq_q` unless `--seq-kv` was given.
pub fn apply_vary_run(
    key: &str,
    value: &str,
    a: &ProblemArgs,
    p: &mut Problem,
    kernel: &mut KernelKind,
) -> Result<(), Error> {
    apply_vary(key, value, p, kernel)?;
    if key == "seq-q" && a.seq_kv.is_none() && a.seq.is_none() {
        p.seq_kv = p.seq_q;
    }
    Ok(())
}

/// Sets one varied option on a problem (or the kernel).
pub fn apply_vary(key: &str, value: &str, p: &mut Problem, kernel: &mut KernelKind) -> Result<(), Error> {
    let num = |v: &str| -> Result<u32, Error> {
        v.parse::<u32>().map_err(|_| Error::Usage(format!("--vary {key}: `{v}` is not a non-negative integer")))
    };
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
        "argv": std::env::args_os().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>(),
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
