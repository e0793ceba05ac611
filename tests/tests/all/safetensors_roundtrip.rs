//! Safetensors round trip: write q, k, v, read them back, run, write o and lse, read those back.

use memattn_cli::inputs::Qkv;
use memattn_cli::problem::{KernelKind, Problem};
use memattn_cli::reference::{reference, RowSelection};
use memattn_cli::runner::{run, RunSpec};
use memattn_cli::safetensors_io::{
    read_qkv, read_qkv_as, write_outputs, write_qkv, write_qkv_as, FileShape, InputError,
};
use memattn_cli::Dtype;

fn tmp(name: &str) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("memattn-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn qkv_round_trip_is_bit_exact() {
    let p = Problem { batch: 2, heads: 3, seq_q: 5, seq_kv: 7, head_dim: 64, ..Problem::default() };
    let x = Qkv::random(&p, 9);
    let shape = FileShape { batch: 2, heads: 3, seq_q: 5, seq_kv: 7, head_dim: 64, heads_kv: 3, varlen: None };
    let path = tmp("qkv.safetensors");
    write_qkv(&path, shape, &x).unwrap();
    let (s2, y) = read_qkv(&path, Dtype::F32).unwrap();
    assert_eq!(s2, shape);
    assert_eq!(x, y);
}

#[test]
fn malformed_and_missing_inputs_are_input_errors() {
    let path = tmp("garbage.safetensors");
    std::fs::write(&path, b"definitely not safetensors").unwrap();
    assert!(matches!(read_qkv(&path, Dtype::F32), Err(InputError::Malformed { .. })));
    assert!(matches!(
        read_qkv(&tmp("absent.safetensors"), Dtype::F32),
        Err(InputError::File(memattn_cli::files::FileError::Read { .. }))
    ));
}

#[test]
fn run_from_file_and_write_outputs() {
    let p = Problem { batch: 1, heads: 2, seq_q: 24, seq_kv: 24, head_dim: 64, causal: true, ..Problem::default() };
    let x = Qkv::random(&p, 4);
    let shape = FileShape { batch: 1, heads: 2, seq_q: 24, seq_kv: 24, head_dim: 64, heads_kv: 2, varlen: None };
    let inp = tmp("in.safetensors");
    write_qkv(&inp, shape, &x).unwrap();
    let (_, y) = read_qkv(&inp, Dtype::F32).unwrap();
    let mut dev = memattn_tests::vm_device();
    let spec = RunSpec { check: RowSelection::All, ..RunSpec::new(p, KernelKind::Flash) };
    let r = run(&mut dev, &spec, Some(&y)).unwrap();
    assert!(r.verified, "{:?}", r.verification.failures);
    let out = tmp("out.safetensors");
    write_outputs(&out, shape, Dtype::F32, &r.outputs.o, &r.outputs.lse).unwrap();
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let o = st.tensor("o").unwrap();
    assert_eq!(o.shape(), &[1, 24, 2, 64]);
    assert_eq!(st.tensor("lse").unwrap().shape(), &[1, 2, 24]);
    let o: Vec<f32> = o.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let want = reference(&p, &x, &RowSelection::All);
    // Row (b 0, h 1, i 23) of the file against the f64 reference.
    let r_idx = want.rows.iter().position(|r| r.h == 1 && r.i == 23).unwrap();
    for d in 0..64 {
        let got = o[(23 * 2 + 1) * 64 + d] as f64;
        assert!((got - want.o[r_idx * 64 + d]).abs() < 1e-4);
    }
}

#[test]
fn bf16_and_f16_round_trip_is_bit_exact_and_dtype_is_inferred() {
    for dtype in [Dtype::Bf16, Dtype::F16] {
        let p = Problem { batch: 2, heads: 3, seq_q: 5, seq_kv: 7, head_dim: 64, dtype, ..Problem::default() };
        let x = Qkv::random(&p, 9);
        assert!(x.representable_in(dtype));
        let shape = FileShape { batch: 2, heads: 3, seq_q: 5, seq_kv: 7, head_dim: 64, heads_kv: 3, varlen: None };
        let path = tmp(&format!("qkv_{dtype}.safetensors"));
        write_qkv_as(&path, shape, dtype, &x).unwrap();
        let (s2, d2, y) = read_qkv_as(&path, None).unwrap();
        assert_eq!((s2, d2), (shape, dtype));
        assert_eq!(x, y);
        let (_, d3, _) = read_qkv_as(&path, Some(dtype)).unwrap();
        assert_eq!(d3, dtype);
        let other = if dtype == Dtype::Bf16 { Dtype::F16 } else { Dtype::Bf16 };
        let e = read_qkv_as(&path, Some(other)).unwrap_err();
        assert!(matches!(e, InputError::WrongDtype { .. }), "{e}");
        assert!(matches!(read_qkv(&path, Dtype::F32), Err(InputError::WrongDtype { .. })));
    }
}

#[test]
fn mixed_dtypes_in_one_file_are_an_input_error() {
    let p = Problem { batch: 1, heads: 1, seq_q: 4, seq_kv: 4, head_dim: 64, ..Problem::default() };
    let x = Qkv::random(&p, 1);
    let (qb, kb) = (Dtype::Bf16.encode(&x.q), Dtype::F32.encode(&x.k));
    let q = safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![1, 4, 1, 64], &qb).unwrap();
    let k = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 4, 1, 64], &kb).unwrap();
    let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 4, 1, 64], &kb).unwrap();
    let path = tmp("mixed.safetensors");
    safetensors::serialize_to_file([("q", q), ("k", k), ("v", v)], None, &path).unwrap();
    let e = read_qkv_as(&path, None).unwrap_err();
    assert!(matches!(e, InputError::MixedDtypes { .. }), "{e}");
}

#[test]
fn run_bf16_from_file_and_write_bf16_outputs() {
    let p = Problem {
        batch: 1,
        heads: 2,
        seq_q: 24,
        seq_kv: 30,
        head_dim: 128,
        causal: true,
        dtype: Dtype::Bf16,
        ..Problem::default()
    };
    let mut dev = memattn_tests::vm_device();
    memattn_tests::require_kernel(&dev, "flash_fwd_bf16_d128");
    let x = Qkv::random(&p, 4);
    let shape = FileShape { batch: 1, heads: 2, seq_q: 24, seq_kv: 30, head_dim: 128, heads_kv: 2, varlen: None };
    let inp = tmp("in_bf16.safetensors");
    write_qkv_as(&inp, shape, Dtype::Bf16, &x).unwrap();
    let (_, dtype, y) = read_qkv_as(&inp, None).unwrap();
    assert_eq!(dtype, Dtype::Bf16);
    let spec = RunSpec { check: RowSelection::All, ..RunSpec::new(p, KernelKind::Flash) };
    let r = run(&mut dev, &spec, Some(&y)).unwrap();
    assert!(r.verified, "{:?}", r.verification.failures);
    let out = tmp("out_bf16.safetensors");
    write_outputs(&out, shape, Dtype::Bf16, &r.outputs.o, &r.outputs.lse).unwrap();
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let o = st.tensor("o").unwrap();
    assert_eq!(o.dtype(), safetensors::Dtype::BF16);
    // The file holds exactly the device's bf16 output.
    assert_eq!(Dtype::Bf16.decode(o.data()), r.outputs.o);
    assert_eq!(Dtype::F32.decode(st.tensor("lse").unwrap().data()), r.outputs.lse);
}
