//! `cargo xtask lesson new NAME` and `cargo xtask lesson build NAME`: a scratch kernel crate of
//! your own under `lessons/scratch/NAME/`, built with the lessons' recipe, and the exact
//! `memattn launch` and `memattn trace` commands for it, from its launch spec.

use crate::lesson::compile;
use crate::paths;
use ptx_vm::Module;
use std::path::PathBuf;

/// The scratch crates' folder (ignored by git: `lessons/scratch/.gitignore`).
pub(crate) fn dir(name: &str) -> PathBuf {
    paths::root().join("lessons/scratch").join(name)
}

/// Where `build` writes the PTX of scratch kernel `name`.
fn ptx_path(name: &str) -> PathBuf {
    paths::root().join("target/lessons").join(format!("{name}.ptx"))
}

/// A crate name that is also the kernel's entry point: a Rust identifier in lower case.
/// Rust's keywords (strict and reserved, every edition) and the names of the crates a kernel
/// build links or that cargo keeps: the kernel's `#[no_mangle] fn NAME` or its package could
/// not be called so.
const RESERVED_NAMES: &[&str] = &[
    "as",
    "async",
    "await",
    "break",
    "const",
    "continue",
    "crate",
    "dyn",
    "else",
    "enum",
    "extern",
    "false",
    "fn",
    "for",
    "gen",
    "if",
    "impl",
    "in",
    "let",
    "loop",
    "match",
    "mod",
    "move",
    "mut",
    "pub",
    "ref",
    "return",
    "self",
    "static",
    "struct",
    "super",
    "trait",
    "true",
    "try",
    "type",
    "unsafe",
    "use",
    "where",
    "while",
    "abstract",
    "become",
    "box",
    "do",
    "final",
    "macro",
    "override",
    "priv",
    "typeof",
    "unsized",
    "virtual",
    "yield",
    "union",
    "core",
    "std",
    "alloc",
    "test",
    "proc_macro",
    "build",
];

pub(crate) fn check_name(name: &str) -> Result<(), String> {
    let ok = name.len() <= 64
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !ok {
        return Err(format!(
            "`{name}` cannot name a kernel: use lower-case letters, digits and `_`, starting with a letter (e.g. `my_scale`)"
        ));
    }
    if RESERVED_NAMES.contains(&name) {
        return Err(format!(
            "`{name}` cannot name a kernel: it is a Rust keyword or a crate's name, which a function or package cannot take (e.g. `my_{name}`)"
        ));
    }
    Ok(())
}

fn manifest(name: &str) -> String {
    format!(
        r#"# A scratch kernel of your own: `cargo xtask lesson build {name}` compiles it to PTX.
[package]
name = "{name}"
version = "0.1.0"
edition = "2021"
publish = false

[lib]
path = "kernel.rs"

[dependencies]
# The lessons' GPU helpers (`tid_x()`, `sync_threads()`, `shfl_xor()`, ...) and panic handler.
memattn-lessons = {{ path = "../.." }}

# The lessons' kernel profile: one codegen unit and fat LTO fold libcore into the PTX.
[profile.ptx]
inherits = "release"
panic = "abort"
lto = "fat"
codegen-units = 1
opt-level = 3
debug = false

# Its own workspace: the scratch crate is not part of the project's.
[workspace]
"#
    )
}

fn kernel(name: &str) -> String {
    format!(
        r#"//! `{name}`: your own kernel, a starting point to change. As written it computes
//! `y[i] = a * x[i] + 1` for `i < n`, one thread per element.
//!
//! Launched as `launch.txt` says (`cargo xtask lesson build {name}` prints the commands): change
//! the kernel and the launch spec together.
#![no_std]
#![feature(abi_ptx)]

use memattn_lessons::gpu::*;

/// # Safety
/// `x` and `y` must point to at least `n` f32s in device memory.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn {name}(n: u32, a: f32, x: *const f32, y: *mut f32) {{
    let i = ctaid_x() * ntid_x() + tid_x();
    if i < n {{
        let v = unsafe {{ *x.add(i as usize) }};
        unsafe {{ *y.add(i as usize) = a * v + 1.0 }};
    }}
}}
"#
    )
}

