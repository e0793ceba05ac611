//! memattn-candle's CUDA path (feature `cuda`) on a candle CUDA device: a 20-step decode loop
//! (append, paged, GQA, window, soft cap) that reads nothing back to the host, then every step's
//! O against attention written with candle's ops on the CPU.
//!
//! Runs where a CUDA driver is: `scripts/candle-cuda-vm.sh` runs it on the VM-backed driver
//! (vm-cuda), which counts device-to-host copies; on a real driver the count is not available
//! and that assertion is skipped with a note. Without a driver the test fails: it is run only
//! by that script (or by hand on a GPU machine).
#![cfg(feature = "cuda")]

mod common;
use candle_core::{DType, Device, IndexOp, Tensor};
use common::candle_decode_attention;
use memattn_candle::{check_kv_status, flash_attn_with_kvcache_opts, KvCacheOpts};

/// The tests take turns: the driver's copy count is per process.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The VM-backed driver's count of device-to-host copies, when the loaded driver is it.
fn dtoh_copies() -> Option<u64> {
    // SAFETY: opens the driver library the process linked (already loaded) and reads a counter
    // through a function that takes nothing.
    let lib = unsafe { libloading::Library::new("libcuda.so") }.ok()?;
    let f: libloading::Symbol<extern "C" fn() -> u64> = unsafe { lib.get(b"vmcuda_device_to_host_copies") }.ok()?;
    Some(f())
}

