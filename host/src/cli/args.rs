//! Command-line definitions (clap derive). Option names are a contract scripts rely on.

use clap::{Args, Parser, Subcommand};
use memattn_cli::device::BackendChoice;
use memattn_cli::dtype::Dtype;
use memattn_cli::problem::{KernelKind, Layout};
use std::path::PathBuf;

/// A non-negative integer option: `-1` is read as a value (not as a flag) and refused with
/// "must be >= 0", so the message says what is wrong with it.
fn non_negative<T: std::str::FromStr>(s: &str) -> Result<T, String> {
    let t = s.trim();
    if let Some(rest) = t.strip_prefix('-') {
        if !rest.is_empty() && rest.chars().all(|c| c.is_ascii_digit() || c == '.' || c == 'e' || c == 'E') {
            return Err(format!("must be >= 0 (got {t})"));
        }
    }
    t.parse::<T>().map_err(|_| format!("`{t}` is not a non-negative integer{}", range_note::<T>()))
}

fn range_note<T>() -> String {
    match std::mem::size_of::<T>() {
        4 => format!(" (at most {})", u32::MAX),
        8 => format!(" (at most {})", u64::MAX),
        _ => String::new(),
    }
}

pub fn non_negative_u32(s: &str) -> Result<u32, String> {
    non_negative(s)
}
pub fn non_negative_u64(s: &str) -> Result<u64, String> {
    non_negative(s)
}
/// `--max-seconds` of `launch` and `trace`: 0 (no limit), or 0.001 to 1000000 seconds (a
/// fraction stops a runaway launch sooner).
pub fn limit_seconds(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(x) if x == 0.0 || (x.is_finite() && (1e-3..=1e6).contains(&x)) => Ok(x),
        _ => Err(format!("`{s}` is not 0 (no limit) or a number of seconds from 0.001 to 1000000")),
    }
}
pub fn non_negative_usize(s: &str) -> Result<usize, String> {
    non_negative(s)
}

const EXAMPLES: &str = "\
Examples:
  memattn compare                                  naive vs flash, verified, memory side by side
  memattn run --kernel flash --seq-q 200 --causal  one verified run (JSON with --json)
  memattn run --inputs qkv.safetensors --output o.safetensors
  memattn compare --vary seq-q=128,256 --kernel flash
  memattn run --dtype bf16 --causal                tensor-core flash kernel, checked against f64
  memattn compare --vary dtype=f32,bf16            the same problem in f32 and bf16 (flash)
  memattn run --heads 8 --heads-kv 2 --window 255,0   GQA with a local window (docs/semantics.md)
  memattn run --sliding-window 256 --softcap 50 --sinks   a model config's sliding_window W = --window W-1,0 --causal
  memattn sweep --vary seq=64,128,256 --plot sweep.svg
  memattn --backend vm --vm-memory-mib 1 sweep --vary seq=128,256 --heads 2
                                                   naive at seq 256 needs over 1 MiB: shown, not run
  memattn doctor                                   GPU, driver, embedded PTX, ptxas, next step
  memattn kernels                                  entry points, parameters, ptxas resources
  memattn trace --kernel flash --thread 5          the instructions one VM thread executes
  memattn plan --layers 32 --heads 32 --heads-kv 8 --head-dim 128 --batch 8 --context 32768 --vram 80GiB
                                                   memory budget of an inference, before anything runs
  memattn --save evidence.jsonl run --seq 128      keep the evidence (every outcome, one JSON line)
  memattn evidence show evidence.jsonl             the runs kept so far
  memattn check --kernel flash --dtype f32 --head-dim 64
                                                   the bug-catching sweep: pass/fail per case (every head dim without --head-dim)
  memattn check --backward --head-dim 64           the same for the backward: every gradient of every case against f64
  memattn draw tiling --seq 200 --causal --out tiling.svg
                                                   the key tiles each block of the flash kernel visits
  memattn decode --heads 32 --heads-kv 8 --cache-len 8192 --sms 132 --vary splits=1,auto
                                                   KV-cache decode: one split vs the split plan for 132 SMs

Exit codes: 0 success, 1 verification failed, 2 bad usage or input, 3 device or kernel error.";

/// Memory-efficient attention kernels written in Rust: run them on a GPU or in the PTX VM, verify
/// every result against an f64 CPU reference, and see how much device memory the fused (flash)
/// kernel saves over the naive one.
#[derive(Debug, Parser)]
#[command(name = "memattn", version, after_help = EXAMPLES, propagate_version = true)]
pub struct Cli {
    /// Where kernels run: `cuda` (a GPU through the CUDA driver), `vm` (the PTX VM on the CPU,
    /// with memcheck and exact memory accounting) or `auto` (CUDA when a driver and a GPU are
    /// present, otherwise the VM; the choice and the reason are printed).
    #[arg(long, global = true, default_value = "auto", value_name = "auto|vm|cuda")]
    pub backend: BackendChoice,

