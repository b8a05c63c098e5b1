//! Secrets at rest: AES-256-GCM (ring, the provider rustls runs on here) under one key per server, kept in a file of its own
//! (mode 0600, made on first start). Each value is sealed with a fresh
//! random nonce and its row's id and version as associated data, so a
//! sealed value copied onto another row or version does not open.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};

/// Bytes of the key (AES-256).
pub const KEY_LEN: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum CipherError {
    #[error("secrets key {path}: {detail}")]
    Key { path: PathBuf, detail: String },
    #[error("a sealed secret did not open (wrong key, or the row was altered)")]
    Open,
    #[error("sealing a secret failed")]
    Seal,
}

pub struct Cipher {
    key: LessSafeKey,
}

impl std::fmt::Debug for Cipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Cipher(..)")
    }
}

/// A value sealed for a row: the nonce and the ciphertext with its tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    pub nonce: Vec<u8>,
    pub data: Vec<u8>,
}

impl Cipher {
    /// The key in `path`, made (32 random bytes, mode 0600) when the file
    /// does not exist. A key that others may read is refused.
    pub fn load_or_create(path: &Path) -> Result<Self, CipherError> {
        let err = |detail: String| CipherError::Key {
            path: path.to_path_buf(),
            detail,
        };
        if !path.exists() {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(|e| err(e.to_string()))?;
            }
            let mut key = [0u8; KEY_LEN];
            getrandom::fill(&mut key).map_err(|e| err(e.to_string()))?;
            let tmp = path.with_extension("tmp");
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(|e| err(format!("creating: {e}")))?;
            f.write_all(&key)
                .and_then(|_| f.sync_all())
                .map_err(|e| err(format!("writing: {e}")))?;
            // Not over a key another process made meanwhile.
            std::fs::hard_link(&tmp, path)
                .or_else(|e| match e.kind() {
                    std::io::ErrorKind::AlreadyExists => Ok(()),
                    _ => Err(e),
                })
                .map_err(|e| err(format!("publishing: {e}")))?;
            let _ = std::fs::remove_file(&tmp);
            tracing::info!(path = %path.display(), "made a new key for secrets");
        }
        let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
        if meta.permissions().mode() & 0o077 != 0 {
            return Err(err(format!(
                "readable by others (mode {:o}): chmod 600 it",
                meta.permissions().mode() & 0o777
            )));
        }
        let bytes = std::fs::read(path).map_err(|e| err(e.to_string()))?;
        Self::from_key(&bytes).map_err(|_| {
            err(format!(
                "holds {} bytes; a key is {KEY_LEN} random bytes",
                bytes.len()
            ))
        })
    }

    pub fn from_key(key: &[u8]) -> Result<Self, CipherError> {
        if key.len() != KEY_LEN {
            return Err(CipherError::Seal);
        }
        let unbound = UnboundKey::new(&AES_256_GCM, key).map_err(|_| CipherError::Seal)?;
        Ok(Self {
            key: LessSafeKey::new(unbound),
        })
    }

    /// A fingerprint of the key (not the key): SHA-256 of a fixed text
    /// sealed under it with a zero nonce, which only the same key yields.
    pub fn fingerprint(&self) -> String {
        let mut data = b"tine secrets key fingerprint".to_vec();
        let nonce = Nonce::assume_unique_for_key([0u8; NONCE_LEN]);
        if self
            .key
            .seal_in_place_append_tag(nonce, Aad::empty(), &mut data)
            .is_err()
        {
            return String::new();
        }
        use sha2::Digest;
        sha2::Sha256::digest(&data)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Seal `value` for row `id` at `version`.
    pub fn seal(&self, id: &str, version: i64, value: &[u8]) -> Result<Sealed, CipherError> {
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::fill(&mut nonce).map_err(|_| CipherError::Seal)?;
        let mut data = value.to_vec();
        self.key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad(id, version).as_bytes()),
                &mut data,
            )
            .map_err(|_| CipherError::Seal)?;
        Ok(Sealed {
            nonce: nonce.to_vec(),
            data,
        })
    }

    /// Open what [`Cipher::seal`] sealed for the same row and version.
    pub fn open(&self, id: &str, version: i64, sealed: &Sealed) -> Result<Vec<u8>, CipherError> {
        let nonce: [u8; NONCE_LEN] = sealed
            .nonce
            .as_slice()
            .try_into()
            .map_err(|_| CipherError::Open)?;
        let mut data = sealed.data.clone();
        let plain = self
            .key
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad(id, version).as_bytes()),
                &mut data,
            )
            .map_err(|_| CipherError::Open)?;
        Ok(plain.to_vec())
    }
}

fn aad(id: &str, version: i64) -> String {
    format!("tine-secret:{id}:{version}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_values_open_only_for_their_row_and_version() {
        let c = Cipher::from_key(&[7u8; KEY_LEN]).unwrap();
        let s = c.seal("sec_a", 1, b"hunter2").unwrap();
        assert!(!s.data.windows(7).any(|w| w == b"hunter2"));
        assert_eq!(c.open("sec_a", 1, &s).unwrap(), b"hunter2");
        assert!(c.open("sec_b", 1, &s).is_err());
        assert!(c.open("sec_a", 2, &s).is_err());
        let mut bent = s.clone();
        bent.data[0] ^= 1;
        assert!(c.open("sec_a", 1, &bent).is_err());
        let other = Cipher::from_key(&[8u8; KEY_LEN]).unwrap();
        assert!(other.open("sec_a", 1, &s).is_err());
        let same = Cipher::from_key(&[7u8; KEY_LEN]).unwrap();
        assert_eq!(c.fingerprint(), same.fingerprint());
        assert_ne!(c.fingerprint(), other.fingerprint());
        assert_eq!(c.fingerprint().len(), 64);
        assert_ne!(c.seal("sec_a", 1, b"hunter2").unwrap().nonce, s.nonce);
    }

    #[test]
    fn the_key_file_is_made_private_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys/secrets.key");
        let a = Cipher::load_or_create(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let sealed = a.seal("x", 1, b"v").unwrap();
        let b = Cipher::load_or_create(&path).unwrap();
        assert_eq!(b.open("x", 1, &sealed).unwrap(), b"v");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Cipher::load_or_create(&path).unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&path, b"short").unwrap();
        let e = Cipher::load_or_create(&path).unwrap_err().to_string();
        assert!(e.contains("32 random bytes"), "{e}");
    }
}
