//! Volumes (E2B's `Volume`): named, team-scoped directories that outlive
//! sandboxes, with a content API that reads and writes their files without
//! a sandbox (`/volumecontent/{id}/…`, authorized by the volume's token).
//!
//! ```text
//! <data>/volumes/<id>/data/   the volume's files
//! <data>/volumes/<id>/tmp/    uploads being written (renamed into data/)
//! ```
//!
//! Every path a caller names is resolved inside `data/` by `openat2` with
//! `RESOLVE_BENEATH` ([`content`]): `..` and symlinks (absolute or
//! relative) that lead out of the volume are refused by the kernel, not by
//! string checks. A volume holds at most its `max_bytes` of file contents
//! (`[volumes] max_bytes`); a write past it is refused whole (507) and
//! leaves the volume as it was.

pub mod content;
pub mod nfs;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::db::{Db, VolumeRow};
pub use nfs::{Exports, VolumeMount};

#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("volume {0} not found")]
    NotFound(String),
    #[error("a volume named {0:?} exists already")]
    Exists(String),
    #[error("invalid volume name {0:?}: 1-64 of [A-Za-z0-9_-]")]
    BadName(String),
    #[error("path {0} not found")]
    PathNotFound(String),
    #[error("path {path}: {detail}")]
    BadPath { path: String, detail: String },
    #[error("path {0} exists already")]
    PathExists(String),
    #[error("volume {id} is mounted by sandbox {}", sandboxes.join(", "))]
    InUse { id: String, sandboxes: Vec<String> },
    #[error("volume {id} is full: {detail}")]
    Full { id: String, detail: String },
    #[error("{0}")]
    Db(#[from] crate::db::DbError),
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, VolumeError>;

/// A volume name: 1-64 of `[A-Za-z0-9_-]`.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// The size limit of a new volume of a team.
pub type LimitOf = Box<dyn Fn(&str) -> u64 + Send + Sync>;

pub struct Volumes {
    db: Arc<Db>,
    dir: PathBuf,
    /// Each team's size limit for its new volumes.
    limit_of: LimitOf,
    /// Bytes of file contents in each volume (counted at first use).
    usage: Mutex<HashMap<String, u64>>,
    /// Commits one at a time: each checks the room the last one left.
    writes: Mutex<()>,
}

impl Volumes {
    /// Volumes in `data_dir`, each made with the limit `limit_of` gives
    /// its team (see [`Volumes::with_limit`] for one for all).
    pub fn new(db: Arc<Db>, data_dir: &std::path::Path, limit_of: LimitOf) -> Self {
        Self {
            db,
            dir: data_dir.join("volumes"),
            limit_of,
            usage: Mutex::new(HashMap::new()),
            writes: Mutex::new(()),
        }
    }

    /// Volumes whose limit is `max_bytes` whatever their team.
    pub fn with_limit(db: Arc<Db>, data_dir: &std::path::Path, max_bytes: u64) -> Self {
        Self::new(db, data_dir, Box::new(move |_| max_bytes))
    }

    fn root(&self, id: &str) -> PathBuf {
        self.dir.join(id)
    }

    /// Make volume `name` for `team`.
    pub fn create(&self, team: &str, name: &str) -> Result<VolumeRow> {
        if !valid_name(name) {
            return Err(VolumeError::BadName(name.to_string()));
        }
        let row = VolumeRow {
            id: format!("vol-{}", crate::ids::random_hex(10)),
            team: team.to_string(),
            name: name.to_string(),
            token: format!("vt_{}", crate::ids::random_hex(20)),
            created_ms: crate::db::now_ms(),
            max_bytes: (self.limit_of)(team),
        };
        let root = self.root(&row.id);
        for d in ["data", "tmp"] {
            std::fs::create_dir_all(root.join(d)).map_err(|source| VolumeError::Io {
                context: format!("creating {}", root.join(d).display()),
                source,
            })?;
        }
        // The guest's `user` (uid 1000) owns the volume's top directory.
        let _ = nix::unistd::chown(
            &root.join("data"),
            Some(nix::unistd::Uid::from_raw(content::DEFAULT_UID)),
            Some(nix::unistd::Gid::from_raw(content::DEFAULT_GID)),
        );
        if !self.db.insert_volume(&row)? {
            let _ = std::fs::remove_dir_all(&root);
            return Err(VolumeError::Exists(name.to_string()));
        }
        Ok(row)
    }

    /// Volume `id` (or name) of `team`.
    pub fn get(&self, team: &str, id: &str) -> Result<VolumeRow> {
        self.db
            .get_volume(team, id)?
            .ok_or_else(|| VolumeError::NotFound(id.to_string()))
    }

    pub fn list(&self, team: &str) -> Result<Vec<VolumeRow>> {
        Ok(self.db.list_volumes(team)?)
    }

    /// Remove volume `id` of `team` and its files; false: no such volume.
    /// Refused while a sandbox that is not killed mounts it.
    pub fn destroy(&self, team: &str, id: &str) -> Result<bool> {
        let Some(row) = self.db.get_volume(team, id)? else {
            return Ok(false);
        };
        let users = self.db.sandboxes_mounting(&row.id)?;
        if !users.is_empty() {
            return Err(VolumeError::InUse {
                id: row.id,
                sandboxes: users,
            });
        }
        self.db.delete_volume(&row.id)?;
        self.usage
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&row.id);
        let root = self.root(&row.id);
        std::fs::remove_dir_all(&root).or_else(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Ok(()),
            _ => Err(VolumeError::Io {
                context: format!("removing {}", root.display()),
                source: e,
            }),
        })?;
        Ok(true)
    }

    /// The volume whose id is `id` and whose token is `token` (compared in
    /// constant time); NotFound for a wrong token as for an unknown id.
    pub fn by_token(&self, id: &str, token: &str) -> Result<VolumeRow> {
        let row = self
            .db
            .volume_by_id(id)?
            .ok_or_else(|| VolumeError::NotFound(id.to_string()))?;
        let (a, b) = (row.token.as_bytes(), token.as_bytes());
        let same =
            a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0;
        match same {
            true => Ok(row),
            false => Err(VolumeError::NotFound(id.to_string())),
        }
    }

    /// A new upload's file in volume `id`'s `tmp/` (same filesystem as its
    /// data, so [`content::Content::commit`] renames it into place).
    pub fn upload_path(&self, id: &str) -> PathBuf {
        self.root(id)
            .join("tmp")
            .join(format!("up-{}", crate::ids::random_hex(8)))
    }

    /// The content of volume `row`.
    pub fn content(&self, row: &VolumeRow) -> Result<content::Content<'_>> {
        content::Content::open(self, row)
    }

    /// Bytes of file contents in volume `id`.
    fn usage(&self, id: &str) -> Result<u64> {
        if let Some(u) = self.usage.lock().unwrap_or_else(|p| p.into_inner()).get(id) {
            return Ok(*u);
        }
        let data = self.root(id).join("data");
        // Called off the async runtime only (content calls block).
        let used = tree_bytes(&data).map_err(|source| VolumeError::Io {
            context: format!("counting the bytes of {}", data.display()),
            source,
        })?;
        self.usage
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.to_string(), used);
        Ok(used)
    }

    fn add_usage(&self, id: &str, delta: i64) {
        if let Some(u) = self
            .usage
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(id)
        {
            *u = u.saturating_add_signed(delta);
        }
    }

    /// Counted again at the next use (after a removal).
    fn forget_usage(&self, id: &str) {
        self.usage
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }
}

/// Bytes of the regular files under `dir` (symlinks not followed).
fn tree_bytes(dir: &std::path::Path) -> std::io::Result<u64> {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let m = e.path().symlink_metadata()?;
            if m.is_dir() {
                stack.push(e.path());
            } else if m.is_file() {
                total += m.len();
            }
        }
    }
    Ok(total)
}
