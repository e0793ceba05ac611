//! PTX text to a light syntax tree: tokens, directives, declarations and raw instructions.
//!
//! The parser accepts the subset of PTX that rustc's NVPTX backend emits (plus common hand-written
//! forms). It never panics: every problem is a `LoadError` naming the PTX line.

use std::sync::{Arc, OnceLock};

use crate::LoadError;

/// A token's kind; names and numbers borrow their text from the source (the lexer allocates
/// nothing per token: a kernel body is a few hundred thousand of them).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Tok<'a> {
    Ident(&'a str),
    Num(&'a str),
    Str,
    Punct(char),
    /// A whole function body, braces included (`start..end` bytes), left unlexed by
    /// [`lex_module`] and parsed on first use ([`FuncBody::stmts`]).
    Body,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Token<'a> {
    pub t: Tok<'a>,
    pub line: usize,
    pub start: usize,
    pub end: usize,
}

pub(crate) fn err<T>(line: usize, msg: impl Into<String>) -> Result<T, LoadError> {
    Err(LoadError { line, message: msg.into() })
}

fn is_ident_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || c == b'_' || c == b'$' || c == b'%' || c == b'.'
}
fn is_ident_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b'$' || c == b'.' || c == b'%'
}

/// Tokens of a module's top level: each function body is one [`Tok::Body`] token, found by
/// matching its braces byte by byte (comments and strings skipped), so loading a module costs
/// a scan of its bodies, not their tokens.
pub(crate) fn lex_module(src: &str) -> Result<Vec<Token<'_>>, LoadError> {
    lex_from(src, 1, true)
}

/// Tokens of `src` (whose first line is PTX line `first_line`), bodies included.
pub(crate) fn lex(src: &str, first_line: usize) -> Result<Vec<Token<'_>>, LoadError> {
    lex_from(src, first_line, false)
}

/// The end (one past the closing brace) and the number of newlines of the braced block that
/// opens at `b[open]`, skipping comments and strings; `None` when it never closes.
fn skip_block(b: &[u8], open: usize) -> Option<(usize, usize)> {
    let (mut i, mut depth, mut lines) = (open, 0usize, 0usize);
    while i < b.len() {
        // The bytes up to the next brace, slash or quote only count lines.
        let (next, skipped_lines) = next_special(b, i);
        lines += skipped_lines;
        i = next;
        if i >= b.len() {
            break;
        }
        match b[i] {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some((i + 1, lines));
                }
            }
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
                continue;
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i += 2;
                while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                    lines += usize::from(b[i] == b'\n');
                    i += 1;
                }
                i += 2;
                continue;
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' && b[i] != b'\n' {
                    i += 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

fn lex_from(src: &str, first_line: usize, skip_bodies: bool) -> Result<Vec<Token<'_>>, LoadError> {
    let b = src.as_bytes();
    let mut i = 0;
    let mut line = first_line;
    // About one token per five bytes in a kernel body (the top level: a few per function).
    let mut out = Vec::with_capacity(if skip_bodies { 1024 } else { src.len() / 4 });
    // Top level only (`skip_bodies`): brace depth, and whether the statement being read
    // declares a function (`.entry`/`.func` seen since the last `;` or `}` at depth 0).
    let mut depth = 0usize;
    let mut in_func = false;
    while i < b.len() {
        let c = b[i];
        if c == b'\n' {
            line += 1;
            i += 1;
        } else if c.is_ascii_whitespace() {
            i += 1;
        } else if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let l0 = line;
            i += 2;
            loop {
                if i + 1 >= b.len() {
                    return err(l0, "unterminated block comment");
                }
                if b[i] == b'*' && b[i + 1] == b'/' {
                    i += 2;
                    break;
                }
                if b[i] == b'\n' {
                    line += 1;
                }
                i += 1;
            }
        } else if c == b'"' {
            let s = i;
            i += 1;
            while i < b.len() && b[i] != b'"' && b[i] != b'\n' {
                i += 1;
            }
            if i >= b.len() || b[i] != b'"' {
                return err(line, "unterminated string");
            }
            i += 1;
            out.push(Token { t: Tok::Str, line, start: s, end: i });
        } else if c.is_ascii_digit() {
            let s = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'.') {
                i += 1;
            }
            out.push(Token { t: Tok::Num(&src[s..i]), line, start: s, end: i });
        } else if is_ident_start(c) {
            let s = i;
            i += 1;
            // `::` joins the parts of a qualifier (`.shared::cta`, `.L2::128B`): one name.
            while i < b.len()
                && (is_ident_char(b[i])
                    || (b[i] == b':' && b.get(i + 1) == Some(&b':') && b.get(i + 2).is_some_and(|&n| is_ident_char(n))))
            {
                i += if b[i] == b':' { 2 } else { 1 };
            }
            if skip_bodies && depth == 0 && matches!(&src[s..i], ".entry" | ".func") {
                in_func = true;
            }
            out.push(Token { t: Tok::Ident(&src[s..i]), line, start: s, end: i });
        } else if skip_bodies && c == b'{' && depth == 0 && in_func {
            let Some((end, lines)) = skip_block(b, i) else {
                return err(line, "unterminated function body");
            };
            out.push(Token { t: Tok::Body, line, start: i, end });
            line += lines;
            i = end;
            in_func = false;
        } else if b"{}()[],;:+-!@|<>=".contains(&c) {
            if skip_bodies {
                match c {
                    b'{' => depth += 1,
                    b'}' => depth = depth.saturating_sub(1),
                    b';' if depth == 0 => in_func = false,
                    _ => {}
                }
            }
            out.push(Token { t: Tok::Punct(c as char), line, start: i, end: i + 1 });
            i += 1;
        } else {
            let ch = src[i..].chars().next().unwrap_or('?');
            return err(line, format!("unexpected character {ch:?}"));
        }
    }
    Ok(out)
}

