//! The `memattn` command line: argument definitions and one function per subcommand.

pub mod args;
mod check;
mod check_backward;
mod check_large;
mod compare;
pub mod cp;
pub mod decode;
mod doctor;
pub mod draw;
mod draw_gpu;
pub mod evidence;
mod launch;
mod plan;
mod run;
mod sweep;
mod trace;

use args::{Cli, Command, ProblemArgs};
use memattn_cli::device::{self, DeviceOptions};
use memattn_cli::error::Error;
use memattn_cli::problem::{KernelKind, Problem};
use memattn_cli::ptx::PtxSource;
use memattn_cli::reference::RowSelection;
use memattn_cli::runner::RunSpec;
use memattn_cli::safetensors_io::FileShape;
use std::time::Duration;

/// Runs the parsed command; returns the exit code.
pub fn dispatch(cli: &Cli) -> Result<i32, Error> {
    // An unwritable evidence file is reported before any measurement, not after it.
    if let Some(path) = &cli.save {
        memattn_cli::evidence::open(path)
            .map_err(|e| Error::Usage(format!("cannot open evidence file {}: {e}", path.display())))?;
    }
    if let Command::Evidence(e) = &cli.command {
        return evidence::command(cli, e);
    }
    // A panic is kept in the evidence too (exit 3, as main reports it), then goes on to main.
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &cli.command {
        Command::Run(a) => run::run(cli, a),
        Command::Compare(a) => compare::compare(cli, a),
        Command::Sweep(a) => sweep::sweep(cli, a),
        Command::Doctor => doctor::doctor(cli),
        Command::Kernels => doctor::kernels(cli),
        Command::Trace(a) => trace::trace(cli, a),
        Command::Plan(a) => plan::plan(cli, a),
        Command::Evidence(_) => unreachable!("answered above, without an evidence line of its own"),
        Command::Launch(a) => launch::launch(cli, a),
        Command::Check(a) => check::check(cli, a),
        Command::Decode(a) => decode::decode(cli, a),
        Command::Draw(a) => draw::draw(cli, a),
    }));
    let outcome = match outcome {
        Ok(o) => o,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            let _ =
                evidence::record_outcome(cli, memattn_cli::error::exit::DEVICE, Some(format!("internal error: {msg}")));
            std::panic::resume_unwind(payload)
        }
    };
    // The evidence line is written whatever the outcome; if it cannot be, a success becomes
    // that error, and any other outcome keeps its own code (the write error is printed).
    if let Err(e) = evidence::record(cli, &outcome) {
        if matches!(outcome, Ok(0)) {
            return Err(e);
        }
        eprintln!("error: {e}");
    }
    outcome
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
    memattn_cli::files::check_distinct(what, path, &others)?;
    memattn_cli::files::check_writable(path, what)?;
    Ok(())
}

