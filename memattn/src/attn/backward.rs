//! The backward of attention on caller buffers: [`Kernels::flash_attn_backward_into`],
//! FlashAttention-2's `_flash_attn_backward`: from q, k, v, the forward's `o` and `lse` and the
//! upstream gradient `d_o`, the gradients `dq`, `dk`, `dv`.
//!
//! Three launches on one stream (`kernels-gpu/src/flash_bwd_f32.rs`): the preprocess
//! (`D = rowsum(dO ∘ O)`, the f32 dQ accumulator zeroed), the main kernel (one block per key
//! tile and K/V head: P recomputed from LSE, dK and dV summed over the GQA group in registers,
//! dQ added with `red.global.add.f32`) and the dQ convert. The workspace — the dQ accumulator
//! (`4 · batch · seq_q · heads · head_dim` bytes) and D (`4 · batch · heads · seq_q`) — is
//! allocated by the call; no `N x N` buffer exists.

use super::*;
use kernels_gpu::abi::BwdParams;
use kernels_gpu::tiles::{BWD_ROWS, FLASH_BWD_F32_D128, FLASH_BWD_F32_D64};

/// The forward's LSE as an input of the backward: `[batch, heads, seq_q]` f32, contiguous,
/// natural log (what [`Kernels::flash_attn_into`] wrote into an [`LseViewMut`]).
pub struct LseView<'a>(TensorView<'a>);

impl<'a> LseView<'a> {
    /// An LSE view of a device buffer (VM or [`Kernels::on_device`]).
    pub fn vm(buf: &'a VmBuffer, batch: usize, heads: usize, seq_q: usize) -> Result<Self, AttnError> {
        Ok(LseView(TensorView::vm(buf, Dtype::F32, [batch, heads, seq_q, 1])?))
    }
    /// An LSE view of a cudarc f32 slice, for a launch on `stream`.
    pub fn cuda<S: DevicePtr<f32>>(
        slice: &'a S,
        stream: &'a Arc<CudaStream>,
        batch: usize,
        heads: usize,
        seq_q: usize,
    ) -> Result<Self, AttnError> {
        Ok(LseView(TensorView::cuda(slice, stream, [batch, heads, seq_q, 1])?))
    }
}

