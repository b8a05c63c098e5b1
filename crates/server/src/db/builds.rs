//! The `builds` table (template builds requested through the API or the
//! CLI, and how they ended) and `template_tags` (which capture each
//! `name:tag` creates sandboxes from).
//!
//! A build's template is a row of kind `template` in `snapshots` only once
//! the build is ready, so a build that fails leaves no template behind.

use rusqlite::{params, OptionalExtension, Row};

use super::{now_ms, Db, DbError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuildStatus {
    /// Registered (`POST /v3/templates`), not started.
    Waiting,
    Building,
    Ready,
    Error,
}

impl BuildStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            BuildStatus::Waiting => "waiting",
            BuildStatus::Building => "building",
            BuildStatus::Ready => "ready",
            BuildStatus::Error => "error",
        }
    }
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "waiting" => BuildStatus::Waiting,
            "building" => BuildStatus::Building,
            "ready" => BuildStatus::Ready,
            "error" => BuildStatus::Error,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct BuildRow {
    pub id: String,
    /// The template's name (its id in the API).
    pub template: String,
    pub status: BuildStatus,
    /// Why it failed, and the step (`"3"`, `"start"`, `"ready"`, `"base"`).
    pub reason: Option<String>,
    pub reason_step: Option<String>,
    pub tags: Vec<String>,
    pub cpu_count: u32,
    pub memory_mb: u32,
    /// The template capture, once ready.
    pub snapshot_id: Option<String>,
    pub created_ms: i64,
    pub finished_ms: Option<i64>,
}

const COLUMNS: &str = "id, template, status, reason, reason_step, tags, cpu_count, memory_mb, snapshot_id, created_ms, finished_ms";

fn from_row(r: &Row<'_>) -> rusqlite::Result<std::result::Result<BuildRow, DbError>> {
    let id: String = r.get(0)?;
    let status: String = r.get(2)?;
    let tags: String = r.get(5)?;
    let build = || -> std::result::Result<BuildRow, DbError> {
        Ok(BuildRow {
            template: r.get(1)?,
            status: BuildStatus::parse(&status)
                .ok_or_else(|| DbError::Corrupt(format!("status of build {id}")))?,
            reason: r.get(3)?,
            reason_step: r.get(4)?,
            tags: serde_json::from_str(&tags)
                .map_err(|_| DbError::Corrupt(format!("tags of build {id}")))?,
            cpu_count: r.get(6)?,
            memory_mb: r.get(7)?,
            snapshot_id: r.get(8)?,
            created_ms: r.get(9)?,
            finished_ms: r.get(10)?,
            id: id.clone(),
        })
    };
    Ok(build())
}

impl Db {
    /// Record which team asked for build `id`.
    pub fn set_build_team(&self, id: &str, team: &str) -> Result<()> {
        self.conn().execute(
            "UPDATE builds SET team = ?2 WHERE id = ?1",
            params![id, team],
        )?;
        Ok(())
    }

    /// The team that owns template `name`: the team of its first build
    /// that names one (`None`: a shared template, such as `base`, or no
    /// such template).
    pub fn template_team(&self, name: &str) -> Result<Option<String>> {
        let built: Option<String> = self
            .conn()
            .query_row(
                "SELECT team FROM builds WHERE template = ?1 AND team IS NOT NULL \
                 ORDER BY created_ms, id LIMIT 1",
                [name],
                |r| r.get(0),
            )
            .optional()?;
        if built.is_some() {
            return Ok(built);
        }
        // Built on another host of a cluster and pulled from its registry.
        let pulled: Option<String> = self
            .conn()
            .query_row(
                "SELECT s.id FROM snapshots s JOIN imported_snapshots i ON i.id = s.id \
                 WHERE s.kind = 'template' AND json_extract(s.names, '$[0]') = ?1 LIMIT 1",
                [name],
                |r| r.get(0),
            )
            .optional()?;
        match pulled {
            Some(id) => self.imported_team(&id),
            None => Ok(None),
        }
    }

    pub fn insert_build(&self, b: &BuildRow) -> Result<()> {
        self.conn().execute(
            &format!("INSERT INTO builds ({COLUMNS}) VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11)"),
            params![
                b.id,
                b.template,
                b.status.as_str(),
                b.reason,
                b.reason_step,
                serde_json::to_string(&b.tags).expect("strings serialize"),
                b.cpu_count,
                b.memory_mb,
                b.snapshot_id,
                b.created_ms,
                b.finished_ms
            ],
        )?;
        Ok(())
    }

    pub fn get_build(&self, id: &str) -> Result<Option<BuildRow>> {
        self.conn()
            .query_row(
                &format!("SELECT {COLUMNS} FROM builds WHERE id = ?1"),
                [id],
                from_row,
            )
            .optional()?
            .transpose()
    }

