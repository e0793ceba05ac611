//! `--save`: one evidence line per command, whatever its outcome; `memattn evidence show|diff|rerun`.
//!
//! Commands report what they expect, what they observed and their result here while they run
//! ([`expect`], [`device_opened`], [`result`]); [`record`] writes the line once the command has
//! finished, with its exit code and message, so refusals (exit 2), device errors (exit 3) and failed
//! verifications (exit 1) are kept like successes. The PTX hash is the one of the text that was
//! loaded for the run, kept when it was loaded.

use super::args::{Cli, EvidenceCommand};
use memattn_cli::device::Device;
use memattn_cli::error::{exit, Error};
use memattn_cli::evidence::{self as ev, Metric};
use memattn_cli::ptx::PtxSource;
use memattn_cli::report::{human_bytes, table};
use serde_json::{json, Value};
use std::sync::Mutex;

#[derive(Default)]
struct Context {
    ptx: Option<Value>,
    device: Option<Value>,
    expected: Option<Value>,
    result: Option<Value>,
    message: Option<String>,
}

static CONTEXT: Mutex<Context> =
    Mutex::new(Context { ptx: None, device: None, expected: None, result: None, message: None });

fn with<T>(f: impl FnOnce(&mut Context) -> T) -> T {
    let mut g = CONTEXT.lock().unwrap_or_else(|p| p.into_inner());
    f(&mut g)
}

/// The PTX this command loaded (origin and SHA-256 of the text that was parsed).
pub fn ptx_loaded(src: &PtxSource) {
    with(|c| c.ptx = Some(json!({"origin": src.origin, "sha256": src.sha256})));
}

/// The device the command opened and its memory before anything was allocated.
pub fn device_opened(dev: &mut dyn Device, reason: &str) {
    let caps = dev.caps().ok();
    let v = json!({
        "backend": dev.backend().name(),
        "name": dev.name(),
        "reason": reason,
        "total_bytes": caps.map(|c| c.total_memory_bytes),
        "free_bytes": caps.map(|c| c.free_memory_bytes),
    });
    with(|c| c.device = Some(v));
}

/// The state the command expects before it measures (e.g. the analytic bytes of a run).
pub fn expect(v: Value) {
    with(|c| c.expected = Some(v));
}

/// The command's result (the object `--json` prints).
pub fn result(v: &Value) {
    with(|c| c.result = Some(v.clone()));
}

/// The message of an outcome that is not an error but not a success either.
pub fn message(m: &str) {
    with(|c| c.message = Some(m.to_string()));
}

fn command_name(cli: &Cli) -> &'static str {
    use super::args::Command::*;
    match &cli.command {
        Run(_) => "run",
        Compare(_) => "compare",
        Sweep(_) => "sweep",
        Doctor => "doctor",
        Kernels => "kernels",
        Trace(_) => "trace",
        Plan(_) => "plan",
        Evidence(_) => "evidence",
        Launch(_) => "launch",
        Check(_) => "check",
        Decode(_) => "decode",
        Draw(_) => "draw",
    }
}

/// The observed state: the device and its memory, and each run's measured memory.
fn observed(device: Option<Value>, result: &Option<Value>) -> Value {
    let mut o = json!({"device": device});
    if let Some(r) = result {
        if r["memory"].is_object() {
            o["memory"] = r["memory"].clone();
            o["peak_device_bytes"] = r["peak_device_bytes"].clone();
        }
        let runs: Vec<Value> = ["runs", "points"]
            .iter()
            .flat_map(|k| r[*k].as_array().cloned().unwrap_or_default())
            .map(|p| {
                json!({
                    "value": p["value"], "kernel": p["kernel"], "ran": p["ran"],
                    "peak_device_bytes": p["report"]["peak_device_bytes"], "memory": p["report"]["memory"],
                    "would_need_bytes": p["would_need_bytes"], "reason": p["reason"],
                })
            })
            .collect();
        if !runs.is_empty() {
            o["runs"] = runs.into();
        }
    }
    o
}

