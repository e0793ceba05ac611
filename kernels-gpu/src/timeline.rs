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
//! stamps in order, each [`Phase`] `<< 56 |` the clock's low 56 bits, and the last word is
//! spare. Lane 0 stores for the warp.
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
    /// The Hopper forward's producer: waiting for the consumers to free a K or V stage.
    WaitSlot = 9,
}

impl Phase {
    /// Every phase, in id order.
    pub const ALL: [Phase; 10] = [
        Phase::Prologue,
        Phase::WaitKv,
        Phase::Barrier,
        Phase::LoadKv,
        Phase::Qk,
        Phase::Softmax,
        Phase::Pv,
        Phase::Epilogue,
        Phase::End,
        Phase::WaitSlot,
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
            Phase::WaitSlot => "wait slot",
        }
    }
    pub fn from_id(id: u8) -> Option<Phase> {
        Phase::ALL.get(id as usize).copied()
    }
}

/// The stamps one warp keeps; later ones are counted, not kept.
pub const EVENTS_PER_WARP: usize = 1023;
/// 64-bit words per warp in the buffer: the count, the stamps and a spare word (the dropped
/// stamps are written there).
pub const WARP_WORDS: usize = EVENTS_PER_WARP + 2;
/// The clock's bits kept in a stamp.
pub const CLOCK_BITS: u32 = 56;
/// The module-scope variable holding the buffer's address.
pub const GLOBAL_NAME: &str = "MEMATTN_TIMELINE";

/// The stamped entries of the timeline modules: `memattn_kernels_timeline.ptx` (sm_80, the first
/// two) and `memattn_kernels_timeline_sm90.ptx` (sm_90a, the Hopper forwards; that module also
/// has `tensor_maps_store`, which the Hopper forward's launch needs).
pub const TIMELINE_KERNELS: [crate::KernelId; 4] = [
    crate::KernelId::FlashFwdBf16D128,
    crate::KernelId::FlashFwdF16D128,
    crate::KernelId::FlashFwdBf16Sm90D128,
    crate::KernelId::FlashFwdF16Sm90D128,
];

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
///
/// Without a branch on the lane: every lane computes the same words and only lane 0's stores
/// are done (predicated), so the warp stays converged for the barriers and `.aligned`
/// instructions after a stamp. The only branch, on the buffer's address, is uniform.
#[cfg(all(target_arch = "nvptx64", memattn_timeline))]
#[inline(always)]
pub fn stamp(phase: Phase) {
    use crate::device::{ctaid_x, ctaid_y, ctaid_z, ntid_x, tid_x};
    // SAFETY: a plain read of the module's variable, which only the host writes.
    let base = unsafe { core::ptr::read_volatile(&raw const MEMATTN_TIMELINE) };
    if base == 0 {
        return;
    }
    let clock: u64;
    // SAFETY: reads a special register.
    unsafe { core::arch::asm!("mov.u64 {c}, %globaltimer;", c = out(reg64) clock) };
    let tid = tid_x();
    // SAFETY: read special registers.
    let (nx, ny) = unsafe { (core::arch::nvptx::_grid_dim_x() as u64, core::arch::nvptx::_grid_dim_y() as u64) };
    let block = (ctaid_z() as u64 * ny + ctaid_y() as u64) * nx + ctaid_x() as u64;
    let warp = block * (ntid_x() / 32) as u64 + (tid / 32) as u64;
    let rec = base + 8 * WARP_WORDS as u64 * warp;
    // SAFETY: the host sized the buffer for every warp of the launch; only lane 0 writes this
    // warp's words. Past the last stamp's word, the spare word takes the dropped ones.
    unsafe {
        let n = core::ptr::read_volatile(rec as *const u64);
        let slot = rec + 8 * (1 + core::cmp::min(n, EVENTS_PER_WARP as u64));
        let word = ((phase as u64) << CLOCK_BITS) | (clock & ((1u64 << CLOCK_BITS) - 1));
        core::arch::asm!(
            "{{",
            ".reg .pred p;",
            "setp.eq.u32 p, {lane}, 0;",
            "@p st.volatile.u64 [{slot}], {word};",
            "@p st.volatile.u64 [{rec}], {next};",
            "}}",
            lane = in(reg32) tid % 32,
            slot = in(reg64) slot,
            word = in(reg64) word,
            rec = in(reg64) rec,
            next = in(reg64) n + 1,
        );
    }
}

/// Lane 0 of the calling warp records the start of `phase` (nothing outside the timeline build).
#[cfg(not(all(target_arch = "nvptx64", memattn_timeline)))]
#[inline(always)]
pub fn stamp(_phase: Phase) {}
