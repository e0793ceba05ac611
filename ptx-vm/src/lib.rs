//! `ptx-vm`: a PTX virtual machine with always-on memcheck.
//!
//! The package is `memattn-ptx-vm` (the folder `ptx-vm/`; memattn's own crates import it under
//! the name `ptx_vm`, as the contract below does).
//!
//! It runs the exact PTX that `cargo xtask build-ptx` produces, with the grid, block, dynamic
//! shared memory and parameter bytes the CUDA driver would get.
//!
//! API CONTRACT (the host crate `memattn` codes against these signatures; keep them stable):
//!
//! ```ignore
//! let module = ptx_vm::Module::load(ptx_text)?;              // LoadError names the PTX line
//! let shared = ptx_vm::Module::shared(ptx_text)?;            // Arc<Module>, parsed once per process
//! let mut vm = ptx_vm::Vm::new();                            // workers = available cores
//! let x = vm.alloc(4 * n)?;                                  // device address (u64, non-zero)
//! vm.write(x, bytemuck_bytes)?;  vm.read(x, &mut out)?;      // host <-> device copies
//! let stats = vm.launch(&module, "saxpy_f32", &LaunchConfig::new(grid, block, smem), &params)?;
//! vm.memory();                                              // MemStats { current, peak, .. }
//! vm.free(x)?;
//! ```
//!
//! Also: [`run::Launcher`] (any entry point with named buffers and typed arguments),
//! [`TensorMap`] (the 128 bytes a `CUtensorMap` is in the VM: `cuTensorMapEncodeTiled` is
//! [`TensorMap::from_cuda_tiled`] then [`TensorMap::encode`]),
//! [`Vm::set_label`] (findings name the buffer), [`Module::source_of`] (PTX line -> Rust line),
//! [`Vm::take_trace`] (the trace of a launch that stopped at a finding).

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

mod banks;
mod decode;
mod exec;
mod fuse;
pub mod hopper;
mod ir;
mod memcheck;
mod memory;
mod num;
mod ops;
mod parse;
mod regalloc;
mod reginit;
pub mod run;
mod sectors;
mod source;
pub mod swizzle;
mod tensor_core;
#[cfg(feature = "unit-tests")]
mod test_params;
mod wgmma;

/// The unit tests, for `ptx-vm-tests` to run (its test `unit`); not an API.
#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod unit_tests {
    pub use crate::banks::tests as banks;
    pub use crate::exec::tests as exec;
    pub use crate::hopper::tests as hopper;
    pub use crate::memcheck::tests as memcheck;
    pub use crate::num::tests as num;
    pub use crate::parse::tests as parse;
    pub use crate::regalloc::tests as regalloc;
    pub use crate::reginit::tests as reginit;
    pub use crate::sectors::tests as sectors;
    pub use crate::source::tests as source;
    pub use crate::swizzle::tests as swizzle;
    pub use crate::tensor_core::tests as tensor_core;
    pub use crate::wgmma::tests as wgmma;
}

pub use exec::SHARED_POISON;
pub use hopper::{OobFill, TensorDataType, TensorMap};
pub use source::SourceLoc;

/// A device address in the VM's global memory (never 0 for a live allocation).
pub type DevPtr = u64;

/// Error while loading a module: the PTX line (1-based) and what is wrong there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadError {
    pub line: usize,
    pub message: String,
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PTX line {}: {}", self.line, self.message)
    }
}
impl std::error::Error for LoadError {}

/// One kernel parameter as declared in PTX.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamInfo {
    pub name: String,
    /// Byte offset in the packed parameter buffer (each parameter aligned to `align`).
    pub offset: usize,
    pub size: usize,
    pub align: usize,
    /// The declared type, as written (`.u64`, `.b8[176]`, `.f32`, ...).
    pub ty: String,
}

/// An `.entry` of a loaded module.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelInfo {
    pub name: String,
    pub params: Vec<ParamInfo>,
    /// Total size of the packed parameter buffer `launch` expects.
    pub param_bytes: usize,
    /// Static `.shared` bytes the kernel declares (dynamic shared memory comes at launch).
    pub static_shared_bytes: usize,
    /// `.local` bytes per thread.
    pub local_bytes: usize,
    /// Number of decoded instructions (including those of called functions).
    pub instructions: usize,
    /// First PTX line of the entry.
    pub line: usize,
}

/// A parsed PTX module whose entries are decoded into runnable programs once each: all of them
/// at [`Module::load`], or each on first use (its first launch or [`Module::kernel`] query) when
/// the module came from [`Module::load_lazy`] or [`Module::shared`].
///
/// Either way an unsupported opcode or modifier is a `LoadError` before any thread of the entry
/// runs (a launch of an entry that does not decode returns [`VmError::Load`]), never a failure
/// half-way through a launch; [`Module::check_all`] decodes every entry of a lazy module.
///
/// A module is immutable once loaded apart from those per-entry caches, and `Sync`: one
/// `Arc<Module>` may be launched by any number of [`Vm`]s, also from several threads at once.
/// Each `Vm` instantiates the module's `.global`/`.const` variables in its own memory (at the
/// module's window, which the module's `id` picks), so VMs sharing a module share no memory.
pub struct Module {
    id: u64,
    version: String,
    target: String,
    ast: parse::ModuleAst,
    func_index: decode::HashMap<String, usize>,
    entries: Vec<Entry>,
    by_name: HashMap<String, usize>,
    globals: decode::Globals,
    /// PTX line -> Rust line: built with the module, or on first use when the text lives as
    /// long as the process ([`Module::shared_static`]: a run without findings or traces never
    /// needs it).
    sources: OnceLock<source::SourceMap>,
    static_text: Option<&'static str>,
}

/// One `.entry` and its program, decoded on first use.
struct Entry {
    /// Index in `ast.funcs`.
    func: usize,
    program: OnceLock<Result<ir::Program, LoadError>>,
}

