//! Helpers shared by the library's integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

/// `libvm_cuda.so` (the VM-backed CUDA driver), which cargo builds next to these tests (a
/// dev-dependency of memattn).
pub fn vm_cuda() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    [deps, deps.parent().unwrap()]
        .iter()
        .map(|d| d.join("libvm_cuda.so"))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("libvm_cuda.so is not next to {}", exe.display()))
}

/// Deterministic inputs in [-1, 1) (xorshift), rounded to `dtype`.
pub fn data(n: usize, seed: u64, dtype: memattn::Dtype) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut x: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    dtype.round_all(&mut x);
    x
}

/// `flash_attn_into` of host tensors shaped by `p` (q `[b, seq_q, heads, d]`, k and v `[b, seq_kv,
/// heads_kv, d]`, in `p.dtype`) into NaN-poisoned O and LSE on `kernels`' device; O and LSE read
/// back as f32.
pub fn flash_into(
    kernels: &memattn::attn::Kernels,
    p: &memattn::Problem,
    (q, k, v): (&[f32], &[f32], &[f32]),
    opts: &memattn::attn::AttnOpts<'_>,
) -> (Vec<f32>, Vec<f32>) {
    use memattn::attn::{LseViewMut, TensorView, TensorViewMut};
    let dt = p.dtype;
    let (b, sq, skv) = (p.batch as usize, p.seq_q as usize, p.seq_kv as usize);
    let (h, hk, d) = (p.heads as usize, p.kv_heads() as usize, p.head_dim as usize);
    let up = |x: &[f32]| kernels.vm_upload_as(dt, x).unwrap();
    let (qb, kb, vb) = (up(q), up(k), up(v));
    let ob = kernels.vm_upload_as(dt, &vec![f32::NAN; q.len()]).unwrap();
    let lb = kernels.vm_upload(&vec![f32::NAN; b * h * sq]).unwrap();
    let (qs, ks) = ([b, sq, h, d], [b, skv, hk, d]);
    kernels
        .flash_attn_into(
            &TensorView::vm(&qb, dt, qs).unwrap(),
            &TensorView::vm(&kb, dt, ks).unwrap(),
            &TensorView::vm(&vb, dt, ks).unwrap(),
            &mut TensorViewMut::vm(&ob, dt, qs).unwrap(),
            &mut LseViewMut::vm(&lb, b, h, sq).unwrap(),
            opts,
        )
        .unwrap();
    (ob.read_f32(dt, q.len()).unwrap(), lb.read_f32(memattn::Dtype::F32, b * h * sq).unwrap())
}

use memattn::attn::{AttnOpts, Kernels, LseViewMut, RotaryView, SinksView, TensorView, TensorViewMut, VmBuffer};
use memattn::decode::{reference as decode_ref, verify_decode, CacheLayout, DecodeInputs, DecodeProblem, Splits};
use memattn::Dtype;

