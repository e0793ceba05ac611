//! The `memattn` library's API tests, through its public API only. They live here rather than in
//! `memattn/tests` because that package builds at opt-level 2 with its tests (7 s of a core for
//! this file set alone); here they build unoptimised in this executable and call the optimised
//! library. The tests that set the driver variable or count the process's module parses are
//! binaries of their own in `memattn/tests` (`cuda_context_*.rs`, `one_parse_per_process.rs`).

mod alibi;
mod attn_api;
mod attn_safety;
mod chunked_prefill;
mod hopper;
mod kv_device_check;
mod shared_prefix;
