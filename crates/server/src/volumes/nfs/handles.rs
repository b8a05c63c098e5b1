//! NFS ids (host inode numbers) back to paths below the volume's `data/`:
//! the map lookups and listings fill, checked on every use, refilled by a
//! walk of the volume after a miss; and paths opened without leaving it.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use nfsserve::nfs::{fileid3, nfsstat3};
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{FileStat, SFlag};

use super::fs::{errno, join, kind, Inner, NfsResult};

/// Walks of a volume (to find an id no lookup named) at most this often:
/// an id still unknown is stale. A guest cannot make the server walk a
/// big volume over and over by presenting made-up handles.
const WALK_INTERVAL: Duration = Duration::from_secs(2);

impl Inner {
    /// `rel` opened from the volume's top, never leaving it.
    pub(super) fn open(&self, rel: &str, flags: OFlag) -> NfsResult<OwnedFd> {
        let rel = if rel.is_empty() { "." } else { rel };
        let how = OpenHow::new()
            .flags(flags | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW)
            .resolve(
                ResolveFlag::RESOLVE_BENEATH
                    | ResolveFlag::RESOLVE_NO_MAGICLINKS
                    | ResolveFlag::RESOLVE_NO_SYMLINKS,
            );
        nix::fcntl::openat2(self.data.as_fd(), rel, how).map_err(errno)
    }

    pub(super) fn lstat(&self, rel: &str) -> NfsResult<FileStat> {
        let fd = self.open(rel, OFlag::O_PATH)?;
        nix::sys::stat::fstat(fd.as_fd()).map_err(errno)
    }

    pub(super) fn remember(&self, ino: u64, rel: String) {
        self.paths
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(ino, rel);
    }

    fn known(&self, id: fileid3) -> Option<String> {
        self.paths
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
    }

    /// The path of NFS id `id`, checked against the file there now.
    pub(super) fn path(&self, id: fileid3) -> NfsResult<String> {
        if id == self.root {
            return Ok(String::new());
        }
        let missed = Instant::now();
        if let Some(rel) = self.known(id) {
            if self.lstat(&rel).is_ok_and(|st| st.st_ino == id) {
                return Ok(rel);
            }
        }
        self.rescan(missed);
        self.known(id).ok_or(nfsstat3::NFS3ERR_STALE)
    }

    /// `id` opened with `flags` (`O_NOFOLLOW` always), checked to be that
    /// file, and its path.
    pub(super) fn open_id(&self, id: fileid3, flags: OFlag) -> NfsResult<(OwnedFd, String)> {
        let check = |rel: &str| -> NfsResult<OwnedFd> {
            let fd = self.open(rel, flags)?;
            match nix::sys::stat::fstat(fd.as_fd()).map_err(errno)?.st_ino == id {
                true => Ok(fd),
                false => Err(nfsstat3::NFS3ERR_STALE),
            }
        };
        let rel = self.path(id)?;
        match check(&rel) {
            // Renamed or replaced since `path` looked.
            Err(nfsstat3::NFS3ERR_STALE) | Err(nfsstat3::NFS3ERR_NOENT) => {
                self.rescan(Instant::now());
                let rel = self.known(id).ok_or(nfsstat3::NFS3ERR_STALE)?;
                Ok((check(&rel)?, rel))
            }
            r => Ok((r?, rel)),
        }
    }

    /// Walk the whole volume and map every inode to its path (a long call
    /// on a big volume: the runtime's worker hands its other tasks off).
    /// Skipped when a walk started after `missed` (its map is as fresh),
    /// or less than [`WALK_INTERVAL`] ago.
    fn rescan(&self, missed: Instant) {
        let once = || {
            let mut last = self.walked.lock().unwrap_or_else(|p| p.into_inner());
            if last.is_some_and(|t| t >= missed || t.elapsed() < WALK_INTERVAL) {
                return;
            }
            *last = Some(Instant::now());
            self.walk();
        };
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(once),
            _ => once(),
        }
    }

    fn walk(&self) {
        let mut found = HashMap::new();
        let mut stack = vec![String::new()];
        while let Some(dir) = stack.pop() {
            let Ok(entries) = self.entries(&dir) else {
                continue;
            };
            for (name, st) in entries {
                let rel = join(&dir, &name);
                if kind(&st) == SFlag::S_IFDIR {
                    stack.push(rel.clone());
                }
                found.insert(st.st_ino, rel);
            }
        }
        *self.paths.lock().unwrap_or_else(|p| p.into_inner()) = found;
    }
}
