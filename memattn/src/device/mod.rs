//! The device layer under [`crate::attn::Kernels`]: the [`Device`] trait, the PTX VM behind it
//! ([`vm::VmDevice`], feature `vm`), and the CUDA driver side ([`cuda`]: driver choice, probe,
//! [`cuda::CudaModule`] with the one `cuLaunchKernel`).
//!
//! [`Device`] is also the library's measurement extension point: a program that wants to
//! measure what a launch costs (the `memattn` command brackets runs with NVML and
//! `cuMemGetInfo`, counts VM instructions, injects faults in its tests) implements or wraps it;
//! [`Device::memory_begin`], [`Device::memory_mark_allocated`], [`Device::memory_end`] and
//! [`Device::timer_start`]/[`Device::timer_stop`] are the hooks, [`LaunchInfo`] what a launch
//! reports.

pub mod cuda;
#[cfg(feature = "vm")]
pub mod vm;

use crate::memory::MeasuredMemory;
use crate::problem::Arch;
use crate::ptx::PtxSource;
use crate::tma::TensorMapDesc;
use kernels_gpu::tiles::LaunchDims;
use std::fmt;
use std::str::FromStr;

/// A device address.
pub type DevPtr = u64;

/// Which backend a device is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum Backend {
    /// The PTX VM on the host's CPU.
    Vm,
    /// A CUDA GPU through the driver.
    Cuda,
}

impl Backend {
    /// The lowercase name (`vm`, `cuda`), as `Display` writes it.
    pub const fn name(self) -> &'static str {
        match self {
            Backend::Vm => "vm",
            Backend::Cuda => "cuda",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The `--backend` option.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendChoice {
    /// CUDA when a driver and a device are present, otherwise the VM.
    #[default]
    Auto,
    /// The PTX VM.
    Vm,
    /// CUDA (opening fails without a driver and a device).
    Cuda,
}

impl FromStr for BackendChoice {
    type Err = crate::parse::ParseEnumError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(BackendChoice::Auto),
            "vm" => Ok(BackendChoice::Vm),
            "cuda" | "gpu" => Ok(BackendChoice::Cuda),
            _ => Err(crate::parse::ParseEnumError { what: "backend", got: s.into(), expected: "auto, vm, cuda" }),
        }
    }
}

pub use crate::caps::DeviceCaps;

/// What one launch reports back.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LaunchInfo {
    /// VM only: instructions executed, counted once per active thread.
    pub thread_instructions: Option<u64>,
    /// VM only: bytes the threads read from global memory (every load once per thread, no cache
    /// model; see `ptx_vm::LaunchStats::global_bytes_read`).
    pub global_bytes_read: Option<u64>,
    /// VM only: bytes the threads wrote to global memory.
    pub global_bytes_written: Option<u64>,
    /// VM only: the instruction trace, when one was requested.
    #[cfg(feature = "vm")]
    pub trace: Vec<ptx_vm::TraceEntry>,
    /// VM only, with [`DeviceOptions::vm_bank_conflicts`]: the shared-memory wavefronts per PTX
    /// line of every shared `ld`, `st` and `ldmatrix` that ran.
    #[cfg(feature = "vm")]
    pub bank_conflicts: Vec<ptx_vm::BankConflicts>,
    /// VM only, with [`DeviceOptions::vm_sectors`]: the 32-byte global-memory sectors per PTX
    /// line of every global `ld`, `st` and `cp.async` that ran (coalescing).
    #[cfg(feature = "vm")]
    pub sectors: Vec<ptx_vm::Sectors>,
}

