//! Captures through the registry: a node of a cluster with `[cluster]
//! registry` pushes each persistent snapshot (`create_snapshot`), each
//! template it builds and (durable pause, on by default) the capture of
//! each sandbox paused with its memory there in the background
//! ([`Captures::run`]); any node asked for a template or snapshot it lacks
//! pulls it ([`Captures::ensure_local`]), and a node a gateway sends the
//! `connect` of a paused sandbox whose own node is down or full adopts it
//! from its capture ([`Captures::adopt`]): same id, tokens, metadata and
//! network policy; the catalog records the move and the old node drops
//! its copy when it is back.
//!
//! A capture travels self-contained ([`tine_vmm::travel`]: device state,
//! whole RAM, disk flattened onto the base rootfs or, for a sandbox on an
//! OCI image, onto the image, whose chunks then travel too: the artifact
//! the node read them from, or `<repo>:image-<digest>` when they were only
//! on the node; a pulling node records the image in its store, reads it
//! lazily through its own image daemon and fetches the capture's disk
//! whole, since its header names that daemon), each file as a chunked
//! artifact of its own (`<repo>:<id>.<file>`: 1 MiB zstd chunks named by
//! their sha256, zero chunks not stored, chunks the registry has already
//! not sent again), and the catalog keeps what a node needs to install it
//! (`tine_captures`: team, names, the snapshot row and meta, the
//! artifacts). A pull reads the capture's RAM and disk lazily through the
//! image daemon ([`tine_image::lazy`]: each chunk fetched and checked when
//! first read; a damaged one ends the VM that read it and refuses later
//! restores), or with `lazy_pull = false` fetches every chunk, checks each
//! against its digest and the files against the snapshot's checksums
//! before the snapshot exists on the node. Either way a damaged chunk is
//! an error naming the capture and the chunk, never a guest with wrong
//! bytes.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tine_image::chunks::{self, remote};
use tine_image::{ImageRef, RegistryOptions};
use tine_vmm::snapshot::SnapshotMeta;

use super::catalog::{Catalog, CatalogError};
use crate::db::{Db, SnapshotKind, SnapshotRow};
use crate::model::SandboxState;

#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("capture {id}: {detail}")]
    Failed { id: String, detail: String },
    #[error(transparent)]
    Catalog(#[from] CatalogError),
}

fn failed(id: &str) -> impl Fn(String) -> CaptureError + '_ {
    move |detail| CaptureError::Failed {
        id: id.to_string(),
        detail,
    }
}

/// The files a lazy pull leaves in the registry until they are read.
const LAZY_FILES: [&str; 2] = ["ram", "disk.qcow2"];

/// What the catalog keeps of a pushed capture.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    /// `snapshot` or `template`.
    pub kind: String,
    /// A template's `(name, tag)`s.
    #[serde(default)]
    pub tags: Vec<(String, String)>,
    pub sandbox_id: String,
    pub template_id: String,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub source_token: String,
    pub created_ms: i64,
    pub meta: SnapshotMeta,
    /// The artifact of each file, by file name.
    pub files: BTreeMap<String, String>,
    /// Bytes of chunks the push sent (the rest the registry had).
    pub pushed_bytes: u64,
    /// A pause capture's sandbox, as it was paused.
    #[serde(default)]
    pub sandbox: Option<crate::model::SandboxRecord>,
    /// The OCI image the capture's disk is over, its chunks in the
    /// registry artifact `image.chunks.remote` (None: over the base rootfs).
    #[serde(default)]
    pub image: Option<tine_image::ImageMeta>,
}

impl Record {
    /// The snapshot row of this capture installed here as `id`.
    fn row(
        &self,
        id: &str,
        kind: SnapshotKind,
        sandbox_id: String,
        names: Vec<String>,
    ) -> SnapshotRow {
        SnapshotRow {
            id: id.to_string(),
            kind,
            sandbox_id,
            parent_id: None,
            names,
            template_id: self.template_id.clone(),
            cpu_count: self.cpu_count,
            memory_mb: self.memory_mb,
            source_token: self.source_token.clone(),
            created_ms: self.created_ms,
        }
    }
}

/// A pushed capture as `tine cluster captures` lists it.
#[derive(Debug, Clone)]
pub struct Listed {
    pub id: String,
    pub team: String,
    pub names: Vec<String>,
    pub node: String,
    pub pushed_bytes: u64,
}

