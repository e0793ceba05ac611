//! `cargo xtask lesson check-scratch NAME [--reference FILE] [--tol T]`: a scratch kernel of
//! `lesson new NAME` checked against a reference, without a host crate of your own.
//!
//! The launch is `launch.txt`'s. A buffer with an INIT is an input: the check fills it with its
//! own values (from a fixed seed, `0.25 <= |v| < 2`, never 0, so a kernel that ignores an input
//! or multiplies by a zero cannot pass by luck). A buffer without one is an output: the VM fills it
//! with the poison NaN `0x7FF00BAD` before the launch, so an element the kernel never writes fails.
//! The reference is either
//! - a Rust file (`reference.rs`, which `lesson new` writes) with `pub fn reference(...)` taking
//!   `launch.txt`'s arguments in order: numbers as their own type, input buffers as `&[f64]`,
//!   output buffers as `&mut [f64]`; it is compiled with `rustc` and run on the same inputs; or
//! - a `.safetensors` file with one tensor per buffer, named as in `launch.txt`: the inputs (F32,
//!   given to the kernel as they are) and the expected outputs (F32 or F64).
//!
//! Every output element must satisfy `|got - expected| <= tol * max(1, |expected|)` ([`DEFAULT_TOL`]
//! unless `--tol`); an infinite or NaN expected value must be matched exactly. Exit codes: 0 every
//! element matches, 1 a mismatch, 2 bad usage or input, 3 the kernel did not build or the VM
//! stopped it.

use crate::lesson::{german, launch, ranges, tr, vm_launcher, Out};
use crate::paths;
use crate::scratch::{self, Spec};
use ptx_vm::run::{Arg, OUTPUT_POISON};
use std::path::{Path, PathBuf};

/// The default tolerance, relative to max(1, |expected|): f32 keeps about 7 decimal digits, and
/// 1e-5 leaves room for the rounding of a few dozen f32 operations per element. A kernel that sums
/// many terms may need `--tol` (its error grows with the number of terms).
pub const DEFAULT_TOL: f64 = 1e-5;

/// How many mismatching elements the report lists.
const SHOWN: usize = 5;

/// One buffer of `launch.txt` (`NAME=f32:LEN[:INIT]`).
#[derive(Debug, Clone, PartialEq)]
struct Buf {
    name: String,
    len: usize,
    /// No INIT (or `poison`): the kernel writes it and the check compares it.
    output: bool,
}

fn parse_buf(s: &str) -> Result<Buf, String> {
    let bad = |why: String| tr!("launch.txt: buf = {}: {}", "launch.txt: buf = {}: {}", s, why);
    let (name, rest) =
        s.split_once('=').ok_or_else(|| bad(tr!("expected NAME=TYPE:LEN[:INIT]", "erwartet NAME=TYP:LÄNGE[:INIT]")))?;
    let mut parts = rest.splitn(3, ':');
    let ty = parts.next().unwrap_or("");
    if ty != "f32" {
        return Err(bad(tr!(
            "check-scratch compares f32 buffers only, and `{}` is {}",
            "check-scratch vergleicht nur f32-Puffer, und `{}` ist {}",
            name,
            ty
        )));
    }
    let len: usize = parts
        .next()
        .unwrap_or("")
        .parse()
        .ok()
        .filter(|&n| n > 0 && n <= 1 << 24)
        .ok_or_else(|| bad(tr!("the length must be 1..=2^24 elements", "die Länge muss 1..=2^24 Elemente sein")))?;
    let init = parts.next().unwrap_or("poison");
    Ok(Buf { name: name.to_string(), len, output: init == "poison" })
}

/// `4` or `4,2` (or `4,2,1`) as three dimensions.
fn dims(what: &str, s: &str) -> Result<[u32; 3], String> {
    let v: Vec<Option<u32>> = s.split(',').map(|x| x.trim().parse().ok().filter(|&n| n > 0)).collect();
    match v.as_slice() {
        [Some(x)] => Ok([*x, 1, 1]),
        [Some(x), Some(y)] => Ok([*x, *y, 1]),
        [Some(x), Some(y), Some(z)] => Ok([*x, *y, *z]),
        _ => Err(tr!(
            "launch.txt: {} = {}: expected one to three sizes of at least 1, e.g. `4` or `4,2`",
            "launch.txt: {} = {}: erwartet ein bis drei Größen von mindestens 1, z. B. `4` oder `4,2`",
            what,
            s
        )),
    }
}

/// `launch.txt`'s arguments (`TYPE=VALUE`), checked against its buffers.
fn parse_args(spec: &Spec, bufs: &[Buf]) -> Result<Vec<Arg>, String> {
    spec.args
        .iter()
        .map(|s| {
            let bad = || {
                tr!(
                    "launch.txt: arg = {}: expected TYPE=VALUE with TYPE u32, i32, f32, u64 or buf (a buffer's name)",
                    "launch.txt: arg = {}: erwartet TYP=WERT mit TYP u32, i32, f32, u64 oder buf (der Name eines Puffers)",
                    s
                )
            };
            let (ty, v) = s.split_once('=').ok_or_else(bad)?;
            Ok(match ty {
                "u32" => Arg::U32(v.parse().map_err(|_| bad())?),
                "i32" => Arg::I32(v.parse().map_err(|_| bad())?),
                "f32" => Arg::F32(v.parse().map_err(|_| bad())?),
                "u64" => Arg::U64(v.parse().map_err(|_| bad())?),
                "buf" if bufs.iter().any(|b| b.name == v) => Arg::buf(v),
                "buf" => {
                    return Err(tr!(
                        "launch.txt: arg = {}: no buffer `{}` (the buffers: {})",
                        "launch.txt: arg = {}: kein Puffer `{}` (die Puffer: {})",
                        s,
                        v,
                        names(bufs.iter())
                    ))
                }
                _ => return Err(bad()),
            })
        })
        .collect()
}

