//! The command's integration tests (they run the `memattn` binary), one module per area, in one
//! test binary: one link instead of one per file, and the areas' tests run side by side.

#[path = "../common/mod.rs"]
mod common;

mod backward_cli;
mod cli;
mod cuda_vm;
mod decode_cli;
mod draw;
mod guide;
mod hardening;
mod help_examples;
mod launch;
mod limits;
mod naive_backward_cli;
mod padded_head_dims;
mod plan_evidence;
mod resources;
mod sectors;
mod timeline;
mod trace;
