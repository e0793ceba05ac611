//! The PTX VM backend: runs the same PTX on the CPU with memcheck on every launch. Memory figures
//! are exact (the VM's allocator); time is host wall clock and says nothing about a GPU.

use super::{Backend, BlockSubset, DevPtr, Device, DeviceCaps, DeviceError, DeviceOptions, LaunchInfo};
use crate::memory::MeasuredMemory;
use crate::problem::Arch;
use crate::ptx::PtxSource;
use crate::tma::TensorMapDesc;
use kernels_gpu::tiles::LaunchDims;
use ptx_vm::{Finding, LaunchConfig, Module, TraceRequest, Vm, VmError};
use std::sync::Arc;
use std::time::Instant;

/// The PTX VM as a [`Device`]: the kernels run on the host's CPU, with memcheck on every launch.
pub struct VmDevice {
    vm: Vm,
    /// The module, parsed once per process and shared ([`Module::shared`]); entries are decoded
    /// on their first launch.
    module: Arc<Module>,
    ptx: PtxSource,
    /// The `sm_90a` module, parsed on the first launch of one of its kernels.
    ptx_sm90: PtxSource,
    module_sm90: Option<Arc<Module>>,
    arch: Arch,
    /// `MEMATTN_HOPPER` as the options had it ([`crate::choice`]).
    hopper: crate::choice::HopperPolicy,
    workers: usize,
    timer: Option<Instant>,
    mem_before: u64,
    /// Trace this thread of the next launch of this kernel.
    trace: Option<(String, TraceRequest)>,
    /// Run only these blocks of the launches of this kernel ([`Device::set_block_subset`]).
    subset: Option<BlockSubset>,
}

/// Formats a memcheck finding with its full location.
pub fn describe_finding(f: &Finding) -> String {
    let mut s = format!(
        "{} in block ({},{},{}) thread ({},{},{}) at PTX line {}: `{}`",
        f.kind, f.block[0], f.block[1], f.block[2], f.thread[0], f.thread[1], f.thread[2], f.line, f.instruction
    );
    if let Some(src) = &f.source {
        s.push_str(&format!(" in {src}"));
    }
    if let Some(b) = &f.buffer {
        s.push_str(&format!(", buffer {b}"));
    }
    if let Some(a) = f.address {
        s.push_str(&format!(", address {a:#x}"));
    }
    if let Some(n) = f.access_bytes {
        s.push_str(&format!(" ({n} bytes)"));
    }
    if let Some(near) = &f.nearest_allocation {
        s.push_str(&format!("; {near}"));
    }
    s
}

fn vm_err(op: &str, e: VmError) -> DeviceError {
    match e {
        VmError::UnknownKernel(k) => DeviceError::UnknownKernel(k),
        VmError::OutOfMemory { requested, free } => DeviceError::OutOfMemory { requested, free },
        VmError::HostMemory { requested } => DeviceError::HostMemory {
            what: format!(
                "a simulated device allocation ({op}; the simulated memory size is larger than the host can back)"
            ),
            bytes: requested,
            human: crate::units::human_bytes(requested),
        },
        VmError::Memcheck(f) | VmError::Trap(f) => {
            DeviceError::Memcheck { kernel: f.kernel.clone(), message: describe_finding(&f) }
        }
        other => DeviceError::Vm { op: op.into(), message: other.to_string() },
    }
}

