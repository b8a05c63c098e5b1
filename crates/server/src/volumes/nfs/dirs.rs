//! Names in a volume's directories: lookups, listings, making, removing
//! and renaming entries, and reading symlinks.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use nfsserve::nfs::{fattr3, fileid3, nfspath3, nfsstat3, sattr3, set_mode3};
use nfsserve::vfs::{DirEntry, ReadDirResult};
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{FileStat, Mode, SFlag};

use super::super::content::{DEFAULT_GID, DEFAULT_UID};
use super::fs::{errno, join, kind, name_of, Inner, NfsResult};

impl Inner {
    /// The names in directory `rel` with what each is, in inode order.
    pub(super) fn entries(&self, rel: &str) -> NfsResult<Vec<(String, FileStat)>> {
        let fd = self.open(rel, OFlag::O_RDONLY | OFlag::O_DIRECTORY)?;
        let mut dir = nix::dir::Dir::from_fd(fd).map_err(errno)?;
        let dfd = dir.as_raw_fd();
        let mut out = Vec::new();
        for e in dir.iter() {
            let e = e.map_err(errno)?;
            let name = e.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            let Ok(name) = std::str::from_utf8(name) else {
                continue;
            };
            // SAFETY: `dfd` is the open directory `dir` owns, alive for
            // this loop; it is only borrowed for the call.
            let at = unsafe { std::os::fd::BorrowedFd::borrow_raw(dfd) };
            if let Ok(st) = nix::sys::stat::fstatat(at, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
                out.push((name.to_string(), st));
            }
        }
        out.sort_by_key(|(_, st)| st.st_ino);
        Ok(out)
    }

    /// Directory `dirid`, opened, and its path.
    fn dir(&self, dirid: fileid3) -> NfsResult<(OwnedFd, String)> {
        let rel = self.path(dirid)?;
        let fd = self.open(&rel, OFlag::O_PATH | OFlag::O_DIRECTORY)?;
        Ok((fd, rel))
    }

