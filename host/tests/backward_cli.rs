//! `memattn run --backward` end to end in the VM: gradients checked here against the f64
//! reference computed by the test from inputs the test wrote, the memory figures against bytes
//! counted here, `--output`, and every refusal (exit 2 naming the limit).

mod common;
use common::*;
use memattn_cli::problem::Problem;
use memattn_cli::reference::grad::attention_backward;
use memattn_cli::rng::SplitMix64;
use std::path::{Path, PathBuf};

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memattn-bwd-{}", std::process::id()));
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
    r(&["--dtype", "bf16"], "f32 only");
    r(&["--dtype", "f16"], "use --dtype f32");
    r(
        &["--head-dim", "80"],
        "head_dim 80 is not supported by the flash kernel: f32 flash kernels are compiled for head_dim 32, 64, 96, 128, 192 and 256",
    );
    r(&["--kernel", "naive", "--deterministic"], "no atomic adds");
    r(&["--kernel", "naive", "--head-dim", "300"], "1..=256");
    assert_refused(&["run", "--deterministic", "--heads", "1"], "--backward");
    assert_refused(
        &["run", "--backward", "--seqlens-q", "3,4", "--seqlens-kv", "3,4", "--heads", "1"],
        "packed sequences",
    );
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
