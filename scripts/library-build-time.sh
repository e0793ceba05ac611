#!/usr/bin/env bash
# What an engine author pays to add memattn: a clean release build of a scratch crate that depends
# on the library at each given path, back to back, each with its own target dir and this
# workspace's Cargo.lock. The crate's main runs one flash_attn in the VM and prints o[0], so the
# builds are compared on the same program.
#
#   scripts/library-build-time.sh PATH_TO_MEMATTN_PACKAGE...
#   e.g. (an older checkout at /tmp/old):  scripts/library-build-time.sh /tmp/old/host "$PWD/memattn"
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 PATH_TO_MEMATTN_PACKAGE..." >&2; exit 2; }
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
n=0
for pkg in "$@"; do
  n=$((n + 1))
  pkg="$(cd "$pkg" && pwd)"
  crate="$work/engine-$n"
  mkdir -p "$crate/src"
  cat > "$crate/Cargo.toml" <<TOML
[package]
name = "engine-$n"
version = "0.1.0"
edition = "2021"
[dependencies]
memattn = { path = "$pkg" }
[workspace]
TOML
  cat > "$crate/src/main.rs" <<'RS'
use memattn::attn::{AttnOpts, Kernels, TensorView};
use memattn::Dtype;
fn main() {
    let k = Kernels::vm().expect("vm");
    let x: Vec<f32> = (0..2 * 64).map(|i| (i % 7) as f32 * 0.1).collect();
    let b = k.vm_upload(&x).unwrap();
    let t = TensorView::vm(&b, Dtype::F32, [1, 2, 1, 64]).unwrap();
    let (o, _) = k.flash_attn(&t, &t, &t, &AttnOpts::new()).unwrap();
    println!("{}", o.to_vec_f32().unwrap()[0]);
}
RS
  cp "$root/Cargo.lock" "$crate/Cargo.lock"
  start=$(date +%s.%N)
  (cd "$crate" && CARGO_TARGET_DIR="$crate/target" cargo build --release -q)
  end=$(date +%s.%N)
  crates=$(cd "$crate" && CARGO_TARGET_DIR="$crate/target" cargo tree -e normal --prefix none | sort -u | wc -l)
  out=$(cd "$crate" && CARGO_TARGET_DIR="$crate/target" cargo run --release -q)
  printf '%s: clean release build %.1f s, %s crates in its tree, o[0] = %s\n' \
    "$pkg" "$(echo "$end - $start" | bc)" "$crates" "$out"
done
