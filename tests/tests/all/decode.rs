//! KV-cache decode on every device (VM always, CUDA when present): the combine on hand-made
//! partials, split-KV decode against the f64 reference (GQA, ragged caches, causal seq_q > 1),
//! split vs no split, paged vs contiguous bit for bit, append then attend, and bad input.

use kernels_gpu::decode_abi::DecodeParams;
use kernels_gpu::tiles::{DECODE_D64, DECODE_MMA_D64};
use memattn_cli::decode::{
    merge_states, merge_states_reference, run_decode, DecodeInputs, DecodeKernel, DecodeProblem, DecodeReport,
    DecodeSpec, Fp8Format, Partials, Rotary, Splits,
};
use memattn_cli::device::Device;
use memattn_cli::Dtype;
use memattn_tests::{device_tests, require_kernel, vm_device};

/// Runs `p` verified with the indices checked on the host, and again checked on the device by
/// `decode_check_*` (with rotary, on tables that cover the capacity); returns the first run's
/// report.
fn run(dev: &mut dyn Device, p: &DecodeProblem, x: Option<&DecodeInputs>) -> DecodeReport {
    let spec = DecodeSpec { problem: p.clone(), seed: 5, warmup: Some(0), repeats: Some(1), indices_on_device: false };
    let r = run_decode(dev, &spec, x).unwrap_or_else(|e| panic!("{p:?}: {e}"));
    assert!(r.verified, "{p:?}: {:?}", r.verification);
    assert_eq!(r.verification.unwritten, 0);
    let spec = DecodeSpec { indices_on_device: true, ..spec };
    let d = run_decode(dev, &spec, x).unwrap_or_else(|e| panic!("{p:?} (indices on the device): {e}"));
    assert!(d.verified && d.verification.unwritten == 0, "{p:?} (indices on the device): {:?}", d.verification);
    assert!(d.launches[0].kernel.starts_with("decode_check_"), "{:?}", d.launches);
    r
}

