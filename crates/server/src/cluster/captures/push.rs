//! Pushing captures to the registry: every snapshot, template and (with
//! durable pause) pause capture of this node, and a fork's capture now.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tine_image::chunks::{self, remote};
use tine_image::ImageRef;

use super::{failed, CaptureError, Captures, Record};
use crate::db::{Db, SnapshotKind, SnapshotRow};

impl Captures {
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

    /// The sandbox `row` (a pause capture) is paused on, if it still is.
    fn paused_sandbox(&self, db: &Db, row: &SnapshotRow) -> Option<crate::model::SandboxRecord> {
        if !db.pause_is_current(&row.sandbox_id, &row.id).ok()? {
            return None;
        }
        db.get_sandbox(&row.sandbox_id).ok().flatten()
    }
}
