//! The executor: one block at a time per worker, warp-at-a-time inside a block.
//!
//! Registers are structure-of-arrays (`regs[slot][lane]`). Each lane has its own PC; a warp runs
//! the group of lanes at the minimum PC and stops the group as soon as it reaches the PC of another
//! lane (they then merge) or diverges at a branch. Converged code therefore runs as one group with
//! no per-instruction bookkeeping. A group that reaches a warp collective while lanes it needs
//! still run elsewhere parks there until they arrive (reconvergence at the join). Barriers park
//! lanes; a block releases a barrier when every non-exited thread waits at the same barrier
//! instruction.

use crate::ir::*;
use crate::memcheck::{Fault, Loc, Mem, SharedMem};
use crate::memory::{self, GlobalView, SHARED_WINDOW, WINDOW_SIZE};
use crate::num::{self, Ty};
use crate::{Conflict, Finding, TraceEntry, TraceRequest};

const FULL: u32 = u32::MAX;
const RUN: u8 = 0;
const BAR: u8 = 1;
const EXIT: u8 = 2;
const ABSENT: u8 = 3;
/// Parked at a warp collective (`.sync` shuffle/vote, `.sync.aligned` ldmatrix/mma) until the
/// lanes it needs, still running on another path, arrive at the same instruction.
const WAIT: u8 = 4;
/// Parked at a `wgmma.mma_async` until the other warps of its warpgroup reach it
/// ([`Launch::wgmma_release`]).
const WGW: u8 = 5;
/// Yielded after a failed `mbarrier.try_wait`/`test_wait` (at the next instruction): runs again
/// once the other warps of the block had their turn ([`crate::hopper`]).
const YIELD: u8 = 6;
/// Parked at a named barrier (`bar.sync a, b` with a thread count) until it has its threads
/// ([`NamedBars`]); the warp's [`Warp::nbar`] says which.
const NBAR: u8 = 7;
/// Rounds of the block's warps in a row in which only failed mbarrier waits ran (no barrier
/// changed, no thread reached an exit or a `bar.sync`) before the block is a deadlock.
const STALLED_ROUNDS: u32 = 1000;
/// Fresh shared memory reads as this repeating little-endian word (a quiet NaN as f32).
pub const SHARED_POISON: u32 = 0x7FC0_DEAD;

pub(crate) struct Launch<'a> {
    pub prog: &'a Program,
    pub kernel: &'a str,
    pub global: &'a GlobalView,
    pub params: &'a [u8],
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: usize,
    pub dyn_shared: u32,
    pub budget: u64,
    /// When the launch must stop ([`crate::DeviceLimits::max_launch_time`]).
    pub deadline: Option<std::time::Instant>,
    pub trace: Option<TraceRequest>,
    /// Report loads of shared bytes that no thread of the block has written (initcheck).
    pub initcheck: bool,
    /// Report shared-memory accesses by different warps to the same word with no barrier
    /// between them, at least one a plain store (racecheck).
    pub racecheck: bool,
    /// Count the wavefronts of shared-memory accesses per instruction (bank conflicts).
    pub banks: bool,
    /// Count the 32-byte sectors of global accesses per instruction (coalescing).
    pub sectors: bool,
    /// Fill the register slots a block does not zero with garbage first (tests of
    /// [`crate::reginit`]: results must not change).
    pub poison_registers: bool,
}

/// Fills every register slot except the constants and specials with a pattern of `seed`.
fn poison_registers(prog: &Program, regs: &mut [[u64; 32]], seed: u64) {
    let mut keep = vec![false; regs.len()];
    for &(s, _) in prog.consts.iter() {
        keep[s as usize] = true;
    }
    for &(s, _) in prog.specials.iter() {
        keep[s as usize] = true;
    }
    for (i, (r, k)) in regs.iter_mut().zip(keep).enumerate() {
        if !k {
            for (l, v) in r.iter_mut().enumerate() {
                *v = 0xDEAD_BEEF_0BAD_F00D ^ (seed << 16) ^ (i as u64) << 5 ^ l as u64;
            }
        }
    }
}

struct Warp {
    regs: Vec<[u64; 32]>,
    /// [`Program::uid`] of the program `regs` holds the constants of (0: none).
    regs_uid: u64,
    pcs: [u32; 32],
    state: [u8; 32],
    stacks: Vec<Vec<u32>>,
    local: Vec<u8>,
    issued: u64,
    hint: Hints,
    /// Lane being traced in this warp.
    trace_lane: Option<u32>,
    /// Pending `cp.async` copies of the warp's threads, in issue order.
    cp: Vec<CpCopy>,
    /// Per lane: the id of the open (uncommitted) `cp.async` group; committed groups have smaller ids.
    cp_next: [u32; 32],
    /// Per lane: groups with ids below this have completed.
    cp_done: [u32; 32],
    /// `wgmma` fences, groups and in-flight operations of the warp.
    wg: crate::wgmma::WarpTrack,
    /// The named barrier the warp's lanes in [`NBAR`] wait at.
    nbar: u8,
}

/// Parks lanes `exec` of `wp` at the barrier instruction `pc` in `state` (`BAR` or `NBAR`); the
/// block loop releases them to `pc + 1`.
fn park(wp: &mut Warp, exec: u32, pc: u32, state: u8) {
    lanes(exec, |l| {
        wp.state[l] = state;
        wp.pcs[l] = pc;
    });
}

/// The 16 named barriers of a block (`bar.sync a, b` / `bar.arrive a, b`): the threads that
/// have arrived at each since it last completed, and the count it was given.
#[derive(Clone, Debug, Default)]
pub(crate) struct NamedBars {
    arrived: [u32; 16],
    count: [u32; 16],
    /// Barriers that reached their count and whose waiting warps the block loop releases.
    complete: u16,
}

impl NamedBars {
    pub(crate) fn reset(&mut self) {
        *self = NamedBars::default();
    }
}

/// One pending `cp.async`: `n` bytes from global `src` into shared offset `dst`, zero-filled to
/// `size` bytes. Both ranges were checked when it was issued; `ptr` is where the source bytes
/// are (the address `resolve` gave at issue: the launch's view of global memory does not change
/// while it runs, so the copy finds them there when it completes; 0 when `n` is 0).
#[derive(Clone, Copy)]
struct CpCopy {
    lane: u8,
    n: u8,
    size: u8,
    group: u32,
    dst: usize,
    ptr: usize,
}

/// What a worker counts besides instructions.
#[derive(Default)]
pub(crate) struct Counters {
    /// Global-memory bytes the threads read and wrote ([`crate::LaunchStats::global_bytes_read`]).
    pub global_bytes: [u64; 2],
    /// Warp instructions run as fused steps ([`crate::fuse`]).
    pub fused: u64,
    /// Shared-memory wavefronts by instruction index, when [`Launch::banks`] is on.
    pub banks: std::collections::HashMap<u32, crate::banks::Count>,
    /// Global-memory sectors by instruction index, when [`Launch::sectors`] is on.
    pub sectors: std::collections::HashMap<u32, crate::sectors::Count>,
}

#[derive(Default)]
pub(crate) struct Worker {
    warps: Vec<Warp>,
    shared: SharedMem,
    pub thread_instructions: u64,
    pub warp_instructions: u64,
    pub blocks: u64,
    pub counters: Counters,
    pub trace: Vec<TraceEntry>,
}

impl Worker {
    /// Clears the counters and the trace of an earlier launch; the warps' register files and
    /// the shared memory keep their allocations (every block start resets their contents).
    pub(crate) fn start_launch(&mut self) {
        self.thread_instructions = 0;
        self.warp_instructions = 0;
        self.blocks = 0;
        self.counters.global_bytes = [0; 2];
        self.counters.fused = 0;
        self.counters.banks.clear();
        self.counters.sectors.clear();
        self.trace.clear();
    }
}

#[inline(always)]
fn lanes(mask: u32, mut f: impl FnMut(usize)) {
    if mask == FULL {
        for l in 0..32 {
            f(l);
        }
    } else {
        let mut m = mask;
        while m != 0 {
            let l = m.trailing_zeros() as usize;
            m &= m - 1;
            f(l);
        }
    }
}

/// The lane-wise maps read each source lane and write the destination lane in one pass through
/// raw pointers: no copy of the source rows (a destination may be one of its sources; lane `l`
/// reads every source's lane `l` before writing it, so that is the same as copying first).
#[inline(always)]
fn rows<const N: usize>(r: &mut [[u64; 32]], d: Slot, src: [Slot; N]) -> (*mut u64, [*const u64; N]) {
    let len = r.len();
    assert!((d as usize) < len && src.iter().all(|&s| (s as usize) < len), "register slot out of range");
    let base = r.as_mut_ptr();
    // SAFETY: every slot was checked against the register file's length just above.
    unsafe { ((*base.add(d as usize)).as_mut_ptr(), src.map(|s| (*base.add(s as usize)).as_ptr())) }
}

#[inline(always)]
fn map1(r: &mut [[u64; 32]], d: Slot, a: Slot, exec: u32, f: impl Fn(u64) -> u64) {
    let (dv, [av]) = rows(r, d, [a]);
    // SAFETY: `rows` checked the slots; lanes are below 32.
    unsafe {
        if exec == FULL {
            for l in 0..32 {
                *dv.add(l) = f(*av.add(l));
            }
        } else {
            lanes(exec, |l| *dv.add(l) = f(*av.add(l)));
        }
    }
}
#[inline(always)]
fn map2(r: &mut [[u64; 32]], d: Slot, a: Slot, b: Slot, exec: u32, f: impl Fn(u64, u64) -> u64) {
    let (dv, [av, bv]) = rows(r, d, [a, b]);
    // SAFETY: `rows` checked the slots; lanes are below 32.
    unsafe {
        if exec == FULL {
            for l in 0..32 {
                *dv.add(l) = f(*av.add(l), *bv.add(l));
            }
        } else {
            lanes(exec, |l| *dv.add(l) = f(*av.add(l), *bv.add(l)));
        }
    }
}
#[inline(always)]
fn map3(r: &mut [[u64; 32]], d: Slot, a: Slot, b: Slot, c: Slot, exec: u32, f: impl Fn(u64, u64, u64) -> u64) {
    let (dv, [av, bv, cv]) = rows(r, d, [a, b, c]);
    // SAFETY: `rows` checked the slots; lanes are below 32.
    unsafe {
        if exec == FULL {
            for l in 0..32 {
                *dv.add(l) = f(*av.add(l), *bv.add(l), *cv.add(l));
            }
        } else {
            lanes(exec, |l| *dv.add(l) = f(*av.add(l), *bv.add(l), *cv.add(l)));
        }
    }
}

/// [`Op::Bin`] over the lanes of `exec`: the tagged integer operations as inlined loops, any
/// other function ([`IntK::Fn`]) called per lane.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn int_bin(r: &mut [[u64; 32]], k: IntK, f: F2, d: Slot, a: Slot, b: Slot, exec: u32) {
    use crate::ops;
    match k {
        IntK::Fn => map2(r, d, a, b, exec, f),
        IntK::Add32 => map2(r, d, a, b, exec, ops::add::<32>),
        IntK::Add64 => map2(r, d, a, b, exec, ops::add::<64>),
        IntK::Sub32 => map2(r, d, a, b, exec, ops::sub::<32>),
        IntK::Sub64 => map2(r, d, a, b, exec, ops::sub::<64>),
        IntK::And => map2(r, d, a, b, exec, ops::and),
        IntK::Or => map2(r, d, a, b, exec, ops::or),
        IntK::Xor => map2(r, d, a, b, exec, ops::xor),
        IntK::Shl32 => map2(r, d, a, b, exec, ops::shl::<32>),
        IntK::Shl64 => map2(r, d, a, b, exec, ops::shl::<64>),
        IntK::ShrU32 => map2(r, d, a, b, exec, ops::shr_u::<32>),
        IntK::ShrU64 => map2(r, d, a, b, exec, ops::shr_u::<64>),
        IntK::CvtBf16x2 => cvt_bf16x2(r, d, a, b, exec),
        IntK::MulLo32 => map2(r, d, a, b, exec, ops::mul::<32>),
        IntK::MulLo64 => map2(r, d, a, b, exec, ops::mul::<64>),
        IntK::MulWideU32 => map2(r, d, a, b, exec, ops::mulwide_u::<32>),
        IntK::MulWideS32 => map2(r, d, a, b, exec, ops::mulwide_s::<32>),
        IntK::FSub32 => map2(r, d, a, b, exec, ops::fsub32),
    }
}

/// `setp` with one destination and no combining predicate. Integer compares and the ordered
/// f32 compares without `.ftz` run as one monomorphic loop per (type class, comparison), chosen
/// once per instruction; everything else goes through [`compare`] lane by lane (same results:
/// the ordered float compares are false on NaN, as `<`, `<=`, `==`, `>=`, `>` are in Rust, and
/// `ne` is `<` or `>`).
// `x < y || x > y` is `ne` on floats too (false on NaN); for the integer types it is `!=`.
#[allow(clippy::too_many_arguments, clippy::double_comparisons)]
#[inline(always)]
fn setp_one(
    r: &mut [[u64; 32]],
    d: Slot,
    a: Slot,
    b: Slot,
    exec: u32,
    cmp: Cmp,
    ty: Ty,
    ftz: bool,
    comb: u8,
    negc: bool,
) {
    macro_rules! each_cmp {
        ($conv:expr) => {{
            let conv = $conv;
            match cmp {
                Cmp::Eq => map2(r, d, a, b, exec, |x, y| combine(comb, conv(x) == conv(y), negc) as u64),
                Cmp::Lt => map2(r, d, a, b, exec, |x, y| combine(comb, conv(x) < conv(y), negc) as u64),
                Cmp::Le => map2(r, d, a, b, exec, |x, y| combine(comb, conv(x) <= conv(y), negc) as u64),
                Cmp::Gt => map2(r, d, a, b, exec, |x, y| combine(comb, conv(x) > conv(y), negc) as u64),
                Cmp::Ge => map2(r, d, a, b, exec, |x, y| combine(comb, conv(x) >= conv(y), negc) as u64),
                Cmp::Ne => map2(r, d, a, b, exec, |x, y| {
                    let (x, y) = (conv(x), conv(y));
                    combine(comb, x < y || x > y, negc) as u64
                }),
                _ => map2(r, d, a, b, exec, |x, y| combine(comb, compare(cmp, ty, ftz, x, y), negc) as u64),
            }
        }};
    }
    match ty {
        Ty::S(bits) => each_cmp!(|v: u64| num::sext(v, bits as u32)),
        Ty::U(bits) | Ty::B(bits) => {
            let m = num::mask(bits as u32);
            each_cmp!(|v: u64| v & m)
        }
        Ty::F32 if !ftz => each_cmp!(|v: u64| f32::from_bits(v as u32)),
        _ => map2(r, d, a, b, exec, |x, y| combine(comb, compare(cmp, ty, ftz, x, y), negc) as u64),
    }
}

fn compare(cmp: Cmp, ty: Ty, ftz: bool, a: u64, b: u64) -> bool {
    use std::cmp::Ordering::*;
    let ord = match ty {
        Ty::F32 => {
            let (mut x, mut y) = (f32::from_bits(a as u32), f32::from_bits(b as u32));
            if ftz {
                x = num::ftz32(x);
                y = num::ftz32(y);
            }
            x.partial_cmp(&y)
        }
        Ty::F64 => f64::from_bits(a).partial_cmp(&f64::from_bits(b)),
        Ty::S(bits) => Some(num::sext(a, bits as u32).cmp(&num::sext(b, bits as u32))),
        t => {
            let m = num::mask(t.bits());
            Some((a & m).cmp(&(b & m)))
        }
    };
    match (cmp, ord) {
        (Cmp::Num, o) => o.is_some(),
        (Cmp::Nan, o) => o.is_none(),
        (Cmp::Equ | Cmp::Neu | Cmp::Ltu | Cmp::Leu | Cmp::Gtu | Cmp::Geu, None) => true,
        (_, None) => false,
        (Cmp::Eq | Cmp::Equ, Some(o)) => o == Equal,
        (Cmp::Ne | Cmp::Neu, Some(o)) => o != Equal,
        (Cmp::Lt | Cmp::Ltu, Some(o)) => o == Less,
        (Cmp::Le | Cmp::Leu, Some(o)) => o != Greater,
        (Cmp::Gt | Cmp::Gtu, Some(o)) => o == Greater,
        (Cmp::Ge | Cmp::Geu, Some(o)) => o != Less,
    }
}

fn combine(comb: u8, x: bool, c: bool) -> bool {
    match comb {
        1 => x && c,
        2 => x || c,
        3 => x ^ c,
        _ => x,
    }
}

fn atom_new(op: AtomOp, ty: Ty, old: u64, b: u64, c: u64) -> u64 {
    let bits = ty.bits();
    let m = num::mask(bits);
    let (o, b) = (old & m, b & m);
    let r = match (op, ty) {
        (AtomOp::Add, Ty::F32) => (f32::from_bits(o as u32) + f32::from_bits(b as u32)).to_bits() as u64,
        (AtomOp::Add, Ty::F64) => (f64::from_bits(o) + f64::from_bits(b)).to_bits(),
        (AtomOp::Add, _) => o.wrapping_add(b),
        (AtomOp::Min, Ty::S(_)) => num::sext(o, bits).min(num::sext(b, bits)) as u64,
        (AtomOp::Max, Ty::S(_)) => num::sext(o, bits).max(num::sext(b, bits)) as u64,
        (AtomOp::Min, _) => o.min(b),
        (AtomOp::Max, _) => o.max(b),
        (AtomOp::Inc, _) => {
            if o >= b {
                0
            } else {
                o + 1
            }
        }
        (AtomOp::Dec, _) => {
            if o == 0 || o > b {
                b
            } else {
                o - 1
            }
        }
        (AtomOp::And, _) => o & b,
        (AtomOp::Or, _) => o | b,
        (AtomOp::Xor, _) => o ^ b,
        (AtomOp::Exch, _) => b,
        (AtomOp::Cas, _) => {
            if o == b {
                c & m
            } else {
                o
            }
        }
    };
    r & m
}

fn dim3(linear: u64, dims: [u32; 3]) -> [u32; 3] {
    let x = linear % dims[0] as u64;
    let y = (linear / dims[0] as u64) % dims[1] as u64;
    let z = linear / (dims[0] as u64 * dims[1] as u64);
    [x as u32, y as u32, z as u32]
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// Recompute the group; the group's lanes are at `pc`.
    Regroup,
    /// Recompute the group; every lane's PC is already written.
    PcsSet,
}

/// The finding of a launch stopped by its time limit.
pub(crate) const TIME_LIMIT: &str = "launch time limit exceeded";

