//! One volume as an NFSv3 file system ([`nfsserve::vfs::NFSFileSystem`]).
//!
//! A file's NFS id is its host inode number; a file handle is the
//! volume's epoch (from its creation time) and that id, so handles stay
//! valid across server restarts, pauses, restores and forks (a guest
//! restored from memory presents the handles it had). An id is turned
//! back into a path through a map filled by lookups and listings; a path
//! is checked against the id on every use (`lstat`'s inode), and a miss
//! (a server restart, a rename by the content API) walks the volume once
//! to refill the map, else the handle is stale.
//!
//! Every path is opened from the volume's `data/` with `openat2`
//! (`RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`) and names are acted on
//! through their directory's descriptor without following them, exactly
//! as the content API does: a symlink a guest writes is kept as a symlink
//! (its guest follows it, in its own file system), never followed here.
//!
//! The RPC calls carry the caller's uid but nfsserve does not pass it on:
//! what a guest makes through a mount belongs to `user` (1000:1000), as
//! what the content API makes; `chown` in the guest changes it. Writes
//! count against the volume's limit: past it the guest sees `ENOSPC`.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nfsserve::nfs::{
    fattr3, fileid3, filename3, ftype3, nfs_fh3, nfspath3, nfsstat3, nfstime3, sattr3, set_atime,
    set_gid3, set_mode3, set_mtime, set_size3, set_uid3, specdata3,
};
use nfsserve::vfs::{DirEntry, NFSFileSystem, ReadDirResult, VFSCapabilities};
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{FileStat, Mode, SFlag};

use super::super::content::{DEFAULT_GID, DEFAULT_UID};
use super::super::Volumes;

type NfsResult<T> = Result<T, nfsstat3>;

/// Volume `id`'s files, served to the guests that mount it. Cheap to
/// clone; every sandbox mounting the volume shares one map of ids.
#[derive(Clone)]
pub struct VolumeFs {
    inner: Arc<Inner>,
}

pub(super) struct Inner {
    vols: Arc<Volumes>,
    id: String,
    max_bytes: u64,
    data: OwnedFd,
    root: u64,
    epoch: u64,
    /// Inode -> path below `data/` ("" for the top).
    paths: Mutex<HashMap<u64, String>>,
    /// When the last walk of the volume started (one at a time).
    walked: Mutex<Option<Instant>>,
}

/// Walks of a volume (to find an id no lookup named) at most this often:
/// an id still unknown is stale. A guest cannot make the server walk a
/// big volume over and over by presenting made-up handles.
const WALK_INTERVAL: Duration = Duration::from_secs(2);

fn errno(e: Errno) -> nfsstat3 {
    match e {
        Errno::ENOENT => nfsstat3::NFS3ERR_NOENT,
        Errno::EEXIST => nfsstat3::NFS3ERR_EXIST,
        Errno::ENOTDIR => nfsstat3::NFS3ERR_NOTDIR,
        Errno::EISDIR => nfsstat3::NFS3ERR_ISDIR,
        Errno::ENOTEMPTY => nfsstat3::NFS3ERR_NOTEMPTY,
        Errno::ENOSPC | Errno::EDQUOT => nfsstat3::NFS3ERR_NOSPC,
        Errno::ENAMETOOLONG => nfsstat3::NFS3ERR_NAMETOOLONG,
        Errno::EINVAL => nfsstat3::NFS3ERR_INVAL,
        Errno::EPERM => nfsstat3::NFS3ERR_PERM,
        // Out of the volume (EXDEV), or a symlink where a file was meant.
        Errno::EACCES | Errno::EXDEV | Errno::ELOOP => nfsstat3::NFS3ERR_ACCES,
        Errno::EFBIG => nfsstat3::NFS3ERR_FBIG,
        _ => nfsstat3::NFS3ERR_IO,
    }
}

