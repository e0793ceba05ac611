//! Instruction families against known values.

use crate::util;
use util::*;

fn f(x: u32) -> f32 {
    f32::from_bits(x)
}

#[test]
fn integer_edges() {
    let o = run1(
        "mov.b32 %r1, -2147483648;\n mov.b32 %r2, -1;\n div.s32 %r3, %r1, %r2;\n st.global.u32 [%rd0], %r3;\n\
         rem.s32 %r4, %r1, %r2;\n st.global.u32 [%rd0+4], %r4;\n\
         mov.b32 %r5, 7;\n mov.b32 %r6, 0;\n div.u32 %r7, %r5, %r6;\n st.global.u32 [%rd0+8], %r7;\n\
         rem.u32 %r8, %r5, %r6;\n st.global.u32 [%rd0+12], %r8;\n\
         mov.b32 %r9, 33;\n shl.b32 %r10, %r5, %r9;\n st.global.u32 [%rd0+16], %r10;\n\
         mov.b32 %r11, -8;\n mov.b32 %r12, 40;\n shr.s32 %r13, %r11, %r12;\n st.global.u32 [%rd0+20], %r13;\n\
         shr.u32 %r14, %r11, 32;\n st.global.u32 [%rd0+24], %r14;\n\
         mul.hi.s32 %r15, %r11, %r1;\n st.global.u32 [%rd0+28], %r15;\n\
         mul.wide.s32 %rd1, %r11, 3;\n st.global.u64 [%rd0+32], %rd1;\n\
         abs.s32 %r16, %r1;\n st.global.u32 [%rd0+40], %r16;\n\
         popc.b32 %r17, %r11;\n st.global.u32 [%rd0+44], %r17;\n\
         clz.b32 %r18, %r5;\n st.global.u32 [%rd0+48], %r18;\n\
         brev.b32 %r19, 1;\n st.global.u32 [%rd0+52], %r19;\n\
         mov.b32 %r20, 0xF0F0;\n bfe.s32 %r21, %r20, 4, 4;\n st.global.u32 [%rd0+56], %r21;\n\
         bfe.u32 %r22, %r20, 4, 4;\n st.global.u32 [%rd0+60], %r22;\n\
         bfi.b32 %r23, 5, %r20, 8, 4;\n st.global.u32 [%rd0+64], %r23;\n\
         mov.b32 %r24, 0x03020100;\n mov.b32 %r25, 0x07060504;\n prmt.b32 %r26, %r24, %r25, 0x4321;\n st.global.u32 [%rd0+68], %r26;\n\
         min.s32 %r27, %r11, %r5;\n st.global.u32 [%rd0+72], %r27;\n min.u32 %r28, %r11, %r5;\n st.global.u32 [%rd0+76], %r28;\n\
         mad.lo.s32 %r29, %r11, %r5, 100;\n st.global.u32 [%rd0+80], %r29;\n\
         add.sat.s32 %r30, %r1, %r11;\n st.global.u32 [%rd0+84], %r30;\n\
         prmt.b32.ecl %r31, %r24, %r25, 2;\n st.global.u32 [%rd0+88], %r31;\n\
         not.b32 %r32, %r5;\n cnot.b32 %r33, %r5;\n st.global.u32 [%rd0+92], %r32;\n st.global.u32 [%rd0+96], %r33;\n\
         mov.b64 %rd2, 5;\n shl.b64 %rd3, %rd2, 64;\n st.global.u64 [%rd0+104], %rd3;",
        28,
    );
    assert_eq!(o[0], i32::MIN as u32, "MIN / -1 wraps");
    assert_eq!(o[1], 0, "MIN % -1");
    assert_eq!(o[2], u32::MAX, "x / 0");
    assert_eq!(o[3], 7, "x % 0");
    assert_eq!(o[4], 0, "shl by 33");
    assert_eq!(o[5], u32::MAX, "shr.s by 40 fills the sign");
    assert_eq!(o[6], 0, "shr.u by 32");
    assert_eq!(o[7], (((-8i64) * (i32::MIN as i64)) >> 32) as u32);
    assert_eq!(o[8] as u64 | (o[9] as u64) << 32, (-24i64) as u64);
    assert_eq!(o[10], i32::MIN as u32);
    assert_eq!(o[11], 29);
    assert_eq!(o[12], 29);
    assert_eq!(o[13], 0x8000_0000);
    assert_eq!(o[14], u32::MAX, "bfe.s32 sign-extends 0xF");
    assert_eq!(o[15], 0xF);
    assert_eq!(o[16], 0xF5F0);
    assert_eq!(o[17], 0x04030201);
    assert_eq!(o[18], -8i32 as u32);
    assert_eq!(o[19], 7);
    assert_eq!(o[20], 44);
    assert_eq!(o[21], i32::MIN as u32, "saturating add");
    assert_eq!(o[22], 0x03020202, "prmt.ecl");
    assert_eq!(o[23], !7u32);
    assert_eq!(o[24], 0);
    assert_eq!(o[26] as u64 | (o[27] as u64) << 32, 0, "shl.b64 by 64");
}

