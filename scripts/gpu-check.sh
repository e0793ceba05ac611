#!/usr/bin/env bash
# GPU check for memattn: runs the prebuilt release binary on a machine with an NVIDIA GPU and no
# Rust toolchain. About 7 minutes on an H200 (its first run and every figure: docs/gpu-h200.md).
#
#   Build (on a machine with the toolchain):
#           cargo build --release -p memattn-cli && cargo build --release -p memattn --example caller_context
#   Carry:  target/release/memattn and target/release/examples/caller_context (git-ignored, so name
#           them explicitly, e.g. in the runner's carry list); the GPU machine needs only the
#           NVIDIA driver.
#   Run:    bash scripts/gpu-check.sh target/release/memattn   (default binary: ./memattn; the
#           example is looked for at $CALLER_CONTEXT_BIN, else examples/caller_context next to it)
#
# With a 15-minute device lease, run scripts/gpu-tune.sh first (480 s: the forward and decode
# candidates against PyTorch SDPA and FlashAttention-3) and then this script with MEMATTN_BENCH=0.
#
# Every step's output goes to the terminal and, when $OUT is set, to $OUT/gpu-check/<step>.{out,err}.
# The last things printed are the benchmark table (memattn vs PyTorch SDPA, bf16/f16) and a
# summary table: step, exit code, seconds, what it showed.
#
# Benchmark against PyTorch (the bench part is capped at $BENCH_BUDGET_S seconds, default 150;
# shapes left when the budget runs out are listed as skipped):
#   for each shape memattn runs `--backend cuda --json run --kernel flash --dtype bf16 ...`
#   (verified on 128 sampled query rows, median of 10 launches after 3 warm-up), and
#   scripts/bench_sdpa.py times torch.nn.functional.scaled_dot_product_attention with the flash
#   backend on the same shapes (skipped, with the reason, when `import torch` fails).
#   Shapes: batch = 16384 / seq, heads = 2048 / head_dim (the same total work per seq, enough
#   blocks to fill the GPU), seq 1024/4096/16384, d 64/128, causal and not, bf16; one f16 shape;
#   then the other head dims, d 32/96/192/256 at seq 4096, causal and not, bf16 (heads = 2048 / d
#   rounded down: 64, 21, 10, 8).
#   memattn runs its default kernel for each shape (on sm_90 the Hopper forward at d128 and d256,
#   from the measured table; each shape's JSON names it); MEMATTN_HOPPER=0 times the sm_80
#   kernels everywhere.
#   MEMATTN_BENCH=0 skips the benchmark.
set -u

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
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
    timeout "$limit" "${STEP_BIN:-$BIN}" "$@" >"$out" 2>"$err"
    rc=$?
    t1=$(date +%s.%N)
    echo "=== $name: $(basename "${STEP_BIN:-$BIN}") $* (exit $rc)"
    cat "$out"
    cat "$err" >&2
    if [ -n "$LOG" ]; then
        cp "$out" "$LOG/$name.out"
        cp "$err" "$LOG/$name.err"
    fi
    local note=""
    if grep -q '"verified": true' "$out" 2>/dev/null; then note="verified"; fi
    if grep -q '"verified": false' "$out" 2>/dev/null; then note="NOT VERIFIED"; fi
    if grep -q '^verified: every part' "$out" 2>/dev/null; then note="verified"; fi
    if [ "$rc" = 124 ]; then note="timed out after ${limit}s"; fi
    if [ "$rc" != 0 ] && [ -z "$note" ]; then note="$(grep -m1 . "$err" | cut -c1-100)"; fi
    [ "$rc" = 0 ] || FAILED=1
    SUMMARY+=("$(printf '%-22s %4s %7.1f  %s' "$name" "$rc" "$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')" "$note")")
    LAST_OUT="$out"
}

command -v nvidia-smi >/dev/null && { echo "=== nvidia-smi"; nvidia-smi; }

# The first launch of a kernel in a process JIT-compiles a module of that kernel alone; with the
# driver's JIT cache off this step's seconds are that compile plus a small verified run (the
# whole 22 MB module, loaded at once before, took about 50 s on an H200).
CUDA_CACHE_DISABLE=1 step first-launch-nocache 120 --backend cuda --json run --kernel flash --dtype bf16 --heads 2 --seq 300 --head-dim 128 --causal
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