/// The first byte at or after `from` that is a brace, a slash or a quote (`b.len()` when there is
/// none), and the newlines before it: 16 bytes per step (SSE2, part of every x86_64 CPU), then
/// byte by byte. A function body is most of a module's bytes, and this is all that loading one
/// reads of it.
fn next_special(b: &[u8], from: usize) -> (usize, usize) {
    let special = |c: u8| (c == b'{') | (c == b'}') | (c == b'/') | (c == b'"');
    let (mut i, mut lines) = (from, 0usize);
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        while i + 16 <= b.len() {
            // SAFETY: the 16 bytes at `i` are inside `b`; SSE2 is part of x86_64.
            let (spec, nl) = unsafe {
                let v = _mm_loadu_si128(b.as_ptr().add(i).cast());
                let eq = |c: u8| _mm_cmpeq_epi8(v, _mm_set1_epi8(c as i8));
                let s = _mm_or_si128(_mm_or_si128(eq(b'{'), eq(b'}')), _mm_or_si128(eq(b'/'), eq(b'"')));
                (_mm_movemask_epi8(s) as u32, _mm_movemask_epi8(eq(b'\n')) as u32)
            };
            if spec != 0 {
                let p = spec.trailing_zeros();
                return (i + p as usize, lines + (nl & ((1 << p) - 1)).count_ones() as usize);
            }
            lines += nl.count_ones() as usize;
            i += 16;
        }
    }
    for (k, &c) in b[i..].iter().enumerate() {
        if special(c) {
            return (i + k, lines);
        }
        lines += usize::from(c == b'\n');
    }
    (b.len(), lines)
}

/// A parsed number literal.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Number {
    Int(u64),
    F32(u32),
    F64(u64),
}

