//! Grouped-query decode over a paged KV cache with memattn's attention API: 3 sequences holding
//! 37, 5 and 64 tokens in 16-token pages (scattered over the cache), 8 query heads sharing 2 KV
//! heads, head dim 64, bf16. Two decode steps: each appends one new token per sequence to the
//! cache (`k_new`, `v_new`) and attends over the cache with 3 KV splits (flash-decoding); the caller advances `cache_seqlens`, as with FlashAttention. Each step is checked
//! against the f64 reference run on each sequence's keys gathered in order.
//!
//! `cargo run --example gqa_decode_paged` runs it in the PTX VM (no GPU needed);
//! `-- --cuda` runs the same calls through cudarc on the GPU's primary context and a stream of
//! its own (`MEMATTN_CUDA_DRIVER=path/to/libvm_cuda.so` runs that path in the VM too).
//! Exit code 0: verified; 1: a result differs from the reference; 3: a device error.

use half::bf16;
use memattn::attn::{AttnOpts, Kernels, TensorView, TensorViewMut};
use memattn::{reference, Dtype, Problem};
use std::process::ExitCode;

const HEADS: usize = 8;
const HEADS_KV: usize = 2;
const D: usize = 64;
const PAGE: usize = 16;
const STEPS: usize = 2;

fn main() -> ExitCode {
    match run(std::env::args().any(|a| a == "--cuda")) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(3)
        }
    }
}

/// Deterministic values in [-1, 1), rounded to bf16 so the reference sees what the device sees.
fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| bf16::from_f32((((i + seed) * 2654435761) % 1000) as f32 / 500.0 - 1.0).to_f32()).collect()
}

