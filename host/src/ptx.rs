//! The PTX module the host launches: embedded at build time (or read from `--ptx FILE`), with
//! what the build recorded about it (`build-info.json`, `ptxas-report.json`) when those exist.

use serde::{Deserialize, Serialize};

/// What `cargo xtask build-ptx` recorded about the committed PTX.
const BUILD_INFO_JSON: &str = include_str!("../../kernels-gpu/ptx/build-info.json");
/// What `cargo xtask ptxas` recorded about the committed PTX.
const PTXAS_REPORT_JSON: &str = include_str!("../../kernels-gpu/ptx/ptxas-report.json");

/// The committed kernel module, `kernels-gpu/ptx/memattn_kernels.ptx`.
pub const EMBEDDED_PTX: &str = include_str!("../../kernels-gpu/ptx/memattn_kernels.ptx");

/// `kernels-gpu/ptx/build-info.json`: how the embedded PTX was built.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildInfo {
    pub rustc: String,
    pub toolchain: String,
    pub target: String,
    pub cpu: String,
    pub ptx_sha256: String,
}

/// `kernels-gpu/ptx/ptxas-report.json`: resources ptxas assigned to each kernel per arch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtxasReport {
    pub ptxas_version: String,
    pub ptx_sha256: String,
    pub kernels: Vec<PtxasKernel>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtxasKernel {
    pub name: String,
    pub arch: String,
    pub registers: u32,
    pub spill_store_bytes: u32,
    pub spill_load_bytes: u32,
    pub stack_bytes: u32,
    pub static_smem_bytes: u32,
    pub dynamic_smem_bytes: u32,
    pub barriers: u32,
    /// HMMA (tensor-core) instructions in the SASS (`nvdisasm`); absent in older reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hmma: Option<u32>,
}

/// One `.param` of an entry, as declared.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PtxParam {
    pub name: String,
    /// e.g. `.align 8 .b8 [176]`, `.u64`, `.f32`.
    pub decl: String,
}

/// One `.entry` found in the PTX text.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PtxEntry {
    pub name: String,
    pub line: usize,
    pub params: Vec<PtxParam>,
}

/// A PTX module's text and what can be read from it without a driver.
#[derive(Clone, Debug)]
pub struct PtxSource {
    pub text: String,
    /// "embedded" or the file path.
    pub origin: String,
    pub sha256: String,
}

impl PtxSource {
    pub fn embedded() -> PtxSource {
        PtxSource {
            text: EMBEDDED_PTX.to_string(),
            origin: "embedded".into(),
            sha256: crate::sha256::sha256_hex(EMBEDDED_PTX.as_bytes()),
        }
    }

    pub fn from_file(path: &std::path::Path, text: String) -> PtxSource {
        let sha256 = crate::sha256::sha256_hex(text.as_bytes());
        PtxSource { text, origin: path.display().to_string(), sha256 }
    }

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
        }
        (version, target)
    }

    /// The `.entry` points and their parameters (a light scan of the text, no full parse).
    pub fn entries(&self) -> Vec<PtxEntry> {
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

/// The build info of the embedded PTX.
pub fn build_info() -> Result<Option<BuildInfo>, String> {
    serde_json::from_str(BUILD_INFO_JSON).map(Some).map_err(|e| format!("build-info.json: {e}"))
}

/// The ptxas report of the embedded PTX.
pub fn ptxas_report() -> Result<Option<PtxasReport>, String> {
    serde_json::from_str(PTXAS_REPORT_JSON).map(Some).map_err(|e| format!("ptxas-report.json: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_entries_are_the_abi_kernels() {
        let src = PtxSource::embedded();
        let names: Vec<String> = src.entries().into_iter().map(|e| e.name).collect();
        // Every kernel the host can launch.
        for k in kernels_gpu::abi::KernelId::ALL {
            assert!(names.iter().any(|n| n == k.name()), "{} missing from {names:?}", k.name());
        }
        let flash = src.entries().into_iter().find(|e| e.name == "flash_fwd_f32_d64").unwrap();
        assert_eq!(flash.params.len(), 1);
        assert!(flash.params[0].decl.contains("[176]"), "{:?}", flash.params[0]);
        let saxpy = src.entries().into_iter().find(|e| e.name == "saxpy_f32").unwrap();
        assert_eq!(saxpy.params.len(), 4);
        let (v, t) = src.version_and_target();
        assert!(v.is_some() && t.as_deref().unwrap_or("").starts_with("sm_"));
    }

    #[test]
    fn embedded_metadata_parses_and_matches_when_present() {
        let src = PtxSource::embedded();
        if let Some(bi) = build_info().unwrap() {
            assert_eq!(bi.target, "nvptx64-nvidia-cuda");
            assert_eq!(bi.ptx_sha256, src.sha256, "build-info.json describes a different PTX");
        }
        if let Some(r) = ptxas_report().unwrap() {
            assert!(!r.kernels.is_empty());
        }
    }
}
