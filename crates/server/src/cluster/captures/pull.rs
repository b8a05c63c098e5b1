//! Pulling captures from the registry: a template or snapshot this node
//! lacks, a fork's source, each lazily through the image daemon or whole.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use tine_image::chunks::{self, remote};
use tine_image::ImageRef;

use super::{failed, CaptureError, Captures, Record};
use crate::db::{Db, SnapshotKind};

/// The files a lazy pull leaves in the registry until they are read.
const LAZY_FILES: [&str; 2] = ["ram", "disk.qcow2"];

impl Captures {
    /// The source sandbox of fork capture `capture` of `team`, pulled from
    /// the registry unless this node has it: children start from it here
    /// ([`crate::sandboxes::Manager::fork_from`]).
    pub async fn fork_source(
        &self,
        db: &Db,
        team: &str,
        capture: &str,
    ) -> Result<crate::model::SandboxRecord, CaptureError> {
        let Some((id, owner, record)) = self.find(team, capture).await? else {
            return Err(failed(capture)(
                "no such fork capture in the catalog".into(),
            ));
        };
        let err = failed(&id);
        let source = record
            .sandbox
            .clone()
            .filter(|s| record.kind == "fork" && s.team == team)
            .ok_or_else(|| err("not a fork capture of this team".into()))?;
        let _one = self.pulls.lock().await;
        if db.get_snapshot(&id).ok().flatten().is_none() {
            let t = std::time::Instant::now();
            let fetched = self.pull(&id, &record).await?;
            let row = record.row(&id, SnapshotKind::Fork, source.id.clone(), Vec::new());
            db.import_snapshot(&row, Some(owner.as_str()), &[])
                .map_err(|e| err(e.to_string()))?;
            tracing::info!(
                snapshot = %id,
                mib = fetched >> 20,
                secs = t.elapsed().as_secs_f64(),
                "fork capture pulled from the registry"
            );
        }
        Ok(source)
    }

    /// Make snapshot `template` (an id or a name) of `team` local if this
    /// node lacks it and the registry has it. `Ok(false)`: nothing to do
    /// (it is here, or no such capture was pushed).
    pub async fn ensure_local(
        &self,
        db: &Db,
        team: &str,
        template: &str,
    ) -> Result<bool, CaptureError> {
        let here = |id: &str| db.get_snapshot(id).ok().flatten().is_some();
        if here(template) {
            return Ok(false);
        }
        let Some((id, owner, record)) = self.find(team, template).await? else {
            return Ok(false);
        };
        let _one = self.pulls.lock().await;
        if here(&id) {
            return Ok(true);
        }
        let err = failed(&id);
        let t = std::time::Instant::now();
        let result = async {
            let fetched = self.pull(&id, &record).await?;
            let kind = match record.kind.as_str() {
                "template" => SnapshotKind::Template,
                _ => SnapshotKind::Snapshot,
            };
            let names = self.names(&id).await?;
            let names = match kind {
                // A template's first name is its own; `name:tag`s find it.
                SnapshotKind::Template => names.into_iter().take(1).collect(),
                _ => names,
            };
            let row = record.row(&id, kind, record.sandbox_id.clone(), names);
            let owner = Some(owner.as_str()).filter(|t| !t.is_empty());
            db.import_snapshot(&row, owner, &record.tags)
                .map_err(|e| err(e.to_string()))?;
            Ok::<_, CaptureError>(fetched)
        }
        .await;
        let fetched = result?;
        tracing::info!(
            snapshot = %id,
            mib = fetched >> 20,
            secs = t.elapsed().as_secs_f64(),
            "capture pulled from the registry"
        );
        Ok(true)
    }

