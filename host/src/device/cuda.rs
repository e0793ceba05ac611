//! The CUDA backend: one context (the device's primary context) on device 0, the default stream,
//! the module loaded once from the PTX text (JIT by the driver), functions looked up once and
//! cached. Memory comes from NVML (before, sampled peak, after; utilisation) and `cuMemGetInfo`;
//! time from CUDA events.
//!
//! The driver library is loaded at run time. `cudarc` panics when it cannot load it or a symbol
//! it resolves is missing, so every first contact goes through [`probe`] and [`quietly`]: a
//! machine without a driver, or with one that lacks a function memattn calls, gets an error that
//! says so, never a crash.
//!
//! [`DRIVER_ENV`] (`MEMATTN_CUDA_DRIVER=/path/to/libcuda`) loads a given driver library instead of
//! the system's, e.g. `libvm_cuda.so` from the workspace's `vm-cuda` crate, a driver backed by
//! ptx-vm that runs this backend without a GPU. Only that variable (or [`use_driver_library`])
//! selects it; NVML is then read from the same library.

use super::{Backend, DevPtr, Device, DeviceCaps, DeviceError, DeviceOptions, LaunchInfo};
use crate::memory::MeasuredMemory;
use crate::nvml::Sampler;
use crate::ptx::PtxSource;
use cudarc::driver::sys;
use cudarc::driver::{result, CudaContext, DriverError};
use kernels_gpu::tiles::LaunchDims;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Dynamic shared memory a kernel may use without opting in.
const SMEM_WITHOUT_OPT_IN: u32 = 48 * 1024;

pub use crate::panics::quietly;

fn drv(op: &str, e: DriverError) -> DeviceError {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    DeviceError::Cuda { op: op.into(), message: format!("{name}: {text}") }
}

/// Every driver function memattn's CUDA backend reaches through cudarc. cudarc resolves each on
/// its first call and panics when the library lacks it, wherever that call is (a launch, a
/// destructor), so [`probe`] looks them all up first. `host/tests/cuda_vm.rs` checks, from the
/// dynamic loader's log, that no other driver function is resolved.
pub const REQUIRED_DRIVER_FUNCTIONS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetUuid",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuModuleLoadDataEx",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuFuncSetAttribute",
    "cuLaunchKernel",
    "cuStreamSynchronize",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventElapsedTime",
    "cuEventDestroy_v2",
    "cuMemGetInfo_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemsetD32_v2",
    "cuGetErrorName",
    "cuGetErrorString",
];

pub use crate::driver::{driver_library, use_driver_library, DRIVER_ENV};

/// Set by [`probe`]: the driver is `vm-cuda`'s (ptx-vm behind the driver API), not a GPU's.
static VM_BACKED: AtomicBool = AtomicBool::new(false);

/// Whether the driver [`probe`] found is the VM-backed one (`vm-cuda`).
pub fn vm_backed() -> bool {
    VM_BACKED.load(Ordering::Relaxed)
}

/// Whether the system has a CUDA driver library (checked without binding cudarc to it).
pub fn system_driver_present() -> bool {
    quietly(culib_present).unwrap_or(false)
}

/// Whether cudarc can load the driver library (call it inside [`quietly`]). Without memattn's
/// `dynamic-loading` feature cudarc is linked to libcuda at build time (candle's `cuda` feature
/// does that), so the library is there whenever the program started.
fn culib_present() -> bool {
    #[cfg(feature = "dynamic-loading")]
    {
        // SAFETY: only tries to dlopen the driver library and closes it again.
        unsafe { sys::is_culib_present() }
    }
    #[cfg(not(feature = "dynamic-loading"))]
    {
        true
    }
}

