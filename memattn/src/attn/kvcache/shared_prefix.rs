//! Shared-prefix (cascade) decode: a batch attends to one prefix cache once and to its own
//! suffix caches, and the two states are merged exactly ([`Kernels::flash_attn_with_shared_prefix_into`];
//! docs/semantics.md, "Shared prefix").
//!
//! Level 1 runs the decode kernel once over the prefix with every request's query rows as the
//! query tokens of one sequence (`q` `[batch, seq_q, heads, d]` is, as memory, `[1, batch ·
//! seq_q, heads, d]`), so each block of packed rows of a KV head reads the prefix once instead of
//! once per request. Level 2 is the usual decode over the suffix caches. Both write split
//! partials; `merge_states` combines them. The decode kernels lay partial rows out as `[split,
//! batch, heads, seq_q]`, so level 1's rows are `[split, heads, batch · seq_q]`: one merge of its
//! splits writes its O in the suffix's row order (a strided f32 view), and one single-state merge
//! copies its LSE into that order (one state of weight `e^0 = 1`: the values unchanged).

use super::*;
use crate::decode::DecodeKernel;

/// The split count of one level: the caller's, or the plan's choice, at least 2 (the states are
/// written as f32 partials to be merged, which one split does not write).
fn level_splits(asked: Option<u32>) -> Option<u32> {
    match asked {
        None | Some(0) => None,
        Some(n) => Some(n.max(2)),
    }
}

