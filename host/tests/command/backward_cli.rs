//! `memattn run --backward` end to end in the VM: gradients checked here against the f64
//! reference computed by the test from inputs the test wrote, the memory figures against bytes
//! counted here, `--output`, and every refusal (exit 2 naming the limit).

use crate::common;
use common::*;
use memattn_cli::problem::Problem;
use memattn_cli::reference::grad::attention_backward;
use memattn_cli::rng::SplitMix64;
use std::path::{Path, PathBuf};

fn tmp(name: &str) -> PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("memattn-bwd-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// One problem's sizes (BSHD).
#[derive(Clone, Copy)]
struct Shape {
    b: usize,
    h: usize,
    hk: usize,
    sq: usize,
    skv: usize,
    d: usize,
}

impl Shape {
    fn qn(&self) -> usize {
        self.b * self.sq * self.h * self.d
    }
    fn kn(&self) -> usize {
        self.b * self.skv * self.hk * self.d
    }
}

fn draw(n: usize, rng: &mut SplitMix64) -> Vec<f32> {
    (0..n).map(|_| rng.below(2001) as f32 / 1000.0 - 1.0).collect()
}

fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Writes q, k, v and (if given) `do` as F32 safetensors.
fn write_inputs(path: &Path, s: Shape, t: &[Vec<f32>], d_o_shape: Option<Vec<usize>>) {
    use safetensors::tensor::TensorView;
    let bytes: Vec<Vec<u8>> = t.iter().map(|x| f32_bytes(x)).collect();
    let (qs, ks) = (vec![s.b, s.sq, s.h, s.d], vec![s.b, s.skv, s.hk, s.d]);
    let f = safetensors::Dtype::F32;
    let mut views = vec![
        ("q", TensorView::new(f, qs.clone(), &bytes[0]).unwrap()),
        ("k", TensorView::new(f, ks.clone(), &bytes[1]).unwrap()),
        ("v", TensorView::new(f, ks, &bytes[2]).unwrap()),
    ];
    if let Some(shape) = d_o_shape {
        views.push(("do", TensorView::new(f, shape, &bytes[3]).unwrap()));
    }
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn read_f32(st: &safetensors::SafeTensors<'_>, name: &str) -> (Vec<usize>, Vec<f32>) {
    let t = st.tensor(name).unwrap_or_else(|_| panic!("output lacks `{name}`"));
    assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
    let v = t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    (t.shape().to_vec(), v)
}

/// Max |got - want| over max(max |want|, 1e-3); NaN propagates (a poisoned element fails).
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1e-3f64, |m, w| m.max(w.abs()));
    got.iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).abs())
        .fold(0.0, |m: f64, e| if e.is_nan() { f64::NAN } else { m.max(e) })
        / scale
}

/// Bytes at the peak, counted from the shape: q, O, dO, dQ and the f32 dQ accumulator are
/// like q; k, v, dK, dV like k; LSE and D one f32 per query row.
fn peak_bytes(s: Shape) -> u64 {
    let rows = s.b * s.h * s.sq;
    4 * (5 * s.qn() + 4 * s.kn() + 2 * rows) as u64
}

