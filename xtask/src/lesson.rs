//! `cargo xtask lesson N [--solution]` and `cargo xtask lesson check`: build one lesson's kernel
//! to PTX, run it in the VM with every check on, on shapes that catch the usual mistakes, and
//! compare it with an f64 CPU reference; say in plain words what is wrong.

use crate::paths;
use crate::toolchain::{self, KERNEL_TOOLCHAIN, TARGET, TARGET_CPU};
use ptx_vm::run::{Arg, Launcher, OUTPUT_POISON};
use ptx_vm::{Module, Vm, VmError};
use std::cell::Cell;
use std::path::PathBuf;
use std::time::Instant;

thread_local! {
    /// German diagnostics on this thread: `--lang de`, or `LC_ALL`/`LANG` starting with `de`
    /// (English otherwise). Per thread, so tests in parallel can use either language.
    static GERMAN: Cell<bool> = const { Cell::new(false) };
}

pub(crate) fn german() -> bool {
    GERMAN.with(Cell::get)
}

pub(crate) fn set_german(on: bool) {
    GERMAN.with(|g| g.set(on));
}

/// The language of the messages: `--lang en|de` wins over `LC_ALL`, which wins over `LANG`
/// (as for gettext; an empty variable counts as unset).
fn choose_language(flag: Option<&str>, lc_all: Option<&str>, lang: Option<&str>) -> Result<bool, String> {
    match flag {
        Some("de") => Ok(true),
        Some("en") => Ok(false),
        Some(other) => Err(format!("--lang {other}: the lessons speak `en` and `de`")),
        None => Ok([lc_all, lang].into_iter().flatten().find(|s| !s.is_empty()).is_some_and(|l| l.starts_with("de"))),
    }
}

/// `tr!("English {}", "Deutsch {}", args...)`: the message in the chosen language.
macro_rules! tr {
    ($en:literal, $de:literal $($rest:tt)*) => {
        if german() { format!($de $($rest)*) } else { format!($en $($rest)*) }
    };
}
pub(crate) use tr;

pub const USAGE: &str = "\
usage: cargo xtask lesson N [--solution]   build lessons/NN-*/kernel.rs (or solution.rs), run and check it
       cargo xtask lesson list             the lessons
       cargo xtask lesson check            CI: every solution passes, every unmodified skeleton fails helpfully
       cargo xtask lesson new NAME         a scratch kernel of your own in lessons/scratch/NAME/
       cargo xtask lesson build NAME       build it to target/lessons/NAME.ptx and print how to launch and trace it
       cargo xtask lesson check-scratch NAME [--reference FILE] [--tol T]
                                           build it, run it as launch.txt says and compare every output
                                           element with a reference: FILE is a Rust file with
                                           `pub fn reference` over f64 slices (default: the scratch
                                           kernel's reference.rs, written by `lesson new`) or a
                                           .safetensors file with the inputs and expected outputs;
                                           an element passes when |got - expected| <= T * max(1, |expected|)
                                           (T = 1e-5 unless --tol); a buffer with an INIT is an input
                                           (filled with fixed-seed values, never 0), one without is an
                                           output (poisoned before the launch)

--lang de|en   the diagnosis in German or English (default: German when LC_ALL or LANG starts with `de`);
               `--lang de` also places the skeleton with German comments, lessons/NN-*/kernel.de.rs
               (the same code on the same lines; made from kernel.rs and kernel.de.txt, not
               tracked by git), and checks that file from then on while German is chosen

exit codes: 0 passed, 1 wrong result, 2 bad usage or input, 3 the kernel did not build or the VM reported a finding";

struct Lesson {
    dir: &'static str,
    title: &'static str,
    titel: &'static str,
    check: fn(&Module, &mut Out) -> Verdict,
}

const LESSONS: [Lesson; 9] = [
    Lesson {
        dir: "01-scale",
        title: "a scaled copy: one thread per element, the bounds guard",
        titel: "eine skalierte Kopie: ein Thread pro Element, die Bereichsprüfung",
        check: lesson1,
    },
    Lesson {
        dir: "02-warp-softmax",
        title: "row softmax with warp shuffles",
        titel: "Zeilen-Softmax mit Warp-Shuffles",
        check: lesson2,
    },
    Lesson {
        dir: "03-tiled-qk",
        title: "scores Q Kᵀ with tiles in shared memory and barriers",
        titel: "Scores Q Kᵀ mit Kacheln im Shared Memory und Barrieren",
        check: lesson3,
    },
    Lesson {
        dir: "04-online-softmax",
        title: "the online-softmax update, masked rows included",
        titel: "das Online-Softmax-Update, maskierte Zeilen eingeschlossen",
        check: lesson4,
    },
    Lesson {
        dir: "05-flash-forward",
        title: "a complete f32 flash-attention forward",
        titel: "ein vollständiger f32-Flash-Attention-Forward",
        check: lesson5,
    },
    Lesson {
        dir: "06-mma-qk",
        title: "one tile of scores on the tensor cores: ldmatrix and mma.sync (bf16)",
        titel: "eine Kachel Scores auf den Tensor Cores: ldmatrix und mma.sync (bf16)",
        check: lesson6,
    },
    Lesson {
        dir: "07-swizzle",
        title: "a swizzled shared tile: ldmatrix without bank conflicts",
        titel: "eine geswizzelte Shared-Kachel: ldmatrix ohne Bank-Konflikte",
        check: lesson7,
    },
    Lesson {
        dir: "08-reduce",
        title: "the sum of an array: a tree in shared memory, one atomic add per block",
        titel: "die Summe eines Arrays: ein Baum im Shared Memory, eine atomare Addition pro Block",
        check: lesson8,
    },
    Lesson {
        dir: "09-transpose",
        title: "a coalesced transpose: both global accesses along rows, the turn in shared memory",
        titel: "eine Transposition mit Coalescing: beide globalen Zugriffe entlang der Zeilen, die Drehung im Shared Memory",
        check: lesson9,
    },
];

/// Which file of a lesson is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum File {
    /// `kernel.rs`, the learner's file (comments in English).
    Skeleton,
    /// `kernel.de.rs`, the learner's file with the comments in German: not in the repository,
    /// placed from `kernel.rs` and `kernel.de.txt` by `--lang de` (see [`german_skeleton`]).
    German,
    /// `solution.rs`, the reference solution.
    Solution,
}

impl File {
    fn name(self) -> &'static str {
        match self {
            File::Skeleton => "kernel.rs",
            File::German => "kernel.de.rs",
            File::Solution => "solution.rs",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    Pass,
    Wrong,
    Finding,
}

/// Collects the report (printed as it goes, kept for `check`).
#[derive(Default)]
pub(crate) struct Out {
    pub(crate) text: String,
    pub(crate) quiet: bool,
    /// The kernel's source file (relative to the repository), read for hints the VM's findings
    /// and the outputs alone cannot give (a `return` before a barrier).
    pub(crate) src: Option<PathBuf>,
    /// The kernel's PTX, for the checks the VM does not make ([`unordered_shared_read`]).
    pub(crate) ptx: Option<String>,
}

impl Out {
    pub(crate) fn say(&mut self, s: impl AsRef<str>) {
        if !self.quiet {
            println!("{}", s.as_ref());
        }
        self.text.push_str(s.as_ref());
        self.text.push('\n');
    }
}

pub fn main(args: &[String]) -> i32 {
    let mut args: Vec<String> = args.to_vec();
    let mut lang = None;
    if let Some(i) = args.iter().position(|a| a == "--lang" || a.starts_with("--lang=")) {
        let v =
            if let Some(v) = args[i].strip_prefix("--lang=") { Some(v.to_string()) } else { args.get(i + 1).cloned() };
        let n = if args[i].contains('=') { 1 } else { 2 };
        args.drain(i..(i + n).min(args.len()));
        match v {
            Some(v) => lang = Some(v),
            None => {
                eprintln!("error: --lang needs `en` or `de`\n\n{USAGE}");
                return 2;
            }
        }
    }
    let env = |v: &str| std::env::var(v).ok();
    match choose_language(lang.as_deref(), env("LC_ALL").as_deref(), env("LANG").as_deref()) {
        Ok(g) => set_german(g),
        Err(e) => {
            eprintln!("error: {e}\n\n{USAGE}");
            return 2;
        }
    }
    let solution = args.iter().any(|a| a == "--solution");
    let rest: Vec<&String> = args.iter().filter(|a| *a != "--solution").collect();
    if rest.first().is_some_and(|c| c.as_str() == "check-scratch") && !solution {
        return crate::scratch_check::main(&rest[1..]);
    }
    match rest.as_slice() {
        [cmd] if cmd.as_str() == "list" => {
            for (i, l) in LESSONS.iter().enumerate() {
                println!("{}  lessons/{}/kernel.rs  {}", i + 1, l.dir, if german() { l.titel } else { l.title });
            }
            0
        }
        [cmd] if cmd.as_str() == "check" && !solution => check_all(),
        [cmd] if cmd.as_str() == "new" || cmd.as_str() == "build" => {
            eprintln!("error: `lesson {cmd}` needs the scratch kernel's NAME, e.g. `cargo xtask lesson {cmd} my_scale`\n\n{USAGE}");
            2
        }
        [cmd, name] if cmd.as_str() == "new" && !solution => crate::scratch::new(name),
        [cmd, name] if cmd.as_str() == "build" && !solution => crate::scratch::build(name),
        [n] => match n.parse::<usize>() {
            Ok(n) if (1..=LESSONS.len()).contains(&n) => {
                let mut out = Out::default();
                let dir = paths::root().join("lessons").join(LESSONS[n - 1].dir);
                let file = if solution {
                    File::Solution
                } else if german() && (lang.as_deref() == Some("de") || dir.join("kernel.de.rs").exists()) {
                    match place_german(n) {
                        Ok(Some(placed)) => println!("{placed}"),
                        Ok(None) => {}
                        Err(e) => {
                            eprintln!("Fehler: {e}");
                            return 3;
                        }
                    }
                    File::German
                } else {
                    File::Skeleton
                };
                let code = run_lesson(n, file, &mut out).1;
                if file == File::Skeleton && german() {
                    println!("(das Gerüst mit deutschen Kommentaren: cargo xtask lesson {n} --lang de)");
                }
                code
            }
            _ => {
                eprintln!("error: `{n}` is not a lesson number (1..={})\n\n{USAGE}", LESSONS.len());
                2
            }
        },
        _ => {
            eprintln!("{USAGE}");
            2
        }
    }
}

/// Builds and checks lesson `n`; returns the verdict (None: it did not build) and the exit code.
fn run_lesson(n: usize, which: File, out: &mut Out) -> (Option<Verdict>, i32) {
    let l = &LESSONS[n - 1];
    let file = format!("lessons/{}/{}", l.dir, which.name());
    out.say(tr!("lesson {}: {} ({})", "Lektion {}: {} ({})", n, if german() { l.titel } else { l.title }, file));
    out.src = Some(PathBuf::from(&file));
    let module = match build(n, which, out) {
        Ok(m) => m,
        Err(e) => {
            out.say(tr!("error: {}", "Fehler: {}", e));
            out.say(tr!(
                "result: NOT PASSED - the kernel did not build (exit 3)",
                "Ergebnis: NICHT BESTANDEN - der Kernel lässt sich nicht bauen (Exit 3)"
            ));
            return (None, 3);
        }
    };
    let v = (l.check)(&module, out);
    let code = match v {
        Verdict::Pass => {
            let next = if n < LESSONS.len() {
                tr!("; next: cargo xtask lesson {}", "; weiter: cargo xtask lesson {}", n + 1)
            } else {
                String::new()
            };
            out.say(tr!(
                "result: PASSED - every case matches the f64 reference{}",
                "Ergebnis: BESTANDEN - jeder Fall stimmt mit der f64-Referenz überein{}",
                next
            ));
            0
        }
        Verdict::Wrong => {
            out.say(tr!(
                "result: NOT PASSED - wrong result (exit 1); edit {} and run the lesson again",
                "Ergebnis: NICHT BESTANDEN - falsches Ergebnis (Exit 1); ändern Sie {} und starten Sie die Lektion erneut",
                file
            ));
            1
        }
        Verdict::Finding => {
            out.say(tr!(
                "result: NOT PASSED - the VM stopped the kernel (exit 3); edit {} and run the lesson again",
                "Ergebnis: NICHT BESTANDEN - die VM hat den Kernel angehalten (Exit 3); ändern Sie {} und starten Sie die Lektion erneut",
                file
            ));
            3
        }
    };
    (Some(v), code)
}

/// Where `build` writes lesson `n`'s PTX.
fn ptx_path(n: usize, which: File) -> PathBuf {
    let tail = match which {
        File::Skeleton => "",
        File::German => "-de",
        File::Solution => "-solution",
    };
    paths::root().join("target/lessons").join(format!("lesson{n}{tail}.ptx"))
}

/// The German skeleton: `en` (a lesson's `kernel.rs`) with each whole-line comment replaced, in
/// order, by the next comment line of `de` (its `kernel.de.txt`: lines starting with `//` after
/// their indentation; other lines there are notes and ignored). Each replacement must have the
/// same indentation and marker (`//!`, `///` or `//`) as the line it replaces, and the counts
/// must agree: the code lines are `kernel.rs`'s own, so both files have the same code on the same
/// line numbers and every diagnosis points at the same lines.
fn german_skeleton(en: &str, de: &str) -> Result<String, String> {
    fn marker(l: &str) -> Option<(&str, &str)> {
        let t = l.trim_start();
        let indent = &l[..l.len() - t.len()];
        let m = ["//!", "///", "//"].into_iter().find(|m| t.starts_with(m))?;
        Some((indent, m))
    }
    let mut de_lines = de.lines().enumerate().filter(|(_, l)| marker(l).is_some());
    let mut out = String::with_capacity(en.len() * 2);
    for (i, line) in en.lines().enumerate() {
        match marker(line) {
            Some(want) => {
                let (j, g) = de_lines
                    .next()
                    .ok_or_else(|| format!("kernel.de.txt ends before the comment on line {} of kernel.rs", i + 1))?;
                if marker(g) != Some(want) {
                    return Err(format!(
                        "kernel.de.txt line {} (`{}`) does not start like line {} of kernel.rs (`{}`)",
                        j + 1,
                        g.trim(),
                        i + 1,
                        line.trim()
                    ));
                }
                out.push_str(g.trim_end());
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    if let Some((j, _)) = de_lines.next() {
        return Err(format!("kernel.de.txt has more comment lines than kernel.rs (line {} is one too many)", j + 1));
    }
    Ok(out)
}

/// Places lesson `n`'s German skeleton `kernel.de.rs` when it is not there yet (an existing one
/// is the learner's work and stays); says so.
fn place_german(n: usize) -> Result<Option<String>, String> {
    let dir = paths::root().join("lessons").join(LESSONS[n - 1].dir);
    let target = dir.join("kernel.de.rs");
    if target.exists() {
        return Ok(None);
    }
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).map_err(|e| format!("{}: {e}", paths::rel(&dir.join(f))));
    let text = german_skeleton(&read("kernel.rs")?, &read("kernel.de.txt")?)?;
    std::fs::write(&target, text).map_err(|e| format!("{}: {e}", paths::rel(&target)))?;
    Ok(Some(format!(
        "{} angelegt: das Gerüst von kernel.rs mit deutschen Kommentaren (derselbe Code in denselben Zeilen). \
         Bearbeiten Sie diese Datei; `cargo xtask lesson {n} --lang de` prüft sie, `rm {}` setzt sie zurück.",
        paths::rel(&target),
        paths::rel(&target)
    )))
}

/// Compiles the lesson to PTX with the kernel toolchain and loads it.
fn build(n: usize, which: File, out: &mut Out) -> Result<Module, String> {
    let extra = match which {
        File::Skeleton => "",
        File::German => ",de",
        File::Solution => ",solution",
    };
    let features = format!("lesson{n}{extra}");
    let ptx_path = ptx_path(n, which);
    let t0 = Instant::now();
    let ptx = compile(&["-p", "memattn-lessons", "--features", &features], &ptx_path)?;
    out.say(tr!("built {} in {:.1} s", "{} gebaut in {:.1} s", paths::rel(&ptx_path), t0.elapsed().as_secs_f64()));
    let m = Module::load(&ptx).map_err(|e| format!("the VM cannot load {}: {e}", paths::rel(&ptx_path)))?;
    out.ptx = Some(ptx);
    Ok(m)
}

/// The lessons' recipe: one kernel crate (`select`: cargo's `-p`/`--manifest-path` and features)
/// compiled with the kernel toolchain for nvptx64 to `ptx_path`, with line tables only; returns
/// the PTX text. A kernel that can panic (an `.extern .func` in the PTX) is an error that says why.
pub(crate) fn compile(select: &[&str], ptx_path: &std::path::Path) -> Result<String, String> {
    toolchain::ensure()?;
    if let Some(dir) = ptx_path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    }
    let status = toolchain::command("cargo")
        .current_dir(paths::root())
        .arg(format!("+{KERNEL_TOOLCHAIN}"))
        .args(["rustc", "--quiet"])
        .args(select)
        .args(["--profile", "ptx", "--crate-type", "staticlib"])
        .args(["--target", TARGET, "-Zbuild-std=core", "--target-dir"])
        .arg(paths::ptx_target_dir(kernels_gpu::variants::PtxModule::Sm80))
        .args(["--", "-C", &format!("target-cpu={TARGET_CPU}")])
        .args(toolchain::LINE_INFO_FLAGS)
        .arg(format!("--emit=asm={}", ptx_path.display()))
        .status()
        .map_err(|e| format!("cannot run cargo +{KERNEL_TOOLCHAIN}: {e}"))?;
    if !status.success() {
        return Err("the kernel does not compile (the compiler's message is above)".into());
    }
    let raw = std::fs::read_to_string(ptx_path).map_err(|e| format!("no PTX at {}: {e}", ptx_path.display()))?;
    let ptx = toolchain::keep_line_info_only(&raw, &paths::root(), &toolchain::sysroot()?);
    std::fs::write(ptx_path, &ptx).map_err(|e| e.to_string())?;
    if let Some(line) = ptx.lines().find(|l| l.contains(".extern .func")) {
        return Err(format!(
            "the PTX calls an external function ({}): something in the kernel can panic (an index out of \
             bounds, an overflow check, `unwrap`) and the panic machinery is not available on the GPU; use \
             raw pointers (`*p.add(i)`) and plain arithmetic",
            line.trim()
        ));
    }
    Ok(ptx)
}

/// `cargo xtask lesson check`: every solution passes; every skeleton, as committed, fails with a
/// message that says what to do.
fn check_all() -> i32 {
    // CI reads the English report ("never written", "what to look at").
    set_german(false);
    let t0 = Instant::now();
    let mut bad = Vec::new();
    for n in 1..=LESSONS.len() {
        let mut out = Out { quiet: true, ..Out::default() };
        let (v, _) = run_lesson(n, File::Solution, &mut out);
        if v != Some(Verdict::Pass) {
            bad.push(format!("lesson {n}: the reference solution does not pass:\n{}", out.text));
        } else {
            println!("lesson {n}: solution passes");
            if n == 5 {
                let ptx = std::fs::read_to_string(ptx_path(5, File::Solution)).unwrap_or_default();
                match barrier_mutants(&ptx) {
                    Ok(races) => {
                        for r in races {
                            println!("lesson 5: {r}");
                        }
                    }
                    Err(e) => bad.push(format!("lesson 5: {e}")),
                }
            }
        }
        let mut out = Out { quiet: true, ..Out::default() };
        let (v, _) = run_lesson(n, File::Skeleton, &mut out);
        // Lesson 7's skeleton computes the right values with an unswizzled tile: it fails on
        // its bank conflicts instead.
        // Lesson 8's skeleton leaves `total` at the 0 it starts with.
        let symptom = match n {
            7 => "bank conflicts",
            8 => "no block added",
            _ => "never written",
        };
        let helpful = out.text.contains(symptom) && out.text.contains("what to look at");
        if v != Some(Verdict::Wrong) || !helpful {
            bad.push(format!("lesson {n}: the unmodified skeleton should fail with a hint, but said:\n{}", out.text));
        } else {
            println!(
                "lesson {n}: skeleton fails with a hint ({})",
                out.text.lines().find(|l| l.contains("what to look at")).unwrap_or("").trim()
            );
        }
    }
    println!("lesson check: {} lessons in {:.1} s", LESSONS.len(), t0.elapsed().as_secs_f64());
    if bad.is_empty() {
        0
    } else {
        for b in bad {
            eprintln!("error: {b}");
        }
        1
    }
}

// ---- inputs, references, comparison ----

/// Deterministic inputs: a 64-bit LCG, approximately standard normal (sum of four uniforms).
struct Rng(u64);
impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f32 {
        let s: f64 = (0..4).map(|_| self.uniform()).sum();
        ((s - 2.0) * (3.0f64).sqrt()) as f32
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * scale).collect()
    }
}

/// Row numbers as ranges, e.g. `0-3, 7, 9-10`.
pub(crate) fn ranges(v: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        parts.push(if i == j { v[i].to_string() } else { format!("{}-{}", v[i], v[j]) });
        i = j + 1;
    }
    if parts.len() > 8 {
        let n = parts.len();
        parts.truncate(8);
        parts.push(format!("... ({n} ranges)"));
    }
    parts.join(", ")
}

/// What is wrong with one output tensor, by row.
#[derive(Default, Debug)]
struct Diff {
    rows: usize,
    cols: usize,
    unwritten_rows: Vec<usize>,
    unwritten: usize,
    nan_rows: Vec<usize>,
    wrong_rows: Vec<usize>,
    /// First wrong element: (row, col, got, want).
    first: Option<(usize, usize, f32, f64)>,
    max_err: f64,
}

