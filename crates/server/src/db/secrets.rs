//! The `secrets` table: each team's secrets, their current version sealed
//! by `crate::secrets::cipher` (the value itself is never stored in clear).

use std::collections::BTreeMap;

use rusqlite::{params, OptionalExtension};

use super::{Db, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretRow {
    pub id: String,
    pub team: String,
    pub name: String,
    pub version: i64,
    pub metadata: BTreeMap<String, String>,
    pub nonce: Vec<u8>,
    pub sealed: Vec<u8>,
    pub created_ms: i64,
    pub updated_ms: i64,
}

const COLUMNS: &str = "id, team, name, version, metadata, nonce, sealed, created_ms, updated_ms";

fn row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SecretRow> {
    let metadata: String = r.get(4)?;
    Ok(SecretRow {
        id: r.get(0)?,
        team: r.get(1)?,
        name: r.get(2)?,
        version: r.get(3)?,
        metadata: serde_json::from_str(&metadata).unwrap_or_default(),
        nonce: r.get(5)?,
        sealed: r.get(6)?,
        created_ms: r.get(7)?,
        updated_ms: r.get(8)?,
    })
}

fn metadata_json(m: &BTreeMap<String, String>) -> String {
    serde_json::to_string(m).unwrap_or_else(|_| "{}".into())
}

impl Db {
    /// Record `s`; false when its team has a secret of that name already.
    pub fn insert_secret(&self, s: &SecretRow) -> Result<bool> {
        let n = self.conn().execute(
            &format!(
                "INSERT INTO secrets ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) \
                 ON CONFLICT (team, name) DO NOTHING"
            ),
            params![
                s.id,
                s.team,
                s.name,
                s.version,
                metadata_json(&s.metadata),
                s.nonce,
                s.sealed,
                s.created_ms,
                s.updated_ms
            ],
        )?;
        Ok(n == 1)
    }

    /// Replace the sealed value (and metadata) of secret `s.id` if its
    /// version is still `s.version - 1`; false when another update won.
    pub fn update_secret(&self, s: &SecretRow) -> Result<bool> {
        let n = self.conn().execute(
            "UPDATE secrets SET version = ?2, metadata = ?3, nonce = ?4, sealed = ?5, \
             updated_ms = ?6 WHERE id = ?1 AND version = ?2 - 1",
            params![
                s.id,
                s.version,
                metadata_json(&s.metadata),
                s.nonce,
                s.sealed,
                s.updated_ms
            ],
        )?;
        Ok(n == 1)
    }

    /// Secret `id_or_name` of `team` (an id wins over a name).
    pub fn get_secret(&self, team: &str, id_or_name: &str) -> Result<Option<SecretRow>> {
        Ok(self
            .conn()
            .query_row(
                &format!(
                    "SELECT {COLUMNS} FROM secrets WHERE team = ?1 AND (id = ?2 OR name = ?2) \
                     ORDER BY id = ?2 DESC LIMIT 1"
                ),
                params![team, id_or_name],
                row,
            )
            .optional()?)
    }

    /// Secret `name` of `team` (by name only: placeholders name secrets).
    pub fn secret_by_name(&self, team: &str, name: &str) -> Result<Option<SecretRow>> {
        Ok(self
            .conn()
            .query_row(
                &format!("SELECT {COLUMNS} FROM secrets WHERE team = ?1 AND name = ?2"),
                params![team, name],
                row,
            )
            .optional()?)
    }

    /// Up to `limit` of `team`'s secrets after id `after`, oldest first.
    pub fn list_secrets(
        &self,
        team: &str,
        after: Option<(i64, &str)>,
        limit: usize,
    ) -> Result<Vec<SecretRow>> {
        let conn = self.conn();
        let (ms, id) = after.unwrap_or((i64::MIN, ""));
        let mut stmt = conn.prepare(&format!(
            "SELECT {COLUMNS} FROM secrets WHERE team = ?1 AND (created_ms, id) > (?2, ?3) \
             ORDER BY created_ms, id LIMIT ?4"
        ))?;
        let rows = stmt.query_map(params![team, ms, id, limit as i64], row)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Delete secret `id` of `team`; false when there was none.
    pub fn delete_secret(&self, team: &str, id: &str) -> Result<bool> {
        let n = self.conn().execute(
            "DELETE FROM secrets WHERE team = ?1 AND id = ?2",
            params![team, id],
        )?;
        Ok(n == 1)
    }
}
