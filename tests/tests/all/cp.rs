//! Context parallelism (`memattn::cp`) with in-process ranks, one VM device each: ring, zigzag
//! and Ulysses over world sizes 1 to 4, gathered and checked against the single-device f64
//! reference (every row; bf16 by the 2x naive-in-dtype rule), and decode over a cache sharded by
//! sequence. The per-rank bytes are checked against the analytic volume.

use memattn::attn::Kernels;
use memattn::cp::{self, Communicator, CpError, CpOpts, CpOutput, Strategy};
use memattn::inputs::Qkv;
use memattn::reference::{reference, RowSelection};
use memattn::{Dtype, Problem};
use memattn_cli::verify::{tolerance_for, verify};

/// How the ranks of a test talk: in-process channels, or [`cp::Grouped`] over
/// [`cp::Rendezvous`] (NCCL's rules in memory: the adapter `cp::nccl` runs on GPUs).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Transport {
    InProcess,
    NcclRules,
}

/// Runs `f` on `world` ranks of `transport`, each on its own thread.
fn run_world<R: Send>(world: usize, transport: Transport, f: impl Fn(&dyn Communicator) -> R + Sync) -> Vec<R> {
    match transport {
        Transport::InProcess => cp::run_in_process(world, |c| f(c)),
        Transport::NcclRules => {
            cp::run_ranks(cp::Rendezvous::communicators(world, std::time::Duration::from_secs(120)), |c| f(c))
        }
    }
}

/// Runs `f` on `world` in-process ranks, each with its own VM and its shards of `x`'s q, k, v and
/// of `d_o` (like q; empty for none) uploaded.
fn on_ranks<R: Send>(
    p: &Problem,
    strategy: Strategy,
    world: usize,
    x: &Qkv,
    d_o: &[f32],
    f: impl Fn(&Kernels, &dyn Communicator, [&memattn::attn::DeviceBuffer; 4]) -> Result<R, CpError> + Sync,
) -> Result<Vec<R>, CpError> {
    on_ranks_of(Transport::InProcess, p, strategy, world, x, d_o, f)
}

/// [`on_ranks`] over `transport`.
fn on_ranks_of<R: Send>(
    transport: Transport,
    p: &Problem,
    strategy: Strategy,
    world: usize,
    x: &Qkv,
    d_o: &[f32],
    f: impl Fn(&Kernels, &dyn Communicator, [&memattn::attn::DeviceBuffer; 4]) -> Result<R, CpError> + Sync,
) -> Result<Vec<R>, CpError> {
    let (h, hk) = (p.heads as usize, p.kv_heads() as usize);
    run_world(world, transport, |comm| {
        let rank = comm.rank();
        let err = |source| CpError::attn(rank, source);
        let kernels = Kernels::vm().map_err(err)?;
        let up = |keys: bool, heads: usize, t: &[f32]| {
            let s = cp::shard(p, strategy, world, rank, keys, heads, t);
            kernels.upload_as(p.dtype, &s).map_err(err)
        };
        let (q, k, v) = (up(false, h, &x.q)?, up(true, hk, &x.k)?, up(true, hk, &x.v)?);
        let g = if d_o.is_empty() { kernels.alloc(4).map_err(err)? } else { up(false, h, d_o)? };
        f(&kernels, comm, [&q, &k, &v, &g])
    })
    .into_iter()
    .collect()
}

/// Runs `strategy` on `world` in-process ranks: each rank gets its shard of `x`.
fn run_cp(p: &Problem, strategy: Strategy, world: usize, x: &Qkv, opts: &CpOpts) -> Result<Vec<CpOutput>, CpError> {
    on_ranks(p, strategy, world, x, &[], |kernels, comm, [q, k, v, _]| {
        cp::attention(kernels, comm, p, strategy, q, k, v, &x.sinks, opts)
    })
}

/// The gathered result's verification against the f64 reference (every row).
fn check(p: &Problem, strategy: Strategy, x: &Qkv, outs: &[CpOutput]) -> memattn_cli::verify::Verification {
    let (o, lse) = cp::gather(p, strategy, outs);
    let r = reference(p, x, &RowSelection::All);
    let tol = tolerance_for(p, x, &r);
    verify(p, &o, &lse, &r, &tol)
}

