//! Hopper asynchronous copies: `mbarrier` phases, `cp.async.bulk.tensor` through tensor maps
//! (OOB fill, negative coordinates, the swizzle modes), the producer/consumer ring of FA3-style
//! kernels, and the findings of their misuse. Expected values come from the PTX ISA's and CUDA's
//! rules written out here (a plain loop over the tensor, the swizzle table of the CUDA
//! programming guide), independently of the VM.

use ptx_vm::swizzle::Swizzle;
use ptx_vm::{Finding, LaunchConfig, LoadError, Module, TensorDataType, TensorMap, Vm, VmError};

const HEADER: &str = ".version 8.0\n.target sm_90a\n.address_size 64\n";

/// A kernel `t` taking `nbufs` pointers (in `%rd40`, `%rd41`, ...) and `nscalars` u32 (in
/// `%r40`, `%r41`, ...).
fn kernel(decls: &str, body: &str, nbufs: usize, nscalars: usize) -> String {
    let mut params = Vec::new();
    let mut loads = String::new();
    for i in 0..nbufs {
        params.push(format!("\t.param .u64 b{i}"));
        loads += &format!("\tld.param.u64 %rd{}, [b{i}];\n", 40 + i);
    }
    for j in 0..nscalars {
        params.push(format!("\t.param .u32 s{j}"));
        loads += &format!("\tld.param.u32 %r{}, [s{j}];\n", 40 + j);
    }
    format!(
        "{HEADER}{decls}\n.visible .entry t(\n{}\n)\n{{\n\t.reg .pred %p<16>;\n\t.reg .b32 %r<64>;\n\t.reg .b64 %rd<64>;\n\
         {loads}{body}\n\tret;\n}}\n",
        params.join(",\n")
    )
}

