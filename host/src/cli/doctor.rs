//! `memattn doctor` and `memattn kernels`.

use super::args::Cli;
use super::{load_ptx, print_json};
use memattn_cli::device::cuda::{probe, quietly};
use memattn_cli::error::{exit, Error};
use memattn_cli::ptx::{build_info, ptxas_report, PtxSource};
use memattn_cli::report::{human_bytes, table};
use std::path::PathBuf;
use std::process::Command;

/// `ptxas` on PATH or in the usual CUDA locations, with its version line.
fn find_ptxas() -> Option<(PathBuf, String)> {
    let mut candidates: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).map(|d| d.join("ptxas")).collect())
        .unwrap_or_default();
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        candidates.push(PathBuf::from(home).join("bin/ptxas"));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/bin/ptxas"));
    for c in candidates {
        if c.is_file() {
            let version = Command::new(&c)
                .arg("--version")
                .output()
                .ok()
                .map(|o| String::from_utf8_lossy(&o.stdout).lines().last().unwrap_or("").trim().to_string())
                .unwrap_or_default();
            return Some((c, version));
        }
    }
    None
}

fn ptx_json(src: &PtxSource) -> serde_json::Value {
    let (version, target) = src.version_and_target();
    let bi = build_info();
    let matches = match (&bi, src.is_embedded()) {
        (Ok(Some(b)), _) => Some(b.ptx_sha256 == src.sha256),
        _ => None,
    };
    serde_json::json!({
        "origin": src.origin,
        "sha256": src.sha256,
        "ptx_version": version,
        "target": target,
        "kernels": src.entries().into_iter().map(|e| e.name).collect::<Vec<_>>(),
        "build_info": match &bi { Ok(b) => serde_json::to_value(b).unwrap_or_default(), Err(e) => e.clone().into() },
        "build_info_matches_loaded_ptx": matches,
    })
}

