//! Register slots shared by values whose lives do not overlap.
//!
//! rustc's PTX gives almost every value a virtual register of its own (SSA form): the
//! tensor-core decode kernel names 1,470 of them. The executor keeps 32 lanes × 8 bytes per
//! slot, so one warp's register file was 376 KB, a block's several times the host CPU's L2
//! cache, and every instruction's operands came from farther away than they need to. At any one
//! point a thread holds far fewer live values. This pass gives every register a slot such that
//! two registers share a slot only when their live ranges do not meet: each register's range is
//! one interval in program order that covers every instruction naming it and every block it is
//! live into or out of (the liveness of [`crate::reginit::Flow`]), and a linear scan over the
//! intervals hands out the slots. Wherever a thread holds a value that some path reads later,
//! its register's interval covers that instruction, so no other register written there shares
//! its slot. Then every thread reads, at every instruction, the value it read before: the
//! result, every check and every finding are those of the program as written. (A graph colouring
//! of the exact interference needs fewer slots, 448 instead of 650 for the bf16 forward, but
//! took four times as long to compute and ran no faster.)
//!
//! Kept as they are (a slot of their own each): constants and special registers (set when the
//! warp starts), `shfl` sources (read from lanes that may not execute the instruction, whose
//! value is whatever the slot holds), and every slot an instruction names for a use the
//! liveness does not see. An instruction's destinations never share a slot with its own other
//! operands, so no executor path depends on the order in which it reads sources and writes
//! destinations. Call parameters, return values and `.param` variables (copied by calls, indexed
//! from their first slot) keep their slots too, in order. Calls follow
//! [`crate::reginit`]'s model (every `ret` may return to every call site: more paths than any
//! thread takes, so longer live ranges, never shorter). Programs with `wgmma` or the Hopper
//! instructions are not packed (their register bookkeeping names slots).
//!
//! A traced launch runs the program as written: its trace names registers by slot.

use crate::ir::{Op, Program, Slot, NONE};
use crate::reginit::{bits, get, Flow};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Programs with more slots are not packed (the liveness keeps `slots` bits per block).
const MAX_SLOTS: usize = 1 << 14;

/// The program with its registers packed into fewer slots, or `None` when it is not packed (see
/// the module's text) or packing saves nothing.
pub(crate) fn pack(prog: &Program) -> Option<Program> {
    if !prog.wgmma.is_empty() || !prog.hopper.is_empty() || prog.nslots > MAX_SLOTS {
        return None;
    }
    if prog.insts.iter().any(|i| matches!(i.op, Op::WgmmaMma { .. } | Op::Hopper { .. })) {
        return None;
    }
    let map = assign(prog)?;
    let nslots = map.iter().filter(|&&c| c != NONE).map(|&c| c as usize + 1).max().unwrap_or(0);
    if nslots >= prog.nslots {
        return None;
    }
    let to = |s: &mut Slot| {
        if *s != NONE {
            *s = map[*s as usize];
        }
    };
    let mut insts = prog.insts.clone();
    for inst in &mut insts {
        for_each_slot(&mut inst.op, to);
        to(&mut inst.guard);
    }
    for (k, n) in crate::fuse::runs(&insts).into_iter().enumerate() {
        insts[k].fused = n;
    }
    let mut mma_srcs = prog.mma_srcs.clone();
    for m in &mut mma_srcs {
        m.a.iter_mut().chain(&mut m.b).chain(&mut m.c).for_each(to);
    }
    let mut slot_names = vec![String::new(); nslots];
    for (s, name) in prog.slot_names.iter().enumerate() {
        if map[s] != NONE {
            let n = &mut slot_names[map[s] as usize];
            if !n.is_empty() {
                n.push('|');
            }
            n.push_str(name);
        }
    }
    Some(Program {
        insts,
        texts: prog.texts.clone(),
        nslots,
        consts: prog.consts.iter().map(|&(s, v)| (map[s as usize], v)).collect(),
        specials: prog.specials.iter().map(|&(s, sp)| (map[s as usize], sp)).collect(),
        slot_names,
        copies: prog
            .copies
            .iter()
            .map(|c| c.iter().map(|&(a, b)| (map[a as usize], map[b as usize])).collect())
            .collect(),
        pvars: prog.pvars.iter().map(|&(s, n)| (map[s as usize], n)).collect(),
        info: prog.info.clone(),
        dyn_shared_offset: prog.dyn_shared_offset,
        has_calls: prog.has_calls,
        mma_srcs,
        shfl_perms: prog.shfl_perms.clone(),
        wgmma: Vec::new(),
        wgmma_info: std::sync::OnceLock::new(),
        hopper: Vec::new(),
        uid: crate::ir::next_uid(),
        zero_slots: std::sync::OnceLock::new(),
        packed: std::sync::OnceLock::new(),
    })
}

