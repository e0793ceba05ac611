//! A varlen (packed) batch with memattn's attention API: 4 sequences of 60, 37, 0 and 1 queries
//! over 90, 37, 5 and 1 keys (a chunked prefill next to a fresh prompt, an empty slot and a
//! decode step), packed as `[total, heads, head_dim]` without padding, causal per sequence
//! (bottom-right aligned), 8 query heads over 2 KV heads, head dim 128, bf16, checked against
//! the f64 reference.
//!
//! `cargo run --example varlen_batch` runs it in the PTX VM (no GPU needed); `-- --cuda` runs the
//! same call through cudarc on the GPU's primary context and a stream of its own
//! (`MEMATTN_CUDA_DRIVER=path/to/libvm_cuda.so` runs that path in the VM too).
//! Exit code 0: verified; 1: a result differs from the reference; 3: a device error.

use half::bf16;
use memattn::attn::{AttnOpts, Kernels, LseViewMut, TensorView, TensorViewMut};
use memattn::problem::Varlen;
use memattn::{reference, Dtype, Problem};
use std::process::ExitCode;

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

fn run(cuda: bool) -> Result<bool, Box<dyn std::error::Error>> {
    let (lens_q, lens_kv) = ([60u32, 37, 0, 1], [90u32, 37, 5, 1]);
    let (h, hk, d) = (8usize, 2usize, 128usize);
    // cu_seqlens: prefix sums, first 0 (FlashAttention's layout).
    let (cu_q, cu_kv) = (Varlen::cu(&lens_q), Varlen::cu(&lens_kv));
    let (total_q, total_kv) = (*cu_q.last().unwrap() as usize, *cu_kv.last().unwrap() as usize);
    let (max_q, max_kv) = (*lens_q.iter().max().unwrap() as usize, *lens_kv.iter().max().unwrap() as usize);
    // Inputs, rounded to bf16 so the reference sees what the device sees.
    let draw = |n: usize, seed: usize| -> Vec<f32> {
        (0..n).map(|i| bf16::from_f32((((i + seed) * 2654435761) % 1000) as f32 / 500.0 - 1.0).to_f32()).collect()
    };
    let (q, k, v) = (draw(total_q * h * d, 1), draw(total_kv * hk * d, 2), draw(total_kv * hk * d, 3));
    let (qs, ks) = ([1, total_q, h, d], [1, total_kv, hk, d]); // packed: batch 1
    let opts = AttnOpts::new().causal(true);

    let (o, lse) = if cuda {
        let ctx = memattn::attn::cuda_context(0)?;
        let stream = ctx.new_stream()?;
        let kernels = Kernels::cuda(&ctx)?;
        let to_bf16 = |x: &[f32]| x.iter().map(|&f| bf16::from_f32(f)).collect::<Vec<_>>();
        let (qd, kd, vd) =
            (stream.clone_htod(&to_bf16(&q))?, stream.clone_htod(&to_bf16(&k))?, stream.clone_htod(&to_bf16(&v))?);
        let (cq, ck) = (kernels.index_tensor(&cu_q, Some(&stream))?, kernels.index_tensor(&cu_kv, Some(&stream))?);
        let mut od = stream.alloc_zeros::<bf16>(q.len())?;
        let mut ld = stream.alloc_zeros::<f32>(h * total_q)?;
        kernels.flash_attn_varlen_into(
            &TensorView::cuda(&qd, &stream, qs)?,
            &TensorView::cuda(&kd, &stream, ks)?,
            &TensorView::cuda(&vd, &stream, ks)?,
            &cq,
            &ck,
            max_q,
            max_kv,
            &mut TensorViewMut::cuda(&mut od, &stream, qs)?,
            &mut LseViewMut::cuda(&mut ld, &stream, 1, h, total_q)?,
            &opts,
        )?;
        let o: Vec<f32> = stream.clone_dtoh(&od)?.iter().map(|x| x.to_f32()).collect();
        (o, stream.clone_dtoh(&ld)?)
    } else {
        let kernels = Kernels::vm()?;
        let up = |x: &[f32]| kernels.vm_upload_as(Dtype::Bf16, x);
        let (qb, kb, vb) = (up(&q)?, up(&k)?, up(&v)?);
        let (cq, ck) = (kernels.index_tensor(&cu_q, None)?, kernels.index_tensor(&cu_kv, None)?);
        let (o, lse) = kernels.flash_attn_varlen(
            &TensorView::vm(&qb, Dtype::Bf16, qs)?,
            &TensorView::vm(&kb, Dtype::Bf16, ks)?,
            &TensorView::vm(&vb, Dtype::Bf16, ks)?,
            &cq,
            &ck,
            max_q,
            max_kv,
            &opts,
        )?;
        (o.to_vec_f32()?, lse.to_vec_f32()?)
    };

    let base = Problem {
        heads: h as u32,
        heads_kv: Some(hk as u32),
        head_dim: d as u32,
        causal: true,
        dtype: Dtype::Bf16,
        ..Problem::default()
    };
    let p = Problem::varlen(base, &lens_q, &lens_kv)?;
    let (ro, rl) = reference::attention_with_sinks(&p, &q, &k, &v, &[])?; // o packed, lse [heads, total_q]
    let o_err = o.iter().zip(&ro).map(|(&a, &r)| (a as f64 - r).abs()).fold(0.0, f64::max);
    let lse_err =
        lse.iter().zip(&rl).filter(|(_, r)| r.is_finite()).map(|(&a, &r)| (a as f64 - r).abs()).fold(0.0, f64::max);
    let inf_ok = lse.iter().zip(&rl).all(|(&a, &r)| r.is_finite() || a == f32::NEG_INFINITY);
    let ok = o_err < 2e-2 && lse_err < 1e-3 && inf_ok;
    println!(
        "varlen causal batch on {}: {} sequences, q lengths {lens_q:?}, k/v lengths {lens_kv:?}, {h} q heads / {hk} KV heads, d {d}, bf16: max |o - ref| = {o_err:.2e}, max |lse - ref| = {lse_err:.2e}: {}",
        if cuda { "CUDA" } else { "the PTX VM" },
        lens_q.len(),
        if ok { "ok" } else { "MISMATCH" }
    );
    Ok(ok)
}