impl VmDevice {
    /// Opens a VM with `opts`' VM settings and module; [`DeviceError::PtxLoad`] when the module
    /// does not parse, [`DeviceError::Setting`] when `MEMATTN_HOPPER` has a value it does not take.
    pub fn new(opts: &DeviceOptions) -> Result<VmDevice, DeviceError> {
        crate::choice::HopperPolicy::from_env().map_err(DeviceError::Setting)?;
        let module = opts
            .ptx
            .vm_module()
            .map_err(|e| DeviceError::PtxLoad { origin: opts.ptx.origin.clone(), message: e.to_string() })?;
        let workers =
            opts.vm_workers.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
        let mut vm = Vm::with_workers(workers);
        vm.set_initcheck(opts.vm_initcheck);
        vm.set_racecheck(opts.vm_racecheck);
        vm.set_bank_conflicts(opts.vm_bank_conflicts);
        vm.set_sectors(opts.vm_sectors);
        let mut limits = vm.limits();
        if let Some(bytes) = opts.vm_memory_bytes {
            limits.memory_bytes = bytes;
        }
        limits.max_launch_time = opts.vm_max_launch_time;
        if let Some(bytes) = opts.vm_max_shared_per_block {
            limits.max_shared_per_block = bytes;
        } else if opts.vm_arch == Arch::Sm90 {
            // An H100's opt-in limit.
            limits.max_shared_per_block = kernels_gpu::tiles::SMEM_OPT_IN_SM90;
        }
        vm.set_limits(limits);
        Ok(VmDevice {
            vm,
            module,
            ptx: opts.ptx.clone(),
            ptx_sm90: opts.ptx_sm90.clone(),
            module_sm90: None,
            arch: opts.vm_arch,
            hopper: opts.hopper,
            workers,
            timer: None,
            mem_before: 0,
            trace: None,
            subset: None,
        })
    }

    /// The loaded module (kernel list, instruction counts).
    pub fn module(&self) -> &Module {
        &self.module
    }

    /// The trace of the last traced launch, also when it stopped at a finding (then its last entry
    /// is the instruction that made it).
    pub fn take_trace(&mut self) -> Vec<ptx_vm::TraceEntry> {
        self.vm.take_trace()
    }

    /// Records the instruction trace of one thread in the next launch of `kernel`.
    pub fn request_trace(&mut self, kernel: &str, request: TraceRequest) {
        self.trace = Some((kernel.to_string(), request));
    }
}

impl Device for VmDevice {
    fn backend(&self) -> Backend {
        Backend::Vm
    }

    fn name(&self) -> String {
        let l = self.vm.limits();
        let off: Vec<&str> = [(self.vm.initcheck(), "initcheck"), (self.vm.racecheck(), "racecheck")]
            .into_iter()
            .filter(|(on, _)| !on)
            .map(|(_, name)| name)
            .collect();
        format!(
            "ptx-vm ({} workers, {} simulated, {} shared/block with opt-in, {} without{})",
            self.workers,
            crate::units::human_bytes(l.memory_bytes),
            crate::units::human_bytes(l.max_shared_per_block as u64),
            crate::units::human_bytes(l.shared_per_block_default as u64),
            if off.is_empty() { String::new() } else { format!(", {} off", off.join(" and ")) }
        )
    }

    fn ptx(&self) -> &PtxSource {
        &self.ptx
    }

    fn ptx_sm90(&self) -> Option<&PtxSource> {
        Some(&self.ptx_sm90)
    }

    fn caps(&mut self) -> Result<DeviceCaps, DeviceError> {
        let l = self.vm.limits();
        let m = self.vm.memory();
        Ok(DeviceCaps {
            max_dynamic_smem_bytes: l.max_shared_per_block,
            max_threads_per_block: l.max_threads_per_block,
            max_grid: l.max_grid,
            total_memory_bytes: l.memory_bytes,
            free_memory_bytes: l.memory_bytes.saturating_sub(m.current_bytes),
        })
    }

    fn alloc(&mut self, bytes: u64) -> Result<DevPtr, DeviceError> {
        self.vm.alloc(bytes).map_err(|e| vm_err("alloc", e))
    }

    fn free(&mut self, ptr: DevPtr) -> Result<(), DeviceError> {
        self.vm.free(ptr).map_err(|e| vm_err("free", e))
    }

    fn upload_bytes(&mut self, ptr: DevPtr, data: &[u8]) -> Result<(), DeviceError> {
        self.vm.write(ptr, data).map_err(|e| vm_err("write", e))
    }

    fn download_bytes(&mut self, ptr: DevPtr, out: &mut [u8]) -> Result<(), DeviceError> {
        self.vm.read(ptr, out).map_err(|e| vm_err("read", e))
    }

