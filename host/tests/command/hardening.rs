//! Bad input of every kind, end to end: no data lost, no exit 0 on an unverified result, no
//! abort or panic. Each test names the inputs it covers; `cli_argument_space_never_panics` is a
//! seeded property test over random valid and invalid command lines.

use crate::common;
use common::*;
use memattn_cli::inputs::Qkv;
use memattn_cli::problem::Problem;
use memattn_cli::safetensors_io::{write_qkv, FileShape};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The binary under test (`MEMATTN_BIN` runs these tests against another build, e.g. an older
/// one, to see which inputs it mishandles).
fn bin_path() -> PathBuf {
    std::env::var_os("MEMATTN_BIN").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_memattn")))
}

fn bin() -> Command {
    let mut c = Command::new(bin_path());
    c.env("MEMATTN_TEST", "1");
    c
}

/// Runs memattn, killing it after `limit` (a FIFO read that blocks must not hang the tests).
fn memattn_os<S: AsRef<OsStr>>(args: &[S], limit: Duration) -> Output {
    let mut child = bin()
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn memattn");
    let start = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let o = child.wait_with_output().expect("output");
            panic!(
                "memattn {:?} did not finish in {limit:?}; stderr: {}",
                args.iter().map(|a| a.as_ref().to_string_lossy().into_owned()).collect::<Vec<_>>(),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn memattn(args: &[&str]) -> Output {
    memattn_os(args, Duration::from_secs(120))
}

fn tmp(name: &str) -> PathBuf {
    let dir =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("memattn-hardening-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// Exit `want` with `needle` on stderr and no panic.
fn expect(args: &[&str], want: i32, needle: &str) -> Output {
    let o = memattn(args);
    assert_eq!(code(&o), want, "{args:?}: stdout {} stderr {}", stdout(&o), stderr(&o));
    let err = stderr(&o);
    assert!(err.contains(needle), "{args:?}: stderr does not mention `{needle}`:\n{err}");
    assert!(!err.contains("panicked") && !err.contains("internal error"), "{err}");
    o
}

/// A small input file; returns its path and bytes.
fn inputs(name: &str) -> (PathBuf, Vec<u8>) {
    let p = Problem { batch: 1, heads: 2, seq_q: 8, seq_kv: 12, head_dim: 64, ..Problem::default() };
    let f = tmp(name);
    write_qkv(
        &f,
        FileShape { batch: 1, heads: 2, seq_q: 8, seq_kv: 12, head_dim: 64, heads_kv: 2, varlen: None },
        &Qkv::random(&p, 5),
    )
    .unwrap();
    let bytes = std::fs::read(&f).unwrap();
    (f, bytes)
}

// ---- lost or corrupted data ----

#[test]
fn outputs_never_replace_inputs_evidence_or_ptx() {
    // Covers: --output = --inputs, --output = --save, --plot = --save, --output = --ptx,
    // --save = --inputs, --output through a symlink to --inputs.
    let (inp, before) = inputs("same_in.safetensors");
    let i = inp.to_str().unwrap();
    let o = expect(&["--backend", "vm", "run", "--inputs", i, "--output", i], 2, "same file as --inputs");
    assert!(stdout(&o).is_empty(), "nothing may run: {}", stdout(&o));
    assert_eq!(std::fs::read(&inp).unwrap(), before, "the input was changed");
    let link = tmp("link_to_in.safetensors");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&inp, &link).unwrap();
    expect(&["--backend", "vm", "run", "--inputs", i, "--output", link.to_str().unwrap()], 2, "same file as --inputs");
    expect(&["--backend", "vm", "--save", i, "run", "--inputs", i], 2, "same file as --inputs");
    assert_eq!(std::fs::read(&inp).unwrap(), before);

    let ev = tmp("same_evidence.jsonl");
    std::fs::write(&ev, "{\"earlier\":1}\n").unwrap();
    let e = ev.to_str().unwrap();
    expect(&["--backend", "vm", "--save", e, "run", "--seq", "8", "--heads", "1", "--output", e], 2, "evidence file");
    expect(&["--backend", "vm", "--save", e, "sweep", "--vary", "seq=8", "--plot", e], 2, "evidence file");
    assert_eq!(std::fs::read_to_string(&ev).unwrap(), "{\"earlier\":1}\n", "evidence was replaced");

    let ptx = tmp("same.ptx");
    std::fs::write(&ptx, memattn_cli::ptx::EMBEDDED_PTX).unwrap();
    let p = ptx.to_str().unwrap();
    expect(&["--backend", "vm", "--ptx", p, "run", "--seq", "8", "--output", p], 2, "--ptx file");
    assert_eq!(std::fs::read_to_string(&ptx).unwrap(), memattn_cli::ptx::EMBEDDED_PTX);
}

#[test]
fn a_failed_verification_leaves_the_previous_output_untouched() {
    // Covers: a run that fails verification (exit 1) with an existing --output.
    let out = tmp("kept.safetensors");
    let o = memattn(&["--backend", "vm", "run", "--seq", "32", "--heads", "1", "--output", out.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let good = std::fs::read(&out).unwrap();
    // ln 2 replaced by 1.0: every LSE is wrong, verification fails.
    let broken = memattn_cli::ptx::EMBEDDED_PTX.replace("0f3F317218", "0f3F800000");
    let f = tmp("wrong_lse_out.ptx");
    std::fs::write(&f, broken).unwrap();
    let args = ["--backend", "vm", "--ptx", f.to_str().unwrap(), "--json", "run", "--seq", "32", "--heads", "1"];
    let o = memattn(&[&args[..], &["--output", out.to_str().unwrap()]].concat());
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains("not writing"), "{}", stderr(&o));
    assert_eq!(json(&o)["output_file"], serde_json::Value::Null);
    assert_eq!(std::fs::read(&out).unwrap(), good, "a failed run replaced the output");
}

#[test]
fn a_write_that_fails_half_way_leaves_the_old_file_whole() {
    // Covers: --output under a file-size limit (EFBIG half-way through the write).
    let out = tmp("fsize.safetensors");
    let o = memattn(&["--backend", "vm", "run", "--seq", "64", "--heads", "2", "--output", out.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let good = std::fs::read(&out).unwrap();
    assert!(good.len() > 32 << 10);
    // 16 blocks of 512 bytes (POSIX sh): the 33 KiB output cannot be written. SIGXFSZ ignored,
    // so the write fails with EFBIG instead of killing the process.
    let script = format!(
        "trap '' XFSZ; ulimit -f 16; exec '{}' --backend vm run --seq 64 --heads 2 --output '{}'",
        bin_path().display(),
        out.display()
    );
    let o = Command::new("sh").arg("-c").arg(&script).output().unwrap();
    // A resource limit: exit 3, naming the file and the limit.
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    assert!(stderr(&o).contains("cannot write output file"), "{}", stderr(&o));
    assert!(stderr(&o).contains("the file-size limit (ulimit -f) is 8192 bytes"), "{}", stderr(&o));
    assert_eq!(std::fs::read(&out).unwrap(), good, "the old output was truncated");
    // The measured, verified result is still reported.
    assert!(stdout(&o).contains("verified     PASS"), "{}", stdout(&o));
    let dir = out.parent().unwrap();
    let leftovers: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("memattn-tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
}

#[test]
fn unwritable_outputs_are_refused_before_the_run() {
    // Covers: --output in a missing directory, --output a directory, --output read-only,
    // --plot in a missing directory, --plot a directory.
    for (args, needle) in [
        (vec!["run", "--seq", "8", "--output", "/nonexistent-dir/o.safetensors"], "nonexistent-dir"),
        (vec!["run", "--seq", "8", "--output", "/tmp"], "a directory"),
        (vec!["sweep", "--vary", "seq=8", "--plot", "/nonexistent-dir/p.svg"], "nonexistent-dir"),
        (vec!["sweep", "--vary", "seq=8", "--plot", "/"], "--plot"),
    ] {
        let o = expect(&[&["--backend", "vm"][..], &args[..]].concat(), 2, needle);
        assert!(stdout(&o).is_empty() && !stderr(&o).contains("running"), "something ran: {}", stdout(&o));
    }
    let ro = tmp("readonly.safetensors");
    std::fs::write(&ro, b"keep").unwrap();
    let mut perm = std::fs::metadata(&ro).unwrap().permissions();
    perm.set_readonly(true);
    std::fs::set_permissions(&ro, perm).unwrap();
    expect(&["--backend", "vm", "run", "--seq", "8", "--output", ro.to_str().unwrap()], 2, "read-only");
    assert_eq!(std::fs::read(&ro).unwrap(), b"keep");
}

// ---- exit 0 only when verified ----

#[test]
fn compare_and_sweep_where_nothing_ran_do_not_claim_verified() {
    // Covers: compare and sweep with every point refused for memory (1 MiB of VM memory).
    let o = memattn(&["--backend", "vm", "--vm-memory-mib", "1", "--json", "compare", "--seq", "512"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["verified"], false);
    assert!(v["runs"].as_array().unwrap().iter().all(|r| r["ran"] == false));
    assert!(stderr(&o).contains("nothing was verified"), "{}", stderr(&o));
    let plot = tmp("none.svg");
    let o = memattn(&[
        "--backend",
        "vm",
        "--vm-memory-mib",
        "1",
        "--json",
        "sweep",
        "--vary",
        "seq=512,1024",
        "--plot",
        plot.to_str().unwrap(),
    ]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert_eq!(json(&o)["verified"], false);
    assert!(!plot.exists(), "a plot of nothing was written");
}

#[test]
fn non_finite_inputs_and_overflowing_scores_are_refused_up_front() {
    // Covers: NaN in k, +inf in q, -inf in v, --scale overflowing the f32 scores.
    let p = Problem { batch: 1, heads: 2, seq_q: 8, seq_kv: 12, head_dim: 64, ..Problem::default() };
    let shape = FileShape { batch: 1, heads: 2, seq_q: 8, seq_kv: 12, head_dim: 64, heads_kv: 2, varlen: None };
    for (tensor, at, value, needle) in [
        ("k", 64 * 5 + 3, f32::NAN, "`k` has a non-finite value NaN at element 323 = [batch 0, seq 2, head 1, dim 3]"),
        ("q", 0, f32::INFINITY, "`q` has a non-finite value inf at element 0"),
        (
            "v",
            64 * 23 + 63,
            f32::NEG_INFINITY,
            "`v` has a non-finite value -inf at element 1535 = [batch 0, seq 11, head 1, dim 63]",
        ),
    ] {
        let mut x = Qkv::random(&p, 2);
        match tensor {
            "q" => x.q[at] = value,
            "k" => x.k[at] = value,
            _ => x.v[at] = value,
        }
        let f = tmp(&format!("nonfinite_{tensor}.safetensors"));
        write_qkv(&f, shape, &x).unwrap();
        let o = expect(&["--backend", "vm", "run", "--inputs", f.to_str().unwrap()], 2, needle);
        assert!(!stdout(&o).contains("verified"), "it ran: {}", stdout(&o));
    }
    expect(&["--backend", "vm", "run", "--seq", "8", "--heads", "1", "--scale", "1e37"], 2, "scores overflow f32");
    // A large scale that does not overflow still runs and verifies.
    let o = memattn(&["--backend", "vm", "run", "--seq", "8", "--heads", "1", "--scale", "1e20"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

// ---- aborts and panics ----

#[test]
fn sizes_and_counts_that_would_wrap_are_refused() {
    // Covers: u64 byte-count wrap (flash and naive), warmup/repeats near u32::MAX, naive grid z
    // wrap in trace, --vm-memory-mib times 2^20 wrap, --nvml-interval-ms 1e300.
    let big = "4294967295";
    let o = expect(&["--backend", "vm", "run", "--batch", big, "--heads", big, "--seq", big], 2, "64-bit byte count");
    assert!(!stderr(&o).contains("score matrix"), "flash has no score matrix: {}", stderr(&o));
    expect(
        &[
            "--backend",
            "vm",
            "run",
            "--kernel",
            "naive",
            "--batch",
            "65536",
            "--heads",
            "65536",
            "--seq",
            "65536",
            "--head-dim",
            "1",
        ],
        2,
        "the score matrix needs",
    );
    // Q wraps a u64 while the old score-matrix check (seq_kv 1) passed: flash, 2^70 bytes of Q.
    expect(
        &[
            "--backend",
            "vm",
            "run",
            "--batch",
            "65536",
            "--heads",
            "65536",
            "--seq-q",
            "536870912",
            "--seq-kv",
            "1",
            "--head-dim",
            "128",
        ],
        2,
        "Q (and O) needs 1180591620717411303424 bytes",
    );
    expect(&["--backend", "vm", "run", "--seq", "8", "--warmup", big], 2, "--warmup must be at most 1000000");
    expect(&["--backend", "vm", "run", "--seq", "8", "--repeats", big], 2, "--repeats must be at most 1000000");
    expect(
        &["trace", "--kernel", "naive", "--batch", "65536", "--heads", "65536", "--seq", "1", "--head-dim", "1"],
        2,
        "grid z",
    );
    expect(
        &["--backend", "vm", "--vm-memory-mib", "18446744073709551615", "run", "--seq", "8"],
        2,
        "--vm-memory-mib must be at most",
    );
    expect(&["--backend", "vm", "--nvml-interval-ms", "1e300", "run", "--seq", "8"], 2, "at most 60000");
    expect(&["--backend", "vm", "--nvml-interval-ms", "nan", "run", "--seq", "8"], 2, "must be > 0");
}

#[test]
fn host_memory_that_cannot_be_had_is_exit_3_with_the_bytes() {
    // Covers: --vm-memory-mib far over the host's RAM with a problem whose buffers cannot fit.
    // With unlimited overcommit (`vm.overcommit_memory = 1`) the kernel promises any amount and
    // the OOM killer ends the process instead: no process can check that, so the test says so.
    let mode = std::fs::read_to_string("/proc/sys/vm/overcommit_memory").unwrap_or_default();
    if mode.trim() == "1" {
        eprintln!("SKIPPED: this host overcommits memory without limit (vm.overcommit_memory = 1)");
        return;
    }
    let o = expect(
        &["--backend", "vm", "--vm-memory-mib", "100000000", "run", "--seq", "1048576", "--heads", "1024"],
        3,
        "host memory: cannot allocate",
    );
    assert!(stderr(&o).contains("bytes"), "{}", stderr(&o));
}

#[test]
fn non_utf8_paths_work() {
    // Covers: non-UTF-8 --save and --output paths.
    let dir = tmp("x").parent().unwrap().to_path_buf();
    let save = dir.join(OsStr::from_bytes(b"evid\xff.jsonl"));
    let out = dir.join(OsStr::from_bytes(b"out\xfe.safetensors"));
    let args: Vec<&OsStr> = vec![
        "--backend".as_ref(),
        "vm".as_ref(),
        "--save".as_ref(),
        save.as_os_str(),
        "run".as_ref(),
        "--seq".as_ref(),
        "8".as_ref(),
        "--heads".as_ref(),
        "1".as_ref(),
        "--output".as_ref(),
        out.as_os_str(),
    ];
    let o = memattn_os(&args, Duration::from_secs(60));
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let line = std::fs::read_to_string(&save).unwrap();
    let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    assert_eq!(v["result"]["verified"], true);
    assert!(std::fs::metadata(&out).unwrap().len() > 1024);
}

#[test]
fn a_closed_stdout_ends_the_process_quietly_by_sigpipe() {
    // Covers: `memattn ... | head -0`.
    let mut child = bin()
        .args(["--backend", "vm", "compare", "--seq", "16", "--heads", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader goes away before anything is printed
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.signal(), Some(libc_sigpipe()), "status {:?}, stderr {}", o.status, stderr(&o));
    assert!(!stderr(&o).contains("error"), "{}", stderr(&o));
}

fn libc_sigpipe() -> i32 {
    13 // SIGPIPE on Linux
}

// ---- unclear or inconsistent ----

#[test]
fn negative_numbers_are_values() {
    // Covers: --seed -1, --heads -1, --seq -4, --warmup -1, --vm-workers -2, --max-entries -1,
    // --check-rows -3, --vm-memory-mib -1, --thread -1, --nvml-interval-ms -5; --scale -0.5 is valid.
    for (args, needle) in [
        (vec!["run", "--seed", "-1"], "--seed <SEED>': must be >= 0 (got -1)"),
        (vec!["run", "--heads", "-1"], "must be >= 0 (got -1)"),
        (vec!["run", "--seq", "-4"], "must be >= 0 (got -4)"),
        (vec!["run", "--warmup", "-1"], "must be >= 0"),
        (vec!["--vm-workers", "-2", "run"], "must be >= 0 (got -2)"),
        (vec!["--vm-memory-mib", "-1", "run"], "must be >= 0 (got -1)"),
        (vec!["trace", "--max-entries", "-1"], "must be >= 0"),
        (vec!["run", "--check-rows", "-3"], "--check-rows must be"),
        (vec!["trace", "--thread", "-1"], "--thread"),
        (vec!["--nvml-interval-ms", "-5", "run"], "must be > 0 (got -5.0)"),
    ] {
        expect(&[&["--backend", "vm"][..], &args[..]].concat(), 2, needle);
    }
    let o = memattn(&["--backend", "vm", "--json", "run", "--seq", "8", "--heads", "1", "--scale", "-0.5"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["shape"]["softmax_scale"], -0.5);
    assert_eq!(v["verified"], true);
}

#[test]
fn json_usage_errors_are_json() {
    // Covers: --json with an unknown flag, a bad value, a missing subcommand.
    for args in [vec!["--json", "run", "--bogus"], vec!["run", "--seq", "x", "--json"], vec!["--json"]] {
        let o = memattn(&args);
        assert_eq!(code(&o), 2, "{args:?}");
        let v = json(&o);
        assert_eq!(v["exit_code"], 2);
        assert!(v["error"].as_str().unwrap().len() > 5, "{v}");
    }
    // Without --json stdout stays empty.
    assert!(stdout(&memattn(&["run", "--bogus"])).is_empty());
}

#[test]
fn garbage_ptx_is_exit_3_everywhere_and_unreadable_files_exit_2() {
    // Covers: binary --ptx (run, kernels), text garbage --ptx (run, kernels), /dev/zero and a FIFO
    // as --ptx and --inputs, a directory as --inputs, .version 99.9 and .target sm_200.
    let bin_ptx = tmp("binary.ptx");
    std::fs::write(&bin_ptx, [0xffu8, 0xfe, 0x00, 0x7f, 0x80]).unwrap();
    let text_ptx = tmp("text.ptx");
    std::fs::write(&text_ptx, "this is not PTX\n").unwrap();
    for f in [&bin_ptx, &text_ptx] {
        let p = f.to_str().unwrap();
        expect(&["--backend", "vm", "--ptx", p, "run", "--seq", "8"], 3, "PTX does not load");
        expect(&["--ptx", p, "kernels"], 3, "PTX does not load");
    }
    let v99 = tmp("v99.ptx");
    std::fs::write(&v99, memattn_cli::ptx::EMBEDDED_PTX.replacen(".version 7.4", ".version 99.9", 1)).unwrap();
    expect(&["--backend", "vm", "--ptx", v99.to_str().unwrap(), "run", "--seq", "8"], 3, "unsupported .version 99.9");
    let sm200 = tmp("sm200.ptx");
    std::fs::write(&sm200, memattn_cli::ptx::EMBEDDED_PTX.replacen(".target sm_80", ".target sm_200", 1)).unwrap();
    expect(&["--ptx", sm200.to_str().unwrap(), "kernels"], 3, "unsupported .target sm_200");

    let fifo = tmp("fifo");
    let _ = std::fs::remove_file(&fifo);
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let fi = fifo.to_str().unwrap();
    for (args, needle) in [
        (vec!["--ptx", fi, "kernels"], "a FIFO; only regular files are read"),
        (vec!["--backend", "vm", "run", "--inputs", fi], "a FIFO"),
        (vec!["--ptx", "/dev/zero", "kernels"], "a character device"),
        (vec!["--backend", "vm", "run", "--inputs", "/dev/zero"], "a character device"),
        (vec!["--backend", "vm", "run", "--inputs", "/tmp"], "a directory"),
    ] {
        let o = memattn_os(&args, Duration::from_secs(20));
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
    }
}

#[test]
fn vary_never_silently_overrides_and_seq_kv_follows_seq_q() {
    // Covers: --vary seq with --seq, --vary seq-q with --seq-q, --vary heads with --heads,
    // --vary dtype with --dtype, sweep's default seq sweep with --seq, trace --step with flash;
    // compare --vary seq-q keeps seq_kv = seq_q unless --seq-kv is given.
    for (args, needle) in [
        (vec!["compare", "--vary", "seq=16,32", "--seq", "64"], "--vary seq sets what --seq sets"),
        (vec!["compare", "--vary", "seq-q=16,32", "--seq-q", "64"], "--seq-q would be ignored"),
        (vec!["compare", "--vary", "heads=1,2", "--heads", "4"], "--heads would be ignored"),
        (vec!["compare", "--vary", "dtype=f32,bf16", "--dtype", "f16"], "--dtype would be ignored"),
        (vec!["sweep", "--seq", "64", "--no-plot"], "--vary seq sets what --seq sets"),
        (vec!["trace", "--step", "pv"], "--step chooses one of the three naive launches"),
    ] {
        let o = expect(&[&["--backend", "vm"][..], &args[..]].concat(), 2, needle);
        assert!(stdout(&o).is_empty());
    }
    let o = memattn(&["--backend", "vm", "--json", "compare", "--vary", "seq-q=16,40", "--heads", "1"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    for (run, n) in v["runs"].as_array().unwrap().iter().zip([16, 40]) {
        assert_eq!(run["report"]["shape"]["seq_q"], n);
        assert_eq!(run["report"]["shape"]["seq_kv"], n, "seq_kv did not follow seq_q");
    }
    let o =
        memattn(&["--backend", "vm", "--json", "compare", "--vary", "seq-q=16,40", "--seq-kv", "24", "--heads", "1"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(json(&o)["runs"].as_array().unwrap().iter().all(|r| r["report"]["shape"]["seq_kv"] == 24));
}

// ---- property test of the argument space ----

/// SplitMix64: a seeded generator for the property test.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[(self.next() % xs.len() as u64) as usize]
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

#[test]
fn cli_argument_space_never_panics() {
    // Random command lines, valid and invalid, from a fixed seed (MEMATTN_FUZZ_SEED overrides it,
    // MEMATTN_FUZZ_CASES the count). Every exit is 0, 1, 2 or 3, never a signal, and stderr never
    // reports a panic. Shapes stay tiny (or absurdly large, refused before anything runs) so the
    // whole test takes seconds.
    let seed = std::env::var("MEMATTN_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5EED_0009);
    let cases: usize = std::env::var("MEMATTN_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    let mut rng = Rng(seed);
    let garbage = tmp("fuzz_garbage.ptx");
    std::fs::write(&garbage, "garbage\n").unwrap();
    let (inp, _) = inputs("fuzz_in.safetensors");
    let out = tmp("fuzz_out.safetensors");
    let ev = tmp("fuzz_evidence.jsonl");
    let plot = tmp("fuzz.svg");
    let paths = [garbage.to_str().unwrap(), inp.to_str().unwrap(), out.to_str().unwrap(), ev.to_str().unwrap()];
    // Small valid sizes (70 %), invalid ones, and absurdly large ones (refused before running).
    let valid_sizes = ["1", "2", "3", "5", "8", "9", "12", "17"];
    let bad_sizes = ["0", "-1", "x", "", "4294967296", "1e3", "4294967295"];
    let start = Instant::now();
    let mut seen = std::collections::BTreeMap::new();
    let mut jobs: Vec<Vec<String>> = Vec::new();
    for _ in 0..cases {
        let mut args: Vec<String> = Vec::new();
        let mut push = |a: &str| args.push(a.to_string());
        if rng.chance(85) {
            push("--backend");
            push(rng.pick(&["vm", "vm", "vm", "auto", "cuda", "tpu"]));
        }
        if rng.chance(30) {
            push("--json");
        }
        if rng.chance(10) {
            push("--ptx");
            push(rng.pick(&[paths[0], "/nonexistent.ptx", "/dev/zero", paths[1]]));
        }
        if rng.chance(10) {
            push("--save");
            push(rng.pick(&[paths[3], paths[1], "/nonexistent-dir/e.jsonl"]));
        }
        if rng.chance(10) {
            push("--vm-memory-mib");
            push(rng.pick(&["1", "64", "0", "-1", "100000000", "18446744073709551615"]));
        }
        if rng.chance(5) {
            push("--vm-allow");
            push(rng.pick(&["initcheck", "racecheck,initcheck", "bogus"]));
        }
        if rng.chance(5) {
            push("--nvml-interval-ms");
            push(rng.pick(&["0.5", "0", "-1", "1e300", "nan", "inf"]));
        }
        let cmd =
            rng.pick(&["run", "run", "run", "compare", "compare", "sweep", "trace", "kernels", "doctor", "bogus"]);
        push(cmd);
        // At most one absurd size per command line, and only with one head, so that nothing
        // moderately large is ever run in the VM.
        let mut big = false;
        let mut size = |rng: &mut Rng| -> String {
            let s = if rng.chance(70) { rng.pick(&valid_sizes) } else { rng.pick(&bad_sizes) };
            if s == "4294967295" || s == "4294967296" {
                if big {
                    return "2".into();
                }
                big = true;
            }
            s.to_string()
        };
        let heads_given = rng.chance(50);
        if heads_given {
            push("--heads");
            let h = if rng.chance(80) { "1".to_string() } else { size(&mut rng) };
            push(&h);
        } else {
            push("--heads");
            push("1");
        }
        let mut seq_given = false;
        // Mostly one way of giving the lengths (--seq, or --seq-q/--seq-kv); sometimes both.
        let seq_flags: &[&str] = match rng.next() % 10 {
            0..=3 => &["--seq"],
            4..=8 => &["--seq-q", "--seq-kv"],
            _ => &["--seq", "--seq-q", "--seq-kv"],
        };
        if rng.chance(25) {
            push("--batch");
            push(&size(&mut rng));
        }
        for flag in seq_flags {
            if rng.chance(40) {
                seq_given = true;
                push(flag);
                push(&size(&mut rng));
            }
        }
        if !seq_given {
            push("--seq");
            push(rng.pick(&["8", "17", "33"]));
        }
        if rng.chance(20) {
            push("--head-dim");
            push(rng.pick(&["64", "128", "96", "1", "0", "300"]));
        }
        if rng.chance(20) {
            push("--dtype");
            push(rng.pick(&["f32", "bf16", "f16", "f8"]));
        }
        if rng.chance(15) {
            push("--causal");
        }
        if rng.chance(10) {
            push("--layout");
            push(rng.pick(&["bshd", "bhsd", "sbhd"]));
        }
        if rng.chance(15) {
            push("--scale");
            push(rng.pick(&["-0.5", "0", "1e30", "1e39", "nan", "inf", "2"]));
        }
        if rng.chance(10) {
            push("--seed");
            push(rng.pick(&["-1", "7", "18446744073709551616"]));
        }
        if rng.chance(10) {
            push(rng.pick(&["--warmup", "--repeats"]));
            push(rng.pick(&["0", "1", "2", "-1", "4294967295"]));
        }
        if rng.chance(10) {
            push("--check-rows");
            push(rng.pick(&["all", "auto", "3", "0", "-3", "many"]));
        }
        match cmd {
            "run" => {
                if rng.chance(25) {
                    push("--kernel");
                    push(rng.pick(&["naive", "flash", "fused"]));
                }
                if rng.chance(10) {
                    push("--inputs");
                    push(rng.pick(&[paths[1], paths[0], "/dev/zero", "/nonexistent.st"]));
                }
                if rng.chance(15) {
                    push("--output");
                    push(rng.pick(&[paths[2], paths[1], paths[3], "/nonexistent-dir/o.st", "/tmp"]));
                }
            }
            "compare" | "sweep" => {
                if rng.chance(60) {
                    push("--vary");
                    push(rng.pick(&[
                        "seq=8,17",
                        "seq-q=8,12",
                        "seq-kv=9,16",
                        "heads=1,2",
                        "kernel=naive,flash",
                        "dtype=f32,bf16",
                        "causal=false,true",
                        "layout=bshd,bhsd",
                        "head-dim=64,128",
                        "batch=1,2",
                        "colour=red",
                        "seq=",
                        "seq=-1",
                        "seq=8,4294967295",
                    ]));
                }
                if cmd == "sweep" {
                    if rng.chance(50) {
                        push("--no-plot");
                    } else {
                        push("--plot");
                        push(rng.pick(&[plot.to_str().unwrap(), paths[3], "/nonexistent-dir/p.svg"]));
                    }
                    if rng.chance(20) {
                        push("--kernels");
                        push(rng.pick(&["naive", "flash", "naive,flash", "", "fast"]));
                    }
                } else if rng.chance(20) {
                    push("--kernel");
                    push(rng.pick(&["naive", "flash"]));
                }
            }
            "trace" => {
                if rng.chance(40) {
                    push("--kernel");
                    push(rng.pick(&["naive", "flash"]));
                }
                if rng.chance(30) {
                    push("--step");
                    push(rng.pick(&["scores", "softmax", "pv", "all"]));
                }
                if rng.chance(30) {
                    push(rng.pick(&["--thread", "--block"]));
                    push(rng.pick(&["0", "3,0", "999", "-1", "1,2,3,4", "x"]));
                }
                push("--max-entries");
                push(rng.pick(&["5", "0", "-1"]));
            }
            _ => {}
        }
        if rng.chance(5) {
            push(rng.pick(&["--bogus", "extra", "--", "-x"]));
        }
        jobs.push(args);
    }
    // The command lines run two at a time (the draw above is serial, so a seed still names the
    // same cases); the checks go in case order.
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: std::sync::Mutex<Vec<(usize, std::process::Output)>> = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(args) = jobs.get(i) else { break };
                let o = memattn_os(args, Duration::from_secs(60));
                results.lock().unwrap().push((i, o));
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|(i, _)| *i);
    assert_eq!(results.len(), jobs.len());
    for ((case, o), args) in results.into_iter().zip(&jobs) {
        let status = o.status.code();
        let err = stderr(&o);
        assert!(
            matches!(status, Some(0..=3)),
            "case {case} (seed {seed:#x}): {args:?} exited with {:?} (signal {:?})\nstderr: {err}",
            status,
            o.status.signal()
        );
        assert!(!err.contains("panicked") && !err.contains("internal error"), "case {case}: {args:?}\n{err}");
        *seen.entry(status.unwrap()).or_insert(0) += 1;
    }
    eprintln!("{cases} random command lines in {:.1} s, exit codes {seen:?}", start.elapsed().as_secs_f64());
    // The generator reaches success and usage errors at least (1 and 3 depend on the draw).
    assert!(seen.contains_key(&0) && seen.contains_key(&2), "{seen:?}");
}

/// Context parallelism at sizes the machine cannot hold: the host copies are probed before any
/// is made (exit 3 naming the bytes, as without --cp) where the process aborted in the
/// allocator (SIGABRT, exit 134); a rank out of device memory is exit 3 as everywhere else
/// (it was exit 2).
#[test]
fn context_parallel_runs_too_large_for_the_machine_exit_3_without_an_abort() {
    for args in [
        &["--backend", "vm", "run", "--cp", "2", "--seq", "4294967295", "--heads", "1"][..],
        &["--backend", "vm", "run", "--cp", "2", "--seq", "4294967295", "--heads", "1", "--backward"][..],
        &["--backend", "vm", "run", "--cp", "64", "--seq", "1000000", "--heads", "64"][..],
    ] {
        let o = memattn(args);
        assert_eq!(o.status.signal(), None, "{args:?}: killed by a signal; {}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(o.status.code(), Some(3), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("host memory: cannot allocate") && err.contains("--cp run"), "{args:?}: {err}");
    }
    let o = memattn(&["--backend", "vm", "--vm-memory-mib", "1", "run", "--cp", "2", "--seq", "4096", "--heads", "8"]);
    assert_eq!(o.status.code(), Some(3), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("out of device memory"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A cache slot of `u32::MAX` asks for 2^32 slots: refused by the size check naming the bytes
/// (exit 2), where counting the slots overflowed into "internal error" (exit 3). An FP8 cache
/// with an explicit `--dtype` other than bf16 is refused naming both options, where the run
/// silently replaced f32 by bf16.
#[test]
fn decode_slot_overflow_and_an_fp8_cache_with_another_dtype_are_refused() {
    let o = memattn(&["--backend", "vm", "decode", "--cache-batch-idx", "4294967295,0", "--cache-len", "10,20"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("bytes") && !err.contains("internal error"), "{err}");
    for dt in ["f32", "f16"] {
        let o = memattn(&["--backend", "vm", "decode", "--kv-dtype", "fp8", "--dtype", dt]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{dt}: {err}");
        assert!(err.contains("--kv-dtype fp8") && err.contains(&format!("--dtype {dt}")), "{err}");
    }
    let o =
        memattn(&["--backend", "vm", "--json", "decode", "--kv-dtype", "fp8", "--dtype", "bf16", "--cache-len", "40"]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
}

/// FP8 scales whose products leave f32's normal range are refused naming both bounds (exit 2),
/// where `--k-scale 3e38` gave NaN outputs summarised as "max err 0" and `--v-scale 1e-45` zeros.
#[test]
fn fp8_scales_outside_f32s_normal_range_are_refused() {
    for (opt, v) in [("--k-scale", "3e38"), ("--v-scale", "1e-45"), ("--k-scale", "5e31")] {
        let o = memattn(&["--backend", "vm", "decode", "--kv-dtype", "fp8", opt, v]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{opt} {v}: {err}");
        assert!(err.contains("smallest normal") && err.contains("2e31"), "{err}");
    }
}

/// Negative values reach the options' own checks (exit 2, "must be >= 0" or "positive"), where
/// clap took `-1` (and `-1,0` of a list) for an unknown flag.
#[test]
fn negative_values_are_named_by_the_options_rules() {
    let cases: &[(&[&str], &str)] = &[
        (&["decode", "--cache-batch-idx", "-1,0", "--cache-len", "3,4"], "must be >= 0"),
        (&["decode", "--cache-len", "3,-4"], "must be >= 0"),
        (&["decode", "--cache-leftpad", "-2"], "must be >= 0"),
        (&["run", "--seqlens-q", "3,-1"], "must be >= 0"),
        (&["run", "--cp", "-1"], "must be >= 0"),
        (&["run", "--cp", "2", "--device-tflops", "-1"], "--device-tflops must be a positive number"),
        (&["run", "--cp", "2", "--link-gbps", "-5"], "--link-gbps must be a positive number"),
    ];
    for (args, want) in cases {
        let o = memattn(&[&["--backend", "vm"], *args].concat());
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want) && !err.contains("unexpected argument"), "{args:?}: {err}");
    }
}

/// `check --large` on a device too small for its cases reports them NOT RUN and exits 3, as
/// `check` does (one rule), where it marked them FAIL and exited 1; the decode call's device
/// memory refusal is a resource error like the forward's.
#[test]
fn check_large_marks_cases_without_room_not_run() {
    let o = memattn(&["--backend", "vm", "--vm-memory-mib", "1", "--json", "check", "--large"]);
    assert_eq!(o.status.code(), Some(3), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!((v["failed"].as_u64(), v["not_run"].as_u64()), (Some(0), Some(5)), "{v}");
    for c in v["cases"].as_array().unwrap() {
        assert_eq!(c["ran"], false, "{c}");
        assert!(c["detail"].as_str().unwrap().contains("device memory"), "{c}");
    }
}

/// Correct f32 results at large scores verify: the f32 bounds grow with the scores' magnitude
/// (docs/semantics.md, "Accuracy"), where a fixed 1e-5 failed them (row rel RMS 1.05e-5 at
/// `--scale 4 --seed 1`; dv at `--backward --scale 7`).
#[test]
fn f32_results_at_large_scores_verify() {
    for args in [
        &["run", "--scale", "4", "--seed", "1"][..],
        &["run", "--scale", "10"][..],
        &["run", "--kernel", "naive", "--scale", "27"][..],
        &["run", "--backward", "--heads", "4", "--seq", "128", "--scale", "7"][..],
    ] {
        let o = memattn(&[&["--backend", "vm"], args].concat());
        assert_eq!(
            o.status.code(),
            Some(0),
            "{args:?}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

/// A verified decode with `cache_batch_idx` writes its file: the caches are shaped by the slots
/// they hold (one past the largest), where the writer shaped them by the batch and failed after
/// the run (the result lost, exit 2).
#[test]
fn decode_with_cache_slots_writes_caches_shaped_by_their_slots() {
    let out = tmp("decode-slots.safetensors");
    let _ = std::fs::remove_file(&out);
    let o = memattn(&[
        "--backend",
        "vm",
        "decode",
        "--cache-batch-idx",
        "3,0",
        "--cache-len",
        "5,6",
        "--output",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("k_cache").unwrap().shape(), [4, 6, 8, 64]);
    assert_eq!(st.tensor("v_cache").unwrap().shape(), [4, 6, 8, 64]);
    assert_eq!(st.tensor("o").unwrap().shape(), [2, 1, 8, 64]);
}

/// The naive backward with sinks verifies and writes its file without a d_sinks it does not
/// compute (it failed writing one after the verified run: the result lost, exit 2).
#[test]
fn a_naive_backward_with_sinks_writes_what_it_computed() {
    let out = tmp("naive-sinks-grads.safetensors");
    let _ = std::fs::remove_file(&out);
    let o = memattn(&[
        "--backend",
        "vm",
        "run",
        "--backward",
        "--kernel",
        "naive",
        "--sinks",
        "--seq",
        "20",
        "--output",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names = st.names();
    names.sort();
    assert_eq!(names, ["dk", "dq", "dv", "lse", "o"]);
}

/// One verdict per output: a varlen bf16 backward judges O and LSE by the forward's rule, as
/// `run` does on the same inputs (it failed O by a per-sequence 2x rule that `run` passes).
#[test]
fn the_backward_judges_o_by_the_forwards_rule() {
    let shape = ["--dtype", "bf16", "--head-dim", "32", "--heads", "8", "--heads-kv", "4", "--seqlens-q", "65,65"];
    let rest = ["--seqlens-kv", "11,65", "--softcap", "50"];
    let fwd = memattn(&[&["--backend", "vm", "run"][..], &shape, &rest].concat());
    assert_eq!(fwd.status.code(), Some(0), "{}", String::from_utf8_lossy(&fwd.stderr));
    let bwd = memattn(&[&["--backend", "vm", "--json", "run", "--backward"][..], &shape, &rest].concat());
    assert_eq!(bwd.status.code(), Some(0), "{}", String::from_utf8_lossy(&bwd.stderr));
    let v: serde_json::Value = serde_json::from_slice(&bwd.stdout).unwrap();
    for s in v["sequences"].as_array().unwrap() {
        let names: Vec<&str> = s["checks"].as_array().unwrap().iter().map(|c| c["tensor"].as_str().unwrap()).collect();
        assert_eq!(names, ["dq", "dk", "dv"], "{s}");
    }
}

/// Seeded random valid configurations (MEMATTN_FUZZ_SEED overrides the seed, MEMATTN_VALID_CASES
/// the count): the forward in every dtype at compiled and padded head dims, seq_q != seq_kv,
/// GQA, causal, windows, soft cap, sinks, BHSD, naive and flash; and KV-cache decodes, paged or
/// contiguous, with appends and splits. Every one must run and verify (exit 0): a valid input
/// that fails is a bug of the kernels, the reference or the rule that judges them.
#[test]
fn random_valid_configurations_all_verify() {
    let seed = std::env::var("MEMATTN_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5EED_0058u64);
    let cases: usize = std::env::var("MEMATTN_VALID_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(24);
    let mut rng = Rng(seed);
    for case in 0..cases {
        let mut a: Vec<String> = vec!["--backend".into(), "vm".into(), "--json".into()];
        let dtype = rng.pick(&["f32", "bf16", "f16"]);
        let heads_kv = rng.pick(&["1", "2"]);
        let heads = if heads_kv == "1" { rng.pick(&["1", "3"]) } else { rng.pick(&["2", "4"]) };
        if rng.chance(70) {
            let d = rng.pick(&["32", "40", "64", "80", "96", "120", "128", "160", "200", "256"]);
            a.extend(
                ["run", "--dtype", dtype, "--head-dim", d, "--heads", heads, "--heads-kv", heads_kv].map(String::from),
            );
            a.extend(
                ["--seq-q", rng.pick(&["1", "7", "65", "130"]), "--seq-kv", rng.pick(&["1", "9", "64", "201"])]
                    .map(String::from),
            );
            a.extend(["--batch", rng.pick(&["1", "2"])].map(String::from));
            if rng.chance(20) {
                a.extend(["--kernel", "naive"].map(String::from));
            } else if rng.chance(40) {
                a.push("--causal".into());
            } else if rng.chance(30) {
                a.extend(["--window", rng.pick(&["5,0", "17,3", "-1,8"])].map(String::from));
            }
            if rng.chance(25) {
                a.extend(["--softcap", rng.pick(&["5", "30"])].map(String::from));
            }
            if rng.chance(20) {
                a.push("--sinks".into());
            }
            if rng.chance(25) {
                a.extend(["--layout", "bhsd"].map(String::from));
            }
            a.extend(["--seed", &(rng.next() % 1000).to_string()].map(String::from));
        } else {
            let d = rng.pick(&["64", "128", "40", "96"]);
            a.extend(
                ["decode", "--dtype", dtype, "--head-dim", d, "--heads", heads, "--heads-kv", heads_kv]
                    .map(String::from),
            );
            a.extend(
                ["--cache-len", rng.pick(&["1", "33", "100,7", "260,0,5"]), "--new-tokens", rng.pick(&["0", "1", "3"])]
                    .map(String::from),
            );
            if rng.chance(50) {
                a.extend(["--page-size", rng.pick(&["1", "16", "24"])].map(String::from));
            }
            a.extend(["--splits", rng.pick(&["auto", "1", "3"])].map(String::from));
        }
        let args: Vec<&str> = a.iter().map(String::as_str).collect();
        let o = memattn(&args);
        assert_eq!(
            o.status.code(),
            Some(0),
            "case {case} (seed {seed:#x}): {}\nstdout: {}\nstderr: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["verified"], true, "case {case}: {}: {v}", args.join(" "));
    }
}
