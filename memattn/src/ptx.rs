//! The PTX module the host launches: embedded at build time (or read from `--ptx FILE`), with
//! what the build recorded about it (`build-info.json`, `ptxas-report.json`) when those exist.

use kernels_gpu::variants::TileRecord;
use kernels_gpu::KernelId;
use std::sync::{Arc, OnceLock};

/// The committed kernel module, `kernels-gpu/ptx/memattn_kernels.ptx` (owned by kernels-gpu): the
/// same static, so a program holds the text once.
pub use kernels_gpu::artifacts::PTX as EMBEDDED_PTX;

/// One `.param` of an entry, as declared.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct PtxParam {
    /// The parameter's name.
    pub name: String,
    /// e.g. `.align 8 .b8 [264]`, `.u64`, `.f32`.
    pub decl: String,
}

/// One `.entry` found in the PTX text.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct PtxEntry {
    /// The entry point's name.
    pub name: String,
    /// The 1-based line of its `.entry` directive.
    pub line: usize,
    /// Its parameters, in declaration order.
    pub params: Vec<PtxParam>,
}

/// A PTX module's text and what can be read from it without a driver.
///
/// The fields describe the module as it was loaded: `sha256` is the digest of `text`, and the
/// tile records ([`PtxSource::tile_records`]) are read from `text` once and shared by clones.
#[derive(Clone, Debug)]
pub struct PtxSource {
    /// The module's text: the embedded one borrowed from the binary, a file's owned.
    pub text: std::borrow::Cow<'static, str>,
    /// "embedded" or the file path.
    pub origin: String,
    /// The SHA-256 digest of `text`, lowercase hex.
    pub sha256: String,
    /// The tile records, read from `text` on first use (every launch plan checks them).
    tiles: Arc<OnceLock<Vec<(String, TileRecord)>>>,
    /// The entries, read from `text` on first use.
    entries: Arc<OnceLock<Vec<PtxEntry>>>,
    /// Each `.entry`'s bytes in `text`, found on first use ([`PtxSource::entry_module`]).
    spans: Arc<OnceLock<EntrySpans>>,
}

impl PtxSource {
    /// The process-wide VM module of this text ([`ptx_vm::Module::shared`]; the embedded text,
    /// which lives as long as the process, without hashing it again).
    #[cfg(feature = "vm")]
    pub fn vm_module(&self) -> Result<Arc<ptx_vm::Module>, ptx_vm::LoadError> {
        match &self.text {
            std::borrow::Cow::Borrowed(text) => ptx_vm::Module::shared_static(text),
            std::borrow::Cow::Owned(text) => ptx_vm::Module::shared(text),
        }
    }

    /// The committed module, borrowed from the binary. Its digest is the one `build-info.json`
    /// records (checked against the text by the tests); its tile records are read once per process.
    pub fn embedded() -> PtxSource {
        static EMBEDDED: OnceLock<PtxSource> = OnceLock::new();
        EMBEDDED
            .get_or_init(|| PtxSource {
                text: EMBEDDED_PTX.into(),
                origin: "embedded".into(),
                sha256: kernels_gpu::artifacts::ptx_sha256(),
                tiles: Arc::default(),
                entries: Arc::default(),
                spans: Arc::default(),
            })
            .clone()
    }

    /// The committed `sm_90a` module (the Hopper kernels), digest computed once per process.
    pub fn embedded_sm90() -> PtxSource {
        static EMBEDDED: OnceLock<PtxSource> = OnceLock::new();
        EMBEDDED
            .get_or_init(|| PtxSource {
                text: kernels_gpu::artifacts::PTX_SM90.into(),
                origin: "embedded (sm_90a)".into(),
                sha256: kernels_gpu::artifacts::ptx_sm90_sha256(),
                tiles: Arc::default(),
                entries: Arc::default(),
                spans: Arc::default(),
            })
            .clone()
    }

