//! A snapshot on disk: everything needed to start clones of a stopped VM.
//!
//! ```text
//! <data>/snapshots/<id>/meta.json   what booted it (machine, artifacts)
//! <data>/snapshots/<id>/state       QEMU device state (migration stream)
//! <data>/snapshots/<id>/disk.qcow2  the VM's frozen disk overlay
//! <shm>/snapshots/<id>/ram          the VM's frozen RAM (clones map it
//!                                   MAP_PRIVATE, so they share its pages)
//! ```

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::{Artifacts, Machine, Paths};
use crate::error::{Error, Result};

pub const META_VERSION: u32 = 1;
/// First bytes of a QEMU migration stream ("QEVM").
const QEMU_STATE_MAGIC: &[u8; 4] = b"QEVM";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotMeta {
    pub version: u32,
    pub id: String,
    /// The VM it was taken from.
    pub source_vm: String,
    pub machine: Machine,
    pub artifacts: Artifacts,
    pub extra_cmdline: Vec<String>,
    pub created_unix_ms: u128,
}

#[derive(Debug, Clone)]
pub struct Snapshot {
    pub meta: SnapshotMeta,
    pub dir: PathBuf,
    pub ram: PathBuf,
}

impl Snapshot {
    pub fn state_path(&self) -> PathBuf {
        self.dir.join("state")
    }
    pub fn disk_path(&self) -> PathBuf {
        self.dir.join("disk.qcow2")
    }

    /// Open snapshot `id` and check that its files are all there and look
    /// right, so a damaged snapshot fails here with a clear message rather
    /// than inside QEMU.
    pub fn open(paths: &Paths, id: &str) -> Result<Self> {
        let dir = paths.snapshot_dir(id);
        let bad = |detail: String| Error::Snapshot { path: dir.clone(), detail };
        let meta_bytes = std::fs::read(dir.join("meta.json"))
            .map_err(|e| bad(format!("reading meta.json: {e}")))?;
        let meta: SnapshotMeta =
            serde_json::from_slice(&meta_bytes).map_err(|e| bad(format!("meta.json is corrupt: {e}")))?;
        if meta.version != META_VERSION {
            return Err(bad(format!("meta.json version {} (this tine reads {META_VERSION})", meta.version)));
        }
        let snap = Self { ram: paths.snapshot_ram(id), dir: dir.clone(), meta };
        check_state_file(&snap.state_path()).map_err(bad)?;
        let ram_len = std::fs::metadata(&snap.ram).map_err(|e| bad(format!("RAM file {}: {e}", snap.ram.display())))?.len();
        let want = u64::from(snap.meta.machine.memory_mib) << 20;
        if ram_len != want {
            return Err(bad(format!("RAM file is {ram_len} bytes, expected {want}")));
        }
        std::fs::metadata(snap.disk_path()).map_err(|e| bad(format!("disk.qcow2: {e}")))?;
        Ok(snap)
    }

    /// Delete every file of the snapshot.
    pub fn delete(paths: &Paths, id: &str) -> Result<()> {
        for dir in [paths.snapshot_dir(id), paths.snapshot_ram(id).parent().unwrap().to_path_buf()] {
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::Io { context: format!("removing {}", dir.display()), source: e }),
            }
        }
        Ok(())
    }
}

fn check_state_file(path: &Path) -> std::result::Result<(), String> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| format!("device state {}: {e}", path.display()))?;
    let mut magic = [0u8; 4];
    f.read_exact(&mut magic)
        .map_err(|_| format!("device state {} is truncated", path.display()))?;
    if &magic != QEMU_STATE_MAGIC {
        return Err(format!("device state {} is not a QEMU migration stream", path.display()));
    }
    Ok(())
}
