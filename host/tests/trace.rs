//! `memattn trace`: typed values, Rust lines, filters, the trace kept up to a finding, and the
//! default problem stated when it differs from `run`'s.

mod common;
use common::*;

const PTX: &str = include_str!("../../kernels-gpu/ptx/memattn_kernels.ptx");

#[test]
fn mma_values_are_f32_and_ldmatrix_values_are_bf16_pairs_with_their_rust_lines() {
    let base = ["--backend", "vm", "--json", "trace", "--kernel", "flash", "--dtype", "bf16", "--max-entries", "3000"];
    let o = memattn(&[&base[..], &["--op", "mma"]].concat());
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let v = json(&o);
    let e = v["entries"].as_array().unwrap();
    assert!(e.len() >= 8, "{} mma entries", e.len());
    for x in e {
        assert!(x["text"].as_str().unwrap().starts_with("mma.sync"), "{x}");
        assert!(x["source"].as_str().unwrap().starts_with("kernels-gpu/src/mma.rs:"), "{x}");
        let w = x["writes"].as_array().unwrap();
        assert_eq!(w.len(), 4, "four f32 accumulators per lane: {x}");
        for r in w {
            let val: f32 = r["value"].as_str().unwrap().parse().unwrap_or_else(|_| panic!("an f32: {r}"));
            let bits = u32::from_str_radix(r["bits"].as_str().unwrap().trim_start_matches("0x"), 16).unwrap();
            assert_eq!(val.to_bits(), bits, "{r}");
        }
    }
    let o = memattn(&[&base[..], &["--op", "ldmatrix"]].concat());
    let v = json(&o);
    let first = &v["entries"][0]["writes"][0];
    let shown = first["value"].as_str().unwrap();
    assert!(shown.contains("(bf16x2"), "{first}");
    let bits = u32::from_str_radix(first["bits"].as_str().unwrap().trim_start_matches("0x"), 16).unwrap();
    let lo = f32::from_bits((bits & 0xffff) << 16);
    let hi = f32::from_bits(bits & 0xffff_0000);
    assert!(shown.starts_with(&format!("[{lo}, {hi}]")), "{shown} vs {lo}, {hi}");
}

#[test]
fn lines_filter_and_the_default_problem_note() {
    let o =
        memattn(&["--backend", "vm", "--json", "trace", "--kernel", "flash", "--thread", "5", "--max-entries", "200"]);
    let v = json(&o);
    let all = v["entries"].as_array().unwrap().clone();
    assert!(v["defaults_differ_from_run"].as_str().unwrap().contains("heads 1 (run: 4)"), "{v}");
    let (a, b) = (all[10]["line"].as_u64().unwrap(), all[20]["line"].as_u64().unwrap());
    let range = format!("{a}-{b}");
    let o = memattn(&[
        "--backend",
        "vm",
        "--json",
        "trace",
        "--kernel",
        "flash",
        "--thread",
        "5",
        "--max-entries",
        "200",
        "--lines",
        &range,
    ]);
    let v = json(&o);
    let some = v["entries"].as_array().unwrap();
    assert!(!some.is_empty() && some.len() < all.len());
    assert!(some.iter().all(|e| (a..=b).contains(&e["line"].as_u64().unwrap())));
    // Every option given: no note; a bad range is a usage error.
    let o = memattn(&["--backend", "vm", "--json", "trace", "--heads", "2", "--seq", "40", "--max-entries", "5"]);
    assert!(json(&o)["defaults_differ_from_run"].is_null());
    let o = memattn(&["--backend", "vm", "trace", "--lines", "9-3"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn a_finding_keeps_the_trace_up_to_the_instruction_that_made_it() {
    // The flash kernel without the barrier before its tile refill (see the guide, chapter 3).
    let mut in_kernel = false;
    let mut removed = false;
    let mut edited = String::new();
    for l in PTX.lines() {
        in_kernel |= l.starts_with(".visible .entry flash_fwd_f32_d64");
        if in_kernel && !removed && l.contains("bar.sync") {
            removed = true;
            continue;
        }
        edited.push_str(l);
        edited.push('\n');
    }
    let dir = std::env::temp_dir().join(format!("memattn-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("no-barrier.ptx");
    std::fs::write(&path, edited).unwrap();
    let p = path.to_str().unwrap();
    let args = [
        "--backend",
        "vm",
        "--json",
        "--ptx",
        p,
        "trace",
        "--heads",
        "2",
        "--seq-q",
        "96",
        "--seq-kv",
        "200",
        "--thread",
        "32",
        "--max-entries",
        "100000",
    ];
    let o = memattn(&args);
    assert_eq!(o.status.code(), Some(3), "{}", String::from_utf8_lossy(&o.stderr));
    let v = json(&o);
    let e = v["entries"].as_array().unwrap();
    assert!(e.len() > 100, "the trace before the finding is kept ({} entries)", e.len());
    let last = e.last().unwrap();
    assert_eq!(last["finding"], "shared memory race", "{last}");
    assert!(last["text"].as_str().unwrap().starts_with("ld.shared"), "{last}");
    assert!(last["source"].as_str().unwrap().starts_with("kernels-gpu/src/flash_fwd_f32.rs:"), "{last}");
    assert!(v["error"].as_str().unwrap().contains("flash_fwd_f32.rs:"), "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}