/// Opens the library cudarc will use (same names, same order), checks that it is the chosen one
/// when there is one, and that it has every function in [`REQUIRED_DRIVER_FUNCTIONS`].
fn check_driver_functions() -> Result<(), String> {
    #[cfg(feature = "dynamic-loading")]
    let names = ["cuda", "nvcuda"].iter().flat_map(|l| cudarc::get_lib_name_candidates(l));
    // Linked at build time: the dynamic loader's `libcuda.so.1` is the library cudarc calls.
    #[cfg(not(feature = "dynamic-loading"))]
    let names = ["libcuda.so.1".to_string()].into_iter();
    for name in names {
        // SAFETY: the same dlopen cudarc does next.
        let Ok(lib) = (unsafe { libloading::Library::new(&name) }) else { continue };
        // SAFETY (both): only look symbols up; nothing is called.
        let init = |l: &libloading::Library| unsafe { l.get::<*const c_void>(b"cuInit").ok().map(|s| *s) };
        if let Some(Ok((path, chosen))) = crate::driver::CHOSEN.get() {
            if init(&lib) != init(chosen) {
                return Err(format!(
                    "{DRIVER_ENV}={} is loaded, but `{name}` names another library, which cudarc would use (the chosen library's soname must be libcuda.so)",
                    path.display()
                ));
            }
        }
        // SAFETY: only looks the symbol up.
        VM_BACKED.store(unsafe { lib.get::<*const c_void>(b"vmCudaDriverVersion") }.is_ok(), Ordering::Relaxed);
        for f in REQUIRED_DRIVER_FUNCTIONS {
            if unsafe { lib.get::<*const c_void>(f.as_bytes()) }.is_err() {
                return Err(format!(
                    "the CUDA driver library ({name}) lacks `{f}`, which memattn calls (a driver older than CUDA 12.8, or not a complete libcuda)"
                ));
            }
        }
        return Ok(());
    }
    Err("no CUDA driver library (libcuda.so.1) could be loaded".into())
}

/// Checks for a usable driver and at least one device. `Ok` describes what was found; `Err` says
/// why CUDA cannot be used.
pub fn probe() -> Result<String, String> {
    let chosen = driver_library()?;
    let r = quietly(|| -> Result<String, String> {
        if !culib_present() {
            return Err("no CUDA driver library (libcuda.so.1) could be loaded".into());
        }
        check_driver_functions()?;
        result::init().map_err(|e| format!("cuInit failed: {}", drv("cuInit", e)))?;
        let n = result::device::get_count().map_err(|e| format!("{}", drv("cuDeviceGetCount", e)))?;
        if n == 0 {
            return Err("the CUDA driver reports no device".into());
        }
        let mut version = 0;
        // SAFETY: out-pointer to a local.
        unsafe { sys::cuDriverGetVersion(&mut version) };
        let mut via = match chosen {
            Some(p) => format!(" from {} ({DRIVER_ENV})", p.display()),
            None => String::new(),
        };
        if vm_backed() {
            via.push_str(", VM-backed: kernels run in ptx-vm, not on a GPU");
        }
        Ok(format!("{n} CUDA device(s), driver API {}.{}{via}", version / 1000, (version % 1000) / 10))
    });
    match r {
        Ok(inner) => inner,
        Err(panic) => Err(format!("the CUDA driver could not be used: {panic}")),
    }
}

pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: sys::CUstream,
    module: sys::CUmodule,
    functions: HashMap<String, (sys::CUfunction, u32)>,
    ptx: PtxSource,
    name: String,
    uuid: Option<String>,
    events: Option<(sys::CUevent, sys::CUevent)>,
    nvml_interval: Duration,
    sampler: Option<Sampler>,
    nvml_before: Option<u64>,
    /// NVML's used bytes read with every buffer allocated (the sampler may miss a short run).
    nvml_allocated: Option<u64>,
    cuda_free_before: Option<u64>,
    cuda_free_allocated: Option<u64>,
    notes: Vec<String>,
    /// Live allocations (base -> bytes): every copy and fill is checked against them, so the
    /// `Device` methods stay safe whatever range a caller passes.
    allocations: std::collections::BTreeMap<DevPtr, u64>,
}

