//! Attention on every device (VM always, CUDA when present): known answers, shape sweeps against
//! the f64 reference, poisoning, and the memory claim.

use kernels_gpu::tiles::{saxpy_launch, LaunchDims};
use memattn_cli::device::{DevPtr, Device, DeviceCaps, DeviceError, LaunchInfo};
use memattn_cli::inputs::Qkv;
use memattn_cli::memory::{AnalyticBytes, MeasuredMemory};
use memattn_cli::problem::{KernelKind, Layout, Problem};
use memattn_cli::ptx::PtxSource;
use memattn_cli::reference::RowSelection;
use memattn_cli::runner::{run, RunSpec};
use memattn_cli::Dtype;
use memattn_tests::{device_tests, require_kernel};

fn spec(p: Problem, k: KernelKind, seed: u64) -> RunSpec {
    RunSpec { seed, check: RowSelection::All, ..RunSpec::new(p, k) }
}

/// Q = 0 makes every score 0: each row averages the V rows it sees. With V[j] = j + d/64 the
/// answer is `(seen - 1) / 2 + d/64` and LSE is `ln(seen)`, computed here by hand, not by the
/// reference.
fn known_answer(dev: &mut dyn Device, kernel: KernelKind, causal: bool, seq_q: u32, seq_kv: u32) {
    let p = Problem { batch: 1, heads: 2, seq_q, seq_kv, head_dim: 64, causal, ..Problem::default() };
    let (h, d) = (p.heads as usize, 64usize);
    let mut v = vec![0f32; p.kv_elems() as usize];
    for j in 0..seq_kv as usize {
        for hh in 0..h {
            for dd in 0..d {
                v[(j * h + hh) * d + dd] = j as f32 + dd as f32 / 64.0;
            }
        }
    }
    let k: Vec<f32> = (0..p.kv_elems()).map(|i| ((i * 7919) % 13) as f32 - 6.0).collect();
    let x = Qkv { q: vec![0.0; p.q_elems() as usize], k, v, sinks: vec![] };
    let r = run(dev, &spec(p, kernel, 0), Some(&x)).expect("run");
    assert!(r.verified, "{kernel}: {:?}", r.verification.failures);
    for i in 0..seq_q {
        let seen = p.keys_seen(i) as f32;
        for hh in 0..h {
            let lse = r.outputs.lse[hh * seq_q as usize + i as usize];
            if seen == 0.0 {
                assert_eq!(lse, f32::NEG_INFINITY, "{kernel} row {i}: fully masked row");
            } else {
                assert!((lse - seen.ln()).abs() < 1e-5, "{kernel} row {i}: lse {lse} vs ln {seen}");
            }
            for dd in [0usize, 1, 33, 63] {
                let got = r.outputs.o[(i as usize * h + hh) * d + dd];
                let want = if seen == 0.0 { 0.0 } else { (seen - 1.0) / 2.0 + dd as f32 / 64.0 };
                assert!((got - want).abs() < 1e-4 * want.abs().max(1.0), "{kernel} row {i} d {dd}: {got} vs {want}");
            }
        }
    }
}

fn sweep_case(dev: &mut dyn Device, p: Problem, kernels: &[KernelKind]) {
    for &k in kernels {
        let r = run(dev, &spec(p, k, 11), None).unwrap_or_else(|e| panic!("{k} {p:?}: {e}"));
        assert!(r.verified, "{k} {p:?}: {:?}", r.verification.failures);
        assert_eq!(r.verification.checked_rows, p.rows());
        assert_eq!(r.verification.unwritten, 0);
        // Real values, not zeros.
        assert!(r.outputs.o.iter().any(|x| x.abs() > 0.1), "{k}: O looks empty");
        assert!(r.verification.o.compared > 0);
    }
}

/// A bf16/f16 flash run against the f64 reference: passes the 2x naive-in-dtype rule, with an
/// absolute ceiling on the relative RMS error as well (1e-2 bf16, 2e-3 f16).
fn sweep_case_16(dev: &mut dyn Device, p: Problem) {
    case_16(dev, p, KernelKind::Flash)
}

/// [`sweep_case_16`] for either kernel family.
fn case_16(dev: &mut dyn Device, p: Problem, kernel: KernelKind) {
    let entry = p.launches(kernel).unwrap()[0].kernel.name();
    require_kernel(dev, entry);
    let r = run(dev, &spec(p, kernel, 13), None).unwrap_or_else(|e| panic!("{entry} {p:?}: {e}"));
    let ceiling = if p.dtype == Dtype::Bf16 { 1e-2 } else { 2e-3 };
    let base = r.baseline_rel_rms_err.expect("16-bit runs report the baseline");
    assert!(r.verified, "{entry} {p:?}: {:?} (baseline {base:.3e})", r.verification.failures);
    assert_eq!(r.launches[0].kernel, entry);
    assert_eq!(r.verification.checked_rows, p.rows());
    assert_eq!(r.verification.unwritten, 0);
    assert!(r.rel_rms_err <= ceiling, "{entry} {p:?}: rel RMS {:.3e} > {ceiling:e}", r.rel_rms_err);
    assert!(
        r.rel_rms_err <= 2.0 * base || r.rel_rms_err <= p.dtype.unit_roundoff(),
        "{entry}: ratio {:?}",
        r.error_ratio
    );
    // Every output is a value of the dtype (it came from 16-bit device memory).
    assert!(r.outputs.o.iter().all(|&x| p.dtype.round(x) == x));
    assert!(r.outputs.o.iter().any(|x| x.abs() > 0.1), "{entry}: O looks empty");
}

