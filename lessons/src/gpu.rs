//! The GPU building blocks the lessons use: thread and block indices, the barrier, warp
//! shuffles, fast exponentials, shared memory. Each is one PTX instruction (or a few).
//!
//! The names are those of `kernels-gpu/src/device.rs`, the building blocks of memattn's own
//! kernels (`tid_x`, `ctaid_x`, `ntid_x`, `sync_threads`, `shfl_xor`, `exp2`, `max_f32`,
//! `dynamic_smem_f32`, ...), each named after the PTX register or instruction it reads: what a
//! lesson teaches reads the same in the production kernels. (The lessons build without
//! kernels-gpu, so these are mirrored, not re-exported.)
//!
//! The tensor-core vocabulary of lesson 6 is not mirrored but is kernels-gpu's own source:
//! [`mma`] is `kernels-gpu/src/mma.rs` (`ldmatrix_x4`, `smem_addr`, `Bf16::mma`, ...) and
//! [`frag`] is `kernels-gpu/src/frag.rs` (the lanes' `ldmatrix` rows, the accumulator layout),
//! the same files compiled into the lesson.

use core::arch::asm;
use core::arch::nvptx;

/// memattn's tensor-core instruction forms: the file `kernels-gpu/src/mma.rs` itself.
#[allow(dead_code)]
#[path = "../../kernels-gpu/src/mma.rs"]
pub mod mma;

/// memattn's fragment helpers: the file `kernels-gpu/src/frag.rs` itself.
#[allow(dead_code)]
#[path = "../../kernels-gpu/src/frag.rs"]
pub mod frag;

/// `%tid.x`: this thread's index in its block (x dimension).
#[inline(always)]
pub fn tid_x() -> u32 {
    unsafe { nvptx::_thread_idx_x() as u32 }
}
/// `%tid.y`.
#[inline(always)]
pub fn tid_y() -> u32 {
    unsafe { nvptx::_thread_idx_y() as u32 }
}
/// `%ctaid.x`: this block's index in the grid (x dimension).
#[inline(always)]
pub fn ctaid_x() -> u32 {
    unsafe { nvptx::_block_idx_x() as u32 }
}
/// `%ctaid.y`.
#[inline(always)]
pub fn ctaid_y() -> u32 {
    unsafe { nvptx::_block_idx_y() as u32 }
}
/// `%ntid.x`: threads per block (x dimension).
#[inline(always)]
pub fn ntid_x() -> u32 {
    unsafe { nvptx::_block_dim_x() as u32 }
}

/// `bar.sync 0`: waits until every thread of the block has arrived. Every thread that has not
/// exited must reach the same barrier.
#[inline(always)]
pub fn sync_threads() {
    unsafe { nvptx::_syncthreads() }
}

/// `shfl.sync.bfly.b32` over the full warp: the value `x` of lane `lane ^ mask`. All 32 lanes
/// of the warp must execute it together.
#[inline(always)]
pub fn shfl_xor(x: f32, mask: u32) -> f32 {
    let y: f32;
    unsafe {
        asm!("shfl.sync.bfly.b32 {y}, {x}, {m}, 31, -1;",
             y = out(reg32) y, x = in(reg32) x, m = in(reg32) mask, options(nomem, nostack))
    };
    y
}

/// `ex2.approx.ftz.f32`: 2^x (2^-inf = 0).
#[inline(always)]
pub fn exp2(x: f32) -> f32 {
    let y: f32;
    unsafe { asm!("ex2.approx.ftz.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x, options(pure, nomem, nostack)) };
    y
}

/// `lg2.approx.ftz.f32`: log2(x) (log2(0) = -inf).
#[inline(always)]
pub fn log2(x: f32) -> f32 {
    let y: f32;
    unsafe { asm!("lg2.approx.ftz.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x, options(pure, nomem, nostack)) };
    y
}

/// `fma.rn.f32`: `a * b + c` with one rounding.
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    core::intrinsics::fmaf32(a, b, c)
}

/// The larger of two floats, with `-inf` as the identity.
#[inline(always)]
pub fn max_f32(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// 16 bytes with 16-byte alignment: the unit `ldmatrix` reads (one row of an 8 x 8 matrix).
#[repr(C, align(16))]
pub struct Row16([u8; 16]);

/// The block's dynamic shared memory as 16-bit values (bf16 bit patterns), 16-byte aligned as
/// `ldmatrix` needs (its size is set by the launch).
#[inline(always)]
pub fn dynamic_smem_u16() -> *mut u16 {
    core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<Row16>() as *mut u16
}

/// The block's dynamic shared memory as `f32`s (its size is set by the launch).
#[inline(always)]
pub fn dynamic_smem_f32() -> *mut f32 {
    core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<f32>()
}

pub const LOG2E: f32 = core::f32::consts::LOG2_E;
pub const LN2: f32 = core::f32::consts::LN_2;

/// `%nctaid.x`: blocks in the grid (x dimension).
#[inline(always)]
pub fn nctaid_x() -> u32 {
    unsafe { nvptx::_grid_dim_x() as u32 }
}

/// `red.global.add.f32`: atomically adds `x` to the f32 at `p` in global memory (no result; the
/// adds of several threads to one address are all applied, in an unspecified order). The same
/// instruction as kernels-gpu's `red_add_f32`.
///
/// # Safety
/// `p` must point to an f32 in global memory.
#[inline(always)]
pub unsafe fn red_add_f32(p: *mut f32, x: f32) {
    unsafe {
        asm!("{{ .reg .b64 %ga;", "cvta.to.global.u64 %ga, {a};", "red.global.add.f32 [%ga], {x}; }}",
             a = in(reg64) p as u64, x = in(reg32) x, options(nostack));
    }
}
