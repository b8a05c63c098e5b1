//! Captures forgotten in the catalog, removed from the registry.
//!
//! Forgetting a capture ([`super::captures::forget`]: its snapshot or
//! template deleted, a pause capture whose sandbox resumed, a fork
//! capture whose children started) moves its row to
//! `tine_capture_trash`. A node that reads a capture lazily keeps needing
//! its chunks in the registry for the pages its sandboxes have not touched
//! yet, so every node records the captures its image daemon has
//! registered (`tine_lazy_readers`, refreshed every [`EVERY`]; the daemon
//! forgets one once its snapshot is gone and no VM maps it). Every node
//! empties the trash: a capture that no node reads any more has its
//! manifests removed from the registry, with its chunks that no other
//! artifact of the repository names ([`tine_image::chunks::prune`]).
//! Several nodes may try one capture at once; the one whose claim (the
//! row's delete) succeeds removes it. A removal that fails goes back to
//! the trash and is tried again after [`RETRY`].

use std::sync::Arc;
use std::time::Duration;

use tine_image::ImageRef;

use super::captures::{Captures, Record};
use super::catalog::CatalogError;

/// How often a node refreshes its readers and looks at the trash.
pub const EVERY: Duration = Duration::from_secs(10);
/// How long a removal that failed waits before the next try.
const RETRY: Duration = Duration::from_secs(300);
/// How long a forgotten capture stays in the trash at least (a pull in
/// flight records its reader within it).
const GRACE: Duration = Duration::from_secs(30);
/// Captures removed per round at most.
const BATCH: i64 = 8;

impl Captures {
    /// Refresh this node's lazy readers and empty the trash, forever.
    pub async fn empty_trash(self: Arc<Self>) {
        loop {
            tokio::time::sleep(EVERY).await;
            if let Err(e) = self.note_readers().await {
                tracing::warn!("recording the captures read lazily here: {e}");
                continue;
            }
            match self.take_out().await {
                Ok(0) => {}
                Ok(n) => tracing::info!(captures = n, "captures removed from the registry"),
                Err(e) => tracing::warn!("emptying the capture trash: {e}"),
            }
        }
    }

    /// Record that this node reads capture `id` lazily (at its pull,
    /// before the capture can be forgotten).
    pub(super) async fn note_reader(&self, id: &str) -> Result<(), CatalogError> {
        let db = self.catalog.pool.get().await?;
        db.execute(
            "INSERT INTO tine_lazy_readers (node_id, capture) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            &[&self.node, &id],
        )
        .await?;
        Ok(())
    }

    /// Record in the catalog the captures this node's image daemon has
    /// registered, and only those.
    async fn note_readers(&self) -> Result<(), CatalogError> {
        let mine = tine_image::lazy::registered(&self.paths.data_dir);
        let db = self.catalog.pool.get().await?;
        db.execute(
            "DELETE FROM tine_lazy_readers WHERE node_id = $1 AND NOT (capture = ANY($2))",
            &[&self.node, &mine],
        )
        .await?;
        db.execute(
            "INSERT INTO tine_lazy_readers (node_id, capture)
             SELECT $1, unnest($2::text[]) ON CONFLICT DO NOTHING",
            &[&self.node, &mine],
        )
        .await?;
        Ok(())
    }

    /// Remove from the registry the trashed captures no node reads; how
    /// many were removed.
    async fn take_out(&self) -> Result<usize, CatalogError> {
        let db = self.catalog.pool.get().await?;
        let rows = db
            .query(
                "SELECT id, record FROM tine_capture_trash t
                 WHERE forgotten_ms <= (extract(epoch from clock_timestamp()) * 1000)::bigint - $2
                   AND NOT EXISTS (SELECT 1 FROM tine_lazy_readers r WHERE r.capture = t.id)
                 ORDER BY forgotten_ms LIMIT $1",
                &[&BATCH, &(GRACE.as_millis() as i64)],
            )
            .await?;
        let mut removed = 0;
        for row in rows {
            let id: String = row.get(0);
            let value: serde_json::Value = row.get(1);
            // Claimed by the first node whose delete finds it.
            let claimed = db
                .execute("DELETE FROM tine_capture_trash WHERE id = $1", &[&id])
                .await?
                > 0;
            if !claimed {
                continue;
            }
            match self.remove(&id, &value).await {
                Ok(r) => {
                    removed += 1;
                    tracing::info!(
                        capture = %id,
                        manifests = r.manifests,
                        chunks = r.blobs,
                        shared = r.kept,
                        "capture removed from the registry"
                    );
                }
                Err(e) => {
                    tracing::warn!(capture = %id, "removing the capture from the registry (again in {RETRY:?}): {e}");
                    db.execute(
                        "INSERT INTO tine_capture_trash (id, record, forgotten_ms)
                         VALUES ($1, $2, (extract(epoch from clock_timestamp()) * 1000)::bigint + $3)
                         ON CONFLICT (id) DO NOTHING",
                        &[&id, &value, &(RETRY.as_millis() as i64)],
                    )
                    .await?;
                }
            }
        }
        Ok(removed)
    }

    /// Remove capture `id`'s artifacts (named in its `record`).
    async fn remove(
        &self,
        id: &str,
        record: &serde_json::Value,
    ) -> Result<tine_image::chunks::prune::Removed, String> {
        let record: Record =
            serde_json::from_value(record.clone()).map_err(|e| format!("its record: {e}"))?;
        let refs: Vec<ImageRef> = record
            .files
            .values()
            .map(|a| ImageRef::parse(a).map_err(|e| e.to_string()))
            .collect::<Result<_, _>>()?;
        let Some(repo) = refs.first() else {
            return Ok(Default::default());
        };
        let tags: Vec<String> = refs
            .iter()
            .filter_map(|r| r.oci().tag().map(str::to_string))
            .collect();
        if refs
            .iter()
            .any(|r| r.oci().repository() != repo.oci().repository())
        {
            return Err(format!(
                "capture {id}: its files are in several repositories"
            ));
        }
        tine_image::chunks::prune::remove_tags(repo, &tags, &self.opts)
            .await
            .map_err(|e| e.to_string())
    }
}
