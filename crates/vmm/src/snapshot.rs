//! A snapshot on disk: everything needed to start clones of a stopped VM.
//!
//! ```text
//! <data>/snapshots/<id>/meta.json   what booted it (machine, artifacts)
//! <data>/snapshots/<id>/state       QEMU device state (migration stream)
//! <data>/snapshots/<id>/disk.qcow2  the VM's frozen disk overlay
//! <data>/snapshots/<id>/ram          a root snapshot (of a booted VM): its
//!                                   frozen RAM, sparse; clones map it
//!                                   MAP_PRIVATE and share its pages
//! <data>/snapshots/<id>/ram.layer    a layered snapshot (of a restored VM):
//!                                   the pages that differ from its parent's
//!                                   RAM (see `crate::ram`)
//! ```
//!
//! A layered snapshot names its parent in `meta.json`; its disk overlay is
//! backed by the parent's. The chain ends at a root snapshot.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::config::{Artifacts, Machine, Paths};
use crate::error::{Error, IoContext, Result};
use crate::ram::Chain;

/// 2: the RAM file moved from the shm dir into the snapshot directory.
/// 3: device state without RAM (`xen-save-devices-state`), RAM layers.
pub const META_VERSION: u32 = 3;
/// Longest parent chain [`Snapshot::open`] follows (a loop guard; chains
/// are compacted long before).
const MAX_DEPTH: usize = 64;
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
    /// The snapshot whose RAM this one's layer is over; `None` for a root
    /// snapshot, which holds its whole RAM.
    #[serde(default)]
    pub parent: Option<String>,
    /// The snapshot disks this one's disk is layered over, nearest first
    /// (the base image lies under them all), as tine created them: the
    /// qcow2 headers that name them were writable by the VM. Absolute
    /// paths, as in those headers. `None` for snapshots from before tine
    /// recorded it.
    #[serde(default)]
    pub disk_over: Option<Vec<PathBuf>>,
    /// CRC-32 of its files by name: `state` (checked at every open) and a
    /// root snapshot's `ram` (its whole content, holes as zeros; checked
    /// once per process). A RAM layer carries its own. Empty in snapshots
    /// from before tine wrote them.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub checksums: std::collections::BTreeMap<String, u32>,
    /// Its VM had a virtio-balloon (its device state holds one, so every
    /// restore needs one too). `false` in snapshots from before.
    #[serde(default)]
    pub balloon: bool,
}

/// An opened snapshot. Its RAM files (root and layers) are held open, so
/// a snapshot opened before its ancestors' files are deleted (by garbage
/// collection after a compaction) still restores.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub meta: SnapshotMeta,
    pub dir: PathBuf,
    /// The root RAM file that VMs restored from this snapshot map.
    pub ram: PathBuf,
    /// RAM layers to write over it, root-first (empty for a root snapshot).
    pub layers: Vec<PathBuf>,
    /// Snapshot ids from the root up to this one's parent.
    pub ancestors: Vec<String>,
    chain: Option<Arc<Chain>>,
}

impl Snapshot {
    pub fn state_path(&self) -> PathBuf {
        self.dir.join("state")
    }
    pub fn disk_path(&self) -> PathBuf {
        resolved(self.dir.join("disk.qcow2"))
    }
    pub fn layer_path(&self) -> PathBuf {
        self.dir.join(LAYER_FILE)
    }
    /// This snapshot's disk and those it is layered over, nearest first;
    /// `None` if that was not recorded (or not as absolute paths).
    pub fn disk_lineage(&self) -> Option<Vec<PathBuf>> {
        let below = self.meta.disk_over.as_ref()?;
        if below.iter().any(|p| !p.is_absolute()) {
            return None;
        }
        Some(
            std::iter::once(self.disk_path())
                .chain(below.iter().cloned())
                .collect(),
        )
    }
    /// Write this snapshot's RAM layers into QEMU process `pid`, which maps
    /// the root RAM file MAP_PRIVATE and has not run yet (blocking).
    /// Returns the pages written.
    pub fn write_ram_layers(&self, pid: i32) -> Result<u64> {
        if self.layers.is_empty() {
            return Ok(0);
        }
        let chain = self.ram_chain();
        let bytes = u64::from(self.meta.machine.memory_mib) << 20;
        let ram = crate::ram::GuestRam::find(pid, &self.ram, bytes)
            .ctx(|| format!("finding the guest RAM of QEMU {pid}"))?;
        chain
            .apply(&ram)
            .ctx(|| format!("writing RAM layers into QEMU {pid}"))
    }

