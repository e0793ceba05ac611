//! `memattn launch`: any entry point with named buffers and typed arguments.

use crate::common;
use common::*;

const SAXPY: [&str; 14] = [
    "launch",
    "saxpy_f32",
    "--grid",
    "4",
    "--block",
    "256",
    "--arg",
    "u32=1000",
    "--arg",
    "f32=2",
    "--arg",
    "buf=x",
    "--arg",
    "buf=y",
];

#[test]
fn saxpy_from_the_command_line_gives_the_exact_answer() {
    let o = memattn(
        &[
            &["--backend", "vm", "--json"][..],
            &SAXPY,
            &["--buf", "x=f32:1000:iota", "--buf", "y=f32:1000:const=1", "--show", "y", "--count", "1000"],
        ]
        .concat(),
    );
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let y = v["buffers"]["y"]["first"].as_array().unwrap();
    assert_eq!(y.len(), 1000);
    for (i, e) in y.iter().enumerate() {
        assert_eq!(e.as_str().unwrap().parse::<f32>().unwrap(), 2.0 * i as f32 + 1.0, "y[{i}]");
    }
    assert_eq!(v["buffers"]["y"]["poison_elements"], 0);
    assert!(v["thread_instructions"].as_u64().unwrap() > 1000);
    // y left at the default poison: the kernel reads it (y = 2x + y), and the NaN's payload
    // comes through, so the output still shows the poison.
    let o = memattn(&[&["--backend", "vm"][..], &SAXPY, &["--buf", "x=f32:1000:iota", "--buf", "y=f32:1000"]].concat());
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("y[0..16] = [poison, poison"), "{out}");
}

