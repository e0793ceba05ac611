//! Syntax tree to `Program`s: symbol resolution, register slots, and one decode arm per opcode.

use std::collections::hash_map::Entry;

/// The decoder's maps (names of registers, labels, functions, constants) with foldhash's fast
/// hasher: decoding a kernel is mostly name lookups, and SipHash was a fifth of its time.
pub(crate) type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

use crate::ir::*;
use crate::memory::{LOCAL_WINDOW, PARAM_WINDOW, SHARED_WINDOW};
use crate::num::{self, FBin, FMode, FUn, Ty};
use crate::ops;
use crate::parse::{err, FuncAst, InstAst, ModuleAst, Number, Operand, Stmt, VarDecl};
use crate::{KernelInfo, LoadError, ParamInfo};

/// Module-level `.global`/`.const` variables: address and initial image.
pub(crate) struct Globals {
    pub addrs: HashMap<String, u64>,
    pub base: u64,
    pub image: Vec<u8>,
}

fn align_up(x: usize, a: usize) -> usize {
    x.div_ceil(a.max(1)) * a.max(1)
}

pub(crate) fn layout_globals(ast: &ModuleAst, base: u64) -> Result<Globals, LoadError> {
    let mut addrs = HashMap::default();
    let mut size = 0usize;
    let mut placed = Vec::new();
    for v in &ast.vars {
        if v.space == ".global" || v.space == ".const" {
            if v.unsized_array {
                return err(v.line, format!("`{}`: unsized global arrays are not supported", v.name));
            }
            size = align_up(size, v.alignment());
            addrs.insert(v.name.clone(), base + size as u64);
            placed.push((size, v));
            size += v.size();
            if size > 1 << 30 {
                return err(v.line, "module globals exceed 1 GiB");
            }
        }
    }
    let mut image = vec![0u8; size];
    for (off, v) in placed {
        let Some(init) = &v.init else { continue };
        let es = crate::parse::type_size(&v.ty).unwrap_or(1);
        let float = v.ty.starts_with(".f");
        for (k, it) in init.iter().enumerate() {
            let at = off + k * es;
            if at + es > off + v.size() {
                return err(v.line, format!("`{}`: too many initialisers", v.name));
            }
            let val: u64 = match it {
                crate::parse::Init::Num(n, neg) => {
                    let raw = imm_bits(*n, es * 8, float);
                    if *neg {
                        if float {
                            raw ^ (1u64 << (es * 8 - 1))
                        } else {
                            raw.wrapping_neg()
                        }
                    } else {
                        raw
                    }
                }
                crate::parse::Init::Sym { name, off, .. } => match addrs.get(name) {
                    Some(a) => a.wrapping_add(*off as u64),
                    None => return err(v.line, format!("initialiser names unknown symbol `{name}`")),
                },
            };
            image[at..at + es].copy_from_slice(&val.to_le_bytes()[..es]);
        }
    }
    Ok(Globals { addrs, base, image })
}

/// Bits of an immediate for an operand of `bits` width; `float` says the operand is a float.
fn imm_bits(n: Number, bits: usize, float: bool) -> u64 {
    match n {
        Number::Int(v) => {
            if float && bits == 32 {
                (v as f32).to_bits() as u64
            } else if float && bits == 64 {
                (v as f64).to_bits()
            } else {
                v & num::mask(bits as u32)
            }
        }
        Number::F32(b) => {
            if bits == 64 && float {
                (f32::from_bits(b) as f64).to_bits()
            } else {
                b as u64
            }
        }
        Number::F64(b) => {
            if bits == 32 && float {
                (f64::from_bits(b) as f32).to_bits() as u64
            } else {
                b & num::mask(bits as u32)
            }
        }
    }
}

#[derive(Clone, Debug)]
enum Sym {
    Reg(Slot),
    /// Function-scope param variable held in `n` slots from `base`.
    PVar(Slot, u32),
    /// Address constant in a state space (kernel params, shared, local, global).
    Addr(Space, u64),
}

struct FuncSig {
    params: Vec<(Slot, u32)>,
    rets: Vec<(Slot, u32)>,
    start: Option<u32>,
}

struct Dcx<'m> {
    ast: &'m ModuleAst,
    globals: &'m Globals,
    func_index: &'m HashMap<String, usize>,
    insts: Vec<Inst>,
    texts: Vec<String>,
    slot_names: Vec<String>,
    consts: HashMap<u64, Slot>,
    const_list: Vec<(Slot, u64)>,
    specials: HashMap<Special, Slot>,
    sink: Slot,
    shared: HashMap<String, u64>,
    shared_size: usize,
    shared_align: usize,
    uses_dyn_shared: bool,
    local_size: usize,
    sigs: HashMap<String, FuncSig>,
    queue: Vec<String>,
    call_fixups: Vec<(usize, String)>,
    copies: Vec<Vec<(Slot, Slot)>>,
    pvars: Vec<(Slot, u32)>,
    call_edges: Vec<(String, String)>,
    mma_srcs: Vec<MmaSrcs>,
    shfl_perms: Vec<[u8; 32]>,
    wgmma: Vec<crate::wgmma::WgmmaInst>,
    hopper: Vec<crate::hopper::HInst>,
}

impl<'m> Dcx<'m> {
    fn new_slot(&mut self, name: &str) -> Slot {
        self.slot_names.push(name.to_string());
        (self.slot_names.len() - 1) as Slot
    }
    fn konst(&mut self, v: u64) -> Slot {
        if let Some(&s) = self.consts.get(&v) {
            return s;
        }
        let s = self.new_slot(&format!("{v:#x}"));
        self.consts.insert(v, s);
        self.const_list.push((s, v));
        s
    }
    fn special(&mut self, sp: Special) -> Slot {
        if let Some(&s) = self.specials.get(&sp) {
            return s;
        }
        let s = self.new_slot(&format!("{sp:?}"));
        self.specials.insert(sp, s);
        s
    }
    fn shared_addr(&mut self, v: &VarDecl) -> u64 {
        if let Some(&a) = self.shared.get(&v.name) {
            return a;
        }
        if v.unsized_array || v.count == 0 {
            // Dynamic shared memory: placed at the end, all extern arrays alias.
            self.uses_dyn_shared = true;
            self.shared_align = self.shared_align.max(v.alignment());
            self.shared.insert(v.name.clone(), DYN_SHARED_MARK);
            return DYN_SHARED_MARK;
        }
        self.shared_size = align_up(self.shared_size, v.alignment());
        let a = self.shared_size as u64;
        self.shared_size += v.size();
        self.shared.insert(v.name.clone(), a);
        a
    }
}

fn special_of(name: &str) -> Option<Special> {
    let dim = |s: &str| match s {
        "x" => Some(0u8),
        "y" => Some(1),
        "z" => Some(2),
        _ => None,
    };
    if let Some((base, d)) = name.rsplit_once('.') {
        let d = dim(d)?;
        return Some(match base {
            "%tid" => Special::Tid(d),
            "%ntid" => Special::Ntid(d),
            "%ctaid" => Special::Ctaid(d),
            "%nctaid" => Special::Nctaid(d),
            "%cluster_ctaid" => Special::ClusterCtaid(d),
            "%cluster_nctaid" => Special::ClusterNctaid(d),
            "%clusterid" => Special::Clusterid(d),
            "%nclusterid" => Special::Nclusterid(d),
            _ => return None,
        });
    }
    Some(match name {
        "%laneid" => Special::Laneid,
        "%warpid" => Special::Warpid,
        "%nwarpid" => Special::Nwarpid,
        "%lanemask_eq" => Special::LanemaskEq,
        "%lanemask_lt" => Special::LanemaskLt,
        "%lanemask_le" => Special::LanemaskLe,
        "%lanemask_gt" => Special::LanemaskGt,
        "%lanemask_ge" => Special::LanemaskGe,
        "%smid" => Special::Smid,
        "%nsmid" => Special::Nsmid,
        "%gridid" => Special::Gridid,
        "%dynamic_smem_size" => Special::DynSmem,
        "%total_smem_size" => Special::TotalSmem,
        "%cluster_ctarank" => Special::ClusterCtarank,
        "%cluster_nctarank" => Special::ClusterNctarank,
        "%is_explicit_cluster" => Special::IsExplicitCluster,
        _ => return None,
    })
}

/// Function name -> index in `ast.funcs` (a definition wins over a declaration).
pub(crate) fn func_index(ast: &ModuleAst) -> HashMap<String, usize> {
    let mut index = HashMap::default();
    for (i, f) in ast.funcs.iter().enumerate() {
        if f.body.is_some() || !index.contains_key(f.name.as_str()) {
            index.insert(f.name.clone(), i);
        }
    }
    index
}

/// The `.entry` functions with a body, as indices into `ast.funcs`, in module order: one
/// `Program` each ([`decode_entry`]).
pub(crate) fn entries(ast: &ModuleAst) -> Vec<usize> {
    ast.funcs.iter().enumerate().filter(|(_, f)| f.is_entry && f.body.is_some()).map(|(i, _)| i).collect()
}

