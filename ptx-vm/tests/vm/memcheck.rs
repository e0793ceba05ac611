//! Memcheck: deliberately broken kernels must produce the exact finding.

use crate::util;
use ptx_vm::{Finding, LaunchConfig, Module, Vm, VmError};
use util::*;

fn finding(decls: &str, body: &str, blocks: u32, threads: u32, out_bytes: usize) -> (Box<Finding>, String, String) {
    let src = kernel(decls, body);
    match run(decls, body, blocks, threads, out_bytes) {
        Err(e @ (VmError::Memcheck(_) | VmError::Trap(_))) => {
            let text = e.to_string();
            match e {
                VmError::Memcheck(f) | VmError::Trap(f) => (f, src, text),
                _ => unreachable!(),
            }
        }
        other => panic!("expected a finding, got {other:?}"),
    }
}

#[test]
fn out_of_bounds_store() {
    let body = "mov.u32 %r1, %tid.x;\n mul.wide.u32 %rd1, %r1, 4;\n add.s64 %rd2, %rd0, %rd1;\n\
        st.global.u32 [%rd2], %r1; // OOB";
    let (f, src, text) = finding("", body, 1, 8, 20);
    assert_eq!(f.kind, "out-of-bounds global store");
    assert_eq!(f.kernel, "t");
    assert_eq!(f.thread, [5, 0, 0]);
    assert_eq!(f.block, [0, 0, 0]);
    assert_eq!(f.line, line_of(&src, "// OOB"));
    assert_eq!(f.instruction, "st.global.u32 [%rd2], %r1;");
    assert_eq!(f.access_bytes, Some(4));
    assert!(
        f.nearest_allocation.as_deref().unwrap().contains("0 bytes past the end of the 20-byte allocation"),
        "{f:?}"
    );
    for part in
        ["out-of-bounds global store", "kernel `t`", "thread (5, 0, 0)", "line", "st.global.u32", "20-byte allocation"]
    {
        assert!(text.contains(part), "{text}");
    }
}

#[test]
fn shared_out_of_window() {
    let decls = ".shared .align 4 .b8 sm[64];";
    let body = "mov.u32 %r1, %tid.x;\n mul.wide.u32 %rd1, %r1, 4;\n mov.u64 %rd2, sm;\n add.s64 %rd3, %rd2, %rd1;\n\
        st.shared.u32 [%rd3], %r1; // SHARED";
    let (f, src, _) = finding(decls, body, 2, 32, 4);
    assert_eq!(f.kind, "shared memory out of window");
    assert_eq!(f.thread, [16, 0, 0]);
    assert_eq!(f.block, [0, 0, 0], "the lowest failing block is reported");
    assert_eq!(f.line, line_of(&src, "// SHARED"));
    assert_eq!(f.address, Some(64));
}

#[test]
fn barrier_under_divergent_branch() {
    let body = "mov.u32 %r1, %tid.x;\n setp.lt.u32 %p1, %r1, 16;\n @%p1 bra SKIP;\n bar.sync 0; // FIRST\n\
        SKIP:\n bar.sync 0; // SECOND\n";
    let (f, src, _) = finding("", body, 1, 32, 4);
    assert_eq!(f.kind, "barrier divergence");
    assert_eq!(f.thread, [0, 0, 0]);
    assert_eq!(f.line, line_of(&src, "// SECOND"));
}

#[test]
fn deadlock_between_warps() {
    let body = "mov.u32 %r1, %tid.x;\n setp.lt.u32 %p1, %r1, 32;\n @%p1 bra SKIP;\n bar.sync 0; // WARP1\n\
        bra.uni END;\nSKIP:\n bar.sync 0; // WARP0\nEND:\n";
    let (f, src, text) = finding("", body, 1, 64, 4);
    assert_eq!(f.kind, "deadlock");
    assert_eq!(f.thread, [32, 0, 0]);
    assert_eq!(f.line, line_of(&src, "// WARP1"));
    assert!(text.contains("deadlock"), "{text}");
}

#[test]
fn barrier_waits_only_for_live_threads() {
    // Warp 1 exits early; warp 0's barrier completes.
    let body = "mov.u32 %r1, %tid.x;\n setp.ge.u32 %p1, %r1, 32;\n @%p1 bra END;\n bar.sync 0;\n st.global.u32 [%rd0], 1;\nEND:\n";
    let o = words(&run("", body, 1, 64, 4).unwrap());
    assert_eq!(o[0], 1);
}

#[test]
fn use_after_free() {
    let src = kernel("", "st.global.u32 [%rd0+8], 1; // UAF");
    let m = Module::load(&src).unwrap();
    let mut vm = Vm::new();
    let p = vm.alloc(64).unwrap();
    vm.free(p).unwrap();
    let e = vm.launch(&m, "t", &LaunchConfig::new([1, 1, 1], [1, 1, 1], 0), &p.to_le_bytes()).unwrap_err();
    let VmError::Memcheck(f) = e else { panic!("{e:?}") };
    assert_eq!(f.kind, "use after free");
    assert_eq!(f.line, line_of(&src, "// UAF"));
    assert_eq!(f.address, Some(p + 8));
    assert!(f.nearest_allocation.as_deref().unwrap().contains("freed 64-byte allocation"), "{f:?}");
    assert!(matches!(vm.free(p), Err(VmError::InvalidPointer(_))));
}