/// Q = 0 in a 16-bit dtype: every row averages the V rows it sees. V[j][d] = j % 8 + (d % 16) / 16
/// is exact in bf16 and f16 (7 significant bits), so the answer `mean(j % 8) + (d % 16) / 16` and
/// `LSE = ln(seen)` are computed by hand.
fn known_answer_16(dev: &mut dyn Device, dtype: Dtype, head_dim: u32, causal: bool, seq_q: u32, seq_kv: u32) {
    let p = Problem { batch: 1, heads: 2, seq_q, seq_kv, head_dim, causal, dtype, ..Problem::default() };
    require_kernel(dev, p.launches(KernelKind::Flash).unwrap()[0].kernel.name());
    let (h, d) = (p.heads as usize, head_dim as usize);
    let val = |j: usize, dd: usize| (j % 8) as f32 + (dd % 16) as f32 / 16.0;
    let mut v = vec![0f32; p.kv_elems() as usize];
    for j in 0..seq_kv as usize {
        for hh in 0..h {
            for dd in 0..d {
                v[(j * h + hh) * d + dd] = val(j, dd);
            }
        }
    }
    let k: Vec<f32> = (0..p.kv_elems()).map(|i| ((i * 7919) % 13) as f32 - 6.0).collect();
    let x = Qkv { q: vec![0.0; p.q_elems() as usize], k, v, sinks: vec![] };
    assert!(x.representable_in(dtype));
    let r = run(dev, &spec(p, KernelKind::Flash, 0), Some(&x)).expect("run");
    assert!(r.verified, "{dtype}: {:?}", r.verification.failures);
    let u = dtype.unit_roundoff() as f32;
    for i in 0..seq_q {
        let seen = p.keys_seen(i) as usize;
        for hh in 0..h {
            let lse = r.outputs.lse[hh * seq_q as usize + i as usize];
            if seen == 0 {
                assert_eq!(lse, f32::NEG_INFINITY, "{dtype} row {i}: fully masked row");
            } else {
                assert!((lse - (seen as f32).ln()).abs() < 1e-5, "{dtype} row {i}: lse {lse} vs ln {seen}");
            }
            let mean_j = (0..seen).map(|j| (j % 8) as f32).sum::<f32>() / seen.max(1) as f32;
            for dd in [0usize, 1, 15, d / 2 + 1, d - 1] {
                let got = r.outputs.o[(i as usize * h + hh) * d + dd];
                let want = if seen == 0 { 0.0 } else { mean_j + (dd % 16) as f32 / 16.0 };
                // Rounding to the dtype (P is exactly 1 before normalisation) costs at most u|want|.
                assert!((got - want).abs() <= 2.0 * u * want.abs() + 1e-6, "{dtype} row {i} d {dd}: {got} vs {want}");
            }
        }
    }
}

/// Scores that keep rising along the keys, at different rates per row, so the running max grows
/// in the middle of the key walk: the lazy rescaling (the base raised only when a row's max grew
/// by more than 2^8, `kernels_gpu::softmax::must_rescale`) runs both ways, skipping tiles whose
/// max rose a little (probabilities above 1 under a stale base) and rescaling O where it rose a
/// lot (keys 150 on rise by 0.35 q nats per key, over 16 in log2 per 32 keys). Against the f64
/// reference with the 2x naive-in-dtype rule and the dtype's ceiling.
fn rising_scores_16(dev: &mut dyn Device, dtype: Dtype, head_dim: u32, causal: bool, seq_q: u32, seq_kv: u32) {
    let p = Problem { batch: 1, heads: 2, seq_q, seq_kv, head_dim, causal, dtype, ..Problem::default() };
    let entry = p.launches(KernelKind::Flash).unwrap()[0].kernel.name();
    require_kernel(dev, entry);
    let (h, d) = (p.heads as usize, head_dim as usize);
    // score(i, j) = scale * d * q_i * k_j = q_i * rise(j): K holds rise(j) / sqrt(d).
    let rise = |j: usize| {
        let j = j as f32;
        (if j < 150.0 { 0.02 * j } else { 3.0 + 0.35 * (j - 150.0) }) + 2.0 * (0.7 * j).sin()
    };
    let mut x = Qkv {
        q: vec![0.0; p.q_elems() as usize],
        k: vec![0.0; p.kv_elems() as usize],
        v: vec![0.0; p.kv_elems() as usize],
        sinks: vec![],
    };
    for i in 0..seq_q as usize {
        for hh in 0..h {
            x.q[(i * h + hh) * d..(i * h + hh + 1) * d].fill(1.0 + 0.25 * ((i + hh) % 4) as f32);
        }
    }
    for j in 0..seq_kv as usize {
        for hh in 0..h {
            let row = (j * h + hh) * d;
            x.k[row..row + d].fill(dtype.round(rise(j) / (d as f32).sqrt()));
            for dd in 0..d {
                x.v[row + dd] = ((j * 31 + dd * 7 + hh * 3) % 17) as f32 / 8.0 - 1.0;
            }
        }
    }
    assert!(x.representable_in(dtype));
    let r = run(dev, &spec(p, KernelKind::Flash, 0), Some(&x)).unwrap_or_else(|e| panic!("{entry}: {e}"));
    let base = r.baseline_rel_rms_err.expect("16-bit runs report the baseline");
    assert!(r.verified, "{entry} {p:?}: {:?} (baseline {base:.3e})", r.verification.failures);
    assert_eq!(r.verification.checked_rows, p.rows());
    let ceiling = if dtype == Dtype::Bf16 { 1e-2 } else { 2e-3 };
    assert!(r.rel_rms_err <= ceiling, "{entry} {p:?}: rel RMS {:.3e} > {ceiling:e}", r.rel_rms_err);
    assert!(r.rel_rms_err <= 2.0 * base, "{entry} {p:?}: rel RMS {:.3e} vs baseline {base:.3e}", r.rel_rms_err);
    assert!(r.outputs.o.iter().all(|o| o.is_finite()) && r.outputs.o.iter().any(|o| o.abs() > 0.1), "{entry}");
}

/// `--window 0,0` (or `0,R` with causal): query `i` sees exactly key `j = i + seq_kv - seq_q`,
/// so O equals that V row (of K/V head `h / (heads / heads_kv)`) and LSE equals the one score,
/// computed here by hand; rows with `j < 0` see nothing (O = 0, LSE = -inf). Exact in every dtype:
/// P is exactly 1 and V is a value of the dtype.
fn known_answer_diagonal_window(dev: &mut dyn Device, kernel: KernelKind, p: Problem) {
    let x = Qkv::random(&p, 5);
    let r = run(dev, &spec(p, kernel, 0), Some(&x)).unwrap_or_else(|e| panic!("{kernel} {p:?}: {e}"));
    assert!(r.verified, "{kernel} {p:?}: {:?}", r.verification.failures);
    let (h, hk, d) = (p.heads as usize, p.kv_heads() as usize, p.head_dim as usize);
    let (nq, nk) = (p.seq_q as usize, p.seq_kv as usize);
    for i in 0..nq {
        let j = i as i64 + nk as i64 - nq as i64;
        for hh in 0..h {
            let kh = hh / (h / hk);
            let lse = r.outputs.lse[hh * nq + i];
            let o = &r.outputs.o[(i * h + hh) * d..][..d];
            if j < 0 {
                assert_eq!(lse, f32::NEG_INFINITY, "{kernel} {p:?} row {i}");
                assert!(o.iter().all(|&v| v == 0.0), "{kernel} {p:?} row {i}: O must be 0");
                continue;
            }
            let vrow = &x.v[((j as usize) * hk + kh) * d..][..d];
            let tol = if p.dtype.is_16bit() { p.dtype.unit_roundoff() as f32 * 2.0 } else { 1e-6 };
            for (dd, (&got, &want)) in o.iter().zip(vrow).enumerate() {
                assert!(
                    (got - want).abs() <= tol * want.abs() + 1e-6,
                    "{kernel} {p:?} row {i} head {hh} d {dd}: {got} vs V {want}"
                );
            }
            let q = &x.q[(i * h + hh) * d..][..d];
            let k = &x.k[((j as usize) * hk + kh) * d..][..d];
            let s = q.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * p.softmax_scale() as f64;
            assert!((lse as f64 - s).abs() < 1e-4 * s.abs().max(1.0), "{kernel} {p:?} row {i}: lse {lse} vs score {s}");
        }
    }
}

