//! Named wrappers over the tensor-core, `ldmatrix` and `cp.async` PTX instruction forms (sm_80+).
//!
//! One function per instruction form. Notation used in the layout drawings: a warp's lane is
//! `l`, its group `g = l / 4` (0..8) and its index in the group `t = l % 4` (0..4). A `.b32`
//! register holding two 16-bit values has the value with the smaller column (or row) index in its
//! low half (bits 0..16).
//!
//! Warp-synchronous instructions (`mma.sync.aligned`, `ldmatrix.sync.aligned`) are never marked
//! `pure` in their `asm!`: a pure asm block may be moved, duplicated into divergent branches or
//! removed by LLVM, and every lane of the warp must execute these together.
//!
//! Shared-memory addresses are 32-bit addresses in the `.shared` window (see `smem_addr`);
//! global addresses are 64-bit addresses in the `.global` window (see `global_addr`).

#[cfg(target_arch = "nvptx64")]
use core::arch::asm;

/// The shared-window address of a generic pointer into shared memory (`cvta.to.shared.u64`,
/// truncated to 32 bits: the window is smaller than 4 GiB).
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub fn smem_addr<T>(p: *const T) -> u32 {
    let a: u64;
    unsafe {
        asm!("cvta.to.shared.u64 {a}, {p};", a = out(reg64) a, p = in(reg64) p as u64,
             options(pure, nomem, nostack))
    };
    a as u32
}

/// The global-window address of a generic pointer into global memory (`cvta.to.global.u64`).
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub fn global_addr(p: u64) -> u64 {
    let a: u64;
    unsafe {
        asm!("cvta.to.global.u64 {a}, {p};", a = out(reg64) a, p = in(reg64) p,
             options(pure, nomem, nostack))
    };
    a
}

// ---------------------------------------------------------------------------------------------
// cp.async: asynchronous 16-byte global -> shared copies, tracked in commit groups.
// ---------------------------------------------------------------------------------------------

/// `cp.async.cg.shared.global.L2::128B [dst], [src], 16, src_bytes;`
///
/// Copies `src_bytes` (0 or 16) bytes from global `src` to shared `dst` and fills the rest of the
/// 16 bytes with zeros, so `src_bytes = 0` writes 16 zero bytes (rows past the end of a tensor).
/// `.cg` caches in L2 only; `.L2::128B` (PTX ISA 7.4, hence the module's `.version 7.4`) asks L2
/// to fetch the whole 128-byte line, which the neighbouring lanes' copies of the row read next. Both addresses 16-byte aligned. The copy is not visible until a
/// [`cp_async_wait_all`] by the issuing thread and a barrier for the other threads.
///
/// # Safety
/// `dst` must lie in the block's shared memory; `src` must be a readable global address.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub unsafe fn cp_async_16(dst: u32, src: u64, src_bytes: u32) {
    unsafe {
        asm!("cp.async.cg.shared.global.L2::128B [{d}], [{s}], 16, {n};",
             d = in(reg32) dst, s = in(reg64) src, n = in(reg32) src_bytes, options(nostack))
    };
}

/// `cp.async.commit_group;`: closes the group of this thread's `cp.async` issued since the last
/// commit.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub fn cp_async_commit() {
    unsafe { asm!("cp.async.commit_group;", options(nostack)) };
}

/// `cp.async.wait_group 0;`: waits until every committed group of this thread has landed.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub fn cp_async_wait_all() {
    unsafe { asm!("cp.async.wait_group 0;", options(nostack)) };
}

// ---------------------------------------------------------------------------------------------
// ldmatrix: a warp loads four 8x8 16-bit matrices from shared memory.
// ---------------------------------------------------------------------------------------------

/// `ldmatrix.sync.aligned.m8n8.x4.shared.b16 {r0, r1, r2, r3}, [addr];`
///
/// Lanes `8i..8i+8` supply the addresses of rows 0..8 of matrix `i` (each row 16 contiguous
/// bytes = 8 values, 16-byte aligned). Register `ri` of lane `l` receives row `g`, columns
/// `2t, 2t+1` of matrix `i`:
///
/// ```text
///   matrix i (8x8, b16)       col: 0 1 | 2 3 | 4 5 | 6 7
///   row 0                          l0  |  l1 |  l2 |  l3
///   row 1                          l4  |  l5 |  l6 |  l7
///   ...                                 ...
///   row 7                          l28 | l29 | l30 | l31
/// ```
///
/// # Safety
/// Every lane of the warp must execute it (`.sync.aligned`) with an address in shared memory.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub unsafe fn ldmatrix_x4(addr: u32) -> [u32; 4] {
    let (r0, r1, r2, r3): (u32, u32, u32, u32);
    unsafe {
        asm!("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{r0}, {r1}, {r2}, {r3}}}, [{a}];",
             r0 = out(reg32) r0, r1 = out(reg32) r1, r2 = out(reg32) r2, r3 = out(reg32) r3,
             a = in(reg32) addr, options(readonly, nostack))
    };
    [r0, r1, r2, r3]
}

