//! The memory budget of an inference workload, before anything runs (`memattn plan`).
//!
//! | term | bytes |
//! |---|---|
//! | weights | `params · size(dtype)`; params of a Llama-style block (below) |
//! | KV cache | `Σ_layers 2 · heads_kv · head_dim · min(context, window_l) · batch · size(kv_dtype)` |
//! | attention workspace | one layer at a time: S and LSE from [`crate::memory::AnalyticBytes`] |
//! | largest activation | the largest single tensor of one forward step (see [`Activation`]) |
//!
//! The attention workspace is the same memory model the kernels' runs are checked against (one
//! source of truth): a [`Problem`] with `seq_q = new_tokens` (the tokens of one forward step: 1 for
//! a decode step) and `seq_kv` = the longest key range of any layer. The KV cache is modelled here
//! with `heads_kv` (grouped-query attention), capped at each layer's sliding window.
//!
//! Weights of a Llama-style decoder: embedding `vocab · hidden` (twice unless tied), per layer
//! `q, o: hidden · heads · head_dim`, `k, v: hidden · heads_kv · head_dim` (+ biases where the
//! model has them), a gated MLP of three `hidden · intermediate` matrices and `norms · hidden`
//! norm weights, and a final norm.

use crate::dtype::Dtype;
use crate::memory::AnalyticBytes;
use crate::problem::{KernelKind, Problem};
use crate::units::human_bytes;
use serde::Serialize;
use std::fmt;

/// Element type of weights, activations or the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreType {
    F32,
    Bf16,
    F16,
    /// One-byte floats (e4m3 / e5m2): a common KV-cache and weight quantisation.
    Fp8,
}

impl StoreType {
    pub const fn bytes(self) -> u64 {
        match self {
            StoreType::F32 => 4,
            StoreType::Bf16 | StoreType::F16 => 2,
            StoreType::Fp8 => 1,
        }
    }
    pub const fn name(self) -> &'static str {
        match self {
            StoreType::F32 => "f32",
            StoreType::Bf16 => "bf16",
            StoreType::F16 => "f16",
            StoreType::Fp8 => "fp8",
        }
    }
    /// `--dtype`, `--kv-dtype` and `torch_dtype` spellings.
    pub fn parse(s: &str) -> Option<StoreType> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" | "float" => Some(StoreType::F32),
            "bf16" | "bfloat16" => Some(StoreType::Bf16),
            "f16" | "fp16" | "float16" | "half" => Some(StoreType::F16),
            "fp8" | "f8" | "float8" | "fp8_e4m3" | "fp8_e5m2" | "float8_e4m3fn" | "float8_e5m2" | "e4m3" | "e5m2" => {
                Some(StoreType::Fp8)
            }
            _ => None,
        }
    }
    /// The kernel dtype of the attention this type stands for (fp8 attention runs in bf16).
    pub const fn kernel_dtype(self) -> Dtype {
        match self {
            StoreType::F32 => Dtype::F32,
            StoreType::Bf16 | StoreType::Fp8 => Dtype::Bf16,
            StoreType::F16 => Dtype::F16,
        }
    }
    /// The next smaller type a KV cache is commonly stored in.
    pub const fn smaller(self) -> Option<StoreType> {
        match self {
            StoreType::F32 => Some(StoreType::Bf16),
            StoreType::Bf16 | StoreType::F16 => Some(StoreType::Fp8),
            StoreType::Fp8 => None,
        }
    }
}

impl fmt::Display for StoreType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Most decoder layers a plan takes: published models have at most a few hundred, and the plan
/// keeps one window per layer and sums over layers in every search step.
pub const MAX_LAYERS: u32 = 1 << 16;

/// Refuses a layer count over [`MAX_LAYERS`] (before anything per layer is allocated).
pub fn check_layers(layers: u32) -> Result<(), String> {
    if layers > MAX_LAYERS {
        return Err(format!("layers {layers} is over the limit of {MAX_LAYERS}"));
    }
    Ok(())
}

