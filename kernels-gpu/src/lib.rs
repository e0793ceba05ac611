//! memattn's attention kernels, written in Rust and compiled to PTX by rustc's NVPTX backend.
//!
//! On `nvptx64-nvidia-cuda` this crate is `no_std` and exports the kernel entry points (one kernel
//! per file). On the host it compiles on stable and exposes only the pure parts shared with the
//! device: the parameter struct ([`abi`]) and the tile configurations and launch geometry
//! ([`tiles`]), so host and device cannot disagree about the ABI.
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

pub mod abi;
pub mod tiles;

#[cfg(target_arch = "nvptx64")]
mod device;
#[cfg(target_arch = "nvptx64")]
pub mod flash_fwd_f32;
#[cfg(target_arch = "nvptx64")]
pub mod flash_fwd_mma;
#[cfg(target_arch = "nvptx64")]
mod mma;
#[cfg(target_arch = "nvptx64")]
pub mod naive_pv;
#[cfg(target_arch = "nvptx64")]
pub mod naive_scores;
#[cfg(target_arch = "nvptx64")]
pub mod naive_softmax;
#[cfg(target_arch = "nvptx64")]
pub mod smoke;

#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    unsafe { core::arch::nvptx::trap() }
}
