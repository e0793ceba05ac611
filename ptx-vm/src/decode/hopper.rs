//! Decoding of the Hopper instructions ([`crate::hopper`]): `mbarrier.*`, `cp.async.bulk*`,
//! `elect.sync`, `setmaxnreg`.

use super::*;
use crate::hopper::{HAddr, HInst};

/// Appends `h` to the program's Hopper table: the `Op` that runs it.
fn push(cx: &mut Dcx, h: HInst, d: Slot) -> Op {
    cx.hopper.push(h);
    Op::Hopper { i: (cx.hopper.len() - 1) as u32, d }
}

fn haddr(cx: &mut Dcx, ctx: &Ictx, o: &Operand, sp: Space, opcode: &str) -> Result<HAddr, LoadError> {
    let Operand::Addr { base, off } = o else {
        return err(ctx.line, format!("`{opcode}`: expected an address operand `[...]`"));
    };
    let (a, off) = address(cx, ctx, base.as_deref(), *off, sp)?;
    Ok(HAddr { sp, a, off })
}

fn dest(cx: &mut Dcx, ctx: &Ictx, n: &str) -> Result<Slot, LoadError> {
    if n == "_" {
        Ok(cx.sink)
    } else {
        ctx.reg(n)
    }
}

/// `mbarrier.*`, `elect.sync`, `setmaxnreg`.
pub(super) fn decode(cx: &mut Dcx, ctx: &Ictx, i: &InstAst, m: &mut Mods) -> Result<Decoded, LoadError> {
    inst_prelude!(ctx, i => line, opcode, base, ops, nops, src, dst);
    let op = match base {
        "elect" => {
            if !m.has("sync") {
                return err(line, format!("`{opcode}` needs .sync"));
            }
            m.finish(line, opcode)?;
            nops(2)?;
            let (d, p) = match &ops[0] {
                Operand::Pair(d, p) => (dest(cx, ctx, d)?, dest(cx, ctx, p)?),
                Operand::Name(d) => (dest(cx, ctx, d)?, cx.sink),
                _ => return err(line, format!("`{opcode}`: expected `d|p`")),
            };
            let mask = src(cx, &ops[1], 32, false)?;
            Op::Elect { d, p, mask }
        }
        "setmaxnreg" => {
            let inc = match m.any(&["inc", "dec"]) {
                Some("inc") => true,
                Some(_) => false,
                None => return err(line, format!("`{opcode}` needs .inc or .dec")),
            };
            if !(m.has("sync") && m.has("aligned") && m.has("u32")) {
                return err(line, format!("`{opcode}` needs .sync.aligned.u32"));
            }
            m.finish(line, opcode)?;
            nops(1)?;
            let n = match &ops[0] {
                Operand::Num(Number::Int(n)) => *n,
                _ => return err(line, format!("`{opcode}`: the register count must be a constant")),
            };
            if !(24..=256).contains(&n) || n % 8 != 0 {
                return err(line, format!("`{opcode}`: the register count {n} is not a multiple of 8 in 24..=256"));
            }
            push(cx, HInst::SetMaxNreg { inc, n: n as u32 }, NONE)
        }
        _ => {
            // mbarrier
            m.ignore_hints();
            let sp = match m.any(&["shared", "shared::cta", "shared::cluster"]) {
                Some(_) => Space::Shared,
                None => Space::Generic,
            };
            if !m.has("b64") {
                return err(line, format!("`{opcode}`: only .b64 mbarriers are supported"));
            }
            let kind = m
                .any(&["init", "arrive", "expect_tx", "complete_tx", "try_wait", "test_wait", "inval"])
                .ok_or_else(|| LoadError { line, message: format!("unsupported instruction `{opcode}`") })?;
            let expect = kind == "arrive" && m.has("expect_tx");
            let parity = matches!(kind, "try_wait" | "test_wait") && m.has("parity");
            m.finish(line, opcode)?;
            let bar = |cx: &mut Dcx, o: &Operand| haddr(cx, ctx, o, sp, opcode);
            match kind {
                "init" => {
                    nops(2)?;
                    let b = bar(cx, &ops[0])?;
                    let count = src(cx, &ops[1], 32, false)?;
                    push(cx, HInst::MbarInit { bar: b, count }, NONE)
                }
                "inval" => {
                    nops(1)?;
                    let b = bar(cx, &ops[0])?;
                    push(cx, HInst::MbarInval { bar: b }, NONE)
                }
                "arrive" => {
                    if ops.len() != 2 && ops.len() != 3 || expect && ops.len() != 3 {
                        return err(line, format!("`{opcode}`: wrong operand count"));
                    }
                    let d = dst(cx, &ops[0])?;
                    let b = bar(cx, &ops[1])?;
                    let third = ops.get(2).map(|o| src(cx, o, 32, false)).transpose()?.unwrap_or(NONE);
                    let (count, tx) = if expect { (NONE, third) } else { (third, NONE) };
                    push(cx, HInst::MbarArrive { bar: b, count, tx }, d)
                }
                "expect_tx" | "complete_tx" => {
                    nops(2)?;
                    let b = bar(cx, &ops[0])?;
                    let tx = src(cx, &ops[1], 32, false)?;
                    let h = if kind == "expect_tx" {
                        HInst::MbarExpectTx { bar: b, tx }
                    } else {
                        HInst::MbarCompleteTx { bar: b, tx }
                    };
                    push(cx, h, NONE)
                }
                _ => {
                    // try_wait / test_wait; try_wait may add a suspend-time hint (ignored).
                    if ops.len() != 3 && !(kind == "try_wait" && ops.len() == 4) {
                        return err(line, format!("`{opcode}`: wrong operand count"));
                    }
                    let d = dst(cx, &ops[0])?;
                    let b = bar(cx, &ops[1])?;
                    let x = src(cx, &ops[2], if parity { 32 } else { 64 }, false)?;
                    if let Some(o) = ops.get(3) {
                        src(cx, o, 32, false)?;
                    }
                    push(cx, HInst::MbarWait { bar: b, parity, x }, d)
                }
            }
        }
    };
    Ok((op, None))
}

