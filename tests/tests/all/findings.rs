//! A VM finding in an attention launch names the tensor the bad access belongs to and the Rust
//! line of the instruction (the committed PTX carries line tables).

use kernels_gpu::abi::{AttnParams, Strides};
use kernels_gpu::tiles::LaunchDims;
use memattn_cli::device::{Device, DeviceError};

#[test]
fn an_out_of_bounds_read_names_the_tensor_and_the_rust_line() {
    let mut dev = memattn_tests::vm_device();
    // naive_scores_f32 reads Q[i] and K[j] rows of head_dim 16; K is given 8 rows too few.
    let (seq_q, seq_kv, d) = (4u32, 40u32, 16u32);
    let q = dev.alloc(4 * (seq_q * d) as u64).unwrap();
    let k = dev.alloc(4 * ((seq_kv - 8) * d) as u64).unwrap();
    let s = dev.alloc(4 * (seq_q * seq_kv) as u64).unwrap();
    let fill = |n: u32| -> Vec<u8> { (0..n).flat_map(|i| (i as f32 * 0.01).to_le_bytes()).collect() };
    dev.upload_bytes(q, &fill(seq_q * d)).unwrap();
    dev.upload_bytes(k, &fill((seq_kv - 8) * d)).unwrap();
    let p = AttnParams {
        q,
        k,
        scores: s,
        q_strides: Strides::bshd(seq_q as u64, 1, d as u64),
        k_strides: Strides::bshd(seq_kv as u64, 1, d as u64),
        v_strides: Strides::bshd(seq_kv as u64, 1, d as u64),
        o_strides: Strides::bshd(seq_q as u64, 1, d as u64),
        batch: 1,
        heads: 1,
        seq_q,
        seq_kv,
        head_dim: d,
        softmax_scale: 0.25,
        ..AttnParams::default()
    };
    let dims = LaunchDims { grid: [seq_q, 1, 1], block: [128, 1, 1], dynamic_smem_bytes: 0 };
    let e = dev.launch("naive_scores_f32", &dims, &[&p.to_bytes()]).unwrap_err();
    let DeviceError::Memcheck { message, .. } = &e else { panic!("expected a memcheck finding, got {e}") };
    eprintln!("{message}");
    assert!(message.contains("out-of-bounds global load"), "{message}");
    assert!(message.contains("buffer K"), "the finding names the tensor: {message}");
    assert!(message.contains("allocation `K`"), "{message}");
    assert!(message.contains("` in kernels-gpu/src/"), "the finding names a Rust file: {message}");
    assert!(message.contains(".rs:"), "{message}");
}