impl Diff {
    fn ok(&self) -> bool {
        self.unwritten == 0 && self.nan_rows.is_empty() && self.wrong_rows.is_empty()
    }
}

/// Compares `got` (`rows x cols`) with `want`: equal within `tol * max(1, |want|)`; an infinite
/// `want` must be matched exactly.
fn compare(got: &[f32], want: &[f64], cols: usize, tol: f64) -> Diff {
    let rows = want.len() / cols;
    let mut d = Diff { rows, cols, ..Diff::default() };
    for r in 0..rows {
        let (mut unw, mut nan, mut wrong) = (false, false, false);
        for c in 0..cols {
            let (g, w) = (got[r * cols + c], want[r * cols + c]);
            if g.to_bits() == OUTPUT_POISON {
                d.unwritten += 1;
                unw = true;
                continue;
            }
            let bad = if w.is_infinite() {
                g as f64 != w
            } else if !g.is_finite() {
                nan = true;
                true
            } else {
                let e = (g as f64 - w).abs();
                d.max_err = d.max_err.max(e / w.abs().max(1.0));
                e > tol * w.abs().max(1.0)
            };
            if bad {
                wrong = true;
                if d.first.is_none() {
                    d.first = Some((r, c, g, w));
                }
            }
        }
        if unw {
            d.unwritten_rows.push(r);
        }
        if nan {
            d.nan_rows.push(r);
        } else if wrong {
            d.wrong_rows.push(r);
        }
    }
    d
}

/// A case's description in the chosen language.
fn what_de(what: &str) -> &str {
    if !german() {
        return what;
    }
    match what {
        "several blocks, 100 columns (more than one per lane)" => {
            "mehrere Blöcke, 100 Spalten (mehr als eine pro Lane)"
        }
        "large scores (exp overflows without the max), the last block partly empty" => {
            "große Scores (exp läuft ohne das Maximum über), der letzte Block teilweise leer"
        }
        "exactly one column per lane" => "genau eine Spalte pro Lane",
        "20 columns: lanes 20-31 have none" => "20 Spalten: die Lanes 20-31 haben keine",
        "no size a multiple of 16" => "keine Größe ein Vielfaches von 16",
        "one tile" => "eine Kachel",
        "five chunks of d, thin edge tiles" => "fünf Abschnitte von d, schmale Randkacheln",
        "3 key tiles, the last one partial; 2 blocks" => "3 Key-Kacheln, die letzte unvollständig; 2 Blöcke",
        "causal, bottom-right aligned" => "kausal, unten rechts ausgerichtet",
        "causal with seq_q > seq_kv: rows 0-59 see no key (O = 0, LSE = -inf)" => {
            "kausal mit seq_q > seq_kv: die Zeilen 0-59 sehen keinen Key (O = 0, LSE = -inf)"
        }
        "one block, one tile" => "ein Block, eine Kachel",
        "many elements per thread: 49 rounds of the grid-stride loop" => {
            "viele Elemente pro Thread: 49 Runden der Grid-Stride-Schleife"
        }
        "fewer elements than threads: 1048 of the 2048 threads have none" => {
            "weniger Elemente als Threads: 1048 der 2048 Threads haben keines"
        }
        "3 blocks, n odd" => "3 Blöcke, n ungerade",
        "whole tiles: 3 x 2 blocks" => "ganze Kacheln: 3 x 2 Blöcke",
        "partial tiles at the right and bottom edges: 3 x 4 blocks" => {
            "unvollständige Kacheln am rechten und unteren Rand: 3 x 4 Blöcke"
        }
        "rows of 45 floats, not 32-byte aligned: 2 x 3 blocks" => {
            "Zeilen aus 45 Floats, nicht auf 32 Byte ausgerichtet: 2 x 3 Blöcke"
        }
        other => other,
    }
}

/// A row unit in German: "element" -> "Element", "row" -> "Zeile" (the English text keeps `unit`).
fn unit_de(unit: &str) -> &str {
    match (german(), unit) {
        (true, "element") => "Element",
        (true, "row") => "Zeile",
        _ => unit,
    }
}

/// The plural of [`unit_de`] in German (the English text appends "s").
fn units_de(unit: &str) -> &str {
    match (german(), unit) {
        (true, "element") => "Elemente",
        (true, "row") => "Zeilen",
        _ => unit,
    }
}

/// Prints what is wrong with tensor `name`; `unit` names its rows ("row", "element").
fn explain(out: &mut Out, name: &str, unit: &str, d: &Diff) {
    if d.unwritten == d.rows * d.cols {
        out.say(tr!(
            "  {}: never written - every {} still holds the poison (NaN 0x{:08X}) the harness filled it with",
            "  {}: nie geschrieben - alle {} enthalten noch das Gift (NaN 0x{:08X}), mit dem die Prüfung sie gefüllt hat",
            name, if german() { units_de(unit) } else { unit }, OUTPUT_POISON
        ));
        return;
    }
    if !d.unwritten_rows.is_empty() {
        out.say(tr!(
            "  {}: {}s {} never written ({} of {}; they still hold the poison 0x{:08X})",
            "  {}: {} {} nie geschrieben ({} von {}; sie enthalten noch das Gift 0x{:08X})",
            name,
            units_de(unit),
            ranges(&d.unwritten_rows),
            d.unwritten_rows.len(),
            d.rows,
            OUTPUT_POISON
        ));
    }
    if !d.nan_rows.is_empty() {
        out.say(tr!(
            "  {}: {}s {} contain NaN or infinity where the reference is finite",
            "  {}: {} {} enthalten NaN oder unendlich, wo die Referenz endlich ist",
            name,
            units_de(unit),
            ranges(&d.nan_rows)
        ));
    }
    if !d.wrong_rows.is_empty() {
        out.say(tr!(
            "  {}: {}s {} have wrong values ({} of {})",
            "  {}: {} {} haben falsche Werte ({} von {})",
            name,
            units_de(unit),
            ranges(&d.wrong_rows),
            d.wrong_rows.len(),
            d.rows
        ));
    }
    if let Some((r, c, g, w)) = d.first {
        out.say(tr!(
            "  {}: first wrong value at {} {}, column {}: got {}, expected {:.7}",
            "  {}: erster falscher Wert bei {} {}, Spalte {}: erhalten {}, erwartet {:.7}",
            name,
            unit_de(unit),
            r,
            c,
            g,
            w
        ));
    }
}

/// Runs one launch; on a VM finding, explains it and returns Err.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch(
    l: &mut Launcher,
    out: &mut Out,
    kernel: &str,
    grid: [u32; 3],
    block: [u32; 3],
    smem: u32,
    args: &[Arg],
) -> Result<(), Verdict> {
    launch_stats(l, out, kernel, grid, block, smem, args).map(|_| ())
}

/// [`launch`], returning the launch's statistics.
#[allow(clippy::too_many_arguments)]
fn launch_stats(
    l: &mut Launcher,
    out: &mut Out,
    kernel: &str,
    grid: [u32; 3],
    block: [u32; 3],
    smem: u32,
    args: &[Arg],
) -> Result<ptx_vm::LaunchStats, Verdict> {
    launch_hinted(l, out, kernel, grid, block, smem, args, |_| None)
}

/// [`launch_stats`] with a lesson's own reading of a finding: `special` gives the hint for the
/// findings it knows (from the thread, block and buffer the finding names), the general hints
/// cover the rest. A wrapped index and a `return` before a barrier keep their own hints.
#[allow(clippy::too_many_arguments)]
fn launch_hinted(
    l: &mut Launcher,
    out: &mut Out,
    kernel: &str,
    grid: [u32; 3],
    block: [u32; 3],
    smem: u32,
    args: &[Arg],
    special: impl Fn(&ptx_vm::Finding) -> Option<String>,
) -> Result<ptx_vm::LaunchStats, Verdict> {
    match l.launch(kernel, grid, block, smem, args) {
        Ok(stats) => Ok(stats),
        Err(VmError::Memcheck(f)) | Err(VmError::Trap(f)) => {
            out.say(format!("  VM finding: {}", f.kind));
            if let Some(s) = &f.source {
                out.say(format!("    at       {s}"));
            }
            out.say(format!("    PTX      line {}: `{}`", f.line, f.instruction));
            out.say(format!("    thread   {:?} of block {:?}", f.thread, f.block));
            if let Some(b) = &f.buffer {
                out.say(format!("    buffer   {b}"));
            }
            if let Some(n) = &f.nearest_allocation {
                out.say(format!("    where    {n}"));
            }
            let early = early_return_in(out, f.source.as_ref());
            let own = special(&f);
            let hint = match f.kind.as_str() {
                k if k.starts_with("out-of-bounds") && wrapped_distance(&f).is_some() => {
                    let gib = wrapped_distance(&f).unwrap_or(0) as f64 / (1u64 << 30) as f64;
                    let buf = f.buffer.as_deref().unwrap_or(if german() { "dem Puffer" } else { "the buffer" });
                    tr!(
                        "the address is {:.1} GiB away from the nearest buffer (`{}`, which need not be the one indexed): an index goes that far only when it wrapped - an unsigned (u32) index or bound that goes below 0 (`i - 1` at i = 0) becomes about 4.29e9; test before subtracting, or compute it in i64",
                        "die Adresse liegt {:.1} GiB vom nächsten Puffer entfernt (`{}`, nicht unbedingt der indizierte): so weit kommt ein Index nur, wenn er übergelaufen ist - ein vorzeichenloser (u32) Index oder eine Grenze unter 0 (`i - 1` bei i = 0) wird zu etwa 4,29e9; prüfen Sie vor dem Subtrahieren, oder rechnen Sie in i64",
                        gib,
                        buf
                    )
                }
                "uninitialized shared memory read" | "barrier divergence" | "deadlock" if early.is_some() => {
                    early_return_hint(early.as_ref())
                }
                _ if own.is_some() => own.unwrap_or_default(),
                k if k.starts_with("out-of-bounds") => tr!(
                    "an access outside `{}`: threads whose index is past the end of the data must not load or store it - guard the index (`if i < n`)",
                    "ein Zugriff außerhalb von `{}`: Threads, deren Index hinter dem Ende der Daten liegt, dürfen dort weder laden noch speichern - prüfen Sie den Index (`if i < n`)",
                    f.buffer.as_deref().unwrap_or(if german() { "dem Puffer" } else { "the buffer" })
                ),
                "shared memory race" => tr!("two warps used the same shared word with no barrier between them: a `sync_threads()` is missing between writing a tile and reading it, or between reading it and overwriting it with the next one", "zwei Warps haben dasselbe Shared-Memory-Wort ohne Barriere dazwischen benutzt: ein `sync_threads()` fehlt zwischen dem Schreiben einer Kachel und dem Lesen, oder zwischen dem Lesen und dem Überschreiben mit der nächsten"),
                "uninitialized shared memory read" => tr!("a read of shared memory no thread has written yet: the tile is read before it is loaded, or a `sync_threads()` after the load is missing", "ein Lesen von Shared Memory, das noch kein Thread geschrieben hat: die Kachel wird gelesen, bevor sie geladen ist, oder ein `sync_threads()` nach dem Laden fehlt"),
                "barrier divergence" | "deadlock" => tr!("not every thread of the block reached the same `sync_threads()`: threads past the edge of the data must not `return` before a barrier", "nicht jeder Thread des Blocks hat dasselbe `sync_threads()` erreicht: Threads hinter dem Rand der Daten dürfen vor einer Barriere nicht `return`en"),
                "shuffle from an exited lane" => tr!("a shuffle read a lane that had already returned, and got an undefined value: every lane of the warp must stay until the last shuffle - return per warp (the row test), not per lane, and let a lane without a column take -inf into the maximum and 0 into the sum", "ein Shuffle hat eine Lane gelesen, die schon zurückgekehrt war, und einen undefinierten Wert bekommen: jede Lane des Warps muss bis zum letzten Shuffle bleiben - kehren Sie pro Warp zurück (die Zeilenprüfung), nicht pro Lane, und lassen Sie eine Lane ohne Spalte -inf ins Maximum und 0 in die Summe geben"),
                "warp collective divergence" => tr!("a shuffle ran with lanes of the warp missing: all 32 lanes must execute `shfl_xor` together (return per warp, not per thread)", "ein Shuffle lief, während Lanes des Warps fehlten: alle 32 Lanes müssen `shfl_xor` gemeinsam ausführen (pro Warp zurückkehren, nicht pro Thread)"),
                k if k.contains("budget") => tr!("the kernel did not finish: a loop whose counter never reaches its end?", "der Kernel ist nicht fertig geworden: eine Schleife, deren Zähler ihr Ende nie erreicht?"),
                _ => tr!("see the PTX line and the Rust line above", "siehe die PTX-Zeile und die Rust-Zeile oben"),
            };
            out.say(tr!("  what to look at: {}", "  worauf Sie achten sollten: {}", hint));
            Err(Verdict::Finding)
        }
        Err(e) => {
            out.say(format!("  the launch failed: {e}"));
            out.say("  what to look at: the kernel's signature must match the one in the skeleton");
            Err(Verdict::Finding)
        }
    }
}

/// A `return` before a `sync_threads()` in kernel source `src`: the 1-based lines of the first
/// `return` statement and of the first barrier after it (comments ignored).
fn early_return(src: &str) -> Option<(usize, usize)> {
    let code = |l: &str| l.split("//").next().unwrap_or("").to_string();
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let is_return = |l: &str| {
        l.match_indices("return").any(|(at, w)| {
            !l[..at].chars().next_back().is_some_and(ident) && !l[at + w.len()..].chars().next().is_some_and(ident)
        })
    };
    let lines: Vec<String> = src.lines().map(code).collect();
    let ret = lines.iter().position(|l| is_return(l))?;
    let sync = ret + 1 + lines[ret + 1..].iter().position(|l| l.contains("sync_threads()"))?;
    Some((ret + 1, sync + 1))
}

/// [`early_return`] in the file a finding points at (`at`), or else in the lesson's file: the
/// file and both lines.
fn early_return_in(out: &Out, at: Option<&ptx_vm::SourceLoc>) -> Option<(String, usize, usize)> {
    // The kernel's own file first (`near` when the finding is in an inlined helper), then the
    // lesson's.
    let files = at
        .into_iter()
        .flat_map(|s| s.near.iter().map(|(f, _)| f.clone()).chain([s.file.clone()]))
        .chain(out.src.as_ref().map(|p| p.display().to_string()))
        .filter(|f| !f.starts_with('<'));
    for file in files {
        if let Some((r, s)) = std::fs::read_to_string(paths::root().join(&file)).ok().and_then(|t| early_return(&t)) {
            return Some((file, r, s));
        }
    }
    None
}

/// What a `return` before a barrier does, in words, with its lines.
fn early_return_hint(e: Option<&(String, usize, usize)>) -> String {
    let Some((file, r, s)) = e else { return String::new() };
    tr!(
        "line {r} of {file} returns before the `sync_threads()` at line {s}: the threads that leave never store their part of the tile, so the others read words nobody wrote (a barrier does not wait for threads that have exited); keep every thread until the last barrier and guard only the loads (load 0.0 instead) and the final store",
        "Zeile {r} von {file} kehrt vor dem `sync_threads()` in Zeile {s} zurück: die Threads, die gehen, speichern ihren Teil der Kachel nie, also lesen die anderen Wörter, die niemand geschrieben hat (eine Barriere wartet nicht auf beendete Threads); halten Sie jeden Thread bis zur letzten Barriere und schützen Sie nur die Ladevorgänge (laden Sie stattdessen 0.0) und das abschließende Speichern"
    )
}

/// How far (bytes) an out-of-bounds access lies from the start of the allocation its finding
/// names, when that is 2 GiB or more: no lesson's buffer is near that size, so the index wrapped.
fn wrapped_distance(f: &ptx_vm::Finding) -> Option<u64> {
    let addr = f.address?;
    let near = f.nearest_allocation.as_deref()?;
    let hex = &near[near.rfind(" at 0x")? + 6..];
    let start = u64::from_str_radix(hex.split(|c: char| !c.is_ascii_hexdigit()).next()?, 16).ok()?;
    let d = addr.abs_diff(start);
    (d >= 1 << 31).then_some(d)
}

pub(crate) fn vm_launcher(m: &Module) -> Launcher<'_> {
    let mut vm = Vm::with_workers(2);
    // The solutions need at most a few thousand instructions per thread: a kernel that runs
    // 16 M is stuck in a loop, and the VM says so in seconds instead of hours.
    let mut limits = vm.limits();
    limits.max_instructions_per_thread = 1 << 24;
    vm.set_limits(limits);
    Launcher::with_vm(vm, m)
}

fn setup<T>(r: Result<T, VmError>) -> T {
    r.unwrap_or_else(|e| panic!("lesson harness: VM set-up failed: {e}"))
}

fn result(
    out: &mut Out,
    d: &[(&str, &str, &Diff)],
    hint: impl Fn(&str, &Diff) -> Option<String>,
) -> Result<(), Verdict> {
    if d.iter().all(|(_, _, x)| x.ok()) {
        out.say("  ok");
        return Ok(());
    }
    for (name, unit, x) in d {
        if !x.ok() {
            explain(out, name, unit, x);
        }
    }
    // A `return` before a barrier leaves tile words unwritten whatever else the kernel does.
    let early = early_return_in(out, None);
    let h = match early {
        Some(_) if d.iter().any(|(_, _, x)| !x.ok() && !all_unwritten(x)) => Some(early_return_hint(early.as_ref())),
        _ => d.iter().filter(|(_, _, x)| !x.ok()).find_map(|(name, _, x)| hint(name, x)),
    };
    out.say(tr!("  what to look at: {}", "  worauf Sie achten sollten: {}", h.unwrap_or_else(not_a_usual_mistake)));
    Err(Verdict::Wrong)
}

// ---- the usual mistakes: what each would store ----

/// In a mistake's output: an element it never writes (it keeps the harness's poison).
const KEPT_POISON: f64 = f64::MIN;

/// Whether `got` is what a kernel with a mistake stores (`want`): each element within `tol` of
/// it relative to max(1, |want|), NaN where it is NaN, the same infinity, the poison where it
/// writes nothing ([`KEPT_POISON`]).
fn same_output(got: &[f32], want: &[f64], tol: f64) -> bool {
    got.len() == want.len()
        && got.iter().zip(want).all(|(&g, &w)| {
            if w == KEPT_POISON {
                g.to_bits() == OUTPUT_POISON
            } else if g.to_bits() == OUTPUT_POISON {
                false
            } else if w.is_nan() {
                g.is_nan()
            } else if w.is_infinite() {
                g as f64 == w
            } else {
                g.is_finite() && (g as f64 - w).abs() <= tol * w.abs().max(1.0)
            }
        })
}

/// A usual mistake: the hint that names it, and what each output of the case holds when it is
/// made (the case's inputs through the reference with that mistake).
struct Mistake {
    hint: String,
    outputs: Vec<Vec<f64>>,
}

/// The hint of the first mistake whose outputs are `got`'s, each within `tol`.
fn mistake_made(got: &[&[f32]], mistakes: impl IntoIterator<Item = Mistake>, tol: f64) -> Option<String> {
    mistakes
        .into_iter()
        .find(|m| m.outputs.len() == got.len() && got.iter().zip(&m.outputs).all(|(g, w)| same_output(g, w, tol)))
        .map(|m| m.hint)
}

/// The output matches no usual mistake: say so instead of guessing one.
fn not_a_usual_mistake() -> String {
    tr!(
        "not one of the usual mistakes (the output matches none of them; the differences are above): compare your steps with the description at the top of the kernel file",
        "keiner der üblichen Fehler (die Ausgabe passt zu keinem; die Abweichungen stehen oben): vergleichen Sie Ihre Schritte mit der Beschreibung oben in der Kernel-Datei (und in README.de.md)"
    )
}

fn all_unwritten(d: &Diff) -> bool {
    d.unwritten == d.rows * d.cols
}

fn verdict(cases: impl FnOnce(&mut Out) -> Result<(), Verdict>, out: &mut Out) -> Verdict {
    match cases(out) {
        Ok(()) => Verdict::Pass,
        Err(v) => v,
    }
}

// ---- lesson 1 ----

fn lesson1(m: &Module, out: &mut Out) -> Verdict {
    verdict(
        |out| {
            for (case, (n, grid)) in [(1000u32, 4u32), (256, 1)].into_iter().enumerate() {
                out.say(tr!(
                    "case {}: n = {}, {} block(s) of 256 threads ({} threads past the end)",
                    "Fall {}: n = {}, {} mit 256 Threads ({} Threads hinter dem Ende)",
                    case + 1,
                    n,
                    if german() && grid == 1 {
                        "1 Block".to_string()
                    } else if german() {
                        format!("{grid} Blöcke")
                    } else {
                        grid.to_string()
                    },
                    grid * 256 - n
                ));
                let mut l = vm_launcher(m);
                let x: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * 0.25 - 12.0).collect();
                let a = -1.5f32;
                setup(l.input_f32("x", &x));
                setup(l.output_f32("y", n as usize));
                launch(
                    &mut l,
                    out,
                    "scale_f32",
                    [grid, 1, 1],
                    [256, 1, 1],
                    0,
                    &[Arg::U32(n), Arg::F32(a), Arg::buf("x"), Arg::buf("y")],
                )?;
                let want: Vec<f64> = x.iter().map(|&v| a as f64 * v as f64).collect();
                let d = compare(&setup(l.read_f32("y")), &want, 1, 1e-6);
                result(out, &[("y", "element", &d)], |_, d| {
                    Some(if all_unwritten(d) {
                        tr!(
                            "step 3 - the kernel does not store into y yet",
                            "Schritt 3 - der Kernel speichert noch nichts in y"
                        )
                    } else if !d.unwritten_rows.is_empty() && d.unwritten_rows[0] >= 256 {
                        tr!(
                            "only the first block's elements were written: the index must include the block, `i = ctaid_x() * ntid_x() + tid_x()` (step 1)",
                            "nur die Elemente des ersten Blocks wurden geschrieben: der Index muss den Block enthalten, `i = ctaid_x() * ntid_x() + tid_x()` (Schritt 1)"
                        )
                    } else if !d.unwritten_rows.is_empty() {
                        tr!(
                            "some elements were never written: does every thread store its own element y[i]?",
                            "einige Elemente wurden nie geschrieben: speichert jeder Thread sein eigenes Element y[i]?"
                        )
                    } else {
                        tr!(
                            "the stored values are wrong: y[i] must be `a * x[i]` for the same i",
                            "die gespeicherten Werte sind falsch: y[i] muss `a * x[i]` für dasselbe i sein"
                        )
                    })
                })?;
            }
            Ok(())
        },
        out,
    )
}