pub(crate) fn parse_number(s: &str, line: usize) -> Result<Number, LoadError> {
    let bad = || LoadError { line, message: format!("bad number literal `{s}`") };
    let lower = s.to_ascii_lowercase();
    let t = lower.trim_end_matches('u');
    if let Some(h) = t.strip_prefix("0f") {
        if h.len() == 8 {
            return u32::from_str_radix(h, 16).map(Number::F32).map_err(|_| bad());
        }
        return Err(bad());
    }
    if let Some(h) = t.strip_prefix("0d") {
        if h.len() == 16 {
            return u64::from_str_radix(h, 16).map(Number::F64).map_err(|_| bad());
        }
        return Err(bad());
    }
    if let Some(h) = t.strip_prefix("0x") {
        return u64::from_str_radix(h, 16).map(Number::Int).map_err(|_| bad());
    }
    if let Some(h) = t.strip_prefix("0b") {
        return u64::from_str_radix(h, 2).map(Number::Int).map_err(|_| bad());
    }
    if t.contains('.') || t.contains('e') {
        return t.parse::<f64>().map(|f| Number::F64(f.to_bits())).map_err(|_| bad());
    }
    if t.len() > 1 && t.starts_with('0') {
        return u64::from_str_radix(&t[1..], 8).map(Number::Int).map_err(|_| bad());
    }
    t.parse::<u64>().map(Number::Int).map_err(|_| bad())
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Operand {
    /// A register, special register, symbol or label name; `_` is the sink.
    Name(String),
    Num(Number),
    /// `-` applied to a number.
    NegNum(Number),
    /// `[base+imm]`, `[imm]`.
    Addr {
        base: Option<String>,
        off: i64,
    },
    Vec(Vec<Operand>),
    /// `%p|%q`
    Pair(String, String),
    /// `!%p`
    Not(String),
    /// `(a, b)` list in calls.
    List(Vec<String>),
    /// `sym+4` (address of a symbol plus offset) in an operand position.
    SymOff(String, i64),
    /// `[tensorMap, {c0, c1, ...}]` (the tensor operand of `cp.async.bulk.tensor`).
    TensorAddr {
        base: Option<String>,
        off: i64,
        coords: Vec<Operand>,
    },
}

#[derive(Clone, Debug)]
pub(crate) struct InstAst {
    pub guard: Option<(String, bool)>,
    pub opcode: String,
    pub ops: Vec<Operand>,
    pub line: usize,
    pub text: String,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Init {
    Num(Number, bool),
    Sym { name: String, off: i64, generic: bool },
}

#[derive(Clone, Debug)]
pub(crate) struct VarDecl {
    pub space: String,
    pub align: usize,
    pub ty: String,
    pub vec: usize,
    pub name: String,
    /// Number of elements (scalars: 1, `[]`: 0).
    pub count: usize,
    pub unsized_array: bool,
    pub is_array: bool,
    pub init: Option<Vec<Init>>,
    pub line: usize,
    pub ptr_align: Option<usize>,
}

impl VarDecl {
    pub fn elem_size(&self) -> usize {
        type_size(&self.ty).unwrap_or(1) * self.vec.max(1)
    }
    pub fn size(&self) -> usize {
        self.elem_size() * self.count
    }
    /// Alignment: explicit `.align` or the element size.
    pub fn alignment(&self) -> usize {
        if self.align > 0 {
            self.align
        } else {
            self.elem_size().max(1)
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) enum Stmt {
    Reg { names: Vec<String>, line: usize },
    Var(VarDecl),
    Label(String),
    Inst(InstAst),
    Open,
    Close,
}

#[derive(Clone, Debug)]
pub(crate) struct FuncAst {
    pub name: String,
    pub is_entry: bool,
    pub rets: Vec<VarDecl>,
    pub params: Vec<VarDecl>,
    pub body: Option<FuncBody>,
    pub line: usize,
}

/// A module's text as its function bodies keep it: borrowed when it lives as long as the
/// process (an embedded module: no copy of its megabytes), else one shared copy.
#[derive(Clone, Debug)]
pub(crate) enum Text {
    Static(&'static str),
    Shared(Arc<str>),
}

impl std::ops::Deref for Text {
    type Target = str;
    fn deref(&self) -> &str {
        match self {
            Text::Static(s) => s,
            Text::Shared(s) => s,
        }
    }
}

/// A function's body: its text, parsed into statements on first use (a module of many kernels
/// is loaded without lexing the bodies of kernels a program never launches).
#[derive(Clone, Debug)]
pub(crate) struct FuncBody {
    src: Text,
    /// Byte range of the body in `src`, braces included, and the PTX line of its `{`.
    start: usize,
    end: usize,
    line: usize,
    stmts: OnceLock<Result<Vec<Stmt>, LoadError>>,
}

impl FuncBody {
    /// The body's statements, parsed on the first call (a syntax error in the body comes
    /// back here, naming its PTX line, on every call).
    pub(crate) fn stmts(&self) -> Result<&[Stmt], LoadError> {
        self.stmts
            .get_or_init(|| {
                let text = &self.src[self.start..self.end];
                let toks = lex(text, self.line)?;
                let mut p = P { src: text, toks, i: 0 };
                p.expect_punct('{')?;
                let stmts = parse_body(&mut p)?;
                if p.i < p.toks.len() {
                    return err(p.line(), format!("unexpected {} after a function body", p.describe()));
                }
                Ok(stmts)
            })
            .as_deref()
            .map_err(Clone::clone)
    }
}

#[derive(Clone, Debug, Default)]
pub(crate) struct ModuleAst {
    pub version: String,
    pub target: String,
    pub vars: Vec<VarDecl>,
    pub funcs: Vec<FuncAst>,
}

pub(crate) fn type_size(ty: &str) -> Option<usize> {
    Some(match ty {
        ".b8" | ".u8" | ".s8" | ".pred" => 1,
        ".b16" | ".u16" | ".s16" | ".f16" | ".bf16" | ".e4m3x2" | ".e5m2x2" => 2,
        ".b32" | ".u32" | ".s32" | ".f32" | ".f16x2" | ".bf16x2" | ".tf32" => 4,
        ".b64" | ".u64" | ".s64" | ".f64" => 8,
        ".b128" => 16,
        _ => return None,
    })
}

struct P<'a> {
    src: &'a str,
    toks: Vec<Token<'a>>,
    i: usize,
}

impl<'a> P<'a> {
    fn peek(&self) -> Option<&Tok<'a>> {
        self.toks.get(self.i).map(|t| &t.t)
    }
    fn peek_at(&self, k: usize) -> Option<&Tok<'a>> {
        self.toks.get(self.i + k).map(|t| &t.t)
    }
    fn line(&self) -> usize {
        self.toks.get(self.i).or(self.toks.last()).map(|t| t.line).unwrap_or(1)
    }
    /// Consumes the next token.
    fn next(&mut self) -> Result<Token<'a>, LoadError> {
        match self.toks.get(self.i) {
            Some(&t) => {
                self.i += 1;
                Ok(t)
            }
            None => err(self.line(), "unexpected end of input"),
        }
    }
    fn is_punct(&self, c: char) -> bool {
        self.peek() == Some(&Tok::Punct(c))
    }
    fn eat_punct(&mut self, c: char) -> bool {
        if self.is_punct(c) {
            self.i += 1;
            true
        } else {
            false
        }
    }
    fn expect_punct(&mut self, c: char) -> Result<(), LoadError> {
        if self.eat_punct(c) {
            Ok(())
        } else {
            let got = self.describe();
            err(self.line(), format!("expected `{c}`, found {got}"))
        }
    }
    fn describe(&self) -> String {
        match self.toks.get(self.i) {
            Some(t) => format!("`{}`", &self.src[t.start..t.end]),
            None => "end of input".to_string(),
        }
    }
    fn ident(&mut self) -> Result<String, LoadError> {
        if let Some(&Tok::Ident(s)) = self.peek() {
            self.i += 1;
            return Ok(s.to_string());
        }
        err(self.line(), format!("expected a name, found {}", self.describe()))
    }
    fn peek_ident(&self) -> Option<&'a str> {
        match self.peek() {
            Some(&Tok::Ident(s)) => Some(s),
            _ => None,
        }
    }
    fn number(&mut self) -> Result<Number, LoadError> {
        let line = self.line();
        if let Some(&Tok::Num(s)) = self.peek() {
            self.i += 1;
            return parse_number(s, line);
        }
        err(line, format!("expected a number, found {}", self.describe()))
    }
    fn uint(&mut self) -> Result<usize, LoadError> {
        let line = self.line();
        match self.number()? {
            Number::Int(v) if v <= u32::MAX as u64 => Ok(v as usize),
            _ => err(line, "expected a small integer"),
        }
    }
    fn signed(&mut self) -> Result<i64, LoadError> {
        let neg = self.eat_punct('-');
        let line = self.line();
        match self.number()? {
            Number::Int(v) => Ok(if neg { (v as i64).wrapping_neg() } else { v as i64 }),
            _ => err(line, "expected an integer offset"),
        }
    }
    /// Skips the remaining tokens on the line of `line`.
    fn skip_line(&mut self, line: usize) {
        while let Some(t) = self.toks.get(self.i) {
            if t.line != line {
                break;
            }
            self.i += 1;
        }
    }
    fn skip_to_semicolon(&mut self) -> Result<(), LoadError> {
        loop {
            if self.eat_punct(';') {
                return Ok(());
            }
            self.next()?;
        }
    }
}

