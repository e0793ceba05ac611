//! `attn::cuda_context` with `MEMATTN_CUDA_DRIVER` naming a library that does not exist: a typed
//! error naming the path, no panic, on any machine (a GPU's driver is not consulted: the choice
//! is made first). A test binary of its own: the driver choice is once per process.

use memattn::attn::{cuda_context, AttnError};
use memattn::device::DeviceError;

#[test]
fn a_missing_driver_library_is_a_typed_error_not_a_panic() {
    let missing = std::env::temp_dir().join("memattn-no-such-dir").join("libcuda.so");
    // SAFETY: this test binary holds this one test, and nothing else reads the environment yet.
    unsafe { std::env::set_var(memattn::driver::DRIVER_ENV, &missing) };
    let e = cuda_context(0).map(|_| ()).unwrap_err();
    match &e {
        AttnError::Device(DeviceError::Unavailable(why)) => {
            assert!(why.contains("MEMATTN_CUDA_DRIVER") && why.contains("memattn-no-such-dir"), "{why}")
        }
        other => panic!("expected DeviceError::Unavailable, got {other:?}"),
    }
    // Asked again, the same answer (the failed choice is remembered, nothing else is loaded).
    assert_eq!(cuda_context(0).map(|_| ()).unwrap_err(), e);
}
