//! A 20-step decode loop through `flash_attn_with_kvcache_opts`, as an engine runs it: each step
//! appends one token per sequence into a paged bf16 cache in place (GQA 4/2, a left window, a
//! soft cap), advances `cache_seqlens` with a tensor op, and its O is checked against attention
//! written with candle's own ops over every key appended so far. At the end the paged cache,
//! gathered through the block table, holds exactly the appended keys and values.

use crate::common::candle_decode_attention;
use candle_core::{DType, Device, IndexOp, Tensor};
use memattn_candle::{check_kv_status, flash_attn_with_kvcache_opts, KvCacheOpts};

#[test]
fn twenty_decode_steps_match_candle_ops_attention() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let (b, h, hk, d, page, pages_per_seq, steps) = (2usize, 4usize, 2usize, 64usize, 8usize, 4usize, 20usize);
    let (window, softcap) = (9usize, 5.0f32);
    let scale = 1.0 / (d as f64).sqrt();
    let start = [3u32, 7];
    let num_pages = b * pages_per_seq;
    // Sequence 0 owns pages 7, 5, 3, 1; sequence 1 pages 0, 2, 4, 6.
    let table: Vec<u32> = vec![7, 5, 3, 1, 0, 2, 4, 6];
    let block_table = Tensor::from_vec(table.clone(), (b, pages_per_seq), &dev)?;
    let k_cache = Tensor::zeros((num_pages, page, hk, d), DType::BF16, &dev)?;
    let v_cache = Tensor::zeros((num_pages, page, hk, d), DType::BF16, &dev)?;
    // The keys and values each sequence holds, [n, hk, d] f32 (bf16-rounded).
    let mut keys: Vec<Tensor> = Vec::new();
    let mut vals: Vec<Tensor> = Vec::new();
    let mut cache_seqlens = Tensor::new(&[0u32, 0], &dev)?;
    for _ in 0..b {
        keys.push(Tensor::zeros((0, hk, d), DType::F32, &dev)?);
        vals.push(Tensor::zeros((0, hk, d), DType::F32, &dev)?);
    }
    // The prompts go in through the op itself, a token per call: both sequences for the first
    // start[0] calls, then sequence 1 alone (a batch of one, its row of the block table) until
    // it holds start[1]; then `steps` decode calls of both.
    let mut worst = 0f32;
    let total_steps = start[1] as usize + steps;
    for t in 0..total_steps {
        let q = Tensor::randn(0f32, 1.0, (b, 1, h, d), &dev)?.to_dtype(DType::BF16)?;
        let kn = Tensor::randn(0f32, 1.0, (b, 1, hk, d), &dev)?.to_dtype(DType::BF16)?;
        let vn = Tensor::randn(0f32, 1.0, (b, 1, hk, d), &dev)?.to_dtype(DType::BF16)?;
        let prompt = t < start[1] as usize;
        let opts = KvCacheOpts { window_size_left: Some(window), softcap: Some(softcap), ..Default::default() };
        let (o, _lse) = if prompt && t >= start[0] as usize {
            // Only sequence 1 appends: a batch of one with its own row of the block table.
            let (o, lse) = flash_attn_with_kvcache_opts(
                &q.i(1..2)?,
                &k_cache,
                &v_cache,
                Some(&kn.i(1..2)?),
                Some(&vn.i(1..2)?),
                &cache_seqlens.i(1..2)?,
                Some(&block_table.i(1..2)?),
                scale as f32,
                true,
                0,
                &opts,
            )?;
            keys[1] = Tensor::cat(&[&keys[1], &kn.i((1, 0))?.to_dtype(DType::F32)?.unsqueeze(0)?], 0)?;
            vals[1] = Tensor::cat(&[&vals[1], &vn.i((1, 0))?.to_dtype(DType::F32)?.unsqueeze(0)?], 0)?;
            let one = Tensor::new(&[0u32, 1], &dev)?;
            cache_seqlens = cache_seqlens.broadcast_add(&one)?;
            let want = candle_decode_attention(
                &q.i(1)?.to_dtype(DType::F32)?,
                &keys[1],
                &vals[1],
                scale,
                window,
                softcap as f64,
            )?;
            worst = worst.max(diff(&o.i(0)?, &want)?);
            (o, lse)
        } else {
            let (o, lse) = flash_attn_with_kvcache_opts(
                &q,
                &k_cache,
                &v_cache,
                Some(&kn),
                Some(&vn),
                &cache_seqlens,
                Some(&block_table),
                scale as f32,
                true,
                0,
                &opts,
            )?;
            for s in 0..b {
                keys[s] = Tensor::cat(&[&keys[s], &kn.i((s, 0))?.to_dtype(DType::F32)?.unsqueeze(0)?], 0)?;
                vals[s] = Tensor::cat(&[&vals[s], &vn.i((s, 0))?.to_dtype(DType::F32)?.unsqueeze(0)?], 0)?;
                let want = candle_decode_attention(
                    &q.i(s)?.to_dtype(DType::F32)?,
                    &keys[s],
                    &vals[s],
                    scale,
                    window,
                    softcap as f64,
                )?;
                worst = worst.max(diff(&o.i(s)?, &want)?);
            }
            cache_seqlens = (cache_seqlens + 1.0)?;
            (o, lse)
        };
        assert!(worst < 2e-2, "call {t}: |O - candle ops| = {worst}");
        assert_eq!(o.dims()[1..], [1, h, d]);
    }
    check_kv_status(&dev)?;
    // The lengths advanced by tensor ops match the keys appended.
    let lens = cache_seqlens.to_vec1::<u32>()?;
    assert_eq!(lens, vec![start[0] + steps as u32, start[1] + steps as u32]);
    // The cache, gathered through the block table, holds exactly the appended rows.
    for s in 0..b {
        let n = lens[s] as usize;
        let rows: Vec<u32> =
            (0..n).map(|j| table[s * pages_per_seq + j / page] * page as u32 + (j % page) as u32).collect();
        let idx = Tensor::from_vec(rows, n, &dev)?;
        for (cache, want) in [(&k_cache, &keys[s]), (&v_cache, &vals[s])] {
            let got = cache.reshape((num_pages * page, hk, d))?.index_select(&idx, 0)?.to_dtype(DType::F32)?;
            assert_eq!(diff(&got, want)?, 0.0, "sequence {s}: the cache holds the appended rows");
        }
    }
    eprintln!("{total_steps} calls ({steps} decode steps of both sequences): worst |O - candle ops| {worst:.2e}");
    Ok(())
}

fn diff(a: &Tensor, b: &Tensor) -> candle_core::Result<f32> {
    (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}
