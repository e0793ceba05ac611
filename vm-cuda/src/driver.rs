//! The driver API functions this library implements, on one VM shared by the whole process.

use ptx_vm::{DeviceLimits, LaunchConfig, Module, Vm, VmError};
use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

pub type CUresult = u32;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
pub type Handle = *mut c_void;

pub const SUCCESS: CUresult = 0;
pub const INVALID_VALUE: CUresult = 1;
pub const OUT_OF_MEMORY: CUresult = 2;
pub const NOT_INITIALIZED: CUresult = 3;
pub const INVALID_DEVICE: CUresult = 101;
pub const INVALID_IMAGE: CUresult = 200;
pub const INVALID_CONTEXT: CUresult = 201;
pub const INVALID_PTX: CUresult = 218;
pub const INVALID_HANDLE: CUresult = 400;
pub const NOT_FOUND: CUresult = 500;
pub const ILLEGAL_ADDRESS: CUresult = 700;
pub const LAUNCH_TIMEOUT: CUresult = 702;
pub const MISALIGNED_ADDRESS: CUresult = 716;
pub const LAUNCH_FAILED: CUresult = 719;
pub const NOT_SUPPORTED: CUresult = 801;
pub const UNKNOWN: CUresult = 999;

/// (code, name, the real driver's description).
const ERRORS: &[(CUresult, &str, &str)] = &[
    (0, "CUDA_SUCCESS", "no error"),
    (1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"),
    (2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"),
    (3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
    (100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"),
    (101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"),
    (200, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"),
    (201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"),
    (218, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"),
    (400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"),
    (500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"),
    (600, "CUDA_ERROR_NOT_READY", "device not ready"),
    (700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"),
    (702, "CUDA_ERROR_LAUNCH_TIMEOUT", "the launch timed out and was terminated"),
    (716, "CUDA_ERROR_MISALIGNED_ADDRESS", "misaligned address"),
    (719, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"),
    (801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"),
    (999, "CUDA_ERROR_UNKNOWN", "unknown error"),
];

/// The device this library models.
#[derive(Clone, Debug)]
pub struct Model {
    pub name: String,
    pub cc: (i32, i32),
    pub sms: i32,
    pub smem_per_block: i32,
    pub smem_optin: i32,
    pub smem_per_sm: i32,
    pub l2_bytes: i32,
    pub clock_khz: i32,
    pub memory_bytes: u64,
    pub uuid: [u8; 16],
}

/// Largest `VM_CUDA_MEMORY_MIB`: its bytes (`MiB << 20`) must fit in 64 bits.
pub const MAX_MEMORY_MIB: u64 = (1 << 44) - 1;

impl Model {
    /// The model the environment asks for; a value that is set but not understood is an error
    /// naming the variable, never silently replaced by the default.
    fn from_env() -> Result<Model, String> {
        let var = |name: &str| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
        Model::from_vars(var("VM_CUDA_ARCH").as_deref(), var("VM_CUDA_MEMORY_MIB").as_deref())
    }

    /// The model for `VM_CUDA_ARCH` (`sm_80`, the default, or `sm_90`) and `VM_CUDA_MEMORY_MIB`
    /// (1..=[`MAX_MEMORY_MIB`], default 16 GiB); unset or empty takes the default.
    pub fn from_vars(arch: Option<&str>, memory_mib: Option<&str>) -> Result<Model, String> {
        let sm90 = match arch.map(str::trim) {
            None | Some("") | Some("sm_80") => false,
            Some("sm_90") => true,
            Some(other) => {
                return Err(format!("VM_CUDA_ARCH={other}: the VM-backed driver models sm_80 (the default) or sm_90"))
            }
        };
        let memory_bytes = match memory_mib.map(str::trim) {
            None | Some("") => 16 << 30,
            Some(m) => match m.parse::<u64>() {
                Ok(n) if (1..=MAX_MEMORY_MIB).contains(&n) => n << 20,
                _ => {
                    return Err(format!(
                        "VM_CUDA_MEMORY_MIB={m}: expected a whole number of MiB in 1..={MAX_MEMORY_MIB}"
                    ))
                }
            },
        };
        let mut uuid = *b"ptx-vm-cuda-sm80";
        if sm90 {
            uuid = *b"ptx-vm-cuda-sm90";
        }
        if sm90 {
            Ok(Model {
                name: "ptx-vm virtual GPU (VM-backed libcuda)".into(),
                cc: (9, 0),
                sms: 132,
                smem_per_block: 48 * 1024,
                smem_optin: 227 * 1024,
                smem_per_sm: 228 * 1024,
                l2_bytes: 50 << 20,
                clock_khz: 1_980_000,
                memory_bytes,
                uuid,
            })
        } else {
            Ok(Model {
                name: "ptx-vm virtual GPU (VM-backed libcuda)".into(),
                cc: (8, 0),
                sms: 108,
                smem_per_block: 48 * 1024,
                smem_optin: 163 * 1024,
                smem_per_sm: 164 * 1024,
                l2_bytes: 40 << 20,
                clock_khz: 1_410_000,
                memory_bytes,
                uuid,
            })
        }
    }
}

struct Function {
    module: usize,
    name: String,
    info: ptx_vm::KernelInfo,
    /// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`.
    max_dynamic_smem: i32,
}

#[derive(Default)]
struct Event {
    recorded: Option<Instant>,
    timing: bool,
}

pub struct State {
    initialised: bool,
    pub model: Model,
    vm: Vm,
    primary_refs: u32,
    next_handle: usize,
    /// Loaded modules: handles onto the process-wide `Module::shared` modules.
    modules: HashMap<usize, Arc<Module>>,
    functions: HashMap<usize, Function>,
    streams: HashMap<usize, ()>,
    events: HashMap<usize, Event>,
}

/// Figures NVML reads without waiting for a launch to finish.
pub static MEM_CURRENT: AtomicU64 = AtomicU64::new(0);
pub static BUSY: AtomicBool = AtomicBool::new(false);
/// Set when a launch starts, cleared by NVML's utilisation query: a kernel ran during the
/// sample period that query reports on (NVML's figure is "percent of time over the past sample
/// period during which one or more kernels was executing", so a launch that starts and ends
/// between two queries still shows in the second).
pub static BUSY_SINCE_QUERY: AtomicBool = AtomicBool::new(false);
pub static LAUNCHES: AtomicU64 = AtomicU64::new(0);
/// Device-to-host copies asked for (`cuMemcpyDtoH*`), each call counted once whatever its size:
/// what a test reads to prove a loop never waits on the device for a value
/// ([`vmcuda_device_to_host_copies`]).
pub static DTOH_COPIES: AtomicU64 = AtomicU64::new(0);

/// The count of [`DTOH_COPIES`] so far, exported for tests that load this driver: not a CUDA
/// entry point.
#[no_mangle]
pub extern "C" fn vmcuda_device_to_host_copies() -> u64 {
    DTOH_COPIES.load(Ordering::Relaxed)
}

/// Device allocations made (`cuMemAlloc_v2`, the one allocating entry point this driver
/// implements; the pool and host allocators are stubs that fail).
pub static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
/// Device frees asked for (`cuMemFree_v2`).
pub static FREES: AtomicU64 = AtomicU64::new(0);
/// Calls that make the host wait for the device: `cuCtxSynchronize`, `cuStreamSynchronize`,
/// `cuEventSynchronize` and the synchronous copies (`cuMemcpyHtoD_v2`, `cuMemcpyDtoH_v2`,
/// `cuMemcpyDtoD_v2`), which on a GPU return once the device has done them.
pub static HOST_SYNCHRONIZATIONS: AtomicU64 = AtomicU64::new(0);
/// Host-to-device copies (`cuMemcpyHtoD*`, synchronous or not): a loop a CUDA graph replays
/// must not depend on one.
pub static HTOD_COPIES: AtomicU64 = AtomicU64::new(0);

/// The counters a test reads to prove a loop graph-capturable, in this order: allocations,
/// frees, host synchronisations, host-to-device copies, device-to-host copies, launches. Written
/// to `out` (six u64); not a CUDA entry point.
///
/// # Safety
/// `out` must point to six writable u64.
#[no_mangle]
pub unsafe extern "C" fn vmcuda_counters(out: *mut u64) {
    let values = [
        ALLOCATIONS.load(Ordering::Relaxed),
        FREES.load(Ordering::Relaxed),
        HOST_SYNCHRONIZATIONS.load(Ordering::Relaxed),
        HTOD_COPIES.load(Ordering::Relaxed),
        DTOH_COPIES.load(Ordering::Relaxed),
        LAUNCHES.load(Ordering::Relaxed),
    ];
    if !out.is_null() {
        // SAFETY: the caller gives six writable u64.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), out, values.len()) };
    }
}
/// References to the primary context (mirrors `State::primary_refs` for NVML's process list).
pub static PRIMARY_ACTIVE: AtomicU32 = AtomicU32::new(0);

/// The one primary context (any non-null value serves as the handle).
const PRIMARY: usize = 0xC0_0000;

thread_local! {
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

/// The environment's model, or why the environment does not name one (read once).
fn configured() -> &'static Result<Model, String> {
    static M: OnceLock<Result<Model, String>> = OnceLock::new();
    M.get_or_init(Model::from_env)
}

/// The modelled device. With a bad environment (see [`config_error`]) `cuInit` fails, so no
/// context is ever made on this fallback sm_80 model; it only lets queries answer.
pub fn model() -> &'static Model {
    static FALLBACK: OnceLock<Model> = OnceLock::new();
    match configured() {
        Ok(m) => m,
        Err(_) => FALLBACK.get_or_init(|| Model::from_vars(None, None).expect("the defaults are valid")),
    }
}

/// Why the environment's `VM_CUDA_*` variables do not describe a device, if they do not.
pub fn config_error() -> Option<&'static str> {
    configured().as_ref().err().map(String::as_str)
}

/// The device's UUID as NVML and `nvidia-smi` write it.
pub fn uuid_string(m: &Model) -> String {
    let hex: String = m.uuid.iter().map(|x| format!("{x:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &hex[0..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..32])
}

pub fn state() -> MutexGuard<'static, State> {
    static S: OnceLock<Mutex<State>> = OnceLock::new();
    S.get_or_init(|| {
        let model = model().clone();
        let mut vm = Vm::new();
        let mut lim: DeviceLimits = vm.limits();
        lim.max_shared_per_block = model.smem_optin as u32;
        lim.shared_per_block_default = model.smem_per_block as u32;
        lim.memory_bytes = model.memory_bytes;
        vm.set_limits(lim);
        // VM_CUDA_ALLOW=initcheck,racecheck: the shared-memory checks memattn's --vm-allow turns off.
        let allow = std::env::var("VM_CUDA_ALLOW").unwrap_or_default();
        vm.set_initcheck(!allow.split(',').any(|a| a.trim() == "initcheck"));
        vm.set_racecheck(!allow.split(',').any(|a| a.trim() == "racecheck"));
        Mutex::new(State {
            initialised: false,
            model,
            vm,
            primary_refs: 0,
            next_handle: 0x1000,
            modules: HashMap::new(),
            functions: HashMap::new(),
            streams: HashMap::new(),
            events: HashMap::new(),
        })
    })
    .lock()
    .unwrap_or_else(|p| p.into_inner())
}

impl State {
    fn handle(&mut self) -> usize {
        self.next_handle += 0x10;
        self.next_handle
    }
    fn ready(&self) -> Result<(), CUresult> {
        if !self.initialised {
            return Err(NOT_INITIALIZED);
        }
        Ok(())
    }
    /// Initialised and a current context on this thread.
    fn ctx(&self) -> Result<(), CUresult> {
        self.ready()?;
        if CURRENT.with(|c| c.get()) != PRIMARY || self.primary_refs == 0 {
            return Err(INVALID_CONTEXT);
        }
        Ok(())
    }
    fn stream(&self, s: Handle) -> Result<(), CUresult> {
        self.ctx()?;
        let s = s as usize;
        // 0 is the legacy default stream, 1 and 2 the legacy and per-thread handles.
        if s <= 2 || self.streams.contains_key(&s) {
            Ok(())
        } else {
            Err(INVALID_HANDLE)
        }
    }
    fn sync_memory(&self) {
        MEM_CURRENT.store(self.vm.memory().current_bytes, Ordering::Relaxed);
    }
}

/// The extra text `cuGetErrorString` appends for the last error of each code.
fn details() -> MutexGuard<'static, HashMap<CUresult, &'static CStr>> {
    static D: OnceLock<Mutex<HashMap<CUresult, &'static CStr>>> = OnceLock::new();
    D.get_or_init(|| Mutex::new(HashMap::new())).lock().unwrap_or_else(|p| p.into_inner())
}

/// Fails with `code`, remembering `detail` for `cuGetErrorString`.
pub fn fail(code: CUresult, detail: impl Into<String>) -> CUresult {
    let base = ERRORS.iter().find(|e| e.0 == code).map(|e| e.2).unwrap_or("error");
    let text = format!("{base} ({})", detail.into().replace('\0', " "));
    let mut d = details();
    if d.get(&code).is_some_and(|s| s.to_bytes() == text.as_bytes()) {
        return code;
    }
    // The string must outlive every caller that holds the pointer: it is leaked (a repeated
    // error reuses it, so a loop of failing calls does not grow memory).
    let s: &'static CStr = Box::leak(CString::new(text).unwrap_or_default().into_boxed_c_str());
    d.insert(code, s);
    code
}

/// Runs an entry point: a panic becomes `CUDA_ERROR_UNKNOWN` instead of crossing the C ABI.
fn entry(f: impl FnOnce() -> Result<(), CUresult>) -> CUresult {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => fail(UNKNOWN, "internal error in the VM-backed driver"),
    }
}

unsafe fn out<T>(p: *mut T, v: T) -> Result<(), CUresult> {
    if p.is_null() {
        return Err(INVALID_VALUE);
    }
    p.write(v);
    Ok(())
}

fn vm_err(op: &str, e: VmError) -> CUresult {
    let code = match &e {
        VmError::OutOfMemory { .. } | VmError::HostMemory { .. } => OUT_OF_MEMORY,
        VmError::InvalidPointer(_) => INVALID_VALUE,
        VmError::InvalidLaunch(_) => INVALID_VALUE,
        VmError::UnknownKernel(_) => INVALID_HANDLE,
        VmError::Load(_) => INVALID_PTX,
        VmError::Memcheck(f) if f.kind.contains("misaligned") => MISALIGNED_ADDRESS,
        VmError::Memcheck(f)
            if f.kind.contains("out-of-bounds") || f.kind.contains("use after free") || f.kind.contains("window") =>
        {
            ILLEGAL_ADDRESS
        }
        VmError::Memcheck(_) => LAUNCH_FAILED,
        VmError::Trap(f) if f.kind.starts_with("instruction budget") => LAUNCH_TIMEOUT,
        VmError::Trap(_) => LAUNCH_FAILED,
    };
    fail(code, format!("{op}: {e}"))
}

/// Names of the driver functions this library implements.
pub fn implemented_functions() -> &'static [&'static str] {
    IMPLEMENTED
}

/// Names of the driver functions that exist only to return `CUDA_ERROR_NOT_SUPPORTED`.
pub fn stubbed_functions() -> &'static [&'static str] {
    crate::stubs::STUBBED
}

const IMPLEMENTED: &[&str] = &[
    "cuGetErrorName",
    "cuGetErrorString",
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetName",
    "cuDeviceGetUuid",
    "cuDeviceGetUuid_v2",
    "cuDeviceTotalMem_v2",
    "cuDeviceGetAttribute",
    "cuDeviceComputeCapability",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuDevicePrimaryCtxGetState",
    "cuDevicePrimaryCtxSetFlags_v2",
    "cuDevicePrimaryCtxReset_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxGetDevice",
    "cuCtxSynchronize",
    "cuCtxGetApiVersion",
    "cuModuleLoadData",
    "cuModuleLoadDataEx",
    "cuModuleUnload",
    "cuModuleGetFunction",
    "cuModuleGetGlobal_v2",
    "cuFuncGetAttribute",
    "cuFuncSetAttribute",
    "cuFuncSetCacheConfig",
    "cuLaunchKernel",
    "cuStreamCreate",
    "cuStreamCreateWithPriority",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventQuery",
    "cuEventElapsedTime",
    "cuEventElapsedTime_v2",
    "cuMemGetInfo_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyDtoD_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemsetD8_v2",
    "cuTensorMapEncodeTiled",
    "cuMemsetD16_v2",
    "cuMemsetD32_v2",
    "cuMemsetD8Async",
    "cuMemsetD16Async",
    "cuMemsetD32Async",
];

/// Marks this library as the VM-backed driver (memattn's `doctor` says so): the version as
/// major * 1000 + minor * 10 + patch of the `vm-cuda` crate.
#[no_mangle]
pub extern "C" fn vmCudaDriverVersion() -> c_uint {
    let v = |s: &str| s.parse::<c_uint>().unwrap_or(0);
    v(env!("CARGO_PKG_VERSION_MAJOR")) * 1000
        + v(env!("CARGO_PKG_VERSION_MINOR")) * 10
        + v(env!("CARGO_PKG_VERSION_PATCH"))
}

// ---- errors ----

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, p_str: *mut *const c_char) -> CUresult {
    static NAMES: OnceLock<Vec<(CUresult, CString)>> = OnceLock::new();
    let names = NAMES.get_or_init(|| ERRORS.iter().map(|e| (e.0, CString::new(e.1).unwrap_or_default())).collect());
    match names.iter().find(|n| n.0 == error) {
        Some((_, s)) => entry(|| out(p_str, s.as_ptr())),
        None => INVALID_VALUE,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(error: CUresult, p_str: *mut *const c_char) -> CUresult {
    static TEXTS: OnceLock<Vec<(CUresult, CString)>> = OnceLock::new();
    let texts = TEXTS.get_or_init(|| ERRORS.iter().map(|e| (e.0, CString::new(e.2).unwrap_or_default())).collect());
    if let Some(d) = details().get(&error) {
        return entry(|| out(p_str, d.as_ptr()));
    }
    match texts.iter().find(|n| n.0 == error) {
        Some((_, s)) => entry(|| out(p_str, s.as_ptr())),
        None => INVALID_VALUE,
    }
}

// ---- init, version, device ----

#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    entry(|| {
        if flags != 0 {
            return Err(fail(INVALID_VALUE, "cuInit flags must be 0"));
        }
        if let Some(why) = config_error() {
            return Err(fail(INVALID_VALUE, why));
        }
        state().initialised = true;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    entry(|| out(version, 12080))
}

fn device(s: &State, dev: CUdevice) -> Result<(), CUresult> {
    s.ready()?;
    if dev != 0 {
        return Err(fail(INVALID_DEVICE, format!("device {dev}: the VM-backed driver has one device, 0")));
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device_out: *mut CUdevice, ordinal: c_int) -> CUresult {
    entry(|| {
        device(&state(), ordinal)?;
        out(device_out, 0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    entry(|| {
        state().ready()?;
        out(count, 1)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    entry(|| {
        let s = state();
        device(&s, dev)?;
        if name.is_null() || len <= 0 {
            return Err(INVALID_VALUE);
        }
        let bytes = s.model.name.as_bytes();
        let n = bytes.len().min(len as usize - 1);
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), name as *mut u8, n);
        *name.add(n) = 0;
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    cu_device_get_uuid(uuid, dev)
}

/// The body of `cuDeviceGetUuid`, called directly by the entry points that forward to it (a call to the
/// exported symbol itself would go through the dynamic loader, as if the host had resolved it).
unsafe fn cu_device_get_uuid(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    entry(|| {
        let s = state();
        device(&s, dev)?;
        out(uuid, s.model.uuid)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    cu_device_get_uuid(uuid, dev)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    entry(|| {
        let s = state();
        device(&s, dev)?;
        out(bytes, s.model.memory_bytes as usize)
    })
}

/// The device attributes the model has values for (`CUdevice_attribute` numbers).
pub fn attribute(m: &Model, attrib: c_int) -> Option<c_int> {
    Some(match attrib {
        1 => 1024,             // MAX_THREADS_PER_BLOCK
        2 | 3 => 1024,         // MAX_BLOCK_DIM_X, _Y
        4 => 64,               // MAX_BLOCK_DIM_Z
        5 => i32::MAX,         // MAX_GRID_DIM_X
        6 | 7 => 65535,        // MAX_GRID_DIM_Y, _Z
        8 => m.smem_per_block, // MAX_SHARED_MEMORY_PER_BLOCK
        9 => 65536,            // TOTAL_CONSTANT_MEMORY
        10 => 32,              // WARP_SIZE
        12 => 65536,           // MAX_REGISTERS_PER_BLOCK
        13 => m.clock_khz,     // CLOCK_RATE
        16 => m.sms,           // MULTIPROCESSOR_COUNT
        18 => 0,               // INTEGRATED
        19 => 0,               // CAN_MAP_HOST_MEMORY (no pinned/mapped host memory)
        20 => 0,               // COMPUTE_MODE: default
        31 => 0,               // CONCURRENT_KERNELS (launches run one at a time)
        32 => 0,               // ECC_ENABLED
        33 | 34 | 50 => 0,     // PCI bus, device, domain
        38 => m.l2_bytes,      // L2_CACHE_SIZE
        39 => 2048,            // MAX_THREADS_PER_MULTIPROCESSOR
        40 => 0,               // ASYNC_ENGINE_COUNT
        41 => 1,               // UNIFIED_ADDRESSING
        75 => m.cc.0,          // COMPUTE_CAPABILITY_MAJOR
        76 => m.cc.1,          // COMPUTE_CAPABILITY_MINOR
        81 => m.smem_per_sm,   // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
        82 => 65536,           // MAX_REGISTERS_PER_MULTIPROCESSOR
        83 => 0,               // MANAGED_MEMORY
        95 => 0,               // COOPERATIVE_LAUNCH
        97 => m.smem_optin,    // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        106 => 32,             // MAX_BLOCKS_PER_MULTIPROCESSOR
        115 => 0,              // MEMORY_POOLS_SUPPORTED (cudarc then uses cuMemAlloc)
        _ => return None,
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(pi: *mut c_int, attrib: c_int, dev: CUdevice) -> CUresult {
    entry(|| {
        let s = state();
        device(&s, dev)?;
        match attribute(&s.model, attrib) {
            Some(v) => out(pi, v),
            None => {
                Err(fail(NOT_SUPPORTED, format!("device attribute {attrib} is not modelled by the VM-backed driver")))
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceComputeCapability(major: *mut c_int, minor: *mut c_int, dev: CUdevice) -> CUresult {
    entry(|| {
        let s = state();
        device(&s, dev)?;
        out(major, s.model.cc.0)?;
        out(minor, s.model.cc.1)
    })
}

// ---- contexts ----

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut Handle, dev: CUdevice) -> CUresult {
    entry(|| {
        let mut s = state();
        device(&s, dev)?;
        out(pctx, PRIMARY as Handle)?;
        s.primary_refs += 1;
        PRIMARY_ACTIVE.store(s.primary_refs, Ordering::Relaxed);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    entry(|| {
        let mut s = state();
        device(&s, dev)?;
        if s.primary_refs == 0 {
            return Err(fail(INVALID_CONTEXT, "the primary context was not retained"));
        }
        s.primary_refs -= 1;
        PRIMARY_ACTIVE.store(s.primary_refs, Ordering::Relaxed);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut c_int) -> CUresult {
    entry(|| {
        let s = state();
        device(&s, dev)?;
        out(flags, 0)?;
        out(active, (s.primary_refs > 0) as c_int)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, _flags: c_uint) -> CUresult {
    entry(|| device(&state(), dev))
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult {
    entry(|| device(&state(), dev))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut Handle) -> CUresult {
    entry(|| {
        state().ready()?;
        out(pctx, CURRENT.with(|c| c.get()) as Handle)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: Handle) -> CUresult {
    cu_ctx_set_current(ctx)
}

/// The body of `cuCtxSetCurrent`, called directly by the entry points that forward to it (a call to the
/// exported symbol itself would go through the dynamic loader, as if the host had resolved it).
unsafe fn cu_ctx_set_current(ctx: Handle) -> CUresult {
    entry(|| {
        state().ready()?;
        let c = ctx as usize;
        if c != 0 && c != PRIMARY {
            return Err(fail(INVALID_CONTEXT, "not a context of the VM-backed driver"));
        }
        CURRENT.with(|cur| cur.set(c));
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: Handle) -> CUresult {
    cu_ctx_set_current(ctx)
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(pctx: *mut Handle) -> CUresult {
    entry(|| {
        state().ready()?;
        let c = CURRENT.with(|cur| cur.replace(0));
        if !pctx.is_null() {
            *pctx = c as Handle;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut CUdevice) -> CUresult {
    entry(|| {
        state().ctx()?;
        out(dev, 0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetApiVersion(ctx: Handle, version: *mut c_uint) -> CUresult {
    entry(|| {
        state().ready()?;
        if ctx as usize != PRIMARY && !ctx.is_null() {
            return Err(INVALID_CONTEXT);
        }
        out(version, 3020)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    HOST_SYNCHRONIZATIONS.fetch_add(1, Ordering::Relaxed);
    entry(|| state().ctx())
}

// ---- modules and functions ----

const JIT_INFO_LOG_BUFFER: c_int = 3;
const JIT_INFO_LOG_BUFFER_SIZE_BYTES: c_int = 4;
const JIT_ERROR_LOG_BUFFER: c_int = 5;
const JIT_ERROR_LOG_BUFFER_SIZE_BYTES: c_int = 6;

fn load_module(s: &mut State, image: *const c_void) -> Result<usize, (CUresult, String)> {
    if image.is_null() {
        return Err((INVALID_VALUE, "no image".into()));
    }
    // The first bytes say what kind of image it is; stop at a NUL (a short PTX text).
    let mut head = [0u8; 4];
    for (i, b) in head.iter_mut().enumerate() {
        // SAFETY: the caller passes a readable image; bytes up to the first NUL are part of it.
        *b = unsafe { *(image as *const u8).add(i) };
        if *b == 0 {
            break;
        }
    }
    if &head == b"\x7fELF" {
        return Err((INVALID_IMAGE, "ptx-vm: cubin (ELF) images are not supported; load PTX text".into()));
    }
    if head == [0x50, 0xed, 0x55, 0xba] || head == [0x46, 0x62, 0xc1, 0x46] {
        return Err((INVALID_IMAGE, "ptx-vm: fatbin images are not supported; load PTX text".into()));
    }
    // SAFETY: PTX images are NUL-terminated text.
    let text = unsafe { CStr::from_ptr(image as *const c_char) };
    let text = text.to_str().map_err(|_| (INVALID_PTX, "ptx-vm: the PTX text is not UTF-8".to_string()))?;
    // One parse per distinct text per process; every entry is decoded here (once per process
    // too), so PTX the VM cannot run fails at load as with a JIT.
    let module = Module::shared(text).map_err(|e| (INVALID_PTX, format!("ptx-vm: {e}")))?;
    module.check_all().map_err(|e| (INVALID_PTX, format!("ptx-vm: {e}")))?;
    let (_, target) = module.version_and_target();
    let sm: Option<i32> = target.trim_start_matches("sm_").trim_end_matches(['a', 'f']).parse().ok();
    let device_sm = s.model.cc.0 * 10 + s.model.cc.1;
    if let Some(sm) = sm {
        if sm > device_sm {
            return Err((INVALID_PTX, format!("ptx-vm: .target {target} is higher than the device's sm_{device_sm}")));
        }
    }
    let h = s.handle();
    s.modules.insert(h, module);
    Ok(h)
}

unsafe fn write_log(buf: *mut c_void, size: usize, text: &str) {
    if buf.is_null() || size == 0 {
        return;
    }
    let n = text.len().min(size - 1);
    std::ptr::copy_nonoverlapping(text.as_ptr(), buf as *mut u8, n);
    *(buf as *mut u8).add(n) = 0;
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadDataEx(
    module: *mut Handle,
    image: *const c_void,
    num_options: c_uint,
    options: *mut c_int,
    option_values: *mut *mut c_void,
) -> CUresult {
    cu_module_load_data_ex(module, image, num_options, options, option_values)
}

/// The body of `cuModuleLoadDataEx`, called directly by the entry points that forward to it (a call to the
/// exported symbol itself would go through the dynamic loader, as if the host had resolved it).
unsafe fn cu_module_load_data_ex(
    module: *mut Handle,
    image: *const c_void,
    num_options: c_uint,
    options: *mut c_int,
    option_values: *mut *mut c_void,
) -> CUresult {
    entry(|| {
        let mut s = state();
        s.ctx()?;
        if module.is_null() || (num_options > 0 && (options.is_null() || option_values.is_null())) {
            return Err(INVALID_VALUE);
        }
        let (mut err_buf, mut err_size, mut info_buf, mut info_size) =
            (std::ptr::null_mut(), 0usize, std::ptr::null_mut(), 0usize);
        let (mut err_size_at, mut info_size_at) = (None, None);
        for i in 0..num_options as usize {
            let v = *option_values.add(i);
            match *options.add(i) {
                JIT_ERROR_LOG_BUFFER => err_buf = v,
                JIT_ERROR_LOG_BUFFER_SIZE_BYTES => {
                    err_size = v as usize;
                    err_size_at = Some(i);
                }
                JIT_INFO_LOG_BUFFER => info_buf = v,
                JIT_INFO_LOG_BUFFER_SIZE_BYTES => {
                    info_size = v as usize;
                    info_size_at = Some(i);
                }
                _ => {} // optimisation level, register caps and the like do not apply
            }
        }
        let set_size = |at: Option<usize>, n: usize| {
            if let Some(i) = at {
                *option_values.add(i) = n as *mut c_void;
            }
        };
        match load_module(&mut s, image) {
            Ok(h) => {
                let msg = "ptx-vm: module decoded for the VM";
                write_log(info_buf, info_size, msg);
                set_size(info_size_at, if info_size > 0 { msg.len().min(info_size - 1) + 1 } else { 0 });
                set_size(err_size_at, 0);
                *module = h as Handle;
                Ok(())
            }
            Err((code, log)) => {
                write_log(err_buf, err_size, &log);
                set_size(err_size_at, if err_size > 0 { log.len().min(err_size - 1) + 1 } else { 0 });
                Err(fail(code, log))
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut Handle, image: *const c_void) -> CUresult {
    cu_module_load_data_ex(module, image, 0, std::ptr::null_mut(), std::ptr::null_mut())
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleUnload(module: Handle) -> CUresult {
    entry(|| {
        let mut s = state();
        s.ready()?;
        let h = module as usize;
        let Some(m) = s.modules.remove(&h) else {
            return Err(fail(INVALID_HANDLE, "cuModuleUnload: not a loaded module"));
        };
        // The last handle onto the module: drop its globals, so a later load of the same text
        // starts from the initialisers as on a GPU.
        if !s.modules.values().any(|o| Arc::ptr_eq(o, &m)) {
            s.vm.release_globals(&m);
        }
        s.functions.retain(|_, f| f.module != h);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(hfunc: *mut Handle, module: Handle, name: *const c_char) -> CUresult {
    entry(|| {
        let mut s = state();
        s.ctx()?;
        if hfunc.is_null() || name.is_null() {
            return Err(INVALID_VALUE);
        }
        let name = CStr::from_ptr(name).to_string_lossy().into_owned();
        let m = module as usize;
        let info = match s.modules.get(&m) {
            None => return Err(fail(INVALID_HANDLE, "cuModuleGetFunction: not a loaded module")),
            Some(module) => module.kernel(&name),
        };
        let Some(info) = info else {
            return Err(fail(NOT_FOUND, format!("the module has no kernel named `{name}`")));
        };
        if let Some((&h, _)) = s.functions.iter().find(|(_, f)| f.module == m && f.name == name) {
            return out(hfunc, h as Handle);
        }
        let h = s.handle();
        let max_dynamic_smem = s.model.smem_per_block - info.static_shared_bytes as i32;
        s.functions.insert(h, Function { module: m, name, info, max_dynamic_smem });
        out(hfunc, h as Handle)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetGlobal_v2(
    dptr: *mut CUdeviceptr,
    bytes: *mut usize,
    module: Handle,
    name: *const c_char,
) -> CUresult {
    entry(|| {
        let mut s = state();
        s.ctx()?;
        if name.is_null() {
            return Err(INVALID_VALUE);
        }
        let name = CStr::from_ptr(name).to_string_lossy().into_owned();
        let st = &mut *s;
        let module = st.modules.get(&(module as usize)).ok_or(INVALID_HANDLE)?;
        let a = st.vm.global_address(module, &name).ok_or_else(|| fail(NOT_FOUND, format!("no global `{name}`")))?;
        if !dptr.is_null() {
            *dptr = a;
        }
        if !bytes.is_null() {
            // The VM does not report the variable's size.
            return Err(fail(NOT_SUPPORTED, "the size of a module global is not modelled (pass NULL for bytes)"));
        }
        Ok(())
    })
}

const FUNC_MAX_THREADS_PER_BLOCK: c_int = 0;
const FUNC_SHARED_SIZE_BYTES: c_int = 1;
const FUNC_CONST_SIZE_BYTES: c_int = 2;
const FUNC_LOCAL_SIZE_BYTES: c_int = 3;
const FUNC_PTX_VERSION: c_int = 5;
const FUNC_BINARY_VERSION: c_int = 6;
const FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES: c_int = 8;

#[no_mangle]
pub unsafe extern "C" fn cuFuncGetAttribute(pi: *mut c_int, attrib: c_int, hfunc: Handle) -> CUresult {
    entry(|| {
        let s = state();
        s.ctx()?;
        let f = s.functions.get(&(hfunc as usize)).ok_or(INVALID_HANDLE)?;
        let v = match attrib {
            FUNC_MAX_THREADS_PER_BLOCK => 1024,
            FUNC_SHARED_SIZE_BYTES => f.info.static_shared_bytes as c_int,
            FUNC_CONST_SIZE_BYTES => 0,
            FUNC_LOCAL_SIZE_BYTES => f.info.local_bytes as c_int,
            FUNC_PTX_VERSION => {
                let (v, _) = s.modules[&f.module].version_and_target();
                let mut it = v.split('.').map(|x| x.parse::<c_int>().unwrap_or(0));
                it.next().unwrap_or(0) * 10 + it.next().unwrap_or(0)
            }
            FUNC_BINARY_VERSION => s.model.cc.0 * 10 + s.model.cc.1,
            FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES => f.max_dynamic_smem,
            _ => {
                return Err(fail(
                    NOT_SUPPORTED,
                    format!("function attribute {attrib} is not modelled (no register allocation in the VM)"),
                ))
            }
        };
        out(pi, v)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncSetAttribute(hfunc: Handle, attrib: c_int, value: c_int) -> CUresult {
    entry(|| {
        let mut s = state();
        s.ctx()?;
        let optin = s.model.smem_optin;
        let f = s.functions.get_mut(&(hfunc as usize)).ok_or(INVALID_HANDLE)?;
        match attrib {
            FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES => {
                let limit = optin - f.info.static_shared_bytes as c_int;
                if value < 0 || value > limit {
                    return Err(fail(
                        INVALID_VALUE,
                        format!(
                            "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = {value} for `{}`: at most {limit} (opt-in limit {optin} minus {} static bytes)",
                            f.name, f.info.static_shared_bytes
                        ),
                    ));
                }
                f.max_dynamic_smem = value;
                Ok(())
            }
            9 => Ok(()), // PREFERRED_SHARED_MEMORY_CARVEOUT: a hint
            _ => Err(fail(NOT_SUPPORTED, format!("setting function attribute {attrib} is not modelled"))),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncSetCacheConfig(hfunc: Handle, _config: c_int) -> CUresult {
    entry(|| {
        let s = state();
        s.ctx()?;
        s.functions.get(&(hfunc as usize)).map(|_| ()).ok_or(INVALID_HANDLE)
    })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: Handle,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared_mem_bytes: c_uint,
    stream: Handle,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    entry(|| {
        let mut s = state();
        s.stream(stream)?;
        let st = &mut *s;
        let func = st
            .functions
            .get(&(f as usize))
            .ok_or_else(|| fail(INVALID_HANDLE, "cuLaunchKernel: not a function handle"))?;
        if !extra.is_null() && !(*extra).is_null() {
            return Err(fail(
                NOT_SUPPORTED,
                "cuLaunchKernel: `extra` (CU_LAUNCH_PARAM_BUFFER_POINTER) is not modelled; pass kernelParams",
            ));
        }
        let info = &func.info;
        if shared_mem_bytes as i64 > func.max_dynamic_smem as i64 {
            return Err(fail(
                INVALID_VALUE,
                format!(
                    "launch of `{}` with {shared_mem_bytes} bytes of dynamic shared memory: the function allows {} (raise CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES with cuFuncSetAttribute, up to {} on this device)",
                    func.name,
                    func.max_dynamic_smem,
                    st.model.smem_optin - info.static_shared_bytes as i32
                ),
            ));
        }
        let mut params = vec![0u8; info.param_bytes];
        if !info.params.is_empty() && kernel_params.is_null() {
            return Err(fail(INVALID_VALUE, format!("launch of `{}`: kernelParams is NULL", func.name)));
        }
        for (i, p) in info.params.iter().enumerate() {
            let src = *kernel_params.add(i) as *const u8;
            if src.is_null() {
                return Err(fail(INVALID_VALUE, format!("launch of `{}`: kernelParams[{i}] is NULL", func.name)));
            }
            std::ptr::copy_nonoverlapping(src, params.as_mut_ptr().add(p.offset), p.size);
        }
        let module = &st.modules[&func.module];
        let config = LaunchConfig::new([gx, gy, gz], [bx, by, bz], shared_mem_bytes);
        let name = func.name.clone();
        BUSY.store(true, Ordering::Relaxed);
        BUSY_SINCE_QUERY.store(true, Ordering::Relaxed);
        let r = st.vm.launch(module, &name, &config, &params);
        BUSY.store(false, Ordering::Relaxed);
        LAUNCHES.fetch_add(1, Ordering::Relaxed);
        r.map(|_| ()).map_err(|e| vm_err(&format!("launch of `{name}`"), e))
    })
}

// ---- streams and events ----

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(ph: *mut Handle, _flags: c_uint) -> CUresult {
    cu_stream_create(ph, _flags)
}

/// The body of `cuStreamCreate`, called directly by the entry points that forward to it (a call to the
/// exported symbol itself would go through the dynamic loader, as if the host had resolved it).
unsafe fn cu_stream_create(ph: *mut Handle, _flags: c_uint) -> CUresult {
    entry(|| {
        let mut s = state();
        s.ctx()?;
        if ph.is_null() {
            return Err(INVALID_VALUE);
        }
        let h = s.handle();
        s.streams.insert(h, ());
        out(ph, h as Handle)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(ph: *mut Handle, flags: c_uint, _priority: c_int) -> CUresult {
    cu_stream_create(ph, flags)
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(h: Handle) -> CUresult {
    entry(|| {
        let mut s = state();
        s.ctx()?;
        s.streams.remove(&(h as usize)).ok_or(INVALID_HANDLE)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(h: Handle) -> CUresult {
    HOST_SYNCHRONIZATIONS.fetch_add(1, Ordering::Relaxed);
    entry(|| state().stream(h))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery(h: Handle) -> CUresult {
    entry(|| state().stream(h))
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(h: Handle, event: Handle, _flags: c_uint) -> CUresult {
    entry(|| {
        let s = state();
        s.stream(h)?;
        s.events.get(&(event as usize)).map(|_| ()).ok_or(INVALID_HANDLE)
    })
}

const EVENT_DISABLE_TIMING: c_uint = 2;

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(ph: *mut Handle, flags: c_uint) -> CUresult {
    entry(|| {
        let mut s = state();
        s.ctx()?;
        if ph.is_null() {
            return Err(INVALID_VALUE);
        }
        let h = s.handle();
        s.events.insert(h, Event { recorded: None, timing: flags & EVENT_DISABLE_TIMING == 0 });
        out(ph, h as Handle)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(h: Handle) -> CUresult {
    entry(|| {
        let mut s = state();
        s.ready()?;
        s.events.remove(&(h as usize)).map(|_| ()).ok_or(INVALID_HANDLE)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(h: Handle, stream: Handle) -> CUresult {
    entry(|| {
        let mut s = state();
        s.stream(stream)?;
        // Everything before this call has completed: the event completes now.
        s.events.get_mut(&(h as usize)).ok_or(INVALID_HANDLE)?.recorded = Some(Instant::now());
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(h: Handle) -> CUresult {
    HOST_SYNCHRONIZATIONS.fetch_add(1, Ordering::Relaxed);
    cu_event_synchronize(h)
}

/// The body of `cuEventSynchronize`, called directly by the entry points that forward to it (a call to the
/// exported symbol itself would go through the dynamic loader, as if the host had resolved it).
unsafe fn cu_event_synchronize(h: Handle) -> CUresult {
    entry(|| {
        let s = state();
        s.ctx()?;
        s.events.get(&(h as usize)).map(|_| ()).ok_or(INVALID_HANDLE)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(h: Handle) -> CUresult {
    cu_event_synchronize(h)
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, start: Handle, end: Handle) -> CUresult {
    cu_event_elapsed_time(ms, start, end)
}

/// The body of `cuEventElapsedTime`, called directly by the entry points that forward to it (a call to the
/// exported symbol itself would go through the dynamic loader, as if the host had resolved it).
unsafe fn cu_event_elapsed_time(ms: *mut f32, start: Handle, end: Handle) -> CUresult {
    entry(|| {
        let s = state();
        s.ctx()?;
        let (a, b) = (s.events.get(&(start as usize)), s.events.get(&(end as usize)));
        let (Some(a), Some(b)) = (a, b) else { return Err(INVALID_HANDLE) };
        if !a.timing || !b.timing {
            return Err(fail(INVALID_HANDLE, "an event was created with CU_EVENT_DISABLE_TIMING"));
        }
        let (Some(ta), Some(tb)) = (a.recorded, b.recorded) else {
            return Err(fail(INVALID_HANDLE, "an event has not been recorded"));
        };
        let d = if tb >= ta { (tb - ta).as_secs_f64() } else { -(ta - tb).as_secs_f64() };
        out(ms, (d * 1e3) as f32)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime_v2(ms: *mut f32, start: Handle, end: Handle) -> CUresult {
    cu_event_elapsed_time(ms, start, end)
}

// ---- memory ----

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    entry(|| {
        let s = state();
        s.ctx()?;
        let used = s.vm.memory().current_bytes;
        out(free, s.model.memory_bytes.saturating_sub(used) as usize)?;
        out(total, s.model.memory_bytes as usize)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    entry(|| {
        let mut s = state();
        s.ctx()?;
        if dptr.is_null() || bytes == 0 {
            return Err(INVALID_VALUE);
        }
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        let p = s.vm.alloc(bytes as u64).map_err(|e| vm_err("cuMemAlloc", e))?;
        s.sync_memory();
        out(dptr, p)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    FREES.fetch_add(1, Ordering::Relaxed);
    entry(|| {
        let mut s = state();
        s.ctx()?;
        s.vm.free(dptr).map_err(|e| vm_err("cuMemFree", e))?;
        s.sync_memory();
        Ok(())
    })
}

unsafe fn htod(dst: CUdeviceptr, src: *const c_void, n: usize, stream: Handle) -> CUresult {
    HTOD_COPIES.fetch_add(1, Ordering::Relaxed);
    entry(|| {
        let mut s = state();
        s.stream(stream)?;
        if n == 0 {
            return Ok(());
        }
        if src.is_null() {
            return Err(INVALID_VALUE);
        }
        let data = std::slice::from_raw_parts(src as *const u8, n);
        s.vm.write(dst, data).map_err(|e| vm_err("cuMemcpyHtoD", e))
    })
}

unsafe fn dtoh(dst: *mut c_void, src: CUdeviceptr, n: usize, stream: Handle) -> CUresult {
    DTOH_COPIES.fetch_add(1, Ordering::Relaxed);
    entry(|| {
        let s = state();
        s.stream(stream)?;
        if n == 0 {
            return Ok(());
        }
        if dst.is_null() {
            return Err(INVALID_VALUE);
        }
        let data = std::slice::from_raw_parts_mut(dst as *mut u8, n);
        s.vm.read(src, data).map_err(|e| vm_err("cuMemcpyDtoH", e))
    })
}

unsafe fn dtod(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: Handle) -> CUresult {
    entry(|| {
        let mut s = state();
        s.stream(stream)?;
        let mut tmp = vec![0u8; n];
        s.vm.read(src, &mut tmp).map_err(|e| vm_err("cuMemcpyDtoD (source)", e))?;
        s.vm.write(dst, &tmp).map_err(|e| vm_err("cuMemcpyDtoD (destination)", e))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize) -> CUresult {
    HOST_SYNCHRONIZATIONS.fetch_add(1, Ordering::Relaxed);
    htod(dst, src, n, std::ptr::null_mut())
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult {
    HOST_SYNCHRONIZATIONS.fetch_add(1, Ordering::Relaxed);
    dtoh(dst, src, n, std::ptr::null_mut())
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    HOST_SYNCHRONIZATIONS.fetch_add(1, Ordering::Relaxed);
    dtod(dst, src, n, std::ptr::null_mut())
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, n: usize, s: Handle) -> CUresult {
    htod(dst, src, n, s)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, n: usize, s: Handle) -> CUresult {
    dtoh(dst, src, n, s)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: Handle) -> CUresult {
    dtod(dst, src, n, s)
}

fn memset(dst: CUdeviceptr, pattern: &[u8], count: usize, stream: Handle) -> CUresult {
    entry(|| {
        let mut s = state();
        s.stream(stream)?;
        let data: Vec<u8> = pattern.iter().copied().cycle().take(pattern.len() * count).collect();
        if !(dst as usize).is_multiple_of(pattern.len()) {
            return Err(fail(INVALID_VALUE, format!("cuMemsetD{}: misaligned address", pattern.len() * 8)));
        }
        s.vm.write(dst, &data).map_err(|e| vm_err("cuMemset", e))
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8_v2(dst: CUdeviceptr, v: u8, n: usize) -> CUresult {
    memset(dst, &[v], n, std::ptr::null_mut())
}
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD16_v2(dst: CUdeviceptr, v: u16, n: usize) -> CUresult {
    memset(dst, &v.to_le_bytes(), n, std::ptr::null_mut())
}
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32_v2(dst: CUdeviceptr, v: c_uint, n: usize) -> CUresult {
    memset(dst, &v.to_le_bytes(), n, std::ptr::null_mut())
}
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8Async(dst: CUdeviceptr, v: u8, n: usize, s: Handle) -> CUresult {
    memset(dst, &[v], n, s)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD16Async(dst: CUdeviceptr, v: u16, n: usize, s: Handle) -> CUresult {
    memset(dst, &v.to_le_bytes(), n, s)
}
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32Async(dst: CUdeviceptr, v: c_uint, n: usize, s: Handle) -> CUresult {
    memset(dst, &v.to_le_bytes(), n, s)
}

// ---- tensor maps (Hopper TMA) ----

/// `cuTensorMapEncodeTiled`: the 128 bytes of a tiled tensor map in ptx-vm's own encoding
/// ([`ptx_vm::TensorMap`]), which the VM's `cp.async.bulk.tensor` reads from wherever the kernel
/// finds it (a map CUDA encoded means nothing to the VM, and this one nothing to a GPU). The
/// arguments are validated as CUDA validates them; an invalid one is `CUDA_ERROR_INVALID_VALUE`
/// with the rule it broke on stderr. Needs no context, as in CUDA.
#[no_mangle]
pub unsafe extern "C" fn cuTensorMapEncodeTiled(
    tensor_map: *mut [u8; 128],
    data_type: c_uint,
    rank: c_uint,
    global_address: *mut c_void,
    global_dim: *const u64,
    global_strides: *const u64,
    box_dim: *const c_uint,
    element_strides: *const c_uint,
    interleave: c_uint,
    swizzle: c_uint,
    l2_promotion: c_uint,
    oob_fill: c_uint,
) -> CUresult {
    entry(|| {
        if tensor_map.is_null() || global_dim.is_null() || box_dim.is_null() || element_strides.is_null() {
            return Err(INVALID_VALUE);
        }
        if !(1..=5).contains(&rank) || (rank > 1 && global_strides.is_null()) {
            return Err(fail(INVALID_VALUE, format!("cuTensorMapEncodeTiled: tensorRank {rank} (1..=5)")));
        }
        let r = rank as usize;
        // SAFETY: the caller passes arrays of `rank` (strides: `rank - 1`) entries.
        let (dims, strides, boxes, estrides) = unsafe {
            (
                std::slice::from_raw_parts(global_dim, r),
                if r > 1 { std::slice::from_raw_parts(global_strides, r - 1) } else { &[][..] },
                std::slice::from_raw_parts(box_dim, r),
                std::slice::from_raw_parts(element_strides, r),
            )
        };
        let map = ptx_vm::TensorMap::from_cuda_tiled(
            data_type,
            rank,
            global_address as u64,
            dims,
            strides,
            boxes,
            estrides,
            interleave,
            swizzle,
            l2_promotion,
            oob_fill,
        )
        .map_err(|e| fail(INVALID_VALUE, format!("cuTensorMapEncodeTiled: {e}")))?;
        // SAFETY: non-null, 128 writable bytes (a CUtensorMap).
        unsafe { tensor_map.write(map.encode()) };
        Ok(())
    })
}

#[cfg(test)]
mod env_tests {
    use super::*;

    #[test]
    fn bad_vm_cuda_variables_are_errors_naming_them() {
        for (arch, mib, needle) in [
            (None, Some("abc"), "VM_CUDA_MEMORY_MIB=abc"),
            (None, Some("-1"), "VM_CUDA_MEMORY_MIB=-1"),
            (None, Some("0"), "VM_CUDA_MEMORY_MIB=0"),
            (None, Some("17592186044416"), "VM_CUDA_MEMORY_MIB=17592186044416"),
            (Some("sm_20"), None, "VM_CUDA_ARCH=sm_20"),
        ] {
            let e = Model::from_vars(arch, mib).err().unwrap_or_else(|| panic!("{arch:?} {mib:?} accepted"));
            assert!(e.contains(needle), "{e}");
        }
    }

    #[test]
    fn good_vm_cuda_variables_and_defaults() {
        let d = Model::from_vars(None, None).unwrap();
        assert_eq!((d.cc, d.memory_bytes), ((8, 0), 16 << 30));
        let m = Model::from_vars(Some(" sm_90 "), Some("2")).unwrap();
        assert_eq!((m.cc, m.memory_bytes), ((9, 0), 2 << 20));
        assert_eq!(
            Model::from_vars(Some("sm_80"), Some(&MAX_MEMORY_MIB.to_string())).unwrap().memory_bytes,
            MAX_MEMORY_MIB << 20
        );
    }
}
