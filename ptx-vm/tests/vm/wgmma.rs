//! Hopper warpgroup MMA: `wgmma.mma_async.sync.aligned.m64nNk16` (f16 / bf16, f32 and f16
//! accumulators, descriptor and register A, K-major and MN-major operands in every swizzle mode),
//! `wgmma.fence` / `commit_group` / `wait_group`, and the findings around them.
//!
//! The expected values come from the PTX ISA, written out here independently of the VM: operands
//! are placed in shared memory with the ISA's canonical layouts (section 9.7.15.5.1.2.1.3, the CuTe
//! shape:stride table, evaluated literally below) and the CuTe swizzle functor
//! `Swizzle<B, 4, 3>` on the byte address, and D is read back with the accumulator fragment map
//! of section 9.7.15.5.1.1.1.

use crate::util;
use half::{bf16, f16};
use ptx_vm::{Finding, LaunchConfig, Module, Vm, VmError};
use util::{line_of, Rng};

#[derive(Clone, Copy, Debug, PartialEq)]
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

/// One shared-memory operand: where it starts, which way it is stored, how it is strided.
#[derive(Clone, Copy, Debug)]
struct Layout {
    mn_major: bool,
    /// 0 (none / interleave), 32, 64 or 128 bytes.
    swizzle: u32,
    /// Shared byte offset of element (0, 0) before swizzling (aligned to the pattern).
    base: u32,
    lbo: u32,
    sbo: u32,
}

/// A CuTe layout mode evaluated at index `x`: colexicographic over `shape`, the last sub-mode
/// unbounded (it is the repeat count m or k of the canonical layouts).
fn eval(x: u32, shape: &[u32], stride: &[u32]) -> u32 {
    let (mut x, mut off) = (x, 0);
    for (i, (&s, &d)) in shape.iter().zip(stride).enumerate() {
        if i + 1 == shape.len() {
            return off + x * d;
        }
        off += (x % s) * d;
        x /= s;
    }
    off
}

/// CuTe's `Swizzle<B, 4, 3>` on a byte address (B = 0, 1, 2, 3 for none, 32B, 64B, 128B).
fn cute_swizzle(bits: u32, addr: u32) -> u32 {
    let yyy = ((1u32 << bits) - 1) << 7;
    addr ^ ((addr & yyy) >> 3)
}

impl Layout {
    fn k_major(swizzle: u32, base: u32, lbo: u32, sbo: u32) -> Layout {
        Layout { mn_major: false, swizzle, base, lbo, sbo }
    }
    fn mn_major(swizzle: u32, base: u32, lbo: u32, sbo: u32) -> Layout {
        Layout { mn_major: true, swizzle, base, lbo, sbo }
    }
    fn mode_bits(&self) -> u64 {
        match self.swizzle {
            0 => 0,
            128 => 1,
            64 => 2,
            32 => 3,
            s => panic!("swizzle {s}"),
        }
    }
    /// Unswizzled byte address of element (mn, k) of a 16-bit operand: the ISA's canonical
    /// layouts with T = 8 elements (16 bytes), in elements, then 2 bytes per element.
    fn logical(&self, mn: u32, k: u32) -> u32 {
        const T: u32 = 8;
        let (l, s) = (self.lbo / 2, self.sbo / 2);
        let w = self.swizzle / 16; // 16-byte chunks per swizzled row
        let e = match (self.mn_major, self.swizzle) {
            // ((8,m),(T,2k)) : ((1T,SBO),(1,LBO))
            (false, 0) => eval(mn, &[8, 0], &[T, s]) + eval(k, &[T, 0], &[1, l]),
            // ((8,m),(T,2k)) : ((wT,SBO),(1,T))
            (false, _) => eval(mn, &[8, 0], &[w * T, s]) + eval(k, &[T, 0], &[1, T]),
            // ((T,1,m),(8,k)) : ((1,T,SBO),(1T,LBO))
            (true, 0) => eval(mn, &[T, 1, 0], &[1, T, s]) + eval(k, &[8, 0], &[T, l]),
            // ((T,w,m),(8,k)) : ((1,T,LBO),(wT,SBO))
            (true, _) => eval(mn, &[T, w, 0], &[1, T, l]) + eval(k, &[8, 0], &[w * T, s]),
        };
        self.base + 2 * e
    }
    fn physical(&self, mn: u32, k: u32) -> u32 {
        let bits = [0, 0, 1, 0, 2, 0, 0, 0, 3][(self.swizzle / 16) as usize];
        cute_swizzle(bits, self.logical(mn, k))
    }
    /// The descriptor of the 16-wide K slice starting at column `k0`.
    fn desc(&self, k0: u32) -> u64 {
        let start = self.logical(0, k0);
        assert!((start | self.lbo | self.sbo).is_multiple_of(16));
        (start as u64 >> 4) | ((self.lbo as u64 >> 4) << 16) | ((self.sbo as u64 >> 4) << 32) | (self.mode_bits() << 62)
    }
}

