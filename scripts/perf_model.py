#!/usr/bin/env python3
"""perf_model.py: an analytic performance model of memattn's forward and decode kernels on an H200,
calibrated against the measured H200 run (docs/gpu-h200/) and checked on shapes it was not fitted on.

usage:
  python3 scripts/perf_model.py           regenerate docs/perf/calibration.json and docs/perf/decode-model.json
  python3 scripts/perf_model.py --check   regenerate in memory, compare with the committed files, check the
                                          hit targets; exit 1 when either fails. Prints the tables either way.

Pure Python 3 standard library (CI has no numpy). Every physical parameter is a named constant below with
its source; the fitted parameters are few, global (shared by every shape and by both memattn and
FlashAttention-2) and found by a deterministic hand-written Nelder-Mead search. docs/perf/README.md explains
the equations.
"""
import heapq
import json
import math
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALIBRATION = os.path.join(ROOT, 'docs', 'perf', 'calibration.json')
DECODE_MODEL = os.path.join(ROOT, 'docs', 'perf', 'decode-model.json')

# ---- physical parameters --------------------------------------------------------------------------
# H200: 132 SMs, 228 KB shared memory per SM (227 KB per block with the opt-in, tiles.rs
# SMEM_OPT_IN_SM90), 64K 32-bit registers per SM, 2048 threads (64 warps) and 32 blocks per SM
# (CUDA programming guide, compute capability 9.0). Clock: 1.98 GHz, the SM clock measured under load
# in the H200 run (docs/gpu-h200.md). Tensor rate: NVIDIA's dense bf16 figure, 989 TFLOP/s at the
# 1.83 GHz boost clock it is quoted at over 132 SMs, is 4096 FLOP per clock per SM (wgmma); one
# m16n8k16 mma.sync is 4096 FLOP. HBM: 4.8 TB/s (H200 datasheet); H100 SXM 3.35 TB/s, 50 MB L2.
GPUS = {
    'H200': dict(sms=132, smem_per_sm=228 * 1024, regs_per_sm=65536, max_warps=64, max_blocks=32,
                 clock_ghz=1.98, tc_flop_per_clk_sm=989e12 / (132 * 1.83e9), hbm_tbps=4.8),
    'H100-SXM': dict(sms=132, smem_per_sm=228 * 1024, regs_per_sm=65536, max_warps=64, max_blocks=32,
                     clock_ghz=1.98, tc_flop_per_clk_sm=989e12 / (132 * 1.83e9), hbm_tbps=3.35),
}
SMSP = 4                 # scheduler partitions (SMSPs) per SM; a warp lives on one, warp i of a block on i % 4
MMA_FLOP = 16 * 8 * 16 * 2   # one mma.sync m16n8k16: 4096 FLOP
MUFU_CYCLES = 8          # ex2 per warp instruction on one SMSP: 32 lanes over 4 SFUs (16 per SM)
SMEM_BYTES_PER_CLK = 128  # shared memory bandwidth per SM: 32 banks x 4 bytes
REG_ALLOC = 256          # registers are allocated per warp in units of 256 (8 per thread)
SMEM_RESERVED = 1024     # shared memory the driver reserves per block on sm_80 and later
LAUNCH_US = 3.0          # one kernel launch on a busy stream, back to back (assumption, a few us)

# ---- what the kernels are made of ----------------------------------------------------------------
# Non-HMMA warp instructions per unit of 64 queries x 64 keys x d in the steady K/V loop (the common
# path: no mask, no O rescale), measured from the SASS by scripts/sass-compare.sh (ptxas 13.5, torch
# 2.15's libtorch_cuda.so); the table in README.md "Static SASS comparison". FA2's registers come from
# the same table (cuobjdump -res-usage of torch's FA2 cubins); d32/d64/d128 FA2 use 255.
SASS_NONHMMA_PER_UNIT = {   # d: (memattn, FA2)
    32: (820, 1274), 64: (892, 1406), 96: (1156, 1616), 128: (1288, 1862), 192: (1484, 2224), 256: (1668, 2540)}
FA2_REGS = {32: 255, 64: 255, 96: 252, 128: 255, 192: 226, 256: 254}
# The tile torch's FA2 forward picks on A100/H100 without dropout (run_mha_fwd_hdim<d> in FA2's
# flash_fwd_launch_template.h; scripts/sass-compare.sh FA2_TILE_<d> defaults): (Br, Bc, warps).
# FA2 keeps Q in shared memory and reloads it every key tile (Is_Q_in_regs false), smem = (Br + 2 Bc) d 2.
FA2_TILES = {32: (128, 128, 4), 64: (128, 128, 4), 96: (128, 64, 4), 128: (128, 64, 4),
             192: (128, 64, 8), 256: (128, 64, 8)}


