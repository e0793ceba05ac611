//! Hopper's warpgroup matrix multiply-accumulate: `wgmma.mma_async.sync.aligned.m64nNk16` over
//! `.f16`/`.bf16` operands with `.f32` (or, for `.f16`, `.f16`) accumulators, and the
//! `wgmma.fence` / `wgmma.commit_group` / `wgmma.wait_group` bookkeeping around it, as pure
//! functions over the four warps of a warpgroup. The executor (`exec.rs`) parks each warp that
//! reaches a `wgmma.mma_async` until all four warps of its aligned warpgroup (warps `4g..4g+3`
//! of the block) have, then runs the instruction once for the warpgroup with these functions.
//!
//! Sources: PTX ISA 9.x, section 9.7.15 "Asynchronous Warpgroup Level Matrix Multiply-Accumulate
//! Instructions": 9.7.15.5.1.1 "Register Fragments", 9.7.15.5.1.2 "Shared Memory Matrix Layout"
//! (its "Major-ness supported by Strides" and "Canonical Layouts" subsections), 9.7.15.5.1.2.2
//! "Matrix Descriptor Format", 9.7.15.5.2 `wgmma.mma_async`, and the `wgmma.fence`,
//! `wgmma.commit_group` and `wgmma.wait_group` instructions of 9.7.15.
//!
//! # Register fragments (per warp `w` = 0..3 of the warpgroup, `group = lane / 4`, `tig = lane % 4`)
//!
//! ```text
//! D (64 x N), f32: N/2 registers; element i = 4j + 2h + c (j = 0..N/8, h, c = 0..1):
//!     row 16 w + group + 8 h, column 8 j + 2 tig + c
//! D, f16: N/4 .f16x2 registers; register r holds elements 2r (low half) and 2r + 1 (high half)
//! A in registers (64 x 16), 4 x .b32 per thread, each {low, high} = two consecutive columns:
//!     reg r: row 16 w + group + 8 (r % 2), columns 2 tig + 8 (r / 2) + {0, 1}
//!     (per warp, mma.m16n8k16's A fragment on the warp's 16 rows)
//! ```
//!
//! # Shared-memory operands (matrix descriptors)
//!
//! Descriptor bits: 0–13 start address >> 4, 16–29 leading-dimension byte offset (LBO) >> 4,
//! 32–45 stride-dimension byte offset (SBO) >> 4, 49–51 base offset, 62–63 swizzle (0 none /
//! interleave, 1 128B, 2 64B, 3 32B). A is 64 x 16 (M x K), B is 16 x N (K x N); an operand is
//! K-major when its `imm-trans` is 0, MN-major when it is 1. With 16-bit elements a 16-byte chunk
//! holds T = 8 elements. The canonical layouts (ISA table "Canonical Layouts", in elements, for
//! an operand of MN extent `8 m` and K extent 16), as implemented by [`Desc::chunk`]:
//!
//! ```text
//! K-major   none:  ((8,m),(T,2)) : ((1T, SBO), (1, LBO))   8 rows x 16 B core matrices, packed
//!                  (row stride 16 B); the next 8 rows at SBO, the second 8 columns of K at LBO
//!           32B/64B/128B (S = 32/64/128 bytes per row):
//!                  ((8,m),(T,2)) : ((S/16 T, SBO), (1, T))
//!                  row r of an 8-row group at r * S bytes, the next 8 rows at SBO, the two K
//!                  chunks adjacent (LBO unused: "assumed to be 1")
//! MN-major  none:  ((T,1,m),(8,2)) : ((1,T,SBO),(1T,LBO))  8 MN elements (16 B) x 8 K rows of
//!                  16 B packed; the next 8 MN elements at SBO, the next 8 K rows at LBO
//!           32B/64B/128B: ((T,S/16,m),(8,2)) : ((1,T,LBO),(S/16 T,SBO))  a K row is S bytes of
//!                  MN; the next S/2 MN elements at LBO, the 8 K rows at S apart, the next 8 K
//!                  rows at SBO
//! ```
//!
//! The byte address so formed (start + offsets) is then swizzled as a shared-memory address with
//! [`Swizzle::apply`] (the pattern repeats at 256/512/1024-byte boundaries, which is why a
//! swizzled buffer is aligned to them and why advancing the start address by 32 bytes inside a
//! 128B-swizzled row selects the next 16 columns of K). A non-zero base offset (a pattern that
//! does not start at such a boundary) is not modelled and is reported.
//!
//! # Numerics
//!
//! As in `tensor_core.rs`: each product of two 16-bit floats is exact in f64; the 16 products
//! of an output are added, in k order, to the accumulator (or to zero when `scale-d` is false) in
//! f64 and the sum is rounded once to f32 (or to f16 for `.f16` accumulators), to nearest even.
//! `imm-scale-a`/`imm-scale-b` = -1 negate A/B.
//!
//! # Asynchrony
//!
//! The result is written when the instruction issues. What the ISA makes undefined is reported
//! instead ([`WarpTrack`]): accessing (reading or writing) an accumulator or A-fragment register
//! of a `wgmma.mma_async` that no `wgmma.wait_group` of the warp has retired yet (another
//! `wgmma.mma_async` of the same shape may accumulate into the same registers), a
//! `wgmma.mma_async` with no `wgmma.fence` before it in the warp, or one whose registers an
//! ordinary instruction accessed after the warp's last `wgmma.fence`. The shared-memory bytes an
//! in-flight `wgmma.mma_async` read are kept; when a `wgmma.wait_group` retires it, bytes that
//! changed in between (a store into the operand before the wait) are reported. Not checked:
//! `fence.proxy.async` between generic stores and the asynchronous proxy's reads, a store that
//! writes back the same bytes, a thread that exits with a `wgmma` in flight, and that the four
//! warps execute the same `commit_group` / `wait_group` sequence (each warp counts its own
//! groups, which is what its registers depend on).
//!
//! Not implemented (refused at load time with the form named): tf32 (k8), fp8 e4m3/e5m2 and
//! integer (k32), single-bit (k256) and sparse (`.sp`) variants. fp8 with f32 accumulation would
//! reuse all of this with T = 16 elements per 16-byte chunk and its own A-register fragment.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::ir::{Op, Program, Slot, NONE};
use crate::swizzle::Swizzle;
use crate::tensor_core::HalfKind;