/// `ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {r0, r1, r2, r3}, [addr];`
///
/// Addresses as in [`ldmatrix_x4`]; the matrices are transposed on the way: register `ri` of
/// lane `l` receives rows `2t, 2t+1` of column `g` of matrix `i` (row `2t` in the low half):
///
/// ```text
///   matrix i (8x8, b16)   col: 0    1    ...  7
///   rows 0,1                   l0   l4   ...  l28
///   rows 2,3                   l1   l5   ...  l29
///   rows 4,5                   l2   l6   ...  l30
///   rows 6,7                   l3   l7   ...  l31
/// ```
///
/// # Safety
/// As [`ldmatrix_x4`].
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
pub unsafe fn ldmatrix_x4_trans(addr: u32) -> [u32; 4] {
    let (r0, r1, r2, r3): (u32, u32, u32, u32);
    unsafe {
        asm!("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{r0}, {r1}, {r2}, {r3}}}, [{a}];",
             r0 = out(reg32) r0, r1 = out(reg32) r1, r2 = out(reg32) r2, r3 = out(reg32) r3,
             a = in(reg32) addr, options(readonly, nostack))
    };
    [r0, r1, r2, r3]
}

// ---------------------------------------------------------------------------------------------
// mma.sync m16n8k16 with f32 accumulation, and the packing of f32 pairs into 16-bit pairs.
// ---------------------------------------------------------------------------------------------

/// A 16-bit input type of `mma.sync.aligned.m16n8k16.row.col.f32.{T}.{T}.f32`.
///
/// Fragment layouts, per lane (`a`: A 16x16 row-major, `b`: B 16x8 "col", `d`: C/D 16x8 f32):
///
/// ```text
///   A (rows m, cols k)           B (rows k, cols n)          C/D (rows m, cols n), f32
///   a0: m=g,   k=2t,2t+1         b0: k=2t,2t+1,   n=g         d0: m=g,   n=2t
///   a1: m=g+8, k=2t,2t+1         b1: k=2t+8,2t+9, n=g         d1: m=g,   n=2t+1
///   a2: m=g,   k=2t+8,2t+9                                    d2: m=g+8, n=2t
///   a3: m=g+8, k=2t+8,2t+9                                    d3: m=g+8, n=2t+1
/// ```
///
/// `D = A B + C`, accumulated in f32. Two C/D fragments side by side (`n` tiles `2j`, `2j+1`)
/// cover a 16x16 block whose pairs `(d0,d1)`, `(d2,d3)` of tile `2j` and of tile `2j+1` are exactly
/// `a0`, `a1`, `a2`, `a3` of an A fragment once packed with [`Half16::pack`] — the scores of one
/// `mma` feed the next without leaving registers.
pub trait Half16 {
    /// `d += a b` (one `mma.sync`; every lane of the warp must execute it).
    fn mma(d: &mut [f32; 4], a: &[u32; 4], b0: u32, b1: u32);
    /// Rounds `lo`, `hi` to nearest-even and packs them, `lo` in bits 0..16.
    fn pack(lo: f32, hi: f32) -> u32;
}

/// bfloat16 inputs.
pub struct Bf16;
/// IEEE half inputs.
pub struct F16;

#[cfg(target_arch = "nvptx64")]
impl Half16 for Bf16 {
    /// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`
    #[inline(always)]
    fn mma(d: &mut [f32; 4], a: &[u32; 4], b0: u32, b1: u32) {
        unsafe {
            asm!("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 \
                  {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, \
                  {{{d0}, {d1}, {d2}, {d3}}};",
                 d0 = inout(reg32) d[0], d1 = inout(reg32) d[1], d2 = inout(reg32) d[2],
                 d3 = inout(reg32) d[3], a0 = in(reg32) a[0], a1 = in(reg32) a[1],
                 a2 = in(reg32) a[2], a3 = in(reg32) a[3], b0 = in(reg32) b0, b1 = in(reg32) b1,
                 options(nomem, nostack))
        };
    }
    /// `cvt.rn.bf16x2.f32 d, hi, lo;` (the first source goes to the upper half).
    #[inline(always)]
    fn pack(lo: f32, hi: f32) -> u32 {
        let d: u32;
        unsafe {
            asm!("cvt.rn.bf16x2.f32 {d}, {hi}, {lo};", d = out(reg32) d, hi = in(reg32) hi,
                 lo = in(reg32) lo, options(pure, nomem, nostack))
        };
        d
    }
}

#[cfg(target_arch = "nvptx64")]
impl Half16 for F16 {
    /// `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`
    #[inline(always)]
    fn mma(d: &mut [f32; 4], a: &[u32; 4], b0: u32, b1: u32) {
        unsafe {
            asm!("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 \
                  {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, \
                  {{{d0}, {d1}, {d2}, {d3}}};",
                 d0 = inout(reg32) d[0], d1 = inout(reg32) d[1], d2 = inout(reg32) d[2],
                 d3 = inout(reg32) d[3], a0 = in(reg32) a[0], a1 = in(reg32) a[1],
                 a2 = in(reg32) a[2], a3 = in(reg32) a[3], b0 = in(reg32) b0, b1 = in(reg32) b1,
                 options(nomem, nostack))
        };
    }
    /// `cvt.rn.f16x2.f32 d, hi, lo;` (the first source goes to the upper half).
    #[inline(always)]
    fn pack(lo: f32, hi: f32) -> u32 {
        let d: u32;
        unsafe {
            asm!("cvt.rn.f16x2.f32 {d}, {hi}, {lo};", d = out(reg32) d, hi = in(reg32) hi,
                 lo = in(reg32) lo, options(pure, nomem, nostack))
        };
        d
    }
}
