//! A cluster's secrets (`tine_secrets`): one store for every node, so a
//! secret made through any gateway is found by the egress proxy of a
//! sandbox on any node. Values stay sealed ([`crate::secrets::cipher`])
//! under the key every node shares (`secrets_key_file`, the same file on
//! each); `tine_secrets_key` holds its fingerprint, so a node with
//! another key is told so instead of failing to open every value.

use std::collections::BTreeMap;

use super::catalog::{Catalog, CatalogError, Result};
use crate::db::SecretRow;

const COLUMNS: &str = "id, team, name, version, metadata, nonce, sealed, created_ms, updated_ms";

fn row(r: &tokio_postgres::Row) -> SecretRow {
    let metadata: String = r.get(4);
    SecretRow {
        id: r.get(0),
        team: r.get(1),
        name: r.get(2),
        version: r.get(3),
        metadata: serde_json::from_str::<BTreeMap<String, String>>(&metadata).unwrap_or_default(),
        nonce: r.get(5),
        sealed: r.get(6),
        created_ms: r.get(7),
        updated_ms: r.get(8),
    }
}

fn metadata_json(m: &BTreeMap<String, String>) -> String {
    serde_json::to_string(m).unwrap_or_else(|_| "{}".into())
}

impl Catalog {
    /// Record the fingerprint of the cluster's secrets key (the first node
    /// to ask sets it); whether `fingerprint` is it.
    pub async fn secrets_key_matches(&self, fingerprint: &str) -> Result<bool> {
        let db = self.pool.get().await?;
        db.execute(
            "INSERT INTO tine_secrets_key (id, fingerprint) VALUES (1, $1) ON CONFLICT DO NOTHING",
            &[&fingerprint],
        )
        .await?;
        let row = db
            .query_one("SELECT fingerprint FROM tine_secrets_key WHERE id = 1", &[])
            .await?;
        Ok(row.get::<_, String>(0) == fingerprint)
    }

    pub async fn insert_secret(&self, s: &SecretRow) -> Result<bool> {
        let db = self.pool.get().await?;
        let n = db
            .execute(
                &format!(
                    "INSERT INTO tine_secrets ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
                     ON CONFLICT DO NOTHING"
                ),
                &[
                    &s.id,
                    &s.team,
                    &s.name,
                    &s.version,
                    &metadata_json(&s.metadata),
                    &s.nonce,
                    &s.sealed,
                    &s.created_ms,
                    &s.updated_ms,
                ],
            )
            .await?;
        Ok(n == 1)
    }

    /// Store version `s.version` if the stored one is the one before.
    pub async fn update_secret(&self, s: &SecretRow) -> Result<bool> {
        let db = self.pool.get().await?;
        let n = db
            .execute(
                "UPDATE tine_secrets SET version = $2::bigint, metadata = $3, nonce = $4,
                 sealed = $5, updated_ms = $6 WHERE id = $1 AND version = $2::bigint - 1",
                &[
                    &s.id,
                    &s.version,
                    &metadata_json(&s.metadata),
                    &s.nonce,
                    &s.sealed,
                    &s.updated_ms,
                ],
            )
            .await?;
        Ok(n == 1)
    }

    pub async fn secret(&self, team: &str, id_or_name: &str) -> Result<Option<SecretRow>> {
        let db = self.pool.get().await?;
        let r = db
            .query_opt(
                &format!(
                    "SELECT {COLUMNS} FROM tine_secrets WHERE team = $1 AND (id = $2 OR name = $2)
                     ORDER BY id = $2 DESC LIMIT 1"
                ),
                &[&team, &id_or_name],
            )
            .await?;
        Ok(r.as_ref().map(row))
    }

    /// Secret `name` of `team`, by name only.
    pub async fn secret_by_name(&self, team: &str, name: &str) -> Result<Option<SecretRow>> {
        let db = self.pool.get().await?;
        let r = db
            .query_opt(
                &format!("SELECT {COLUMNS} FROM tine_secrets WHERE team = $1 AND name = $2"),
                &[&team, &name],
            )
            .await?;
        Ok(r.as_ref().map(row))
    }

    pub async fn secrets(
        &self,
        team: &str,
        after: Option<(i64, &str)>,
        limit: usize,
    ) -> Result<Vec<SecretRow>> {
        let db = self.pool.get().await?;
        let (ms, id) = after.unwrap_or((i64::MIN, ""));
        let limit = i64::try_from(limit).map_err(|e| CatalogError::Query(e.to_string()))?;
        let rows = db
            .query(
                &format!(
                    "SELECT {COLUMNS} FROM tine_secrets WHERE team = $1 AND (created_ms, id) > ($2, $3)
                     ORDER BY created_ms, id LIMIT $4"
                ),
                &[&team, &ms, &id, &limit],
            )
            .await?;
        Ok(rows.iter().map(row).collect())
    }

    pub async fn delete_secret(&self, team: &str, id: &str) -> Result<bool> {
        let db = self.pool.get().await?;
        let n = db
            .execute(
                "DELETE FROM tine_secrets WHERE team = $1 AND id = $2",
                &[&team, &id],
            )
            .await?;
        Ok(n == 1)
    }
}
