//! `memattn decode`: one KV-cache decode call (split-KV attention, optional paged cache and
//! append), verified against the f64 reference, with the split plan and the memory figures.

use super::args::{non_negative_u32, non_negative_u64, Cli};
use super::{check_output, open_device, print_json, save_evidence};
use clap::Args;
use memattn_cli::decode::{
    run_decode, run_shared_prefix, CacheLayout, DecodeInputs, DecodeKernel, DecodeProblem, DecodeReport, DecodeSpec,
    SmCountSource, Splits, DEFAULT_SM_COUNT,
};
use memattn_cli::dtype::Dtype;
use memattn_cli::error::{exit, Error};
use memattn_cli::safetensors_io::SafetensorsDtype;
use memattn_cli::units::human_bytes;
use safetensors::tensor::TensorView;

const AFTER: &str = "\
Semantics follow FlashAttention-2's flash_attn_with_kvcache: the cache holds --cache-len keys per
sequence; --new-tokens T new keys/values are appended at that position (in place) before attention,
so each sequence attends over cache-len + T keys. Query head h reads KV head h / (heads / heads-kv).
Causal masking is bottom-right aligned (query i of seq_q sees key j <= i + seqlen_k - seq_q);
--window LEFT,RIGHT also limits each query to LEFT keys before and RIGHT after that diagonal. A row
that sees no key (cache-len 0, no new tokens) gives O = 0 and LSE = -inf.

Kernels: bf16 and f16 run on tensor cores (decode_mma: Q Kᵀ and P V with mma.sync, the query heads
of one KV head packed as rows of a 16-row tile); f32 runs the SIMT kernel (decode_fwd, f32
arithmetic), which --kernel simt also picks for 16-bit types.

