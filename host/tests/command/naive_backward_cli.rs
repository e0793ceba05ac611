//! The naive backward end to end in the VM: `memattn run --backward --kernel naive` (gradients
//! checked here against the f64 reference of inputs the test wrote, the peak against bytes
//! counted here) and `memattn compare --backward` (both sides verified, measured peak equal to
//! the expected bytes, the workspaces P + dS and dQ accumulator + D), and their refusals.

use crate::common;
use common::*;
use memattn_cli::problem::Problem;
use memattn_cli::reference::grad::attention_backward;
use memattn_cli::rng::SplitMix64;
use std::path::PathBuf;

fn tmp(name: &str) -> PathBuf {
    let dir =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("memattn-naive-bwd-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn draw(n: usize, rng: &mut SplitMix64) -> Vec<f32> {
    (0..n).map(|_| rng.below(2001) as f32 / 1000.0 - 1.0).collect()
}

fn read_f32(st: &safetensors::SafeTensors<'_>, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap_or_else(|_| panic!("output lacks `{name}`"));
    t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Max |got - want| over max(max |want|, 1e-3); NaN (a poisoned element) propagates.
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1e-3f64, |m, w| m.max(w.abs()));
    got.iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).abs())
        .fold(0.0, |m: f64, e| if e.is_nan() { f64::NAN } else { m.max(e) })
        / scale
}

#[test]
fn naive_run_backward_writes_verified_gradients_at_the_counted_peak() {
    // GQA 3:1, head_dim 20 (no flash kernel has it), seq_q > seq_kv with a causal window: the
    // first rows see no key; a soft cap; neither length a multiple of anything.
    let (b, h, hk, sq, skv, d) = (1usize, 3usize, 1usize, 30usize, 21usize, 20usize);
    let (qn, kn) = (b * sq * h * d, b * skv * hk * d);
    let mut rng = SplitMix64::new(9);
    let t = [draw(qn, &mut rng), draw(kn, &mut rng), draw(kn, &mut rng), draw(qn, &mut rng)];
    let bytes: Vec<Vec<u8>> = t.iter().map(|x| x.iter().flat_map(|v| v.to_le_bytes()).collect()).collect();
    let (qs, ks) = (vec![b, sq, h, d], vec![b, skv, hk, d]);
    let f = safetensors::Dtype::F32;
    use safetensors::tensor::TensorView;
    let views = vec![
        ("q", TensorView::new(f, qs.clone(), &bytes[0]).unwrap()),
        ("k", TensorView::new(f, ks.clone(), &bytes[1]).unwrap()),
        ("v", TensorView::new(f, ks.clone(), &bytes[2]).unwrap()),
        ("do", TensorView::new(f, qs.clone(), &bytes[3]).unwrap()),
    ];
    let (input, output) = (tmp("in.safetensors"), tmp("out.safetensors"));
    safetensors::serialize_to_file(views, None, &input).unwrap();
    let o = memattn(&[
        "--json",
        "run",
        "--backward",
        "--kernel",
        "naive",
        "--inputs",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
        "--causal",
        "--window",
        "6,0",
        "--softcap",
        "1.5",
    ]);
    assert_eq!(code(&o), 0, "{}\n{}", stdout(&o), stderr(&o));
    let v = json(&o);
    assert_eq!((&v["verified"], &v["kernel"]), (&true.into(), &"naive".into()), "{v}");
    let launches: Vec<&str> = v["launches"].as_array().unwrap().iter().map(|l| l["kernel"].as_str().unwrap()).collect();
    assert_eq!(launches, ["naive_bwd_p_f32", "naive_bwd_ds_f32", "naive_bwd_dq_f32", "naive_bwd_dkv_f32"]);
    // The peak, counted here: q, k, v, dO; O and LSE; dq, dk, dv; P and dS (the naive forward's
    // score matrix is freed before the backward allocates them).
    let rows = b * h * sq;
    let pds = 2 * 4 * (b * h * sq * skv) as u64;
    let peak = 4 * (2 * qn + 2 * kn + qn + rows + qn + 2 * kn) as u64 + pds;
    assert_eq!(v["peak_device_bytes"].as_u64(), Some(peak), "{}", v["memory"]);
    assert_eq!(v["expected_bytes"]["p_ds_bytes"].as_u64(), Some(pds));
    assert_eq!(v["expected_bytes"]["workspace_bytes"].as_u64(), Some(pds));
    assert_eq!(v["memory_as_expected"], true);

    let p = Problem {
        heads: h as u32,
        heads_kv: Some(hk as u32),
        seq_q: sq as u32,
        seq_kv: skv as u32,
        head_dim: d as u32,
        causal: true,
        window: (6, 0),
        softcap: 1.5,
        ..Problem::default()
    };
    let want = attention_backward(&p, &t[0], &t[1], &t[2], &t[3], &[]).unwrap();
    let file = std::fs::read(&output).unwrap();
    let st = safetensors::SafeTensors::deserialize(&file).unwrap();
    for (name, w) in [("o", &want.o), ("dq", &want.dq), ("dk", &want.dk), ("dv", &want.dv)] {
        let e = rel_err(&read_f32(&st, name), w);
        assert!(e <= 2e-5, "{name}: relative error {e:e}");
    }
    // The first 9 rows of every head see no key: their dq is exactly 0.
    let dq = read_f32(&st, "dq");
    assert!(dq[..9 * h * d].iter().all(|x| *x == 0.0));
    std::fs::remove_file(&input).ok();
    std::fs::remove_file(&output).ok();
}