/// Sinks with known answers: a sink of 1e30 takes all the weight (O = 0, LSE = 1e30); with
/// `seq_q > seq_kv` causal, the first rows see only their sink (O = 0, LSE = sink, finite).
fn known_answer_sinks(dev: &mut dyn Device, kernel: KernelKind, dtype: Dtype, head_dim: u32) {
    let p = Problem {
        batch: 1,
        heads: 4,
        heads_kv: Some(2),
        seq_q: 70,
        seq_kv: 40,
        head_dim,
        causal: true,
        sinks: true,
        dtype,
        ..Problem::default()
    };
    let (h, d, nq) = (4usize, head_dim as usize, 70usize);
    let mut x = Qkv::random(&p, 8);
    x.sinks = vec![0.5, -1.25, 1e30, 3.0];
    let r = run(dev, &spec(p, kernel, 0), Some(&x)).unwrap_or_else(|e| panic!("{kernel} {dtype}: {e}"));
    assert!(r.verified, "{kernel} {dtype} d{head_dim}: {:?}", r.verification.failures);
    for i in 0..nq {
        for hh in 0..h {
            let lse = r.outputs.lse[hh * nq + i];
            let o = &r.outputs.o[(i * h + hh) * d..][..d];
            let sink_only = i < nq - 40;
            if hh == 2 || sink_only {
                assert!(o.iter().all(|&v| v == 0.0), "{kernel} {dtype} row {i} head {hh}: O must be 0");
                let want = x.sinks[hh];
                assert!(
                    lse.is_finite() && (lse - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{kernel} {dtype} row {i} head {hh}: lse {lse} vs sink {want}"
                );
            } else {
                assert!(o.iter().any(|&v| v.abs() > 1e-3), "{kernel} {dtype} row {i} head {hh}: O looks empty");
            }
        }
    }
}

/// One inference-options case against the f64 reference, for the kernels of its dtype.
fn inference_case(dev: &mut dyn Device, p: Problem, kernels: &[KernelKind]) {
    if p.dtype.is_16bit() {
        for &k in kernels {
            case_16(dev, p, k);
        }
    } else {
        sweep_case(dev, p, kernels);
    }
}

/// Varlen with Q = 0: every row averages the V rows of its own sequence that it sees. V of packed
/// key row `t` is `t + d/64`, so a wrong sequence offset, a mask applied to the wrong lengths or
/// a wrong LSE layout shows as a wrong mean; the expected values are computed here by hand.
/// Sequence 1 has queries and no keys: without sinks its rows are O = 0, LSE = -inf; with sinks
/// O = 0, LSE = sink.
fn known_answer_varlen(dev: &mut dyn Device, kernel: KernelKind, dtype: Dtype, sinks: bool) {
    let (lq, lk) = ([37u32, 5, 0, 1, 70], [64u32, 0, 3, 1, 130]);
    let base = Problem { heads: 4, heads_kv: Some(2), head_dim: 64, causal: true, dtype, sinks, ..Problem::default() };
    let p = Problem::varlen(base, &lq, &lk).unwrap();
    let (h, hk, d) = (4usize, 2usize, 64usize);
    let total_kv = p.total_kv() as usize;
    let mut v = vec![0f32; p.kv_elems() as usize];
    for t in 0..total_kv {
        for kh in 0..hk {
            for dd in 0..d {
                // Exact in bf16/f16: t < 256 needs 8 bits; keep values small.
                v[(t * hk + kh) * d + dd] = (t % 16) as f32 + (dd % 4) as f32 / 4.0;
            }
        }
    }
    let k = vec![0.5f32; p.kv_elems() as usize];
    let sinks_v = if sinks { vec![0.25, -2.0, 1.5, 0.0] } else { vec![] };
    let x = Qkv { q: vec![0.0; p.q_elems() as usize], k, v, sinks: sinks_v.clone() };
    let r = run(dev, &spec(p, kernel, 0), Some(&x)).unwrap_or_else(|e| panic!("{kernel} {dtype}: {e}"));
    assert!(r.verified, "{kernel} {dtype} sinks {sinks}: {:?}", r.verification.failures);
    assert_eq!(r.outputs.lse.len(), h * p.total_q() as usize);
    let u = if dtype.is_16bit() { dtype.unit_roundoff() as f32 } else { 1e-6 };
    let (mut q0, mut k0) = (0usize, 0usize);
    for (b, (&nq, &nk)) in lq.iter().zip(&lk).enumerate() {
        for i in 0..nq as usize {
            let end = (i as i64 + 1 + nk as i64 - nq as i64).clamp(0, nk as i64) as usize;
            for hh in 0..h {
                let lse = r.outputs.lse[hh * p.total_q() as usize + q0 + i];
                let sink = sinks_v.get(hh).copied().unwrap_or(f32::NEG_INFINITY) as f64;
                // Every visible score is 0: l = end + e^sink, LSE = ln l, O = mean over weights.
                let l = end as f64 + sink.exp();
                let want_lse = if l == 0.0 { f64::NEG_INFINITY } else { l.ln() };
                if want_lse.is_finite() {
                    assert!(
                        (lse as f64 - want_lse).abs() < 1e-5,
                        "{kernel} {dtype} seq {b} row {i} head {hh}: lse {lse} vs {want_lse}"
                    );
                } else {
                    assert_eq!(lse, f32::NEG_INFINITY, "{kernel} {dtype} seq {b} row {i} head {hh}");
                }
                for dd in [0usize, 1, 3, 62] {
                    let got = r.outputs.o[((q0 + i) * h + hh) * d + dd];
                    let want = if l == 0.0 {
                        0.0
                    } else {
                        (0..end).map(|j| ((k0 + j) % 16) as f64 + (dd % 4) as f64 / 4.0).sum::<f64>() / l
                    };
                    assert!(
                        (got as f64 - want).abs() <= 4.0 * u as f64 * want.abs() + 1e-5,
                        "{kernel} {dtype} seq {b} row {i} head {hh} d {dd}: {got} vs {want}"
                    );
                }
            }
        }
        q0 += nq as usize;
        k0 += nk as usize;
    }
}

const BOTH: [KernelKind; 2] = [KernelKind::Naive, KernelKind::Flash];

/// A device that drops every launch: the outputs stay poisoned and verification must fail.
struct DropLaunches<'a>(&'a mut dyn Device);

