//! Fused `ld.shared.b32` + `fma.rn.f32` runs (`ptx-vm/src/fuse.rs`): the VM takes such a run in
//! one step where that cannot change anything. Every case runs twice, fused and one instruction
//! at a time (the bank-conflict count watches single instructions, so it turns fusion off), and
//! must give the same bits, counts and findings; the values are also checked against f32
//! arithmetic done here.

use crate::util;
use ptx_vm::{Finding, LaunchConfig, LaunchStats, Module, Vm, VmError};
use util::*;

/// Runs `body` (see `util::kernel`) with 64 threads in `blocks` blocks, fused (`banks` off) or
/// one by one (`banks` on); the output buffer holds `out_words` words, poisoned before.
fn launch(
    decls: &str,
    body: &str,
    blocks: u32,
    out_words: usize,
    banks: bool,
) -> Result<(Vec<u32>, LaunchStats), VmError> {
    let src = kernel(decls, body);
    let m = Module::load(&src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let mut vm = Vm::with_workers(2);
    vm.set_bank_conflicts(banks);
    let out = vm.alloc(out_words as u64 * 4)?;
    vm.write(out, &vec![0xA5u8; out_words * 4])?;
    let stats = vm.launch(&m, "t", &LaunchConfig::new([blocks, 1, 1], [64, 1, 1], 0), &out.to_le_bytes())?;
    let mut b = vec![0u8; out_words * 4];
    vm.read(out, &mut b)?;
    Ok((words(&b), stats))
}

/// Both ways; the results must agree. Returns the fused run's.
fn both(decls: &str, body: &str, blocks: u32, out_words: usize) -> Result<(Vec<u32>, LaunchStats), VmError> {
    let fused = launch(decls, body, blocks, out_words, false);
    let single = launch(decls, body, blocks, out_words, true);
    match (&fused, &single) {
        (Ok((a, sa)), Ok((b, sb))) => {
            assert_eq!(a, b, "fused and one by one give the same bits");
            assert_eq!(
                (sa.thread_instructions, sa.warp_instructions, sa.global_bytes_read, sa.global_bytes_written),
                (sb.thread_instructions, sb.warp_instructions, sb.global_bytes_read, sb.global_bytes_written),
                "the same counts"
            );
            assert_eq!(sb.fused_warp_instructions, 0, "the bank-conflict count runs one by one");
        }
        (Err(a), Err(b)) => assert_eq!(finding_of(a), finding_of(b), "the same finding"),
        _ => panic!("fused {fused:?}\none by one {single:?}"),
    }
    fused
}

/// Both ways, `body` must fail with a shared-memory race at the line marked `at`, in thread
/// `thread` of block 0, naming the access of warp `other.0` (a write if `other.1`) at the line
/// marked `other.2`.
fn assert_race(decls: &str, body: &str, at: &str, thread: u32, other: (u32, bool, &str)) {
    let err = both(decls, body, 1, 64 * 4).unwrap_err();
    let f = finding_of(&err);
    let src = kernel(decls, body);
    assert_eq!((f.kind.as_str(), f.line, f.thread), ("shared memory race", line_of(&src, at), [thread, 0, 0]), "{f:?}");
    let c = f.conflict.clone().expect("a race names the other access");
    assert_eq!((c.warp, c.write, c.line), (other.0, other.1, line_of(&src, other.2)), "{f:?}");
}

fn finding_of(e: &VmError) -> &Finding {
    match e {
        VmError::Memcheck(f) | VmError::Trap(f) => f,
        other => panic!("expected a finding, got {other:?}"),
    }
}

const DECLS: &str = ".shared .align 4 .b8 sm[256];";

/// Word `w` of the window holds `w * 0.37 - 3` (as f32 arithmetic: `mul`, then `sub`).
fn word_value(w: u32) -> f32 {
    w as f32 * f32::from_bits(0x3EBD_70A4) - 3.0
}

/// Thread t stores word t (64 threads fill the 256-byte window), a barrier, then `%rd4` = the
/// window address of word `t % 32` for the loads; `%f10..%f12` start at 1, 2, 0.5.
const PROLOGUE: &str = "mov.u32 %r1, %tid.x;\n cvt.rn.f32.u32 %f1, %r1;\n mul.rn.f32 %f1, %f1, 0f3EBD70A4;\n\
    sub.rn.f32 %f1, %f1, 0f40400000;\n mov.u64 %rd1, sm;\n mul.wide.u32 %rd2, %r1, 4;\n add.s64 %rd3, %rd1, %rd2;\n\
    st.shared.f32 [%rd3], %f1;\n bar.sync 0;\n and.b32 %r2, %r1, 31;\n mul.wide.u32 %rd5, %r2, 4;\n\
    add.s64 %rd4, %rd1, %rd5;\n mov.f32 %f10, 0f3F800000;\n mov.f32 %f11, 0f40000000;\n mov.f32 %f12, 0f3F000000;\n";

/// Thread t of block b writes `%f10`, `%f11`, `%f12` and `%f3` to out[4 (64 b + t) ..].
const EPILOGUE: &str = "mov.u32 %r9, %ctaid.x;\n mad.lo.u32 %r10, %r9, 64, %r1;\n mul.wide.u32 %rd6, %r10, 16;\n add.s64 %rd7, %rd0, %rd6;\n st.global.v4.f32 [%rd7], {%f10, %f11, %f12, %f3};\n";

/// The run of the tests: eight pairs from `%rd4` at offsets out of order, the loaded register in
/// every operand position and as the destination, a destination that a later pair reads.
const RUN: [(i64, &str); 8] = [
    (0, "fma.rn.f32 %f10, %f3, %f11, %f10;"),
    (16, "fma.rn.f32 %f11, %f10, %f3, %f11;"),
    (128, "fma.rn.f32 %f12, %f10, %f11, %f3;"),
    (4, "fma.rn.f32 %f3, %f3, %f3, %f12;"),
    (64, "fma.rn.f32 %f10, %f3, %f12, %f10;"),
    (32, "fma.rn.f32 %f12, %f12, %f11, %f3;"),
    (8, "fma.rn.f32 %f11, %f3, %f10, %f11;"),
    (96, "fma.rn.f32 %f3, %f10, %f11, %f12;"),
];

fn run_body(offsets: &[i64]) -> String {
    let mut b = String::from(PROLOGUE);
    for (k, (&off, (_, fma))) in offsets.iter().zip(RUN).enumerate() {
        b += &format!("ld.shared.b32 %f3, [%rd4+{off}]; // LOAD{k}\n {fma}\n");
    }
    b + EPILOGUE
}

/// What thread `t` computes, in f32 here.
fn expected(t: u32, offsets: &[i64]) -> [u32; 4] {
    let (mut f10, mut f11, mut f12, mut f3) = (1.0f32, 2.0f32, 0.5f32, 0.0f32);
    let lane = t % 32;
    for (&off, k) in offsets.iter().zip(0..) {
        f3 = word_value(lane + off as u32 / 4);
        match k {
            0 => f10 = f3.mul_add(f11, f10),
            1 => f11 = f10.mul_add(f3, f11),
            2 => f12 = f10.mul_add(f11, f3),
            3 => f3 = f3.mul_add(f3, f12),
            4 => f10 = f3.mul_add(f12, f10),
            5 => f12 = f12.mul_add(f11, f3),
            6 => f11 = f3.mul_add(f10, f11),
            _ => f3 = f10.mul_add(f11, f12),
        }
    }
    [f10, f11, f12, f3].map(f32::to_bits)
}

#[test]
fn a_run_gives_the_bits_of_f32_arithmetic_and_of_one_by_one() {
    let offsets: Vec<i64> = RUN.iter().map(|r| r.0).collect();
    let (out, stats) = both(DECLS, &run_body(&offsets), 3, 3 * 64 * 4).unwrap();
    for b in 0..3 {
        for t in 0..64u32 {
            let got = &out[(b * 64 + t as usize) * 4..][..4];
            assert_eq!(got, expected(t, &offsets), "block {b}, thread {t}");
        }
    }
    // Where the CPU has AVX-512F, each warp of each block ran the eight pairs as one step.
    if std::arch::is_x86_feature_detected!("avx512f") {
        assert_eq!(stats.fused_warp_instructions, 3 * 2 * 16, "{stats:?}");
    } else {
        assert_eq!(stats.fused_warp_instructions, 0);
    }
}

#[test]
fn a_load_past_the_window_inside_a_run_is_reported_at_its_line() {
    // The fifth load reads 160 bytes past lane l's word: lanes from 24 on are outside the
    // 256-byte window. The run declines and the loads run one by one: the first four pairs
    // complete, the fifth reports lane 24 of warp 0.
    let offsets = [0, 16, 128, 4, 160, 32, 8, 96];
    let body = run_body(&offsets);
    let err = both(DECLS, &body, 1, 64 * 4).unwrap_err();
    let f = finding_of(&err);
    let src = kernel(DECLS, &body);
    assert_eq!(
        (f.kind.as_str(), f.line, f.thread),
        ("shared memory out of window", line_of(&src, "// LOAD4"), [24, 0, 0])
    );
    assert_eq!(f.address, Some(24 * 4 + 160));
}

#[test]
fn a_misaligned_base_is_reported_by_the_first_load() {
    // `%rd4` one byte past each lane's word: every load is misaligned; the first one reports.
    let body = run_body(&RUN.map(|r| r.0))
        .replace("add.s64 %rd4, %rd1, %rd5;", "add.s64 %rd4, %rd1, %rd5;\n add.s64 %rd4, %rd4, 1;");
    let err = both(DECLS, &body, 1, 64 * 4).unwrap_err();
    let f = finding_of(&err);
    let src = kernel(DECLS, &body);
    assert_eq!(
        (f.kind.as_str(), f.line, f.thread),
        ("misaligned access", line_of(&src, "// LOAD0"), [0, 0, 0]),
        "{f:?}"
    );
}

#[test]
fn reads_of_a_run_are_stamped_for_a_later_store_of_another_warp() {
    // Both warps run the pairs after the barrier; warp 0 runs first, to its exit, then thread
    // 40 (warp 1) stores to word 9 with no barrier in between: a write-after-read race,
    // reported at the store and naming warp 0's last load of word 9 (lane 7 of the load at
    // offset 8). Warp 0's reads were queued by its fused step.
    let offsets = RUN.map(|r| r.0);
    let body = run_body(&offsets).replace(
        EPILOGUE,
        &format!("setp.eq.u32 %p1, %r1, 40;\n @%p1 st.shared.f32 [sm+36], %f3; // STORE\n{EPILOGUE}"),
    );
    assert_race(DECLS, &body, "// STORE", 40, (0, false, "// LOAD6"));
}

#[test]
fn a_run_reading_another_warps_unordered_store_is_a_race_at_the_right_load() {
    // Thread 0 rewrites word 12 after the barrier, then both warps run the pairs (warp 0
    // first). Warp 0's own store is no race for its reads. Warp 1's run finds another warp's
    // store in the interval, so it declines, and its loads, one by one, report the
    // read-after-write race at the first load with a lane on word 12: offset 0, lane 12
    // (thread 44).
    let offsets = RUN.map(|r| r.0);
    let body = run_body(&offsets).replace(
        "bar.sync 0;\n",
        "bar.sync 0;\n setp.eq.u32 %p1, %r1, 0;\n @%p1 st.shared.f32 [sm+48], %f1; // STORE\n",
    );
    assert_race(DECLS, &body, "// LOAD0", 44, (0, true, "// STORE"));
}

#[test]
fn a_run_on_a_window_not_fully_written_leaves_initcheck_to_the_loads() {
    // A 512-byte window of which the 64 threads write the first 256 bytes: the offset-128 load
    // of lanes 0..31 stays inside the written half, and the run has no load past it, so the
    // result is that of the full window. A load at 256 + 4 l then reads unwritten bytes: the
    // initcheck finding names lane 0 at that load.
    let decls = ".shared .align 4 .b8 sm[512];";
    let offsets = RUN.map(|r| r.0);
    let (out, stats) = both(decls, &run_body(&offsets), 1, 64 * 4).unwrap();
    for t in 0..64u32 {
        assert_eq!(&out[t as usize * 4..][..4], expected(t, &offsets), "thread {t}");
    }
    assert_eq!(stats.fused_warp_instructions, 0, "half the window unwritten: no fused step");
    let mut far = offsets;
    far[5] = 256;
    let body = run_body(&far);
    let err = both(decls, &body, 1, 64 * 4).unwrap_err();
    let f = finding_of(&err);
    let src = kernel(decls, &body);
    assert_eq!(f.line, line_of(&src, "// LOAD5"), "{f:?}");
    assert_eq!(f.thread, [0, 0, 0], "{f:?}");
    assert_eq!(f.kind, "uninitialized shared memory read", "{f:?}");
}

#[test]
fn the_f32_flash_kernel_gives_the_same_bits_fused_and_one_by_one() {
    // flash_fwd_f32_d64 at lengths that are not tile multiples, causal with seq_q < seq_kv, GQA
    // 4/2: O, LSE, the counts and every input bit for bit both ways.
    use kernels_gpu::abi::{AttnParams, Strides};
    use kernels_gpu::tiles::FLASH_F32_D64;
    let m = module();
    let (batch, heads, heads_kv, seq_q, seq_kv, d) = (2u32, 4u32, 2u32, 70u32, 100u32, 64u32);
    let mut rng = Rng(7);
    let nq = (batch * seq_q * heads * d) as usize;
    let nkv = (batch * seq_kv * heads_kv * d) as usize;
    let data: Vec<Vec<f32>> = [nq, nkv, nkv].iter().map(|&n| (0..n).map(|_| rng.f32()).collect()).collect();
    let run = |banks: bool| -> (Vec<u8>, LaunchStats) {
        let mut vm = Vm::with_workers(2);
        vm.set_bank_conflicts(banks);
        let mut up = |bytes: Vec<u8>| {
            let p = vm.alloc(bytes.len() as u64).unwrap();
            vm.write(p, &bytes).unwrap();
            p
        };
        let f = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let (q, k, v) = (up(f(&data[0])), up(f(&data[1])), up(f(&data[2])));
        let (o, lse) = (up(vec![0xA5; nq * 4]), up(vec![0xA5; (batch * heads * seq_q) as usize * 4]));
        let p = AttnParams {
            q,
            k,
            v,
            o,
            lse,
            scores: 0,
            q_strides: Strides::bshd(seq_q as u64, heads as u64, d as u64),
            k_strides: Strides::bshd(seq_kv as u64, heads_kv as u64, d as u64),
            v_strides: Strides::bshd(seq_kv as u64, heads_kv as u64, d as u64),
            o_strides: Strides::bshd(seq_q as u64, heads as u64, d as u64),
            batch,
            heads,
            heads_kv,
            seq_q,
            seq_kv,
            head_dim: d,
            causal: 1,
            softmax_scale: 1.0 / (d as f32).sqrt(),
            ..AttnParams::default()
        };
        let dims = FLASH_F32_D64.launch(batch, heads, seq_q);
        let stats = vm
            .launch(
                &m,
                "flash_fwd_f32_d64",
                &LaunchConfig::new(dims.grid, dims.block, dims.dynamic_smem_bytes),
                &p.to_bytes(),
            )
            .unwrap();
        let mut out = vec![0u8; nq * 4 + (batch * heads * seq_q) as usize * 4];
        vm.read(o, &mut out[..nq * 4]).unwrap();
        vm.read(lse, &mut out[nq * 4..]).unwrap();
        (out, stats)
    };
    let ((fo, fs), (so, ss)) = (run(false), run(true));
    assert!(fo == so, "O and LSE: the same bits");
    assert!(!fo.chunks(4).any(|c| c == [0xA5; 4]), "every element written");
    assert_eq!((fs.thread_instructions, fs.warp_instructions), (ss.thread_instructions, ss.warp_instructions));
    assert_eq!(ss.fused_warp_instructions, 0);
    if std::arch::is_x86_feature_detected!("avx512f") {
        assert!(fs.fused_warp_instructions > fs.warp_instructions / 4, "{fs:?}");
    }
}

#[test]
fn reads_of_a_run_with_lanes_out_of_order_are_stamped_at_their_loads() {
    // As above, with lane l reading word 5 l mod 32 (+ the offset): words that are not evenly
    // spaced, listed once for the whole run. Thread 40's store to word 9 must name warp 0's last
    // load of word 9: the one at offset 8 (lane 27).
    let offsets = RUN.map(|r| r.0);
    let body =
        run_body(&offsets).replace("and.b32 %r2, %r1, 31;", "mul.lo.u32 %r2, %r1, 5;\n and.b32 %r2, %r2, 31;").replace(
            EPILOGUE,
            &format!("setp.eq.u32 %p1, %r1, 40;\n @%p1 st.shared.f32 [sm+36], %f3; // STORE\n{EPILOGUE}"),
        );
    assert_race(DECLS, &body, "// STORE", 40, (0, false, "// LOAD6"));
    // Without the store: the values of f32 arithmetic on the permuted words.
    let body = run_body(&offsets).replace("and.b32 %r2, %r1, 31;", "mul.lo.u32 %r2, %r1, 5;\n and.b32 %r2, %r2, 31;");
    let (out, stats) = both(DECLS, &body, 1, 64 * 4).unwrap();
    for t in 0..64u32 {
        let lane = (5 * t) % 32;
        assert_eq!(&out[t as usize * 4..][..4], expected(lane, &offsets), "thread {t}");
    }
    if std::arch::is_x86_feature_detected!("avx512f") {
        assert_eq!(stats.fused_warp_instructions, 2 * 16, "{stats:?}");
    }
}

#[test]
fn a_run_of_one_word_for_every_lane_gives_the_bits_of_one_by_one() {
    // Every lane reads word 7 (+ the offset): the broadcast load of a run (lanes in order take
    // one row, lanes out of order a gather: the tests above).
    let offsets = RUN.map(|r| r.0);
    let body = run_body(&offsets).replace("and.b32 %r2, %r1, 31;", "mov.u32 %r2, 7;");
    let (out, stats) = both(DECLS, &body, 2, 2 * 64 * 4).unwrap();
    for t in 0..2 * 64u32 {
        assert_eq!(&out[t as usize * 4..][..4], expected(7, &offsets), "thread {t}");
    }
    if std::arch::is_x86_feature_detected!("avx512f") {
        assert_eq!(stats.fused_warp_instructions, 2 * 2 * 16, "{stats:?}");
    }
}
