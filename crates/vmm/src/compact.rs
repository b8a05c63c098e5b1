//! Compaction: folding a snapshot's chain into one layer over its root;
//! and materializing: giving a snapshot its whole RAM as a file.
//!
//! Each capture of a restored VM adds a RAM layer and a disk layer over its
//! parent, so a sandbox paused and resumed many times restores through a
//! long chain. Compaction rewrites one snapshot in place: its RAM layer
//! becomes the merge of the whole chain and its disk overlay is rebased
//! onto the root's disk (qemu-img copies in the clusters the chain
//! changed), then its `meta.json` names the root as parent.
//!
//! The snapshot's contents do not change, only how they are stored, so
//! this is safe next to users of it: each file is replaced by a rename, a
//! reader sees the old or the new file, and either, with either `meta.json`,
//! yields the same RAM and disk. VMs already running on the old files keep
//! them open. The intermediate snapshots are then no longer needed by this
//! one; deleting them is the caller's garbage collection.

use std::time::Instant;

use crate::config::Paths;
use crate::disk::{self, BackingFormat};
use crate::error::{Error, IoContext, Result};
use crate::snapshot::{Snapshot, SnapshotMeta};

/// Compaction and materializing both rewrite a snapshot's files and
/// `meta.json`; they run one at a time so their renames never interleave.
pub(crate) static REWRITES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Compact snapshot `id` if it has more than one RAM layer. Returns the
/// root it now sits directly on, or `None` if there was nothing to do.
pub async fn compact(paths: &Paths, id: &str) -> Result<Option<String>> {
    let _one_at_a_time = REWRITES.lock().await;
    let snap = Snapshot::open(paths, id)?;
    if snap.layers.len() <= 1 {
        return Ok(None);
    }
    let t = Instant::now();
    let root_id = snap.ancestors[0].clone();
    let root = Snapshot::open(paths, &root_id)?;
    let layer_tmp = snap.dir.join("ram.layer.compact");
    let disk_tmp = snap.dir.join("disk.compact.qcow2");
    let result = async {
        let chain_snap = snap.clone();
        let out = layer_tmp.clone();
        let (pages, _) = crate::blocking(move || {
            chain_snap
                .ram_chain()
                .write_merged(&out)
                .ctx(|| format!("writing {}", out.display()))
        })
        .await?;
        // qemu-img (as root) reads the chain the disk's header names.
        snap.check_disk_chain(paths)?;
        std::fs::copy(snap.disk_path(), &disk_tmp)
            .ctx(|| format!("copying {}", snap.disk_path().display()))?;
        disk::rebase(&disk_tmp, &root.disk_path(), BackingFormat::Qcow2).await?;
        // On disk before they replace the old files (and before garbage
        // collection may delete the chain those replaced).
        for f in [&layer_tmp, &disk_tmp] {
            std::fs::File::open(f)
                .and_then(|f| f.sync_all())
                .ctx(|| format!("syncing {}", f.display()))?;
        }

        std::fs::rename(&layer_tmp, snap.layer_path()).ctx(|| "replacing the RAM layer".into())?;
        crate::failpoint::hit("compact.after_layer");
        std::fs::rename(&disk_tmp, snap.disk_path()).ctx(|| "replacing the disk".into())?;
        let meta = SnapshotMeta {
            parent: Some(root_id.clone()),
            disk_over: root.disk_lineage(),
            ..snap.meta.clone()
        };
        crate::vm::write_atomic(
            &snap.dir.join("meta.json"),
            &serde_json::to_vec_pretty(&meta).expect("meta serializes"),
        )?;
        Ok::<_, Error>(pages)
    }
    .await;
    let _ = std::fs::remove_file(&layer_tmp);
    let _ = std::fs::remove_file(&disk_tmp);
    let pages = result?;
    tracing::info!(
        snapshot = id,
        layers = snap.layers.len(),
        pages,
        ms = t.elapsed().as_secs_f64() * 1e3,
        "chain compacted onto {root_id}"
    );
    Ok(Some(root_id))
}

/// Turn layered snapshot `id` into one with its whole RAM in a file of its
/// own (`ram`: the root's data plus the chain's pages), so that the VMs
/// restored from it map that file and share all of its pages, rather than
/// each getting private copies of the layer pages. A fork does this before
/// it starts its children. Its disk stays layered on its parent's. Returns
/// whether there was anything to do.
pub async fn materialize(paths: &Paths, id: &str) -> Result<bool> {
    let _one_at_a_time = REWRITES.lock().await;
    let snap = Snapshot::open(paths, id)?;
    if snap.layers.is_empty() {
        return Ok(false);
    }
    let t = Instant::now();
    let tmp = snap.dir.join("ram.partial");
    let (src, out) = (snap.clone(), tmp.clone());
    let written = crate::blocking(move || {
        let copied = crate::snapshot::copy_sparse(&src.ram, &out)
            .ctx(|| format!("copying {} to {}", src.ram.display(), out.display()))?;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&out)
            .ctx(|| format!("opening {}", out.display()))?;
        let pages = src
            .ram_chain()
            .write_into(&file)
            .ctx(|| format!("writing the RAM layers into {}", out.display()))?;
        file.sync_all()
            .ctx(|| format!("syncing {}", out.display()))?;
        let crc = crate::checksum::sparse_crc(&out).ctx(|| format!("reading {}", out.display()))?;
        Ok((copied, pages, crc))
    })
    .await;
    let (copied, pages, crc) = match written {
        Ok(w) => w,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    // The file first, then meta.json; a reader in between still finds the
    // layer and its parents, which give the same RAM.
    std::fs::rename(&tmp, snap.dir.join("ram")).ctx(|| "installing the RAM file".into())?;
    let mut meta = SnapshotMeta {
        parent: None,
        ..snap.meta.clone()
    };
    meta.checksums.insert("ram".into(), crc);
    crate::vm::write_atomic(
        &snap.dir.join("meta.json"),
        &serde_json::to_vec_pretty(&meta).expect("meta serializes"),
    )?;
    let _ = std::fs::remove_file(snap.layer_path());
    tracing::info!(
        snapshot = id,
        mib = copied >> 20,
        pages,
        ms = t.elapsed().as_secs_f64() * 1e3,
        "RAM materialized into its own file"
    );
    Ok(true)
}