    /// The committed timeline module (`memattn run --timeline`: the forwards with a clock stamp
    /// per warp at each phase, see [`kernels_gpu::timeline`]). Its text is a copy, so that a
    /// CUDA device loads the small module whole, as it loads a file.
    pub fn embedded_timeline() -> PtxSource {
        static EMBEDDED: OnceLock<PtxSource> = OnceLock::new();
        EMBEDDED
            .get_or_init(|| PtxSource {
                text: std::borrow::Cow::Owned(kernels_gpu::artifacts::PTX_TIMELINE.to_string()),
                origin: "embedded (timeline)".into(),
                sha256: kernels_gpu::artifacts::ptx_timeline_sha256(),
                tiles: Arc::default(),
                entries: Arc::default(),
                spans: Arc::default(),
            })
            .clone()
    }

    /// The committed sm_90a timeline module (the Hopper forwards with their stamps), loaded as
    /// [`PtxSource::embedded_timeline`].
    pub fn embedded_timeline_sm90() -> PtxSource {
        static EMBEDDED: OnceLock<PtxSource> = OnceLock::new();
        EMBEDDED
            .get_or_init(|| PtxSource {
                text: std::borrow::Cow::Owned(kernels_gpu::artifacts::PTX_TIMELINE_SM90.to_string()),
                origin: "embedded (timeline, sm_90a)".into(),
                sha256: kernels_gpu::artifacts::ptx_timeline_sm90_sha256(),
                tiles: Arc::default(),
                entries: Arc::default(),
                spans: Arc::default(),
            })
            .clone()
    }

    /// A module read from the file `path` (its origin), with its text `text`.
    pub fn from_file(path: &std::path::Path, text: String) -> PtxSource {
        let sha256 = kernels_gpu::artifacts::sha256_hex(text.as_bytes());
        PtxSource {
            text: text.into(),
            origin: path.display().to_string(),
            sha256,
            tiles: Arc::default(),
            entries: Arc::default(),
            spans: Arc::default(),
        }
    }

    /// Whether this is the embedded `sm_80` module (origin `embedded`).
    pub fn is_embedded(&self) -> bool {
        self.origin == "embedded"
    }

    /// `.version` and `.target` directives.
    pub fn version_and_target(&self) -> (Option<String>, Option<String>) {
        let mut version = None;
        let mut target = None;
        for line in self.text.lines() {
            let t = line.trim();
            if let Some(v) = t.strip_prefix(".version") {
                version.get_or_insert_with(|| v.trim().to_string());
            } else if let Some(v) = t.strip_prefix(".target") {
                target.get_or_insert_with(|| v.trim().to_string());
            }
            // The first of each counts: the rest of a large module need not be read.
            if version.is_some() && target.is_some() {
                break;
            }
        }
        (version, target)
    }

    /// A module of one kernel: the text with every `.entry` but `name` cut out (the globals and
    /// `.func`s stay). A driver compiles it in a fraction of the whole module's time (ptxas: at
    /// most 1.8 of 37 seconds, for a tensor-core forward). `Ok(None)` when the text has no entry `name`; an
    /// error when its functions' braces do not pair up.
    pub fn entry_module(&self, name: &str) -> Result<Option<String>, String> {
        let spans = self.spans.get_or_init(|| entry_spans(&self.text)).as_ref().map_err(|e| e.clone())?;
        if !spans.iter().any(|(n, _)| n == name) {
            return Ok(None);
        }
        let mut out = String::new();
        let mut at = 0;
        for (n, r) in spans {
            if n != name {
                out.push_str(&self.text[at..r.start]);
                at = r.end;
            }
        }
        out.push_str(&self.text[at..]);
        Ok(Some(out))
    }

    /// The `.entry` points and their parameters (a light scan of the text, no full parse, once).
    pub fn entries(&self) -> Vec<PtxEntry> {
        self.entries.get_or_init(|| self.scan_entries()).clone()
    }