// ---- lesson 2 ----

fn softmax_rows(x: &[f32], cols: usize) -> Vec<f64> {
    let mut y = vec![0.0; x.len()];
    for (xr, yr) in x.chunks(cols).zip(y.chunks_mut(cols)) {
        let m = xr.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
        let s: f64 = xr.iter().map(|&v| (v as f64 - m).exp()).sum();
        for (o, &v) in yr.iter_mut().zip(xr) {
            *o = (v as f64 - m).exp() / s;
        }
    }
    y
}

/// The row of warp `w` of block `b`.
type RowOf = fn(usize, usize) -> usize;

/// Row indices a learner writes instead of `ctaid_x() * 4 + tid_x() / 32` (the same for all 32
/// lanes of a warp), as written, and the row of warp `w` of block `b`.
const L2_ROWS: [(&str, RowOf); 6] = [
    ("tid_x() / 32", |_, w| w),
    ("ctaid_x() + tid_x() / 32", |b, w| b + w),
    ("ctaid_x() * ntid_x() + tid_x() / 32", |b, w| b * 128 + w),
    ("ctaid_x() * 32 + tid_x() / 32", |b, w| b * 32 + w),
    ("ctaid_x() * 4 + tid_x() / 64", |b, w| b * 4 + w / 2),
    ("ctaid_x() * 4 + tid_x() / 128", |b, _| b * 4),
];

/// A mistake in lesson 2's kernel, for [`softmax_sim`].
#[derive(Clone, Copy)]
enum L2Flaw {
    /// Warp `w` of block `b` takes row `f(b, w)`.
    Rows(RowOf),
    /// No loop over columns: lane l handles column l only.
    NoColumnLoop,
    /// Neither the maximum nor the sum combined over the lanes.
    LaneMaxAndSum,
    /// The maximum combined, the sum not.
    LaneSum,
    /// The sum combined, the maximum not (each lane's terms in its own base).
    LaneMax,
}

/// What lesson 2's kernel with `flaw` stores for `x` (`rows x cols`, `grid` blocks of 4 warps).
fn softmax_sim(x: &[f32], rows: usize, cols: usize, grid: usize, flaw: L2Flaw) -> Vec<f64> {
    let mut y = vec![KEPT_POISON; rows * cols];
    let lane_of = |j: usize| j % 32;
    for row in 0..rows {
        let xr: Vec<f64> = x[row * cols..(row + 1) * cols].iter().map(|&v| v as f64).collect();
        let yr = &mut y[row * cols..(row + 1) * cols];
        let lane_max = |l: usize| xr.iter().skip(l).step_by(32).cloned().fold(f64::NEG_INFINITY, f64::max);
        let row_max = xr.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lane_sum = |l: usize, m: f64| xr.iter().skip(l).step_by(32).map(|v| (v - m).exp()).sum::<f64>();
        match flaw {
            L2Flaw::Rows(_) => {}
            L2Flaw::NoColumnLoop => {
                let n = cols.min(32);
                let m = xr[..n].iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = xr[..n].iter().map(|v| (v - m).exp()).sum();
                for j in 0..n {
                    yr[j] = (xr[j] - m).exp() / sum;
                }
            }
            L2Flaw::LaneMaxAndSum => {
                for j in 0..cols {
                    let m = lane_max(lane_of(j));
                    yr[j] = (xr[j] - m).exp() / lane_sum(lane_of(j), m);
                }
            }
            L2Flaw::LaneSum => {
                for j in 0..cols {
                    yr[j] = (xr[j] - row_max).exp() / lane_sum(lane_of(j), row_max);
                }
            }
            L2Flaw::LaneMax => {
                let total: f64 = (0..32.min(cols)).map(|l| lane_sum(l, lane_max(l))).sum();
                for j in 0..cols {
                    yr[j] = (xr[j] - lane_max(lane_of(j))).exp() / total;
                }
            }
        }
    }
    if let L2Flaw::Rows(f) = flaw {
        let right = softmax_rows(x, cols);
        for b in 0..grid {
            for w in 0..4 {
                let row = f(b, w);
                if row < rows {
                    y[row * cols..(row + 1) * cols].copy_from_slice(&right[row * cols..(row + 1) * cols]);
                }
            }
        }
    }
    y
}

/// Whether some row of `got` has its first 32 columns written and a column past them not.
fn columns_past_32_unwritten(got: &[f32], cols: usize) -> bool {
    let poison = |v: &f32| v.to_bits() == OUTPUT_POISON;
    cols > 32 && got.chunks(cols).any(|r| !r[..32].iter().any(poison) && r[32..].iter().any(poison))
}

fn lesson2(m: &Module, out: &mut Out) -> Verdict {
    verdict(
        |out| {
            let cases = [
                (6u32, 100u32, 1.0f32, "several blocks, 100 columns (more than one per lane)"),
                (9, 37, 40.0, "large scores (exp overflows without the max), the last block partly empty"),
                (4, 32, 1.0, "exactly one column per lane"),
                (5, 20, 1.0, "20 columns: lanes 20-31 have none"),
            ];
            for (case, (rows, cols, scale, what)) in cases.into_iter().enumerate() {
                let grid = rows.div_ceil(4);
                out.say(tr!(
                    "case {}: rows = {rows}, cols = {cols}, inputs x {scale}, {grid} block(s) of 128 threads: {what}",
                    "Fall {}: rows = {rows}, cols = {cols}, Eingaben x {scale}, Blöcke: {grid} zu je 128 Threads: {what}",
                    case + 1,
                    what = what_de(what)
                ));
                let mut l = vm_launcher(m);
                let x = Rng(7 + case as u64).vec((rows * cols) as usize, scale);
                setup(l.input_f32("x", &x));
                setup(l.output_f32("y", (rows * cols) as usize));
                launch(
                    &mut l,
                    out,
                    "row_softmax_f32",
                    [grid, 1, 1],
                    [128, 1, 1],
                    0,
                    &[Arg::U32(rows), Arg::U32(cols), Arg::buf("x"), Arg::buf("y")],
                )?;
                let got = setup(l.read_f32("y"));
                let d = compare(&got, &softmax_rows(&x, cols as usize), cols as usize, 1e-5);
                let made = if d.ok() {
                    None
                } else {
                    let (r, c) = (rows as usize, cols as usize);
                    let mut usual: Vec<Mistake> = L2_ROWS
                        .iter()
                        .map(|&(formula, f)| Mistake {
                            hint: tr!(
                                "the rows written are the ones `row = {}` reaches (each holds its own softmax, the others still hold the poison): the row is `ctaid_x() * 4 + tid_x() / 32`, one row per warp, 4 warps per block (step 1)",
                                "geschrieben sind die Zeilen, die `row = {}` erreicht (jede enthält ihren eigenen Softmax, die anderen noch das Gift): die Zeile ist `ctaid_x() * 4 + tid_x() / 32`, eine Zeile pro Warp, 4 Warps pro Block (Schritt 1)",
                                formula
                            ),
                            outputs: vec![softmax_sim(&x, r, c, grid as usize, L2Flaw::Rows(f))],
                        })
                        .collect();
                    for (flaw, hint) in [
                        (L2Flaw::NoColumnLoop, tr!(
                            "each lane handles one column only: columns 0-31 hold the softmax of those 32 alone and the rest were never written - each lane must loop over columns `lane, lane + 32, lane + 64, ...` in every step",
                            "jede Lane bearbeitet nur eine Spalte: die Spalten 0-31 enthalten den Softmax nur dieser 32, der Rest wurde nie geschrieben - jede Lane muss in jedem Schritt über die Spalten `lane, lane + 32, lane + 64, ...` laufen"
                        )),
                        (L2Flaw::LaneMaxAndSum, tr!(
                            "each lane uses its own maximum and its own sum: combine both over the 32 lanes (shfl_xor with 16, 8, 4, 2, 1) before using them (steps 2-3)",
                            "jede Lane nimmt ihr eigenes Maximum und ihre eigene Summe: kombinieren Sie beide über die 32 Lanes (shfl_xor mit 16, 8, 4, 2, 1), bevor Sie sie benutzen (Schritte 2-3)"
                        )),
                        (L2Flaw::LaneSum, tr!(
                            "the maximum is the row's, but each lane divides by its own sum: combine the sum over the 32 lanes (shfl_xor with 16, 8, 4, 2, 1) before dividing (step 3)",
                            "das Maximum ist das der Zeile, aber jede Lane teilt durch ihre eigene Summe: kombinieren Sie die Summe über die 32 Lanes (shfl_xor mit 16, 8, 4, 2, 1), bevor Sie teilen (Schritt 3)"
                        )),
                        (L2Flaw::LaneMax, tr!(
                            "the sum is combined over the lanes, but each lane subtracted its own maximum: combine the maximum over the 32 lanes first (step 2), so that every term of the sum has the same base",
                            "die Summe wird über die Lanes kombiniert, aber jede Lane hat ihr eigenes Maximum abgezogen: kombinieren Sie zuerst das Maximum über die 32 Lanes (Schritt 2), damit jeder Term der Summe dieselbe Basis hat"
                        )),
                    ] {
                        usual.push(Mistake { hint, outputs: vec![softmax_sim(&x, r, c, grid as usize, flaw)] });
                    }
                    mistake_made(&[&got], usual, 1e-4)
                };
                result(out, &[("y", "row", &d)], |_, d| {
                    Some(if all_unwritten(d) {
                        tr!(
                            "step 4 - the kernel does not store into y yet",
                            "Schritt 4 - der Kernel speichert noch nichts in y"
                        )
                    } else if made.is_some() {
                        return made.clone();
                    } else if !d.nan_rows.is_empty() {
                        tr!("NaN or infinity: subtract the row maximum before the exponential (step 3) and make sure every lane has the same maximum and sum (steps 2-3: shuffle with 16, 8, 4, 2, 1)", "NaN oder unendlich: ziehen Sie vor der Exponentialfunktion das Zeilenmaximum ab (Schritt 3) und sorgen Sie dafür, dass jede Lane dasselbe Maximum und dieselbe Summe hat (Schritte 2-3: Shuffle mit 16, 8, 4, 2, 1)")
                    } else if columns_past_32_unwritten(&got, cols as usize) {
                        tr!("columns past 32 were never written while the first 32 were: each lane must loop over columns `lane, lane + 32, lane + 64, ...`", "Spalten ab 32 wurden nie geschrieben, die ersten 32 schon: jede Lane muss über die Spalten `lane, lane + 32, lane + 64, ...` laufen")
                    } else if !d.unwritten_rows.is_empty() {
                        return None;
                    } else {
                        let sums: Vec<f32> = got.chunks(cols as usize).map(|r| r.iter().sum()).collect();
                        let off = sums.iter().position(|s| (s - 1.0).abs() > 1e-3);
                        match off {
                            Some(r) => tr!("row {} sums to {} instead of 1: the sum must include every column and be combined over all 32 lanes before dividing", "Zeile {} summiert sich zu {} statt zu 1: die Summe muss jede Spalte enthalten und vor dem Teilen über alle 32 Lanes kombiniert werden", r, sums[r]),
                            None => return None,
                        }
                    })
                })?;
            }
            Ok(())
        },
        out,
    )
}

// ---- lesson 3 ----

fn lesson3(m: &Module, out: &mut Out) -> Verdict {
    verdict(
        |out| {
            let cases = [
                (40u32, 50u32, 40u32, "no size a multiple of 16"),
                (16, 16, 16, "one tile"),
                (33, 17, 70, "five chunks of d, thin edge tiles"),
            ];
            for (case, (n, mk, d, what)) in cases.into_iter().enumerate() {
                let grid = [mk.div_ceil(16), n.div_ceil(16), 1];
                out.say(tr!(
                    "case {}: n = {n}, m = {mk}, d = {d}, grid {:?} of 16 x 16 threads: {what}",
                    "Fall {}: n = {n}, m = {mk}, d = {d}, Grid {:?} aus 16 x 16 Threads: {what}",
                    case + 1,
                    &grid[..2],
                    what = what_de(what)
                ));
                let mut l = vm_launcher(m);
                let mut rng = Rng(11 + case as u64);
                let q = rng.vec((n * d) as usize, 1.0);
                let k = rng.vec((mk * d) as usize, 1.0);
                let scale = 0.125f32;
                setup(l.input_f32("Q", &q));
                setup(l.input_f32("K", &k));
                setup(l.output_f32("S", (n * mk) as usize));
                launch(
                    &mut l,
                    out,
                    "qk_tiled_f32",
                    grid,
                    [16, 16, 1],
                    2048,
                    &[
                        Arg::U32(n),
                        Arg::U32(mk),
                        Arg::U32(d),
                        Arg::F32(scale),
                        Arg::buf("Q"),
                        Arg::buf("K"),
                        Arg::buf("S"),
                    ],
                )?;
                let (n, mk, d) = (n as usize, mk as usize, d as usize);
                let mut want = vec![0.0f64; n * mk];
                for i in 0..n {
                    for j in 0..mk {
                        want[i * mk + j] =
                            scale as f64 * (0..d).map(|c| q[i * d + c] as f64 * k[j * d + c] as f64).sum::<f64>();
                    }
                }
                let got = setup(l.read_f32("S"));
                let diff = compare(&got, &want, mk, 1e-5);
                let made = if diff.ok() {
                    None
                } else {
                    let usual = [
                        (L3Flaw::KTransposed, tr!(
                            "the product reads K's tile transposed, `Ks[k][tx]`: row ty of the tile holds K's row ctaid_x() * 16 + ty, so thread (ty, tx) needs `Qs[ty][k] * Ks[tx][k]` (step 3)",
                            "das Produkt liest die Kachel von K transponiert, `Ks[k][tx]`: Zeile ty der Kachel enthält die Zeile ctaid_x() * 16 + ty von K, also braucht Thread (ty, tx) `Qs[ty][k] * Ks[tx][k]` (Schritt 3)"
                        )),
                        (L3Flaw::QTransposed, tr!(
                            "the product reads Q's tile transposed, `Qs[k][ty]`: row ty of the tile holds Q's row i, so thread (ty, tx) needs `Qs[ty][k] * Ks[tx][k]` (step 3)",
                            "das Produkt liest die Kachel von Q transponiert, `Qs[k][ty]`: Zeile ty der Kachel enthält die Zeile i von Q, also braucht Thread (ty, tx) `Qs[ty][k] * Ks[tx][k]` (Schritt 3)"
                        )),
                        (L3Flaw::OneChunk, tr!(
                            "only the first 16 dimensions are summed: loop over every chunk c0 = 0, 16, 32, ... below d, loading and multiplying each",
                            "nur die ersten 16 Dimensionen werden summiert: laufen Sie über jeden Abschnitt c0 = 0, 16, 32, ... unter d, und laden und multiplizieren Sie jeden"
                        )),
                        (L3Flaw::NoScale, tr!(
                            "S is the product without `scale`: store `scale * acc`",
                            "S ist das Produkt ohne `scale`: speichern Sie `scale * acc`"
                        )),
                    ]
                    .map(|(flaw, hint)| Mistake { hint, outputs: vec![qk_sim(&q, &k, n, mk, d, scale as f64, flaw)] });
                    mistake_made(&[&got], usual, 1e-4)
                };
                result(out, &[("S", "row", &diff)], |_, x| {
                    Some(if all_unwritten(x) {
                        tr!(
                            "the kernel does not store into S yet (the last step)",
                            "der Kernel speichert noch nichts in S (der letzte Schritt)"
                        )
                    } else if !x.unwritten_rows.is_empty() {
                        tr!("some rows or columns of S were never written: i = ctaid_y() * 16 + tid_y(), j = ctaid_x() * 16 + tid_x(), and the store needs only `i < n && j < m`", "einige Zeilen oder Spalten von S wurden nie geschrieben: i = ctaid_y() * 16 + tid_y(), j = ctaid_x() * 16 + tid_x(), und das Speichern braucht nur `i < n && j < m`")
                    } else {
                        return made.clone();
                    })
                })?;
            }
            Ok(())
        },
        out,
    )
}

/// A mistake in lesson 3's kernel, for [`qk_sim`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum L3Flaw {
    /// `Qs[ty][k] * Ks[k][tx]`.
    KTransposed,
    /// `Qs[k][ty] * Ks[tx][k]`.
    QTransposed,
    /// The first chunk of 16 dimensions only.
    OneChunk,
    /// `acc` stored without `scale`.
    NoScale,
}

/// Lesson 3's tiles in f64 as the solution fills and multiplies them (16 x 16 tiles, zeros past
/// the edges), with `flaw` made: what a kernel with that mistake stores in S.
fn qk_sim(q: &[f32], k: &[f32], n: usize, m: usize, d: usize, scale: f64, flaw: L3Flaw) -> Vec<f64> {
    const T: usize = 16;
    let at = |x: &[f32], rows: usize, r: usize, c: usize| if r < rows && c < d { x[r * d + c] as f64 } else { 0.0 };
    let mut s = vec![0.0f64; n * m];
    for i in 0..n {
        for j in 0..m {
            let (by, bx, ty, tx) = (i / T, j / T, i % T, j % T);
            let chunks = if flaw == L3Flaw::OneChunk { 1 } else { d.div_ceil(T) };
            let mut acc = 0.0;
            for c0 in (0..chunks).map(|c| c * T) {
                let qs = |r: usize, c: usize| at(q, n, by * T + r, c0 + c);
                let ks = |r: usize, c: usize| at(k, m, bx * T + r, c0 + c);
                for kk in 0..T {
                    acc += match flaw {
                        L3Flaw::KTransposed => qs(ty, kk) * ks(kk, tx),
                        L3Flaw::QTransposed => qs(kk, ty) * ks(tx, kk),
                        _ => qs(ty, kk) * ks(tx, kk),
                    };
                }
            }
            s[i * m + j] = if flaw == L3Flaw::NoScale { acc } else { scale * acc };
        }
    }
    s
}

// ---- lesson 4 ----

