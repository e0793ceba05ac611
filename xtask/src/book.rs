//! `cargo xtask book --check`: the book (`docs/`, an mdBook whose `src` is `docs/` itself) is
//! whole and its links resolve.
//!
//! - every Markdown page under `docs/` is a chapter of `docs/SUMMARY.md` (a page that is not
//!   would be left out of the built book, and links to it would break there);
//! - every chapter named in `SUMMARY.md` exists;
//! - every relative link of every chapter (and of README.md, which points into the book) names a
//!   file or folder of the repository, and a link to a chapter with `#anchor` names a heading of
//!   that chapter (anchors as mdBook and GitHub make them: lower case, spaces to `-`,
//!   punctuation dropped); `#anchor` alone names a heading of the same page.
//!
//! Links to web addresses are not followed (no network here). Links inside code blocks and inline
//! code are not links. `mdbook build docs/book` renders the book into `target/book/`.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

/// Runs the check from the repository root `root`; the error lists every problem found.
pub fn run(root: &Path) -> Result<(), String> {
    let docs = root.join("docs");
    let summary_path = docs.join("SUMMARY.md");
    let summary = std::fs::read_to_string(&summary_path).map_err(|e| format!("{}: {e}", summary_path.display()))?;
    let mut problems = Vec::new();
    let chapters: Vec<String> = links(&summary).into_iter().map(|l| l.target).collect();
    let listed: BTreeSet<PathBuf> = chapters.iter().map(|c| normalise(&docs.join(c))).collect();
    for c in &chapters {
        if !docs.join(c).is_file() {
            problems.push(format!("docs/SUMMARY.md: chapter `{c}` does not exist"));
        }
    }
    let mut pages = Vec::new();
    markdown_files(&docs, &mut pages);
    pages.sort();
    for p in &pages {
        if p.file_name().is_some_and(|n| n == "SUMMARY.md") {
            continue;
        }
        if !listed.contains(&normalise(p)) {
            problems.push(format!(
                "{}: not a chapter of docs/SUMMARY.md (the built book would leave it out)",
                rel(root, p)
            ));
        }
    }
    let mut checked = 0;
    for page in pages.iter().chain(std::iter::once(&root.join("README.md"))) {
        let text = std::fs::read_to_string(page).map_err(|e| format!("{}: {e}", page.display()))?;
        for link in links(&text) {
            checked += 1;
            if let Err(e) = resolve(root, &docs, &listed, page, &text, &link.target) {
                problems.push(format!("{}:{}: link `{}`: {e}", rel(root, page), link.line, link.target));
            }
        }
    }
    if problems.is_empty() {
        println!("book: {} chapters in docs/SUMMARY.md, every page listed, {checked} links resolve", chapters.len());
        Ok(())
    } else {
        Err(format!("the book has {} problem(s):\n{}", problems.len(), problems.join("\n")))
    }
}

/// One link of a page: its target as written and the line it is on (1-based).
#[derive(Debug, PartialEq)]
pub struct Link {
    pub target: String,
    pub line: usize,
}

/// The targets of the Markdown links and images of `text` (`[label](target)`, `![alt](target)`,
/// an optional `"title"` after the target dropped), outside fenced code blocks and inline code.
pub fn links(text: &str) -> Vec<Link> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let line = strip_inline_code(line);
        let b = line.as_bytes();
        let mut at = 0;
        while let Some(off) = line[at..].find("](") {
            let start = at + off + 2;
            // The label must open on this line: an unmatched `]` is not a link.
            let opened = line[..at + off].rfind('[').is_some();
            let mut depth = 0usize;
            let mut end = start;
            while end < b.len() {
                match b[end] {
                    b'(' => depth += 1,
                    b')' if depth == 0 => break,
                    b')' => depth -= 1,
                    _ => {}
                }
                end += 1;
            }
            if opened && end < b.len() {
                let target = line[start..end].split_whitespace().next().unwrap_or("").trim_matches(['<', '>']);
                if !target.is_empty() {
                    out.push(Link { target: target.to_string(), line: i + 1 });
                }
            }
            at = end.max(start);
        }
    }
    out
}

/// `line` with the contents of inline code spans blanked, so a `[a](b)` inside backticks is no link.
fn strip_inline_code(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut in_code = false;
    for ch in line.chars() {
        if ch == '`' {
            in_code = !in_code;
            out.push(ch);
        } else if in_code {
            out.push(' ');
        } else {
            out.push(ch);
        }
    }
    out
}

/// The anchors of a page: its headings', as mdBook (and GitHub) make them — the heading's text
/// without its Markdown (code ticks, emphasis, link targets), lower case, whitespace to `-`, every
/// character that is not alphanumeric, `-` or `_` dropped; a repeated anchor gets `-1`, `-2`, ...
/// — and the `id="..."` of HTML elements (`<a id="bank"></a>`).
pub fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for part in text.split("id=\"").skip(1) {
        if let Some(id) = part.split('"').next() {
            out.insert(id.to_string());
        }
    }
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced || !line.starts_with('#') {
            continue;
        }
        let heading = line.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let base = slug(&plain_text(heading.trim()));
        let mut id = base.clone();
        let mut n = 1;
        while out.contains(&id) {
            id = format!("{base}-{n}");
            n += 1;
        }
        out.insert(id);
    }
    out
}

