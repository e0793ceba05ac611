//! Resource limits and interrupted writes end to end (exit 3 naming the limit, no torn or
//! temporary files), and the decode and config inputs whose options were checked against the
//! wrong values. Each test names the inputs it covers.

use crate::common;
use common::*;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn tmp(name: &str) -> PathBuf {
    let dir =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("memattn-resources-{}", std::process::id()));
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

/// memattn under `ulimit -f BLOCKS` (512-byte blocks), SIGXFSZ left at its default (the shell
/// does not trap it): the binary itself must ignore it.
fn under_file_size_limit(blocks: u32, args: &[&str]) -> Output {
    let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
    let script = format!("ulimit -f {blocks}; exec '{}' {}", env!("CARGO_BIN_EXE_memattn"), quoted.join(" "));
    Command::new("sh").arg("-c").arg(&script).env("MEMATTN_TEST", "1").output().unwrap()
}

fn temporaries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("memattn-tmp"))
        .collect()
}

#[test]
fn the_file_size_limit_is_exit_3_naming_file_and_limit_and_leaves_nothing_behind() {
    // Covers: --output over `ulimit -f` (no SIGXFSZ trap), an existing output kept whole; a
    // --save append over the limit rolled back to the old length.
    let out = tmp("fsize-out.safetensors");
    std::fs::write(&out, b"previous output").unwrap();
    let o =
        under_file_size_limit(128, &["--backend", "vm", "run", "--seq", "256", "--heads", "4", "--output", s(&out)]);
    assert_eq!(o.status.signal(), None, "killed by a signal: {:?}; stderr {}", o.status, stderr(&o));
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains(s(&out)), "the file is not named: {err}");
    assert!(err.contains("file-size limit (ulimit -f) is 65536 bytes"), "the limit is not named: {err}");
    assert!(err.contains("needs 266384 bytes"), "{err}");
    assert!(stdout(&o).contains("verified     PASS"), "the result is still reported: {}", stdout(&o));
    assert_eq!(std::fs::read(&out).unwrap(), b"previous output");
    assert!(temporaries(out.parent().unwrap()).is_empty(), "{:?}", temporaries(out.parent().unwrap()));

    // 1 KiB of limit, a ~1 KiB evidence file: the next record (a few KiB) does not fit.
    let ev = tmp("fsize-evidence.jsonl");
    let first = format!("{{\"earlier\":\"{}\"}}\n", "x".repeat(900));
    std::fs::write(&ev, &first).unwrap();
    let o = under_file_size_limit(2, &["--backend", "vm", "--save", s(&ev), "run", "--seq", "8", "--heads", "1"]);
    assert_eq!(o.status.signal(), None, "{:?}", o.status);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    assert!(stderr(&o).contains("cannot write evidence file"), "{}", stderr(&o));
    assert!(stderr(&o).contains("file-size limit (ulimit -f) is 1024 bytes"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(&ev).unwrap(), first, "the evidence file was not rolled back");
}

