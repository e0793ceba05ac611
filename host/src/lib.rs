//! `memattn`: run memattn's attention kernels on a GPU (CUDA driver) or in the PTX VM, check every
//! result against an f64 CPU reference, and measure time and device memory.
//!
//! The pieces, in the order a run uses them:
//! - [`problem`]: the attention problem (shape, dtype, causal, scale, layout) and its validation
//!   against the device, before anything is allocated.
//! - [`memory`]: analytic bytes each kernel needs (inputs, outputs, workspace).
//! - [`device`]: the [`device::Device`] trait and its two backends, `vm` and `cuda`.
//! - [`runner`]: one measured run: upload, poison, launch, time, download.
//! - [`reference`] and [`verify`]: the f64 reference and the error metrics.
//! - [`timing`]: medians and FLOP counts.
//! - [`ptx`]: the embedded PTX module and what is known about it.
//! - [`safetensors_io`], [`report`], [`plot`], [`charts`]: files, tables and pictures.
//! - [`plan`]: the memory budget of an inference workload; [`evidence`]: the `--save` file.

pub mod charts;
pub mod device;
pub mod dtype;
pub mod error;
pub mod evidence;
pub mod inputs;
pub mod memory;
pub mod nvml;
pub mod plan;
pub mod plot;
pub mod problem;
pub mod ptx;
pub mod reference;
pub mod report;
pub mod rng;
pub mod runner;
pub mod safetensors_io;
pub mod sha256;
pub mod timing;
pub mod verify;

pub use device::{Backend, BackendChoice, Device};
pub use dtype::Dtype;
pub use error::Error;
pub use problem::{KernelKind, Layout, Problem};