/// Decodes one `.entry` and every function it calls into a `Program`.
pub(crate) fn decode_entry(
    ast: &ModuleAst,
    globals: &Globals,
    func_index: &HashMap<String, usize>,
    f: &FuncAst,
) -> Result<Program, LoadError> {
    let mut cx = Dcx {
        ast,
        globals,
        func_index,
        insts: Vec::new(),
        texts: Vec::new(),
        slot_names: Vec::new(),
        consts: HashMap::default(),
        const_list: Vec::new(),
        specials: HashMap::default(),
        sink: 0,
        shared: HashMap::default(),
        shared_size: 0,
        shared_align: 1,
        uses_dyn_shared: false,
        local_size: 0,
        sigs: HashMap::default(),
        queue: Vec::new(),
        call_fixups: Vec::new(),
        copies: Vec::new(),
        pvars: Vec::new(),
        call_edges: Vec::new(),
        mma_srcs: Vec::new(),
        shfl_perms: Vec::new(),
        wgmma: Vec::new(),
        hopper: Vec::new(),
    };
    cx.sink = cx.new_slot("_");
    // Kernel parameters.
    let mut params = Vec::new();
    let mut scope: HashMap<String, Sym> = HashMap::default();
    let mut off = 0usize;
    for p in &f.params {
        let size = p.size();
        let align = if p.align > 0 { p.align } else { p.elem_size().max(1) };
        if p.unsized_array {
            return err(p.line, "unsized kernel parameter");
        }
        off = align_up(off, align);
        let ty = if p.is_array { format!("{}[{}]", p.ty, p.count) } else { p.ty.clone() };
        params.push(ParamInfo { name: p.name.clone(), offset: off, size, align, ty });
        scope.insert(p.name.clone(), Sym::Addr(Space::Param, off as u64));
        off += size;
    }
    let param_bytes = off;
    decode_body(&mut cx, f, scope)?;
    // Called functions, transitively.
    while let Some(name) = cx.queue.pop() {
        let fi = cx.func_index[name.as_str()];
        let g = &ast.funcs[fi];
        let start = cx.insts.len() as u32;
        cx.sigs.get_mut(&name).expect("queued function has a signature").start = Some(start);
        let sig = &cx.sigs[&name];
        let mut scope = HashMap::default();
        for (p, &(s, n)) in g.params.iter().zip(&sig.params) {
            scope.insert(p.name.clone(), Sym::PVar(s, n));
        }
        for (p, &(s, n)) in g.rets.iter().zip(&sig.rets) {
            scope.insert(p.name.clone(), Sym::PVar(s, n));
        }
        decode_body(&mut cx, g, scope)?;
    }
    for (at, name) in std::mem::take(&mut cx.call_fixups) {
        let t = cx.sigs[&name].start.expect("called function decoded");
        if let Op::Call { t: ref mut tt, .. } = cx.insts[at].op {
            *tt = t;
        }
    }
    check_recursion(&cx.call_edges, &f.name, f.line)?;
    let dyn_off = align_up(cx.shared_size, cx.shared_align.max(16));
    // Patch the dynamic-shared address constants.
    for (_, v) in cx.const_list.iter_mut() {
        if *v >> 48 == DYN_SHARED_MARK >> 48 {
            *v = (*v - DYN_SHARED_MARK) + dyn_off as u64;
        }
    }
    let nslots = cx.slot_names.len();
    let info = KernelInfo {
        name: f.name.clone(),
        params,
        param_bytes,
        static_shared_bytes: cx.shared_size,
        local_bytes: cx.local_size,
        instructions: cx.insts.len(),
        line: f.line,
    };
    let runs = crate::fuse::runs(&cx.insts);
    for (inst, n) in cx.insts.iter_mut().zip(runs) {
        inst.fused = n;
    }
    Ok(Program {
        has_calls: !cx.copies.is_empty(),
        insts: cx.insts,
        texts: cx.texts,
        nslots,
        consts: cx.const_list,
        specials: cx.specials.into_iter().map(|(k, v)| (v, k)).collect(),
        slot_names: cx.slot_names,
        copies: cx.copies,
        pvars: cx.pvars,
        info,
        dyn_shared_offset: dyn_off,
        mma_srcs: cx.mma_srcs,
        shfl_perms: cx.shfl_perms,
        wgmma: cx.wgmma,
        wgmma_info: std::sync::OnceLock::new(),
        hopper: cx.hopper,
        uid: crate::ir::next_uid(),
        zero_slots: std::sync::OnceLock::new(),
        packed: std::sync::OnceLock::new(),
    })
}

/// Register slots per kernel (registers, constants and parameter words together).
const MAX_SLOTS: usize = 1 << 16;

/// Marker constant patched to the dynamic shared offset once the static layout is known.
const DYN_SHARED_MARK: u64 = 0xD15A_0000_0000_0000;

fn check_recursion(edges: &[(String, String)], entry: &str, line: usize) -> Result<(), LoadError> {
    fn dfs<'a>(
        n: &'a str,
        edges: &'a [(String, String)],
        stack: &mut Vec<&'a str>,
        done: &mut Vec<&'a str>,
    ) -> Option<String> {
        if stack.contains(&n) {
            return Some(n.to_string());
        }
        if done.contains(&n) {
            return None;
        }
        stack.push(n);
        for (a, b) in edges {
            if a == n {
                if let Some(r) = dfs(b, edges, stack, done) {
                    return Some(r);
                }
            }
        }
        stack.pop();
        done.push(n);
        None
    }
    if let Some(r) = dfs(entry, edges, &mut Vec::new(), &mut Vec::new()) {
        return err(line, format!("recursive call to `{r}` is not supported"));
    }
    Ok(())
}

fn decode_body(cx: &mut Dcx, f: &FuncAst, base_scope: HashMap<String, Sym>) -> Result<(), LoadError> {
    let body = f.body.as_ref().expect("body").stmts()?;
    let mut scopes: Vec<HashMap<String, Sym>> = vec![base_scope];
    let mut labels: HashMap<String, u32> = HashMap::default();
    for s in body {
        if let Stmt::Label(l) = s {
            labels.insert(l.clone(), u32::MAX);
        }
    }
    let mut fixups: Vec<(usize, String, usize)> = Vec::new();
    for s in body {
        match s {
            Stmt::Open => scopes.push(HashMap::default()),
            Stmt::Close => {
                scopes.pop();
            }
            Stmt::Label(l) => {
                labels.insert(l.clone(), cx.insts.len() as u32);
            }
            Stmt::Reg { names, line, .. } => {
                if cx.slot_names.len() + names.len() > MAX_SLOTS {
                    return err(*line, format!("more than {MAX_SLOTS} registers in one kernel"));
                }
                let sc = scopes.last_mut().expect("scope");
                sc.reserve(names.len());
                for n in names {
                    let slot = Sym::Reg(cx.slot_names.len() as Slot);
                    match sc.entry(n.clone()) {
                        Entry::Occupied(o) if matches!(o.get(), Sym::Reg(_)) => {
                            return err(*line, format!("duplicate declaration of register `{n}` in one scope"));
                        }
                        Entry::Occupied(mut o) => {
                            o.insert(slot);
                        }
                        Entry::Vacant(v) => {
                            v.insert(slot);
                        }
                    }
                    cx.slot_names.push(n.clone());
                }
            }
            Stmt::Var(v) => {
                let sym = match v.space.as_str() {
                    ".local" => {
                        cx.local_size = align_up(cx.local_size, v.alignment());
                        let a = cx.local_size as u64;
                        cx.local_size += v.size();
                        if cx.local_size > 1 << 20 {
                            return err(v.line, "local memory per thread exceeds 1 MiB");
                        }
                        Sym::Addr(Space::Local, a)
                    }
                    ".shared" => {
                        let a = cx.shared_addr(v);
                        Sym::Addr(Space::Shared, a)
                    }
                    ".param" => {
                        let n = v.size().div_ceil(8).max(1) as u32;
                        if n > 4096 {
                            return err(v.line, "param variable too large");
                        }
                        let base = cx.slot_names.len() as Slot;
                        for k in 0..n {
                            cx.slot_names.push(format!("{}[{}]", v.name, k * 8));
                        }
                        cx.pvars.push((base, n));
                        Sym::PVar(base, n)
                    }
                    _ => return err(v.line, format!("`{}` variables inside a function are not supported", v.space)),
                };
                scopes.last_mut().expect("scope").insert(v.name.clone(), sym);
            }
            Stmt::Inst(i) => {
                let at = cx.insts.len();
                let ctx = Ictx { scopes: &scopes, line: i.line };
                let (op, label) = decode_inst(cx, &ctx, i, &f.name)?;
                let (guard, gneg) = match &i.guard {
                    None => (NONE, false),
                    Some((g, neg)) => (ctx.reg(g)?, *neg),
                };
                if let Some(l) = label {
                    fixups.push((at, l, i.line));
                }
                cx.insts.push(Inst { op, guard, gneg, fused: 0, line: i.line as u32 });
                cx.texts.push(i.text.clone());
            }
        }
    }
    // A function body that falls off its end returns.
    let line =
        body.iter().rev().find_map(|s| if let Stmt::Inst(i) = s { Some(i.line) } else { None }).unwrap_or(f.line);
    cx.insts.push(Inst { op: Op::Ret, guard: NONE, gneg: false, fused: 0, line: line as u32 });
    cx.texts.push("ret; (end of function)".into());
    for (at, l, line) in fixups {
        match labels.get(&l) {
            Some(&t) if t != u32::MAX => {
                if let Op::Bra { t: ref mut tt } = cx.insts[at].op {
                    *tt = t;
                }
            }
            _ => return err(line, format!("unknown label `{l}`")),
        }
    }
    Ok(())
}

struct Ictx<'a> {
    scopes: &'a [HashMap<String, Sym>],
    line: usize,
}

impl Ictx<'_> {
    fn lookup(&self, n: &str) -> Option<&Sym> {
        self.scopes.iter().rev().find_map(|s| s.get(n))
    }
    fn reg(&self, n: &str) -> Result<Slot, LoadError> {
        match self.lookup(n) {
            Some(Sym::Reg(s)) => Ok(*s),
            _ => err(self.line, format!("`{n}` is not a declared register")),
        }
    }
}

/// Decoded modifiers of an opcode.
struct Mods<'a> {
    parts: Vec<&'a str>,
    used: Vec<bool>,
}

impl<'a> Mods<'a> {
    fn new(op: &'a str) -> Self {
        let parts: Vec<&str> = op.split('.').skip(1).collect();
        let used = vec![false; parts.len()];
        Mods { parts, used }
    }
    fn has(&mut self, m: &str) -> bool {
        for (i, p) in self.parts.iter().enumerate() {
            if *p == m && !self.used[i] {
                self.used[i] = true;
                return true;
            }
        }
        false
    }
    fn any(&mut self, ms: &[&str]) -> Option<&'a str> {
        for (i, p) in self.parts.iter().enumerate() {
            if ms.contains(p) && !self.used[i] {
                self.used[i] = true;
                return Some(p);
            }
        }
        None
    }
    /// Ignore cache, scope, eviction and ordering qualifiers.
    fn ignore_hints(&mut self) {
        for (i, p) in self.parts.iter().enumerate() {
            if matches!(
                *p,
                "ca" | "cg"
                    | "cs"
                    | "lu"
                    | "cv"
                    | "wb"
                    | "wt"
                    | "nc"
                    | "weak"
                    | "volatile"
                    | "relaxed"
                    | "acquire"
                    | "release"
                    | "acq_rel"
                    | "cta"
                    | "gpu"
                    | "sys"
                    | "cluster"
                    | "L1::evict_normal"
                    | "L1::evict_unchanged"
                    | "L1::evict_first"
                    | "L1::evict_last"
                    | "L1::no_allocate"
                    | "L2::64B"
                    | "L2::128B"
                    | "L2::256B"
                    | "L2::evict_first"
                    | "L2::evict_last"
                    | "L2::evict_normal"
                    | "L2::cache_hint"
                    | "aligned"
                    | "uni"
            ) || p.starts_with("L1::")
                || p.starts_with("L2::")
            {
                self.used[i] = true;
            }
        }
    }
    /// Takes the last unused type modifier.
    fn ty(&mut self) -> Option<Ty> {
        for i in (0..self.parts.len()).rev() {
            if !self.used[i] {
                if let Some(t) = Ty::parse(self.parts[i]) {
                    self.used[i] = true;
                    return Some(t);
                }
            }
        }
        None
    }
    fn finish(&self, line: usize, opcode: &str) -> Result<(), LoadError> {
        for (i, p) in self.parts.iter().enumerate() {
            if !self.used[i] {
                return err(line, format!("unsupported modifier `.{p}` in `{opcode}`"));
            }
        }
        Ok(())
    }
}