pub fn doctor(cli: &Cli) -> Result<i32, Error> {
    let src = load_ptx(cli)?;
    let cuda = probe();
    let gpus = memattn_cli::nvml::gpus();
    let ptxas = find_ptxas();
    let vm = quietly(|| src.vm_module().and_then(|m| m.check_all().map(|()| m.kernels().len())));
    let vm_status = match &vm {
        Ok(Ok(n)) => format!("loads the PTX ({n} kernels decoded)"),
        Ok(Err(e)) => format!("cannot load the PTX: {e}"),
        Err(p) => format!("not usable in this build: {p}"),
    };
    let vm_device = vm_device(cli);
    let next = match (&cuda, &gpus) {
        (Ok(_), Ok(g)) if !g.is_empty() => {
{
            use memattn_cli::memory::AnalyticBytes;
            use memattn_cli::problem::{KernelKind, Problem};
            let p = Problem { seq_q: 4096, seq_kv: 4096, ..Problem::default() };
            let what = if memattn_cli::device::cuda::vm_backed() {
                "the VM-backed driver's simulated memory (no GPU: this CUDA driver runs the PTX VM)"
            } else {
                "this GPU's free memory"
            };
            format!(
                "next safe step: the plan of your workload against {what}, then one small measured run: \
                 `memattn --save evidence.jsonl plan --config config.json --batch 1 --context 4096` then \
                 `memattn --save evidence.jsonl --backend cuda compare --seq 4096` (expected state: naive {}, flash {} \
                 on top of the memory used now)",
                human_bytes(AnalyticBytes::new(&p, KernelKind::Naive).total),
                human_bytes(AnalyticBytes::new(&p, KernelKind::Flash).total)
            )
        }
        }
        (Ok(_), _) => "CUDA works but NVML does not: memory will come from cuMemGetInfo only; check that libnvidia-ml.so.1 is installed with the driver".to_string(),
        (Err(why), Ok(g)) if !g.is_empty() => format!(
            "NVML sees a GPU but CUDA cannot be used ({why}); check that libcuda.so.1 matches the kernel driver (`nvidia-smi`) and that the process may open /dev/nvidia*"
        ),
        (Err(_), _) => "no GPU here: every command runs in the PTX VM. Next safe step, the memory plan of your \
             workload before anything runs: `memattn --save evidence.jsonl plan --layers 32 --heads 32 --heads-kv 8 --head-dim 128 --batch 1 --context 4096 --verify` \
             (--config config.json reads a model's sizes instead; or `memattn --save evidence.jsonl compare` for a measured naive-vs-flash run in the VM); on a GPU machine \
             run `scripts/gpu-check.sh` with the release binary".to_string(),
    };
    let v = serde_json::json!({
        "command": "doctor",
        "cuda": match &cuda { Ok(s) => serde_json::json!({"available": true, "detail": s}), Err(e) => serde_json::json!({"available": false, "reason": e}) },
        "gpus": match &gpus { Ok(g) => serde_json::to_value(g).unwrap_or_default(), Err(e) => serde_json::json!({"error": e}) },
        "ptx": ptx_json(&src),
        "ptxas": ptxas.as_ref().map(|(p, v)| serde_json::json!({"path": p.display().to_string(), "version": v})),
        "vm": vm_status,
        "vm_device": vm_device,
        "next_step": next,
    });
    super::save_evidence(cli, &v)?;
    if cli.json {
        print_json(&v);
        return Ok(exit::SUCCESS);
    }
    println!("== GPU");
    match &cuda {
        Ok(s) => println!("CUDA driver: {s}"),
        Err(e) => println!("CUDA: not available: {e}"),
    }
    match &gpus {
        Ok(g) if g.is_empty() => println!("NVML: no GPU listed"),
        Ok(g) => {
            for d in g {
                println!(
                    "GPU {}: {}  compute capability {}  driver {}{}",
                    d.index,
                    d.name,
                    d.compute_capability,
                    d.driver_version,
                    d.cuda_driver_version.as_ref().map(|v| format!(" (CUDA {v})")).unwrap_or_default()
                );
                println!(
                    "  memory: {} used / {} total, {} free; utilisation {}% GPU, {}% memory",
                    human_bytes(d.memory_used_bytes),
                    human_bytes(d.memory_total_bytes),
                    human_bytes(d.memory_free_bytes),
                    d.utilization_gpu_percent.map(|u| u.to_string()).unwrap_or_else(|| "?".into()),
                    d.utilization_memory_percent.map(|u| u.to_string()).unwrap_or_else(|| "?".into())
                );
                let mhz = |v: Option<u32>| v.map(|m| format!("{m} MHz")).unwrap_or_else(|| "?".into());
                println!(
                    "  clocks: SM {} (max {}), memory {}",
                    mhz(d.clock_sm_mhz),
                    mhz(d.clock_sm_max_mhz),
                    mhz(d.clock_memory_mhz)
                );
                if d.processes.is_empty() {
                    println!("  processes: none using the GPU (or NVML may not list them here)");
                }
                for p in &d.processes {
                    println!(
                        "  process {}: {}",
                        p.pid,
                        p.used_bytes.map(human_bytes).unwrap_or_else(|| "memory not reported".into())
                    );
                }
                println!("  uuid: {}", d.uuid);
            }
        }
        Err(e) => println!("NVML: {e}"),
    }
    let vm_chosen = matches!(cli.backend, memattn_cli::device::BackendChoice::Vm);
    if cuda.is_err() || vm_chosen {
        let why = match &cuda {
            _ if vm_chosen => "--backend vm".to_string(),
            Err(e) => format!("no GPU: {e}"),
            Ok(_) => String::new(),
        };
        println!("\n== the device every command will use: the PTX VM ({why})");
        let d = &vm_device;
        if d["error"].is_null() {
            println!("name: {}", d["name"].as_str().unwrap_or(""));
            println!(
                "simulated device memory: {} ({})",
                human_bytes(d["memory_bytes"].as_u64().unwrap_or(0)),
                if d["memory_from_flag"] == true {
                    "set by --vm-memory-mib"
                } else {
                    "the VM's default; --vm-memory-mib sets it"
                }
            );
            println!(
                "shared memory per block: {} (an sm_80 part's limit with opt-in; 48 KiB without)",
                human_bytes(d["shared_per_block_bytes"].as_u64().unwrap_or(0))
            );
            println!("threads per block: at most {}; grid at most {}", d["max_threads_per_block"], d["max_grid"]);
            println!(
                "SMs: none simulated - the blocks of a launch are shared out to {} worker threads (--vm-workers), each running whole blocks",
                d["workers"]
            );
            println!(
                "checks: memcheck always; initcheck {}, racecheck {} (--vm-allow turns them off)",
                d["initcheck"].as_str().unwrap_or("?"),
                d["racecheck"].as_str().unwrap_or("?")
            );
            println!("memory figures: exact (the VM's allocator); time: host wall clock, says nothing about a GPU");
        } else {
            println!("the VM cannot start: {}", d["error"]);
        }
    }
    println!("\n== PTX");
    let (version, target) = src.version_and_target();
    println!("source: {}  sha256 {}", src.origin, src.sha256);
    println!("PTX ISA {}  target {}", version.unwrap_or_else(|| "?".into()), target.unwrap_or_else(|| "?".into()));
    println!("kernels: {}", src.entries().into_iter().map(|e| e.name).collect::<Vec<_>>().join(", "));
    match build_info() {
        Ok(Some(b)) => {
            println!("built by {} ({}) for {} {}", b.rustc, b.toolchain, b.target, b.cpu);
            if b.ptx_sha256 != src.sha256 {
                println!("note: build-info.json describes PTX {}, not the loaded one", b.ptx_sha256);
            }
        }
        Ok(None) => println!("build info: not recorded at build time (kernels-gpu/ptx/build-info.json missing)"),
        Err(e) => println!("build info: unreadable: {e}"),
    }
    println!("VM: {vm_status}");
    println!("\n== ptxas");
    match &ptxas {
        Some((p, v)) => println!("{} ({v})", p.display()),
        None => println!("not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin); the embedded ptxas report is shown by `memattn kernels`"),
    }
    println!("\n== next step\n{next}");
    Ok(exit::SUCCESS)
}

