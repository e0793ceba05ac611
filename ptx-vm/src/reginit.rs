//! Which register slots a warp must zero when a block starts.
//!
//! A warp's registers read as zero until written. Zeroing the whole register file for every
//! warp of every block cost the tensor-core kernels a large share of their time (thousands of
//! SSA registers of 256 bytes each, most of which a thread writes before it reads them). A
//! backward liveness pass over the kernel's control-flow graph finds the slots some path from the
//! entry may read before an unconditional write by the same thread: only those are zeroed. A
//! slot that is not live at the entry is written on every path before any read, so its value
//! at block start is never observed. Slots read across lanes (`shfl`'s source, which may come
//! from a lane that is not executing the instruction) are always zeroed. Constant and special
//! slots keep their values between blocks of the same program and are never written.
//!
//! Calls are modelled context-insensitively: a call continues at the callee's entry, and every
//! `ret` may return to every call site (more paths than any thread takes, which can only make
//! more slots live, i.e. zeroed). Parameter copies count as reads of their sources.

use crate::ir::{Inst, Op, Program, Slot, NONE};

/// The slots to zero at block start, sorted, or `None` when the whole file must be zeroed.
pub(crate) fn zero_slots(prog: &Program) -> Option<Vec<Slot>> {
    let f = Flow::build(prog)?;
    let entry = f.live_in(0);
    Some((0..prog.nslots as Slot).filter(|&s| !f.fixed[s as usize] && (get(entry, s) || get(&f.always, s))).collect())
}

/// Whether bit `s` of the bit set `v` is set.
pub(crate) fn get(v: &[u64], s: Slot) -> bool {
    v[s as usize / 64] >> (s % 64) & 1 == 1
}

/// Sets bit `s` of the bit set `v`.
pub(crate) fn set(v: &mut [u64], s: Slot) {
    v[s as usize / 64] |= 1 << (s % 64);
}

/// The slots in the bit set `v`, ascending.
pub(crate) fn bits(v: &[u64]) -> impl Iterator<Item = Slot> + '_ {
    v.iter().enumerate().flat_map(|(w, &word)| {
        std::iter::successors((word != 0).then_some(word), |&b| Some(b & (b - 1)).filter(|&b| b != 0))
            .map(move |b| (w * 64) as Slot + b.trailing_zeros())
    })
}

/// A program's control flow and the liveness of its slots (one thread's paths).
pub(crate) struct Flow {
    /// Words of a slot bit set.
    pub words: usize,
    /// Per slot: a constant or special (written when the warp starts, never by an instruction).
    pub fixed: Vec<bool>,
    /// The slots an instruction may read from lanes that do not execute it (`shfl`'s source).
    pub always: Vec<u64>,
    /// Per instruction: the slots it reads for its own lane (its guard included).
    pub srcs: Vec<Vec<Slot>>,
    /// First instruction of every basic block (ascending).
    pub starts: Vec<usize>,
    /// Per block: the blocks control may go to next.
    pub bsucc: Vec<Vec<usize>>,
    /// Per block: the slots live at its start (a bit set of `words`).
    live: Vec<u64>,
}