#[test]
fn misaligned_access() {
    let (f, src, _) = finding("", "ld.global.u32 %r1, [%rd0+2]; // MIS", 1, 1, 16);
    assert_eq!(f.kind, "misaligned access");
    assert_eq!(f.line, line_of(&src, "// MIS"));
    let (f, _, _) = finding("", "st.global.v2.u32 [%rd0+4], {%r1, %r2};", 1, 1, 16);
    assert_eq!(f.kind, "misaligned access");
    assert_eq!(f.access_bytes, Some(8));
}

#[test]
fn vector_global_load_past_the_end_names_the_first_lane_and_element_outside() {
    // All 32 lanes load two words at 8 * tid of a 252-byte buffer: lanes 0-30 are inside, lane 31
    // reads bytes 248..256, of which only its first element (248..252) is inside. The report
    // names lane 31 and its second element (4 bytes at +252): a check of each lane's first
    // element alone would let it through.
    let body = "mov.u32 %r1, %tid.x;\n mul.wide.u32 %rd1, %r1, 8;\n add.s64 %rd2, %rd0, %rd1;\n\
        ld.global.v2.u32 {%r2, %r3}, [%rd2]; // LOAD";
    let (f, src, text) = finding("", body, 1, 32, 252);
    assert_eq!(
        (f.kind.as_str(), f.line, f.thread),
        ("out-of-bounds global load", line_of(&src, "// LOAD"), [31, 0, 0]),
        "{text}"
    );
    assert_eq!(f.access_bytes, Some(4), "{text}");
    let base = f.address.unwrap() - 252;
    assert_eq!(base % 256, 0, "the buffer's start: {text}");
    // Inside the buffer, every lane reads what the lanes stored.
    let ok = "mov.u32 %r1, %tid.x;\n mul.wide.u32 %rd1, %r1, 4;\n add.s64 %rd2, %rd0, %rd1;\n\
        add.u32 %r4, %r1, 100;\n st.global.u32 [%rd2], %r4;\n bar.sync 0;\n\
        and.b32 %r5, %r1, 30;\n mul.wide.u32 %rd3, %r5, 4;\n add.s64 %rd4, %rd0, %rd3;\n\
        ld.global.v2.u32 {%r2, %r3}, [%rd4];\n bar.sync 0;\n add.u32 %r6, %r2, %r3;\n st.global.u32 [%rd2], %r6;";
    let want: Vec<u32> = (0..32u32).map(|t| 2 * (t & 30) + 201).collect();
    assert_eq!(words(&run("", ok, 1, 32, 128).unwrap()), want);
}

#[test]
fn local_overflow() {
    let decls = "";
    let body = "{ .local .align 4 .b8 dep[8];\n mov.u64 %rd1, dep;\n st.local.u32 [%rd1+8], 1; // LOCAL\n }";
    let (f, src, _) = finding(decls, body, 1, 1, 4);
    assert_eq!(f.kind, "local memory overflow");
    assert_eq!(f.line, line_of(&src, "// LOCAL"));
}

#[test]
fn trap_and_hang() {
    let (f, src, text) = finding("", "mov.u32 %r1, %tid.x;\n setp.eq.u32 %p1, %r1, 3;\n @%p1 trap; // TRAP", 1, 8, 4);
    assert_eq!(f.kind, "trap");
    assert_eq!(f.thread, [3, 0, 0]);
    assert_eq!(f.line, line_of(&src, "// TRAP"));
    assert!(text.starts_with("The kernel stopped"), "{text}");
    let src = kernel("", "L:\n bra.uni L;");
    let m = Module::load(&src).unwrap();
    let mut vm = Vm::new();
    let mut lim = vm.limits();
    lim.max_instructions_per_thread = 10_000;
    vm.set_limits(lim);
    let p = vm.alloc(4).unwrap();
    let e = vm.launch(&m, "t", &LaunchConfig::new([1, 1, 1], [32, 1, 1], 0), &p.to_le_bytes()).unwrap_err();
    assert!(matches!(&e, VmError::Trap(f) if f.kind.starts_with("instruction budget")), "{e:?}");
}