#[test]
fn float_rounding_nan_inf() {
    let o = run1(
        "mov.f32 %f1, 0f3F800000;\n mov.f32 %f2, 0f30800000;\n\
         add.rz.f32 %f3, %f1, %f2;\n st.global.f32 [%rd0], %f3;\n\
         add.rp.f32 %f4, %f1, %f2;\n st.global.f32 [%rd0+4], %f4;\n\
         sub.rm.f32 %f5, %f1, %f2;\n st.global.f32 [%rd0+8], %f5;\n\
         mov.f32 %f6, 0f7FC00000;\n min.f32 %f7, %f6, %f1;\n st.global.f32 [%rd0+12], %f7;\n\
         max.f32 %f8, %f1, %f6;\n st.global.f32 [%rd0+16], %f8;\n\
         mov.f32 %f9, 0fFF800000;\n ex2.approx.ftz.f32 %f10, %f9;\n st.global.f32 [%rd0+20], %f10;\n\
         mov.f32 %f11, 0f00000000;\n lg2.approx.ftz.f32 %f12, %f11;\n st.global.f32 [%rd0+24], %f12;\n\
         mov.f32 %f13, 0f80000001;\n mul.ftz.f32 %f14, %f13, %f1;\n st.global.f32 [%rd0+28], %f14;\n\
         setp.leu.f32 %p1, %f6, %f1;\n selp.u32 %r1, 1, 0, %p1;\n st.global.u32 [%rd0+32], %r1;\n\
         setp.lt.f32 %p2, %f6, %f1;\n selp.u32 %r2, 1, 0, %p2;\n st.global.u32 [%rd0+36], %r2;\n\
         mov.f32 %f15, 0fBFC00000;\n cvt.rzi.s32.f32 %r3, %f15;\n st.global.u32 [%rd0+40], %r3;\n\
         mov.f32 %f16, 0f40200000;\n cvt.rni.s32.f32 %r4, %f16;\n st.global.u32 [%rd0+44], %r4;\n\
         cvt.rzi.s32.f32 %r5, %f6;\n st.global.u32 [%rd0+48], %r5;\n\
         mov.f32 %f17, 0f4F800000;\n cvt.rzi.s32.f32 %r6, %f17;\n st.global.u32 [%rd0+52], %r6;\n\
         cvt.rn.f16.f32 %h1, %f16;\n cvt.u32.u16 %r7, %h1;\n st.global.u32 [%rd0+56], %r7;\n\
         cvt.f32.f16 %f18, %h1;\n st.global.f32 [%rd0+60], %f18;\n\
         mov.f64 %fd1, 0d3FF0000000000001;\n cvt.rz.f32.f64 %f19, %fd1;\n st.global.f32 [%rd0+64], %f19;\n\
         cvt.rp.f32.f64 %f20, %fd1;\n st.global.f32 [%rd0+68], %f20;\n\
         mov.f32 %f21, 0f40000000;\n sqrt.rn.f32 %f22, %f21;\n st.global.f32 [%rd0+72], %f22;\n\
         div.rn.f32 %f23, %f1, %f21;\n st.global.f32 [%rd0+76], %f23;\n\
         fma.rn.f32 %f24, %f21, %f21, %f1;\n st.global.f32 [%rd0+80], %f24;\n\
         cvt.sat.f32.f32 %f25, %f21;\n st.global.f32 [%rd0+84], %f25;\n\
         mov.f32 %f26, 0f40400000;\n div.rz.f32 %f27, %f1, %f26;\n st.global.f32 [%rd0+88], %f27;\n\
         div.rp.f32 %f28, %f1, %f26;\n st.global.f32 [%rd0+92], %f28;\n\
         cvt.rn.bf16.f32 %h2, %f26;\n cvt.u32.u16 %r8, %h2;\n st.global.u32 [%rd0+96], %r8;\n\
         mov.b32 %r9, -1;\n cvt.rn.f32.u32 %f29, %r9;\n st.global.f32 [%rd0+100], %f29;\n\
         cvt.rz.f32.u32 %f30, %r9;\n st.global.f32 [%rd0+104], %f30;\n\
         cvt.sat.u8.s32 %r10, %r9;\n st.global.u32 [%rd0+108], %r10;\n\
         cvt.s64.s32 %rd1, %r9;\n st.global.u64 [%rd0+112], %rd1;\n\
         mul.rn.f64 %fd2, %fd1, %fd1;\n st.global.f64 [%rd0+120], %fd2;\n\
         neg.f32 %f31, %f11;\n st.global.f32 [%rd0+128], %f31;",
        33,
    );
    assert_eq!(o[0], 1.0f32.to_bits(), "add.rz");
    assert_eq!(o[1], 1.0f32.next_up().to_bits(), "add.rp");
    assert_eq!(o[2], (1.0f32 - 2f32.powi(-30)).next_down().max(1.0f32.next_down()).to_bits(), "sub.rm");
    assert_eq!(f(o[3]), 1.0, "min with one NaN returns the other");
    assert_eq!(f(o[4]), 1.0);
    assert_eq!(o[5], 0, "ex2(-inf) = +0");
    assert_eq!(f(o[6]), f32::NEG_INFINITY, "lg2(0) = -inf");
    assert_eq!(o[7], 0x8000_0000, "ftz flushes to a sign-preserving zero");
    assert_eq!(o[8], 1, "leu is true on NaN");
    assert_eq!(o[9], 0, "lt is false on NaN");
    assert_eq!(o[10] as i32, -1);
    assert_eq!(o[11], 2, "round half to even");
    assert_eq!(o[12], 0, "NaN converts to 0");
    assert_eq!(o[13], i32::MAX as u32, "float to int saturates");
    assert_eq!(o[14], half::f16::from_f32(2.5).to_bits() as u32);
    assert_eq!(f(o[15]), 2.5);
    assert_eq!(f(o[16]), 1.0);
    assert_eq!(f(o[17]), 1.0f32.next_up());
    assert_eq!(f(o[18]), 2f32.sqrt());
    assert_eq!(f(o[19]), 0.5);
    assert_eq!(f(o[20]), 5.0);
    assert_eq!(f(o[21]), 1.0, ".sat clamps");
    // 1/3 rounds up to nearest in f32, so .rz is one ulp below and .rp equals .rn.
    assert_eq!(f(o[22]), (1.0f32 / 3.0).next_down(), "div.rz");
    assert_eq!(f(o[23]), 1.0f32 / 3.0, "div.rp");
    assert_eq!(o[24], half::bf16::from_f32(3.0).to_bits() as u32);
    assert_eq!(f(o[25]), 4294967296.0);
    assert_eq!(f(o[26]), 4294967040.0, "rz");
    assert_eq!(o[27], 0, "cvt.sat.u8 of -1");
    assert_eq!(o[28] as u64 | (o[29] as u64) << 32, u64::MAX, "sign extension");
    let x = f64::from_bits(0x3FF0000000000001);
    assert_eq!(o[30] as u64 | (o[31] as u64) << 32, (x * x).to_bits());
    assert_eq!(o[32], 0x8000_0000, "neg(+0) = -0");
}

