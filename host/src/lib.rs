//! `memattn-cli`: the `memattn` command's side of memattn, on top of the [`memattn`] library: one
//! measured run (validate, plan memory, upload, poison, launch, time, download, verify), reports,
//! the `--save` evidence file, the inference memory planner, charts, NVML and safetensors I/O.
//!
//! Every kernel launch goes through the library's device layer ([`memattn::device`]): the VM's
//! [`memattn::device::vm::VmDevice`], or on CUDA [`memattn::device::cuda::CudaModule::launch`],
//! the one `cuLaunchKernel` of the workspace, which [`memattn::attn::Kernels`] uses too. The
//! kernel parameters come from the library's builders (`Problem::attn_params`,
//! [`memattn::decode::decode_params`]).
//!
//! The library's modules are re-exported here under their own names, so `memattn_cli::dtype` is
//! `memattn::dtype`; [`device`] adds the CLI's CUDA device ([`device::cuda::CudaDevice`]) and
//! [`device::open`], [`decode`] the measured decode run, [`ptx`] the build's JSON records.
//!
//! The modules form layers; each imports only from layers above it in this list (a unit test,
//! `module_layers_have_no_cycle`, reads the sources and fails on an import against the order):
//! 1. leaves: [`files`] (bounded reads and atomic writes), [`timing`], [`nvml`];
//! 2. [`safetensors_io`], [`cuda_device`], [`backward_sample`] (which part of a backward run is
//!    checked);
//! 3. [`error`], then [`harness`]: the measured run every command shares (repetitions, poison,
//!    memory bracket, timing), configured by [`runner`]: one measured run, [`backward_run`]: one
//!    measured forward and backward, and [`decode_run`]: one measured decode run;
//! 4. [`report`] (tables and summaries), [`plan`] (the memory budget of an inference workload),
//!    [`evidence`] (the `--save` file);
//! 5. [`charts`] (the sweep, plan and timeline pictures);
//! 6. [`timeline`] (`run --timeline`: the stamps' device, the trace and its picture); the
//!    subcommands (in the binary) sit on top.

pub use memattn::{
    attn, caps, choice, driver, dtype, inputs, memory, panics, parse, problem, reference, rng, units, verify,
};
pub use memattn::{Backend, BackendChoice, Device, Dtype, KernelKind, Layout, Problem};

pub mod backward_run;
pub mod backward_sample;
pub mod charts;
pub mod cuda_device;
pub mod decode_run;
pub mod error;
pub mod evidence;
pub mod files;
pub mod harness;
pub mod nvml;
pub mod plan;
pub mod report;
pub mod runner;
pub mod safetensors_io;
pub mod timeline;
pub mod timing;

pub use error::Error;

/// The library's device layer plus the CLI's CUDA device and the backend choice.
pub mod device {
    pub use crate::cuda_device::{open, Opened};
    pub use memattn::device::*;
    /// The library's CUDA driver side plus the CLI's measuring [`crate::cuda_device::CudaDevice`].
    pub mod cuda {
        pub use crate::cuda_device::CudaDevice;
        pub use memattn::device::cuda::*;
    }
}

/// The library's KV-cache decode plan and reference plus the measured run ([`crate::decode_run`]).
pub mod decode {
    pub use crate::decode_run::*;
    pub use memattn::decode::*;
}

/// The library's PTX module plus the kernel build's JSON records.
pub mod ptx {
    pub use kernels_gpu::artifacts::{BuildInfo, PtxasKernel, PtxasReport};
    pub use memattn::ptx::*;

    /// The build info of the embedded PTX.
    pub fn build_info() -> Result<Option<BuildInfo>, String> {
        BuildInfo::embedded().map(Some)
    }

    /// The ptxas report of the embedded PTX.
    pub fn ptxas_report() -> Result<Option<PtxasReport>, String> {
        PtxasReport::embedded().map(Some)
    }
}

/// The unit tests, for `memattn-tests` to run (its test `unit`); not an API.
#[cfg(feature = "unit-tests")]
#[doc(hidden)]
pub mod unit_tests {
    pub use crate::backward_run::tests as backward_run;
    pub use crate::backward_sample::tests as backward_sample;
    pub use crate::charts::tests as charts;
    pub use crate::evidence::tests as evidence;
    pub use crate::files::tests as files;
    pub use crate::harness::tests as harness;
    pub use crate::layering_tests;
    pub use crate::plan::tests as plan;
    pub use crate::report::tests as report;
    pub use crate::safetensors_io::tests as safetensors_io;
    pub use crate::timeline::tests as timeline;
    pub use crate::timing::tests as timing;
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod layering_tests {
    //! The module layers of the crate docs, checked against the sources.

    use std::collections::{BTreeMap, BTreeSet};

    /// The library's modules (re-exported) and the façades above: they import nothing from
    /// this crate's modules.
    const LIBRARY: &[&str] = &[
        "attn",
        "caps",
        "driver",
        "dtype",
        "inputs",
        "memory",
        "panics",
        "parse",
        "problem",
        "reference",
        "rng",
        "units",
        "verify",
        "device",
        "decode",
        "ptx",
    ];

    /// The layers, top (imports nothing from the crate) to bottom.
    const LAYERS: &[&[&str]] = &[
        &["files", "timing", "nvml"],
        &["safetensors_io", "cuda_device", "backward_sample"],
        &["error", "harness", "runner", "backward_run", "decode_run"],
        &["report", "evidence", "plan"],
        &["charts"],
        &["timeline"],
    ];

    fn layer_of(m: &str) -> Option<usize> {
        if LIBRARY.contains(&m) {
            return Some(0);
        }
        LAYERS.iter().position(|l| l.contains(&m)).map(|l| l + 1)
    }

    fn root_reexport(name: &str) -> &str {
        match name {
            "Dtype" | "Backend" | "BackendChoice" | "Device" | "KernelKind" | "Layout" | "Problem" => "dtype",
            "Error" => "error",
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
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            // `cli/` is the binary's (it imports the crate as `memattn_cli`); lib.rs holds the façades.
            if p.extension().is_some_and(|x| x == "rs") {
                let stem = p.file_stem().unwrap().to_string_lossy().to_string();
                if stem != "lib" && stem != "main" {
                    let deps = imports(&std::fs::read_to_string(&p).unwrap());
                    g.entry(stem.clone()).or_default().extend(deps.into_iter().filter(|d| *d != stem));
                }
            }
        }
        g
    }

    pub fn module_layers_have_no_cycle() {
        let g = graph();
        for (m, deps) in &g {
            let lm = layer_of(m).unwrap_or_else(|| {
                panic!("module `{m}` is not in a layer: add it to LAYERS here and to the list in lib.rs's docs")
            });
            for d in deps {
                let ld = layer_of(d).unwrap_or_else(|| panic!("`{m}` imports unknown module `{d}`"));
                assert!(ld <= lm, "`{m}` (layer {lm}) imports `{d}` from a lower layer ({ld})");
            }
        }
    }
}
