//! The VM's record, `vm.json` in its directory: written when its QEMU
//! starts and after each change, read back to adopt it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{Vm, VmFiles};
use crate::config::{Artifacts, Machine};
use crate::error::{IoContext, Result};

/// What `vm.json` in the VM's directory records, enough to adopt the VM
/// from another process (the CLI, or the server after a restart).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmRecord {
    pub id: String,
    pub pid: i32,
    pub netns: String,
    pub machine: Machine,
    pub artifacts: Artifacts,
    pub extra_cmdline: Vec<String>,
    /// RAM mapped `share=on` (booted) or MAP_PRIVATE over a snapshot's
    /// frozen RAM (restored).
    pub ram_shared: bool,
    pub ram: PathBuf,
    /// The snapshot this VM was restored from, if any (or last captured
    /// in place: its RAM layers are over this one).
    pub parent: Option<String>,
    /// In-place captures so far: which disk overlay QEMU writes to.
    #[serde(default)]
    pub disk_generation: u32,
    /// The uid (and gid) its jailed QEMU runs as; `None`: not jailed.
    #[serde(default)]
    pub uid: Option<u32>,
    /// The snapshot disks its overlay is layered over, nearest first (see
    /// [`crate::snapshot::SnapshotMeta::disk_over`]); `None`: not recorded.
    #[serde(default)]
    pub disk_over: Option<Vec<PathBuf>>,
    /// It has a virtio-balloon reporting free pages (see
    /// [`crate::snapshot::SnapshotMeta::balloon`]).
    #[serde(default)]
    pub balloon: bool,
}

impl Vm {
    pub(super) fn save_record(&self) -> Result<()> {
        save_record(&self.files(), &self.record)
    }
}

pub(super) fn save_record(files: &VmFiles, record: &VmRecord) -> Result<()> {
    write_atomic(
        &files.record(),
        &serde_json::to_vec_pretty(record).expect("record serializes"),
    )
}

/// Replace `path` with `data` durably through [`tine_durable`]: a temp
/// file, fsync, rename, fsync of the directory (≈ 0.5 ms here). A crash
/// leaves the old file or the new one, never a torn one or a rename that
/// did not reach the disk.
pub(crate) fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    tine_durable::write(path, data).ctx(|| format!("storing {}", path.display()))
}
