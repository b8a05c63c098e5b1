//! Captures that travel between hosts: a snapshot made self-contained
//! ([`export`]) and installed on another host ([`import`]).
//!
//! On its own host a snapshot leans on others: its RAM may be a layer over
//! its parent's, its disk a qcow2 layer over a chain of other snapshots'
//! disks, named by absolute paths. An exported capture leans only on the
//! guest artifacts (kernel, initramfs, base rootfs), which every host
//! builds from the same recipe at the same paths:
//!
//! ```text
//! state        QEMU's device state, as in the snapshot
//! ram          the whole RAM (the parent chain merged in), sparse
//! disk.qcow2   the disk, flattened onto the base rootfs (qemu-img copies
//!              in every cluster the chain changed)
//! ```
//!
//! with a [`SnapshotMeta`] that names no parent and no disks below. A
//! capture of a sandbox whose root disk is an OCI image (an export of the
//! image daemon) has its disk flattened onto that export instead: the host
//! that installs it must have the image in its store (its index; chunks
//! come on first read), and its disk is pointed at that host's daemon.

use std::path::Path;

use crate::config::{Paths, RootDisk};
use crate::disk::{self, BackingFormat};
use crate::error::{Error, IoContext, Result};
use crate::snapshot::{Snapshot, SnapshotMeta};

/// The files of an exported capture.
pub const FILES: [&str; 3] = ["state", "ram", "disk.qcow2"];