impl Launch<'_> {
    pub(crate) fn past_deadline(&self) -> bool {
        self.deadline.is_some_and(|d| std::time::Instant::now() >= d)
    }
    /// The time-limit finding for a block that did not start (thread 0, first instruction).
    pub(crate) fn time_limit_finding(&self, linear: u64) -> Box<Finding> {
        Box::new(self.finding(dim3(linear, self.grid), 0, 0, 0, &self.time_limit_kind()))
    }
    fn time_limit_kind(&self) -> String {
        format!("{TIME_LIMIT} (the kernel appears to hang, or is larger than the VM runs in that time)")
    }
    fn threads(&self) -> u32 {
        self.block[0] * self.block[1] * self.block[2]
    }

    fn finding(&self, block: [u32; 3], warp: usize, lane: u32, pc: usize, kind: &str) -> Finding {
        let inst = &self.prog.insts[pc];
        Finding {
            kind: kind.to_string(),
            kernel: self.kernel.to_string(),
            block,
            thread: dim3(warp as u64 * 32 + lane as u64, self.block),
            line: inst.line as usize,
            instruction: self.prog.texts[pc].clone(),
            address: None,
            access_bytes: None,
            nearest_allocation: None,
            buffer: None,
            source: None,
            conflict: None,
        }
    }

    fn fault_finding(&self, block: [u32; 3], warp: usize, pc: usize, f: Fault) -> Finding {
        let mut fd = self.finding(block, warp, f.lane, pc, f.kind);
        fd.address = Some(f.addr);
        fd.access_bytes = Some(f.size);
        fd.conflict = f.other.map(|o| {
            let pc = o.pc as usize;
            Conflict {
                warp: o.warp,
                write: o.write,
                line: self.prog.insts[pc].line as usize,
                instruction: self.prog.texts[pc].clone(),
                source: None,
            }
        });
        fd.nearest_allocation = Some(match f.detail {
            Some(d) => d,
            None => match f.kind {
                "shared memory out of window" => format!(
                    "the block's shared window is {} bytes ({} static + {} dynamic)",
                    self.shared_bytes, self.prog.info.static_shared_bytes, self.dyn_shared
                ),
                "uninitialized shared memory read" => {
                    let off = if f.addr >= SHARED_WINDOW { f.addr - SHARED_WINDOW } else { f.addr };
                    format!(
                        "no thread of this block has written shared bytes {off}..{} yet \
                         (a missing bar.sync or cp.async wait?)",
                        off + f.size as u64
                    )
                }
                "local memory overflow" => format!("the thread's local memory is {} bytes", self.prog.info.local_bytes),
                "out-of-bounds parameter load" | "store to kernel parameter space" => {
                    format!("the kernel parameter buffer is {} bytes", self.params.len())
                }
                _ if f.addr >= SHARED_WINDOW && f.addr < SHARED_WINDOW + WINDOW_SIZE => {
                    format!("shared memory offset {}", f.addr - SHARED_WINDOW)
                }
                _ => self.global.describe(f.addr, f.size as u64),
            },
        });
        fd
    }

    pub fn run_block(&self, w: &mut Worker, linear: u64) -> Result<(), Box<Finding>> {
        let prog = self.prog;
        let block = dim3(linear, self.grid);
        let threads = self.threads();
        let nwarps = threads.div_ceil(32) as usize;
        // Shared memory: fresh, poisoned, nothing written yet.
        w.shared.reset(self.shared_bytes, self.initcheck, self.racecheck);
        w.shared.hopper.reset(nwarps, self.shared_bytes, !prog.hopper.is_empty());
        let trace_at = self.trace.filter(|t| t.block == block).and_then(|t| {
            let [x, y, z] = t.thread;
            if x < self.block[0] && y < self.block[1] && z < self.block[2] {
                Some((x + self.block[0] * (y + self.block[1] * z)) as usize)
            } else {
                None
            }
        });
        let local_bytes = prog.info.local_bytes;
        let zero = prog.zero_slots();
        while w.warps.len() < nwarps {
            w.warps.push(Warp {
                regs: Vec::new(),
                regs_uid: 0,
                pcs: [0; 32],
                state: [ABSENT; 32],
                stacks: Vec::new(),
                local: Vec::new(),
                issued: 0,
                hint: Hints::default(),
                trace_lane: None,
                cp: Vec::new(),
                cp_next: [0; 32],
                cp_done: [0; 32],
                wg: Default::default(),
                nbar: 0,
            });
        }
        for (wi, wp) in w.warps.iter_mut().enumerate().take(nwarps) {
            // Registers read as zero until written: the slots some path may read first (all of
            // them when the file holds another program's), then the constants once.
            match zero {
                Some(z) if wp.regs_uid == prog.uid && wp.regs.len() == prog.nslots => {
                    if self.poison_registers {
                        poison_registers(prog, &mut wp.regs, wi as u64 ^ linear << 8);
                    }
                    for &s in z {
                        wp.regs[s as usize] = [0; 32];
                    }
                }
                _ => {
                    wp.regs.clear();
                    wp.regs.resize(prog.nslots, [0u64; 32]);
                    for &(s, v) in &prog.consts {
                        wp.regs[s as usize] = [v; 32];
                    }
                    wp.regs_uid = prog.uid;
                }
            }
            wp.pcs = [0; 32];
            wp.issued = 0;
            wp.cp.clear();
            wp.cp_next = [0; 32];
            wp.cp_done = [0; 32];
            wp.wg.reset(if prog.wgmma.is_empty() { 0 } else { prog.nslots });
            wp.local.clear();
            wp.local.resize(local_bytes * 32, 0);
            if prog.has_calls {
                wp.stacks.resize(32, Vec::new());
                for s in wp.stacks.iter_mut() {
                    s.clear();
                }
            }
            wp.trace_lane = trace_at.filter(|t| t / 32 == wi).map(|t| (t % 32) as u32);
            for l in 0..32u32 {
                let lin = wi as u64 * 32 + l as u64;
                wp.state[l as usize] = if lin < threads as u64 { RUN } else { ABSENT };
                let tid = dim3(lin, self.block);
                for &(s, sp) in &prog.specials {
                    let v: u64 = match sp {
                        Special::Tid(d) => tid[d as usize] as u64,
                        Special::Ntid(d) => self.block[d as usize] as u64,
                        Special::Ctaid(d) => block[d as usize] as u64,
                        Special::Nctaid(d) => self.grid[d as usize] as u64,
                        Special::Laneid => l as u64,
                        Special::Warpid => wi as u64,
                        Special::Nwarpid => nwarps as u64,
                        Special::LanemaskEq => 1u64 << l,
                        Special::LanemaskLt => (1u64 << l) - 1,
                        Special::LanemaskLe => (2u64 << l) - 1,
                        Special::LanemaskGt => (!((2u64 << l) - 1)) & 0xffff_ffff,
                        Special::LanemaskGe => (!((1u64 << l) - 1)) & 0xffff_ffff,
                        Special::Smid | Special::Gridid => 0,
                        Special::Nsmid => 1,
                        Special::DynSmem => self.dyn_shared as u64,
                        Special::TotalSmem => self.shared_bytes as u64,
                        Special::ClusterCtaid(_) | Special::ClusterCtarank | Special::IsExplicitCluster => 0,
                        Special::ClusterNctaid(_) | Special::ClusterNctarank => 1,
                        Special::Clusterid(d) => block[d as usize] as u64,
                        Special::Nclusterid(d) => self.grid[d as usize] as u64,
                    };
                    wp.regs[s as usize][l as usize] = v;
                }
            }
        }
        let mut trace = std::mem::take(&mut w.trace);
        let r = self.block_loop(w, nwarps, block, &mut trace);
        w.trace = trace;
        w.blocks += 1;
        r
    }

    fn block_loop(
        &self,
        w: &mut Worker,
        nwarps: usize,
        block: [u32; 3],
        trace: &mut Vec<TraceEntry>,
    ) -> Result<(), Box<Finding>> {
        let (mut stalled, mut progress) = (0u32, None);
        loop {
            for wi in 0..nwarps {
                let (warps, shared, counters) = (&mut w.warps, &mut w.shared, &mut w.counters);
                let wp = &mut warps[wi];
                if wp.state.contains(&RUN) {
                    shared.race.warp = wi as u32;
                    let mut ti = 0u64;
                    let mut wi_count = 0u64;
                    let r = self.run_warp(wp, wi, block, shared, counters, &mut ti, &mut wi_count, trace);
                    w.thread_instructions += ti;
                    w.warp_instructions += wi_count;
                    r?;
                }
            }
            // Named barriers that have their threads release the warps waiting at them (a
            // completed barrier counts afresh).
            if w.shared.named.complete != 0 {
                let done = std::mem::take(&mut w.shared.named.complete);
                for i in 0..16 {
                    if done >> i & 1 == 1 {
                        w.shared.named.arrived[i] = 0;
                        w.shared.named.count[i] = 0;
                    }
                }
                for wp in w.warps.iter_mut().take(nwarps) {
                    if done >> wp.nbar & 1 == 1 {
                        for l in 0..32 {
                            if wp.state[l] == NBAR {
                                wp.state[l] = RUN;
                                wp.pcs[l] += 1;
                            }
                        }
                    }
                }
                continue;
            }
            // Every warp is done or parked at a barrier or a wgmma.mma_async.
            if !self.prog.wgmma.is_empty() && self.wgmma_release(w, nwarps, block)? {
                continue;
            }
            // Warps that yielded at a failed mbarrier wait run again, while anything changes.
            if w.warps.iter().take(nwarps).any(|wp| wp.state.contains(&YIELD)) {
                let mut parked = 0usize;
                for wp in w.warps.iter().take(nwarps) {
                    parked += wp.state.iter().filter(|&&s| matches!(s, EXIT | BAR | WAIT | NBAR)).count();
                }
                let now = Some((w.shared.hopper.changes, parked));
                if now == progress {
                    stalled += 1;
                    if stalled >= STALLED_ROUNDS {
                        return Err(Box::new(self.mbarrier_deadlock(w, nwarps, block)));
                    }
                } else {
                    (stalled, progress) = (0, now);
                }
                for wp in w.warps.iter_mut().take(nwarps) {
                    for s in wp.state.iter_mut() {
                        if *s == YIELD {
                            *s = RUN;
                        }
                    }
                }
                continue;
            }
            // Every warp is done or parked at a barrier. One parked at a named barrier now waits
            // for arrivals no warp can make any more.
            if let Some((wi, l)) =
                (0..nwarps).find_map(|wi| (0..32).find(|&l| w.warps[wi].state[l] == NBAR).map(|l| (wi, l)))
            {
                let wp = &w.warps[wi];
                let i = wp.nbar as usize;
                let mut f = self.finding(block, wi, l as u32, wp.pcs[l] as usize, "deadlock");
                f.nearest_allocation = Some(format!(
                    "named barrier {i} has {} of its {} threads and no running warp is left to arrive (any warp not \
                     at it has exited or waits elsewhere)",
                    w.shared.named.arrived[i], w.shared.named.count[i]
                ));
                return Err(Box::new(f));
            }
            let mut first: Option<(usize, u32, u32)> = None; // (warp, lane, pc)
            for (wi, wp) in w.warps.iter().enumerate().take(nwarps) {
                let mut wpc: Option<(u32, u32)> = None;
                for l in 0..32u32 {
                    if wp.state[l as usize] != BAR {
                        continue;
                    }
                    let pc = wp.pcs[l as usize];
                    match wpc {
                        None => wpc = Some((l, pc)),
                        Some((l0, pc0)) if pc0 != pc => {
                            return Err(Box::new(self.finding(
                                block,
                                wi,
                                l0.min(l),
                                wp.pcs[l0.min(l) as usize] as usize,
                                "barrier divergence",
                            )));
                        }
                        _ => {}
                    }
                }
                if let Some((l, pc)) = wpc {
                    match first {
                        None => first = Some((wi, l, pc)),
                        Some((_, _, pc0)) if pc0 != pc => {
                            return Err(Box::new(self.finding(block, wi, l, pc as usize, "deadlock")));
                        }
                        _ => {}
                    }
                }
            }
            if first.is_none() {
                if let Err((wi, pc, detail)) = w.shared.hopper.block_end() {
                    let mut f = self.finding(block, wi, 0, pc as usize, "warp collective divergence");
                    f.nearest_allocation = Some(detail);
                    return Err(Box::new(f));
                }
                return Ok(());
            }
            for wp in w.warps.iter_mut().take(nwarps) {
                for l in 0..32 {
                    if wp.state[l] == BAR {
                        wp.state[l] = RUN;
                        wp.pcs[l] += 1;
                    }
                }
            }
            // The barrier orders everything before it against everything after it.
            w.shared.race.next_epoch();
            w.shared.hopper.barrier_sync();
        }
    }

    /// The finding of a block whose warps only fail mbarrier waits: at the first yielded warp's
    /// last failed wait, naming the barrier's state and where the other warps are.
    fn mbarrier_deadlock(&self, w: &Worker, nwarps: usize, block: [u32; 3]) -> Finding {
        let st = &w.shared.hopper;
        let mut waiting = Vec::new();
        let mut at_bar = Vec::new();
        let mut first = None;
        for (wi, wp) in w.warps.iter().enumerate().take(nwarps) {
            if let Some(l) = wp.state.iter().position(|&s| s == YIELD) {
                let fw = st.failed.get(wi).copied().flatten();
                first = first.or(fw.map(|f| (wi, l as u32, f)));
                if let Some(f) = fw {
                    let what = if f.parity { format!("parity {}", f.x & 1) } else { format!("state {:#x}", f.x) };
                    waiting.push(format!(
                        "warp {wi} waits at PTX line {} for {what}: {}",
                        self.prog.insts[f.pc as usize].line,
                        st.describe(f.bar_off)
                    ));
                }
            } else if let Some(l) = wp.state.iter().position(|&s| s == BAR) {
                at_bar.push(format!(
                    "warp {wi} waits at bar.sync (PTX line {})",
                    self.prog.insts[wp.pcs[l] as usize].line
                ));
            }
        }
        let (wi, lane, fw) = first.expect("a yielded warp has a failed wait");
        let mut f = self.finding(block, wi, lane, fw.pc as usize, "deadlock");
        waiting.extend(at_bar);
        f.nearest_allocation = Some(format!(
            "no mbarrier phase can complete any more: {} (any warp not named has exited)",
            waiting.join("; ")
        ));
        f
    }

    #[allow(clippy::too_many_arguments)]
    fn run_warp(
        &self,
        wp: &mut Warp,
        wi: usize,
        block: [u32; 3],
        shared: &mut SharedMem,
        counters: &mut Counters,
        ti: &mut u64,
        wc: &mut u64,
        trace: &mut Vec<TraceEntry>,
    ) -> Result<(), Box<Finding>> {
        loop {
            let mut runnable = 0u32;
            let mut pc = u32::MAX;
            for l in 0..32 {
                if wp.state[l] == RUN {
                    runnable |= 1 << l;
                    pc = pc.min(wp.pcs[l]);
                }
            }
            if runnable == 0 {
                // Lanes parked at a collective that no running lane can join any more (the rest
                // exited, wait at a barrier or at another collective): run the lowest group, so
                // the collective reports the lanes that are missing.
                let mut wpc = u32::MAX;
                for l in 0..32 {
                    if wp.state[l] == WAIT {
                        wpc = wpc.min(wp.pcs[l]);
                    }
                }
                if wpc == u32::MAX || wp.state.contains(&YIELD) {
                    return Ok(());
                }
                for l in 0..32 {
                    if wp.state[l] == WAIT && wp.pcs[l] == wpc {
                        wp.state[l] = RUN;
                    }
                }
                continue;
            }
            let mut group = 0u32;
            let mut limit = u32::MAX;
            lanes(runnable, |l| {
                if wp.pcs[l] == pc {
                    group |= 1 << l;
                } else {
                    limit = limit.min(wp.pcs[l]);
                }
            });
            self.run_group(wp, wi, block, shared, counters, pc, group, limit, ti, wc, trace)?;
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn run_group(
        &self,
        wp: &mut Warp,
        wi: usize,
        block: [u32; 3],
        shared: &mut SharedMem,
        counters: &mut Counters,
        mut pc: u32,
        mut group: u32,
        limit: u32,
        ti: &mut u64,
        wc: &mut u64,
        trace: &mut Vec<TraceEntry>,
    ) -> Result<(), Box<Finding>> {
        let prog = self.prog;
        let insts = &prog.insts[..];
        let local_bytes = prog.info.local_bytes;
        let mut tr = wp.trace_lane.is_some_and(|l| group >> l & 1 == 1);
        let wg_info = prog.wgmma_info();
        let max_trace = self.trace.map_or(0, |t| t.max_entries);
        // Fused steps (`crate::fuse`) only where nothing watches single instructions.
        let fuse = wp.trace_lane.is_none() && !self.banks && !self.sectors && wg_info.is_none() && avx512();
        macro_rules! leave {
            () => {{
                lanes(group, |l| wp.pcs[l] = pc);
                return Ok(());
            }};
        }
        loop {
            if pc >= limit {
                leave!();
            }
            let inst = &insts[pc as usize];
            if inst.op.is_warp_collective() {
                // Reconvergence. Lanes of a warp that took different paths of a branch run one
                // path after the other (lowest PC first), so a path laid out after the join
                // reaches a collective later than the other. Lanes already parked here join this
                // group; if lanes this collective needs are still running elsewhere, this group
                // parks until they arrive (as the hardware reconverges the warp before it).
                let mut waiting = 0u32;
                let mut running = 0u32;
                // (A converged warp has no lane outside the group.)
                for l in 0..if group == FULL { 0 } else { 32 } {
                    if group >> l & 1 == 0 {
                        if wp.state[l] == WAIT && wp.pcs[l] == pc {
                            waiting |= 1 << l;
                        } else if matches!(wp.state[l], RUN | YIELD) {
                            running |= 1 << l;
                        }
                    }
                }
                lanes(waiting, |l| wp.state[l] = RUN);
                group |= waiting;
                let needed = match inst.op {
                    Op::Shfl { mask, .. }
                    | Op::Vote { mask, .. }
                    | Op::Redux { mask, .. }
                    | Op::Match { mask, .. }
                    | Op::Elect { mask, .. }
                        if mask != NONE =>
                    {
                        wp.regs[mask as usize][group.trailing_zeros() as usize] as u32
                    }
                    _ => FULL,
                };
                if needed & running != 0 {
                    lanes(group, |l| {
                        wp.state[l] = WAIT;
                        wp.pcs[l] = pc;
                    });
                    return Ok(());
                }
            }
            if inst.fused != 0 && fuse && group == FULL {
                // A run of `ld.shared.b32` + `fma.rn.f32` pairs in one step (`crate::fuse`),
                // when no counter limit falls inside it.
                let steps = 2 * inst.fused as u64;
                let issued = wp.issued;
                if issued + steps <= self.budget
                    && (issued & 0xFFFF) + steps < 0x10000
                    && pc as u64 + steps <= limit as u64
                    && crate::fuse::run(&mut wp.regs, shared, insts, pc, steps as usize / 2)
                {
                    *ti += 32 * steps;
                    *wc += steps;
                    counters.fused += steps;
                    wp.issued += steps;
                    pc += steps as u32;
                    continue;
                }
            }
            let mut exec = group;
            if inst.guard != NONE {
                let mut gm = guard_mask(&wp.regs[inst.guard as usize]);
                if inst.gneg {
                    gm = !gm;
                }
                exec &= gm;
            }
            *ti += group.count_ones() as u64;
            *wc += 1;
            wp.issued += 1;
            shared.race.pc = pc;
            if wp.issued & 0xFFFF == 0 && self.past_deadline() {
                let l = group.trailing_zeros();
                return Err(Box::new(self.finding(block, wi, l, pc as usize, &self.time_limit_kind())));
            }
            if wp.issued > self.budget {
                let l = group.trailing_zeros();
                return Err(Box::new(self.finding(
                    block,
                    wi,
                    l,
                    pc as usize,
                    "instruction budget exceeded (the kernel appears to hang)",
                )));
            }
            if let Some(info) = wg_info {
                let t = &info.touched[pc as usize];
                if !t.is_empty() && exec != 0 {
                    if let Err(h) = wp.wg.access(prog, t, pc) {
                        return Err(Box::new(self.wgmma_hazard_finding(block, wi, exec.trailing_zeros(), pc, h)));
                    }
                }
            }
            let r = &mut wp.regs;
            if self.banks && exec != 0 {
                if let Some((waves, ideal)) = crate::banks::of_op(&inst.op, r, exec) {
                    let c = counters.banks.entry(pc).or_default();
                    c[0] += 1;
                    c[1] += waves;
                    c[2] += ideal;
                }
            }
            if self.sectors && exec != 0 {
                if let Some((useful, n)) = crate::sectors::of_op(&inst.op, r, exec) {
                    let c = counters.sectors.entry(pc).or_default();
                    c[0] += 1;
                    c[1] += useful;
                    c[2] += n;
                }
            }
            let mut stop: Option<Stop> = None;
            match inst.op {
                Op::Bra { t } => {
                    if exec == group {
                        pc = t;
                    } else if exec == 0 {
                        pc += 1;
                    } else {
                        lanes(group, |l| wp.pcs[l] = if exec >> l & 1 == 1 { t } else { pc + 1 });
                        stop = Some(Stop::PcsSet);
                    }
                }
                Op::Exit | Op::Ret if !prog.has_calls || matches!(inst.op, Op::Exit) => {
                    if !wp.cp.is_empty() {
                        // A thread that exits with copies in flight completes them.
                        cp_complete(shared, &mut wp.cp, |c| exec >> c.lane & 1 == 1);
                    }
                    lanes(exec, |l| wp.state[l] = EXIT);
                    group &= !exec;
                    pc += 1;
                    if group == 0 {
                        stop = Some(Stop::Regroup);
                    }
                }
                Op::Ret => {
                    let stacks = &mut wp.stacks;
                    let state = &mut wp.state;
                    let pcs = &mut wp.pcs;
                    let mut exited = 0u32;
                    lanes(group, |l| {
                        if exec >> l & 1 == 1 {
                            match stacks[l].pop() {
                                Some(ret) => pcs[l] = ret,
                                None => {
                                    state[l] = EXIT;
                                    exited |= 1 << l;
                                }
                            }
                        } else {
                            pcs[l] = pc + 1;
                        }
                    });
                    if exited != 0 && !wp.cp.is_empty() {
                        cp_complete(shared, &mut wp.cp, |c| exited >> c.lane & 1 == 1);
                    }
                    stop = Some(Stop::PcsSet);
                }
                Op::Call { t, copies } => {
                    let cps = &prog.copies[copies as usize];
                    for &(s, d) in cps {
                        let sv = r[s as usize];
                        let dv = &mut r[d as usize];
                        lanes(exec, |l| dv[l] = sv[l]);
                    }
                    if wp.stacks[0].len() > 4096 {
                        return Err(Box::new(self.finding(
                            block,
                            wi,
                            exec.trailing_zeros(),
                            pc as usize,
                            "call stack overflow",
                        )));
                    }
                    let stacks = &mut wp.stacks;
                    let pcs = &mut wp.pcs;
                    lanes(group, |l| {
                        if exec >> l & 1 == 1 {
                            stacks[l].push(pc + 1);
                            pcs[l] = t;
                        } else {
                            pcs[l] = pc + 2;
                        }
                    });
                    if exec == group {
                        pc = t;
                    } else {
                        stop = Some(Stop::PcsSet);
                    }
                }
                Op::CallRet { copies } => {
                    for &(s, d) in &prog.copies[copies as usize] {
                        let sv = r[s as usize];
                        let dv = &mut r[d as usize];
                        lanes(exec, |l| dv[l] = sv[l]);
                    }
                    pc += 1;
                }
                Op::Trap => {
                    if exec != 0 {
                        return Err(Box::new(self.finding(block, wi, exec.trailing_zeros(), pc as usize, "trap")));
                    }
                    pc += 1;
                }
                Op::Bar => {
                    if exec != 0 {
                        park(wp, exec, pc, BAR);
                        group &= !exec;
                        stop = Some(Stop::Regroup);
                    }
                    pc += 1;
                }
                Op::NamedBar { id, count, arrive } => {
                    if exec != 0 {
                        let l0 = exec.trailing_zeros() as usize;
                        let (idv, n) = (r[id as usize][l0] as u32, r[count as usize][l0] as u32);
                        let live = (0..32)
                            .filter(|&l| wp.state[l] != EXIT && wp.state[l] != ABSENT)
                            .fold(0u32, |m, l| m | 1 << l);
                        let bad = if idv >= 16 {
                            Some(format!("barrier id {idv}: the ids are 0..=15"))
                        } else if n == 0 || n % 32 != 0 || n > self.threads() {
                            Some(format!(
                                "thread count {n}: it must be a non-zero multiple of 32 and at most the block's {} threads",
                                self.threads()
                            ))
                        } else if exec != live {
                            Some(format!(
                                "lanes {:#010x} of the warp execute it and lanes {live:#010x} are live: all of a warp's threads \
                                 must execute a named barrier together",
                                exec
                            ))
                        } else if shared.named.count[idv as usize] != 0 && shared.named.count[idv as usize] != n {
                            Some(format!(
                                "thread count {n}, while barrier {idv} is counting to {} (arrivals since it last completed)",
                                shared.named.count[idv as usize]
                            ))
                        } else {
                            None
                        };
                        if let Some(why) = bad {
                            let mut f = self.finding(block, wi, l0 as u32, pc as usize, "named barrier misuse");
                            f.nearest_allocation = Some(why);
                            return Err(Box::new(f));
                        }
                        let nb = &mut shared.named;
                        let i = idv as usize;
                        nb.count[i] = n;
                        nb.arrived[i] += 32;
                        if nb.arrived[i] >= n {
                            nb.complete |= 1 << i;
                        }
                        if !arrive {
                            wp.nbar = idv as u8;
                            park(wp, exec, pc, NBAR);
                            group &= !exec;
                            stop = Some(Stop::Regroup);
                        }
                    }
                    pc += 1;
                }
                Op::Shfl { .. }
                | Op::Vote { .. }
                | Op::Redux { .. }
                | Op::Match { .. }
                | Op::BarWarp
                | Op::Elect { .. } => {
                    if exec != 0 {
                        let mslot = match inst.op {
                            Op::Shfl { mask, .. }
                            | Op::Vote { mask, .. }
                            | Op::Redux { mask, .. }
                            | Op::Match { mask, .. }
                            | Op::Elect { mask, .. } => mask,
                            _ => NONE,
                        };
                        let member =
                            if mslot == NONE { FULL } else { r[mslot as usize][exec.trailing_zeros() as usize] as u32 };
                        let mut missing = 0u32;
                        // (When every lane executes it, none is missing.)
                        for l in 0..if exec == FULL { 0 } else { 32 } {
                            if member >> l & 1 == 1
                                && matches!(wp.state[l], RUN | BAR | WAIT | YIELD)
                                && exec >> l & 1 == 0
                            {
                                missing |= 1 << l;
                            }
                        }
                        if missing != 0 {
                            let l = exec.trailing_zeros();
                            let mut f = self.finding(block, wi, l, pc as usize, "warp collective divergence");
                            f.nearest_allocation = Some(format!(
                                "member mask {member:#010x} names lanes {missing:#010x} that are not executing this instruction"
                            ));
                            return Err(Box::new(f));
                        }
                        // A lane that has exited holds no value to give: a shuffle that reads one
                        // gets an undefined value (a per-lane `return` before a warp reduction).
                        if let Op::Shfl { mode, b, c, .. } = inst.op {
                            if exec != FULL {
                                let from_exited = (0..32).find_map(|l| {
                                    let j = shfl_source(mode, l, r[b as usize][l], r[c as usize][l])?;
                                    (exec >> l & 1 == 1 && wp.state[j] == EXIT).then_some((l, j))
                                });
                                if let Some((l, j)) = from_exited {
                                    let mut f =
                                        self.finding(block, wi, l as u32, pc as usize, "shuffle from an exited lane");
                                    f.nearest_allocation = Some(format!(
                                        "lane {l} reads lane {j}, which has exited: the value it gets is undefined"
                                    ));
                                    return Err(Box::new(f));
                                }
                            }
                        }
                        collective(&inst.op, r, exec, &prog.shfl_perms);
                    }
                    pc += 1;
                }
                Op::Ldmatrix { .. } | Op::Mma { .. } => {
                    if exec != 0 {
                        if exec != FULL {
                            return Err(self.aligned_divergence(block, wi, exec, pc));
                        }
                        if let Op::Mma { kind, k16, d, srcs } = inst.op {
                            mma(r, kind, k16, d, &prog.mma_srcs[srcs as usize]);
                        } else if let Op::Ldmatrix { num, trans, sp, ds, a, off } = inst.op {
                            let mut mem = Mem {
                                global: self.global,
                                shared: &mut *shared,
                                local: &mut wp.local,
                                local_bytes,
                                params: self.params,
                                hint: &mut wp.hint,
                                traffic: &mut counters.global_bytes,
                            };
                            if !ldmatrix_fast(r, &mut mem, num, trans, sp, ds, a, off) {
                                ldmatrix(r, &mut mem, num, trans, sp, ds, a, off)
                                    .map_err(|f| Box::new(self.fault_finding(block, wi, pc as usize, f)))?;
                            }
                        }
                    }
                    pc += 1;
                }
                Op::WgmmaMma { .. } | Op::WgmmaFence | Op::WgmmaCommit | Op::WgmmaWait { .. } => {
                    if exec != 0 {
                        if exec != FULL {
                            return Err(self.aligned_divergence(block, wi, exec, pc));
                        }
                        match inst.op {
                            Op::WgmmaMma { .. } => {
                                // Parked until the warpgroup's other warps arrive.
                                lanes(exec, |l| {
                                    wp.state[l] = WGW;
                                    wp.pcs[l] = pc;
                                });
                                group = 0;
                                stop = Some(Stop::Regroup);
                            }
                            Op::WgmmaFence => wp.wg.fence(),
                            Op::WgmmaCommit => wp.wg.commit(),
                            Op::WgmmaWait { n } => {
                                for snap in wp.wg.wait(prog, n) {
                                    if let Some(at) = snap.changed(&shared.bytes) {
                                        return Err(Box::new(
                                            self.wgmma_overwrite_finding(block, wi, pc, &snap, at, shared),
                                        ));
                                    }
                                }
                            }
                            _ => {}
                        }
                    }
                    pc += 1;
                }
                Op::CpAsync { size, d, doff, a, aoff, n } => {
                    if exec != 0 {
                        let mut mem = Mem {
                            global: self.global,
                            shared: &mut *shared,
                            local: &mut wp.local,
                            local_bytes,
                            params: self.params,
                            hint: &mut wp.hint,
                            traffic: &mut counters.global_bytes,
                        };
                        let (cp, next) = (&mut wp.cp, &wp.cp_next);
                        match cp_issue_fast(r, &mut mem, cp, next, exec, size, d, doff, a, aoff, n) {
                            Ok(true) => {
                                pc += 1;
                                continue;
                            }
                            Ok(false) => {}
                            Err(f) => return Err(Box::new(self.fault_finding(block, wi, pc as usize, f))),
                        }
                        let mut err = None;
                        lanes(exec, |l| {
                            if err.is_some() {
                                return;
                            }
                            let dst = r[d as usize][l].wrapping_add(doff as i64 as u64);
                            let src = r[a as usize][l].wrapping_add(aoff as i64 as u64);
                            let nb = if n == NONE { size as u64 } else { r[n as usize][l] & 0xffff_ffff };
                            match cp_issue(&mut mem, l as u32, size, dst, src, nb) {
                                Ok((dst, ptr)) => cp.push(CpCopy {
                                    lane: l as u8,
                                    n: nb as u8,
                                    size,
                                    group: next[l],
                                    dst,
                                    ptr: ptr as usize,
                                }),
                                Err(f) => err = Some(f),
                            }
                        });
                        if let Some(f) = err {
                            return Err(Box::new(self.fault_finding(block, wi, pc as usize, f)));
                        }
                    }
                    pc += 1;
                }
                Op::Hopper { i, d } => {
                    if exec != 0 {
                        let mut live = 0u32;
                        for l in 0..32 {
                            if matches!(wp.state[l], RUN | BAR | WAIT | YIELD) {
                                live |= 1 << l;
                            }
                        }
                        let mut mem = Mem {
                            global: self.global,
                            shared: &mut *shared,
                            local: &mut wp.local,
                            local_bytes,
                            params: self.params,
                            hint: &mut wp.hint,
                            traffic: &mut counters.global_bytes,
                        };
                        let h = &prog.hopper[i as usize];
                        match crate::hopper::exec(h, d, r, exec, live, wi, pc, &mut mem) {
                            Ok(crate::hopper::Flow::Next) => {}
                            Ok(crate::hopper::Flow::Yield) => {
                                // A failed wait: the group continues after it once the other
                                // warps ran (the kernel's loop retries the wait).
                                lanes(group, |l| wp.state[l] = YIELD);
                                stop = Some(Stop::Regroup);
                            }
                            Err(f) => return Err(Box::new(self.fault_finding(block, wi, pc as usize, f))),
                        }
                    }
                    pc += 1;
                }
                Op::CpCommit => {
                    lanes(exec, |l| wp.cp_next[l] += 1);
                    pc += 1;
                }
                Op::CpWait { n, all } => {
                    if exec != 0 {
                        // Copies of group < upto[lane] complete.
                        let mut upto = [0u32; 32];
                        lanes(exec, |l| {
                            if all {
                                wp.cp_next[l] += 1;
                            }
                            let pending = wp.cp_next[l] - wp.cp_done[l];
                            if pending > n {
                                wp.cp_done[l] = wp.cp_next[l] - n;
                            }
                            upto[l] = wp.cp_done[l];
                        });
                        if !wp.cp.is_empty() {
                            cp_complete(shared, &mut wp.cp, |c| {
                                exec >> c.lane & 1 == 1 && c.group < upto[c.lane as usize]
                            });
                        }
                    }
                    pc += 1;
                }
                Op::Activemask { d } => {
                    let dv = &mut r[d as usize];
                    lanes(exec, |l| dv[l] = group as u64);
                    pc += 1;
                }
                Op::Clock { d } => {
                    let v = wp.issued;
                    let dv = &mut r[d as usize];
                    lanes(exec, |l| dv[l] = v);
                    pc += 1;
                }
                Op::Ld { sp: Space::Shared, size, n, sext, dbits, ds, a, off } if shared.all_written() => {
                    // The f32 kernels' operand loads, without the call into `exec_simple`
                    // (which runs them when the fast path declines).
                    if exec != 0 {
                        let mut mem = Mem {
                            global: self.global,
                            shared: &mut *shared,
                            local: &mut wp.local,
                            local_bytes,
                            params: self.params,
                            hint: &mut wp.hint,
                            traffic: &mut counters.global_bytes,
                        };
                        let done = ld_shared_fast(r, exec, &mut mem, size, n, sext, dbits, ds, a, off)
                            .and_then(|done| if done { Ok(()) } else { exec_simple(&inst.op, r, exec, &mut mem) });
                        if let Err(f) = done {
                            return Err(Box::new(self.fault_finding(block, wi, pc as usize, f)));
                        }
                    }
                    pc += 1;
                }
                _ => {
                    if exec != 0 && !exec_register_op(&inst.op, r, exec) {
                        let mut mem = Mem {
                            global: self.global,
                            shared: &mut *shared,
                            local: &mut wp.local,
                            local_bytes,
                            params: self.params,
                            hint: &mut wp.hint,
                            traffic: &mut counters.global_bytes,
                        };
                        if let Err(f) = exec_simple(&inst.op, r, exec, &mut mem) {
                            let pcu = pc as usize;
                            return Err(Box::new(self.fault_finding(block, wi, pcu, f)));
                        }
                    }
                    pc += 1;
                }
            }
            if tr {
                let l = wp.trace_lane.unwrap_or(0) as usize;
                if trace.len() < max_trace {
                    let executed = exec >> l & 1 == 1;
                    let writes = if executed {
                        inst.op
                            .dsts()
                            .into_iter()
                            .map(|s| (prog.slot_names[s as usize].clone(), wp.regs[s as usize][l]))
                            .collect()
                    } else {
                        Vec::new()
                    };
                    let idx = inst as *const Inst as usize - insts.as_ptr() as usize;
                    let idx = idx / std::mem::size_of::<Inst>();
                    trace.push(TraceEntry {
                        line: inst.line as usize,
                        text: prog.texts[idx].clone(),
                        executed,
                        writes,
                        source: None,
                        finding: None,
                    });
                }
                tr = wp.trace_lane.is_some_and(|l| group >> l & 1 == 1);
            }
            match stop {
                None => {}
                Some(Stop::Regroup) => {
                    lanes(group, |l| wp.pcs[l] = pc);
                    return Ok(());
                }
                Some(Stop::PcsSet) => return Ok(()),
            }
        }
    }
}

/// Whether the bits `mask` of every lane's value are those of lane 0's.
#[inline(always)]
fn uniform(v: &[u64; 32], mask: u64) -> bool {
    let x0 = v[0];
    v.iter().fold(0, |acc, &x| acc | (x ^ x0)) & mask == 0
}

/// The source lane of every lane of a `shfl` of mode `mode` (0 up, 1 down, 2 bfly, 3 idx) with
/// lane operand `b` and clamp/segment word `c` the same in every lane; a lane whose source is out
/// of range reads its own value.
pub(crate) fn shfl_sources(mode: u8, b: u64, c: u64) -> [u8; 32] {
    let (bval, cval, segmask) = ((b & 0x1f) as i64, (c & 0x1f) as i64, ((c >> 8) & 0x1f) as i64);
    std::array::from_fn(|l| {
        let lane = l as i64;
        let max_lane = (lane & segmask) | (cval & !segmask);
        let (j, ok) = match mode {
            0 => (lane - bval, lane - bval >= max_lane),
            1 => (lane + bval, lane + bval <= max_lane),
            2 => (lane ^ bval, (lane ^ bval) <= max_lane),
            _ => {
                let j = (lane & segmask) | (bval & !segmask);
                (j, j <= max_lane)
            }
        };
        if ok && (0..32).contains(&j) {
            j as u8
        } else {
            l as u8
        }
    })
}

/// `d[l] = a[src[l]]` (the low 32 bits) for every lane.
#[inline(always)]
fn shfl_permute(r: &mut [[u64; 32]], d: Slot, a: Slot, src: &[u8; 32]) {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        let _ = &r[a as usize];
        let _ = &r[d as usize];
        // SAFETY: the CPU has AVX-512F; both slots are rows of `r` (indexed above).
        unsafe {
            shfl_permute_avx512(r.as_mut_ptr().add(a as usize).cast(), r.as_mut_ptr().add(d as usize).cast(), src)
        };
        return;
    }
    let av = r[a as usize];
    let dv = &mut r[d as usize];
    for l in 0..32 {
        dv[l] = av[src[l] as usize & 31] & 0xffff_ffff;
    }
}

