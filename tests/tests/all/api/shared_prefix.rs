//! Shared-prefix decode (`Kernels::flash_attn_with_shared_prefix_into`): a batch over one prefix
//! cache and its own suffix caches, against the f64 reference of the same requests as plain
//! decodes over `prefix ++ suffix`, with the prefix's global bytes read counted from the VM; the
//! options and shapes it refuses.

use memattn::attn::{AttnError, AttnOpts, Kernels, KvCacheRule, LseViewMut, SinksView, TensorView, TensorViewMut};
use memattn::decode::{reference, verify_decode, CacheLayout, DecodeInputs, DecodeProblem, SharedPrefix};
use memattn::Dtype;

/// What one shared-prefix call did: its output, verification and the VM's bytes read by launch.
struct Ran {
    o: Vec<f32>,
    lse: Vec<f32>,
    /// `(kernel, global bytes read)` per launch, in order.
    reads: Vec<(String, u64)>,
}

/// Runs the shared-prefix call of `p` (whose first `prefix` cached keys become one shared
/// prefix), outputs poisoned with NaN first.
fn run(kernels: &Kernels, p: &DecodeProblem, sp: &SharedPrefix, splits: Option<u32>) -> Ran {
    let s = &sp.suffix;
    let x = &sp.suffix_inputs;
    let dt = p.dtype;
    let (b, sq, h, hk, d) =
        (p.batch as usize, p.seq_q as usize, p.heads as usize, p.heads_kv as usize, p.head_dim as usize);
    // One element more than needed, so no view of an empty vector is made.
    let up = |v: &[f32]| kernels.vm_upload_as(dt, &[v, &[0.0][..]].concat()).unwrap();
    let (qb, pk, pv, kc, vc, kn, vn) =
        (up(&x.q), up(&sp.prefix_k), up(&sp.prefix_v), up(&x.k_cache), up(&x.v_cache), up(&x.k_new), up(&x.v_new));
    let cache_shape = match x.layout {
        CacheLayout::Contiguous { seq_cache } => [b, seq_cache as usize, hk, d],
        CacheLayout::Paged { page_size, num_pages, .. } => [num_pages as usize, page_size as usize, hk, d],
    };
    let table = kernels.index_tensor(&x.block_table, None).unwrap();
    let prefix_shape = [1, sp.prefix as usize, hk, d];
    let seqlens = kernels.index_tensor(&s.cache_seqlens, None).unwrap();
    let ob = kernels.vm_upload_as(dt, &vec![f32::NAN; b * sq * h * d]).unwrap();
    let lb = kernels.vm_upload(&vec![f32::NAN; b * h * sq]).unwrap();
    let sinks = kernels.vm_upload(&[&x.sinks[..], &[0.0]].concat()).unwrap();
    let sinks = SinksView::vm(&sinks, h).unwrap();
    let mut opts = AttnOpts::new().causal(p.causal).decode_kernel(p.kernel);
    if let Some(n) = splits {
        opts = opts.num_splits(n);
    }
    if p.sinks {
        opts = opts.sinks(&sinks);
    }
    let new_shape = [b, s.seq_new as usize, hk, d];
    let new = s.seq_new > 0;
    let (kn, vn) = (TensorView::vm(&kn, dt, new_shape).unwrap(), TensorView::vm(&vn, dt, new_shape).unwrap());
    kernels.record_launches(true).unwrap();
    kernels
        .flash_attn_with_shared_prefix_into(
            &TensorView::vm(&qb, dt, [b, sq, h, d]).unwrap(),
            &TensorView::vm(&pk, dt, prefix_shape).unwrap(),
            &TensorView::vm(&pv, dt, prefix_shape).unwrap(),
            &mut TensorViewMut::vm(&kc, dt, cache_shape).unwrap(),
            &mut TensorViewMut::vm(&vc, dt, cache_shape).unwrap(),
            new.then_some(&kn),
            new.then_some(&vn),
            &seqlens,
            (!x.block_table.is_empty()).then_some(&table),
            &mut TensorViewMut::vm(&ob, dt, [b, sq, h, d]).unwrap(),
            &mut LseViewMut::vm(&lb, b, h, sq).unwrap(),
            &opts,
        )
        .unwrap_or_else(|e| panic!("{p:?}: {e}"));
    let reads = kernels
        .take_launches()
        .unwrap()
        .into_iter()
        .map(|l| (l.kernel.name().to_string(), l.info.global_bytes_read.unwrap()))
        .collect();
    kernels.record_launches(false).unwrap();
    Ran { o: ob.read_f32(dt, b * sq * h * d).unwrap(), lse: lb.read_f32(Dtype::F32, b * h * sq).unwrap(), reads }
}

