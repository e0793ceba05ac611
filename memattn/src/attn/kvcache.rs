//! KV-cache decode and the split combine on the caller's buffers: [`Kernels::merge_states_into`] and
//! [`Kernels::flash_attn_with_kvcache`], launching the decode kernels with the split plan of
//! [`crate::decode`].

use super::*;
use crate::decode::{
    check_cache_layout, check_fp8_scales, decode_params, merge_params, planned_launches, prefill_params, CacheLayout,
    DecodeBuffers, DecodeProblem, Fp8Format, SmCountSource, Splits, MAX_SPLITS,
};
use kernels_gpu::Family;

mod shared_prefix;

/// Partial attention states to combine with [`Kernels::merge_states_into`], on the kernels' device:
/// `o_part` `[splits, batch, heads, seq_q, head_dim]` f32 (each state normalised by its own sum)
/// and `lse_part` `[splits, batch, heads, seq_q]` f32 (natural log; `-inf` for a state that saw
/// no key), both contiguous. `shape` is the merged output's `[batch, seq_q, heads, head_dim]`.
pub struct PartialsView<'a> {
    o: TensorView<'a>,
    lse: TensorView<'a>,
    splits: usize,
    shape: [usize; 4],
}

impl<'a> PartialsView<'a> {
    fn new(o: TensorView<'a>, lse: TensorView<'a>, splits: usize, shape: [usize; 4]) -> Self {
        PartialsView { o, lse, splits, shape }
    }
    fn sizes(splits: usize, shape: [usize; 4]) -> ([usize; 4], [usize; 4]) {
        let [b, sq, h, d] = shape;
        let rows = splits * b * h * sq;
        ([1, rows, 1, d], [1, rows, 1, 1])
    }
    /// Partial states in two device buffers (VM or [`Kernels::on_device`]).
    pub fn vm(
        o_part: &'a VmBuffer,
        lse_part: &'a VmBuffer,
        splits: usize,
        shape: [usize; 4],
    ) -> Result<Self, AttnError> {
        let (os, ls) = Self::sizes(splits, shape);
        Ok(Self::new(TensorView::vm(o_part, Dtype::F32, os)?, TensorView::vm(lse_part, Dtype::F32, ls)?, splits, shape))
    }
    /// Partial states in two cudarc f32 slices, for a launch on `stream`.
    pub fn cuda<S: DevicePtr<f32>, L: DevicePtr<f32>>(
        o_part: &'a S,
        lse_part: &'a L,
        stream: &'a Arc<CudaStream>,
        splits: usize,
        shape: [usize; 4],
    ) -> Result<Self, AttnError> {
        let (os, ls) = Self::sizes(splits, shape);
        Ok(Self::new(TensorView::cuda(o_part, stream, os)?, TensorView::cuda(lse_part, stream, ls)?, splits, shape))
    }
    /// The number of states per row.
    pub fn splits(&self) -> usize {
        self.splits
    }
}

/// The f32 scales of one FP8 cache tensor on the kernels' device, `heads_kv` of them (a
/// per-tensor scale is stored once per KV head), checked when made ([`Kernels::fp8_scales`]).
pub struct Fp8Scales {
    values: Vec<f32>,
    /// The device address of the `values` (f32).
    ptr: u64,
    /// The device (and stream) they were copied on.
    place: Place,
    _storage: Fp8ScalesStorage,
}

#[allow(dead_code)] // owns the device memory `ptr` refers to
enum Fp8ScalesStorage {
    Dev(DeviceBuffer),
    Cuda(cudarc::driver::CudaSlice<f32>),
}

impl fmt::Debug for Fp8Scales {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fp8Scales").field("values", &self.values).field("ptr", &self.ptr).finish()
    }
}

impl Fp8Scales {
    /// The scales, one per KV head.
    pub fn values(&self) -> &[f32] {
        &self.values
    }
    /// Bytes on the device.
    fn bytes(&self) -> u64 {
        self.values.len() as u64 * 4
    }
}

/// An FP8 KV cache tensor: one byte per element in `format` ([`Fp8Format`], `docs/semantics.md`
/// "FP8 KV cache"), `[batch, seq_cache, heads_kv, head_dim]` or paged `[num_pages, page_size,
/// heads_kv, head_dim]`, contiguous, in a buffer of device-backed kernels (VM or
/// [`Kernels::on_device`]) or a caller's cudarc `u8` slice ([`Fp8CacheViewMut::cuda`]). Element
/// `x` is stored as `encode(x / scale)`; its value is `decode(byte) * scale` with the scale of
/// its KV head ([`Fp8Scales`]).
pub struct Fp8CacheViewMut<'a> {
    /// The cache seen with its shape; the dtype slot holds bf16 (the dtype of the call) and is
    /// never used to size it.
    view: TensorViewMut<'a>,
    format: Fp8Format,
}

impl<'a> Fp8CacheViewMut<'a> {
    /// An FP8 cache in `buf`: `shape` elements of one byte from its start.
    pub fn device(buf: &'a DeviceBuffer, format: Fp8Format, shape: [usize; 4]) -> Result<Self, AttnError> {
        let raw = RawView::new(buf.ptr, buf.bytes, Dtype::Bf16, shape, buf.dev.place());
        Ok(Fp8CacheViewMut { view: TensorViewMut { raw, _guard: None, stream: None, _borrow: PhantomData }, format })
    }
    /// An FP8 cache in a caller's cudarc slice of bytes (`CudaSlice<u8>` or `CudaViewMut<u8>`),
    /// `shape` elements of one byte from its start, for launches on `stream`.
    pub fn cuda<S: cudarc::driver::DevicePtrMut<u8>>(
        slice: &'a mut S,
        stream: &'a Arc<CudaStream>,
        format: Fp8Format,
        shape: [usize; 4],
    ) -> Result<Self, AttnError> {
        check_slice_context("the FP8 cache", slice, stream)?;
        let avail = slice.len() as u64;
        let (ptr, guard) = slice.device_ptr_mut(stream);
        let raw = RawView::new(ptr, avail, Dtype::Bf16, shape, cuda_place(stream));
        let view = TensorViewMut { raw, _guard: Some(guard), stream: Some(stream.clone()), _borrow: PhantomData };
        Ok(Fp8CacheViewMut { view, format })
    }
    /// The FP8 format of the cache's bytes (e4m3 or e5m2).
    pub fn format(&self) -> Fp8Format {
        self.format
    }
    /// `[batch or num_pages, seq_cache or page_size, heads_kv, head_dim]`.
    pub fn shape(&self) -> [usize; 4] {
        self.view.raw.shape
    }
}

/// The bytes of an FP8 cache view, as a view of `ceil(elements / 2)` 2-byte elements (for the
/// bounds and aliasing checks, which count in elements of the view's dtype).
fn fp8_bytes_view(raw: &RawView) -> RawView {
    let elems: usize = raw.shape.iter().product();
    RawView::new(raw.ptr, raw.avail, Dtype::Bf16, [1, 1, 1, elems.div_ceil(2)], raw.place)
}

/// An FP8 call's cache format and scales.
#[derive(Clone, Copy)]
struct Fp8Call<'s> {
    format: Fp8Format,
    k_scale: &'s Fp8Scales,
    v_scale: &'s Fp8Scales,
}

/// The shape rules of a KV cache against q's `heads` and `head_dim`: `k_cache` and `v_cache` of
/// one shape, its head dim q's, its heads dividing q's. Returns the cache's shape.
pub(super) fn check_cache_shape(
    h: usize,
    d: usize,
    k_cache: &RawView,
    v_cache: &RawView,
) -> Result<[usize; 4], AttnError> {
    let kshape = k_cache.shape;
    if v_cache.shape != kshape {
        return Err(AttnError::Shape {
            tensor: "v_cache",
            got: v_cache.shape,
            why: ShapeRule::VCache { k_cache: kshape },
        });
    }
    let [_, _, hk, kd] = kshape;
    if kd != d {
        return Err(AttnError::Shape {
            tensor: "k_cache",
            got: kshape,
            why: ShapeRule::CacheHeadDim { got: kd, q: d },
        });
    }
    if hk == 0 || !h.is_multiple_of(hk) {
        return Err(AttnError::Shape { tensor: "k_cache", got: kshape, why: ShapeRule::CacheHeads { got: hk, q: h } });
    }
    Ok(kshape)
}

