//! `attn::cuda_context` and `Kernels::cuda` with `MEMATTN_CUDA_DRIVER` naming the VM-backed
//! driver, and no probe call by the test: they work, and the kernel's answer is the reference's.
//! (A test binary of its own: the driver choice is once per process.)

mod common;
use common::vm_cuda;
use memattn::attn::{cuda_context, AttnOpts, Kernels, TensorView};

#[test]
fn cuda_context_and_kernels_work_on_the_vm_backed_driver_without_a_probe() {
    // SAFETY: this test binary holds this one test, and nothing else reads the environment yet.
    unsafe { std::env::set_var(memattn::driver::DRIVER_ENV, vm_cuda()) };
    let ctx = cuda_context(0).expect("the VM-backed driver opens a context");
    let kernels = Kernels::cuda(&ctx).expect("the kernels load on it");
    let stream = ctx.new_stream().unwrap();
    // One query row over 3 keys, head dim 32: o is the softmax-weighted mean of v's rows.
    let (s, d) = (3usize, 32usize);
    let q: Vec<f32> = (0..d).map(|c| ((c * 7) % 5) as f32 * 0.1 - 0.2).collect();
    let k: Vec<f32> = (0..s * d).map(|i| ((i * 13) % 11) as f32 * 0.05 - 0.25).collect();
    let v: Vec<f32> = (0..s * d).map(|i| ((i * 3) % 17) as f32 * 0.1 - 0.8).collect();
    let (qd, kd, vd) = (stream.clone_htod(&q).unwrap(), stream.clone_htod(&k).unwrap(), stream.clone_htod(&v).unwrap());
    let (o, lse) = kernels
        .flash_attn(
            &TensorView::cuda(&qd, &stream, [1, 1, 1, d]).unwrap(),
            &TensorView::cuda(&kd, &stream, [1, s, 1, d]).unwrap(),
            &TensorView::cuda(&vd, &stream, [1, s, 1, d]).unwrap(),
            &AttnOpts::new(),
        )
        .unwrap();
    let (o, lse) = (o.to_vec_f32().unwrap(), lse.to_vec_f32().unwrap());
    // The answer in f64, written out here.
    let scale = 1.0 / (d as f64).sqrt();
    let scores: Vec<f64> =
        (0..s).map(|j| scale * (0..d).map(|c| q[c] as f64 * k[j * d + c] as f64).sum::<f64>()).collect();
    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = scores.iter().map(|x| (x - m).exp()).sum();
    assert!((lse[0] as f64 - (m + sum.ln())).abs() < 1e-5, "lse {} vs {}", lse[0], m + sum.ln());
    for c in 0..d {
        let want: f64 = (0..s).map(|j| (scores[j] - m).exp() / sum * v[j * d + c] as f64).sum();
        assert!((o[c] as f64 - want).abs() < 1e-5, "o[{c}] {} vs {want}", o[c]);
    }
}
