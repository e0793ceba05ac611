//! ptx-vm's integration tests, one module per area, in one test binary: one link against the
//! library instead of one per file, and the areas' tests run side by side. (`tests/shared.rs` is a
//! binary of its own: it counts the module parses of its process.)

#[path = "../util/mod.rs"]
mod util;

mod coalescing;
mod fused;
mod hopper_tma;
mod instructions;
mod kernels;
mod memcheck;
mod named_barriers;
mod robustness;
mod source_lines;
mod tensor_core;
mod wgmma;
