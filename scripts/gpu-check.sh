#!/usr/bin/env bash
# GPU check for memattn: runs the prebuilt release binary on a machine with an NVIDIA GPU and no
# Rust toolchain. Finishes in well under 5 minutes on a current data-centre GPU.
#
#   Build (on a machine with the toolchain):  cargo build --release -p memattn
#   Carry:  target/release/memattn (git-ignored, so name it explicitly, e.g. in the runner's carry
#           list, or copy it next to this script); the GPU machine needs only the NVIDIA driver.
#   Run:    bash scripts/gpu-check.sh target/release/memattn   (default binary: ./memattn)
#
# Every step's output goes to the terminal and, when $OUT is set, to $OUT/gpu-check/<step>.{out,err}.
# The last thing printed is a summary table: step, exit code, seconds, what it showed.
set -u

BIN="${1:-./memattn}"
if [ ! -x "$BIN" ]; then
    echo "gpu-check: no executable memattn at '$BIN' (pass the path as the first argument)" >&2
    exit 2
fi
LOG=""
if [ -n "${OUT:-}" ]; then
    LOG="$OUT/gpu-check"
    mkdir -p "$LOG"
fi

SUMMARY=()
FAILED=0

# step NAME TIMEOUT_S ARGS... : runs the binary, logs stdout/stderr, records exit code and time.
step() {
    local name="$1" limit="$2"
    shift 2
    local t0 t1 rc out err
    out="$(mktemp)"
    err="$(mktemp)"
    t0=$(date +%s.%N)
    timeout "$limit" "$BIN" "$@" >"$out" 2>"$err"
    rc=$?
    t1=$(date +%s.%N)
    echo "=== $name: memattn $* (exit $rc)"
    cat "$out"
    cat "$err" >&2
    if [ -n "$LOG" ]; then
        cp "$out" "$LOG/$name.out"
        cp "$err" "$LOG/$name.err"
    fi
    local note=""
    if grep -q '"verified": true' "$out" 2>/dev/null; then note="verified"; fi
    if grep -q '"verified": false' "$out" 2>/dev/null; then note="NOT VERIFIED"; fi
    if [ "$rc" = 124 ]; then note="timed out after ${limit}s"; fi
    if [ "$rc" != 0 ] && [ -z "$note" ]; then note="$(grep -m1 . "$err" | cut -c1-100)"; fi
    [ "$rc" = 0 ] || FAILED=1
    SUMMARY+=("$(printf '%-22s %4s %7.1f  %s' "$name" "$rc" "$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')" "$note")")
    LAST_OUT="$out"
}

command -v nvidia-smi >/dev/null && { echo "=== nvidia-smi"; nvidia-smi; }

step doctor 30 doctor
step doctor-json 30 --json doctor
step kernels 30 kernels

# Correctness on the GPU: both kernels, d 64/128, causal, tails, seq_q != seq_kv, bhsd.
step run-flash-d64 60 --backend cuda --json run --kernel flash --batch 2 --heads 4 --seq-q 1000 --seq-kv 1000 --head-dim 64
step run-naive-d64 60 --backend cuda --json run --kernel naive --batch 2 --heads 4 --seq-q 1000 --seq-kv 1000 --head-dim 64
step run-flash-d128-causal 60 --backend cuda --json run --kernel flash --heads 8 --seq-q 777 --seq-kv 1500 --head-dim 128 --causal
step run-naive-d128-causal 60 --backend cuda --json run --kernel naive --heads 8 --seq-q 777 --seq-kv 1500 --head-dim 128 --causal
step run-flash-bhsd 60 --backend cuda --json run --kernel flash --batch 3 --heads 5 --seq 333 --layout bhsd --check-rows all

# Memory: naive needs 4 * 8 * 16 * 16384^2 B = 128 GiB of scores at this size, so use a size
# where S is several GiB: batch 1, heads 16, seq 16384 -> S = 16 GiB; flash needs ~0.3 GiB.
step compare-memory 180 --backend cuda compare --batch 1 --heads 16 --seq 16384 --head-dim 64 --repeats 3 --warmup 1
step compare-memory-json 180 --backend cuda --json compare --batch 1 --heads 16 --seq 16384 --head-dim 64 --repeats 3 --warmup 1

# Short timing: causal vs not, flash only, default repeats (10, warm-up 3).
step timing-causal 120 --backend cuda compare --kernel flash --vary causal=false,true --batch 4 --heads 16 --seq 4096 --head-dim 128
step sweep 180 --backend cuda sweep --heads 8 --vary seq=1024,4096,16384 --plot "${LOG:-.}/memattn-sweep.svg"

echo
echo "=== summary ($BIN)"
printf '%-22s %4s %7s  %s\n' step exit seconds note
for line in "${SUMMARY[@]}"; do echo "$line"; done
exit $FAILED
