//! The `tine_api_keys` table: the cluster's API keys.

use super::{Catalog, ClusterKey, Result, NOW_MS};

impl Catalog {
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
