//! The evidence file of `--save`: one JSON object per line, one line per command that ran,
//! whatever its outcome.
//!
//! Appends are atomic with respect to other `memattn` processes: the file is opened with
//! `O_APPEND`, locked (`flock`, exclusive) for the append, and the whole line goes out in one
//! `write`. If the file does not end in a newline (an append that was interrupted part-way, or a
//! file edited by hand), the new record starts on a line of its own, so it never glues onto the
//! broken one; `evidence show` then names the broken line.
//!
//! An append that fails part-way (the file-size limit, a full disk) is rolled back to the file's
//! old length under the lock, so this version never leaves a torn line; a torn last line that
//! an older version left is reported by [`read`] as a [`BadLine`] with `torn` set.

use serde_json::Value;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;

/// Holds an exclusive advisory lock on a file for as long as it lives.
struct Locked<'a>(&'a File);

impl<'a> Locked<'a> {
    #[cfg(unix)]
    fn new(f: &'a File) -> io::Result<Self> {
        use std::os::unix::io::AsRawFd;
        loop {
            // SAFETY: flock on a file descriptor we own; no memory is passed.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(Locked(f));
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
    #[cfg(not(unix))]
    fn new(f: &'a File) -> io::Result<Self> {
        Ok(Locked(f))
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        #[cfg(unix)]
        {
            use std::os::unix::io::AsRawFd;
            // SAFETY: as above.
            unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
        }
    }
}

/// Whether the file's last byte is something other than a newline.
fn ends_without_newline(f: &File) -> io::Result<bool> {
    let len = f.metadata()?.len();
    if len == 0 {
        return Ok(false);
    }
    let mut last = [0u8; 1];
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileExt;
        f.read_exact_at(&mut last, len - 1)?;
    }
    #[cfg(not(unix))]
    {
        use std::io::{Read, Seek, SeekFrom};
        let mut g = f.try_clone()?;
        g.seek(SeekFrom::Start(len - 1))?;
        g.read_exact(&mut last)?;
    }
    Ok(last[0] != b'\n')
}

/// Opens (creating) the evidence file for appending. Only a regular file is accepted: opening
/// for reading and writing does not block on a FIFO (opening it write-only would, until a reader
/// appears), and the type is checked on the opened file, so no later swap of the path matters.
pub fn open(path: &Path) -> io::Result<File> {
    let f = OpenOptions::new().create(true).append(true).read(true).open(path)?;
    if !f.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file; evidence is appended to regular files only",
        ));
    }
    Ok(f)
}

/// Why an append failed.
#[derive(Debug, thiserror::Error)]
pub enum AppendError {
    /// A host resource limit (the file-size limit, a full disk, a quota): the file was rolled
    /// back to its old length, nothing of the record is in it.
    #[error("{0}; the record was not appended (the file is as it was)")]
    Resource(String),
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// Appends `record` as one line: the whole line, or (on an error part-way) nothing.
pub fn append(path: &Path, record: &Value) -> Result<(), AppendError> {
    let mut line = serde_json::to_string(record).map_err(io::Error::other)?;
    line.push('\n');
    let f = open(path)?;
    let _lock = Locked::new(&f)?;
    let mut buf = Vec::with_capacity(line.len() + 1);
    if ends_without_newline(&f)? {
        buf.push(b'\n');
    }
    buf.extend_from_slice(line.as_bytes());
    let old_len = f.metadata()?.len();
    // `write_all` finishes a short write (a signal); an error part-way (EFBIG under the
    // file-size limit, ENOSPC) rolls the file back to where it was, under the same lock.
    let mut out = &f;
    if let Err(e) = out.write_all(&buf) {
        let rolled_back = f.set_len(old_len);
        let needed = old_len + buf.len() as u64;
        return Err(match (crate::files::resource_limit(&e, needed), rolled_back) {
            (Some(m), Ok(())) => AppendError::Resource(m),
            (None, Ok(())) => AppendError::Io(e),
            (_, Err(r)) => AppendError::Io(io::Error::new(
                e.kind(),
                format!(
                    "{e}; rolling the file back to its {old_len} bytes failed too ({r}): its last line may be torn"
                ),
            )),
        });
    }
    Ok(())
}

/// One record of an evidence file, numbered by its line (1-based).
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    pub line: usize,
    pub value: Value,
}

/// A line that is not a JSON object.
#[derive(Clone, Debug, PartialEq)]
pub struct BadLine {
    pub line: usize,
    pub error: String,
    /// The first characters of the line.
    pub start: String,
    /// A JSON object cut short (the text ends inside it): an append that an older version left
    /// unfinished (this one rolls a failed append back). Other bad lines were edited by hand.
    pub torn: bool,
}

