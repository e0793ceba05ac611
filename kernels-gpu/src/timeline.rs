//! A timeline of every warp: the timeline build of the kernels (`--cfg memattn_timeline`,
//! `cargo xtask build-ptx --timeline`, `kernels-gpu/ptx/memattn_kernels_timeline.ptx`) stamps a
//! clock per warp at each phase boundary of the kernels in [`TIMELINE_KERNELS`]; `memattn run
//! --timeline FILE` reads the stamps back into a Chrome trace and a picture.
//!
//! The buffer: the module-scope `.global .u64` [`GLOBAL_NAME`] holds its address (0: no
//! stamps), set by the host before the launch, so the kernels' parameters do not change. Warp
//! `w` of linear block `b = (z · nctaid.y + y) · nctaid.x + x` owns the [`WARP_WORDS`] 64-bit
//! words at word `(b · warps_per_block + w) · WARP_WORDS`: word 0 counts the stamps the warp
//! made (more than [`EVENTS_PER_WARP`] means the later ones were dropped), words 1.. hold the
//! stamps in order, each [`Phase`] `<< 56 |` the clock's low 56 bits. Lane 0 stamps for the warp.
//!
//! The clock is `%globaltimer` (nanoseconds) on a GPU; ptx-vm answers `%globaltimer` with the
//! warp's count of executed instructions, so the same build shows a warp's phases in the VM in
//! instructions. Outside the timeline build [`stamp`] is empty and the kernels are unchanged.

/// One stamp marks the start of a phase (and the end of the one before it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Phase {
    /// From the kernel's start: the block's setup and the `cp.async` copies of Q and the first
    /// K tile.
    Prologue = 0,
    /// `cp.async.wait_all`: waiting for this thread's K or V copies to land.
    WaitKv = 1,
    /// `bar.sync`: waiting for the block's other warps.
    Barrier = 2,
    /// Issuing the `cp.async` copies of the next V or K tile.
    LoadKv = 3,
    /// `S = Q Kᵀ` on tensor cores.
    Qk = 4,
    /// Masks, the running max, the rescale and `P = exp2(...)`.
    Softmax = 5,
    /// `O += P V` on tensor cores.
    Pv = 6,
    /// O divided by l, the stores of O and LSE.
    Epilogue = 7,
    /// The warp's end (closes the last phase; not a phase of its own).
    End = 8,
}

impl Phase {
    pub const ALL: [Phase; 9] = [
        Phase::Prologue,
        Phase::WaitKv,
        Phase::Barrier,
        Phase::LoadKv,
        Phase::Qk,
        Phase::Softmax,
        Phase::Pv,
        Phase::Epilogue,
        Phase::End,
    ];
    /// The name a trace shows.
    pub const fn name(self) -> &'static str {
        match self {
            Phase::Prologue => "prologue",
            Phase::WaitKv => "wait K/V",
            Phase::Barrier => "barrier",
            Phase::LoadKv => "load K/V",
            Phase::Qk => "QK^T",
            Phase::Softmax => "softmax",
            Phase::Pv => "PV",
            Phase::Epilogue => "epilogue",
            Phase::End => "end",
        }
    }
    pub fn from_id(id: u8) -> Option<Phase> {
        Phase::ALL.get(id as usize).copied()
    }
}

/// The stamps one warp keeps; later ones are counted, not kept.
pub const EVENTS_PER_WARP: usize = 1023;
/// 64-bit words per warp in the buffer: the count and the stamps.
pub const WARP_WORDS: usize = EVENTS_PER_WARP + 1;
/// The clock's bits kept in a stamp.
pub const CLOCK_BITS: u32 = 56;
/// The module-scope variable holding the buffer's address.
pub const GLOBAL_NAME: &str = "MEMATTN_TIMELINE";

/// The entries of the timeline module (`memattn_kernels_timeline.ptx`, built for sm_80).
pub const TIMELINE_KERNELS: [crate::KernelId; 2] =
    [crate::KernelId::FlashFwdBf16D128, crate::KernelId::FlashFwdF16D128];

/// Splits a stamp into its phase and clock.
pub fn decode(word: u64) -> (Option<Phase>, u64) {
    (Phase::from_id((word >> CLOCK_BITS) as u8), word & ((1u64 << CLOCK_BITS) - 1))
}

/// The buffer's address (0 until the host sets it). Only in the timeline build.
#[cfg(all(target_arch = "nvptx64", memattn_timeline))]
#[no_mangle]
#[used]
static mut MEMATTN_TIMELINE: u64 = 0;

/// Lane 0 of the calling warp records the start of `phase` (nothing outside the timeline build).
#[cfg(all(target_arch = "nvptx64", memattn_timeline))]
#[inline(always)]
pub fn stamp(phase: Phase) {
    use crate::device::{ctaid_x, ctaid_y, ctaid_z, ntid_x, tid_x};
    let tid = tid_x();
    if tid % 32 != 0 {
        return;
    }
    // SAFETY: a plain read of the module's variable, which only the host writes.
    let base = unsafe { core::ptr::read_volatile(&raw const MEMATTN_TIMELINE) };
    if base == 0 {
        return;
    }
    let clock: u64;
    // SAFETY: reads a special register.
    unsafe { core::arch::asm!("mov.u64 {c}, %globaltimer;", c = out(reg64) clock) };
    // SAFETY: read special registers.
    let (nx, ny) = unsafe { (core::arch::nvptx::_grid_dim_x() as u64, core::arch::nvptx::_grid_dim_y() as u64) };
    let block = (ctaid_z() as u64 * ny + ctaid_y() as u64) * nx + ctaid_x() as u64;
    let warp = block * (ntid_x() / 32) as u64 + (tid / 32) as u64;
    let rec = (base + 8 * WARP_WORDS as u64 * warp) as *mut u64;
    // SAFETY: the host sized the buffer for every warp of the launch; only this lane writes
    // this warp's words.
    unsafe {
        let n = core::ptr::read_volatile(rec);
        if n < EVENTS_PER_WARP as u64 {
            let word = ((phase as u64) << CLOCK_BITS) | (clock & ((1u64 << CLOCK_BITS) - 1));
            core::ptr::write_volatile(rec.add(1 + n as usize), word);
        }
        core::ptr::write_volatile(rec, n + 1);
    }
}

/// Lane 0 of the calling warp records the start of `phase` (nothing outside the timeline build).
#[cfg(not(all(target_arch = "nvptx64", memattn_timeline)))]
#[inline(always)]
pub fn stamp(_phase: Phase) {}
