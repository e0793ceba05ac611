//! `flash_attn_with_kvcache` with new tokens, on candle CPU tensors (the PTX VM path): O and LSE
//! against `memattn::decode`'s f64 reference over the cached keys followed by the new ones, and
//! the caller's caches after the call, bit for bit: the appended rows hold `k`/`v`, every other
//! element is unchanged.

use candle_core::{DType, Device, IndexOp, Tensor};
use memattn::decode::{reference, verify_decode, CacheLayout, DecodeInputs, DecodeProblem, Splits};
use memattn::Dtype;

fn candle_dtype(d: Dtype) -> DType {
    match d {
        Dtype::Bf16 => DType::BF16,
        Dtype::F16 => DType::F16,
        _ => DType::F32,
    }
}

/// The elements as f32 bit patterns (bf16 and f16 widen exactly, so equal bits mean equal
/// 16-bit values; NaN poison compares by its bits too).
fn bits(t: &Tensor) -> Vec<u32> {
    let v = t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
    v.iter().map(|x| x.to_bits()).collect()
}

/// The cache row (of `[rows, heads_kv * head_dim]`) that holds token `j` of sequence `b`,
/// from the layout's definition: `b * seq_cache + j` contiguous, or page
/// `block_table[b][j / page_size]`, slot `j % page_size`.
fn cache_row(x: &DecodeInputs, b: usize, j: usize) -> usize {
    match x.layout {
        CacheLayout::Contiguous { seq_cache } => b * seq_cache as usize + j,
        CacheLayout::Paged { page_size, max_pages, .. } => {
            let ps = page_size as usize;
            x.block_table[b * max_pages as usize + j / ps] as usize * ps + j % ps
        }
    }
}

struct Case {
    x: DecodeInputs,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor,
    v: Tensor,
    seqlens: Tensor,
    table: Option<Tensor>,
}

fn tensors(p: &DecodeProblem, seed: u64) -> Case {
    let x = DecodeInputs::random(p, seed);
    let dev = Device::Cpu;
    let dt = candle_dtype(p.dtype);
    let (b, sq, h, hk, d) =
        (p.batch as usize, p.seq_q as usize, p.heads as usize, p.heads_kv as usize, p.head_dim as usize);
    let t = |v: &[f32], shape: (usize, usize, usize, usize)| {
        Tensor::from_slice(v, shape, &dev).unwrap().to_dtype(dt).unwrap()
    };
    let cache_shape = match x.layout {
        CacheLayout::Contiguous { seq_cache } => (b, seq_cache as usize, hk, d),
        CacheLayout::Paged { page_size, num_pages, .. } => (num_pages as usize, page_size as usize, hk, d),
    };
    let new_shape = (b, p.seq_new as usize, hk, d);
    let table = match x.layout {
        CacheLayout::Paged { max_pages, .. } => {
            Some(Tensor::from_slice(&x.block_table, (b, max_pages as usize), &dev).unwrap())
        }
        CacheLayout::Contiguous { .. } => None,
    };
    Case {
        q: t(&x.q, (b, sq, h, d)),
        k_cache: t(&x.k_cache, cache_shape),
        v_cache: t(&x.v_cache, cache_shape),
        k: t(&x.k_new, new_shape),
        v: t(&x.v_new, new_shape),
        seqlens: Tensor::new(p.cache_seqlens.as_slice(), &dev).unwrap(),
        table,
        x,
    }
}