/// 64 requests over a 4096-token prefix (heads 8/2, d 64, bf16 on tensor cores, suffixes of
/// different lengths, none a tile multiple): the output verifies against the f64 reference of
/// each request as one plain decode over `prefix ++ suffix`, and the prefix is read once per
/// 16-row tile of packed query rows of a KV head (the decode kernel's block of rows), not once
/// per request.
#[test]
fn sixty_four_requests_read_the_prefix_once_per_block_of_rows() {
    let kernels = Kernels::vm().unwrap();
    let (batch, heads, heads_kv, d, prefix) = (64u32, 8u32, 2u32, 64u32, 4096u32);
    let p = DecodeProblem {
        batch,
        heads,
        heads_kv,
        head_dim: d,
        seq_q: 1,
        // Suffixes of 1 to 149 keys, differing and none a multiple of 64.
        cache_seqlens: (0..batch).map(|b| prefix + 1 + (b * 37) % 149).collect(),
        dtype: Dtype::Bf16,
        causal: true,
        ..DecodeProblem::default()
    };
    let mut x = DecodeInputs::random(&p, 7);
    let sp = SharedPrefix::split(&p, &mut x, prefix).unwrap();
    let r = reference(&p, &x);
    let ran = run(&kernels, &p, &sp, None);
    let v = verify_decode(&p, &ran.o, &ran.lse, &r);
    assert!(v.passed && v.unwritten == 0, "{:?}", v.failures);
    eprintln!(
        "shared prefix: O max err {:.3e} (bound {:.3e}), LSE err {:.3e} (bound {:.3e}); launches {:?}",
        v.o_max_scaled_err, v.o_bound, v.lse_max_abs_err, v.lse_bound, ran.reads
    );

    // Expected bytes, from the shapes alone: the prefix's K and V (bf16) are 2 x 4096 x 2 x 64 x
    // 2 bytes = 2 MiB; level 1 packs the 4 query heads of a KV head for each of the 64 requests,
    // 256 rows, in 16-row tiles: 16 tiles per KV head, each reading its KV head's half of the
    // prefix once.
    let elem = 2u64;
    let prefix_bytes = 2 * prefix as u64 * heads_kv as u64 * d as u64 * elem;
    assert_eq!(prefix_bytes, 2 << 20);
    let group = (heads / heads_kv) as u64;
    let tiles_per_kv_head = (batch as u64 * group).div_ceil(16);
    assert_eq!(tiles_per_kv_head, 16);
    let once_per_tile = tiles_per_kv_head * prefix_bytes;
    let per_request = batch as u64 * prefix_bytes;
    // The first launch is the decode over the prefix; what else it reads is the query rows of
    // its tiles (64 x 8 x 64 x 2 bytes = 64 KiB per split), small beside the prefix.
    let (name, level1) = &ran.reads[0];
    assert!(name.starts_with("decode_mma_bf16_d64"), "{:?}", ran.reads);
    assert!(*level1 >= once_per_tile, "level 1 read {level1} B, less than the prefix once per tile {once_per_tile}");
    assert!(
        *level1 <= once_per_tile + once_per_tile / 8,
        "level 1 read {level1} B; the prefix once per tile is {once_per_tile} B"
    );
    let total: u64 = ran.reads.iter().map(|r| r.1).sum();
    assert!(
        total * 3 < per_request,
        "the call read {total} B; per-request reading of the prefix alone is {per_request} B"
    );

    // The result depends on the prefix: the reference without it (the suffixes alone) rejects it.
    let suffix_only = reference(&sp.suffix, &sp.suffix_inputs);
    assert!(!verify_decode(&p, &ran.o, &ran.lse, &suffix_only).passed, "the output does not depend on the prefix");
}

/// Options the prefix carries (sinks, counted once), speculative decoding with appended tokens
/// (causal, seq_q 3), f32 on the SIMT kernel and f16 on tensor cores, forced and chosen splits,
/// contiguous and paged suffix caches.
#[test]
fn sinks_new_tokens_and_seq_q_above_one_match_the_reference() {
    let kernels = Kernels::vm().unwrap();
    let base = DecodeProblem {
        batch: 5,
        heads: 4,
        heads_kv: 2,
        head_dim: 64,
        seq_q: 3,
        seq_new: 2,
        cache_seqlens: vec![70, 301, 66, 129, 65],
        causal: true,
        sinks: true,
        ..DecodeProblem::default()
    };
    for (p, splits) in [
        (base.clone(), Some(3)),
        (DecodeProblem { dtype: Dtype::F16, ..base.clone() }, None),
        (DecodeProblem { dtype: Dtype::Bf16, causal: false, sinks: false, seq_new: 0, ..base.clone() }, Some(1)),
    ] {
        let mut x = DecodeInputs::random(&p, 3);
        let mut sp = SharedPrefix::split(&p, &mut x, 65).unwrap();
        let ran = run(&kernels, &p, &sp, splits);
        let r = reference(&p, &x);
        let v = verify_decode(&p, &ran.o, &ran.lse, &r);
        assert!(v.passed && v.unwritten == 0, "{p:?}: {:?}", v.failures);
        // The suffixes in pages of 16 (shuffled; the appended tokens go through the block table).
        let (suffix, mut paged) = sp.suffix_inputs.relaid(&sp.suffix, Some(16), 5);
        paged.sinks = sp.suffix_inputs.sinks.clone();
        (sp.suffix, sp.suffix_inputs) = (suffix, paged);
        let ran = run(&kernels, &p, &sp, splits);
        let v = verify_decode(&p, &ran.o, &ran.lse, &r);
        assert!(v.passed && v.unwritten == 0, "{p:?}, paged suffix: {:?}", v.failures);
    }
}