#[test]
fn a_launch_time_limit_stops_endless_loops_and_endless_grids_whatever_their_shape() {
    // Without a time limit, an endless loop stops only at the per-thread budget, one warp after
    // another (minutes for many warps), and a grid of 2^31 - 1 empty blocks never stops in a
    // useful time. With one, both stop in about that time, as a trap naming the limit.
    let limit = std::time::Duration::from_millis(300);
    let run = |src: &str, grid: u32, block: u32| {
        let m = Module::load(src).unwrap();
        let mut vm = Vm::new();
        let mut lim = vm.limits();
        lim.max_launch_time = Some(limit);
        vm.set_limits(lim);
        let p = vm.alloc(4).unwrap();
        let t = std::time::Instant::now();
        let e = vm.launch(&m, "t", &LaunchConfig::new([grid, 1, 1], [block, 1, 1], 0), &p.to_le_bytes()).unwrap_err();
        (e, t.elapsed())
    };
    let endless = kernel("", "L:\n add.u32 %r1, %r1, 1;\n bra.uni L; // LOOP");
    let (e, took) = run(&endless, 64, 1024);
    let VmError::Trap(f) = &e else { panic!("expected a trap, got {e:?}") };
    assert!(f.kind.starts_with("launch time limit exceeded"), "{e}");
    assert!(f.line == line_of(&endless, "// LOOP") || f.line + 1 == line_of(&endless, "// LOOP"), "{e}");
    assert!(took < limit * 10, "stopped after {took:?}");
    let nop = kernel("", "");
    let (e, took) = run(&nop, i32::MAX as u32, 32);
    assert!(matches!(&e, VmError::Trap(f) if f.kind.starts_with("launch time limit exceeded")), "{e:?}");
    assert!(took < limit * 10, "stopped after {took:?}");
    // A launch that finishes in time is untouched by the limit.
    let m = Module::load(&nop).unwrap();
    let mut vm = Vm::new();
    let mut lim = vm.limits();
    lim.max_launch_time = Some(std::time::Duration::from_secs(30));
    vm.set_limits(lim);
    let p = vm.alloc(4).unwrap();
    vm.launch(&m, "t", &LaunchConfig::new([64, 1, 1], [64, 1, 1], 0), &p.to_le_bytes()).unwrap();
}

#[test]
fn shared_memory_is_fresh_and_poisoned_per_block() {
    // Each block reads its shared word before writing it. With initcheck off the read sees the
    // poison, never the previous block's write.
    let decls = ".shared .align 4 .b8 sm[4];";
    let body =
        "mov.u32 %r1, %ctaid.x;\n ld.shared.u32 %r2, [sm];\n mul.wide.u32 %rd1, %r1, 4;\n add.s64 %rd2, %rd0, %rd1;\n\
        st.global.u32 [%rd2], %r2;\n st.shared.u32 [sm], %r1;";
    let o = words(&run_with(decls, body, 16, 1, 64, false).unwrap());
    assert!(o.iter().all(|&w| w == ptx_vm::SHARED_POISON), "{o:x?}");

    // With initcheck on (the default) the same read is a finding at the load.
    let (f, src, text) = finding(decls, body, 1, 1, 64);
    assert_eq!(f.kind, "uninitialized shared memory read", "{text}");
    assert_eq!(f.line, line_of(&src, "ld.shared.u32 %r2"), "{text}");
    assert!(text.contains("no thread of this block has written shared bytes 0..4 yet"), "{text}");
    assert_eq!((f.block, f.thread), ([0, 0, 0], [0, 0, 0]));
}

#[test]
fn shared_read_of_another_threads_unsynchronised_store_is_caught_only_when_unwritten() {
    // Thread 1 reads the word thread 0 stores; without a barrier the read runs first (warp order
    // is by PC, and thread 0 stores after its own read): a finding. With bar.sync: no finding.
    let decls = ".shared .align 4 .b8 sm[8];";
    let racy = "mov.u32 %r1, %tid.x;\n setp.eq.u32 %p1, %r1, 1;\n @%p1 ld.shared.u32 %r2, [sm];\n\
        @!%p1 st.shared.u32 [sm], 7;";
    let (f, src, text) = finding(decls, racy, 1, 2, 8);
    assert_eq!(f.kind, "uninitialized shared memory read", "{text}");
    assert_eq!((f.line, f.thread), (line_of(&src, "@%p1 ld.shared"), [1, 0, 0]), "{text}");

    let synced = "mov.u32 %r1, %tid.x;\n setp.eq.u32 %p1, %r1, 0;\n @%p1 st.shared.u32 [sm], 7;\n bar.sync 0;\n\
        ld.shared.u32 %r2, [sm];\n mul.wide.u32 %rd1, %r1, 4;\n add.s64 %rd2, %rd0, %rd1;\n st.global.u32 [%rd2], %r2;";
    assert_eq!(words(&run(decls, synced, 1, 2, 8).unwrap()), vec![7, 7]);
}

#[test]
fn launch_validation() {
    let m = Module::load(&kernel("", "")).unwrap();
    let mut vm = Vm::new();
    let e = vm.launch(&m, "t", &LaunchConfig::new([1, 1, 1], [1, 1, 1], 0), &[0u8; 4]).unwrap_err();
    let s = e.to_string();
    assert!(matches!(e, VmError::InvalidLaunch(_)) && s.contains('8') && s.contains('4'), "{s}");
    let e = vm.launch(&m, "t", &LaunchConfig::new([1, 1, 1], [2048, 1, 1], 0), &[0u8; 8]).unwrap_err();
    assert!(e.to_string().contains("max_block"), "{e}");
    // sm_80's opt-in limit (163 KiB) is the most a block gets; 48 KiB is only the default.
    assert_eq!((vm.limits().max_shared_per_block, vm.limits().shared_per_block_default), (163 * 1024, 48 * 1024));
    let e = vm.launch(&m, "t", &LaunchConfig::new([1, 1, 1], [32, 1, 1], 163 * 1024 + 16), &[0u8; 8]).unwrap_err();
    assert!(e.to_string().contains("max_shared_per_block"), "{e}");
    vm.launch(&m, "t", &LaunchConfig::new([1, 1, 1], [32, 1, 1], 64 * 1024), &[0u8; 8]).unwrap();
    let mut h = Vm::new();
    h.set_limits(ptx_vm::DeviceLimits::sm90());
    h.launch(&m, "t", &LaunchConfig::new([1, 1, 1], [32, 1, 1], 227 * 1024), &[0u8; 8]).unwrap();
    let e = h.launch(&m, "t", &LaunchConfig::new([1, 1, 1], [32, 1, 1], 227 * 1024 + 16), &[0u8; 8]).unwrap_err();
    assert!(e.to_string().contains("max_shared_per_block"), "{e}");
    assert!(matches!(
        vm.launch(&m, "nope", &LaunchConfig::new([1; 3], [1; 3], 0), &[]),
        Err(VmError::UnknownKernel(_))
    ));
}

