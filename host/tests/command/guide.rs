//! The guide cannot rot: every command in `docs/guide/en/NN-*.md` is run here, chapter by chapter
//! and in order, from the repository root, and must exit with its documented code and print every
//! output line the guide shows under it; the German chapters must contain the same commands.
//!
//! Conventions (also in `docs/guide/README.md`): a command is a line starting with `$ ` inside a
//! fenced block marked `console`; `# exit N` at the end of the line is its expected exit code
//! (default 0). The lines shown under it are its output: each must equal a line the command
//! prints (stdout or stderr, whitespace collapsed), in the order shown. A shown block may be an
//! excerpt: output lines may be left out between shown lines, and a line `...` says so to the
//! reader (it is not compared). In a shown line `…` stands for any text: it marks what differs
//! between runs or machines (times, the number of VM workers) and nothing else, so hashes,
//! registers, line numbers, counts and bytes are all compared. A command shown without output
//! must print nothing. The German chapters have the same commands with the same exit codes;
//! their output is what a German reader sees (`LANG=de_DE.UTF-8`): where it differs from the
//! English chapter's, the command runs a second time, right after the English run, in German.
//!
//! Conclusions the prose draws from an output are recomputed from the command (chapter 0's
//! occupancy table and quiz answer from `memattn kernels`), and trace headings quoted in the
//! prose must be lines the chapter shows.
//!
//! The commands run as a reader runs them: each chapter starts from a state without
//! `target/guide/` (the folder everything the guide writes goes to), and the test creates no
//! folder itself, so a chapter that writes there must create it with a command of its own.
//! Besides the commands, every repository path the guide names in backticks must exist, every
//! relative link must lead to a file (and anchor) that exists, and every chapter ends with a
//! quiz whose answers are folded.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

#[derive(Debug, Clone, PartialEq)]
struct Cmd {
    chapter: String,
    line: usize,
    command: String,
    exit: i32,
    /// The output lines shown under the command (whitespace collapsed; `...` lines dropped).
    shown: Vec<String>,
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn collapse(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn commands(md: &str, chapter: &str) -> Vec<Cmd> {
    let mut out: Vec<Cmd> = Vec::new();
    let mut in_console = false;
    let mut in_other = false;
    let mut after_command = false;
    for (i, line) in md.lines().enumerate() {
        let t = line.trim_start();
        if t.starts_with("```") {
            if in_console || in_other {
                in_console = false;
                in_other = false;
            } else if t.trim_start_matches('`').trim() == "console" {
                in_console = true;
            } else {
                in_other = true;
            }
            after_command = false;
            continue;
        }
        if !in_console {
            continue;
        }
        if let Some(c) = t.strip_prefix("$ ") {
            let (command, exit) = match c.rsplit_once("# exit ") {
                Some((cmd, code)) => (cmd.trim().to_string(), code.trim().parse().expect("`# exit N` with a number")),
                None => (c.trim().to_string(), 0),
            };
            out.push(Cmd { chapter: chapter.to_string(), line: i + 1, command, exit, shown: Vec::new() });
            after_command = true;
        } else if after_command && !t.trim().is_empty() && !matches!(t.trim(), "..." | "…") {
            out.last_mut().unwrap().shown.push(collapse(t));
        }
    }
    out
}

/// Whether the output line `actual` is the shown line `shown`: equal once whitespace is
/// collapsed, where every `…` of the shown line stands for any text (a timing, a figure that
/// differs between machines).
fn line_matches(shown: &str, actual: &str) -> bool {
    let actual = collapse(actual);
    let parts: Vec<&str> = shown.split('…').map(str::trim).collect();
    if parts.len() == 1 {
        return actual == shown;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !actual.starts_with(first) || !actual[first.len()..].ends_with(last) {
        return false;
    }
    let mut rest = &actual[first.len()..actual.len() - last.len()];
    for p in &parts[1..parts.len() - 1] {
        match rest.find(p) {
            Some(k) => rest = &rest[k + p.len()..],
            None => return false,
        }
    }
    true
}

/// The shown lines that no line of `output` matches, in order: each shown line must match an
/// output line after the one the line before it matched (output lines may be left out between
/// them: an excerpt).
fn unmatched<'a>(shown: &'a [String], output: &str) -> Vec<&'a str> {
    let lines: Vec<&str> = output.lines().collect();
    let mut at = 0;
    let mut missing = Vec::new();
    for s in shown {
        match lines[at..].iter().position(|l| line_matches(s, l)) {
            Some(k) => at += k + 1,
            None => missing.push(s.as_str()),
        }
    }
    missing
}

/// Every Markdown file of one language, sorted by name: the chapters and the glossary.
fn pages(lang: &str) -> Vec<(String, String)> {
    let dir = root().join("docs/guide").join(lang);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| (p.file_name().unwrap().to_string_lossy().to_string(), std::fs::read_to_string(&p).unwrap()))
        .collect()
}

