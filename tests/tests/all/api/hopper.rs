//! The Hopper forward (`flash_fwd_{bf16,f16}_sm90_d{64,128,256}`: TMA, mbarriers, wgmma, a
//! producer and two consumer warpgroups) in the VM modelling sm_90: chosen by the library for
//! the problems it covers, run into poisoned outputs, judged against the f64 reference at shapes
//! that are not tile multiples (length 1, seq_q != seq_kv with fully masked rows, several query
//! blocks and heads, GQA, windows, soft cap, sinks, varlen).

use crate::common;
use common::{data, flash_into};
use memattn::attn::{AttnOpts, Kernels, LseViewMut, SinksView, TensorView, TensorViewMut};
use memattn::device::vm::VmDevice;
use memattn::device::{BackendChoice, DeviceOptions};
use memattn::problem::Arch;
use memattn::ptx::PtxSource;
use memattn::{reference, Dtype, Problem};

/// The VM modelling sm_90 with every Hopper row on (`MEMATTN_HOPPER=1`'s policy): the tests
/// check the kernel at each head dim it has, d64 included, which the measured table leaves to
/// the sm_80 kernel by default.
fn sm90_kernels() -> Kernels {
    let mut opts = DeviceOptions::new(BackendChoice::Vm, PtxSource::embedded());
    opts.vm_arch = Arch::Sm90;
    opts.hopper = memattn::choice::HopperPolicy::Always;
    Kernels::on_device(Box::new(VmDevice::new(&opts).unwrap()))
}

fn assert_close(p: &Problem, o: &[f32], lse: &[f32], ro: &[f64], rl: &[f64]) {
    let tol = 1.6e-2;
    for (i, (&g, &r)) in o.iter().zip(ro).enumerate() {
        assert!((g as f64 - r).abs() <= tol, "o[{i}] = {g}, reference {r} ({p:?})");
    }
    for (i, (&g, &r)) in lse.iter().zip(rl).enumerate() {
        if r == f64::NEG_INFINITY {
            assert_eq!(g, f32::NEG_INFINITY, "lse[{i}] ({p:?})");
        } else {
            assert!((g as f64 - r).abs() <= 1e-4 * r.abs().max(1.0), "lse[{i}] = {g}, reference {r} ({p:?})");
        }
    }
}

/// The kernels the last call launched: the tensor-map store, then the Hopper row for `p`.
fn assert_ran_sm90(kernels: &Kernels, p: &Problem) {
    let launched = kernels.take_launches().unwrap();
    assert_eq!(launched.len(), 2, "{launched:?}");
    assert_eq!(launched[0].kernel, kernels_gpu::KernelId::TensorMapsStore, "({p:?})");
    let want = p.sm90_kernel().expect("a Hopper row");
    assert_eq!(launched[1].kernel, want, "({p:?})");
}

#[test]
fn dense_cases_match_the_reference() {
    let kernels = sm90_kernels();
    kernels.record_launches(true).unwrap();
    let base =
        Problem { batch: 2, heads: 4, heads_kv: Some(2), head_dim: 64, dtype: Dtype::Bf16, ..Problem::default() };
    let cases = [
        // Length 1 against length 1.
        Problem { batch: 1, heads: 1, heads_kv: None, seq_q: 1, seq_kv: 1, ..base },
        // Two query blocks (128 rows each), a key count that is not a tile multiple, causal
        // bottom-right (seq_q < seq_kv), GQA 4/2.
        Problem { seq_q: 150, seq_kv: 201, causal: true, ..base },
        // seq_q > seq_kv, causal: the first rows see no key (O = 0, LSE = -inf).
        Problem { seq_q: 140, seq_kv: 37, causal: true, head_dim: 128, ..base },
        // A window on both sides with a soft cap, f16, d128.
        Problem { seq_q: 130, seq_kv: 290, window: (9, 4), softcap: 3.0, head_dim: 128, dtype: Dtype::F16, ..base },
        // d256 (key tiles of 64), non-causal, f16.
        Problem { batch: 1, seq_q: 70, seq_kv: 133, head_dim: 256, dtype: Dtype::F16, ..base },
        // A negative scale (the loop that scales every score first), causal, d64.
        Problem { seq_q: 77, seq_kv: 50, causal: true, scale: Some(-0.3), ..base },
        // A zero scale: every visible key weighs the same.
        Problem { batch: 1, seq_q: 33, seq_kv: 300, window: (40, 0), scale: Some(0.0), head_dim: 128, ..base },
    ];
    for p in cases {
        let (h, hk, d) = (p.heads as usize, p.kv_heads() as usize, p.head_dim as usize);
        let (b, sq, skv) = (p.batch as usize, p.seq_q as usize, p.seq_kv as usize);
        let dt = p.dtype;
        let (q, k, v) = (data(b * sq * h * d, 1, dt), data(b * skv * hk * d, 2, dt), data(b * skv * hk * d, 3, dt));
        let side = |w: i32| u32::try_from(w).ok();
        let mut opts = AttnOpts::new().causal(p.causal).window(side(p.window.0), side(p.window.1));
        if p.softcap > 0.0 {
            opts = opts.softcap(p.softcap);
        }
        if let Some(scale) = p.scale {
            opts = opts.softmax_scale(scale);
        }
        let (o, lse) = flash_into(&kernels, &p, (&q, &k, &v), &opts);
        assert_ran_sm90(&kernels, &p);
        let (ro, rl) = reference::attention(&p, &q, &k, &v).unwrap();
        assert_close(&p, &o, &lse, &ro, &rl);
    }
}