FP8 KV cache: --kv-dtype fp8 (OCP e4m3, max 448) or fp8_e5m2 (max 57344) stores the cache one byte
per element, half of bf16 (Q, O and new tokens are bf16; --dtype bf16 is implied). Element x is
stored as round(x / scale) to the nearest code (ties to even), saturating at the largest finite
value; the kernel reads decode(byte) * scale. --k-scale and --v-scale give one scale per tensor
(default: the largest |x| of the random cache over the format's max, so nothing saturates).
The run is verified against the f64 reference over the same bytes (the usual bf16 bounds), and
the report adds the quantisation error: the rel RMS of O against attention over the unquantised
cache. FP8 runs on tensor cores (the cache widened exactly to f16 after each load, f16 mma.sync;
no FP8 instructions, so sm_80 runs it; on sm_90 (--vm-arch sm_90, or a Hopper GPU with the sm_90a
module, unless MEMATTN_HOPPER=0) e4m3 is widened by cvt.rn.f16x2.e4m3x2 instead) or, with
--kernel simt, on the SIMT kernel.

Split-KV: --splits N cuts each sequence's keys into N ranges of whole key tiles (64 keys for the
tensor-core kernel, 32 for SIMT), computed by N blocks in parallel and merged by log-sum-exp
(merge_states); --splits auto uses FlashAttention-2's wave-efficiency heuristic over --sms
multiprocessors (default: the device's count on CUDA, 132 on the VM). With a fixed N a sequence's output does not depend on the rest of the batch
(batch-invariant); every run is bit-reproducible. --sinks adds a per-head sink logit to the
softmax denominator (counted once: in split 0); the LSE includes it.

Examples:
  memattn decode --heads 32 --heads-kv 8 --head-dim 128 --cache-len 8192 --dtype bf16
  memattn decode --batch 3 --cache-len 100,0,37 --new-tokens 1 --page-size 16
  memattn decode --cache-len 4096 --vary splits=1,auto
  memattn decode --cache-len 1000,30 --vary page-size=16,256
  memattn decode --dtype bf16 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 300 --vary kernel=simt,mma
  memattn decode --kv-dtype fp8 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 4096
  memattn decode --dtype bf16 --batch 16 --heads 8 --heads-kv 2 --cache-len 1100 --shared-prefix 1024

Exit codes: 0 verified, 1 verification failed, 2 bad usage or input, 3 device or kernel error.";

/// `memattn decode` options.
#[derive(Debug, Args)]
#[command(after_help = AFTER)]
pub struct DecodeArgs {
    /// Sequences [default: the number of --cache-len values].
    #[arg(long, value_name = "B", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub batch: Option<u32>,
    /// Query heads.
    #[arg(long, default_value_t = 8, value_name = "H", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub heads: u32,
    /// KV heads (GQA; `heads` must be a multiple) [default: --heads].
    #[arg(long, value_name = "HK", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub heads_kv: Option<u32>,
    /// Head dim: 32, 64, 96, 128, 192 or 256 (the tensor-core decode at 64 and 128), or any
    /// other multiple of 8 up to 256 on the next of them, padded (not with an FP8 cache).
    #[arg(long, default_value_t = 64, value_name = "D", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub head_dim: u32,
    /// Keys in the cache before the call: one value for every sequence, or one per sequence.
    #[arg(long, default_value = "1024", value_name = "L[,L2,...]", value_delimiter = ',', allow_hyphen_values = true, value_parser = non_negative_u32)]
    pub cache_len: Vec<u32>,
    /// New tokens per sequence appended to the cache before attention.
    #[arg(long, default_value_t = 0, value_name = "T", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub new_tokens: u32,
    /// Query tokens per sequence (> 1: speculative decoding or chunked prefill).
    #[arg(long, default_value_t = 1, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub seq_q: u32,
    /// Contiguous cache: the cache slot of each sequence (FlashAttention-2's `cache_batch_idx`),
    /// one per sequence, e.g. `2,0,1`. The cache gets one slot past the largest; the others stay
    /// NaN, so a kernel that reads the wrong slot fails verification. With --new-tokens no two
    /// sequences may share a slot.
    #[arg(long, value_name = "S0,S1,...", value_delimiter = ',', allow_hyphen_values = true, value_parser = non_negative_u32, conflicts_with_all = ["inputs", "page_size"])]
    pub cache_batch_idx: Option<Vec<u32>>,
    /// Contiguous cache: rows of left padding before each sequence's keys (FlashAttention-2's
    /// `cache_leftpad`), one value for every sequence or one per sequence, each at most its
    /// --cache-len (which counts the padding: the keys are rows PAD .. cache-len + new tokens).
    /// The padding rows are NaN, so a kernel that reads them fails verification.
    #[arg(long, value_name = "PAD[,PAD2,...]", value_delimiter = ',', allow_hyphen_values = true, value_parser = non_negative_u32, conflicts_with_all = ["inputs", "page_size"])]
    pub cache_leftpad: Option<Vec<u32>>,
    /// Rotary embedding of q and the new keys (FlashAttention-2's rotary_cos/rotary_sin): the
    /// first N dims of every head (even, at most --head-dim; less than it is a partial rotary)
    /// rotate by the usual angles (base 10000) of each token's position: new key t at
    /// cache-len + t, query token i at cache-len + i (at cache-len for all with --no-causal and
    /// no window). Needs --new-tokens, as FlashAttention-2 does.
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32, conflicts_with = "inputs")]
    pub rotary_dim: Option<u32>,
    /// With --rotary-dim (or the rotary tables of --inputs): rotate the pairs (2i, 2i+1) (GPT-J, FlashAttention-2's
    /// rotary_interleaved=True) instead of (i, i + N/2) (GPT-NeoX, the default).
    /// With --inputs, the pairs of the file's rotary tables.
    #[arg(long)]
    pub rotary_interleaved: bool,
    /// Paged cache with P keys per page (any P >= 1; pages shuffled); default: contiguous.
    #[arg(long, value_name = "P", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub page_size: Option<u32>,
    /// Split count: `auto` (FlashAttention-2's heuristic) or 1..=128 [default: auto].
    #[arg(long, value_name = "auto|N", allow_negative_numbers = true)]
    pub splits: Option<Splits>,
    /// Multiprocessors the split plan fills [default: the device's multiprocessor count on CUDA;
    /// 132, an H100/H200, on the VM, which models that count].
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub sms: Option<u32>,
    /// Element type of Q, the cache and O (bf16/f16 run on tensor cores, f32 on the SIMT kernel)
    /// [default: f32].
    #[arg(long, value_name = "f32|bf16|f16")]
    pub dtype: Option<Dtype>,
    /// KV cache element type: `fp8` (OCP e4m3) or `fp8_e5m2`, one byte per element with f32
    /// scales (Q, O and new tokens bf16) [default: --dtype].
    #[arg(long, value_name = "fp8|fp8_e5m2", value_parser = parse_kv_dtype, conflicts_with = "inputs")]
    pub kv_dtype: Option<memattn_cli::decode::Fp8Format>,
    /// FP8 cache: the K scale (stored = round(k / scale)), finite and > 0 [default: max |k| / the
    /// format's max].
    #[arg(long, value_name = "X", allow_negative_numbers = true, requires = "kv_dtype")]
    pub k_scale: Option<f32>,
    /// FP8 cache: the V scale, as --k-scale.
    #[arg(long, value_name = "Y", allow_negative_numbers = true, requires = "kv_dtype")]
    pub v_scale: Option<f32>,
    /// Decode forward: `auto` (tensor cores for bf16/f16, SIMT for f32; the prefill kernel for a
    /// query of at least its block's rows, 96 to 256 tokens by head dim), `simt` (f32 arithmetic, any
    /// dtype), `mma` (tensor cores, bf16/f16 only) or `prefill` (chunked prefill: the
    /// tensor-core forward reading the cache through the block table, no key splits; bf16/f16,
    /// no FP8 cache, ALiBi, cache slots, left padding or --splits N > 1) [default: auto].
    #[arg(long, value_name = "auto|simt|mma|prefill")]
    pub kernel: Option<DecodeKernel>,
    /// Check the index tensors (cache_seqlens, block table, slots, left padding) on the device,
    /// as a serving loop that never reads them back does: the library gets them without host
    /// copies, plans from the cache's size, and runs `decode_check_*` first in the call (its
    /// launch and thread-instructions show among the launches); a bad index would make O NaN and
    /// is reported after the run. With --rotary-dim the tables then cover every position up to
    /// the capacity. Default: checked on the host before the launch.
    #[arg(long)]
    pub indices_on_device: bool,
    /// Per-head attention sinks (random, or the `sinks` tensor of --inputs): a logit per query
    /// head joins the softmax denominator only; the LSE includes it.
    #[arg(long)]
    pub sinks: bool,
    /// ALiBi with the paper's slopes for --heads: the score of query token i and key j gains
    /// -slope_h * |i + seqlen_k - seq_q - j| (FlashAttention-2's alibi_slopes).
    #[arg(long)]
    pub alibi: bool,
    /// Attend to every key (default: bottom-right causal, which only matters for seq_q > 1).
    #[arg(long)]
    pub no_causal: bool,
    /// Sliding window `LEFT,RIGHT`: keys left and right of the (bottom-right aligned) diagonal a
    /// query sees, `-1` for unbounded, as FlashAttention-2's `window_size` (causal makes RIGHT 0).
    #[arg(long, value_name = "LEFT,RIGHT", allow_hyphen_values = true)]
    pub window: Option<String>,
    /// Score soft-capping: `softcap * tanh(score / softcap)` before the softmax (0: off).
    #[arg(long, default_value_t = 0.0, value_name = "C", allow_negative_numbers = true)]
    pub softcap: f32,
    /// Softmax scale [default: 1/sqrt(head_dim)].
    #[arg(long, value_name = "S", allow_negative_numbers = true)]
    pub scale: Option<f32>,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0, value_name = "SEED", allow_negative_numbers = true, value_parser = non_negative_u64)]
    pub seed: u64,
    /// Warm-up launches [default: the device's].
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub warmup: Option<u32>,
    /// Timed repetitions [default: the device's].
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub repeats: Option<u32>,
    /// Run once per value of one option and print the runs side by side: `splits=1,auto`,
    /// `page-size=16,256` (`0` = contiguous), `dtype=f32,bf16`, `kernel=simt,mma`.
    #[arg(long, value_name = "KEY=A,B[,...]")]
    pub vary: Option<String>,
    /// Read the tensors from a safetensors file instead of drawing them: `q` `[batch, seq_q,
    /// heads, d]`, `k_cache`, `v_cache` (`[batch, seq_cache, heads_kv, d]`, or `[num_pages,
    /// page_size, heads_kv, d]` with `block_table`), `cache_seqlens` `[batch]` (U32/I32), optional
    /// `block_table` `[batch, max_pages]` (U32/I32), `k_new`, `v_new` `[batch, new, heads_kv, d]`,
    /// `sinks` `[heads]` F32 (present: sinks on), FlashAttention-2's `cache_batch_idx` and
    /// `cache_leftpad` `[batch]` (U32/I32; contiguous caches, whose first dimension is then the
    /// slots), `rotary_cos`, `rotary_sin` `[seqlen_ro, rotary_dim / 2]` (with new tokens;
    /// `--rotary-interleaved` for GPT-J pairs) and `alibi_slopes` `[heads]` or `[batch, heads]`
    /// F32; F32, BF16 or F16, one dtype. Shapes, lengths, page size and dtype then come from the
    /// file.
    #[arg(long, value_name = "FILE.safetensors", conflicts_with_all = ["batch", "heads", "heads_kv", "head_dim", "cache_len", "new_tokens", "seq_q", "page_size", "dtype", "vary", "sinks"])]
    pub inputs: Option<std::path::PathBuf>,
    /// Shared prefix (cascade attention): the first N cached keys of every sequence are one
    /// prefix (sequence 0's, copied into every sequence's inputs), held once as a `[1, N,
    /// heads_kv, d]` cache; each sequence keeps its other cache-len - N keys in its own suffix
    /// cache. The library attends every query row of the batch to the prefix in one decode launch
    /// and each sequence to its suffix, and merges the two states exactly; the result is verified
    /// against the f64 reference of each sequence as one plain decode over prefix ++ suffix. The
    /// report prints the global bytes the call read (VM) next to what reading the prefix once per
    /// sequence costs. 1 <= N <= the shortest --cache-len; contiguous caches, no window, ALiBi,
    /// FP8, rotary, cache slots or left padding.
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32, conflicts_with_all = ["inputs", "output", "vary", "page_size", "kv_dtype", "cache_batch_idx", "cache_leftpad", "rotary_dim", "indices_on_device", "alibi", "window"])]
    pub shared_prefix: Option<u32>,
    /// Write `o`, `lse` and the cache after the append (`k_cache`, `v_cache`, in the cache's
    /// layout) to a safetensors file (atomically, only when the run verified).
    #[arg(long, value_name = "FILE.safetensors")]
    pub output: Option<std::path::PathBuf>,
}

