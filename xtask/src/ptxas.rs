//! `cargo xtask ptxas [--check]`: assemble the committed PTX modules and keep their resource
//! reports: `memattn_kernels.ptx` for sm_80 and sm_90 (`ptxas-report.json`),
//! `memattn_kernels_sm90.ptx` for sm_90a (`ptxas-report-sm90.json`).

use crate::paths;
use kernels_gpu::artifacts::{sha256_hex, PtxasKernel, PtxasReport};
use kernels_gpu::variants::PtxModule;
use kernels_gpu::KernelId;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The pinned wheel that carries ptxas (no CUDA installation needed).
const NVCC_WHEEL: &str = "nvidia-cuda-nvcc==13.5.37";
const WHEEL_PTXAS: &str = "nvidia/cu13/bin/ptxas";
pub const ARCHS: [&str; 2] = ["sm_80", "sm_90"];

/// The archs a module is assembled for.
pub fn archs(module: PtxModule) -> &'static [&'static str] {
    match module {
        PtxModule::Sm80 => &ARCHS,
        PtxModule::Sm90a => &["sm_90a"],
    }
}

/// Resources of one kernel at one arch (the report's record type, owned by kernels-gpu).
pub type Resources = PtxasKernel;

/// A CUDA tool shipped in a pinned PyPI wheel.
pub struct Tool {
    pub name: &'static str,
    pub wheel: &'static str,
    pub path_in_wheel: &'static str,
}

pub const PTXAS: Tool = Tool { name: "ptxas", wheel: NVCC_WHEEL, path_in_wheel: WHEEL_PTXAS };
/// nvdisasm turns a cubin into SASS, where the tensor-core instructions (HMMA) can be counted.
pub const NVDISASM: Tool =
    Tool { name: "nvdisasm", wheel: "nvidia-cuda-nvdisasm==13.5.37", path_in_wheel: "nvidia/cu13/bin/nvdisasm" };

/// A tool from `$CUDA_HOME/bin`, then `$PATH`, then its pinned wheel (downloaded once into
/// `target/ptxas-cache`).
pub fn find_tool(tool: &Tool) -> Result<PathBuf, String> {
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        let p = PathBuf::from(home).join("bin").join(tool.name);
        if p.is_file() {
            return Ok(p);
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join(tool.name);
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    let cached = paths::ptxas_cache().join(tool.path_in_wheel);
    if cached.is_file() {
        return Ok(cached);
    }
    println!(
        "xtask: {} not found in $CUDA_HOME or $PATH; fetching the PyPI wheel {} into {}",
        tool.name,
        tool.wheel,
        paths::rel(&paths::ptxas_cache())
    );
    let wheel_dir = paths::ptxas_cache().join("wheel");
    let st = Command::new("python3")
        .args(["-m", "pip", "download", "--quiet", "--no-deps", tool.wheel, "-d"])
        .arg(&wheel_dir)
        .status()
        .map_err(|e| {
            format!(
                "cannot run python3 -m pip to fetch {}: {e}. fix: install python3 with pip, or set CUDA_HOME",
                tool.name
            )
        })?;
    if !st.success() {
        return Err(format!(
            "`python3 -m pip download {}` failed; set CUDA_HOME to a CUDA toolkit instead",
            tool.wheel
        ));
    }
    let stem = tool.wheel.split("==").next().unwrap_or(tool.wheel).replace('-', "_");
    let script = "import glob, os, sys, zipfile\n\
         w = sorted(glob.glob(os.path.join(sys.argv[1], sys.argv[3] + '-*.whl')))[-1]\n\
         zipfile.ZipFile(w).extract(sys.argv[4], sys.argv[2])\n\
         os.chmod(os.path.join(sys.argv[2], sys.argv[4]), 0o755)\n";
    let st = Command::new("python3")
        .args(["-c", script])
        .arg(&wheel_dir)
        .arg(paths::ptxas_cache())
        .arg(&stem)
        .arg(tool.path_in_wheel)
        .status()
        .map_err(|e| e.to_string())?;
    if !st.success() || !cached.is_file() {
        return Err(format!("could not unpack {} from the wheel in {}", tool.name, wheel_dir.display()));
    }
    Ok(cached)
}

/// Number of HMMA and HGMMA (tensor-core matrix) instructions per kernel in a cubin's SASS.
pub fn hmma_counts(nvdisasm: &Path, cubin: &Path) -> Result<Vec<(String, u32)>, String> {
    let out = Command::new(nvdisasm).arg("-c").arg(cubin).output().map_err(|e| format!("cannot run nvdisasm: {e}"))?;
    if !out.status.success() {
        return Err(format!("nvdisasm failed on {}: {}", cubin.display(), String::from_utf8_lossy(&out.stderr)));
    }
    let mut counts: Vec<(String, u32)> = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if let Some(name) = line.trim().strip_prefix(".text.").and_then(|n| n.strip_suffix(':')) {
            counts.push((name.to_string(), 0));
        } else if line.contains(" HMMA.") || line.contains(" HGMMA.") {
            if let Some(last) = counts.last_mut() {
                last.1 += 1;
            }
        }
    }
    Ok(counts)
}