/// The chapters of one language (`NN-name.md`), in order.
fn chapters(lang: &str) -> Vec<(String, String)> {
    pages(lang).into_iter().filter(|(name, _)| is_chapter(name)).collect()
}

fn is_chapter(name: &str) -> bool {
    let b = name.as_bytes();
    b.len() > 3 && b[0].is_ascii_digit() && b[1].is_ascii_digit() && b[2] == b'-'
}

/// Text outside fenced code blocks, line by line (fences and their contents become empty lines,
/// so line numbers stay those of the file).
fn prose(md: &str) -> Vec<String> {
    let mut fenced = false;
    md.lines()
        .map(|l| {
            if l.trim_start().starts_with("```") {
                fenced = !fenced;
                return String::new();
            }
            if fenced {
                String::new()
            } else {
                l.to_string()
            }
        })
        .collect()
}

/// Backticked spans of the prose that name a file or folder of the repository: no spaces, a
/// `/`, only path characters, and not generated (`target/...`), a placeholder (`a/...`),
/// absolute or a URL. A trailing
/// `:LINE` (or `:…`) is dropped.
fn repo_paths(md: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, line) in prose(md).iter().enumerate() {
        for (k, span) in line.split('`').enumerate() {
            if k % 2 == 0 {
                continue; // outside backticks
            }
            let path = span.split(':').next().unwrap_or("");
            let path_chars = path.chars().all(|c| c.is_ascii_alphanumeric() || "_-./".contains(c));
            if path.contains('/')
                && path_chars
                && !path.contains("...")
                && !path.starts_with("target/")
                && !path.starts_with('/')
                && !path.starts_with("../")
                && !path.starts_with("./")
                && path.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
            {
                out.push((i + 1, path.to_string()));
            }
        }
    }
    out
}

/// Relative Markdown links `[text](target)` of the prose (not `http...`, not `#...` alone).
fn relative_links(md: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, line) in prose(md).iter().enumerate() {
        let mut rest = line.as_str();
        while let Some(p) = rest.find("](") {
            rest = &rest[p + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = &rest[..end];
            if !target.starts_with("http") && !target.starts_with('#') && !target.is_empty() {
                out.push((i + 1, target.to_string()));
            }
            rest = &rest[end..];
        }
    }
    out
}

/// The anchors a page offers: explicit `id="..."` and GitHub's heading slugs.
fn anchors(md: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose(md) {
        let mut rest = line.as_str();
        while let Some(p) = rest.find("id=\"") {
            rest = &rest[p + 4..];
            if let Some(end) = rest.find('"') {
                out.push(rest[..end].to_string());
            }
        }
        if let Some(h) = line.trim_start().strip_prefix('#') {
            let h = h.trim_start_matches('#').trim();
            let slug: String = h
                .to_lowercase()
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                    _ => None,
                })
                .collect();
            out.push(slug);
        }
    }
    out
}