fn lesson4(m: &Module, out: &mut Out) -> Verdict {
    verdict(
        |out| {
            let (rows, n) = (70usize, 50usize);
            out.say(tr!(
                "case 1: rows = {}, n = {}, 2 blocks of 64 threads; rows 3 and 40 fully masked (-inf), row 10 masked for its first 20 keys, row 11 with scores x 30",
                "Fall 1: rows = {}, n = {}, 2 Blöcke mit 64 Threads; Zeilen 3 und 40 vollständig maskiert (-inf), Zeile 10 für ihre ersten 20 Keys maskiert, Zeile 11 mit Scores x 30",
                rows,
                n
            ));
            let mut rng = Rng(5);
            let mut s = rng.vec(rows * n, 3.0);
            for j in 0..n {
                s[3 * n + j] = f32::NEG_INFINITY;
                s[40 * n + j] = f32::NEG_INFINITY;
                s[11 * n + j] *= 10.0;
            }
            for j in 0..20 {
                s[10 * n + j] = f32::NEG_INFINITY;
            }
            let v = rng.vec(n * 4, 1.0);
            let mut l = vm_launcher(m);
            setup(l.input_f32("S", &s));
            setup(l.input_f32("V", &v));
            setup(l.output_f32("O", rows * 4));
            setup(l.output_f32("LSE", rows));
            launch(
                &mut l,
                out,
                "online_softmax_pv_f32",
                [2, 1, 1],
                [64, 1, 1],
                0,
                &[
                    Arg::U32(rows as u32),
                    Arg::U32(n as u32),
                    Arg::buf("S"),
                    Arg::buf("V"),
                    Arg::buf("O"),
                    Arg::buf("LSE"),
                ],
            )?;
            let (mut want_o, mut want_lse) = (vec![0.0f64; rows * 4], vec![0.0f64; rows]);
            for r in 0..rows {
                let row = &s[r * n..r * n + n];
                let mx = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
                if mx == f64::NEG_INFINITY {
                    want_lse[r] = f64::NEG_INFINITY;
                    continue;
                }
                let sum: f64 = row.iter().map(|&x| (x as f64 - mx).exp()).sum();
                want_lse[r] = mx + sum.ln();
                for c in 0..4 {
                    want_o[r * 4 + c] =
                        row.iter().enumerate().map(|(j, &x)| (x as f64 - mx).exp() * v[j * 4 + c] as f64).sum::<f64>()
                            / sum;
                }
            }
            let (got_o, got_l) = (setup(l.read_f32("O")), setup(l.read_f32("LSE")));
            let d_o = compare(&got_o, &want_o, 4, 1e-5);
            let d_l = compare(&got_l, &want_lse, 1, 1e-5);
            // What each usual mistake would store, and the first the outputs match.
            let made = if d_o.ok() && d_l.ok() {
                None
            } else {
                let mut usual = Vec::new();
                let rescale = |what: &str| {
                    tr!(
                        "{} not rescaled: when the maximum grows, l and acc must both be multiplied by alpha = 2^(m - base) before p is added (step 2)",
                        "{} nicht umskaliert: wenn das Maximum wächst, müssen l und acc beide mit alpha = 2^(m - basis) multipliziert werden, bevor p addiert wird (Schritt 2)",
                        what
                    )
                };
                for (flaw, hint) in [
                    (L4Flaw::NoRescale, rescale(&tr!("l and acc are", "l und acc werden"))),
                    (L4Flaw::NoRescaleAcc, rescale(&tr!("acc is", "acc wird"))),
                    (L4Flaw::NoRescaleL, rescale(&tr!("l is", "l wird"))),
                ] {
                    let (o, lse) = online_sim(&s, &v, rows, n, flaw);
                    usual.push(Mistake { hint, outputs: vec![o, lse] });
                }
                for (formula, f) in L4_LSE_FORMULAS {
                    let (o, lse) = online_sim(&s, &v, rows, n, L4Flaw::Lse(f));
                    usual.push(Mistake {
                        hint: tr!(
                            "O is right; LSE is not: it is `{}` of the running m and l, but LSE is the natural log of the row's sum, ln 2 * (m + log2 l) with m in base 2 (`LN2 * (m + log2(l))`)",
                            "O stimmt; LSE nicht: es ist `{}` aus dem laufenden m und l, aber LSE ist der natürliche Logarithmus der Zeilensumme, ln 2 * (m + log2 l) mit m zur Basis 2 (`LN2 * (m + log2(l))`)",
                            formula
                        ),
                        outputs: vec![o, lse],
                    });
                }
                mistake_made(&[&got_o, &got_l], usual, 1e-3)
            };
            result(out, &[("O", "row", &d_o), ("LSE", "row", &d_l)], |name, d| {
                let masked = |rows: &[usize]| rows.iter().any(|r| *r == 3 || *r == 40);
                Some(if all_unwritten(d) {
                    tr!(
                        "the kernel does not store into {} yet (the final step)",
                        "der Kernel speichert noch nichts in {} (der letzte Schritt)",
                        name
                    )
                } else if masked(&d.nan_rows) || masked(&d.wrong_rows) {
                    tr!("the fully masked rows 3 and 40: while m is -inf use 0 as the base (step 1), and when l is 0 store O = 0 and LSE = -inf", "die vollständig maskierten Zeilen 3 und 40: solange m -inf ist, nehmen Sie 0 als Basis (Schritt 1), und wenn l 0 ist, speichern Sie O = 0 und LSE = -inf")
                } else if d.nan_rows.contains(&10) || (d.wrong_rows == [10]) {
                    tr!("row 10 starts with 20 masked keys: the base must be 0 while nothing has been seen, or 2^(-inf - -inf) is NaN", "Zeile 10 beginnt mit 20 maskierten Keys: die Basis muss 0 sein, solange nichts gesehen wurde, sonst ist 2^(-inf - -inf) NaN")
                } else {
                    return made.clone();
                })
            })
        },
        out,
    )
}

/// A mistake in lesson 4's kernel, for [`online_sim`].
#[derive(Clone, Copy)]
enum L4Flaw {
    /// l and acc not multiplied by alpha when the maximum grows.
    NoRescale,
    NoRescaleAcc,
    NoRescaleL,
    /// LSE computed from the final m (base 2) and l by this formula.
    Lse(LseOf),
}

/// An LSE from the final m (base 2) and l.
type LseOf = fn(f64, f64) -> f64;

/// LSE formulas a learner writes instead of `LN2 * (m + log2(l))`, as written in Rust.
const L4_LSE_FORMULAS: [(&str, LseOf); 6] = [
    ("m + log2(l)", |m, l| m + l.log2()),
    ("LN2 * m + log2(l)", |m, l| std::f64::consts::LN_2 * m + l.log2()),
    ("m + ln(l)", |m, l| m + l.ln()),
    ("LN2 * log2(l)", |_, l| l.ln()),
    ("LN2 * m", |m, _| std::f64::consts::LN_2 * m),
    ("m * LN2 + ln(l) / LN2", |m, l| std::f64::consts::LN_2 * m + l.ln() / std::f64::consts::LN_2),
];

/// Lesson 4's algorithm in f64 as the solution runs it (scores in base 2, the running maximum,
/// base 0 while it is -inf), with `flaw` made: what a kernel with that mistake stores in O and
/// LSE.
fn online_sim(s: &[f32], v: &[f32], rows: usize, n: usize, flaw: L4Flaw) -> (Vec<f64>, Vec<f64>) {
    let (mut o, mut lse) = (vec![0.0f64; rows * 4], vec![f64::NEG_INFINITY; rows]);
    for r in 0..rows {
        let (mut m, mut l, mut acc) = (f64::NEG_INFINITY, 0.0f64, [0.0f64; 4]);
        for j in 0..n {
            let s2 = s[r * n + j] as f64 * std::f64::consts::LOG2_E;
            let m_new = m.max(s2);
            let base = if m_new == f64::NEG_INFINITY { 0.0 } else { m_new };
            let alpha = (m - base).exp2();
            let (al, aa) = match flaw {
                L4Flaw::NoRescale => (1.0, 1.0),
                L4Flaw::NoRescaleL => (1.0, alpha),
                L4Flaw::NoRescaleAcc => (alpha, 1.0),
                L4Flaw::Lse(_) => (alpha, alpha),
            };
            let p = (s2 - base).exp2();
            l = l * al + p;
            for (c, a) in acc.iter_mut().enumerate() {
                *a = *a * aa + p * v[j * 4 + c] as f64;
            }
            m = m_new;
        }
        if l > 0.0 {
            lse[r] = match flaw {
                L4Flaw::Lse(f) => f(m, l),
                _ => std::f64::consts::LN_2 * (m + l.log2()),
            };
            for c in 0..4 {
                o[r * 4 + c] = acc[c] / l;
            }
        }
    }
    (o, lse)
}

// ---- lesson 5 ----

fn attention_ref(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    sq: usize,
    skv: usize,
    causal: bool,
    scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    const D: usize = 32;
    let (mut o, mut lse) = (vec![0.0f64; sq * D], vec![f64::NEG_INFINITY; sq]);
    for i in 0..sq {
        let end = if causal { (i as i64 + skv as i64 - sq as i64 + 1).clamp(0, skv as i64) as usize } else { skv };
        if end == 0 {
            continue;
        }
        let s: Vec<f64> =
            (0..end).map(|j| scale * (0..D).map(|c| q[i * D + c] as f64 * k[j * D + c] as f64).sum::<f64>()).collect();
        let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = s.iter().map(|x| (x - mx).exp()).sum();
        lse[i] = mx + sum.ln();
        for c in 0..D {
            o[i * D + c] = s.iter().enumerate().map(|(j, x)| (x - mx).exp() * v[j * D + c] as f64).sum::<f64>() / sum;
        }
    }
    (o, lse)
}

/// A mistake in lesson 5's kernel, for [`flash_sim`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum L5Flaw {
    /// The solution (the tests compare it with [`attention_ref`]).
    #[cfg(test)]
    None,
    /// l and acc not multiplied by alpha when the maximum grows.
    NoRescale,
    /// acc only.
    NoRescaleAcc,
    /// l only.
    NoRescaleL,
    /// Keys past seq_kv in the last tile (K and V rows loaded as zeros) not masked: score 0.
    TailUnmasked,
    /// The scores multiplied by `scale`, not `scale * LOG2E`, before exp2.
    NoLog2e,
    /// The scores multiplied by LOG2E only.
    NoScale,
    /// The causal bound `i + seq_kv - seq_q + 1` moved by this many keys.
    CausalShift(i64),
}

/// Lesson 5's algorithm in f64, step by step as the solution runs it (tiles of 64 keys, base
/// 2, the running maximum), with `flaw` made: what a kernel with that mistake stores in O and LSE.
#[allow(clippy::too_many_arguments)]
fn flash_sim(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    sq: usize,
    skv: usize,
    causal: bool,
    scale: f64,
    flaw: L5Flaw,
) -> (Vec<f64>, Vec<f64>) {
    const D: usize = 32;
    let log2e = std::f64::consts::LOG2_E;
    let scale2 = match flaw {
        L5Flaw::NoLog2e => scale,
        L5Flaw::NoScale => log2e,
        _ => scale * log2e,
    };
    let shift = if let L5Flaw::CausalShift(d) = flaw { d } else { 0 };
    let (mut o, mut lse) = (vec![0.0f64; sq * D], vec![f64::NEG_INFINITY; sq]);
    for i in 0..sq {
        let key_end = if causal { (i as i64 + skv as i64 - sq as i64 + 1 + shift).min(skv as i64) } else { skv as i64 };
        let (mut m, mut l, mut acc) = (f64::NEG_INFINITY, 0.0f64, [0.0f64; D]);
        for j in 0..skv.div_ceil(L5_THREADS) * L5_THREADS {
            let real = j < skv;
            let mut s = if real {
                scale2 * (0..D).map(|c| q[i * D + c] as f64 * k[j * D + c] as f64).sum::<f64>()
            } else {
                0.0
            };
            if j as i64 >= key_end && (real || flaw != L5Flaw::TailUnmasked) {
                s = f64::NEG_INFINITY;
            }
            let m_new = m.max(s);
            let base = if m_new == f64::NEG_INFINITY { 0.0 } else { m_new };
            let alpha = (m - base).exp2();
            let p = (s - base).exp2();
            let (al, aa) = match flaw {
                L5Flaw::NoRescale => (1.0, 1.0),
                L5Flaw::NoRescaleL => (1.0, alpha),
                L5Flaw::NoRescaleAcc => (alpha, 1.0),
                _ => (alpha, alpha),
            };
            l = l * al + p;
            for (c, a) in acc.iter_mut().enumerate() {
                *a = p * if real { v[j * D + c] as f64 } else { 0.0 } + *a * aa;
            }
            m = m_new;
        }
        if l > 0.0 {
            lse[i] = std::f64::consts::LN_2 * (m + l.log2());
            for c in 0..D {
                o[i * D + c] = acc[c] / l;
            }
        }
    }
    (o, lse)
}

/// How many leading keys row `i`'s output `got` (32 values) is the attention over: the prefix
/// length `e` (0 for an all-zero row) whose f64 attention matches `got` within 1e-3, if any.
fn keys_seen(q: &[f32], k: &[f32], v: &[f32], i: usize, skv: usize, scale: f64, got: &[f32]) -> Option<usize> {
    const D: usize = 32;
    let near = |a: f64, b: f32| (a - b as f64).abs() <= 1e-3 * a.abs().max(1.0);
    if got.iter().all(|&x| x == 0.0) {
        return Some(0);
    }
    let s: Vec<f64> =
        (0..skv).map(|j| scale * (0..D).map(|c| q[i * D + c] as f64 * k[j * D + c] as f64).sum::<f64>()).collect();
    let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let (mut num, mut den) = ([0.0f64; D], 0.0f64);
    for (j, x) in s.iter().enumerate() {
        let p = (x - mx).exp();
        den += p;
        for (c, n) in num.iter_mut().enumerate() {
            *n += p * v[j * D + c] as f64;
        }
        if num.iter().zip(got).all(|(n, &g)| near(n / den, g)) {
            return Some(j + 1);
        }
    }
    None
}

/// Lesson 5's blocks: two warps, so a missing barrier is a race between them.
const L5_THREADS: usize = 64;
const L5_SMEM: u32 = 2 * L5_THREADS as u32 * 32 * 4;

fn lesson5(m: &Module, out: &mut Out) -> Verdict {
    verdict(
        |out| {
            let cases = [
                (90usize, 150usize, false, "3 key tiles, the last one partial; 2 blocks"),
                (90, 150, true, "causal, bottom-right aligned"),
                (150, 90, true, "causal with seq_q > seq_kv: rows 0-59 see no key (O = 0, LSE = -inf)"),
                (64, 64, false, "one block, one tile"),
            ];
            for (case, (sq, skv, causal, what)) in cases.into_iter().enumerate() {
                let grid = sq.div_ceil(L5_THREADS) as u32;
                out.say(tr!(
                    "case {}: seq_q = {sq}, seq_kv = {skv}, causal = {causal}, {grid} block(s) of {L5_THREADS} threads: {what}",
                    "Fall {}: seq_q = {sq}, seq_kv = {skv}, causal = {causal}, Blöcke: {grid} zu je {L5_THREADS} Threads: {what}",
                    case + 1,
                    what = what_de(what)
                ));
                let mut rng = Rng(21 + case as u64);
                let (q, k, v) = (rng.vec(sq * 32, 1.0), rng.vec(skv * 32, 1.0), rng.vec(skv * 32, 1.0));
                let scale = 1.0 / (32.0f32).sqrt();
                let mut l = vm_launcher(m);
                // Racecheck alone judges the barriers. With initcheck on, a missing barrier after
                // the load stops at the first read of a row the other warp has not stored yet,
                // which names only that read; without it the other warp's store into the row is
                // a write-after-read race, reported with both lines. Unwritten shared memory
                // then reads as NaN, which the comparison catches.
                l.vm().set_initcheck(false);
                setup(l.input_f32("Q", &q));
                setup(l.input_f32("K", &k));
                setup(l.input_f32("V", &v));
                setup(l.output_f32("O", sq * 32));
                setup(l.output_f32("LSE", sq));
                let args = [
                    Arg::U32(sq as u32),
                    Arg::U32(skv as u32),
                    Arg::F32(scale),
                    Arg::U32(causal as u32),
                    Arg::buf("Q"),
                    Arg::buf("K"),
                    Arg::buf("V"),
                    Arg::buf("O"),
                    Arg::buf("LSE"),
                ];
                launch(&mut l, out, "flash_lesson_f32", [grid, 1, 1], [L5_THREADS as u32, 1, 1], L5_SMEM, &args)?;
                let (want_o, want_lse) = attention_ref(&q, &k, &v, sq, skv, causal, scale as f64);
                let got_o = setup(l.read_f32("O"));
                let d_o = compare(&got_o, &want_o, 32, 1e-4);
                let d_l = compare(&setup(l.read_f32("LSE")), &want_lse, 1, 1e-4);
                let blind = sq.saturating_sub(skv); // rows that see no key when causal
                                                    // Rows whose bound `i + seq_kv - seq_q` is below 0 but which saw every key: the
                                                    // bound was computed in u32 and wrapped around.
                let wrapped: Vec<usize> = if causal {
                    d_o.wrong_rows
                        .iter()
                        .copied()
                        .filter(|&r| {
                            r < blind
                                && keys_seen(&q, &k, &v, r, skv, scale as f64, &got_o[r * 32..r * 32 + 32]) == Some(skv)
                        })
                        .collect()
                } else {
                    Vec::new()
                };
                // What each usual mistake would store, and the first the outputs match.
                let made = if d_o.ok() && d_l.ok() {
                    None
                } else {
                    let got_l = setup(l.read_f32("LSE"));
                    let sim = |flaw| flash_sim(&q, &k, &v, sq, skv, causal, scale as f64, flaw);
                    let mistake = |flaw, hint: String| {
                        let (o, lse) = sim(flaw);
                        Mistake { hint, outputs: vec![o, lse] }
                    };
                    let rescale = |what: &str, was: &str| {
                        tr!(
                            "{} not rescaled: when the maximum grows, l and acc must both be multiplied by alpha = 2^(m - base) before p is added ({} is what the output is)",
                            "{} nicht umskaliert: wenn das Maximum wächst, müssen l und acc beide mit alpha = 2^(m - basis) multipliziert werden, bevor p addiert wird ({} ist das, was die Ausgabe ist)",
                            what,
                            was
                        )
                    };
                    let mut usual = vec![
                        mistake(L5Flaw::NoRescale, rescale(&tr!("l and acc are", "l und acc werden"), &tr!("the attention without the rescale", "die Attention ohne das Umskalieren"))),
                        mistake(L5Flaw::NoRescaleAcc, rescale(&tr!("acc is", "acc wird"), &tr!("l rescaled, acc not", "l umskaliert, acc nicht"))),
                        mistake(L5Flaw::NoRescaleL, rescale(&tr!("l is", "l wird"), &tr!("acc rescaled, l not", "acc umskaliert, l nicht"))),
                        mistake(L5Flaw::TailUnmasked, tr!(
                            "keys past seq_kv in the last tile are not masked: their K and V rows were loaded as zeros, so each scores 0 and adds to l - they must score -inf (the output is the attention with those keys in)",
                            "Keys hinter seq_kv in der letzten Kachel werden nicht maskiert: ihre K- und V-Zeilen wurden als Nullen geladen, also bekommt jeder den Score 0 und zählt in l - sie müssen -inf bekommen (die Ausgabe ist die Attention mit diesen Keys)"
                        )),
                        mistake(L5Flaw::NoLog2e, tr!(
                            "the scores are multiplied by scale but not by LOG2E: exp2 needs them in base 2, scale * LOG2E once in step 1",
                            "die Scores werden mit scale multipliziert, aber nicht mit LOG2E: exp2 braucht sie zur Basis 2, einmal scale * LOG2E in Schritt 1"
                        )),
                        mistake(L5Flaw::NoScale, tr!(
                            "the scores are not multiplied by scale: multiply Q's row by scale * LOG2E once in step 1",
                            "die Scores werden nicht mit scale multipliziert: multiplizieren Sie die Zeile von Q einmal in Schritt 1 mit scale * LOG2E"
                        )),
                    ];
                    if causal {
                        for shift in [1i64, -1] {
                            usual.push(mistake(L5Flaw::CausalShift(shift), tr!(
                                "the causal bound is off by one (each row sees one key too many or too few): query i sees key j iff j <= i + seq_kv - seq_q, so keys j < i + seq_kv - seq_q + 1",
                                "die kausale Grenze ist um eins verschoben (jede Zeile sieht einen Key zu viel oder zu wenig): Query i sieht Key j genau dann, wenn j <= i + seq_kv - seq_q, also die Keys j < i + seq_kv - seq_q + 1"
                            )));
                        }
                    }
                    mistake_made(&[&got_o, &got_l], usual, 1e-3)
                };
                result(out, &[("O", "row", &d_o), ("LSE", "row", &d_l)], |name, d| {
                    Some(if !wrapped.is_empty() {
                        tr!(
                            "rows {} see all {} keys, though their causal bound `i + seq_kv - seq_q` is below 0: in u32 the subtraction wraps around (0 - 1 = 4294967295), so the mask lets every key through - compute the bound in i64, or compare `j + seq_q <= i + seq_kv`, which never goes below 0",
                            "die Zeilen {} sehen alle {} Keys, obwohl ihre kausale Grenze `i + seq_kv - seq_q` unter 0 liegt: in u32 läuft die Subtraktion über (0 - 1 = 4294967295), also lässt die Maske jeden Key durch - rechnen Sie die Grenze in i64, oder vergleichen Sie `j + seq_q <= i + seq_kv`, was nie unter 0 fällt",
                            ranges(&wrapped),
                            skv
                        )
                    } else if all_unwritten(d) {
                        tr!(
                            "the kernel does not store into {} yet (step 3)",
                            "der Kernel speichert noch nichts in {} (Schritt 3)",
                            name
                        )
                    } else if !d.unwritten_rows.is_empty() {
                        tr!("rows of the second block were never written: the row is `ctaid_x() * {} + tid_x()`", "Zeilen des zweiten Blocks wurden nie geschrieben: die Zeile ist `ctaid_x() * {} + tid_x()`", L5_THREADS)
                    } else if causal && blind > 0 && (d.nan_rows.iter().chain(&d.wrong_rows).any(|&r| r < blind)) {
                        tr!(
                            "rows 0-{} see no key: O = 0 and LSE = -inf, with base 0 while the maximum is -inf",
                            "die Zeilen 0-{} sehen keinen Key: O = 0 und LSE = -inf, mit Basis 0, solange das Maximum -inf ist",
                            blind - 1
                        )
                    } else {
                        return made.clone();
                    })
                })?;
            }
            Ok(())
        },
        out,
    )
}

// ---- lesson 6 ----

/// Lesson 6's inputs: every bf16 value distinct and exact (multiples of 1/32 and 1/16 up to 4 in
/// magnitude), so a register's content names the elements it holds.
fn l6_q(i: usize, c: usize) -> f32 {
    (i * 16 + c) as f32 / 32.0 - 4.0
}
fn l6_k(j: usize, c: usize) -> f32 {
    (j * 16 + c) as f32 / 16.0 - 4.0
}

/// The bf16 bit pattern of an f32 that bf16 holds exactly.
fn bf16_bits(x: f32) -> u16 {
    debug_assert_eq!(x.to_bits() & 0xffff, 0, "{x} is not exact in bf16");
    (x.to_bits() >> 16) as u16
}

/// Two bf16 in one register, `lo` in bits 0..16.
fn pair(lo: f32, hi: f32) -> u32 {
    bf16_bits(lo) as u32 | (bf16_bits(hi) as u32) << 16
}

/// The m16n8k16 operand layout, written out: what register `r` of lane `l` must hold, as
/// (matrix, row, first column) of the pair it packs. A (Q): `a0` rows g, cols 2t; `a1` rows g+8;
/// `a2` cols 2t+8; `a3` both. B (K, key-major): `b0` key g, cols 2t; `b1` cols 2t+8.
fn l6_slot(a: bool, l: usize, r: usize) -> (usize, usize) {
    let (g, t) = (l / 4, l % 4);
    if a {
        (g + 8 * (r % 2), 2 * t + 8 * (r / 2))
    } else {
        (g, 2 * t + 8 * r)
    }
}