impl Device for DropLaunches<'_> {
    fn backend(&self) -> memattn_cli::Backend {
        self.0.backend()
    }
    fn name(&self) -> String {
        self.0.name()
    }
    fn ptx(&self) -> &PtxSource {
        self.0.ptx()
    }
    fn caps(&mut self) -> Result<DeviceCaps, DeviceError> {
        self.0.caps()
    }
    fn alloc(&mut self, bytes: u64) -> Result<DevPtr, DeviceError> {
        self.0.alloc(bytes)
    }
    fn free(&mut self, ptr: DevPtr) -> Result<(), DeviceError> {
        self.0.free(ptr)
    }
    fn upload_bytes(&mut self, ptr: DevPtr, data: &[u8]) -> Result<(), DeviceError> {
        self.0.upload_bytes(ptr, data)
    }
    fn download_bytes(&mut self, ptr: DevPtr, out: &mut [u8]) -> Result<(), DeviceError> {
        self.0.download_bytes(ptr, out)
    }
    fn fill_u32(&mut self, ptr: DevPtr, count: u64, value: u32) -> Result<(), DeviceError> {
        self.0.fill_u32(ptr, count, value)
    }
    fn launch(&mut self, _: &str, _: &LaunchDims, _: &[&[u8]]) -> Result<LaunchInfo, DeviceError> {
        Ok(LaunchInfo::default())
    }
    fn synchronize(&mut self) -> Result<(), DeviceError> {
        self.0.synchronize()
    }
    fn timer_start(&mut self) -> Result<(), DeviceError> {
        self.0.timer_start()
    }
    fn timer_stop(&mut self) -> Result<f64, DeviceError> {
        self.0.timer_stop()
    }
    fn clock_name(&self) -> &'static str {
        self.0.clock_name()
    }
    fn memory_begin(&mut self) -> Result<(), DeviceError> {
        self.0.memory_begin()
    }
    fn memory_mark_allocated(&mut self) -> Result<(), DeviceError> {
        self.0.memory_mark_allocated()
    }
    fn memory_end(&mut self) -> Result<MeasuredMemory, DeviceError> {
        self.0.memory_end()
    }
    fn default_warmup_repeats(&self) -> (u32, u32) {
        self.0.default_warmup_repeats()
    }
}