#[test]
fn english_and_german_chapters_have_the_same_commands() {
    let en = chapters("en");
    let de = chapters("de");
    let names = |v: &[(String, String)]| v.iter().map(|c| c.0.clone()).collect::<Vec<_>>();
    assert_eq!(names(&en), names(&de), "docs/guide/en and docs/guide/de must have the same chapter files");
    assert!(en.len() >= 6, "chapters 0 to 5");
    assert_eq!(en[0].0, "00-execution-model.md", "chapter 0 comes first");
    for ((name, e), (_, d)) in en.iter().zip(&de) {
        // Key lines may differ: the German chapter shows what a German reader sees.
        let ce: Vec<(String, i32)> = commands(e, name).into_iter().map(|c| (c.command, c.exit)).collect();
        let cd: Vec<(String, i32)> = commands(d, name).into_iter().map(|c| (c.command, c.exit)).collect();
        assert!(!ce.is_empty(), "{name}: no commands");
        assert_eq!(ce, cd, "{name}: the English and German chapters differ in their commands (or exit codes)");
    }
}

#[test]
fn every_command_in_the_guide_runs_as_documented() {
    let root = root();
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_memattn")).parent().unwrap().to_path_buf();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    // A reader has no `target/guide/` before the first chapter that writes there: each chapter
    // starts without it, and nothing here creates it.
    let guide_out = root.join("target/guide");
    let nightly = Command::new("rustc")
        .args(["+nightly", "-V"])
        .env_remove("RUSTUP_TOOLCHAIN")
        .output()
        .is_ok_and(|o| o.status.success());
    let (mut ran, mut ran_de, mut skipped, mut failures) = (0, 0, 0, Vec::new());
    let t_all = Instant::now();
    // `cargo xtask` (chapter 5) builds the xtask binary first (`run --bin xtask`: with the
    // workspace's features, so on top of the test build only xtask itself). It is built here,
    // in the background while the chapters before run, exactly as `cargo xtask` builds it (and
    // waited for before the first `cargo` command): the commands then run as documented.
    let mut xtask_build = Some({
        let root = root.clone();
        std::thread::spawn(move || {
            Command::new("cargo")
                .args(["build", "--quiet", "--bin", "xtask"])
                .current_dir(&root)
                .env_remove("RUSTUP_TOOLCHAIN")
                .output()
        })
    });
    // Runs `c` with `lang` as LANG and says what is wrong, if anything.
    let check = |c: &Cmd, lang: &str, page: &str| -> Option<String> {
        let t0 = Instant::now();
        let o = Command::new("bash")
            .args(["-c", &c.command])
            .current_dir(&root)
            .env("PATH", &path)
            .env_remove("RUSTUP_TOOLCHAIN")
            // The output is English unless the command or the chapter's language asks for German.
            .env_remove("LC_ALL")
            .env("LANG", lang)
            .output()
            .expect("spawn bash");
        let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        let all = format!("{out}\n{err}");
        let code = o.status.code().unwrap_or(-1);
        let at = format!("{page}/{}:{}", c.chapter, c.line);
        eprintln!("{:>6.2} s  exit {code}  {at}  {}", t0.elapsed().as_secs_f64(), c.command);
        if code != c.exit {
            return Some(format!("{at}: `{}` exited {code}, the guide says {}\n{all}", c.command, c.exit));
        }
        if c.shown.is_empty() {
            return (!all.trim().is_empty())
                .then(|| format!("{at}: `{}` shows no output in the guide but printed\n{all}", c.command));
        }
        // stdout and stderr are two streams: the shown lines may come from either first.
        let missing = unmatched(&c.shown, &all);
        let missing = if missing.is_empty() { missing } else { unmatched(&c.shown, &format!("{err}\n{out}")) };
        (!missing.is_empty()).then(|| {
            format!(
                "{at}: `{}` did not print {} of the {} line(s) the guide shows (in this order; `…` stands for any text):\n  {}\noutput:\n{all}",
                c.command,
                missing.len(),
                c.shown.len(),
                missing.join("\n  ")
            )
        })
    };
    let german: Vec<(String, String)> = chapters("de");
    for (name, text) in chapters("en") {
        let de_text = german.iter().find(|(n, _)| *n == name).map(|(_, t)| t.clone()).unwrap_or_default();
        let de_cmds = commands(&de_text, &name);
        match std::fs::remove_dir_all(&guide_out) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => panic!("cannot remove {}: {e}", guide_out.display()),
        }
        for (j, c) in commands(&text, &name).into_iter().enumerate() {
            if (c.command.contains("cargo xtask lesson") || c.command.contains("target/lessons/")) && !nightly {
                skipped += 1;
                continue;
            }
            ran += 1;
            if c.command.contains("cargo ") {
                if let Some(b) = xtask_build.take() {
                    // A failed build shows in the `cargo xtask` command that follows.
                    let _ = b.join();
                }
            }
            failures.extend(check(&c, "C.UTF-8", "en"));
            // The German chapter's output, where it differs: the same command for a German reader.
            if let Some(d) = de_cmds.get(j).filter(|d| d.command == c.command && d.shown != c.shown) {
                ran_de += 1;
                failures.extend(check(d, "de_DE.UTF-8", "de"));
            }
        }
    }
    eprintln!("guide: {ran} commands ran, {ran_de} of them again in German, in {:.1} s", t_all.elapsed().as_secs_f64());
    if skipped > 0 {
        eprintln!("SKIPPED: {skipped} lesson commands (the `nightly` toolchain is not installed)");
    }
    assert!(ran >= 15, "only {ran} commands found");
    assert!(ran_de >= 3 || skipped > 0, "only {ran_de} commands with German output ran");
    assert!(
        failures.is_empty(),
        "{} guide command(s) do not behave as documented:\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn the_command_parser_reads_exit_codes_and_shown_lines() {
    let md =
        "text\n```console\n$ memattn run   # exit 3\nerror:   x\n...\nmore\n\n$ ls\n```\n```sh\n$ not-a-command\n```\n";
    let c = commands(md, "t");
    assert_eq!(c.len(), 2);
    assert_eq!((c[0].command.as_str(), c[0].exit), ("memattn run", 3));
    assert_eq!(c[0].shown, vec!["error: x".to_string(), "more".to_string()]);
    assert_eq!((c[1].command.as_str(), c[1].exit, c[1].shown.len()), ("ls", 0, 0));
}