/// Row and column of accumulator element `i` of thread `t` (0..128) of the warpgroup (ISA
/// figure "WGMMA .m64nNk16 register fragment layout for accumulator matrix D").
fn d_coord(t: usize, i: usize) -> (usize, usize) {
    let (w, lane) = (t / 32, t % 32);
    (16 * w + lane / 4 + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * (lane % 4) + (i & 1))
}

/// Row and column of the low half of A register `r` of thread `t` (the A fragment figure:
/// per warp, mma.m16n8k16's A on the warp's 16 rows).
fn a_coord(t: usize, r: usize) -> (usize, usize) {
    let (w, lane) = (t / 32, t % 32);
    (16 * w + lane / 4 + 8 * (r % 2), 2 * (lane % 4) + 8 * (r / 2))
}

#[derive(Clone, Copy, Debug)]
enum ScaleD {
    /// Immediate 0.
    Zero,
    /// Immediate 1.
    One,
    /// A predicate loaded from the input.
    Pred(bool),
}

#[derive(Clone, Debug)]
struct Case {
    n: u32,
    kind: Kind,
    /// `.f16` accumulators (else `.f32`).
    acc16: bool,
    /// A in shared memory (`None`: in registers).
    a: Option<Layout>,
    b: Layout,
    /// k16 steps chained on one accumulator.
    steps: u32,
    /// Advance the descriptors in the kernel by 32 bytes per step (K-major swizzled operands,
    /// as kernels walk a 128B-swizzled row) instead of loading each step's descriptor.
    advance_in_ptx: bool,
    scale_d: ScaleD,
    neg_a: bool,
    neg_b: bool,
    threads: u32,
}

impl Case {
    fn new(n: u32, kind: Kind, a: Option<Layout>, b: Layout) -> Case {
        Case {
            n,
            kind,
            acc16: false,
            a,
            b,
            steps: 1,
            advance_in_ptx: false,
            scale_d: ScaleD::Pred(true),
            neg_a: false,
            neg_b: false,
            threads: 128,
        }
    }
    fn nd(&self) -> usize {
        (if self.acc16 { self.n / 4 } else { self.n / 2 }) as usize
    }
}

const HDR: usize = 256;
const SMEM: usize = 40960;

/// Byte offsets in the I/O buffer of thread `t`'s D input, D output and A registers.
fn thread_io(c: &Case, t: usize) -> (usize, usize, usize) {
    let per = 8 * c.nd() + 16;
    let at = HDR + SMEM + t * per;
    (at, at + 4 * c.nd(), at + 8 * c.nd())
}

