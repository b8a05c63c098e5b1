//! Replacing a file so that a crash leaves either the old content or the
//! new, never a mix: the bytes go to a temporary file in the same
//! directory, which is then renamed over the target.
//!
//! [`write`] is for state that must survive a crash (snapshot metadata, VM
//! records, image metadata, chunks stored only here): the file is synced
//! before the rename and the directory after it, so once it returns the
//! new content is on disk under its name. [`write_unsynced`] skips both
//! syncs and is only for files whose content is checked when read and
//! can be had again (chunks in the image cache, verified against their
//! digest and fetched again when damaged; statistics rewritten every few
//! seconds): after a power cut such a file may be empty or missing.
//!
//! Both the VM driver (`tine-vmm`) and the image store (`tine-image`) use
//! this crate, so there is one writer with one set of rules.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Write `data` to `path` atomically and durably.
pub fn write(path: &Path, data: &[u8]) -> std::io::Result<()> {
    replace(path, data, true)
}

/// Write `data` to `path` atomically, without waiting for the disk: only
/// for content that is verified when read and can be had again.
pub fn write_unsynced(path: &Path, data: &[u8]) -> std::io::Result<()> {
    replace(path, data, false)
}

fn replace(path: &Path, data: &[u8], sync: bool) -> std::io::Result<()> {
    let tmp = temp_name(path);
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(data)?;
        if sync {
            f.sync_all()?;
        }
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(std::io::Error::new(
            e.kind(),
            format!("writing {}: {e}", path.display()),
        ));
    }
    if sync {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| {
                std::io::Error::new(e.kind(), format!("syncing {}: {e}", dir.display()))
            })?;
    }
    Ok(())
}

/// A name beside `path` that no other writer (thread or process) uses at
/// the same time.
fn temp_name(path: &Path) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}-{n}", std::process::id()));
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_whole_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.json");
        write(&p, b"one").unwrap();
        write(&p, b"two, longer").unwrap();
        write_unsynced(&p, b"3").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"3");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["state.json"]);
    }

    #[test]
    fn a_failed_write_names_the_file_and_keeps_the_old_content() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("kept");
        write(&p, b"old").unwrap();
        // A directory in the way of the rename.
        let blocked = dir.path().join("blocked");
        std::fs::create_dir(&blocked).unwrap();
        std::fs::write(blocked.join("inside"), b"x").unwrap();
        let e = write(&blocked, b"new").unwrap_err();
        assert!(e.to_string().contains("blocked"), "{e}");
        assert_eq!(std::fs::read(&p).unwrap(), b"old");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
        let missing = dir.path().join("no-such-dir").join("f");
        assert!(write(&missing, b"x").is_err());
    }

    #[test]
    fn temporary_names_differ() {
        let p = Path::new("/x/y.json");
        let (a, b) = (temp_name(p), temp_name(p));
        assert_ne!(a, b);
        assert_eq!(a.parent(), p.parent());
        assert!(a
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("y.json.tmp-"));
    }
}