impl Kernels {
    /// Gradients of attention, FlashAttention-2's `_flash_attn_backward`: given the forward's
    /// inputs `q`, `k`, `v`, its output `o` and `lse` (from [`Kernels::flash_attn_into`] with
    /// the same `opts`) and the upstream gradient `d_o` (shaped like `o`), writes `dq` (like
    /// `q`), `dk` and `dv` (like `k` and `v`; with GQA summed over the query heads of each K/V
    /// head). Every view may have its own strides (contiguous last dimension). The conventions
    /// are those of `docs/semantics.md` (bottom-right causal, windows, soft cap through `tanh`);
    /// a query row that sees no key contributes nothing. The f64 gradients to check against are
    /// [`crate::reference::grad`].
    ///
    /// Supported now: f32 at head dims 64 and 128, causal, windows, soft cap and GQA/MQA.
    /// bf16/f16, other head dims, sinks (`d_sink`) and packed sequences are refused with a typed
    /// error, never answered wrongly. `dq`, `dk` and `dv` must each map their elements to
    /// distinct addresses and overlap no input and no other gradient ([`AttnError::Aliasing`]);
    /// the inputs may share memory. On CUDA the three launches are queued on the views' stream
    /// and the call returns without waiting; the workspace is freed in that stream's order.
    ///
    /// ```
    /// use memattn::attn::{AttnOpts, Kernels, LseView, LseViewMut, TensorView, TensorViewMut};
    /// use memattn::Dtype;
    ///
    /// let kernels = Kernels::vm()?;
    /// let shape = [1, 3, 1, 64];
    /// let n = 3 * 64;
    /// let x: Vec<f32> = (0..n).map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5).collect();
    /// let (q, k, v, d_o) = (kernels.vm_upload(&x)?, kernels.vm_upload(&x)?, kernels.vm_upload(&x)?, kernels.vm_upload(&x)?);
    /// let (o, lse, dq, dk, dv) = (kernels.vm_alloc(4 * n as u64)?, kernels.vm_alloc(12)?,
    ///     kernels.vm_alloc(4 * n as u64)?, kernels.vm_alloc(4 * n as u64)?, kernels.vm_alloc(4 * n as u64)?);
    /// let view = |b| TensorView::vm(b, Dtype::F32, shape);
    /// let opts = AttnOpts::new().causal(true);
    /// kernels.flash_attn_into(&view(&q)?, &view(&k)?, &view(&v)?,
    ///     &mut TensorViewMut::vm(&o, Dtype::F32, shape)?, &mut LseViewMut::vm(&lse, 1, 1, 3)?, &opts)?;
    /// kernels.flash_attn_backward_into(&view(&q)?, &view(&k)?, &view(&v)?, &view(&o)?,
    ///     &LseView::vm(&lse, 1, 1, 3)?, &view(&d_o)?,
    ///     &mut TensorViewMut::vm(&dq, Dtype::F32, shape)?, &mut TensorViewMut::vm(&dk, Dtype::F32, shape)?,
    ///     &mut TensorViewMut::vm(&dv, Dtype::F32, shape)?, &opts)?;
    /// // Causal: the last key is seen by the last row only, with weight P, so dv[2] = P · d_o[2].
    /// let (g, want) = (dv.read_f32(Dtype::F32, n)?, memattn::reference::grad::attention_backward(
    ///     &memattn::Problem { batch: 1, heads: 1, seq_q: 3, seq_kv: 3, head_dim: 64, causal: true,
    ///         ..Default::default() }, &x, &x, &x, &x, &[]).unwrap());
    /// assert!(g.iter().zip(&want.dv).all(|(a, b)| (*a as f64 - b).abs() < 1e-5));
    /// # Ok::<(), memattn::attn::AttnError>(())
    /// ```
    #[allow(clippy::too_many_arguments)] // FlashAttention-2's signature on caller buffers
    pub fn flash_attn_backward_into(
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
        // The forward's validation of q, k, v, o, lse and the options (shapes, dtypes, places,
        // strides, bounds, head dim, grid limits): one rule for both directions.
        let outs = (&o.raw, o.stream.as_deref(), Some(lse.0.raw), lse.0.stream.as_deref());
        let plan = self.plan(KernelKind::Flash, q, k, v, Some(outs), None, opts, None)?;
        let dtype = q.raw.dtype;
        if dtype != Dtype::F32 {
            return Err(AttnError::NotSupportedYet {
                feature: "the backward in bf16/f16 (the backward kernels are f32 SIMT; run it on f32 tensors)",
            });
        }
        if opts.sinks.is_some() {
            return Err(AttnError::NotSupportedYet { feature: "sinks in the backward (d_sink is not computed yet)" });
        }
        let [b, sq, h, d] = q.raw.shape;
        let [_, skv, hk, _] = k.raw.shape;
        let kernels = KernelId::flash_bwd(dtype.elem(), d as u32).ok_or_else(|| {
            AttnError::Problem(ProblemError::UnsupportedHeadDim {
                kernel: KernelKind::Flash,
                got: d as u32,
                supported: format!(
                    "the {dtype} backward kernels are compiled for head_dim {}",
                    crate::problem::list_and(&KernelId::flash_bwd_head_dims(dtype.elem()))
                ),
            })
        })?;
        // The gradients' views: on the kernels' device and q's stream, f32, shaped like their
        // tensors, contiguous in head_dim, within their buffers.
        let grads: [(&'static str, &RawView, Option<&CudaStream>, [usize; 4]); 4] = [
            ("d_o", &d_o.raw, d_o.stream.as_deref(), q.raw.shape),
            ("dq", &dq.raw, dq.stream.as_deref(), q.raw.shape),
            ("dk", &dk.raw, dk.stream.as_deref(), k.raw.shape),
            ("dv", &dv.raw, dv.stream.as_deref(), v.raw.shape),
        ];
        let places: Vec<_> = grads.iter().map(|(n, t, s, _)| (*n, *t, *s)).collect();
        self.check_places(&places, &q.raw)?;
        for (name, t, _, want) in &grads {
            if t.dtype != dtype {
                return Err(AttnError::Dtype { tensor: name, got: t.dtype, expected: dtype });
            }
            if t.shape != *want {
                let of = if want == &q.raw.shape { "q's" } else { "k's and v's" };
                return Err(AttnError::Shape {
                    tensor: name,
                    got: t.shape,
                    why: ShapeRule::Output { of, want: *want },
                });
            }
            if t.strides[3] != 1 {
                return Err(AttnError::InnerStride { tensor: name, stride: t.strides[3] });
            }
            t.check_bounds(name)?;
        }
        // The gradients are written: each one-to-one, none overlapping an input or another
        // gradient (the inputs may share memory with each other, as in the forward).
        for (name, t) in [("dq", &dq.raw), ("dk", &dk.raw), ("dv", &dv.raw)] {
            alias::check_injective(name, t)?;
        }
        alias::check_disjoint(&[
            alias::Extent::of_view("q", &q.raw, false),
            alias::Extent::of_view("k", &k.raw, false),
            alias::Extent::of_view("v", &v.raw, false),
            alias::Extent::of_view("o", &o.raw, false),
            alias::Extent::of_view("lse", &lse.0.raw, false),
            alias::Extent::of_view("d_o", &d_o.raw, false),
            alias::Extent::of_view("dq", &dq.raw, true),
            alias::Extent::of_view("dk", &dk.raw, true),
            alias::Extent::of_view("dv", &dv.raw, true),
        ])?;
        self.check_module(&kernels)?;

        // Workspace: the f32 dQ accumulator [b, sq, h, d] and D [b, h, sq].
        let accum_bytes = (b * sq * h * d) as u64 * 4;
        let delta_bytes = (b * h * sq) as u64 * 4;
        let (accum, delta) = self.alloc_outputs(q, accum_bytes, delta_bytes)?;
        let params = BwdParams {
            attn: plan.params,
            d_o: d_o.raw.ptr,
            delta: delta.ptr(),
            dq_accum: accum.ptr(),
            dq: dq.raw.ptr,
            dk: dk.raw.ptr,
            dv: dv.raw.ptr,
            dsinks: 0,
            d_o_strides: d_o.raw.kernel_strides(),
            dq_accum_strides: Strides::bshd(sq as u64, h as u64, d as u64),
            dq_strides: dq.raw.kernel_strides(),
            dk_strides: dk.raw.kernel_strides(),
            dv_strides: dv.raw.kernel_strides(),
        };
        let main_tile = match kernels[1] {
            KernelId::FlashBwdF32D64 => FLASH_BWD_F32_D64,
            KernelId::FlashBwdF32D128 => FLASH_BWD_F32_D128,
            other => unreachable!("flash_bwd returned {other:?}, not a main backward kernel"),
        };
        let (bu, hu, squ) = (b as u32, h as u32, sq as u32);
        let dims =
            [BWD_ROWS.launch(bu, hu, squ), main_tile.launch(bu, hk as u32, skv as u32), BWD_ROWS.launch(bu, hu, squ)];
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
        let bytes = params.to_bytes();
        for (kernel, dims) in kernels.iter().zip(&dims) {
            self.launch_bytes(*kernel, dims, &bytes, q.stream.as_deref())?;
        }
        // The workspace is dropped here: in the VM after the launches ran, on CUDA freed in the
        // stream's order (after them).
        drop((accum, delta));
        Ok(())
    }
}

#[cfg(all(test, feature = "vm"))]
mod tests {
    use super::*;
    use crate::reference::grad::{attention_backward, Grads};
    use crate::rng::SplitMix64;

