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
