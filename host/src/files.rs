//! Files the CLI reads and writes, handled so that no data is lost.
//!
//! - Inputs (`--inputs`, `--ptx`) must be regular files under a size limit: a FIFO would block
//!   and `/dev/zero` would be read until memory runs out.
//! - Outputs (`--output`, `--plot`) are checked before anything runs (the directory is writable,
//!   an existing file is a regular writable file, and it is not one of the inputs or the
//!   evidence file), then written atomically: a temporary file in the same directory, fsynced,
//!   renamed over the target. A failed write never leaves a truncated file where a good one was.
//! - A write the file-size limit (`ulimit -f`), a full disk or a quota cuts short is a resource
//!   error naming the file and the limit ([`FileError::Resource`], exit 3); `main` ignores
//!   SIGXFSZ so such a write fails with EFBIG instead of killing the process.
//! - SIGINT, SIGTERM and SIGHUP during a write remove its temporary file before the process ends
//!   by the signal ([`install_signal_cleanup`], [`RemoveOnSignal`]).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// Largest `--ptx` file read (the embedded module is a few MiB).
pub const MAX_PTX_BYTES: u64 = 256 << 20;
/// Largest `--inputs` file read.
pub const MAX_INPUT_BYTES: u64 = 64 << 30;

/// Why a file cannot be read or written.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FileError {
    #[error("cannot read {what} {path}: {message}")]
    Read { what: &'static str, path: String, message: String },
    #[error("cannot write {what} {path}: {message}")]
    Write { what: &'static str, path: String, message: String },
    #[error("{what} {path} is the same file as {other} {other_path}: refusing to overwrite it")]
    SameFile { what: &'static str, path: String, other: &'static str, other_path: String },
    #[error("host memory: cannot allocate {bytes} bytes ({human}) for {what}")]
    HostMemory { what: String, bytes: u64, human: String },
    /// The write ran into a host resource limit: the file-size limit, a full disk, a quota.
    #[error("cannot write {what} {path}: {message}")]
    Resource { what: &'static str, path: String, message: String },
}

/// What a failed write of `bytes` bytes means: a host resource limit (EFBIG under `ulimit -f`,
/// ENOSPC, EDQUOT) named with its figures, or `None` for any other error.
pub fn resource_limit(e: &std::io::Error, bytes: u64) -> Option<String> {
    match e.raw_os_error()? {
        libc::EFBIG => Some(match file_size_limit() {
            Some(limit) => format!(
                "the file-size limit (ulimit -f) is {limit} bytes ({}), the file needs {bytes} bytes ({})",
                crate::units::human_bytes(limit),
                crate::units::human_bytes(bytes)
            ),
            None => format!("the file is too large for the file system ({bytes} bytes)"),
        }),
        libc::ENOSPC => {
            Some(format!("no space left on the device ({bytes} bytes ({}) to write)", crate::units::human_bytes(bytes)))
        }
        libc::EDQUOT => {
            Some(format!("the disk quota is exhausted ({bytes} bytes ({}) to write)", crate::units::human_bytes(bytes)))
        }
        _ => None,
    }
}

/// The soft file-size limit of this process (`RLIMIT_FSIZE`) in bytes; `None` when unlimited.
pub fn file_size_limit() -> Option<u64> {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_FSIZE, &mut r) } != 0 || r.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    Some(r.rlim_cur)
}

/// Slots for the temporary files being written, read by the signal handler. A slot holds a
/// NUL-terminated path that is never freed (a handler running on another thread may still read
/// it after the slot is cleared); a process writes a handful of files, so this is a few hundred
/// bytes at most.
const SLOTS: usize = 16;
static PENDING: [std::sync::atomic::AtomicPtr<libc::c_char>; SLOTS] =
    [const { std::sync::atomic::AtomicPtr::new(std::ptr::null_mut()) }; SLOTS];

/// Registers a temporary file for removal if SIGINT, SIGTERM or SIGHUP ends the process before
/// the guard is dropped (see [`install_signal_cleanup`]). Register before creating the file.
pub struct RemoveOnSignal {
    slot: Option<usize>,
}

impl RemoveOnSignal {
    pub fn new(path: &Path) -> Self {
        use std::os::unix::ffi::OsStrExt;
        use std::sync::atomic::Ordering;
        let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else { return RemoveOnSignal { slot: None } };
        let raw = c.into_raw();
        for (i, s) in PENDING.iter().enumerate() {
            if s.compare_exchange(std::ptr::null_mut(), raw, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
                return RemoveOnSignal { slot: Some(i) };
            }
        }
        // All slots taken (more than 16 writes at once): the file is not cleaned up on a signal.
        // SAFETY: `raw` came from `into_raw` above and was never shared.
        drop(unsafe { std::ffi::CString::from_raw(raw) });
        RemoveOnSignal { slot: None }
    }
}

impl Drop for RemoveOnSignal {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            // The path itself stays allocated (see `PENDING`).
            PENDING[i].store(std::ptr::null_mut(), std::sync::atomic::Ordering::SeqCst);
        }
    }
}

