#!/usr/bin/env bash
# A learner's first hour, timed from a fresh clone: clone the repository into a temporary folder,
# build `memattn` as docs/guide/README.md says, run the first commands of chapters 0 and 1, solve
# lesson 1 by applying its solution, make a scratch kernel with `cargo xtask lesson new`, build it,
# check it against its reference.rs with `cargo xtask lesson check-scratch` and trace one of its
# threads with `memattn trace --ptx ... --entry ...`. Prints the seconds of
# each step and the total; exits 1 at the first step that fails (its output is shown), 2 on bad
# usage.
#
#   scripts/learner-path.sh [REPO]      REPO: a path or URL git can clone [default: this repository]
#
# The build goes to $LEARNER_TARGET_DIR if set (reuse one between runs to time the steps without
# the first build), else to a target folder inside the temporary clone, never to the target of
# the checkout it is started from. Each run needs its own clone path: cargo's uplifted xtask
# binary names the clone it was built from.
set -uo pipefail
[ $# -le 1 ] || { echo "usage: $0 [REPO]" >&2; exit 2; }
root="$(cd "$(dirname "$0")/.." && pwd)"
repo="${1:-$root}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
clone="$work/memattn"
export CARGO_TARGET_DIR="${LEARNER_TARGET_DIR:-$clone/target}"
export PATH="$CARGO_TARGET_DIR/release:$PATH"
log="$work/step.log"
total_start=$(date +%s.%N)

# step NAME EXPECTED COMMAND...: runs COMMAND in the clone; passes when it exits 0 and its output
# contains EXPECTED (empty: any output).
step() {
  local name="$1" want="$2"
  shift 2
  local t0 t1
  t0=$(date +%s.%N)
  if (cd "$clone" 2>/dev/null || cd "$work"; "$@") >"$log" 2>&1 && { [ -z "$want" ] || grep -qF -- "$want" "$log"; }; then
    t1=$(date +%s.%N)
    printf '%-44s %8.1f s\n' "$name" "$(awk "BEGIN{print $t1 - $t0}")"
  else
    t1=$(date +%s.%N)
    printf '%-44s %8.1f s  FAILED\n' "$name" "$(awk "BEGIN{print $t1 - $t0}")"
    [ -z "$want" ] || echo "expected in the output: $want"
    tail -n 40 "$log"
    exit 1
  fi
}

step "clone" "" git clone --quiet "$repo" "$clone"
step "build memattn (release)" "" cargo build --release -p memattn-cli
step "chapter 0: launch saxpy_f32" "y[0..4] = [0, 2, 4, 6]" \
  memattn launch saxpy_f32 --grid 4 --block 256 --buf x=f32:1000:iota --buf y=f32:1000:zeros \
  --arg u32=1000 --arg f32=2 --arg buf=x --arg buf=y --show y --count 4
step "chapter 0: trace a flash thread" "trace of \`flash_fwd_f32_d64\`" \
  memattn trace --kernel flash --heads 2 --batch 2 --seq 100 --max-entries 1
step "chapter 1: compare naive and flash" "verified" memattn compare --heads 1 --seq 256
step "lesson 1: apply the solution" "" cp lessons/01-scale/solution.rs lessons/01-scale/kernel.rs
step "lesson 1: cargo xtask lesson 1" "" cargo xtask lesson 1
step "cargo xtask lesson new my_scale" "scratch kernel \`my_scale\`" cargo xtask lesson new my_scale
step "cargo xtask lesson build my_scale" "launch it:" cargo xtask lesson build my_scale
step "cargo xtask lesson check-scratch my_scale" "result: PASSED" cargo xtask lesson check-scratch my_scale
step "trace the scratch kernel" "trace of \`my_scale\` block [0, 0, 0] thread [5, 0, 0]" \
  memattn trace --ptx target/lessons/my_scale.ptx --entry my_scale --grid 4 --block-dim 256 \
  --buf x=f32:1000:iota --buf y=f32:1000 --arg u32=1000 --arg f32=2 --arg buf=x --arg buf=y \
  --block 0 --thread 5

total_end=$(date +%s.%N)
printf '%-44s %8.1f s\n' "total" "$(awk "BEGIN{print $total_end - $total_start}")"
