#!/usr/bin/env python3
"""Joins memattn and PyTorch SDPA timings into one table (used by gpu-check.sh).

usage: bench_table.py BENCH_DIR
  BENCH_DIR/memattn-*.json   one `memattn --json run` object each (a missing or broken file is a
                             row saying so)
  BENCH_DIR/torch.jsonl      bench_sdpa.py output (optional: torch columns show "-" without it)
Prints the table and writes one JSON object per shape to BENCH_DIR/bench.jsonl.
"""
import glob
import json
import os
import sys


def key(dtype, batch, heads, seq, head_dim, causal):
    return (dtype, int(batch), int(heads), int(seq), int(head_dim), bool(causal))


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    d = sys.argv[1]
    torch = {}
    tpath = os.path.join(d, "torch.jsonl")
    if os.path.exists(tpath):
        for line in open(tpath):
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                t = json.loads(line)
                torch[key(t["dtype"], t["batch"], t["heads"], t["seq"], t["head_dim"], t["causal"])] = t
            except (ValueError, KeyError):
                pass
    rows = []
    for path in sorted(glob.glob(os.path.join(d, "memattn-*.json"))):
        tag = os.path.basename(path)[len("memattn-"):-len(".json")]
        try:
            m = json.load(open(path))
            if "shape" not in m and "error" in m:
                rows.append({"tag": tag, "error": f"memattn exit {m.get('exit_code')}: {str(m['error'])[:100]}"})
                continue
            s = m["shape"]
            k = key(m["dtype"], s["batch"], s["heads"], s["seq_q"], s["head_dim"], s["causal"])
        except (ValueError, KeyError, OSError) as e:
            rows.append({"tag": tag, "error": f"no memattn result ({type(e).__name__})"})
            continue
        t = torch.get(k, {})
        mt, tt = m.get("tflops"), t.get("tflops")
        rows.append({
            "tag": tag,
            "dtype": k[0], "batch": k[1], "heads": k[2], "seq": k[3], "head_dim": k[4], "causal": k[5],
            "memattn_tflops": mt, "memattn_ms": m.get("time_ms"), "verified": m.get("verified"),
            "rel_rms_err": m.get("rel_rms_err"), "error_ratio": m.get("error_ratio"),
            "checked_rows": m.get("verification", {}).get("checked_rows"),
            "torch_tflops": tt, "torch_ms": t.get("time_ms"), "torch_error": t.get("error"),
            "ratio": (mt / tt) if (mt and tt) else None,
        })
    rows.sort(key=lambda r: (r.get("dtype") != "bf16", r.get("seq", 0), r.get("head_dim", 0), r.get("causal", False), r["tag"]))
    f = lambda x, p=1: "-" if x is None else f"{x:.{p}f}"
    hdr = f"{'shape (dtype b x h x seq x d)':<34} {'causal':>6} {'memattn TFLOP/s':>15} {'torch TFLOP/s':>13} {'memattn/torch':>13} {'verified':>8} {'rel RMS':>8} {'err/naive':>9}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if "error" in r:
            print(f"{r['tag']:<34} {r['error']}")
            continue
        shape = f"{r['dtype']} {r['batch']}x{r['heads']}x{r['seq']}x{r['head_dim']}"
        torch_col = f(r["torch_tflops"]) if r["torch_error"] is None else "error"
        rel = "-" if r["rel_rms_err"] is None else f"{r['rel_rms_err']:.1e}"
        print(f"{shape:<34} {str(r['causal']).lower():>6} {f(r['memattn_tflops']):>15} {torch_col:>13} "
              f"{f(r['ratio'], 2):>13} {str(r['verified']).lower():>8} {rel:>8} {f(r['error_ratio'], 2):>9}")
    for r in rows:
        if r.get("torch_error"):
            print(f"torch error for {r['tag']}: {r['torch_error']}")
    with open(os.path.join(d, "bench.jsonl"), "w") as out:
        for r in rows:
            out.write(json.dumps(r) + "\n")
    print(f"(per-shape JSON: {os.path.join(d, 'bench.jsonl')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