fn format_uuid(u: &sys::CUuuid) -> String {
    let b: Vec<u8> = u.bytes.iter().map(|&x| x as u8).collect();
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &hex[0..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..32])
}

impl CudaDevice {
    pub fn new(opts: &DeviceOptions) -> Result<CudaDevice, DeviceError> {
        probe().map_err(DeviceError::Unavailable)?;
        let ctx = quietly(|| CudaContext::new(0))
            .map_err(DeviceError::Unavailable)?
            .map_err(|e| drv("creating the context on device 0", e))?;
        let name = ctx.name().unwrap_or_else(|_| "CUDA device 0".into());
        let (major, minor) = ctx.compute_capability().map_err(|e| drv("cuDeviceGetAttribute", e))?;
        let uuid = ctx.uuid().ok().map(|u| format_uuid(&u));
        let module = load_module(&opts.ptx)?;
        Ok(CudaDevice {
            ctx,
            stream: std::ptr::null_mut(),
            module,
            functions: HashMap::new(),
            ptx: opts.ptx.clone(),
            name: format!("{name} (sm_{major}{minor})"),
            uuid,
            events: None,
            nvml_interval: opts.nvml_interval,
            sampler: None,
            nvml_before: None,
            nvml_allocated: None,
            cuda_free_before: None,
            cuda_free_allocated: None,
            notes: Vec::new(),
            allocations: Default::default(),
        })
    }

    /// Fails unless `[ptr, ptr + bytes)` lies inside one live allocation.
    fn check_range(&self, op: &str, ptr: DevPtr, bytes: u64) -> Result<(), DeviceError> {
        match self.allocations.range(..=ptr).next_back() {
            Some((&base, &len)) if ptr.checked_add(bytes).is_some_and(|end| end <= base + len) => Ok(()),
            _ => Err(DeviceError::Cuda {
                op: op.into(),
                message: format!("{bytes} bytes at {ptr:#x} are not inside one allocation of this device"),
            }),
        }
    }

    fn mem_get_info_free(&self) -> u64 {
        result::mem_get_info().map(|(f, _)| f as u64).unwrap_or(0)
    }

    fn attr(&self, a: sys::CUdevice_attribute) -> Result<i32, DeviceError> {
        self.ctx.attribute(a).map_err(|e| drv("cuDeviceGetAttribute", e))
    }

    fn function(&mut self, name: &str) -> Result<(sys::CUfunction, u32), DeviceError> {
        if let Some(f) = self.functions.get(name) {
            return Ok(*f);
        }
        let cname = CString::new(name).map_err(|_| DeviceError::UnknownKernel(name.into()))?;
        // SAFETY: the module is loaded and lives as long as self.
        let f = unsafe { result::module::get_function(self.module, cname) }
            .map_err(|_| DeviceError::UnknownKernel(name.into()))?;
        self.functions.insert(name.to_string(), (f, SMEM_WITHOUT_OPT_IN));
        Ok((f, SMEM_WITHOUT_OPT_IN))
    }

    fn events(&mut self) -> Result<(sys::CUevent, sys::CUevent), DeviceError> {
        if let Some(e) = self.events {
            return Ok(e);
        }
        let a = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| drv("cuEventCreate", e))?;
        let b = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| drv("cuEventCreate", e))?;
        self.events = Some((a, b));
        Ok((a, b))
    }

    fn nvml_used(&self) -> Option<u64> {
        crate::nvml::gpu(self.uuid.as_deref()).ok().map(|g| g.memory_used_bytes)
    }
}