fn run(cuda: bool) -> Result<bool, Box<dyn std::error::Error>> {
    let lens0 = [37usize, 5, 64];
    let b = lens0.len();
    let row = HEADS_KV * D; // one token of one sequence in the cache
                            // Pages for every token the sequences will hold after the last step, in a scattered order.
    let pages_per_seq: Vec<usize> = lens0.iter().map(|l| (l + STEPS).div_ceil(PAGE)).collect();
    let max_pages = *pages_per_seq.iter().max().unwrap();
    let num_pages = pages_per_seq.iter().sum::<usize>() + 1; // one spare page
    let mut order: Vec<u32> = (0..num_pages as u32).collect();
    order.reverse();
    order.rotate_left(2);
    let mut block_table = vec![0u32; b * max_pages];
    let mut next = 0;
    for (s, &n) in pages_per_seq.iter().enumerate() {
        for slot in 0..n {
            block_table[s * max_pages + slot] = order[next];
            next += 1;
        }
    }
    let at = |s: usize, j: usize| (block_table[s * max_pages + j / PAGE] as usize * PAGE + j % PAGE) * row;
    // The sequences' keys and values (the host's own copy, for the reference), and the paged cache.
    let mut seq_k: Vec<Vec<f32>> = lens0.iter().enumerate().map(|(s, &l)| values(l * row, 10 + s)).collect();
    let mut seq_v: Vec<Vec<f32>> = lens0.iter().enumerate().map(|(s, &l)| values(l * row, 20 + s)).collect();
    let (mut k_cache, mut v_cache) = (vec![0f32; num_pages * PAGE * row], vec![0f32; num_pages * PAGE * row]);
    for s in 0..b {
        for j in 0..lens0[s] {
            k_cache[at(s, j)..][..row].copy_from_slice(&seq_k[s][j * row..][..row]);
            v_cache[at(s, j)..][..row].copy_from_slice(&seq_v[s][j * row..][..row]);
        }
    }
    let cache_shape = [num_pages, PAGE, HEADS_KV, D];
    // 3 key splits (flash-decoding), combined on the device; without `num_splits` the library
    // chooses (FlashAttention-2's heuristic: 1 here, as no sequence fills a 256-key block).
    let opts = AttnOpts::new().causal(true).num_splits(3);

    let mut lens = lens0.to_vec();
    let mut all_ok = true;
    // Device state: the kernels and the cache live across the steps.
    let ctx_stream = if cuda {
        let ctx = memattn::attn::cuda_context(0)?;
        let stream = ctx.new_stream()?;
        Some((ctx, stream))
    } else {
        None
    };
    let kernels = match &ctx_stream {
        Some((ctx, _)) => Kernels::cuda(ctx)?,
        None => Kernels::vm()?,
    };
    let to_bf16 = |x: &[f32]| x.iter().map(|&f| bf16::from_f32(f)).collect::<Vec<_>>();
    let stream = ctx_stream.as_ref().map(|(_, s)| s.clone());
    // The cache, on the device.
    let (mut kc_dev, mut vc_dev) = match &stream {
        Some(st) => (Some(st.clone_htod(&to_bf16(&k_cache))?), Some(st.clone_htod(&to_bf16(&v_cache))?)),
        None => (None, None),
    };
    let (kc_vm, vc_vm) = match &stream {
        Some(_) => (None, None),
        None => {
            (Some(kernels.vm_upload_as(Dtype::Bf16, &k_cache)?), Some(kernels.vm_upload_as(Dtype::Bf16, &v_cache)?))
        }
    };
    let table = kernels.index_tensor(&block_table, stream.as_ref())?;

    for step in 0..STEPS {
        let q = values(b * HEADS * D, 100 + step);
        let k_new = values(b * row, 200 + step);
        let v_new = values(b * row, 300 + step);
        let seqlens: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
        let cache_seqlens = kernels.index_tensor(&seqlens, stream.as_ref())?;
        let (qs, ns) = ([b, 1, HEADS, D], [b, 1, HEADS_KV, D]);
        let (o, lse) = match &stream {
            Some(st) => {
                let (qd, knd, vnd) =
                    (st.clone_htod(&to_bf16(&q))?, st.clone_htod(&to_bf16(&k_new))?, st.clone_htod(&to_bf16(&v_new))?);
                let (kc, vc) = (kc_dev.as_mut().unwrap(), vc_dev.as_mut().unwrap());
                let (o, lse) = kernels.flash_attn_with_kvcache(
                    &TensorView::cuda(&qd, st, qs)?,
                    &mut TensorViewMut::cuda(kc, st, cache_shape)?,
                    &mut TensorViewMut::cuda(vc, st, cache_shape)?,
                    Some(&TensorView::cuda(&knd, st, ns)?),
                    Some(&TensorView::cuda(&vnd, st, ns)?),
                    &cache_seqlens,
                    Some(&table),
                    &opts,
                )?;
                (o.to_vec_f32()?, lse.to_vec_f32()?)
            }
            None => {
                let up = |x: &[f32]| kernels.vm_upload_as(Dtype::Bf16, x);
                let (qb, knb, vnb) = (up(&q)?, up(&k_new)?, up(&v_new)?);
                let (kc, vc) = (kc_vm.as_ref().unwrap(), vc_vm.as_ref().unwrap());
                let (o, lse) = kernels.flash_attn_with_kvcache(
                    &TensorView::vm(&qb, Dtype::Bf16, qs)?,
                    &mut TensorViewMut::vm(kc, Dtype::Bf16, cache_shape)?,
                    &mut TensorViewMut::vm(vc, Dtype::Bf16, cache_shape)?,
                    Some(&TensorView::vm(&knb, Dtype::Bf16, ns)?),
                    Some(&TensorView::vm(&vnb, Dtype::Bf16, ns)?),
                    &cache_seqlens,
                    Some(&table),
                    &opts,
                )?;
                (o.to_vec_f32()?, lse.to_vec_f32()?)
            }
        };
        // The reference: each sequence's keys so far plus its new token, one query, in f64.
        let (mut o_err, mut lse_err) = (0f64, 0f64);
        for s in 0..b {
            seq_k[s].extend_from_slice(&k_new[s * row..][..row]);
            seq_v[s].extend_from_slice(&v_new[s * row..][..row]);
            lens[s] += 1; // the caller advances cache_seqlens
            let p = Problem {
                batch: 1,
                heads: HEADS as u32,
                heads_kv: Some(HEADS_KV as u32),
                seq_q: 1,
                seq_kv: lens[s] as u32,
                head_dim: D as u32,
                causal: true,
                ..Problem::default()
            };
            let (ro, rl) = reference::attention(&p, &q[s * HEADS * D..][..HEADS * D], &seq_k[s], &seq_v[s])?;
            let got = &o[s * HEADS * D..][..HEADS * D];
            o_err = got.iter().zip(&ro).map(|(&a, &r)| (a as f64 - r).abs()).fold(o_err, f64::max);
            lse_err =
                lse[s * HEADS..][..HEADS].iter().zip(&rl).map(|(&a, &r)| (a as f64 - r).abs()).fold(lse_err, f64::max);
        }
        let ok = o_err < 2e-2 && lse_err < 1e-3;
        all_ok &= ok;
        println!(
            "step {step}: GQA decode on {}, {b} sequences of {:?} keys (paged, {PAGE}-token pages), {HEADS} q heads / {HEADS_KV} KV heads, bf16: max |o - ref| = {o_err:.2e}, max |lse - ref| = {lse_err:.2e}: {}",
            if cuda { "CUDA" } else { "the PTX VM" },
            lens,
            if ok { "ok" } else { "MISMATCH" }
        );
    }
    // The appended tokens are in the cache, at the pages the block table names.
    let cache_after: Vec<f32> = match (&stream, &kc_dev, &kc_vm) {
        (Some(st), Some(kc), _) => st.clone_dtoh(kc)?.iter().map(|x| x.to_f32()).collect(),
        (_, _, Some(kc)) => kc.read_f32(Dtype::Bf16, k_cache.len())?,
        _ => unreachable!("one of the two backends holds the cache"),
    };
    let appended_ok =
        (0..b).all(|s| (lens0[s]..lens[s]).all(|j| cache_after[at(s, j)..][..row] == seq_k[s][j * row..][..row]));
    println!("appended keys in the paged cache: {}", if appended_ok { "ok" } else { "MISMATCH" });
    Ok(all_ok && appended_ok)
}