/// Launches `src` with one block of `threads` threads: the buffers (copied in, read back) and the
/// scalars as parameters.
fn launch(src: &str, threads: u32, bufs: &[Vec<u8>], scalars: &[u32]) -> Result<Vec<Vec<u8>>, VmError> {
    let m = Module::load(src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let mut vm = Vm::with_workers(1);
    let mut ptrs = Vec::new();
    let mut params = Vec::new();
    for b in bufs {
        let p = vm.alloc(b.len().max(1) as u64)?;
        vm.write(p, b)?;
        ptrs.push(p);
        params.extend_from_slice(&p.to_le_bytes());
    }
    for s in scalars {
        params.extend_from_slice(&s.to_le_bytes());
    }
    vm.launch(&m, "t", &LaunchConfig::new([1, 1, 1], [threads, 1, 1], 0), &params)?;
    let mut out = Vec::new();
    for (p, b) in ptrs.iter().zip(bufs) {
        let mut v = vec![0u8; b.len()];
        vm.read(*p, &mut v)?;
        out.push(v);
    }
    Ok(out)
}

fn finding_of(r: Result<Vec<Vec<u8>>, VmError>) -> Box<Finding> {
    match r {
        Err(VmError::Memcheck(f)) => f,
        other => panic!("expected a finding, got {:?}", other.map(|_| ())),
    }
}

fn line_of(src: &str, marker: &str) -> usize {
    src.lines().position(|l| l.contains(marker)).unwrap_or_else(|| panic!("marker {marker}")) + 1
}

fn u32s(b: &[u8]) -> Vec<u32> {
    b.chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect()
}

// ------------------------------------------------------------------------------------------------
// mbarrier phases
// ------------------------------------------------------------------------------------------------

/// One thread walks a barrier of 3 arrivals through three phases: arrivals with counts, tx bytes
/// expected and completed in parts, and `test_wait` by parity and by state at every step.
#[test]
fn mbarrier_phases_flip_when_arrivals_and_tx_bytes_are_complete() {
    let body = "\
	mbarrier.init.shared::cta.b64 [bar], 3;
	mov.u32 %r30, 0;
	mbarrier.test_wait.parity.shared::cta.b64 %p1, [bar], 0;
	selp.u32 %r1, 1, 0, %p1;
	mbarrier.arrive.shared::cta.b64 %rd1, [bar];
	mbarrier.test_wait.shared::cta.b64 %p1, [bar], %rd1;
	selp.u32 %r2, 1, 0, %p1;
	mbarrier.arrive.release.cta.shared::cta.b64 %rd2, [bar], 2;
	mbarrier.test_wait.parity.shared::cta.b64 %p1, [bar], 0;
	selp.u32 %r3, 1, 0, %p1;
	mbarrier.test_wait.parity.shared::cta.b64 %p1, [bar], 1;
	selp.u32 %r4, 1, 0, %p1;
	mbarrier.test_wait.shared::cta.b64 %p1, [bar], %rd1;
	selp.u32 %r5, 1, 0, %p1;
	mbarrier.expect_tx.shared::cta.b64 [bar], 64;
	mbarrier.arrive.shared::cta.b64 %rd3, [bar], 3;
	mbarrier.test_wait.parity.shared::cta.b64 %p1, [bar], 1;
	selp.u32 %r6, 1, 0, %p1;
	mbarrier.complete_tx.shared::cta.b64 [bar], 48;
	mbarrier.test_wait.parity.shared::cta.b64 %p1, [bar], 1;
	selp.u32 %r7, 1, 0, %p1;
	mbarrier.complete_tx.shared::cta.b64 [bar], 16;
	mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 %p1, [bar], 1;
	selp.u32 %r8, 1, 0, %p1;
	mbarrier.test_wait.parity.shared::cta.b64 %p1, [bar], 0;
	selp.u32 %r9, 1, 0, %p1;
	mbarrier.arrive.expect_tx.shared::cta.b64 %rd4, [bar], 128;
	mbarrier.complete_tx.shared::cta.b64 [bar], 128;
	mbarrier.test_wait.parity.shared::cta.b64 %p1, [bar], 0;
	selp.u32 %r10, 1, 0, %p1;
	mbarrier.arrive.shared::cta.b64 _, [bar], 2;
	mbarrier.try_wait.shared::cta.b64 %p1, [bar], %rd4;
	selp.u32 %r11, 1, 0, %p1;
	mbarrier.test_wait.parity.shared::cta.b64 %p1, [bar], 0;
	selp.u32 %r12, 1, 0, %p1;
	mbarrier.inval.shared::cta.b64 [bar];
	st.global.v4.u32 [%rd40], {%r1, %r2, %r3, %r4};
	st.global.v4.u32 [%rd40+16], {%r5, %r6, %r7, %r8};
	st.global.v4.u32 [%rd40+32], {%r9, %r10, %r11, %r12};";
    let src = kernel(".shared .align 8 .b64 bar;", body, 1, 0);
    let out = launch(&src, 1, &[vec![0; 48]], &[]).unwrap_or_else(|e| panic!("{e}"));
    // Phase 0 needs 3 arrivals; phase 1 needs 3 arrivals and 64 tx bytes; phase 2 needs 3
    // arrivals and 128 tx bytes. `test_wait.parity P` is true once the phase of parity P before
    // the current one completed; `test_wait state` once the arrival's phase completed.
    let want = [
        0, // phase 0 in progress
        0, // the arrival's phase (0) is not complete
        1, // phase 0 complete: parity 0 done
        0, // phase 1 (parity 1) in progress
        1, // the first arrival's phase is complete
        0, // all 3 arrivals, 64 tx bytes pending
        0, // 16 bytes pending
        1, // phase 1 complete
        0, // phase 2 (parity 0) in progress
        0, // 2 arrivals pending
        1, // phase 2 complete (by state)
        1, // and by parity
    ];
    assert_eq!(u32s(&out[0]), want);
}

/// Four warps meet at one barrier (4 arrivals: lane 0 of each warp) in three phases; warp 0 also
/// expects 16 tx bytes that warp 1 completes. Each warp publishes a value before it arrives and
/// every thread reads its neighbour warp's value after the wait (no race: the wait orders it).
#[test]
fn warps_meet_at_an_mbarrier_phase_after_phase() {
    let body = "\
	mov.u32 %r1, %tid.x;
	shr.u32 %r2, %r1, 5;
	and.b32 %r3, %r1, 31;
	setp.ne.u32 %p1, %r1, 0;
	@%p1 bra SYNC;
	mbarrier.init.shared::cta.b64 [bar], 4;
SYNC:
	bar.sync 0;
	mov.u32 %r4, 0;
PHASE:
	setp.ge.u32 %p2, %r4, 3;
	@%p2 bra DONE;
	setp.ne.u32 %p3, %r3, 0;
	@%p3 bra WAIT;
	// lane 0: slot[phase][warp] = 100 * phase + warp, then arrive
	shl.b32 %r5, %r4, 2;
	add.u32 %r5, %r5, %r2;
	shl.b32 %r5, %r5, 2;
	mov.u32 %r6, slot;
	add.u32 %r6, %r6, %r5;
	mul.lo.u32 %r7, %r4, 100;
	add.u32 %r7, %r7, %r2;
	st.shared.u32 [%r6], %r7;
	setp.eq.u32 %p4, %r2, 0;
	@%p4 mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], 16;
	@!%p4 mbarrier.arrive.shared::cta.b64 _, [bar];
	setp.eq.u32 %p4, %r2, 1;
	@%p4 mbarrier.complete_tx.shared::cta.b64 [bar], 16;
WAIT:
	and.b32 %r8, %r4, 1;
	mbarrier.try_wait.parity.shared::cta.b64 %p5, [bar], %r8;
	@!%p5 bra WAIT;
	// out[tid * 3 + phase] = slot[phase][(warp + 1) % 4]
	add.u32 %r9, %r2, 1;
	and.b32 %r9, %r9, 3;
	shl.b32 %r10, %r4, 2;
	add.u32 %r10, %r10, %r9;
	shl.b32 %r10, %r10, 2;
	mov.u32 %r11, slot;
	add.u32 %r11, %r11, %r10;
	ld.shared.u32 %r12, [%r11];
	mul.lo.u32 %r13, %r1, 3;
	add.u32 %r13, %r13, %r4;
	mul.wide.u32 %rd1, %r13, 4;
	add.u64 %rd2, %rd40, %rd1;
	st.global.u32 [%rd2], %r12;
	add.u32 %r4, %r4, 1;
	bra PHASE;
DONE:";
    let src = kernel(".shared .align 8 .b64 bar;\n.shared .align 4 .b32 slot[12];", body, 1, 0);
    let out = launch(&src, 128, &[vec![0; 128 * 3 * 4]], &[]).unwrap_or_else(|e| panic!("{e}"));
    let got = u32s(&out[0]);
    for t in 0..128u32 {
        for k in 0..3u32 {
            assert_eq!(got[(t * 3 + k) as usize], 100 * k + (t / 32 + 1) % 4, "thread {t} phase {k}");
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Tensor copies: layout
// ------------------------------------------------------------------------------------------------

/// The CUDA programming guide's swizzle table, as an address map: the 16-byte chunk `c` of the
/// 128-byte line `y` of shared memory is stored at chunk `c ^ (y % 8)` (128B), `c ^ (y % 4)`
/// (64B) or `c ^ (y % 2)` (32B) of the same line.
fn swizzled(s: Swizzle, addr: usize) -> usize {
    let (line, chunk, byte) = (addr / 128, (addr % 128) / 16, addr % 16);
    let c = match s {
        Swizzle::None => chunk,
        Swizzle::B32 => chunk ^ (line % 2),
        Swizzle::B64 => chunk ^ (line % 4),
        Swizzle::B128 => chunk ^ (line % 8),
    };
    line * 128 + c * 16 + byte
}

fn swizzle_code(s: Swizzle) -> u32 {
    match s {
        Swizzle::None => 0,
        Swizzle::B32 => 1,
        Swizzle::B64 => 2,
        Swizzle::B128 => 3,
    }
}

/// A tensor of `dims` (innermost first) of `es`-byte elements, each row padded by `pad` bytes:
/// the bytes, the strides of dims 1.., and every element's value (distinct, never zero).
struct Tensor {
    bytes: Vec<u8>,
    strides: Vec<u64>,
    es: usize,
    dims: Vec<u64>,
}

impl Tensor {
    fn new(es: usize, dims: &[u64], pad: u64) -> Tensor {
        let mut strides = Vec::new();
        let mut s = (dims[0] * es as u64).div_ceil(16) * 16 + pad;
        for d in &dims[1..] {
            strides.push(s);
            s *= d;
        }
        let total = s as usize;
        let mut t = Tensor { bytes: vec![0xEE; total], strides, es, dims: dims.to_vec() };
        let n: u64 = dims.iter().product();
        for lin in 0..n {
            let mut g = Vec::new();
            let mut r = lin;
            for d in dims {
                g.push((r % d) as i64);
                r /= d;
            }
            let v = Tensor::value(es, lin);
            let at = t.offset(&g);
            t.bytes[at..at + es].copy_from_slice(&v[..es]);
        }
        t
    }
    /// Element `lin`'s bytes: a distinct non-zero pattern (for 2 bytes: a finite bf16/f16).
    fn value(es: usize, lin: u64) -> [u8; 8] {
        let v = match es {
            1 => lin % 255 + 1,
            2 => 0x3C00 + (lin % 0x3000),
            4 => 0x3F80_0000 + lin * 3 + 1,
            _ => 0x4000_0000_0000_0000 + lin * 5 + 1,
        };
        v.to_le_bytes()
    }
    fn offset(&self, g: &[i64]) -> usize {
        let mut o = g[0] as usize * self.es;
        for (x, s) in g[1..].iter().zip(&self.strides) {
            o += *x as usize * *s as usize;
        }
        o
    }
    fn inside(&self, g: &[i64]) -> bool {
        g.iter().zip(&self.dims).all(|(&x, &d)| x >= 0 && x < d as i64)
    }
}

const PRE: u8 = 0xAB;

/// The PTX of one tensor copy of rank `rank` into `smem + dst_off`: shared memory is first
/// filled with `0xAB` by all threads, thread 0 initialises the barrier and issues the copy, every
/// thread waits for the phase and copies `region` bytes from `smem + dst_off` out.
fn copy_kernel(rank: usize, bytes: u64, dst_off: u64, region: u64) -> String {
    let coords: Vec<String> = (0..rank).map(|i| format!("%r{}", 41 + i)).collect();
    let body = format!(
        "\
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, %ntid.x;
	mov.u32 %r3, smem;
	mov.u32 %r4, %r1;
FILL:
	setp.ge.u32 %p1, %r4, {fill_words};
	@%p1 bra FILLED;
	shl.b32 %r5, %r4, 2;
	add.u32 %r6, %r3, %r5;
	st.shared.u32 [%r6], 0xABABABAB;
	add.u32 %r4, %r4, %r2;
	bra FILL;
FILLED:
	bar.sync 0;
	setp.ne.u32 %p1, %r1, 0;
	@%p1 bra WAIT;
	mbarrier.init.shared::cta.b64 [bar], 1;
	fence.mbarrier_init.release.cluster;
	fence.proxy.async.shared::cta;
	mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], {bytes};
	add.u32 %r7, %r3, {dst_off};
	cp.async.bulk.tensor.{rank}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%r7], [%rd41, {{{coords}}}], [bar]; // COPY
WAIT:
	bar.sync 0;
SPIN:
	mbarrier.try_wait.parity.shared::cta.b64 %p2, [bar], 0;
	@!%p2 bra SPIN;
	mov.u32 %r4, %r1;
OUT:
	setp.ge.u32 %p1, %r4, {out_words};
	@%p1 bra DONE;
	shl.b32 %r5, %r4, 2;
	add.u32 %r6, %r3, %r5;
	ld.shared.u32 %r8, [%r6+{dst_off}];
	mul.wide.u32 %rd1, %r4, 4;
	add.u64 %rd2, %rd40, %rd1;
	st.global.u32 [%rd2], %r8;
	add.u32 %r4, %r4, %r2;
	bra OUT;
DONE:",
        fill_words = (dst_off + region) / 4,
        out_words = region / 4,
        coords = coords.join(", "),
    );
    kernel(
        &format!(".shared .align 1024 .b8 smem[{}];\n.shared .align 8 .b64 bar;", (dst_off + region).max(1024)),
        &body,
        2,
        1 + rank,
    )
}

/// Copies the box at `coords` of a tensor of `dims` through a tensor map with `swizzle` into
/// shared memory at `dst_off` and compares the raw shared bytes with the expected ones: every
/// element of the box (dimension 0 fastest) at its dense position, zero outside the tensor, each
/// byte moved by the swizzle table.
fn check_tile(dt: TensorDataType, dims: &[u64], boxd: &[u32], coords: &[i32], swizzle: Swizzle, dst_off: u64) {
    let rank = dims.len();
    let es = dt.bytes() as usize;
    let t = Tensor::new(es, dims, 32);
    let map = TensorMap::from_cuda_tiled(
        dt.cuda(),
        rank as u32,
        0, // patched below
        dims,
        &t.strides,
        boxd,
        &vec![1; rank],
        0,
        swizzle_code(swizzle),
        0,
        0,
    );
    // The global address is only known once allocated: the tensor goes first in one buffer.
    let map = map.unwrap_or_else(|e| panic!("{e}"));
    let total: u64 = boxd.iter().map(|&b| b as u64).product::<u64>() * es as u64;
    let region = total.div_ceil(128) * 128;
    let src = copy_kernel(rank, total, dst_off, region);
    let m = Module::load(&src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let mut vm = Vm::with_workers(1);
    let out = vm.alloc(region).unwrap();
    let tensor = vm.alloc(t.bytes.len() as u64).unwrap();
    vm.write(tensor, &t.bytes).unwrap();
    let mapbuf = vm.alloc(128).unwrap();
    let map = TensorMap { global_address: tensor, ..map };
    vm.write(mapbuf, &map.encode()).unwrap();
    let mut params = Vec::new();
    params.extend_from_slice(&out.to_le_bytes());
    params.extend_from_slice(&mapbuf.to_le_bytes());
    params.extend_from_slice(&(total as u32).to_le_bytes());
    for c in coords {
        params.extend_from_slice(&c.to_le_bytes());
    }
    vm.launch(&m, "t", &LaunchConfig::new([1, 1, 1], [96, 1, 1], 0), &params).unwrap_or_else(|e| panic!("{e}"));
    let mut got = vec![0u8; region as usize];
    vm.read(out, &mut got).unwrap();
    // Expected: a plain loop over the box.
    let mut want = vec![PRE; region as usize];
    let n: u64 = boxd.iter().map(|&b| b as u64).product();
    for lin in 0..n {
        let mut g = Vec::new();
        let mut r = lin;
        for (i, &b) in boxd.iter().enumerate() {
            g.push(coords[i] as i64 + (r % b as u64) as i64);
            r /= b as u64;
        }
        let logical = lin as usize * es;
        for b in 0..es {
            let byte = if t.inside(&g) { t.bytes[t.offset(&g) + b] } else { 0 };
            let at = swizzled(swizzle, dst_off as usize + logical + b) - dst_off as usize;
            want[at] = byte;
        }
    }
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g, w,
            "{dt:?} dims {dims:?} box {boxd:?} at {coords:?} {swizzle:?} dst {dst_off}: shared byte {i} (of {region})"
        );
    }
}

