//! `memattn launch`: run any entry point of a PTX module in the VM with named buffers and typed
//! arguments (the command-line face of `ptx_vm::run::Launcher`).

use super::args::{Cli, LaunchArgs};
use super::{load_ptx, parse_dim3, print_json};
use memattn_cli::device::{BackendChoice, DeviceError};
use memattn_cli::error::{exit, Error};
use ptx_vm::run::{Arg, Launcher, OUTPUT_POISON};
use ptx_vm::{Module, Vm, VmError};

/// `NAME=TYPE:LEN[:INIT]`.
struct BufSpec {
    name: String,
    ty: &'static str,
    len: usize,
    init: String,
}

fn parse_buf(s: &str) -> Result<BufSpec, Error> {
    let bad = |why: &str| {
        Error::Usage(format!(
            "--buf {s}: {why}; expected NAME=TYPE:LEN[:INIT] with TYPE f32 or u32 and INIT poison (default), zeros, iota, randn or const=V"
        ))
    };
    let (name, rest) = s.split_once('=').ok_or_else(|| bad("no `=`"))?;
    let mut parts = rest.splitn(3, ':');
    let ty = match parts.next().unwrap_or("") {
        "f32" => "f32",
        "u32" => "u32",
        t => return Err(bad(&format!("unknown type `{t}`"))),
    };
    let len: usize = parts.next().unwrap_or("").parse().map_err(|_| bad("the length is not a number"))?;
    if len == 0 || len > 1 << 28 {
        return Err(bad("the length must be 1..=2^28 elements"));
    }
    let init = parts.next().unwrap_or("poison").to_string();
    if name.is_empty() {
        return Err(bad("empty name"));
    }
    Ok(BufSpec { name: name.to_string(), ty, len, init })
}

fn parse_arg(s: &str) -> Result<Arg, Error> {
    let bad =
        || Error::Usage(format!("--arg {s}: expected TYPE=VALUE with TYPE u32, i32, f32, u64 or buf (a --buf name)"));
    let (ty, v) = s.split_once('=').ok_or_else(bad)?;
    Ok(match ty {
        "u32" => Arg::U32(v.parse().map_err(|_| bad())?),
        "i32" => Arg::I32(v.parse().map_err(|_| bad())?),
        "f32" => Arg::F32(v.parse().map_err(|_| bad())?),
        "u64" => Arg::U64(v.parse().map_err(|_| bad())?),
        "buf" => Arg::buf(v),
        _ => return Err(bad()),
    })
}

