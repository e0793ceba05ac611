//! The kernel build's artifacts (host only): the committed PTX module, what the build recorded
//! about it, and their schema. The host, xtask and the tests all read them from here — one
//! `include_str!` each, one SHA-256 helper, one record type per file.
//!
//! - [`PTX`]: `kernels-gpu/ptx/memattn_kernels.ptx`, written by `cargo xtask build-ptx`;
//! - [`BUILD_INFO_JSON`] ([`BuildInfo`]): toolchain, target and the PTX's SHA-256;
//! - [`PTXAS_REPORT_JSON`] ([`PtxasReport`]): registers, spills, shared memory and HMMA count per
//!   kernel and arch, written by `cargo xtask ptxas`.

use crate::variants::TileRecord;
#[cfg(feature = "artifacts-json")]
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The committed kernel module.
///
/// A `static`, not a `const`: a `const` is copied into every crate that reads it, and a 22 MB
/// text read from kernels-gpu and from memattn was linked into a program twice.
pub static PTX: &str = include_str!("../ptx/memattn_kernels.ptx");
/// The `sm_90a` module (`kernels-gpu/ptx/memattn_kernels_sm90.ptx`): the Hopper rows of the
/// variant table.
pub static PTX_SM90: &str = include_str!("../ptx/memattn_kernels_sm90.ptx");
/// What `cargo xtask build-ptx` recorded about [`PTX_SM90`].
pub static BUILD_INFO_SM90_JSON: &str = include_str!("../ptx/build-info-sm90.json");
/// What `cargo xtask ptxas` recorded about [`PTX_SM90`] (sm_90a).
pub static PTXAS_REPORT_SM90_JSON: &str = include_str!("../ptx/ptxas-report-sm90.json");
/// The timeline module (`kernels-gpu/ptx/memattn_kernels_timeline.ptx`, `cargo xtask build-ptx
/// --timeline`): the rows of [`crate::timeline::TIMELINE_KERNELS`] with their phase stamps.
pub static PTX_TIMELINE: &str = include_str!("../ptx/memattn_kernels_timeline.ptx");
/// What `cargo xtask build-ptx --timeline` recorded about [`PTX_TIMELINE`].
pub static BUILD_INFO_TIMELINE_JSON: &str = include_str!("../ptx/build-info-timeline.json");
/// The sm_90a timeline module (`kernels-gpu/ptx/memattn_kernels_timeline_sm90.ptx`): the Hopper
/// rows of [`crate::timeline::TIMELINE_KERNELS`] with their stamps, and the tensor-map store.
pub static PTX_TIMELINE_SM90: &str = include_str!("../ptx/memattn_kernels_timeline_sm90.ptx");
/// What `cargo xtask build-ptx --timeline` recorded about [`PTX_TIMELINE_SM90`].
pub static BUILD_INFO_TIMELINE_SM90_JSON: &str = include_str!("../ptx/build-info-timeline-sm90.json");
/// What `cargo xtask build-ptx` recorded about [`PTX`].
pub static BUILD_INFO_JSON: &str = include_str!("../ptx/build-info.json");
/// What `cargo xtask ptxas` recorded about [`PTX`].
pub static PTXAS_REPORT_JSON: &str = include_str!("../ptx/ptxas-report.json");

/// Lower-case hex SHA-256 of `data`.
pub fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

/// The SHA-256 (hex) of [`PTX`] as the committed `build-info.json` records it: read from that
/// small file instead of hashing the 7 MB text on every process start (a test and
/// `cargo xtask build-ptx --check` keep the two in agreement).
pub fn ptx_sha256() -> String {
    recorded_sha256(BUILD_INFO_JSON).unwrap_or_else(|| sha256_hex(PTX.as_bytes()))
}

/// [`ptx_sha256`] for [`PTX_SM90`] (`build-info-sm90.json`).
pub fn ptx_sm90_sha256() -> String {
    recorded_sha256(BUILD_INFO_SM90_JSON).unwrap_or_else(|| sha256_hex(PTX_SM90.as_bytes()))
}

/// [`ptx_sha256`] for [`PTX_TIMELINE`] (`build-info-timeline.json`).
pub fn ptx_timeline_sha256() -> String {
    recorded_sha256(BUILD_INFO_TIMELINE_JSON).unwrap_or_else(|| sha256_hex(PTX_TIMELINE.as_bytes()))
}

/// [`ptx_sha256`] for [`PTX_TIMELINE_SM90`] (`build-info-timeline-sm90.json`).
pub fn ptx_timeline_sm90_sha256() -> String {
    recorded_sha256(BUILD_INFO_TIMELINE_SM90_JSON).unwrap_or_else(|| sha256_hex(PTX_TIMELINE_SM90.as_bytes()))
}

