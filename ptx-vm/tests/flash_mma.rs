//! The tensor-core flash kernels `flash_fwd_{bf16,f16}_d{64,128}` of the committed PTX, run in the
//! VM against an f64 reference computed from the 16-bit-rounded inputs.
//!
//! Tolerance: the kernel's error against the f64 reference may be at most twice the error of
//! naive attention computed in the same 16-bit type (scores and softmax in f32 from the rounded
//! inputs, P rounded to the type before P·V, O rounded to the type), measured both as the
//! largest absolute error and as the relative RMS error of O. LSE is f32 in both.

use half::{bf16, f16};
use kernels_gpu::abi::{AttnParams, KernelId, Strides};
use kernels_gpu::tiles;
use ptx_vm::{LaunchConfig, Module, Vm};

mod util;
use util::{module, Rng};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Dt {
    Bf16,
    F16,
}

impl Dt {
    fn enc(self, x: f32) -> u16 {
        match self {
            Dt::Bf16 => bf16::from_f32(x).to_bits(),
            Dt::F16 => f16::from_f32(x).to_bits(),
        }
    }
    fn dec(self, b: u16) -> f32 {
        match self {
            Dt::Bf16 => bf16::from_bits(b).to_f32(),
            Dt::F16 => f16::from_bits(b).to_f32(),
        }
    }
    fn round(self, x: f32) -> f32 {
        self.dec(self.enc(x))
    }
}

#[derive(Clone, Copy, Debug)]
struct Case {
    batch: u32,
    heads: u32,
    seq_q: u32,
    seq_kv: u32,
    causal: bool,
    bhsd: bool,
}

/// Error of `got` against the f64 reference over the finite reference entries:
/// (largest absolute error, relative RMS error).
fn errors(got: &[f64], want: &[f64]) -> (f64, f64) {
    let (mut e2, mut r2, mut mx) = (0.0f64, 0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        e2 += (g - w) * (g - w);
        r2 += w * w;
        mx = mx.max((g - w).abs());
    }
    (mx, (e2 / r2.max(1e-300)).sqrt())
}

/// Runs one case; returns (max abs err, rel RMS, naive max abs err, naive rel RMS).
fn run_case(vm: &mut Vm, m: &Module, kid: KernelId, dt: Dt, d: u32, c: Case, seed: u64) -> [f64; 4] {
    let (b, h, sq, skv, du) = (c.batch as u64, c.heads as u64, c.seq_q as u64, c.seq_kv as u64, d as usize);
    let st = |s: u64| if c.bhsd { Strides::bhsd(s, h, d as u64) } else { Strides::bshd(s, h, d as u64) };
    let nq = (b * sq * h) as usize * du;
    let nk = (b * skv * h) as usize * du;
    let mut rng = Rng(seed);
    let q: Vec<u16> = (0..nq).map(|_| dt.enc(rng.f32())).collect();
    let k: Vec<u16> = (0..nk).map(|_| dt.enc(rng.f32())).collect();
    let v: Vec<u16> = (0..nk).map(|_| dt.enc(rng.f32())).collect();
    let up16 = |vm: &mut Vm, x: &[u16]| {
        let p = vm.alloc((x.len() * 2).max(2) as u64).unwrap();
        let bytes: Vec<u8> = x.iter().flat_map(|e| e.to_le_bytes()).collect();
        vm.write(p, &bytes).unwrap();
        p
    };
    let (pq, pk, pv) = (up16(vm, &q), up16(vm, &k), up16(vm, &v));
    // O poisoned with NaN bits, LSE with an f32 NaN.
    let po = up16(vm, &vec![0xFFFF; nq]);
    let nlse = (b * h * sq) as usize;
    let plse = vm.alloc((nlse * 4) as u64).unwrap();
    vm.write(plse, &f32::NAN.to_le_bytes().repeat(nlse)).unwrap();
    let p = AttnParams {
        q: pq,
        k: pk,
        v: pv,
        o: po,
        lse: plse,
        scores: 0,
        q_strides: st(sq),
        k_strides: st(skv),
        v_strides: st(skv),
        o_strides: st(sq),
        batch: c.batch,
        heads: c.heads,
        seq_q: c.seq_q,
        seq_kv: c.seq_kv,
        head_dim: d,
        causal: c.causal as u32,
        softmax_scale: 1.0 / (d as f32).sqrt(),
        _pad: 0,
    };
    let tag = format!("{} {c:?}", kid.name());
    let dims = tiles::flash_mma_tile(d).unwrap().launch(c.batch, c.heads, c.seq_q);
    assert_eq!(dims.dynamic_smem_bytes, kid.dynamic_smem_bytes());
    vm.launch(m, kid.name(), &LaunchConfig::new(dims.grid, dims.block, dims.dynamic_smem_bytes), &p.to_bytes())
        .unwrap_or_else(|e| panic!("{tag}: {e}"));
    let mut ob = vec![0u8; nq * 2];
    vm.read(po, &mut ob).unwrap();
    let got_o: Vec<u16> = ob.chunks(2).map(|x| u16::from_le_bytes([x[0], x[1]])).collect();
    let mut lb = vec![0u8; nlse * 4];
    vm.read(plse, &mut lb).unwrap();
    let got_lse: Vec<f32> = lb.chunks(4).map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]])).collect();
    for ptr in [pq, pk, pv, po, plse] {
        vm.free(ptr).unwrap();
    }

    let (qf, kf, vf): (Vec<f32>, Vec<f32>, Vec<f32>) = (
        q.iter().map(|&x| dt.dec(x)).collect(),
        k.iter().map(|&x| dt.dec(x)).collect(),
        v.iter().map(|&x| dt.dec(x)).collect(),
    );
    let scale = p.softmax_scale;
    let (mut want, mut got, mut naive) = (Vec::new(), Vec::new(), Vec::new());
    for bi in 0..b {
        for hi in 0..h {
            for i in 0..sq {
                let end = p.key_end(i as u32).max(0) as u64;
                let qo = p.q_strides.offset(bi, i, hi) as usize;
                let oo = p.o_strides.offset(bi, i, hi) as usize;
                let li = ((bi * h + hi) * sq + i) as usize;
                if end == 0 {
                    // A row that sees no key: exactly O = 0 and LSE = -inf.
                    for t in 0..du {
                        assert_eq!(dt.dec(got_o[oo + t]), 0.0, "{tag}: masked row {i} O[{t}]");
                    }
                    assert_eq!(got_lse[li], f32::NEG_INFINITY, "{tag}: masked row {i} LSE");
                    continue;
                }
                let (mut s64, mut s32) = (Vec::new(), Vec::new());
                for j in 0..end {
                    let ko = p.k_strides.offset(bi, j, hi) as usize;
                    let (mut a64, mut a32) = (0.0f64, 0.0f32);
                    for t in 0..du {
                        a64 += qf[qo + t] as f64 * kf[ko + t] as f64;
                        a32 += qf[qo + t] * kf[ko + t];
                    }
                    s64.push(a64 * scale as f64);
                    s32.push(a32 * scale);
                }
                let mx = s64.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = s64.iter().map(|x| (x - mx).exp()).sum();
                let lse = mx + sum.ln();
                let g = got_lse[li] as f64;
                assert!((g - lse).abs() <= 1e-4 * lse.abs().max(1.0), "{tag}: row {i} LSE {g} vs {lse}");
                let mx32 = s32.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let sum32: f32 = s32.iter().map(|x| (x - mx32).exp()).sum();
                let p16: Vec<f32> = s32.iter().map(|x| dt.round((x - mx32).exp() / sum32)).collect();
                for t in 0..du {
                    let (mut acc, mut acc32) = (0.0f64, 0.0f32);
                    for (j, sj) in s64.iter().enumerate() {
                        let vo = p.v_strides.offset(bi, j as u64, hi) as usize;
                        acc += (sj - mx).exp() / sum * vf[vo + t] as f64;
                        acc32 += p16[j] * vf[vo + t];
                    }
                    want.push(acc);
                    naive.push(dt.round(acc32) as f64);
                    let o = dt.dec(got_o[oo + t]) as f64;
                    assert!(o.is_finite(), "{tag}: row {i} O[{t}] = {o}");
                    got.push(o);
                }
            }
        }
    }
    let (e_max, e_rms) = errors(&got, &want);
    let (n_max, n_rms) = errors(&naive, &want);
    eprintln!(
        "{tag}: max abs {e_max:.3e} (2x naive {:.3e}, ratio {:.2}), rel RMS {e_rms:.3e} (2x naive {:.3e}, ratio {:.2})",
        2.0 * n_max,
        e_max / n_max.max(1e-300),
        2.0 * n_rms,
        e_rms / n_rms.max(1e-300)
    );
    if !want.is_empty() {
        assert!(e_max <= 2.0 * n_max, "{tag}: max abs error {e_max} > 2 x naive {n_max}");
        assert!(e_rms <= 2.0 * n_rms, "{tag}: rel RMS error {e_rms} > 2 x naive {n_rms}");
    }
    [e_max, e_rms, n_max, n_rms]
}