/// The kernel of a case; `before` goes just before the `wgmma.fence`, `between` just after the
/// `wgmma.commit_group`.
fn kernel(c: &Case, between: &str, before: &str) -> String {
    let ty = c.kind.name();
    let dty = if c.acc16 { "f16" } else { "f32" };
    let nd = c.nd();
    let dreg = |i: usize| if c.acc16 { format!("%h{i}") } else { format!("%f{i}") };
    let dlist = (0..nd).map(dreg).collect::<Vec<_>>().join(", ");
    let (din, dout, areg) = thread_io(c, 0);
    let per = 8 * nd + 16;
    let mut body = String::new();
    let mut line = |s: &str| {
        body.push('\t');
        body.push_str(s);
        body.push('\n');
    };
    line("ld.param.u64 %rd0, [t_param_0];");
    line("mov.u32 %r1, %tid.x;");
    line("mov.u32 %r6, smem;");
    // Copy the shared image in, one word per thread per iteration.
    line("mov.u32 %r2, %r1;");
    line("COPY:");
    line(&format!("setp.ge.u32 %p0, %r2, {};", SMEM / 4));
    line("@%p0 bra COPIED;");
    line("mul.wide.u32 %rd1, %r2, 4;");
    line("add.s64 %rd2, %rd0, %rd1;");
    line(&format!("ld.global.u32 %r3, [%rd2+{HDR}];"));
    line("shl.b32 %r4, %r2, 2;");
    line("add.u32 %r5, %r6, %r4;");
    line("st.shared.u32 [%r5], %r3;");
    line(&format!("add.u32 %r2, %r2, {};", c.threads));
    line("bra COPY;");
    line("COPIED:");
    line("bar.sync 0;");
    line("fence.proxy.async.shared::cta;");
    line(&format!("mul.wide.u32 %rd3, %r1, {per};"));
    line("add.s64 %rd4, %rd0, %rd3;");
    for i in 0..nd {
        let ld = if c.acc16 { "ld.global.b32" } else { "ld.global.f32" };
        line(&format!("{ld} {}, [%rd4+{}];", dreg(i), din + 4 * i));
    }
    if c.a.is_none() {
        for r in 0..4 {
            line(&format!("ld.global.b32 %r{}, [%rd4+{}];", 20 + r, areg + 4 * r));
        }
    }
    line("ld.global.u32 %r7, [%rd0+16];");
    line("setp.ne.u32 %p1, %r7, 0;");
    for s in 0..c.steps as usize {
        if c.advance_in_ptx && s > 0 {
            line(&format!("add.s64 %rd{}, %rd{}, 2;", 10 + s, 9 + s));
            line(&format!("add.s64 %rd{}, %rd{}, 2;", 30 + s, 29 + s));
        } else {
            line(&format!("ld.global.u64 %rd{}, [%rd0+{}];", 10 + s, 32 + 8 * s));
            line(&format!("ld.global.u64 %rd{}, [%rd0+{}];", 30 + s, 128 + 8 * s));
        }
    }
    line(before);
    line("wgmma.fence.sync.aligned;");
    for s in 0..c.steps as usize {
        let scale = match (s, c.scale_d) {
            (0, ScaleD::Zero) => "0".to_string(),
            (0, ScaleD::Pred(_)) => "%p1".to_string(),
            _ => "1".to_string(),
        };
        let sa = if c.neg_a { -1 } else { 1 };
        let sb = if c.neg_b { -1 } else { 1 };
        let tb = c.b.mn_major as u32;
        let op = format!("wgmma.mma_async.sync.aligned.m64n{}k16.{dty}.{ty}.{ty}", c.n);
        match c.a {
            Some(a) => line(&format!(
                "{op} {{{dlist}}}, %rd{}, %rd{}, {scale}, {sa}, {sb}, {}, {tb}; // MMA{s}",
                10 + s,
                30 + s,
                a.mn_major as u32
            )),
            None => line(&format!(
                "{op} {{{dlist}}}, {{%r20, %r21, %r22, %r23}}, %rd{}, {scale}, {sa}, {sb}, {tb}; // MMA{s}",
                30 + s
            )),
        }
    }
    line("wgmma.commit_group.sync.aligned;");
    line(between);
    line("wgmma.wait_group.sync.aligned 0; // WAIT");
    for i in 0..nd {
        let st = if c.acc16 { "st.global.b32" } else { "st.global.f32" };
        line(&format!("{st} [%rd4+{}], {};", dout + 4 * i, dreg(i)));
    }
    format!(
        ".version 8.0\n.target sm_90a\n.address_size 64\n\n.visible .entry t(\n\t.param .u64 t_param_0\n)\n{{\n\
         \t.reg .pred %p<8>;\n\t.reg .b32 %r<32>;\n\t.reg .b64 %rd<64>;\n\t.reg .f32 %f<130>;\n\t.reg .b32 %h<70>;\n\
         \t.shared .align 1024 .b8 smem[{SMEM}];\n{body}\tret;\n}}\n"
    )
}

/// Inputs of a case: A (64 x 16 steps), B (16 steps x N, `b[k][n]`), D in (64 x N).
struct Data {
    a: Vec<Vec<u16>>,
    b: Vec<Vec<u16>>,
    d: Vec<Vec<f32>>,
}