#[test]
fn tensor_copy_2d_bf16_every_swizzle_with_oob_fill_and_negative_coordinates() {
    // bf16, a 40 x 37 matrix (rows padded), boxes of 64/32/16 columns x 11 rows.
    for (sw, cols) in [(Swizzle::None, 64u32), (Swizzle::B128, 64), (Swizzle::B64, 32), (Swizzle::B32, 16)] {
        for coords in [[0, 0], [-5, -3], [30, 30], [-60, 2], [8, 36], [0, 40]] {
            check_tile(TensorDataType::Bf16, &[40, 37], &[cols, 11], &coords, sw, 0);
        }
    }
}

#[test]
fn tensor_copy_2d_f32_every_swizzle() {
    for (sw, cols) in [(Swizzle::None, 12u32), (Swizzle::B128, 32), (Swizzle::B64, 16), (Swizzle::B32, 8)] {
        for coords in [[0, 0], [3, -2], [-7, 9], [20, 1]] {
            check_tile(TensorDataType::F32, &[25, 13], &[cols, 16], &coords, sw, 0);
        }
    }
}

#[test]
fn tensor_copy_3d_with_partial_boxes() {
    for (sw, dt, cols) in [
        (Swizzle::B128, TensorDataType::Bf16, 64u32),
        (Swizzle::B64, TensorDataType::F32, 16),
        (Swizzle::None, TensorDataType::U8, 48),
    ] {
        for coords in [[0, 0, 0], [-3, 2, -1], [10, -4, 2], [0, 5, 3]] {
            check_tile(dt, &[50, 9, 4], &[cols, 5, 3], &coords, sw, 0);
        }
    }
}

