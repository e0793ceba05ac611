//! Files the CLI reads and writes, handled so that no data is lost.
//!
//! - Inputs (`--inputs`, `--ptx`) must be regular files under a size limit: a FIFO would block
//!   and `/dev/zero` would be read until memory runs out.
//! - Outputs (`--output`, `--plot`) are checked before anything runs (the directory is writable,
//!   an existing file is a regular writable file, and it is not one of the inputs or the
//!   evidence file), then written atomically: a temporary file in the same directory, fsynced,
//!   renamed over the target. A failed write never leaves a truncated file where a good one was.

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
    let err = |message: String| FileError::Write { what, path: path.display().to_string(), message };
    let target = write_target(path);
    if let Ok(m) = std::fs::metadata(&target) {
        if !m.is_file() {
            return Err(err(format!("{}; only regular files are replaced", kind_of(&m))));
        }
    }
    let tmp = temp_path(&target);
    let result = (|| -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        if let Ok(m) = std::fs::metadata(&target) {
            f.set_permissions(m.permissions())?;
        }
        f.write_all(bytes)?;
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
        err(e.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("memattn-files-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn atomic_write_replaces_whole_files_and_leaves_no_temporary() {
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

    #[test]
    fn only_bounded_regular_files_are_read() {
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
