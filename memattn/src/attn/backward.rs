//! The backward of attention: [`Kernels::flash_attn_backward_into`] (and `_into_with`, with
//! [`BwdOpts`]), the allocating [`Kernels::flash_attn_backward`] and the packed
//! [`Kernels::flash_attn_varlen_backward_into`], FlashAttention-2's `_flash_attn_backward`: from
//! q, k, v, the forward's `o` and `lse` and the upstream gradient `d_o`, the gradients `dq`, `dk`,
//! `dv` (and with sinks `d_sink`).
//!
//! Three launches on one stream (`kernels-gpu/src/flash_bwd_f32.rs`; for bf16 and f16 the main
//! kernel is `kernels-gpu/src/flash_bwd_mma.rs`, on tensor cores): the preprocess
//! (`D = rowsum(dO ∘ O)`, the atomic mode's f32 dQ accumulator zeroed), the main kernel (one
//! block per key tile and K/V head: P recomputed from LSE, dK and dV summed over the GQA group in
//! registers, dQ added with `red.global.add.f32`, or in deterministic mode stored into the key
//! block's own slice) and the dQ convert (which also writes `d_sink`). The workspace
//! ([`flash_attn_backward_workspace`]) is allocated by the call; no `N x N` buffer exists.

use super::*;
use kernels_gpu::abi::BwdParams;
use kernels_gpu::tiles::{LaunchDims, BWD_ROWS};

/// The forward's LSE as an input of the backward: `[batch, heads, seq_q]` f32, contiguous,
/// natural log (what [`Kernels::flash_attn_into`] wrote into an [`LseViewMut`]).
pub struct LseView<'a>(pub(super) TensorView<'a>);

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

/// The gradient of the per-head sink logits, an output of the backward: `[heads]` f32,
/// contiguous, on the kernels' device ([`BwdOpts::d_sinks`]).
pub struct SinksViewMut<'a>(TensorViewMut<'a>);

impl<'a> SinksViewMut<'a> {
    /// `heads` f32 from the start of a device buffer (VM or [`Kernels::on_device`]).
    pub fn vm(buf: &'a VmBuffer, heads: usize) -> Result<Self, AttnError> {
        Ok(SinksViewMut(TensorViewMut::vm(buf, Dtype::F32, [1, 1, heads, 1])?))
    }
    /// A cudarc f32 slice, for a launch on `stream`.
    pub fn cuda<S: DevicePtrMut<f32>>(
        slice: &'a mut S,
        stream: &'a Arc<CudaStream>,
        heads: usize,
    ) -> Result<Self, AttnError> {
        Ok(SinksViewMut(TensorViewMut::cuda(slice, stream, [1, 1, heads, 1])?))
    }
    /// The number of heads.
    pub fn heads(&self) -> usize {
        self.0.raw.shape[2]
    }
}

/// Options of the backward beyond the forward's [`AttnOpts`]: `BwdOpts::new().deterministic(true)`.
#[derive(Default)]
#[non_exhaustive]
pub struct BwdOpts<'a> {
    deterministic: bool,
    d_sinks: Option<SinksViewMut<'a>>,
}

impl<'a> BwdOpts<'a> {
    /// The defaults: atomic dQ accumulation, no sink gradient.
    pub fn new() -> Self {
        Self::default()
    }
    /// Deterministic dQ: every key block writes its partial dQ to a slice of its own and the
    /// slices are summed in key order, so dq is bitwise the same run to run (dk, dv and d_sink
    /// always are). It costs workspace: one f32 copy of q's shape per key block of the head
    /// dim's kernel ([`flash_attn_backward_workspace`] says how many bytes). The default adds
    /// the partials with `red.global.add.f32`, whose order, and so dq's last bits, varies.
    pub fn deterministic(mut self, on: bool) -> Self {
        self.deterministic = on;
        self
    }
    /// Also write `d_sink[h] = -Σ_rows exp(sink[h] - LSE) · D` (`D = rowsum(dO ∘ O)`, the sum
    /// over every query row of every batch or sequence) for the sinks in [`AttnOpts::sinks`]
    /// (one per query head). Without it the sinks still enter dq, dk and dv through LSE.
    pub fn d_sinks(mut self, d_sinks: SinksViewMut<'a>) -> Self {
        self.d_sinks = Some(d_sinks);
        self
    }
    /// Whether the dQ partials are summed deterministically.
    pub fn is_deterministic(&self) -> bool {
        self.deterministic
    }
}

/// Device memory a backward call allocates for itself (beyond its inputs and outputs), from
/// [`flash_attn_backward_workspace`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BwdWorkspace {
    /// dQ slices: 1 (atomic) or the key blocks of the main kernel (deterministic).
    pub dq_slices: u64,
    /// Keys per key block of the main kernel for this head dim.
    pub key_block: u32,
    /// `dq_slices · 4 · batch · seq_q · heads · head_dim`.
    pub dq_accum_bytes: u64,
    /// `D = rowsum(dO ∘ O)`: `4 · batch · heads · seq_q`.
    pub delta_bytes: u64,
    /// `dq_accum_bytes + delta_bytes`.
    pub total_bytes: u64,
}

/// The workspace of a backward call on `dtype` tensors with q of shape `q_shape` (`[batch,
/// seq_q, heads, head_dim]`; varlen `[1, total_q, heads, head_dim]`), `seq_kv` keys (varlen: the
/// longest sequence, `max_seqlen_k`) and the mode of `deterministic`
/// ([`BwdOpts::deterministic`]). The dQ accumulator is f32 whatever the dtype; the key block
/// is the main kernel's (32 keys or fewer for f32; 128 at d64 and 64 otherwise for bf16 and
/// f16). This is the workspace on a GPU whose blocks may opt in to 128 KiB of shared memory
/// (A100, H100, H200, the VM); GPUs with less (sm_86, sm_89: 99 KiB) run the compact bf16/f16
/// kernels, whose key block is 64, so their deterministic workspace at d64 is twice this.
/// [`Kernels::flash_attn_backward_workspace`] gives the workspace on the kernels' own device.
/// Atomic mode: one f32 dQ accumulator plus D, O(N·d). Deterministic mode: `ceil(seq_kv /
/// key_block)` accumulators, which grows as `N² · d / key_block`. A head dim without a backward
/// kernel in `dtype` is [`ProblemError::UnsupportedHeadDim`]; a byte count past `u64`,
/// [`ProblemError::TooLarge`].
///
/// ```
/// use memattn::Dtype;
/// let w = memattn::attn::flash_attn_backward_workspace(Dtype::F32, [1, 100, 2, 64], 100, true)?;
/// assert_eq!((w.key_block, w.dq_slices), (32, 4)); // ceil(100 / 32) key blocks
/// assert_eq!(w.dq_accum_bytes, 4 * 4 * 100 * 2 * 64);
/// assert_eq!(w.delta_bytes, 4 * 2 * 100);
/// let w = memattn::attn::flash_attn_backward_workspace(Dtype::Bf16, [1, 100, 2, 64], 100, true)?;
/// assert_eq!((w.key_block, w.dq_slices), (128, 1));
/// # Ok::<(), memattn::attn::AttnError>(())
/// ```
pub fn flash_attn_backward_workspace(
    dtype: Dtype,
    q_shape: [usize; 4],
    seq_kv: usize,
    deterministic: bool,
) -> Result<BwdWorkspace, AttnError> {
    flash_attn_backward_workspace_on(dtype, q_shape, seq_kv, deterministic, u32::MAX)
}