#[test]
fn tensor_copy_4d_and_5d() {
    check_tile(TensorDataType::F32, &[8, 3, 5, 2], &[8, 2, 4, 2], &[0, 2, -1, 1], Swizzle::B32, 0);
    check_tile(TensorDataType::Bf16, &[16, 3, 2, 3, 2], &[16, 2, 2, 2, 2], &[-8, 1, 1, 2, -1], Swizzle::B32, 0);
}

/// A box of rows narrower than the swizzle span, and a destination aligned to 128 bytes but not
/// to the 1024-byte pattern: the swizzle is a function of the shared address itself (the CUDA
/// guide's `(smem_ptr / 128) % 8` offset).
#[test]
fn tensor_copy_swizzle_follows_the_absolute_shared_address() {
    check_tile(TensorDataType::Bf16, &[64, 32], &[16, 24], &[0, 0], Swizzle::B128, 0);
    check_tile(TensorDataType::Bf16, &[64, 32], &[64, 8], &[-4, 3], Swizzle::B128, 384);
    check_tile(TensorDataType::F32, &[64, 32], &[16, 8], &[5, 3], Swizzle::B64, 640);
}

// ------------------------------------------------------------------------------------------------
// The producer / consumer ring
// ------------------------------------------------------------------------------------------------

/// Warp 0 (one elected lane) produces `ntiles` tiles of 16 x 32 f32 through two stages: it waits
/// on the stage's "empty" barrier (first round: the parity before the first phase, which passes),
/// expects the tile's bytes on the "full" barrier and issues the copy. Warps 1 and 2 (64 threads)
/// wait on "full", copy the tile out, and arrive on "empty" (64 arrivals release the stage).
/// Scalars: ntiles, arrive-before-reading (a bug), skip the full wait (a bug), the xor of the
/// empty parity (1; 0 is a bug).
fn ring_kernel() -> String {
    let body = "\
	mov.u32 %r1, %tid.x;
	shr.u32 %r2, %r1, 5;
	setp.ne.u32 %p1, %r1, 0;
	@%p1 bra INIT_DONE;
	mbarrier.init.shared::cta.b64 [full], 1;
	mbarrier.init.shared::cta.b64 [full+8], 1;
	mbarrier.init.shared::cta.b64 [empty], 64;
	mbarrier.init.shared::cta.b64 [empty+8], 64;
	fence.mbarrier_init.release.cluster;
INIT_DONE:
	bar.sync 0;
	setp.ne.u32 %p1, %r2, 0;
	@%p1 bra CONSUMER;
	elect.sync %r3|%p2, -1;
	@!%p2 bra END;
	mov.u32 %r4, 0;
PLOOP:
	setp.ge.u32 %p3, %r4, %r40;
	@%p3 bra END;
	and.b32 %r5, %r4, 1;
	shr.u32 %r6, %r4, 1;
	and.b32 %r7, %r6, 1;
	xor.b32 %r7, %r7, %r43;
	shl.b32 %r8, %r5, 3;
	mov.u32 %r9, empty;
	add.u32 %r9, %r9, %r8;
	mov.u32 %r10, full;
	add.u32 %r10, %r10, %r8;
PWAIT:
	mbarrier.try_wait.parity.shared::cta.b64 %p5, [%r9], %r7; // EMPTY_WAIT
	@!%p5 bra PWAIT;
	mbarrier.arrive.expect_tx.shared::cta.b64 _, [%r10], 2048;
	shl.b32 %r11, %r5, 11;
	mov.u32 %r12, stage;
	add.u32 %r12, %r12, %r11;
	shl.b32 %r13, %r4, 4;
	mov.u32 %r14, 0;
	cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%r12], [%rd41, {%r14, %r13}], [%r10]; // PRODUCE
	add.u32 %r4, %r4, 1;
	bra PLOOP;