/// The f64 reference of the kernel as `new` writes it, for `lesson check-scratch NAME`.
fn reference(name: &str) -> String {
    format!(
        r#"//! What `{name}` should compute, in plain Rust over f64: `cargo xtask lesson check-scratch {name}`
//! runs the kernel in the VM and this function on the same inputs, and compares every element.
//!
//! The parameters are the arguments of `launch.txt`, in order: a number as its own type (`u32`,
//! `i32`, `f32`, `u64`), an input buffer (one with an INIT) as `&[f64]` holding exactly the values
//! the kernel gets, an output buffer (no INIT) as `&mut [f64]` to fill. Change it with the kernel.

pub fn reference(n: u32, a: f32, x: &[f64], y: &mut [f64]) {{
    for i in 0..n as usize {{
        y[i] = a as f64 * x[i] + 1.0;
    }}
}}
"#
    )
}

const LAUNCH: &str = "\
# How to launch the kernel: `cargo xtask lesson build NAME` reads this to print the
# `memattn launch` and `memattn trace` commands. One `key = value` a line:
#   grid, block   sizes x[,y[,z]]          smem   dynamic shared memory in bytes
#   buf           NAME=TYPE:LEN[:INIT], repeatable (as `memattn launch --buf`)
#   arg           TYPE=VALUE in the kernel's parameter order, repeatable (`--arg`)
#   show          the buffer to print        trace  the traced block and thread, `B T`
grid = 4
block = 256
smem = 0
buf = x=f32:1000:iota
buf = y=f32:1000
arg = u32=1000
arg = f32=2
arg = buf=x
arg = buf=y
show = y
trace = 0 5
";

/// The launch spec of `launch.txt`.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Spec {
    pub(crate) grid: String,
    pub(crate) block: String,
    pub(crate) smem: u32,
    pub(crate) bufs: Vec<String>,
    pub(crate) args: Vec<String>,
    pub(crate) show: Option<String>,
    pub(crate) trace: (String, String),
}

pub(crate) fn parse_spec(text: &str) -> Result<Spec, String> {
    let mut s = Spec { grid: "1".into(), block: "1".into(), trace: ("0".into(), "0".into()), ..Spec::default() };
    for (i, line) in text.lines().enumerate() {
        let t = line.split('#').next().unwrap_or("").trim();
        if t.is_empty() {
            continue;
        }
        let bad = |why: &str| format!("launch.txt line {}: {why} (`{t}`)", i + 1);
        let (k, v) = t.split_once('=').ok_or_else(|| bad("expected `key = value`"))?;
        let v = v.trim().to_string();
        if v.contains(char::is_whitespace) && k.trim() != "trace" {
            return Err(bad("the value has a space"));
        }
        match k.trim() {
            "grid" => s.grid = v,
            "block" => s.block = v,
            "smem" => s.smem = v.parse().map_err(|_| bad("smem is a number of bytes"))?,
            "buf" => s.bufs.push(v),
            "arg" => s.args.push(v),
            "show" => s.show = Some(v),
            "trace" => {
                let mut w = v.split_whitespace();
                match (w.next(), w.next(), w.next()) {
                    (Some(b), Some(th), None) => s.trace = (b.to_string(), th.to_string()),
                    _ => return Err(bad("trace is `BLOCK THREAD`, e.g. `0 5`")),
                }
            }
            other => return Err(bad(&format!("unknown key `{other}`"))),
        }
    }
    Ok(s)
}

