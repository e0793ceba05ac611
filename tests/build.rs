//! Tells the tests whether this machine has an NVIDIA GPU (`cfg(memattn_gpu)`): then every
//! CUDA case of `device_tests!` runs on it; without one the CUDA cases run on the VM-backed
//! driver, where only the smoke cases run by default (the rest is the VM's PTX in the VM again).
use std::path::Path;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(memattn_gpu)");
    println!("cargo::rerun-if-env-changed=MEMATTN_CUDA_DRIVER");
    println!("cargo::rerun-if-changed=/dev/nvidiactl");
    let chosen_driver = std::env::var_os("MEMATTN_CUDA_DRIVER").is_some_and(|v| !v.is_empty());
    if Path::new("/dev/nvidiactl").exists() && !chosen_driver {
        println!("cargo::rustc-cfg=memattn_gpu");
    }
}