CONSUMER:
	sub.u32 %r20, %r1, 32;
	mov.u32 %r4, 0;
CLOOP:
	setp.ge.u32 %p3, %r4, %r40;
	@%p3 bra END;
	and.b32 %r5, %r4, 1;
	shr.u32 %r6, %r4, 1;
	and.b32 %r7, %r6, 1;
	shl.b32 %r8, %r5, 3;
	mov.u32 %r9, empty;
	add.u32 %r9, %r9, %r8;
	mov.u32 %r10, full;
	add.u32 %r10, %r10, %r8;
	setp.ne.u32 %p7, %r42, 0;
	@%p7 bra CREADY;
CWAIT:
	mbarrier.try_wait.parity.shared::cta.b64 %p5, [%r10], %r7;
	@!%p5 bra CWAIT;
CREADY:
	setp.ne.u32 %p8, %r41, 0;
	@%p8 mbarrier.arrive.shared::cta.b64 %rd4, [%r9];
	shl.b32 %r11, %r5, 11;
	mov.u32 %r12, stage;
	add.u32 %r12, %r12, %r11;
	mov.u32 %r21, 0;
CREAD:
	setp.ge.u32 %p6, %r21, 8;
	@%p6 bra CARRIVE;
	shl.b32 %r22, %r21, 6;
	add.u32 %r22, %r22, %r20;
	shl.b32 %r23, %r22, 2;
	add.u32 %r24, %r12, %r23;
	ld.shared.u32 %r25, [%r24]; // CONSUME
	shl.b32 %r26, %r4, 9;
	add.u32 %r26, %r26, %r22;
	mul.wide.u32 %rd2, %r26, 4;
	add.u64 %rd3, %rd40, %rd2;
	st.global.u32 [%rd3], %r25;
	add.u32 %r21, %r21, 1;
	bra CREAD;
CARRIVE:
	@!%p8 mbarrier.arrive.shared::cta.b64 %rd4, [%r9];
	add.u32 %r4, %r4, 1;
	bra CLOOP;
END:";
    kernel(
        ".shared .align 1024 .b8 stage[4096];\n.shared .align 8 .b64 full[2];\n.shared .align 8 .b64 empty[2];",
        body,
        2,
        4,
    )
}

