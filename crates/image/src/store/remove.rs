//! Removing images: `rm` of one reference and `prune`, keeping what a
//! snapshot still runs on, then the blobs and chunks no image lists.

use std::collections::BTreeMap;
use std::path::Path;

use super::{hex, ImageStore};
use crate::chunks;
use crate::reference::ImageRef;
use crate::{io, ImageError, Result};

impl ImageStore {
    /// Forget `reference`; the image's files go when no other reference
    /// names it, unless a snapshot in `snapshots_dir` (a `meta.json` that
    /// name its root disk) still runs on it.
    pub fn remove(&self, reference: &str, snapshots_dir: &Path) -> Result<()> {
        let meta = self.get(reference)?;
        let mut refs = self.refs();
        let digest = meta.manifest_digest.clone();
        let named: Vec<String> = refs
            .iter()
            .filter(|(_, d)| **d == digest)
            .map(|(r, _)| r.clone())
            .collect();
        let key = ImageRef::parse(reference)
            .map(|r| r.canonical())
            .ok()
            .filter(|k| refs.contains_key(k));
        let last = named.len() <= 1 || key.is_none();
        if last {
            let users = snapshots_using(snapshots_dir, hex(&digest));
            if !users.is_empty() {
                return Err(ImageError::InUse {
                    reference: reference.to_string(),
                    users: format!("snapshots {}", users.join(", ")),
                });
            }
        }
        match key {
            Some(k) => {
                refs.remove(&k);
            }
            None => refs.retain(|_, d| *d != digest),
        }
        self.save_refs(&refs)?;
        if !refs.values().any(|d| *d == digest) {
            let dir = self.image_dir(&digest);
            std::fs::remove_dir_all(&dir).map_err(io(format!("removing {}", dir.display())))?;
            self.remove_unused_blobs(&refs)?;
        }
        Ok(())
    }

    /// The snapshots in `snapshots_dir` that run on `reference`'s image
    /// (whose `meta.json` names its root disk).
    pub fn snapshots_on(&self, reference: &str, snapshots_dir: &Path) -> Result<Vec<String>> {
        let meta = self.get(reference)?;
        Ok(snapshots_using(snapshots_dir, hex(&meta.manifest_digest)))
    }

    /// Delete layer blobs and chunks no remaining image lists.
    fn remove_unused_blobs(&self, refs: &BTreeMap<String, String>) -> Result<()> {
        let mut used = std::collections::HashSet::new();
        for digest in refs.values() {
            if let Ok(m) = self.read_meta(digest) {
                if m.chunks.is_some() {
                    let index = self.index(&m)?;
                    used.extend(
                        index
                            .unique()
                            .into_iter()
                            .map(|c| hex(&c.digest).to_string()),
                    );
                }
                used.extend(m.layers.into_iter().map(|l| hex(&l.digest).to_string()));
            }
        }
        for dir in [self.blobs().join("sha256"), chunks::chunk_dir(&self.dir)] {
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if !used.contains(&name) {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
        Ok(())
    }

    /// Images no snapshot in `snapshots_dir` runs on, removed with every
    /// reference to them; returns the references removed.
    pub fn prune(&self, snapshots_dir: &Path) -> Result<Vec<String>> {
        let mut removed = Vec::new();
        for (reference, meta) in self.list() {
            if snapshots_using(snapshots_dir, hex(&meta.manifest_digest)).is_empty()
                && self.remove(&reference, snapshots_dir).is_ok()
            {
                removed.push(reference);
            }
        }
        Ok(removed)
    }
}

/// Snapshot ids under `snapshots_dir` whose `meta.json` names the image
/// with manifest hex `needle` (its rootfs path or its NBD export).
fn snapshots_using(snapshots_dir: &Path, needle: &str) -> Vec<String> {
    std::fs::read_dir(snapshots_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("meta.json")).is_ok_and(|m| m.contains(needle))
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}
