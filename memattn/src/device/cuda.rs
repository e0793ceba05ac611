//! The CUDA driver side of the library: which driver library is used and whether it is usable
//! ([`probe`]), and [`CudaModule`], memattn's PTX loaded in a context with its function cache and
//! the one `cuLaunchKernel` call of the workspace. [`crate::attn::Kernels`] launches through it,
//! and so does the `memattn` command's measuring device.
//!
//! The driver library is loaded at run time. `cudarc` panics when it cannot load it or a symbol
//! it resolves is missing, so every first contact goes through [`probe`] and [`quietly`]: a
//! machine without a driver, or with one that lacks a function memattn calls, gets an error that
//! says so, never a crash.
//!
//! [`DRIVER_ENV`] (`MEMATTN_CUDA_DRIVER=/path/to/libcuda`) loads a given driver library instead of
//! the system's, e.g. `libvm_cuda.so` from the workspace's `vm-cuda` crate, a driver backed by
//! ptx-vm that runs this backend without a GPU. Only that variable (or [`use_driver_library`])
//! selects it.

use super::DeviceError;
use crate::ptx::PtxSource;
use cudarc::driver::sys;
use cudarc::driver::{result, DriverError};
use kernels_gpu::tiles::LaunchDims;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Dynamic shared memory a kernel may use without opting in.
const SMEM_WITHOUT_OPT_IN: u32 = 48 * 1024;

pub use crate::panics::quietly;

/// A driver error as a [`DeviceError`], with the driver's name and text for it.
pub fn drv(op: &str, e: DriverError) -> DeviceError {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    DeviceError::Cuda { op: op.into(), message: format!("{name}: {text}") }
}

/// Every driver function memattn's CUDA backend reaches through cudarc. cudarc resolves each on
/// its first call and panics when the library lacks it, wherever that call is (a launch, a
/// destructor), so [`probe`] looks them all up first. `host/tests/command/cuda_vm.rs` checks, from the
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
    "cuTensorMapEncodeTiled",
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

/// The names cudarc's run-time loading asks the dynamic loader for, in its order (cudarc's
/// `get_lib_name_candidates("cuda")` for CUDA 12 and 13). A program that links libcuda at
/// build time (cudarc's `dynamic-linking`, as candle-core's `cuda` feature does) has
/// `libcuda.so.1` loaded already, so the same names find it.
fn driver_library_names() -> Vec<String> {
    if cfg!(windows) {
        return vec!["nvcuda.dll".into(), "cuda.dll".into()];
    }
    ["libcuda.so", "libcuda64.so", "libcuda.so.13", "libcuda.so.12", "libcuda.so.1"].map(String::from).to_vec()
}

/// Whether the process can load a CUDA driver library (call it inside [`quietly`]).
fn culib_present() -> bool {
    driver_library_names().iter().any(|name| {
        // SAFETY: only tries to dlopen the driver library and closes it again.
        unsafe { libloading::Library::new(name) }.is_ok()
    })
}