/// The `ptx_sha256` value of a build-info file: 64 hex digits, or `None`.
fn recorded_sha256(json: &str) -> Option<String> {
    const KEY: &str = "\"ptx_sha256\": \"";
    let at = json.find(KEY)? + KEY.len();
    let hex = json.get(at..at + 64)?;
    hex.bytes().all(|b| b.is_ascii_hexdigit()).then(|| hex.to_string())
}

#[cfg(feature = "artifacts-json")]
/// `build-info.json`: how the PTX was built.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildInfo {
    pub toolchain: String,
    pub rustc: String,
    pub target: String,
    pub cpu: String,
    pub ptx_sha256: String,
}

#[cfg(feature = "artifacts-json")]
impl BuildInfo {
    /// The record of the committed PTX.
    pub fn embedded() -> Result<BuildInfo, String> {
        serde_json::from_str(BUILD_INFO_JSON).map_err(|e| format!("build-info.json: {e}"))
    }
    /// The file's text, as xtask writes it.
    pub fn to_json(&self) -> String {
        format!(
            "{{\n  \"toolchain\": \"{}\",\n  \"rustc\": \"{}\",\n  \"target\": \"{}\",\n  \"cpu\": \"{}\",\n  \
             \"ptx_sha256\": \"{}\"\n}}\n",
            self.toolchain, self.rustc, self.target, self.cpu, self.ptx_sha256
        )
    }
}

#[cfg(feature = "artifacts-json")]
/// `ptxas-report.json`: resources ptxas assigned to each kernel per arch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtxasReport {
    pub ptxas_version: String,
    pub ptx_sha256: String,
    pub kernels: Vec<PtxasKernel>,
}

#[cfg(feature = "artifacts-json")]
/// Resources of one kernel at one arch, as `ptxas -v` reports them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
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

#[cfg(feature = "artifacts-json")]
impl PtxasReport {
    /// The report of the committed PTX.
    pub fn embedded() -> Result<PtxasReport, String> {
        serde_json::from_str(PTXAS_REPORT_JSON).map_err(|e| format!("ptxas-report.json: {e}"))
    }
    /// The file's text, as xtask writes it (one kernel per line, so diffs stay readable).
    pub fn to_json(&self) -> String {
        let mut s = format!(
            "{{\n  \"ptxas_version\": \"{}\",\n  \"ptx_sha256\": \"{}\",\n  \"kernels\": [\n",
            self.ptxas_version, self.ptx_sha256
        );
        for (i, r) in self.kernels.iter().enumerate() {
            s += "    ";
            s += &serde_json::to_string(r).expect("plain record").replace("\":", "\": ").replace(",\"", ", \"");
            s += if i + 1 < self.kernels.len() { ",\n" } else { "\n" };
        }
        s + "  ]\n}\n"
    }
}

