//! Durable state in one SQLite file: sandboxes, API keys, events.
//!
//! One connection behind a mutex: every statement here is a point lookup
//! or a small write (WAL mode, `synchronous=NORMAL`), far shorter than any
//! VM operation, and SQLite serializes writers anyway. The CLI (`tine
//! keys`) opens the same file while the server runs; `busy_timeout` makes
//! the two wait for each other instead of failing.

mod builds;
mod events;
mod images;
mod keys;
mod sandboxes;
mod secrets;
mod snapshots;
mod volumes;

use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use rusqlite::Connection;

pub use builds::{BuildRow, BuildStatus};
pub use events::Event;
pub use images::ANY_TEAM;
pub use keys::{hash as key_hash, new_key_plaintext, valid_team, ApiKey, NewKey, DEFAULT_TEAM};
pub use sandboxes::{ListFilter, TeamUsage};
pub use secrets::SecretRow;
pub use snapshots::{SnapshotKind, SnapshotRow};
pub use volumes::VolumeRow;

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("database {path}: {source}")]
    Open {
        path: String,
        source: rusqlite::Error,
    },
    #[error("database: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error("database holds a corrupt value in {0}")]
    Corrupt(String),
    /// A bug: a state change the sandbox lifecycle does not have.
    #[error("sandbox {id}: the lifecycle has no transition {from} -> {to}")]
    Transition {
        id: String,
        from: &'static str,
        to: &'static str,
    },
}

pub type Result<T> = std::result::Result<T, DbError>;

pub struct Db {
    conn: Mutex<Connection>,
    /// Woken when a sandbox's state or times change or a snapshot is
    /// taken: a cluster node publishes its list and what it holds then,
    /// not only on its timer.
    changed: tokio::sync::watch::Sender<u64>,
}

/// Schema migrations, applied in order; `user_version` counts those done.
const MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE sandboxes (
    id                TEXT PRIMARY KEY,
    template_id       TEXT NOT NULL,
    alias             TEXT,
    client_id         TEXT NOT NULL,
    state             TEXT NOT NULL,
    metadata          TEXT NOT NULL,
    env_vars          TEXT NOT NULL,
    cpu_count         INTEGER NOT NULL,
    memory_mb         INTEGER NOT NULL,
    disk_size_mb      INTEGER NOT NULL,
    envd_version      TEXT NOT NULL,
    envd_access_token TEXT NOT NULL,
    started_at_ms     INTEGER NOT NULL,
    end_at_ms         INTEGER NOT NULL,
    auto_pause        INTEGER NOT NULL,
    error             TEXT
);
CREATE INDEX sandboxes_by_state ON sandboxes (state, started_at_ms, id);
CREATE TABLE api_keys (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    hash        TEXT NOT NULL UNIQUE,
    prefix      TEXT NOT NULL,
    created_ms  INTEGER NOT NULL,
    revoked_ms  INTEGER
);
CREATE TABLE events (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id  TEXT NOT NULL,
    at_ms       INTEGER NOT NULL,
    kind        TEXT NOT NULL,
    detail      TEXT NOT NULL
);
CREATE INDEX events_by_sandbox ON events (sandbox_id, seq);
"#,
    r#"
ALTER TABLE sandboxes ADD COLUMN snapshot_id TEXT;
CREATE TABLE snapshots (
    id            TEXT PRIMARY KEY,
    kind          TEXT NOT NULL,
    sandbox_id    TEXT NOT NULL,
    parent_id     TEXT,
    names         TEXT NOT NULL,
    template_id   TEXT NOT NULL,
    cpu_count     INTEGER NOT NULL,
    memory_mb     INTEGER NOT NULL,
    source_token  TEXT NOT NULL,
    created_ms    INTEGER NOT NULL,
    deleted_ms    INTEGER
);
CREATE INDEX snapshots_by_parent ON snapshots (parent_id);
"#,
    r#"
CREATE TABLE builds (
    id             TEXT PRIMARY KEY,
    template       TEXT NOT NULL,
    status         TEXT NOT NULL,
    reason         TEXT,
    reason_step    TEXT,
    tags           TEXT NOT NULL,
    cpu_count      INTEGER NOT NULL,
    memory_mb      INTEGER NOT NULL,
    snapshot_id    TEXT,
    build_key      TEXT,
    created_ms     INTEGER NOT NULL,
    finished_ms    INTEGER
);
CREATE INDEX builds_by_template ON builds (template, created_ms);
CREATE TABLE template_tags (
    template     TEXT NOT NULL,
    tag          TEXT NOT NULL,
    snapshot_id  TEXT NOT NULL,
    build_id     TEXT NOT NULL,
    created_ms   INTEGER NOT NULL,
    PRIMARY KEY (template, tag)
);
"#,
    r#"
