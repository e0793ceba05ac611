//! The end-to-end tests of the library and the command's runner, one module per area, in one test
//! binary: one link instead of one per file, and the areas' tests run side by side.

/// The helpers of the `memattn` library's integration tests, shared with `memattn/tests`.
#[path = "../../../memattn/tests/common/mod.rs"]
mod common;

mod api;
mod attention;
mod cp;
mod cuda_backend;
mod decode;
mod findings;
mod safetensors_roundtrip;