/// What a wrong fragment register holds, in words: which elements, and where they belong.
fn l6_name(a: bool, got: u32) -> Option<String> {
    let (rows, f): (usize, fn(usize, usize) -> f32) = if a { (16, l6_q) } else { (8, l6_k) };
    let regs = if a { 4 } else { 2 };
    let m = if a { "Q" } else { "K" };
    for l in 0..32 {
        for r in 0..regs {
            let (i, c) = l6_slot(a, l, r);
            if i < rows && pair(f(i, c), f(i, c + 1)) == got {
                let reg = if a { format!("a{r}") } else { format!("b{r}") };
                return Some(tr!(
                    "{m}[{i}, {c}..{}], which belongs in {reg} of lane {l}",
                    "{m}[{i}, {c}..{}], das in {reg} von Lane {l} gehört",
                    c + 1
                ));
            }
        }
    }
    None
}

/// S as the mma computes it when its operands are passed in another order: register `r` of A
/// given `a[pa[r]]`, register `r` of B `b[pb[r]]` (every lane the same), from the right
/// fragments.
fn l6_mma_sim(pa: [usize; 4], pb: [usize; 2]) -> Vec<f64> {
    // Element (i, c) of A is in register (i / 8) + 2 * (c / 8) of its lane; with register p in
    // its place it is Q's element at the same position of p's 8 x 8 block.
    let a = |i: usize, c: usize| {
        let p = pa[i / 8 + 2 * (c / 8)];
        l6_q(i % 8 + 8 * (p % 2), c % 8 + 8 * (p / 2)) as f64
    };
    let b = |j: usize, c: usize| l6_k(j, c % 8 + 8 * pb[c / 8]) as f64;
    (0..128).map(|x| (0..16).map(|c| a(x / 8, c) * b(x % 8, c)).sum()).collect()
}

/// With the fragments right: the operand order of the mma whose S is `got`, in words, when it is
/// not a0, a1, a2, a3 and b0, b1.
fn l6_operand_order(got: &[f32]) -> Option<String> {
    let mut orders = Vec::new();
    for x in 0..24usize {
        // The permutations of 0..4, by their Lehmer code.
        let mut rest = vec![0, 1, 2, 3];
        let pa: [usize; 4] = std::array::from_fn(|i| rest.remove(x / [6, 2, 1, 1][i] % (4 - i)));
        for pb in [[0, 1], [1, 0]] {
            if pa != [0, 1, 2, 3] || pb != [0, 1] {
                orders.push((pa, pb));
            }
        }
    }
    orders.into_iter().find(|&(pa, pb)| same_output(got, &l6_mma_sim(pa, pb), 1e-5)).map(|(pa, pb)| {
        let mut names = Vec::new();
        if pa != [0, 1, 2, 3] {
            names.push(pa.map(|p| format!("a{p}")).join(", "));
        }
        if pb != [0, 1] {
            names.push(pb.map(|p| format!("b{p}")).join(", "));
        }
        tr!(
            "the fragments are right, but S is what the mma computes as if its operands were {} in that order: pass a[0], a[1], a[2], a[3] and b[0], b[1] as loaded (step 4)",
            "die Fragmente stimmen, aber S ist das, was die mma berechnet, als wären ihre Operanden {} in dieser Reihenfolge: übergeben Sie a[0], a[1], a[2], a[3] und b[0], b[1] so, wie sie geladen wurden (Schritt 4)",
            names.join(tr!(" and ", " und ").as_str())
        )
    })
}

/// Whether every written value of S is one of the right S's values (all distinct), some in the
/// wrong place: the mma computed right and the store of D misplaced them.
fn l6_misplaced(got: &[f32], want: &[f64]) -> bool {
    let written: Vec<f32> = got.iter().copied().filter(|g| g.to_bits() != OUTPUT_POISON).collect();
    !written.is_empty()
        && written.iter().all(|&g| want.iter().any(|&w| (g as f64 - w).abs() <= 1e-5 * w.abs().max(1.0)))
}

fn lesson6(m: &Module, out: &mut Out) -> Verdict {
    verdict(
        |out| {
            no_unordered_shared_read(m, out)?;
            out.say(tr!(
                "case 1: Q 16 x 16, K 8 x 16 (bf16, every value distinct), 1 block of 32 threads: S = Q Kᵀ, 16 x 8",
                "Fall 1: Q 16 x 16, K 8 x 16 (bf16, jeder Wert verschieden), 1 Block mit 32 Threads: S = Q Kᵀ, 16 x 8"
            ));
            let q: Vec<u8> = (0..256).flat_map(|x| bf16_bits(l6_q(x / 16, x % 16)).to_le_bytes()).collect();
            let k: Vec<u8> = (0..128).flat_map(|x| bf16_bits(l6_k(x / 16, x % 16)).to_le_bytes()).collect();
            let mut l = vm_launcher(m);
            setup(l.input_bytes("Q", &q));
            setup(l.input_bytes("K", &k));
            setup(l.output_f32("S", 128));
            setup(l.output_f32("frag_a", 128));
            setup(l.output_f32("frag_b", 64));
            let args = [Arg::buf("Q"), Arg::buf("K"), Arg::buf("S"), Arg::buf("frag_a"), Arg::buf("frag_b")];
            launch(&mut l, out, "qk_mma_bf16", [1, 1, 1], [32, 1, 1], 768, &args)?;
            let words = |name: &str| -> Vec<u32> {
                setup(l.read_bytes(name)).chunks(4).map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])).collect()
            };
            let (fa, fb) = (words("frag_a"), words("frag_b"));
            // The fragments, lane by lane: the first register that differs, with what it holds.
            let mut frag_hint = None;
            let mut frags_ok = true;
            for (a, got, regs) in [(true, &fa, 4usize), (false, &fb, 2)] {
                let name = if a { "frag_a" } else { "frag_b" };
                let want: Vec<u32> = (0..32 * regs)
                    .map(|x| {
                        let (i, c) = l6_slot(a, x / regs, x % regs);
                        if a {
                            pair(l6_q(i, c), l6_q(i, c + 1))
                        } else {
                            pair(l6_k(i, c), l6_k(i, c + 1))
                        }
                    })
                    .collect();
                if got.iter().all(|&w| w == OUTPUT_POISON) {
                    frags_ok = false;
                    out.say(tr!(
                        "  {}: never written - every register still holds the poison 0x{:08X} (step 5)",
                        "  {}: nie geschrieben - alle Register enthalten noch das Gift 0x{:08X} (Schritt 5)",
                        name,
                        OUTPUT_POISON
                    ));
                    continue;
                }
                let bad: Vec<usize> = (0..want.len()).filter(|&x| got[x] != want[x]).collect();
                if bad.is_empty() {
                    out.say(tr!(
                        "  {}: every lane's registers match the layout",
                        "  {}: die Register jeder Lane stimmen mit dem Layout überein",
                        name
                    ));
                    continue;
                }
                frags_ok = false;
                let lanes: Vec<usize> = {
                    let mut v: Vec<usize> = bad.iter().map(|x| x / regs).collect();
                    v.dedup();
                    v
                };
                let x = bad[0];
                let (lane, r) = (x / regs, x % regs);
                let reg = if a { format!("a{r}") } else { format!("b{r}") };
                let (i, c) = l6_slot(a, lane, r);
                let mat = if a { "Q" } else { "K" };
                let holds = l6_name(a, got[x]).unwrap_or_else(|| {
                    tr!("0x{:08X}, no pair of {} at all", "0x{:08X}, gar kein Paar aus {}", got[x], mat)
                });
                out.say(tr!(
                    "  {}: {} of {} registers differ, in lanes {}",
                    "  {}: {} von {} Registern weichen ab, in den Lanes {}",
                    name,
                    bad.len(),
                    want.len(),
                    ranges(&lanes)
                ));
                if frag_hint.is_none() {
                    frag_hint = Some(tr!(
                        "lane {lane}, register {reg} holds {holds}; {reg} of lane {lane} must hold {mat}[{i}, {c}..{}] (group g = {}, t = {})",
                        "Lane {lane}, Register {reg} enthält {holds}; {reg} von Lane {lane} muss {mat}[{i}, {c}..{}] enthalten (Gruppe g = {}, t = {})",
                        c + 1,
                        lane / 4,
                        lane % 4
                    ));
                }
            }
            let mut want_s = vec![0.0f64; 128];
            for i in 0..16 {
                for j in 0..8 {
                    want_s[i * 8 + j] = (0..16).map(|c| l6_q(i, c) as f64 * l6_k(j, c) as f64).sum();
                }
            }
            let got_s = setup(l.read_f32("S"));
            let d = compare(&got_s, &want_s, 8, 1e-5);
            if d.ok() && frags_ok {
                out.say("  ok");
                return Ok(());
            }
            if !d.ok() {
                explain(out, "S", "row", &d);
            }
            let hint = if let Some(h) = frag_hint {
                h
            } else if all_unwritten(&d) {
                tr!(
                    "the kernel does not store into S (or the fragments) yet (step 5)",
                    "der Kernel speichert noch nichts in S (oder die Fragmente) (Schritt 5)"
                )
            } else if !frags_ok {
                tr!(
                    "store every lane's A and B registers: frag_a[lane * 4 + r], frag_b[lane * 2 + r] (step 5)",
                    "speichern Sie die A- und B-Register jeder Lane: frag_a[lane * 4 + r], frag_b[lane * 2 + r] (Schritt 5)"
                )
            } else if let Some(h) = l6_operand_order(&got_s) {
                h
            } else if l6_misplaced(&got_s, &want_s) {
                tr!(
                    "the fragments are right and every value of S was computed, but stored in the wrong place: d[e] is S[g + 8 * (e / 2), 2t + e % 2]",
                    "die Fragmente stimmen und jeder Wert von S wurde berechnet, aber an der falschen Stelle gespeichert: d[e] ist S[g + 8 * (e / 2), 2t + e % 2]"
                )
            } else {
                not_a_usual_mistake()
            };
            out.say(tr!("  what to look at: {}", "  worauf Sie achten sollten: {}", hint));
            Err(Verdict::Wrong)
        },
        out,
    )
}

/// The PTX lines of the first shared-memory read by `ldmatrix` or `ld.shared` that follows a
/// shared-memory write (`st.shared`, `cp.async`) in `ptx` with no barrier (`bar.sync`,
/// `barrier.sync`, `bar.warp.sync`) between them, in the order of the text.
///
/// Lessons 6 and 7 run one warp, and the VM's race check sees races between warps only. Within
/// a warp the PTX memory model still orders one lane's store to shared memory before another
/// lane's load only through a barrier (`bar.sync`, or `bar.warp.sync`, `__syncwarp`): the lanes
/// of a warp need not run in step. Every shared read of these kernels is an `ldmatrix`, whose
/// lanes read rows other lanes stored, so a write followed by a read with no barrier between
/// them in the (straight-line) PTX is that race.
fn unordered_shared_read(ptx: &str) -> Option<(usize, usize)> {
    let mut write = None;
    for (i, line) in ptx.lines().enumerate() {
        let t = line.trim_start();
        if ["bar.sync", "barrier.sync", "bar.warp.sync", "barrier.cta.sync", "bar.cta.sync"]
            .iter()
            .any(|b| t.starts_with(b))
        {
            write = None;
        } else if t.starts_with("st.shared") || t.starts_with("cp.async.ca.") || t.starts_with("cp.async.cg.") {
            write.get_or_insert(i + 1);
        } else if t.starts_with("ldmatrix") || t.starts_with("ld.shared") {
            if let Some(w) = write {
                return Some((w, i + 1));
            }
        }
    }
    None
}

/// [`unordered_shared_read`] in the kernel's PTX, reported as a finding with both Rust lines.
fn no_unordered_shared_read(m: &Module, out: &mut Out) -> Result<(), Verdict> {
    let Some((w, r)) = out.ptx.as_deref().and_then(unordered_shared_read) else { return Ok(()) };
    let at = |line: usize| m.source_of(line).map(|s| s.to_string()).unwrap_or_else(|| format!("PTX line {line}"));
    out.say(tr!(
        "  check: a shared-memory read with no barrier after the write - another lane's store is not ordered before it",
        "  Prüfung: ein Lesen von Shared Memory ohne Barriere nach dem Schreiben - der Speicherbefehl einer anderen Lane ist nicht davor geordnet"
    ));
    out.say(tr!("    write    {} (PTX line {})", "    Schreiben {} (PTX-Zeile {})", at(w), w));
    out.say(tr!("    read     {} (PTX line {})", "    Lesen     {} (PTX-Zeile {})", at(r), r));
    out.say(tr!(
        "  what to look at: a `sync_threads()` is missing between filling the shared tile and the first ldmatrix: each lane of ldmatrix reads rows other lanes stored, and even within one warp a store by one lane is guaranteed visible to another only after a barrier (the lanes of a warp need not run in step)",
        "  worauf Sie achten sollten: zwischen dem Füllen der Shared-Kachel und dem ersten ldmatrix fehlt ein `sync_threads()`: jede Lane von ldmatrix liest Zeilen, die andere Lanes gespeichert haben, und auch innerhalb eines Warps ist der Speicherbefehl einer Lane für eine andere erst nach einer Barriere sicher sichtbar (die Lanes eines Warps laufen nicht unbedingt im Gleichschritt)"
    ));
    Err(Verdict::Finding)
}

// ---- lesson 7 ----

/// Lesson 7's tile: 64 rows of 64 bf16 (8 chunks of 16 bytes per row). The kernel only moves
/// bits, so each element holds its own index as its bit pattern: a register names its elements.
fn l7_k(row: usize, col: usize) -> u16 {
    (row * 64 + col) as u16
}

/// What lane `lane` must hold in register `m` of the `ldmatrix_x4` of row group `rg` and half
/// `half`: (row, first column) of the pair.
fn l7_slot(rg: usize, half: usize, lane: usize, m: usize) -> (usize, usize) {
    (rg * 8 + lane / 4, (half * 4 + m) * 8 + 2 * (lane % 4))
}

fn lesson7(m: &Module, out: &mut Out) -> Verdict {
    verdict(
        |out| {
            no_unordered_shared_read(m, out)?;
            out.say(tr!(
                "case 1: K 64 x 64 (bf16, every element its own bit pattern), 1 block of 32 threads: 16 ldmatrix_x4 from the shared tile",
                "Fall 1: K 64 x 64 (bf16, jedes Element mit eigenem Bitmuster), 1 Block mit 32 Threads: 16 ldmatrix_x4 aus der Shared-Kachel"
            ));
            let k: Vec<u8> = (0..64 * 64).flat_map(|x| l7_k(x / 64, x % 64).to_le_bytes()).collect();
            let mut l = vm_launcher(m);
            l.vm().set_bank_conflicts(true);
            setup(l.input_bytes("K", &k));
            setup(l.output_f32("frag", 2048));
            let args = [Arg::buf("K"), Arg::buf("frag")];
            let stats = launch_stats(&mut l, out, "swizzle_tile_bf16", [1, 1, 1], [32, 1, 1], 8192, &args)?;
            let got: Vec<u32> =
                setup(l.read_bytes("frag")).chunks(4).map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])).collect();
            let want = |x: usize| {
                let (rg, half, lane, m) = (x / 256, x / 128 % 2, x / 4 % 32, x % 4);
                let (i, c) = l7_slot(rg, half, lane, m);
                l7_k(i, c) as u32 | (l7_k(i, c + 1) as u32) << 16
            };
            if got.iter().all(|&w| w == OUTPUT_POISON) {
                out.say(tr!(
                    "  frag: never written - every register still holds the poison 0x{:08X} (step 3)",
                    "  frag: nie geschrieben - alle Register enthalten noch das Gift 0x{:08X} (Schritt 3)",
                    OUTPUT_POISON
                ));
                out.say(tr!(
                    "  what to look at: store the four registers of every ldmatrix_x4: frag[((rg * 2 + half) * 32 + lane) * 4 + m] (step 3)",
                    "  worauf Sie achten sollten: speichern Sie die vier Register jedes ldmatrix_x4: frag[((rg * 2 + half) * 32 + lane) * 4 + m] (Schritt 3)"
                ));
                return Err(Verdict::Wrong);
            }
            let bad: Vec<usize> = (0..got.len()).filter(|&x| got[x] != want(x)).collect();
            if let Some(&x) = bad.first() {
                let (rg, half, lane, m) = (x / 256, x / 128 % 2, x / 4 % 32, x % 4);
                let (i, c) = l7_slot(rg, half, lane, m);
                let v = got[x] & 0xffff;
                let holds = if got[x] >> 16 == v + 1 && v < 4096 {
                    format!("K[{}, {}..{}]", v / 64, v % 64, v % 64 + 1)
                } else {
                    format!("0x{:08X}", got[x])
                };
                out.say(tr!(
                    "  frag: {} of {} registers differ; the first: ldmatrix of row group {rg}, half {half}, lane {lane}, r[{m}] holds {holds}, want K[{i}, {c}..{}]",
                    "  frag: {} von {} Registern weichen ab; das erste: ldmatrix von Zeilengruppe {rg}, Hälfte {half}, Lane {lane}, r[{m}] enthält {holds}, erwartet K[{i}, {c}..{}]",
                    bad.len(),
                    got.len(),
                    c + 1
                ));
                out.say(tr!(
                    "  what to look at: the load must find every chunk where the store put it - `cp.async` and `ldmatrix` both take the address from slot(row, chunk), with the same row and chunk (step 2: lane l names row rg * 8 + l % 8, chunk half * 4 + l / 8)",
                    "  worauf Sie achten sollten: das Laden muss jeden Chunk dort finden, wo das Speichern ihn abgelegt hat - `cp.async` und `ldmatrix` nehmen die Adresse beide von slot(row, chunk), mit derselben Zeile und demselben Chunk (Schritt 2: Lane l nennt Zeile rg * 8 + l % 8, Chunk half * 4 + l / 8)"
                ));
                return Err(Verdict::Wrong);
            }
            out.say(tr!(
                "  frag: every register of every ldmatrix holds the right pair",
                "  frag: jedes Register jedes ldmatrix enthält das richtige Paar"
            ));
            let (waves, ideal): (u64, u64) =
                stats.bank_conflicts.iter().fold((0, 0), |(w, i), b| (w + b.wavefronts, i + b.ideal));
            // By source line (an unrolled loop is many PTX lines of one Rust line), in order.
            // The `ldmatrix` is memattn's inlined helper (`mma.rs`): name the learner's call of it.
            let call = out.src.as_ref().and_then(|p| {
                let text = std::fs::read_to_string(paths::root().join(p)).ok()?;
                let n = text.lines().position(|l| l.split("//").next().unwrap_or("").contains("ldmatrix_x4("))?;
                Some(format!("{}:{}", p.display(), n + 1))
            });
            for (at, b) in
                ptx_vm::BankConflicts::by_source(&stats.bank_conflicts).into_iter().filter(|(_, b)| b.extra() > 0)
            {
                let at = match (&b.source, &call) {
                    (Some(s), Some(c)) if s.file.ends_with("mma.rs") => {
                        tr!("the ldmatrix_x4 of {c}", "dem ldmatrix_x4 in {c}")
                    }
                    _ => at,
                };
                out.say(tr!(
                    "  bank conflicts at {at}: {} wavefronts where {} would do ({:.1}-way), {} warp-wide executions",
                    "  Bank-Konflikte bei {at}: {} Wavefronts, wo {} genügten ({:.1}-fach), {} warpweite Ausführungen",
                    b.wavefronts,
                    b.ideal,
                    b.ways(),
                    b.executions
                ));
            }
            if waves > ideal {
                out.say(tr!(
                    "  shared memory: {waves} wavefronts in all; the swizzled tile takes {ideal}, one per phase",
                    "  Shared Memory: insgesamt {waves} Wavefronts; die geswizzelte Kachel braucht {ideal}, einen pro Phase"
                ));
                out.say(tr!(
                    "  what to look at: the values are right, the layout is slow - a row is 128 bytes, so the same chunk of the 8 rows one ldmatrix phase reads lies in the same 4 banks (an 8-way conflict); store and load chunk c of row r at r * 8 + (c ^ (r % 8)) in slot() (step 1)",
                    "  worauf Sie achten sollten: die Werte stimmen, das Layout ist langsam - eine Zeile hat 128 Bytes, also liegt derselbe Chunk der 8 Zeilen, die eine ldmatrix-Phase liest, in denselben 4 Banks (ein 8-facher Konflikt); speichern und laden Sie Chunk c von Zeile r in slot() an r * 8 + (c ^ (r % 8)) (Schritt 1)"
                ));
                return Err(Verdict::Wrong);
            }
            out.say(tr!(
                "  shared memory: {waves} wavefronts, one per phase - no bank conflicts",
                "  Shared Memory: {waves} Wavefronts, einer pro Phase - keine Bank-Konflikte"
            ));
            out.say("  ok");
            Ok(())
        },
        out,
    )
}

// ---- lesson 8 ----

/// Lesson 8's block size.
const L8_THREADS: usize = 256;

/// A mistake in lesson 8's kernel, for [`reduce_sim`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum L8Flaw {
    None,
    /// The loop goes up by the block's threads only (`i += 256`): block `b` sums every element
    /// from `b * 256` on, so the blocks overlap.
    BlockStride,
    /// The loop goes up by the number of blocks (`i += nctaid_x()`).
    GridStride,
    /// The loop starts at `tid_x()`, without the block: every block sums the same elements.
    NoBlockStart,
    /// The tree starts at `half = 64`: each block's sum holds its threads 0-127 only.
    TreeFrom64,
}

