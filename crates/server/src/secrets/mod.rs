//! Secrets (E2B's `Secret`): named, team-scoped values that sandboxes use
//! but never see. A value is write-only: `create` and `update` take it,
//! nothing returns it. It is kept sealed ([`cipher`]) in the database and
//! opened only by a sandbox's egress proxy, at the moment it writes a
//! request header whose transform names it (`${e2b.secrets.<name>}`,
//! `crate::network::inject`), so an update applies to every sandbox at its
//! next request.
//!
//! A single server keeps them in its SQLite file; a cluster's nodes in the
//! catalog (`crate::cluster::secrets`), all under one key.

pub mod cipher;

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use crate::cluster::catalog::Catalog;
use crate::db::{Db, SecretRow};
pub use cipher::Cipher;

/// Bytes a value may have.
pub const MAX_VALUE_BYTES: usize = 64 * 1024;
/// Metadata entries a secret may carry, and bytes of each key and value.
pub const MAX_METADATA: usize = 64;
pub const MAX_METADATA_KEY: usize = 256;
pub const MAX_METADATA_VALUE: usize = 1024;
/// Bytes of a name.
pub const MAX_NAME: usize = 255;

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("secret {0} not found")]
    NotFound(String),
    #[error("a secret named {0:?} exists already")]
    Exists(String),
    #[error("invalid secret name {0:?}: 1-255 bytes without '{{', '}}' or control characters")]
    BadName(String),
    #[error("invalid secret value: {0}")]
    BadValue(String),
    #[error("invalid secret metadata: {0}")]
    BadMetadata(String),
    #[error("secret {0} was updated by another call at the same time; try again")]
    Conflict(String),
    #[error("{0}")]
    Db(#[from] crate::db::DbError),
    #[error("{0}")]
    Cipher(#[from] cipher::CipherError),
    #[error("the cluster's catalog: {0}")]
    Catalog(#[from] crate::cluster::catalog::CatalogError),
    #[error(
        "this node's secrets key is not the cluster's: give every node the same secrets_key_file"
    )]
    OtherKey,
}

pub type Result<T> = std::result::Result<T, SecretError>;

/// A name the SDK can put in a placeholder: no braces, no control
/// characters (the SDK's own rule, `e2b/secret/base.py`).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && !name.chars().any(|c| c == '{' || c == '}' || c.is_control())
}

/// A value goes into HTTP header values: no control characters but tab.
fn check_value(value: &str) -> Result<()> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(SecretError::BadValue(format!(
            "{} bytes; at most {MAX_VALUE_BYTES}",
            value.len()
        )));
    }
    if value.chars().any(|c| c.is_control() && c != '\t') {
        return Err(SecretError::BadValue(
            "values are written into HTTP headers: no control characters (CR, LF, NUL…)".into(),
        ));
    }
    Ok(())
}

fn check_metadata(m: &BTreeMap<String, String>) -> Result<()> {
    if m.len() > MAX_METADATA {
        return Err(SecretError::BadMetadata(format!(
            "{} entries; at most {MAX_METADATA}",
            m.len()
        )));
    }
    for (k, v) in m {
        if k.is_empty() || k.len() > MAX_METADATA_KEY || v.len() > MAX_METADATA_VALUE {
            return Err(SecretError::BadMetadata(format!(
                "key {k:?}: keys are 1-{MAX_METADATA_KEY} bytes, values at most {MAX_METADATA_VALUE}"
            )));
        }
    }
    Ok(())
}

/// Where a cluster node keeps secrets: the catalog, if this node's key
/// is the cluster's.
struct Shared {
    catalog: Catalog,
    key_matches: bool,
}

/// Teams' secrets.
pub struct Secrets {
    db: Arc<Db>,
    shared: OnceLock<Shared>,
    cipher: Cipher,
}

impl Secrets {
    pub fn new(db: Arc<Db>, cipher: Cipher) -> Self {
        Self {
            db,
            shared: OnceLock::new(),
            cipher,
        }
    }