/// A decoder-only transformer as far as memory is concerned.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Model {
    /// `model_type` of the config, or "flags".
    pub model_type: String,
    pub layers: u32,
    pub heads: u32,
    pub heads_kv: u32,
    pub head_dim: u32,
    /// 0 when not given (flags without --hidden): weights and activations are then not counted.
    pub hidden: u32,
    pub intermediate: u32,
    pub vocab: u32,
    pub tied_embeddings: bool,
    /// q, k and v projections have biases (Qwen2).
    pub qkv_bias: bool,
    /// Norm weight vectors per layer (2 in Llama, 4 in Gemma 2).
    pub norms_per_layer: u32,
    /// Sliding window of each layer (`None`: full attention).
    pub windows: Vec<Option<u32>>,
    pub max_position_embeddings: Option<u64>,
    /// The config's `torch_dtype`.
    pub torch_dtype: Option<StoreType>,
    /// How fields the config left out were filled in.
    pub notes: Vec<String>,
}

/// The attention kinds a `layer_types` entry may name: the two this plan models.
const LAYER_TYPES: [&str; 2] = ["full_attention", "sliding_attention"];

/// The config's `layer_types`, checked: absent (or null), or an array of exactly `layers` known
/// layer-type strings; anything else is an error naming the field, the entry and the rule.
fn layer_types<'a>(c: &'a serde_json::Value, layers: u32, origin: &str) -> Result<Option<Vec<&'a str>>, String> {
    let types = match c.get("layer_types") {
        None | Some(serde_json::Value::Null) => return Ok(None),
        Some(serde_json::Value::Array(t)) => t,
        Some(v) => {
            return Err(format!(
            "config {origin}: field `layer_types` must be an array of {layers} strings (one per layer: {}), got {v}",
            LAYER_TYPES.join(" or ")
        ))
        }
    };
    if types.len() != layers as usize {
        return Err(format!(
            "config {origin}: field `layer_types` has {} entries for {layers} layers (num_hidden_layers)",
            types.len()
        ));
    }
    types
        .iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            Some(s) if LAYER_TYPES.contains(&s) => Ok(s),
            _ => Err(format!(
                "config {origin}: field `layer_types` entry {i} is {t}; known layer types: {}",
                LAYER_TYPES.join(", ")
            )),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

impl Model {
    /// Whether weights and activations can be counted (hidden, intermediate, vocab known).
    pub fn has_weights(&self) -> bool {
        self.hidden > 0 && self.intermediate > 0 && self.vocab > 0
    }

    /// The parameter count (saturating at `u64::MAX`; [`Model::validate`] refuses a model whose
    /// count does not fit, so a validated model's count is exact).
    pub fn params(&self) -> u64 {
        u64::try_from(self.params_exact()).unwrap_or(u64::MAX)
    }

    /// The parameter count in 128 bits: every factor is a u32, so no term can wrap.
    pub fn params_exact(&self) -> u128 {
        if !self.has_weights() {
            return 0;
        }
        let (h, hd) = (self.hidden as u128, self.head_dim as u128);
        let (nq, nkv) = (self.heads as u128 * hd, self.heads_kv as u128 * hd);
        let embed = self.vocab as u128 * h * if self.tied_embeddings { 1 } else { 2 };
        let attn = h * nq + 2 * h * nkv + nq * h + if self.qkv_bias { nq + 2 * nkv } else { 0 };
        let mlp = 3 * h * self.intermediate as u128;
        let norms = self.norms_per_layer as u128 * h;
        embed + self.layers as u128 * (attn + mlp + norms) + h
    }

    /// Layers with a sliding window.
    pub fn windowed_layers(&self) -> usize {
        self.windows.iter().filter(|w| w.is_some()).count()
    }

    /// Keys one layer attends to at this context.
    pub fn keys(&self, layer: usize, context: u32) -> u32 {
        match self.windows.get(layer).copied().flatten() {
            Some(w) => context.min(w),
            None => context,
        }
    }