/// The tile records a PTX module exports (`memattn_tile_<entry>` globals, see [`TileRecord`]),
/// by entry name, read from the text. Malformed records are skipped (a module without records
/// simply has none).
pub fn tile_records(ptx: &str) -> Vec<(String, TileRecord)> {
    let mut out = Vec::new();
    // The lines that name a record, found by one search of the text for the prefix (a module is
    // megabytes of instructions and a few dozen records), each line once, in order.
    let mut next_line = 0;
    for at in memchr::memmem::find_iter(ptx.as_bytes(), TileRecord::SYMBOL_PREFIX) {
        if at < next_line {
            continue;
        }
        let start = ptx[..at].rfind('\n').map_or(0, |i| i + 1);
        let end = ptx[at..].find('\n').map_or(ptx.len(), |i| at + i);
        next_line = end;
        let line = ptx[start..end].strip_suffix('\r').unwrap_or(&ptx[start..end]);
        let t = line.trim();
        if !t.contains(".global") {
            continue;
        }
        let Some(pos) = t.find(TileRecord::SYMBOL_PREFIX) else { continue };
        let rest = &t[pos + TileRecord::SYMBOL_PREFIX.len()..];
        let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let Some(init) = rest.split_once('{').and_then(|(_, r)| r.split_once('}')).map(|(i, _)| i) else {
            continue;
        };
        let Ok(mut vals) = init.split(',').map(|v| v.trim().parse::<u64>()).collect::<Result<Vec<u64>, _>>() else {
            continue;
        };
        // Trailing zeros may be left out of an initialiser (the rest of the array is zero).
        let words: Option<Vec<u32>> = if rest.contains("[20]") && t.contains(".b8") && vals.len() <= 20 {
            // `.b8 name[20] = {b0, b1, ...}`: little-endian bytes.
            vals.resize(20, 0);
            vals.chunks(4)
                .map(|c| c.iter().rev().try_fold(0u32, |a, &b| u8::try_from(b).ok().map(|b| (a << 8) | b as u32)))
                .collect()
        } else if rest.contains("[5]") && vals.len() <= 5 {
            // `.u32 name[5] = {w0, ...}`.
            vals.resize(5, 0);
            vals.iter().map(|&v| u32::try_from(v).ok()).collect()
        } else {
            None
        };
        if let Some(w) = words {
            out.push((name, TileRecord::from_array([w[0], w[1], w[2], w[3], w[4]])));
        }
    }
    out
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;
    use crate::variants::KernelId;
    #[cfg(feature = "artifacts-json")]
    use crate::variants::VARIANTS;

    pub fn the_recorded_digests_are_the_texts_digests() {
        assert_eq!(ptx_sha256(), sha256_hex(PTX.as_bytes()), "build-info.json records another PTX's digest");
        assert_eq!(ptx_sm90_sha256(), sha256_hex(PTX_SM90.as_bytes()), "build-info-sm90.json records another digest");
        assert_eq!(recorded_sha256("{\"ptx_sha256\": \"12ab\"}"), None, "too short");
        assert_eq!(recorded_sha256("{}"), None);
    }

    #[cfg(feature = "artifacts-json")]
    pub fn build_info_describes_the_committed_ptx() {
        let bi = BuildInfo::embedded().unwrap();
        assert_eq!(bi.ptx_sha256, sha256_hex(PTX.as_bytes()), "build-info.json describes a different PTX");
        assert_eq!(bi.to_json(), BUILD_INFO_JSON, "the writer and the committed file agree");
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    #[cfg(feature = "artifacts-json")]
    pub fn ptxas_report_round_trips_and_covers_every_kernel() {
        let r = PtxasReport::embedded().unwrap();
        assert_eq!(r.to_json(), PTXAS_REPORT_JSON, "the writer and the committed file agree");
        assert_eq!(r.ptx_sha256, sha256_hex(PTX.as_bytes()));
        for v in VARIANTS.iter().filter(|v| v.module() == crate::variants::PtxModule::Sm80) {
            let rows: Vec<_> = r.kernels.iter().filter(|k| k.name == v.name).collect();
            assert_eq!(rows.len(), 2, "{} at sm_80 and sm_90", v.name);
            for k in rows {
                assert_eq!(k.dynamic_smem_bytes, v.dynamic_smem_bytes(), "{}", v.name);
                assert_eq!(k.hmma.unwrap_or(0) > 0, v.tensor_cores(), "{} HMMA", v.name);
            }
            // A row built for N blocks per SM has its launch bounds in the PTX, and ptxas's sm_90
            // registers (rounded up to 8 per thread, as a warp's are allocated) fit N blocks in
            // the 64 Ki registers of an SM.
            let blocks = v.min_blocks_per_sm();
            let entry = PTX.find(&format!(".visible .entry {}(", v.name)).expect("the entry");
            let body = &PTX[entry..entry + PTX[entry..].find('{').unwrap()];
            assert_eq!(body.contains(".maxntid"), blocks > 0, "{}: launch bound", v.name);
            if blocks > 0 {
                assert!(body.contains(&format!(".maxntid {}, 1, 1", v.threads())), "{}", v.name);
                assert!(body.contains(&format!(".minnctapersm {blocks}")), "{}", v.name);
                let k = r.kernels.iter().find(|k| k.name == v.name && k.arch == "sm_90").unwrap();
                let per_block = k.registers.next_multiple_of(8) * v.threads();
                assert!(
                    blocks * per_block <= 65536,
                    "{}: {} registers at sm_90 fit {} blocks of {} threads per SM, not {blocks}",
                    v.name,
                    k.registers,
                    65536 / per_block,
                    v.threads()
                );
            }
        }
    }

    #[cfg(feature = "artifacts-json")]
    pub fn the_sm90_module_records_cover_its_rows() {
        let bi: BuildInfo = serde_json::from_str(BUILD_INFO_SM90_JSON).unwrap();
        assert_eq!(bi.ptx_sha256, sha256_hex(PTX_SM90.as_bytes()), "build-info-sm90.json describes a different PTX");
        assert_eq!(bi.cpu, "sm_90a");
        let r: PtxasReport = serde_json::from_str(PTXAS_REPORT_SM90_JSON).unwrap();
        assert_eq!(r.to_json(), PTXAS_REPORT_SM90_JSON, "the writer and the committed file agree");
        assert_eq!(r.ptx_sha256, sha256_hex(PTX_SM90.as_bytes()));
        for v in VARIANTS.iter().filter(|v| v.module() == crate::variants::PtxModule::Sm90a) {
            let rows: Vec<_> = r.kernels.iter().filter(|k| k.name == v.name).collect();
            assert_eq!(rows.len(), 1, "{} at sm_90a", v.name);
            assert_eq!(rows[0].arch, "sm_90a");
            assert_eq!(rows[0].dynamic_smem_bytes, v.dynamic_smem_bytes(), "{}", v.name);
            // Every sm_90a row but the tensor-map store (48 stores) is written for tensor cores.
            assert_eq!(rows[0].hmma.unwrap_or(0) > 0, v.tensor_cores(), "{} HGMMA", v.name);
            assert_eq!(rows[0].spill_store_bytes + rows[0].spill_load_bytes + rows[0].stack_bytes, 0, "{}", v.name);
        }
    }

    /// The timeline module: its recorded digest, exactly the rows of
    /// [`crate::timeline::TIMELINE_KERNELS`] with their tile records, the buffer's variable and
    /// the clock reads.
    pub fn the_timeline_module_has_the_timeline_rows() {
        use crate::variants::PtxModule;
        assert_eq!(ptx_timeline_sha256(), sha256_hex(PTX_TIMELINE.as_bytes()), "build-info-timeline.json");
        assert_eq!(
            ptx_timeline_sm90_sha256(),
            sha256_hex(PTX_TIMELINE_SM90.as_bytes()),
            "build-info-timeline-sm90.json"
        );
        assert!(BUILD_INFO_TIMELINE_JSON.contains("\"cpu\": \"sm_80\""));
        assert!(BUILD_INFO_TIMELINE_SM90_JSON.contains("\"cpu\": \"sm_90a\""));
        let modules = [
            (PTX_TIMELINE, PtxModule::Sm80, None),
            (PTX_TIMELINE_SM90, PtxModule::Sm90a, Some(KernelId::TensorMapsStore)),
        ];
        for (text, module, extra) in modules {
            let recs = tile_records(text);
            let rows: Vec<KernelId> = crate::timeline::TIMELINE_KERNELS
                .into_iter()
                .filter(|k| k.variant().module() == module)
                .chain(extra)
                .collect();
            assert_eq!(recs.len(), rows.len(), "{module:?}");
            for k in &rows {
                let found: Vec<_> = recs.iter().filter(|(n, _)| n == k.name()).collect();
                assert_eq!(found.len(), 1, "{}", k.name());
                assert_eq!(found[0].1, k.variant().tile_record(), "{}", k.name());
            }
            let entries = text.lines().filter(|l| l.starts_with(".visible .entry ")).count();
            assert_eq!(entries, rows.len(), "{module:?}");
            let var = format!(".visible .global .align 8 .b8 {}[8];", crate::timeline::GLOBAL_NAME);
            assert!(text.contains(&var), "{var}");
            assert!(text.contains("%globaltimer"));
        }
        for text in [PTX, PTX_SM90] {
            assert!(!text.contains(crate::timeline::GLOBAL_NAME) && !text.contains("%globaltimer"), "no stamps");
        }
    }

    pub fn the_committed_ptx_exports_the_tables_tile_records() {
        use crate::variants::PtxModule;
        for (text, module) in [(PTX, PtxModule::Sm80), (PTX_SM90, PtxModule::Sm90a)] {
            let recs = tile_records(text);
            let rows: Vec<KernelId> = KernelId::ALL.into_iter().filter(|k| k.variant().module() == module).collect();
            for k in &rows {
                let found: Vec<_> = recs.iter().filter(|(n, _)| n == k.name()).collect();
                assert_eq!(found.len(), 1, "`{}{}` in the {module:?} PTX", TileRecord::SYMBOL_PREFIX, k.name());
                assert_eq!(found[0].1, k.variant().tile_record(), "{}", k.name());
            }
            assert_eq!(recs.len(), rows.len(), "{module:?}");
        }
    }

    pub fn tile_records_parse_bytes_and_words() {
        let b = ".visible .global .align 4 .b8 memattn_tile_k1[20] = {128, 0, 0, 0, 64, 0, 0, 0, 128, 0, 0, 0, \
                 0, 160, 0, 0, 64, 0, 0, 0};";
        let w = ".global .align 4 .u32 memattn_tile_k2[5] = {32};";
        let r = tile_records(&format!("{b}\n{w}\n.global .b8 other[3] = {{1, 2, 3}};\n"));
        assert_eq!(r.len(), 2);
        assert_eq!(r[0], ("k1".into(), TileRecord::from_array([128, 64, 128, 40960, 64])));
        assert_eq!(r[1], ("k2".into(), TileRecord::from_array([32, 0, 0, 0, 0])));
    }
}