/// Runs `--backward --inputs` with a `do` tensor and `--output` for one case; checks exit 0,
/// the JSON, the memory figures and the written gradients against the f64 reference.
fn case(name: &str, s: Shape, flags: &[&str], causal: bool, window: (i32, i32), softcap: f32, seed: u64) {
    let mut rng = SplitMix64::new(seed);
    let t = vec![draw(s.qn(), &mut rng), draw(s.kn(), &mut rng), draw(s.kn(), &mut rng), draw(s.qn(), &mut rng)];
    let (input, output) = (tmp(&format!("{name}-in.safetensors")), tmp(&format!("{name}-out.safetensors")));
    write_inputs(&input, s, &t, Some(vec![s.b, s.sq, s.h, s.d]));
    let mut args = vec!["--json", "run", "--backward", "--inputs", input.to_str().unwrap()];
    args.extend_from_slice(&["--output", output.to_str().unwrap()]);
    args.extend_from_slice(flags);
    let o = memattn(&args);
    assert_eq!(code(&o), 0, "{name}: {}\n{}", stdout(&o), stderr(&o));
    let v = json(&o);
    assert_eq!(v["verified"], true, "{name}: {v}");
    assert_eq!(v["d_o"], "given (tensor `do`)", "{name}");
    let names: Vec<&str> = v["checks"].as_array().unwrap().iter().map(|c| c["tensor"].as_str().unwrap()).collect();
    assert_eq!(names, ["o", "lse", "dq", "dk", "dv"], "{name}");
    // The VM's allocator is exact: the peak is the bytes counted here, and the workspace is
    // the dQ accumulator plus D.
    let rows = (s.b * s.h * s.sq) as u64;
    assert_eq!(v["peak_device_bytes"].as_u64().unwrap(), peak_bytes(s), "{name}: {}", v["memory"]);
    assert_eq!(v["expected_bytes"]["total_bytes"].as_u64().unwrap(), peak_bytes(s), "{name}");
    assert_eq!(v["expected_bytes"]["workspace_bytes"].as_u64().unwrap(), 4 * s.qn() as u64 + 4 * rows, "{name}");
    assert_eq!(v["memory_as_expected"], true, "{name}");
    assert_eq!(v["launches"].as_array().unwrap().len(), 3, "{name}: preprocess, main, convert");

    let p = Problem {
        batch: s.b as u32,
        heads: s.h as u32,
        heads_kv: Some(s.hk as u32),
        seq_q: s.sq as u32,
        seq_kv: s.skv as u32,
        head_dim: s.d as u32,
        causal,
        window,
        softcap,
        ..Problem::default()
    };
    let want = attention_backward(&p, &t[0], &t[1], &t[2], &t[3], &[]).unwrap();
    let bytes = std::fs::read(&output).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (qs, ks) = (vec![s.b, s.sq, s.h, s.d], vec![s.b, s.skv, s.hk, s.d]);
    for (tensor, shape, w) in [("o", &qs, &want.o), ("dq", &qs, &want.dq), ("dk", &ks, &want.dk), ("dv", &ks, &want.dv)]
    {
        let (got_shape, got) = read_f32(&st, tensor);
        assert_eq!(&got_shape, shape, "{name}: {tensor}");
        let e = rel_err(&got, w);
        assert!(e <= 2e-5, "{name}: {tensor} relative error {e:e}");
    }
    let (lse_shape, lse) = read_f32(&st, "lse");
    assert_eq!(lse_shape, [s.b, s.h, s.sq], "{name}");
    for (g, w) in lse.iter().zip(&want.lse) {
        assert!(if w.is_finite() { (*g as f64 - w).abs() <= 1e-5 * w.abs().max(1.0) } else { *g == f32::NEG_INFINITY });
    }
    std::fs::remove_file(&input).ok();
    std::fs::remove_file(&output).ok();
}

#[test]
fn gqa_with_fully_masked_rows_verifies_and_writes_the_gradients() {
    // seq_q > seq_kv, causal (bottom-right): the first 25 query rows see no key, so their dq is
    // 0 and their LSE -inf; neither length is a tile multiple; 2 query heads per K/V head.
    let s = Shape { b: 1, h: 4, hk: 2, sq: 45, skv: 20, d: 64 };
    case("gqa-masked", s, &["--causal"], true, (-1, -1), 0.0, 1);
}

#[test]
fn d128_window_softcap_two_batches_bhsd_verifies() {
    let s = Shape { b: 2, h: 2, hk: 1, sq: 33, skv: 70, d: 128 };
    let flags = ["--window", "9,3", "--softcap", "2", "--layout", "bhsd"];
    case("d128-window", s, &flags, false, (9, 3), 2.0, 2);
}

