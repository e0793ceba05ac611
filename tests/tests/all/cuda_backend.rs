//! What only the CUDA backend does, run on the driver `memattn_tests::cuda_driver` chooses (the
//! VM-backed one without a GPU): the shared-memory opt-in, launch faults as device errors.

use kernels_gpu::tiles::{saxpy_launch, LaunchDims};
use memattn_cli::device::{Device, DeviceError};
use memattn_tests::{cuda_device, cuda_serial};

fn saxpy(dev: &mut dyn Device, n: u32, len: u32, smem: u32) -> (Result<(), DeviceError>, Vec<f32>) {
    let x: Vec<f32> = (0..len).map(|i| i as f32).collect();
    let y: Vec<f32> = (0..len).map(|i| 2.0 * i as f32 + 1.0).collect();
    let (px, py) = (dev.alloc(4 * len as u64).unwrap(), dev.alloc(4 * len as u64).unwrap());
    dev.upload(px, &x).unwrap();
    dev.upload(py, &y).unwrap();
    let dims = LaunchDims { dynamic_smem_bytes: smem, ..saxpy_launch(n) };
    let (nb, ab, xb, yb) = (n.to_le_bytes(), 0.5f32.to_le_bytes(), px.to_le_bytes(), py.to_le_bytes());
    let r = dev.launch("saxpy_f32", &dims, &[&nb, &ab, &xb, &yb]).map(|_| ());
    let mut out = vec![0f32; len as usize];
    dev.download(py, &mut out).unwrap();
    dev.free(px).unwrap();
    dev.free(py).unwrap();
    (r, out)
}

#[test]
fn dynamic_shared_memory_above_48k_is_opted_in_and_above_the_device_limit_refused() {
    let _one = cuda_serial();
    let mut dev = cuda_device();
    let limit = dev.caps().unwrap().max_dynamic_smem_bytes;
    assert!(limit > 48 * 1024, "the device has an opt-in above 48 KiB: {limit}");
    let (r, out) = saxpy(&mut dev, 300, 300, 64 * 1024);
    r.unwrap();
    for (i, v) in out.iter().enumerate() {
        assert_eq!(*v, 0.5f32.mul_add(i as f32, 2.0 * i as f32 + 1.0), "element {i}");
    }
    let (r, _) = saxpy(&mut dev, 300, 300, limit + 1024);
    let e = r.unwrap_err().to_string();
    assert!(e.contains("opting `saxpy_f32` in to") && e.contains("CUDA_ERROR_INVALID_VALUE"), "{e}");
}

#[test]
fn a_launch_fault_is_a_device_error() {
    let _one = cuda_serial();
    let mut dev = cuda_device();
    if !memattn_cli::device::cuda::vm_backed() {
        eprintln!("skipped: a deliberate out-of-bounds launch is run on the VM-backed driver only");
        return;
    }
    // One element past both buffers.
    let (r, out) = saxpy(&mut dev, 257, 256, 0);
    let e = r.unwrap_err().to_string();
    assert!(e.contains("CUDA_ERROR_ILLEGAL_ADDRESS") && e.contains("out-of-bounds"), "{e}");
    // Everything before the faulting store happened, as on a GPU.
    assert_eq!(out[0], 1.0);
}