#[test]
fn heap_statistics() {
    let mut vm = Vm::new();
    let mut lim = vm.limits();
    lim.memory_bytes = 1000;
    vm.set_limits(lim);
    let a = vm.alloc(600).unwrap();
    assert!(a != 0 && a.is_multiple_of(256));
    assert_eq!(vm.alloc(500), Err(VmError::OutOfMemory { requested: 500, free: 400 }));
    let b = vm.alloc(300).unwrap();
    assert_eq!(vm.memory().current_bytes, 900);
    vm.free(a).unwrap();
    assert_eq!(vm.memory().current_bytes, 300);
    assert_eq!(vm.memory().peak_bytes, 900);
    vm.reset_peak();
    assert_eq!(vm.memory().peak_bytes, 300);
    assert_eq!(vm.memory().live_allocations, 1);
    assert_eq!(vm.memory().total_allocations, 2);
    assert!(vm.write(b + 290, &[0u8; 20]).is_err());
    let mut x = [0u8; 4];
    assert!(vm.read(a, &mut x).is_err());
}

#[test]
fn racecheck_on_the_fully_written_window_names_the_element_and_both_lines() {
    // Once every shared byte has been written, `ld.shared` takes the VM's fast path: its race
    // reports must be those of the general path. Warp 0 fills the window, a barrier, then warp
    // 0 rewrites word 1 and all 32 lanes of warp 1 load both words as one vector (every lane the
    // same address): the race is on the vector's second element, named with both lines.
    let decls = ".shared .align 8 .b8 sm[8];";
    let body = "mov.u32 %r1, %tid.x;\n setp.eq.u32 %p1, %r1, 0;\n setp.ge.u32 %p2, %r1, 32;\n\
        @%p1 st.shared.v2.u32 [sm], {1, 2};\n bar.sync 0;\n @%p1 st.shared.u32 [sm+4], 7; // STORE\n\
        @%p2 ld.shared.v2.u32 {%r2, %r3}, [sm]; // LOAD";
    let (f, src, text) = finding(decls, body, 1, 64, 8);
    assert_eq!(
        (f.kind.as_str(), f.line, f.thread),
        ("shared memory race", line_of(&src, "// LOAD"), [32, 0, 0]),
        "{text}"
    );
    assert!(text.contains("warp 1 reads shared word 4 that warp 0 wrote since the last barrier"), "{text}");
    assert_eq!((f.address, f.access_bytes), (Some(4), Some(4)), "the second element, 4 bytes: {text}");
    let c = f.conflict.clone().expect("a race names the other access");
    assert_eq!((c.warp, c.write, c.line), (0, true, line_of(&src, "// STORE")), "{text}");
    // Ordered by a second barrier, the same loads see the new value in every lane of warp 1.
    let ordered = "mov.u32 %r1, %tid.x;\n setp.eq.u32 %p1, %r1, 0;\n setp.ge.u32 %p2, %r1, 32;\n\
        @%p1 st.shared.v2.u32 [sm], {1, 2};\n bar.sync 0;\n @%p1 st.shared.u32 [sm+4], 7;\n bar.sync 0;\n\
        ld.shared.v2.u32 {%r2, %r3}, [sm];\n add.u32 %r4, %r2, %r3;\n mul.wide.u32 %rd1, %r1, 4;\n\
        add.s64 %rd2, %rd0, %rd1;\n st.global.u32 [%rd2], %r4;";
    assert_eq!(words(&run(decls, ordered, 1, 64, 256).unwrap()), vec![8; 64]);
}

#[test]
fn racecheck_of_word_loads_on_the_fully_written_window_names_the_first_racing_lane() {
    // The one-word `ld.shared` of the f32 kernels on the fully written window: warp 0 fills the
    // 32 words (one each), a barrier, then threads 5 and 6 rewrite words 9 and 3, and every
    // lane l of warp 1 loads word l. Lanes 3 and 9 race; the report names lane 3 (thread 35),
    // the first in lane order, its word and warp 0's store.
    let decls = ".shared .align 4 .b8 sm[128];";
    let body = "mov.u32 %r1, %tid.x;\n mov.u32 %r2, sm;\n and.b32 %r3, %r1, 31;\n shl.b32 %r3, %r3, 2;\n\
        add.u32 %r4, %r2, %r3;\n setp.lt.u32 %p1, %r1, 32;\n setp.ge.u32 %p2, %r1, 32;\n\
        setp.eq.u32 %p3, %r1, 5;\n setp.eq.u32 %p4, %r1, 6;\n\
        @%p1 st.shared.u32 [%r4], %r1;\n bar.sync 0;\n\
        @%p3 st.shared.u32 [sm+36], 7;\n @%p4 st.shared.u32 [sm+12], 8; // STORE\n\
        @%p2 ld.shared.u32 %r5, [%r4]; // LOAD";
    let (f, src, text) = finding(decls, body, 1, 64, 8);
    assert_eq!(
        (f.kind.as_str(), f.line, f.thread),
        ("shared memory race", line_of(&src, "// LOAD"), [35, 0, 0]),
        "{text}"
    );
    assert!(text.contains("warp 1 reads shared word 12 that warp 0 wrote since the last barrier"), "{text}");
    assert_eq!((f.address, f.access_bytes), (Some(12), Some(4)), "{text}");
    let c = f.conflict.clone().expect("a race names the other access");
    assert_eq!((c.warp, c.write, c.line), (0, true, line_of(&src, "// STORE")), "{text}");
}