/// Loads PTX text through the driver's JIT, returning the JIT error log on failure.
pub(crate) fn load_module(ptx: &PtxSource) -> Result<sys::CUmodule, DeviceError> {
    let image = CString::new(ptx.text.as_bytes()).map_err(|_| DeviceError::PtxLoad {
        origin: ptx.origin.clone(),
        message: "PTX text contains a NUL byte".into(),
    })?;
    let mut log = vec![0u8; 16 * 1024];
    let mut options =
        [sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER, sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
    let mut values = [log.as_mut_ptr() as *mut c_void, log.len() as *mut c_void];
    let mut module = std::ptr::null_mut();
    // SAFETY: `image` is NUL-terminated PTX; options/values are two valid pairs; `log` outlives the call.
    let r = unsafe {
        sys::cuModuleLoadDataEx(
            &mut module,
            image.as_ptr() as *const c_void,
            options.len() as u32,
            options.as_mut_ptr(),
            values.as_mut_ptr(),
        )
    };
    match r.result() {
        Ok(()) => Ok(module),
        Err(e) => {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            let jit_log = String::from_utf8_lossy(&log[..end]).trim().to_string();
            let DeviceError::Cuda { message, .. } = drv("cuModuleLoadDataEx", e) else { unreachable!() };
            Err(DeviceError::PtxLoad {
                origin: ptx.origin.clone(),
                message: if jit_log.is_empty() { message } else { format!("{message}; JIT log: {jit_log}") },
            })
        }
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if let Some(s) = self.sampler.take() {
            let _ = s.stop();
        }
        // SAFETY: handles created by this device and not used after this point.
        unsafe {
            if let Some((a, b)) = self.events.take() {
                let _ = result::event::destroy(a);
                let _ = result::event::destroy(b);
            }
            let _ = result::module::unload(self.module);
        }
    }
}

impl Device for CudaDevice {
    fn backend(&self) -> Backend {
        Backend::Cuda
    }

    fn name(&self) -> String {
        self.name.clone()
    }

    fn ptx(&self) -> &PtxSource {
        &self.ptx
    }

    fn caps(&mut self) -> Result<DeviceCaps, DeviceError> {
        use sys::CUdevice_attribute::*;
        let (free, total) = result::mem_get_info().map_err(|e| drv("cuMemGetInfo", e))?;
        Ok(DeviceCaps {
            max_dynamic_smem_bytes: self.attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as u32,
            max_threads_per_block: self.attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)? as u32,
            max_grid: [
                self.attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)? as u32,
                self.attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y)? as u32,
                self.attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)? as u32,
            ],
            total_memory_bytes: total as u64,
            free_memory_bytes: free as u64,
        })
    }

    fn multiprocessor_count(&mut self) -> Result<Option<u32>, DeviceError> {
        let n = self.attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        Ok(u32::try_from(n).ok().filter(|&n| n > 0))
    }

    fn alloc(&mut self, bytes: u64) -> Result<DevPtr, DeviceError> {
        // SAFETY: plain allocation in the current (bound) context.
        let bytes_usize = usize::try_from(bytes)
            .map_err(|_| DeviceError::OutOfMemory { requested: bytes, free: self.mem_get_info_free() })?;
        let ptr = unsafe { result::malloc_sync(bytes_usize) }.map_err(|e| {
            let free = result::mem_get_info().map(|(f, _)| f as u64).unwrap_or(0);
            if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                DeviceError::OutOfMemory { requested: bytes, free }
            } else {
                drv("cuMemAlloc", e)
            }
        })?;
        self.allocations.insert(ptr, bytes);
        Ok(ptr)
    }

    fn free(&mut self, ptr: DevPtr) -> Result<(), DeviceError> {
        if self.allocations.remove(&ptr).is_none() {
            return Err(DeviceError::Cuda {
                op: "cuMemFree".into(),
                message: format!("{ptr:#x} is not a live allocation"),
            });
        }
        // SAFETY: `ptr` is a live allocation of this device (checked above), freed once.
        unsafe { result::free_sync(ptr) }.map_err(|e| drv("cuMemFree", e))
    }

    fn upload_bytes(&mut self, ptr: DevPtr, data: &[u8]) -> Result<(), DeviceError> {
        self.check_range("cuMemcpyHtoD", ptr, data.len() as u64)?;
        // SAFETY: `[ptr, ptr + data.len())` lies inside a live allocation (checked above).
        unsafe { result::memcpy_htod_sync(ptr, data) }.map_err(|e| drv("cuMemcpyHtoD", e))
    }

    fn download_bytes(&mut self, ptr: DevPtr, out: &mut [u8]) -> Result<(), DeviceError> {
        self.synchronize()?;
        self.check_range("cuMemcpyDtoH", ptr, out.len() as u64)?;
        // SAFETY: `[ptr, ptr + out.len())` lies inside a live allocation (checked above).
        unsafe { result::memcpy_dtoh_sync(out, ptr) }.map_err(|e| drv("cuMemcpyDtoH", e))
    }

    fn fill_u32(&mut self, ptr: DevPtr, count: u64, value: u32) -> Result<(), DeviceError> {
        self.check_range("cuMemsetD32", ptr, count.saturating_mul(4))?;
        // SAFETY: `count` 32-bit words at `ptr` lie inside a live allocation (checked above).
        unsafe { sys::cuMemsetD32_v2(ptr, value, count as usize) }.result().map_err(|e| drv("cuMemsetD32", e))
    }

    fn launch(&mut self, kernel: &str, dims: &LaunchDims, params: &[&[u8]]) -> Result<LaunchInfo, DeviceError> {
        let (f, smem_allowed) = self.function(kernel)?;
        if dims.dynamic_smem_bytes > smem_allowed {
            // SAFETY: `f` is a live function of the loaded module.
            unsafe {
                result::function::set_function_attribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    dims.dynamic_smem_bytes as i32,
                )
            }
            .map_err(|e| {
                drv(&format!("opting `{kernel}` in to {} bytes of shared memory", dims.dynamic_smem_bytes), e)
            })?;
            if let Some(entry) = self.functions.get_mut(kernel) {
                entry.1 = dims.dynamic_smem_bytes;
            }
        }
        // Each parameter's bytes in an 8-byte aligned buffer; the driver copies them at launch
        // using the sizes it knows from the PTX.
        let mut storage: Vec<Vec<u64>> = params
            .iter()
            .map(|p| {
                let mut w = vec![0u64; p.len().div_ceil(8)];
                for (i, b) in p.iter().enumerate() {
                    w[i / 8] |= (*b as u64) << (8 * (i % 8));
                }
                w
            })
            .collect();
        let mut ptrs: Vec<*mut c_void> = storage.iter_mut().map(|w| w.as_mut_ptr() as *mut c_void).collect();
        let grid = (dims.grid[0], dims.grid[1], dims.grid[2]);
        let block = (dims.block[0], dims.block[1], dims.block[2]);
        // SAFETY: `f` is live, `ptrs` has one pointer per declared parameter (checked by the
        // runner against the ABI), and the pointed-to buffers outlive the call.
        unsafe { result::launch_kernel(f, grid, block, dims.dynamic_smem_bytes, self.stream, &mut ptrs) }
            .map_err(|e| drv(&format!("launch of `{kernel}` (grid {:?}, block {:?})", dims.grid, dims.block), e))?;
        Ok(LaunchInfo::default())
    }

    fn synchronize(&mut self) -> Result<(), DeviceError> {
        // SAFETY: the default stream of the bound context.
        unsafe { result::stream::synchronize(self.stream) }
            .map_err(|e| drv("cuStreamSynchronize (an earlier kernel failed)", e))
    }

    fn timer_start(&mut self) -> Result<(), DeviceError> {
        let (a, _) = self.events()?;
        // SAFETY: live event, default stream.
        unsafe { result::event::record(a, self.stream) }.map_err(|e| drv("cuEventRecord", e))
    }

    fn timer_stop(&mut self) -> Result<f64, DeviceError> {
        let (a, b) = self.events()?;
        // SAFETY: live events recorded on the same stream.
        unsafe {
            result::event::record(b, self.stream).map_err(|e| drv("cuEventRecord", e))?;
            result::event::synchronize(b).map_err(|e| drv("cuEventSynchronize (a kernel failed)", e))?;
            result::event::elapsed(a, b).map(|ms| ms as f64).map_err(|e| drv("cuEventElapsedTime", e))
        }
    }

    fn clock_name(&self) -> &'static str {
        "cuda events"
    }

    fn memory_begin(&mut self) -> Result<(), DeviceError> {
        self.synchronize()?;
        self.notes.clear();
        self.cuda_free_before = result::mem_get_info().ok().map(|(f, _)| f as u64);
        self.cuda_free_allocated = None;
        self.nvml_allocated = None;
        self.nvml_before = self.nvml_used();
        match Sampler::start(self.uuid.clone(), self.nvml_interval) {
            Ok(s) => self.sampler = Some(s),
            Err(e) => self.notes.push(format!("no NVML sampling: {e}")),
        }
        Ok(())
    }

    fn memory_mark_allocated(&mut self) -> Result<(), DeviceError> {
        self.synchronize()?;
        self.cuda_free_allocated = result::mem_get_info().ok().map(|(f, _)| f as u64);
        // One NVML reading at the known peak: a run shorter than the sampling interval
        // allocates and frees between two samples.
        self.nvml_allocated = self.nvml_used();
        Ok(())
    }

    fn memory_end(&mut self) -> Result<MeasuredMemory, DeviceError> {
        self.synchronize()?;
        let samples = self.sampler.take().map(|s| s.stop());
        let after = self.nvml_used();
        let mut m = MeasuredMemory {
            source: format!("nvml (sampled every {} us) + cuMemGetInfo", self.nvml_interval.as_micros()),
            cuda_free_before_bytes: self.cuda_free_before,
            cuda_free_allocated_bytes: self.cuda_free_allocated,
            notes: std::mem::take(&mut self.notes),
            ..MeasuredMemory::default()
        };
        if !vm_backed() {
            m.notes.push("CUDA rounds allocations up (2 MiB pages for large buffers), so measured bytes exceed the analytic figure slightly".into());
        }
        let cuda_delta = match (self.cuda_free_before, self.cuda_free_allocated) {
            (Some(a), Some(b)) => Some(a.saturating_sub(b)),
            _ => None,
        };
        match (self.nvml_before, samples) {
            (Some(before), Some(Ok(s))) => {
                m.before_bytes = before;
                m.peak_bytes = s.peak_used_bytes.max(self.nvml_allocated.unwrap_or(0)).max(before);
                m.after_bytes = after.unwrap_or(0);
                m.peak_delta_bytes = m.peak_bytes - before;
                m.samples = Some(s.count);
                m.gpu_util_max_percent = Some(s.util_max_percent);
                m.gpu_util_mean_percent = Some(s.util_mean_percent);
            }
            (_, sampled) => {
                if let Some(Err(e)) = sampled {
                    m.notes.push(format!("NVML sampler: {e}"));
                }
                // Without NVML, the cuMemGetInfo difference is the measurement.
                m.source = "cuMemGetInfo (NVML unavailable)".into();
                if let (Some(before), Some(d)) = (self.cuda_free_before, cuda_delta) {
                    let _ = before;
                    m.peak_delta_bytes = d;
                }
            }
        }
        if let Some(d) = cuda_delta {
            if m.peak_delta_bytes < d {
                // The sampler may miss a short peak; cuMemGetInfo with everything allocated cannot.
                m.notes.push(format!("NVML peak below the cuMemGetInfo difference ({d} bytes); reporting the latter"));
                m.peak_delta_bytes = d;
                m.peak_bytes = m.peak_bytes.max(m.before_bytes + d);
            }
        }
        Ok(m)
    }

    fn default_warmup_repeats(&self) -> (u32, u32) {
        // The VM-backed driver's events time the interpreter: repeating buys nothing.
        if vm_backed() {
            (0, 1)
        } else {
            (3, 10)
        }
    }
}