static NEXT_MODULE: AtomicU64 = AtomicU64::new(0);
static PARSES: AtomicU64 = AtomicU64::new(0);

/// Modules [`Module::shared`] keeps alive although nobody holds them (the most recent first
/// used): the committed module stays loaded for the whole process while a program that loads
/// many different texts keeps only a few of them.
const SHARED_KEEP: usize = 4;

struct SharedCache {
    /// Every module loaded through `shared` that is still alive somewhere, by SHA-256 of its text
    /// or, for a text that lives as long as the process, by its address and length.
    live: HashMap<SharedKey, Weak<Module>>,
    /// Strong references to the last `SHARED_KEEP` distinct modules `shared` returned.
    recent: VecDeque<Arc<Module>>,
}

/// What [`Module::shared`] and [`Module::shared_static`] key their modules by.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum SharedKey {
    Digest([u8; 32]),
    Static(usize, usize),
}

impl Module {
    /// Parses `ptx` and decodes every entry: any `LoadError` the module has comes back here.
    pub fn load(ptx: &str) -> Result<Module, LoadError> {
        let m = Module::load_lazy(ptx)?;
        m.check_all()?;
        Ok(m)
    }

    /// Parses `ptx`'s top level and lays out its globals; each entry is parsed and decoded on
    /// its first launch or [`Module::kernel`] query (then an error in its code is a
    /// [`VmError::Load`] or a `None`), or all at once by [`Module::check_all`]. Syntax errors
    /// outside function bodies, and a body that never closes, come back here. Function bodies
    /// are found by matching braces and are not lexed here, so a module of many kernels loads
    /// in the time of a byte scan.
    pub fn load_lazy(ptx: &str) -> Result<Module, LoadError> {
        let mut m = Module::parse_only(ptx)?;
        m.sources = OnceLock::from(source::SourceMap::build(ptx));
        Ok(m)
    }

    /// [`Module::load_lazy`] without the source map, which is built on first use from `text`
    /// when that lives as long as the process.
    fn parse_only(ptx: &str) -> Result<Module, LoadError> {
        Module::from_ast(parse::parse(ptx)?)
    }

    /// [`Module::parse_only`] of a text that lives as long as the process: its function bodies
    /// borrow it instead of a copy.
    fn parse_only_static(ptx: &'static str) -> Result<Module, LoadError> {
        Module::from_ast(parse::parse_static(ptx)?)
    }

    fn from_ast(ast: parse::ModuleAst) -> Result<Module, LoadError> {
        PARSES.fetch_add(1, Ordering::Relaxed);
        let id = NEXT_MODULE.fetch_add(1, Ordering::Relaxed);
        let base = memory::MODULE_BASE + (id % 128) * (1 << 32);
        let globals = decode::layout_globals(&ast, base)?;
        let func_index = decode::func_index(&ast);
        let mut by_name = HashMap::new();
        let entries: Vec<Entry> = decode::entries(&ast)
            .into_iter()
            .enumerate()
            .map(|(i, func)| {
                by_name.entry(ast.funcs[func].name.clone()).or_insert(i);
                Entry { func, program: OnceLock::new() }
            })
            .collect();
        Ok(Module {
            id,
            version: ast.version.clone(),
            target: ast.target.clone(),
            ast,
            func_index,
            entries,
            by_name,
            globals,
            sources: OnceLock::new(),
            static_text: None,
        })
    }

    /// The process-wide module for `ptx`: the first call for a text parses it ([`Module::load_lazy`],
    /// entries decoded on first use), later calls with the same text (by SHA-256) return the same
    /// module while it is alive. The last few distinct modules stay alive even when no caller
    /// holds them, so a process that opens and closes devices on the committed module parses it
    /// once; older ones are dropped with their last `Arc`. A text that fails to load is not
    /// cached (each call reports the error again).
    pub fn shared(ptx: &str) -> Result<Arc<Module>, LoadError> {
        Module::shared_by(SharedKey::Digest(Sha256::digest(ptx.as_bytes()).into()), || Module::load_lazy(ptx))
    }

    /// [`Module::shared`] for a text that lives as long as the process (an embedded module): the
    /// same text, by address and length, returns the same module without hashing it (a `'static`
    /// text never changes), which spares a short-lived program the digest of a large module.
    pub fn shared_static(ptx: &'static str) -> Result<Arc<Module>, LoadError> {
        let load = || Ok(Module { static_text: Some(ptx), ..Module::parse_only_static(ptx)? });
        Module::shared_by(SharedKey::Static(ptx.as_ptr() as usize, ptx.len()), load)
    }

    fn shared_by(key: SharedKey, load: impl FnOnce() -> Result<Module, LoadError>) -> Result<Arc<Module>, LoadError> {
        static CACHE: OnceLock<Mutex<SharedCache>> = OnceLock::new();
        let cache = CACHE.get_or_init(|| Mutex::new(SharedCache { live: HashMap::new(), recent: VecDeque::new() }));
        // The lock is held while parsing, so that threads asking for the same text at once parse
        // it once (a different text waits too; loads are rare).
        let mut c = cache.lock().unwrap_or_else(|e| e.into_inner());
        let m = match c.live.get(&key).and_then(Weak::upgrade) {
            Some(m) => m,
            None => {
                let m = Arc::new(load()?);
                c.live.retain(|_, w| w.strong_count() > 0);
                c.live.insert(key, Arc::downgrade(&m));
                m
            }
        };
        c.recent.retain(|r| !Arc::ptr_eq(r, &m));
        c.recent.push_front(m.clone());
        c.recent.truncate(SHARED_KEEP);
        Ok(m)
    }

    /// How many PTX texts this process has parsed ([`Module::load`], [`Module::load_lazy`], and
    /// [`Module::shared`] when it did not have the module yet).
    pub fn parses() -> u64 {
        PARSES.load(Ordering::Relaxed)
    }

