#!/usr/bin/env python3
"""perf_model.py: an analytic performance model of memattn's forward and decode kernels on an H200,
calibrated against the measured H200 run (docs/gpu-h200/) and checked on shapes it was not fitted on; and a
prediction of the sm_80 backward against FlashAttention-2's from the same calibrated parameters (nothing of
the backward was measured: docs/perf/backward-model.json has "measured": null).

usage:
  python3 scripts/perf_model.py           regenerate docs/perf/calibration.json, docs/perf/decode-model.json
                                          and docs/perf/backward-model.json
  python3 scripts/perf_model.py --check   regenerate in memory, compare with the committed files, check the
                                          hit targets; exit 1 when either fails. Prints the tables either way.
  python3 scripts/perf_model.py --pin-run COMMIT
                                          write docs/perf/h200-kernels.json from COMMIT's tiles.rs and ptxas
                                          reports (done once, for a2b6b1f, the commit the H200 ran)

Two sets of kernels: the calibration models the forward kernels as the H200 ran them (tiles and registers
pinned in docs/perf/h200-kernels.json), and a second prediction per shape ("predicted_now" in
calibration.json, the "now" table) models them as kernels-gpu/src/tiles.rs and ptxas-report.json have
them today, with the fitted parameters of the calibration.

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
BACKWARD_MODEL = os.path.join(ROOT, 'docs', 'perf', 'backward-model.json')
RUN_KERNELS = os.path.join(ROOT, 'docs', 'perf', 'h200-kernels.json')

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


def read_our_tiles(src=None):
    """memattn's sm_80 forward tiles, from the FLASH_MMA_D<d> literals of kernels-gpu/src/tiles.rs (or of
    the text `src`)."""
    if src is None:
        src = open(os.path.join(ROOT, 'kernels-gpu', 'src', 'tiles.rs')).read()
    tiles = {}
    for m in re.finditer(r'pub const FLASH_MMA_D(\d+): FlashMmaTile =\s*FlashMmaTile \{([^}]*)\}', src):
        fields = dict(kv.split(':') for kv in re.sub(r'\s', '', m.group(2)).split(',') if kv)
        tiles[int(m.group(1))] = dict(br=int(fields['br']), bc=int(fields['bc']), warps=int(fields['warps']),
                                      rows_per_warp=int(fields['rows_per_warp']),
                                      q_reg_ksteps=int(fields['q_reg_ksteps']))
    return tiles


def read_decode_mma_tile(d=128):
    """The tensor-core decode's tile at head dim d, from the DECODE_MMA_D<d> literal of
    kernels-gpu/src/tiles.rs: bc, warps and stages (K and V buffers each)."""
    src = open(os.path.join(ROOT, 'kernels-gpu', 'src', 'tiles.rs')).read()
    m = re.search(r'pub const DECODE_MMA_D%d: DecodeMmaTile =\s*DecodeMmaTile \{([^}]*)\}' % d, src)
    fields = dict(kv.split(':') for kv in re.sub(r'\s', '', m.group(1)).split(',') if kv)
    return dict(bc=int(fields['bc']), warps=int(fields['warps']), stages=int(fields.get('stages', 1)))


def read_ptxas(path='ptxas-report.json', arch='sm_90', text=None):
    """name -> (registers, dynamic shared memory) of the ptxas report (or of the JSON text `text`). The
    H200 JIT-compiles the sm_80 PTX for sm_90, so the sm_90 row of ptxas-report.json is the one it runs."""
    rep = json.loads(text) if text is not None else json.load(open(os.path.join(ROOT, 'kernels-gpu', 'ptx', path)))
    return {k['name']: (k['registers'], k['dynamic_smem_bytes']) for k in rep['kernels'] if k['arch'] == arch}


def pin_run_kernels(commit):
    """docs/perf/h200-kernels.json: the forward tiles and registers (sm_90 rows) of `commit`, read with
    git show. The calibration models these, whatever the tiles are today."""
    import subprocess
    show = lambda path: subprocess.check_output(['git', '-C', ROOT, 'show', '%s:%s' % (commit, path)], text=True)
    tiles = read_our_tiles(show('kernels-gpu/src/tiles.rs'))
    ptxas = read_ptxas(arch='sm_90', text=show('kernels-gpu/ptx/ptxas-report.json'))
    hopper = read_ptxas(arch='sm_90a', text=show('kernels-gpu/ptx/ptxas-report-sm90.json'))
    doc = dict(
        note='The sm_80 forward kernels as the H200 run (docs/gpu-h200.md) executed them: the FLASH_MMA_D<d> tiles '
             'of kernels-gpu/src/tiles.rs and the sm_90 rows of kernels-gpu/ptx/ptxas-report.json (and '
             'ptxas-report-sm90.json for the sm_90a forward) at the run\'s commit. scripts/perf_model.py fits and '
             'checks its calibration on these; written once by `python3 scripts/perf_model.py --pin-run %s`.' % commit,
        commit=commit,
        forward={str(d): dict(tiles[d], registers=ptxas['flash_fwd_bf16_d%d' % d][0],
                              dynamic_smem_bytes=ptxas['flash_fwd_bf16_d%d' % d][1])
                 for d in sorted(SASS_NONHMMA_PER_UNIT)},
        sm90={n: dict(registers=r, dynamic_smem_bytes=m) for n, (r, m) in sorted(hopper.items())
              if n.startswith('flash_fwd_bf16_sm90_d')})
    open(RUN_KERNELS, 'w').write(dumps(doc))
    return doc


def run_kernels():
    return json.load(open(RUN_KERNELS))


def kernel_specs(now=False):
    """Both sides' kernels per head dim: tile, registers, shared memory, SASS counts. memattn's as the H200
    ran them (docs/perf/h200-kernels.json), or with now=True as tiles.rs and ptxas-report.json have them
    today. The SASS counts per unit are the run's kernels'; a tile changed since then keeps them, corrected
    for its own ldmatrix count (ldsm_per_unit), as the tile advice does for its candidates."""
    run = run_kernels()['forward']
    if now:
        ours, ptxas = read_our_tiles(), read_ptxas()
    specs = {}
    for d in sorted(SASS_NONHMMA_PER_UNIT):
        r = run[str(d)]
        t, regs, smem = r, r['registers'], r['dynamic_smem_bytes']
        if now:
            t = ours[d]
            regs, smem = ptxas['flash_fwd_bf16_d%d' % d]
        nonhmma = (SASS_NONHMMA_PER_UNIT[d][0] - ldsm_per_unit(d, r['rows_per_warp'], r['bc'], r['q_reg_ksteps'])
                   + ldsm_per_unit(d, t['rows_per_warp'], t['bc'], t['q_reg_ksteps']))
        specs[('memattn', d)] = dict(d=d, br=t['br'], bc=t['bc'], warps=t['warps'], rows_per_warp=t['rows_per_warp'],
                                     q_reg_ksteps=t['q_reg_ksteps'], regs=regs, smem=smem,
                                     nonhmma_unit=nonhmma, warp_skips_masked=True)
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
    within an SMSP (see docs/perf/README.md), so they add. (Its exponentials are among the other
    instructions; the MUFU pipe's own rate is not a term here.)"""
    hmma = k['rows_per_warp'] * k['bc'] * k['d'] * 4 / MMA_FLOP
    nonhmma = k['nonhmma_unit'] * k['br'] * k['bc'] / (64 * 64 * k['warps'])
    tc = hmma * p['hmma_cycles']
    return dict(hmma=hmma, nonhmma=nonhmma, tensor=tc, issue=nonhmma, busy=tc + nonhmma)


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
def block_cycles(k, occ, p, seq, m, causal, rounds):
    """Cycles of query block m (all its key tiles); rounds[nb] is a round with nb busy warps per SMSP.
    Causal: the block stops at the tile holding its last row's key; on tiles past its first row a
    memattn warp whose rows see none of the tile's keys skips it (the busiest SMSP sets the round),
    FlashAttention-2 computes and masks whole tiles."""
    per_smsp = -(-k['warps'] // SMSP)
    if not causal:
        return -(-seq // k['bc']) * rounds[per_smsp]
    first_row, last_row = m * k['br'], min(seq, (m + 1) * k['br']) - 1
    ntiles = last_row // k['bc'] + 1
    unmasked = ntiles if not k['warp_skips_masked'] else min(ntiles, (first_row + 1) // k['bc'])
    cycles = unmasked * rounds[per_smsp]
    for j in range(unmasked, ntiles):
        active = [0] * SMSP
        for w in range(k['warps']):
            if first_row + (w + 1) * k['rows_per_warp'] - 1 >= j * k['bc']:
                active[w % SMSP] += 1
        cycles += rounds[max(active)]
    return cycles


def kernel_ms(k, gpu, p, batch, heads, seq, causal):
    """Predicted kernel time: blocks in launch order (query block fastest, then head, then batch)
    taken greedily by the SMs' block slots (blocks per SM x 132), plus a prologue per block (Q's load
    and the first K tile, then O's store: memory round trips), a launch, and never less than the
    unique HBM bytes (Q, K, V read once, O written once) over the bandwidth."""
    occ = occupancy(gpu, k['regs'], k['smem'], k['warps'])
    mblocks = -(-seq // k['br'])
    pro = p['prologue']
    per_smsp = -(-k['warps'] // SMSP)
    rounds = [0.0] + [round_cycles(k, occ, p, active_per_smsp=nb) for nb in range(1, per_smsp + 1)]
    durs = [block_cycles(k, occ, p, seq, m, causal, rounds) + pro for m in range(mblocks)]
    slots = gpu['sms'] * occ['blocks']
    nblocks = batch * heads * mblocks
    if not causal:
        makespan = -(-nblocks // slots) * durs[0]
    else:
        makespan = greedy_makespan(durs, nblocks, slots)
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


def greedy_makespan(durs, nblocks, slots):
    """Blocks i = 0.. (duration durs[i % len(durs)]) taken in order by the first free of `slots` block
    slots (the hardware's block scheduler, approximately): the time the last one ends."""
    free = [0.0] * min(slots, nblocks)
    period = len(durs)
    for i in range(len(free)):
        free[i] = durs[i % period]
    heapq.heapify(free)
    for i in range(len(free), nblocks):
        heapq.heapreplace(free, free[0] + durs[i % period])
    return max(free)


def flops(batch, heads, seq, d, causal):
    f = 4.0 * batch * heads * seq * seq * d
    return f / 2 if causal else f


# ---- the Hopper forward (wgmma), for the time-sm80/sm90 steps -------------------------------------
# memattn's sm_90a forward (flash_fwd_sm90.rs): 384 threads, a producer warpgroup and two consumer
# warpgroups of 64 query rows that ping-pong (one's softmax while the other's wgmma run), Br 128, key
# tiles of Bc (tiles.rs FLASH_SM90_D<d>), registers and shared memory from ptxas-report-sm90.json.
# wgmma rate: the bf16 matrix product measured through PyTorch on the H200 kind of machine, 770-798
# TFLOP/s (docs: /work/shared TOOLCHAIN-FACTS, "A GPU target we know"), is 0.73 of 4096 FLOP/clk/SM
# at 1.98 GHz over 132 SMs: a warpgroup's GEMMs run at that rate.
WGMMA_EFFICIENCY = 784e12 / (4096 * 132 * 1.98e9)
SM90_BC = {64: 128, 128: 128, 256: 64}
SM90_TIMED = {64: (0.941, 1.075), 128: (1.111, 0.609), 256: (1.100, 0.626)}   # docs/gpu-h200.md: sm80, sm90 ms


def sm90_spec(d):
    k = run_kernels()['sm90']['flash_fwd_bf16_sm90_d%d' % d]
    regs, smem = k['registers'], k['dynamic_smem_bytes']
    return dict(d=d, br=128, bc=SM90_BC[d], warps=12, regs=regs, smem=smem, kind='wgmma')


def sm90_round_cycles(k, p):
    """One key tile of one block (both consumer warpgroups): each warpgroup's GEMMs G, its softmax S
    (MUFU-bound: 16 rows x Bc exps per warp, 8 cycles per ex2 instruction) and the dependency latency
    L; with ping-pong the tensor core is busy 2 G and a warpgroup's turn takes G + S + L."""
    g = 64 * k['bc'] * k['d'] * 4 / (k_tc_per_clk() * WGMMA_EFFICIENCY)
    s = 16 * k['bc'] / 32 * MUFU_CYCLES
    return max(2 * g, g + s + p['latency']), dict(gemm=g, softmax=s)


def k_tc_per_clk():
    return GPUS['H200']['tc_flop_per_clk_sm']


def sm90_ms(d, p, batch, heads, seq, causal):
    """The Hopper forward's time with the same block scheduling and prologue as the sm_80 model; one
    block per SM (168 registers x 384 threads at launch). A causal tile is computed whole."""
    gpu = GPUS['H200']
    k = sm90_spec(d)
    occ = occupancy(gpu, k['regs'], k['smem'], k['warps'])
    rnd, parts = sm90_round_cycles(k, p)
    mblocks = -(-seq // k['br'])
    durs = []
    for m in range(mblocks):
        tiles = ((min(seq, (m + 1) * k['br']) - 1) // k['bc'] + 1) if causal else -(-seq // k['bc'])
        durs.append(tiles * rnd + p['prologue'])
    ms = greedy_makespan(durs, batch * heads * mblocks, gpu['sms'] * occ['blocks']) / (gpu['clock_ghz'] * 1e6) + LAUNCH_US / 1e3
    lim = 'tensor (wgmma)' if 2 * parts['gemm'] >= parts['gemm'] + parts['softmax'] + p['latency'] else 'softmax + latency'
    return dict(ms=ms, occ=occ, limiter=lim, **parts)


# ---- fitting -------------------------------------------------------------------------------------
PARAMS = ('hmma_cycles', 'latency', 'prologue')
START = dict(hmma_cycles=8.0, latency=1500.0, prologue=5000.0)


def nelder_mead(f, x0, step, iters=100):
    """Minimise f from x0: the textbook Nelder-Mead simplex (reflect, expand, contract, shrink),
    deterministic, a fixed number of iterations."""
    n = len(x0)
    pts = [list(x0)] + [[x0[j] + (step[j] if j == i else 0.0) for j in range(n)] for i in range(n)]
    vals = [f(x) for x in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=lambda i: vals[i])
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        c = [sum(pts[i][j] for i in range(n)) / n for j in range(n)]
        xr = [2 * c[j] - pts[-1][j] for j in range(n)]
        fr = f(xr)
        if fr < vals[0]:
            xe = [3 * c[j] - 2 * pts[-1][j] for j in range(n)]
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = [(c[j] + pts[-1][j]) / 2 for j in range(n)]
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                for i in range(1, n + 1):
                    pts[i] = [(pts[0][j] + pts[i][j]) / 2 for j in range(n)]
                    vals[i] = f(pts[i])
    best = min(range(n + 1), key=lambda i: vals[i])
    return pts[best], vals[best]


# ---- the measured H200 forward table -------------------------------------------------------------
def measured_rows():
    """docs/gpu-h200/bench.jsonl: the 21 shapes of table.txt, both sides' times."""
    path = os.path.join(ROOT, 'docs', 'gpu-h200', 'bench.jsonl')
    return [json.loads(line) for line in open(path) if line.strip()]


def shape_name(r):
    return '%s %dx%dx%dx%d' % (r['dtype'], r['batch'], r['heads'], r['seq'], r['head_dim'])


# The held-out split: the head dims in order 32, 64, 96, 128, 192, 256; the parameters of the split fit
# are fitted on the 1st, 3rd and 5th (32, 96, 192: 6 rows) and predict the others (64, 128, 256: 15
# rows, the f16 row included), kernels whose tiles and occupancy the fit never saw.
FIT_DIMS = (32, 96, 192)
# What docs/perf/README.md claims beyond the prefill targets; --check fails when fewer hold.
DECODE_CLAIM = 6     # of the 7 measured decode figures within 15 % (the e4m3 call is the miss)
HOPPER_CLAIM = 2     # of the 3 Hopper/sm_80 ratios within 15 % (d64 is the miss)


def predict_row(r, specs, p, gpu=GPUS['H200']):
    d, args = r['head_dim'], (r['batch'], r['heads'], r['seq'], r['causal'])
    ours = kernel_ms(specs[('memattn', d)], gpu, p, *args)
    fa2 = kernel_ms(specs[('fa2', d)], gpu, p, *args)
    return ours, fa2


def fit(rows, specs):
    """Global parameters minimising the squared log errors of both sides' times (memattn and FA2)
    over `rows`; searched in log space so they stay positive."""
    def loss(x):
        p = dict(zip(PARAMS, (math.exp(v) for v in x)))
        err = 0.0
        for r in rows:
            ours, fa2 = predict_row(r, specs, p)
            err += math.log(ours['ms'] / r['memattn_ms']) ** 2 + math.log(fa2['ms'] / r['torch_ms']) ** 2
        return err
    x, _ = nelder_mead(loss, [math.log(START[k]) for k in PARAMS], [0.3] * len(PARAMS))
    return {k: float('%.4g' % math.exp(v)) for k, v in zip(PARAMS, x)}


def within(pred, meas, tol=0.15):
    return abs(pred / meas - 1.0) <= tol


def calibration(specs, specs_now):
    """One entry per measured shape: the model's ratio with the parameters fitted on all rows, and the
    ratio from the split fit (held_out rows were not in that fit), both for the kernels as the H200 ran
    them (`specs`); then the all-rows fit's ratio for memattn's kernels as they are now (`specs_now`,
    "predicted_now"), which nothing has measured."""
    rows = measured_rows()
    p_all = fit(rows, specs)
    p_half = fit([r for r in rows if r['head_dim'] in FIT_DIMS], specs)
    out = []
    for r in rows:
        ours, fa2 = predict_row(r, specs, p_all)
        h_ours, h_fa2 = predict_row(r, specs, p_half)
        now, _ = predict_row(r, specs_now, p_all)
        kn = specs_now[('memattn', r['head_dim'])]
        f = flops(r['batch'], r['heads'], r['seq'], r['head_dim'], r['causal'])
        out.append({
            'shape': shape_name(r), 'causal': r['causal'], 'measured': round(r['ratio'], 3),
            'predicted': round(fa2['ms'] / ours['ms'], 3),
            'held_out': r['head_dim'] not in FIT_DIMS,
            'predicted_split_fit': round(h_fa2['ms'] / h_ours['ms'], 3),
            'memattn_ms': {'measured': round(r['memattn_ms'], 4), 'predicted': round(ours['ms'], 4)},
            'fa2_ms': {'measured': round(r['torch_ms'], 4), 'predicted': round(fa2['ms'], 4)},
            'memattn_tflops': {'measured': round(r['memattn_tflops'], 1), 'predicted': round(f / ours['ms'] / 1e9, 1)},
            'fa2_tflops': {'measured': round(r['torch_tflops'], 1), 'predicted': round(f / fa2['ms'] / 1e9, 1)},
            'memattn': {'blocks_per_sm': ours['occ']['blocks'], 'warps_per_sm': ours['occ']['warps'],
                        'occupancy_limit': ours['occ']['limit'], 'waves': round(ours['waves'], 2),
                        'limiter': ours['limiter']},
            'fa2': {'blocks_per_sm': fa2['occ']['blocks'], 'warps_per_sm': fa2['occ']['warps'],
                    'occupancy_limit': fa2['occ']['limit'], 'waves': round(fa2['waves'], 2),
                    'limiter': fa2['limiter']},
            'predicted_now': round(fa2['ms'] / now['ms'], 3),
            'memattn_now': {'tile': '%dx%d, %d warps x %d rows, q%d' % (kn['br'], kn['bc'], kn['warps'], kn['rows_per_warp'],
                                                                     kn['q_reg_ksteps']),
                            'registers': kn['regs'], 'blocks_per_sm': now['occ']['blocks'],
                            'ms_predicted': round(now['ms'], 4), 'limiter': now['limiter']},
        })
    hopper = []
    for d in sorted(SM90_TIMED):
        b, h, s = 4, 2048 // d, 4096
        old = kernel_ms(specs[('memattn', d)], GPUS['H200'], p_all, b, h, s, True)
        new = sm90_ms(d, p_all, b, h, s, True)
        m80, m90 = SM90_TIMED[d]
        hopper.append({
            'shape': 'bf16 %dx%dx%dx%d' % (b, h, s, d), 'causal': True, 'kernel': 'flash_fwd_bf16_sm90_d%d' % d,
            'measured': round(m80 / m90, 3), 'predicted': round(old['ms'] / new['ms'], 3),
            'ratio_of': 'sm90 kernel speed / sm80 kernel speed',
            'sm90_ms': {'measured': m90, 'predicted': round(new['ms'], 4)},
            'sm80_ms': {'measured': m80, 'predicted': round(old['ms'], 4)},
            'sm90': {'blocks_per_sm': new['occ']['blocks'], 'occupancy_limit': new['occ']['limit'],
                     'gemm_cycles_per_warpgroup_tile': round(new['gemm']), 'softmax_cycles': round(new['softmax']),
                     'limiter': new['limiter']},
        })
    return dict(params_all=p_all, params_split=p_half, rows=out, hopper=hopper)


# ---- decode: bytes in flight against memory latency ----------------------------------------------
# Each decode kernel walks its split's keys tile by tile; K and V have one buffer each, so a block has
# one tile's load outstanding at a time and waits for it (decode_mma.rs: wait for K, start V, S and
# the softmax, wait for V, start the next K, P V; decode_fwd.rs stages K and V together with plain
# loads, then computes key by key). The bytes a block has in flight are therefore one tile, and
# Little's law gives the bandwidth: BW = min(HBM, bytes in flight over all SMs / latency).
# Registers: at the H200 run (commit a2b6b1f's ptxas-report.json, sm_90 row) and now.
DECODE_KERNELS = {
    'decode_mma_bf16_d128': dict(bc=64, rows=16, warps=4, elem=2, smem=36864, regs_run=191, kv_per_phase=1),
    'decode_mma_fp8_e4m3_d128': dict(bc=64, rows=16, warps=4, elem=1, smem=36864, regs_run=166, kv_per_phase=1),
    'decode_fwd_bf16_d128': dict(bc=32, rows=8, warps=4, elem=2, smem=32768, regs_run=95, kv_per_phase=2, simt=True),
    # PyTorch SDPA's FA2 split-KV forward at d128 (flash_fwd_launch_template.h, run_mha_fwd_splitkv_dispatch:
    # kBlockM 64, kBlockN 128, 4 warps; smem (64 + 2 x 128) x 128 x 2; registers assumed 255 as its forward's).
    'fa2_splitkv_d128': dict(bc=128, rows=64, warps=4, elem=2, smem=(64 + 256) * 128 * 2, regs_run=255, kv_per_phase=1),
}
DECODE_PARAMS = ('mem_latency_us', 'loaded_latency_us', 'call_us', 'simt_key_cycles')
DECODE_START = dict(mem_latency_us=0.6, loaded_latency_us=0.4, call_us=20.0, simt_key_cycles=400.0)


def fa2_num_splits(blocks, sms, n_blocks, max_splits=128):
    """FlashAttention-2's num_splits_heuristic, as memattn/src/decode.rs copies it."""
    if blocks >= 0.8 * sms:
        return 1
    max_splits = min(max_splits, sms, n_blocks)
    eligible = lambda n: n == 1 or -(-n_blocks // n) != -(-n_blocks // (n - 1))
    eff = lambda n: (blocks * n / sms) / math.ceil(blocks * n / sms)
    best = max(eff(n) for n in range(1, max_splits + 1) if eligible(n))
    return next(n for n in range(1, max_splits + 1) if eligible(n) and eff(n) >= 0.85 * best)


IN_FLIGHT_PER_SM = 32 * 1024      # memattn/src/decode.rs IN_FLIGHT_PER_SM
DECODE_MMA_BLOCKS_PER_SM = 2      # memattn/src/decode.rs DECODE_MMA_BLOCKS_PER_SM


def memattn_mma_splits(blocks, sms, tile_bytes, n_blocks, max_splits=128):
    """memattn's `--splits auto` for the tensor-core decode since the H200 run
    (memattn/src/decode.rs splits_for_bytes_in_flight): enough resident blocks per SM for
    IN_FLIGHT_PER_SM bytes of key tiles in flight (at most 2), the most splits within one wave."""
    per_sm = max(1, min(-(-IN_FLIGHT_PER_SM // max(1, tile_bytes)), DECODE_MMA_BLOCKS_PER_SM))
    if blocks == 0:
        return 1
    return min(max(1, sms * per_sm // blocks), max(1, n_blocks), max_splits)


def decode_us(kname, p, batch, heads, heads_kv, d, cache, splits='auto', regs=None, stages=1, paged=False,
              appends=0, fused_merge=False, tile=None, gpu=GPUS['H200']):
    """Predicted time of one decode call (seq_q 1): the call's fixed cost, the decode kernel's blocks
    (waves of resident blocks, each tile: max(latency at this load, bytes in flight / HBM)), the merge
    of the splits and any cache append. Returns microseconds and the parts."""
    k = dict(DECODE_KERNELS[kname], **(tile or {}))
    group = heads // heads_kv
    per_split = -(-group // k['rows']) * heads_kv * batch
    n_blocks_fa2 = -(-cache // 128)          # memattn/src/decode.rs fa2_block_n(128) = 128
    if splits == 'auto':
        nsplit = fa2_num_splits(per_split, gpu['sms'], n_blocks_fa2)
    elif splits == 'auto-now':     # memattn's plan today: SIMT keeps FA2's heuristic
        nsplit = (fa2_num_splits(per_split, gpu['sms'], n_blocks_fa2) if k.get('simt') else
                  memattn_mma_splits(per_split, gpu['sms'], k['bc'] * d * k['elem'], n_blocks_fa2))
    else:
        nsplit = splits
    blocks = per_split * nsplit
    # `smem_total`: a kernel's own figure (the ptxas report's); else its single-stage smem times stages
    occ = occupancy(gpu, regs or k['regs_run'], k.get('smem_total') or k['smem'] * (stages if stages > 1 else 1),
                    k['warps'])
    resident = min(blocks, gpu['sms'] * occ['blocks'])
    key_tiles = -(-cache // k['bc'])
    tiles = -(-key_tiles // nsplit)                  # a split covers whole key tiles
    tile_bytes = k['bc'] * d * k['elem'] * k['kv_per_phase']
    inflight = resident * tile_bytes * stages
    bw = gpu['hbm_tbps'] * 1e6                # bytes per microsecond
    load = min(1.0, inflight / (bw * p['mem_latency_us']))
    latency = p['mem_latency_us'] + p['loaded_latency_us'] * load
    phases = tiles * (2 // k['kv_per_phase'])
    phase_us = max(latency / stages, inflight / stages / bw)
    if k.get('simt'):
        phase_us += k['bc'] * p['simt_key_cycles'] / (gpu['clock_ghz'] * 1e3)
    lookups_us = tiles * p['mem_latency_us'] if paged else 0.0   # a block-table read before each K tile
    waves = -(-blocks // resident)
    # per block: its tile phases, the lookups, and two round trips (Q in, the partial O out)
    kernel = waves * (phases * phase_us + lookups_us + 2 * p['mem_latency_us'])
    merge = 0.0
    if nsplit > 1:
        # a second launch reads every split's LSE, then their O rows (two dependent round trips);
        # fused (the last block of a row's splits merges them, FlashInfer-style) it costs no launch
        rows = batch * heads
        merge = (0.0 if fused_merge else LAUNCH_US) + 2 * p['mem_latency_us'] + nsplit * rows * (d + 1) * 4 / bw
    append = appends * (LAUNCH_US + p['mem_latency_us'])
    total = p['call_us'] + kernel + merge + append
    kv_bytes = 2 * batch * heads_kv * cache * d * k['elem']
    return dict(us=total, gbps=kv_bytes / total / 1e3, splits=nsplit, blocks=blocks, blocks_per_sm=occ['blocks'],
                resident=resident, inflight_per_sm=inflight / min(gpu['sms'], resident), kernel_us=kernel,
                merge_us=merge, call_us=p['call_us'], latency_us=latency, phases=phases, kv_bytes=kv_bytes)


# The measured decode figures (docs/gpu-h200.md, "Decode against PyTorch SDPA"; heads 32/8, d128).
DECODE_MEASURED = [
    dict(shape='bf16 batch 8 heads 32/8 d128 cache 32768 splits auto', kernel='decode_mma_bf16_d128',
         args=dict(batch=8, cache=32768), measured_ms=0.485),
    dict(shape='bf16 batch 8 heads 32/8 d128 cache 32768 splits auto', kernel='decode_fwd_bf16_d128',
         args=dict(batch=8, cache=32768), measured_ms=4.139),
    dict(shape='bf16 batch 1 heads 32/8 d128 cache 8192 splits auto', kernel='decode_mma_bf16_d128',
         args=dict(batch=1, cache=8192), measured_ms=0.0373),
    dict(shape='bf16 batch 1 heads 32/8 d128 cache 8192 splits 1', kernel='decode_mma_bf16_d128',
         args=dict(batch=1, cache=8192, splits=1), measured_ms=0.197),
    dict(shape='e4m3 batch 1 heads 32/8 d128 cache 8192 (+1 appended) page 16 splits auto', kernel='decode_mma_fp8_e4m3_d128',
         args=dict(batch=1, cache=8193, paged=True, appends=1), measured_ms=0.0528),
    dict(shape='bf16 batch 8 heads 32/8 d128 cache 32768 (PyTorch SDPA)', kernel='fa2_splitkv_d128',
         args=dict(batch=8, cache=32768), measured_ms=0.25513601303100586),
    dict(shape='bf16 batch 1 heads 32/8 d128 cache 8192 (PyTorch SDPA)', kernel='fa2_splitkv_d128',
         args=dict(batch=1, cache=8192), measured_ms=0.030688000842928886),
]


def decode_predict(m, p, **extra):
    a = dict(heads=32, heads_kv=8, d=128)
    a.update(m['args'])
    a.update(extra)
    return decode_us(m['kernel'], p, **a)


def decode_fit():
    def loss(x):
        p = dict(zip(DECODE_PARAMS, (math.exp(v) for v in x)))
        return sum(math.log(decode_predict(m, p)['us'] / (m['measured_ms'] * 1e3)) ** 2 for m in DECODE_MEASURED)
    x, _ = nelder_mead(loss, [math.log(DECODE_START[k]) for k in DECODE_PARAMS], [0.3] * len(DECODE_PARAMS), iters=300)
    return {k: float('%.4g' % math.exp(v)) for k, v in zip(DECODE_PARAMS, x)}


def now_stages(kname, now):
    """The tensor-core decode as committed: its K/V stages (tiles.rs DECODE_MMA_D128) and shared
    memory (the ptxas report's); nothing for the other kernels."""
    if not kname.startswith('decode_mma_'):
        return {}
    return dict(stages=read_decode_mma_tile(128)['stages'], tile=dict(smem_total=now[kname][1]))


def decode_entries(p):
    """One entry per measured H200 figure (the kernels as they ran), then one per shape for the kernels
    as they are now (the registers of today's ptxas-report.json, sm_90 row), measured_gbps null."""
    out = []
    for m in DECODE_MEASURED:
        r = decode_predict(m, p)
        meas = r['kv_bytes'] / (m['measured_ms'] * 1e3) / 1e3
        out.append(dict(shape=m['shape'], kernel=m['kernel'], registers=DECODE_KERNELS[m['kernel']]['regs_run'],
                        measured_gbps=round(meas), predicted_gbps=round(r['gbps']),
                        measured_ms=round(m['measured_ms'], 4), predicted_ms=round(r['us'] / 1e3, 4),
                        splits=r['splits'], blocks=r['blocks'], blocks_per_sm_allowed=r['blocks_per_sm'],
                        bytes_in_flight_per_sm=round(r['inflight_per_sm']), latency_us=round(r['latency_us'], 3),
                        kernel_us=round(r['kernel_us'], 1), merge_us=round(r['merge_us'], 1), call_us=r['call_us']))
    now = read_ptxas()
    for m in DECODE_MEASURED:
        if m['kernel'] not in now:
            continue
        regs = now[m['kernel']][0]
        extra = dict(regs=regs, **now_stages(m['kernel'], now))
        if 'splits' not in m['args']:
            extra['splits'] = 'auto-now'      # the split plan as it is now (decode.rs)
        r = decode_predict(m, p, **extra)
        out.append(dict(shape=m['shape'], kernel=m['kernel'], registers=regs, as_of='now', measured_gbps=None,
                        predicted_gbps=round(r['gbps']), predicted_ms=round(r['us'] / 1e3, 4), splits=r['splits'],
                        stages=extra.get('stages', 1), blocks=r['blocks'], blocks_per_sm_allowed=r['blocks_per_sm'],
                        bytes_in_flight_per_sm=round(r['inflight_per_sm'])))
    # Not measured on the H200: the e4m3 cache at the long shape, against bf16 on the same plan rule.
    fp8 = 'decode_mma_fp8_e4m3_d128'
    if fp8 in now:
        r = decode_us(fp8, p, 8, 32, 8, 128, 32768, splits='auto-now', regs=now[fp8][0], **now_stages(fp8, now))
        bf = decode_us('decode_mma_bf16_d128', p, 8, 32, 8, 128, 32768, splits='auto-now',
                       regs=now['decode_mma_bf16_d128'][0], **now_stages('decode_mma_bf16_d128', now))
        out.append(dict(shape='e4m3 batch 8 heads 32/8 d128 cache 32768 splits auto', kernel=fp8,
                        registers=now[fp8][0], as_of='now', measured_gbps=None, predicted_gbps=round(r['gbps']),
                        predicted_ms=round(r['us'] / 1e3, 4), splits=r['splits'],
                        stages=now_stages(fp8, now).get('stages', 1), blocks=r['blocks'],
                        blocks_per_sm_allowed=r['blocks_per_sm'], bytes_in_flight_per_sm=round(r['inflight_per_sm']),
                        speed_over_bf16=round(bf['us'] / r['us'], 3)))
    return out


def decode_advice(p):
    """What the tensor-core decode needs at the two shapes: the predicted bandwidth over split counts,
    K/V stages (tiles in flight per block) and key tiles, with today's registers (3 blocks per SM)."""
    regs = read_ptxas()['decode_mma_bf16_d128'][0]
    rows = []
    for batch, cache, target in ((8, 32768, 3840), (1, 8192, 1100)):
        for splits in ('auto', 2, 4, 8, 16, 32):
            for stages in (1, 2, 3):
                for bc in (64, 128):
                    for fused in (False, True):
                        tile = dict(bc=bc, smem=(16 + 2 * bc) * 128 * 2)   # Q tile + K and V tiles, bf16
                        r = decode_us('decode_mma_bf16_d128', p, batch, 32, 8, 128, cache, splits=splits, regs=regs,
                                      stages=stages, fused_merge=fused, tile=tile)
                        rows.append(dict(batch=batch, cache=cache, target_gbps=target, splits=r['splits'],
                                         stages=stages, bc=bc, fused_merge=fused, predicted_gbps=round(r['gbps']),
                                         reaches=r['gbps'] >= target, blocks=r['blocks'],
                                         bytes_in_flight_per_sm=round(r['inflight_per_sm']),
                                         kernel_us=round(r['kernel_us'], 1), merge_us=round(r['merge_us'], 1),
                                         total_us=round(r['us'], 1)))
    # Little's law alone: the bytes in flight per SM that sustain the target at the loaded latency.
    need = {}
    for batch, cache, target in ((8, 32768, 3840), (1, 8192, 1100)):
        lat = p['mem_latency_us'] + p['loaded_latency_us']
        need['batch %d cache %d' % (batch, cache)] = dict(
            target_gbps=target, loaded_latency_us=round(lat, 3),
            bytes_in_flight_per_sm=round(target * 1e3 * lat / GPUS['H200']['sms']),
            time_budget_us=round(2 * batch * 8 * cache * 128 * 2 / (target * 1e3), 1), call_us=p['call_us'])
    return dict(sweep=rows, littles_law=need)


# ---- prefill advice: which tiles the model puts at >= 1.0x FA2 -----------------------------------
def ldsm_per_unit(d, rows_per_warp, bc, q_reg_ksteps):
    """ldmatrix.x4 (512 bytes) per 64 x 64 unit: every warp reads K and V whole (32 d / rows per warp)
    and the block reloads Q's k-steps not kept in registers per key tile (16 (d - 16 q) / Bc). It gives
    README's measured counts (memattn d128: 128 + 48 = 176; FA2 d128: 128 + 32 = 160)."""
    return 32 * d / rows_per_warp + 16 * (d - 16 * q_reg_ksteps) / bc


def register_floor(d, rows_per_warp, bc, q_reg_ksteps):
    """A floor on the registers per thread of a tile: the O accumulator (rows x d f32 over 32 lanes),
    the scores (rows x Bc), Q's fragments kept in registers, and 64 for addresses, the row statistics
    and the loop (today's kernels use 10-60 more than this floor; ptxas decides)."""
    return rows_per_warp * (d + bc) // 32 + rows_per_warp * q_reg_ksteps // 4 + 64


def tile_advice(specs, p):
    """For every head dim: the model's memattn/FA2 ratio at the table's 4096-token shape (non-causal and
    causal) for candidate tiles (Br, Bc, warps, registers per thread). A candidate keeps today's SASS
    instruction count per unit at that head dim, corrected for its ldmatrix count (ldsm_per_unit), and
    needs at least register_floor registers; whether ptxas fits it in the budget without spilling is
    the kernel's to show (ptxas-report.json)."""
    gpu = GPUS['H200']
    out = []
    for d in sorted(SASS_NONHMMA_PER_UNIT):
        base = specs[('memattn', d)]
        b, h, s = 4, 2048 // d, 4096
        fa2 = {c: kernel_ms(specs[('fa2', d)], gpu, p, b, h, s, c)['ms'] for c in (False, True)}
        cur = {c: kernel_ms(base, gpu, p, b, h, s, c)['ms'] for c in (False, True)}
        ldsm0 = ldsm_per_unit(d, base['rows_per_warp'], base['bc'], base['q_reg_ksteps'])
        best = {}
        for warps in (4, 6, 8):
            for rpw in (16, 32):
                br = warps * rpw
                for bc in (32, 64, 128):
                    for q in sorted({0, base['q_reg_ksteps']}):
                        smem = (br + 2 * bc) * d * 2
                        if smem > 227 * 1024:
                            continue
                        floor = register_floor(d, rpw, bc, q)
                        for regs in (128, 168, 200, 232, 255):
                            occ = occupancy(gpu, regs, smem, warps)
                            if regs < floor or occ['blocks'] == 0:
                                continue
                            k = dict(base, br=br, bc=bc, warps=warps, rows_per_warp=rpw, regs=regs, smem=smem,
                                     q_reg_ksteps=q,
                                     nonhmma_unit=base['nonhmma_unit'] - ldsm0 + ldsm_per_unit(d, rpw, bc, q))
                            r = {c: kernel_ms(k, gpu, p, b, h, s, c)['ms'] for c in (False, True)}
                            c = dict(br=br, bc=bc, warps=warps, rows_per_warp=rpw, q_reg_ksteps=q, regs=regs,
                                     register_floor=floor, smem=smem, blocks_per_sm=occ['blocks'],
                                     warps_per_sm=occ['warps'], ratio=round(fa2[False] / r[False], 3),
                                     ratio_causal=round(fa2[True] / r[True], 3))
                            key = (br, bc, warps)
                            score = (min(c['ratio'], c['ratio_causal']), regs)
                            if key not in best or score > (min(best[key]['ratio'], best[key]['ratio_causal']), best[key]['regs']):
                                best[key] = c
        ranked = sorted(best.values(), key=lambda c: (-min(c['ratio'], c['ratio_causal']), -c['regs']))
        occ0 = occupancy(gpu, base['regs'], base['smem'], base['warps'])
        out.append(dict(d=d, current=dict(br=base['br'], bc=base['bc'], warps=base['warps'], regs=base['regs'],
                                          blocks_per_sm=occ0['blocks'], warps_per_sm=occ0['warps'],
                                          ratio=round(fa2[False] / cur[False], 3),
                                          ratio_causal=round(fa2[True] / cur[True], 3), limiter=limiter(base, occ0, p)),
                        candidates=ranked[:8]))
    return out


# ---- the backward (sm_80 main kernels), predicted from the forward's calibration -----------------
# Nothing of the backward was timed on the H200: this section applies the forward's fitted parameters
# (c, L, P) and the decode's fitted memory latency L0 to the backward kernels' structure. A block owns
# a key block (Bc keys, K and V staged once) and walks query tiles of Br rows: per tile S and dP, P
# and dS, dV += P^T dO, dK += dS^T Q, dQ += dS K (five GEMMs, 10 d mma.sync per 64 x 64 unit), dQ
# added to an f32 accumulator by reductions in L2. Around it, two bandwidth kernels: the preprocess
# (D = rowsum(dO o O), the accumulator zeroed) and the convert (accumulator to dQ).
#
# Per 64 x 64 x d unit, steady query tile (no mask), sm_80 SASS (ptxas 13.5; torch 2.15's FA2), from
# `BWD=1 scripts/sass-compare.sh` as docs/kernels.md's backward table records it: non-HMMA warp
# instructions, shared-memory bytes (KiB) and dQ reduction bytes (KiB) per unit, per SM. The compact
# rows (flash_bwd_*_d{64,128}_compact) were measured at commit cec1388 (the table of that commit's
# README), before flash_bwd_mma.rs was last edited: their counts are older than the others'.
BWD_SASS = {   # name: (non-HMMA per unit, HMMA per unit, smem KiB per unit, dQ reduction KiB per unit)
    'flash_bwd_bf16_d32': (2236, 320, 129, 8),
    'flash_bwd_bf16_d64': (2572, 640, 184, 8),
    'flash_bwd_bf16_d128': (4484, 1280, 352, 32),
    'flash_bwd_bf16_d64_compact': (3416, 640, 250, 16),
    'flash_bwd_bf16_d128_compact': (7632, 1792, 692, 32),   # 2 warps per 16 keys both compute S and dP
    'fa2_bwd_d32': (1778, 320, 108, 4),
    'fa2_bwd_d64': (2132, 640, 168, 8),
    'fa2_bwd_d128': (2804, 1280, 320, 16),
}
# FlashAttention-2's backward tiles on A100/H100 without dropout (run_mha_bwd_hdim<d> in FA2's
# flash_bwd_launch_template.h, >= 144 KB opt-in shared memory; sass-compare.sh FA2_BWD_TILES):
# Flash_bwd_kernel_traits<d, kBlockM, kBlockN, kNWarps, ...>; registers 255 (cuobjdump -res-usage of
# torch 2.15's cubins, docs/kernels.md); shared memory kSmemSize1colblock (sass-compare.sh fa2_bwd_smem).
FA2_BWD_TILES = {32: (128, 128, 8, True), 64: (128, 128, 8, False), 128: (64, 128, 8, False)}  # Br, Bc, warps, V in regs
FA2_BWD_REGS = 255
# Fraction of a query tile's work that runs between the issue of the next tile's Q and dO and the wait
# for them. memattn stages Q and dO at the top of the tile and waits before S (flash_bwd_tc.rs,
# flash_bwd_mma.rs): 0. FA2 (flash_bwd_kernel.h) double-buffers Q, issued after dP, and issues the next
# dO after the dV GEMM: the dQ and dK GEMMs, 2 of the 5, run while it arrives: 0.4.
BWD_LOAD_OVERLAP = {'memattn': 0.0, 'fa2': 0.4}
BWD_SHAPES = ((64, False), (64, True), (128, False), (128, True))   # the forward table's 4096 rows: 4 x 2048/d
BWD_EXTRA = (32,)                                                     # d32 (4 x 64 x 4096 x 32) if cheap
# What docs/perf/README.md "The backward" claims; --check fails when the model stops giving it.
BWD_CLAIM = dict(at_or_above=0, below=4, prefetch_at_or_above=0, candidate_at_or_above=0)


def bwd_fa2_smem(d):
    br, bc, _, v_in_regs = FA2_BWD_TILES[d]
    qdo, kv, pds = br * d * 3 * 2, bc * d * 2 * 2, br * bc * 2
    return qdo + (max(kv, kv // 2 + 2 * pds) if v_in_regs else kv + 2 * pds)


def read_bwd_tiles():
    """memattn's backward main-kernel tiles: FLASH_BWD_TC_D<d> (Br 128, 8 warps, Bc) and
    FLASH_BWD_MMA_D<d> (Br, warps, Bc = 16 warps / kv_splits) of kernels-gpu/src/tiles.rs."""
    src = open(os.path.join(ROOT, 'kernels-gpu', 'src', 'tiles.rs')).read()
    tiles = {}
    for m in re.finditer(r'pub const FLASH_BWD_MMA_D(\d+): FlashBwdMmaTile =\s*FlashBwdMmaTile \{([^}]*)\}', src):
        f = dict(kv.split(':') for kv in re.sub(r'\s', '', m.group(2)).split(',') if kv)
        warps, splits = int(f['warps']), int(f.get('kv_splits', 1))
        tiles[('compact', int(m.group(1)))] = dict(br=int(f['br']), bc=16 * warps // splits, warps=warps)
    for m in re.finditer(r'pub const FLASH_BWD_TC_D(\d+): FlashBwdTcTile =\s*FlashBwdTcTile \{([^}]*)\}', src):
        f = dict(kv.split(':') for kv in re.sub(r'\s', '', m.group(2)).split(',') if kv)
        tiles[('tc', int(m.group(1)))] = dict(br=128, bc=int(f['bc']), warps=8)
    return tiles


def bwd_specs():
    """name -> kernel dict for the backward model: tile, registers and shared memory (sm_90 rows of
    ptxas-report.json: the H200 JIT-compiles the sm_80 PTX), per-unit SASS counts, load overlap."""
    tiles, ptxas = read_bwd_tiles(), read_ptxas()
    specs = {}
    for name, (nonhmma, hmma, smem_kib, red_kib) in BWD_SASS.items():
        m = re.match(r'(flash_bwd_bf16|fa2_bwd)_d(\d+)(_compact)?$', name)
        d = int(m.group(2))
        if m.group(1) == 'fa2_bwd':
            br, bc, warps, _ = FA2_BWD_TILES[d]
            regs, smem, side = FA2_BWD_REGS, bwd_fa2_smem(d), 'fa2'
        else:
            t = tiles[('compact', d)] if (m.group(3) or ('tc', d) not in tiles) else tiles[('tc', d)]
            br, bc, warps = t['br'], t['bc'], t['warps']
            regs, smem = ptxas[name]
            side = 'memattn'
        specs[name] = dict(name=name, side=side, d=d, br=br, bc=bc, warps=warps, regs=regs, smem=smem,
                           nonhmma_unit=nonhmma, hmma_unit=hmma, smem_unit=smem_kib * 1024, red_unit=red_kib * 1024,
                           load_overlap=BWD_LOAD_OVERLAP[side])
    return specs


def bwd_round(k, occ, p, arrival_cycles):
    """Cycles of one round (every resident block does one query tile) and its parts. W: one warp's
    tile (its mma.sync at c cycles plus its other instructions at one issue per clock, as the
    forward's); the SMSP is busy n W; a block's own warps wait out L / nb of the tile's dependency
    chain (the forward's rule) and the arrival of Q and dO that the tile's work does not cover."""
    units = k['br'] * k['bc'] / 4096.0
    hmma = k['hmma_unit'] * units / k['warps']
    nonhmma = k['nonhmma_unit'] * units / k['warps']
    w = hmma * p['hmma_cycles'] + nonhmma
    nb = -(-k['warps'] // SMSP)
    n = nb * occ['blocks']
    arrival = max(0.0, arrival_cycles - k['load_overlap'] * nb * w)
    own = 'latency + Q/dO arrival (own block)' if arrival > 0 else 'latency (own block)'
    terms = {'SMSP busy (tensor + issue)': n * w, own: nb * w + p['latency'] / nb + arrival,
             'shared memory': occ['blocks'] * k['smem_unit'] * units / SMEM_BYTES_PER_CLK}
    return max(terms.values()), dict(w=w, nb=nb, n=n, hmma=hmma, nonhmma=nonhmma, arrival=arrival, units=units,
                                     limiter=max(terms, key=terms.get), terms=terms)


def bwd_main_ms(k, p, mem_latency_us, batch, heads, seq, causal, gpu=GPUS['H200']):
    """The main kernel: blocks (key block fastest, then head, then batch) taken greedily by the
    SMs' block slots; key block j walks the query tiles from the one holding its first key's
    diagonal (causal: floor(j Bc / Br)) to the last, each a full round (neither kernel skips
    warps in a tile); plus the forward's prologue per block and a launch."""
    occ = occupancy(gpu, k['regs'], k['smem'], k['warps'])
    rnd, parts = bwd_round(k, occ, p, mem_latency_us * gpu['clock_ghz'] * 1e3)
    nq, nk = -(-seq // k['br']), -(-seq // k['bc'])
    durs = [(nq - ((j * k['bc']) // k['br'] if causal else 0)) * rnd + p['prologue'] for j in range(nk)]
    slots = gpu['sms'] * occ['blocks']
    nblocks = batch * heads * nk
    makespan = greedy_makespan(durs, nblocks, slots)
    ms = makespan / (gpu['clock_ghz'] * 1e6) + LAUNCH_US / 1e3
    # HBM floor: Q, K, V, dO read, dK, dV written (2 B), LSE and D read (4 B per row), the dQ
    # accumulator read and written back once (4 B): far from binding here.
    rows = batch * heads * seq
    hbm_bytes = rows * k['d'] * 2 * 6 + rows * 8 + rows * k['d'] * 4 * 2
    ms = max(ms, hbm_bytes / (gpu['hbm_tbps'] * 1e12) * 1e3)
    pairs = seq * (seq + 1) / 2 if causal else seq * seq
    units = batch * heads * pairs / 4096.0
    return dict(ms=ms, occ=occ, waves=nblocks / slots, parts=parts, round=rnd,
                red_bytes=units * k['red_unit'], red_gbps=units * k['red_unit'] / (ms * 1e6))


def bwd_rows_kernel_ms(batch, heads, seq, d, gpu=GPUS['H200']):
    """The preprocess and the convert of either library (memattn's flash_bwd_pre / flash_bwd_dq,
    FA2's flash_bwd_dot_do_o_kernel / flash_bwd_convert_dq_kernel move the same bytes): HBM-bound
    streams, bytes over 4.8 TB/s plus a launch each. Preprocess: dO and O read, D written, the f32
    accumulator zeroed; convert: the accumulator read, dQ written."""
    rows = batch * heads * seq
    pre = rows * d * 2 * 2 + rows * 4 + rows * d * 4
    conv = rows * d * 4 + rows * d * 2
    bw = gpu['hbm_tbps'] * 1e12
    return dict(pre_ms=pre / bw * 1e3 + LAUNCH_US / 1e3, convert_ms=conv / bw * 1e3 + LAUNCH_US / 1e3,
                pre_bytes=pre, convert_bytes=conv)


def bwd_sdpa_accumulate_ms(batch, heads, seq, d, gpu=GPUS['H200']):
    """What the SDPA call bench_sdpa.py times adds to FA2's kernels: torch.autograd.backward
    accumulates into q.grad, k.grad and v.grad, which exist after the warm-up: three in-place adds
    (read two, write one, 2-byte elements) and their launches."""
    n = batch * heads * seq * d
    return 3 * (3 * n * 2 / (gpu['hbm_tbps'] * 1e12) * 1e3 + LAUNCH_US / 1e3)


def bwd_flops(batch, heads, seq, d, causal):
    """2.5 x the forward's FLOPs with the unmasked pairs of memattn's backward_flops and bench_sdpa.py
    (causal: seq (seq + 1) / 2 per head)."""
    pairs = seq * (seq + 1) // 2 if causal else seq * seq
    return 2.5 * 4.0 * batch * heads * d * pairs


def bwd_breakdown(k, p, mem_latency_us, gpu=GPUS['H200']):
    """One round of query tiles per 64 x 64 x d unit, SM cycles: tensor, issue, the unhidden part
    of the dependency chain, the unhidden Q/dO arrival, total."""
    occ = occupancy(gpu, k['regs'], k['smem'], k['warps'])
    rnd, q = bwd_round(k, occ, p, mem_latency_us * gpu['clock_ghz'] * 1e3)
    units = occ['blocks'] * q['units']
    tensor = occ['warps'] * q['hmma'] * p['hmma_cycles'] / SMSP / units
    issue = occ['warps'] * q['nonhmma'] / SMSP / units
    busy = q['n'] * q['w']
    imbalance = (busy - occ['warps'] * q['w'] / SMSP) / units
    exposed = max(0.0, rnd - busy)
    chain = min(exposed, p['latency'] / q['nb']) if q['limiter'].startswith('latency') else 0.0
    arrival = exposed - chain if q['limiter'].startswith('latency') else 0.0
    other = exposed - chain - arrival
    return dict(blocks_per_sm=occ['blocks'], warps_per_smsp=q['n'], tensor=tensor, issue=issue, imbalance=imbalance,
                latency=chain / units, arrival=arrival / units, shared_memory=other / units, total=rnd / units,
                limiter=q['limiter'])


def bwd_predict(k_ours, k_fa2, p, mem_latency_us, call_us, batch, heads, seq, d, causal):
    ours = bwd_main_ms(k_ours, p, mem_latency_us, batch, heads, seq, causal)
    fa2 = bwd_main_ms(k_fa2, p, mem_latency_us, batch, heads, seq, causal)
    rk = bwd_rows_kernel_ms(batch, heads, seq, d)
    side = rk['pre_ms'] + rk['convert_ms'] + call_us / 1e3
    ours_ms, fa2_ms = ours['ms'] + side, fa2['ms'] + side
    sdpa_ms = fa2_ms + bwd_sdpa_accumulate_ms(batch, heads, seq, d)
    return dict(ours=ours, fa2=fa2, rows=rk, ours_ms=ours_ms, fa2_ms=fa2_ms, sdpa_ms=sdpa_ms)


def bwd_per_row_instructions(d, bc):
    """Warp instructions per unit of memattn's backward that a query tile pays per query row, from
    the kernel's structure (flash_bwd_tc.rs): cp.async of Q and dO (16 B per lane), the LSE and D
    loads (4 rows x 2 per warp, both key halves' warps) and the dQ reductions (one red.f32 per
    element): (64 d / 128 + 32 + 64 d / 32) x 64 / Bc; their address arithmetic not counted."""
    return (64 * d * 2 * 2 // 16 // 32 + 32 + 64 * d // 32) * 64 // bc


def bwd_candidate(k, d):
    """The d128 tile the model is asked about: FA2's Br 64 x Bc 128 with the next tile's Q and dO
    overlapping dQ += dS K; the count per unit keeps today's, less the per-row instructions the
    larger key block halves. Shared memory (2 x 128 + 4 x 64) x 128 x 2 B = 128 KiB; registers 255
    (dK and dV of 128 keys take 128 per thread, as FA2's; whether ptxas fits them is the kernel's
    to show)."""
    nonhmma = k['nonhmma_unit'] - bwd_per_row_instructions(d, k['bc']) + bwd_per_row_instructions(d, 128)
    return dict(k, br=64, bc=128, regs=255, smem=(2 * 128 + 4 * 64) * d * 2, load_overlap=0.2, nonhmma_unit=nonhmma)


def bwd_break_even(k, f, p, dp, args):
    """The non-HMMA instructions per unit at which memattn's kernel, with the next tile's Q and dO
    overlapping dQ += dS K, matches FA2 (ratio 1.0): a bisection, to 1 instruction."""
    ratio = lambda x: (lambda r: r['fa2_ms'] / r['ours_ms'])(
        bwd_predict(dict(k, load_overlap=0.2, nonhmma_unit=x), f, p, dp['mem_latency_us'], dp['call_us'], *args))
    lo, hi = 0.0, float(k['nonhmma_unit'])
    if ratio(hi) >= 1.0:
        return k['nonhmma_unit']
    if ratio(lo) < 1.0:
        return None     # not by instructions alone: latency per unit (small tiles) keeps it below
    while hi - lo > 1.0:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) >= 1.0 else (lo, mid)
    return int(lo)


def bwd_candidate_entry(k, f, p, dp, args):
    c = bwd_candidate(k, args[3])
    r = bwd_predict(c, f, p, dp['mem_latency_us'], dp['call_us'], *args)
    occ = occupancy(GPUS['H200'], c['regs'], c['smem'], c['warps'])
    return dict(tile='%dx%d, %d warps, next Q/dO overlapping dQ' % (c['br'], c['bc'], c['warps']), registers=c['regs'],
                smem=c['smem'], blocks_per_sm=occ['blocks'], nonhmma_per_unit=c['nonhmma_unit'],
                memattn_ms=round(r['ours_ms'], 4), ratio=round(r['fa2_ms'] / r['ours_ms'], 3))


def bwd_entries(p, dp):
    """docs/perf/backward-model.json: one entry per shape (the forward table's 4096-token rows at d64
    and d128, causal and not; then d32 and the compact rows), memattn and FA2 predicted, measured null;
    each with the ratio for the change the model suggests (Q and dO of the next tile started before
    dQ += dS K, overlapping it)."""
    specs = bwd_specs()
    out = []
    shapes = [(d, c, 'flash_bwd_bf16_d%d' % d) for d, c in BWD_SHAPES]
    shapes += [(d, c, 'flash_bwd_bf16_d%d' % d) for d in BWD_EXTRA for c in (False, True)]
    shapes += [(d, c, 'flash_bwd_bf16_d%d_compact' % d) for d in (64, 128) for c in (False, True)]
    for d, causal, name in shapes:
        b, h, s = 4, 2048 // d, 4096
        k, f = specs[name], specs['fa2_bwd_d%d' % d]
        r = bwd_predict(k, f, p, dp['mem_latency_us'], dp['call_us'], b, h, s, d, causal)
        pre = bwd_predict(dict(k, load_overlap=0.2), f, p, dp['mem_latency_us'], dp['call_us'], b, h, s, d, causal)
        no_arrival = bwd_predict(k, f, p, 0.0, dp['call_us'], b, h, s, d, causal)
        # The backward's chain per tile (five GEMMs, two or three barriers) is longer than the
        # forward's that L was fitted on: the ratio with 2 L for both sides.
        long_chain = bwd_predict(k, f, dict(p, latency=2 * p['latency']), dp['mem_latency_us'], dp['call_us'], b, h, s, d, causal)
        fl = bwd_flops(b, h, s, d, causal)
        o, fa = r['ours'], r['fa2']
        out.append({
            'shape': 'bf16 %dx%dx%dx%d' % (b, h, s, d), 'causal': causal,
            'kernel': name, 'fa2_kernel': 'flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<%d, %d, %d, %d, ...>>' % (
                d, f['br'], f['bc'], f['warps']),
            'in_h200_table': name == 'flash_bwd_bf16_d%d' % d and d in (64, 128),
            'measured': None,
            'memattn_ms': round(r['ours_ms'], 4), 'fa2_ms': round(r['fa2_ms'], 4),
            'memattn_tflops': round(fl / r['ours_ms'] / 1e9, 1), 'fa2_tflops': round(fl / r['fa2_ms'] / 1e9, 1),
            'ratio': round(r['fa2_ms'] / r['ours_ms'], 3),
            'main_kernel_ms': {'memattn': round(o['ms'], 4), 'fa2': round(fa['ms'], 4)},
            'main_kernel_ratio': round(fa['ms'] / o['ms'], 3),
            'preprocess_ms': round(r['rows']['pre_ms'], 4), 'convert_ms': round(r['rows']['convert_ms'], 4),
            'call_us': dp['call_us'],
            'sdpa_call_ms': round(r['sdpa_ms'], 4), 'ratio_vs_sdpa_call': round(r['sdpa_ms'] / r['ours_ms'], 3),
            'memattn': {'tile': '%dx%d, %d warps' % (k['br'], k['bc'], k['warps']), 'registers': k['regs'],
                        'smem': k['smem'], 'blocks_per_sm': o['occ']['blocks'], 'warps_per_sm': o['occ']['warps'],
                        'occupancy_limit': o['occ']['limit'], 'waves': round(o['waves'], 2), 'limiter': o['parts']['limiter'],
                        'dq_reduction_gbps': round(o['red_gbps'])},
            'fa2': {'tile': '%dx%d, %d warps' % (f['br'], f['bc'], f['warps']), 'registers': f['regs'],
                    'smem': f['smem'], 'blocks_per_sm': fa['occ']['blocks'], 'warps_per_sm': fa['occ']['warps'],
                    'occupancy_limit': fa['occ']['limit'], 'waves': round(fa['waves'], 2), 'limiter': fa['parts']['limiter'],
                    'dq_reduction_gbps': round(fa['red_gbps'])},
            'ratio_if_next_qdo_overlaps_dq': round(pre['fa2_ms'] / pre['ours_ms'], 3),
            'ratio_without_qdo_arrival': round(no_arrival['fa2_ms'] / no_arrival['ours_ms'], 3),
            'ratio_with_twice_the_chain_latency': round(long_chain['fa2_ms'] / long_chain['ours_ms'], 3),
            'candidate': bwd_candidate_entry(k, f, p, dp, (b, h, s, d, causal)) if name == 'flash_bwd_bf16_d128' else None,
            'nonhmma_per_unit': {'memattn': k['nonhmma_unit'], 'fa2': f['nonhmma_unit'],
                                 'memattn_at_ratio_1_with_overlap': bwd_break_even(k, f, p, dp, (b, h, s, d, causal))},
        })
    return out


def bwd_claims(rows):
    main = [r for r in rows if r['in_h200_table']]
    return dict(at_or_above=sum(r['ratio'] >= 1.0 for r in main), below=sum(r['ratio'] < 1.0 for r in main),
                prefetch_at_or_above=sum(r['ratio_if_next_qdo_overlaps_dq'] >= 1.0 for r in main),
                candidate_at_or_above=sum(r['candidate']['ratio'] >= 1.0 for r in main if r['candidate']))


def print_backward(rows, p, dp):
    print('\nbackward (sm_80 main kernels + preprocess + convert), predicted from the forward calibration '
          '(c, L, P) and the decode\'s L0 = %.4f us; nothing measured' % dp['mem_latency_us'])
    print('  %-22s %-6s %-28s %9s %9s %7s %8s %8s %9s %9s %7s  %-34s %s' % (
        'shape', 'causal', 'memattn kernel', 'memattn', 'FA2', 'ratio', 'main', 'vs SDPA', 'overlap', 'no arr.', '2 L',
        'memattn tile, regs -> blocks/SM', 'limiter'))
    for r in rows:
        m = r['memattn']
        print('  %-22s %-6s %-28s %6.3f ms %6.3f ms %7.3f %8.3f %8.3f %9.3f %9.3f %7.3f  %-34s %s' % (
            r['shape'], r['causal'], r['kernel'], r['memattn_ms'], r['fa2_ms'], r['ratio'], r['main_kernel_ratio'],
            r['ratio_vs_sdpa_call'], r['ratio_if_next_qdo_overlaps_dq'], r['ratio_without_qdo_arrival'],
            r['ratio_with_twice_the_chain_latency'],
            '%s, %d -> %d' % (m['tile'], m['registers'], m['blocks_per_sm']), m['limiter']))
    print('  non-HMMA per unit memattn / FA2 / memattn at ratio 1.0 with the overlap: ' + '; '.join('%s%s %d / %d / %s' % (
        r['kernel'].replace('flash_bwd_bf16_', ''), ' causal' if r['causal'] else '', r['nonhmma_per_unit']['memattn'],
        r['nonhmma_per_unit']['fa2'], r['nonhmma_per_unit']['memattn_at_ratio_1_with_overlap'] or 'none') for r in rows))
    for r in rows:
        if r['candidate']:
            c = r['candidate']
            print('  candidate %s%s: %s, %d regs, %d B smem -> %d/SM, non-HMMA %d per unit: ratio %.3f' % (
                r['shape'], ' causal' if r['causal'] else '', c['tile'], c['registers'], c['smem'], c['blocks_per_sm'],
                c['nonhmma_per_unit'], c['ratio']))
    print('  TFLOP/s memattn / FA2: ' + '; '.join('d%d%s %.0f / %.0f' % (
        int(r['shape'].split('x')[-1]), ' causal' if r['causal'] else '', r['memattn_tflops'], r['fa2_tflops'])
        for r in rows if r['in_h200_table']))
    specs = bwd_specs()
    print('\n  what a round of query tiles costs per 64 x 64 x d unit, SM cycles (backward model):')
    print('  %-28s %9s %10s %7s %7s %10s %8s %8s %7s %7s' % ('kernel', 'blocks/SM', 'warps/SMSP', 'tensor', 'issue',
                                                            'imbalance', 'latency', 'arrival', 'smem', 'total'))
    for name in BWD_SASS:
        b = bwd_breakdown(specs[name], p, dp['mem_latency_us'])
        print('  %-28s %9d %10d %7.0f %7.0f %10.0f %8.0f %8.0f %7.0f %7.0f' % (
            name, b['blocks_per_sm'], b['warps_per_smsp'], b['tensor'], b['issue'], b['imbalance'], b['latency'],
            b['arrival'], b['shared_memory'], b['total']))


# ---- output, check, tables -----------------------------------------------------------------------
def build():
    specs = kernel_specs()
    cal = calibration(specs, kernel_specs(now=True))
    dp = decode_fit()
    return specs, cal, dp


def calibration_json(cal):
    rows = list(cal['rows'])
    extra = [dict(h, extra='Hopper forward (time-sm80/sm90 steps)') for h in cal['hopper']]
    return rows + extra


def dumps(obj):
    return json.dumps(obj, indent=1, sort_keys=False) + '\n'


def same(a, b, tol=1e-3):
    """Equal up to float formatting: numbers within a relative 1e-3, everything else exactly."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], tol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= tol * max(abs(a), abs(b), 1e-9)
    return a == b


def hits(cal_rows):
    main = [r for r in cal_rows if 'extra' not in r]
    allhit = sum(within(r['predicted'], r['measured']) for r in main)
    held = [r for r in main if r['held_out']]
    heldhit = sum(within(r['predicted_split_fit'], r['measured']) for r in held)
    return allhit, len(main), heldhit, len(held)


def print_tables(cal, cal_rows, dec_rows, dp):
    print('prefill: memattn / FA2 speed ratio on the H200, model vs measured')
    print('parameters (all rows): %s' % cal['params_all'])
    print('parameters (fit on d %s): %s' % ('/'.join(map(str, FIT_DIMS)), cal['params_split']))
    pa, ghz = cal['params_all'], GPUS['H200']['clock_ghz']
    print('  that is: mma.sync %.0f FLOP/clk/SM (%.2f of the wgmma rate, %.0f), L = %.2f us, P = %.2f us per block' % (
        SMSP * MMA_FLOP / pa['hmma_cycles'], SMSP * MMA_FLOP / pa['hmma_cycles'] / GPUS['H200']['tc_flop_per_clk_sm'],
        GPUS['H200']['tc_flop_per_clk_sm'], pa['latency'] / ghz / 1e3, pa['prologue'] / ghz / 1e3))
    print('%-24s %-6s %8s %9s %6s %9s %6s  %-17s %-17s' % ('shape', 'causal', 'measured', 'predicted', 'hit',
          'held-out', 'hit', 'memattn TFLOP/s', 'FA2 TFLOP/s'))
    for r in cal_rows:
        if 'extra' in r:
            continue
        ho = '%.3f' % r['predicted_split_fit'] if r['held_out'] else '(fit)'
        hh = ('yes' if within(r['predicted_split_fit'], r['measured']) else 'NO') if r['held_out'] else ''
        print('%-24s %-6s %8.3f %9.3f %6s %9s %6s  %6.1f / %-8.1f %6.1f / %-8.1f' % (
            r['shape'], r['causal'], r['measured'], r['predicted'], 'yes' if within(r['predicted'], r['measured']) else 'NO',
            ho, hh, r['memattn_tflops']['measured'], r['memattn_tflops']['predicted'],
            r['fa2_tflops']['measured'], r['fa2_tflops']['predicted']))
    a, n, h, hn = hits(cal_rows)
    print('within 15 %%: %d of %d (all-rows fit); held-out: %d of %d (split fit)' % (a, n, h, hn))
    main_rows = [r for r in cal_rows if 'extra' not in r]
    for side in ('memattn', 'fa2'):
        errs = [r[side + '_tflops']['predicted'] / r[side + '_tflops']['measured'] - 1 for r in main_rows]
        print('absolute %s TFLOP/s: %d of %d within 15 %%, worst %+.0f %%' % (
            side, sum(abs(e) <= 0.15 for e in errs), len(errs), 100 * max(errs, key=abs)))
    print('\nnow: memattn / FA2 predicted for the sm_80 forward as tiles.rs and ptxas-report.json have it today '
          '(all-rows parameters; nothing measured)')
    print('%-24s %-6s %8s %13s %13s  %-34s %4s %9s' % ('shape', 'causal', 'measured', 'predicted run', 'predicted now',
                                                    'tile now', 'regs', 'blocks/SM'))
    for r in main_rows:
        n = r['memattn_now']
        print('%-24s %-6s %8.3f %13.3f %13.3f  %-34s %4d %9d' % (r['shape'], r['causal'], r['measured'], r['predicted'],
              r['predicted_now'], n['tile'], n['registers'], n['blocks_per_sm']))
    print('\nHopper forward, sm90 / sm80 speed on the same shape (causal):')
    for r in cal_rows:
        if 'extra' in r:
            print('  %-22s measured %.3f predicted %.3f (%s)  sm90 %.3f ms measured, %.3f predicted; limiter %s' % (
                r['shape'], r['measured'], r['predicted'], 'hit' if within(r['predicted'], r['measured']) else 'miss',
                r['sm90_ms']['measured'], r['sm90_ms']['predicted'], r['sm90']['limiter']))
    print('\ndecode: parameters %s' % dp)
    for r in dec_rows:
        if r['measured_gbps'] is None:
            print('  %-72s %-26s regs %3d  now: predicted %5d GB/s' % (r['shape'], r['kernel'], r['registers'], r['predicted_gbps']))
        else:
            print('  %-72s %-26s measured %5d GB/s predicted %5d (%s)' % (
                r['shape'], r['kernel'], r['measured_gbps'], r['predicted_gbps'],
                'hit' if within(r['predicted_gbps'], r['measured_gbps']) else 'miss'))
    dm = [r for r in dec_rows if r['measured_gbps'] is not None]
    print('  decode within 15 %%: %d of %d' % (sum(within(r['predicted_gbps'], r['measured_gbps']) for r in dm), len(dm)))


def breakdown(k, p, gpu=GPUS['H200']):
    """A full round of key tiles split into what it costs, per 64 x 64 x d unit of work, in SM cycles:
    the SMSPs' work spread evenly, what uneven warps per SMSP add (6 warps on 4 SMSPs), and the
    latency the resident warps do not hide."""
    occ = occupancy(gpu, k['regs'], k['smem'], k['warps'])
    w = warp_tile_work(k, p)
    nb = -(-k['warps'] // SMSP)
    n = nb * occ['blocks']
    rnd = round_cycles(k, occ, p)
    units = occ['blocks'] * k['br'] * k['bc'] / 4096.0
    even = occ['warps'] * w['busy'] / SMSP
    return dict(blocks_per_sm=occ['blocks'], warps_per_smsp=n, tensor=occ['warps'] * w['tensor'] / SMSP / units,
                issue=occ['warps'] * w['issue'] / SMSP / units, imbalance=(n * w['busy'] - even) / units,
                latency=max(0.0, rnd - n * w['busy']) / units, total=rnd / units)


def print_advice(specs, p, dp):
    """The model's advice, as tables (docs/perf/README.md quotes them)."""
    print('\nwhat a round of key tiles costs per 64 x 64 x d unit, SM cycles (model, all-rows parameters):')
    print('  %-4s %-8s %9s %10s %7s %7s %10s %8s %7s' % ('d', 'kernel', 'blocks/SM', 'warps/SMSP', 'tensor', 'issue',
                                                     'imbalance', 'latency', 'total'))
    for d in sorted(SASS_NONHMMA_PER_UNIT):
        for side in ('memattn', 'fa2'):
            b = breakdown(specs[(side, d)], p)
            print('  %-4d %-8s %9d %10d %7.0f %7.0f %10.0f %8.0f %7.0f' % (d, side, b['blocks_per_sm'], b['warps_per_smsp'],
                  b['tensor'], b['issue'], b['imbalance'], b['latency'], b['total']))
    print('\nprefill advice: memattn/FA2 at 4 x (2048/d) x 4096, non-causal / causal (model)')
    print('  %-4s %-34s %-13s | %s' % ('d', 'as run: Br x Bc, warps, regs -> blocks/SM', 'ratio', 'best candidates (Br x Bc, warps x rows, q-steps in regs, regs budget [floor] -> blocks/SM: ratio)'))
    for e in tile_advice(specs, p):
        c = e['current']
        cands = '; '.join('%dx%d, %dx%d, q%d, %d [%d] -> %d: %.2f / %.2f' % (
            x['br'], x['bc'], x['warps'], x['rows_per_warp'], x['q_reg_ksteps'], x['regs'], x['register_floor'],
            x['blocks_per_sm'], x['ratio'], x['ratio_causal']) for x in e['candidates'][:3])
        print('  %-4d %-34s %.2f / %.2f  | %s' % (e['d'], '%dx%d, %d, %d -> %d (%d warps)' % (
            c['br'], c['bc'], c['warps'], c['regs'], c['blocks_per_sm'], c['warps_per_sm']),
            c['ratio'], c['ratio_causal'], cands))
    adv = decode_advice(dp)
    print('\ndecode advice (decode_mma_bf16_d128 at today\'s registers; model):')
    for key, v in adv['littles_law'].items():
        print('  %s: %d GB/s needs %d bytes in flight per SM at the loaded latency %.3f us; the whole call '
              'must take <= %.1f us, of which the fixed per-call cost is %.1f us' % (
                  key, v['target_gbps'], v['bytes_in_flight_per_sm'], v['loaded_latency_us'], v['time_budget_us'],
                  v['call_us']))
    print('  %-22s %6s %6s %4s %6s %8s %9s %8s %7s %7s' % ('shape', 'splits', 'stages', 'Bc', 'fused', 'GB/s', 'B/SM', 'kernel', 'merge', 'total'))
    seen = set()
    for r in adv['sweep']:
        key = (r['batch'], r['splits'], r['stages'], r['bc'], r['fused_merge'])
        interesting = (r['stages'], r['bc'], r['fused_merge']) in ((1, 64, False), (2, 64, False), (1, 128, False), (2, 64, True))
        if key in seen or not interesting or r['splits'] not in (2, 4, 8, 16, 32):
            continue
        seen.add(key)
        print('  %-22s %6d %6d %4d %6s %8d %9d %8.1f %7.1f %7.1f%s' % (
            'batch %d cache %d' % (r['batch'], r['cache']), r['splits'], r['stages'], r['bc'], r['fused_merge'],
            r['predicted_gbps'], r['bytes_in_flight_per_sm'], r['kernel_us'], r['merge_us'], r['total_us'],
            '  >= target' if r['reaches'] else ''))


def main(argv):
    if '--pin-run' in argv:
        doc = pin_run_kernels(argv[argv.index('--pin-run') + 1])
        print('wrote %s (commit %s)' % (os.path.relpath(RUN_KERNELS, ROOT), doc['commit']))
        return 0
    check = '--check' in argv
    specs, cal, dp = build()
    cal_rows = calibration_json(cal)
    dec_rows = decode_entries(dp)
    cal_doc = dict(params_all=cal['params_all'], params_split=cal['params_split'], fit_dims=list(FIT_DIMS))
    bwd_rows = bwd_entries(cal['params_all'], dp)
    files = {CALIBRATION: cal_rows, DECODE_MODEL: dec_rows, BACKWARD_MODEL: bwd_rows}
    print_tables(cal, cal_rows, dec_rows, dp)
    print_advice(specs, cal['params_all'], dp)
    print_backward(bwd_rows, cal['params_all'], dp)
    a, n, h, hn = hits(cal_rows)
    ok = True
    if a < 18 or h < math.ceil(0.9 * hn):
        print('FAIL: the targets (>= 18 of 21 within 15 %%, held-out >= 90 %%) do not hold: %d of %d, %d of %d' % (a, n, h, hn))
        ok = False
    dm = [r for r in dec_rows if r['measured_gbps'] is not None]
    dh = sum(within(r['predicted_gbps'], r['measured_gbps']) for r in dm)
    hop = sum(within(r['predicted'], r['measured']) for r in cal_rows if 'extra' in r)
    if dh < DECODE_CLAIM or hop < HOPPER_CLAIM:
        print('FAIL: what docs/perf/README.md claims does not hold: decode %d of %d within 15 %% (claimed %d), '
              'Hopper %d of 3 (claimed %d)' % (dh, len(dm), DECODE_CLAIM, hop, HOPPER_CLAIM))
        ok = False
    bc = bwd_claims(bwd_rows)
    if bc != BWD_CLAIM:
        print('FAIL: what docs/perf/README.md claims of the backward does not hold: %s (claimed %s)' % (bc, BWD_CLAIM))
        ok = False
    if not check:
        os.makedirs(os.path.dirname(CALIBRATION), exist_ok=True)
        for path, obj in files.items():
            open(path, 'w').write(dumps(obj))
        print('\nwrote %s (%s)' % (', '.join(os.path.relpath(f, ROOT) for f in files), cal_doc))
        return 0 if ok else 1
    for path, obj in files.items():
        try:
            committed = json.load(open(path))
        except (OSError, ValueError) as e:
            print('FAIL: %s: %s' % (os.path.relpath(path, ROOT), e))
            ok = False
            continue
        if not same(committed, json.loads(dumps(obj))):
            print('FAIL: %s differs from what the model gives now (run python3 scripts/perf_model.py)' % os.path.relpath(path, ROOT))
            ok = False
    print('\nperf_model --check: %s' % ('ok' if ok else 'FAILED'))
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