#[test]
fn a_short_buffer_is_a_finding_that_names_it_and_bad_arguments_are_usage_errors() {
    let o = memattn(
        &[&["--backend", "vm"][..], &SAXPY, &["--buf", "x=f32:1000:iota", "--buf", "y=f32:900:zeros"]].concat(),
    );
    assert_eq!(o.status.code(), Some(3));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("buffer y") && err.contains("kernels-gpu/src/smoke.rs:") && err.contains("thread (132,0,0)"),
        "{err}"
    );
    for (bad, why) in [
        (vec!["launch", "saxpy_f32", "--arg", "u32=1"], "takes 4 parameters"),
        (
            vec![
                "launch",
                "saxpy_f32",
                "--arg",
                "u32=1",
                "--arg",
                "buf=x",
                "--arg",
                "buf=x",
                "--arg",
                "buf=x",
                "--buf",
                "x=f32:4",
            ],
            "is `.f32`",
        ),
        (vec!["launch", "saxpy_f32", "--grid", "0"], "at least 1"),
        (vec!["launch", "saxpy_f32", "--buf", "x=f64:4"], "unknown type"),
        (vec!["launch", "saxpy_f32", "--arg", "q32=1"], "TYPE=VALUE"),
    ] {
        let o = memattn(&[&["--backend", "vm"][..], &bad].concat());
        assert_eq!(o.status.code(), Some(2), "{bad:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(why), "{bad:?}: {err}");
    }
    // A kernel the module does not have is a bad argument, not a device error.
    let o = memattn(&["--backend", "vm", "launch", "no_such_kernel"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no entry point `no_such_kernel`"));
}

#[test]
fn a_launch_that_would_run_for_hours_stops_at_its_time_limit() {
    // saxpy over 0 elements on 2^31 - 1 blocks: every block returns at once, and there are
    // billions of them. `--max-seconds 0.25` stops it as a hang (exit 3) in about a quarter second.
    let t = std::time::Instant::now();
    let o = memattn(&[
        "--backend",
        "vm",
        "launch",
        "saxpy_f32",
        "--grid",
        "2147483647",
        "--block",
        "256",
        "--arg",
        "u32=0",
        "--arg",
        "f32=2",
        "--arg",
        "buf=x",
        "--arg",
        "buf=y",
        "--buf",
        "x=f32:4",
        "--buf",
        "y=f32:4",
        "--max-seconds",
        "0.25",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(err.contains("launch time limit exceeded"), "{err}");
    assert!(t.elapsed() < std::time::Duration::from_secs(15), "took {:?}", t.elapsed());
}

/// `--max-seconds` takes 0 (no limit) or 0.001 to 1000000 seconds, fractions included; anything
/// else is a usage error (exit 2) naming the option, never a panic.
#[test]
fn max_seconds_outside_its_range_is_a_usage_error() {
    for bad in ["-1", "nan", "inf", "0.0001", "1e7", "x"] {
        for cmd in [&["launch", "saxpy_f32"][..], &["trace", "--entry", "saxpy_f32"][..]] {
            let o = memattn(&[cmd, &["--max-seconds", bad]].concat());
            let err = stderr(&o);
            assert_eq!(code(&o), 2, "{cmd:?} --max-seconds {bad}: {err}");
            assert!(err.contains("--max-seconds") && err.contains("0.001 to 1000000"), "{err}");
            assert!(!err.contains("panicked"), "{err}");
        }
    }
}

/// A 32 x 32 f32 transpose through a shared tile, one thread per element (block 32 x 32, one
/// warp per row `ty`): `x[ty][tx]` stored at `tile[ty * STRIDE + tx]`, `y[ty][tx]` read from
/// `tile[tx * STRIDE + ty]`.
fn transpose_ptx(stride: u32) -> String {
    format!(
        ".version 7.0\n.target sm_80\n.address_size 64\n.shared .align 4 .b8 tile[{bytes}];\n\
         .visible .entry transpose32(\n\t.param .u64 in,\n\t.param .u64 out\n)\n{{\n\
         \t.reg .b32 %r<6>;\n\t.reg .b64 %rd<12>;\n\t.reg .f32 %f<2>;\n\
         \tld.param.u64 %rd1, [in];\n\tld.param.u64 %rd2, [out];\n\
         \tcvta.to.global.u64 %rd1, %rd1;\n\tcvta.to.global.u64 %rd2, %rd2;\n\
         \tmov.u32 %r1, %tid.x;\n\tmov.u32 %r2, %tid.y;\n\
         \tshl.b32 %r3, %r2, 5;\n\tadd.s32 %r3, %r3, %r1;\n\tmul.wide.u32 %rd3, %r3, 4;\n\
         \tadd.s64 %rd4, %rd1, %rd3;\n\tld.global.f32 %f1, [%rd4];\n\
         \tmul.lo.s32 %r4, %r2, {stride};\n\tadd.s32 %r4, %r4, %r1;\n\tmul.wide.u32 %rd5, %r4, 4;\n\
         \tmov.u64 %rd6, tile;\n\tadd.s64 %rd7, %rd6, %rd5;\n\tst.shared.f32 [%rd7], %f1;\n\
         \tbar.sync 0;\n\
         \tmul.lo.s32 %r5, %r1, {stride};\n\tadd.s32 %r5, %r5, %r2;\n\tmul.wide.u32 %rd8, %r5, 4;\n\
         \tadd.s64 %rd9, %rd6, %rd8;\n\tld.shared.f32 %f1, [%rd9];\n\
         \tadd.s64 %rd11, %rd2, %rd3;\n\tst.global.f32 [%rd11], %f1;\n\tret;\n}}\n",
        bytes = 32 * stride * 4
    )
}

/// `launch --vm-bank-conflicts` counts the shared-memory wavefronts. The unpadded transpose
/// reads a column of the tile: word `tx * 32 + ty` is in bank `ty` for every lane, so each of the
/// 32 warps' reads takes 32 wavefronts (32-way, 1024 in all for a minimum of 32); its stores
/// (a row, 32 banks) take one each. Padded to 33 words a row, lane `tx` reads bank
/// `(tx + ty) % 32`: no conflicts. Both transpose correctly.
#[test]
fn launch_reports_the_bank_conflicts_of_a_transpose() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("memattn-launch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let run = |stride: u32, json: bool| {
        let f = dir.join(format!("transpose{stride}.ptx"));
        std::fs::write(&f, transpose_ptx(stride)).unwrap();
        let mut a = vec!["--backend", "vm", "--vm-bank-conflicts", "--ptx", f.to_str().unwrap()];
        if json {
            a.push("--json");
        }
        a.extend([
            "launch",
            "transpose32",
            "--block",
            "32,32",
            "--arg",
            "buf=x",
            "--arg",
            "buf=y",
            "--buf",
            "x=f32:1024:iota",
            "--buf",
            "y=f32:1024",
            "--show",
            "y",
            "--count",
            "1024",
        ]);
        let o = memattn(&a);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        o
    };
    for stride in [32, 33] {
        let v: serde_json::Value = serde_json::from_slice(&run(stride, true).stdout).unwrap();
        let y = v["buffers"]["y"]["first"].as_array().unwrap();
        for (i, e) in y.iter().enumerate() {
            assert_eq!(e.as_str().unwrap().parse::<f32>().unwrap(), ((i % 32) * 32 + i / 32) as f32, "y[{i}]");
        }
        let lines = v["bank_conflicts"].as_array().unwrap();
        let (st, ld) = (&lines[0], &lines[1]);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(st["at"].as_str().unwrap().starts_with("PTX line "), "{st}");
        assert_eq!(
            (st["executions"].as_u64(), st["wavefronts"].as_u64(), st["ideal"].as_u64()),
            (Some(32), Some(32), Some(32))
        );
        let want = if stride == 32 { 32 * 32 } else { 32 };
        assert_eq!(
            (ld["executions"].as_u64(), ld["wavefronts"].as_u64(), ld["ideal"].as_u64()),
            (Some(32), Some(want), Some(32))
        );
    }
    let text = String::from_utf8_lossy(&run(32, false).stdout).to_string();
    assert!(text.contains("banks: 1056 shared-memory wavefronts for a minimum of 64 (16.50x)"), "{text}");
    assert!(text.contains(": 1024 wavefronts for 32 (32.0-way), 32 warp-wide executions"), "{text}");
    let text = String::from_utf8_lossy(&run(33, false).stdout).to_string();
    assert!(text.contains("banks: 64 shared-memory wavefronts for a minimum of 64 (1.00x)"), "{text}");
    assert!(text.contains("no bank conflicts"), "{text}");
}
