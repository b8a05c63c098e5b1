//! The cluster's catalog in PostgreSQL: nodes and their heartbeats, where
//! each sandbox lives (with what `list` shows of it), reservations that
//! placement holds while a create is under way, and API keys.
//!
//! Times are PostgreSQL's own clock (`clock_timestamp()`, in ms), so the
//! hosts' clocks never need to agree. A row about a sandbox changes only
//! to information observed later than what it holds (`observed_ms`): a
//! node's periodic full list, read before a gateway's write, cannot undo
//! that write.

use std::collections::BTreeMap;

use deadpool_postgres::{GenericClient, Pool};
use serde::{Deserialize, Serialize};

/// PostgreSQL's clock, in Unix milliseconds.
pub(super) const NOW_MS: &str = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

/// How long a placement's reservation holds room on a node and in a team
/// while its create runs (a create that outlives it is still published by
/// its node).
pub const RESERVATION_MS: i64 = 120_000;

/// How long an `Idempotency-Key` keeps sending its creates to one node (as
/// long as a node remembers it).
pub const IDEMPOTENCY_MS: i64 = 24 * 3600 * 1000;

#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error("the cluster database is unreachable: {0}")]
    Unavailable(String),
    #[error("cluster database: {0}")]
    Query(String),
}

impl From<deadpool_postgres::PoolError> for CatalogError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        CatalogError::Unavailable(e.to_string())
    }
}

impl From<tokio_postgres::Error> for CatalogError {
    fn from(e: tokio_postgres::Error) -> Self {
        if e.is_closed() || e.as_db_error().is_none() {
            CatalogError::Unavailable(e.to_string())
        } else {
            CatalogError::Query(e.to_string())
        }
    }
}

pub type Result<T> = std::result::Result<T, CatalogError>;

/// What a node reports at each heartbeat.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct NodeStatus {
    /// Where gateways reach its API and proxy (`http://host:port`).
    pub address: String,
    pub cores: usize,
    /// Sandboxes it admits (its own admission model), and how many run.
    pub capacity: usize,
    pub live: usize,
    pub memory_free_mb: u64,
    pub disk_free_mb: u64,
    /// Templates and snapshots it holds, by id and by name.
    pub templates: Vec<String>,
    pub version: String,
}

/// A node as the catalog knows it.
#[derive(Debug, Clone)]
pub struct Node {
    pub id: String,
    pub status: NodeStatus,
    /// Since its last heartbeat, by PostgreSQL's clock.
    pub silent_ms: i64,
    /// Creates placed on it and not yet published.
    pub reserved: usize,
    /// Running sandboxes the catalog places on it (ahead of its next
    /// heartbeat's `live`).
    pub placed: usize,
}

/// What the catalog keeps of one sandbox.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRow {
    pub id: String,
    pub team: String,
    /// `running` or `paused` (what `list` shows).
    pub state: String,
    pub template_id: String,
    pub started_ms: i64,
    pub metadata: BTreeMap<String, String>,
    /// The sandbox as `GET /v2/sandboxes` shows it (no secrets).
    pub detail: serde_json::Value,
}

/// Filters of a list, as the node's own list takes them.
#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    pub team: String,
    pub states: Vec<String>,
    pub metadata: BTreeMap<String, String>,
    pub template: Option<String>,
    pub started_after_ms: Option<i64>,
    pub started_before_ms: Option<i64>,
    pub after: Option<(i64, String)>,
    pub descending: bool,
    pub limit: usize,
    /// Nodes whose sandboxes are not shown (down for longer than the grace).
    pub down_nodes: Vec<String>,
}

/// An API key of the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterKey {
    pub id: String,
    pub name: String,
    pub team: String,
}

