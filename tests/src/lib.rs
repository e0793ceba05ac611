//! Workspace-level tests live in `tests/tests/`. This library holds what they share: opening
//! each backend and the `device_tests!` macro that instantiates one test for every device.

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

/// The GPU, when this machine has a CUDA driver and a device; otherwise None (and says why).
pub fn cuda_device() -> Option<CudaDevice> {
    match probe() {
        Ok(_) => Some(
            CudaDevice::new(&DeviceOptions::new(BackendChoice::Cuda, PtxSource::embedded()))
                .expect("CUDA device opens"),
        ),
        Err(why) => {
            eprintln!("CUDA variant skipped: {why}");
            None
        }
    }
}

/// Whether the device's loaded PTX has the entry `name`. The committed module has every kernel,
/// so a missing entry (a `--ptx`-style module without it) fails the test rather than skipping it.
pub fn has_kernel(dev: &dyn memattn::device::Device, name: &str) -> bool {
    let found = dev.ptx().entries().iter().any(|e| e.name == name);
    assert!(found, "`{name}` is not in the loaded PTX ({})", dev.ptx().origin);
    found
}

/// Instantiates each `fn name(dev: &mut dyn Device)` once for the VM (always) and once for CUDA
/// (when a GPU is present).
#[macro_export]
macro_rules! device_tests {
    ($(fn $name:ident($dev:ident: &mut dyn Device) $body:block)*) => {
        $(fn $name($dev: &mut dyn memattn::device::Device) $body)*
        mod vm {
            $(#[test] fn $name() { super::$name(&mut $crate::vm_device()) })*
        }
        mod cuda {
            $(#[test] fn $name() { if let Some(mut d) = $crate::cuda_device() { super::$name(&mut d) } })*
        }
    };
}
