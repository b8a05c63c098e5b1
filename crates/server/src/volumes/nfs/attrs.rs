//! A file's NFS attributes, read and set (a size change counts against
//! the volume's limit).

use std::os::fd::{AsFd, AsRawFd};

use nfsserve::nfs::{
    fattr3, fileid3, ftype3, nfsstat3, nfstime3, sattr3, set_atime, set_gid3, set_mode3, set_mtime,
    set_size3, set_uid3, specdata3,
};
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{FileStat, Mode, SFlag};

use super::fs::{errno, kind, Inner, NfsResult};

fn time(secs: i64, nanos: i64) -> nfstime3 {
    nfstime3 {
        seconds: secs.clamp(0, u32::MAX as i64) as u32,
        nseconds: nanos as u32,
    }
}

impl Inner {
    pub(super) fn attr(&self, st: &FileStat) -> fattr3 {
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

    pub(super) fn getattr(&self, id: fileid3) -> NfsResult<fattr3> {
        let (fd, _) = self.open_id(id, OFlag::O_PATH)?;
        Ok(self.attr(&nix::sys::stat::fstat(fd.as_fd()).map_err(errno)?))
    }

    /// Apply `set` to the file at `rel` (a symlink takes only times and
    /// owner changes, which are skipped here).
    pub(super) fn setattr(&self, id: fileid3, set: sattr3) -> NfsResult<fattr3> {
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
}
