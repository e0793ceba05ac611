//! Dense causal prefill with memattn's attention API: batch 2, 4 heads, 100 tokens, head dim 64,
//! bf16, on the caller's buffers, checked against the f64 reference.
//!
//! `cargo run --example dense_prefill` runs it in the PTX VM (no GPU needed). On a machine with a
//! GPU, `cargo run --example dense_prefill -- --cuda` runs the same code through cudarc on the
//! GPU's primary context and a stream of its own (`MEMATTN_CUDA_DRIVER=path/to/libvm_cuda.so`
//! runs that path in the VM too).

use memattn::attn::{AttnOpts, Kernels, LseViewMut, TensorView, TensorViewMut};
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
    let (b, s, h, d) = (2usize, 100usize, 4usize, 64usize);
    let n = b * s * h * d;
    // Inputs, rounded to bf16 so the reference sees what the device sees.
    let mut x: Vec<f32> = (0..3 * n).map(|i| (((i * 2654435761) % 1000) as f32 / 500.0) - 1.0).collect();
    Dtype::Bf16.round_all(&mut x);
    let (q, rest) = x.split_at(n);
    let (k, v) = rest.split_at(n);
    let shape = [b, s, h, d];
    let opts = AttnOpts::new().causal(true);

    let (o, lse) = if cuda {
        let ctx = memattn::attn::cuda_context(0)?;
        let stream = ctx.new_stream()?;
        let kernels = Kernels::cuda(&ctx)?;
        let to_bf16 = |x: &[f32]| x.iter().map(|&f| half::bf16::from_f32(f)).collect::<Vec<_>>();
        let (qd, kd, vd) =
            (stream.clone_htod(&to_bf16(q))?, stream.clone_htod(&to_bf16(k))?, stream.clone_htod(&to_bf16(v))?);
        let mut od = stream.alloc_zeros::<half::bf16>(n)?;
        let mut ld = stream.alloc_zeros::<f32>(b * h * s)?;
        kernels.flash_attn_into(
            &TensorView::cuda(&qd, &stream, shape)?,
            &TensorView::cuda(&kd, &stream, shape)?,
            &TensorView::cuda(&vd, &stream, shape)?,
            &mut TensorViewMut::cuda(&mut od, &stream, shape)?,
            &mut LseViewMut::cuda(&mut ld, &stream, b, h, s)?,
            &opts,
        )?;
        let o: Vec<f32> = stream.clone_dtoh(&od)?.iter().map(|x| x.to_f32()).collect();
        (o, stream.clone_dtoh(&ld)?)
    } else {
        let kernels = Kernels::vm()?;
        let up = |x: &[f32]| kernels.vm_upload_as(Dtype::Bf16, x);
        let (qb, kb, vb) = (up(q)?, up(k)?, up(v)?);
        let view = |buf| TensorView::vm(buf, Dtype::Bf16, shape);
        let (o, lse) = kernels.flash_attn(&view(&qb)?, &view(&kb)?, &view(&vb)?, &opts)?;
        (o.to_vec_f32()?, lse.to_vec_f32()?)
    };

    let p = Problem {
        batch: b as u32,
        heads: h as u32,
        seq_q: s as u32,
        seq_kv: s as u32,
        head_dim: d as u32,
        causal: true,
        ..Problem::default()
    };
    let (ro, rl) = reference::attention(&p, q, k, v)?;
    let o_err = o.iter().zip(&ro).map(|(&a, &r)| (a as f64 - r).abs()).fold(0.0, f64::max);
    let lse_err = lse.iter().zip(&rl).map(|(&a, &r)| (a as f64 - r).abs()).fold(0.0, f64::max);
    let ok = o_err < 2e-2 && lse_err < 1e-3;
    println!(
        "dense causal prefill on {}: o {b}x{s}x{h}x{d} bf16, max |o - ref| = {o_err:.2e}, max |lse - ref| = {lse_err:.2e}: {}",
        if cuda { "CUDA" } else { "the PTX VM" },
        if ok { "ok" } else { "MISMATCH" }
    );
    Ok(ok)
}
