//! `run --timeline FILE`: the forward from the timeline module, a Chrome trace of every warp's
//! phases and its picture, in the VM (the clock: the warp's executed instructions).

use crate::common;
use common::*;
use std::collections::BTreeMap;
use std::path::PathBuf;

fn dir() -> PathBuf {
    let d = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("memattn-timeline-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The tile of `kernel` as `memattn --json kernels` lists it: (warps per block, br, bc).
fn tile(kernel: &str) -> (u64, u64, u64) {
    let o = memattn(&["--json", "kernels"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    let k = v["kernels"].as_array().unwrap().iter().find(|k| k["name"] == kernel).expect("kernel listed");
    let t = &k["tile"];
    (t["warps"].as_u64().unwrap(), t["br"].as_u64().unwrap(), t["bc"].as_u64().unwrap())
}

/// Each warp's phase names in order, by (block, warp), after checking that every event is a
/// complete event with a non-negative duration that starts where the warp's last one ended.
fn tracks(trace: &serde_json::Value) -> BTreeMap<(u64, u64), Vec<String>> {
    let mut out: BTreeMap<(u64, u64), Vec<String>> = BTreeMap::new();
    let mut end: BTreeMap<(u64, u64), f64> = BTreeMap::new();
    for e in trace["traceEvents"].as_array().expect("traceEvents") {
        if e["ph"] == "M" {
            continue;
        }
        assert_eq!(e["ph"], "X", "{e}");
        let key = (e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap());
        let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
        assert!(dur >= 0.0, "{e}");
        if let Some(&last) = end.get(&key) {
            assert_eq!(ts, last, "phases of a warp follow each other: {e}");
        }
        end.insert(key, ts + dur);
        out.entry(key).or_default().push(e["name"].as_str().unwrap().to_string());
    }
    out
}

/// The phases the sm_80 forward's structure gives a warp that computes every one of `tiles` key
/// tiles: the prologue (Q and the first K, one wait and barrier), then per key tile the wait for
/// K, its barrier, the copies of V, QKᵀ and the softmax, the wait for V, its barrier, the copies
/// of the next K and P·V; the epilogue last.
fn expected_phases(tiles: u64) -> Vec<String> {
    let mut v = vec!["prologue", "wait K/V", "barrier", "prologue"];
    for _ in 0..tiles {
        v.extend(["wait K/V", "barrier", "load K/V", "QK^T", "softmax", "wait K/V", "barrier", "load K/V", "PV"]);
    }
    v.push("epilogue");
    v.into_iter().map(String::from).collect()
}

fn run_timeline(dtype: &str, extra: &[&str], name: &str) -> (std::process::Output, PathBuf) {
    let trace = dir().join(name);
    let mut args = vec!["--backend", "vm", "--json", "run", "--timeline", trace.to_str().unwrap(), "--dtype", dtype];
    args.extend(["--head-dim", "128", "--seq", "512", "--heads", "2"]);
    args.extend(extra);
    (memattn(&args), trace)
}

#[test]
fn timeline_has_a_track_per_warp_with_the_forwards_phases_in_order() {
    let (o, trace) = run_timeline("bf16", &[], "bf16.json");
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["verified"], true);
    assert_eq!(v["timeline_file"], trace.to_str().unwrap());
    let t: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    assert_eq!(t["otherData"]["kernel"], "flash_fwd_bf16_d128");
    assert!(t["otherData"]["ts_unit"].as_str().unwrap().contains("instructions"), "{}", t["otherData"]);
    assert_eq!(t["otherData"]["dropped_stamps"], 0);
    let (warps, br, bc) = tile("flash_fwd_bf16_d128");
    assert_eq!(t["otherData"]["warps_per_block"], warps);
    let blocks = 512u64.div_ceil(br) * 2;
    let tr = tracks(&t);
    let want: Vec<(u64, u64)> = (0..blocks).flat_map(|b| (0..warps).map(move |w| (b, w))).collect();
    assert_eq!(tr.keys().copied().collect::<Vec<_>>(), want, "one track per warp of every block");
    let phases = expected_phases(512 / bc);
    for (k, names) in &tr {
        assert_eq!(names, &phases, "block {} warp {}", k.0, k.1);
    }
    // Every track and block is named for the viewer.
    let named = t["traceEvents"].as_array().unwrap().iter().filter(|e| e["name"] == "thread_name").count();
    assert_eq!(named as u64, blocks * warps);
    // The picture next to it.
    let svg = std::fs::read_to_string(trace.with_extension("svg")).unwrap();
    assert!(svg.starts_with("<svg") || svg.starts_with("<?xml"), "{}", &svg[..svg.len().min(80)]);
    for phase in ["wait K/V", "barrier", "QK^T", "softmax", "PV", "epilogue"] {
        assert!(svg.contains(phase), "legend names {phase}");
    }
}

#[test]
fn timeline_causal_warps_skip_the_products_of_tiles_outside_their_rows() {
    // Causal, f16: a warp's tiles past its last row are staged but not computed (wait, barrier
    // and copies only), so the warps of one block differ; the order stays the kernel's.
    let png = dir().join("f16.png");
    let (o, trace) = run_timeline("f16", &["--causal", "--timeline-picture", png.to_str().unwrap()], "f16.json");
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
    let t: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    assert_eq!(t["otherData"]["kernel"], "flash_fwd_f16_d128");
    let tr = tracks(&t);
    let step = ["wait K/V", "barrier", "load K/V"];
    let mut computed = Vec::new();
    for (k, names) in &tr {
        assert_eq!(&names[..4], ["prologue", "wait K/V", "barrier", "prologue"], "{k:?}");
        assert_eq!(names.last().unwrap(), "epilogue", "{k:?}");
        let mut rest = &names[4..names.len() - 1];
        let mut n = 0;
        while !rest.is_empty() {
            assert_eq!(&rest[..3], step, "{k:?}: {names:?}");
            let active = rest.get(3).is_some_and(|p| p == "QK^T");
            let half = if active { 5 } else { 3 };
            assert!(!active || rest[3..5] == ["QK^T", "softmax"], "{k:?}");
            rest = &rest[half..];
            assert_eq!(&rest[..3], step, "{k:?}: {names:?}");
            let pv = if active { 4 } else { 3 };
            assert!(!active || rest[3] == "PV", "{k:?}");
            rest = &rest[pv..];
            n += active as usize;
        }
        computed.push(n);
    }
    assert!(computed.iter().min() < computed.iter().max(), "causal warps compute different tile counts: {computed:?}");
}

#[test]
fn timeline_stamps_do_not_change_the_result() {
    let d = dir();
    let (plain, stamped) = (d.join("plain.safetensors"), d.join("stamped.safetensors"));
    let common = ["--dtype", "bf16", "--head-dim", "128", "--seq", "256", "--heads", "1", "--seed", "3"];
    let mut a = vec!["--backend", "vm", "run", "--output", plain.to_str().unwrap()];
    a.extend(common);
    let o = memattn(&a);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let trace = d.join("same.json");
    let mut b = vec!["--backend", "vm", "run", "--output", stamped.to_str().unwrap()];
    b.extend(["--timeline", trace.to_str().unwrap()]);
    b.extend(common);
    let o = memattn(&b);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).contains("wrote the timeline of"), "{}", stdout(&o));
    assert_eq!(std::fs::read(&plain).unwrap(), std::fs::read(&stamped).unwrap(), "same O and LSE, bit for bit");
}

#[test]
fn timeline_refuses_what_it_cannot_stamp() {
    let trace = dir().join("refused.json");
    let t = trace.to_str().unwrap();
    for (args, why) in [
        (vec!["--head-dim", "64"], "launches flash_fwd_bf16_d64"),
        (vec!["--kernel", "naive"], "--kernel flash"),
        (vec!["--backward"], "not --backward"),
        (vec!["--dtype", "f32"], "launches flash_fwd_f32"),
    ] {
        let mut a = vec!["--backend", "vm", "run", "--timeline", t, "--seq", "64", "--heads", "1"];
        if !args.contains(&"--dtype") {
            a.extend(["--dtype", "bf16"]);
        }
        a.extend(args.iter().copied());
        let o = memattn(&a);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        let e = stderr(&o);
        assert!(
            e.contains(why) && e.contains("flash_fwd_bf16_d128, flash_fwd_f16_d128, flash_fwd_bf16_sm90_d128"),
            "{args:?}: {e}"
        );
        assert!(!trace.exists());
    }
}

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

#[test]
fn timeline_on_the_cuda_backend_sets_the_module_variable_through_the_driver() {
    // The CUDA road (cuModuleGetGlobal, a copy to the variable) on the VM-backed driver: its
    // %globaltimer is the VM's instruction count, which the trace then reads as nanoseconds.
    let trace = dir().join("cuda.json");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_memattn"))
        .args(["--backend", "cuda", "--json", "run", "--timeline", trace.to_str().unwrap()])
        .args(["--dtype", "bf16", "--head-dim", "128", "--seq", "256", "--heads", "1"])
        .env("MEMATTN_TEST", "1")
        .env("MEMATTN_CUDA_DRIVER", vm_cuda())
        .output()
        .unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["verified"], true);
    assert_eq!(v["backend"], "cuda");
    let t: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    assert!(t["otherData"]["clock"].as_str().unwrap().contains("globaltimer"));
    let (warps, br, bc) = tile("flash_fwd_bf16_d128");
    let tr = tracks(&t);
    // One track per warp of every block: 256 query rows in blocks of `br`.
    assert_eq!(tr.len() as u64, warps * 256u64.div_ceil(br));
    for names in tr.values() {
        assert_eq!(names, &expected_phases(256 / bc));
    }
}

