//! `memattn`: memory-efficient (FlashAttention-style) attention kernels written in Rust, shipped
//! as prebuilt PTX, launched on your CUDA stream through cudarc or run in the PTX VM, with an f64
//! reference for your tests. No nvcc and no CUDA toolkit at build time; the driver is loaded at
//! run time.
//!
//! Start at [`attn`]: views of your cudarc slices (or VM buffers), [`attn::Kernels::flash_attn`]
//! / [`attn::Kernels::flash_attn_into`], the varlen and KV-cache calls, `merge_states_into`, typed
//! errors before launch, and the semantics table (layouts, bottom-right causal mask, LSE in
//! natural log). [`reference::attention`] and [`decode::reference`] are the f64 references (one
//! row routine behind both), [`verify`] the acceptance rule of both.
//!
//! # Features
//! - `vm` (default): the PTX VM backend ([`attn::Kernels::vm`]), the same kernels on the CPU with
//!   memcheck, initcheck and racecheck.
//! - `cuda-12080` (default): cudarc's two build choices for a program that makes none: the CUDA
//!   driver API version it binds (cudarc needs exactly one) and `fallback-dynamic-loading` (the
//!   driver is loaded at run time unless the program links it). A program that makes its own
//!   (candle-core's `cuda` feature: `cuda-version-from-build-system` and `dynamic-linking`) turns
//!   the default features off; memattn then asks cudarc for nothing that program does not.
//! - `serde`: `serde::Serialize` for the plain records ([`Dtype`], [`Problem`], the decode plan).
//!
//! The modules form layers; each imports only from layers above it in this list (a unit test,
//! `module_layers_have_no_cycle`, reads every source file, subfolders included, and fails on an
//! import against the order):
//! 1. leaves: [`units`] (byte sizes), [`parse`] (option-value errors), [`caps`] (device limits),
//!    [`panics`] (calling code that may panic), [`driver`] (which CUDA driver library), [`rng`],
//!    [`tma`] (the Hopper forward's tensor maps), [`choice`] (which module's kernel a GPU
//!    generation runs: the measured table and `MEMATTN_HOPPER`);
//! 2. [`dtype`] and [`problem`]: the attention problem (shape, dtype, causal, scale, layout), the
//!    kernels it launches (a lookup in the variant table) and its launch-limit validation;
//! 3. [`inputs`], [`memory`] (the analytic bytes of a run and the free-memory check);
//! 4. [`mod@reference`] (the f64 reference), then [`verify`] (a result's errors against it and
//!    the bounds it must meet, the same check the `memattn` command makes);
//! 5. [`ptx`] (the module and what is known about it), then [`device`] (the [`device::Device`]
//!    trait, the VM and the CUDA module with the one launch);
//! 6. [`error`], then [`decode`]: the KV-cache decode plan (split plan, launches, parameters),
//!    its f64 reference and the `merge_states` reference;
//! 7. [`attn`]: the attention API;
//! 8. [`cp`]: context parallelism (ring, zigzag, Ulysses, sharded decode) over a
//!    [`cp::Communicator`], written on [`attn`].

#![deny(missing_docs)]