/// # Safety
/// `a` and `d` point at 32 `u64` each (they may be the same row); the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn shfl_permute_avx512(a: *const u64, d: *mut u64, src: &[u8; 32]) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's bounds; every source row is read before any destination is written.
    // (Loops, not closures: a closure may be compiled out of line, without the target feature.)
    unsafe {
        let z = [
            _mm512_loadu_si512(a.cast()),
            _mm512_loadu_si512(a.add(8).cast()),
            _mm512_loadu_si512(a.add(16).cast()),
            _mm512_loadu_si512(a.add(24).cast()),
        ];
        let (low, sixteen) = (_mm512_set1_epi64(0xffff_ffff), _mm512_set1_epi64(16));
        let mut out = [_mm512_setzero_si512(); 4];
        for (q, o) in out.iter_mut().enumerate() {
            let idx = _mm512_cvtepu8_epi64(_mm_loadl_epi64(src.as_ptr().add(8 * q).cast()));
            let lo = _mm512_permutex2var_epi64(z[0], idx, z[1]);
            let hi = _mm512_permutex2var_epi64(z[2], idx, z[3]);
            let upper = _mm512_cmpge_epu64_mask(idx, sixteen);
            *o = _mm512_and_si512(_mm512_mask_blend_epi64(upper, lo, hi), low);
        }
        for (q, v) in out.iter().enumerate() {
            _mm512_storeu_si512(d.add(8 * q).cast(), *v);
        }
    }
}

/// The lane that lane `l` of a `shfl.sync` (`mode` 0 up, 1 down, 2 bfly, 3 idx; lane operand
/// `b`, clamp/segment word `c`) reads, or None when the source is out of its segment (the lane
/// keeps its own value).
fn shfl_source(mode: u8, l: usize, b: u64, c: u64) -> Option<usize> {
    let lane = l as i64;
    let bval = (b & 0x1f) as i64;
    let cval = (c & 0x1f) as i64;
    let segmask = ((c >> 8) & 0x1f) as i64;
    let max_lane = (lane & segmask) | (cval & !segmask);
    let min_lane = lane & segmask;
    let (j, ok) = match mode {
        0 => (lane - bval, lane - bval >= max_lane),
        1 => (lane + bval, lane + bval <= max_lane),
        2 => (lane ^ bval, (lane ^ bval) <= max_lane),
        _ => {
            let j = min_lane | (bval & !segmask);
            (j, j <= max_lane)
        }
    };
    (ok && (0..32).contains(&j)).then_some(j as usize)
}