/// One call with new tokens: O and LSE against the f64 reference (cache rows at and past
/// `cache_seqlens` are NaN before the call, so attending before the append fails), then both
/// caches against their contents before the call with the new rows put in by hand. `joint`:
/// the caches are the two halves of one tensor `[2, ...cache shape]` (vLLM's joint layout,
/// `kv.i(0)` and `kv.i(1)`: one storage).
fn append_case(p: &DecodeProblem, num_splits: usize, joint: bool) {
    let mut c = tensors(p, 11);
    let mut kv = None;
    if joint {
        let t = Tensor::stack(&[&c.k_cache, &c.v_cache], 0).unwrap();
        (c.k_cache, c.v_cache) = (t.i(0).unwrap(), t.i(1).unwrap());
        assert_eq!(c.v_cache.layout().start_offset(), c.k_cache.elem_count());
        kv = Some(t);
    }
    let (k_before, v_before) = (bits(&c.k_cache), bits(&c.v_cache));
    let (o, lse) = memattn_candle::flash_attn_with_kvcache_with_lse(
        &c.q,
        &c.k_cache,
        &c.v_cache,
        Some(&c.k),
        Some(&c.v),
        &c.seqlens,
        c.table.as_ref(),
        p.softmax_scale(),
        p.causal,
        num_splits,
    )
    .unwrap();
    let (b, sq, h) = (p.batch as usize, p.seq_q as usize, p.heads as usize);
    assert_eq!((o.dims(), o.dtype()), (c.q.dims(), c.q.dtype()));
    assert_eq!((lse.dims(), lse.dtype()), (&[b, h, sq][..], DType::F32));
    let o = o.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
    let lse = lse.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let v = verify_decode(p, &o, &lse, &reference(p, &c.x));
    println!(
        "{} {:?} lens {:?} + {} new, {}/{} heads, splits {num_splits}: O scaled err {:.2e}, LSE err {:.2e}",
        p.dtype, c.x.layout, p.cache_seqlens, p.seq_new, p.heads, p.heads_kv, v.o_max_scaled_err, v.lse_max_abs_err
    );
    assert!(v.passed, "{:?}", v.failures);

    let row = (p.heads_kv * p.head_dim) as usize;
    let (k_new, v_new) = (bits(&c.k), bits(&c.v));
    let (mut k_want, mut v_want) = (k_before, v_before);
    for s in 0..b {
        for t in 0..p.seq_new as usize {
            let at = cache_row(&c.x, s, p.cache_seqlens[s] as usize + t) * row;
            let from = (s * p.seq_new as usize + t) * row;
            k_want[at..at + row].copy_from_slice(&k_new[from..from + row]);
            v_want[at..at + row].copy_from_slice(&v_new[from..from + row]);
        }
    }
    for (name, got, want) in [("k_cache", bits(&c.k_cache), k_want), ("v_cache", bits(&c.v_cache), v_want)] {
        let bad: Vec<usize> =
            (0..got.len() / row).filter(|r| got[r * row..][..row] != want[r * row..][..row]).collect();
        assert!(bad.is_empty(), "{name}: rows {bad:?} differ from the expected append");
    }
    if let Some(kv) = kv {
        // The one storage holds both appended caches (read through the joint tensor itself).
        let (k_after, v_after) = (bits(&kv.i(0).unwrap()), bits(&kv.i(1).unwrap()));
        assert!(k_after == bits(&c.k_cache) && v_after == bits(&c.v_cache), "the joint tensor after the append");
    }
}

#[test]
fn append_into_a_paged_gqa_cache_matches_the_reference() {
    // Pages of 7 keys (shuffled), GQA 8/2, 3 sequences of different lengths (one empty), 2 new
    // tokens each crossing page boundaries, 2 queries per sequence, causal, 3 KV splits.
    let p = DecodeProblem {
        batch: 3,
        heads: 8,
        heads_kv: 2,
        seq_q: 2,
        cache_seqlens: vec![13, 0, 20],
        seq_new: 2,
        page_size: Some(7),
        splits: Splits::Fixed(3),
        ..DecodeProblem::default()
    };
    append_case(&p, 3, false);
}

#[test]
fn append_into_a_contiguous_bf16_cache_matches_the_reference() {
    // bf16 (the tensor-core decode kernel), contiguous cache, MQA 4/1, 3 new tokens, not causal,
    // memattn's split choice.
    let p = DecodeProblem {
        batch: 2,
        heads: 4,
        heads_kv: 1,
        cache_seqlens: vec![37, 17],
        seq_new: 3,
        dtype: Dtype::Bf16,
        causal: false,
        ..DecodeProblem::default()
    };
    append_case(&p, 0, false);
}

#[test]
fn append_into_one_joint_kv_tensor_matches_the_reference() {
    // vLLM's layout: one [2, num_pages, page_size, heads_kv, head_dim] tensor, k_cache and
    // v_cache its halves (one storage). Paged (5-key pages, shuffled), GQA 4/2, 3 sequences (one
    // empty), 2 new tokens each, causal, 2 splits; then bf16 contiguous MQA.
    let p = DecodeProblem {
        batch: 3,
        heads: 4,
        heads_kv: 2,
        cache_seqlens: vec![9, 0, 12],
        seq_new: 2,
        page_size: Some(5),
        splits: Splits::Fixed(2),
        ..DecodeProblem::default()
    };
    append_case(&p, 2, true);
    let p = DecodeProblem {
        batch: 2,
        heads: 4,
        heads_kv: 1,
        cache_seqlens: vec![21, 6],
        seq_new: 3,
        dtype: Dtype::Bf16,
        ..DecodeProblem::default()
    };
    append_case(&p, 0, true);
}

