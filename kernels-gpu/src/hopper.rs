//! Hopper (`sm_90a`) instruction wrappers of the warp-specialised forward
//! ([`crate::flash_fwd_sm90`]): `mbarrier` phases, TMA tensor copies (`cp.async.bulk.tensor`),
//! `wgmma` warpgroup MMAs and their shared-memory matrix descriptors, `setmaxnreg`.
//!
//! Compiled only into the `sm_90a` module (`cfg(memattn_sm90)`); every instruction here is
//! described in the PTX ISA 8.0 and run by ptx-vm.
//!
//! `wgmma` accumulators: an `m64nN` f32 accumulator is `N / 2` registers per thread, held here as
//! `N / 8` [`Acc`] fragments with exactly the layout of an `mma.sync` m16n8 accumulator
//! ([`crate::frag`]): warp `w` of the warpgroup holds rows `16w..16w + 16`, lane `l` rows
//! `l / 4` and `l / 4 + 8` of them and, of every 8-column slice `n`, columns `8n + 2(l % 4)` and
//! `+ 1`. So the softmax helpers of `frag` work on them unchanged, and two adjacent 8-key slices of
//! S are the register A operand of one k-step of `P V` ([`crate::frag::pack_a`]).

use crate::frag::Acc;
use core::arch::asm;

/// Shared-memory matrix descriptor of a `wgmma` operand (PTX ISA "Matrix Descriptor Format"):
/// start address, leading- and stride-dimension byte offsets (all in 16-byte units, 14 bits),
/// layout 1 = 128-byte swizzle, base offset 0 (every swizzled tile is 1024-byte aligned).
#[inline(always)]
pub const fn desc_sw128(addr: u32, lbo: u32, sbo: u32) -> u64 {
    ((addr as u64 & 0x3ffff) >> 4)
        | (((lbo as u64 >> 4) & 0x3fff) << 16)
        | (((sbo as u64 >> 4) & 0x3fff) << 32)
        | (1u64 << 62)
}

/// `mbarrier.init.shared::cta.b64 [bar], count`.
#[inline(always)]
pub unsafe fn mbar_init(bar: u32, count: u32) {
    unsafe {
        asm!("mbarrier.init.shared::cta.b64 [{b}], {c};", b = in(reg32) bar, c = in(reg32) count, options(nostack))
    }
}

/// Makes the barriers' initialisation visible to the async proxy (TMA) and the other threads
/// (followed by a block barrier).
#[inline(always)]
pub fn fence_barrier_init() {
    unsafe { asm!("fence.mbarrier_init.release.cluster;", "fence.proxy.async.shared::cta;", options(nostack)) }
}

/// `mbarrier.arrive.expect_tx`: this thread's arrival, and `bytes` more transaction bytes the
/// current phase waits for.
#[inline(always)]
pub unsafe fn mbar_arrive_expect_tx(bar: u32, bytes: u32) {
    unsafe {
        asm!("mbarrier.arrive.expect_tx.shared::cta.b64 _, [{b}], {n};", b = in(reg32) bar, n = in(reg32) bytes,
            options(nostack))
    }
}

/// `mbarrier.arrive`: one arrival on the current phase.
#[inline(always)]
pub unsafe fn mbar_arrive(bar: u32) {
    unsafe { asm!("mbarrier.arrive.shared::cta.b64 _, [{b}];", b = in(reg32) bar, options(nostack)) }
}

/// Waits until the phase of parity `parity` of the barrier has completed
/// (`mbarrier.try_wait.parity` in a loop).
#[inline(always)]
pub unsafe fn mbar_wait(bar: u32, parity: u32) {
    loop {
        let done: u32;
        unsafe {
            asm!("{{ .reg .pred p;", "mbarrier.try_wait.parity.shared::cta.b64 p, [{b}], {ph};", "selp.u32 {d}, 1, 0, p; }}",
                b = in(reg32) bar, ph = in(reg32) parity, d = out(reg32) done, options(nostack))
        };
        if done != 0 {
            break;
        }
    }
}

/// A 4-d TMA tile copy of the box at coordinates `c` (innermost first) of the tensor map at
/// global address `map` into shared memory at `dst`, completing `bar`'s transaction bytes.
#[inline(always)]
pub unsafe fn tma_load_4d(dst: u32, map: u64, c: [i32; 4], bar: u32) {
    unsafe {
        asm!("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [{d}], [{m}, {{{c0}, {c1}, {c2}, {c3}}}], [{b}];",
            d = in(reg32) dst, m = in(reg64) map, c0 = in(reg32) c[0], c1 = in(reg32) c[1], c2 = in(reg32) c[2],
            c3 = in(reg32) c[3], b = in(reg32) bar, options(nostack))
    }
}

/// Orders the tensor map's bytes (written by the host) before the TMA unit reads them.
#[inline(always)]
pub unsafe fn fence_tensormap(map: u64) {
    unsafe { asm!("fence.proxy.tensormap::generic.acquire.gpu [{m}], 128;", m = in(reg64) map, options(nostack)) }
}