/// [`flash_attn_backward_workspace`] on a device whose blocks may opt in to `max_smem_bytes` of
/// dynamic shared memory (`DeviceCaps::max_dynamic_smem_bytes`): the main kernel is the one
/// [`KernelId::flash_bwd_for`] picks there.
pub fn flash_attn_backward_workspace_on(
    dtype: Dtype,
    q_shape: [usize; 4],
    seq_kv: usize,
    deterministic: bool,
    max_smem_bytes: u32,
) -> Result<BwdWorkspace, AttnError> {
    workspace_of(&MainKernel::of(dtype, q_shape[3], max_smem_bytes)?, q_shape, seq_kv, deterministic)
}

/// [`flash_attn_backward_workspace`] of the main kernel `main`.
fn workspace_of(
    main: &MainKernel,
    q_shape: [usize; 4],
    seq_kv: usize,
    deterministic: bool,
) -> Result<BwdWorkspace, AttnError> {
    let [b, sq, h, d] = q_shape;
    let dq_slices = if deterministic { seq_kv.div_ceil(main.key_block as usize).max(1) as u128 } else { 1 };
    let slice = b as u128 * sq as u128 * h as u128 * d as u128 * 4;
    let delta = b as u128 * h as u128 * sq as u128 * 4;
    let accum = dq_slices * slice;
    let total = accum + delta;
    if total > u64::MAX as u128 {
        return Err(ProblemError::TooLarge { what: "the backward's dQ workspace", got: total.to_string() }.into());
    }
    Ok(BwdWorkspace {
        dq_slices: dq_slices as u64,
        key_block: main.key_block,
        dq_accum_bytes: accum as u64,
        delta_bytes: delta as u64,
        total_bytes: total as u64,
    })
}

/// The backward's kernels for `dtype` and a head dim: `[preprocess, main, convert]`, the main
/// kernel's key block and its launch geometry.
#[derive(Clone, Copy)]
struct MainKernel {
    kernels: [KernelId; 3],
    key_block: u32,
    tile: kernels_gpu::variants::Tile,
}

impl MainKernel {
    /// The kernels of `dtype` at `head_dim` on a device whose blocks may use `max_smem_bytes`
    /// of dynamic shared memory ([`KernelId::flash_bwd_for`]), or the refusal naming the head
    /// dims there are.
    fn of(dtype: Dtype, head_dim: usize, max_smem_bytes: u32) -> Result<Self, AttnError> {
        let elem = dtype.elem();
        let unsupported = || {
            AttnError::Problem(ProblemError::UnsupportedHeadDim {
                kernel: KernelKind::Flash,
                got: head_dim.min(u32::MAX as usize) as u32,
                supported: format!(
                    "the {} backward kernels are compiled for head_dim {}; {}",
                    dtype.name(),
                    crate::problem::list_and(&KernelId::flash_bwd_head_dims(elem)),
                    crate::problem::PADDED_HEAD_DIMS
                ),
            })
        };
        let d = u32::try_from(head_dim).map_err(|_| unsupported())?;
        let kernels = KernelId::flash_bwd_for(elem, d, max_smem_bytes).ok_or_else(unsupported)?;
        let tile = kernels[1].variant().tile;
        let key_block = kernels[1].variant().block_cols();
        Ok(MainKernel { kernels, key_block, tile })
    }

    /// Grid `(ceil(seq_kv / key_block), heads_kv, batch)` and the block of the main kernel.
    fn launch(&self, batch: u32, heads_kv: u32, seq_kv: u32) -> LaunchDims {
        match self.tile {
            kernels_gpu::variants::Tile::FlashBwdF32(t) => t.launch(batch, heads_kv, seq_kv),
            kernels_gpu::variants::Tile::FlashBwdMma(t) => t.launch(batch, heads_kv, seq_kv),
            kernels_gpu::variants::Tile::FlashBwdTc(t) => t.launch(batch, heads_kv, seq_kv),
            _ => unreachable!("KernelId::flash_bwd returns a backward main kernel"),
        }
    }
}

/// dq, dk and dv from [`Kernels::flash_attn_backward`], on the kernels' device: dq shaped like
/// q, dk and dv like k and v, contiguous.
#[derive(Debug)]
#[non_exhaustive]
pub struct Gradients {
    /// The gradient of q, shaped like q.
    pub dq: DeviceTensor,
    /// The gradient of k, shaped like k.
    pub dk: DeviceTensor,
    /// The gradient of v, shaped like v.
    pub dv: DeviceTensor,
}

/// The gradient views of an `_into` call: dq, dk, dv (raw view and stream each).
type GradViews<'v> = [(&'v RawView, Option<&'v CudaStream>); 3];

impl Kernels {
    /// [`flash_attn_backward_workspace`] on this device: the main kernel is the one its
    /// shared memory per block allows (the compact bf16/f16 kernels below 128 KiB).
    pub fn flash_attn_backward_workspace(
        &self,
        dtype: Dtype,
        q_shape: [usize; 4],
        seq_kv: usize,
        deterministic: bool,
    ) -> Result<BwdWorkspace, AttnError> {
        let caps = self.caps()?;
        flash_attn_backward_workspace_on(dtype, q_shape, seq_kv, deterministic, caps.max_dynamic_smem_bytes)
    }

