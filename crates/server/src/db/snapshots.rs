//! The `snapshots` table: captures of sandboxes. `pause` captures are what
//! a paused sandbox resumes from, `fork` captures what forks start from,
//! `snapshot` captures the ones users made (restorable by id).
//!
//! Each capture's disk is a qcow2 overlay backed by its parent's, so a
//! capture's files may be deleted only when no sandbox runs on it, no
//! paused sandbox resumes from it and no other capture has it as parent;
//! [`Db::collectable_snapshots`] finds those.

use rusqlite::{params, OptionalExtension, Row};

use super::{now_ms, Db, DbError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotKind {
    Pause,
    Fork,
    Snapshot,
    /// A template (`names[0]` is its name): `base` for each machine shape
    /// in use, and those `tine template build` made.
    Template,
    /// A template build's step result (`template_id` holds its cache key),
    /// kept while templates sit on it.
    Layer,
}

impl SnapshotKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            SnapshotKind::Pause => "pause",
            SnapshotKind::Fork => "fork",
            SnapshotKind::Snapshot => "snapshot",
            SnapshotKind::Template => "template",
            SnapshotKind::Layer => "layer",
        }
    }
    pub(crate) fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "pause" => SnapshotKind::Pause,
            "fork" => SnapshotKind::Fork,
            "snapshot" => SnapshotKind::Snapshot,
            "template" => SnapshotKind::Template,
            "layer" => SnapshotKind::Layer,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotRow {
    pub id: String,
    pub kind: SnapshotKind,
    pub sandbox_id: String,
    /// The capture (or template snapshot) the source ran on.
    pub parent_id: Option<String>,
    pub names: Vec<String>,
    pub template_id: String,
    pub cpu_count: u32,
    pub memory_mb: u32,
    /// The access token the guest had when captured (needed to re-`/init`).
    pub source_token: String,
    pub created_ms: i64,
}

const COLUMNS: &str = "id, kind, sandbox_id, parent_id, names, template_id, cpu_count, memory_mb, source_token, created_ms";

pub(super) fn insert_snapshot_on(conn: &rusqlite::Connection, s: &SnapshotRow) -> Result<()> {
    conn.execute(
        &format!(
            "INSERT OR IGNORE INTO snapshots ({COLUMNS}) VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10)"
        ),
        params![
            s.id,
            s.kind.as_str(),
            s.sandbox_id,
            s.parent_id,
            serde_json::to_string(&s.names).expect("strings serialize"),
            s.template_id,
            s.cpu_count,
            s.memory_mb,
            s.source_token,
            s.created_ms
        ],
    )?;
    Ok(())
}

fn from_row(r: &Row<'_>) -> rusqlite::Result<std::result::Result<SnapshotRow, DbError>> {
    let id: String = r.get(0)?;
    let kind: String = r.get(1)?;
    let names: String = r.get(4)?;
    let build = || -> std::result::Result<SnapshotRow, DbError> {
        Ok(SnapshotRow {
            kind: SnapshotKind::parse(&kind)
                .ok_or_else(|| DbError::Corrupt(format!("kind of snapshot {id}")))?,
            sandbox_id: r.get(2)?,
            parent_id: r.get(3)?,
            names: serde_json::from_str(&names)
                .map_err(|_| DbError::Corrupt(format!("names of snapshot {id}")))?,
            template_id: r.get(5)?,
            cpu_count: r.get(6)?,
            memory_mb: r.get(7)?,
            source_token: r.get(8)?,
            created_ms: r.get(9)?,
            id: id.clone(),
        })
    };
    Ok(build())
}

impl Db {
    pub fn insert_snapshot(&self, s: &SnapshotRow) -> Result<()> {
        insert_snapshot_on(&self.conn(), s)?;
        // A node's heartbeat names the snapshots it holds.
        self.note_change();
        Ok(())
    }

    /// A snapshot that has not been deleted.
    pub fn get_snapshot(&self, id: &str) -> Result<Option<SnapshotRow>> {
        self.conn()
            .query_row(
                &format!("SELECT {COLUMNS} FROM snapshots WHERE id = ?1 AND deleted_ms IS NULL"),
                [id],
                from_row,
            )
            .optional()?
            .transpose()
    }

    /// The team that owns a capture: its sandbox's; for a template, its
    /// builder's (`None`: shared by every team).
    pub fn snapshot_team(&self, row: &SnapshotRow) -> Result<Option<String>> {
        match row.kind {
            SnapshotKind::Template => match row.names.first() {
                Some(name) => match self.template_team(name)? {
                    Some(team) => Ok(Some(team)),
                    None => self.imported_team(&row.id),
                },
                None => Ok(None),
            },
            SnapshotKind::Layer => Ok(None),
            _ => match self.sandbox_team(&row.sandbox_id)? {
                Some(team) => Ok(Some(team)),
                None => self.imported_team(&row.id),
            },
        }
    }