fn rnd_of(m: &mut Mods) -> (u8, bool) {
    match m.any(&["rn", "rz", "rm", "rp", "rni", "rzi", "rmi", "rpi"]) {
        Some("rz") => (num::RZ, false),
        Some("rm") => (num::RM, false),
        Some("rp") => (num::RP, false),
        Some("rn") => (num::RN, false),
        Some("rni") => (num::RN, true),
        Some("rzi") => (num::RZ, true),
        Some("rmi") => (num::RM, true),
        Some("rpi") => (num::RP, true),
        _ => (num::RN, false),
    }
}

type Decoded = (Op, Option<String>);
type SrcFn<'a> = dyn FnMut(&mut Dcx, usize, u32, bool) -> Result<Slot, LoadError> + 'a;

/// The locals every family decoder starts with: the line, the opcode and its base, the
/// operands, an operand-count check (`nops`), a source-operand reader (`src`) and, when named, a
/// destination-register reader (`dst`).
macro_rules! inst_prelude {
    ($ctx:ident, $i:ident => $line:ident, $opcode:ident, $base:ident, $ops:ident, $nops:ident, $src:ident $(, $dst:ident)?) => {
        let $line = $i.line;
        let $opcode = $i.opcode.as_str();
        let $base = $opcode.split('.').next().unwrap_or("");
        let $ops = &$i.ops;
        let $nops = |n: usize| -> Result<(), LoadError> {
            if $ops.len() != n {
                err($line, format!("`{}` expects {n} operands, found {}", $opcode, $ops.len()))
            } else {
                Ok(())
            }
        };
        // Source operand of a given width (float says how to read float literals).
        let $src = |cx: &mut Dcx, o: &Operand, bits: u32, float: bool| -> Result<Slot, LoadError> {
            src_operand(cx, $ctx, o, bits, float)
        };
        $(
            let $dst = |cx: &mut Dcx, o: &Operand| -> Result<Slot, LoadError> {
                match o {
                    Operand::Name(n) if n == "_" => Ok(cx.sink),
                    Operand::Name(n) => $ctx.reg(n),
                    _ => err($line, format!("bad destination operand in `{}`", $opcode)),
                }
            };
        )?
    };
}

/// The oldest `.target` an instruction family assembles for (ptxas and a driver's JIT refuse it
/// below), whether it needs the architecture-specific `sm_90a` (wgmma, setmaxnreg: not forward
/// compatible), and its name for the message. `None`: every target the VM loads.
fn required_target(opcode: &str) -> Option<(u32, bool, &'static str)> {
    let base = opcode.split('.').next().unwrap_or("");
    Some(match base {
        "wgmma" => (90, true, "wgmma"),
        "setmaxnreg" => (90, true, "setmaxnreg"),
        "elect" => (90, false, "elect.sync"),
        "mbarrier" if opcode.contains("expect_tx") || opcode.contains("try_wait") => {
            (90, false, "mbarrier.expect_tx / try_wait")
        }
        "cp" if opcode.starts_with("cp.async.bulk") => (90, false, "cp.async.bulk"),
        "cp" if opcode.starts_with("cp.async") => (80, false, "cp.async"),
        "fence" if opcode.contains("proxy.tensormap") || opcode.contains("mbarrier_init") => {
            (90, false, "fence.proxy.tensormap / fence.mbarrier_init")
        }
        "mma" => (80, false, "mma.sync.m16n8k16"),
        "ldmatrix" => (75, false, "ldmatrix"),
        "redux" => (80, false, "redux.sync"),
        "cvt" if opcode.contains("e4m3") || opcode.contains("e5m2") => (89, false, "cvt to or from FP8"),
        _ => return None,
    })
}

/// The module's GPU architecture (`.target sm_80`, `sm_90a`, ...): its number and whether it is
/// the architecture-specific (`a`) form; `None` without a `.target`.
fn module_target(target: &str) -> Option<(u32, bool)> {
    let sm = target.split(',').map(str::trim).find_map(|t| t.strip_prefix("sm_"))?;
    let a = sm.ends_with('a');
    sm.trim_end_matches(['a', 'f']).parse().ok().map(|n| (n, a))
}

/// Decodes one instruction: the opcode's family decides which decoder reads it.
fn decode_inst(cx: &mut Dcx, ctx: &Ictx, i: &InstAst, fname: &str) -> Result<Decoded, LoadError> {
    let opcode = i.opcode.as_str();
    if let (Some((min, needs_a, what)), Some((sm, a))) = (required_target(opcode), module_target(&cx.ast.target)) {
        let ok = if needs_a { sm == 90 && a } else { sm >= min };
        if !ok {
            let need = if needs_a { "sm_90a".to_string() } else { format!("sm_{min} or newer") };
            return err(
                i.line,
                format!("`{opcode}`: {what} needs .target {need}, but the module declares .target {}", cx.ast.target),
            );
        }
    }
    let base = opcode.split('.').next().unwrap_or("");
    let mut m = Mods::new(opcode);
    match base {
        "ld" | "ldu" | "st" | "atom" | "red" | "cp" | "ldmatrix" => decode_memory(cx, ctx, i, &mut m),
        "bra" | "call" | "ret" | "exit" | "trap" | "brkpt" | "bar" | "barrier" | "membar" | "fence" | "prefetch"
        | "prefetchu" | "discard" | "nanosleep" | "pmevent" => decode_control(cx, ctx, i, &mut m, fname),
        "shfl" | "vote" | "redux" | "match" | "mma" => decode_warp(cx, ctx, i, &mut m),
        "wgmma" => decode_wgmma(cx, ctx, i).map(|op| (op, None)),
        "mbarrier" | "elect" | "setmaxnreg" => hopper::decode(cx, ctx, i, &mut m),
        _ => decode_data(cx, ctx, i, &mut m),
    }
}

/// Moves, arithmetic, selection, comparison and conversion (`mov`, `activemask`, the arithmetic
/// family, `selp`, `setp`/`set`, `cvt`, `cvta`).
fn decode_data(cx: &mut Dcx, ctx: &Ictx, i: &InstAst, m: &mut Mods) -> Result<Decoded, LoadError> {
    inst_prelude!(ctx, i => line, opcode, base, ops, nops, src, dst);
    let op = match base {
        "mov" => {
            let t = m.ty().ok_or(LoadError { line, message: format!("`{opcode}` needs a type") })?;
            m.finish(line, opcode)?;
            nops(2)?;
            let bits = t.bits();
            match (&ops[0], &ops[1]) {
                (Operand::Vec(ds), a) => {
                    let n = ds.len();
                    if !(n == 2 || n == 4) || bits % n as u32 != 0 {
                        return err(line, "bad vector unpack");
                    }
                    let mut arr = [NONE; 4];
                    for (k, d) in ds.iter().enumerate() {
                        arr[k] = dst(cx, d)?;
                    }
                    let a = src(cx, a, bits, false)?;
                    Op::Unpack { ds: arr, n: n as u8, bits: (bits / n as u32) as u8, a }
                }
                (d, Operand::Vec(ps)) => {
                    let n = ps.len();
                    if !(n == 2 || n == 4) || bits % n as u32 != 0 {
                        return err(line, "bad vector pack");
                    }
                    let pb = bits / n as u32;
                    let mut arr = [NONE; 4];
                    for (k, p) in ps.iter().enumerate() {
                        arr[k] = src(cx, p, pb, false)?;
                    }
                    Op::Pack { d: dst(cx, d)?, parts: arr, n: n as u8, bits: pb as u8 }
                }
                (d, Operand::Name(n)) if n == "%clock" || n == "%clock64" || n == "%globaltimer" => {
                    Op::Clock { d: dst(cx, d)? }
                }
                (d, a) => {
                    let a = src(cx, a, bits, t.is_float())?;
                    Op::Mov { d: dst(cx, d)?, a }
                }
            }
        }
        "activemask" => {
            m.has("b32");
            m.finish(line, opcode)?;
            nops(1)?;
            Op::Activemask { d: dst(cx, &ops[0])? }
        }
        "add" | "sub" | "mul" | "mad" | "fma" | "div" | "rem" | "min" | "max" | "abs" | "neg" | "and" | "or"
        | "xor" | "not" | "cnot" | "popc" | "clz" | "brev" | "bfe" | "bfi" | "shl" | "shr" | "prmt" | "copysign"
        | "rcp" | "sqrt" | "rsqrt" | "ex2" | "lg2" | "sin" | "cos" | "tanh" | "mul24" | "mad24" | "sad" => {
            arith(cx, ctx, m, i, base)?
        }
        "selp" => {
            let t = m.ty().ok_or(LoadError { line, message: "selp needs a type".into() })?;
            m.finish(line, opcode)?;
            nops(4)?;
            let b = t.bits();
            let f = t.is_float();
            Op::Selp {
                d: dst(cx, &ops[0])?,
                a: src(cx, &ops[1], b, f)?,
                b: src(cx, &ops[2], b, f)?,
                p: src(cx, &ops[3], 1, false)?,
            }
        }
        "setp" | "set" => {
            let cmp = match m.any(&[
                "eq", "ne", "lt", "le", "gt", "ge", "lo", "ls", "hi", "hs", "equ", "neu", "ltu", "leu", "gtu", "geu",
                "num", "nan",
            ]) {
                Some("eq") => Cmp::Eq,
                Some("ne") => Cmp::Ne,
                Some("lt") | Some("lo") => Cmp::Lt,
                Some("le") | Some("ls") => Cmp::Le,
                Some("gt") | Some("hi") => Cmp::Gt,
                Some("ge") | Some("hs") => Cmp::Ge,
                Some("equ") => Cmp::Equ,
                Some("neu") => Cmp::Neu,
                Some("ltu") => Cmp::Ltu,
                Some("leu") => Cmp::Leu,
                Some("gtu") => Cmp::Gtu,
                Some("geu") => Cmp::Geu,
                Some("num") => Cmp::Num,
                Some("nan") => Cmp::Nan,
                _ => return err(line, format!("`{opcode}`: missing comparison")),
            };
            let unsigned_cmp = opcode.contains(".lo.")
                || opcode.contains(".ls.")
                || opcode.contains(".hi.")
                || opcode.contains(".hs.");
            let comb = match m.any(&["and", "or", "xor"]) {
                Some("and") => 1,
                Some("or") => 2,
                Some("xor") => 3,
                _ => 0,
            };
            let ftz = m.has("ftz");
            let mut ty = m.ty().ok_or(LoadError { line, message: format!("`{opcode}` needs a type") })?;
            let dty = if base == "set" {
                Some(m.ty().ok_or(LoadError { line, message: "set needs two types".into() })?)
            } else {
                None
            };
            if unsigned_cmp {
                if let Ty::S(b) = ty {
                    ty = Ty::U(b);
                }
            }
            if ty == Ty::F16 || ty == Ty::BF16 || ty == Ty::Pred {
                return err(line, format!("`{opcode}`: unsupported comparison type"));
            }
            m.finish(line, opcode)?;
            let n = ops.len();
            if !(n == 3 || n == 4) || (comb == 0) != (n == 3) {
                return err(line, format!("`{opcode}`: wrong operand count"));
            }
            let bits = ty.bits();
            let (c, negc) = if n == 4 {
                match &ops[3] {
                    Operand::Not(p) => (ctx.reg(p)?, true),
                    o => (src(cx, o, 1, false)?, false),
                }
            } else {
                (NONE, false)
            };
            let a = src(cx, &ops[1], bits, ty.is_float())?;
            let b = src(cx, &ops[2], bits, ty.is_float())?;
            if base == "setp" {
                let (d, d2) = match &ops[0] {
                    Operand::Pair(p, q) => (ctx.reg(p)?, ctx.reg(q)?),
                    o => (dst(cx, o)?, NONE),
                };
                Op::Setp { cmp, ty, ftz, comb, negc, d, d2, a, b, c }
            } else {
                let dty = dty.expect("set dtype");
                Op::Set { cmp, ty, ftz, comb, negc, float_dst: dty == Ty::F32, d: dst(cx, &ops[0])?, a, b, c }
            }
        }
        "cvt" if opcode.ends_with(".f16x2.e4m3x2") || opcode.ends_with(".f16x2.e5m2x2") => {
            // cvt.rn.f16x2.{e4m3x2,e5m2x2} d, a (sm_89+): two FP8 values in a's 16 bits.
            let e4m3 = m.any(&["e4m3x2", "e5m2x2"]) == Some("e4m3x2");
            if !m.has("rn") || !m.has("f16x2") {
                return err(line, format!("`{opcode}`: the FP8 conversions take .rn and write .f16x2"));
            }
            m.finish(line, opcode)?;
            nops(2)?;
            let f: F1 = if e4m3 { ops::cvt_f16x2_fp8x2::<true> } else { ops::cvt_f16x2_fp8x2::<false> };
            Op::Un { f, d: dst(cx, &ops[0])?, a: src(cx, &ops[1], 16, false)? }
        }
        "cvt" if opcode.contains("16x2.") => {
            // cvt.{rn,rz}.{bf16x2,f16x2}.f32 d, a, b: d = {round(a) in bits 16..32, round(b) in 0..16}.
            let rz = match m.any(&["rn", "rz"]) {
                Some("rn") => false,
                Some("rz") => true,
                _ => return err(line, format!("`{opcode}`: packed conversions need .rn or .rz")),
            };
            let bf = match m.any(&["bf16x2", "f16x2"]) {
                Some("bf16x2") => true,
                Some("f16x2") => false,
                _ => return err(line, format!("unsupported packed conversion `{opcode}`")),
            };
            if !m.has("f32") {
                return err(line, format!("`{opcode}`: packed conversions read .f32"));
            }
            m.finish(line, opcode)?;
            nops(3)?;
            let f: F2 = match (bf, rz) {
                (true, false) => ops::cvt_x2::<true, false>,
                (true, true) => ops::cvt_x2::<true, true>,
                (false, false) => ops::cvt_x2::<false, false>,
                (false, true) => ops::cvt_x2::<false, true>,
            };
            Op::Bin {
                f,
                k: if bf && !rz { IntK::CvtBf16x2 } else { IntK::Fn },
                d: dst(cx, &ops[0])?,
                a: src(cx, &ops[1], 32, true)?,
                b: src(cx, &ops[2], 32, true)?,
            }
        }
        "cvt" => {
            let (rnd, int_round) = rnd_of(m);
            let ftz = m.has("ftz");
            let sat = m.has("sat");
            let from = m.ty().ok_or(LoadError { line, message: "cvt needs two types".into() })?;
            let to = m.ty().ok_or(LoadError { line, message: "cvt needs two types".into() })?;
            m.finish(line, opcode)?;
            nops(2)?;
            let fm = FMode { rnd, ftz, sat, int_round };
            let d = dst(cx, &ops[0])?;
            let a = src(cx, &ops[1], from.bits(), from.is_float())?;
            if to == Ty::Pred || from == Ty::Pred {
                return err(line, "cvt with .pred is not valid");
            }
            if !to.is_float() && !from.is_float() && !sat {
                // (Run inline by the executor: `exec::int_cvt`, the same values as `ops::int_cvt`.)
                Op::Cvt { to, from, m: fm, d, a }
            } else {
                Op::Cvt { to, from, m: fm, d, a }
            }
        }
        "cvta" => {
            let to = m.has("to");
            let sp = match m.any(&["global", "shared", "local", "const", "param"]) {
                Some("global") | Some("const") => 0u64,
                Some("shared") => SHARED_WINDOW,
                Some("local") => LOCAL_WINDOW,
                Some("param") => PARAM_WINDOW,
                _ => return err(line, "cvta needs a state space"),
            };
            let t = m.ty().ok_or(LoadError { line, message: "cvta needs a size".into() })?;
            m.finish(line, opcode)?;
            nops(2)?;
            let bits = t.bits();
            let a = src(cx, &ops[1], bits, false)?;
            let delta = if to { sp.wrapping_neg() } else { sp };
            let k = cx.konst(delta);
            let f: F2 = if bits == 32 { ops::add::<32> } else { ops::add::<64> };
            Op::Bin { f, k: IntK::Fn, d: dst(cx, &ops[0])?, a, b: k }
        }
        _ => return err(line, format!("unsupported instruction `{opcode}`")),
    };
    Ok((op, None))
}