/// A device error. Every variant maps to exit code 3.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DeviceError {
    /// The backend, or one of its features, is not available here (the reason).
    #[error("CUDA backend unavailable: {0}")]
    Unavailable(String),
    /// A PTX module that the device refuses, or whose kernels do not match the tiles planned.
    #[error("PTX does not load ({origin}): {message}")]
    PtxLoad {
        /// Where the module came from ([`PtxSource::origin`]).
        origin: String,
        /// What went wrong.
        message: String,
    },
    /// A kernel entry point the loaded module does not have (its name).
    #[error("kernel `{0}` is not in the loaded PTX module")]
    UnknownKernel(String),
    /// A CUDA driver call failed.
    #[error("CUDA error in {op}: {message}")]
    Cuda {
        /// The operation that failed.
        op: String,
        /// The driver's error.
        message: String,
    },
    /// The VM's memcheck (or a trap) stopped a launch.
    #[error("VM memcheck in `{kernel}`: {message}")]
    Memcheck {
        /// The kernel entry point.
        kernel: String,
        /// The finding, described.
        message: String,
    },
    /// Another VM error.
    #[error("VM error in {op}: {message}")]
    Vm {
        /// The operation that failed.
        op: String,
        /// The VM's error.
        message: String,
    },
    /// A device allocation not aligned as a kernel needs (the details).
    #[error("device allocation does not meet the kernel's alignment: {0}")]
    Misaligned(String),
    /// An allocation larger than the free device memory.
    #[error("out of device memory: requested {requested} bytes, {free} free")]
    OutOfMemory {
        /// Bytes requested.
        requested: u64,
        /// Bytes free.
        free: u64,
    },
    /// The host cannot allocate the memory an operation needs.
    #[error("host memory: cannot allocate {bytes} bytes ({human}) for {what}")]
    HostMemory {
        /// What the memory was for.
        what: String,
        /// Bytes requested.
        bytes: u64,
        /// `bytes`, human-readable.
        human: String,
    },
    /// An environment setting the library reads has a value it does not take (the message
    /// names the variable and its values).
    #[error("{0}")]
    Setting(String),
}