fn assert_matches(p: &Problem, strategy: Strategy, world: usize, seed: u64) {
    let x = Qkv::random(p, seed);
    let outs =
        run_cp(p, strategy, world, &x, &CpOpts::default()).unwrap_or_else(|e| panic!("{strategy} w{world} {p:?}: {e}"));
    let v = check(p, strategy, &x, &outs);
    assert!(v.passed, "{strategy} world {world} {p:?}: {:?}", v.failures);
    assert_eq!(v.checked_rows, v.total_rows);
    assert_eq!(v.unwritten, 0);
    // Every rank's bytes equal the analytic volume.
    for (rank, out) in outs.iter().enumerate() {
        let (sent, recv) = cp::analytic_bytes(p, strategy, world, rank, false);
        assert_eq!(
            (out.stats.bytes_sent(), out.stats.bytes_received()),
            (sent, recv),
            "{strategy} world {world} rank {rank}"
        );
    }
    assert!(outs.iter().flat_map(|o| &o.o).any(|x| x.abs() > 0.1), "O looks empty");
}

fn base() -> Problem {
    Problem { batch: 2, heads: 4, heads_kv: Some(2), seq_q: 45, seq_kv: 45, head_dim: 32, ..Problem::default() }
}

#[test]
fn ring_and_zigzag_match_the_reference_on_1_to_4_ranks() {
    for strategy in [Strategy::Ring, Strategy::Zigzag] {
        for world in 1..=4 {
            for causal in [false, true] {
                assert_matches(&Problem { causal, ..base() }, strategy, world, 3 + world as u64);
            }
        }
    }
}

#[test]
fn ulysses_matches_the_reference_and_names_the_head_rule() {
    for world in 1..=4 {
        // heads 12 / heads_kv 12 split over 1..4 ranks; GQA 8/2 over 2.
        let p = Problem { heads: 12, heads_kv: Some(12), causal: world % 2 == 0, ..base() };
        assert_matches(&p, Strategy::Ulysses, world, 11);
    }
    assert_matches(&Problem { heads: 8, heads_kv: Some(2), causal: true, ..base() }, Strategy::Ulysses, 2, 12);
    let p = Problem { heads: 8, heads_kv: Some(2), ..base() };
    let e = run_cp(&p, Strategy::Ulysses, 4, &Qkv::random(&p, 1), &CpOpts::default()).unwrap_err();
    assert!(e.to_string().contains("heads_kv (2) must both be divisible by the world size 4"), "{e}");
}

/// GQA 8/2, a sliding window, soft cap, sinks, seq_q < seq_kv (rows above the diagonal are fully
/// masked) on 3 ranks.
#[test]
fn masks_gqa_softcap_sinks_and_unequal_lengths_on_3_ranks() {
    let cases = [
        Problem { heads: 8, heads_kv: Some(2), causal: true, window: (7, 0), ..base() },
        Problem { heads: 8, heads_kv: Some(2), window: (5, 3), softcap: 2.0, ..base() },
        Problem { seq_q: 40, seq_kv: 23, causal: true, sinks: true, ..base() },
        Problem { seq_q: 13, seq_kv: 50, causal: true, window: (9, 0), ..base() },
    ];
    for p in cases {
        for strategy in [Strategy::Ring, Strategy::Zigzag] {
            assert_matches(&p, strategy, 3, 21);
        }
    }
    let p = Problem { heads: 6, heads_kv: Some(3), causal: true, window: (7, 0), sinks: true, ..base() };
    assert_matches(&p, Strategy::Ulysses, 3, 22);
}

#[test]
fn varlen_with_unequal_lengths() {
    let base = Problem { heads: 4, heads_kv: Some(2), head_dim: 32, causal: true, ..Problem::default() };
    let p = Problem::varlen(base, &[17, 1, 40, 9], &[17, 1, 40, 9]).unwrap();
    for (strategy, world) in [(Strategy::Ring, 3), (Strategy::Zigzag, 2), (Strategy::Zigzag, 4), (Strategy::Ulysses, 2)]
    {
        assert_matches(&p, strategy, world, 31);
    }
    let p = Problem::varlen(Problem { window: (6, 0), ..base }, &[5, 30, 0, 12], &[9, 30, 3, 12]).unwrap();
    assert_matches(&p, Strategy::Ring, 4, 32);
}

#[test]
fn bf16_by_the_2x_naive_in_dtype_rule() {
    let p = Problem {
        heads: 4,
        heads_kv: Some(2),
        head_dim: 64,
        seq_q: 70,
        seq_kv: 70,
        causal: true,
        dtype: Dtype::Bf16,
        ..base()
    };
    for strategy in Strategy::ALL {
        assert_matches(&p, strategy, 2, 41);
    }
    assert_matches(&p, Strategy::Zigzag, 3, 42);
}