    /// Machine-readable output: one JSON object on stdout (errors too); no tables, no progress bar.
    #[arg(long, global = true)]
    pub json: bool,

    /// Keep the evidence: append one JSON line to FILE for this command, whatever its outcome
    /// (refusals, device errors and failed verifications too): the command line, exit code and
    /// message, the expected state (the analytic bytes or the plan), the observed state (device
    /// memory before, peak, after), the result `--json` prints and the SHA-256 of the PTX that
    /// ran. Appends are locked and whole lines. Read it with `memattn evidence show|diff|rerun`.
    #[arg(long, global = true, value_name = "FILE")]
    pub save: Option<std::path::PathBuf>,

    /// Load kernels from this PTX file instead of the module embedded at build time (try a kernel
    /// change without rebuilding the host: `cargo xtask build-ptx`, then `--ptx path/to.ptx`).
    #[arg(long, global = true, value_name = "FILE")]
    pub ptx: Option<PathBuf>,

    /// CUDA: NVML sampling interval for the peak-memory and utilisation measurement (> 0, at most
    /// 60000).
    #[arg(long, global = true, default_value_t = 1.0, value_name = "MS", allow_negative_numbers = true, value_parser = clap::value_parser!(f64))]
    pub nvml_interval_ms: f64,

    /// VM: simulated device memory in MiB (default: the VM's 16 GiB). A small value shows how
    /// naive attention runs out of memory long before flash does.
    #[arg(long, global = true, value_name = "MIB", allow_negative_numbers = true, value_parser = non_negative_u64)]
    pub vm_memory_mib: Option<u64>,

    /// VM: stop any one launch that runs longer than this many seconds (exit 3, "launch time
    /// limit exceeded"), whatever its grid [default: no limit: a verified run at a large shape
    /// may take minutes]. `launch` and `trace` have their own `--max-seconds` (default 20).
    #[arg(long, global = true, value_name = "S", allow_negative_numbers = true, value_parser = clap::value_parser!(f64))]
    pub vm_max_seconds: Option<f64>,

    /// VM: worker threads (default: all cores; `check` then also runs its cases on two VM
    /// devices side by side).
    #[arg(long, global = true, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_usize)]
    pub vm_workers: Option<usize>,

    /// VM: turn off the shared-memory checks that go beyond bounds and alignment — `initcheck`
    /// (a load of shared bytes no thread has written) and/or `racecheck` (warps touching the same
    /// shared word with no barrier between them). For kernels under development with a race you
    /// know to be benign; the project's own kernels pass both.
    #[arg(long, global = true, value_name = "initcheck,racecheck", value_delimiter = ',')]
    pub vm_allow: Vec<VmCheck>,

    /// VM: the GPU generation the VM models for kernel selection, as a GPU of that compute
    /// capability would pick. `sm_90` runs the `sm_90a` module's kernels where the measured table
    /// picks them (the Hopper forward `flash_fwd_*_sm90_*` for bf16/f16 flash at head dims 128
    /// and 256 without ALiBi, the e4m3 decode; `MEMATTN_HOPPER=1` every one there is, d64
    /// included, `0` none) and raises the shared-memory limit to an H100's 227 KiB; everything
    /// else runs the sm_80 kernels either way.
    #[arg(long, global = true, value_name = "ARCH", default_value = "sm_80", value_parser = parse_vm_arch)]
    pub vm_arch: memattn_cli::problem::Arch,

    /// VM: count the shared-memory bank conflicts of every launch (the wavefronts each shared
    /// `ld`, `st` and `ldmatrix` takes against the minimum, one per phase) and report them with
    /// the worst source lines. Slower; `run` and `launch` show them.
    #[arg(long, global = true)]
    pub vm_bank_conflicts: bool,