    /// Checks every field; the error names it.
    pub fn validate(&self) -> Result<(), String> {
        check_layers(self.layers)?;
        for (name, v) in
            [("layers", self.layers), ("heads", self.heads), ("heads_kv", self.heads_kv), ("head_dim", self.head_dim)]
        {
            if v == 0 {
                return Err(format!("{name} must be at least 1 (got 0)"));
            }
        }
        if !self.heads.is_multiple_of(self.heads_kv) {
            return Err(format!(
                "heads_kv {} does not divide heads {}: each KV head serves a whole group of query heads",
                self.heads_kv, self.heads
            ));
        }
        if self.windows.len() != self.layers as usize {
            return Err(format!("{} layer windows for {} layers", self.windows.len(), self.layers));
        }
        if self.windows.contains(&Some(0)) {
            return Err("sliding_window must be at least 1 (got 0)".into());
        }
        if self.params_exact() > u64::MAX as u128 {
            return Err(format!(
                "the parameter count {} (computed in 128 bits) is over 2^64 - 1: check hidden, intermediate, vocab, heads and head_dim",
                self.params_exact()
            ));
        }
        Ok(())
    }

    /// Reads a Hugging Face `config.json`. Missing required fields are errors naming the field;
    /// `origin` names the file in messages.
    pub fn from_config(text: &str, origin: &str) -> Result<Model, String> {
        let root: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| format!("config {origin} is not JSON: line {} column {}: {e}", e.line(), e.column()))?;
        if !root.is_object() {
            return Err(format!("config {origin} is not a JSON object"));
        }
        // Multimodal configs keep the language model in `text_config`.
        let c = match (root.get("num_hidden_layers"), root.get("text_config")) {
            (None, Some(t)) if t.is_object() => t,
            _ => &root,
        };
        let mut notes = Vec::new();
        let model_type = c.get("model_type").or(root.get("model_type")).and_then(|v| v.as_str()).unwrap_or("unknown");
        let field = |name: &str| -> Result<Option<u64>, String> {
            match c.get(name) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(n) if n <= u32::MAX as u64 => Ok(Some(n)),
                    _ => Err(format!("config {origin}: field `{name}` must be a non-negative integer (got {v})")),
                },
            }
        };
        let required = |name: &str, what: &str| -> Result<u32, String> {
            field(name)?.map(|n| n as u32).ok_or_else(|| format!("config {origin}: missing field `{name}` ({what})"))
        };
        let layers = required("num_hidden_layers", "the number of decoder layers")?;
        check_layers(layers).map_err(|e| format!("config {origin}: num_hidden_layers: {e}"))?;
        let heads = required("num_attention_heads", "query heads per layer")?;
        if heads == 0 {
            return Err(format!("config {origin}: num_attention_heads must be at least 1 (got 0)"));
        }
        let hidden = required("hidden_size", "the model width")?;
        let intermediate = required("intermediate_size", "the MLP width")?;
        let vocab = required("vocab_size", "the vocabulary size")?;
        let heads_kv = match field("num_key_value_heads")? {
            Some(n) => n as u32,
            None => {
                notes.push(
                    "no num_key_value_heads: multi-head attention (heads_kv = heads), as transformers assumes".into(),
                );
                heads
            }
        };
        let head_dim = match field("head_dim")? {
            Some(d) => d as u32,
            None => {
                if heads == 0 || !hidden.is_multiple_of(heads) {
                    return Err(format!(
                        "config {origin}: no `head_dim` and hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
                    ));
                }
                hidden / heads
            }
        };
        let tied_embeddings = match c.get("tie_word_embeddings").or(root.get("tie_word_embeddings")) {
            Some(serde_json::Value::Bool(b)) => *b,
            Some(v) => {
                return Err(format!("config {origin}: field `tie_word_embeddings` must be true or false (got {v})"))
            }
            None => match model_type {
                "llama" | "mistral" | "mixtral" | "qwen2" | "qwen3" | "phi3" => false,
                "gemma" | "gemma2" | "gemma3_text" => true,
                _ => {
                    notes.push(format!(
                        "no tie_word_embeddings for model_type `{model_type}`: tied, the transformers default"
                    ));
                    true
                }
            },
        };
        let qkv_bias = match c.get("attention_bias") {
            Some(serde_json::Value::Bool(b)) => *b,
            _ => model_type == "qwen2",
        };
        let norms_per_layer = if model_type.starts_with("gemma2") || model_type.starts_with("gemma3") { 4 } else { 2 };
        if !matches!(model_type, "llama" | "mistral" | "qwen2" | "gemma" | "gemma2") {
            notes.push(format!(
                "model_type `{model_type}`: weights counted as a Llama-style block (q, k, v, o; gated MLP of three matrices)"
            ));
        }
        let window = field("sliding_window")?.map(|w| w as u32);
        let use_window = !matches!(c.get("use_sliding_window"), Some(serde_json::Value::Bool(false)));
        let mut windows = vec![None; layers as usize];
        let layer_types = layer_types(c, layers, origin)?;
        if let (Some(w), true) = (window, use_window) {
            if let Some(types) = &layer_types {
                for (i, t) in types.iter().enumerate() {
                    if *t == "sliding_attention" {
                        windows[i] = Some(w);
                    }
                }
            } else if model_type == "gemma2" {
                // Gemma 2 alternates local (sliding) and global layers, starting with a local one.
                for (i, slot) in windows.iter_mut().enumerate() {
                    if i % 2 == 0 {
                        *slot = Some(w);
                    }
                }
            } else if model_type == "qwen2" {
                let from = field("max_window_layers")?.unwrap_or(layers as u64) as usize;
                for slot in windows.iter_mut().skip(from) {
                    *slot = Some(w);
                }
            } else {
                windows.iter_mut().for_each(|s| *s = Some(w));
            }
        }
        let torch_dtype = match c.get("torch_dtype").or(root.get("torch_dtype")).or(c.get("dtype")) {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => {
                let s = v.as_str().unwrap_or("");
                Some(StoreType::parse(s).ok_or_else(|| {
                    format!("config {origin}: field `torch_dtype` is {v}; known: float32, bfloat16, float16, float8")
                })?)
            }
        };
        let m = Model {
            model_type: model_type.to_string(),
            layers,
            heads,
            heads_kv,
            head_dim,
            hidden,
            intermediate,
            vocab,
            tied_embeddings,
            qkv_bias,
            norms_per_layer,
            windows,
            max_position_embeddings: field("max_position_embeddings")?,
            torch_dtype,
            notes,
        };
        m.validate().map_err(|e| format!("config {origin}: {e}"))?;
        Ok(m)
    }
}

