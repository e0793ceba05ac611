//! NVML: what `nvidia-smi` would show (name, driver, memory, utilisation) and a background
//! sampler of device memory and utilisation during a run.
//!
//! NVML is loaded at run time; when `libnvidia-ml.so.1` is missing every call returns an error
//! that says so, and nothing panics.

use nvml_wrapper::Nvml;
use serde::Serialize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One GPU as NVML sees it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GpuInfo {
    pub index: u32,
    pub name: String,
    pub uuid: String,
    pub compute_capability: String,
    pub driver_version: String,
    pub cuda_driver_version: Option<String>,
    pub memory_total_bytes: u64,
    pub memory_used_bytes: u64,
    pub memory_free_bytes: u64,
    pub utilization_gpu_percent: Option<u32>,
    pub utilization_memory_percent: Option<u32>,
    /// GPU memory used by this process, when the driver reports it.
    pub this_process_used_bytes: Option<u64>,
    /// Current SM and memory clocks and the SM clock's maximum (MHz), where NVML reports them.
    pub clock_sm_mhz: Option<u32>,
    pub clock_memory_mhz: Option<u32>,
    pub clock_sm_max_mhz: Option<u32>,
    /// Compute processes on the GPU and their memory (what nvidia-smi's process table shows).
    pub processes: Vec<GpuProcess>,
}

/// One process using a GPU.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GpuProcess {
    pub pid: u32,
    /// `None` where the driver does not report it (e.g. inside some containers).
    pub used_bytes: Option<u64>,
}

fn init() -> Result<Nvml, String> {
    // A driver library chosen with MEMATTN_CUDA_DRIVER provides NVML too (vm-cuda's does).
    let chosen = crate::driver::driver_library().ok().flatten();
    // A chosen library without NVML (a real libcuda) leaves NVML to the system's library.
    let open = || match chosen {
        Some(p) => Nvml::builder().lib_path(p.as_os_str()).init().or_else(|_| Nvml::init()),
        None => Nvml::init(),
    };
    match crate::panics::quietly(open) {
        Ok(Ok(n)) => Ok(n),
        Ok(Err(e)) => Err(format!("NVML unavailable: {e}")),
        Err(p) => Err(format!("NVML unavailable: {p}")),
    }
}

/// Every GPU NVML can see.
pub fn gpus() -> Result<Vec<GpuInfo>, String> {
    let nvml = init()?;
    let driver_version = nvml.sys_driver_version().unwrap_or_else(|e| format!("unknown ({e})"));
    let cuda_driver_version = nvml.sys_cuda_driver_version().ok().map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10));
    let count = nvml.device_count().map_err(|e| format!("NVML device count: {e}"))?;
    let pid = std::process::id();
    let mut out = Vec::new();
    for index in 0..count {
        let d = nvml.device_by_index(index).map_err(|e| format!("NVML device {index}: {e}"))?;
        let mem = d.memory_info().map_err(|e| format!("NVML memory info of device {index}: {e}"))?;
        let util = d.utilization_rates().ok();
        let cc = d.cuda_compute_capability().map(|c| format!("{}.{}", c.major, c.minor)).unwrap_or_default();
        let processes: Vec<GpuProcess> = d
            .running_compute_processes()
            .map(|ps| {
                ps.into_iter()
                    .map(|p| GpuProcess {
                        pid: p.pid,
                        used_bytes: match p.used_gpu_memory {
                            nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => Some(b),
                            nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => None,
                        },
                    })
                    .collect()
            })
            .unwrap_or_default();
        let this_process_used_bytes = processes.iter().find(|p| p.pid == pid).and_then(|p| p.used_bytes);
        use nvml_wrapper::enum_wrappers::device::Clock;
        out.push(GpuInfo {
            index,
            name: d.name().unwrap_or_default(),
            uuid: d.uuid().unwrap_or_default(),
            compute_capability: cc,
            driver_version: driver_version.clone(),
            cuda_driver_version: cuda_driver_version.clone(),
            memory_total_bytes: mem.total,
            memory_used_bytes: mem.used,
            memory_free_bytes: mem.free,
            utilization_gpu_percent: util.as_ref().map(|u| u.gpu),
            utilization_memory_percent: util.as_ref().map(|u| u.memory),
            this_process_used_bytes,
            clock_sm_mhz: d.clock_info(Clock::SM).ok(),
            clock_memory_mhz: d.clock_info(Clock::Memory).ok(),
            clock_sm_max_mhz: d.max_clock_info(Clock::SM).ok(),
            processes,
        });
    }
    Ok(out)
}

/// The GPU with this UUID (`GPU-...`), or index 0 when `uuid` is None.
pub fn gpu(uuid: Option<&str>) -> Result<GpuInfo, String> {
    let all = gpus()?;
    let found = match uuid {
        Some(u) => all.into_iter().find(|g| g.uuid.eq_ignore_ascii_case(u)),
        None => all.into_iter().next(),
    };
    found.ok_or_else(|| "NVML does not list this GPU".to_string())
}

/// What a sampler saw.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Samples {
    pub count: u64,
    pub peak_used_bytes: u64,
    pub util_max_percent: u32,
    pub util_mean_percent: f64,
    pub wall: Duration,
}

/// Samples device used memory and GPU utilisation on a background thread.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Result<Samples, String>>,
}

impl Sampler {
    /// Starts sampling the GPU with `uuid` every `interval`.
    pub fn start(uuid: Option<String>, interval: Duration) -> Result<Sampler, String> {
        // Fail early (on this thread) when NVML is missing.
        let nvml = init()?;
        drop(nvml);
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
        let handle = std::thread::Builder::new()
            .name("nvml-sampler".into())
            .spawn(move || {
                let nvml = match init() {
                    Ok(n) => n,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.clone()));
                        return Err(e);
                    }
                };
                let dev = match &uuid {
                    Some(u) => nvml.device_by_uuid(u.as_str()),
                    None => nvml.device_by_index(0),
                };
                let dev = match dev {
                    Ok(d) => d,
                    Err(e) => {
                        let msg = format!("NVML device: {e}");
                        let _ = ready_tx.send(Err(msg.clone()));
                        return Err(msg);
                    }
                };
                let t0 = Instant::now();
                let mut s = Samples::default();
                let mut util_sum = 0u64;
                let mut first = true;
                loop {
                    if let Ok(m) = dev.memory_info() {
                        s.peak_used_bytes = s.peak_used_bytes.max(m.used);
                        s.count += 1;
                    }
                    if let Ok(u) = dev.utilization_rates() {
                        s.util_max_percent = s.util_max_percent.max(u.gpu);
                        util_sum += u.gpu as u64;
                    }
                    if first {
                        let _ = ready_tx.send(Ok(()));
                        first = false;
                    }
                    if flag.load(Ordering::Relaxed) {
                        break;
                    }
                    std::thread::sleep(interval);
                }
                s.util_mean_percent = if s.count > 0 { util_sum as f64 / s.count as f64 } else { 0.0 };
                s.wall = t0.elapsed();
                Ok(s)
            })
            .map_err(|e| format!("cannot start the NVML sampler thread: {e}"))?;
        // Wait for the first sample so the baseline is in before the run allocates.
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Sampler { stop, handle }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err("NVML sampler thread ended before its first sample".into()),
        }
    }

    /// Stops the sampler (it takes one last sample) and returns what it saw.
    pub fn stop(self) -> Result<Samples, String> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().map_err(|_| "NVML sampler thread panicked".to_string())?
    }
}