/// Leaving out one step's merge is caught by the check: the check can fail.
#[test]
fn a_dropped_merge_step_fails_the_check() {
    let p = Problem { causal: true, ..base() };
    let x = Qkv::random(&p, 5);
    for strategy in [Strategy::Ring, Strategy::Zigzag] {
        let opts = CpOpts { drop_merge_step: Some(1) };
        let outs = run_cp(&p, strategy, 3, &x, &opts).unwrap();
        assert!(!check(&p, strategy, &x, &outs).passed, "{strategy}: a dropped step still verified");
        let outs = run_cp(&p, strategy, 3, &x, &CpOpts::default()).unwrap();
        assert!(check(&p, strategy, &x, &outs).passed);
    }
}

/// Causal zigzag balances the work: every rank sees the same number of query-key pairs per step
/// (even lengths), where plain ring's last rank does all of its steps and rank 0 one.
#[test]
fn zigzag_balances_causal_work() {
    let p = Problem { batch: 1, heads: 1, heads_kv: None, seq_q: 64, seq_kv: 64, causal: true, ..base() };
    let x = Qkv::random(&p, 7);
    let work = |s| -> Vec<u64> {
        run_cp(&p, s, 4, &x, &CpOpts::default())
            .unwrap()
            .iter()
            .map(|o| o.stats.steps.iter().map(|s| s.visible_pairs).sum())
            .collect()
    };
    let ring = work(Strategy::Ring);
    let zig = work(Strategy::Zigzag);
    assert_eq!(ring.iter().sum::<u64>(), 64 * 65 / 2);
    assert_eq!(zig.iter().sum::<u64>(), 64 * 65 / 2);
    assert!(ring[3] > 5 * ring[0], "{ring:?}");
    let (lo, hi) = (zig.iter().min().unwrap(), zig.iter().max().unwrap());
    assert!(hi - lo <= 16, "zigzag {zig:?}");
}

/// Decode over a cache sharded by sequence on 2 and 4 ranks against the single-device reference,
/// f32 and bf16, plain and with a window that leaves some shards without keys (that case through
/// NCCL's rules, [`Transport::NcclRules`]).
#[test]
fn sharded_decode_matches_the_single_device_decode() {
    let cases = [
        Problem {
            batch: 2,
            heads: 8,
            heads_kv: Some(2),
            seq_q: 1,
            seq_kv: 300,
            head_dim: 64,
            causal: true,
            ..Problem::default()
        },
        Problem {
            batch: 1,
            heads: 4,
            heads_kv: Some(1),
            seq_q: 3,
            seq_kv: 97,
            head_dim: 128,
            causal: true,
            window: (20, 0),
            dtype: Dtype::Bf16,
            ..Problem::default()
        },
        Problem {
            batch: 1,
            heads: 2,
            heads_kv: Some(2),
            seq_q: 2,
            seq_kv: 61,
            head_dim: 64,
            causal: true,
            sinks: true,
            softcap: 3.0,
            ..Problem::default()
        },
    ];
    for (p, transport) in cases.into_iter().zip([Transport::InProcess, Transport::NcclRules, Transport::InProcess]) {
        let x = Qkv::random(&p, 9);
        for world in [2, 4] {
            let hk = p.kv_heads() as usize;
            let outs: Vec<CpOutput> = run_world(world, transport, |comm| {
                let rank = comm.rank();
                let err = |source| CpError::attn(rank, source);
                let kernels = Kernels::vm().map_err(err)?;
                let q = kernels.upload_as(p.dtype, &x.q).map_err(err)?;
                let up = |t: &[f32]| {
                    kernels.upload_as(p.dtype, &cp::shard(&p, Strategy::Ring, world, rank, true, hk, t)).map_err(err)
                };
                let (k, v) = (up(&x.k)?, up(&x.v)?);
                cp::decode(&kernels, comm, &p, &q, &k, &v, &x.sinks)
            })
            .into_iter()
            .collect::<Result<_, _>>()
            .unwrap_or_else(|e| panic!("{p:?} world {world}: {e}"));
            let r = reference(&p, &x, &RowSelection::All);
            let tol = tolerance_for(&p, &x, &r);
            for (rank, out) in outs.iter().enumerate() {
                let v = verify(&p, &out.o, &out.lse, &r, &tol);
                assert!(v.passed, "{p:?} world {world} rank {rank}: {:?}", v.failures);
                assert_eq!(out.o, outs[0].o, "every rank merges the same states in the same order");
                let (s, rcv) = cp::analytic_bytes(&p, Strategy::Ring, world, rank, true);
                assert_eq!((out.stats.bytes_sent(), out.stats.bytes_received()), (s, rcv));
            }
        }
    }
}

