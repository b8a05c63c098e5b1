//! The `tine_nodes` table: nodes, their heartbeats and what they hold.

use super::{Catalog, CatalogError, Node, NodeStatus, Result, NOW_MS};

impl Catalog {
    // ---- nodes ----

    pub async fn heartbeat(&self, node: &str, status: &NodeStatus) -> Result<()> {
        let db = self.pool.get().await?;
        let json = serde_json::to_value(status).map_err(|e| CatalogError::Query(e.to_string()))?;
        db.execute(
            &format!(
                "INSERT INTO tine_nodes (id, status, heartbeat_ms) VALUES ($1, $2, {NOW_MS})
                 ON CONFLICT (id) DO UPDATE SET status = $2, heartbeat_ms = {NOW_MS}"
            ),
            &[&node, &json],
        )
        .await?;
        Ok(())
    }

    /// Add `templates` to what node `node` holds, ahead of its next
    /// heartbeat (which lists them too): a snapshot taken through a gateway
    /// can be created from at once, through any gateway.
    pub async fn add_templates(&self, node: &str, templates: &[String]) -> Result<()> {
        let db = self.pool.get().await?;
        let json =
            serde_json::to_value(templates).map_err(|e| CatalogError::Query(e.to_string()))?;
        db.execute(
            "UPDATE tine_nodes SET status = jsonb_set(status, '{templates}',
                 COALESCE(status->'templates', '[]'::jsonb) || $2::jsonb)
             WHERE id = $1",
            &[&node, &json],
        )
        .await?;
        Ok(())
    }

    /// Every node that ever registered, with its reservations.
    pub async fn nodes(&self) -> Result<Vec<Node>> {
        let db = self.pool.get().await?;
        let rows = db
            .query(
                &format!(
                    "SELECT n.id, n.status, {NOW_MS} - n.heartbeat_ms,
                        (SELECT count(*) FROM tine_reservations r
                          WHERE r.node_id = n.id AND r.expires_ms > {NOW_MS}),
                        (SELECT count(*) FROM tine_sandboxes s
                          WHERE s.node_id = n.id AND s.state = 'running')
                     FROM tine_nodes n ORDER BY n.id"
                ),
                &[],
            )
            .await?;
        Ok(rows
            .iter()
            .filter_map(|r| {
                Some(Node {
                    id: r.get(0),
                    status: serde_json::from_value(r.get(1)).ok()?,
                    silent_ms: r.get(2),
                    reserved: r.get::<_, i64>(3).max(0) as usize,
                    placed: r.get::<_, i64>(4).max(0) as usize,
                })
            })
            .collect())
    }

    /// Remove a node and everything the catalog holds of it (a host taken
    /// out of the cluster for good; its sandboxes are not reachable).
    pub async fn forget_node(&self, node: &str) -> Result<()> {
        let mut db = self.pool.get().await?;
        let tx = db.transaction().await?;
        for table in ["tine_sandboxes", "tine_reservations", "tine_idempotency"] {
            tx.execute(&format!("DELETE FROM {table} WHERE node_id = $1"), &[&node])
                .await?;
        }
        tx.execute("DELETE FROM tine_nodes WHERE id = $1", &[&node])
            .await?;
        tx.commit().await?;
        Ok(())
    }
}