/// What runs on the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Workload {
    pub batch: u32,
    /// Tokens each sequence holds in the KV cache at the step planned (prompt + generated).
    pub context: u32,
    /// Query tokens of one forward step: 1 for a decode step, the prompt length for a prefill.
    pub new_tokens: u32,
    /// Weights and activations.
    pub dtype: StoreType,
    pub kv_dtype: StoreType,
    pub kernel: KernelKind,
    /// A paged KV cache: each sequence holds whole pages of `page` tokens (None: one contiguous
    /// block of `context` tokens per sequence).
    pub page: Option<u32>,
}

impl Workload {
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [("batch", self.batch), ("context", self.context), ("new_tokens", self.new_tokens)] {
            if v == 0 {
                return Err(format!("--{} must be at least 1 (got 0)", name.replace('_', "-")));
            }
        }
        if self.new_tokens > self.context {
            return Err(format!(
                "--new-tokens {} exceeds --context {}: the context counts every token in the cache, the new ones included",
                self.new_tokens, self.context
            ));
        }
        Ok(())
    }
}

/// The largest single activation of one forward step (one layer at a time).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Activation {
    pub name: String,
    pub bytes: u64,
}

/// The attention workspace of one layer from the kernels' memory model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Workspace {
    /// `seq_kv` of the attention problem: the longest key range of any layer.
    pub keys: u32,
    /// The naive score matrix (0 for flash).
    pub scores: u64,
    pub lse: u64,
    /// The flash kernels do not split KV: no partial outputs.
    pub split_kv_partials: u64,
    pub total: u64,
}