    /// Builds of `template`, newest first.
    pub fn list_builds(&self, template: &str) -> Result<Vec<BuildRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {COLUMNS} FROM builds WHERE template = ?1 ORDER BY created_ms DESC, id"
        ))?;
        let rows = stmt.query_map([template], from_row)?;
        let mut out = Vec::new();
        for r in rows {
            out.push(r??);
        }
        Ok(out)
    }

    /// The newest `limit` builds team `team` may see: its own and those
    /// of no team (made with the CLI), newest first.
    pub fn recent_builds(&self, team: &str, limit: usize) -> Result<Vec<BuildRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {COLUMNS} FROM builds WHERE team = ?1 OR team IS NULL \
             ORDER BY created_ms DESC, id LIMIT ?2"
        ))?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = stmt.query_map(params![team, limit], from_row)?;
        let mut out = Vec::new();
        for r in rows {
            out.push(r??);
        }
        Ok(out)
    }

    /// The template capture of the newest ready build of `template` whose
    /// steps had key `key`, while that capture is a live template.
    pub fn ready_build_with_key(&self, template: &str, key: &str) -> Result<Option<String>> {
        Ok(self
            .conn()
            .query_row(
                "SELECT b.snapshot_id FROM builds b JOIN snapshots s ON s.id = b.snapshot_id \
                 WHERE b.template = ?1 AND b.build_key = ?2 AND b.status = 'ready' \
                 AND s.deleted_ms IS NULL ORDER BY b.created_ms DESC LIMIT 1",
                params![template, key],
                |r| r.get(0),
            )
            .optional()?)
    }

    pub fn set_build_key(&self, id: &str, key: &str) -> Result<()> {
        self.conn().execute(
            "UPDATE builds SET build_key = ?2 WHERE id = ?1",
            params![id, key],
        )?;
        Ok(())
    }

    /// Move a build to `status`; only a build that has not ended moves.
    pub fn set_build_status(
        &self,
        id: &str,
        status: BuildStatus,
        reason: Option<(&str, Option<&str>)>,
        snapshot_id: Option<&str>,
    ) -> Result<bool> {
        let finished = matches!(status, BuildStatus::Ready | BuildStatus::Error).then(now_ms);
        let n = self.conn().execute(
            "UPDATE builds SET status = ?2, reason = ?3, reason_step = ?4, snapshot_id = ?5, finished_ms = ?6 \
             WHERE id = ?1 AND status IN ('waiting', 'building')",
            params![
                id,
                status.as_str(),
                reason.map(|r| r.0),
                reason.and_then(|r| r.1),
                snapshot_id,
                finished
            ],
        )?;
        Ok(n == 1)
    }

    /// Delete every build of `template` that is not running.
    pub fn delete_builds(&self, template: &str) -> Result<usize> {
        Ok(self.conn().execute(
            "DELETE FROM builds WHERE template = ?1 AND status != 'building'",
            [template],
        )?)
    }

    /// Builds that were running when the server stopped end as errors.
    pub fn fail_unfinished_builds(&self, reason: &str) -> Result<usize> {
        Ok(self.conn().execute(
            "UPDATE builds SET status = 'error', reason = ?1, finished_ms = ?2 \
             WHERE status IN ('waiting', 'building')",
            params![reason, now_ms()],
        )?)
    }

    /// Point `template:tag` at capture `snapshot_id`.
    pub fn set_tag(
        &self,
        template: &str,
        tag: &str,
        snapshot_id: &str,
        build_id: &str,
    ) -> Result<()> {
        self.conn().execute(
            "INSERT INTO template_tags (template, tag, snapshot_id, build_id, created_ms) VALUES (?1,?2,?3,?4,?5) \
             ON CONFLICT (template, tag) DO UPDATE SET snapshot_id = ?3, build_id = ?4, created_ms = ?5",
            params![template, tag, snapshot_id, build_id, now_ms()],
        )?;
        Ok(())
    }

    pub fn delete_tag(&self, template: &str, tag: &str) -> Result<bool> {
        Ok(self.conn().execute(
            "DELETE FROM template_tags WHERE template = ?1 AND tag = ?2",
            params![template, tag],
        )? == 1)
    }

    pub fn delete_tags(&self, template: &str) -> Result<()> {
        self.conn()
            .execute("DELETE FROM template_tags WHERE template = ?1", [template])?;
        Ok(())
    }

    /// `(tag, snapshot_id, build_id, created_ms)` of every tag of `template`.
    pub fn tags(&self, template: &str) -> Result<Vec<(String, String, String, i64)>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT tag, snapshot_id, build_id, created_ms FROM template_tags WHERE template = ?1 ORDER BY tag",
        )?;
        let rows = stmt.query_map([template], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// The capture `template:tag` points at.
    pub fn tag_snapshot(&self, template: &str, tag: &str) -> Result<Option<String>> {
        Ok(self
            .conn()
            .query_row(
                "SELECT snapshot_id FROM template_tags WHERE template = ?1 AND tag = ?2",
                params![template, tag],
                |r| r.get(0),
            )
            .optional()?)
    }

    /// The build that made capture `snapshot_id` (the nil UUID for a
    /// template built before builds were recorded).
    pub fn build_of_snapshot(&self, snapshot_id: &str) -> Result<String> {
        Ok(self
            .conn()
            .query_row(
                "SELECT id FROM builds WHERE snapshot_id = ?1 ORDER BY created_ms DESC LIMIT 1",
                [snapshot_id],
                |r| r.get(0),
            )
            .optional()?
            .unwrap_or_else(|| "00000000-0000-0000-0000-000000000000".into()))
    }

    /// Whether a tag still points at capture `snapshot_id`.
    pub fn is_tagged(&self, snapshot_id: &str) -> Result<bool> {
        Ok(self
            .conn()
            .query_row(
                "SELECT 1 FROM template_tags WHERE snapshot_id = ?1 LIMIT 1",
                [snapshot_id],
                |_| Ok(()),
            )
            .optional()?
            .is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str) -> BuildRow {
        BuildRow {
            id: id.into(),
            template: "t".into(),
            status: BuildStatus::Waiting,
            reason: None,
            reason_step: None,
            tags: vec!["default".into()],
            cpu_count: 2,
            memory_mb: 512,
            snapshot_id: None,
            created_ms: 1,
            finished_ms: None,
        }
    }

    #[test]
    fn recent_builds_are_the_teams_and_the_clis_newest_first() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("t.db")).unwrap();
        for (id, team, at) in [
            ("a", Some("x"), 1),
            ("b", Some("y"), 2),
            ("c", None, 3),
            ("d", Some("x"), 4),
        ] {
            db.insert_build(&BuildRow {
                created_ms: at,
                ..row(id)
            })
            .unwrap();
            if let Some(t) = team {
                db.set_build_team(id, t).unwrap();
            }
        }
        let ids = |team, n| -> Vec<String> {
            db.recent_builds(team, n)
                .unwrap()
                .into_iter()
                .map(|b| b.id)
                .collect()
        };
        assert_eq!(ids("x", 10), ["d", "c", "a"]);
        assert_eq!(ids("x", 2), ["d", "c"]);
        assert_eq!(ids("y", 10), ["c", "b"]);
        assert_eq!(ids("z", 10), ["c"]);
    }

    #[test]
    fn a_build_ends_once() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("t.db")).unwrap();
        db.insert_build(&row("b1")).unwrap();
        assert!(db
            .set_build_status("b1", BuildStatus::Building, None, None)
            .unwrap());
        assert!(db
            .set_build_status("b1", BuildStatus::Error, Some(("boom", Some("2"))), None)
            .unwrap());
        // An ended build does not move again.
        assert!(!db
            .set_build_status("b1", BuildStatus::Ready, None, Some("s"))
            .unwrap());
        let b = db.get_build("b1").unwrap().unwrap();
        assert_eq!(b.status, BuildStatus::Error);
        assert_eq!(b.reason.as_deref(), Some("boom"));
        assert_eq!(b.reason_step.as_deref(), Some("2"));
        assert!(b.finished_ms.is_some());
    }

    #[test]
    fn tags_move() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("t.db")).unwrap();
        db.set_tag("t", "v1", "s1", "b1").unwrap();
        db.set_tag("t", "v1", "s2", "b2").unwrap();
        assert_eq!(db.tag_snapshot("t", "v1").unwrap().as_deref(), Some("s2"));
        assert!(!db.is_tagged("s1").unwrap());
        assert!(db.delete_tag("t", "v1").unwrap());
        assert_eq!(db.tag_snapshot("t", "v1").unwrap(), None);
    }
}

