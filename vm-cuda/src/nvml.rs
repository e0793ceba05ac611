//! The NVML functions memattn's sampler and `doctor` use, reading the same VM as the driver:
//! memory used is the VM allocator's current bytes, utilisation is 100 % for a sample period (the time since the previous
//! utilisation query) in which a launch ran, 0 % otherwise.
//! The running-process list holds this process while it has the primary context retained. Any
//! other NVML function is absent; nvml-wrapper reports an absent one as an error when called.

use crate::driver::{model, uuid_string, BUSY, BUSY_SINCE_QUERY, MEM_CURRENT, PRIMARY_ACTIVE};
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU32, Ordering};

type NvmlReturn = c_uint;
const SUCCESS: NvmlReturn = 0;
const UNINITIALIZED: NvmlReturn = 1;
const INVALID_ARGUMENT: NvmlReturn = 2;
const NOT_SUPPORTED: NvmlReturn = 3;
const NOT_FOUND: NvmlReturn = 6;
const INSUFFICIENT_SIZE: NvmlReturn = 7;

/// The handle of the one device.
const DEVICE: usize = 0xD0_0000;

static INIT_COUNT: AtomicU32 = AtomicU32::new(0);

fn ready() -> Result<(), NvmlReturn> {
    if INIT_COUNT.load(Ordering::Relaxed) == 0 {
        Err(UNINITIALIZED)
    } else {
        Ok(())
    }
}

fn dev(d: *mut c_void) -> Result<(), NvmlReturn> {
    ready()?;
    if d as usize == DEVICE {
        Ok(())
    } else {
        Err(INVALID_ARGUMENT)
    }
}

fn run(f: impl FnOnce() -> Result<(), NvmlReturn>) -> NvmlReturn {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => 999,
    }
}

unsafe fn put_str(buf: *mut c_char, len: c_uint, s: &str) -> Result<(), NvmlReturn> {
    if buf.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    if s.len() + 1 > len as usize {
        return Err(INSUFFICIENT_SIZE);
    }
    std::ptr::copy_nonoverlapping(s.as_ptr(), buf as *mut u8, s.len());
    *buf.add(s.len()) = 0;
    Ok(())
}

unsafe fn put<T>(p: *mut T, v: T) -> Result<(), NvmlReturn> {
    if p.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    p.write(v);
    Ok(())
}

#[no_mangle]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    INIT_COUNT.fetch_add(1, Ordering::Relaxed);
    SUCCESS
}

#[no_mangle]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> NvmlReturn {
    nvmlInit_v2()
}

#[no_mangle]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    run(|| {
        ready()?;
        INIT_COUNT.fetch_sub(1, Ordering::Relaxed);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn nvmlErrorString(result: NvmlReturn) -> *const c_char {
    let s: &'static [u8] = match result {
        SUCCESS => b"Success\0",
        UNINITIALIZED => b"Uninitialized\0",
        INVALID_ARGUMENT => b"Invalid Argument\0",
        NOT_SUPPORTED => b"Not Supported (VM-backed NVML)\0",
        NOT_FOUND => b"Not Found\0",
        INSUFFICIENT_SIZE => b"Insufficient Size\0",
        _ => b"Unknown Error\0",
    };
    s.as_ptr() as *const c_char
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) -> NvmlReturn {
    run(|| {
        ready()?;
        put_str(version, length, concat!("ptx-vm ", env!("CARGO_PKG_VERSION")))
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) -> NvmlReturn {
    run(|| {
        ready()?;
        put_str(version, length, "12.0 (ptx-vm)")
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(v: *mut c_int) -> NvmlReturn {
    run(|| {
        ready()?;
        put(v, 12080)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(v: *mut c_int) -> NvmlReturn {
    nvmlSystemGetCudaDriverVersion(v)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> NvmlReturn {
    run(|| {
        ready()?;
        put(count, 1)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, device: *mut *mut c_void) -> NvmlReturn {
    run(|| {
        ready()?;
        if index != 0 {
            return Err(INVALID_ARGUMENT);
        }
        put(device, DEVICE as *mut c_void)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(uuid: *const c_char, device: *mut *mut c_void) -> NvmlReturn {
    run(|| {
        ready()?;
        if uuid.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let u = std::ffi::CStr::from_ptr(uuid).to_string_lossy();
        if !u.eq_ignore_ascii_case(&uuid_string(model())) {
            return Err(NOT_FOUND);
        }
        put(device, DEVICE as *mut c_void)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: *mut c_void, index: *mut c_uint) -> NvmlReturn {
    run(|| {
        dev(device)?;
        put(index, 0)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetName(device: *mut c_void, name: *mut c_char, length: c_uint) -> NvmlReturn {
    run(|| {
        dev(device)?;
        put_str(name, length, &model().name)
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUUID(device: *mut c_void, uuid: *mut c_char, length: c_uint) -> NvmlReturn {
    run(|| {
        dev(device)?;
        put_str(uuid, length, &uuid_string(model()))
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: *mut c_void,
    major: *mut c_int,
    minor: *mut c_int,
) -> NvmlReturn {
    run(|| {
        dev(device)?;
        put(major, model().cc.0)?;
        put(minor, model().cc.1)
    })
}

#[repr(C)]
pub struct Memory {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
pub struct MemoryV2 {
    version: c_uint,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

fn memory() -> (u64, u64, u64) {
    let total = model().memory_bytes;
    let used = MEM_CURRENT.load(Ordering::Relaxed);
    (total, total.saturating_sub(used), used)
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(device: *mut c_void, m: *mut Memory) -> NvmlReturn {
    run(|| {
        dev(device)?;
        let (total, free, used) = memory();
        put(m, Memory { total, free, used })
    })
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(device: *mut c_void, m: *mut MemoryV2) -> NvmlReturn {
    run(|| {
        dev(device)?;
        if m.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let (total, free, used) = memory();
        let version = (*m).version;
        put(m, MemoryV2 { version, total, reserved: 0, free, used })
    })
}

#[repr(C)]
pub struct Utilization {
    gpu: c_uint,
    memory: c_uint,
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(device: *mut c_void, u: *mut Utilization) -> NvmlReturn {
    run(|| {
        dev(device)?;
        // `swap` first: a launch that ended since the last query counts, and clears for the next.
        let ran = BUSY_SINCE_QUERY.swap(false, Ordering::Relaxed) | BUSY.load(Ordering::Relaxed);
        let busy = if ran { 100 } else { 0 };
        put(u, Utilization { gpu: busy, memory: busy })
    })
}

#[repr(C)]
pub struct ProcessInfo {
    pid: c_uint,
    used_gpu_memory: u64,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

/// This process, while it holds the primary context, using the VM allocator's current bytes.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: *mut c_void,
    count: *mut c_uint,
    infos: *mut ProcessInfo,
) -> NvmlReturn {
    run(|| {
        dev(device)?;
        if count.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let n = (PRIMARY_ACTIVE.load(Ordering::Relaxed) > 0) as c_uint;
        let room = *count;
        *count = n;
        if n == 0 {
            return Ok(());
        }
        if room < n || infos.is_null() {
            return Err(INSUFFICIENT_SIZE);
        }
        let (_, _, used) = memory();
        infos.write(ProcessInfo {
            pid: std::process::id(),
            used_gpu_memory: used,
            gpu_instance_id: c_uint::MAX,
            compute_instance_id: c_uint::MAX,
        });
        Ok(())
    })
}