/// Element type of the accumulator D.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AccKind {
    F32,
    F16,
}

/// Where A comes from.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ASrc {
    /// A 64-bit matrix descriptor register.
    Desc(Slot),
    /// Four `.b32` registers per thread.
    Regs([Slot; 4]),
}

/// The operands of one `wgmma.mma_async` (`Program::wgmma[i]` of `Op::WgmmaMma { i }`).
#[derive(Clone, Debug)]
pub(crate) struct WgmmaInst {
    /// N of m64nNk16 (8..=256, a multiple of 8).
    pub n: u32,
    pub kind: HalfKind,
    pub acc: AccKind,
    /// N/2 (f32) or N/4 (f16) accumulator registers.
    pub d: Vec<Slot>,
    pub a: ASrc,
    /// B's descriptor.
    pub b: Slot,
    /// Predicate (or constant) slot: accumulate into D when bit 0 is set.
    pub scale_d: Slot,
    pub neg_a: bool,
    pub neg_b: bool,
    /// MN-major A (`imm-trans-a` = 1; descriptor form only).
    pub trans_a: bool,
    /// MN-major B (`imm-trans-b` = 1).
    pub trans_b: bool,
}

impl WgmmaInst {
    /// A's registers (empty for a descriptor A).
    pub(crate) fn a_regs(&self) -> &[Slot] {
        match &self.a {
            ASrc::Regs(r) => r,
            ASrc::Desc(_) => &[],
        }
    }
    /// Every slot the instruction reads (D is read when `scale-d` may be true).
    pub(crate) fn sources(&self, mut push: impl FnMut(Slot)) {
        self.d.iter().for_each(|&s| push(s));
        match self.a {
            ASrc::Desc(s) => push(s),
            ASrc::Regs(r) => r.iter().for_each(|&s| push(s)),
        }
        push(self.b);
        push(self.scale_d);
    }
}

/// A decoded matrix descriptor (byte quantities).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Desc {
    pub start: u32,
    pub lbo: u32,
    pub sbo: u32,
    pub base_offset: u32,
    pub swizzle: Swizzle,
}