#[test]
fn compare_backward_shows_both_verified_at_their_expected_bytes() {
    // GQA 2:1, causal, 70 keys: several flash key blocks, seq not a tile multiple; sinks enter
    // both backwards through LSE (the naive side computes no d_sinks).
    let args = ["compare", "--backward", "--heads", "4", "--heads-kv", "2", "--seq", "70", "--causal", "--sinks"];
    let mut json_args = vec!["--json"];
    json_args.extend_from_slice(&args);
    let o = memattn(&json_args);
    assert_eq!(code(&o), 0, "{}\n{}", stdout(&o), stderr(&o));
    let v = json(&o);
    assert_eq!((&v["command"], &v["backward"], &v["verified"]), (&"compare".into(), &true.into(), &true.into()));
    let runs = v["runs"].as_array().unwrap();
    let kernels: Vec<&str> = runs.iter().map(|r| r["kernel"].as_str().unwrap()).collect();
    assert_eq!(kernels, ["naive", "flash"]);
    let (b, h, hk, n, d) = (1u64, 4u64, 2u64, 70u64, 64u64);
    let (qb, kb, rows) = (4 * b * n * h * d, 4 * b * n * hk * d, 4 * b * h * n);
    let sinks = 4 * h;
    for r in runs {
        assert_eq!(r["verified"], true, "{}", r["kernel"]);
        assert_eq!(r["memory_as_expected"], true, "{}", r["kernel"]);
        assert_eq!(r["peak_device_bytes"], r["expected_bytes"]["total_bytes"], "{}", r["kernel"]);
    }
    // naive: P + dS, no d_sinks; flash: the dQ accumulator and D (O(N·d)), and d_sinks.
    let base = 2 * qb + 2 * kb + sinks + qb + rows + qb + 2 * kb;
    assert_eq!(runs[0]["expected_bytes"]["workspace_bytes"].as_u64(), Some(2 * 4 * b * h * n * n));
    assert_eq!(runs[0]["peak_device_bytes"].as_u64(), Some(base + 2 * 4 * b * h * n * n));
    assert_eq!(runs[1]["expected_bytes"]["workspace_bytes"].as_u64(), Some(qb + rows));
    assert_eq!(runs[1]["peak_device_bytes"].as_u64(), Some(base + sinks + qb + rows));
    let names: Vec<&str> =
        runs[0]["checks"].as_array().unwrap().iter().map(|c| c["tensor"].as_str().unwrap()).collect();
    assert_eq!(names, ["o", "lse", "dq", "dk", "dv"]);
    assert!(runs[1]["checks"].as_array().unwrap().iter().any(|c| c["tensor"] == "d_sinks"));

    let o = memattn(&args);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let text = stdout(&o);
    for needle in [
        "naive/flash",
        "naive_bwd_{p,ds,dq,dkv}_f32",
        "measured peak",
        "measured - expected",
        "P + dS",
        "dQ acc",
        "O(N*d)",
        "O(N^2)",
        "backward time (ms)",
        "less device memory than naive",
        "verified",
    ] {
        assert!(text.contains(needle), "compare --backward lacks `{needle}`:\n{text}");
    }
    let row = text.lines().find(|l| l.starts_with("measured - expected")).expect("a measured - expected row");
    assert_eq!(row.split_whitespace().skip(3).collect::<Vec<_>>(), ["0", "B", "0", "B"], "{row}");
}

#[test]
fn compare_backward_refusals_name_the_limit() {
    let refused = |args: &[&str], needle: &str| {
        let o = memattn(args);
        assert_eq!(code(&o), 2, "{args:?}: {}\n{}", stdout(&o), stderr(&o));
        let err = stderr(&o);
        assert!(err.contains(needle), "{args:?}: stderr lacks `{needle}`:\n{err}");
        assert!(!err.contains("panicked"), "{err}");
    };
    refused(&["compare", "--backward", "--vary", "seq=8,16"], "--vary kernel=naive,flash");
    refused(&["compare", "--backward", "--kernel", "naive", "--seq", "8"], "without --kernel");
    refused(&["compare", "--backward", "--vary", "kernel=naive,naive"], "--vary kernel=naive,flash");
    refused(&["compare", "--backward", "--dtype", "bf16", "--seq", "8"], "f32 only");
    refused(&["compare", "--backward", "--head-dim", "84", "--seq", "8"], "head_dim 84");
}