fn expected_from_result(r: &Value) -> Value {
    if r["analytic_bytes"].is_object() {
        return json!({"problem": r["shape"], "dtype": r["dtype"], "kernel": r["kernel"], "analytic_bytes": r["analytic_bytes"]});
    }
    let runs: Vec<Value> = ["runs", "points"]
        .iter()
        .flat_map(|k| r[*k].as_array().cloned().unwrap_or_default())
        .map(|p| {
            json!({"value": p["value"], "kernel": p["kernel"],
                   "analytic_bytes": if p["report"].is_object() { p["report"]["analytic_bytes"]["total"].clone() } else { p["would_need_bytes"].clone() }})
        })
        .collect();
    if runs.is_empty() {
        Value::Null
    } else {
        json!({ "runs": runs })
    }
}

/// Writes the evidence line of the command that just finished (nothing without `--save`).
pub fn record(cli: &Cli, outcome: &Result<i32, Error>) -> Result<(), Error> {
    match outcome {
        Ok(c) => record_outcome(cli, *c, None),
        Err(e) => record_outcome(cli, e.exit_code(), Some(e.to_string())),
    }
}

/// Writes the evidence line of an outcome: its exit code and, for an error, its message.
pub fn record_outcome(cli: &Cli, code: i32, error: Option<String>) -> Result<(), Error> {
    let Some(path) = &cli.save else { return Ok(()) };
    if let Some(clash) = save_clash(path) {
        // The refusal itself is the outcome: appending to an input, a module or an output would
        // destroy it.
        eprintln!("not appending evidence: --save {} is the same file as {clash}", path.display());
        return Ok(());
    }
    let (ptx, device, expected, result, message) =
        with(|c| (c.ptx.take(), c.device.take(), c.expected.take(), c.result.take(), c.message.take()));
    let message = match error {
        Some(e) => Some(e),
        None if code == exit::VERIFICATION_FAILED && message.is_none() => {
            let first = result
                .as_ref()
                .and_then(|r| r["verification"]["failures"].as_array().and_then(|f| f.first().cloned()))
                .and_then(|f| f.as_str().map(str::to_string));
            Some(format!("verification failed{}", first.map(|f| format!(": {f}")).unwrap_or_default()))
        }
        None => message,
    };
    let expected = expected.or_else(|| result.as_ref().map(expected_from_result));
    let recorded = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let line = json!({
        "recorded_unix_s": recorded,
        "argv": std::env::args_os().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>(),
        "memattn_version": env!("CARGO_PKG_VERSION"),
        "command": command_name(cli),
        "exit_code": code,
        "message": message,
        "ptx": ptx,
        "expected": expected,
        "observed": observed(device, &result),
        "result": result,
    });
    ev::append(path, &line).map_err(|e| match e {
        // The file-size limit or a full disk: a host resource (exit 3), not bad input.
        ev::AppendError::Resource(message) => Error::File(memattn_cli::files::FileError::Resource {
            what: "evidence file",
            path: path.display().to_string(),
            message,
        }),
        ev::AppendError::Io(e) => Error::Usage(format!("cannot write evidence file {}: {e}", path.display())),
    })?;
    if !cli.json {
        eprintln!("evidence appended to {} (exit code {code})", path.display());
    }
    Ok(())
}

/// The path option of this command line that names the same file as `--save`, if any (files that
/// evidence must never be appended to).
fn save_clash(save: &std::path::Path) -> Option<String> {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    for (i, a) in args.iter().enumerate() {
        let a = a.to_string_lossy();
        for opt in ["--inputs", "--output", "--plot", "--ptx", "--config"] {
            let value = match a.strip_prefix(&format!("{opt}=")) {
                Some(v) => Some(std::path::PathBuf::from(v)),
                None if a == opt => args.get(i + 1).map(std::path::PathBuf::from),
                None => None,
            };
            if let Some(v) = value {
                if memattn_cli::files::same_file(save, &v) {
                    return Some(format!("{opt} {}", v.display()));
                }
            }
        }
    }
    None
}