fn collective(op: &Op, r: &mut [[u64; 32]], exec: u32, perms: &[[u8; 32]]) {
    match *op {
        Op::Shfl { perm, d, p, a, .. } if perm != NO_PERM && exec == FULL && p == NONE => {
            shfl_permute(r, d, a, &perms[perm as usize]);
        }
        // The kernels' reductions: a full warp, no predicate result, the lane operand and the
        // clamp/segment word the same in every lane (constants, mostly). The same source lane
        // per lane as below, computed once, and one pass without the copies of `b`, `c` and `d`.
        Op::Shfl { mode, d, p, a, b, c, .. }
            if exec == FULL && p == NONE && uniform(&r[b as usize], 0x1f) && uniform(&r[c as usize], 0x1f1f) =>
        {
            let (bv, cv) = (r[b as usize][0], r[c as usize][0]);
            if cv & 0x1f1f == 0x1f {
                // One segment of 32 lanes (the kernels' reductions): the sources of every mode
                // and lane operand, computed once per process.
                static WHOLE_WARP: std::sync::OnceLock<[[[u8; 32]; 32]; 4]> = std::sync::OnceLock::new();
                let table = WHOLE_WARP.get_or_init(|| {
                    std::array::from_fn(|m| std::array::from_fn(|b| shfl_sources(m as u8, b as u64, 0x1f)))
                });
                shfl_permute(r, d, a, &table[mode as usize & 3][bv as usize & 0x1f]);
            } else {
                shfl_permute(r, d, a, &shfl_sources(mode, bv, cv));
            }
        }
        Op::Shfl { mode, d, p, a, b, c, .. } => {
            let av = r[a as usize];
            let bv = r[b as usize];
            let cv = r[c as usize];
            let mut out = r[d as usize];
            let mut pout = if p != NONE { r[p as usize] } else { [0; 32] };
            lanes(exec, |l| {
                let lane = l as i64;
                let bval = (bv[l] & 0x1f) as i64;
                let cval = (cv[l] & 0x1f) as i64;
                let segmask = ((cv[l] >> 8) & 0x1f) as i64;
                let max_lane = (lane & segmask) | (cval & !segmask);
                let min_lane = lane & segmask;
                let (j, ok) = match mode {
                    0 => {
                        let j = lane - bval;
                        (j, j >= max_lane)
                    }
                    1 => {
                        let j = lane + bval;
                        (j, j <= max_lane)
                    }
                    2 => {
                        let j = lane ^ bval;
                        (j, j <= max_lane)
                    }
                    _ => {
                        let j = min_lane | (bval & !segmask);
                        (j, j <= max_lane)
                    }
                };
                let j = if ok && (0..32).contains(&j) { j as usize } else { l };
                out[l] = av[j] & 0xffff_ffff;
                pout[l] = ok as u64;
            });
            r[d as usize] = out;
            if p != NONE {
                r[p as usize] = pout;
            }
        }
        Op::Vote { mode, neg, d, a, .. } => {
            let av = r[a as usize];
            let mut ballot = 0u32;
            lanes(exec, |l| {
                if ((av[l] & 1) == 1) != neg {
                    ballot |= 1 << l;
                }
            });
            let v = match mode {
                0 => (ballot == exec) as u64,
                1 => (ballot != 0) as u64,
                2 => (ballot == exec || ballot == 0) as u64,
                _ => ballot as u64,
            };
            let dv = &mut r[d as usize];
            lanes(exec, |l| dv[l] = v);
        }
        Op::Redux { op, signed, d, a, .. } => {
            let av = r[a as usize];
            let mut acc: Option<u64> = None;
            lanes(exec, |l| {
                let x = av[l] & 0xffff_ffff;
                acc = Some(match acc {
                    None => x,
                    Some(y) => match op {
                        0 => (x + y) & 0xffff_ffff,
                        1 if signed => (x as u32 as i32).min(y as u32 as i32) as u32 as u64,
                        2 if signed => (x as u32 as i32).max(y as u32 as i32) as u32 as u64,
                        1 => x.min(y),
                        2 => x.max(y),
                        3 => x & y,
                        4 => x | y,
                        _ => x ^ y,
                    },
                });
            });
            let v = acc.unwrap_or(0);
            let dv = &mut r[d as usize];
            lanes(exec, |l| dv[l] = v);
        }
        Op::Elect { d, p, .. } => {
            // The lowest executing lane of the member mask is the leader.
            let leader = exec.trailing_zeros() as u64;
            lanes(exec, |l| {
                r[d as usize][l] = leader;
                r[p as usize][l] = (l as u64 == leader) as u64;
            });
        }
        Op::Match { all, bits64, d, p, a, .. } => {
            let av = r[a as usize];
            let m = if bits64 { u64::MAX } else { 0xffff_ffff };
            let mut out = r[d as usize];
            let mut pout = if p != NONE { r[p as usize] } else { [0; 32] };
            lanes(exec, |l| {
                let mut same = 0u32;
                lanes(exec, |k| {
                    if av[k] & m == av[l] & m {
                        same |= 1 << k;
                    }
                });
                if all {
                    let eq = same == exec;
                    out[l] = if eq { exec as u64 } else { 0 };
                    pout[l] = eq as u64;
                } else {
                    out[l] = same as u64;
                }
            });
            r[d as usize] = out;
            if p != NONE {
                r[p as usize] = pout;
            }
        }
        _ => {}
    }
}

/// Checks one `cp.async` at issue: the shared destination (`size` bytes, aligned to `size`, in the
/// window) and the `n` global source bytes (aligned to `size`; not checked when `n = 0`, which
/// reads nothing). Returns the destination's offset in shared memory and where the source bytes
/// are (null when `n = 0`).
fn cp_issue(mem: &mut Mem, lane: u32, size: u8, dst: u64, src: u64, n: u64) -> Result<(usize, *mut u8), Fault> {
    let dst = match mem.locate(Space::Shared, dst, size as u64, lane, true)? {
        Loc::Shared(o) => o,
        _ => unreachable!("shared space resolves to shared memory"),
    };
    if n > size as u64 {
        return Err(Fault {
            lane,
            kind: "cp.async source size exceeds the copy size",
            addr: src,
            size: n.min(u32::MAX as u64) as u32,
            detail: Some(format!("src-size {n} > cp-size {size}")),
            other: None,
        });
    }
    if n > 0 {
        if src & (size as u64 - 1) != 0 {
            return Err(Fault::new(lane, "misaligned access", src, size as u32, None));
        }
        return Ok((dst, mem.check_global(src, n, lane, false)?));
    }
    Ok((dst, std::ptr::null_mut()))
}

/// Completes (and removes) the pending copies `done` selects, in issue order: reads the global
/// source now and writes the shared destination, zero-filling past the `n` source bytes.
fn cp_complete(shared: &mut SharedMem, cp: &mut Vec<CpCopy>, done: impl Fn(&CpCopy) -> bool) {
    // In place: the completed copies are done in order, the others move down (stable).
    let mut keep = 0;
    for i in 0..cp.len() {
        let c = cp[i];
        if !done(&c) {
            cp[keep] = c;
            keep += 1;
            continue;
        }
        shared.mark_written(c.dst, c.size as usize);
        let dst = &mut shared.bytes[c.dst..c.dst + c.size as usize];
        let p = c.ptr as *mut u8;
        if c.n == 16 && c.size == 16 {
            // The common whole 16-byte copy: two 8-byte loads, nothing to zero-fill.
            // SAFETY: `resolve` checked the 16 bytes at issue (the view of global memory does not
            // change during a launch), and the source is 16-byte aligned (checked at issue).
            let (lo, hi) = unsafe { (memory::atomic_load(p, 8), memory::atomic_load(p.add(8), 8)) };
            dst[..8].copy_from_slice(&lo.to_le_bytes());
            dst[8..].copy_from_slice(&hi.to_le_bytes());
            continue;
        }
        dst.fill(0);
        if c.n > 0 {
            // Whole copies of 4, 8 or 16 bytes (the source is aligned to the copy size, checked
            // at issue) in 4- or 8-byte loads, anything else byte by byte: the same bytes.
            let chunk = match c.n {
                4 => 4,
                8 | 16 => 8,
                _ => 1,
            };
            if chunk > 1 && c.n == c.size {
                for (k, d) in dst.chunks_exact_mut(chunk).enumerate() {
                    // SAFETY: as above; every chunk is aligned to its size.
                    let v = unsafe { memory::atomic_load(p.add(k * chunk), chunk as u8) };
                    d.copy_from_slice(&v.to_le_bytes()[..chunk]);
                }
            } else {
                for (k, b) in dst[..c.n as usize].iter_mut().enumerate() {
                    // SAFETY: as above; byte accesses need no alignment.
                    *b = unsafe { memory::atomic_load(p.add(k), 1) } as u8;
                }
            }
        }
    }
    cp.truncate(keep);
}

/// `mma.sync.aligned.m16n8k{8,16}.row.col.f32.T.T.f32` over the whole warp.
fn mma(r: &mut [[u64; 32]], kind: crate::tensor_core::HalfKind, k16: bool, d: [Slot; 4], s: &MmaSrcs) {
    const ZERO: [u64; 32] = [0; 32];
    let out = {
        let row = |slot: Slot| if slot == NONE { &ZERO } else { &r[slot as usize] };
        crate::tensor_core::mma_rows(kind, k16, s.a.map(row), s.b.map(row), s.c.map(row))
    };
    for (&dk, o) in d.iter().zip(out) {
        r[dk as usize] = o;
    }
}

/// [`ldmatrix`] once every byte of the window has been written: the alignment and window
/// checks of every row address first, then racecheck of all rows' words at once (queued as
/// reads, [`crate::memcheck::RaceState::read_rows`]), then the rows in 16-byte copies.
/// Returns false, having changed nothing, when a row is misaligned, outside the window or races,
/// for [`ldmatrix`] to report exactly as it always does.
#[allow(clippy::too_many_arguments)]
fn ldmatrix_fast(
    r: &mut [[u64; 32]],
    mem: &mut Mem,
    num: u8,
    trans: bool,
    sp: Space,
    ds: [Slot; 4],
    a: Slot,
    off: i32,
) -> bool {
    let base = match sp {
        Space::Shared => 0,
        Space::Generic => SHARED_WINDOW,
        _ => return false,
    };
    let window = mem.shared.bytes.len() as u64;
    if !mem.shared.all_written() || window < 16 {
        return false;
    }
    let (last, nrows) = (window - 16, 8 * num as usize);
    let av = &r[a as usize];
    let mut offs = [0u64; 32];
    let mut bad = 0u64;
    for l in 0..nrows {
        let addr = av[l].wrapping_add(off as i64 as u64);
        let o = addr.wrapping_sub(base);
        offs[l] = o;
        bad |= (addr & 15) | u64::from(o > last);
    }
    if bad != 0 {
        return false;
    }
    if mem.shared.racecheck_on() {
        let exec = if nrows == 32 { FULL } else { (1u32 << nrows) - 1 };
        let rows: [u32; 32] = std::array::from_fn(|l| (offs[l] / 4) as u32);
        if !mem.shared.race.read_rows(exec, &rows) {
            return false;
        }
    }
    // `tensor_core::ldmatrix`'s layout read straight from the rows (every row's 16 bytes lie in
    // the window: checked above): matrix `m`'s row `i` starts at `offs[8 m + i]`. Without
    // `.trans`, lane `l` gets the 4 bytes at column pair `l % 4` of row `l / 4`; with it, the
    // 2-byte elements at column `l / 4` of rows `2 (l % 4)` and `2 (l % 4) + 1`.
    let p = mem.shared.bytes.as_ptr();
    // SAFETY (the reads): every row's 16 bytes lie in the window (checked above), and the
    // offsets below stay inside a row.
    let u32_at = |o: usize| u32::from_le(unsafe { p.add(o).cast::<u32>().read_unaligned() }) as u64;
    for (m, &dk) in ds.iter().enumerate().take(num as usize) {
        let rows: [usize; 8] = std::array::from_fn(|i| offs[8 * m + i] as usize);
        let dv = &mut r[dk as usize];
        if trans {
            // SAFETY: as above (each row's 16 bytes).
            let m8: [[u16; 8]; 8] = std::array::from_fn(|i| {
                unsafe { p.add(rows[i]).cast::<[u16; 8]>().read_unaligned() }.map(u16::from_le)
            });
            for (l, v) in dv.iter_mut().enumerate() {
                let (col, row) = (l / 4, 2 * (l % 4));
                *v = m8[row][col] as u64 | (m8[row + 1][col] as u64) << 16;
            }
        } else {
            for (l, v) in dv.iter_mut().enumerate() {
                *v = u32_at(rows[l / 4] + 4 * (l % 4));
            }
        }
    }
    true
}

/// `ldmatrix.sync.aligned.m8n8.x{num}{.trans}.shared.b16` over the whole warp: lane `8 m + i`
/// addresses row `i` of matrix `m` (16 bytes, 16-byte aligned, in shared memory).
#[allow(clippy::too_many_arguments)]
fn ldmatrix(
    r: &mut [[u64; 32]],
    mem: &mut Mem,
    num: u8,
    trans: bool,
    sp: Space,
    ds: [Slot; 4],
    a: Slot,
    off: i32,
) -> Result<(), Fault> {
    let mut rows = [[[0u16; 8]; 8]; 4];
    for (m, mat) in rows.iter_mut().enumerate().take(num as usize) {
        for (i, row) in mat.iter_mut().enumerate() {
            let l = 8 * m + i;
            let addr = r[a as usize][l].wrapping_add(off as i64 as u64);
            let o = match mem.locate(sp, addr, 16, l as u32, false)? {
                Loc::Shared(o) => o,
                _ => {
                    return Err(Fault {
                        lane: l as u32,
                        kind: "ldmatrix address outside shared memory",
                        addr,
                        size: 16,
                        detail: None,
                        other: None,
                    })
                }
            };
            for (k, e) in row.iter_mut().enumerate() {
                *e = u16::from_le_bytes([mem.shared.bytes[o + 2 * k], mem.shared.bytes[o + 2 * k + 1]]);
            }
        }
    }
    let out = crate::tensor_core::ldmatrix(num as usize, trans, &rows[..num as usize]);
    for (k, &dk) in ds.iter().enumerate().take(num as usize) {
        let dv = &mut r[dk as usize];
        for l in 0..32 {
            dv[l] = out[l][k] as u64;
        }
    }
    Ok(())
}

#[inline(always)]
fn fma_f32(x: u64, y: u64, z: u64) -> u64 {
    f32::from_bits(x as u32).mul_add(f32::from_bits(y as u32), f32::from_bits(z as u32)).to_bits() as u64
}

/// `fma.rn.f32` over the lanes in `exec`. `f32::mul_add` is a fused multiply-add everywhere; without
/// the `fma` target feature it is a call to the C library's `fmaf` (exact, slow), so on x86-64 CPUs
/// that have FMA the loop runs in a copy compiled with it (one `vfmadd` per lane, same results).
#[inline(always)]
fn fma_f32_lanes(r: &mut [[u64; 32]], d: Slot, a: Slot, b: Slot, c: Slot, exec: u32) {
    #[cfg(all(target_arch = "x86_64", not(target_feature = "fma")))]
    {
        if std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports FMA (checked just above).
            unsafe { fma_f32_lanes_x86_fma(r, d, a, b, c, exec) };
            return;
        }
    }
    map3(r, d, a, b, c, exec, fma_f32);
}

#[cfg(all(target_arch = "x86_64", not(target_feature = "fma")))]
#[target_feature(enable = "fma")]
fn fma_f32_lanes_x86_fma(r: &mut [[u64; 32]], d: Slot, a: Slot, b: Slot, c: Slot, exec: u32) {
    map3(r, d, a, b, c, exec, fma_f32);
}

/// `for l in lanes of exec { body }` written out in the caller (a closure passed to [`lanes`]
/// was not always inlined, which cost a call per lane on the hottest path). `continue` skips a lane.
macro_rules! for_lanes {
    ($exec:expr, $l:ident, $body:block) => {{
        let exec: u32 = $exec;
        if exec == FULL {
            #[allow(clippy::needless_range_loop)]
            for $l in 0..32usize $body
        } else {
            let mut m = exec;
            while m != 0 {
                let $l = m.trailing_zeros() as usize;
                m &= m - 1;
                $body
            }
        }
    }};
}

/// [`cp_issue`] for the lanes of `exec`, when every side-effect-free check passes for all of
/// them (shared destination aligned and in the window, src-size at most cp-size, source
/// aligned and in one live allocation): then only racecheck's stamps of the destinations can
/// fail, lane by lane in order as in the general path, which is what runs here. Returns
/// `Ok(false)`, having done nothing, when some lane fails a check, for the general path to
/// report it exactly as it always does.
#[allow(clippy::too_many_arguments)]
fn cp_issue_fast(
    r: &[[u64; 32]],
    mem: &mut Mem,
    cp: &mut Vec<CpCopy>,
    next: &[u32; 32],
    exec: u32,
    size: u8,
    d: Slot,
    doff: i32,
    a: Slot,
    aoff: i32,
    n: Slot,
) -> Result<bool, Fault> {
    let size64 = size as u64;
    let window = mem.shared.bytes.len() as u64;
    let mut dsts = [0u64; 32];
    let mut nbs = [0u64; 32];
    let mut ptrs = [0usize; 32];
    for_lanes!(exec, l, {
        let dst = r[d as usize][l].wrapping_add(doff as i64 as u64);
        let src = r[a as usize][l].wrapping_add(aoff as i64 as u64);
        let nb = if n == NONE { size64 } else { r[n as usize][l] & 0xffff_ffff };
        if mem.shared.hopper.on
            || dst & (size64 - 1) != 0
            || dst.checked_add(size64).is_none_or(|e| e > window)
            || nb > size64
        {
            return Ok(false);
        }
        if nb > 0 {
            if src & (size64 - 1) != 0 {
                return Ok(false);
            }
            match mem.global.resolve(src, nb, &mut mem.hint.alloc) {
                Some(p) => ptrs[l] = p as usize,
                None => return Ok(false),
            }
        }
        dsts[l] = dst;
        nbs[l] = nb;
    });
    // Racecheck of all lanes' stores at once; on a conflict, lane by lane below for the report.
    let race = mem.shared.racecheck_on()
        && !mem.shared.race.store_spans(exec, &std::array::from_fn(|l| (dsts[l] / 4) as u32), size as u32 / 4);
    let mut line = usize::MAX;
    for_lanes!(exec, l, {
        let dst = dsts[l];
        if nbs[l] > 0 && ptrs[l] >> 6 != line {
            // The copy completes at a later wait: start loading its source's cache line now.
            line = ptrs[l] >> 6;
            prefetch(ptrs[l]);
        }
        if race {
            if let Err((msg, other)) = mem.shared.race.access(dst as usize, size as usize, true) {
                return Err(Fault {
                    other: Some(other),
                    ..Fault::new(l as u32, "shared memory race", dst, size as u32, Some(msg))
                });
            }
        }
        mem.traffic[0] += nbs[l];
        cp.push(CpCopy { lane: l as u8, n: nbs[l] as u8, size, group: next[l], dst: dst as usize, ptr: ptrs[l] });
    });
    Ok(true)
}