#[test]
fn setp_combinations_and_pairs() {
    let o = run1(
        "mov.b32 %r1, 3;\n mov.b32 %r2, 5;\n setp.lt.s32 %p1|%p2, %r1, %r2;\n\
         selp.u32 %r3, 1, 0, %p1;\n selp.u32 %r4, 1, 0, %p2;\n st.global.u32 [%rd0], %r3;\n st.global.u32 [%rd0+4], %r4;\n\
         setp.gt.and.s32 %p3, %r2, %r1, %p2;\n selp.u32 %r5, 1, 0, %p3;\n st.global.u32 [%rd0+8], %r5;\n\
         setp.gt.or.s32 %p4, %r1, %r2, !%p2;\n selp.u32 %r6, 1, 0, %p4;\n st.global.u32 [%rd0+12], %r6;\n\
         set.lt.u32.s32 %r7, %r1, %r2;\n st.global.u32 [%rd0+16], %r7;\n\
         mov.b32 %r8, -1;\n setp.lo.u32 %p5, %r1, %r8;\n selp.u32 %r9, 1, 0, %p5;\n st.global.u32 [%rd0+20], %r9;\n\
         setp.lt.s32 %p6, %r8, %r1;\n @!%p6 bra SKIP;\n st.global.u32 [%rd0+24], %r2;\nSKIP:\n\
         and.pred %p7, %p1, %p6;\n not.pred %p8, %p7;\n selp.u32 %r10, 1, 0, %p8;\n st.global.u32 [%rd0+28], %r10;",
        8,
    );
    assert_eq!(&o[..], &[1, 0, 0, 1, u32::MAX, 1, 5, 0]);
}

