//! Workspace-level tests live in `tests/tests/`. This library holds what they share: opening
//! each backend and the `device_tests!` macro that instantiates one test for every device.
//!
//! Kernel-versus-reference tests live here once, generic over the device. Both instances always
//! run: the CUDA one on the GPU when there is one, else on `vm-cuda`, the CUDA driver backed by
//! ptx-vm, so the `cuda` backend's code is exercised without a GPU and nothing is skipped.

use memattn_cli::device::cuda::{driver_library, probe, system_driver_present, use_driver_library, CudaDevice};
use memattn_cli::device::vm::VmDevice;
use memattn_cli::device::{BackendChoice, DeviceOptions};
use memattn_cli::ptx::PtxSource;
use std::path::PathBuf;
use std::sync::OnceLock;

/// The VM with the embedded PTX (2 workers: the CI machine has 2 cores).
pub fn vm_device() -> VmDevice {
    let mut o = DeviceOptions::new(BackendChoice::Vm, PtxSource::embedded());
    o.vm_workers = Some(2);
    VmDevice::new(&o).expect("the embedded PTX loads in the VM")
}

/// `libvm_cuda.so` (the `vm-cuda` crate: a CUDA driver backed by ptx-vm), which cargo builds
/// next to the test executables because this crate depends on it.
pub fn vm_cuda_library() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let deps = exe.parent().expect("target/<profile>/deps");
    [deps, deps.parent().unwrap_or(deps)]
        .iter()
        .map(|d| d.join("libvm_cuda.so"))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("libvm_cuda.so is not next to {} (`cargo build -p memattn-vm-cuda`)", exe.display()))
}

/// Which driver the CUDA variants run on: `MEMATTN_CUDA_DRIVER` when set, else the system's
/// driver when there is one, else the VM-backed driver. Decided once per process.
pub fn cuda_driver() -> &'static str {
    static CHOICE: OnceLock<String> = OnceLock::new();
    CHOICE.get_or_init(|| {
        if let Some(p) = driver_library().expect("MEMATTN_CUDA_DRIVER loads") {
            return format!("{}", p.display());
        }
        if system_driver_present() {
            return "the system's CUDA driver".into();
        }
        let lib = vm_cuda_library();
        use_driver_library(&lib).expect("libvm_cuda.so loads");
        format!("{}", lib.display())
    })
}

/// The CUDA device on the driver [`cuda_driver`] chose. Never skipped: without a GPU the CUDA
/// backend runs on the VM-backed driver. A system driver that cannot be used fails the test
/// with the reason (`MEMATTN_CUDA_DRIVER=<path of libvm_cuda.so>` runs the VM-backed one instead).
pub fn cuda_device() -> CudaDevice {
    let driver = cuda_driver();
    if let Err(why) = probe() {
        panic!("CUDA ({driver}) cannot be used: {why}");
    }
    CudaDevice::new(&DeviceOptions::new(BackendChoice::Cuda, PtxSource::embedded()))
        .unwrap_or_else(|e| panic!("CUDA device on {driver} opens: {e}"))
}

/// Held by each CUDA variant: they share one device, and the memory figures a test checks must
/// not include another test's buffers.
pub fn cuda_serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Fails the test unless the device's loaded PTX has the entry `name`. The committed module has
/// every row of the variant table, so a missing entry is a build problem, never a reason to skip.
pub fn require_kernel(dev: &dyn memattn_cli::device::Device, name: &str) {
    let found = dev.ptx().entries().iter().any(|e| e.name == name);
    assert!(
        found,
        "`{name}` is not in the loaded PTX ({}); every row of kernels-gpu/src/variants.rs must be built \
         into it: cargo xtask build-ptx",
        dev.ptx().origin
    );
}

/// Instantiates each `fn name(dev: &mut dyn Device)` once for the VM and once for CUDA (on the
/// GPU when there is one, else on the VM-backed driver; see [`cuda_device`]).
///
/// On a machine with an NVIDIA GPU (`cfg(memattn_gpu)`, set by this crate's build script) every
/// CUDA case runs on it. On the VM-backed driver a CUDA case runs the same PTX in the same VM as
/// its VM case, so there only the cases marked `#[smoke]` run (they cover every launch road: the
/// f32, bf16 and naive kernels, varlen, decode, merge); the others are `#[ignore]`d with the
/// reason, and `cargo test -p memattn-tests -- --include-ignored` runs them too.
#[macro_export]
macro_rules! device_tests {
    ($($(#[$marker:ident])? fn $name:ident($dev:ident: &mut dyn Device) $body:block)*) => {
        $(fn $name($dev: &mut dyn memattn_cli::device::Device) $body)*
        mod vm {
            $(#[test] fn $name() { super::$name(&mut $crate::vm_device()) })*
        }
        mod cuda {
            $($crate::cuda_case!($($marker)? $name);)*
        }
    };
}

/// One CUDA case of [`device_tests!`]: `smoke NAME` always runs, `NAME` runs on a GPU and is
/// ignored on the VM-backed driver unless asked for (`--include-ignored`).
#[macro_export]
macro_rules! cuda_case {
    (smoke $name:ident) => {
        #[test]
        fn $name() {
            let _one_at_a_time = $crate::cuda_serial();
            super::$name(&mut $crate::cuda_device())
        }
    };
    ($name:ident) => {
        #[test]
        #[cfg_attr(
            not(memattn_gpu),
            ignore = "on the VM-backed driver: the VM case runs the same PTX (--include-ignored runs it)"
        )]
        fn $name() {
            let _one_at_a_time = $crate::cuda_serial();
            super::$name(&mut $crate::cuda_device())
        }
    };
}
