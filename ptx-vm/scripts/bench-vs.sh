#!/usr/bin/env bash
# Runs two builds of the flash bench (`cargo bench -p memattn-ptx-vm --bench flash`) alternately, on the
# same inputs, and prints per kernel and worker count the median over all rounds of each build's
# median wall time, the throughput, the ratio old/new, and whether the result checksums agree.
#
# Usage: ptx-vm/scripts/bench-vs.sh OLD_BIN NEW_BIN [ROUNDS=3] [RUNS=7] [FILTER]
#   OLD_BIN, NEW_BIN  bench executables (target/release/deps/flash-<hash>, see the README)
#   ROUNDS            rounds; each runs both binaries once (the order alternates per round)
#   RUNS              launches per kernel per binary and round (the bench's own median)
#   FILTER            optional word: only kernels whose name contains it
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n '2,/^set/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 2
fi
old=$1
new=$2
rounds=${3:-3}
runs=${4:-7}
filter=${5:-}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for r in $(seq 1 "$rounds"); do
    if [ $((r % 2)) -eq 1 ]; then order="old new"; else order="new old"; fi
    for which in $order; do
        bin=$old
        [ "$which" = new ] && bin=$new
        # shellcheck disable=SC2086
        "$bin" "$runs" $filter | sed "s/^/$which\t/" >>"$out"
    done
    echo "round $r of $rounds done" >&2
done
awk -F'\t' '
function median(list,    n, a, i, j, t) {
    n = split(list, a, " ")
    for (i = 2; i <= n; i++) { t = a[i] + 0; for (j = i - 1; j >= 1 && a[j] + 0 > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
    return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
{
    which = $1; line = $2
    k = index(line, ": median wall"); if (k == 0) next
    key = substr(line, 1, k - 1)
    if (!(key in seen)) { seen[key] = 1; keys[++nk] = key }
    match(line, /median wall [0-9.]+ ms/); ms = substr(line, RSTART + 12, RLENGTH - 15)
    match(line, /[0-9]+ thread-instructions,/); instr[key] = substr(line, RSTART, RLENGTH - 21)
    n = split(line, f, " "); cs = f[n]
    walls[which, key] = walls[which, key] " " ms
    if (!((which, key) in sum)) sum[which, key] = cs
    else if (sum[which, key] != cs) sum[which, key] = sum[which, key] "|" cs
}
END {
    printf "%-82s %10s %9s %10s %9s %7s  %s\n", "kernel, workers", "old ms", "old M/s", "new ms", "new M/s", "old/new", "checksums"
    for (i = 1; i <= nk; i++) {
        key = keys[i]
        o = median(walls["old", key]); nw = median(walls["new", key])
        same = (sum["old", key] == sum["new", key] && index(sum["old", key], "|") == 0) ? "identical " sum["old", key] : "DIFFER old " sum["old", key] " new " sum["new", key]
        printf "%-82s %10.2f %9.1f %10.2f %9.1f %6.2fx  %s\n", key, o, instr[key] / o / 1e3, nw, instr[key] / nw / 1e3, o / nw, same
    }
}' "$out"