fn parse_kv_dtype(s: &str) -> Result<memattn_cli::decode::Fp8Format, String> {
    use memattn_cli::decode::Fp8Format;
    match s.to_ascii_lowercase().as_str() {
        "fp8" | "fp8_e4m3" | "e4m3" => Ok(Fp8Format::E4m3),
        "fp8_e5m2" | "e5m2" => Ok(Fp8Format::E5m2),
        _ => Err(format!("`{s}`: the KV cache dtypes are fp8 (e4m3) and fp8_e5m2")),
    }
}

/// Most sequences of one decode call: the launch grid's z dimension holds `heads_kv x batch`, and
/// a CUDA grid's z is at most 65535 (checked before the per-sequence lengths are expanded).
const MAX_DECODE_BATCH: u32 = 65535;

fn problem(a: &DecodeArgs) -> Result<DecodeProblem, Error> {
    let batch = a.batch.unwrap_or(a.cache_len.len() as u32);
    if batch > MAX_DECODE_BATCH {
        return Err(Error::Usage(format!(
            "--batch {batch}: at most {MAX_DECODE_BATCH} sequences (the decode grid's z dimension is heads_kv x batch, at most 65535)"
        )));
    }
    let cache_seqlens = match a.cache_len.len() {
        1 => vec![a.cache_len[0]; batch as usize],
        n if n as u32 == batch => a.cache_len.clone(),
        n => {
            return Err(Error::Usage(format!(
                "--cache-len has {n} values and --batch is {batch}: give one length, or one per sequence"
            )))
        }
    };
    if a.repeats == Some(0) {
        return Err(Error::Usage("--repeats must be at least 1".into()));
    }
    let cache_leftpad = match a.cache_leftpad.as_deref() {
        None => None,
        Some([pad]) => Some(vec![*pad; batch as usize]),
        Some(pads) if pads.len() as u32 == batch => Some(pads.to_vec()),
        Some(pads) => {
            return Err(Error::Usage(format!(
                "--cache-leftpad has {} values and --batch is {batch}: give one, or one per sequence",
                pads.len()
            )))
        }
    };
    let (window_left, window_right) = match &a.window {
        None => (-1, -1),
        Some(w) => {
            let parts: Vec<Result<i32, _>> = w.split(',').map(|x| x.trim().parse::<i32>()).collect();
            match parts.as_slice() {
                [Ok(l), Ok(r)] => (*l, *r),
                _ => {
                    return Err(Error::Usage(format!("--window takes LEFT,RIGHT (integers, -1 unbounded), got `{w}`")))
                }
            }
        }
    };
    let p = DecodeProblem {
        window_left,
        window_right,
        softcap: a.softcap,
        batch,
        heads: a.heads,
        heads_kv: a.heads_kv.unwrap_or(a.heads),
        head_dim: a.head_dim,
        seq_q: a.seq_q,
        cache_seqlens,
        seq_new: a.new_tokens,
        page_size: a.page_size,
        dtype: a.dtype.unwrap_or(Dtype::F32),
        causal: !a.no_causal,
        scale: a.scale,
        splits: a.splits.unwrap_or_default(),
        sm_count: a.sms.unwrap_or(DEFAULT_SM_COUNT),
        sm_count_source: if a.sms.is_some() { SmCountSource::Given } else { SmCountSource::Default },
        kernel: a.kernel.unwrap_or_default(),
        sinks: a.sinks,
        alibi: a.alibi,
        kv_fp8: a.kv_dtype,
        cache_batch_idx: a.cache_batch_idx.clone(),
        cache_leftpad,
        rotary: a.rotary_dim.map(|dim| memattn_cli::decode::Rotary { dim, interleaved: a.rotary_interleaved }),
    };
    // An FP8 cache keeps Q, O and the new tokens in bf16: implied without --dtype; another
    // --dtype is refused, never silently replaced.
    if let (Some(f), Some(d)) = (a.kv_dtype, a.dtype.filter(|&d| d != Dtype::Bf16)) {
        return Err(Error::Usage(format!(
            "--kv-dtype {} keeps q, o and the new tokens in bf16: --dtype {d} cannot go with it (leave --dtype out, or give bf16)",
            match f {
                memattn_cli::decode::Fp8Format::E4m3 => "fp8",
                memattn_cli::decode::Fp8Format::E5m2 => "fp8_e5m2",
            }
        )));
    }
    let p = if a.kv_dtype.is_some() { DecodeProblem { dtype: Dtype::Bf16, ..p } } else { p };
    if a.rotary_interleaved && a.rotary_dim.is_none() && a.inputs.is_none() {
        return Err(Error::Usage("--rotary-interleaved needs --rotary-dim (or --inputs with rotary tables)".into()));
    }
    // With --inputs the dtype and the shapes come from the file: the options are checked once
    // they are known (in `read_inputs`), not against the defaults.
    if a.inputs.is_none() {
        p.validate()?;
    }
    Ok(p)
}