/// A hint to the host CPU to start loading the cache line at `p` (no effect on results).
#[inline(always)]
fn prefetch(p: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults, whatever the address.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// `ld.shared` once every byte of the window has been written (initcheck has nothing left to
/// say): the alignment and window checks of all lanes first (a full-warp `.b32` load with
/// AVX-512), then racecheck (4-byte loads: the words queued as reads,
/// [`crate::memcheck::RaceState::read_words`]; wider ones lane by lane, a lane reading the
/// address the previous lane read not checked twice), then the reads. Returns `Ok(false)` when a
/// lane is misaligned or out of the window, for the general path to report exactly as it always
/// does.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn ld_shared_fast(
    r: &mut [[u64; 32]],
    exec: u32,
    mem: &mut Mem,
    size: u8,
    n: u8,
    sext: bool,
    dbits: u8,
    ds: [Slot; 4],
    a: Slot,
    off: i64,
) -> Result<bool, Fault> {
    let av = &r[a as usize];
    let total = size as u64 * n as u64;
    let window = mem.shared.bytes.len() as u64;
    if window < total {
        return Ok(false);
    }
    // In the window and aligned: `addr + total <= window`, and `addr` a multiple of `total`.
    let last = window - total;
    let mut addrs = [0u64; 32];
    let mut words = [0u32; 32];
    // The full-warp `ld.shared.b32` of the f32 kernels in AVX-512 where the CPU has it.
    let wide = exec == FULL && size == 4 && n == 1 && !sext && avx512();
    if wide {
        // SAFETY: the CPU has AVX-512F (`avx512`).
        if !unsafe { b32_addresses_avx512(av, off as u64, last, &mut addrs, &mut words) } {
            return Ok(false);
        }
    } else {
        let mut bad = 0u64;
        for_lanes!(exec, l, {
            let addr = av[l].wrapping_add(off as u64);
            addrs[l] = addr;
            words[l] = (addr / 4) as u32;
            bad |= (addr & (total - 1)) | u64::from(addr > last);
        });
        if bad != 0 {
            return Ok(false);
        }
    }
    if mem.shared.racecheck_on() && total == 4 {
        // One word per lane: the whole check without the word loop; a conflict goes to the
        // general check below, which builds the message.
        let race = &mut mem.shared.race;
        if !race.read_words(exec, &words) {
            // Nothing of this instruction is stamped yet (a conflict queues nothing): `access`
            // stamps the reads lane by lane and stops at the first conflict.
            for_lanes!(exec, l, {
                if let Err((d, other)) = race.access(addrs[l] as usize, 4, false) {
                    return Err(Fault {
                        other: Some(other),
                        ..Fault::new(l as u32, "shared memory race", addrs[l], 4, Some(d))
                    });
                }
            });
        }
    } else if mem.shared.racecheck_on() {
        let mut prev = u64::MAX;
        let mut err = None;
        for_lanes!(exec, l, {
            let addr = addrs[l];
            if err.is_some() || addr == prev {
                continue;
            }
            prev = addr;
            if let Err((d, other)) = mem.shared.race.access(addr as usize, total as usize, false) {
                // The general path checks element by element; report the element it would name.
                let k = (0..n as u64)
                    .find(|k| mem.shared.race.conflicts(addr as usize + (k * size as u64) as usize, size as usize))
                    .unwrap_or(0);
                err = Some(Fault {
                    other: Some(other),
                    ..Fault::new(l as u32, "shared memory race", addr + k * size as u64, size as u32, Some(d))
                });
            }
        });
        if let Some(f) = err {
            return Err(f);
        }
    }
    let bytes = &mem.shared.bytes[..];
    if wide {
        // SAFETY: the CPU has AVX-512F; every lane's 4 bytes lie in the window (checked above).
        unsafe { gather_b32_avx512(bytes, &addrs, &mut r[ds[0] as usize]) };
        return Ok(true);
    }
    for k in 0..n as usize {
        let dv = &mut r[ds[k] as usize];
        let kb = k * size as usize;
        if size == 4 && !sext {
            // The f32 kernels' operand loads: one unaligned-safe 4-byte read per lane.
            for_lanes!(exec, l, {
                let at = addrs[l] as usize + kb;
                // SAFETY: every lane's `[addr, addr + total)` lies inside the window (checked above).
                let w: [u8; 4] = unsafe { *(bytes.as_ptr().add(at) as *const [u8; 4]) };
                dv[l] = u32::from_le_bytes(w) as u64;
            });
        } else {
            for_lanes!(exec, l, {
                let at = addrs[l] as usize + kb;
                let mut v = match size {
                    1 => bytes[at] as u64,
                    2 => u16::from_le_bytes([bytes[at], bytes[at + 1]]) as u64,
                    4 => u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as u64,
                    _ => u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()),
                };
                if sext && size < 8 {
                    v = (num::sext(v, size as u32 * 8) as u64) & num::mask(dbits as u32);
                }
                dv[l] = v;
            });
        }
    }
    Ok(true)
}

/// Bit `l` = bit 0 of `g[l]`: the lanes whose guard predicate is true.
#[inline(always)]
fn guard_mask(g: &[u64; 32]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: the CPU has AVX-512F (checked just above).
        return unsafe { guard_mask_avx512(g) };
    }
    let mut gm = 0u32;
    for (l, v) in g.iter().enumerate() {
        gm |= ((*v & 1) as u32) << l;
    }
    gm
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn guard_mask_avx512(g: &[u64; 32]) -> u32 {
    use std::arch::x86_64::*;
    let one = _mm512_set1_epi64(1);
    let mut gm = 0u32;
    for q in 0..4 {
        // SAFETY: 8 u64 at `8 q` of a 32-element array.
        let v = unsafe { _mm512_loadu_si512(g.as_ptr().add(8 * q).cast()) };
        gm |= (_mm512_test_epi64_mask(v, one) as u32) << (8 * q);
    }
    gm
}

const F32_ADD: u8 = 0;
const F32_MUL: u8 = 1;
const F32_FMA: u8 = 2;

/// `add`/`mul`/`fma.rn.f32` (`OP`) for all 32 lanes: `d = a + b`, `a * b` or `a * b + c` on the
/// low 32 bits of each lane, the result zero-extended; 16 lanes per AVX-512 operation (the same
/// IEEE operations as the lane loops). The caller checked that the CPU has AVX-512F.
#[inline(always)]
fn f32_warp_avx512<const OP: u8>(r: &mut [[u64; 32]], d: Slot, a: Slot, b: Slot, c: Slot) {
    let (dv, [av, bv, cv]) = rows(r, d, [a, b, c]);
    // SAFETY: `rows` checked the slots (32 lanes each); `avx512()` was true.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        f32_warp_avx512_impl::<OP>(dv, av, bv, cv)
    };
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (dv, av, bv, cv);
        unreachable!("avx512() is false");
    }
}

/// # Safety
/// The four pointers address 32 `u64` each (`d` may be one of the sources); the CPU has
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn f32_warp_avx512_impl<const OP: u8>(d: *mut u64, a: *const u64, b: *const u64, c: *const u64) {
    use std::arch::x86_64::*;
    // 16 lanes' low halves as one vector of f32.
    let load = |p: *const u64| -> __m512 {
        // SAFETY: 16 u64 at `p` (the caller's bounds).
        unsafe {
            let lo = _mm512_cvtepi64_epi32(_mm512_loadu_si512(p.cast()));
            let hi = _mm512_cvtepi64_epi32(_mm512_loadu_si512(p.add(8).cast()));
            _mm512_castsi512_ps(_mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi))
        }
    };
    for h in 0..2 {
        let o = 16 * h;
        // Every source of these 16 lanes is read before any of them is written.
        // SAFETY: lanes `o..o + 16` of 32.
        let (x, y) = unsafe { (load(a.add(o)), load(b.add(o))) };
        let v = match OP {
            F32_ADD => _mm512_add_ps(x, y),
            F32_MUL => _mm512_mul_ps(x, y),
            // SAFETY: as above.
            _ => _mm512_fmadd_ps(x, y, unsafe { load(c.add(o)) }),
        };
        let v = _mm512_castps_si512(v);
        // SAFETY: as above.
        unsafe {
            _mm512_storeu_si512(d.add(o).cast(), _mm512_cvtepu32_epi64(_mm512_castsi512_si256(v)));
            _mm512_storeu_si512(d.add(o + 8).cast(), _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64::<1>(v)));
        }
    }
}

/// Whether the CPU has AVX-512F (cached by the standard library after the first query).
#[inline(always)]
pub(crate) fn avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The 32 lanes' addresses `av[l] + off` of a 4-byte shared load into `addrs` and their word
/// indices into `words`; false when a lane is misaligned or past `last` (then `addrs` and
/// `words` mean nothing).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn b32_addresses_avx512(av: &[u64; 32], off: u64, last: u64, addrs: &mut [u64; 32], words: &mut [u32; 32]) -> bool {
    use std::arch::x86_64::*;
    let (offv, lastv, three) = (_mm512_set1_epi64(off as i64), _mm512_set1_epi64(last as i64), _mm512_set1_epi64(3));
    let mut bad: __mmask8 = 0;
    for q in 0..4 {
        // SAFETY: 8 u64 at `8 q` of 32-element arrays.
        unsafe {
            let a = _mm512_add_epi64(_mm512_loadu_si512(av.as_ptr().add(8 * q).cast()), offv);
            bad |= _mm512_test_epi64_mask(a, three) | _mm512_cmpgt_epu64_mask(a, lastv);
            _mm512_storeu_si512(addrs.as_mut_ptr().add(8 * q).cast(), a);
            let w = _mm512_cvtepi64_epi32(_mm512_srli_epi64::<2>(a));
            _mm256_storeu_si256(words.as_mut_ptr().add(8 * q).cast(), w);
        }
    }
    bad == 0
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn b32_addresses_avx512(_: &[u64; 32], _: u64, _: u64, _: &mut [u64; 32], _: &mut [u32; 32]) -> bool {
    unreachable!("avx512() is false")
}

/// `dv[l]` = the 4 bytes at `bytes[addrs[l]..]` (little-endian, zero-extended) for all 32 lanes.
///
/// # Safety
/// Every `addrs[l] + 4 <= bytes.len()`, and the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gather_b32_avx512(bytes: &[u8], addrs: &[u64; 32], dv: &mut [u64; 32]) {
    use std::arch::x86_64::*;
    for q in 0..4 {
        // SAFETY: the caller's bounds; 8 u64 at `8 q` of 32-element arrays.
        unsafe {
            let idx = _mm512_loadu_si512(addrs.as_ptr().add(8 * q).cast());
            let v = _mm512_i64gather_epi32::<1>(idx, bytes.as_ptr().cast());
            _mm512_storeu_si512(dv.as_mut_ptr().add(8 * q).cast(), _mm512_cvtepu32_epi64(v));
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn gather_b32_avx512(_: &[u8], _: &[u64; 32], _: &mut [u64; 32]) {
    unreachable!("avx512() is false")
}

/// `ld.global` (not sign-extending) when every lane's access is aligned and inside one live
/// allocation: the checks of all lanes first, then the reads. Returns false, having written
/// nothing, when a lane is misaligned or outside, for the general path to report exactly as it
/// always does. (A vector aligned to its size that starts in an allocation cannot reach into
/// another one, which starts on a 256-byte boundary, so checking the whole vector at once
/// accepts exactly the accesses whose every element the general path accepts.)
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn ld_global_fast(
    r: &mut [[u64; 32]],
    exec: u32,
    mem: &mut Mem,
    generic: bool,
    size: u8,
    n: u8,
    ds: [Slot; 4],
    a: Slot,
    off: i64,
) -> bool {
    let total = size as u64 * n as u64;
    let align = if n > 1 { total } else { size as u64 };
    let Some(ptrs) = global_ptrs(&r[a as usize], off, exec, generic, total, align, mem) else { return false };
    mem.traffic[0] += total * exec.count_ones() as u64;
    if exec == FULL {
        mem.hint.stride_prefetch(ds[0], &ptrs, total);
    }
    for k in 0..n as usize {
        let dv = &mut r[ds[k] as usize];
        let kb = k * size as usize;
        macro_rules! each {
            ($t:ty) => {
                for_lanes!(exec, l, {
                    // SAFETY: `[ptrs[l], ptrs[l] + total)` lies inside a live allocation, and the
                    // start is aligned to `size` (so is every element).
                    dv[l] =
                        unsafe { (*(ptrs[l].add(kb) as *const $t)).load(std::sync::atomic::Ordering::Relaxed) } as u64;
                })
            };
        }
        match size {
            1 => each!(std::sync::atomic::AtomicU8),
            2 => each!(std::sync::atomic::AtomicU16),
            4 => each!(std::sync::atomic::AtomicU32),
            _ => each!(std::sync::atomic::AtomicU64),
        }
    }
    true
}

/// Per warp: the allocation [`GlobalView::resolve`] found last, and a stride detector for
/// full-warp global loads (no effect on results: it only asks the host CPU to load cache lines
/// early).
#[derive(Default)]
pub(crate) struct Hints {
    pub(crate) alloc: usize,
    strides: [StrideEntry; 16],
}

/// The last host address of one load instruction's warp (keyed by its first destination slot)
/// and the step between its last two executions.
#[derive(Default, Clone, Copy)]
struct StrideEntry {
    key: Slot,
    last: usize,
    step: isize,
}

impl Hints {
    /// A full warp's load of `total` bytes per lane at `ptrs`: when the same instruction's last
    /// two executions moved by the same step, the host CPU is asked to load the lines one step
    /// further (a key's row of a KV cache, the next loop iteration), at most 16 of them.
    #[inline(always)]
    fn stride_prefetch(&mut self, key: Slot, ptrs: &[*mut u8; 32], total: u64) {
        let (mut lo, mut hi) = (usize::MAX, 0usize);
        for &p in ptrs {
            lo = lo.min(p as usize);
            hi = hi.max(p as usize);
        }
        let e = &mut self.strides[key as usize % 16];
        if e.key == key && e.last != 0 {
            let step = lo.wrapping_sub(e.last) as isize;
            if step == e.step && step != 0 {
                let end = hi + total as usize;
                let mut line = lo & !63;
                let mut n = 0;
                while line < end && n < 16 {
                    prefetch(line.wrapping_add_signed(step));
                    line += 64;
                    n += 1;
                }
            }
            e.step = step;
        } else {
            *e = StrideEntry { key, last: 0, step: 0 };
        }
        e.last = lo;
    }
}

/// Each lane's pointer for a `total`-byte global access at `av[l] + off` aligned to `align`, or
/// `None` when a lane is misaligned, at a generic address in the parameter, local or shared
/// window, or not inside one live allocation (the general path then reports). A full warp whose
/// accesses all lie in one allocation (a tile of one tensor) takes one lookup for the span from
/// its lowest to its highest address.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn global_ptrs(
    av: &[u64; 32],
    off: i64,
    exec: u32,
    generic: bool,
    total: u64,
    align: u64,
    mem: &mut Mem,
) -> Option<[*mut u8; 32]> {
    let mut ptrs = [std::ptr::null_mut::<u8>(); 32];
    // (One range check over the three windows: an address between them is in no allocation
    // either, and takes the general path.)
    let windows = memory::PARAM_WINDOW..SHARED_WINDOW + WINDOW_SIZE;
    if exec == FULL {
        let (mut lo, mut hi, mut bad) = (u64::MAX, 0u64, 0u64);
        for &x in av.iter() {
            let addr = x.wrapping_add(off as u64);
            lo = lo.min(addr);
            hi = hi.max(addr);
            bad |= addr & (align - 1);
        }
        let outside_windows = !generic || hi < windows.start || lo >= windows.end;
        if bad == 0 && outside_windows {
            if let Some(p) = hi.checked_add(total).and_then(|end| mem.global.resolve(lo, end - lo, &mut mem.hint.alloc))
            {
                for (l, ptr) in ptrs.iter_mut().enumerate() {
                    // SAFETY: `[lo, hi + total)` lies in one allocation at `p`, and so does
                    // every lane's access.
                    *ptr = unsafe { p.add((av[l].wrapping_add(off as u64) - lo) as usize) };
                }
                return Some(ptrs);
            }
        }
    }
    for_lanes!(exec, l, {
        let addr = av[l].wrapping_add(off as u64);
        if addr & (align - 1) != 0 || generic && windows.contains(&addr) {
            return None;
        }
        ptrs[l] = mem.global.resolve(addr, total, &mut mem.hint.alloc)?;
    });
    Some(ptrs)
}

/// `st.global` (and generic stores to global memory) when every lane's access is aligned and
/// inside one live allocation: all lanes' checks first, then the stores in lane order, as the
/// general path does them. Returns false, having stored nothing, otherwise, for the general path
/// to store and report exactly as it always does (see [`ld_global_fast`] on checking a vector
/// at once).
#[allow(clippy::too_many_arguments)]
#[inline(never)]
fn st_global_fast(
    r: &[[u64; 32]],
    exec: u32,
    mem: &mut Mem,
    generic: bool,
    size: u8,
    n: u8,
    srcs: [Slot; 4],
    a: Slot,
    off: i64,
) -> bool {
    let total = size as u64 * n as u64;
    let align = if n > 1 { total } else { size as u64 };
    let Some(ptrs) = global_ptrs(&r[a as usize], off, exec, generic, total, align, mem) else { return false };
    mem.traffic[1] += total * exec.count_ones() as u64;
    for_lanes!(exec, l, {
        for k in 0..n as usize {
            // SAFETY: `resolve` put `[ptrs[l], ptrs[l] + total)` inside a live allocation, and
            // every element is aligned to `size`.
            unsafe { memory::atomic_store(ptrs[l].add(k * size as usize), size, r[srcs[k] as usize][l]) };
        }
    });
    true
}

/// `ld.param` when every lane's access is aligned and inside the parameter block: the general
/// path's reads without its per-lane dispatch. Returns false, having read nothing, otherwise.
#[allow(clippy::too_many_arguments)]
#[inline(never)]
fn ld_param_fast(
    r: &mut [[u64; 32]],
    exec: u32,
    mem: &Mem,
    size: u8,
    n: u8,
    sext: bool,
    dbits: u8,
    ds: [Slot; 4],
    a: Slot,
    off: i64,
) -> bool {
    let total = size as u64 * n as u64;
    let align = if n > 1 { total } else { size as u64 };
    let len = mem.params.len() as u64;
    let av = &r[a as usize];
    let mut addrs = [0usize; 32];
    let mut bad = false;
    for_lanes!(exec, l, {
        let addr = av[l].wrapping_add(off as u64);
        bad |= addr & (align - 1) != 0 || addr.checked_add(total).is_none_or(|e| e > len);
        addrs[l] = addr as usize;
    });
    if bad {
        return false;
    }
    for k in 0..n as usize {
        let kb = k * size as usize;
        for_lanes!(exec, l, {
            let at = addrs[l] + kb;
            let mut b = [0u8; 8];
            b[..size as usize].copy_from_slice(&mem.params[at..at + size as usize]);
            let mut v = u64::from_le_bytes(b);
            if sext && size < 8 {
                v = (num::sext(v, size as u32 * 8) as u64) & num::mask(dbits as u32);
            }
            r[ds[k] as usize][l] = v;
        });
    }
    true
}

/// `st` of one element to shared memory (`st.shared`, or generic addresses in the shared
/// window): the alignment and window checks of all lanes first (no effect), then lane by lane,
/// in order, racecheck's stamp and the store, exactly as the general path does them. Returns
/// `Ok(false)`, having done nothing, when a lane is misaligned or outside the window, for the
/// general path to report exactly as it always does.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn st_shared_fast(
    r: &mut [[u64; 32]],
    exec: u32,
    mem: &mut Mem,
    sp: Space,
    size: u8,
    src: Slot,
    a: Slot,
    off: i64,
) -> Result<bool, Fault> {
    let base = if sp == Space::Generic { SHARED_WINDOW } else { 0 };
    let size64 = size as u64;
    let window = mem.shared.bytes.len() as u64;
    if window < size64 || mem.shared.hopper.on {
        return Ok(false);
    }
    let last = window - size64;
    let av = &r[a as usize];
    let mut offs = [0u64; 32];
    let mut bad = 0u64;
    for_lanes!(exec, l, {
        let addr = av[l].wrapping_add(off as u64);
        let o = addr.wrapping_sub(base);
        offs[l] = o;
        bad |= (addr & (size64 - 1)) | u64::from(o > last);
    });
    if bad != 0 {
        return Ok(false);
    }
    let sv = &r[src as usize];
    let race = mem.shared.racecheck_on();
    if exec == FULL && size == 4 {
        // A full warp's word stores (the f32 kernels' tiles): racecheck's checks of all 32
        // words first, then their stamps, as the lane-by-lane path below does them when none
        // conflicts; on a conflict that path runs and names the lane.
        let words: [u32; 32] = std::array::from_fn(|l| (offs[l] / 4) as u32);
        if !race || mem.shared.race.store_words(&words) {
            let bytes = mem.shared.bytes.as_mut_ptr();
            for l in 0..32 {
                // SAFETY: every `offs[l] <= window - 4` (checked above, `bad == 0`).
                unsafe { bytes.add(offs[l] as usize).cast::<u32>().write_unaligned(sv[l] as u32) };
            }
            for &o in &offs {
                // (Nothing to mark once initcheck has seen every byte written.)
                mem.shared.mark_written(o as usize, 4);
            }
            return Ok(true);
        }
    }
    for_lanes!(exec, l, {
        let o = offs[l] as usize;
        if race {
            if let Err((d, other)) = mem.shared.race.access(o, size as usize, true) {
                let addr = av[l].wrapping_add(off as u64);
                return Err(Fault {
                    other: Some(other),
                    ..Fault::new(l as u32, "shared memory race", addr, size as u32, Some(d))
                });
            }
        }
        mem.write(Loc::Shared(o), size, sv[l]);
    });
    Ok(true)
}

