#!/usr/bin/env bash
# sass-compare.sh: static SASS comparison of memattn's tensor-core flash forward kernels (and with BWD=1
# the backward's main kernels) against the FlashAttention-2 kernels that PyTorch's SDPA flash backend runs
# (compiled into libtorch_cuda.so); with SM90=1 also memattn's Hopper (sm_90a, wgmma) forward against
# FlashAttention-3's forward kernels (the fa3-fwd wheel).
# No GPU needed: it assembles our PTX with ptxas, pulls FA2's sm_80/sm_90 cubins out of the torch wheel
# with cuobjdump, disassembles both, finds each kernel's K/V main loop (the back edge with the most HMMA)
# and counts instructions per loop iteration.
#
# usage: scripts/sass-compare.sh [PROJECT_DIR]   (default: the current directory, a memattn checkout)
#   Reads PROJECT_DIR/kernels-gpu/ptx/memattn_kernels.ptx, .../ptxas-report.json and our tiles from
#   `memattn --json kernels` (MEMATTN_BIN; else PROJECT_DIR/target/{release,debug}/memattn if built; else
#   the struct literals of kernels-gpu/src/tiles.rs); writes nothing there.
# environment (all optional):
#   MEMATTN_SASS_CACHE  download/cache folder           (default ~/.cache/memattn-sass)
#   SASS_OUT            report folder                   (default $MEMATTN_SASS_CACHE/report)
#   CUDA_TOOLS_VERSION  nvidia-cuda-nvcc / nvidia-cuda-cuobjdump wheel version (default 13.5.37)
#   TORCH_SPEC          pip requirement of the torch wheel (default torch==2.15.0, the one studied first;
#                       any Linux x86_64 CUDA build works if its FA2 template names are unchanged)
#   KEEP_TORCH_WHEEL=1  keep the ~0.5 GB wheel after libtorch_cuda.so is extracted
#   ARCHS="80 90"  DIMS="128 64 32 96 192 256"  OURS_PTX=path  OURS_KERNEL=flash_fwd_bf16_d%d
#   MEMATTN_BIN=path    the memattn binary whose `--json kernels` gives our tiles
#   OURS_TILES="128:64,64,4 ..."  (d:br,bc,warps) overrides both
#   FA2_TILE_<d>="kBlockM kBlockN kNWarps": the tile torch picks on A100/H100, non-dropout (run_mha_fwd_hdim<d>
#                       in FA2's flash_fwd_launch_template.h; sm8x consumer parts pick others). Defaults:
#                       d32 "128 128 4", d64 "128 128 4", d96 "128 64 4", d128 "128 64 4", d192 "128 64 8",
#                       d256 "128 64 8" (its smem test passes on A100/H100).
#   BWD=1               also the backward, as a second section of report.md / report.json (bwd_notes, bwd_rows,
#                       bwd_summary); BWD=only: the backward alone. Unset / 0: the forward alone, as before.
#                       Ours: OURS_BWD_KERNEL=flash_bwd_bf16_d%d, BWD_DIMS="64 128 32", tiles from the
#                       FLASH_BWD_TC_D<d> literals of tiles.rs (Br 128, 8 warps, Bc from the tile) where they exist,
#                       else FLASH_BWD_MMA_D<d> (Bc = 16 warps / kv_splits); OURS_BWD_TILES="64:128,8,128" =
#                       d:br,warps[,bc] overrides (Bc defaults to 16 warps). Compact rows: OURS_BWD_KERNEL=
#                       flash_bwd_bf16_d%d_compact with OURS_BWD_TILES="64:32,4 128:32,8,64".
#                       FA2: flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel, noncausal and causal evenMN, with the
#                       Flash_bwd_kernel_traits run_mha_bwd_hdim<d> picks on A100/H100 without dropout
#                       (flash_bwd_launch_template.h, >= 144 KB opt-in smem), the template arguments of the mangled
#                       names: FA2_BWD_TILE_<d>="kBlockM kBlockN kNWarps AtomLayoutMSdP AtomLayoutNdKV AtomLayoutMdQ
#                       Is_V_in_regs", defaults d32 "128 128 8 4 4 4 1", d64 "128 128 8 4 4 4 0", d128 "64 128 8 2 4 2 0".
#                       Main loop: the query-tile (m-block) loop of one key block; unit: 64 queries x 64 keys x d of
#                       the five GEMMs; ours' steady tile skips its mask block, "masked" takes it (vs FA2 causal).
#                       Measured (torch 2.15.0, ptxas 13.5, model FA2 cycles / ours, >= 1: ours at least as fast),
#                       A100 / H100: d32 0.84 / 0.84, d64 0.67 / 0.67, d128 0.70 / 0.70 (ours smem-bound).
#   FWD=0               leave out the forward section (default 1: as before). With FWD=0 and BWD unset / 0, no torch wheel
#                       is fetched.
#   SM90=1              also the Hopper section, after the others (report.md "# Hopper", report.json sm90_notes / sm90_rows /
#                       sm90_summary); SM90=only (= SM90=1 FWD=0 BWD=0): the Hopper section alone, no torch wheel.
#                       Ours: OURS_SM90_PTX (default PROJECT/kernels-gpu/ptx/memattn_kernels_sm90.ptx) through ptxas -arch=
#                       its .target (sm_90a), entries OURS_SM90_KERNEL=flash_fwd_bf16_sm90_d%d for SM90_DIMS="64 128 256",
#                       tiles from the PTX's memattn_tile_<entry> records (threads, Br, Bc, smem, d).
#                       FA3: FA3_SPEC (default fa3-fwd==0.0.3, a forward-only FlashAttention-3 build) from PyPI, its
#                       fa3_fwd/_C.abi3.so; the FlashAttnFwdSm90 kernels for bf16, head dim d (= d_v), none of causal /
#                       local / softcap / varlen / paged / appendkv / qv / packgqa / split, matched on the template
#                       arguments of the demangled names (needs c++filt); FA3_CLUSTER=1 (or 2) picks the cluster shape
#                       compared (both are reported at d >= 128).
#                       Main loop: the consumer warpgroups' key-tile loop (innermost loop with HGMMA), steady path as
#                       explained in the report; pipe model per SM per 128 x 128 block of S, H100 SXM5 rates (assumptions
#                       listed in the report). Measured (ptxas 13.5, fa3-fwd 0.0.3, cluster 1x1; FA3 / ours, >= 1: ours at
#                       least as fast): d64 0.86 (ours issue-bound, FA3 mufu-bound), d128 1.00, d256 1.00 (all tensor-bound).
# output: $SASS_OUT/report.md (tables), report.json, sass/*.sass (the disassembly it measured).
# Counts in the tables are measured from the SASS; the "pipe model" section is an assumption-based bound.
set -euo pipefail
PROJECT=$(cd "${1:-.}" && pwd)
CACHE=${MEMATTN_SASS_CACHE:-$HOME/.cache/memattn-sass}
OUT=${SASS_OUT:-$CACHE/report}
VER=${CUDA_TOOLS_VERSION:-13.5.37}
TORCH_SPEC=${TORCH_SPEC:-torch==2.15.0}
mkdir -p "$CACHE" "$OUT/sass"
log() { echo "sass-compare: $*" >&2; }