/// Refuses `--vary KEY` together with the option it sets (`--splits 2 --vary splits=1,3`): each
/// run sets the varied option, so the given value would be ignored.
fn check_vary_conflict(a: &DecodeArgs, key: &str) -> Result<(), Error> {
    let (flag, given) = match key {
        "splits" => ("--splits", a.splits.is_some()),
        "page-size" => ("--page-size", a.page_size.is_some()),
        "dtype" => ("--dtype", a.dtype.is_some()),
        "kernel" => ("--kernel", a.kernel.is_some()),
        _ => return Ok(()),
    };
    if given {
        return Err(Error::Usage(format!(
            "--vary {key} sets what {flag} sets, so {flag} would be ignored: give one of them"
        )));
    }
    Ok(())
}

/// The problem with `key=value` applied.
fn varied(p: &DecodeProblem, key: &str, value: &str) -> Result<DecodeProblem, Error> {
    let mut q = p.clone();
    match key {
        "splits" => q.splits = value.parse().map_err(Error::Usage)?,
        "page-size" => {
            let n: u32 = super::args::non_negative_u32(value)
                .map_err(|e| Error::Usage(format!("--vary page-size={value}: {e} (0 = contiguous)")))?;
            q.page_size = (n > 0).then_some(n);
        }
        "dtype" => {
            q.dtype = value.parse().map_err(|e: memattn_cli::dtype::UnknownDtype| Error::Usage(e.to_string()))?
        }
        "kernel" => q.kernel = value.parse().map_err(Error::Usage)?,
        _ => return Err(Error::Usage(format!("decode --vary takes splits, page-size, dtype or kernel (got `{key}`)"))),
    }
    q.validate()?;
    Ok(q)
}

/// A tensor read from the input file: its shape and values.
type Tensor<T> = (Vec<usize>, Vec<T>);