/// The register-to-register instructions of the kernels' hot loops (`fma`/`add`/`mul.f32`,
/// `mov`, `selp`, address arithmetic), run inline in the dispatch loop without the call into
/// [`exec_simple`]; false for any other instruction, which `exec_simple` then runs. The arms
/// are `exec_simple`'s own.
#[inline(always)]
fn exec_register_op(op: &Op, r: &mut [[u64; 32]], exec: u32) -> bool {
    match *op {
        Op::FmaF32 { d, a, b, c } if exec == FULL && avx512() => f32_warp_avx512::<F32_FMA>(r, d, a, b, c),
        Op::AddF32 { d, a, b } if exec == FULL && avx512() => f32_warp_avx512::<F32_ADD>(r, d, a, b, b),
        Op::MulF32 { d, a, b } if exec == FULL && avx512() => f32_warp_avx512::<F32_MUL>(r, d, a, b, b),
        Op::FmaF32 { d, a, b, c } => fma_f32_lanes(r, d, a, b, c, exec),
        Op::AddF32 { d, a, b } => {
            map2(r, d, a, b, exec, |x, y| (f32::from_bits(x as u32) + f32::from_bits(y as u32)).to_bits() as u64)
        }
        Op::MulF32 { d, a, b } => {
            map2(r, d, a, b, exec, |x, y| (f32::from_bits(x as u32) * f32::from_bits(y as u32)).to_bits() as u64)
        }
        Op::Selp { d, a, b, p } => map3(r, d, a, b, p, exec, |x, y, q| if q & 1 == 1 { x } else { y }),
        Op::Mov { d, a } => map1(r, d, a, exec, |x| x),
        // `sub`/`min`/`max`/`div.f32` in round-to-nearest without `.ftz`/`.sat`: `fbin32` with
        // its kind and mode constant (one loop per kind instead of a call per lane).
        Op::FBin32 { k, m, d, a, b } if m == num::FMode::default() => fbin32_rn(r, k, d, a, b, exec),
        Op::FUn32 { k: num::FUn::Ex2, m, d, a, .. } if !m.sat => ex2_f32(r, m.ftz, d, a, exec),
        Op::Bin { f, k, d, a, b } if k != IntK::Fn => int_bin(r, k, f, d, a, b, exec),
        Op::Ter { k, d, a, b, c, .. } if k != TerK::Fn => match k {
            TerK::MadLo32 => map3(r, d, a, b, c, exec, crate::ops::mad::<32>),
            TerK::MadLo64 => map3(r, d, a, b, c, exec, crate::ops::mad::<64>),
            TerK::MadWideU32 => map3(r, d, a, b, c, exec, crate::ops::madwide_u::<32>),
            _ => map3(r, d, a, b, c, exec, crate::ops::madwide_s::<32>),
        },
        Op::Setp { cmp, ty, ftz, comb: 0, d, d2: NONE, a, b, c: NONE, .. }
            if exec == FULL && setp_full(r, d, a, b, cmp, ty, ftz) => {}
        Op::Cvt {
            to: to @ (Ty::U(_) | Ty::S(_) | Ty::B(_)),
            from: from @ (Ty::U(_) | Ty::S(_) | Ty::B(_)),
            m,
            d,
            a,
        } if !m.sat => int_cvt(r, to, from, d, a, exec),
        _ => return false,
    }
    true
}

/// `num::fbin32` in round-to-nearest without `.ftz`/`.sat` (`sub`/`min`/`max`/`div`; `add` and
/// `mul` have their own ops), written out per kind so that nothing is called per lane. (A
/// function of its own: inside the dispatch loop the compiler calls such closures per lane.)
#[inline(never)]
fn fbin32_rn(r: &mut [[u64; 32]], k: num::FBin, d: Slot, a: Slot, b: Slot, exec: u32) {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { fbin32_rn_avx512(r, k, d, a, b, exec) };
    }
    fbin32_rn_lanes(r, k, d, a, b, exec)
}

/// [`fbin32_rn`] compiled for AVX-512 (the same operations, 8 lanes per vector: the `min`/`max`
/// selects are three compares and a blend there, and a dozen SSE2 operations per 2 lanes
/// otherwise).
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fbin32_rn_avx512(r: &mut [[u64; 32]], k: num::FBin, d: Slot, a: Slot, b: Slot, exec: u32) {
    fbin32_rn_lanes(r, k, d, a, b, exec)
}

#[inline(always)]
fn fbin32_rn_lanes(r: &mut [[u64; 32]], k: num::FBin, d: Slot, a: Slot, b: Slot, exec: u32) {
    let f = |x: u64| f32::from_bits(x as u32);
    match k {
        num::FBin::Add => map2(r, d, a, b, exec, |x, y| (f(x) + f(y)).to_bits() as u64),
        // As `fbin32`: `a + (-b)`.
        num::FBin::Sub => map2(r, d, a, b, exec, |x, y| (f(x) + -f(y)).to_bits() as u64),
        num::FBin::Mul => map2(r, d, a, b, exec, |x, y| (f(x) * f(y)).to_bits() as u64),
        num::FBin::Div => map2(r, d, a, b, exec, |x, y| (f(x) / f(y)).to_bits() as u64),
        num::FBin::Min => map2(r, d, a, b, exec, |x, y| minmax32_select(f(x), f(y), false)),
        num::FBin::Max => map2(r, d, a, b, exec, |x, y| minmax32_select(f(x), f(y), true)),
    }
}

/// `num::minmax32` as selects, without branches (so that the lane loop vectorises): NaN and
/// NaN give the canonical NaN, one NaN gives the other operand, equal operands give `b` when
/// `max` is `a`'s sign bit (so -0 < +0), otherwise the larger (`max`) or smaller operand.
#[inline(always)]
fn minmax32_select(a: f32, b: f32, max: bool) -> u64 {
    let (an, bn, eq) = (a.is_nan(), b.is_nan(), a == b);
    let pick_a = !an & (bn | (eq & (max != a.is_sign_negative())) | (!eq & ((a > b) == max)));
    let v = if pick_a { a.to_bits() } else { b.to_bits() };
    (if an & bn { 0x7fff_ffff } else { v }) as u64
}

/// `ex2.f32` (`.approx`, with or without `.ftz`; no `.sat`): `num::fun32`'s `Ex2` without its
/// dispatch per lane.
#[inline(never)]
fn ex2_f32(r: &mut [[u64; 32]], ftz: bool, d: Slot, a: Slot, exec: u32) {
    #[cfg(target_arch = "x86_64")]
    if exec == FULL && avx512() {
        let _ = (&r[a as usize], &r[d as usize]);
        // SAFETY: the CPU has AVX-512F (and so FMA); both slots are rows of `r` (indexed above).
        unsafe { ex2_f32_avx512(r.as_ptr().add(a as usize).cast(), r.as_mut_ptr().add(d as usize).cast(), ftz) };
        return;
    }
    // `num::ftz32` on the bits: a zero exponent field (zero or subnormal) keeps only the sign.
    let ftz32 = |b: u32| if b & 0x7f80_0000 == 0 { b & 0x8000_0000 } else { b };
    if ftz {
        map1(r, d, a, exec, |x| ftz32(f32::from_bits(ftz32(x as u32)).exp2().to_bits()) as u64)
    } else {
        map1(r, d, a, exec, |x| f32::from_bits(x as u32).exp2().to_bits() as u64)
    }
}

/// `exp2f` of glibc 2.28 and later on a CPU with FMA (the variant its loader picks wherever
/// AVX-512 is present), for `|x| < 128`: `x = k/32 + r`, `2^x = 2^(k/32) 2^r` with a 32-entry
/// table and a cubic in `r`, in f64. The constants and the table are that function's (the
/// table holds the bits of `2^(i/32)` less `i << 47`).
#[cfg(target_arch = "x86_64")]
mod exp2f_table {
    pub(super) const SHIFT: u64 = 0x42e8_0000_0000_0000; // 0x1.8p52 / 32
    pub(super) const C: [u64; 3] = [0x3fac_6af8_4b91_2394, 0x3fce_bfce_50fa_c4f3, 0x3fe6_2e42_ff0c_52d6];
    pub(super) const T: [u64; 32] = [
        0x3ff0000000000000,
        0x3fefd9b0d3158574,
        0x3fefb5586cf9890f,
        0x3fef9301d0125b51,
        0x3fef72b83c7d517b,
        0x3fef54873168b9aa,
        0x3fef387a6e756238,
        0x3fef1e9df51fdee1,
        0x3fef06fe0a31b715,
        0x3feef1a7373aa9cb,
        0x3feedea64c123422,
        0x3feece086061892d,
        0x3feebfdad5362a27,
        0x3feeb42b569d4f82,
        0x3feeab07dd485429,
        0x3feea47eb03a5585,
        0x3feea09e667f3bcd,
        0x3fee9f75e8ec5f74,
        0x3feea11473eb0187,
        0x3feea589994cce13,
        0x3feeace5422aa0db,
        0x3feeb737b0cdc5e5,
        0x3feec49182a3f090,
        0x3feed503b23e255d,
        0x3feee89f995ad3ad,
        0x3feeff76f2fb5e47,
        0x3fef199bdd85529c,
        0x3fef3720dcef9069,
        0x3fef5818dcfba487,
        0x3fef7c97337b9b5f,
        0x3fefa4afa2a490da,
        0x3fefd0765b6e4540,
    ];
}

/// [`ex2_f32`] for a full warp, 8 lanes per vector: lanes with `|x| < 128` through
/// [`exp2f_table`] (the same operations as the library's, so the same bits), the others
/// (overflow, underflow, infinities, NaN) through `f32::exp2`.
///
/// # Safety
/// `a` and `d` point at 32 `u64` each (they may be the same row); the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,fma")]
unsafe fn ex2_f32_avx512(a: *const u64, d: *mut u64, ftz: bool) {
    use exp2f_table::*;
    use std::arch::x86_64::*;
    let (shift, one) = (_mm512_set1_pd(f64::from_bits(SHIFT)), _mm512_set1_pd(1.0));
    let c = [
        _mm512_set1_pd(f64::from_bits(C[0])),
        _mm512_set1_pd(f64::from_bits(C[1])),
        _mm512_set1_pd(f64::from_bits(C[2])),
    ];
    let (exp_field, sign) = (_mm256_set1_epi32(0x7f80_0000), _mm256_set1_epi32(0x8000_0000u32 as i32));
    // `num::ftz32` on 8 lanes' bits: a zero exponent field keeps only the sign. (Macros, not
    // closures: a closure may be compiled out of line, without the target features.)
    macro_rules! ftz8 {
        ($b:expr) => {{
            let b: __m256i = $b;
            let tiny = _mm256_cmpeq_epi32_mask(_mm256_and_si256(b, exp_field), _mm256_setzero_si256());
            _mm256_mask_and_epi32(b, tiny, b, sign)
        }};
    }
    let mut out = [0u64; 32];
    let mut special = 0u32;
    let mut xs = [0u32; 32];
    for q in 0..4 {
        // SAFETY: 8 `u64` at `8 q` of the 32-lane rows.
        let mut bits = _mm512_cvtepi64_epi32(unsafe { _mm512_loadu_si512(a.add(8 * q).cast()) });
        if ftz {
            bits = ftz8!(bits);
        }
        // SAFETY: 8 `u32` at `8 q` of `xs`.
        unsafe { _mm256_storeu_si256(xs.as_mut_ptr().add(8 * q).cast(), bits) };
        let abstop = _mm256_and_si256(_mm256_srli_epi32::<20>(bits), _mm256_set1_epi32(0x7ff));
        special |= (_mm256_cmpgt_epu32_mask(abstop, _mm256_set1_epi32(0x42f)) as u32) << (8 * q);
        let xd = _mm512_cvtps_pd(_mm256_castsi256_ps(bits));
        let kd = _mm512_add_pd(xd, shift);
        let ki = _mm512_castpd_si512(kd);
        let r = _mm512_sub_pd(xd, _mm512_sub_pd(kd, shift));
        let idx = _mm512_and_si512(ki, _mm512_set1_epi64(31));
        // SAFETY: every index is below 32.
        let t = unsafe { _mm512_i64gather_epi64::<8>(idx, T.as_ptr().cast()) };
        let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64::<47>(ki)));
        let z = _mm512_fmadd_pd(c[0], r, c[1]);
        let r2 = _mm512_mul_pd(r, r);
        let y = _mm512_fmadd_pd(r, c[2], one);
        let y = _mm512_mul_pd(_mm512_fmadd_pd(z, r2, y), s);
        let mut f = _mm256_castps_si256(_mm512_cvtpd_ps(y));
        if ftz {
            f = ftz8!(f);
        }
        // SAFETY: 8 `u64` at `8 q` of `out`.
        unsafe { _mm512_storeu_si512(out.as_mut_ptr().add(8 * q).cast(), _mm512_cvtepu32_epi64(f)) };
    }
    while special != 0 {
        let l = special.trailing_zeros() as usize;
        special &= special - 1;
        let y = f32::from_bits(xs[l]).exp2().to_bits();
        out[l] = if ftz && y & 0x7f80_0000 == 0 { y & 0x8000_0000 } else { y } as u64;
    }
    // SAFETY: the caller's bounds; every source lane was read above.
    unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), d, 32) };
}

/// `cvt.rn.bf16x2.f32 d, a, b` (`ops::cvt_x2`): `a` rounded to bf16 in the high half, `b` in the
/// low half, with [`num::bf16_rn_bits`] so that the lane loop has no branch.
#[inline(never)]
fn cvt_bf16x2(r: &mut [[u64; 32]], d: Slot, a: Slot, b: Slot, exec: u32) {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { cvt_bf16x2_avx512(r, d, a, b, exec) };
    }
    cvt_bf16x2_lanes(r, d, a, b, exec)
}

/// [`cvt_bf16x2`] compiled for AVX-512 (the same operations, 8 lanes per vector).
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn cvt_bf16x2_avx512(r: &mut [[u64; 32]], d: Slot, a: Slot, b: Slot, exec: u32) {
    cvt_bf16x2_lanes(r, d, a, b, exec)
}

#[inline(always)]
fn cvt_bf16x2_lanes(r: &mut [[u64; 32]], d: Slot, a: Slot, b: Slot, exec: u32) {
    map2(r, d, a, b, exec, |x, y| (num::bf16_rn_bits(x as u32) << 16 | num::bf16_rn_bits(y as u32) & 0xffff) as u64)
}

/// `num::cvt` between integer types without `.sat`: the source's value (sign- or zero-extended
/// from its width), cut to the destination's.
#[inline(never)]
fn int_cvt(r: &mut [[u64; 32]], to: Ty, from: Ty, d: Slot, a: Slot, exec: u32) {
    let (fb, tm) = (from.bits(), num::mask(to.bits()));
    if from.is_signed() {
        map1(r, d, a, exec, |x| num::sext(x, fb) as u64 & tm)
    } else {
        let m = num::mask(fb) & tm;
        map1(r, d, a, exec, |x| x & m)
    }
}

/// `setp` of a full warp with one predicate and no combining operand, for the kernels' integer
/// and ordered f32 compares, as one loop per (type, comparison) with nothing called per lane:
/// the results of `compare` (false on NaN for the ordered float compares; `ne` is `<` or `>`).
/// False, having done nothing, for any other type or comparison.
#[inline(never)]
fn setp_full(r: &mut [[u64; 32]], d: Slot, a: Slot, b: Slot, cmp: Cmp, ty: Ty, ftz: bool) -> bool {
    let (dv, [av, bv]) = rows(r, d, [a, b]);
    macro_rules! each {
        ($conv:expr) => {{
            let conv = $conv;
            macro_rules! lp {
                ($x:ident, $y:ident, $e:expr) => {
                    // SAFETY: `rows` checked the slots; 32 lanes each; every lane reads both
                    // sources before writing its destination lane.
                    unsafe {
                        for l in 0..32 {
                            let ($x, $y) = (conv(*av.add(l)), conv(*bv.add(l)));
                            *dv.add(l) = ($e) as u64;
                        }
                    }
                };
            }
            #[allow(clippy::double_comparisons)]
            match cmp {
                Cmp::Eq => lp!(x, y, x == y),
                Cmp::Ne => lp!(x, y, x < y || x > y),
                Cmp::Lt => lp!(x, y, x < y),
                Cmp::Le => lp!(x, y, x <= y),
                Cmp::Gt => lp!(x, y, x > y),
                Cmp::Ge => lp!(x, y, x >= y),
                _ => return false,
            }
            true
        }};
    }
    match ty {
        Ty::S(32) => each!(|v: u64| v as u32 as i32),
        Ty::S(64) => each!(|v: u64| v as i64),
        Ty::U(32) | Ty::B(32) => each!(|v: u64| v as u32),
        Ty::U(64) | Ty::B(64) => each!(|v: u64| v),
        Ty::F32 if !ftz => each!(|v: u64| f32::from_bits(v as u32)),
        _ => false,
    }
}

