//! Helpers shared by the command's integration tests: run the `memattn` binary and read what it
//! said. (Each test file uses some of them.)
#![allow(dead_code)]

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output};

/// The `memattn` binary cargo built for these tests.
pub fn bin() -> Command {
    static SWEEP: std::sync::Once = std::sync::Once::new();
    SWEEP.call_once(sweep_finished_runs);
    Command::new(env!("CARGO_BIN_EXE_memattn"))
}

/// Removes the folders earlier runs of these tests left in cargo's temporary folder
/// (`memattn-<area>-<pid>`, one per test process, which cargo never cleans: the backward's
/// safetensors alone made gigabytes over a few hundred runs), those of processes that are no
/// longer running. A run that is still going (another `cargo test` at the same time) keeps its.
fn sweep_finished_runs() {
    let Ok(entries) = std::fs::read_dir(env!("CARGO_TARGET_TMPDIR")) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix("memattn-").and_then(|r| r.rsplit_once('-')).map(|(_, pid)| pid.to_string())
        else {
            continue;
        };
        if pid.parse::<u32>().is_ok_and(|p| p != std::process::id())
            && !std::path::Path::new("/proc").join(&pid).exists()
        {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
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