/// Reads the tensors of `--inputs`; returns the problem (with `base`'s split, scale and causal
/// options) and the inputs. Every shape rule broken is exit 2 naming the tensor.
fn read_inputs(
    path: &std::path::Path,
    base: &DecodeProblem,
    rotary_interleaved: bool,
) -> Result<(DecodeProblem, DecodeInputs), Error> {
    let bytes = memattn_cli::files::read_regular(path, memattn_cli::files::MAX_INPUT_BYTES, "input file")?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| Error::Usage(format!("{} is not a valid safetensors file: {e}", path.display())))?;
    let bad = |m: String| Error::Usage(format!("{}: {m}", path.display()));
    let q = st.tensor("q").map_err(|_| bad("no tensor `q`".into()))?;
    let dtype =
        Dtype::from_safetensors(q.dtype()).ok_or_else(|| bad(format!("q is {:?}; F32, BF16 or F16", q.dtype())))?;
    let float = |name: &str| -> Result<Option<Tensor<f32>>, Error> {
        let Ok(t) = st.tensor(name) else { return Ok(None) };
        if t.dtype() != dtype.safetensors() {
            return Err(bad(format!("`{name}` is {:?} but q is {:?}: one dtype for all", t.dtype(), q.dtype())));
        }
        if t.shape().len() != 4 {
            return Err(bad(format!("`{name}` has shape {:?}; 4 dimensions expected", t.shape())));
        }
        Ok(Some((t.shape().to_vec(), dtype.decode(t.data()))))
    };
    let index = |name: &str| -> Result<Option<Tensor<u32>>, Error> {
        let Ok(t) = st.tensor(name) else { return Ok(None) };
        let v: Vec<u32> = match t.dtype() {
            safetensors::Dtype::U32 => {
                t.data().chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
            safetensors::Dtype::I32 => {
                let v: Vec<i32> =
                    t.data().chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                if let Some(n) = v.iter().find(|&&n| n < 0) {
                    return Err(bad(format!("`{name}` has a negative entry {n}")));
                }
                v.into_iter().map(|n| n as u32).collect()
            }
            d => return Err(bad(format!("`{name}` is {d:?}; U32 or I32 expected"))),
        };
        Ok(Some((t.shape().to_vec(), v)))
    };
    let need = |name: &str, x: Option<Tensor<f32>>| x.ok_or_else(|| bad(format!("no tensor `{name}`")));
    let (qs, qv) = need("q", float("q")?)?;
    let (ks, kv) = need("k_cache", float("k_cache")?)?;
    let (vs, vv) = need("v_cache", float("v_cache")?)?;
    let (ls, lens) = index("cache_seqlens")?.ok_or_else(|| bad("no tensor `cache_seqlens`".into()))?;
    let [b, sq, h, d] = [qs[0], qs[1], qs[2], qs[3]];
    if ks != vs || ks[3] != d {
        return Err(bad(format!("k_cache {ks:?} and v_cache {vs:?} must have one shape with head_dim {d} of q")));
    }
    if ls != [b] {
        return Err(bad(format!("cache_seqlens has shape {ls:?}, expected [{b}] (batch of q)")));
    }
    let hk = ks[2];
    let (new_k, new_v, seq_new) = match (float("k_new")?, float("v_new")?) {
        (None, None) => (Vec::new(), Vec::new(), 0),
        (Some((a, x)), Some((c, y))) if a == c && a[0] == b && a[2] == hk && a[3] == d => (x, y, a[1]),
        _ => return Err(bad(format!("k_new and v_new must both be [{b}, new, {hk}, {d}]"))),
    };
    let u32_of = |n: usize, what: &str| u32::try_from(n).map_err(|_| bad(format!("{what} {n} is over the u32 limit")));
    // FlashAttention-2's cache_batch_idx and cache_leftpad: `[batch]` each (contiguous caches).
    let per_seq = |name: &str| -> Result<Option<Vec<u32>>, Error> {
        match index(name)? {
            None => Ok(None),
            Some((s, v)) if s == [b] => Ok(Some(v)),
            Some((s, _)) => Err(bad(format!("`{name}` has shape {s:?}, expected [{b}] (batch of q)"))),
        }
    };
    let (slots, leftpad) = (per_seq("cache_batch_idx")?, per_seq("cache_leftpad")?);
    let (layout, table, page_size) = match index("block_table")? {
        Some((ts, t)) => {
            if ts.len() != 2 || ts[0] != b {
                return Err(bad(format!("block_table has shape {ts:?}, expected [{b}, max_pages]")));
            }
            let layout = CacheLayout::Paged {
                page_size: u32_of(ks[1], "page_size")?,
                num_pages: u32_of(ks[0], "num_pages")?,
                max_pages: u32_of(ts[1], "max_pages")?,
            };
            (layout, t, Some(u32_of(ks[1], "page_size")?))
        }
        None => {
            if ks[0] != b && slots.is_none() {
                return Err(bad(format!(
                    "contiguous k_cache {ks:?} must have batch {b} first (or give a block_table, or cache_batch_idx)"
                )));
            }
            (CacheLayout::Contiguous { seq_cache: u32_of(ks[1], "seq_cache")? }, Vec::new(), None)
        }
    };
    // Rotary tables `[seqlen_ro, rotary_dim / 2]` in q's dtype, both or neither.
    let table2 = |name: &str| -> Result<Option<Tensor<f32>>, Error> {
        let Ok(t) = st.tensor(name) else { return Ok(None) };
        if t.dtype() != dtype.safetensors() || t.shape().len() != 2 {
            return Err(bad(format!(
                "`{name}` is {:?} {:?}; {:?} [seqlen_ro, rotary_dim / 2] expected",
                t.dtype(),
                t.shape(),
                q.dtype()
            )));
        }
        Ok(Some((t.shape().to_vec(), dtype.decode(t.data()))))
    };
    let (rotary, rotary_cos, rotary_sin) = match (table2("rotary_cos")?, table2("rotary_sin")?) {
        (None, None) => (None, Vec::new(), Vec::new()),
        (Some((cs, c)), Some((ss, s))) if cs == ss => {
            let dim = u32_of(2 * cs[1], "rotary_dim")?;
            (Some(memattn_cli::decode::Rotary { dim, interleaved: rotary_interleaved }), c, s)
        }
        _ => return Err(bad("rotary_cos and rotary_sin must both be given, with one shape".into())),
    };
    if rotary.is_none() && rotary_interleaved {
        return Err(bad("--rotary-interleaved needs the file's rotary_cos and rotary_sin".into()));
    }
    // ALiBi slopes: F32 `[heads]` or `[batch, heads]`.
    let alibi_slopes = match st.tensor("alibi_slopes") {
        Err(_) if base.alibi => memattn::problem::alibi_slopes(u32_of(h, "heads")?),
        Err(_) => Vec::new(),
        Ok(t) if t.dtype() == safetensors::Dtype::F32 && (t.shape() == [h] || t.shape() == [b, h]) => {
            Dtype::F32.decode(t.data())
        }
        Ok(t) => {
            return Err(bad(format!(
                "`alibi_slopes` is {:?} {:?}; F32 [{h}] or [{b}, {h}] expected",
                t.dtype(),
                t.shape()
            )))
        }
    };
    let sinks = match st.tensor("sinks") {
        Err(_) => Vec::new(),
        Ok(t) if t.dtype() == safetensors::Dtype::F32 && t.shape() == [h] => Dtype::F32.decode(t.data()),
        Ok(t) => {
            return Err(bad(format!(
                "`sinks` is {:?} {:?}; F32 [{h}] (one logit per query head) expected",
                t.dtype(),
                t.shape()
            )))
        }
    };
    let p = DecodeProblem {
        sinks: !sinks.is_empty(),
        batch: u32_of(b, "batch")?,
        heads: u32_of(h, "heads")?,
        heads_kv: u32_of(hk, "heads_kv")?,
        head_dim: u32_of(d, "head_dim")?,
        seq_q: u32_of(sq, "seq_q")?,
        cache_seqlens: lens,
        seq_new: u32_of(seq_new, "new tokens")?,
        page_size,
        dtype,
        cache_batch_idx: slots,
        cache_leftpad: leftpad,
        rotary,
        alibi: !alibi_slopes.is_empty(),
        ..base.clone()
    };
    p.validate()?;
    let x = DecodeInputs {
        q: qv,
        k_cache: kv,
        v_cache: vv,
        block_table: table,
        k_new: new_k,
        v_new: new_v,
        layout,
        sinks,
        k_scale: Vec::new(),
        v_scale: Vec::new(),
        rotary_cos,
        rotary_sin,
        alibi_slopes,
    };
    Ok((p, x))
}