/// Records a command line that did not parse (exit 2), if it names `--save FILE`; a failure to
/// write is printed, the exit code stays 2.
pub fn record_refused_command_line(message: &str) {
    let args: Vec<String> = std::env::args_os().map(|a| a.to_string_lossy().into_owned()).collect();
    let path = args.iter().enumerate().find_map(|(i, a)| match a.strip_prefix("--save=") {
        Some(p) => Some(p.to_string()),
        None if a == "--save" => args.get(i + 1).cloned(),
        None => None,
    });
    let Some(path) = path else { return };
    if let Some(clash) = save_clash(std::path::Path::new(&path)) {
        eprintln!("not appending evidence: --save {path} is the same file as {clash}");
        return;
    }
    let recorded = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    // The error and its details, without the usage and help lines that follow.
    let first: Vec<&str> = message
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.is_empty())
        .collect();
    let first = first.join(" ");
    let line = json!({
        "recorded_unix_s": recorded,
        "argv": args,
        "memattn_version": env!("CARGO_PKG_VERSION"),
        "command": null,
        "exit_code": exit::BAD_INPUT,
        "message": first,
        "ptx": null,
        "expected": null,
        "observed": null,
        "result": null,
    });
    match ev::append(std::path::Path::new(&path), &line) {
        Ok(()) => eprintln!("evidence appended to {path} (exit code 2)"),
        Err(e) => eprintln!("error: cannot write evidence file {path}: {e}"),
    }
}

fn fmt_value(m: &Metric) -> String {
    match (m.unit, &m.value) {
        ("bytes", Value::Number(n)) => n.as_u64().map(human_bytes).unwrap_or_else(|| n.to_string()),
        ("ms", Value::Number(n)) => format!("{:.3}", n.as_f64().unwrap_or(f64::NAN)),
        ("err", Value::Number(n)) => format!("{:.2e}", n.as_f64().unwrap_or(f64::NAN)),
        (_, Value::String(s)) => s.clone(),
        (_, v) => v.to_string(),
    }
}

fn change(a: &Metric, b: &Metric) -> String {
    if a.value == b.value {
        return "same".into();
    }
    match (a.value.as_f64(), b.value.as_f64(), a.unit) {
        (Some(x), Some(y), "bytes" | "ms" | "err") if x > 0.0 => {
            let d = y - x;
            let delta = if a.unit == "bytes" {
                format!("{}{}", if d < 0.0 { "-" } else { "+" }, human_bytes(d.abs() as u64))
            } else {
                format!("{d:+.3e}")
            };
            format!("{delta} ({:.2}x)", y / x)
        }
        (Some(x), Some(y), "") => format!("{:+}", y - x),
        _ => "changed".into(),
    }
}

fn argv(v: &Value) -> Vec<String> {
    v["argv"].as_array().into_iter().flatten().filter_map(|a| a.as_str().map(str::to_string)).collect()
}

fn short_cmd(v: &Value) -> String {
    argv(v).iter().skip(1).cloned().collect::<Vec<_>>().join(" ")
}

fn load(file: &std::path::Path) -> Result<(Vec<ev::Record>, Vec<ev::BadLine>), Error> {
    ev::read(file).map_err(Error::Usage)
}

fn find(records: &[ev::Record], bad: &[ev::BadLine], n: usize, file: &std::path::Path) -> Result<Value, Error> {
    if let Some(r) = records.iter().find(|r| r.line == n) {
        return Ok(r.value.clone());
    }
    if let Some(b) = bad.iter().find(|b| b.line == n) {
        return Err(Error::Usage(format!("{} line {n} is not a JSON record: {}", file.display(), b.error)));
    }
    let lines: Vec<String> = records.iter().map(|r| r.line.to_string()).collect();
    Err(Error::Usage(format!("{} has no record on line {n} (records: {})", file.display(), lines.join(", "))))
}

fn bad_lines_error(file: &std::path::Path, bad: &[ev::BadLine]) -> Error {
    let list: Vec<String> =
        bad.iter().map(|b| format!("line {}: {} (starts `{}`)", b.line, b.error, b.start)).collect();
    Error::Usage(format!("{} is not JSON lines: {}", file.display(), list.join("; ")))
}