    /// Keep secrets in the cluster's catalog from now on. A node whose key
    /// differs from the one the cluster's first node recorded serves no
    /// secret (each call says why) rather than values it cannot open.
    pub async fn share(&self, catalog: Catalog) -> Result<()> {
        let key_matches = catalog
            .secrets_key_matches(&self.cipher.fingerprint())
            .await?;
        if !key_matches {
            tracing::error!("{}", SecretError::OtherKey);
        }
        let _ = self.shared.set(Shared {
            catalog,
            key_matches,
        });
        Ok(())
    }

    fn catalog(&self) -> Result<Option<&Catalog>> {
        match self.shared.get() {
            Some(s) if s.key_matches => Ok(Some(&s.catalog)),
            Some(_) => Err(SecretError::OtherKey),
            None => Ok(None),
        }
    }

    async fn insert(&self, row: &SecretRow) -> Result<bool> {
        Ok(match self.catalog()? {
            Some(c) => c.insert_secret(row).await?,
            None => self.db.insert_secret(row)?,
        })
    }

    async fn store_update(&self, row: &SecretRow) -> Result<bool> {
        Ok(match self.catalog()? {
            Some(c) => c.update_secret(row).await?,
            None => self.db.update_secret(row)?,
        })
    }

    async fn find(&self, team: &str, id_or_name: &str) -> Result<Option<SecretRow>> {
        Ok(match self.catalog()? {
            Some(c) => c.secret(team, id_or_name).await?,
            None => self.db.get_secret(team, id_or_name)?,
        })
    }

    pub async fn create(
        &self,
        team: &str,
        name: &str,
        value: &str,
        metadata: BTreeMap<String, String>,
    ) -> Result<SecretRow> {
        if !valid_name(name) {
            return Err(SecretError::BadName(name.into()));
        }
        check_value(value)?;
        check_metadata(&metadata)?;
        let id = format!("sec_{}", crate::ids::random_hex(12));
        let now = crate::db::now_ms();
        let sealed = self.cipher.seal(&id, 1, value.as_bytes())?;
        let row = SecretRow {
            id,
            team: team.into(),
            name: name.into(),
            version: 1,
            metadata,
            nonce: sealed.nonce,
            sealed: sealed.data,
            created_ms: now,
            updated_ms: now,
        };
        if !self.insert(&row).await? {
            return Err(SecretError::Exists(name.into()));
        }
        Ok(row)
    }

    /// Store `value` as the next version of `id_or_name`; `metadata`, when
    /// given, replaces the stored one.
    pub async fn update(
        &self,
        team: &str,
        id_or_name: &str,
        value: &str,
        metadata: Option<BTreeMap<String, String>>,
    ) -> Result<SecretRow> {
        check_value(value)?;
        if let Some(m) = &metadata {
            check_metadata(m)?;
        }
        let mut row = self.get(team, id_or_name).await?;
        row.version += 1;
        let sealed = self.cipher.seal(&row.id, row.version, value.as_bytes())?;
        row.nonce = sealed.nonce;
        row.sealed = sealed.data;
        row.updated_ms = crate::db::now_ms().max(row.updated_ms);
        if let Some(m) = metadata {
            row.metadata = m;
        }
        if !self.store_update(&row).await? {
            return Err(SecretError::Conflict(id_or_name.into()));
        }
        Ok(row)
    }

    pub async fn get(&self, team: &str, id_or_name: &str) -> Result<SecretRow> {
        self.find(team, id_or_name)
            .await?
            .ok_or_else(|| SecretError::NotFound(id_or_name.into()))
    }

    /// A page of `team`'s secrets after `after` (a row's `(created_ms, id)`).
    pub async fn list(
        &self,
        team: &str,
        after: Option<(i64, &str)>,
        limit: usize,
    ) -> Result<Vec<SecretRow>> {
        Ok(match self.catalog()? {
            Some(c) => c.secrets(team, after, limit).await?,
            None => self.db.list_secrets(team, after, limit)?,
        })
    }

    /// Forget `id_or_name`; false when there was none.
    pub async fn destroy(&self, team: &str, id_or_name: &str) -> Result<bool> {
        let Some(row) = self.find(team, id_or_name).await? else {
            return Ok(false);
        };
        Ok(match self.catalog()? {
            Some(c) => c.delete_secret(team, &row.id).await?,
            None => self.db.delete_secret(team, &row.id)?,
        })
    }