device_tests! {
    #[smoke]
    fn saxpy_smoke(dev: &mut dyn Device) {
        let n = 1000u32;
        let x: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let y: Vec<f32> = (0..n).map(|i| 1.0 - i as f32).collect();
        let (px, py) = (dev.alloc(4 * n as u64).unwrap(), dev.alloc(4 * n as u64).unwrap());
        dev.upload(px, &x).unwrap();
        dev.upload(py, &y).unwrap();
        let a = 2.5f32;
        let (nb, ab, xb, yb) = (n.to_le_bytes(), a.to_le_bytes(), px.to_le_bytes(), py.to_le_bytes());
        dev.launch("saxpy_f32", &saxpy_launch(n), &[&nb, &ab, &xb, &yb]).unwrap();
        let mut out = vec![0f32; n as usize];
        dev.download(py, &mut out).unwrap();
        for i in 0..n as usize {
            assert_eq!(out[i], a.mul_add(x[i], y[i]), "element {i}");
        }
        dev.free(px).unwrap();
        dev.free(py).unwrap();
    }

    fn known_answer_uniform_attention(dev: &mut dyn Device) {
        for k in BOTH {
            known_answer(dev, k, false, 40, 40);
            known_answer(dev, k, true, 40, 40);
            known_answer(dev, k, true, 50, 20); // 30 fully masked rows
            known_answer(dev, k, true, 20, 70);
        }
    }

    fn shapes_d64_d128_causal_tails(dev: &mut dyn Device) {
        for d in [64, 128] {
            for causal in [false, true] {
                for (sq, sk) in [(67, 67), (33, 100), (100, 33), (1, 5)] {
                    let p = Problem { batch: 1, heads: 2, seq_q: sq, seq_kv: sk, head_dim: d, causal, ..Problem::default() };
                    sweep_case(dev, p, &BOTH);
                }
            }
        }
    }

    fn shapes_several_blocks_heads_batches_bhsd(dev: &mut dyn Device) {
        for layout in [Layout::Bshd, Layout::Bhsd] {
            let p = Problem { batch: 2, heads: 3, seq_q: 70, seq_kv: 130, head_dim: 64, causal: true, layout, ..Problem::default() };
            sweep_case(dev, p, &BOTH);
        }
        let p = Problem { batch: 1, heads: 2, seq_q: 48, seq_kv: 48, head_dim: 128, layout: Layout::Bhsd, scale: Some(0.3), ..Problem::default() };
        sweep_case(dev, p, &BOTH);
        // Naive accepts head dims the flash kernels are not compiled for.
        let p = Problem { batch: 1, heads: 1, seq_q: 20, seq_kv: 30, head_dim: 40, causal: true, ..Problem::default() };
        sweep_case(dev, p, &[KernelKind::Naive]);
    }

    fn bf16_f16_flash_shapes_d64_d128_causal_tails(dev: &mut dyn Device) {
        for dtype in [Dtype::Bf16, Dtype::F16] {
            for d in [64, 128] {
                for causal in [false, true] {
                    for (sq, sk) in [(67, 67), (33, 100), (100, 33), (1, 5)] {
                        let p = Problem { batch: 1, heads: 2, seq_q: sq, seq_kv: sk, head_dim: d, causal, dtype, ..Problem::default() };
                        sweep_case_16(dev, p);
                    }
                }
            }
        }
    }

    fn bf16_f16_flash_several_blocks_heads_batches_bhsd(dev: &mut dyn Device) {
        for dtype in [Dtype::Bf16, Dtype::F16] {
            for layout in [Layout::Bshd, Layout::Bhsd] {
                // seq_q 130: two 128-row blocks, the last with 2 rows; seq_kv 129: a partial key tile.
                let p = Problem { batch: 2, heads: 3, seq_q: 130, seq_kv: 129, head_dim: 64, causal: true, layout, dtype, ..Problem::default() };
                sweep_case_16(dev, p);
            }
            let p = Problem { batch: 2, heads: 2, seq_q: 80, seq_kv: 72, head_dim: 128, layout: Layout::Bhsd, scale: Some(0.3), dtype, ..Problem::default() };
            sweep_case_16(dev, p);
            // d128's 256-row blocks: two of them, the second with 44 rows, most of them fully
            // masked (causal, seq_q > seq_kv).
            let p = Problem { batch: 1, heads: 2, seq_q: 300, seq_kv: 140, head_dim: 128, causal: true, dtype, ..Problem::default() };
            sweep_case_16(dev, p);
            // The kernels take the running max on raw scores: a negative scale (Q negated once in
            // shared memory) and a zero scale (uniform rows; masked keys stay -inf, never NaN),
            // with and without the soft cap.
            for (d, scale, causal, softcap) in [(64, -0.4, true, 0.0), (128, -0.2, false, 3.0), (64, 0.0, true, 0.0), (128, 0.0, false, 2.0)] {
                let p = Problem { batch: 1, heads: 2, seq_q: 70, seq_kv: 90, head_dim: d, causal, softcap, scale: Some(scale), dtype, ..Problem::default() };
                sweep_case_16(dev, p);
            }
        }
    }

    fn bf16_f16_naive_shapes_causal_tails_any_head_dim(dev: &mut dyn Device) {
        // The 16-bit naive kernels keep S and P in f32 (only Q, K, V, O are 16-bit), so they meet
        // the same 2x naive-in-dtype rule; head_dim 40 exists only for naive.
        for dtype in [Dtype::Bf16, Dtype::F16] {
            for (sq, sk, d, causal, layout) in [
                (67, 67, 64, false, Layout::Bshd),
                (100, 33, 40, true, Layout::Bshd),
                (33, 100, 128, true, Layout::Bhsd),
                (1, 5, 64, false, Layout::Bhsd),
            ] {
                let p = Problem { batch: 2, heads: 2, seq_q: sq, seq_kv: sk, head_dim: d, causal, layout, dtype, ..Problem::default() };
                case_16(dev, p, KernelKind::Naive);
            }
        }
    }

    fn bf16_f16_known_answer_uniform_attention(dev: &mut dyn Device) {
        for dtype in [Dtype::Bf16, Dtype::F16] {
            known_answer_16(dev, dtype, 64, false, 40, 40);
            known_answer_16(dev, dtype, 64, true, 50, 20); // 30 fully masked rows
            known_answer_16(dev, dtype, 64, true, 20, 70);
        }
    }

    // Head dims 32, 96, 192 and 256 (tensor-core tiles Br x Bc 128 x 64, 64 x 64, 64 x 64, 128 x 64;
    // f32 32 x 64, 16 x 32, 8 x 32, 8 x 16): per head dim one pair of lengths that no tile divides,
    // with more than one query block, run as bf16 causal with seq_q > seq_kv (rows before the
    // diagonal see nothing), f16 with seq_q < seq_kv in BHSD over 2 batches, and f32 causal with
    // seq_q < seq_kv, each against the f64 reference (16 bits: the 2x naive-in-dtype rule); then
    // the Q = 0 known answer in bf16 with 30 fully masked rows.
    fn other_head_dims_32_96_192_256_every_dtype(dev: &mut dyn Device) {
        for (d, long, short) in [(32, 150, 140), (96, 200, 70), (192, 130, 45), (256, 140, 37)] {
            for (dtype, batch, sq, sk, causal, layout) in [
                (Dtype::Bf16, 1, long, short, true, Layout::Bshd),
                (Dtype::F16, 2, short, long, false, Layout::Bhsd),
                (Dtype::F32, 1, short, long, true, Layout::Bshd),
            ] {
                let p = Problem { batch, heads: 2, seq_q: sq, seq_kv: sk, head_dim: d, causal, layout, dtype, ..Problem::default() };
                assert_eq!(p.launches(KernelKind::Flash).unwrap()[0].kernel.name(), format!("flash_fwd_{dtype}_d{d}"));
                if dtype == Dtype::F32 {
                    require_kernel(dev, &format!("flash_fwd_f32_d{d}"));
                    sweep_case(dev, p, &[KernelKind::Flash]);
                } else {
                    sweep_case_16(dev, p);
                }
            }
            known_answer_16(dev, Dtype::Bf16, d, true, 50, 20);
        }
    }

    // Head dims without a kernel of their own (multiples of 8: candle-transformers' 40, 80 and
    // 160, and 120, 200) run on the next compiled one, which reads and writes only their
    // columns: per head dim, bf16 causal with seq_q > seq_kv (fully masked rows) over 2 heads,
    // f16 in BHSD over 2 batches with seq_q < seq_kv, f32 causal with GQA; lengths no tile
    // divides, outputs poisoned, each against the f64 reference (16 bits: the 2x naive rule).
    // Then a window on the narrow-window rows, a soft cap, and the Q = 0 known answer.
    fn padded_head_dims_40_80_120_160_200_every_dtype(dev: &mut dyn Device) {
        for (d, kernel_d) in [(40u32, 64u32), (80, 96), (120, 128), (160, 192), (200, 256)] {
            for (dtype, batch, heads_kv, sq, sk, causal, layout) in [
                (Dtype::Bf16, 1, 2, 45, 20, true, Layout::Bshd),
                (Dtype::F16, 2, 2, 20, 37, false, Layout::Bhsd),
                (Dtype::F32, 1, 1, 19, 40, true, Layout::Bshd),
            ] {
                let p = Problem { batch, heads: 2, heads_kv: Some(heads_kv), seq_q: sq, seq_kv: sk, head_dim: d, causal, layout, dtype, ..Problem::default() };
                assert!(p.padded(), "d{d}");
                assert_eq!(p.launches(KernelKind::Flash).unwrap()[0].kernel.name(), format!("flash_fwd_{dtype}_d{kernel_d}"));
                if dtype == Dtype::F32 {
                    require_kernel(dev, &format!("flash_fwd_f32_d{kernel_d}"));
                    sweep_case(dev, p, &[KernelKind::Flash]);
                } else {
                    sweep_case_16(dev, p);
                }
            }
        }
        // A window (d120 takes the d128 narrow-window row), a soft cap (d40), sinks (d200).
        let p = Problem { heads: 2, seq_q: 70, seq_kv: 50, head_dim: 120, window: (20, 3), dtype: Dtype::Bf16, ..Problem::default() };
        assert_eq!(p.launches(KernelKind::Flash).unwrap()[0].kernel.name(), "flash_fwd_bf16_d128_window");
        sweep_case_16(dev, p);
        sweep_case_16(dev, Problem { heads: 2, seq_q: 33, seq_kv: 65, head_dim: 40, softcap: 3.0, dtype: Dtype::F16, ..Problem::default() });
        sweep_case(dev, Problem { heads: 2, seq_q: 17, seq_kv: 20, head_dim: 200, sinks: true, causal: true, ..Problem::default() }, &[KernelKind::Flash]);
        known_answer_16(dev, Dtype::Bf16, 80, true, 40, 20);
    }

    // The narrow-window rows of the tensor-core head dims that have one (d32, d96, d128: 64-, 96-
    // and 64-row blocks; d192, d256: key tiles of 32): windows crossing the blocks' edges, tails,
    // seq_q != seq_kv with fully masked rows, GQA, sinks.
    fn narrow_window_rows_of_every_head_dim_against_the_reference(dev: &mut dyn Device) {
        for (i, d) in [32u32, 96, 128, 192, 256].into_iter().enumerate() {
            for (dtype, sq, sk, window, causal, sinks) in [
                (Dtype::Bf16, 130, 200, (50, 20), false, true),
                (Dtype::F16, 150, 70, (37, 0), true, false),
            ] {
                let heads_kv = if i % 2 == 0 { 2 } else { 1 };
                let p = Problem { heads: 4, heads_kv: Some(heads_kv), seq_q: sq, seq_kv: sk, head_dim: d, window, causal, sinks, dtype, ..Problem::default() };
                assert_eq!(p.launches(KernelKind::Flash).unwrap()[0].kernel.name(), format!("flash_fwd_{dtype}_d{d}_window"));
                sweep_case_16(dev, p);
            }
        }
    }

    // Every tensor-core head dim: the max rises slowly, then fast, along 300 keys (tiles of 32
    // and 64, the last partial), causal with seq_q < seq_kv and not, with several query blocks.
    fn bf16_f16_rising_scores_rescale_lazily(dev: &mut dyn Device) {
        for d in [32, 64, 96, 128, 192, 256] {
            rising_scores_16(dev, Dtype::Bf16, d, true, 77, 300);
            rising_scores_16(dev, Dtype::F16, d, false, 300, 300);
        }
    }

    fn bf16_unwritten_outputs_fail_verification(dev: &mut dyn Device) {
        let p = Problem { batch: 1, heads: 1, seq_q: 16, seq_kv: 16, dtype: Dtype::Bf16, ..Problem::default() };
        require_kernel(dev, "flash_fwd_bf16_d64");
        let mut dropping = DropLaunches(dev);
        let r = run(&mut dropping, &spec(p, KernelKind::Flash, 1), None).unwrap();
        assert!(!r.verified);
        // The 16-bit NaN poison reads back as NaN in every element of O.
        assert_eq!(r.verification.unwritten, p.q_elems() + p.rows());
    }

    fn bf16_memory_is_two_bytes_per_element(dev: &mut dyn Device) {
        let p = Problem { batch: 1, heads: 2, seq_q: 96, seq_kv: 80, head_dim: 64, ..Problem::default() };
        let b = Problem { dtype: Dtype::Bf16, ..p };
        let (a32, a16) = (AnalyticBytes::new(&p, KernelKind::Flash), AnalyticBytes::new(&b, KernelKind::Flash));
        assert_eq!(a16.inputs * 2, a32.inputs);
        assert_eq!(a16.outputs, 2 * p.q_elems());
        assert_eq!(a16.lse, a32.lse); // LSE stays f32
        require_kernel(dev, "flash_fwd_bf16_d64");
        let r = run(dev, &spec(b, KernelKind::Flash, 2), None).unwrap();
        assert!(r.verified, "{:?}", r.verification.failures);
        if dev.backend() == memattn_cli::Backend::Vm {
            assert_eq!(r.peak_device_bytes, a16.total, "{:?}", r.memory);
        }
    }

    fn unwritten_outputs_fail_verification(dev: &mut dyn Device) {
        let p = Problem { batch: 1, heads: 1, seq_q: 16, seq_kv: 16, ..Problem::default() };
        let mut dropping = DropLaunches(dev);
        let r = run(&mut dropping, &spec(p, KernelKind::Flash, 1), None).unwrap();
        assert!(!r.verified);
        assert_eq!(r.verification.unwritten, p.q_elems() + p.rows());
    }

    #[smoke]
    fn flash_needs_less_memory_than_naive(dev: &mut dyn Device) {
        let p = Problem { batch: 1, heads: 2, seq_q: 128, seq_kv: 128, head_dim: 64, ..Problem::default() };
        let naive = run(dev, &spec(p, KernelKind::Naive, 5), None).unwrap();
        let flash = run(dev, &spec(p, KernelKind::Flash, 5), None).unwrap();
        assert!(naive.verified && flash.verified);
        let (an, af) = (AnalyticBytes::new(&p, KernelKind::Naive), AnalyticBytes::new(&p, KernelKind::Flash));
        assert_eq!(af.workspace, af.lse);
        assert_eq!(af.lse, 4 * p.rows());
        assert!(flash.peak_device_bytes < naive.peak_device_bytes);
        if dev.backend() == memattn_cli::Backend::Vm {
            // The VM's allocator is exact: measured == analytic, and the difference is S.
            assert_eq!(flash.peak_device_bytes, af.total, "{:?}", flash.memory);
            assert_eq!(naive.peak_device_bytes, an.total, "{:?}", naive.memory);
            assert_eq!(naive.peak_device_bytes - flash.peak_device_bytes, 4 * p.score_elems());
            assert_eq!(flash.memory.after_bytes, flash.memory.before_bytes, "all buffers freed");
            assert!(flash.vm_thread_instructions.unwrap() > 0);
        }
    }

    // Shapes the VM-only kernel tests used to cover, now run on every device with the host's
    // reference: f32 flash and naive at both head dims, batch/heads > 1, BSHD and BHSD, causal
    // with seq_q < seq_kv and seq_q > seq_kv (fully masked rows).
    fn f32_shapes_from_the_vm_kernel_tests(dev: &mut dyn Device) {
        for (batch, heads, sq, sk, d, causal, layout) in [
            (1, 1, 32, 64, 64, false, Layout::Bshd),
            (2, 2, 45, 45, 64, true, Layout::Bshd),
            (1, 3, 20, 77, 64, true, Layout::Bhsd),
            (1, 2, 70, 33, 64, true, Layout::Bshd),
            (2, 1, 17, 40, 128, false, Layout::Bhsd),
            (1, 2, 33, 50, 128, true, Layout::Bshd),
        ] {
            let p = Problem { batch, heads, seq_q: sq, seq_kv: sk, head_dim: d, causal, layout, ..Problem::default() };
            sweep_case(dev, p, &BOTH);
        }
    }

    // The tensor-core kernels at the shapes of the former VM-only test: tails, causal both ways,
    // several query blocks and key tiles, single query / single key.
    fn bf16_f16_shapes_from_the_vm_kernel_tests(dev: &mut dyn Device) {
        for dtype in [Dtype::Bf16, Dtype::F16] {
            for d in [64, 128] {
                for (batch, heads, sq, sk, causal, layout) in [
                    (2, 2, 100, 100, false, Layout::Bshd),
                    (1, 2, 65, 130, true, Layout::Bhsd),
                    (1, 1, 100, 65, true, Layout::Bshd),
                    (1, 1, 200, 300, true, Layout::Bshd),
                    (1, 1, 129, 129, true, Layout::Bhsd),
                    (1, 1, 1, 65, false, Layout::Bshd),
                    (1, 1, 70, 1, false, Layout::Bshd),
                ] {
                    let p = Problem { batch, heads, seq_q: sq, seq_kv: sk, head_dim: d, causal, layout, dtype, ..Problem::default() };
                    sweep_case_16(dev, p);
                }
            }
        }
    }
    // d128 has a narrow-window row (64-row blocks, windows of at most 96 keys) next to the default
    // 256-row block; d64 has only its default row, whose warps skip the key tiles outside their
    // own rows' windows (docs/semantics.md, "Which kernel runs"). Windows on both, against the
    // f64 reference at shapes with tails, seq_q != seq_kv both ways (fully masked rows), several
    // query blocks (and a last block with warps past seq_q), single query and single key, windows
    // whose edges fall inside key tiles, BHSD, GQA, soft cap and sinks; each case also checks
    // that the rule picked the kernel named here.
    fn bf16_f16_narrow_window_tile_and_windows_on_the_default_tiles(dev: &mut dyn Device) {
        for dtype in [Dtype::Bf16, Dtype::F16] {
            for (d, batch, heads, hk, sq, sk, window, causal, layout, softcap, sinks, narrow) in [
                (128, 2, 2, 2, 100, 100, (30, 30), false, Layout::Bshd, 0.0, false, true),
                (128, 1, 2, 1, 65, 130, (63, -1), true, Layout::Bhsd, 0.0, true, true),
                (128, 1, 1, 1, 100, 65, (10, 0), false, Layout::Bshd, 0.0, false, true),
                (128, 1, 4, 2, 200, 300, (80, 5), false, Layout::Bshd, 4.0, false, true),
                (128, 1, 1, 1, 129, 129, (0, 0), false, Layout::Bhsd, 0.0, false, true),
                (128, 1, 1, 1, 1, 65, (64, 0), false, Layout::Bshd, 0.0, false, true),
                (128, 1, 1, 1, 70, 1, (3, 3), false, Layout::Bshd, 0.0, false, true),
                (128, 1, 1, 1, 150, 700, (95, 0), false, Layout::Bshd, 0.0, false, true),
                // Past the rule: the default tiles with windows bounded on the left.
                (128, 1, 1, 1, 300, 700, (96, 0), false, Layout::Bshd, 0.0, false, false),
                (64, 1, 1, 1, 150, 700, (511, 0), false, Layout::Bshd, 0.0, false, false),
                (64, 2, 2, 2, 100, 100, (30, 30), false, Layout::Bshd, 0.0, false, false),
                (64, 1, 2, 1, 65, 130, (63, -1), true, Layout::Bhsd, 0.0, true, false),
                (64, 1, 1, 1, 129, 129, (0, 0), false, Layout::Bhsd, 0.0, false, false),
                (64, 1, 1, 1, 70, 1, (3, 3), false, Layout::Bshd, 0.0, false, false),
                (64, 1, 4, 1, 130, 700, (300, 300), false, Layout::Bhsd, 3.0, true, false),
                (64, 1, 2, 2, 200, 129, (127, -1), false, Layout::Bshd, 0.0, false, false),
            ] {
                let p = Problem { batch, heads, heads_kv: Some(hk), seq_q: sq, seq_kv: sk, head_dim: d, window, causal, layout, softcap, sinks, dtype, ..Problem::default() };
                let want = format!("flash_fwd_{dtype}_d{d}{}", if narrow { "_window" } else { "" });
                assert_eq!(p.launches(KernelKind::Flash).unwrap()[0].kernel.name(), want, "{p:?}");
                case_16(dev, p, KernelKind::Flash);
            }
            // Known answers, each row sees exactly its diagonal key: the d128 64-row block and the
            // d64 default block.
            let p = Problem { batch: 1, heads: 4, heads_kv: Some(2), seq_q: 130, seq_kv: 150, head_dim: 128, window: (0, 0), dtype, ..Problem::default() };
            known_answer_diagonal_window(dev, KernelKind::Flash, p);
            let p = Problem { head_dim: 64, ..p };
            known_answer_diagonal_window(dev, KernelKind::Flash, p);
        }
    }

    // GQA/MQA, windows, soft cap and sinks (docs/semantics.md): known answers in every dtype and
    // both head dims (f32 at both; bf16 at 64, f16 at 128), GQA ratios 8 and 4.
    fn inference_known_answers_diagonal_window_and_sinks(dev: &mut dyn Device) {
        for (dtype, d) in [(Dtype::F32, 64), (Dtype::F32, 128), (Dtype::Bf16, 64), (Dtype::F16, 128)] {
            for (sq, sk, hk, window, causal) in [(70, 100, 1, (0, 0), false), (100, 70, 2, (0, 5), true)] {
                let p = Problem { batch: 1, heads: 8, heads_kv: Some(hk), seq_q: sq, seq_kv: sk, head_dim: d, window, causal, dtype, ..Problem::default() };
                for k in BOTH {
                    known_answer_diagonal_window(dev, k, p);
                }
            }
            for k in BOTH {
                known_answer_sinks(dev, k, dtype, d);
            }
        }
    }

    fn inference_f32_gqa_windows_softcap_sinks_against_the_reference(dev: &mut dyn Device) {
        // Windows crossing the f32 tiles' edges (Bc 64 at d64, 32 at d128), seq_q != seq_kv both
        // ways, GQA ratios 1/4/8, BHSD, soft cap with large scores, sinks.
        for (d, hk, sq, sk, window, causal, softcap, sinks, layout) in [
            (64, 8, 77, 150, (40, 3), false, 0.0, false, Layout::Bshd),
            (64, 2, 150, 77, (-1, 10), false, 0.0, true, Layout::Bhsd),
            (64, 1, 96, 200, (63, -1), true, 5.0, false, Layout::Bshd),
            (128, 2, 70, 90, (33, 33), false, 2.0, true, Layout::Bshd),
            (128, 8, 45, 45, (-1, -1), false, 0.0, true, Layout::Bhsd),
        ] {
            let p = Problem { batch: 2, heads: 8, heads_kv: Some(hk), seq_q: sq, seq_kv: sk, head_dim: d, window, causal, softcap, sinks, layout, scale: Some(0.3), ..Problem::default() };
            inference_case(dev, p, &BOTH);
        }
    }

    fn inference_16bit_gqa_windows_softcap_sinks_against_the_reference(dev: &mut dyn Device) {
        // Windows crossing the tensor-core tiles' edges (Br 128; Bc 64 at d64, 32 at d128).
        for dtype in [Dtype::Bf16, Dtype::F16] {
            for (d, hk, sq, sk, window, causal, softcap, sinks, layout) in [
                (64, 2, 130, 300, (100, 20), false, 0.0, true, Layout::Bshd),
                (64, 1, 200, 129, (127, -1), true, 4.0, false, Layout::Bhsd),
                (128, 8, 100, 150, (70, 0), false, 3.0, true, Layout::Bshd),
                (128, 2, 65, 65, (-1, 1), false, 0.0, false, Layout::Bhsd),
            ] {
                let p = Problem { batch: 1, heads: 8, heads_kv: Some(hk), seq_q: sq, seq_kv: sk, head_dim: d, window, causal, softcap, sinks, layout, dtype, ..Problem::default() };
                inference_case(dev, p, &BOTH);
            }
        }
    }
    // Varlen batches (empty and length-1 sequences, seq_q > seq_kv and < within one batch) in
    // every kernel: known answers, then the f64 reference with GQA, windows, soft cap and sinks.
    #[smoke]
    fn varlen_known_answers_every_kernel(dev: &mut dyn Device) {
        for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            for k in BOTH {
                known_answer_varlen(dev, k, dtype, false);
            }
            known_answer_varlen(dev, KernelKind::Flash, dtype, true);
        }
        known_answer_varlen(dev, KernelKind::Naive, Dtype::F32, true);
    }

    fn varlen_against_the_reference(dev: &mut dyn Device) {
        for (dtype, d, hk, lq, lk, window, softcap, sinks) in [
            (Dtype::F32, 64, 1, &[100u32, 0, 33, 1][..], &[70u32, 9, 130, 1][..], (40, 0), 0.0, true),
            (Dtype::F32, 128, 4, &[17, 50][..], &[50, 17][..], (-1, -1), 3.0, false),
            (Dtype::Bf16, 64, 2, &[130, 1, 0, 65][..], &[200, 1, 7, 65][..], (-1, 0), 0.0, true),
            (Dtype::F16, 128, 1, &[70, 64][..], &[129, 30][..], (20, 5), 2.0, false),
        ] {
            let base = Problem { heads: 4, heads_kv: Some(hk), head_dim: d, window, softcap, sinks, dtype, ..Problem::default() };
            let p = Problem::varlen(base, lq, lk).unwrap();
            inference_case(dev, p, &BOTH);
        }
    }
}

