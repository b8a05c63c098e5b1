//! The cluster's catalog in PostgreSQL: nodes and their heartbeats, where
//! each sandbox lives (with what `list` shows of it), reservations that
//! placement holds while a create is under way, and API keys.
//!
//! Times are PostgreSQL's own clock (`clock_timestamp()`, in ms), so the
//! hosts' clocks never need to agree. A row about a sandbox changes only
//! to information observed later than what it holds (`observed_ms`): a
//! node's periodic full list, read before a gateway's write, cannot undo
//! that write.
//!
//! The parts: the schema and the connection here; `nodes` (heartbeats),
//! `sandboxes` (full lists, single rows, moves, lookups and lists),
//! `placement` (reservations and `Idempotency-Key` claims) and `keys`
//! (API keys).

mod keys;
mod nodes;
mod placement;
mod sandboxes;

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
}