    /// The current value of `team`'s secret `name` (`None`: no such
    /// secret). Only the egress proxy calls this.
    pub async fn reveal(&self, team: &str, name: &str) -> Result<Option<String>> {
        // Placeholders name secrets, not ids.
        let found = match self.catalog()? {
            Some(c) => c.secret_by_name(team, name).await?,
            None => self.db.secret_by_name(team, name)?,
        };
        let Some(row) = found else {
            return Ok(None);
        };
        let sealed = cipher::Sealed {
            nonce: row.nonce,
            data: row.sealed,
        };
        let plain = self.cipher.open(&row.id, row.version, &sealed)?;
        String::from_utf8(plain)
            .map(Some)
            .map_err(|_| SecretError::Cipher(cipher::CipherError::Open))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (tempfile::TempDir, Secrets) {
        let dir = tempfile::tempdir().unwrap();
        let db = Arc::new(Db::open(&dir.path().join("t.db")).unwrap());
        let c = Cipher::from_key(&[1u8; cipher::KEY_LEN]).unwrap();
        (dir, Secrets::new(db, c))
    }

    #[tokio::test]
    async fn values_are_write_only_and_versions_count_up() {
        let (dir, s) = store();
        let row = s
            .create(
                "t",
                "api-key",
                "v1-value",
                BTreeMap::from([("a".into(), "b".into())]),
            )
            .await
            .unwrap();
        assert_eq!(row.version, 1);
        assert!(matches!(
            s.create("t", "api-key", "x", BTreeMap::new()).await,
            Err(SecretError::Exists(_))
        ));
        assert_eq!(
            s.reveal("t", "api-key").await.unwrap().as_deref(),
            Some("v1-value")
        );
        assert_eq!(
            s.reveal("other", "api-key").await.unwrap(),
            None,
            "team scoped"
        );
        assert_eq!(
            s.reveal("t", &row.id).await.unwrap(),
            None,
            "placeholders name secrets"
        );
        let up = s.update("t", &row.id, "v2-value", None).await.unwrap();
        assert_eq!((up.version, up.metadata.len()), (2, 1));
        assert_eq!(
            s.reveal("t", "api-key").await.unwrap().as_deref(),
            Some("v2-value")
        );
        // The value is nowhere in the database file in clear.
        drop(s);
        for f in std::fs::read_dir(dir.path()).unwrap() {
            let bytes = std::fs::read(f.unwrap().path()).unwrap();
            assert!(!bytes
                .windows(8)
                .any(|w| w == b"v2-value" || w == b"v1-value"));
        }
    }

    #[tokio::test]
    async fn bad_names_values_and_metadata_are_refused() {
        let (_dir, s) = store();
        for name in ["", "a{b", "a}b", "a\nb", &"n".repeat(256)] {
            assert!(matches!(
                s.create("t", name, "v", BTreeMap::new()).await,
                Err(SecretError::BadName(_))
            ));
        }
        assert!(matches!(
            s.create("t", "n", "a\r\nX-Evil: 1", BTreeMap::new()).await,
            Err(SecretError::BadValue(_))
        ));
        assert!(matches!(
            s.create("t", "n", &"v".repeat(MAX_VALUE_BYTES + 1), BTreeMap::new())
                .await,
            Err(SecretError::BadValue(_))
        ));
        assert!(matches!(
            s.create("t", "n", "v", BTreeMap::from([(String::new(), "x".into())]))
                .await,
            Err(SecretError::BadMetadata(_))
        ));
        assert!(matches!(
            s.get("t", "nope").await,
            Err(SecretError::NotFound(_))
        ));
        assert!(!s.destroy("t", "nope").await.unwrap());
        s.create("t", "n", "v", BTreeMap::new()).await.unwrap();
        assert!(s.destroy("t", "n").await.unwrap());
        assert_eq!(s.reveal("t", "n").await.unwrap(), None);
    }
}