/// The diff of two records as table rows.
fn diff_rows(a: &Value, b: &Value) -> Vec<Vec<String>> {
    let (ma, mb) = (ev::metrics(a), ev::metrics(b));
    let mut names: Vec<String> = ma.iter().map(|m| m.name.clone()).collect();
    for m in &mb {
        if !names.contains(&m.name) {
            names.push(m.name.clone());
        }
    }
    names
        .iter()
        .map(|n| {
            let x = ma.iter().find(|m| &m.name == n);
            let y = mb.iter().find(|m| &m.name == n);
            vec![
                n.clone(),
                x.map(fmt_value).unwrap_or_else(|| "-".into()),
                y.map(fmt_value).unwrap_or_else(|| "-".into()),
                match (x, y) {
                    (Some(x), Some(y)) => change(x, y),
                    _ => "-".into(),
                },
            ]
        })
        .collect()
}

fn print_diff(a: &Value, la: usize, b: &Value, lb: usize) {
    println!("run {la}: {}", short_cmd(a));
    println!("run {lb}: {}", short_cmd(b));
    let changes = ev::argv_changes(&argv(a)[1.min(argv(a).len())..], &argv(b)[1.min(argv(b).len())..]);
    if changes.is_empty() {
        println!("options: the same command line (a repeat of the same measurement)");
    } else {
        println!("options changed: {}", changes.join("; "));
    }
    if a["ptx"]["sha256"] != b["ptx"]["sha256"] {
        println!("PTX changed: {} -> {}", a["ptx"]["sha256"], b["ptx"]["sha256"]);
    }
    for (l, r) in [(la, a), (lb, b)] {
        if let Some(m) = r["message"].as_str() {
            println!("run {l} message: {m}");
        }
    }
    let header: Vec<String> =
        ["", &format!("run {la}"), &format!("run {lb}"), "change"].iter().map(|s| s.to_string()).collect();
    print!("{}", table(&header, &diff_rows(a, b)));
}

/// File-valued options that only read their file; every other option whose value names a file
/// (`FILE…` in `--help`) is one the command writes.
const READING_OPTIONS: [&str; 2] = ["--ptx", "--inputs"];

/// An option of some subcommand whose value is a file the command writes, and the file it writes
/// when the option is left out (a default), read off the command's definition: a writing option
/// added later is covered without a list to keep.
struct WritingOption {
    long: String,
    /// The subcommand that declares it (`None`: a global option).
    subcommand: Option<String>,
    default: Option<String>,
}

fn writing_options() -> Vec<WritingOption> {
    use clap::CommandFactory;
    fn walk(c: &clap::Command, sub: Option<&str>, out: &mut Vec<WritingOption>) {
        for a in c.get_arguments() {
            let (Some(long), Some(names)) = (a.get_long(), a.get_value_names()) else { continue };
            let long = format!("--{long}");
            if !names.iter().any(|n| n.as_str().starts_with("FILE")) || READING_OPTIONS.contains(&long.as_str()) {
                continue;
            }
            if out.iter().any(|w| w.long == long && w.subcommand.as_deref() == sub) {
                continue; // a global option, seen again under each subcommand
            }
            let default = a.get_default_values().first().map(|v| v.to_string_lossy().into_owned());
            let subcommand = if a.is_global_set() { None } else { sub.map(str::to_string) };
            out.push(WritingOption { long, subcommand, default });
        }
        for s in c.get_subcommands() {
            walk(s, Some(s.get_name()), out);
        }
    }
    let mut out = Vec::new();
    walk(&super::args::Cli::command(), None, &mut out);
    out
}

/// The value of `opt` in `args` (`--opt V` or `--opt=V`), each occurrence.
fn option_values<'a>(args: &'a [String], opt: &str) -> Vec<&'a str> {
    let mut out = Vec::new();
    for (i, a) in args.iter().enumerate() {
        if a == opt {
            if let Some(v) = args.get(i + 1) {
                out.push(v.as_str());
            }
        } else if let Some(v) = a.strip_prefix(opt).and_then(|r| r.strip_prefix('=')) {
            out.push(v);
        }
    }
    out
}