#[derive(Clone)]
pub struct Catalog {
    pub(super) pool: Pool,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS tine_nodes (
    id TEXT PRIMARY KEY,
    status JSONB NOT NULL,
    heartbeat_ms BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS tine_sandboxes (
    id TEXT PRIMARY KEY,
    node_id TEXT NOT NULL,
    team TEXT NOT NULL,
    state TEXT NOT NULL,
    template_id TEXT NOT NULL,
    started_ms BIGINT NOT NULL,
    metadata JSONB NOT NULL,
    detail JSONB NOT NULL,
    observed_ms BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS tine_sandboxes_team ON tine_sandboxes (team, started_ms, id);
CREATE INDEX IF NOT EXISTS tine_sandboxes_node ON tine_sandboxes (node_id);
CREATE TABLE IF NOT EXISTS tine_reservations (
    id TEXT PRIMARY KEY,
    team TEXT NOT NULL,
    node_id TEXT NOT NULL,
    expires_ms BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS tine_idempotency (
    team TEXT NOT NULL,
    key TEXT NOT NULL,
    node_id TEXT NOT NULL,
    expires_ms BIGINT NOT NULL,
    PRIMARY KEY (team, key)
);
CREATE TABLE IF NOT EXISTS tine_captures (
    id TEXT PRIMARY KEY,
    team TEXT NOT NULL,
    names JSONB NOT NULL,
    node_id TEXT NOT NULL,
    record JSONB NOT NULL,
    pushed_ms BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS tine_moves (
    sandbox_id TEXT PRIMARY KEY,
    from_node TEXT NOT NULL,
    to_node TEXT NOT NULL,
    moved_ms BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS tine_moves_from ON tine_moves (from_node);
CREATE TABLE IF NOT EXISTS tine_capture_trash (
    id TEXT PRIMARY KEY,
    record JSONB NOT NULL,
    forgotten_ms BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS tine_lazy_readers (
    node_id TEXT NOT NULL,
    capture TEXT NOT NULL,
    PRIMARY KEY (node_id, capture)
);
CREATE INDEX IF NOT EXISTS tine_lazy_readers_capture ON tine_lazy_readers (capture);
CREATE TABLE IF NOT EXISTS tine_volumes (
    id TEXT PRIMARY KEY,
    team TEXT NOT NULL,
    name TEXT NOT NULL,
    node_id TEXT NOT NULL,
    created_ms BIGINT NOT NULL,
    UNIQUE (team, name)
);
CREATE TABLE IF NOT EXISTS tine_secrets (
    id TEXT PRIMARY KEY,
    team TEXT NOT NULL,
    name TEXT NOT NULL,
    version BIGINT NOT NULL,
    metadata TEXT NOT NULL,
    nonce BYTEA NOT NULL,
    sealed BYTEA NOT NULL,
    created_ms BIGINT NOT NULL,
    updated_ms BIGINT NOT NULL,
    UNIQUE (team, name)
);
CREATE TABLE IF NOT EXISTS tine_secrets_key (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    fingerprint TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS tine_api_keys (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    prefix TEXT NOT NULL,
    hash TEXT NOT NULL UNIQUE,
    team TEXT NOT NULL,
    created_ms BIGINT NOT NULL,
    revoked_ms BIGINT
);
";

/// The advisory lock that serializes schema creation across processes.
const SCHEMA_LOCK: i64 = 0x7469_6e65_0001;

impl Catalog {
    /// A pool of connections to `url` (a libpq URL or key=value string);
    /// creates the schema when missing. Fails when PostgreSQL cannot be
    /// reached now; later outages are reported per call.
    pub async fn connect(url: &str) -> Result<Self> {
        let pg: tokio_postgres::Config = url
            .parse()
            .map_err(|e| CatalogError::Query(format!("postgres_url: {e}")))?;
        let manager = deadpool_postgres::Manager::from_config(
            pg,
            tokio_postgres::NoTls,
            deadpool_postgres::ManagerConfig {
                recycling_method: deadpool_postgres::RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(16)
            .wait_timeout(Some(std::time::Duration::from_secs(5)))
            .create_timeout(Some(std::time::Duration::from_secs(5)))
            .recycle_timeout(Some(std::time::Duration::from_secs(5)))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(|e| CatalogError::Query(e.to_string()))?;
        let c = Catalog { pool };
        c.migrate().await?;
        Ok(c)
    }

    async fn migrate(&self) -> Result<()> {
        let mut db = self.pool.get().await?;
        let tx = db.transaction().await?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK])
            .await?;
        // No NOTICE for every table that exists already.
        tx.batch_execute("SET LOCAL client_min_messages = warning")
            .await?;
        tx.batch_execute(SCHEMA).await?;
        tx.commit().await?;
        Ok(())
    }

    /// PostgreSQL's clock now, in Unix ms.
    pub async fn now_ms(&self) -> Result<i64> {
        let db = self.pool.get().await?;
        let row = db.query_one(&format!("SELECT {NOW_MS}"), &[]).await?;
        Ok(row.get(0))
    }

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

    // ---- keys ----

    pub async fn create_key(&self, name: &str, team: &str) -> Result<(ClusterKey, String)> {
        let plaintext = crate::db::new_key_plaintext();
        let key = ClusterKey {
            id: format!("key_{}", crate::ids::random_hex(6)),
            name: name.to_string(),
            team: team.to_string(),
        };
        let prefix = plaintext[..12.min(plaintext.len())].to_string();
        let db = self.pool.get().await?;
        db.execute(
            &format!(
                "INSERT INTO tine_api_keys (id, name, prefix, hash, team, created_ms)
                 VALUES ($1, $2, $3, $4, $5, {NOW_MS})"
            ),
            &[
                &key.id,
                &key.name,
                &prefix,
                &crate::db::key_hash(&plaintext),
                &key.team,
            ],
        )
        .await?;
        Ok((key, plaintext))
    }

    /// Revoke key `id`; false if there is no such key.
    pub async fn revoke_key(&self, id: &str) -> Result<bool> {
        let db = self.pool.get().await?;
        let n = db
            .execute(
                &format!("UPDATE tine_api_keys SET revoked_ms = {NOW_MS} WHERE id = $1 AND revoked_ms IS NULL"),
                &[&id],
            )
            .await?;
        Ok(n > 0)
    }

    pub async fn verify_key(&self, plaintext: &str) -> Result<Option<ClusterKey>> {
        let db = self.pool.get().await?;
        let row = db
            .query_opt(
                "SELECT id, name, team FROM tine_api_keys WHERE hash = $1 AND revoked_ms IS NULL",
                &[&crate::db::key_hash(plaintext)],
            )
            .await?;
        Ok(row.map(|r| ClusterKey {
            id: r.get(0),
            name: r.get(1),
            team: r.get(2),
        }))
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