impl Flow {
    /// `None` when an instruction names a slot outside the file or writes a constant.
    pub fn build(prog: &Program) -> Option<Flow> {
        let n = prog.insts.len();
        let nslots = prog.nslots;
        let words = nslots.div_ceil(64);
        let mut fixed = vec![false; nslots];
        for &(s, _) in &prog.consts {
            fixed[s as usize] = true;
        }
        for &(s, _) in &prog.specials {
            fixed[s as usize] = true;
        }
        // Per instruction: sources, unconditional destinations, successors.
        let mut always = vec![0u64; words];
        let mut srcs: Vec<Vec<Slot>> = Vec::with_capacity(n);
        let mut defs: Vec<Vec<Slot>> = Vec::with_capacity(n);
        for inst in &prog.insts {
            let mut s = Vec::new();
            sources(&inst.op, prog, &mut s, &mut always);
            if inst.guard != NONE {
                s.push(inst.guard);
            }
            let d: Vec<Slot> = inst.op.dsts();
            if d.iter().any(|&x| (x as usize) >= nslots || fixed[x as usize]) || s.iter().any(|&x| x as usize >= nslots)
            {
                return None;
            }
            srcs.push(s);
            defs.push(if inst.guard == NONE { d } else { Vec::new() });
        }
        // Where a `ret` may continue: after every call (a `ret` with an empty stack exits).
        let returns: Vec<usize> = prog
            .insts
            .iter()
            .enumerate()
            .filter(|(_, i)| matches!(i.op, Op::Call { .. }))
            .map(|(pc, _)| pc + 1)
            .collect();
        let succ = |pc: usize, inst: &Inst| -> Vec<usize> {
            let next = (pc + 1 < n).then_some(pc + 1);
            let guarded = inst.guard != NONE;
            let mut v: Vec<usize> = match inst.op {
                Op::Bra { t } | Op::Call { t, .. } => vec![t as usize],
                Op::Ret if prog.has_calls => returns.clone(),
                Op::Exit | Op::Ret | Op::Trap => vec![],
                _ => next.into_iter().collect(),
            };
            if guarded && matches!(inst.op, Op::Bra { .. } | Op::Call { .. } | Op::Ret | Op::Exit | Op::Trap) {
                v.extend(next);
            }
            v.retain(|&t| t < n);
            v
        };
        // Basic blocks: leaders at 0, branch and call targets and after every control transfer.
        let mut leader = vec![false; n + 1];
        leader[0] = true;
        leader[n] = true;
        for (pc, inst) in prog.insts.iter().enumerate() {
            if let Op::Bra { t } | Op::Call { t, .. } = inst.op {
                if (t as usize) < n {
                    leader[t as usize] = true;
                }
            }
            if matches!(inst.op, Op::Bra { .. } | Op::Call { .. } | Op::Exit | Op::Ret | Op::Trap) {
                leader[pc + 1] = true;
            }
        }
        let starts: Vec<usize> = (0..n).filter(|&pc| leader[pc]).collect();
        let mut block_of = vec![0usize; n];
        for (b, &s) in starts.iter().enumerate() {
            let end = starts.get(b + 1).copied().unwrap_or(n);
            block_of[s..end].fill(b);
        }
        let nb = starts.len();
        // use = read before any unconditional write in the block; def = unconditionally written.
        let mut uses = vec![0u64; nb * words];
        let mut kill = vec![0u64; nb * words];
        let mut bsucc: Vec<Vec<usize>> = vec![Vec::new(); nb];
        for (b, &s) in starts.iter().enumerate() {
            let end = starts.get(b + 1).copied().unwrap_or(n);
            let (u, k) = (&mut uses[b * words..(b + 1) * words], &mut kill[b * words..(b + 1) * words]);
            for pc in s..end {
                for &x in &srcs[pc] {
                    if !get(k, x) {
                        set(u, x);
                    }
                }
                for &x in &defs[pc] {
                    set(k, x);
                }
            }
            for t in succ(end - 1, &prog.insts[end - 1]) {
                bsucc[b].push(block_of[t]);
            }
        }
        // live_in = use | (live_out & !kill), iterated to a fixed point (blocks in reverse order).
        let mut live = vec![0u64; nb * words];
        let mut out = vec![0u64; words];
        loop {
            let mut changed = false;
            for b in (0..nb).rev() {
                out.fill(0);
                for &t in &bsucc[b] {
                    for (o, l) in out.iter_mut().zip(&live[t * words..(t + 1) * words]) {
                        *o |= l;
                    }
                }
                for w in 0..words {
                    let v = uses[b * words + w] | (out[w] & !kill[b * words + w]);
                    if v != live[b * words + w] {
                        live[b * words + w] = v;
                        changed = true;
                    }
                }
            }
            if !changed {
                break;
            }
        }
        Some(Flow { words, fixed, always, srcs, starts, bsucc, live })
    }

    /// The slots live at the start of block `b`.
    pub fn live_in(&self, b: usize) -> &[u64] {
        &self.live[b * self.words..(b + 1) * self.words]
    }

    /// The slots live at the end of block `b` (live at the start of a block after it).
    pub fn live_out(&self, b: usize) -> Vec<u64> {
        let mut out = vec![0u64; self.words];
        for &t in &self.bsucc[b] {
            for (o, l) in out.iter_mut().zip(self.live_in(t)) {
                *o |= l;
            }
        }
        out
    }
}