/// The PTX to load: `--ptx FILE` or the embedded module.
pub fn load_ptx(cli: &Cli) -> Result<PtxSource, Error> {
    match &cli.ptx {
        None => {
            let src = PtxSource::embedded();
            evidence::ptx_loaded(&src);
            Ok(src)
        }
        Some(path) => {
            // An unreadable path is bad input (2); bytes that are not PTX text do not load (3),
            // like text the VM or the driver cannot parse.
            let bytes = memattn_cli::files::read_regular(path, memattn_cli::files::MAX_PTX_BYTES, "PTX file")?;
            let text = String::from_utf8(bytes).map_err(|e| {
                Error::Device(memattn_cli::device::DeviceError::PtxLoad {
                    origin: path.display().to_string(),
                    message: format!("not UTF-8 text (invalid byte at offset {})", e.utf8_error().valid_up_to()),
                })
            })?;
            let src = PtxSource::from_file(path, text);
            evidence::ptx_loaded(&src);
            Ok(src)
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
    if let Some(secs) = cli.vm_max_seconds {
        // Above a million seconds (11.6 days) a limit is no limit; below a millisecond no launch fits.
        if !(secs.is_finite() && (1e-3..=1e6).contains(&secs)) {
            return Err(Error::Usage(format!("--vm-max-seconds must be between 0.001 and 1000000 (got {secs})")));
        }
        o.vm_max_launch_time = Some(Duration::from_secs_f64(secs));
    }
    if cli.vm_workers == Some(0) {
        return Err(Error::Usage("--vm-workers must be at least 1".into()));
    }
    o.vm_workers = cli.vm_workers;
    o.vm_initcheck = !cli.vm_allow.contains(&args::VmCheck::Initcheck);
    o.vm_racecheck = !cli.vm_allow.contains(&args::VmCheck::Racecheck);
    o.vm_bank_conflicts = cli.vm_bank_conflicts;
    o.vm_sectors = cli.vm_sectors;
    o.vm_arch = cli.vm_arch;
    o.hopper = memattn_cli::choice::HopperPolicy::from_env().map_err(Error::Usage)?;
    Ok(o)
}

/// Opens the device and says which one and why (stderr, human mode only).
pub fn open_device(cli: &Cli) -> Result<(Box<dyn device::Device>, String), Error> {
    open_device_with(cli, |_| {})
}

/// [`open_device`] with the options changed by `change` (`run --timeline`: its module).
pub fn open_device_with(
    cli: &Cli,
    change: impl FnOnce(&mut DeviceOptions),
) -> Result<(Box<dyn device::Device>, String), Error> {
    let mut options = device_options(cli)?;
    change(&mut options);
    let mut opened = device::open(&options)?;
    evidence::device_opened(opened.device.as_mut(), &opened.reason);
    if !cli.json {
        eprintln!("backend: {} - {} ({})", opened.device.backend(), opened.device.name(), opened.reason);
    }
    Ok((opened.device, opened.reason))
}

/// `X[,Y[,Z]]` of `--grid`, `--block`, `--thread` (missing dimensions are 0).
pub fn parse_dim3(what: &str, s: &str) -> Result<[u32; 3], Error> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    if parts.is_empty() || parts.len() > 3 {
        return Err(Error::Usage(format!("--{what} expects X[,Y[,Z]] (got `{s}`)")));
    }
    let mut out = [0u32; 3];
    for (i, p) in parts.iter().enumerate() {
        out[i] = p.parse().map_err(|_| {
            let negative = p.strip_prefix('-').is_some_and(|r| !r.is_empty() && r.chars().all(|c| c.is_ascii_digit()));
            Error::Usage(if negative {
                format!("--{what}: must be >= 0 (got {p})")
            } else {
                format!("--{what}: `{p}` is not a non-negative integer (at most {})", u32::MAX)
            })
        })?;
    }
    Ok(out)
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
    p.alibi = a.alibi || p.alibi;
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
    for (name, v) in [("--warmup", a.warmup), ("--repeats", a.repeats)] {
        if let Some(n) = v.filter(|&n| n > memattn_cli::harness::MAX_LAUNCHES) {
            return Err(Error::Usage(format!(
                "{name} must be at most {} (got {n})",
                memattn_cli::harness::MAX_LAUNCHES
            )));
        }
    }
    Ok(RunSpec {
        problem,
        kernel,
        seed: a.seed,
        warmup: a.warmup,
        repeats: a.repeats,
        check: row_selection(a)?,
        sampled_blocks: false,
        reference_alongside: false,
    })
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
    if w > i32::MAX as u32 {
        return Err(Error::Usage(format!(
            "--sliding-window {w}: W must be at most {} (the window's left side W - 1 is a 32-bit signed count)",
            i32::MAX
        )));
    }
    if w == 0 {
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
    if p.varlen.is_some() && matches!(key, "batch" | "seq" | "seq-q" | "seq-kv") {
        return Err(Error::Usage(format!(
            "--vary {key} with --seqlens-q: a varlen batch takes its batch and lengths from the lists; vary seqlens-q instead"
        )));
    }
    match key {
        "kernel" => {
            *kernel = value.parse().map_err(|e: memattn_cli::problem::ParseEnumError| Error::Usage(e.to_string()))?
        }
        "dtype" => {
            p.dtype = value.parse().map_err(|e: memattn_cli::dtype::UnknownDtype| Error::Usage(e.to_string()))?
        }
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
            p.layout = value.parse().map_err(|e: memattn_cli::problem::ParseEnumError| Error::Usage(e.to_string()))?
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
        "alibi" => p.alibi = parse_bool(key, value)?,
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
        "splits" | "page-size" | "cache-len" | "new-tokens" => {
            return Err(Error::Usage(format!(
                "--vary: `{key}` is a decode option; compare varies the forward problem. Vary it on the \
                 decode command, which prints the same side-by-side table: memattn decode --vary {key}=A,B \
                 (e.g. `memattn decode --cache-len 4096 --vary splits=1,auto`)"
            )))
        }
        _ => return Err(Error::Usage(format!("--vary: unknown key `{key}` (keys: {VARY_KEYS})"))),
    }
    Ok(())
}

/// Keeps `result` (the object `--json` prints) for the `--save` evidence line, which is written
/// once the command has finished, whatever its outcome (see [`evidence::record`]).
pub fn save_evidence(_cli: &Cli, result: &serde_json::Value) -> Result<(), Error> {
    evidence::result(result);
    Ok(())
}

/// Prints a JSON value on stdout.
pub fn print_json(v: &serde_json::Value) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_else(|e| format!("{{\"error\": \"json: {e}\"}}")));
}