    /// Gradients of attention, FlashAttention-2's `_flash_attn_backward`: given the forward's
    /// inputs `q`, `k`, `v`, its output `o` and `lse` (from [`Kernels::flash_attn_into`] with
    /// the same `opts`) and the upstream gradient `d_o` (shaped like `o`), writes `dq` (like
    /// `q`), `dk` and `dv` (like `k` and `v`; with GQA summed over the query heads of each K/V
    /// head). Every view may have its own strides (contiguous last dimension). The conventions
    /// are those of `docs/semantics.md` (bottom-right causal, windows, soft cap through `tanh`,
    /// sinks through LSE); a query row that sees no key contributes nothing. The f64 gradients
    /// to check against are [`crate::reference::grad`]. The options of the backward alone
    /// (deterministic dQ, the sinks' gradient) are [`Kernels::flash_attn_backward_into_with`]'s.
    ///
    /// Supported: f32, bf16 and f16 at the head dims of `KernelId::flash_bwd_head_dims` (f32
    /// SIMT kernels; bf16/f16 on tensor cores, whose `d_o`, `dq`, `dk` and `dv` are of q's
    /// dtype and whose rows follow the forward's alignment rules, dk and dv 4-byte aligned),
    /// causal, windows, soft cap, GQA/MQA and sinks. Other head dims are refused with a typed
    /// error, never answered wrongly. `dq`, `dk` and `dv` must each map their elements to
    /// distinct addresses and overlap no input and no other gradient ([`AttnError::Aliasing`]);
    /// the inputs may share memory. On CUDA the three launches are queued on the views' stream
    /// and the call returns without waiting; the workspace ([`flash_attn_backward_workspace`])
    /// is freed in that stream's order.
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
        self.flash_attn_backward_into_with(q, k, v, o, lse, d_o, dq, dk, dv, opts, &BwdOpts::new())
    }

    /// [`Kernels::flash_attn_backward_into`] with the backward's own options `bwd`:
    /// [`BwdOpts::deterministic`] (dq bitwise reproducible, at the workspace cost
    /// [`flash_attn_backward_workspace`] states) and [`BwdOpts::d_sinks`] (the gradient of the
    /// sink logits of `opts`; asking for it without sinks is [`AttnError::Sinks`], a view of
    /// another head count too). `d_sinks` is written, so it may overlap nothing else.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attn_backward_into_with(
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
        bwd: &BwdOpts<'_>,
    ) -> Result<(), AttnError> {
        let grads = [(&dq.raw, dq.stream.as_deref()), (&dk.raw, dk.stream.as_deref()), (&dv.raw, dv.stream.as_deref())];
        self.backward(q, k, v, o, lse, d_o, Some(grads), opts, bwd, None).map(|_| ())
    }

    /// The allocating form of [`Kernels::flash_attn_backward_into_with`]: dq, dk and dv in
    /// buffers memattn allocates on the kernels' device (on CUDA on q's stream), contiguous.
    /// Everything is validated before anything is allocated.
    ///
    /// ```
    /// use memattn::attn::{AttnOpts, BwdOpts, Kernels, LseView, TensorView};
    /// use memattn::Dtype;
    ///
    /// let kernels = Kernels::vm()?;
    /// let shape = [1, 5, 2, 64];
    /// let x: Vec<f32> = (0..5 * 2 * 64).map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5).collect();
    /// let buf = kernels.vm_upload(&x)?;
    /// let t = TensorView::vm(&buf, Dtype::F32, shape)?;
    /// let opts = AttnOpts::new().causal(true);
    /// let (o, lse) = kernels.flash_attn(&t, &t, &t, &opts)?;
    /// let (ob, lb) = (o.as_vm().unwrap(), lse.as_vm().unwrap());
    /// let g = kernels.flash_attn_backward(&t, &t, &t, &TensorView::vm(ob, Dtype::F32, shape)?,
    ///     &LseView::vm(lb, 1, 2, 5)?, &t, &opts, &BwdOpts::new().deterministic(true))?;
    /// let want = memattn::reference::grad::attention_backward(&memattn::Problem { batch: 1, heads: 2,
    ///     seq_q: 5, seq_kv: 5, head_dim: 64, causal: true, ..Default::default() }, &x, &x, &x, &x, &[]).unwrap();
    /// let dq = g.dq.to_vec_f32()?;
    /// assert!(dq.iter().zip(&want.dq).all(|(a, b)| (*a as f64 - b).abs() < 1e-5));
    /// # Ok::<(), memattn::attn::AttnError>(())
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attn_backward(
        &self,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        o: &TensorView<'_>,
        lse: &LseView<'_>,
        d_o: &TensorView<'_>,
        opts: &AttnOpts<'_>,
        bwd: &BwdOpts<'_>,
    ) -> Result<Gradients, AttnError> {
        let g = self.backward(q, k, v, o, lse, d_o, None, opts, bwd, None)?;
        Ok(g.expect("the allocating backward returns its gradients"))
    }

    /// The backward of [`Kernels::flash_attn_varlen_into`] (packed sequences): `q`, `o`, `d_o`
    /// and `dq` are `[1, total_q, heads, head_dim]`, `k`, `v`, `dk`, `dv` `[1, total_kv,
    /// heads_kv, head_dim]`, `lse` the forward's `[1, heads, total_q]`; the cu_seqlens and
    /// maxima are the forward's (the same rules, [`AttnError::SeqLens`]). Each sequence's
    /// gradients are its own: keys of one sequence get nothing from another's queries.
    /// `d_sinks` sums over every row of every sequence.
    #[allow(clippy::too_many_arguments)] // FlashAttention-2's signature plus the outputs
    pub fn flash_attn_varlen_backward_into(
        &self,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        cu_seqlens_q: &IndexTensor,
        cu_seqlens_k: &IndexTensor,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
        o: &TensorView<'_>,
        lse: &LseView<'_>,
        d_o: &TensorView<'_>,
        dq: &mut TensorViewMut<'_>,
        dk: &mut TensorViewMut<'_>,
        dv: &mut TensorViewMut<'_>,
        opts: &AttnOpts<'_>,
        bwd: &BwdOpts<'_>,
    ) -> Result<(), AttnError> {
        let va = VarlenArgs { cu_q: cu_seqlens_q, cu_kv: cu_seqlens_k, max_q: max_seqlen_q, max_kv: max_seqlen_k };
        let grads = [(&dq.raw, dq.stream.as_deref()), (&dk.raw, dk.stream.as_deref()), (&dv.raw, dv.stream.as_deref())];
        self.backward(q, k, v, o, lse, d_o, Some(grads), opts, bwd, Some(&va)).map(|_| ())
    }

    /// The one road of every backward call: validate, allocate the gradients when `grads` is
    /// `None` (the allocating form), allocate the workspace, launch the three kernels.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        o: &TensorView<'_>,
        lse: &LseView<'_>,
        d_o: &TensorView<'_>,
        grads: Option<GradViews<'_>>,
        opts: &AttnOpts<'_>,
        bwd: &BwdOpts<'_>,
        varlen: Option<&VarlenArgs<'_>>,
    ) -> Result<Option<Gradients>, AttnError> {
        if opts.alibi_slopes.is_some() {
            return Err(AttnError::Alibi { why: super::AlibiRule::Unsupported { call: "the backward" } });
        }
        // The forward's validation of q, k, v, o, lse, the options and the cu_seqlens (shapes,
        // dtypes, places, strides, bounds, head dim, grid limits): one rule for both directions.
        let outs = (&o.raw, o.stream.as_deref(), Some(lse.0.raw), lse.0.stream.as_deref());
        let plan = self.plan(KernelKind::Flash, q, k, v, Some(outs), None, opts, varlen)?;
        let dtype = q.raw.dtype;
        let [_, rows, h, d] = q.raw.shape;
        let hk = k.raw.shape[2];
        // The main kernel the device's shared memory allows (the compact one on GPUs whose
        // blocks get at most 99 KiB).
        let caps = self.caps()?;
        let main = MainKernel::of(dtype, d, caps.max_dynamic_smem_bytes)?;
        let kernels = main.kernels;
        let (qs, ks) = (q.raw.shape, k.raw.shape);
        // The workspace's size is checked before anything is allocated.
        let ws = workspace_of(&main, qs, plan.params.seq_kv as usize, bwd.deterministic)?;
        let d_sinks = match (&bwd.d_sinks, opts.sinks) {
            (None, _) => None,
            (Some(_), None) => return Err(AttnError::Sinks { why: SinksRule::Count { got: 0, heads: h } }),
            (Some(ds), Some(_)) if ds.heads() != h => {
                return Err(AttnError::Sinks { why: SinksRule::Count { got: ds.heads(), heads: h } });
            }
            (Some(ds), Some(_)) => Some(&ds.0),
        };
        if let Some(ds) = d_sinks
            && ds.raw.ptr % 4 != 0
        {
            return Err(AttnError::Sinks { why: SinksRule::Misaligned { ptr: ds.raw.ptr } });
        }
        // d_o (and d_sinks) are checked before the gradients are allocated.
        let mut views: Vec<(&'static str, RawView, Option<&CudaStream>, [usize; 4])> =
            vec![("d_o", d_o.raw, d_o.stream.as_deref(), qs)];
        if let Some(ds) = d_sinks {
            views.push(("d_sinks", ds.raw, ds.stream.as_deref(), [1, 1, h, 1]));
        }
        self.check_grad_views(&views, &q.raw, varlen.is_some())?;
        let (owned, grad_views) = match grads {
            Some(g) => (None, [*g[0].0, *g[1].0, *g[2].0]),
            None => {
                let shapes = [qs, ks, ks];
                let mut st = Vec::with_capacity(3);
                for s in shapes {
                    st.push(self.alloc_storage(q, s.iter().product::<usize>() as u64 * dtype.size_bytes())?);
                }
                let raw: Vec<RawView> = st.iter().zip(shapes).map(|(s, shape)| s.raw_view(dtype, shape)).collect();
                (Some(st), [raw[0], raw[1], raw[2]])
            }
        };
        let streams = grads.map_or([q.stream.as_deref(); 3], |g| [g[0].1, g[1].1, g[2].1]);
        let names = ["dq", "dk", "dv"];
        let gv: Vec<_> = (0..3).map(|i| (names[i], grad_views[i], streams[i], [qs, ks, ks][i])).collect();
        self.check_grad_views(&gv, &q.raw, varlen.is_some())?;
        // The gradients are written: each one-to-one, none overlapping an input or another
        // gradient (the inputs may share memory with each other, as in the forward).
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
        if let Some(ds) = d_sinks {
            extents.push(alias::Extent::of_view("d_sinks", &ds.raw, true));
        }
        if let Some(va) = varlen {
            extents.push(alias::Extent::of_index("cu_seqlens_q", va.cu_q));
            extents.push(alias::Extent::of_index("cu_seqlens_k", va.cu_kv));
        }
        alias::check_disjoint(&extents)?;
        self.check_module(&kernels)?;

        // Launch geometry: sequences (varlen) or batches, the longest lengths.
        let (nb, sq, skv) = (plan.params.batch, plan.params.seq_q, plan.params.seq_kv);
        let dims =
            [BWD_ROWS.launch(nb, h as u32, sq), main.launch(nb, hk as u32, skv), BWD_ROWS.launch(nb, h as u32, sq)];
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

        // Workspace: the dQ slices [slices][rows of q's shape, h, d] and D [.., h, rows].
        let (accum, delta) = self.alloc_outputs(q, ws.dq_accum_bytes, ws.delta_bytes)?;
        let q_elems = (qs[0] * rows * h * d) as u64;
        let params = BwdParams {
            attn: plan.params,
            d_o: d_o.raw.ptr,
            delta: delta.ptr(),
            dq_accum: accum.ptr(),
            dq: grad_views[0].ptr,
            dk: grad_views[1].ptr,
            dv: grad_views[2].ptr,
            dsinks: d_sinks.map_or(0, |s| s.raw.ptr),
            d_o_strides: d_o.raw.kernel_strides(),
            dq_accum_strides: Strides::bshd(rows as u64, h as u64, d as u64),
            dq_strides: grad_views[0].kernel_strides(),
            dk_strides: grad_views[1].kernel_strides(),
            dv_strides: grad_views[2].kernel_strides(),
            dq_split_stride: if bwd.deterministic { q_elems } else { 0 },
            dq_splits: ws.dq_slices as u32,
            key_block: main.key_block,
        };
        let bytes = params.to_bytes();
        for (kernel, dims) in kernels.iter().zip(&dims) {
            self.launch_bytes(*kernel, dims, &bytes, q.stream.as_deref())?;
        }
        // The workspace is dropped here: in the VM after the launches ran, on CUDA freed in the
        // stream's order (after them).
        drop((accum, delta));
        Ok(owned.map(|st| {
            let mut it = st.into_iter();
            let mut t = |shape| DeviceTensor { storage: it.next().expect("three buffers"), dtype, shape };
            Gradients { dq: t(qs), dk: t(ks), dv: t(ks) }
        }))
    }

    /// Gradient-side views (d_o, d_sinks, dq, dk, dv): on the kernels' device and q's stream,
    /// of q's dtype (d_sinks f32), shaped as `want`, contiguous in the last dimension, within
    /// their buffers; for the tensor-core kernels (bf16, f16) d_o's rows 16-byte aligned (its
    /// tiles are `cp.async` copies), dk's and dv's 4-byte aligned (stored in pairs).
    pub(super) fn check_grad_views(
        &self,
        views: &[(&'static str, RawView, Option<&CudaStream>, [usize; 4])],
        q: &RawView,
        varlen: bool,
    ) -> Result<(), AttnError> {
        let places: Vec<_> = views.iter().map(|(n, t, s, _)| (*n, t, *s)).collect();
        self.check_places(&places, q)?;
        for (name, t, _, want) in views {
            let expected = if *name == "d_sinks" { Dtype::F32 } else { q.dtype };
            if t.dtype != expected {
                return Err(AttnError::Dtype { tensor: name, got: t.dtype, expected });
            }
            if t.shape != *want {
                let of = if *name == "d_sinks" {
                    "the sinks'"
                } else if want == &q.shape {
                    "q's"
                } else {
                    "k's and v's"
                };
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
            if q.dtype.is_16bit() {
                let (align, need) = match *name {
                    "d_o" => (
                        8,
                        "16-byte aligned rows: base pointer and strides multiples of 8 elements (cp.async copies 16-byte chunks)",
                    ),
                    "dk" | "dv" => {
                        (2, "4-byte aligned rows: base pointer and strides multiples of 2 elements (stored in pairs)")
                    }
                    _ => continue,
                };
                let entry = KernelId::flash_bwd(q.dtype.elem(), q.shape[3] as u32).map_or("", |k| k[1].name());
                if !t.ptr.is_multiple_of(2 * align as u64) {
                    let got = format!("{:#x}", t.ptr);
                    return Err(AttnError::Misaligned { tensor: name, what: "the base pointer", got, entry, need });
                }
                for (i, what) in [(0, "the batch stride"), (1, "the seq stride"), (2, "the head stride")] {
                    if i == 0 && varlen {
                        continue; // one packed batch: the batch stride is not used
                    }
                    if !t.strides[i].is_multiple_of(align) {
                        let got = format!("{} elements", t.strides[i]);
                        return Err(AttnError::Misaligned { tensor: name, what, got, entry, need });
                    }
                }
            }
        }
        Ok(())
    }

    /// One buffer of `bytes` on the kernels' device (on CUDA on q's stream, so it is freed in
    /// that stream's order); not zeroed: the backward writes every element of dq, dk and dv.
    pub(super) fn alloc_storage(&self, q: &TensorView<'_>, bytes: u64) -> Result<Storage, AttnError> {
        Ok(match &self.inner {
            Inner::Dev(_) => Storage::Dev(self.alloc(bytes)?),
            Inner::Cuda(_) => {
                let stream = q.stream.clone().ok_or_else(|| AttnError::WrongDevice {
                    tensor: "q",
                    got: "a raw view without a stream".into(),
                    expected: "a view made for a stream (the allocating call allocates on q's stream)".into(),
                })?;
                // SAFETY: read only after the launches that fill it, on the same stream.
                let slice = unsafe { stream.alloc::<u8>(bytes.max(1) as usize) }
                    .map_err(|e| cuda_err("allocating a gradient", e))?;
                Storage::Cuda { slice, stream }
            }
        })
    }
}

impl Storage {
    /// A `dtype` view of the whole buffer, contiguous `shape`.
    pub(super) fn raw_view(&self, dtype: Dtype, shape: [usize; 4]) -> RawView {
        let (avail, place) = match self {
            Storage::Dev(b) => (b.bytes, b.dev.place()),
            Storage::Cuda { slice, stream } => (slice.len() as u64, cuda_place(stream)),
        };
        RawView::new(self.ptr(), avail, dtype, shape, place)
    }
}

#[cfg(all(feature = "unit-tests", feature = "vm"))]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;
    use crate::reference::grad::{attention_backward, Grads};
    use crate::rng::SplitMix64;

    /// One backward case: sizes and options (`varlen`: the query and key lengths per sequence;
    /// `b`, `sq`, `skv` are then ignored).
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
        varlen: Option<(&'static [u32], &'static [u32])>,
        /// The dtype of q, k, v, o, d_o and the gradients (LSE, sinks, d_sinks are f32).
        dtype: Dtype,
    }

    const BASE: Case = Case {
        b: 1,
        h: 1,
        hk: 1,
        sq: 1,
        skv: 1,
        d: 64,
        causal: false,
        window: (-1, -1),
        softcap: 0.0,
        sinks: false,
        varlen: None,
        dtype: Dtype::F32,
    };

    /// A quiet NaN in f32, and two in bf16 and in f16.
    const NAN: u32 = 0x7fc0_7fc0;

    fn draw(n: usize, rng: &mut SplitMix64) -> Vec<f32> {
        (0..n).map(|_| rng.below(2001) as f32 / 1000.0 - 1.0).collect()
    }

    /// What one run produced: dq, dk, dv, d_sinks (empty without sinks).
    struct Got {
        grads: [Vec<f32>; 3],
        d_sinks: Vec<f32>,
    }

    /// Forward then backward in the VM (gradients poisoned with NaN first); returns the kernels'
    /// gradients and the f64 reference's.
    fn run(kernels: &Kernels, c: Case, seed: u64, deterministic: bool) -> (Got, Grads) {
        let mut rng = SplitMix64::new(seed);
        let (b, sq, skv) = match c.varlen {
            Some((lq, lk)) => (1, lq.iter().sum::<u32>() as usize, lk.iter().sum::<u32>() as usize),
            None => (c.b, c.sq, c.skv),
        };
        let (qn, kn) = (b * sq * c.h * c.d, b * skv * c.hk * c.d);
        let dt = c.dtype;
        // The inputs in the dtype: the reference sees exactly what the kernels read.
        let mut x4 = [draw(qn, &mut rng), draw(kn, &mut rng), draw(kn, &mut rng), draw(qn, &mut rng)];
        x4.iter_mut().for_each(|x| dt.round_all(x));
        let [qx, kx, vx, dox] = x4;
        let sinks_x = if c.sinks { draw(c.h, &mut rng) } else { vec![] };
        let up = |x: &[f32]| kernels.vm_upload_as(dt, x).unwrap();
        let (q, k, v, d_o) = (up(&qx), up(&kx), up(&vx), up(&dox));
        // Poisoned with NaN (in f32 words; two 16-bit NaNs per word for bf16/f16).
        let alloc = |n: usize| {
            let buf = kernels.vm_alloc(4 * n.max(1) as u64).unwrap();
            buf.fill_u32(n.max(1) as u64, NAN).unwrap();
            buf
        };
        let (o, lse, dq, dk, dv) = (alloc(qn), alloc(b * c.h * sq), alloc(qn), alloc(kn), alloc(kn));
        let sinks_buf = kernels.vm_upload(if c.sinks { &sinks_x } else { &[0.0] }).unwrap();
        let ds_buf = alloc(c.h);
        let sinks_view = SinksView::vm(&sinks_buf, c.h).unwrap();
        let (qs, ks) = ([b, sq, c.h, c.d], [b, skv, c.hk, c.d]);
        let t = |buf, s| TensorView::vm(buf, dt, s).unwrap();
        let tm = |buf, s| TensorViewMut::vm(buf, dt, s).unwrap();
        let mut opts = AttnOpts::new().causal(c.causal).window_size(c.window.0, c.window.1);
        if c.softcap > 0.0 {
            opts = opts.softcap(c.softcap);
        }
        let mut bwd = BwdOpts::new().deterministic(deterministic);
        if c.sinks {
            opts = opts.sinks(&sinks_view);
            bwd = bwd.d_sinks(SinksViewMut::vm(&ds_buf, c.h).unwrap());
        }
        let (lse_w, lse_r) = (LseViewMut::vm(&lse, b, c.h, sq).unwrap(), LseView::vm(&lse, b, c.h, sq).unwrap());
        let mut lse_w = lse_w;
        match c.varlen {
            None => {
                kernels
                    .flash_attn_into(&t(&q, qs), &t(&k, ks), &t(&v, ks), &mut tm(&o, qs), &mut lse_w, &opts)
                    .unwrap();
                kernels
                    .flash_attn_backward_into_with(
                        &t(&q, qs),
                        &t(&k, ks),
                        &t(&v, ks),
                        &t(&o, qs),
                        &lse_r,
                        &t(&d_o, qs),
                        &mut tm(&dq, qs),
                        &mut tm(&dk, ks),
                        &mut tm(&dv, ks),
                        &opts,
                        &bwd,
                    )
                    .unwrap();
            }
            Some((lq, lk)) => {
                let cu = |l: &[u32]| kernels.index_tensor(&crate::problem::Varlen::cu(l), None).unwrap();
                let (cq, ck) = (cu(lq), cu(lk));
                let (mq, mk) = (*lq.iter().max().unwrap() as usize, *lk.iter().max().unwrap() as usize);
                let (qv, kv, vv) = (t(&q, qs), t(&k, ks), t(&v, ks));
                kernels
                    .flash_attn_varlen_into(&qv, &kv, &vv, &cq, &ck, mq, mk, &mut tm(&o, qs), &mut lse_w, &opts)
                    .unwrap();
                kernels
                    .flash_attn_varlen_backward_into(
                        &qv,
                        &kv,
                        &vv,
                        &cq,
                        &ck,
                        mq,
                        mk,
                        &t(&o, qs),
                        &lse_r,
                        &t(&d_o, qs),
                        &mut tm(&dq, qs),
                        &mut tm(&dk, ks),
                        &mut tm(&dv, ks),
                        &opts,
                        &bwd,
                    )
                    .unwrap();
            }
        }
        let read = |buf: &VmBuffer, n| buf.read_f32(dt, n).unwrap();
        let base = Problem {
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
        };
        let p = match c.varlen {
            Some((lq, lk)) => Problem::varlen(base, lq, lk).unwrap(),
            None => base,
        };
        let want = attention_backward(&p, &qx, &kx, &vx, &dox, &sinks_x).unwrap();
        let d_sinks = if c.sinks { ds_buf.read_f32(Dtype::F32, c.h).unwrap() } else { vec![] };
        (Got { grads: [read(&dq, qn), read(&dk, kn), read(&dv, kn)], d_sinks }, want)
    }

    /// Max |got - want| over max |want| (at least 1e-3), NaN-propagating: an unwritten
    /// (poisoned) element fails.
    fn rel_err(got: &[f32], want: &[f64]) -> f64 {
        let scale = want.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
        if got.len() != want.len() {
            return f64::NAN;
        }
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
    /// See [`tensor_core_gradients_match_the_f64_reference`].
    const TOL_BF16: f64 = 1e-2;
    const TOL_F16: f64 = 1.5e-3;

    fn check(what: &str, c: &Case, got: &Got, want: &Grads) {
        let mut tensors =
            vec![("dq", &got.grads[0], &want.dq), ("dk", &got.grads[1], &want.dk), ("dv", &got.grads[2], &want.dv)];
        if c.sinks {
            tensors.push(("d_sinks", &got.d_sinks, &want.dsinks));
        }
        let tol = match c.dtype {
            Dtype::F32 => TOL,
            Dtype::Bf16 => TOL_BF16,
            Dtype::F16 => TOL_F16,
        };
        for (name, g, w) in tensors {
            let e = rel_err(g, w);
            if std::env::var_os("MEMATTN_PRINT_ERRORS").is_some() {
                eprintln!("{what} {:?} {name}: {e:.3e}", c.dtype);
            }
            assert!(e <= tol, "{what} {c:?}: {name} relative error {e:.3e} > {tol:.0e}");
        }
    }

    pub fn gradients_match_the_f64_reference() {
        let kernels = Kernels::vm().unwrap();
        let cases = [
            ("length 1", BASE),
            // Several key blocks and query tiles (neither a tile multiple), GQA, two batches.
            ("GQA, seq_q != seq_kv", Case { b: 2, h: 4, hk: 2, sq: 37, skv: 50, ..BASE }),
            // Causal with seq_q > seq_kv: the first 25 rows see no key (LSE = -inf).
            ("MQA causal, fully masked rows", Case { h: 2, sq: 45, skv: 20, causal: true, ..BASE }),
            ("d128 causal", Case { h: 2, sq: 33, skv: 40, d: 128, causal: true, ..BASE }),
            ("window and soft cap", Case { h: 2, hk: 1, sq: 40, skv: 70, window: (9, 3), softcap: 2.0, ..BASE }),
            // Sinks: the first 5 rows see only the sink (O = 0, D = 0, P_sink = 1), the others
            // share their mass with it; two batches, GQA, several key blocks.
            (
                "sinks, fully masked rows",
                Case { b: 2, h: 4, hk: 2, sq: 45, skv: 40, causal: true, sinks: true, ..BASE },
            ),
            // The other head dims, each over several key blocks and query tiles.
            ("d32 GQA", Case { h: 2, hk: 1, sq: 33, skv: 40, d: 32, ..BASE }),
            ("d96 window", Case { h: 2, sq: 20, skv: 35, d: 96, window: (5, 2), ..BASE }),
            ("d192 causal, masked rows", Case { h: 2, hk: 1, sq: 20, skv: 17, d: 192, causal: true, ..BASE }),
            ("d256 sinks, soft cap", Case { sq: 10, skv: 20, d: 256, softcap: 3.0, sinks: true, ..BASE }),
            // Head dims padded to the next kernel's (40 on d64, ... 200 on d256): only their
            // columns are read and written (the gradients' buffers are exactly their size).
            ("d40 GQA", Case { h: 2, hk: 1, sq: 33, skv: 40, d: 40, ..BASE }),
            ("d80 causal, masked rows", Case { b: 2, h: 2, sq: 25, skv: 17, d: 80, causal: true, ..BASE }),
            ("d120 window", Case { h: 2, sq: 20, skv: 35, d: 120, window: (5, 2), ..BASE }),
            ("d160 GQA causal", Case { h: 2, hk: 1, sq: 20, skv: 24, d: 160, causal: true, ..BASE }),
            ("d200 sinks, soft cap", Case { sq: 10, skv: 20, d: 200, softcap: 3.0, sinks: true, ..BASE }),
        ];
        for (seed, (what, c)) in cases.iter().enumerate() {
            let (got, want) = run(&kernels, *c, seed as u64 + 1, false);
            check(what, c, &got, &want);
        }
    }

    /// The tensor-core backward (bf16, f16) at every head dim it has, against the f64 gradients
    /// of the same (rounded) inputs. P and dS are rounded to 16 bits before their products, as
    /// in FlashAttention-2, and O (hence D) comes from the 16-bit forward; the errors measured
    /// here are 2.0e-3 to 4.2e-3 of the gradient's scale in bf16 (unit roundoff 2^-8 = 3.9e-3)
    /// and 2.9e-4 to 5.8e-4 in f16 (2^-11 = 4.9e-4). The bounds are about 2.5x the worst.
    pub fn tensor_core_gradients_match_the_f64_reference() {
        let kernels = Kernels::vm().unwrap();
        let cases = [
            ("length 1", BASE),
            // Several key blocks and query tiles (neither a tile multiple), GQA, two batches.
            ("GQA, seq_q != seq_kv", Case { b: 2, h: 4, hk: 2, sq: 77, skv: 130, ..BASE }),
            // Causal with seq_q > seq_kv: the first 25 rows see no key (LSE = -inf).
            ("MQA causal, fully masked rows", Case { h: 2, sq: 95, skv: 70, causal: true, ..BASE }),
            ("d128 causal", Case { h: 2, sq: 70, skv: 90, d: 128, causal: true, ..BASE }),
            ("d128 GQA window", Case { h: 2, hk: 1, sq: 40, skv: 100, d: 128, window: (20, 5), ..BASE }),
            ("window and soft cap", Case { h: 2, hk: 1, sq: 70, skv: 140, window: (9, 3), softcap: 2.0, ..BASE }),
            (
                "sinks, fully masked rows",
                Case { b: 2, h: 2, hk: 1, sq: 75, skv: 70, causal: true, sinks: true, ..BASE },
            ),
            ("d32 GQA", Case { h: 2, hk: 1, sq: 65, skv: 80, d: 32, ..BASE }),
            ("d32 causal soft cap", Case { sq: 30, skv: 100, d: 32, causal: true, softcap: 5.0, ..BASE }),
            // Two query tiles of the 128-row kernels and tails of both their key blocks.
            ("d64 two query tiles, GQA", Case { h: 2, hk: 1, sq: 200, skv: 150, ..BASE }),
            ("d128 two query tiles, causal", Case { sq: 170, skv: 140, d: 128, causal: true, ..BASE }),
            // Head dims padded to the next kernel's: 40 on d64, 80 and 120 on d128.
            ("d40 GQA", Case { h: 2, hk: 1, sq: 65, skv: 80, d: 40, ..BASE }),
            ("d80 causal, masked rows", Case { b: 2, h: 2, sq: 75, skv: 50, d: 80, causal: true, ..BASE }),
            ("d120 window", Case { h: 2, sq: 40, skv: 100, d: 120, window: (20, 5), ..BASE }),
        ];
        for dtype in [Dtype::Bf16, Dtype::F16] {
            for (seed, (what, c)) in cases.iter().enumerate() {
                let c = Case { dtype, ..*c };
                let (got, want) = run(&kernels, c, seed as u64 + 1, false);
                check(what, &c, &got, &want);
            }
        }
    }

    /// On a device whose blocks get 99 KiB of shared memory (an sm_86 GPU), d64 and d128 run the
    /// compact kernels (one warp per 16 keys), with the same bounds against f64; the workspace
    /// the device's kernels need is the one stated for it.
    pub fn compact_backward_runs_where_shared_memory_is_small() {
        use crate::device::{vm::VmDevice, BackendChoice, DeviceOptions};
        let mut opts = DeviceOptions::new(BackendChoice::Vm, crate::ptx::PtxSource::embedded());
        opts.vm_max_shared_per_block = Some(99 * 1024);
        let kernels = Kernels::on_device(Box::new(VmDevice::new(&opts).unwrap()));
        for d in [64usize, 128] {
            let (small, big) = (
                KernelId::flash_bwd_for(Dtype::Bf16.elem(), d as u32, 99 * 1024).unwrap()[1],
                KernelId::flash_bwd(Dtype::Bf16.elem(), d as u32).unwrap()[1],
            );
            assert_eq!(small.name(), format!("flash_bwd_bf16_d{d}_compact"));
            assert_eq!(big.name(), format!("flash_bwd_bf16_d{d}"));
        }
        let ws = kernels.flash_attn_backward_workspace(Dtype::Bf16, [1, 100, 2, 64], 200, true).unwrap();
        assert_eq!((ws.key_block, ws.dq_slices), (64, 4));
        let ws = flash_attn_backward_workspace(Dtype::Bf16, [1, 100, 2, 64], 200, true).unwrap();
        assert_eq!((ws.key_block, ws.dq_slices), (128, 2));
        let cases = [
            ("d64 GQA causal", Case { h: 2, hk: 1, sq: 77, skv: 130, causal: true, ..BASE }),
            ("d128 window soft cap", Case { sq: 40, skv: 100, d: 128, window: (20, 5), softcap: 3.0, ..BASE }),
        ];
        for dtype in [Dtype::Bf16, Dtype::F16] {
            for (seed, (what, c)) in cases.iter().enumerate() {
                let c = Case { dtype, ..*c };
                for det in [false, true] {
                    let (got, want) = run(&kernels, c, seed as u64 + 1, det);
                    check(what, &c, &got, &want);
                }
            }
        }
    }

    pub fn varlen_gradients_match_the_f64_reference() {
        // Three sequences, one empty, one of more queries than keys (causal: rows that see
        // nothing), keys over two key blocks; sinks summed over every sequence; both modes.
        let kernels = Kernels::vm().unwrap();
        let c = Case { h: 2, hk: 1, causal: true, sinks: true, varlen: Some((&[7, 0, 30], &[3, 5, 45])), ..BASE };
        for deterministic in [false, true] {
            let (got, want) = run(&kernels, c, 11, deterministic);
            check(if deterministic { "varlen deterministic" } else { "varlen" }, &c, &got, &want);
        }
    }

    pub fn atomic_dq_adds_survive_several_workers() {
        // Four VM workers run the key blocks concurrently, so the `red.global.add.f32` adds of
        // different blocks to one dQ row interleave for real; memcheck, initcheck and racecheck
        // stay on. Every add must land: the result matches the reference as with one worker.
        let kernels = four_workers();
        let c = Case { b: 2, h: 4, hk: 2, sq: 37, skv: 100, causal: true, ..BASE };
        let (got, want) = run(&kernels, c, 7, false);
        check("4 workers", &c, &got, &want);
    }

    fn four_workers() -> Kernels {
        use crate::device::{vm::VmDevice, BackendChoice, DeviceOptions};
        use crate::ptx::PtxSource;
        let mut opts = DeviceOptions::new(BackendChoice::Vm, PtxSource::embedded());
        opts.vm_workers = Some(4);
        Kernels::on_device(Box::new(VmDevice::new(&opts).unwrap()))
    }

    pub fn deterministic_mode_is_bitwise_reproducible_and_right() {
        // Four workers (key blocks concurrent), 4 key blocks, causal with fully masked rows,
        // GQA, sinks: two runs agree to the bit and both match the f64 reference. initcheck
        // is on, so a slice the convert reads that no key block wrote would fail the launch.
        let kernels = four_workers();
        let c = Case { b: 2, h: 4, hk: 2, sq: 37, skv: 100, causal: true, window: (50, -1), sinks: true, ..BASE };
        let (a, want) = run(&kernels, c, 8, true);
        let (b, _) = run(&kernels, c, 8, true);
        check("deterministic", &c, &a, &want);
        check("deterministic, again", &c, &b, &want);
        let bits = |g: &Got| g.grads.iter().chain([&g.d_sinks]).flatten().map(|x| x.to_bits()).collect::<Vec<u32>>();
        assert_eq!(bits(&a), bits(&b), "two deterministic runs differ");
        // 16 keys per block at d=192: the convert sums by the head dim's own key block.
        let c = Case { h: 2, hk: 1, sq: 21, skv: 40, d: 192, causal: true, ..BASE };
        let (got, want) = run(&kernels, c, 9, true);
        check("deterministic d192", &c, &got, &want);
    }

    pub fn the_workspace_is_stated_exactly() {
        // Atomic: one f32 copy of q's shape plus D. Deterministic at d=64 (32 keys per block),
        // 100 keys: 4 slices.
        let w = flash_attn_backward_workspace(Dtype::F32, [2, 37, 4, 64], 100, false).unwrap();
        assert_eq!((w.dq_slices, w.dq_accum_bytes, w.delta_bytes), (1, 2 * 37 * 4 * 64 * 4, 2 * 4 * 37 * 4));
        let w = flash_attn_backward_workspace(Dtype::F32, [2, 37, 4, 64], 100, true).unwrap();
        assert_eq!((w.dq_slices, w.key_block, w.dq_accum_bytes), (4, 32, 4 * 2 * 37 * 4 * 64 * 4));
        assert_eq!(w.total_bytes, w.dq_accum_bytes + w.delta_bytes);
        // The VM's allocator sees exactly that much besides the caller's buffers.
        let e = flash_attn_backward_workspace(Dtype::F32, [1, 1, 1, 84], 1, false).unwrap_err();
        assert!(e.to_string().contains("head_dim"), "{e}");
        let e = flash_attn_backward_workspace(Dtype::F32, [1 << 40, 1 << 20, 1, 64], 1 << 30, true).unwrap_err();
        assert!(matches!(e, AttnError::Problem(ProblemError::TooLarge { .. })), "{e}");
        // bf16/f16: the tensor-core kernel's key block (128 at d64, 64 at d128; 64 at d64 too
        // with the compact kernel), the accumulator still f32; d96 has no tensor-core backward,
        // named with the head dims there are.
        let w = flash_attn_backward_workspace(Dtype::Bf16, [2, 37, 4, 64], 200, true).unwrap();
        assert_eq!((w.dq_slices, w.key_block, w.dq_accum_bytes), (2, 128, 2 * 2 * 37 * 4 * 64 * 4));
        let w = flash_attn_backward_workspace_on(Dtype::Bf16, [2, 37, 4, 64], 200, true, 99 * 1024).unwrap();
        assert_eq!((w.dq_slices, w.key_block, w.dq_accum_bytes), (4, 64, 4 * 2 * 37 * 4 * 64 * 4));
        let w = flash_attn_backward_workspace(Dtype::F16, [2, 37, 4, 128], 100, true).unwrap();
        assert_eq!((w.dq_slices, w.key_block, w.dq_accum_bytes), (2, 64, 2 * 2 * 37 * 4 * 128 * 4));
        // A padded head dim takes the next kernel's key block (d80 on d128: 64) and its own
        // columns of the accumulator; past the largest head dim (128) it is refused.
        let w = flash_attn_backward_workspace(Dtype::F16, [2, 37, 4, 80], 100, true).unwrap();
        assert_eq!((w.dq_slices, w.key_block, w.dq_accum_bytes), (2, 64, 2 * 2 * 37 * 4 * 80 * 4));
        let e = flash_attn_backward_workspace(Dtype::F16, [1, 1, 1, 160], 1, false).unwrap_err();
        assert!(e.to_string().contains("f16 backward kernels are compiled for head_dim 32, 64 and 128"), "{e}");
    }

    pub fn the_allocating_form_returns_verified_gradients() {
        let kernels = Kernels::vm().unwrap();
        let c = Case { b: 2, h: 2, hk: 1, sq: 19, skv: 40, causal: true, ..BASE };
        let (got, want) = run(&kernels, c, 3, false);
        check("into", &c, &got, &want);
        // The same inputs again (seed 3), through the allocating call.
        let mut rng = SplitMix64::new(3);
        let (qn, kn) = (2 * 19 * 2 * 64, 2 * 40 * 64);
        let (qx, kx, vx, dox) = (draw(qn, &mut rng), draw(kn, &mut rng), draw(kn, &mut rng), draw(qn, &mut rng));
        let up = |x: &[f32]| kernels.vm_upload(x).unwrap();
        let (q, k, v, d_o) = (up(&qx), up(&kx), up(&vx), up(&dox));
        let (qs, ks) = ([2, 19, 2, 64], [2, 40, 1, 64]);
        let t = |buf, s| TensorView::vm(buf, Dtype::F32, s).unwrap();
        let opts = AttnOpts::new().causal(true);
        let (o, lse) = kernels.flash_attn(&t(&q, qs), &t(&k, ks), &t(&v, ks), &opts).unwrap();
        let lse = LseView::vm(lse.as_vm().unwrap(), 2, 2, 19).unwrap();
        let g = kernels
            .flash_attn_backward(
                &t(&q, qs),
                &t(&k, ks),
                &t(&v, ks),
                &t(o.as_vm().unwrap(), qs),
                &lse,
                &t(&d_o, qs),
                &opts,
                &BwdOpts::new(),
            )
            .unwrap();
        assert_eq!((g.dq.shape(), g.dk.shape(), g.dv.shape()), (qs, ks, ks));
        let alloc = Got {
            grads: [g.dq.to_vec_f32().unwrap(), g.dk.to_vec_f32().unwrap(), g.dv.to_vec_f32().unwrap()],
            d_sinks: vec![],
        };
        check("allocating", &c, &alloc, &want);
        // A refused call allocates nothing: a d_o not shaped like q is refused after the
        // forward's checks passed, before the gradients would be allocated.
        kernels.with_device(|d| d.memory_begin()).unwrap();
        let e = kernels
            .flash_attn_backward(
                &t(&q, qs),
                &t(&k, ks),
                &t(&v, ks),
                &t(&q, qs),
                &lse,
                &t(&d_o, ks),
                &opts,
                &BwdOpts::new(),
            )
            .unwrap_err();
        assert!(matches!(e, AttnError::Shape { tensor: "d_o", .. }), "{e}");
        let m = kernels.with_device(|d| d.memory_end()).unwrap();
        assert_eq!(m.peak_delta_bytes, 0, "the refused call allocated");
    }

    pub fn refusals_are_typed() {
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
        // bf16 inputs take bf16 gradients (here f32 views: refused, naming the first).
        let e = call(&t(Dtype::Bf16, s), s, &AttnOpts::new()).unwrap_err();
        assert!(matches!(e, AttnError::Dtype { tensor: "dq", expected: Dtype::Bf16, .. }), "{e}");
        // The sinks' gradient needs sinks, one per head.
        let sinks_buf = kernels.vm_upload(&[0.5, 0.5]).unwrap();
        let sinks = SinksView::vm(&sinks_buf, 2).unwrap();
        let ds_buf = kernels.vm_alloc(64).unwrap();
        let with_ds = |opts: &AttnOpts<'_>, heads| {
            let v = t(Dtype::F32, s);
            let (g1, g2, g3) = (
                kernels.vm_alloc(1 << 12).unwrap(),
                kernels.vm_alloc(1 << 12).unwrap(),
                kernels.vm_alloc(1 << 12).unwrap(),
            );
            let tm = |b| TensorViewMut::vm(b, Dtype::F32, s).unwrap();
            let bwd = BwdOpts::new().d_sinks(SinksViewMut::vm(&ds_buf, heads).unwrap());
            let (mut d1, mut d2, mut d3) = (tm(&g1), tm(&g2), tm(&g3));
            kernels.flash_attn_backward_into_with(&v, &v, &v, &v, &lse, &v, &mut d1, &mut d2, &mut d3, opts, &bwd)
        };
        let e = with_ds(&AttnOpts::new(), 2).unwrap_err();
        assert!(matches!(e, AttnError::Sinks { why: SinksRule::Count { got: 0, heads: 2 } }), "{e}");
        let e = with_ds(&AttnOpts::new().sinks(&sinks), 3).unwrap_err();
        assert!(matches!(e, AttnError::Sinks { why: SinksRule::Count { got: 3, heads: 2 } }), "{e}");
        // d_sinks over the sinks themselves.
        let v = t(Dtype::F32, s);
        let (g1, g2, g3) = (
            kernels.vm_alloc(1 << 12).unwrap(),
            kernels.vm_alloc(1 << 12).unwrap(),
            kernels.vm_alloc(1 << 12).unwrap(),
        );
        let tmv = |b| TensorViewMut::vm(b, Dtype::F32, s).unwrap();
        let bwd = BwdOpts::new().d_sinks(SinksViewMut::vm(&sinks_buf, 2).unwrap());
        let e = kernels
            .flash_attn_backward_into_with(
                &v,
                &v,
                &v,
                &v,
                &lse,
                &v,
                &mut tmv(&g1),
                &mut tmv(&g2),
                &mut tmv(&g3),
                &AttnOpts::new().sinks(&sinks),
                &bwd,
            )
            .unwrap_err();
        assert!(
            matches!(e, AttnError::Aliasing { why: AliasRule::Overlap { written: "d_sinks", other: "sinks", .. } }),
            "{e}"
        );
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