#[test]
fn warp_shuffles_and_votes() {
    let body = "mov.u32 %r1, %tid.x;\n mul.wide.u32 %rd1, %r1, 4;\n add.s64 %rd2, %rd0, %rd1;\n\
        shfl.sync.up.b32 %r2, %r1, 1, 0, -1;\n st.global.u32 [%rd2], %r2;\n\
        shfl.sync.down.b32 %r3, %r1, 3, 31, -1;\n st.global.u32 [%rd2+128], %r3;\n\
        shfl.sync.bfly.b32 %r4, %r1, 1, 31, -1;\n st.global.u32 [%rd2+256], %r4;\n\
        shfl.sync.idx.b32 %r5|%p1, %r1, 5, 0x1f, -1;\n st.global.u32 [%rd2+384], %r5;\n\
        shfl.sync.down.b32 %r6, %r1, 1, 0x181f, -1;\n st.global.u32 [%rd2+512], %r6;\n\
        setp.lt.u32 %p2, %r1, 10;\n vote.sync.ballot.b32 %r7, %p2, -1;\n st.global.u32 [%rd2+640], %r7;\n\
        vote.sync.any.pred %p3, %p2, -1;\n selp.u32 %r8, 1, 0, %p3;\n vote.sync.all.pred %p4, %p2, -1;\n selp.u32 %r9, 1, 0, %p4;\n\
        add.s32 %r10, %r8, %r9;\n st.global.u32 [%rd2+768], %r10;\n\
        redux.sync.add.u32 %r11, %r1, -1;\n st.global.u32 [%rd2+896], %r11;\n\
        mov.u32 %r12, %laneid;\n mov.u32 %r13, %lanemask_lt;\n popc.b32 %r14, %r13;\n sub.s32 %r15, %r14, %r12;\n st.global.u32 [%rd2+1024], %r15;";
    let o = words(&run("", body, 1, 32, 32 * 4 * 9).unwrap_or_else(|e| panic!("{e}")));
    for l in 0..32u32 {
        assert_eq!(o[l as usize], l.saturating_sub(1), "up lane {l}");
        assert_eq!(o[32 + l as usize], if l + 3 <= 31 { l + 3 } else { l }, "down lane {l}");
        assert_eq!(o[64 + l as usize], l ^ 1, "bfly lane {l}");
        assert_eq!(o[96 + l as usize], 5, "idx lane {l}");
        // segments of 8 lanes (segmask 0x18): down stays inside its segment.
        let seg_end = (l & !7) | 7;
        assert_eq!(o[128 + l as usize], if l < seg_end { l + 1 } else { l }, "segmented down lane {l}");
        assert_eq!(o[160 + l as usize], 0x3ff);
        assert_eq!(o[192 + l as usize], 1);
        assert_eq!(o[224 + l as usize], 496);
        assert_eq!(o[256 + l as usize], 0);
    }
}

