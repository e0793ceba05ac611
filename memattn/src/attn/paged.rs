//! Chunked prefill over a paged KV cache for a mixed batch: [`Kernels::flash_attn_varlen_paged`],
//! the tensor-core forward reading K and V through the block table.

use super::*;
use crate::decode::{check_cache_layout, CacheLayout, DecodeProblem};
use crate::error::KvCacheRule;
use kernels_gpu::variants::Tile;

impl Kernels {
    /// Attention of packed query chunks against a paged KV cache, vLLM's mixed prefill and
    /// decode batch (FlashAttention-2's `flash_attn_varlen_func` with `block_table` and
    /// `seqused_k`): one launch of the bf16/f16 tensor-core forward, which reads K and V through
    /// the block table.
    ///
    /// - `q`: `[1, total_q, heads, head_dim]`, contiguous; sequence `b` is rows
    ///   `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` (a decode row is a chunk of 1).
    /// - `k_cache`, `v_cache`: `[num_pages, page_size, heads_kv, head_dim]`, contiguous, the same
    ///   shape; `heads_kv` divides `heads` (GQA). Any page size.
    /// - `seqused_k`: `[batch]` keys of each sequence (its chunk's keys included: the cache is
    ///   written before attention, as vLLM does); key `j` of sequence `b` is row `j % page_size`
    ///   of page `block_table[b * max_pages + j / page_size]`.
    /// - `block_table`: `[batch, max_pages]`; entries past a sequence's last page are not read.
    /// - `max_seqlen_q` bounds the longest chunk (it sizes the grid).
    /// - `opts`: scale, causal (bottom-right: query `i` of a chunk of `n` sees keys
    ///   `j <= i + seqused_k[b] - n`), window, soft cap, sinks. ALiBi, split counts and the
    ///   KV-cache options are refused.
    ///
    /// Returns `o` `[1, total_q, heads, head_dim]` and `lse` `[heads, total_q]` (shape
    /// `[1, heads, total_q, 1]`). Every index is checked on the host copies before the launch
    /// ([`AttnError::SeqLens`], [`AttnError::KvCache`] name the rule).
    ///
    /// ```
    /// use memattn::attn::{AttnOpts, Kernels, TensorView};
    /// use memattn::Dtype;
    ///
    /// let kernels = Kernels::vm()?;
    /// let (h, d, page) = (2, 64, 16);
    /// // Two sequences: a chunk of 3 tokens with 20 keys (pages 1, 0), one decode row with 5 keys (page 2).
    /// let cache: Vec<f32> = (0..3 * page * h * d).map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5).collect();
    /// let kc = kernels.vm_upload_as(Dtype::Bf16, &cache)?;
    /// let q = kernels.vm_upload_as(Dtype::Bf16, &vec![0.0; 4 * h * d])?; // q = 0: uniform weights
    /// let kv = TensorView::vm(&kc, Dtype::Bf16, [3, page, h, d])?;
    /// let cu = kernels.index_tensor(&[0, 3, 4], None)?;
    /// let used = kernels.index_tensor(&[20, 5], None)?;
    /// let table = kernels.index_tensor(&[1, 0, 2, 2], None)?; // [batch, max_pages = 2]
    /// let (o, lse) = kernels.flash_attn_varlen_paged(
    ///     &TensorView::vm(&q, Dtype::Bf16, [1, 4, h, d])?,
    ///     &kv,
    ///     &kv,
    ///     &cu,
    ///     &used,
    ///     &table,
    ///     3,
    ///     &AttnOpts::new().causal(true),
    /// )?;
    /// let lse = lse.to_vec_f32()?; // [heads, total_q]
    /// // Causal: the chunk's first token sees keys 0..=17, the last all 20; the decode row all 5.
    /// assert!((lse[0] - 18f32.ln()).abs() < 1e-5);
    /// assert!((lse[2] - 20f32.ln()).abs() < 1e-5);
    /// assert!((lse[3] - 5f32.ln()).abs() < 1e-5);
    /// assert_eq!(o.shape(), [1, 4, h, d]);
    /// # Ok::<(), memattn::attn::AttnError>(())
    /// ```
    #[allow(clippy::too_many_arguments)] // FlashAttention-2's / vLLM's arguments
    pub fn flash_attn_varlen_paged(
        &self,
        q: &TensorView<'_>,
        k_cache: &TensorView<'_>,
        v_cache: &TensorView<'_>,
        cu_seqlens_q: &IndexTensor,
        seqused_k: &IndexTensor,
        block_table: &IndexTensor,
        max_seqlen_q: usize,
        opts: &AttnOpts<'_>,
    ) -> Result<(DeviceTensor, DeviceTensor), AttnError> {
        let refuse = |why: &'static str| AttnError::KvCache { why: KvCacheRule::PrefillUnsupported { why } };
        opts.check_one_split()?;
        if opts.alibi_slopes.is_some() {
            return Err(AttnError::Alibi { why: AlibiRule::Unsupported { call: "flash_attn_varlen_paged" } });
        }
        if opts.cache_batch_idx.is_some() || opts.cache_leftpad.is_some() || opts.rotary.is_some() {
            return Err(refuse("takes no cache_batch_idx, cache_leftpad or rotary tables here"));
        }
        let window = opts.window_i32()?;
        let mut tensors: Vec<(&'static str, &RawView, Option<&CudaStream>)> = vec![
            ("q", &q.raw, q.stream.as_deref()),
            ("k_cache", &k_cache.raw, k_cache.stream.as_deref()),
            ("v_cache", &v_cache.raw, v_cache.stream.as_deref()),
        ];
        if let Some(s) = opts.sinks {
            tensors.push(("sinks", &s.0.raw, s.0.stream.as_deref()));
        }
        self.check_places(&tensors, &q.raw)?;
        for (name, t) in [("cu_seqlens_q", cu_seqlens_q), ("seqused_k", seqused_k), ("block_table", block_table)] {
            self.check_index(name, t, &q.raw)?;
        }
        let dtype = q.raw.dtype;
        if !dtype.is_16bit() {
            return Err(refuse("takes bf16 or f16"));
        }
        for (name, t, _) in &tensors {
            let want = if *name == "sinks" { Dtype::F32 } else { dtype };
            if t.dtype != want {
                return Err(AttnError::Dtype { tensor: name, got: t.dtype, expected: want });
            }
        }
        // Shapes.
        let [b, total_q, h, d] = q.raw.shape;
        if b != 1 {
            return Err(AttnError::Shape { tensor: "q", got: q.raw.shape, why: ShapeRule::PackedBatch });
        }
        let kshape = super::kvcache::check_cache_shape(h, d, &k_cache.raw, &v_cache.raw)?;
        let [num_pages, page_size, hk, _] = kshape;
        for (name, t, _) in &tensors {
            if *name != "sinks" && t.strides != contiguous(t.shape) {
                return Err(AttnError::NotContiguous { tensor: name, strides: t.strides, want: contiguous(t.shape) });
            }
        }
        if let Some(s) = opts.sinks
            && s.heads() != h
        {
            return Err(AttnError::Sinks { why: SinksRule::Count { got: s.heads(), heads: h } });
        }
        // The sequences: chunks from cu_seqlens_q, keys from seqused_k, pages from the table.
        let cu_rule = |why: SeqLensRule| AttnError::SeqLens { tensor: "cu_seqlens_q", why };
        let cu_values = cu_seqlens_q.host_values("cu_seqlens_q")?;
        let lens = Varlen::lens_from_cu(cu_values, "cu_seqlens_q").map_err(cu_rule)?;
        let last = *cu_values.last().expect("lens_from_cu checked >= 2 entries") as usize;
        if last != total_q {
            return Err(cu_rule(SeqLensRule::LastSum { last, packed: "q has", total: total_q }));
        }
        let longest = lens.iter().copied().max().unwrap_or(0) as usize;
        if longest > max_seqlen_q {
            return Err(cu_rule(SeqLensRule::TooLong { rows: longest, max_name: "max_seqlen_q", max: max_seqlen_q }));
        }
        let nseq = lens.len();
        let seqused = seqused_k.host_values("seqused_k")?;
        let table = block_table.host_values("block_table")?;
        if seqused.len() != nseq {
            return Err(AttnError::SeqLens {
                tensor: "seqused_k",
                why: SeqLensRule::BatchEntries { got: seqused.len(), batch: nseq },
            });
        }
        let entries = table.len();
        if entries == 0 || !entries.is_multiple_of(nseq) {
            return Err(AttnError::KvCache { why: KvCacheRule::BlockTableShape { entries, batch: nseq } });
        }
        let u32_of = |tensor: &'static str, shape: [usize; 4], n: usize, what: &'static str| {
            u32::try_from(n).map_err(|_| AttnError::Shape {
                tensor,
                got: shape,
                why: ShapeRule::OverLimit { what, got: n },
            })
        };
        let page_u32 = u32_of("k_cache", kshape, page_size, "page_size")?;
        let layout = CacheLayout::Paged {
            page_size: page_u32,
            num_pages: u32_of("k_cache", kshape, num_pages, "num_pages")?,
            max_pages: u32_of("block_table", kshape, entries / nseq, "max_pages")?,
        };
        // The capacity and page rules of a decode call with these key counts and no appends.
        let keys = DecodeProblem {
            batch: u32_of("q", q.raw.shape, nseq, "batch")?,
            heads: u32_of("q", q.raw.shape, h, "heads")?,
            heads_kv: u32_of("k_cache", kshape, hk, "heads_kv")?,
            head_dim: u32_of("q", q.raw.shape, d, "head_dim")?,
            seq_q: u32_of("q", q.raw.shape, max_seqlen_q.max(1), "max_seqlen_q")?,
            cache_seqlens: seqused.to_vec(),
            page_size: Some(page_u32),
            dtype,
            ..DecodeProblem::default()
        };
        if page_size == 0 {
            return Err(AttnError::KvCache { why: KvCacheRule::PageSizeZero });
        }
        if keys.cache_seqlens.iter().any(|&l| l > u32::MAX / 2) {
            return Err(AttnError::KvCache { why: KvCacheRule::TooLong });
        }
        check_cache_layout(&keys, layout, table).map_err(|why| AttnError::KvCache { why })?;
        let kernel = KernelId::flash(dtype.elem(), keys.head_dim).ok_or_else(|| AttnError::KvCache {
            why: KvCacheRule::HeadDim {
                head_dim: keys.head_dim,
                dtype,
                compiled: KernelId::flash_head_dims(dtype.elem()),
            },
        })?;
        self.check_module(&[kernel])?;
        for (name, t, _) in &tensors {
            t.check_bounds(name)?;
            if *name != "sinks" && !t.ptr.is_multiple_of(16) {
                return Err(AttnError::Misaligned {
                    tensor: name,
                    what: "the base pointer",
                    got: format!("{:#x}", t.ptr),
                    entry: kernel.name(),
                    need: "16-byte aligned base pointers (cp.async copies 16-byte chunks)",
                });
            }
        }
        let dims = match kernel.variant().tile {
            Tile::FlashMma(t) => t.launch(keys.batch, keys.heads, keys.seq_q),
            _ => unreachable!("KernelId::flash of a 16-bit dtype is a FlashMma row"),
        };
        let o_bytes = (total_q * h * d) as u64 * dtype.size_bytes();
        let lse_bytes = (h * total_q) as u64 * 4;
        let (o, lse) = self.alloc_outputs(q, o_bytes, lse_bytes)?;
        let o = DeviceTensor { storage: o, dtype, shape: [1, total_q, h, d] };
        let lse = DeviceTensor { storage: lse, dtype: Dtype::F32, shape: [1, h, total_q, 1] };
        let (hu, hku, du) = (h as u64, hk as u64, d as u64);
        let qo = Strides::bshd(total_q as u64, hu, du);
        let kv = Strides::bshd(page_size as u64, hku, du);
        let (page_size, max_pages) = match layout {
            CacheLayout::Paged { page_size, max_pages, .. } => (page_size, max_pages),
            CacheLayout::Contiguous { .. } => unreachable!("built paged above"),
        };
        let problem = Problem {
            batch: keys.batch,
            heads: keys.heads,
            seq_q: keys.seq_q,
            seq_kv: keys.max_seqlen_k(),
            head_dim: keys.head_dim,
            dtype,
            causal: opts.causal,
            scale: opts.softmax_scale,
            layout: Layout::Bshd,
            heads_kv: Some(keys.heads_kv),
            window,
            softcap: opts.softcap.unwrap_or(0.0),
            sinks: opts.sinks.is_some(),
            alibi: false,
            varlen: None,
        };
        let params = problem.attn_params(&AttnBuffers {
            q: q.raw.ptr,
            k: k_cache.raw.ptr,
            v: v_cache.raw.ptr,
            o: o.ptr(),
            lse: lse.ptr(),
            sinks: opts.sinks.map_or(0, |s| s.0.raw.ptr),
            cu_seqlens_q: cu_seqlens_q.ptr,
            // Read for the varlen key offset, which a paged cache does not use (any `batch + 1`
            // entries will do).
            cu_seqlens_kv: cu_seqlens_q.ptr,
            q_strides: qo,
            k_strides: kv,
            v_strides: kv,
            o_strides: qo,
            seqused_k: seqused_k.ptr,
            block_table: block_table.ptr,
            page_size,
            max_pages,
            packed_total_q: u32_of("q", q.raw.shape, total_q, "total_q")?,
            ..Default::default()
        });
        self.launch_bytes(kernel, &dims, &params.to_bytes(), q.stream.as_deref())?;
        Ok((o, lse))
    }
}