/// Whether `k` is a tensor-core kernel of a KV-cache call (decode or prefill): it copies q and
/// the caches in 16-byte chunks (`cp.async`), so their base pointers must be 16-byte aligned.
fn copies_in_16_byte_chunks(k: KernelId) -> bool {
    matches!(k.variant().family, Family::DecodeMma | Family::DecodeMmaSm90 | Family::FlashMma)
}

fn kv_err(why: KvCacheRule) -> AttnError {
    AttnError::KvCache { why }
}

fn u32_of(tensor: &'static str, shape: [usize; 4], n: usize, what: &'static str) -> Result<u32, AttnError> {
    u32::try_from(n).map_err(|_| AttnError::Shape { tensor, got: shape, why: ShapeRule::OverLimit { what, got: n } })
}

impl Kernels {
    /// Multiprocessors the split plan fills: the device's count on CUDA, the modelled
    /// [`DEFAULT_SM_COUNT`] in the VM.
    fn sm_count(&self) -> u32 {
        match &self.inner {
            Inner::Dev(d) => {
                d.with(|d| d.multiprocessor_count()).ok().flatten().unwrap_or(crate::decode::DEFAULT_SM_COUNT)
            }
            Inner::Cuda(c) => c.sm_count,
        }
    }

    /// Checks that every launch's grid fits the device.
    fn check_grid(&self, kernel: KernelId, dims: &kernels_gpu::tiles::LaunchDims) -> Result<(), AttnError> {
        let caps = self.caps()?;
        for a in 0..3 {
            if dims.grid[a] == 0 || dims.grid[a] > caps.max_grid[a] {
                return Err(AttnError::Grid {
                    entry: kernel.name(),
                    grid: dims.grid,
                    limit: caps.max_grid,
                    axis: ['x', 'y', 'z'][a],
                });
            }
        }
        Ok(())
    }

    /// Combines `splits` partial attention states per row (flash-decoding's second pass, or
    /// states the caller computed over separate key ranges) into `o` (`[batch, seq_q, heads,
    /// head_dim]` in any dtype with a kernel, any seq/head strides) and `lse` (`[batch, heads,
    /// seq_q]` f32): with `m = max_s lse_s`, `lse = m + ln Σ_s e^(lse_s - m)` and
    /// `o = Σ_s e^(lse_s - lse) · o_s`. A row whose states are all `-inf` gives `o = 0`,
    /// `lse = -inf`. Queued on the views' stream.
    ///
    /// ```
    /// use memattn::attn::{Kernels, LseViewMut, PartialsView, TensorViewMut};
    /// use memattn::Dtype;
    ///
    /// let kernels = Kernels::vm()?;
    /// // One row, head_dim 2, two states: LSE ln 1 and ln 3 weigh them 1/4 and 3/4.
    /// let o_part = kernels.vm_upload(&[1.0, 2.0, 5.0, 6.0])?; // [splits 2, 1, 1, 1, 2]
    /// let lse_part = kernels.vm_upload(&[0.0, 3f32.ln()])?;
    /// let (o, lse) = (kernels.vm_alloc(8)?, kernels.vm_alloc(4)?);
    /// kernels.merge_states_into(
    ///     &PartialsView::vm(&o_part, &lse_part, 2, [1, 1, 1, 2])?,
    ///     &mut TensorViewMut::vm(&o, Dtype::F32, [1, 1, 1, 2])?,
    ///     &mut LseViewMut::vm(&lse, 1, 1, 1)?,
    /// )?;
    /// let (o, lse) = (o.read_f32(Dtype::F32, 2)?, lse.read_f32(Dtype::F32, 1)?);
    /// assert!((o[0] - 4.0).abs() < 1e-6 && (o[1] - 5.0).abs() < 1e-6);
    /// assert!((lse[0] - 4f32.ln()).abs() < 1e-6);
    /// # Ok::<(), memattn::attn::AttnError>(())
    /// ```
    pub fn merge_states_into(
        &self,
        partials: &PartialsView<'_>,
        o: &mut TensorViewMut<'_>,
        lse: &mut LseViewMut<'_>,
    ) -> Result<(), AttnError> {
        let tensors: Vec<(&'static str, &RawView, Option<&CudaStream>)> = vec![
            ("o_part", &partials.o.raw, partials.o.stream.as_deref()),
            ("lse_part", &partials.lse.raw, partials.lse.stream.as_deref()),
            ("o", &o.raw, o.stream.as_deref()),
            ("lse", &lse.0.raw, lse.0.stream.as_deref()),
        ];
        self.check_places(&tensors, &partials.o.raw)?;
        for (name, t, _) in &tensors {
            if *name != "o" && t.dtype != Dtype::F32 {
                return Err(AttnError::Dtype { tensor: name, got: t.dtype, expected: Dtype::F32 });
            }
        }
        let shape = partials.shape;
        let [b, sq, h, d] = shape;
        if partials.splits == 0 || shape.contains(&0) {
            return Err(AttnError::Shape {
                tensor: "o_part",
                got: shape,
                why: ShapeRule::EmptyPartials { splits: partials.splits },
            });
        }
        if o.raw.shape != shape {
            return Err(AttnError::Shape {
                tensor: "o",
                got: o.raw.shape,
                why: ShapeRule::Output { of: "the partial states'", want: shape },
            });
        }
        if lse.0.raw.shape != [b, h, sq, 1] || lse.0.raw.strides != contiguous([b, h, sq, 1]) {
            return Err(AttnError::Shape {
                tensor: "lse",
                got: lse.0.raw.shape,
                why: ShapeRule::Lse { want: [b, h, sq], packed: false },
            });
        }
        if o.raw.strides[3] != 1 {
            return Err(AttnError::InnerStride { tensor: "o", stride: o.raw.strides[3] });
        }
        for (name, t, _) in &tensors {
            t.check_bounds(name)?;
        }
        alias::check_injective("o", &o.raw)?;
        let extents: Vec<alias::Extent> =
            tensors.iter().map(|(name, t, _)| alias::Extent::of_view(name, t, matches!(*name, "o" | "lse"))).collect();
        alias::check_disjoint(&extents)?;
        let dtype = o.raw.dtype;
        let kernel = KernelId::find(Family::MergeStates, dtype.elem(), None)
            .ok_or(AttnError::NotSupportedYet { feature: "merge_states into this dtype" })?;
        let rows = (b * h * sq) as u64;
        let dims = kernels_gpu::tiles::MERGE.launch(rows);
        self.check_grid(kernel, &dims)?;
        let p = DecodeProblem {
            batch: u32_of("o", shape, b, "batch")?,
            heads: u32_of("o", shape, h, "heads")?,
            heads_kv: 1,
            head_dim: u32_of("o", shape, d, "head_dim")?,
            seq_q: u32_of("o", shape, sq, "seq_q")?,
            ..DecodeProblem::default()
        };
        let bufs = DecodeBuffers {
            o_part: partials.o.raw.ptr,
            lse_part: partials.lse.raw.ptr,
            o: o.raw.ptr,
            lse: lse.0.raw.ptr,
            ..DecodeBuffers::default()
        };
        let splits = u32_of("o_part", shape, partials.splits, "splits")?;
        let m = merge_params(&p, splits, &bufs, o.raw.kernel_strides());
        self.launch_bytes(kernel, &dims, &m.to_bytes(), o.stream.as_deref())
    }