#[test]
fn racecheck_finds_unordered_shared_accesses_between_warps() {
    let decls = ".shared .align 4 .b8 sm[8];";
    // Read after write: warp 0 stores word 0, warp 1 loads it with no barrier in between.
    let raw = "mov.u32 %r1, %tid.x;\n setp.eq.u32 %p1, %r1, 0;\n setp.eq.u32 %p2, %r1, 32;\n\
        @%p1 st.shared.u32 [sm], 7; // STORE\n @%p2 ld.shared.u32 %r2, [sm]; // LOAD";
    let (f, src, text) = finding(decls, raw, 1, 64, 8);
    assert_eq!(f.kind, "shared memory race", "{text}");
    assert_eq!((f.line, f.thread), (line_of(&src, "// LOAD"), [32, 0, 0]), "{text}");
    assert!(text.contains("warp 1 reads shared word 0 that warp 0 wrote since the last barrier"), "{text}");
    // The report names the other access too: warp 0's store, by its PTX line and instruction.
    let store = line_of(&src, "// STORE");
    let c = f.conflict.clone().expect("a race names the other access");
    assert_eq!((c.warp, c.write, c.line, c.instruction.as_str()), (0, true, store, "@%p1 st.shared.u32 [sm], 7;"));
    assert!(text.contains(&format!("warp 0's write was at PTX line {store} `@%p1 st.shared.u32 [sm], 7;`")), "{text}");

    // The same accesses ordered by bar.sync: no finding, and the value arrives.
    let ordered = "mov.u32 %r1, %tid.x;\n setp.eq.u32 %p1, %r1, 0;\n setp.eq.u32 %p2, %r1, 32;\n\
        @%p1 st.shared.u32 [sm], 7;\n bar.sync 0;\n @%p2 ld.shared.u32 %r2, [sm];\n @%p2 st.global.u32 [%rd0], %r2;";
    assert_eq!(words(&run(decls, ordered, 1, 64, 8).unwrap())[0], 7);

    // Write after read: warp 0 reads word 0 after the barrier, warp 1 overwrites it.
    let war = "mov.u32 %r1, %tid.x;\n setp.eq.u32 %p1, %r1, 0;\n setp.eq.u32 %p2, %r1, 32;\n\
        @%p1 st.shared.u32 [sm], 7;\n bar.sync 0;\n @%p1 ld.shared.u32 %r2, [sm]; // LOAD\n\
        @%p2 st.shared.u32 [sm], 9; // STORE";
    let (f, src, text) = finding(decls, war, 1, 64, 8);
    assert_eq!((f.kind.as_str(), f.line), ("shared memory race", line_of(&src, "// STORE")), "{text}");
    assert!(text.contains("warp 1 writes shared word 0 that warp 0 read since the last barrier"), "{text}");
    let c = f.conflict.clone().expect("a race names the other access");
    assert_eq!((c.warp, c.write, c.line), (0, false, line_of(&src, "// LOAD")), "{text}");
    assert!(text.contains(&format!("warp 0's read was at PTX line {}", line_of(&src, "// LOAD"))), "{text}");
    // Both warps read the word (warp 1 last), then warp 1 overwrites it: the read named is
    // warp 0's, not warp 1's own.
    let war2 = "mov.u32 %r1, %tid.x;\n setp.eq.u32 %p1, %r1, 0;\n setp.eq.u32 %p2, %r1, 32;\n\
        @%p1 st.shared.u32 [sm], 7;\n bar.sync 0;\n @%p1 ld.shared.u32 %r2, [sm]; // WARP0\n\
        @%p2 ld.shared.u32 %r2, [sm]; // WARP1\n @%p2 st.shared.u32 [sm], 9; // STORE";
    let (f, src, text) = finding(decls, war2, 1, 64, 8);
    assert_eq!((f.kind.as_str(), f.line), ("shared memory race", line_of(&src, "// STORE")), "{text}");
    let c = f.conflict.clone().expect("a race names the other access");
    assert_eq!((c.warp, c.write, c.line), (0, false, line_of(&src, "// WARP0")), "{text}");

    // Atomics from every thread of both warps are not races. (Every thread storing the same
    // initial value would be: a write-write race, benign or not, is reported.)
    let atomics = "mov.u32 %r1, %tid.x;\n setp.eq.u32 %p1, %r1, 0;\n @%p1 st.shared.u32 [sm], 0;\n bar.sync 0;\n\
        atom.shared.add.u32 %r2, [sm], 1;\n bar.sync 0;\n @%p1 ld.shared.u32 %r3, [sm];\n @%p1 st.global.u32 [%rd0], %r3;";
    assert_eq!(words(&run(decls, atomics, 1, 64, 8).unwrap())[0], 64);
}