#[test]
fn warp_shuffles_of_every_mode_and_segment_width() {
    // Each mode with a constant lane operand (source lanes computed at decode), the same value
    // in a register (the same in every lane: the fast path at run time) and one that differs per
    // lane (`%r2` = 7 l mod 32, the general path), for segment widths 32, 8 and 1 and a clamp
    // below 31: against the PTX ISA's definition, written out here.
    let modes = ["up", "down", "bfly", "idx"];
    let cs: [u32; 4] = [0x1f, 0x181f, 0x1f00, 0x0a];
    let mut body = String::from(
        "mov.u32 %r1, %tid.x;\n mul.wide.u32 %rd1, %r1, 4;\n add.s64 %rd2, %rd0, %rd1;\n\
        mul.lo.u32 %r2, %r1, 7;\n and.b32 %r2, %r2, 31;\n mul.lo.u32 %r4, %r1, 3;\n add.u32 %r4, %r4, 100;\n\
        mov.u32 %r5, 3;\n",
    );
    let mut k = 0;
    for m in modes {
        for c in cs {
            for b in ["3", "%r5", "%r2"] {
                body +=
                    &format!("shfl.sync.{m}.b32 %r3, %r4, {b}, {c:#x}, -1;\n st.global.u32 [%rd2+{}], %r3;\n", 128 * k);
                k += 1;
            }
        }
    }
    let o = words(&run("", &body, 1, 32, 128 * k).unwrap_or_else(|e| panic!("{e}")));
    let mut k = 0;
    for (mi, m) in modes.iter().enumerate() {
        for c in cs {
            for (b_kind, per_lane) in [("constant", false), ("register", false), ("per lane", true)] {
                for lane in 0..32u32 {
                    let bval = if per_lane { (lane * 7) % 32 } else { 3 };
                    let (cval, segmask) = ((c & 0x1f) as i64, ((c >> 8) & 0x1f) as i64);
                    let (l, bv) = (lane as i64, bval as i64);
                    let max_lane = (l & segmask) | (cval & !segmask);
                    let (j, ok) = match mi {
                        0 => (l - bv, l - bv >= max_lane),
                        1 => (l + bv, l + bv <= max_lane),
                        2 => (l ^ bv, (l ^ bv) <= max_lane),
                        _ => ((l & segmask) | (bv & !segmask), ((l & segmask) | (bv & !segmask)) <= max_lane),
                    };
                    let src = if ok { j as u32 } else { lane };
                    assert_eq!(o[k * 32 + lane as usize], 100 + 3 * src, "{m}, c {c:#x}, b {b_kind}, lane {lane}");
                }
                k += 1;
            }
        }
    }
}

#[test]
fn atomics_global_and_shared() {
    let decls = ".shared .align 4 .b8 cnt[4];";
    let body =
        "mov.u32 %r1, %tid.x;\n setp.ne.u32 %p1, %r1, 0;\n @%p1 bra L1;\n st.shared.u32 [cnt], 0;\nL1:\n bar.sync 0;\n\
        atom.shared.add.u32 %r2, [cnt], 1;\n bar.sync 0;\n\
        atom.global.add.u32 %r3, [%rd0], 1;\n red.global.add.f32 [%rd0+4], 0f3F000000;\n\
        atom.global.max.s32 %r4, [%rd0+8], %r1;\n atom.global.cas.b32 %r5, [%rd0+12], 0, 7;\n\
        @%p1 bra L2;\n ld.shared.u32 %r6, [cnt];\n atom.global.add.u32 %r7, [%rd0+16], %r6;\nL2:\n\
        atom.global.inc.u32 %r8, [%rd0+20], 9;\n atom.global.exch.b32 %r9, [%rd0+24], 3;";
    let o = words(&run(decls, body, 4, 64, 28).unwrap_or_else(|e| panic!("{e}")));
    assert_eq!(o[0], 256);
    assert_eq!(f32::from_bits(o[1]), 128.0);
    assert_eq!(o[2], 63);
    assert_eq!(o[3], 7);
    assert_eq!(o[4], 256, "each block's shared counter reached 64");
    assert_eq!(o[5], 256 % 10);
    assert_eq!(o[6], 3);
}