    /// Decode attention over a KV cache, FlashAttention-2's `flash_attn_with_kvcache`, into
    /// buffers memattn allocates (see [`Kernels::flash_attn_with_kvcache_into`] for the
    /// arguments). Returns `o` `[batch, seq_q, heads, head_dim]` and `lse` `[batch, heads, seq_q]`.
    ///
    /// ```
    /// use memattn::attn::{AttnOpts, Kernels, TensorView, TensorViewMut};
    /// use memattn::Dtype;
    ///
    /// let kernels = Kernels::vm()?;
    /// let (b, h, hk, d, page) = (1, 4, 2, 64, 16); // GQA: 2 query heads per KV head
    /// // A paged cache of 3 pages of 16 keys; the sequence holds 20 keys in pages 2 and 0.
    /// let row = hk * d;
    /// let cache: Vec<f32> = (0..3 * page * row).map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5).collect();
    /// let (kc, vc) = (kernels.vm_upload(&cache)?, kernels.vm_upload(&cache)?);
    /// let block_table = kernels.index_tensor(&[2, 0], None)?; // [batch, max_pages]
    /// let cache_seqlens = kernels.index_tensor(&[20], None)?;
    /// let q = kernels.vm_upload(&vec![0.0; b * h * d])?; // q = 0: uniform weights
    /// let kv = |buf| TensorViewMut::vm(buf, Dtype::F32, [3, page, hk, d]);
    /// let (o, lse) = kernels.flash_attn_with_kvcache(
    ///     &TensorView::vm(&q, Dtype::F32, [b, 1, h, d])?,
    ///     &mut kv(&kc)?,
    ///     &mut kv(&vc)?,
    ///     None, // no new tokens to append
    ///     None,
    ///     &cache_seqlens,
    ///     Some(&block_table),
    ///     &AttnOpts::new().causal(true).num_splits(2),
    /// )?;
    /// let (o, lse) = (o.to_vec_f32()?, lse.to_vec_f32()?);
    /// // o is the mean of the 20 values of KV head 0 (keys 0..16 in page 2, 16..20 in page 0).
    /// let key = |j: usize| if j < page { (2 * page + j) * row } else { (j - page) * row };
    /// let mean = (0..20).map(|j| cache[key(j)]).sum::<f32>() / 20.0;
    /// assert!((o[0] - mean).abs() < 1e-5);
    /// assert!((lse[0] - 20f32.ln()).abs() < 1e-5);
    /// # Ok::<(), memattn::attn::AttnError>(())
    /// ```
    #[allow(clippy::too_many_arguments)] // FlashAttention-2's signature
    pub fn flash_attn_with_kvcache(
        &self,
        q: &TensorView<'_>,
        k_cache: &mut TensorViewMut<'_>,
        v_cache: &mut TensorViewMut<'_>,
        k_new: Option<&TensorView<'_>>,
        v_new: Option<&TensorView<'_>>,
        cache_seqlens: &IndexTensor,
        block_table: Option<&IndexTensor>,
        opts: &AttnOpts<'_>,
    ) -> Result<(DeviceTensor, DeviceTensor), AttnError> {
        let [b, sq, h, d] = q.raw.shape;
        let dtype = q.raw.dtype;
        let (o_bytes, lse_bytes) = ((b * sq * h * d) as u64 * dtype.size_bytes(), (b * h * sq) as u64 * 4);
        // Validate before allocating (the outputs are checked again, trivially, in the call).
        let plan =
            self.kvcache_plan(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, None, opts, None)?;
        let (o, lse) = self.alloc_outputs(q, o_bytes, lse_bytes)?;
        let o = DeviceTensor { storage: o, dtype, shape: [b, sq, h, d] };
        let lse = DeviceTensor { storage: lse, dtype: Dtype::F32, shape: [b, h, sq, 1] };
        let outs = (o.ptr(), lse.ptr());
        self.kvcache_run(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, outs, &plan, None)?;
        Ok((o, lse))
    }

    /// Decode attention over a KV cache, FlashAttention-2's `flash_attn_with_kvcache`, into the
    /// caller's `o` (`[batch, seq_q, heads, head_dim]`) and `lse` (`[batch, heads, seq_q]`).
    ///
    /// - `q`: `[batch, seq_q, heads, head_dim]` (`seq_q` 1 for plain decode, more for
    ///   speculative decoding), contiguous.
    /// - `k_cache`, `v_cache`: contiguous `[batch, seq_cache, heads_kv, head_dim]`, or, with a
    ///   `block_table`, a paged cache `[num_pages, page_size, heads_kv, head_dim]` (any page
    ///   size); `heads_kv` divides `heads` (GQA). Written when new tokens are given.
    /// - `k_new`, `v_new` (FlashAttention-2's `k`, `v`): `[batch, seq_new, heads_kv, head_dim]`,
    ///   written into the cache at `cache_seqlens[b]..` before attention, which then runs over
    ///   `cache_seqlens[b] + seq_new` keys. `cache_seqlens` is not advanced (the caller does it).
    /// - `cache_seqlens`: `[batch]` keys in the cache before the call.
    /// - `block_table`: `[batch, max_pages]` page indices ([`IndexTensor`]; `max_pages` is its
    ///   length over `batch`). Entries past a sequence's last used page are not read.
    ///
    /// The arguments come in FlashAttention-2's order (`q, k_cache, v_cache, k, v, ...,
    /// cache_seqlens, ..., block_table`), then the outputs and the options.
    /// - `opts`: scale, causal (bottom-right aligned), window, soft cap and
    ///   [`AttnOpts::num_splits`] (`None`/0: FlashAttention-2's heuristic over the device's
    ///   multiprocessors; `n`: exactly `n` key splits, combined by `merge_states`) and
    ///   per-head [`AttnOpts::sinks`] (counted once, in split 0, whatever the split count).
    ///   bf16/f16 run on the tensor-core decode kernel, which needs q and the caches 16-byte
    ///   aligned ([`AttnError::Misaligned`] otherwise).
    ///
    /// Every index is checked on the host copies before any launch: capacity of each sequence,
    /// block-table entries below `num_pages`, and no page that receives new tokens referenced
    /// twice ([`AttnError::KvCache`] names the rule). When an index tensor has no host copy
    /// ([`IndexTensor::device_only`], [`Kernels::index_tensor_from_cuda`]) the same rules are
    /// checked on the device instead, by the call's first kernel, with nothing read back: a
    /// violation makes the call (and every later one) write NaN into O and LSE and leave the
    /// caches alone until [`Kernels::check_kv_status`] reports it (docs/semantics.md, "Indices
    /// checked on the device"). `o` and `lse` may not share memory with
    /// any other tensor of the call; with new tokens neither may `k_cache` or `v_cache`
    /// ([`AttnError::Aliasing`] names both tensors). With more than one split the f32 workspace
    /// (`num_splits · batch · heads · seq_q · (head_dim + 1) · 4` bytes) is allocated for the call
    /// (on CUDA on the stream, freed in stream order).
    #[allow(clippy::too_many_arguments)] // FlashAttention-2's signature plus the outputs
    pub fn flash_attn_with_kvcache_into(
        &self,
        q: &TensorView<'_>,
        k_cache: &mut TensorViewMut<'_>,
        v_cache: &mut TensorViewMut<'_>,
        k_new: Option<&TensorView<'_>>,
        v_new: Option<&TensorView<'_>>,
        cache_seqlens: &IndexTensor,
        block_table: Option<&IndexTensor>,
        o: &mut TensorViewMut<'_>,
        lse: &mut LseViewMut<'_>,
        opts: &AttnOpts<'_>,
    ) -> Result<(), AttnError> {
        let outs = (&o.raw, o.stream.as_deref(), &lse.0.raw, lse.0.stream.as_deref());
        let plan =
            self.kvcache_plan(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, Some(outs), opts, None)?;
        let outs = (o.raw.ptr, lse.0.raw.ptr);
        self.kvcache_run(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, outs, &plan, None)
    }

    /// The scales of one FP8 cache tensor on the kernels' device: `scales` holds 1 (per tensor)
    /// or `heads_kv` (per KV head) values, each between [`crate::decode::MIN_FP8_SCALE`] and
    /// [`crate::decode::MAX_FP8_SCALE`] ([`KvCacheRule::Fp8Scale`],
    /// [`KvCacheRule::Fp8ScaleCount`]). Device-backed kernels (VM or [`Kernels::on_device`]);
    /// on a caller's CUDA context use [`Kernels::fp8_scales_on`] with a stream.
    pub fn fp8_scales(&self, scales: &[f32], heads_kv: usize) -> Result<Fp8Scales, AttnError> {
        self.fp8_scales_on(scales, heads_kv, None)
    }