/// Every term of one plan, in bytes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Terms {
    pub params: u64,
    pub weights: u64,
    pub kv_per_token: u64,
    pub kv_per_sequence: u64,
    pub kv_cache: u64,
    pub workspace: Workspace,
    pub activation: Activation,
    pub total: u64,
}

/// The attention problem of one layer of the workload: `heads` query heads on `heads_kv` K/V heads.
pub fn attention_problem(m: &Model, w: &Workload, keys: u32) -> Problem {
    Problem {
        batch: w.batch,
        heads: m.heads,
        heads_kv: (m.heads_kv != m.heads).then_some(m.heads_kv),
        seq_q: w.new_tokens,
        seq_kv: keys,
        head_dim: m.head_dim,
        dtype: w.dtype.kernel_dtype(),
        ..Problem::default()
    }
}

/// Beyond this a term cannot be held by any device; searches treat it as "does not fit".
const HUGE: u128 = 1 << 62;

/// The bytes of every term. Sizes past 2^62 bytes saturate to `u64::MAX`.
pub fn terms(m: &Model, w: &Workload) -> Terms {
    let sat = |x: u128| if x >= HUGE { u64::MAX } else { x as u64 };
    let (b, t) = (w.batch as u128, w.new_tokens as u128);
    let kv_token_layer = 2 * m.heads_kv as u128 * m.head_dim as u128 * w.kv_dtype.bytes() as u128;
    let held = |keys: u32| -> u128 {
        match w.page {
            Some(p) => (keys as u128).div_ceil(p as u128) * p as u128,
            None => keys as u128,
        }
    };
    let kv_seq: u128 = (0..m.layers as usize).map(|l| kv_token_layer * held(m.keys(l, w.context))).sum();
    let keys = (0..m.layers as usize).map(|l| m.keys(l, w.context)).max().unwrap_or(w.context);
    let p = attention_problem(m, w, keys);
    let score_elems = b * m.heads as u128 * t * keys as u128;
    let workspace = if score_elems * 4 >= HUGE {
        Workspace { keys, scores: u64::MAX, lse: u64::MAX, split_kv_partials: 0, total: u64::MAX }
    } else {
        let a = AnalyticBytes::new(&p, w.kernel);
        Workspace { keys, scores: a.scores, lse: a.lse, split_kv_partials: 0, total: a.workspace }
    };
    let es = w.dtype.bytes() as u128;
    let candidates = [
        ("logits f32 [batch, new_tokens, vocab]", b * t * m.vocab as u128 * 4),
        ("MLP gate+up [batch, new_tokens, 2 x intermediate]", b * t * 2 * m.intermediate as u128 * es),
        ("attention Q+O [batch, new_tokens, heads, head_dim]", b * t * 2 * m.heads as u128 * m.head_dim as u128 * es),
        ("hidden state + residual [batch, new_tokens, hidden]", b * t * 2 * m.hidden as u128 * es),
    ];
    let (name, bytes) = candidates.iter().max_by_key(|c| c.1).map(|c| (c.0, c.1)).unwrap_or(("none", 0));
    let params = m.params();
    let weights = params as u128 * w.dtype.bytes() as u128;
    let kv_cache = kv_seq * b;
    let total = weights + kv_cache + workspace.total as u128 + bytes;
    Terms {
        params,
        weights: sat(weights),
        kv_per_token: sat(kv_token_layer * m.layers as u128),
        kv_per_sequence: sat(kv_seq),
        kv_cache: sat(kv_cache),
        workspace,
        activation: Activation { name: name.to_string(), bytes: sat(bytes) },
        total: sat(total),
    }
}

/// Per-device bytes of the workload under context parallelism over `n` devices: the sequence
/// is split (ring/zigzag), the model is not.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CpTerms {
    pub devices: u32,
    /// Every device holds all the weights.
    pub weights: u64,
    /// Each device's slice of every sequence's cache: `ceil(keys / n)` tokens per layer.
    pub kv_cache: u64,
    /// The ring's two K/V blocks of one layer in flight (the one computed on and the next
    /// arriving): `2 x ceil(keys / n)` tokens of one layer.
    pub ring_buffers: u64,
    /// The f32 running state of the device's query rows (o and lse), `ceil(new_tokens / n)` rows.
    pub merge_state: u64,
    /// The largest activation, over `ceil(new_tokens / n)` rows (a decode step's one row is not split).
    pub activation: u64,
    pub total: u64,
}