#[test]
fn sinks_and_varlen_match_the_reference() {
    let kernels = sm90_kernels();
    kernels.record_launches(true).unwrap();
    let (h, hk, d, dt) = (4usize, 1usize, 128usize, Dtype::Bf16);
    // Sinks: dense, causal, one block.
    let p = Problem {
        batch: 1,
        heads: h as u32,
        heads_kv: Some(hk as u32),
        head_dim: d as u32,
        seq_q: 40,
        seq_kv: 75,
        causal: true,
        sinks: true,
        dtype: dt,
        ..Problem::default()
    };
    let sinks = [0.5f32, -1.0, 2.0, 0.0];
    let (q, k, v) = (data(40 * h * d, 4, dt), data(75 * hk * d, 5, dt), data(75 * hk * d, 6, dt));
    let sb = kernels.vm_upload(&sinks).unwrap();
    let sv = SinksView::vm(&sb, h).unwrap();
    let (o, lse) = flash_into(&kernels, &p, (&q, &k, &v), &AttnOpts::new().causal(true).sinks(&sv));
    assert_ran_sm90(&kernels, &p);
    let (ro, rl) = reference::attention_with_sinks(&p, &q, &k, &v, &sinks).unwrap();
    assert_close(&p, &o, &lse, &ro, &rl);

    // Varlen: three packed sequences, one longer than a query block, one of a single row.
    let (lq, lk) = ([130u32, 1, 20], [60u32, 9, 200]);
    let base = Problem {
        heads: h as u32,
        heads_kv: Some(hk as u32),
        head_dim: d as u32,
        causal: true,
        dtype: dt,
        ..Problem::default()
    };
    let p = Problem::varlen(base, &lq, &lk).unwrap();
    let (tq, tk) = (p.total_q() as usize, p.total_kv() as usize);
    let (q, k, v) = (data(tq * h * d, 7, dt), data(tk * hk * d, 8, dt), data(tk * hk * d, 9, dt));
    let up = |x: &[f32]| kernels.vm_upload_as(dt, x).unwrap();
    let (qb, kb, vb) = (up(&q), up(&k), up(&v));
    let ob = kernels.vm_upload_as(dt, &vec![f32::NAN; q.len()]).unwrap();
    let lb = kernels.vm_upload(&vec![f32::NAN; h * tq]).unwrap();
    let cu = |l: &[u32]| memattn::problem::Varlen::cu(l);
    let (cq, ck) = (kernels.index_tensor(&cu(&lq), None).unwrap(), kernels.index_tensor(&cu(&lk), None).unwrap());
    kernels
        .flash_attn_varlen_into(
            &TensorView::vm(&qb, dt, [1, tq, h, d]).unwrap(),
            &TensorView::vm(&kb, dt, [1, tk, hk, d]).unwrap(),
            &TensorView::vm(&vb, dt, [1, tk, hk, d]).unwrap(),
            &cq,
            &ck,
            130,
            200,
            &mut TensorViewMut::vm(&ob, dt, [1, tq, h, d]).unwrap(),
            &mut LseViewMut::vm(&lb, 1, h, tq).unwrap(),
            &AttnOpts::new().causal(true),
        )
        .unwrap();
    assert_ran_sm90(&kernels, &p);
    let o = ob.read_f32(dt, q.len()).unwrap();
    let lse = lb.read_f32(Dtype::F32, h * tq).unwrap();
    let (ro, rl) = reference::attention(&p, &q, &k, &v).unwrap();
    assert_close(&p, &o, &lse, &ro, &rl);
}

#[test]
fn the_sm80_model_keeps_the_sm80_kernels() {
    let kernels = Kernels::vm().unwrap();
    kernels.record_launches(true).unwrap();
    let p = Problem { seq_q: 20, seq_kv: 20, head_dim: 128, dtype: Dtype::Bf16, ..Problem::default() };
    let n = 20 * p.heads as usize * 128;
    let (q, k, v) = (data(n, 1, p.dtype), data(n, 2, p.dtype), data(n, 3, p.dtype));
    flash_into(&kernels, &p, (&q, &k, &v), &AttnOpts::new());
    let launched = kernels.take_launches().unwrap();
    assert_eq!(launched[0].kernel, kernels_gpu::KernelId::FlashFwdBf16D128);
}

