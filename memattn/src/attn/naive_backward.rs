//! The naive backward, for comparison with the fused one: [`Kernels::naive_attn_backward_into`]
//! and the allocating [`Kernels::naive_attn_backward`], the same gradients as
//! [`Kernels::flash_attn_backward_into`] from four kernels that materialise P and dS
//! (`kernels-gpu/src/naive_bwd.rs`): P recomputed from the forward's LSE, `dS · ds/dx` (with
//! `D = rowsum(dO ∘ O)` per row), `dQ = dS K`, and `dK = dSᵀ Q`, `dV = Pᵀ dO` summed over the
//! query heads of each K/V head. The two `[batch, heads, seq_q, seq_kv]` f32 matrices are the
//! workspace the call allocates ([`naive_attn_backward_workspace`]), `O(N²)` where the fused
//! backward's is `O(N·d)`.

use super::*;
use kernels_gpu::abi::{BwdParams, NaiveBwdParams};
use kernels_gpu::tiles::{NAIVE_BWD_DKV, NAIVE_MAX_HEAD_DIM};
use kernels_gpu::variants::LaunchShape;
use kernels_gpu::Elem;

/// Device memory a naive backward call allocates for itself, from
/// [`naive_attn_backward_workspace`]: P and dS, nothing else (no dQ accumulator: dQ is written
/// once per element, and D is summed in registers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct NaiveBwdWorkspace {
    /// P, `4 · batch · heads · seq_q · seq_kv`.
    pub p_bytes: u64,
    /// dS (times `ds/dx`), the same size.
    pub ds_bytes: u64,
    /// `p_bytes + ds_bytes`.
    pub total_bytes: u64,
}

/// The workspace of a naive backward call with q of shape `q_shape` (`[batch, seq_q, heads,
/// head_dim]`) and `seq_kv` keys: P and dS, f32, `N x N` per head each. A byte count past
/// `u64` is [`ProblemError::TooLarge`].
///
/// ```
/// let w = memattn::attn::naive_attn_backward_workspace([1, 1024, 4, 64], 1024)?;
/// assert_eq!(w.p_bytes, 4 * 4 * 1024 * 1024);
/// assert_eq!(w.total_bytes, 2 * w.p_bytes); // 32 MiB, against the fused backward's 1.06 MiB
/// # Ok::<(), memattn::attn::AttnError>(())
/// ```
pub fn naive_attn_backward_workspace(q_shape: [usize; 4], seq_kv: usize) -> Result<NaiveBwdWorkspace, AttnError> {
    let [b, sq, h, _] = q_shape;
    let one = b as u128 * h as u128 * sq as u128 * seq_kv as u128 * 4;
    if 2 * one > u64::MAX as u128 {
        return Err(ProblemError::TooLarge { what: "the naive backward's P and dS", got: (2 * one).to_string() }.into());
    }
    Ok(NaiveBwdWorkspace { p_bytes: one as u64, ds_bytes: one as u64, total_bytes: 2 * one as u64 })
}

