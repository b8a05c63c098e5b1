//! The catalog's `tine_captures` table: what was pushed, found by id,
//! name or sandbox, and forgotten into the trash.

use super::super::catalog::{Catalog, CatalogError};
use super::{failed, CaptureError, Captures, Listed, Record};

impl Captures {
    /// Forget capture `id` (its snapshot was deleted here): no node pulls
    /// it again. Failures only log (the gateway forgets it too).
    pub async fn forget(&self, id: &str) {
        if let Err(e) = forget(&self.catalog, id).await {
            tracing::warn!(snapshot = id, "forgetting the capture in the catalog: {e}");
        }
    }

    // ---- the catalog's table ----

    pub(super) async fn put(
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
    pub(super) async fn find(
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
    pub(super) async fn find_pause(
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
    pub(super) async fn pushed_here(&self) -> Result<Vec<(String, Option<String>)>, CatalogError> {
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

    pub(super) async fn names(&self, id: &str) -> Result<Vec<String>, CaptureError> {
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
/// registry once no node reads it lazily ([`crate::cluster::trash`]).
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
