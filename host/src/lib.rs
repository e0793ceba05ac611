//! `memattn`: run memattn's attention kernels on a GPU (CUDA driver) or in the PTX VM, check every
//! result against an f64 CPU reference, and measure time and device memory.
//!
//! **As a library for your own program**, see [`attn`]: views of your cudarc slices (or VM
//! buffers), [`attn::Kernels::flash_attn`] / [`attn::Kernels::flash_attn_into`] on your stream,
//! typed errors before launch, and the semantics table (layouts, bottom-right causal mask, LSE in
//! natural log). [`reference::attention`] is the f64 reference for your tests.
//!
//! The modules form layers; each imports only from layers above it in this list (a unit test,
//! `module_layers_have_no_cycle`, reads the sources and fails on an import against the order):
//! 1. leaves: [`units`] (byte sizes), [`parse`] (option-value errors), [`caps`] (device limits),
//!    [`panics`] (calling code that may panic), [`driver`] (which CUDA driver library), [`files`] (bounded
//!    reads and atomic writes), [`rng`], [`sha256`], [`timing`], [`plot`];
//! 2. [`dtype`] and [`problem`]: the attention problem (shape, dtype, causal, scale, layout), the
//!    kernels it launches (a lookup in the variant table) and its launch-limit validation;
//! 3. [`inputs`], [`memory`] (the analytic bytes of a run and the free-memory check),
//!    [`safetensors_io`];
//! 4. [`mod@reference`] (the f64 reference), then [`verify`] (error metrics and bounds);
//! 5. [`ptx`] (the module and what is known about it), [`nvml`], then [`device`] (the
//!    [`device::Device`] trait and its two backends, `vm` and `cuda`);
//! 6. [`error`], then [`runner`]: one measured run — validate, plan memory, upload, poison,
//!    launch, time, download, verify; [`decode`]: the KV-cache decode (split plan, cache
//!    append, split-KV attention, `merge_states`), its f64 reference and one verified run;
//! 7. [`report`] (tables and summaries), [`plan`] (the memory budget of an inference workload),
//!    [`evidence`] (the `--save` file), [`attn`] (the attention API for programs that own their
//!    device buffers and streams: views, options, [`attn::Kernels`]);
//! 8. [`charts`] (the sweep and plan pictures); the CLI (in the binary) sits on top.

pub mod attn;
pub mod caps;
pub mod charts;
pub mod decode;
pub mod device;
pub mod driver;
pub mod dtype;
pub mod error;
pub mod evidence;
pub mod files;
pub mod inputs;
pub mod memory;
pub mod nvml;
pub mod panics;
pub mod parse;
pub mod plan;
pub mod plot;
pub mod problem;
pub mod ptx;
pub mod reference;
pub mod report;
pub mod rng;
pub mod runner;
pub mod safetensors_io;
pub mod sha256;
pub mod timing;
pub mod units;
pub mod verify;

pub use device::{Backend, BackendChoice, Device};
pub use dtype::Dtype;
pub use error::Error;
pub use problem::{KernelKind, Layout, Problem};

#[cfg(test)]
mod layering_tests {
    //! The module layers of the crate docs, checked against the sources.

    use std::collections::{BTreeMap, BTreeSet};

    /// The layers, top (imports nothing from the crate) to bottom.
    const LAYERS: &[&[&str]] = &[
        &["units", "parse", "caps", "panics", "driver", "files", "rng", "sha256", "timing", "plot"],
        &["dtype", "problem"],
        &["inputs", "memory", "safetensors_io"],
        &["reference", "verify"],
        &["ptx", "nvml", "device"],
        &["error", "runner", "decode"],
        &["report", "evidence", "plan", "attn"],
        &["charts"],
    ];

    fn layer_of(m: &str) -> Option<usize> {
        LAYERS.iter().position(|l| l.contains(&m))
    }

    /// The module behind a name re-exported at the crate root (see the `pub use`s above).
    fn root_reexport(name: &str) -> &str {
        match name {
            "Dtype" => "dtype",
            "Error" => "error",
            "Backend" | "BackendChoice" | "Device" => "device",
            "KernelKind" | "Layout" | "Problem" => "problem",
            other => other,
        }
    }

    /// `crate::name` references in code (comment lines and doc comments are skipped).
    fn imports(src: &str) -> BTreeSet<String> {
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

    fn graph() -> BTreeMap<String, BTreeSet<String>> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut files = Vec::new();
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() && p.file_name().unwrap() == "device" {
                for f in std::fs::read_dir(&p).unwrap() {
                    files.push(("device".to_string(), f.unwrap().path()));
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                let stem = p.file_stem().unwrap().to_string_lossy().to_string();
                if stem != "lib" && stem != "main" {
                    files.push((stem, p));
                }
            }
        }
        for (module, path) in files {
            let deps = imports(&std::fs::read_to_string(&path).unwrap());
            g.entry(module.clone()).or_default().extend(deps.into_iter().filter(|d| *d != module));
        }
        g
    }

    #[test]
    fn module_layers_have_no_cycle() {
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

    #[test]
    fn the_checker_sees_imports_and_cycles() {
        let deps = imports(
            "use crate::memory::X; // crate::report\n/// [`crate::verify`]\nlet a = crate::units::human_bytes(1);",
        );
        assert_eq!(deps.into_iter().collect::<Vec<_>>(), ["memory", "units"]);
    }
}