    /// Fetch capture `id`'s files, check them and install them as
    /// snapshot `id` of this node (no row yet); the bytes fetched. With
    /// lazy pulls its RAM and disk are not fetched here but registered
    /// with the image daemon, which fetches their chunks as the VMs
    /// restored from it first read them ([`tine_image::lazy`]).
    pub(super) async fn pull(&self, id: &str, record: &Record) -> Result<u64, CaptureError> {
        let err = failed(id);
        let stage = self.work.join(format!("pull-{id}"));
        let _ = std::fs::remove_dir_all(&stage);
        let result = async {
            let files_dir = stage.join("files");
            let chunk_dir = stage.join("chunks");
            std::fs::create_dir_all(&files_dir).map_err(|e| err(e.to_string()))?;
            let mut fetched = 0;
            let mut lazy = BTreeMap::new();
            let mut whole = Vec::new();
            if let Some(image) = &record.image {
                self.install_image(id, image).await?;
            }
            // The disk of a capture on an image names its node's image
            // daemon: it is fetched whole and pointed at this node's.
            let lazy_files: &[&str] = match record.image {
                Some(_) => &["ram"],
                None => &LAZY_FILES,
            };
            for (f, artifact) in &record.files {
                let r = ImageRef::parse(artifact).map_err(|e| err(e.to_string()))?;
                let index = remote::find_at(&r, &self.opts, None)
                    .await
                    .map_err(|e| err(format!("{f}: {e}")))?
                    .ok_or_else(|| err(format!("{f}: {artifact} is not in the registry")))?;
                match self.lazy_pull && lazy_files.contains(&f.as_str()) {
                    true => {
                        lazy.insert(
                            f.clone(),
                            tine_image::lazy::LazyFile {
                                reference: artifact.clone(),
                                index,
                            },
                        );
                    }
                    false => whole.push((f.clone(), r, index)),
                }
            }
            if !lazy.is_empty() && !self.serve_lazily(id, &lazy, &files_dir).await {
                for (f, l) in std::mem::take(&mut lazy) {
                    let r = ImageRef::parse(&l.reference).map_err(|e| err(e.to_string()))?;
                    whole.push((f, r, l.index));
                }
            }
            for (f, r, index) in whole {
                fetched += remote::fetch_all(&r, &index, &chunk_dir, &self.opts, None)
                    .await
                    .map_err(|e| err(format!("{f}: {e}")))?;
                let (dir, out) = (chunk_dir.clone(), files_dir.join(&f));
                tokio::task::spawn_blocking(move || chunks::assemble(&index, &dir, &out))
                    .await
                    .map_err(|e| err(e.to_string()))?
                    .map_err(|e| err(format!("{f}: {e}")))?;
            }
            let mut meta = record.meta.clone();
            if let tine_vmm::RootDisk::Nbd { socket, .. } = &mut meta.artifacts.rootfs {
                *socket = tine_image::nbd::daemon::socket_path(&self.paths.data_dir);
            }
            let installed = tine_vmm::travel::import(&self.paths, id, &files_dir, meta)
                .await
                .map_err(|e| err(e.to_string()));
            if installed.is_err() && !lazy.is_empty() {
                tine_image::lazy::unregister(&self.paths.data_dir, id);
            }
            installed?;
            self.stats.pulled.fetch_add(1, Ordering::Relaxed);
            self.stats
                .pulled_bytes
                .fetch_add(fetched, Ordering::Relaxed);
            Ok::<_, CaptureError>(fetched)
        }
        .await;
        let _ = std::fs::remove_dir_all(&stage);
        result
    }

    /// Register `files` of capture `id` with the image daemon and link
    /// them into `files_dir`; false (and nothing registered) when the
    /// daemon does not serve them (no FUSE on this host).
    async fn serve_lazily(
        &self,
        id: &str,
        files: &BTreeMap<String, tine_image::lazy::LazyFile>,
        files_dir: &std::path::Path,
    ) -> bool {
        let data_dir = self.paths.data_dir.clone();
        let d = tine_image::lazy::Descriptor {
            capture: id.to_string(),
            snapshot_dir: self.paths.snapshot_dir(id),
            files: files.clone(),
            registries: self.opts.clone(),
        };
        let (id_, links) = (id.to_string(), files_dir.to_path_buf());
        let served = tokio::task::spawn_blocking(move || {
            tine_image::lazy::register(&data_dir, &d).map_err(|e| e.to_string())?;
            for (f, l) in &d.files {
                let at = tine_image::lazy::path_of(&data_dir, &id_, f);
                let len = std::fs::metadata(&at)
                    .map_err(|e| format!("{}: {e}", at.display()))?
                    .len();
                if len != l.index.disk_size {
                    return Err(format!(
                        "{} is {len} bytes, not {}",
                        at.display(),
                        l.index.disk_size
                    ));
                }
                std::os::unix::fs::symlink(&at, links.join(f))
                    .map_err(|e| format!("linking {}: {e}", at.display()))?;
            }
            Ok::<_, String>(())
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r);
        // Recorded as read here before anything can forget the capture:
        // the trash keeps a capture some node reads (super::trash).
        let served = match served {
            Ok(()) => self
                .note_reader(id)
                .await
                .map_err(|e| format!("recording the reader: {e}")),
            e => e,
        };
        match served {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(
                    capture = id,
                    "pulling the capture whole: the image daemon does not serve it lazily ({e})"
                );
                tine_image::lazy::unregister(&self.paths.data_dir, id);
                for f in files.keys() {
                    let _ = std::fs::remove_file(files_dir.join(f));
                }
                false
            }
        }
    }
}
