//! The guide cannot rot: every command in `docs/guide/en/*.md` is run here, in order, from the
//! repository root, and must exit with its documented code and print its key line; the German
//! chapters must contain the same commands.
//!
//! Conventions (also in `docs/guide/README.md`): a command is a line starting with `$ ` inside a
//! fenced block marked `console`; `# exit N` at the end of the line is its expected exit code
//! (default 0); the first output line shown under it is its key line, which must appear in the
//! command's stdout or stderr (whitespace collapsed). A command shown without output must print
//! nothing.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

#[derive(Debug, Clone, PartialEq)]
struct Cmd {
    chapter: String,
    line: usize,
    command: String,
    exit: i32,
    key: Option<String>,
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
    let mut want_key = false;
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
            want_key = false;
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
            out.push(Cmd { chapter: chapter.to_string(), line: i + 1, command, exit, key: None });
            want_key = true;
        } else if want_key && !t.trim().is_empty() {
            out.last_mut().unwrap().key = Some(collapse(t));
            want_key = false;
        }
    }
    out
}

fn chapters(lang: &str) -> Vec<(String, String)> {
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

#[test]
fn english_and_german_chapters_have_the_same_commands() {
    let en = chapters("en");
    let de = chapters("de");
    let names = |v: &[(String, String)]| v.iter().map(|c| c.0.clone()).collect::<Vec<_>>();
    assert_eq!(names(&en), names(&de), "docs/guide/en and docs/guide/de must have the same chapter files");
    assert!(en.len() >= 5, "five chapters");
    for ((name, e), (_, d)) in en.iter().zip(&de) {
        let ce: Vec<(String, i32, Option<String>)> =
            commands(e, name).into_iter().map(|c| (c.command, c.exit, c.key)).collect();
        let cd: Vec<(String, i32, Option<String>)> =
            commands(d, name).into_iter().map(|c| (c.command, c.exit, c.key)).collect();
        assert!(!ce.is_empty(), "{name}: no commands");
        assert_eq!(ce, cd, "{name}: the English and German chapters differ in their commands (or key lines)");
    }
}

#[test]
fn every_command_in_the_guide_runs_as_documented() {
    let root = root();
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_memattn")).parent().unwrap().to_path_buf();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    let guide_out = root.join("target/guide");
    let _ = std::fs::remove_dir_all(&guide_out);
    std::fs::create_dir_all(&guide_out).unwrap();
    let nightly = Command::new("rustc")
        .args(["+nightly", "-V"])
        .env_remove("RUSTUP_TOOLCHAIN")
        .output()
        .is_ok_and(|o| o.status.success());
    let (mut ran, mut skipped, mut failures) = (0, 0, Vec::new());
    let t_all = Instant::now();
    for (name, text) in chapters("en") {
        for c in commands(&text, &name) {
            if (c.command.starts_with("cargo xtask lesson") || c.command.contains("target/lessons/")) && !nightly {
                skipped += 1;
                continue;
            }
            let t0 = Instant::now();
            let o = Command::new("bash")
                .args(["-c", &c.command])
                .current_dir(&root)
                .env("PATH", &path)
                .env_remove("RUSTUP_TOOLCHAIN")
                .output()
                .expect("spawn bash");
            ran += 1;
            let all = format!("{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
            let code = o.status.code().unwrap_or(-1);
            eprintln!("{:>6.2} s  exit {code}  {}:{}  {}", t0.elapsed().as_secs_f64(), c.chapter, c.line, c.command);
            if code != c.exit {
                failures.push(format!(
                    "{}:{}: `{}` exited {code}, the guide says {}\n{all}",
                    c.chapter, c.line, c.command, c.exit
                ));
            } else if let Some(key) = &c.key {
                if !collapse(&all).contains(key) {
                    failures.push(format!(
                        "{}:{}: `{}` did not print its key line\n  {key}\noutput:\n{all}",
                        c.chapter, c.line, c.command
                    ));
                }
            } else if !all.trim().is_empty() {
                failures.push(format!(
                    "{}:{}: `{}` shows no output in the guide but printed\n{all}",
                    c.chapter, c.line, c.command
                ));
            }
        }
    }
    eprintln!("guide: {ran} commands ran in {:.1} s", t_all.elapsed().as_secs_f64());
    if skipped > 0 {
        eprintln!("SKIPPED: {skipped} lesson commands (the `nightly` toolchain is not installed)");
    }
    assert!(ran >= 15, "only {ran} commands found");
    assert!(
        failures.is_empty(),
        "{} guide command(s) do not behave as documented:\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn the_command_parser_reads_exit_codes_and_key_lines() {
    let md = "text\n```console\n$ memattn run   # exit 3\nerror: x\n\n$ ls\n```\n```sh\n$ not-a-command\n```\n";
    let c = commands(md, "t");
    assert_eq!(c.len(), 2);
    assert_eq!((c[0].command.as_str(), c[0].exit, c[0].key.as_deref()), ("memattn run", 3, Some("error: x")));
    assert_eq!((c[1].command.as_str(), c[1].exit, c[1].key.as_deref()), ("ls", 0, None));
}