    /// VM: count the 32-byte global-memory sectors of every launch (per warp instruction, the
    /// sectors its lanes' bytes lie in) and report the coalescing efficiency, useful bytes /
    /// (32 x sectors), with the worst source lines. Slower; `run` and `launch` show it.
    #[arg(long, global = true)]
    pub vm_sectors: bool,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run one kernel on one problem: verify against the CPU reference, report error, time and
    /// device memory (expected vs measured).
    Run(RunArgs),
    /// Run the same problem several times with exactly one option changed (default: the kernel,
    /// naive vs flash) and print the results side by side with ratios.
    Compare(CompareArgs),
    /// Sweep a range of sequence lengths (or another option) for naive and flash: table, progress
    /// bar and an SVG plot of peak memory and time.
    Sweep(SweepArgs),
    /// Describe the GPU, driver and memory (what nvidia-smi would show) or why there is none, the
    /// loaded PTX, whether ptxas is available, and what to check next.
    Doctor,
    /// List the kernels in the loaded PTX with their parameters and ptxas resources.
    Kernels,
    /// VM only: print the instructions one thread of one kernel executes, with the Rust line each
    /// comes from and the registers it writes in the instruction's type (for learning how the
    /// kernel works). Its default problem is smaller than `run`'s: heads 1 and seq 64 unless
    /// given (the defaults listed below are `run`'s). A VM finding keeps the trace up to it.
    Trace(TraceArgs),
    /// The memory budget of an inference workload before anything runs: weights, KV cache,
    /// attention workspace (naive vs flash), largest activation, against the device memory; the
    /// largest batch and longest context that fit and the one option that changes the outcome most.
    #[command(after_help = PLAN_EXAMPLES)]
    Plan(PlanArgs),
    /// Read the evidence file of `--save`: a table of the runs, what one change did, or repeat a run.
    #[command(subcommand)]
    Evidence(EvidenceCommand),
    /// VM only: launch any entry point of the loaded PTX (`--ptx FILE`, or the embedded module)
    /// with named buffers and typed arguments, and print the buffers afterwards. Findings name
    /// the Rust line and the buffer. Example: `memattn launch saxpy_f32 --grid 4 --block 256
    /// --buf x=f32:1000:iota --buf y=f32:1000:zeros --arg u32=1000 --arg f32=2 --arg buf=x
    /// --arg buf=y --show y`.
    Launch(LaunchArgs),
    /// For kernel authors: a fixed sweep of the shapes that catch the usual bugs (tails that are
    /// not tile multiples, fully masked causal rows, seq 1, several blocks/heads/batches,
    /// BSHD/BHSD, GQA ratios 1/4/8, windows crossing tile edges, soft cap and sinks, varlen with an
    /// empty and a length-1 sequence) for one kernel family and dtype, every row checked against
    /// the f64 reference; prints a pass/fail table, exits 1 on a failed case (3 if a case hit a
    /// device or kernel error). `--backward`: the same for the backward (forward and backward per
    /// case, O, LSE, dq, dk, dv and d_sinks against the f64 gradients).
    Check(CheckArgs),
    /// KV-cache decode: split-KV attention over a contiguous or paged cache with GQA and cache
    /// append, verified against the f64 reference, with the split plan and the memory figures.
    Decode(super::decode::DecodeArgs),
    /// Draw a picture (SVG) computed from the kernels' own constants and functions: `tiling` (the
    /// key tiles each block visits under a causal or window mask), `online-softmax` (one row's
    /// running max, sum and rescales over its key tiles), `fragment` (which lane holds which
    /// element of an `mma.sync.m16n8k16`), `swizzle` (the bank group of each shared-memory
    /// chunk, without and with the XOR swizzle), `execution-model` (grid, blocks, warps, lanes and
    /// SMs of one launch), `memory` (registers, shared memory, L2 and HBM and what a flash kernel
    /// keeps in each) or `flash-dataflow` (one block's tiles through them); `--lang de` labels it
    /// in German. `memattn draw --help` lists each picture's options.
    Draw(super::draw::DrawArgs),
}

const PLAN_EXAMPLES: &str = "\
Examples:
  memattn plan --config host/tests/fixtures/configs/llama-3-8b.json --batch 8 --context 32768 --vram 80GiB
                           the KV cache dominates; the one option that changes the outcome most
  memattn plan --layers 32 --heads 32 --heads-kv 8 --head-dim 128 --batch 8 --context 32768 --vram 80GiB
                           the same attention from flags (weights not counted without --hidden ...)
  memattn plan --config host/tests/fixtures/configs/llama-3-8b.json --batch 8 --context 32768 --vram 80GiB --kv-dtype fp8
                           one option changed: the KV cache halves
  memattn plan --config host/tests/fixtures/configs/mistral-7b-v0.1.json --batch 1 --context 8192 --verify
                           one layer's attention, scaled down, in the VM: expected = measured
  memattn plan --config host/tests/fixtures/configs/llama-3-8b.json --batch 8 --context 32768 --vram 80GiB --plot plan.png
                           memory against context, stacked, with the limit line