/// The sum each block of lesson 8's kernel with `flaw` adds, for `x[..n]` and `grid` blocks
/// (elements a thread would read past `n` are not read: the VM stops that kernel first).
fn reduce_sim(x: &[f32], grid: usize, flaw: L8Flaw) -> Vec<f64> {
    let n = x.len();
    let all = L8_THREADS * grid;
    let (start, stride): (fn(usize, usize) -> usize, usize) = match flaw {
        L8Flaw::BlockStride => (|b, t| b * L8_THREADS + t, L8_THREADS),
        L8Flaw::GridStride => (|b, t| b * L8_THREADS + t, grid),
        L8Flaw::NoBlockStart => (|_, t| t, all),
        L8Flaw::None | L8Flaw::TreeFrom64 => (|b, t| b * L8_THREADS + t, all),
    };
    let summed = if flaw == L8Flaw::TreeFrom64 { L8_THREADS / 2 } else { L8_THREADS };
    (0..grid)
        .map(|b| {
            (0..summed)
                .map(|t| x.iter().skip(start(b, t)).step_by(stride).take(n).map(|&v| v as f64).sum::<f64>())
                .sum()
        })
        .collect()
}

fn lesson8(m: &Module, out: &mut Out) -> Verdict {
    verdict(
        |out| {
            let cases = [
                (100_000u32, 8u32, "many elements per thread: 49 rounds of the grid-stride loop"),
                (1000, 8, "fewer elements than threads: 1048 of the 2048 threads have none"),
                (70_001, 3, "3 blocks, n odd"),
            ];
            for (case, (n, grid, what)) in cases.into_iter().enumerate() {
                out.say(tr!(
                    "case {}: n = {n}, {grid} blocks of 256 threads: {what}",
                    "Fall {}: n = {n}, {grid} Blöcke mit 256 Threads: {what}",
                    case + 1,
                    what = what_de(what)
                ));
                let x: Vec<f32> = Rng(11 + case as u64).vec(n as usize, 1.0).iter().map(|v| v + 0.5).collect();
                let mut l = vm_launcher(m);
                setup(l.input_f32("x", &x));
                setup(l.input_f32("total", &[0.0]));
                let args = [Arg::U32(n), Arg::buf("x"), Arg::buf("total")];
                let stats = launch_stats(&mut l, out, "block_sum_f32", [grid, 1, 1], [256, 1, 1], 1024, &args)?;
                let got = setup(l.read_f32("total"))[0];
                let want: f64 = x.iter().map(|&v| v as f64).sum();
                // The blocks add in any order and each block's sum is rounded to f32: allow what
                // f32 sums of this many terms can differ by.
                let tol = 1e-5 * x.iter().map(|&v| v.abs() as f64).sum::<f64>();
                let close = |w: f64| got.is_finite() && (got as f64 - w).abs() <= tol;
                // Every atomic add (and every store) writes 4 bytes: a right kernel writes 4 per block.
                let adds = stats.global_bytes_written / 4;
                if close(want) && adds <= grid as u64 {
                    out.say(tr!(
                        "  ok: total = {got} (f64 reference {want:.3}), {adds} atomic adds for {grid} blocks",
                        "  ok: total = {got} (f64-Referenz {want:.3}), {adds} atomare Additionen für {grid} Blöcke"
                    ));
                    continue;
                }
                if close(want) {
                    out.say(tr!(
                        "  total: right ({got}), but with {adds} atomic adds for {grid} blocks",
                        "  total: richtig ({got}), aber mit {adds} atomaren Additionen für {grid} Blöcke"
                    ));
                    out.say(tr!(
                        "  what to look at: every thread adds to total on its own: the sum is right, but the adds to one address wait for each other (on a GPU they are done one after another, {adds} of them); sum in the block first (steps 2-3) and let thread 0 add once per block (step 4)",
                        "  worauf Sie achten sollten: jeder Thread addiert selbst zu total: die Summe stimmt, aber die Additionen auf eine Adresse warten aufeinander (auf einer GPU laufen sie nacheinander, {adds} Stück); summieren Sie zuerst im Block (Schritte 2-3) und lassen Sie Thread 0 einmal pro Block addieren (Schritt 4)"
                    ));
                    return Err(Verdict::Wrong);
                }
                if got == 0.0 && adds == 0 {
                    out.say(tr!(
                        "  total: still 0 - no block added to it (expected {want:.3})",
                        "  total: noch 0 - kein Block hat dazu addiert (erwartet {want:.3})"
                    ));
                    out.say(tr!(
                        "  what to look at: steps 1-4 - the kernel does not add to total yet; thread 0 of each block adds its block's sum with `red_add_f32(total, ...)`",
                        "  worauf Sie achten sollten: Schritte 1-4 - der Kernel addiert noch nichts zu total; Thread 0 jedes Blocks addiert die Summe seines Blocks mit `red_add_f32(total, ...)`"
                    ));
                    return Err(Verdict::Wrong);
                }
                out.say(tr!(
                    "  total: got {got}, expected {want:.3} (within {tol:.1e}: the blocks add in any order); {adds} adds or stores for {grid} blocks",
                    "  total: erhalten {got}, erwartet {want:.3} (auf {tol:.1e} genau: die Blöcke addieren in beliebiger Reihenfolge); {adds} Additionen oder Speicherungen für {grid} Blöcke"
                ));
                let sim = |f| reduce_sim(&x, grid as usize, f);
                let block_sums = sim(L8Flaw::None);
                let hint = if !got.is_finite() {
                    None
                } else if block_sums.iter().any(|&s| close(s)) && !close(want) {
                    Some(tr!(
                        "total is one block's sum: the blocks stored their sums (`*total = ...`) instead of adding them, and the last one won; add with `red_add_f32(total, ...)` (step 4)",
                        "total ist die Summe eines einzigen Blocks: die Blöcke haben ihre Summen gespeichert (`*total = ...`) statt sie zu addieren, und der letzte hat gewonnen; addieren Sie mit `red_add_f32(total, ...)` (Schritt 4)"
                    ))
                } else {
                    [
                        (L8Flaw::BlockStride, tr!(
                            "the loop goes up by 256, the threads of one block, so block b sums every element from b * 256 on and the blocks count elements more than once: the stride is every thread of the grid, `256 * nctaid_x()` (step 1)",
                            "die Schleife geht um 256 weiter, die Threads eines Blocks, also summiert Block b jedes Element ab b * 256, und die Blöcke zählen Elemente mehrfach: die Schrittweite ist die Zahl aller Threads im Grid, `256 * nctaid_x()` (Schritt 1)"
                        )),
                        (L8Flaw::GridStride, tr!(
                            "the loop goes up by `nctaid_x()`, the number of blocks: the stride is the number of threads in the grid, `256 * nctaid_x()` (step 1)",
                            "die Schleife geht um `nctaid_x()` weiter, die Zahl der Blöcke: die Schrittweite ist die Zahl der Threads im Grid, `256 * nctaid_x()` (Schritt 1)"
                        )),
                        (L8Flaw::NoBlockStart, tr!(
                            "every block summed the same elements: the loop starts at `tid_x()` without the block; start at `ctaid_x() * 256 + tid_x()` (step 1)",
                            "jeder Block hat dieselben Elemente summiert: die Schleife beginnt bei `tid_x()` ohne den Block; beginnen Sie bei `ctaid_x() * 256 + tid_x()` (Schritt 1)"
                        )),
                        (L8Flaw::TreeFrom64, tr!(
                            "each block's sum holds only the values of its threads 0-127: the tree starts at `half = 128`, half of the 256 threads (step 3)",
                            "die Summe jedes Blocks enthält nur die Werte seiner Threads 0-127: der Baum beginnt bei `half = 128`, der Hälfte der 256 Threads (Schritt 3)"
                        )),
                    ]
                    .into_iter()
                    .find(|(f, _)| close(sim(*f).iter().sum()))
                    .map(|(_, h)| h)
                };
                let early = early_return_in(out, None).map(|e| early_return_hint(Some(&e)));
                out.say(tr!(
                    "  what to look at: {}",
                    "  worauf Sie achten sollten: {}",
                    early.or(hint).unwrap_or_else(not_a_usual_mistake)
                ));
                return Err(Verdict::Wrong);
            }
            Ok(())
        },
        out,
    )
}

// ---- lesson 9 ----

/// Lesson 9's tile edge: blocks of 32 x 32 threads, a warp's lanes along a row.
const L9_TILE: usize = 32;
/// Lesson 9's dynamic shared memory: the tile, 32 rows of 33 floats.
const L9_SMEM: u32 = (L9_TILE * (L9_TILE + 1) * 4) as u32;
/// The sector efficiency every global read and write of lesson 9's kernel must reach: at least
/// half the bytes it moves are used. The solution's lowest is 76.3 % (case 3's reads of x: rows
/// of 45 floats are not 32-byte aligned, and the edge tiles' 13-float rows fill their sectors
/// less); an access whose lanes each need a sector of their own is at 12.5 %.
const L9_MIN_EFFICIENCY: f64 = 0.5;

/// A mistake in lesson 9's kernel, for [`transpose_sim`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum L9Flaw {
    None,
    /// Step 3 reads the tile at `ty * 33 + tx`, the word the thread stored itself: each tile is
    /// copied to its transposed place, but not turned.
    SwappedTile,
}

/// What lesson 9's kernel with `flaw` stores in `y` (`cols x rows`) for `x` (`rows x cols`), the
/// poison where it stores nothing.
fn transpose_sim(x: &[f32], rows: usize, cols: usize, flaw: L9Flaw) -> Vec<f64> {
    const T: usize = L9_TILE;
    let mut y = vec![KEPT_POISON; cols * rows];
    for j in 0..cols {
        for i in 0..rows {
            let (r, c) = match flaw {
                L9Flaw::None => (i, j),
                // Thread (tx, ty) = (i % 32, j % 32) of block (j / 32, i / 32) reads the word it
                // stored, x[i / 32 * 32 + ty][j / 32 * 32 + tx].
                L9Flaw::SwappedTile => (i / T * T + j % T, j / T * T + i % T),
            };
            if r < rows && c < cols {
                y[j * rows + i] = x[r * cols + c] as f64;
            }
        }
    }
    y
}

/// Lesson 9's global accesses by Rust line, reads and writes apart (one Rust line can do both):
/// (a write?, `file:line`, their sectors merged), in the order of the PTX.
fn l9_accesses(stats: &ptx_vm::LaunchStats, ptx: &str) -> Vec<(bool, String, ptx_vm::Sectors)> {
    let lines: Vec<&str> = ptx.lines().collect();
    let mut out: Vec<(bool, String, ptx_vm::Sectors)> = Vec::new();
    for s in &stats.sectors {
        let write = lines.get(s.line.wrapping_sub(1)).is_some_and(|l| l.trim_start().starts_with("st."));
        let at = s.source.as_ref().map(|l| format!("{}:{}", l.file, l.line)).unwrap_or(format!("PTX line {}", s.line));
        match out.iter_mut().find(|(w, a, _)| *w == write && *a == at) {
            Some((_, _, m)) => {
                m.executions += s.executions;
                m.useful_bytes += s.useful_bytes;
                m.sectors += s.sectors;
            }
            None => out.push((write, at, s.clone())),
        }
    }
    out
}

/// Lesson 9's reading of a VM finding, from the thread and block it names: which step's guard
/// or index the thread got wrong, or the missing barrier. `has_barrier`: the PTX has a
/// `bar.sync`.
fn l9_finding_hint(f: &ptx_vm::Finding, rows: usize, cols: usize, has_barrier: bool) -> Option<String> {
    const T: usize = L9_TILE;
    let (tx, ty) = (f.thread[0] as usize, f.thread[1] as usize);
    let (bx, by) = (f.block[0] as usize, f.block[1] as usize);
    let who =
        tr!("thread (tx {tx}, ty {ty}) of block ({bx}, {by})", "Thread (tx {tx}, ty {ty}) von Block ({bx}, {by})");
    // Step 1's element of x and step 3's element of y.
    let (r, c) = (by * T + ty, bx * T + tx);
    let (j, i) = (bx * T + ty, by * T + tx);
    let outside_x = r >= rows || c >= cols;
    let outside_y = j >= cols || i >= rows;
    Some(match f.kind.as_str() {
        "out-of-bounds global load" if outside_x => tr!(
            "{who} reads x at row r = {r}, column c = {c}, past the edge of x ({rows} x {cols}): the tiles at the right and bottom edges are partial, so the read needs `r < rows && c < cols` (step 1)",
            "{who} liest x in Zeile r = {r}, Spalte c = {c}, hinter dem Rand von x ({rows} x {cols}): die Kacheln am rechten und unteren Rand sind unvollständig, also braucht das Lesen `r < rows && c < cols` (Schritt 1)"
        ),
        "out-of-bounds global load" => tr!(
            "{who} reads past the end of x although its row r = {r} and column c = {c} lie inside: the index of x[r][c] is `r * cols + c` (step 1)",
            "{who} liest hinter dem Ende von x, obwohl seine Zeile r = {r} und Spalte c = {c} innerhalb liegen: der Index von x[r][c] ist `r * cols + c` (Schritt 1)"
        ),
        "out-of-bounds global store" if outside_y => tr!(
            "{who} writes y at row j = {j}, column i = {i}, past the edge of y ({cols} x {rows}): the write needs `j < cols && i < rows` (step 3)",
            "{who} schreibt y in Zeile j = {j}, Spalte i = {i}, hinter dem Rand von y ({cols} x {rows}): das Schreiben braucht `j < cols && i < rows` (Schritt 3)"
        ),
        "out-of-bounds global store" => tr!(
            "{who} writes past the end of y although its row j = {j} and column i = {i} lie inside: y is `cols x rows`, the index of y[j][i] is `j * rows + i` (step 3)",
            "{who} schreibt hinter das Ende von y, obwohl seine Zeile j = {j} und Spalte i = {i} innerhalb liegen: y ist `cols x rows`, der Index von y[j][i] ist `j * rows + i` (Schritt 3)"
        ),
        "uninitialized shared memory read" if outside_y => tr!(
            "{who} would write y at row j = {j}, column i = {i}, past the edge of y ({cols} x {rows}), and reads a word of the tile no thread stored (x has no element there): the write, and the read of the tile with it, needs `j < cols && i < rows` (step 3)",
            "{who} würde y in Zeile j = {j}, Spalte i = {i} schreiben, hinter dem Rand von y ({cols} x {rows}), und liest ein Wort der Kachel, das kein Thread gespeichert hat (x hat dort kein Element): das Schreiben, und mit ihm das Lesen der Kachel, braucht `j < cols && i < rows` (Schritt 3)"
        ),
        "uninitialized shared memory read" if has_barrier => tr!(
            "{who} reads a word of the tile no thread stored: in step 1 thread (tx, ty) stores x[r][c] at `ty * 33 + tx`, so y[j][i] = x[i][j] is the word thread (ty, tx) stored, at `tx * 33 + ty` (step 3)",
            "{who} liest ein Wort der Kachel, das kein Thread gespeichert hat: in Schritt 1 speichert Thread (tx, ty) x[r][c] an `ty * 33 + tx`, also ist y[j][i] = x[i][j] das Wort, das Thread (ty, tx) gespeichert hat, an `tx * 33 + ty` (Schritt 3)"
        ),
        "uninitialized shared memory read" | "shared memory race" => tr!(
            "{who} reads the word of the tile that thread (tx {ty}, ty {tx}), in warp {tx} of the block, stores in step 1, with no barrier between the store and the read: `sync_threads()` after step 1 makes every warp wait until the whole tile is stored (step 2)",
            "{who} liest das Wort der Kachel, das Thread (tx {ty}, ty {tx}) in Warp {tx} des Blocks in Schritt 1 speichert, ohne Barriere zwischen Speichern und Lesen: `sync_threads()` nach Schritt 1 lässt jeden Warp warten, bis die ganze Kachel gespeichert ist (Schritt 2)"
        ),
        _ => return None,
    })
}

fn lesson9(m: &Module, out: &mut Out) -> Verdict {
    const T: usize = L9_TILE;
    let has_barrier = out.ptx.as_deref().is_some_and(|p| p.contains("bar.sync") || p.contains("barrier.sync"));
    verdict(
        |out| {
            let cases = [
                (64u32, 96u32, "whole tiles: 3 x 2 blocks"),
                (100, 75, "partial tiles at the right and bottom edges: 3 x 4 blocks"),
                (70, 45, "rows of 45 floats, not 32-byte aligned: 2 x 3 blocks"),
            ];
            for (case, (rows, cols, what)) in cases.into_iter().enumerate() {
                let grid = [cols.div_ceil(T as u32), rows.div_ceil(T as u32), 1];
                out.say(tr!(
                    "case {}: x {rows} x {cols}, grid {:?} of 32 x 32 threads: {what}",
                    "Fall {}: x {rows} x {cols}, Grid {:?} aus 32 x 32 Threads: {what}",
                    case + 1,
                    &grid[..2],
                    what = what_de(what)
                ));
                let (r, c) = (rows as usize, cols as usize);
                let x = Rng(21 + case as u64).vec(r * c, 1.0);
                let mut l = vm_launcher(m);
                l.vm().set_sectors(true);
                l.vm().set_bank_conflicts(true);
                setup(l.input_f32("x", &x));
                setup(l.output_f32("y", c * r));
                let args = [Arg::U32(rows), Arg::U32(cols), Arg::buf("x"), Arg::buf("y")];
                let stats = launch_hinted(&mut l, out, "transpose_f32", grid, [32, 32, 1], L9_SMEM, &args, |f| {
                    l9_finding_hint(f, r, c, has_barrier)
                })?;
                let got = setup(l.read_f32("y"));
                let diff = compare(&got, &transpose_sim(&x, r, c, L9Flaw::None), r, 0.0);
                if diff.ok() {
                    out.say(tr!(
                        "  y: every element is x's transposed",
                        "  y: jedes Element ist das transponierte von x"
                    ));
                } else {
                    let usual = [Mistake {
                        hint: tr!(
                            "each 32 x 32 tile went to its transposed place but was not turned: step 3 reads the tile at `ty * 33 + tx`, the word the thread stored itself; y[j][i] = x[i][j] is the word thread (ty, tx) stored, at `tx * 33 + ty` (step 3)",
                            "jede 32 x 32-Kachel kam an ihren transponierten Platz, wurde aber nicht gedreht: Schritt 3 liest die Kachel an `ty * 33 + tx`, das Wort, das der Thread selbst gespeichert hat; y[j][i] = x[i][j] ist das Wort, das Thread (ty, tx) gespeichert hat, an `tx * 33 + ty` (Schritt 3)"
                        ),
                        outputs: vec![transpose_sim(&x, r, c, L9Flaw::SwappedTile)],
                    }];
                    let made = mistake_made(&[&got], usual, 0.0);
                    result(out, &[("y", "row", &diff)], |_, d| {
                        Some(if all_unwritten(d) {
                            tr!(
                                "the kernel does not write y yet (step 3)",
                                "der Kernel schreibt noch nichts in y (Schritt 3)"
                            )
                        } else if let Some(h) = made.clone() {
                            h
                        } else if !d.unwritten_rows.is_empty() {
                            tr!(
                            "some elements of y were never written: y is `cols x rows`; thread (tx, ty) of block (bx, by) writes y[j][i] with j = bx * 32 + ty, i = by * 32 + tx, whenever `j < cols && i < rows` (step 3)",
                            "einige Elemente von y wurden nie geschrieben: y ist `cols x rows`; Thread (tx, ty) von Block (bx, by) schreibt y[j][i] mit j = bx * 32 + ty, i = by * 32 + tx, immer wenn `j < cols && i < rows` (Schritt 3)"
                        )
                        } else {
                            return None;
                        })
                    })?;
                }
                let accesses = l9_accesses(&stats, out.ptx.as_deref().unwrap_or(""));
                for (write, at, s) in &accesses {
                    let access = match (write, german()) {
                        (false, false) => "read of x",
                        (true, false) => "write of y",
                        (false, true) => "Lesen von x",
                        (true, true) => "Schreiben von y",
                    };
                    out.say(tr!(
                        "  sectors: the {access} at {at}: {} useful bytes in {} sectors of 32 B ({:.1} %), {:.1} sectors per warp-wide access",
                        "  Sektoren: das {access} in {at}: {} nützliche Bytes in {} Sektoren zu 32 B ({:.1} %), {:.1} Sektoren je warpweitem Zugriff",
                        s.useful_bytes,
                        s.sectors,
                        100.0 * s.efficiency(),
                        s.per_execution()
                    ));
                }
                if let Some((write, at, s)) = accesses.iter().find(|(_, _, s)| s.efficiency() < L9_MIN_EFFICIENCY) {
                    let (eff, per, min) = (100.0 * s.efficiency(), s.per_execution(), 100.0 * L9_MIN_EFFICIENCY);
                    out.say(tr!(
                        "  what to look at: the values are right, the access is not coalesced - the {} at {at} uses {eff:.1} % of the bytes of the sectors it touches ({per:.1} sectors per warp-wide access; neighbouring lanes take 4 or 5), below the {min:.0} % the lesson asks: {}",
                        "  worauf Sie achten sollten: die Werte stimmen, der Zugriff ist nicht zusammengefasst - das {} in {at} nutzt {eff:.1} % der Bytes der Sektoren, die es berührt ({per:.1} Sektoren je warpweitem Zugriff; benachbarte Lanes brauchen 4 oder 5), unter den {min:.0} %, die die Lektion verlangt: {}",
                        if *write { tr!("write of y", "Schreiben von y") } else { tr!("read of x", "Lesen von x") },
                        if *write {
                            tr!(
                                "the lanes of a warp (consecutive tid_x()) write y down a column, `rows` floats apart, each in a sector of its own; write along a row of y instead, i = ctaid_y() * 32 + tx, from the tile read across (steps 2-3)",
                                "die Lanes eines Warps (aufeinanderfolgende tid_x()) schreiben y eine Spalte hinab, `rows` Floats auseinander, jede in einen eigenen Sektor; schreiben Sie stattdessen entlang einer Zeile von y, i = ctaid_y() * 32 + tx, aus der quer gelesenen Kachel (Schritte 2-3)"
                            )
                        } else {
                            tr!(
                                "the lanes of a warp (consecutive tid_x()) read x down a column, `cols` floats apart, each from a sector of its own; read along a row of x instead, c = ctaid_x() * 32 + tx, into the shared tile, and turn it there (steps 1-3)",
                                "die Lanes eines Warps (aufeinanderfolgende tid_x()) lesen x eine Spalte hinab, `cols` Floats auseinander, jede aus einem eigenen Sektor; lesen Sie stattdessen entlang einer Zeile von x, c = ctaid_x() * 32 + tx, in die Shared-Kachel, und drehen Sie sie dort (Schritte 1-3)"
                            )
                        }
                    ));
                    return Err(Verdict::Wrong);
                }
                let conflicts: Vec<(String, ptx_vm::BankConflicts)> =
                    ptx_vm::BankConflicts::by_source(&stats.bank_conflicts)
                        .into_iter()
                        .filter(|(_, b)| b.extra() > 0)
                        .collect();
                for (at, b) in &conflicts {
                    out.say(tr!(
                        "  bank conflicts at {at}: {} wavefronts where {} would do ({:.1}-way), {} warp-wide executions",
                        "  Bankkonflikte in {at}: {} Wavefronts, wo {} genügten ({:.1}-fach), {} warpweite Ausführungen",
                        b.wavefronts,
                        b.ideal,
                        b.ways(),
                        b.executions
                    ));
                }
                if !conflicts.is_empty() {
                    out.say(tr!(
                        "  what to look at: the values are right and the global accesses whole, but the tile's rows are 32 floats: a column of the tile then lies in one bank, and the 32 lanes reading it wait for each other; make a row 33 floats, store at `ty * 33 + tx` and read at `tx * 33 + ty` (steps 1 and 3)",
                        "  worauf Sie achten sollten: die Werte stimmen und die globalen Zugriffe sind ganz, aber die Zeilen der Kachel sind 32 Floats lang: eine Spalte der Kachel liegt dann in einer Bank, und die 32 Lanes, die sie lesen, warten aufeinander; machen Sie eine Zeile 33 Floats lang, speichern Sie an `ty * 33 + tx` und lesen Sie an `tx * 33 + ty` (Schritte 1 und 3)"
                    ));
                    return Err(Verdict::Wrong);
                }
                out.say(tr!(
                    "  ok: every global access at {:.0} % or better, no bank conflicts",
                    "  ok: jeder globale Zugriff bei {:.0} % oder besser, keine Bankkonflikte",
                    100.0 * L9_MIN_EFFICIENCY
                ));
            }
            Ok(())
        },
        out,
    )
}

