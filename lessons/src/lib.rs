//! The lessons' kernels. `cargo xtask lesson N` compiles exactly one of them to PTX: the feature
//! `lessonN` selects the lesson, `solution` the reference solution instead of the learner's file
//! (`NN-name/kernel.rs`), `de` the learner's German copy (`NN-name/kernel.de.rs`, the same code
//! with German comments, placed by `cargo xtask lesson N --lang de`). On the host this crate is
//! empty.
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
#![cfg_attr(target_arch = "nvptx64", allow(internal_features, unused_features))]

// memattn's own unrolling macros, for `gpu::frag` (the same file as the kernels').
#[cfg(target_arch = "nvptx64")]
#[macro_use]
#[path = "../../kernels-gpu/src/unroll.rs"]
mod unroll;

#[cfg(target_arch = "nvptx64")]
pub mod gpu;

/// The names `gpu::frag` (kernels-gpu's `frag.rs`) takes from kernels-gpu's `device` module.
#[cfg(target_arch = "nvptx64")]
mod device {
    pub use crate::gpu::{max_f32, shfl_xor};
}

macro_rules! lesson {
    ($feature:literal, $kernel:literal, $kernel_de:literal, $solution:literal) => {
        #[cfg(all(target_arch = "nvptx64", feature = $feature, not(feature = "solution"), not(feature = "de")))]
        #[path = $kernel]
        pub mod lesson;
        #[cfg(all(target_arch = "nvptx64", feature = $feature, not(feature = "solution"), feature = "de"))]
        #[path = $kernel_de]
        pub mod lesson;
        #[cfg(all(target_arch = "nvptx64", feature = $feature, feature = "solution"))]
        #[path = $solution]
        pub mod lesson;
    };
}
lesson!("lesson1", "../01-scale/kernel.rs", "../01-scale/kernel.de.rs", "../01-scale/solution.rs");
lesson!("lesson2", "../02-warp-softmax/kernel.rs", "../02-warp-softmax/kernel.de.rs", "../02-warp-softmax/solution.rs");
lesson!("lesson3", "../03-tiled-qk/kernel.rs", "../03-tiled-qk/kernel.de.rs", "../03-tiled-qk/solution.rs");
lesson!(
    "lesson4",
    "../04-online-softmax/kernel.rs",
    "../04-online-softmax/kernel.de.rs",
    "../04-online-softmax/solution.rs"
);
lesson!(
    "lesson5",
    "../05-flash-forward/kernel.rs",
    "../05-flash-forward/kernel.de.rs",
    "../05-flash-forward/solution.rs"
);
lesson!("lesson6", "../06-mma-qk/kernel.rs", "../06-mma-qk/kernel.de.rs", "../06-mma-qk/solution.rs");
lesson!("lesson7", "../07-swizzle/kernel.rs", "../07-swizzle/kernel.de.rs", "../07-swizzle/solution.rs");
lesson!("lesson8", "../08-reduce/kernel.rs", "../08-reduce/kernel.de.rs", "../08-reduce/solution.rs");
lesson!("lesson9", "../09-transpose/kernel.rs", "../09-transpose/kernel.de.rs", "../09-transpose/solution.rs");

#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    unsafe { core::arch::nvptx::trap() }
}