/// Deterministic standard-normal-ish values (sum of four uniforms), so runs can be repeated.
fn randn(len: usize, seed: u64) -> Vec<f32> {
    let mut st = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut u = || {
        st = st.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (st >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..len).map(|_| (((0..4).map(|_| u()).sum::<f64>() - 2.0) * 3f64.sqrt()) as f32).collect()
}

fn init_bytes(b: &BufSpec, seed: u64) -> Result<Vec<u8>, Error> {
    let words: Vec<u32> = match (b.init.as_str(), b.ty) {
        ("poison", _) => vec![OUTPUT_POISON; b.len],
        ("zeros", _) => vec![0; b.len],
        ("iota", "f32") => (0..b.len).map(|i| (i as f32).to_bits()).collect(),
        ("iota", _) => (0..b.len as u32).collect(),
        ("randn", "f32") => randn(b.len, seed).into_iter().map(f32::to_bits).collect(),
        (c, ty) if c.starts_with("const=") => {
            let v = &c[6..];
            let bits = if ty == "f32" { v.parse::<f32>().map(f32::to_bits).ok() } else { v.parse::<u32>().ok() };
            vec![bits.ok_or_else(|| Error::Usage(format!("--buf {}: `{v}` is not a {ty}", b.name)))?; b.len]
        }
        (i, ty) => return Err(Error::Usage(format!("--buf {}: unknown initialiser `{i}` for {ty}", b.name))),
    };
    Ok(words.into_iter().flat_map(u32::to_le_bytes).collect())
}

fn vm_error(kernel: &str, e: VmError) -> Error {
    match e {
        VmError::Memcheck(f) | VmError::Trap(f) => Error::Device(DeviceError::Memcheck {
            kernel: kernel.to_string(),
            message: memattn_cli::device::vm::describe_finding(&f),
        }),
        VmError::UnknownKernel(k) => unknown_kernel(&k),
        VmError::InvalidLaunch(m) | VmError::InvalidPointer(m) => Error::Usage(m),
        other => Error::Device(DeviceError::Vm { op: format!("launch of `{kernel}`"), message: other.to_string() }),
    }
}

/// A kernel name the module does not have is a bad argument (exit 2), not a device error.
fn unknown_kernel(name: &str) -> Error {
    Error::Usage(format!("no entry point `{name}` in the PTX module (`memattn kernels` lists them)"))
}

/// Refuses buffers that together exceed the VM's device memory (exit 2) or whose host copies
/// cannot be reserved (exit 3), before any of them is filled: each buffer is built on the host
/// and copied into the VM's memory, which is host memory too.
fn check_buffers_fit(bufs: &[BufSpec], vm_limit: u64) -> Result<(), Error> {
    let total: u64 = bufs.iter().map(|b| b.len as u64 * 4).sum();
    if total > vm_limit {
        return Err(Error::Usage(format!(
            "the --buf buffers total {total} bytes ({}), over the VM's device memory of {vm_limit} bytes ({}; --vm-memory-mib sets it)",
            memattn_cli::units::human_bytes(total),
            memattn_cli::units::human_bytes(vm_limit)
        )));
    }
    let largest = bufs.iter().map(|b| b.len as u64 * 4).max().unwrap_or(0);
    memattn_cli::runner::probe_host_memory(
        total.saturating_add(largest.saturating_mul(2)),
        "the --buf buffers (VM memory plus the host copy being filled)",
    )
}

pub fn launch(cli: &Cli, a: &LaunchArgs) -> Result<i32, Error> {
    if cli.backend == BackendChoice::Cuda {
        return Err(Error::Usage("launch runs in the VM only (use --backend vm or auto)".into()));
    }
    let dims = |what: &str, s: &str| -> Result<[u32; 3], Error> {
        let d = parse_dim3(what, s)?;
        let given = s.split(',').count();
        if d[..given].contains(&0) {
            return Err(Error::Usage(format!("--{what} {s}: every dimension must be at least 1")));
        }
        Ok(d.map(|x| x.max(1)))
    };
    let grid = dims("grid", &a.grid)?;
    let block = dims("block", &a.block)?;
    let bufs: Vec<BufSpec> = a.buf.iter().map(|s| parse_buf(s)).collect::<Result<_, _>>()?;
    let args: Vec<Arg> = a.arg.iter().map(|s| parse_arg(s)).collect::<Result<_, _>>()?;
    let ptx = load_ptx(cli)?;
    let module = ptx
        .vm_module()
        .map_err(|e| Error::Device(DeviceError::PtxLoad { origin: ptx.origin.clone(), message: e.to_string() }))?;
    if !module.kernel_names().iter().any(|k| k == &a.kernel) {
        return Err(unknown_kernel(&a.kernel));
    }
    let mut vm = match cli.vm_workers {
        Some(0) => return Err(Error::Usage("--vm-workers must be at least 1".into())),
        Some(n) => Vm::with_workers(n),
        None => Vm::new(),
    };
    if let Some(mib) = cli.vm_memory_mib {
        let bytes = mib
            .checked_mul(1 << 20)
            .filter(|&b| b > 0)
            .ok_or_else(|| Error::Usage(format!("--vm-memory-mib must be 1..={} (got {mib})", u64::MAX >> 20)))?;
        let mut limits = vm.limits();
        limits.memory_bytes = bytes;
        vm.set_limits(limits);
    }
    set_time_limit(&mut vm, a.max_seconds);
    check_buffers_fit(&bufs, vm.limits().memory_bytes)?;
    vm.set_sectors(cli.vm_sectors);
    vm.set_initcheck(!cli.vm_allow.contains(&super::args::VmCheck::Initcheck));
    vm.set_racecheck(!cli.vm_allow.contains(&super::args::VmCheck::Racecheck));
    vm.set_bank_conflicts(cli.vm_bank_conflicts);
    let mut l = Launcher::with_vm(vm, &module);
    for (i, b) in bufs.iter().enumerate() {
        l.input_bytes(&b.name, &init_bytes(b, a.seed + i as u64)?).map_err(|e| vm_error(&a.kernel, e))?;
    }
    let stats = l.launch(&a.kernel, grid, block, a.smem, &args).map_err(|e| vm_error(&a.kernel, e))?;
    let show: Vec<&BufSpec> = if a.show.is_empty() {
        bufs.iter().collect()
    } else {
        a.show
            .iter()
            .map(|n| {
                bufs.iter()
                    .find(|b| &b.name == n)
                    .ok_or_else(|| Error::Usage(format!("--show {n}: no --buf named `{n}`")))
            })
            .collect::<Result<_, _>>()?
    };
    let mut shown = serde_json::Map::new();
    if !cli.json {
        println!(
            "launched `{}` grid {grid:?} block {block:?} smem {} B in the VM: {} thread instructions",
            a.kernel, a.smem, stats.thread_instructions
        );
        print_sectors(&a.kernel, &stats);
    }
    let banks = memattn_cli::runner::bank_lines(&stats.bank_conflicts);
    if cli.vm_bank_conflicts && !cli.json {
        print_banks(&banks);
    }
    for b in show {
        let raw = l.read_bytes(&b.name).map_err(|e| vm_error(&a.kernel, e))?;
        let words: Vec<u32> = raw.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let unwritten = words.iter().filter(|&&w| w == OUTPUT_POISON).count();
        let head: Vec<String> = words
            .iter()
            .take(a.count)
            .map(|&w| match (w == OUTPUT_POISON, b.ty) {
                (true, _) => "poison".to_string(),
                (_, "f32") => format!("{}", f32::from_bits(w)),
                _ => w.to_string(),
            })
            .collect();
        if cli.json {
            shown.insert(
                b.name.clone(),
                serde_json::json!({"type": b.ty, "len": b.len, "poison_elements": unwritten, "first": head}),
            );
        } else {
            println!("{}[0..{}] = [{}]", b.name, head.len(), head.join(", "));
            println!("  {} of {} elements still hold the poison 0x{OUTPUT_POISON:08X}", unwritten, b.len);
        }
    }
    if cli.json {
        print_json(&serde_json::json!({
            "command": "launch",
            "kernel": a.kernel,
            "ptx": ptx.origin,
            "grid": grid,
            "block": block,
            "smem_bytes": a.smem,
            "thread_instructions": stats.thread_instructions,
            "sectors": memattn_cli::runner::sector_lines(&stats.sectors),
            "buffers": shown,
            "bank_conflicts": cli.vm_bank_conflicts.then_some(&banks),
        }));
    }
    Ok(exit::SUCCESS)
}

/// `--vm-bank-conflicts`: the launch's shared-memory wavefronts against the minimum (one per
/// phase), then every source line (PTX line without `.loc`) that took more, in the order the
/// kernel first ran them.
fn print_banks(banks: &[memattn_cli::runner::BankLine]) {
    let (w, i) = banks.iter().fold((0, 0), |(w, i), b| (w + b.wavefronts, i + b.ideal));
    if banks.is_empty() {
        println!("banks: no shared-memory ld, st or ldmatrix ran");
        return;
    }
    println!("banks: {w} shared-memory wavefronts for a minimum of {i} ({:.2}x)", w as f64 / i.max(1) as f64);
    let mut any = false;
    for b in banks.iter().filter(|b| b.wavefronts > b.ideal) {
        any = true;
        println!(
            "  {}: {} wavefronts for {} ({:.1}-way), {} warp-wide executions",
            b.at,
            b.wavefronts,
            b.ideal,
            b.wavefronts as f64 / b.ideal.max(1) as f64,
            b.executions
        );
    }
    if !any {
        println!("  no bank conflicts: every shared access took one wavefront per phase");
    }
}

/// With `--vm-sectors`: the launch's global-memory sectors, every source line with a global
/// access, least efficient first.
fn print_sectors(kernel: &str, stats: &ptx_vm::LaunchStats) {
    if !stats.sectors.is_empty() {
        let lines = memattn_cli::runner::sector_lines(&stats.sectors);
        for l in memattn_cli::runner::sector_report(kernel, &lines, lines.len()) {
            println!("{l}");
        }
    }
}

/// `--grid`/`--block` of a launch: X[,Y[,Z]], every given dimension at least 1.
pub(super) fn launch_dim3(what: &str, s: &str) -> Result<[u32; 3], Error> {
    let d = parse_dim3(what, s)?;
    let given = s.split(',').count();
    if d[..given].contains(&0) {
        return Err(Error::Usage(format!("--{what} {s}: every dimension must be at least 1")));
    }
    Ok(d.map(|x| x.max(1)))
}

/// `--max-seconds`: the VM stops a launch past it as a hang (0: no limit).
fn set_time_limit(vm: &mut Vm, max_seconds: f64) {
    if max_seconds > 0.0 {
        let mut limits = vm.limits();
        limits.max_launch_time = Some(std::time::Duration::from_secs_f64(max_seconds));
        vm.set_limits(limits);
    }
}

/// `trace --entry`: one launch of any entry with `launch`'s buffers (`--buf`), arguments
/// (`--arg`) and VM checks, and the trace the configuration requests. A launch that cannot start
/// (unknown entry, arguments that do not match its parameters) is the error; a launch stopped by
/// a finding returns the trace up to it, with the finding as the second value.
pub(super) fn launch_traced(
    cli: &Cli,
    module: &Module,
    kernel: &str,
    config: &ptx_vm::LaunchConfig,
    own: &super::trace::EntryArgs,
    seed: u64,
) -> Result<(Vec<ptx_vm::TraceEntry>, Option<Error>), Error> {
    let (buf, arg, max_seconds) = (&own.buf, &own.arg, own.max_seconds);
    let bufs: Vec<BufSpec> = buf.iter().map(|s| parse_buf(s)).collect::<Result<_, _>>()?;
    let args: Vec<Arg> = arg.iter().map(|s| parse_arg(s)).collect::<Result<_, _>>()?;
    let mut vm = match cli.vm_workers {
        Some(0) => return Err(Error::Usage("--vm-workers must be at least 1".into())),
        Some(n) => Vm::with_workers(n),
        None => Vm::new(),
    };
    set_time_limit(&mut vm, max_seconds);
    vm.set_initcheck(!cli.vm_allow.contains(&super::args::VmCheck::Initcheck));
    vm.set_racecheck(!cli.vm_allow.contains(&super::args::VmCheck::Racecheck));
    let mut l = Launcher::with_vm(vm, module);
    for (i, b) in bufs.iter().enumerate() {
        l.input_bytes(&b.name, &init_bytes(b, seed + i as u64)?).map_err(|e| vm_error(kernel, e))?;
    }
    l.pack(kernel, &args).map_err(|e| vm_error(kernel, e))?;
    match l.launch_with(kernel, config, &args) {
        Ok(stats) => Ok((stats.trace, None)),
        Err(e) => Ok((l.vm().take_trace(), Some(vm_error(kernel, e)))),
    }
}
