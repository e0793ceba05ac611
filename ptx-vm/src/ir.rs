//! The decoded, compact instruction form the executor runs.
//!
//! Every operand is a register slot: immediates, symbol addresses and per-thread special
//! registers are materialised as read-only slots when a warp starts, so an instruction reads
//! `regs[slot][lane]` and never inspects an operand kind at run time. Adding an instruction is one
//! decode arm (in `decode.rs`) producing an `Op` and, if it needs new behaviour, one `Op` variant
//! and its exec arm (in `exec.rs`).

use crate::num::{FBin, FMode, FUn, Ty};

pub(crate) type Slot = u32;

/// [`Op::Shfl::perm`] of a shuffle whose lane operands are not both constants.
pub(crate) const NO_PERM: u16 = u16::MAX;
/// "No register" (absent second destination, unused source).
pub(crate) const NONE: Slot = u32::MAX;

pub(crate) type F2 = fn(u64, u64) -> u64;
pub(crate) type F1 = fn(u64) -> u64;
pub(crate) type F3 = fn(u64, u64, u64) -> u64;
pub(crate) type F4 = fn(u64, u64, u64, u64) -> u64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Space {
    Global,
    Shared,
    Local,
    /// Kernel parameter space (read-only, shared by all threads).
    Param,
    Generic,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Equ,
    Neu,
    Ltu,
    Leu,
    Gtu,
    Geu,
    Num,
    Nan,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AtomOp {
    Add,
    Min,
    Max,
    Inc,
    Dec,
    And,
    Or,
    Xor,
    Exch,
    Cas,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Special {
    Tid(u8),
    Ntid(u8),
    Ctaid(u8),
    Nctaid(u8),
    Laneid,
    Warpid,
    Nwarpid,
    LanemaskEq,
    LanemaskLt,
    LanemaskLe,
    LanemaskGt,
    LanemaskGe,
    Smid,
    Nsmid,
    Gridid,
    DynSmem,
    TotalSmem,
    /// `%cluster_ctaid`, `%cluster_nctaid`, `%clusterid`, `%nclusterid`, `%cluster_ctarank`,
    /// `%cluster_nctarank`, `%is_explicit_cluster`: every launch is a cluster of one block.
    ClusterCtaid(u8),
    ClusterNctaid(u8),
    Clusterid(u8),
    Nclusterid(u8),
    ClusterCtarank,
    ClusterNctarank,
    IsExplicitCluster,
}

/// The integer operations of address arithmetic that [`Op::Bin`] names besides its function
/// pointer (the same functions of `ops`, at 32 or 64 bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IntK {
    Fn,
    Add32,
    Add64,
    Sub32,
    Sub64,
    And,
    Or,
    Xor,
    Shl32,
    Shl64,
    ShrU32,
    ShrU64,
    /// `cvt.rn.bf16x2.f32`.
    CvtBf16x2,
    MulLo32,
    MulLo64,
    MulWideU32,
    MulWideS32,
    /// `sub.rn.f32` without `.ftz`/`.sat`.
    FSub32,
}

/// Which function an [`Op::Ter`] is, for the hot ones (`Fn`: any other; call `f`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TerK {
    Fn,
    MadLo32,
    MadLo64,
    MadWideU32,
    MadWideS32,
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum Op {
    Nop,
    Mov {
        d: Slot,
        a: Slot,
    },
    Bin {
        f: F2,
        /// Which of the hot integer functions `f` is, so that the executor runs it as an inlined
        /// loop instead of one indirect call per lane ([`IntK::Fn`]: another function, called).
        k: IntK,
        d: Slot,
        a: Slot,
        b: Slot,
    },
    Un {
        f: F1,
        d: Slot,
        a: Slot,
    },
    Ter {
        f: F3,
        k: TerK,
        d: Slot,
        a: Slot,
        b: Slot,
        c: Slot,
    },
    Quad {
        f: F4,
        d: Slot,
        a: Slot,
        b: Slot,
        c: Slot,
        e: Slot,
    },
    /// Fast paths of the f32 hot loop.
    AddF32 {
        d: Slot,
        a: Slot,
        b: Slot,
    },
    MulF32 {
        d: Slot,
        a: Slot,
        b: Slot,
    },
    FmaF32 {
        d: Slot,
        a: Slot,
        b: Slot,
        c: Slot,
    },
    FBin32 {
        k: FBin,
        m: FMode,
        d: Slot,
        a: Slot,
        b: Slot,
    },
    FBin64 {
        k: FBin,
        m: FMode,
        d: Slot,
        a: Slot,
        b: Slot,
    },
    FUn32 {
        k: FUn,
        m: FMode,
        approx: bool,
        d: Slot,
        a: Slot,
    },
    FUn64 {
        k: FUn,
        m: FMode,
        approx: bool,
        d: Slot,
        a: Slot,
    },
    Fma32 {
        m: FMode,
        d: Slot,
        a: Slot,
        b: Slot,
        c: Slot,
    },
    Fma64 {
        m: FMode,
        d: Slot,
        a: Slot,
        b: Slot,
        c: Slot,
    },
    Cvt {
        to: Ty,
        from: Ty,
        m: FMode,
        d: Slot,
        a: Slot,
    },
    /// `setp`: `d = cmp(a, b) comb c`, `d2 = !cmp(a, b) comb c`. comb: 0 none, 1 and, 2 or, 3 xor.
    Setp {
        cmp: Cmp,
        ty: Ty,
        ftz: bool,
        comb: u8,
        negc: bool,
        d: Slot,
        d2: Slot,
        a: Slot,
        b: Slot,
        c: Slot,
    },
    /// `set`: like `setp` but writes all-ones / 1.0f (when `float_dst`) or 0.
    Set {
        cmp: Cmp,
        ty: Ty,
        ftz: bool,
        comb: u8,
        negc: bool,
        float_dst: bool,
        d: Slot,
        a: Slot,
        b: Slot,
        c: Slot,
    },
    Selp {
        d: Slot,
        a: Slot,
        b: Slot,
        p: Slot,
    },
    Pack {
        d: Slot,
        parts: [Slot; 4],
        n: u8,
        bits: u8,
    },
    Unpack {
        ds: [Slot; 4],
        n: u8,
        bits: u8,
        a: Slot,
    },
    /// `ld`: `n` elements of `size` bytes to `ds`; `sext` sign-extends narrow loads to `dbits`.
    Ld {
        sp: Space,
        size: u8,
        n: u8,
        sext: bool,
        dbits: u8,
        ds: [Slot; 4],
        a: Slot,
        off: i64,
    },
    St {
        sp: Space,
        size: u8,
        n: u8,
        srcs: [Slot; 4],
        a: Slot,
        off: i64,
    },
    /// Access to a function-scope `.param` variable held in registers (`base` .. `base + slots`).
    LdSlot {
        size: u8,
        n: u8,
        ds: [Slot; 4],
        base: Slot,
        off: u32,
    },
    StSlot {
        size: u8,
        n: u8,
        srcs: [Slot; 4],
        base: Slot,
        off: u32,
    },
    Atom {
        sp: Space,
        op: AtomOp,
        ty: Ty,
        d: Slot,
        a: Slot,
        off: i64,
        b: Slot,
        c: Slot,
    },
    Bra {
        t: u32,
    },
    Call {
        t: u32,
        copies: u32,
    },
    CallRet {
        copies: u32,
    },
    Ret,
    Exit,
    Trap,
    /// `bar.sync a` / `barrier.sync a` without a thread count: every thread of the block (the
    /// id is not modelled: such a barrier waits for all of them whatever its id).
    Bar,
    /// `bar.sync a, b` / `bar.arrive a, b` (and `barrier.*`): named barrier `a` (0..15) of `b`
    /// threads (a multiple of 32). Each warp that executes it counts 32; `arrive` goes on, a sync
    /// waits until the barrier has its `b` threads, which releases every warp waiting on it.
    NamedBar {
        id: Slot,
        count: Slot,
        arrive: bool,
    },
    BarWarp,
    /// mode: 0 up, 1 down, 2 bfly, 3 idx. `perm`: with constant `b` and `c`, the source lane of
    /// every lane, computed at decode (`Program::shfl_perms[perm]`; [`NO_PERM`]: none).
    Shfl {
        mode: u8,
        perm: u16,
        d: Slot,
        p: Slot,
        a: Slot,
        b: Slot,
        c: Slot,
        mask: Slot,
    },
    /// mode: 0 all, 1 any, 2 uni, 3 ballot.
    Vote {
        mode: u8,
        neg: bool,
        d: Slot,
        a: Slot,
        mask: Slot,
    },
    Activemask {
        d: Slot,
    },
    Clock {
        d: Slot,
    },
    /// op: 0 add, 1 min, 2 max, 3 and, 4 or, 5 xor; signed for s32 min/max.
    Redux {
        op: u8,
        signed: bool,
        d: Slot,
        a: Slot,
        mask: Slot,
    },
    /// all: match.all (with optional predicate `p`), else match.any.
    Match {
        all: bool,
        bits64: bool,
        d: Slot,
        p: Slot,
        a: Slot,
        mask: Slot,
    },
    /// `cp.async.{ca,cg}.shared.global [d + doff], [a + aoff], size, n`: an asynchronous copy of
    /// `n` bytes (`n` slot, or `size` when `n` is NONE) zero-filled to `size` bytes, queued per
    /// thread until a `cp.async.wait_*` (or the thread's exit) completes it.
    CpAsync {
        size: u8,
        d: Slot,
        doff: i32,
        a: Slot,
        aoff: i32,
        n: Slot,
    },
    /// `cp.async.commit_group`.
    CpCommit,
    /// `cp.async.wait_group n` (`all`: `cp.async.wait_all`, i.e. commit then wait for 0).
    CpWait {
        n: u32,
        all: bool,
    },
    /// `ldmatrix.sync.aligned.m8n8.x{num}{.trans}.shared.b16 {ds}, [a + off]` (warp-collective).
    Ldmatrix {
        num: u8,
        trans: bool,
        sp: Space,
        ds: [Slot; 4],
        a: Slot,
        off: i32,
    },
    /// `mma.sync.aligned.m16n8k{8,16}.row.col.f32.T.T.f32 {d}, {a}, {b}, {c}` (warp-collective);
    /// the source slots are `Program::mma_srcs[srcs]`.
    Mma {
        kind: crate::tensor_core::HalfKind,
        k16: bool,
        d: [Slot; 4],
        srcs: u32,
    },
    /// `wgmma.mma_async.sync.aligned.m64nNk16...` (warpgroup-collective); the operands are
    /// `Program::wgmma[i]`.
    WgmmaMma {
        i: u32,
    },
    /// `wgmma.fence.sync.aligned`.
    WgmmaFence,
    /// `wgmma.commit_group.sync.aligned`.
    WgmmaCommit,
    /// `wgmma.wait_group.sync.aligned n`.
    WgmmaWait {
        n: u32,
    },
    /// A Hopper instruction (`mbarrier`, `cp.async.bulk`, `setmaxnreg`): `Program::hopper[i]`,
    /// writing `d` (or NONE).
    Hopper {
        i: u32,
        d: Slot,
    },
    /// `elect.sync d|p, mask` (warp-collective).
    Elect {
        d: Slot,
        p: Slot,
        mask: Slot,
    },
}

/// Source slots of one `mma`: A (4, or 2 for k8), B (2, or 1 for k8; unused entries NONE), C (4).
#[derive(Clone, Copy, Debug)]
pub(crate) struct MmaSrcs {
    pub a: [Slot; 4],
    pub b: [Slot; 2],
    pub c: [Slot; 4],
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Inst {
    pub op: Op,
    /// Guard predicate slot or NONE.
    pub guard: Slot,
    pub gneg: bool,
    /// [`crate::fuse::runs`]: the fusable `ld.shared` + `fma` pairs from here (0: none), next
    /// to the instruction the dispatch loop reads anyway.
    pub fused: u16,
    pub line: u32,
}

impl Op {
    /// Destination slots (for the trace).
    /// An instruction that the lanes of a warp execute together: `shfl`/`vote`/`redux`/`match`
    /// `.sync`, `bar.warp.sync`, a named barrier (it counts whole warps), and the `.sync.aligned`
    /// `ldmatrix` and `mma`.
    pub fn is_warp_collective(&self) -> bool {
        matches!(
            self,
            Op::Shfl { .. }
                | Op::Vote { .. }
                | Op::Redux { .. }
                | Op::Match { .. }
                | Op::BarWarp
                | Op::NamedBar { .. }
                | Op::Ldmatrix { .. }
                | Op::Mma { .. }
                | Op::WgmmaMma { .. }
                | Op::WgmmaFence
                | Op::WgmmaCommit
                | Op::WgmmaWait { .. }
                | Op::Elect { .. }
        )
    }

    pub fn dsts(&self) -> Vec<Slot> {
        use Op::*;
        let v: Vec<Slot> = match *self {
            Mov { d, .. }
            | Bin { d, .. }
            | Un { d, .. }
            | Ter { d, .. }
            | Quad { d, .. }
            | AddF32 { d, .. }
            | MulF32 { d, .. }
            | FmaF32 { d, .. }
            | FBin32 { d, .. }
            | FBin64 { d, .. }
            | FUn32 { d, .. }
            | FUn64 { d, .. }
            | Fma32 { d, .. }
            | Fma64 { d, .. }
            | Cvt { d, .. }
            | Set { d, .. }
            | Selp { d, .. }
            | Pack { d, .. }
            | Atom { d, .. }
            | Activemask { d }
            | Clock { d }
            | Redux { d, .. }
            | Vote { d, .. }
            | Hopper { d, .. } => vec![d],
            Setp { d, d2, .. } => vec![d, d2],
            Shfl { d, p, .. } | Match { d, p, .. } | Elect { d, p, .. } => vec![d, p],
            Unpack { ds, n, .. } | Ld { ds, n, .. } | LdSlot { ds, n, .. } => ds[..n as usize].to_vec(),
            Ldmatrix { ds, num, .. } => ds[..num as usize].to_vec(),
            Mma { d, .. } => d.to_vec(),
            _ => vec![],
        };
        v.into_iter().filter(|&s| s != NONE).collect()
    }
}

/// One kernel, ready to run: its entry and every function it calls, decoded.
pub(crate) struct Program {
    pub insts: Vec<Inst>,
    pub texts: Vec<String>,
    pub nslots: usize,
    /// Constant slots and their values.
    pub consts: Vec<(Slot, u64)>,
    pub specials: Vec<(Slot, Special)>,
    /// Register names (for the trace), indexed by slot.
    pub slot_names: Vec<String>,
    pub copies: Vec<Vec<(Slot, Slot)>>,
    /// The `.param` variables held in registers (function scope, call parameters and return
    /// values): first slot and slot count; `LdSlot`/`StSlot` index them from the first.
    pub pvars: Vec<(Slot, u32)>,
    pub info: crate::KernelInfo,
    /// Offset of the dynamic (`.extern`) shared window.
    pub dyn_shared_offset: usize,
    pub has_calls: bool,
    /// Source operands of the `mma` instructions (`Op::Mma::srcs` indexes it).
    pub mma_srcs: Vec<MmaSrcs>,
    /// Source lanes of the `shfl` instructions with constant operands (`Op::Shfl::perm`).
    pub shfl_perms: Vec<[u8; 32]>,
    /// Operands of the `wgmma.mma_async` instructions (`Op::WgmmaMma::i` indexes it).
    pub wgmma: Vec<crate::wgmma::WgmmaInst>,
    /// [`crate::wgmma::ProgInfo`], computed on the first launch of a program with `wgmma`.
    pub wgmma_info: std::sync::OnceLock<crate::wgmma::ProgInfo>,
    /// The Hopper instructions (`Op::Hopper::i` indexes it).
    pub hopper: Vec<crate::hopper::HInst>,
    /// Unique per decoded program: a warp whose register file was set up for this id still holds
    /// its constant slots.
    pub uid: u64,
    /// [`crate::reginit::zero_slots`], computed on the first launch.
    pub zero_slots: std::sync::OnceLock<Option<Vec<Slot>>>,
    /// [`crate::regalloc::pack`], computed on the first launch that runs it.
    pub packed: std::sync::OnceLock<Option<Box<Program>>>,
}

/// A fresh [`Program::uid`].
pub(crate) fn next_uid() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl Program {
    /// The slots a warp zeroes at block start (`None`: all of them).
    pub fn zero_slots(&self) -> Option<&[Slot]> {
        self.zero_slots.get_or_init(|| crate::reginit::zero_slots(self)).as_deref()
    }

    /// The program with its registers packed into fewer slots ([`crate::regalloc`]), or the
    /// program itself when it is not packed.
    pub fn packed(&self) -> &Program {
        self.packed.get_or_init(|| crate::regalloc::pack(self).map(Box::new)).as_deref().unwrap_or(self)
    }

    /// The per-instruction `wgmma` register sets (`None`: the program has no `wgmma.mma_async`).
    pub fn wgmma_info(&self) -> Option<&crate::wgmma::ProgInfo> {
        if self.wgmma.is_empty() {
            return None;
        }
        Some(self.wgmma_info.get_or_init(|| crate::wgmma::ProgInfo::build(self)))
    }
}