    /// Parses every function body and decodes every entry not decoded yet (in parallel, one
    /// worker per core), and returns the first error in module order: what [`Module::load`]
    /// checks, for a lazily loaded module.
    pub fn check_all(&self) -> Result<(), LoadError> {
        // Every body parses (also those of functions no entry calls), first error in module order.
        for f in &self.ast.funcs {
            if let Some(b) = &f.body {
                b.stmts()?;
            }
        }
        let todo: Vec<&Entry> = self.entries.iter().filter(|e| e.program.get().is_none()).collect();
        let workers = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(todo.len());
        if workers > 1 {
            let next = AtomicUsize::new(0);
            std::thread::scope(|s| {
                for _ in 0..workers {
                    s.spawn(|| {
                        while let Some(e) = todo.get(next.fetch_add(1, Ordering::Relaxed)) {
                            let _ = self.decoded(e);
                        }
                    });
                }
            });
        }
        for e in &self.entries {
            self.decoded(e).map_err(Clone::clone)?;
        }
        Ok(())
    }

    /// Names of the module's entries, in module order (nothing is decoded).
    pub fn kernel_names(&self) -> Vec<String> {
        self.entries.iter().map(|e| self.ast.funcs[e.func].name.clone()).collect()
    }

    /// The Rust source line a PTX line (1-based) was compiled from, when the PTX carries line
    /// tables (`.file`/`.loc`; the kernel build writes them). See [`SourceLoc`].
    pub fn source_of(&self, ptx_line: usize) -> Option<SourceLoc> {
        self.sources().get(ptx_line)
    }
    fn sources(&self) -> &source::SourceMap {
        self.sources.get_or_init(|| source::SourceMap::build(self.static_text.unwrap_or_default()))
    }
    /// Whether the PTX has line tables (`.file` directives).
    pub fn has_line_info(&self) -> bool {
        !self.sources().is_empty()
    }
    /// PTX `.version` and `.target` of the module, e.g. ("7.0", "sm_80").
    pub fn version_and_target(&self) -> (String, String) {
        (self.version.clone(), self.target.clone())
    }
    /// Every entry, decoding those not decoded yet. An entry that does not decode is left out
    /// (only possible for a lazily loaded module: [`Module::check_all`] gives the error).
    pub fn kernels(&self) -> Vec<KernelInfo> {
        // Decode in parallel first.
        let _ = self.check_all();
        self.entries.iter().filter_map(|e| self.decoded(e).ok()).map(|p| p.info.clone()).collect()
    }
    /// The entry `name`, decoded on first use. `None` when the module has no such entry, and
    /// also when it does not decode ([`Module::kernel_info`] tells the two apart).
    pub fn kernel(&self, name: &str) -> Option<KernelInfo> {
        self.program(name).ok().map(|p| p.info.clone())
    }
    /// The entry `name`, decoded on first use: [`VmError::UnknownKernel`] when there is none,
    /// [`VmError::Load`] when it does not decode.
    pub fn kernel_info(&self, name: &str) -> Result<KernelInfo, VmError> {
        self.program(name).map(|p| p.info.clone())
    }
    fn program(&self, name: &str) -> Result<&ir::Program, VmError> {
        let e = self.by_name.get(name).ok_or_else(|| VmError::UnknownKernel(name.to_string()))?;
        self.decoded(&self.entries[*e]).map_err(|e| VmError::Load(e.clone()))
    }
    fn decoded<'a>(&'a self, e: &'a Entry) -> Result<&'a ir::Program, &'a LoadError> {
        e.program
            .get_or_init(|| decode::decode_entry(&self.ast, &self.globals, &self.func_index, &self.ast.funcs[e.func]))
            .as_ref()
    }
}

/// Device limits the VM enforces at launch (defaults model an sm_80 part, A100:
/// [`DeviceLimits::sm80`]; [`DeviceLimits::sm90`] models H100).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceLimits {
    pub max_threads_per_block: u32,
    /// Static + dynamic shared memory a block may use with the opt-in
    /// (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` on a GPU, which the VM does not ask
    /// for): 163 KiB on sm_80, 227 KiB on sm_90. A launch above it is refused.
    pub max_shared_per_block: u32,
    /// What a block gets without the opt-in (48 KiB on both): a device property reported to
    /// hosts (`CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK`), not enforced by the VM.
    pub shared_per_block_default: u32,
    pub max_grid: [u32; 3],
    pub max_block: [u32; 3],
    /// Simulated device memory; `alloc` beyond it fails with `OutOfMemory` (default 16 GiB).
    pub memory_bytes: u64,
    /// Per-thread instruction budget per launch before the VM reports a hang (default 2^32).
    pub max_instructions_per_thread: u64,
    /// Wall-clock limit of one launch (default none): past it the launch stops with a
    /// [`VmError::Trap`] "launch time limit exceeded", checked at every block start and every
    /// 65536 instructions of a warp, so that a kernel that never ends (an endless loop, or a
    /// grid of billions of blocks) is stopped in about this time whatever its shape.
    pub max_launch_time: Option<std::time::Duration>,
}

/// Which thread to trace (block and thread index); the trace comes back in `LaunchStats::trace`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceRequest {
    pub block: [u32; 3],
    pub thread: [u32; 3],
    pub max_entries: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LaunchConfig {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub dynamic_shared_bytes: u32,
    pub trace: Option<TraceRequest>,
    /// Run only these blocks of the grid (a sampled launch: what the others would have written
    /// stays as it was; [`LaunchStats::blocks`] counts the blocks that ran). `None`: every block.
    /// Each must lie inside the grid (else [`VmError::InvalidLaunch`]); duplicates run once, in
    /// the grid's order.
    pub blocks: Option<Vec<[u32; 3]>>,
}

