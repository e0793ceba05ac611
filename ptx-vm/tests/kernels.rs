//! Runs the project's committed PTX in the VM and checks it against an f64 reference.

use kernels_gpu::abi::{AttnParams, Strides};
use kernels_gpu::tiles;
use ptx_vm::{LaunchConfig, Module, Vm};

mod util;
use util::{module, Rng};

fn upload(vm: &mut Vm, v: &[f32]) -> u64 {
    let p = vm.alloc((v.len() * 4) as u64).unwrap();
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    vm.write(p, &bytes).unwrap();
    p
}
fn download(vm: &Vm, p: u64, n: usize) -> Vec<f32> {
    let mut b = vec![0u8; n * 4];
    vm.read(p, &mut b).unwrap();
    b.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[test]
fn all_kernels_load() {
    let m = module();
    let names: Vec<String> = m.kernels().into_iter().map(|k| k.name).collect();
    for k in [
        "saxpy_f32",
        "naive_scores_f32",
        "naive_softmax_f32",
        "naive_pv_f32",
        "flash_fwd_f32_d64",
        "flash_fwd_f32_d128",
        "flash_fwd_bf16_d64",
        "flash_fwd_bf16_d128",
        "flash_fwd_f16_d64",
        "flash_fwd_f16_d128",
    ] {
        assert!(names.iter().any(|n| n == k), "{k} missing");
    }
    assert_eq!(m.version_and_target(), ("7.0".to_string(), "sm_80".to_string()));
    let s = m.kernel("saxpy_f32").unwrap();
    assert_eq!(s.param_bytes, 24);
    assert_eq!(s.params[2].offset, 8);
    assert_eq!(s.params[2].align, 8);
    let f = m.kernel("flash_fwd_f32_d64").unwrap();
    assert_eq!(f.param_bytes, 176);
    assert_eq!(f.params[0].align, 8);
}

#[test]
fn saxpy() {
    let m = module();
    let mut vm = Vm::with_workers(1);
    let mut lim = vm.limits();
    lim.max_instructions_per_thread = 10000;
    vm.set_limits(lim);
    let n = 1000u32;
    let mut rng = Rng(7);
    let x: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
    let y: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
    let (px, py) = (upload(&mut vm, &x), upload(&mut vm, &y));
    let a = 1.5f32;
    let mut params = Vec::new();
    params.extend_from_slice(&n.to_le_bytes());
    params.extend_from_slice(&a.to_le_bytes());
    params.extend_from_slice(&px.to_le_bytes());
    params.extend_from_slice(&py.to_le_bytes());
    let d = tiles::saxpy_launch(n);
    let st = vm.launch(&m, "saxpy_f32", &LaunchConfig::new(d.grid, d.block, 0), &params).unwrap();
    let out = download(&vm, py, n as usize);
    for i in 0..n as usize {
        assert_eq!(out[i].to_bits(), (a * x[i] + y[i]).to_bits());
    }
    assert_eq!(st.blocks, 4);
    assert!(st.thread_instructions > 0 && st.warp_instructions * 32 >= st.thread_instructions);
}

struct Case {
    batch: u32,
    heads: u32,
    seq_q: u32,
    seq_kv: u32,
    d: u32,
    causal: bool,
    bhsd: bool,
}

/// f64 reference: returns (O in the given layout of q/o strides, LSE [b, h, sq]).
fn reference(c: &Case, p: &AttnParams, q: &[f32], k: &[f32], v: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let d = c.d as usize;
    let mut o = vec![0f64; q.len()];
    let mut lse = vec![0f64; (c.batch * c.heads * c.seq_q) as usize];
    for b in 0..c.batch as u64 {
        for h in 0..c.heads as u64 {
            for i in 0..c.seq_q as u64 {
                let end = p.key_end(i as u32).max(0) as u64;
                let qo = p.q_strides.offset(b, i, h) as usize;
                let mut s = Vec::new();
                for j in 0..end {
                    let ko = p.k_strides.offset(b, j, h) as usize;
                    let dot: f64 = (0..d).map(|t| q[qo + t] as f64 * k[ko + t] as f64).sum();
                    s.push(dot * p.softmax_scale as f64);
                }
                let li = ((b * c.heads as u64 + h) * c.seq_q as u64 + i) as usize;
                let oo = p.o_strides.offset(b, i, h) as usize;
                if s.is_empty() {
                    lse[li] = f64::NEG_INFINITY;
                    continue;
                }
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = s.iter().map(|x| (x - mx).exp()).sum();
                lse[li] = mx + sum.ln();
                for t in 0..d {
                    let mut acc = 0.0;
                    for (j, sj) in s.iter().enumerate() {
                        let vo = p.v_strides.offset(b, j as u64, h) as usize;
                        acc += (sj - mx).exp() / sum * v[vo + t] as f64;
                    }
                    o[oo + t] = acc;
                }
            }
        }
    }
    (o, lse)
}

fn check(name: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    let mut err2 = 0.0;
    let mut ref2 = 0.0;
    let mut max_abs: f64 = 0.0;
    let scale = want.iter().filter(|x| x.is_finite()).fold(0f64, |a, b| a.max(b.abs())).max(1e-30);
    for (g, w) in got.iter().zip(want) {
        let g = *g as f64;
        if w.is_infinite() {
            assert_eq!(g, *w, "{name}: expected {w}, got {g}");
            continue;
        }
        assert!(g.is_finite(), "{name}: non-finite output {g} (want {w})");
        err2 += (g - w) * (g - w);
        ref2 += w * w;
        max_abs = max_abs.max((g - w).abs());
    }
    let rel = (err2 / ref2.max(1e-300)).sqrt();
    assert!(rel <= 1e-5, "{name}: rel RMS error {rel}");
    assert!(max_abs <= 1e-5 * scale, "{name}: max abs error {max_abs} (scale {scale})");
}

fn run_case(vm: &mut Vm, m: &Module, c: &Case, flash: bool, seed: u64) {
    let d = c.d as u64;
    let (sq, skv, h) = (c.seq_q as u64, c.seq_kv as u64, c.heads as u64);
    let st = |s: u64| if c.bhsd { Strides::bhsd(s, h, d) } else { Strides::bshd(s, h, d) };
    let nq = (c.batch as u64 * sq * h * d) as usize;
    let nk = (c.batch as u64 * skv * h * d) as usize;
    let mut rng = Rng(seed);
    let q: Vec<f32> = (0..nq).map(|_| rng.f32()).collect();
    let k: Vec<f32> = (0..nk).map(|_| rng.f32()).collect();
    let v: Vec<f32> = (0..nk).map(|_| rng.f32()).collect();
    let nan_o = vec![f32::NAN; nq];
    let nlse = (c.batch as u64 * h * sq) as usize;
    let (pq, pk, pv, po) = (upload(vm, &q), upload(vm, &k), upload(vm, &v), upload(vm, &nan_o));
    let plse = upload(vm, &vec![f32::NAN; nlse]);
    let nscores = (c.batch as u64 * h * sq * skv) as usize;
    let pscores = if flash { 0 } else { upload(vm, &vec![f32::NAN; nscores.max(1)]) };
    let p = AttnParams {
        q: pq,
        k: pk,
        v: pv,
        o: po,
        lse: plse,
        scores: pscores,
        q_strides: st(sq),
        k_strides: st(skv),
        v_strides: st(skv),
        o_strides: st(sq),
        batch: c.batch,
        heads: c.heads,
        seq_q: c.seq_q,
        seq_kv: c.seq_kv,
        head_dim: c.d,
        causal: c.causal as u32,
        softmax_scale: 1.0 / (c.d as f32).sqrt(),
        _pad: 0,
    };
    let bytes = p.to_bytes();
    let tag = format!(
        "{} b{} h{} sq{} skv{} d{} causal{} bhsd{}",
        if flash { "flash" } else { "naive" },
        c.batch,
        c.heads,
        c.seq_q,
        c.seq_kv,
        c.d,
        c.causal,
        c.bhsd
    );
    if flash {
        let tile = tiles::flash_f32_tile(c.d).unwrap();
        let dims = tile.launch(c.batch, c.heads, c.seq_q);
        let name = if c.d == 64 { "flash_fwd_f32_d64" } else { "flash_fwd_f32_d128" };
        vm.launch(m, name, &LaunchConfig::new(dims.grid, dims.block, dims.dynamic_smem_bytes), &bytes)
            .unwrap_or_else(|e| panic!("{tag}: {e}"));
    } else {
        use kernels_gpu::abi::KernelId::*;
        for kid in [NaiveScoresF32, NaiveSoftmaxF32, NaivePvF32] {
            let dims = tiles::naive_launch(kid, c.batch, c.heads, c.seq_q, c.seq_kv);
            vm.launch(m, kid.name(), &LaunchConfig::new(dims.grid, dims.block, dims.dynamic_smem_bytes), &bytes)
                .unwrap_or_else(|e| panic!("{tag}: {e}"));
        }
    }
    let (want_o, want_lse) = reference(c, &p, &q, &k, &v);
    let got_o = download(vm, po, nq);
    let got_lse = download(vm, plse, nlse);
    check(&format!("{tag} O"), &got_o, &want_o);
    check(&format!("{tag} LSE"), &got_lse, &want_lse);
    for ptr in [pq, pk, pv, po, plse] {
        vm.free(ptr).unwrap();
    }
    if !flash {
        vm.free(pscores).unwrap();
    }
}

fn cases() -> Vec<Case> {
    vec![
        Case { batch: 1, heads: 1, seq_q: 32, seq_kv: 64, d: 64, causal: false, bhsd: false },
        Case { batch: 2, heads: 2, seq_q: 45, seq_kv: 45, d: 64, causal: true, bhsd: false },
        Case { batch: 1, heads: 3, seq_q: 20, seq_kv: 77, d: 64, causal: true, bhsd: true },
        Case { batch: 1, heads: 2, seq_q: 70, seq_kv: 33, d: 64, causal: true, bhsd: false },
        Case { batch: 2, heads: 1, seq_q: 17, seq_kv: 40, d: 128, causal: false, bhsd: true },
        Case { batch: 1, heads: 2, seq_q: 33, seq_kv: 50, d: 128, causal: true, bhsd: false },
    ]
}

#[test]
fn flash_kernels_match_reference() {
    let m = module();
    let mut vm = Vm::new();
    for (i, c) in cases().iter().enumerate() {
        run_case(&mut vm, &m, c, true, 100 + i as u64);
    }
    assert_eq!(vm.memory().current_bytes, 0);
}

#[test]
fn naive_kernels_match_reference() {
    let m = module();
    let mut vm = Vm::new();
    for (i, c) in cases().iter().enumerate() {
        run_case(&mut vm, &m, c, false, 200 + i as u64);
    }
}