/// Lesson 5's solution with one `bar.sync` of its PTX removed at a time (the PTX of deleting one
/// `sync_threads()`): each must stop at a shared memory race whose report names the Rust lines
/// of both accesses (the store and the other warp's load, or the load and the other warp's
/// store). Returns one line per barrier.
fn barrier_mutants(ptx: &str) -> Result<Vec<String>, String> {
    let bars: Vec<usize> = ptx.match_indices("bar.sync").map(|(at, _)| at).collect();
    if bars.len() < 2 {
        return Err(format!("the solution's PTX has {} bar.sync, expected the two barriers of step 2a", bars.len()));
    }
    let mut lines = Vec::new();
    for (n, &at) in bars.iter().enumerate() {
        let ptx_line = ptx[..at].lines().count();
        // Commented out in place: every other PTX line keeps its number.
        let mutated = format!("{}// removed: {}", &ptx[..at], &ptx[at..]);
        let m = Module::load(&mutated).map_err(|e| format!("the PTX without bar.sync {n} does not load: {e}"))?;
        let mut out = Out { quiet: true, ..Out::default() };
        let v = lesson5(&m, &mut out);
        let (this, other) = race_lines(&out.text).ok_or_else(|| {
            format!(
                "without the bar.sync at PTX line {ptx_line} the solution should stop at a shared memory race naming \
                 both lines, but said ({v:?}):\n{}",
                out.text
            )
        })?;
        lines.push(format!("without the bar.sync at PTX line {ptx_line}: a race between {this} and {other}"));
    }
    Ok(lines)
}