/// Runs `p` with the SIMT and the tensor-core decode kernel (16-bit dtypes) and checks which ran.
fn run_both(dev: &mut dyn Device, p: &DecodeProblem, x: Option<&DecodeInputs>) -> [DecodeReport; 2] {
    let simt = run(dev, &DecodeProblem { kernel: DecodeKernel::Simt, ..p.clone() }, x);
    let mma = run(dev, &DecodeProblem { kernel: DecodeKernel::Mma, ..p.clone() }, x);
    assert_eq!((simt.kernel, mma.kernel), ("simt", "mma"));
    assert!(mma.launches.iter().any(|l| l.kernel.starts_with("decode_mma_")), "{:?}", mma.launches);
    [simt, mma]
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Partials with finite and `-inf` states: row 0 all `-inf`, every third state `-inf`, LSEs far
/// apart (a state that dominates) and close together.
fn partials(splits: u32, batch: u32, heads: u32, seq_q: u32, d: u32) -> Partials {
    let rows = (batch * heads * seq_q) as usize;
    let mut lse = vec![0f32; splits as usize * rows];
    for s in 0..splits as usize {
        for r in 0..rows {
            lse[s * rows + r] = if r == 0 || (s + r) % 3 == 0 {
                f32::NEG_INFINITY
            } else {
                ((s * 7 + r * 3) % 11) as f32 * 1.7 - 6.0 + if r == 5 && s == 1 { 40.0 } else { 0.0 }
            };
        }
    }
    let o = (0..splits as usize * rows * d as usize).map(|i| ((i * 2654435761) % 1000) as f32 / 250.0 - 2.0).collect();
    Partials { splits, batch, heads, seq_q, head_dim: d, o, lse }
}

device_tests! {
    #[smoke]
    fn merge_states_hand_made_partials_against_f64(dev: &mut dyn Device) {
        // d = 40: the lanes' stride over the head dim has a ragged tail; 7 rows of 4 per block.
        for (splits, d) in [(1u32, 40u32), (4, 40), (5, 128)] {
            let x = partials(splits, 1, 7, 1, d);
            let (ro, rl) = merge_states_reference(&x);
            for dtype in Dtype::ALL {
                require_kernel(dev, &format!("merge_states_{dtype}"));
                let (o, lse) = merge_states(dev, &x, dtype).unwrap();
                let tol = if dtype.is_16bit() { 2.0 * dtype.unit_roundoff() } else { 1e-6 };
                for (r, (&g, &w)) in lse.iter().zip(&rl).enumerate() {
                    if w == f64::NEG_INFINITY {
                        assert_eq!(g, f32::NEG_INFINITY, "{dtype} row {r}");
                    } else {
                        assert!((g as f64 - w).abs() <= 1e-6 * w.abs().max(1.0), "{dtype} row {r}: lse {g} vs {w}");
                    }
                }
                let scale = ro.iter().fold(1f64, |m, v| m.max(v.abs()));
                for (e, (&g, &w)) in o.iter().zip(&ro).enumerate() {
                    assert!((g as f64 - w).abs() <= tol * scale, "{dtype} splits {splits} elem {e}: {g} vs {w}");
                }
                // Row 0 (all splits -inf): O = 0 exactly, LSE = -inf.
                assert!(o[..d as usize].iter().all(|&v| v == 0.0), "{dtype}: fully masked row");
                assert_eq!(lse[0], f32::NEG_INFINITY);
                assert!(o.iter().any(|v| v.abs() > 0.1), "real values");
            }
        }
    }

    fn decode_f32_gqa_ragged_caches_against_f64(dev: &mut dyn Device) {
        for (d, heads, heads_kv) in [(64u32, 4u32, 4u32), (64, 8, 2), (128, 8, 1)] {
            for (seq_q, causal) in [(1u32, true), (3, true), (2, false)] {
                let p = DecodeProblem {
                    batch: 4,
                    heads,
                    heads_kv,
                    head_dim: d,
                    seq_q,
                    cache_seqlens: vec![0, 1, 77, 130],
                    causal,
                    splits: Splits::Fixed(3),
                    ..DecodeProblem::default()
                };
                let r = run(dev, &p, None);
                assert_eq!(r.plan.num_splits, 3);
                // Sequence 0 has no key: its rows are O = 0, LSE = -inf.
                assert!(r.lse[..(heads * seq_q) as usize].iter().all(|&l| l == f32::NEG_INFINITY));
                assert!(r.o.iter().any(|v| v.abs() > 0.1), "real values");
            }
        }
    }

    // Chunked prefill: the tensor-core forward reads the cache through the block table. Queries
    // of 1, 7, 128 and 300 tokens against pages of 1, 16 and 256 keys (and a contiguous cache),
    // GQA, causal bottom-right against `cache_seqlens + seq_new`, ragged sequences (one shorter
    // than the query: its first rows see nothing), appends, window, soft cap and sinks, bf16
    // and f16; each against the f64 reference, and each also by the decode kernel.
    fn chunked_prefill_over_pages_against_f64(dev: &mut dyn Device) {
        require_kernel(dev, "flash_fwd_bf16_d64");
        let mut case = 0u64;
        for seq_q in [1u32, 7, 128, 300] {
            for page in [Some(1u32), Some(16), Some(256), None] {
                case += 1;
                let dtype = if case.is_multiple_of(2) { Dtype::F16 } else { Dtype::Bf16 };
                let (window_left, window_right, softcap, sinks) = match case % 4 {
                    0 => (-1, -1, 0.0, false),
                    1 => (90, -1, 0.0, true),
                    2 => (-1, -1, 12.0, false),
                    _ => (40, -1, 8.0, true),
                };
                let p = DecodeProblem {
                    batch: 3,
                    heads: 4,
                    heads_kv: 2,
                    head_dim: 64,
                    seq_q,
                    // Sequence 1 holds fewer keys than the query has tokens.
                    cache_seqlens: vec![310, 3, 170],
                    seq_new: if case.is_multiple_of(3) { 5 } else { 0 },
                    page_size: page,
                    dtype,
                    window_left,
                    window_right,
                    softcap,
                    sinks,
                    kernel: DecodeKernel::Prefill,
                    ..DecodeProblem::default()
                };
                let x = DecodeInputs::random(&p, 40 + case);
                let r = run(dev, &p, Some(&x));
                assert_eq!(r.kernel, "prefill", "{p:?}");
                assert!(r.launches.iter().any(|l| l.kernel.starts_with("flash_fwd_")), "{:?}", r.launches);
                assert_eq!(r.plan.num_splits, 1);
                assert!(r.o.iter().any(|v| v.abs() > 0.1), "real values");
                // Sequence 1 sees 3 + seq_new keys: with seq_q above that, its first rows see
                // none (O = 0; LSE = -inf, or the sink's logit).
                let seen = 3 + p.seq_new;
                if seq_q > seen {
                    let lse1 = &r.lse[(p.heads * seq_q) as usize..][..seq_q as usize];
                    assert_eq!(lse1[0] == f32::NEG_INFINITY, !sinks, "{p:?}");
                    let row = (p.heads * p.head_dim) as usize;
                    assert!(r.o[seq_q as usize * row..][..row].iter().all(|&v| v == 0.0), "{p:?}");
                    assert!(lse1[(seq_q - 1) as usize].is_finite(), "{p:?}");
                }
                // The decode kernel on the same inputs agrees within both bounds.
                let m = run(dev, &DecodeProblem { kernel: DecodeKernel::Mma, ..p.clone() }, Some(&x));
                let diff = r.o.iter().zip(&m.o).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(diff < 2e-2, "{p:?}: prefill and decode kernels differ by {diff}");
            }
        }
    }

    // The prefill kernel at the other head dims (their tiles: d 32 and 96 with the 4-chunk
    // swizzle, d 192 and 256 with one m-tile per warp), paged and contiguous, with an append,
    // window, soft cap and sinks.
    fn chunked_prefill_at_every_head_dim(dev: &mut dyn Device) {
        for d in [32u32, 96, 192, 256] {
            for page in [Some(16u32), None] {
                let p = DecodeProblem {
                    batch: 2,
                    heads: 6,
                    heads_kv: 2,
                    head_dim: d,
                    seq_q: 40,
                    cache_seqlens: vec![150, 9],
                    seq_new: 3,
                    page_size: page,
                    dtype: if page.is_some() { Dtype::Bf16 } else { Dtype::F16 },
                    window_left: 60,
                    softcap: 7.0,
                    sinks: true,
                    kernel: DecodeKernel::Prefill,
                    ..DecodeProblem::default()
                };
                let r = run(dev, &p, None);
                assert_eq!(r.kernel, "prefill", "{p:?}");
                assert!(r.launches.iter().any(|l| l.kernel == format!("flash_fwd_{}_d{d}", p.dtype)), "{:?}", r.launches);
            }
        }
    }

    // Head dims without a kernel of their own run on the next compiled one (the tensor-core
    // decode where it has that head dim: 40 on d64, 120 on d128), reading and writing only their
    // columns of Q, O, the cache and the partials: every dtype, ragged caches with appends,
    // paged and contiguous, GQA, several splits, against f64 (the appended cache checked too);
    // then the prefill kernel over a paged and a contiguous cache.
    fn decode_padded_head_dims_against_f64(dev: &mut dyn Device) {
        for (i, (d, kernel)) in
            [(40u32, "mma_{}_d64"), (80, "fwd_{}_d96"), (120, "mma_{}_d128"), (160, "fwd_{}_d192"), (200, "fwd_{}_d256")]
                .into_iter()
                .enumerate()
        {
            for (j, dtype) in [Dtype::F32, Dtype::Bf16, Dtype::F16].into_iter().enumerate() {
                let p = DecodeProblem {
                    batch: 2,
                    heads: 4,
                    heads_kv: if (i + j) % 2 == 0 { 2 } else { 4 },
                    head_dim: d,
                    seq_q: 1 + (j as u32 % 2),
                    cache_seqlens: vec![37, 70],
                    seq_new: 2,
                    page_size: if (i + j) % 2 == 1 { Some(16) } else { None },
                    dtype,
                    splits: Splits::Fixed(2),
                    ..DecodeProblem::default()
                };
                let r = run(dev, &p, None);
                // f32 has no tensor-core decode: the SIMT one at the same head dim.
                let family = if dtype == Dtype::F32 { kernel.replace("mma_", "fwd_") } else { kernel.to_string() };
                let want = format!("decode_{}", family.replace("{}", dtype.name()));
                assert!(r.launches.iter().any(|l| l.kernel == want), "d{d} {dtype}: {want} not in {:?}", r.launches);
                assert_eq!(r.verification.cache_ok, Some(true));
                assert!(r.o.iter().any(|v| v.abs() > 0.1), "real values");
            }
        }
        for (d, page) in [(40u32, Some(16u32)), (120, None)] {
            let p = DecodeProblem {
                batch: 2,
                heads: 4,
                heads_kv: 2,
                head_dim: d,
                seq_q: 20,
                cache_seqlens: vec![45, 9],
                seq_new: 3,
                page_size: page,
                dtype: Dtype::Bf16,
                kernel: DecodeKernel::Prefill,
                ..DecodeProblem::default()
            };
            let r = run(dev, &p, None);
            assert_eq!(r.kernel, "prefill", "{p:?}");
            let want = format!("flash_fwd_bf16_d{}", if d == 40 { 64 } else { 128 });
            assert!(r.launches.iter().any(|l| l.kernel == want), "{:?}", r.launches);
        }
        // An FP8 cache keeps its own head dims.
        let p = DecodeProblem { head_dim: 80, kv_fp8: Some(Fp8Format::E4m3), dtype: Dtype::Bf16, ..DecodeProblem::default() };
        let e = p.validate().unwrap_err().to_string();
        assert!(e.contains("head_dim 80") && e.contains("not over an FP8 cache"), "{e}");
    }

    // `Auto` picks the prefill kernel for a query of at least the forward's block rows (128 at
    // d 64), the tensor-core decode below, and the decode kernel for what the forward refuses.
    fn auto_picks_prefill_by_query_length(dev: &mut dyn Device) {
        let p = DecodeProblem {
            batch: 1,
            heads: 4,
            heads_kv: 1,
            head_dim: 64,
            cache_seqlens: vec![200],
            page_size: Some(16),
            dtype: Dtype::Bf16,
            ..DecodeProblem::default()
        };
        for (seq_q, kernel) in [(127u32, "mma"), (128, "prefill"), (300, "prefill")] {
            let q = DecodeProblem { seq_q, ..p.clone() };
            assert_eq!(q.uses_prefill(), kernel == "prefill");
            assert_eq!(run(dev, &q, None).kernel, kernel, "seq_q {seq_q}");
        }
        let alibi = DecodeProblem { seq_q: 300, alibi: true, ..p.clone() };
        assert!(!alibi.uses_prefill());
        let forced = DecodeProblem { kernel: DecodeKernel::Prefill, ..alibi };
        let e = forced.validate().unwrap_err().to_string();
        assert!(e.contains("prefill kernel") && e.contains("ALiBi"), "{e}");
        let f32 = DecodeProblem { kernel: DecodeKernel::Prefill, dtype: Dtype::F32, ..p.clone() };
        assert!(f32.validate().unwrap_err().to_string().contains("bf16 or f16"));
        // A split count above 1 keeps the decode kernel under Auto, and is refused by Prefill.
        let split = DecodeProblem { seq_q: 300, splits: Splits::Fixed(3), ..p };
        assert!(!split.uses_prefill());
        assert_eq!(run(dev, &split, None).kernel, "mma");
        let forced = DecodeProblem { kernel: DecodeKernel::Prefill, ..split };
        assert!(forced.validate().unwrap_err().to_string().contains("no key splits"));
    }

    fn decode_split_and_no_split_agree(dev: &mut dyn Device) {
        let base = DecodeProblem {
            batch: 2,
            heads: 8,
            heads_kv: 2,
            head_dim: 64,
            seq_q: 2,
            cache_seqlens: vec![600, 61], // 3 of FlashAttention-2's 256-key blocks: auto picks 3
            ..DecodeProblem::default()
        };
        let one = run(dev, &DecodeProblem { splits: Splits::Fixed(1), ..base.clone() }, None);
        for splits in [Splits::Fixed(2), Splits::Fixed(7), Splits::Auto] {
            let r = run(dev, &DecodeProblem { splits, ..base.clone() }, None);
            assert!(r.plan.num_splits > 1, "{splits}: {:?}", r.plan);
            assert!(splits != Splits::Auto || r.plan.num_splits == 3, "{:?}", r.plan);
            let diff = r.o.iter().zip(&one.o).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(diff < 1e-5, "{splits}: split and unsplit differ by {diff}");
        }
    }

    #[smoke]
    fn decode_paged_equals_contiguous_bit_for_bit(dev: &mut dyn Device) {
        let p = DecodeProblem {
            batch: 3,
            heads: 4,
            heads_kv: 1,
            head_dim: 64,
            seq_q: 1,
            cache_seqlens: vec![300, 1, 45],
            seq_new: 1,
            splits: Splits::Fixed(3),
            ..DecodeProblem::default()
        };
        let x = DecodeInputs::random(&p, 21);
        let contiguous = run(dev, &p, Some(&x));
        // Powers of two take the shift-and-mask page math, 24 the division.
        for ps in [1u32, 16, 24, 32, 256] {
            let (pp, y) = x.relaid(&p, Some(ps), 100 + ps as u64);
            let paged = run(dev, &pp, Some(&y));
            assert_eq!(paged.plan.num_splits, 3);
            assert_eq!(bits(&paged.o), bits(&contiguous.o), "page size {ps}");
            assert_eq!(bits(&paged.lse), bits(&contiguous.lse), "page size {ps}");
            assert_eq!(paged.verification.cache_ok, Some(true));
        }
    }

    // FlashAttention-2's cache_batch_idx and cache_leftpad (contiguous caches): sequences in a
    // permutation of 5 cache slots with left padding (one sequence all padding before its new
    // tokens), new tokens appended past the padding, GQA, seq_q 2, 3 splits; against f64 with
    // both decode kernels and every dtype, the appended cache exact, and bit for bit the same
    // as the same keys laid out from row 0 of slot b. The unused slots and the padding are NaN
    // (DecodeInputs::random), so a kernel that reads either fails.
    fn decode_cache_slots_and_left_padding(dev: &mut dyn Device) {
        for (dtype, window) in [(Dtype::F32, (-1, -1)), (Dtype::Bf16, (20, 0)), (Dtype::F16, (-1, -1))] {
            let p = DecodeProblem {
                batch: 3,
                heads: 4,
                heads_kv: 2,
                head_dim: 64,
                seq_q: 2,
                cache_seqlens: vec![40, 70, 33],
                seq_new: 2,
                dtype,
                window_left: window.0,
                window_right: window.1,
                splits: Splits::Fixed(3),
                cache_batch_idx: Some(vec![2, 0, 4]),
                cache_leftpad: Some(vec![5, 0, 33]),
                ..DecodeProblem::default()
            };
            let x = DecodeInputs::random(&p, 17);
            assert_eq!(x.k_cache.len(), 5 * 72 * 2 * 64, "5 slots of 72 rows");
            let reports = if dtype == Dtype::F32 { vec![run(dev, &p, Some(&x))] } else { run_both(dev, &p, Some(&x)).to_vec() };
            let (pp, y) = x.relaid(&p, None, 9);
            assert_eq!(pp.cache_seqlens, [35, 70, 0]);
            for r in &reports {
                assert_eq!(r.verification.cache_ok, Some(true), "{dtype} {}", r.kernel);
                let kernel = if r.kernel == "mma" { DecodeKernel::Mma } else { DecodeKernel::Simt };
                let plain = run(dev, &DecodeProblem { kernel, ..pp.clone() }, Some(&y));
                assert_eq!(plain.kernel, r.kernel);
                let differ = |a: &[f32], b: &[f32]| a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
                assert_eq!(differ(&r.o, &plain.o), 0, "{dtype} {}: O differs from the plain layout's", r.kernel);
                assert_eq!(differ(&r.lse, &plain.lse), 0, "{dtype} {}: LSE differs", r.kernel);
            }
        }
        // Without new tokens two sequences may read one slot.
        let p = DecodeProblem {
            batch: 2,
            cache_seqlens: vec![30, 50],
            cache_batch_idx: Some(vec![1, 1]),
            cache_leftpad: Some(vec![3, 0]),
            ..DecodeProblem::default()
        };
        run(dev, &p, None);
    }

    // Head dims 32, 96, 192 and 256 (the SIMT decode, also for bf16/f16): ragged caches, GQA,
    // several splits, a paged cache with appends, a window and a soft cap, against f64.
    fn decode_every_forward_head_dim_against_f64(dev: &mut dyn Device) {
        for (i, d) in [32u32, 96, 192, 256].into_iter().enumerate() {
            for (j, dtype) in [Dtype::F32, Dtype::Bf16, Dtype::F16].into_iter().enumerate() {
                let p = DecodeProblem {
                    batch: 2,
                    heads: 8,
                    heads_kv: if (i + j) % 2 == 0 { 2 } else { 8 },
                    head_dim: d,
                    seq_q: 1 + (j as u32 % 2),
                    cache_seqlens: vec![77, 130],
                    seq_new: 2,
                    page_size: if j == 1 { Some(16) } else { None },
                    dtype,
                    window_left: if j == 2 { 40 } else { -1 },
                    window_right: if j == 2 { 0 } else { -1 },
                    softcap: if i == 1 { 20.0 } else { 0.0 },
                    splits: Splits::Fixed(3),
                    ..DecodeProblem::default()
                };
                let r = run(dev, &p, None);
                assert_eq!(r.kernel, "simt", "d{d} {dtype}");
                assert!(r.launches.iter().any(|l| l.kernel == format!("decode_fwd_{dtype}_d{d}")), "{:?}", r.launches);
                assert_eq!(r.verification.cache_ok, Some(true));
            }
        }
        // The tensor-core decode is refused past its widest head dim (96 runs on its d128,
        // padded), naming its head dims.
        let p = DecodeProblem { head_dim: 192, dtype: Dtype::Bf16, kernel: DecodeKernel::Mma, ..DecodeProblem::default() };
        let e = p.validate().unwrap_err().to_string();
        assert!(e.contains("compiled for head_dim 64 and 128"), "{e}");
    }

    // FlashAttention-2's rotary embedding in a KV-cache call: GPT-NeoX and GPT-J pairs, the full
    // and a partial rotary dim, per-token query positions (causal) and one position for all
    // (not causal), GQA, seq_q 3, appends; contiguous, paged, and with cache slots and left
    // padding; f32 and bf16 on both decode kernels. Each run is checked against f64 attention
    // over the rotated inputs and the appended cache (rotated keys) bit for bit.
    fn decode_rotary_append_against_f64(dev: &mut dyn Device) {
        let mut case = 0u64;
        for interleaved in [false, true] {
            for (dim, causal, page_size, dtype) in [
                (64u32, true, None, Dtype::F32),
                (32, false, Some(16u32), Dtype::F32),
                (64, false, None, Dtype::Bf16),
                (32, true, Some(7), Dtype::Bf16),
            ] {
                case += 1;
                let p = DecodeProblem {
                    batch: 2,
                    heads: 4,
                    heads_kv: 2,
                    head_dim: 64,
                    seq_q: 3,
                    cache_seqlens: vec![37, 90],
                    seq_new: 3,
                    page_size,
                    dtype,
                    causal,
                    splits: Splits::Fixed(2),
                    rotary: Some(Rotary { dim, interleaved }),
                    ..DecodeProblem::default()
                };
                let x = DecodeInputs::random(&p, 40 + case);
                let reports = if dtype == Dtype::F32 { vec![run(dev, &p, Some(&x))] } else { run_both(dev, &p, Some(&x)).to_vec() };
                for r in &reports {
                    assert_eq!(r.verification.cache_ok, Some(true), "{p:?}");
                    assert!(r.launches[0].kernel.starts_with("decode_rotary_"), "{:?}", r.launches);
                }
            }
        }
        // With cache slots and left padding: positions count the padding (cache_seqlens + t).
        let p = DecodeProblem {
            batch: 2,
            heads: 4,
            heads_kv: 1,
            head_dim: 64,
            cache_seqlens: vec![20, 33],
            seq_new: 2,
            cache_batch_idx: Some(vec![1, 0]),
            cache_leftpad: Some(vec![6, 0]),
            rotary: Some(Rotary { dim: 48, interleaved: false }),
            ..DecodeProblem::default()
        };
        let r = run(dev, &p, None);
        assert_eq!(r.verification.cache_ok, Some(true));
    }

    fn decode_append_then_attend_equals_attend_over_the_concatenation(dev: &mut dyn Device) {
        for page_size in [None, Some(16)] {
            let p = DecodeProblem {
                batch: 2,
                heads: 8,
                heads_kv: 2,
                head_dim: 64,
                seq_q: 3,
                cache_seqlens: vec![50, 0],
                seq_new: 3,
                page_size,
                splits: Splits::Fixed(2),
                ..DecodeProblem::default()
            };
            let x = DecodeInputs::random(&p, 3);
            let appended = run(dev, &p, Some(&x));
            assert_eq!(appended.verification.cache_ok, Some(true));
            // The concatenated cache, no new tokens.
            let mut cat = x.clone();
            (cat.k_cache, cat.v_cache) = x.appended(&p);
            cat.k_new.clear();
            cat.v_new.clear();
            let pc = DecodeProblem { cache_seqlens: vec![53, 3], seq_new: 0, ..p.clone() };
            let whole = run(dev, &pc, Some(&cat));
            assert_eq!(bits(&appended.o), bits(&whole.o), "{page_size:?}");
            assert_eq!(bits(&appended.lse), bits(&whole.lse), "{page_size:?}");
            assert_eq!(bits(&appended.k_cache), bits(&cat.k_cache));
        }
    }

    fn decode_fixed_splits_are_batch_invariant(dev: &mut dyn Device) {
        // Sequence 2 of a batch of 3 (not the longest), and the same sequence alone: the same
        // bits with --splits 2.
        let p3 = DecodeProblem {
            batch: 3,
            heads: 4,
            heads_kv: 2,
            head_dim: 64,
            seq_q: 2,
            cache_seqlens: vec![5, 130, 77],
            splits: Splits::Fixed(2),
            ..DecodeProblem::default()
        };
        let x3 = DecodeInputs::random(&p3, 8);
        let p1 = DecodeProblem { batch: 1, cache_seqlens: vec![77], ..p3.clone() };
        let (qn, rows) = (2 * 4 * 64, 130 * 2 * 64);
        let x1 = DecodeInputs {
            q: x3.q[2 * qn..3 * qn].to_vec(),
            k_cache: x3.k_cache[2 * rows..3 * rows].to_vec(),
            v_cache: x3.v_cache[2 * rows..3 * rows].to_vec(),
            ..x3.clone()
        };
        let (r3, r1) = (run(dev, &p3, Some(&x3)), run(dev, &p1, Some(&x1)));
        assert_eq!(bits(&r1.o), bits(&r3.o[2 * qn..3 * qn]), "O of sequence 2");
        assert_eq!(bits(&r1.lse), bits(&r3.lse[16..24]), "LSE of sequence 2");
        // And run to run.
        assert_eq!(bits(&run(dev, &p3, Some(&x3)).o), bits(&r3.o));
    }

    fn decode_sliding_windows_against_f64(dev: &mut dyn Device) {
        // Windows that start inside a later tile (skipped tiles), see one key, see nothing for the
        // first rows (seq_q > seqlen_k), and look right of the diagonal without causal.
        for (left, right, causal, seq_q) in [(40, -1, true, 1u32), (5, 0, true, 3), (0, 0, false, 3), (-1, 2, false, 4), (70, 3, false, 2)] {
            let p = DecodeProblem {
                batch: 3,
                heads: 8,
                heads_kv: 2,
                head_dim: 64,
                seq_q,
                cache_seqlens: vec![200, 1, 97],
                seq_new: 1,
                page_size: Some(16),
                causal,
                window_left: left,
                window_right: right,
                splits: Splits::Fixed(3),
                ..DecodeProblem::default()
            };
            let r = run(dev, &p, None);
            assert!(r.o.iter().any(|v| v.abs() > 0.1), "real values");
        }
    }

    fn decode_softcap_against_f64(dev: &mut dyn Device) {
        for (softcap, scale) in [(0.7f32, None), (2.0, Some(1.0))] {
            let p = DecodeProblem {
                batch: 2,
                heads: 4,
                heads_kv: 1,
                head_dim: 128,
                seq_q: 2,
                cache_seqlens: vec![70, 3],
                softcap,
                scale,
                splits: Splits::Fixed(2),
                ..DecodeProblem::default()
            };
            let r = run(dev, &p, None);
            // The cap changes the answer: the same run without it differs by far more than the bound.
            let plain = run(dev, &DecodeProblem { softcap: 0.0, ..p.clone() }, None);
            let diff = r.o.iter().zip(&plain.o).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(diff > 1e-2, "softcap {softcap}: {diff}");
        }
    }

    fn decode_bf16_f16_against_f64(dev: &mut dyn Device) {
        for dtype in [Dtype::Bf16, Dtype::F16] {
            for d in [64u32, 128] {
                for kernel in [DecodeKernel::Simt, DecodeKernel::Mma] {
                let p = DecodeProblem {
                    batch: 2,
                    heads: 8,
                    heads_kv: 2,
                    head_dim: d,
                    seq_q: 2,
                    cache_seqlens: vec![90, 1],
                    seq_new: 1,
                    page_size: Some(32),
                    dtype,
                    kernel,
                    splits: Splits::Fixed(2),
                    ..DecodeProblem::default()
                };
                let r = run(dev, &p, None);
                assert!(r.verification.o_max_scaled_err > 0.0, "{dtype}: rounding shows");
                assert_eq!(r.kernel, if kernel == DecodeKernel::Mma { "mma" } else { "simt" });
                }
            }
        }
        // The default for 16-bit types is the tensor-core kernel, for f32 the SIMT one.
        let p = DecodeProblem { dtype: Dtype::Bf16, cache_seqlens: vec![40], ..DecodeProblem::default() };
        assert_eq!(run(dev, &p, None).kernel, "mma");
        assert_eq!(run(dev, &DecodeProblem { dtype: Dtype::F32, ..p }, None).kernel, "simt");
    }

    fn decode_mma_gqa_ragged_windows_softcap_against_f64(dev: &mut dyn Device) {
        // GQA ratios 1, 4, 8 and 16 (16 rows of one token fill the m-tile; 8 x 3 tokens = 24 rows
        // take two tiles, the second half empty), ragged caches with 0 and 1 keys, seq_q > 1,
        // paged with pages that a 64-key tile straddles, windows and a soft cap.
        let cases = [
            (Dtype::Bf16, 64u32, 4u32, 4u32, 1u32, -1, -1, 0.0f32, None),
            (Dtype::F16, 64, 8, 2, 3, -1, -1, 0.0, Some(24)),
            (Dtype::Bf16, 128, 8, 1, 3, 40, 0, 0.0, Some(7)),
            (Dtype::F16, 128, 16, 1, 1, -1, -1, 1.5, None),
            (Dtype::Bf16, 64, 4, 1, 2, 5, 2, 0.0, Some(16)),
        ];
        for (dtype, d, heads, heads_kv, seq_q, left, right, softcap, page_size) in cases {
            let p = DecodeProblem {
                batch: 4,
                heads,
                heads_kv,
                head_dim: d,
                seq_q,
                cache_seqlens: vec![0, 1, 77, 150],
                seq_new: 1,
                page_size,
                dtype,
                causal: right == 0 || left < 0,
                window_left: left,
                window_right: right,
                softcap,
                kernel: DecodeKernel::Mma,
                splits: Splits::Fixed(3),
                ..DecodeProblem::default()
            };
            let r = run(dev, &p, None);
            assert_eq!(r.kernel, "mma");
            assert!(r.o.iter().any(|v| v.abs() > 0.1), "real values");
        }
    }

    #[smoke]
    fn decode_mma_paged_equals_contiguous_and_splits_agree(dev: &mut dyn Device) {
        let p = DecodeProblem {
            batch: 3,
            heads: 8,
            heads_kv: 2,
            head_dim: 64,
            seq_q: 2,
            cache_seqlens: vec![300, 1, 45],
            seq_new: 1,
            dtype: Dtype::Bf16,
            kernel: DecodeKernel::Mma,
            splits: Splits::Fixed(3),
            ..DecodeProblem::default()
        };
        let x = DecodeInputs::random(&p, 21);
        let contiguous = run(dev, &p, Some(&x));
        for ps in [1u32, 16, 37, 256] {
            let (pp, y) = x.relaid(&p, Some(ps), 100 + ps as u64);
            let paged = run(dev, &pp, Some(&y));
            assert_eq!(paged.kernel, "mma");
            assert_eq!(bits(&paged.o), bits(&contiguous.o), "page size {ps}");
            assert_eq!(bits(&paged.lse), bits(&contiguous.lse), "page size {ps}");
            assert_eq!(paged.verification.cache_ok, Some(true));
        }
        // Split vs no split, and the SIMT kernel: within the bf16 rounding of O.
        let one = run(dev, &DecodeProblem { splits: Splits::Fixed(1), ..p.clone() }, Some(&x));
        let [simt, _] = run_both(dev, &p, Some(&x));
        for (what, r) in [("1 split", &one), ("simt", &simt)] {
            let diff = r.o.iter().zip(&contiguous.o).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(diff < 2e-2, "{what}: {diff}");
        }
        // Run to run.
        assert_eq!(bits(&run(dev, &p, Some(&x)).o), bits(&contiguous.o));
    }

    fn decode_sinks_against_f64_with_any_split_count(dev: &mut dyn Device) {
        // Sequence 0 has no key: O = 0 and LSE = sink[h]. With splits > 1 the sink is counted in
        // split 0 only; counted in every split, the merged denominator would be off and the f64
        // check fails.
        let cases = [
            (Dtype::F32, DecodeKernel::Simt, Splits::Fixed(1)),
            (Dtype::F32, DecodeKernel::Simt, Splits::Fixed(3)),
            (Dtype::Bf16, DecodeKernel::Mma, Splits::Fixed(1)),
            (Dtype::Bf16, DecodeKernel::Mma, Splits::Fixed(3)),
            (Dtype::F16, DecodeKernel::Mma, Splits::Auto),
            (Dtype::F16, DecodeKernel::Simt, Splits::Auto),
        ];
        for (n, (dtype, kernel, splits)) in cases.into_iter().enumerate() {
            let p = DecodeProblem {
                batch: 3,
                heads: 8,
                heads_kv: 2,
                head_dim: 64,
                seq_q: 2,
                cache_seqlens: vec![0, 50, 300],
                dtype,
                kernel,
                sinks: true,
                splits,
                ..DecodeProblem::default()
            };
            let x = DecodeInputs::random(&p, 9);
            assert_eq!(x.sinks.len(), 8);
            let r = run(dev, &p, Some(&x));
            assert!(splits == Splits::Fixed(1) || r.plan.num_splits > 1, "{:?}", r.plan);
            for h in 0..8 {
                for i in 0..2 {
                    let (got, sink) = (r.lse[h * 2 + i], x.sinks[h]);
                    assert!((got - sink).abs() <= 1e-6 * sink.abs().max(1.0), "{dtype} {splits}: head {h} {got} vs {sink}");
                }
            }
            assert!(r.o[..2 * 8 * 64].iter().all(|&v| v == 0.0));
            assert!(r.o.iter().any(|v| v.abs() > 0.1), "real values");
            if n == 3 {
                // Without the sinks every row that sees a key has a lower LSE.
                let y = DecodeInputs { sinks: vec![], ..x.clone() };
                let plain = run(dev, &DecodeProblem { sinks: false, ..p.clone() }, Some(&y));
                assert!(r.lse[16..].iter().zip(&plain.lse[16..]).all(|(a, b)| a > b), "{dtype} {splits}");
            }
        }
    }

    fn fp8_cache_decode_against_the_reference_over_its_bytes(dev: &mut dyn Device) {
        // SIMT and tensor-core kernels; both formats; GQA 4:1 and 2:1; several sequences of lengths off the 32-key tile and the
        // page size (one empty before the append); page sizes 1 and 16 and a contiguous cache;
        // per-tensor and per-KV-head scales; new tokens appended (quantised by the kernel).
        let cases = [
            (Fp8Format::E4m3, 64, 8, 2, Some(16), vec![37u32, 0, 70], 2u32, false),
            (Fp8Format::E5m2, 64, 8, 2, Some(1), vec![5, 33], 1, true),
            (Fp8Format::E4m3, 128, 4, 2, None, vec![65, 3], 1, true),
            (Fp8Format::E5m2, 128, 8, 4, Some(16), vec![40], 0, false),
        ];
        for (f, d, h, hk, page_size, lens, new, per_head) in cases {
            require_kernel(dev, &format!("decode_fwd_{}_d{d}", memattn_cli::decode::fp8_elem(f).name()));
            let p = DecodeProblem {
                batch: lens.len() as u32,
                heads: h,
                heads_kv: hk,
                head_dim: d,
                cache_seqlens: lens.clone(),
                seq_new: new,
                page_size,
                dtype: Dtype::Bf16,
                kv_fp8: Some(f),
                splits: Splits::Fixed(2),
                ..DecodeProblem::default()
            };
            let mut x = DecodeInputs::random(&p, 11);
            if per_head {
                // Each KV head its own scale; head 0's is a quarter of what its values need, so
                // its largest values saturate to the format's max.
                let base = x.k_scale[0];
                x.k_scale = (0..hk).map(|i| base * if i == 0 { 0.25 } else { 1.0 + i as f32 }).collect();
                x.v_scale = (0..hk).map(|i| x.v_scale[0] * (0.5 + i as f32)).collect();
            }
            let label = format!("{f:?} d{d} {h}/{hk} page {page_size:?} lens {lens:?} per_head {per_head}");
            require_kernel(dev, &format!("decode_mma_{}_d{d}", memattn_cli::decode::fp8_elem(f).name()));
            for r in run_both(dev, &p, Some(&x)) {
            assert_eq!(r.kv_dtype, f.name(), "{label}");
            assert_eq!(r.verification.cache_ok, if new > 0 { Some(true) } else { None }, "{label}");
            let q = r.verification.quantisation_rel_rms.expect("an FP8 run reports its quantisation error");
            // e4m3 keeps 3 mantissa bits (u = 2^-4), e5m2 2 (u = 2^-3): O averages the errors.
            assert!(q > 1e-3 && q < 4.0 * f.unit_roundoff() as f64, "{label}: quantisation rel RMS {q}");
            assert_eq!(r.bytes.kv_cache, x.k_cache.len() as u64 * 2, "{label}: one byte per element, K and V");
            if per_head {
                // The saturated head: some stored values are exactly +-max * scale.
                let deq = x.dequantised(&p);
                let top = f.max_finite() * x.k_scale[0];
                let sat = (0..deq.k_cache.len())
                    .filter(|&i| (i / d as usize).is_multiple_of(hk as usize) && deq.k_cache[i].abs() == top)
                    .count();
                assert!(sat > 0, "{label}: no saturated value in head 0");
            }
            }
        }
        // Rotary with an FP8 cache: the new keys are rotated, then quantised (the appended cache
        // is judged bit for bit against that order), on both kernels.
        let p = DecodeProblem {
            batch: 2,
            heads: 8,
            heads_kv: 2,
            head_dim: 64,
            seq_q: 3,
            cache_seqlens: vec![37, 5],
            seq_new: 3,
            dtype: Dtype::Bf16,
            kv_fp8: Some(Fp8Format::E4m3),
            rotary: Some(Rotary { dim: 32, interleaved: false }),
            ..DecodeProblem::default()
        };
        let x = DecodeInputs::random(&p, 5);
        for r in run_both(dev, &p, Some(&x)) {
            assert_eq!(r.verification.cache_ok, Some(true), "{:?}", r.verification);
        }
        // Bad scales are typed refusals (exit 2) naming the tensor and the rule.
        let p = DecodeProblem { dtype: Dtype::Bf16, kv_fp8: Some(Fp8Format::E4m3), ..DecodeProblem::default() };
        let x = DecodeInputs::random(&p, 1);
        let spec = DecodeSpec { problem: p.clone(), seed: 0, warmup: Some(0), repeats: Some(1), indices_on_device: false };
        for (k, v, want) in [
            (vec![0.0], vec![1.0], "k_scale[0] = 0"),
            (vec![1.0], vec![f32::NAN], "v_scale[0] = NaN"),
            (vec![1.0, 1.0, 1.0], vec![1.0], "k_scale has 3 scales"),
        ] {
            let y = DecodeInputs { k_scale: k, v_scale: v, ..x.clone() };
            let e = run_decode(dev, &spec, Some(&y)).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{e}");
            assert!(e.to_string().contains(want), "{e}");
        }
        let f32_q = DecodeProblem { dtype: Dtype::F32, ..p.clone() };
        assert!(f32_q.validate().unwrap_err().to_string().contains("bf16"));
        // Auto runs the tensor-core kernel (f16 mma over the widened cache).
        assert_eq!(p.kernels().unwrap()[0].name(), "decode_mma_fp8_e4m3_d64");
    }

    fn decode_bad_input_is_refused_before_launch(dev: &mut dyn Device) {
        let p = DecodeProblem {
            batch: 2,
            heads: 4,
            heads_kv: 2,
            head_dim: 64,
            cache_seqlens: vec![20, 33],
            seq_new: 1,
            page_size: Some(16),
            ..DecodeProblem::default()
        };
        let x = DecodeInputs::random(&p, 1);
        let spec = DecodeSpec { problem: p.clone(), seed: 0, warmup: Some(0), repeats: Some(1), indices_on_device: false };
        let err = |dev: &mut dyn Device, s: &DecodeSpec, y: &DecodeInputs| {
            let e = run_decode(dev, s, Some(y)).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{e}");
            e.to_string()
        };
        let mut y = x.clone();
        y.block_table[1] = 1000;
        assert!(err(dev, &spec, &y).contains("past num_pages"));
        // 33 + 1 keys need 3 pages of 16; give the spec a longer cache than the pages hold.
        let longer = DecodeSpec { problem: DecodeProblem { cache_seqlens: vec![20, 60], ..p.clone() }, ..spec.clone() };
        assert!(err(dev, &longer, &x).contains("needs 4 pages of 16"));
        let mut y = x.clone();
        let max_pages = y.block_table.len() / 2;
        y.block_table[max_pages + 2] = y.block_table[1]; // sequence 1's last page is sequence 0's page 1
        assert!(err(dev, &spec, &y).contains("duplicate pages"));
        let zero = DecodeSpec { problem: DecodeProblem { page_size: Some(0), ..p.clone() }, ..spec.clone() };
        assert!(err(dev, &zero, &x).contains("page_size must be >= 1"));
        let heads = DecodeSpec { problem: DecodeProblem { heads: 3, ..p.clone() }, ..spec.clone() };
        assert!(err(dev, &heads, &x).contains("mismatched heads"));
    }
}

/// What the host's block-table check prevents: the same bad entry launched directly (no
/// validation) is an out-of-bounds read that the VM's memcheck reports, in the SIMT kernel (f32)
/// and in the tensor-core one (bf16, whose `cp.async` copies read the cache). VM only: a GPU need
/// not fault on it.
#[test]
fn vm_memcheck_catches_the_block_table_entry_the_host_refuses() {
    for (kernel, elem_bytes) in [("decode_fwd_f32_d64", 4u64), ("decode_mma_bf16_d64", 2)] {
        memcheck_catches_a_bad_block_table_entry(kernel, elem_bytes);
    }
}

fn memcheck_catches_a_bad_block_table_entry(kernel: &str, elem_bytes: u64) {
    let mut dev = vm_device();
    let (hk, d, ps, pages) = (1u64, 64u64, 16u64, 2u64);
    let cache = dev.alloc(pages * ps * hk * d * elem_bytes).unwrap();
    dev.fill_u32(cache, pages * ps * hk * d * elem_bytes / 4, 0).unwrap();
    let q = dev.alloc(d * 4).unwrap();
    dev.fill_u32(q, d, 0).unwrap();
    let o = dev.alloc(d * 4).unwrap();
    let lse = dev.alloc(4).unwrap();
    let table = dev.alloc(8).unwrap();
    let seqlens = dev.alloc(4).unwrap();
    dev.upload_bytes(seqlens, &20u32.to_le_bytes()).unwrap();
    let launch = |dev: &mut dyn Device, second_page: u32| {
        let t: Vec<u8> = [0u32, second_page].iter().flat_map(|v| v.to_le_bytes()).collect();
        dev.upload_bytes(table, &t).unwrap();
        let prm = DecodeParams {
            q,
            k_cache: cache,
            v_cache: cache,
            block_table: table,
            cache_seqlens: seqlens,
            o,
            lse,
            batch: 1,
            heads: 1,
            heads_kv: 1,
            seq_q: 1,
            head_dim: 64,
            page_size: 16,
            max_pages: 2,
            num_splits: 1,
            softmax_scale: 0.125,
            ..Default::default()
        };
        let dims = if kernel.starts_with("decode_mma") {
            DECODE_MMA_D64.launch(1, 1, 1, 1, 1)
        } else {
            DECODE_D64.launch(1, 1, 1, 1, 1)
        };
        dev.launch(kernel, &dims, &[&prm.to_bytes()])
    };
    launch(&mut dev, 1).unwrap_or_else(|e| panic!("{kernel}: valid table: {e}"));
    let e = launch(&mut dev, 7).unwrap_err();
    assert!(e.to_string().contains("memcheck"), "{kernel}: {e}");
}

/// The library's FP8 road ([`memattn::attn::Kernels::plan_kvcache_fp8`]): a plan for an FP8
/// cache runs only through `run_kvcache_fp8`, a bf16 plan not through it, and scales that do not
/// match the cache's KV heads or are not finite and positive are refused with the rule named.
#[test]
fn vm_fp8_plans_and_scales_are_checked_by_the_library() {
    use memattn::attn::{AttnError, AttnOpts, Fp8CacheViewMut, Kernels, LseViewMut, TensorView, TensorViewMut};
    use memattn::error::KvCacheRule;
    let k = Kernels::vm().unwrap();
    let (b, h, hk, d, cap) = (1usize, 4usize, 2usize, 64usize, 40usize);
    let q = k.upload_as(Dtype::Bf16, &vec![0.5; b * h * d]).unwrap();
    let (kc, vc) = (k.vm_alloc((b * cap * hk * d) as u64).unwrap(), k.vm_alloc((b * cap * hk * d) as u64).unwrap());
    let (o, lse) = (k.vm_alloc((b * h * d * 2) as u64).unwrap(), k.vm_alloc((b * h * 4) as u64).unwrap());
    let lens = k.index_tensor(&[33], None).unwrap();
    let qv = TensorView::device(&q, Dtype::Bf16, [b, 1, h, d]).unwrap();
    let mut kv = Fp8CacheViewMut::device(&kc, Fp8Format::E4m3, [b, cap, hk, d]).unwrap();
    let mut vv = Fp8CacheViewMut::device(&vc, Fp8Format::E4m3, [b, cap, hk, d]).unwrap();
    let (mut ov, mut lv) =
        (TensorViewMut::device(&o, Dtype::Bf16, [b, 1, h, d]).unwrap(), LseViewMut::vm(&lse, b, h, 1).unwrap());
    let opts = AttnOpts::new();
    let rule = |e: AttnError| match e {
        AttnError::KvCache { why } => why,
        other => panic!("{other}"),
    };
    // Scales: 0 and NaN refused when made; 3 scales for 2 KV heads refused when made.
    assert!(matches!(rule(k.fp8_scales(&[0.0], hk).unwrap_err()), KvCacheRule::Fp8Scale { index: 0, .. }));
    assert!(matches!(rule(k.fp8_scales(&[1.0, f32::NAN], hk).unwrap_err()), KvCacheRule::Fp8Scale { index: 1, .. }));
    assert!(matches!(rule(k.fp8_scales(&[1.0; 3], hk).unwrap_err()), KvCacheRule::Fp8ScaleCount { got: 3, .. }));
    // Scales made for 4 KV heads do not fit a cache of 2.
    let (s4, s2) = (k.fp8_scales(&[1.0], 4).unwrap(), k.fp8_scales(&[0.5, 2.0], hk).unwrap());
    let e = k.plan_kvcache_fp8(&qv, &kv, &vv, &s4, &s2, None, None, &lens, None, &ov, &lv, &opts).unwrap_err();
    assert!(matches!(rule(e), KvCacheRule::Fp8ScaleCount { tensor: "k_scale", got: 4, heads_kv: 2, .. }));
    // An FP8 plan runs through run_kvcache_fp8 only; the bf16 road refuses it.
    let plan = k.plan_kvcache_fp8(&qv, &kv, &vv, &s2, &s2, None, None, &lens, None, &ov, &lv, &opts).unwrap();
    k.run_kvcache_fp8(&plan, &qv, &mut kv, &mut vv, None, None, &mut ov, &mut lv).unwrap();
    let (kb, vb) = (
        k.upload_as(Dtype::Bf16, &vec![0.0; b * cap * hk * d]).unwrap(),
        k.vm_alloc((b * cap * hk * d * 2) as u64).unwrap(),
    );
    let mut kbv = TensorViewMut::device(&kb, Dtype::Bf16, [b, cap, hk, d]).unwrap();
    let mut vbv = TensorViewMut::device(&vb, Dtype::Bf16, [b, cap, hk, d]).unwrap();
    let e = k.run_kvcache(&plan, &qv, &mut kbv, &mut vbv, None, None, &mut ov, &mut lv).unwrap_err();
    assert_eq!(rule(e), KvCacheRule::Fp8Plan { planned: true });
    let bf16_plan = k.plan_kvcache(&qv, &kbv, &vbv, None, None, &lens, None, &ov, &lv, &opts).unwrap();
    let e = k.run_kvcache_fp8(&bf16_plan, &qv, &mut kv, &mut vv, None, None, &mut ov, &mut lv).unwrap_err();
    assert_eq!(rule(e), KvCacheRule::Fp8Plan { planned: false });
    // An FP8 cache of the right shape in a buffer one byte short is out of bounds.
    let short = k.vm_alloc((b * cap * hk * d - 1) as u64).unwrap();
    let sv = Fp8CacheViewMut::device(&short, Fp8Format::E4m3, [b, cap, hk, d]).unwrap();
    let e = k.plan_kvcache_fp8(&qv, &sv, &vv, &s2, &s2, None, None, &lens, None, &ov, &lv, &opts).unwrap_err();
    assert!(matches!(e, AttnError::OutOfBounds { tensor: "k_cache", .. }), "{e}");
}

/// The host's rotated inputs (what the reference attends over) against rotary embedding written
/// here in f64 from its definitions: GPT-NeoX rotates dims (i, i + dim/2), GPT-J dims (2i, 2i + 1),
/// by the angle at the token's position; dims past `dim` stay. Within one rounding of the dtype.
#[test]
fn rotated_inputs_follow_the_rotary_definitions() {
    for (dtype, interleaved, dim, causal) in
        [(Dtype::F32, false, 64u32, true), (Dtype::F32, true, 32, false), (Dtype::Bf16, true, 64, true)]
    {
        let p = DecodeProblem {
            batch: 2,
            heads: 2,
            heads_kv: 1,
            head_dim: 64,
            seq_q: 2,
            cache_seqlens: vec![5, 11],
            seq_new: 2,
            dtype,
            causal,
            rotary: Some(Rotary { dim, interleaved }),
            ..DecodeProblem::default()
        };
        let x = DecodeInputs::random(&p, 3);
        let y = x.rotated(&p);
        let tol = if dtype == Dtype::F32 { 1e-6 } else { 1.0 / 128.0 };
        let half = (dim / 2) as usize;
        let check = |orig: &[f32], got: &[f32], heads: usize, tokens: usize, pos: &dyn Fn(usize, usize) -> usize| {
            for b in 0..2 {
                for t in 0..tokens {
                    for h in 0..heads {
                        let at = ((b * tokens + t) * heads + h) * 64;
                        let (o, g) = (&orig[at..at + 64], &got[at..at + 64]);
                        let ang = |i: usize| pos(b, t) as f64 * 10000f64.powf(-2.0 * i as f64 / dim as f64);
                        let mut want: Vec<f64> = o.iter().map(|&v| v as f64).collect();
                        for i in 0..half {
                            let (a, c) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
                            let (xa, xc) = (o[a] as f64, o[c] as f64);
                            want[a] = xa * ang(i).cos() - xc * ang(i).sin();
                            want[c] = xa * ang(i).sin() + xc * ang(i).cos();
                        }
                        for e in 0..64 {
                            let err = (g[e] as f64 - want[e]).abs();
                            assert!(
                                err <= tol * want[e].abs().max(1.0),
                                "{dtype} b{b} t{t} h{h} dim {e}: {} vs {}",
                                g[e],
                                want[e]
                            );
                        }
                    }
                }
            }
        };
        let q_pos = |b: usize, i: usize| p.cache_seqlens[b] as usize + if causal { i } else { 0 };
        check(&x.q, &y.q, 2, 2, &q_pos);
        check(&x.k_new, &y.k_new, 1, 2, &|b, t| p.cache_seqlens[b] as usize + t);
        assert_eq!(x.v_new, y.v_new, "v is not rotated");
    }
}