/// One KV-cache call of `p` through [`Kernels::flash_attn_with_kvcache_into`] on random inputs
/// (NaN in every cache row the call must not read before writing), O and LSE poisoned: O, LSE
/// and the appended cache match `memattn::decode`'s f64 reference. With `indices_on_device` every
/// index tensor is device-only and the call must begin with the device check
/// (`decode_check_*`); without, it must not. Returns the kernels launched.
pub fn kvcache_case(kernels: &Kernels, p: &DecodeProblem, seed: u64, indices_on_device: bool) -> Vec<String> {
    let x = DecodeInputs::random(p, seed);
    let dt = p.dtype;
    let (b, sq, h, hk, d) =
        (p.batch as usize, p.seq_q as usize, p.heads as usize, p.heads_kv as usize, p.head_dim as usize);
    let up = |v: &[f32]| kernels.vm_upload_as(dt, &[v, &[0.0][..]].concat()).unwrap();
    let (qb, kc, vc) = (up(&x.q), up(&x.k_cache), up(&x.v_cache));
    let (kn, vn) = (up(&x.k_new), up(&x.v_new));
    let slots = p.cache_slots() as usize;
    let cache_shape = match x.layout {
        CacheLayout::Contiguous { seq_cache } => [slots.max(b), seq_cache as usize, hk, d],
        CacheLayout::Paged { page_size, num_pages, .. } => [num_pages as usize, page_size as usize, hk, d],
    };
    let it = |v: &[u32]| {
        let t = kernels.index_tensor(v, None).unwrap();
        if indices_on_device {
            t.device_only()
        } else {
            t
        }
    };
    let seqlens = it(&p.cache_seqlens);
    let table = it(&x.block_table);
    let slot_t = p.cache_batch_idx.as_ref().map(|v| it(v));
    let pad_t = p.cache_leftpad.as_ref().map(|v| it(v));
    let ob = kernels.vm_upload_as(dt, &vec![f32::NAN; b * sq * h * d]).unwrap();
    let lb = kernels.vm_upload(&vec![f32::NAN; b * h * sq]).unwrap();
    let sinks_buf = kernels.vm_upload(&[&x.sinks[..], &[0.0]].concat()).unwrap();
    let sinks = SinksView::vm(&sinks_buf, h).unwrap();
    let rot_bufs = (up(&x.rotary_cos), up(&x.rotary_sin));
    let half = p.rotary.map_or(1, |r| r.dim as usize / 2);
    let rows = x.rotary_cos.len() / half;
    let rot = p.rotary.map(|r| {
        let t = |buf| TensorView::vm(buf, dt, [rows, half, 1, 1]).unwrap();
        RotaryView::new(t(&rot_bufs.0), t(&rot_bufs.1), r.interleaved)
    });
    let mut opts = AttnOpts::new()
        .causal(p.causal)
        .window_size(p.window_left, p.window_right)
        .softmax_scale(p.softmax_scale())
        .decode_kernel(p.kernel);
    if p.sinks {
        opts = opts.sinks(&sinks);
    }
    if p.softcap > 0.0 {
        opts = opts.softcap(p.softcap);
    }
    if let Splits::Fixed(n) = p.splits {
        opts = opts.num_splits(n);
    }
    if let Some(t) = &slot_t {
        opts = opts.cache_batch_idx(t);
    }
    if let Some(t) = &pad_t {
        opts = opts.cache_leftpad(t);
    }
    if let Some(r) = &rot {
        opts = opts.rotary(r);
    }
    let new_shape = [b, p.seq_new as usize, hk, d];
    let (knv, vnv) = (TensorView::vm(&kn, dt, new_shape).unwrap(), TensorView::vm(&vn, dt, new_shape).unwrap());
    let has_new = p.seq_new > 0;
    kernels.record_launches(true).unwrap();
    kernels
        .flash_attn_with_kvcache_into(
            &TensorView::vm(&qb, dt, [b, sq, h, d]).unwrap(),
            &mut TensorViewMut::vm(&kc, dt, cache_shape).unwrap(),
            &mut TensorViewMut::vm(&vc, dt, cache_shape).unwrap(),
            has_new.then_some(&knv),
            has_new.then_some(&vnv),
            &seqlens,
            (!x.block_table.is_empty()).then_some(&table),
            &mut TensorViewMut::vm(&ob, dt, [b, sq, h, d]).unwrap(),
            &mut LseViewMut::vm(&lb, b, h, sq).unwrap(),
            &opts,
        )
        .unwrap();
    let launched: Vec<String> = kernels.take_launches().unwrap().iter().map(|l| l.kernel.name().to_string()).collect();
    kernels.record_launches(false).unwrap();
    assert_eq!(launched[0].starts_with("decode_check_"), indices_on_device, "{launched:?}");
    kernels.check_kv_status().unwrap();
    let o = ob.read_f32(dt, b * sq * h * d).unwrap();
    let lse = lb.read_f32(Dtype::F32, b * h * sq).unwrap();
    let v = verify_decode(p, &o, &lse, &decode_ref(p, &x));
    assert!(v.passed, "{p:?}: {:?}", v.failures);
    eprintln!("{launched:?}: O scaled err {:.2e}, LSE err {:.2e}", v.o_max_scaled_err, v.lse_max_abs_err);
    if has_new {
        let (ke, ve) = x.appended(p);
        let same = |buf: &VmBuffer, want: &[f32]| {
            let got = buf.read_f32(dt, want.len()).unwrap();
            got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()))
        };
        assert!(same(&kc, &ke) && same(&vc, &ve), "the cache after the append");
    }
    launched
}
