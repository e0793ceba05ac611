//! `cargo xtask build-ptx [--check]`: both PTX modules, `memattn_kernels.ptx` (sm_80, every row
//! of the variant table but the Hopper ones) and `memattn_kernels_sm90.ptx` (sm_90a, the Hopper
//! rows: `--cfg memattn_sm90`, which also leaves the sm_80 kernel modules out), built at the
//! same time, each in its own target dir.

use crate::paths;
use crate::toolchain::{self, KERNEL_TOOLCHAIN, TARGET};
use kernels_gpu::artifacts::{sha256_hex, BuildInfo};
use kernels_gpu::variants::PtxModule;
use std::time::Instant;

/// The codegen flags of a module: its CPU, the PTX ISA version it needs, its cfg.
fn module_flags(module: PtxModule) -> Vec<String> {
    let mut f = vec!["-C".to_string(), format!("target-cpu={}", module.target_cpu()), "-C".into()];
    match module {
        // PTX ISA 7.4 (CUDA 11.4 drivers and newer): the first with cp.async's L2 prefetch hint.
        PtxModule::Sm80 => f.push("target-feature=+ptx74".into()),
        // PTX ISA 8.3 (CUDA 12.3 drivers): wgmma, TMA, setmaxnreg, and the tensor-map proxy fence.
        PtxModule::Sm90a => f.extend(["target-feature=+ptx83".into(), "--cfg".into(), "memattn_sm90".into()]),
    }
    f
}

/// Builds one module's PTX into `out` and returns the rustc version that built it.
pub fn build_into(module: PtxModule, out: &std::path::Path) -> Result<String, String> {
    build_flags_into(
        module.target_cpu(),
        &module_flags(module),
        &paths::ptx_target_dir(module),
        module == PtxModule::Sm90a,
        out,
    )
}

/// Builds PTX for `label` with the codegen `flags` in `target_dir` into `out` (`maxntid`: add
/// each entry's `.maxntid`; entries that ask for blocks per SM get their launch bounds in any
/// module) and returns the rustc version that built it.
fn build_flags_into(
    label: &str,
    flags: &[String],
    target_dir: &std::path::Path,
    maxntid: bool,
    out: &std::path::Path,
) -> Result<String, String> {
    let version = toolchain::ensure()?;
    println!("xtask: building kernels-gpu for {TARGET} ({label}) with {version}");
    let started = Instant::now();
    // rustc writes the raw PTX beside `out`; `out` gets the post-processed text. When cargo finds
    // the build fresh it does not run rustc, and the raw file is still the last build's, so
    // post-processing it again gives the same `out` (processing `out` itself would not).
    let raw = out.with_extension("raw.ptx");
    let status = toolchain::command("cargo")
        .current_dir(paths::root())
        .arg(format!("+{KERNEL_TOOLCHAIN}"))
        .args(["rustc", "--quiet", "-p", "memattn-kernels", "--profile", "ptx", "--crate-type", "staticlib"])
        .args(["--target", TARGET, "-Zbuild-std=core", "--target-dir"])
        .arg(target_dir)
        .arg("--")
        .args(flags)
        .args(toolchain::LINE_INFO_FLAGS)
        .arg(format!("--emit=asm={}", raw.display()))
        .status()
        .map_err(|e| format!("cannot run cargo +{KERNEL_TOOLCHAIN}: {e}"))?;
    if !status.success() {
        return Err(format!("the {label} kernel build failed (see the compiler output above)"));
    }
    let raw = std::fs::read_to_string(&raw).map_err(|e| format!("no PTX at {}: {e}", raw.display()))?;
    let mut ptx = toolchain::keep_line_info_only(&raw, &paths::root(), &toolchain::sysroot()?);
    ptx = with_launch_bounds(&ptx, maxntid)?;
    std::fs::write(out, &ptx).map_err(|e| format!("cannot write {}: {e}", out.display()))?;
    if let Some(line) = ptx.lines().find(|l| l.contains(".extern .func")) {
        return Err(format!(
            "the PTX still calls into an external function ({}); ptxas cannot resolve it. \
             Is the `ptx` profile's fat LTO in effect?",
            line.trim()
        ));
    }
    println!("xtask: built {} bytes of {label} PTX in {:.1} s", ptx.len(), started.elapsed().as_secs_f64());
    Ok(version)
}