impl LaunchConfig {
    pub fn new(grid: [u32; 3], block: [u32; 3], dynamic_shared_bytes: u32) -> Self {
        LaunchConfig { grid, block, dynamic_shared_bytes, trace: None, blocks: None }
    }
}

/// One executed instruction of the traced thread.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceEntry {
    /// PTX source line (1-based) and its text, trimmed.
    pub line: usize,
    pub text: String,
    /// False when the instruction's guard predicate was false.
    pub executed: bool,
    /// Registers written, with their new value as raw bits (e.g. `("%r12", 0x3f800000)`).
    pub writes: Vec<(String, u64)>,
    /// The Rust line it was compiled from (PTX with line tables only).
    pub source: Option<SourceLoc>,
    /// Set on the last entry when the launch stopped at this instruction of the traced thread:
    /// the finding's kind (the instruction did not complete, so it writes nothing).
    pub finding: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct LaunchStats {
    /// Instructions executed, counted once per active thread.
    pub thread_instructions: u64,
    /// Instructions issued, counted once per warp.
    pub warp_instructions: u64,
    /// Of [`LaunchStats::warp_instructions`], those the VM ran as fused steps: runs of
    /// `ld.shared.b32` + `fma.rn.f32` pairs taken in one step where that cannot change any
    /// result, count or finding (see `ptx-vm/PERF.md`). Zero while a trace or the bank-conflict
    /// count is on, which watch single instructions.
    pub fused_warp_instructions: u64,
    pub blocks: u64,
    /// Bytes the threads read from global memory: every `ld` (and generic `ld` that resolved to
    /// global memory) counts its size once per active thread, a `cp.async` its source bytes.
    /// There is no cache model: these are the bytes asked of global memory (L2 and HBM together),
    /// the quantity a kernel's tiling decides. An atomic counts as a write only.
    pub global_bytes_read: u64,
    /// Bytes the threads wrote to global memory (`st`, `red`/`atom`), counted as for reads.
    pub global_bytes_written: u64,
    /// Shared-memory bank conflicts per PTX line, when [`Vm::set_bank_conflicts`] is on (empty
    /// otherwise), in line order: every line with a shared `ld`, `st` or `ldmatrix` that ran.
    pub bank_conflicts: Vec<BankConflicts>,
    /// Global-memory sectors per PTX line, when [`Vm::set_sectors`] is on (empty otherwise), in
    /// line order: every line with a global `ld`, `st` or `cp.async` that ran.
    pub sectors: Vec<Sectors>,
    pub wall: Duration,
    pub trace: Vec<TraceEntry>,
}

/// The shared-memory wavefronts of one PTX instruction over a launch (see [`Vm::set_bank_conflicts`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BankConflicts {
    /// The PTX line.
    pub line: usize,
    /// The Rust (or other source) line the PTX line came from, when the module has `.loc`.
    pub source: Option<SourceLoc>,
    /// Warp-wide executions of the instruction.
    pub executions: u64,
    /// Wavefronts they took.
    pub wavefronts: u64,
    /// The fewest wavefronts they could take: one per phase (32 lanes for accesses of up to
    /// 4 bytes, 16 for 8 bytes, 8 for 16 bytes and for each matrix of `ldmatrix`).
    pub ideal: u64,
}

impl BankConflicts {
    /// Wavefronts beyond the minimum: the bank conflicts.
    pub fn extra(&self) -> u64 {
        self.wavefronts - self.ideal
    }
    /// The conflict degree, wavefronts per phase on average (1.0 = conflict-free, 8.0 = an
    /// 8-way conflict).
    pub fn ways(&self) -> f64 {
        self.wavefronts as f64 / self.ideal.max(1) as f64
    }
    /// `counts` (per PTX line) merged by source line, labelled `file:line` (`PTX line N` where the
    /// module has no `.loc`), in first-seen order: an unrolled loop is many PTX lines of one source
    /// line. Each merged entry keeps the first PTX line and source location of its group.
    pub fn by_source(counts: &[BankConflicts]) -> Vec<(String, BankConflicts)> {
        let mut out: Vec<(String, BankConflicts)> = Vec::new();
        for b in counts {
            let at = b
                .source
                .as_ref()
                .map(|s| format!("{}:{}", s.file, s.line))
                .unwrap_or_else(|| format!("PTX line {}", b.line));
            match out.iter_mut().find(|(a, _)| *a == at) {
                Some((_, m)) => {
                    m.executions += b.executions;
                    m.wavefronts += b.wavefronts;
                    m.ideal += b.ideal;
                }
                None => out.push((at, b.clone())),
            }
        }
        out
    }
}

/// The 32-byte global-memory sectors of one PTX instruction over a launch (see
/// [`Vm::set_sectors`]): how well its warps' accesses coalesce.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sectors {
    /// The PTX line.
    pub line: usize,
    /// The Rust (or other source) line the PTX line came from, when the module has `.loc`.
    pub source: Option<SourceLoc>,
    /// Warp-wide executions of the instruction.
    pub executions: u64,
    /// The distinct bytes the active lanes asked for, summed over the executions.
    pub useful_bytes: u64,
    /// The 32-byte sectors those bytes lie in, summed over the executions.
    pub sectors: u64,
}