/// Per slot of `prog`: its slot in the packed program (`NONE`: named by no instruction).
fn assign(prog: &Program) -> Option<Vec<Slot>> {
    let ns = prog.nslots;
    let f = Flow::build(prog)?;
    let n = prog.insts.len();
    // Every slot an instruction names; named but neither read nor written by the liveness'
    // account: a slot of its own.
    let mut named = vec![false; ns];
    let mut seen = vec![false; ns];
    let note = |s: Slot, named: &mut Vec<bool>| {
        if s != NONE {
            named[s as usize] = true;
        }
    };
    for (pc, inst) in prog.insts.iter().enumerate() {
        let mut op = inst.op;
        for_each_slot(&mut op, |s| note(*s, &mut named));
        note(inst.guard, &mut named);
        if let Op::Mma { srcs, .. } = inst.op {
            let m = &prog.mma_srcs[srcs as usize];
            m.a.iter().chain(&m.b).chain(&m.c).for_each(|&s| note(s, &mut named));
        }
        for &s in f.srcs[pc].iter().chain(&inst.op.dsts()) {
            seen[s as usize] = true;
        }
    }
    let mut own: Vec<bool> =
        (0..ns as Slot).map(|s| f.fixed[s as usize] || get(&f.always, s) || !seen[s as usize]).collect();
    // Call parameters and `.param` variables: copied by calls and returns, indexed from their
    // first slot (each keeps its slots, in order).
    for &(base, k) in &prog.pvars {
        for s in base..base + k {
            (own[s as usize], named[s as usize]) = (true, true);
        }
    }
    for &(a, b) in prog.copies.iter().flatten() {
        for s in [a, b] {
            (own[s as usize], named[s as usize]) = (true, true);
        }
    }
    // Each slot's live range in program order, widened to one interval: every instruction that
    // names it, and the first (last) instruction of every block it is live into (out of). Two
    // slots whose intervals do not meet are never live together, nor is one written while the
    // other is live (its instruction lies in both), nor do they meet in one instruction.
    let (mut lo, mut hi) = (vec![u32::MAX; ns], vec![0u32; ns]);
    let mut widen = |s: Slot, pc: usize| {
        lo[s as usize] = lo[s as usize].min(pc as u32);
        hi[s as usize] = hi[s as usize].max(pc as u32);
    };
    for (b, &start) in f.starts.iter().enumerate() {
        let end = f.starts.get(b + 1).copied().unwrap_or(n);
        bits(f.live_in(b)).for_each(|s| widen(s, start));
        bits(&f.live_out(b)).for_each(|s| widen(s, end - 1));
        for pc in start..end {
            f.srcs[pc].iter().chain(&prog.insts[pc].op.dsts()).for_each(|&s| widen(s, pc));
        }
    }
    // Linear scan in order of first instruction: a slot takes the lowest slot number that no
    // interval still open holds; then the slots of their own.
    let mut order: Vec<(u32, u32, Slot)> =
        (0..ns).filter(|&s| !own[s] && lo[s] != u32::MAX).map(|s| (lo[s], hi[s], s as Slot)).collect();
    order.sort_unstable();
    let mut map = vec![NONE; ns];
    let mut open: BinaryHeap<Reverse<(u32, u32)>> = BinaryHeap::new();
    let mut free: BinaryHeap<Reverse<u32>> = BinaryHeap::new();
    let mut colours = 0u32;
    for (start, end, s) in order {
        while let Some(&Reverse((e, c))) = open.peek() {
            if e >= start {
                break;
            }
            open.pop();
            free.push(Reverse(c));
        }
        let c = free.pop().map_or_else(
            || {
                colours += 1;
                colours - 1
            },
            |Reverse(c)| c,
        );
        map[s as usize] = c;
        open.push(Reverse((end, c)));
    }
    for s in 0..ns {
        if own[s] && (named[s] || f.fixed[s]) {
            map[s] = colours;
            colours += 1;
        }
    }
    Some(map)
}