/// Head dims padded to the next decode kernel's (40 on the tensor-core d64, 80 on the SIMT d96,
/// 160 on d192): only their columns of Q, O and the caches are read and written.
#[test]
fn append_at_padded_head_dims_matches_the_reference() {
    for (head_dim, dtype, page_size) in
        [(40, Dtype::Bf16, Some(7)), (80, Dtype::F32, None), (160, Dtype::F16, Some(16))]
    {
        let p = DecodeProblem {
            batch: 2,
            heads: 4,
            heads_kv: 2,
            head_dim,
            seq_q: 1,
            cache_seqlens: vec![13, 20],
            seq_new: 2,
            page_size,
            dtype,
            splits: Splits::Fixed(2),
            ..DecodeProblem::default()
        };
        append_case(&p, 2, false);
    }
}

#[test]
fn refused_calls_leave_the_caches_untouched() {
    let p = DecodeProblem {
        batch: 2,
        heads: 4,
        heads_kv: 2,
        cache_seqlens: vec![5, 9],
        seq_new: 1,
        page_size: Some(4),
        ..DecodeProblem::default()
    };
    let c = tensors(&p, 3);
    let (k_before, v_before) = (bits(&c.k_cache), bits(&c.v_cache));
    let call = |kc: &Tensor, vc: &Tensor, k: Option<&Tensor>, v: Option<&Tensor>, table: &Tensor| {
        memattn_candle::flash_attn_with_kvcache(&c.q, kc, vc, k, v, &c.seqlens, Some(table), 0.125, true, 0)
            .unwrap_err()
            .to_string()
    };
    let table = c.table.clone().unwrap();
    // A block-table entry past the cache's pages: checked before anything is written.
    let mut bad = c.x.block_table.clone();
    let last = bad.len() - 1;
    bad[last] = 99;
    let bad = Tensor::from_slice(&bad, table.dims(), &Device::Cpu).unwrap();
    let e = call(&c.k_cache, &c.v_cache, Some(&c.k), Some(&c.v), &bad);
    assert!(e.contains("= 99 is past num_pages"), "{e}");
    // New keys without new values.
    let e = call(&c.k_cache, &c.v_cache, Some(&c.k), None, &table);
    assert!(e.contains("v is missing while k is given"), "{e}");
    // One tensor as both caches (a clone shares the storage and every byte): memattn refuses
    // the overlap, naming the bytes the two share.
    let e = call(&c.k_cache, &c.k_cache.clone(), Some(&c.k), Some(&c.v), &table);
    let all = c.k_cache.elem_count() * 4;
    assert!(e.contains("k_cache (written") && e.contains(&format!("({all} bytes)")), "{e}");
    // Two views of one tensor that share a page: refused the same way, one page shared.
    let (pages, page) = (c.k_cache.dim(0).unwrap(), c.k_cache.dims()[1..].iter().product::<usize>());
    let big = Tensor::cat(&[&c.k_cache, &c.v_cache], 0).unwrap();
    let (k_over, v_over) = (big.narrow(0, 0, pages).unwrap(), big.narrow(0, pages - 1, pages).unwrap());
    let big_before = bits(&big);
    let err = memattn_candle::flash_attn_with_kvcache(
        &c.q,
        &k_over,
        &v_over,
        Some(&c.k),
        Some(&c.v),
        &c.seqlens,
        Some(&table),
        0.125,
        true,
        0,
    )
    .unwrap_err();
    match memattn_candle::attn_error(&err) {
        Some(memattn::attn::AttnError::Aliasing {
            why: memattn::attn::AliasRule::Overlap { written, other, written_bytes, other_bytes },
        }) => {
            assert_eq!((*written, *other), ("k_cache", "v_cache"), "{err}");
            let shared = written_bytes[1] - other_bytes[0];
            assert_eq!(shared, (page * 4) as u64, "{err}");
            assert!(err.to_string().contains(&format!("({shared} bytes)")), "{err}");
        }
        other => panic!("expected the overlap of k_cache and v_cache, found {other:?}: {err}"),
    }
    assert!(bits(&big) == big_before, "a refused call wrote the joint tensor");
    let e = call(&c.k_cache, &c.v_cache, Some(&c.v_cache), Some(&c.v), &table);
    assert!(e.contains("v_cache shares its storage with k"), "{e}");
    assert!(bits(&c.k_cache) == k_before && bits(&c.v_cache) == v_before, "a refused call wrote a cache");
}
