//! The `memattn` command's CUDA device: one context (the device's primary context) on device 0 (or,
//! for a context-parallel rank, the GPU it is given),
//! the default stream, memattn's module loaded once as the library's
//! [`memattn::device::cuda::CudaModule`] (whose `launch` is the one `cuLaunchKernel` of the
//! workspace). Memory comes from NVML (before, sampled peak, after; utilisation) and
//! `cuMemGetInfo`; time from CUDA events. NVML is read from the chosen driver library when
//! `MEMATTN_CUDA_DRIVER` names one.

use crate::nvml::Sampler;
use cudarc::driver::sys;
use cudarc::driver::{result, CudaContext};
use kernels_gpu::tiles::LaunchDims;
use memattn::device::cuda::{drv, probe, quietly, vm_backed, CudaModule};
use memattn::device::{Backend, BackendChoice, DevPtr, Device, DeviceCaps, DeviceError, DeviceOptions, LaunchInfo};
use memattn::memory::MeasuredMemory;
use memattn::problem::Arch;
use memattn::ptx::PtxSource;
use memattn::tma::TensorMapDesc;
use std::sync::Arc;
use std::time::Duration;

pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: sys::CUstream,
    module: CudaModule,
    ptx: PtxSource,
    /// The `sm_90a` module: loaded on the first launch of a Hopper kernel (compute capability
    /// 9.0 only).
    module_sm90: Option<CudaModule>,
    ptx_sm90: PtxSource,
    compute_capability: (i32, i32),
    /// `MEMATTN_HOPPER` as the options had it ([`Device::target`]).
    hopper: memattn::choice::HopperPolicy,
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

// SAFETY: the raw handles (the default stream, two events) belong to `ctx`, and every method
// that calls the driver makes `ctx` current on the calling thread first (`bind`), so the device
// works from whichever thread owns it; `&mut self` serialises the calls.
unsafe impl Send for CudaDevice {}

impl CudaDevice {
    /// Makes the device's context current on this thread (a no-op when it already is).
    fn bind(&self) -> Result<(), DeviceError> {
        self.ctx.bind_to_thread().map_err(|e| drv("binding the context", e))
    }

    pub fn new(opts: &DeviceOptions) -> Result<CudaDevice, DeviceError> {
        CudaDevice::on_ordinal(opts, 0)
    }