def read_our_tiles():
    """memattn's sm_80 forward tiles, from the FLASH_MMA_D<d> literals of kernels-gpu/src/tiles.rs."""
    src = open(os.path.join(ROOT, 'kernels-gpu', 'src', 'tiles.rs')).read()
    tiles = {}
    for m in re.finditer(r'pub const FLASH_MMA_D(\d+): FlashMmaTile =\s*FlashMmaTile \{([^}]*)\}', src):
        fields = dict(kv.split(':') for kv in m.group(2).replace(' ', '').split(',') if kv)
        tiles[int(m.group(1))] = dict(br=int(fields['br']), bc=int(fields['bc']), warps=int(fields['warps']),
                                      rows_per_warp=int(fields['rows_per_warp']),
                                      q_reg_ksteps=int(fields['q_reg_ksteps']))
    return tiles


def read_ptxas(path='ptxas-report.json', arch='sm_90'):
    """name -> (registers, dynamic shared memory) of the ptxas report. The H200 JIT-compiles the sm_80
    PTX for sm_90, so the sm_90 row of ptxas-report.json is the one it runs."""
    rep = json.load(open(os.path.join(ROOT, 'kernels-gpu', 'ptx', path)))
    return {k['name']: (k['registers'], k['dynamic_smem_bytes']) for k in rep['kernels'] if k['arch'] == arch}


def kernel_specs():
    """Both sides' kernels per head dim: tile, registers, shared memory, SASS counts."""
    ours, ptxas = read_our_tiles(), read_ptxas()
    specs = {}
    for d in sorted(SASS_NONHMMA_PER_UNIT):
        t = ours[d]
        regs, smem = ptxas['flash_fwd_bf16_d%d' % d]
        specs[('memattn', d)] = dict(d=d, br=t['br'], bc=t['bc'], warps=t['warps'], rows_per_warp=t['rows_per_warp'],
                                     q_reg_ksteps=t['q_reg_ksteps'], regs=regs, smem=smem,
                                     nonhmma_unit=SASS_NONHMMA_PER_UNIT[d][0], warp_skips_masked=True)
        br, bc, w = FA2_TILES[d]
        specs[('fa2', d)] = dict(d=d, br=br, bc=bc, warps=w, rows_per_warp=br // w, q_reg_ksteps=0,
                                 regs=FA2_REGS[d], smem=(br + 2 * bc) * d * 2,
                                 nonhmma_unit=SASS_NONHMMA_PER_UNIT[d][1], warp_skips_masked=False)
    return specs