pub fn ptxas_version(ptxas: &Path) -> Result<String, String> {
    let out =
        Command::new(ptxas).arg("--version").output().map_err(|e| format!("cannot run {}: {e}", ptxas.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("unknown").trim().to_string())
}

fn number_before(text: &str, unit: &str) -> Option<u32> {
    let idx = text.find(unit)?;
    text[..idx].split_whitespace().last()?.parse().ok()
}

/// Parses `ptxas -v` output for one arch.
///
/// An entry's stack and spill line follows `Function properties for <entry>`; ptxas also prints
/// `Function properties for` the device functions it keeps (libcore's panic paths), after the
/// entry's own lines and before the next entry, so only the entry's own block is read.
pub fn parse(output: &str, arch: &str) -> Result<Vec<Resources>, String> {
    let mut all = Vec::new();
    let mut cur: Option<Resources> = None;
    let mut own_properties = false;
    for line in output.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            own_properties = cur.as_ref().is_some_and(|r| r.name == rest.trim());
            continue;
        }
        if line.contains("error") && !line.contains("0 error") {
            return Err(format!("ptxas ({arch}): {}", line.trim()));
        }
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            if let Some(r) = cur.take() {
                all.push(r);
            }
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            let dynamic_smem_bytes = KernelId::from_name(&name).map(|k| k.dynamic_smem_bytes()).unwrap_or(0);
            cur = Some(Resources { name, arch: arch.to_string(), dynamic_smem_bytes, ..Default::default() });
            own_properties = false;
        } else if let Some(r) = cur.as_mut() {
            if line.contains("bytes stack frame") {
                if !own_properties {
                    continue;
                }
                r.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
                r.spill_store_bytes = number_before(line, "bytes spill stores").unwrap_or(0);
                r.spill_load_bytes = number_before(line, "bytes spill loads").unwrap_or(0);
            } else if line.contains("Used") && line.contains("registers") {
                r.registers = number_before(line, "registers").unwrap_or(0);
                r.barriers = number_before(line, "barriers").unwrap_or(0);
                r.static_smem_bytes = number_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    all.extend(cur);
    Ok(all)
}

pub fn run(check: bool, only_sm90: bool) -> Result<(), String> {
    for m in PtxModule::ALL.into_iter().filter(|m| !only_sm90 || *m == PtxModule::Sm90a) {
        run_module(m, check)?;
    }
    Ok(())
}

fn run_module(module: PtxModule, check: bool) -> Result<(), String> {
    let ptxas = find_tool(&PTXAS)?;
    let nvdisasm = find_tool(&NVDISASM)?;
    let version = ptxas_version(&ptxas)?;
    let ptx_path = paths::ptx(module);
    let ptx = std::fs::read(&ptx_path)
        .map_err(|e| format!("cannot read {}: {e}. fix: cargo xtask build-ptx", paths::rel(&ptx_path)))?;
    println!("xtask: assembling {} with {} ({version})", paths::rel(&ptx_path), ptxas.display());
    let mut all = Vec::new();
    for arch in archs(module) {
        let cubin = paths::ptxas_cache().join(format!("{}.{arch}.cubin", module.file_name().trim_end_matches(".ptx")));
        std::fs::create_dir_all(paths::ptxas_cache()).map_err(|e| e.to_string())?;
        let out = Command::new(&ptxas)
            .args(["-arch", arch, "-v"])
            .arg(&ptx_path)
            .arg("-o")
            .arg(&cubin)
            .output()
            .map_err(|e| format!("cannot run ptxas: {e}"))?;
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if !out.status.success() {
            return Err(format!("ptxas failed for {arch}:\n{text}"));
        }
        let mut res = parse(&text, arch)?;
        for (name, n) in hmma_counts(&nvdisasm, &cubin)? {
            if let Some(r) = res.iter_mut().find(|r| r.name == name) {
                r.hmma = Some(n);
            }
        }
        all.extend(res);
    }
    all.sort_by(|a, b| (&a.name, &a.arch).cmp(&(&b.name, &b.arch)));

    println!(
        "{:<26} {:>5} {:>5} {:>8} {:>8} {:>6} {:>8} {:>8} {:>5}",
        "kernel", "arch", "regs", "spill-st", "spill-ld", "stack", "smem", "dyn-smem", "hmma"
    );
    for r in &all {
        println!(
            "{:<26} {:>5} {:>5} {:>8} {:>8} {:>6} {:>8} {:>8} {:>5}",
            r.name,
            r.arch,
            r.registers,
            r.spill_store_bytes,
            r.spill_load_bytes,
            r.stack_bytes,
            r.static_smem_bytes,
            r.dynamic_smem_bytes,
            r.hmma.unwrap_or(0)
        );
    }
    let ptx_text = String::from_utf8_lossy(&ptx);
    let entries = ptx_text.lines().filter(|l| l.contains(".entry")).count();
    if all.len() != entries * archs(module).len() {
        return Err(format!(
            "ptxas reported {} entries but the PTX declares {entries} per arch",
            all.len() / archs(module).len()
        ));
    }
    let spills: Vec<String> = all
        .iter()
        .filter(|r| r.spill_store_bytes + r.spill_load_bytes > 0)
        .map(|r| format!("{} ({}): {} B stored, {} B loaded", r.name, r.arch, r.spill_store_bytes, r.spill_load_bytes))
        .collect();

    // Every entry must be a row of the variant table, and the rows written for tensor cores
    // must really use them.
    let unknown: Vec<&str> =
        all.iter().filter(|r| KernelId::from_name(&r.name).is_none()).map(|r| r.name.as_str()).collect();
    if !unknown.is_empty() {
        return Err(format!(
            "entries that are not rows of the variant table (kernels-gpu/src/variants.rs): {}",
            unknown.join(", ")
        ));
    }
    let no_hmma: Vec<String> = all
        .iter()
        .filter(|r| {
            KernelId::from_name(&r.name).is_some_and(|k| k.variant().tensor_cores()) && r.hmma.unwrap_or(0) == 0
        })
        .map(|r| format!("{} ({})", r.name, r.arch))
        .collect();
    if !no_hmma.is_empty() {
        return Err(format!("tensor-core kernels without HMMA in their SASS: {}", no_hmma.join(", ")));
    }

    let report = PtxasReport { ptxas_version: version.clone(), ptx_sha256: sha256_hex(&ptx), kernels: all }.to_json();
    if check {
        if !spills.is_empty() {
            return Err(format!("register spills: {}", spills.join("; ")));
        }
        let committed = std::fs::read_to_string(paths::ptxas_report(module)).unwrap_or_default();
        if committed != report {
            let hint = if !committed.contains(&version) {
                format!(" (the report was not made with {version})")
            } else {
                String::new()
            };
            return Err(format!(
                "{} is stale{hint}. fix: cargo xtask ptxas, then commit",
                paths::rel(&paths::ptxas_report(module))
            ));
        }
        println!("xtask: {} is up to date; 0 spills", paths::rel(&paths::ptxas_report(module)));
        return Ok(());
    }
    if !spills.is_empty() {
        println!("xtask: WARNING register spills: {}", spills.join("; "));
    }
    std::fs::write(paths::ptxas_report(module), report).map_err(|e| e.to_string())?;
    println!("xtask: wrote {}", paths::rel(&paths::ptxas_report(module)));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The device functions' properties after an entry (0 bytes) do not overwrite the entry's.
    #[test]
    fn an_entrys_spills_are_its_own() {
        let out = "\
ptxas info    : Compiling entry function 'flash_fwd_bf16_d256' for 'sm_80'
ptxas info    : Function properties for flash_fwd_bf16_d256
    32 bytes stack frame, 36 bytes spill stores, 64 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 32 bytes cumulative stack size, 576 bytes cmem[0]
ptxas info    : Compile time = 312.113 ms
ptxas info    : Function properties for _RNvNtCsbSE61zFgCyu_4core9panicking9panic_fmt
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'saxpy_f32' for 'sm_80'
ptxas info    : Function properties for saxpy_f32
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers, 380 bytes cmem[0]
ptxas info    : Function properties for _RNvNtCsbSE61zFgCyu_4core9panicking9panic_fmt
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
";
        let r = parse(out, "sm_80").unwrap();
        assert_eq!(r.len(), 2);
        let d256 = &r[0];
        assert_eq!((d256.name.as_str(), d256.registers, d256.barriers), ("flash_fwd_bf16_d256", 255, 1));
        assert_eq!((d256.stack_bytes, d256.spill_store_bytes, d256.spill_load_bytes), (32, 36, 64));
        let s = &r[1];
        assert_eq!((s.name.as_str(), s.registers, s.stack_bytes, s.spill_store_bytes), ("saxpy_f32", 10, 0, 0));
    }
}