/// `flash_fwd_f32_d64` with its `n`-th `bar.sync` deleted (0: before a K/V tile is overwritten,
/// 1: after it is loaded), launched on 2 heads x 96 queries x 200 keys (4 key tiles), with
/// initcheck on or off.
fn flash_without_barrier(n: usize, initcheck: bool) -> Result<(), ptx_vm::VmError> {
    use kernels_gpu::abi::{AttnParams, Strides};
    use kernels_gpu::tiles::FLASH_F32_D64;
    let ptx = util::PTX;
    let start = ptx.find(".entry flash_fwd_f32_d64(").unwrap();
    let end = start + ptx[start..].find("\n}").unwrap();
    let at = start + ptx[start..end].match_indices("bar.sync").nth(n).expect("two barriers").0;
    let mutated = format!("{}// removed: {}", &ptx[..at], &ptx[at..]);
    let m = Module::load(&mutated).unwrap();
    let mut vm = Vm::with_workers(2);
    vm.set_initcheck(initcheck);
    let (h, sq, skv, d) = (2u64, 96u64, 200u64, 64u64);
    let mut rng = util::Rng(5);
    let mut up = |n: u64| {
        let p = vm.alloc(4 * n).unwrap();
        let b: Vec<u8> = (0..n).flat_map(|_| rng.f32().to_le_bytes()).collect();
        vm.write(p, &b).unwrap();
        p
    };
    let (q, k, v, o, lse) = (up(h * sq * d), up(h * skv * d), up(h * skv * d), up(h * sq * d), up(h * sq));
    let p = AttnParams {
        q,
        k,
        v,
        o,
        lse,
        q_strides: Strides::bshd(sq, h, d),
        k_strides: Strides::bshd(skv, h, d),
        v_strides: Strides::bshd(skv, h, d),
        o_strides: Strides::bshd(sq, h, d),
        batch: 1,
        heads: h as u32,
        seq_q: sq as u32,
        seq_kv: skv as u32,
        head_dim: d as u32,
        softmax_scale: 0.125,
        ..AttnParams::default()
    };
    let dims = FLASH_F32_D64.launch(1, h as u32, sq as u32);
    let cfg = LaunchConfig::new(dims.grid, dims.block, dims.dynamic_smem_bytes);
    vm.launch(&m, "flash_fwd_f32_d64", &cfg, &p.to_bytes()).map(|_| ())
}

#[test]
fn deleting_either_barrier_of_the_flash_kernel_is_caught() {
    // The untouched kernel has neither race nor uninitialized read (checked by the kernel tests);
    // without the barrier before a tile refill, a fast warp overwrites K/V that a slow warp still
    // reads; without the one after the load, a warp reads rows another warp is still storing.
    // Without initcheck the missing barrier after the load is a race too: the other warp's
    // store into a row this warp already read (write-after-read).
    let mut races = 0;
    for (n, initcheck) in [(0, true), (1, true), (1, false)] {
        match flash_without_barrier(n, initcheck) {
            Err(VmError::Memcheck(f)) => {
                eprintln!("barrier {n} removed: {f}");
                assert!(
                    f.kind == "shared memory race" || f.kind == "uninitialized shared memory read",
                    "barrier {n}: {f}"
                );
                assert!(f.instruction.contains("shared"), "barrier {n}: {f}");
                if f.kind == "shared memory race" {
                    // Both accesses by their Rust lines (the committed PTX has line tables):
                    // the load of the tile and the other warp's store into it.
                    races += 1;
                    let c = f.conflict.as_ref().expect("a race names the other access");
                    let (this, other) =
                        (f.source.clone().expect("a Rust line"), c.source.clone().expect("a Rust line"));
                    assert_eq!((this.file.as_str(), other.file.as_str()), (FLASH_RS, FLASH_RS), "{f}");
                    assert!(c.instruction.contains("shared") && this.line != other.line, "{f}");
                    assert!(f.to_string().contains(&format!("{FLASH_RS}:{}", other.line)), "{f}");
                }
            }
            other => panic!("barrier {n} removed, expected a finding, got {other:?}"),
        }
    }
    assert_eq!(races, 2, "barrier 0, and barrier 1 without initcheck, are races");
}

const FLASH_RS: &str = "kernels-gpu/src/flash_fwd_f32.rs";

