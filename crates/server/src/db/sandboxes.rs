//! The `sandboxes` table.

use std::collections::BTreeMap;

use rusqlite::{params, OptionalExtension, Row};

use super::{Db, DbError, Result};
use crate::model::{SandboxRecord, SandboxState};

const COLUMNS: &str =
    "id, template_id, alias, client_id, state, metadata, env_vars, cpu_count, memory_mb, \
     disk_size_mb, envd_version, envd_access_token, started_at_ms, end_at_ms, auto_pause, error, \
     network, traffic_token, lifecycle, team, volume_mounts, iam";

fn from_row(row: &Row<'_>) -> rusqlite::Result<std::result::Result<SandboxRecord, DbError>> {
    let state: String = row.get(4)?;
    let metadata: String = row.get(5)?;
    let env_vars: String = row.get(6)?;
    let network: String = row.get(16)?;
    let lifecycle: String = row.get(18)?;
    let volume_mounts: String = row.get(20)?;
    let iam: String = row.get(21)?;
    let id: String = row.get(0)?;
    let parse_map = |s: &str, what: &str| {
        serde_json::from_str::<BTreeMap<String, String>>(s)
            .map_err(|_| DbError::Corrupt(format!("{what} of {id}")))
    };
    let build = || -> std::result::Result<SandboxRecord, DbError> {
        Ok(SandboxRecord {
            id: id.clone(),
            template_id: row.get(1)?,
            alias: row.get(2)?,
            client_id: row.get(3)?,
            state: SandboxState::parse(&state)
                .ok_or_else(|| DbError::Corrupt(format!("state of {id}")))?,
            metadata: parse_map(&metadata, "metadata")?,
            env_vars: parse_map(&env_vars, "env_vars")?,
            cpu_count: row.get(7)?,
            memory_mb: row.get(8)?,
            disk_size_mb: row.get(9)?,
            envd_version: row.get(10)?,
            envd_access_token: row.get(11)?,
            started_at_ms: row.get(12)?,
            end_at_ms: row.get(13)?,
            auto_pause: row.get(14)?,
            error: row.get(15)?,
            network: serde_json::from_str(&network)
                .map_err(|_| DbError::Corrupt(format!("network of {id}")))?,
            traffic_token: row.get(17)?,
            lifecycle: serde_json::from_str(&lifecycle)
                .map_err(|_| DbError::Corrupt(format!("lifecycle of {id}")))?,
            team: row.get(19)?,
            volume_mounts: serde_json::from_str(&volume_mounts)
                .map_err(|_| DbError::Corrupt(format!("volume_mounts of {id}")))?,
            iam: serde_json::from_str(&iam)
                .map_err(|_| DbError::Corrupt(format!("iam of {id}")))?,
        })
    };
    Ok(build())
}

/// Which sandboxes `list` returns, in `(started_at, id)` order.
#[derive(Debug, Default, Clone)]
pub struct ListFilter {
    pub states: Vec<SandboxState>,
    pub metadata: BTreeMap<String, String>,
    pub template: Option<String>,
    /// Only this team's sandboxes.
    pub team: Option<String>,
    pub started_after_ms: Option<i64>,
    pub started_before_ms: Option<i64>,
    /// Continue after this `(started_at_ms, id)` (the paging token).
    pub after: Option<(i64, String)>,
    pub descending: bool,
    pub limit: usize,
}

/// What one team's running (and starting) sandboxes hold.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TeamUsage {
    pub sandboxes: u64,
    pub vcpus: u64,
    pub memory_mb: u64,
}

impl Db {
    /// The team a sandbox belongs to (`None`: no such sandbox).
    pub fn sandbox_team(&self, id: &str) -> Result<Option<String>> {
        Ok(self
            .conn()
            .query_row("SELECT team FROM sandboxes WHERE id = ?1", [id], |r| {
                r.get(0)
            })
            .optional()?)
    }