#[test]
fn evidence_show_skips_a_torn_last_line_with_a_warning() {
    // Covers: a record cut short at the end of the file (older versions), and a line that is
    // not JSON at all (still an error).
    let ev = tmp("torn.jsonl");
    let o = memattn(&["--backend", "vm", "--save", s(&ev), "run", "--seq", "8", "--heads", "1"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let mut text = std::fs::read_to_string(&ev).unwrap();
    text.push_str(r#"{"recorded_unix_s": 1, "argv": ["memattn", "run"], "command": "ru"#);
    std::fs::write(&ev, &text).unwrap();
    let o = expect(&["evidence", "show", s(&ev)], 0, "line 2 is a record cut short");
    assert!(stdout(&o).contains("1 records in"), "{}", stdout(&o));
    let o = memattn(&["--json", "evidence", "show", s(&ev)]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["records"].as_array().unwrap().len(), 1);
    assert_eq!(v["torn_lines"][0]["line"], 2);
    assert!(v["bad_lines"].as_array().unwrap().is_empty());
    std::fs::write(&ev, format!("{}not json\n", text.lines().next().unwrap().to_owned() + "\n")).unwrap();
    expect(&["evidence", "show", s(&ev)], 2, "is not JSON lines: line 2");
}

#[test]
fn check_cases_that_could_not_run_are_not_run_exit_3() {
    // Covers: check under --vm-memory-mib 1 (most cases do not fit).
    let o = memattn(&["--backend", "vm", "--vm-memory-mib", "1", "--json", "check", "--head-dim", "64"]);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    let v = json(&o);
    let cases = v["cases"].as_array().unwrap();
    let not_run: Vec<_> = cases.iter().filter(|c| c["ran"] == false).collect();
    assert!(!not_run.is_empty() && not_run.len() < cases.len(), "{v}");
    assert!(not_run.iter().all(|c| c["passed"] == false && c["detail"].as_str().unwrap().contains("device memory")));
    // The cases that ran all verified: none is a failure.
    assert_eq!(v["failed"], 0, "{v}");
    assert_eq!(v["not_run"].as_u64(), Some(not_run.len() as u64));
    assert!(cases.iter().filter(|c| c["ran"] == true).all(|c| c["passed"] == true));
    let o = memattn(&["--backend", "vm", "--vm-memory-mib", "1", "check", "--head-dim", "64"]);
    assert_eq!(code(&o), 3);
    assert!(stdout(&o).contains("NOT RUN") && !stdout(&o).contains(" FAIL "), "{}", stdout(&o));
    assert!(stdout(&o).contains(&format!("{} not run", not_run.len())), "{}", stdout(&o));
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A bf16 decode input file: batch 2, heads 4, heads_kv 2, d 64, pages of 8 (3 pages).
fn write_bf16_paged(path: &Path) {
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;
    let bf16s = |n: usize, k: usize| -> Vec<u8> {
        (0..n).flat_map(|i| half::bf16::from_f32(((i * 37 + k * 11) % 29) as f32 / 14.0 - 1.0).to_le_bytes()).collect()
    };
    let (q, kc, vc) = (bf16s(2 * 4 * 64, 1), bf16s(3 * 8 * 2 * 64, 2), bf16s(3 * 8 * 2 * 64, 3));
    let t: Vec<u8> = [2u32, 0, 1, 0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let l: Vec<u8> = [9i32, 4].iter().flat_map(|v| v.to_le_bytes()).collect();
    let tensors = [
        ("q", TensorView::new(Dtype::BF16, vec![2, 1, 4, 64], &q).unwrap()),
        ("k_cache", TensorView::new(Dtype::BF16, vec![3, 8, 2, 64], &kc).unwrap()),
        ("v_cache", TensorView::new(Dtype::BF16, vec![3, 8, 2, 64], &vc).unwrap()),
        ("block_table", TensorView::new(Dtype::U32, vec![2, 2], &t).unwrap()),
        ("cache_seqlens", TensorView::new(Dtype::I32, vec![2], &l).unwrap()),
    ];
    std::fs::write(path, safetensors::serialize(tensors, None).unwrap()).unwrap();
}

/// An f32 decode input file whose caches hold no key at all: `k_cache` `[2, 0, 2, 64]`,
/// `cache_seqlens` `[0, 0]`, 3 query tokens per sequence.
fn write_empty_cache(path: &Path) {
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;
    let q: Vec<u8> = (0..2 * 3 * 4 * 64).flat_map(|i| ((i % 13) as f32 / 6.0 - 1.0).to_le_bytes()).collect();
    let l: Vec<u8> = [0u32, 0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let tensors = [
        ("q", TensorView::new(Dtype::F32, vec![2, 3, 4, 64], &q).unwrap()),
        ("k_cache", TensorView::new(Dtype::F32, vec![2, 0, 2, 64], &[]).unwrap()),
        ("v_cache", TensorView::new(Dtype::F32, vec![2, 0, 2, 64], &[]).unwrap()),
        ("cache_seqlens", TensorView::new(Dtype::U32, vec![2], &l).unwrap()),
    ];
    std::fs::write(path, safetensors::serialize(tensors, None).unwrap()).unwrap();
}

#[test]
fn decode_inputs_options_are_checked_against_the_file() {
    // Covers: --kernel mma with a bf16 paged file (was refused as f32 before the file was read);
    // an empty cache (cache_seqlens 0, zero-size cache tensors) gives O = 0 and LSE = -inf.
    let inp = tmp("bf16-paged.safetensors");
    write_bf16_paged(&inp);
    let o = memattn(&["--backend", "vm", "--json", "decode", "--inputs", s(&inp), "--kernel", "mma", "--repeats", "1"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(
        (v["dtype"].as_str(), v["kernel"].as_str(), v["verified"].as_bool()),
        (Some("bf16"), Some("mma"), Some(true))
    );

    let empty = tmp("empty-cache.safetensors");
    write_empty_cache(&empty);
    let out = tmp("empty-cache-out.safetensors");
    let o = memattn(&["--backend", "vm", "decode", "--inputs", s(&empty), "--output", s(&out), "--repeats", "1"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |name: &str| -> Vec<f32> {
        st.tensor(name).unwrap().data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    };
    let (ov, lse) = (f32s("o"), f32s("lse"));
    assert_eq!((ov.len(), lse.len()), (2 * 3 * 4 * 64, 2 * 4 * 3));
    assert!(ov.iter().all(|&x| x == 0.0), "O of a row with no key must be 0");
    assert!(lse.iter().all(|&x| x == f32::NEG_INFINITY), "LSE of a row with no key must be -inf: {lse:?}");
}

#[test]
fn decode_refuses_overflowing_scores_and_vary_overrides() {
    // Covers: decode --scale 1e38 (scores overflow f32), decode --splits 2 --vary splits=1,3,
    // --dtype with --vary dtype, --kernel with --vary kernel, --page-size with --vary page-size.
    let o = expect(
        &["--backend", "vm", "decode", "--cache-len", "64", "--heads", "1", "--scale", "1e38"],
        2,
        "scores overflow f32",
    );
    assert!(!stdout(&o).contains("verified"), "it ran: {}", stdout(&o));
    let o = memattn(&[
        "--backend",
        "vm",
        "decode",
        "--cache-len",
        "64",
        "--heads",
        "1",
        "--scale",
        "1e20",
        "--repeats",
        "1",
    ]);
    assert_eq!(code(&o), 0, "a large scale that does not overflow runs: {}", stderr(&o));
    for (args, needle) in [
        (vec!["--splits", "2", "--vary", "splits=1,3"], "--vary splits sets what --splits sets"),
        (vec!["--dtype", "bf16", "--vary", "dtype=f32,f16"], "--vary dtype sets what --dtype sets"),
        (vec!["--kernel", "simt", "--vary", "kernel=simt,auto"], "--vary kernel sets what --kernel sets"),
        (vec!["--page-size", "16", "--vary", "page-size=8,0"], "--vary page-size sets what --page-size sets"),
    ] {
        let o = expect(&[&["--backend", "vm", "decode", "--cache-len", "40"][..], &args[..]].concat(), 2, needle);
        assert!(stdout(&o).is_empty(), "something ran: {}", stdout(&o));
    }
}

#[test]
fn plan_config_layer_types_are_validated() {
    // Covers: layer_types a number, a string, an array with a number, an unknown layer type, the
    // wrong length; a valid array still plans.
    let cfg = |layer_types: &str| {
        format!(
            r#"{{"model_type": "gemma3_text", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
               "head_dim": 64, "hidden_size": 512, "intermediate_size": 1024, "vocab_size": 1000,
               "sliding_window": 128, "layer_types": {layer_types}}}"#
        )
    };
    for (i, (types, needle)) in [
        ("7", "field `layer_types` must be an array of 4 strings"),
        (r#""sliding_attention""#, "field `layer_types` must be an array of 4 strings"),
        (r#"["full_attention", 1, "full_attention", "full_attention"]"#, "entry 1 is 1; known layer types"),
        (r#"["full_attention", "sliding", "full_attention", "full_attention"]"#, "entry 1 is \"sliding\""),
        (r#"["full_attention", "sliding_attention"]"#, "has 2 entries for 4 layers"),
    ]
    .into_iter()
    .enumerate()
    {
        let f = tmp(&format!("layer-types-{i}.json"));
        std::fs::write(&f, cfg(types)).unwrap();
        expect(&["plan", "--config", s(&f), "--context", "1024"], 2, needle);
    }
    let f = tmp("layer-types-ok.json");
    std::fs::write(&f, cfg(r#"["sliding_attention", "full_attention", "sliding_attention", "full_attention"]"#))
        .unwrap();
    let o = memattn(&["--json", "plan", "--config", s(&f), "--context", "1024"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

/// `sweep --plot` and `plan --plot` (SVG and PNG) over `ulimit -f`: exit 3 naming the file and
/// the limit, an existing plot kept whole, no temporary left, as every other writer (they were
/// exit 2 with a debug dump of the drawing library's error).
#[test]
fn plots_over_the_file_size_limit_are_exit_3_like_every_writer() {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/configs/llama-3-8b.json");
    for ext in ["svg", "png"] {
        let plot = tmp(&format!("fsize-plot.{ext}"));
        std::fs::write(&plot, b"previous plot").unwrap();
        for args in [
            vec!["--backend", "vm", "sweep", "--heads", "1", "--vary", "seq=16,32", "--plot", s(&plot)],
            vec![
                "plan",
                "--config",
                config,
                "--batch",
                "8",
                "--context",
                "4096",
                "--vram",
                "80GiB",
                "--plot",
                s(&plot),
            ],
        ] {
            let o = under_file_size_limit(2, &args);
            assert_eq!(o.status.signal(), None, "{args:?}: {:?}", o.status);
            assert_eq!(code(&o), 3, "{args:?}: {}", stderr(&o));
            let err = stderr(&o);
            assert!(
                err.contains("cannot write plot") && err.contains("file-size limit (ulimit -f) is 1024 bytes"),
                "{err}"
            );
            assert!(!err.contains("BackendError"), "{err}");
            assert_eq!(std::fs::read(&plot).unwrap(), b"previous plot");
            assert!(temporaries(plot.parent().unwrap()).is_empty());
        }
    }
}