impl Kernels {
    /// Decode attention of a batch over one shared prefix and each sequence's own suffix cache
    /// (FlashInfer's cascade attention), into the caller's `o` (`[batch, seq_q, heads,
    /// head_dim]`) and `lse` (`[batch, heads, seq_q]`). The result is that of
    /// [`Kernels::flash_attn_with_kvcache_into`] over the concatenation `prefix ++ suffix[b]` of
    /// each sequence, with the prefix's K/V read once per block of packed query rows of a KV head
    /// (16 rows of `heads / heads_kv · batch · seq_q` on the tensor-core decode) instead of once
    /// per sequence.
    ///
    /// - `q`: contiguous `[batch, seq_q, heads, head_dim]`.
    /// - `prefix_k`, `prefix_v`: contiguous `[1, prefix_len, heads_kv, head_dim]`, `prefix_len
    ///   >= 1`: the keys every sequence holds first. Only read.
    /// - `k_cache`, `v_cache`, `k_new`, `v_new`, `cache_seqlens`, `block_table`: each
    ///   sequence's suffix, as in [`Kernels::flash_attn_with_kvcache_into`] (contiguous or paged;
    ///   new tokens are appended to the suffix cache; `cache_seqlens` counts suffix keys only, and
    ///   may be 0).
    /// - `opts`: scale, soft cap, sinks (counted once, with the prefix), the decode kernel
    ///   (`Auto`, `Simt` or `Mma`) and [`AttnOpts::num_splits`] (each level's splits; at least
    ///   2, since both levels write partial states). `causal`: every query row sees the whole
    ///   prefix and its suffix keys bottom-right aligned as usual, which needs at least `seq_q -
    ///   1` suffix keys per sequence ([`KvCacheRule::SharedPrefixCausal`]; checked on the host
    ///   copy of `cache_seqlens`). Windows, ALiBi, rotary, cache slots and left padding
    ///   (per-request positions) are refused ([`KvCacheRule::SharedPrefixOption`]), and so is the
    ///   prefill kernel.
    ///
    /// Launches: the decode over the prefix, the decode over the suffixes (after the append of
    /// new tokens), and three `merge_states` (the prefix's splits, its LSE reordered, the final
    /// merge). Workspace: f32 partial states of both levels, allocated for the call.
    ///
    /// ```
    /// use memattn::attn::{AttnOpts, Kernels, LseViewMut, TensorView, TensorViewMut};
    /// use memattn::Dtype;
    ///
    /// let kernels = Kernels::vm()?;
    /// let (b, h, hk, d, prefix, cap) = (2, 2, 1, 32, 3, 4);
    /// let val = |i: usize| ((i * 37) % 101) as f32 / 101.0 - 0.5;
    /// let q = kernels.vm_upload(&(0..b * h * d).map(val).collect::<Vec<_>>())?;
    /// let pk = kernels.vm_upload(&(0..prefix * hk * d).map(|i| val(i + 7)).collect::<Vec<_>>())?;
    /// let pv = kernels.vm_upload(&(0..prefix * hk * d).map(|i| val(i + 11)).collect::<Vec<_>>())?;
    /// let sk = kernels.vm_upload(&(0..b * cap * hk * d).map(|i| val(i + 3)).collect::<Vec<_>>())?;
    /// let sv = kernels.vm_upload(&(0..b * cap * hk * d).map(|i| val(i + 5)).collect::<Vec<_>>())?;
    /// let cache_seqlens = kernels.index_tensor(&[4, 1], None)?; // suffix keys per sequence
    /// let (o, lse) = (kernels.vm_alloc((b * h * d * 4) as u64)?, kernels.vm_alloc((b * h * 4) as u64)?);
    /// kernels.flash_attn_with_shared_prefix_into(
    ///     &TensorView::vm(&q, Dtype::F32, [b, 1, h, d])?,
    ///     &TensorView::vm(&pk, Dtype::F32, [1, prefix, hk, d])?,
    ///     &TensorView::vm(&pv, Dtype::F32, [1, prefix, hk, d])?,
    ///     &mut TensorViewMut::vm(&sk, Dtype::F32, [b, cap, hk, d])?,
    ///     &mut TensorViewMut::vm(&sv, Dtype::F32, [b, cap, hk, d])?,
    ///     None,
    ///     None,
    ///     &cache_seqlens,
    ///     None,
    ///     &mut TensorViewMut::vm(&o, Dtype::F32, [b, 1, h, d])?,
    ///     &mut LseViewMut::vm(&lse, b, h, 1)?,
    ///     &AttnOpts::new().causal(true),
    /// )?;
    /// assert!(o.read_f32(Dtype::F32, b * h * d)?.iter().all(|x| x.is_finite()));
    /// # Ok::<(), memattn::attn::AttnError>(())
    /// ```
    #[allow(clippy::too_many_arguments)] // FlashAttention-2's KV-cache arguments plus the prefix
    pub fn flash_attn_with_shared_prefix_into(
        &self,
        q: &TensorView<'_>,
        prefix_k: &TensorView<'_>,
        prefix_v: &TensorView<'_>,
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
        let refuse = |option| Err(AttnError::KvCache { why: KvCacheRule::SharedPrefixOption { option } });
        if opts.window != (None, None) {
            return refuse("a window");
        }
        if opts.alibi_slopes.is_some() {
            return refuse("ALiBi slopes");
        }
        if opts.rotary.is_some() {
            return refuse("a rotary embedding");
        }
        if opts.cache_batch_idx.is_some() {
            return refuse("cache_batch_idx");
        }
        if opts.cache_leftpad.is_some() {
            return refuse("cache_leftpad");
        }
        if opts.decode_kernel == DecodeKernel::Prefill {
            return refuse("the prefill kernel (it writes no partial states)");
        }
        let [b, sq, h, d] = q.raw.shape;
        if q.raw.strides != contiguous(q.raw.shape) {
            return Err(AttnError::NotContiguous {
                tensor: "q",
                strides: q.raw.strides,
                want: contiguous(q.raw.shape),
            });
        }
        let hk = k_cache.raw.shape[2];
        for (name, t) in [("prefix_k", &prefix_k.raw), ("prefix_v", &prefix_v.raw)] {
            let s = t.shape;
            if s[0] != 1 || s[1] == 0 || s[2] != hk || s[3] != d || s[1] != prefix_k.raw.shape[1] {
                return Err(AttnError::KvCache {
                    why: KvCacheRule::SharedPrefixShape { tensor: name, got: s, heads_kv: hk, head_dim: d },
                });
            }
        }
        let prefix_len = prefix_k.raw.shape[1];
        let seq_new = k_new.map_or(0, |t| t.raw.shape[1]);
        if opts.causal && cache_seqlens.host {
            for (batch, &len) in cache_seqlens.values.iter().enumerate() {
                let suffix_keys = len.saturating_add(seq_new as u32);
                if (suffix_keys as usize) + 1 < sq {
                    return Err(AttnError::KvCache {
                        why: KvCacheRule::SharedPrefixCausal { batch, suffix_keys, seq_q: sq as u32 },
                    });
                }
            }
        }
        // The outputs against every other tensor of the call (each level checks its own inputs).
        let mut extents = vec![
            alias::Extent::of_view("q", &q.raw, false),
            alias::Extent::of_view("prefix_k", &prefix_k.raw, false),
            alias::Extent::of_view("prefix_v", &prefix_v.raw, false),
            alias::Extent::of_view("k_cache", &k_cache.raw, seq_new > 0),
            alias::Extent::of_view("v_cache", &v_cache.raw, seq_new > 0),
            alias::Extent::of_view("o", &o.raw, true),
            alias::Extent::of_view("lse", &lse.0.raw, true),
            alias::Extent::of_index("cache_seqlens", cache_seqlens),
        ];
        for (name, t) in [("k_new", k_new), ("v_new", v_new)] {
            if let Some(t) = t {
                extents.push(alias::Extent::of_view(name, &t.raw, false));
            }
        }
        if let Some(bt) = block_table {
            extents.push(alias::Extent::of_index("block_table", bt));
        }
        alias::check_disjoint(&extents)?;

        // Level 1: every query row of the batch against the prefix, not causal (every prefix key
        // precedes every request's tokens).
        let n = b * sq;
        let q1 = TensorView {
            raw: RawView { shape: [1, n, h, d], strides: contiguous([1, n, h, d]), ..q.raw },
            _guard: None,
            stream: q.stream.clone(),
            _borrow: PhantomData,
        };
        let as_mut = |t: &TensorView<'_>| TensorViewMut {
            raw: t.raw,
            _guard: None,
            stream: t.stream.clone(),
            _borrow: PhantomData,
        };
        let (pk, pv) = (as_mut(prefix_k), as_mut(prefix_v));
        let prefix_seqlens = self.index_tensor(&[prefix_len as u32], q.stream.as_ref())?;
        let mut opts1 = opts.clone();
        opts1.causal = false;
        opts1.num_splits = level_splits(opts.num_splits);
        let mut plan1 = self.kvcache_plan(&q1, &pk, &pv, &prefix_seqlens, None, None, None, None, &opts1, None)?;
        if plan1.splits < 2 {
            opts1.num_splits = Some(2);
            plan1 = self.kvcache_plan(&q1, &pk, &pv, &prefix_seqlens, None, None, None, None, &opts1, None)?;
        }
        // Level 2: the suffixes, as a plain KV-cache call without the sinks (counted in level 1).
        let mut opts2 = opts.clone();
        opts2.sinks = None;
        opts2.num_splits = level_splits(opts.num_splits);
        let (kn, vn) = (k_new, v_new);
        let mut plan2 =
            self.kvcache_plan(q, k_cache, v_cache, cache_seqlens, block_table, kn, vn, None, &opts2, None)?;
        if plan2.splits < 2 {
            opts2.num_splits = Some(2);
            plan2 = self.kvcache_plan(q, k_cache, v_cache, cache_seqlens, block_table, kn, vn, None, &opts2, None)?;
        }
        for plan in [&mut plan1, &mut plan2] {
            plan.launches.retain(|(k, _)| k.variant().family != Family::MergeStates);
        }
        let (s1, s2) = (plan1.splits as usize, plan2.splits as usize);
        let rows = b * h * sq;
        let raw = |s: &Storage, shape: [usize; 4]| {
            RawView::new(s.ptr(), (shape.iter().product::<usize>() * 4) as u64, Dtype::F32, shape, q.raw.place)
        };
        let f32_view = |s: &Storage, shape: [usize; 4]| TensorViewMut {
            raw: raw(s, shape),
            _guard: None,
            stream: q.stream.clone(),
            _borrow: PhantomData,
        };
        let f32_in = |s: &Storage, shape: [usize; 4]| TensorView {
            raw: raw(s, shape),
            _guard: None,
            stream: q.stream.clone(),
            _borrow: PhantomData,
        };
        // The states of both levels, merged last: slot 0 the prefix's, slots 1..=s2 the
        // suffix's splits, rows in `[batch, heads, seq_q]` order.
        let slots = 1 + s2;
        let (all_o, all_lse) = self.alloc_outputs(q, (slots * rows * d * 4) as u64, (slots * rows * 4) as u64)?;
        // Level 1's splits, rows in `[heads, batch, seq_q]` order, and its merged LSE.
        let (pre_o, pre_lse) = self.alloc_outputs(q, (s1 * rows * d * 4) as u64, (s1 * rows * 4) as u64)?;
        let (lse1, lse_scratch) = self.alloc_outputs(q, (rows * 4) as u64, (rows * 4) as u64)?;