/// Loads, stores, atomics and the asynchronous and matrix loads (`ld`/`ldu`/`st`, `atom`/`red`,
/// `cp.async`, `ldmatrix`).
fn decode_memory(cx: &mut Dcx, ctx: &Ictx, i: &InstAst, m: &mut Mods) -> Result<Decoded, LoadError> {
    inst_prelude!(ctx, i => line, opcode, base, ops, nops, src, dst);
    let op = match base {
        "ld" | "ldu" | "st" => {
            let is_ld = base != "st";
            m.ignore_hints();
            let sp = match m.any(&["global", "shared", "local", "param", "const"]) {
                Some("global") | Some("const") => Space::Global,
                Some("shared") => Space::Shared,
                Some("local") => Space::Local,
                Some("param") => Space::Param,
                _ => Space::Generic,
            };
            m.has("shared::cta");
            let n = match m.any(&["v2", "v4"]) {
                Some("v2") => 2,
                Some("v4") => 4,
                _ => 1,
            };
            let t = m.ty().ok_or(LoadError { line, message: format!("`{opcode}` needs a type") })?;
            m.finish(line, opcode)?;
            nops(2)?;
            let size = t.bits().div_ceil(8);
            if size > 8 {
                return err(line, format!("`{opcode}`: 128-bit accesses are not supported"));
            }
            let (regs_op, addr_op) = if is_ld { (&ops[0], &ops[1]) } else { (&ops[1], &ops[0]) };
            let regs: Vec<&Operand> = match regs_op {
                Operand::Vec(v) if v.len() == n && n > 1 => v.iter().collect(),
                o if n == 1 => vec![o],
                _ => return err(line, format!("`{opcode}`: vector operand does not match .v{n}")),
            };
            let mut arr = [NONE; 4];
            for (k, r) in regs.iter().enumerate() {
                arr[k] = if is_ld { dst(cx, r)? } else { src(cx, r, t.bits(), t.is_float())? };
            }
            let Operand::Addr { base: abase, off } = addr_op else {
                return err(line, format!("`{opcode}`: expected an address operand `[...]`"));
            };
            // Function-scope param variables live in registers.
            if let Some(Sym::PVar(b, nslots)) = abase.as_ref().and_then(|b| ctx.lookup(b)) {
                let (b, nslots) = (*b, *nslots);
                if *off < 0
                    || (*off as u64 + (n as u64 * size as u64)) > nslots as u64 * 8
                    || !(*off as usize).is_multiple_of(size as usize)
                {
                    return err(line, format!("`{opcode}`: access outside or misaligned in the param variable"));
                }
                if sp != Space::Param {
                    return err(line, "param variable accessed outside `.param` space");
                }
                let off = *off as u32;
                if is_ld {
                    Op::LdSlot { size: size as u8, n: n as u8, ds: arr, base: b, off }
                } else {
                    Op::StSlot { size: size as u8, n: n as u8, srcs: arr, base: b, off }
                }
            } else {
                let (a, off) = address(cx, ctx, abase.as_deref(), *off, sp)?;
                if !is_ld && sp == Space::Param {
                    return err(line, "stores to kernel parameters are not supported");
                }
                if is_ld {
                    Op::Ld {
                        sp,
                        size: size as u8,
                        n: n as u8,
                        sext: t.is_signed(),
                        dbits: if size < 4 { 32 } else { (size * 8) as u8 },
                        ds: arr,
                        a,
                        off,
                    }
                } else {
                    Op::St { sp, size: size as u8, n: n as u8, srcs: arr, a, off }
                }
            }
        }
        "atom" | "red" => {
            m.ignore_hints();
            let sp = match m.any(&["global", "shared"]) {
                Some("global") => Space::Global,
                Some("shared") => Space::Shared,
                _ => Space::Generic,
            };
            let aop = match m.any(&["add", "min", "max", "inc", "dec", "and", "or", "xor", "exch", "cas"]) {
                Some("add") => AtomOp::Add,
                Some("min") => AtomOp::Min,
                Some("max") => AtomOp::Max,
                Some("inc") => AtomOp::Inc,
                Some("dec") => AtomOp::Dec,
                Some("and") => AtomOp::And,
                Some("or") => AtomOp::Or,
                Some("xor") => AtomOp::Xor,
                Some("exch") => AtomOp::Exch,
                Some("cas") => AtomOp::Cas,
                _ => return err(line, format!("`{opcode}`: unsupported atomic operation")),
            };
            let ty = m.ty().ok_or(LoadError { line, message: format!("`{opcode}` needs a type") })?;
            m.finish(line, opcode)?;
            let ok_ty = match ty {
                Ty::U(32) | Ty::U(64) | Ty::S(32) | Ty::S(64) | Ty::B(32) | Ty::B(64) => true,
                Ty::F32 | Ty::F64 => aop == AtomOp::Add || aop == AtomOp::Exch,
                _ => false,
            };
            if !ok_ty {
                return err(line, format!("`{opcode}`: unsupported atomic type"));
            }
            let bits = ty.bits();
            let (d, rest) = if base == "atom" { (Some(&ops[0]), &ops[1..]) } else { (None, &ops[..]) };
            let want = if aop == AtomOp::Cas { 3 } else { 2 };
            if rest.len() != want {
                return err(line, format!("`{opcode}`: wrong operand count"));
            }
            let d = match d {
                Some(o) => dst(cx, o)?,
                None => cx.sink,
            };
            let Operand::Addr { base: abase, off } = &rest[0] else {
                return err(line, format!("`{opcode}`: expected an address"));
            };
            let (a, off) = address(cx, ctx, abase.as_deref(), *off, sp)?;
            let b = src(cx, &rest[1], bits, ty.is_float())?;
            let c = if aop == AtomOp::Cas { src(cx, &rest[2], bits, false)? } else { NONE };
            Op::Atom { sp, op: aop, ty, d, a, off, b, c }
        }
        "cp" if opcode.starts_with("cp.async.bulk") => hopper::decode_bulk(cx, ctx, i, m)?,
        "cp" => decode_cp_async(cx, ctx, m, i)?,
        "ldmatrix" => {
            m.has("sync");
            m.has("aligned");
            if !m.has("m8n8") {
                return err(line, format!("`{opcode}`: only the .m8n8 shape is supported"));
            }
            let num = match m.any(&["x1", "x2", "x4"]) {
                Some("x1") => 1,
                Some("x2") => 2,
                Some("x4") => 4,
                _ => return err(line, format!("`{opcode}` needs .x1, .x2 or .x4")),
            };
            let trans = m.has("trans");
            let sp = if m.has("shared") || m.has("shared::cta") { Space::Shared } else { Space::Generic };
            if !m.has("b16") {
                return err(line, format!("`{opcode}`: only .b16 is supported"));
            }
            m.finish(line, opcode)?;
            if !opcode.contains(".sync") || !opcode.contains(".aligned") {
                return err(line, format!("`{opcode}` needs .sync.aligned"));
            }
            nops(2)?;
            let regs: Vec<&Operand> = match &ops[0] {
                Operand::Vec(v) => v.iter().collect(),
                o => vec![o],
            };
            if regs.len() != num {
                return err(line, format!("`{opcode}` writes {num} registers, found {}", regs.len()));
            }
            let mut ds = [NONE; 4];
            for (k, r) in regs.iter().enumerate() {
                ds[k] = dst(cx, r)?;
            }
            let Operand::Addr { base: abase, off } = &ops[1] else {
                return err(line, format!("`{opcode}`: expected an address operand `[...]`"));
            };
            let (a, off) = address(cx, ctx, abase.as_deref(), *off, sp)?;
            let off = i32::try_from(off).map_err(|_| LoadError { line, message: "address offset too large".into() })?;
            Op::Ldmatrix { num: num as u8, trans, sp, ds, a, off }
        }
        _ => return err(line, format!("unsupported instruction `{opcode}`")),
    };
    Ok((op, None))
}