fn names<'a>(bufs: impl Iterator<Item = &'a Buf>) -> String {
    bufs.map(|b| b.name.as_str()).collect::<Vec<_>>().join(", ")
}

/// Input `k`'s values: deterministic (a 64-bit LCG seeded by the buffer's position), of either
/// sign, `0.25 <= |v| < 2`: never 0 and never tiny, so every input matters to the output.
fn input_values(k: usize, len: usize) -> Vec<f32> {
    let mut s = 0x5EED_0000_u64 + k as u64;
    let mut next = move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..len)
        .map(|_| {
            let m = 0.25 + 1.75 * next();
            (if next() < 0.5 { -m } else { m }) as f32
        })
        .collect()
}

/// What the reference says: for each output buffer, the expected values; and the inputs the
/// kernel runs on.
struct Expected {
    inputs: Vec<(String, Vec<f32>)>,
    outputs: Vec<(String, Vec<f64>)>,
}

/// The signature the Rust reference must have for this launch.
fn signature(args: &[Arg], bufs: &[Buf]) -> String {
    let params: Vec<String> = args
        .iter()
        .enumerate()
        .map(|(i, a)| match a {
            Arg::U32(_) => format!("arg{i}: u32"),
            Arg::I32(_) => format!("arg{i}: i32"),
            Arg::F32(_) => format!("arg{i}: f32"),
            Arg::U64(_) => format!("arg{i}: u64"),
            Arg::Buf(n) if bufs.iter().any(|b| &b.name == n && b.output) => format!("{n}: &mut [f64]"),
            Arg::Buf(n) => format!("{n}: &[f64]"),
            Arg::Bytes(_) => unreachable!("launch.txt passes no raw bytes"),
        })
        .collect();
    format!("pub fn reference({})", params.join(", "))
}

/// The program that runs a Rust reference: reads the inputs (f64, in buffer order) from the file
/// named by its first argument, calls `reference`, writes the outputs to the second.
fn runner_source(file: &Path, args: &[Arg], bufs: &[Buf]) -> String {
    let mut s = String::from("#![allow(warnings)]\n");
    s.push_str(&format!("#[path = {:?}]\nmod reference;\n\n", file.display().to_string()));
    s.push_str("fn main() {\n    let a: Vec<String> = std::env::args().collect();\n");
    s.push_str("    let raw = std::fs::read(&a[1]).unwrap();\n");
    s.push_str("    let mut v = raw.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap()));\n");
    for (k, b) in bufs.iter().enumerate() {
        if b.output {
            s.push_str(&format!("    let mut b{k}: Vec<f64> = vec![f64::NAN; {}];\n", b.len));
        } else {
            s.push_str(&format!("    let b{k}: Vec<f64> = (&mut v).take({}).collect();\n", b.len));
        }
    }
    let call: Vec<String> = args
        .iter()
        .map(|a| match a {
            Arg::U32(x) => format!("{x}u32"),
            Arg::I32(x) => format!("({x}i32)"),
            Arg::F32(x) => format!("f32::from_bits({:#x})", x.to_bits()),
            Arg::U64(x) => format!("{x}u64"),
            Arg::Buf(n) => {
                let k = bufs.iter().position(|b| &b.name == n).unwrap_or(0);
                if bufs[k].output {
                    format!("&mut b{k}[..]")
                } else {
                    format!("&b{k}[..]")
                }
            }
            Arg::Bytes(_) => unreachable!("launch.txt passes no raw bytes"),
        })
        .collect();
    s.push_str(&format!("    reference::reference({});\n", call.join(", ")));
    s.push_str("    let mut out: Vec<u8> = Vec::new();\n");
    for (k, _) in bufs.iter().enumerate().filter(|(_, b)| b.output) {
        s.push_str(&format!("    for x in &b{k} {{ out.extend_from_slice(&x.to_le_bytes()); }}\n"));
    }
    s.push_str("    std::fs::write(&a[2], out).unwrap();\n}\n");
    s
}