/// `setmaxnreg.dec`: the producer warpgroup gives registers back.
#[inline(always)]
pub fn setmaxnreg_dec_40() {
    unsafe { asm!("setmaxnreg.dec.sync.aligned.u32 40;", options(nostack)) }
}

/// `setmaxnreg.inc`: a consumer warpgroup takes them.
#[inline(always)]
pub fn setmaxnreg_inc_232() {
    unsafe { asm!("setmaxnreg.inc.sync.aligned.u32 232;", options(nostack)) }
}

/// `wgmma.fence` after every register of `d` is "used" by an empty side-effecting asm: the
/// compiler must finish the ordinary writes of the accumulators (zeroed, rescaled) before the
/// fence, and the fence orders them before the next `wgmma` reads them.
#[inline(always)]
pub fn wgmma_fence<const N: usize>(d: &mut [Acc; N]) {
    fence_operands(d);
    unsafe { asm!("wgmma.fence.sync.aligned;", options(nostack)) }
}

/// Pins every register of `d` at this point of the program (CUTLASS's
/// `warpgroup_fence_operand`): an empty asm with side effects that reads and writes each, so
/// no access to them moves across the `wgmma` instructions around it.
#[inline(always)]
pub fn fence_operands<const N: usize>(d: &mut [Acc; N]) {
    unroll!(n in 0..N, max 32 => {
        unroll4!(e in 0..4 => {
            unsafe { asm!("/* {x} */", x = inout(reg32) d[n][e], options(nomem, nostack)) };
        });
    });
}

/// [`fence_operands`] for the register A operands (packed P).
#[inline(always)]
pub fn fence_a_operands<const N: usize>(a: &mut [[u32; 4]; N], steps: usize) {
    unroll!(n in 0..N, max 32 => {
        if n < steps {
            unroll4!(e in 0..4 => {
                unsafe { asm!("/* {x} */", x = inout(reg32) a[n][e], options(nomem, nostack)) };
            });
        }
    });
}

/// `bar.sync id, threads`: wait at named barrier `id` until `threads` threads (a multiple of
/// 32; each warp counts 32) have synced or arrived on it.
#[inline(always)]
pub fn named_bar_sync(id: u32, threads: u32) {
    unsafe { asm!("bar.sync {id}, {n};", id = in(reg32) id, n = in(reg32) threads, options(nostack)) }
}

/// `bar.arrive id, threads`: count this warp's 32 threads on named barrier `id` and go on.
#[inline(always)]
pub fn named_bar_arrive(id: u32, threads: u32) {
    unsafe { asm!("bar.arrive {id}, {n};", id = in(reg32) id, n = in(reg32) threads, options(nostack)) }
}

/// `wgmma.commit_group`.
#[inline(always)]
pub fn wgmma_commit() {
    unsafe { asm!("wgmma.commit_group.sync.aligned;", options(nostack)) }
}

/// `wgmma.wait_group 0`, then every accumulator register of `d` "redefined" by an empty asm, so
/// no read of them is scheduled before the wait.
#[inline(always)]
pub fn wgmma_wait_all<const N: usize>(d: &mut [Acc; N]) {
    unsafe { asm!("wgmma.wait_group.sync.aligned 0;", options(nostack)) };
    fence_operands(d);
}

/// `D (+)= A Bᵀ` of one k-step with both operands in shared memory, K-major (`S = Q Kᵀ`).
macro_rules! wgmma_ss {
    ($fname:ident, $shape:literal, $ty:literal, $regs:literal, [$d0:literal $(, $d:literal)*]) => {
        #[inline(always)]
        unsafe fn $fname(d: &mut [f32; $regs], a: u64, b: u64, scale_d: u32) {
            unsafe {
                asm!(
                    "{{ .reg .pred p;",
                    "setp.ne.b32 p, {sd}, 0;",
                    concat!("wgmma.mma_async.sync.aligned.", $shape, ".f32.", $ty, ".", $ty, " {{{", $d0, "}" $(, ", {", $d, "}")*, "}}, {a}, {b}, p, 1, 1, 0, 0;"),
                    "}}",
                    inout(reg32) d[$d0], $(inout(reg32) d[$d],)*
                    a = in(reg64) a, b = in(reg64) b, sd = in(reg32) scale_d, options(nostack));
            }
        }
    };
}