/// A heading's text as rendered: `[label](target)` becomes `label`; ticks, `*` and `_` pairs go.
fn plain_text(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(open) = rest.find('[') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        match after.find("](").and_then(|close| after[close..].find(')').map(|p| (close, close + p))) {
            Some((close, end)) => {
                out.push_str(&after[..close]);
                rest = &after[end + 1..];
            }
            None => {
                out.push('[');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out.replace(['`', '*'], "")
}

/// mdBook's `normalize_id`.
pub fn slug(text: &str) -> String {
    text.chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c.to_lowercase().next().unwrap_or(c))
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

fn resolve(
    root: &Path,
    docs: &Path,
    listed: &BTreeSet<PathBuf>,
    page: &Path,
    page_text: &str,
    target: &str,
) -> Result<(), String> {
    if target.contains("://") || target.starts_with("mailto:") {
        return Ok(());
    }
    let (path, anchor) = match target.split_once('#') {
        Some((p, a)) => (p, Some(a)),
        None => (target, None),
    };
    if path.is_empty() {
        let a = anchor.unwrap_or("");
        return if anchors(page_text).contains(a) { Ok(()) } else { Err(format!("no heading `#{a}` on this page")) };
    }
    if path.starts_with('/') {
        return Err("absolute paths break outside the repository; use a relative one".into());
    }
    let file = normalise(&page.parent().unwrap_or(root).join(path));
    if !file.starts_with(normalise(root)) {
        return Err("points outside the repository".into());
    }
    if !file.exists() {
        return Err(format!("{} does not exist", rel(root, &file)));
    }
    let is_md = file.extension().is_some_and(|e| e == "md");
    let summary = file == normalise(&docs.join("SUMMARY.md"));
    if is_md && !summary && file.starts_with(normalise(docs)) && !listed.contains(&file) {
        return Err(format!("{} is not a chapter of docs/SUMMARY.md", rel(root, &file)));
    }
    if let (Some(a), true) = (anchor, is_md) {
        let text = std::fs::read_to_string(&file).map_err(|e| e.to_string())?;
        if !anchors(&text).contains(a) {
            return Err(format!("{} has no heading `#{a}`", rel(root, &file)));
        }
    }
    Ok(())
}

/// `p` with `.` and `..` folded (no file-system access, no symlinks resolved).
fn normalise(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

fn rel(root: &Path, p: &Path) -> String {
    normalise(p)
        .strip_prefix(normalise(root))
        .map(|r| r.display().to_string())
        .unwrap_or_else(|_| p.display().to_string())
}

fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            markdown_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "md") {
            out.push(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_outside_code_only() {
        let text = "see [a](x.md#h) and `[b](y.md)`\n```\n[c](z.md)\n```\n![img](f.svg \"t\") [d](e(1).md)\nno] (link)";
        let got: Vec<(String, usize)> = links(text).into_iter().map(|l| (l.target, l.line)).collect();
        assert_eq!(
            got,
            vec![("x.md#h".into(), 1), ("f.svg".into(), 5), ("e(1).md".into(), 5)],
            "links in code are no links; nested parentheses stay"
        );
    }

    #[test]
    fn anchors_as_mdbook_makes_them() {
        let text = "# Set-up: two commands\n## The `Kernels` handle\n## [Link](x.md) text\n## Set-up: two commands\n```\n# not a heading\n```\n#nospace\n- <a id=\"bank\"></a>**Bank**";
        let a = anchors(text);
        let want: BTreeSet<String> =
            ["set-up-two-commands", "the-kernels-handle", "link-text", "set-up-two-commands-1", "bank"]
                .iter()
                .map(|s| s.to_string())
                .collect();
        assert_eq!(a, want);
        assert_eq!(slug("Übung: Zeilen & Spalten"), "übung-zeilen--spalten");
    }

    /// The repository's own book (what CI's `cargo xtask book --check` runs).
    #[test]
    fn the_repository_book_is_whole() {
        run(&crate::paths::root()).unwrap();
    }

    /// A scratch book: one good page, and each kind of mistake is reported.
    #[test]
    fn broken_links_and_unlisted_pages_fail() {
        let root = std::env::temp_dir().join(format!("memattn-book-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("docs/sub")).unwrap();
        std::fs::write(root.join("README.md"), "[book](docs/a.md#first)\n").unwrap();
        std::fs::write(root.join("docs/SUMMARY.md"), "# Summary\n- [A](a.md)\n- [B](sub/b.md)\n").unwrap();
        std::fs::write(root.join("docs/a.md"), "# First\n[b](sub/b.md#second) [self](#first) [readme](../README.md)\n")
            .unwrap();
        std::fs::write(root.join("docs/sub/b.md"), "# Second\n").unwrap();
        assert_eq!(run(&root), Ok(()));

        std::fs::write(root.join("docs/a.md"), "# First\n[b](sub/b.md#third) [gone](missing.md) [self](#nope)\n")
            .unwrap();
        std::fs::write(root.join("docs/c.md"), "# Unlisted\n").unwrap();
        let e = run(&root).unwrap_err();
        for want in [
            "docs/c.md: not a chapter",
            "docs/a.md:2: link `sub/b.md#third`: docs/sub/b.md has no heading `#third`",
            "link `missing.md`: docs/missing.md does not exist",
            "link `#nope`: no heading `#nope` on this page",
        ] {
            assert!(e.contains(want), "want `{want}` in:\n{e}");
        }
        let _ = std::fs::remove_dir_all(&root);
    }
}
