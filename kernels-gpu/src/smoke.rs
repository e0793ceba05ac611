//! `saxpy_f32`: `y[i] = a * x[i] + y[i]` for `i < n`.
//!
//! The smallest kernel in the module; it exercises pointer parameters (`.ptr .align`), the
//! bounds-check early exit and f32 fma. Used by the VM and host smoke tests.
//! Thread mapping: one thread per element, `i = ctaid.x * ntid.x + tid.x`.
//! Launch: [`crate::tiles::saxpy_launch`]; its table row ([`crate::variants`]) has no generated
//! entry, since it takes four scalar parameters rather than `AttnParams`.
//!
//! # Safety
//! `x` and `y` must point to at least `n` f32s in device memory.

#[cfg(target_arch = "nvptx64")]
use crate::device::*;

#[cfg(all(target_arch = "nvptx64", not(memattn_sm90)))]
#[no_mangle]
pub unsafe extern "ptx-kernel" fn saxpy_f32(n: u32, a: f32, x: *const f32, y: *mut f32) {
    let i = ctaid_x() * ntid_x() + tid_x();
    if i < n {
        unsafe {
            let yi = y.add(i as usize);
            *yi = a * *x.add(i as usize) + *yi;
        }
    }
}