/// PTX ISA versions a driver accepts: 1.0 to 9.x (CUDA 13). A newer one is rejected by the
/// driver's JIT, so the VM rejects it too instead of running what no GPU would load.
fn check_version(v: &str, line: usize) -> Result<(), LoadError> {
    let ok = match v.split_once('.') {
        Some((major, minor)) => {
            matches!(major.parse::<u32>(), Ok(1..=9)) && minor.len() == 1 && minor.chars().all(|c| c.is_ascii_digit())
        }
        None => false,
    };
    if ok {
        Ok(())
    } else {
        err(line, format!("unsupported .version {v}: PTX ISA versions run from 1.0 to 9.x"))
    }
}

/// GPU architectures a `.target` may name (with an optional `a`/`f` feature suffix), and the
/// target modifiers.
const SM_VERSIONS: [u32; 33] = [
    10, 11, 12, 13, 20, 21, 30, 32, 35, 37, 50, 52, 53, 60, 61, 62, 70, 72, 73, 75, 80, 86, 87, 88, 89, 90, 100, 101,
    103, 110, 120, 121, 122,
];

fn check_target(t: &str, line: usize) -> Result<(), LoadError> {
    if matches!(t, "texmode_unified" | "texmode_independent" | "debug" | "map_f64_to_f32") {
        return Ok(());
    }
    let known = t
        .strip_prefix("sm_")
        .map(|n| n.trim_end_matches(['a', 'f']))
        .and_then(|n| n.parse::<u32>().ok())
        .is_some_and(|n| SM_VERSIONS.contains(&n));
    if known {
        Ok(())
    } else {
        err(line, format!("unsupported .target {t}: not a GPU architecture PTX can target (sm_10 ... sm_122)"))
    }
}

const LINKAGE: [&str; 4] = [".visible", ".extern", ".weak", ".common"];
const SPACES: [&str; 5] = [".global", ".shared", ".const", ".local", ".param"];

pub(crate) fn parse(src: &str) -> Result<ModuleAst, LoadError> {
    parse_text(src, || Text::Shared(Arc::from(src)))
}

