#!/usr/bin/env bash
# gpu-tune.sh: one GPU run that tunes. Times every candidate configuration memattn ships for the
# forward and the decode, PyTorch SDPA (FlashAttention-2) and FlashAttention-3 (the fa3-fwd wheel,
# when it imports) on the same shapes, within a device-time budget, and writes the raw results and
# a table under $OUT/gpu-tune/ (commit them as docs/gpu-<device>/tune/). The table ends with the
# rows of memattn/src/choice/kernel-choice.tsv the timings support (the kernel choice per GPU
# generation reads that committed table).
#
#   usage: bash scripts/gpu-tune.sh [--dry-run] [MEMATTN_BIN]      (default binary: ./memattn)
#
# Candidates:
#   forward  bf16, batch 4, heads 2048/d, seq 4096 (the H200 table's shapes), d 64/96/128/192/256,
#            causal and not: the library's default; on compute capability 9.0 also the sm_80
#            module alone (MEMATTN_HOPPER=0) and the sm_90a forward wherever it has a row
#            (MEMATTN_HOPPER=1: d64, d128, d256). Each run is verified on 64 sampled rows against
#            the f64 reference; median of 20 launches after 3 warm-up.
#   decode   bf16 and e4m3 caches, heads 32/8, d128, batch 1 x 8192 and batch 8 x 32768 cached
#            keys, --splits auto and a sweep (1 2 4 8 16 33 for batch 1; 2 4 6 8 16 for batch 8),
#            every call verified; PyTorch SDPA on the same bf16 caches (bench_decode_sdpa.py).
#   torch    scripts/bench_sdpa.py on the forward shapes (skipped with the reason without torch).
#   FA3      scripts/bench_fa3.py on the forward shapes when `fa3_fwd_interface` imports; with
#            FA3_WHEEL=path/to/fa3_fwd-*.whl the wheel is unpacked into a temporary folder first
#            (no pip install; carry the wheel to a machine without network).
#
# Budget: TUNE_BUDGET_S (default 480 s) for the whole script; a step that would start after the
# budget is listed as skipped. 480 s leaves room for `MEMATTN_BENCH=0 scripts/gpu-check.sh`
# (about 4 minutes) in a 15-minute device lease.
#
# --dry-run: every step on the machine at hand through the VM-backed CUDA driver (vm-cuda;
# MEMATTN_CUDA_DRIVER, default target/debug/libvm_cuda.so; VM_CUDA_ARCH=sm_90 so the Hopper
# candidates run), at small shapes, torch and FA3 skipped: CI runs it so the script cannot rot.
#
# Output ($OUT/gpu-tune, or a temporary folder): forward.jsonl, decode.jsonl (memattn's --json
# lines with "config" added), torch.jsonl, torch-decode.jsonl, fa3.jsonl, steps.txt (step, exit,
# seconds, note), device.txt, table.txt (scripts/tune_table.py).
set -u

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
BIN="${1:-./memattn}"
if [ ! -x "$BIN" ]; then
    echo "gpu-tune: no executable memattn at '$BIN' (pass the path as the first argument)" >&2
    exit 2