impl Desc {
    pub(crate) fn decode(v: u64) -> Desc {
        let field = |lo: u32| ((v >> lo) & 0x3FFF) as u32 * 16;
        Desc {
            start: field(0),
            lbo: field(16),
            sbo: field(32),
            base_offset: ((v >> 49) & 7) as u32,
            swizzle: match v >> 62 {
                0 => Swizzle::None,
                1 => Swizzle::B128,
                2 => Swizzle::B64,
                _ => Swizzle::B32,
            },
        }
    }

    /// Shared-memory address (swizzled) of the 16-byte chunk of 8 consecutive elements that
    /// holds, for a K-major operand, row `mn` and columns `8 kc .. 8 kc + 8` (`kc` = 0, 1), for
    /// an MN-major one, column `k` (`kc` = k, 0..16) and rows `8 (mn / 8) .. 8 (mn / 8) + 8`.
    pub(crate) fn chunk(&self, mn_major: bool, mn: u32, kc: u32) -> u32 {
        let s = self.swizzle.span();
        let off = if !mn_major {
            let (r, mi) = (mn % 8, mn / 8);
            match self.swizzle {
                Swizzle::None => r * 16 + mi * self.sbo + kc * self.lbo,
                _ => r * s + mi * self.sbo + kc * 16,
            }
        } else {
            let (mc, r, kj) = (mn / 8, kc % 8, kc / 8);
            match self.swizzle {
                Swizzle::None => mc * self.sbo + r * 16 + kj * self.lbo,
                _ => {
                    let per = s / 16;
                    (mc % per) * 16 + (mc / per) * self.lbo + r * s + kj * self.sbo
                }
            }
        };
        self.swizzle.apply(self.start.wrapping_add(off))
    }
}

/// Reads an operand of `rows` x 16 elements (A: 64 rows of M; B: N rows, i.e. B transposed,
/// `m[n][k]` = B[k][n]) through descriptor `d`; `read(addr)` returns the 16 shared bytes at
/// `addr` (or the reason it may not).
pub(crate) fn load_operand<E>(
    d: &Desc,
    mn_major: bool,
    rows: u32,
    kind: HalfKind,
    neg: bool,
    mut read: impl FnMut(u32) -> Result<[u8; 16], E>,
) -> Result<Vec<[f64; 16]>, E> {
    let sign = if neg { -1.0 } else { 1.0 };
    let val = |b: &[u8; 16], i: usize| sign * kind.to_f64(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]));
    let mut m = vec![[0f64; 16]; rows as usize];
    if !mn_major {
        for mn in 0..rows {
            for kc in 0..2 {
                let b = read(d.chunk(false, mn, kc))?;
                for i in 0..8 {
                    m[mn as usize][8 * kc as usize + i] = val(&b, i);
                }
            }
        }
    } else {
        for mc in 0..rows / 8 {
            for k in 0..16 {
                let b = read(d.chunk(true, 8 * mc, k))?;
                for i in 0..8 {
                    m[8 * mc as usize + i][k as usize] = val(&b, i);
                }
            }
        }
    }
    Ok(m)
}

/// Row and column of accumulator element `i` of `lane` in warp `w` (f32 numbering: element i is
/// register i; for f16 accumulators register r holds elements 2r and 2r + 1).
#[inline]
pub(crate) fn d_elem(w: usize, lane: usize, i: usize) -> (usize, usize) {
    (16 * w + lane / 4 + 8 * ((i / 2) % 2), 8 * (i / 4) + 2 * (lane % 4) + i % 2)
}

/// Row and column of the low half of A register `r` (0..4) of `lane` in warp `w` (the high
/// half is the next column).
#[inline]
pub(crate) fn a_elem(w: usize, lane: usize, r: usize) -> (usize, usize) {
    (16 * w + lane / 4 + 8 * (r % 2), 2 * (lane % 4) + 8 * (r / 2))
}

/// Fills rows `16 w .. 16 w + 16` of `a` (64 x 16) from warp `w`'s A registers.
pub(crate) fn gather_a_regs(
    kind: HalfKind,
    neg: bool,
    w: usize,
    regs: &[[u64; 32]],
    slots: &[Slot; 4],
    a: &mut [[f64; 16]],
) {
    let sign = if neg { -1.0 } else { 1.0 };
    for (r, &s) in slots.iter().enumerate() {
        for (lane, &v) in regs[s as usize].iter().enumerate() {
            let (row, col) = a_elem(w, lane, r);
            a[row][col] = sign * kind.to_f64(v as u16);
            a[row][col + 1] = sign * kind.to_f64((v >> 16) as u16);
        }
    }
}