/// `cp.async.bulk{.tensor}*`, `cp.async.bulk.commit_group`, `cp.async.bulk.wait_group{.read}`,
/// `cp.async.bulk.prefetch*`.
pub(super) fn decode_bulk(cx: &mut Dcx, ctx: &Ictx, i: &InstAst, m: &mut Mods) -> Result<Op, LoadError> {
    inst_prelude!(ctx, i => line, opcode, _base, ops, _nops, src);
    m.has("async");
    m.has("bulk");
    for p in &m.parts {
        if p.starts_with("im2col") || p.starts_with("multicast") || p.starts_with("cta_group") || *p == "gather4" {
            return err(line, format!("`{opcode}`: `.{p}` is not supported by the VM (tile mode, no multicast)"));
        }
    }
    if m.has("commit_group") {
        m.finish(line, opcode)?;
        return Ok(Op::Nop);
    }
    if m.has("wait_group") {
        // Bulk copies complete when they are issued.
        m.has("read");
        m.finish(line, opcode)?;
        return match ops.as_slice() {
            [Operand::Num(Number::Int(_))] => Ok(Op::Nop),
            _ => err(line, "cp.async.bulk.wait_group needs an integer constant"),
        };
    }
    if m.has("prefetch") {
        return Ok(Op::Nop);
    }
    let tensor = m.has("tensor");
    let rank = match m.any(&["1d", "2d", "3d", "4d", "5d"]) {
        Some(d) => d.as_bytes()[0] - b'0',
        None if tensor => return err(line, format!("`{opcode}` needs a dimension (.1d .. .5d)")),
        None => 0,
    };
    m.has("tile");
    let hint = m.has("L2::cache_hint");
    let pos = |m: &Mods, names: &[&str]| m.parts.iter().position(|p| names.contains(p));
    let (Some(sh), Some(gl)) = (pos(m, &["shared::cluster", "shared::cta", "shared"]), pos(m, &["global"])) else {
        return err(line, format!("`{opcode}`: only copies between global and shared memory are supported"));
    };
    let load = sh < gl;
    m.used[sh] = true;
    m.used[gl] = true;
    if load && !m.has("mbarrier::complete_tx::bytes") {
        return err(line, format!("`{opcode}`: a load needs .mbarrier::complete_tx::bytes"));
    }
    if !load && !m.has("bulk_group") {
        return err(line, format!("`{opcode}`: a store needs .bulk_group"));
    }
    m.finish(line, opcode)?;
    let want = match (tensor, load) {
        (true, true) => 3,
        (true, false) => 2,
        (false, true) => 4,
        (false, false) => 3,
    } + hint as usize;
    if ops.len() != want {
        return err(line, format!("`{opcode}` expects {want} operands, found {}", ops.len()));
    }
    let tmap = |cx: &mut Dcx, o: &Operand| -> Result<(HAddr, [Slot; 5]), LoadError> {
        let Operand::TensorAddr { base, off, coords } = o else {
            return err(line, format!("`{opcode}`: expected `[tensorMap, {{c0, ...}}]`"));
        };
        if coords.len() != rank as usize {
            return err(line, format!("`{opcode}`: {} coordinates for a .{rank}d copy", coords.len()));
        }
        let (a, off) = address(cx, ctx, base.as_deref(), *off, Space::Generic)?;
        let mut cs = [NONE; 5];
        for (k, c) in coords.iter().enumerate() {
            cs[k] = src(cx, c, 32, false)?;
        }
        Ok((HAddr { sp: Space::Generic, a, off }, cs))
    };
    let sh_addr = |cx: &mut Dcx, o: &Operand| haddr(cx, ctx, o, Space::Shared, opcode);
    let gl_addr = |cx: &mut Dcx, o: &Operand| haddr(cx, ctx, o, Space::Global, opcode);
    let h = match (tensor, load) {
        (true, true) => {
            let dst = sh_addr(cx, &ops[0])?;
            let (map, coords) = tmap(cx, &ops[1])?;
            let bar = sh_addr(cx, &ops[2])?;
            HInst::TensorLoad { rank, dst, map, coords, bar }
        }
        (true, false) => {
            let (map, coords) = tmap(cx, &ops[0])?;
            let s = sh_addr(cx, &ops[1])?;
            HInst::TensorStore { rank, map, coords, src: s }
        }
        (false, true) => {
            let dst = sh_addr(cx, &ops[0])?;
            let s = gl_addr(cx, &ops[1])?;
            let size = src(cx, &ops[2], 32, false)?;
            let bar = sh_addr(cx, &ops[3])?;
            HInst::BulkLoad { dst, src: s, size, bar }
        }
        (false, false) => {
            let dst = gl_addr(cx, &ops[0])?;
            let s = sh_addr(cx, &ops[1])?;
            let size = src(cx, &ops[2], 32, false)?;
            HInst::BulkStore { dst, src: s, size }
        }
    };
    if hint {
        src(cx, &ops[want - 1], 64, false)?;
    }
    Ok(push(cx, h, NONE))
}