    /// [`Kernels::fp8_scales`] on any kernels: on CUDA kernels the scales are copied on `stream`
    /// (without waiting), and the plans using them must run on that stream.
    pub fn fp8_scales_on(
        &self,
        scales: &[f32],
        heads_kv: usize,
        stream: Option<&Arc<CudaStream>>,
    ) -> Result<Fp8Scales, AttnError> {
        check_fp8_scales("scales", scales, heads_kv, true).map_err(kv_err)?;
        let values: Vec<f32> = (0..heads_kv).map(|h| crate::decode::DecodeInputs::fp8_scale(scales, h)).collect();
        match &self.inner {
            Inner::Dev(dev) => {
                let buf = self.alloc(values.len() as u64 * 4)?;
                buf.write_bytes(&values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
                Ok(Fp8Scales { values, ptr: buf.ptr(), place: dev.place(), _storage: Fp8ScalesStorage::Dev(buf) })
            }
            Inner::Cuda(c) => {
                let stream = c.copy_stream(
                    "FP8 scales",
                    "Kernels::fp8_scales_on: CUDA kernels copy the scales on a stream",
                    stream,
                )?;
                let slice = stream.clone_htod(&values).map_err(|e| cuda_err("copying FP8 scales to the device", e))?;
                let ptr = slice.device_ptr(stream).0;
                Ok(Fp8Scales { values, ptr, place: cuda_place(stream), _storage: Fp8ScalesStorage::Cuda(slice) })
            }
        }
    }

    /// [`Kernels::plan_kvcache`] for an FP8 KV cache: bf16 `q`, `o`, `k_new`, `v_new`; the caches
    /// one byte per element ([`Fp8CacheViewMut`], both in one format) with their scales. Every
    /// check of the bf16 call applies; the decode dequantises after each load (tensor cores: widened
    /// exactly to f16 for f16 `mma.sync`; no FP8 instructions, so sm_80 runs it), the append quantises the
    /// new tokens (`encode(x / scale)`, nearest even, saturating). Run it with
    /// [`Kernels::run_kvcache_fp8`].
    #[allow(clippy::too_many_arguments)]
    pub fn plan_kvcache_fp8<'p>(
        &self,
        q: &TensorView<'_>,
        k_cache: &Fp8CacheViewMut<'_>,
        v_cache: &Fp8CacheViewMut<'_>,
        k_scale: &'p Fp8Scales,
        v_scale: &'p Fp8Scales,
        k_new: Option<&TensorView<'_>>,
        v_new: Option<&TensorView<'_>>,
        cache_seqlens: &'p IndexTensor,
        block_table: Option<&'p IndexTensor>,
        o: &TensorViewMut<'_>,
        lse: &LseViewMut<'_>,
        opts: &AttnOpts<'p>,
    ) -> Result<KvCachePlan<'p>, AttnError> {
        if v_cache.format != k_cache.format {
            return Err(AttnError::NotSupportedYet { feature: "K and V caches in two different FP8 formats" });
        }
        let fp8 = Fp8Call { format: k_cache.format, k_scale, v_scale };
        self.plan_kvcache_any(
            q,
            &k_cache.view,
            &v_cache.view,
            k_new,
            v_new,
            cache_seqlens,
            block_table,
            o,
            lse,
            opts,
            Some(fp8),
        )
    }

    /// [`Kernels::run_kvcache`] of a plan made by [`Kernels::plan_kvcache_fp8`], on this layer's
    /// FP8 caches (the planned scales).
    #[allow(clippy::too_many_arguments)]
    pub fn run_kvcache_fp8(
        &self,
        plan: &KvCachePlan<'_>,
        q: &TensorView<'_>,
        k_cache: &mut Fp8CacheViewMut<'_>,
        v_cache: &mut Fp8CacheViewMut<'_>,
        k_new: Option<&TensorView<'_>>,
        v_new: Option<&TensorView<'_>>,
        o: &mut TensorViewMut<'_>,
        lse: &mut LseViewMut<'_>,
    ) -> Result<(), AttnError> {
        if plan.plan.fp8.map(|f| f.0) != Some(k_cache.format) || v_cache.format != k_cache.format {
            return Err(kv_err(KvCacheRule::Fp8Plan { planned: plan.plan.fp8.is_some() }));
        }
        self.run_kvcache_any(plan, q, &mut k_cache.view, &mut v_cache.view, k_new, v_new, o, lse)
    }

    /// The f32 split workspace of `plan` on q's device (none for one split).
    fn split_workspace(
        &self,
        q: &TensorView<'_>,
        plan: &KvPlan,
    ) -> Result<(Option<Storage>, Option<Storage>), AttnError> {
        if plan.splits <= 1 {
            return Ok((None, None));
        }
        let (splits, rows, d) = (plan.splits as u64, plan.problem.rows(), plan.problem.head_dim as u64);
        let (ob, lb) = self.alloc_outputs(q, splits * rows * d * 4, splits * rows * 4)?;
        Ok((Some(ob), Some(lb)))
    }

    /// Plans a KV-cache call once for a batch shape (FlashInfer's plan/run split): every check of
    /// [`Kernels::flash_attn_with_kvcache_into`] on these tensors, the split count and the
    /// launches fixed, and the split workspace allocated once. [`Kernels::run_kvcache`] then runs
    /// it per layer on other buffers of the same shapes, with O(1) checks per tensor and no
    /// allocation. The plan borrows `cache_seqlens`, `block_table` and the options' sinks: they
    /// stay as planned for every run (advance `cache_seqlens` by planning again). With index
    /// tensors without host copies planning reads no value (the indices are checked on the
    /// device at each run, [`Kernels::check_kv_status`]), so planning again per step costs no
    /// wait on the device.
    ///
    /// ```
    /// use memattn::attn::{AttnOpts, Kernels, LseViewMut, TensorView, TensorViewMut};
    /// use memattn::Dtype;
    ///
    /// let kernels = Kernels::vm()?;
    /// let (b, h, d, cap) = (1, 2, 64, 40);
    /// let lens = kernels.index_tensor(&[33], None)?;
    /// let layers: Vec<_> = (0..3)
    ///     .map(|l| {
    ///         let x: Vec<f32> = (0..b * cap * h * d).map(|i| ((i * 7 + l * 13) % 29) as f32 / 29.0 - 0.5).collect();
    ///         (kernels.vm_upload(&x[..b * h * d]).unwrap(), kernels.vm_upload(&x).unwrap(), kernels.vm_upload(&x).unwrap())
    ///     })
    ///     .collect();
    /// let (o, lse) = (kernels.vm_alloc((b * h * d * 4) as u64)?, kernels.vm_alloc((b * h * 4) as u64)?);
    /// let (q0, k0, v0) = &layers[0];
    /// let (mut ov, mut lv) = (TensorViewMut::vm(&o, Dtype::F32, [b, 1, h, d])?, LseViewMut::vm(&lse, b, h, 1)?);
    /// let plan = kernels.plan_kvcache(
    ///     &TensorView::vm(q0, Dtype::F32, [b, 1, h, d])?,
    ///     &TensorViewMut::vm(k0, Dtype::F32, [b, cap, h, d])?,
    ///     &TensorViewMut::vm(v0, Dtype::F32, [b, cap, h, d])?,
    ///     None, // no new tokens
    ///     None,
    ///     &lens,
    ///     None, // a contiguous cache
    ///     &ov,
    ///     &lv,
    ///     &AttnOpts::new().num_splits(2),
    /// )?;
    /// for (q, k, v) in &layers {
    ///     let q = TensorView::vm(q, Dtype::F32, [b, 1, h, d])?;
    ///     let mut k = TensorViewMut::vm(k, Dtype::F32, [b, cap, h, d])?;
    ///     let mut v = TensorViewMut::vm(v, Dtype::F32, [b, cap, h, d])?;
    ///     kernels.run_kvcache(&plan, &q, &mut k, &mut v, None, None, &mut ov, &mut lv)?;
    ///     assert!(o.read_f32(Dtype::F32, b * h * d)?.iter().all(|x| x.is_finite()));
    /// }
    /// # Ok::<(), memattn::attn::AttnError>(())
    /// ```
    #[allow(clippy::too_many_arguments)] // FlashAttention-2's arguments plus the outputs
    pub fn plan_kvcache<'p>(
        &self,
        q: &TensorView<'_>,
        k_cache: &TensorViewMut<'_>,
        v_cache: &TensorViewMut<'_>,
        k_new: Option<&TensorView<'_>>,
        v_new: Option<&TensorView<'_>>,
        cache_seqlens: &'p IndexTensor,
        block_table: Option<&'p IndexTensor>,
        o: &TensorViewMut<'_>,
        lse: &LseViewMut<'_>,
        opts: &AttnOpts<'p>,
    ) -> Result<KvCachePlan<'p>, AttnError> {
        self.plan_kvcache_any(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, o, lse, opts, None)
    }

    /// [`Kernels::plan_kvcache`] with the caches in the dtype of the call or FP8 (`fp8`).
    #[allow(clippy::too_many_arguments)]
    fn plan_kvcache_any<'p>(
        &self,
        q: &TensorView<'_>,
        k_cache: &TensorViewMut<'_>,
        v_cache: &TensorViewMut<'_>,
        k_new: Option<&TensorView<'_>>,
        v_new: Option<&TensorView<'_>>,
        cache_seqlens: &'p IndexTensor,
        block_table: Option<&'p IndexTensor>,
        o: &TensorViewMut<'_>,
        lse: &LseViewMut<'_>,
        opts: &AttnOpts<'p>,
        fp8: Option<Fp8Call<'p>>,
    ) -> Result<KvCachePlan<'p>, AttnError> {
        let outs = (&o.raw, o.stream.as_deref(), &lse.0.raw, lse.0.stream.as_deref());
        let plan =
            self.kvcache_plan(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, Some(outs), opts, fp8)?;
        let workspace = self.split_workspace(q, &plan)?;
        Ok(KvCachePlan {
            kernels: self.place_name(),
            place: q.raw.place,
            dtype: q.raw.dtype,
            shapes: [q.raw.shape, k_cache.raw.shape, o.raw.shape, lse.0.raw.shape],
            new_shape: k_new.map(|t| t.raw.shape),
            mma: plan.launches.iter().any(|(k, _)| copies_in_16_byte_chunks(*k)),
            plan,
            workspace,
            cache_seqlens,
            block_table,
            _scales: fp8.map(|f| (f.k_scale, f.v_scale)),
            _sinks: std::marker::PhantomData,
        })
    }

    /// Runs a planned KV-cache call ([`Kernels::plan_kvcache`]) on this layer's tensors: they must
    /// have the planned shapes, dtype and device (and stream), be contiguous as planned, lie
    /// inside their buffers and, for the tensor-core decode kernel, be 16-byte aligned; each is
    /// checked in O(1) and named in the error. The plan's split workspace is reused, so runs of
    /// one plan must be ordered (one stream, as the views' stream is checked to be the planned
    /// one).
    #[allow(clippy::too_many_arguments)]
    pub fn run_kvcache(
        &self,
        plan: &KvCachePlan<'_>,
        q: &TensorView<'_>,
        k_cache: &mut TensorViewMut<'_>,
        v_cache: &mut TensorViewMut<'_>,
        k_new: Option<&TensorView<'_>>,
        v_new: Option<&TensorView<'_>>,
        o: &mut TensorViewMut<'_>,
        lse: &mut LseViewMut<'_>,
    ) -> Result<(), AttnError> {
        if plan.plan.fp8.is_some() {
            return Err(kv_err(KvCacheRule::Fp8Plan { planned: true }));
        }
        self.run_kvcache_any(plan, q, k_cache, v_cache, k_new, v_new, o, lse)
    }

    /// [`Kernels::run_kvcache`] for either kind of cache (the plan says which).
    #[allow(clippy::too_many_arguments)]
    fn run_kvcache_any(
        &self,
        plan: &KvCachePlan<'_>,
        q: &TensorView<'_>,
        k_cache: &mut TensorViewMut<'_>,
        v_cache: &mut TensorViewMut<'_>,
        k_new: Option<&TensorView<'_>>,
        v_new: Option<&TensorView<'_>>,
        o: &mut TensorViewMut<'_>,
        lse: &mut LseViewMut<'_>,
    ) -> Result<(), AttnError> {
        let fp8 = plan.plan.fp8.is_some();
        let mut tensors: Vec<(&'static str, &RawView, [usize; 4])> = vec![
            ("q", &q.raw, plan.shapes[0]),
            ("k_cache", &k_cache.raw, plan.shapes[1]),
            ("v_cache", &v_cache.raw, plan.shapes[1]),
            ("o", &o.raw, plan.shapes[2]),
            ("lse", &lse.0.raw, plan.shapes[3]),
        ];
        match (plan.new_shape, k_new, v_new) {
            (Some(shape), Some(k), Some(v)) => {
                tensors.push(("k_new", &k.raw, shape));
                tensors.push(("v_new", &v.raw, shape));
            }
            (None, None, None) => {}
            (planned, _, _) => {
                return Err(AttnError::KvCache {
                    why: KvCacheRule::PlanNewTokens {
                        planned: planned.is_some(),
                        given: k_new.is_some() || v_new.is_some(),
                    },
                });
            }
        }
        if self.place_name() != plan.kernels {
            return Err(AttnError::WrongDevice {
                tensor: "the plan",
                got: plan.kernels.clone(),
                expected: format!("{} (plan and run on one kernels handle)", self.place_name()),
            });
        }
        for (name, t, shape) in &tensors {
            if t.place != plan.place {
                return Err(AttnError::WrongDevice {
                    tensor: name,
                    got: t.place.to_string(),
                    expected: format!("{} (and the stream) the plan was made for", plan.place),
                });
            }
            let want = if *name == "lse" { Dtype::F32 } else { plan.dtype };
            if t.dtype != want {
                return Err(AttnError::Dtype { tensor: name, got: t.dtype, expected: want });
            }
            if t.shape != *shape {
                return Err(AttnError::Shape {
                    tensor: name,
                    got: t.shape,
                    why: ShapeRule::NotPlanned { planned: *shape },
                });
            }
            if t.strides != contiguous(t.shape) {
                return Err(AttnError::NotContiguous { tensor: name, strides: t.strides, want: contiguous(t.shape) });
            }
            if fp8 && matches!(*name, "k_cache" | "v_cache") {
                fp8_bytes_view(t).check_bounds(name)?;
            } else {
                t.check_bounds(name)?;
            }
            if plan.mma && matches!(*name, "q" | "k_cache" | "v_cache") && !t.ptr.is_multiple_of(16) {
                return Err(AttnError::Misaligned {
                    tensor: name,
                    what: "the base pointer",
                    got: format!("{:#x}", t.ptr),
                    entry: plan.plan.launches[0].0.name(),
                    need: "16-byte aligned base pointers (cp.async copies 16-byte chunks)",
                });
            }
        }
        let appends = plan.new_shape.is_some_and(|s| s[1] > 0);
        let sized: Vec<(&'static str, RawView)> = tensors
            .iter()
            .map(|(name, t, _)| {
                (*name, if fp8 && matches!(*name, "k_cache" | "v_cache") { fp8_bytes_view(t) } else { **t })
            })
            .collect();
        let mut extents = kv_extents(sized.iter().map(|(name, t)| (*name, t)), appends);
        extents.push(alias::Extent::of_index("cache_seqlens", plan.cache_seqlens));
        if let Some((_, ks, vs)) = plan.plan.fp8 {
            let n = plan.shapes[1][2] as u64 * 4;
            extents.push(alias::Extent::of_ptr("k_scale", plan.place, ks, n));
            extents.push(alias::Extent::of_ptr("v_scale", plan.place, vs, n));
        }
        if let Some(bt) = plan.block_table {
            extents.push(alias::Extent::of_index("block_table", bt));
        }
        if plan.plan.sinks != 0 {
            // The plan holds the sinks' address only: `heads` f32 from there.
            let heads = plan.shapes[0][2] as u64;
            extents.push(alias::Extent::of_ptr("sinks", plan.place, plan.plan.sinks, heads * 4));
        }
        if plan.plan.alibi.0 != 0 {
            // `heads` f32 slopes per sequence, one row or `batch`.
            let [b, _, heads, _] = plan.shapes[0];
            let rows = if plan.plan.alibi.1 == 0 { 1 } else { b as u64 };
            extents.push(alias::Extent::of_ptr("alibi_slopes", plan.place, plan.plan.alibi.0, rows * heads as u64 * 4));
        }
        alias::check_disjoint(&extents)?;
        let ptr = |s: &Option<Storage>| s.as_ref().map_or(0, |s| s.ptr());
        let workspace = Some((ptr(&plan.workspace.0), ptr(&plan.workspace.1)));
        let outs = (o.raw.ptr, lse.0.raw.ptr);
        let (cs, bt) = (plan.cache_seqlens, plan.block_table);
        self.kvcache_run(q, k_cache, v_cache, cs, bt, k_new, v_new, outs, &plan.plan, workspace)
    }

    /// Launches a validated call ([`Self::kvcache_plan`]) with outputs at `outs`.
    #[allow(clippy::too_many_arguments)]
    fn kvcache_run(
        &self,
        q: &TensorView<'_>,
        k_cache: &TensorViewMut<'_>,
        v_cache: &TensorViewMut<'_>,
        cache_seqlens: &IndexTensor,
        block_table: Option<&IndexTensor>,
        k_new: Option<&TensorView<'_>>,
        v_new: Option<&TensorView<'_>>,
        outs: (u64, u64),
        plan: &KvPlan,
        workspace: Option<(u64, u64)>,
    ) -> Result<(), AttnError> {
        let p = &plan.problem;
        let splits = plan.splits;
        let d = p.head_dim as u64;
        // The split workspace: the reusable plan's, or one for this call only.
        let (ws_o, ws_lse) = match workspace {
            Some(_) => (None, None),
            None => self.split_workspace(q, plan)?,
        };
        let ptr = |s: &Option<Storage>| s.as_ref().map_or(0, |s| s.ptr());
        let (o_part, lse_part) = workspace.unwrap_or((ptr(&ws_o), ptr(&ws_lse)));
        let bufs = DecodeBuffers {
            q: q.raw.ptr,
            k_cache: k_cache.raw.ptr,
            v_cache: v_cache.raw.ptr,
            k_new: k_new.map_or(0, |t| t.raw.ptr),
            v_new: v_new.map_or(0, |t| t.raw.ptr),
            block_table: block_table.map_or(0, |t| t.ptr),
            cache_seqlens: cache_seqlens.ptr,
            o: outs.0,
            lse: outs.1,
            o_part,
            lse_part,
            sinks: plan.sinks,
            k_scale: plan.fp8.map_or(0, |f| f.1),
            v_scale: plan.fp8.map_or(0, |f| f.2),
            cache_batch_idx: plan.slots[0],
            cache_leftpad: plan.slots[1],
            alibi_slopes: plan.alibi.0,
            alibi_batch_stride: plan.alibi.1,
            status: if plan.on_device { self.kv_status_ptr()? } else { 0 },
            cache_slots: plan.cache_slots,
            ..DecodeBuffers::default()
        };
        // Rotary: rotated copies of q and k_new for this call (the rotary kernel writes them, the
        // append and the forward read them in place of the originals).
        let rot = match p.rotary {
            Some(_) => {
                let es = p.dtype.size_bytes();
                Some(self.alloc_outputs(q, p.q_elems() * es, p.new_elems() * es)?)
            }
            None => None,
        };
        // The rotary launch reads q and k_new and writes the copies; every later launch reads the
        // copies.
        let (rotary, bufs) = match &rot {
            Some((qr, kr)) => {
                let (q_rot, k_rot) = (qr.ptr(), kr.ptr());
                let rb = DecodeBuffers { rotary_cos: plan.rotary[0], rotary_sin: plan.rotary[1], q_rot, k_rot, ..bufs };
                (
                    Some(decode_params(p, plan.layout, splits, &rb).to_bytes()),
                    DecodeBuffers { q: q_rot, k_new: k_rot, ..bufs },
                )
            }
            None => (None, bufs),
        };
        let params = decode_params(p, plan.layout, splits, &bufs).to_bytes();
        let merge = merge_params(p, splits, &bufs, Strides::bshd(p.seq_q as u64, p.heads as u64, d)).to_bytes();
        let prefill = prefill_params(p, plan.layout, &bufs).to_bytes();
        for (kernel, dims) in &plan.launches {
            let arg: &[u8] = match (kernel.variant().family, &rotary) {
                (Family::MergeStates, _) => &merge,
                (Family::FlashMma, _) => &prefill,
                (Family::DecodeRotary, Some(r)) => r,
                _ => &params,
            };
            self.launch_bytes(*kernel, dims, arg, q.stream.as_deref())?;
        }
        drop((ws_o, ws_lse, rot)); // after the launches: on CUDA freed in stream order
        Ok(())
    }

    /// Every check of a KV-cache call, before anything is allocated or launched.
    #[allow(clippy::too_many_arguments)]
    fn kvcache_plan(
        &self,
        q: &TensorView<'_>,
        k_cache: &TensorViewMut<'_>,
        v_cache: &TensorViewMut<'_>,
        cache_seqlens: &IndexTensor,
        block_table: Option<&IndexTensor>,
        k_new: Option<&TensorView<'_>>,
        v_new: Option<&TensorView<'_>>,
        outs: Option<(&RawView, Option<&CudaStream>, &RawView, Option<&CudaStream>)>,
        opts: &AttnOpts<'_>,
        fp8: Option<Fp8Call<'_>>,
    ) -> Result<KvPlan, AttnError> {
        let splits = match opts.num_splits {
            None | Some(0) => Splits::Auto,
            Some(n) if n <= MAX_SPLITS => Splits::Fixed(n),
            Some(n) => return Err(AttnError::Splits { got: n, max: MAX_SPLITS }),
        };
        let window = opts.window_i32()?;
        let mut tensors: Vec<(&'static str, &RawView, Option<&CudaStream>)> = vec![
            ("q", &q.raw, q.stream.as_deref()),
            ("k_cache", &k_cache.raw, k_cache.stream.as_deref()),
            ("v_cache", &v_cache.raw, v_cache.stream.as_deref()),
        ];
        match (k_new, v_new) {
            (Some(k), Some(v)) => {
                tensors.push(("k_new", &k.raw, k.stream.as_deref()));
                tensors.push(("v_new", &v.raw, v.stream.as_deref()));
            }
            (None, None) => {}
            (k, _) => {
                let (missing, given) = if k.is_some() { ("v_new", "k_new") } else { ("k_new", "v_new") };
                return Err(AttnError::KvCache { why: KvCacheRule::NewTokensPair { missing, given } });
            }
        }
        if let Some((o, os, l, ls)) = outs {
            tensors.push(("o", o, os));
            tensors.push(("lse", l, ls));
        }
        if let Some(s) = opts.sinks {
            tensors.push(("sinks", &s.0.raw, s.0.stream.as_deref()));
        }
        if let Some(a) = opts.alibi_slopes {
            tensors.push(("alibi_slopes", a.raw(), a.stream()));
        }
        if let Some(r) = opts.rotary {
            tensors.push(("rotary_cos", &r.cos.raw, r.cos.stream.as_deref()));
            tensors.push(("rotary_sin", &r.sin.raw, r.sin.stream.as_deref()));
        }
        self.check_places(&tensors, &q.raw)?;
        self.check_index("cache_seqlens", cache_seqlens, &q.raw)?;
        if let Some(bt) = block_table {
            self.check_index("block_table", bt, &q.raw)?;
        }
        if let Some(t) = opts.cache_batch_idx {
            self.check_index("cache_batch_idx", t, &q.raw)?;
        }
        if let Some(t) = opts.cache_leftpad {
            self.check_index("cache_leftpad", t, &q.raw)?;
        }
        let dtype = q.raw.dtype;
        if fp8.is_some() && dtype != Dtype::Bf16 {
            return Err(kv_err(KvCacheRule::Fp8Dtype { dtype }));
        }
        for (name, t, _) in &tensors {
            let want = if matches!(*name, "lse" | "sinks" | "alibi_slopes") { Dtype::F32 } else { dtype };
            if t.dtype != want {
                return Err(AttnError::Dtype { tensor: name, got: t.dtype, expected: want });
            }
        }
        // Shapes.
        let [b, sq, h, d] = q.raw.shape;
        let kshape = check_cache_shape(h, d, &k_cache.raw, &v_cache.raw)?;
        let [c0, c1, hk, _] = kshape;
        let mut seq_new = 0;
        if let (Some(kn), Some(vn)) = (k_new, v_new) {
            seq_new = kn.raw.shape[1];
            for (name, t) in [("k_new", &kn.raw), ("v_new", &vn.raw)] {
                if t.shape != [b, seq_new, hk, d] {
                    return Err(AttnError::Shape {
                        tensor: name,
                        got: t.shape,
                        why: ShapeRule::NewTokens { want: [b, seq_new, hk, d] },
                    });
                }
            }
        }
        if let Some((o, _, l, _)) = outs {
            if o.shape != q.raw.shape {
                return Err(AttnError::Shape {
                    tensor: "o",
                    got: o.shape,
                    why: ShapeRule::Output { of: "q's", want: q.raw.shape },
                });
            }
            if l.shape != [b, h, sq, 1] || l.strides != contiguous([b, h, sq, 1]) {
                return Err(AttnError::Shape {
                    tensor: "lse",
                    got: l.shape,
                    why: ShapeRule::Lse { want: [b, h, sq], packed: false },
                });
            }
        }
        if let Some(s) = opts.sinks {
            if s.heads() != h {
                return Err(AttnError::Sinks { why: SinksRule::Count { got: s.heads(), heads: h } });
            }
            if !s.0.raw.ptr.is_multiple_of(4) {
                return Err(AttnError::Sinks { why: SinksRule::Misaligned { ptr: s.0.raw.ptr } });
            }
        }
        // The decode kernels address every tensor as contiguous.
        for (name, t, _) in &tensors {
            if !matches!(*name, "lse" | "sinks" | "alibi_slopes") && t.strides != contiguous(t.shape) {
                return Err(AttnError::NotContiguous { tensor: name, strides: t.strides, want: contiguous(t.shape) });
            }
        }
        if cache_seqlens.len != b {
            return Err(AttnError::SeqLens {
                tensor: "cache_seqlens",
                why: SeqLensRule::BatchEntries { got: cache_seqlens.len, batch: b },
            });
        }
        // Without a host copy of any index, every index is checked on the device, and the call
        // is planned for the worst case its shapes allow (FlashAttention-2 plans from the cache's
        // size too): each sequence at the cache's capacity, no left padding.
        let on_device = [Some(cache_seqlens), block_table, opts.cache_batch_idx, opts.cache_leftpad]
            .into_iter()
            .flatten()
            .any(|t| !t.host);
        let layout = match block_table {
            None if opts.cache_batch_idx.is_some() => {
                // The sequences' slots, each inside the cache's first dimension.
                let slots = opts.cache_batch_idx.map_or(&[][..], |t| &t.values[..]);
                if let Some((batch, &slot)) =
                    slots.iter().enumerate().find(|&(_, &s)| s as usize >= c0).filter(|_| !on_device)
                {
                    return Err(kv_err(KvCacheRule::SlotPastEnd {
                        batch,
                        slot,
                        slots: u32_of("k_cache", kshape, c0, "slots")?,
                    }));
                }
                CacheLayout::Contiguous { seq_cache: u32_of("k_cache", kshape, c1, "seq_cache")? }
            }
            None => {
                if c0 != b {
                    return Err(AttnError::Shape {
                        tensor: "k_cache",
                        got: kshape,
                        why: ShapeRule::CacheBatch { got: c0, q: b },
                    });
                }
                CacheLayout::Contiguous { seq_cache: u32_of("k_cache", kshape, c1, "seq_cache")? }
            }
            Some(bt) => {
                let n = bt.len;
                if b == 0 || n == 0 || !n.is_multiple_of(b) {
                    return Err(AttnError::KvCache { why: KvCacheRule::BlockTableShape { entries: n, batch: b } });
                }
                CacheLayout::Paged {
                    page_size: u32_of("k_cache", kshape, c1, "page_size")?,
                    num_pages: u32_of("k_cache", kshape, c0, "num_pages")?,
                    max_pages: u32_of("k_cache", kshape, n / b, "max_pages")?,
                }
            }
        };
        let capacity = layout.capacity();
        let seq_new_u32 = u32::try_from(seq_new).unwrap_or(u32::MAX);
        let problem = DecodeProblem {
            batch: u32_of("q", q.raw.shape, b, "batch")?,
            heads: u32_of("q", q.raw.shape, h, "heads")?,
            heads_kv: u32_of("k_cache", kshape, hk, "heads_kv")?,
            head_dim: u32_of("q", q.raw.shape, d, "head_dim")?,
            seq_q: u32_of("q", q.raw.shape, sq, "seq_q")?,
            cache_seqlens: cache_seqlens.values.clone(),
            seq_new: u32_of("k_new", kshape, seq_new, "seq_new")?,
            page_size: match layout {
                CacheLayout::Paged { page_size, .. } => Some(page_size),
                CacheLayout::Contiguous { .. } => None,
            },
            dtype,
            causal: opts.causal,
            window_left: window.0,
            window_right: window.1,
            softcap: opts.softcap.unwrap_or(0.0),
            scale: opts.softmax_scale,
            splits,
            sm_count: self.sm_count(),
            sm_count_source: if self.is_vm() { SmCountSource::Default } else { SmCountSource::Device },
            kernel: opts.decode_kernel,
            sinks: opts.sinks.is_some(),
            alibi: opts.alibi_slopes.is_some(),
            kv_fp8: fp8.map(|f| f.format),
            cache_batch_idx: opts.cache_batch_idx.map(|t| t.values.clone()),
            cache_leftpad: opts.cache_leftpad.map(|t| t.values.clone()),
            rotary: opts
                .rotary
                .map(|r| crate::decode::Rotary { dim: (2 * r.cos.raw.shape[1]) as u32, interleaved: r.interleaved }),
        };
        // Without host values, the worst case the shapes allow (the device checks the values).
        let problem = match on_device {
            true => problem.at_capacity(capacity, u32::try_from(c0).unwrap_or(u32::MAX)),
            false => problem,
        };
        problem.validate().map_err(kv_err)?;
        if let Some(r) = opts.rotary {
            // [seqlen_ro, rotary_dim / 2, 1, 1] each, one row per rotated position.
            let (cs, ss) = (r.cos.raw.shape, r.sin.raw.shape);
            let need = problem.rotary_rows();
            if cs != ss || cs[2] != 1 || cs[3] != 1 || cs[0] < need as usize {
                return Err(kv_err(KvCacheRule::RotaryTables {
                    rows: cs[0],
                    half: cs[1],
                    need,
                    cos_shape: cs,
                    sin_shape: ss,
                }));
            }
        }
        if !on_device {
            check_cache_layout(&problem, layout, block_table.map_or(&[][..], |t| &t.values)).map_err(kv_err)?;
        } else if seq_new_u32 > capacity || capacity == 0 && matches!(layout, CacheLayout::Paged { .. }) {
            // No cache_seqlens could make room for the new tokens.
            return Err(kv_err(match layout {
                CacheLayout::Contiguous { seq_cache } => {
                    KvCacheRule::Capacity { batch: 0, cache_seqlen: 0, new: seq_new_u32, seq_cache }
                }
                CacheLayout::Paged { page_size, max_pages, .. } => KvCacheRule::Pages {
                    batch: 0,
                    cache_seqlen: 0,
                    new: seq_new_u32,
                    need: seq_new_u32.div_ceil(page_size.max(1)),
                    page_size,
                    max_pages,
                },
            }));
        }
        let plan = problem.plan().map_err(kv_err)?;
        let mut launches = planned_launches(&problem, &plan, self.target()?).map_err(kv_err)?;
        if on_device {
            // First in the stream: the check every later launch of the call obeys.
            let check = KernelId::find(Family::DecodeCheck, dtype.elem(), None)
                .ok_or(AttnError::NotSupportedYet { feature: "device-checked indices for this dtype" })?;
            launches.insert(0, (check, kernels_gpu::tiles::APPEND.launch(1, 1)));
            // The status words the check writes, made now (once per kernels handle): a run of
            // the plan then allocates and waits for nothing.
            self.kv_status_ptr()?;
        }
        self.check_module(&launches.iter().map(|l| l.0).collect::<Vec<_>>())?;
        for (kernel, dims) in &launches {
            self.check_grid(*kernel, dims)?;
        }
        let fp8_cache = |name: &str| fp8.is_some() && matches!(name, "k_cache" | "v_cache");
        for (name, t, _) in &tensors {
            if fp8_cache(name) {
                fp8_bytes_view(t).check_bounds(name)?;
            } else {
                t.check_bounds(name)?;
            }
        }
        let sized: Vec<(&'static str, RawView)> =
            tensors.iter().map(|(name, t, _)| (*name, if fp8_cache(name) { fp8_bytes_view(t) } else { **t })).collect();
        let mut extents = kv_extents(sized.iter().map(|(name, t)| (*name, t)), seq_new > 0);
        extents.push(alias::Extent::of_index("cache_seqlens", cache_seqlens));
        if let Some(f) = fp8 {
            for (name, s) in [("k_scale", f.k_scale), ("v_scale", f.v_scale)] {
                if s.values.len() != hk {
                    return Err(kv_err(KvCacheRule::Fp8ScaleCount {
                        tensor: name,
                        got: s.values.len(),
                        heads_kv: hk,
                        fp8: true,
                    }));
                }
                let same = match (s.place, q.raw.place) {
                    (Place::Cuda { ctx, stream }, Place::Cuda { ctx: qc, stream: qs }) => {
                        if ctx == qc && stream != qs {
                            return Err(AttnError::StreamMismatch { tensor: name, got: stream, expected: qs });
                        }
                        ctx == qc
                    }
                    (a, b) => a == b,
                };
                if !same {
                    return Err(AttnError::WrongDevice {
                        tensor: name,
                        got: s.place.to_string(),
                        expected: q.raw.place.to_string(),
                    });
                }
                extents.push(alias::Extent::of_ptr(name, q.raw.place, s.ptr, s.bytes()));
            }
        }
        if let Some(bt) = block_table {
            extents.push(alias::Extent::of_index("block_table", bt));
        }
        for (name, t) in [("cache_batch_idx", opts.cache_batch_idx), ("cache_leftpad", opts.cache_leftpad)] {
            if let Some(t) = t {
                extents.push(alias::Extent::of_index(name, t));
            }
        }
        alias::check_disjoint(&extents)?;
        // The tensor-core decode kernel copies q and the caches in 16-byte chunks (`cp.async`).
        if let Some((kernel, _)) = launches.iter().find(|(k, _)| copies_in_16_byte_chunks(*k)) {
            for (name, t, _) in &tensors {
                if matches!(*name, "q" | "k_cache" | "v_cache") && !t.ptr.is_multiple_of(16) {
                    return Err(AttnError::Misaligned {
                        tensor: name,
                        what: "the base pointer",
                        got: format!("{:#x}", t.ptr),
                        entry: kernel.name(),
                        need: "16-byte aligned base pointers (cp.async copies 16-byte chunks)",
                    });
                }
            }
        }
        let alibi = opts.alibi_slopes.map(|a| a.check(h, b)).transpose()?;
        Ok(KvPlan {
            splits: plan.num_splits,
            layout,
            launches,
            problem,
            sinks: opts.sinks.map_or(0, |s| s.0.raw.ptr),
            alibi: alibi.unwrap_or((0, 0)),
            fp8: fp8.map(|f| (f.format, f.k_scale.ptr, f.v_scale.ptr)),
            slots: [opts.cache_batch_idx.map_or(0, |t| t.ptr), opts.cache_leftpad.map_or(0, |t| t.ptr)],
            rotary: opts.rotary.map_or([0, 0], |r| [r.cos.raw.ptr, r.sin.raw.ptr]),
            on_device,
            cache_slots: u32_of("k_cache", kshape, c0, "its first dimension")?,
        })
    }
}

/// The extents of a KV-cache call's views: `o` and `lse` are written, and with new tokens to
/// append (`appends`) the caches too, so then they may not overlap each other, q, the new
/// tokens or anything else.
fn kv_extents<'r>(tensors: impl Iterator<Item = (&'static str, &'r RawView)>, appends: bool) -> Vec<alias::Extent> {
    tensors
        .map(|(name, t)| {
            let written = matches!(name, "o" | "lse") || (appends && matches!(name, "k_cache" | "v_cache"));
            alias::Extent::of_view(name, t, written)
        })
        .collect()
}

