//! The `volumes` table: each team's volumes (their files live under
//! `<data>/volumes/<id>`, see `crate::volumes`).

use rusqlite::{params, OptionalExtension};

use super::{Db, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRow {
    pub id: String,
    pub team: String,
    pub name: String,
    /// What the content API takes as `Authorization: Bearer`.
    pub token: String,
    pub created_ms: i64,
    /// Bytes of file contents it may hold.
    pub max_bytes: u64,
}

const COLUMNS: &str = "id, team, name, token, created_ms, max_bytes";

fn row(r: &rusqlite::Row<'_>) -> rusqlite::Result<VolumeRow> {
    Ok(VolumeRow {
        id: r.get(0)?,
        team: r.get(1)?,
        name: r.get(2)?,
        token: r.get(3)?,
        created_ms: r.get(4)?,
        max_bytes: r.get::<_, i64>(5)? as u64,
    })
}

impl Db {
    /// Record `v`; false when its team has a volume of that name already.
    pub fn insert_volume(&self, v: &VolumeRow) -> Result<bool> {
        let n = self.conn().execute(
            "INSERT INTO volumes (id, team, name, token, created_ms, max_bytes) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT (team, name) DO NOTHING",
            params![
                v.id,
                v.team,
                v.name,
                v.token,
                v.created_ms,
                v.max_bytes as i64
            ],
        )?;
        Ok(n == 1)
    }

    /// Volume `id_or_name` of `team`.
    pub fn get_volume(&self, team: &str, id_or_name: &str) -> Result<Option<VolumeRow>> {
        Ok(self
            .conn()
            .query_row(
                &format!(
                    "SELECT {COLUMNS} FROM volumes WHERE team = ?1 AND (id = ?2 OR name = ?2) \
                     ORDER BY id = ?2 DESC LIMIT 1"
                ),
                params![team, id_or_name],
                row,
            )
            .optional()?)
    }

    /// Volume `id` of any team.
    pub fn volume_by_id(&self, id: &str) -> Result<Option<VolumeRow>> {
        Ok(self
            .conn()
            .query_row(
                &format!("SELECT {COLUMNS} FROM volumes WHERE id = ?1"),
                [id],
                row,
            )
            .optional()?)
    }

    /// `team`'s volumes, oldest first.
    pub fn list_volumes(&self, team: &str) -> Result<Vec<VolumeRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {COLUMNS} FROM volumes WHERE team = ?1 ORDER BY created_ms, id"
        ))?;
        let rows = stmt.query_map([team], row)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Sandboxes (starting, running or paused) that mount volume `id`.
    pub fn sandboxes_mounting(&self, id: &str) -> Result<Vec<String>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT s.id FROM sandboxes s, json_each(s.volume_mounts) m \
             WHERE s.state IN ('starting', 'running', 'paused') \
             AND json_extract(m.value, '$.volume_id') = ?1 ORDER BY s.id",
        )?;
        let rows = stmt.query_map([id], |r| r.get(0))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    pub fn delete_volume(&self, id: &str) -> Result<()> {
        self.conn()
            .execute("DELETE FROM volumes WHERE id = ?1", [id])?;
        Ok(())
    }
}