#[test]
fn racecheck_of_full_warp_word_stores_names_the_first_racing_lane() {
    // Every lane of a warp storing one word: the VM checks all 32 words before stamping any.
    // Warp 0 stores words 0..31 (lane l: word l), then warp 1 stores word (l + 20) mod 64 with
    // no barrier in between: lanes 0..11 hit words 20..31 that warp 0 wrote. The report names
    // lane 0 (thread 32), word 20, and warp 0's store.
    let decls = ".shared .align 4 .b8 sm[256];";
    let body = "mov.u32 %r1, %tid.x;\n mov.u32 %r2, sm;\n setp.lt.u32 %p1, %r1, 32;\n and.b32 %r3, %r1, 31;\n\
        @%p1 bra W0;\n add.u32 %r3, %r3, 20;\n and.b32 %r3, %r3, 63;\n shl.b32 %r4, %r3, 2;\n add.u32 %r5, %r2, %r4;\n\
        st.shared.u32 [%r5], %r1; // WARP1\n bra DONE;\n\
        W0:\n shl.b32 %r4, %r3, 2;\n add.u32 %r5, %r2, %r4;\n st.shared.u32 [%r5], %r1; // WARP0\n DONE:";
    let (f, src, text) = finding(decls, body, 1, 64, 8);
    assert_eq!(
        (f.kind.as_str(), f.line, f.thread),
        ("shared memory race", line_of(&src, "// WARP1"), [32, 0, 0]),
        "{text}"
    );
    assert!(
        text.contains("warp 1 writes shared word 80 that warp 0 wrote since the last barrier (write-write race)"),
        "{text}"
    );
    let c = f.conflict.clone().expect("a race names the other access");
    assert_eq!((c.warp, c.write, c.line), (0, true, line_of(&src, "// WARP0")), "{text}");

    // Warp 0 reads words 0..31 instead: the same stores of warp 1 are write-after-read races,
    // lane 0 first again, naming warp 0's load.
    let body = body.replace("st.shared.u32 [%r5], %r1; // WARP0", "ld.shared.u32 %r6, [%r5]; // WARP0");
    let body = format!(
        "mov.u32 %r7, %tid.x;\n shl.b32 %r8, %r7, 2;\n mov.u32 %r9, sm;\n add.u32 %r9, %r9, %r8;\n\
        st.shared.u32 [%r9], %r7;\n bar.sync 0;\n{body}"
    );
    let (f, src, text) = finding(decls, &body, 1, 64, 8);
    assert_eq!(
        (f.kind.as_str(), f.line, f.thread),
        ("shared memory race", line_of(&src, "// WARP1"), [32, 0, 0]),
        "{text}"
    );
    assert!(
        text.contains("warp 1 writes shared word 80 that warp 0 read since the last barrier (write-after-read race)"),
        "{text}"
    );
    let c = f.conflict.clone().expect("a race names the other access");
    assert_eq!((c.warp, c.write, c.line), (0, false, line_of(&src, "// WARP0")), "{text}");
}

#[test]
fn full_warp_word_stores_to_one_word_keep_the_last_lane_and_are_no_race() {
    // All 32 lanes of each warp store their thread index to word 0 (one warp's own stores do
    // not race), a barrier between the warps' turns; lane 31 of the later warp wins: 63.
    let decls = ".shared .align 4 .b8 sm[4];";
    let body = "mov.u32 %r1, %tid.x;\n setp.lt.u32 %p1, %r1, 32;\n @%p1 st.shared.u32 [sm], %r1;\n bar.sync 0;\n\
        @!%p1 st.shared.u32 [sm], %r1;\n bar.sync 0;\n ld.shared.u32 %r2, [sm];\n mul.wide.u32 %rd1, %r1, 4;\n\
        add.s64 %rd2, %rd0, %rd1;\n st.global.u32 [%rd2], %r2;";
    assert_eq!(words(&run(decls, body, 1, 64, 256).unwrap_or_else(|e| panic!("{e}"))), vec![63; 64]);
}

#[test]
fn full_warp_global_stores_and_parameter_loads_report_the_first_bad_lane() {
    // 32 lanes store word l of a 100-byte buffer: lanes 0..24 fit, lane 25 is the first past
    // the end. The finding names thread 25.
    let body = "mov.u32 %r1, %tid.x;\n mul.wide.u32 %rd1, %r1, 4;\n add.s64 %rd2, %rd0, %rd1;\n\
        st.global.u32 [%rd2], %r1; // STORE";
    let (f, src, text) = finding("", body, 1, 32, 100);
    assert_eq!(
        (f.kind.as_str(), f.line, f.thread),
        ("out-of-bounds global store", line_of(&src, "// STORE"), [25, 0, 0]),
        "{text}"
    );
    // The same with a vector store, 16 bytes per lane: lane 6 reaches past 100 bytes.
    let body = "mov.u32 %r1, %tid.x;\n mul.wide.u32 %rd1, %r1, 16;\n add.s64 %rd2, %rd0, %rd1;\n\
        st.global.v4.u32 [%rd2], {%r1, %r1, %r1, %r1}; // STORE";
    let (f, src, text) = finding("", body, 1, 32, 100);
    assert_eq!(
        (f.kind.as_str(), f.line, f.thread),
        ("out-of-bounds global store", line_of(&src, "// STORE"), [6, 0, 0]),
        "{text}"
    );
    // A parameter load past the 8-byte parameter block, lane by lane: lane 2 reads bytes 8..12.
    let body =
        "mov.u32 %r1, %tid.x;\n mul.wide.u32 %rd1, %r1, 4;\n mov.u64 %rd3, t_param_0;\n add.s64 %rd2, %rd3, %rd1;\n\
        ld.param.u32 %r2, [%rd2]; // PARAM";
    let (f, src, text) = finding("", body, 1, 32, 4);
    assert_eq!(
        (f.kind.as_str(), f.line, f.thread),
        ("out-of-bounds parameter load", line_of(&src, "// PARAM"), [2, 0, 0]),
        "{text}"
    );
    // In bounds, every lane reads the pointer's two halves.
    let body = "mov.u32 %r1, %tid.x;\n ld.param.u32 %r2, [t_param_0];\n ld.param.u32 %r3, [t_param_0+4];\n\
        mul.wide.u32 %rd1, %r1, 8;\n add.s64 %rd2, %rd0, %rd1;\n st.global.v2.u32 [%rd2], {%r2, %r3};";
    let src = kernel("", body);
    let m = Module::load(&src).unwrap();
    let mut vm = Vm::with_workers(1);
    let out = vm.alloc(256).unwrap();
    vm.launch(&m, "t", &LaunchConfig::new([1, 1, 1], [32, 1, 1], 0), &out.to_le_bytes()).unwrap();
    let mut b = vec![0u8; 256];
    vm.read(out, &mut b).unwrap();
    for l in 0..32 {
        assert_eq!(u64::from_le_bytes(b[8 * l..8 * l + 8].try_into().unwrap()), out, "lane {l}");
    }
}