# Tensor cores: bf16 and f16 flash against the f64 reference (2x naive-in-dtype rule), d 64/128,
# causal, tails, seq_q != seq_kv, bhsd; the same problem in f32 and bf16 side by side.
step run-bf16-d64 60 --backend cuda --json run --kernel flash --dtype bf16 --batch 2 --heads 4 --seq-q 1000 --seq-kv 1000 --head-dim 64
step run-bf16-d128-causal 60 --backend cuda --json run --kernel flash --dtype bf16 --heads 8 --seq-q 777 --seq-kv 1500 --head-dim 128 --causal
step run-f16-d64-causal 60 --backend cuda --json run --kernel flash --dtype f16 --batch 3 --heads 5 --seq-q 1500 --seq-kv 777 --head-dim 64 --causal
step run-bf16-d64-window 60 --backend cuda --json run --kernel flash --dtype bf16 --batch 2 --heads 4 --seq-q 1000 --seq-kv 1300 --head-dim 64 --window 255,0 --check-rows all
step run-f16-d128-bhsd 60 --backend cuda --json run --kernel flash --dtype f16 --batch 3 --heads 5 --seq 333 --head-dim 128 --layout bhsd --check-rows all
step compare-dtype 120 --backend cuda compare --vary dtype=f32,bf16,f16 --batch 4 --heads 16 --seq 4096 --head-dim 128 --causal
step run-naive-bf16-causal 60 --backend cuda --json run --kernel naive --dtype bf16 --heads 4 --seq-q 700 --seq-kv 1000 --head-dim 64 --causal
# The other head dims (tiles in kernels-gpu/src/tiles.rs): one verified shape each, tails and
# seq_q != seq_kv, causal in half of them; f32 SIMT at two of them.
step run-bf16-d32-causal 60 --backend cuda --json run --kernel flash --dtype bf16 --batch 2 --heads 8 --seq-q 1000 --seq-kv 1300 --head-dim 32 --causal
step run-f16-d96 60 --backend cuda --json run --kernel flash --dtype f16 --batch 2 --heads 6 --seq-q 777 --seq-kv 1000 --head-dim 96
step run-bf16-d192-causal 60 --backend cuda --json run --kernel flash --dtype bf16 --batch 2 --heads 4 --seq-q 1000 --seq-kv 777 --head-dim 192 --causal
step run-bf16-d256-bhsd 60 --backend cuda --json run --kernel flash --dtype bf16 --batch 2 --heads 4 --seq 555 --head-dim 256 --layout bhsd --check-rows all
# The Hopper forward (flash_fwd_*_sm90_*, the sm_90a module: TMA, mbarriers, wgmma, warp
# specialisation). On compute capability 9.0 the library picks it by default where the measured
# table (memattn/src/choice/kernel-choice.tsv) says so, bf16/f16 d128 and d256; MEMATTN_HOPPER=1
# adds d64, MEMATTN_HOPPER=0 keeps the sm_80 module. Every step checks rows against the f64
# reference. First passed on an H200 (docs/gpu-h200.md: 1.83x the sm_80 kernel at d128, 1.76x
# at d256, 0.88x at d64).
if [ "${MEMATTN_SM90:-1}" != 0 ]; then
    # The default, with no variable: the command must name flash_fwd_bf16_sm90_d128 here.
    step sm90-default-d128 60 --backend cuda --json run --dtype bf16 --heads 4 --heads-kv 2 --seq-q 700 --seq-kv 1000 --head-dim 128 --causal --check-rows all
    # A caller's own CUDA context, as an engine holds one (memattn/examples/caller_context.rs):
    # the default forward (the Hopper one here), an e4m3 KV cache in the caller's buffers, and a
    # decode step plus a prefill captured as one CUDA graph and replayed, all checked in f64.
    CALLER_CONTEXT_BIN="${CALLER_CONTEXT_BIN:-$(dirname "$BIN")/examples/caller_context}"
    if [ -x "$CALLER_CONTEXT_BIN" ]; then
        STEP_BIN="$CALLER_CONTEXT_BIN" step caller-context 300
    else
        SUMMARY+=("$(printf '%-22s %4s %7s  %s' caller-context - - "skipped: no $CALLER_CONTEXT_BIN")")
    fi
    MEMATTN_HOPPER=1 step sm90-bf16-d128-causal 60 --backend cuda --json run --kernel flash --dtype bf16 --heads 8 --seq-q 777 --seq-kv 1500 --head-dim 128 --causal --check-rows all
    MEMATTN_HOPPER=1 step sm90-f16-d64-bhsd 60 --backend cuda --json run --kernel flash --dtype f16 --batch 3 --heads 5 --seq 333 --head-dim 64 --layout bhsd --check-rows all
    MEMATTN_HOPPER=1 step sm90-bf16-d256-gqa-win 60 --backend cuda --json run --kernel flash --dtype bf16 --batch 2 --heads 8 --heads-kv 2 --seq-q 1000 --seq-kv 1300 --head-dim 256 --window 255,0 --check-rows all
    MEMATTN_HOPPER=1 step sm90-bf16-d128-softcap 60 --backend cuda --json run --kernel flash --dtype bf16 --heads 4 --seq 1000 --head-dim 128 --softcap 30 --check-rows all
    # The e4m3 KV-cache decode of the sm_90a module (cvt.rn.f16x2.e4m3x2), against the sm_80 row.
    MEMATTN_HOPPER=1 step sm90-decode-fp8 60 --backend cuda --json decode --kv-dtype fp8 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 8192 --new-tokens 1 --page-size 16
    MEMATTN_HOPPER=0 step sm80-decode-fp8 60 --backend cuda --json decode --kv-dtype fp8 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 8192 --new-tokens 1 --page-size 16
    # The same call on a bf16 cache: the like-for-like baseline of the two e4m3 rows (the first
    # H200 run had 0.0528 ms for both, and no bf16 figure with the append and this split plan).
    step decode-bf16-as-fp8 60 --backend cuda --json decode --dtype bf16 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 8192 --new-tokens 1 --page-size 16
    # Side by side, the same shape: the sm_80 kernel, then the Hopper one (flash_time_ms, median).
    for d in 64 128 256; do
        MEMATTN_HOPPER=0 step "time-sm80-d$d" 120 --backend cuda --json run --kernel flash --dtype bf16 --batch 4 --heads $((2048 / d)) --seq 4096 --head-dim "$d" --causal --repeats 20 --warmup 3
        MEMATTN_HOPPER=1 step "time-sm90-d$d" 120 --backend cuda --json run --kernel flash --dtype bf16 --batch 4 --heads $((2048 / d)) --seq 4096 --head-dim "$d" --causal --repeats 20 --warmup 3
    done