impl Sectors {
    /// Bytes of a sector.
    pub const BYTES: u64 = sectors::SECTOR;
    /// Useful bytes over the bytes of the sectors touched, `useful / (32 · sectors)`: 1.0 when
    /// the accesses coalesce perfectly, 0.125 when each lane of a 4-byte access has a sector of
    /// its own.
    pub fn efficiency(&self) -> f64 {
        self.useful_bytes as f64 / (Self::BYTES * self.sectors).max(1) as f64
    }
    /// Sectors per warp-wide execution.
    pub fn per_execution(&self) -> f64 {
        self.sectors as f64 / self.executions.max(1) as f64
    }
    /// `counts` (per PTX line) merged by source line, labelled `file:line` (`PTX line N` where the
    /// module has no `.loc`), in first-seen order, as [`BankConflicts::by_source`].
    pub fn by_source(counts: &[Sectors]) -> Vec<(String, Sectors)> {
        let mut out: Vec<(String, Sectors)> = Vec::new();
        for c in counts {
            let at = c
                .source
                .as_ref()
                .map(|s| format!("{}:{}", s.file, s.line))
                .unwrap_or_else(|| format!("PTX line {}", c.line));
            match out.iter_mut().find(|(a, _)| *a == at) {
                Some((_, m)) => {
                    m.executions += c.executions;
                    m.useful_bytes += c.useful_bytes;
                    m.sectors += c.sectors;
                }
                None => out.push((at, c.clone())),
            }
        }
        out
    }
}

/// Exact allocator statistics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemStats {
    pub current_bytes: u64,
    pub peak_bytes: u64,
    pub live_allocations: u64,
    pub total_allocations: u64,
}

/// What memcheck found wrong: kind of fault and the full location.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// e.g. "out-of-bounds global store", "misaligned access", "use after free",
    /// "shared memory out of window", "local memory overflow", "barrier divergence", "deadlock".
    pub kind: String,
    pub kernel: String,
    pub block: [u32; 3],
    pub thread: [u32; 3],
    pub line: usize,
    pub instruction: String,
    pub address: Option<u64>,
    pub access_bytes: Option<u32>,
    /// Human description of the nearest allocation, e.g. "4 bytes past the end of 1024-byte allocation at 0x...".
    pub nearest_allocation: Option<String>,
    /// The name of the global buffer the access belongs to (the allocation containing the
    /// address, or the nearest one), when it was named with [`Vm::set_label`].
    pub buffer: Option<String>,
    /// The Rust line of the instruction (PTX with line tables only).
    pub source: Option<SourceLoc>,
    /// For a shared memory race: the other warp's access to the same word in the same barrier
    /// interval (the write a read or write conflicts with, or the read a write conflicts with).
    /// Its location is also in [`Finding::nearest_allocation`]'s text.
    pub conflict: Option<Conflict>,
}

/// The other access of a shared memory race.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conflict {
    pub warp: u32,
    /// A write (else a read).
    pub write: bool,
    /// PTX line of the instruction.
    pub line: usize,
    pub instruction: String,
    /// Its Rust line (PTX with line tables only).
    pub source: Option<SourceLoc>,
}

impl fmt::Display for Conflict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "warp {}'s {} was at PTX line {} `{}`",
            self.warp,
            if self.write { "write" } else { "read" },
            self.line,
            self.instruction
        )?;
        if let Some(s) = &self.source {
            write!(f, " in {s}")?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum VmError {
    UnknownKernel(String),
    /// The kernel does not decode (an unsupported opcode or modifier, found at its first use in
    /// a lazily loaded module); nothing ran.
    Load(LoadError),
    /// Bad launch configuration or parameter bytes; the message names the limit.
    InvalidLaunch(String),
    OutOfMemory {
        requested: u64,
        free: u64,
    },
    /// The host could not back a simulated allocation with memory (the simulated device may be
    /// larger than the host's RAM).
    HostMemory {
        requested: u64,
    },
    /// Host-side misuse of the heap API (bad pointer to free/read/write).
    InvalidPointer(String),
    Memcheck(Box<Finding>),
    /// `trap` executed, or the per-thread instruction budget was exceeded.
    Trap(Box<Finding>),
}

impl DeviceLimits {
    /// An sm_80 part (A100): 163 KiB of shared memory per block with the opt-in, 48 KiB without.
    pub fn sm80() -> Self {
        Self::default()
    }
    /// An sm_90 part (H100): 227 KiB of shared memory per block with the opt-in, 48 KiB without.
    pub fn sm90() -> Self {
        DeviceLimits { max_shared_per_block: 227 * 1024, ..Self::default() }
    }
}

impl Default for DeviceLimits {
    fn default() -> Self {
        DeviceLimits {
            max_threads_per_block: 1024,
            max_shared_per_block: 163 * 1024,
            shared_per_block_default: 48 * 1024,
            max_grid: [i32::MAX as u32, 65_535, 65_535],
            max_block: [1024, 1024, 64],
            memory_bytes: 16 << 30,
            max_instructions_per_thread: 1 << 32,
            max_launch_time: None,
        }
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [bx, by, bz] = self.block;
        let [tx, ty, tz] = self.thread;
        write!(
            f,
            "{} in kernel `{}`, block ({bx}, {by}, {bz}), thread ({tx}, {ty}, {tz}), at PTX line {} `{}`",
            self.kind, self.kernel, self.line, self.instruction
        )?;
        if let Some(s) = &self.source {
            write!(f, " in {s}")?;
        }
        if let Some(b) = &self.buffer {
            write!(f, ", buffer `{b}`")?;
        }
        match (self.address, self.access_bytes) {
            (Some(a), Some(n)) => write!(f, ", {n}-byte access at address {a:#x}")?,
            (Some(a), None) => write!(f, ", address {a:#x}")?,
            _ => {}
        }
        if let Some(n) = &self.nearest_allocation {
            write!(f, " ({n})")?;
        }
        write!(f, ".")
    }
}

impl fmt::Display for VmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VmError::UnknownKernel(k) => write!(f, "The module has no kernel named `{k}`."),
            VmError::Load(e) => write!(f, "The kernel cannot be loaded: {e}."),
            VmError::InvalidLaunch(m) => write!(f, "Invalid launch: {m}."),
            VmError::OutOfMemory { requested, free } => {
                write!(f, "Out of device memory: {requested} bytes were requested but only {free} bytes are free.")
            }
            VmError::HostMemory { requested } => write!(
                f,
                "The host cannot allocate the {requested} bytes that back this device allocation \
                 (the simulated device memory is larger than what the host can provide)."
            ),
            VmError::InvalidPointer(m) => write!(f, "Invalid device pointer: {m}."),
            VmError::Memcheck(x) => write!(f, "Memcheck found a {x}"),
            VmError::Trap(x) => write!(f, "The kernel stopped: {x}"),
        }
    }
}
impl std::error::Error for VmError {}