    /// The team of a capture pulled from another host (`None`: shared, or
    /// not pulled).
    pub(super) fn imported_team(&self, id: &str) -> Result<Option<String>> {
        let team: Option<String> = self
            .conn()
            .query_row(
                "SELECT team FROM imported_snapshots WHERE id = ?1",
                [id],
                |r| r.get(0),
            )
            .optional()?;
        Ok(team.filter(|t| !t.is_empty()))
    }

    /// Record capture `s` of `team` (`None`: shared), pulled from another
    /// host, in one transaction with its team and, for a template, its
    /// `(template, tag)`s.
    pub fn import_snapshot(
        &self,
        s: &SnapshotRow,
        team: Option<&str>,
        tags: &[(String, String)],
    ) -> Result<()> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        insert_snapshot_on(&tx, s)?;
        tx.execute(
            "INSERT OR REPLACE INTO imported_snapshots (id, team, imported_ms) VALUES (?1, ?2, ?3)",
            params![s.id, team.unwrap_or_default(), super::now_ms()],
        )?;
        for (template, tag) in tags {
            tx.execute(
                "INSERT INTO template_tags (template, tag, snapshot_id, build_id, created_ms) \
                 VALUES (?1, ?2, ?3, '', ?4) \
                 ON CONFLICT (template, tag) DO UPDATE SET snapshot_id = ?3, created_ms = ?4",
                params![template, tag, s.id, super::now_ms()],
            )?;
        }
        tx.commit()?;
        drop(conn);
        self.note_change();
        Ok(())
    }

    /// Captures (user snapshots and pauses) of team `team`'s sandboxes
    /// that are not deleted.
    pub fn team_snapshot_ids(&self, team: &str) -> Result<Vec<String>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT s.id FROM snapshots s JOIN sandboxes b ON b.id = s.sandbox_id \
             WHERE b.team = ?1 AND s.deleted_ms IS NULL AND s.kind IN ('snapshot', 'pause')",
        )?;
        let rows = stmt.query_map([team], |r| r.get::<_, String>(0))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// User snapshots, oldest first, optionally of one sandbox.
    pub fn list_snapshots(&self, sandbox_id: Option<&str>) -> Result<Vec<SnapshotRow>> {
        self.select_snapshots(
            "kind = 'snapshot' AND deleted_ms IS NULL AND (?1 IS NULL OR sandbox_id = ?1)",
            [sandbox_id],
        )
    }

    /// Hide a user snapshot (by id) or a template (by id or name); the
    /// files go when nothing depends on them.
    pub fn delete_snapshot(&self, id: &str) -> Result<bool> {
        let n = self.conn().execute(
            "UPDATE snapshots SET deleted_ms = ?2 WHERE deleted_ms IS NULL AND \
             ((id = ?1 AND kind IN ('snapshot', 'template')) OR (kind = 'template' AND json_extract(names, '$[0]') = ?1))",
            params![id, now_ms()],
        )?;
        Ok(n >= 1)
    }

    /// Hide snapshot `id` whatever its kind (a replaced template).
    pub fn hide_snapshot(&self, id: &str) -> Result<()> {
        self.conn().execute(
            "UPDATE snapshots SET deleted_ms = ?2 WHERE id = ?1 AND deleted_ms IS NULL",
            params![id, now_ms()],
        )?;
        Ok(())
    }

    /// The newest template called `name` whose shape is `cpu`/`mem` (any
    /// shape when `None`).
    pub fn find_template(
        &self,
        name: &str,
        shape: Option<(u32, u32)>,
    ) -> Result<Option<SnapshotRow>> {
        let (cpu, mem) = shape.map_or((None, None), |(c, m)| (Some(c), Some(m)));
        self.conn()
            .query_row(
                &format!(
                    "SELECT {COLUMNS} FROM snapshots WHERE kind = 'template' AND deleted_ms IS NULL \
                     AND json_extract(names, '$[0]') = ?1 AND (?2 IS NULL OR cpu_count = ?2) \
                     AND (?3 IS NULL OR memory_mb = ?3) ORDER BY created_ms DESC LIMIT 1"
                ),
                params![name, cpu, mem],
                from_row,
            )
            .optional()?
            .transpose()
    }

    /// This host's own user snapshots and built templates (not `base`'s,
    /// which every host builds, nor those pulled from another host), and
    /// with `pauses` the captures its sandboxes paused with their memory
    /// wait on: what a
    /// cluster node pushes to its registry.
    pub fn travelling_snapshots(&self, pauses: bool) -> Result<Vec<SnapshotRow>> {
        self.select_snapshots(
            "((kind IN ('snapshot', 'template') AND deleted_ms IS NULL \
               AND json_extract(names, '$[0]') IS NOT 'base') \
              OR (?1 AND kind = 'pause' AND id IN \
                  (SELECT snapshot_id FROM sandboxes WHERE state = 'paused' \
                     AND json_extract(lifecycle, '$.pausedDiskOnly') IS NOT 1))) \
             AND id NOT IN (SELECT id FROM imported_snapshots)",
            [pauses],
        )
    }

    /// Whether pause capture `id` is still what its sandbox is paused on
    /// (not resumed since, nor killed).
    pub fn pause_is_current(&self, sandbox_id: &str, id: &str) -> Result<bool> {
        Ok(self
            .conn()
            .query_row(
                "SELECT 1 FROM sandboxes WHERE id = ?1 AND snapshot_id = ?2 AND state = 'paused'",
                [sandbox_id, id],
                |_| Ok(()),
            )
            .optional()?
            .is_some())
    }

    /// The snapshot rows `filter` (an SQL condition over `params`)
    /// selects, oldest first.
    fn select_snapshots(
        &self,
        filter: &str,
        params: impl rusqlite::Params,
    ) -> Result<Vec<SnapshotRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {COLUMNS} FROM snapshots WHERE {filter} ORDER BY created_ms, id"
        ))?;
        let rows = stmt.query_map(params, from_row)?;
        let mut out = Vec::new();
        for r in rows {
            out.push(r??);
        }
        Ok(out)
    }

    /// The `(template, tag)`s that point at capture `id`.
    pub fn tags_of(&self, id: &str) -> Result<Vec<(String, String)>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT template, tag FROM template_tags WHERE snapshot_id = ?1 ORDER BY template, tag",
        )?;
        let rows = stmt.query_map([id], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Templates, one row per template and shape.
    pub fn list_templates(&self) -> Result<Vec<SnapshotRow>> {
        self.select_snapshots("kind = 'template' AND deleted_ms IS NULL", [])
    }

    /// A build reused layer `id` now (it expires counting from its last use).
    pub fn touch_snapshot(&self, id: &str) -> Result<()> {
        self.conn().execute(
            "UPDATE snapshots SET used_ms = ?2 WHERE id = ?1",
            params![id, now_ms()],
        )?;
        Ok(())
    }

    /// Delete the build layers last made or used before `cutoff_ms`; their
    /// files go (via [`Db::collectable_snapshots`]) once no later layer,
    /// template or sandbox sits on them. Returns how many.
    pub fn expire_layers(&self, cutoff_ms: i64) -> Result<usize> {
        Ok(self.conn().execute(
            "UPDATE snapshots SET deleted_ms = ?2 WHERE kind = 'layer' AND deleted_ms IS NULL \
             AND COALESCE(used_ms, created_ms) < ?1",
            params![cutoff_ms, now_ms()],
        )?)
    }

    /// The id of every row, deleted or not (their files are the garbage
    /// collection's to delete).
    pub fn all_snapshot_ids(&self) -> Result<Vec<String>> {
        let conn = self.conn();
        let mut stmt = conn.prepare("SELECT id FROM snapshots")?;
        let rows = stmt.query_map([], |r| r.get(0))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// The newest build layer with cache key `key`.
    pub fn find_layer(&self, key: &str) -> Result<Option<SnapshotRow>> {
        self.conn()
            .query_row(
                &format!(
                    "SELECT {COLUMNS} FROM snapshots WHERE kind = 'layer' AND deleted_ms IS NULL \
                     AND template_id = ?1 ORDER BY created_ms DESC LIMIT 1"
                ),
                [key],
                from_row,
            )
            .optional()?
            .transpose()
    }

    /// A capture now sits directly on `parent_id` (after compaction).
    pub fn set_snapshot_parent(&self, id: &str, parent_id: &str) -> Result<()> {
        self.conn().execute(
            "UPDATE snapshots SET parent_id = ?2 WHERE id = ?1",
            params![id, parent_id],
        )?;
        Ok(())
    }

    pub fn set_sandbox_snapshot(&self, sandbox_id: &str, snapshot_id: Option<&str>) -> Result<()> {
        self.conn().execute(
            "UPDATE sandboxes SET snapshot_id = ?2 WHERE id = ?1",
            params![sandbox_id, snapshot_id],
        )?;
        Ok(())
    }

    pub fn sandbox_snapshot(&self, sandbox_id: &str) -> Result<Option<String>> {
        Ok(self
            .conn()
            .query_row(
                "SELECT snapshot_id FROM sandboxes WHERE id = ?1",
                [sandbox_id],
                |r| r.get(0),
            )
            .optional()?
            .flatten())
    }

    /// Captures whose files nothing needs any more: internal (pause, fork)
    /// or deleted ones that no live sandbox and no other capture uses.
    pub fn collectable_snapshots(&self) -> Result<Vec<String>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT s.id FROM snapshots s WHERE (s.kind IN ('pause', 'fork') OR s.deleted_ms IS NOT NULL) \
             AND NOT EXISTS (SELECT 1 FROM sandboxes b WHERE b.snapshot_id = s.id \
                             AND b.state IN ('starting', 'running', 'paused')) \
             AND NOT EXISTS (SELECT 1 FROM snapshots c WHERE c.parent_id = s.id)",
        )?;
        let rows = stmt.query_map([], |r| r.get(0))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Forget a capture whose files are gone.
    pub fn remove_snapshot_row(&self, id: &str) -> Result<()> {
        self.conn()
            .execute("DELETE FROM snapshots WHERE id = ?1", [id])?;
        Ok(())
    }
}