/// Removes every registered temporary file. Async-signal-safe: atomic loads and unlink(2) only.
fn remove_pending() {
    for s in &PENDING {
        let p = s.load(std::sync::atomic::Ordering::SeqCst);
        if !p.is_null() {
            // SAFETY: `p` is a NUL-terminated path that is never freed (see `PENDING`).
            unsafe { libc::unlink(p) };
        }
    }
}

extern "C" fn remove_pending_and_reraise(sig: libc::c_int) {
    remove_pending();
    // SAFETY: signal(2) and raise(2) are async-signal-safe; the default action then ends the
    // process by `sig`, so the parent sees the signal as it would without the handler.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

/// Installs the handler that removes registered temporary files on SIGINT, SIGTERM and SIGHUP
/// and then ends the process by the same signal. Signals that are ignored (a command started
/// with `nohup`, or in the background by a shell without job control) stay ignored.
pub fn install_signal_cleanup() {
    let handler = remove_pending_and_reraise as extern "C" fn(libc::c_int) as libc::sighandler_t;
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler is async-signal-safe (see `remove_pending_and_reraise`).
        unsafe {
            if libc::signal(sig, handler) == libc::SIG_IGN {
                libc::signal(sig, libc::SIG_IGN);
            }
        }
    }
}

fn kind_of(m: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = m.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// A `Vec<u8>` of capacity `n`, or the error naming the bytes.
pub fn try_bytes(n: u64, what: &str) -> Result<Vec<u8>, FileError> {
    let mut v = Vec::new();
    usize::try_from(n).ok().and_then(|n| v.try_reserve_exact(n).ok()).ok_or_else(|| FileError::HostMemory {
        what: what.to_string(),
        bytes: n,
        human: crate::units::human_bytes(n),
    })?;
    Ok(v)
}

/// Reads a regular file of at most `limit` bytes. Refuses FIFOs, devices and directories before
/// opening them (opening a FIFO for reading blocks until a writer appears).
pub fn read_regular(path: &Path, limit: u64, what: &'static str) -> Result<Vec<u8>, FileError> {
    let err = |message: String| FileError::Read { what, path: path.display().to_string(), message };
    let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
    if !meta.is_file() {
        return Err(err(format!("{}; only regular files are read", kind_of(&meta))));
    }
    if meta.len() > limit {
        return Err(err(format!(
            "{} bytes, over the limit of {} bytes ({})",
            meta.len(),
            limit,
            crate::units::human_bytes(limit)
        )));
    }
    let f = std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
    let mut buf = try_bytes(meta.len(), &format!("reading {what} {}", path.display()))?;
    // `take` bounds the read even if the file grows while it is read.
    f.take(limit + 1).read_to_end(&mut buf).map_err(|e| err(e.to_string()))?;
    if buf.len() as u64 > limit {
        return Err(err(format!("grew past the limit of {limit} bytes while being read")));
    }
    Ok(buf)
}

/// The path a write replaces: an existing symlink is followed, so the link is kept and its target
/// is replaced.
fn write_target(path: &Path) -> PathBuf {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()),
        _ => path.to_path_buf(),
    }
}

fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn temp_path(target: &Path) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
    let n = N.fetch_add(1, Ordering::Relaxed);
    parent_dir(target).join(format!(".{name}.memattn-tmp-{}-{n}", std::process::id()))
}

/// Checks, before a run, that `path` can be written: its directory exists and accepts a new file,
/// and an existing file there is a regular, writable file.
pub fn check_writable(path: &Path, what: &'static str) -> Result<(), FileError> {
    let err = |message: String| FileError::Write { what, path: path.display().to_string(), message };
    let target = write_target(path);
    if target.file_name().is_none() {
        return Err(err("the path names no file".into()));
    }
    match std::fs::metadata(&target) {
        Ok(m) if !m.is_file() => return Err(err(format!("{}; only regular files are replaced", kind_of(&m)))),
        Ok(m) if m.permissions().readonly() => return Err(err("the file is read-only".into())),
        _ => {}
    }
    let dir = parent_dir(&target);
    match std::fs::metadata(&dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(err(format!("{} is not a directory", dir.display()))),
        Err(e) => return Err(err(format!("directory {}: {e}", dir.display()))),
    }
    let probe = temp_path(&target);
    let _guard = RemoveOnSignal::new(&probe);
    match std::fs::OpenOptions::new().write(true).create_new(true).open(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(err(format!("cannot create a file in {}: {e}", dir.display()))),
    }
}

