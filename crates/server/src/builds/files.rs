//! Build contexts: the archives (tar, or tar.gz) that the SDK uploads for
//! `COPY` steps, stored by the sha256 of their bytes, with a map from the
//! SDK's `filesHash` (its cache key, computed on the client from paths,
//! modes and contents; the server cannot recompute it, the two SDKs even
//! differ) to the archive's own digest. Layers are keyed by that digest,
//! so a wrong upload under some `filesHash` can never be taken for the
//! layer of another archive.
//!
//! Uploads go to a URL the server signs itself (HMAC-SHA256 over hash and
//! expiry with a per-process key), streamed to disk under a size limit.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::{Stream, StreamExt};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use super::steps::{hex, valid_hash};

#[derive(Debug, thiserror::Error)]
pub enum FilesError {
    #[error("upload URL is invalid or expired")]
    BadSignature,
    #[error("files hash {0:?} is not a sha256 hex digest")]
    BadHash(String),
    #[error("upload is over the limit of {limit} bytes")]
    TooLarge { limit: u64 },
    #[error("upload is not a tar archive (plain or gzip): {0}")]
    NotTar(String),
    #[error("reading the upload: {0}")]
    Body(String),
    #[error("build files: {0}")]
    Io(#[from] std::io::Error),
}

pub struct ContextStore {
    dir: PathBuf,
    key: [u8; 32],
    pub max_bytes: u64,
}

type HmacSha256 = Hmac<Sha256>;

impl ContextStore {
    pub fn new(data_dir: &Path, max_bytes: u64) -> Self {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).expect("the OS has randomness");
        Self {
            dir: data_dir.join("build-files"),
            key,
            max_bytes,
        }
    }

    fn archive(&self, digest: &str) -> PathBuf {
        self.dir.join("sha256").join(digest)
    }

    fn alias(&self, files_hash: &str) -> PathBuf {
        self.dir.join("by-files-hash").join(files_hash)
    }

    /// The digest of the archive uploaded for `files_hash`, if it is here.
    pub fn digest(&self, files_hash: &str) -> Option<String> {
        if !valid_hash(files_hash) {
            return None;
        }
        let d = std::fs::read_to_string(self.alias(files_hash)).ok()?;
        let d = d.trim().to_string();
        (valid_hash(&d) && self.archive(&d).is_file()).then_some(d)
    }

    /// The archive with digest `digest`.
    pub fn archive_path(&self, digest: &str) -> PathBuf {
        self.archive(digest)
    }

    fn sign(&self, files_hash: &str, expires: u64) -> String {
        let mut mac = HmacSha256::new_from_slice(&self.key).expect("any key length");
        mac.update(format!("{files_hash}\n{expires}").as_bytes());
        hex(&mac.finalize().into_bytes())
    }

    /// The path and query of the upload URL for `files_hash`, valid `ttl`.
    pub fn upload_path(&self, files_hash: &str, ttl: Duration) -> String {
        let expires = unix_now() + ttl.as_secs();
        format!(
            "/build-files/{files_hash}?expires={expires}&signature={}",
            self.sign(files_hash, expires)
        )
    }

    /// Check an upload URL's signature (constant time) and expiry.
    pub fn verify(
        &self,
        files_hash: &str,
        expires: u64,
        signature: &str,
    ) -> Result<(), FilesError> {
        if !valid_hash(files_hash) {
            return Err(FilesError::BadHash(files_hash.into()));
        }
        let Ok(sig) = decode_hex(signature) else {
            return Err(FilesError::BadSignature);
        };
        let mut mac = HmacSha256::new_from_slice(&self.key).expect("any key length");
        mac.update(format!("{files_hash}\n{expires}").as_bytes());
        mac.verify_slice(&sig)
            .map_err(|_| FilesError::BadSignature)?;
        if expires < unix_now() {
            return Err(FilesError::BadSignature);
        }
        Ok(())
    }