/// A single name inside a directory: no `/`, no NUL, not `.` or `..`.
fn name_of(f: &[u8]) -> NfsResult<String> {
    let s = std::str::from_utf8(f).map_err(|_| nfsstat3::NFS3ERR_INVAL)?;
    if s.len() > 255 {
        return Err(nfsstat3::NFS3ERR_NAMETOOLONG);
    }
    if s.is_empty() || s == "." || s == ".." || s.contains(['/', '\0']) {
        return Err(nfsstat3::NFS3ERR_INVAL);
    }
    Ok(s.to_string())
}

fn join(dir: &str, name: &str) -> String {
    match dir.is_empty() {
        true => name.to_string(),
        false => format!("{dir}/{name}"),
    }
}

fn kind(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits())
}

fn time(secs: i64, nanos: i64) -> nfstime3 {
    nfstime3 {
        seconds: secs.clamp(0, u32::MAX as i64) as u32,
        nseconds: nanos as u32,
    }
}

impl Inner {
    /// `rel` opened from the volume's top, never leaving it.
    fn open(&self, rel: &str, flags: OFlag) -> NfsResult<OwnedFd> {
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

    fn lstat(&self, rel: &str) -> NfsResult<FileStat> {
        let fd = self.open(rel, OFlag::O_PATH)?;
        nix::sys::stat::fstat(fd.as_fd()).map_err(errno)
    }

    fn remember(&self, ino: u64, rel: String) {
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
    fn path(&self, id: fileid3) -> NfsResult<String> {
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
    fn open_id(&self, id: fileid3, flags: OFlag) -> NfsResult<(OwnedFd, String)> {
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

    /// The names in directory `rel` with what each is, in inode order.
    fn entries(&self, rel: &str) -> NfsResult<Vec<(String, FileStat)>> {
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

    fn attr(&self, st: &FileStat) -> fattr3 {
        let ftype = match kind(st) {
            SFlag::S_IFDIR => ftype3::NF3DIR,
            SFlag::S_IFLNK => ftype3::NF3LNK,
            SFlag::S_IFBLK => ftype3::NF3BLK,
            SFlag::S_IFCHR => ftype3::NF3CHR,
            SFlag::S_IFSOCK => ftype3::NF3SOCK,
            SFlag::S_IFIFO => ftype3::NF3FIFO,
            _ => ftype3::NF3REG,
        };
        fattr3 {
            ftype,
            mode: st.st_mode & 0o7777,
            nlink: st.st_nlink as u32,
            uid: st.st_uid,
            gid: st.st_gid,
            size: st.st_size as u64,
            used: st.st_blocks as u64 * 512,
            rdev: specdata3::default(),
            fsid: self.epoch,
            fileid: st.st_ino,
            atime: time(st.st_atime, st.st_atime_nsec),
            mtime: time(st.st_mtime, st.st_mtime_nsec),
            ctime: time(st.st_ctime, st.st_ctime_nsec),
        }
    }

    fn getattr(&self, id: fileid3) -> NfsResult<fattr3> {
        let (fd, _) = self.open_id(id, OFlag::O_PATH)?;
        Ok(self.attr(&nix::sys::stat::fstat(fd.as_fd()).map_err(errno)?))
    }

    /// Directory `dirid`, opened, and its path.
    fn dir(&self, dirid: fileid3) -> NfsResult<(OwnedFd, String)> {
        let rel = self.path(dirid)?;
        let fd = self.open(&rel, OFlag::O_PATH | OFlag::O_DIRECTORY)?;
        Ok((fd, rel))
    }

    fn lookup(&self, dirid: fileid3, name: &[u8]) -> NfsResult<fileid3> {
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

    /// Apply `set` to the file at `rel` (a symlink takes only times and
    /// owner changes, which are skipped here).
    fn setattr(&self, id: fileid3, set: sattr3) -> NfsResult<fattr3> {
        let (fd, _) = self.open_id(id, OFlag::O_PATH)?;
        let st = nix::sys::stat::fstat(fd.as_fd()).map_err(errno)?;
        if kind(&st) == SFlag::S_IFLNK {
            return Ok(self.attr(&st));
        }
        // The inode the descriptor holds (checked not to be a symlink).
        let proc = format!("/proc/self/fd/{}", fd.as_raw_fd());
        if let set_size3::size(size) = set.size {
            if kind(&st) != SFlag::S_IFREG {
                return Err(nfsstat3::NFS3ERR_INVAL);
            }
            if size > i64::MAX as u64 {
                return Err(nfsstat3::NFS3ERR_FBIG);
            }
            // The same inode, opened for writing; its size read under the
            // lock, so concurrent calls count each change once.
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&proc)
                .map_err(|_| nfsstat3::NFS3ERR_IO)?;
            let _one = self.vols.writes.lock().unwrap_or_else(|p| p.into_inner());
            let before = f.metadata().map_err(|_| nfsstat3::NFS3ERR_IO)?.len();
            self.room(size.saturating_sub(before))?;
            f.set_len(size)
                .map_err(|e| errno(Errno::from_raw(e.raw_os_error().unwrap_or(5))))?;
            self.vols.add_usage(&self.id, size as i64 - before as i64);
        }
        if let set_mode3::mode(mode) = set.mode {
            nix::sys::stat::fchmodat(
                nix::fcntl::AT_FDCWD,
                proc.as_str(),
                Mode::from_bits_truncate(mode & 0o7777),
                nix::sys::stat::FchmodatFlags::FollowSymlink,
            )
            .map_err(errno)?;
        }
        let uid = match set.uid {
            set_uid3::uid(u) => Some(nix::unistd::Uid::from_raw(u)),
            set_uid3::Void => None,
        };
        let gid = match set.gid {
            set_gid3::gid(g) => Some(nix::unistd::Gid::from_raw(g)),
            set_gid3::Void => None,
        };
        if uid.is_some() || gid.is_some() {
            nix::unistd::fchownat(fd.as_fd(), "", uid, gid, AtFlags::AT_EMPTY_PATH)
                .map_err(errno)?;
        }
        use nix::sys::time::TimeSpec;
        let now = || TimeSpec::new(0, nix::libc::UTIME_NOW);
        let omit = || TimeSpec::new(0, nix::libc::UTIME_OMIT);
        let at = match set.atime {
            set_atime::DONT_CHANGE => omit(),
            set_atime::SET_TO_SERVER_TIME => now(),
            set_atime::SET_TO_CLIENT_TIME(t) => TimeSpec::new(t.seconds as i64, t.nseconds as i64),
        };
        let mt = match set.mtime {
            set_mtime::DONT_CHANGE => omit(),
            set_mtime::SET_TO_SERVER_TIME => now(),
            set_mtime::SET_TO_CLIENT_TIME(t) => TimeSpec::new(t.seconds as i64, t.nseconds as i64),
        };
        if at.tv_nsec() != nix::libc::UTIME_OMIT || mt.tv_nsec() != nix::libc::UTIME_OMIT {
            nix::sys::stat::utimensat(
                nix::fcntl::AT_FDCWD,
                proc.as_str(),
                &at,
                &mt,
                nix::sys::stat::UtimensatFlags::FollowSymlink,
            )
            .map_err(errno)?;
        }
        Ok(self.attr(&nix::sys::stat::fstat(fd.as_fd()).map_err(errno)?))
    }

    /// Whether `more` bytes still fit (callers hold `vols.writes`).
    fn room(&self, more: u64) -> NfsResult<()> {
        if more == 0 {
            return Ok(());
        }
        let used = self
            .vols
            .usage(&self.id)
            .map_err(|_| nfsstat3::NFS3ERR_IO)?;
        match used.saturating_add(more) > self.max_bytes {
            true => Err(nfsstat3::NFS3ERR_NOSPC),
            false => Ok(()),
        }
    }

    fn read(&self, id: fileid3, offset: u64, count: u32) -> NfsResult<(Vec<u8>, bool)> {
        let (fd, _) = self.open_id(id, OFlag::O_RDONLY)?;
        let size = nix::sys::stat::fstat(fd.as_fd()).map_err(errno)?.st_size as u64;
        // At most the 1 MiB the server announces (rtmax), whatever is asked.
        let want = (count.min(1 << 20) as u64).min(size.saturating_sub(offset)) as usize;
        let mut buf = vec![0u8; want];
        let mut got = 0;
        while got < want {
            match nix::sys::uio::pread(fd.as_fd(), &mut buf[got..], (offset + got as u64) as i64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(errno(e)),
            }
        }
        buf.truncate(got);
        Ok((buf, offset.saturating_add(got as u64) >= size))
    }

    fn write(&self, id: fileid3, offset: u64, data: &[u8]) -> NfsResult<fattr3> {
        if offset.saturating_add(data.len() as u64) > i64::MAX as u64 {
            return Err(nfsstat3::NFS3ERR_FBIG);
        }
        let (fd, _) = self.open_id(id, OFlag::O_WRONLY)?;
        let _one = self.vols.writes.lock().unwrap_or_else(|p| p.into_inner());
        let size = |fd: &OwnedFd| -> NfsResult<u64> {
            Ok(nix::sys::stat::fstat(fd.as_fd()).map_err(errno)?.st_size as u64)
        };
        let before = size(&fd)?;
        if !data.is_empty() {
            self.room((offset + data.len() as u64).saturating_sub(before))?;
        }
        let mut done = 0;
        let result = loop {
            if done == data.len() {
                break Ok(());
            }
            match nix::sys::uio::pwrite(fd.as_fd(), &data[done..], (offset + done as u64) as i64) {
                Ok(0) => break Err(nfsstat3::NFS3ERR_IO),
                Ok(n) => done += n,
                Err(Errno::EINTR) => {}
                Err(e) => break Err(errno(e)),
            }
        };
        // What the file grew by, whatever part of the write happened.
        let after = size(&fd)?;
        self.vols.add_usage(&self.id, after as i64 - before as i64);
        result?;
        Ok(self.attr(&nix::sys::stat::fstat(fd.as_fd()).map_err(errno)?))
    }

    /// Make `name` in `dirid` with `make` (given the directory and name),
    /// owned by `user`, and return what it is.
    fn make(
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

    fn create_file(&self, dirid: fileid3, name: &[u8], mode: u32) -> NfsResult<fileid3> {
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

    fn create(&self, dirid: fileid3, name: &[u8], set: sattr3) -> NfsResult<(fileid3, fattr3)> {
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

    fn remove(&self, dirid: fileid3, name: &[u8]) -> NfsResult<()> {
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

    fn rename(&self, from: fileid3, fname: &[u8], to: fileid3, tname: &[u8]) -> NfsResult<()> {
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

    fn readdir(&self, dirid: fileid3, after: fileid3, max: usize) -> NfsResult<ReadDirResult> {
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

    fn readlink(&self, id: fileid3) -> NfsResult<nfspath3> {
        let rel = self.path(id)?;
        let (up, name) = rel.rsplit_once('/').unwrap_or(("", rel.as_str()));
        let dir = self.open(up, OFlag::O_PATH | OFlag::O_DIRECTORY)?;
        let target = nix::fcntl::readlinkat(dir.as_fd(), name).map_err(errno)?;
        Ok(target.as_encoded_bytes().into())
    }
}

impl VolumeFs {
    /// Serve volume `id` (its files in `data`).
    pub(super) fn open(
        vols: Arc<Volumes>,
        id: &str,
        max_bytes: u64,
        epoch: u64,
    ) -> std::io::Result<Self> {
        let data = nix::fcntl::open(
            &vols.root(id).join("data"),
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )?;
        let root = nix::sys::stat::fstat(data.as_fd())?.st_ino;
        Ok(Self {
            inner: Arc::new(Inner {
                vols,
                id: id.to_string(),
                max_bytes,
                data,
                root,
                epoch,
                paths: Mutex::new(HashMap::new()),
                walked: Mutex::new(None),
            }),
        })
    }

    pub(super) fn downgrade(&self) -> std::sync::Weak<Inner> {
        Arc::downgrade(&self.inner)
    }

    pub(super) fn upgrade(weak: &std::sync::Weak<Inner>) -> Option<Self> {
        weak.upgrade().map(|inner| Self { inner })
    }

    /// Run `f`, which moves file contents (up to 1 MiB), off the async
    /// runtime.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> NfsResult<T> + Send + 'static,
    ) -> NfsResult<T> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || f(&inner))
            .await
            .unwrap_or(Err(nfsstat3::NFS3ERR_SERVERFAULT))
    }

    /// Run `f`, a few metadata system calls on a local file system (a
    /// handful of microseconds) that take no lock but the path map's, where
    /// it is: a hand-off to a blocking thread would cost more than the
    /// calls. (A walk after a miss hands the worker's tasks off.)
    async fn quick<T>(&self, f: impl FnOnce(&Inner) -> NfsResult<T>) -> NfsResult<T> {
        f(&self.inner)
    }
}

#[async_trait::async_trait]
impl NFSFileSystem for VolumeFs {
    fn capabilities(&self) -> VFSCapabilities {
        VFSCapabilities::ReadWrite
    }

    fn root_dir(&self) -> fileid3 {
        self.inner.root
    }

    async fn lookup(&self, dirid: fileid3, filename: &filename3) -> NfsResult<fileid3> {
        self.quick(|fs| fs.lookup(dirid, &filename.0)).await
    }

    async fn getattr(&self, id: fileid3) -> NfsResult<fattr3> {
        self.quick(|fs| fs.getattr(id)).await
    }

    async fn setattr(&self, id: fileid3, setattr: sattr3) -> NfsResult<fattr3> {
        // A size change waits for the volume's write lock: off the runtime.
        match setattr.size {
            set_size3::Void => self.quick(|fs| fs.setattr(id, setattr)).await,
            set_size3::size(_) => self.blocking(move |fs| fs.setattr(id, setattr)).await,
        }
    }

    async fn read(&self, id: fileid3, offset: u64, count: u32) -> NfsResult<(Vec<u8>, bool)> {
        self.blocking(move |fs| fs.read(id, offset, count)).await
    }

    async fn write(&self, id: fileid3, offset: u64, data: &[u8]) -> NfsResult<fattr3> {
        let data = data.to_vec();
        self.blocking(move |fs| fs.write(id, offset, &data)).await
    }

    async fn create(
        &self,
        dirid: fileid3,
        filename: &filename3,
        attr: sattr3,
    ) -> NfsResult<(fileid3, fattr3)> {
        let name = filename.0.clone();
        match attr.size {
            set_size3::Void => self.quick(|fs| fs.create(dirid, &name, attr)).await,
            set_size3::size(_) => self.blocking(move |fs| fs.create(dirid, &name, attr)).await,
        }
    }

    async fn create_exclusive(&self, dirid: fileid3, filename: &filename3) -> NfsResult<fileid3> {
        self.quick(|fs| fs.create_file(dirid, &filename.0, 0o644))
            .await
    }

    async fn mkdir(&self, dirid: fileid3, dirname: &filename3) -> NfsResult<(fileid3, fattr3)> {
        let name = dirname.0.clone();
        self.quick(|fs| {
            fs.make(dirid, &name, |dir, name| {
                nix::sys::stat::mkdirat(dir.as_fd(), name, Mode::from_bits_truncate(0o755))
            })
        })
        .await
    }

    async fn remove(&self, dirid: fileid3, filename: &filename3) -> NfsResult<()> {
        let name = filename.0.clone();
        self.blocking(move |fs| fs.remove(dirid, &name)).await
    }

    async fn rename(
        &self,
        from_dirid: fileid3,
        from_filename: &filename3,
        to_dirid: fileid3,
        to_filename: &filename3,
    ) -> NfsResult<()> {
        let (f, t) = (from_filename.0.clone(), to_filename.0.clone());
        self.blocking(move |fs| fs.rename(from_dirid, &f, to_dirid, &t))
            .await
    }

    async fn readdir(
        &self,
        dirid: fileid3,
        start_after: fileid3,
        max_entries: usize,
    ) -> NfsResult<ReadDirResult> {
        self.blocking(move |fs| fs.readdir(dirid, start_after, max_entries))
            .await
    }

    async fn symlink(
        &self,
        dirid: fileid3,
        linkname: &filename3,
        symlink: &nfspath3,
        _attr: &sattr3,
    ) -> NfsResult<(fileid3, fattr3)> {
        let name = linkname.0.clone();
        let target = symlink.0.clone();
        self.quick(|fs| {
            let target = <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&target);
            fs.make(dirid, &name, |dir, name| {
                nix::unistd::symlinkat(target, dir.as_fd(), name)
            })
        })
        .await
    }

    async fn readlink(&self, id: fileid3) -> NfsResult<nfspath3> {
        self.quick(|fs| fs.readlink(id)).await
    }

    fn id_to_fh(&self, id: fileid3) -> nfs_fh3 {
        let mut data = Vec::with_capacity(16);
        data.extend_from_slice(&self.inner.epoch.to_le_bytes());
        data.extend_from_slice(&id.to_le_bytes());
        nfs_fh3 { data }
    }

    fn fh_to_id(&self, fh: &nfs_fh3) -> NfsResult<fileid3> {
        let (Some(epoch), Some(id)) = (fh.data.get(0..8), fh.data.get(8..16)) else {
            return Err(nfsstat3::NFS3ERR_BADHANDLE);
        };
        if fh.data.len() != 16 {
            return Err(nfsstat3::NFS3ERR_BADHANDLE);
        }
        let epoch = u64::from_le_bytes(epoch.try_into().expect("8 bytes"));
        match epoch == self.inner.epoch {
            true => Ok(u64::from_le_bytes(id.try_into().expect("8 bytes"))),
            false => Err(nfsstat3::NFS3ERR_STALE),
        }
    }

    fn serverid(&self) -> nfsserve::nfs::cookieverf3 {
        self.inner.epoch.to_le_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume(max: u64) -> (tempfile::TempDir, VolumeFs) {
        let dir = tempfile::tempdir().unwrap();
        let db = Arc::new(crate::db::Db::open(&dir.path().join("db.sqlite")).unwrap());
        let vols = Arc::new(Volumes::with_limit(db, dir.path(), max));
        let row = vols.create("team", "v").unwrap();
        let fs = VolumeFs::open(vols, &row.id, max, 7).unwrap();
        (dir, fs)
    }

    #[test]
    fn files_directories_renames_and_handles_after_a_restart() {
        let (_dir, fs) = volume(1 << 20);
        let v = &fs.inner;
        let root = v.root;
        let (dir, _) = v
            .make(root, b"d", |d, n| {
                nix::sys::stat::mkdirat(d.as_fd(), n, Mode::from_bits_truncate(0o755))
            })
            .unwrap();
        let (file, attr) = v.create(root, b"a.txt", sattr3::default()).unwrap();
        assert_eq!(
            (attr.uid, attr.gid, attr.mode),
            (DEFAULT_UID, DEFAULT_GID, 0o644)
        );
        assert_eq!(v.write(file, 0, b"hello").unwrap().size, 5);
        assert_eq!(v.read(file, 0, 100).unwrap(), (b"hello".to_vec(), true));
        assert_eq!(v.read(file, 1, 2).unwrap(), (b"el".to_vec(), false));
        v.rename(root, b"a.txt", dir, b"b.txt").unwrap();
        assert_eq!(v.lookup(dir, b"b.txt").unwrap(), file);
        assert_eq!(v.lookup(dir, b"..").unwrap(), root);
        assert_eq!(v.lookup(root, b"..").unwrap(), root);
        let names: Vec<_> = v
            .readdir(dir, 0, 10)
            .unwrap()
            .entries
            .into_iter()
            .map(|e| e.name.0)
            .collect();
        assert_eq!(names, vec![b"b.txt".to_vec()]);
        // A new server knows no paths: the handle is found by a walk.
        let again = VolumeFs::open(v.vols.clone(), &v.id, v.max_bytes, 7).unwrap();
        assert_eq!(again.inner.read(file, 0, 5).unwrap().0, b"hello");
        // Handles of another epoch (another volume) are stale.
        let fh = fs.id_to_fh(file);
        assert_eq!(fs.fh_to_id(&fh).unwrap(), file);
        let other = VolumeFs::open(v.vols.clone(), &v.id, v.max_bytes, 8).unwrap();
        assert!(matches!(other.fh_to_id(&fh), Err(nfsstat3::NFS3ERR_STALE)));
        // Removed: its handle is stale.
        v.remove(dir, b"b.txt").unwrap();
        assert!(matches!(v.getattr(file), Err(nfsstat3::NFS3ERR_STALE)));
    }

    #[test]
    fn names_symlinks_and_the_limit() {
        let (_dir, fs) = volume(1000);
        let v = &fs.inner;
        let root = v.root;
        for bad in [&b".."[..], b"a/b", b"", b"."] {
            assert!(v.create(root, bad, sattr3::default()).is_err(), "{bad:?}");
        }
        // A symlink is kept as written and never followed here.
        let (link, _) = v
            .make(root, b"out", |d, n| {
                nix::unistd::symlinkat("/etc", d.as_fd(), n)
            })
            .unwrap();
        assert_eq!(v.readlink(link).unwrap().0, b"/etc");
        assert!(v.lookup(link, b"passwd").is_err());
        assert!(v.read(link, 0, 10).is_err());
        // Past the volume's limit: no space, and nothing written.
        let (f, _) = v.create(root, b"f", sattr3::default()).unwrap();
        v.write(f, 0, &[1; 900]).unwrap();
        assert!(matches!(
            v.write(f, 900, &[1; 200]),
            Err(nfsstat3::NFS3ERR_NOSPC)
        ));
        assert_eq!(v.getattr(f).unwrap().size, 900);
        v.remove(root, b"f").unwrap();
        let (g, _) = v.create(root, b"g", sattr3::default()).unwrap();
        assert_eq!(v.write(g, 0, &[2; 950]).unwrap().size, 950);
        // Renaming a file onto itself frees nothing; nor does an empty
        // write far out take room.
        v.rename(root, b"g", root, b"g").unwrap();
        assert!(matches!(
            v.write(g, 950, &[3; 100]),
            Err(nfsstat3::NFS3ERR_NOSPC)
        ));
        v.write(g, 999, &[]).unwrap();
        assert_eq!(v.write(g, 950, &[3; 50]).unwrap().size, 1000);
        // Truncating frees, growing by setattr counts.
        let size = |n| sattr3 {
            size: set_size3::size(n),
            ..sattr3::default()
        };
        assert_eq!(v.setattr(g, size(100)).unwrap().size, 100);
        assert!(matches!(
            v.setattr(g, size(2000)),
            Err(nfsstat3::NFS3ERR_NOSPC)
        ));
        assert_eq!(v.setattr(g, size(1000)).unwrap().size, 1000);
    }

    #[test]
    fn a_listing_goes_on_after_its_cookie_is_removed() {
        let (_dir, fs) = volume(1 << 20);
        let v = &fs.inner;
        for i in 0..10 {
            v.create(v.root, format!("f{i}").as_bytes(), sattr3::default())
                .unwrap();
        }
        let first = v.readdir(v.root, 0, 4).unwrap();
        assert_eq!(first.entries.len(), 4);
        assert!(!first.end);
        // As `rm -rf` does: remove what was listed, then go on.
        for e in &first.entries {
            v.remove(v.root, &e.name.0).unwrap();
        }
        let cookie = first.entries.last().unwrap().fileid;
        let rest = v.readdir(v.root, cookie, 100).unwrap();
        assert_eq!(rest.entries.len(), 6);
        assert!(rest.end);
    }
}