/// A record's command line may be replayed only if it is not itself a rerun (which would replay
/// without end) and writes no file the user did not name: `--save` to the evidence file being
/// rerun is allowed (the rerun's own line); any other option that writes a file
/// ([`writing_options`]: `--output`, `--save`, `--plot`, `draw --out`, …), given or by default,
/// needs `--allow-writes`.
fn check_replayable(args: &[String], file: &std::path::Path, n: usize, allow_writes: bool) -> Result<(), Error> {
    let evidence_at = args.iter().position(|a| a == "evidence");
    if evidence_at.is_some_and(|i| args[i + 1..].iter().any(|a| a == "rerun")) {
        return Err(Error::Usage(format!(
            "{} line {n} is itself an `evidence rerun`: refusing to replay it (it would rerun without end)",
            file.display()
        )));
    }
    if allow_writes {
        return Ok(());
    }
    let mut writes = Vec::new();
    for w in writing_options() {
        let given = option_values(args, &w.long);
        for v in &given {
            let own_evidence = w.long == "--save" && memattn_cli::files::same_file(file, std::path::Path::new(v));
            if !own_evidence {
                writes.push(format!("{} {v}", w.long));
            }
        }
        // A subcommand that writes a file by default (e.g. `sweep`'s plot) writes it when replayed.
        if let (Some(sub), Some(default), true) = (&w.subcommand, &w.default, given.is_empty()) {
            if args.iter().any(|a| a == sub) && !writes.iter().any(|x| x.starts_with(&w.long)) {
                writes.push(format!("{} {default} (its default)", w.long));
            }
        }
    }
    if !writes.is_empty() {
        return Err(Error::Usage(format!(
            "{} line {n} writes files ({}): refusing to replay it without --allow-writes",
            file.display(),
            writes.join(", ")
        )));
    }
    Ok(())
}

