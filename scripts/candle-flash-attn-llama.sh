#!/usr/bin/env bash
# candle-transformers' llama with its `flash-attn` feature and candle-flash-attn patched to this
# repository's drop-in (candle-flash-attn/llama-check, a workspace of its own), on candle's CPU
# device: flash attention on and off, logits compared over 12 decoding steps (src/main.rs there).
#   bash scripts/candle-flash-attn-llama.sh
#
# The feature turns on candle's `cuda`, so the build needs what scripts/candle-cuda-vm.sh sets up:
# the stand-in nvcc (candle's own kernels are empty) and the stand-in CUDA libraries to link and
# load (nothing runs on a CUDA device here). It uses that script's target folder, so the crates
# both build (candle-core with `cuda`, cudarc, memattn, ...) are compiled once.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR_CANDLE_CUDA:-$PWD/target/candle-cuda-vm}"
source scripts/candle-cuda-vm/env.sh
manifest=candle-flash-attn/llama-check/Cargo.toml
start=$(date +%s)
# Not --locked: the lock pins the registry crates; cargo updates the entries of the path crates
# (memattn's own) when they change.
cargo build --quiet --manifest-path "$manifest"
built=$(date +%s)
# The check's own notice: memattn-candle says once that the CPU device runs in the PTX VM.
"$CARGO_TARGET_DIR/debug/llama-check"
echo "llama-check: build $((built - start)) s, run $(($(date +%s) - built)) s"
