//! The library's integration tests, one module per area, in one test binary: one link instead of
//! one per file, and the areas' tests run side by side. The tests that set the driver variable
//! or count the process's module parses are binaries of their own (`cuda_context_*.rs`,
//! `one_parse_per_process.rs`).

#[path = "../common/mod.rs"]
mod common;

mod alibi;
mod attn_api;
mod attn_safety;
mod chunked_prefill;
mod hopper;
mod kv_device_check;