    fn scan_entries(&self) -> Vec<PtxEntry> {
        let mut out = Vec::new();
        let mut current: Option<PtxEntry> = None;
        for (n, line) in self.text.lines().enumerate() {
            let t = line.trim();
            if let Some(pos) = t.find(".entry ") {
                let rest = &t[pos + ".entry ".len()..];
                let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '$').collect();
                if let Some(e) = current.take() {
                    out.push(e);
                }
                current = Some(PtxEntry { name, line: n + 1, params: Vec::new() });
                continue;
            }
            if let Some(e) = current.as_mut() {
                if let Some(decl) = t.strip_prefix(".param") {
                    let decl = decl.trim().trim_end_matches(',').trim();
                    let (decl, name) = match decl.rsplit_once(char::is_whitespace) {
                        Some((d, n)) => (d.trim().to_string(), n.to_string()),
                        None => (String::new(), decl.to_string()),
                    };
                    let (name, decl) = match name.find('[') {
                        Some(i) => (name[..i].to_string(), format!("{decl} {}", &name[i..])),
                        None => (name, decl),
                    };
                    e.params.push(PtxParam { name, decl });
                } else if t.starts_with('{') || t.starts_with(')') && t.contains('{') {
                    out.push(current.take().expect("current entry"));
                }
            }
        }
        out.extend(current);
        out
    }
}

impl PtxSource {
    /// The tile records the module exports (`memattn_tile_<entry>`), by entry name.
    pub fn tile_records(&self) -> Vec<(String, TileRecord)> {
        self.tiles().to_vec()
    }

    fn tiles(&self) -> &[(String, TileRecord)] {
        self.tiles.get_or_init(|| kernels_gpu::artifacts::tile_records(&self.text))
    }