/// The VM device as the options describe it (what every command uses without a GPU).
fn vm_device(cli: &Cli) -> serde_json::Value {
    let opts = match super::device_options(cli) {
        Ok(o) => o,
        Err(e) => return serde_json::json!({"error": e.to_string()}),
    };
    match memattn_cli::device::vm::VmDevice::new(&opts) {
        Ok(mut d) => {
            use memattn_cli::device::Device;
            let caps = d.caps().ok();
            serde_json::json!({
                "name": d.name(),
                "memory_bytes": caps.map(|c| c.total_memory_bytes),
                "memory_from_flag": cli.vm_memory_mib.is_some(),
                "shared_per_block_bytes": caps.map(|c| c.max_dynamic_smem_bytes),
                "max_threads_per_block": caps.map(|c| c.max_threads_per_block),
                "max_grid": caps.map(|c| c.max_grid),
                "sm_count": null,
                "workers": opts.vm_workers.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)),
                "initcheck": if opts.vm_initcheck { "on" } else { "off" },
                "racecheck": if opts.vm_racecheck { "on" } else { "off" },
            })
        }
        Err(e) => serde_json::json!({"error": e.to_string()}),
    }
}

/// Kernels of the ABI the loaded PTX does not contain, with what runs them.
fn missing_kernels(src: &PtxSource) -> Vec<(String, String)> {
    let names: Vec<String> = src.entries().into_iter().map(|e| e.name).collect();
    kernels_gpu::KernelId::ALL
        .into_iter()
        // The Hopper rows live in the second module (`memattn_kernels_sm90.ptx`).
        .filter(|k| k.variant().module() == kernels_gpu::variants::PtxModule::Sm80)
        .filter(|k| !names.iter().any(|n| n == k.name()))
        .map(|k| {
            let what = if k.variant().tensor_cores() {
                "--dtype bf16/f16 needs it: the module was built without the tensor-core kernels; \
                 load one that has them with --ptx"
            } else {
                "the host launches it; this module cannot run every command"
            };
            (k.name().to_string(), what.to_string())
        })
        .collect()
}

/// The tile of the variant-table row named `name` (`null` for an entry the table does not have):
/// query rows and keys per block step (`null` for kernels without such tiles), warps per block,
/// dynamic shared memory.
fn tile_json(name: &str) -> serde_json::Value {
    let Some(v) = kernels_gpu::variants::KernelId::from_name(name).map(|k| k.variant()) else {
        return serde_json::Value::Null;
    };
    let or_null = |x: u32| if x == 0 { None } else { Some(x) };
    serde_json::json!({
        "br": or_null(v.block_rows()),
        "bc": or_null(v.block_cols()),
        "warps": v.threads().div_ceil(32),
        "smem_bytes": v.dynamic_smem_bytes(),
    })
}

