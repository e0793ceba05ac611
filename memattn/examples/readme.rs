// README.md's "Use from Rust" program (memattn/examples/readme.rs): bf16 causal attention on caller buffers.
// On a GPU: `cargo run --example readme`; without one, `MEMATTN_CUDA_DRIVER=target/debug/libvm_cuda.so`
// runs the same CUDA path in the PTX VM (build the driver with `cargo build -p memattn-vm-cuda`).
use half::bf16;
use memattn::attn::{cuda_context, AttnOpts, Kernels, LseViewMut, TensorView, TensorViewMut};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (batch, seq, heads) = (2, 100, 4);
    let shape = [batch, seq, heads, 64]; // [b, s, h, d]; .with_strides(..) for BHSD or others
    let n = batch * seq * heads * 64;
    let x: Vec<bf16> = (0..3 * n).map(|i| bf16::from_f32((i * 7919 % 1000) as f32 / 500.0 - 1.0)).collect();

    let ctx = cuda_context(0)?; // cudarc's CudaContext of GPU 0
    let stream = ctx.new_stream()?;
    let kernels = Kernels::cuda(&ctx)?; // once per context (Kernels::vm() for the PTX VM)
    let q_dev = stream.clone_htod(&x[..n])?;
    let k_dev = stream.clone_htod(&x[n..2 * n])?;
    let v_dev = stream.clone_htod(&x[2 * n..])?;
    let mut o_dev = stream.alloc_zeros::<bf16>(n)?;
    let mut lse_dev = stream.alloc_zeros::<f32>(batch * heads * seq)?;
    {
        let (q, k, v) = (
            TensorView::cuda(&q_dev, &stream, shape)?,
            TensorView::cuda(&k_dev, &stream, shape)?,
            TensorView::cuda(&v_dev, &stream, shape)?,
        );
        let mut o = TensorViewMut::cuda(&mut o_dev, &stream, shape)?;
        let mut lse = LseViewMut::cuda(&mut lse_dev, &stream, batch, heads, seq)?; // f32, natural log
        kernels.flash_attn_into(&q, &k, &v, &mut o, &mut lse, &AttnOpts::new().causal(true))?;
        // queued on `stream`; nothing waited. Kernels::flash_attn allocates o and lse instead.
    }
    let o = stream.clone_dtoh(&o_dev)?; // waits for the stream

    // A known answer: causal query 0 sees key 0 only, so its output row is v's row 0 exactly.
    let row = |t: &[bf16], b: usize, h: usize| t[(b * seq * heads + h) * 64..][..64].to_vec();
    let exact = (0..batch).all(|b| (0..heads).all(|h| row(&o, b, h) == row(&x[2 * n..], b, h)));
    println!("o[:, 0] == v[:, 0] for every batch and head: {exact}");
    if !exact {
        return Err("the first query's output is not v's first row".into());
    }
    Ok(())
}
