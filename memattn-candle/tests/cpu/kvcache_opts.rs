//! `flash_attn_with_kvcache_opts`: FlashAttention-2's keyword arguments of `flash_attn_with_kvcache`
//! (window, soft cap, ALiBi, sinks, rotary with both pairings, `cache_batch_idx`, `cache_leftpad`)
//! through the candle op on CPU tensors (the PTX VM path), against `memattn::decode`'s f64
//! reference on the same inputs; and each option seen to matter.

use candle_core::{DType, Device, Tensor};
use memattn::decode::{reference, verify_decode, CacheLayout, DecodeInputs, DecodeProblem, Rotary, Splits};
use memattn::Dtype;
use memattn_candle::{flash_attn_with_kvcache_opts, KvCacheOpts};

fn candle_dtype(d: Dtype) -> DType {
    match d {
        Dtype::Bf16 => DType::BF16,
        Dtype::F16 => DType::F16,
        _ => DType::F32,
    }
}

/// Runs `p` with `x` through the candle op and checks O and LSE against the f64 reference.
/// Returns whether the result also passes the reference of `without` (the same call with one
/// option left out), which it must not.
fn case(p: &DecodeProblem, x: &DecodeInputs, without: Option<(&DecodeProblem, &DecodeInputs)>) {
    let dev = Device::Cpu;
    let dt = candle_dtype(p.dtype);
    let (b, sq, h, hk, d) =
        (p.batch as usize, p.seq_q as usize, p.heads as usize, p.heads_kv as usize, p.head_dim as usize);
    let t = |v: &[f32], shape: &[usize]| Tensor::from_vec(v.to_vec(), shape, &dev).unwrap().to_dtype(dt).unwrap();
    let cache_shape: Vec<usize> = match x.layout {
        CacheLayout::Contiguous { seq_cache } => {
            vec![x.k_cache.len() / (seq_cache as usize * hk * d), seq_cache as usize, hk, d]
        }
        CacheLayout::Paged { page_size, num_pages, .. } => vec![num_pages as usize, page_size as usize, hk, d],
    };
    let q = t(&x.q, &[b, sq, h, d]);
    let (kc, vc) = (t(&x.k_cache, &cache_shape), t(&x.v_cache, &cache_shape));
    let new = [b, p.seq_new as usize, hk, d];
    let (kn, vn) = (t(&x.k_new, &new), t(&x.v_new, &new));
    let seqlens = Tensor::from_vec(p.cache_seqlens.clone(), b, &dev).unwrap();
    let table = match x.layout {
        CacheLayout::Paged { max_pages, .. } => {
            Some(Tensor::from_vec(x.block_table.clone(), (b, max_pages as usize), &dev).unwrap())
        }
        CacheLayout::Contiguous { .. } => None,
    };
    let u32t = |v: &Option<Vec<u32>>| v.as_ref().map(|v| Tensor::from_vec(v.clone(), b, &dev).unwrap());
    let (slots, leftpad) = (u32t(&p.cache_batch_idx), u32t(&p.cache_leftpad));
    let f32t = |v: &[f32], shape: &[usize]| (!v.is_empty()).then(|| Tensor::from_vec(v.to_vec(), shape, &dev).unwrap());
    let sinks = f32t(&x.sinks, &[h]);
    let alibi_shape = if x.alibi_slopes.len() == h { vec![h] } else { vec![b, h] };
    let alibi = f32t(&x.alibi_slopes, &alibi_shape);
    let half = p.rotary.map_or(0, |r| r.dim as usize / 2);
    let rows = x.rotary_cos.len().checked_div(half).unwrap_or(0);
    let (cos, sin) =
        ((half > 0).then(|| t(&x.rotary_cos, &[rows, half])), (half > 0).then(|| t(&x.rotary_sin, &[rows, half])));
    let side = |w: i32| usize::try_from(w).ok();
    let opts = KvCacheOpts {
        window_size_left: side(p.window_left),
        window_size_right: side(p.window_right),
        softcap: (p.softcap > 0.0).then_some(p.softcap),
        rotary_cos: cos.as_ref(),
        rotary_sin: sin.as_ref(),
        rotary_interleaved: p.rotary.is_some_and(|r| r.interleaved),
        cache_batch_idx: slots.as_ref(),
        cache_leftpad: leftpad.as_ref(),
        alibi_slopes: alibi.as_ref(),
        sinks: sinks.as_ref(),
    };
    let splits = match p.splits {
        Splits::Fixed(n) => n as usize,
        Splits::Auto => 0,
    };
    let (o, lse) = flash_attn_with_kvcache_opts(
        &q,
        &kc,
        &vc,
        Some(&kn),
        Some(&vn),
        &seqlens,
        table.as_ref(),
        p.softmax_scale(),
        p.causal,
        splits,
        &opts,
    )
    .unwrap_or_else(|e| panic!("{p:?}: {e}"));
    let o = o.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
    let lse = lse.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let v = verify_decode(p, &o, &lse, &reference(p, x));
    assert!(v.passed, "{p:?}: {:?}", v.failures);
    if let Some((p0, x0)) = without {
        assert!(!verify_decode(p0, &o, &lse, &reference(p0, x0)).passed, "{p:?}: the option changed nothing");
    }
}