fi
step run-f32-d96-causal 60 --backend cuda --json run --kernel flash --batch 2 --heads 4 --seq-q 500 --seq-kv 700 --head-dim 96 --causal
step run-f32-d256 60 --backend cuda --json run --kernel flash --batch 1 --heads 4 --seq 500 --head-dim 256

# The backward on CUDA, each gradient verified against f64 (`run --backward`): the tensor-core
# kernels (d64 and d128: FlashAttention-2's 2-D warp layout, 128 KiB of shared memory; d32 the
# compact kernel), GQA, causal with rows that see no key, a window, deterministic dQ, f32 SIMT.
step bwd-bf16-d64-causal 120 --backend cuda --json run --backward --dtype bf16 --batch 2 --heads 8 --heads-kv 2 --seq-q 1000 --seq-kv 777 --head-dim 64 --causal
step bwd-f16-d128 120 --backend cuda --json run --backward --dtype f16 --batch 2 --heads 4 --seq-q 777 --seq-kv 1000 --head-dim 128
step bwd-bf16-d128-window-det 120 --backend cuda --json run --backward --dtype bf16 --heads 4 --heads-kv 1 --seq 1500 --head-dim 128 --window 255,0 --deterministic --repeats 3
step bwd-bf16-d32-softcap 120 --backend cuda --json run --backward --dtype bf16 --heads 4 --seq 700 --head-dim 32 --causal --softcap 30
step bwd-f32-d96 120 --backend cuda --json run --backward --heads 2 --seq-q 300 --seq-kv 500 --head-dim 96 --causal

# Short timing: causal vs not, flash only, default repeats (10, warm-up 3).
step timing-causal 120 --backend cuda compare --kernel flash --vary causal=false,true --batch 4 --heads 16 --seq 4096 --head-dim 128
step sweep 180 --backend cuda sweep --heads 8 --vary seq=1024,4096,16384 --plot "${LOG:-.}/memattn-sweep.svg"