/// The forward, then the backward ([`cp::attention_backward`]), on `world` in-process ranks with
/// the upstream gradient `d_o`; the gathered gradients.
fn run_cp_backward(
    p: &Problem,
    strategy: Strategy,
    world: usize,
    x: &Qkv,
    d_o: &[f32],
) -> Result<Vec<cp::CpGrads>, CpError> {
    on_ranks(p, strategy, world, x, d_o, |kernels, comm, [q, k, v, g]| {
        let out = cp::attention(kernels, comm, p, strategy, q, k, v, &x.sinks, &CpOpts::default())?;
        cp::attention_backward(kernels, comm, p, strategy, q, k, v, &out.o, &out.lse, g, &x.sinks)
    })
}

/// Max |got - want| over max |want| (1 when want is all zeros).
fn rel(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f64, |m, w| m.max(w.abs())).max(1e-30);
    got.iter().zip(want).fold(0f64, |m, (g, w)| m.max((*g as f64 - w).abs())) / scale
}

fn assert_grads_match(p: &Problem, strategy: Strategy, world: usize, seed: u64, tol: f64) {
    let x = Qkv::random(p, seed);
    let mut d_o = Qkv::random(p, seed + 1000).q;
    p.dtype.round_all(&mut d_o);
    let grads = run_cp_backward(p, strategy, world, &x, &d_o).unwrap_or_else(|e| panic!("{strategy} w{world}: {e}"));
    let (dq, dk, dv, ds) = cp::gather_grads(p, strategy, &grads);
    let want = memattn::reference::grad::attention_backward(p, &x.q, &x.k, &x.v, &d_o, &x.sinks).unwrap();
    for (name, got, w) in
        [("dq", &dq, &want.dq), ("dk", &dk, &want.dk), ("dv", &dv, &want.dv), ("d_sinks", &ds, &want.dsinks)]
    {
        if name == "d_sinks" && !p.sinks {
            continue;
        }
        let e = rel(got, w);
        assert!(e <= tol, "{strategy} world {world} {p:?}: {name} relative error {e:.3e} > {tol:.0e}");
    }
    assert!(dk.iter().any(|x| x.abs() > 1e-3), "dk looks empty");
    // Every rank sent and received its K/V blocks (as the forward) and, with more than one rank,
    // one dK/dV sum (f32) of every block each way.
    for (rank, g) in grads.iter().enumerate() {
        let (sent, recv) = cp::analytic_backward_bytes(p, strategy, world, rank);
        assert_eq!((g.stats.bytes_sent(), g.stats.bytes_received()), (sent, recv), "{strategy} w{world} rank {rank}");
    }
    if world > 1 && strategy != Strategy::Ulysses {
        let (hk, d) = (p.kv_heads() as u64, p.head_dim as u64);
        let keys = p.varlen.map_or(p.batch as u64 * p.seq_kv as u64, |v| v.seqlens_kv.iter().map(|&l| l as u64).sum());
        let (fwd, _) = cp::analytic_bytes(p, strategy, world, 0, false);
        assert_eq!(grads[0].stats.bytes_sent(), fwd + 2 * hk * d * 4 * keys);
    }
}

/// Ring and zigzag backward on 1 to 4 ranks against the f64 gradients: f32 within 2e-5 of the
/// gradient's scale (the sums of per-block f32 partials), causal and not, GQA, a window with soft
/// cap and seq_q != seq_kv, sinks (their gradient summed over the ranks), varlen, and bf16 within
/// 1e-2 (each block's gradients are rounded to bf16 before the f32 sum).
#[test]
fn ring_and_zigzag_backward_match_the_reference_gradients() {
    for strategy in [Strategy::Ring, Strategy::Zigzag] {
        for world in 1..=4 {
            for causal in [false, true] {
                assert_grads_match(&Problem { causal, ..base() }, strategy, world, 50 + world as u64, 2e-5);
            }
        }
        let cases = [
            Problem { heads: 8, heads_kv: Some(2), seq_q: 40, seq_kv: 55, window: (9, 3), softcap: 2.0, ..base() },
            Problem { seq_q: 40, seq_kv: 23, causal: true, sinks: true, ..base() },
        ];
        for p in cases {
            assert_grads_match(&p, strategy, 3, 61, 2e-5);
        }
        let vb = Problem { heads: 4, heads_kv: Some(2), head_dim: 32, causal: true, ..Problem::default() };
        let p = Problem::varlen(vb, &[17, 1, 40, 0], &[17, 3, 40, 9]).unwrap();
        assert_grads_match(&p, strategy, 2, 62, 2e-5);
        let p = Problem { head_dim: 64, seq_q: 70, seq_kv: 70, causal: true, dtype: Dtype::Bf16, ..base() };
        assert_grads_match(&p, strategy, 2, 63, 1e-2);
    }
}