    /// Check that the backing chain its disk's qcow2 header names is the
    /// one tine made (before qemu-img reads that chain as root).
    pub(crate) fn check_disk_chain(
        &self,
        paths: &Paths,
    ) -> Result<Vec<crate::jail::chain::Backing>> {
        let allowed = crate::jail::chain::allowed_disks(
            paths,
            self.meta.disk_over.as_deref(),
            &self.meta.artifacts.rootfs,
        );
        crate::jail::chain::below_within(&self.disk_path(), &allowed)
            .ctx(|| format!("checking the disk of snapshot {}", self.meta.id))
    }

    /// The root and layers of this snapshot's RAM, opened for reading.
    pub fn ram_chain(&self) -> Arc<Chain> {
        self.chain.clone().expect("Snapshot::open opens the chain")
    }

    /// Open snapshot `id` and check that its files are all there and look
    /// right (the whole RAM layer chain is read and checked), so a damaged
    /// snapshot fails here with a clear message rather than inside QEMU.
    pub fn open(paths: &Paths, id: &str) -> Result<Self> {
        if !paths.snapshot_dir(id).exists() {
            return Err(Error::NotFound {
                what: "snapshot",
                id: id.to_string(),
            });
        }
        let mut snap = Self::open_at_depth(paths, id, 0)?;
        let chain = Chain::open(&snap.ram, &snap.layers).map_err(|e| Error::Snapshot {
            path: snap.dir.clone(),
            detail: format!("RAM: {e}"),
        })?;
        snap.chain = Some(Arc::new(chain));
        Ok(snap)
    }

    fn open_at_depth(paths: &Paths, id: &str, depth: usize) -> Result<Self> {
        let dir = paths.snapshot_dir(id);
        let bad = |detail: String| Error::Snapshot {
            path: dir.clone(),
            detail,
        };
        let meta_bytes = std::fs::read(dir.join("meta.json"))
            .map_err(|e| bad(format!("reading meta.json: {e}")))?;
        let meta: SnapshotMeta = serde_json::from_slice(&meta_bytes)
            .map_err(|e| bad(format!("meta.json is corrupt: {e}")))?;
        if meta.version != META_VERSION {
            return Err(bad(format!(
                "meta.json version {} (this tine reads {META_VERSION})",
                meta.version
            )));
        }
        check_state_file(&dir.join("state")).map_err(bad)?;
        if let Some(&want) = meta.checksums.get("state") {
            check_crc(&dir.join("state"), want).map_err(bad)?;
        }
        std::fs::metadata(dir.join("disk.qcow2")).map_err(|e| bad(format!("disk.qcow2: {e}")))?;
        let want = u64::from(meta.machine.memory_mib) << 20;
        if let Some(parent_id) = meta.parent.clone() {
            if depth >= MAX_DEPTH {
                return Err(bad(format!("parent chain longer than {MAX_DEPTH}")));
            }
            let parent = Self::open_at_depth(paths, &parent_id, depth + 1)
                .map_err(|e| bad(format!("its parent {parent_id}: {e}")))?;
            if parent.meta.machine.memory_mib != meta.machine.memory_mib {
                return Err(bad(format!("its parent {parent_id} has another RAM size")));
            }
            let layer = dir.join(LAYER_FILE);
            check_layer_file(&layer).map_err(bad)?;
            let mut layers = parent.layers;
            layers.push(layer);
            let mut ancestors = parent.ancestors;
            ancestors.push(parent_id);
            return Ok(Self {
                ram: parent.ram,
                layers,
                ancestors,
                dir,
                meta,
                chain: None,
            });
        }
        let snap = Self {
            ram: resolved(paths.snapshot_ram(id)),
            layers: Vec::new(),
            ancestors: Vec::new(),
            dir: dir.clone(),
            meta,
            chain: None,
        };
        let ram_len = std::fs::metadata(&snap.ram)
            .map_err(|e| bad(format!("RAM file {}: {e}", snap.ram.display())))?
            .len();
        if ram_len != want {
            return Err(bad(format!("RAM file is {ram_len} bytes, expected {want}")));
        }
        if let Some(&want) = snap.meta.checksums.get("ram") {
            let check = |file: &std::fs::File| {
                let got = crate::checksum::sparse_crc_of(file)?;
                if got != want {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("CRC-32 {got:08x}, meta.json says {want:08x}"),
                    ));
                }
                Ok(())
            };
            std::fs::File::open(&snap.ram)
                .and_then(|f| crate::checksum::once(&f, || check(&f)))
                .map_err(|e| bad(format!("RAM file {} is damaged: {e}", snap.ram.display())))?;
        }
        Ok(snap)
    }

    /// Delete every file of the snapshot.
    pub fn delete(paths: &Paths, id: &str) -> Result<()> {
        let dir = paths.snapshot_dir(id);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::Io {
                context: format!("removing {}", dir.display()),
                source: e,
            }),
        }
    }
}