/// Opens the library cudarc will use (same names, same order), checks that it is the chosen one
/// when there is one, and that it has every function in [`REQUIRED_DRIVER_FUNCTIONS`].
fn check_driver_functions() -> Result<(), String> {
    for name in driver_library_names() {
        // SAFETY: the same dlopen cudarc does next.
        let Ok(lib) = (unsafe { libloading::Library::new(&name) }) else { continue };
        // SAFETY (both): only look symbols up; nothing is called.
        let init = |l: &libloading::Library| unsafe { l.get::<*const c_void>(b"cuInit").ok().map(|s| *s) };
        if let Some(Ok((path, chosen))) = crate::driver::CHOSEN.get()
            && init(&lib) != init(chosen)
        {
            return Err(format!(
                "{DRIVER_ENV}={} is loaded, but `{name}` names another library, which cudarc would use (the chosen library's soname must be libcuda.so)",
                path.display()
            ));
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

/// Loads PTX text through the driver's JIT, returning the JIT error log on failure.
fn load_module(text: &str, origin: &str) -> Result<sys::CUmodule, DeviceError> {
    let image = CString::new(text.as_bytes()).map_err(|_| DeviceError::PtxLoad {
        origin: origin.to_string(),
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
                origin: origin.to_string(),
                message: if jit_log.is_empty() { message } else { format!("{message}; JIT log: {jit_log}") },
            })
        }
    }
}

/// memattn's PTX loaded in the current CUDA context, each function looked up once and cached
/// with the dynamic shared memory it is opted in to; [`CudaModule::launch`] is the one
/// `cuLaunchKernel` of the workspace.
///
/// A module compiled into the binary (checked by ptxas when it was built) is loaded one kernel at
/// a time: the first launch of a kernel has the driver JIT-compile a module of that kernel alone
/// ([`PtxSource::entry_module`]), up to about two seconds, where the whole 22 MB module took about 50
/// seconds on an H200 before the first launch. A PTX file (`--ptx`) is loaded whole, at once, so
/// that its JIT errors show before anything runs.
///
/// The modules are unloaded on drop; the context they were loaded in must be current then (and
/// alive).
pub struct CudaModule {
    /// The whole text's module (a file), or None: one module per kernel, from `per_entry`.
    whole: Option<sys::CUmodule>,
    per_entry: Option<Box<PtxSource>>,
    /// Modules loaded for single kernels.
    loaded: Mutex<Vec<usize>>,
    /// Function handle and the dynamic shared memory it is opted in to, by entry name.
    functions: Mutex<HashMap<String, (usize, u32)>>,
}

// SAFETY: driver handles may be used from any thread; the function cache is behind a mutex.
unsafe impl Send for CudaModule {}
unsafe impl Sync for CudaModule {}

impl CudaModule {
    /// Loads `ptx` into the context current on this thread: a file's text whole (the JIT error
    /// log on failure), the embedded modules one kernel at a time on first use.
    pub fn load(ptx: &PtxSource) -> Result<CudaModule, DeviceError> {
        let embedded = matches!(ptx.text, std::borrow::Cow::Borrowed(_));
        Ok(CudaModule {
            whole: if embedded { None } else { Some(load_module(&ptx.text, &ptx.origin)?) },
            per_entry: embedded.then(|| Box::new(ptx.clone())),
            loaded: Mutex::new(Vec::new()),
            functions: Mutex::new(HashMap::new()),
        })
    }

    /// The module that holds `kernel`: the whole one, or a module of `kernel` alone, JIT-compiled
    /// now.
    fn module_of(&self, kernel: &str) -> Result<sys::CUmodule, DeviceError> {
        if let Some(m) = self.whole {
            return Ok(m);
        }
        let ptx = self.per_entry.as_ref().expect("a module is whole or per entry");
        let text = ptx
            .entry_module(kernel)
            .map_err(|message| DeviceError::PtxLoad { origin: ptx.origin.clone(), message })?
            .ok_or_else(|| DeviceError::UnknownKernel(kernel.into()))?;
        let m = load_module(&text, &format!("{} (entry {kernel})", ptx.origin))?;
        self.loaded.lock().unwrap_or_else(|e| e.into_inner()).push(m as usize);
        Ok(m)
    }

    /// The device address of the module-scope variable `name` in the module that holds `kernel`
    /// (loaded now if it is not yet).
    pub fn global(&self, kernel: &str, name: &str) -> Result<u64, DeviceError> {
        let module = self.module_of_loaded(kernel)?;
        let cname = CString::new(name).map_err(|_| DeviceError::UnknownKernel(name.into()))?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the module is loaded and lives as long as self; the size is not asked for
        // (a null pointer, which every driver accepts).
        unsafe { sys::cuModuleGetGlobal_v2(&mut ptr, std::ptr::null_mut(), module, cname.as_ptr()) }
            .result()
            .map_err(|e| drv(&format!("looking up `{name}` in the module of `{kernel}`"), e))?;
        Ok(ptr)
    }

    /// [`CudaModule::module_of`], reusing the module of `kernel`'s function once it was looked up.
    fn module_of_loaded(&self, kernel: &str) -> Result<sys::CUmodule, DeviceError> {
        if let Some(m) = self.whole {
            return Ok(m);
        }
        let f = self.function(kernel, 0)?;
        let mut module = std::ptr::null_mut();
        // SAFETY: a live function of a loaded module.
        unsafe { sys::cuFuncGetModule(&mut module, f) }
            .result()
            .map_err(|e| drv(&format!("the module of `{kernel}`"), e))?;
        Ok(module)
    }

    /// The function `kernel`, looked up once, opted in to `smem` bytes of dynamic shared memory.
    fn function(&self, kernel: &str, smem: u32) -> Result<sys::CUfunction, DeviceError> {
        let mut cache = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        let mut entry = match cache.get(kernel) {
            Some(e) => *e,
            None => {
                let name = CString::new(kernel).map_err(|_| DeviceError::UnknownKernel(kernel.into()))?;
                let module = self.module_of(kernel)?;
                // SAFETY: the module is loaded and lives as long as self.
                let f = unsafe { result::module::get_function(module, name) }
                    .map_err(|_| DeviceError::UnknownKernel(kernel.into()))?;
                (f as usize, SMEM_WITHOUT_OPT_IN)
            }
        };
        if smem > entry.1 {
            // SAFETY: a live function of the loaded module.
            unsafe {
                result::function::set_function_attribute(
                    entry.0 as sys::CUfunction,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
            }
            .map_err(|e| drv(&format!("opting `{kernel}` in to {smem} bytes of shared memory"), e))?;
            entry.1 = smem;
        }
        cache.insert(kernel.to_string(), entry);
        Ok(entry.0 as sys::CUfunction)
    }

    /// Launches `kernel` on `stream` (null: the context's default stream) with its parameters,
    /// each given as its raw bytes in declaration order. Returns once the launch is queued.
    ///
    /// # Safety
    /// `params` must be the parameters `kernel` declares, and every device address in them must
    /// point into memory of this module's context that stays alive until the kernel completes;
    /// `stream` must be null or a live stream of that context, and the context must be current.
    pub unsafe fn launch(
        &self,
        kernel: &str,
        dims: &LaunchDims,
        params: &[&[u8]],
        stream: sys::CUstream,
    ) -> Result<(), DeviceError> {
        let f = self.function(kernel, dims.dynamic_smem_bytes)?;
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
        // SAFETY: `f` is live; the caller guarantees the parameters, their buffers and the
        // stream; `ptrs` and `storage` outlive the call.
        unsafe { result::launch_kernel(f, grid, block, dims.dynamic_smem_bytes, stream, &mut ptrs) }
            .map_err(|e| drv(&format!("launch of `{kernel}` (grid {:?}, block {:?})", dims.grid, dims.block), e))
    }
}

impl Drop for CudaModule {
    fn drop(&mut self) {
        let loaded = std::mem::take(self.loaded.get_mut().unwrap_or_else(|e| e.into_inner()));
        for m in self.whole.into_iter().chain(loaded.into_iter().map(|m| m as sys::CUmodule)) {
            // SAFETY: the module was loaded by this handle and is not used after this point.
            let _ = unsafe { result::module::unload(m) };
        }
    }
}

/// Encodes a tensor map of the Hopper forward (`cuTensorMapEncodeTiled`) in the current
/// context: the 128 bytes the kernel's TMA copies read, for global memory.
pub fn encode_tensor_map(desc: &crate::tma::TensorMapDesc) -> Result<[u8; 128], DeviceError> {
    use sys::{
        CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave, CUtensorMapL2promotion, CUtensorMapSwizzle,
    };
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    let element_strides = [1u32; 4];
    // SAFETY: every pointer is to a local array of the rank's length; the map is written by the
    // driver. The address is a device address the caller allocated (the encoding only records
    // it).
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            // 2-byte elements; the copy moves bits, and zero bits are +0.0 in bf16 and f16.
            CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
            4,
            desc.address as *mut c_void,
            desc.dims.as_ptr(),
            desc.strides.as_ptr(),
            desc.box_dims.as_ptr(),
            element_strides.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    r.result().map_err(|e| drv("cuTensorMapEncodeTiled", e))?;
    // SAFETY: initialised (zeroed, then written by the driver).
    let map = unsafe { map.assume_init() };
    let mut out = [0u8; 128];
    for (i, w) in map.opaque.iter().enumerate() {
        out[8 * i..8 * i + 8].copy_from_slice(&w.to_le_bytes());
    }
    Ok(out)
}
