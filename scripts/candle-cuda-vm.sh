#!/usr/bin/env bash
# Runs memattn-candle's CUDA path (feature `cuda`: candle's CUDA device, memattn's kernels on
# candle's stream) on the VM-backed CUDA driver, without a GPU or the CUDA toolkit:
#   bash scripts/candle-cuda-vm.sh            # builds, then runs tests/cuda_decode_loop.rs
#
# candle-core's `cuda` feature links libcuda, cuBLAS, cuBLASLt, cuRAND, NVRTC and the CUDA
# runtime, and builds candle's own kernels with nvcc. Here:
# - libcuda is vm-cuda (libvm_cuda.so under the name libcuda.so), which runs PTX in ptx-vm;
# - the other libraries are stand-ins (scripts/candle-cuda-vm/stubs.c): creating a cuBLAS
#   handle or a cuRAND generator succeeds, so `Device::new_cuda` works, and every other
#   function fails with a non-zero status;
# - nvcc is the stand-in of scripts/nvcc-check-stub (empty outputs), so candle's own kernels
#   are empty: the test creates and reads tensors with copies only and runs no candle kernel
#   on the device (one that tried would fail to load its module, never compute a wrong value).
# The build goes to a target folder of its own (target/candle-cuda-vm) so the workspace's
# builds are untouched.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR_CANDLE_CUDA:-$repo/target/candle-cuda-vm}"
# The stand-ins and the environment that builds and runs against them (scripts/candle-cuda-vm/env.sh).
source scripts/candle-cuda-vm/env.sh
cargo test -p memattn-candle --features cuda --test cuda_decode_loop -- --nocapture
