//! Tensor-core instruction family: `mma.sync` (m16n8k16 / m16n8k8, f16 / bf16, f32 accumulate),
//! `ldmatrix`, `cp.async` (asynchronous copies with commit groups), packed `cvt.{bf16x2,f16x2}`.
//! Expected values come from the fragment layouts of the PTX ISA, written out here independently
//! of the VM.

use crate::util;
use half::{bf16, f16};
use ptx_vm::{Finding, LaunchConfig, Module, TraceRequest, Vm, VmError, SHARED_POISON};
use util::*;

/// Runs kernel `t` with one buffer of `input.len() + out_bytes` bytes (input first, pointer in
/// `%rd0`) and `threads` threads in one block; returns the whole buffer.
fn run_io(decls: &str, body: &str, threads: u32, input: &[u8], out_bytes: usize) -> Result<Vec<u8>, VmError> {
    run_io_with(decls, body, threads, input, out_bytes, true)
}

/// As [`run_io`], with shared-memory initcheck on or off (off: unwritten bytes read as poison).
fn run_io_with(
    decls: &str,
    body: &str,
    threads: u32,
    input: &[u8],
    out_bytes: usize,
    initcheck: bool,
) -> Result<Vec<u8>, VmError> {
    let src = kernel(decls, body);
    let m = Module::load(&src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let mut vm = Vm::with_workers(1);
    vm.set_initcheck(initcheck);
    let n = input.len() + out_bytes;
    let buf = vm.alloc(n as u64)?;
    vm.write(buf, input)?;
    vm.launch(&m, "t", &LaunchConfig::new([1, 1, 1], [threads, 1, 1], 0), &buf.to_le_bytes())?;
    let mut b = vec![0u8; n];
    vm.read(buf, &mut b)?;
    Ok(b)
}

fn finding_of(r: Result<Vec<u8>, VmError>) -> Box<Finding> {
    match r {
        Err(VmError::Memcheck(f)) => f,
        other => panic!("expected a finding, got {other:?}"),
    }
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    F16,
    Bf16,
}

impl Kind {
    fn enc(self, x: f32) -> u16 {
        match self {
            Kind::F16 => f16::from_f32(x).to_bits(),
            Kind::Bf16 => bf16::from_f32(x).to_bits(),
        }
    }
    fn dec(self, b: u16) -> f64 {
        match self {
            Kind::F16 => f16::from_bits(b).to_f64(),
            Kind::Bf16 => bf16::from_bits(b).to_f64(),
        }
    }
    fn name(self) -> &'static str {
        match self {
            Kind::F16 => "f16",
            Kind::Bf16 => "bf16",
        }
    }
}

fn pack(lo: u16, hi: u16) -> u32 {
    lo as u32 | (hi as u32) << 16
}

