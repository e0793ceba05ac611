//! End-to-end tests of the `memattn` binary: exit codes, JSON shape, files, and (in the VM) the
//! main commands. Every exit code of the contract is exercised here.

use crate::common;
use common::*;
use memattn_cli::inputs::Qkv;
use memattn_cli::problem::Problem;
use memattn_cli::reference::{reference, RowSelection};
use memattn_cli::safetensors_io::{write_qkv, write_qkv_as, FileShape};
use memattn_cli::Dtype;
use std::path::PathBuf;

fn tmp(name: &str) -> PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("memattn-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// Exit 2 with a message on stderr naming `needle`, and no panic.
fn assert_bad_input(args: &[&str], needle: &str) {
    let o = memattn(args);
    assert_eq!(code(&o), 2, "{args:?}: stdout {} stderr {}", stdout(&o), stderr(&o));
    let err = stderr(&o);
    assert!(err.contains(needle), "{args:?}: stderr does not mention `{needle}`:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
}

fn no_gpu() -> bool {
    memattn_cli::device::cuda::probe().is_err()
}

// ---- exit 0: help, doctor, kernels ----

#[test]
fn help_teaches_and_exits_0() {
    let o = memattn(&["--help"]);
    assert_eq!(code(&o), 0);
    let s = stdout(&o);
    for needle in ["--backend", "--json", "--ptx", "compare", "sweep", "doctor", "Examples:", "Exit codes"] {
        assert!(s.contains(needle), "--help lacks {needle}:\n{s}");
    }
    let o = memattn(&["run", "--help"]);
    assert_eq!(code(&o), 0);
    for needle in ["--seq-q", "--seq-kv", "--head-dim", "--causal", "--inputs", "--output", "bottom-right"] {
        assert!(stdout(&o).contains(needle), "run --help lacks {needle}");
    }
}

#[test]
fn doctor_reports_gpu_or_why_not_and_the_ptx() {
    let o = memattn(&["doctor"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let s = stdout(&o);
    assert!(s.contains("== PTX") && s.contains("sha256") && s.contains("next step"), "{s}");
    let o = memattn(&["--json", "doctor"]);
    assert_eq!(code(&o), 0);
    let v = json(&o);
    assert!(v["cuda"]["available"].is_boolean());
    if no_gpu() {
        assert_eq!(v["cuda"]["available"], false);
        assert!(
            v["cuda"]["reason"].as_str().unwrap().contains("libcuda")
                || v["cuda"]["reason"].as_str().unwrap().contains("no device")
        );
    }
    assert_eq!(v["ptx"]["target"], "sm_80");
    // Every entry point of the ABI is in the committed module.
    let n = v["ptx"]["kernels"].as_array().unwrap().len();
    assert_eq!(
        n,
        kernels_gpu::KernelId::ALL
            .into_iter()
            .filter(|k| k.variant().module() == kernels_gpu::variants::PtxModule::Sm80)
            .count(),
        "the committed PTX and the variant table disagree: every kernel is one row of \
         kernels-gpu/src/variants.rs (add it there, then cargo xtask build-ptx)"
    );
    assert!(v["next_step"].as_str().unwrap().len() > 10);
    // The global flag also works after the subcommand.
    let o = memattn(&["doctor", "--json"]);
    assert_eq!(code(&o), 0);
    json(&o);
}

#[test]
fn kernels_lists_entries_params_and_ptxas_resources() {
    let o = memattn(&["kernels", "--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    let ks = v["kernels"].as_array().unwrap();
    let flash = ks.iter().find(|k| k["name"] == "flash_fwd_f32_d64").expect("flash d64 listed");
    assert!(flash["params"][0]["decl"].as_str().unwrap().contains("[264]"));
    if memattn_cli::ptx::ptxas_report().unwrap().is_some() {
        let res = flash["ptxas"].as_array().unwrap();
        assert!(res.iter().any(|r| r["arch"] == "sm_80" && r["dynamic_smem_bytes"] == 32768));
    }
    let o = memattn(&["kernels"]);
    assert!(stdout(&o).contains("naive_softmax_f32"));
    assert!(stdout(&o).contains("hmma"), "{}", stdout(&o));
    assert_eq!(v["missing"].as_array().unwrap().len(), 0);
    for name in ["flash_fwd_bf16_d64", "flash_fwd_bf16_d128", "flash_fwd_f16_d64", "flash_fwd_f16_d128"] {
        let k = ks.iter().find(|k| k["name"] == name).unwrap_or_else(|| panic!("{name} listed"));
        assert!(k["params"][0]["decl"].as_str().unwrap().contains("[264]"));
        assert!(k["vm_instructions"].as_u64().unwrap() > 0, "{name}: the VM decodes it");
        let report = memattn_cli::ptx::ptxas_report().unwrap();
        if report.as_ref().is_some_and(|r| r.kernels.iter().any(|r| r.name == name)) {
            // ptxas resources with the HMMA count: a tensor-core kernel without HMMA is a bug.
            let res = k["ptxas"].as_array().unwrap();
            assert!(res.iter().any(|r| r["arch"] == "sm_80"), "{name}: {res:?}");
            assert!(res.iter().all(|r| r["hmma"].as_u64().unwrap_or(0) > 0), "{name}: {res:?}");
        }
    }
}

#[test]
fn kernels_json_reports_each_tile_from_the_variant_table() {
    let o = memattn(&["--json", "kernels"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    let ks = v["kernels"].as_array().unwrap();
    let tile =
        |name: &str| ks.iter().find(|k| k["name"] == name).unwrap_or_else(|| panic!("{name} listed"))["tile"].clone();
    // Tensor-core rows for every head dim and both 16-bit types; shared memory is Q + K + V tiles
    // of 2-byte elements, (br + 2 bc) d 2 bytes, recomputed here from the reported br and bc.
    for dtype in ["bf16", "f16"] {
        for (d, br, bc, warps) in
            [(32, 128, 64, 4), (64, 128, 64, 4), (96, 64, 64, 4), (128, 64, 64, 4), (192, 64, 64, 4), (256, 128, 64, 8)]
        {
            let t = tile(&format!("flash_fwd_{dtype}_d{d}"));
            assert_eq!(
                (t["br"].as_u64(), t["bc"].as_u64(), t["warps"].as_u64()),
                (Some(br), Some(bc), Some(warps)),
                "d{d}: {t}"
            );
            assert_eq!(t["smem_bytes"].as_u64(), Some((br + 2 * bc) * d * 2), "d{d}: {t}");
            // At most the sm_80 opt-in limit (163 KiB); above 48 KiB the hosts request the opt-in.
            assert!(t["smem_bytes"].as_u64().unwrap() <= 163 * 1024, "d{d}: {t}");
        }
    }
    // f32 SIMT: K + V tiles of 4-byte elements.
    let t = tile("flash_fwd_f32_d96");
    assert_eq!(
        (t["br"].as_u64(), t["bc"].as_u64(), t["warps"].as_u64(), t["smem_bytes"].as_u64()),
        (Some(16), Some(32), Some(4), Some(2 * 32 * 96 * 4))
    );
    // A kernel without row tiles has none; every listed table entry has a tile.
    let t = tile("naive_pv_f32");
    assert!(t["br"].is_null() && t["bc"].is_null() && t["warps"] == 2 && t["smem_bytes"] == 0, "{t}");
    assert!(ks.iter().all(|k| k["tile"].is_object()), "every entry of the committed PTX is a table row");
}

// ---- exit 2: bad usage and bad input ----

#[test]
fn bad_options_exit_2_naming_the_limit() {
    assert_bad_input(&["run", "--bogus"], "--bogus");
    assert_bad_input(&["run", "--kernel", "fused"], "naive, flash");
    assert_bad_input(&["--backend", "tpu", "doctor"], "auto, vm, cuda");
    assert_bad_input(&["run", "--head-dim", "84"], "32, 64, 96, 128, 192 and 256; any other multiple of 8 up to 256");
    assert_bad_input(&["run", "--head-dim", "264"], "up to 256");
    assert_bad_input(&["run", "--kernel", "naive", "--head-dim", "300"], "1..=256");
    assert_bad_input(&["run", "--batch", "0"], "batch must be at least 1");
    assert_bad_input(&["run", "--seq-kv", "0"], "seq_kv");
    assert_bad_input(&["run", "--dtype", "f8"], "bf16");
    assert_bad_input(&["run", "--check-rows", "0"], "--check-rows");
    assert_bad_input(&["run", "--repeats", "0"], "--repeats");
    assert_bad_input(&["run", "--scale", "inf"], "scale");
    assert_bad_input(&["run", "--seq", "4", "--seq-q", "5"], "--seq");
    assert_bad_input(&["compare", "--vary", "colour=red"], "unknown key");
    assert_bad_input(&["compare", "--vary", "splits=1,auto"], "memattn decode --vary splits=A,B");
    assert_bad_input(&["compare", "--vary", "page-size=16,256"], "is a decode option");
    assert_bad_input(&["compare", "--vary", "seq-q=12,x"], "not a non-negative integer");
    assert_bad_input(&["compare", "--vary", "kernel"], "KEY=A,B");
    assert_bad_input(&["sweep", "--kernels", "naive,fast"], "fast");
    assert_bad_input(&["--ptx", "/nonexistent/k.ptx", "kernels"], "cannot read PTX file");
    assert_bad_input(&["trace", "--backend", "cuda"], "VM only");
}

#[test]
fn bad_input_files_exit_2() {
    assert_bad_input(&["run", "--inputs", "/nonexistent/qkv.safetensors"], "cannot read");
    let garbage = tmp("garbage.safetensors");
    std::fs::write(&garbage, b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":1}").unwrap();
    assert_bad_input(&["run", "--inputs", garbage.to_str().unwrap()], "not a valid safetensors file");

    let shape = FileShape { batch: 1, heads: 2, seq_q: 8, seq_kv: 8, head_dim: 64, heads_kv: 2, varlen: None };
    let p = Problem { batch: 1, heads: 2, seq_q: 8, seq_kv: 8, head_dim: 64, ..Problem::default() };
    let x = Qkv::random(&p, 1);

    // Missing tensor: only q and k.
    let f = tmp("missing_v.safetensors");
    let qb: Vec<u8> = x.q.iter().flat_map(|v| v.to_le_bytes()).collect();
    let q = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 8, 2, 64], &qb).unwrap();
    let k = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 8, 2, 64], &qb).unwrap();
    safetensors::serialize_to_file([("q", q), ("k", k)], None, &f).unwrap();
    assert_bad_input(&["run", "--inputs", f.to_str().unwrap()], "no tensor `v`");

    // Wrong dtype: f64 q.
    let f = tmp("f64.safetensors");
    let qb64: Vec<u8> = x.q.iter().flat_map(|v| (*v as f64).to_le_bytes()).collect();
    let q = safetensors::tensor::TensorView::new(safetensors::Dtype::F64, vec![1, 8, 2, 64], &qb64).unwrap();
    safetensors::serialize_to_file([("q", q)], None, &f).unwrap();
    assert_bad_input(&["run", "--inputs", f.to_str().unwrap()], "F64");

    // Wrong shape: k with a head count that does not divide q's (2 heads; k has 3), and v whose
    // heads differ from k's (K/V with 1 head for 2 query heads is GQA and valid).
    let f = tmp("shape.safetensors");
    let kb: Vec<u8> = x.k.iter().flat_map(|v| v.to_le_bytes()).collect();
    let q = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 8, 2, 64], &qb).unwrap();
    let k = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 5, 3, 64], &kb[..960 * 4]).unwrap();
    let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 5, 3, 64], &kb[..960 * 4]).unwrap();
    safetensors::serialize_to_file([("q", q), ("k", k), ("v", v)], None, &f).unwrap();
    assert_bad_input(&["run", "--inputs", f.to_str().unwrap()], "dividing q's heads 2");
    let f = tmp("shape_v.safetensors");
    let q = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 8, 2, 64], &qb).unwrap();
    let k = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 16, 1, 64], &kb).unwrap();
    let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 8, 2, 64], &kb).unwrap();
    safetensors::serialize_to_file([("q", q), ("k", k), ("v", v)], None, &f).unwrap();
    assert_bad_input(&["run", "--inputs", f.to_str().unwrap()], "has shape");

    // Three-dimensional q.
    let f = tmp("rank.safetensors");
    let q = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![8, 2, 64], &qb).unwrap();
    safetensors::serialize_to_file([("q", q)], None, &f).unwrap();
    assert_bad_input(&["run", "--inputs", f.to_str().unwrap()], "4 dimensions");

    // A shape flag that contradicts the file.
    let f = tmp("good.safetensors");
    write_qkv(&f, shape, &x).unwrap();
    assert_bad_input(&["run", "--inputs", f.to_str().unwrap(), "--heads", "3"], "contradicts the input file");
}

