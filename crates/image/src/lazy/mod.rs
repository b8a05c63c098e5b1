//! Captures read lazily: a capture's big files (its RAM and its disk),
//! pulled from a registry chunk by chunk as a VM first touches them, under
//! one FUSE mount the image daemon serves.
//!
//! ```text
//! <data>/images/lazy/<capture>.json   what a capture's files are made of
//!                                     (0600: it may hold credentials)
//! <data>/images/lazy/<capture>.error  its damaged chunk, once one was read
//! /run/tine/lazy/<data-hash>/<capture>/<file>
//!                                     the files, read-only, as QEMU maps them
//! /run/tine/lazy/<data-hash>/<capture>/error
//!                                     the damaged chunk, once one was read
//! ```
//!
//! The mount is outside the data directory so that removing a data
//! directory never meets it (a mount point cannot be removed), and a mount
//! left by a daemon that was killed is detached by the next one.
//!
//! A host that restores a capture it lacks registers it ([`register`]),
//! fetches only its small device state, and points the snapshot's `ram`
//! and `disk.qcow2` at [`path_of`]. QEMU maps the RAM file MAP_PRIVATE as
//! it maps any snapshot's: a page the guest touches for the first time is
//! a FUSE read, answered from the chunk cache (the same bounded cache OCI
//! images use, so pulled captures count against `image_cache_max_bytes`),
//! which fetches the chunk from the registry and checks its digest first.
//! A chunk that cannot be fetched or does not match is an EIO: the disk
//! read fails in the guest and a RAM page faults QEMU out (SIGBUS), never
//! a guest running on wrong bytes; the error, naming the capture and the
//! chunk, is logged; a damaged chunk's is kept, and read next to the file
//! as `error` ([`read_failure`]), for whoever reports the VM's end and to
//! refuse later restores of it.
//!
//! Why FUSE and not userfaultfd: QEMU's guest RAM lives in QEMU's process,
//! and a userfaultfd must be registered by the process that owns the
//! memory; QEMU only does so for its own postcopy migration. A file QEMU
//! maps needs no change to QEMU, keeps restores the MAP_PRIVATE mapping of
//! a frozen file every local restore is, and lives in the image daemon,
//! which outlives server restarts as the QEMUs do. `fuser` is the
//! maintained pure-Rust FUSE library (no libfuse needed; as root it mounts
//! with mount(2) directly).
//!
//! The parts: what a capture registers (its descriptor) here; `fs` (the
//! FUSE filesystem: inodes, reads through the chunk cache, holes) and
//! `mount` (mounting it, and forgetting captures nothing reads).

mod fs;
mod mount;

pub use mount::{mount, Mounted};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::chunks::Index;
use crate::registry::RegistryOptions;
use crate::{io, ImageError, Result};

/// One file of a capture as a chunked artifact in a registry.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LazyFile {
    /// The artifact (`host/repo:tag`) its chunks are blobs of.
    pub reference: String,
    pub index: Index,
}

/// What [`register`] records of a capture.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Descriptor {
    pub capture: String,
    /// The snapshot made of it: once that is gone (and nothing has the
    /// files open) the daemon forgets the capture.
    pub snapshot_dir: PathBuf,
    pub files: BTreeMap<String, LazyFile>,
    pub registries: RegistryOptions,
}

/// Directory of the descriptors.
pub fn descriptors_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("images").join("lazy")
}

/// The daemon's mount point: under `/run`, named by a hash of the data
/// directory.
pub fn mount_dir(data_dir: &Path) -> PathBuf {
    let canonical = std::fs::canonicalize(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
    let hash = crate::chunks::sha256(canonical.as_os_str().as_encoded_bytes());
    let hex = hash.strip_prefix("sha256:").unwrap_or(&hash);
    Path::new("/run/tine/lazy").join(&hex[..16])
}

/// Where file `file` of capture `capture` appears once registered.
pub fn path_of(data_dir: &Path, capture: &str, file: &str) -> PathBuf {
    mount_dir(data_dir).join(capture).join(file)
}

/// A capture id or file name: what may appear as one path component.
fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Record `d` for the daemon to serve (replacing an earlier one).
pub fn register(data_dir: &Path, d: &Descriptor) -> Result<()> {
    let bad = |what: &str| ImageError::Io {
        context: format!("capture {:?}: {what} is not a valid name", d.capture),
        source: std::io::ErrorKind::InvalidInput.into(),
    };
    if !valid_name(&d.capture) {
        return Err(bad("its id"));
    }
    if let Some(f) = d.files.keys().find(|f| !valid_name(f)) {
        return Err(bad(f));
    }
    let dir = descriptors_dir(data_dir);
    std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
    let json = serde_json::to_vec(d).unwrap_or_default();
    crate::nbd::daemon::write_private(&dir.join(format!("{}.json", d.capture)), &json)?;
    let _ = std::fs::remove_file(dir.join(format!("{}.error", d.capture)));
    Ok(())
}

/// The captures registered here (read lazily now or soon).
pub fn registered(data_dir: &Path) -> Vec<String> {
    described(&descriptors_dir(data_dir))
}

/// The captures with a descriptor in `dir`.
fn described(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_str()?.strip_suffix(".json")?.to_string();
            valid_name(&n).then_some(n)
        })
        .collect()
}

/// Forget capture `capture` (files already open stay readable).
pub fn unregister(data_dir: &Path, capture: &str) {
    if valid_name(capture) {
        let dir = descriptors_dir(data_dir);
        let _ = std::fs::remove_file(dir.join(format!("{capture}.json")));
        let _ = std::fs::remove_file(dir.join(format!("{capture}.error")));
    }
}

/// Why reading lazily read file `path` failed, if it is one and a chunk
/// of it was damaged: the error names the capture, the file and the chunk
/// (served as `error` next to it).
pub fn read_failure(path: &Path) -> Option<String> {
    if !path.starts_with("/run/tine/lazy") {
        return None;
    }
    std::fs::read_to_string(path.with_file_name(ERROR_FILE)).ok()
}

/// What the daemon serves next to a capture's files once a chunk of it
/// was found damaged.
const ERROR_FILE: &str = "error";

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_single_safe_components() {
        for ok in ["abc", "snap-1.ram", "x_y"] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", ".", "..", "a/b", "a b", "é", &"x".repeat(129)] {
            assert!(!valid_name(bad), "{bad}");
        }
    }

    #[test]
    fn mounts_are_outside_data_dirs_and_one_per_data_dir() {
        let (a, b) = (
            mount_dir(Path::new("/data/a")),
            mount_dir(Path::new("/data/b")),
        );
        assert!(a.starts_with("/run/tine/lazy") && b.starts_with("/run/tine/lazy"));
        assert_ne!(a, b);
        assert_eq!(read_failure(Path::new("/data/a/snapshots/x/ram")), None);
    }
}