/// Ulysses' backward (the all-to-all reversed around one single-device backward per rank's
/// heads) on 1 to 4 ranks, GQA, window and soft cap, sinks, varlen, bf16.
#[test]
fn ulysses_backward_matches_the_reference_gradients() {
    for world in [1, 2, 4] {
        let p = Problem { heads: 8, heads_kv: Some(4), causal: world != 2, ..base() };
        assert_grads_match(&p, Strategy::Ulysses, world, 70 + world as u64, 2e-5);
    }
    let p = Problem {
        heads: 6,
        heads_kv: Some(3),
        seq_q: 40,
        seq_kv: 55,
        window: (9, 3),
        softcap: 2.0,
        sinks: true,
        ..base()
    };
    assert_grads_match(&p, Strategy::Ulysses, 3, 74, 2e-5);
    let vb = Problem { heads: 4, heads_kv: Some(2), head_dim: 32, causal: true, ..Problem::default() };
    let p = Problem::varlen(vb, &[17, 1, 40, 0], &[17, 3, 40, 9]).unwrap();
    assert_grads_match(&p, Strategy::Ulysses, 2, 75, 2e-5);
    let p = Problem {
        heads: 4,
        heads_kv: Some(2),
        head_dim: 64,
        seq_q: 70,
        seq_kv: 70,
        causal: true,
        dtype: Dtype::Bf16,
        ..base()
    };
    assert_grads_match(&p, Strategy::Ulysses, 2, 76, 1e-2);
}

/// Every strategy, forward and backward, through [`cp::Grouped`] over [`cp::Rendezvous`] (NCCL's
/// rendezvous rules in memory: a send completes only when received, sizes agreed, a group that
/// cannot complete fails instead of hanging), the adapter `cp::nccl` runs on GPUs: bit-identical
/// outputs, LSE and gradients to the in-process ranks', and the same bytes per rank.
#[test]
fn nccl_rules_give_the_in_process_results_bit_for_bit() {
    let p = Problem { causal: true, seq_q: 37, seq_kv: 53, sinks: true, heads: 8, heads_kv: Some(4), ..base() };
    let x = Qkv::random(&p, 21);
    let mut d_o = Qkv::random(&p, 22).q;
    p.dtype.round_all(&mut d_o);
    for (strategy, world) in [
        (Strategy::Ring, 2),
        (Strategy::Zigzag, 3),
        (Strategy::Ring, 4),
        (Strategy::Ulysses, 2),
        (Strategy::Ulysses, 4),
    ] {
        let run = |t: Transport| {
            on_ranks_of(t, &p, strategy, world, &x, &d_o, |kernels, comm, [q, k, v, g]| {
                let out = cp::attention(kernels, comm, &p, strategy, q, k, v, &x.sinks, &CpOpts::default())?;
                let grads =
                    cp::attention_backward(kernels, comm, &p, strategy, q, k, v, &out.o, &out.lse, g, &x.sinks)?;
                Ok((out, grads))
            })
            .unwrap_or_else(|e| panic!("{strategy} world {world} over {t:?}: {e}"))
        };
        let (a, b) = (run(Transport::InProcess), run(Transport::NcclRules));
        for (rank, ((oa, ga), (ob, gb))) in a.iter().zip(&b).enumerate() {
            let at = format!("{strategy} world {world} rank {rank}");
            for (name, x, y) in [
                ("o", &oa.o, &ob.o),
                ("lse", &oa.lse, &ob.lse),
                ("dq", &ga.dq, &gb.dq),
                ("dk", &ga.dk, &gb.dk),
                ("dv", &ga.dv, &gb.dv),
            ] {
                assert_eq!(x.len(), y.len(), "{at}: {name} length");
                if let Some(i) = (0..x.len()).find(|&i| x[i].to_bits() != y[i].to_bits()) {
                    panic!("{at}: {name}[{i}] is {} over NCCL's rules, {} in process", y[i], x[i]);
                }
            }
            assert_eq!(
                (ob.stats.bytes_sent(), ob.stats.bytes_received(), gb.stats.bytes_sent(), gb.stats.bytes_received()),
                (oa.stats.bytes_sent(), oa.stats.bytes_received(), ga.stats.bytes_sent(), ga.stats.bytes_received()),
                "{at}: bytes"
            );
        }
        let v = check(&p, strategy, &x, &b.iter().map(|(o, _)| o.clone()).collect::<Vec<_>>());
        assert!(v.passed, "{strategy} world {world}: {:?}", v.failures);
    }
}