/// Runs one `mma` over A (16 x k, row-major values `a`), B (k x 8, `b[k][n]`), C (16 x 8) and
/// returns D per lane as the four f32 of the lane's fragment.
fn run_mma(kind: Kind, k: usize, a: &[[u16; 16]; 16], b: &[[u16; 8]; 16], c: &[[f32; 8]; 16]) -> Vec<[f32; 4]> {
    // Per lane 64 input bytes: a0..a3, b0, b1, c0..c3 (the PTX ISA fragment layouts).
    let mut input = vec![0u8; 32 * 64];
    for lane in 0..32 {
        let (g, t) = (lane / 4, lane % 4);
        let mut w = [0u32; 10];
        w[0] = pack(a[g][2 * t], a[g][2 * t + 1]);
        w[1] = pack(a[g + 8][2 * t], a[g + 8][2 * t + 1]);
        w[2] = pack(a[g][2 * t + 8], a[g][2 * t + 9]);
        w[3] = pack(a[g + 8][2 * t + 8], a[g + 8][2 * t + 9]);
        w[4] = pack(b[2 * t][g], b[2 * t + 1][g]);
        w[5] = pack(b[2 * t + 8][g], b[2 * t + 9][g]);
        w[6] = c[g][2 * t].to_bits();
        w[7] = c[g][2 * t + 1].to_bits();
        w[8] = c[g + 8][2 * t].to_bits();
        w[9] = c[g + 8][2 * t + 1].to_bits();
        for (i, x) in w.iter().enumerate() {
            input[lane * 64 + 4 * i..lane * 64 + 4 * i + 4].copy_from_slice(&x.to_le_bytes());
        }
    }
    let ty = kind.name();
    let inst = if k == 16 {
        format!(
            "mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{%f5, %f6, %f7, %f8}}, {{%r2, %r3, %r4, %r5}}, \
             {{%r6, %r7}}, {{%f1, %f2, %f3, %f4}};"
        )
    } else {
        format!(
            "mma.sync.aligned.m16n8k8.row.col.f32.{ty}.{ty}.f32 {{%f5, %f6, %f7, %f8}}, {{%r2, %r3}}, {{%r6}}, \
             {{%f1, %f2, %f3, %f4}};"
        )
    };
    let body = format!(
        "mov.u32 %r1, %laneid;\n mul.wide.u32 %rd1, %r1, 64;\n add.s64 %rd2, %rd0, %rd1;\n\
         ld.global.b32 %r2, [%rd2];\n ld.global.b32 %r3, [%rd2+4];\n ld.global.b32 %r4, [%rd2+8];\n\
         ld.global.b32 %r5, [%rd2+12];\n ld.global.b32 %r6, [%rd2+16];\n ld.global.b32 %r7, [%rd2+20];\n\
         ld.global.f32 %f1, [%rd2+24];\n ld.global.f32 %f2, [%rd2+28];\n ld.global.f32 %f3, [%rd2+32];\n\
         ld.global.f32 %f4, [%rd2+36];\n {inst}\n\
         mul.wide.u32 %rd3, %r1, 16;\n add.s64 %rd4, %rd0, %rd3;\n\
         st.global.f32 [%rd4+2048], %f5;\n st.global.f32 [%rd4+2052], %f6;\n\
         st.global.f32 [%rd4+2056], %f7;\n st.global.f32 [%rd4+2060], %f8;"
    );
    let out = run_io("", &body, 32, &input, 32 * 16).unwrap_or_else(|e| panic!("{e}"));
    let w = words(&out[2048..]);
    (0..32).map(|l| [0, 1, 2, 3].map(|i| f32::from_bits(w[4 * l + i]))).collect()
}

/// D = A B + C in f64 over the first `k` columns of A, rounded once to f32.
fn mma_expect(
    kind: Kind,
    k: usize,
    a: &[[u16; 16]; 16],
    b: &[[u16; 8]; 16],
    c: &[[f32; 8]; 16],
    row: usize,
    col: usize,
) -> f32 {
    let mut s = c[row][col] as f64;
    for kk in 0..k {
        s += kind.dec(a[row][kk]) * kind.dec(b[kk][col]);
    }
    s as f32
}

fn check_mma(kind: Kind, k: usize, exact: bool) {
    let mut a = [[0u16; 16]; 16];
    let mut b = [[0u16; 8]; 16];
    let mut c = [[0f32; 8]; 16];
    let mut seed = 0x9E37_79B9_7F4A_7C15u64 ^ (k as u64) ^ (exact as u64) << 8;
    let mut rnd = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    for (i, (ar, (br, cr))) in a.iter_mut().zip(b.iter_mut().zip(c.iter_mut())).enumerate() {
        for (j, e) in ar.iter_mut().enumerate() {
            // Small integers and halves (exact in both formats, exact sums) or random values.
            *e = kind.enc(if exact { ((i * 7 + j * 3) % 11) as f32 * 0.5 - 2.0 } else { rnd() * 3.0 });
        }
        for (j, (be, ce)) in br.iter_mut().zip(cr.iter_mut()).enumerate() {
            *be = kind.enc(if exact { ((i * 5 + j * 13) % 9) as f32 - 4.0 } else { rnd() });
            *ce = if exact { (i * 8 + j) as f32 * 0.25 } else { rnd() * 1e-3 };
        }
    }
    let d = run_mma(kind, k, &a, &b, &c);
    for (lane, dl) in d.iter().enumerate() {
        let (g, t) = (lane / 4, lane % 4);
        for (i, (row, col)) in [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)].into_iter().enumerate()
        {
            let want = mma_expect(kind, k, &a, &b, &c, row, col);
            assert_eq!(
                dl[i].to_bits(),
                want.to_bits(),
                "{kind:?} k{k} exact={exact} lane {lane} d{i}: {} vs {want}",
                dl[i]
            );
            if exact {
                // Independently: integer-valued sums are exact.
                let mut s = c[row][col] as f64;
                for kk in 0..k {
                    s += (((row * 7 + kk * 3) % 11) as f64 * 0.5 - 2.0) * (((kk * 5 + col * 13) % 9) as f64 - 4.0);
                }
                assert_eq!(dl[i] as f64, s);
            }
        }
    }
}