#[test]
fn timeline_of_the_hopper_forward_shows_the_producer_and_the_consumers() {
    // The VM modelling an sm_90 GPU runs the Hopper forward from the sm_90a timeline module:
    // warp 0 is the producer (TMA copies, waiting for free stages), warps 1-3 of its warpgroup
    // leave after the first barrier, and the two consumer warpgroups (warps 4-11) compute.
    let trace = dir().join("sm90.json");
    let o = bin()
        .args(["--backend", "vm", "--vm-arch", "sm_90", "--json", "run", "--timeline", trace.to_str().unwrap()])
        .args(["--dtype", "bf16", "--head-dim", "128", "--seq", "512", "--heads", "1"])
        .env("MEMATTN_HOPPER", "1")
        .output()
        .unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(json(&o)["verified"], true);
    let t: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    assert_eq!(t["otherData"]["kernel"], "flash_fwd_bf16_sm90_d128");
    // `memattn kernels` lists the sm_80 module; the Hopper row's tile from the library's table.
    let v = kernels_gpu::KernelId::FlashFwdBf16Sm90D128.variant();
    let (warps, br, bc) = ((v.threads() / 32) as u64, v.block_rows() as u64, v.block_cols() as u64);
    assert_eq!(warps, 12);
    assert_eq!(t["otherData"]["warps_per_block"], warps);
    let tr = tracks(&t);
    let blocks = 512u64.div_ceil(br);
    assert_eq!(tr.len() as u64, blocks * warps, "one track per warp");
    let tiles = 512 / bc;
    for ((b, w), names) in &tr {
        let mut want = vec!["prologue", "barrier"];
        match w {
            0 => {
                want.push("load K/V");
                for _ in 0..tiles {
                    want.extend(["wait slot", "load K/V", "wait slot", "load K/V"]);
                }
            }
            1..=3 => {}
            _ => {
                want.push("wait K/V");
                for _ in 0..tiles {
                    want.extend(["wait K/V", "barrier", "QK^T", "softmax", "wait K/V", "PV"]);
                }
                want.push("epilogue");
            }
        }
        assert_eq!(names, &want, "block {b} warp {w}");
    }
    let svg = std::fs::read_to_string(trace.with_extension("svg")).unwrap();
    assert!(svg.contains("wait slot"), "the legend names the producer's phase");
}
