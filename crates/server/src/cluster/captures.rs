//! Captures through the registry: a node of a cluster with `[cluster]
//! registry` pushes each persistent snapshot (`create_snapshot`) there in
//! the background, and any node asked for a snapshot it lacks pulls it.
//!
//! A capture travels self-contained ([`tine_vmm::travel`]: device state,
//! whole RAM, disk flattened onto the base rootfs), each file as a chunked
//! artifact of its own (`<repo>:<id>.<file>`: 1 MiB zstd chunks named by
//! their sha256, zero chunks not stored, chunks the registry has already
//! not sent again), and the catalog keeps what a node needs to install it
//! (`tine_captures`: team, names, the snapshot row and meta, the
//! artifacts). A pull fetches every chunk, checks each against its digest
//! and the files against the snapshot's checksums before the snapshot
//! exists on the node: a damaged chunk is an error naming the capture and
//! the chunk, never a guest with wrong bytes.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tine_image::chunks::{self, remote};
use tine_image::{ImageRef, RegistryOptions};
use tine_vmm::snapshot::SnapshotMeta;

use super::catalog::{Catalog, CatalogError};
use crate::db::{Db, SnapshotKind, SnapshotRow};

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

/// What the catalog keeps of a pushed capture.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
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
    node: String,
    /// `host:port/path` of the repository.
    repo: String,
    opts: RegistryOptions,
    catalog: Catalog,
    paths: tine_vmm::Paths,
    /// Staging for pushes and pulls (`<data>/captures`).
    work: PathBuf,
    /// One pull at a time: two creates from one capture pull it once.
    pulls: tokio::sync::Mutex<()>,
}

impl Captures {
    pub fn new(
        node: &str,
        repo: &str,
        opts: RegistryOptions,
        catalog: Catalog,
        paths: tine_vmm::Paths,
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
        }
    }

    fn artifact(&self, id: &str, file: &str) -> Result<ImageRef, CaptureError> {
        let tag = file.split('.').next().unwrap_or(file);
        ImageRef::parse(&format!("{}:{id}.{tag}", self.repo)).map_err(|e| failed(id)(e.to_string()))
    }

    /// Push snapshot `row` of `team` in the background; the outcome is
    /// logged (and listed by `tine cluster captures` once done).
    pub fn push_later(self: &Arc<Self>, row: SnapshotRow, team: String) {
        let me = self.clone();
        tokio::spawn(async move {
            let t = std::time::Instant::now();
            match me.push(&row, &team).await {
                Ok(bytes) => tracing::info!(
                    snapshot = %row.id,
                    mib = bytes >> 20,
                    secs = t.elapsed().as_secs_f64(),
                    "capture pushed to the registry"
                ),
                Err(e) => tracing::warn!(snapshot = %row.id, "pushing the capture: {e}"),
            }
        });
    }

    async fn push(&self, row: &SnapshotRow, team: &str) -> Result<u64, CaptureError> {
        let err = failed(&row.id);
        let stage = self.work.join(format!("push-{}", row.id));
        let _ = std::fs::remove_dir_all(&stage);
        let result = async {
            let files_dir = stage.join("files");
            let meta = tine_vmm::travel::export(&self.paths, &row.id, &files_dir)
                .await
                .map_err(|e| err(e.to_string()))?;
            let chunk_dir = stage.join("chunks");
            let mut files = BTreeMap::new();
            let mut pushed_bytes = 0;
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
                sandbox_id: row.sandbox_id.clone(),
                template_id: row.template_id.clone(),
                cpu_count: row.cpu_count,
                memory_mb: row.memory_mb,
                source_token: row.source_token.clone(),
                created_ms: row.created_ms,
                meta,
                files,
                pushed_bytes,
            };
            self.put(&row.id, team, &row.names, &record).await?;
            Ok::<_, CaptureError>(pushed_bytes)
        }
        .await;
        let _ = std::fs::remove_dir_all(&stage);
        result
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
        let Some((id, record)) = self.find(team, template).await? else {
            return Ok(false);
        };
        let _one = self.pulls.lock().await;
        if here(&id) {
            return Ok(true);
        }
        let err = failed(&id);
        let t = std::time::Instant::now();
        let stage = self.work.join(format!("pull-{id}"));
        let _ = std::fs::remove_dir_all(&stage);
        let result = async {
            let files_dir = stage.join("files");
            let chunk_dir = stage.join("chunks");
            std::fs::create_dir_all(&files_dir).map_err(|e| err(e.to_string()))?;
            let mut fetched = 0;
            for (f, artifact) in &record.files {
                let r = ImageRef::parse(artifact).map_err(|e| err(e.to_string()))?;
                let index = remote::find_at(&r, &self.opts, None)
                    .await
                    .map_err(|e| err(format!("{f}: {e}")))?
                    .ok_or_else(|| err(format!("{f}: {artifact} is not in the registry")))?;
                fetched += remote::fetch_all(&r, &index, &chunk_dir, &self.opts, None)
                    .await
                    .map_err(|e| err(format!("{f}: {e}")))?;
                let (dir, out) = (chunk_dir.clone(), files_dir.join(f));
                tokio::task::spawn_blocking(move || chunks::assemble(&index, &dir, &out))
                    .await
                    .map_err(|e| err(e.to_string()))?
                    .map_err(|e| err(format!("{f}: {e}")))?;
            }
            tine_vmm::travel::import(&self.paths, &id, &files_dir, record.meta.clone())
                .await
                .map_err(|e| err(e.to_string()))?;
            let row = SnapshotRow {
                id: id.clone(),
                kind: SnapshotKind::Snapshot,
                sandbox_id: record.sandbox_id.clone(),
                parent_id: None,
                names: self.names(&id).await.unwrap_or_default(),
                template_id: record.template_id.clone(),
                cpu_count: record.cpu_count,
                memory_mb: record.memory_mb,
                source_token: record.source_token.clone(),
                created_ms: record.created_ms,
            };
            db.import_snapshot(&row, team)
                .map_err(|e| err(e.to_string()))?;
            Ok::<_, CaptureError>(fetched)
        }
        .await;
        let _ = std::fs::remove_dir_all(&stage);
        let fetched = result?;
        tracing::info!(
            snapshot = %id,
            mib = fetched >> 20,
            secs = t.elapsed().as_secs_f64(),
            "capture pulled from the registry"
        );
        Ok(true)
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

    async fn find(
        &self,
        team: &str,
        template: &str,
    ) -> Result<Option<(String, Record)>, CaptureError> {
        let db = self.catalog.pool.get().await.map_err(CatalogError::from)?;
        let row = db
            .query_opt(
                "SELECT id, record FROM tine_captures
                 WHERE team = $1 AND (id = $2 OR names ? $2) LIMIT 1",
                &[&team, &template],
            )
            .await
            .map_err(CatalogError::from)?;
        let Some(row) = row else { return Ok(None) };
        let id: String = row.get(0);
        let record: serde_json::Value = row.get(1);
        let record = serde_json::from_value(record)
            .map_err(|e| failed(&id)(format!("its catalog record: {e}")))?;
        Ok(Some((id, record)))
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
/// pulls it again.
pub async fn forget(catalog: &Catalog, id: &str) -> Result<bool, CatalogError> {
    let db = catalog.pool.get().await?;
    Ok(db
        .execute("DELETE FROM tine_captures WHERE id = $1", &[&id])
        .await?
        > 0)
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