#[test]
fn bad_input_is_refused_with_the_rule() {
    let p = DecodeProblem {
        batch: 2,
        heads: 4,
        heads_kv: 2,
        seq_q: 1,
        cache_seqlens: vec![10, 4],
        ..DecodeProblem::default()
    };
    let mut x = DecodeInputs::random(&p, 1);
    let err = SharedPrefix::split(&p, &mut x, 5).unwrap_err();
    assert_eq!(err, KvCacheRule::SharedPrefixLength { prefix: 5, batch: 1, cache_seqlen: 4 });
    assert!(err.to_string().contains("sequence 1 caches only 4 keys"), "{err}");
    let err = SharedPrefix::split(&p, &mut x, 0).unwrap_err();
    assert!(err.to_string().contains("at least 1"), "{err}");
    let windowed = DecodeProblem { window_left: 3, ..p.clone() };
    assert!(matches!(SharedPrefix::split(&windowed, &mut x, 2), Err(KvCacheRule::SharedPrefixOption { .. })));

    // The library call: a prefix of the wrong shape, an option it does not take, and a causal
    // call whose suffix is too short for the query to see the whole prefix.
    let kernels = Kernels::vm().unwrap();
    let (b, sq, h, hk, d) = (2usize, 3usize, 4usize, 2usize, 64usize);
    let buf = |n: usize| kernels.vm_upload(&vec![0.5; n]).unwrap();
    let (qb, pk, kc, vc, ob, lb) = (
        buf(b * sq * h * d),
        buf(8 * hk * d),
        buf(b * 8 * hk * d),
        buf(b * 8 * hk * d),
        buf(b * sq * h * d),
        buf(b * h * sq),
    );
    let call = |prefix_shape: [usize; 4], lens: &[u32], opts: &AttnOpts<'_>| {
        let seqlens = kernels.index_tensor(lens, None).unwrap();
        kernels.flash_attn_with_shared_prefix_into(
            &TensorView::vm(&qb, Dtype::F32, [b, sq, h, d]).unwrap(),
            &TensorView::vm(&pk, Dtype::F32, prefix_shape).unwrap(),
            &TensorView::vm(&pk, Dtype::F32, prefix_shape).unwrap(),
            &mut TensorViewMut::vm(&kc, Dtype::F32, [b, 8, hk, d]).unwrap(),
            &mut TensorViewMut::vm(&vc, Dtype::F32, [b, 8, hk, d]).unwrap(),
            None,
            None,
            &seqlens,
            None,
            &mut TensorViewMut::vm(&ob, Dtype::F32, [b, sq, h, d]).unwrap(),
            &mut LseViewMut::vm(&lb, b, h, sq).unwrap(),
            opts,
        )
    };
    let causal = AttnOpts::new().causal(true);
    for shape in [[1, 8, 1, d], [2, 4, hk, d], [1, 0, hk, d], [1, 8, hk, 32]] {
        let err = call(shape, &[4, 4], &causal).unwrap_err();
        assert!(
            matches!(err, AttnError::KvCache { why: KvCacheRule::SharedPrefixShape { got, .. } } if got == shape),
            "{shape:?}: {err}"
        );
    }
    let err = call([1, 8, hk, d], &[4, 4], &AttnOpts::new().window_size(3, 0)).unwrap_err();
    assert!(matches!(err, AttnError::KvCache { why: KvCacheRule::SharedPrefixOption { option: "a window" } }), "{err}");
    let err = call([1, 8, hk, d], &[4, 1], &causal).unwrap_err();
    assert_eq!(err, AttnError::KvCache { why: KvCacheRule::SharedPrefixCausal { batch: 1, suffix_keys: 1, seq_q: 3 } });
    assert!(err.to_string().contains("at least seq_q - 1 = 2"), "{err}");
    // Two suffix keys are enough for three query tokens; the outputs may not overlap the inputs.
    call([1, 8, hk, d], &[4, 2], &causal).unwrap();
    let alias = kernels.flash_attn_with_shared_prefix_into(
        &TensorView::vm(&qb, Dtype::F32, [b, sq, h, d]).unwrap(),
        &TensorView::vm(&pk, Dtype::F32, [1, 8, hk, d]).unwrap(),
        &TensorView::vm(&pk, Dtype::F32, [1, 8, hk, d]).unwrap(),
        &mut TensorViewMut::vm(&kc, Dtype::F32, [b, 8, hk, d]).unwrap(),
        &mut TensorViewMut::vm(&vc, Dtype::F32, [b, 8, hk, d]).unwrap(),
        None,
        None,
        &kernels.index_tensor(&[4, 4], None).unwrap(),
        None,
        &mut TensorViewMut::vm(&qb, Dtype::F32, [b, sq, h, d]).unwrap(),
        &mut LseViewMut::vm(&lb, b, h, sq).unwrap(),
        &causal,
    );
    assert!(matches!(alias, Err(AttnError::Aliasing { .. })), "{alias:?}");
}
