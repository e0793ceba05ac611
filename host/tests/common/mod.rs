//! Helpers shared by the command's integration tests: run the `memattn` binary and read what it
//! said. (Each test file uses some of them.)
#![allow(dead_code)]

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output};

/// The `memattn` binary cargo built for these tests.
pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_memattn"))
}

/// Runs `memattn ARGS` to completion.
pub fn memattn(args: &[&str]) -> Output {
    bin().args(args).output().expect("spawn memattn")
}

/// The exit code; a test fails when the process was killed by a signal (an abort is a bug).
pub fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or_else(|| panic!("killed by signal {:?}", o.status.signal()))
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// stdout as one JSON value (the `--json` contract), or a failure showing both streams.
pub fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}):\n{}\nstderr:\n{}", stdout(o), stderr(o)))
}