/// A device that can run memattn's kernels and measure them.
///
/// Launches may be asynchronous; [`Device::synchronize`], [`Device::download`] and
/// [`Device::timer_stop`] wait for them. A device is `Send` so that
/// [`crate::attn::Kernels::on_device`] stays `Send + Sync`; calls are serialised by the kernels.
pub trait Device: Send {
    /// Which backend this device is.
    fn backend(&self) -> Backend;
    /// e.g. "NVIDIA H100 80GB HBM3 (sm_90)" or "ptx-vm (2 workers, 16 GiB simulated)".
    fn name(&self) -> String;
    /// Where the loaded PTX came from and its hash.
    fn ptx(&self) -> &PtxSource;
    /// The `sm_90a` module the device launches the Hopper kernels from, if it can run them.
    fn ptx_sm90(&self) -> Option<&PtxSource> {
        None
    }
    /// Each of `kernels` carries, in the module it launches from ([`Device::ptx`], or
    /// [`Device::ptx_sm90`] for the `sm_90a` rows), the tile these launches were planned for.
    fn check_tiles(&self, kernels: &[kernels_gpu::KernelId]) -> Result<(), DeviceError> {
        use kernels_gpu::variants::PtxModule;
        let (sm90, sm80): (Vec<_>, Vec<_>) = kernels.iter().partition(|k| k.variant().module() == PtxModule::Sm90a);
        let check = |src: &PtxSource, ids: &[kernels_gpu::KernelId]| {
            src.check_tiles(ids).map_err(|message| DeviceError::PtxLoad { origin: src.origin.clone(), message })
        };
        check(self.ptx(), &sm80)?;
        match self.ptx_sm90() {
            Some(src) if !sm90.is_empty() => check(src, &sm90),
            _ => Ok(()),
        }
    }
    /// The limits problems are validated against, free memory read now.
    fn caps(&mut self) -> Result<DeviceCaps, DeviceError>;
    /// The device's multiprocessor count (CUDA: `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`);
    /// `None` where the backend has none of its own (the VM, whose split plans assume
    /// [`crate::decode::DEFAULT_SM_COUNT`]).
    fn multiprocessor_count(&mut self) -> Result<Option<u32>, DeviceError> {
        Ok(None)
    }
    /// Allocates `bytes` bytes of device memory; its address.
    fn alloc(&mut self, bytes: u64) -> Result<DevPtr, DeviceError>;
    /// Frees an allocation made by [`Device::alloc`].
    fn free(&mut self, ptr: DevPtr) -> Result<(), DeviceError>;
    /// Copies raw bytes to the device. A range outside a live allocation is an error, never
    /// undefined behaviour (both backends check it).
    fn upload_bytes(&mut self, ptr: DevPtr, data: &[u8]) -> Result<(), DeviceError>;
    /// Copies raw bytes from the device, after the launches before it completed.
    fn download_bytes(&mut self, ptr: DevPtr, out: &mut [u8]) -> Result<(), DeviceError>;
    /// Uploads f32 values (little-endian).
    fn upload(&mut self, ptr: DevPtr, data: &[f32]) -> Result<(), DeviceError> {
        self.upload_bytes(ptr, &crate::dtype::Dtype::F32.encode(data))
    }
    /// Downloads f32 values.
    fn download(&mut self, ptr: DevPtr, out: &mut [f32]) -> Result<(), DeviceError> {
        let mut bytes = vec![0u8; out.len() * 4];
        self.download_bytes(ptr, &mut bytes)?;
        out.copy_from_slice(&crate::dtype::Dtype::F32.decode(&bytes));
        Ok(())
    }
    /// Sets `count` 32-bit words at `ptr` to `value` (used to poison outputs with NaN).
    fn fill_u32(&mut self, ptr: DevPtr, count: u64, value: u32) -> Result<(), DeviceError>;
    /// Writes `value` to the module-scope `.global` variable `name` of the module `kernel`
    /// launches from (the timeline build's buffer address, `memattn run --timeline`), before a
    /// launch. `value` must not be longer than the variable.
    fn set_module_global(&mut self, kernel: &str, name: &str, value: &[u8]) -> Result<(), DeviceError> {
        let _ = value;
        Err(DeviceError::Unavailable(format!(
            "{} cannot set the module variable `{name}` of `{kernel}`",
            self.backend()
        )))
    }
    /// Launches `kernel` with its parameters, each given as its raw bytes in declaration order.
    fn launch(&mut self, kernel: &str, dims: &LaunchDims, params: &[&[u8]]) -> Result<LaunchInfo, DeviceError>;
    /// The GPU generation whose kernels the library launches here: [`Arch::Sm90`] runs the
    /// Hopper forward from the `sm_90a` module. The VM models the one its options name
    /// ([`DeviceOptions::vm_arch`]).
    fn arch(&mut self) -> Result<Arch, DeviceError> {
        Ok(Arch::Sm80)
    }
    /// The kernels the library picks here: [`Device::arch`] with the measured choices
    /// ([`crate::choice`]); a device opened with [`DeviceOptions::hopper`] carries that policy.
    fn target(&mut self) -> Result<crate::choice::Target, DeviceError> {
        Ok(self.arch()?.into())
    }
    /// Encodes a TMA tensor map (128 bytes, for global memory) of the Hopper forward.
    fn encode_tensor_map(&mut self, desc: &TensorMapDesc) -> Result<[u8; 128], DeviceError> {
        let _ = desc;
        Err(DeviceError::Unavailable(format!("{} has no tensor maps (the Hopper forward needs sm_90)", self.backend())))
    }
    /// Waits until every launch queued so far has completed.
    fn synchronize(&mut self) -> Result<(), DeviceError>;
    /// Starts the clock for the launches that follow.
    fn timer_start(&mut self) -> Result<(), DeviceError>;
    /// Stops the clock after the launches since `timer_start` completed; milliseconds.
    fn timer_stop(&mut self) -> Result<f64, DeviceError>;
    /// "cuda events" or "host wall clock".
    fn clock_name(&self) -> &'static str;
    /// Starts measuring device memory (baseline; NVML sampling on CUDA).
    fn memory_begin(&mut self) -> Result<(), DeviceError>;
    /// Marks the point where all buffers are allocated (CUDA: reads `cuMemGetInfo`).
    fn memory_mark_allocated(&mut self) -> Result<(), DeviceError>;
    /// Stops measuring, after the run's buffers were freed.
    fn memory_end(&mut self) -> Result<MeasuredMemory, DeviceError>;
    /// Default warm-up launches and repetitions for timing on this device.
    fn default_warmup_repeats(&self) -> (u32, u32);
    /// Runs only `subset.blocks` of every later launch of `subset.kernel` (until set to `None`):
    /// a sampled launch, whose other blocks write nothing, for checking a few rows of a shape
    /// too large to run whole. Only the VM can ([`vm::VmDevice`]); other devices refuse.
    fn set_block_subset(&mut self, subset: Option<BlockSubset>) -> Result<(), DeviceError> {
        match subset {
            None => Ok(()),
            Some(s) => Err(DeviceError::Unavailable(format!(
                "running a subset of the blocks of `{}` is a VM feature; {} runs whole grids",
                s.kernel,
                self.backend()
            ))),
        }
    }
}

