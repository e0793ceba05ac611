//! `vm-cuda`: a CUDA driver library (`libcuda.so`) and an NVML library backed by `ptx-vm`.
//!
//! The package is `memattn-vm-cuda` (the folder `vm-cuda/`); the library keeps the name `vm_cuda`,
//! which names its file. Build it (`cargo build -p memattn-vm-cuda`) and a program that uses the
//! CUDA driver API to load PTX and launch kernels (memattn's `cuda` backend, any cudarc program,
//! a candle custom op) runs on the CPU, with the VM's memcheck, initcheck and racecheck on every
//! launch. Nothing loads it by accident: its file is `libvm_cuda.so`, and a program gets it only when asked for, either by
//! loading it by path first (memattn: `MEMATTN_CUDA_DRIVER=/path/to/libvm_cuda.so`; the library's
//! soname is `libcuda.so`, so the loader then hands it out for that name) or through a directory
//! on `LD_LIBRARY_PATH` holding a `libcuda.so` link to it.
//!
//! What is modelled: one device (sm_80 by default, `VM_CUDA_ARCH=sm_90` for an sm_90 part) with
//! its attributes, the primary context and the current context of each thread, streams, PTX
//! modules (a JIT error log for PTX the VM cannot load), functions and their attributes (the
//! opt-in above 48 KiB of dynamic shared memory is enforced as the driver does), `cuLaunchKernel`
//! with `kernelParams` laid out as the PTX `.param` declarations say, memory (alloc, free, memset,
//! copies, `cuMemGetInfo`), events with elapsed time, and NVML's device queries (memory from the
//! VM allocator, utilisation 100 % for a sample period in which a launch ran). Every other function cudarc 0.19 may
//! resolve for CUDA 12.8 exists and returns `CUDA_ERROR_NOT_SUPPORTED`, with
//! `cuGetErrorString` naming the function.
//!
//! What is not modelled: timing (events measure the VM's wall clock), concurrency (every call,
//! launches included, completes before it returns, so streams are ordered trivially), the runtime
//! API (`libcudart`), cubin/fatbin/SASS images, unified/managed and pinned host memory, graphs,
//! memory pools, multiple devices or contexts. A launch fault is returned by `cuLaunchKernel`
//! itself (the real driver reports it at the next synchronising call) and is not sticky.
#![allow(clippy::missing_safety_doc)] // The exported functions follow the CUDA driver API's contracts.

mod driver;
mod nvml;
mod stubs;

pub use driver::{implemented_functions, stubbed_functions};