fn summary(r: &DecodeReport) -> String {
    let b = &r.bytes;
    let mut s = String::new();
    let cache = match r.cache {
        memattn_cli::decode::CacheLayout::Contiguous { seq_cache } => {
            format!("contiguous, {seq_cache} keys per sequence")
        }
        memattn_cli::decode::CacheLayout::Paged { page_size, num_pages, max_pages } => {
            format!("paged, {num_pages} pages of {page_size} keys, block table {} x {max_pages}", r.batch)
        }
    };
    s += &format!("cache        {cache}\n");
    s += &format!(
        "kernel       {}{}\n",
        match r.kernel {
            "mma" => "tensor cores (mma.sync m16n8k16), GQA group packed into 16-row tiles",
            "prefill" => "chunked prefill: the tensor-core forward reading the cache, no key splits",
            _ => "SIMT, f32 arithmetic",
        },
        if r.sinks && r.kernel != "prefill" {
            "; sinks (counted in split 0)"
        } else if r.sinks {
            "; sinks"
        } else {
            ""
        }
    );
    s += &format!(
        "plan         {} splits ({}), {} blocks on {} SMs ({}) = {:.2} blocks per SM, wave efficiency {:.0}%\n",
        r.plan.num_splits,
        r.plan.chosen_by,
        r.plan.blocks,
        r.plan.sm_count,
        match r.plan.sm_count_source {
            SmCountSource::Given => "--sms",
            other => other.describe(),
        },
        r.plan.blocks_per_sm,
        100.0 * r.plan.wave_efficiency
    );
    let v = &r.verification;
    s += &format!(
        "verified     {}  (O max err {:.2e} of row scale, bound {:.1e}; rel RMS {:.2e}; LSE err {:.2e}{})\n",
        if r.verified { "PASS" } else { "FAIL" },
        v.o_max_scaled_err,
        v.o_bound,
        v.o_rel_rms_err,
        v.lse_max_abs_err,
        match v.cache_ok {
            Some(true) => "; appended cache exact",
            Some(false) => "; appended cache WRONG",
            None => "",
        }
    );
    for f in &v.failures {
        s += &format!("  {f}\n");
    }
    if r.indices_checked_on == "device" {
        s += "indices      checked on the device (decode_check first; nothing read back until the run ended)\n";
    }
    if let Some(q) = v.quantisation_rel_rms {
        s += &format!(
            "quantised    {} cache: O rel RMS {q:.2e} against the unquantised cache (kernel vs same bytes: {:.2e})\n",
            r.kv_dtype, v.o_rel_rms_err
        );
    }
    s += &format!(
        "time         {:.4} ms median ({} repeats, {}), {:.3} TFLOP/s, K/V read {:.2} GB/s\n",
        r.time_ms, r.timing.repeats, r.timing.clock, r.tflops, r.kv_read_gb_per_s
    );
    s += &format!(
        "KV cache     {} {} allocated, {} used, {} unused; contiguous {} vs paged (page {}) {}\n",
        r.kv_dtype,
        human_bytes(b.kv_cache),
        human_bytes(b.kv_used),
        human_bytes(b.kv_unused),
        human_bytes(b.kv_contiguous),
        b.kv_paged_page_size,
        human_bytes(b.kv_paged)
    );
    s += &format!(
        "bytes        moved {} per call, {} per query token; split workspace {}; measured peak {}\n",
        human_bytes(b.moved),
        human_bytes(b.moved_per_token),
        human_bytes(b.workspace),
        human_bytes(r.peak_device_bytes)
    );
    if let (Some(n), Some(per)) = (r.vm_thread_instructions, r.vm_thread_instructions_per_cached_token) {
        s += &format!("VM           {n} thread-instructions, {per:.1} per cached token\n");
    }
    for l in &r.launches {
        s += &format!(
            "launch       {} grid {:?} block {:?} smem {} B\n",
            l.kernel, l.grid, l.block, l.dynamic_smem_bytes
        );
    }
    s
}

