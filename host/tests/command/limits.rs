//! Sizes, files and replays at their limits, end to end: a size too large for the device or the
//! host is exit 2 or 3 before anything is allocated (never an abort), a FIFO or a device where a
//! regular file is required is refused at once (never a hang), `evidence rerun` replays no record
//! that writes files without `--allow-writes` and none that is itself a rerun, and negative or
//! too-large numbers get a message saying so. Each case runs under a time limit and, where an
//! abort was the failure, an address-space limit, so a regression fails fast instead of taking
//! the machine's memory. `MEMATTN_BIN` runs them against another build.

use std::io::{Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin_path() -> PathBuf {
    std::env::var_os("MEMATTN_BIN").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_memattn")))
}

/// Address space each case may use (KiB): far above what a refusal needs, far below the
/// allocations the unchecked paths attempted.
const VMEM_KIB: u64 = 4 << 20;

/// Runs memattn with `args` under [`VMEM_KIB`], in its own process group, killing the group after
/// `limit` (a hang, or a rerun that replays itself, must not outlive the test).
fn run_limited(args: &[&str], envs: &[(&str, &str)], limit: Duration) -> Output {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(format!("ulimit -v {VMEM_KIB}; exec \"$0\" \"$@\""))
        .arg(bin_path())
        .args(args)
        .env("MEMATTN_TEST", "1")
        .envs(envs.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = cmd.spawn().expect("spawn memattn");
    // Both pipes are drained while the child runs, so a long output cannot block it.
    let drain = |r: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out = drain(child.stdout.take().map(|r| Box::new(r) as _));
    let err = drain(child.stderr.take().map(|r| Box::new(r) as _));
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if start.elapsed() > limit {
            kill_group(child.id());
            let _ = child.wait();
            let e = err.join().unwrap_or_default();
            panic!("memattn {args:?} did not finish in {limit:?}; stderr: {}", String::from_utf8_lossy(&e));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    // A rerun's grandchildren may hold the pipes: end the group before reading to the end.
    kill_group(child.id());
    Output { status, stdout: out.join().unwrap_or_default(), stderr: err.join().unwrap_or_default() }
}

fn kill_group(pgid: u32) {
    let _ = Command::new("kill").args(["-KILL", "--", &format!("-{pgid}")]).status();
}

fn memattn(args: &[&str]) -> Output {
    run_limited(args, &[], Duration::from_secs(60))
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or_else(|| {
        panic!("killed by signal {:?}; stderr: {}", o.status.signal(), String::from_utf8_lossy(&o.stderr))
    })
}

/// Exit `want` with `needle` on stderr, and no panic.
fn expect(args: &[&str], want: i32, needle: &str) -> Output {
    let o = memattn(args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(code(&o), want, "{args:?}: stderr {err}");
    assert!(err.contains(needle), "{args:?}: stderr does not mention `{needle}`:\n{err}");
    assert!(!err.contains("panicked") && !err.contains("internal error"), "{err}");
    o
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("memattn-limits-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    let _ = std::fs::remove_file(&p);
    p
}

fn fifo(name: &str) -> PathBuf {
    let p = tmp(name);
    assert!(Command::new("mkfifo").arg(&p).status().expect("mkfifo").success());
    p
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn decode_sizes_too_large_are_refused_before_allocation() {
    let base = ["--backend", "vm", "decode"];
    for extra in [
        &["--cache-len", "1", "--heads", "2", "--page-size", "4294967295"][..],
        &["--heads", "4294967295", "--heads-kv", "1", "--cache-len", "1"],
        &["--cache-len", "2147483000"],
        &["--seq-q", "4294967295", "--cache-len", "1"],
    ] {
        expect(&[&base[..], extra].concat(), 2, "of device memory");
    }
    // A device as large as 64-bit byte counts allow: the host copies are what cannot be held.
    expect(
        &[
            "--backend",
            "vm",
            "--vm-memory-mib",
            "17592186044415",
            "decode",
            "--cache-len",
            "1",
            "--heads",
            "2",
            "--page-size",
            "4294967295",
        ],
        3,
        "host memory",
    );
    // The per-sequence lengths are not expanded for a batch no grid can hold.
    expect(&["--backend", "vm", "decode", "--batch", "4294967295", "--cache-len", "1"], 2, "at most 65535 sequences");
    // Tensors whose element counts overflow 64-bit byte counts are named.
    expect(
        &["--backend", "vm", "decode", "--heads", "4294967295", "--heads-kv", "4294967295", "--cache-len", "1"],
        2,
        "heads_kv * head_dim",
    );
}

#[test]
fn plan_layer_counts_are_bounded() {
    let flags = ["plan", "--heads", "8", "--head-dim", "128", "--context", "1", "--vram", "80GiB"];
    expect(&[&flags[..], &["--layers", "4294967295"]].concat(), 2, "over the limit of 65536");
    let cfg = tmp("layers.json");
    std::fs::write(
        &cfg,
        r#"{"model_type": "llama", "num_hidden_layers": 4294967295, "num_attention_heads": 8, "hidden_size": 1024,
            "intermediate_size": 4096, "vocab_size": 1000}"#,
    )
    .unwrap();
    expect(&["plan", "--config", s(&cfg), "--context", "1", "--vram", "80GiB"], 2, "num_hidden_layers");
    // A config's layers overridden by a flag is checked too.
    let ok = tmp("ok.json");
    std::fs::write(
        &ok,
        r#"{"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 1024,
            "intermediate_size": 4096, "vocab_size": 1000}"#,
    )
    .unwrap();
    expect(&["plan", "--config", s(&ok), "--layers", "500000000", "--context", "1", "--vram", "80GiB"], 2, "--layers");
}

#[test]
fn plan_parameter_count_that_wraps_u64_is_refused() {
    let o = expect(
        &[
            "plan",
            "--layers",
            "1",
            "--heads",
            "1",
            "--heads-kv",
            "1",
            "--head-dim",
            "2147483648",
            "--hidden",
            "2147483648",
            "--intermediate",
            "1",
            "--vocab",
            "1",
            "--tied-embeddings",
            "--context",
            "1",
            "--vram",
            "80GiB",
        ],
        2,
        "parameter count",
    );
    assert!(!String::from_utf8_lossy(&o.stdout).contains("fits: yes"));
}

#[test]
fn launch_buffers_over_the_vm_memory_are_refused_before_allocation() {
    let mut args = vec!["--backend", "vm", "launch", "saxpy_f32"];
    let names: Vec<String> = (0..17).map(|i| format!("b{i}=f32:268435456")).collect();
    for n in &names {
        args.extend(["--buf", n.as_str()]);
    }
    expect(&args, 2, "over the VM's device memory");
    expect(
        &["--backend", "vm", "--vm-memory-mib", "64", "launch", "saxpy_f32", "--buf", "x=f32:268435456"],
        2,
        "over the VM's device memory",
    );
    expect(&["--backend", "vm", "launch", "nosuch"], 2, "no entry point `nosuch`");
}

/// An evidence file of two records whose command lines are `n` distinct tokens each.
fn long_argv_records(n: usize) -> PathBuf {
    let f = tmp("long.jsonl");
    let mut out = std::fs::File::create(&f).unwrap();
    for side in ["a", "b"] {
        let argv: Vec<String> =
            std::iter::once("memattn".to_string()).chain((0..n).map(|i| format!("--x{side}{i}"))).collect();
        let rec = serde_json::json!({"argv": argv, "command": "run", "exit_code": 0, "message": null});
        writeln!(out, "{rec}").unwrap();
    }
    f
}

#[test]
fn evidence_diff_of_huge_command_lines_is_bounded() {
    let f = long_argv_records(60_000);
    let o = expect(&["evidence", "diff", s(&f), "1", "2"], 0, "");
    assert!(String::from_utf8_lossy(&o.stdout).contains("too long to align"), "{}", String::from_utf8_lossy(&o.stdout));
}

/// Writes one record with `argv` (after `memattn`) to a new evidence file.
fn record(name: &str, argv: &[&str]) -> PathBuf {
    let f = tmp(name);
    let argv: Vec<&str> = std::iter::once("memattn").chain(argv.iter().copied()).collect();
    let rec = serde_json::json!({"argv": argv, "command": "run", "exit_code": 0, "message": null});
    std::fs::write(&f, format!("{rec}\n")).unwrap();
    f
}

#[test]
fn evidence_rerun_refuses_records_that_write_files() {
    let victim = tmp("victim.txt");
    std::fs::write(&victim, b"precious user data\n").unwrap();
    let before = std::fs::read(&victim).unwrap();
    let run = ["--backend", "vm", "run", "--seq", "8", "--heads", "1"];
    for (i, opt) in ["--output", "--save", "--plot"].into_iter().enumerate() {
        let f = record(&format!("w{i}.jsonl"), &[&run[..], &[opt, s(&victim)]].concat());
        let evidence_before = std::fs::read(&f).unwrap();
        expect(&["evidence", "rerun", s(&f), "1"], 2, "--allow-writes");
        assert_eq!(std::fs::read(&victim).unwrap(), before, "{opt} touched the victim");
        assert_eq!(std::fs::read(&f).unwrap(), evidence_before, "{opt}: the evidence file changed");
    }
    // `--opt=value` is seen too.
    let eq = format!("--output={}", s(&victim));
    let f = record("weq.jsonl", &[&run[..], &[eq.as_str()]].concat());
    expect(&["evidence", "rerun", s(&f), "1"], 2, "--allow-writes");
    assert_eq!(std::fs::read(&victim).unwrap(), before);
    // `--save` to the evidence file being rerun is the rerun's own line: allowed.
    let own = tmp("own.jsonl");
    let argv: Vec<&str> = [&["memattn"][..], &run[..], &["--save", s(&own)]].concat();
    std::fs::write(&own, format!("{}\n", serde_json::json!({"argv": argv, "command": "run", "exit_code": 0}))).unwrap();
    let o = memattn(&["evidence", "rerun", s(&own), "1"]);
    assert_eq!(code(&o), 0, "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(std::fs::read_to_string(&own).unwrap().lines().count(), 2);
}

#[test]
fn evidence_rerun_of_a_rerun_is_refused() {
    let f = tmp("self.jsonl");
    let rec =
        serde_json::json!({"argv": ["memattn", "evidence", "rerun", s(&f), "1"], "command": null, "exit_code": 0});
    std::fs::write(&f, format!("{rec}\n")).unwrap();
    let o = run_limited(&["evidence", "rerun", s(&f), "1"], &[], Duration::from_secs(5));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(code(&o), 2, "{err}");
    assert!(err.contains("itself an `evidence rerun`"), "{err}");
}

fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

#[test]
fn sigterm_to_rerun_ends_its_child() {
    // A run that takes minutes in the VM: the rerun's child is still running when the signal comes.
    let f = record("long.jsonl", &["--backend", "vm", "run", "--seq", "4096", "--heads", "8"]);
    let mut rerun = Command::new(bin_path())
        .args(["evidence", "rerun", s(&f), "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    let start = Instant::now();
    let child = loop {
        if let Some(&c) = children(rerun.id()).first() {
            break c;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "the rerun started no child");
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = Command::new("kill").args(["-TERM", &rerun.id().to_string()]).status();
    let _ = rerun.wait();
    let gone = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|st| st.rsplit(')').next().is_some_and(|r| r.trim_start().starts_with('Z')))
            .unwrap_or(true)
    };
    let start = Instant::now();
    while !gone(child) && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let orphaned = !gone(child);
    if orphaned {
        let _ = Command::new("kill").args(["-KILL", &child.to_string()]).status();
    }
    assert!(!orphaned, "the rerun's child {child} outlived SIGTERM to the rerun");
}

#[test]
fn fifos_and_devices_where_regular_files_are_required_are_refused() {
    let limit = Duration::from_secs(20);
    let check = |args: &[&str], needle: &str| {
        let o = run_limited(args, &[], limit);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(code(&o), 2, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    };
    let cfg = fifo("config.fifo");
    check(&["plan", "--config", s(&cfg), "--context", "1", "--vram", "1GiB"], "a FIFO");
    let ev = fifo("evidence.fifo");
    check(&["evidence", "show", s(&ev)], "a FIFO");
    check(&["evidence", "show", "/dev/zero"], "a character device");
    let save = fifo("save.fifo");
    check(
        &[
            "--save",
            s(&save),
            "plan",
            "--layers",
            "1",
            "--heads",
            "1",
            "--head-dim",
            "64",
            "--context",
            "1",
            "--vram",
            "1GiB",
        ],
        "not a regular file",
    );
}

#[test]
fn negative_and_oversized_numbers_say_what_is_wrong() {
    let plan = ["plan", "--layers", "1", "--heads", "1", "--head-dim", "64", "--context", "1", "--vram", "1GiB"];
    for opt in [
        "--layers",
        "--heads",
        "--heads-kv",
        "--head-dim",
        "--batch",
        "--context",
        "--new-tokens",
        "--page",
        "--sliding-window",
    ] {
        let mut args: Vec<&str> = plan.to_vec();
        args.extend([opt, "-1"]);
        // A flag given twice is clap's error; replace the value instead when it is there.
        if let Some(i) = plan.iter().position(|a| *a == opt) {
            args = plan.to_vec();
            args[i + 1] = "-1";
        }
        expect(&args, 2, "must be >= 0");
    }
    for opt in ["--grid", "--block"] {
        expect(&["--backend", "vm", "launch", "saxpy_f32", opt, "-1"], 2, "must be >= 0");
    }
    expect(&["--backend", "vm", "launch", "saxpy_f32", "--smem", "-1"], 2, "must be >= 0");
    let f = record("neg.jsonl", &["doctor"]);
    expect(&["evidence", "rerun", s(&f), "-1"], 2, "must be >= 0");
    expect(&["evidence", "diff", s(&f), "-1", "1"], 2, "must be >= 0");
    expect(&["--backend", "vm", "run", "--sliding-window", "3000000000"], 2, "at most 2147483647");
    let mut vram = plan.to_vec();
    *vram.last_mut().unwrap() = "-1GiB";
    expect(&vram, 2, "must be >= 0");
    expect(&["--backend", "vm", "decode", "--splits", "-1"], 2, "must be >= 0");
    expect(&["--backend", "vm", "decode", "--vary", "page-size=-1"], 2, "must be >= 0");
}

/// `libvm_cuda.so`, which cargo builds next to this test (a dev-dependency of memattn).
fn vm_cuda() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    [deps, deps.parent().unwrap()]
        .iter()
        .map(|d| d.join("libvm_cuda.so"))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("libvm_cuda.so is not next to {}", exe.display()))
}

#[test]
fn vm_cuda_refuses_variables_it_does_not_understand() {
    let driver = vm_cuda();
    for (var, value) in [
        ("VM_CUDA_MEMORY_MIB", "abc"),
        ("VM_CUDA_MEMORY_MIB", "-1"),
        ("VM_CUDA_MEMORY_MIB", "17592186044416"),
        ("VM_CUDA_ARCH", "sm_20"),
    ] {
        let o = run_limited(
            &["--backend", "cuda", "run", "--seq", "8", "--heads", "1"],
            &[("MEMATTN_CUDA_DRIVER", s(&driver)), (var, value)],
            Duration::from_secs(60),
        );
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(code(&o), 3, "{var}={value}: {err}");
        assert!(err.contains(&format!("{var}={value}")), "{var}={value}: {err}");
    }
}