    fn fill_u32(&mut self, ptr: DevPtr, count: u64, value: u32) -> Result<(), DeviceError> {
        // In chunks of at most 1 MiB: no temporary the size of the buffer.
        const CHUNK_WORDS: u64 = 1 << 18;
        let chunk: Vec<u8> = (0..count.min(CHUNK_WORDS)).flat_map(|_| value.to_le_bytes()).collect();
        let mut done = 0u64;
        while done < count {
            let n = (count - done).min(CHUNK_WORDS);
            let at = ptr.checked_add(done * 4).ok_or_else(|| DeviceError::Vm {
                op: "fill".into(),
                message: format!("{count} words at {ptr:#x} wrap the address space"),
            })?;
            self.vm.write(at, &chunk[..(n * 4) as usize]).map_err(|e| vm_err("write", e))?;
            done += n;
        }
        Ok(())
    }

    fn arch(&mut self) -> Result<Arch, DeviceError> {
        Ok(self.arch)
    }

    fn target(&mut self) -> Result<crate::choice::Target, DeviceError> {
        Ok(crate::choice::Target::new(self.arch, self.hopper))
    }

    fn encode_tensor_map(&mut self, desc: &TensorMapDesc) -> Result<[u8; 128], DeviceError> {
        // The arguments `cuTensorMapEncodeTiled` gets on a GPU: 2-byte elements (UINT16), rank 4,
        // element strides 1, no interleave, 128-byte swizzle, L2 promotion 128 B, zero fill.
        ptx_vm::TensorMap::from_cuda_tiled(
            1,
            4,
            desc.address,
            &desc.dims,
            &desc.strides,
            &desc.box_dims,
            &[1; 4],
            0,
            3,
            2,
            0,
        )
        .map(|m| m.encode())
        .map_err(|message| DeviceError::Vm { op: "encoding a tensor map".into(), message })
    }

    fn set_module_global(&mut self, kernel: &str, name: &str, value: &[u8]) -> Result<(), DeviceError> {
        let sm90 = kernels_gpu::KernelId::from_name(kernel)
            .is_some_and(|k| k.variant().module() == kernels_gpu::variants::PtxModule::Sm90a);
        if sm90 && self.module_sm90.is_none() {
            let m = self
                .ptx_sm90
                .vm_module()
                .map_err(|e| DeviceError::PtxLoad { origin: self.ptx_sm90.origin.clone(), message: e.to_string() })?;
            self.module_sm90 = Some(m);
        }
        let (module, origin) = match (&self.module_sm90, sm90) {
            (Some(m), true) => (m.clone(), &self.ptx_sm90.origin),
            _ => (self.module.clone(), &self.ptx.origin),
        };
        let at = self.vm.global_address(&module, name).ok_or_else(|| DeviceError::PtxLoad {
            origin: origin.clone(),
            message: format!("the module has no `.global` variable `{name}`"),
        })?;
        self.vm.write(at, value).map_err(|e| vm_err("write", e))
    }