/// Calls `f` on every register slot `op` names (its sources and destinations; the `mma`
/// sources are in [`Program::mma_srcs`]). Every variant is named: a new instruction must say
/// which slots it holds.
pub(crate) fn for_each_slot(op: &mut Op, mut f: impl FnMut(&mut Slot)) {
    let mut g = |s: &mut Slot| {
        if *s != NONE {
            f(s)
        }
    };
    match op {
        Op::Nop
        | Op::Bra { .. }
        | Op::Call { .. }
        | Op::CallRet { .. }
        | Op::Ret
        | Op::Exit
        | Op::Trap
        | Op::Bar
        | Op::BarWarp
        | Op::CpCommit
        | Op::CpWait { .. }
        | Op::WgmmaMma { .. }
        | Op::WgmmaFence
        | Op::WgmmaCommit
        | Op::WgmmaWait { .. } => {}
        Op::Mov { d, a }
        | Op::Un { d, a, .. }
        | Op::FUn32 { d, a, .. }
        | Op::FUn64 { d, a, .. }
        | Op::Cvt { d, a, .. } => [d, a].into_iter().for_each(g),
        Op::Bin { d, a, b, .. }
        | Op::AddF32 { d, a, b }
        | Op::MulF32 { d, a, b }
        | Op::FBin32 { d, a, b, .. }
        | Op::FBin64 { d, a, b, .. } => [d, a, b].into_iter().for_each(g),
        Op::Ter { d, a, b, c, .. }
        | Op::FmaF32 { d, a, b, c }
        | Op::Fma32 { d, a, b, c, .. }
        | Op::Fma64 { d, a, b, c, .. }
        | Op::Set { d, a, b, c, .. }
        | Op::Atom { d, a, b, c, .. } => [d, a, b, c].into_iter().for_each(g),
        Op::Quad { d, a, b, c, e, .. } => [d, a, b, c, e].into_iter().for_each(g),
        Op::Setp { d, d2, a, b, c, .. } => [d, d2, a, b, c].into_iter().for_each(g),
        Op::Selp { d, a, b, p } => [d, a, b, p].into_iter().for_each(g),
        Op::Pack { d, parts, n, .. } => {
            g(d);
            parts[..*n as usize].iter_mut().for_each(g);
        }
        Op::Unpack { ds, n, a, .. } | Op::Ld { ds, n, a, .. } => {
            ds[..*n as usize].iter_mut().for_each(&mut g);
            g(a);
        }
        Op::St { srcs, n, a, .. } => {
            srcs[..*n as usize].iter_mut().for_each(&mut g);
            g(a);
        }
        Op::LdSlot { ds, n, base, .. } => {
            ds[..*n as usize].iter_mut().for_each(&mut g);
            g(base);
        }
        Op::StSlot { srcs, n, base, .. } => {
            srcs[..*n as usize].iter_mut().for_each(&mut g);
            g(base);
        }
        Op::NamedBar { id, count, .. } => [id, count].into_iter().for_each(g),
        Op::Shfl { d, p, a, b, c, mask, .. } => [d, p, a, b, c, mask].into_iter().for_each(g),
        Op::Vote { d, a, mask, .. } | Op::Redux { d, a, mask, .. } => [d, a, mask].into_iter().for_each(g),
        Op::Activemask { d } | Op::Clock { d } | Op::Hopper { d, .. } => g(d),
        Op::Match { d, p, a, mask, .. } => [d, p, a, mask].into_iter().for_each(g),
        Op::CpAsync { d, a, n, .. } => [d, a, n].into_iter().for_each(g),
        Op::Ldmatrix { ds, num, a, .. } => {
            ds[..*num as usize].iter_mut().for_each(&mut g);
            g(a);
        }
        Op::Mma { d, .. } => d.iter_mut().for_each(g),
        Op::Elect { d, p, mask } => [d, p, mask].into_iter().for_each(g),
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use crate::{LaunchConfig, Module, Vm};
    use kernels_gpu::abi::{AttnParams, BwdParams, Strides};
    use kernels_gpu::decode_abi::DecodeParams;
    use kernels_gpu::tiles::{
        LaunchDims, DECODE_D128, DECODE_MMA_D128, FLASH_BWD_TC_D64, FLASH_F32_D64, FLASH_MMA_D64,
    };

    /// Random bytes of `n` values of `eb` bytes each (f32 or bf16 in [-1, 1)).
    fn values(seed: &mut u64, n: usize, eb: usize) -> Vec<u8> {
        (0..n)
            .flat_map(|_| {
                *seed ^= *seed << 13;
                *seed ^= *seed >> 7;
                *seed ^= *seed << 17;
                let x = ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
                if eb == 4 {
                    x.to_le_bytes().to_vec()
                } else {
                    half::bf16::from_f32(x).to_le_bytes().to_vec()
                }
            })
            .collect()
    }

    /// Allocates and fills a case's buffers; returns its parameters and the buffers to read.
    type Setup<'a> = dyn Fn(&mut Vm) -> (Vec<u8>, Vec<(u64, usize)>) + 'a;

    /// Every buffer's bytes after launching `kernel` twice on the same warps' register files
    /// (the second launch finds the first one's values there), registers packed or as written.
    /// `setup` allocates and fills the buffers and returns the parameters and the buffers to read.
    fn outputs(m: &Module, kernel: &str, dims: LaunchDims, pack: bool, setup: &Setup) -> Vec<u8> {
        let mut vm = Vm::with_workers(2);
        vm.pack_registers = pack;
        // Packed, the slots a thread writes first start with garbage too.
        vm.poison_registers = pack;
        let (params, bufs) = setup(&mut vm);
        let cfg = LaunchConfig::new(dims.grid, dims.block, dims.dynamic_smem_bytes);
        let mut out = Vec::new();
        for _ in 0..2 {
            out.clear();
            vm.launch(m, kernel, &cfg, &params).unwrap();
            for &(b, len) in &bufs {
                let mut v = vec![0u8; len];
                vm.read(b, &mut v).unwrap();
                out.extend(v);
            }
        }
        out
    }

    /// The flash forward (f32 SIMT and bf16 tensor cores, causal, a length that is not a tile
    /// multiple), the tensor-core backward and both decode kernels (GQA, a cache that is not a
    /// tile multiple, two splits) give the same bytes with their registers packed into a few
    /// hundred slots as with one slot per register.
    pub fn packed_kernels_give_the_bytes_of_the_program_as_written() {
        let m = Module::load(kernels_gpu::artifacts::PTX).unwrap();
        let (heads, seq, d) = (2u32, 80u32, 64u32);
        let n = (heads * seq * d) as usize;
        let st = Strides::bshd(seq as u64, heads as u64, d as u64);
        let attn = |vm: &mut Vm, eb: usize, seed: u64| -> (AttnParams, Vec<(u64, usize)>) {
            let mut s = seed;
            let bufs: Vec<u64> = (0..8)
                .map(|_| {
                    let b = vm.alloc((n * eb) as u64).unwrap();
                    vm.write(b, &values(&mut s, n, eb)).unwrap();
                    b
                })
                .collect();
            let rows = (heads * seq) as usize;
            let lse = vm.alloc(rows as u64 * 4).unwrap();
            vm.write(lse, &(0..rows).flat_map(|_| (seq as f32).ln().to_le_bytes()).collect::<Vec<u8>>()).unwrap();
            let p = crate::test_params::causal_bshd([bufs[0], bufs[1], bufs[2], bufs[3]], lse, heads, seq, d);
            let mut read: Vec<(u64, usize)> = bufs.iter().map(|&b| (b, n * eb)).collect();
            read.push((lse, rows * 4));
            (p, read)
        };
        let mut cases: Vec<(&str, LaunchDims, Box<Setup<'_>>)> = vec![
            (
                "flash_fwd_f32_d64",
                FLASH_F32_D64.launch(1, heads, seq),
                Box::new(|vm: &mut Vm| {
                    let (p, r) = attn(vm, 4, 1);
                    (p.to_bytes().to_vec(), r)
                }),
            ),
            (
                "flash_fwd_bf16_d64",
                FLASH_MMA_D64.launch(1, heads, seq),
                Box::new(|vm: &mut Vm| {
                    let (p, r) = attn(vm, 2, 2);
                    (p.to_bytes().to_vec(), r)
                }),
            ),
            (
                "flash_bwd_bf16_d64",
                FLASH_BWD_TC_D64.launch(1, heads, seq),
                Box::new(|vm: &mut Vm| {
                    let (p, mut r) = attn(vm, 2, 3);
                    let rows = (heads * seq) as usize;
                    let delta = vm.alloc(rows as u64 * 4).unwrap();
                    vm.write(delta, &values(&mut 4, rows, 4)).unwrap();
                    let dq_accum = vm.alloc(n as u64 * 4).unwrap();
                    vm.write(dq_accum, &vec![0u8; n * 4]).unwrap();
                    r.extend([(delta, rows * 4), (dq_accum, n * 4)]);
                    let b = BwdParams {
                        attn: p,
                        d_o: r[3].0,
                        delta,
                        dq_accum,
                        dq: r[4].0,
                        dk: r[5].0,
                        dv: r[6].0,
                        dsinks: 0,
                        d_o_strides: st,
                        dq_accum_strides: st,
                        dq_strides: st,
                        dk_strides: st,
                        dv_strides: st,
                        dq_split_stride: 0,
                        dq_splits: 1,
                        key_block: FLASH_BWD_TC_D64.bc,
                    };
                    (b.to_bytes().to_vec(), r)
                }),
            ),
        ];
        let (dheads, dkv, dd, cache, splits) = (8u32, 2u32, 128u32, 300u32, 2u32);
        for (kernel, eb, dims) in [
            ("decode_mma_bf16_d128", 2usize, DECODE_MMA_D128.launch(splits, 1, dheads / dkv, dkv, 1)),
            ("decode_fwd_f32_d128", 4, DECODE_D128.launch(splits, 1, dheads / dkv, dkv, 1)),
        ] {
            cases.push((
                kernel,
                dims,
                Box::new(move |vm: &mut Vm| {
                    let mut s = 5 + eb as u64;
                    let (nq, nkv) = ((dheads * dd) as usize, (cache * dkv * dd) as usize);
                    let mut up = |bytes: Vec<u8>| {
                        let b = vm.alloc(bytes.len() as u64).unwrap();
                        vm.write(b, &bytes).unwrap();
                        (b, bytes.len())
                    };
                    let bufs = [
                        up(values(&mut s, nq, eb)),
                        up(values(&mut s, nkv, eb)),
                        up(values(&mut s, nkv, eb)),
                        up(cache.to_le_bytes().to_vec()),
                        up(vec![0; nq * eb]),
                        up(vec![0; dheads as usize * 4]),
                        up(vec![0; (splits * dheads * dd) as usize * 4]),
                        up(vec![0; (splits * dheads) as usize * 4]),
                    ];
                    let p = DecodeParams {
                        q: bufs[0].0,
                        k_cache: bufs[1].0,
                        v_cache: bufs[2].0,
                        cache_seqlens: bufs[3].0,
                        o: bufs[4].0,
                        lse: bufs[5].0,
                        o_part: bufs[6].0,
                        lse_part: bufs[7].0,
                        batch: 1,
                        heads: dheads,
                        heads_kv: dkv,
                        seq_q: 1,
                        head_dim: dd,
                        seq_cache: cache,
                        num_splits: splits,
                        causal: 1,
                        softmax_scale: 1.0 / (dd as f32).sqrt(),
                        window_left: -1,
                        window_right: -1,
                        ..DecodeParams::default()
                    };
                    (p.to_bytes().to_vec(), bufs.to_vec())
                }),
            ));
        }
        for (kernel, dims, setup) in &cases {
            let p = m.program(kernel).unwrap();
            assert!(p.packed().nslots * 4 < p.nslots, "{kernel}: {} -> {} slots", p.nslots, p.packed().nslots);
            let (as_written, packed) =
                (outputs(&m, kernel, *dims, false, setup), outputs(&m, kernel, *dims, true, setup));
            assert!(as_written.iter().any(|&b| b != 0), "{kernel}: no output");
            assert!(as_written == packed, "{kernel}: packed registers changed the output");
        }
    }

    /// A loop with a register carried around it, a call inside it whose parameter and return
    /// value pass through `.param` slots, a guarded write, and a branch on which the lanes
    /// diverge (odd lanes keep a value live across the even lanes' path that writes others):
    /// the known results with the registers packed and as written.
    pub fn loops_calls_and_divergent_paths_keep_their_values_when_packed() {
        let ptx = ".version 7.0\n.target sm_80\n.address_size 64\n\
            .func (.param .b32 r) plus3(.param .b32 x)\n{\n.reg .b32 %a<3>;\n\
            ld.param.b32 %a1, [x];\n add.u32 %a2, %a1, 3;\n st.param.b32 [r], %a2;\n ret;\n}\n\
            .visible .entry k(.param .u64 out)\n{\n\
            .reg .pred %p<4>;\n.reg .b32 %r<20>;\n.reg .b64 %rd<4>;\n\
            ld.param.u64 %rd0, [out];\n mov.u32 %r1, %tid.x;\n mov.u32 %r2, 0;\n mov.u32 %r3, 0;\n\
            and.b32 %r4, %r1, 1;\n setp.eq.u32 %p1, %r4, 0;\n mul.lo.u32 %r5, %r1, 7;\n\
            @%p1 bra EVEN;\n add.u32 %r6, %r5, 100;\n bra JOIN;\n\
            EVEN:\n mov.u32 %r7, 11;\n mov.u32 %r8, 13;\n mul.lo.u32 %r9, %r7, %r8;\n add.u32 %r6, %r9, %r1;\n\
            JOIN:\n\
            LOOP:\n { .param .b32 px;\n .param .b32 pr;\n st.param.b32 [px], %r2;\n\
            call.uni (pr), plus3, (px);\n ld.param.b32 %r10, [pr];\n }\n\
            mov.u32 %r2, %r10;\n setp.lt.u32 %p2, %r3, %r1;\n @%p2 add.u32 %r11, %r3, %r5;\n\
            @!%p2 mov.u32 %r11, 1;\n add.u32 %r12, %r11, %r2;\n add.u32 %r3, %r3, 1;\n\
            setp.lt.u32 %p3, %r3, 5;\n @%p3 bra LOOP;\n\
            add.u32 %r13, %r12, %r6;\n add.u32 %r14, %r13, %r5;\n\
            mul.wide.u32 %rd1, %r1, 4;\n add.u64 %rd2, %rd0, %rd1;\n st.global.u32 [%rd2], %r14;\n ret;\n}\n";
        let m = Module::load(ptx).unwrap();
        let p = m.program("k").unwrap();
        assert!(p.packed().nslots < p.nslots, "{} -> {} slots", p.nslots, p.packed().nslots);
        // Lane t after 5 iterations: r2 = 15, r11 = (4 < t ? 4 + 7t : 1), r6 = odd ? 7t + 100 : 143 + t.
        let want: Vec<u32> = (0..32u32)
            .map(|t| {
                let r11 = if 4 < t { 4 + 7 * t } else { 1 };
                let r6 = if t % 2 == 1 { 7 * t + 100 } else { 143 + t };
                r11 + 15 + r6 + 7 * t
            })
            .collect();
        for pack in [false, true] {
            let mut vm = Vm::with_workers(1);
            vm.pack_registers = pack;
            vm.poison_registers = true;
            let out = vm.alloc(128).unwrap();
            vm.launch(&m, "k", &LaunchConfig::new([1, 1, 1], [32, 1, 1], 0), &out.to_le_bytes()).unwrap();
            let mut b = [0u8; 128];
            vm.read(out, &mut b).unwrap();
            let got: Vec<u32> = b.chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
            assert_eq!(got, want, "pack {pack}");
        }
    }
}
