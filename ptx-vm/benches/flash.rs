//! Throughput of the VM on the flash kernels `flash_fwd_f32_d64` (SIMT, f32) and
//! `flash_fwd_bf16_d64` (tensor cores), batch 1, heads 2, seq 256, and on the backward's main
//! kernel `flash_bwd_bf16_d64` (tensor cores, FlashAttention-2's warp layout) at the same shape
//! (its inputs: random Q, K, V, dO, a saved LSE of `ln(seq)` and a random D); and the decode
//! kernels `decode_mma_bf16_d128` (tensor cores) and `decode_fwd_f32_d128` (SIMT) on one step of
//! batch 1, heads 32 / 8 (GQA), a contiguous cache of 4096 keys, 8 KV splits (the decode launch
//! alone, without the split combine).
//!
//! Run: `cargo bench -p memattn-ptx-vm --bench flash` (add `-- <runs>` to change the number of runs, and
//! a word such as `bf16` to run only the kernels whose name contains it).
//! Prints thread-instructions per second and the median wall time for 1 worker and for all cores,
//! and, for the f32 kernel on 1 worker, the same with shared-memory initcheck and racecheck off
//! (their cost).
//!
//! Each line ends with a checksum of the launch's results: FNV-1a over the thread-instruction
//! count and every buffer of the launch (inputs and outputs) as read back after the first run, so
//! that two builds of the VM can be compared for bit-identical results
//! (`ptx-vm/scripts/bench-vs.sh OLD_BIN NEW_BIN` runs two builds alternately and compares them).
//!
//! Where the time goes, per kernel (before issue 27's changes; details and the measurements
//! after them in `ptx-vm/PERF.md`):
//!
//! | kernel | largest shares |
//! |---|---|
//! | `flash_fwd_f32_d64`, `decode_fwd_f32_d128` | `ld.shared.b32` (a third of the instructions, 57 % of the cycles: window checks and racecheck's per-word stamps, cache misses on a 32-byte shadow per word), `fma`, dispatch |
//! | `flash_fwd_bf16_d64`, `flash_bwd_bf16_d64` | `mma` (32 %: scalar gathers into f64 arrays), zeroing a 2 MB register file per warp and block, `ldmatrix`, `cvt` to bf16 |
//! | `decode_mma_bf16_d128` | `cp.async` issue and completion (per lane, byte by byte), `ldmatrix`, `mma` |

use kernels_gpu::abi::{AttnParams, BwdParams, Strides};
use kernels_gpu::decode_abi::DecodeParams;
use kernels_gpu::tiles::{LaunchDims, DECODE_D128, DECODE_MMA_D128, FLASH_BWD_TC_D64, FLASH_F32_D64, FLASH_MMA_D64};
use memattn_ptx_vm::{LaunchConfig, Module, Vm};

use kernels_gpu::artifacts::PTX;

fn main() {
    let runs: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(7);
    // A word that is not a number or a flag keeps only the kernels whose name contains it.
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-') && a.parse::<usize>().is_err());
    let module = Module::load(PTX).expect("module loads");
    let cores = std::thread::available_parallelism().map(|c| c.get()).unwrap_or(1);
    let mut worker_counts = vec![1];
    if cores > 1 {
        worker_counts.push(cores);
    }
    for (kernel, elem_bytes, tile) in [
        ("flash_fwd_f32_d64", 4usize, FLASH_F32_D64.launch(1, 2, 256)),
        ("flash_fwd_bf16_d64", 2, FLASH_MMA_D64.launch(1, 2, 256)),
        ("flash_bwd_bf16_d64", 2, FLASH_BWD_TC_D64.launch(1, 2, 256)),
    ] {
        if filter.as_ref().is_some_and(|f| !kernel.contains(f.as_str())) {
            continue;
        }
        for &workers in &worker_counts {
            bench(&module, kernel, elem_bytes, tile, workers, runs, true);
        }
        if elem_bytes == 4 {
            bench(&module, kernel, elem_bytes, tile, 1, runs, false);
        }
    }
    for (kernel, elem_bytes, tile) in [
        ("decode_mma_bf16_d128", 2usize, DECODE_MMA_D128.launch(SPLITS, 1, 4, 8, 1)),
        ("decode_fwd_f32_d128", 4, DECODE_D128.launch(SPLITS, 1, 4, 8, 1)),
    ] {
        if filter.as_ref().is_some_and(|f| !kernel.contains(f.as_str())) {
            continue;
        }
        for &workers in &worker_counts {
            bench_decode(&module, kernel, elem_bytes, tile, workers, runs);
        }
    }
}