        self.kvcache_run(
            &q1,
            &pk,
            &pv,
            &prefix_seqlens,
            None,
            None,
            None,
            (0, 0),
            &plan1,
            Some((pre_o.ptr(), pre_lse.ptr())),
        )?;
        let slot_bytes = (rows * d * 4) as u64;
        let suffix_parts = (all_o.ptr() + slot_bytes, all_lse.ptr() + (rows * 4) as u64);
        self.kvcache_run(q, k_cache, v_cache, cache_seqlens, block_table, kn, vn, (0, 0), &plan2, Some(suffix_parts))?;

        // Level 1's rows read as `[batch' = heads, seq' = seq_q, heads' = batch]`: merge its
        // splits into slot 0 in `[batch, heads, seq_q]` order.
        let pre_shape = [h, sq, b, d];
        let pre = PartialsView::new(
            f32_in(&pre_o, [1, s1 * rows, 1, d]),
            f32_in(&pre_lse, [1, s1 * rows, 1, 1]),
            s1,
            pre_shape,
        );
        let mut slot0 = f32_view(&all_o, pre_shape).with_strides([sq * d, d, h * sq * d, 1]);
        self.merge_states_into(&pre, &mut slot0, &mut LseViewMut(f32_view(&lse1, [h, b, sq, 1])))?;
        // Its LSE into slot 0's order: one state, its own LSE as weight (`e^0 = 1`, exact).
        let copy = PartialsView::new(f32_in(&lse1, [1, rows, 1, 1]), f32_in(&lse1, [1, rows, 1, 1]), 1, [h, sq, b, 1]);
        let mut lse_slot0 = f32_view(&all_lse, [h, sq, b, 1]).with_strides([sq, 1, h * sq, 1]);
        self.merge_states_into(&copy, &mut lse_slot0, &mut LseViewMut(f32_view(&lse_scratch, [h, b, sq, 1])))?;
        // The prefix's state and the suffix's splits, into the caller's outputs.
        let all = PartialsView::new(
            f32_in(&all_o, [1, slots * rows, 1, d]),
            f32_in(&all_lse, [1, slots * rows, 1, 1]),
            slots,
            [b, sq, h, d],
        );
        self.merge_states_into(&all, o, lse)?;
        drop((all_o, all_lse, pre_o, pre_lse, lse1, lse_scratch, prefix_seqlens)); // in stream order on CUDA
        Ok(())
    }
}
