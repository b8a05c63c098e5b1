//! API keys. Only a SHA-256 of each key is stored: keys are 20 random
//! bytes, so a fast unsalted hash is safe and lets lookups use an index.
//!
//! A key looks like E2B's own, `e2b_` and 40 hex digits, because some SDK
//! versions refuse any other shape on the client before sending a request.
//! Keys made by older tine versions (`tine_` and 64 hex digits) keep
//! working until they are revoked.

use rusqlite::{params, OptionalExtension};
use sha2::{Digest, Sha256};

use super::{now_ms, Db, Result};

/// Every new key starts with this (E2B's prefix, which SDKs check).
pub const KEY_PREFIX: &str = "e2b_";
/// Random bytes in a key: 40 hex digits, the length E2B's keys have.
const KEY_BYTES: usize = 20;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKey {
    pub id: String,
    pub name: String,
    /// The first characters of the key, to tell keys apart in listings.
    pub prefix: String,
    pub created_ms: i64,
    pub revoked_ms: Option<i64>,
    /// What it may see and change: its team's sandboxes, snapshots and
    /// templates (and the shared base templates).
    pub team: String,
}

/// The team of keys made without one.
pub const DEFAULT_TEAM: &str = "default";

/// A key just created: the only time its plaintext is known.
#[derive(Debug)]
pub struct NewKey {
    pub key: ApiKey,
    pub plaintext: String,
}

/// An `ApiKey` from a row of `id, name, prefix, created_ms, revoked_ms,
/// team`.
fn key_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<ApiKey> {
    Ok(ApiKey {
        id: r.get(0)?,
        name: r.get(1)?,
        prefix: r.get(2)?,
        created_ms: r.get(3)?,
        revoked_ms: r.get(4)?,
        team: r.get(5)?,
    })
}

pub use crate::ids::valid_team;

/// A new key's plaintext (E2B's shape).
pub fn new_key_plaintext() -> String {
    format!("{KEY_PREFIX}{}", crate::ids::random_hex(KEY_BYTES))
}

/// What is stored of a key: its SHA-256, hex.
pub fn hash(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl Db {
    pub fn create_key(&self, name: &str) -> Result<NewKey> {
        self.create_team_key(name, DEFAULT_TEAM)
    }

    /// A key of team `team` (checked with [`valid_team`] by the caller).
    pub fn create_team_key(&self, name: &str, team: &str) -> Result<NewKey> {
        let plaintext = new_key_plaintext();
        let key = ApiKey {
            id: format!("key_{}", crate::ids::random_hex(6)),
            name: name.to_string(),
            prefix: plaintext[..KEY_PREFIX.len() + 6].to_string(),
            created_ms: now_ms(),
            revoked_ms: None,
            team: team.to_string(),
        };
        self.conn().execute(
            "INSERT INTO api_keys (id, name, hash, prefix, created_ms, team) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![
                key.id,
                key.name,
                hash(&plaintext),
                key.prefix,
                key.created_ms,
                key.team
            ],
        )?;
        Ok(NewKey { key, plaintext })
    }

    /// The key with this plaintext, if it exists and is not revoked.
    pub fn verify_key(&self, plaintext: &str) -> Result<Option<ApiKey>> {
        Ok(self
            .conn()
            .query_row(
                "SELECT id, name, prefix, created_ms, revoked_ms, team FROM api_keys WHERE hash = ?1 AND revoked_ms IS NULL",
                [hash(plaintext)],
                key_from_row,
            )
            .optional()?)
    }

    pub fn list_keys(&self) -> Result<Vec<ApiKey>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT id, name, prefix, created_ms, revoked_ms, team FROM api_keys ORDER BY created_ms",
        )?;
        let rows = stmt.query_map([], key_from_row)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Revoke key `id`; returns false when there is no such active key.
    pub fn revoke_key(&self, id: &str) -> Result<bool> {
        let n = self.conn().execute(
            "UPDATE api_keys SET revoked_ms = ?2 WHERE id = ?1 AND revoked_ms IS NULL",
            params![id, now_ms()],
        )?;
        Ok(n == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_keys_look_like_e2b_keys_and_old_ones_still_verify() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("t.db")).unwrap();
        let new = db.create_key("k").unwrap();
        let hex = new.plaintext.strip_prefix("e2b_").expect("e2b_ prefix");
        assert_eq!(hex.len(), 40);
        assert!(hex
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(
            db.verify_key(&new.plaintext).unwrap().unwrap().id,
            new.key.id
        );
        // A key an older tine made: only its hash is in the table.
        let old = format!("tine_{}", "ab".repeat(32));
        db.conn()
            .execute(
                "INSERT INTO api_keys (id, name, hash, prefix, created_ms) VALUES ('key_old', 'old', ?1, 'tine_ababab', 1)",
                [hash(&old)],
            )
            .unwrap();
        assert_eq!(db.verify_key(&old).unwrap().unwrap().id, "key_old");
        assert!(db.revoke_key("key_old").unwrap());
        assert!(db.verify_key(&old).unwrap().is_none());
        assert!(db.verify_key("e2b_0000").unwrap().is_none());
    }
}
