//! `ptx-vm`: a PTX virtual machine with always-on memcheck.
//!
//! It runs the exact PTX that `cargo xtask build-ptx` produces, with the grid, block, dynamic
//! shared memory and parameter bytes the CUDA driver would get.
//!
//! API CONTRACT (the host crate `memattn` codes against these signatures; keep them stable):
//!
//! ```ignore
//! let module = ptx_vm::Module::load(ptx_text)?;              // LoadError names the PTX line
//! let mut vm = ptx_vm::Vm::new();                            // workers = available cores
//! let x = vm.alloc(4 * n)?;                                  // device address (u64, non-zero)
//! vm.write(x, bytemuck_bytes)?;  vm.read(x, &mut out)?;      // host <-> device copies
//! let stats = vm.launch(&module, "saxpy_f32", &LaunchConfig::new(grid, block, smem), &params)?;
//! vm.memory();                                              // MemStats { current, peak, .. }
//! vm.free(x)?;
//! ```

use std::fmt;
use std::time::Duration;

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

/// A parsed and fully decoded PTX module. Loading decodes every instruction up front: an
/// unsupported opcode or modifier is a `LoadError`, never a failure half-way through a launch.
pub struct Module {
    _private: (),
}

impl Module {
    pub fn load(ptx: &str) -> Result<Module, LoadError> {
        let _ = ptx;
        todo!()
    }
    /// PTX `.version` and `.target` of the module, e.g. ("7.0", "sm_80").
    pub fn version_and_target(&self) -> (String, String) {
        todo!()
    }
    pub fn kernels(&self) -> Vec<KernelInfo> {
        todo!()
    }
    pub fn kernel(&self, name: &str) -> Option<KernelInfo> {
        let _ = name;
        todo!()
    }
}

/// Device limits the VM enforces at launch (defaults model an sm_80 part without opt-in).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceLimits {
    pub max_threads_per_block: u32,
    /// Static + dynamic shared memory per block (default 48 KiB).
    pub max_shared_per_block: u32,
    pub max_grid: [u32; 3],
    pub max_block: [u32; 3],
    /// Simulated device memory; `alloc` beyond it fails with `OutOfMemory` (default 16 GiB).
    pub memory_bytes: u64,
    /// Per-thread instruction budget per launch before the VM reports a hang (default 2^32).
    pub max_instructions_per_thread: u64,
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
}

impl LaunchConfig {
    pub fn new(grid: [u32; 3], block: [u32; 3], dynamic_shared_bytes: u32) -> Self {
        LaunchConfig { grid, block, dynamic_shared_bytes, trace: None }
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
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct LaunchStats {
    /// Instructions executed, counted once per active thread.
    pub thread_instructions: u64,
    /// Instructions issued, counted once per warp.
    pub warp_instructions: u64,
    pub blocks: u64,
    pub wall: Duration,
    pub trace: Vec<TraceEntry>,
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
}

#[derive(Clone, Debug, PartialEq)]
pub enum VmError {
    UnknownKernel(String),
    /// Bad launch configuration or parameter bytes; the message names the limit.
    InvalidLaunch(String),
    OutOfMemory { requested: u64, free: u64 },
    /// Host-side misuse of the heap API (bad pointer to free/read/write).
    InvalidPointer(String),
    Memcheck(Box<Finding>),
    /// `trap` executed, or the per-thread instruction budget was exceeded.
    Trap(Box<Finding>),
}

impl fmt::Display for VmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let _ = f;
        todo!()
    }
}
impl std::error::Error for VmError {}

/// The virtual device: global memory heap plus the executor.
pub struct Vm {
    _private: (),
}

impl Default for Vm {
    fn default() -> Self {
        Vm::new()
    }
}

impl Vm {
    /// Worker threads = available parallelism.
    pub fn new() -> Vm {
        todo!()
    }
    pub fn with_workers(workers: usize) -> Vm {
        let _ = workers;
        todo!()
    }
    pub fn limits(&self) -> DeviceLimits {
        todo!()
    }
    pub fn set_limits(&mut self, limits: DeviceLimits) {
        let _ = limits;
        todo!()
    }
    pub fn alloc(&mut self, bytes: u64) -> Result<DevPtr, VmError> {
        let _ = bytes;
        todo!()
    }
    pub fn free(&mut self, ptr: DevPtr) -> Result<(), VmError> {
        let _ = ptr;
        todo!()
    }
    pub fn write(&mut self, ptr: DevPtr, data: &[u8]) -> Result<(), VmError> {
        let _ = (ptr, data);
        todo!()
    }
    pub fn read(&self, ptr: DevPtr, out: &mut [u8]) -> Result<(), VmError> {
        let _ = (ptr, out);
        todo!()
    }
    pub fn memory(&self) -> MemStats {
        todo!()
    }
    pub fn reset_peak(&mut self) {
        todo!()
    }
    /// Runs `kernel` to completion. `params` is the packed parameter buffer
    /// (`KernelInfo::param_bytes` long, each parameter at its `offset`).
    pub fn launch(
        &mut self,
        module: &Module,
        kernel: &str,
        config: &LaunchConfig,
        params: &[u8],
    ) -> Result<LaunchStats, VmError> {
        let _ = (module, kernel, config, params);
        todo!()
    }
}
