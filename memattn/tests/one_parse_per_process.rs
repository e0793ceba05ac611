//! The committed PTX is parsed once per process however many VM handles a program opens
//! (`ptx_vm::Module::shared_static`: the embedded text by its address); entries are decoded on first launch.
//! A test binary of its own, so no other test's module is counted.

use memattn::attn::{AttnOpts, Kernels, TensorView};
use memattn::device::vm::VmDevice;
use memattn::device::{BackendChoice, DeviceOptions};
use memattn::ptx::PtxSource;
use memattn::Dtype;

#[test]
fn three_kernel_handles_and_a_device_parse_the_module_once() {
    let before = ptx_vm::Module::parses();
    let handles: Vec<Kernels> = (0..3).map(|_| Kernels::vm().unwrap()).collect();
    let _dev = VmDevice::new(&DeviceOptions::new(BackendChoice::Vm, PtxSource::embedded())).unwrap();
    assert_eq!(ptx_vm::Module::parses() - before, 1, "the embedded module is parsed once");
    // Each handle still runs the kernels on its own memory: one query row over its own key.
    for (i, k) in handles.iter().enumerate() {
        let x: Vec<f32> = (0..64).map(|c| (c as f32 + i as f32) * 0.01).collect();
        let b = k.vm_upload(&x).unwrap();
        let t = TensorView::vm(&b, Dtype::F32, [1, 1, 1, 64]).unwrap();
        let (o, lse) = k.flash_attn(&t, &t, &t, &AttnOpts::new()).unwrap();
        // One key: o is v's row, lse the one scaled score.
        assert_eq!(o.to_vec_f32().unwrap(), x);
        let score: f32 = x.iter().map(|a| a * a).sum::<f32>() / 8.0;
        assert!((lse.to_vec_f32().unwrap()[0] - score).abs() < 1e-5);
    }
    assert_eq!(ptx_vm::Module::parses() - before, 1, "launches decode entries, they do not parse again");
}