/// The tile in one line of the plain listing.
fn tile_text(name: &str) -> Option<String> {
    let v = kernels_gpu::variants::KernelId::from_name(name)?.variant();
    let rows = match (v.block_rows(), v.block_cols(), v.head_dim()) {
        (0, _, _) => String::new(),
        (br, bc, Some(d)) => format!("Br {br} x Bc {bc} (d {d}), "),
        (br, bc, None) => format!("Br {br} x Bc {bc}, "),
    };
    Some(format!("{rows}{} warps, {} B dynamic smem", v.threads().div_ceil(32), v.dynamic_smem_bytes()))
}

pub fn kernels(cli: &Cli) -> Result<i32, Error> {
    let src = load_ptx(cli)?;
    let report = ptxas_report().map_err(Error::Usage)?;
    let report_matches = report.as_ref().map(|r| r.ptx_sha256 == src.sha256);
    // PTX that does not load is a kernel error (exit 3), as it is for `run`: a listing of what a
    // text scan finds in it would look like a valid module.
    let vm_info: Option<Vec<ptx_vm::KernelInfo>> =
        match quietly(|| src.vm_module().and_then(|m| m.check_all().map(|()| m.kernels()))) {
            Ok(Ok(k)) => Some(k),
            Ok(Err(e)) => {
                return Err(Error::Device(memattn_cli::device::DeviceError::PtxLoad {
                    origin: src.origin.clone(),
                    message: e.to_string(),
                }))
            }
            Err(_) => None,
        };
    let entries = src.entries();
    if cli.json {
        let ks: Vec<serde_json::Value> = entries
            .iter()
            .map(|e| {
                let res: Vec<_> = report.iter().flat_map(|r| r.kernels.iter().filter(|k| k.name == e.name)).collect();
                let vm = vm_info.as_ref().and_then(|v| v.iter().find(|k| k.name == e.name));
                serde_json::json!({
                    "name": e.name,
                    "line": e.line,
                    "params": e.params,
                    "ptxas": res,
                    "vm_instructions": vm.map(|k| k.instructions),
                    "vm_param_bytes": vm.map(|k| k.param_bytes),
                    "tile": tile_json(&e.name),
                })
            })
            .collect();
        print_json(&serde_json::json!({
            "command": "kernels",
            "ptx": ptx_json(&src),
            "missing": missing_kernels(&src),
            "ptxas_version": report.as_ref().map(|r| r.ptxas_version.clone()),
            "ptxas_report_matches_loaded_ptx": report_matches,
            "kernels": ks,
        }));
        return Ok(exit::SUCCESS);
    }
    println!("PTX: {} (sha256 {})", src.origin, src.sha256);
    for e in &entries {
        let params: Vec<String> = e.params.iter().map(|p| format!("{} {}", p.decl, p.name)).collect();
        let vm = vm_info.as_ref().and_then(|v| v.iter().find(|k| k.name == e.name));
        println!(
            "\n{} (PTX line {}){}\n  params: {}",
            e.name,
            e.line,
            vm.map(|k| format!(", {} instructions decoded by the VM", k.instructions)).unwrap_or_default(),
            params.join(", ")
        );
        if let Some(t) = tile_text(&e.name) {
            println!("  tile: {t}");
        }
    }
    for (name, what) in missing_kernels(&src) {
        println!("\n{name}: not in the loaded PTX ({what})");
    }
    match &report {
        None => println!("\nptxas resources: not recorded (kernels-gpu/ptx/ptxas-report.json missing at build time)"),
        Some(r) => {
            println!(
                "\nptxas resources ({}){}:",
                r.ptxas_version,
                if report_matches == Some(false) {
                    " - NOTE: recorded for a different PTX than the loaded one"
                } else {
                    ""
                }
            );
            let header: Vec<String> =
                ["kernel", "arch", "regs", "spill st/ld", "stack", "static smem", "dyn smem", "barriers", "hmma"]
                    .iter()
                    .map(|s| s.to_string())
                    .collect();
            let rows: Vec<Vec<String>> = r
                .kernels
                .iter()
                .map(|k| {
                    vec![
                        k.name.clone(),
                        k.arch.clone(),
                        k.registers.to_string(),
                        format!("{}/{}", k.spill_store_bytes, k.spill_load_bytes),
                        k.stack_bytes.to_string(),
                        k.static_smem_bytes.to_string(),
                        k.dynamic_smem_bytes.to_string(),
                        k.barriers.to_string(),
                        k.hmma.map(|n| n.to_string()).unwrap_or_else(|| "-".into()),
                    ]
                })
                .collect();
            print!("{}", table(&header, &rows));
        }
    }
    Ok(exit::SUCCESS)
}