Exit codes: 0 it fits (or was planned), 1 --verify measured other bytes than planned, 2 bad input or it
does not fit even at batch 1 (the message names the term and the bytes).";

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// A Hugging Face config.json (num_hidden_layers, num_attention_heads, num_key_value_heads,
    /// head_dim, hidden_size, intermediate_size, vocab_size, sliding_window, torch_dtype,
    /// tie_word_embeddings). Flags given as well override its values.
    #[arg(long, value_name = "config.json")]
    pub config: Option<PathBuf>,
    /// Decoder layers.
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub layers: Option<u32>,
    /// Query heads per layer.
    #[arg(long, value_name = "H", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub heads: Option<u32>,
    /// Key/value heads per layer (grouped-query attention; must divide --heads) [default: --heads].
    #[arg(long, value_name = "H", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub heads_kv: Option<u32>,
    /// Head dimension.
    #[arg(long, value_name = "D", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub head_dim: Option<u32>,
    /// Model width (with --intermediate and --vocab: weights and activations are counted).
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub hidden: Option<u32>,
    /// MLP width.
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub intermediate: Option<u32>,
    /// Vocabulary size.
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub vocab: Option<u32>,
    /// Input and output embeddings share one matrix.
    #[arg(long)]
    pub tied_embeddings: bool,
    /// A sliding window of N tokens on every layer (the KV cache of a layer holds at most N).
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub sliding_window: Option<u32>,
    /// Weights and activations: f32, bf16, f16, fp8 [default: the config's torch_dtype, else bf16].
    #[arg(long, value_name = "TYPE")]
    pub dtype: Option<String>,
    /// KV cache element type [default: --dtype].
    #[arg(long, value_name = "TYPE")]
    pub kv_dtype: Option<String>,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 1, value_name = "B", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub batch: u32,
    /// Tokens each sequence holds in the KV cache (prompt + generated so far).
    #[arg(long, value_name = "TOKENS", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub context: u32,
    /// Query tokens of the forward step planned: 1 for a decode step, the prompt length for a prefill.
    #[arg(long, default_value_t = 1, value_name = "T", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub new_tokens: u32,
    /// Attention kernel whose workspace counts in the total [default: flash]; both are shown.
    #[arg(long, value_name = "naive|flash")]
    pub kernel: Option<KernelKind>,
    /// A paged KV cache with pages of N tokens (each sequence's cache rounds up to whole pages).
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub page: Option<u32>,
    /// Device memory to plan against, e.g. 80GiB, 24GB [default: free memory of the device].
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub vram: Option<String>,
    /// Context parallelism over N devices (the sequence split, ring or zigzag; the weights on
    /// every device): the memory per device (its slice of the KV cache, the ring's two K/V
    /// blocks of one layer in flight, the f32 merge state of its query rows, its share of the
    /// activations) and the smallest N at which the workload fits. Exit 0 when it fits on N.
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub cp: Option<u32>,
    /// Run the attention part of one layer, scaled down, in the VM (naive and flash) and show
    /// that the measured bytes equal the planned ones.
    #[arg(long)]
    pub verify: bool,
    /// Draw memory against context length (weights, KV cache, workspace stacked; naive and
    /// flash; the limit) to FILE.svg or FILE.png.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum EvidenceCommand {
    /// A table of the runs in an evidence file (one JSON line each), numbered by line.
    Show {
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
    /// What changed between runs A and B (options) and what that did to memory, time, error and
    /// exit code: the "one change, same measurement" comparison.
    Diff {
        #[arg(value_name = "FILE")]
        file: PathBuf,
        #[arg(value_name = "A", allow_negative_numbers = true, value_parser = non_negative_usize)]
        a: usize,
        #[arg(value_name = "B", allow_negative_numbers = true, value_parser = non_negative_usize)]
        b: usize,
    },
    /// Repeat run N's exact command line (appending to the evidence file when it had --save) and
    /// compare the new result with run N: the proof that a fix works, or the way back.
    Rerun {
        #[arg(value_name = "FILE")]
        file: PathBuf,
        #[arg(value_name = "N", allow_negative_numbers = true, value_parser = non_negative_usize)]
        n: usize,
        /// Run the record even though its command line writes files (`--output`, `--save`,
        /// `--plot`): without it such a record is refused, so a replayed line cannot replace or
        /// append to a file.
        #[arg(long)]
        allow_writes: bool,
    },
}