/// Inputs of the wrong length are refused on every path, including the one that first rounds
/// them to a 16-bit dtype (values not representable in bf16).
#[test]
fn wrong_length_inputs_are_refused_before_upload_in_every_path() {
    let mut dev = memattn_tests::vm_device();
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let p = Problem { batch: 1, heads: 1, seq_q: 8, seq_kv: 8, dtype, ..Problem::default() };
        let mut x = Qkv::random(&Problem { dtype: Dtype::F32, ..p }, 3);
        x.k.pop(); // one element short
        assert!(!x.representable_in(Dtype::Bf16), "the bf16 case must take the rounding path");
        let e = run(&mut dev, &spec(p, KernelKind::Flash, 0), Some(&x)).unwrap_err();
        assert!(matches!(e, memattn_cli::Error::Usage(_)), "{dtype}: {e}");
        assert!(e.to_string().contains("512/511/512 elements"), "{e}");
    }
}

/// VM only: memcheck is the VM's (a GPU would corrupt memory instead; the VM-backed driver's
/// launch fault is checked in `host/tests/command/cuda_vm.rs`).
#[test]
fn out_of_bounds_launch_is_a_device_error() {
    let dev = &mut memattn_tests::vm_device();
    let (px, py) = (dev.alloc(64).unwrap(), dev.alloc(64).unwrap());
    let n = 100u32; // 16 floats allocated
    let (nb, ab, xb, yb) = (n.to_le_bytes(), 1f32.to_le_bytes(), px.to_le_bytes(), py.to_le_bytes());
    let e = dev.launch("saxpy_f32", &saxpy_launch(n), &[&nb, &ab, &xb, &yb]).unwrap_err();
    assert!(matches!(e, DeviceError::Memcheck { .. }), "{e}");
    assert!(e.to_string().contains("saxpy_f32"), "{e}");
}