/// A snapshot file, or the file it links to: a capture pulled from a
/// registry has its RAM and disk read lazily by the image daemon
/// (`tine_image::lazy`) and links to them, and QEMU, its jail and the
/// disk chain checks all want the file itself.
fn resolved(p: PathBuf) -> PathBuf {
    match std::fs::read_link(&p) {
        Ok(target) if target.is_absolute() => target,
        _ => p,
    }
}

/// The RAM layer's file name in a layered snapshot's directory.
pub const LAYER_FILE: &str = "ram.layer";

/// The files of a snapshot directory besides `meta.json`.
const DATA_FILES: [&str; 4] = ["state", "disk.qcow2", LAYER_FILE, "ram"];

/// Make the snapshot in `dir` durable and then publish its `meta.json`
/// (`meta`): its data files, the new meta (under a temporary name), the
/// directory's entries and the directory's own entry in its parent are
/// flushed at once, so one journal commit can cover them all; then the
/// meta is renamed into place and the directory flushed again. A snapshot
/// exists once its `meta.json` does, so a crash at any point leaves
/// either no snapshot or one whose files are all on disk, under names
/// that are on disk too.
///
/// The meta is written over the space [`reserve_meta`] took, if it did.
pub fn publish(dir: &Path, meta: &[u8]) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let path = dir.join("meta.json");
    let tmp = dir.join(META_TMP);
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&tmp)
        .and_then(|f| {
            f.write_all_at(meta, 0)?;
            f.set_len(meta.len() as u64)
        })
        .ctx(|| format!("writing {}", tmp.display()))?;
    let mut paths: Vec<PathBuf> = DATA_FILES
        .iter()
        .map(|name| dir.join(name))
        .filter(|p| p.exists())
        .collect();
    paths.push(tmp.clone());
    paths.push(dir.to_path_buf());
    paths.extend(dir.parent().map(Path::to_path_buf));
    sync_all(&paths)?;
    std::fs::rename(&tmp, &path).ctx(|| format!("renaming {}", tmp.display()))?;
    sync_all(&[dir.to_path_buf()])
}

/// Where [`publish`] writes the meta before renaming it.
const META_TMP: &str = "meta.json.tmp";

/// Bytes [`reserve_meta`] takes: a `meta.json` is a few KiB (its longest
/// part, the disk chain, is cut short by compaction).
const META_RESERVE: i64 = 64 << 10;

/// Take the room the snapshot in `dir` will need for its `meta.json`
/// before its capture passes the point where the VM cannot go on (its
/// QEMU exits): a file system that fills up in between then fails the
/// capture before that point, not after it, when the VM's disk and RAM
/// are already in the capture.
pub fn reserve_meta(dir: &Path) -> Result<()> {
    let tmp = dir.join(META_TMP);
    let f = std::fs::File::create(&tmp).ctx(|| format!("creating {}", tmp.display()))?;
    nix::fcntl::posix_fallocate(&f, 0, META_RESERVE)
        .map_err(std::io::Error::from)
        .ctx(|| format!("reserving room for {}", tmp.display()))
}

/// Flush `paths` (files or directories) to disk, each on a thread of its
/// own, so the file system can commit them together.
pub fn sync_all(paths: &[PathBuf]) -> Result<()> {
    std::thread::scope(|s| {
        let syncs: Vec<_> = paths
            .iter()
            .map(|p| s.spawn(move || std::fs::File::open(p).and_then(|f| f.sync_all())))
            .collect();
        for (p, h) in paths.iter().zip(syncs) {
            h.join()
                .unwrap_or_else(|_| Err(std::io::Error::other("panicked")))
                .ctx(|| format!("syncing {}", p.display()))?;
        }
        Ok(())
    })
}

/// A cheap check at open time; the whole index is read and checked when
/// the chain is opened for a restore.
fn check_layer_file(path: &Path) -> std::result::Result<(), String> {
    let mut magic = [0u8; 8];
    std::fs::File::open(path)
        .and_then(|f| std::os::unix::fs::FileExt::read_exact_at(&f, &mut magic, 0))
        .map_err(|e| format!("RAM layer {}: {e}", path.display()))?;
    if &magic != crate::ram::layer::MAGIC {
        return Err(format!("RAM layer {} is damaged", path.display()));
    }
    Ok(())
}