/// The slot of accumulator element `i` and the bit position of its value in it.
#[inline]
fn d_slot(inst: &WgmmaInst, i: usize) -> (Slot, u32) {
    match inst.acc {
        AccKind::F32 => (inst.d[i], 0),
        AccKind::F16 => (inst.d[i / 2], 16 * (i % 2) as u32),
    }
}

/// Reads warp `w`'s accumulator registers into rows `16 w .. 16 w + 16` of `acc` (64 x N,
/// row-major).
pub(crate) fn gather_d(inst: &WgmmaInst, w: usize, regs: &[[u64; 32]], acc: &mut [f64]) {
    let n = inst.n as usize;
    for i in 0..n / 2 {
        let (slot, shift) = d_slot(inst, i);
        for (lane, &x) in regs[slot as usize].iter().enumerate() {
            let v = match inst.acc {
                AccKind::F32 => f32::from_bits(x as u32) as f64,
                AccKind::F16 => half::f16::from_bits((x >> shift) as u16).to_f64(),
            };
            let (row, col) = d_elem(w, lane, i);
            acc[row * n + col] = v;
        }
    }
}

/// Writes rows `16 w .. 16 w + 16` of `acc`, rounded once, to warp `w`'s accumulator registers.
pub(crate) fn scatter_d(inst: &WgmmaInst, w: usize, regs: &mut [[u64; 32]], acc: &[f64]) {
    let n = inst.n as usize;
    for i in 0..n / 2 {
        let (slot, shift) = d_slot(inst, i);
        for (lane, x) in regs[slot as usize].iter_mut().enumerate() {
            let (row, col) = d_elem(w, lane, i);
            let v = acc[row * n + col];
            *x = match inst.acc {
                AccKind::F32 => (v as f32).to_bits() as u64,
                AccKind::F16 => {
                    let h = half::f16::from_f64(v).to_bits() as u64;
                    ((*x & !(0xFFFF << shift)) | h << shift) & 0xFFFF_FFFF
                }
            };
        }
    }
}

/// `acc[m][n] += sum_k a[m][k] bt[n][k]`, k in order, in f64 (`acc` 64 x N row-major).
pub(crate) fn product(a: &[[f64; 16]], bt: &[[f64; 16]], acc: &mut [f64]) {
    let n = bt.len();
    for (m, ar) in a.iter().enumerate() {
        let row = &mut acc[m * n..(m + 1) * n];
        for (x, br) in row.iter_mut().zip(bt) {
            let mut s = *x;
            for k in 0..16 {
                s += ar[k] * br[k];
            }
            *x = s;
        }
    }
}

/// The shared-memory bytes one `wgmma.mma_async` read, kept until a `wgmma.wait_group` retires
/// it, to report stores into them before that.
pub(crate) struct Snapshot {
    /// Instruction index of the `wgmma.mma_async`.
    pub pc: u32,
    /// Warpgroup that issued it.
    pub group: u32,
    /// Shared offset and the 16 bytes read there.
    pub chunks: Vec<(u32, [u8; 16])>,
    /// Compared already (by the first warp of the warpgroup to retire it).
    pub checked: AtomicBool,
}

impl Snapshot {
    /// The first chunk whose bytes in `shared` differ from what the instruction read:
    /// `(offset of the first changed byte, that byte then)`.
    pub(crate) fn changed(&self, shared: &[u8]) -> Option<u32> {
        if self.checked.swap(true, Ordering::Relaxed) {
            return None;
        }
        for &(off, b) in &self.chunks {
            let now = &shared[off as usize..off as usize + 16];
            if let Some(i) = now.iter().zip(&b).position(|(x, y)| x != y) {
                return Some(off + i as u32);
            }
        }
        None
    }
}

