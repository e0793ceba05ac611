//! End-to-end tests of `memattn decode` in the VM: the verified run and its JSON, `--vary`,
//! `--output`, and bad input (exit 2 naming the rule, never a panic).

use std::process::{Command, Output};

fn memattn(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memattn")).args(args).env("MEMATTN_TEST", "1").output().expect("spawn memattn")
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("exited normally (no signal)")
}

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

    let dir = std::env::temp_dir().join(format!("memattn-decode-cli-{}", std::process::id()));
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
fn decode_bad_input_exits_2_naming_the_rule() {
    assert_bad_input(&["--backend", "vm", "decode", "--page-size", "0"], "page_size must be >= 1");
    assert_bad_input(&["--backend", "vm", "decode", "--heads", "6", "--heads-kv", "4"], "mismatched heads");
    assert_bad_input(&["--backend", "vm", "decode", "--batch", "2", "--cache-len", "1,2,3"], "one per sequence");
    assert_bad_input(&["--backend", "vm", "decode", "--head-dim", "96"], "head_dim 96");
    assert_bad_input(&["--backend", "vm", "decode", "--splits", "0"], "--splits takes");
    assert_bad_input(&["--backend", "vm", "decode", "--vary", "seq=1,2"], "decode --vary takes");
    let o = memattn(&["decode", "--help"]);
    assert_eq!(code(&o), 0);
    let h = text(&o.stdout);
    for needle in ["--cache-len", "--page-size", "--splits", "--new-tokens", "flash_attn_with_kvcache", "Examples:"] {
        assert!(h.contains(needle), "decode --help lacks {needle}");
    }
}