/// Compiles and runs the Rust reference `file` on generated inputs.
fn rust_reference(name: &str, file: &Path, args: &[Arg], bufs: &[Buf]) -> Result<Expected, String> {
    let work = paths::root().join("target/lessons/check-scratch").join(name);
    std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", paths::rel(&work)))?;
    let abs = std::fs::canonicalize(file).map_err(|e| format!("{}: {e}", file.display()))?;
    std::fs::write(work.join("main.rs"), runner_source(&abs, args, bufs)).map_err(|e| e.to_string())?;
    let exe = work.join("reference");
    let sig = signature(args, bufs);
    let status = std::process::Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()))
        .current_dir(&work)
        .args(["--edition", "2021", "--crate-name", "reference_runner", "-C", "debuginfo=0", "-o"])
        .arg(&exe)
        .arg("main.rs")
        .status()
        .map_err(|e| tr!("cannot run rustc: {}", "rustc lässt sich nicht starten: {}", e))?;
    if !status.success() {
        return Err(tr!(
            "the reference {} does not compile (rustc's message is above); for this launch.txt it must define `{}`",
            "die Referenz {} lässt sich nicht übersetzen (die Meldung von rustc steht oben); für diese launch.txt muss sie `{}` definieren",
            file.display(),
            sig
        ));
    }
    let mut inputs = Vec::new();
    let mut raw = Vec::new();
    for (k, b) in bufs.iter().enumerate().filter(|(_, b)| !b.output) {
        let v = input_values(k, b.len);
        raw.extend(v.iter().flat_map(|&x| (x as f64).to_le_bytes()));
        inputs.push((b.name.clone(), v));
    }
    let (inp, outp) = (work.join("inputs.bin"), work.join("outputs.bin"));
    std::fs::write(&inp, raw).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_file(&outp);
    let status = std::process::Command::new(&exe)
        .env("RUST_BACKTRACE", "0")
        .arg(&inp)
        .arg(&outp)
        .status()
        .map_err(|e| format!("{}: {e}", paths::rel(&exe)))?;
    if !status.success() {
        return Err(tr!(
            "the reference {} stopped before it finished (its message is above: an index out of range?)",
            "die Referenz {} hat vor dem Ende angehalten (ihre Meldung steht oben: ein Index außerhalb des Bereichs?)",
            file.display()
        ));
    }
    let bytes = std::fs::read(&outp).map_err(|e| e.to_string())?;
    let want: usize = bufs.iter().filter(|b| b.output).map(|b| b.len * 8).sum();
    if bytes.len() != want {
        return Err(format!("the reference's runner wrote {} bytes of outputs, not {want}", bytes.len()));
    }
    let mut vals = bytes.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])));
    let outputs =
        bufs.iter().filter(|b| b.output).map(|b| (b.name.clone(), (&mut vals).take(b.len).collect())).collect();
    Ok(Expected { inputs, outputs })
}

/// Reads inputs and expected outputs from a safetensors file: one tensor per buffer, named as the
/// buffer, with as many elements as the buffer.
fn safetensors_reference(file: &Path, bufs: &[Buf]) -> Result<Expected, String> {
    use safetensors::{Dtype, SafeTensors};
    let bytes = std::fs::read(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| {
        tr!("{} is not a valid safetensors file: {}", "{} ist keine gültige safetensors-Datei: {}", file.display(), e)
    })?;
    let mut found: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    found.sort();
    let (mut inputs, mut outputs) = (Vec::new(), Vec::new());
    for b in bufs {
        let t = st.tensor(&b.name).map_err(|_| {
            tr!(
                "{} has no tensor `{}` ({} of launch.txt; the file holds: {})",
                "{} hat keinen Tensor `{}` ({} aus launch.txt; die Datei enthält: {})",
                file.display(),
                b.name,
                if b.output { tr!("an output", "eine Ausgabe") } else { tr!("an input", "eine Eingabe") },
                found.join(", ")
            )
        })?;
        let n: usize = t.shape().iter().product();
        if n != b.len {
            return Err(tr!(
                "{}: tensor `{}` has shape {:?} ({} elements), but launch.txt's buffer `{}` has {}",
                "{}: Tensor `{}` hat die Form {:?} ({} Elemente), aber der Puffer `{}` in launch.txt hat {}",
                file.display(),
                b.name,
                t.shape(),
                n,
                b.name,
                b.len
            ));
        }
        let data = t.data();
        match (t.dtype(), b.output) {
            (Dtype::F32, false) => inputs.push((
                b.name.clone(),
                data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            )),
            (Dtype::F32, true) => outputs.push((
                b.name.clone(),
                data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64).collect(),
            )),
            (Dtype::F64, true) => outputs.push((
                b.name.clone(),
                data.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect(),
            )),
            (d, out) => {
                return Err(tr!(
                    "{}: tensor `{}` is {:?}; an input must be F32, an expected output F32 or F64 (`{}` is {})",
                    "{}: Tensor `{}` ist {:?}; eine Eingabe muss F32 sein, eine erwartete Ausgabe F32 oder F64 (`{}` ist {})",
                    file.display(),
                    b.name,
                    d,
                    b.name,
                    if out { tr!("an output", "eine Ausgabe") } else { tr!("an input", "eine Eingabe") }
                ))
            }
        }
    }
    Ok(Expected { inputs, outputs })
}

/// What is wrong with one output buffer.
#[derive(Debug, Default)]
struct Compared {
    unwritten: Vec<usize>,
    non_finite: Vec<usize>,
    wrong: Vec<usize>,
    /// The first mismatching elements: (index, got, expected).
    first: Vec<(usize, f32, f64)>,
    max_err: f64,
}