fn check_crc(path: &Path, want: u32) -> std::result::Result<(), String> {
    let got = crate::checksum::file_crc(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if got != want {
        return Err(format!(
            "{} is damaged: CRC-32 {got:08x}, meta.json says {want:08x}",
            path.display()
        ));
    }
    Ok(())
}

fn check_state_file(path: &Path) -> std::result::Result<(), String> {
    use std::io::Read;
    let mut f =
        std::fs::File::open(path).map_err(|e| format!("device state {}: {e}", path.display()))?;
    let mut magic = [0u8; 4];
    f.read_exact(&mut magic)
        .map_err(|_| format!("device state {} is truncated", path.display()))?;
    if &magic != QEMU_STATE_MAGIC {
        return Err(format!(
            "device state {} is not a QEMU migration stream",
            path.display()
        ));
    }
    Ok(())
}

/// Copy `from` to a new file `to`, writing only its data extents (guest RAM
/// files are mostly holes), then remove `from`. Used to move a booted VM's
/// RAM from tmpfs into its snapshot on disk.
pub(crate) fn move_sparse(from: &Path, to: &Path) -> std::io::Result<u64> {
    let copied = copy_sparse(from, to)?;
    std::fs::File::open(to)?.sync_all()?;
    std::fs::remove_file(from)?;
    Ok(copied)
}

/// Copy `from` to a new file `to`, writing only its data extents (not
/// synced). Returns the bytes copied.
pub(crate) fn copy_sparse(from: &Path, to: &Path) -> std::io::Result<u64> {
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;
    let src = std::fs::File::open(from)?;
    let len = src.metadata()?.len();
    let dst = std::fs::File::create(to)?;
    dst.set_len(len)?;
    let mut copied = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    for (start, end) in crate::sparse::data_extents(&src)? {
        // In the kernel when it can; copy_file_range refuses to cross
        // filesystems (tmpfs to the data dir's): then through a buffer.
        let mut off = start;
        while off < end {
            let (mut src_off, mut dst_off) = (off as i64, off as i64);
            let want = (end - off) as usize;
            match nix::fcntl::copy_file_range(
                src.as_fd(),
                Some(&mut src_off),
                dst.as_fd(),
                Some(&mut dst_off),
                want,
            ) {
                Ok(n) if n > 0 => {
                    off += n as u64;
                    copied += n as u64;
                    continue;
                }
                _ => {}
            }
            let n = ((end - off) as usize).min(buf.len());
            src.read_exact_at(&mut buf[..n], off)?;
            dst.write_all_at(&buf[..n], off)?;
            off += n as u64;
            copied += n as u64;
        }
    }
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{FileExt, MetadataExt};

    /// The meta appears under its name only after the data files are
    /// flushed, and no temporary file is left; a directory that cannot
    /// take the meta publishes nothing.
    #[test]
    fn publish_writes_the_meta_last_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("state"), b"state").unwrap();
        std::fs::write(dir.path().join(super::LAYER_FILE), b"layer").unwrap();
        super::publish(dir.path(), b"{\"v\":1}").unwrap();
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["meta.json", "ram.layer", "state"]);
        assert_eq!(
            std::fs::read(dir.path().join("meta.json")).unwrap(),
            b"{\"v\":1}"
        );
        let gone = dir.path().join("gone");
        assert!(super::publish(&gone, b"{}").is_err());
        assert!(!gone.join("meta.json").exists());
        let err = super::sync_all(&[dir.path().to_path_buf(), gone.clone()]).unwrap_err();
        assert!(
            err.to_string().contains("gone"),
            "names what it could not sync: {err}"
        );
    }

    /// On a file system that fills up after the reservation, the meta
    /// still fits; without one, it does not (so this test can fail).
    #[test]
    fn a_reserved_meta_is_published_on_a_full_file_system() {
        let mnt = tempfile::tempdir().unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
            .arg(mnt.path())
            .status()
            .unwrap();
        assert!(mounted.success(), "mounting a 1 MiB tmpfs (as root)");
        struct Unmount<'a>(&'a std::path::Path);
        impl Drop for Unmount<'_> {
            fn drop(&mut self) {
                let _ = std::process::Command::new("umount").arg(self.0).status();
            }
        }
        let _unmount = Unmount(mnt.path());
        let (reserved, bare) = (mnt.path().join("reserved"), mnt.path().join("bare"));
        std::fs::create_dir(&reserved).unwrap();
        std::fs::create_dir(&bare).unwrap();
        super::reserve_meta(&reserved).unwrap();
        // Fill it: a page at a time until there is no room left.
        let mut fill = std::fs::File::create(mnt.path().join("fill")).unwrap();
        let page = [1u8; 4096];
        while std::io::Write::write_all(&mut fill, &page).is_ok() {}
        drop(fill);
        let meta = vec![b' '; 6000];
        assert!(super::publish(&bare, &meta).is_err(), "the disk is full");
        super::publish(&reserved, &meta).expect("published into the reserved room");
        assert_eq!(std::fs::read(reserved.join("meta.json")).unwrap(), meta);
        assert!(!reserved.join(super::META_TMP).exists());
    }

    #[test]
    fn move_sparse_copies_data_and_keeps_holes() {
        let shm = tempfile::tempdir_in("/dev/shm").unwrap();
        let disk = tempfile::tempdir().unwrap();
        let from = shm.path().join("ram");
        let to = disk.path().join("ram");
        let f = std::fs::File::create(&from).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(b"start", 0).unwrap();
        f.write_all_at(&vec![7u8; 3 << 20], 40 << 20).unwrap();
        drop(f);
        let copied = super::move_sparse(&from, &to).unwrap();
        assert!(!from.exists(), "the source is removed");
        assert!(
            ((3 << 20) + 5..8 << 20).contains(&copied),
            "only data extents are copied: {copied}"
        );
        let g = std::fs::File::open(&to).unwrap();
        assert_eq!(g.metadata().unwrap().len(), 64 << 20);
        assert!(
            g.metadata().unwrap().blocks() * 512 < 16 << 20,
            "holes stay holes"
        );
        let mut buf = [0u8; 5];
        g.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(&buf, b"start");
        g.read_exact_at(&mut buf, (40 << 20) + 100).unwrap();
        assert_eq!(buf, [7u8; 5]);
        g.read_exact_at(&mut buf, 20 << 20).unwrap();
        assert_eq!(buf, [0u8; 5]);
    }
}