#[test]
fn mma_m16n8k16_f16_bf16() {
    for kind in [Kind::F16, Kind::Bf16] {
        check_mma(kind, 16, true);
        check_mma(kind, 16, false);
    }
}

#[test]
fn mma_m16n8k8_f16_bf16() {
    for kind in [Kind::F16, Kind::Bf16] {
        check_mma(kind, 8, true);
        check_mma(kind, 8, false);
    }
}

#[test]
fn mma_rounds_once_to_f32() {
    // Row 0 of A = [2^-12, 2^-12, 0, ..], column 0 of B likewise, C = 1: the exact sum 1 + 2^-23 is
    // an f32; two separate f32 additions of 2^-24 would each round back to 1.
    let kind = Kind::F16;
    let tiny = kind.enc(2f32.powi(-12));
    let mut a = [[0u16; 16]; 16];
    let mut b = [[0u16; 8]; 16];
    let c = [[1.0f32; 8]; 16];
    a[0][0] = tiny;
    a[0][1] = tiny;
    b[0][0] = tiny;
    b[1][0] = tiny;
    let d = run_mma(kind, 16, &a, &b, &c);
    assert_eq!(d[0][0], 1.0 + 2f32.powi(-23));
    assert_eq!(d[0][1], 1.0);
}

/// Stored row `p` (of 32) of the shared pattern: 8 b16 values.
fn ld_row(p: usize) -> [u16; 8] {
    std::array::from_fn(|c| (0x1000 + p * 16 + c) as u16)
}

/// Lane `l`'s row address for `ldmatrix`: stored row `(5 l + 3) % 32` (a permutation).
fn ld_perm(l: usize) -> usize {
    (5 * l + 3) % 32
}