# KV-cache decode (first run on an H200: docs/gpu-h200.md): verified decode calls (GQA, ragged and paged caches,
# append, seq_q > 1), then the benchmark shape of the decode figures - batch 1, heads 32,
# heads_kv 8, d 128, bf16, cache 8192 - with --splits 1 and auto (`plan` in the JSON: blocks per
# SM, wave efficiency; `kv_read_gb_per_s`: K/V bytes read per second, to hold against the ~4.3 TB/s
# copy bandwidth; bf16 runs the tensor-core kernel, `decode-long-simt` the SIMT one on the same
# shape), sinks with splits on a paged cache, and PyTorch SDPA on the same cache
# (scripts/bench_decode_sdpa.py; skipped with the reason when `import torch` fails).
step decode-ragged-paged 60 --backend cuda --json decode --batch 4 --heads 16 --heads-kv 2 --head-dim 128 --cache-len 0,1,777,5000 --new-tokens 2 --seq-q 3 --page-size 16 --splits auto
step decode-bf16-paged-1 60 --backend cuda --json decode --dtype bf16 --batch 2 --heads 8 --heads-kv 8 --cache-len 300,31 --page-size 1 --splits 5
step decode-splits-1 60 --backend cuda --json decode --dtype bf16 --batch 1 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 8192 --splits 1
step decode-splits-auto 60 --backend cuda --json decode --dtype bf16 --batch 1 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 8192 --splits auto
step decode-long-auto 120 --backend cuda --json decode --dtype bf16 --batch 8 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 32768 --splits auto
# The split count at that shape: auto chose 2 (128 blocks, under one per multiprocessor) and read
# the cache at 2.2 TB/s where SDPA read 4.2 on the H200; more blocks per SM may hide more latency.
step decode-long-splits 180 --backend cuda --json decode --dtype bf16 --batch 8 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 32768 --vary splits=2,4,8,16
# An e4m3 cache reads half the bytes of a bf16 one: at both measured shapes, the library's default
# (on sm_90 the sm_90a row) next to the bf16 steps above; on the H200 the batch-1 e4m3 call ran
# no faster than bf16 would (0.0528 ms).
step decode-fp8-b1 60 --backend cuda --json decode --kv-dtype fp8 --batch 1 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 8192 --splits auto
step decode-fp8-long 120 --backend cuda --json decode --kv-dtype fp8 --batch 8 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 32768 --splits auto
step decode-long-simt 120 --backend cuda --json decode --dtype bf16 --kernel simt --batch 8 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 32768 --splits auto
step decode-sinks-paged 60 --backend cuda --json decode --dtype f16 --batch 3 --heads 16 --heads-kv 4 --cache-len 2000,0,45 --page-size 24 --sinks --splits 3
# Chunked prefill: the tensor-core forward over the paged cache against the tensor-core decode on
# the same call, at a query of 32, 128 and 512 tokens (where `--kernel auto` switches is reasoned
# from the tiles: these timings are the evidence to set it by; at 32 tokens on the H200 the
# tensor-core decode took 0.119 ms and the prefill kernel 0.391 ms).
step prefill-chunk-32 60 --backend cuda --json decode --dtype bf16 --batch 1 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 8192 --seq-q 32 --page-size 16 --vary kernel=prefill,mma
step prefill-chunk-128 90 --backend cuda --json decode --dtype bf16 --batch 1 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 8192 --new-tokens 128 --seq-q 128 --page-size 16 --vary kernel=prefill,mma
step prefill-chunk-512 120 --backend cuda --json decode --dtype bf16 --batch 1 --heads 32 --heads-kv 8 --head-dim 128 --cache-len 8192 --new-tokens 512 --seq-q 512 --page-size 16 --vary kernel=prefill,mma
if command -v python3 >/dev/null && python3 -c "import torch" >/dev/null 2>&1; then
    echo "=== decode: PyTorch SDPA on the same cache shapes"
    timeout 120 python3 "$SCRIPT_DIR/bench_decode_sdpa.py" | tee "${LOG:-/tmp}/decode-sdpa.jsonl"
    rc=${PIPESTATUS[0]}
    SUMMARY+=("$(printf '%-22s %4s %7s  %s' decode-sdpa "$rc" - "torch SDPA decode timings")")
else
    SUMMARY+=("$(printf '%-22s %4s %7s  %s' decode-sdpa - - "skipped: no python3 with torch")")
fi

