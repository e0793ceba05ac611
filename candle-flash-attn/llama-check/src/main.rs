//! candle-transformers 0.11.1's llama, built with its `flash-attn` feature against this
//! repository's candle-flash-attn (patched in), on candle's CPU device: the same tiny model with
//! `Config::use_flash_attn` on (candle_flash_attn::flash_attn, memattn's kernels in the PTX VM)
//! and off (candle's own matmul/softmax attention) decodes greedily with a KV cache, one prompt of
//! 8 tokens then 12 steps, each step's token the argmax of the candle-attention run fed to both.
//! Checked at every one of the 13 logits rows:
//! - f32: `max |flash - candle| / max |candle|` at most 1e-5;
//! - bf16 (weights and activations; llama converts logits to f32): the same argmax. bf16 logits
//!   tie often (a unit roundoff near 3 is 0.016): where candle's row has several maxima, the
//!   flash row's argmax must be one of them (it is a greedy choice of candle's logits), and the
//!   tie is reported.
//!
//! With `LLAMA_CHECK_CUDA=1` both models run on candle's CUDA device 0 instead (a GPU machine
//! with nvcc and the CUDA libraries: candle's own kernels and cuBLAS do the rest of the model).
//!
//! The weights are deterministic functions of their names (no download, no random state), so
//! every run sees the same model. Exits non-zero when a check fails.

use candle_core::{DType, Device, Result, Shape, Tensor};
use candle_nn::{Init, VarBuilder};
use candle_transformers::models::llama::{Cache, Config, Llama};

/// Weights from a hash of the tensor's name: uniform with candle-nn's hinted scale.
struct NamedWeights;

impl candle_nn::var_builder::SimpleBackend for NamedWeights {
    fn get(&self, s: Shape, name: &str, h: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        // FNV-1a of the name seeds an xorshift64* stream.
        let mut state =
            name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        let mut uniform = move || {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let fan_in = *s.dims().last().unwrap_or(&1) as f32;
        let values: Vec<f32> = match h {
            // Norm weights (1 in candle-nn) with a tenth of noise, so they are not all equal.
            Init::Const(c) => (0..s.elem_count()).map(|_| c as f32 + 0.1 * uniform()).collect(),
            // Embeddings: unit variance; projections: variance 1 / fan_in (uniform has 1/3).
            _ => {
                let scale = if name.contains("embed_tokens") { 3f32.sqrt() } else { (3.0 / fan_in).sqrt() };
                (0..s.elem_count()).map(|_| scale * uniform()).collect()
            }
        };
        Tensor::from_vec(values, s, dev)?.to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> Result<Tensor> {
        candle_core::bail!("llama-check: {name} is only made with a shape")
    }

    fn contains_tensor(&self, _: &str) -> bool {
        true
    }
}

/// Two layers, 4 query heads of 32 over 2 k/v heads (grouped-query), a 384-token vocabulary.
fn config(use_flash_attn: bool) -> Config {
    Config {
        hidden_size: 128,
        intermediate_size: 256,
        vocab_size: 384,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        use_flash_attn,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: 64,
        tie_word_embeddings: false,
    }
}

const PROMPT: [u32; 8] = [1, 17, 42, 7, 99, 3, 250, 12];
const STEPS: usize = 12;

/// What one dtype's run found.
struct Run {
    rows: usize,
    max_rel: f32,
    argmax_same: usize,
    /// Rows whose argmaxes differ only between maxima of candle's row (an exact tie there).
    ties: usize,
    min_margin: f32,
}

fn argmax_and_margin(logits: &[f32]) -> (usize, f32) {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    (idx[0], logits[idx[0]] - logits[idx[1]])
}

fn run(dtype: DType, dev: &Device) -> Result<Run> {
    let dev = dev.clone();
    let vb = VarBuilder::from_backend(Box::new(NamedWeights), dtype, dev.clone());
    let (flash_cfg, candle_cfg) = (config(true), config(false));
    let flash = Llama::load(vb.clone(), &flash_cfg)?;
    let candle = Llama::load(vb, &candle_cfg)?;
    let mut flash_cache = Cache::new(true, dtype, &flash_cfg, &dev)?;
    let mut candle_cache = Cache::new(true, dtype, &candle_cfg, &dev)?;
    let mut input = PROMPT.to_vec();
    let mut pos = 0;
    let mut out = Run { rows: 0, max_rel: 0.0, argmax_same: 0, ties: 0, min_margin: f32::INFINITY };
    for step in 0..=STEPS {
        let x = Tensor::new(input.as_slice(), &dev)?.unsqueeze(0)?;
        let a = flash.forward(&x, pos, &mut flash_cache)?.flatten_all()?.to_vec1::<f32>()?;
        let b = candle.forward(&x, pos, &mut candle_cache)?.flatten_all()?.to_vec1::<f32>()?;
        let diff = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        let scale = b.iter().map(|y| y.abs()).fold(0f32, f32::max);
        let rel = diff / scale;
        let ((ta, _), (tb, margin)) = (argmax_and_margin(&a), argmax_and_margin(&b));
        println!(
            "{dtype:?} {}: max |flash - candle| {diff:.3e}, max |candle| {scale:.3}, relative {rel:.3e}; \
             argmax flash {ta} candle {tb} (candle's top-2 margin {margin:.4})",
            if step == 0 { "prompt".to_string() } else { format!("step {step:2}") },
        );
        out.rows += 1;
        out.max_rel = out.max_rel.max(rel);
        out.argmax_same += usize::from(ta == tb);
        let tie = ta != tb && b[ta] == b[tb];
        out.ties += usize::from(tie);
        if tie {
            println!("  a tie: candle's logits of tokens {ta} and {tb} are equal ({}), flash's choice is a maximum of candle's", b[tb]);
        }
        out.min_margin = out.min_margin.min(margin);
        pos += input.len();
        input = vec![tb as u32];
    }
    Ok(out)
}

fn main() -> Result<()> {
    let dev = match std::env::var_os("LLAMA_CHECK_CUDA") {
        Some(_) => Device::new_cuda(0)?,
        None => Device::Cpu,
    };
    let f32_run = run(DType::F32, &dev)?;
    let bf16_run = run(DType::BF16, &dev)?;
    let f32_ok = f32_run.max_rel <= 1e-5 && f32_run.argmax_same == f32_run.rows;
    let bf16_ok = bf16_run.argmax_same + bf16_run.ties == bf16_run.rows;
    println!(
        "f32: {} logits rows (prompt + {STEPS} steps), max relative difference {:.3e} (bound 1e-5), argmax equal in {}/{}",
        f32_run.rows, f32_run.max_rel, f32_run.argmax_same, f32_run.rows
    );
    println!(
        "bf16: argmax equal in {}/{} rows, {} more a maximum of candle's tied logits (smallest top-2 margin of \
         candle's logits {:.4}), max relative difference {:.3e}",
        bf16_run.argmax_same, bf16_run.rows, bf16_run.ties, bf16_run.min_margin, bf16_run.max_rel
    );
    if !(f32_ok && bf16_ok) {
        eprintln!("llama-check: FAILED (f32 {}, bf16 {})", ok(f32_ok), ok(bf16_ok));
        std::process::exit(1);
    }
    println!("llama-check: flash-attn on (memattn's candle-flash-attn) and off agree");
    Ok(())
}

fn ok(b: bool) -> &'static str {
    if b {
        "ok"
    } else {
        "failed"
    }
}
