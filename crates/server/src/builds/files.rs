//! Build contexts: the archives (tar, or tar.gz) that the SDK uploads for
//! `COPY` steps, stored by the sha256 of their bytes, with a map per team
//! from the SDK's `filesHash` (its cache key, computed on the client from
//! paths, modes and contents; the server cannot recompute it, the two SDKs
//! even differ) to the archive's own digest. Layers are keyed by that
//! digest, so a wrong upload under some `filesHash` can never be taken for
//! the layer of another archive.
//!
//! The map is per team and written once: a `filesHash` is public (anyone
//! with the files computes it), so an upload by one team never becomes
//! what another team's build copies, and an upload never replaces what a
//! team's earlier builds used.
//!
//! Uploads go to a URL the server signs itself (HMAC-SHA256 over team,
//! hash and expiry with a per-process key), streamed to disk under a size
//! limit.

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
        let dir = data_dir.join("build-files");
        // The map of earlier versions, shared by every team: dropped (a
        // build whose files it named uploads them again).
        let _ = std::fs::remove_dir_all(dir.join("by-files-hash"));
        Self {
            dir,
            key,
            max_bytes,
        }
    }

    fn archive(&self, digest: &str) -> PathBuf {
        self.dir.join("sha256").join(digest)
    }

    /// Where `team`'s map names the archive of `files_hash` (both checked
    /// by the caller: a team name is `[A-Za-z0-9_-]{1,64}`).
    fn alias(&self, team: &str, files_hash: &str) -> PathBuf {
        self.dir.join("by-team").join(team).join(files_hash)
    }

    /// The digest of the archive `team` uploaded for `files_hash`, if it
    /// is here.
    pub fn digest(&self, team: &str, files_hash: &str) -> Option<String> {
        if !valid_hash(files_hash) || !crate::ids::valid_team(team) {
            return None;
        }
        let d = std::fs::read_to_string(self.alias(team, files_hash)).ok()?;
        let d = d.trim().to_string();
        (valid_hash(&d) && self.archive(&d).is_file()).then_some(d)
    }

    /// The archive with digest `digest`.
    pub fn archive_path(&self, digest: &str) -> PathBuf {
        self.archive(digest)
    }

    fn mac(&self, team: &str, files_hash: &str, expires: u64) -> HmacSha256 {
        let mut mac = HmacSha256::new_from_slice(&self.key).expect("any key length");
        mac.update(format!("{team}\n{files_hash}\n{expires}").as_bytes());
        mac
    }

    /// The path and query of `team`'s upload URL for `files_hash`, valid
    /// `ttl`.
    pub fn upload_path(&self, team: &str, files_hash: &str, ttl: Duration) -> String {
        let expires = unix_now() + ttl.as_secs();
        let sig = hex(&self.mac(team, files_hash, expires).finalize().into_bytes());
        format!("/build-files/{files_hash}?team={team}&expires={expires}&signature={sig}")
    }

    /// Check an upload URL's signature (constant time) and expiry.
    pub fn verify(
        &self,
        team: &str,
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
        if !crate::ids::valid_team(team) {
            return Err(FilesError::BadSignature);
        }
        self.mac(team, files_hash, expires)
            .verify_slice(&sig)
            .map_err(|_| FilesError::BadSignature)?;
        if expires < unix_now() {
            return Err(FilesError::BadSignature);
        }
        Ok(())
    }

    /// Stream `team`'s upload for `files_hash` to disk: at most
    /// `max_bytes`, checked to be a tar archive, stored under its own
    /// digest (returned). When the team has files for that hash already,
    /// they stay what its builds copy (and their digest is returned).
    pub async fn receive<S, E>(
        &self,
        team: &str,
        files_hash: &str,
        mut body: S,
    ) -> Result<String, FilesError>
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
        self.commit(team, files_hash, tmp, &digest)
    }

    /// Store a local archive (the CLI's own context, for `team`) under its
    /// digest, which is also its files hash; returns the digest.
    pub fn insert_local(&self, team: &str, archive: &Path) -> Result<String, FilesError> {
        check_tar(archive)?;
        let mut h = Sha256::new();
        let mut f = std::fs::File::open(archive)?;
        std::io::copy(&mut f, &mut h)?;
        let digest = hex(&h.finalize());
        let tmp_dir = self.dir.join("tmp");
        std::fs::create_dir_all(&tmp_dir)?;
        let tmp = tempfile::NamedTempFile::new_in(&tmp_dir)?;
        std::fs::copy(archive, tmp.path())?;
        self.commit(team, &digest, tmp, &digest)
    }

    /// Keep the archive under `digest` and map `team`'s `files_hash` to it
    /// unless the team's map has that hash already (written once: the
    /// first upload stays); returns the digest the map names.
    fn commit(
        &self,
        team: &str,
        files_hash: &str,
        tmp: tempfile::NamedTempFile,
        digest: &str,
    ) -> Result<String, FilesError> {
        if !crate::ids::valid_team(team) {
            return Err(FilesError::BadSignature);
        }
        if let Some(kept) = self.digest(team, files_hash) {
            return Ok(kept);
        }
        let target = self.archive(digest);
        std::fs::create_dir_all(target.parent().expect("has a parent"))?;
        tmp.persist(&target).map_err(|e| e.error)?;
        let alias = self.alias(team, files_hash);
        let parent = alias.parent().expect("has a parent");
        std::fs::create_dir_all(parent)?;
        let tmp = tempfile::NamedTempFile::new_in(parent)?;
        std::fs::write(tmp.path(), digest)?;
        tmp.as_file().sync_all()?;
        match tmp.persist_noclobber(&alias) {
            Ok(_) => Ok(digest.to_string()),
            Err(e) if e.error.kind() == std::io::ErrorKind::AlreadyExists => {
                // Another upload of the same team and hash came first; or
                // the map names an archive that is gone, and is replaced.
                match self.digest(team, files_hash) {
                    Some(kept) => Ok(kept),
                    None => {
                        e.file.persist(&alias).map_err(|e| e.error)?;
                        Ok(digest.to_string())
                    }
                }
            }
            Err(e) => Err(e.error.into()),
        }
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
        assert_eq!(s.digest("red", H), None);
        let d = s.receive("red", H, stream(tar_bytes())).await.unwrap();
        assert_eq!(s.digest("red", H).as_deref(), Some(d.as_str()));
        assert!(s.archive_path(&d).is_file());
        // Path-like team names name nothing.
        assert_eq!(s.digest("../red", H), None);
    }

    fn other_tar() -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(4);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, "evil.sh", &b"pwnd"[..]).unwrap();
        b.into_inner().unwrap()
    }

    /// The attack: another team uploads its own files under the victim's
    /// (public) files hash, before and after the victim.
    #[tokio::test]
    async fn one_teams_upload_is_never_anothers_files_and_the_first_stays() {
        let dir = tempfile::tempdir().unwrap();
        let s = ContextStore::new(dir.path(), 1 << 20);
        let evil = s.receive("mallory", H, stream(other_tar())).await.unwrap();
        assert_eq!(
            s.digest("victim", H),
            None,
            "the victim's SDK uploads its own"
        );
        let good = s.receive("victim", H, stream(tar_bytes())).await.unwrap();
        assert_ne!(good, evil);
        assert_eq!(s.digest("victim", H).as_deref(), Some(good.as_str()));
        // A later upload under the same hash (same team) changes nothing.
        let again = s.receive("victim", H, stream(other_tar())).await.unwrap();
        assert_eq!(again, good);
        assert_eq!(s.digest("victim", H).as_deref(), Some(good.as_str()));
        assert_eq!(s.digest("mallory", H).as_deref(), Some(evil.as_str()));
        // The map of an archive that is gone is written anew.
        std::fs::remove_file(s.archive_path(&good)).unwrap();
        assert_eq!(s.digest("victim", H), None);
        let back = s.receive("victim", H, stream(tar_bytes())).await.unwrap();
        assert_eq!(back, good);
        assert_eq!(s.digest("victim", H).as_deref(), Some(good.as_str()));
    }

    #[tokio::test]
    async fn refuses_garbage_and_oversize() {
        let dir = tempfile::tempdir().unwrap();
        let s = ContextStore::new(dir.path(), 100);
        assert!(matches!(
            s.receive("red", H, stream(tar_bytes())).await,
            Err(FilesError::TooLarge { .. })
        ));
        let s = ContextStore::new(dir.path(), 1 << 20);
        assert!(matches!(
            s.receive("red", H, stream(b"not a tar at all".repeat(64)))
                .await,
            Err(FilesError::NotTar(_))
        ));
        assert_eq!(s.digest("red", H), None);
    }

    #[test]
    fn signatures_bind_team_hash_and_expiry() {
        let dir = tempfile::tempdir().unwrap();
        let s = ContextStore::new(dir.path(), 1);
        let url = s.upload_path("red", H, Duration::from_secs(60));
        let q: std::collections::HashMap<String, String> =
            serde_urlencoded::from_str(url.split_once('?').unwrap().1).unwrap();
        assert_eq!(q["team"], "red");
        let exp: u64 = q["expires"].parse().unwrap();
        s.verify("red", H, exp, &q["signature"]).unwrap();
        assert!(s.verify("red", H, exp + 1, &q["signature"]).is_err());
        assert!(s.verify("blue", H, exp, &q["signature"]).is_err());
        let other = "b".repeat(64);
        assert!(s.verify("red", &other, exp, &q["signature"]).is_err());
        assert!(s.verify("red", H, exp, "zz").is_err());
        // An expired but well-signed URL is refused too.
        let old = 1000;
        let sig = hex(&s.mac("red", H, old).finalize().into_bytes());
        assert!(s.verify("red", H, old, &sig).is_err());
    }
}