impl Compared {
    fn bad(&self) -> usize {
        self.unwritten.len() + self.non_finite.len() + self.wrong.len()
    }
}

/// Compares element by element: `|got - want| <= tol * max(1, |want|)`; a NaN or infinite `want`
/// must be matched exactly; the poison is never a match.
fn compare(got: &[f32], want: &[f64], tol: f64) -> Compared {
    let mut c = Compared::default();
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if g.to_bits() == OUTPUT_POISON {
            c.unwritten.push(i);
            false
        } else if w.is_nan() {
            g.is_nan() || {
                c.wrong.push(i);
                false
            }
        } else if w.is_infinite() {
            g as f64 == w || {
                c.wrong.push(i);
                false
            }
        } else if !g.is_finite() {
            c.non_finite.push(i);
            false
        } else {
            let e = (g as f64 - w).abs() / w.abs().max(1.0);
            c.max_err = c.max_err.max(e);
            e <= tol || {
                c.wrong.push(i);
                false
            }
        };
        if !ok && c.first.len() < SHOWN {
            c.first.push((i, g, w));
        }
    }
    c
}

fn show_got(g: f32) -> String {
    if g.to_bits() == OUTPUT_POISON {
        tr!("the poison 0x{:08X} (never written)", "das Poison 0x{:08X} (nie geschrieben)", OUTPUT_POISON)
    } else {
        format!("{g}")
    }
}

/// What to look at, from the kind of mismatch in buffer `name` of `len` elements launched with
/// `threads` threads in all.
fn hint(name: &str, len: usize, threads: u64, c: &Compared) -> String {
    if c.unwritten.len() == len {
        return tr!(
            "`{}` was never written: does the kernel store into the parameter that launch.txt passes as `{}`, and do its threads reach the store?",
            "`{}` wurde nie geschrieben: speichert der Kernel in den Parameter, den launch.txt als `{}` übergibt, und erreichen seine Threads das Speichern?",
            name,
            name
        );
    }
    if !c.unwritten.is_empty() {
        if threads < len as u64 {
            return tr!(
                "no thread stored those elements: the launch has {} threads (grid x block) for {} elements - enlarge the grid in launch.txt, or let each thread handle several elements",
                "kein Thread hat diese Elemente gespeichert: der Start hat {} Threads (Grid x Block) für {} Elemente - vergrößern Sie das Grid in launch.txt, oder lassen Sie jeden Thread mehrere Elemente bearbeiten",
                threads,
                len
            );
        }
        return tr!(
            "no thread stored those elements: is the bounds guard too strict (`<` against the right length), or is the index computed with the wrong block size?",
            "kein Thread hat diese Elemente gespeichert: ist die Bereichsprüfung zu streng (`<` gegen die richtige Länge), oder wird der Index mit der falschen Blockgröße berechnet?"
        );
    }
    if !c.non_finite.is_empty() {
        return tr!(
            "NaN or infinity where the reference is finite: a division by zero, an `exp` that overflows, or a value used before it was set",
            "NaN oder unendlich, wo die Referenz endlich ist: eine Division durch null, ein `exp`, das überläuft, oder ein Wert, der benutzt wird, bevor er gesetzt ist"
        );
    }
    if c.wrong.len() == len {
        return tr!(
            "every element differs: the kernel and the reference compute different things - follow both by hand on the first element above",
            "jedes Element weicht ab: Kernel und Referenz berechnen Verschiedenes - rechnen Sie beide am ersten Element oben von Hand nach"
        );
    }
    tr!(
        "only some elements differ: what sets them apart (the last block, the edge of a tile, a stride)? If the errors are rounding (a long sum), --tol accepts a larger tolerance",
        "nur einige Elemente weichen ab: was unterscheidet sie (der letzte Block, der Rand einer Kachel, eine Schrittweite)? Sind die Abweichungen Rundung (eine lange Summe), erlaubt --tol eine größere Toleranz"
    )
}

/// The reference: `--reference FILE`, or `lessons/scratch/NAME/reference.rs`.
fn reference_file(name: &str, given: Option<&str>) -> Result<PathBuf, String> {
    // A path as the learner typed it: from the current folder, or else from the repository's root.
    let file = match given.map(PathBuf::from) {
        Some(f) if f.is_absolute() || f.exists() => f,
        Some(f) => paths::root().join(f),
        None => scratch::dir(name).join("reference.rs"),
    };
    let kind = file.extension().and_then(|e| e.to_str()).unwrap_or("");
    if kind != "rs" && kind != "safetensors" {
        return Err(tr!(
            "--reference {}: the reference is a Rust file (`.rs`, with `pub fn reference`) or a `.safetensors` file",
            "--reference {}: die Referenz ist eine Rust-Datei (`.rs`, mit `pub fn reference`) oder eine `.safetensors`-Datei",
            paths::rel(&file)
        ));
    }
    if !file.is_file() {
        return Err(tr!(
            "no reference {} (the file does not exist; `lesson new` writes reference.rs, `--reference FILE` names another)",
            "keine Referenz {} (die Datei existiert nicht; `lesson new` legt reference.rs an, `--reference FILE` nennt eine andere)",
            paths::rel(&file)
        ));
    }
    Ok(file)
}