/// The Rust lines of both accesses of a race report from `launch`: the finding's own (`at`) and
/// the other warp's (in the `where` line), when they are in the solution file and differ.
fn race_lines(text: &str) -> Option<(String, String)> {
    const FILE: &str = "lessons/05-flash-forward/solution.rs:";
    if !text.contains("VM finding: shared memory race") {
        return None;
    }
    let this = text.lines().find_map(|l| l.trim().strip_prefix("at ").and_then(|r| r.split_whitespace().next()))?;
    let where_ = text.lines().find_map(|l| l.trim().strip_prefix("where"))?;
    let (_, after) = where_.split_once(" was at PTX line ")?;
    let other = &after[after.find(FILE)?..];
    let other = other.split([' ', ')']).next()?;
    (this.starts_with(FILE) && other != this).then(|| (this.to_string(), other.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lesson 5's solution passes, and without either of its barriers it stops at a race whose
    /// report names both lines. Needs the kernel toolchain (as `cargo xtask lesson` does).
    #[test]
    fn lesson5_without_either_barrier_is_a_race_naming_both_lines() {
        if let Err(e) = toolchain::ensure() {
            eprintln!("SKIPPED: lesson 5 is not built without the kernel toolchain: {e}");
            return;
        }
        let mut out = Out { quiet: true, ..Out::default() };
        let m = build(5, File::Solution, &mut out).unwrap_or_else(|e| panic!("lesson 5 does not build: {e}"));
        assert_eq!(lesson5(&m, &mut out), Verdict::Pass, "{}", out.text);
        let ptx = std::fs::read_to_string(ptx_path(5, File::Solution)).unwrap();
        let races = barrier_mutants(&ptx).unwrap_or_else(|e| panic!("{e}"));
        for r in &races {
            eprintln!("{r}");
        }
        assert!(races.len() >= 2, "{races:?}");
    }

    /// Lesson `dir`'s solution with each `(from, to)` of `edits` replaced (each must occur), as
    /// a crate of its own under `target/lesson-mutants/NAME/` built with the lessons' recipe (as
    /// `lesson build` builds a scratch kernel): the mistake a learner makes, for the checker to
    /// diagnose. Returns the module and an `Out` whose source is the mutated file.
    fn mutant(dir: &str, name: &str, edits: &[(&str, &str)]) -> (Module, Out) {
        let root = paths::root();
        let crate_dir = root.join("target/lesson-mutants").join(name);
        std::fs::create_dir_all(&crate_dir).unwrap();
        let mut src = std::fs::read_to_string(root.join("lessons").join(dir).join("solution.rs")).unwrap();
        for (from, to) in edits {
            assert!(src.contains(from), "`{from}` is not in lessons/{dir}/solution.rs");
            src = src.replacen(from, to, 1);
        }
        let src = src.replace("crate::gpu", "memattn_lessons::gpu");
        std::fs::write(crate_dir.join("kernel.rs"), format!("#![no_std]\n#![feature(abi_ptx)]\n{src}")).unwrap();
        let manifest = format!(
            "[package]\nname = \"{name}\"\nversion = \"0.1.0\"\nedition = \"2021\"\npublish = false\n\n[lib]\npath = \"kernel.rs\"\n\n\
             [dependencies]\nmemattn-lessons = {{ path = \"{}\" }}\n\n[profile.ptx]\ninherits = \"release\"\npanic = \"abort\"\n\
             lto = \"fat\"\ncodegen-units = 1\ndebug = false\n\n[workspace]\n",
            root.join("lessons").display()
        );
        std::fs::write(crate_dir.join("Cargo.toml"), manifest).unwrap();
        let ptx_path = root.join("target/lessons").join(format!("mutant-{name}.ptx"));
        let m = crate_dir.join("Cargo.toml").display().to_string();
        let ptx = compile(&["--manifest-path", &m], &ptx_path).unwrap_or_else(|e| panic!("mutant {name}: {e}"));
        let out = Out {
            quiet: true,
            src: Some(paths::rel(&crate_dir.join("kernel.rs")).into()),
            ptx: Some(ptx.clone()),
            ..Out::default()
        };
        (Module::load(&ptx).unwrap(), out)
    }

    /// The last "what to look at" line of a report.
    fn hint_of(text: &str) -> &str {
        text.lines().rfind(|l| l.contains("what to look at")).unwrap_or("")
    }

    /// Lesson 3 with the threads past the edge returning before the first barrier: the VM sees
    /// a read of shared memory nobody wrote, and the hint names the `return` and the barrier,
    /// not a missing barrier.
    #[test]
    fn an_early_return_before_a_barrier_is_named_as_that() {
        if let Err(e) = toolchain::ensure() {
            eprintln!("SKIPPED: the lessons are not built without the kernel toolchain: {e}");
            return;
        }
        let (m, mut out) = mutant(
            "03-tiled-qk",
            "early_return_l3",
            &[(
                "    let mut acc = 0.0f32;\n",
                "    let mut acc = 0.0f32;\n    if i >= n || j >= m {\n        return;\n    }\n",
            )],
        );
        let src = std::fs::read_to_string(paths::root().join(out.src.as_ref().unwrap())).unwrap();
        let (ret, sync) = early_return(&src).expect("the mutant returns before a barrier");
        assert_eq!(src.lines().nth(ret - 1).map(str::trim), Some("return;"));
        assert!(src.lines().nth(sync - 1).unwrap().contains("sync_threads()"));
        assert_eq!(lesson3(&m, &mut out), Verdict::Finding, "{}", out.text);
        let hint = hint_of(&out.text);
        assert!(out.text.contains("VM finding: uninitialized shared memory read"), "{}", out.text);
        assert!(hint.contains(&format!("line {ret} of ")) && hint.contains(&format!("at line {sync}")), "{hint}");
        assert!(hint.contains("returns before the `sync_threads()`"), "{hint}");
        assert!(!hint.contains("is missing"), "{hint}");

        // Lesson 5 runs without initcheck (racecheck judges its barriers): the words nobody
        // wrote read as NaN, and the wrong rows get the same hint.
        let (m, mut out) = mutant(
            "05-flash-forward",
            "early_return_l5",
            &[(
                "    let valid = i < seq_q;\n",
                "    let valid = i < seq_q;\n    if !valid {\n        return;\n    }\n",
            )],
        );
        assert_eq!(lesson5(&m, &mut out), Verdict::Wrong, "{}", out.text);
        let hint = hint_of(&out.text);
        assert!(hint.contains("returns before the `sync_threads()`"), "{}", out.text);
    }

    /// Lesson 5 with the causal bound in u32: for rows with `i + seq_kv < seq_q` it wraps and
    /// the row sees every key. The hint names the wrap and the rows, not the base of -inf.
    #[test]
    fn a_u32_wrap_in_the_causal_bound_is_named_as_a_wrap() {
        if let Err(e) = toolchain::ensure() {
            eprintln!("SKIPPED: the lessons are not built without the kernel toolchain: {e}");
            return;
        }
        let (m, mut out) = mutant(
            "05-flash-forward",
            "u32_bound_l5",
            &[
                (
                    "if causal != 0 { (i as i64 + seq_kv as i64 - seq_q as i64 + 1).min(seq_kv as i64) } else { seq_kv as i64 }",
                    "if causal != 0 { (i + seq_kv - seq_q + 1).min(seq_kv) } else { seq_kv }",
                ),
                ("if ((kv0 as usize + r) as i64) >= key_end {", "if kv0 + r as u32 >= key_end {"),
            ],
        );
        assert_eq!(lesson5(&m, &mut out), Verdict::Wrong, "{}", out.text);
        let hint = hint_of(&out.text);
        // Case 3 (seq_q = 150, seq_kv = 90): rows 0-58 wrap; row 59's bound is -1 + 1 = 0 in
        // u32 too.
        assert!(hint.contains("rows 0-58 see all 90 keys"), "{}", out.text);
        assert!(hint.contains("wraps around"), "{hint}");
        assert!(!hint.contains("base"), "{hint}");
    }

    /// Lesson 1 reading `x[i - 1]`: at i = 0 the u32 index wraps to 16 GiB past `x`. The hint
    /// names the wrap, not a missing bounds guard.
    #[test]
    fn a_u32_wrap_in_an_index_is_named_as_a_wrap() {
        if let Err(e) = toolchain::ensure() {
            eprintln!("SKIPPED: the lessons are not built without the kernel toolchain: {e}");
            return;
        }
        let (m, mut out) = mutant("01-scale", "u32_index_l1", &[("x.add(i as usize)", "x.add((i - 1) as usize)")]);
        assert_eq!(lesson1(&m, &mut out), Verdict::Finding, "{}", out.text);
        let hint = hint_of(&out.text);
        assert!(hint.contains("16.0 GiB away from the nearest buffer"), "{}", out.text);
        assert!(out.text.contains("u32_index_l1/kernel.rs:16"), "{}", out.text);
        assert!(hint.contains("`i - 1` at i = 0"), "{hint}");
    }

    /// Lesson 7: the unswizzled tile (the skeleton's layout) computes the right registers and
    /// fails on its 8-way bank conflicts, counted by the VM; the swizzled one takes one wavefront
    /// per phase; a swizzle on the copy but not on the load is a wrong register, named. Needs the
    /// kernel toolchain.
    #[test]
    fn lesson7_counts_the_bank_conflicts_of_an_unswizzled_tile() {
        if let Err(e) = toolchain::ensure() {
            eprintln!("SKIPPED: the lessons are not built without the kernel toolchain: {e}");
            return;
        }
        let (m, mut out) = mutant("07-swizzle", "swizzled_l7", &[]);
        assert_eq!(lesson7(&m, &mut out), Verdict::Pass, "{}", out.text);
        assert!(out.text.contains("shared memory: 64 wavefronts, one per phase - no bank conflicts"), "{}", out.text);

        let swizzle = "row * 8 + (chunk ^ (row % 8))";
        let (m, mut out) = mutant("07-swizzle", "unswizzled_l7", &[(swizzle, "row * 8 + chunk")]);
        assert_eq!(lesson7(&m, &mut out), Verdict::Wrong, "{}", out.text);
        assert!(out.text.contains("frag: every register of every ldmatrix holds the right pair"), "{}", out.text);
        assert!(
            out.text.contains("512 wavefronts where 64 would do (8.0-way), 16 warp-wide executions"),
            "{}",
            out.text
        );
        assert!(out.text.contains("the ldmatrix_x4 of target/lesson-mutants/unswizzled_l7/kernel.rs:"), "{}", out.text);
        assert!(hint_of(&out.text).contains("r * 8 + (c ^ (r % 8))"), "{}", out.text);

        let load = "ldmatrix_x4(smem_addr(k_s.add(slot(row, chunk) * 8)))";
        let (m, mut out) = mutant(
            "07-swizzle",
            "load_unswizzled_l7",
            &[(load, "ldmatrix_x4(smem_addr(k_s.add((row * 8 + chunk) * 8)))")],
        );
        assert_eq!(lesson7(&m, &mut out), Verdict::Wrong, "{}", out.text);
        assert!(
            out.text
                .contains("the first: ldmatrix of row group 0, half 0, lane 4, r[0] holds K[1, 8..9], want K[1, 0..1]"),
            "{}",
            out.text
        );
        assert!(hint_of(&out.text).contains("the load must find every chunk where the store put it"), "{}", out.text);
    }

    /// Lesson 6 with two registers of a fragment swapped after `ldmatrix`: the checker names the
    /// lane, the register, what it holds and what it must hold. Needs the kernel toolchain.
    #[test]
    fn a_swapped_fragment_register_is_named_by_lane_and_register() {
        if let Err(e) = toolchain::ensure() {
            eprintln!("SKIPPED: the lessons are not built without the kernel toolchain: {e}");
            return;
        }
        let load_a = "let a = unsafe { ldmatrix_x4(smem_addr(q_s.add(row * 16 + chunk * 8))) };\n";
        let (m, mut out) = mutant(
            "06-mma-qk",
            "swapped_a_l6",
            &[(load_a, &format!("{load_a}    let a = [a[0], a[2], a[1], a[3]];\n"))],
        );
        assert_eq!(lesson6(&m, &mut out), Verdict::Wrong, "{}", out.text);
        let hint = hint_of(&out.text);
        assert!(
            hint.contains("lane 0, register a1 holds Q[0, 8..9], which belongs in a2 of lane 0; a1 of lane 0 must hold Q[8, 0..1]"),
            "{}",
            out.text
        );
        assert!(out.text.contains("frag_a: 64 of 128 registers differ, in lanes 0-31"), "{}", out.text);
        assert!(out.text.contains("frag_b: every lane's registers match the layout"), "{}", out.text);

        let load_b = "let b = unsafe { ldmatrix_x4(smem_addr(k_s.add((key % 8) * 16 + chunk * 8))) };\n";
        let (m, mut out) = mutant(
            "06-mma-qk",
            "swapped_b_l6",
            &[(load_b, &format!("{load_b}    let b = [b[1], b[0], b[2], b[3]];\n"))],
        );
        assert_eq!(lesson6(&m, &mut out), Verdict::Wrong, "{}", out.text);
        let hint = hint_of(&out.text);
        assert!(
            hint.contains("lane 0, register b0 holds K[0, 8..9], which belongs in b1 of lane 0; b0 of lane 0 must hold K[0, 0..1]"),
            "{}",
            out.text
        );
    }

    /// The usual mistakes, each applied to a solution: the hint names the mistake made (its
    /// output is what the checker's reference with that mistake gives), not another one.
    fn skip_without_toolchain() -> bool {
        if let Err(e) = toolchain::ensure() {
            eprintln!("SKIPPED: the lessons are not built without the kernel toolchain: {e}");
            return true;
        }
        false
    }

    /// Lesson 8's usual mistakes, each applied to its solution: the hint names the mistake,
    /// chosen by what the kernel printed or the VM found.
    #[test]
    fn lesson8_each_usual_mistake_gets_its_own_hint() {
        if skip_without_toolchain() {
            return;
        }
        let atomic = "    if t == 0 {\n        unsafe { red_add_f32(total, *s) };\n    }\n";
        // (scratch name, (text, replacement) edits of the solution, verdict, hint text).
        type Mistake<'a> = (&'a str, &'a [(&'a str, &'a str)], Verdict, &'a str);
        let cases: [Mistake; 7] = [
            (
                "no_first_barrier_l8",
                &[(
                    "    unsafe { *s.add(t as usize) = acc };\n    sync_threads();\n",
                    "    unsafe { *s.add(t as usize) = acc };\n",
                )],
                Verdict::Finding,
                "a `sync_threads()` after the load is missing",
            ),
            (
                "no_tree_barrier_l8",
                &[("        sync_threads();\n        half /= 2;\n", "        half /= 2;\n")],
                Verdict::Finding,
                "two warps used the same shared word with no barrier between them",
            ),
            (
                "every_thread_adds_l8",
                &[(atomic, "    unsafe { red_add_f32(total, acc) };\n")],
                Verdict::Wrong,
                "every thread adds to total on its own",
            ),
            ("block_stride_l8", &[("i += B * nctaid_x();", "i += B;")], Verdict::Wrong, "the loop goes up by 256"),
            (
                "no_block_start_l8",
                &[("let mut i = ctaid_x() * B + t;", "let mut i = t;")],
                Verdict::Wrong,
                "every block summed the same elements",
            ),
            (
                "tree_from_64_l8",
                &[("let mut half = B / 2;", "let mut half = B / 4;")],
                Verdict::Wrong,
                "the tree starts at `half = 128`",
            ),
            (
                "plain_store_l8",
                &[(atomic, "    if t == 0 {\n        unsafe { *total = *s };\n    }\n")],
                Verdict::Wrong,
                "instead of adding them",
            ),
        ];
        for (name, edits, want, hint) in cases {
            let (m, mut out) = mutant("08-reduce", name, edits);
            assert_eq!(lesson8(&m, &mut out), want, "{name}:\n{}", out.text);
            assert!(hint_of(&out.text).contains(hint), "{name}: expected `{hint}` in:\n{}", out.text);
        }
        // Reading past n: the VM stops the kernel at the load and names the guard.
        let (m, mut out) = mutant(
            "08-reduce",
            "tail_l8",
            &[("    while i < n {\n", "    for _ in 0..n.div_ceil(B * nctaid_x()) {\n")],
        );
        assert_eq!(lesson8(&m, &mut out), Verdict::Finding, "{}", out.text);
        assert!(hint_of(&out.text).contains("guard the index (`if i < n`)"), "{}", out.text);
    }

    /// Lesson 9's usual mistakes, each applied to its solution: the hint names the mistake,
    /// chosen by what the kernel stored, the VM found (with its thread and block) or the VM's
    /// sector and bank counters measured. Needs the kernel toolchain.
    #[test]
    fn lesson9_each_usual_mistake_gets_its_own_hint() {
        if skip_without_toolchain() {
            return;
        }
        let sol = std::fs::read_to_string(paths::root().join("lessons/09-transpose/solution.rs")).unwrap();
        // The kernel's body, for the transposes without a tile.
        let body = &sol[sol.find("    let tile = dynamic_smem_f32();\n").unwrap()..sol.rfind('}').unwrap()];
        let naive_read = "    let (tx, ty) = (tid_x(), tid_y());\n    \
                          let (j, i) = (ctaid_x() * T + ty, ctaid_y() * T + tx);\n    \
                          if j < cols && i < rows {\n        \
                          unsafe { *y.add((j * rows + i) as usize) = *x.add((i * cols + j) as usize) };\n    }\n";
        let naive_write = "    let (tx, ty) = (tid_x(), tid_y());\n    \
                           let (r, c) = (ctaid_y() * T + ty, ctaid_x() * T + tx);\n    \
                           if r < rows && c < cols {\n        \
                           unsafe { *y.add((c * rows + r) as usize) = *x.add((r * cols + c) as usize) };\n    }\n";
        let (row, unused_row) = ("const ROW: u32 = T + 1;", "#[allow(dead_code)]\nconst ROW: u32 = T + 1;");
        let load = "    if r < rows && c < cols {\n";
        let store = "    if j < cols && i < rows {\n";
        // (scratch name, (text, replacement) edits of the solution, verdict, hint text).
        type Mistake<'a> = (&'a str, Vec<(&'a str, &'a str)>, Verdict, &'a str);
        let cases: [Mistake; 8] = [
            (
                "no_load_guard_l9",
                vec![(load, "    {\n")],
                Verdict::Finding,
                "past the edge of x (100 x 75): the tiles at the right and bottom edges are partial, so the read needs `r < rows && c < cols` (step 1)",
            ),
            (
                "no_store_guard_l9",
                vec![(store, "    {\n")],
                Verdict::Finding,
                "past the edge of y (75 x 100), and reads a word of the tile no thread stored (x has no element there): the write, and the read of the tile with it, needs `j < cols && i < rows` (step 3)",
            ),
            (
                "swapped_tile_l9",
                vec![("*tile.add((tx * ROW + ty) as usize)", "*tile.add((ty * ROW + tx) as usize)")],
                Verdict::Wrong,
                "each 32 x 32 tile went to its transposed place but was not turned",
            ),
            (
                "no_barrier_l9",
                vec![("    sync_threads();\n", "")],
                Verdict::Finding,
                "with no barrier between the store and the read: `sync_threads()` after step 1",
            ),
            (
                "early_return_l9",
                vec![(load, "    if r >= rows || c >= cols {\n        return;\n    }\n    {\n")],
                Verdict::Wrong,
                "returns before the `sync_threads()`",
            ),
            (
                "naive_read_l9",
                vec![(body, naive_read), (row, unused_row)],
                Verdict::Wrong,
                "the access is not coalesced - the read of x at target/lesson-mutants/naive_read_l9/kernel.rs:23 uses 12.5 % of \
                 the bytes of the sectors it touches (32.0 sectors per warp-wide access; neighbouring lanes take 4 or 5), \
                 below the 50 % the lesson asks: the lanes of a warp (consecutive tid_x()) read x down a column",
            ),
            (
                "naive_write_l9",
                vec![(body, naive_write), (row, unused_row)],
                Verdict::Wrong,
                "the access is not coalesced - the write of y at target/lesson-mutants/naive_write_l9/kernel.rs:23 uses 12.5 % of \
                 the bytes of the sectors it touches (32.0 sectors per warp-wide access; neighbouring lanes take 4 or 5), \
                 below the 50 % the lesson asks: the lanes of a warp (consecutive tid_x()) write y down a column",
            ),
            (
                "unpadded_l9",
                vec![(row, "const ROW: u32 = T;")],
                Verdict::Wrong,
                "the tile's rows are 32 floats: a column of the tile then lies in one bank",
            ),
        ];
        for (name, edits, want, hint) in cases {
            let (m, mut out) = mutant("09-transpose", name, &edits);
            assert_eq!(lesson9(&m, &mut out), want, "{name}:\n{}", out.text);
            assert!(hint_of(&out.text).contains(hint), "{name}: expected `{hint}` in:\n{}", out.text);
            eprintln!("{name}: {}", hint_of(&out.text).trim());
        }
        // The same measurement, said in German.
        set_german(true);
        let (m, mut out) = mutant("09-transpose", "naive_write_l9", &[(body, naive_write), (row, unused_row)]);
        let verdict = lesson9(&m, &mut out);
        set_german(false);
        assert_eq!(verdict, Verdict::Wrong, "{}", out.text);
        let hint = out.text.lines().rfind(|l| l.contains("worauf Sie achten sollten")).unwrap_or("");
        assert!(
            hint.contains(
                "das Schreiben von y in target/lesson-mutants/naive_write_l9/kernel.rs:23 nutzt 12.5 % der Bytes"
            ),
            "{}",
            out.text
        );
        assert!(hint.contains("schreiben y eine Spalte hinab"), "{hint}");
    }

    /// The references with a mistake, without it, are the f64 references.
    #[test]
    fn the_mistake_references_without_a_mistake_are_the_references() {
        let mut rng = Rng(3);
        let (sq, skv) = (70, 100);
        let (q, k, v) = (rng.vec(sq * 32, 1.0), rng.vec(skv * 32, 1.0), rng.vec(skv * 32, 1.0));
        for causal in [false, true] {
            let (o, lse) = attention_ref(&q, &k, &v, sq, skv, causal, 0.2);
            let (so, slse) = flash_sim(&q, &k, &v, sq, skv, causal, 0.2, L5Flaw::None);
            let f32s = |x: &[f64]| x.iter().map(|&y| y as f32).collect::<Vec<_>>();
            assert!(same_output(&f32s(&so), &o, 1e-6) && same_output(&f32s(&slse), &lse, 1e-6), "causal {causal}");
        }
        let s6: Vec<f32> = l6_mma_sim([0, 1, 2, 3], [0, 1]).iter().map(|&x| x as f32).collect();
        let want: Vec<f64> =
            (0..128).map(|x| (0..16).map(|c| l6_q(x / 8, c) as f64 * l6_k(x % 8, c) as f64).sum()).collect();
        assert!(same_output(&s6, &want, 1e-6));
        let x = rng.vec(6 * 40, 1.0);
        let right: Vec<f32> = softmax_rows(&x, 40).iter().map(|&y| y as f32).collect();
        assert!(same_output(&right, &softmax_sim(&x, 6, 40, 2, L2Flaw::Rows(|b, w| b * 4 + w)), 1e-6));
    }

    #[test]
    fn lesson5_a_forgotten_rescale_and_unmasked_tail_keys_are_told_apart() {
        if skip_without_toolchain() {
            return;
        }
        let (m, mut out) = mutant(
            "05-flash-forward",
            "no_rescale_l5",
            &[
                ("l = l * alpha + p;", "l += p;"),
                ("fma(p, unsafe { *v_s.add(r * D + c) }, *a * alpha)", "fma(p, unsafe { *v_s.add(r * D + c) }, *a)"),
            ],
        );
        assert_eq!(lesson5(&m, &mut out), Verdict::Wrong, "{}", out.text);
        let hint = hint_of(&out.text);
        assert!(hint.contains("l and acc are not rescaled"), "{}", out.text);
        assert!(!hint.contains("seq_kv"), "{hint}");

        let (m, mut out) = mutant(
            "05-flash-forward",
            "tail_unmasked_l5",
            &[(
                "if ((kv0 as usize + r) as i64) >= key_end {",
                "if ((kv0 as usize + r) as i64) >= key_end && kv0 as usize + r < seq_kv as usize {",
            )],
        );
        assert_eq!(lesson5(&m, &mut out), Verdict::Wrong, "{}", out.text);
        let hint = hint_of(&out.text);
        assert!(hint.contains("keys past seq_kv"), "{}", out.text);
        assert!(!hint.contains("alpha"), "{hint}");
    }

    #[test]
    fn lesson6_b0_and_b1_swapped_in_the_mma_is_named() {
        if skip_without_toolchain() {
            return;
        }
        let (m, mut out) = mutant(
            "06-mma-qk",
            "mma_b_swapped_l6",
            &[("Bf16::mma(&mut d, &a, b[0], b[1]);", "Bf16::mma(&mut d, &a, b[1], b[0]);")],
        );
        assert_eq!(lesson6(&m, &mut out), Verdict::Wrong, "{}", out.text);
        let hint = hint_of(&out.text);
        assert!(hint.contains("as if its operands were b1, b0"), "{}", out.text);
        assert!(!hint.contains("store of D"), "{hint}");
    }

    #[test]
    fn lesson4_a_wrong_lse_formula_is_named_and_not_the_rescale() {
        if skip_without_toolchain() {
            return;
        }
        for (name, formula) in [("lse_base2_l4", "m + log2(l)"), ("lse_half_l4", "LN2 * m + log2(l)")] {
            let (m, mut out) = mutant("04-online-softmax", name, &[("LN2 * (m + log2(l))", formula)]);
            assert_eq!(lesson4(&m, &mut out), Verdict::Wrong, "{}", out.text);
            let hint = hint_of(&out.text);
            assert!(hint.contains("O is right; LSE"), "{}", out.text);
            assert!(hint.contains(formula), "{}", out.text);
            assert!(!hint.contains("alpha"), "{hint}");
        }
    }

    #[test]
    fn lesson3_a_transposed_product_index_is_named() {
        if skip_without_toolchain() {
            return;
        }
        for (name, from, to, named) in [
            ("transposed_q_l3", "qs.add((ty * T + kk) as usize)", "qs.add((kk * T + ty) as usize)", "`Qs[k][ty]`"),
            ("transposed_k_l3", "ks.add((tx * T + kk) as usize)", "ks.add((kk * T + tx) as usize)", "`Ks[k][tx]`"),
        ] {
            let (m, mut out) = mutant("03-tiled-qk", name, &[(from, to)]);
            assert_eq!(lesson3(&m, &mut out), Verdict::Wrong, "{}", out.text);
            let hint = hint_of(&out.text);
            assert!(hint.contains(named), "{}", out.text);
            assert!(!hint.contains("load zeros"), "{hint}");
        }
    }

    #[test]
    fn lesson2_a_wrong_row_index_is_named_and_a_per_lane_return_is_a_finding() {
        if skip_without_toolchain() {
            return;
        }
        let row = "let row = ctaid_x() * 4 + tid_x() / 32;";
        let (m, mut out) =
            mutant("02-warp-softmax", "row_index_l2", &[(row, "let row = ctaid_x() * 4 + tid_x() / 64;")]);
        assert_eq!(lesson2(&m, &mut out), Verdict::Wrong, "{}", out.text);
        let hint = hint_of(&out.text);
        assert!(hint.contains("`row = ctaid_x() * 4 + tid_x() / 64`"), "{}", out.text);
        assert!(!hint.contains("columns past 32"), "{hint}");

        // Lanes without a column leave before the shuffles: at 20 columns a shuffle reads a lane
        // that has returned.
        let ret = "    if row >= rows {\n        return;\n    }\n";
        let (m, mut out) = mutant(
            "02-warp-softmax",
            "lane_return_l2",
            &[(ret, &format!("{ret}    if lane >= cols {{\n        return;\n    }}\n"))],
        );
        assert_eq!(lesson2(&m, &mut out), Verdict::Finding, "{}", out.text);
        assert!(out.text.contains("VM finding: shuffle from an exited lane"), "{}", out.text);
        assert!(hint_of(&out.text).contains("return per warp"), "{}", out.text);
    }

    /// Lessons 6 and 7 (one warp) without their barrier: the read by ldmatrix of what other
    /// lanes stored is not ordered after the store, a finding naming both lines.
    #[test]
    fn lessons_6_and_7_without_their_barrier_are_a_finding() {
        if skip_without_toolchain() {
            return;
        }
        for (dir, name, check) in [
            ("06-mma-qk", "no_barrier_l6", lesson6 as fn(&Module, &mut Out) -> Verdict),
            ("07-swizzle", "no_barrier_l7", lesson7),
        ] {
            let (m, mut out) = mutant(dir, name, &[("    sync_threads();\n", "")]);
            assert_eq!(check(&m, &mut out), Verdict::Finding, "{}", out.text);
            assert!(out.text.contains("a shared-memory read with no barrier after the write"), "{}", out.text);
            let write = out.text.lines().find(|l| l.trim_start().starts_with("write")).unwrap_or("");
            assert!(write.contains(&format!("target/lesson-mutants/{name}/kernel.rs:")), "{}", out.text);
            assert!(hint_of(&out.text).contains("`sync_threads()` is missing"), "{}", out.text);
        }
        assert_eq!(unordered_shared_read("st.shared.b32 [a], 1;\nbar.warp.sync -1;\nldmatrix.x;\n"), None);
        assert_eq!(
            unordered_shared_read("cp.async.cg.shared.global [a], [b], 16;\ncp.async.wait_all;\nldmatrix.x;\n"),
            Some((1, 3))
        );
    }

    /// The layout the checker restates (written apart from kernels-gpu's `frag` helpers, which
    /// the solution uses) puts every pair of Q and of K in exactly one lane's register.
    #[test]
    fn lesson6_slots_cover_each_pair_once() {
        let mut seen = [[0u8; 8]; 16];
        for l in 0..32 {
            for r in 0..4 {
                let (i, c) = l6_slot(true, l, r);
                seen[i][c / 2] += 1;
            }
        }
        assert!(seen.iter().flatten().all(|&n| n == 1), "{seen:?}");
        let mut seen = [[0u8; 8]; 8];
        for l in 0..32 {
            for r in 0..2 {
                let (j, c) = l6_slot(false, l, r);
                seen[j][c / 2] += 1;
            }
        }
        assert!(seen.iter().flatten().all(|&n| n == 1), "{seen:?}");
    }

    #[test]
    fn early_return_finds_a_return_before_a_barrier_only() {
        let src =
            "fn k() {\n    // return early? no\n    if i >= n {\n        return;\n    }\n    sync_threads();\n}\n";
        assert_eq!(early_return(src), Some((4, 6)));
        assert_eq!(early_return("fn k() {\n    sync_threads();\n    if i >= n { return; }\n}\n"), None);
        assert_eq!(early_return("fn k() {\n    let returned = 1;\n    sync_threads();\n}\n"), None);
    }

    /// Every lesson's German skeleton is its `kernel.rs` line for line: the same code on the same
    /// lines, every comment line German (none left as in `kernel.rs` but commented-out code).
    #[test]
    fn every_german_skeleton_is_kernel_rs_with_german_comments() {
        for (n, l) in LESSONS.iter().enumerate() {
            let dir = paths::root().join("lessons").join(l.dir);
            let en = std::fs::read_to_string(dir.join("kernel.rs")).unwrap();
            let de = german_skeleton(&en, &std::fs::read_to_string(dir.join("kernel.de.txt")).unwrap())
                .unwrap_or_else(|e| panic!("lesson {}: {e}", n + 1));
            assert_eq!(en.lines().count(), de.lines().count(), "lesson {}", n + 1);
            let mut translated = 0;
            for (i, (e, g)) in en.lines().zip(de.lines()).enumerate() {
                if e.trim_start().starts_with("//") {
                    translated += usize::from(e != g);
                } else {
                    assert_eq!(e, g, "lesson {} line {}: code must be kernel.rs's", n + 1, i + 1);
                }
            }
            assert!(de.starts_with(&format!("//! Lektion {}: ", n + 1)), "lesson {}", n + 1);
            assert!(de.contains("/// # Sicherheit") && !de.contains("Check it"), "lesson {}", n + 1);
            assert!(translated >= 10, "lesson {}: only {translated} comment lines differ", n + 1);
        }
        // A translation out of step with kernel.rs is refused with both lines.
        let e = german_skeleton("//! a\nfn f() {}\n    // b\n", "//! x\n//! y\n").unwrap_err();
        assert!(e.contains("line 2") && e.contains("line 3 of kernel.rs"), "{e}");
        assert!(german_skeleton("//! a\n", "//! x\n//! y\n").unwrap_err().contains("more comment lines"));
        assert!(german_skeleton("//! a\n// b\n", "//! x\n").unwrap_err().contains("ends before"));
    }

    /// `--lang de` places lesson 1's German skeleton, builds it and diagnoses it as it does
    /// `kernel.rs`, naming `kernel.de.rs`. Needs the kernel toolchain.
    #[test]
    fn the_german_skeleton_is_placed_built_and_checked() {
        if let Err(e) = toolchain::ensure() {
            eprintln!("SKIPPED: lesson 1 is not built without the kernel toolchain: {e}");
            return;
        }
        let file = paths::root().join("lessons/01-scale/kernel.de.rs");
        let placed = place_german(1).unwrap();
        if placed.is_some() {
            let want = german_skeleton(
                &std::fs::read_to_string(paths::root().join("lessons/01-scale/kernel.rs")).unwrap(),
                &std::fs::read_to_string(paths::root().join("lessons/01-scale/kernel.de.txt")).unwrap(),
            )
            .unwrap();
            assert_eq!(std::fs::read_to_string(&file).unwrap(), want);
            assert!(placed.as_deref().unwrap().contains("kernel.de.rs angelegt"), "{placed:?}");
        }
        if placed.is_none() {
            eprintln!("SKIPPED: {} is there already (a learner's copy) and stays as it is", file.display());
            return;
        }
        set_german(true);
        let mut out = Out { quiet: true, ..Out::default() };
        let (v, code) = run_lesson(1, File::German, &mut out);
        // Solved in the German file only: it passes, so the German file is what was built.
        let text = std::fs::read_to_string(&file).unwrap();
        let solved = text.replace(
            "    let _ = (n, a, x, y);",
            "    let i = ctaid_x() * ntid_x() + tid_x();\n    if i < n {\n        unsafe { *y.add(i as usize) = a * *x.add(i as usize) };\n    }",
        );
        std::fs::write(&file, solved).unwrap();
        let mut solved_out = Out { quiet: true, ..Out::default() };
        let solved_v = run_lesson(1, File::German, &mut solved_out);
        set_german(false);
        std::fs::remove_file(&file).unwrap();
        assert_eq!((v, code), (Some(Verdict::Wrong), 1), "{}", out.text);
        assert!(out.text.contains("(lessons/01-scale/kernel.de.rs)"), "{}", out.text);
        assert!(out.text.contains("lesson1-de.ptx gebaut"), "{}", out.text);
        assert!(out.text.contains("Schritt 3 - der Kernel speichert noch nichts in y"), "{}", out.text);
        assert!(out.text.contains("ändern Sie lessons/01-scale/kernel.de.rs"), "{}", out.text);
        assert_eq!(solved_v, (Some(Verdict::Pass), 0), "{}", solved_out.text);
    }

    #[test]
    fn the_language_is_the_flag_then_lc_all_then_lang() {
        assert_eq!(choose_language(None, None, Some("de_DE.UTF-8")), Ok(true));
        assert_eq!(choose_language(None, Some("C"), Some("de_DE.UTF-8")), Ok(false));
        assert_eq!(choose_language(None, Some(""), Some("de_AT")), Ok(true));
        assert_eq!(choose_language(None, None, Some("en_US.UTF-8")), Ok(false));
        assert_eq!(choose_language(None, None, None), Ok(false));
        assert_eq!(choose_language(Some("en"), Some("de_DE"), None), Ok(false));
        assert_eq!(choose_language(Some("de"), None, None), Ok(true));
        assert!(choose_language(Some("fr"), None, None).unwrap_err().contains("`en` and `de`"));
    }

    /// The unsolved lesson 1 in German: the diagnosis, the hint and the result line. Needs the
    /// kernel toolchain.
    #[test]
    fn lesson1_skeleton_says_what_is_wrong_in_german() {
        if let Err(e) = toolchain::ensure() {
            eprintln!("SKIPPED: lesson 1 is not built without the kernel toolchain: {e}");
            return;
        }
        set_german(true);
        let mut out = Out { quiet: true, ..Out::default() };
        let (v, code) = run_lesson(1, File::Skeleton, &mut out);
        set_german(false);
        assert_eq!((v, code), (Some(Verdict::Wrong), 1), "{}", out.text);
        for line in [
            "y: nie geschrieben - alle Elemente enthalten noch das Gift",
            "worauf Sie achten sollten: Schritt 3 - der Kernel speichert noch nichts in y",
            "Ergebnis: NICHT BESTANDEN - falsches Ergebnis (Exit 1)",
        ] {
            assert!(out.text.contains(line), "missing `{line}` in:\n{}", out.text);
        }
        assert!(!out.text.contains("what to look at"), "{}", out.text);
    }

    #[test]
    fn race_lines_reads_both_lines_of_a_report() {
        let f = "lessons/05-flash-forward/solution.rs";
        let report = format!(
            "  VM finding: shared memory race\n    at       {f}:64\n    PTX      line 9: `ld.shared.f32 %f1, [%rd1];`\n    \
             where    warp 1 reads shared word 0 that warp 0 wrote since the last barrier (read-after-write race); \
             warp 0's write was at PTX line 7 `st.shared.f32 [%rd2], %f2;` in {f}:52\n"
        );
        assert_eq!(race_lines(&report), Some((format!("{f}:64"), format!("{f}:52"))));
        // One line only, or the same line twice, is not a report naming both.
        assert_eq!(race_lines(&report.replace(&format!(" in {f}:52"), "")), None);
        assert_eq!(race_lines(&report.replace(":52", ":64")), None);
        assert_eq!(race_lines(&report.replace("shared memory race", "uninitialized shared memory read")), None);
    }
}
