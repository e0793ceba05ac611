//! Named barriers, `bar.sync a, b` and `bar.arrive a, b` (PTX ISA, "bar, barrier"): barrier `a`
//! of `b` threads completes when `b` threads have arrived, 32 for each warp that executes a
//! `bar.sync` or a `bar.arrive` on it; the warps that synced wait until then, the ones that
//! arrived go on. The expected orders below follow from those rules alone: the VM runs the warps
//! of a block in index order, so without the barriers each case would come out in that order
//! instead.

use crate::util;

use ptx_vm::VmError;

/// Warp `w` (of the block) in `%r2`, lane in `%r3`, `%p1` = lane 0.
const IDS: &str =
    "\tmov.u32 %r1, %tid.x;\n\tshr.u32 %r2, %r1, 5;\n\tand.b32 %r3, %r1, 31;\n\tsetp.eq.u32 %p1, %r3, 0;\n";

/// Lane 0 takes the next ticket of the counter at `out[0]` and stores it at `out[1 + %r{slot}]`.
fn ticket(slot: u32) -> String {
    format!(
        "\t@%p1 atom.global.add.u32 %r10, [%rd0], 1;\n\tadd.u32 %r11, %r{slot}, 1;\n\tmul.wide.u32 %rd1, %r11, 4;\n\t\
         add.s64 %rd2, %rd0, %rd1;\n\t@%p1 st.global.u32 [%rd2], %r10;\n"
    )
}

fn run_words(body: &str, threads: u32, words: usize) -> Result<Vec<u32>, VmError> {
    util::run("", body, 1, threads, words * 4).map(|b| util::words(&b))
}

#[test]
fn a_sync_waits_for_the_arrivals_of_other_warps() {
    // Warp 0 syncs on barrier 1 of 64 threads before its ticket; warp 1 takes its ticket, then
    // arrives: warp 0 can only go on after that, so it gets ticket 1 and warp 1 ticket 0.
    let body = format!(
        "{IDS}\tsetp.eq.u32 %p2, %r2, 0;\n\t@%p2 bra W0;\n{t}\tbar.arrive 1, 64;\n\tbra.uni END;\nW0:\n\tbar.sync 1, 64;\n{t}END:\n",
        t = ticket(2)
    );
    let w = run_words(&body, 64, 3).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(&w[..], &[2, 1, 0], "counter, warp 0's ticket, warp 1's ticket");
}

#[test]
fn two_groups_alternate_through_two_barriers() {
    // FlashAttention-3's warpgroup ping-pong with groups of two warps: group A (warps 0, 1) syncs
    // on barrier 1 and arrives on barrier 2 after its step; group B (warps 2, 3) arrives on 1
    // once to let A start, then syncs on 2 and arrives on 1 after each step but its last. Each
    // group needs the other's arrival for every step, so the steps alternate A, B, A, B, A, B.
    // Tickets go to out[1 + 4 * step + warp].
    let step = |sync: u32, arrive: &str| {
        format!("\tbar.sync {sync}, 128;\n\tmad.lo.u32 %r12, %r5, 4, %r2;\n{t}{arrive}", t = ticket(12))
    };
    let body = format!(
        "{IDS}\tmov.u32 %r5, 0;\n\tsetp.ge.u32 %p2, %r2, 2;\n\t@%p2 bra B;\n\
         LA:\n{a}\tadd.u32 %r5, %r5, 1;\n\tsetp.lt.u32 %p3, %r5, 3;\n\t@%p3 bra LA;\n\tbra.uni END;\n\
         B:\n\tbar.arrive 1, 128;\n\
         LB:\n{b}\tadd.u32 %r5, %r5, 1;\n\tsetp.lt.u32 %p3, %r5, 3;\n\t@%p3 bra LB;\nEND:\n",
        a = step(1, "\tbar.arrive 2, 128;\n"),
        b = step(2, "\tsetp.lt.u32 %p4, %r5, 2;\n\t@%p4 bar.arrive 1, 128;\n"),
    );
    let w = run_words(&body, 128, 13).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(w[0], 12, "12 tickets");
    for s in 0..3 {
        for warp in 0..4 {
            let t = w[1 + 4 * s + warp];
            let first = 4 * s as u32 + if warp < 2 { 0 } else { 2 };
            assert!(
                t == first || t == first + 1,
                "step {s} warp {warp}: ticket {t}, expected {first} or {}",
                first + 1
            );
        }
    }
}

#[test]
fn a_barrier_completes_again_after_each_release() {
    // Barrier 2 of 64 threads used four times by two warps; block-wide bar.sync 0 in between.
    let body = format!(
        "{IDS}\tmov.u32 %r5, 0;\nL:\n\tbar.sync 2, 64;\n\tbar.sync 0;\n\tadd.u32 %r5, %r5, 1;\n\tsetp.lt.u32 %p3, %r5, 4;\n\t\
         @%p3 bra L;\n{t}",
        t = ticket(2)
    );
    let w = run_words(&body, 64, 3).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(w[0], 2);
}

fn finding(body: &str, threads: u32) -> Box<ptx_vm::Finding> {
    match run_words(body, threads, 3) {
        Err(VmError::Memcheck(f)) => f,
        other => panic!("expected a finding, got {other:?}"),
    }
}

#[test]
fn a_sync_no_warp_can_complete_is_a_deadlock() {
    // Warp 0 waits for 64 threads on barrier 3; warp 1 exits without arriving.
    let body = format!("{IDS}\tsetp.ne.u32 %p2, %r2, 0;\n\t@%p2 bra END;\n\tbar.sync 3, 64;\nEND:\n");
    let f = finding(&body, 64);
    assert_eq!(f.kind, "deadlock", "{f}");
    let why = f.nearest_allocation.clone().unwrap_or_default();
    assert!(why.contains("named barrier 3 has 32 of its 64 threads"), "{why}");
}

#[test]
fn counts_ids_and_divergent_lanes_are_checked() {
    for (bar, want) in [
        ("bar.sync 1, 48;", "thread count 48"),
        ("bar.sync 1, 128;", "at most the block's 64 threads"),
        ("bar.arrive 16, 64;", "barrier id 16"),
    ] {
        let f = finding(&format!("{IDS}\t{bar}\n"), 64);
        assert_eq!(f.kind, "named barrier misuse", "{bar}: {f}");
        let why = f.nearest_allocation.clone().unwrap_or_default();
        assert!(why.contains(want), "{bar}: {why}");
    }
    // Two counts for one barrier before it completes.
    let body = format!(
        "{IDS}\tsetp.eq.u32 %p2, %r2, 0;\n\t@%p2 bar.arrive 4, 64;\n\tsetp.ne.u32 %p2, %r2, 0;\n\t@%p2 bar.arrive 4, 96;\n"
    );
    let why = finding(&body, 96).nearest_allocation.clone().unwrap_or_default();
    assert!(why.contains("thread count 96, while barrier 4 is counting to 64"), "{why}");
    // Half a warp.
    let body = format!("{IDS}\tsetp.lt.u32 %p2, %r3, 16;\n\t@%p2 bar.arrive 5, 64;\n");
    let why = finding(&body, 64).nearest_allocation.clone().unwrap_or_default();
    assert!(why.contains("all of a warp's threads"), "{why}");
}
