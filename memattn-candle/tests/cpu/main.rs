//! memattn-candle's ops on candle CPU tensors (the PTX VM path), in one test executable: each
//! area is a module (one link instead of one per file). The CUDA-device test is
//! `tests/cuda_decode_loop.rs` (feature `cuda`, its own process: it reads the driver's copy count).

#[path = "../common/mod.rs"]
mod common;

mod against_candle_ops;
mod backward;
mod decode_loop;
mod kvcache_append;
mod kvcache_opts;
mod typed_errors;
mod vm_notice;