/// The virtual device: global memory heap plus the executor.
pub struct Vm {
    heap: memory::Heap,
    limits: DeviceLimits,
    workers: usize,
    initcheck: bool,
    racecheck: bool,
    banks: bool,
    sectors: bool,
    /// Module id -> instantiated globals base.
    module_globals: HashMap<u64, u64>,
    /// The trace of the last launch, kept when it stopped at a finding.
    last_trace: Vec<TraceEntry>,
    /// Workers of earlier launches, reused so that their register files and shared memory are
    /// not allocated (and page-faulted in) again on every launch.
    pool: Vec<exec::Worker>,
    /// [`exec::Launch::poison_registers`] (set by tests).
    pub(crate) poison_registers: bool,
    /// Run programs with their registers packed ([`regalloc`]; on unless a test compares).
    pub(crate) pack_registers: bool,
}

impl Default for Vm {
    fn default() -> Self {
        Vm::new()
    }
}

impl Vm {
    /// Worker threads = available parallelism.
    pub fn new() -> Vm {
        Vm::with_workers(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
    }
    pub fn with_workers(workers: usize) -> Vm {
        Vm {
            heap: memory::Heap::new(),
            limits: DeviceLimits::default(),
            workers: workers.max(1),
            initcheck: true,
            racecheck: true,
            banks: false,
            sectors: false,
            module_globals: HashMap::new(),
            last_trace: Vec::new(),
            pool: Vec::new(),
            poison_registers: false,
            pack_registers: true,
        }
    }
    /// Names an allocation (e.g. `Q`, `O`, `LSE`): findings then say which buffer an access
    /// belongs to ([`Finding::buffer`] and the allocation description).
    pub fn set_label(&mut self, ptr: DevPtr, name: &str) {
        self.heap.labels.insert(ptr, name.to_string());
    }
    /// The trace of the last launch that requested one, including a launch that stopped at a
    /// finding (then, if the finding was on the traced thread, its last entry is the instruction
    /// that made it, with [`TraceEntry::finding`] set). Successful launches also return it in
    /// [`LaunchStats::trace`].
    pub fn take_trace(&mut self) -> Vec<TraceEntry> {
        std::mem::take(&mut self.last_trace)
    }
    /// Whether loads of shared memory that no thread of the block has written are findings
    /// ("uninitialized shared memory read"; on by default). Off, such loads see
    /// [`SHARED_POISON`] — useful to observe what an unsynchronised read would have returned.
    pub fn initcheck(&self) -> bool {
        self.initcheck
    }
    pub fn set_initcheck(&mut self, on: bool) {
        self.initcheck = on;
    }
    /// Whether accesses to the same shared word by different warps of a block with no barrier
    /// between them (at least one a plain store) are findings ("shared memory race"; on by
    /// default). Atomics are exempt; the granularity is the 4-byte word.
    pub fn racecheck(&self) -> bool {
        self.racecheck
    }
    pub fn set_racecheck(&mut self, on: bool) {
        self.racecheck = on;
    }
    /// Whether launches count the wavefronts of every shared-memory `ld`, `st` and `ldmatrix`
    /// and report them per PTX line in [`LaunchStats::bank_conflicts`] (off by default: it costs
    /// time on every shared access).
    pub fn bank_conflicts(&self) -> bool {
        self.banks
    }
    pub fn set_bank_conflicts(&mut self, on: bool) {
        self.banks = on;
    }
    /// Whether launches count the 32-byte sectors of every global `ld`, `st` and `cp.async`
    /// (per warp instruction: the sectors its active lanes' bytes lie in) and report them per
    /// PTX line in [`LaunchStats::sectors`] (off by default: it costs time on every global
    /// access).
    pub fn sectors(&self) -> bool {
        self.sectors
    }
    pub fn set_sectors(&mut self, on: bool) {
        self.sectors = on;
    }
    /// Number of worker threads blocks run on.
    pub fn workers(&self) -> usize {
        self.workers
    }
    pub fn limits(&self) -> DeviceLimits {
        self.limits
    }
    pub fn set_limits(&mut self, limits: DeviceLimits) {
        self.limits = limits;
    }
    pub fn alloc(&mut self, bytes: u64) -> Result<DevPtr, VmError> {
        self.heap.alloc(bytes, self.limits.memory_bytes)
    }
    pub fn free(&mut self, ptr: DevPtr) -> Result<(), VmError> {
        self.heap.free(ptr)
    }
    pub fn write(&mut self, ptr: DevPtr, data: &[u8]) -> Result<(), VmError> {
        let p = self.heap.host_access(ptr, data.len() as u64)?;
        // SAFETY: the range lies inside one live allocation and no launch is running (`&mut self`).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        Ok(())
    }
    pub fn read(&self, ptr: DevPtr, out: &mut [u8]) -> Result<(), VmError> {
        let p = self.heap.host_access(ptr, out.len() as u64)?;
        // SAFETY: as in `write`; launches hold `&mut self`, so nothing writes concurrently.
        unsafe { std::ptr::copy_nonoverlapping(p as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }
    pub fn memory(&self) -> MemStats {
        MemStats {
            current_bytes: self.heap.current,
            peak_bytes: self.heap.peak,
            live_allocations: self.heap.live,
            total_allocations: self.heap.total,
        }
    }
    pub fn reset_peak(&mut self) {
        self.heap.peak = self.heap.current;
    }

    /// Device address of a module-scope `.global`/`.const` variable (instantiated on first use).
    pub fn global_address(&mut self, module: &Module, name: &str) -> Option<DevPtr> {
        let a = *module.globals.addrs.get(name)?;
        self.instantiate_globals(module);
        Some(a)
    }

    /// Drops this VM's instance of `module`'s `.global`/`.const` variables (what a GPU does at
    /// module unload): the next launch or [`Vm::global_address`] instantiates them afresh from
    /// the module's initialisers. Needed before reusing a module from [`Module::shared`] as a
    /// freshly loaded one in the same VM; other VMs' instances are not affected.
    pub fn release_globals(&mut self, module: &Module) {
        if self.module_globals.remove(&module.id).is_some() {
            let base = module.globals.base;
            if self.heap.allocs.get(&base).and_then(|a| a.module) == Some(module.id) {
                self.heap.allocs.remove(&base);
            }
        }
    }

    fn instantiate_globals(&mut self, module: &Module) {
        let g = &module.globals;
        if g.image.is_empty() || self.module_globals.get(&module.id) == Some(&g.base) {
            return;
        }
        // Another module may have used this window before.
        if let Some(old) = self.heap.allocs.get(&g.base).and_then(|a| a.module) {
            self.module_globals.remove(&old);
        }
        let data = {
            let words = g.image.len().div_ceil(8);
            let v: Vec<AtomicU64> = (0..words)
                .map(|i| {
                    let mut b = [0u8; 8];
                    let s = i * 8;
                    let e = (s + 8).min(g.image.len());
                    b[..e - s].copy_from_slice(&g.image[s..e]);
                    AtomicU64::new(u64::from_le_bytes(b))
                })
                .collect();
            v.into_boxed_slice()
        };
        self.heap.allocs.insert(g.base, memory::Alloc { size: g.image.len() as u64, data, module: Some(module.id) });
        self.module_globals.insert(module.id, g.base);
    }

    /// Runs `kernel` to completion. `params` is the packed parameter buffer
    /// (`KernelInfo::param_bytes` long, each parameter at its `offset`).
    ///
    /// Blocks run in parallel on the worker threads; each block's result is independent of the
    /// schedule. On a memcheck finding or trap the error of the lowest-numbered failing block is
    /// returned; writes made before it stay in memory (as on a GPU).
    pub fn launch(
        &mut self,
        module: &Module,
        kernel: &str,
        config: &LaunchConfig,
        params: &[u8],
    ) -> Result<LaunchStats, VmError> {
        let t0 = Instant::now();
        let prog = module.program(kernel)?;
        // A traced launch runs the program as written (the trace names registers by slot).
        let prog = if self.pack_registers && config.trace.is_none() { prog.packed() } else { prog };
        let info = &prog.info;
        let lim = self.limits;
        if params.len() != info.param_bytes {
            return Err(VmError::InvalidLaunch(format!(
                "kernel `{kernel}` takes {} parameter bytes but {} were given",
                info.param_bytes,
                params.len()
            )));
        }
        let names = ["x", "y", "z"];
        #[allow(clippy::needless_range_loop)]
        for d in 0..3 {
            if config.grid[d] == 0 || config.grid[d] > lim.max_grid[d] {
                return Err(VmError::InvalidLaunch(format!(
                    "grid.{} = {} is outside 1..={} (max_grid)",
                    names[d], config.grid[d], lim.max_grid[d]
                )));
            }
            if config.block[d] == 0 || config.block[d] > lim.max_block[d] {
                return Err(VmError::InvalidLaunch(format!(
                    "block.{} = {} is outside 1..={} (max_block)",
                    names[d], config.block[d], lim.max_block[d]
                )));
            }
        }
        let threads = config.block.iter().map(|&b| b as u64).product::<u64>();
        if threads > lim.max_threads_per_block as u64 {
            return Err(VmError::InvalidLaunch(format!(
                "{threads} threads per block exceed max_threads_per_block = {}",
                lim.max_threads_per_block
            )));
        }
        let shared = if config.dynamic_shared_bytes > 0 {
            prog.dyn_shared_offset as u64 + config.dynamic_shared_bytes as u64
        } else {
            info.static_shared_bytes as u64
        };
        if info.static_shared_bytes as u64 + config.dynamic_shared_bytes as u64 > lim.max_shared_per_block as u64 {
            return Err(VmError::InvalidLaunch(format!(
                "{} static + {} dynamic shared bytes exceed max_shared_per_block = {}",
                info.static_shared_bytes, config.dynamic_shared_bytes, lim.max_shared_per_block
            )));
        }
        self.instantiate_globals(module);
        let view = memory::GlobalView::new(&self.heap);
        let launch = exec::Launch {
            prog,
            kernel,
            global: &view,
            params,
            grid: config.grid,
            block: config.block,
            shared_bytes: shared as usize,
            dyn_shared: config.dynamic_shared_bytes,
            budget: lim.max_instructions_per_thread,
            deadline: lim.max_launch_time.map(|d| t0 + d),
            trace: config.trace,
            initcheck: self.initcheck,
            racecheck: self.racecheck,
            banks: self.banks,
            sectors: self.sectors,
            poison_registers: self.poison_registers,
        };
        let nblocks = config.grid.iter().map(|&g| g as u64).product::<u64>();
        // A sampled launch: the linear indices of the blocks to run, in the grid's order.
        let subset: Option<Vec<u64>> = match &config.blocks {
            None => None,
            Some(blocks) => {
                let mut linear = Vec::with_capacity(blocks.len());
                for b in blocks {
                    if (0..3).any(|d| b[d] >= config.grid[d]) {
                        return Err(VmError::InvalidLaunch(format!(
                            "block ({},{},{}) of the launch's subset is outside the grid ({},{},{})",
                            b[0], b[1], b[2], config.grid[0], config.grid[1], config.grid[2]
                        )));
                    }
                    let [gx, gy, _] = config.grid.map(|g| g as u64);
                    linear.push(b[0] as u64 + gx * (b[1] as u64 + gy * b[2] as u64));
                }
                linear.sort_unstable();
                linear.dedup();
                Some(linear)
            }
        };
        let nblocks = subset.as_ref().map_or(nblocks, |s| s.len() as u64);
        let next = AtomicU64::new(0);
        let fail_at = AtomicU64::new(u64::MAX);
        let errors: Mutex<Vec<(u64, Box<Finding>)>> = Mutex::new(Vec::new());
        let results: Mutex<Vec<exec::Worker>> = Mutex::new(Vec::new());
        let pool = Mutex::new(std::mem::take(&mut self.pool));
        let work = || {
            let mut w = pool.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default();
            w.start_launch();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= nblocks {
                    break;
                }
                let b = subset.as_ref().map_or(i, |s| s[i as usize]);
                if b > fail_at.load(Ordering::Relaxed) {
                    break;
                }
                if launch.past_deadline() {
                    fail_at.fetch_min(b, Ordering::Relaxed);
                    errors.lock().unwrap_or_else(|e| e.into_inner()).push((b, launch.time_limit_finding(b)));
                    break;
                }
                if let Err(f) = launch.run_block(&mut w, b) {
                    fail_at.fetch_min(b, Ordering::Relaxed);
                    errors.lock().unwrap_or_else(|e| e.into_inner()).push((b, f));
                }
            }
            results.lock().unwrap_or_else(|e| e.into_inner()).push(w);
        };
        let workers = (self.workers as u64).min(nblocks).max(1) as usize;
        if workers == 1 {
            work();
        } else {
            std::thread::scope(|s| {
                for _ in 0..workers {
                    s.spawn(work);
                }
            });
        }
        let mut errors = errors.into_inner().unwrap_or_else(|e| e.into_inner());
        let mut stats = LaunchStats::default();
        let mut banks: std::collections::BTreeMap<u32, [u64; 3]> = Default::default();
        let mut sectors: std::collections::BTreeMap<u32, [u64; 3]> = Default::default();
        for mut w in results.into_inner().unwrap_or_else(|e| e.into_inner()) {
            stats.thread_instructions += w.thread_instructions;
            stats.warp_instructions += w.warp_instructions;
            stats.blocks += w.blocks;
            stats.global_bytes_read += w.counters.global_bytes[0];
            stats.global_bytes_written += w.counters.global_bytes[1];
            stats.fused_warp_instructions += w.counters.fused;
            for (&pc, c) in &w.counters.sectors {
                let e = sectors.entry(pc).or_insert([0; 3]);
                for k in 0..3 {
                    e[k] += c[k];
                }
            }
            for (&pc, c) in &w.counters.banks {
                let e = banks.entry(pc).or_insert([0; 3]);
                for k in 0..3 {
                    e[k] += c[k];
                }
            }
            stats.trace.append(&mut w.trace);
            self.pool.push(w);
        }
        self.pool.append(&mut pool.into_inner().unwrap_or_else(|e| e.into_inner()));
        for t in &mut stats.trace {
            t.source = module.source_of(t.line);
        }
        let mut by_line: std::collections::BTreeMap<usize, [u64; 3]> = Default::default();
        for (pc, c) in banks {
            let e = by_line.entry(prog.insts[pc as usize].line as usize).or_insert([0; 3]);
            for k in 0..3 {
                e[k] += c[k];
            }
        }
        stats.bank_conflicts = by_line
            .into_iter()
            .map(|(line, c)| BankConflicts {
                line,
                source: module.source_of(line),
                executions: c[0],
                wavefronts: c[1],
                ideal: c[2],
            })
            .collect();
        let mut by_line: std::collections::BTreeMap<usize, [u64; 3]> = Default::default();
        for (pc, c) in sectors {
            let e = by_line.entry(prog.insts[pc as usize].line as usize).or_insert([0; 3]);
            for k in 0..3 {
                e[k] += c[k];
            }
        }
        stats.sectors = by_line
            .into_iter()
            .map(|(line, c)| Sectors {
                line,
                source: module.source_of(line),
                executions: c[0],
                useful_bytes: c[1],
                sectors: c[2],
            })
            .collect();
        if !errors.is_empty() {
            errors.sort_by_key(|e| e.0);
            let mut f = errors.swap_remove(0).1;
            f.source = module.source_of(f.line);
            if let Some(c) = &mut f.conflict {
                c.source = module.source_of(c.line);
                let detail = f.nearest_allocation.take().unwrap_or_default();
                f.nearest_allocation = Some(format!("{detail}; {c}"));
            }
            if let Some(a) = f.address.filter(|a| (memory::MODULE_BASE..memory::PARAM_WINDOW).contains(a)) {
                f.buffer = self.heap.label_near(a, f.access_bytes.unwrap_or(1) as u64);
            }
            if let Some(t) = config.trace {
                if t.block == f.block && t.thread == f.thread {
                    stats.trace.push(TraceEntry {
                        line: f.line,
                        text: f.instruction.clone(),
                        executed: true,
                        writes: Vec::new(),
                        source: f.source.clone(),
                        finding: Some(f.kind.clone()),
                    });
                }
            }
            self.last_trace = stats.trace;
            return Err(
                if f.kind == "trap" || f.kind.starts_with("instruction budget") || f.kind.starts_with(exec::TIME_LIMIT)
                {
                    VmError::Trap(f)
                } else {
                    VmError::Memcheck(f)
                },
            );
        }
        self.last_trace = stats.trace.clone();
        stats.wall = t0.elapsed();
        Ok(stats)
    }
}