/// The `memattn` commands for scratch kernel `name` launched as `spec` says.
fn commands(name: &str, spec: &Spec) -> [String; 2] {
    let ptx = format!("target/lessons/{name}.ptx");
    let mut io = String::new();
    for b in &spec.bufs {
        io.push_str(&format!(" --buf {b}"));
    }
    for a in &spec.args {
        io.push_str(&format!(" --arg {a}"));
    }
    let smem = if spec.smem > 0 { format!(" --smem {}", spec.smem) } else { String::new() };
    let show = spec.show.as_ref().map(|s| format!(" --show {s} --count 4")).unwrap_or_default();
    [
        format!("memattn launch --ptx {ptx} {name} --grid {} --block {}{smem}{io}{show}", spec.grid, spec.block),
        format!(
            "memattn trace --ptx {ptx} --entry {name} --grid {} --block-dim {}{smem}{io} --block {} --thread {}",
            spec.grid, spec.block, spec.trace.0, spec.trace.1
        ),
    ]
}

/// `lesson new NAME`: writes the crate (an existing one is left as it is) and says what next.
pub fn new(name: &str) -> i32 {
    if let Err(e) = check_name(name) {
        eprintln!("error: {e}");
        return 2;
    }
    let d = dir(name);
    println!("scratch kernel `{name}` in {}/", paths::rel(&d));
    if d.join("kernel.rs").exists() {
        println!("  it exists already: left as it is");
    } else {
        let write = || -> std::io::Result<()> {
            std::fs::create_dir_all(&d)?;
            std::fs::write(d.join("Cargo.toml"), manifest(name))?;
            std::fs::write(d.join("kernel.rs"), kernel(name))?;
            std::fs::write(d.join("launch.txt"), LAUNCH)?;
            std::fs::write(d.join("reference.rs"), reference(name))?;
            Ok(())
        };
        if let Err(e) = write() {
            eprintln!("error: cannot write {}: {e}", paths::rel(&d));
            return 3;
        }
        println!(
            "  created Cargo.toml, kernel.rs (the entry `{name}`), launch.txt (how to launch it) and reference.rs (what it should compute)"
        );
    }
    println!("next:");
    println!("  cargo xtask lesson build {name}");
    println!("  (it prints the `memattn launch` and `memattn trace` commands for {})", ptx_rel(name));
    println!("  cargo xtask lesson check-scratch {name}");
    println!("  (it runs the kernel and reference.rs on the same inputs and compares every element)");
    0
}

pub(crate) fn ptx_rel(name: &str) -> String {
    paths::rel(&ptx_path(name))
}

/// A scratch kernel built: its launch spec, its PTX loaded in the VM, and how long the build took.
pub(crate) struct Built {
    pub(crate) spec: Spec,
    pub(crate) module: Module,
    pub(crate) seconds: f64,
}

/// Compiles scratch kernel `name` with the lessons' recipe and loads its PTX in the VM. The error
/// is the exit code (2: bad usage or input, 3: the kernel did not build) and what went wrong.
pub(crate) fn build_module(name: &str) -> Result<Built, (i32, String)> {
    check_name(name).map_err(|e| (2, e))?;
    let d = dir(name);
    let manifest = d.join("Cargo.toml");
    if !manifest.exists() {
        return Err((
            2,
            format!(
                "no scratch kernel `{name}` ({} is missing); make one with: cargo xtask lesson new {name}",
                paths::rel(&manifest)
            ),
        ));
    }
    let spec = std::fs::read_to_string(d.join("launch.txt"))
        .map_err(|e| format!("{}/launch.txt: {e}", paths::rel(&d)))
        .and_then(|t| parse_spec(&t))
        .map_err(|e| (2, e))?;
    let out = ptx_path(name);
    let t0 = std::time::Instant::now();
    let m = manifest.display().to_string();
    let ptx = compile(&["--manifest-path", &m], &out).map_err(|e| (3, e))?;
    let module = Module::load(&ptx).map_err(|e| (3, format!("the VM cannot load {}: {e}", ptx_rel(name))))?;
    if module.kernel_info(name).is_err() {
        return Err((
            3,
            format!(
                "{} has no entry `{name}`: keep `#[no_mangle] pub unsafe extern \"ptx-kernel\" fn {name}` in kernel.rs",
                ptx_rel(name)
            ),
        ));
    }
    Ok(Built { spec, module, seconds: t0.elapsed().as_secs_f64() })
}