# --- tools: ptxas (nvcc wheel), cuobjdump and nvdisasm (cuobjdump -sass runs it), from PyPI wheels
TOOLS="$CACHE/cuda-tools-$VER"
find_tool() { find "$TOOLS" -type f -path "*/bin/$1" 2>/dev/null | head -1; }
for pkg in nvidia-cuda-nvcc:ptxas nvidia-cuda-cuobjdump:cuobjdump nvidia-cuda-nvdisasm:nvdisasm; do
  name=${pkg%%:*}; bin=${pkg##*:}
  if [ -z "$(find_tool "$bin")" ]; then
    log "downloading $name==$VER"
    mkdir -p "$TOOLS/whl"
    python3 -m pip download -q --no-deps "$name==$VER" -d "$TOOLS/whl"
    whl=$(ls "$TOOLS"/whl/"${name//-/_}"-"$VER"-*.whl | head -1)
    (cd "$TOOLS" && unzip -q -o "$whl" "*/bin/$bin")
    rm -f "$whl"
  fi
  chmod +x "$(find_tool "$bin")"
done
PTXAS=$(find_tool ptxas); CUOBJDUMP=$(find_tool cuobjdump)
PATH="$(dirname "$(find_tool nvdisasm)"):$PATH"; export PATH
command -v c++filt >/dev/null || log "c++filt not found: FA2 names stay mangled"

# --- which sections run: FWD (default 1), BWD (0 / 1 / only), SM90 (0 / 1 / only)
FWD=${FWD:-1} BWD=${BWD:-0} SM90=${SM90:-0}
if [ "$SM90" = only ]; then FWD=0; BWD=0; fi
NEED_TORCH=0
if { [ "$FWD" != 0 ] && [ "$BWD" != only ]; } || [ "$BWD" = 1 ] || [ "$BWD" = only ]; then NEED_TORCH=1; fi

# --- torch: libtorch_cuda.so out of the wheel (only that member), cached per TORCH_SPEC
TKEY=$(printf '%s' "$TORCH_SPEC" | tr -c 'A-Za-z0-9._-' '_')
TDIR="$CACHE/torch-$TKEY"
LIB="$TDIR/torch/lib/libtorch_cuda.so"
if [ "$NEED_TORCH" = 1 ] && [ ! -s "$LIB" ]; then
  log "downloading $TORCH_SPEC (large)"
  mkdir -p "$TDIR/whl"
  python3 -m pip download -q --no-deps --only-binary=:all: "$TORCH_SPEC" -d "$TDIR/whl"
  whl=$(ls "$TDIR"/whl/torch-*.whl | head -1)
  (cd "$TDIR" && unzip -q -o "$whl" 'torch/lib/libtorch_cuda.so' 'torch/version.py')
  [ "${KEEP_TORCH_WHEEL:-0}" = 1 ] || rm -f "$whl"
fi
if [ "$NEED_TORCH" = 1 ] && [ ! -s "$TDIR/resusage.txt" ]; then
  log "indexing cubins of libtorch_cuda.so"
  "$CUOBJDUMP" -lelf "$LIB" > "$TDIR/lelf.txt"
  "$CUOBJDUMP" -res-usage "$LIB" > "$TDIR/resusage.tmp" && mv "$TDIR/resusage.tmp" "$TDIR/resusage.txt"
fi

# --- FA3 (SM90): the fa3-fwd wheel's extension module (its only .so), cached per FA3_SPEC
FA3_SPEC=${FA3_SPEC:-fa3-fwd==0.0.3}
F3DIR="$CACHE/fa3-$(printf '%s' "$FA3_SPEC" | tr -c 'A-Za-z0-9._-' '_')"
find_f3lib() { [ -d "$F3DIR" ] || return 0; find "$F3DIR" -path "$F3DIR/whl" -prune -o -type f -name '*.so' -print | head -1; }
F3LIB=""
if [ "$SM90" != 0 ]; then
  F3LIB=$(find_f3lib)
  if [ -z "$F3LIB" ]; then
    log "downloading $FA3_SPEC"
    mkdir -p "$F3DIR/whl"
    if python3 -m pip download -q --no-deps --only-binary=:all: "$FA3_SPEC" -d "$F3DIR/whl"; then
      whl=$(ls "$F3DIR"/whl/*.whl | head -1)
      (cd "$F3DIR" && unzip -q -o "$whl" '*.so' '*.dist-info/METADATA')
      rm -f "$whl"
      F3LIB=$(find_f3lib)
    else
      log "could not download $FA3_SPEC: the Hopper section reports memattn alone"
    fi
  fi
  if [ -n "$F3LIB" ] && [ ! -s "$F3DIR/resusage.txt" ]; then
    log "indexing cubins of $(basename "$F3LIB")"
    "$CUOBJDUMP" -lelf "$F3LIB" > "$F3DIR/lelf.txt"
    "$CUOBJDUMP" -res-usage "$F3LIB" > "$F3DIR/resusage.tmp" && mv "$F3DIR/resusage.tmp" "$F3DIR/resusage.txt"
  fi
fi

export PROJECT CACHE OUT PTXAS CUOBJDUMP LIB TDIR TORCH_SPEC FWD SM90 FA3_SPEC F3DIR F3LIB
export OURS_SM90_PTX=${OURS_SM90_PTX:-$PROJECT/kernels-gpu/ptx/memattn_kernels_sm90.ptx}
export OURS_SM90_KERNEL=${OURS_SM90_KERNEL:-flash_fwd_bf16_sm90_d%d} SM90_DIMS=${SM90_DIMS:-64 128 256}
export ARCHS=${ARCHS:-80 90} DIMS=${DIMS:-128 64 32 96 192 256}
export OURS_PTX=${OURS_PTX:-$PROJECT/kernels-gpu/ptx/memattn_kernels.ptx}
export OURS_KERNEL=${OURS_KERNEL:-flash_fwd_bf16_d%d}
export OURS_BWD_KERNEL=${OURS_BWD_KERNEL:-flash_bwd_bf16_d%d} BWD=${BWD:-0}
if [ -z "${MEMATTN_BIN:-}" ]; then
  for b in "$PROJECT/target/release/memattn" "$PROJECT/target/debug/memattn"; do
    if [ -x "$b" ]; then MEMATTN_BIN=$b; break; fi
  done
fi
[ -n "${MEMATTN_BIN:-}" ] && export MEMATTN_BIN
exec python3 - <<'PY'
import collections, json, re, sys

INSN = re.compile(r'^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*/\*\s*0x[0-9a-f]+\s*\*/\s*$')
CTL = ('BRA', 'CALL', 'EXIT', 'RET', 'BSSY', 'BSYNC', 'WARPSYNC', 'JMP', 'BREAK', 'BRX', 'JMX', 'YIELD')

def parse(path):
    ins = []
    for line in open(path):
        m = INSN.match(line)
        if not m:
            continue
        text = m.group(2).strip().rstrip(';').strip()
        pred = None
        pm = re.match(r'^(@!?U?P[0-9T]+)\s+(.*)$', text)
        if pm:
            pred, text = pm.group(1), pm.group(2)
        op = text.split()[0]
        base = op.split('.')[0]
        tgt = None
        if base in ('BRA', 'CALL', 'BSSY', 'JMP'):
            t = re.findall(r'0x([0-9a-f]+)', text)
            if t:
                tgt = int(t[-1], 16)
        ins.append(dict(addr=int(m.group(1), 16), pred=pred, op=op, base=base, text=text, tgt=tgt))
    # drop the trailing self-branch and NOP padding
    while ins and (ins[-1]['base'] == 'NOP' or (ins[-1]['base'] == 'BRA' and ins[-1]['tgt'] == ins[-1]['addr'])):
        ins.pop()
    # A subroutine call: `MOV Rn, <address of the instruction after the CALL>` shortly before a
    # `CALL.REL.NOINC`, and a `RET.REL.NODEC` in the function (the callee may return through
    # another register it copied Rn to). Control comes back to the next instruction, so the call is
    # an instruction with fall-through (ptxas calls slow paths such as IEEE division this way,
    # unpredicated, inside the main loop), not a jump.
    has_ret = any(i['op'].startswith('RET.REL') for i in ins)
    for k, i in enumerate(ins):
        if i['base'] == 'CALL' and k + 1 < len(ins):
            nxt = ins[k + 1]['addr']
            for j in range(max(0, k - 8), k):
                m = re.match(r'^(?:IMAD\.)?MOV(?:\.U32)? (R\d+), (?:RZ, RZ, )?0x([0-9a-f]+)$', ins[j]['text'])
                if m and int(m.group(2), 16) == nxt and has_ret:
                    i['returns'] = True
    return ins

COLS = ['HMMA', 'LDSM', 'LDSM.T', 'LDGSTS', 'LDG', 'STG', 'LDS', 'LDS(dummy)', 'STS', 'LDL', 'STL',
        'MUFU.EX2', 'MUFU(other)', 'FFMA', 'FMUL', 'FMUL(pred)', 'FADD', 'FMNMX', 'FSETP', 'FSEL', 'F2FP',
        'SHFL', 'BAR', 'DEPBAR', 'ISETP', 'SEL', 'IMAD', 'IADD3', 'LEA', 'LOP3', 'SHF', 'MOV', 'uniform',
        'branch/ctl', 'other']

def cls(i):
    b, op = i['base'], i['op']
    if b == 'LDSM':
        return 'LDSM.T' if 'MT88' in op or '.T' in op.split('LDSM')[1][:3] else 'LDSM'
    if b == 'LDS' and i['pred'] == '@!PT':
        return 'LDS(dummy)'
    if b == 'MUFU':
        return 'MUFU.EX2' if op.startswith('MUFU.EX2') else 'MUFU(other)'
    if b == 'FMUL' and i['pred']:
        return 'FMUL(pred)'
    if b in CTL:
        return 'branch/ctl'
    if b in ('IMAD', 'IMAD.MOV', 'IMAD.WIDE', 'IMAD.IADD', 'IMAD.SHL', 'IMAD.X', 'IMAD.U32'):
        return 'IMAD'
    if b in ('VIADD',):
        return 'IADD3'
    if b in ('LDGDEPBAR',):
        return 'DEPBAR'
    if b in COLS:
        return b
    if b.startswith('U') or b in ('S2UR', 'R2UR'):
        return 'uniform'
    return 'other'

def hist(seq):
    return collections.Counter(cls(i) for i in seq)

def ldgsts_moving(bb):
    # LDGSTS of one basic block that can move data in one pass: ptxas if-converts "copy every row /
    # copy with row checks" into two sets of copies under @P and @!P of the same predicate, of which
    # one set runs. Unguarded copies count once; a guarded pair counts its larger side.
    n, by = 0, collections.Counter()
    for i in bb:
        if i['base'] == 'LDGSTS':
            if i['pred']:
                by[(i['pred'].lstrip('@!'), i['pred'].startswith('@!'))] += 1
            else:
                n += 1
    return n + sum(max(by[(r, False)], by[(r, True)]) for r in {r for r, _ in by})

def basic_blocks(ins):
    addrs = [i['addr'] for i in ins]
    pos = {a: k for k, a in enumerate(addrs)}
    leaders = {addrs[0]}
    for k, i in enumerate(ins):
        if i['base'] in ('BRA', 'CALL', 'JMP') and i['tgt'] in pos:
            leaders.add(i['tgt'])
        if i['base'] in ('BRA', 'CALL', 'JMP', 'EXIT', 'RET', 'BRX', 'JMX') and k + 1 < len(ins):
            leaders.add(addrs[k + 1])
    bbs, cur = [], []
    for i in ins:
        if i['addr'] in leaders and cur:
            bbs.append(cur)
            cur = []
        cur.append(i)
    if cur:
        bbs.append(cur)
    start = {bb[0]['addr']: n for n, bb in enumerate(bbs)}
    succ = []
    for n, bb in enumerate(bbs):
        last = bb[-1]
        s = []
        fall = n + 1 if n + 1 < len(bbs) else None
        b = last['base']
        if b == 'CALL' and last.get('returns'):
            if fall is not None:  # a subroutine call: comes back to the next instruction
                s.append(fall)
        elif b in ('BRA', 'JMP', 'CALL') and last['tgt'] in start:
            s.append(start[last['tgt']])
            if last['pred'] or b == 'CALL':  # CALL.REL.NOINC used as a (conditional) loop exit
                if fall is not None and not (b == 'CALL' and not last['pred']):
                    s.append(fall)
        elif b in ('EXIT', 'RET'):
            if last['pred'] and fall is not None:
                s.append(fall)
        elif fall is not None:
            s.append(fall)
        succ.append(s)
    return bbs, succ

def is_mask_block(bb):
    n_inf = sum(1 for i in bb if i['base'] == 'FSEL' and '-INF' in i['text'])
    return not any(i['base'] in ('HMMA', 'LDSM') for i in bb) and n_inf >= max(4, len(bb) // 4)

def is_rescale_block(bb):
    # memattn's lazy O rescale: a block of FMULs (O *= alpha) with the four ex2 of the alphas,
    # branched around on a warp vote when no row's max grew by more than 2^8 (FA4's conditional
    # rescaling). FA2 rescales O in every tile, inside its straight-line loop body.
    n_fmul = sum(1 for i in bb if i['base'] == 'FMUL')
    return (not any(i['base'] in ('HMMA', 'LDSM', 'LDGSTS') for i in bb) and n_fmul >= 32
            and n_fmul >= 0.6 * len(bb) and any(i['base'] == 'MUFU' for i in bb))

def is_rare_block(bb):
    # An IEEE division with its slow-path subroutine call (FCHK, CALL): in memattn's loop only the
    # soft cap's tanh divides, a branch taken only with --softcap, so the steady path avoids it.
    return any(i['base'] == 'FCHK' or (i['base'] == 'CALL' and i.get('returns')) for i in bb)

def dominators(succ, n):
    preds = [[] for _ in range(n)]
    for a, s in enumerate(succ):
        for b in s:
            preds[b].append(a)
    full = set(range(n))
    dom = [full] * n
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for b in range(1, n):
            ps = [dom[p] for p in preds[b]]
            d = (set.intersection(*ps) if ps else set()) | {b}
            if d != dom[b]:
                dom[b] = d
                changed = True
    return dom, preds

def main_loop(ins, is_mask=is_mask_block, hist=hist, keep_seq=False):
    # is_mask: which blocks the steady path skips (the forward's -inf masking blocks by default);
    # hist: the opcode classes; keep_seq: also return the steady path's instructions.
    bbs, succ = basic_blocks(ins)
    dom, preds = dominators(succ, len(bbs))
    pred = preds
    best = None
    for n, s in enumerate(succ):
        for h in s:
            if h in dom[n]:  # back edge n -> h (h dominates n)
                body, stack = {h, n}, [n]
                while stack:
                    x = stack.pop()
                    if x == h:
                        continue
                    for p in pred[x]:
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                hm = sum(1 for b in body for i in bbs[b] if i['base'] == 'HMMA')
                # most HMMA first; among equals the smallest body in instructions (not in basic
                # blocks): a kernel that peels its masked tiles into a loop of their own is
                # measured on its steady-state loop, as FA2 (which unrolls its masked steps before
                # the loop) is, and of two loops with equal HMMA (ours with and without the soft
                # cap) the one without.
                key = (hm, -sum(len(bbs[b]) for b in body))
                if best is None or key > best[0]:
                    best = (key, h, n, body)
    if best is None:
        return None
    _, h, tail, body = best
    # Longest / shortest / steady (max minus masking blocks) path from header to tail inside the body, DAG
    # (the back edge removed; inner back edges, if any, are ignored).
    order = sorted(body, key=lambda b: bbs[b][0]['addr'])
    def skipped(b, skip_mask, skip_rescale):
        return (skip_mask and is_mask(bbs[b])) or (skip_rescale and is_rescale_block(bbs[b]))
    def cost(b, skip_mask, skip_rescale=False):
        return 0 if skipped(b, skip_mask, skip_rescale) else len(bbs[b])
    def paths(skip_mask, pick, skip_rescale=False):
        memo = {}
        def go(b, seen):
            if b in memo:
                return memo[b]
            if b == tail:
                r = (cost(b, skip_mask, skip_rescale), [b])
            else:
                opts = []
                cands = [s for s in succ[b] if s in body and s != h and s not in seen]
                if skip_mask and any(not is_rare_block(bbs[s]) for s in cands):
                    cands = [s for s in cands if not is_rare_block(bbs[s])]
                for s in cands:
                    r2 = go(s, seen | {s})
                    if r2 is not None:
                        opts.append(r2)
                if not opts:
                    return None
                c, p = pick(opts, key=lambda x: x[0])
                r = (c + cost(b, skip_mask, skip_rescale), [b] + p)
            memo[b] = r
            return r
        return go(h, frozenset([h]))
    longest = paths(False, max)
    shortest = paths(False, min)
    steady = paths(True, max, True)
    steady_ins = [i for b in steady[1] if not skipped(b, True, True) for i in bbs[b]]
    steady_copies = sum(ldgsts_moving(bbs[b]) for b in steady[1] if not skipped(b, True, True))
    # The same path with the rescale block taken (a tile where some row's max grew by > 2^8).
    rescale_bbs = [b for b in body if is_rescale_block(bbs[b])]
    taken = paths(True, max)
    taken_ins = [i for b in taken[1] if not is_mask(bbs[b]) for i in bbs[b]]
    cond_blocks = []
    for b in order:
        if b not in shortest[1] or is_mask(bbs[b]) or is_rescale_block(bbs[b]):
            cond_blocks.append(dict(addr='%05x' % bbs[b][0]['addr'], n=len(bbs[b]), mask=is_mask(bbs[b]),
                                    rescale=is_rescale_block(bbs[b]),
                                    in_steady=(b in steady[1] and not skipped(b, True, True)),
                                    hist=dict(hist(bbs[b]).most_common(8))))
    return dict(head='%05x' % bbs[h][0]['addr'], tail='%05x' % bbs[tail][-1]['addr'],
                static=sum(len(bbs[b]) for b in body), longest=longest[0], shortest=shortest[0],
                steady=len(steady_ins), steady_hist=hist(steady_ins), cond_blocks=cond_blocks,
                mask_n=sum(len(bbs[b]) for b in body if is_mask(bbs[b])),
                rescale_n=sum(len(bbs[b]) for b in rescale_bbs), steady_copies=steady_copies,
                taken=len(taken_ins), taken_hist=hist(taken_ins) if rescale_bbs else None,
                **(dict(steady_seq=steady_ins) if keep_seq else {}))

# ---- occupancy ----------------------------------------------------------------------------------
GPUS = {'sm_80': dict(gpu='A100', smem_kb=164, regs=65536, max_warps=64, max_blocks=32),
        'sm_90': dict(gpu='H100', smem_kb=228, regs=65536, max_warps=64, max_blocks=32)}

def occupancy(arch, regs, smem, threads):
    g = GPUS[arch]
    warps = threads // 32
    per_warp = -(-regs * 32 // 256) * 256
    b_regs = (g['regs'] // per_warp) // warps
    b_smem = (g['smem_kb'] * 1024) // (smem + 1024) if smem else g['max_blocks']
    b_thr = g['max_warps'] // warps
    b = min(b_regs, b_smem, b_thr, g['max_blocks'])
    lim = 'regs' if b == b_regs else ('smem' if b == b_smem else 'threads')
    return dict(blocks=b, warps=b * warps, limit=lim, b_regs=b_regs, b_smem=b_smem)

# ---- issue / pipe model (assumptions, not measurements) -----------------------------------------
# Per SM sub-partition (SMSP) cycles per warp instruction; shared memory 128 B/clk per SM.
MODEL = {'sm_80': dict(hmma=8.0, fma=2.0, alu=2.0, mufu=8.0),    # A100: 64 FP32 + 64 INT32 lanes, 16 SFU / SM
         'sm_90': dict(hmma=4.0, fma=1.0, alu=2.0, mufu=8.0)}    # H100: mma.sync at full TC peak (optimistic)
FMA_PIPE = {'FFMA', 'FMUL', 'FMUL(pred)', 'FADD', 'IMAD'}
ALU_PIPE = {'FMNMX', 'FSETP', 'FSEL', 'ISETP', 'SEL', 'IADD3', 'LEA', 'LOP3', 'SHF', 'MOV', 'F2FP'}

def model(arch, h, warps, br, bc, copies=None):
    """Cycles per SM for one 64-query x 64-key x d unit, from the steady-state loop histogram."""
    m = MODEL[arch]
    f = warps * 4096.0 / (br * bc) / 4.0          # warp-instructions per SMSP per unit, per loop instr
    tot = sum(h.values())
    c = dict(tensor=h['HMMA'] * f * m['hmma'], issue=tot * f,
             fma=sum(h[k] for k in FMA_PIPE) * f * m['fma'], alu=sum(h[k] for k in ALU_PIPE) * f * m['alu'],
             mufu=(h['MUFU.EX2'] + h['MUFU(other)']) * f * m['mufu'],
             smem=(h['LDSM'] + h['LDSM.T'] + (h['LDGSTS'] if copies is None else copies)) * 512 * 4 * f / 128.0)
    c['bound'] = max(c, key=c.get)
    return c


# ---- orchestration -------------------------------------------------------------------------------
import hashlib, os, subprocess, shutil
E = os.environ
OUT, TDIR = E['OUT'], E['TDIR']
SASS = os.path.join(OUT, 'sass')

def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout

def demangle(names):
    if not shutil.which('c++filt'):
        return list(names)
    r = subprocess.run(['c++filt'], input='\n'.join(names), capture_output=True, text=True).stdout.split('\n')
    return r[:len(names)]

def fa2_index():
    """(section index, arch, mangled name) -> (regs, stack) from cuobjdump -res-usage of the whole .so."""
    idx, k, arch, fn = {}, 0, None, None
    for line in open(os.path.join(TDIR, 'resusage.txt')):
        if line.startswith('Fatbin elf code'):
            k += 1
        m = re.match(r'arch = (\S+)', line)
        if m:
            arch = m.group(1)
        m = re.match(r' Function (\S+):', line)
        if m:
            fn = m.group(1)
            continue
        m = re.match(r'\s+REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)', line)
        if m and fn:
            if 'flash_fwd_kernel' in fn or 'flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel' in fn:
                idx[(arch, fn)] = dict(section=k, regs=int(m.group(1)), stack=int(m.group(2)))
            fn = None
    elves = {}
    for line in open(os.path.join(TDIR, 'lelf.txt')):
        m = re.match(r'ELF file\s+(\d+):\s+(\S+)', line)
        if m:
            elves[int(m.group(1))] = m.group(2)
    return idx, elves

def fa2_name(d, bm, bn, w, causal, even_mn):
    t = 'ILi%dELi%dELi%dELi%d' % (d, bm, bn, w)
    return ('_ZN13pytorch_flash16flash_fwd_kernelI23Flash_fwd_kernel_traits%sELb0ELb0EN7cutlass10bfloat16_tE'
            '19Flash_kernel_traits%sES3_EELb0ELb%dELb0ELb0ELb%dELb1ELb0ELb0EEEvNS_16Flash_fwd_paramsE') % (t, t, causal, even_mn)

def ours_tiles():
    # Tile of each of our kernels, first found wins: OURS_TILES="128:128,64,4 64:128,128,4"
    # (d:br,bc,warps); `memattn --json kernels` (MEMATTN_BIN) if it reports a tile per kernel;
    # else struct literals in kernels-gpu/src/*.rs with head_dim, br, bc and warps fields.
    tiles = {}
    for item in os.environ.get('OURS_TILES', '').split():
        d, rest = item.split(':'); br, bc, w = map(int, rest.split(','))
        tiles[int(d)] = dict(br=br, bc=bc, warps=w, smem=(br + 2 * bc) * int(d) * 2)
    if not tiles and os.environ.get('MEMATTN_BIN'):
        try:
            j = json.loads(run([os.environ['MEMATTN_BIN'], '--json', 'kernels']))
            for k in j.get('kernels', []):
                m = re.match(E['OURS_KERNEL'].replace('%d', r'(\d+)') + '$', k.get('name', ''))
                t = k.get('tile') or {}
                if m and all(x in t for x in ('br', 'bc', 'warps')):
                    d = int(m.group(1))
                    tiles[d] = dict(br=int(t['br']), bc=int(t['bc']), warps=int(t['warps']), smem=int(t.get('smem_bytes', (t['br'] + 2 * t['bc']) * d * 2)))
        except Exception as e:
            print('memattn kernels --json gave no tiles: %s' % e)
    if not tiles:
        src = ''
        sd = os.path.join(E['PROJECT'], 'kernels-gpu/src')
        for dp, _, fs in os.walk(sd):
            for f in fs:
                if f.endswith('.rs'):
                    src += open(os.path.join(dp, f)).read() + '\n'
        for m in re.finditer(r'\{([^{}]*\bhead_dim\s*:\s*\d+[^{}]*)\}', src):
            body = m.group(1)
            f = {k: int(v) for k, v in re.findall(r'\b(head_dim|br|bc|warps)\s*:\s*(\d+)', body)}
            if all(k in f for k in ('head_dim', 'br', 'bc', 'warps')) and f['head_dim'] not in tiles and 'mma' in src[max(0, m.start() - 200):m.start()].lower():
                d = f['head_dim']
                tiles[d] = dict(br=f['br'], bc=f['bc'], warps=f['warps'], smem=(f['br'] + 2 * f['bc']) * d * 2)
    rp = os.path.join(E['PROJECT'], 'kernels-gpu/ptx/ptxas-report.json')
    if os.path.exists(rp):
        for k in json.load(open(rp)).get('kernels', []):
            m = re.match(r'flash_fwd_bf16_d(\d+)$', k['name'])
            if m and int(m.group(1)) in tiles:
                tiles[int(m.group(1))]['smem'] = k['dynamic_smem_bytes'] + k.get('static_smem_bytes', 0)
    return tiles

_ASSEMBLED = {}
def assemble_ours(arch):
    """Our PTX through ptxas -v for one arch (once per run): the cubin and each entry's registers."""
    if arch not in _ASSEMBLED:
        cubin = os.path.join(CACHE_OURS, 'ours.%s.cubin' % arch)
        log = subprocess.run([E['PTXAS'], '-arch=' + arch, '-v', '-o', cubin, E['OURS_PTX']],
                             check=True, capture_output=True, text=True).stderr
        regs = {}
        for m in re.finditer(r"Compiling entry function '(\w+)' for '\w+'\n.*?\n\s+(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads\nptxas info\s+: Used (\d+) registers", log):
            regs[m.group(1)] = dict(regs=int(m.group(5)), stack=int(m.group(2)), spill=int(m.group(3)) + int(m.group(4)))
        _ASSEMBLED[arch] = (cubin, regs)
    return _ASSEMBLED[arch]

def main():
    archs, dims = E['ARCHS'].split(), [int(x) for x in E['DIMS'].split()]
    idx, elves = fa2_index()
    tiles = ours_tiles()
    cub = os.path.join(TDIR, 'cubins')
    os.makedirs(cub, exist_ok=True)
    spec, notes = [], []
    try:
        notes.append('torch: ' + open(os.path.join(TDIR, 'torch/version.py')).read().split("__version__ = ")[1].split('\n')[0])
    except Exception:
        notes.append('torch: ' + E['TORCH_SPEC'])
    notes.append('ptxas: ' + run([E['PTXAS'], '--version']).strip().split('\n')[-1])
    fa_archs = sorted(set(a for (a, f), v in idx.items() if 'Flash_fwd_kernel_traitsILi128' in f and v['regs'] > 32))
    stubs = sorted(set(a for (a, f), v in idx.items() if 'Flash_fwd_kernel_traitsILi128' in f and v['regs'] <= 32))
    notes.append('archs with FA2 hdim128 fwd code in libtorch_cuda.so: %s (empty stubs, <= 32 regs: %s)' % (
        ' '.join(fa_archs), ' '.join(stubs) or 'none'))
    for a in archs:
        arch = 'sm_' + a
        cubin, regs = assemble_ours(arch)
        for d in dims:
            name = E['OURS_KERNEL'] % d
            if name not in regs or d not in tiles:
                print('skip ours %s %s: not in PTX or tiles.rs' % (name, arch)); continue
            path = os.path.join(SASS, 'ours_d%d.%s.sass' % (d, arch))
            open(path, 'w').write(run([E['CUOBJDUMP'], '-sass', '-fun', name, cubin]))
            t = tiles[d]
            spec.append(dict(name='ours d%d' % d, arch=arch, variant='one kernel (runtime mask)', sass=path, regs=regs[name]['regs'],
                             stack=regs[name]['stack'], smem=t['smem'], threads=32 * t['warps'], br=t['br'], bc=t['bc'], d=d, warps=t['warps']))
            bm, bn, w = map(int, E.get('FA2_TILE_%d' % d, FA2_TILES.get(d, '128 64 4')).split())
            for causal, even, v in ((0, 1, 'noncausal evenMN'), (1, 1, 'causal evenMN'), (0, 0, 'noncausal !evenMN'), (1, 0, 'causal !evenMN')):
                fn = fa2_name(d, bm, bn, w, causal, even)
                if (arch, fn) not in idx:
                    if even and d > 128:
                        continue  # FA2 instantiates evenMN only up to hdim 128 (IsEvenMNConst needs kHeadDim <= 128)
                    print('FA2 kernel not found for %s: %s' % (arch, fn)); continue
                info = idx[(arch, fn)]
                elf = elves[info['section']]
                cpath = os.path.join(cub, elf)
                if not os.path.exists(cpath):
                    subprocess.run([E['CUOBJDUMP'], '-xelf', elf, E['LIB']], cwd=cub, check=True, capture_output=True)
                path = os.path.join(SASS, 'fa2_d%d_%s%s.%s.sass' % (d, 'c' if causal else 'nc', '_even' if even else '_odd', arch))
                open(path, 'w').write(run([E['CUOBJDUMP'], '-sass', '-fun', fn, cpath]))
                spec.append(dict(name='FA2 d%d' % d, arch=arch, variant=v, sass=path, regs=info['regs'], stack=info['stack'],
                                 smem=(bm + 2 * bn) * d * 2, threads=32 * w, br=bm, bc=bn, d=d, warps=w,
                                 demangled=demangle([fn])[0], cubin=elf))
    report(spec, notes)

def report(spec, notes):
    rows = []
    for s in spec:
        ins = parse(s['sass'])
        L = main_loop(ins)
        h = L['steady_hist']
        hm, non = h['HMMA'], L['steady'] - h['HMMA']
        unit = s['warps'] * 4096.0 / (s['br'] * s['bc'])
        rows.append(dict(s, total=len(ins), hist_total=dict(hist(ins)), occ=occupancy(s['arch'], s['regs'], s['smem'], s['threads']),
                         loop={k: v for k, v in L.items() if k not in ('steady_hist', 'taken_hist')}, steady_hist=dict(h), hmma_iter=hm,
                         nonhmma_iter=non, ratio=non / max(hm, 1), per_unit_hmma=hm * unit, per_unit_nonhmma=non * unit,
                         per_unit_ldsm=(h['LDSM'] + h['LDSM.T']) * unit, model=model(s['arch'], h, s['warps'], s['br'], s['bc'], L['steady_copies']),
                         taken_nonhmma_per_unit=(L['taken'] - h['HMMA']) * unit if L['taken_hist'] else None,
                         taken_model=model(s['arch'], L['taken_hist'], s['warps'], s['br'], s['bc'], L['steady_copies']) if L['taken_hist'] else None))
    json.dump(dict(notes=notes, rows=rows), open(os.path.join(OUT, 'report.json'), 'w'), indent=1, default=str)
    W = ['# SASS comparison: memattn vs FA2 in torch', ''] + ['- ' + n for n in notes] + ['']
    W.append('Occupancy: 64K regs/SM, 64 warps/SM, smem/SM 164 KB (A100, sm_80) / 228 KB (H100, sm_90), 1 KB reserved per block. '
             'FA2 smem = (kBlockM + 2 kBlockN) d 2 B (Share_Q_K_smem = false). "steady" = one K/V tile of the main loop on its '
             'common path (masking blocks skipped, soft-cap division branches avoided, next-tile prefetch taken; ours: the lazy O '
             'rescale skipped, which a warp takes only on a tile where some row\'s max grew by more than 2^8 - its cost is shown '
             'separately as "rescale taken"). "unit" = 64 queries x 64 keys x d.')
    W.append('')
    W.append('| kernel | arch | variant | regs | stack B | smem B | thr | Br | Bc | blk/SM A100-or-H100 (limit) | warps/SM | SASS instr | loop instr/iter | HMMA/iter | non-HMMA/iter | non-HMMA per HMMA | per unit: HMMA / non-HMMA / LDSM |')
    W.append('|' + '---|' * 17)
    for r in rows:
        o = r['occ']
        W.append('| %s | %s | %s | %d | %d | %d | %d | %d | %d | %d (%s) | %d | %d | %d | %d | %d | %.2f | %d / %d / %d |' % (
            r['name'], r['arch'], r['variant'], r['regs'], r['stack'], r['smem'], r['threads'], r['br'], r['bc'], o['blocks'],
            o['limit'], o['warps'], r['total'], r['loop']['steady'], r['hmma_iter'], r['nonhmma_iter'], r['ratio'],
            r['per_unit_hmma'], r['per_unit_nonhmma'], r['per_unit_ldsm']))
    for title, key in (('Steady loop iteration, opcode histogram (per warp, one K/V tile)', 'steady_hist'),
                       ('Whole kernel, opcode histogram', 'hist_total')):
        W += ['', title + ':', '', '| kernel | arch | variant | ' + ' | '.join(COLS) + ' |', '|' + '---|' * (3 + len(COLS))]
        for r in rows:
            W.append('| %s | %s | %s | ' % (r['name'], r['arch'], r['variant']) + ' | '.join(str(r[key].get(c, 0)) for c in COLS) + ' |')
    W += ['', 'Main loop structure (addresses in the .sass files; static = all instructions of the natural loop):', '']
    for r in rows:
        L = r['loop']
        W.append('- %s %s %s: head %s, back edge %s, static %d, longest path %d, shortest %d, steady %d (masking blocks %d%s); '
                 'conditional blocks: %s' % (r['name'], r['arch'], r['variant'], L['head'], L['tail'], L['static'], L['longest'],
                 L['shortest'], L['steady'], L['mask_n'],
                 ', rescale block %d: %d with it taken' % (L['rescale_n'], L['taken']) if L['rescale_n'] else '',
                 '; '.join('%s n=%d%s%s%s' % (c['addr'], c['n'], ' MASK' if c['mask'] else '',
                 ' RESCALE' if c.get('rescale') else '',
                 ' (in steady)' if c['in_steady'] else '') for c in L['cond_blocks']) or 'none'))
    W += ['', 'Pipe model (ASSUMPTION, not a measurement): cycles per SM sub-partition per unit, from the steady histogram. '
          'Rates per SMSP in cycles per warp instruction: %s; issue 1/clk; shared memory 128 B/clk/SM, each LDSM.x4 and '
          'LDGSTS.128 moves 512 B (of two sets of copies under @P / @!P of one predicate, only the larger counts: one set runs). The largest column bounds the loop; real kernels also lose time to latency and barriers.' % json.dumps(MODEL), '']
    W += ['| kernel | arch | variant | tensor | issue | fma pipe | alu pipe | mufu | smem | bound |', '|' + '---|' * 10]
    for r in rows:
        for m, v in ((r['model'], r['variant']), (r.get('taken_model'), r['variant'] + ', rescale taken')):
            if m:
                W.append('| %s | %s | %s | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %s |' % (r['name'], r['arch'], v, m['tensor'],
                         m['issue'], m['fma'], m['alu'], m['mufu'], m['smem'], m['bound']))
    W += ['', 'Ours vs FA2 (noncausal evenMN; above d128, where FA2 has no evenMN kernel, noncausal !evenMN), model bounds:', '']
    def fa2_steady(r):
        for v in ('noncausal evenMN', 'noncausal !evenMN'):
            for f in rows:
                if f['name'].startswith('FA2') and f['d'] == r['d'] and f['arch'] == r['arch'] and f['variant'] == v:
                    return [f]
        return []
    for r in rows:
        if r['name'].startswith('ours'):
            for f in fa2_steady(r):
                bo, bf = max(v for k, v in r['model'].items() if k != 'bound'), max(v for k, v in f['model'].items() if k != 'bound')
                tm = r.get('taken_model')
                taken = ''
                if tm:
                    bt = max(v for k, v in tm.items() if k != 'bound')
                    taken = ' (a tile that rescales: %s-bound %.0f, %.0f%%; non-HMMA %.2f)' % (
                        tm['bound'], bt, 100.0 * bf / bt, r['taken_nonhmma_per_unit'] / f['per_unit_nonhmma'])
                W.append('- d%d %s: ours %s-bound %.0f cyc/unit, FA2 %s-bound %.0f -> ours at most %.0f%% of FA2; '
                         'non-HMMA per unit ours/FA2 = %.2f; LDSM per unit ours/FA2 = %.2f%s' % (
                             r['d'], r['arch'], r['model']['bound'], bo, f['model']['bound'], bf, 100.0 * bf / bo,
                             r['per_unit_nonhmma'] / f['per_unit_nonhmma'], r['per_unit_ldsm'] / f['per_unit_ldsm'], taken))
    for r in rows:
        if 'demangled' in r:
            W.append('- %s %s %s = `%s` (%s)' % (r['name'], r['arch'], r['variant'], r['demangled'], r['cubin']))
    open(os.path.join(OUT, 'report.md'), 'w').write('\n'.join(W) + '\n')
    print('\n'.join(W))

# ---- backward (BWD=1: after the forward; BWD=only: alone) ---------------------------------------
# FA2's backward in torch: run_mha_bwd_hdim<d> (flash_bwd_launch_template.h) picks, where the opt-in
# shared memory per block is >= 144 KB (A100 163 KB, H100 227 KB), without dropout:
#   d32  Flash_bwd_kernel_traits<32, 128, 128, 8, 4, 4, 4, true, false>   (>= 104 KB and !Is_dropout: V in registers)
#   d64  Flash_bwd_kernel_traits<64, 128, 128, 8, 4, 4, 4, false, false>
#   d128 Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, false>
# <kHeadDim, kBlockM, kBlockN, kNWarps, AtomLayoutMSdP, AtomLayoutNdKV, AtomLayoutMdQ, Is_V_in_regs,
# No_double_buffer>, run through run_flash_bwd_seqk_parallel as flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel
# <traits, Is_dropout, Is_causal, Is_local, Has_alibi, Is_even_MN, Is_even_K, Is_softcap> (the mangled names in
# libtorch_cuda.so carry exactly these template arguments; FA2_BWD_TILE_<d> overrides, 7 numbers).
FA2_BWD_TILES = {32: '128 128 8 4 4 4 1', 64: '128 128 8 4 4 4 0', 128: '64 128 8 2 4 2 0'}
BWD_COLS = ['HMMA', 'LDSM', 'LDSM.T', 'LDGSTS', 'LDG', 'STG', 'RED', 'LDS', 'LDS(dummy)', 'STS', 'LDL', 'STL',
            'MUFU.EX2', 'MUFU(other)', 'FFMA', 'FMUL', 'FMUL(pred)', 'FADD', 'FMNMX', 'FSETP', 'FSEL', 'F2FP', 'SHFL',
            'BAR', 'DEPBAR', 'ISETP', 'SEL', 'IMAD', 'IADD3', 'LEA', 'LOP3', 'SHF', 'MOV', 'P2R/PLOP3', 'uniform',
            'branch/ctl', 'other']

def fa2_bwd_name(d, t, causal, even_mn):
    bm, bn, w, a1, a2, a3, vr = t
    tr = 'ILi%dELi%dELi%dELi%d' % (d, bm, bn, w)
    return ('_ZN13pytorch_flash44flash_bwd_dq_dk_dv_loop_seqk_parallel_kernelI23Flash_bwd_kernel_traits%sELi%dELi%dELi%dELb%dELb0E'
            'N7cutlass10bfloat16_tE19Flash_kernel_traits%sES3_EELb0ELb%dELb0ELb0ELb%dELb1ELb0EEEvNS_16Flash_bwd_paramsE') % (
                tr, a1, a2, a3, vr, tr, causal, even_mn)

def fa2_bwd_smem(d, t):
    # kSmemSize1colblock of Flash_bwd_kernel_traits (kernel_traits.h), 2-byte elements: Q and dO
    # (3 tiles of kBlockM x d: Q double-buffered), K and V, P and dS (kBlockM x kBlockN each).
    bm, bn, w, a1, a2, a3, vr = t
    qdo, kv, pds = bm * d * 3 * 2, bn * d * 2 * 2, bm * bn * 2
    return qdo + (max(kv, kv // 2 + 2 * pds) if vr else kv + 2 * pds)

def cls_bwd(i):
    b = i['base']
    if b in ('RED', 'REDG', 'ATOM', 'ATOMG'):
        return 'RED'
    if b in ('LD', 'LDG'):
        return 'LDG'
    if b in ('ST', 'STG'):
        return 'STG'
    if b in ('P2R', 'R2P', 'PLOP3'):
        return 'P2R/PLOP3'
    return cls(i)

def hist_bwd(seq):
    return collections.Counter(cls_bwd(i) for i in seq)

def is_bwd_mask_block(bb):
    # memattn's backward masks P and dS in a block of its own, branched around in a tile whose every
    # row sees every key of the block (all tiles but those on the causal diagonal, a window edge or
    # seq_kv): integer offset compares and predicated zeroing, no tensor-core or memory work. FA2
    # if-converts its causal mask into the loop body (-inf FSELs among the HMMA), so nothing of FA2's
    # is skipped; its noncausal evenMN kernel has no mask code.
    if is_mask_block(bb):
        return True
    if len(bb) < 64 or any(i['base'] in ('HMMA', 'LDSM', 'LDGSTS', 'LDS', 'STS', 'MUFU', 'RED', 'REDG', 'LD', 'LDG',
                                         'ST', 'STG', 'BAR') for i in bb):
        return False
    return sum(1 for i in bb if cls_bwd(i) in ('ISETP', 'LOP3', 'P2R/PLOP3', 'SEL', 'FSEL', 'IADD3', 'IMAD', 'uniform',
                                               'SHF', 'MOV', 'LEA')) >= 0.9 * len(bb)

def smem_bytes(i):
    """Shared-memory bytes one warp instruction moves (0 for a `@!PT` dummy)."""
    b, parts = i['base'], i['op'].split('.')
    if i['pred'] == '@!PT':
        return 0
    if b == 'LDSM':
        return 128 * (int(parts[-1]) if parts[-1] in ('1', '2', '4') else 4)
    if b in ('LDS', 'STS', 'LDGSTS'):
        w = 4
        for x in parts[1:]:
            w = {'64': 8, '128': 16, 'U8': 1, 'S8': 1, 'U16': 2, 'S16': 2}.get(x, w)
        return 32 * w
    return 0

def red_bytes(i):
    return 32 * (8 if '.64' in i['op'] or 'F32x2' in i['op'] else 4) if cls_bwd(i) == 'RED' else 0

def bwd_loop_costs(seq, copies):
    # LDGSTS: the moving copies of main_loop (a guarded @P / @!P pair counts its larger side).
    lg = [smem_bytes(i) for i in seq if i['base'] == 'LDGSTS']
    sm = sum(smem_bytes(i) for i in seq if i['base'] != 'LDGSTS') + copies * (max(lg) if lg else 0)
    return sm, sum(red_bytes(i) for i in seq)

def bwd_model(arch, h, smem_b, warps, br, bc):
    """Cycles per SM for one unit (64 queries x 64 keys x d, all five GEMMs), from one warp's loop iteration."""
    m = MODEL[arch]
    per_sm = warps * 4096.0 / (br * bc)     # warp-instructions per SM per unit, per instruction of one warp's iteration
    f = per_sm / 4.0                        # ... per SM sub-partition
    c = dict(tensor=h['HMMA'] * f * m['hmma'], issue=sum(h.values()) * f,
             fma=sum(h[k] for k in FMA_PIPE) * f * m['fma'],
             alu=sum(h[k] for k in ALU_PIPE | {'P2R/PLOP3'}) * f * m['alu'],
             mufu=(h['MUFU.EX2'] + h['MUFU(other)']) * f * m['mufu'], smem=smem_b * per_sm / 128.0)
    c['bound'] = max(c, key=c.get)
    return c

def ours_bwd_tiles():
    # OURS_BWD_TILES="64:32,4 128:32,4" (d:br,warps; Bc = 16 warps), else the FLASH_BWD_MMA_D<d>
    # literals of kernels-gpu/src/tiles.rs; shared memory from ptxas-report.json.
    tiles = {}
    for item in E.get('OURS_BWD_TILES', '').split():
        d, rest = item.split(':'); nums = list(map(int, rest.split(',')))
        tiles[int(d)] = dict(br=nums[0], warps=nums[1])
        if len(nums) > 2:
            tiles[int(d)]['bc'] = nums[2]
    if not tiles:
        src = open(os.path.join(E['PROJECT'], 'kernels-gpu/src/tiles.rs')).read()
        for m in re.finditer(r'FLASH_BWD_MMA_D(\d+)\s*:\s*FlashBwdMmaTile\s*=\s*FlashBwdMmaTile\s*\{([^}]*)\}', src):
            f = {k: int(v) for k, v in re.findall(r'\b(head_dim|br|warps|kv_splits)\s*:\s*(\d+)', m.group(2))}
            if all(k in f for k in ('head_dim', 'br', 'warps')):
                tiles[f['head_dim']] = dict(br=f['br'], warps=f['warps'], kv_splits=f.get('kv_splits', 1))
        # The two-dimensional kernels (flash_bwd_tc.rs) take the plain names where they exist:
        # 8 warps, Br 128, Bc from the tile.
        for m in re.finditer(r'FLASH_BWD_TC_D(\d+)\s*:\s*FlashBwdTcTile\s*=\s*FlashBwdTcTile\s*\{([^}]*)\}', src):
            f = {k: int(v) for k, v in re.findall(r'\b(head_dim|bc)\s*:\s*(\d+)', m.group(2))}
            if all(k in f for k in ('head_dim', 'bc')):
                tiles[f['head_dim']] = dict(br=128, warps=8, bc=f['bc'])
    rep = {}
    rp = os.path.join(E['PROJECT'], 'kernels-gpu/ptx/ptxas-report.json')
    if os.path.exists(rp):
        for k in json.load(open(rp)).get('kernels', []):
            rep[(k['name'], k['arch'])] = k
    for d, t in tiles.items():
        # 16 keys per row group of kv_splits warps (d128: two warps share a group's keys).
        t.setdefault('bc', 16 * t['warps'] // t.get('kv_splits', 1))
        k = rep.get((E['OURS_BWD_KERNEL'] % d, 'sm_80'))
        t['smem'] = (k['dynamic_smem_bytes'] + k.get('static_smem_bytes', 0)) if k else \
            (2 * t['bc'] * d + 2 * t['br'] * d + t['bc'] * t['br']) * 2 + 2 * t['br'] * 4
    return tiles, rep

def bwd_main(append):
    archs, dims = E['ARCHS'].split(), [int(x) for x in E.get('BWD_DIMS', '64 128 32').split()]
    idx, elves = fa2_index()
    tiles, ptx_rep = ours_bwd_tiles()
    cub = os.path.join(TDIR, 'cubins')
    os.makedirs(cub, exist_ok=True)
    spec, notes = [], []
    for a in archs:
        arch = 'sm_' + a
        cubin, regs = assemble_ours(arch)
        for d in dims:
            name = E['OURS_BWD_KERNEL'] % d
            if name not in regs or d not in tiles:
                print('skip ours %s %s: not in PTX or tiles.rs' % (name, arch)); continue
            path = os.path.join(SASS, 'ours_bwd_d%d.%s.sass' % (d, arch))
            open(path, 'w').write(run([E['CUOBJDUMP'], '-sass', '-fun', name, cubin]))
            t, r, pr = tiles[d], regs[name], ptx_rep.get((name, arch))
            if pr and (pr['registers'], pr['stack_bytes'], pr['spill_store_bytes'] + pr['spill_load_bytes']) != (r['regs'], r['stack'], r['spill']):
                notes.append('%s %s: ptxas-report.json says %d regs / %d B stack / %d B spill, this ptxas %d / %d / %d' % (
                    name, arch, pr['registers'], pr['stack_bytes'], pr['spill_store_bytes'] + pr['spill_load_bytes'], r['regs'], r['stack'], r['spill']))
            spec.append(dict(name='ours d%d' % d, arch=arch, variant='one kernel (runtime mask)', sass=path, regs=r['regs'],
                             stack=r['stack'], spill=r['spill'], smem=t['smem'], threads=32 * t['warps'], br=t['br'],
                             bc=t['bc'], d=d, warps=t['warps'], kernel=name))
            ft = tuple(map(int, E.get('FA2_BWD_TILE_%d' % d, FA2_BWD_TILES.get(d, '64 128 8 2 4 2 0')).split()))
            for causal, v in ((0, 'noncausal evenMN'), (1, 'causal evenMN')):
                fn = fa2_bwd_name(d, ft, causal, 1)
                if (arch, fn) not in idx:
                    print('FA2 kernel not found for %s: %s' % (arch, fn)); continue
                info = idx[(arch, fn)]
                elf = elves[info['section']]
                cpath = os.path.join(cub, elf)
                if not os.path.exists(cpath):
                    subprocess.run([E['CUOBJDUMP'], '-xelf', elf, E['LIB']], cwd=cub, check=True, capture_output=True)
                path = os.path.join(SASS, 'fa2_bwd_d%d_%s.%s.sass' % (d, 'c' if causal else 'nc', arch))
                open(path, 'w').write(run([E['CUOBJDUMP'], '-sass', '-fun', fn, cpath]))
                spec.append(dict(name='FA2 d%d' % d, arch=arch, variant=v, sass=path, regs=info['regs'], stack=info['stack'],
                                 spill=None, smem=fa2_bwd_smem(d, ft), threads=32 * ft[2], br=ft[0], bc=ft[1], d=d,
                                 warps=ft[2], demangled=demangle([fn])[0], cubin=elf, tile=ft))
    if not append:
        try:
            notes.insert(0, 'torch: ' + open(os.path.join(TDIR, 'torch/version.py')).read().split("__version__ = ")[1].split('\n')[0])
        except Exception:
            notes.insert(0, 'torch: ' + E['TORCH_SPEC'])
        notes.insert(1, 'ptxas: ' + run([E['PTXAS'], '--version']).strip().split('\n')[-1])
    notes.append('registers / stack / spills: ours from this ptxas -v (ptxas-report.json agrees unless noted); FA2 from '
                 'cuobjdump -res-usage, which gives REG and STACK but no spill bytes: its LDL/STL in the SASS are the spills')
    bwd_report(spec, notes, append)

def bwd_report(spec, notes, append):
    rows = []
    for s in spec:
        ins = parse(s['sass'])
        per_sm = s['warps'] * 4096.0 / (s['br'] * s['bc'])
        out = dict(s, total=len(ins), hist_total=dict(hist_bwd(ins)),
                   occ=occupancy(s['arch'], s['regs'], s['smem'], s['threads']))
        for key, mask in (('steady', is_bwd_mask_block), ('masked', lambda bb: False)):
            L = main_loop(ins, is_mask=mask, hist=hist_bwd, keep_seq=True)
            h = L['steady_hist']
            sm, rb = bwd_loop_costs(L['steady_seq'], L['steady_copies'])
            out[key] = dict(loop={k: v for k, v in L.items() if k not in ('steady_hist', 'taken_hist', 'steady_seq')},
                            hist=dict(h), n=L['steady'], hmma=h['HMMA'], nonhmma=L['steady'] - h['HMMA'],
                            unit_hmma=h['HMMA'] * per_sm, unit_nonhmma=(L['steady'] - h['HMMA']) * per_sm,
                            unit_smem=sm * per_sm, unit_red=rb * per_sm, unit_local=(h['LDL'] + h['STL']) * per_sm,
                            model=bwd_model(s['arch'], h, sm, s['warps'], s['br'], s['bc']))
        out['local_total'] = out['hist_total'].get('LDL', 0) + out['hist_total'].get('STL', 0)
        if out['steady']['unit_hmma'] != 10 * s['d']:
            notes.append('%s %s %s: %d HMMA per unit, not the five GEMMs\' 10 d = %d' % (
                s['name'], s['arch'], s['variant'], out['steady']['unit_hmma'], 10 * s['d']))
        rows.append(out)
    jp = os.path.join(OUT, 'report.json')
    j = json.load(open(jp)) if append and os.path.exists(jp) else {}
    j.update(bwd_notes=notes, bwd_rows=rows)
    json.dump(j, open(jp, 'w'), indent=1, default=str)
    W = ['', '# Backward: memattn vs FA2 in torch (BWD=%s)' % E.get('BWD'), ''] + ['- ' + n for n in notes]
    W += ['- FA2: flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel, bf16, the tile run_mha_bwd_hdim<d> picks with >= 144 KB '
          'opt-in smem and no dropout (A100, H100): ' + '; '.join('d%d Flash_bwd_kernel_traits<%d, %s>' % (
              d, d, ', '.join(E.get('FA2_BWD_TILE_%d' % d, FA2_BWD_TILES[d]).split())) for d in sorted(FA2_BWD_TILES)) +
          ' (kBlockM, kBlockN, kNWarps, AtomLayoutMSdP, AtomLayoutNdKV, AtomLayoutMdQ, Is_V_in_regs); smem = '
          'kSmemSize1colblock. Ours: FLASH_BWD_TC_D<d> of kernels-gpu/src/tiles.rs (Br 128, 8 warps) where it exists, else '
          'FLASH_BWD_MMA_D<d> (Bc = 16 x warps / kv_splits); smem from ptxas-report.json.',
          '- Main loop = the loop over query tiles (m-blocks) of one key block: the back edge with the most HMMA, the '
          'smallest of equals (ours: the loop without soft cap, inside the loop over a GQA group\'s query heads; FA2: inside '
          'its loop over key blocks n_block += gridDim.x). "steady" = one query tile on its longest path with ours\' mask '
          'block skipped (a tile every row of which sees every key of the block); "masked" = the same with the mask block '
          '(diagonal / window-edge / seq_kv tiles). FA2 has no such block: its causal mask is if-converted into the loop, '
          'so its causal kernel pays it in every tile. Both paths count the next-tile prefetch (FA2) and, for ours, the '
          'LSE/D loads of the threads tid < Br (warp 0 at Br 32, warps 0-1 at Br 64; the other warps skip them) and the `@P ST.E` of the deterministic mode, '
          'predicated off in atomic mode but issued.',
          '- "unit" = 64 queries x 64 keys x d of the five GEMMs (S, dP, dV, dK, dQ): per SM, one loop iteration of every '
          'warp times 4096 / (Br x Bc); HMMA per unit is 10 d for a kernel without redundant MMA. smem = LDSM / LDS / STS / '
          'cp.async bytes by width (not bank conflicts); RED = dQ atomic bytes to L2 (not in the model\'s bound).', '']
    W.append('| kernel | arch | variant | regs | stack B | spill B st+ld | LDL+STL (kernel / loop) | smem B | thr | Br | Bc | blk/SM A100-or-H100 (limit) | warps/SM | SASS instr | loop instr/iter steady / masked | HMMA/iter | non-HMMA/iter | per unit: HMMA / non-HMMA / smem KiB / RED KiB |')
    W.append('|' + '---|' * 16)
    for r in rows:
        o, st, mk = r['occ'], r['steady'], r['masked']
        W.append('| %s | %s | %s | %d | %d | %s | %d / %d | %d | %d | %d | %d | %d (%s) | %d | %d | %d / %d | %d | %d | %d / %d / %.0f / %.0f |' % (
            r['name'], r['arch'], r['variant'], r['regs'], r['stack'], '-' if r['spill'] is None else r['spill'],
            r['local_total'], st['hist'].get('LDL', 0) + st['hist'].get('STL', 0), r['smem'], r['threads'], r['br'], r['bc'],
            o['blocks'], o['limit'], o['warps'], r['total'], st['n'], mk['n'], st['hmma'], st['nonhmma'],
            st['unit_hmma'], st['unit_nonhmma'], st['unit_smem'] / 1024, st['unit_red'] / 1024))
    W += ['', 'Steady loop iteration (one query tile), opcode histogram per warp:', '',
          '| kernel | arch | variant | ' + ' | '.join(BWD_COLS) + ' |', '|' + '---|' * (3 + len(BWD_COLS))]
    for r in rows:
        W.append('| %s | %s | %s | ' % (r['name'], r['arch'], r['variant']) + ' | '.join(str(r['steady']['hist'].get(c, 0)) for c in BWD_COLS) + ' |')
    W += ['', 'Main loop structure (addresses in the .sass files):', '']
    for r in rows:
        L = r['steady']['loop']
        W.append('- %s %s %s: head %s, back edge %s, static %d, longest path %d, shortest %d, steady %d (mask blocks %d); '
                 'conditional blocks: %s' % (r['name'], r['arch'], r['variant'], L['head'], L['tail'], L['static'], L['longest'],
                 L['shortest'], L['steady'], L['mask_n'], '; '.join('%s n=%d%s%s' % (c['addr'], c['n'], ' MASK' if c['mask'] else '',
                 ' (in steady)' if c['in_steady'] else '') for c in L['cond_blocks']) or 'none'))
    W += ['', 'Pipe model (ASSUMPTION, not a measurement): cycles per SM sub-partition per unit, rates as the forward\'s; '
          'smem 128 B/clk/SM from the bytes above. It ignores latency (the backward\'s chain S -> P -> dS -> STS -> barrier -> '
          'dQ per tile, at 1-2 blocks per SM), the barriers, bank conflicts, L2 atomics and local-memory traffic.', '',
          '| kernel | arch | variant | tensor | issue | fma pipe | alu pipe | mufu | smem | bound |', '|' + '---|' * 10]
    for r in rows:
        for key in ('steady', 'masked'):
            if key == 'masked' and not r['name'].startswith('ours'):
                continue
            m = r[key]['model']
            W.append('| %s | %s | %s%s | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %s |' % (r['name'], r['arch'], r['variant'],
                     ', masked tile' if key == 'masked' else '', m['tensor'], m['issue'], m['fma'], m['alu'], m['mufu'], m['smem'], m['bound']))
    W += ['', 'Ours vs FA2, model bounds (ratio = FA2 cycles / ours: >= 1 means ours at least as fast by the model):', '']
    bound = lambda m: max(v for k, v in m.items() if k != 'bound')
    summary = []
    for r in rows:
        if not r['name'].startswith('ours'):
            continue
        fa = {f['variant']: f for f in rows if f['name'].startswith('FA2') and f['d'] == r['d'] and f['arch'] == r['arch']}
        f, fc = fa.get('noncausal evenMN'), fa.get('causal evenMN')
        if not f:
            continue
        bo, bm, bf = bound(r['steady']['model']), bound(r['masked']['model']), bound(f['steady']['model'])
        bfc = bound(fc['steady']['model']) if fc else float('nan')
        summary.append(dict(d=r['d'], arch=r['arch'], ours=bo, ours_bound=r['steady']['model']['bound'], fa2=bf,
                            fa2_bound=f['steady']['model']['bound'], ratio=bf / bo, ours_masked=bm, fa2_causal=bfc, ratio_masked=bfc / bm,
                            nonhmma=r['steady']['unit_nonhmma'] / f['steady']['unit_nonhmma'],
                            smem=r['steady']['unit_smem'] / f['steady']['unit_smem'], red=r['steady']['unit_red'] / f['steady']['unit_red']))
        s = summary[-1]
        W.append('- d%d %s: ours %s-bound %.0f cyc/unit, FA2 noncausal %s-bound %.0f -> FA2/ours = %.2f; masked tile: ours %.0f, '
                 'FA2 causal %.0f -> %.2f; per unit ours/FA2: non-HMMA %.2f, smem bytes %.2f, dQ RED bytes %.2f' % (
                     s['d'], s['arch'], s['ours_bound'], bo, s['fa2_bound'], bf, s['ratio'], bm, bfc, s['ratio_masked'],
                     s['nonhmma'], s['smem'], s['red']))
    j['bwd_summary'] = summary
    json.dump(j, open(jp, 'w'), indent=1, default=str)
    for r in rows:
        if 'demangled' in r:
            W.append('- %s %s %s = `%s` (%s)' % (r['name'], r['arch'], r['variant'], r['demangled'], r['cubin']))
    mp = os.path.join(OUT, 'report.md')
    if append and os.path.exists(mp):
        open(mp, 'a').write('\n'.join(W) + '\n')
    else:
        open(mp, 'w').write('\n'.join(W).lstrip('\n') + '\n')
    print('\n'.join(W))

# ---- Hopper (SM90=1: after the other sections; SM90=only: alone) ---------------------------------
# memattn's sm_90a forward (kernels-gpu/ptx/memattn_kernels_sm90.ptx: TMA + mbarrier, a producer warpgroup,
# consumer warpgroups of 64 query rows each, wgmma) against FlashAttention-3's forward from the fa3-fwd
# wheel (flash-attention hopper/, built into fa3_fwd/_C.abi3.so). Both are warp specialised: the loop
# measured is the consumer warpgroups' per-key-tile loop (the innermost loop with HGMMA); the producer
# (a few TMA issues per tile from one thread) is left out of the issue model, for both alike.
H90_COLS = ['HGMMA', 'WARPGROUP', 'SYNCS', 'BAR', 'MUFU.EX2', 'MUFU(other)', 'FFMA', 'FMUL', 'FMUL(pred)', 'FADD',
            'FMNMX', 'FSETP', 'FSEL', 'F2FP', 'SHFL', 'LDS', 'STS', 'STSM', 'LDSM', 'LDL', 'STL', 'ISETP', 'SEL',
            'IMAD', 'IADD3', 'LEA', 'LOP3', 'SHF', 'MOV', 'uniform', 'NOP', 'branch/ctl', 'other']
# H100 SXM5: 132 SMs, 989.4 TFLOP/s dense BF16 at the 1830 MHz boost clock (NVIDIA H100 whitepaper / datasheet)
# -> 989.4e12 / (132 x 1.83e9) = 4096 FLOP/clk/SM = 2048 bf16 MAC/clk/SM (4 tensor cores x 512; A100: 1024).
H100 = dict(sms=132, mhz=1830, tflops=989.4, tc_mac_per_clk=2048, issue_per_smsp=1.0, fma_lanes_per_smsp=32,
            alu_lanes_per_smsp=16, mufu_lanes_per_sm=16, smem_b_per_clk=128)
H90_FMA = {'FFMA', 'FMUL', 'FMUL(pred)', 'FADD', 'IMAD'}
H90_ALU = {'FMNMX', 'FSETP', 'FSEL', 'ISETP', 'SEL', 'IADD3', 'LEA', 'LOP3', 'SHF', 'MOV', 'F2FP'}
# FA3's template (hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp): CollectiveMainloopFwdSm90<Stages, ClusterShape,
# TileShape_MNK, kHeadDimV, Element, ElementAccum, ArchTag, then these 12 bools>.
FA3_BOOLS = ['Is_causal', 'Is_local', 'Has_softcap', 'Varlen', 'PagedKVNonTMA', 'AppendKV', 'HasQv', 'MmaPV_is_RS',
             'IntraWGOverlap', 'PackGQA', 'Split', 'V_colmajor']
FA3_FREE = ('MmaPV_is_RS', 'IntraWGOverlap')   # picked by tile_size_fwd_sm90 with the tile, not a feature

def cls90(i):
    b = i['base']
    if b in ('HGMMA', 'WARPGROUP', 'SYNCS', 'NOP', 'STSM'):
        return b
    if b in ('NANOSLEEP', 'YIELD'):
        return 'branch/ctl'
    return cls(i)

def hist90(seq):
    return collections.Counter(cls90(i) for i in seq)

def hgmma_macs(i):
    m = re.match(r'HGMMA\.(\d+)x(\d+)x(\d+)', i['op'])
    return int(m.group(1)) * int(m.group(2)) * int(m.group(3)) if m else 0

def _phasechk_operands(bb):
    return {i['text'].split(',', 1)[1].strip() for i in bb if i['op'].startswith('SYNCS.PHASECHK') and ',' in i['text']}

def block_kind90(bbs, succ, preds, n):
    """Why the steady path avoids loop block n, or None. 'mask': the -inf masking block (a tile every row of
    which sees every key skips it); 'softcap': the soft cap's tanh (ex2 + rcp, off unless a soft cap is
    given); 'rescale': a lazy O-rescale block; 'wait-retry': an mbarrier wait run again only when the first
    try found the phase incomplete (a spin loop, its jump back, or a second test of the same barrier)."""
    bb = bbs[n]
    if any(i['base'] == 'HGMMA' for i in bb):
        return None
    if is_mask_block(bb):
        return 'mask'
    if is_rescale_block(bb):
        return 'rescale'
    mufu = [i['op'] for i in bb if i['base'] == 'MUFU']
    if any(o.startswith('MUFU.TANH') for o in mufu) or (
            any(o.startswith('MUFU.RCP') for o in mufu) and any(o.startswith('MUFU.EX2') for o in mufu)
            and not any(i['base'] in ('SYNCS', 'BAR') for i in bb)):
        return 'softcap'
    if all(i['base'] in ('SYNCS', 'NANOSLEEP', 'YIELD', 'BRA', 'MOV', 'IMAD') for i in bb):
        if n in succ[n]:
            return 'wait-retry'
        ops = _phasechk_operands(bb)
        if ops and any(ops & _phasechk_operands(bbs[p]) for p in preds[n]):
            return 'wait-retry'
        if len(bb) == 1 and bb[0]['base'] == 'BRA' and preds[n] and all(p in succ[p] for p in preds[n]):
            return 'wait-retry'
    return None

def sm90_loop(ins):
    """The consumer warpgroups' key-tile loop: of the natural loops with HGMMA, the innermost (no other
    HGMMA loop inside), most HGMMA first, then the smallest. Steady path: the longest path header -> back
    edge that avoids the blocks block_kind90 names wherever the branch offers another way. Every block of
    the loop off that path is listed with its reason."""
    bbs, succ = basic_blocks(ins)
    dom, preds = dominators(succ, len(bbs))
    loops = []
    for n, s in enumerate(succ):
        for h in s:
            if h in dom[n]:
                body, stack = {h, n}, [n]
                while stack:
                    x = stack.pop()
                    if x == h:
                        continue
                    for p in preds[x]:
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                loops.append((h, n, frozenset(body)))
    hg = lambda body: sum(1 for b in body for i in bbs[b] if i['base'] == 'HGMMA')
    cands = [L for L in loops if hg(L[2])]
    if not cands:
        return None
    inner = [L for L in cands if not any(M[2] < L[2] for M in cands)]
    h, tail, body = max(inner, key=lambda L: (hg(L[2]), -sum(len(bbs[b]) for b in L[2])))
    kind = {b: block_kind90(bbs, succ, preds, b) for b in body}
    memo = {}
    def go(b, seen):
        if b in memo:
            return memo[b]
        if b == tail:
            r = (len(bbs[b]), [b])
        else:
            cs = [s for s in succ[b] if s in body and s != h and s not in seen]
            if any(kind[s] is None for s in cs):
                cs = [s for s in cs if kind[s] is None]
            opts = [r2 for r2 in (go(s, seen | {s}) for s in cs) if r2 is not None]
            if not opts:
                return None
            c, p = max(opts, key=lambda x: x[0])
            r = (c + len(bbs[b]), [b] + p)
        memo[b] = r
        return r
    _, path = go(h, frozenset([h]))
    seq = [i for b in path for i in bbs[b]]
    # the branches of the steady path that step around an off-path block (issued in every iteration)
    guards = collections.Counter(kind[s] for b in path for s in succ[b]
                                 if s in body and s not in path and kind[s] and bbs[b][-1]['base'] == 'BRA')
    off = [dict(addr='%05x' % bbs[b][0]['addr'], n=len(bbs[b]), kind=kind[b] or 'other branch (not the longest)',
                hist=dict(hist90(bbs[b]).most_common(6))) for b in sorted(body) if b not in path]
    kinds = sorted({o['kind'] for o in off})
    hl = hist90(seq)
    return dict(head='%05x' % bbs[h][0]['addr'], tail='%05x' % bbs[tail][-1]['addr'], blocks=len(body),
                static=sum(len(bbs[b]) for b in body), steady=len(seq), seq=seq, hist=hl, off=off,
                off_blocks={k: sum(1 for o in off if o['kind'] == k) for k in kinds},
                off_instr={k: sum(o['n'] for o in off if o['kind'] == k) for k in kinds},
                # guarded instructions on the steady path: issued (and counted) whether or not the guard holds
                guarded=sum(1 for i in seq if i['pred'] and i['base'] != 'BRA' and i['pred'] != '@!PT'),
                guarded_bra=sum(1 for i in seq if i['pred'] and i['base'] == 'BRA'), guards=dict(guards),
                never=sum(1 for i in seq if i['pred'] == '@!PT'),
                hgmma=hl['HGMMA'], hgmma_kernel=sum(1 for i in ins if i['base'] == 'HGMMA'),
                hgmma_outer=sorted({hg(L[2]) for L in cands if L[2] != body and L[2] > body}),
                macs=sum(hgmma_macs(i) for i in seq if i['base'] == 'HGMMA'),
                shapes=dict(collections.Counter(i['op'] for i in seq if i['base'] == 'HGMMA')),
                waits=['%s%s' % ((i['pred'] + ' ') if i['pred'] else '', i['text']) for i in seq
                       if i['op'].startswith('WARPGROUP.DEPBAR') or i['base'] == 'BAR'],
                smem=sum(smem90(i) for i in seq))

def smem90(i):
    """Shared-memory bytes of one warp instruction other than wgmma's operand reads (STSM.x4: 4 8x8 b16 matrices)."""
    if i['base'] == 'STSM':
        x = i['op'].split('.')[-1]
        return 0 if i['pred'] == '@!PT' else 128 * (int(x) if x in ('1', '2', '4') else 4)
    return smem_bytes(i)

def setmaxnreg(ins):
    """The register counts a warpgroup asks for with setmaxnreg: (producer: .dec, consumers: .inc)."""
    dec = [int(re.findall(r'0x([0-9a-f]+)', i['text'])[-1], 16) for i in ins if i['op'].startswith('USETMAXREG.DEALLOC')]
    inc = [int(re.findall(r'0x([0-9a-f]+)', i['text'])[-1], 16) for i in ins if i['op'].startswith('USETMAXREG.TRY_ALLOC')]
    return (min(dec) if dec else None, max(inc) if inc else None)

def sm90_model(L, wgs, br, bc):
    """Clocks per SM per unit (a 128 x 128 block of S at the kernel's head dim: S = Q K^T and O += P V for
    128 queries x 128 keys), from one consumer warp's steady iteration: every one of the wgs x 4 consumer
    warps runs it once per key tile of Br x Bc (Br = 64 x wgs)."""
    h, m = L['hist'], H100
    per_unit = 128.0 * 128.0 / (br * bc)          # block iterations per unit
    f = 4 * wgs * per_unit / 4.0                   # warp-instructions per SMSP per unit, per instruction of the loop
    c = dict(tensor=L['macs'] * wgs * per_unit / m['tc_mac_per_clk'],
             issue=L['steady'] * f / m['issue_per_smsp'],
             fma=sum(h[k] for k in H90_FMA) * f * 32.0 / m['fma_lanes_per_smsp'],
             alu=sum(h[k] for k in H90_ALU) * f * 32.0 / m['alu_lanes_per_smsp'],
             mufu=(h['MUFU.EX2'] + h['MUFU(other)']) * f * 4 * 32.0 / m['mufu_lanes_per_sm'],
             smem=L['smem'] * 4 * wgs * per_unit / m['smem_b_per_clk'])
    order = sorted(c, key=c.get, reverse=True)
    c['bound'], c['next'] = order[0], order[1]
    c['clk'] = c[order[0]]
    return c

def ours_sm90_tiles(ptx_text):
    """memattn_tile_<entry> records of the PTX (5 x u32: threads, block rows, block cols, dynamic smem, head dim)."""
    tiles = {}
    for m in re.finditer(r'\.global[^\n]*?memattn_tile_(\w+)\[(20|5)\]\s*=\s*\{([^}]*)\}', ptx_text):
        vals = [int(v) for v in m.group(3).split(',') if v.strip()]
        if m.group(2) == '20':
            vals += [0] * (20 - len(vals))
            words = [vals[k] | vals[k + 1] << 8 | vals[k + 2] << 16 | vals[k + 3] << 24 for k in range(0, 20, 4)]
        else:
            words = vals + [0] * (5 - len(vals))
        tiles[m.group(1)] = dict(zip(('threads', 'br', 'bc', 'smem', 'd'), words))
    return tiles

def fa3_index():
    """The FlashAttnFwdSm90 kernels of the FA3 library, with registers / stack (cuobjdump -res-usage), their
    cubin, and their template arguments read from the demangled names (c++filt)."""
    d3 = E['F3DIR']
    k, arch, fn, ks = 0, None, None, []
    for line in open(os.path.join(d3, 'resusage.txt')):
        if line.startswith('Fatbin elf code'):
            k += 1
        m = re.match(r'arch = (\S+)', line)
        if m:
            arch = m.group(1)
        m = re.match(r' Function (\S+):', line)
        if m:
            fn = m.group(1)
            continue
        m = re.match(r'\s+REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)', line)
        if m and fn:
            if 'FlashAttnFwdSm90' in fn:
                ks.append(dict(section=k, arch=arch, regs=int(m.group(1)), stack=int(m.group(2)), mangled=fn))
            fn = None
    elves = {}
    for line in open(os.path.join(d3, 'lelf.txt')):
        m = re.match(r'ELF file\s+(\d+):\s+(\S+)', line)
        if m:
            elves[int(m.group(1))] = m.group(2)
    if not shutil.which('c++filt'):
        return ks, elves, False
    for kk, dm in zip(ks, demangle([x['mangled'] for x in ks])):
        kk['demangled'] = dm
        t = re.sub(r'cute::C<(\d+)>', r'\1', dm)
        kk['short'] = t.split('>(', 1)[0] + '>'   # without the parameter list (Params of the same type)
        m = re.search(r'CollectiveMainloopFwdSm90<(\d+), cute::tuple<([\d, ]+)>, cute::tuple<([\d, ]+)>, (\d+), '
                      r'([\w:]+), float, cutlass::arch::Sm90, ((?:(?:true|false)(?:, )?){12})>', t)
        if not m:
            continue
        cl = [int(x) for x in m.group(2).replace(' ', '').split(',') if x]
        mnk = [int(x) for x in m.group(3).replace(' ', '').split(',') if x]
        flags = dict(zip(FA3_BOOLS, [x.strip() == 'true' for x in m.group(6).split(',')]))
        ep = re.search(r'CollectiveEpilogueFwd<cute::tuple<[\d, ]+>, cute::tuple<[\d, ]+>, [\w:]+, cutlass::arch::Sm90, (\d+), '
                       r'(true|false), (true|false), (true|false)', t)
        sch = re.search(r'flash::(\w*TileScheduler)', t)
        kk.update(stages=int(m.group(1)), cluster=cl, bm=mnk[0], bn=mnk[1], d=mnk[2], dv=int(m.group(4)),
                  elem=m.group(5).split('::')[-1], flags=flags, mma_threads=int(ep.group(1)) if ep else None,
                  # the epilogue repeats Varlen, PackGQA, Split: a check on the order of the mainloop's bools
                  order_ok=bool(ep) and [ep.group(k) == 'true' for k in (2, 3, 4)] == [flags[f] for f in ('Varlen', 'PackGQA', 'Split')],
                  scheduler=sch.group(1) if sch else '?')
    return ks, elves, True

def sm90_main(append):
    dims = [int(x) for x in E.get('SM90_DIMS', '64 128 256').split()]
    want_cl = int(E.get('FA3_CLUSTER', '1'))
    notes, spec = [], []
    notes.append('ptxas: ' + run([E['PTXAS'], '--version']).strip().split('\n')[-1])
    # ours
    ptx = E['OURS_SM90_PTX']
    if not os.path.exists(ptx):
        notes.append('ours: %s not found, no rows for memattn' % ptx)
    else:
        text = open(ptx).read()
        tgt = re.search(r'^\s*\.target\s+(\S+)', text, re.M)
        arch = tgt.group(1) if tgt else 'sm_90a'
        cubin = os.path.join(CACHE_OURS, 'ours_sm90.%s.cubin' % arch)
        log = subprocess.run([E['PTXAS'], '-arch=' + arch, '-v', '-o', cubin, ptx], check=True, capture_output=True, text=True).stderr
        regs = {}
        for m in re.finditer(r"Compiling entry function '(\w+)' for '\w+'\n.*?\n\s+(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads\nptxas info\s+: Used (\d+) registers", log):
            regs[m.group(1)] = dict(regs=int(m.group(5)), stack=int(m.group(2)), spill=int(m.group(3)) + int(m.group(4)))
        tiles = ours_sm90_tiles(text)
        # what the project recorded for this PTX (ptxas-report-sm90.json next to it), if anything: said where it differs
        rep, rp = {}, os.path.join(os.path.dirname(ptx), 'ptxas-report-sm90.json')
        if os.path.exists(rp):
            rj = json.load(open(rp))
            if rj.get('ptx_sha256') not in (None, hashlib.sha256(text.encode()).hexdigest()):
                notes.append('ours: %s is for another PTX (sha256 %s...)' % (os.path.basename(rp), rj['ptx_sha256'][:16]))
            rep = {k['name']: k for k in rj.get('kernels', [])}
        notes.append('ours: %s (%s, sha256 %s), ptxas -arch=%s' % (os.path.relpath(ptx, E['PROJECT']), arch,
                     hashlib.sha256(text.encode()).hexdigest()[:16], arch))
        for d in dims:
            name = E['OURS_SM90_KERNEL'] % d
            if name not in regs or name not in tiles:
                notes.append('ours %s: not in the PTX (or no memattn_tile_ record)' % name)
                continue
            t, pr, r = tiles[name], rep.get(name), regs[name]
            if pr and (pr['registers'], pr['stack_bytes'], pr['spill_store_bytes'] + pr['spill_load_bytes']) != (r['regs'], r['stack'], r['spill']):
                notes.append('%s: ptxas-report-sm90.json says %d regs / %d B stack / %d B spill, this ptxas %d / %d / %d' % (
                    name, pr['registers'], pr['stack_bytes'], pr['spill_store_bytes'] + pr['spill_load_bytes'], r['regs'], r['stack'], r['spill']))
            path = os.path.join(SASS, 'ours_sm90_d%d.%s.sass' % (d, arch))
            open(path, 'w').write(run([E['CUOBJDUMP'], '-sass', '-fun', name, cubin]))
            spec.append(dict(name='ours d%d' % d, kernel=name, variant='Br %d x Bc %d, %d threads' % (t['br'], t['bc'], t['threads']),
                             sass=path, d=d, regs=regs[name]['regs'], stack=regs[name]['stack'], spill=regs[name]['spill'],
                             smem=t['smem'], threads=t['threads'], br=t['br'], bc=t['bc'], wgs=t['br'] // 64))
    # FA3
    fa3 = {}
    if E.get('F3LIB') and os.path.exists(E['F3LIB']):
        ks, elves, have_names = fa3_index()
        n_sm90 = sum(1 for v in elves.values() if 'sm_90' in v)
        notes.append('FA3: %s, %s: %d cubins (%d sm_90a), %d FlashAttnFwdSm90 kernels' % (
            E['FA3_SPEC'], os.path.basename(E['F3LIB']), len(elves), n_sm90, len(ks)))
        if not have_names:
            notes.append('FA3: c++filt not found, template arguments unreadable: no FA3 rows')
        cub = os.path.join(E['F3DIR'], 'cubins')
        os.makedirs(cub, exist_ok=True)
        for d in dims:
            cands = [k for k in ks if k.get('d') == d and k.get('dv') == d and k.get('elem') == 'bfloat16_t'
                     and not any(v for f, v in k['flags'].items() if f not in FA3_FREE)]
            if not cands:
                if have_names:
                    notes.append('FA3 d%d: no bf16 kernel without causal/local/softcap/varlen/paged/appendkv/qv/packgqa/split' % d)
                continue
            for k in sorted(cands, key=lambda k: k['cluster'][0]):
                elf = elves[k['section']]
                cpath = os.path.join(cub, elf)
                if not os.path.exists(cpath):
                    subprocess.run([E['CUOBJDUMP'], '-xelf', elf, E['F3LIB']], cwd=cub, check=True, capture_output=True)
                path = os.path.join(SASS, 'fa3_d%d_cl%d.sm_90a.sass' % (d, k['cluster'][0]))
                open(path, 'w').write(run([E['CUOBJDUMP'], '-sass', '-fun', k['mangled'], cpath]))
                if not k['order_ok']:
                    notes.append('FA3 d%d: the epilogue\'s Varlen / PackGQA / Split disagree with the mainloop\'s bools read in the '
                                 'assumed order: the template may have changed, the match is doubtful' % d)
                wgs = k['bm'] // 64   # one consumer warpgroup per 64 rows of kBlockM
                if k['mma_threads'] != 128 * wgs:
                    notes.append('FA3 d%d: NumMmaThreads %s in the epilogue, not 128 x kBlockM / 64' % (d, k['mma_threads']))
                spec.append(dict(name='FA3 d%d' % d, kernel=k['short'], mangled=k['mangled'], variant='cluster %dx%d%s, %s%s' % (
                                 k['cluster'][0], k['cluster'][1], '' if k['cluster'][0] == 1 else ' (seqlen_q / kBlockM even)',
                                 'RS' if k['flags']['MmaPV_is_RS'] else 'SS', ', IntraWGOverlap' if k['flags']['IntraWGOverlap'] else ''),
                                 sass=path, d=d, regs=k['regs'], stack=k['stack'], spill=None, smem=None,
                                 threads=(wgs + 1) * 128, br=k['bm'], bc=k['bn'], wgs=wgs, cluster=k['cluster'][0],
                                 cubin=elf, scheduler=k['scheduler'], stages=k['stages']))
    else:
        notes.append('FA3: library not available (%s), no FA3 rows' % E.get('FA3_SPEC'))
    sm90_report(spec, notes, append, want_cl)

def sm90_report(spec, notes, append, want_cl):
    rows = []
    for s in spec:
        ins = parse(s['sass'])
        L = sm90_loop(ins)
        if L is None:
            notes.append('%s %s: no loop with HGMMA' % (s['name'], s['variant']))
            continue
        prod, cons = setmaxnreg(ins)
        ht = hist90(ins)
        r = dict(s, total=len(ins), loop={k: v for k, v in L.items() if k not in ('seq', 'hist')}, hist=dict(L['hist']),
                 setmaxnreg=(prod, cons), local_kernel=ht['LDL'] + ht['STL'], local_loop=L['hist']['LDL'] + L['hist']['STL'],
                 model=sm90_model(L, s['wgs'], s['br'], s['bc']))
        ns = {int(re.match(r'HGMMA\.\d+x(\d+)x', k).group(1)) for k in L['shapes']}
        if ns != {s['bc'], s['d']}:
            notes.append('%s %s: HGMMA N in the loop %s, not {Bc, d} = {%d, %d}' % (s['name'], s['variant'], sorted(ns), s['bc'], s['d']))
        exp = s['d'] // 16 + s['bc'] // 16
        if L['hgmma'] != exp:
            notes.append('%s %s: %d HGMMA per iteration per warpgroup, not D/16 + Bc/16 = %d' % (s['name'], s['variant'], L['hgmma'], exp))
        if abs(r['model']['tensor'] - 16 * s['d']) > 0.5:
            notes.append('%s %s: tensor %.0f clk per unit, not the exact GEMMs\' 16 d = %d' % (s['name'], s['variant'], r['model']['tensor'], 16 * s['d']))
        rows.append(r)
    jp = os.path.join(OUT, 'report.json')
    j = json.load(open(jp)) if append and os.path.exists(jp) else {}
    W = ['', '# Hopper (sm_90a): memattn vs FlashAttention-3 (SM90=%s)' % E.get('SM90'), ''] + ['- ' + n for n in notes]
    W += ['- FA3 kernels: cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<CollectiveMainloopFwdSm90<...>, '
          'CollectiveEpilogueFwd<...>, Scheduler>>>, matched on the demangled template: bf16, TileShape K = kHeadDimV = d, '
          'and false for %s (MmaPV_is_RS / IntraWGOverlap come with the tile, tile_size_fwd_sm90). That leaves the '
          'non-varlen, non-split scheduler (StaticPersistentTileScheduler) in cluster 1x1 and, at d >= 128, 2x1 (FA3 runs 2x1 '
          'when ceil(seqlen_q / kBlockM) is even); the comparison takes cluster %dx1 (FA3_CLUSTER).' % (
              ', '.join(f for f in FA3_BOOLS if f not in FA3_FREE), want_cl),
          '- Loop = the consumer warpgroups\' key-tile loop: the innermost natural loop with HGMMA (FA3: inside its persistent '
          'tile loop, whose HGMMA ("in enclosing HGMMA loops") include its peeled first / last key tile). "steady" = its longest path header -> back '
          'edge avoiding, where the branch allows, the blocks listed under "off the steady path": mask (-inf masking, taken on '
          'boundary tiles), softcap (tanh of the soft cap, runtime flag off), rescale, wait-retry (an mbarrier wait that '
          'spins or tests again only when the phase is not yet complete). Guarded instructions on the path are counted as '
          'issued ("guarded"; BRA guards separately), @!PT ones too ("never").',
          '- "unit" = a 128 x 128 block of S at head dim d (S = Q K^T and O += P V, 2 x 128 x 128 x d MAC); per SM: every '
          'consumer warp (4 per warpgroup) runs one steady iteration per Br x Bc key tile, i.e. 16384 / (Br Bc) iterations per unit. '
          'The producer warpgroup is not counted (ours and FA3 alike).', '']
    W.append('| kernel | variant | launch regs | setmaxnreg producer / consumer | stack B | spill B | LDL+STL kernel / loop | smem B | '
             'threads (consumer WGs) | Br x Bc | SASS instr | loop static / steady | HGMMA/iter per WG (D/16 + Bc/16) | HGMMA shapes | '
             'per unit: HGMMA / other warp-instr |')
    W.append('|' + '---|' * 15)
    for r in rows:
        L, per_unit = r['loop'], 16384.0 / (r['br'] * r['bc'])
        W.append('| %s | %s | %d | %s / %s | %d | %s | %d / %d | %s | %d (%d) | %d x %d | %d | %d / %d | %d (%d) | %s | %.0f / %.0f |' % (
            r['name'], r['variant'], r['regs'], r['setmaxnreg'][0], r['setmaxnreg'][1], r['stack'],
            '-' if r['spill'] is None else r['spill'], r['local_kernel'], r['local_loop'], '-' if r['smem'] is None else r['smem'],
            r['threads'], r['wgs'], r['br'], r['bc'], r['total'], L['static'], L['steady'], L['hgmma'],
            r['d'] // 16 + r['bc'] // 16, ', '.join('%s x%d' % (k.split('.')[1], v) for k, v in L['shapes'].items()),
            L['hgmma'] * 4 * r['wgs'] * per_unit, (L['steady'] - L['hgmma']) * 4 * r['wgs'] * per_unit))
    W += ['', 'Steady loop iteration, opcode histogram (per consumer warp, one key tile):', '',
          '| kernel | variant | ' + ' | '.join(H90_COLS) + ' |', '|' + '---|' * (2 + len(H90_COLS))]
    for r in rows:
        W.append('| %s | %s | ' % (r['name'], r['variant']) + ' | '.join(str(r['hist'].get(c, 0)) for c in H90_COLS) + ' |')
    W += ['', 'Loop structure (addresses in the .sass files):', '']
    for r in rows:
        L = r['loop']
        W.append('- %s %s: head %s, back edge %s, %d blocks, static %d, steady %d; HGMMA in the kernel %d, in enclosing HGMMA loops %s; '
                 'guarded instr on the path %d (+ %d guarded BRA), @!PT %d; off the steady path: %s; wgmma waits / named '
                 'barriers in order: %s' % (
                     r['name'], r['variant'], L['head'], L['tail'], L['blocks'], L['static'], L['steady'], L['hgmma_kernel'],
                     L['hgmma_outer'] or 'none', L['guarded'], L['guarded_bra'], L['never'],
                     '; '.join('%s %d blocks / %d instr (%d BRA around it on the path)' % (
                         k, L['off_blocks'][k], L['off_instr'][k], L['guards'].get(k, 0)) for k in L['off_blocks']) or 'nothing',
                     ' | '.join(L['waits']) or 'none'))
    m = H100
    W += ['', 'Pipe model (ASSUMPTION, not a measurement), H100 SXM5, clocks per SM per unit; the largest column bounds the loop:', '',
          '- tensor: HGMMA m64nNk16 = 64 N 16 MAC at %d bf16 MAC/clk/SM (%.1f TFLOP/s dense / (%d SMs x %d MHz) = 4096 FLOP/clk/SM; '
          'so m64n128k16 = 64 clk); wgmma operands read from shared memory are not charged to the smem column.' % (
              m['tc_mac_per_clk'], m['tflops'], m['sms'], m['mhz']),
          '- issue: 1 warp-instruction per clk per SM sub-partition (4 per SM), every instruction of the consumer warps\' steady '
          'path (uniform-datapath, NOP, BRA included); the 4 warps of a warpgroup sit on the 4 sub-partitions.',
          '- fma pipe: FFMA/FMUL/FADD/IMAD at 32 lanes/clk/SMSP (1 clk per warp-instruction); alu pipe: FMNMX/FSETP/FSEL/ISETP/SEL/'
          'IADD3/LEA/LOP3/SHF/MOV/F2FP at 16 lanes/clk/SMSP (2 clk) - the sm_90 rates of the forward section.',
          '- mufu: MUFU (ex2 and others) at 16 lanes/clk/SM (4 per SMSP, 8 clk per warp-instruction).',
          '- smem: LDS/STS/LDSM/STSM bytes (not wgmma operand reads) at 128 B/clk/SM.',
          '- Not modelled: latency and dependencies (ours waits for each wgmma group right after issuing it, FA3 keeps one in '
          'flight - see the waits above), the two consumer warpgroups\' overlap (both kernels take turns through named barriers, ping-pong; the BAR instructions are counted in issue), TMA / L2 / HBM, '
          'mbarrier spin time, the producer warpgroup, the peeled first / last tiles and the epilogue.', '']
    W += ['| kernel | variant | tensor | issue | fma pipe | alu pipe | mufu | smem | bound |', '|' + '---|' * 9]
    for r in rows:
        c = r['model']
        W.append('| %s | %s | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %s %.0f |' % (
            r['name'], r['variant'], c['tensor'], c['issue'], c['fma'], c['alu'], c['mufu'], c['smem'], c['bound'], c['clk']))
    summary = []
    W += ['', 'Ours vs FA3 (FA3 cluster %dx1), model bound in clk per unit (ratio = FA3 / ours: >= 1 means ours at least as '
          'fast on the model):' % want_cl, '',
          '| d | ours bound | ours binding pipe (next) | FA3 bound | FA3 binding pipe (next) | FA3 / ours | issue ours / FA3 |', '|' + '---|' * 7]
    for r in rows:
        if not r['name'].startswith('ours'):
            continue
        fs = [f for f in rows if f['name'].startswith('FA3') and f['d'] == r['d'] and f['cluster'] == want_cl] or \
             [f for f in rows if f['name'].startswith('FA3') and f['d'] == r['d']]
        if not fs:
            W.append('| %d | %.0f | %s (%s %.0f) | - | - | - | - |' % (r['d'], r['model']['clk'], r['model']['bound'],
                     r['model']['next'], r['model'][r['model']['next']]))
            continue
        o, f = r['model'], fs[0]['model']
        s = dict(d=r['d'], ours=o['clk'], ours_pipe=o['bound'], ours_next=o['next'], ours_next_clk=o[o['next']],
                 fa3=f['clk'], fa3_pipe=f['bound'], fa3_next=f['next'], fa3_next_clk=f[f['next']], ratio=f['clk'] / o['clk'],
                 issue_ratio=o['issue'] / f['issue'], fa3_variant=fs[0]['variant'])
        summary.append(s)
        W.append('| %d | %.0f | %s (%s %.0f) | %.0f | %s (%s %.0f) | %.2f | %.2f |' % (
            s['d'], s['ours'], s['ours_pipe'], s['ours_next'], s['ours_next_clk'], s['fa3'], s['fa3_pipe'], s['fa3_next'],
            s['fa3_next_clk'], s['ratio'], s['issue_ratio']))
    W.append('')
    for r in rows:
        if r['name'].startswith('FA3'):
            W.append('- %s %s = `%s` (%s; cute::C<n> written n; mangled name in report.json)' % (r['name'], r['variant'], r['kernel'], r['cubin']))
    j.update(sm90_notes=notes, sm90_rows=rows, sm90_summary=summary)
    json.dump(j, open(jp, 'w'), indent=1, default=str)
    mp = os.path.join(OUT, 'report.md')
    if append and os.path.exists(mp):
        open(mp, 'a').write('\n'.join(W) + '\n')
    else:
        open(mp, 'w').write('\n'.join(W).lstrip('\n') + '\n')
    print('\n'.join(W))

# The tiles torch's FA2 runs on A100/H100 without dropout (run_mha_fwd_hdim* in flash_fwd_launch_template.h).
FA2_TILES = {32: '128 128 4', 64: '128 128 4', 96: '128 64 4', 128: '128 64 4', 192: '128 64 8', 256: '128 64 8'}
# Our cubins go with the report, so runs with different SASS_OUT do not overwrite each other's.
CACHE_OURS = os.path.join(OUT, 'ours')
os.makedirs(CACHE_OURS, exist_ok=True)
BWD = E.get('BWD', '0')
ran = False
if BWD != 'only' and E.get('FWD', '1') != '0':
    main()
    ran = True
if BWD in ('1', 'only'):
    bwd_main(append=ran)
    ran = True
if E.get('SM90', '0') != '0':
    sm90_main(append=ran)
PY