/// [`parse`] of a text that lives as long as the process: the bodies borrow it.
pub(crate) fn parse_static(src: &'static str) -> Result<ModuleAst, LoadError> {
    parse_text(src, || Text::Static(src))
}

fn parse_text(src: &str, keep: impl FnOnce() -> Text) -> Result<ModuleAst, LoadError> {
    let toks = lex_module(src)?;
    let shared = keep();
    let mut p = P { src, toks, i: 0 };
    let mut m = ModuleAst::default();
    while p.i < p.toks.len() {
        let line = p.line();
        let id = match p.peek() {
            Some(&Tok::Ident(s)) => s,
            _ => return err(line, format!("expected a directive, found {}", p.describe())),
        };
        match id {
            ".version" => {
                p.i += 1;
                m.version = match p.next()?.t {
                    Tok::Num(s) => s.to_string(),
                    _ => return err(line, "bad .version"),
                };
                check_version(&m.version, line)?;
                p.skip_line(line);
            }
            ".target" => {
                p.i += 1;
                let mut t = Vec::new();
                while let Some(Tok::Ident(s)) = p.peek() {
                    if p.toks[p.i].line != line {
                        break;
                    }
                    t.push(s.to_string());
                    p.i += 1;
                    if !p.eat_punct(',') {
                        break;
                    }
                }
                for x in &t {
                    check_target(x, line)?;
                }
                m.target = t.join(", ");
                p.skip_line(line);
            }
            ".address_size" => {
                p.i += 1;
                let n = p.uint()?;
                if n != 64 {
                    return err(line, format!("unsupported .address_size {n} (only 64)"));
                }
            }
            ".file" | ".loc" => {
                p.i += 1;
                p.skip_line(line);
            }
            ".section" => {
                // Debug sections: skip the braced block.
                p.i += 1;
                while !p.is_punct('{') {
                    p.next()?;
                }
                let mut depth = 0;
                loop {
                    let t = p.next()?;
                    match t.t {
                        Tok::Punct('{') => depth += 1,
                        Tok::Punct('}') => {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        _ => {}
                    }
                }
            }
            ".pragma" => {
                p.i += 1;
                p.skip_to_semicolon()?;
            }
            _ => {
                // Linkage, then either a function or a variable.
                let mut j = 0;
                while let Some(Tok::Ident(s)) = p.peek_at(j) {
                    if LINKAGE.contains(s) {
                        j += 1;
                    } else {
                        break;
                    }
                }
                match p.peek_at(j) {
                    Some(&Tok::Ident(s)) if s == ".entry" || s == ".func" => {
                        p.i += j;
                        if let Some(f) = parse_func(&mut p, &shared)? {
                            // A declaration may precede the definition; two definitions of one
                            // name are an error in ptxas too.
                            if f.body.is_some() {
                                if let Some(first) = m.funcs.iter().find(|g| g.name == f.name && g.body.is_some()) {
                                    return err(
                                        f.line,
                                        format!(
                                            "duplicate definition of `{}` (first defined at PTX line {})",
                                            f.name, first.line
                                        ),
                                    );
                                }
                            }
                            m.funcs.push(f);
                        }
                    }
                    Some(Tok::Ident(s)) if SPACES.contains(s) => {
                        p.i += j;
                        let v = parse_var(&mut p, true)?;
                        m.vars.push(v);
                    }
                    _ => return err(line, format!("unsupported directive {}", p.describe())),
                }
            }
        }
    }
    Ok(m)
}

/// Parses `[.space] [.align N] [.ptr [.space] .align N] [.vN] .type name[[N]]... [= init]` up to and
/// including `;` when `with_semi`.
fn parse_var(p: &mut P, with_semi: bool) -> Result<VarDecl, LoadError> {
    let line = p.line();
    let mut v = VarDecl {
        space: String::new(),
        align: 0,
        ty: String::new(),
        vec: 1,
        name: String::new(),
        count: 1,
        unsized_array: false,
        is_array: false,
        init: None,
        line,
        ptr_align: None,
    };
    loop {
        let s = match p.peek_ident() {
            Some(s) => s.to_string(),
            None => return err(p.line(), format!("expected a declaration, found {}", p.describe())),
        };
        if !s.starts_with('.') {
            break;
        }
        p.i += 1;
        match s.as_str() {
            ".align" => v.align = p.uint()?,
            ".ptr" => {
                if let Some(sp) = p.peek_ident() {
                    if SPACES.contains(&sp) {
                        p.i += 1;
                    }
                }
                if p.peek_ident() == Some(".align") {
                    p.i += 1;
                    v.ptr_align = Some(p.uint()?);
                }
            }
            ".v2" => v.vec = 2,
            ".v4" => v.vec = 4,
            ".v8" => v.vec = 8,
            _ if SPACES.contains(&s.as_str()) => v.space = s,
            _ if LINKAGE.contains(&s.as_str()) => {}
            _ if type_size(&s).is_some() => v.ty = s,
            _ => return err(line, format!("unsupported declaration qualifier `{s}`")),
        }
    }
    if v.ty.is_empty() {
        return err(line, "declaration without a type");
    }
    if v.align != 0 && !v.align.is_power_of_two() {
        return err(line, format!("alignment {} is not a power of two", v.align));
    }
    v.name = p.ident()?;
    while p.eat_punct('[') {
        v.is_array = true;
        if p.eat_punct(']') {
            v.unsized_array = true;
            v.count = 0;
        } else {
            let n = p.uint()?;
            p.expect_punct(']')?;
            v.count = v
                .count
                .checked_mul(n)
                .filter(|&c| c <= 1 << 30)
                .ok_or(LoadError { line, message: "array too large".into() })?;
        }
    }
    if p.eat_punct('=') {
        let mut items = Vec::new();
        parse_init(p, &mut items, 0)?;
        if v.unsized_array {
            v.count = items.len().div_ceil(v.vec.max(1));
            v.unsized_array = false;
        }
        v.init = Some(items);
    }
    if with_semi {
        p.expect_punct(';')?;
    }
    Ok(v)
}

fn parse_init(p: &mut P, out: &mut Vec<Init>, depth: usize) -> Result<(), LoadError> {
    if depth > 8 {
        return err(p.line(), "initialiser nested too deeply");
    }
    if p.eat_punct('{') {
        if p.eat_punct('}') {
            return Ok(());
        }
        loop {
            parse_init(p, out, depth + 1)?;
            if p.eat_punct('}') {
                return Ok(());
            }
            p.expect_punct(',')?;
        }
    }
    let line = p.line();
    let neg = p.eat_punct('-');
    match p.peek().copied() {
        Some(Tok::Num(s)) => {
            p.i += 1;
            out.push(Init::Num(parse_number(s, line)?, neg));
        }
        Some(Tok::Ident(s)) if !neg => {
            p.i += 1;
            let (name, generic) = if s == "generic" {
                p.expect_punct('(')?;
                let n = p.ident()?;
                p.expect_punct(')')?;
                (n, true)
            } else {
                (s.to_string(), false)
            };
            let mut off = 0;
            if p.eat_punct('+') {
                off = p.signed()?;
            }
            out.push(Init::Sym { name, off, generic });
        }
        _ => return err(line, format!("bad initialiser {}", p.describe())),
    }
    Ok(())
}

fn parse_param_list(p: &mut P) -> Result<Vec<VarDecl>, LoadError> {
    let mut out = Vec::new();
    p.expect_punct('(')?;
    if p.eat_punct(')') {
        return Ok(out);
    }
    loop {
        let line = p.line();
        match p.peek_ident() {
            Some(".param") => {}
            Some(".reg") => return err(line, "`.reg` function parameters are not supported"),
            _ => return err(line, format!("expected `.param`, found {}", p.describe())),
        }
        let v = parse_var(p, false)?;
        out.push(v);
        if p.eat_punct(')') {
            return Ok(out);
        }
        p.expect_punct(',')?;
    }
}

fn parse_func(p: &mut P, shared: &Text) -> Result<Option<FuncAst>, LoadError> {
    let line = p.line();
    let kind = p.ident()?;
    let is_entry = kind == ".entry";
    let mut rets = Vec::new();
    if !is_entry && p.is_punct('(') {
        rets = parse_param_list(p)?;
    }
    let name = p.ident()?;
    let params = if p.is_punct('(') { parse_param_list(p)? } else { Vec::new() };
    // Performance directives up to the body.
    loop {
        match p.peek() {
            Some(Tok::Body) => break,
            Some(Tok::Punct(';')) => {
                p.i += 1;
                return Ok(Some(FuncAst { name, is_entry, rets, params, body: None, line }));
            }
            Some(&Tok::Ident(s)) => match s {
                ".maxntid" | ".reqntid" | ".minnctapersm" | ".maxnreg" | ".maxclusterrank" | ".reqnctapercluster"
                | ".explicitcluster" | ".noreturn" | ".blocksareclusters" => {
                    p.i += 1;
                    while matches!(p.peek(), Some(Tok::Num(_)) | Some(Tok::Punct(','))) {
                        p.i += 1;
                    }
                }
                ".pragma" => {
                    p.i += 1;
                    p.skip_to_semicolon()?;
                }
                _ => return err(p.line(), format!("unsupported function directive `{s}`")),
            },
            _ => return err(p.line(), format!("expected a function body, found {}", p.describe())),
        }
    }
    let t = p.next()?;
    let body = FuncBody { src: shared.clone(), start: t.start, end: t.end, line: t.line, stmts: OnceLock::new() };
    Ok(Some(FuncAst { name, is_entry, rets, params, body: Some(body), line }))
}

/// The statements of a body whose `{` has been read, up to and including its `}`.
fn parse_body(p: &mut P) -> Result<Vec<Stmt>, LoadError> {
    // About one statement per ten tokens.
    let mut body = Vec::with_capacity(p.toks.len() / 10);
    let mut depth = 1usize;
    loop {
        let line = p.line();
        if p.eat_punct('}') {
            depth -= 1;
            if depth == 0 {
                break;
            }
            body.push(Stmt::Close);
            continue;
        }
        if p.eat_punct('{') {
            depth += 1;
            if depth > 64 {
                return err(line, "blocks nested too deeply");
            }
            body.push(Stmt::Open);
            continue;
        }
        // Instructions (most statements) are parsed from the tokens; only labels and directives
        // need the name here.
        let directive = match p.peek() {
            None => return err(line, "unterminated function body"),
            Some(&Tok::Ident(s)) if s.starts_with('.') => Some(s),
            Some(Tok::Ident(_)) if p.peek_at(1) == Some(&Tok::Punct(':')) => {
                let s = p.ident()?;
                p.i += 1;
                body.push(Stmt::Label(s));
                continue;
            }
            _ => None,
        };
        match p.peek() {
            None => return err(line, "unterminated function body"),
            Some(Tok::Ident(_)) => {
                let s = directive.unwrap_or_default();
                match s {
                    ".reg" => {
                        p.i += 1;
                        let mut ty = String::new();
                        while let Some(q) = p.peek_ident() {
                            if !q.starts_with('.') {
                                break;
                            }
                            if type_size(q).is_some() {
                                ty = q.to_string();
                            } else if q == ".v2" || q == ".v4" {
                                return err(line, "vector registers are not supported");
                            } else if q == ".align" {
                                p.i += 1;
                                p.uint()?;
                                continue;
                            } else {
                                return err(line, format!("unsupported register type `{q}`"));
                            }
                            p.i += 1;
                        }
                        if ty.is_empty() {
                            return err(line, "`.reg` without a type");
                        }
                        let mut names = Vec::new();
                        loop {
                            let n = p.ident()?;
                            if p.eat_punct('<') {
                                let c = p.uint()?;
                                p.expect_punct('>')?;
                                if c > 1 << 20 {
                                    return err(line, "too many registers");
                                }
                                for k in 0..c {
                                    names.push(format!("{n}{k}"));
                                }
                            } else {
                                names.push(n);
                            }
                            if !p.eat_punct(',') {
                                break;
                            }
                        }
                        p.expect_punct(';')?;
                        let _ = ty;
                        body.push(Stmt::Reg { names, line });
                    }
                    ".local" | ".shared" | ".param" | ".global" | ".const" => {
                        let v = parse_var(p, true)?;
                        body.push(Stmt::Var(v));
                    }
                    ".pragma" | ".loc" | ".file" | ".maxnreg" => {
                        p.i += 1;
                        if s == ".pragma" {
                            p.skip_to_semicolon()?;
                        } else {
                            p.skip_line(line);
                        }
                    }
                    _ if s.starts_with('.') => return err(line, format!("unsupported directive `{s}` in a body")),
                    _ => body.push(Stmt::Inst(parse_inst(p)?)),
                }
            }
            Some(Tok::Punct('@')) => body.push(Stmt::Inst(parse_inst(p)?)),
            Some(_) => return err(line, format!("unexpected {} in a function body", p.describe())),
        }
    }
    Ok(body)
}

fn parse_inst(p: &mut P) -> Result<InstAst, LoadError> {
    let line = p.line();
    let start = p.toks[p.i].start;
    let mut guard = None;
    if p.eat_punct('@') {
        let neg = p.eat_punct('!');
        guard = Some((p.ident()?, neg));
    }
    let opcode = p.ident()?;
    let mut ops = Vec::new();
    if !p.is_punct(';') {
        loop {
            ops.push(parse_operand(p)?);
            if !p.eat_punct(',') {
                break;
            }
        }
    }
    let end = p.toks.get(p.i).map(|t| t.end).unwrap_or(start);
    p.expect_punct(';')?;
    let text = squeeze_whitespace(p.src.get(start..end).unwrap_or(""));
    Ok(InstAst { guard, opcode, ops, line, text })
}

/// `s` with each run of whitespace made one space and none at either end.
fn squeeze_whitespace(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for w in s.split_ascii_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(w);
    }
    out
}