/// Adds launch bounds to the module's entries: `.maxntid T, 1, 1` (the row's threads per block)
/// to every entry of the sm_90a module (`all_maxntid`), and in either module `.maxntid` with
/// `.minnctapersm N` to every entry whose row is built for N blocks per SM
/// ([`kernels_gpu::variants::Variant::min_blocks_per_sm`]). rustc has no launch-bounds
/// attribute. Without the block size ptxas cannot honour `setmaxnreg` (it needs the register
/// count at entry) and may give a 384-thread block more registers than an SM has for it;
/// `.minnctapersm` caps the registers so that N blocks fit, in ptxas and in the driver's JIT.
fn with_launch_bounds(ptx: &str, all_maxntid: bool) -> Result<String, String> {
    let mut out = String::with_capacity(ptx.len() + 1024);
    let mut pending: Option<(u32, u32)> = None;
    for line in ptx.lines() {
        if let Some(rest) = line.trim_start().strip_prefix(".visible .entry ") {
            let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            let k = kernels_gpu::KernelId::from_name(&name)
                .ok_or_else(|| format!("entry `{name}` of the PTX module is not a row of the variant table"))?;
            let v = k.variant();
            if all_maxntid || v.min_blocks_per_sm() > 0 {
                pending = Some((v.threads(), v.min_blocks_per_sm()));
            }
        }
        if let (Some((t, blocks)), "{") = (pending, line.trim()) {
            out.push_str(&format!(".maxntid {t}, 1, 1\n"));
            if blocks > 0 {
                out.push_str(&format!(".minnctapersm {blocks}\n"));
            }
            pending = None;
        }
        out.push_str(line);
        out.push('\n');
    }
    Ok(out)
}

fn build_info_json(module: PtxModule, rustc: &str, ptx: &[u8]) -> String {
    BuildInfo {
        toolchain: KERNEL_TOOLCHAIN.into(),
        rustc: rustc.into(),
        target: TARGET.into(),
        cpu: module.target_cpu().into(),
        ptx_sha256: sha256_hex(ptx),
    }
    .to_json()
}

/// A module's fresh PTX and the rustc version that built it.
type Built = (Vec<u8>, String);

pub fn run(check: bool, only_sm90: bool) -> Result<(), String> {
    // Both modules at once: each build is one rustc process, mostly single-threaded (fat LTO,
    // one codegen unit).
    let builds: Vec<(PtxModule, Result<Built, String>)> = std::thread::scope(|s| {
        let handles: Vec<_> = PtxModule::ALL
            .into_iter()
            .filter(|m| !only_sm90 || *m == PtxModule::Sm90a)
            .map(|m| {
                (
                    m,
                    s.spawn(move || -> Result<Built, String> {
                        let dir = paths::ptx_target_dir(m);
                        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
                        let tmp = dir.join(m.file_name());
                        let rustc = build_into(m, &tmp)?;
                        let fresh = std::fs::read(&tmp).map_err(|e| e.to_string())?;
                        Ok((fresh, rustc))
                    }),
                )
            })
            .collect();
        handles
            .into_iter()
            .map(|(m, h)| (m, h.join().unwrap_or_else(|_| Err("the build thread panicked".into()))))
            .collect()
    });
    let mut stale = Vec::new();
    let mut built = Vec::new();
    for (m, r) in builds {
        let (fresh, rustc) = r?;
        let info = build_info_json(m, &rustc, &fresh);
        if check {
            let committed = std::fs::read(paths::ptx(m)).unwrap_or_default();
            let committed_info = std::fs::read_to_string(paths::build_info(m)).unwrap_or_default();
            if committed != fresh || committed_info != info {
                stale.push(format!("{} or {}", paths::rel(&paths::ptx(m)), paths::rel(&paths::build_info(m))));
            } else {
                println!("xtask: {} is up to date ({})", paths::rel(&paths::ptx(m)), sha256_hex(&fresh));
            }
        } else {
            built.push((m, fresh, info));
        }
    }
    if !stale.is_empty() {
        return Err(format!(
            "{} stale (the kernel sources or toolchain changed). fix: cargo xtask build-ptx && cargo xtask ptxas, then commit",
            stale.join(" and ")
        ));
    }
    for (m, fresh, info) in built {
        std::fs::write(paths::ptx(m), &fresh).map_err(|e| e.to_string())?;
        std::fs::write(paths::build_info(m), info).map_err(|e| e.to_string())?;
        println!("xtask: wrote {} and {}", paths::rel(&paths::ptx(m)), paths::rel(&paths::build_info(m)));
    }
    Ok(())
}

