//! Workspace-level tests live in `tests/tests/`. This library holds what they share: opening
//! each backend and the `device_tests!` macro that instantiates one test for every device.
//!
//! Kernel-versus-reference tests live here once, generic over the device. The VM instance runs
//! always. The CUDA instance is `#[ignore]`d with its reason, so `cargo test` lists it as ignored
//! rather than passing it silently; on a machine with a GPU, run them with
//! `cargo test -p memattn-tests -- --ignored` (they fail, naming the reason, when no GPU opens).

use memattn::device::cuda::{probe, CudaDevice};
use memattn::device::vm::VmDevice;
use memattn::device::{BackendChoice, DeviceOptions};
use memattn::ptx::PtxSource;

/// The VM with the embedded PTX (2 workers: the CI machine has 2 cores).
pub fn vm_device() -> VmDevice {
    let mut o = DeviceOptions::new(BackendChoice::Vm, PtxSource::embedded());
    o.vm_workers = Some(2);
    VmDevice::new(&o).expect("the embedded PTX loads in the VM")
}

/// The GPU. Panics with the reason when this machine has no CUDA driver or device (the CUDA
/// instances are `#[ignore]`d, so they run only when asked for).
pub fn cuda_device() -> CudaDevice {
    match probe() {
        Ok(_) => {
            CudaDevice::new(&DeviceOptions::new(BackendChoice::Cuda, PtxSource::embedded())).expect("CUDA device opens")
        }
        Err(why) => panic!("the CUDA instance of this test needs a GPU: {why}"),
    }
}

/// Fails the test unless the device's loaded PTX has the entry `name`. The committed module has
/// every row of the variant table, so a missing entry is a build problem, never a reason to skip.
pub fn require_kernel(dev: &dyn memattn::device::Device, name: &str) {
    let found = dev.ptx().entries().iter().any(|e| e.name == name);
    assert!(
        found,
        "`{name}` is not in the loaded PTX ({}); every row of kernels-gpu/src/variants.rs must be built \
         into it: cargo xtask build-ptx",
        dev.ptx().origin
    );
}

/// Instantiates each `fn name(dev: &mut dyn Device)` once for the VM (always run) and once for
/// CUDA (`#[ignore]`d with the reason; `-- --ignored` runs it on a machine with a GPU).
#[macro_export]
macro_rules! device_tests {
    ($(fn $name:ident($dev:ident: &mut dyn Device) $body:block)*) => {
        $(fn $name($dev: &mut dyn memattn::device::Device) $body)*
        mod vm {
            $(#[test] fn $name() { super::$name(&mut $crate::vm_device()) })*
        }
        mod cuda {
            $(
                #[test]
                #[ignore = "needs a CUDA GPU: cargo test -p memattn-tests -- --ignored"]
                fn $name() { super::$name(&mut $crate::cuda_device()) }
            )*
        }
    };
}