fn exec_simple(op: &Op, r: &mut [[u64; 32]], exec: u32, mem: &mut Mem) -> Result<(), Fault> {
    match *op {
        Op::Nop => {}
        Op::Mov { d, a } => {
            let av = r[a as usize];
            let dv = &mut r[d as usize];
            if exec == FULL {
                *dv = av;
            } else {
                lanes(exec, |l| dv[l] = av[l]);
            }
        }
        Op::Bin { f, k, d, a, b } => int_bin(r, k, f, d, a, b, exec),
        Op::Un { f, d, a } => map1(r, d, a, exec, f),
        Op::Ter { f, d, a, b, c, .. } => map3(r, d, a, b, c, exec, f),
        Op::Quad { f, d, a, b, c, e } => {
            let ev = r[e as usize];
            let av = r[a as usize];
            let bv = r[b as usize];
            let cv = r[c as usize];
            let dv = &mut r[d as usize];
            lanes(exec, |l| dv[l] = f(av[l], bv[l], cv[l], ev[l]));
        }
        Op::AddF32 { d, a, b } => {
            map2(r, d, a, b, exec, |x, y| (f32::from_bits(x as u32) + f32::from_bits(y as u32)).to_bits() as u64)
        }
        Op::MulF32 { d, a, b } => {
            map2(r, d, a, b, exec, |x, y| (f32::from_bits(x as u32) * f32::from_bits(y as u32)).to_bits() as u64)
        }
        Op::FmaF32 { d, a, b, c } => fma_f32_lanes(r, d, a, b, c, exec),
        Op::FBin32 { k, m, d, a, b } => map2(r, d, a, b, exec, |x, y| num::fbin32(k, m, x, y)),
        Op::FBin64 { k, m, d, a, b } => map2(r, d, a, b, exec, |x, y| num::fbin64(k, m, x, y)),
        Op::FUn32 { k, m, approx, d, a } => map1(r, d, a, exec, |x| num::fun32(k, m, approx, x)),
        Op::FUn64 { k, m, approx, d, a } => map1(r, d, a, exec, |x| num::fun64(k, m, approx, x)),
        Op::Fma32 { m, d, a, b, c } => map3(r, d, a, b, c, exec, |x, y, z| num::fma32(m, x, y, z)),
        Op::Fma64 { m, d, a, b, c } => map3(r, d, a, b, c, exec, |x, y, z| num::fma64(m, x, y, z)),
        Op::Cvt {
            to: Ty::BF16,
            from: Ty::F32,
            m: num::FMode { rnd: num::RN, ftz: false, sat: false, int_round: false },
            d,
            a,
        } => map1(r, d, a, exec, num::cvt_rn_bf16_f32),
        Op::Cvt { to, from, m, d, a } => map1(r, d, a, exec, |x| num::cvt(to, from, m, x)),
        Op::Setp { cmp, ty, ftz, comb, negc, d, d2, a, b, c } if d2 == NONE && c == NONE => {
            // The common form: one predicate, no combining operand.
            setp_one(r, d, a, b, exec, cmp, ty, ftz, comb, negc)
        }
        Op::Setp { cmp, ty, ftz, comb, negc, d, d2, a, b, c } => {
            let av = r[a as usize];
            let bv = r[b as usize];
            let cv = if c != NONE { r[c as usize] } else { [0; 32] };
            let mut o1 = r[d as usize];
            let mut o2 = if d2 != NONE { r[d2 as usize] } else { [0; 32] };
            lanes(exec, |l| {
                let x = compare(cmp, ty, ftz, av[l], bv[l]);
                let cb = ((cv[l] & 1) == 1) != negc;
                o1[l] = combine(comb, x, cb) as u64;
                o2[l] = combine(comb, !x, cb) as u64;
            });
            r[d as usize] = o1;
            if d2 != NONE {
                r[d2 as usize] = o2;
            }
        }
        Op::Set { cmp, ty, ftz, comb, negc, float_dst, d, a, b, c } => {
            let av = r[a as usize];
            let bv = r[b as usize];
            let cv = if c != NONE { r[c as usize] } else { [0; 32] };
            let dv = &mut r[d as usize];
            lanes(exec, |l| {
                let x = compare(cmp, ty, ftz, av[l], bv[l]);
                let cb = ((cv[l] & 1) == 1) != negc;
                let t = combine(comb, x, cb);
                dv[l] = match (t, float_dst) {
                    (true, true) => 1.0f32.to_bits() as u64,
                    (true, false) => 0xffff_ffff,
                    _ => 0,
                };
            });
        }
        Op::Selp { d, a, b, p } => map3(r, d, a, b, p, exec, |x, y, q| if q & 1 == 1 { x } else { y }),
        Op::Pack { d, parts, n, bits } => {
            let m = num::mask(bits as u32);
            let mut out = r[d as usize];
            lanes(exec, |l| {
                let mut v = 0u64;
                for k in 0..n as usize {
                    v |= (r[parts[k] as usize][l] & m) << (k as u32 * bits as u32);
                }
                out[l] = v;
            });
            r[d as usize] = out;
        }
        Op::Unpack { ds, n, bits, a } => {
            let av = r[a as usize];
            let m = num::mask(bits as u32);
            for k in 0..n as usize {
                let dv = &mut r[ds[k] as usize];
                lanes(exec, |l| dv[l] = (av[l] >> (k as u32 * bits as u32)) & m);
            }
        }
        Op::Ld { sp: Space::Shared, size, n, sext, dbits, ds, a, off }
            if mem.shared.all_written() && ld_shared_fast(r, exec, mem, size, n, sext, dbits, ds, a, off)? => {}
        Op::Ld { sp: sp @ (Space::Global | Space::Generic), size, n, sext: false, ds, a, off, .. }
            if ld_global_fast(r, exec, mem, sp == Space::Generic, size, n, ds, a, off) => {}
        Op::St { sp: sp @ (Space::Shared | Space::Generic), size, n: 1, srcs, a, off }
            if st_shared_fast(r, exec, mem, sp, size, srcs[0], a, off)? => {}
        Op::St { sp: sp @ (Space::Global | Space::Generic), size, n, srcs, a, off }
            if st_global_fast(r, exec, mem, sp == Space::Generic, size, n, srcs, a, off) => {}
        Op::Ld { sp: Space::Param, size, n, sext, dbits, ds, a, off }
            if ld_param_fast(r, exec, mem, size, n, sext, dbits, ds, a, off) => {}
        Op::Ld { sp, size, n, sext, dbits, ds, a, off } => {
            let av = r[a as usize];
            let mut err = None;
            let total = size as u64 * n as u64;
            lanes(exec, |l| {
                if err.is_some() {
                    return;
                }
                let addr = av[l].wrapping_add(off as u64);
                let vaddr_align = if n > 1 { total } else { size as u64 };
                if addr & (vaddr_align - 1) != 0 {
                    err = Some(Fault {
                        lane: l as u32,
                        kind: "misaligned access",
                        addr,
                        size: total as u32,
                        detail: None,
                        other: None,
                    });
                    return;
                }
                for k in 0..n as usize {
                    let ea = addr + (k as u64) * size as u64;
                    match mem.locate(sp, ea, size as u64, l as u32, false) {
                        Ok(loc) => {
                            let mut v = mem.read(loc, size);
                            if sext && size < 8 {
                                v = (num::sext(v, size as u32 * 8) as u64) & num::mask(dbits as u32);
                            }
                            r[ds[k] as usize][l] = v;
                        }
                        Err(f) => {
                            err = Some(f);
                            return;
                        }
                    }
                }
            });
            if let Some(f) = err {
                return Err(f);
            }
        }
        Op::St { sp, size, n, srcs, a, off } => {
            let av = r[a as usize];
            let total = size as u64 * n as u64;
            let mut err = None;
            lanes(exec, |l| {
                if err.is_some() {
                    return;
                }
                let addr = av[l].wrapping_add(off as u64);
                if n > 1 && addr & (total - 1) != 0 {
                    err = Some(Fault {
                        lane: l as u32,
                        kind: "misaligned access",
                        addr,
                        size: total as u32,
                        detail: None,
                        other: None,
                    });
                    return;
                }
                for k in 0..n as usize {
                    let ea = addr + (k as u64) * size as u64;
                    match mem.locate(sp, ea, size as u64, l as u32, true) {
                        Ok(loc) => mem.write(loc, size, r[srcs[k] as usize][l]),
                        Err(f) => {
                            err = Some(f);
                            return;
                        }
                    }
                }
            });
            if let Some(f) = err {
                return Err(f);
            }
        }
        Op::LdSlot { size, n, ds, base, off, .. } => {
            for k in 0..n as usize {
                let o = off as usize + k * size as usize;
                let (slot, sh) = (base as usize + o / 8, (o % 8) * 8);
                let m = num::mask(size as u32 * 8);
                let sv = r[slot];
                let dv = &mut r[ds[k] as usize];
                lanes(exec, |l| dv[l] = (sv[l] >> sh) & m);
            }
        }
        Op::StSlot { size, n, srcs, base, off, .. } => {
            for k in 0..n as usize {
                let o = off as usize + k * size as usize;
                let (slot, sh) = (base as usize + o / 8, (o % 8) * 8);
                let m = num::mask(size as u32 * 8) << sh;
                let sv = r[srcs[k] as usize];
                let dv = &mut r[slot];
                lanes(exec, |l| dv[l] = (dv[l] & !m) | ((sv[l] << sh) & m));
            }
        }
        Op::Atom { sp, op, ty, d, a, off, b, c } => {
            let av = r[a as usize];
            let bv = r[b as usize];
            let cv = if c != NONE { r[c as usize] } else { [0; 32] };
            let size = (ty.bits() / 8) as u8;
            let mut out = r[d as usize];
            let mut err = None;
            lanes(exec, |l| {
                if err.is_some() {
                    return;
                }
                let addr = av[l].wrapping_add(off as u64);
                mem.shared.race.atomic = true;
                let loc = mem.locate(sp, addr, size as u64, l as u32, true);
                mem.shared.race.atomic = false;
                match loc {
                    Ok(loc) => {
                        let (bb, cc) = (bv[l], cv[l]);
                        out[l] = mem.rmw(loc, size, |old| atom_new(op, ty, old, bb, cc));
                    }
                    Err(f) => err = Some(f),
                }
            });
            if let Some(f) = err {
                return Err(f);
            }
            r[d as usize] = out;
        }
        _ => {}
    }
    Ok(())
}

/// Whether `slot` holds the same value (under `mask`) in all 128 threads of `warps`; else the
/// first warp and lane that differ from warp 0's lane 0.
fn wg_uniform(warps: &[Warp], slot: Slot, mask: u64) -> Result<u64, (usize, u32)> {
    let v = warps[0].regs[slot as usize][0] & mask;
    for (k, wp) in warps.iter().enumerate() {
        if let Some(l) = wp.regs[slot as usize].iter().position(|&x| x & mask != v) {
            return Err((k, l as u32));
        }
    }
    Ok(v)
}

/// The 16 shared bytes at `addr` for a `wgmma.mma_async` operand, with memcheck (window,
/// initcheck, racecheck as a read by the warpgroup's first warp); kept in `chunks`.
fn wg_read(shared: &mut SharedMem, chunks: &mut Vec<(u32, [u8; 16])>, addr: u32) -> Result<[u8; 16], Fault> {
    let at = addr as usize;
    if at + 16 > shared.bytes.len() {
        return Err(Fault::new(0, "wgmma operand outside shared memory", addr as u64, 16, None));
    }
    if !shared.is_written(at, 16) {
        return Err(Fault::new(0, "uninitialized shared memory read", addr as u64, 16, None));
    }
    if shared.racecheck_on() {
        if let Err((d, other)) = shared.race.access(at, 16, false) {
            return Err(Fault { other: Some(other), ..Fault::new(0, "shared memory race", addr as u64, 16, Some(d)) });
        }
    }
    let b: [u8; 16] = shared.bytes[at..at + 16].try_into().expect("16 bytes");
    chunks.push((addr, b));
    Ok(b)
}