/// Runs the ring over a `rows x 32` f32 matrix (the last tile partly outside: zeros).
fn run_ring(ntiles: u32, rows: u64, flags: [u32; 3]) -> (Result<Vec<Vec<u8>>, VmError>, Vec<f32>, String) {
    let src = ring_kernel();
    let m = Module::load(&src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let mut vm = Vm::with_workers(1);
    let vals: Vec<f32> = (0..rows * 32).map(|i| i as f32 * 0.5 + 1.0).collect();
    let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let tensor = vm.alloc(bytes.len() as u64).unwrap();
    vm.write(tensor, &bytes).unwrap();
    let map = TensorMap::matrix(TensorDataType::F32, tensor, rows, 32, 128, 16, 32, Swizzle::None);
    let mapbuf = vm.alloc(128).unwrap();
    vm.write(mapbuf, &map.encode()).unwrap();
    let out_len = ntiles as usize * 512 * 4;
    let out = vm.alloc(out_len as u64).unwrap();
    let mut params = Vec::new();
    params.extend_from_slice(&out.to_le_bytes());
    params.extend_from_slice(&mapbuf.to_le_bytes());
    for s in [ntiles, flags[0], flags[1], flags[2]] {
        params.extend_from_slice(&s.to_le_bytes());
    }
    let r = vm.launch(&m, "t", &LaunchConfig::new([1, 1, 1], [96, 1, 1], 0), &params).map(|_| {
        let mut o = vec![0u8; out_len];
        vm.read(out, &mut o).unwrap();
        vec![o]
    });
    // Expected: tile t holds rows 16 t .. 16 t + 16, zero past the end.
    let want: Vec<f32> = (0..ntiles as u64 * 512)
        .map(|i| {
            let (row, col) = (i / 32, i % 32);
            if row < rows {
                vals[(row * 32 + col) as usize]
            } else {
                0.0
            }
        })
        .collect();
    (r, want, src)
}

#[test]
fn producer_and_consumers_pass_tiles_through_a_two_stage_ring() {
    for (ntiles, rows) in [(6u32, 91u64), (1, 16), (5, 80)] {
        let (r, want, _) = run_ring(ntiles, rows, [0, 0, 1]);
        let out = r.unwrap_or_else(|e| panic!("{e}"));
        let got: Vec<f32> = u32s(&out[0]).into_iter().map(f32::from_bits).collect();
        assert_eq!(got, want, "{ntiles} tiles of a {rows}-row matrix");
    }
}

#[test]
fn a_consumer_reading_before_the_full_phase_completes_is_an_async_proxy_race() {
    let (r, _, src) = run_ring(4, 64, [0, 1, 1]);
    let f = finding_of(r);
    assert_eq!(f.kind, "async-proxy race", "{f}");
    assert_eq!(f.line, line_of(&src, "// CONSUME"), "{f}");
    let c = f.conflict.as_ref().expect("the copy");
    assert_eq!((c.line, c.write), (line_of(&src, "// PRODUCE"), true), "{f}");
    assert!(f.to_string().contains("has not observed"), "{f}");
}

#[test]
fn a_producer_refilling_a_stage_the_consumers_still_read_is_an_async_proxy_race() {
    // The consumers arrive on "empty" before they read the stage: the producer's wait on it no
    // longer orders the reads before its next copy into the stage.
    let (r, _, src) = run_ring(4, 64, [1, 0, 1]);
    let f = finding_of(r);
    assert_eq!(f.kind, "async-proxy race", "{f}");
    assert_eq!(f.line, line_of(&src, "// PRODUCE"), "{f}");
    let c = f.conflict.as_ref().expect("the read");
    assert_eq!((c.line, c.write), (line_of(&src, "// CONSUME"), false), "{f}");
}

#[test]
fn a_producer_waiting_on_the_wrong_parity_deadlocks() {
    let (r, _, src) = run_ring(4, 64, [0, 0, 0]);
    let f = finding_of(r);
    assert_eq!(f.kind, "deadlock", "{f}");
    assert_eq!(f.line, line_of(&src, "// EMPTY_WAIT"), "{f}");
    let d = f.nearest_allocation.clone().unwrap_or_default();
    assert!(d.contains("warp 0 waits") && d.contains("warp 1 waits") && d.contains("parity 0"), "{d}");
}

// ------------------------------------------------------------------------------------------------
// Findings of misuse
// ------------------------------------------------------------------------------------------------

/// One thread: init, expect `expect` bytes, copy a 16 x 32 f32 box (2048 bytes) to `smem + off`
/// through the map in buffer 1, wait, read.
fn single_copy(expect: u32, off: u32, map: &[u8]) -> (Result<Vec<Vec<u8>>, VmError>, String) {
    let body = format!(
        "\
	mbarrier.init.shared::cta.b64 [bar], 1;
	mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], {expect}; // EXPECT
	mov.u32 %r1, smem;
	add.u32 %r1, %r1, {off};
	mov.u32 %r2, 0;
	cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%r1], [%rd41, {{%r2, %r2}}], [bar]; // COPY
SPIN:
	mbarrier.try_wait.parity.shared::cta.b64 %p1, [bar], 0;
	@!%p1 bra SPIN;
	ld.shared.u32 %r3, [smem];
	st.global.u32 [%rd40], %r3;"
    );
    let src = kernel(".shared .align 1024 .b8 smem[4096];\n.shared .align 8 .b64 bar;", &body, 3, 0);
    let mut vm = Vm::with_workers(1);
    let tensor = vm.alloc(16 * 128).unwrap();
    vm.write(tensor, &[1u8; 16 * 128]).unwrap();
    let mut mapb = map.to_vec();
    if mapb.is_empty() {
        mapb = TensorMap::matrix(TensorDataType::F32, tensor, 16, 32, 128, 16, 32, Swizzle::None).encode().to_vec();
    }
    let m = Module::load(&src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let out = vm.alloc(4).unwrap();
    let mapbuf = vm.alloc(128).unwrap();
    vm.write(mapbuf, &mapb).unwrap();
    let mut params = out.to_le_bytes().to_vec();
    params.extend_from_slice(&mapbuf.to_le_bytes());
    params.extend_from_slice(&tensor.to_le_bytes());
    let r = vm.launch(&m, "t", &LaunchConfig::new([1, 1, 1], [1, 1, 1], 0), &params).map(|_| vec![]);
    (r, src)
}