/// A KV-cache call planned once ([`Kernels::plan_kvcache`]) and run per layer
/// ([`Kernels::run_kvcache`]): the validated problem, the split count and launches, what every
/// run must match, and the split workspace (allocated once, freed with the plan).
pub struct KvCachePlan<'p> {
    plan: KvPlan,
    /// The kernels handle it was planned on ([`Kernels::place_name`]).
    kernels: String,
    place: Place,
    dtype: Dtype,
    /// q, the caches, o, lse.
    shapes: [[usize; 4]; 4],
    new_shape: Option<[usize; 4]>,
    mma: bool,
    workspace: (Option<Storage>, Option<Storage>),
    cache_seqlens: &'p IndexTensor,
    block_table: Option<&'p IndexTensor>,
    /// An FP8 plan's scales (their addresses are in the plan).
    _scales: Option<(&'p Fp8Scales, &'p Fp8Scales)>,
    _sinks: std::marker::PhantomData<&'p ()>,
}

impl fmt::Debug for KvCachePlan<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvCachePlan")
            .field("splits", &self.plan.splits)
            .field("launches", &self.plan.launches.iter().map(|(k, _)| k.name()).collect::<Vec<_>>())
            .field("shapes", &self.shapes)
            .finish()
    }
}

impl KvCachePlan<'_> {
    /// The split count the plan runs with (1: no workspace, no merge).
    pub fn num_splits(&self) -> u32 {
        self.plan.splits
    }

    /// Device-backed kernels: sets every 32-bit word of the split workspace (the partial O and
    /// LSE of each split) to `value`, e.g. a NaN poison that shows a state no kernel wrote.
    /// Nothing to do for one split; on CUDA kernels an error (the workspace is cudarc's there).
    pub fn fill_workspace_u32(&self, value: u32) -> Result<(), AttnError> {
        for s in [&self.workspace.0, &self.workspace.1].into_iter().flatten() {
            match s {
                Storage::Dev(b) => b.fill_u32(b.bytes() / 4, value)?,
                Storage::Cuda { .. } => {
                    return Err(AttnError::NotSupportedYet { feature: "filling the split workspace of CUDA kernels" });
                }
            }
        }
        Ok(())
    }
}

