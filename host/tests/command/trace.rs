//! `memattn trace`: typed values, Rust lines, filters, the trace kept up to a finding, and the
//! default problem stated when it differs from `run`'s.

use crate::common;
use common::*;

const PTX: &str = include_str!("../../../kernels-gpu/ptx/memattn_kernels.ptx");

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
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("memattn-trace-{}", std::process::id()));
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

/// A hand-written kernel with a line table, as rustc writes one: `x[i] += 1` for `i < n`, the
/// Rust lines in `lessons/scratch/add_one.rs` (no such file is needed to trace it).
const ADD_ONE: &str = "\
.version 8.0
.target sm_80
.address_size 64

.visible .entry add_one_f32(
\t.param .u32 add_one_f32_param_0,
\t.param .u64 add_one_f32_param_1
)
{
\t.reg .pred %p<2>;
\t.reg .b32 %r<5>;
\t.reg .f32 %f<3>;
\t.reg .b64 %rd<4>;

\t.loc\t1 5 0
\tld.param.u32 %r1, [add_one_f32_param_0];
\tld.param.u64 %rd1, [add_one_f32_param_1];
\t.loc\t1 6 13
\tmov.u32 %r2, %tid.x;
\tmov.u32 %r3, %ctaid.x;
\tmov.u32 %r4, %ntid.x;
\tmad.lo.s32 %r2, %r3, %r4, %r2;
\t.loc\t1 7 8
\tsetp.ge.u32 %p1, %r2, %r1;
\t@%p1 bra $L__BB0_2;
\t.loc\t1 8 9
\tcvta.to.global.u64 %rd2, %rd1;
\tmul.wide.u32 %rd3, %r2, 4;
\tadd.s64 %rd2, %rd2, %rd3;
\tld.global.f32 %f1, [%rd2];
\tadd.f32 %f2, %f1, 0f3F800000;
\tst.global.f32 [%rd2], %f2;
$L__BB0_2:
\t.loc\t1 10 1
\tret;
}
\t.file\t1 \"lessons/scratch/add_one.rs\"
";

fn add_one_ptx(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("memattn-trace-entry-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}.ptx"));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn any_entry_is_traced_with_its_rust_lines_and_a_finding_ends_the_trace() {
    let path = add_one_ptx("add-one", ADD_ONE);
    let p = path.to_str().unwrap();
    let launch = |n: &str, len: &str, thread: &str, json: bool| {
        let mut args = vec!["--backend", "vm", "--ptx", p, "trace", "--entry", "add_one_f32", "--grid", "2"];
        args.extend(["--block-dim", "4", "--block", "1", "--thread", thread, "--arg", n, "--arg", "buf=x"]);
        args.extend(["--buf", len]);
        if json {
            args.insert(0, "--json");
        }
        memattn(&args)
    };
    // Element 5 (block 1, thread 1) of six: 5 + 1, on Rust line 8.
    let o = launch("u32=6", "x=f32:6:iota", "1", true);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let v = json(&o);
    assert_eq!(v["kernel"], "add_one_f32", "{v}");
    assert_eq!(v["block_dim"], serde_json::json!([4, 1, 1]));
    assert!(v["verified"].is_null() && v["error"].is_null(), "{v}");
    let e = v["entries"].as_array().unwrap();
    let add = e.iter().find(|x| x["text"].as_str().unwrap().starts_with("add.f32")).expect("the add");
    assert_eq!(add["source"], "lessons/scratch/add_one.rs:8", "{add}");
    assert_eq!(add["writes"][0]["value"], "6", "{add}");
    assert!(e.iter().all(|x| x["source"].is_string()), "every instruction has a Rust line: {v}");
    // The text form names the lines as it does for flash.
    let o = launch("u32=6", "x=f32:6:iota", "1", false);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("trace of `add_one_f32` block [1, 0, 0] thread [1, 0, 0] (grid [2, 1, 1], block [4, 1, 1])"),
        "{out}"
    );
    assert!(out.contains("-- lessons/scratch/add_one.rs:8") && out.contains("nothing to verify"), "{out}");
    // Element 7 is past n = 6: the guarded branch is taken and the body never runs.
    let o = launch("u32=6", "x=f32:6:iota", "3", true);
    let v = json(&o);
    assert!(!v["entries"].as_array().unwrap().iter().any(|x| x["text"].as_str().unwrap().starts_with("ld.global")));
    // n = 8 over a 6-element buffer: element 6 is an out-of-bounds load on line 8, the last entry.
    let o = launch("u32=8", "x=f32:6:iota", "2", true);
    assert_eq!(o.status.code(), Some(3), "{}", String::from_utf8_lossy(&o.stderr));
    let v = json(&o);
    let last = v["entries"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["finding"], "out-of-bounds global load", "{last}");
    assert_eq!(last["source"], "lessons/scratch/add_one.rs:8", "{last}");
    assert!(v["error"].as_str().unwrap().contains("in lessons/scratch/add_one.rs:8, buffer x"), "{v}");
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn own_kernel_mistakes_are_usage_errors_that_say_what_to_give() {
    let path = add_one_ptx("usage", ADD_ONE);
    let p = path.to_str().unwrap();
    let base = ["--backend", "vm", "--ptx", p, "trace"];
    let bad = |extra: &[&str], why: &str| {
        let o = memattn(&[&base[..], extra].concat());
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains(why), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    };
    // Without --entry: the module has no flash kernel, and the message names its entries.
    bad(&[], "add --entry NAME");
    bad(&[], "(add_one_f32)");
    let run = ["--entry", "add_one_f32", "--arg", "u32=4", "--arg", "buf=x", "--buf", "x=f32:4"];
    bad(&[&run[..], &["--block-dim", "4", "--thread", "4"]].concat(), "outside the block [4, 1, 1]");
    bad(&[&run[..], &["--block", "256"]].concat(), "the block size is --block-dim");
    bad(&[&run[..], &["--heads", "2"]].concat(), "are for the naive and flash kernels");
    bad(&[&run[..], &["--arg", "u32=1"]].concat(), "takes 2 parameters");
    bad(&["--grid", "2"], "--entry");
    // An entry the module does not have is bad input (exit 2), as for `memattn launch`.
    let o = memattn(&[&base[..], &["--entry", "nope", "--arg", "u32=4"]].concat());
    assert_eq!(o.status.code(), Some(2), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("nope"));
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[test]
fn an_endless_kernel_is_stopped_at_max_seconds_with_the_trace_up_to_there() {
    let spin = ".version 7.0\n.target sm_80\n.address_size 64\n.visible .entry spin()\n{\n.reg .b32 %r<2>;\n\
        mov.u32 %r1, 0;\nL:\nadd.u32 %r1, %r1, 1;\nbra.uni L;\n}\n";
    let path = add_one_ptx("spin", spin);
    let t = std::time::Instant::now();
    let o = memattn(&[
        "--json",
        "--backend",
        "vm",
        "--ptx",
        path.to_str().unwrap(),
        "trace",
        "--entry",
        "spin",
        "--block-dim",
        "64",
        "--max-seconds",
        "0.25",
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(t.elapsed() < std::time::Duration::from_secs(15), "took {:?}", t.elapsed());
    let v = json(&o);
    assert!(v["error"].as_str().unwrap().contains("launch time limit exceeded"), "{v}");
    assert!(v["entries"].as_array().is_some_and(|e| !e.is_empty()), "the trace up to the stop: {v}");
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}