// ---- exit 3: device and kernel errors ----

#[test]
fn cuda_without_a_driver_exits_3_without_crashing() {
    // A driver library that is not there takes the same road as a machine without a driver, on
    // any machine (a GPU's driver is not consulted once one is chosen).
    let missing = tmp("no-such-dir").join("libcuda.so");
    let without = |args: &[&str]| bin().args(args).env("MEMATTN_CUDA_DRIVER", &missing).output().unwrap();
    for cmd in [&["--backend", "cuda", "run"][..], &["--backend", "cuda", "compare", "--json"][..]] {
        let o = without(cmd);
        assert_eq!(code(&o), 3, "{cmd:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("CUDA backend unavailable"), "{}", stderr(&o));
        assert!(stderr(&o).contains("no-such-dir"), "the message names the library: {}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"));
    }
    let v = json(&without(&["--backend", "cuda", "--json", "run"]));
    assert_eq!(v["exit_code"], 3);
    // And where the system has no driver at all, the same without the variable.
    if no_gpu() && std::env::var_os("MEMATTN_CUDA_DRIVER").is_none() {
        let o = memattn(&["--backend", "cuda", "run"]);
        assert_eq!(code(&o), 3, "{}", stderr(&o));
        assert!(stderr(&o).contains("CUDA backend unavailable"), "{}", stderr(&o));
    }
}

