//! The `memattn` binary with `--backend cuda` on the VM-backed CUDA driver (`vm-cuda`'s
//! `libvm_cuda.so`, chosen with `MEMATTN_CUDA_DRIVER`): the whole CUDA path — cudarc, the JIT
//! log, events, NVML sampling, `cuMemGetInfo` — runs without a GPU, and its results must equal
//! the `vm` backend's bit for bit.

use crate::common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `libvm_cuda.so`, which cargo builds next to this test (a dev-dependency of memattn).
fn vm_cuda() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    [deps, deps.parent().unwrap()]
        .iter()
        .map(|d| d.join("libvm_cuda.so"))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("libvm_cuda.so is not next to {}", exe.display()))
}

fn memattn_with(driver: &Path, envs: &[(&str, &str)], args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memattn"))
        .args(args)
        .env("MEMATTN_TEST", "1")
        .env("MEMATTN_CUDA_DRIVER", driver)
        .envs(envs.iter().copied())
        .output()
        .expect("spawn memattn")
}

fn memattn(args: &[&str]) -> Output {
    memattn_with(&vm_cuda(), &[], args)
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("memattn-cuda-vm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn run_on_the_vm_backed_driver_equals_the_vm_bit_for_bit() {
    for (dtype, extra) in [("f32", &[][..]), ("bf16", &["--causal", "--layout", "bhsd"][..])] {
        let mut outs = Vec::new();
        for backend in ["cuda", "vm"] {
            let out = tmp(&format!("o-{dtype}-{backend}.safetensors"));
            let mut args = vec![
                "--json",
                "--backend",
                backend,
                "run",
                "--dtype",
                dtype,
                "--heads",
                "2",
                "--seq-q",
                "40",
                "--seq-kv",
                "70",
            ];
            args.extend_from_slice(extra);
            args.extend_from_slice(&["--output", out.to_str().unwrap()]);
            let o = memattn(&args);
            assert_eq!(code(&o), 0, "{backend} {dtype}: {}", stderr(&o));
            let v = json(&o);
            assert_eq!(v["backend"], backend);
            assert_eq!(v["verified"], true, "{v}");
            // The measured peak equals the analytic bytes: exact in the VM; on the VM-backed
            // driver NVML's sampled peak and cuMemGetInfo read the same allocator.
            assert_eq!(v["memory"]["peak_delta_bytes"], v["analytic_bytes"]["total"], "{backend} {dtype}: {v}");
            if backend == "cuda" {
                assert!(v["device"].as_str().unwrap().contains("VM-backed"), "{}", v["device"]);
                let m = &v["memory"];
                assert!(m["source"].as_str().unwrap().starts_with("nvml"), "NVML sampled: {m}");
                assert!(m["samples"].as_u64().unwrap() > 0, "{m}");
                assert_eq!(m["gpu_util_max_percent"], 100, "busy during the launch: {m}");
                // NVML's own sampled peak reached the allocator's figure (else a note says the
                // cuMemGetInfo difference was reported instead).
                assert_eq!(m["peak_bytes"], v["analytic_bytes"]["total"], "{m}");
                assert!(!m["notes"].to_string().contains("NVML peak below"), "{m}");
                let (before, allocated) =
                    (m["cuda_free_before_bytes"].as_u64().unwrap(), m["cuda_free_allocated_bytes"].as_u64().unwrap());
                assert_eq!(before - allocated, v["analytic_bytes"]["total"].as_u64().unwrap(), "cuMemGetInfo: {m}");
                assert_eq!(v["timing"]["clock"], "cuda events");
                assert_eq!((v["timing"]["warmup"].as_u64(), v["timing"]["repeats"].as_u64()), (Some(0), Some(1)));
            }
            outs.push(std::fs::read(&out).unwrap());
        }
        assert!(outs[0] == outs[1], "{dtype}: O and LSE differ between --backend cuda and --backend vm");
    }
}

/// The Hopper forward through the CUDA path (the sm_90a module loaded by the driver's JIT,
/// tensor maps from `cuTensorMapEncodeTiled`, stored by `tensor_maps_store`) on the VM-backed
/// driver modelling sm_90 equals `--backend vm --vm-arch sm_90` bit for bit. With no variable set
/// both pick it at d128 (the measured table); `MEMATTN_HOPPER=0` keeps the sm_80 kernel there,
/// `MEMATTN_HOPPER=1` picks it at d64 too, where the table keeps the sm_80 kernel; another value
/// is refused naming the variable (exit 2).
#[test]
fn the_hopper_forward_on_the_vm_backed_driver_equals_the_vm() {
    let args = |backend: &str, d: &str, out: &PathBuf| -> Vec<String> {
        let mut a: Vec<String> = ["--json", "--backend", backend, "--vm-arch", "sm_90", "run", "--dtype", "bf16"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.extend(
            ["--heads", "4", "--heads-kv", "2", "--seq-q", "150", "--seq-kv", "201", "--head-dim", d, "--causal"]
                .iter()
                .map(|s| s.to_string()),
        );
        a.extend(["--output".to_string(), out.to_str().unwrap().to_string()]);
        a
    };
    let mut outs = Vec::new();
    let cases = [
        ("cuda", "128", None, "flash_fwd_bf16_sm90_d128"),
        ("vm", "128", None, "flash_fwd_bf16_sm90_d128"),
        ("cuda", "128", Some("0"), "flash_fwd_bf16_d128"),
        ("cuda", "64", None, "flash_fwd_bf16_d64"),
        ("cuda", "64", Some("1"), "flash_fwd_bf16_sm90_d64"),
        ("vm", "64", Some("1"), "flash_fwd_bf16_sm90_d64"),
    ];
    for (backend, d, hopper, want) in cases {
        let out = tmp(&format!("sm90-{backend}-{d}-{}.safetensors", hopper.unwrap_or("unset")));
        let a = args(backend, d, &out);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let mut envs = vec![("VM_CUDA_ARCH", "sm_90")];
        envs.extend(hopper.map(|h| ("MEMATTN_HOPPER", h)));
        let o = memattn_with(&vm_cuda(), &envs, &a);
        assert_eq!(code(&o), 0, "{backend} d{d} {hopper:?}: {}", stderr(&o));
        let v = json(&o);
        assert_eq!(v["verified"], true, "{v}");
        assert!(v.to_string().contains(want), "{backend} d{d} {hopper:?}: {want} not in {v}");
        assert_eq!(v["memory"]["peak_delta_bytes"], v["analytic_bytes"]["total"], "{backend} d{d} {hopper:?}: {v}");
        outs.push(std::fs::read(&out).unwrap());
    }
    assert!(outs[0] == outs[1], "O and LSE differ between the Hopper forward on the driver and in the VM (d128)");
    assert!(outs[4] == outs[5], "O and LSE differ between the Hopper forward on the driver and in the VM (d64)");
    let out = tmp("sm90-bad-hopper.safetensors");
    let a = args("cuda", "128", &out);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let o = memattn_with(&vm_cuda(), &[("VM_CUDA_ARCH", "sm_90"), ("MEMATTN_HOPPER", "yes")], &a);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("MEMATTN_HOPPER=\"yes\"") && stderr(&o).contains("use 1"), "{}", stderr(&o));
    assert!(!out.exists(), "nothing is written after a refused setting");
}

/// NVML reports utilisation over the past sample period, so a launch that starts and ends
/// between two samples still shows: with samples half a second apart the short launch runs
/// wholly between the first sample and the last, and the last one must see it.
#[test]
fn a_launch_between_two_nvml_samples_still_shows_as_busy() {
    let o =
        memattn(&["--json", "--backend", "cuda", "--nvml-interval-ms", "500", "run", "--heads", "2", "--seq-q", "9"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let m = &json(&o)["memory"];
    assert!(m["source"].as_str().unwrap().contains("every 500000 us"), "{m}");
    assert_eq!(m["gpu_util_max_percent"], 100, "the launch ran during the last sample period: {m}");
    // The NVML reading taken with every buffer allocated holds the peak the samples missed.
    assert!(!m["notes"].to_string().contains("NVML peak below"), "{m}");
    assert_eq!(m["peak_delta_bytes"], m["peak_bytes"].as_u64().unwrap() - m["before_bytes"].as_u64().unwrap(), "{m}");
}

#[test]
fn compare_and_sweep_on_the_vm_backed_driver() {
    let o = memattn(&["--json", "--backend", "cuda", "compare", "--heads", "2", "--seq-q", "40", "--seq-kv", "70"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["verified"], true);
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for r in runs {
        let rep = &r["report"];
        assert_eq!(rep["memory"]["peak_delta_bytes"], rep["analytic_bytes"]["total"], "{}: {rep}", r["kernel"]);
    }
    // naive's score matrix: 2 heads x 40 x 70 f32.
    assert_eq!(v["comparisons"][0]["memory_saved_bytes"], 2 * 40 * 70 * 4);
    // The same outputs as in the VM: the same errors against the reference, to the last bit.
    let o = memattn(&["--json", "--backend", "vm", "compare", "--heads", "2", "--seq-q", "40", "--seq-kv", "70"]);
    let vm = json(&o);
    for (c, m) in runs.iter().zip(vm["runs"].as_array().unwrap()) {
        assert_eq!(c["kernel"], m["kernel"]);
        for field in ["rel_rms_err", "max_abs_err", "lse_err"] {
            assert_eq!(c["report"][field], m["report"][field], "{} {field}", c["kernel"]);
        }
        assert_eq!(c["report"]["memory"]["peak_delta_bytes"], m["report"]["memory"]["peak_delta_bytes"]);
    }

    // 2 MiB of device memory: at seq 256 naive (2 MiB + 4 KiB) does not fit, which the CUDA
    // backend learns from cuMemGetInfo before allocating.
    let o = memattn_with(
        &vm_cuda(),
        &[("VM_CUDA_MEMORY_MIB", "2")],
        &["--json", "--backend", "cuda", "sweep", "--vary", "seq=32,256", "--heads", "4", "--no-plot"],
    );
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    let pts = v["points"].as_array().unwrap();
    assert_eq!(pts.len(), 4);
    let naive_256 = pts.iter().find(|p| p["value"] == "256" && p["kernel"] == "naive").unwrap();
    assert_eq!(naive_256["ran"], false, "{naive_256}");
    assert!(naive_256["reason"].as_str().unwrap().contains("free"), "{naive_256}");
    let flash_256 = pts.iter().find(|p| p["value"] == "256" && p["kernel"] == "flash").unwrap();
    assert_eq!(flash_256["report"]["verified"], true, "{flash_256}");
}

#[test]
fn doctor_and_kernels_say_the_driver_is_vm_backed() {
    let o = memattn(&["--json", "doctor"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["cuda"]["available"], true, "{v}");
    let detail = v["cuda"]["detail"].as_str().unwrap();
    assert!(detail.contains("MEMATTN_CUDA_DRIVER") && detail.contains("VM-backed"), "{detail}");
    let gpu = &v["gpus"][0];
    assert!(gpu["name"].as_str().unwrap().contains("ptx-vm"), "NVML from the same library: {gpu}");
    assert_eq!(gpu["memory_total_bytes"], 16u64 << 30);
    assert_eq!(gpu["compute_capability"], "8.0");
    // The next step names the VM-backed driver's memory, not a GPU's.
    let next = v["next_step"].as_str().unwrap_or_default();
    assert!(next.contains("VM-backed driver's simulated memory") && !next.contains("GPU's free memory"), "{next}");
    let o = memattn(&["--backend", "cuda", "kernels"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    // `--backend vm` where a driver loads: doctor still describes the VM, the device every
    // command will then use, with its options.
    let o = memattn(&["--backend", "vm", "--vm-memory-mib", "64", "doctor"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("== the device every command will use: the PTX VM (--backend vm)"), "{out}");
    assert!(out.contains("simulated device memory: 64.00 MiB (set by --vm-memory-mib)"), "{out}");
}

#[test]
fn ptx_the_driver_cannot_load_exits_3_with_the_jit_log() {
    let f = tmp("broken.ptx");
    std::fs::write(
        &f,
        ".version 7.0\n.target sm_80\n.address_size 64\n.visible .entry k(\n)\n{\n\tfrobnicate.f32 %r1;\n}\n",
    )
    .unwrap();
    let o = memattn(&["--backend", "cuda", "--ptx", f.to_str().unwrap(), "run", "--seq", "8", "--heads", "1"]);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("PTX does not load") && err.contains("CUDA_ERROR_INVALID_PTX"), "{err}");
    assert!(err.contains("JIT log: ptx-vm: PTX line 7"), "{err}");
}

/// A copy of the library in which `symbol` is renamed (same length), so it lacks that function.
fn library_without(symbol: &str) -> PathBuf {
    let mut bytes = std::fs::read(vm_cuda()).unwrap();
    let find = format!("\0{symbol}\0").into_bytes();
    let mut renamed = find.clone();
    *renamed.iter_mut().rev().nth(1).unwrap() = b'X';
    let mut hits = 0;
    let mut i = 0;
    while i + find.len() <= bytes.len() {
        if bytes[i..i + find.len()] == find[..] {
            bytes[i..i + find.len()].copy_from_slice(&renamed);
            hits += 1;
        }
        i += 1;
    }
    assert!(hits > 0, "`{symbol}` not found in the library's string tables");
    let p = tmp(&format!("without-{symbol}/libvm_cuda.so"));
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn a_driver_lacking_a_function_memattn_calls_exits_3_naming_it() {
    // cuMemsetD32_v2 is first called to poison the outputs, after the context and module exist.
    let lib = library_without("cuMemsetD32_v2");
    for args in
        [&["--backend", "cuda", "run", "--seq", "16", "--heads", "1"][..], &["--backend", "cuda", "--json", "run"][..]]
    {
        let o = memattn_with(&lib, &[], args);
        assert_eq!(code(&o), 3, "{args:?}: {}", stderr(&o));
        let err = if args.contains(&"--json") { json(&o)["error"].as_str().unwrap().to_string() } else { stderr(&o) };
        assert!(err.contains("lacks `cuMemsetD32_v2`"), "{err}");
        assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    }
    let o = memattn_with(&lib, &[], &["--json", "doctor"]);
    assert_eq!(code(&o), 0);
    let v = json(&o);
    assert_eq!(v["cuda"]["available"], false);
    assert!(v["cuda"]["reason"].as_str().unwrap().contains("cuMemsetD32_v2"), "{v}");
}

#[test]
fn any_cudarc_program_gets_it_through_ld_library_path() {
    // What a user does for a program that has no MEMATTN_CUDA_DRIVER: a directory with the
    // names cudarc and nvml-wrapper ask for, on LD_LIBRARY_PATH.
    let dir = tmp("ld-library-path");
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["libcuda.so", "libnvidia-ml.so.1"] {
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(vm_cuda(), &link).unwrap();
    }
    let o = Command::new(env!("CARGO_BIN_EXE_memattn"))
        .args(["--json", "--backend", "cuda", "run", "--heads", "1", "--seq", "24"])
        .env("MEMATTN_TEST", "1")
        .env_remove("MEMATTN_CUDA_DRIVER")
        .env("LD_LIBRARY_PATH", &dir)
        .env("VM_CUDA_ARCH", "sm_90")
        .output()
        .unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["verified"], true);
    assert!(
        v["device"].as_str().unwrap().contains("VM-backed") && v["device"].as_str().unwrap().contains("sm_90"),
        "{v}"
    );
    // NVML came from the same library through its own name: it saw the run's buffers.
    assert!(v["memory"]["source"].as_str().unwrap().starts_with("nvml"), "{}", v["memory"]);
    assert_eq!(v["memory"]["peak_bytes"], v["analytic_bytes"]["total"]);
}

#[test]
fn every_driver_function_memattn_resolves_is_in_the_probe_list() {
    // The dynamic loader logs each symbol lookup (glibc's LD_DEBUG): every `cu*` function that
    // cudarc resolves during run, compare (naive and flash, f32 and bf16) and doctor must be one
    // the probe checks, or a driver lacking it would panic instead of exiting 3.
    let dir = tmp("ld-debug");
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("log");
    let runs: [&[&str]; 3] = [
        &["--backend", "cuda", "compare", "--heads", "1", "--seq", "24"],
        &["--backend", "cuda", "run", "--dtype", "bf16", "--heads", "1", "--seq", "24"],
        &["--backend", "cuda", "doctor"],
    ];
    for args in runs {
        let o = memattn_with(&vm_cuda(), &[("LD_DEBUG", "symbols"), ("LD_DEBUG_OUTPUT", log.to_str().unwrap())], args);
        assert_eq!(code(&o), 0, "{args:?}: {}", stderr(&o));
    }
    let mut seen = std::collections::BTreeSet::new();
    for f in std::fs::read_dir(&dir).unwrap() {
        let text = std::fs::read_to_string(f.unwrap().path()).unwrap();
        for line in text.lines().filter(|l| l.contains("libvm_cuda.so")) {
            if let Some(name) = line.split("symbol=").nth(1).and_then(|r| r.split(';').next()) {
                if name.starts_with("cu") {
                    seen.insert(name.to_string());
                }
            }
        }
    }
    assert!(seen.contains("cuInit") && seen.contains("cuLaunchKernel"), "the loader logged no lookups: {seen:?}");
    let listed = memattn_cli::device::cuda::REQUIRED_DRIVER_FUNCTIONS;
    let missing: Vec<&String> = seen.iter().filter(|s| !listed.contains(&s.as_str())).collect();
    assert!(missing.is_empty(), "resolved but not checked by the probe: {missing:?}");
}

#[test]
fn a_memcheck_finding_is_a_launch_failure_naming_it() {
    // The flash kernel without the barrier before its K/V tile refill (as in cli.rs): on the
    // VM-backed driver the race is CUDA_ERROR_LAUNCH_FAILED carrying the finding (exit 3); with
    // the checks off the kernel finishes and verification catches the damage (exit 1).
    let ptx = memattn_cli::ptx::PtxSource::embedded().text;
    let start = ptx.find(".entry flash_fwd_f32_d64(").unwrap();
    let at = start + ptx[start..].find("bar.sync").unwrap();
    let path = tmp("no-barrier.ptx");
    std::fs::write(&path, format!("{}// removed: {}", &ptx[..at], &ptx[at..])).unwrap();
    let args = [
        "--backend",
        "cuda",
        "--ptx",
        path.to_str().unwrap(),
        "run",
        "--heads",
        "2",
        "--seq-q",
        "96",
        "--seq-kv",
        "200",
    ];
    let o = memattn(&args);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("CUDA_ERROR_LAUNCH_FAILED") && err.contains("shared memory race"), "{err}");
    let o = memattn_with(&vm_cuda(), &[("VM_CUDA_ALLOW", "initcheck,racecheck")], &args);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
}

/// `decode --splits auto` plans for the device's multiprocessor count on CUDA (the VM-backed
/// driver models 108 SMs at sm_80 and 132 at sm_90), for `--sms` when given, and for 132 on the
/// VM; the output says which.
#[test]
fn decode_plans_for_the_device_multiprocessor_count() {
    let args = ["--json", "--backend", "cuda", "decode", "--heads", "4", "--cache-len", "100", "--repeats", "1"];
    let plan = |o: &Output| {
        assert_eq!(code(o), 0, "{}", stderr(o));
        let v = json(o);
        assert_eq!(v["verified"], true);
        (v["plan"]["sm_count"].as_u64().unwrap(), v["plan"]["sm_count_source"].as_str().unwrap().to_string())
    };
    assert_eq!(plan(&memattn(&args)), (108, "device".into()));
    assert_eq!(plan(&memattn_with(&vm_cuda(), &[("VM_CUDA_ARCH", "sm_90")], &args)), (132, "device".into()));
    let given: Vec<&str> = args.iter().copied().chain(["--sms", "20"]).collect();
    assert_eq!(plan(&memattn(&given)), (20, "given".into()));
    let mut vm = args;
    vm[2] = "vm";
    assert_eq!(plan(&memattn(&vm)), (132, "default".into()));
    let o = memattn(&args[1..]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("on 108 SMs (the device's multiprocessor count)"));
}

/// `run --cp N --cp-comm nccl` on the VM-backed driver: one GPU is seen, so two ranks are refused
/// naming the count; one rank needs NCCL, which a machine without it refuses naming the library
/// names tried (exit 3 both, never a panic). Where NCCL is installed the second case is skipped:
/// NCCL would drive the real GPU driver, not the VM-backed one.
#[test]
fn cp_over_nccl_names_what_is_missing() {
    let o = memattn(&["--backend", "cuda", "run", "--cp", "2", "--cp-comm", "nccl", "--seq", "64"]);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    assert!(stderr(&o).contains("needs 2 GPUs (one per rank); the driver sees 1"), "{}", stderr(&o));
    if memattn::cp::nccl::available() {
        eprintln!("SKIPPED: the one-rank case (NCCL is installed here and would use the real driver)");
        return;
    }
    let o = memattn(&["--backend", "cuda", "run", "--cp", "1", "--cp-comm", "nccl", "--seq", "64"]);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("no NCCL library loads") && e.contains("libnccl.so"), "{e}");
    assert!(!e.contains("panicked"), "{e}");
}