fn write_output(path: &std::path::Path, p: &DecodeProblem, r: &DecodeReport) -> Result<(), Error> {
    let err = |e: safetensors::SafeTensorError| Error::Usage(format!("cannot write {}: {e}", path.display()));
    let (b, sq, h, d, hk) =
        (p.batch as usize, p.seq_q as usize, p.heads as usize, p.head_dim as usize, p.heads_kv as usize);
    // Shaped by what is written: a contiguous cache has as many slots as it holds (with
    // cache_batch_idx, one past the largest slot, not the batch).
    let cache_shape = match r.cache {
        memattn_cli::decode::CacheLayout::Contiguous { seq_cache } => {
            let slot = (seq_cache as usize * hk * d).max(1);
            vec![r.k_cache.len() / slot, seq_cache as usize, hk, d]
        }
        memattn_cli::decode::CacheLayout::Paged { page_size, num_pages, .. } => {
            vec![num_pages as usize, page_size as usize, hk, d]
        }
    };
    let st = p.dtype.safetensors();
    let (ob, lb, kb, vb) =
        (p.dtype.encode(&r.o), Dtype::F32.encode(&r.lse), p.dtype.encode(&r.k_cache), p.dtype.encode(&r.v_cache));
    let o = TensorView::new(st, vec![b, sq, h, d], &ob).map_err(err)?;
    let l = TensorView::new(safetensors::Dtype::F32, vec![b, h, sq], &lb).map_err(err)?;
    let k = TensorView::new(st, cache_shape.clone(), &kb).map_err(err)?;
    let v = TensorView::new(st, cache_shape, &vb).map_err(err)?;
    let bytes = safetensors::serialize([("o", o), ("lse", l), ("k_cache", k), ("v_cache", v)], None).map_err(err)?;
    Ok(memattn_cli::files::write_atomic(path, &bytes, "output file")?)
}

/// Refuses, before the random inputs are drawn, a call whose device buffers exceed the device's
/// free memory (exit 2, naming both) or whose host copies cannot be reserved (exit 3, naming the
/// bytes): the sizes come from [`DecodeProblem::sizes`], in 128 bits, so nothing wraps.
fn check_generated_fits(dev: &mut dyn memattn_cli::Device, p: &DecodeProblem) -> Result<(), Error> {
    let sizes = p.sizes()?;
    let need = sizes.device_bytes(p);
    let free = dev.caps()?.free_memory_bytes;
    if need > free {
        return Err(Error::DeviceMemory { what: "decode call", needed: need, free });
    }
    memattn_cli::runner::probe_host_memory(sizes.host_bytes(p), "the host copies of the decode problem")
}

