//! End-to-end tests of `memattn decode` in the VM: the verified run and its JSON, `--vary`,
//! `--output`, and bad input (exit 2 naming the rule, never a panic).

use crate::common;
use common::*;

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn assert_bad_input(args: &[&str], needle: &str) {
    let o = memattn(args);
    let err = text(&o.stderr);
    assert_eq!(code(&o), 2, "{args:?}: stdout {} stderr {err}", text(&o.stdout));
    assert!(err.contains(needle), "{args:?}: stderr does not mention `{needle}`:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn decode_runs_verified_with_plan_and_memory_figures() {
    let o = memattn(&[
        "--backend",
        "vm",
        "--json",
        "decode",
        "--batch",
        "3",
        "--heads",
        "8",
        "--heads-kv",
        "2",
        "--cache-len",
        "300,0,37",
        "--new-tokens",
        "2",
        "--seq-q",
        "2",
        "--page-size",
        "16",
        "--splits",
        "2",
        "--repeats",
        "1",
        "--warmup",
        "0",
    ]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    assert_eq!(v["verified"], true);
    assert_eq!(v["verification"]["cache_ok"], true);
    assert_eq!(v["plan"]["num_splits"], 2);
    assert_eq!(v["cache"]["kind"], "paged");
    // 302, 2 and 39 keys in pages of 16: 19 + 1 + 3 pages; 2 + 14 + 9 rows unused.
    assert_eq!(v["cache"]["num_pages"], 23);
    let row = 2 * 64 * 4 * 2; // heads_kv * d * f32 * (K and V)
    assert_eq!(v["bytes"]["kv_cache"], 23 * 16 * row);
    assert_eq!(v["bytes"]["kv_unused"], (2 + 14 + 9) * row);
    assert_eq!(v["bytes"]["workspace"], 2 * 3 * 8 * 2 * (64 + 1) * 4);
    let names: Vec<&str> = v["launches"].as_array().unwrap().iter().map(|l| l["kernel"].as_str().unwrap()).collect();
    assert_eq!(names, ["decode_append_f32", "decode_fwd_f32_d64", "merge_states_f32"]);
    assert!(v["vm_thread_instructions_per_cached_token"].as_f64().unwrap() > 0.0);
}

#[test]
fn decode_vary_splits_and_output_file() {
    let o = memattn(&[
        "--backend",
        "vm",
        "--json",
        "decode",
        "--cache-len",
        "700",
        "--heads",
        "4",
        "--vary",
        "splits=1,auto",
        "--repeats",
        "1",
        "--warmup",
        "0",
    ]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs[0]["plan"]["num_splits"], 1);
    // 4 blocks on 132 SMs, ceil(700 / 256) = 3 key blocks: 3 splits.
    assert_eq!(runs[1]["plan"]["num_splits"], 3);
    assert!(runs.iter().all(|r| r["verified"] == true));

    let dir =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("memattn-decode-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("out.safetensors");
    let o = memattn(&[
        "--backend",
        "vm",
        "decode",
        "--cache-len",
        "5",
        "--new-tokens",
        "1",
        "--heads",
        "2",
        "--output",
        path.to_str().unwrap(),
        "--repeats",
        "1",
    ]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("o").unwrap().shape(), [1, 1, 2, 64]);
    assert_eq!(st.tensor("lse").unwrap().shape(), [1, 2, 1]);
    assert_eq!(st.tensor("k_cache").unwrap().shape(), [1, 6, 2, 64]);
    assert_eq!(st.tensor("v_cache").unwrap().shape(), [1, 6, 2, 64]);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn decode_tensor_core_kernel_and_sinks() {
    let o = memattn(&[
        "--backend",
        "vm",
        "--json",
        "decode",
        "--dtype",
        "bf16",
        "--heads",
        "8",
        "--heads-kv",
        "2",
        "--head-dim",
        "128",
        "--cache-len",
        "90,3",
        "--seq-q",
        "2",
        "--sinks",
        "--splits",
        "3",
        "--vary",
        "kernel=simt,mma",
        "--repeats",
        "1",
        "--warmup",
        "0",
    ]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let runs = v["runs"].as_array().unwrap();
    assert_eq!((runs[0]["kernel"].as_str(), runs[1]["kernel"].as_str()), (Some("simt"), Some("mma")));
    assert!(runs.iter().all(|r| r["verified"] == true && r["sinks"] == true && r["plan"]["num_splits"] == 3));
    assert_eq!(runs[1]["launches"][0]["kernel"], "decode_mma_bf16_d128");
    assert_eq!(runs[1]["launches"][0]["grid"], serde_json::json!([3, 1, 4]));
    assert_eq!(runs[1]["bytes"]["sinks"], 8 * 4);
    assert_bad_input(&["--backend", "vm", "decode", "--kernel", "mma"], "takes bf16 or f16, not f32");
    assert_bad_input(&["--backend", "vm", "decode", "--kernel", "wmma"], "auto, simt, mma or prefill");
}

/// `--indices-on-device`: the same call verified with the indices checked by `decode_check_*`
/// first, on the SIMT, tensor-core and prefill kernels, paged, with cache slots, and with rotary
/// (whose tables then cover the capacity).
#[test]
fn decode_indices_checked_on_the_device() {
    for (extra, first, kernel) in [
        (&["--cache-len", "300,0,37", "--new-tokens", "2", "--page-size", "16"][..], "decode_check_f32", "simt"),
        (
            &["--dtype", "bf16", "--cache-len", "70,9", "--new-tokens", "1", "--page-size", "8"][..],
            "decode_check_bf16",
            "mma",
        ),
        (
            &["--dtype", "f16", "--cache-len", "40,9", "--seq-q", "130", "--new-tokens", "3"][..],
            "decode_check_f16",
            "prefill",
        ),
        (
            &["--cache-len", "30,12", "--new-tokens", "1", "--cache-batch-idx", "2,0", "--cache-leftpad", "3"][..],
            "decode_check_f32",
            "simt",
        ),
        (
            &["--dtype", "bf16", "--cache-len", "30,12", "--new-tokens", "2", "--seq-q", "3", "--rotary-dim", "32"][..],
            "decode_check_bf16",
            "mma",
        ),
    ] {
        let base = ["--backend", "vm", "--json", "decode", "--heads", "4", "--heads-kv", "2", "--indices-on-device"];
        let o = memattn(&[&base[..], extra, &["--repeats", "1", "--warmup", "0"]].concat());
        assert_eq!(code(&o), 0, "{extra:?}: {}", text(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!((v["verified"].as_bool(), v["kernel"].as_str()), (Some(true), Some(kernel)), "{extra:?}");
        assert_eq!(
            (v["indices_checked_on"].as_str(), v["verification"]["cache_ok"].as_bool()),
            (Some("device"), Some(true))
        );
        assert_eq!(v["launches"][0]["kernel"], first, "{extra:?}");
    }
}

/// Chunked prefill from the command line: `--kernel prefill` (and `auto` at a long query) runs the
/// tensor-core forward over the paged cache with new tokens appended, verified, one launch after
/// the append and no merge; `auto` keeps the decode kernel for a short query; the refusals.
#[test]
fn decode_chunked_prefill_kernel() {
    let run = |extra: &[&str]| -> serde_json::Value {
        let base = ["--backend", "vm", "--json", "decode", "--dtype", "f16", "--heads", "4", "--heads-kv", "2"];
        let more =
            ["--cache-len", "200,9", "--new-tokens", "3", "--page-size", "16", "--repeats", "1", "--warmup", "0"];
        let o = memattn(&[&base[..], &more[..], extra].concat());
        assert_eq!(code(&o), 0, "{extra:?}: {}", text(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    for (extra, kernel) in [
        (&["--seq-q", "20", "--kernel", "prefill", "--sinks", "--window", "30,0"][..], "prefill"),
        (&["--seq-q", "130"][..], "prefill"),
        (&["--seq-q", "20"][..], "mma"),
    ] {
        let v = run(extra);
        assert_eq!((v["verified"].as_bool(), v["kernel"].as_str()), (Some(true), Some(kernel)), "{extra:?}");
        assert_eq!(v["verification"]["cache_ok"], true);
        let names: Vec<&str> =
            v["launches"].as_array().unwrap().iter().map(|l| l["kernel"].as_str().unwrap()).collect();
        if kernel == "prefill" {
            assert_eq!(names, ["decode_append_f16", "flash_fwd_f16_d64"], "{extra:?}");
            assert_eq!(v["plan"]["num_splits"], 1);
        } else {
            assert!(names.contains(&"decode_mma_f16_d64"), "{names:?}");
        }
    }
    let d = ["--backend", "vm", "decode", "--kernel", "prefill"];
    assert_bad_input(&d, "takes bf16 or f16");
    assert_bad_input(&[&d[..], &["--dtype", "bf16", "--alibi"]].concat(), "does not take ALiBi");
    assert_bad_input(&[&d[..], &["--dtype", "bf16", "--kv-dtype", "fp8"]].concat(), "FP8");
}

#[test]
fn decode_bad_input_exits_2_naming_the_rule() {
    assert_bad_input(&["--backend", "vm", "decode", "--page-size", "0"], "page_size must be >= 1");
    assert_bad_input(&["--backend", "vm", "decode", "--heads", "6", "--heads-kv", "4"], "mismatched heads");
    assert_bad_input(&["--backend", "vm", "decode", "--batch", "2", "--cache-len", "1,2,3"], "one per sequence");
    assert_bad_input(&["--backend", "vm", "decode", "--head-dim", "84"], "head_dim 84");
    assert_bad_input(&["--backend", "vm", "decode", "--splits", "0"], "a split count is `auto` or a count 1..=128");
    assert_bad_input(&["--backend", "vm", "decode", "--vary", "seq=1,2"], "decode --vary takes");
    assert_bad_input(&["--backend", "vm", "decode", "--window", "5"], "--window takes LEFT,RIGHT");
    assert_bad_input(&["--backend", "vm", "decode", "--window", "-2,0"], "window (-2, 0)");
    let o = memattn(&["--backend", "vm", "decode", "--window", "-1,0", "--cache-len", "40", "--repeats", "1"]);
    assert_eq!(code(&o), 0, "--window -1,0 (FlashAttention-2's causal spelling): {}", text(&o.stderr));
    let o = memattn(&["decode", "--help"]);
    assert_eq!(code(&o), 0);
    let h = text(&o.stdout);
    for needle in ["--cache-len", "--page-size", "--splits", "--new-tokens", "flash_attn_with_kvcache", "Examples:"] {
        assert!(h.contains(needle), "decode --help lacks {needle}");
    }
}

/// Writes a decode input file: batch 2, heads 4, heads_kv 2, d 64, paged cache of 3 pages of 8
/// (sequence 0: 9 keys in pages 2 and 0, sequence 1: 4 keys in page 1), one new token each.
fn write_inputs(path: &std::path::Path, table: &[u32], seqlens: &[i32]) {
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;
    let f32s = |n: usize, k: usize| -> Vec<u8> {
        (0..n).flat_map(|i| (((i * 37 + k * 11) % 29) as f32 / 14.0 - 1.0).to_le_bytes()).collect()
    };
    let (q, kc, vc, kn, vn) = (
        f32s(2 * 4 * 64, 1),
        f32s(3 * 8 * 2 * 64, 2),
        f32s(3 * 8 * 2 * 64, 3),
        f32s(2 * 2 * 64, 4),
        f32s(2 * 2 * 64, 5),
    );
    let t: Vec<u8> = table.iter().flat_map(|v| v.to_le_bytes()).collect();
    let l: Vec<u8> = seqlens.iter().flat_map(|v| v.to_le_bytes()).collect();
    let tensors = [
        ("q", TensorView::new(Dtype::F32, vec![2, 1, 4, 64], &q).unwrap()),
        ("k_cache", TensorView::new(Dtype::F32, vec![3, 8, 2, 64], &kc).unwrap()),
        ("v_cache", TensorView::new(Dtype::F32, vec![3, 8, 2, 64], &vc).unwrap()),
        ("k_new", TensorView::new(Dtype::F32, vec![2, 1, 2, 64], &kn).unwrap()),
        ("v_new", TensorView::new(Dtype::F32, vec![2, 1, 2, 64], &vn).unwrap()),
        ("block_table", TensorView::new(Dtype::U32, vec![2, 2], &t).unwrap()),
        ("cache_seqlens", TensorView::new(Dtype::I32, vec![2], &l).unwrap()),
    ];
    std::fs::write(path, safetensors::serialize(tensors, None).unwrap()).unwrap();
}

#[test]
fn decode_reads_inputs_and_refuses_bad_block_tables() {
    let dir =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("memattn-decode-inputs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (inp, out) = (dir.join("in.safetensors"), dir.join("out.safetensors"));
    // Sequence 0 has 9 keys + 1 new = 10 (pages 2, 0); sequence 1 has 4 + 1 (page 1).
    write_inputs(&inp, &[2, 0, 1, 7], &[9, 4]);
    let o = memattn(&[
        "--backend",
        "vm",
        "--json",
        "decode",
        "--inputs",
        inp.to_str().unwrap(),
        "--splits",
        "2",
        "--output",
        out.to_str().unwrap(),
        "--repeats",
        "1",
    ]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["verified"], true);
    assert_eq!(v["inputs"], "given");
    assert_eq!((v["heads_kv"].as_u64(), v["new_tokens"].as_u64()), (Some(2), Some(1)));
    assert_eq!(v["cache"]["page_size"], 8);
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("k_cache").unwrap().shape(), [3, 8, 2, 64]);
    // Page 7 of 3: refused, naming the rule.
    write_inputs(&inp, &[2, 7, 1, 0], &[9, 4]);
    assert_bad_input(&["--backend", "vm", "decode", "--inputs", inp.to_str().unwrap()], "past num_pages");
    write_inputs(&inp, &[2, 0, 1, 0], &[9, -1]);
    assert_bad_input(&["--backend", "vm", "decode", "--inputs", inp.to_str().unwrap()], "negative entry");
    // 9 + 1 keys in 2 pages of 8 fits; 17 + 1 does not.
    write_inputs(&inp, &[2, 0, 1, 0], &[17, 4]);
    assert_bad_input(&["--backend", "vm", "decode", "--inputs", inp.to_str().unwrap()], "needs 3 pages of 8");
    assert_bad_input(
        &["--backend", "vm", "decode", "--inputs", inp.to_str().unwrap(), "--heads", "4"],
        "cannot be used with",
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn plan_recommends_an_fp8_cache_and_its_decode_command_measures_the_planned_bytes() {
    let o = memattn(&[
        "--json",
        "plan",
        "--config",
        "tests/fixtures/configs/llama-3-8b.json",
        "--batch",
        "8",
        "--context",
        "131072",
        "--vram",
        "80GiB",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&o.stdout)));
    assert_eq!(v["best_change"]["flag"], "--kv-dtype fp8", "{v}");
    let cmd = v["fp8_decode"]["command"].as_str().expect("the plan prints the FP8 decode command");
    let per = v["fp8_decode"]["kv_bytes_per_token_per_layer"].as_u64().unwrap();
    // Llama-3-8B: 8 KV heads of head dim 128, one byte per element, K and V.
    assert_eq!(per, 2 * 8 * 128);
    let words: Vec<&str> = cmd.split_whitespace().collect();
    assert_eq!(words[..2], ["memattn", "decode"], "{cmd}");
    let mut args = vec!["--backend", "vm", "--json"];
    args.extend(&words[1..]);
    let o = memattn(&args);
    assert_eq!(code(&o), 0, "{cmd}: {}", text(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["verified"], true, "{r}");
    assert_eq!(r["kv_dtype"], "fp8");
    let tokens: u64 = r["cache_seqlens"].as_array().unwrap().iter().map(|l| l.as_u64().unwrap()).sum::<u64>()
        + r["batch"].as_u64().unwrap() * r["new_tokens"].as_u64().unwrap();
    assert_eq!(r["bytes"]["kv_used"].as_u64().unwrap(), tokens * per, "{}", r["bytes"]);
    assert!(r["verification"]["quantisation_rel_rms"].as_f64().unwrap() > 0.0);
    // Bad FP8 input is exit 2 naming the rule.
    assert_bad_input(
        &["--backend", "vm", "decode", "--kv-dtype", "fp8", "--k-scale", "0", "--cache-len", "4"],
        "k_scale[0] = 0",
    );
    assert_bad_input(
        &["--backend", "vm", "decode", "--kv-dtype", "fp9", "--cache-len", "4"],
        "fp8 (e4m3) and fp8_e5m2",
    );
    assert_bad_input(&["--backend", "vm", "decode", "--kv-dtype", "fp8", "--dtype", "f16"], "bf16");
}

/// `--inputs` with FlashAttention-2's other cache arguments in the file: `cache_batch_idx`,
/// `cache_leftpad`, `rotary_cos`/`rotary_sin` (with `--rotary-interleaved`) and `alibi_slopes`,
/// written from the library's random inputs (padding rows and unused slots NaN), verified; the
/// same file without `cache_leftpad` starts sequence 0 at its NaN padding (refused, exit 2).
#[test]
fn decode_inputs_with_slots_padding_rotary_and_alibi() {
    use memattn_cli::decode::{DecodeInputs, DecodeProblem, Rotary};
    use safetensors::tensor::TensorView;
    use safetensors::Dtype as St;
    let p = DecodeProblem {
        batch: 2,
        heads: 4,
        heads_kv: 2,
        head_dim: 64,
        seq_q: 2,
        cache_seqlens: vec![20, 9],
        seq_new: 2,
        dtype: memattn_cli::Dtype::F32,
        cache_batch_idx: Some(vec![2, 0]),
        cache_leftpad: Some(vec![5, 0]),
        rotary: Some(Rotary { dim: 32, interleaved: true }),
        alibi: true,
        ..DecodeProblem::default()
    };
    p.validate().unwrap();
    let x = DecodeInputs::random(&p, 7);
    let seq_cache = match x.layout {
        memattn_cli::decode::CacheLayout::Contiguous { seq_cache } => seq_cache as usize,
        _ => unreachable!("contiguous"),
    };
    let slots = x.k_cache.len() / (seq_cache * 2 * 64);
    let f = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let u = |v: &[u32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let (q, kc, vc, kn, vn) = (f(&x.q), f(&x.k_cache), f(&x.v_cache), f(&x.k_new), f(&x.v_new));
    let (cs, sn, al) = (f(&x.rotary_cos), f(&x.rotary_sin), f(&x.alibi_slopes));
    let (lens, idx, pad) = (u(&p.cache_seqlens), u(&[2, 0]), u(&[5, 0]));
    let rows = x.rotary_cos.len() / 16;
    let dir =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("memattn-decode-extras-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The same tables with 37 more rows (FlashAttention-2's seqlen_ro may exceed what a call
    // needs): their values are never read.
    let longer = |t: &[u8]| -> Vec<u8> { [t, &f(&vec![0.25f32; 37 * 16])[..]].concat() };
    let (cs_long, sn_long) = (longer(&cs), longer(&sn));
    let write = |name: &str, with_pad: bool, long: bool| {
        let (cs, sn, rows) = if long { (&cs_long, &sn_long, rows + 37) } else { (&cs, &sn, rows) };
        let mut t = vec![
            ("q", TensorView::new(St::F32, vec![2, 2, 4, 64], &q).unwrap()),
            ("k_cache", TensorView::new(St::F32, vec![slots, seq_cache, 2, 64], &kc).unwrap()),
            ("v_cache", TensorView::new(St::F32, vec![slots, seq_cache, 2, 64], &vc).unwrap()),
            ("k_new", TensorView::new(St::F32, vec![2, 2, 2, 64], &kn).unwrap()),
            ("v_new", TensorView::new(St::F32, vec![2, 2, 2, 64], &vn).unwrap()),
            ("cache_seqlens", TensorView::new(St::U32, vec![2], &lens).unwrap()),
            ("cache_batch_idx", TensorView::new(St::U32, vec![2], &idx).unwrap()),
            ("rotary_cos", TensorView::new(St::F32, vec![rows, 16], cs).unwrap()),
            ("rotary_sin", TensorView::new(St::F32, vec![rows, 16], sn).unwrap()),
            ("alibi_slopes", TensorView::new(St::F32, vec![4], &al).unwrap()),
        ];
        if with_pad {
            t.push(("cache_leftpad", TensorView::new(St::U32, vec![2], &pad).unwrap()));
        }
        let path = dir.join(name);
        std::fs::write(&path, safetensors::serialize(t, None).unwrap()).unwrap();
        path
    };
    let (good, nopad) = (write("good.safetensors", true, false), write("nopad.safetensors", false, false));
    let long = write("long-rotary.safetensors", true, true);
    let run = |path: &std::path::Path, extra: &[&str]| {
        let base = ["--backend", "vm", "--json", "decode", "--inputs", path.to_str().unwrap(), "--repeats", "1"];
        memattn(&[&base[..], extra].concat())
    };
    let o = run(&good, &["--rotary-interleaved"]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!((v["verified"].as_bool(), v["verification"]["cache_ok"].as_bool()), (Some(true), Some(true)));
    assert_eq!(v["alibi"], true);
    // Longer rotary tables: accepted, and the result is the same (once refused, exit 2).
    let o = run(&long, &["--rotary-interleaved"]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let vl: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(vl["verified"], true, "{vl}");
    assert_eq!(vl["verification"], v["verification"], "the extra rows change nothing");
    // Without cache_leftpad sequence 0's keys start at its NaN padding rows: refused (exit 2).
    let o = run(&nopad, &["--rotary-interleaved"]);
    assert_eq!(code(&o), 2, "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("non-finite value in key 0 of sequence 0"), "{}", text(&o.stderr));
    let names: Vec<&str> = v["launches"].as_array().unwrap().iter().map(|l| l["kernel"].as_str().unwrap()).collect();
    assert_eq!(names[0], "decode_rotary_f32", "{names:?}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn on_sm90_the_e4m3_decode_widens_with_cvt_and_fewer_instructions() {
    // The same call on the VM modelling sm_80 and sm_90: the sm_90a module's e4m3 row runs on
    // sm_90 (cvt.rn.f16x2.e4m3x2) and reads the same bytes as the sm_80 row (integer widening);
    // e5m2 and bf16 keep their sm_80 rows.
    let run = |arch: &str, kv: &[&str]| -> serde_json::Value {
        let mut a = vec!["--backend", "vm", "--vm-arch", arch, "--json", "decode", "--heads", "8", "--heads-kv", "2"];
        a.extend(["--head-dim", "128", "--cache-len", "300,41", "--new-tokens", "2", "--page-size", "16"]);
        a.extend(kv);
        let o = memattn(&a);
        assert_eq!(code(&o), 0, "{arch} {kv:?}: {}", text(&o.stderr));
        let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(r["verified"], true, "{arch} {kv:?}: {r}");
        r
    };
    let fwd = |r: &serde_json::Value| -> String {
        let l = r["launches"].as_array().unwrap();
        l.iter().map(|x| x["kernel"].as_str().unwrap().to_string()).find(|k| k.starts_with("decode_mma")).unwrap()
    };
    let (e80, e90) = (run("sm_80", &["--kv-dtype", "fp8"]), run("sm_90", &["--kv-dtype", "fp8"]));
    assert_eq!(fwd(&e80), "decode_mma_fp8_e4m3_d128");
    assert_eq!(fwd(&e90), "decode_mma_fp8_e4m3_sm90_d128");
    assert_eq!(e80["verification"]["cache_ok"], true);
    assert_eq!(e90["verification"]["cache_ok"], true);
    let n = |r: &serde_json::Value| r["vm_thread_instructions"].as_u64().unwrap();
    assert!(n(&e90) < n(&e80), "sm_90 {} against sm_80 {}", n(&e90), n(&e80));
    assert_eq!(fwd(&run("sm_90", &["--kv-dtype", "fp8_e5m2"])), "decode_mma_fp8_e5m2_d128");
    assert_eq!(fwd(&run("sm_90", &["--dtype", "bf16"])), "decode_mma_bf16_d128");
}

#[test]
fn decode_shared_prefix_reads_the_prefix_once_per_block_of_rows() {
    let o = memattn(&[
        "--backend",
        "vm",
        "--json",
        "decode",
        "--dtype",
        "bf16",
        "--batch",
        "16",
        "--heads",
        "8",
        "--heads-kv",
        "2",
        "--cache-len",
        "1100,1030,1101,1200,1090,1025,1088,1150,1100,1030,1101,1200,1090,1025,1088,1150",
        "--new-tokens",
        "1",
        "--sinks",
        "--shared-prefix",
        "1024",
        "--repeats",
        "1",
        "--warmup",
        "0",
    ]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    assert_eq!(v["verified"], true, "{}", v["verification"]);
    assert_eq!(v["prefix"], 1024);
    assert_eq!(v["suffix_seqlens"][1], 6);
    assert_eq!(v["kernel"], "mma");
    // The prefix's K and V: 2 x 1024 keys x 2 KV heads x 64 x 2 bytes = 512 KiB; reading it once
    // per sequence costs 16 times that. The launch over the prefix packs 16 x 4 query rows per KV
    // head into 4 tiles of 16 and reads the prefix once per tile.
    let prefix = 2 * 1024 * 2 * 64 * 2u64;
    assert_eq!(v["prefix_bytes"], prefix);
    assert_eq!(v["per_request_prefix_bytes"], 16 * prefix);
    let first = v["prefix_launch_bytes_read"].as_u64().unwrap();
    assert!((4 * prefix..4 * prefix + prefix / 2).contains(&first), "{first}");
    assert!(v["bytes_read"].as_u64().unwrap() < 16 * prefix / 2, "{}", v["bytes_read"]);
    let names: Vec<&str> = v["launches"].as_array().unwrap().iter().map(|l| l["kernel"].as_str().unwrap()).collect();
    assert_eq!(names[0], "decode_mma_bf16_d64");
    assert_eq!(names.last(), Some(&"merge_states_bf16"));

    // The text report prints the bytes next to the per-request cost.
    let o =
        memattn(&["--backend", "vm", "decode", "--batch", "3", "--cache-len", "100,20,37", "--shared-prefix", "20"]);
    assert_eq!(code(&o), 0, "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert!(out.contains("verified     PASS"), "{out}");
    assert!(out.contains("reading the prefix once per sequence"), "{out}");

    assert_bad_input(
        &["--backend", "vm", "decode", "--batch", "3", "--cache-len", "100,20,37", "--shared-prefix", "21"],
        "sequence 1 caches only 20 keys",
    );
    assert_bad_input(&["--backend", "vm", "decode", "--cache-len", "100", "--shared-prefix", "0"], "at least 1");
    assert_bad_input(
        &["--backend", "vm", "decode", "--cache-len", "100", "--shared-prefix", "5", "--page-size", "16"],
        "cannot be used with",
    );
    assert_bad_input(
        &["--backend", "vm", "decode", "--seq-q", "4", "--cache-len", "100", "--shared-prefix", "99"],
        "at least seq_q - 1 = 3",
    );
}