    /// Stream an upload for `files_hash` to disk: at most `max_bytes`,
    /// checked to be a tar archive, stored under its own digest (returned).
    pub async fn receive<S, E>(&self, files_hash: &str, mut body: S) -> Result<String, FilesError>
    where
        S: Stream<Item = Result<bytes::Bytes, E>> + Unpin,
        E: std::fmt::Display,
    {
        let tmp_dir = self.dir.join("tmp");
        std::fs::create_dir_all(&tmp_dir)?;
        let tmp = tempfile::NamedTempFile::new_in(&tmp_dir)?;
        let mut file = tmp.reopen()?;
        let mut hasher = Sha256::new();
        let mut len = 0u64;
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| FilesError::Body(e.to_string()))?;
            len += chunk.len() as u64;
            if len > self.max_bytes {
                return Err(FilesError::TooLarge {
                    limit: self.max_bytes,
                });
            }
            hasher.update(&chunk);
            file.write_all(&chunk)?;
        }
        file.sync_all()?;
        let path = tmp.path().to_path_buf();
        tokio::task::spawn_blocking(move || check_tar(&path))
            .await
            .map_err(|e| FilesError::NotTar(e.to_string()))??;
        let digest = hex(&hasher.finalize());
        self.commit(files_hash, tmp, &digest)?;
        Ok(digest)
    }

    /// Store a local archive (the CLI's own context) under its digest,
    /// which is also its files hash; returns the digest.
    pub fn insert_local(&self, archive: &Path) -> Result<String, FilesError> {
        check_tar(archive)?;
        let mut h = Sha256::new();
        let mut f = std::fs::File::open(archive)?;
        std::io::copy(&mut f, &mut h)?;
        let digest = hex(&h.finalize());
        let tmp_dir = self.dir.join("tmp");
        std::fs::create_dir_all(&tmp_dir)?;
        let tmp = tempfile::NamedTempFile::new_in(&tmp_dir)?;
        std::fs::copy(archive, tmp.path())?;
        self.commit(&digest, tmp, &digest)?;
        Ok(digest)
    }

    fn commit(
        &self,
        files_hash: &str,
        tmp: tempfile::NamedTempFile,
        digest: &str,
    ) -> Result<(), FilesError> {
        let target = self.archive(digest);
        std::fs::create_dir_all(target.parent().expect("has a parent"))?;
        tmp.persist(&target).map_err(|e| e.error)?;
        let alias = self.alias(files_hash);
        std::fs::create_dir_all(alias.parent().expect("has a parent"))?;
        let tmp = tempfile::NamedTempFile::new_in(alias.parent().expect("has a parent"))?;
        std::fs::write(tmp.path(), digest)?;
        tmp.as_file().sync_all()?;
        tmp.persist(&alias).map_err(|e| e.error)?;
        Ok(())
    }
}

/// Read every header of a tar (or tar.gz) archive.
fn check_tar(path: &Path) -> Result<(), FilesError> {
    let mut f = std::fs::File::open(path)?;
    let mut magic = [0u8; 2];
    let n = f.read(&mut magic)?;
    drop(f);
    let f = std::fs::File::open(path)?;
    let reader: Box<dyn Read> = if n == 2 && magic == [0x1f, 0x8b] {
        Box::new(flate2::read::GzDecoder::new(f))
    } else {
        Box::new(f)
    };
    let mut archive = tar::Archive::new(reader);
    let entries = archive
        .entries()
        .map_err(|e| FilesError::NotTar(e.to_string()))?;
    let mut count = 0usize;
    for e in entries {
        e.map_err(|e| FilesError::NotTar(e.to_string()))?;
        count += 1;
    }
    if count == 0 {
        return Err(FilesError::NotTar("it has no entries".into()));
    }
    Ok(())
}

fn decode_hex(s: &str) -> Result<Vec<u8>, ()> {
    if !s.len().is_multiple_of(2) {
        return Err(());
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2).ok_or(())?, 16).map_err(|_| ()))
        .collect()
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tar_bytes() -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(2);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, "a.txt", &b"hi"[..]).unwrap();
        b.into_inner().unwrap()
    }

    fn stream(v: Vec<u8>) -> impl Stream<Item = Result<bytes::Bytes, std::io::Error>> + Unpin {
        futures::stream::iter(vec![Ok(bytes::Bytes::from(v))])
    }

    const H: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

    #[tokio::test]
    async fn stores_by_digest_and_maps_the_files_hash() {
        let dir = tempfile::tempdir().unwrap();
        let s = ContextStore::new(dir.path(), 1 << 20);
        assert_eq!(s.digest(H), None);
        let d = s.receive(H, stream(tar_bytes())).await.unwrap();
        assert_eq!(s.digest(H).as_deref(), Some(d.as_str()));
        assert!(s.archive_path(&d).is_file());
    }

    #[tokio::test]
    async fn refuses_garbage_and_oversize() {
        let dir = tempfile::tempdir().unwrap();
        let s = ContextStore::new(dir.path(), 100);
        assert!(matches!(
            s.receive(H, stream(tar_bytes())).await,
            Err(FilesError::TooLarge { .. })
        ));
        let s = ContextStore::new(dir.path(), 1 << 20);
        assert!(matches!(
            s.receive(H, stream(b"not a tar at all".repeat(64))).await,
            Err(FilesError::NotTar(_))
        ));
        assert_eq!(s.digest(H), None);
    }

    #[test]
    fn signatures_bind_hash_and_expiry() {
        let dir = tempfile::tempdir().unwrap();
        let s = ContextStore::new(dir.path(), 1);
        let url = s.upload_path(H, Duration::from_secs(60));
        let q: std::collections::HashMap<String, String> =
            serde_urlencoded::from_str(url.split_once('?').unwrap().1).unwrap();
        let exp: u64 = q["expires"].parse().unwrap();
        s.verify(H, exp, &q["signature"]).unwrap();
        assert!(s.verify(H, exp + 1, &q["signature"]).is_err());
        let other = "b".repeat(64);
        assert!(s.verify(&other, exp, &q["signature"]).is_err());
        assert!(s.verify(H, exp, "zz").is_err());
        // An expired but well-signed URL is refused too.
        let old = 1000;
        let sig = s.sign(H, old);
        assert!(s.verify(H, old, &sig).is_err());
    }
}