/// Control flow, barriers and hints (`bra`, `call`, `ret`, `exit`, `trap`, `bar`, no-ops).
fn decode_control(cx: &mut Dcx, ctx: &Ictx, i: &InstAst, m: &mut Mods, fname: &str) -> Result<Decoded, LoadError> {
    inst_prelude!(ctx, i => line, opcode, base, ops, nops, src);
    let op = match base {
        "bra" => {
            m.has("uni");
            m.finish(line, opcode)?;
            nops(1)?;
            let Operand::Name(l) = &ops[0] else { return err(line, "bra needs a label") };
            return Ok((Op::Bra { t: 0 }, Some(l.clone())));
        }
        "call" => {
            m.has("uni");
            m.finish(line, opcode)?;
            return decode_call(cx, ctx, i, fname).map(|op| (op, None));
        }
        "ret" => {
            m.has("uni");
            m.finish(line, opcode)?;
            Op::Ret
        }
        "exit" => Op::Exit,
        "trap" | "brkpt" => Op::Trap,
        // A launch is a cluster of one block: the cluster barrier is the block's.
        "barrier" if opcode.starts_with("barrier.cluster.") => {
            m.has("cluster");
            let wait = m.any(&["arrive", "wait"]) == Some("wait");
            m.ignore_hints();
            m.finish(line, opcode)?;
            nops(0)?;
            if wait {
                Op::Bar
            } else {
                Op::Nop
            }
        }
        "bar" | "barrier" => {
            m.ignore_hints();
            if m.has("warp") {
                m.has("sync");
                m.finish(line, opcode)?;
                Op::BarWarp
            } else {
                let arrive = m.has("arrive");
                if !arrive && !m.has("sync") {
                    let is_plain = base == "bar" && m.parts.is_empty();
                    if !is_plain {
                        return err(
                            line,
                            format!("`{opcode}` is not supported (only bar.sync / bar.arrive / barrier.sync / barrier.arrive)"),
                        );
                    }
                }
                m.has("aligned");
                m.finish(line, opcode)?;
                if ops.is_empty() || ops.len() > 2 {
                    return err(line, format!("`{opcode}` needs a barrier id (and a thread count)"));
                }
                let id = src(cx, &ops[0], 32, false)?;
                if ops.len() == 2 {
                    // A named barrier of `count` threads: the warps that sync on it wait for
                    // that many arrivals (syncs and arrives, 32 per warp).
                    Op::NamedBar { id, count: src(cx, &ops[1], 32, false)?, arrive }
                } else if arrive {
                    return err(line, format!("`{opcode}` needs a thread count (bar.arrive a, b)"));
                } else {
                    Op::Bar
                }
            }
        }
        "membar" | "fence" | "prefetch" | "prefetchu" | "discard" | "nanosleep" | "pmevent" => Op::Nop,
        _ => return err(line, format!("unsupported instruction `{opcode}`")),
    };
    Ok((op, None))
}

/// Warp-collective instructions (`shfl`, `vote`, `redux`, `match`, `mma`).
fn decode_warp(cx: &mut Dcx, ctx: &Ictx, i: &InstAst, m: &mut Mods) -> Result<Decoded, LoadError> {
    inst_prelude!(ctx, i => line, opcode, base, ops, nops, src, dst);
    let op = match base {
        "shfl" => {
            m.has("sync");
            let mode = match m.any(&["up", "down", "bfly", "idx"]) {
                Some("up") => 0,
                Some("down") => 1,
                Some("bfly") => 2,
                Some("idx") => 3,
                _ => return err(line, "shfl needs a mode"),
            };
            m.has("b32");
            m.finish(line, opcode)?;
            if !opcode.contains(".sync") {
                return err(line, "only shfl.sync is supported");
            }
            nops(5)?;
            let (d, p) = match &ops[0] {
                Operand::Pair(d, p) => (ctx.reg(d)?, ctx.reg(p)?),
                o => (dst(cx, o)?, NONE),
            };
            let (a, b, c) = (src(cx, &ops[1], 32, false)?, src(cx, &ops[2], 32, false)?, src(cx, &ops[3], 32, false)?);
            // Constant lane operands (the kernels' reductions): the source lanes now.
            let value = |s: Slot| cx.const_list.iter().rev().find(|&&(k, _)| k == s).map(|&(_, v)| v);
            let perm = match (value(b), value(c)) {
                (Some(bv), Some(cv)) if cx.shfl_perms.len() < NO_PERM as usize => {
                    cx.shfl_perms.push(crate::exec::shfl_sources(mode, bv, cv));
                    (cx.shfl_perms.len() - 1) as u16
                }
                _ => NO_PERM,
            };
            Op::Shfl { mode, perm, d, p, a, b, c, mask: src(cx, &ops[4], 32, false)? }
        }
        "vote" => {
            m.has("sync");
            let mode = match m.any(&["all", "any", "uni", "ballot"]) {
                Some("all") => 0,
                Some("any") => 1,
                Some("uni") => 2,
                Some("ballot") => 3,
                _ => return err(line, "vote needs a mode"),
            };
            m.any(&["pred", "b32"]);
            m.finish(line, opcode)?;
            if ops.len() != 3 && ops.len() != 2 {
                return err(line, "vote: wrong operand count");
            }
            let (a, neg) = match &ops[1] {
                Operand::Not(p) => (ctx.reg(p)?, true),
                o => (src(cx, o, 1, false)?, false),
            };
            let mask = if ops.len() == 3 { src(cx, &ops[2], 32, false)? } else { cx.konst(0xffff_ffff) };
            Op::Vote { mode, neg, d: dst(cx, &ops[0])?, a, mask }
        }
        "redux" => {
            m.has("sync");
            let op = match m.any(&["add", "min", "max", "and", "or", "xor"]) {
                Some("add") => 0,
                Some("min") => 1,
                Some("max") => 2,
                Some("and") => 3,
                Some("or") => 4,
                Some("xor") => 5,
                _ => return err(line, "redux: unsupported operation"),
            };
            let t = m.ty().ok_or(LoadError { line, message: "redux needs a type".into() })?;
            m.finish(line, opcode)?;
            if t.bits() != 32 || t.is_float() {
                return err(line, "redux: only 32-bit integer types are supported");
            }
            nops(3)?;
            Op::Redux {
                op,
                signed: t.is_signed(),
                d: dst(cx, &ops[0])?,
                a: src(cx, &ops[1], 32, false)?,
                mask: src(cx, &ops[2], 32, false)?,
            }
        }
        "match" => {
            let all = match m.any(&["any", "all"]) {
                Some("all") => true,
                Some("any") => false,
                _ => return err(line, "match needs .any or .all"),
            };
            m.has("sync");
            let t = m.ty().ok_or(LoadError { line, message: "match needs a type".into() })?;
            m.finish(line, opcode)?;
            nops(3)?;
            let (d, p) = match &ops[0] {
                Operand::Pair(d, p) if all => (ctx.reg(d)?, ctx.reg(p)?),
                o => (dst(cx, o)?, NONE),
            };
            Op::Match {
                all,
                bits64: t.bits() == 64,
                d,
                p,
                a: src(cx, &ops[1], t.bits(), false)?,
                mask: src(cx, &ops[2], 32, false)?,
            }
        }
        "mma" => {
            m.has("sync");
            m.has("aligned");
            let k16 = match m.any(&["m16n8k16", "m16n8k8"]) {
                Some("m16n8k16") => true,
                Some("m16n8k8") => false,
                _ => return err(line, format!("`{opcode}`: only the m16n8k16 and m16n8k8 shapes are supported")),
            };
            if !m.has("row") || !m.has("col") {
                return err(line, format!("`{opcode}`: only the .row.col layout is supported"));
            }
            let tys: Vec<Option<Ty>> = (0..4).map(|_| m.ty()).collect();
            // m.ty() takes the last type first: C, B, A, D.
            let kind = match (tys[0], tys[1], tys[2], tys[3]) {
                (Some(Ty::F32), Some(Ty::BF16), Some(Ty::BF16), Some(Ty::F32)) => crate::tensor_core::HalfKind::Bf16,
                (Some(Ty::F32), Some(Ty::F16), Some(Ty::F16), Some(Ty::F32)) => crate::tensor_core::HalfKind::F16,
                _ => {
                    return err(line, format!("`{opcode}`: only .f32.bf16.bf16.f32 and .f32.f16.f16.f32 are supported"))
                }
            };
            m.finish(line, opcode)?;
            if !opcode.contains(".sync") || !opcode.contains(".aligned") {
                return err(line, format!("`{opcode}` needs .sync.aligned"));
            }
            nops(4)?;
            let (na, nb) = if k16 { (4, 2) } else { (2, 1) };
            let list = |k: usize, want: usize| -> Result<&Vec<Operand>, LoadError> {
                match &ops[k] {
                    Operand::Vec(v) if v.len() == want => Ok(v),
                    _ => err(line, format!("`{opcode}`: operand {k} must be a vector of {want} registers")),
                }
            };
            let mut d = [NONE; 4];
            for (k, o) in list(0, 4)?.iter().enumerate() {
                d[k] = dst(cx, o)?;
            }
            let mut srcs = MmaSrcs { a: [NONE; 4], b: [NONE; 2], c: [NONE; 4] };
            for (k, o) in list(1, na)?.iter().enumerate() {
                srcs.a[k] = src(cx, o, 32, false)?;
            }
            for (k, o) in list(2, nb)?.iter().enumerate() {
                srcs.b[k] = src(cx, o, 32, false)?;
            }
            for (k, o) in list(3, 4)?.iter().enumerate() {
                srcs.c[k] = src(cx, o, 32, true)?;
            }
            cx.mma_srcs.push(srcs);
            Op::Mma { kind, k16, d, srcs: (cx.mma_srcs.len() - 1) as u32 }
        }
        _ => return err(line, format!("unsupported instruction `{opcode}`")),
    };
    Ok((op, None))
}