/// The attention problem. Unset options take the defaults shown (or the shape of `--inputs`).
#[derive(Debug, Clone, Args, Default)]
pub struct ProblemArgs {
    /// Batch size [default: 1].
    #[arg(long, value_name = "B", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub batch: Option<u32>,
    /// Attention heads [default: 4].
    #[arg(long, value_name = "H", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub heads: Option<u32>,
    /// Query sequence length [default: 256].
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub seq_q: Option<u32>,
    /// Key/value sequence length [default: --seq-q].
    #[arg(long, value_name = "M", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub seq_kv: Option<u32>,
    /// Sets both --seq-q and --seq-kv.
    #[arg(long, value_name = "N", conflicts_with_all = ["seq_q", "seq_kv"], allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub seq: Option<u32>,
    /// Head dimension [default: 64]. Flash kernels exist for 32, 64, 96, 128, 192 and 256 in every
    /// dtype (`memattn kernels` lists them with their tiles); any other multiple of 8 up to 256
    /// runs on the next of them with its head dim padded (40 on the 64 kernel, nothing copied);
    /// naive accepts 1..=256.
    #[arg(long, value_name = "D", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub head_dim: Option<u32>,
    /// Element type of Q, K, V, O [default: f32, or the dtype of --inputs]. With bf16 and f16, flash
    /// runs the tensor-core kernels (sm_80+; f32 accumulation, LSE f32) and naive keeps its score
    /// matrix in f32. Random inputs are drawn in f32 and rounded to the dtype; the f64 reference
    /// uses the rounded values.
    #[arg(long, value_name = "f32|bf16|f16")]
    pub dtype: Option<Dtype>,
    /// Causal mask, bottom-right aligned: query i sees key j iff j <= i + seq_kv - seq_q (the
    /// window's right side set to 0). Semantics of every option: docs/semantics.md.
    #[arg(long)]
    pub causal: bool,
    /// K/V heads for grouped-query (GQA) or multi-query (MQA, 1) attention [default: --heads].
    /// Must divide --heads; query head h reads K/V head h / (heads / heads_kv). Example: --heads 32
    /// --heads-kv 8 (Llama-3 8B).
    #[arg(long, value_name = "N")]
    pub heads_kv: Option<u32>,
    /// Local attention window L,R (FlashAttention-2 convention, -1 = unbounded, bottom-right
    /// aligned): query i sees key j iff i + seq_kv - seq_q - L <= j <= i + seq_kv - seq_q + R.
    /// --causal sets R = 0. Example: --window 4095,0 (each query sees itself and 4095 keys before).
    #[arg(long, value_name = "L,R", allow_hyphen_values = true, conflicts_with = "sliding_window")]
    pub window: Option<String>,
    /// A model config's `sliding_window = W` (Mistral, HF): shorthand for --window W-1,0 --causal.
    /// Note the off-by-one: W counts the query itself, so the left side is W - 1.
    #[arg(long, value_name = "W")]
    pub sliding_window: Option<u32>,
    /// Logit soft cap C (Gemma-2: 50): scores become C * tanh(scale * q.k / C) [default: 0 = off].
    #[arg(long, value_name = "C", allow_negative_numbers = true)]
    pub softcap: Option<f32>,
    /// Attention sinks (gpt-oss): one f32 logit per query head joins the softmax denominator only,
    /// O = sum_j e^(s_j - m) v_j / (e^(sink - m) + sum_j e^(s_j - m)). Random logits (normal + 1,
    /// from --seed), or the `sinks` tensor [heads] F32 of --inputs.
    #[arg(long)]
    pub sinks: bool,
    /// ALiBi (BLOOM, MPT; FlashAttention-2's alibi_slopes): the score of query i and key j gains
    /// -slope_h * |i + seq_kv - seq_q - j| after the soft cap, with the ALiBi paper's slopes for
    /// --heads (2^(-8h/n), h = 1..n, for n a power of two). Forward only (not --backward, --cp).
    #[arg(long)]
    pub alibi: bool,
    /// Varlen batch: the query length of each packed sequence (the batch is their count), e.g.
    /// 100,37,0,512; Q and O are [total_q, heads, d], LSE [heads, total_q]; masks and windows apply
    /// per sequence, bottom-right aligned within each. Empty sequences produce nothing.
    #[arg(long, value_name = "N,N,...", value_delimiter = ',', allow_hyphen_values = true, value_parser = non_negative_u32, conflicts_with_all = ["batch", "seq", "seq_q", "seq_kv"])]
    pub seqlens_q: Option<Vec<u32>>,
    /// Varlen: the key/value length of each sequence [default: --seqlens-q].
    #[arg(long, value_name = "M,M,...", value_delimiter = ',', allow_hyphen_values = true, value_parser = non_negative_u32, requires = "seqlens_q")]
    pub seqlens_kv: Option<Vec<u32>>,
    /// Softmax scale [default: 1/sqrt(head_dim)].
    #[arg(long, value_name = "S", allow_negative_numbers = true)]
    pub scale: Option<f32>,
    /// Device layout of Q, K, V, O: bshd = [batch, seq, heads, d], bhsd = [batch, heads, seq, d]
    /// [default: bshd]. Files are always [batch, seq, heads, d].
    #[arg(long, value_name = "bshd|bhsd")]
    pub layout: Option<Layout>,
    /// Seed of the random (standard normal) inputs and of the sampled reference rows.
    #[arg(long, default_value_t = 0, value_name = "SEED", allow_negative_numbers = true, value_parser = non_negative_u64)]
    pub seed: u64,
    /// Untimed launches before timing [default: 3 on a GPU, 0 in the VM and on the VM-backed
    /// CUDA driver; at most 1000000].
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub warmup: Option<u32>,
    /// Timed repetitions; the median is reported [default: 10 on a GPU, 1 in the VM and on the
    /// VM-backed CUDA driver; at most 1000000].
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub repeats: Option<u32>,
    /// Query rows checked against the reference: `all`, a number (seeded random sample), or
    /// `auto` (all when the reference costs under 2^28 multiply-adds, else a sample). With
    /// `--backward`: whole (batch, KV head) slices holding at least N rows; `auto` samples past
    /// 2^34 multiply-adds.
    #[arg(long, value_name = "all|N|auto", default_value = "auto", allow_negative_numbers = true)]
    pub check_rows: String,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// naive (scores, softmax, P·V with the score matrix in memory) or flash (fused) [default: flash].
    #[arg(long, value_name = "naive|flash")]
    pub kernel: Option<KernelKind>,
    #[command(flatten)]
    pub problem: ProblemArgs,
    /// Read q, k, v ([batch, seq, heads, head_dim], F32, BF16 or F16) from a .safetensors file
    /// instead of random inputs; the shape comes from the file, and so does the dtype unless
    /// --dtype is given (then the file must match it). A regular file (at most 64 GiB); NaN or
    /// inf values are refused.
    #[arg(long, value_name = "FILE.safetensors")]
    pub inputs: Option<PathBuf>,
    /// Write o ([batch, seq_q, heads, head_dim], in the run's dtype) and lse ([batch, heads, seq_q],
    /// f32) to this file, only when the result verified, atomically (a temporary file renamed
    /// over it). Checked before the run: writable, and not --inputs, --ptx or the --save file.
    #[arg(long, value_name = "FILE.safetensors")]
    pub output: Option<PathBuf>,
    /// A timeline of every warp: the forward runs from the timeline build of the kernels
    /// (every warp stamps a clock at each phase: prologue, wait K/V, barrier, load K/V, QK^T,
    /// softmax, PV, epilogue) and this file gets a Chrome trace of the stamps (one process per
    /// block, one thread per warp; open it in Perfetto), FILE with .svg a picture (one row per
    /// warp, a coloured bar per phase). The clock is %globaltimer on a GPU (ts in µs) and the
    /// warp's executed instructions in the VM (ts in instructions). The flash forward at bf16
    /// or f16, head_dim 128, no narrow window; on Hopper it runs the sm_80 forward. The output
    /// is still verified (exit 0 only if it did). See docs/timeline.md.
    #[arg(long, value_name = "FILE.json")]
    pub timeline: Option<PathBuf>,
    /// The picture of --timeline (.svg or .png) [default: the --timeline file with .svg].
    #[arg(long, value_name = "FILE.svg|FILE.png", requires = "timeline")]
    pub timeline_picture: Option<PathBuf>,
    #[command(flatten)]
    pub backward: super::run::BackwardArgs,
    #[command(flatten)]
    pub cp: super::cp::CpArgs,
}

