//! Every example command in `memattn --help`, `memattn plan --help`, README.md, host/README.md and
//! the book's usage pages (`BOOK_PAGES`) does what its comment says: each runs (in a scratch folder) and its exit code and one key line
//! of output are checked. An example added without an entry here fails the test, and so does an
//! entry whose example is gone.

use std::path::{Path, PathBuf};
use std::process::Command;

/// What an example must do: exit code and a piece of its output (stdout or stderr), or why it is
/// not run here.
enum Expect {
    Run(i32, &'static str),
    Skip(&'static str),
}
use Expect::*;

const EXAMPLES: &[(&str, Expect)] = &[
    ("memattn compare", Run(0, "verified                                      PASS               PASS")),
    ("memattn run --kernel flash --seq-q 200 --causal", Run(0, "verified     PASS")),
    ("memattn run --inputs qkv.safetensors --output o.safetensors", Run(0, "wrote o [1, 24, 2, 64] f32")),
    ("memattn compare --vary seq-q=128,256 --kernel flash", Run(0, "seq-q=256 uses")),
    ("memattn run --dtype bf16 --causal", Run(0, "flash_fwd_bf16_d64")),
    (
        "memattn --backend vm --vm-arch sm_90 run --dtype bf16 --head-dim 128 --seq 300 --heads 2 --causal",
        Run(0, "flash_fwd_bf16_sm90_d128"),
    ),
    ("memattn --backend vm --vm-arch sm_90 check --dtype bf16", Run(0, "check: 126 of 126 cases passed")),
    ("memattn compare --vary dtype=f32,bf16", Run(0, "dtype=bf16 uses 512.00 KiB less device memory")),
    ("memattn sweep --vary seq=64,128,256 --plot sweep.svg", Run(0, "plot: sweep.svg")),
    ("memattn --backend vm --vm-memory-mib 1 sweep --vary seq=128,256 --heads 2", Run(0, "needs 1.00 MiB")),
    ("memattn run --heads 8 --heads-kv 2 --window 255,0", Run(0, "verified     PASS")),
    ("memattn run --sliding-window 256 --softcap 50 --sinks", Run(0, "verified     PASS")),
    ("memattn check --kernel flash --dtype f32 --head-dim 64", Run(0, "check: 21 of 21 cases passed")),
    ("memattn check --backward --head-dim 64", Run(0, "check --backward: 20 of 20 cases passed")),
    (
        "memattn run --backward --heads 2 --seqlens-q 7,0,30 --seqlens-kv 3,5,45 --causal",
        Run(0, "sequence 1 (seq_q 0, seq_kv 5): dv"),
    ),
    (
        "memattn --backend vm decode --batch 3 --heads 8 --heads-kv 2 --cache-len 1000,0,37 --new-tokens 1 --page-size 16",
        Run(0, "appended cache exact"),
    ),
    (
        "memattn --backend vm decode --dtype bf16 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 512 --vary kernel=simt,mma",
        Run(0, "launch       decode_mma_bf16_d128 grid [4, 1, 8]"),
    ),
    (
        "memattn --backend vm decode --dtype bf16 --batch 64 --heads 8 --heads-kv 2 --cache-len 4197 --shared-prefix 4096 --repeats 1 --warmup 0",
        Run(0, "32.62 MiB by the prefix's launch (16.3x the prefix)"),
    ),
    ("memattn draw tiling --seq 200 --causal --out tiling.svg", Run(0, "visited 6 of 8 tiles")),
    (
        "memattn decode --heads 32 --heads-kv 8 --cache-len 8192 --sms 132 --vary splits=1,auto",
        Run(0, "decode_fwd_f32_d64 grid [16, 1, 8]"),
    ),
    (
        "memattn run --cp 4 --cp-strategy zigzag --causal --seq 1000 --heads 4 --heads-kv 2 --dtype bf16",
        Run(0, "rank 3: sent 384000 B (analytic 384000 B), received 384000 B (analytic 384000 B)"),
    ),
    (
        "memattn run --cp 3 --cp-strategy zigzag --backward --causal --seq 200 --heads 4 --heads-kv 2",
        Run(0, "backward rank 2: sent 340992 B (analytic 340992 B), received 340992 B"),
    ),
    (
        "memattn run --cp 3 --cp-comm nccl-rules --cp-strategy zigzag --causal --seq 300 --heads 2",
        Run(0, "rank 2: sent 204800 B (analytic 204800 B)"),
    ),
    (
        "memattn plan --config host/tests/fixtures/configs/llama-3-8b.json --context 1048576 --cp 8 --vram 80GiB",
        Run(0, "smallest context-parallel group that fits: 3 devices"),
    ),
    ("memattn doctor", Run(0, "== next step")),
    ("memattn kernels", Run(0, "flash_fwd_f32_d64 (PTX line")),
    ("memattn trace --kernel flash --thread 5", Run(0, "ld.param")),
    (
        "memattn plan --layers 32 --heads 32 --heads-kv 8 --head-dim 128 --batch 8 --context 32768 --vram 80GiB",
        Run(0, "dominant term: KV cache, 32.00 GiB = 100.00%"),
    ),
    ("memattn --save evidence.jsonl run --seq 128", Run(0, "evidence appended to evidence.jsonl (exit code 0)")),
    ("memattn evidence show evidence.jsonl", Run(0, "records in evidence.jsonl")),
    (
        "memattn plan --config host/tests/fixtures/configs/llama-3-8b.json --batch 8 --context 32768 --vram 80GiB",
        Run(0, "dominant term: KV cache, 32.00 GiB"),
    ),
    (
        "memattn plan --config host/tests/fixtures/configs/llama-3-8b.json --batch 8 --context 32768 --vram 80GiB --kv-dtype fp8",
        Run(0, "KV cache (8 sequences)                                     16.00 GiB"),
    ),
    (
        "memattn plan --config host/tests/fixtures/configs/mistral-7b-v0.1.json --batch 1 --context 8192 --verify",
        Run(0, "measured 104464 B  PASS"),
    ),
    (
        "memattn plan --config host/tests/fixtures/configs/llama-3-8b.json --batch 8 --context 32768 --vram 80GiB --plot plan.png",
        Run(0, "plot: plan.png"),
    ),
    ("memattn --save evidence.jsonl doctor", Run(0, "evidence appended to evidence.jsonl")),
    ("memattn --save evidence.jsonl compare --vary seq=128,256", Run(0, "seq=256 uses")),
    ("memattn --save evidence.jsonl compare --vary dtype=f32,bf16", Run(0, "dtype=bf16 uses")),
    (
        "memattn --backend vm --vm-memory-mib 1 sweep --vary seq=128,256 --heads 2 --plot sweep.png",
        Run(0, "needs 1.00 MiB"),
    ),
    ("memattn --ptx no-barrier.ptx run --kernel flash --heads 2 --seq-q 96 --seq-kv 200", Run(3, "shared memory race")),
    (
        "memattn --backend vm --vm-allow racecheck,initcheck --ptx no-barrier.ptx run ...",
        Skip("abbreviated in the README; run in full below as the same run with the checks off"),
    ),
    ("memattn run --kernel naive --seq-q 200 --seq-kv 300 --causal --json", Run(0, "\"verified\": true")),
    (
        "memattn run --backward --heads 4 --heads-kv 2 --seq-q 45 --seq-kv 20 --causal",
        Run(0, "measured peak 272800 B (as expected)"),
    ),
    (
        "memattn compare --backward --heads 4 --seq 256",
        Run(0, "flash uses 1.75 MiB less device memory than naive (2.26 MiB vs 4.00 MiB measured peak"),
    ),
    ("memattn compare --vary dtype=f32,bf16,f16", Run(0, "dtype=f16 uses")),
    ("memattn compare --vary causal=false,true --kernel flash", Run(0, "causal=true uses")),
    (
        "memattn --backend vm --vm-memory-mib 1 sweep --vary seq=128,256 --heads 2 --plot sweep.svg",
        Run(0, "needs 1.00 MiB"),
    ),
    ("memattn trace --kernel naive --step softmax --block 0 --thread 5", Run(0, "naive_softmax_f32")),
    ("memattn --ptx my_kernels.ptx compare", Run(0, "verified                                      PASS")),
    ("memattn --save oom.jsonl doctor", Run(0, "evidence appended to oom.jsonl")),
    (
        "memattn --save oom.jsonl plan --config host/tests/fixtures/configs/llama-3-8b.json --batch 8 --context 32768 --vram 80GiB",
        Run(0, "the one option that changes the outcome most: --kv-dtype fp8 -> total 30.96 GiB"),
    ),
    (
        "memattn --save oom.jsonl plan --config host/tests/fixtures/configs/llama-3-8b.json --batch 8 --context 32768 --vram 80GiB --kv-dtype fp8",
        Run(0, "largest batch that fits: 32"),
    ),
    ("memattn evidence diff oom.jsonl 2 3", Run(0, "options changed: (nothing) -> --kv-dtype fp8")),
    (
        "memattn --save oom.jsonl plan --config host/tests/fixtures/configs/mistral-7b-v0.1.json --batch 1 --context 8192 --verify",
        Run(0, "PASS"),
    ),
    ("memattn evidence show oom.jsonl", Run(0, "4 records in oom.jsonl")),
    ("memattn evidence rerun oom.jsonl 2", Run(0, "exit code: run 2 0, rerun 0 (same)")),
    (
        "memattn --backend vm run --timeline t.json --dtype bf16 --head-dim 128 --seq 512 --heads 2",
        Run(0, "wrote the timeline of"),
    ),
];

/// The book's pages that README.md's sections moved to: their examples are checked like the README's.
const BOOK_PAGES: &[&str] = &[
    "docs/main-job.md",
    "docs/embed.md",
    "docs/oom.md",
    "docs/decode.md",
    "docs/backward.md",
    "docs/context-parallel.md",
    "docs/memcheck.md",
    "docs/learn.md",
    "docs/kernels.md",
    "docs/timeline.md",
];

/// Example commands of `--help` texts (lines `  memattn ...`, the description after two spaces
/// dropped) and of the READMEs' code blocks (`memattn ...` or `$ memattn ...`, `# comment` dropped).
fn examples(repo: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for args in [&["--help"][..], &["plan", "--help"][..]] {
        let o = Command::new(env!("CARGO_BIN_EXE_memattn")).args(args).output().unwrap();
        for l in String::from_utf8_lossy(&o.stdout).lines() {
            if let Some(rest) = l.strip_prefix("  memattn ") {
                let cmd = rest.split("  ").next().unwrap_or("").trim();
                out.push((format!("memattn {}", args.join(" ")), format!("memattn {cmd}")));
            }
        }
    }
    for f in ["README.md", "host/README.md"].into_iter().chain(BOOK_PAGES.iter().copied()) {
        let text = std::fs::read_to_string(repo.join(f)).unwrap();
        let mut in_block = false;
        for l in text.lines() {
            if l.starts_with("```") {
                in_block = !in_block;
                continue;
            }
            let t = l.strip_prefix("$ ").unwrap_or(l);
            if in_block && t.starts_with("memattn ") {
                out.push((f.to_string(), t.split('#').next().unwrap_or("").trim().to_string()));
            }
        }
    }
    out
}

/// A scratch folder with what the examples read: `host` (the fixtures), `qkv.safetensors`,
/// `my_kernels.ptx` (the embedded PTX) and `no-barrier.ptx` (a barrier deleted).
fn scratch(repo: &Path, name: &str) -> PathBuf {
    let d = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("memattn-help-examples-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    #[cfg(unix)]
    std::os::unix::fs::symlink(repo.join("host"), d.join("host")).unwrap();
    let shape = memattn_cli::safetensors_io::FileShape {
        batch: 1,
        heads: 2,
        seq_q: 24,
        seq_kv: 40,
        head_dim: 64,
        heads_kv: 2,
        varlen: None,
    };
    let p = memattn_cli::Problem { batch: 1, heads: 2, seq_q: 24, seq_kv: 40, head_dim: 64, ..Default::default() };
    memattn_cli::safetensors_io::write_qkv(&d.join("qkv.safetensors"), shape, &memattn_cli::inputs::Qkv::random(&p, 7))
        .unwrap();
    let ptx = memattn_cli::ptx::PtxSource::embedded().text;
    std::fs::write(d.join("my_kernels.ptx"), ptx.as_bytes()).unwrap();
    let start = ptx.find(".entry flash_fwd_f32_d64(").unwrap();
    let at = start + ptx[start..].find("bar.sync").unwrap();
    std::fs::write(d.join("no-barrier.ptx"), format!("{}// removed: {}", &ptx[..at], &ptx[at..])).unwrap();
    d
}

fn run(dir: &Path, cmd: &str) -> (i32, String) {
    let words: Vec<&str> = cmd.split_whitespace().skip(1).collect();
    let o = Command::new(env!("CARGO_BIN_EXE_memattn")).args(&words).current_dir(dir).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    (o.status.code().unwrap_or(-1), text)
}

/// Runs the examples `group` selects (in `EXAMPLES` order, in a scratch folder of its own).
fn check(name: &str, in_group: impl Fn(&[(String, String)], &str) -> bool) {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let found = examples(&repo);
    let mut problems = Vec::new();
    for (src, cmd) in &found {
        if !EXAMPLES.iter().any(|(c, _)| c == cmd) {
            problems.push(format!("{src}: example `{cmd}` has no expected outcome in this test"));
        }
    }
    for (c, _) in EXAMPLES {
        if !found.iter().any(|(_, f)| f == c) {
            problems.push(format!("`{c}` is not an example any more: remove it here"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    let dir = scratch(&repo, name);
    let (mut ran, mut skipped) = (0, 0);
    for (cmd, expect) in EXAMPLES.iter().filter(|(c, _)| in_group(&found, c)) {
        match expect {
            Skip(why) => {
                eprintln!("skipped `{cmd}`: {why}");
                skipped += 1;
            }
            Run(want, key) => {
                let started = std::time::Instant::now();
                let (got, text) = run(&dir, cmd);
                eprintln!("{:6.2} s `{cmd}`", started.elapsed().as_secs_f64());
                if got != *want || !text.contains(key) {
                    problems.push(format!("`{cmd}`: exit {got} (want {want}), want `{key}` in:\n{text}"));
                }
                ran += 1;
            }
        }
    }
    eprintln!("{name}: {ran} examples ran, {skipped} skipped");
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
}

fn in_help(found: &[(String, String)], cmd: &str) -> bool {
    found.iter().any(|(src, c)| c == cmd && src.starts_with("memattn "))
}

#[test]
#[cfg_attr(not(unix), ignore = "the scratch folder links the fixtures with a unix symlink")]
fn every_example_in_help_does_what_it_says() {
    check("help", in_help);
}

#[test]
#[cfg_attr(not(unix), ignore = "the scratch folder links the fixtures with a unix symlink")]
fn every_example_in_the_readmes_does_what_it_says() {
    check("readmes", |found, cmd| !in_help(found, cmd));
    // The abbreviated README run in full: with the checks off the damage is a wrong answer.
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let dir = scratch(&repo, "readmes-full");
    let full = "memattn --backend vm --vm-allow racecheck,initcheck --ptx no-barrier.ptx run --kernel flash --heads 2 --seq-q 96 --seq-kv 200";
    let (got, text) = run(&dir, full);
    assert!(got == 1 && text.contains("verified     FAIL"), "`{full}`: exit {got} (want 1):\n{text}");
}