    /// One backward case: sizes and options.
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
    }

    const BASE: Case = Case { b: 1, h: 1, hk: 1, sq: 1, skv: 1, d: 64, causal: false, window: (-1, -1), softcap: 0.0 };

    const NAN: u32 = 0x7fc0_0000;

    fn draw(n: usize, rng: &mut SplitMix64) -> Vec<f32> {
        (0..n).map(|_| rng.below(2001) as f32 / 1000.0 - 1.0).collect()
    }

    /// Forward then backward in the VM (gradients poisoned with NaN first); returns the kernels'
    /// dq, dk, dv and the f64 reference's gradients.
    fn run(kernels: &Kernels, c: Case, seed: u64) -> ([Vec<f32>; 3], Grads) {
        let mut rng = SplitMix64::new(seed);
        let (qn, kn) = (c.b * c.sq * c.h * c.d, c.b * c.skv * c.hk * c.d);
        let (qx, kx, vx, dox) = (draw(qn, &mut rng), draw(kn, &mut rng), draw(kn, &mut rng), draw(qn, &mut rng));
        let up = |x: &[f32]| kernels.vm_upload(x).unwrap();
        let (q, k, v, d_o) = (up(&qx), up(&kx), up(&vx), up(&dox));
        let alloc = |n: usize| {
            let buf = kernels.vm_alloc(4 * n as u64).unwrap();
            buf.fill_u32(n as u64, NAN).unwrap();
            buf
        };
        let (o, lse, dq, dk, dv) = (alloc(qn), alloc(c.b * c.h * c.sq), alloc(qn), alloc(kn), alloc(kn));
        let (qs, ks) = ([c.b, c.sq, c.h, c.d], [c.b, c.skv, c.hk, c.d]);
        let t = |buf, s| TensorView::vm(buf, Dtype::F32, s).unwrap();
        let tm = |buf, s| TensorViewMut::vm(buf, Dtype::F32, s).unwrap();
        let mut opts = AttnOpts::new().causal(c.causal).window_size(c.window.0, c.window.1);
        if c.softcap > 0.0 {
            opts = opts.softcap(c.softcap);
        }
        kernels
            .flash_attn_into(
                &t(&q, qs),
                &t(&k, ks),
                &t(&v, ks),
                &mut tm(&o, qs),
                &mut LseViewMut::vm(&lse, c.b, c.h, c.sq).unwrap(),
                &opts,
            )
            .unwrap();
        kernels
            .flash_attn_backward_into(
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
        let p = Problem {
            batch: c.b as u32,
            heads: c.h as u32,
            heads_kv: Some(c.hk as u32),
            seq_q: c.sq as u32,
            seq_kv: c.skv as u32,
            head_dim: c.d as u32,
            causal: c.causal,
            window: c.window,
            softcap: c.softcap,
            ..Problem::default()
        };
        let want = attention_backward(&p, &qx, &kx, &vx, &dox, &[]).unwrap();
        ([read(&dq, qn), read(&dk, kn), read(&dv, kn)], want)
    }

    /// Max |got - want| over max |want| (at least 1e-3), NaN-propagating: an unwritten
    /// (poisoned) element fails.
    fn rel_err(got: &[f32], want: &[f64]) -> f64 {
        let scale = want.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
        got.iter().zip(want).fold(0.0f64, |m, (a, b)| {
            let e = (*a as f64 - b).abs();
            if e.is_nan() || m.is_nan() {
                f64::NAN
            } else {
                m.max(e)
            }
        }) / scale
    }

    /// f32 accumulation over at most a few hundred terms: measured 2e-7 to 5e-7 of the
    /// gradient's scale on these cases; 5e-6 leaves a factor of 10.
    const TOL: f64 = 5e-6;

    #[test]
    fn gradients_match_the_f64_reference() {
        let kernels = Kernels::vm().unwrap();
        let cases = [
            ("length 1", BASE),
            // Several key blocks and query tiles (neither a tile multiple), GQA, two batches.
            ("GQA, seq_q != seq_kv", Case { b: 2, h: 4, hk: 2, sq: 37, skv: 50, ..BASE }),
            // Causal with seq_q > seq_kv: the first 25 rows see no key (LSE = -inf).
            ("MQA causal, fully masked rows", Case { h: 2, sq: 45, skv: 20, causal: true, ..BASE }),
            ("d128 causal", Case { h: 2, sq: 33, skv: 40, d: 128, causal: true, ..BASE }),
            ("window and soft cap", Case { h: 2, hk: 1, sq: 40, skv: 70, window: (9, 3), softcap: 2.0, ..BASE }),
        ];
        for (seed, (what, c)) in cases.iter().enumerate() {
            let (got, want) = run(&kernels, *c, seed as u64 + 1);
            for (name, g, w) in [("dq", &got[0], &want.dq), ("dk", &got[1], &want.dk), ("dv", &got[2], &want.dv)] {
                let e = rel_err(g, w);
                assert!(e <= TOL, "{what} {c:?}: {name} relative error {e:.3e} > {TOL:.0e}");
            }
        }
    }

    #[test]
    fn atomic_dq_adds_survive_several_workers() {
        // Four VM workers run the key blocks concurrently, so the `red.global.add.f32` adds of
        // different blocks to one dQ row interleave for real; memcheck, initcheck and racecheck
        // stay on. Every add must land: the result matches the reference as with one worker.
        use crate::device::{vm::VmDevice, BackendChoice, DeviceOptions};
        use crate::ptx::PtxSource;
        let mut opts = DeviceOptions::new(BackendChoice::Vm, PtxSource::embedded());
        opts.vm_workers = Some(4);
        let kernels = Kernels::on_device(Box::new(VmDevice::new(&opts).unwrap()));
        let c = Case { b: 2, h: 4, hk: 2, sq: 37, skv: 100, causal: true, ..BASE };
        let (got, want) = run(&kernels, c, 7);
        for (name, g, w) in [("dq", &got[0], &want.dq), ("dk", &got[1], &want.dk), ("dv", &got[2], &want.dv)] {
            let e = rel_err(g, w);
            assert!(e <= TOL, "{c:?} with 4 workers: {name} relative error {e:.3e} > {TOL:.0e}");
        }
    }

    #[test]
    fn refusals_are_typed() {
        let kernels = Kernels::vm().unwrap();
        let buf = kernels.vm_alloc(1 << 16).unwrap();
        let s = [1, 4, 2, 64];
        let t = |dtype, s| TensorView::vm(&buf, dtype, s).unwrap();
        let tm = |s| TensorViewMut::vm(&buf, Dtype::F32, s).unwrap();
        let lse = LseView::vm(&buf, 1, 2, 4).unwrap();
        let call = |q: &TensorView<'_>, dq_shape, opts: &AttnOpts<'_>| {
            let (mut dq, mut dk, mut dv) = (tm(dq_shape), tm(s), tm(s));
            kernels.flash_attn_backward_into(
                q,
                &t(q.dtype(), s),
                &t(q.dtype(), s),
                &t(q.dtype(), s),
                &lse,
                &t(q.dtype(), s),
                &mut dq,
                &mut dk,
                &mut dv,
                opts,
            )
        };
        let e = call(&t(Dtype::F32, s), [1, 4, 2, 32], &AttnOpts::new()).unwrap_err();
        assert!(matches!(e, AttnError::Shape { tensor: "dq", .. }), "{e}");
        let e = call(&t(Dtype::Bf16, s), s, &AttnOpts::new()).unwrap_err();
        assert!(matches!(e, AttnError::NotSupportedYet { .. }), "{e}");
        let s96 = [1, 4, 2, 96];
        let (mut dq, mut dk, mut dv) = (tm(s96), tm(s96), tm(s96));
        let v96 = t(Dtype::F32, s96);
        let e = kernels
            .flash_attn_backward_into(&v96, &v96, &v96, &v96, &lse, &v96, &mut dq, &mut dk, &mut dv, &AttnOpts::new())
            .unwrap_err();
        assert!(e.to_string().contains("head_dim 64 and 128"), "{e}");
        let sinks_buf = kernels.vm_upload(&[0.5, 0.5]).unwrap();
        let sinks = SinksView::vm(&sinks_buf, 2).unwrap();
        let e = call(&t(Dtype::F32, s), s, &AttnOpts::new().sinks(&sinks)).unwrap_err();
        assert!(e.to_string().contains("sinks"), "{e}");
        // A gradient view past its buffer.
        let small = kernels.vm_alloc(64).unwrap();
        let (mut dq, mut dk, mut dv) = (tm(s), tm(s), TensorViewMut::vm(&small, Dtype::F32, s).unwrap());
        let v = t(Dtype::F32, s);
        let e = kernels
            .flash_attn_backward_into(&v, &v, &v, &v, &lse, &v, &mut dq, &mut dk, &mut dv, &AttnOpts::new())
            .unwrap_err();
        assert!(matches!(e, AttnError::OutOfBounds { tensor: "dv", .. }), "{e}");
        // Gradients written over the inputs, or over each other, are refused before any launch.
        let e = call(&t(Dtype::F32, s), s, &AttnOpts::new()).unwrap_err();
        assert!(matches!(e, AttnError::Aliasing { why: AliasRule::Overlap { written: "dq", other: "q", .. } }), "{e}");
        let (x, gq, gk) = (
            kernels.vm_alloc(1 << 12).unwrap(),
            kernels.vm_alloc(1 << 12).unwrap(),
            kernels.vm_alloc(1 << 12).unwrap(),
        );
        let v = t(Dtype::F32, s);
        let (xv, mut dq) = (TensorView::vm(&x, Dtype::F32, s).unwrap(), TensorViewMut::vm(&gq, Dtype::F32, s).unwrap());
        let (mut dk, mut dv) =
            (TensorViewMut::vm(&gk, Dtype::F32, s).unwrap(), TensorViewMut::vm(&gk, Dtype::F32, s).unwrap());
        let e = kernels
            .flash_attn_backward_into(&v, &v, &v, &v, &lse, &xv, &mut dq, &mut dk, &mut dv, &AttnOpts::new())
            .unwrap_err();
        assert!(matches!(e, AttnError::Aliasing { why: AliasRule::Overlap { written: "dk", other: "dv", .. } }), "{e}");
        let mut shared = TensorViewMut::vm(&gk, Dtype::F32, s).unwrap().with_strides([0, 0, 0, 1]);
        let mut dv = TensorViewMut::vm(&x, Dtype::F32, s).unwrap();
        let e = kernels
            .flash_attn_backward_into(&v, &v, &v, &v, &lse, &v, &mut dq, &mut shared, &mut dv, &AttnOpts::new())
            .unwrap_err();
        assert!(matches!(e, AttnError::Aliasing { why: AliasRule::SelfOverlap { tensor: "dk", .. } }), "{e}");
    }
}