fn data(c: &Case, seed: u64) -> Data {
    let mut rng = Rng(seed);
    let k = 16 * c.steps as usize;
    let n = c.n as usize;
    // Multiples of 1/8 and 1/16: every product and sum is exact in f32, so the result does not
    // depend on the order of additions.
    let mut val = |den: f32| (rng.below(33) as f32 - 16.0) / den;
    let a = (0..64).map(|_| (0..k).map(|_| c.kind.enc(val(8.0))).collect()).collect();
    let b = (0..k).map(|_| (0..n).map(|_| c.kind.enc(val(16.0))).collect()).collect();
    let d = (0..64).map(|_| (0..n).map(|_| val(4.0)).collect()).collect();
    Data { a, b, d }
}

/// The whole I/O buffer: header (scale-d flag, descriptors), shared image, per-thread D and A.
fn input(c: &Case, x: &Data) -> Vec<u8> {
    let mut buf = vec![0u8; HDR + SMEM + c.threads as usize * (8 * c.nd() + 16)];
    let scale = matches!(c.scale_d, ScaleD::Pred(true));
    buf[16..20].copy_from_slice(&(scale as u32).to_le_bytes());
    // Bytes the layout leaves unused hold a value that would show up in the result.
    let image = &mut buf[HDR..HDR + SMEM];
    for ch in image.chunks_mut(2) {
        ch.copy_from_slice(&c.kind.enc(1000.0).to_le_bytes());
    }
    let put = |image: &mut [u8], at: u32, v: u16| {
        let at = at as usize;
        image[at..at + 2].copy_from_slice(&v.to_le_bytes());
    };
    let k = 16 * c.steps;
    let mut used = std::collections::HashSet::new();
    if let Some(l) = c.a {
        for m in 0..64 {
            for kk in 0..k {
                let at = l.physical(m, kk);
                assert!(used.insert(at), "A layout places two elements at {at}");
                put(image, at, x.a[m as usize][kk as usize]);
            }
        }
    }
    for kk in 0..k {
        for n in 0..c.n {
            let at = c.b.physical(n, kk);
            assert!(used.insert(at), "B layout places two elements at {at}");
            put(image, at, x.b[kk as usize][n as usize]);
        }
    }
    for s in 0..c.steps {
        if let Some(l) = c.a {
            buf[32 + 8 * s as usize..40 + 8 * s as usize].copy_from_slice(&l.desc(16 * s).to_le_bytes());
        }
        buf[128 + 8 * s as usize..136 + 8 * s as usize].copy_from_slice(&c.b.desc(16 * s).to_le_bytes());
    }
    for t in 0..c.threads as usize {
        let (din, _, areg) = thread_io(c, t);
        let tw = t % 128;
        for i in 0..c.nd() {
            let word = if c.acc16 {
                let (r0, c0) = d_coord(tw, 2 * i);
                let (r1, c1) = d_coord(tw, 2 * i + 1);
                f16::from_f32(x.d[r0][c0]).to_bits() as u32 | (f16::from_f32(x.d[r1][c1]).to_bits() as u32) << 16
            } else {
                let (r, cc) = d_coord(tw, i);
                x.d[r][cc].to_bits()
            };
            buf[din + 4 * i..din + 4 * i + 4].copy_from_slice(&word.to_le_bytes());
        }
        for r in 0..4 {
            let (row, col) = a_coord(tw, r);
            let w = x.a[row][col] as u32 | (x.a[row][col + 1] as u32) << 16;
            buf[areg + 4 * r..areg + 4 * r + 4].copy_from_slice(&w.to_le_bytes());
        }
    }
    buf
}