/// `wgmma.fence`, `wgmma.commit_group`, `wgmma.wait_group N` and
/// `wgmma.mma_async.sync.aligned.m64nNk16.{f32,f16}.{f16,bf16}.{f16,bf16}` in its descriptor-A
/// and register-A forms (semantics in `wgmma.rs`).
fn decode_wgmma(cx: &mut Dcx, ctx: &Ictx, i: &InstAst) -> Result<Op, LoadError> {
    use crate::wgmma::{ASrc, AccKind, WgmmaInst};
    let line = i.line;
    let opcode = i.opcode.as_str();
    let ops = &i.ops;
    let parts: Vec<&str> = opcode.split('.').skip(1).collect();
    let Some((&what, rest)) = parts.split_first() else {
        return err(line, format!("unsupported instruction `{opcode}`"));
    };
    let rest: Vec<&str> = rest.iter().copied().filter(|p| !matches!(*p, "sync" | "aligned")).collect();
    if !opcode.contains(".sync") || !opcode.contains(".aligned") {
        return err(line, format!("`{opcode}` needs .sync.aligned"));
    }
    let imm = |o: &Operand| -> Option<i64> {
        match o {
            Operand::Num(Number::Int(v)) => Some(*v as i64),
            Operand::NegNum(Number::Int(v)) => Some((*v as i64).wrapping_neg()),
            _ => None,
        }
    };
    match what {
        "fence" | "commit_group" if rest.is_empty() => {
            if !ops.is_empty() {
                return err(line, format!("`{opcode}` takes no operands"));
            }
            return Ok(if what == "fence" { Op::WgmmaFence } else { Op::WgmmaCommit });
        }
        "wait_group" if rest.is_empty() => {
            return match ops.as_slice() {
                [o] => match imm(o) {
                    Some(n) if (0..=u32::MAX as i64).contains(&n) => Ok(Op::WgmmaWait { n: n as u32 }),
                    _ => err(line, format!("`{opcode}` needs an integer constant")),
                },
                _ => err(line, format!("`{opcode}` expects 1 operand, found {}", ops.len())),
            };
        }
        "mma_async" => {}
        _ => return err(line, format!("unsupported instruction `{opcode}`")),
    }
    let supported = "supported: wgmma.mma_async.sync.aligned.m64nNk16 (N = 8, 16, ..., 256) with \
                     .f32.f16.f16, .f32.bf16.bf16 or .f16.f16.f16";
    let (shape, types) = match rest.split_first() {
        Some((s, t)) if !rest.contains(&"sp") && !rest.contains(&"satfinite") => (*s, t),
        _ => return err(line, format!("`{opcode}` is not supported ({supported})")),
    };
    let dims = shape
        .strip_prefix("m64n")
        .and_then(|s| s.split_once('k'))
        .and_then(|(n, k)| Some((n.parse::<u32>().ok()?, k.parse::<u32>().ok()?)));
    let Some((n, k)) = dims else {
        return err(line, format!("`{opcode}`: bad shape `.{shape}` ({supported})"));
    };
    let (kind, acc) = match types {
        ["f32", "bf16", "bf16"] => (crate::tensor_core::HalfKind::Bf16, AccKind::F32),
        ["f32", "f16", "f16"] => (crate::tensor_core::HalfKind::F16, AccKind::F32),
        ["f16", "f16", "f16"] => (crate::tensor_core::HalfKind::F16, AccKind::F16),
        _ => {
            let t = types.join(".");
            let family = match types.get(1).copied() {
                Some("tf32") => "tf32 (k8) wgmma",
                Some("e4m3" | "e5m2") => "fp8 (k32) wgmma",
                Some("s8" | "u8") => "integer (k32) wgmma",
                Some("b1") => "single-bit (k256) wgmma",
                _ => "this type combination",
            };
            return err(line, format!("`{opcode}`: {family} (.{t}) is not supported ({supported})"));
        }
    };
    if k != 16 || n == 0 || n > 256 || n % 8 != 0 {
        return err(line, format!("`{opcode}`: shape `.{shape}` is not valid for .{} ({supported})", types.join(".")));
    }
    let desc_a = ops.len() == 8;
    if ops.len() != 8 && ops.len() != 7 {
        return err(
            line,
            format!(
                "`{opcode}` expects d, a-desc, b-desc, scale-d, imm-scale-a, imm-scale-b, imm-trans-a, imm-trans-b \
                 (or d, {{a0, a1, a2, a3}}, b-desc, scale-d, imm-scale-a, imm-scale-b, imm-trans-b), found {} operands",
                ops.len()
            ),
        );
    }
    let nd = match acc {
        AccKind::F32 => n / 2,
        AccKind::F16 => n / 4,
    } as usize;
    let d = match &ops[0] {
        Operand::Vec(v) if v.len() == nd => v
            .iter()
            .map(|o| match o {
                Operand::Name(r) => ctx.reg(r),
                _ => err(line, format!("`{opcode}`: bad accumulator operand")),
            })
            .collect::<Result<Vec<Slot>, LoadError>>()?,
        _ => return err(line, format!("`{opcode}`: operand 0 must be a vector of {nd} registers")),
    };
    let a = if desc_a {
        ASrc::Desc(src_operand(cx, ctx, &ops[1], 64, false)?)
    } else {
        match &ops[1] {
            Operand::Vec(v) if v.len() == 4 => {
                let mut r = [NONE; 4];
                for (k, o) in v.iter().enumerate() {
                    r[k] = src_operand(cx, ctx, o, 32, false)?;
                }
                ASrc::Regs(r)
            }
            _ => return err(line, format!("`{opcode}`: A must be a descriptor or a vector of 4 registers")),
        }
    };
    let b = src_operand(cx, ctx, &ops[2], 64, false)?;
    let scale_d = match &ops[3] {
        Operand::Name(p) => ctx.reg(p)?,
        o => match imm(o) {
            Some(v @ (0 | 1)) => cx.konst(v as u64),
            _ => return err(line, format!("`{opcode}`: scale-d must be a predicate (or 0 / 1)")),
        },
    };
    let sign = |o: &Operand, what: &str| -> Result<bool, LoadError> {
        match imm(o) {
            Some(1) => Ok(false),
            Some(-1) => Ok(true),
            _ => err(line, format!("`{opcode}`: {what} must be 1 or -1")),
        }
    };
    let flag = |o: &Operand, what: &str| -> Result<bool, LoadError> {
        match imm(o) {
            Some(0) => Ok(false),
            Some(1) => Ok(true),
            _ => err(line, format!("`{opcode}`: {what} must be 0 or 1")),
        }
    };
    let neg_a = sign(&ops[4], "imm-scale-a")?;
    let neg_b = sign(&ops[5], "imm-scale-b")?;
    let (trans_a, trans_b) = if desc_a {
        (flag(&ops[6], "imm-trans-a")?, flag(&ops[7], "imm-trans-b")?)
    } else {
        (false, flag(&ops[6], "imm-trans-b")?)
    };
    cx.wgmma.push(WgmmaInst { n, kind, acc, d, a, b, scale_d, neg_a, neg_b, trans_a, trans_b });
    Ok(Op::WgmmaMma { i: (cx.wgmma.len() - 1) as u32 })
}

/// `cp.async.{ca,cg}.shared{::cta}.global [dst], [src], cp-size{, src-size}`,
/// `cp.async.commit_group`, `cp.async.wait_group N`, `cp.async.wait_all`.
fn decode_cp_async(cx: &mut Dcx, ctx: &Ictx, m: &mut Mods, i: &InstAst) -> Result<Op, LoadError> {
    let line = i.line;
    let opcode = i.opcode.as_str();
    let ops = &i.ops;
    if !m.has("async") {
        return err(line, format!("unsupported instruction `{opcode}`"));
    }
    if m.has("commit_group") {
        m.finish(line, opcode)?;
        if !ops.is_empty() {
            return err(line, "cp.async.commit_group takes no operands");
        }
        return Ok(Op::CpCommit);
    }
    if m.has("wait_all") {
        m.finish(line, opcode)?;
        if !ops.is_empty() {
            return err(line, "cp.async.wait_all takes no operands");
        }
        return Ok(Op::CpWait { n: 0, all: true });
    }
    if m.has("wait_group") {
        m.finish(line, opcode)?;
        return match ops.as_slice() {
            [Operand::Num(Number::Int(n))] if *n <= u32::MAX as u64 => Ok(Op::CpWait { n: *n as u32, all: false }),
            _ => err(line, "cp.async.wait_group needs an integer constant"),
        };
    }
    let cg = match m.any(&["ca", "cg"]) {
        Some("cg") => true,
        Some(_) => false,
        None => return err(line, format!("`{opcode}` needs .ca or .cg")),
    };
    if !(m.has("shared") || m.has("shared::cta")) || !m.has("global") {
        return err(line, format!("`{opcode}`: only .shared.global copies are supported"));
    }
    for (k, p) in m.parts.iter().enumerate() {
        if p.starts_with("L2::") && *p != "L2::cache_hint" {
            m.used[k] = true;
        }
    }
    m.finish(line, opcode)?;
    if ops.len() != 3 && ops.len() != 4 {
        return err(line, format!("`{opcode}` expects 3 or 4 operands, found {}", ops.len()));
    }
    let size = match &ops[2] {
        Operand::Num(Number::Int(n @ (4 | 8 | 16))) => *n as u8,
        _ => return err(line, format!("`{opcode}`: cp-size must be 4, 8 or 16")),
    };
    if cg && size != 16 {
        return err(line, "cp.async.cg copies 16 bytes");
    }
    let addr = |cx: &mut Dcx, o: &Operand, sp: Space| -> Result<(Slot, i32), LoadError> {
        let Operand::Addr { base, off } = o else {
            return err(line, format!("`{opcode}`: expected an address operand `[...]`"));
        };
        let (a, off) = address(cx, ctx, base.as_deref(), *off, sp)?;
        let off = i32::try_from(off).map_err(|_| LoadError { line, message: "address offset too large".into() })?;
        Ok((a, off))
    };
    let (d, doff) = addr(cx, &ops[0], Space::Shared)?;
    let (a, aoff) = addr(cx, &ops[1], Space::Global)?;
    let n = match ops.get(3) {
        Some(Operand::Num(Number::Int(v))) if *v > size as u64 => {
            return err(line, format!("`{opcode}`: src-size {v} exceeds cp-size {size}"))
        }
        Some(o) => src_operand(cx, ctx, o, 32, false)?,
        None => NONE,
    };
    Ok(Op::CpAsync { size, d, doff, a, aoff, n })
}