#[test]
fn random_upstream_gradient_and_human_summary() {
    let o = memattn(&["run", "--backward", "--heads", "2", "--seq-q", "17", "--seq-kv", "40", "--causal"]);
    assert_eq!(code(&o), 0, "{}\n{}", stdout(&o), stderr(&o));
    let s = stdout(&o);
    for needle in ["dq", "dk", "dv", "dQ accumulator", "as expected", "verified"] {
        assert!(s.contains(needle), "summary lacks `{needle}`:\n{s}");
    }
    // The default dO comes from the seed: another seed, other gradients.
    let run = |seed: &str| {
        let o = memattn(&["--json", "run", "--backward", "--heads", "1", "--seq", "5", "--seed", seed]);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        let v = json(&o);
        assert!(v["d_o"].as_str().unwrap().contains(&format!("seed {seed}")), "{v}");
        v["checks"][2]["max_abs_ref"].as_f64().unwrap()
    };
    assert_ne!(run("1"), run("2"));
}

/// Exit 2 with a message on stderr naming `needle`, and no panic.
fn assert_refused(args: &[&str], needle: &str) {
    let o = memattn(args);
    assert_eq!(code(&o), 2, "{args:?}: stdout {} stderr {}", stdout(&o), stderr(&o));
    let err = stderr(&o);
    assert!(err.contains(needle), "{args:?}: stderr does not mention `{needle}`:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn unsupported_options_are_refused_with_the_limit() {
    let r = |extra: &[&str], needle: &str| {
        let mut args = vec!["run", "--backward", "--heads", "1", "--seq", "8"];
        args.extend_from_slice(extra);
        assert_refused(&args, needle);
    };
    r(&["--dtype", "bf16", "--head-dim", "192"], "the bf16 backward is compiled for head_dim 32, 64 and 128");
    r(&["--dtype", "f16", "--head-dim", "256"], "the f16 backward is compiled for head_dim 32, 64 and 128");
    r(
        &["--head-dim", "84"],
        "head_dim 84 is not supported by the flash kernel: f32 flash kernels are compiled for head_dim 32, 64, 96, 128, 192 and 256; any other multiple of 8 up to 256 runs on the next of them",
    );
    r(&["--kernel", "naive", "--deterministic"], "no atomic adds");
    r(&["--kernel", "naive", "--head-dim", "300"], "1..=256");
    assert_refused(&["run", "--deterministic", "--heads", "1"], "--backward");
    // Packed sequences keep the forward's rules: BSHD only, lengths per sequence.
    assert_refused(
        &["run", "--backward", "--seqlens-q", "3,4", "--seqlens-kv", "3,4", "--heads", "1", "--layout", "bhsd"],
        "--layout bshd",
    );
    assert_refused(&["run", "--backward", "--seqlens-q", "3,4", "--seqlens-kv", "3", "--heads", "1"], "lengths");
}

/// Writes a packed (varlen) input file: q, do `[total_q, h, d]`, k, v `[total_kv, hk, d]`,
/// cu_seqlens_q and cu_seqlens_kv (U32).
fn write_varlen_inputs(path: &Path, h: usize, hk: usize, d: usize, lq: &[u32], lk: &[u32], t: &[Vec<f32>]) {
    use safetensors::tensor::TensorView;
    let (tq, tk) = (lq.iter().sum::<u32>() as usize, lk.iter().sum::<u32>() as usize);
    let cu = |l: &[u32]| -> Vec<u8> {
        let mut c = vec![0u32];
        for &x in l {
            c.push(c.last().unwrap() + x);
        }
        c.iter().flat_map(|v| v.to_le_bytes()).collect()
    };
    let bytes: Vec<Vec<u8>> = t.iter().map(|x| f32_bytes(x)).collect();
    let (cq, ck) = (cu(lq), cu(lk));
    let f = safetensors::Dtype::F32;
    let views = vec![
        ("q", TensorView::new(f, vec![tq, h, d], &bytes[0]).unwrap()),
        ("k", TensorView::new(f, vec![tk, hk, d], &bytes[1]).unwrap()),
        ("v", TensorView::new(f, vec![tk, hk, d], &bytes[2]).unwrap()),
        ("do", TensorView::new(f, vec![tq, h, d], &bytes[3]).unwrap()),
        ("cu_seqlens_q", TensorView::new(safetensors::Dtype::U32, vec![lq.len() + 1], &cq).unwrap()),
        ("cu_seqlens_kv", TensorView::new(safetensors::Dtype::U32, vec![lk.len() + 1], &ck).unwrap()),
    ];
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn packed_sequences_verify_per_sequence_and_write_packed_gradients() {
    // Three sequences: 7 queries over 3 keys (causal: the first 4 rows see nothing), an empty
    // query sequence with 5 keys (its dk, dv must be written as 0), 30 queries over 45 keys (two
    // key blocks); GQA 4 over 2. The gradients written are checked here, sequence by sequence,
    // against the f64 reference of the inputs this test wrote.
    let (h, hk, d) = (4usize, 2usize, 64usize);
    let (lq, lk): (&[u32], &[u32]) = (&[7, 0, 30], &[3, 5, 45]);
    let (tq, tk) = (37usize, 53usize);
    let mut rng = SplitMix64::new(21);
    let t = vec![
        draw(tq * h * d, &mut rng),
        draw(tk * hk * d, &mut rng),
        draw(tk * hk * d, &mut rng),
        draw(tq * h * d, &mut rng),
    ];
    let (input, output) = (tmp("varlen-in.safetensors"), tmp("varlen-out.safetensors"));
    write_varlen_inputs(&input, h, hk, d, lq, lk, &t);
    let args = [
        "--json",
        "run",
        "--backward",
        "--causal",
        "--inputs",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ];
    let o = memattn(&args);
    assert_eq!(code(&o), 0, "{}\n{}", stdout(&o), stderr(&o));
    let v = json(&o);
    assert_eq!(v["verified"], true, "{v}");
    let seqs = v["sequences"].as_array().expect("a per-sequence check");
    let lens: Vec<(u64, u64)> =
        seqs.iter().map(|s| (s["seq_q"].as_u64().unwrap(), s["seq_kv"].as_u64().unwrap())).collect();
    assert_eq!(lens, [(7, 3), (0, 5), (30, 45)]);
    for s in seqs {
        let names: Vec<&str> = s["checks"].as_array().unwrap().iter().map(|c| c["tensor"].as_str().unwrap()).collect();
        // O and LSE are judged once, by the forward's rule (every row on its own scale).
        assert_eq!((names, &s["passed"]), (vec!["dq", "dk", "dv"], &true.into()), "{s}");
    }
    // Bytes counted here: q, O, dO, dq and the f32 dQ accumulator like q; k, v, dk, dv like k;
    // LSE and D one f32 per row; the two cu_seqlens, 4 entries of 4 B each.
    let (qb, kb, rows) = (4 * (tq * h * d) as u64, 4 * (tk * hk * d) as u64, 4 * (h * tq) as u64);
    assert_eq!(v["peak_device_bytes"].as_u64().unwrap(), 5 * qb + 4 * kb + 2 * rows + 2 * 16, "{}", v["memory"]);
    assert_eq!(v["memory_as_expected"], true);

    let base =
        Problem { heads: h as u32, heads_kv: Some(hk as u32), head_dim: d as u32, causal: true, ..Problem::default() };
    let p = Problem::varlen(base, lq, lk).unwrap();
    let want = attention_backward(&p, &t[0], &t[1], &t[2], &t[3], &[]).unwrap();
    let bytes = std::fs::read(&output).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (cq, ck) = ([0usize, 7, 7, 37], [0usize, 3, 8, 53]);
    for (tensor, shape, w, cu, width) in [
        ("o", vec![tq, h, d], &want.o, &cq, h * d),
        ("dq", vec![tq, h, d], &want.dq, &cq, h * d),
        ("dk", vec![tk, hk, d], &want.dk, &ck, hk * d),
        ("dv", vec![tk, hk, d], &want.dv, &ck, hk * d),
    ] {
        let (got_shape, got) = read_f32(&st, tensor);
        assert_eq!(got_shape, shape, "{tensor}");
        for s in 0..3 {
            let (lo, hi) = (cu[s] * width, cu[s + 1] * width);
            let e = rel_err(&got[lo..hi], &w[lo..hi]);
            assert!(e <= 2e-5, "sequence {s}: {tensor} relative error {e:e}");
        }
    }
    // Keys no query reads: exactly zero gradients.
    let (_, dk) = read_f32(&st, "dk");
    assert!(dk[3 * hk * d..8 * hk * d].iter().all(|&x| x == 0.0));
    let (lse_shape, lse) = read_f32(&st, "lse");
    assert_eq!(lse_shape, [h, tq]);
    for (g, w) in lse.iter().zip(&want.lse) {
        assert!(if w.is_finite() { (*g as f64 - w).abs() <= 1e-5 * w.abs().max(1.0) } else { *g == f32::NEG_INFINITY });
    }
    // Rows 0..4 of sequence 0 see no key (7 queries, 3 keys, bottom-right causal).
    assert!(lse[..4].iter().all(|&x| x == f32::NEG_INFINITY) && lse[4].is_finite());
    std::fs::remove_file(&input).ok();
    std::fs::remove_file(&output).ok();

    // From the command line, with sinks and deterministic dQ: the summary lists each sequence.
    let o = memattn(&[
        "run",
        "--backward",
        "--heads",
        "2",
        "--seqlens-q",
        "7,0,30",
        "--seqlens-kv",
        "3,5,45",
        "--causal",
        "--sinks",
        "--deterministic",
        "--warmup",
        "1",
        "--head-dim",
        "32",
    ]);
    assert_eq!(code(&o), 0, "{}\n{}", stdout(&o), stderr(&o));
    let text = stdout(&o);
    for needle in [
        "sequence 0 (seq_q 7, seq_kv 3)",
        "sequence 1 (seq_q 0, seq_kv 5)",
        "d_sinks",
        "cu_seqlens",
        "bitwise identical",
        "verified",
    ] {
        assert!(text.contains(needle), "summary lacks `{needle}`:\n{text}");
    }
}

#[test]
fn a_do_tensor_not_shaped_like_q_is_refused() {
    let s = Shape { b: 1, h: 1, hk: 1, sq: 6, skv: 6, d: 64 };
    let mut rng = SplitMix64::new(3);
    let t = vec![draw(s.qn(), &mut rng), draw(s.kn(), &mut rng), draw(s.kn(), &mut rng), draw(s.qn(), &mut rng)];
    let input = tmp("bad-do.safetensors");
    write_inputs(&input, s, &t, Some(vec![1, 6, 64, 1]));
    assert_refused(&["run", "--backward", "--inputs", input.to_str().unwrap()], "tensor `do`");
    std::fs::remove_file(&input).ok();
}

#[test]
fn run_help_teaches_the_backward() {
    let o = memattn(&["run", "--help"]);
    assert_eq!(code(&o), 0);
    let s = stdout(&o);
    for needle in [
        "--backward",
        "recomputed from the forward's LSE",
        "dQ accumulator",
        "tensor `do`",
        "exit 2",
        "--deterministic",
        "bitwise the same",
        "d_sinks",
        "P and dS",
    ] {
        assert!(s.contains(needle), "run --help lacks `{needle}`");
    }
}

#[test]
fn sinks_and_deterministic_mode_verify_and_state_their_bytes() {
    // Causal with seq_q > seq_kv: the first 5 rows see only the sink. 40 keys at d=64 are two
    // key blocks, so deterministic mode keeps two dQ accumulators. Three repetitions (one
    // warm-up) must write the same bits; d_sinks is checked by the run and, from --output,
    // here against the f64 reference of the same seeded inputs.
    let output = tmp("sinks-det-out.safetensors");
    let args = [
        "--json",
        "run",
        "--backward",
        "--sinks",
        "--deterministic",
        "--heads",
        "2",
        "--heads-kv",
        "1",
        "--seq-q",
        "45",
        "--seq-kv",
        "40",
        "--causal",
        "--warmup",
        "1",
        "--repeats",
        "2",
        "--seed",
        "5",
        "--output",
        output.to_str().unwrap(),
    ];
    let o = memattn(&args);
    assert_eq!(code(&o), 0, "{}\n{}", stdout(&o), stderr(&o));
    let v = json(&o);
    assert_eq!(v["verified"], true, "{v}");
    assert_eq!(
        (&v["deterministic"], &v["bitwise_reproducible"], &v["repetitions"]),
        (&true.into(), &true.into(), &3.into())
    );
    let names: Vec<&str> = v["checks"].as_array().unwrap().iter().map(|c| c["tensor"].as_str().unwrap()).collect();
    assert_eq!(names, ["o", "lse", "dq", "dk", "dv", "d_sinks"]);
    let s = Shape { b: 1, h: 2, hk: 1, sq: 45, skv: 40, d: 64 };
    let e = &v["expected_bytes"];
    let (qb, rows) = (4 * s.qn() as u64, 4 * (s.b * s.h * s.sq) as u64);
    assert_eq!((e["dq_slices"].as_u64(), e["dq_accum_bytes"].as_u64()), (Some(2), Some(2 * qb)));
    assert_eq!(e["workspace_bytes"].as_u64().unwrap(), 2 * qb + rows);
    // One more accumulator and the sinks and their gradient (4 B per head each).
    assert_eq!(v["peak_device_bytes"].as_u64().unwrap(), peak_bytes(s) + qb + 2 * 4 * 2, "{}", v["memory"]);
    assert_eq!(v["memory_as_expected"], true);
    // A naive backward's P and dS: two f32 matrices of seq_q x seq_kv per head.
    assert_eq!(e["naive_p_ds_bytes"].as_u64().unwrap(), 2 * 4 * 2 * 45 * 40);

    let p = Problem {
        heads: 2,
        heads_kv: Some(1),
        seq_q: 45,
        seq_kv: 40,
        causal: true,
        sinks: true,
        dtype: memattn_cli::Dtype::F32,
        ..Problem::default()
    };
    let x = memattn_cli::inputs::Qkv::random(&p, 5);
    let d_o = memattn_cli::backward_run::random_d_o(&p, 5);
    let want = attention_backward(&p, &x.q, &x.k, &x.v, &d_o, &x.sinks).unwrap();
    let bytes = std::fs::read(&output).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (shape, ds) = read_f32(&st, "d_sinks");
    assert_eq!(shape, [2]);
    let err = rel_err(&ds, &want.dsinks);
    assert!(err <= 2e-5, "d_sinks relative error {err:e}: {ds:?} vs {:?}", want.dsinks);
    std::fs::remove_file(&output).ok();

    // The human summary says the same.
    let o = memattn(&args[1..args.len() - 2]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let text = stdout(&o);
    for needle in
        ["d_sinks", "dQ accumulators 2 x 23040 + D 360", "naive backward: P and dS", "bitwise identical", "verified"]
    {
        assert!(text.contains(needle), "summary lacks `{needle}`:\n{text}");
    }
}

#[test]
fn check_backward_sweeps_every_case_and_each_gradient() {
    let o = memattn(&["--backend", "vm", "--json", "check", "--backward", "--head-dim", "64"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!((&v["backward"], &v["passed"], &v["failed"]), (&true.into(), &true.into(), &0.into()));
    let cases = v["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 20);
    let case = |name: &str| cases.iter().find(|c| c["case"] == name).unwrap_or_else(|| panic!("no case `{name}`"));
    for c in cases {
        assert_eq!((&c["passed"], &c["head_dim"]), (&true.into(), &64.into()), "{c}");
        let names: Vec<&str> = c["checks"].as_array().unwrap().iter().map(|t| t["tensor"].as_str().unwrap()).collect();
        assert_eq!(&names[..5], ["o", "lse", "dq", "dk", "dv"], "{c}");
    }
    // Rows that see no key: LSE = -inf is checked as such (the shape says seq_q > seq_kv).
    assert_eq!(case("seq_q > seq_kv")["shape"]["seq_q"], 100);
    let names = |c: &serde_json::Value| -> Vec<String> {
        c["checks"].as_array().unwrap().iter().map(|t| t["tensor"].as_str().unwrap().to_string()).collect()
    };
    assert!(names(case("sinks")).contains(&"d_sinks".to_string()));
    // Deterministic cases compare two repetitions' bits.
    for name in ["deterministic", "varlen deterministic"] {
        assert_eq!((&case(name)["deterministic"], &case(name)["bitwise_reproducible"]), (&true.into(), &true.into()));
    }
    // Varlen: every sequence on its own, the empty one included.
    let seqs = case("varlen causal")["sequences"].as_array().unwrap().clone();
    let lens: Vec<(u64, u64)> =
        seqs.iter().map(|s| (s["seq_q"].as_u64().unwrap(), s["seq_kv"].as_u64().unwrap())).collect();
    assert_eq!(lens, [(100, 64), (0, 5), (1, 1), (37, 130), (65, 65)]);

    // Without --head-dim: every head dim the f32 backward is compiled for (from the kernel table).
    let o = memattn(&["--backend", "vm", "check", "--backward", "--head-dim", "32"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).contains("check --backward: 20 of 20 cases passed"), "{}", stdout(&o));
}

#[test]
fn check_backward_refuses_what_has_no_backward() {
    // bf16/f16 have tensor-core backward kernels at 32, 64 and 128 only (96 runs padded on
    // 128, 192 has none): refused before anything runs, naming the limit.
    for dtype in ["bf16", "f16"] {
        assert_refused(&["check", "--backward", "--dtype", dtype, "--head-dim", "192"], "32, 64 and 128");
    }
    assert_refused(&["check", "--backward", "--head-dim", "84"], "32, 64, 96, 128, 192 and 256");
    // The naive backward exists: the refusal says where it runs.
    assert_refused(&["check", "--backward", "--kernel", "naive"], "run --backward --kernel naive");
    // A forward-only guard is refused, never silently ignored.
    assert_refused(&["check", "--backward", "--dtype", "bf16", "--max-error-ratio", "0.01"], "--max-error-ratio 0.01");
}

/// The embedded PTX with the f32 d64 backward's `red.global.add.f32` (each key block's dQ added
/// into the f32 accumulator) deleted, written to `name`.
fn ptx_without_dq_adds(name: &str) -> PathBuf {
    let ptx = memattn_cli::ptx::PtxSource::embedded().text;
    let entry = ptx.find(".entry flash_bwd_f32_d64(").unwrap();
    let add = "red.global.add.f32 [%ga], %r44; }";
    let at = entry + ptx[entry..].find(add).expect("the d64 backward adds dQ with red.global.add.f32");
    let broken = tmp(name);
    std::fs::write(&broken, format!("{}}}{}", &ptx[..at], &ptx[at + add.len()..])).unwrap();
    broken
}

/// The tensors a check object (`run --backward`'s report, or a case of `check --backward`)
/// failed.
fn failed_tensors(v: &serde_json::Value) -> Vec<&str> {
    v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["passed"] == false)
        .map(|t| t["tensor"].as_str().unwrap())
        .collect()
}

#[test]
fn check_backward_fails_a_kernel_that_drops_the_dq_adds() {
    // The d64 backward's `red.global.add.f32` (each key block's dQ added into the f32
    // accumulator) deleted from the PTX: the atomic cases lose dq (left at the preprocess's
    // zeros) and fail on dq; the cases whose dq is 0 anyway (one visible key per row) and the
    // deterministic ones (dQ slices stored, not added) pass. Exit 1.
    let broken = ptx_without_dq_adds("no-dq-add.ptx");
    let o = memattn(&[
        "--backend",
        "vm",
        "--ptx",
        broken.to_str().unwrap(),
        "--json",
        "check",
        "--backward",
        "--head-dim",
        "64",
    ]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    let v = json(&o);
    let cases = v["cases"].as_array().unwrap();
    let passed: Vec<&str> = cases.iter().filter(|c| c["passed"] == true).map(|c| c["case"].as_str().unwrap()).collect();
    assert_eq!(passed, ["seq 1", "window 0", "deterministic", "varlen deterministic"]);
    for c in cases.iter().filter(|c| c["passed"] == false) {
        assert_eq!(failed_tensors(c), ["dq"], "{}: {}", c["case"], c["detail"]);
    }
    std::fs::remove_file(&broken).ok();
}

#[test]
fn a_bf16_backward_runs_on_tensor_cores_and_verifies_by_the_2x_rule() {
    // GQA, causal with more queries than keys (rows that see no key), tails of every tile.
    for dtype in ["bf16", "f16"] {
        let o = memattn(&[
            "--json",
            "run",
            "--backward",
            "--dtype",
            dtype,
            "--heads",
            "4",
            "--heads-kv",
            "2",
            "--seq-q",
            "77",
            "--seq-kv",
            "70",
            "--causal",
            "--head-dim",
            "64",
        ]);
        assert_eq!(code(&o), 0, "{dtype}: {}", stderr(&o));
        let v = json(&o);
        let checks = v["checks"].as_array().unwrap();
        for name in ["dq", "dk", "dv"] {
            let c = checks.iter().find(|c| c["tensor"] == name).unwrap();
            assert_eq!(c["passed"], true, "{dtype} {name}: {c}");
            assert!(c["two_x"].is_object(), "{dtype} {name}: held to the naive backward in {dtype}: {c}");
            assert!(c["max_abs_err"].as_f64().unwrap() > 0.0, "{dtype} {name}: a 16-bit result has rounding error");
        }
    }
}

#[test]
fn a_sampled_backward_check_names_its_slices_and_still_fails_a_broken_kernel() {
    // --check-rows 1: one whole (batch, KV head) slice of a GQA problem (group 2, seq_q 50: 100
    // rows) is held to the rule; the report says which.
    let args = |dtype: &'static str| {
        vec![
            "--json",
            "run",
            "--backward",
            "--dtype",
            dtype,
            "--batch",
            "3",
            "--heads",
            "4",
            "--heads-kv",
            "2",
            "--seq-q",
            "50",
            "--seq-kv",
            "45",
            "--head-dim",
            "64",
            "--causal",
            "--check-rows",
            "1",
        ]
    };
    let o = memattn(&args("bf16"));
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!((v["checked_rows"].as_u64(), v["total_rows"].as_u64()), (Some(100), Some(600)), "{v}");
    let s = &v["checked_slices"];
    assert_eq!((s["batches"].as_array().unwrap().len(), s["kv_heads"].as_array().unwrap().len()), (1, 1), "{s}");
    assert!(v["checks"].as_array().unwrap().iter().all(|c| c["passed"] == true));
    let text = memattn(&args("bf16")[1..]);
    assert!(stdout(&text).contains("checked 100 of 600 query rows: batches ["), "{}", stdout(&text));
    // Without --check-rows the problem is small enough to be checked whole.
    let whole: Vec<&str> = args("bf16").into_iter().take(18).collect();
    let v = json(&memattn(&whole));
    assert_eq!(v["checked_rows"], 600);
    assert!(v.get("checked_slices").is_none(), "{v}");

    // The f32 d64 backward without its dQ adds fails the sampled check too (exit 1, on dq).
    let broken = ptx_without_dq_adds("no-dq-add-sampled.ptx");
    let mut a = vec!["--backend", "vm", "--ptx", broken.to_str().unwrap()];
    a.extend(args("f32"));
    let o = memattn(&a);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["checked_rows"], 100);
    assert_eq!(failed_tensors(&v), ["dq"], "{v}");
    std::fs::remove_file(&broken).ok();
}
