//! Thin, named wrappers over the PTX instructions the kernels use (nvptx64 only).

use core::arch::asm;
use core::arch::nvptx;

#[inline(always)]
pub fn tid_x() -> u32 {
    unsafe { nvptx::_thread_idx_x() as u32 }
}
#[inline(always)]
pub fn ctaid_x() -> u32 {
    unsafe { nvptx::_block_idx_x() as u32 }
}
#[inline(always)]
pub fn ctaid_y() -> u32 {
    unsafe { nvptx::_block_idx_y() as u32 }
}
#[inline(always)]
pub fn ctaid_z() -> u32 {
    unsafe { nvptx::_block_idx_z() as u32 }
}
#[inline(always)]
pub fn ntid_x() -> u32 {
    unsafe { nvptx::_block_dim_x() as u32 }
}

/// Whether a KV-cache call's device-side index check (`crate::kv_check`) refused the call:
/// `status` is 0 (indices checked on the host: never) or the address of the call's status
/// words, refused while word 0 is set. Read at a kernel's entry, before any index is used.
///
/// # Safety
/// A non-zero `status` must be a valid device address of a `u32`.
#[inline(always)]
pub unsafe fn kv_refused(status: u64) -> bool {
    status != 0 && unsafe { core::ptr::read_volatile(status as *const u32) } != 0
}

/// `bar.sync 0`: every non-exited thread of the block must reach it.
#[inline(always)]
pub fn sync_threads() {
    unsafe { nvptx::_syncthreads() }
}