/// Largest evidence file read (a record is a few KiB).
pub const MAX_EVIDENCE_BYTES: u64 = 1 << 30;

/// Reads every line; empty lines are skipped, anything else that is not a JSON object is a
/// [`BadLine`].
pub fn read(path: &Path) -> Result<(Vec<Record>, Vec<BadLine>), String> {
    // A FIFO or a device would block or never end: only regular files, of a bounded size.
    let text = crate::files::read_regular(path, MAX_EVIDENCE_BYTES, "evidence file").map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&text);
    let mut good = Vec::new();
    let mut bad = Vec::new();
    for (i, l) in text.split('\n').enumerate() {
        if l.trim().is_empty() {
            continue;
        }
        let start = l.chars().take(60).collect();
        match serde_json::from_str::<Value>(l) {
            Ok(v) if v.is_object() => good.push(Record { line: i + 1, value: v }),
            Ok(_) => bad.push(BadLine { line: i + 1, error: "not a JSON object".into(), start, torn: false }),
            Err(e) => {
                let torn = e.is_eof() && l.trim_start().starts_with('{');
                bad.push(BadLine { line: i + 1, error: e.to_string(), start, torn })
            }
        }
    }
    Ok((good, bad))
}

/// One figure of a record, for tables and diffs.
#[derive(Clone, Debug, PartialEq)]
pub struct Metric {
    pub name: String,
    pub value: Value,
    /// `bytes`, `ms`, `err` or `` (how to print and compare it).
    pub unit: &'static str,
}

fn push(out: &mut Vec<Metric>, prefix: &str, name: &str, v: &Value, unit: &'static str) {
    if !v.is_null() {
        out.push(Metric { name: format!("{prefix}{name}"), value: v.clone(), unit });
    }
}

fn run_metrics(out: &mut Vec<Metric>, prefix: &str, r: &Value) {
    push(out, prefix, "verified", &r["verified"], "");
    push(out, prefix, "expected bytes", &r["analytic_bytes"]["total"], "bytes");
    push(out, prefix, "measured peak", &r["peak_device_bytes"], "bytes");
    push(out, prefix, "time ms", &r["time_ms"], "ms");
    push(out, prefix, "O rel RMS err", &r["rel_rms_err"], "err");
}

/// The figures of a record: exit code, and per run: verified, expected and measured bytes, time,
/// error; for a plan: the total, the limit and whether it fits.
pub fn metrics(rec: &Value) -> Vec<Metric> {
    let mut out = Vec::new();
    push(&mut out, "", "exit code", &rec["exit_code"], "");
    let r = &rec["result"];
    if r["peak_device_bytes"].is_u64() {
        run_metrics(&mut out, "", r);
    }
    let vary = r["vary"].as_str().unwrap_or("");
    for key in ["runs", "points"] {
        for p in r[key].as_array().into_iter().flatten() {
            let prefix =
                format!("{vary}={} {}: ", p["value"].as_str().unwrap_or("?"), p["kernel"].as_str().unwrap_or("?"));
            if p["report"].is_object() {
                run_metrics(&mut out, &prefix, &p["report"]);
            } else {
                push(&mut out, &prefix, "would need", &p["would_need_bytes"], "bytes");
            }
        }
    }
    if r["command"] == "plan" {
        let k = r["workload"]["kernel"].as_str().unwrap_or("flash");
        push(&mut out, "", "plan total", &r[k]["total"], "bytes");
        push(&mut out, "", "KV cache", &r[k]["kv_cache"], "bytes");
        push(&mut out, "", "limit", &r["limit_bytes"], "bytes");
        push(&mut out, "", "fits", &r["fits"], "");
        push(&mut out, "", "largest batch", &r["largest_batch"], "");
    }
    if out.len() == 1 {
        // No result (a refusal or an error): what was expected, and what the device had free.
        push(&mut out, "", "expected bytes", &rec["expected"]["analytic_bytes"]["total"], "bytes");
        push(&mut out, "", "device free", &rec["observed"]["device"]["free_bytes"], "bytes");
    }
    out
}

/// The tokens of `a` and `b` that differ, each with the token before them for context:
/// `["--seq 256 -> --seq 512"]`.
pub fn argv_changes(a: &[String], b: &[String]) -> Vec<String> {
    // The common head and tail are kept as they are; only the middle is aligned.
    let head = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let tail = a[head..].iter().rev().zip(b[head..].iter().rev()).take_while(|(x, y)| x == y).count();
    let (mid_a, mid_b) = (&a[head..a.len() - tail], &b[head..b.len() - tail]);
    if mid_a.len().saturating_mul(mid_b.len()) > MAX_ALIGNED_CELLS {
        // The alignment table grows with the product of the lengths: past the bound, say what
        // differs without aligning it.
        return vec![format!(
            "{} tokens -> {} tokens from token {} on (too long to align token by token)",
            mid_a.len(),
            mid_b.len(),
            head + 1
        )];
    }
    let context = head.checked_sub(1).map(|i| a[i].as_str());
    argv_changes_aligned(mid_a, mid_b, context)
}