#[derive(Debug, Args)]
pub struct CompareArgs {
    /// The option to vary and its values: kernel, dtype, batch, heads, seq (both lengths), seq-q,
    /// seq-kv, head-dim, causal, layout, heads-kv, window (L:R pairs, e.g. window=255:0,-1:0),
    /// sliding-window, softcap, sinks (true/false), seqlens-q and seqlens-kv (lengths joined by
    /// `:`, e.g. seqlens-q=100:37:512,64:64).
    #[arg(long, default_value = "kernel=naive,flash", value_name = "KEY=A,B[,C...]")]
    pub vary: String,
    /// Kernel for the runs when --vary is not `kernel` [default: flash].
    #[arg(long, value_name = "naive|flash")]
    pub kernel: Option<KernelKind>,
    /// Compare the backward instead: the naive backward (P and dS materialised, N x N f32 per
    /// head each) against the flash backward (P recomputed from LSE; workspace the f32 dQ
    /// accumulator and D = rowsum(dO * O), O(N*d)) on one problem, each after its own forward
    /// (naive after the naive forward, whose score matrix is freed first), both verified against
    /// the f64 reference gradients (the rule of `run --backward`). The table shows the expected
    /// bytes before and the measured peak after, and the time of each backward. f32 only; the
    /// naive side does not compute d_sinks. Only --vary kernel=naive,flash (the default).
    ///
    /// Example: memattn compare --backward --heads 4 --seq 256
    #[arg(long)]
    pub backward: bool,
    #[command(flatten)]
    pub problem: ProblemArgs,
}