# ---- context parallelism over NCCL: one rank per GPU (memattn run --cp N --cp-comm nccl) ----
# NCCL is loaded at run time. cudarc looks for libnccl.so; pip's nvidia-nccl-cu12 (a torch
# dependency) ships libnccl.so.2 only, so a libnccl.so link to it goes on the library path.
NCCL_LINK_DIR=""
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
    nccl_so=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib', 'libnccl.so.2'))" 2>/dev/null)
    if [ -n "$nccl_so" ] && [ -f "$nccl_so" ]; then
        NCCL_LINK_DIR=$(mktemp -d)
        ln -s "$nccl_so" "$NCCL_LINK_DIR/libnccl.so"
        echo "=== NCCL: linked $nccl_so as $NCCL_LINK_DIR/libnccl.so"
    fi
fi
SAVED_LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
export LD_LIBRARY_PATH="${NCCL_LINK_DIR:+$NCCL_LINK_DIR:}${LD_LIBRARY_PATH:-}"
# World size 1 (a loopback through NCCL, then the ring with nothing to pass), forward and
# backward; with two or more GPUs, world size 2 passes K/V blocks between GPUs.
step cp-nccl-1 120 --backend cuda --json run --cp 1 --cp-comm nccl --dtype bf16 --heads 4 --seq 2048 --head-dim 64 --causal
step cp-nccl-1-bwd 120 --backend cuda --json run --cp 1 --cp-comm nccl --backward --dtype bf16 --heads 4 --seq 1000 --head-dim 64 --causal
GPU_COUNT=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${GPU_COUNT:-0}" -ge 2 ]; then
    step cp-nccl-2-zigzag 180 --backend cuda --json run --cp 2 --cp-comm nccl --cp-strategy zigzag --backward --dtype bf16 --heads 4 --heads-kv 2 --seq 4096 --head-dim 64 --causal
else
    SUMMARY+=("$(printf '%-22s %4s %7s  %s' cp-nccl-2-zigzag - - "skipped: ${GPU_COUNT:-0} GPU(s), world 2 needs 2")")
fi
export LD_LIBRARY_PATH="$SAVED_LD_LIBRARY_PATH"

# ---- benchmark: memattn (bf16/f16 tensor-core flash) vs PyTorch SDPA flash, same machine ----
bench() {
    local budget="${BENCH_BUDGET_S:-150}" dir t_start shapes=() line dtype seq d causal b h tag flag
    local elapsed left rc json_shapes="" sep=""
    dir="${LOG:-$(mktemp -d)}/bench"
    mkdir -p "$dir"
    rm -f "$dir"/memattn-*.json "$dir"/torch.jsonl
    t_start=$(date +%s)
    for seq in 1024 4096 16384; do
        for d in 64 128; do
            for causal in false true; do shapes+=("bf16 $seq $d $causal"); done
        done
    done
    shapes+=("f16 4096 128 true")
    for d in 32 96 192 256; do
        for causal in false true; do shapes+=("bf16 4096 $d $causal"); done
    done
    echo "=== bench: ${#shapes[@]} shapes, budget ${budget}s, results in $dir"
    local skipped=()
    for line in "${shapes[@]}"; do
        read -r dtype seq d causal <<<"$line"
        b=$((16384 / seq)); h=$((2048 / d))
        tag="${dtype}-s${seq}-d${d}-$([ "$causal" = true ] && echo causal || echo full)"
        elapsed=$(( $(date +%s) - t_start ))
        # Keep ~30% of the budget for torch.
        if [ "$elapsed" -ge $((budget * 7 / 10)) ]; then skipped+=("$tag"); continue; fi
        flag=""; [ "$causal" = true ] && flag="--causal"
        left=$((budget * 7 / 10 - elapsed)); [ "$left" -gt 60 ] && left=60; [ "$left" -lt 5 ] && left=5
        timeout "$left" "$BIN" --backend cuda --json run --kernel flash --dtype "$dtype" --batch "$b" \
            --heads "$h" --seq "$seq" --head-dim "$d" $flag --check-rows 128 \
            >"$dir/memattn-$tag.json" 2>"$dir/memattn-$tag.err"
        rc=$?
        printf '  memattn %-22s exit %s\n' "$tag" "$rc"
        [ "$rc" = 0 ] || FAILED=1
        json_shapes+="$sep{\"dtype\":\"$dtype\",\"batch\":$b,\"heads\":$h,\"seq\":$seq,\"head_dim\":$d,\"causal\":$causal}"
        sep=","
    done
    if [ "${#skipped[@]}" -gt 0 ]; then echo "  skipped (bench budget): ${skipped[*]}"; fi
    local torch_note="torch: not run"
    if ! command -v python3 >/dev/null; then
        torch_note="torch: skipped (no python3)"
    elif ! python3 -c "import torch" >"$dir/torch-import.err" 2>&1; then
        torch_note="torch: skipped (import torch failed: $(tail -n1 "$dir/torch-import.err" | cut -c1-80))"
    elif [ -n "$json_shapes" ]; then
        elapsed=$(( $(date +%s) - t_start )); left=$((budget - elapsed)); [ "$left" -lt 20 ] && left=20
        timeout "$left" python3 "$SCRIPT_DIR/bench_sdpa.py" "[$json_shapes]" >"$dir/torch.jsonl" 2>"$dir/torch.err"
        rc=$?
        torch_note="torch: exit $rc ($(grep -c '^{' "$dir/torch.jsonl") shapes timed; $(grep -m1 'bench_sdpa' "$dir/torch.err" | cut -c1-90))"
        [ "$rc" = 124 ] && torch_note="$torch_note - timed out after ${left}s"
    fi
    echo "  $torch_note"
    echo
    echo "=== bench: memattn vs PyTorch SDPA (flash backend), TFLOP/s from useful FLOPs (4*b*h*d*unmasked pairs)"
    if command -v python3 >/dev/null; then
        python3 "$SCRIPT_DIR/bench_table.py" "$dir" | tee "$dir/table.txt"
    else
        grep -H '"tflops"' "$dir"/memattn-*.json
    fi
    SUMMARY+=("$(printf '%-22s %4s %7.1f  %s' bench - "$(( $(date +%s) - t_start ))" "$torch_note")")
}
if [ "${MEMATTN_BENCH:-1}" != 0 ]; then bench; fi