/// `fn $name(args) -> R { body }` whose body is compiled three times, for AVX-512, for AVX2 and
/// for the baseline, the widest the host has chosen at run time (once per call: the standard
/// library caches the CPU's features); `$baseline` is the baseline copy alone (for tests that
/// compare the copies). For the host's f64 reference loops: the compiler vectorises them wider
/// with each level, and never contracts a multiply and an add into an FMA, so every level gives
/// the same bits. What the body calls in its loops must be `#[inline(always)]` so that it is
/// compiled inside each copy.
macro_rules! widest_vectors {
    (
        $(#[$doc:meta])*
        fn $name:ident / $baseline:ident ($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block
    ) => {
        #[inline(always)]
        #[allow(clippy::too_many_arguments)]
        fn $baseline($($arg: $ty),*) $(-> $ret)? $body

        $(#[$doc])*
        #[allow(clippy::too_many_arguments)]
        fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    $baseline($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $baseline($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512F, the one feature `avx512` is compiled with.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2, the one feature `avx2` is compiled with.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $baseline($($arg),*)
        }
    };
}

pub mod attn;
pub mod caps;
pub mod choice;
pub mod cp;
pub mod decode;
pub mod device;
pub mod driver;
pub mod dtype;
pub mod error;
pub mod inputs;
pub mod memory;
pub mod panics;
pub mod parse;
pub mod problem;
pub mod ptx;
pub mod reference;
pub mod rng;
pub mod tma;
pub mod units;
pub mod verify;

pub use device::{Backend, BackendChoice, Device};
pub use dtype::Dtype;
pub use problem::{KernelKind, Layout, Problem};

/// The unit tests, for `memattn-tests` to run (its test `unit`); not an API.
#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod unit_tests {
    pub use crate::attn::alias::tests as attn_alias;
    #[cfg(feature = "vm")]
    pub use crate::attn::backward::tests as attn_backward;
    #[cfg(feature = "vm")]
    pub use crate::attn::naive_backward::tests as attn_naive_backward;
    pub use crate::choice::tests as choice;
    pub use crate::cp::grouped::tests as cp_grouped;
    pub use crate::cp::tests as cp;
    pub use crate::decode::tests as decode;
    pub use crate::dtype::tests as dtype;
    pub use crate::inputs::tests as inputs;
    pub use crate::layering_tests;
    pub use crate::memory::tests as memory;
    pub use crate::problem::tests as problem;
    pub use crate::ptx::tests as ptx;
    pub use crate::reference::grad::tests as reference_grad;
    pub use crate::reference::tests as reference;
    pub use crate::rng::tests as rng;
    pub use crate::verify::grad::tests as verify_grad;
    pub use crate::verify::row_local_tests as verify_row_local_tests;
    pub use crate::verify::tests as verify;
    pub use crate::verify::underflow_tests as verify_underflow_tests;
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod layering_tests {
    //! The module layers of the crate docs, checked against the sources.

    use std::collections::{BTreeMap, BTreeSet};

    /// The layers, top (imports nothing from the crate) to bottom.
    const LAYERS: &[&[&str]] = &[
        &["units", "parse", "caps", "panics", "driver", "rng", "tma", "choice"],
        &["dtype", "problem"],
        &["inputs", "memory"],
        &["reference"],
        &["verify"],
        &["ptx", "device"],
        &["error", "decode"],
        &["attn"],
        &["cp"],
    ];

    fn layer_of(m: &str) -> Option<usize> {
        LAYERS.iter().position(|l| l.contains(&m))
    }

    /// The module behind a name re-exported at the crate root (see the `pub use`s above).
    fn root_reexport(name: &str) -> &str {
        match name {
            "Dtype" => "dtype",
            "Backend" | "BackendChoice" | "Device" => "device",
            "KernelKind" | "Layout" | "Problem" => "problem",
            other => other,
        }
    }

    /// `crate::name` references in code (comment lines and doc comments are skipped).
    pub(crate) fn imports(src: &str) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        for line in src.lines() {
            let code = line.split("//").next().unwrap_or("");
            let mut rest = code;
            while let Some(i) = rest.find("crate::") {
                let name: String =
                    rest[i + 7..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                out.insert(root_reexport(&name).to_string());
                rest = &rest[i + 7..];
            }
        }
        out
    }

    /// Every `.rs` file under `dir`, subfolders included, with the top-level module it belongs to
    /// (`attn/kvcache.rs` belongs to `attn`).
    fn sources(dir: &std::path::Path) -> Vec<(String, std::path::PathBuf)> {
        let mut out = Vec::new();
        let mut stack = vec![(None::<String>, dir.to_path_buf())];
        while let Some((module, d)) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                let stem = p.file_stem().unwrap().to_string_lossy().to_string();
                if p.is_dir() {
                    stack.push((Some(module.clone().unwrap_or(stem)), p));
                } else if p.extension().is_some_and(|x| x == "rs") {
                    match &module {
                        Some(m) => out.push((m.clone(), p)),
                        None if stem != "lib" => out.push((stem, p)),
                        None => {}
                    }
                }
            }
        }
        out
    }

    fn graph() -> BTreeMap<String, BTreeSet<String>> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (module, path) in sources(&dir) {
            let deps = imports(&std::fs::read_to_string(&path).unwrap());
            g.entry(module.clone()).or_default().extend(deps.into_iter().filter(|d| *d != module));
        }
        g
    }

    /// `--name` words (a command-line flag) in the string literals of `src`'s code lines (comments
    /// and doc comments skipped): `(line, flag)`.
    pub(crate) fn flags_in_strings(src: &str) -> Vec<(usize, String)> {
        let mut out = Vec::new();
        for (i, line) in src.lines().enumerate() {
            let t = line.trim_start();
            if t.starts_with("//") {
                continue;
            }
            // The string literals of the line (a literal continued from the line before counts
            // from the line's start when the line has an odd number of quotes before any code).
            let mut in_str = false;
            let mut lit = String::new();
            let mut prev = ' ';
            for c in line.chars() {
                if c == '"' && prev != '\\' {
                    if in_str {
                        out.extend(flags(&lit).into_iter().map(|f| (i + 1, f)));
                        lit.clear();
                    }
                    in_str = !in_str;
                } else if in_str {
                    lit.push(c);
                }
                prev = c;
            }
        }
        out
    }

    fn flags(s: &str) -> Vec<String> {
        let b = s.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i + 2 < b.len() {
            let starts =
                b[i] == b'-' && b[i + 1] == b'-' && (i == 0 || !b[i - 1].is_ascii_alphanumeric() && b[i - 1] != b'-');
            if starts && b[i + 2].is_ascii_lowercase() {
                let end = (i + 2..b.len())
                    .find(|&j| !(b[j].is_ascii_lowercase() || b[j].is_ascii_digit() || b[j] == b'-'))
                    .unwrap_or(b.len());
                out.push(s[i..end].to_string());
                i = end;
            } else {
                i += 1;
            }
        }
        out
    }

    /// The library speaks of its own API: no command-line flag (`--layout`, `--ptx`) in the string
    /// literals of its code (messages, errors), tests (`mod tests` onwards) excepted. The command
    /// adds the flag to the messages it prints (`memattn_cli::Error`).
    pub fn no_command_line_flag_in_messages() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut found = Vec::new();
        for (_, path) in sources(&dir) {
            let src = std::fs::read_to_string(&path).unwrap();
            let code = src.split("#[cfg(test)]").next().unwrap_or(&src);
            for (line, flag) in flags_in_strings(code) {
                found.push(format!("{}:{line}: {flag}", path.display()));
            }
        }
        assert!(found.is_empty(), "command-line flags in the library's messages:\n{}", found.join("\n"));
        // The checker sees a flag in a literal, not in a comment, a range or a negative number.
        assert_eq!(
            flags_in_strings("let e = format!(\"use --layout bshd\"); // --not-this"),
            vec![(1, "--layout".to_string())]
        );
        assert!(flags_in_strings("/// see --ptx\nlet x = \"a--b -1 --\";").is_empty());
    }

    pub fn every_subfolder_is_read() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let files = sources(&dir);
        for (module, file) in [("attn", "kvcache.rs"), ("device", "vm.rs"), ("device", "cuda.rs")] {
            assert!(
                files.iter().any(|(m, p)| m == module && p.file_name().unwrap() == file),
                "{module}/{file} not read: {files:?}"
            );
        }
    }

    pub fn module_layers_have_no_cycle() {
        let g = graph();
        for (m, deps) in &g {
            let lm = layer_of(m).unwrap_or_else(|| {
                panic!("module `{m}` is not in a layer: add it to LAYERS here and to the list in lib.rs's docs")
            });
            for d in deps {
                let ld = layer_of(d).unwrap_or_else(|| panic!("`{m}` imports unknown module `{d}`"));
                assert!(ld <= lm, "`{m}` (layer {}) imports `{d}` from a lower layer ({})", lm + 1, ld + 1);
            }
        }
        // Within a layer, imports must not form a cycle either.
        fn visit(m: &str, g: &BTreeMap<String, BTreeSet<String>>, path: &mut Vec<String>, done: &mut BTreeSet<String>) {
            if done.contains(m) {
                return;
            }
            if let Some(i) = path.iter().position(|p| p == m) {
                panic!("import cycle: {} -> {m}", path[i..].join(" -> "));
            }
            path.push(m.to_string());
            for d in g.get(m).into_iter().flatten() {
                visit(d, g, path, done);
            }
            path.pop();
            done.insert(m.to_string());
        }
        let mut done = BTreeSet::new();
        for m in g.keys() {
            visit(m, &g, &mut Vec::new(), &mut done);
        }
    }

    pub fn the_checker_sees_imports_and_cycles() {
        let deps = imports(
            "use crate::memory::X; // crate::report\n/// [`crate::verify`]\nlet a = crate::units::human_bytes(1);",
        );
        assert_eq!(deps.into_iter().collect::<Vec<_>>(), ["memory", "units"]);
    }
}