/// Pushes the slots `op` reads for the executing thread's own lane onto `out`, and marks in
/// `always` the slots it may read from other lanes.
pub(crate) fn sources(op: &Op, prog: &Program, out: &mut Vec<Slot>, always: &mut [u64]) {
    let mut push = |s: Slot| {
        if s != NONE {
            out.push(s);
        }
    };
    // Every variant named: a new instruction must say what it reads.
    match *op {
        Op::Nop
        | Op::Bra { .. }
        | Op::Ret
        | Op::Exit
        | Op::Trap
        | Op::Bar
        | Op::BarWarp
        | Op::Activemask { .. }
        | Op::Clock { .. }
        | Op::CpCommit
        | Op::CpWait { .. }
        | Op::WgmmaFence
        | Op::WgmmaCommit
        | Op::WgmmaWait { .. } => {}
        Op::Hopper { i, .. } => prog.hopper[i as usize].sources().into_iter().for_each(push),
        Op::Elect { mask, .. } => push(mask),
        Op::NamedBar { id, count, .. } => {
            push(id);
            push(count);
        }
        Op::Call { copies, .. } | Op::CallRet { copies } => {
            prog.copies[copies as usize].iter().for_each(|&(s, _)| push(s))
        }
        Op::Mov { a, .. } | Op::Un { a, .. } | Op::FUn32 { a, .. } | Op::FUn64 { a, .. } | Op::Cvt { a, .. } => push(a),
        Op::Bin { a, b, .. }
        | Op::AddF32 { a, b, .. }
        | Op::MulF32 { a, b, .. }
        | Op::FBin32 { a, b, .. }
        | Op::FBin64 { a, b, .. } => {
            push(a);
            push(b);
        }
        Op::Ter { a, b, c, .. }
        | Op::FmaF32 { a, b, c, .. }
        | Op::Fma32 { a, b, c, .. }
        | Op::Fma64 { a, b, c, .. } => {
            push(a);
            push(b);
            push(c);
        }
        Op::Quad { a, b, c, e, .. } => {
            push(a);
            push(b);
            push(c);
            push(e);
        }
        Op::Setp { a, b, c, .. } | Op::Set { a, b, c, .. } => {
            push(a);
            push(b);
            push(c);
        }
        Op::Selp { a, b, p, .. } => {
            push(a);
            push(b);
            push(p);
        }
        Op::Pack { parts, n, .. } => parts[..n as usize].iter().for_each(|&s| push(s)),
        Op::Unpack { a, .. } => push(a),
        Op::Ld { a, .. } => push(a),
        Op::St { srcs, n, a, .. } => {
            push(a);
            srcs[..n as usize].iter().for_each(|&s| push(s));
        }
        Op::LdSlot { size, n, base, off, .. } => {
            (0..n as u32).for_each(|k| push(base + (off + k * size as u32) / 8));
        }
        Op::StSlot { size, n, srcs, base, off } => {
            // A partial write: the slot's other bytes are read.
            (0..n as u32).for_each(|k| push(base + (off + k * size as u32) / 8));
            srcs[..n as usize].iter().for_each(|&s| push(s));
        }
        Op::Atom { a, b, c, .. } => {
            push(a);
            push(b);
            push(c);
        }
        Op::Shfl { a, b, c, mask, .. } => {
            push(a);
            push(b);
            push(c);
            push(mask);
            if let Some(w) = always.get_mut(a as usize / 64).filter(|_| a != NONE) {
                *w |= 1 << (a % 64);
            }
        }
        Op::Vote { a, mask, .. } | Op::Redux { a, mask, .. } | Op::Match { a, mask, .. } => {
            push(a);
            push(mask);
        }
        Op::CpAsync { d, a, n, .. } => {
            push(d);
            push(a);
            push(n);
        }
        Op::Ldmatrix { a, .. } => push(a),
        Op::Mma { srcs, .. } => {
            let s = &prog.mma_srcs[srcs as usize];
            s.a.iter().chain(&s.b).chain(&s.c).for_each(|&x| push(x));
        }
        Op::WgmmaMma { i } => prog.wgmma[i as usize].sources(push),
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use crate::{LaunchConfig, Module, Vm};

    /// A register that only block 0 writes (predicated) reads as zero in the blocks after it on
    /// the same warp, with or without garbage in the slots the pass leaves alone.
    pub fn a_register_written_on_some_paths_reads_zero_in_later_blocks() {
        let ptx = ".version 7.0\n.target sm_80\n.address_size 64\n\
            .visible .entry k(.param .u64 out)\n{\n\
            .reg .pred %p<2>;\n.reg .b32 %r<8>;\n.reg .b64 %rd<4>;\n\
            ld.param.u64 %rd0, [out];\n mov.u32 %r1, %ctaid.x;\n setp.eq.u32 %p1, %r1, 0;\n\
            @%p1 mov.u32 %r2, 7;\n mov.u32 %r3, 5;\n add.u32 %r4, %r3, 1;\n\
            mul.wide.u32 %rd1, %r1, 4;\n add.u64 %rd2, %rd0, %rd1;\n st.global.u32 [%rd2], %r2;\n\
            st.global.u32 [%rd2+16], %r4;\n ret;\n}\n";
        let m = Module::load(ptx).unwrap();
        let z = m.program("k").unwrap().zero_slots().unwrap().to_vec();
        assert_eq!(z.len(), 1, "only %r2 may be read before it is written: {z:?}");
        for poison in [false, true] {
            let mut vm = Vm::with_workers(1);
            vm.poison_registers = poison;
            let out = vm.alloc(32).unwrap();
            for _ in 0..2 {
                vm.launch(&m, "k", &LaunchConfig::new([4, 1, 1], [32, 1, 1], 0), &out.to_le_bytes()).unwrap();
                let mut b = [0u8; 32];
                vm.read(out, &mut b).unwrap();
                let w: Vec<u32> = b.chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
                assert_eq!(w, [7, 0, 0, 0, 6, 6, 6, 6], "poison {poison}");
            }
        }
    }

    /// The committed flash kernels (SIMT f32 and tensor-core bf16, forward and backward) and
    /// the decode kernels give the same bytes when the slots the pass leaves alone start with
    /// garbage, and the pass covers every entry (calls included).
    pub fn committed_kernels_ignore_the_registers_they_write_first() {
        use kernels_gpu::tiles::{FLASH_F32_D64, FLASH_MMA_D64};
        let m = Module::load(kernels_gpu::artifacts::PTX).unwrap();
        for name in m.kernel_names() {
            assert!(m.program(&name).unwrap().zero_slots().is_some(), "{name}");
        }
        let (heads, seq, d) = (2u32, 80u32, 64u32);
        let n = (heads * seq * d) as usize;
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        let inputs: Vec<f32> = (0..3 * n).map(|_| rnd()).collect();
        for (kernel, bf16, dims) in [
            ("flash_fwd_f32_d64", false, FLASH_F32_D64.launch(1, heads, seq)),
            ("flash_fwd_bf16_d64", true, FLASH_MMA_D64.launch(1, heads, seq)),
        ] {
            let mut outs = Vec::new();
            for poison in [false, true] {
                let mut vm = Vm::with_workers(1);
                vm.poison_registers = poison;
                let eb = if bf16 { 2 } else { 4 };
                let enc: Vec<u8> = inputs
                    .iter()
                    .flat_map(|&v| {
                        if bf16 {
                            half::bf16::from_f32(v).to_le_bytes().to_vec()
                        } else {
                            v.to_le_bytes().to_vec()
                        }
                    })
                    .collect();
                let bufs: Vec<u64> = (0..4).map(|_| vm.alloc((n * eb) as u64).unwrap()).collect();
                for (i, b) in bufs.iter().take(3).enumerate() {
                    vm.write(*b, &enc[i * n * eb..(i + 1) * n * eb]).unwrap();
                }
                let lse = vm.alloc((heads * seq * 4) as u64).unwrap();
                let p = crate::test_params::causal_bshd([bufs[0], bufs[1], bufs[2], bufs[3]], lse, heads, seq, d);
                let cfg = LaunchConfig::new(dims.grid, dims.block, dims.dynamic_smem_bytes);
                let mut out = vec![0u8; n * eb + (heads * seq * 4) as usize];
                // Twice: the second launch finds the first one's values in the register files.
                for _ in 0..2 {
                    vm.launch(&m, kernel, &cfg, &p.to_bytes()).unwrap();
                    vm.read(bufs[3], &mut out[..n * eb]).unwrap();
                    vm.read(lse, &mut out[n * eb..]).unwrap();
                }
                outs.push(out);
            }
            assert!(outs[0] == outs[1], "{kernel}: garbage in the registers it writes first changed its output");
        }
    }
}