/// `D += A B` of one k-step with A (four registers per thread, P) in registers and B in shared
/// memory, MN-major (`imm-trans-b` 1: V stored `[key][d]`).
macro_rules! wgmma_rs {
    ($fname:ident, $shape:literal, $ty:literal, $regs:literal, [$d0:literal $(, $d:literal)*]) => {
        #[inline(always)]
        unsafe fn $fname(d: &mut [f32; $regs], a: &[u32; 4], b: u64) {
            unsafe {
                asm!(
                    concat!("wgmma.mma_async.sync.aligned.", $shape, ".f32.", $ty, ".", $ty, " {{{", $d0, "}" $(, ", {", $d, "}")*, "}}, {{{a0}, {a1}, {a2}, {a3}}}, {b}, 1, 1, 1, 1;"),
                    inout(reg32) d[$d0], $(inout(reg32) d[$d],)*
                    a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
                    b = in(reg64) b, options(nostack));
            }
        }
    };
}

wgmma_ss!(
    ss_bf16_n64,
    "m64n64k16",
    "bf16",
    32,
    [
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
        30, 31
    ]
);
wgmma_ss!(
    ss_bf16_n128,
    "m64n128k16",
    "bf16",
    64,
    [
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
        30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57,
        58, 59, 60, 61, 62, 63
    ]
);
wgmma_rs!(
    rs_bf16_n64,
    "m64n64k16",
    "bf16",
    32,
    [
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
        30, 31
    ]
);
wgmma_rs!(
    rs_bf16_n128,
    "m64n128k16",
    "bf16",
    64,
    [
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
        30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57,
        58, 59, 60, 61, 62, 63
    ]
);
wgmma_rs!(
    rs_bf16_n256,
    "m64n256k16",
    "bf16",
    128,
    [
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
        30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57,
        58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85,
        86, 87, 88, 89, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110,
        111, 112, 113, 114, 115, 116, 117, 118, 119, 120, 121, 122, 123, 124, 125, 126, 127
    ]
);
wgmma_ss!(
    ss_f16_n64,
    "m64n64k16",
    "f16",
    32,
    [
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
        30, 31
    ]
);
wgmma_ss!(
    ss_f16_n128,
    "m64n128k16",
    "f16",
    64,
    [
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
        30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57,
        58, 59, 60, 61, 62, 63
    ]
);
wgmma_rs!(
    rs_f16_n64,
    "m64n64k16",
    "f16",
    32,
    [
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
        30, 31
    ]
);
wgmma_rs!(
    rs_f16_n128,
    "m64n128k16",
    "f16",
    64,
    [
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
        30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57,
        58, 59, 60, 61, 62, 63
    ]
);
wgmma_rs!(
    rs_f16_n256,
    "m64n256k16",
    "f16",
    128,
    [
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
        30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57,
        58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85,
        86, 87, 88, 89, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110,
        111, 112, 113, 114, 115, 116, 117, 118, 119, 120, 121, 122, 123, 124, 125, 126, 127
    ]
);

/// The `wgmma` forms of one element type: `S = Q Kᵀ` k-steps for `N` keys, `O += P V` k-steps
/// for `N` = the head dim.
pub trait WgmmaElem {
    /// `s (+)= Q Kᵀ` (one k-step) for an `[Acc; N]` accumulator, `N` = 8 or 16 (64 or 128 keys).
    unsafe fn qk<const N: usize>(s: &mut [Acc; N], a: u64, b: u64, scale_d: u32);
    /// `o += P V` (one k-step) for `N` = 8, 16 or 32 (head dim 64, 128, 256).
    unsafe fn pv<const N: usize>(o: &mut [Acc; N], a: &[u32; 4], b: u64);
}

macro_rules! wgmma_elem {
    ($t:ty, $ss64:ident, $ss128:ident, $rs64:ident, $rs128:ident, $rs256:ident) => {
        impl WgmmaElem for $t {
            #[inline(always)]
            unsafe fn qk<const N: usize>(s: &mut [Acc; N], a: u64, b: u64, scale_d: u32) {
                let p = s.as_mut_ptr() as *mut f32;
                match N {
                    8 => unsafe { $ss64(&mut *(p as *mut [f32; 32]), a, b, scale_d) },
                    16 => unsafe { $ss128(&mut *(p as *mut [f32; 64]), a, b, scale_d) },
                    _ => core::arch::nvptx::trap(),
                }
            }
            #[inline(always)]
            unsafe fn pv<const N: usize>(o: &mut [Acc; N], a: &[u32; 4], b: u64) {
                let p = o.as_mut_ptr() as *mut f32;
                match N {
                    8 => unsafe { $rs64(&mut *(p as *mut [f32; 32]), a, b) },
                    16 => unsafe { $rs128(&mut *(p as *mut [f32; 64]), a, b) },
                    32 => unsafe { $rs256(&mut *(p as *mut [f32; 128]), a, b) },
                    _ => core::arch::nvptx::trap(),
                }
            }
        }
    };
}

wgmma_elem!(crate::mma::Bf16, ss_bf16_n64, ss_bf16_n128, rs_bf16_n64, rs_bf16_n128, rs_bf16_n256);
wgmma_elem!(crate::mma::F16, ss_f16_n64, ss_f16_n128, rs_f16_n64, rs_f16_n128, rs_f16_n256);
