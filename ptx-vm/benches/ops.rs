//! The VM's cost per warp instruction, instruction by instruction: a kernel of 4 blocks of 128
//! threads (every lane active) runs one instruction 200 times in a row, 500 times over (a
//! barrier after each 200), on 1 worker with every check on; prints the best of 5 launches as
//! nanoseconds per warp instruction (the loop's own few instructions included).
//!
//! Run: `cargo bench -p memattn-ptx-vm --bench ops` (add a word to run only the lines that contain it).
//! A flat profile hides which single instruction is slow; this table shows it directly, and two
//! builds run one after the other compare instruction by instruction (`ptx-vm/PERF.md`).
//!
//! The shared window (4 KiB) is written in full before the loop, so loads take the checked fast
//! paths a kernel's main loop takes; `%rd0` points at 1 MiB of global memory, `%rd11` at each
//! thread's 16 bytes of it, `%rd3` / `%rd4` / `%rd5` at each thread's word / each lane's
//! 16-byte row / each thread's 16 bytes of shared memory.

use memattn_ptx_vm::{LaunchConfig, Module, Vm};

const OPS: &[&str] = &[
    "mov.b32 %r4, %r1;",
    "add.s32 %r9, %r1, %r2;",
    "add.s64 %rd9, %rd1, %rd2;",
    "shl.b64 %rd9, %rd1, 3;",
    "mul.wide.u32 %rd6, %r1, %r2;",
    "mad.lo.s64 %rd5, %rd1, %rd1, %rd2;",
    "cvt.u32.u64 %r7, %rd1;",
    "setp.lt.s32 %p2, %r1, %r2;",
    "setp.gt.f32 %p2, %f1, %f2;",
    "selp.f32 %f5, %f1, %f2, %p1;",
    "fma.rn.f32 %f3, %f1, %f2, %f3;",
    "add.rn.f32 %f3, %f1, %f2;",
    "sub.rn.f32 %f3, %f1, %f2;",
    "max.f32 %f3, %f1, %f2;",
    "ex2.approx.ftz.f32 %f4, %f2;",
    "cvt.rn.bf16x2.f32 %r9, %f1, %f2;",
    "shfl.sync.bfly.b32 %r6, %r1, 1, 31, -1;",
    "shfl.sync.bfly.b32 %r6, %r1, %r2, 31, -1;",
    "ld.param.b64 %rd9, [t_param_0];",
    "ld.shared.b32 %r5, [%rd3+512];",
    "ld.shared.b32 %r5, [%rd3+512]; fma.rn.f32 %f3, %f1, %f2, %f3;",
    "st.shared.b32 [%rd3+512], %r1;",
    "ld.global.b32 %r8, [%rd11];",
    "st.global.b32 [%rd11], %r1;",
    "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r16,%r17,%r18,%r19}, [%rd4];",
    "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%r16,%r17,%r18,%r19}, [%rd4];",
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f10,%f11,%f12,%f13}, {%r10,%r11,%r12,%r13}, {%r14,%r15}, {%f10,%f11,%f12,%f13};",
    "cp.async.cg.shared.global [%rd5+1024], [%rd11], 16; cp.async.commit_group; cp.async.wait_group 0;",
];

const PROLOGUE: &str = "ld.param.u64 %rd0, [t_param_0];\nmov.u32 %r1, %tid.x;\nmov.u32 %r2, 3;\nmov.u32 %r3, 0;\n\
    mov.f32 %f1, 0f3F800000;\nmov.f32 %f2, 0f3F000000;\nmov.f32 %f3, 0f00000000;\nsetp.lt.u32 %p1, %r1, 40;\n\
    mul.wide.u32 %rd1, %r1, 4;\nmov.u64 %rd2, sm;\nadd.s64 %rd3, %rd2, %rd1;\n\
    st.shared.u32 [%rd3], %r1;\nst.shared.u32 [%rd3+512], %r1;\nst.shared.u32 [%rd3+1024], %r1;\nst.shared.u32 [%rd3+1536], %r1;\n\
    st.shared.u32 [%rd3+2048], %r1;\nst.shared.u32 [%rd3+2560], %r1;\nst.shared.u32 [%rd3+3072], %r1;\nst.shared.u32 [%rd3+3584], %r1;\n\
    bar.sync 0;\nand.b32 %r20, %r1, 31;\nmul.wide.u32 %rd10, %r20, 16;\nadd.s64 %rd4, %rd2, %rd10;\n\
    mul.wide.u32 %rd12, %r1, 16;\nadd.s64 %rd11, %rd0, %rd12;\nadd.s64 %rd5, %rd2, %rd12;\n\
    mov.b32 %r10, 0x3f803f80;\nmov.b32 %r11, 0x3f803f80;\nmov.b32 %r12, 0x3f803f80;\nmov.b32 %r13, 0x3f803f80;\n\
    mov.b32 %r14, 0x3f803f80;\nmov.b32 %r15, 0x3f803f80;\nmov.f32 %f10, 0f00000000;\nmov.f32 %f11, 0f00000000;\n\
    mov.f32 %f12, 0f00000000;\nmov.f32 %f13, 0f00000000;\n";

fn main() {
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let mut vm = Vm::with_workers(1);
    let buf = vm.alloc(1 << 20).unwrap();
    vm.write(buf, &vec![0x3f; 1 << 20]).unwrap();
    println!("{:>9}  instruction(s) repeated in the loop", "ns/warp-instr");
    for op in OPS {
        if filter.as_ref().is_some_and(|f| !op.contains(f.as_str())) {
            continue;
        }
        let body: String = (0..200).map(|_| format!("{op}\n")).collect();
        let src = format!(
            ".version 7.0\n.target sm_80\n.address_size 64\n.shared .align 16 .b8 sm[4096];\n\
             .visible .entry t(\n.param .u64 t_param_0\n)\n{{\n.reg .pred %p<16>;\n.reg .b32 %r<64>;\n\
             .reg .b64 %rd<64>;\n.reg .f32 %f<32>;\n{PROLOGUE}LOOP:\n{body}bar.sync 0;\nadd.s32 %r3, %r3, 1;\n\
             setp.lt.s32 %p3, %r3, 500;\n@%p3 bra LOOP;\nret;\n}}\n"
        );
        let m = Module::load(&src).unwrap_or_else(|e| panic!("{e}\n{op}"));
        let mut best = f64::MAX;
        let mut warp_instructions = 0;
        for _ in 0..5 {
            let s = vm.launch(&m, "t", &LaunchConfig::new([4, 1, 1], [128, 1, 1], 0), &buf.to_le_bytes()).unwrap();
            best = best.min(s.wall.as_secs_f64());
            warp_instructions = s.warp_instructions;
        }
        println!("{:>13.1}  {op}", best * 1e9 / warp_instructions as f64);
    }
}