pub struct Captures {
    pub(super) node: String,
    /// `host:port/path` of the repository.
    repo: String,
    pub(super) opts: RegistryOptions,
    pub(super) catalog: Catalog,
    pub(super) paths: tine_vmm::Paths,
    /// Staging for pushes and pulls (`<data>/captures`).
    work: PathBuf,
    /// One pull at a time: two creates from one capture pull it once.
    pulls: tokio::sync::Mutex<()>,
    /// Push the captures of paused sandboxes too.
    durable_pause: bool,
    /// Read pulled captures' RAM and disk lazily.
    lazy_pull: bool,
    stats: Stats,
}

/// What a node's captures moved since it started (its `/metrics`).
#[derive(Debug, Default)]
pub struct Stats {
    pub pushed: AtomicU64,
    pub pushed_bytes: AtomicU64,
    pub pulled: AtomicU64,
    pub pulled_bytes: AtomicU64,
    pub adopted: AtomicU64,
}

impl Captures {
    pub fn new(
        node: &str,
        repo: &str,
        opts: RegistryOptions,
        catalog: Catalog,
        paths: tine_vmm::Paths,
        durable_pause: bool,
        lazy_pull: bool,
    ) -> Self {
        let work = paths.data_dir.join("captures");
        // Left by a run that stopped mid-way.
        let _ = std::fs::remove_dir_all(&work);
        Captures {
            node: node.to_string(),
            repo: repo.trim_end_matches('/').to_string(),
            opts,
            catalog,
            paths,
            work,
            pulls: tokio::sync::Mutex::new(()),
            durable_pause,
            lazy_pull,
            stats: Stats::default(),
        }
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    fn artifact(&self, id: &str, file: &str) -> Result<ImageRef, CaptureError> {
        let tag = file.split('.').next().unwrap_or(file);
        ImageRef::parse(&format!("{}:{id}.{tag}", self.repo)).map_err(|e| failed(id)(e.to_string()))
    }

    /// Push every snapshot and template of this node (and the capture of
    /// each paused sandbox) that the catalog does not have yet, whenever
    /// one is made, forever; forget the pause captures whose sandbox was
    /// resumed or killed since. A push that fails is tried again after 5
    /// minutes.
    pub async fn run(self: Arc<Self>, db: Arc<Db>) {
        let mut changes = db.subscribe();
        let pushed = self.pushed_here().await.unwrap_or_else(|e| {
            tracing::warn!("reading the pushed captures: {e}");
            Vec::new()
        });
        let mut done: std::collections::HashSet<String> =
            pushed.iter().map(|(id, _)| id.clone()).collect();
        // Pause captures pushed: capture -> its sandbox.
        let mut pauses: std::collections::HashMap<String, String> = pushed
            .into_iter()
            .filter_map(|(id, sandbox)| Some((id, sandbox?)))
            .collect();
        // A capture whose push failed waits before the next try.
        let mut failed_at: std::collections::HashMap<String, std::time::Instant> =
            Default::default();
        loop {
            failed_at.retain(|_, t| t.elapsed() < std::time::Duration::from_secs(300));
            let stale: Vec<String> = pauses
                .iter()
                .filter(|(c, sb)| !db.pause_is_current(sb, c).unwrap_or(true))
                .map(|(c, _)| c.clone())
                .collect();
            for c in stale {
                // Resumed or killed here: its capture is history.
                self.forget(&c).await;
                pauses.remove(&c);
            }
            let rows = db
                .travelling_snapshots(self.durable_pause)
                .unwrap_or_else(|e| {
                    tracing::warn!("listing the snapshots to push: {e}");
                    Vec::new()
                });
            let new: Vec<SnapshotRow> = rows
                .into_iter()
                .filter(|r| !done.contains(&r.id) && !failed_at.contains_key(&r.id))
                .collect();
            for row in new {
                let team = db.snapshot_team(&row).ok().flatten();
                let tags = db.tags_of(&row.id).unwrap_or_default();
                let t = std::time::Instant::now();
                match self.push(&db, &row, team.as_deref(), &tags).await {
                    Ok(bytes) => {
                        tracing::info!(
                            snapshot = %row.id,
                            mib = bytes >> 20,
                            secs = t.elapsed().as_secs_f64(),
                            "capture pushed to the registry"
                        );
                        if row.kind == SnapshotKind::Pause {
                            pauses.insert(row.id.clone(), row.sandbox_id.clone());
                        }
                        done.insert(row.id);
                    }
                    Err(e) => {
                        tracing::warn!(snapshot = %row.id, "pushing the capture (again in 5 min): {e}");
                        failed_at.insert(row.id, std::time::Instant::now());
                    }
                }
            }
            tokio::select! {
                _ = changes.changed() => {
                    // A build tags its template just after it is made.
                    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                }
                _ = tokio::time::sleep(std::time::Duration::from_secs(60)) => {}
            }
        }
    }

    async fn push(
        &self,
        db: &Db,
        row: &SnapshotRow,
        team: Option<&str>,
        tags: &[(String, String)],
    ) -> Result<u64, CaptureError> {
        let err = failed(&row.id);
        let sandbox = match row.kind {
            SnapshotKind::Pause => Some(
                self.paused_sandbox(db, row)
                    .ok_or_else(|| err("its sandbox is no longer paused on it".into()))?,
            ),
            SnapshotKind::Fork => Some(
                db.get_sandbox(&row.sandbox_id)
                    .ok()
                    .flatten()
                    .ok_or_else(|| err("its sandbox is gone".into()))?,
            ),
            _ => None,
        };
        let stage = self.work.join(format!("push-{}", row.id));
        let _ = std::fs::remove_dir_all(&stage);
        let result = async {
            let files_dir = stage.join("files");
            let meta = tine_vmm::travel::export(&self.paths, &row.id, &files_dir)
                .await
                .map_err(|e| err(e.to_string()))?;
            let (image, mut pushed_bytes) = match &meta.artifacts.rootfs {
                tine_vmm::RootDisk::Nbd { export, .. } => {
                    let (image, sent) = self.travelling_image(&row.id, export).await?;
                    (Some(image), sent)
                }
                tine_vmm::RootDisk::File(_) => (None, 0),
            };
            let chunk_dir = stage.join("chunks");
            let mut files = BTreeMap::new();
            for f in tine_vmm::travel::FILES {
                let (path, dir) = (files_dir.join(f), chunk_dir.clone());
                let index = tokio::task::spawn_blocking(move || chunks::build(&path, &dir))
                    .await
                    .map_err(|e| err(e.to_string()))?
                    .map_err(|e| err(format!("chunking {f}: {e}")))?;
                let target = self.artifact(&row.id, f)?;
                let mut sent = 0;
                remote::push(&target, &index, &chunk_dir, &self.opts, None, &mut |p| {
                    if !p.skipped {
                        sent += p.bytes
                    }
                })
                .await
                .map_err(|e| err(format!("pushing {f}: {e}")))?;
                pushed_bytes += sent;
                files.insert(f.to_string(), target.to_string());
            }
            let record = Record {
                kind: row.kind.as_str().to_string(),
                tags: tags.to_vec(),
                sandbox_id: row.sandbox_id.clone(),
                template_id: row.template_id.clone(),
                cpu_count: row.cpu_count,
                memory_mb: row.memory_mb,
                source_token: row.source_token.clone(),
                created_ms: row.created_ms,
                meta,
                files,
                pushed_bytes,
                sandbox,
                image,
            };
            // Found by id, by name and by `name:tag`.
            let names: Vec<String> = row
                .names
                .iter()
                .cloned()
                .chain(tags.iter().map(|(t, tag)| format!("{t}:{tag}")))
                .collect();
            self.put(&row.id, team.unwrap_or_default(), &names, &record)
                .await?;
            self.stats.pushed.fetch_add(1, Ordering::Relaxed);
            self.stats
                .pushed_bytes
                .fetch_add(pushed_bytes, Ordering::Relaxed);
            Ok::<_, CaptureError>(pushed_bytes)
        }
        .await;
        let _ = std::fs::remove_dir_all(&stage);
        result
    }

    /// Image `export` (a manifest digest's hex), which capture `id`'s disk
    /// is over, as other nodes install it: with its chunks in a registry
    /// they read. An image whose chunks are only here (converted here) or
    /// are fetched with credentials only this node holds is pushed to the
    /// cluster's repository as `image-<digest>` first; that tag is shared
    /// by every capture on the image and stays when they are deleted.
    /// Also returns the bytes of chunks that push sent.
    async fn travelling_image(
        &self,
        id: &str,
        export: &str,
    ) -> Result<(tine_image::ImageMeta, u64), CaptureError> {
        let err = failed(id);
        let store = tine_image::ImageStore::new(&self.paths.data_dir);
        let meta = store.by_digest(export).ok_or_else(|| {
            err(format!(
                "its image sha256:{export} is not in this node's store"
            ))
        })?;
        let remote = meta.chunks.as_ref().and_then(|c| c.remote.clone());
        if let Some(r) = remote.filter(|_| !store.needs_credentials(&meta)) {
            // Still there (a registry emptied since would leave it naming
            // nothing: then its chunks are pushed again, if all are here).
            let r = ImageRef::parse(&r).map_err(|e| err(e.to_string()))?;
            if remote::find_at(&r, &self.opts, None)
                .await
                .map_err(|e| err(format!("image {}: {e}", meta.reference)))?
                .is_some()
            {
                return Ok((meta, 0));
            }
        }
        let target = ImageRef::parse(&format!("{}:image-{export}", self.repo))
            .map_err(|e| err(e.to_string()))?;
        let mut sent = 0;
        let mut pushed = store
            .push_to(&meta, &target, &self.opts, None, &mut |p| {
                if !p.skipped {
                    sent += p.bytes
                }
            })
            .await
            .map_err(|e| {
                err(format!(
                    "pushing the chunks of image {}: {e}",
                    meta.reference
                ))
            })?;
        if let Some(c) = pushed.chunks.as_mut() {
            c.remote = Some(target.to_string());
        }
        tracing::info!(
            capture = id,
            image = %meta.reference,
            artifact = %target,
            mib = sent >> 20,
            "image chunks pushed to the registry with the capture"
        );
        Ok((pushed, sent))
    }

    /// Push fork capture `row` now (its children start on other nodes
    /// too); the bytes sent.
    pub async fn push_fork(&self, db: &Db, row: &SnapshotRow) -> Result<u64, CaptureError> {
        let team = db.snapshot_team(row).ok().flatten();
        let t = std::time::Instant::now();
        let bytes = self.push(db, row, team.as_deref(), &[]).await?;
        tracing::info!(
            snapshot = %row.id,
            mib = bytes >> 20,
            secs = t.elapsed().as_secs_f64(),
            "fork capture pushed to the registry"
        );
        Ok(bytes)
    }

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
    async fn pull(&self, id: &str, record: &Record) -> Result<u64, CaptureError> {
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

    /// Put `image`, which capture `id`'s disk is over, into this node's
    /// image store if it lacks it: its index only, its chunks come from
    /// the registry on first read, as for a lazy pull.
    async fn install_image(
        &self,
        id: &str,
        image: &tine_image::ImageMeta,
    ) -> Result<(), CaptureError> {
        let err = failed(id);
        let store = tine_image::ImageStore::new(&self.paths.data_dir);
        if store.has(&image.manifest_digest) {
            return Ok(());
        }
        let artifact = image
            .chunks
            .as_ref()
            .and_then(|c| c.remote.clone())
            .ok_or_else(|| {
                err(format!(
                    "image {}: its chunks are in no registry",
                    image.reference
                ))
            })?;
        let r = ImageRef::parse(&artifact).map_err(|e| err(e.to_string()))?;
        let index = remote::find_at(&r, &self.opts, None)
            .await
            .map_err(|e| err(format!("image {}: {e}", image.reference)))?
            .ok_or_else(|| {
                err(format!(
                    "image {}: {artifact} is not in the registry",
                    image.reference
                ))
            })?;
        let image = image.clone();
        tokio::task::spawn_blocking(move || store.install(&image, &index))
            .await
            .map_err(|e| err(e.to_string()))?
            .map_err(|e| err(e.to_string()))
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

    /// Make paused sandbox `sandbox_id` of `team`, which this node does
    /// not have, this node's from the capture its own node pushed when it
    /// paused: pulled, installed, and the sandbox recorded here as paused
    /// on it (its `connect` then resumes it as any). The catalog records
    /// the move. `Ok(false)`: no capture of it was pushed.
    pub async fn adopt(&self, db: &Db, team: &str, sandbox_id: &str) -> Result<bool, CaptureError> {
        // Here already (a killed row is one that moved away from here).
        let here = || {
            db.get_sandbox(sandbox_id)
                .ok()
                .flatten()
                .is_some_and(|s| !matches!(s.state, SandboxState::Killed | SandboxState::Failed))
        };
        if here() {
            return Ok(false);
        }
        let Some((id, from, record)) = self.find_pause(team, sandbox_id).await? else {
            return Ok(false);
        };
        let err = failed(&id);
        let sandbox = record
            .sandbox
            .clone()
            .filter(|s| s.id == sandbox_id && s.team == team)
            .ok_or_else(|| err("its record names another sandbox".into()))?;
        let _one = self.pulls.lock().await;
        if here() {
            return Ok(true);
        }
        let t = std::time::Instant::now();
        let fetched = self.pull(&id, &record).await?;
        let row = record.row(&id, SnapshotKind::Pause, sandbox_id.to_string(), Vec::new());
        let detail = format!("from node {from}: its pause capture {id} pulled from the registry");
        db.adopt_sandbox(&sandbox, &row, &detail)
            .map_err(|e| err(e.to_string()))?;
        // From here on the old node's lists no longer speak for it; its
        // next resume here pushes a new capture when it pauses again.
        self.catalog
            .record_move(sandbox_id, &from, &self.node)
            .await?;
        self.forget(&id).await;
        self.stats.adopted.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            sandbox = sandbox_id,
            capture = %id,
            from = %from,
            mib = fetched >> 20,
            secs = t.elapsed().as_secs_f64(),
            "paused sandbox adopted from its pushed capture"
        );
        Ok(true)
    }

    /// The sandbox `row` (a pause capture) is paused on, if it still is.
    fn paused_sandbox(&self, db: &Db, row: &SnapshotRow) -> Option<crate::model::SandboxRecord> {
        if !db.pause_is_current(&row.sandbox_id, &row.id).ok()? {
            return None;
        }
        db.get_sandbox(&row.sandbox_id).ok().flatten()
    }

    /// Forget capture `id` (its snapshot was deleted here): no node pulls
    /// it again. Failures only log (the gateway forgets it too).
    pub async fn forget(&self, id: &str) {
        if let Err(e) = forget(&self.catalog, id).await {
            tracing::warn!(snapshot = id, "forgetting the capture in the catalog: {e}");
        }
    }

    // ---- the catalog's table ----

    async fn put(
        &self,
        id: &str,
        team: &str,
        names: &[String],
        record: &Record,
    ) -> Result<(), CaptureError> {
        let db = self.catalog.pool.get().await.map_err(CatalogError::from)?;
        let names = serde_json::to_value(names).unwrap_or_default();
        let record = serde_json::to_value(record).unwrap_or_default();
        db.execute(
            "INSERT INTO tine_captures (id, team, names, node_id, record, pushed_ms)
             VALUES ($1, $2, $3, $4, $5, (extract(epoch from clock_timestamp()) * 1000)::bigint)
             ON CONFLICT (id) DO UPDATE SET record = $5, names = $3",
            &[&id, &team, &names, &self.node, &record],
        )
        .await
        .map_err(CatalogError::from)?;
        Ok(())
    }

    /// The capture `template` names (an id, a name, `name:tag`) that
    /// `team` may use (its own, or shared: team ''), newest first: its id,
    /// its team and its record.
    async fn find(
        &self,
        team: &str,
        template: &str,
    ) -> Result<Option<(String, String, Record)>, CaptureError> {
        let db = self.catalog.pool.get().await.map_err(CatalogError::from)?;
        let row = db
            .query_opt(
                "SELECT id, team, record FROM tine_captures
                 WHERE (team = $1 OR team = '') AND (id = $2 OR names ? $2)
                 ORDER BY pushed_ms DESC LIMIT 1",
                &[&team, &template],
            )
            .await
            .map_err(CatalogError::from)?;
        let Some(row) = row else { return Ok(None) };
        let id: String = row.get(0);
        let record: serde_json::Value = row.get(2);
        let record = serde_json::from_value(record)
            .map_err(|e| failed(&id)(format!("its catalog record: {e}")))?;
        Ok(Some((id, row.get(1), record)))
    }

    /// The newest pause capture of sandbox `sandbox_id` of `team`: its
    /// id, the node that pushed it and its record.
    async fn find_pause(
        &self,
        team: &str,
        sandbox_id: &str,
    ) -> Result<Option<(String, String, Record)>, CaptureError> {
        let db = self.catalog.pool.get().await.map_err(CatalogError::from)?;
        let row = db
            .query_opt(
                "SELECT id, node_id, record FROM tine_captures
                 WHERE team = $1 AND record->>'kind' = 'pause' AND record->>'sandbox_id' = $2
                 ORDER BY pushed_ms DESC LIMIT 1",
                &[&team, &sandbox_id],
            )
            .await
            .map_err(CatalogError::from)?;
        let Some(row) = row else { return Ok(None) };
        let id: String = row.get(0);
        let record = serde_json::from_value(row.get(2))
            .map_err(|e| failed(&id)(format!("its catalog record: {e}")))?;
        Ok(Some((id, row.get(1), record)))
    }

    /// The captures this node pushed, with the sandbox of each pause
    /// capture.
    async fn pushed_here(&self) -> Result<Vec<(String, Option<String>)>, CatalogError> {
        let db = self.catalog.pool.get().await?;
        let rows = db
            .query(
                "SELECT id, CASE WHEN record->>'kind' = 'pause' THEN record->>'sandbox_id' END
                   FROM tine_captures WHERE node_id = $1",
                &[&self.node],
            )
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    async fn names(&self, id: &str) -> Result<Vec<String>, CaptureError> {
        let db = self.catalog.pool.get().await.map_err(CatalogError::from)?;
        let row = db
            .query_opt("SELECT names FROM tine_captures WHERE id = $1", &[&id])
            .await
            .map_err(CatalogError::from)?;
        Ok(row
            .and_then(|r| serde_json::from_value(r.get::<_, serde_json::Value>(0)).ok())
            .unwrap_or_default())
    }
}

/// Forget capture `id` in the catalog (its snapshot was deleted): no node
/// pulls it again, and its artifacts go to the trash, removed from the
/// registry once no node reads it lazily ([`super::trash`]).
pub async fn forget(catalog: &Catalog, id: &str) -> Result<bool, CatalogError> {
    let db = catalog.pool.get().await?;
    Ok(db
        .execute(
            "WITH gone AS (DELETE FROM tine_captures WHERE id = $1 RETURNING id, record)
             INSERT INTO tine_capture_trash (id, record, forgotten_ms)
             SELECT id, record, (extract(epoch from clock_timestamp()) * 1000)::bigint FROM gone
             ON CONFLICT (id) DO NOTHING",
            &[&id],
        )
        .await?
        > 0)
}

/// Team `team`'s persistent snapshots pushed to the registry, oldest
/// first: id, names and the sandbox each was taken of. What a gateway
/// lists of them when the nodes that hold them are down.
pub async fn snapshots_of(
    catalog: &Catalog,
    team: &str,
) -> Result<Vec<(String, Vec<String>, String)>, CatalogError> {
    let db = catalog.pool.get().await?;
    let rows = db
        .query(
            "SELECT id, names, record->>'sandbox_id' FROM tine_captures
             WHERE team = $1 AND record->>'kind' = 'snapshot'
             ORDER BY pushed_ms, id",
            &[&team],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| {
            let names: serde_json::Value = r.get(1);
            let sandbox: Option<String> = r.get(2);
            (
                r.get(0),
                serde_json::from_value(names).unwrap_or_default(),
                sandbox.unwrap_or_default(),
            )
        })
        .collect())
}

/// Every pushed capture, oldest first.
pub async fn list(catalog: &Catalog) -> Result<Vec<Listed>, CatalogError> {
    let db = catalog.pool.get().await?;
    let rows = db
        .query(
            "SELECT id, team, names, node_id, record FROM tine_captures ORDER BY pushed_ms, id",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| {
            let record: serde_json::Value = r.get(4);
            Listed {
                id: r.get(0),
                team: r.get(1),
                names: serde_json::from_value(r.get::<_, serde_json::Value>(2)).unwrap_or_default(),
                node: r.get(3),
                pushed_bytes: record["pushed_bytes"].as_u64().unwrap_or(0),
            }
        })
        .collect())
}