/// KV splits of the decode cases.
const SPLITS: u32 = 8;

/// One decode step (batch 1, heads 32 / 8, d 128, 4096 cached keys, [`SPLITS`] splits), `runs`
/// times; prints the median.
fn bench_decode(module: &Module, kernel: &str, elem_bytes: usize, dims: LaunchDims, workers: usize, runs: usize) {
    let (heads, heads_kv, d, cache) = (32u32, 8u32, 128u32, 4096u32);
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut rnd = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let mut data = |n: usize| -> Vec<u8> {
        (0..n)
            .flat_map(|_| {
                let x = rnd();
                if elem_bytes == 4 {
                    x.to_le_bytes().to_vec()
                } else {
                    half::bf16::from_f32(x).to_le_bytes().to_vec()
                }
            })
            .collect()
    };
    let (nq, nkv) = ((heads * d) as usize, (cache * heads_kv * d) as usize);
    let mut vm = Vm::with_workers(workers);
    let mut up = |bytes: Vec<u8>| {
        let b = vm.alloc(bytes.len() as u64).unwrap();
        vm.write(b, &bytes).unwrap();
        b
    };
    let (q, k, v) = (up(data(nq)), up(data(nkv)), up(data(nkv)));
    let seqlens = up(cache.to_le_bytes().to_vec());
    let o = up(vec![0; nq * elem_bytes]);
    let lse = up(vec![0; heads as usize * 4]);
    let o_part = up(vec![0; SPLITS as usize * nq * 4]);
    let lse_part = up(vec![0; SPLITS as usize * heads as usize * 4]);
    let p = DecodeParams {
        q,
        k_cache: k,
        v_cache: v,
        cache_seqlens: seqlens,
        o,
        lse,
        o_part,
        lse_part,
        batch: 1,
        heads,
        heads_kv,
        seq_q: 1,
        head_dim: d,
        seq_cache: cache,
        num_splits: SPLITS,
        causal: 1,
        softmax_scale: 1.0 / (d as f32).sqrt(),
        window_left: -1,
        window_right: -1,
        ..DecodeParams::default()
    };
    let bufs = [
        (q, nq * elem_bytes),
        (o, nq * elem_bytes),
        (lse, heads as usize * 4),
        (o_part, SPLITS as usize * nq * 4),
        (lse_part, SPLITS as usize * heads as usize * 4),
    ];
    let (instr, med, sum) = timed(&mut vm, module, kernel, dims, &p.to_bytes(), runs, &bufs);
    println!(
        "{kernel} b1 h{heads}/{heads_kv} cache {cache} d{d} splits {SPLITS}: workers {workers}: median wall {:.2} ms \
         over {runs} runs, {instr} thread-instructions, {:.1} M thread-instructions/s, checksum {sum:016x}",
        med.as_secs_f64() * 1e3,
        instr as f64 / med.as_secs_f64() / 1e6
    );
}