/// The process id of the running rerun child (0: none), for the signal handler.
static CHILD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn forward_signal(sig: libc::c_int) {
    let pid = CHILD.load(std::sync::atomic::Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill(2) is async-signal-safe; `pid` is our own child, not yet reaped.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

/// Asks the kernel to send the child SIGTERM when this process dies.
#[cfg(target_os = "linux")]
fn end_with_parent(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the child between fork and exec and calls only prctl(2), which
    // is async-signal-safe and changes only the child's own state.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn end_with_parent(_cmd: &mut std::process::Command) {}

/// Runs the rerun's child: SIGTERM, SIGINT and SIGHUP sent to this process are passed on to
/// it, and it gets SIGTERM should this process die first (Linux), so no child is orphaned.
fn run_child(cmd: &mut std::process::Command) -> std::io::Result<std::process::ExitStatus> {
    end_with_parent(cmd);
    let mut child = cmd.spawn()?;
    CHILD.store(child.id() as i32, std::sync::atomic::Ordering::SeqCst);
    let handler = forward_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: installs a handler that only calls kill(2); the previous dispositions are restored
    // below once the child is reaped.
    let old = unsafe { [libc::SIGTERM, libc::SIGINT, libc::SIGHUP].map(|s| (s, libc::signal(s, handler))) };
    let status = child.wait();
    CHILD.store(0, std::sync::atomic::Ordering::SeqCst);
    for (s, h) in old {
        // SAFETY: restores the disposition saved above.
        unsafe {
            libc::signal(s, h);
        }
    }
    status
}

pub fn command(cli: &Cli, c: &EvidenceCommand) -> Result<i32, Error> {
    match c {
        EvidenceCommand::Show { file } => {
            let (records, bad) = load(file)?;
            // A record an older version's interrupted append left cut short is skipped with a
            // warning; any other line that is not a record is an error.
            let (torn, bad): (Vec<_>, Vec<_>) = bad.into_iter().partition(|b| b.torn);
            for t in &torn {
                eprintln!(
                    "warning: {} line {} is a record cut short (an append that did not finish: {}), skipped",
                    file.display(),
                    t.line,
                    t.error
                );
            }
            if cli.json {
                super::print_json(&json!({
                    "command": "evidence show",
                    "records": records.iter().map(|r| json!({"line": r.line, "record": r.value})).collect::<Vec<_>>(),
                    "bad_lines": bad.iter().map(|b| json!({"line": b.line, "error": b.error})).collect::<Vec<_>>(),
                    "torn_lines": torn.iter().map(|b| json!({"line": b.line, "error": b.error})).collect::<Vec<_>>(),
                }));
            } else {
                let header: Vec<String> = [
                    "#",
                    "command",
                    "exit",
                    "expected",
                    "measured",
                    "time ms",
                    "verified",
                    "ptx",
                    "message / command line",
                ]
                .iter()
                .map(|s| s.to_string())
                .collect();
                let rows: Vec<Vec<String>> = records
                    .iter()
                    .map(|r| {
                        let v = &r.value;
                        let ms = ev::metrics(v);
                        let get = |name: &str| {
                            let all: Vec<String> =
                                ms.iter().filter(|m| m.name.ends_with(name)).map(fmt_value).collect();
                            if all.is_empty() {
                                "-".to_string()
                            } else {
                                all.join(" / ")
                            }
                        };
                        let expected = if v["command"] == "plan" { get("plan total") } else { get("expected bytes") };
                        vec![
                            r.line.to_string(),
                            v["command"].as_str().unwrap_or("?").to_string(),
                            v["exit_code"].to_string(),
                            expected,
                            get("measured peak"),
                            get("time ms"),
                            get("verified"),
                            v["ptx"]["sha256"]
                                .as_str()
                                // Characters, not bytes: a record edited by hand may hold any text.
                                .map(|s| s.chars().take(12).collect::<String>())
                                .unwrap_or_else(|| "-".into()),
                            v["message"].as_str().map(|m| m.chars().take(90).collect()).unwrap_or_else(|| short_cmd(v)),
                        ]
                    })
                    .collect();
                print!("{}", table(&header, &rows));
                println!("{} records in {}", records.len(), file.display());
            }
            if bad.is_empty() {
                Ok(exit::SUCCESS)
            } else {
                Err(bad_lines_error(file, &bad))
            }
        }
        EvidenceCommand::Diff { file, a, b } => {
            let (records, bad) = load(file)?;
            let (ra, rb) = (find(&records, &bad, *a, file)?, find(&records, &bad, *b, file)?);
            if cli.json {
                let rows = diff_rows(&ra, &rb);
                super::print_json(&json!({
                    "command": "evidence diff",
                    "a": a, "b": b,
                    "options_changed": ev::argv_changes(&argv(&ra), &argv(&rb)),
                    "rows": rows.iter().map(|r| json!({"name": r[0], "a": r[1], "b": r[2], "change": r[3]})).collect::<Vec<_>>(),
                }));
            } else {
                print_diff(&ra, *a, &rb, *b);
            }
            Ok(exit::SUCCESS)
        }
        EvidenceCommand::Rerun { file, n, allow_writes } => {
            let (records, bad) = load(file)?;
            let rec = find(&records, &bad, *n, file)?;
            let args = argv(&rec);
            if args.len() < 2 {
                return Err(Error::Usage(format!("{} line {n} has no command line (argv)", file.display())));
            }
            check_replayable(&args[1..], file, *n, *allow_writes)?;
            let exe = std::env::current_exe()
                .map_err(|e| Error::Usage(format!("cannot find the memattn executable: {e}")))?;
            eprintln!("rerun of {} line {n}: memattn {}", file.display(), args[1..].join(" "));
            let status = run_child(std::process::Command::new(exe).args(&args[1..]))
                .map_err(|e| Error::Usage(format!("cannot start memattn: {e}")))?;
            let code = match status.code() {
                Some(c) => c,
                None => {
                    use std::os::unix::process::ExitStatusExt;
                    eprintln!("the rerun was ended by signal {}", status.signal().unwrap_or(0));
                    exit::DEVICE
                }
            };
            // The rerun appended its own line when it had --save: compare it with run N.
            let saved_here = args.windows(2).any(|w| w[0] == "--save" && std::path::Path::new(&w[1]) == file.as_path());
            if saved_here {
                let (after, _) = load(file)?;
                if let Some(last) = after.last().filter(|l| l.line > records.last().map(|r| r.line).unwrap_or(0)) {
                    println!("\nrun {n} and its rerun (line {}):", last.line);
                    print_diff(&rec, *n, &last.value, last.line);
                }
            }
            let was = rec["exit_code"].as_i64().unwrap_or(-1);
            if !cli.json {
                println!("exit code: run {n} {was}, rerun {code}{}", if was == code as i64 { " (same)" } else { "" });
            }
            Ok(code)
        }
    }
}