#[test]
fn calls_local_memory_and_vectors() {
    let src = format!(
        "{HEADER}
.func (.param .b32 func_retval0) addmul(.param .b32 a, .param .align 8 .b8 s[16])
{{
\t.reg .b32 %r<8>;
\t.reg .b64 %rd<4>;
\tld.param.b32 %r1, [a];
\tld.param.b64 %rd1, [s+8];
\tcvt.u32.u64 %r2, %rd1;
\tmad.lo.s32 %r3, %r1, %r2, 1;
\tst.param.b32 [func_retval0], %r3;
\tret;
}}
.visible .entry t(.param .u64 t_param_0)
{{
\t.local .align 8 .b8 __local_depot0[16];
\t.reg .b32 %r<16>;
\t.reg .b64 %rd<16>;
\t.reg .f32 %f<8>;
\tmov.u64 %rd9, __local_depot0;
\tcvta.local.u64 %rd10, %rd9;
\tld.param.u64 %rd1, [t_param_0];
\tcvta.to.global.u64 %rd2, %rd1;
\tmov.u32 %r1, %tid.x;
\tst.u32 [%rd10+4], %r1;
\tld.local.u32 %r2, [%rd9+4];
\t{{ .reg .b32 tmp;
\t.param .b32 param0;
\tst.param.b32 [param0], %r2;
\t.param .align 8 .b8 param1[16];
\tst.param.b64 [param1+8], 10;
\t.param .b32 retval0;
\tcall.uni (retval0), addmul, (param0, param1);
\tld.param.b32 %r3, [retval0];
\t}}
\tmul.wide.u32 %rd3, %r1, 16;
\tadd.s64 %rd4, %rd2, %rd3;
\tcvt.rn.f32.u32 %f1, %r3;
\tmov.f32 %f2, 0f3F800000;
\tst.global.v4.f32 [%rd4], {{%f1, %f2, %f1, %f2}};
\tld.global.v2.u32 {{%r4, %r5}}, [%rd4];
\tst.global.v2.u32 [%rd4+8], {{%r5, %r4}};
\tret;
}}
"
    );
    let m = ptx_vm::Module::load(&src).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(m.kernel("t").unwrap().local_bytes, 16);
    let mut vm = ptx_vm::Vm::new();
    let out = vm.alloc(64 * 16).unwrap();
    vm.launch(&m, "t", &ptx_vm::LaunchConfig::new([1, 1, 1], [64, 1, 1], 0), &out.to_le_bytes()).unwrap();
    let mut b = vec![0u8; 64 * 16];
    vm.read(out, &mut b).unwrap();
    let o = words(&b);
    for t in 0..64usize {
        let want = (t * 10 + 1) as f32;
        assert_eq!(f32::from_bits(o[4 * t]), want);
        assert_eq!(f32::from_bits(o[4 * t + 1]), 1.0);
        assert_eq!(f32::from_bits(o[4 * t + 2]), 1.0);
        assert_eq!(f32::from_bits(o[4 * t + 3]), want);
    }
}