    /// Checks, before launch, that the module was built from the same tiles as this host: the
    /// host derives block size, grid and dynamic shared memory from its variant table, so a module
    /// built from other tiles would run with the wrong geometry. An error names the entry, both
    /// configurations and the fix.
    pub fn check_tiles(&self, kernels: &[KernelId]) -> Result<(), String> {
        let records = self.tiles();
        for k in kernels {
            let want = k.variant().tile_record();
            let show = |r: &TileRecord| {
                format!(
                    "threads {}, block rows {}, block cols {}, dynamic smem {} B, head_dim {}",
                    r.threads, r.block_rows, r.block_cols, r.dynamic_smem_bytes, r.head_dim
                )
            };
            match records.iter().find(|(n, _)| n == k.name()) {
                Some((_, got)) if *got == want => {}
                Some((_, got)) => {
                    return Err(format!(
                        "`{}` in {} was built with a different tile ({}) than this memattn launches ({}); \
                         rebuild the module from this source tree (cargo xtask build-ptx) or edit a copy of the \
                         committed PTX",
                        k.name(),
                        self.origin,
                        show(got),
                        show(&want)
                    ));
                }
                None => {
                    return Err(format!(
                        "{} has no tile record `{}{}` for `{}`, so its launch geometry cannot be confirmed; \
                         modules built by `cargo xtask build-ptx` (and edited copies of the committed PTX) carry \
                         one per entry",
                        self.origin,
                        TileRecord::SYMBOL_PREFIX,
                        k.name(),
                        k.name()
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Each `.entry`'s name and bytes, or why the text could not be cut ([`entry_spans`]).
type EntrySpans = Result<Vec<(String, std::ops::Range<usize>)>, String>;
/// Each `.entry` function of a PTX text and its bytes: from its first qualifier (`.visible`,
/// `.weak`) or `.entry` to one past its closing brace, found by pairing the braces of the top
/// level (comments and strings skipped).
pub fn entry_spans(text: &str) -> Result<Vec<(String, std::ops::Range<usize>)>, String> {
    let b = text.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b'$' || c == b'.' || c == b'%';
    let line = |at: usize| text[..at].matches('\n').count() + 1;
    let (mut i, mut depth) = (0usize, 0usize);
    let mut pending: Option<(String, usize)> = None;
    let mut out = Vec::new();
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                i = text[i..].find('\n').map_or(b.len(), |n| i + n);
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let end = text[i + 2..].find("*/").ok_or_else(|| format!("line {}: unterminated comment", line(i)))?;
                i += 2 + end + 2;
            }
            b'"' => {
                let end = text[i + 1..].find('"').ok_or_else(|| format!("line {}: unterminated string", line(i)))?;
                i += 1 + end + 1;
            }
            b'{' => {
                depth += 1;
                i += 1;
            }
            b'}' => {
                depth = depth.checked_sub(1).ok_or_else(|| format!("line {}: `}}` without `{{`", line(i)))?;
                i += 1;
                if depth == 0
                    && let Some((name, start)) = pending.take()
                {
                    out.push((name, start..i));
                }
            }
            b';' if depth == 0 && pending.is_some() => {
                return Err(format!("line {}: `.entry` without a body", line(i)));
            }
            b'.' if depth == 0
                && text[i..].starts_with(".entry")
                && (i == 0 || !ident(b[i - 1]))
                && !b.get(i + 6).is_some_and(|&c| ident(c)) =>
            {
                let rest = text[i + 6..].trim_start();
                let name: String = rest.bytes().take_while(|&c| ident(c)).map(char::from).collect();
                if name.is_empty() {
                    return Err(format!("line {}: `.entry` without a name", line(i)));
                }
                // Back over the qualifiers written before `.entry`.
                let mut start = i;
                loop {
                    let before = text[..start].trim_end();
                    match [".visible", ".weak"].iter().find(|q| before.ends_with(*q)) {
                        Some(q) if !before[..before.len() - q.len()].bytes().last().is_some_and(ident) => {
                            start = before.len() - q.len();
                        }
                        _ => break,
                    }
                }
                pending = Some((name, start));
                i += 6;
            }
            _ => i += 1,
        }
    }
    if depth != 0 || pending.is_some() {
        return Err("the text ends inside a function".into());
    }
    Ok(out)
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    pub fn an_entry_module_keeps_one_entry_and_everything_else() {
        let text = "// header {\n.version 7.4\n.target sm_80\n.address_size 64\n\n\
                    .global .align 4 .b8 g[2] = {1, 2};\n.func helper(.param .b32 a)\n{\n\tret;\n}\n\
                    // .globl\ta\n.visible .entry a(\n\t.param .u64 p\n)\n{\n\t// a } in a comment\n\
                    \t/* and { here */\n\t{ .reg .b32 t; }\n\tret;\n}\n\
                    .weak   .entry b()\n.maxntid 128, 1, 1\n{\n\tret;\n}\n.entry c()\n{\n\tret;\n}\n";
        let spans = entry_spans(text).unwrap();
        let names: Vec<&str> = spans.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert!(
            text[spans[0].1.clone()].starts_with(".visible .entry a(") && text[spans[0].1.clone()].ends_with("ret;\n}")
        );
        assert!(text[spans[1].1.clone()].starts_with(".weak   .entry b()"));
        let src = PtxSource::from_file(std::path::Path::new("t.ptx"), text.to_string());
        let a = src.entry_module("a").unwrap().unwrap();
        assert!(a.contains(".entry a(") && !a.contains(".entry b(") && !a.contains(".entry c("), "{a}");
        assert!(
            a.starts_with("// header {\n.version 7.4") && a.contains(".func helper") && a.contains("g[2] = {1, 2};")
        );
        let b = src.entry_module("b").unwrap().unwrap();
        assert!(b.contains(".maxntid 128, 1, 1") && !b.contains(".entry a(") && !b.contains(".entry c("), "{b}");
        assert_eq!(src.entry_module("d").unwrap(), None);
        // Every byte is in exactly one entry or in what all of them keep.
        let common = text.len() - spans.iter().map(|(_, r)| r.len()).sum::<usize>();
        assert_eq!(a.len(), common + spans[0].1.len());
        // A body that never closes, a stray brace, an entry without a body: errors.
        assert!(entry_spans(".entry a()\n{\n\tret;\n").is_err());
        assert!(entry_spans("}\n").is_err());
        assert!(entry_spans(".entry a();\n").is_err());
    }

    /// Each entry of both committed modules alone: one `.entry`, that one, and (VM) a module that
    /// loads with exactly that kernel. The per-entry texts are what the CUDA backend JIT-compiles.
    pub fn every_committed_entry_makes_a_module_of_its_own() {
        for src in [PtxSource::embedded(), PtxSource::embedded_sm90()] {
            let spans = entry_spans(&src.text).unwrap();
            let names: Vec<String> = src.entries().into_iter().map(|e| e.name).collect();
            assert_eq!(spans.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(), names, "{}", src.origin);
            let common = src.text.len() - spans.iter().map(|(_, r)| r.len()).sum::<usize>();
            assert!(common < 64 * 1024, "{}: {common} bytes outside the entries", src.origin);
            for (name, r) in &spans {
                let m = src.entry_module(name).unwrap().unwrap();
                assert_eq!(m.len(), common + r.len(), "{name}");
                assert_eq!(m.matches(".entry ").count(), 1, "{name}");
                #[cfg(feature = "vm")]
                {
                    let vm = ptx_vm::Module::load(&m).unwrap_or_else(|e| panic!("{name}: {e}"));
                    assert_eq!(vm.kernel_names(), std::slice::from_ref(name));
                }
            }
        }
    }

    pub fn a_module_built_from_other_tiles_is_refused_before_launch() {
        let k = KernelId::FlashFwdF32D64;
        let good = PtxSource::embedded();
        assert!(good.check_tiles(&[k]).is_ok());
        // The same module with the f32 d64 tile's block rows changed from 32 to 16.
        let needle = "memattn_tile_flash_fwd_f32_d64[20] = {128, 0, 0, 0, 32,";
        assert!(good.text.contains(needle));
        let text = good.text.replace(needle, "memattn_tile_flash_fwd_f32_d64[20] = {128, 0, 0, 0, 16,");
        let other = PtxSource::from_file(std::path::Path::new("other.ptx"), text);
        let e = other.check_tiles(&[k]).unwrap_err();
        assert!(e.contains("flash_fwd_f32_d64") && e.contains("block rows 16") && e.contains("block rows 32"), "{e}");
        // A module without records.
        let bare: String = good.text.lines().filter(|l| !l.contains("memattn_tile_")).collect::<Vec<_>>().join("\n");
        let e = PtxSource::from_file(std::path::Path::new("bare.ptx"), bare).check_tiles(&[k]).unwrap_err();
        assert!(e.contains("no tile record") && e.contains("bare.ptx"), "{e}");
    }

    pub fn embedded_entries_are_the_variant_table() {
        use kernels_gpu::variants::PtxModule;
        // Every row of the table is an entry of its module, and every entry is a row.
        for (src, module) in [(PtxSource::embedded(), PtxModule::Sm80), (PtxSource::embedded_sm90(), PtxModule::Sm90a)]
        {
            let names: Vec<String> = src.entries().into_iter().map(|e| e.name).collect();
            let rows: Vec<KernelId> = KernelId::ALL.into_iter().filter(|k| k.variant().module() == module).collect();
            for k in &rows {
                assert!(
                    names.iter().any(|n| n == k.name()),
                    "`{}` is a row of kernels-gpu/src/variants.rs but missing from the {module:?} PTX; fix: cargo xtask build-ptx",
                    k.name()
                );
            }
            for n in &names {
                assert!(
                    KernelId::from_name(n).is_some_and(|k| k.variant().module() == module),
                    "PTX entry `{n}` is not a {module:?} row of kernels-gpu/src/variants.rs; add its row there"
                );
            }
            assert!(src.check_tiles(&rows).is_ok());
        }
        let src = PtxSource::embedded();
        let flash = src.entries().into_iter().find(|e| e.name == "flash_fwd_f32_d64").unwrap();
        assert_eq!(flash.params.len(), 1);
        assert!(flash.params[0].decl.contains("[264]"), "{:?}", flash.params[0]);
        let saxpy = src.entries().into_iter().find(|e| e.name == "saxpy_f32").unwrap();
        assert_eq!(saxpy.params.len(), 4);
        let (v, t) = src.version_and_target();
        assert!(v.is_some() && t.as_deref().unwrap_or("").starts_with("sm_"));
    }
}