/// One `wgmma.mma_async` a warp has issued and no `wgmma.wait_group` has retired.
struct InFlight {
    pc: u32,
    /// Its wgmma-group: the number of `wgmma.commit_group`s the warp had executed before it.
    group: u32,
    /// Index into `Program::wgmma`.
    inst: u32,
    snap: Arc<Snapshot>,
}

/// Why a `wgmma.mma_async` or an ordinary instruction may not touch a register now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Hazard {
    /// The warp executed no `wgmma.fence` before this `wgmma.mma_async`.
    NoFence,
    /// `slot`, an operand register, was accessed by the ordinary instruction at `pc` after the
    /// warp's last `wgmma.fence`.
    Unfenced { slot: Slot, pc: u32 },
    /// `slot` belongs to the in-flight `wgmma.mma_async` at `pc` (an accumulator when `acc`,
    /// else an A fragment register).
    InFlight { slot: Slot, pc: u32, acc: bool },
}

/// Per warp: the `wgmma` state the ISA leaves to the program to get right.
#[derive(Default)]
pub(crate) struct WarpTrack {
    fenced: bool,
    /// Per slot: 1 + the instruction that last accessed it since the last `wgmma.fence`, for the
    /// slots some `wgmma.mma_async` uses as D or A (0: none).
    dirty: Vec<u32>,
    dirty_list: Vec<Slot>,
    /// Per slot: 1 + the instruction index of the latest in-flight `wgmma.mma_async` using it as
    /// D or A (0: free).
    lock_pc: Vec<u32>,
    inflight: Vec<InFlight>,
    /// `wgmma.commit_group`s executed.
    open: u32,
}

impl WarpTrack {
    /// Fresh state for a block of a program with `nslots` slots (0: no wgmma in the program).
    pub(crate) fn reset(&mut self, nslots: usize) {
        self.fenced = false;
        self.dirty.clear();
        self.dirty.resize(nslots, 0);
        self.dirty_list.clear();
        self.lock_pc.clear();
        self.lock_pc.resize(nslots, 0);
        self.inflight.clear();
        self.open = 0;
    }

    /// An ordinary instruction at `pc` accesses the wgmma operand registers `slots`.
    #[inline]
    pub(crate) fn access(&mut self, prog: &Program, slots: &[Slot], pc: u32) -> Result<(), Hazard> {
        for &s in slots {
            let l = self.lock_pc[s as usize];
            if l != 0 {
                let holder = l - 1;
                let acc = wgmma_of(prog, holder).is_some_and(|w| w.d.contains(&s));
                return Err(Hazard::InFlight { slot: s, pc: holder, acc });
            }
            if self.dirty[s as usize] == 0 {
                self.dirty_list.push(s);
            }
            self.dirty[s as usize] = pc + 1;
        }
        Ok(())
    }

    pub(crate) fn fence(&mut self) {
        self.fenced = true;
        for &s in &self.dirty_list {
            self.dirty[s as usize] = 0;
        }
        self.dirty_list.clear();
    }

    pub(crate) fn commit(&mut self) {
        self.open += 1;
    }

    /// May `inst` (at `pc`) issue? Checks the fence and the in-flight registers.
    pub(crate) fn check_issue(&self, prog: &Program, inst: &WgmmaInst) -> Result<(), Hazard> {
        if !self.fenced {
            return Err(Hazard::NoFence);
        }
        for (&s, is_acc) in inst.d.iter().map(|s| (s, true)).chain(inst.a_regs().iter().map(|s| (s, false))) {
            let d = self.dirty[s as usize];
            if d != 0 {
                return Err(Hazard::Unfenced { slot: s, pc: d - 1 });
            }
            let l = self.lock_pc[s as usize];
            if l != 0 {
                let holder = l - 1;
                let Some(h) = wgmma_of(prog, holder) else { continue };
                let held_acc = h.d.contains(&s);
                // Accumulating into the accumulator of an in-flight wgmma of the same shape is
                // ordered by the hardware; so is reading the same A registers again.
                let fine = if is_acc {
                    held_acc && h.n == inst.n && h.acc == inst.acc && h.kind == inst.kind
                } else {
                    !held_acc
                };
                if !fine {
                    return Err(Hazard::InFlight { slot: s, pc: holder, acc: held_acc });
                }
            }
        }
        Ok(())
    }