/// True when both paths exist and are the same file (same device and inode, links followed).
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// Refuses an output that is the same file as one of `others` (`(role, path)`).
pub fn check_distinct(
    what: &'static str,
    path: &Path,
    others: &[(&'static str, Option<&Path>)],
) -> Result<(), FileError> {
    for (other, o) in others {
        if let Some(o) = o {
            if same_file(path, o) {
                return Err(FileError::SameFile {
                    what,
                    path: path.display().to_string(),
                    other,
                    other_path: o.display().to_string(),
                });
            }
        }
    }
    Ok(())
}

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, written, fsynced,
/// then renamed over `path` (an existing file keeps its permissions). On any error the temporary
/// file is removed and `path` is untouched.
pub fn write_atomic(path: &Path, bytes: &[u8], what: &'static str) -> Result<(), FileError> {
    write_atomic_with(path, bytes.len() as u64, what, |f| f.write_all(bytes))
}

/// [`write_atomic`] with the contents written by `write` (`bytes`: how many it writes, for the
/// message when a resource limit cuts it short).
pub fn write_atomic_with(
    path: &Path,
    bytes: u64,
    what: &'static str,
    write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> Result<(), FileError> {
    let err = |message: String| FileError::Write { what, path: path.display().to_string(), message };
    let target = write_target(path);
    if let Ok(m) = std::fs::metadata(&target) {
        if !m.is_file() {
            return Err(err(format!("{}; only regular files are replaced", kind_of(&m))));
        }
    }
    let tmp = temp_path(&target);
    // Registered before the file exists: a signal at any point of the write removes it.
    let _guard = RemoveOnSignal::new(&tmp);
    let result = (|| -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        if let Ok(m) = std::fs::metadata(&target) {
            f.set_permissions(m.permissions())?;
        }
        write(&mut f)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, &target)?;
        // Make the rename itself durable (best effort: not every file system syncs directories).
        if let Ok(d) = std::fs::File::open(parent_dir(&target)) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    result.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        match resource_limit(&e, bytes) {
            Some(message) => FileError::Resource { what, path: path.display().to_string(), message },
            None => err(e.to_string()),
        }
    })
}

#[cfg(feature = "unit-tests")]
#[allow(rustdoc::private_intra_doc_links)]
#[doc(hidden)]
pub mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("memattn-files-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    pub fn atomic_write_replaces_whole_files_and_leaves_no_temporary() {
        let d = dir("atomic");
        let p = d.join("o.bin");
        std::fs::write(&p, b"old contents").unwrap();
        write_atomic(&p, b"new", "output").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1, "a temporary file was left behind");
        // Through a symlink: the target is replaced, the link kept.
        let link = d.join("link.bin");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        write_atomic(&link, b"via link", "output").unwrap();
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read(&p).unwrap(), b"via link");
        // A directory in the way: refused, nothing written.
        let sub = d.join("sub");
        std::fs::create_dir(&sub).unwrap();
        let e = write_atomic(&sub, b"x", "output").unwrap_err().to_string();
        assert!(e.contains("a directory"), "{e}");
        assert!(check_writable(&sub, "output").is_err());
        // A missing directory fails the pre-check.
        let e = check_writable(&d.join("none/o.bin"), "output").unwrap_err().to_string();
        assert!(e.contains("none"), "{e}");
        assert!(check_writable(&d.join("fresh.bin"), "output").is_ok());
        assert!(!d.join("fresh.bin").exists(), "the pre-check leaves no file");
    }

    /// The child half of the test below: writes half a file, then receives SIGTERM.
    fn signalled_writer(dir: &Path) -> ! {
        install_signal_cleanup();
        let _ = write_atomic_with(&dir.join("o.bin"), 8, "output", |f| {
            f.write_all(b"half")?;
            // SAFETY: raise(2) delivers SIGTERM to this thread; its handler ends the process.
            unsafe { libc::raise(libc::SIGTERM) };
            f.write_all(b"rest")
        });
        std::process::exit(0)
    }

    pub fn a_signal_during_an_atomic_write_removes_the_temporary_file() {
        if let Some(d) = std::env::var_os("MEMATTN_FILES_SIGNAL_CHILD") {
            signalled_writer(Path::new(&d));
        }
        use std::os::unix::process::ExitStatusExt;
        let d = dir("signal");
        std::fs::write(d.join("o.bin"), b"old contents").unwrap();
        // This test again, in a child process of the same test executable (the harness runs each
        // test on a thread named after it, whichever runner lists it).
        let me = std::thread::current().name().expect("run by the test harness").to_string();
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", &me])
            .args(["--test-threads", "1", "--nocapture"])
            .env("MEMATTN_FILES_SIGNAL_CHILD", &d)
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap();
        assert_eq!(status.signal(), Some(libc::SIGTERM), "the writer was not ended by SIGTERM: {status:?}");
        assert_eq!(std::fs::read(d.join("o.bin")).unwrap(), b"old contents");
        let names: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["o.bin"], "a temporary file was left behind");
    }

    pub fn only_bounded_regular_files_are_read() {
        let d = dir("read");
        let p = d.join("a.txt");
        std::fs::write(&p, b"0123456789").unwrap();
        assert_eq!(read_regular(&p, 10, "PTX file").unwrap(), b"0123456789");
        let e = read_regular(&p, 9, "PTX file").unwrap_err().to_string();
        assert!(e.contains("over the limit of 9 bytes"), "{e}");
        let e = read_regular(Path::new("/dev/zero"), 10, "PTX file").unwrap_err().to_string();
        assert!(e.contains("character device"), "{e}");
        let e = read_regular(&d, 10, "PTX file").unwrap_err().to_string();
        assert!(e.contains("a directory"), "{e}");
        assert!(same_file(&p, &d.join(".").join("a.txt")));
        assert!(!same_file(&p, &d.join("b.txt")));
    }
}