fn cases() -> Vec<Case> {
    let c = |batch, heads, seq_q, seq_kv, causal, bhsd| Case { batch, heads, seq_q, seq_kv, causal, bhsd };
    vec![
        // seq not a tile multiple, batch 2 heads 2.
        c(2, 2, 100, 100, false, false),
        // Causal, seq_q < seq_kv (bottom-right aligned: every row sees keys).
        c(1, 2, 65, 130, true, true),
        // Causal, seq_q > seq_kv: rows 0..35 see no key (O = 0, LSE = -inf).
        c(1, 1, 100, 65, true, false),
        // Several query blocks and key tiles, causal: tiles past a block's last visible key are
        // skipped, tiles that reach past its first row's are masked.
        c(1, 1, 200, 300, true, false),
        c(1, 1, 129, 129, true, true),
        // Single query / single key.
        c(1, 1, 1, 65, false, false),
        c(1, 1, 70, 1, false, false),
    ]
}

fn run_kernel(kid: KernelId, dt: Dt, d: u32) {
    let m = module();
    let mut vm = Vm::new();
    for (i, c) in cases().into_iter().enumerate() {
        let [e_max, e_rms, ..] = run_case(&mut vm, &m, kid, dt, d, c, 1000 + i as u64);
        if dt == Dt::Bf16 {
            assert!(e_rms <= 1e-2, "{} {c:?}: rel RMS {e_rms}", kid.name());
        }
        let _ = e_max;
    }
    assert_eq!(vm.memory().current_bytes, 0);
}

#[test]
fn flash_fwd_bf16_d64() {
    run_kernel(KernelId::FlashFwdBf16D64, Dt::Bf16, 64);
}

#[test]
fn flash_fwd_bf16_d128() {
    run_kernel(KernelId::FlashFwdBf16D128, Dt::Bf16, 128);
}

#[test]
fn flash_fwd_f16_d64() {
    run_kernel(KernelId::FlashFwdF16D64, Dt::F16, 64);
}

#[test]
fn flash_fwd_f16_d128() {
    run_kernel(KernelId::FlashFwdF16D128, Dt::F16, 128);
}