#[derive(Debug, Args)]
pub struct SweepArgs {
    /// The option to sweep and its values [default: seq=64,128,256 in the VM,
    /// seq=1024,2048,4096,8192,16384 on CUDA].
    #[arg(long, value_name = "KEY=A,B[,C...]")]
    pub vary: Option<String>,
    /// Kernels run at every point [default: naive,flash].
    #[arg(long, value_name = "LIST")]
    pub kernels: Option<String>,
    /// Where to write the plot: FILE.svg or FILE.png (memory with the device limit, and time);
    /// written only when the sweep verified, atomically; checked before the sweep like --output.
    #[arg(long, default_value = "memattn-sweep.svg", value_name = "FILE.svg|FILE.png")]
    pub plot: PathBuf,
    /// Do not write a plot.
    #[arg(long)]
    pub no_plot: bool,
    /// Also show the bytes each kernel's threads read from and wrote to global memory in one
    /// run (VM only: every load and store counted once per thread, no cache model). The naive
    /// kernels write and read back the N×N scores; flash writes only O and the LSE.
    #[arg(long)]
    pub bytes: bool,
    #[command(flatten)]
    pub problem: ProblemArgs,
}

#[derive(Debug, Args)]
pub struct TraceArgs {
    /// naive or flash [default: flash].
    #[arg(long, value_name = "naive|flash")]
    pub kernel: Option<KernelKind>,
    /// Naive only: which of its three launches to trace [default: scores]. Flash is one launch,
    /// so `--step` with flash is refused.
    #[arg(long, value_name = "scores|softmax|pv")]
    pub step: Option<String>,
    /// Block index x[,y[,z]].
    #[arg(long, default_value = "0", value_name = "X[,Y[,Z]]", allow_negative_numbers = true)]
    pub block: String,
    /// Thread index x[,y[,z]] within the block.
    #[arg(long, default_value = "0", value_name = "X[,Y[,Z]]", allow_negative_numbers = true)]
    pub thread: String,
    /// Stop recording after this many instructions (an instruction that makes a VM finding is
    /// always shown, after a gap if the trace stopped before it).
    #[arg(long, default_value_t = 400, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_usize)]
    pub max_entries: usize,
    /// Show only instructions on these PTX lines (the first column), e.g. `--lines 9200-9260`.
    #[arg(long, value_name = "A-B")]
    pub lines: Option<String>,
    /// Show only instructions whose opcode starts with this, e.g. `--op mma`, `--op ld.shared`.
    #[arg(long, value_name = "OPCODE")]
    pub op: Option<String>,
    #[command(flatten)]
    pub problem: ProblemArgs,
    #[command(flatten)]
    pub own: super::trace::EntryArgs,
}