#[test]
fn a_well_formed_single_copy_runs() {
    let (r, _) = single_copy(2048, 0, &[]);
    r.unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn a_tensor_map_without_the_magic_is_a_finding() {
    let mut garbage = [0x5Au8; 128];
    garbage[0] = b'C';
    let (r, src) = single_copy(2048, 0, &garbage);
    let f = finding_of(r);
    assert_eq!((f.kind.as_str(), f.line), ("invalid tensor map", line_of(&src, "// COPY")), "{f}");
    assert!(f.to_string().contains("PVTM"), "{f}");
    // A valid map modified after encoding fails its checksum.
    let mut m = TensorMap::matrix(TensorDataType::F32, 0x1000, 16, 32, 128, 16, 32, Swizzle::None).encode();
    m[24] ^= 1;
    let f = finding_of(single_copy(2048, 0, &m).0);
    assert!(f.kind == "invalid tensor map" && f.to_string().contains("checksum"), "{f}");
}

#[test]
fn a_destination_not_aligned_to_128_bytes_is_a_finding() {
    let (r, src) = single_copy(2048, 64, &[]);
    let f = finding_of(r);
    assert_eq!((f.kind.as_str(), f.line), ("misaligned bulk copy", line_of(&src, "// COPY")), "{f}");
    assert!(f.to_string().contains("128-byte aligned"), "{f}");
}

#[test]
fn more_bytes_than_expected_is_a_tx_count_underflow() {
    let (r, src) = single_copy(1024, 0, &[]);
    let f = finding_of(r);
    assert_eq!((f.kind.as_str(), f.line), ("mbarrier tx-count underflow", line_of(&src, "// COPY")), "{f}");
    // Fewer bytes than expected: the phase never completes.
    let (r, src) = single_copy(4096, 0, &[]);
    let f = finding_of(r);
    assert_eq!(f.kind, "deadlock", "{f}");
    assert_eq!(f.line, line_of(&src, "mbarrier.try_wait"), "{f}");
    assert!(f.to_string().contains("tx-count 2048"), "{f}");
}

#[test]
fn a_wait_no_arrival_can_complete_is_a_deadlock() {
    let body = "\
	mov.u32 %r1, %tid.x;
	setp.ne.u32 %p1, %r1, 0;
	@%p1 bra W;
	mbarrier.init.shared::cta.b64 [bar], 2;
	mbarrier.arrive.shared::cta.b64 _, [bar];
W:
	bar.sync 0;
SPIN:
	mbarrier.try_wait.parity.shared::cta.b64 %p2, [bar], 0; // WAIT
	@!%p2 bra SPIN;";
    let src = kernel(".shared .align 8 .b64 bar;", body, 1, 0);
    let f = finding_of(launch(&src, 64, &[vec![0; 4]], &[]));
    assert_eq!((f.kind.as_str(), f.line), ("deadlock", line_of(&src, "// WAIT")), "{f}");
    assert!(f.to_string().contains("1 of 2 arrivals pending"), "{f}");
}

#[test]
fn mbarrier_misuse_is_reported_with_its_line() {
    let run = |body: &str| {
        let src = kernel(".shared .align 8 .b64 bar;\n.shared .align 8 .b64 bar2;", body, 1, 0);
        (finding_of(launch(&src, 1, &[vec![0; 4]], &[])), src)
    };
    let (f, src) = run("\tmbarrier.arrive.shared::cta.b64 _, [bar]; // X");
    assert_eq!((f.kind.as_str(), f.line), ("mbarrier misuse", line_of(&src, "// X")), "{f}");
    assert!(f.to_string().contains("not initialised"), "{f}");
    let (f, src) = run("\tmbarrier.init.shared::cta.b64 [bar], 2;\n\tmbarrier.arrive.shared::cta.b64 _, [bar];\n\tmbarrier.init.shared::cta.b64 [bar], 2; // X");
    assert_eq!((f.kind.as_str(), f.line), ("mbarrier misuse", line_of(&src, "// X")), "{f}");
    assert!(f.to_string().contains("in use"), "{f}");
    let (f, _) = run("\tmbarrier.init.shared::cta.b64 [bar], 2;\n\tmbarrier.arrive.shared::cta.b64 _, [bar], 3;");
    assert!(f.kind == "mbarrier misuse" && f.to_string().contains("count 3"), "{f}");
    let (f, _) = run("\tmbarrier.init.shared::cta.b64 [bar], 1;\n\tmbarrier.inval.shared::cta.b64 [bar];\n\tmbarrier.try_wait.parity.shared::cta.b64 %p1, [bar], 0;");
    assert!(f.kind == "mbarrier misuse" && f.to_string().contains("invalidated"), "{f}");
    let (f, _) = run("\tmbarrier.init.shared::cta.b64 [bar], 1;\n\tmbarrier.init.shared::cta.b64 [bar2], 1;\n\tmbarrier.arrive.shared::cta.b64 %rd1, [bar];\n\tmbarrier.test_wait.shared::cta.b64 %p1, [bar2], %rd1;");
    assert!(f.kind == "mbarrier misuse" && f.to_string().contains("state operand"), "{f}");
    // complete_tx before the arrivals is allowed (the tx-count is -16 while an arrival is
    // pending), but the last arrival leaves the phase on a negative count no one can raise.
    let (f, src) = run("\tmbarrier.init.shared::cta.b64 [bar], 1;\n\tmbarrier.complete_tx.shared::cta.b64 [bar], 16;\n\tmbarrier.arrive.shared::cta.b64 _, [bar]; // X");
    assert_eq!((f.kind.as_str(), f.line), ("mbarrier tx-count underflow", line_of(&src, "// X")), "{f}");
    let src = kernel(
        ".shared .align 8 .b64 bar;",
        "\tmbarrier.init.shared::cta.b64 [bar], 1;\n\tmbarrier.complete_tx.shared::cta.b64 [bar], 16;\n\tmbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], 16;\n\tmbarrier.try_wait.parity.shared::cta.b64 %p1, [bar], 0;\n\t@!%p1 trap;",
        1,
        0,
    );
    launch(&src, 1, &[vec![0; 4]], &[]).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn setmaxnreg_must_be_executed_by_the_whole_warpgroup() {
    // Threads 0..63: two warps of warpgroup 0 only.
    let body = "\tsetmaxnreg.inc.sync.aligned.u32 240; // X";
    let src = kernel("", body, 1, 0);
    let f = finding_of(launch(&src, 64, &[vec![0; 4]], &[]));
    assert_eq!((f.kind.as_str(), f.line), ("warp collective divergence", line_of(&src, "// X")), "{f}");
    assert!(f.to_string().contains("warpgroup"), "{f}");
    launch(&src, 128, &[vec![0; 4]], &[]).unwrap_or_else(|e| panic!("{e}"));
    let bad = kernel("", "\tsetmaxnreg.inc.sync.aligned.u32 244;", 1, 0);
    let e = Module::load(&bad).err().expect("a load error");
    assert!(e.message.contains("multiple of 8"), "{e}");
}

// ------------------------------------------------------------------------------------------------
// Other instructions
// ------------------------------------------------------------------------------------------------

#[test]
fn elect_cluster_registers_and_fences() {
    let body = "\
	mov.u32 %r1, %tid.x;
	setp.lt.u32 %p1, %r1, 5;
	@%p1 bra SKIP;
	elect.sync %r2|%p2, 0xffffffe0;
	selp.u32 %r3, 1, 0, %p2;
	shl.b32 %r4, %r1, 3;
	cvt.u64.u32 %rd1, %r4;
	add.u64 %rd2, %rd40, %rd1;
	st.global.v2.u32 [%rd2], {%r2, %r3};
SKIP:
	bar.warp.sync -1;
	setp.ne.u32 %p3, %r1, 0;
	@%p3 bra END2;
	mov.u32 %r5, %cluster_ctarank;
	mov.u32 %r6, %cluster_nctarank;
	mov.u32 %r7, %clusterid.x;
	mov.u32 %r8, %cluster_nctaid.x;
	mov.u32 %r9, %warpid;
	mov.u32 %r10, %is_explicit_cluster;
	fence.proxy.async.shared::cta;
	fence.proxy.tensormap::generic.acquire.gpu [%rd40], 128;
	fence.proxy.tensormap::generic.release.gpu;
	barrier.cluster.arrive.release.aligned;
	barrier.cluster.wait.acquire.aligned;
	st.global.v4.u32 [%rd40+256], {%r5, %r6, %r7, %r8};
	st.global.v2.u32 [%rd40+272], {%r9, %r10};
END2:";
    let src = kernel("", body, 1, 0);
    let out = launch(&src, 32, &[vec![0; 280]], &[]).unwrap_or_else(|e| panic!("{e}"));
    let w = u32s(&out[0]);
    for l in 0..32 {
        let want = if l < 5 { [0, 0] } else { [5, (l == 5) as u32] };
        assert_eq!([w[2 * l], w[2 * l + 1]], want, "lane {l}");
    }
    assert_eq!(&w[64..70], &[0, 1, 0, 1, 0, 0]);
}

/// `cp.async.bulk` (no tensor map) in and out of shared memory, and a 2-D tensor store with a
/// swizzled map clipped at the tensor's edge.
#[test]
fn bulk_copies_and_tensor_stores() {
    let body = "\
	mbarrier.init.shared::cta.b64 [bar], 1;
	mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], 256;
	cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [smem], [%rd40], 256, [bar];
SPIN:
	mbarrier.try_wait.parity.shared::cta.b64 %p1, [bar], 0;
	@!%p1 bra SPIN;
	fence.proxy.async.shared::cta;
	cp.async.bulk.global.shared::cta.bulk_group [%rd41], [smem], 256;
	mov.u32 %r1, 1;
	mov.u32 %r2, -1;
	cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%rd42, {%r1, %r2}], [smem];
	cp.async.bulk.commit_group;
	cp.async.bulk.wait_group.read 0;";
    let src = kernel(".shared .align 1024 .b8 smem[1024];\n.shared .align 8 .b64 bar;", body, 4, 0);
    let m = Module::load(&src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let mut vm = Vm::with_workers(1);
    let input: Vec<u8> = (0..256u32).map(|i| (i * 7 + 3) as u8).collect();
    let a = vm.alloc(256).unwrap();
    vm.write(a, &input).unwrap();
    let b = vm.alloc(256).unwrap();
    // The store's target: a 6 x 5 matrix of f32 (rows of 32 bytes); the box is 8 x 8 f32 (256
    // bytes) with 32B swizzle, stored at column 1, row -1.
    let target = vm.alloc(5 * 32).unwrap();
    vm.write(target, &[0xCC; 160]).unwrap();
    let map = TensorMap::matrix(TensorDataType::F32, target, 5, 6, 32, 8, 8, Swizzle::B32);
    let mapbuf = vm.alloc(128).unwrap();
    vm.write(mapbuf, &map.encode()).unwrap();
    let mut params = Vec::new();
    for p in [a, b, mapbuf, 0] {
        params.extend_from_slice(&p.to_le_bytes());
    }
    vm.launch(&m, "t", &LaunchConfig::new([1, 1, 1], [1, 1, 1], 0), &params).unwrap_or_else(|e| panic!("{e}"));
    let mut got = vec![0u8; 256];
    vm.read(b, &mut got).unwrap();
    assert_eq!(got, input);
    let mut t = vec![0u8; 160];
    vm.read(target, &mut t).unwrap();
    // Box element (row i, col j) is logical shared byte 32 i + 4 j, stored swizzled; it goes to
    // global (row i - 1, col j + 1) when that is inside the 5 x 6 matrix.
    let mut want = vec![0xCCu8; 160];
    for i in 0..8i64 {
        for j in 0..8i64 {
            let (gr, gc) = (i - 1, j + 1);
            if (0..5).contains(&gr) && (0..6).contains(&gc) {
                let s = swizzled(Swizzle::B32, (32 * i + 4 * j) as usize);
                let at = (gr * 32 + gc * 4) as usize;
                want[at..at + 4].copy_from_slice(&input[s..s + 4]);
            }
        }
    }
    assert_eq!(t, want);
}

#[test]
fn unsupported_bulk_forms_are_load_errors_naming_the_qualifier() {
    let load = |inst: &str| -> LoadError {
        let src = kernel(".shared .align 1024 .b8 smem[1024];\n.shared .align 8 .b64 bar;", inst, 2, 0);
        Module::load(&src).err().unwrap_or_else(|| panic!("`{inst}` loaded"))
    };
    let e = load("\tcp.async.bulk.tensor.3d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes [smem], [%rd41, {%r1, %r2, %r3}], [bar], {%rs1};");
    assert!(e.message.contains(".im2col"), "{e}");
    let e = load("\tcp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [smem], [%rd41, {%r1, %r2}], [bar], %r3;");
    assert!(e.message.contains(".multicast::cluster"), "{e}");
    let e = load("\tmbarrier.arrive.noComplete.shared::cta.b64 %rd1, [bar], 1;");
    assert!(e.message.contains(".noComplete"), "{e}");
    // The cache hint operand is accepted and ignored.
    let src = kernel(
        ".shared .align 1024 .b8 smem[1024];\n.shared .align 8 .b64 bar;",
        "\tcp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [smem], [%rd41, {%r1, %r2}], [bar], %rd2;",
        2,
        0,
    );
    Module::load(&src).unwrap_or_else(|e| panic!("{e}"));
}
