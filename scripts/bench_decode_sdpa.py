#!/usr/bin/env python3
"""PyTorch reference timings for `memattn decode` (first run on an H200: docs/gpu-h200.md).

Times torch.nn.functional.scaled_dot_product_attention on the decode shapes of
scripts/gpu-check.sh: one query token per sequence against a bf16 KV cache, GQA expanded the way
a PyTorch user would (`enable_gqa=True` where available, else repeat_interleave of the KV heads,
not timed). Prints one JSON line per shape: median ms over 50 launches after 10 warm-up, and the
K/V bytes of the cache read per second.
"""
import json
import torch
import torch.nn.functional as F

SHAPES = [  # batch, heads, heads_kv, head_dim, cache_len
    (1, 32, 8, 128, 8192),
    (8, 32, 8, 128, 32768),
]


def time_ms(fn, warmup=10, reps=50):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main():
    dev = torch.device("cuda")
    for b, h, hk, d, n in SHAPES:
        q = torch.randn(b, h, 1, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, hk, n, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, hk, n, d, device=dev, dtype=torch.bfloat16)
        try:
            fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            fn()
            how = "enable_gqa"
        except TypeError:
            k2, v2 = k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1)
            fn = lambda: F.scaled_dot_product_attention(q, k2, v2)
            how = "repeat_interleave"
        ms = time_ms(fn)
        kv_bytes = 2 * b * hk * n * d * 2
        print(json.dumps({"batch": b, "heads": h, "heads_kv": hk, "head_dim": d, "cache_len": n,
                          "gqa": how, "median_ms": ms, "kv_read_gb_per_s": kv_bytes / (ms * 1e-3) / 1e9,
                          "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