/// Builds scratch kernel `name`, runs it as `launch.txt` says on the reference's inputs and
/// compares every output element. `Ok` is the exit code of a check that ran (0 or 1; 3 for a VM
/// finding), the report said in `out`; `Err` is bad input or a failed build (exit code, reason).
fn check(name: &str, reference: Option<&str>, tol: f64, out: &mut Out) -> Result<i32, (i32, String)> {
    let bad = |e: String| (2, e);
    scratch::check_name(name).map_err(bad)?;
    if !scratch::dir(name).join("Cargo.toml").exists() {
        return Err(bad(tr!(
            "no scratch kernel `{}` ({}/Cargo.toml is missing); make one with: cargo xtask lesson new {}",
            "kein Scratch-Kernel `{}` ({}/Cargo.toml fehlt); legen Sie einen an mit: cargo xtask lesson new {}",
            name,
            paths::rel(&scratch::dir(name)),
            name
        )));
    }
    let file = reference_file(name, reference).map_err(bad)?;
    let built = scratch::build_module(name)?;
    let spec = &built.spec;
    let bufs: Vec<Buf> = spec.bufs.iter().map(|s| parse_buf(s)).collect::<Result<_, _>>().map_err(bad)?;
    let outputs: Vec<&Buf> = bufs.iter().filter(|b| b.output).collect();
    if outputs.is_empty() {
        return Err(bad(tr!(
            "launch.txt has no output buffer (a `buf` without INIT, e.g. `buf = y=f32:1000`): there is nothing to compare",
            "launch.txt hat keinen Ausgabepuffer (ein `buf` ohne INIT, z. B. `buf = y=f32:1000`): es gibt nichts zu vergleichen"
        )));
    }
    let grid = dims("grid", &spec.grid).map_err(bad)?;
    let block = dims("block", &spec.block).map_err(bad)?;
    let args = parse_args(spec, &bufs).map_err(bad)?;
    let rel = paths::rel(&file);
    let expected = if file.extension().is_some_and(|e| e == "safetensors") {
        safetensors_reference(&file, &bufs)
    } else {
        rust_reference(name, &file, &args, &bufs)
    }
    .map_err(bad)?;

    out.src = Some(PathBuf::from(paths::rel(&scratch::dir(name).join("kernel.rs"))));
    out.say(tr!(
        "check-scratch {}: {} against {} (built in {:.1} s)",
        "check-scratch {}: {} gegen {} (gebaut in {:.1} s)",
        name,
        scratch::ptx_rel(name),
        rel,
        built.seconds
    ));
    let origin = if file.extension().is_some_and(|e| e == "safetensors") {
        tr!("values from the file", "Werte aus der Datei")
    } else {
        tr!("values from a fixed seed, 0.25 <= |v| < 2", "Werte aus einem festen Seed, 0.25 <= |v| < 2")
    };
    let ins: Vec<String> = expected.inputs.iter().map(|(n, v)| format!("{n} ({} f32)", v.len())).collect();
    if !ins.is_empty() {
        out.say(tr!("  inputs: {}, {}", "  Eingaben: {}, {}", ins.join(", "), origin));
    }
    let outs: Vec<String> = outputs.iter().map(|b| format!("{} ({} f32)", b.name, b.len)).collect();
    out.say(tr!(
        "  outputs: {}, filled with the poison NaN 0x{:08X} before the launch",
        "  Ausgaben: {}, vor dem Start mit dem Poison-NaN 0x{:08X} gefüllt",
        outs.join(", "),
        OUTPUT_POISON
    ));
    let mut l = vm_launcher(&built.module);
    let setup = |r: Result<_, ptx_vm::VmError>| r.map(|_| ()).map_err(|e| (3, e.to_string()));
    for (n, v) in &expected.inputs {
        setup(l.input_f32(n, v))?;
    }
    for b in &outputs {
        setup(l.output_f32(&b.name, b.len))?;
    }
    out.say(tr!(
        "  launch: grid {:?}, block {:?}, {} bytes of dynamic shared memory (launch.txt)",
        "  Start: Grid {:?}, Block {:?}, {} Byte dynamischer Shared Memory (launch.txt)",
        grid,
        block,
        spec.smem
    ));
    if launch(&mut l, out, name, grid, block, spec.smem, &args).is_err() {
        out.say(tr!(
            "result: NOT PASSED - the VM stopped the kernel (exit 3); edit {} and run the check again",
            "Ergebnis: NICHT BESTANDEN - die VM hat den Kernel angehalten (Exit 3); ändern Sie {} und starten Sie die Prüfung erneut",
            out.src.as_ref().map(|p| p.display().to_string()).unwrap_or_default()
        ));
        return Ok(3);
    }
    let threads: u64 = grid.iter().chain(&block).map(|&d| d as u64).product();
    let mut failed = Vec::new();
    for (bname, want) in &expected.outputs {
        let got = l.read_f32(bname).map_err(|e| (3, e.to_string()))?;
        let c = compare(&got, want, tol);
        if c.bad() == 0 {
            out.say(tr!(
                "  {}: all {} elements match (largest error {:.1e}, tolerance {:e})",
                "  {}: alle {} Elemente stimmen (größter Fehler {:.1e}, Toleranz {:e})",
                bname,
                want.len(),
                c.max_err,
                tol
            ));
            continue;
        }
        let mut bad_idx: Vec<usize> = c.unwritten.iter().chain(&c.non_finite).chain(&c.wrong).copied().collect();
        bad_idx.sort_unstable();
        out.say(tr!(
            "  {}: {} of {} elements differ: {}",
            "  {}: {} von {} Elementen weichen ab: {}",
            bname,
            c.bad(),
            want.len(),
            ranges(&bad_idx)
        ));
        if !c.unwritten.is_empty() && c.unwritten.len() < c.bad() {
            out.say(tr!(
                "  {}: {} elements never written (they still hold the poison 0x{:08X}): {}",
                "  {}: {} Elemente nie geschrieben (sie enthalten noch das Poison 0x{:08X}): {}",
                bname,
                c.unwritten.len(),
                OUTPUT_POISON,
                ranges(&c.unwritten)
            ));
        }
        for &(i, g, w) in &c.first {
            out.say(tr!(
                "    {}[{}]: got {}, expected {}",
                "    {}[{}]: erhalten {}, erwartet {}",
                bname,
                i,
                show_got(g),
                w as f32
            ));
        }
        out.say(tr!("  what to look at: {}", "  worauf Sie achten sollten: {}", hint(bname, want.len(), threads, &c)));
        failed.push(bname.clone());
    }
    if failed.is_empty() {
        out.say(tr!(
            "result: PASSED - every element matches the reference: |got - expected| <= {:e} * max(1, |expected|)",
            "Ergebnis: BESTANDEN - jedes Element stimmt mit der Referenz überein: |erhalten - erwartet| <= {:e} * max(1, |erwartet|)",
            tol
        ));
        Ok(0)
    } else {
        out.say(tr!(
            "result: NOT PASSED - {} does not match the reference (exit 1)",
            "Ergebnis: NICHT BESTANDEN - {} stimmt nicht mit der Referenz überein (Exit 1)",
            failed.join(", ")
        ));
        Ok(1)
    }
}

