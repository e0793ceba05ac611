#!/usr/bin/env python3
"""FlashAttention-3 forward timings (the `fa3-fwd` wheel: `fa3_fwd_interface.flash_attn_func`, bf16,
Hopper only) for the shapes memattn benchmarks, with the same conventions as bench_sdpa.py.

Prints one JSON object per line: {"dtype", "batch", "heads", "seq", "head_dim", "causal",
"time_ms", "tflops", "fa3"}, or the same keys with "error" instead of the timing (e.g. a dtype the
forward-only build does not ship). FLOPs: memattn's count, 4 * batch * heads * d * unmasked
pairs. Timing: CUDA events around each call, 3 warm-up and 10 timed calls, median. FA3 takes
[batch, seq, heads, d] (memattn's BSHD) and masks bottom-right, as memattn does.

usage: bench_fa3.py SHAPES_JSON   (a list of {"dtype","batch","heads","seq","head_dim","causal"})
exit: 0 done, 2 usage, 3 no CUDA device or no fa3_fwd_interface (the reason on stderr).
"""
import json
import statistics
import sys


def unmasked(seq, causal):
    return seq * (seq + 1) // 2 if causal else seq * seq


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        import torch
        from fa3_fwd_interface import flash_attn_func
    except Exception as e:  # the wheel needs a matching torch; say why and stop
        print(f"bench_fa3.py: cannot import FlashAttention-3: {type(e).__name__}: {e}".splitlines()[0][:240],
              file=sys.stderr)
        return 3
    if not torch.cuda.is_available():
        print("bench_fa3.py: torch sees no CUDA device", file=sys.stderr)
        return 3
    print(f"bench_fa3.py: torch {torch.__version__} on {torch.cuda.get_device_name(0)}", file=sys.stderr)
    for s in json.loads(sys.argv[1]):
        row = dict(s, fa3="fa3-fwd")
        try:
            dt = {"bf16": torch.bfloat16, "f16": torch.float16}[s["dtype"]]
            b, h, n, d = s["batch"], s["heads"], s["seq"], s["head_dim"]
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=dt) for _ in range(3))
            call = lambda: flash_attn_func(q, k, v, causal=s["causal"])
            for _ in range(3):
                call()
            times = []
            for _ in range(10):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            ms = statistics.median(times)
            row.update(time_ms=ms, tflops=4 * b * h * d * unmasked(n, s["causal"]) / (ms * 1e-3) / 1e12)
            del q, k, v
        except Exception as e:  # one failing shape must not lose the others
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