    pub(super) fn lookup(&self, dirid: fileid3, name: &[u8]) -> NfsResult<fileid3> {
        match name {
            b"." => return Ok(dirid),
            b".." => {
                let rel = self.path(dirid)?;
                let up = rel.rsplit_once('/').map(|(u, _)| u).unwrap_or("");
                return Ok(self.lstat(up)?.st_ino);
            }
            _ => {}
        }
        let name = name_of(name)?;
        let (dir, rel) = self.dir(dirid)?;
        let st = nix::sys::stat::fstatat(dir.as_fd(), name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(errno)?;
        self.remember(st.st_ino, join(&rel, &name));
        Ok(st.st_ino)
    }

    /// Make `name` in `dirid` with `make` (given the directory and name),
    /// owned by `user`, and return what it is.
    pub(super) fn make(
        &self,
        dirid: fileid3,
        name: &[u8],
        make: impl FnOnce(&OwnedFd, &str) -> Result<(), Errno>,
    ) -> NfsResult<(fileid3, fattr3)> {
        let name = name_of(name)?;
        let (dir, rel) = self.dir(dirid)?;
        make(&dir, &name).map_err(errno)?;
        nix::unistd::fchownat(
            dir.as_fd(),
            name.as_str(),
            Some(nix::unistd::Uid::from_raw(DEFAULT_UID)),
            Some(nix::unistd::Gid::from_raw(DEFAULT_GID)),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(errno)?;
        let st = nix::sys::stat::fstatat(dir.as_fd(), name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(errno)?;
        self.remember(st.st_ino, join(&rel, &name));
        Ok((st.st_ino, self.attr(&st)))
    }

    pub(super) fn create_file(&self, dirid: fileid3, name: &[u8], mode: u32) -> NfsResult<fileid3> {
        let (id, _) = self.make(dirid, name, |dir, name| {
            let how = OpenHow::new()
                .flags(OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_WRONLY | OFlag::O_CLOEXEC)
                .mode(Mode::from_bits_truncate(mode & 0o7777))
                .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS);
            let fd = nix::fcntl::openat2(dir.as_fd(), name, how)?;
            // The mode asked for, not what the server's umask leaves of it.
            nix::sys::stat::fchmod(fd.as_fd(), Mode::from_bits_truncate(mode & 0o7777))
        })?;
        Ok(id)
    }

    pub(super) fn create(
        &self,
        dirid: fileid3,
        name: &[u8],
        set: sattr3,
    ) -> NfsResult<(fileid3, fattr3)> {
        let mode = match set.mode {
            set_mode3::mode(m) => m,
            set_mode3::Void => 0o644,
        };
        // UNCHECKED: an existing file is opened (and set) instead.
        let id = match self.create_file(dirid, name, mode) {
            Ok(id) => id,
            Err(nfsstat3::NFS3ERR_EXIST) => self.lookup(dirid, name)?,
            Err(e) => return Err(e),
        };
        let set = sattr3 {
            mode: set_mode3::Void,
            ..set
        };
        Ok((id, self.setattr(id, set)?))
    }

    pub(super) fn remove(&self, dirid: fileid3, name: &[u8]) -> NfsResult<()> {
        let name = name_of(name)?;
        let (dir, _) = self.dir(dirid)?;
        // Under the lock: what it freed is counted once.
        let _one = self.vols.writes.lock().unwrap_or_else(|p| p.into_inner());
        let st = nix::sys::stat::fstatat(dir.as_fd(), name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(errno)?;
        let flag = match kind(&st) == SFlag::S_IFDIR {
            true => nix::unistd::UnlinkatFlags::RemoveDir,
            false => nix::unistd::UnlinkatFlags::NoRemoveDir,
        };
        nix::unistd::unlinkat(dir.as_fd(), name.as_str(), flag).map_err(errno)?;
        if kind(&st) == SFlag::S_IFREG && st.st_nlink <= 1 {
            self.vols.add_usage(&self.id, -st.st_size);
        }
        self.paths
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&st.st_ino);
        Ok(())
    }

    pub(super) fn rename(
        &self,
        from: fileid3,
        fname: &[u8],
        to: fileid3,
        tname: &[u8],
    ) -> NfsResult<()> {
        let (fname, tname) = (name_of(fname)?, name_of(tname)?);
        let (fdir, frel) = self.dir(from)?;
        let (tdir, trel) = self.dir(to)?;
        let stat = |dir: &OwnedFd, name: &str| {
            nix::sys::stat::fstatat(dir.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW)
        };
        let _one = self.vols.writes.lock().unwrap_or_else(|p| p.into_inner());
        let moved = stat(&fdir, &fname).map_err(errno)?;
        // A file renamed onto itself (or onto another link of it) frees
        // nothing.
        let replaced = stat(&tdir, &tname)
            .ok()
            .filter(|st| st.st_ino != moved.st_ino);
        nix::fcntl::renameat(fdir.as_fd(), fname.as_str(), tdir.as_fd(), tname.as_str())
            .map_err(errno)?;
        if let Some(st) = replaced.filter(|st| kind(st) == SFlag::S_IFREG && st.st_nlink <= 1) {
            self.vols.add_usage(&self.id, -st.st_size);
        }
        // What was under the old path is under the new one now.
        let (old, new) = (join(&frel, &fname), join(&trel, &tname));
        let below = format!("{old}/");
        let mut paths = self.paths.lock().unwrap_or_else(|p| p.into_inner());
        for rel in paths.values_mut() {
            if *rel == old {
                *rel = new.clone();
            } else if let Some(rest) = rel.strip_prefix(&below) {
                *rel = format!("{new}/{rest}");
            }
        }
        Ok(())
    }

    pub(super) fn readdir(
        &self,
        dirid: fileid3,
        after: fileid3,
        max: usize,
    ) -> NfsResult<ReadDirResult> {
        let rel = self.path(dirid)?;
        let all = self.entries(&rel)?;
        // In inode order: a listing goes on after its cookie even when
        // that entry is gone (`rm -rf` removes as it lists).
        let start = match after {
            0 => 0,
            a => all.partition_point(|(_, st)| st.st_ino <= a),
        };
        let mut entries = Vec::new();
        for (name, st) in all.iter().skip(start).take(max) {
            self.remember(st.st_ino, join(&rel, name));
            entries.push(DirEntry {
                fileid: st.st_ino,
                name: name.as_bytes().into(),
                attr: self.attr(st),
            });
        }
        Ok(ReadDirResult {
            end: start + entries.len() >= all.len(),
            entries,
        })
    }

    pub(super) fn readlink(&self, id: fileid3) -> NfsResult<nfspath3> {
        let rel = self.path(id)?;
        let (up, name) = rel.rsplit_once('/').unwrap_or(("", rel.as_str()));
        let dir = self.open(up, OFlag::O_PATH | OFlag::O_DIRECTORY)?;
        let target = nix::fcntl::readlinkat(dir.as_fd(), name).map_err(errno)?;
        Ok(target.as_encoded_bytes().into())
    }
}