#[test]
fn divergence_and_reconvergence() {
    // Odd lanes loop 3 times, even lanes once; all reconverge for a full-warp shuffle.
    let body = "mov.u32 %r1, %tid.x;\n and.b32 %r2, %r1, 1;\n mov.u32 %r3, 0;\n mov.u32 %r4, 0;\n\
        LOOP:\n add.s32 %r3, %r3, 1;\n add.s32 %r4, %r4, %r1;\n setp.eq.u32 %p1, %r2, 0;\n @%p1 bra DONE;\n\
        setp.lt.u32 %p2, %r3, 3;\n @%p2 bra LOOP;\nDONE:\n\
        shfl.sync.bfly.b32 %r5, %r4, 1, 31, -1;\n mul.wide.u32 %rd1, %r1, 4;\n add.s64 %rd2, %rd0, %rd1;\n\
        st.global.u32 [%rd2], %r5;";
    let o = words(&run("", body, 1, 32, 128).unwrap_or_else(|e| panic!("{e}")));
    for l in 0..32u32 {
        let partner = l ^ 1;
        let want = if partner & 1 == 1 { partner * 3 } else { partner };
        assert_eq!(o[l as usize], want, "lane {l}");
    }
}

#[test]
fn globals_with_initialisers() {
    let src = format!(
        "{HEADER}.global .align 4 .u32 table[4] = {{1, 2, 3, 4}};\n.global .align 8 .u64 ptrs[2] = {{generic(table), 0}};\n\
         .visible .entry t(.param .u64 o)\n{{\n.reg .b32 %r<4>;\n.reg .b64 %rd<8>;\n\
         ld.param.u64 %rd1, [o];\nld.global.u64 %rd2, [ptrs];\nld.u32 %r1, [%rd2+8];\nmov.u64 %rd3, table;\n\
         ld.global.u32 %r2, [%rd3+12];\nadd.s32 %r3, %r1, %r2;\nst.global.u32 [%rd1], %r3;\nret;\n}}\n"
    );
    let m = ptx_vm::Module::load(&src).unwrap_or_else(|e| panic!("{e}"));
    let mut vm = ptx_vm::Vm::new();
    let out = vm.alloc(4).unwrap();
    vm.launch(&m, "t", &ptx_vm::LaunchConfig::new([1, 1, 1], [1, 1, 1], 0), &out.to_le_bytes()).unwrap();
    let mut b = [0u8; 4];
    vm.read(out, &mut b).unwrap();
    assert_eq!(u32::from_le_bytes(b), 7);
    assert_eq!(vm.memory().current_bytes, 4, "module variables are not counted");
}

#[test]
fn vector_mov_packs_and_unpacks_low_element_first() {
    // mov.b32 d, {lo, hi}: the first element lands in the low half; the reverse splits it again.
    let o = run1(
        "mov.b16 %h0, 0x3C00;\n mov.b16 %h1, 0xC000;\n mov.b32 %r0, {%h0, %h1};\n st.global.u32 [%rd0], %r0;\n\
         mov.b32 {%h2, %h3}, %r0;\n cvt.u32.u16 %r1, %h2;\n cvt.u32.u16 %r2, %h3;\n\
         st.global.u32 [%rd0+4], %r1;\n st.global.u32 [%rd0+8], %r2;\n\
         mov.b32 %r3, 0x89ABCDEF;\n mov.b64 %rd1, {%r3, %r0};\n st.global.u64 [%rd0+16], %rd1;\n\
         mov.b64 {%r4, %r5}, %rd1;\n st.global.u32 [%rd0+24], %r4;\n st.global.u32 [%rd0+28], %r5;",
        8,
    );
    assert_eq!(o[0], 0xC000_3C00);
    assert_eq!((o[1], o[2]), (0x3C00, 0xC000));
    assert_eq!((o[4], o[5]), (0x89AB_CDEF, 0xC000_3C00), "u64 = {{low, high}}, little-endian");
    assert_eq!((o[6], o[7]), (0x89AB_CDEF, 0xC000_3C00));
}