/// `MEMATTN_CUDA_DRIVER` naming a FIFO (or a directory): refused at once, naming the path,
/// where opening it blocked `memattn doctor` for good.
#[test]
fn a_driver_path_that_is_no_regular_file_is_refused_without_opening_it() {
    let dir = tmp("driver-fifo");
    let _ = std::fs::create_dir_all(&dir);
    let fifo = dir.join("libcuda-fifo.so");
    let _ = std::fs::remove_file(&fifo);
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().map(|s| s.success()).unwrap_or(false);
    let mut paths = vec![dir.clone()];
    if made {
        paths.push(fifo.clone());
    } else {
        eprintln!("mkfifo is not available: the FIFO case is skipped, the directory case runs");
    }
    for path in paths {
        let mut child = bin()
            .args(["--backend", "cuda", "run"])
            .env("MEMATTN_CUDA_DRIVER", &path)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let start = std::time::Instant::now();
        while child.try_wait().unwrap().is_none() {
            if start.elapsed() > std::time::Duration::from_secs(20) {
                let _ = child.kill();
                panic!("memattn blocked on MEMATTN_CUDA_DRIVER={}", path.display());
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let o = child.wait_with_output().unwrap();
        assert_eq!(code(&o), 3, "{}: {}", path.display(), stderr(&o));
        assert!(
            stderr(&o).contains("is not a regular file") && stderr(&o).contains(&*path.to_string_lossy()),
            "{}",
            stderr(&o)
        );
    }
}

#[test]
fn ptx_that_does_not_load_exits_3() {
    let f = tmp("broken.ptx");
    std::fs::write(
        &f,
        ".version 7.0\n.target sm_80\n.address_size 64\n.visible .entry k(\n)\n{\n\tfrobnicate.f32 %r1;\n}\n",
    )
    .unwrap();
    let o = memattn(&["--backend", "vm", "--ptx", f.to_str().unwrap(), "run", "--seq", "8", "--heads", "1"]);
    assert_eq!(code(&o), 3, "stdout {} stderr {}", stdout(&o), stderr(&o));
    assert!(stderr(&o).contains("PTX does not load"), "{}", stderr(&o));
}

// ---- VM runs: exit 0 and 1, JSON, files, compare, sweep, trace ----

#[test]
fn run_json_has_the_contract_fields_and_real_values() {
    let o = memattn(&[
        "--backend",
        "vm",
        "--json",
        "run",
        "--kernel",
        "naive",
        "--seq-q",
        "40",
        "--seq-kv",
        "70",
        "--heads",
        "2",
        "--causal",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    for key in [
        "backend",
        "kernel",
        "dtype",
        "shape",
        "verified",
        "max_abs_err",
        "rel_rms_err",
        "time_ms",
        "tflops",
        "analytic_bytes",
        "peak_device_bytes",
        "vm_thread_instructions",
    ] {
        assert!(!v[key].is_null(), "missing {key}");
    }
    assert_eq!(v["backend"], "vm");
    assert_eq!(v["kernel"], "naive");
    assert_eq!(v["dtype"], "f32");
    assert_eq!(v["shape"]["seq_q"], 40);
    assert_eq!(v["shape"]["seq_kv"], 70);
    assert_eq!(v["shape"]["causal"], true);
    assert_eq!(v["verified"], true);
    let err = v["rel_rms_err"].as_f64().unwrap();
    assert!(err < 1e-5, "{err}");
    // S is 2 heads x 40 x 70 floats; the VM's measurement equals the analytic total.
    assert_eq!(v["analytic_bytes"]["scores"], 4 * 2 * 40 * 70);
    assert_eq!(v["peak_device_bytes"], v["analytic_bytes"]["total"]);
    assert!(v["vm_thread_instructions"].as_u64().unwrap() > 0);
    assert!(v["time_ms"].as_f64().unwrap() > 0.0);
    // Exact useful FLOPs for bottom-right causal, 40 x 70: rows see 31..=70 keys.
    let pairs: u64 = (31..=70).sum();
    assert_eq!(v["flops"].as_f64().unwrap(), (4 * 2 * 64 * pairs) as f64);
}

/// The VM's global-memory byte counts are the tensors each kernel touches, computed here from
/// the shapes alone: flash writes O and the LSE once and reads Q once and K, V once per block of
/// query rows; the naive kernels also write S and P.
#[test]
fn vm_global_bytes_are_the_tensors_each_kernel_touches() {
    let (h, sq, sk, d) = (2u64, 100u64, 70u64, 64u64);
    let bytes = |kernel: &str, dtype: &str| -> (u64, u64, serde_json::Value) {
        let (sq_s, sk_s) = (sq.to_string(), sk.to_string());
        let args = ["--backend", "vm", "--json", "run", "--kernel", kernel, "--dtype", dtype, "--heads", "2"];
        let o = memattn(&[&args[..], &["--seq-q", &sq_s, "--seq-kv", &sk_s]].concat());
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        let v = json(&o);
        (v["vm_global_bytes_read"].as_u64().unwrap(), v["vm_global_bytes_written"].as_u64().unwrap(), v)
    };
    let br = |dtype| {
        let ids = memattn_cli::KernelKind::Flash.kernels(dtype, d as u32, (-1, -1)).unwrap();
        ids[0].variant().block_rows() as u64
    };
    for (dtype, name, el) in [(memattn_cli::Dtype::F32, "f32", 4u64), (memattn_cli::Dtype::Bf16, "bf16", 2)] {
        let (q, kv, o, lse) = (h * sq * d * el, 2 * h * sk * d * el, h * sq * d * el, h * sq * 4);
        let blocks = sq.div_ceil(br(dtype));
        let (read, written, _) = bytes("flash", name);
        assert_eq!(written, o + lse, "{name}: flash writes O and the LSE once");
        assert_eq!(read, q + blocks * kv, "{name}: Q once, K and V once per block of {} rows", br(dtype));
    }
    // Naive f32: S (scores), then P and the LSE (softmax), then O (pv); each launch's own count.
    let (_, written, v) = bytes("naive", "f32");
    let (s, o, lse) = (h * sq * sk * 4, h * sq * d * 4, h * sq * 4);
    let per_launch: Vec<u64> =
        v["launches"].as_array().unwrap().iter().map(|l| l["global_bytes_written"].as_u64().unwrap()).collect();
    assert_eq!(per_launch, vec![s, s + lse, o]);
    assert_eq!(written, 2 * s + lse + o);
}

/// `--vm-bank-conflicts`: the tensor-core kernels' swizzled tiles take one wavefront per phase
/// on every shared access line, and the report says so; without the flag nothing is counted.
#[test]
fn vm_bank_conflicts_of_the_swizzled_kernels_are_the_minimum() {
    for d in ["64", "96"] {
        let args = ["--backend", "vm", "--vm-bank-conflicts", "--json", "run", "--dtype", "bf16", "--seq", "130"];
        let o = memattn(&[&args[..], &["--heads", "1", "--head-dim", d]].concat());
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        let v = json(&o);
        let lines = v["launches"][0]["bank_conflicts"].as_array().unwrap();
        assert!(lines.len() >= 2, "d{d}: the ldmatrix and shared store lines: {lines:?}");
        for l in lines {
            assert!(l["ideal"].as_u64().unwrap() > 0, "{l}");
            assert_eq!(l["wavefronts"], l["ideal"], "d{d}: {l}");
        }
    }
    let o =
        memattn(&["--backend", "vm", "--vm-bank-conflicts", "run", "--dtype", "bf16", "--seq", "130", "--heads", "1"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stdout(&o).contains("no bank conflicts: every shared access took one wavefront per phase"),
        "{}",
        stdout(&o)
    );
    let o = memattn(&["--backend", "vm", "--json", "run", "--dtype", "bf16", "--seq", "130", "--heads", "1"]);
    assert!(json(&o)["launches"][0].get("bank_conflicts").is_none());
}

#[test]
fn run_bf16_json_reports_the_tolerance_rule_and_baseline() {
    let o = memattn(&[
        "--backend",
        "vm",
        "--json",
        "run",
        "--dtype",
        "bf16",
        "--seq-q",
        "70",
        "--seq-kv",
        "90",
        "--heads",
        "2",
        "--causal",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["dtype"], "bf16");
    assert_eq!(v["verified"], true);
    assert_eq!(v["launches"][0]["kernel"], "flash_fwd_bf16_d64");
    let (err, base) = (v["rel_rms_err"].as_f64().unwrap(), v["baseline_rel_rms_err"].as_f64().unwrap());
    assert!(err > 0.0 && err <= 1e-2, "{err}");
    assert!(base > 1e-4 && base < 1e-2, "naive bf16 baseline {base}");
    let t = &v["tolerance"];
    assert_eq!(t["rel_rms"].as_f64().unwrap(), (2.0 * base).max(2f64.powi(-9)));
    assert!(t["rule"].as_str().unwrap().contains("2x naive attention in bf16"));
    assert!((v["error_ratio"].as_f64().unwrap() - err / base).abs() < 1e-12);
    // Memory in the dtype's bytes: Q, K, V, O 2 bytes per element, LSE 4.
    let (q, kv) = (70 * 2 * 64, 90 * 2 * 64);
    assert_eq!(v["analytic_bytes"]["inputs"], 2 * (q + 2 * kv));
    assert_eq!(v["analytic_bytes"]["outputs"], 2 * q);
    assert_eq!(v["analytic_bytes"]["lse"], 4 * 2 * 70);
    assert_eq!(v["peak_device_bytes"], v["analytic_bytes"]["total"]);
    // f32 runs keep the fixed bounds and report no baseline.
    let o = memattn(&["--backend", "vm", "--json", "run", "--seq", "20", "--heads", "1"]);
    let v = json(&o);
    assert!(v["baseline_rel_rms_err"].is_null());
    assert_eq!(v["tolerance"]["rel_rms"], 1e-5);
    // Human output names the bound, the baseline and the ratio.
    let o = memattn(&["--backend", "vm", "run", "--dtype", "f16", "--seq", "40", "--heads", "1", "--head-dim", "128"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let s = stdout(&o);
    for needle in ["flash_fwd_f16_d128", "PASS", "naive f16", "kernel/naive", "2x naive attention in f16"] {
        assert!(s.contains(needle), "run --dtype f16 output lacks {needle}:\n{s}");
    }
}

#[test]
fn compare_vary_dtype_runs_flash_in_f32_and_bf16() {
    let o = memattn(&[
        "--backend",
        "vm",
        "--json",
        "compare",
        "--vary",
        "dtype=f32,bf16",
        "--seq",
        "72",
        "--heads",
        "2",
        "--causal",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["vary"], "dtype");
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert!(runs.iter().all(|r| r["kernel"] == "flash" && r["report"]["verified"] == true));
    assert_eq!(runs[0]["report"]["launches"][0]["kernel"], "flash_fwd_f32_d64");
    assert_eq!(runs[1]["report"]["launches"][0]["kernel"], "flash_fwd_bf16_d64");
    // Same problem, half the bytes for Q, K, V, O; LSE unchanged.
    let (a, b) = (&runs[0]["report"]["analytic_bytes"], &runs[1]["report"]["analytic_bytes"]);
    assert_eq!(a["inputs"].as_u64().unwrap(), 2 * b["inputs"].as_u64().unwrap());
    assert_eq!(a["lse"], b["lse"]);
    let saved = v["comparisons"][0]["memory_saved_bytes"].as_i64().unwrap();
    assert_eq!(saved as u64, (a["inputs"].as_u64().unwrap() + a["outputs"].as_u64().unwrap()) / 2);
    let o = memattn(&["--backend", "vm", "compare", "--vary", "dtype=f32,bf16,f16", "--seq", "40", "--heads", "1"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let s = stdout(&o);
    for needle in ["flash_fwd_bf16_d64", "flash_fwd_f16_d64", "naive-in-dtype", "err/naive", "less device memory"] {
        assert!(s.contains(needle), "compare output lacks {needle}:\n{s}");
    }
}

#[test]
fn sweep_in_bf16_runs_naive_and_flash() {
    let o = memattn(&[
        "--backend",
        "vm",
        "--json",
        "sweep",
        "--dtype",
        "bf16",
        "--vary",
        "seq=32,64",
        "--heads",
        "1",
        "--no-plot",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    let pts = v["points"].as_array().unwrap();
    assert_eq!(pts.len(), 4);
    assert!(pts.iter().all(|p| p["report"]["dtype"] == "bf16" && p["report"]["verified"] == true), "{v}");
    assert_eq!(pts.iter().filter(|p| p["kernel"] == "naive").count(), 2);
    assert!(v["skipped"].as_array().unwrap().is_empty());
}

#[test]
fn naive_vs_flash_in_bf16_shows_the_f32_score_matrix() {
    // The default compare in bf16: naive's workspace is the f32 score matrix (4 bytes per score)
    // even though Q, K, V, O are 2 bytes; flash keeps LSE only. Both verified, exact in the VM.
    let o = memattn(&["--backend", "vm", "--json", "compare", "--dtype", "bf16", "--seq", "96", "--heads", "2"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    let runs = v["runs"].as_array().unwrap();
    let naive = &runs[0]["report"];
    let flash = &runs[1]["report"];
    assert_eq!((naive["kernel"].as_str(), flash["kernel"].as_str()), (Some("naive"), Some("flash")));
    assert!(naive["verified"] == true && flash["verified"] == true, "{v}");
    let entries: Vec<&str> =
        naive["launches"].as_array().unwrap().iter().map(|l| l["kernel"].as_str().unwrap()).collect();
    assert_eq!(entries, ["naive_scores_bf16", "naive_softmax_f32", "naive_pv_bf16"]);
    let scores = 4 * 2 * 96 * 96u64;
    let io = 4 * 2 * 96 * 64 * 2u64; // Q, K, V, O in bf16
    let lse = 4 * 2 * 96u64;
    assert_eq!(naive["analytic_bytes"]["scores"].as_u64(), Some(scores));
    assert_eq!(naive["peak_device_bytes"].as_u64(), Some(io + lse + scores));
    assert_eq!(flash["peak_device_bytes"].as_u64(), Some(io + lse));
    // The naive 16-bit kernels keep P in f32, so they are at least as accurate as the baseline.
    assert!(naive["error_ratio"].as_f64().unwrap() <= 1.0, "{v}");
}

#[test]
fn bf16_safetensors_round_trip_and_dtype_mismatch() {
    let p =
        Problem { batch: 1, heads: 2, seq_q: 24, seq_kv: 40, head_dim: 64, dtype: Dtype::Bf16, ..Problem::default() };
    let x = Qkv::random(&p, 5);
    let shape = FileShape { batch: 1, heads: 2, seq_q: 24, seq_kv: 40, head_dim: 64, heads_kv: 2, varlen: None };
    let inp = tmp("bf16_in.safetensors");
    let out = tmp("bf16_out.safetensors");
    write_qkv_as(&inp, shape, Dtype::Bf16, &x).unwrap();
    // --dtype must match the file when given.
    assert_bad_input(&["run", "--inputs", inp.to_str().unwrap(), "--dtype", "f16"], "BF16");
    assert_bad_input(&["run", "--inputs", inp.to_str().unwrap(), "--dtype", "f16"], "for --dtype f16");
    // Without --dtype the file's dtype is used.
    let o = memattn(&[
        "--backend",
        "vm",
        "--json",
        "run",
        "--inputs",
        inp.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(json(&o)["dtype"], "bf16");
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (ot, lt) = (st.tensor("o").unwrap(), st.tensor("lse").unwrap());
    assert_eq!(ot.dtype(), safetensors::Dtype::BF16);
    assert_eq!(ot.shape(), &[1, 24, 2, 64]);
    assert_eq!(lt.dtype(), safetensors::Dtype::F32);
    let o_file = Dtype::Bf16.decode(ot.data());
    let lse_file = Dtype::F32.decode(lt.data());
    let r = reference(&p, &x, &RowSelection::All);
    let (mut d2, mut r2) = (0f64, 0f64);
    for (k, row) in r.rows.iter().enumerate() {
        let base = ((row.b * 24 + row.i) * 2 + row.h) as usize * 64;
        for d in 0..64 {
            let w = r.o[k * 64 + d];
            d2 += (o_file[base + d] as f64 - w).powi(2);
            r2 += w * w;
        }
        let l = lse_file[((row.b * 2 + row.h) * 24 + row.i) as usize] as f64;
        assert!((l - r.lse[k]).abs() < 1e-4);
    }
    assert!((d2 / r2).sqrt() < 1e-2, "bf16 file O rel RMS {}", (d2 / r2).sqrt());
    // And with a matching --dtype.
    let o = memattn(&["--backend", "vm", "run", "--inputs", inp.to_str().unwrap(), "--dtype", "bf16"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

#[test]
fn run_inputs_output_round_trip_matches_the_reference() {
    let p = Problem { batch: 2, heads: 1, seq_q: 24, seq_kv: 40, head_dim: 128, ..Problem::default() };
    let x = Qkv::random(&p, 77);
    let inp = tmp("rt_in.safetensors");
    let out = tmp("rt_out.safetensors");
    write_qkv(
        &inp,
        FileShape { batch: 2, heads: 1, seq_q: 24, seq_kv: 40, head_dim: 128, heads_kv: 1, varlen: None },
        &x,
    )
    .unwrap();
    let o = memattn(&[
        "--backend",
        "vm",
        "run",
        "--inputs",
        inp.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--layout",
        "bhsd",
    ]);
    assert_eq!(code(&o), 0, "{}{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("PASS"));
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |name: &str| -> Vec<f32> {
        st.tensor(name).unwrap().data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    };
    let (o_file, lse_file) = (f32s("o"), f32s("lse"));
    let r = reference(&p, &x, &RowSelection::All);
    let heads = p.heads;
    for (k, row) in r.rows.iter().enumerate() {
        let base = ((row.b * 24 + row.i) * heads + row.h) as usize * 128;
        for d in 0..128 {
            assert!((o_file[base + d] as f64 - r.o[k * 128 + d]).abs() < 1e-4);
        }
        let l = lse_file[((row.b * heads + row.h) * 24 + row.i) as usize] as f64;
        assert!((l - r.lse[k]).abs() < 1e-4);
    }
}

#[test]
fn wrong_kernel_results_exit_1() {
    // ln 2 (0f3F317218) turns LSE from log2 to natural log in every kernel; make it 1.0.
    let broken = memattn_cli::ptx::EMBEDDED_PTX.replace("0f3F317218", "0f3F800000");
    assert_ne!(broken, memattn_cli::ptx::EMBEDDED_PTX);
    let f = tmp("wrong_lse.ptx");
    std::fs::write(&f, broken).unwrap();
    let o = memattn(&["--backend", "vm", "--ptx", f.to_str().unwrap(), "--json", "run", "--seq", "32", "--heads", "1"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["verified"], false);
    assert!(v["lse_err"]["max_abs_err"].as_f64().unwrap() > 1e-2);
}

#[test]
fn compare_default_verifies_both_and_prints_the_memory_table() {
    let o = memattn(&["--backend", "vm", "compare", "--seq", "64", "--heads", "2"]);
    assert_eq!(code(&o), 0, "{}{}", stdout(&o), stderr(&o));
    let s = stdout(&o);
    for needle in ["naive", "flash", "measured peak", "expected bytes", "workspace", "less device memory"] {
        assert!(s.contains(needle), "compare output lacks {needle}:\n{s}");
    }
    let o = memattn(&[
        "--backend",
        "vm",
        "--json",
        "compare",
        "--vary",
        "causal=false,true",
        "--seq",
        "48",
        "--heads",
        "1",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["vary"], "causal");
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[1]["report"]["shape"]["causal"], true);
    assert!(runs.iter().all(|r| r["report"]["verified"] == true));
    // Causal does about half the work.
    let f0 = runs[0]["report"]["flops"].as_f64().unwrap();
    let f1 = runs[1]["report"]["flops"].as_f64().unwrap();
    assert_eq!(f1 / f0, (48.0 * 49.0 / 2.0) / (48.0 * 48.0));
}

#[test]
fn sweep_shows_naive_runs_that_do_not_fit() {
    let plot = tmp("sweep.svg");
    // 2 MiB of VM memory. At seq 256, 4 heads: flash needs 1 MiB + 4 KiB (Q, K, V, O, LSE);
    // naive needs another 1 MiB for S, 2 MiB + 4 KiB in all, which does not fit.
    let o = memattn(&[
        "--backend",
        "vm",
        "--vm-memory-mib",
        "2",
        "--json",
        "sweep",
        "--vary",
        "seq=32,256",
        "--heads",
        "4",
        "--plot",
        plot.to_str().unwrap(),
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    let pts = v["points"].as_array().unwrap();
    assert_eq!(pts.len(), 4);
    let naive_256 = pts.iter().find(|p| p["value"] == "256" && p["kernel"] == "naive").unwrap();
    assert_eq!(naive_256["ran"], false);
    assert_eq!(naive_256["would_need_bytes"].as_u64().unwrap(), (2 << 20) + 4096);
    assert!(naive_256["reason"].as_str().unwrap().contains("free"));
    let flash_256 = pts.iter().find(|p| p["value"] == "256" && p["kernel"] == "flash").unwrap();
    assert_eq!(flash_256["ran"], true);
    assert_eq!(flash_256["report"]["verified"], true);
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("polyline") && svg.contains("did not run"));
}

#[test]
fn trace_prints_one_threads_instructions() {
    let o = memattn(&[
        "--backend",
        "vm",
        "--json",
        "trace",
        "--kernel",
        "naive",
        "--step",
        "scores",
        "--seq",
        "8",
        "--thread",
        "3",
        "--max-entries",
        "50",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    let entries = v["entries"].as_array().unwrap();
    assert!(!entries.is_empty() && entries.len() <= 50);
    assert!(entries.iter().any(|e| e["text"].as_str().unwrap().contains("ld.param")));
    assert_bad_input(&["trace", "--thread", "999"], "outside the block");
}

#[test]
fn save_appends_one_evidence_line_per_measurement() {
    let path = tmp("evidence.jsonl");
    let _ = std::fs::remove_file(&path);
    let p = path.to_str().unwrap();
    // The method: observe, measure, change one option, repeat the same measurement.
    let base = ["--backend", "vm", "run", "--kernel", "flash", "--seq", "40", "--heads", "2"];
    let o1 = memattn(&[&base[..], &["--json", "--save", p]].concat());
    assert_eq!(code(&o1), 0, "{}", stderr(&o1));
    let o2 = memattn(&[&base[..], &["--causal", "--save", p]].concat());
    assert_eq!(code(&o2), 0, "{}", stderr(&o2));
    assert!(stderr(&o2).contains("evidence appended to"), "{}", stderr(&o2));

    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<serde_json::Value> =
        text.lines().map(|l| serde_json::from_str(l).expect("one JSON object per line")).collect();
    assert_eq!(lines.len(), 2, "{text}");
    // The saved result is exactly what --json printed.
    assert_eq!(lines[0]["result"], json(&o1));
    assert_eq!(lines[0]["result"]["shape"]["causal"], false);
    assert_eq!(lines[1]["result"]["shape"]["causal"], true);
    assert!(lines[1]["argv"].as_array().unwrap().iter().any(|a| a == "--causal"));
    let sha = memattn_cli::ptx::PtxSource::embedded().sha256;
    assert_eq!(lines[1]["ptx"]["sha256"], sha.as_str());
    // Causal does a little over half the work: fewer flops than the full run.
    assert!(lines[1]["result"]["flops"].as_f64().unwrap() < lines[0]["result"]["flops"].as_f64().unwrap());

    assert_bad_input(&["--backend", "vm", "run", "--seq", "8", "--save", "/nonexistent-dir/e.jsonl"], "evidence file");
}

#[test]
fn a_missing_barrier_is_a_device_error_and_without_the_checks_a_wrong_answer() {
    // The flash kernel with the barrier before its K/V tile refill deleted: a fast warp
    // overwrites the tile while a slow one still reads it.
    let ptx = memattn_cli::ptx::PtxSource::embedded().text;
    let start = ptx.find(".entry flash_fwd_f32_d64(").unwrap();
    let at = start + ptx[start..].find("bar.sync").unwrap();
    let path = tmp("no-barrier.ptx");
    std::fs::write(&path, format!("{}// removed: {}", &ptx[..at], &ptx[at..])).unwrap();
    let p = path.to_str().unwrap();
    let run = ["run", "--kernel", "flash", "--heads", "2", "--seq-q", "96", "--seq-kv", "200"];
    let o = memattn(&[&["--backend", "vm", "--ptx", p][..], &run[..]].concat());
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    assert!(stderr(&o).contains("shared memory race"), "{}", stderr(&o));
    // With the checks off the same kernel runs to the end and verification catches the damage.
    let o = memattn(&[&["--backend", "vm", "--vm-allow", "racecheck,initcheck", "--ptx", p][..], &run[..]].concat());
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains("initcheck and racecheck off"), "{}", stderr(&o));
}

#[test]
fn inference_options_bad_values_exit_2_naming_value_and_rule() {
    for (args, needle) in [
        (&["run", "--heads", "6", "--heads-kv", "4"][..], "heads_kv 4 must divide heads 6"),
        (&["run", "--heads-kv", "0"][..], "heads_kv must be at least 1"),
        (&["run", "--window", "-2,0"][..], "the left side is -2"),
        (&["run", "--window", "3"][..], "expected L,R"),
        (&["run", "--window", "1,x"][..], "expected L,R"),
        (&["run", "--sliding-window", "0"][..], "W must be at least 1"),
        (&["run", "--softcap", "-1"][..], "softcap -1 is invalid"),
        (&["run", "--softcap", "NaN"][..], "softcap NaN is invalid"),
        (&["compare", "--vary", "window=3:0,-5:0"][..], "the left side is -5"),
        (&["compare", "--vary", "softcap=1,-2"][..], "softcap: -2 is invalid"),
        (&["compare", "--vary", "heads-kv=3"][..], "heads_kv 3 must divide heads 4"),
    ] {
        assert_bad_input(args, needle);
    }
}

/// GQA with sinks through files: k/v with heads_kv heads and a `sinks` tensor are read, verified
/// against the reference and written back; `--sinks` with a file that lacks the tensor exits 2.
#[test]
fn gqa_and_sinks_from_safetensors() {
    let p = Problem { heads: 4, heads_kv: Some(1), seq_q: 20, seq_kv: 33, sinks: true, ..Problem::default() };
    let x = Qkv::random(&p, 4);
    assert_eq!(x.k.len(), 33 * 64);
    let inp = tmp("gqa_sinks.safetensors");
    let shape = FileShape { batch: 1, heads: 4, seq_q: 20, seq_kv: 33, head_dim: 64, heads_kv: 1, varlen: None };
    write_qkv(&inp, shape, &x).unwrap();
    let o = memattn(&["--backend", "vm", "--json", "run", "--inputs", inp.to_str().unwrap(), "--window", "7,2"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["shape"]["heads_kv"], 1);
    assert_eq!(v["shape"]["sinks"], true);
    assert_eq!(v["shape"]["window_left"], 7);
    assert_eq!(v["analytic_bytes"]["inputs"], 4 * (20 * 4 * 64 + 2 * 33 * 64 + 4));
    assert_eq!(v["verified"], true);
    let no_sinks = tmp("gqa_no_sinks.safetensors");
    write_qkv(&no_sinks, shape, &Qkv { sinks: vec![], ..x }).unwrap();
    assert_bad_input(
        &["--backend", "vm", "run", "--inputs", no_sinks.to_str().unwrap(), "--sinks"],
        "needs a `sinks` tensor",
    );
}

/// Varlen through files and options: packed q/k/v with cu_seqlens (U32 written, I32 accepted)
/// run verified and write o [total_q, heads, d] and lse [heads, total_q]; bad cu_seqlens exit 2.
#[test]
fn varlen_files_and_bad_cu_seqlens() {
    use memattn_cli::inputs::Qkv;
    use memattn_cli::problem::Problem;
    let base = Problem { heads: 2, heads_kv: Some(1), causal: true, ..Problem::default() };
    let p = Problem::varlen(base, &[9, 0, 1, 20], &[4, 3, 1, 25]).unwrap();
    let x = Qkv::random(&p, 2);
    let shape = FileShape { batch: 4, heads: 2, seq_q: 20, seq_kv: 25, head_dim: 64, heads_kv: 1, varlen: p.varlen };
    let inp = tmp("varlen.safetensors");
    let out = tmp("varlen_out.safetensors");
    write_qkv(&inp, shape, &x).unwrap();
    let o = memattn(&[
        "--backend",
        "vm",
        "--json",
        "run",
        "--inputs",
        inp.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["verified"], true);
    assert_eq!(v["shape"]["seqlens_kv"], serde_json::json!([4, 3, 1, 25]));
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("o").unwrap().shape(), [30, 2, 64]);
    assert_eq!(st.tensor("lse").unwrap().shape(), [2, 30]);

    // Hand-made files: I32 prefix sums accepted; decreasing, wrong total, wrong count refused.
    let qb: Vec<u8> = x.q.iter().flat_map(|v| v.to_le_bytes()).collect();
    let kb: Vec<u8> = x.k.iter().flat_map(|v| v.to_le_bytes()).collect();
    let write = |name: &str, cq: &[i32], ck: &[i32]| -> PathBuf {
        let f = tmp(name);
        let (cqb, ckb): (Vec<u8>, Vec<u8>) =
            (cq.iter().flat_map(|v| v.to_le_bytes()).collect(), ck.iter().flat_map(|v| v.to_le_bytes()).collect());
        use safetensors::tensor::TensorView as T;
        let t = [
            ("q", T::new(safetensors::Dtype::F32, vec![30, 2, 64], &qb).unwrap()),
            ("k", T::new(safetensors::Dtype::F32, vec![33, 1, 64], &kb).unwrap()),
            ("v", T::new(safetensors::Dtype::F32, vec![33, 1, 64], &kb).unwrap()),
            ("cu_seqlens_q", T::new(safetensors::Dtype::I32, vec![cq.len()], &cqb).unwrap()),
            ("cu_seqlens_kv", T::new(safetensors::Dtype::I32, vec![ck.len()], &ckb).unwrap()),
        ];
        safetensors::serialize_to_file(t, None, &f).unwrap();
        f
    };
    let ok = write("varlen_i32.safetensors", &[0, 9, 9, 10, 30], &[0, 4, 7, 8, 33]);
    let o = memattn(&["--backend", "vm", "run", "--inputs", ok.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let f = write("varlen_dec.safetensors", &[0, 9, 8, 10, 30], &[0, 4, 7, 8, 33]);
    assert_bad_input(&["run", "--inputs", f.to_str().unwrap()], "cu_seqlens_q decreases at entry 2");
    let f = write("varlen_total.safetensors", &[0, 9, 9, 10, 30], &[0, 4, 7, 8, 32]);
    assert_bad_input(
        &["run", "--inputs", f.to_str().unwrap()],
        "cu_seqlens_kv ends at 32 but the packed tensor has 33 rows",
    );
    let f = write("varlen_count.safetensors", &[0, 9, 9, 10, 30], &[0, 4, 33]);
    assert_bad_input(&["run", "--inputs", f.to_str().unwrap()], "both need batch + 1");
    // Options: mismatched counts, BHSD.
    assert_bad_input(&["run", "--seqlens-q", "3,4", "--seqlens-kv", "5"], "2 query lengths and 1 key lengths");
    assert_bad_input(&["run", "--seqlens-q", "3,4", "--layout", "bhsd"], "use --layout bshd");
}

/// `memattn check`: the fixed sweep passes for the committed f32 flash kernel at d64, listing
/// every case (the table's JSON form); an unknown family/dtype pair is bad usage.
#[test]
fn check_sweep_passes_and_lists_its_cases() {
    let o = memattn(&["--backend", "vm", "--json", "check", "--kernel", "flash", "--dtype", "f32", "--head-dim", "64"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let cases = v["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 21);
    assert!(cases.iter().all(|c| c["passed"] == true), "{cases:?}");
    let names: Vec<&str> = cases.iter().map(|c| c["case"].as_str().unwrap()).collect();
    for want in ["tails", "seq_q > seq_kv", "gqa 8 (mqa)", "window in tile", "varlen causal", "alibi causal gqa"] {
        assert!(names.contains(&want), "{names:?}");
    }
    assert_eq!(v["failed"], 0);
    assert_bad_input(&["check", "--head-dim", "84"], "84");
}

/// `check --max-error-ratio`: each bf16 case reports its max error over naive attention's in
/// bf16 (recomputed here from the case's own bound), the worst and median are in the JSON, and a
/// limit below the worst is exit 1 naming the case although every case verified; a limit above
/// it is exit 0. The limit is refused for f32 and when not a number above 0.
#[test]
fn check_reports_the_error_ratio_and_fails_on_drift() {
    let args = ["--backend", "vm", "--json", "check", "--dtype", "bf16", "--head-dim", "32"];
    let o = memattn(&args);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let cases = v["cases"].as_array().unwrap();
    let mut ratios = Vec::new();
    for c in cases {
        let r = c["error_ratio"].as_f64().unwrap_or_else(|| panic!("no error_ratio: {c}"));
        assert!((0.0..=2.0 + 1e-9).contains(&r), "{c}");
        ratios.push(r);
    }
    ratios.sort_by(f64::total_cmp);
    let worst = v["worst_error_ratio"]["ratio"].as_f64().unwrap();
    assert_eq!(worst, *ratios.last().unwrap());
    assert_eq!(v["median_error_ratio"].as_f64().unwrap(), ratios[ratios.len() / 2]);
    assert!(worst > ratios[0], "the ratio varies between cases: {ratios:?}");
    let limit = format!("{}", (worst * 0.99 * 1000.0).floor() / 1000.0);
    let o = memattn(&[&args[..], &["--max-error-ratio", &limit]].concat());
    assert_eq!(code(&o), 1, "{}", stdout(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!((v["failed"].as_u64(), v["passed"].as_bool()), (Some(0), Some(false)));
    let case = v["worst_error_ratio"]["case"].as_str().unwrap();
    assert!(v["drift"].as_str().unwrap().contains(case), "{}", v["drift"]);
    let above = format!("{}", worst + 0.01);
    assert_eq!(code(&memattn(&[&args[..], &["--max-error-ratio", &above]].concat())), 0);
    assert_bad_input(&["check", "--dtype", "f32", "--max-error-ratio", "1.5"], "judged by fixed bounds");
    assert_bad_input(&["check", "--dtype", "bf16", "--max-error-ratio", "0"], "above 0");
    assert_bad_input(&["check", "--dtype", "bf16", "--max-error-ratio", "-1"], "above 0");
}

/// `--vm-max-seconds`: a launch past the limit stops with exit 3 naming the limit and the kernel
/// (a run of about 8 s at 50 ms); out-of-range limits are exit 2.
#[test]
fn vm_max_seconds_stops_a_long_launch() {
    let t = std::time::Instant::now();
    let o = memattn(&["--backend", "vm", "--vm-max-seconds", "0.05", "run", "--seq", "2048", "--heads", "8"]);
    assert_eq!(code(&o), 3, "{}", stdout(&o));
    assert!(
        stderr(&o).contains("launch time limit exceeded") && stderr(&o).contains("flash_fwd_f32_d64"),
        "{}",
        stderr(&o)
    );
    assert!(t.elapsed() < std::time::Duration::from_secs(5), "took {:?}", t.elapsed());
    for bad in ["0", "-1", "nan", "1e7"] {
        assert_bad_input(&["--vm-max-seconds", bad, "run"], "--vm-max-seconds");
    }
}

/// `check --large` has fixed cases in the VM: filters and `--backward` are bad usage (the run
/// itself is a CI step: about 20 s in a debug build).
#[test]
fn check_large_refuses_filters() {
    assert_bad_input(&["--backend", "vm", "check", "--large", "--dtype", "bf16"], "fixed cases");
    assert_bad_input(&["--backend", "vm", "check", "--large", "--head-dim", "64"], "fixed cases");
    assert_bad_input(&["--backend", "vm", "check", "--large", "--backward"], "separate sweeps");
}

/// `decode --cache-batch-idx/--cache-leftpad`: a permutation of slots with left padding and
/// appended tokens verifies (f32 and bf16), and each refusal names its rule.
#[test]
fn decode_cache_slots_and_left_padding() {
    for dtype in ["f32", "bf16"] {
        let o = memattn(&[
            "--backend",
            "vm",
            "--json",
            "decode",
            "--dtype",
            dtype,
            "--heads",
            "4",
            "--heads-kv",
            "2",
            "--cache-len",
            "40,70,33",
            "--cache-batch-idx",
            "3,1,0",
            "--cache-leftpad",
            "7,0,33",
            "--new-tokens",
            "2",
            "--seq-q",
            "2",
        ]);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert_eq!(v["verified"], true);
        assert_eq!(v["verification"]["cache_ok"], true);
    }
    let d = ["--backend", "vm", "decode", "--cache-len", "40,70"];
    assert_bad_input(
        &[&d[..], &["--cache-batch-idx", "1,1", "--new-tokens", "1"]].concat(),
        "names slot 1 for sequences 0 and 1",
    );
    assert_bad_input(&[&d[..], &["--cache-batch-idx", "1"]].concat(), "cache_batch_idx has 1 entries");
    assert_bad_input(
        &[&d[..], &["--cache-leftpad", "41,0"]].concat(),
        "cache_leftpad[0] = 41 is past cache_seqlens[0] = 40",
    );
    assert_bad_input(&[&d[..], &["--cache-leftpad", "1,2,3"]].concat(), "--cache-leftpad has 3 values");
    assert_bad_input(&[&d[..], &["--cache-leftpad", "1", "--page-size", "16"]].concat(), "cannot be used with");
}

/// `decode --rotary-dim`: GPT-NeoX and GPT-J pairs, a partial rotary dim, paged and with left
/// padding verify (the reference attends over the rotated inputs; the appended keys are the
/// rotated ones, bit for bit), and the refusals name FlashAttention-2's rules.
#[test]
fn decode_rotary_embedding() {
    for extra in [
        &["--rotary-dim", "64", "--new-tokens", "2"][..],
        &["--rotary-dim", "32", "--rotary-interleaved", "--new-tokens", "3", "--seq-q", "2", "--page-size", "16"],
        &["--rotary-dim", "48", "--new-tokens", "1", "--dtype", "bf16", "--cache-leftpad", "5", "--cache-len", "30,40"],
    ] {
        let o =
            memattn(&[&["--backend", "vm", "--json", "decode", "--heads", "8", "--heads-kv", "2"][..], extra].concat());
        assert_eq!(code(&o), 0, "{extra:?}: {}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert_eq!(
            (v["verified"].as_bool(), v["verification"]["cache_ok"].as_bool()),
            (Some(true), Some(true)),
            "{extra:?}"
        );
    }
    let d = ["--backend", "vm", "decode"];
    assert_bad_input(&[&d[..], &["--rotary-dim", "64"]].concat(), "needs new tokens");
    assert_bad_input(&[&d[..], &["--rotary-dim", "3", "--new-tokens", "1"]].concat(), "rotary_dim 3: it must be even");
    assert_bad_input(&[&d[..], &["--rotary-dim", "80", "--new-tokens", "1"]].concat(), "at most head_dim 64");
    assert_bad_input(&[&d[..], &["--rotary-interleaved"]].concat(), "--rotary-dim");
}

/// `--sliding-window W` is `--window W-1,0 --causal` (the model-config convention): the same
/// window in the JSON and the same thread-instruction count, verified.
#[test]
fn sliding_window_is_window_w_minus_1_causal() {
    let run = |args: &[&str]| -> serde_json::Value {
        let mut a = vec!["--backend", "vm", "--json", "run", "--heads", "1", "--seq", "100"];
        a.extend_from_slice(args);
        let o = memattn(&a);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        serde_json::from_str(&stdout(&o)).unwrap()
    };
    let a = run(&["--sliding-window", "16"]);
    let b = run(&["--window", "15,0", "--causal"]);
    for v in [&a, &b] {
        assert_eq!((v["shape"]["window_left"].as_i64(), v["shape"]["window_right"].as_i64()), (Some(15), Some(0)));
        assert_eq!(v["shape"]["causal"], true);
        assert_eq!(v["verified"], true);
    }
    assert_eq!(a["vm_thread_instructions"], b["vm_thread_instructions"]);
    assert_eq!(a["flops"], 4.0 * 64.0 * (16.0 * 100.0 - 15.0 * 16.0 / 2.0));
}

/// `run --cp`: in-process ranks verified against the f64 reference, every rank's bytes equal
/// to the analytic volume (recomputed here from the formula of docs/semantics.md), the overlap
/// model of each strategy, and the refusals.
#[test]
fn run_cp_reports_bytes_and_the_overlap_model() {
    // zigzag, 4 ranks, GQA 4/2, bf16, a length that is no multiple of 8 pieces.
    let o = memattn(&[
        "--json",
        "--backend",
        "vm",
        "run",
        "--cp",
        "4",
        "--cp-strategy",
        "zigzag",
        "--causal",
        "--seq",
        "301",
        "--heads",
        "4",
        "--heads-kv",
        "2",
        "--head-dim",
        "64",
        "--dtype",
        "bf16",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["verified"], true);
    assert_eq!(v["checked_rows"], v["total_rows"]);
    let ranks = v["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 4);
    // Ring over zigzag pieces: rank r sends the K/V of every rank but r+1 (2 x heads_kv x d x 2 B per key).
    let piece = |i: u64| (i + 1) * 301 / 8 - i * 301 / 8;
    let held = |r: u64| piece(r) + piece(7 - r);
    for (r, rank) in ranks.iter().enumerate() {
        let r = r as u64;
        assert_eq!(rank["bytes_sent"], 2 * 2 * 64 * 2 * (301 - held((r + 1) % 4)), "rank {r}");
        assert_eq!(rank["bytes_received"], 2 * 2 * 64 * 2 * (301 - held(r)), "rank {r}");
        assert_eq!(rank["steps"].as_array().unwrap().len(), 4);
    }
    let models = v["overlap_model"]["strategies"].as_array().unwrap();
    assert_eq!(models.len(), 3);
    assert!(models[0]["fraction_of_ideal"].as_f64().unwrap() > 0.0);
    assert!(models[2]["not_applicable"].as_str().unwrap().contains("divisible by the world size 4"));

    // Human output: the table, the bytes against the formula, the model.
    let o = memattn(&[
        "--backend",
        "vm",
        "run",
        "--cp",
        "2",
        "--cp-strategy",
        "ulysses",
        "--seq",
        "37",
        "--heads",
        "2",
        "--head-dim",
        "32",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let s = stdout(&o);
    assert!(s.contains("rank 1: sent") && s.contains("(analytic"), "{s}");
    assert!(
        s.contains("overlap model, 2 ranks at 450 GB/s") || s.contains("overlap model, 2 ranks at 450.0 GB/s"),
        "{s}"
    );
    assert!(s.contains("VERIFIED"), "{s}");

    // Refusals name the rule, exit 2.
    for (args, want) in [
        (vec!["run", "--cp", "0"], "--cp must be 1 to 64"),
        (vec!["run", "--cp", "3", "--cp-strategy", "ulysses", "--heads", "4"], "divisible by the world size 3"),
        (vec!["run", "--cp", "2", "--kernel", "naive"], "--cp runs the flash kernels"),
        (vec!["run", "--cp", "2", "--link-gbps", "0"], "--link-gbps must be a positive number"),
        (vec!["--backend", "cuda", "run", "--cp", "2"], "--cp-comm in-process runs its ranks on VMs"),
        (vec!["--backend", "vm", "run", "--cp", "2", "--cp-comm", "nccl"], "one rank per GPU: not with --backend vm"),
        (vec!["run", "--cp", "2", "--backward", "--dtype", "bf16", "--head-dim", "192"], "head_dim"),
    ] {
        let o = memattn(&args);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(want), "{args:?}: {}", stderr(&o));
    }
    let o = memattn(&["run", "--cp-strategy", "ring"]);
    assert_eq!(code(&o), 2, "--cp-strategy without --cp");
    let o = memattn(&["run", "--cp-comm", "nccl-rules"]);
    assert_eq!(code(&o), 2, "--cp-comm without --cp");

    // NCCL's adapter over NCCL's rules in memory: the same result and bytes as in-process ranks.
    let run = |comm: &str| {
        let o = memattn(&[
            "--json",
            "--backend",
            "vm",
            "run",
            "--cp",
            "3",
            "--cp-strategy",
            "zigzag",
            "--cp-comm",
            comm,
            "--causal",
            "--seq",
            "101",
            "--heads",
            "2",
            "--head-dim",
            "32",
        ]);
        assert_eq!(code(&o), 0, "{comm}: {}", stderr(&o));
        json(&o)
    };
    let (a, b) = (run("in-process"), run("nccl-rules"));
    assert_eq!((a["cp_comm"].as_str(), b["cp_comm"].as_str()), (Some("in-process"), Some("nccl-rules")));
    assert_eq!(b["verified"], true);
    assert_eq!(a["o_rel_rms_err"], b["o_rel_rms_err"], "the same arithmetic over either transport");
    for r in 0..3 {
        assert_eq!(a["ranks"][r]["bytes_sent"], b["ranks"][r]["bytes_sent"]);
        assert_eq!(b["ranks"][r]["bytes_match"], true);
    }
}

/// `run --cp --backward`: the backward along the ring, the gathered gradients checked against
/// f64 and each rank's bytes against the forward's volume plus one f32 dK/dV sum of every block
/// each way (2 x heads_kv x d x 4 B per key).
#[test]
fn run_cp_backward_verifies_the_gradients_and_their_bytes() {
    let o = memattn(&[
        "--json",
        "--backend",
        "vm",
        "run",
        "--cp",
        "3",
        "--cp-strategy",
        "zigzag",
        "--backward",
        "--causal",
        "--seq",
        "67",
        "--heads",
        "4",
        "--heads-kv",
        "2",
        "--head-dim",
        "32",
        "--sinks",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["verified"], true);
    assert_eq!(v["backward"]["gradients_verified"], true);
    let checks = v["backward"]["checks"].as_array().unwrap();
    let names: Vec<&str> = checks.iter().map(|c| c["tensor"].as_str().unwrap()).collect();
    assert_eq!(names, ["o", "lse", "dq", "dk", "dv", "d_sinks"]);
    assert!(checks.iter().all(|c| c["passed"] == true && c["max_abs_err"].as_f64().unwrap() > 0.0), "{checks:?}");
    for (fwd, bwd) in v["ranks"].as_array().unwrap().iter().zip(v["backward"]["ranks"].as_array().unwrap()) {
        let sums = 2 * 2 * 32 * 4 * 67;
        assert_eq!(bwd["bytes_sent"].as_u64().unwrap(), fwd["bytes_sent"].as_u64().unwrap() + sums);
        assert_eq!(bwd["bytes_received"].as_u64().unwrap(), fwd["bytes_received"].as_u64().unwrap() + sums);
    }
    // Ulysses: the all-to-all reversed; 2 ranks, 4 heads, 2 K/V heads, 40 rows each way.
    let o = memattn(&[
        "--json",
        "--backend",
        "vm",
        "run",
        "--cp",
        "2",
        "--cp-strategy",
        "ulysses",
        "--backward",
        "--seq",
        "80",
        "--heads",
        "4",
        "--heads-kv",
        "2",
        "--head-dim",
        "32",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["backward"]["gradients_verified"], true);
    // Out: 40 rows x 2 heads x (3 x 32 x 4 + 4) + 2 x 40 keys x 1 K/V head x 32 x 4; back:
    // 40 x 2 x 32 x 4 + 2 x 40 x 1 x 32 x 4.
    let want = 40 * 2 * (3 * 32 * 4 + 4) + 2 * 40 * 32 * 4 + 40 * 2 * 32 * 4 + 2 * 40 * 32 * 4;
    for r in v["backward"]["ranks"].as_array().unwrap() {
        assert_eq!(r["bytes_sent"], want);
        assert_eq!(r["bytes_received"], want);
    }
}