/// Resolves `[base+off]` in state space `sp` to (slot, offset).
fn address(cx: &mut Dcx, ctx: &Ictx, base: Option<&str>, off: i64, sp: Space) -> Result<(Slot, i64), LoadError> {
    let line = ctx.line;
    let Some(b) = base else {
        return Ok((cx.konst(off as u64), 0));
    };
    match ctx.lookup(b).cloned() {
        Some(Sym::Reg(s)) => Ok((s, off)),
        Some(Sym::Addr(space, a)) => {
            let generic = sym_generic(space, a);
            let addr = if sp == Space::Generic { generic } else { a };
            if sp != Space::Generic && sp != space {
                return err(line, format!("`{b}` is not in the instruction's state space"));
            }
            Ok((cx.konst(addr), off))
        }
        Some(Sym::PVar(..)) => err(line, format!("param variable `{b}` used as an address")),
        None => {
            let (space, a) = module_sym(cx, b).ok_or(LoadError { line, message: format!("unknown symbol `{b}`") })?;
            let addr = if sp == Space::Generic { sym_generic(space, a) } else { a };
            if sp != Space::Generic && sp != space {
                return err(line, format!("`{b}` is not in the instruction's state space"));
            }
            Ok((cx.konst(addr), off))
        }
    }
}

fn sym_generic(space: Space, a: u64) -> u64 {
    match space {
        Space::Shared => a.wrapping_add(SHARED_WINDOW),
        Space::Local => a.wrapping_add(LOCAL_WINDOW),
        Space::Param => a.wrapping_add(PARAM_WINDOW),
        _ => a,
    }
}

/// Address of a module-scope variable (global or shared).
fn module_sym(cx: &mut Dcx, name: &str) -> Option<(Space, u64)> {
    if let Some(&a) = cx.globals.addrs.get(name) {
        return Some((Space::Global, a));
    }
    let v = cx.ast.vars.iter().find(|v| v.name == name && v.space == ".shared")?.clone();
    let a = cx.shared_addr(&v);
    Some((Space::Shared, a))
}

fn src_operand(cx: &mut Dcx, ctx: &Ictx, o: &Operand, bits: u32, float: bool) -> Result<Slot, LoadError> {
    let line = ctx.line;
    match o {
        Operand::Name(n) => match ctx.lookup(n).cloned() {
            Some(Sym::Reg(s)) => Ok(s),
            Some(Sym::Addr(_, a)) => Ok(cx.konst(a)),
            Some(Sym::PVar(..)) => err(line, format!("taking the address of param variable `{n}` is not supported")),
            None => {
                if let Some(sp) = special_of(n) {
                    return Ok(cx.special(sp));
                }
                if n == "WARP_SZ" {
                    return Ok(cx.konst(32));
                }
                match module_sym(cx, n) {
                    Some((_, a)) => Ok(cx.konst(a)),
                    None => err(line, format!("unknown register or symbol `{n}`")),
                }
            }
        },
        Operand::SymOff(n, off) => {
            let a = match ctx.lookup(n).cloned() {
                Some(Sym::Addr(_, a)) => a,
                _ => module_sym(cx, n).ok_or(LoadError { line, message: format!("unknown symbol `{n}`") })?.1,
            };
            if a == DYN_SHARED_MARK {
                return err(line, "offsets from dynamic shared symbols in operands are not supported");
            }
            Ok(cx.konst(a.wrapping_add(*off as u64)))
        }
        Operand::Num(n) => Ok(cx.konst(imm_bits(*n, bits as usize, float))),
        Operand::NegNum(Number::Int(v)) => Ok(cx.konst(v.wrapping_neg() & num::mask(bits))),
        _ => err(line, "unsupported operand form"),
    }
}

fn decode_call(cx: &mut Dcx, ctx: &Ictx, i: &InstAst, fname: &str) -> Result<Op, LoadError> {
    let line = i.line;
    let mut k = 0;
    let mut rets: Vec<String> = Vec::new();
    if let Some(Operand::List(r)) = i.ops.first() {
        rets = r.clone();
        k = 1;
    }
    let Some(Operand::Name(target)) = i.ops.get(k) else {
        return err(line, "call needs a function name");
    };
    let args: Vec<String> = match i.ops.get(k + 1) {
        Some(Operand::List(a)) => a.clone(),
        None => Vec::new(),
        _ => return err(line, "unsupported call form (indirect calls and prototypes are not supported)"),
    };
    if i.ops.len() > k + 2 {
        return err(line, "unsupported call form (indirect calls and prototypes are not supported)");
    }
    if ctx.lookup(target).is_some() {
        return err(line, "indirect calls are not supported");
    }
    let Some(&fi) = cx.func_index.get(target.as_str()) else {
        return err(line, format!("call to unknown function `{target}`"));
    };
    let g = &cx.ast.funcs[fi];
    if g.body.is_none() {
        return err(line, format!("call to external function `{target}` (no body in the module)"));
    }
    if g.is_entry {
        return err(line, "calling a kernel entry is not supported");
    }
    if g.params.len() != args.len() || g.rets.len() != rets.len() {
        return err(line, format!("call to `{target}`: argument count does not match its declaration"));
    }
    if !cx.sigs.contains_key(target) {
        let mut params = Vec::new();
        let mut rets_s = Vec::new();
        for (list, out) in [(&g.params, &mut params), (&g.rets, &mut rets_s)] {
            for p in list.iter() {
                let n = p.size().div_ceil(8).max(1) as u32;
                let base = cx.slot_names.len() as Slot;
                for q in 0..n {
                    cx.slot_names.push(format!("{}[{}]", p.name, q * 8));
                }
                cx.pvars.push((base, n));
                out.push((base, n));
            }
        }
        cx.sigs.insert(target.clone(), FuncSig { params, rets: rets_s, start: None });
        cx.queue.push(target.clone());
    }
    cx.call_edges.push((fname.to_string(), target.clone()));
    let pv = |n: &str| -> Result<(Slot, u32), LoadError> {
        match ctx.lookup(n) {
            Some(Sym::PVar(b, k)) => Ok((*b, *k)),
            _ => err(line, format!("call argument `{n}` is not a `.param` variable")),
        }
    };
    let sig = &cx.sigs[target];
    let mut in_copies = Vec::new();
    for (a, &(cb, cn)) in args.iter().zip(&sig.params) {
        let (b, n) = pv(a)?;
        for q in 0..n.min(cn) {
            in_copies.push((b + q, cb + q));
        }
    }
    let mut out_copies = Vec::new();
    for (r, &(cb, cn)) in rets.iter().zip(&sig.rets) {
        let (b, n) = pv(r)?;
        for q in 0..n.min(cn) {
            out_copies.push((cb + q, b + q));
        }
    }
    cx.copies.push(in_copies);
    let ci = (cx.copies.len() - 1) as u32;
    cx.copies.push(out_copies);
    let co = (cx.copies.len() - 1) as u32;
    cx.call_fixups.push((cx.insts.len(), target.clone()));
    // The call's return lands on a CallRet that copies the return values back.
    cx.insts.push(Inst { op: Op::Call { t: 0, copies: ci }, guard: NONE, gneg: false, fused: 0, line: line as u32 });
    cx.texts.push(i.text.clone());
    Ok(Op::CallRet { copies: co })
}