/// The blocks of one kernel that a sampled launch runs ([`Device::set_block_subset`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockSubset {
    /// The entry point whose launches are sampled.
    pub kernel: String,
    /// Block indices `[x, y, z]` inside the launch's grid.
    pub blocks: Vec<[u32; 3]>,
}

/// Options for opening a device.
#[derive(Clone, Debug)]
pub struct DeviceOptions {
    /// Which backend to open.
    pub backend: BackendChoice,
    /// The PTX module (`sm_80`) the kernels are loaded from.
    pub ptx: PtxSource,
    /// NVML sampling interval (CUDA).
    pub nvml_interval: std::time::Duration,
    /// Simulated device memory of the VM (None: the VM's default).
    pub vm_memory_bytes: Option<u64>,
    /// VM worker threads (None: available parallelism).
    pub vm_workers: Option<usize>,
    /// VM: shared-memory initcheck and racecheck (both on by default).
    pub vm_initcheck: bool,
    /// VM: shared-memory racecheck (on by default).
    pub vm_racecheck: bool,
    /// VM: count the shared-memory wavefronts of every launch per instruction
    /// ([`LaunchInfo::bank_conflicts`]; off by default, it costs time on every shared access).
    pub vm_bank_conflicts: bool,
    /// VM: count the 32-byte global-memory sectors of every launch per instruction
    /// ([`LaunchInfo::sectors`]; off by default, it costs time on every global access).
    pub vm_sectors: bool,
    /// VM: wall-clock limit of one launch (None, the default: no limit, since a verified run at a
    /// large shape can take minutes). A launch that runs longer stops with
    /// [`DeviceError::Memcheck`] "launch time limit exceeded" in about this time, whatever its
    /// grid: a kernel that never ends cannot hang the program.
    pub vm_max_launch_time: Option<std::time::Duration>,
    /// VM: the dynamic shared memory a block may opt in to (None, the default: the VM's
    /// 163 KiB, an A100's). `Some(99 * 1024)` models an sm_86/sm_89 GPU: the library then runs
    /// the compact bf16/f16 backward kernels, as it would there.
    pub vm_max_shared_per_block: Option<u32>,
    /// VM: the GPU generation it models, for kernel selection ([`Device::arch`]): `Sm80` (the
    /// default) or `Sm90`, which runs the Hopper forward (`sm_90a` module) in the VM.
    pub vm_arch: Arch,
    /// The `sm_90a` module (the Hopper kernels), loaded on the first launch of one of them.
    pub ptx_sm90: PtxSource,
    /// Whether an sm_90 device (a compute capability 9.0 GPU, or the VM with `vm_arch` `Sm90`)
    /// runs the `sm_90a` module's kernels: the measured choice by default, `MEMATTN_HOPPER=1`
    /// always, `0` never ([`crate::choice`]).
    pub hopper: crate::choice::HopperPolicy,
}

impl DeviceOptions {
    /// Options with the defaults each field states, `hopper` from `MEMATTN_HOPPER` (the measured
    /// choice when unset or invalid).
    pub fn new(backend: BackendChoice, ptx: PtxSource) -> Self {
        DeviceOptions {
            backend,
            ptx,
            nvml_interval: std::time::Duration::from_millis(1),
            vm_memory_bytes: None,
            vm_workers: None,
            vm_initcheck: true,
            vm_racecheck: true,
            vm_bank_conflicts: false,
            vm_sectors: false,
            vm_max_launch_time: None,
            vm_max_shared_per_block: None,
            vm_arch: Arch::Sm80,
            ptx_sm90: PtxSource::embedded_sm90(),
            // A value the variable cannot have is refused where a device opens
            // ([`crate::choice::HopperPolicy::from_env`]).
            hopper: crate::choice::HopperPolicy::from_env().unwrap_or_default(),
        }
    }
}