fi
DIR="${OUT:+$OUT/gpu-tune}"
DIR="${DIR:-$(mktemp -d)/gpu-tune}"
mkdir -p "$DIR"
rm -f "$DIR"/*.jsonl "$DIR"/steps.txt
BUDGET="${TUNE_BUDGET_S:-480}"
T0=$(date +%s)
FAILED=0

if [ "$DRY" = 1 ]; then
    export MEMATTN_CUDA_DRIVER="${MEMATTN_CUDA_DRIVER:-$PWD/target/debug/libvm_cuda.so}"
    export VM_CUDA_ARCH="${VM_CUDA_ARCH:-sm_90}"
    if [ ! -f "$MEMATTN_CUDA_DRIVER" ]; then
        echo "gpu-tune --dry-run: no VM-backed driver at $MEMATTN_CUDA_DRIVER (cargo build -p memattn-vm-cuda)" >&2
        exit 2
    fi
    echo "gpu-tune: dry run on the VM-backed driver $MEMATTN_CUDA_DRIVER ($VM_CUDA_ARCH), small shapes" | tee "$DIR/device.txt"
    HDIMS="64 128"; SEQ=96; FWD_BATCH=1; FWD_HEADS_W=128   # heads = FWD_HEADS_W / d, at least 1
    DEC_SHAPES="1:200 2:333"; SWEEP_1="1 2 4"; SWEEP_8="2 4"; REPEATS="--repeats 1 --warmup 0"
else
    { nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader 2>/dev/null \
        || echo "nvidia-smi: not found"; } | tee "$DIR/device.txt"
    HDIMS="64 96 128 192 256"; SEQ=4096; FWD_BATCH=4; FWD_HEADS_W=2048
    DEC_SHAPES="1:8192 8:32768"; SWEEP_1="1 2 4 8 16 33"; SWEEP_8="2 4 6 8 16"; REPEATS="--repeats 20 --warmup 3"
fi
# Compute capability 9.0 (or the dry run's sm_90): the Hopper candidates exist.
SM90=0
if [ "$DRY" = 1 ] || grep -q ', 9\.0,' "$DIR/device.txt"; then SM90=1; fi

left() { echo $((BUDGET - ($(date +%s) - T0))); }

# record NAME RC SECONDS NOTE
record() { printf '%-34s %4s %6s  %s\n' "$1" "$2" "$3" "$4" >>"$DIR/steps.txt"; }

# tune FILE CONFIG ENV... -- ARGS... : one memattn run; its JSON (one object, or one per line
# with --vary) goes to FILE with "config" added; the step's exit code and time to steps.txt.
tune() {
    local file="$1" config="$2"; shift 2
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    local l; l=$(left)
    if [ "$l" -le 5 ]; then record "$config" - - "skipped: budget ${BUDGET}s spent"; return; fi
    [ "$l" -gt 120 ] && l=120
    local out err t0 rc
    out=$(mktemp); err=$(mktemp); t0=$(date +%s.%N)
    env "${envs[@]}" timeout "$l" "$BIN" --backend cuda --json "$@" >"$out" 2>"$err"
    rc=$?
    local secs; secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    python3 - "$out" "$config" >>"$file" <<'EOF'
import json, sys
text = open(sys.argv[1]).read()
dec = json.JSONDecoder()
i = 0
while i < len(text):
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text):
        break
    obj, i = dec.raw_decode(text, i)
    obj["config"] = sys.argv[2]
    print(json.dumps(obj))
EOF
    local note; note=$(grep -o '"verified": [a-z]*' "$out" | sort | uniq -c | tr -s ' ' | tr '\n' ';')
    [ "$rc" = 124 ] && note="timed out after ${l}s"
    [ "$rc" != 0 ] && [ -z "$note" ] && note=$(grep -m1 . "$err" | cut -c1-100)
    [ "$rc" = 0 ] || FAILED=1
    record "$config" "$rc" "$secs" "$note"
    rm -f "$out" "$err"
}

# ---- forward ----
SHAPES_JSON=""; sep=""
for d in $HDIMS; do
    h=$((FWD_HEADS_W / d)); [ "$h" -lt 1 ] && h=1
    for causal in false true; do
        flag=""; [ "$causal" = true ] && flag="--causal"
        tag="bf16-${FWD_BATCH}x${h}x${SEQ}x${d}-$([ "$causal" = true ] && echo causal || echo full)"
        args=(run --kernel flash --dtype bf16 --batch "$FWD_BATCH" --heads "$h" --seq "$SEQ" --head-dim "$d" $flag --check-rows 64 $REPEATS)
        tune "$DIR/forward.jsonl" "fwd-default-$tag" -- "${args[@]}"
        if [ "$SM90" = 1 ]; then
            tune "$DIR/forward.jsonl" "fwd-sm80-$tag" MEMATTN_HOPPER=0 -- "${args[@]}"
            case $d in 64|128|256) tune "$DIR/forward.jsonl" "fwd-sm90-$tag" MEMATTN_HOPPER=1 -- "${args[@]}" ;; esac
        fi
        SHAPES_JSON+="$sep{\"dtype\":\"bf16\",\"batch\":$FWD_BATCH,\"heads\":$h,\"seq\":$SEQ,\"head_dim\":$d,\"causal\":$causal}"
        sep=","
    done
done

# ---- decode ----
for shape in $DEC_SHAPES; do
    b=${shape%%:*}; n=${shape##*:}
    if [ "$b" = 1 ]; then sweep=$SWEEP_1; else sweep=$SWEEP_8; fi
    vary="auto,$(echo "$sweep" | tr ' ' ',')"
    for cache in bf16 fp8; do
        kv=(--dtype bf16); [ "$cache" = fp8 ] && kv=(--kv-dtype fp8)
        tune "$DIR/decode.jsonl" "dec-$cache-b$b-c$n" -- decode "${kv[@]}" --batch "$b" --heads 32 --heads-kv 8 \
            --head-dim 128 --cache-len "$n" --vary "splits=$vary" $REPEATS
    done
done

# ---- PyTorch SDPA and FlashAttention-3 on the same shapes ----
if [ "$DRY" = 1 ]; then
    record torch - - "skipped: dry run"
    record torch-decode - - "skipped: dry run"
    record fa3 - - "skipped: dry run"
elif ! command -v python3 >/dev/null || ! python3 -c "import torch" >/dev/null 2>&1; then
    record torch - - "skipped: no python3 with torch"
    record fa3 - - "skipped: no python3 with torch"
else
    l=$(left); [ "$l" -gt 90 ] && l=90
    if [ "$l" -gt 10 ]; then
        timeout "$l" python3 "$SCRIPT_DIR/bench_sdpa.py" "[$SHAPES_JSON]" >"$DIR/torch.jsonl" 2>"$DIR/torch.err"
        record torch "$?" - "$(grep -c '^{' "$DIR/torch.jsonl") shapes; $(grep -m1 bench_sdpa "$DIR/torch.err" | cut -c1-80)"
        timeout 60 python3 "$SCRIPT_DIR/bench_decode_sdpa.py" >"$DIR/torch-decode.jsonl" 2>"$DIR/torch-decode.err"
        record torch-decode "$?" - "$(grep -c '^{' "$DIR/torch-decode.jsonl") shapes"
    else
        record torch - - "skipped: budget ${BUDGET}s spent"
    fi
    fa3_path=""
    if [ -n "${FA3_WHEEL:-}" ]; then
        fa3_path=$(mktemp -d)
        python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$FA3_WHEEL" "$fa3_path" \
            || record fa3-unpack 1 - "could not unpack $FA3_WHEEL"
    fi
    l=$(left); [ "$l" -gt 90 ] && l=90
    if [ "$SM90" != 1 ]; then
        record fa3 - - "skipped: FlashAttention-3 runs on compute capability 9.0 only"
    elif [ "$l" -gt 10 ]; then
        PYTHONPATH="${fa3_path:+$fa3_path:}${PYTHONPATH:-}" timeout "$l" python3 "$SCRIPT_DIR/bench_fa3.py" "[$SHAPES_JSON]" \
            >"$DIR/fa3.jsonl" 2>"$DIR/fa3.err"
        rc=$?
        record fa3 "$rc" - "$(grep -c '^{' "$DIR/fa3.jsonl") shapes; $(tail -n1 "$DIR/fa3.err" | cut -c1-100)"
    else
        record fa3 - - "skipped: budget ${BUDGET}s spent"
    fi
fi

echo "=== gpu-tune: steps (config, exit, seconds, note)"
cat "$DIR/steps.txt"
echo
python3 "$SCRIPT_DIR/tune_table.py" "$DIR" | tee "$DIR/table.txt"
[ "${PIPESTATUS[0]}" = 0 ] || FAILED=1
echo "gpu-tune: results in $DIR ($(( $(date +%s) - T0 )) s)"
exit $FAILED
