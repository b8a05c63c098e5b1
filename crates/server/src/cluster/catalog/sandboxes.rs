//! The `tine_sandboxes` and `tine_moves` tables: where each sandbox lives
//! and what `list` shows of it, written from nodes' lists and gateways'
//! calls.

use deadpool_postgres::GenericClient;

use super::{Catalog, ListQuery, Result, SandboxRow, NOW_MS};

impl Catalog {
    // ---- sandboxes ----

    /// A node's full list of sandboxes, read at `observed_ms` (taken from
    /// [`Catalog::now_ms`] before the list was read): rows of that node
    /// observed earlier and not in `rows` are removed, the others updated.
    pub async fn publish(&self, node: &str, observed_ms: i64, rows: &[SandboxRow]) -> Result<()> {
        let mut db = self.pool.get().await?;
        let tx = db.transaction().await?;
        for r in rows {
            upsert(&tx, node, Some(observed_ms), r, None).await?;
        }
        let ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
        tx.execute(
            "DELETE FROM tine_sandboxes
              WHERE node_id = $1 AND observed_ms < $2 AND NOT (id = ANY($3))",
            &[&node, &observed_ms, &ids],
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// One sandbox as just read from its node (after a create, fork,
    /// pause, resume or timeout change made through a gateway); drops any
    /// reservation `reservation` held for it. One statement: it is on a
    /// create's path.
    pub async fn put(&self, node: &str, row: &SandboxRow, reservation: Option<&str>) -> Result<()> {
        let db = self.pool.get().await?;
        upsert(&db, node, None, row, reservation).await
    }

    /// A sandbox that is gone (killed, or unknown to its node).
    pub async fn remove(&self, id: &str) -> Result<()> {
        let db = self.pool.get().await?;
        // A tombstone, not a delete: a full list read before the kill must
        // not bring it back. The node's next full list removes it.
        db.execute(
            &format!(
                "UPDATE tine_sandboxes SET state = 'killed', observed_ms = {NOW_MS} WHERE id = $1"
            ),
            &[&id],
        )
        .await?;
        Ok(())
    }

    /// Paused sandbox `id` moved from node `from` to node `to` (which
    /// resumed it from its pushed capture): `from`'s lists no longer
    /// speak for it, and `from` drops it ([`Catalog::moved_away`]).
    pub async fn record_move(&self, id: &str, from: &str, to: &str) -> Result<()> {
        let db = self.pool.get().await?;
        db.execute(
            &format!(
                "INSERT INTO tine_moves (sandbox_id, from_node, to_node, moved_ms)
                 VALUES ($1, $2, $3, {NOW_MS})
                 ON CONFLICT (sandbox_id) DO UPDATE SET from_node = $2, to_node = $3,
                    moved_ms = excluded.moved_ms"
            ),
            &[&id, &from, &to],
        )
        .await?;
        Ok(())
    }

    /// The sandboxes that moved away from node `node`: `(id, to node)`.
    pub async fn moved_away(&self, node: &str) -> Result<Vec<(String, String)>> {
        let db = self.pool.get().await?;
        let rows = db
            .query(
                "SELECT sandbox_id, to_node FROM tine_moves WHERE from_node = $1",
                &[&node],
            )
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// Whether sandbox `id` is paused, as its node last said.
    pub async fn is_paused(&self, id: &str) -> Result<bool> {
        let db = self.pool.get().await?;
        let row = db
            .query_opt(
                "SELECT 1 FROM tine_sandboxes WHERE id = $1 AND state = 'paused'",
                &[&id],
            )
            .await?;
        Ok(row.is_some())
    }

    /// The node and team of a sandbox that is not known to be gone.
    pub async fn locate(&self, id: &str) -> Result<Option<(String, String)>> {
        let db = self.pool.get().await?;
        let row = db
            .query_opt(
                "SELECT node_id, team FROM tine_sandboxes WHERE id = $1 AND state <> 'killed'",
                &[&id],
            )
            .await?;
        Ok(row.map(|r| (r.get(0), r.get(1))))
    }

    /// A page of a team's sandboxes across every node, in the order and
    /// with the paging key the node's own list uses.
    pub async fn list(&self, q: &ListQuery) -> Result<Vec<SandboxRow>> {
        let db = self.pool.get().await?;
        let mut sql = String::from(
            // (The node rides along in the detail, as `GET
            // /sandboxes/{id}` through a gateway names it.)
            "SELECT id, team, state, template_id, started_ms, metadata,
                    detail || jsonb_build_object('nodeID', node_id)
               FROM tine_sandboxes WHERE team = $1 AND state = ANY($2)",
        );
        let metadata = serde_json::to_value(&q.metadata).unwrap_or_default();
        let mut args: Vec<Box<dyn tokio_postgres::types::ToSql + Sync + Send>> =
            vec![Box::new(q.team.clone()), Box::new(q.states.clone())];
        let mut arg =
            |sql: &mut String,
             clause: &str,
             v: Box<dyn tokio_postgres::types::ToSql + Sync + Send>| {
                args.push(v);
                *sql += &clause.replace("$?", &format!("${}", args.len()));
            };
        if !q.metadata.is_empty() {
            arg(&mut sql, " AND metadata @> $?", Box::new(metadata));
        }
        if !q.down_nodes.is_empty() {
            arg(
                &mut sql,
                " AND NOT (node_id = ANY($?))",
                Box::new(q.down_nodes.clone()),
            );
        }
        if let Some(t) = &q.template {
            arg(&mut sql, " AND template_id = $?", Box::new(t.clone()));
        }
        if let Some(ms) = q.started_after_ms {
            arg(&mut sql, " AND started_ms >= $?", Box::new(ms));
        }
        if let Some(ms) = q.started_before_ms {
            arg(&mut sql, " AND started_ms < $?", Box::new(ms));
        }
        let dir = if q.descending { "DESC" } else { "ASC" };
        if let Some((ms, id)) = &q.after {
            let op = if q.descending { "<" } else { ">" };
            arg(
                &mut sql,
                &format!(" AND (started_ms, id) {op} ($?"),
                Box::new(*ms),
            );
            arg(&mut sql, ", $?)", Box::new(id.clone()));
        }
        let limit = q.limit.min(i64::MAX as usize) as i64;
        arg(
            &mut sql,
            &format!(" ORDER BY started_ms {dir}, id {dir} LIMIT $?"),
            Box::new(limit),
        );
        let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
            args.iter().map(|a| a.as_ref() as _).collect();
        let rows = db.query(&sql, &params).await?;
        Ok(rows.iter().map(row_of).collect())
    }
}

fn row_of(r: &tokio_postgres::Row) -> SandboxRow {
    SandboxRow {
        id: r.get(0),
        team: r.get(1),
        state: r.get(2),
        template_id: r.get(3),
        started_ms: r.get(4),
        metadata: serde_json::from_value(r.get(5)).unwrap_or_default(),
        detail: r.get(6),
    }
}

/// Write one sandbox row, observed at `observed_ms` (`None`: now, by
/// PostgreSQL's clock), unless the row holds a later observation; drops
/// `reservation` in the same statement.
async fn upsert(
    db: &impl GenericClient,
    node: &str,
    observed_ms: Option<i64>,
    r: &SandboxRow,
    reservation: Option<&str>,
) -> Result<()> {
    let metadata = serde_json::to_value(&r.metadata).unwrap_or_default();
    db.execute(
        &format!(
            "WITH released AS (DELETE FROM tine_reservations WHERE id = $10)
             INSERT INTO tine_sandboxes
                (id, node_id, team, state, template_id, started_ms, metadata, detail, observed_ms)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, COALESCE($9, {NOW_MS}))
             ON CONFLICT (id) DO UPDATE SET
                node_id = $2, team = $3, state = $4, template_id = $5, started_ms = $6,
                metadata = $7, detail = $8, observed_ms = excluded.observed_ms
             WHERE tine_sandboxes.observed_ms <= excluded.observed_ms
               AND NOT EXISTS (SELECT 1 FROM tine_moves
                                WHERE sandbox_id = $1 AND from_node = $2)"
        ),
        &[
            &r.id,
            &node,
            &r.team,
            &r.state,
            &r.template_id,
            &r.started_ms,
            &metadata,
            &r.detail,
            &observed_ms,
            &reservation.unwrap_or(""),
        ],
    )
    .await?;
    Ok(())
}