#[test]
fn twenty_decode_steps_on_a_cuda_device_read_nothing_back() -> candle_core::Result<()> {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::new_cuda(0)?;
    let cpu = Device::Cpu;
    let (b, h, hk, d, page, pages_per_seq, steps) = (2usize, 4usize, 2usize, 64usize, 8usize, 4usize, 20usize);
    let (window, softcap) = (9usize, 5.0f32);
    let scale = 1.0 / (d as f64).sqrt();
    let start = [3usize, 7];
    let num_pages = b * pages_per_seq;
    let table: Vec<u32> = vec![7, 5, 3, 1, 0, 2, 4, 6];
    let row = |s: usize, j: usize| table[s * pages_per_seq + j / page] as usize * page + j % page;
    // The prompts' keys and values, placed through the block table on the host, then moved.
    let mut keys: Vec<Tensor> = Vec::new();
    let mut vals: Vec<Tensor> = Vec::new();
    let mut k_host = vec![0f32; num_pages * page * hk * d];
    let mut v_host = k_host.clone();
    for (s, &n) in start.iter().enumerate() {
        let kp = Tensor::randn(0f32, 1.0, (n, hk, d), &cpu)?.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
        let vp = Tensor::randn(0f32, 1.0, (n, hk, d), &cpu)?.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
        let (kv, vv) = (kp.flatten_all()?.to_vec1::<f32>()?, vp.flatten_all()?.to_vec1::<f32>()?);
        for j in 0..n {
            let (at, from) = (row(s, j) * hk * d, j * hk * d);
            k_host[at..at + hk * d].copy_from_slice(&kv[from..from + hk * d]);
            v_host[at..at + hk * d].copy_from_slice(&vv[from..from + hk * d]);
        }
        keys.push(kp);
        vals.push(vp);
    }
    let shape = (num_pages, page, hk, d);
    let k_cache = Tensor::from_vec(k_host, shape, &cpu)?.to_dtype(DType::BF16)?.to_device(&dev)?;
    let v_cache = Tensor::from_vec(v_host, shape, &cpu)?.to_dtype(DType::BF16)?.to_device(&dev)?;
    let block_table = Tensor::from_vec(table.clone(), (b, pages_per_seq), &dev)?;
    let opts = KvCacheOpts { window_size_left: Some(window), softcap: Some(softcap), ..Default::default() };
    // Inputs made on the host first (candle's random numbers on a CUDA device are cuRAND's).
    let inputs: Vec<(Tensor, Tensor, Tensor)> = (0..steps)
        .map(|_| -> candle_core::Result<_> {
            let r = |shape: (usize, usize, usize, usize)| Tensor::randn(0f32, 1.0, shape, &cpu)?.to_dtype(DType::BF16);
            Ok((r((b, 1, h, d))?, r((b, 1, hk, d))?, r((b, 1, hk, d))?))
        })
        .collect::<candle_core::Result<_>>()?;
    let before = dtoh_copies();
    let mut outs = Vec::new();
    for (t, (q, kn, vn)) in inputs.iter().enumerate() {
        // Host to device only: the step's tokens and the advanced lengths.
        let lens: Vec<u32> = start.iter().map(|&n| (n + t) as u32).collect();
        let cache_seqlens = Tensor::new(lens.as_slice(), &dev)?;
        let (q, kn, vn) = (q.to_device(&dev)?, kn.to_device(&dev)?, vn.to_device(&dev)?);
        let (o, _lse) = flash_attn_with_kvcache_opts(
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
        outs.push(o);
    }
    match (before, dtoh_copies()) {
        (Some(a), Some(z)) => assert_eq!(z - a, 0, "device-to-host copies inside the loop"),
        _ => eprintln!("not the VM-backed driver: device-to-host copies not counted"),
    }
    check_kv_status(&dev)?;
    let mut worst = 0f32;
    for (t, ((q, kn, vn), o)) in inputs.iter().zip(&outs).enumerate() {
        let o = o.to_device(&cpu)?.to_dtype(DType::F32)?;
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
            let err = (o.i(s)? - want)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            worst = worst.max(err);
            assert!(err < 2e-2, "step {t} sequence {s}: |O - candle ops| = {err}");
        }
    }
    // The cache, gathered through the block table, holds every appended row.
    let (kc, vc) = (k_cache.to_device(&cpu)?.to_dtype(DType::F32)?, v_cache.to_device(&cpu)?.to_dtype(DType::F32)?);
    for s in 0..b {
        let n = start[s] + steps;
        let idx = Tensor::from_vec((0..n).map(|j| row(s, j) as u32).collect::<Vec<_>>(), n, &cpu)?;
        for (cache, want) in [(&kc, &keys[s]), (&vc, &vals[s])] {
            let got = cache.reshape((num_pages * page, hk, d))?.index_select(&idx, 0)?;
            let err = (got - want)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert_eq!(err, 0.0, "sequence {s}: the cache holds the appended rows");
        }
    }
    eprintln!("{steps} decode steps on {dev:?}: worst |O - candle ops| {worst:.2e}");
    // A block table naming page 99 of 8: the call writes NaN, leaves the caches alone, and the
    // status check names the rule, then clears it.
    let bad = Tensor::from_vec(vec![7u32, 5, 3, 99, 0, 2, 4, 6], (b, pages_per_seq), &dev)?;
    let lens = Tensor::new(&[25u32, 20], &dev)?;
    let (q, kn, vn) = (inputs[0].0.to_device(&dev)?, inputs[0].1.to_device(&dev)?, inputs[0].2.to_device(&dev)?);
    let (o, lse) = flash_attn_with_kvcache_opts(
        &q,
        &k_cache,
        &v_cache,
        Some(&kn),
        Some(&vn),
        &lens,
        Some(&bad),
        scale as f32,
        true,
        0,
        &opts,
    )?;
    let all_nan = |t: &Tensor| -> candle_core::Result<bool> {
        Ok(t.to_device(&cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().all(|x| x.is_nan()))
    };
    assert!(all_nan(&o)? && all_nan(&lse)?, "a refused call's O and LSE are NaN");
    let unchanged = k_cache.to_device(&cpu)?.to_dtype(DType::F32)?;
    assert_eq!((unchanged - &kc)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?, 0.0, "caches untouched");
    let e = check_kv_status(&dev).unwrap_err().to_string();
    assert!(e.contains("block_table[0][3] = 99 is past num_pages (8)"), "{e}");
    check_kv_status(&dev)?;
    Ok(())
}

/// The forward ops on a candle CUDA device give the CPU device's answer bit for bit (both run
/// the same PTX; the CPU device in memattn's VM): `flash_attn` (causal GQA, bf16), and
/// `flash_attn_with_kvcache` without new tokens over a contiguous f16 cache.
#[test]
fn forward_ops_on_a_cuda_device_equal_the_cpu_device_bit_for_bit() -> candle_core::Result<()> {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::new_cuda(0)?;
    let cpu = Device::Cpu;
    let bits = |t: &Tensor| -> candle_core::Result<Vec<u32>> {
        Ok(t.to_device(&cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .map(|x| x.to_bits())
            .collect())
    };
    let r = |shape: (usize, usize, usize, usize), dt| Tensor::randn(0f32, 1.0, shape, &cpu)?.to_dtype(dt);
    let (q, k, v) = (r((2, 37, 4, 64), DType::BF16)?, r((2, 50, 2, 64), DType::BF16)?, r((2, 50, 2, 64), DType::BF16)?);
    let on_cpu = memattn_candle::flash_attn(&q, &k, &v, 0.125, true)?;
    let on_cuda =
        memattn_candle::flash_attn(&q.to_device(&dev)?, &k.to_device(&dev)?, &v.to_device(&dev)?, 0.125, true)?;
    assert!(on_cuda.device().is_cuda());
    assert_eq!(bits(&on_cpu)?, bits(&on_cuda)?, "flash_attn");
    let (q, kc, vc) = (r((2, 1, 4, 64), DType::F16)?, r((2, 40, 2, 64), DType::F16)?, r((2, 40, 2, 64), DType::F16)?);
    let lens = [33u32, 7];
    let run = |d: &Device| -> candle_core::Result<Tensor> {
        memattn_candle::flash_attn_with_kvcache(
            &q.to_device(d)?,
            &kc.to_device(d)?,
            &vc.to_device(d)?,
            None,
            None,
            &Tensor::new(&lens, d)?,
            None,
            0.125,
            true,
            0,
        )
    };
    assert_eq!(bits(&run(&cpu)?)?, bits(&run(&dev)?)?, "flash_attn_with_kvcache");
    check_kv_status(&dev)
}

/// vLLM's joint KV layout on a candle CUDA device: k_cache and v_cache the halves of one
/// `[2, num_pages, page_size, heads_kv, head_dim]` tensor (one storage). A paged append gives the
/// CPU device's O and joint tensor bit for bit (the CPU device's joint append is checked against
/// the f64 reference in tests/cpu/kvcache_append.rs).
#[test]
fn joint_kv_append_on_a_cuda_device_equals_the_cpu_device_bit_for_bit() -> candle_core::Result<()> {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Device::new_cuda(0)?;
    let cpu = Device::Cpu;
    let bits = |t: &Tensor| -> candle_core::Result<Vec<u32>> {
        Ok(t.to_device(&cpu)?.flatten_all()?.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect())
    };
    let (b, h, hk, d, page, pages) = (2usize, 4usize, 2usize, 64usize, 8usize, 6usize);
    let r = |shape: &[usize]| Tensor::randn(0f32, 1.0, shape, &cpu);
    let (q, kv0, kn, vn) = (r(&[b, 1, h, d])?, r(&[2, pages, page, hk, d])?, r(&[b, 1, hk, d])?, r(&[b, 1, hk, d])?);
    let (lens, table) = ([13u32, 5], [4u32, 0, 2, 5, 1, 3]);
    let run = |dv: &Device| -> candle_core::Result<(Tensor, Tensor)> {
        // A copy: on the CPU device `to_device` would share kv0's storage, which the call writes.
        let kv = kv0.copy()?.to_device(dv)?;
        let o = flash_attn_with_kvcache_opts(
            &q.to_device(dv)?,
            &kv.i(0)?,
            &kv.i(1)?,
            Some(&kn.to_device(dv)?),
            Some(&vn.to_device(dv)?),
            &Tensor::new(&lens, dv)?,
            Some(&Tensor::from_slice(&table, (b, 3), dv)?),
            0.125,
            true,
            2,
            &KvCacheOpts::default(),
        )?
        .0;
        Ok((o, kv))
    };
    let ((o_cpu, kv_cpu), (o_cuda, kv_cuda)) = (run(&cpu)?, run(&dev)?);
    check_kv_status(&dev)?;
    assert!(o_cuda.device().is_cuda() && kv_cuda.device().is_cuda());
    assert_ne!(bits(&kv_cpu)?, bits(&kv0)?, "the append wrote the joint tensor");
    assert_eq!(bits(&o_cpu)?, bits(&o_cuda)?, "O");
    assert_eq!(bits(&kv_cpu)?, bits(&kv_cuda)?, "the joint tensor after the append");
    Ok(())
}
