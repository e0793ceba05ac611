//! Rust source lines for PTX lines, from the `.file`/`.loc` line tables rustc writes with
//! `-C debuginfo=line-tables-only` (the kernel build's default).
//!
//! Each PTX line gets the innermost location of the last `.loc` before it in its function. rustc's
//! NVPTX backend writes no `inlined_at`, so an instruction of an inlined helper (a load in
//! `device.rs`) names the helper's line; for those the map also keeps the last line of the
//! function's own file seen before it in the PTX (the line of the kernel that was being compiled
//! there, usually the caller). A `.loc` with line 0 (code the compiler made up) clears the location.

use std::collections::HashMap;
use std::fmt;

/// Where a PTX line came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceLoc {
    /// Path as written in `.file`, e.g. `kernels-gpu/src/flash_fwd_f32.rs`.
    pub file: String,
    pub line: u32,
    /// When `file` is not the function's own file (an inlined helper): the last line of the
    /// function's own file before this PTX line.
    pub near: Option<(String, u32)>,
}

impl fmt::Display for SourceLoc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file, self.line)?;
        if let Some((file, line)) = &self.near {
            write!(f, " (inlined; after {file}:{line})")?;
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Default)]
struct Entry {
    file: u32,
    line: u32,
    near_file: u32,
    near_line: u32,
}

/// PTX line (1-based) -> source location, for a whole module.
#[derive(Default)]
pub(crate) struct SourceMap {
    files: HashMap<u32, String>,
    lines: Vec<Entry>,
}

impl SourceMap {
    pub fn build(ptx: &str) -> SourceMap {
        let mut files = HashMap::new();
        // About one line per 30 bytes in the kernels' PTX: one allocation, no regrowth.
        let mut lines = Vec::with_capacity(ptx.len() / 30);
        let mut cur = Entry::default();
        let mut own_file = 0u32;
        let mut in_body = false;
        // Where `.func` occurs, found in one pass over the text: a line contains it when the next
        // occurrence at or after the line's start ends within the line (it spans no whitespace,
        // so the trimmed line contains it too).
        let funcs: Vec<usize> = ptx.match_indices(".func").map(|(at, _)| at).collect();
        let mut next_func = 0;
        for text in ptx.lines() {
            let start = text.as_ptr() as usize - ptx.as_ptr() as usize;
            while funcs.get(next_func).is_some_and(|&at| at < start) {
                next_func += 1;
            }
            let has_func = funcs.get(next_func).is_some_and(|&at| at + ".func".len() <= start + text.len());
            let t = text.trim();
            if t.starts_with(".visible .entry") || t.starts_with(".entry") || has_func && !t.ends_with(';') {
                cur = Entry::default();
                own_file = 0;
                in_body = true;
            }
            if let Some(rest) = t.strip_prefix(".file") {
                let mut it = rest.trim().splitn(2, char::is_whitespace);
                if let (Some(n), Some(path)) = (it.next(), it.next()) {
                    if let Ok(n) = n.parse::<u32>() {
                        let path = path.trim();
                        let path = path.split('"').nth(1).unwrap_or(path);
                        files.insert(n, path.to_string());
                    }
                }
            } else if let Some(rest) = t.strip_prefix(".loc") {
                let mut it = rest.split_whitespace();
                let f = it.next().and_then(|x| x.parse::<u32>().ok()).unwrap_or(0);
                let l = it.next().and_then(|x| x.trim_end_matches(',').parse::<u32>().ok()).unwrap_or(0);
                if in_body && own_file == 0 && f != 0 && l != 0 {
                    own_file = f;
                }
                if l == 0 {
                    cur.file = 0;
                    cur.line = 0;
                } else {
                    cur.file = f;
                    cur.line = l;
                    if f == own_file {
                        cur.near_file = f;
                        cur.near_line = l;
                    }
                }
            }
            lines.push(cur);
        }
        SourceMap { files, lines }
    }

    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    pub fn get(&self, ptx_line: usize) -> Option<SourceLoc> {
        let e = *self.lines.get(ptx_line.checked_sub(1)?)?;
        if e.line == 0 {
            return None;
        }
        let file = self.files.get(&e.file)?.clone();
        let near = if e.file != e.near_file && e.near_line != 0 {
            self.files.get(&e.near_file).map(|f| (f.clone(), e.near_line))
        } else {
            None
        };
        Some(SourceLoc { file, line: e.line, near })
    }
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    /// The map as the plain rule builds it: `contains(".func")` on every trimmed line.
    fn build_plain(ptx: &str) -> SourceMap {
        let mut files = HashMap::new();
        let mut lines = Vec::new();
        let mut cur = Entry::default();
        let mut own_file = 0u32;
        let mut in_body = false;
        for text in ptx.lines() {
            let t = text.trim();
            if t.starts_with(".visible .entry") || t.starts_with(".entry") || t.contains(".func") && !t.ends_with(';') {
                cur = Entry::default();
                own_file = 0;
                in_body = true;
            }
            if let Some(rest) = t.strip_prefix(".file") {
                let mut it = rest.trim().splitn(2, char::is_whitespace);
                if let (Some(n), Some(path)) = (it.next(), it.next()) {
                    if let Ok(n) = n.parse::<u32>() {
                        let path = path.trim();
                        files.insert(n, path.split('"').nth(1).unwrap_or(path).to_string());
                    }
                }
            } else if let Some(rest) = t.strip_prefix(".loc") {
                let mut it = rest.split_whitespace();
                let f = it.next().and_then(|x| x.parse::<u32>().ok()).unwrap_or(0);
                let l = it.next().and_then(|x| x.trim_end_matches(',').parse::<u32>().ok()).unwrap_or(0);
                if in_body && own_file == 0 && f != 0 && l != 0 {
                    own_file = f;
                }
                if l == 0 {
                    cur.file = 0;
                    cur.line = 0;
                } else {
                    cur.file = f;
                    cur.line = l;
                    if f == own_file {
                        cur.near_file = f;
                        cur.near_line = l;
                    }
                }
            }
            lines.push(cur);
        }
        SourceMap { files, lines }
    }