/// VM only: a sampled launch (`RunSpec::sampled_blocks`, what `check --large` runs) computes the
/// blocks of the checked rows, which verify against the f64 reference, and nothing else: the
/// other rows stay NaN-poisoned and the VM counts only the blocks that ran. Flash only, not
/// varlen.
#[test]
fn sampled_launch_runs_the_blocks_of_the_checked_rows() {
    let mut dev = memattn_tests::vm_device();
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let p = Problem {
            batch: 2,
            heads: 3,
            heads_kv: Some(1),
            seq_q: 700,
            seq_kv: 650,
            causal: true,
            dtype,
            ..Problem::default()
        };
        let whole = run(
            &mut dev,
            &RunSpec { check: RowSelection::Sample { count: 5, seed: 9 }, ..spec(p, KernelKind::Flash, 4) },
            None,
        )
        .unwrap();
        let sampled = RunSpec {
            check: RowSelection::Sample { count: 5, seed: 9 },
            sampled_blocks: true,
            ..spec(p, KernelKind::Flash, 4)
        };
        let r = run(&mut dev, &sampled, None).unwrap();
        assert!(r.verified, "{dtype}: {:?}", r.verification.failures);
        assert_eq!(r.verification.checked_rows, 5);
        let (all, part) = (whole.vm_thread_instructions.unwrap(), r.vm_thread_instructions.unwrap());
        assert!(part > 0 && part * 4 < all, "{dtype}: {part} of {all} thread-instructions");
        assert!(r.warnings.iter().any(|w| w.contains("sampled launch")), "{:?}", r.warnings);
        // The checked rows are the ones written; most others are the poison.
        let nan = r.outputs.o.iter().filter(|v| v.is_nan()).count();
        assert!(nan > r.outputs.o.len() / 2, "{dtype}: {nan} of {} NaN", r.outputs.o.len());
        for (a, b) in r.outputs.lse.iter().zip(&whole.outputs.lse) {
            assert!(a.is_nan() || a.to_bits() == b.to_bits(), "a sampled block's LSE differs from the whole run's");
        }
    }
    let p = Problem::varlen(Problem { heads: 2, ..Problem::default() }, &[30, 40], &[30, 40]).unwrap();
    let e = run(&mut dev, &RunSpec { sampled_blocks: true, ..spec(p, KernelKind::Flash, 0) }, None).unwrap_err();
    assert!(e.to_string().contains("not varlen"), "{e}");
    let p = Problem { heads: 1, seq_q: 40, seq_kv: 40, ..Problem::default() };
    let e = run(&mut dev, &RunSpec { sampled_blocks: true, ..spec(p, KernelKind::Naive, 0) }, None).unwrap_err();
    assert!(e.to_string().contains("flash kernel"), "{e}");
}