#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// The entry point (`memattn kernels` lists them).
    #[arg(value_name = "KERNEL")]
    pub kernel: String,
    /// Grid size x[,y[,z]].
    #[arg(long, default_value = "1", value_name = "X[,Y[,Z]]", allow_hyphen_values = true)]
    pub grid: String,
    /// Block size x[,y[,z]].
    #[arg(long, default_value = "1", value_name = "X[,Y[,Z]]", allow_hyphen_values = true)]
    pub block: String,
    /// Dynamic shared memory in bytes.
    #[arg(long, default_value_t = 0, value_name = "BYTES", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub smem: u32,
    /// A device buffer: NAME=TYPE:LEN[:INIT], TYPE f32 or u32, INIT poison (default: the NaN
    /// 0x7FF00BAD, so unwritten elements show), zeros, iota (0, 1, 2, ...), randn (seeded) or
    /// const=V. Repeatable.
    #[arg(long, value_name = "NAME=TYPE:LEN[:INIT]")]
    pub buf: Vec<String>,
    /// A kernel argument, in the order of the kernel's parameters: u32=V, i32=V, f32=V, u64=V
    /// or buf=NAME (the buffer's address). Repeatable.
    #[arg(long, value_name = "TYPE=VALUE", allow_hyphen_values = true)]
    pub arg: Vec<String>,
    /// Buffers to print after the launch [default: all]. Repeatable.
    #[arg(long, value_name = "NAME")]
    pub show: Vec<String>,
    /// Elements printed per buffer.
    #[arg(long, default_value_t = 16, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_usize)]
    pub count: usize,
    /// Seed of `randn` buffers.
    #[arg(long, default_value_t = 0, value_name = "SEED", allow_negative_numbers = true, value_parser = non_negative_u64)]
    pub seed: u64,
    /// Stop the launch after this many seconds (fractions allowed, e.g. 0.5): a kernel that
    /// never ends (an endless loop, a grid of billions of blocks) is reported as a hang (exit 3)
    /// instead of running on. 0: no limit.
    #[arg(long, default_value_t = 20.0, value_name = "SECONDS", allow_negative_numbers = true, value_parser = limit_seconds)]
    pub max_seconds: f64,
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    /// naive or flash [default: flash].
    #[arg(long, value_name = "naive|flash")]
    pub kernel: Option<KernelKind>,
    /// f32, bf16 or f16 [default: f32].
    #[arg(long, value_name = "f32|bf16|f16")]
    pub dtype: Option<Dtype>,
    /// Only this head dim [default: every flash head dim of the dtype, for naive too].
    #[arg(long, value_name = "D", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub head_dim: Option<u32>,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 0, value_name = "SEED", allow_negative_numbers = true, value_parser = non_negative_u64)]
    pub seed: u64,
    /// Sweep the backward instead: each case runs the forward and the backward (as `run
    /// --backward`) and checks O, LSE, dq, dk, dv (and d_sinks) against the f64 reference
    /// gradients, every element: lengths that are not tile multiples, seq_q > seq_kv causal
    /// (rows that see no key), length 1, several blocks, heads and batches, BHSD, GQA and MQA,
    /// windows, soft cap, sinks with d_sinks, deterministic dQ (two repetitions, same bits),
    /// varlen with an empty sequence, at every head dim the backward kernels of the dtype are
    /// compiled for. f32: 2e-5 of each tensor's scale. bf16/f16 (once the library has a
    /// backward in them; until then exit 2): each tensor, whole and per row, at most twice the
    /// error of a naive backward in the same dtype. Flash only.
    #[arg(long)]
    pub backward: bool,
    /// Large shapes instead of the sweep, in the VM (about 20 s on two cores): f32, bf16
    /// and f16 flash at seq 32768 (causal, GQA, a 4096-key window) as sampled launches that run
    /// only the query blocks of the checked rows, and a bf16 paged decode over 65536 cached
    /// tokens, all verified against the f64 reference. Catches what small shapes cannot: index
    /// arithmetic past their range, split plans over long caches, window tiles far from the
    /// first key. `--seed` picks the inputs and the checked rows.
    #[arg(long)]
    pub large: bool,
    /// bf16/f16: also fail (exit 1) when the worst case's max error exceeds R times that of
    /// naive attention computed in the same dtype on the same inputs (the "err/naive" column;
    /// FlashAttention's own rule allows 2, which every case must meet anyway). Set R a little
    /// above today's worst so that an accuracy loss shows before it reaches the bound, e.g.
    /// `memattn check --dtype f16 --max-error-ratio 1.5`.
    #[arg(long, value_name = "R", allow_negative_numbers = true, value_parser = positive_ratio)]
    pub max_error_ratio: Option<f64>,
}

/// A finite ratio above 0 (`--max-error-ratio`).
fn positive_ratio(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        Ok(v) => Err(format!("must be a finite number above 0, got {v}")),
        Err(_) => Err(format!("must be a number above 0 (e.g. 1.5), got '{s}'")),
    }
}

/// A VM shared-memory check `--vm-allow` can turn off.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum VmCheck {
    Initcheck,
    Racecheck,
}

fn parse_vm_arch(s: &str) -> Result<memattn_cli::problem::Arch, String> {
    match s.to_ascii_lowercase().trim_start_matches("sm_").trim_start_matches("sm") {
        "80" => Ok(memattn_cli::problem::Arch::Sm80),
        "90" | "90a" => Ok(memattn_cli::problem::Arch::Sm90),
        _ => Err(format!("unknown VM arch `{s}` (expected sm_80 or sm_90)")),
    }
}