impl Kernels {
    /// Gradients of attention by the naive backward: the arguments, semantics and refusals of
    /// [`Kernels::flash_attn_backward_into`] (bottom-right causal, windows, soft cap, GQA/MQA,
    /// sinks through LSE; dq like q, dk and dv like k and v, each with its own strides), but P
    /// and dS are materialised in a workspace the call allocates
    /// ([`naive_attn_backward_workspace`]) and freed when it returns (on CUDA in the stream's
    /// order). f32, head dims 1 to 256. The gradient of the sink logits is not computed here:
    /// use [`Kernels::flash_attn_backward_into_with`] with [`BwdOpts::d_sinks`]. No atomics, so
    /// the result is the same bits run to run.
    ///
    /// ```
    /// use memattn::attn::{AttnOpts, Kernels, LseView, TensorView, TensorViewMut};
    /// use memattn::Dtype;
    ///
    /// let kernels = Kernels::vm()?;
    /// let shape = [1, 5, 2, 32];
    /// let n = 5 * 2 * 32;
    /// let x: Vec<f32> = (0..n).map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5).collect();
    /// let buf = kernels.vm_upload(&x)?;
    /// let t = TensorView::vm(&buf, Dtype::F32, shape)?;
    /// let opts = AttnOpts::new().causal(true);
    /// let (o, lse) = kernels.flash_attn(&t, &t, &t, &opts)?; // any forward's o and lse
    /// let (dq, dk, dv) = (kernels.vm_alloc(4 * n as u64)?, kernels.vm_alloc(4 * n as u64)?, kernels.vm_alloc(4 * n as u64)?);
    /// let tm = |b| TensorViewMut::vm(b, Dtype::F32, shape);
    /// kernels.naive_attn_backward_into(&t, &t, &t, &TensorView::vm(o.as_vm().unwrap(), Dtype::F32, shape)?,
    ///     &LseView::vm(lse.as_vm().unwrap(), 1, 2, 5)?, &t, &mut tm(&dq)?, &mut tm(&dk)?, &mut tm(&dv)?, &opts)?;
    /// let want = memattn::reference::grad::attention_backward(&memattn::Problem { batch: 1, heads: 2,
    ///     seq_q: 5, seq_kv: 5, head_dim: 32, causal: true, ..Default::default() }, &x, &x, &x, &x, &[]).unwrap();
    /// let got = dk.read_f32(Dtype::F32, n)?;
    /// assert!(got.iter().zip(&want.dk).all(|(a, b)| (*a as f64 - b).abs() < 1e-5));
    /// # Ok::<(), memattn::attn::AttnError>(())
    /// ```
    #[allow(clippy::too_many_arguments)] // flash_attn_backward_into's signature
    pub fn naive_attn_backward_into(
        &self,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        o: &TensorView<'_>,
        lse: &LseView<'_>,
        d_o: &TensorView<'_>,
        dq: &mut TensorViewMut<'_>,
        dk: &mut TensorViewMut<'_>,
        dv: &mut TensorViewMut<'_>,
        opts: &AttnOpts<'_>,
    ) -> Result<(), AttnError> {
        let grads = [(&dq.raw, dq.stream.as_deref()), (&dk.raw, dk.stream.as_deref()), (&dv.raw, dv.stream.as_deref())];
        self.naive_backward(q, k, v, o, lse, d_o, Some(grads), opts).map(|_| ())
    }

    /// The allocating form of [`Kernels::naive_attn_backward_into`]: dq, dk and dv in buffers
    /// memattn allocates on the kernels' device (on CUDA on q's stream), contiguous. Everything
    /// is validated before anything is allocated.
    #[allow(clippy::too_many_arguments)]
    pub fn naive_attn_backward(
        &self,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        o: &TensorView<'_>,
        lse: &LseView<'_>,
        d_o: &TensorView<'_>,
        opts: &AttnOpts<'_>,
    ) -> Result<Gradients, AttnError> {
        let g = self.naive_backward(q, k, v, o, lse, d_o, None, opts)?;
        Ok(g.expect("the allocating backward returns its gradients"))
    }