    fn launch(&mut self, kernel: &str, dims: &LaunchDims, params: &[&[u8]]) -> Result<LaunchInfo, DeviceError> {
        // The Hopper kernels are in the second module, parsed when first launched.
        let sm90 = kernels_gpu::KernelId::from_name(kernel)
            .is_some_and(|k| k.variant().module() == kernels_gpu::variants::PtxModule::Sm90a);
        if sm90 && self.module_sm90.is_none() {
            let m = self
                .ptx_sm90
                .vm_module()
                .map_err(|e| DeviceError::PtxLoad { origin: self.ptx_sm90.origin.clone(), message: e.to_string() })?;
            self.module_sm90 = Some(m);
        }
        let (module, origin) = match (&self.module_sm90, sm90) {
            (Some(m), true) => (m.clone(), &self.ptx_sm90.origin),
            _ => (self.module.clone(), &self.ptx.origin),
        };
        let info = module.kernel_info(kernel).map_err(|e| match e {
            VmError::Load(e) => DeviceError::PtxLoad { origin: origin.clone(), message: e.to_string() },
            other => vm_err(&format!("launch of `{kernel}`"), other),
        })?;
        if info.params.len() != params.len() {
            return Err(DeviceError::Vm {
                op: format!("launch of `{kernel}`"),
                message: format!("the kernel declares {} parameters, {} given", info.params.len(), params.len()),
            });
        }
        let mut packed = vec![0u8; info.param_bytes];
        for (decl, value) in info.params.iter().zip(params) {
            if decl.size != value.len() {
                return Err(DeviceError::Vm {
                    op: format!("launch of `{kernel}`"),
                    message: format!("parameter `{}` is {} bytes, {} given", decl.name, decl.size, value.len()),
                });
            }
            packed[decl.offset..decl.offset + decl.size].copy_from_slice(value);
        }
        // Name the buffers of an attention launch, so a finding says which tensor it hit.
        if params.len() == 1
            && (params[0].len() == kernels_gpu::abi::ATTN_PARAMS_BYTES
                || params[0].len() == kernels_gpu::abi::SM90_PARAMS_BYTES)
        {
            for (i, name) in ["Q", "K", "V", "O", "LSE", "S (scores workspace)"].iter().enumerate() {
                let mut w = [0u8; 8];
                w.copy_from_slice(&params[0][8 * i..8 * i + 8]);
                let ptr = u64::from_le_bytes(w);
                if ptr != 0 {
                    self.vm.set_label(ptr, name);
                }
            }
        }
        let mut config = LaunchConfig::new(dims.grid, dims.block, dims.dynamic_smem_bytes);
        if let Some(sub) = self.subset.as_ref().filter(|s| s.kernel == kernel) {
            config.blocks = Some(sub.blocks.clone());
        }
        if let Some((k, req)) = &self.trace
            && k == kernel
        {
            config.trace = Some(*req);
            self.trace = None;
        }
        let stats = self
            .vm
            .launch(&module, kernel, &config, &packed)
            .map_err(|e| vm_err(&format!("launch of `{kernel}`"), e))?;
        Ok(LaunchInfo {
            thread_instructions: Some(stats.thread_instructions),
            global_bytes_read: Some(stats.global_bytes_read),
            global_bytes_written: Some(stats.global_bytes_written),
            trace: stats.trace,
            bank_conflicts: stats.bank_conflicts,
            sectors: stats.sectors,
        })
    }

    fn synchronize(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }

    fn timer_start(&mut self) -> Result<(), DeviceError> {
        self.timer = Some(Instant::now());
        Ok(())
    }

    fn timer_stop(&mut self) -> Result<f64, DeviceError> {
        let t = self
            .timer
            .take()
            .ok_or_else(|| DeviceError::Vm { op: "timer".into(), message: "timer_stop without timer_start".into() })?;
        Ok(t.elapsed().as_secs_f64() * 1e3)
    }

    fn clock_name(&self) -> &'static str {
        "host wall clock: VM interpreter time, not GPU time"
    }

    fn memory_begin(&mut self) -> Result<(), DeviceError> {
        self.vm.reset_peak();
        self.mem_before = self.vm.memory().current_bytes;
        Ok(())
    }

    fn memory_mark_allocated(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }

    fn memory_end(&mut self) -> Result<MeasuredMemory, DeviceError> {
        let m = self.vm.memory();
        Ok(MeasuredMemory {
            source: "vm allocator (exact)".into(),
            before_bytes: self.mem_before,
            peak_bytes: m.peak_bytes,
            after_bytes: m.current_bytes,
            peak_delta_bytes: m.peak_bytes.saturating_sub(self.mem_before),
            ..MeasuredMemory::default()
        })
    }

    fn default_warmup_repeats(&self) -> (u32, u32) {
        // The VM is deterministic and slow: one measured launch, no warm-up.
        (0, 1)
    }

    fn set_block_subset(&mut self, subset: Option<BlockSubset>) -> Result<(), DeviceError> {
        self.subset = subset;
        Ok(())
    }
}