/// A validated KV-cache call.
struct KvPlan {
    splits: u32,
    layout: CacheLayout,
    launches: Vec<(KernelId, kernels_gpu::tiles::LaunchDims)>,
    problem: DecodeProblem,
    /// The sinks' device address (`0` = none).
    sinks: u64,
    /// The ALiBi slopes' device address (`0` = none) and batch stride.
    alibi: (u64, u32),
    /// An FP8 cache: its format and the device addresses of the K and V scales.
    fp8: Option<(Fp8Format, u64, u64)>,
    /// The device addresses of `cache_batch_idx` and `cache_leftpad` (`0` = none).
    slots: [u64; 2],
    /// The device addresses of the rotary tables (`0` = no rotary).
    rotary: [u64; 2],
    /// Indices checked on the device (an index tensor without host values): the call starts
    /// with `decode_check` and every launch obeys the status words.
    on_device: bool,
    /// The cache's first dimension (pages, or slots), for the device check.
    cache_slots: u32,
}

/// The [`KvCacheRule`] of status words a device-side check set
/// ([`kernels_gpu::decode_abi::kv_status`]).
pub(super) fn status_rule(w: &[u32]) -> KvCacheRule {
    use kernels_gpu::decode_abi::kv_status as st;
    let batch = w[1] as usize;
    match w[0] {
        st::CAPACITY => KvCacheRule::Capacity { batch, cache_seqlen: w[2], new: w[3], seq_cache: w[4] },
        st::PAGES => {
            KvCacheRule::Pages { batch, cache_seqlen: w[2], new: w[3], need: w[4], page_size: w[5], max_pages: w[6] }
        }
        st::PAGE_PAST_END => KvCacheRule::PagePastEnd { batch, slot: w[2] as usize, page: w[3], num_pages: w[4] },
        st::SLOT_PAST_END => KvCacheRule::SlotPastEnd { batch, slot: w[2], slots: w[3] },
        st::LEFTPAD => KvCacheRule::LeftpadPastSeqlen { batch, leftpad: w[2], cache_seqlen: w[3] },
        st::SHARED_SLOT => KvCacheRule::SharedSlot { slot: w[2], first: w[3] as usize, second: batch },
        st::SHARED_WRITTEN_PAGE => KvCacheRule::SharedWrittenPage { page: w[2] },
        code => KvCacheRule::StatusCode { code, words: w.to_vec() },
    }
}