/// `ex2.approx.ftz.f32`: 2^x (max rel error 2^-22; -inf -> +0).
#[inline(always)]
pub fn exp2(x: f32) -> f32 {
    let y: f32;
    unsafe { asm!("ex2.approx.ftz.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x, options(pure, nomem, nostack)) };
    y
}

/// `rcp.approx.ftz.f32`: 1/x (max error about 1 ulp; inf -> +0). No IEEE division, so no
/// division slow-path call in the code that uses it.
#[inline(always)]
pub fn rcp(x: f32) -> f32 {
    let y: f32;
    unsafe { asm!("rcp.approx.ftz.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x, options(pure, nomem, nostack)) };
    y
}

/// `lg2.approx.ftz.f32`: log2(x) (0 -> -inf).
#[inline(always)]
pub fn log2(x: f32) -> f32 {
    let y: f32;
    unsafe { asm!("lg2.approx.ftz.f32 {y}, {x};", y = out(reg32) y, x = in(reg32) x, options(pure, nomem, nostack)) };
    y
}

/// `shfl.sync.bfly.b32` over the full warp: the value of lane `lane ^ mask`.
#[inline(always)]
pub fn shfl_xor(x: f32, mask: u32) -> f32 {
    let y: f32;
    unsafe {
        asm!("shfl.sync.bfly.b32 {y}, {x}, {m}, 31, -1;",
             y = out(reg32) y, x = in(reg32) x, m = in(reg32) mask, options(nomem, nostack))
    };
    y
}

pub use crate::mma::{Bf16, F16};
pub use crate::softmax::fmax;

/// Read-only global load through a raw device address.
///
/// # Safety
/// `addr` must be a valid, aligned device address of an `f32`.
#[inline(always)]
pub unsafe fn ld_f32(addr: u64) -> f32 {
    unsafe { *(addr as *const f32) }
}

/// Global load of a `u32`.
///
/// # Safety
/// `addr` must be a valid, 4-byte aligned device address of a `u32`.
#[inline(always)]
pub unsafe fn ld_u32(addr: u64) -> u32 {
    unsafe { *(addr as *const u32) }
}

/// # Safety
/// `addr` must be a valid, aligned device address of an `f32`.
#[inline(always)]
pub unsafe fn st_f32(addr: u64, x: f32) {
    unsafe { *(addr as *mut f32) = x }
}

/// Dynamic shared memory as `f32`s.
#[inline(always)]
pub fn dynamic_smem_f32() -> *mut f32 {
    core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<f32>()
}

/// `vote.sync.any.pred` over the full warp: whether `p` holds in any lane (the same answer in
/// every lane, so a branch on it is uniform). Every lane of the warp must execute it.
#[inline(always)]
pub fn warp_any(p: bool) -> bool {
    let r: u32;
    unsafe {
        asm!("{{ .reg .pred %va, %vb;", "setp.ne.u32 %va, {x}, 0;", "vote.sync.any.pred %vb, %va, 0xffffffff;",
             "selp.u32 {r}, 1, 0, %vb; }}",
             x = in(reg32) p as u32, r = out(reg32) r, options(nomem, nostack));
    }
    r != 0
}

/// `max.f32`: the larger of `a` and `b` (one FMNMX; -inf is the identity; NaN only if both are).
#[inline(always)]
pub fn max_f32(a: f32, b: f32) -> f32 {
    let y: f32;
    unsafe {
        asm!("max.f32 {y}, {a}, {b};", y = out(reg32) y, a = in(reg32) a, b = in(reg32) b,
             options(pure, nomem, nostack))
    };
    y
}

/// `fma.rn.f32`: `a * b + c` with one rounding. rustc emits `mul.rn` + `add.rn` for `a * b + c`,
/// and the explicit `.rn` forbids ptxas from fusing them, so dot products call this.
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    core::intrinsics::fmaf32(a, b, c)
}

/// Stores 32 bits (e.g. two packed 16-bit values) through a raw device address.
///
/// # Safety
/// `addr` must be a valid, 4-byte aligned device address.
#[inline(always)]
pub unsafe fn st_u32(addr: u64, x: u32) {
    unsafe { *(addr as *mut u32) = x }
}

/// `x`, hidden from the optimiser: a value computed from it inside a loop stays in the loop.
/// Used on shared-memory base addresses so LLVM does not hoist one register per fragment address
/// out of the key loop (the addresses are `base + constant` and fold into the instructions).
#[inline(always)]
pub fn opaque_u32(x: u32) -> u32 {
    let y: u32;
    unsafe { asm!("mov.b32 {y}, {x};", y = out(reg32) y, x = in(reg32) x, options(nomem, nostack)) };
    y
}

/// The 64-bit counterpart of [`opaque_u32`]: a value LLVM cannot see through, so a chain of
/// `x + step` stays a chain (no hoisted `n * step` registers).
#[inline(always)]
pub fn opaque_u64(x: u64) -> u64 {
    let y: u64;
    unsafe { asm!("mov.b64 {y}, {x};", y = out(reg64) y, x = in(reg64) x, options(nomem, nostack)) };
    y
}

/// Element type of Q, K, V and O in the naive kernels: loaded as f32, stored rounded to nearest
/// even. Arithmetic is f32 either way.
pub trait Elem {
    /// Bytes per element (addresses are `base + BYTES * index`).
    const BYTES: u64;
    /// # Safety
    /// `addr` must be a valid device address of one element, aligned to `BYTES`.
    unsafe fn load(addr: u64) -> f32;
    /// # Safety
    /// As for [`Elem::load`].
    unsafe fn store(addr: u64, x: f32);
}

/// f32 elements.
pub struct F32;

impl Elem for F32 {
    const BYTES: u64 = 4;
    #[inline(always)]
    unsafe fn load(addr: u64) -> f32 {
        unsafe { ld_f32(addr) }
    }
    #[inline(always)]
    unsafe fn store(addr: u64, x: f32) {
        unsafe { st_f32(addr, x) }
    }
}

impl Elem for crate::mma::Bf16 {
    const BYTES: u64 = 2;
    /// bf16 is the top half of an f32: widening is a shift.
    #[inline(always)]
    unsafe fn load(addr: u64) -> f32 {
        f32::from_bits((unsafe { *(addr as *const u16) } as u32) << 16)
    }
    /// `cvt.rn.bf16.f32`.
    #[inline(always)]
    unsafe fn store(addr: u64, x: f32) {
        let h: u16;
        unsafe {
            asm!("cvt.rn.bf16.f32 {h}, {x};", h = out(reg16) h, x = in(reg32) x, options(pure, nomem, nostack));
            *(addr as *mut u16) = h;
        }
    }
}

impl Elem for crate::mma::F16 {
    const BYTES: u64 = 2;
    /// `cvt.f32.f16` (exact).
    #[inline(always)]
    unsafe fn load(addr: u64) -> f32 {
        let h = unsafe { *(addr as *const u16) };
        let x: f32;
        unsafe { asm!("cvt.f32.f16 {x}, {h};", x = out(reg32) x, h = in(reg16) h, options(pure, nomem, nostack)) };
        x
    }
    /// `cvt.rn.f16.f32` (overflow to ±inf).
    #[inline(always)]
    unsafe fn store(addr: u64, x: f32) {
        let h: u16;
        unsafe {
            asm!("cvt.rn.f16.f32 {h}, {x};", h = out(reg16) h, x = in(reg32) x, options(pure, nomem, nostack));
            *(addr as *mut u16) = h;
        }
    }
}

/// Varlen: sequence `b` (read from `p.cu_seqlens_q` / `p.cu_seqlens_kv`, see
/// [`crate::abi::AttnParams::sequence`]); without cu_seqlens, `p` itself at batch `b`.
///
/// # Safety
/// With varlen, `p.cu_seqlens_q` and `p.cu_seqlens_kv` must hold `p.batch + 1` valid prefix sums
/// and `b < p.batch`.
#[inline(always)]
pub unsafe fn sequence_of(p: &crate::abi::AttnParams, b: u32) -> crate::abi::Sequence {
    if p.cu_seqlens_q == 0 {
        return crate::abi::Sequence { p: *p, b: b as u64, q0: 0, k0: 0 };
    }
    let (cq, ck) = (p.cu_seqlens_q + 4 * b as u64, p.cu_seqlens_kv + 4 * b as u64);
    unsafe { p.sequence(ld_u32(cq), ld_u32(cq + 4), ld_u32(ck), ld_u32(ck + 4)) }
}

/// `red.global.add.f32`: atomically adds `x` to the f32 at `addr` (no result; the adds of
/// several threads to one address are all applied, in an unspecified order).
///
/// # Safety
/// `addr` must be a valid, 4-byte aligned device address of an `f32` in global memory.
#[inline(always)]
pub unsafe fn red_add_f32(addr: u64, x: f32) {
    unsafe {
        asm!("{{ .reg .b64 %ga;", "cvta.to.global.u64 %ga, {a};", "red.global.add.f32 [%ga], {x}; }}",
             a = in(reg64) addr, x = in(reg32) x, options(nostack));
    }
}

/// ALiBi: the slope of sequence `b`, head `h` (`slopes[b * batch_stride + h]`), 0 without
/// slopes (`slopes == 0`). A score's bias is `-slope * |i + seq_kv - seq_q - j|`
/// ([`alibi_distance`]).
///
/// # Safety
/// A non-zero `slopes` must hold the f32 slope at that index.
#[inline(always)]
pub unsafe fn alibi_slope(slopes: u64, batch_stride: u32, b: u32, h: u32) -> f32 {
    if slopes == 0 {
        0.0
    } else {
        unsafe { ld_f32(slopes + 4 * (b as u64 * batch_stride as u64 + h as u64)) }
    }
}

/// `|rd - j|` as f32: the ALiBi distance of a key `j` from a row whose diagonal (`i + seq_kv -
/// seq_q`) is `rd`.
#[inline(always)]
pub fn alibi_distance(rd: i32, j: i32) -> f32 {
    let d = rd - j;
    (if d < 0 { -d } else { d }) as f32
}

/// `%tid.x` read again: a volatile read the compiler cannot merge with an earlier one, so the
/// value need not stay in a register through a kernel's key loop.
#[inline(always)]
pub(crate) fn tid_x_fresh() -> u32 {
    let y: u32;
    unsafe { core::arch::asm!("mov.u32 {y}, %tid.x;", y = out(reg32) y, options(nomem, nostack)) };
    y
}

/// `%ctaid.{x,y,z}` read again (a volatile read the compiler cannot merge with an earlier one, so
/// the value need not stay in a register through the key loop).
#[inline(always)]
pub(crate) fn ctaid_x_fresh() -> u32 {
    let y: u32;
    unsafe { core::arch::asm!("mov.u32 {y}, %ctaid.x;", y = out(reg32) y, options(nomem, nostack)) };
    y
}
#[inline(always)]
pub(crate) fn ctaid_y_fresh() -> u32 {
    let y: u32;
    unsafe { core::arch::asm!("mov.u32 {y}, %ctaid.y;", y = out(reg32) y, options(nomem, nostack)) };
    y
}
#[inline(always)]
pub(crate) fn ctaid_z_fresh() -> u32 {
    let y: u32;
    unsafe { core::arch::asm!("mov.u32 {y}, %ctaid.z;", y = out(reg32) y, options(nomem, nostack)) };
    y
}

/// `st.shared.b32 [addr], x;`
#[inline(always)]
pub(crate) unsafe fn st_shared_u32(addr: u32, x: u32) {
    unsafe { core::arch::asm!("st.shared.b32 [{a}], {x};", a = in(reg32) addr, x = in(reg32) x, options(nostack)) };
}