/// Integer, bit and float arithmetic.
fn arith(cx: &mut Dcx, ctx: &Ictx, m: &mut Mods, i: &InstAst, base: &str) -> Result<Op, LoadError> {
    let line = i.line;
    let opcode = i.opcode.as_str();
    let ops = &i.ops;
    let (rnd, _) = rnd_of(m);
    let has_rnd = opcode.contains(".rn") || opcode.contains(".rz") || opcode.contains(".rm") || opcode.contains(".rp");
    let ftz = m.has("ftz");
    let sat = m.has("sat");
    let approx = m.has("approx");
    let full = m.has("full");
    let lo = m.has("lo");
    let hi = m.has("hi");
    let wide = m.has("wide");
    let shiftmode = m.any(&["f4e", "b4e", "rc8", "ecl", "ecr", "rc16"]);
    let ty = m.ty().ok_or(LoadError { line, message: format!("`{opcode}` needs a type") })?;
    m.finish(line, opcode)?;
    let bits = ty.bits();
    let fl = ty.is_float();
    let need = |n: usize| -> Result<(), LoadError> {
        if ops.len() != n {
            err(line, format!("`{opcode}` expects {n} operands, found {}", ops.len()))
        } else {
            Ok(())
        }
    };
    let d = match ops.first() {
        Some(Operand::Name(n)) if n == "_" => cx.sink,
        Some(Operand::Name(n)) => ctx.reg(n)?,
        _ => return err(line, format!("`{opcode}`: bad destination")),
    };
    let mut s = |cx: &mut Dcx, k: usize, b: u32, f: bool| -> Result<Slot, LoadError> {
        match ops.get(k) {
            Some(o) => src_operand(cx, ctx, o, b, f),
            None => err(line, format!("`{opcode}`: missing operand {k}")),
        }
    };
    if fl {
        if ty == Ty::F16 || ty == Ty::BF16 {
            return err(line, format!("`{opcode}`: f16/bf16 arithmetic is not supported"));
        }
        let f64_ = ty == Ty::F64;
        let fm = FMode { rnd, ftz, sat, int_round: false };
        let plain = rnd == num::RN && !ftz && !sat && !f64_;
        let _ = (full, has_rnd);
        let bin = |k: FBin, cx: &mut Dcx, s: &mut SrcFn| -> Result<Op, LoadError> {
            need(3)?;
            let a = s(cx, 1, bits, true)?;
            let b = s(cx, 2, bits, true)?;
            Ok(match (k, plain) {
                (FBin::Add, true) => Op::AddF32 { d, a, b },
                (FBin::Mul, true) => Op::MulF32 { d, a, b },
                (FBin::Sub, true) => Op::Bin { f: ops::fsub32, k: IntK::FSub32, d, a, b },
                _ if f64_ => Op::FBin64 { k, m: fm, d, a, b },
                _ => Op::FBin32 { k, m: fm, d, a, b },
            })
        };
        let un = |k: FUn, cx: &mut Dcx, s: &mut SrcFn| -> Result<Op, LoadError> {
            need(2)?;
            let a = s(cx, 1, bits, true)?;
            Ok(if f64_ { Op::FUn64 { k, m: fm, approx, d, a } } else { Op::FUn32 { k, m: fm, approx, d, a } })
        };
        return match base {
            "add" => bin(FBin::Add, cx, &mut s),
            "sub" => bin(FBin::Sub, cx, &mut s),
            "mul" => bin(FBin::Mul, cx, &mut s),
            "div" => bin(FBin::Div, cx, &mut s),
            "min" => bin(FBin::Min, cx, &mut s),
            "max" => bin(FBin::Max, cx, &mut s),
            "fma" | "mad" => {
                need(4)?;
                let a = s(cx, 1, bits, true)?;
                let b = s(cx, 2, bits, true)?;
                let c = s(cx, 3, bits, true)?;
                Ok(if plain {
                    Op::FmaF32 { d, a, b, c }
                } else if f64_ {
                    Op::Fma64 { m: fm, d, a, b, c }
                } else {
                    Op::Fma32 { m: fm, d, a, b, c }
                })
            }
            "neg" => un(FUn::Neg, cx, &mut s),
            "abs" => un(FUn::Abs, cx, &mut s),
            "rcp" => un(FUn::Rcp, cx, &mut s),
            "sqrt" => un(FUn::Sqrt, cx, &mut s),
            "rsqrt" => un(FUn::Rsqrt, cx, &mut s),
            "ex2" => un(FUn::Ex2, cx, &mut s),
            "lg2" => un(FUn::Lg2, cx, &mut s),
            "sin" => un(FUn::Sin, cx, &mut s),
            "cos" => un(FUn::Cos, cx, &mut s),
            "tanh" => un(FUn::Tanh, cx, &mut s),
            "copysign" => {
                need(3)?;
                let a = s(cx, 1, bits, true)?;
                let b = s(cx, 2, bits, true)?;
                Ok(Op::Bin { f: if f64_ { ops::copysign64 } else { ops::copysign32 }, k: IntK::Fn, d, a, b })
            }
            _ => err(line, format!("unsupported float instruction `{opcode}`")),
        };
    }
    if ty == Ty::Pred {
        return match base {
            "and" | "or" | "xor" => {
                need(3)?;
                let a = s(cx, 1, 1, false)?;
                let b = s(cx, 2, 1, false)?;
                let f: F2 = match base {
                    "and" => ops::and,
                    "or" => ops::or,
                    _ => ops::xor,
                };
                Ok(Op::Bin { f, k: IntK::Fn, d, a, b })
            }
            "not" | "cnot" => {
                need(2)?;
                let a = s(cx, 1, 1, false)?;
                Ok(Op::Un { f: ops::pnot, d, a })
            }
            _ => err(line, format!("`{opcode}`: not valid on predicates")),
        };
    }
    let signed = ty.is_signed();
    macro_rules! w {
        ($f:ident) => {
            match bits {
                8 => ops::$f::<8> as F2,
                16 => ops::$f::<16> as F2,
                32 => ops::$f::<32> as F2,
                _ => ops::$f::<64> as F2,
            }
        };
    }
    macro_rules! w1 {
        ($f:ident) => {
            match bits {
                8 => ops::$f::<8> as F1,
                16 => ops::$f::<16> as F1,
                32 => ops::$f::<32> as F1,
                _ => ops::$f::<64> as F1,
            }
        };
    }
    macro_rules! w3 {
        ($f:ident) => {
            match bits {
                8 => ops::$f::<8> as F3,
                16 => ops::$f::<16> as F3,
                32 => ops::$f::<32> as F3,
                _ => ops::$f::<64> as F3,
            }
        };
    }
    let two = |cx: &mut Dcx, f: F2, s: &mut SrcFn, bb: u32| -> Result<Op, LoadError> {
        need(3)?;
        let a = s(cx, 1, bits, false)?;
        let b = s(cx, 2, bb, false)?;
        Ok(Op::Bin { f, k: IntK::Fn, d, a, b })
    };
    // The hot kinds at 32 and 64 bits (`f` stays the same function, for the trace and tests).
    let hot = |op: Result<Op, LoadError>, k32: IntK, k64: IntK| -> Result<Op, LoadError> {
        match op? {
            Op::Bin { f, d, a, b, .. } if bits == 32 || bits == 64 => {
                Ok(Op::Bin { f, k: if bits == 32 { k32 } else { k64 }, d, a, b })
            }
            op => Ok(op),
        }
    };
    if (sat && !(base == "add" || base == "sub") && !(base == "mad" && hi)) || (sat && !signed) {
        return err(line, format!("unsupported modifier `.sat` in `{opcode}`"));
    }
    match base {
        "add" if sat => two(cx, ops::add_sat_s32, &mut s, bits),
        "sub" if sat => two(cx, ops::sub_sat_s32, &mut s, bits),
        "add" => hot(two(cx, w!(add), &mut s, bits), IntK::Add32, IntK::Add64),
        "sub" => hot(two(cx, w!(sub), &mut s, bits), IntK::Sub32, IntK::Sub64),
        "mul" => {
            let f = if wide {
                if bits > 32 {
                    return err(line, "mul.wide needs a 16- or 32-bit type");
                }
                match (bits, signed) {
                    (16, false) => ops::mulwide_u::<16> as F2,
                    (16, true) => ops::mulwide_s::<16>,
                    (_, false) => ops::mulwide_u::<32>,
                    (_, true) => ops::mulwide_s::<32>,
                }
            } else if hi {
                if signed {
                    w!(mulhi_s)
                } else {
                    w!(mulhi_u)
                }
            } else {
                let _ = lo;
                w!(mul)
            };
            let k = match (wide, hi, bits, signed) {
                (true, _, 32, false) => IntK::MulWideU32,
                (true, _, 32, true) => IntK::MulWideS32,
                (false, false, 32, _) => IntK::MulLo32,
                (false, false, 64, _) => IntK::MulLo64,
                _ => IntK::Fn,
            };
            match two(cx, f, &mut s, bits)? {
                Op::Bin { f, d, a, b, .. } => Ok(Op::Bin { f, k, d, a, b }),
                op => Ok(op),
            }
        }
        "mad" => {
            need(4)?;
            let a = s(cx, 1, bits, false)?;
            let b = s(cx, 2, bits, false)?;
            let cbits = if wide { bits * 2 } else { bits };
            let c = s(cx, 3, cbits, false)?;
            let f: F3 = if wide {
                if bits > 32 {
                    return err(line, "mad.wide needs a 16- or 32-bit type");
                }
                match (bits, signed) {
                    (16, false) => ops::madwide_u::<16>,
                    (16, true) => ops::madwide_s::<16>,
                    (_, false) => ops::madwide_u::<32>,
                    (_, true) => ops::madwide_s::<32>,
                }
            } else if hi {
                if sat {
                    ops::madhi_sat_s32
                } else if signed {
                    w3!(madhi_s)
                } else {
                    w3!(madhi_u)
                }
            } else {
                w3!(mad)
            };
            // The hot kinds (`f` stays the same function, for the trace and tests).
            let k = match (wide, hi, bits, signed) {
                (true, _, 32, false) => TerK::MadWideU32,
                (true, _, 32, true) => TerK::MadWideS32,
                (false, false, 32, _) => TerK::MadLo32,
                (false, false, 64, _) => TerK::MadLo64,
                _ => TerK::Fn,
            };
            Ok(Op::Ter { f, k, d, a, b, c })
        }
        "mul24" | "mad24" => err(line, format!("`{opcode}` is not supported")),
        "sad" => {
            need(4)?;
            let a = s(cx, 1, bits, false)?;
            let b = s(cx, 2, bits, false)?;
            let c = s(cx, 3, bits, false)?;
            Ok(Op::Ter { f: if signed { w3!(sad_s) } else { w3!(sad_u) }, k: TerK::Fn, d, a, b, c })
        }
        "div" => two(cx, if signed { w!(div_s) } else { w!(div_u) }, &mut s, bits),
        "rem" => two(cx, if signed { w!(rem_s) } else { w!(rem_u) }, &mut s, bits),
        "min" => two(cx, if signed { w!(min_s) } else { w!(min_u) }, &mut s, bits),
        "max" => two(cx, if signed { w!(max_s) } else { w!(max_u) }, &mut s, bits),
        "and" => hot(two(cx, ops::and, &mut s, bits), IntK::And, IntK::And),
        "or" => hot(two(cx, ops::or, &mut s, bits), IntK::Or, IntK::Or),
        "xor" => hot(two(cx, ops::xor, &mut s, bits), IntK::Xor, IntK::Xor),
        "shl" => hot(two(cx, w!(shl), &mut s, 32), IntK::Shl32, IntK::Shl64),
        "shr" if !signed => hot(two(cx, w!(shr_u), &mut s, 32), IntK::ShrU32, IntK::ShrU64),
        "shr" => two(cx, w!(shr_s), &mut s, 32),
        "abs" | "neg" | "not" | "cnot" | "popc" | "clz" | "brev" => {
            need(2)?;
            let a = s(cx, 1, bits, false)?;
            let f = match base {
                "abs" => w1!(abs),
                "neg" => w1!(neg),
                "not" => w1!(not),
                "cnot" => ops::cnot,
                "popc" => w1!(popc),
                "clz" => w1!(clz),
                _ => w1!(brev),
            };
            Ok(Op::Un { f, d, a })
        }
        "bfe" => {
            need(4)?;
            let a = s(cx, 1, bits, false)?;
            let b = s(cx, 2, 32, false)?;
            let c = s(cx, 3, 32, false)?;
            let f: F3 = match (bits, signed) {
                (32, false) => ops::bfe_u::<32>,
                (32, true) => ops::bfe_s::<32>,
                (64, false) => ops::bfe_u::<64>,
                (64, true) => ops::bfe_s::<64>,
                _ => return err(line, "bfe needs a 32- or 64-bit type"),
            };
            Ok(Op::Ter { f, k: TerK::Fn, d, a, b, c })
        }
        "bfi" => {
            need(5)?;
            let a = s(cx, 1, bits, false)?;
            let b = s(cx, 2, bits, false)?;
            let c = s(cx, 3, 32, false)?;
            let e = s(cx, 4, 32, false)?;
            let f: F4 = if bits == 64 { ops::bfi::<64> } else { ops::bfi::<32> };
            Ok(Op::Quad { f, d, a, b, c, e })
        }
        "prmt" => {
            need(4)?;
            if bits != 32 {
                return err(line, "prmt needs .b32");
            }
            let a = s(cx, 1, 32, false)?;
            let b = s(cx, 2, 32, false)?;
            let c = s(cx, 3, 32, false)?;
            let f: F3 = match shiftmode {
                None => ops::prmt::<0>,
                Some("f4e") => ops::prmt::<1>,
                Some("b4e") => ops::prmt::<2>,
                Some("rc8") => ops::prmt::<3>,
                Some("ecl") => ops::prmt::<4>,
                Some("ecr") => ops::prmt::<5>,
                _ => ops::prmt::<6>,
            };
            Ok(Op::Ter { f, k: TerK::Fn, d, a, b, c })
        }
        _ => err(line, format!("unsupported integer instruction `{opcode}`")),
    }
}

// After `inst_prelude!`, which it uses.
mod hopper;
