//! Command-line definitions (clap derive). Option names are a contract scripts rely on.

use clap::{Args, Parser, Subcommand};
use memattn::device::BackendChoice;
use memattn::dtype::Dtype;
use memattn::problem::{KernelKind, Layout};
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
fn non_negative_usize(s: &str) -> Result<usize, String> {
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
  memattn sweep --vary seq=64,128,256 --plot sweep.svg
  memattn --backend vm --vm-memory-mib 64 sweep   naive runs over 64 MiB show what they would need
  memattn doctor                                   GPU, driver, embedded PTX, ptxas, next step
  memattn kernels                                  entry points, parameters, ptxas resources
  memattn trace --kernel flash --thread 5          the instructions one VM thread executes
  memattn decode --heads 32 --heads-kv 8 --cache-len 8192 --vary splits=1,auto   KV-cache decode

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

    /// Keep the evidence: append this command's result (the same object `--json` prints, plus
    /// the command line, the time and the PTX hash) as one JSON line to FILE. Use one file for a
    /// whole investigation: observe (`doctor`), change one option, repeat the same measurement.
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

    /// VM: worker threads (default: all cores).
    #[arg(long, global = true, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_usize)]
    pub vm_workers: Option<usize>,

    /// VM: turn off the shared-memory checks that go beyond bounds and alignment — `initcheck`
    /// (a load of shared bytes no thread has written) and/or `racecheck` (warps touching the same
    /// shared word with no barrier between them). For kernels under development with a race you
    /// know to be benign; the project's own kernels pass both.
    #[arg(long, global = true, value_name = "initcheck,racecheck", value_delimiter = ',')]
    pub vm_allow: Vec<VmCheck>,

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
    /// VM only: print the instructions one thread of one kernel executes, with the registers it
    /// writes (for learning how the kernel works).
    Trace(TraceArgs),
    /// KV-cache decode: split-KV attention over a contiguous or paged cache with GQA and cache
    /// append, verified against the f64 reference, with the split plan and the memory figures.
    Decode(super::decode::DecodeArgs),
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
    /// Head dimension [default: 64]. Flash kernels exist for 64 and 128; naive accepts 1..=256.
    #[arg(long, value_name = "D", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub head_dim: Option<u32>,
    /// Element type of Q, K, V, O [default: f32, or the dtype of --inputs]. With bf16 and f16, flash
    /// runs the tensor-core kernels (sm_80+; f32 accumulation, LSE f32) and naive keeps its score
    /// matrix in f32. Random inputs are drawn in f32 and rounded to the dtype; the f64 reference
    /// uses the rounded values.
    #[arg(long, value_name = "f32|bf16|f16")]
    pub dtype: Option<Dtype>,
    /// Causal mask, bottom-right aligned: query i sees key j iff j <= i + seq_kv - seq_q.
    #[arg(long)]
    pub causal: bool,
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
    /// Untimed launches before timing [default: 3 on CUDA, 0 in the VM; at most 1000000].
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub warmup: Option<u32>,
    /// Timed repetitions; the median is reported [default: 10 on CUDA, 1 in the VM; at most
    /// 1000000].
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = non_negative_u32)]
    pub repeats: Option<u32>,
    /// Query rows checked against the reference: `all`, a number (seeded random sample), or
    /// `auto` (all when the reference costs under 2^28 multiply-adds, else a sample).
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
}

#[derive(Debug, Args)]
pub struct CompareArgs {
    /// The option to vary and its values: kernel, dtype, batch, heads, seq (both lengths), seq-q,
    /// seq-kv, head-dim, causal, layout.
    #[arg(long, default_value = "kernel=naive,flash", value_name = "KEY=A,B[,C...]")]
    pub vary: String,
    /// Kernel for the runs when --vary is not `kernel` [default: flash].
    #[arg(long, value_name = "naive|flash")]
    pub kernel: Option<KernelKind>,
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
    /// Where to write the plot (SVG): only when the sweep verified, atomically; checked before
    /// the sweep like --output.
    #[arg(long, default_value = "memattn-sweep.svg", value_name = "FILE.svg")]
    pub plot: PathBuf,
    /// Do not write a plot.
    #[arg(long)]
    pub no_plot: bool,
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
    /// Trace problem [default: heads 1, seq 64 — smaller than `run`'s heads 4, seq 256, which
    /// the trace prints when it differs].
    #[command(flatten)]
    pub problem: ProblemArgs,
}

/// A VM shared-memory check `--vm-allow` can turn off.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum VmCheck {
    Initcheck,
    Racecheck,
}