#[test]
fn every_keyword_argument_matches_the_f64_reference() {
    let base = DecodeProblem {
        batch: 3,
        heads: 8,
        heads_kv: 2,
        head_dim: 64,
        seq_q: 2,
        cache_seqlens: vec![40, 3, 77],
        seq_new: 2,
        splits: Splits::Fixed(3),
        ..DecodeProblem::default()
    };
    // Contiguous: slots (a permutation of 5), left padding, rotary (GPT-NeoX, partial), window,
    // soft cap, sinks and ALiBi per sequence, f32 and bf16.
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let p = DecodeProblem {
            dtype,
            cache_batch_idx: Some(vec![4, 0, 2]),
            cache_leftpad: Some(vec![5, 0, 11]),
            rotary: Some(Rotary { dim: 32, interleaved: false }),
            window_left: 30,
            softcap: 20.0,
            sinks: true,
            alibi: true,
            ..base.clone()
        };
        let mut x = DecodeInputs::random(&p, 3);
        x.alibi_slopes = (0..24).map(|i| 0.004 * (i + 1) as f32).collect();
        // Without ALiBi's bias the reference is another one.
        let p0 = DecodeProblem { alibi: false, ..p.clone() };
        let x0 = DecodeInputs { alibi_slopes: vec![], ..x.clone() };
        case(&p, &x, Some((&p0, &x0)));
    }
    // Paged (page 7): GPT-J rotary, window on both sides, sinks, the paper's slopes.
    let p = DecodeProblem {
        page_size: Some(7),
        rotary: Some(Rotary { dim: 64, interleaved: true }),
        window_left: 20,
        window_right: 3,
        causal: false,
        sinks: true,
        alibi: true,
        dtype: Dtype::F16,
        ..base.clone()
    };
    let x = DecodeInputs::random(&p, 4);
    let p0 = DecodeProblem { rotary: Some(Rotary { dim: 64, interleaved: false }), ..p.clone() };
    case(&p, &x, Some((&p0, &x)));
}

#[test]
fn option_tensors_of_the_wrong_kind_are_refused() {
    let dev = Device::Cpu;
    let q = Tensor::zeros((1, 1, 2, 64), DType::F32, &dev).unwrap();
    let kc = Tensor::zeros((1, 8, 2, 64), DType::F32, &dev).unwrap();
    let seqlens = Tensor::from_vec(vec![4u32], 1, &dev).unwrap();
    let run = |o: &KvCacheOpts| {
        flash_attn_with_kvcache_opts(&q, &kc, &kc.copy().unwrap(), None, None, &seqlens, None, 0.125, true, 0, o)
            .unwrap_err()
            .to_string()
    };
    let bad = Tensor::zeros(2, DType::BF16, &dev).unwrap();
    assert!(
        run(&KvCacheOpts { sinks: Some(&bad), ..Default::default() }).contains("sinks must be a 1-d or 2-d f32 tensor")
    );
    let cos = Tensor::zeros((8, 16), DType::F32, &dev).unwrap();
    assert!(run(&KvCacheOpts { rotary_cos: Some(&cos), ..Default::default() }).contains("come together"));
    let slots = Tensor::from_vec(vec![0i64], 1, &dev).unwrap();
    assert!(run(&KvCacheOpts { cache_batch_idx: Some(&slots), ..Default::default() })
        .contains("cache_batch_idx must be a 1-d u32"));
    // The library's own rules name the option: three slopes for two heads.
    let slopes = Tensor::from_vec(vec![0.1f32; 3], 3, &dev).unwrap();
    let e = run(&KvCacheOpts { alibi_slopes: Some(&slopes), ..Default::default() });
    assert!(e.contains("3 slopes per sequence for q's 2 heads"), "{e}");
}