    /// The GPUs the driver sees (0 when it cannot say).
    pub fn count() -> Result<usize, DeviceError> {
        probe().map_err(DeviceError::Unavailable)?;
        let n = quietly(CudaContext::device_count)
            .map_err(DeviceError::Unavailable)?
            .map_err(|e| drv("cuDeviceGetCount", e))?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// The device on GPU `ordinal` (context-parallel ranks take one GPU each).
    pub fn on_ordinal(opts: &DeviceOptions, ordinal: usize) -> Result<CudaDevice, DeviceError> {
        memattn::choice::HopperPolicy::from_env().map_err(DeviceError::Setting)?;
        probe().map_err(DeviceError::Unavailable)?;
        let ctx = quietly(|| CudaContext::new(ordinal))
            .map_err(DeviceError::Unavailable)?
            .map_err(|e| drv(&format!("creating the context on device {ordinal}"), e))?;
        let name = ctx.name().unwrap_or_else(|_| format!("CUDA device {ordinal}"));
        let (major, minor) = ctx.compute_capability().map_err(|e| drv("cuDeviceGetAttribute", e))?;
        let uuid = ctx.uuid().ok().map(|u| format_uuid(&u));
        let module = CudaModule::load(&opts.ptx)?;
        Ok(CudaDevice {
            ctx,
            stream: std::ptr::null_mut(),
            module,
            ptx: opts.ptx.clone(),
            module_sm90: None,
            ptx_sm90: opts.ptx_sm90.clone(),
            compute_capability: (major, minor),
            hopper: opts.hopper,
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

    /// A new stream on this device's context (NCCL's transfers of a context-parallel rank).
    pub fn new_stream(&self) -> Result<Arc<cudarc::driver::CudaStream>, DeviceError> {
        self.ctx.new_stream().map_err(|e| drv("cuStreamCreate", e))
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

    fn ptx_sm90(&self) -> Option<&PtxSource> {
        Some(&self.ptx_sm90)
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
        self.bind()?;
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
        self.bind()?;
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
        self.bind()?;
        self.check_range("cuMemcpyHtoD", ptr, data.len() as u64)?;
        // SAFETY: `[ptr, ptr + data.len())` lies inside a live allocation (checked above).
        unsafe { result::memcpy_htod_sync(ptr, data) }.map_err(|e| drv("cuMemcpyHtoD", e))
    }

    fn download_bytes(&mut self, ptr: DevPtr, out: &mut [u8]) -> Result<(), DeviceError> {
        self.bind()?;
        self.synchronize()?;
        self.check_range("cuMemcpyDtoH", ptr, out.len() as u64)?;
        // SAFETY: `[ptr, ptr + out.len())` lies inside a live allocation (checked above).
        unsafe { result::memcpy_dtoh_sync(out, ptr) }.map_err(|e| drv("cuMemcpyDtoH", e))
    }

    fn fill_u32(&mut self, ptr: DevPtr, count: u64, value: u32) -> Result<(), DeviceError> {
        self.bind()?;
        self.check_range("cuMemsetD32", ptr, count.saturating_mul(4))?;
        // SAFETY: `count` 32-bit words at `ptr` lie inside a live allocation (checked above).
        unsafe { sys::cuMemsetD32_v2(ptr, value, count as usize) }.result().map_err(|e| drv("cuMemsetD32", e))
    }

    fn set_module_global(&mut self, kernel: &str, name: &str, value: &[u8]) -> Result<(), DeviceError> {
        self.bind()?;
        let sm90 = kernels_gpu::KernelId::from_name(kernel)
            .is_some_and(|k| k.variant().module() == kernels_gpu::variants::PtxModule::Sm90a);
        if sm90 && self.module_sm90.is_none() {
            self.module_sm90 = Some(CudaModule::load(&self.ptx_sm90)?);
        }
        let module = match (&self.module_sm90, sm90) {
            (Some(m), true) => m,
            _ => &self.module,
        };
        let at = module.global(kernel, name)?;
        // SAFETY: the variable lives as long as its module; the caller keeps `value` within it.
        // Synchronous: ordered before the launches that follow on the default stream.
        unsafe { result::memcpy_htod_sync(at, value) }.map_err(|e| drv("cuMemcpyHtoD (module variable)", e))
    }

    fn launch(&mut self, kernel: &str, dims: &LaunchDims, params: &[&[u8]]) -> Result<LaunchInfo, DeviceError> {
        self.bind()?;
        let sm90 = kernels_gpu::KernelId::from_name(kernel)
            .is_some_and(|k| k.variant().module() == kernels_gpu::variants::PtxModule::Sm90a);
        if sm90 && self.module_sm90.is_none() {
            if self.compute_capability != (9, 0) {
                let (major, minor) = self.compute_capability;
                return Err(DeviceError::Unavailable(format!(
                    "`{kernel}` is in the sm_90a module, which only compute capability 9.0 loads (this GPU: {major}.{minor})"
                )));
            }
            self.module_sm90 = Some(CudaModule::load(&self.ptx_sm90)?);
        }
        let module = match (&self.module_sm90, sm90) {
            (Some(m), true) => m,
            _ => &self.module,
        };
        // SAFETY: the runner passes the parameters the kernel's ABI declares, with addresses
        // of live allocations of this device (checked against the ABI and its allocations),
        // on the default stream of the bound context.
        unsafe { module.launch(kernel, dims, params, self.stream) }?;
        Ok(LaunchInfo::default())
    }

    fn arch(&mut self) -> Result<Arch, DeviceError> {
        let (major, minor) = self.compute_capability;
        Ok(Arch::of_compute_capability(major, minor))
    }

    fn target(&mut self) -> Result<memattn::choice::Target, DeviceError> {
        Ok(memattn::choice::Target::new(self.arch()?, self.hopper))
    }

    fn encode_tensor_map(&mut self, desc: &TensorMapDesc) -> Result<[u8; 128], DeviceError> {
        self.bind()?;
        memattn::device::cuda::encode_tensor_map(desc)
    }

    fn synchronize(&mut self) -> Result<(), DeviceError> {
        self.bind()?;
        // SAFETY: the default stream of the bound context.
        unsafe { result::stream::synchronize(self.stream) }
            .map_err(|e| drv("cuStreamSynchronize (an earlier kernel failed)", e))
    }

    fn timer_start(&mut self) -> Result<(), DeviceError> {
        self.bind()?;
        let (a, _) = self.events()?;
        // SAFETY: live event, default stream.
        unsafe { result::event::record(a, self.stream) }.map_err(|e| drv("cuEventRecord", e))
    }

    fn timer_stop(&mut self) -> Result<f64, DeviceError> {
        self.bind()?;
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
        self.bind()?;
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
        self.bind()?;
        self.synchronize()?;
        self.cuda_free_allocated = result::mem_get_info().ok().map(|(f, _)| f as u64);
        // One NVML reading at the known peak: a run shorter than the sampling interval
        // allocates and frees between two samples.
        self.nvml_allocated = self.nvml_used();
        Ok(())
    }

    fn memory_end(&mut self) -> Result<MeasuredMemory, DeviceError> {
        self.bind()?;
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
/// An opened device and why this backend was picked.
pub struct Opened {
    pub device: Box<dyn Device>,
    pub reason: String,
}

/// Opens the backend `opts.backend` asks for. `auto` tries CUDA and falls back to the VM, saying
/// why; a missing driver never panics.
pub fn open(opts: &DeviceOptions) -> Result<Opened, DeviceError> {
    match opts.backend {
        BackendChoice::Vm => {
            Ok(Opened { device: Box::new(memattn::device::vm::VmDevice::new(opts)?), reason: "--backend vm".into() })
        }
        BackendChoice::Cuda => {
            let d = CudaDevice::new(opts)?;
            Ok(Opened { device: Box::new(d), reason: "--backend cuda".into() })
        }
        BackendChoice::Auto => match probe() {
            Ok(_) => {
                let d = CudaDevice::new(opts)?;
                Ok(Opened { device: Box::new(d), reason: "auto: CUDA driver and a GPU found".into() })
            }
            Err(why) => Ok(Opened {
                device: Box::new(memattn::device::vm::VmDevice::new(opts)?),
                reason: format!("auto: using the PTX VM because {why}"),
            }),
        },
    }
}