#[cfg(test)]
mod checksum_tests {
    use std::os::unix::fs::FileExt;

    use super::*;
    use crate::config::{Artifacts, RootDisk};

    /// A root snapshot's files by hand, with the checksums a capture writes.
    fn make(paths: &Paths, id: &str) {
        let dir = paths.snapshot_dir(id);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("state"), b"QEVM and some device state").unwrap();
        std::fs::write(dir.join("disk.qcow2"), b"").unwrap();
        let machine = Machine {
            memory_mib: 16,
            ..Machine::default()
        };
        let ram = std::fs::File::create(dir.join("ram")).unwrap();
        ram.set_len(16 << 20).unwrap();
        ram.write_all_at(&[9u8; 8192], 5 << 20).unwrap();
        let meta = SnapshotMeta {
            version: META_VERSION,
            id: id.into(),
            source_vm: "vm".into(),
            machine,
            artifacts: Artifacts {
                kernel: "/k".into(),
                initramfs: "/i".into(),
                rootfs: RootDisk::File("/r".into()),
            },
            extra_cmdline: vec![],
            created_unix_ms: 0,
            parent: None,
            disk_over: Some(vec![]),
            checksums: [
                (
                    "state".to_string(),
                    crate::checksum::file_crc(&dir.join("state")).unwrap(),
                ),
                (
                    "ram".to_string(),
                    crate::checksum::sparse_crc(&dir.join("ram")).unwrap(),
                ),
            ]
            .into(),
            balloon: false,
        };
        std::fs::write(dir.join("meta.json"), serde_json::to_vec(&meta).unwrap()).unwrap();
    }

    #[test]
    fn damaged_state_or_ram_files_are_refused_by_name() {
        let tmp = tempfile::tempdir().unwrap();
        let paths = Paths {
            data_dir: tmp.path().into(),
            shm_dir: tmp.path().join("shm"),
            jail: Default::default(),
            track_writes: true,
            balloon: true,
            guest_tsc: true,
        };
        make(&paths, "whole");
        Snapshot::open(&paths, "whole").unwrap();

        make(&paths, "bad-ram");
        let ram = paths.snapshot_ram("bad-ram");
        let f = std::fs::OpenOptions::new().write(true).open(&ram).unwrap();
        f.write_all_at(b"x", (5 << 20) + 17).unwrap();
        let err = Snapshot::open(&paths, "bad-ram").unwrap_err().to_string();
        assert!(
            err.contains("is damaged") && err.contains(&ram.display().to_string()),
            "{err}"
        );

        make(&paths, "bad-state");
        let state = paths.snapshot_dir("bad-state").join("state");
        std::fs::write(&state, b"QEVM and some device stat!").unwrap();
        let err = Snapshot::open(&paths, "bad-state").unwrap_err().to_string();
        assert!(
            err.contains("is damaged") && err.contains(&state.display().to_string()),
            "{err}"
        );
    }
}
