//! `memattn plan` on the published model configs (exact bytes), its bad inputs, and the `--save`
//! evidence of every outcome (exit codes 0, 1, 2 and 3) with `evidence show | diff | rerun`.

use crate::common;
use common::*;
use std::path::PathBuf;

fn fixture(name: &str) -> String {
    format!("{}/tests/fixtures/configs/{name}.json", env!("CARGO_MANIFEST_DIR"))
}
fn tmp(name: &str) -> PathBuf {
    let d =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("memattn-plan-evidence-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let p = d.join(name);
    let _ = std::fs::remove_file(&p);
    p
}

/// The published model, as the KV-cache formula sees it: (layers, heads, heads_kv, head_dim,
/// layers with a window, window, published parameter count, bytes per weight of torch_dtype).
struct Card {
    name: &'static str,
    layers: u64,
    heads: u64,
    heads_kv: u64,
    head_dim: u64,
    windowed: u64,
    window: u64,
    params: u64,
    dtype_bytes: u64,
}

const CARDS: [Card; 4] = [
    Card {
        name: "llama-3-8b",
        layers: 32,
        heads: 32,
        heads_kv: 8,
        head_dim: 128,
        windowed: 0,
        window: 0,
        params: 8_030_261_248,
        dtype_bytes: 2,
    },
    Card {
        name: "mistral-7b-v0.1",
        layers: 32,
        heads: 32,
        heads_kv: 8,
        head_dim: 128,
        windowed: 32,
        window: 4096,
        params: 7_241_732_096,
        dtype_bytes: 2,
    },
    // use_sliding_window is false: the 131072-token window is not applied.
    Card {
        name: "qwen2-7b",
        layers: 28,
        heads: 28,
        heads_kv: 4,
        head_dim: 128,
        windowed: 0,
        window: 0,
        params: 7_615_616_512,
        dtype_bytes: 2,
    },
    // Local (4096-token window) and global layers alternate; torch_dtype float32.
    Card {
        name: "gemma-2-9b",
        layers: 42,
        heads: 16,
        heads_kv: 8,
        head_dim: 256,
        windowed: 21,
        window: 4096,
        params: 9_241_705_984,
        dtype_bytes: 4,
    },
];

#[test]
fn plan_on_four_model_configs_has_the_exact_bytes() {
    for c in &CARDS {
        for (batch, context) in [(8u64, 32768u64), (3, 1000)] {
            let (b, ctx) = (batch.to_string(), context.to_string());
            let o = memattn(&[
                "--json",
                "plan",
                "--config",
                &fixture(c.name),
                "--batch",
                &b,
                "--context",
                &ctx,
                "--vram",
                "80GiB",
            ]);
            assert_eq!(code(&o), 0, "{}: {}", c.name, stderr(&o));
            let v = json(&o);
            // KV cache = 2 x layers x heads_kv x head_dim x context x batch x bytes, windowed layers capped.
            let full = c.layers - c.windowed;
            let capped = if c.windowed > 0 { context.min(c.window) } else { 0 };
            let kv = 2 * c.heads_kv * c.head_dim * (full * context + c.windowed * capped) * batch * c.dtype_bytes;
            for k in ["naive", "flash"] {
                assert_eq!(v[k]["kv_cache"], kv, "{} {k} batch {batch} context {context}", c.name);
                assert_eq!(v[k]["params"], c.params, "{}", c.name);
                assert_eq!(v[k]["weights"], c.params * c.dtype_bytes, "{}", c.name);
            }
            // Attention workspace of one decode step: S (f32) for naive, LSE (f32) for both.
            // Keys of the longest layer: the window when every layer has one.
            let keys = if c.windowed == c.layers { context.min(c.window) } else { context };
            assert_eq!(v["naive"]["workspace"]["scores"], 4 * batch * c.heads * keys, "{}", c.name);
            assert_eq!(v["flash"]["workspace"]["scores"], 0);
            assert_eq!(v["flash"]["workspace"]["total"], 4 * batch * c.heads, "{}", c.name);
            let t = &v["flash"];
            let sum = ["weights", "kv_cache"].iter().map(|k| t[*k].as_u64().unwrap()).sum::<u64>()
                + t["workspace"]["total"].as_u64().unwrap()
                + t["activation"]["bytes"].as_u64().unwrap();
            assert_eq!(t["total"], sum);
            assert_eq!(v["limit_bytes"], 80u64 << 30);
        }
    }
}

#[test]
fn plan_llama_decode_names_the_kv_cache_and_the_one_option() {
    let o =
        memattn(&["plan", "--config", &fixture("llama-3-8b"), "--batch", "8", "--context", "32768", "--vram", "80GiB"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let s = stdout(&o);
    assert!(
        s.contains("KV cache (8 sequences)                                     32.00 GiB          32.00 GiB"),
        "{s}"
    );
    assert!(s.contains("dominant term: KV cache, 32.00 GiB"), "{s}");
    assert!(s.contains("naive -> flash changes the total by 32.00 MiB (0.07%)"), "{s}");
    assert!(s.contains("largest batch that fits: 16"), "{s}");
    assert!(s.contains("the one option that changes the outcome most: --kv-dtype fp8 -> total 30.96 GiB"), "{s}");
    assert!(s.contains("beyond max_position_embeddings 8192"), "{s}");
    // The same workload from flags: the same KV cache.
    let o = memattn(&[
        "--json",
        "plan",
        "--layers",
        "32",
        "--heads",
        "32",
        "--heads-kv",
        "8",
        "--head-dim",
        "128",
        "--batch",
        "8",
        "--context",
        "32768",
        "--vram",
        "80GiB",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(json(&o)["flash"]["kv_cache"], 32u64 << 30);
    assert_eq!(json(&o)["flash"]["weights"], 0);
}

#[test]
fn plan_that_cannot_fit_at_batch_1_exits_2_naming_the_term() {
    let o =
        memattn(&["plan", "--config", &fixture("llama-3-8b"), "--batch", "8", "--context", "32768", "--vram", "12GiB"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("does not fit at batch 1: the KV cache alone needs 32.00 GiB (34359738368 bytes)"), "{e}");
    assert!(e.contains("12884901888 bytes"), "{e}");
    let o = memattn(&["--json", "plan", "--config", &fixture("llama-3-8b"), "--context", "8192", "--vram", "12GiB"]);
    assert_eq!(code(&o), 2);
    assert_eq!(json(&o)["exit_code"], 2);
    assert!(json(&o)["error"].as_str().unwrap().contains("the weights alone needs 14.96 GiB"));
}

#[test]
fn plan_bad_input_exits_2_naming_the_field() {
    let good = std::fs::read_to_string(fixture("llama-3-8b")).unwrap();
    let cases: Vec<(String, &str)> = vec![
        (
            good.replace("\"num_attention_heads\": 32", "\"num_attention_heads\": 0"),
            "num_attention_heads must be at least 1",
        ),
        (
            good.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5"),
            "heads_kv 5 does not divide heads 32",
        ),
        (good.replace("  \"vocab_size\": 128256\n", "  \"x\": 1\n"), "missing field `vocab_size`"),
        (good.replace("\"hidden_size\": 4096", "\"hidden_size\": \"big\""), "field `hidden_size` must be"),
        (good[..200].to_string(), "is not JSON: line"),
    ];
    for (i, (text, needle)) in cases.iter().enumerate() {
        let p = tmp(&format!("bad-config-{i}.json"));
        std::fs::write(&p, text).unwrap();
        let o = memattn(&["plan", "--config", p.to_str().unwrap(), "--context", "1024", "--vram", "80GiB"]);
        assert_eq!(code(&o), 2, "case {i}: {}", stderr(&o));
        assert!(stderr(&o).contains(needle), "case {i}: want `{needle}` in {}", stderr(&o));
    }
    // An unknown model type is fine: counted as a Llama-style block, and the plan says so.
    let p = tmp("mystery.json");
    std::fs::write(&p, good.replace("\"model_type\": \"llama\"", "\"model_type\": \"mystery\"")).unwrap();
    let o = memattn(&["--json", "plan", "--config", p.to_str().unwrap(), "--context", "1024", "--vram", "80GiB"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["flash"]["params"], 8_030_261_248u64, "explicit tie_word_embeddings false is kept");
    assert!(v["notes"].as_array().unwrap().iter().any(|n| n.as_str().unwrap().contains("Llama-style block")), "{v}");
    let llama = fixture("llama-3-8b");
    for (args, needle) in [
        (vec!["plan", "--config", "/nonexistent/config.json", "--context", "8"], "cannot read config"),
        (vec!["plan", "--config", &llama, "--context", "0"], "--context must be at least 1"),
        (vec!["plan", "--config", &llama, "--context", "8", "--vram", "lots"], "--vram: `lots` is not a size"),
        (vec!["plan", "--config", &llama, "--context", "8", "--vram", "80G"], "unknown unit `G`"),
        (vec!["plan", "--config", &llama, "--context", "8", "--kv-dtype", "int3"], "--kv-dtype: unknown type"),
        (vec!["plan", "--heads", "32", "--head-dim", "128", "--context", "8"], "--layers is needed"),
        (
            vec!["plan", "--layers", "2", "--heads", "32", "--head-dim", "128", "--hidden", "4096", "--context", "8"],
            "missing --intermediate, --vocab",
        ),
    ] {
        let o = memattn(&args);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(needle), "{args:?}: want `{needle}` in {}", stderr(&o));
    }
}

#[test]
fn plan_verify_measures_what_it_planned() {
    let o = memattn(&[
        "--json",
        "plan",
        "--config",
        &fixture("mistral-7b-v0.1"),
        "--batch",
        "2",
        "--context",
        "8192",
        "--vram",
        "24GiB",
        "--verify",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    let runs = v["verify"]["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for r in runs {
        // Mistral groups 4 query heads per KV head: the scaled layer keeps one group.
        let (b, h, hkv, sq, skv, d) = (2u64, 4u64, 1u64, 1u64, 200u64, 128u64);
        assert_eq!(r["shape"]["seq_kv"], skv);
        assert_eq!((r["shape"]["heads"].as_u64(), r["shape"]["heads_kv"].as_u64()), (Some(h), Some(hkv)), "{r}");
        // Q, O (seq_q rows, h heads) and K, V (seq_kv rows, hkv heads) in bf16, LSE f32, S f32
        // for naive only.
        let s = if r["kernel"] == "naive" { 4 * b * h * sq * skv } else { 0 };
        let expected = 2 * (2 * b * sq * h * d) + 2 * (2 * b * skv * hkv * d) + 4 * b * h * sq + s;
        assert_eq!(r["plan_bytes"]["total"], expected, "{r}");
        assert_eq!(r["measured_peak_bytes"], expected, "{r}");
        assert_eq!(r["verified"], true);
    }
    assert_eq!(v["verify"]["passed"], true);
}

#[test]
fn plan_plot_writes_png_and_svg() {
    for ext in ["png", "svg"] {
        let p = tmp(&format!("plan.{ext}"));
        let o = memattn(&[
            "plan",
            "--config",
            &fixture("qwen2-7b"),
            "--context",
            "4096",
            "--vram",
            "24GiB",
            "--plot",
            p.to_str().unwrap(),
        ]);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        let bytes = std::fs::read(&p).unwrap();
        if ext == "png" {
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        } else {
            let s = String::from_utf8(bytes).unwrap();
            assert!(s.contains("limit 24.00 GiB") && s.contains("KV cache") && s.contains("GiB"), "{s:.300}");
        }
    }
    let o =
        memattn(&["plan", "--config", &fixture("qwen2-7b"), "--context", "4096", "--vram", "24GiB", "--plot", "p.jpg"]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains(".svg or .png"));
}

#[test]
fn evidence_keeps_every_outcome_and_show_diff_rerun_read_it() {
    let path = tmp("evidence.jsonl");
    let p = path.to_str().unwrap();
    let run = |extra: &[&str]| memattn(&[&["--save", p, "--backend", "vm"][..], extra].concat());
    // 1: success.
    let o = run(&["run", "--seq", "40", "--heads", "2"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    // 2: a refusal: naive needs more than the simulated 1 MiB.
    let o = run(&["--vm-memory-mib", "1", "run", "--kernel", "naive", "--seq", "300", "--heads", "2"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    // 3: a device error: a PTX module that does not load.
    let bad_ptx = tmp("bad.ptx");
    std::fs::write(&bad_ptx, ".version 8.0\n.target sm_80\n.entry broken( {\n").unwrap();
    let o = run(&["--ptx", bad_ptx.to_str().unwrap(), "run", "--seq", "40", "--heads", "2"]);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    // 4: a failed verification: LSE in log2 instead of natural log.
    let broken = memattn_cli::ptx::EMBEDDED_PTX.replace("0f3F317218", "0f3F800000");
    let wrong = tmp("wrong.ptx");
    std::fs::write(&wrong, &broken).unwrap();
    let o = run(&["--ptx", wrong.to_str().unwrap(), "run", "--seq", "40", "--heads", "2"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));

    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.iter().map(|l| l["exit_code"].as_i64().unwrap()).collect::<Vec<_>>(), vec![0, 2, 3, 1]);
    // Success: expected and observed bytes agree.
    assert_eq!(lines[0]["expected"]["analytic_bytes"]["total"], lines[0]["observed"]["peak_device_bytes"]);
    // Refusal: what it expected to need and what the device had free.
    assert_eq!(lines[1]["expected"]["analytic_bytes"]["scores"], 4 * 2 * 300 * 300);
    assert_eq!(lines[1]["observed"]["device"]["free_bytes"], 1 << 20);
    assert!(
        lines[1]["message"].as_str().unwrap().contains("of device memory, more than the 1048576 bytes"),
        "{}",
        lines[1]
    );
    assert!(lines[2]["message"].as_str().unwrap().contains("PTX does not load"), "{}", lines[2]);
    assert!(lines[3]["message"].as_str().unwrap().starts_with("verification failed"), "{}", lines[3]);
    // The PTX hash is the one of the text that ran.
    assert_eq!(lines[0]["ptx"]["sha256"], memattn_cli::ptx::PtxSource::embedded().sha256.as_str());
    assert_eq!(lines[3]["ptx"]["sha256"], kernels_gpu::artifacts::sha256_hex(broken.as_bytes()).as_str());
    assert_eq!(
        lines[2]["ptx"]["sha256"],
        kernels_gpu::artifacts::sha256_hex(std::fs::read(&bad_ptx).unwrap().as_slice()).as_str()
    );

    let o = memattn(&["evidence", "show", p]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let s = stdout(&o);
    assert!(s.contains("4 records"), "{s}");
    assert!(
        s.lines().any(|l| l.starts_with("2 ") && l.contains("run") && l.contains("naive needs an estimated")),
        "{s}"
    );

    let o = memattn(&["evidence", "diff", p, "1", "4"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let s = stdout(&o);
    assert!(s.contains("options changed: (nothing) -> --ptx"), "{s}");
    assert!(s.contains("PTX changed"), "{s}");
    assert!(s.lines().any(|l| l.starts_with("exit code") && l.contains('0') && l.contains('1')), "{s}");

    // Rerun of the refusal: the same outcome, appended as line 5.
    let o = memattn(&["evidence", "rerun", p, "2"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stdout(&o).contains("exit code: run 2 2, rerun 2 (same)"), "{}", stdout(&o));
    assert!(stdout(&o).contains("options: the same command line"), "{}", stdout(&o));
    assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 5);

    // A plan refused at batch 1 is kept too, with the term and the bytes.
    let o = memattn(&["--save", p, "plan", "--config", &fixture("llama-3-8b"), "--context", "8192", "--vram", "12GiB"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    let last: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(&path).unwrap().lines().last().unwrap()).unwrap();
    assert_eq!(last["exit_code"], 2);
    assert!(last["message"].as_str().unwrap().contains("does not fit at batch 1: the weights alone needs 14.96 GiB"));
    assert_eq!(last["expected"]["limit_bytes"], 12u64 << 30);

    // A command line that does not parse (no --context) is kept as a refusal too.
    let o = memattn(&["--save", p, "plan", "--config", &fixture("llama-3-8b")]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    let last: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(&path).unwrap().lines().last().unwrap()).unwrap();
    assert_eq!(last["exit_code"], 2);
    assert!(last["message"].as_str().unwrap().contains("--context"), "{last}");

    let o = memattn(&["evidence", "diff", p, "1", "9"]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("no record on line 9"), "{}", stderr(&o));
}

#[test]
fn evidence_show_names_the_line_that_is_not_json() {
    let path = tmp("broken.jsonl");
    std::fs::write(
        &path,
        "{\"command\": \"run\", \"exit_code\": 0}\nnot json at all\n{\"command\": \"doctor\", \"exit_code\": 0}\n",
    )
    .unwrap();
    let o = memattn(&["evidence", "show", path.to_str().unwrap()]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("line 2"), "{}", stderr(&o));
    assert!(stdout(&o).contains("2 records"), "{}", stdout(&o));
}

#[test]
fn sweep_plot_shows_bytes_the_limit_and_what_did_not_fit() {
    let p = tmp("sweep.svg");
    let o = memattn(&[
        "--backend",
        "vm",
        "--vm-memory-mib",
        "1",
        "sweep",
        "--vary",
        "seq=128,256",
        "--heads",
        "2",
        "--plot",
        p.to_str().unwrap(),
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).contains("needs 1.00 MiB"), "{}", stdout(&o));
    let svg = std::fs::read_to_string(&p).unwrap();
    // Title with shape, dtype, backend and limit; memory ticks in KiB/MiB; the limit line's label.
    assert!(svg.contains("batch 1 heads 2 head_dim 64 f32, vm (VM wall clock), device limit 1.00 MiB"), "{svg:.600}");
    for tick in [">\n256 KiB\n<", ">\n512 KiB\n<", ">\n1 MiB\n<"] {
        assert!(svg.contains(tick), "{tick}");
    }
    assert!(svg.contains(">\ndevice limit 1.00 MiB\n<"), "the limit line's legend");
    // The naive run at 256 that did not fit: one hollow marker (no fill), drawn in naive's colour.
    assert_eq!(svg.matches(r##"fill="none" stroke="#D62728""##).count(), 1);
}

/// `plan --cp`: the per-device terms add up, the KV slice is the single-device cache over N,
/// and the smallest group that fits is the first N whose total is under the limit.
#[test]
fn plan_cp_gives_per_device_memory_and_the_smallest_group() {
    let o = memattn(&[
        "--json",
        "plan",
        "--config",
        &fixture("llama-3-8b"),
        "--context",
        "1048576",
        "--cp",
        "8",
        "--vram",
        "80GiB",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    let t = &v["cp"]["per_device"];
    let n = |k: &str| t[k].as_u64().unwrap();
    assert_eq!(n("total"), n("weights") + n("kv_cache") + n("ring_buffers") + n("merge_state") + n("activation"));
    assert_eq!(n("weights"), v["flash"]["weights"].as_u64().unwrap());
    assert_eq!(n("kv_cache"), v["flash"]["kv_cache"].as_u64().unwrap() / 8);
    // Llama 3 8B: 32 layers x 2 x 8 KV heads x 128 x 2 B = 128 KiB per token; one layer's two
    // blocks of 2^20 / 8 tokens.
    assert_eq!(n("ring_buffers"), 2 * (2 * 8 * 128 * 2) * (1 << 17));
    assert_eq!(v["cp"]["fits"], true);
    let smallest = v["cp"]["smallest_devices"].as_u64().unwrap();
    let limit = v["limit_bytes"].as_u64().unwrap();
    let total_at = |cp: u64| {
        let o = memattn(&[
            "--json",
            "plan",
            "--config",
            &fixture("llama-3-8b"),
            "--context",
            "1048576",
            "--cp",
            &cp.to_string(),
            "--vram",
            "80GiB",
        ]);
        json(&o)["cp"]["per_device"]["total"].as_u64().unwrap()
    };
    assert!(total_at(smallest) <= limit && total_at(smallest - 1) > limit, "smallest {smallest}");
    // One device short: exit 2 naming the smallest group.
    let o = memattn(&[
        "plan",
        "--config",
        &fixture("llama-3-8b"),
        "--context",
        "1048576",
        "--cp",
        &(smallest - 1).to_string(),
        "--vram",
        "80GiB",
    ]);
    assert_eq!(code(&o), 2);
    assert!(
        stderr(&o).contains(&format!("the smallest context-parallel group that fits is {smallest} devices")),
        "{}",
        stderr(&o)
    );
    let o = memattn(&["plan", "--config", &fixture("llama-3-8b"), "--context", "1024", "--cp", "0"]);
    assert_eq!(code(&o), 2);
}

/// A record whose PTX hash holds multi-byte characters (an evidence file edited by hand) is
/// shown, its first 12 characters in the table, where cutting it at byte 12 panicked (exit 3).
#[test]
fn evidence_show_takes_any_text_in_a_record() {
    let f = tmp("multibyte-evidence.jsonl");
    std::fs::write(
        &f,
        "{\"command\": \"memattn run\", \"exit_code\": 0, \"ptx\": {\"sha256\": \"a€€€€€€€€€€€€€€\"}}\n",
    )
    .unwrap();
    let o = memattn(&["evidence", "show", f.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).contains("a€€€€€€€€€€€"), "{}", stdout(&o));
}

/// `evidence rerun` refuses a record that writes a file by any option of the command's
/// definition — here `draw --out`, which the hand-kept list lacked, so the replay replaced the
/// file — and replays it with --allow-writes.
#[test]
fn evidence_rerun_refuses_every_writing_option_without_allow_writes() {
    let ev = tmp("draw-evidence.jsonl");
    let svg = tmp("draw-evidence.svg");
    let _ = std::fs::remove_file(&ev);
    let o = memattn(&["--save", ev.to_str().unwrap(), "draw", "tiling", "--out", svg.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    std::fs::write(&svg, "kept").unwrap();
    let o = memattn(&["evidence", "rerun", ev.to_str().unwrap(), "1"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("--out") && stderr(&o).contains("--allow-writes"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(&svg).unwrap(), "kept", "the file was not touched");
    let o = memattn(&["evidence", "rerun", ev.to_str().unwrap(), "1", "--allow-writes"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));
}
