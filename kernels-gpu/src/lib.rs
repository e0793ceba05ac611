//! memattn's attention kernels, written in Rust and compiled to PTX by rustc's NVPTX backend.
//!
//! The package is `memattn-kernels` (the folder `kernels-gpu/`; memattn's own crates import it
//! under the name `kernels_gpu`).
//!
//! On `nvptx64-nvidia-cuda` this crate is `no_std` and exports the kernel entry points. On the
//! host it compiles on stable and exposes the pure parts shared with the device, so host and
//! device cannot disagree:
//! - [`variants`]: the variant table, the one place a kernel is listed ([`KernelId`], launch
//!   geometry, the host's kernel selection);
//! - [`abi`]: the parameter struct every attention kernel takes;
//! - [`decode_abi`]: the parameters of the KV-cache decode kernels, the cache-row / page lookup
//!   ([`decode_abi::DecodeParams::cache_row`]) and the split plan's math;
//! - [`fp8`]: the FP8 formats of an FP8 KV cache (decode and saturating encode);
//! - [`mask`]: the window rule, which keys a query row sees ([`mask::key_range`]), for every
//!   kernel and the host's planning;
//! - [`tiles`]: one tile item per variant;
//! - [`swizzle`]: the shared-memory address math of the tensor-core kernels;
//! - [`softmax`]: the online-softmax state and the one rescale policy
//!   ([`softmax::must_rescale`]) of every fused kernel;
//! - [`frag`]: the `mma` fragment layout and the fragment steps of the tensor-core kernels;
//! - `artifacts` (host only): the committed PTX, its build info and ptxas report.
//!
//! The kernel modules are documented here for every target — the algorithm, tiles, thread
//! mapping and safety contract — while their device code is compiled for nvptx64 only. A tour
//! from the naive pipeline to tensor cores and on to inference: [`naive_scores`],
//! [`naive_softmax`], [`naive_pv`] (three kernels, an `N x N` buffer), [`flash_fwd_f32`] (fused,
//! online softmax, SIMT), [`flash_fwd_mma`] (the same on tensor cores, with the instruction
//! forms of [`mma`]); then decode over a KV cache: [`decode_append`] (writes new keys into the
//! cache), [`decode_fwd`] (split-KV decode, SIMT), [`decode_mma`] (the same on tensor cores) and
//! [`merge_states`] (combines the splits); then training: [`flash_bwd_f32`] (the backward, dQ,
//! dK and dV from the saved LSE), [`flash_bwd_mma`] (the same on tensor cores) and their
//! baseline [`naive_bwd`] (P and dS materialised); [`smoke`] is the smoke-test kernel.
//!
//! Build the PTX with `cargo xtask build-ptx` (see the workspace README).
#![cfg_attr(target_arch = "nvptx64", no_std)]
#![cfg_attr(
    target_arch = "nvptx64",
    feature(
        abi_ptx,
        stdarch_nvptx,
        asm_experimental_arch,
        gpu_launch_sized_workgroup_mem,
        gpu_intrinsics,
        core_intrinsics
    )
)]
#![cfg_attr(target_arch = "nvptx64", allow(internal_features))]
// The `sm_90a` build (`--cfg memattn_sm90`) compiles only what the Hopper rows use (the Hopper
// forward and the e4m3 decode): the other sm_80 kernel modules are left out of it, which takes
// their type checking (most of a kernel build's time) off that build; the shared modules then
// have items it does not use.
#![cfg_attr(memattn_sm90, allow(dead_code, unused_imports))]
// The timeline build (`--cfg memattn_timeline`, `cargo xtask build-ptx --timeline`) has only the
// rows of `timeline::TIMELINE_KERNELS`, with their phase stamps.
#![cfg_attr(memattn_timeline, allow(dead_code, unused_imports, unused_macros))]

pub mod abi;
pub mod decode_abi;
pub mod fp8;
pub mod mask;
pub mod softmax;
pub mod swizzle;
pub mod tiles;
#[macro_use]
mod unroll;
pub mod frag;
pub mod timeline;
pub mod variants;

pub use variants::{Elem, Family, KernelId, Variant, WindowRule, MAX_HEAD_DIM, PAD_MULTIPLE, VARIANTS};

#[cfg(not(target_arch = "nvptx64"))]
pub mod artifacts;

/// The unit tests, for `memattn-tests` to run (its test `unit`); not an API.
#[cfg(all(feature = "unit-tests", not(target_arch = "nvptx64")))]
#[doc(hidden)]
pub mod unit_tests {
    pub use crate::abi::tests as abi;
    pub use crate::artifacts::tests as artifacts;
    pub use crate::decode_abi::tests as decode_abi;
    pub use crate::fp8::tests as fp8;
    pub use crate::frag::tests as frag;
    pub use crate::mask::tests as mask;
    pub use crate::softmax::tests as softmax;
    pub use crate::swizzle::tests as swizzle;
    pub use crate::variants::tests as variants;
}

#[cfg(target_arch = "nvptx64")]
mod device;
#[cfg(any(doc, target_arch = "nvptx64"))]
pub mod mma;
#[cfg(all(target_arch = "nvptx64", not(memattn_sm90)))]
mod staging;

/// The kernel modules only the `sm_80` module's rows use: compiled for nvptx64 except in the
/// `sm_90a` build (`--cfg memattn_sm90`) and the timeline build (`--cfg memattn_timeline`), and
/// documented on the host.
macro_rules! sm80_kernel_modules {
    ($($name:ident),* $(,)?) => {
        $(
            #[cfg(any(doc, all(target_arch = "nvptx64", not(memattn_sm90), not(memattn_timeline))))]
            pub mod $name;
        )*
    };
}
sm80_kernel_modules!(decode_append, decode_rotary, flash_bwd_f32, flash_bwd_mma, flash_bwd_tc, flash_fwd_f32,);
/// The sm_80 forward, also the whole of the timeline build (`--cfg memattn_timeline`).
#[cfg(any(doc, all(target_arch = "nvptx64", not(memattn_sm90))))]
pub mod flash_fwd_mma;
sm80_kernel_modules!(kv_check, merge_states, naive_bwd, naive_pv, naive_scores, naive_softmax, smoke,);
#[cfg(any(doc, target_arch = "nvptx64"))]
pub mod decode_fwd;
#[cfg(any(doc, target_arch = "nvptx64"))]
pub mod decode_mma;
pub mod flash_fwd_sm90;
#[cfg(all(target_arch = "nvptx64", memattn_sm90))]
pub mod hopper;
pub mod tensor_maps;

#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    unsafe { core::arch::nvptx::trap() }
}