/// `wgmma` (semantics in `wgmma.rs`): the warpgroup collective and its findings.
impl Launch<'_> {
    fn at_line(&self, pc: u32) -> String {
        let pc = pc as usize;
        format!("line {}: `{}`", self.prog.insts[pc].line, self.prog.texts[pc])
    }

    fn conflict_at(&self, warp: u32, pc: u32, write: bool) -> Conflict {
        let pcu = pc as usize;
        Conflict {
            warp,
            write,
            line: self.prog.insts[pcu].line as usize,
            instruction: self.prog.texts[pcu].clone(),
            source: None,
        }
    }

    /// Runs the `wgmma.mma_async` of every warpgroup whose four warps all wait at it. A
    /// warpgroup with a warp parked there while another of its warps is not (exited, at a
    /// barrier, at another instruction, or not in the block) can never complete it: a finding.
    /// Returns whether any warpgroup ran one.
    /// The finding of a `.sync.aligned` instruction (`ldmatrix`, `mma`, `wgmma`) that not all 32
    /// lanes of warp `wi` execute (`exec` the lanes that do).
    fn aligned_divergence(&self, block: [u32; 3], wi: usize, exec: u32, pc: u32) -> Box<Finding> {
        let mut f = self.finding(block, wi, exec.trailing_zeros(), pc as usize, "warp collective divergence");
        f.nearest_allocation = Some(format!(
            "`.sync.aligned` needs all 32 lanes of the warp converged and active; lanes {:#010x} are not executing this instruction",
            !exec
        ));
        Box::new(f)
    }

    fn wgmma_release(&self, w: &mut Worker, nwarps: usize, block: [u32; 3]) -> Result<bool, Box<Finding>> {
        let mut released = false;
        for g in 0..nwarps.div_ceil(4) {
            let parked = (4 * g..(4 * g + 4).min(nwarps)).find_map(|wi| {
                let wp = &w.warps[wi];
                (0..32).find(|&l| wp.state[l] == WGW).map(|l| (wi, wp.pcs[l]))
            });
            let Some((first, pc)) = parked else { continue };
            // A warp of the group that yielded at a failed mbarrier wait may still get here (it
            // runs again after this): not ready yet, not a divergence.
            if (4 * g..(4 * g + 4).min(nwarps)).any(|wi| w.warps[wi].state.contains(&YIELD)) {
                continue;
            }
            for wi in 4 * g..4 * g + 4 {
                let why = if wi >= nwarps {
                    Some(format!("warp {wi} does not exist (the block has {} threads)", self.threads()))
                } else {
                    let wp = &w.warps[wi];
                    (0..32).find(|&l| !(wp.state[l] == WGW && wp.pcs[l] == pc)).map(|l| {
                        let t = wi * 32 + l;
                        match wp.state[l] {
                            ABSENT => format!("thread {t} does not exist (the block has {} threads)", self.threads()),
                            EXIT => format!("warp {wi} (thread {t}) has exited"),
                            BAR => format!("warp {wi} (thread {t}) waits at a barrier, {}", self.at_line(wp.pcs[l])),
                            NBAR => format!(
                                "warp {wi} (thread {t}) waits at named barrier {}, {}",
                                wp.nbar,
                                self.at_line(wp.pcs[l])
                            ),
                            WGW => format!("warp {wi} waits at another wgmma.mma_async, {}", self.at_line(wp.pcs[l])),
                            _ => format!("warp {wi} (thread {t}) is at {}", self.at_line(wp.pcs[l])),
                        }
                    })
                };
                if let Some(why) = why {
                    let mut f = self.finding(block, first, 0, pc as usize, "warpgroup collective divergence");
                    f.nearest_allocation = Some(format!(
                        "`wgmma.mma_async.sync.aligned` needs all 128 threads of warpgroup {g} (warps {}..={}) to \
                         execute it together; {why}",
                        4 * g,
                        4 * g + 3
                    ));
                    return Err(Box::new(f));
                }
            }
            self.wgmma_execute(w, g, pc, block)?;
            for wp in &mut w.warps[4 * g..4 * g + 4] {
                for l in 0..32 {
                    wp.state[l] = RUN;
                    wp.pcs[l] += 1;
                }
            }
            released = true;
        }
        Ok(released)
    }

    /// One `wgmma.mma_async` of warpgroup `g` (warps `4g..4g+3`, all at `pc`).
    fn wgmma_execute(&self, w: &mut Worker, g: usize, pc: u32, block: [u32; 3]) -> Result<(), Box<Finding>> {
        use crate::wgmma::{self as wg, ASrc, Desc};
        let prog = self.prog;
        let Op::WgmmaMma { i } = prog.insts[pc as usize].op else { unreachable!("wgmma_execute at a non-wgmma") };
        let inst = &prog.wgmma[i as usize];
        let w0 = 4 * g;
        let warps = &mut w.warps[w0..w0 + 4];
        // The descriptors (the ISA: "must be same across all the warps in the warpgroup") and
        // scale-d.
        let uniform = |slot: Slot, mask: u64, what: &str| -> Result<u64, Box<Finding>> {
            wg_uniform(warps, slot, mask).map_err(|(k, l)| {
                let mut f = self.finding(block, w0 + k, l, pc as usize, "wgmma operand differs across the warpgroup");
                f.nearest_allocation = Some(format!(
                    "{what} of thread {} is {:#x}, of thread {} {:#x}; all 128 threads of the warpgroup must give the same",
                    (w0 + k) * 32 + l as usize,
                    warps[k].regs[slot as usize][l as usize] & mask,
                    w0 * 32,
                    warps[0].regs[slot as usize][0] & mask
                ));
                Box::new(f)
            })
        };
        let a_desc = match inst.a {
            ASrc::Desc(s) => Some(uniform(s, u64::MAX, "the A descriptor")?),
            ASrc::Regs(_) => None,
        };
        let b_desc = uniform(inst.b, u64::MAX, "the B descriptor")?;
        let scale_d = uniform(inst.scale_d, 1, "scale-d")? == 1;
        for (k, wp) in warps.iter().enumerate() {
            if let Err(h) = wp.wg.check_issue(prog, inst) {
                return Err(Box::new(self.wgmma_hazard_finding(block, w0 + k, 0, pc, h)));
            }
        }
        // Operands.
        let shared = &mut w.shared;
        shared.race.warp = w0 as u32;
        shared.race.pc = pc;
        let window = shared.bytes.len();
        let mut chunks = Vec::new();
        let mut load = |v: u64,
                        mn_major: bool,
                        rows: u32,
                        neg: bool,
                        which: &str|
         -> Result<Vec<[f64; 16]>, Box<Finding>> {
            let d = Desc::decode(v);
            let describe = || {
                format!(
                    "{which} descriptor {v:#018x}: start {}, LBO {}, SBO {}, {:?} swizzle, {}-major",
                    d.start,
                    d.lbo,
                    d.sbo,
                    d.swizzle,
                    if mn_major { "MN" } else { "K" }
                )
            };
            if d.base_offset != 0 {
                let mut f = self.finding(block, w0, 0, pc as usize, "wgmma descriptor base offset not supported");
                f.nearest_allocation = Some(format!(
                    "{}: base offset {} (a swizzle pattern that does not start at its 256/512/1024-byte boundary) is not modelled",
                    describe(),
                    d.base_offset
                ));
                return Err(Box::new(f));
            }
            wg::load_operand(&d, mn_major, rows, inst.kind, neg, |addr| wg_read(shared, &mut chunks, addr)).map_err(
                |mut f| {
                    if f.kind == "wgmma operand outside shared memory" {
                        f.detail = Some(format!(
                            "{} addresses shared bytes {}..{}; the block's shared window is {window} bytes",
                            describe(),
                            f.addr,
                            f.addr + 16
                        ));
                    }
                    Box::new(self.fault_finding(block, w0, pc as usize, f))
                },
            )
        };
        let mut a = match (inst.a, a_desc) {
            (ASrc::Desc(_), Some(v)) => load(v, inst.trans_a, 64, inst.neg_a, "A")?,
            _ => vec![[0f64; 16]; 64],
        };
        let bt = load(b_desc, inst.trans_b, inst.n, inst.neg_b, "B")?;
        if let ASrc::Regs(s) = inst.a {
            for (k, wp) in warps.iter().enumerate() {
                wg::gather_a_regs(inst.kind, inst.neg_a, k, &wp.regs, &s, &mut a);
            }
        }
        let mut acc = vec![0f64; 64 * inst.n as usize];
        if scale_d {
            for (k, wp) in warps.iter().enumerate() {
                wg::gather_d(inst, k, &wp.regs, &mut acc);
            }
        }
        wg::product(&a, &bt, &mut acc);
        let snap = std::sync::Arc::new(wg::Snapshot {
            pc,
            group: g as u32,
            chunks,
            checked: std::sync::atomic::AtomicBool::new(false),
        });
        for (k, wp) in warps.iter_mut().enumerate() {
            wg::scatter_d(inst, k, &mut wp.regs, &acc);
            wp.wg.issue(inst, i, pc, snap.clone());
        }
        Ok(())
    }

    /// A register access the `wgmma` rules forbid, at instruction `pc` of warp `wi`.
    fn wgmma_hazard_finding(&self, block: [u32; 3], wi: usize, lane: u32, pc: u32, h: crate::wgmma::Hazard) -> Finding {
        use crate::wgmma::Hazard;
        let name = |s: Slot| self.prog.slot_names[s as usize].clone();
        let writes = |pc: u32, s: Slot| self.prog.insts[pc as usize].op.dsts().contains(&s);
        let (kind, text, conflict) = match h {
            Hazard::NoFence => (
                "wgmma.mma_async without wgmma.fence",
                "the warp executed no wgmma.fence before this wgmma.mma_async (the ISA requires one before the first \
                 wgmma.mma_async of a warpgroup)"
                    .to_string(),
                None,
            ),
            Hazard::Unfenced { slot, pc: other } => (
                "wgmma register access not fenced",
                format!(
                    "register {} is an operand of this wgmma.mma_async and {} accessed it after the warp's last \
                     wgmma.fence (a wgmma.fence must separate them)",
                    name(slot),
                    self.at_line(other)
                ),
                Some(self.conflict_at(wi as u32, other, writes(other, slot))),
            ),
            Hazard::InFlight { slot, pc: holder, acc } => (
                "wgmma register accessed in flight",
                format!(
                    "register {} is {} of the wgmma.mma_async at {}, which no wgmma.wait_group of this warp has retired yet",
                    name(slot),
                    if acc { "an accumulator" } else { "an A fragment register" },
                    self.at_line(holder)
                ),
                Some(self.conflict_at(wi as u32, holder, acc)),
            ),
        };
        let mut f = self.finding(block, wi, lane, pc as usize, kind);
        f.nearest_allocation = Some(text);
        f.conflict = conflict;
        f
    }

    /// Shared byte `at`, read by the in-flight `wgmma.mma_async` of `snap`, changed before the
    /// `wgmma.wait_group` at `pc` (warp `wi`) retired it.
    fn wgmma_overwrite_finding(
        &self,
        block: [u32; 3],
        wi: usize,
        pc: u32,
        snap: &crate::wgmma::Snapshot,
        at: u32,
        shared: &SharedMem,
    ) -> Finding {
        let mut f = self.finding(block, wi, 0, pc as usize, "shared memory overwritten under an in-flight wgmma");
        let store = if shared.racecheck_on() { shared.race.last_writer(at as usize / 4) } else { None };
        f.nearest_allocation = Some(format!(
            "shared byte {at} was read by the wgmma.mma_async at {} (warpgroup {}) and changed before this \
             wgmma.wait_group retired it{}",
            self.at_line(snap.pc),
            snap.group,
            match store {
                Some((ww, spc)) => format!("; the last store to it: warp {ww}, {}", self.at_line(spc)),
                None => String::new(),
            }
        ));
        f.address = Some(at as u64);
        f.access_bytes = Some(1);
        f.conflict = Some(self.conflict_at(4 * snap.group, snap.pc, false));
        f
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    /// `ex2_f32` of every bit pattern `start, start + step, ...` (32 per warp row, high bits
    /// set above the word) against `num::fun32` (`f32::exp2` lane by lane), with and without
    /// `.ftz`; returns the patterns compared.
    fn ex2_against_fun32(start: u64, step: u64, count: u64) -> u64 {
        let mut n = 0;
        let mut x = start;
        while n < count {
            let mut r = vec![[0xdead_0000_0000u64; 32]; 4];
            for (l, v) in r[0].iter_mut().enumerate() {
                *v = (x + l as u64 * step) & 0xffff_ffff | 0x5a5a_0000_0000;
            }
            for ftz in [false, true] {
                let mut rr = r.clone();
                ex2_f32(&mut rr, ftz, 3, 0, FULL);
                let m = num::FMode { ftz, ..num::FMode::default() };
                for l in 0..32 {
                    let want = num::fun32(num::FUn::Ex2, m, true, r[0][l]);
                    let nan = |v: u64| f32::from_bits(v as u32).is_nan();
                    assert!(
                        rr[3][l] == want || nan(rr[3][l]) && nan(want),
                        "ex2 ftz {ftz} of {:#010x}: {:#x}, want {want:#x}",
                        r[0][l] as u32,
                        rr[3][l]
                    );
                }
            }
            x += 32 * step;
            n += 32;
        }
        n
    }

    /// The warp-wide `ex2` (a vector `exp2f` where the CPU has AVX-512) gives the bits of
    /// `f32::exp2` on a sample of every sign and exponent (a step of 4099 through all 2^32
    /// patterns) and on every pattern of `[-2, 2]`'s upper exponents around `x = ±1`.
    pub fn ex2_of_a_full_warp_matches_exp2_lane_by_lane() {
        assert!(ex2_against_fun32(0, 4099, 1 << 20) >= 1 << 20);
        assert!(ex2_against_fun32(0x3f00_0000, 1, 1 << 16) >= 1 << 16);
        assert!(ex2_against_fun32(0xbf00_0000, 1, 1 << 16) >= 1 << 16);
    }

    /// The same over all 2^32 patterns (about a minute in a release build of the tests:
    /// `cargo test -p ptx-vm-tests --release --test unit ex2_every -- --ignored`).
    pub fn ex2_every_pattern_matches_exp2() {
        assert_eq!(ex2_against_fun32(0, 1, 1 << 32), 1 << 32);
    }

    /// Register values that catch the fast paths' mistakes: zero, small and extreme integers,
    /// bits above 32, NaNs (quiet, signalling, negative), infinities, signed zeros, subnormals.
    fn edge_values() -> Vec<u64> {
        let f = |x: f32| x.to_bits() as u64;
        vec![
            0,
            1,
            5,
            0xffff_ffff,
            0x8000_0000,
            0x7fff_ffff,
            0x1_0000_0003,
            u64::MAX,
            0x8000_0000_0000_0000,
            0xffff,
            0x8000,
            0x80,
            f(f32::NAN),
            f(-f32::NAN),
            0x7f80_0001,
            f(-0.0),
            f(0.0),
            f(f32::INFINITY),
            f(f32::NEG_INFINITY),
            f(1.5),
            f(-2.25),
            f(1e-40),
            f(-1e-40),
            f(3.0e38),
        ]
    }

    #[allow(clippy::needless_range_loop)]
    pub fn full_warp_fast_paths_match_the_general_functions() {
        // `setp_full`, `fbin32_rn`, `int_cvt` and the tagged multiplies against `compare`,
        // `num::fbin32`, `num::cvt` and the `ops` functions, on edge values in every lane pairing.
        let vals = edge_values();
        let rows = |i: usize| -> Vec<[u64; 32]> {
            let mut r = vec![[0u64; 32]; 4];
            for l in 0..32 {
                r[0][l] = vals[(i + l) % vals.len()];
                r[1][l] = vals[(i * 7 + 3 * l) % vals.len()];
                r[2][l] = vals[(i * 5 + l / 2) % vals.len()];
                r[3][l] = 0xdead;
            }
            r
        };
        let mut n = 0;
        for i in 0..vals.len() {
            for cmp in [Cmp::Eq, Cmp::Ne, Cmp::Lt, Cmp::Le, Cmp::Gt, Cmp::Ge, Cmp::Equ, Cmp::Nan] {
                for ty in
                    [Ty::S(16), Ty::S(32), Ty::S(64), Ty::U(32), Ty::U(64), Ty::B(32), Ty::B(64), Ty::F32, Ty::F64]
                {
                    for ftz in [false, true] {
                        let mut r = rows(i);
                        if setp_full(&mut r, 3, 0, 1, cmp, ty, ftz) {
                            n += 1;
                            for l in 0..32 {
                                assert_eq!(
                                    r[3][l],
                                    compare(cmp, ty, ftz, r[0][l], r[1][l]) as u64,
                                    "{cmp:?} {ty:?} lane {l}"
                                );
                            }
                        } else {
                            assert!(r[3].iter().all(|&x| x == 0xdead), "declined: nothing written");
                        }
                    }
                }
            }
            for k in [num::FBin::Add, num::FBin::Sub, num::FBin::Mul, num::FBin::Div, num::FBin::Min, num::FBin::Max] {
                for exec in [FULL, 0x5555_1234] {
                    let mut r = rows(i);
                    let mut r2 = rows(i);
                    fbin32_rn(&mut r, k, 3, 0, 1, exec);
                    // The portable loop too (`fbin32_rn` takes the AVX-512 copy where it can).
                    fbin32_rn_lanes(&mut r2, k, 3, 0, 1, exec);
                    let nan = |x: u64| f32::from_bits(x as u32).is_nan();
                    for l in 0..32 {
                        assert!(r2[3][l] == r[3][l] || nan(r[3][l]) && nan(r2[3][l]), "{k:?} lane {l}");
                    }
                    for l in 0..32 {
                        let want = if exec >> l & 1 == 1 {
                            num::fbin32(k, num::FMode::default(), r[0][l], r[1][l])
                        } else {
                            0xdead
                        };
                        // (A NaN result's payload depends on the operand order the compiler
                        // picks for a commutative operation; any NaN is the same NaN here.)
                        let nan = |x: u64| exec >> l & 1 == 1 && f32::from_bits(x as u32).is_nan();
                        assert!(
                            r[3][l] == want || nan(r[3][l]) && nan(want),
                            "{k:?} lane {l}: {:#x} {want:#x}",
                            r[3][l]
                        );
                    }
                }
            }
            for ftz in [false, true] {
                let mut r = rows(i);
                ex2_f32(&mut r, ftz, 3, 0, FULL);
                let m = num::FMode { ftz, ..num::FMode::default() };
                for l in 0..32 {
                    let want = num::fun32(num::FUn::Ex2, m, true, r[0][l]);
                    let nan = |x: u64| f32::from_bits(x as u32).is_nan();
                    assert!(r[3][l] == want || nan(r[3][l]) && nan(want), "ex2 ftz {ftz} lane {l}");
                }
            }
            for from in
                [Ty::S(8), Ty::S(16), Ty::S(32), Ty::S(64), Ty::U(8), Ty::U(16), Ty::U(32), Ty::U(64), Ty::B(32)]
            {
                for to in [Ty::S(8), Ty::S(16), Ty::S(32), Ty::S(64), Ty::U(16), Ty::U(32), Ty::U(64), Ty::B(64)] {
                    let mut r = rows(i);
                    int_cvt(&mut r, to, from, 3, 0, FULL);
                    for l in 0..32 {
                        assert_eq!(r[3][l], num::cvt(to, from, num::FMode::default(), r[0][l]), "{from:?} -> {to:?}");
                    }
                }
            }
            for (k, want) in [
                (IntK::MulLo32, crate::ops::mul::<32> as fn(u64, u64) -> u64),
                (IntK::MulLo64, crate::ops::mul::<64>),
                (IntK::MulWideU32, crate::ops::mulwide_u::<32>),
                (IntK::MulWideS32, crate::ops::mulwide_s::<32>),
                (IntK::FSub32, crate::ops::fsub32),
            ] {
                let mut r = rows(i);
                int_bin(&mut r, k, want, 3, 0, 1, FULL);
                for l in 0..32 {
                    assert_eq!(r[3][l], want(r[0][l], r[1][l]), "{k:?}");
                }
                // The tag, not `f`, picks the loop: a wrong function passed along is not called.
                let mut r2 = rows(i);
                int_bin(&mut r2, k, |_, _| 0xbad, 3, 0, 1, FULL);
                assert_eq!(r2[3], r[3], "{k:?}");
            }
            // `sub.rn.f32` as `fbin32` computes it (`a + (-b)`) and as `ops::fsub32` (`a - b`):
            // the same bits on these values (a NaN's payload aside).
            for l in 0..32 {
                let r = rows(i);
                let (x, y) = (
                    crate::ops::fsub32(r[0][l], r[1][l]),
                    num::fbin32(num::FBin::Sub, num::FMode::default(), r[0][l], r[1][l]),
                );
                let nan = |x: u64| f32::from_bits(x as u32).is_nan();
                assert!(x == y || nan(x) && nan(y), "{x:#x} {y:#x}");
            }
        }
        assert!(n > 100, "setp_full took {n} cases");
    }

    #[allow(clippy::needless_range_loop)]
    pub fn bf16_rounding_without_branches_matches_half() {
        // Every sign and exponent with mantissas around the rounding boundaries (the 16 cut
        // bits near 0x8000, the kept part's lowest bit both ways, all-ones), and a strided sweep
        // of all 2^32 patterns; NaNs (signalling and quiet) and infinities among them.
        let check = |x: u32| {
            let want = half::bf16::from_f32(f32::from_bits(x)).to_bits() as u32;
            assert_eq!(num::bf16_rn_bits(x), want, "{x:#010x}");
        };
        for se in 0..512u32 {
            for hi in [0u32, 1, 2, 0x3e, 0x3f, 0x40, 0x41, 0x7e, 0x7f] {
                for lo in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x4000, 0xc000] {
                    check(se << 23 | hi << 16 | lo);
                }
            }
        }
        let mut x = 0u32;
        loop {
            check(x);
            match x.checked_add(4099) {
                Some(y) => x = y,
                None => break,
            }
        }
        let mut r = vec![[0u64; 32]; 3];
        for l in 0..32 {
            r[0][l] = 0x3f80_8000 + l as u64 * 0x1_0001;
            r[1][l] = 0xff80_0001 - l as u64 * 0x3_0003;
        }
        let mut r2 = r.clone();
        cvt_bf16x2(&mut r, 2, 0, 1, FULL);
        cvt_bf16x2_lanes(&mut r2, 2, 0, 1, 0x7fff_fffe);
        for l in 0..32 {
            assert_eq!(r[2][l], crate::ops::cvt_x2::<true, false>(r[0][l], r[1][l]), "lane {l}");
            assert_eq!(r2[2][l], if l == 0 || l == 31 { 0 } else { r[2][l] }, "lane {l}");
        }
    }

    /// The monomorphic `setp` loops give the predicate the general [`compare`] gives, for every
    /// comparison, integer width and signedness, f32 with and without `.ftz`, each combine mode
    /// and negation, on values that include NaN, infinities, signed zeros, subnormals, and bits
    /// above the type's width; lanes outside `exec` keep their old value.
    #[allow(clippy::needless_range_loop)]
    pub fn setp_fast_loops_match_compare() {
        let vals = edge_values();
        let cmps = [
            Cmp::Eq,
            Cmp::Ne,
            Cmp::Lt,
            Cmp::Le,
            Cmp::Gt,
            Cmp::Ge,
            Cmp::Equ,
            Cmp::Neu,
            Cmp::Ltu,
            Cmp::Leu,
            Cmp::Gtu,
            Cmp::Geu,
            Cmp::Num,
            Cmp::Nan,
        ];
        let tys = [Ty::S(16), Ty::S(32), Ty::S(64), Ty::U(16), Ty::U(32), Ty::U(64), Ty::B(32), Ty::F32, Ty::F64];
        let (mut checked, mut exec) = (0, 0u32);
        for &cmp in &cmps {
            for &ty in &tys {
                for ftz in [false, true] {
                    for comb in 0..4u8 {
                        for negc in [false, true] {
                            for (i, &x) in vals.iter().enumerate() {
                                let mut r = vec![[0u64; 32]; 3];
                                for l in 0..32 {
                                    r[0][l] = x;
                                    r[1][l] = vals[(i + l) % vals.len()];
                                    r[2][l] = 7;
                                }
                                exec = exec.rotate_left(7) ^ 0x9E37_79B9 ^ i as u32;
                                let e = if i % 3 == 0 { FULL } else { exec };
                                setp_one(&mut r, 2, 0, 1, e, cmp, ty, ftz, comb, negc);
                                for l in 0..32 {
                                    let want = if e >> l & 1 == 1 {
                                        combine(comb, compare(cmp, ty, ftz, r[0][l], r[1][l]), negc) as u64
                                    } else {
                                        7
                                    };
                                    assert_eq!(
                                        r[2][l], want,
                                        "{cmp:?} {ty:?} ftz {ftz} comb {comb} negc {negc} lane {l}"
                                    );
                                    checked += 1;
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 100_000);
    }

    /// The AVX-512 address check and gather of full-warp `ld.shared.b32` accept exactly the
    /// addresses the scalar check accepts (aligned, `addr <= last`, wrapping sums included) and
    /// read the same words.
    pub fn b32_address_check_and_gather_match_the_scalar_path() {
        if !avx512() {
            return;
        }
        let bytes: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        let last = bytes.len() as u64 - 4;
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for round in 0..2000 {
            let off = [0u64, 16384, u64::MAX - 3, 4, last][round % 5];
            let mut av = [0u64; 32];
            for (l, v) in av.iter_mut().enumerate() {
                let x = next();
                *v = match round % 4 {
                    0 => (4 * l as u64 + 8 * (x % 400)).wrapping_sub(off),
                    1 => (x % (last + 8)).wrapping_sub(off),
                    2 => x,
                    _ => (4 * (x % (last / 4 + 2))).wrapping_sub(off),
                };
            }
            let (mut addrs, mut words) = ([0u64; 32], [0u32; 32]);
            // SAFETY: `avx512()` said the CPU has it.
            let ok = unsafe { b32_addresses_avx512(&av, off, last, &mut addrs, &mut words) };
            let want: Vec<u64> = av.iter().map(|a| a.wrapping_add(off)).collect();
            let want_ok = want.iter().all(|&a| a & 3 == 0 && a <= last);
            assert_eq!(ok, want_ok, "round {round}");
            if ok {
                assert_eq!(&addrs[..], &want[..]);
                assert!(words.iter().zip(&want).all(|(&w, &a)| w as u64 == a / 4));
                let mut dv = [0u64; 32];
                // SAFETY: every address passed the window check.
                unsafe { gather_b32_avx512(&bytes, &addrs, &mut dv) };
                for (l, &a) in want.iter().enumerate() {
                    let a = a as usize;
                    assert_eq!(dv[l], u32::from_le_bytes(bytes[a..a + 4].try_into().unwrap()) as u64);
                }
            }
        }
    }

    /// The AVX-512 `add`/`mul`/`fma.rn.f32` of a full warp give the lane loops' bits (finite,
    /// subnormal, infinite and zero operands of both signs; a destination that is a source).
    pub fn f32_warp_ops_match_the_lane_loops() {
        if !avx512() {
            return;
        }
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let special =
            [0u32, 0x8000_0000, 1, 0x8000_0001, 0x0080_0000, 0x7F7F_FFFF, 0x7F80_0000, 0xFF80_0000, 0x3F80_0001];
        for round in 0..300 {
            let mut r = vec![[0u64; 32]; 8];
            for slot in r.iter_mut().take(3) {
                for v in slot.iter_mut() {
                    let x = next();
                    let bits = if x >> 61 == 0 { special[(x as usize >> 8) % special.len()] } else { (x >> 16) as u32 };
                    *v = bits as u64 | (x << 40);
                }
            }
            let mut want = r.clone();
            map2(&mut want, 3, 0, 1, FULL, |x, y| {
                (f32::from_bits(x as u32) + f32::from_bits(y as u32)).to_bits() as u64
            });
            map2(&mut want, 4, 0, 1, FULL, |x, y| {
                (f32::from_bits(x as u32) * f32::from_bits(y as u32)).to_bits() as u64
            });
            map3(&mut want, 5, 0, 1, 2, FULL, fma_f32);
            map3(&mut want, 6, 0, 1, 2, FULL, fma_f32);
            let mut got = r.clone();
            f32_warp_avx512::<F32_ADD>(&mut got, 3, 0, 1, 1);
            f32_warp_avx512::<F32_MUL>(&mut got, 4, 0, 1, 1);
            f32_warp_avx512::<F32_FMA>(&mut got, 5, 0, 1, 2);
            // In place: the destination is the accumulator.
            got[6] = got[2];
            f32_warp_avx512::<F32_FMA>(&mut got, 6, 0, 1, 6);
            for k in 3..7 {
                assert_eq!(got[k], want[k], "round {round} op {k}");
            }
        }
    }

    /// The guard mask from AVX-512 is the scalar loop's.
    pub fn guard_mask_takes_bit_0_of_every_lane() {
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..1000 {
            let g: [u64; 32] = std::array::from_fn(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s
            });
            let want = g.iter().enumerate().fold(0u32, |m, (l, v)| m | ((v & 1) as u32) << l);
            assert_eq!(guard_mask(&g), want);
        }
    }

    /// The FMA-feature copy of the `fma.rn.f32` loop gives the bits of the portable one.
    pub fn fma_fast_path_matches_portable() {
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let special =
            [0u32, 0x8000_0000, 1, 0x0080_0000, 0x7F7F_FFFF, 0x7F80_0000, 0x7FC0_0000, 0x3F80_0001, 0x3380_0000];
        for round in 0..200 {
            let mut r = vec![[0u64; 32]; 5];
            for slot in r.iter_mut().take(3) {
                for (l, v) in slot.iter_mut().enumerate() {
                    let x = next();
                    *v = if (x >> 60) < 3 { special[(x as usize >> 8) % special.len()] } else { x as u32 } as u64;
                    if round % 2 == 1 && l % 3 == 0 {
                        *v ^= 0x8000_0000;
                    }
                }
            }
            let exec = if round % 3 == 0 { FULL } else { next() as u32 };
            map3(&mut r, 3, 0, 1, 2, exec, fma_f32);
            fma_f32_lanes(&mut r, 4, 0, 1, 2, exec);
            for (l, (want, got)) in r[3].iter().zip(&r[4]).enumerate() {
                if exec >> l & 1 == 1 {
                    assert_eq!(want, got, "lane {l}: {:#x} {:#x} {:#x}", r[0][l], r[1][l], r[2][l]);
                }
            }
        }
    }
}
