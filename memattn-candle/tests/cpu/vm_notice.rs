//! The CPU device's notice (`memattn_candle::VM_NOTICE`): said on stderr exactly once per
//! process however many ops run, and not at all with `MEMATTN_CANDLE_VM_QUIET` set. Each case
//! runs this test executable again as a child process (test `vm_notice::child`) and counts the
//! notice in its stderr: the parent's own stderr already holds the notice of the other tests.

use candle_core::{Device, Tensor};
use std::process::Command;

/// Set for the child run; without it `child` returns at once.
const CHILD_ENV: &str = "MEMATTN_CANDLE_VM_NOTICE_CHILD";

/// Three ops (forward twice, a windowed one) on the CPU device, in the child process only.
#[test]
fn child() -> candle_core::Result<()> {
    if std::env::var_os(CHILD_ENV).is_none() {
        return Ok(());
    }
    let t = |s: usize| Tensor::randn(0f32, 1.0, (1, s, 2, 32), &Device::Cpu);
    let (q, k, v) = (t(5)?, t(7)?, t(7)?);
    memattn_candle::flash_attn(&q, &k, &v, 0.2, true)?;
    memattn_candle::flash_attn(&q, &k, &v, 0.2, false)?;
    memattn_candle::flash_attn_windowed(&q, &k, &v, 0.2, Some(2), Some(0))?;
    Ok(())
}

/// How often the child's stderr holds the notice, with `quiet` setting the silencing variable.
fn notices_in_child(quiet: bool) -> usize {
    let mut cmd = Command::new(std::env::current_exe().expect("test executable"));
    cmd.args(["--exact", "vm_notice::child", "--nocapture", "--test-threads=1"]).env(CHILD_ENV, "1");
    cmd.env_remove(memattn_candle::VM_NOTICE_QUIET_ENV);
    if quiet {
        cmd.env(memattn_candle::VM_NOTICE_QUIET_ENV, "1");
    }
    let out = cmd.output().expect("child test run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child run failed: {stderr}\n{}", String::from_utf8_lossy(&out.stdout));
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"), "the child test did not run");
    stderr.matches(memattn_candle::VM_NOTICE).count()
}

#[test]
fn said_once_per_process() {
    assert_eq!(notices_in_child(false), 1);
}

#[test]
fn silenced_by_the_variable() {
    assert_eq!(notices_in_child(true), 0);
}

#[test]
fn names_the_vm_the_cost_and_the_variable() {
    let n = memattn_candle::VM_NOTICE;
    for part in ["PTX VM on the CPU", "4-20x slower", "not for CPU", memattn_candle::VM_NOTICE_QUIET_ENV] {
        assert!(n.contains(part), "{part:?} missing from {n:?}");
    }
}
