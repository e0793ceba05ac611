#!/usr/bin/env bash
# Checks that the library crates can be published and used from crates.io as they are packaged:
#   bash scripts/package-check.sh
#
# 1. `cargo package --no-verify` for every library crate (memattn-kernels, memattn-ptx-vm,
#    memattn-vm-cuda, memattn, memattn-candle): the .crate files land in target/package/. Each
#    must be under crates.io's 10 MB limit and carry the same license files as the repository.
# 2. A scratch crate in a temporary folder, outside the workspace, depends on them the way a user
#    does (`memattn = "0.1"`, ...); `[patch.crates-io]` points those names at the unpacked .crate
#    files (kept in target/package-check/crates) and nothing else, so only what was packaged (the
#    rewritten Cargo.toml, the files `cargo package --list` lists, the embedded PTX) builds.
#    Every other dependency comes from crates.io at the versions of the workspace's Cargo.lock
#    (copied in), which a workspace build has already downloaded: with CARGO_NET_OFFLINE=true the
#    check runs offline.
# 3. Its programs are the examples of the READMEs, taken from them: memattn/README.md's (the PTX
#    VM backend, checked against the f64 reference), memattn-kernels' (kernels-gpu/README.md) and
#    README.md's "Use from Rust" program (the CUDA path), run on the VM-backed driver that the
#    packaged memattn-vm-cuda builds. Each must say that it verified its result.
#
# memattn-candle is packaged and its manifest checked, but not built here: candle-core would take
# more than the rest of the check together (`cargo package -p memattn-candle` without
# `--no-verify` builds it). The scratch build has a target folder of its own,
# target/package-check (PACKAGE_CHECK_TARGET_DIR), kept between runs.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
crates=(memattn-kernels memattn-ptx-vm memattn-vm-cuda memattn memattn-candle)
folders=(kernels-gpu ptx-vm vm-cuda memattn memattn-candle)
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
target_dir="${PACKAGE_CHECK_TARGET_DIR:-$repo/target/package-check}"
limit=$((10 * 1000 * 1000))

for f in "${folders[@]}"; do
  for l in LICENSE-MIT LICENSE-APACHE; do
    cmp -s "$l" "$f/$l" || { echo "$f/$l differs from $l (the packages ship a copy: cp $l $f/)"; exit 1; }
  done
done

# --allow-dirty: what is checked is the package's content, whatever the state of the clone.
cargo package --quiet --no-verify --allow-dirty $(printf -- '-p %s ' "${crates[@]}")
for c in "${crates[@]}"; do
  file="target/package/$c-$version.crate"
  size=$(wc -c <"$file")
  printf '%-16s %9d bytes compressed, %3d files\n' "$c" "$size" "$(tar tzf "$file" | grep -vc '/$')"
  [ "$size" -lt "$limit" ] || { echo "$file is over crates.io's limit of 10 MB"; exit 1; }
done

# The unpacked crates stay at one path (in the target folder), so that a second run finds them
# built. A .crate's files all carry one fixed old mtime, which cargo would take for "unchanged":
# a file whose content differs from the last run's is copied over it (a new mtime, so cargo
# rebuilds what depends on it), the others keep theirs.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/unpacked" "$work/check/src/bin"
unpacked="$target_dir/crates"
for c in "${crates[@]}"; do
  tar xzf "target/package/$c-$version.crate" -C "$work/unpacked"
done
(cd "$work/unpacked" && find . -type f) | while IFS= read -r f; do
  if ! cmp -s "$work/unpacked/$f" "$unpacked/$f"; then
    mkdir -p "$(dirname "$unpacked/$f")"
    cp "$work/unpacked/$f" "$unpacked/$f"
  fi
done
if [ -d "$unpacked" ]; then
  (cd "$unpacked" && find . -type f) | while IFS= read -r f; do
    [ -e "$work/unpacked/$f" ] || rm "$unpacked/$f"
  done
fi

# The ```rust block of a Markdown file that contains a given text.
extract() {
  local file=$1 tag=$2 in=0 buf="" line
  while IFS= read -r line; do
    if [ $in = 0 ] && [ "$line" = '```rust' ]; then
      in=1 buf=""
    elif [ $in = 1 ] && [ "$line" = '```' ]; then
      in=0
      case $buf in *"$tag"*) printf '%s' "$buf" && return 0 ;; esac
    elif [ $in = 1 ]; then
      buf+="$line"$'\n'
    fi
  done <"$file"
  echo "no \`\`\`rust block with \"$tag\" in $file" >&2
  return 1
}
extract memattn/README.md "memattn/README.md's example" >"$work/check/src/main.rs"
extract kernels-gpu/README.md "memattn-kernels/README.md's example" >"$work/check/src/bin/kernels.rs"
extract README.md '"Use from Rust" program' >"$work/check/src/bin/readme.rs"

patches=""
for c in memattn-kernels memattn-ptx-vm memattn-vm-cuda memattn; do
  patches+="$c = { path = \"$unpacked/$c-$version\" }"$'\n'
done
# The profile memattn/README.md recommends for a debug build (the VM optimised), without debug
# info: less to compile.
cat >"$work/check/Cargo.toml" <<EOF
[package]
name = "memattn-package-check"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
memattn = "${version%.*}"
memattn-kernels = "${version%.*}"
# The VM-backed CUDA driver (libvm_cuda.so in the target folder's deps/) for the CUDA example.
memattn-vm-cuda = "${version%.*}"
half = "2"

[patch.crates-io]
$patches
[profile.dev]
debug = false
incremental = false
[profile.dev.package.memattn-ptx-vm]
opt-level = 3
[profile.dev.package.memattn]
opt-level = 2

[workspace]
EOF
cp Cargo.lock "$work/check/Cargo.lock"

cd "$work/check"
export CARGO_TARGET_DIR="$target_dir"
cargo build --quiet --bins
bin="$CARGO_TARGET_DIR/debug"
driver="$bin/deps/libvm_cuda.so"
[ -f "$driver" ] || { echo "the packaged memattn-vm-cuda built no $driver"; exit 1; }
run() {
  local want=$1 out
  shift
  out=$("$@") || { echo "$out"; echo "failed: $*"; exit 1; }
  echo "$out"
  case $out in *"$want"*) ;; *) echo "expected \"$want\" in the output of $*"; exit 1 ;; esac
}
run ": verified" "$bin/memattn-package-check"
run "flash_fwd_bf16_d128: grid" "$bin/kernels"
run "for every batch and head: true" env MEMATTN_CUDA_DRIVER="$driver" "$bin/readme"
echo "the packaged crates build outside the workspace and their README examples verify"