/// Cells of the longest-common-subsequence table [`argv_changes`] fills at most (16 MiB of it).
const MAX_ALIGNED_CELLS: usize = 1 << 21;

fn argv_changes_aligned(a: &[String], b: &[String], context: Option<&str>) -> Vec<String> {
    // Longest common subsequence of the two token lists.
    let (n, m) = (a.len(), b.len());
    let mut l = vec![vec![0usize; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            l[i][j] = if a[i] == b[j] { l[i + 1][j + 1] + 1 } else { l[i + 1][j].max(l[i][j + 1]) };
        }
    }
    let (mut i, mut j) = (0, 0);
    let mut out = Vec::new();
    let mut last_common: Option<&str> = context;
    while i < n || j < m {
        if i < n && j < m && a[i] == b[j] {
            last_common = Some(&a[i]);
            i += 1;
            j += 1;
            continue;
        }
        let (mut del, mut ins) = (Vec::new(), Vec::new());
        while i < n || j < m {
            if i < n && j < m && a[i] == b[j] {
                break;
            }
            if j >= m || (i < n && l[i + 1][j] >= l[i][j + 1]) {
                del.push(a[i].as_str());
                i += 1;
            } else {
                ins.push(b[j].as_str());
                j += 1;
            }
        }
        // An option's value changed: show the option with both values.
        let ctx = last_common.filter(|c| c.starts_with("--") && !del.is_empty() && !ins.is_empty());
        let side = |t: &[&str]| {
            let body = if t.is_empty() { "(nothing)".to_string() } else { t.join(" ") };
            match ctx {
                Some(c) => format!("{c} {body}"),
                None => body,
            }
        };
        out.push(format!("{} -> {}", side(&del), side(&ins)));
    }
    out
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    fn tmp(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("memattn-evidence-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join(name);
        let _ = std::fs::remove_file(&p);
        p
    }

    pub fn concurrent_appends_never_interleave() {
        let path = tmp("concurrent.jsonl");
        // Lines of ~20 KiB, larger than a pipe buffer, from 6 threads with their own handles.
        let threads: Vec<_> = (0..6)
            .map(|t| {
                let path = path.clone();
                std::thread::spawn(move || {
                    for i in 0..40 {
                        let pad: String = std::iter::repeat_n(char::from(b'a' + t as u8), 20_000).collect();
                        append(&path, &serde_json::json!({"t": t, "i": i, "pad": pad})).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let (good, bad) = read(&path).unwrap();
        assert!(bad.is_empty(), "{:?}", bad.iter().map(|b| (b.line, &b.error)).collect::<Vec<_>>());
        assert_eq!(good.len(), 240);
        for t in 0..6u64 {
            let mine: Vec<u64> =
                good.iter().filter(|r| r.value["t"] == t).map(|r| r.value["i"].as_u64().unwrap()).collect();
            assert_eq!(mine, (0..40).collect::<Vec<_>>(), "thread {t}: each line whole and in order");
            let c = char::from(b'a' + t as u8);
            assert!(good.iter().filter(|r| r.value["t"] == t).all(|r| r.value["pad"]
                .as_str()
                .unwrap()
                .chars()
                .all(|x| x == c)));
        }
    }

    pub fn a_partial_last_line_does_not_glue_to_the_next_record() {
        let path = tmp("partial.jsonl");
        append(&path, &serde_json::json!({"n": 1})).unwrap();
        // An append interrupted part-way: half a record, no newline.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(br#"{"n": 2, "result": {"verif"#).unwrap();
        drop(f);
        append(&path, &serde_json::json!({"n": 3})).unwrap();
        let (good, bad) = read(&path).unwrap();
        assert_eq!(
            good.iter().map(|r| (r.line, r.value["n"].as_u64().unwrap())).collect::<Vec<_>>(),
            vec![(1, 1), (3, 3)]
        );
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].line, 2);
        assert!(bad[0].error.contains("EOF"), "{}", bad[0].error);
        assert!(bad[0].torn, "a record cut short is torn");
    }

    pub fn argv_changes_name_the_option() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let a = s(&["memattn", "run", "--seq", "256", "--heads", "2"]);
        let b = s(&["memattn", "run", "--seq", "512", "--heads", "2", "--causal"]);
        assert_eq!(argv_changes(&a, &b), vec!["--seq 256 -> --seq 512", "(nothing) -> --causal"]);
        assert!(argv_changes(&a, &a).is_empty());
    }
}