# ---- benchmark: the backward, memattn vs PyTorch SDPA's (FlashAttention-2's) on the same shapes ----
# (The gradients of one (batch, KV head) slice are checked against f64 at these shapes: the whole
# check would keep the host busy for many minutes.)
bench_bwd() {
    local dir t_start seq d causal b h tag flag rc json_shapes="" sep="" out
    dir="${LOG:-$(mktemp -d)}/bench-bwd"
    mkdir -p "$dir"
    t_start=$(date +%s)
    echo "=== bench-bwd: bf16 backward, seq 4096, d 64 and 128, causal and not (backward_time_ms, median)"
    for d in 64 128; do
        for causal in false true; do
            b=4; h=$((2048 / d))
            tag="bf16-s4096-d${d}-$([ "$causal" = true ] && echo causal || echo full)"
            flag=""; [ "$causal" = true ] && flag="--causal"
            timeout 120 "$BIN" --backend cuda --json run --backward --dtype bf16 --batch "$b" --heads "$h" \
                --seq 4096 --head-dim "$d" $flag >"$dir/memattn-$tag.json" 2>"$dir/memattn-$tag.err"
            rc=$?
            [ "$rc" = 0 ] || FAILED=1
            out=$(python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print('%.3f ms, %.1f TFLOP/s' % (j['backward_time_ms'], j['backward_flops'] / j['backward_time_ms'] / 1e9))" "$dir/memattn-$tag.json" 2>/dev/null || echo "no timing")
            printf '  memattn %-24s exit %s  %s\n' "$tag" "$rc" "$out"
            json_shapes+="$sep{\"dtype\":\"bf16\",\"batch\":$b,\"heads\":$h,\"seq\":4096,\"head_dim\":$d,\"causal\":$causal,\"backward\":true}"
            sep=","
        done
    done
    if command -v python3 >/dev/null && python3 -c "import torch" >/dev/null 2>&1; then
        timeout 120 python3 "$SCRIPT_DIR/bench_sdpa.py" "[$json_shapes]" | tee "$dir/torch.jsonl"
        SUMMARY+=("$(printf '%-22s %4s %7s  %s' bench-bwd "${PIPESTATUS[0]}" "$(( $(date +%s) - t_start ))" "memattn backward vs torch SDPA backward")")
    else
        SUMMARY+=("$(printf '%-22s %4s %7s  %s' bench-bwd - "$(( $(date +%s) - t_start ))" "torch skipped: no python3 with torch")")
    fi
}
if [ "${MEMATTN_BENCH:-1}" != 0 ]; then bench_bwd; fi

echo
echo "=== summary ($BIN)"
printf '%-22s %4s %7s  %s\n' step exit seconds note
for line in "${SUMMARY[@]}"; do echo "$line"; done
exit $FAILED