# ---- component 1: occupancy ----------------------------------------------------------------------
def occupancy(gpu, regs, smem, warps):
    """Blocks resident per SM and which resource limits them (registers, shared memory, threads)."""
    per_warp = -(-regs * 32 // REG_ALLOC) * REG_ALLOC
    by_regs = (gpu['regs_per_sm'] // per_warp) // warps
    by_smem = gpu['smem_per_sm'] // (smem + SMEM_RESERVED)
    by_threads = gpu['max_warps'] // warps
    blocks = min(by_regs, by_smem, by_threads, gpu['max_blocks'])
    limit = 'registers' if blocks == by_regs else ('shared memory' if blocks == by_smem else 'threads')
    return dict(blocks=blocks, warps=blocks * warps, limit=limit)


# ---- component 2: one warp's work per key tile ---------------------------------------------------
def warp_tile_work(k, p):
    """Cycles one warp keeps its SMSP busy for one key tile: its mma.sync (HMMA) at the mma.sync rate
    plus its other instructions at one issue per clock. The measured kernels overlap the two poorly
    within an SMSP (see the README), so they add."""
    hmma = k['rows_per_warp'] * k['bc'] * k['d'] * 4 / MMA_FLOP
    nonhmma = k['nonhmma_unit'] * k['br'] * k['bc'] / (64 * 64 * k['warps'])
    mufu = k['rows_per_warp'] * k['bc'] / 32
    tc = hmma * p['hmma_cycles']
    return dict(hmma=hmma, nonhmma=nonhmma, mufu=mufu, tensor=tc, issue=nonhmma, busy=tc + nonhmma)


def smem_bytes_per_tile(k):
    """Shared-memory bytes one block moves per key tile: every warp reads all of K and V by ldmatrix,
    Q's k-steps not kept in registers are reloaded, and cp.async writes the next K and V."""
    kv = 2 * k['bc'] * k['d'] * 2
    q_reload = k['br'] * (k['d'] - 16 * k['q_reg_ksteps']) * 2
    return k['warps'] * kv + q_reload + kv


# ---- component 3: a round of key tiles on one SM ------------------------------------------------
def round_cycles(k, occ, p, active_per_smsp=None):
    """Cycles for every resident block to finish one key tile. n = warps per SMSP (all blocks),
    nb = warps per SMSP of one block. The SMSP is busy n * W; a warp's own dependency chain (mma
    latency, the row max and sum shuffles, the exp, the barrier and the K/V tile's arrival) adds L
    cycles that the other blocks' warps can fill but its own block's cannot (they wait at the same
    barrier for the same tile): max(n W, nb W + L). Shared memory bandwidth bounds it from below."""
    w = warp_tile_work(k, p)['busy']
    nb = -(-k['warps'] // SMSP) if active_per_smsp is None else active_per_smsp
    n = nb * occ['blocks']
    compute = max(n * w, nb * w + p['latency'] / nb)
    smem = occ['blocks'] * smem_bytes_per_tile(k) / SMEM_BYTES_PER_CLK
    return max(compute, smem)


# ---- component 4: blocks, causal imbalance and waves ---------------------------------------------
def block_cycles(k, occ, p, seq, m, causal):
    """Cycles of query block m (all its key tiles). Causal: the block stops at the tile holding its
    last row's key; on tiles past its first row a memattn warp whose rows see none of the tile's keys
    skips it (the busiest SMSP sets the round), FlashAttention-2 computes and masks whole tiles."""
    ntiles = -(-seq // k['bc'])
    full = round_cycles(k, occ, p)
    if not causal:
        return ntiles * full
    last_row = min(seq, (m + 1) * k['br']) - 1
    first_row = m * k['br']
    ntiles = last_row // k['bc'] + 1
    cycles = 0.0
    per_smsp = -(-k['warps'] // SMSP)
    for j in range(ntiles):
        key0 = j * k['bc']
        if key0 + k['bc'] - 1 <= first_row or not k['warp_skips_masked']:
            cycles += full
            continue
        active = [0] * SMSP
        for w in range(k['warps']):
            if first_row + (w + 1) * k['rows_per_warp'] - 1 >= key0:
                active[w % SMSP] += 1
        nb = max(active)
        cycles += full if nb == per_smsp else round_cycles(k, occ, p, active_per_smsp=nb)
    return cycles


def kernel_ms(k, gpu, p, batch, heads, seq, causal):
    """Predicted kernel time: blocks in launch order (query block fastest, then head, then batch)
    taken greedily by the SMs' block slots (blocks per SM x 132), plus a prologue per block (Q's load
    and the first K tile, then O's store: memory round trips), a launch, and never less than the
    unique HBM bytes (Q, K, V read once, O written once) over the bandwidth."""
    occ = occupancy(gpu, k['regs'], k['smem'], k['warps'])
    mblocks = -(-seq // k['br'])
    pro = p['prologue']
    durs = [block_cycles(k, occ, p, seq, m, causal) + pro for m in range(mblocks)]
    slots = gpu['sms'] * occ['blocks']
    nblocks = batch * heads * mblocks
    if not causal:
        makespan = -(-nblocks // slots) * durs[0]
    else:
        free = [0.0] * min(slots, nblocks)
        heapq.heapify(free)
        for i in range(nblocks):
            t = heapq.heappop(free)
            heapq.heappush(free, t + durs[i % mblocks])
        makespan = max(free)
    ms = makespan / (gpu['clock_ghz'] * 1e6) + LAUNCH_US / 1e3
    hbm = 4 * batch * heads * seq * k['d'] * 2 / (gpu['hbm_tbps'] * 1e12) * 1e3
    return dict(ms=max(ms, hbm), occ=occ, blocks=nblocks, waves=nblocks / slots,
                limiter=limiter(k, occ, p))


def limiter(k, occ, p):
    """Which term sets a full round: 'issue+tensor' (the SMSP busy), 'latency' or 'shared memory'."""
    w = warp_tile_work(k, p)['busy']
    nb = -(-k['warps'] // SMSP)
    n = nb * occ['blocks']
    terms = {'SMSP busy (tensor + issue)': n * w, 'latency (own block)': nb * w + p['latency'] / nb,
             'shared memory': occ['blocks'] * smem_bytes_per_tile(k) / SMEM_BYTES_PER_CLK}
    return max(terms, key=terms.get)


def flops(batch, heads, seq, d, causal):
    f = 4.0 * batch * heads * seq * seq * d
    return f / 2 if causal else f
