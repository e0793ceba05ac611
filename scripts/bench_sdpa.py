#!/usr/bin/env python3
"""PyTorch SDPA (flash backend) timings for the shapes memattn benchmarks.

Prints one JSON object per line: {"dtype", "batch", "heads", "seq", "head_dim", "causal",
"time_ms", "tflops", "torch"}, or the same keys with "error" instead of the timing when a shape
fails (e.g. the flash backend refuses it). FLOPs use memattn's count: 4 * batch * heads * d *
(unmasked score entries), where a causal square problem has seq * (seq + 1) / 2 unmasked
entries, so the two tools' TFLOP/s are directly comparable. Timing: CUDA events around each
call, 3 warm-up and 10 timed calls, median (memattn's defaults on CUDA).

A shape with "backward": true times the backward alone instead: the forward runs once with
requires_grad, then `torch.autograd.backward(o, do, retain_graph=True)` is timed the same way
(FlashAttention-2's backward kernels under SDPA's flash backend); FLOPs are 2.5x the forward's,
memattn's `backward_flops`.

usage: bench_sdpa.py SHAPES_JSON   (a list of {"dtype","batch","heads","seq","head_dim","causal"[,"backward"]})
exit: 0 done, 2 usage, 3 no CUDA device visible to torch.
"""
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def unmasked(seq, causal):
    return seq * (seq + 1) // 2 if causal else seq * seq


def bench(dtype, batch, heads, seq, head_dim, causal, backward=False, warmup=3, iters=10):
    dt = {"bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    # SDPA takes [batch, heads, seq, d]; memattn's BSHD tensors are the same data transposed.
    # Square problems only, so torch's top-left causal mask equals memattn's bottom-right one.
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=dt, requires_grad=backward)
               for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        if backward:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            do = torch.randn_like(o)
            call = lambda: torch.autograd.backward(o, do, retain_graph=True)
        else:
            call = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        for _ in range(warmup):
            call()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    del q, k, v
    ms = statistics.median(times)
    flops = 4 * batch * heads * head_dim * unmasked(seq, causal) * (2.5 if backward else 1.0)
    return {"time_ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_sdpa.py: torch sees no CUDA device", file=sys.stderr)
        return 3
    print(f"bench_sdpa.py: torch {torch.__version__} on {torch.cuda.get_device_name(0)}", file=sys.stderr)
    for s in json.loads(sys.argv[1]):
        row = dict(s, torch=torch.__version__)
        try:
            row.update(bench(**s))
        except Exception as e:  # one failing shape must not lose the others
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