/// [`CpTerms`] of `w` over `n` devices (flash kernels).
pub fn cp_terms(m: &Model, w: &Workload, n: u32) -> CpTerms {
    let sat = |x: u128| if x >= HUGE { u64::MAX } else { x as u64 };
    let n = n.max(1);
    let b = w.batch as u128;
    let kv_token_layer = 2 * m.heads_kv as u128 * m.head_dim as u128 * w.kv_dtype.bytes() as u128;
    let held = |keys: u32| -> u128 {
        let k = (keys as u128).div_ceil(n as u128);
        match w.page {
            Some(p) => k.div_ceil(p as u128) * p as u128,
            None => k,
        }
    };
    let kv: u128 = (0..m.layers as usize).map(|l| kv_token_layer * held(m.keys(l, w.context))).sum::<u128>() * b;
    let max_keys = (0..m.layers as usize).map(|l| m.keys(l, w.context)).max().unwrap_or(w.context);
    let ring = if n > 1 { 2 * kv_token_layer * (max_keys as u128).div_ceil(n as u128) * b } else { 0 };
    let rows = (w.new_tokens as u128).div_ceil(n as u128);
    let merge = b * m.heads as u128 * rows * (m.head_dim as u128 + 1) * 4;
    let one = terms(m, &Workload { kernel: KernelKind::Flash, ..*w });
    let act = one.activation.bytes as u128 * rows / w.new_tokens.max(1) as u128;
    let weights = one.weights as u128;
    CpTerms {
        devices: n,
        weights: sat(weights),
        kv_cache: sat(kv),
        ring_buffers: sat(ring),
        merge_state: sat(merge),
        activation: sat(act),
        total: sat(weights + kv + ring + merge + act),
    }
}

/// The fewest devices (up to `max`) over which the workload fits `limit` bytes per device, or
/// `None` (the weights alone, which every device holds, may not fit).
pub fn smallest_cp(m: &Model, w: &Workload, limit: u64, max: u32) -> Option<u32> {
    (1..=max).find(|&n| cp_terms(m, w, n).total <= limit)
}

/// The largest `x` in `lo..=hi` with `fits(x)`, for `fits` monotone (true then false).
fn largest(lo: u32, hi: u32, fits: impl Fn(u32) -> bool) -> Option<u32> {
    if !fits(lo) {
        return None;
    }
    let (mut a, mut b) = (lo, hi);
    if fits(b) {
        return Some(b);
    }
    while b - a > 1 {
        let mid = a + (b - a) / 2;
        if fits(mid) {
            a = mid;
        } else {
            b = mid;
        }
    }
    Some(a)
}

/// The largest batch that fits in `limit` bytes at this context (None: not even batch 1).
pub fn largest_batch(m: &Model, w: &Workload, limit: u64) -> Option<u32> {
    largest(1, u32::MAX, |b| terms(m, &Workload { batch: b, ..*w }).total <= limit)
}

/// The longest context that fits at this batch (None: not even `new_tokens`).
pub fn longest_context(m: &Model, w: &Workload, limit: u64) -> Option<u32> {
    largest(w.new_tokens, u32::MAX, |c| terms(m, &Workload { context: c, ..*w }).total <= limit)
}

/// One option changed, and the total after it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Change {
    /// `kernel`, `kv-dtype`, `paging`, `batch` or `context`.
    pub option: &'static str,
    /// The flag that makes the change, e.g. `--kv-dtype fp8`.
    pub flag: String,
    pub total_after: u64,
    /// `total - total_after` (negative: the change costs memory).
    pub saved: i128,
    pub fits_after: bool,
    pub note: String,
}

/// Page size of the paged-KV-cache candidate (vLLM's default block size).
pub const PAGE_TOKENS: u32 = 16;