    pub fn the_one_pass_func_search_builds_the_plain_map() {
        // Both committed modules, and lines that name `.func` where the plain rule sees them:
        // in a comment, at a line's end, across a `.loc`, with and without `;`.
        let odd = ".file 1 \"k.rs\"\n.entry e(\n.loc 1 5 0\nmov;\n// .func b(\n.loc 1 6 0\n\t.func c;\n\
                   .loc 1 7 0\nx;\n  y .func\n.loc 2 8 0\n.func\n.loc 1 9 0\n.func.func\n";
        for ptx in [kernels_gpu::artifacts::PTX, kernels_gpu::artifacts::PTX_SM90, odd] {
            let (fast, plain) = (SourceMap::build(ptx), build_plain(ptx));
            assert_eq!(fast.files, plain.files);
            assert_eq!(fast.lines.len(), plain.lines.len());
            for (n, (a, b)) in fast.lines.iter().zip(&plain.lines).enumerate() {
                let key = |e: &Entry| (e.file, e.line, e.near_file, e.near_line);
                assert_eq!(key(a), key(b), "PTX line {}", n + 1);
            }
        }
    }

    pub fn lines_map_to_the_last_loc_and_inlined_helpers_keep_the_kernel_line() {
        let ptx = "\
.visible .entry k(
)
{
\t.loc\t1 10 0
\tmov.u32 %r1, 1;
\t.loc\t2 76 14
\tld.f32 %f1, [%rd1];
\t.loc\t1 0 3
\tadd.s32 %r2, %r1, 1;
\t.loc\t1 12 5
\tst.f32 [%rd1], %f1;
}
\t.file\t1 \"kernels-gpu/src/k.rs\"
\t.file\t2 \"kernels-gpu/src/device.rs\"
";
        let m = SourceMap::build(ptx);
        assert_eq!(m.get(5).map(|s| s.to_string()).as_deref(), Some("kernels-gpu/src/k.rs:10"));
        assert_eq!(
            m.get(7).map(|s| s.to_string()).as_deref(),
            Some("kernels-gpu/src/device.rs:76 (inlined; after kernels-gpu/src/k.rs:10)")
        );
        assert_eq!(m.get(9), None, "line 0: no location");
        assert_eq!(m.get(11).map(|s| s.line), Some(12));
        assert_eq!(m.get(2), None, "before any .loc");
        assert_eq!(m.get(999), None);
    }
}