#[test]
fn a_full_warp_loading_from_two_allocations_reads_each() {
    // Even lanes load word l of buffer A, odd lanes word l of buffer B (two allocations, with
    // the space between them in none): every lane gets its own buffer's value; then lane 31
    // reading one word past B's end is an out-of-bounds load of thread 31.
    let src = format!(
        "{HEADER}.visible .entry t2(\n\t.param .u64 a,\n\t.param .u64 b,\n\t.param .u64 o,\n\t.param .u32 n\n)\n{{\n\
         \t.reg .pred %p<4>;\n\t.reg .b32 %r<16>;\n\t.reg .b64 %rd<16>;\n\
         ld.param.u64 %rd1, [a];\n ld.param.u64 %rd2, [b];\n ld.param.u64 %rd3, [o];\n ld.param.u32 %r9, [n];\n\
         mov.u32 %r1, %tid.x;\n and.b32 %r2, %r1, 1;\n setp.eq.u32 %p1, %r2, 1;\n selp.b64 %rd4, %rd2, %rd1, %p1;\n\
         setp.eq.u32 %p2, %r1, 31;\n selp.b32 %r3, %r9, %r1, %p2;\n mul.wide.u32 %rd5, %r3, 4;\n add.s64 %rd6, %rd4, %rd5;\n\
         ld.global.u32 %r4, [%rd6]; // LOAD\n mul.wide.u32 %rd7, %r1, 4;\n add.s64 %rd8, %rd3, %rd7;\n st.global.u32 [%rd8], %r4;\n\
         ret;\n}}\n"
    );
    let m = Module::load(&src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let run = |n: u32| -> Result<Vec<u32>, VmError> {
        let mut vm = Vm::with_workers(1);
        let (a, b, o) = (vm.alloc(128)?, vm.alloc(128)?, vm.alloc(128)?);
        let words = |base: u32| (0..32u32).flat_map(|i| (base + i).to_le_bytes()).collect::<Vec<u8>>();
        vm.write(a, &words(1000))?;
        vm.write(b, &words(2000))?;
        let mut params = Vec::new();
        for p in [a, b, o] {
            params.extend_from_slice(&p.to_le_bytes());
        }
        params.extend_from_slice(&n.to_le_bytes());
        vm.launch(&m, "t2", &LaunchConfig::new([1, 1, 1], [32, 1, 1], 0), &params)?;
        let mut out = vec![0u8; 128];
        vm.read(o, &mut out)?;
        Ok(util::words(&out))
    };
    let got = run(31).unwrap();
    for l in 0..32u32 {
        assert_eq!(got[l as usize], if l % 2 == 1 { 2000 + l } else { 1000 + l }, "lane {l}");
    }
    let f = match run(32) {
        Err(VmError::Memcheck(f)) => f,
        other => panic!("expected a finding, got {other:?}"),
    };
    assert_eq!(
        (f.kind.as_str(), f.thread, f.line),
        ("out-of-bounds global load", [31, 0, 0], line_of(&src, "// LOAD")),
        "{f:?}"
    );
}

#[test]
fn a_shuffle_that_reads_an_exited_lane_is_a_finding() {
    // Lanes 20-31 return before the butterfly; at xor 16 lanes 4-15 read lanes 20-31.
    let body = "mov.u32 %r1, %tid.x;\n setp.ge.u32 %p1, %r1, 20;\n @%p1 ret;\n\
        shfl.sync.bfly.b32 %r2, %r1, 1, 31, -1; // ONE\n\
        shfl.sync.bfly.b32 %r3, %r1, 16, 31, -1; // SIXTEEN\n";
    let (f, src, _) = finding("", body, 1, 32, 4);
    assert_eq!(f.kind, "shuffle from an exited lane");
    assert_eq!(f.line, line_of(&src, "// SIXTEEN"), "xor 1 stays among lanes 0-19");
    assert_eq!(f.thread, [4, 0, 0]);
    assert!(f.nearest_allocation.as_deref().unwrap().contains("lane 4 reads lane 20"), "{f:?}");
}
