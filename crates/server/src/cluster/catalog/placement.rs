//! Placement's side of the catalog: reservations held while a create runs,
//! and where each `Idempotency-Key` sends its creates.

use super::{Catalog, Result, IDEMPOTENCY_MS, NOW_MS, RESERVATION_MS};

impl Catalog {
    // ---- placement ----

    /// Reserve room for one sandbox of `team` on `node`, unless the team
    /// already has `team_max` running (or reserved) across the cluster.
    /// One transaction under the team's lock: two gateways placing at once
    /// never exceed the limit. Returns the reservation's id, or `None` when
    /// the team is full.
    pub async fn reserve(
        &self,
        team: &str,
        team_max: Option<usize>,
        node: &str,
    ) -> Result<Option<String>> {
        let id = format!("res_{}", crate::ids::random_hex(8));
        let insert = format!(
            "INSERT INTO tine_reservations (id, team, node_id, expires_ms)
             VALUES ($1, $2, $3, {NOW_MS} + $4)"
        );
        let mut db = self.pool.get().await?;
        // Expired reservations go now and then (they no longer count).
        if crate::ids::random_index(16) == 0 {
            db.execute(
                &format!("DELETE FROM tine_reservations WHERE expires_ms < {NOW_MS}"),
                &[],
            )
            .await?;
        }
        let Some(max) = team_max else {
            // No limit to hold: one statement.
            db.execute(&insert, &[&id, &team, &node, &RESERVATION_MS])
                .await?;
            return Ok(Some(id));
        };
        let tx = db.transaction().await?;
        tx.execute(
            "SELECT pg_advisory_xact_lock(hashtext('tine-team:' || $1))",
            &[&team],
        )
        .await?;
        let used: i64 = tx
            .query_one(
                &format!(
                    "SELECT (SELECT count(*) FROM tine_sandboxes WHERE team = $1 AND state = 'running')
                          + (SELECT count(*) FROM tine_reservations WHERE team = $1 AND expires_ms > {NOW_MS})"
                ),
                &[&team],
            )
            .await?
            .get(0);
        if used.max(0) as usize >= max {
            return Ok(None);
        }
        tx.execute(&insert, &[&id, &team, &node, &RESERVATION_MS])
            .await?;
        tx.commit().await?;
        Ok(Some(id))
    }

    /// The node a create with `Idempotency-Key` `key` goes to: `node` if
    /// the key is new (or its claim expired), else the node the first
    /// attempt went to, whose own idempotency then answers (one sandbox).
    pub async fn claim_idempotency(&self, team: &str, key: &str, node: &str) -> Result<String> {
        let db = self.pool.get().await?;
        let row = db
            .query_one(
                &format!(
                    "INSERT INTO tine_idempotency (team, key, node_id, expires_ms)
                     VALUES ($1, $2, $3, {NOW_MS} + $4)
                     ON CONFLICT (team, key) DO UPDATE SET
                        node_id = CASE WHEN tine_idempotency.expires_ms < {NOW_MS}
                                       THEN excluded.node_id ELSE tine_idempotency.node_id END,
                        expires_ms = CASE WHEN tine_idempotency.expires_ms < {NOW_MS}
                                          THEN excluded.expires_ms ELSE tine_idempotency.expires_ms END
                     RETURNING node_id"
                ),
                &[&team, &key, &node, &IDEMPOTENCY_MS],
            )
            .await?;
        Ok(row.get(0))
    }

    /// Forget the claim of `key` on `node` (its create was refused: a retry
    /// may go elsewhere).
    pub async fn unclaim_idempotency(&self, team: &str, key: &str, node: &str) -> Result<()> {
        let db = self.pool.get().await?;
        db.execute(
            "DELETE FROM tine_idempotency WHERE team = $1 AND key = $2 AND node_id = $3",
            &[&team, &key, &node],
        )
        .await?;
        Ok(())
    }

    /// A reservation whose create failed.
    pub async fn release(&self, reservation: &str) -> Result<()> {
        let db = self.pool.get().await?;
        db.execute(
            "DELETE FROM tine_reservations WHERE id = $1",
            &[&reservation],
        )
        .await?;
        Ok(())
    }
}