/// The VM modelling sm_90 with the default policy picks what the measured table says (the
/// Hopper forward at d128, the sm_80 kernel at d64, where the Hopper one measured 0.88x), and
/// `HopperPolicy::Never` (`MEMATTN_HOPPER=0`) keeps the sm_80 module; both results verify.
#[test]
fn the_default_follows_the_measured_table_and_never_keeps_sm80() {
    use kernels_gpu::KernelId;
    use memattn::choice::HopperPolicy;
    for (policy, d, want) in [
        (HopperPolicy::Measured, 128, KernelId::FlashFwdBf16Sm90D128),
        (HopperPolicy::Measured, 64, KernelId::FlashFwdBf16D64),
        (HopperPolicy::Never, 128, KernelId::FlashFwdBf16D128),
    ] {
        let mut opts = DeviceOptions::new(BackendChoice::Vm, PtxSource::embedded());
        opts.vm_arch = Arch::Sm90;
        opts.hopper = policy;
        let kernels = Kernels::on_device(Box::new(VmDevice::new(&opts).unwrap()));
        kernels.record_launches(true).unwrap();
        let p = Problem {
            heads: 2,
            seq_q: 70,
            seq_kv: 133,
            head_dim: d,
            causal: true,
            dtype: Dtype::Bf16,
            ..Problem::default()
        };
        let (nq, nk) = (70 * 2 * d as usize, 133 * 2 * d as usize);
        let (q, k, v) = (data(nq, 7, p.dtype), data(nk, 8, p.dtype), data(nk, 9, p.dtype));
        let (o, lse) = flash_into(&kernels, &p, (&q, &k, &v), &AttnOpts::new().causal(true));
        let launched = kernels.take_launches().unwrap();
        assert_eq!(launched.last().unwrap().kernel, want, "{policy:?} d{d}");
        let (ro, rl) = reference::attention(&p, &q, &k, &v).unwrap();
        assert_close(&p, &o, &lse, &ro, &rl);
    }
}

/// BHSD tensors (`[batch, heads, seq, d]` in memory) with a sequence of length 1: the seq
/// dimension's stride (`d`) is below what the head dimension spans, which a tensor map refuses
/// unless the extent-1 dimension's stride is raised to cover it (it is never stepped along).
/// Once refused with a tensor-map stride error; now verified.
#[test]
fn bhsd_tensors_with_a_length_one_sequence_run() {
    let kernels = sm90_kernels();
    kernels.record_launches(true).unwrap();
    let (b, h, d, dt) = (2usize, 2usize, 128usize, Dtype::Bf16);
    for (sq, skv) in [(1usize, 1usize), (100, 1), (1, 37)] {
        let p = Problem {
            batch: b as u32,
            heads: h as u32,
            seq_q: sq as u32,
            seq_kv: skv as u32,
            head_dim: d as u32,
            dtype: dt,
            ..Problem::default()
        };
        let (q, k, v) = (data(b * sq * h * d, 41, dt), data(b * skv * h * d, 42, dt), data(b * skv * h * d, 43, dt));
        // BSHD host data laid out as BHSD on the device.
        let bhsd = |x: &[f32], s: usize| {
            let mut out = vec![0f32; x.len()];
            for bi in 0..b {
                for si in 0..s {
                    for hi in 0..h {
                        let from = ((bi * s + si) * h + hi) * d;
                        let to = ((bi * h + hi) * s + si) * d;
                        out[to..to + d].copy_from_slice(&x[from..from + d]);
                    }
                }
            }
            out
        };
        let up = |x: Vec<f32>| kernels.vm_upload_as(dt, &x).unwrap();
        let (qb, kb, vb) = (up(bhsd(&q, sq)), up(bhsd(&k, skv)), up(bhsd(&v, skv)));
        let ob = kernels.vm_upload_as(dt, &vec![f32::NAN; q.len()]).unwrap();
        let lb = kernels.vm_upload(&vec![f32::NAN; b * h * sq]).unwrap();
        let strides = |s: usize| [h * s * d, d, s * d, 1];
        let view = |buf, s: usize| TensorView::vm(buf, dt, [b, s, h, d]).unwrap().with_strides(strides(s));
        kernels
            .flash_attn_into(
                &view(&qb, sq),
                &view(&kb, skv),
                &view(&vb, skv),
                &mut TensorViewMut::vm(&ob, dt, [b, sq, h, d]).unwrap(),
                &mut LseViewMut::vm(&lb, b, h, sq).unwrap(),
                &AttnOpts::new(),
            )
            .unwrap_or_else(|e| panic!("seq_q {sq} seq_kv {skv}: {e}"));
        assert_ran_sm90(&kernels, &p);
        let (o, lse) = (ob.read_f32(dt, q.len()).unwrap(), lb.read_f32(Dtype::F32, b * h * sq).unwrap());
        let (ro, rl) = reference::attention(&p, &q, &k, &v).unwrap();
        assert_close(&p, &o, &lse, &ro, &rl);
    }
}