    /// Records `inst` (`Program::wgmma[i]`, at `pc`) as issued and in flight.
    pub(crate) fn issue(&mut self, inst: &WgmmaInst, i: u32, pc: u32, snap: Arc<Snapshot>) {
        for &s in inst.d.iter().chain(inst.a_regs()) {
            self.lock_pc[s as usize] = pc + 1;
        }
        self.inflight.push(InFlight { pc, group: self.open, inst: i, snap });
    }

    /// `wgmma.wait_group n`: retires the wgmma-groups but the `n` most recent committed ones;
    /// returns the snapshots of what it retired.
    pub(crate) fn wait(&mut self, prog: &Program, n: u32) -> Vec<Arc<Snapshot>> {
        let open = self.open;
        let mut done = Vec::new();
        self.inflight.retain(|f| {
            // Committed groups are 0..open; keep the n most recent and the uncommitted ones.
            let retire = f.group + n < open;
            if retire {
                done.push(f.snap.clone());
            }
            !retire
        });
        if !done.is_empty() {
            for s in self.lock_pc.iter_mut() {
                *s = 0;
            }
            for f in &self.inflight {
                let w = &prog.wgmma[f.inst as usize];
                for &s in w.d.iter().chain(w.a_regs()) {
                    self.lock_pc[s as usize] = f.pc + 1;
                }
            }
        }
        done
    }
}

/// The operands of the `wgmma.mma_async` at `pc`.
fn wgmma_of(prog: &Program, pc: u32) -> Option<&WgmmaInst> {
    match prog.insts.get(pc as usize)?.op {
        Op::WgmmaMma { i } => prog.wgmma.get(i as usize),
        _ => None,
    }
}

/// What the executor needs per program to check ordinary instructions cheaply.
pub(crate) struct ProgInfo {
    /// Per instruction: the registers some `wgmma.mma_async` uses as D or A that this
    /// (ordinary) instruction reads or writes; empty for most, and for the wgmma instructions.
    pub touched: Vec<Box<[Slot]>>,
}

impl ProgInfo {
    pub(crate) fn build(prog: &Program) -> ProgInfo {
        let mut wg = vec![false; prog.nslots];
        for w in &prog.wgmma {
            for &s in w.d.iter().chain(w.a_regs()) {
                wg[s as usize] = true;
            }
        }
        let mut always = vec![0u64; prog.nslots.div_ceil(64)];
        let touched = prog
            .insts
            .iter()
            .map(|inst| {
                if matches!(inst.op, Op::WgmmaMma { .. } | Op::WgmmaFence | Op::WgmmaCommit | Op::WgmmaWait { .. }) {
                    return Box::default();
                }
                let mut s = Vec::new();
                crate::reginit::sources(&inst.op, prog, &mut s, &mut always);
                s.extend(inst.op.dsts());
                s.push(inst.guard);
                s.retain(|&x| x != NONE && (x as usize) < wg.len() && wg[x as usize]);
                s.sort_unstable();
                s.dedup();
                s.into_boxed_slice()
            })
            .collect();
        ProgInfo { touched }
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    pub fn descriptor_fields() {
        let v: u64 = (0x1234 >> 4) | (3 << 16) | (64u64 << 32) | (1u64 << 62);
        let d = Desc::decode(v);
        assert_eq!(d, Desc { start: 0x1230, lbo: 48, sbo: 1024, base_offset: 0, swizzle: Swizzle::B128 });
        assert_eq!(Desc::decode(2u64 << 62).swizzle, Swizzle::B64);
        assert_eq!(Desc::decode(3u64 << 62).swizzle, Swizzle::B32);
        assert_eq!(Desc::decode(5u64 << 49).base_offset, 5);
    }

    pub fn fragment_maps_cover_the_tile_once() {
        let mut seen = vec![0u8; 64 * 256];
        for w in 0..4 {
            for lane in 0..32 {
                for i in 0..128 {
                    let (r, c) = d_elem(w, lane, i);
                    seen[r * 256 + c] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&x| x == 1));
        let mut seen = [0u8; 64 * 16];
        for w in 0..4 {
            for lane in 0..32 {
                for r in 0..4 {
                    let (row, col) = a_elem(w, lane, r);
                    seen[row * 16 + col] += 1;
                    seen[row * 16 + col + 1] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&x| x == 1));
    }
}