    pub fn team_usage(&self, team: &str) -> Result<TeamUsage> {
        Ok(self.conn().query_row(
            "SELECT COUNT(*), COALESCE(SUM(cpu_count), 0), COALESCE(SUM(memory_mb), 0) \
             FROM sandboxes WHERE team = ?1 AND state IN ('starting', 'running')",
            [team],
            |r| {
                Ok(TeamUsage {
                    sandboxes: r.get::<_, i64>(0)? as u64,
                    vcpus: r.get::<_, i64>(1)? as u64,
                    memory_mb: r.get::<_, i64>(2)? as u64,
                })
            },
        )?)
    }

    pub fn insert_sandbox(&self, s: &SandboxRecord) -> Result<()> {
        insert_sandbox_on(&self.conn(), s)
    }

    /// Sandbox `s`, paused on `capture` (pulled from another node of a
    /// cluster, whose sandbox it was), becomes this node's: the capture's
    /// row, its import and the paused sandbox in one transaction.
    pub fn adopt_sandbox(
        &self,
        s: &SandboxRecord,
        capture: &super::SnapshotRow,
        detail: &str,
    ) -> Result<()> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        super::snapshots::insert_snapshot_on(&tx, capture)?;
        tx.execute(
            "INSERT OR REPLACE INTO imported_snapshots (id, team, imported_ms) VALUES (?1, ?2, ?3)",
            params![capture.id, s.team, super::now_ms()],
        )?;
        let paused = SandboxRecord {
            state: SandboxState::Paused,
            ..s.clone()
        };
        // It lived here before and moved away (killed here then): it comes
        // back as it is now.
        tx.execute(
            "DELETE FROM sandboxes WHERE id = ?1 AND state IN ('killed', 'failed')",
            [&s.id],
        )?;
        insert_sandbox_on(&tx, &paused)?;
        tx.execute(
            "UPDATE sandboxes SET snapshot_id = ?2 WHERE id = ?1",
            params![s.id, capture.id],
        )?;
        tx.execute(
            "INSERT INTO events (sandbox_id, at_ms, kind, detail) VALUES (?1, ?2, 'adopted', ?3)",
            params![s.id, super::now_ms(), detail],
        )?;
        tx.commit()?;
        drop(conn);
        self.note_change();
        Ok(())
    }

    pub fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRecord>> {
        self.conn()
            .query_row(
                &format!("SELECT {COLUMNS} FROM sandboxes WHERE id = ?1"),
                [id],
                from_row,
            )
            .optional()?
            .transpose()
    }

    /// Move sandbox `id` from one of the states `from` to `state` and
    /// record `event` (kind, detail) with it, in one transaction. `Ok(false)`:
    /// it is in none of `from`, and nothing changed. A change the lifecycle
    /// does not have ([`SandboxState::can_become`]) is an error: a bug.
    pub fn set_state(
        &self,
        id: &str,
        from: &[SandboxState],
        state: SandboxState,
        error: Option<&str>,
        event: (&str, &str),
    ) -> Result<bool> {
        self.change_state(id, from, state, error, event, |_| Ok(()))
    }

    /// [`Db::set_state`] to paused, in the same transaction as the pause's
    /// capture row, the sandbox's pointer to it and its lifecycle: a crash
    /// leaves the sandbox running with none of them, or paused with all.
    pub fn set_paused(
        &self,
        id: &str,
        capture: &super::SnapshotRow,
        lifecycle: &crate::model::Lifecycle,
        event: (&str, &str),
    ) -> Result<bool> {
        self.change_state(
            id,
            &[SandboxState::Running],
            SandboxState::Paused,
            None,
            event,
            |tx| {
                super::snapshots::insert_snapshot_on(tx, capture)?;
                tx.execute(
                    "UPDATE sandboxes SET snapshot_id = ?2, lifecycle = ?3 WHERE id = ?1",
                    params![
                        id,
                        capture.id,
                        serde_json::to_string(lifecycle).expect("a lifecycle serializes")
                    ],
                )?;
                Ok(())
            },
        )
    }

    /// [`Db::set_state`] from paused to running, in the same transaction as
    /// its new end time and lifecycle.
    pub fn set_resumed(
        &self,
        id: &str,
        end_at_ms: i64,
        lifecycle: &crate::model::Lifecycle,
        event: (&str, &str),
    ) -> Result<bool> {
        self.change_state(
            id,
            &[SandboxState::Paused],
            SandboxState::Running,
            None,
            event,
            |tx| {
                tx.execute(
                    "UPDATE sandboxes SET end_at_ms = ?2, lifecycle = ?3 WHERE id = ?1",
                    params![
                        id,
                        end_at_ms,
                        serde_json::to_string(lifecycle).expect("a lifecycle serializes")
                    ],
                )?;
                Ok(())
            },
        )
    }

    /// A capture of running sandbox `id` is whole: its row, the sandbox's
    /// pointer to it and the end of its intent, in one transaction.
    pub fn record_capture(&self, id: &str, capture: &super::SnapshotRow) -> Result<()> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        super::snapshots::insert_snapshot_on(&tx, capture)?;
        tx.execute(
            "UPDATE sandboxes SET snapshot_id = ?2, intent = NULL WHERE id = ?1",
            params![id, capture.id],
        )?;
        tx.commit()?;
        Ok(())
    }

    /// Every recorded intent: `(sandbox id, intent)`.
    pub fn intents(&self) -> Result<Vec<(String, String)>> {
        let conn = self.conn();
        let mut stmt = conn.prepare("SELECT id, intent FROM sandboxes WHERE intent IS NOT NULL")?;
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Record what operation on sandbox `id` is in flight (`None`: none),
    /// so that a restart after a crash knows (see `sandboxes/recover.rs`).
    pub fn set_intent(&self, id: &str, intent: Option<&str>) -> Result<()> {
        self.conn().execute(
            "UPDATE sandboxes SET intent = ?2 WHERE id = ?1",
            params![id, intent],
        )?;
        Ok(())
    }

    /// The operation in flight on sandbox `id`, if any.
    pub fn intent(&self, id: &str) -> Result<Option<String>> {
        Ok(self
            .conn()
            .query_row("SELECT intent FROM sandboxes WHERE id = ?1", [id], |r| {
                r.get(0)
            })
            .optional()?
            .flatten())
    }

    fn change_state(
        &self,
        id: &str,
        from: &[SandboxState],
        state: SandboxState,
        error: Option<&str>,
        (kind, detail): (&str, &str),
        also: impl FnOnce(&rusqlite::Transaction<'_>) -> Result<()>,
    ) -> Result<bool> {
        if let Some(bad) = from.iter().find(|f| !f.can_become(state)) {
            return Err(DbError::Transition {
                id: id.to_string(),
                from: bad.as_str(),
                to: state.as_str(),
            });
        }
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let current: Option<String> = tx
            .query_row("SELECT state FROM sandboxes WHERE id = ?1", [id], |r| {
                r.get(0)
            })
            .optional()?;
        let Some(current) = current.as_deref().and_then(SandboxState::parse) else {
            return Ok(false);
        };
        if !from.contains(&current) {
            return Ok(false);
        }
        tx.execute(
            "UPDATE sandboxes SET state = ?2, error = COALESCE(?3, error), intent = NULL \
             WHERE id = ?1",
            params![id, state.as_str(), error],
        )?;
        tx.execute(
            "INSERT INTO events (sandbox_id, at_ms, kind, detail) VALUES (?1, ?2, ?3, ?4)",
            params![id, super::now_ms(), kind, detail],
        )?;
        also(&tx)?;
        tx.commit()?;
        self.note_change();
        Ok(true)
    }

    pub fn set_times(&self, id: &str, started_at_ms: i64, end_at_ms: i64) -> Result<()> {
        self.conn().execute(
            "UPDATE sandboxes SET started_at_ms = ?2, end_at_ms = ?3 WHERE id = ?1",
            params![id, started_at_ms, end_at_ms],
        )?;
        self.note_change();
        Ok(())
    }

    /// Replace `id`'s network policy.
    pub fn set_network(&self, id: &str, network: &crate::network::NetworkPolicy) -> Result<()> {
        self.conn().execute(
            "UPDATE sandboxes SET network = ?2 WHERE id = ?1",
            params![
                id,
                serde_json::to_string(network).expect("a policy serializes")
            ],
        )?;
        Ok(())
    }

    /// `(id, access token)` of every paused sandbox.
    pub fn paused_tokens(&self) -> Result<Vec<(String, String)>> {
        let conn = self.conn();
        let mut stmt =
            conn.prepare("SELECT id, envd_access_token FROM sandboxes WHERE state = 'paused'")?;
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    pub fn set_end_at(&self, id: &str, end_at_ms: i64) -> Result<()> {
        self.conn().execute(
            "UPDATE sandboxes SET end_at_ms = ?2 WHERE id = ?1",
            params![id, end_at_ms],
        )?;
        self.note_change();
        Ok(())
    }

    pub fn list_sandboxes(&self, f: &ListFilter) -> Result<Vec<SandboxRecord>> {
        let mut sql = format!("SELECT {COLUMNS} FROM sandboxes WHERE 1=1");
        let mut args: Vec<rusqlite::types::Value> = Vec::new();
        if !f.states.is_empty() {
            let marks: Vec<String> = f
                .states
                .iter()
                .map(|s| {
                    args.push(s.as_str().to_string().into());
                    format!("?{}", args.len())
                })
                .collect();
            sql += &format!(" AND state IN ({})", marks.join(","));
        }
        if let Some(t) = &f.template {
            args.push(t.clone().into());
            sql += &format!(" AND template_id = ?{}", args.len());
        }
        if let Some(t) = &f.team {
            args.push(t.clone().into());
            sql += &format!(" AND team = ?{}", args.len());
        }
        if let Some(ms) = f.started_after_ms {
            args.push(ms.into());
            sql += &format!(" AND started_at_ms >= ?{}", args.len());
        }
        if let Some(ms) = f.started_before_ms {
            args.push(ms.into());
            sql += &format!(" AND started_at_ms < ?{}", args.len());
        }
        for (k, v) in &f.metadata {
            args.push(format!("$.\"{}\"", k.replace('"', "\"\"")).into());
            let kp = args.len();
            args.push(v.clone().into());
            sql += &format!(" AND json_extract(metadata, ?{kp}) = ?{}", args.len());
        }
        let (cmp, order) = if f.descending {
            ("<", "DESC")
        } else {
            (">", "ASC")
        };
        if let Some((ms, id)) = &f.after {
            args.push((*ms).into());
            let a = args.len();
            args.push(id.clone().into());
            sql += &format!(" AND (started_at_ms, id) {cmp} (?{a}, ?{})", args.len());
        }
        args.push((f.limit as i64).into());
        sql += &format!(
            " ORDER BY started_at_ms {order}, id {order} LIMIT ?{}",
            args.len()
        );
        let conn = self.conn();
        let mut stmt = conn.prepare(&sql)?;
        let rows = stmt.query_map(rusqlite::params_from_iter(args), from_row)?;
        let mut out = Vec::new();
        for row in rows {
            out.push(row??);
        }
        Ok(out)
    }
}

/// One sandbox row, on a connection or in a transaction.
fn insert_sandbox_on(conn: &rusqlite::Connection, s: &SandboxRecord) -> Result<()> {
    conn.execute(
        &format!("INSERT INTO sandboxes ({COLUMNS}) VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12,?13,?14,?15,?16,?17,?18,?19,?20,?21,?22)"),
        params![
            s.id,
            s.template_id,
            s.alias,
            s.client_id,
            s.state.as_str(),
            serde_json::to_string(&s.metadata).expect("a string map serializes"),
            serde_json::to_string(&s.env_vars).expect("a string map serializes"),
            s.cpu_count,
            s.memory_mb,
            s.disk_size_mb,
            s.envd_version,
            s.envd_access_token,
            s.started_at_ms,
            s.end_at_ms,
            s.auto_pause,
            s.error,
            serde_json::to_string(&s.network).expect("a policy serializes"),
            s.traffic_token,
            serde_json::to_string(&s.lifecycle).expect("a lifecycle serializes"),
            s.team,
            serde_json::to_string(&s.volume_mounts).expect("mounts serialize"),
            serde_json::to_string(&s.iam).expect("iam serializes"),
        ],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::{SnapshotKind, SnapshotRow};

    fn record(id: &str) -> SandboxRecord {
        SandboxRecord {
            id: id.into(),
            template_id: "base".into(),
            alias: None,
            client_id: "tine".into(),
            state: SandboxState::Running,
            metadata: BTreeMap::from([("k".to_string(), "v".to_string())]),
            env_vars: BTreeMap::new(),
            cpu_count: 1,
            memory_mb: 256,
            disk_size_mb: 0,
            envd_version: "0.2.0".into(),
            envd_access_token: "tok".into(),
            started_at_ms: 1,
            end_at_ms: 2,
            auto_pause: false,
            error: None,
            network: Default::default(),
            traffic_token: Some("traffic".into()),
            lifecycle: Default::default(),
            team: "default".into(),
            volume_mounts: Vec::new(),
            iam: Default::default(),
        }
    }

    fn pause_row(id: &str, sandbox: &str) -> SnapshotRow {
        SnapshotRow {
            id: id.into(),
            kind: SnapshotKind::Pause,
            sandbox_id: sandbox.into(),
            parent_id: None,
            names: vec![],
            template_id: "base".into(),
            cpu_count: 1,
            memory_mb: 256,
            source_token: "tok".into(),
            created_ms: 3,
        }
    }

    fn travelling(db: &Db) -> Vec<String> {
        db.travelling_snapshots(true)
            .unwrap()
            .into_iter()
            .map(|r| r.id)
            .collect()
    }

    #[test]
    fn only_current_pauses_with_memory_travel_and_an_adopted_one_does_not_again() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("t.db")).unwrap();
        for id in ["a", "b"] {
            db.insert_sandbox(&record(id)).unwrap();
        }
        let lc = crate::model::Lifecycle::default();
        assert!(db
            .set_paused("a", &pause_row("p-a-1", "a"), &lc, ("paused", ""))
            .unwrap());
        let disk_only = crate::model::Lifecycle {
            paused_disk_only: true,
            ..lc
        };
        assert!(db
            .set_paused("b", &pause_row("p-b-1", "b"), &disk_only, ("paused", ""))
            .unwrap());
        // A pause without memory stays on its node; durable pause off: none.
        assert_eq!(travelling(&db), vec!["p-a-1"]);
        assert!(db.travelling_snapshots(false).unwrap().is_empty());
        assert!(db.pause_is_current("a", "p-a-1").unwrap());
        // Resumed: its capture is history.
        assert!(db.set_resumed("a", 10, &lc, ("resumed", "")).unwrap());
        assert!(!db.pause_is_current("a", "p-a-1").unwrap());
        assert!(travelling(&db).is_empty());

        // Adopted from another node: paused here on the pulled capture,
        // with its record as it was, and not pushed back.
        let moved = record("c");
        db.adopt_sandbox(&moved, &pause_row("p-c-1", "c"), "from node-1")
            .unwrap();
        let got = db.get_sandbox("c").unwrap().unwrap();
        assert_eq!(got.state, SandboxState::Paused);
        assert_eq!(
            (got.envd_access_token.as_str(), got.traffic_token.as_deref()),
            ("tok", Some("traffic"))
        );
        assert_eq!(got.metadata, moved.metadata);
        assert_eq!(db.sandbox_snapshot("c").unwrap().as_deref(), Some("p-c-1"));
        assert!(db.pause_is_current("c", "p-c-1").unwrap());
        assert!(travelling(&db).is_empty());
        // Adopting it twice is an error, not a second row.
        assert!(db
            .adopt_sandbox(&moved, &pause_row("p-c-2", "c"), "again")
            .is_err());
        // Moved away (dropped here), then back: adopted again.
        assert!(db
            .set_state(
                "c",
                &[SandboxState::Paused],
                SandboxState::Killed,
                Some("moved"),
                ("killed", "")
            )
            .unwrap());
        db.adopt_sandbox(&moved, &pause_row("p-c-3", "c"), "back")
            .unwrap();
        assert_eq!(
            db.get_sandbox("c").unwrap().unwrap().state,
            SandboxState::Paused
        );
        assert_eq!(db.sandbox_snapshot("c").unwrap().as_deref(), Some("p-c-3"));
    }
}
