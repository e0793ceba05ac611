#!/usr/bin/env python3
"""The table of a gpu-tune.sh run: every forward candidate per shape next to PyTorch SDPA
(FlashAttention-2) and FlashAttention-3, every decode split count per cache, the best of each,
and the rows of memattn/src/choice/kernel-choice.tsv the timings support.

usage: tune_table.py DIR   (DIR holds forward.jsonl, decode.jsonl, torch.jsonl, torch-decode.jsonl,
                            fa3.jsonl, device.txt; missing files are tables without those columns)
exit: 0 when every memattn row verified, 1 when one did not, 2 on usage.
Times from a dry run (the VM-backed driver) are host wall clock of the VM, not GPU time: the
table says so and proposes no kernel-choice rows then.
"""
import json
import os
import sys
from collections import defaultdict


def rows(path):
    out = []
    if not os.path.exists(path):
        return out
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def shape_key(dtype, batch, heads, seq, d, causal):
    return f"{dtype} {batch}x{heads}x{seq}x{d}", bool(causal)


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    d = argv[1]
    device = open(os.path.join(d, "device.txt")).read().strip() if os.path.exists(os.path.join(d, "device.txt")) else "?"
    dry = "dry run" in device
    ok = True
    print(f"device: {device}")
    if dry:
        print("(dry run: times are the VM interpreter's wall clock, not GPU time; no kernel choice is proposed)")

    # ---- forward ----
    fwd = defaultdict(dict)     # (shape, causal) -> config -> (tflops, ms, entry, verified)
    for r in rows(os.path.join(d, "forward.jsonl")):
        s = r["shape"]
        key = shape_key(r["dtype"], s["batch"], s["heads"], s["seq_q"], s["head_dim"], s["causal"])
        config = r["config"].split("-")[1]          # fwd-<config>-<tag>
        # The forward's own launch (the Hopper call stores its tensor maps in a launch before it).
        fwd_launches = [x["kernel"] for x in r.get("launches", []) if x["kernel"].startswith("flash_fwd_")]
        entry = fwd_launches[-1].replace(f"flash_fwd_{r['dtype']}_", "") if fwd_launches else "?"
        fwd[key][config] = (r["tflops"], r["timing"]["median_ms"], entry, r["verified"])
        ok &= bool(r["verified"])
    other = {}
    for name, file, col in (("torch", "torch.jsonl", "SDPA"), ("fa3", "fa3.jsonl", "FA3")):
        for r in rows(os.path.join(d, file)):
            if "tflops" in r:
                other[(name,) + shape_key(r["dtype"], r["batch"], r["heads"], r["seq"], r["head_dim"], r["causal"])] = r["tflops"]
    configs = sorted({c for v in fwd.values() for c in v}, key=lambda c: ("default", "sm80", "sm90").index(c) if c in ("default", "sm80", "sm90") else 9)
    print()
    print("forward: TFLOP/s (kernel), every memattn row verified on sampled rows against f64" if ok else
          "forward: TFLOP/s (kernel); NOT every memattn row verified (marked !)")
    head = f"{'shape':<24} {'causal':<6} " + " ".join(f"{c:>18}" for c in configs) + f" {'SDPA':>8} {'FA3':>8}  best/SDPA  best/FA3"
    print(head)
    print("-" * len(head))
    choice = defaultdict(list)   # head_dim -> [(sm80 ms, sm90 ms)]
    for key in sorted(fwd, key=lambda k: (int(k[0].split("x")[-1]), k[1])):
        cells = []
        for c in configs:
            v = fwd[key].get(c)
            cells.append(f"{v[0]:.1f} ({v[2]}){'' if v[3] else '!'}".rjust(18) if v else "-".rjust(18))
        t = other.get(("torch",) + key)
        f = other.get(("fa3",) + key)
        best = max(v[0] for v in fwd[key].values())
        print(f"{key[0]:<24} {str(key[1]).lower():<6} " + " ".join(cells)
              + f" {'-' if t is None else f'{t:.1f}':>8} {'-' if f is None else f'{f:.1f}':>8}"
              + f"  {'-' if not t else f'{best / t:9.2f}'}  {'-' if not f else f'{best / f:8.2f}'}")
        if "sm80" in fwd[key] and "sm90" in fwd[key]:
            choice[int(key[0].split("x")[-1])].append((fwd[key]["sm80"][1], fwd[key]["sm90"][1]))

    # ---- decode ----
    dec = defaultdict(dict)     # (cache dtype, batch, cache) -> splits label -> (GB/s, ms, splits, verified)
    for r in rows(os.path.join(d, "decode.jsonl")):
        for run in r.get("runs", [r]):
            key = (run.get("kv_dtype", run["dtype"]), run["batch"], max(run["cache_seqlens"]))
            label = f"{run['plan']['num_splits']}{'a' if run['plan']['chosen_by'] == 'auto' else ''}"
            dec[key][label] = (run["kv_read_gb_per_s"], run["timing"]["median_ms"], run["plan"]["num_splits"], run["verified"])
            ok &= bool(run["verified"])
    sdpa_dec = {(r.get("batch"), r.get("cache_len")): r for r in rows(os.path.join(d, "torch-decode.jsonl"))}
    if dec:
        print()
        print("decode: heads 32/8, d128, K/V read GB/s per split count (`a`: the plan of --splits auto)")
        for key in sorted(dec):
            cells = "  ".join(f"{lab}:{v[0]:.0f}{'' if v[3] else '!'}" for lab, v in sorted(dec[key].items(), key=lambda kv: kv[1][2]))
            best = max(dec[key].items(), key=lambda kv: kv[1][0])
            s = sdpa_dec.get((key[1], key[2]))
            sd = f"; SDPA {s['kv_read_gb_per_s']:.0f}" if s and "kv_read_gb_per_s" in s else ""
            print(f"  {key[0]:<9} batch {key[1]:<2} cache {key[2]:<6} {cells}  (best: {best[0]}{sd})")

    # ---- kernel choice ----
    print()
    if dry or not choice:
        print("kernel-choice.tsv: nothing proposed" + (" (dry run)" if dry else " (no sm_80 / sm_90 pair timed)"))
    else:
        print("kernel-choice.tsv rows these timings support (arch, family, dtype, head dim, kernel, evidence):")
        for hd in sorted(choice):
            s80 = sum(a for a, _ in choice[hd]) / len(choice[hd])
            s90 = sum(b for _, b in choice[hd]) / len(choice[hd])
            pick = "sm_90" if s90 < s80 else "sm_80"
            print(f"  sm_90\tforward\tbf16\t{hd}\t{pick}\tgpu-tune: sm_80 {s80:.3f} ms, sm_90 {s90:.3f} ms (mean of causal and not)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