/// `lesson build NAME`: compiles the scratch crate with the lessons' recipe, loads the PTX in the
/// VM, and prints the launch and trace commands of its launch spec.
pub fn build(name: &str) -> i32 {
    let built = match build_module(name) {
        Ok(b) => b,
        Err((code, e)) => {
            eprintln!("error: {e}");
            return code;
        }
    };
    println!("built {} in {:.1} s", ptx_rel(name), built.seconds);
    let [launch, trace] = commands(name, &built.spec);
    println!("launch it:\n  {launch}");
    println!("trace one thread, with the Rust lines:\n  {trace}");
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_launch_spec_gives_the_commands_and_bad_lines_are_named() {
        let s = parse_spec(LAUNCH).unwrap();
        let [launch, trace] = commands("my_scale", &s);
        assert_eq!(
            launch,
            "memattn launch --ptx target/lessons/my_scale.ptx my_scale --grid 4 --block 256 --buf x=f32:1000:iota \
             --buf y=f32:1000 --arg u32=1000 --arg f32=2 --arg buf=x --arg buf=y --show y --count 4"
        );
        assert_eq!(
            trace,
            "memattn trace --ptx target/lessons/my_scale.ptx --entry my_scale --grid 4 --block-dim 256 --buf x=f32:1000:iota \
             --buf y=f32:1000 --arg u32=1000 --arg f32=2 --arg buf=x --arg buf=y --block 0 --thread 5"
        );
        assert!(parse_spec("grid = 4\nblok = 2\n").unwrap_err().contains("line 2: unknown key `blok`"));
        assert!(parse_spec("trace = 1\n").unwrap_err().contains("BLOCK THREAD"));
        assert!(parse_spec("smem = lots\n").unwrap_err().contains("number of bytes"));
    }

    #[test]
    fn names_are_identifiers() {
        assert!(check_name("my_scale2").is_ok());
        for bad in ["", "My", "2x", "a-b", "../x", "a b", "fn", "struct", "self", "core", "try"] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
        assert!(check_name("fn").unwrap_err().contains("keyword"));
        assert!(check_name("fn_scale").is_ok());
    }

    /// `lesson new` then `lesson build`: the scratch crate builds with the lessons' recipe, has
    /// Rust lines, and its launch spec runs in the VM. Needs the kernel toolchain.
    #[test]
    fn a_new_scratch_kernel_builds_and_runs_as_its_spec_says() {
        if let Err(e) = crate::toolchain::ensure() {
            eprintln!("SKIPPED: the scratch kernel is not built without the kernel toolchain: {e}");
            return;
        }
        let name = format!("xtask_test_{}", std::process::id());
        assert_eq!(new(&name), 0);
        assert_eq!(build(&name), 0);
        let ptx = std::fs::read_to_string(ptx_path(&name)).unwrap();
        let m = Module::load(&ptx).unwrap();
        assert!(m.has_line_info());
        let mut l = ptx_vm::run::Launcher::new(&m);
        l.input_f32("x", &[1.0, 2.0, 3.0]).unwrap();
        l.output_f32("y", 3).unwrap();
        use ptx_vm::run::Arg;
        l.launch(&name, [1, 1, 1], [32, 1, 1], 0, &[Arg::U32(3), Arg::F32(2.0), Arg::buf("x"), Arg::buf("y")]).unwrap();
        assert_eq!(l.read_f32("y").unwrap(), vec![3.0, 5.0, 7.0]);
        let _ = std::fs::remove_dir_all(dir(&name));
        let _ = std::fs::remove_file(ptx_path(&name));
    }
}
