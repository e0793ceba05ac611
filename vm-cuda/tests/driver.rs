//! The VM-backed driver called through cudarc exactly as a user program calls a GPU: the library
//! is loaded by its path first, then cudarc's own `dlopen("libcuda.so")` gets it.

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{result, CudaContext, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use kernels_gpu::abi::{AttnParams, Strides};
use kernels_gpu::tiles::FLASH_F32_D64;
use std::ffi::{c_void, CString};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use kernels_gpu::artifacts::PTX;

/// `libvm_cuda.so`, built by cargo next to this test's executable.
fn library_path() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    for dir in [deps, deps.parent().unwrap()] {
        let p = dir.join("libvm_cuda.so");
        if p.exists() {
            return p;
        }
    }
    panic!("libvm_cuda.so is not next to {} (cargo builds it with this test)", exe.display());
}

/// Loads the VM-backed driver once and serialises the tests (they share one device and its
/// memory figures).
fn driver() -> (MutexGuard<'static, ()>, Arc<CudaContext>) {
    static LIB: OnceLock<libloading::Library> = OnceLock::new();
    static SERIAL: Mutex<()> = Mutex::new(());
    let guard = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    LIB.get_or_init(|| unsafe { libloading::Library::new(library_path()).expect("load libvm_cuda.so") });
    let ctx = CudaContext::new(0).expect("the VM-backed device opens");
    (guard, ctx)
}

fn err_text(e: &cudarc::driver::DriverError) -> String {
    e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
}

#[test]
fn device_attributes_model_an_sm80_part() {
    let (_g, ctx) = driver();
    assert!(ctx.name().unwrap().contains("ptx-vm"), "{}", ctx.name().unwrap());
    assert_eq!(ctx.compute_capability().unwrap(), (8, 0));
    use sys::CUdevice_attribute::*;
    assert_eq!(ctx.attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK).unwrap(), 48 * 1024);
    assert_eq!(ctx.attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN).unwrap(), 163 * 1024);
    assert_eq!(ctx.attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).unwrap(), 108);
    assert_eq!(ctx.attribute(CU_DEVICE_ATTRIBUTE_WARP_SIZE).unwrap(), 32);
    let mut v = 0;
    unsafe { sys::cuDriverGetVersion(&mut v) }.result().unwrap();
    assert_eq!(v, 12080);
    let total = unsafe { result::device::total_mem(0) }.unwrap();
    assert_eq!(total, 16 << 30);
    assert_eq!(result::device::get_count().unwrap(), 1);
    assert_eq!(result::device::get(1).unwrap_err().0, CUresult::CUDA_ERROR_INVALID_DEVICE);
}