    /// Validate, allocate the gradients when `grads` is `None`, allocate P and dS, launch the
    /// four kernels.
    #[allow(clippy::too_many_arguments)]
    fn naive_backward(
        &self,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        o: &TensorView<'_>,
        lse: &LseView<'_>,
        d_o: &TensorView<'_>,
        grads: Option<[(&RawView, Option<&CudaStream>); 3]>,
        opts: &AttnOpts<'_>,
    ) -> Result<Option<Gradients>, AttnError> {
        // The forward's validation of q, k, v, o, lse and the options (the naive kernels' head
        // dims, 1..=256), as the fused backward does with its own.
        let outs = (&o.raw, o.stream.as_deref(), Some(lse.0.raw), lse.0.stream.as_deref());
        if opts.alibi_slopes.is_some() {
            return Err(AttnError::Alibi { why: super::AlibiRule::Unsupported { call: "the naive backward" } });
        }
        let plan = self.plan(KernelKind::Naive, q, k, v, Some(outs), None, opts, None)?;
        let dtype = q.raw.dtype;
        if dtype != Dtype::F32 {
            return Err(AttnError::NotSupportedYet {
                feature: "the naive backward in bf16/f16 (its kernels are f32; run it on f32 tensors)",
            });
        }
        let [_, _, h, d] = q.raw.shape;
        debug_assert!(d as u32 <= NAIVE_MAX_HEAD_DIM, "plan checked the naive head dims");
        let hk = k.raw.shape[2];
        let kernels = KernelId::naive_bwd(Elem::F32).expect("the table has the f32 naive backward");
        let (qs, ks) = (q.raw.shape, k.raw.shape);
        let ws = naive_attn_backward_workspace(qs, plan.params.seq_kv as usize)?;
        self.check_grad_views(&[("d_o", d_o.raw, d_o.stream.as_deref(), qs)], &q.raw, false)?;
        let (owned, grad_views) = match grads {
            Some(g) => (None, [*g[0].0, *g[1].0, *g[2].0]),
            None => {
                let shapes = [qs, ks, ks];
                let mut st = Vec::with_capacity(3);
                for s in shapes {
                    st.push(self.alloc_storage(q, (s.iter().product::<usize>() * 4) as u64)?);
                }
                let raw: Vec<RawView> = st.iter().zip(shapes).map(|(s, shape)| s.raw_view(Dtype::F32, shape)).collect();
                (Some(st), [raw[0], raw[1], raw[2]])
            }
        };
        let streams = grads.map_or([q.stream.as_deref(); 3], |g| [g[0].1, g[1].1, g[2].1]);
        let names = ["dq", "dk", "dv"];
        let gv: Vec<_> = (0..3).map(|i| (names[i], grad_views[i], streams[i], [qs, ks, ks][i])).collect();
        self.check_grad_views(&gv, &q.raw, false)?;
        for (name, t, ..) in &gv {
            alias::check_injective(name, t)?;
        }
        let mut extents = vec![
            alias::Extent::of_view("q", &q.raw, false),
            alias::Extent::of_view("k", &k.raw, false),
            alias::Extent::of_view("v", &v.raw, false),
            alias::Extent::of_view("o", &o.raw, false),
            alias::Extent::of_view("lse", &lse.0.raw, false),
            alias::Extent::of_view("d_o", &d_o.raw, false),
            alias::Extent::of_view("dq", &grad_views[0], true),
            alias::Extent::of_view("dk", &grad_views[1], true),
            alias::Extent::of_view("dv", &grad_views[2], true),
        ];
        if let Some(s) = opts.sinks {
            extents.push(alias::Extent::of_view("sinks", &s.0.raw, false));
        }
        alias::check_disjoint(&extents)?;
        self.check_module(&kernels)?;

        let (nb, sq, skv) = (plan.params.batch, plan.params.seq_q, plan.params.seq_kv);
        let shape = LaunchShape { batch: nb, heads: h as u32, seq_q: sq, seq_kv: skv };
        let row_dims = |k: KernelId| k.variant().launch(shape).expect("row-shaped naive backward kernels");
        let dims = [
            row_dims(kernels[0]),
            row_dims(kernels[1]),
            row_dims(kernels[2]),
            NAIVE_BWD_DKV.launch(nb, hk as u32, skv),
        ];
        let caps = self.caps()?;
        for (kernel, dims) in kernels.iter().zip(&dims) {
            for axis in 0..3 {
                if dims.grid[axis] > caps.max_grid[axis] {
                    return Err(AttnError::Grid {
                        entry: kernel.name(),
                        grid: dims.grid,
                        limit: caps.max_grid,
                        axis: ['x', 'y', 'z'][axis],
                    });
                }
            }
        }

        // The workspace: P and dS, [batch, heads, seq_q, seq_kv] f32 each.
        let (p_buf, ds_buf) = self.alloc_outputs(q, ws.p_bytes, ws.ds_bytes)?;
        let mut attn = plan.params;
        attn.scores = p_buf.ptr();
        let z = Strides::default();
        let params = NaiveBwdParams {
            bwd: BwdParams {
                attn,
                d_o: d_o.raw.ptr,
                delta: 0,
                dq_accum: 0,
                dq: grad_views[0].ptr,
                dk: grad_views[1].ptr,
                dv: grad_views[2].ptr,
                dsinks: 0,
                d_o_strides: d_o.raw.kernel_strides(),
                dq_accum_strides: z,
                dq_strides: grad_views[0].kernel_strides(),
                dk_strides: grad_views[1].kernel_strides(),
                dv_strides: grad_views[2].kernel_strides(),
                dq_split_stride: 0,
                dq_splits: 0,
                key_block: 0,
            },
            ds: ds_buf.ptr(),
        };
        let bytes = params.to_bytes();
        for (kernel, dims) in kernels.iter().zip(&dims) {
            self.launch_bytes(*kernel, dims, &bytes, q.stream.as_deref())?;
        }
        drop((p_buf, ds_buf));
        Ok(owned.map(|st| {
            let mut it = st.into_iter();
            let mut t = |shape| DeviceTensor { storage: it.next().expect("three buffers"), dtype, shape };
            Gradients { dq: t(qs), dk: t(ks), dv: t(ks) }
        }))
    }
}

