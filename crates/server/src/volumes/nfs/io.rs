//! File contents read and written, writes within the volume's limit.

use std::os::fd::{AsFd, OwnedFd};

use nfsserve::nfs::{fattr3, fileid3, nfsstat3};
use nix::errno::Errno;
use nix::fcntl::OFlag;

use super::fs::{errno, Inner, NfsResult};

impl Inner {
    /// Whether `more` bytes still fit (callers hold `vols.writes`).
    pub(super) fn room(&self, more: u64) -> NfsResult<()> {
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

    pub(super) fn read(&self, id: fileid3, offset: u64, count: u32) -> NfsResult<(Vec<u8>, bool)> {
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

    pub(super) fn write(&self, id: fileid3, offset: u64, data: &[u8]) -> NfsResult<fattr3> {
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
}