/// `lesson check-scratch NAME [--reference FILE] [--tol T]` (the arguments after `check-scratch`).
pub fn main(args: &[&String]) -> i32 {
    let mut name = None;
    let mut reference = None;
    let mut tol = DEFAULT_TOL;
    let mut i = 0;
    let usage = |e: String| {
        eprintln!("{} {e}\n\n{}", if german() { "Fehler:" } else { "error:" }, crate::lesson::USAGE);
        2
    };
    while i < args.len() {
        let a = args[i].as_str();
        let (key, inline) = match a.split_once('=') {
            Some((k, v)) if k.starts_with("--") => (k, Some(v.to_string())),
            _ => (a, None),
        };
        match key {
            "--reference" | "--tol" => {
                let v = match inline.or_else(|| {
                    i += 1;
                    args.get(i).map(|s| s.to_string())
                }) {
                    Some(v) => v,
                    None => return usage(tr!("{} needs a value", "{} braucht einen Wert", key)),
                };
                if key == "--reference" {
                    reference = Some(v);
                } else {
                    match v.parse::<f64>() {
                        Ok(t) if t.is_finite() && t >= 0.0 => tol = t,
                        _ => {
                            return usage(tr!(
                                "--tol {}: expected a number of at least 0, e.g. 1e-4",
                                "--tol {}: erwartet eine Zahl von mindestens 0, z. B. 1e-4",
                                v
                            ))
                        }
                    }
                }
            }
            k if k.starts_with('-') => {
                return usage(tr!("unknown option `{}`", "unbekannte Option `{}`", a));
            }
            _ if name.is_none() => name = Some(a.to_string()),
            _ => return usage(tr!("one scratch kernel at a time (`{}`?)", "ein Scratch-Kernel auf einmal (`{}`?)", a)),
        }
        i += 1;
    }
    let Some(name) = name else {
        return usage(tr!(
            "`lesson check-scratch` needs the scratch kernel's NAME, e.g. `cargo xtask lesson check-scratch my_scale`",
            "`lesson check-scratch` braucht den NAMEN des Scratch-Kernels, z. B. `cargo xtask lesson check-scratch my_scale`"
        ));
    };
    let mut out = Out::default();
    match check(&name, reference.as_deref(), tol, &mut out) {
        Ok(code) => code,
        Err((code, e)) => {
            eprintln!("{} {e}", if german() { "Fehler:" } else { "error:" });
            code
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_args_and_dims_are_read_from_the_launch_spec() {
        assert_eq!(parse_buf("x=f32:1000:iota").unwrap(), Buf { name: "x".into(), len: 1000, output: false });
        assert_eq!(parse_buf("y=f32:10").unwrap(), Buf { name: "y".into(), len: 10, output: true });
        assert!(parse_buf("i=u32:10").unwrap_err().contains("f32 buffers only"));
        assert!(parse_buf("y=f32:0").unwrap_err().contains("1..=2^24"));
        assert_eq!(dims("grid", "4").unwrap(), [4, 1, 1]);
        assert_eq!(dims("block", "32,2").unwrap(), [32, 2, 1]);
        assert!(dims("grid", "0").is_err() && dims("grid", "a").is_err());
        let spec = Spec { args: vec!["u32=3".into(), "buf=z".into()], ..Spec::default() };
        assert!(parse_args(&spec, &[]).unwrap_err().contains("no buffer `z`"));
    }

    #[test]
    fn inputs_are_deterministic_and_never_near_zero() {
        let a = input_values(0, 1000);
        assert_eq!(a, input_values(0, 1000));
        assert_ne!(a, input_values(1, 1000));
        assert!(a.iter().all(|v| (0.25..2.0).contains(&v.abs())));
        assert!(a.iter().any(|&v| v < 0.0) && a.iter().any(|&v| v > 0.0));
    }

    #[test]
    fn the_comparison_names_unwritten_wrong_and_non_finite_elements() {
        let poison = f32::from_bits(OUTPUT_POISON);
        let c = compare(&[1.0, poison, 3.5, f32::NAN, 1e-7], &[1.0, 2.0, 3.0, 4.0, 0.0], 1e-5);
        assert_eq!((c.unwritten.clone(), c.wrong.clone(), c.non_finite.clone()), (vec![1], vec![2], vec![3]));
        assert_eq!(c.first.len(), 3);
        assert_eq!(c.first[1], (2, 3.5, 3.0));
        // Within the tolerance relative to max(1, |expected|): 1e-7 against 0 passes.
        assert_eq!(c.bad(), 3);
        // An infinite expected value must be matched exactly; a NaN one by a NaN (not the poison).
        let c = compare(&[f32::INFINITY, f32::NAN, poison], &[f64::INFINITY, f64::NAN, f64::NAN], 1e-5);
        assert_eq!((c.bad(), c.unwritten.clone()), (1, vec![2]));
    }

    /// The reference's signature follows launch.txt: numbers as themselves, inputs as `&[f64]`,
    /// outputs as `&mut [f64]`.
    #[test]
    fn the_reference_signature_follows_the_launch_spec() {
        let bufs = [parse_buf("x=f32:8:iota").unwrap(), parse_buf("y=f32:8").unwrap()];
        let args = [Arg::U32(8), Arg::F32(2.0), Arg::buf("x"), Arg::buf("y")];
        assert_eq!(signature(&args, &bufs), "pub fn reference(arg0: u32, arg1: f32, x: &[f64], y: &mut [f64])");
        let src = runner_source(Path::new("/r.rs"), &args, &bufs);
        assert!(src.contains("reference::reference(8u32, f32::from_bits(0x40000000), &b0[..], &mut b1[..]);"), "{src}");
    }

    fn quiet() -> Out {
        Out { quiet: true, ..Out::default() }
    }

    /// Unknown kernels, missing or unreadable references and bad options are errors that say so
    /// (exit 2), before anything is built.
    #[test]
    fn bad_input_is_named_with_exit_2() {
        let e = check("xtask_no_such_kernel", None, DEFAULT_TOL, &mut quiet()).unwrap_err();
        assert_eq!(e.0, 2);
        assert!(e.1.contains("no scratch kernel `xtask_no_such_kernel`") && e.1.contains("lesson new"), "{}", e.1);
        assert_eq!(check("Bad-Name", None, DEFAULT_TOL, &mut quiet()).unwrap_err().0, 2);
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<String>>();
        for bad in [&["--tol", "x"][..], &["k", "--reference"], &["k", "--what"], &[], &["a", "b"]] {
            let a = args(bad);
            assert_eq!(main(&a.iter().collect::<Vec<_>>()), 2, "{bad:?}");
        }
    }

    /// A fresh scratch kernel, the name of a test of its own (the tests run in parallel).
    fn scratch_kernel(test: &str) -> Option<String> {
        if let Err(e) = crate::toolchain::ensure() {
            eprintln!("SKIPPED: the scratch kernel is not built without the kernel toolchain: {e}");
            return None;
        }
        let name = format!("xtask_{test}_{}", std::process::id());
        let _ = std::fs::remove_dir_all(scratch::dir(&name));
        assert_eq!(scratch::new(&name), 0);
        Some(name)
    }

    fn remove(name: &str) {
        let _ = std::fs::remove_dir_all(scratch::dir(name));
        let _ = std::fs::remove_dir_all(paths::root().join("target/lessons/check-scratch").join(name));
        let _ = std::fs::remove_file(paths::root().join("target/lessons").join(format!("{name}.ptx")));
    }

    /// `lesson new` then `check-scratch`: the kernel passes the reference.rs `new` wrote, fails a
    /// reference that adds 2 instead of 1 (every element, with got and expected), and fails when
    /// the grid no longer covers the data (the unwritten elements named, with the thread count).
    #[test]
    fn a_new_scratch_kernel_passes_its_reference_and_fails_a_wrong_one() {
        let Some(name) = scratch_kernel("check") else { return };
        let d = scratch::dir(&name);
        let mut out = quiet();
        assert_eq!(check(&name, None, DEFAULT_TOL, &mut out), Ok(0), "{}", out.text);
        assert!(out.text.contains("y: all 1000 elements match"), "{}", out.text);
        assert!(out.text.contains("result: PASSED"), "{}", out.text);

        let wrong = d.join("wrong.rs");
        let text = std::fs::read_to_string(d.join("reference.rs")).unwrap().replace("+ 1.0", "+ 2.0");
        std::fs::write(&wrong, text).unwrap();
        let mut out = quiet();
        assert_eq!(check(&name, wrong.to_str(), DEFAULT_TOL, &mut out), Ok(1), "{}", out.text);
        assert!(out.text.contains("y: 1000 of 1000 elements differ: 0-999"), "{}", out.text);
        let first = out.text.lines().find(|l| l.trim_start().starts_with("y[0]: got ")).expect("y[0] listed");
        let (got, want) = first.split_once(", expected ").unwrap();
        let got: f32 = got.rsplit(' ').next().unwrap().parse().unwrap();
        let want: f32 = want.trim().parse().unwrap();
        assert!((want - got - 1.0).abs() < 1e-5, "{first}");
        assert!(out.text.contains("result: NOT PASSED"), "{}", out.text);
        // The same in German.
        crate::lesson::set_german(true);
        let mut out = quiet();
        let de = check(&name, wrong.to_str(), DEFAULT_TOL, &mut out);
        crate::lesson::set_german(false);
        assert_eq!(de, Ok(1));
        assert!(out.text.contains("y[0]: erhalten ") && out.text.contains("Ergebnis: NICHT BESTANDEN"), "{}", out.text);

        // A grid of 3 blocks of 256 leaves elements 768-999 unwritten.
        let launch = std::fs::read_to_string(d.join("launch.txt")).unwrap();
        std::fs::write(d.join("launch.txt"), launch.replace("grid = 4", "grid = 3")).unwrap();
        let mut out = quiet();
        assert_eq!(check(&name, None, DEFAULT_TOL, &mut out), Ok(1), "{}", out.text);
        assert!(out.text.contains("y[768]: got the poison 0x7FF00BAD (never written)"), "{}", out.text);
        assert!(out.text.contains("768 threads (grid x block) for 1000 elements"), "{}", out.text);

        // A reference whose signature does not fit the launch is bad input.
        std::fs::write(&wrong, "pub fn reference(n: u32, x: &[f64], y: &mut [f64]) {}\n").unwrap();
        let e = check(&name, wrong.to_str(), DEFAULT_TOL, &mut quiet()).unwrap_err();
        assert_eq!(e.0, 2);
        assert!(e.1.contains("pub fn reference(arg0: u32, arg1: f32, x: &[f64], y: &mut [f64])"), "{}", e.1);
        remove(&name);
    }

    /// A safetensors reference: its inputs run through the kernel and its expected output is
    /// compared; a wrong expected value, a wrong shape and a missing tensor are each reported.
    #[test]
    fn a_safetensors_reference_is_read_compared_and_checked() {
        let Some(name) = scratch_kernel("safetensors") else { return };
        let d = scratch::dir(&name);
        let x: Vec<f32> = (0..1000).map(|i| 0.5 + (i % 7) as f32 * 0.25).collect();
        let y: Vec<f64> = x.iter().map(|&v| 2.0 * v as f64 + 1.0).collect();
        let write = |file: &str, x: &[f32], y: &[f64], y_name: &str| {
            use safetensors::tensor::TensorView;
            let xb: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
            let yb: Vec<u8> = y.iter().flat_map(|v| v.to_le_bytes()).collect();
            let t = [
                ("x", TensorView::new(safetensors::Dtype::F32, vec![x.len()], &xb).unwrap()),
                (y_name, TensorView::new(safetensors::Dtype::F64, vec![y.len()], &yb).unwrap()),
            ];
            let path = d.join(file);
            safetensors::serialize_to_file(t, None, &path).unwrap();
            path.display().to_string()
        };
        let good = write("good.safetensors", &x, &y, "y");
        let mut out = quiet();
        assert_eq!(check(&name, Some(&good), DEFAULT_TOL, &mut out), Ok(0), "{}", out.text);
        assert!(out.text.contains("inputs: x (1000 f32), values from the file"), "{}", out.text);

        let mut y_bad = y.clone();
        y_bad[517] += 0.5;
        let bad = write("bad.safetensors", &x, &y_bad, "y");
        let mut out = quiet();
        assert_eq!(check(&name, Some(&bad), DEFAULT_TOL, &mut out), Ok(1), "{}", out.text);
        assert!(out.text.contains("y: 1 of 1000 elements differ: 517"), "{}", out.text);
        assert!(
            out.text.contains(&format!("y[517]: got {}, expected {}", y[517] as f32, y_bad[517] as f32)),
            "{}",
            out.text
        );

        let short = write("short.safetensors", &x[..999], &y, "y");
        let e = check(&name, Some(&short), DEFAULT_TOL, &mut quiet()).unwrap_err();
        assert_eq!(e.0, 2);
        assert!(
            e.1.contains("tensor `x` has shape [999] (999 elements), but launch.txt's buffer `x` has 1000"),
            "{}",
            e.1
        );
        let renamed = write("renamed.safetensors", &x, &y, "out");
        let e = check(&name, Some(&renamed), DEFAULT_TOL, &mut quiet()).unwrap_err();
        assert!(e.1.contains("has no tensor `y` (an output of launch.txt; the file holds: out, x)"), "{}", e.1);
        remove(&name);
    }
}