pub fn decode(cli: &Cli, a: &DecodeArgs) -> Result<i32, Error> {
    let mut base = problem(a)?;
    if let Some(out) = &a.output {
        if a.kv_dtype.is_some() {
            return Err(Error::Usage(
                "--output writes f32/bf16/f16 tensors; writing an FP8 cache (its bytes and scales) is not supported yet: leave out --output or --kv-dtype".into(),
            ));
        }
        if a.vary.is_some() {
            return Err(Error::Usage("--output writes one run: leave out --vary".into()));
        }
        check_output(cli, "--output", out, &[("--inputs", a.inputs.as_deref())])?;
    }
    let given = match &a.inputs {
        Some(path) => {
            let (p, x) = read_inputs(path, &base, a.rotary_interleaved)?;
            base = p;
            Some(x)
        }
        None => None,
    };
    let runs: Vec<(String, DecodeProblem)> = match &a.vary {
        None => vec![(String::new(), base.clone())],
        Some(v) => {
            let Some((k, vals)) = v.split_once('=') else {
                return Err(Error::Usage(format!("--vary expects KEY=A,B (got `{v}`)")));
            };
            let key = k.trim().to_ascii_lowercase().replace('_', "-");
            let list: Vec<&str> = vals.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
            if list.is_empty() {
                return Err(Error::Usage(format!("--vary {key}= has no values")));
            }
            check_vary_conflict(a, &key)?;
            list.iter()
                .map(|val| Ok((format!("{key}={val}"), varied(&base, &key, val)?)))
                .collect::<Result<_, Error>>()?
        }
    };
    let (mut dev, reason) = open_device(cli)?;
    if let Some(prefix) = a.shared_prefix {
        return shared_prefix(cli, a, dev.as_mut(), &base, prefix, reason);
    }
    let mut reports = Vec::new();
    for (label, p) in &runs {
        let mut p = p.clone();
        p.use_device_sm_count(dev.as_mut())?;
        let spec = DecodeSpec {
            problem: p.clone(),
            seed: a.seed,
            warmup: a.warmup,
            repeats: a.repeats,
            indices_on_device: a.indices_on_device,
        };
        if !cli.json {
            println!(
                "{}decode: batch {}, heads {} (kv {}), head_dim {}, seq_q {}, cache {:?} + {} new, {}{}",
                if label.is_empty() { String::new() } else { format!("[{label}] ") },
                p.batch,
                p.heads,
                p.heads_kv,
                p.head_dim,
                p.seq_q,
                p.cache_seqlens.iter().take(8).collect::<Vec<_>>(),
                p.seq_new,
                p.dtype,
                if p.causal { ", causal" } else { "" }
            );
        }
        if given.is_none() {
            check_generated_fits(dev.as_mut(), &p)?;
        }
        // Given FP8 scales replace the drawn ones (the same random values otherwise).
        let scaled = match (given.is_none() && p.kv_fp8.is_some(), a.k_scale, a.v_scale) {
            (true, ks, vs) if ks.is_some() || vs.is_some() => {
                let mut x = DecodeInputs::random(&p, a.seed);
                if let Some(s) = ks {
                    x.k_scale = vec![s];
                }
                if let Some(s) = vs {
                    x.v_scale = vec![s];
                }
                Some(x)
            }
            _ => None,
        };
        let r = run_decode(dev.as_mut(), &spec, scaled.as_ref().or(given.as_ref()))?;
        if !cli.json {
            print!("{}", summary(&r));
        }
        reports.push((label.clone(), r));
    }
    let mut written = None;
    if let (Some(path), Some((_, r))) = (&a.output, reports.first()) {
        if r.verified {
            write_output(path, &runs[0].1, r)?;
            written = Some(path.display().to_string());
            if !cli.json {
                println!("wrote o, lse, k_cache, v_cache to {}", path.display());
            }
        } else {
            eprintln!("not writing {}: the result did not verify", path.display());
        }
    }
    let mut v = if reports.len() == 1 {
        serde_json::to_value(&reports[0].1).unwrap_or_default()
    } else {
        serde_json::json!({ "runs": reports.iter().map(|(l, r)| {
            let mut x = serde_json::to_value(r).unwrap_or_default();
            x["varied"] = l.clone().into();
            x
        }).collect::<Vec<_>>() })
    };
    v["backend_reason"] = reason.into();
    if a.output.is_some() {
        v["output_file"] = written.into();
    }
    save_evidence(cli, &v)?;
    if cli.json {
        print_json(&v);
    }
    Ok(if reports.iter().all(|(_, r)| r.verified) { exit::SUCCESS } else { exit::VERIFICATION_FAILED })
}

/// `decode --shared-prefix N`: one shared-prefix call over random inputs, verified, with the bytes
/// it read against what reading the prefix once per sequence costs.
fn shared_prefix(
    cli: &Cli,
    a: &DecodeArgs,
    dev: &mut dyn memattn_cli::Device,
    p: &DecodeProblem,
    prefix: u32,
    reason: String,
) -> Result<i32, Error> {
    let mut p = p.clone();
    p.use_device_sm_count(dev)?;
    check_generated_fits(dev, &p)?;
    let spec =
        DecodeSpec { problem: p.clone(), seed: a.seed, warmup: a.warmup, repeats: a.repeats, indices_on_device: false };
    let r = run_shared_prefix(dev, &spec, prefix)?;
    if !cli.json {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        println!(
            "decode: batch {}, heads {} (kv {}), head_dim {}, seq_q {}, cache {:?} + {} new, {}{}",
            p.batch,
            p.heads,
            p.heads_kv,
            p.head_dim,
            p.seq_q,
            p.cache_seqlens.iter().take(8).collect::<Vec<_>>(),
            p.seq_new,
            p.dtype,
            if p.causal { ", causal" } else { "" }
        );
        println!(
            "shared prefix {} keys ({} of K and V, held once), suffixes {:?}",
            r.prefix,
            human_bytes(r.prefix_bytes),
            r.suffix_seqlens.iter().take(8).collect::<Vec<_>>()
        );
        println!(
            "kernel       {}",
            if r.kernel == "mma" { "tensor cores (mma.sync m16n8k16)" } else { "SIMT, f32 arithmetic" }
        );
        let v = &r.verification;
        println!(
            "verified     {}  (O max err {:.2e} of row scale, bound {:.1e}; rel RMS {:.2e}; LSE err {:.2e}; against prefix ++ suffix as one decode)",
            if r.verified { "PASS" } else { "FAIL" },
            v.o_max_scaled_err,
            v.o_bound,
            v.o_rel_rms_err,
            v.lse_max_abs_err
        );
        if let (Some(pre), Some(all)) = (r.prefix_launch_bytes_read, r.bytes_read) {
            println!(
                "bytes read   {:.2} MiB by the call, {:.2} MiB by the prefix's launch ({:.1}x the prefix); reading the prefix once per sequence: {:.2} MiB ({}x)",
                mib(all),
                mib(pre),
                pre as f64 / r.prefix_bytes.max(1) as f64,
                mib(r.per_request_prefix_bytes),
                p.batch
            );
        }
        for l in &r.launches {
            println!("launch       {} grid {:?} block {:?} smem {} B", l.kernel, l.grid, l.block, l.dynamic_smem_bytes);
        }
        for f in &r.verification.failures {
            eprintln!("  {f}");
        }
    }
    let mut v = serde_json::to_value(&r).unwrap_or_default();
    v["backend_reason"] = reason.into();
    save_evidence(cli, &v)?;
    if cli.json {
        print_json(&v);
    }
    Ok(if r.verified { exit::SUCCESS } else { exit::VERIFICATION_FAILED })
}