/// `cargo xtask build-ptx --timeline [--check]`: the timeline modules, built at the same time
/// with `--cfg memattn_timeline`: `memattn_kernels_timeline.ptx` (sm_80) and
/// `memattn_kernels_timeline_sm90.ptx` (sm_90a), each with only the rows of
/// `kernels_gpu::timeline::TIMELINE_KERNELS` of its module (and, in sm_90a, the tensor-map store
/// the Hopper forward's launch needs), with their phase stamps; and their build info.
pub fn run_timeline(check: bool) -> Result<(), String> {
    let builds: Vec<(PtxModule, Result<Built, String>)> = std::thread::scope(|s| {
        let handles: Vec<_> = PtxModule::ALL.into_iter().map(|m| (m, s.spawn(move || build_timeline(m)))).collect();
        handles
            .into_iter()
            .map(|(m, h)| (m, h.join().unwrap_or_else(|_| Err("the build thread panicked".into()))))
            .collect()
    });
    let mut out = Vec::new();
    for (m, r) in builds {
        let (fresh, rustc) = r?;
        let info = build_info_json(m, &rustc, &fresh);
        let (name, info_name) = timeline_files(m);
        let dir = paths::root().join("kernels-gpu/ptx");
        out.push((dir.join(name), dir.join(info_name), fresh, info));
    }
    if check {
        let stale: Vec<String> = out
            .iter()
            .filter(|(ptx, info_path, fresh, info)| {
                std::fs::read(ptx).unwrap_or_default() != *fresh
                    || std::fs::read_to_string(info_path).unwrap_or_default() != *info
            })
            .map(|(ptx, info_path, _, _)| format!("{} or {}", paths::rel(ptx), paths::rel(info_path)))
            .collect();
        if !stale.is_empty() {
            return Err(format!(
                "{} stale (the kernel sources or toolchain changed). fix: cargo xtask build-ptx --timeline, then commit",
                stale.join(" and ")
            ));
        }
        for (ptx, _, fresh, _) in &out {
            println!("xtask: {} is up to date ({})", paths::rel(ptx), sha256_hex(fresh));
        }
        return Ok(());
    }
    for (ptx, info_path, fresh, info) in out {
        std::fs::write(&ptx, &fresh).map_err(|e| e.to_string())?;
        std::fs::write(&info_path, info).map_err(|e| e.to_string())?;
        println!("xtask: wrote {} and {}", paths::rel(&ptx), paths::rel(&info_path));
    }
    Ok(())
}

/// One timeline module's fresh PTX and the rustc version that built it.
fn build_timeline(m: PtxModule) -> Result<Built, String> {
    let mut flags = module_flags(m);
    flags.extend(["--cfg".into(), "memattn_timeline".into()]);
    let dir = paths::root().join(match m {
        PtxModule::Sm80 => "target/ptx-build-timeline",
        PtxModule::Sm90a => "target/ptx-build-timeline-sm90",
    });
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let tmp = dir.join(timeline_files(m).0);
    let label = format!("{}, timeline", m.target_cpu());
    let rustc = build_flags_into(&label, &flags, &dir, m == PtxModule::Sm90a, &tmp)?;
    let fresh = std::fs::read(&tmp).map_err(|e| e.to_string())?;
    Ok((fresh, rustc))
}

/// A timeline module's PTX and build-info file names under `kernels-gpu/ptx/`.
fn timeline_files(m: PtxModule) -> (&'static str, &'static str) {
    match m {
        PtxModule::Sm80 => ("memattn_kernels_timeline.ptx", "build-info-timeline.json"),
        PtxModule::Sm90a => ("memattn_kernels_timeline_sm90.ptx", "build-info-timeline-sm90.json"),
    }
}