#[test]
fn ldmatrix_x1_x2_x4_plain_and_trans() {
    let mut input = vec![0u8; 512];
    for p in 0..32 {
        for (c, v) in ld_row(p).iter().enumerate() {
            input[p * 16 + 2 * c..p * 16 + 2 * c + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    let decls = ".shared .align 16 .b8 sm[512];";
    // Stage the pattern, then each variant: lanes past 8 x num give an address far outside the
    // window, which ldmatrix must ignore.
    let mut body = String::from(
        "mov.u32 %r1, %laneid;\n mul.wide.u32 %rd1, %r1, 16;\n add.s64 %rd2, %rd0, %rd1;\n\
         ld.global.v2.b64 {%rd3, %rd4}, [%rd2];\n mov.u32 %r2, sm;\n mul.lo.u32 %r3, %r1, 16;\n add.u32 %r4, %r2, %r3;\n\
         st.shared.v2.b64 [%r4], {%rd3, %rd4};\n bar.sync 0;\n\
         mul.lo.u32 %r5, %r1, 5;\n add.u32 %r5, %r5, 3;\n rem.u32 %r5, %r5, 32;\n mul.lo.u32 %r5, %r5, 16;\n\
         add.u32 %r5, %r2, %r5;\n add.s64 %rd5, %rd2, 512;\n",
    );
    let mut v = 0;
    for num in [1, 2, 4] {
        for trans in [false, true] {
            let regs = ["%r10", "%r11", "%r12", "%r13"][..num].join(", ");
            let tr = if trans { ".trans" } else { "" };
            body += &format!(
                "setp.lt.u32 %p1, %r1, {lim};\n selp.b32 %r6, %r5, 0x7ffffff0, %p1;\n\
                 mov.b32 %r10, 0;\n mov.b32 %r11, 0;\n mov.b32 %r12, 0;\n mov.b32 %r13, 0;\n\
                 ldmatrix.sync.aligned.m8n8.x{num}{tr}.shared.b16 {{{regs}}}, [%r6];\n\
                 st.global.v4.b32 [%rd5+{o}], {{%r10, %r11, %r12, %r13}};\n",
                lim = 8 * num,
                o = v * 512,
            );
            v += 1;
        }
    }
    let out = run_io(decls, &body, 32, &input, 6 * 512).unwrap_or_else(|e| panic!("{e}"));
    let w = words(&out[512..]);
    let mut v = 0;
    for num in [1usize, 2, 4] {
        for trans in [false, true] {
            for lane in 0..32 {
                let (g, t) = (lane / 4, lane % 4);
                for reg in 0..4 {
                    let got = w[v * 128 + lane * 4 + reg];
                    let want = if reg >= num {
                        0
                    } else {
                        // Matrix `reg`: row i is the stored row lane 8 reg + i addressed.
                        let row = |i: usize| ld_row(ld_perm(8 * reg + i));
                        if trans {
                            pack(row(2 * t)[g], row(2 * t + 1)[g])
                        } else {
                            pack(row(g)[2 * t], row(g)[2 * t + 1])
                        }
                    };
                    assert_eq!(got, want, "x{num} trans={trans} lane {lane} reg {reg}: {got:#x} vs {want:#x}");
                }
            }
            v += 1;
        }
    }
}

#[test]
fn cp_async_zero_fill_groups_and_wait() {
    // Source: 32 rows of 16 bytes, no zero byte. The first copy carries the `::` qualifiers the
    // kernels emit (`.shared::cta`, the `.L2::128B` prefetch hint), which change nothing here.
    let input: Vec<u8> = (0..512).map(|i| (i % 251) as u8 + 1).collect();
    let decls = ".shared .align 16 .b8 sm[1536];";
    let body = "mov.u32 %r1, %laneid;\n mov.u32 %r2, sm;\n mul.lo.u32 %r3, %r1, 16;\n add.u32 %r4, %r2, %r3;\n\
        mul.wide.u32 %rd1, %r1, 16;\n add.s64 %rd2, %rd0, %rd1;\n rem.u32 %r5, %r1, 17;\n\
        cp.async.cg.shared::cta.global.L2::128B [%r4], [%rd2], 16, %r5;\n\
        ld.shared.b32 %r6, [%r4];\n\
        cp.async.commit_group;\n\
        ld.shared.b32 %r7, [%r4];\n\
        add.u32 %r8, %r4, 512;\n\
        cp.async.ca.shared.global [%r8], [%rd2], 16;\n\
        cp.async.commit_group;\n\
        cp.async.wait_group 1;\n\
        ld.shared.v4.b32 {%r10, %r11, %r12, %r13}, [%r4];\n\
        ld.shared.b32 %r14, [%r8];\n\
        st.global.u32 [%rd2], 0xABCDEF01;\n\
        mul.lo.u32 %r20, %r1, 4;\n add.u32 %r20, %r20, 1024;\n add.u32 %r20, %r20, %r2;\n\
        cp.async.ca.shared.global [%r20], [%rd2+4], 4;\n\
        cp.async.wait_group 0;\n\
        ld.shared.b32 %r21, [%r20];\n\
        cp.async.wait_all;\n\
        ld.shared.v4.b32 {%r16, %r17, %r18, %r19}, [%r8];\n\
        ld.shared.b32 %r22, [%r20];\n\
        mul.wide.u32 %rd3, %r1, 64;\n add.s64 %rd4, %rd0, %rd3;\n\
        st.global.v4.b32 [%rd4+512], {%r6, %r7, %r14, %r21};\n\
        st.global.v4.b32 [%rd4+528], {%r10, %r11, %r12, %r13};\n\
        st.global.v4.b32 [%rd4+544], {%r16, %r17, %r18, %r19};\n\
        st.global.u32 [%rd4+560], %r22;";
    // Initcheck off to observe the poison a too-early read returns; with it on (the default) the
    // first read before the wait is itself the finding.
    let early = finding_of(run_io(decls, body, 32, &input, 32 * 64));
    assert_eq!(early.kind, "uninitialized shared memory read", "{early:?}");
    assert_eq!(early.instruction, "ld.shared.b32 %r6, [%r4];");
    let out = run_io_with(decls, body, 32, &input, 32 * 64, false).unwrap_or_else(|e| panic!("{e}"));
    let w = words(&out[512..]);
    for lane in 0..32usize {
        let o = &w[lane * 16..lane * 16 + 16];
        let src: Vec<u8> = input[lane * 16..lane * 16 + 16].to_vec();
        let n = lane % 17;
        assert_eq!(o[0], SHARED_POISON, "lane {lane}: issued, not committed: the destination is untouched");
        assert_eq!(o[1], SHARED_POISON, "lane {lane}: committed, not waited for");
        assert_eq!(o[2], SHARED_POISON, "lane {lane}: wait_group 1 leaves the newest group pending");
        assert_eq!(o[3], SHARED_POISON, "lane {lane}: wait_group 0 does not wait for uncommitted copies");
        let mut first = [0u8; 16];
        first[..n].copy_from_slice(&src[..n]);
        assert_eq!(&o[4..8], &words(&first)[..], "lane {lane}: {n} bytes copied, the rest zero-filled");
        // The second copy read the source when it completed, after the store of 0xABCDEF01.
        let mut second = src.clone();
        second[..4].copy_from_slice(&0xABCD_EF01u32.to_le_bytes());
        assert_eq!(&o[8..12], &words(&second)[..], "lane {lane}: second copy");
        assert_eq!(o[12], words(&src[4..8])[0], "lane {lane}: wait_all completes uncommitted copies");
    }
}

#[test]
fn cp_async_memcheck() {
    let decls = ".shared .align 16 .b8 sm[64];";
    let pre = "mov.u32 %r2, sm;\n";
    // The source range is checked for the n bytes read: the last 4 bytes of a 32-byte buffer,
    // with n = 4, are fine; n = 0 reads nothing, so any source address is fine.
    let ok = format!(
        "{pre}cp.async.ca.shared.global [%r2], [%rd0+28], 4, 4;\n\
         cp.async.cg.shared.global [%r2+16], [%rd0+16], 16, 0;\n\
         mov.u64 %rd1, 0;\n cp.async.cg.shared.global [%r2+32], [%rd1], 16, 0;\n\
         cp.async.cg.shared.global [%r2+48], [%rd0+16], 16, 16;\n cp.async.wait_all;"
    );
    run_io(decls, &ok, 1, &[0u8; 32], 0).unwrap_or_else(|e| panic!("{e}"));
    let oob = format!("{pre}cp.async.ca.shared.global [%r2], [%rd0+24], 8, 8; // SRC");
    let f = finding_of(run_io(decls, &oob, 1, &[0u8; 28], 0));
    assert_eq!(f.kind, "out-of-bounds global load");
    assert_eq!(f.access_bytes, Some(8));
    assert_eq!(f.line, line_of(&kernel(decls, &oob), "// SRC"));
    assert!(f.instruction.starts_with("cp.async.ca"), "{f:?}");
    let f =
        finding_of(run_io(decls, &format!("{pre}cp.async.cg.shared.global [%r2+8], [%rd0], 16;"), 1, &[0u8; 32], 0));
    assert_eq!(f.kind, "misaligned access", "{f:?}");
    let f = finding_of(run_io(
        decls,
        &format!("{pre}cp.async.cg.shared.global [%r2+64], [%rd0], 16, 0;"),
        1,
        &[0u8; 32],
        0,
    ));
    assert_eq!(f.kind, "shared memory out of window", "{f:?}");
    let f = finding_of(run_io(decls, &format!("{pre}cp.async.ca.shared.global [%r2], [%rd0+4], 8;"), 1, &[0u8; 32], 0));
    assert_eq!(f.kind, "misaligned access", "source aligned to the copy size: {f:?}");
    let f = finding_of(run_io(
        decls,
        &format!("{pre}mov.u32 %r3, 20;\n cp.async.cg.shared.global [%r2], [%rd0], 16, %r3;"),
        1,
        &[0u8; 32],
        0,
    ));
    assert_eq!(f.kind, "cp.async source size exceeds the copy size", "{f:?}");
}

#[test]
fn cp_async_of_two_warps_to_overlapping_words_is_a_race_at_the_first_lane() {
    // Warp 0 copies 16 bytes per lane to sm[16 l ..] (512 bytes), then warp 1 copies to
    // sm[256 + 16 l ..] with no barrier between: its lanes 0..15 write words warp 0 wrote. The
    // report names lane 0 of warp 1 (thread 32), shared word 256 and warp 0's copy. Ordered by a
    // barrier, the same copies complete and the bytes are those of the source.
    let decls = ".shared .align 16 .b8 sm[1024];";
    let copy = |sep: &str| {
        format!(
            "mov.u32 %r1, %tid.x;\n and.b32 %r2, %r1, 31;\n mul.lo.u32 %r3, %r2, 16;\n mov.u32 %r4, sm;\n\
             add.u32 %r5, %r4, %r3;\n mul.wide.u32 %rd1, %r3, 1;\n add.s64 %rd2, %rd0, %rd1;\n\
             setp.ge.u32 %p1, %r1, 32;\n @!%p1 cp.async.cg.shared.global [%r5], [%rd2], 16; // W0\n\
             {sep}\n @%p1 cp.async.cg.shared.global [%r5+256], [%rd2], 16; // W1\n\
             cp.async.wait_all;\n bar.sync 0;\n ld.shared.u32 %r6, [%r5+256];\n mul.wide.u32 %rd3, %r1, 4;\n\
             add.s64 %rd4, %rd0, %rd3;\n st.global.u32 [%rd4+512], %r6;"
        )
    };
    let input: Vec<u8> = (0..512u32).map(|i| (i * 7 + 3) as u8).collect();
    let body = copy("");
    let f = finding_of(run_io(decls, &body, 64, &input, 256));
    let src = kernel(decls, &body);
    assert_eq!(
        (f.kind.as_str(), f.line, f.thread),
        ("shared memory race", line_of(&src, "// W1"), [32, 0, 0]),
        "{f:?}"
    );
    assert_eq!((f.address, f.access_bytes), (Some(256), Some(16)), "{f:?}");
    let c = f.conflict.clone().expect("a race names the other access");
    assert_eq!((c.warp, c.write, c.line), (0, true, line_of(&src, "// W0")), "{f:?}");
    // Each warp on its own side of a barrier: no race; thread t reads sm[256 + 16 (t % 32)],
    // which warp 1's copy wrote last: the first 4 source bytes of its lane.
    let out =
        run_io(decls, &copy("cp.async.wait_all;\n bar.sync 0;"), 64, &input, 256).unwrap_or_else(|e| panic!("{e}"));
    for t in 0..64usize {
        let l = t % 32;
        assert_eq!(&out[512 + 4 * t..][..4], &input[16 * l..][..4], "thread {t}");
    }
}

#[test]
fn ldmatrix_memcheck() {
    let decls = ".shared .align 16 .b8 sm[512];";
    let body = "mov.u32 %r1, %laneid;\n mov.u32 %r2, sm;\n mul.lo.u32 %r3, %r1, 16;\n add.u32 %r4, %r2, %r3;\n\
        setp.eq.u32 %p1, %r1, 13;\n @%p1 add.u32 %r4, %r4, 8;\n\
        ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r10, %r11, %r12, %r13}, [%r4];";
    // Nothing was written: with initcheck on, lane 0's row is the first finding.
    let f = finding_of(run_io(decls, body, 32, &[], 0));
    assert_eq!((f.kind.as_str(), f.thread), ("uninitialized shared memory read", [0, 0, 0]));
    // Address checks alone (initcheck off).
    let f = finding_of(run_io_with(decls, body, 32, &[], 0, false));
    assert_eq!(f.kind, "misaligned access");
    assert_eq!(f.thread, [13, 0, 0]);
    let body = "mov.u32 %r1, %laneid;\n mov.u32 %r2, sm;\n mul.lo.u32 %r3, %r1, 32;\n add.u32 %r4, %r2, %r3;\n\
        ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r10, %r11, %r12, %r13}, [%r4];";
    let f = finding_of(run_io_with(decls, body, 32, &[], 0, false));
    assert_eq!(f.kind, "shared memory out of window");
    assert_eq!(f.thread, [16, 0, 0]);
}

const MMA: &str = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f5, %f6, %f7, %f8}, {%r2, %r3, %r4, %r5}, \
                   {%r6, %r7}, {%f1, %f2, %f3, %f4};";

#[test]
fn divergent_mma_and_ldmatrix_are_findings() {
    let guarded = format!("mov.u32 %r1, %laneid;\n setp.lt.u32 %p1, %r1, 16;\n @%p1 {MMA} // MMA");
    let f = finding_of(run_io("", &guarded, 32, &[], 0));
    assert_eq!(f.kind, "warp collective divergence");
    assert!(f.instruction.contains("mma.sync.aligned.m16n8k16"), "{f:?}");
    assert_eq!(f.line, line_of(&kernel("", &guarded), "// MMA"));
    assert!(f.nearest_allocation.as_deref().unwrap().contains("0xffff0000"), "{f:?}");
    // Branch divergence: the two halves reach the mma at different times.
    let branched = format!(
        "mov.u32 %r1, %laneid;\n setp.lt.u32 %p1, %r1, 8;\n @%p1 bra SKIP;\n {MMA}\n SKIP:\n add.u32 %r9, %r1, 1;"
    );
    let f = finding_of(run_io("", &branched, 32, &[], 0));
    assert_eq!(f.kind, "warp collective divergence");
    // A partial warp (16 threads) cannot run a warp-wide mma.
    let f = finding_of(run_io("", MMA, 16, &[], 0));
    assert_eq!(f.kind, "warp collective divergence");
    let ld = "mov.u32 %r1, %laneid;\n setp.eq.u32 %p1, %r1, 31;\n mov.u32 %r2, sm;\n\
              @!%p1 ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%r10}, [%r2];";
    let f = finding_of(run_io(".shared .align 16 .b8 sm[512];", ld, 32, &[], 0));
    assert_eq!(f.kind, "warp collective divergence");
    assert!(f.instruction.contains("ldmatrix.sync"), "{f:?}");
    // Predicated off for the whole warp: nothing happens.
    run_io("", &format!("setp.eq.u32 %p1, 1, 0;\n @%p1 {MMA}"), 32, &[], 0).unwrap();
}

/// A branch whose join block is laid out between its two paths (as LLVM's block placement often
/// does): the lanes on the path before the join reach the collectives after it first. The warp
/// reconverges there, as the hardware does, and every collective sees all 32 lanes.
#[test]
fn a_join_laid_out_before_one_path_reconverges_before_its_collectives() {
    let decls = ".shared .align 16 .b8 sm[512];";
    let body =
        "mov.u32 %r1, %laneid;\n mov.u32 %r2, sm;\n mul.lo.u32 %r3, %r1, 16;\n add.u32 %r4, %r2, %r3;\n\
         mul.lo.u32 %r20, %r1, 4;\n add.u32 %r21, %r2, %r20;\n st.shared.u32 [%r21], %r1;\n\
         st.shared.u32 [%r21+128], %r1;\n st.shared.u32 [%r21+256], %r1;\n st.shared.u32 [%r21+384], %r1;\n\
         bar.warp.sync -1;\n\
         setp.lt.u32 %p1, %r1, 16;\n @%p1 bra LOW;\n bra.uni HIGH;\n\
         LOW:\n mov.u32 %r5, 100;\n\
         JOIN:\n shfl.sync.bfly.b32 %r6, %r5, 16, 31, -1; // SHFL\n\
         ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%r7}, [%r4]; // LDSM\n\
         mul.wide.u32 %rd1, %r1, 8;\n add.s64 %rd2, %rd0, %rd1;\n st.global.u32 [%rd2], %r6;\n st.global.u32 [%rd2+4], %r7;\n\
         bra.uni END;\n\
         HIGH:\n mov.u32 %r5, 200;\n bra.uni JOIN;\n\
         END:"
        .to_string();
    let o = run_io(decls, &body, 32, &[], 32 * 8).unwrap_or_else(|e| panic!("{e}"));
    let w: Vec<u32> = o.chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
    for l in 0..32usize {
        // The butterfly across the halves: each half reads the other half's path value.
        assert_eq!(w[2 * l], if l < 16 { 200 } else { 100 }, "shfl lane {l}");
        // x1: lane l gets the 32-bit word l % 4 of row l / 4 (row r at lane r's address, shared
        // words 4r..4r+3); shared word i holds i.
        let word = 4 * (l / 4) as u32 + (l % 4) as u32;
        assert_eq!(w[2 * l + 1], word, "ldmatrix lane {l}");
    }
    // A path that never reaches the collectives: the upper half exits before the join. A
    // shuffle's member lanes that have exited are not counted as missing, but the butterfly
    // reads them (xor 16), and what an exited lane gives is undefined: that is the finding.
    let exited = body.replace("HIGH:\n mov.u32 %r5, 200;\n bra.uni JOIN;", "HIGH:\n ret;");
    let f = finding_of(run_io(decls, &exited, 32, &[], 32 * 8));
    assert_eq!(f.kind, "shuffle from an exited lane", "{f:?}");
    assert_eq!(f.line, line_of(&kernel(decls, &exited), "// SHFL"));
    // Without the shuffle the aligned ldmatrix, which needs all 32 lanes, is divergence, found
    // once the waiting lanes can be joined by nobody.
    let no_shfl = exited.replace("shfl.sync.bfly.b32 %r6, %r5, 16, 31, -1; // SHFL", "mov.u32 %r6, %r5;");
    let f = finding_of(run_io(decls, &no_shfl, 32, &[], 32 * 8));
    assert_eq!(f.kind, "warp collective divergence", "{f:?}");
    assert_eq!(f.line, line_of(&kernel(decls, &no_shfl), "// LDSM"));
    // Two halves parked at two different collectives wait for each other: divergence, not a hang.
    let crossed = body.replace(
        "HIGH:\n mov.u32 %r5, 200;\n bra.uni JOIN;",
        "HIGH:\n mov.u32 %r5, 200;\n bra.uni LD2;\n LD2:\n ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%r8}, [%r4];",
    );
    let f = finding_of(run_io(decls, &crossed, 32, &[], 32 * 8));
    assert_eq!(f.kind, "warp collective divergence", "{f:?}");
}

#[test]
fn cvt_packed_rounding() {
    // 0x3F808001 = 1.0039063..: truncating to bf16 gives 0x3F80, nearest gives 0x3F81.
    // 1 + 2^-11 + 2^-20 in f16: truncation 0x3C00, nearest 0x3C01. 1 + 2^-11 exactly: a tie, to even (0x3C00).
    let a = 0x3F80_8001u32;
    let b = (1.0f32 + 2f32.powi(-11) + 2f32.powi(-20)).to_bits();
    let tie = (1.0f32 + 2f32.powi(-11)).to_bits();
    let body = format!(
        "mov.b32 %f1, 0x{a:08x};\n mov.b32 %f2, 0x{b:08x};\n mov.b32 %f3, 0x{tie:08x};\n mov.b32 %f4, 0xC0490FDB;\n\
         cvt.rn.bf16x2.f32 %r1, %f1, %f4;\n st.global.u32 [%rd0], %r1;\n\
         cvt.rz.bf16x2.f32 %r2, %f1, %f4;\n st.global.u32 [%rd0+4], %r2;\n\
         cvt.rn.f16x2.f32 %r3, %f2, %f3;\n st.global.u32 [%rd0+8], %r3;\n\
         cvt.rz.f16x2.f32 %r4, %f2, %f4;\n st.global.u32 [%rd0+12], %r4;\n\
         cvt.rn.bf16.f32 %h1, %f1;\n st.global.u16 [%rd0+16], %h1;"
    );
    let o = run1(&body, 5);
    assert_eq!(o[4], 0x3F81, "scalar cvt.rn.bf16.f32 rounds the same way");
    let pi_bf_rn = bf16::from_f32(f32::from_bits(0xC049_0FDB)).to_bits() as u32; // -3.1415927
    assert_eq!(pi_bf_rn, 0xC049);
    assert_eq!(o[0], 0x3F81 << 16 | pi_bf_rn, "{:#x}", o[0]);
    assert_eq!(o[1], 0x3F80 << 16 | 0xC049, "{:#x}", o[1]);
    assert_eq!(o[2], 0x3C01 << 16 | 0x3C00, "{:#x}", o[2]);
    // -3.1415927 in f16: nearest is 0xC248, toward zero 0xC248 too (-3.140625).
    assert_eq!(o[3], 0x3C00 << 16 | 0xC248, "{:#x}", o[3]);
}

#[test]
fn trace_records_tensor_core_destinations() {
    let body = format!(
        "mov.b32 %r2, 0x3F803F80;\n mov.b32 %r3, 0;\n mov.b32 %r4, 0;\n mov.b32 %r5, 0;\n\
         mov.b32 %r6, 0x40004000;\n mov.b32 %r7, 0;\n mov.f32 %f1, 0f3F800000;\n mov.f32 %f2, 0f00000000;\n\
         mov.f32 %f3, 0f00000000;\n mov.f32 %f4, 0f00000000;\n {MMA}"
    );
    let src = kernel("", &body);
    let m = Module::load(&src).unwrap();
    let mut vm = Vm::with_workers(1);
    let buf = vm.alloc(4).unwrap();
    let mut cfg = LaunchConfig::new([1, 1, 1], [32, 1, 1], 0);
    cfg.trace = Some(TraceRequest { block: [0, 0, 0], thread: [0, 0, 0], max_entries: 100 });
    let st = vm.launch(&m, "t", &cfg, &buf.to_le_bytes()).unwrap();
    let e = st.trace.iter().find(|e| e.text.starts_with("mma.sync")).expect("mma traced");
    // Every lane holds a0 = (1, 1) and b0 = (2, 2): A[m][0..8] = 1, B[0..8][n] = 2, the rest 0.
    // Lane 0: D[0][0] = C 1 + 8 * 2 = 17.
    let names: Vec<&str> = e.writes.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["%f5", "%f6", "%f7", "%f8"]);
    assert_eq!(f32::from_bits(e.writes[0].1 as u32), 17.0);
    assert_eq!(f32::from_bits(e.writes[1].1 as u32), 16.0);
}