/// Each one-option change of the workload, in the order ties are broken.
pub fn changes(m: &Model, w: &Workload, limit: u64) -> Vec<Change> {
    let total = terms(m, w).total;
    let mut out = Vec::new();
    let mut push = |option: &'static str, flag: String, after: Workload, note: String| {
        let t = terms(m, &after).total;
        out.push(Change {
            option,
            flag,
            total_after: t,
            saved: total as i128 - t as i128,
            fits_after: t <= limit,
            note,
        });
    };
    let other = match w.kernel {
        KernelKind::Naive => KernelKind::Flash,
        KernelKind::Flash => KernelKind::Naive,
    };
    push(
        "kernel",
        format!("--kernel {other}"),
        Workload { kernel: other, ..*w },
        "the attention workspace: S (naive) or LSE only (flash)".into(),
    );
    if let Some(s) = w.kv_dtype.smaller() {
        push(
            "kv-dtype",
            format!("--kv-dtype {s}"),
            Workload { kv_dtype: s, ..*w },
            "halves the bytes per cached element".into(),
        );
    }
    if w.page.is_none() {
        push(
            "paging",
            format!("--page {PAGE_TOKENS}"),
            Workload { page: Some(PAGE_TOKENS), ..*w },
            format!(
                "a paged cache holds the pages sequences fill, not --context reserved for each; with every sequence at --context {} it saves nothing (pages round up)",
                w.context
            ),
        );
    }
    if w.batch > 1 {
        push(
            "batch",
            format!("--batch {}", w.batch / 2),
            Workload { batch: w.batch / 2, ..*w },
            "half the sequences".into(),
        );
    }
    if w.context / 2 >= w.new_tokens {
        push(
            "context",
            format!("--context {}", w.context / 2),
            Workload { context: w.context / 2, ..*w },
            "half the tokens per sequence".into(),
        );
    }
    out
}

/// The change with the lowest total. Totals within 1 % of the lowest count as a tie, won by the
/// earlier in [`changes`]' order: options that keep the workload (kernel, KV dtype, paging) come
/// before those that shrink it (batch, context).
pub fn best_change(changes: &[Change]) -> Option<&Change> {
    let lowest = changes.iter().map(|c| c.total_after).min()?;
    let near = lowest as u128 + lowest as u128 / 100;
    changes.iter().find(|c| c.total_after as u128 <= near)
}

/// Per-layer attention buffers of the workload as a kernel run allocates them: Q and O of the
/// new tokens, K and V of the layer's cache slice (`heads_kv` heads), S/LSE workspace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct LayerAttention {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub workspace: u64,
    pub total: u64,
}

/// The attention part of one layer (the layer with the longest key range), with K and V held in
/// the kernel's dtype.
pub fn layer_attention(m: &Model, w: &Workload) -> LayerAttention {
    let keys = (0..m.layers as usize).map(|l| m.keys(l, w.context)).max().unwrap_or(w.context);
    let es = w.dtype.kernel_dtype().size_bytes();
    let q = w.batch as u64 * w.new_tokens as u64 * m.heads as u64 * m.head_dim as u64 * es;
    let kv = w.batch as u64 * keys as u64 * m.heads_kv as u64 * m.head_dim as u64 * es;
    let workspace = AnalyticBytes::new(&attention_problem(m, w, keys), w.kernel).workspace;
    LayerAttention { q, k: kv, v: kv, o: q, workspace, total: 2 * q + 2 * kv + workspace }
}

