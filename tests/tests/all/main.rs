//! The end-to-end tests of the library and the command's runner, one module per area, in one test
//! binary: one link instead of one per file, and the areas' tests run side by side.

mod attention;
mod cp;
mod cuda_backend;
mod decode;
mod findings;
mod safetensors_roundtrip;
