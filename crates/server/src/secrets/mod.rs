//! Secrets (E2B's `Secret`): named, team-scoped values that sandboxes use
//! but never see. A value is write-only: `create` and `update` take it,
//! nothing returns it. It is kept sealed ([`cipher`]) in the database and
//! opened only by a sandbox's egress proxy, at the moment it writes a
//! request header whose transform names it (`${e2b.secrets.<name>}`,
//! `crate::network::inject`), so an update applies to every sandbox at its
//! next request.

pub mod cipher;

use std::collections::BTreeMap;
use std::sync::Arc;

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

/// Teams' secrets.
pub struct Secrets {
    db: Arc<Db>,
    cipher: Cipher,
}

impl Secrets {
    pub fn new(db: Arc<Db>, cipher: Cipher) -> Self {
        Self { db, cipher }
    }

    pub fn create(
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
        if !self.db.insert_secret(&row)? {
            return Err(SecretError::Exists(name.into()));
        }
        Ok(row)
    }

    /// Store `value` as the next version of `id_or_name`; `metadata`, when
    /// given, replaces the stored one.
    pub fn update(
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
        let mut row = self.get(team, id_or_name)?;
        row.version += 1;
        let sealed = self.cipher.seal(&row.id, row.version, value.as_bytes())?;
        row.nonce = sealed.nonce;
        row.sealed = sealed.data;
        row.updated_ms = crate::db::now_ms().max(row.updated_ms);
        if let Some(m) = metadata {
            row.metadata = m;
        }
        if !self.db.update_secret(&row)? {
            return Err(SecretError::Conflict(id_or_name.into()));
        }
        Ok(row)
    }

    pub fn get(&self, team: &str, id_or_name: &str) -> Result<SecretRow> {
        self.db
            .get_secret(team, id_or_name)?
            .ok_or_else(|| SecretError::NotFound(id_or_name.into()))
    }

    /// A page of `team`'s secrets after `after` (a row's `(created_ms, id)`).
    pub fn list(
        &self,
        team: &str,
        after: Option<(i64, &str)>,
        limit: usize,
    ) -> Result<Vec<SecretRow>> {
        Ok(self.db.list_secrets(team, after, limit)?)
    }

    /// Forget `id_or_name`; false when there was none.
    pub fn destroy(&self, team: &str, id_or_name: &str) -> Result<bool> {
        match self.db.get_secret(team, id_or_name)? {
            Some(row) => Ok(self.db.delete_secret(team, &row.id)?),
            None => Ok(false),
        }
    }

    /// The current value of `team`'s secret `name` (`None`: no such
    /// secret). Only the egress proxy calls this.
    pub fn reveal(&self, team: &str, name: &str) -> Result<Option<String>> {
        let Some(row) = self.db.get_secret(team, name)? else {
            return Ok(None);
        };
        if row.name != name {
            // Placeholders name secrets, not ids.
            return Ok(None);
        }
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

    #[test]
    fn values_are_write_only_and_versions_count_up() {
        let (dir, s) = store();
        let row = s
            .create(
                "t",
                "api-key",
                "v1-value",
                BTreeMap::from([("a".into(), "b".into())]),
            )
            .unwrap();
        assert_eq!(row.version, 1);
        assert!(matches!(
            s.create("t", "api-key", "x", BTreeMap::new()),
            Err(SecretError::Exists(_))
        ));
        assert_eq!(
            s.reveal("t", "api-key").unwrap().as_deref(),
            Some("v1-value")
        );
        assert_eq!(s.reveal("other", "api-key").unwrap(), None, "team scoped");
        assert_eq!(
            s.reveal("t", &row.id).unwrap(),
            None,
            "placeholders name secrets"
        );
        let up = s.update("t", &row.id, "v2-value", None).unwrap();
        assert_eq!((up.version, up.metadata.len()), (2, 1));
        assert_eq!(
            s.reveal("t", "api-key").unwrap().as_deref(),
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

    #[test]
    fn bad_names_values_and_metadata_are_refused() {
        let (_dir, s) = store();
        for name in ["", "a{b", "a}b", "a\nb", &"n".repeat(256)] {
            assert!(matches!(
                s.create("t", name, "v", BTreeMap::new()),
                Err(SecretError::BadName(_))
            ));
        }
        assert!(matches!(
            s.create("t", "n", "a\r\nX-Evil: 1", BTreeMap::new()),
            Err(SecretError::BadValue(_))
        ));
        assert!(matches!(
            s.create("t", "n", &"v".repeat(MAX_VALUE_BYTES + 1), BTreeMap::new()),
            Err(SecretError::BadValue(_))
        ));
        assert!(matches!(
            s.create("t", "n", "v", BTreeMap::from([(String::new(), "x".into())])),
            Err(SecretError::BadMetadata(_))
        ));
        assert!(matches!(s.get("t", "nope"), Err(SecretError::NotFound(_))));
        assert!(!s.destroy("t", "nope").unwrap());
        s.create("t", "n", "v", BTreeMap::new()).unwrap();
        assert!(s.destroy("t", "n").unwrap());
        assert_eq!(s.reveal("t", "n").unwrap(), None);
    }
}