ALTER TABLE snapshots ADD COLUMN used_ms INTEGER;
"#,
    r#"
ALTER TABLE sandboxes ADD COLUMN network TEXT NOT NULL DEFAULT '{}';
ALTER TABLE sandboxes ADD COLUMN traffic_token TEXT;
"#,
    r#"
ALTER TABLE sandboxes ADD COLUMN lifecycle TEXT NOT NULL DEFAULT '{}';
"#,
    r#"
ALTER TABLE api_keys ADD COLUMN team TEXT NOT NULL DEFAULT 'default';
ALTER TABLE sandboxes ADD COLUMN team TEXT NOT NULL DEFAULT 'default';
ALTER TABLE builds ADD COLUMN team TEXT;
CREATE INDEX sandboxes_by_team ON sandboxes (team, state);
"#,
    r#"
ALTER TABLE sandboxes ADD COLUMN intent TEXT;
"#,
    // Captures made on another host of a cluster and pulled from its
    // registry: their sandbox is not here, so their team is kept here.
    r#"
CREATE TABLE imported_snapshots (
    id          TEXT PRIMARY KEY,
    team        TEXT NOT NULL,
    imported_ms INTEGER NOT NULL
);
"#,
    // Volumes (crate::volumes): a name is its team's.
    r#"
CREATE TABLE volumes (
    id          TEXT PRIMARY KEY,
    team        TEXT NOT NULL,
    name        TEXT NOT NULL,
    token       TEXT NOT NULL,
    created_ms  INTEGER NOT NULL,
    max_bytes   INTEGER NOT NULL,
    UNIQUE (team, name)
);
"#,
    // The volumes mounted into each sandbox (JSON list of VolumeMount).
    r#"
ALTER TABLE sandboxes ADD COLUMN volume_mounts TEXT NOT NULL DEFAULT '[]';
"#,
    // Workload identity tokens of each sandbox (JSON map, crate::identity).
    r#"
ALTER TABLE sandboxes ADD COLUMN iam TEXT NOT NULL DEFAULT '{}';
"#,
    // Secrets (crate::secrets): the current version, sealed.
    r#"
CREATE TABLE secrets (
    id          TEXT PRIMARY KEY,
    team        TEXT NOT NULL,
    name        TEXT NOT NULL,
    version     INTEGER NOT NULL,
    metadata    TEXT NOT NULL,
    nonce       BLOB NOT NULL,
    sealed      BLOB NOT NULL,
    created_ms  INTEGER NOT NULL,
    updated_ms  INTEGER NOT NULL,
    UNIQUE (team, name)
);
"#,
    // Which teams may use the local copy of an image (db::images).
    r#"
CREATE TABLE image_access (
    digest  TEXT NOT NULL,
    team    TEXT NOT NULL,
    PRIMARY KEY (digest, team)
);
"#,
];

impl Db {
    pub fn open(path: &Path) -> Result<Self> {
        let open_err = |source| DbError::Open {
            path: path.display().to_string(),
            source,
        };
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let conn = Connection::open(path).map_err(open_err)?;
        // The database holds access tokens: tine's alone.
        for suffix in ["", "-wal", "-shm"] {
            let mut name = path.as_os_str().to_owned();
            name.push(suffix);
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&name, std::fs::Permissions::from_mode(0o600));
        }
        conn.busy_timeout(std::time::Duration::from_secs(10))
            .map_err(open_err)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(open_err)?;
        conn.pragma_update(None, "synchronous", "NORMAL")
            .map_err(open_err)?;
        conn.pragma_update(None, "foreign_keys", "ON")
            .map_err(open_err)?;
        let db = Self {
            conn: Mutex::new(conn),
            changed: tokio::sync::watch::Sender::new(0),
        };
        db.migrate()?;
        Ok(db)
    }

    fn migrate(&self) -> Result<()> {
        let mut conn = self.conn();
        let done: usize = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        for (i, sql) in MIGRATIONS.iter().enumerate().skip(done) {
            let tx = conn.transaction()?;
            tx.execute_batch(sql)?;
            tx.pragma_update(None, "user_version", i + 1)?;
            tx.commit()?;
        }
        Ok(())
    }

    /// Changes after a sandbox's state or times change or a snapshot is
    /// taken: every subscriber sees them; a burst is seen once.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    fn note_change(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn conn(&self) -> MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