fn launch(src: &str, threads: u32, buf: &[u8]) -> Result<Vec<u8>, VmError> {
    let m = Module::load(src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let mut vm = Vm::with_workers(1);
    let dev = vm.alloc(buf.len() as u64)?;
    vm.write(dev, buf)?;
    vm.launch(&m, "t", &LaunchConfig::new([1, 1, 1], [threads, 1, 1], 0), &dev.to_le_bytes())?;
    let mut out = vec![0u8; buf.len()];
    vm.read(dev, &mut out)?;
    Ok(out)
}

/// D (64 x N) the ISA defines: k16 steps in order, each rounded to the accumulator type.
fn expected(c: &Case, x: &Data) -> Vec<Vec<f64>> {
    let n = c.n as usize;
    let round = |v: f64| if c.acc16 { f16::from_f64(v).to_f64() } else { v as f32 as f64 };
    let mut d: Vec<Vec<f64>> = (0..64)
        .map(|m| {
            (0..n)
                .map(|j| match c.scale_d {
                    ScaleD::Pred(true) | ScaleD::One => round(x.d[m][j] as f64),
                    _ => 0.0,
                })
                .collect()
        })
        .collect();
    let sa = if c.neg_a { -1.0 } else { 1.0 };
    let sb = if c.neg_b { -1.0 } else { 1.0 };
    for s in 0..c.steps as usize {
        for (m, dm) in d.iter_mut().enumerate() {
            for (j, v) in dm.iter_mut().enumerate() {
                let mut acc = *v;
                for k in 16 * s..16 * s + 16 {
                    acc += sa * c.kind.dec(x.a[m][k]) * sb * c.kind.dec(x.b[k][j]);
                }
                *v = round(acc);
            }
        }
    }
    d
}

/// Runs a case and checks every thread's D against [`expected`].
fn check(c: &Case, seed: u64) {
    let x = data(c, seed);
    let src = kernel(c, "", "");
    let out = launch(&src, c.threads, &input(c, &x)).unwrap_or_else(|e| panic!("{c:?}: {e}"));
    let want = expected(c, &x);
    for t in 0..c.threads as usize {
        let (_, dout, _) = thread_io(c, t);
        for i in 0..c.n as usize / 2 {
            let (r, col) = d_coord(t % 128, i);
            let got = if c.acc16 {
                let w = u32::from_le_bytes(out[dout + 4 * (i / 2)..dout + 4 * (i / 2) + 4].try_into().unwrap());
                f16::from_bits((w >> (16 * (i % 2))) as u16).to_f64()
            } else {
                f32::from_le_bytes(out[dout + 4 * i..dout + 4 * i + 4].try_into().unwrap()) as f64
            };
            assert_eq!(got, want[r][col], "{c:?}: thread {t} element {i} = D[{r}][{col}]");
        }
    }
}

/// K-major, no swizzle: core matrices of 8 rows x 16 bytes; the 8-row groups packed (SBO = 128)
/// and the second 8 columns of K after all of them (LBO = rows / 8 x 128).
fn k_none(base: u32, rows: u32) -> Layout {
    Layout::k_major(0, base, rows / 8 * 128, 128)
}

/// K-major, swizzled: rows of `s` bytes, 8-row groups packed (SBO = 8 s).
fn k_swz(s: u32, base: u32) -> Layout {
    Layout::k_major(s, base, 16, 8 * s)
}

#[test]
fn k_major_no_swizzle_bf16_all_widths() {
    for (i, n) in [8u32, 16, 24, 64, 120, 128, 256].into_iter().enumerate() {
        check(&Case::new(n, Kind::Bf16, Some(k_none(0, 64)), k_none(4096, n)), 10 + i as u64);
    }
}

#[test]
fn k_major_no_swizzle_f16_with_a_wide_stride() {
    // LBO and SBO both different from the packed values: 8-row groups 256 bytes apart with the
    // second K half interleaved between them.
    let a = Layout::k_major(0, 0, 128, 256);
    let b = Layout::k_major(0, 4096, 128, 256);
    check(&Case::new(64, Kind::F16, Some(a), b), 3);
}

#[test]
fn k_major_swizzles_32_64_128() {
    for (i, s) in [32u32, 64, 128].into_iter().enumerate() {
        for kind in [Kind::Bf16, Kind::F16] {
            for n in [64u32, 256] {
                check(&Case::new(n, kind, Some(k_swz(s, 0)), k_swz(s, 8192)), 20 + i as u64);
            }
        }
    }
}

#[test]
fn mn_major_every_swizzle_for_a_and_b() {
    // No swizzle: MN groups of 8 at SBO = 256, the two K groups of 8 at LBO = 128.
    let none = |base| Layout::mn_major(0, base, 128, 256);
    // Swizzled: K rows of s bytes of MN; 8 K rows at s apart, the next 8 at SBO = 8 s, the next
    // s / 2 MN elements at LBO = 16 s (after both K groups).
    let swz = |s: u32, base| Layout::mn_major(s, base, 16 * s, 8 * s);
    for (i, n) in [64u32, 128].into_iter().enumerate() {
        check(&Case::new(n, Kind::Bf16, Some(none(0)), none(8192)), 30 + i as u64);
        for s in [32u32, 64, 128] {
            check(&Case::new(n, Kind::Bf16, Some(swz(s, 0)), swz(s, 8192)), 40 + s as u64);
            // Mixed: K-major A, MN-major B (P V with V row-major).
            check(&Case::new(n, Kind::F16, Some(k_swz(s, 0)), swz(s, 8192)), 50 + s as u64);
        }
    }
}

#[test]
fn p_times_v_mn_major_b_128b_swizzle_chained_over_64_keys() {
    // V: 64 keys (K) x 128 head dims (N) row-major in 128B-swizzled atoms (64 dims x 8 keys):
    // the next 8 keys at SBO = 1024, the second 64 dims at LBO = 8 KiB; each k16 step moves
    // the start by 2 atoms (2 KiB). A (P) from registers would follow a softmax; here in smem.
    let v = Layout::mn_major(128, 16384, 8192, 1024);
    let mut c = Case::new(128, Kind::Bf16, Some(k_swz(128, 0)), v);
    c.steps = 4;
    check(&c, 60);
}

#[test]
fn chained_k_steps_walk_a_128b_swizzled_row() {
    // K = 64: one 128-byte row per M / N index; each step advances both descriptors by 32 bytes
    // (2 in the encoded start address), as kernels do; the first step with scale-d = 0.
    for n in [64u32, 256] {
        let mut c = Case::new(n, Kind::Bf16, Some(k_swz(128, 0)), k_swz(128, 8192));
        c.steps = 4;
        c.advance_in_ptx = true;
        c.scale_d = ScaleD::Zero;
        check(&c, 70 + n as u64);
    }
}

#[test]
fn register_a() {
    for (n, b) in [(64u32, k_swz(128, 8192)), (256, k_none(8192, 256)), (128, Layout::mn_major(128, 8192, 8192, 1024))]
    {
        let mut c = Case::new(n, Kind::Bf16, None, b);
        c.steps = 1;
        check(&c, 80 + n as u64);
        c.kind = Kind::F16;
        check(&c, 90 + n as u64);
    }
}

#[test]
fn scale_d_and_negation() {
    let base = Case::new(64, Kind::Bf16, Some(k_swz(64, 0)), k_swz(64, 8192));
    for (i, scale) in [ScaleD::Zero, ScaleD::One, ScaleD::Pred(false), ScaleD::Pred(true)].into_iter().enumerate() {
        let mut c = base.clone();
        c.scale_d = scale;
        check(&c, 100 + i as u64);
    }
    let mut c = base.clone();
    c.neg_a = true;
    check(&c, 110);
    c.neg_b = true;
    check(&c, 111);
    let mut c = Case::new(64, Kind::F16, None, k_swz(64, 8192));
    c.neg_a = true;
    check(&c, 112);
}

#[test]
fn f16_accumulators() {
    for n in [8u32, 64, 256] {
        let mut c = Case::new(n, Kind::F16, Some(k_swz(128, 0)), k_swz(128, 8192));
        c.acc16 = true;
        check(&c, 120 + n as u64);
    }
    let mut c = Case::new(64, Kind::F16, None, k_none(8192, 64));
    c.acc16 = true;
    check(&c, 130);
    let mut c = Case::new(64, Kind::F16, Some(k_none(0, 64)), k_none(8192, 64));
    c.acc16 = true;
    c.steps = 2;
    check(&c, 131);
}

#[test]
fn two_warpgroups_each_run_their_own() {
    let mut c = Case::new(64, Kind::Bf16, Some(k_swz(128, 0)), k_swz(128, 8192));
    c.threads = 256;
    check(&c, 140);
}

// ---- findings ----

fn finding_of(r: Result<Vec<u8>, VmError>) -> Box<Finding> {
    match r {
        Err(VmError::Memcheck(f)) => f,
        other => panic!("expected a finding, got {:?}", other.map(|_| ())),
    }
}

fn small() -> Case {
    Case::new(16, Kind::Bf16, Some(k_swz(128, 0)), k_swz(128, 8192))
}

fn run_finding(c: &Case, between: &str, before: &str) -> (String, Box<Finding>) {
    let x = data(c, 7);
    let src = kernel(c, between, before);
    let f = finding_of(launch(&src, c.threads, &input(c, &x)));
    (src, f)
}

#[test]
fn a_warp_missing_from_the_warpgroup_is_a_finding() {
    // Warp 3 leaves before the wgmma.
    let c = small();
    let x = data(&c, 7);
    let src = kernel(&c, "", "setp.ge.u32 %p2, %r1, 96;\n\t@%p2 bra DONE;").replace("\tret;\n}", "DONE:\n\tret;\n}");
    let f = finding_of(launch(&src, c.threads, &input(&c, &x)));
    assert_eq!((f.kind.as_str(), f.line), ("warpgroup collective divergence", line_of(&src, "// MMA0")));
    let text = f.nearest_allocation.clone().unwrap_or_default();
    assert!(text.contains("warp 3") && text.contains("exited"), "{text}");
    // A block of 96 threads has no fourth warp at all.
    let mut c = small();
    c.threads = 96;
    let (src, f) = run_finding(&c, "", "");
    assert_eq!((f.kind.as_str(), f.line), ("warpgroup collective divergence", line_of(&src, "// MMA0")));
    assert!(f.nearest_allocation.as_deref().unwrap_or("").contains("warp 3 does not exist"), "{f}");
}

#[test]
fn reading_an_accumulator_before_wait_group_is_a_finding() {
    let c = small();
    let (src, f) = run_finding(&c, "st.global.f32 [%rd0+24], %f3; // EARLY", "");
    assert_eq!(f.kind, "wgmma register accessed in flight", "{f}");
    assert_eq!(f.line, line_of(&src, "// EARLY"));
    let other = f.conflict.as_ref().expect("names the wgmma");
    assert_eq!(other.line, line_of(&src, "// MMA0"));
    assert!(f.nearest_allocation.as_deref().unwrap_or("").contains("%f3"), "{f}");
    // Writing it is one too; after the wait both are fine (the plain case passes in `check`).
    let (src, f) = run_finding(&c, "mov.f32 %f0, 0f3F800000; // EARLY", "");
    assert_eq!((f.kind.as_str(), f.line), ("wgmma register accessed in flight", line_of(&src, "// EARLY")));
    // A wait_group 1 with the only group committed last does not retire it.
    let (src, f) = run_finding(&c, "wgmma.wait_group.sync.aligned 1;\n\tst.global.f32 [%rd0+24], %f3; // EARLY", "");
    assert_eq!((f.kind.as_str(), f.line), ("wgmma register accessed in flight", line_of(&src, "// EARLY")));
    // Register A: overwriting A's registers before the wait.
    let c = Case::new(16, Kind::Bf16, None, k_swz(128, 8192));
    let (src, f) = run_finding(&c, "mov.b32 %r21, 0; // EARLY", "");
    assert_eq!((f.kind.as_str(), f.line), ("wgmma register accessed in flight", line_of(&src, "// EARLY")));
    assert!(f.nearest_allocation.as_deref().unwrap_or("").contains("A fragment"), "{f}");
}

#[test]
fn fences_are_checked() {
    let c = small();
    // No fence at all.
    let x = data(&c, 7);
    let src = kernel(&c, "", "").replace("\twgmma.fence.sync.aligned;\n", "");
    let f = finding_of(launch(&src, c.threads, &input(&c, &x)));
    assert_eq!((f.kind.as_str(), f.line), ("wgmma.mma_async without wgmma.fence", line_of(&src, "// MMA0")));
    // An accumulator written after the fence and before the wgmma.
    let src = kernel(&c, "", "")
        .replace("\twgmma.fence.sync.aligned;\n", "\twgmma.fence.sync.aligned;\n\tmov.f32 %f2, 0f00000000; // LATE\n");
    let f = finding_of(launch(&src, c.threads, &input(&c, &x)));
    assert_eq!((f.kind.as_str(), f.line), ("wgmma register access not fenced", line_of(&src, "// MMA0")));
    assert_eq!(f.conflict.as_ref().map(|o| o.line), Some(line_of(&src, "// LATE")));
}

#[test]
fn a_descriptor_outside_shared_memory_is_a_finding() {
    let c = small();
    let x = data(&c, 7);
    let mut buf = input(&c, &x);
    // B starts 64 bytes before the end of the 40 KiB window: its rows run past it.
    let bad = Layout { base: SMEM as u32 - 64, ..c.b };
    buf[128..136].copy_from_slice(&bad.desc(0).to_le_bytes());
    let src = kernel(&c, "", "");
    let f = finding_of(launch(&src, c.threads, &buf));
    assert_eq!((f.kind.as_str(), f.line), ("wgmma operand outside shared memory", line_of(&src, "// MMA0")));
    let text = f.nearest_allocation.clone().unwrap_or_default();
    assert!(text.contains("B descriptor") && text.contains("40960 bytes"), "{text}");
}

#[test]
fn a_store_into_an_operand_before_wait_group_is_a_finding() {
    let c = small();
    // Thread 0 overwrites the first word of B (shared offset 8192) while the wgmma is in flight.
    let (src, f) = run_finding(&c, "st.shared.u32 [%r6+8192], %r1; // CLOBBER", "");
    assert_eq!(
        (f.kind.as_str(), f.line),
        ("shared memory overwritten under an in-flight wgmma", line_of(&src, "// WAIT"))
    );
    assert_eq!(f.conflict.as_ref().map(|o| o.line), Some(line_of(&src, "// MMA0")));
    let store = format!("the last store to it: warp 0, line {}", line_of(&src, "// CLOBBER"));
    assert!(f.nearest_allocation.as_deref().unwrap_or("").contains(&store), "{f}");
}

#[test]
fn descriptors_must_agree_across_the_warpgroup() {
    let c = small();
    let (src, f) = run_finding(&c, "", "setp.eq.u32 %p3, %r1, 77;\n\t@%p3 add.s64 %rd30, %rd30, 2;");
    assert_eq!((f.kind.as_str(), f.line), ("wgmma operand differs across the warpgroup", line_of(&src, "// MMA0")));
    assert_eq!(f.thread, [77, 0, 0]);
}

#[test]
fn unsupported_forms_are_load_errors() {
    let wrap = |inst: &str| {
        format!(
            ".version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry t()\n{{\n\t.reg .b64 %rd<4>;\n\
             \t.reg .f32 %f<8>;\n\t.reg .b32 %r<8>;\n\t{inst}\n\tret;\n}}\n"
        )
    };
    let cases = [
        ("wgmma.mma_async.sync.aligned.m64n8k8.f32.tf32.tf32 {%f0, %f1, %f2, %f3}, %rd0, %rd1, 1, 1, 1;", "tf32"),
        ("wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%f0, %f1, %f2, %f3}, %rd0, %rd1, 1, 1, 1;", "fp8"),
        ("wgmma.mma_async.sync.aligned.m64n8k32.s32.s8.s8 {%r0, %r1, %r2, %r3}, %rd0, %rd1, 1;", "integer"),
        ("wgmma.mma_async.sync.aligned.m64n12k16.f32.bf16.bf16 {%f0, %f1, %f2, %f3}, %rd0, %rd1, 1, 1, 1, 0, 0;", "shape"),
        ("wgmma.mma_async.sync.aligned.m64n8k16.f16.bf16.bf16 {%r0, %r1}, %rd0, %rd1, 1, 1, 1, 0, 0;", "bf16"),
        ("wgmma.mma_async.sp.sync.aligned.m64n8k32.f32.bf16.bf16 {%f0, %f1, %f2, %f3}, %rd0, %rd1, %r0, 0, 1, 1, 1, 0, 0;", "not supported"),
        ("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%f0, %f1}, %rd0, %rd1, 1, 1, 1, 0, 0;", "vector of 4"),
        ("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%f0, %f1, %f2, %f3}, %rd0, %rd1, 1, 2, 1, 0, 0;", "imm-scale-a"),
        ("wgmma.wait_group.sync.aligned %r0;", "integer constant"),
    ];
    for (inst, what) in cases {
        let e = match Module::load(&wrap(inst)) {
            Err(e) => e,
            Ok(_) => panic!("`{inst}` loaded"),
        };
        assert_eq!(e.line, line_of(&wrap(inst), inst), "{e}");
        assert!(e.message.contains(what), "`{inst}`: {e}");
    }
}