fn parse_operand(p: &mut P) -> Result<Operand, LoadError> {
    let line = p.line();
    if p.eat_punct('[') {
        let mut base = None;
        let mut off = 0i64;
        if let Some(Tok::Ident(_)) = p.peek() {
            base = Some(p.ident()?);
            if p.eat_punct('+') || p.is_punct('-') {
                off = p.signed()?;
            }
        } else {
            off = p.signed()?;
        }
        if p.eat_punct(',') {
            let coords = match parse_operand(p)? {
                Operand::Vec(v) => v,
                _ => return err(line, "expected `{...}` coordinates after the tensor map"),
            };
            p.expect_punct(']')?;
            return Ok(Operand::TensorAddr { base, off, coords });
        }
        p.expect_punct(']')?;
        return Ok(Operand::Addr { base, off });
    }
    if p.eat_punct('{') {
        let mut v = Vec::new();
        loop {
            v.push(parse_operand(p)?);
            if p.eat_punct('}') {
                break;
            }
            p.expect_punct(',')?;
        }
        return Ok(Operand::Vec(v));
    }
    if p.eat_punct('(') {
        let mut v = Vec::new();
        if !p.eat_punct(')') {
            loop {
                v.push(p.ident()?);
                if p.eat_punct(')') {
                    break;
                }
                p.expect_punct(',')?;
            }
        }
        return Ok(Operand::List(v));
    }
    if p.eat_punct('!') {
        return Ok(Operand::Not(p.ident()?));
    }
    if p.eat_punct('-') {
        return match p.number()? {
            n @ Number::Int(_) => Ok(Operand::NegNum(n)),
            Number::F32(b) => Ok(Operand::Num(Number::F32(b ^ 0x8000_0000))),
            Number::F64(b) => Ok(Operand::Num(Number::F64(b ^ (1 << 63)))),
        };
    }
    match p.peek() {
        Some(Tok::Num(_)) => Ok(Operand::Num(p.number()?)),
        Some(Tok::Ident(_)) => {
            let s = p.ident()?;
            if p.eat_punct('|') {
                return Ok(Operand::Pair(s, p.ident()?));
            }
            if p.eat_punct('+') {
                return Ok(Operand::SymOff(s, p.signed()?));
            }
            Ok(Operand::Name(s))
        }
        _ => err(line, format!("bad operand {}", p.describe())),
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    pub fn next_special_finds_the_byte_and_counts_the_lines_before_it() {
        // Texts of braces, slashes, quotes, newlines and other bytes, every start, against the
        // byte-by-byte rule: the vector steps and the tail at every alignment.
        let alphabet = b"ab \n\n{}/\"x";
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        for len in 0..120 {
            for sparse in [false, true] {
                let text: Vec<u8> = (0..len)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let k = (x >> 40) as usize;
                        if sparse && !k.is_multiple_of(23) {
                            [b'a', b'\n'][k % 2]
                        } else {
                            alphabet[k % alphabet.len()]
                        }
                    })
                    .collect();
                for from in 0..=len {
                    let at = (from..len).find(|&i| b"{}/\"".contains(&text[i])).unwrap_or(len);
                    let lines = text[from..at].iter().filter(|&&c| c == b'\n').count();
                    assert_eq!(next_special(&text, from), (at, lines), "len {len} from {from}");
                }
            }
        }
    }

    /// [`skip_block`] byte by byte, as it was before it skipped to the next special byte.
    fn skip_block_plain(b: &[u8], open: usize) -> Option<(usize, usize)> {
        let (mut i, mut depth, mut lines) = (open, 0usize, 0usize);
        while i < b.len() {
            match b[i] {
                b'\n' => lines += 1,
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        return Some((i + 1, lines));
                    }
                }
                b'/' if b.get(i + 1) == Some(&b'/') => {
                    while i < b.len() && b[i] != b'\n' {
                        i += 1;
                    }
                    continue;
                }
                b'/' if b.get(i + 1) == Some(&b'*') => {
                    i += 2;
                    while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                        lines += usize::from(b[i] == b'\n');
                        i += 1;
                    }
                    i += 2;
                    continue;
                }
                b'"' => {
                    i += 1;
                    while i < b.len() && b[i] != b'"' && b[i] != b'\n' {
                        i += 1;
                    }
                }
                _ => {}
            }
            i += 1;
        }
        None
    }

    pub fn skipping_a_block_ends_and_counts_lines_as_byte_by_byte() {
        // Every `{` of both committed modules, and blocks with comments, strings (one cut by a
        // newline), braces inside them, slashes, and no end.
        let odd = "{ a\n// } {\n/* }\n{ */ \"}\n\" / b { c\n}\n}\nx { \"open\n} y\n{ /* never closed\n}";
        for text in [kernels_gpu::artifacts::PTX, kernels_gpu::artifacts::PTX_SM90, odd] {
            let b = text.as_bytes();
            let opens: Vec<usize> = (0..b.len()).filter(|&i| b[i] == b'{').collect();
            let step = (opens.len() / 3000).max(1);
            for &open in opens.iter().step_by(step) {
                assert_eq!(skip_block(b, open), skip_block_plain(b, open), "block at byte {open}");
            }
        }
    }
}