#[test]
fn saxpy_through_cudarc_with_memory_figures() {
    let (_g, ctx) = driver();
    let stream = ctx.new_stream().unwrap();
    let module = ctx.load_module(Ptx::from_src(PTX)).unwrap();
    let f = module.load_function("saxpy_f32").unwrap();
    let n = 1000u32;
    let x: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let y: Vec<f32> = (0..n).map(|i| 3.0 - i as f32).collect();
    let (free0, total) = result::mem_get_info().unwrap();
    let dx = stream.clone_htod(&x).unwrap();
    let mut dy = stream.clone_htod(&y).unwrap();
    let (free1, _) = result::mem_get_info().unwrap();
    assert_eq!(free0 - free1, 8 * n as usize, "cuMemGetInfo counts the two buffers exactly");
    assert_eq!(total, 16 << 30);
    let a = 1.25f32;
    let mut b = stream.launch_builder(&f);
    b.arg(&n).arg(&a).arg(&dx).arg(&mut dy);
    unsafe {
        b.launch(LaunchConfig { grid_dim: (n.div_ceil(256), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 })
    }
    .unwrap();
    let out = stream.clone_dtoh(&dy).unwrap();
    for i in 0..n as usize {
        assert_eq!(out[i], a.mul_add(x[i], y[i]), "element {i}");
    }
    // Device-to-device copy and memset.
    let mut dz = stream.alloc_zeros::<f32>(n as usize).unwrap();
    stream.memcpy_dtod(&dy, &mut dz).unwrap();
    assert_eq!(stream.clone_dtoh(&dz).unwrap(), out);
    stream.memset_zeros(&mut dz).unwrap();
    assert!(stream.clone_dtoh(&dz).unwrap().iter().all(|&v| v == 0.0));
    drop((dx, dy, dz));
    let (free2, _) = result::mem_get_info().unwrap();
    assert_eq!(free2, free0, "every buffer is freed");
}

#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct Params(AttnParams);
unsafe impl DeviceRepr for Params {}

/// O in f64 for `[head, seq, d]` inputs; `shape` = (heads, seq_q, seq_kv, head_dim).
fn reference(q: &[f32], k: &[f32], v: &[f32], shape: (usize, usize, usize, usize), causal: bool) -> Vec<f64> {
    let (h, sq, skv, d) = shape;
    let mut o = vec![0f64; h * sq * d];
    let scale = 1.0 / (d as f64).sqrt();
    for hh in 0..h {
        for i in 0..sq {
            // Bottom-right causal: query i sees keys j <= i + skv - sq.
            let end = if causal { (i as i64 + 1 + skv as i64 - sq as i64).clamp(0, skv as i64) as usize } else { skv };
            let qi = &q[(hh * sq + i) * d..][..d];
            let s: Vec<f64> = (0..end)
                .map(|j| (0..d).map(|t| qi[t] as f64 * k[(hh * skv + j) * d + t] as f64).sum::<f64>() * scale)
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = s.iter().map(|x| (x - m).exp()).sum();
            for t in 0..d {
                let acc: f64 = (0..end).map(|j| (s[j] - m).exp() * v[(hh * skv + j) * d + t] as f64).sum();
                o[(hh * sq + i) * d + t] = if end == 0 { 0.0 } else { acc / sum };
            }
        }
    }
    o
}

#[test]
fn flash_kernel_matches_an_f64_reference() {
    let (_g, ctx) = driver();
    let stream = ctx.default_stream();
    let module = ctx.load_module(Ptx::from_src(PTX)).unwrap();
    let f = module.load_function("flash_fwd_f32_d64").unwrap();
    let (h, sq, skv, d) = (2usize, 40usize, 70usize, 64usize);
    let gen = |n: usize, seed: u32| -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    };
    let (q, k, v) = (gen(h * sq * d, 1), gen(h * skv * d, 2), gen(h * skv * d, 3));
    let (dq, dk, dv) = (stream.clone_htod(&q).unwrap(), stream.clone_htod(&k).unwrap(), stream.clone_htod(&v).unwrap());
    for causal in [false, true] {
        let o = stream.clone_htod(&vec![f32::NAN; h * sq * d]).unwrap();
        let lse = stream.clone_htod(&vec![f32::NAN; h * sq]).unwrap();
        let ptr = |s: &cudarc::driver::CudaSlice<f32>| s.device_ptr(&stream).0;
        let p = Params(AttnParams {
            q: ptr(&dq),
            k: ptr(&dk),
            v: ptr(&dv),
            o: ptr(&o),
            lse: ptr(&lse),
            scores: 0,
            q_strides: Strides::bhsd(sq as u64, h as u64, d as u64),
            k_strides: Strides::bhsd(skv as u64, h as u64, d as u64),
            v_strides: Strides::bhsd(skv as u64, h as u64, d as u64),
            o_strides: Strides::bhsd(sq as u64, h as u64, d as u64),
            batch: 1,
            heads: h as u32,
            seq_q: sq as u32,
            seq_kv: skv as u32,
            head_dim: d as u32,
            causal: causal as u32,
            softmax_scale: 1.0 / (d as f32).sqrt(),
            ..AttnParams::default()
        });
        let dims = FLASH_F32_D64.launch(1, h as u32, sq as u32);
        let cfg = LaunchConfig {
            grid_dim: (dims.grid[0], dims.grid[1], dims.grid[2]),
            block_dim: (dims.block[0], dims.block[1], dims.block[2]),
            shared_mem_bytes: dims.dynamic_smem_bytes,
        };
        let mut b = stream.launch_builder(&f);
        b.arg(&p);
        unsafe { b.launch(cfg) }.unwrap();
        let got = stream.clone_dtoh(&o).unwrap();
        let want = reference(&q, &k, &v, (h, sq, skv, d), causal);
        let worst = got.iter().zip(&want).map(|(g, w)| (*g as f64 - w).abs()).fold(0f64, f64::max);
        assert!(worst < 1e-5, "causal {causal}: worst abs error {worst}");
        assert!(want.iter().any(|w| w.abs() > 0.05), "the reference is not all zeros");
    }
}

#[test]
fn events_time_a_launch() {
    let (_g, ctx) = driver();
    let stream = ctx.default_stream();
    let module = ctx.load_module(Ptx::from_src(PTX)).unwrap();
    let f = module.load_function("saxpy_f32").unwrap();
    let n = 1 << 16;
    let dx = stream.clone_htod(&vec![1f32; n as usize]).unwrap();
    let mut dy = stream.clone_htod(&vec![2f32; n as usize]).unwrap();
    let start = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
    let end = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
    start.record(&stream).unwrap();
    let mut b = stream.launch_builder(&f);
    b.arg(&n).arg(&3f32).arg(&dx).arg(&mut dy);
    unsafe { b.launch(LaunchConfig::for_num_elems(n)) }.unwrap();
    end.record(&stream).unwrap();
    end.synchronize().unwrap();
    let ms = start.elapsed_ms(&end).unwrap();
    assert!(ms > 0.0 && ms < 60_000.0, "{ms} ms");
    assert!(stream.clone_dtoh(&dy).unwrap().iter().all(|&v| v == 5.0));
    // An event without timing cannot be timed.
    let untimed = ctx.new_event(None).unwrap();
    untimed.record(&stream).unwrap();
    assert_eq!(start.elapsed_ms(&untimed).unwrap_err().0, CUresult::CUDA_ERROR_INVALID_HANDLE);
}