/// `80GiB`, `24 GB`, `512MiB`, `1073741824`: binary (KiB, MiB, GiB, TiB) or decimal (KB, MB,
/// GB, TB) units, case-insensitive, optional space; a bare number is bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(format!("`{s}`: a size must be >= 0 (and at least 1 byte)"));
    }
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = (&t[..split], t[split..].trim());
    let value: f64 = num.parse().map_err(|_| {
        format!("`{s}` is not a size: give a number and a unit, e.g. 80GiB, 24GB, 512MiB (units: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    })?;
    let mult: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => {
            return Err(format!(
                "`{s}`: unknown unit `{unit}` (units: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB; K/M/G alone are ambiguous)"
            ))
        }
    };
    let bytes = value * mult;
    if !(bytes.is_finite() && (1.0..1.8e19).contains(&bytes)) {
        return Err(format!("`{s}` is not a usable size (at least 1 byte)"));
    }
    Ok(bytes.round() as u64)
}

/// `34359738368` -> `32.00 GiB`; `u64::MAX` -> `> 4 EiB`.
pub fn bytes_label(b: u64) -> String {
    if b == u64::MAX {
        "> 4 EiB".into()
    } else {
        human_bytes(b)
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    fn llama() -> Model {
        Model {
            model_type: "flags".into(),
            layers: 32,
            heads: 32,
            heads_kv: 8,
            head_dim: 128,
            hidden: 4096,
            intermediate: 14336,
            vocab: 128256,
            tied_embeddings: false,
            qkv_bias: false,
            norms_per_layer: 2,
            windows: vec![None; 32],
            max_position_embeddings: None,
            torch_dtype: None,
            notes: vec![],
        }
    }

    fn decode(batch: u32, context: u32) -> Workload {
        Workload {
            batch,
            context,
            new_tokens: 1,
            dtype: StoreType::Bf16,
            kv_dtype: StoreType::Bf16,
            kernel: KernelKind::Flash,
            page: None,
        }
    }

    pub fn kv_cache_counts_kv_heads_not_query_heads() {
        let t = terms(&llama(), &decode(8, 32768));
        // 2 (K and V) x 32 layers x 8 KV heads x 128 x 32768 tokens x 8 sequences x 2 bytes.
        assert_eq!(t.kv_cache, 2 * 32 * 8 * 128 * 32768 * 8 * 2);
        assert_eq!(t.kv_cache, 32 << 30);
        assert_eq!(t.kv_per_token, 2 * 32 * 8 * 128 * 2);
        // Flash keeps LSE only: 4 bytes per (batch, head, query row).
        assert_eq!(t.workspace.total, 4 * 8 * 32);
        let naive = terms(&llama(), &Workload { kernel: KernelKind::Naive, ..decode(8, 32768) });
        assert_eq!(naive.workspace.scores, 4 * 8 * 32 * 32768);
        // Published parameter count of Meta-Llama-3-8B.
        assert_eq!(t.params, 8_030_261_248);
    }

    pub fn windows_cap_the_cache_and_the_key_range() {
        let mut m = llama();
        for (i, w) in m.windows.iter_mut().enumerate() {
            if i % 2 == 0 {
                *w = Some(4096);
            }
        }
        let t = terms(&m, &decode(2, 10000));
        assert_eq!(t.kv_per_sequence, 2 * 8 * 128 * 2 * (16 * 4096 + 16 * 10000));
        assert_eq!(t.workspace.keys, 10000);
        let short = terms(&m, &decode(2, 1000));
        assert_eq!(short.kv_per_sequence, 2 * 8 * 128 * 2 * 32 * 1000);
    }

    pub fn searches_find_the_edge() {
        let m = llama();
        let w = decode(8, 32768);
        let limit = 80u64 << 30;
        let b = largest_batch(&m, &w, limit).unwrap();
        assert!(terms(&m, &Workload { batch: b, ..w }).total <= limit);
        assert!(terms(&m, &Workload { batch: b + 1, ..w }).total > limit);
        let c = longest_context(&m, &w, limit).unwrap();
        assert!(terms(&m, &Workload { context: c, ..w }).total <= limit);
        assert!(terms(&m, &Workload { context: c + 1, ..w }).total > limit);
        assert_eq!(largest_batch(&m, &w, 1 << 30), None);
    }

    pub fn sizes_parse_with_units() {
        assert_eq!(parse_size("80GiB"), Ok(80 << 30));
        assert_eq!(parse_size("24 GB"), Ok(24_000_000_000));
        assert_eq!(parse_size("1.5KiB"), Ok(1536));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("80G").unwrap_err().contains("unit"));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("0GiB").is_err());
    }
}