#[test]
fn shown_lines_match_whole_output_lines_with_ellipses_for_timings() {
    assert!(line_matches("time ms 69.1", "time ms   69.1"));
    assert!(!line_matches("time ms 69.1", "time ms 69.12"), "a whole line, not a prefix");
    assert!(line_matches("time ms … … (…x)", "time ms  69.121  173.173 (2.51x)"));
    assert!(line_matches("name: ptx-vm (… workers, 64 MiB)", "name: ptx-vm (16 workers, 64 MiB)"));
    assert!(!line_matches("name: ptx-vm (… workers, 64 MiB)", "name: ptx-vm (16 workers, 32 MiB)"));
    assert!(line_matches("… PASS", "12.5 PASS"));
    let shown = vec!["a 1".to_string(), "c …".to_string()];
    assert!(unmatched(&shown, "a 1\nb 2\nc 3\n").is_empty(), "lines may be left out between shown lines");
    assert_eq!(unmatched(&shown, "c 3\na 1\n"), vec!["c …"], "the shown order is the printed order");
    assert_eq!(unmatched(&shown, "a 2\nc 3\n"), vec!["a 1"], "a changed figure is a missing line");
}

#[test]
fn every_repository_path_the_guide_names_exists() {
    let root = root();
    let (mut checked, mut missing) = (0, Vec::new());
    for lang in ["en", "de"] {
        let mut texts = pages(lang);
        if lang == "en" {
            texts.push(("../README.md".into(), std::fs::read_to_string(root.join("docs/guide/README.md")).unwrap()));
        }
        for (name, text) in texts {
            for (line, path) in repo_paths(&text) {
                checked += 1;
                if !root.join(&path).exists() {
                    missing.push(format!("docs/guide/{lang}/{name}:{line}: `{path}` does not exist"));
                }
            }
        }
    }
    assert!(checked >= 20, "only {checked} repository paths found in the guide");
    assert!(missing.is_empty(), "the guide names paths that do not exist:\n{}", missing.join("\n"));
}