#[cfg(all(feature = "unit-tests", feature = "vm"))]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;
    use crate::reference::grad::{attention_backward, Grads};
    use crate::rng::SplitMix64;

    #[derive(Clone, Copy, Debug)]
    struct Case {
        b: usize,
        h: usize,
        hk: usize,
        sq: usize,
        skv: usize,
        d: usize,
        causal: bool,
        window: (i32, i32),
        softcap: f32,
        sinks: bool,
    }

    const BASE: Case =
        Case { b: 1, h: 1, hk: 1, sq: 1, skv: 1, d: 64, causal: false, window: (-1, -1), softcap: 0.0, sinks: false };

    const NAN: u32 = 0x7fc0_0000;

    fn draw(n: usize, rng: &mut SplitMix64) -> Vec<f32> {
        (0..n).map(|_| rng.below(2001) as f32 / 1000.0 - 1.0).collect()
    }

    fn problem(c: &Case) -> Problem {
        Problem {
            batch: c.b as u32,
            heads: c.h as u32,
            heads_kv: Some(c.hk as u32),
            seq_q: c.sq as u32,
            seq_kv: c.skv as u32,
            head_dim: c.d as u32,
            causal: c.causal,
            window: c.window,
            softcap: c.softcap,
            sinks: c.sinks,
            ..Problem::default()
        }
    }

    /// The naive forward (o, lse), then the naive backward into NaN-poisoned gradients; returns
    /// dq, dk, dv and the f64 reference's gradients.
    fn run(kernels: &Kernels, c: Case, seed: u64) -> ([Vec<f32>; 3], Grads) {
        let mut rng = SplitMix64::new(seed);
        let (qn, kn) = (c.b * c.sq * c.h * c.d, c.b * c.skv * c.hk * c.d);
        let (qx, kx, vx, dox) = (draw(qn, &mut rng), draw(kn, &mut rng), draw(kn, &mut rng), draw(qn, &mut rng));
        let sinks_x = if c.sinks { draw(c.h, &mut rng) } else { vec![] };
        let up = |x: &[f32]| kernels.vm_upload(x).unwrap();
        let (q, k, v, d_o) = (up(&qx), up(&kx), up(&vx), up(&dox));
        let alloc = |n: usize| {
            let buf = kernels.vm_alloc(4 * n.max(1) as u64).unwrap();
            buf.fill_u32(n.max(1) as u64, NAN).unwrap();
            buf
        };
        let rows = c.b * c.h * c.sq;
        let (o, lse, s, dq, dk, dv) = (alloc(qn), alloc(rows), alloc(rows * c.skv), alloc(qn), alloc(kn), alloc(kn));
        let sinks_buf = up(if c.sinks { &sinks_x } else { &[0.0] });
        let sinks_view = SinksView::vm(&sinks_buf, c.h).unwrap();
        let (qs, ks) = ([c.b, c.sq, c.h, c.d], [c.b, c.skv, c.hk, c.d]);
        let t = |buf, s| TensorView::vm(buf, Dtype::F32, s).unwrap();
        let tm = |buf, s| TensorViewMut::vm(buf, Dtype::F32, s).unwrap();
        let mut opts = AttnOpts::new().causal(c.causal).window_size(c.window.0, c.window.1);
        if c.softcap > 0.0 {
            opts = opts.softcap(c.softcap);
        }
        if c.sinks {
            opts = opts.sinks(&sinks_view);
        }
        let mut scores = tm(&s, [c.b, c.h, c.sq, c.skv]);
        let mut lse_w = LseViewMut::vm(&lse, c.b, c.h, c.sq).unwrap();
        kernels
            .naive_attn_into(&t(&q, qs), &t(&k, ks), &t(&v, ks), &mut tm(&o, qs), &mut lse_w, &mut scores, &opts)
            .unwrap();
        kernels
            .naive_attn_backward_into(
                &t(&q, qs),
                &t(&k, ks),
                &t(&v, ks),
                &t(&o, qs),
                &LseView::vm(&lse, c.b, c.h, c.sq).unwrap(),
                &t(&d_o, qs),
                &mut tm(&dq, qs),
                &mut tm(&dk, ks),
                &mut tm(&dv, ks),
                &opts,
            )
            .unwrap();
        let read = |buf: &VmBuffer, n| buf.read_f32(Dtype::F32, n).unwrap();
        let want = attention_backward(&problem(&c), &qx, &kx, &vx, &dox, &sinks_x).unwrap();
        ([read(&dq, qn), read(&dk, kn), read(&dv, kn)], want)
    }

    /// Max |got - want| over max |want| (at least 1e-3); NaN (a poisoned, unwritten element)
    /// makes it NaN, which fails every bound.
    fn rel_err(got: &[f32], want: &[f64]) -> f64 {
        if got.len() != want.len() {
            return f64::NAN;
        }
        let scale = want.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
        let mut worst = 0.0f64;
        for (a, b) in got.iter().zip(want) {
            let e = (*a as f64 - b).abs();
            if e.is_nan() {
                return f64::NAN;
            }
            worst = worst.max(e);
        }
        worst / scale
    }

    /// f32 sums of at most a few hundred products per element: measured below 1e-6 of the
    /// tensor's scale here; a dropped D, GQA term or soft-cap factor is off by 1e-2 or more.
    const TOL: f64 = 5e-6;

    fn check(what: &str, c: &Case, got: &[Vec<f32>; 3], want: &Grads) {
        for (name, g, w) in [("dq", &got[0], &want.dq), ("dk", &got[1], &want.dk), ("dv", &got[2], &want.dv)] {
            let e = rel_err(g, w);
            assert!(e <= TOL, "{what} {c:?}: {name} relative error {e:.3e} > {TOL:.0e}");
        }
    }

    pub fn naive_gradients_match_the_f64_reference() {
        let kernels = Kernels::vm().unwrap();
        let cases = [
            ("length 1", BASE),
            // GQA, two batches, lengths that are no multiple of any block (P: 3 blocks of keys).
            ("GQA, seq_q != seq_kv", Case { b: 2, h: 4, hk: 2, sq: 37, skv: 300, ..BASE }),
            // Causal with seq_q > seq_kv: the first 25 rows see no key (LSE = -inf, P = 0).
            ("MQA causal, fully masked rows", Case { h: 2, sq: 45, skv: 20, causal: true, ..BASE }),
            ("window and soft cap", Case { h: 2, sq: 40, skv: 70, window: (9, 3), softcap: 2.0, ..BASE }),
            // Sinks through LSE: the first 5 rows see only the sink.
            ("sinks, masked rows", Case { b: 2, h: 4, hk: 2, sq: 45, skv: 40, causal: true, sinks: true, ..BASE }),
            // Head dims no fused kernel has, and the largest.
            ("d20 window right only", Case { h: 3, hk: 1, sq: 9, skv: 33, d: 20, window: (-1, 4), ..BASE }),
            ("d256 soft cap causal", Case { sq: 12, skv: 7, d: 256, causal: true, softcap: 5.0, ..BASE }),
        ];
        for (seed, (what, c)) in cases.iter().enumerate() {
            let (got, want) = run(&kernels, *c, seed as u64 + 21);
            check(what, c, &got, &want);
        }
    }

    pub fn the_workspace_is_p_and_ds_exactly() {
        let kernels = Kernels::vm().unwrap();
        let c = Case { b: 2, h: 2, hk: 1, sq: 19, skv: 40, causal: true, ..BASE };
        let w = naive_attn_backward_workspace([2, 19, 2, 64], 40).unwrap();
        assert_eq!(
            (w.p_bytes, w.ds_bytes, w.total_bytes),
            (4 * 2 * 2 * 19 * 40, 4 * 2 * 2 * 19 * 40, 8 * 2 * 2 * 19 * 40)
        );
        // The allocating call on the inputs of `run`: its peak beyond the caller's buffers is
        // the gradients plus P and dS, and its gradients are right.
        let (_, want) = run(&kernels, c, 5);
        let mut rng = SplitMix64::new(5);
        let (qn, kn) = (2 * 19 * 2 * 64, 2 * 40 * 64);
        let (qx, kx, vx, dox) = (draw(qn, &mut rng), draw(kn, &mut rng), draw(kn, &mut rng), draw(qn, &mut rng));
        let up = |x: &[f32]| kernels.vm_upload(x).unwrap();
        let (q, k, v, d_o) = (up(&qx), up(&kx), up(&vx), up(&dox));
        let (qs, ks) = ([2, 19, 2, 64], [2, 40, 1, 64]);
        let t = |buf, s| TensorView::vm(buf, Dtype::F32, s).unwrap();
        let opts = AttnOpts::new().causal(true);
        let (o, lse) = kernels.flash_attn(&t(&q, qs), &t(&k, ks), &t(&v, ks), &opts).unwrap();
        let lse = LseView::vm(lse.as_vm().unwrap(), 2, 2, 19).unwrap();
        let ov = t(o.as_vm().unwrap(), qs);
        kernels.with_device(|d| d.memory_begin()).unwrap();
        let g =
            kernels.naive_attn_backward(&t(&q, qs), &t(&k, ks), &t(&v, ks), &ov, &lse, &t(&d_o, qs), &opts).unwrap();
        let got = [g.dq.to_vec_f32().unwrap(), g.dk.to_vec_f32().unwrap(), g.dv.to_vec_f32().unwrap()];
        drop(g);
        let m = kernels.with_device(|d| d.memory_end()).unwrap();
        assert_eq!(m.peak_delta_bytes, 4 * (qn + 2 * kn) as u64 + w.total_bytes);
        check("allocating", &c, &got, &want);
    }

    pub fn refusals_are_typed() {
        let kernels = Kernels::vm().unwrap();
        let s = [1, 4, 2, 64];
        let bufs: Vec<VmBuffer> = (0..7).map(|_| kernels.vm_alloc(1 << 12).unwrap()).collect();
        let lse = LseView::vm(&bufs[6], 1, 2, 4).unwrap();
        let call = |dtype: Dtype, d_o_shape, dq_buf: usize, opts: &AttnOpts<'_>| {
            let t = |i: usize, sh| TensorView::vm(&bufs[i], dtype, sh).unwrap();
            let tm = |i: usize| TensorViewMut::vm(&bufs[i], Dtype::F32, s).unwrap();
            let (mut dq, mut dk, mut dv) = (tm(dq_buf), tm(4), tm(5));
            kernels.naive_attn_backward_into(
                &t(0, s),
                &t(0, s),
                &t(0, s),
                &t(1, s),
                &lse,
                &t(2, d_o_shape),
                &mut dq,
                &mut dk,
                &mut dv,
                opts,
            )
        };
        let opts = AttnOpts::new();
        assert!(call(Dtype::F32, s, 3, &opts).is_ok());
        let e = call(Dtype::Bf16, s, 3, &opts).unwrap_err();
        assert!(matches!(e, AttnError::NotSupportedYet { .. }), "{e}");
        let e = call(Dtype::F32, [1, 4, 2, 32], 3, &opts).unwrap_err();
        assert!(matches!(e, AttnError::Shape { tensor: "d_o", .. }), "{e}");
        let e = call(Dtype::F32, s, 0, &opts).unwrap_err();
        assert!(matches!(e, AttnError::Aliasing { why: AliasRule::Overlap { written: "dq", other: "q", .. } }), "{e}");
        let e = call(Dtype::F32, s, 4, &opts).unwrap_err();
        assert!(matches!(e, AttnError::Aliasing { why: AliasRule::Overlap { .. } }), "{e}");
        // Head dims past the naive kernels' loop bound name it.
        let big = kernels.vm_alloc(1 << 16).unwrap();
        let t = TensorView::vm(&big, Dtype::F32, [1, 1, 1, 300]).unwrap();
        let (g1, g2, g3) =
            (kernels.vm_alloc(2048).unwrap(), kernels.vm_alloc(2048).unwrap(), kernels.vm_alloc(2048).unwrap());
        let tm = |b| TensorViewMut::vm(b, Dtype::F32, [1, 1, 1, 300]).unwrap();
        let l1 = kernels.vm_alloc(4).unwrap();
        let e = kernels
            .naive_attn_backward_into(
                &t,
                &t,
                &t,
                &t,
                &LseView::vm(&l1, 1, 1, 1).unwrap(),
                &t,
                &mut tm(&g1),
                &mut tm(&g2),
                &mut tm(&g3),
                &opts,
            )
            .unwrap_err();
        assert!(e.to_string().contains("256"), "{e}");
    }
}