#[test]
fn fma_f64_directed_rounding_is_exact() {
    // x = 1 + 2^-52, y = 1 - 2^-53. x·x = 1 + 2^-51 + 2^-104 (just above a representable value);
    // x·y = 1 + 2^-53 - 2^-105 (just below the halfway point between 1 and 1 + 2^-52).
    let mut body = String::from(
        "mov.f64 %fd1, 0d3FF0000000000001;\n mov.f64 %fd2, 0d3FEFFFFFFFFFFFFF;\n mov.f64 %fd3, 0d0000000000000000;\n\
         neg.f64 %fd4, %fd1;\n",
    );
    let mut at = 0;
    for (a, b) in [("%fd1", "%fd1"), ("%fd1", "%fd2"), ("%fd4", "%fd1")] {
        for m in ["rn", "rz", "rm", "rp"] {
            body += &format!("fma.{m}.f64 %fd5, {a}, {b}, %fd3;\n st.global.f64 [%rd0+{at}], %fd5;\n");
            at += 8;
        }
    }
    let o = run1(&body, 24);
    let w: Vec<u64> = o.chunks(2).map(|c| c[0] as u64 | (c[1] as u64) << 32).collect();
    assert_eq!(&w[0..4], &[0x3FF0000000000002, 0x3FF0000000000002, 0x3FF0000000000002, 0x3FF0000000000003], "x*x");
    assert_eq!(&w[4..8], &[0x3FF0000000000000, 0x3FF0000000000000, 0x3FF0000000000000, 0x3FF0000000000001], "x*y");
    assert_eq!(&w[8..12], &[0xBFF0000000000002, 0xBFF0000000000002, 0xBFF0000000000003, 0xBFF0000000000002], "-x*x");
}

/// The OCP FP8 value of byte `b` (sign, exponent bias 7 or 15, 3 or 2 mantissa bits; e4m3 has no
/// infinity and one NaN code per sign, e5m2 has IEEE-style infinities and NaNs), as f64.
fn ocp_fp8(b: u32, e4m3: bool) -> f64 {
    let (ebits, mbits, bias) = if e4m3 { (4, 3, 7) } else { (5, 2, 15) };
    let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = (b >> mbits) & ((1 << ebits) - 1);
    let m = b & ((1 << mbits) - 1);
    let emax = (1 << ebits) - 1;
    if e4m3 && e == emax && m == (1 << mbits) - 1 {
        return f64::NAN;
    }
    if !e4m3 && e == emax {
        return if m == 0 { s * f64::INFINITY } else { f64::NAN };
    }
    let frac = m as f64 / (1 << mbits) as f64;
    if e == 0 {
        s * frac * 2f64.powi(1 - bias)
    } else {
        s * (1.0 + frac) * 2f64.powi(e as i32 - bias)
    }
}

#[test]
fn cvt_f16x2_from_fp8x2_is_exact_for_every_code() {
    // Thread t converts the pair (low byte t, high byte t ^ 0xa5): every code in both positions.
    for (fmt, e4m3) in [("e4m3x2", true), ("e5m2x2", false)] {
        let body = format!(
            "\tmov.u32 %r1, %tid.x;\n\txor.b32 %r2, %r1, 165;\n\tshl.b32 %r2, %r2, 8;\n\tor.b32 %r3, %r1, %r2;\n\t\
             cvt.u16.u32 %h1, %r3;\n\tcvt.rn.f16x2.{fmt} %r4, %h1;\n\tmul.wide.u32 %rd1, %r1, 4;\n\tadd.s64 %rd2, %rd0, %rd1;\n\t\
             st.global.u32 [%rd2], %r4;\n"
        );
        // FP8 conversions arrived with sm_89.
        let out = util::words(&util::run_on("sm_89", &body, 1, 256, 1024).unwrap_or_else(|e| panic!("{e}")));
        for (t, &w) in out.iter().enumerate() {
            for (half, byte) in [(w & 0xffff, t as u32), (w >> 16, t as u32 ^ 0xa5)] {
                let want = ocp_fp8(byte, e4m3);
                let got = half::f16::from_bits(half as u16);
                if want.is_nan() {
                    assert_eq!(half, 0x7fff, "{fmt} byte {byte:#04x}: NaN gives the canonical NaN");
                } else {
                    assert_eq!(got.to_f64(), want, "{fmt} byte {byte:#04x}: got {half:#06x}");
                    assert_eq!(got.is_sign_negative(), byte & 0x80 != 0, "{fmt} byte {byte:#04x}: sign");
                }
            }
        }
    }
}