#[test]
fn every_relative_link_of_the_guide_leads_somewhere() {
    let guide = root().join("docs/guide");
    let mut broken = Vec::new();
    let mut all: Vec<(String, String, String)> =
        vec![(String::new(), "README.md".into(), std::fs::read_to_string(guide.join("README.md")).unwrap())];
    for lang in ["en", "de"] {
        all.extend(pages(lang).into_iter().map(|(n, t)| (lang.to_string(), n, t)));
    }
    for (lang, name, text) in all {
        for (line, link) in relative_links(&text) {
            let (file, anchor) = link.split_once('#').map_or((link.as_str(), None), |(f, a)| (f, Some(a)));
            let target = guide.join(&lang).join(file);
            match std::fs::read_to_string(&target) {
                Err(_) if target.exists() => {}
                Err(_) => broken.push(format!("{lang}/{name}:{line}: `{link}`: no file {}", target.display())),
                Ok(t) => {
                    if let Some(a) = anchor {
                        if !anchors(&t).iter().any(|x| x == a) {
                            broken.push(format!("{lang}/{name}:{line}: `{link}`: no anchor `{a}` there"));
                        }
                    }
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links in the guide:\n{}", broken.join("\n"));
}

#[test]
fn the_glossary_is_linked_and_has_the_same_terms_in_both_languages() {
    let ids = |lang: &str| {
        let g = std::fs::read_to_string(root().join("docs/guide").join(lang).join("glossary.md")).unwrap();
        let mut a: Vec<String> = anchors(&g).into_iter().filter(|a| !a.is_empty()).collect();
        a.retain(|x| g.contains(&format!("id=\"{x}\"")));
        a.sort();
        a
    };
    let (en, de) = (ids("en"), ids("de"));
    assert!(en.len() >= 20, "the glossary has only {} terms", en.len());
    assert_eq!(
        en, de,
        "docs/guide/en/glossary.md and docs/guide/de/glossary.md must define the same terms (`<a id=...>`)"
    );
    for lang in ["en", "de"] {
        for (name, text) in chapters(lang) {
            if name.as_str() < "05" {
                assert!(text.contains("](glossary.md#"), "{lang}/{name}: links no glossary term");
            }
        }
    }
}

#[test]
fn every_chapter_ends_with_a_quiz_with_folded_answers() {
    for lang in ["en", "de"] {
        for (name, text) in chapters(lang) {
            let p = prose(&text);
            let Some(q) = p.iter().rposition(|l| l.starts_with("## Quiz")) else {
                panic!("{lang}/{name}: no `## Quiz` section");
            };
            let rest = &p[q + 1..];
            assert!(!rest.iter().any(|l| l.starts_with("## ")), "{lang}/{name}: the quiz is not the last section");
            let questions = rest.iter().filter(|l| l.trim_start().starts_with("<details>")).count();
            let closed = rest.iter().filter(|l| l.trim() == "</details>").count();
            assert!((3..=5).contains(&questions), "{lang}/{name}: the quiz has {questions} folded answers, not 3 to 5");
            assert_eq!(questions, closed, "{lang}/{name}: a <details> block of the quiz is not closed");
        }
    }
}

#[test]
fn the_path_and_link_readers_find_what_they_should() {
    let md = "See `kernels-gpu/src/x.rs:12` and `target/guide/a.svg`, `a b/c`, `--x=1`.\n\
              ```sh\n`host/in/fence.rs`\n```\n[g](glossary.md#warp) [w](https://x.org/a) [c](01-memory.md)\n\
              ## The swizzle\n<a id=\"warp\"></a>\n";
    assert_eq!(repo_paths(md), vec![(1, "kernels-gpu/src/x.rs".to_string())]);
    assert_eq!(relative_links(md), vec![(5, "glossary.md#warp".to_string()), (5, "01-memory.md".to_string())]);
    let a = anchors(md);
    assert!(a.contains(&"the-swizzle".to_string()) && a.contains(&"warp".to_string()), "{a:?}");
    assert!(is_chapter("00-execution-model.md") && !is_chapter("glossary.md"));
}

/// A number with a space every three digits, as the guide writes them (`65 536`).
fn grouped(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(c);
    }
    out
}

/// Blocks of one kernel resident on one SM: each limit, the result and what limits it.
#[derive(Debug, PartialEq)]
struct Occupancy {
    by_regs: u64,
    by_smem: u64,
    by_threads: u64,
    blocks: u64,
    warps: u64,
    /// Per cent of the 64 warps an SM holds.
    percent: f64,
    /// `registers`, `shared memory` or both (`registers and shared memory`).
    limiter: &'static str,
}

/// NVIDIA's published limits per SM (chapter 0): 65 536 registers, 2048 threads, 64 warps;
/// `smem_kb` KB of shared memory with 1 KiB reserved per block.
fn occupancy(regs: u64, threads: u64, smem_bytes: u64, smem_kb: u64) -> Occupancy {
    let by_regs = 65_536 / (regs * threads);
    let by_smem = smem_kb / (smem_bytes.div_ceil(1024) + 1);
    let by_threads = 2048 / threads;
    let blocks = by_regs.min(by_smem).min(by_threads);
    let warps = blocks * threads / 32;
    let limiter = match (by_regs == blocks, by_smem == blocks) {
        (true, true) => "registers and shared memory",
        (true, false) => "registers",
        (false, true) => "shared memory",
        (false, false) => "threads",
    };
    Occupancy { by_regs, by_smem, by_threads, blocks, warps, percent: warps as f64 * 100.0 / 64.0, limiter }
}

/// `31.25`, `25`, `37.5` (en) or `31,25` (de).
fn percent(p: f64, lang: &str) -> String {
    let s = format!("{p:.2}");
    let s = s.trim_end_matches('0').trim_end_matches('.').to_string();
    if lang == "de" {
        s.replace('.', ",")
    } else {
        s
    }
}

#[test]
fn the_occupancy_arithmetic_follows_nvidias_limits() {
    // The figures of chapter 0 at the time of writing, and the earlier 80/72 registers.
    let h100 = occupancy(96, 128, 32768, 228);
    assert_eq!((h100.blocks, h100.warps, h100.limiter, h100.by_smem), (5, 20, "registers", 6));
    assert_eq!(percent(h100.percent, "en"), "31.25");
    assert_eq!(percent(h100.percent, "de"), "31,25");
    let a100 = occupancy(80, 128, 32768, 164);
    assert_eq!((a100.by_regs, a100.blocks, a100.limiter), (6, 4, "shared memory"));
    assert_eq!(percent(a100.percent, "en"), "25");
    assert_eq!(occupancy(128, 128, 32768, 164).limiter, "registers and shared memory");
    assert_eq!(grouped(65536), "65 536");
    assert_eq!(grouped(9216), "9 216");
    assert_eq!(grouped(512), "512");
}

/// Chapter 0's occupancy table and quiz question 4 are conclusions from `memattn kernels`: the
/// registers ptxas reported for `flash_fwd_f32_d64` and its shared memory. They are recomputed
/// here from what the command prints now, in both languages, so a new compiler or kernel that
/// changes the registers makes this test name the lines to update.
#[test]
fn chapter_0s_occupancy_is_computed_from_the_kernels_report() {
    let o = Command::new(env!("CARGO_BIN_EXE_memattn")).arg("kernels").output().expect("run memattn kernels");
    assert!(o.status.success(), "memattn kernels failed");
    let out = String::from_utf8_lossy(&o.stdout);
    let header: Vec<&str> =
        out.lines().find(|l| l.starts_with("kernel ")).expect("a header line").split("  ").collect();
    assert!(header.iter().any(|h| h.trim() == "regs"), "the report has no `regs` column: {header:?}");
    // Fields: kernel arch regs spill-st/ld stack static-smem dyn-smem barriers hmma.
    let row = |arch: &str| -> (u64, u64) {
        let f: Vec<&str> = out
            .lines()
            .find(|l| l.starts_with("flash_fwd_f32_d64 ") && l.split_whitespace().nth(1) == Some(arch))
            .unwrap_or_else(|| panic!("no flash_fwd_f32_d64 {arch} row in `memattn kernels`"))
            .split_whitespace()
            .collect();
        (
            f[2].parse().expect("regs"),
            f[6].parse::<u64>().expect("dyn smem") + f[5].parse::<u64>().expect("static smem"),
        )
    };
    let threads = 128;
    let ((r80, s80), (r90, s90)) = (row("sm_80"), row("sm_90"));
    let (a100, h100) = (occupancy(r80, threads, s80, 164), occupancy(r90, threads, s90, 228));
    let smem_kib = s80.div_ceil(1024);
    let mut wrong = Vec::new();
    for lang in ["en", "de"] {
        let text = std::fs::read_to_string(root().join("docs/guide").join(lang).join("00-execution-model.md")).unwrap();
        let (blocks, limited, regs, and, sm) = match lang {
            "en" => ("blocks", "limited by", "registers", "and", "shared memory"),
            _ => ("Blöcke", "begrenzt durch", "Register", "und", "Shared Memory"),
        };
        let limiter = |o: &Occupancy| match o.limiter {
            "registers" => regs.to_string(),
            "shared memory" => sm.to_string(),
            "registers and shared memory" => format!("{regs} {and} {sm}"),
            _ => "threads".to_string(),
        };
        let reg_cell = |r: u64, o: &Occupancy| format!("65 536 / {} → {} {blocks}", grouped(r * threads), o.by_regs);
        let smem_cell = |kb: u64, o: &Occupancy| format!("{kb} / {} → {} {blocks}", smem_kib + 1, o.by_smem);
        let warps = if lang == "en" { "warps" } else { "Warps" };
        let resident =
            |o: &Occupancy| format!("**{} {blocks} = {} {warps} ({} %)**", o.blocks, o.warps, percent(o.percent, lang));
        let h100_pct = percent(h100.percent, lang);
        let prose_and_quiz = match lang {
            "en" => [
                format!("its {r90} registers per thread leave room for {}", h100.by_regs),
                format!("with {r80} registers per thread, both allow {}", a100.blocks),
                format!("needs {r90} registers per thread"),
                format!(
                    "65 536 / ({r90} · {threads}) gives {} blocks = {} warps ({h100_pct} %)",
                    h100.blocks, h100.warps
                ),
                format!("would allow {}, the threads {}", h100.by_smem, h100.by_threads),
            ],
            _ => [
                format!("die {r90} Register je Thread aber nur {}", h100.by_regs),
                format!("beide mit {r80} Registern je Thread {} Blöcke", a100.blocks),
                format!("braucht der f32-Flash-Kernel {r90} Register je Thread"),
                format!(
                    "65 536 / ({r90} · {threads}) ergibt {} Blöcke = {} Warps ({h100_pct} %)",
                    h100.blocks, h100.warps
                ),
                format!("ließe {} zu, die Threads {}", h100.by_smem, h100.by_threads),
            ],
        };
        let mut expected = vec![
            format!("| {} {blocks} | {} {blocks} |", a100.by_threads, h100.by_threads),
            format!("| {} | {} |", reg_cell(r80, &a100), reg_cell(r90, &h100)),
            format!("| {} | {} |", smem_cell(164, &a100), smem_cell(228, &h100)),
            format!("| {} | {} |", resident(&a100), resident(&h100)),
            format!("| **{limited}** | {} | {} |", limiter(&a100), limiter(&h100)),
        ];
        expected.extend(prose_and_quiz);
        let flat = collapse(&text);
        for e in expected {
            if !flat.contains(&collapse(&e)) {
                wrong.push(format!("docs/guide/{lang}/00-execution-model.md does not say `{e}`"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "chapter 0's occupancy no longer follows `memattn kernels` (flash_fwd_f32_d64: {r80} registers on sm_80, \
         {r90} on sm_90, {s80} B of shared memory):\n{}",
        wrong.join("\n")
    );
}

/// A trace heading quoted in the prose (`` `file.rs:N (inlined; after file.rs:M)` ``) names
/// source lines that move whenever the kernels are edited: it must be one of the output lines the
/// same chapter shows (which `every_command_in_the_guide_runs_as_documented` checks against the
/// command), so the prose cannot keep an old line number.
#[test]
fn trace_headings_quoted_in_the_prose_are_shown_output() {
    let mut wrong = Vec::new();
    let mut quoted = 0;
    for lang in ["en", "de"] {
        for (name, text) in chapters(lang) {
            let shown: Vec<String> = commands(&text, &name).into_iter().flat_map(|c| c.shown).collect();
            let prose = prose(&text).join("\n");
            for (k, span) in prose.split('`').enumerate() {
                if k % 2 == 1 && span.contains(" (inlined; after ") {
                    quoted += 1;
                    let span = collapse(span);
                    if !shown.iter().any(|s| s.trim_start_matches("-- ") == span) {
                        wrong.push(format!("docs/guide/{lang}/{name}: `{span}` is not a line the chapter shows"));
                    }
                }
            }
        }
    }
    assert!(quoted >= 2, "no trace heading quoted in the prose");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The avoided words of the German glossary (its table under `## Vermiedene Wörter`: the first
/// cell of each row, a trailing `…` meaning any continuation of the word), as (word, is_prefix).
fn avoided_german_words() -> Vec<(String, bool)> {
    let g = std::fs::read_to_string(root().join("docs/guide/de/glossary.md")).unwrap();
    let Some(at) = g.find("## Vermiedene Wörter") else { return Vec::new() };
    g[at..]
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| vermeiden"))
        .filter_map(|l| l.split('|').nth(1).map(str::trim))
        .map(|w| match w.strip_suffix('…') {
            Some(stem) => (stem.to_string(), true),
            None => (w.to_string(), false),
        })
        .collect()
}

/// Where `word` occurs in `text` as a word (or, with `prefix`, as the start of one): the
/// neighbouring characters are not letters or digits.
fn finds_word(text: &str, word: &str, prefix: bool) -> bool {
    let is_word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric());
    let mut from = 0;
    while let Some(k) = text[from..].find(word) {
        let (a, b) = (from + k, from + k + word.len());
        let before = text[..a].chars().next_back();
        let after = text[b..].chars().next();
        let starts_word = !is_word(before) || !word.starts_with(|c: char| c.is_alphanumeric());
        if starts_word && (prefix || !is_word(after) || !word.ends_with(|c: char| c.is_alphanumeric())) {
            return true;
        }
        from = b;
    }
    false
}

#[test]
fn the_avoided_word_reader_finds_words_and_stems() {
    assert!(finds_word("die Banks zu", "Banks", false));
    assert!(!finds_word("die Bankskonflikte", "Banks", false));
    assert!(finds_word("das Reskalieren", "Reskalier", true));
    assert!(!finds_word("das Umskalieren", "skalier", true), "a stem starts a word");
    assert!(finds_word("er `return`t, dann", "`return`t", false));
}

/// One term per concept in German: the chapters' prose and the lessons' German READMEs use
/// none of the words the German glossary lists as avoided (code spans, commands and outputs
/// excepted: they show what programs print).
#[test]
fn german_text_uses_none_of_the_words_the_glossary_avoids() {
    let avoided = avoided_german_words();
    assert!(avoided.len() >= 10, "the German glossary lists only {} avoided words", avoided.len());
    let mut texts: Vec<(String, String)> =
        chapters("de").into_iter().map(|(n, t)| (format!("docs/guide/de/{n}"), t)).collect();
    let lessons = root().join("lessons");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&lessons).unwrap().map(|e| e.unwrap().path()).collect();
    dirs.sort();
    for d in dirs {
        if let Ok(t) = std::fs::read_to_string(d.join("README.de.md")) {
            texts.push((format!("lessons/{}/README.de.md", d.file_name().unwrap().to_string_lossy()), t));
        }
    }
    assert!(texts.len() >= 12, "only {} German texts found", texts.len());
    let mut found = Vec::new();
    for (name, text) in &texts {
        for (i, line) in prose(text).iter().enumerate() {
            // Outside code spans, unless the avoided word is itself written with one (`return`t).
            let plain = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
            for (w, prefix) in &avoided {
                let hay = if w.contains('`') { line.as_str() } else { plain.as_str() };
                if finds_word(hay, w, *prefix) {
                    found.push(format!("{name}:{}: `{w}` (the glossary's `## Vermiedene Wörter`)", i + 1));
                }
            }
        }
    }
    assert!(found.is_empty(), "German text uses words the glossary avoids:\n{}", found.join("\n"));
}