#[test]
fn bad_ptx_fails_with_a_jit_error_log() {
    let (_g, _ctx) = driver();
    let text = CString::new(
        ".version 7.0\n.target sm_80\n.address_size 64\n.visible .entry k()\n{\n\tfrobnicate.f32 %r1;\n}\n",
    )
    .unwrap();
    let mut log = vec![0u8; 4096];
    let mut options =
        [sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER, sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
    let mut values = [log.as_mut_ptr() as *mut c_void, log.len() as *mut c_void];
    let mut module = std::ptr::null_mut();
    let r = unsafe {
        sys::cuModuleLoadDataEx(
            &mut module,
            text.as_ptr() as *const c_void,
            2,
            options.as_mut_ptr(),
            values.as_mut_ptr(),
        )
    };
    assert_eq!(r, CUresult::CUDA_ERROR_INVALID_PTX);
    let end = log.iter().position(|&b| b == 0).unwrap();
    let log = String::from_utf8_lossy(&log[..end]);
    assert!(log.contains("PTX line 6") && log.contains("frobnicate"), "{log}");
    assert_eq!(values[1] as usize, end + 1, "the driver writes back the log size");
    // A cubin (ELF) image is not PTX.
    let elf = b"\x7fELF\x02\x01\x01\x00\x00\x00";
    let e = unsafe { result::module::load_data(elf.as_ptr() as *const c_void) }.unwrap_err();
    assert_eq!(e.0, CUresult::CUDA_ERROR_INVALID_IMAGE);
    assert!(err_text(&e).contains("cubin"), "{}", err_text(&e));
    // PTX for a newer architecture than the device's.
    let newer = CString::new(PTX.replacen(".target sm_80", ".target sm_90", 1)).unwrap();
    let e = unsafe { result::module::load_data(newer.as_ptr() as *const c_void) }.unwrap_err();
    assert_eq!(e.0, CUresult::CUDA_ERROR_INVALID_PTX);
    assert!(err_text(&e).contains("sm_90"), "{}", err_text(&e));
}

#[test]
fn out_of_bounds_launch_is_an_illegal_address_naming_the_finding() {
    let (_g, ctx) = driver();
    let stream = ctx.default_stream();
    let module = ctx.load_module(Ptx::from_src(PTX)).unwrap();
    let f = module.load_function("saxpy_f32").unwrap();
    let dx = stream.clone_htod(&vec![1f32; 100]).unwrap();
    let mut dy = stream.clone_htod(&vec![1f32; 100]).unwrap();
    let n = 101u32; // one element past both buffers
    let mut b = stream.launch_builder(&f);
    b.arg(&n).arg(&1f32).arg(&dx).arg(&mut dy);
    let e = unsafe { b.launch(LaunchConfig::for_num_elems(n)) }.unwrap_err();
    assert_eq!(e.0, CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
    let text = err_text(&e);
    assert!(
        text.contains("out-of-bounds") && text.contains("saxpy_f32") && text.contains("thread (100, 0, 0)"),
        "{text}"
    );
    // Not sticky: the context keeps working.
    assert_eq!(stream.clone_dtoh(&dy).unwrap()[0], 2.0);
}

#[test]
fn shared_memory_above_48k_needs_the_opt_in() {
    let (_g, ctx) = driver();
    let stream = ctx.default_stream();
    let module = ctx.load_module(Ptx::from_src(PTX)).unwrap();
    let f = module.load_function("saxpy_f32").unwrap();
    let n = 256u32;
    let dx = stream.clone_htod(&vec![1f32; 256]).unwrap();
    let mut dy = stream.clone_htod(&vec![1f32; 256]).unwrap();
    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 64 * 1024 };
    let launch = |dy: &mut cudarc::driver::CudaSlice<f32>| {
        let mut b = stream.launch_builder(&f);
        b.arg(&n).arg(&1f32).arg(&dx).arg(dy);
        unsafe { b.launch(cfg) }
    };
    let e = launch(&mut dy).unwrap_err();
    assert_eq!(e.0, CUresult::CUDA_ERROR_INVALID_VALUE);
    assert!(err_text(&e).contains("CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES"), "{}", err_text(&e));
    use sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYN;
    assert_eq!(f.get_attribute(MAX_DYN).unwrap(), 48 * 1024);
    // Above the device's opt-in limit: refused.
    assert_eq!(f.set_attribute(MAX_DYN, 164 * 1024).unwrap_err().0, CUresult::CUDA_ERROR_INVALID_VALUE);
    f.set_attribute(MAX_DYN, 64 * 1024).unwrap();
    launch(&mut dy).unwrap();
    assert!(stream.clone_dtoh(&dy).unwrap().iter().all(|&v| v == 2.0));
}

#[test]
fn double_free_oom_and_unsupported_calls_are_errors() {
    let (_g, _ctx) = driver();
    let p = unsafe { result::malloc_sync(1024) }.unwrap();
    unsafe { result::free_sync(p) }.unwrap();
    assert_eq!(unsafe { result::free_sync(p) }.unwrap_err().0, CUresult::CUDA_ERROR_INVALID_VALUE);
    let e = unsafe { result::malloc_sync(17 << 30) }.unwrap_err();
    assert_eq!(e.0, CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    // A function the library does not model.
    let mut g = std::ptr::null_mut();
    let r = unsafe { sys::cuGraphCreate(&mut g, 0) };
    assert_eq!(r, CUresult::CUDA_ERROR_NOT_SUPPORTED);
    let e = r.result().unwrap_err();
    assert!(err_text(&e).contains("cuGraphCreate"), "{}", err_text(&e));
}

#[test]
fn nvml_reads_the_same_allocator() {
    let (_g, ctx) = driver();
    let nvml = nvml_wrapper::Nvml::builder().lib_path(library_path().as_os_str()).init().unwrap();
    let dev = nvml.device_by_index(0).unwrap();
    let uuid = ctx.uuid().unwrap();
    let hex: String = uuid.bytes.iter().map(|&b| format!("{:02x}", b as u8)).collect();
    assert_eq!(dev.uuid().unwrap().replace('-', ""), format!("GPU{hex}"));
    assert_eq!(dev.name().unwrap(), ctx.name().unwrap());
    let before = dev.memory_info().unwrap();
    let stream = ctx.default_stream();
    let buf = stream.alloc_zeros::<u8>(3 << 20).unwrap();
    let during = dev.memory_info().unwrap();
    assert_eq!(during.used - before.used, 3 << 20);
    assert_eq!(during.total, 16 << 30);
    assert_eq!(during.free + during.used, during.total);
    let (free, _) = result::mem_get_info().unwrap();
    assert_eq!(free as u64, during.free, "NVML and cuMemGetInfo agree");
    let procs = dev.running_compute_processes().unwrap();
    assert_eq!(procs.len(), 1);
    assert_eq!(procs[0].pid, std::process::id());
    assert_eq!(procs[0].used_gpu_memory, nvml_wrapper::enums::device::UsedGpuMemory::Used(during.used));
    drop(buf);
    assert_eq!(dev.memory_info().unwrap().used, before.used);
    // Utilisation covers the sample period since the previous query: the first query may still
    // see a launch of an earlier test in this process; with no launch since, the next is 0.
    let _ = dev.utilization_rates().unwrap();
    assert_eq!(dev.utilization_rates().unwrap().gpu, 0, "idle between launches");
    let cc = dev.cuda_compute_capability().unwrap();
    assert_eq!((cc.major, cc.minor), (8, 0));
}

#[test]
fn a_reloaded_module_starts_from_its_initialisers() {
    // The driver shares one parsed module per text across loads; its globals still belong to
    // the load: unloading and loading the same text again resets them, as on a GPU.
    let (_g, ctx) = driver();
    let stream = ctx.default_stream();
    let text = ".version 7.0\n.target sm_80\n.address_size 64\n.global .align 4 .u32 counter = 40;\n\
        .visible .entry bump(.param .u64 o)\n{\n.reg .b32 %r<4>;\n.reg .b64 %rd<4>;\n\
        ld.param.u64 %rd1, [o];\ncvta.to.global.u64 %rd1, %rd1;\nld.global.u32 %r1, [counter];\n\
        add.s32 %r1, %r1, 1;\nst.global.u32 [counter], %r1;\nst.global.u32 [%rd1], %r1;\nret;\n}\n";
    let mut out = stream.alloc_zeros::<u32>(1).unwrap();
    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
    let mut seen = Vec::new();
    for _ in 0..2 {
        let module = ctx.load_module(Ptx::from_src(text)).unwrap();
        let f = module.load_function("bump").unwrap();
        for _ in 0..2 {
            let mut b = stream.launch_builder(&f);
            b.arg(&mut out);
            unsafe { b.launch(cfg) }.unwrap();
            seen.push(stream.clone_dtoh(&out).unwrap()[0]);
        }
        drop((f, module));
    }
    assert_eq!(seen, [41, 42, 41, 42]);
}