/// Runs `kernel` (batch 1, heads 2, seq 256, d 64) `runs` times and prints the median.
fn bench(
    module: &Module,
    kernel: &str,
    elem_bytes: usize,
    dims: LaunchDims,
    workers: usize,
    runs: usize,
    initcheck: bool,
) {
    let (batch, heads, seq, d) = (1u32, 2u32, 256u32, 64u32);
    let n = (batch * heads * seq * d) as usize;
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut rnd = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let enc = |x: f32| -> Vec<u8> {
        if elem_bytes == 4 {
            x.to_le_bytes().to_vec()
        } else {
            half::bf16::from_f32(x).to_le_bytes().to_vec()
        }
    };
    // q, k, v (and for the backward d_o) random; o, dq, dk, dv written by the kernels.
    let data: Vec<Vec<u8>> = (0..4).map(|_| (0..n).flat_map(|_| enc(rnd())).collect()).collect();
    let mut vm = Vm::with_workers(workers);
    vm.set_initcheck(initcheck);
    vm.set_racecheck(initcheck);
    let bufs: Vec<u64> = (0..8).map(|_| vm.alloc((n * elem_bytes) as u64).unwrap()).collect();
    for (b, d) in bufs.iter().zip(&data) {
        vm.write(*b, d).unwrap();
    }
    let rows = (batch * heads * seq) as usize;
    let lse = vm.alloc(rows as u64 * 4).unwrap();
    let delta = vm.alloc(rows as u64 * 4).unwrap();
    let dq_accum = vm.alloc(n as u64 * 4).unwrap();
    // The backward's inputs: an LSE near the uniform softmax's, a small random D, a zero accumulator.
    let f32s =
        |f: &mut dyn FnMut() -> f32, len: usize| -> Vec<u8> { (0..len).flat_map(|_| f().to_le_bytes()).collect() };
    vm.write(lse, &f32s(&mut || (seq as f32).ln(), rows)).unwrap();
    vm.write(delta, &f32s(&mut || 0.1 * rnd(), rows)).unwrap();
    vm.write(dq_accum, &vec![0u8; n * 4]).unwrap();
    let st = Strides::bshd(seq as u64, heads as u64, d as u64);
    let p = AttnParams {
        q: bufs[0],
        k: bufs[1],
        v: bufs[2],
        o: bufs[3],
        lse,
        scores: 0,
        q_strides: st,
        k_strides: st,
        v_strides: st,
        o_strides: st,
        batch,
        heads,
        seq_q: seq,
        seq_kv: seq,
        head_dim: d,
        causal: 0,
        softmax_scale: 1.0 / (d as f32).sqrt(),
        ..AttnParams::default()
    };
    let params: Vec<u8> = if kernel.starts_with("flash_bwd") {
        BwdParams {
            attn: p,
            d_o: bufs[3],
            delta,
            dq_accum,
            dq: bufs[4],
            dk: bufs[5],
            dv: bufs[6],
            dsinks: 0,
            d_o_strides: st,
            dq_accum_strides: st,
            dq_strides: st,
            dk_strides: st,
            dv_strides: st,
            dq_split_stride: 0,
            dq_splits: 1,
            key_block: FLASH_BWD_TC_D64.bc,
        }
        .to_bytes()
        .to_vec()
    } else {
        AttnParams { o: bufs[4], ..p }.to_bytes().to_vec()
    };
    let mut all: Vec<(u64, usize)> = bufs.iter().map(|&b| (b, n * elem_bytes)).collect();
    all.extend([(lse, rows * 4), (delta, rows * 4), (dq_accum, n * 4)]);
    let (instr, med, sum) = timed(&mut vm, module, kernel, dims, &params, runs, &all);
    println!(
        "{kernel} b{batch} h{heads} s{seq} d{d}: workers {workers}{}: median wall {:.2} ms over {runs} runs, \
         {instr} thread-instructions, {:.1} M thread-instructions/s, checksum {sum:016x}",
        if initcheck { "" } else { " (initcheck, racecheck off)" },
        med.as_secs_f64() * 1e3,
        instr as f64 / med.as_secs_f64() / 1e6
    );
}

/// `runs` launches of `kernel`: its thread-instructions, the median wall time, and the checksum
/// of the instruction count and of the buffers `bufs` (address, bytes) after the first launch.
fn timed(
    vm: &mut Vm,
    module: &Module,
    kernel: &str,
    dims: LaunchDims,
    params: &[u8],
    runs: usize,
    bufs: &[(u64, usize)],
) -> (u64, std::time::Duration, u64) {
    let cfg = LaunchConfig::new(dims.grid, dims.block, dims.dynamic_smem_bytes);
    let mut walls = Vec::new();
    let mut instr = 0;
    let mut sum = 0;
    for run in 0..runs {
        let s = vm.launch(module, kernel, &cfg, params).expect("launch");
        instr = s.thread_instructions;
        walls.push(s.wall);
        if run == 0 {
            sum = checksum(vm, instr, bufs);
        }
    }
    walls.sort();
    (instr, walls[walls.len() / 2], sum)
}

/// FNV-1a (64-bit) over `instr` and the bytes of every buffer in `bufs`.
fn checksum(vm: &Vm, instr: u64, bufs: &[(u64, usize)]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(&instr.to_le_bytes());
    for &(ptr, len) in bufs {
        let mut out = vec![0u8; len];
        vm.read(ptr, &mut out).expect("read back");
        eat(&out);
    }
    h
}