#[cfg(test)]
mod layer_tests {
    use super::super::{SnapshotKind, SnapshotRow};
    use super::*;

    fn layer(id: &str, parent: Option<&str>, created_ms: i64) -> SnapshotRow {
        SnapshotRow {
            id: id.into(),
            kind: SnapshotKind::Layer,
            sandbox_id: String::new(),
            parent_id: parent.map(String::from),
            names: vec!["t".into()],
            template_id: format!("key-{id}"),
            cpu_count: 1,
            memory_mb: 256,
            source_token: String::new(),
            created_ms,
        }
    }

    #[test]
    fn unused_layers_expire_and_go_leaf_first() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("t.db")).unwrap();
        db.insert_snapshot(&layer("l1", None, 1)).unwrap();
        db.insert_snapshot(&layer("l2", Some("l1"), 2)).unwrap();
        db.insert_snapshot(&layer("l3", Some("l2"), 3)).unwrap();
        db.insert_snapshot(&layer("fresh", Some("l1"), now_ms()))
            .unwrap();
        // l2 was reused by a build just now: it does not expire.
        db.touch_snapshot("l2").unwrap();
        assert!(db.collectable_snapshots().unwrap().is_empty());
        assert_eq!(db.expire_layers(now_ms() - 60_000).unwrap(), 2);
        assert!(db.find_layer("key-l3").unwrap().is_none());
        assert!(db.find_layer("key-l2").unwrap().is_some());
        // Only the leaf goes: l1 still has children.
        assert_eq!(db.collectable_snapshots().unwrap(), vec!["l3".to_string()]);
    }
}
