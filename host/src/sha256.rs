//! SHA-256 of the loaded PTX, compared with `build-info.json` to tell which build it is (the
//! helper is kernels-gpu's, which owns the artifacts).

pub use kernels_gpu::artifacts::sha256_hex;