fn refuse(path: &Path, detail: impl Into<String>) -> Error {
    Error::Snapshot {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

/// Write snapshot `id` as a self-contained capture into the empty
/// directory `out` and return its meta. The snapshot is only read.
pub async fn export(paths: &Paths, id: &str, out: &Path) -> Result<SnapshotMeta> {
    // Not while compaction rewrites the snapshot's files.
    let _one_at_a_time = crate::compact::REWRITES.lock().await;
    let snap = Snapshot::open(paths, id)?;
    std::fs::create_dir_all(out).ctx(|| format!("creating {}", out.display()))?;
    // qemu-img (as root) reads the chain the disk's header names.
    let below = snap.check_disk_chain(paths)?;
    let disk_out = out.join("disk.qcow2");
    std::fs::copy(snap.disk_path(), &disk_out)
        .ctx(|| format!("copying {}", snap.disk_path().display()))?;
    match &snap.meta.artifacts.rootfs {
        RootDisk::File(rootfs) => disk::rebase(&disk_out, rootfs, BackingFormat::Raw).await?,
        // Already right over the image's export (a template's disk).
        RootDisk::Nbd { .. } if below.len() <= 1 => {}
        nbd => disk::rebase(&disk_out, nbd.backing(), BackingFormat::Raw).await?,
    }

    let (src, dir) = (snap.clone(), out.to_path_buf());
    let crc = crate::blocking(move || {
        std::fs::copy(src.state_path(), dir.join("state"))
            .ctx(|| format!("copying {}", src.state_path().display()))?;
        let ram = dir.join("ram");
        crate::snapshot::copy_sparse(&src.ram, &ram)
            .ctx(|| format!("copying {}", src.ram.display()))?;
        if !src.layers.is_empty() {
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(&ram)
                .ctx(|| format!("opening {}", ram.display()))?;
            src.ram_chain()
                .write_into(&file)
                .ctx(|| format!("writing the RAM layers into {}", ram.display()))?;
        }
        crate::checksum::sparse_crc(&ram).ctx(|| format!("reading {}", ram.display()))
    })
    .await?;
    let mut meta = SnapshotMeta {
        parent: None,
        disk_over: Some(Vec::new()),
        ..snap.meta.clone()
    };
    meta.checksums.insert("ram".into(), crc);
    Ok(meta)
}

/// Install the capture whose files are in `from` (as [`export`] wrote
/// them) as snapshot `id`: its checksums are checked, its disk is pointed
/// at this host's base rootfs (or, for a capture on an OCI image, at the
/// export `meta` names: the caller points it at this host's image daemon
/// and has the image installed), and it exists once its `meta.json` does.
/// The files are moved out of `from`.
pub async fn import(paths: &Paths, id: &str, from: &Path, mut meta: SnapshotMeta) -> Result<()> {
    let base = match meta.artifacts.rootfs.clone() {
        RootDisk::File(rootfs) => {
            if !rootfs.exists() {
                return Err(lacks(from, "base rootfs", &rootfs));
            }
            RootDisk::File(rootfs)
        }
        // The caller installed the image and named this host's daemon.
        nbd => nbd,
    };
    for (what, p) in [
        ("kernel", &meta.artifacts.kernel),
        ("initramfs", &meta.artifacts.initramfs),
    ] {
        if !p.exists() {
            return Err(lacks(from, what, p));
        }
    }
    let dir = paths.snapshot_dir(id);
    if dir.join("meta.json").exists() {
        return Ok(());
    }
    // A file linked to the image daemon's lazy mount is read on demand,
    // each chunk checked against its digest as it comes: summing it here
    // would fetch it whole.
    let lazy =
        |f: &str| std::fs::symlink_metadata(from.join(f)).is_ok_and(|m| m.file_type().is_symlink());
    let (lazy_ram, lazy_disk) = (lazy("ram"), lazy("disk.qcow2"));
    if lazy_ram {
        meta.checksums.remove("ram");
    }
    let (src, want) = (from.to_path_buf(), meta.checksums.clone());
    crate::blocking(move || {
        let mut sums = vec![("state", crate::checksum::file_crc(&src.join("state")))];
        if !lazy_ram {
            sums.push(("ram", crate::checksum::sparse_crc(&src.join("ram"))));
        }
        for (name, sum) in sums {
            let sum = sum.ctx(|| format!("reading {}", src.join(name).display()))?;
            if want.get(name).is_some_and(|w| *w != sum) {
                return Err(refuse(
                    &src,
                    format!("its {name} does not match its checksum"),
                ));
            }
        }
        Ok(())
    })
    .await?;
    let disk = from.join("disk.qcow2");
    if lazy_disk {
        // Read-only: its header must already name this host's base (the
        // exporter's, which every host builds at the same path).
        let below = crate::jail::chain::below(&disk)
            .ctx(|| format!("reading the header of {}", disk.display()))?;
        let RootDisk::File(rootfs) = &base else {
            return Err(refuse(
                &disk,
                "the disk of a capture on an OCI image names its host's image daemon: it is fetched whole",
            ));
        };
        if below != [crate::jail::chain::Backing::File(rootfs.clone())] {
            return Err(refuse(
                &disk,
                format!(
                    "its disk is not over this host's base rootfs {}",
                    rootfs.display()
                ),
            ));
        }
    } else {
        // Only the name of the disk below changes, not its contents.
        disk::rebase_unchecked(&disk, base.backing(), BackingFormat::Raw).await?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).ctx(|| format!("creating {}", dir.display()))?;
    for f in FILES {
        std::fs::rename(from.join(f), dir.join(f))
            .ctx(|| format!("moving {} into {}", f, dir.display()))?;
    }
    meta.id = id.to_string();
    meta.parent = None;
    meta.disk_over = Some(Vec::new());
    crate::snapshot::publish(
        &dir,
        &serde_json::to_vec_pretty(&meta).expect("meta serializes"),
    )?;
    // It opens as any snapshot of this host does.
    Snapshot::open(paths, id).map(|_| ())
}

fn lacks(capture: &Path, what: &str, path: &Path) -> Error {
    refuse(
        capture,
        format!(
            "it needs the guest {what} {} that this host lacks (hosts of a cluster build the same artifacts: scripts/setup-host.sh)",
            path.display()
        ),
    )
}
