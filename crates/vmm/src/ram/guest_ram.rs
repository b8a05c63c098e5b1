//! A running QEMU's guest RAM, seen from the host: where it is mapped in
//! the QEMU process, which of its pages the guest changed, and reading and
//! writing them (`process_vm_readv` / `process_vm_writev`, as root).
//!
//! A restored VM maps its snapshot's RAM file MAP_PRIVATE. A page the guest
//! writes becomes a private anonymous copy; `/proc/PID/pagemap` tells those
//! (present and not file-backed, or swapped out) from pages still shared
//! with the file. Read while the vCPUs are stopped, that is exactly the set
//! of pages that can differ from the file.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

use nix::sys::uio::{process_vm_readv, process_vm_writev, RemoteIoVec};
use nix::unistd::Pid;

use super::layer::PAGE;

const PRESENT: u64 = 1 << 63;
const SWAPPED: u64 = 1 << 62;
const FILE_OR_SHARED: u64 = 1 << 61;

#[derive(Debug, Clone, Copy)]
pub struct GuestRam {
    pid: Pid,
    base: u64,
    len: u64,
}

impl GuestRam {
    /// Find the mapping of `ram_file` (`len` bytes) in process `pid`. The
    /// file is matched by device and inode, so a deleted or renamed RAM
    /// file is still found.
    pub fn find(pid: i32, ram_file: &Path, len: u64) -> io::Result<Self> {
        let meta = std::fs::metadata(ram_file)?;
        let (major, minor) = (libc::major(meta.dev()), libc::minor(meta.dev()));
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
        for line in maps.lines() {
            let mut f = line.split_whitespace();
            let (Some(range), Some(_perms), Some(offset), Some(dev), Some(inode)) =
                (f.next(), f.next(), f.next(), f.next(), f.next())
            else {
                continue;
            };
            if inode.parse::<u64>().ok() != Some(meta.ino())
                || !offset.trim_start_matches('0').is_empty()
            {
                continue;
            }
            let same_dev = dev.split_once(':').is_some_and(|(a, b)| {
                u32::from_str_radix(a, 16).ok() == Some(major)
                    && u32::from_str_radix(b, 16).ok() == Some(minor)
            });
            let Some((start, end)) = range.split_once('-') else {
                continue;
            };
            let (Ok(start), Ok(end)) =
                (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
            else {
                continue;
            };
            if same_dev && end - start == len {
                return Ok(Self {
                    pid: Pid::from_raw(pid),
                    base: start,
                    len,
                });
            }
        }
        Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "process {pid} has no {len}-byte mapping of {}",
                ram_file.display()
            ),
        ))
    }

    pub fn pid(&self) -> i32 {
        self.pid.as_raw()
    }

    /// Where the RAM is mapped in its process: (address, bytes).
    pub fn range(&self) -> (u64, u64) {
        (self.base, self.len)
    }

    pub fn pages(&self) -> u64 {
        self.len / PAGE as u64
    }

    /// Page numbers (ascending) whose contents may differ from the file.
    pub fn private_pages(&self) -> io::Result<Vec<u64>> {
        let pagemap = std::fs::File::open(format!("/proc/{}/pagemap", self.pid))?;
        let first = self.base / PAGE as u64;
        let mut out = Vec::new();
        let mut buf = vec![0u8; 8 * 65536];
        let mut page = 0u64;
        while page < self.pages() {
            let n = (self.pages() - page).min(65536) as usize;
            let chunk = &mut buf[..n * 8];
            pagemap.read_exact_at(chunk, (first + page) * 8)?;
            for (i, word) in chunk.chunks_exact(8).enumerate() {
                let v = u64::from_le_bytes(word.try_into().unwrap());
                if (v & PRESENT != 0 && v & FILE_OR_SHARED == 0) || v & SWAPPED != 0 {
                    out.push(page + i as u64);
                }
            }
            page += n as u64;
        }
        Ok(out)
    }

    fn remote(&self, first_page: u64, bytes: usize) -> io::Result<RemoteIoVec> {
        let off = first_page * PAGE as u64;
        if off + bytes as u64 > self.len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("pages {first_page}+{} beyond guest RAM", bytes / PAGE),
            ));
        }
        Ok(RemoteIoVec {
            base: (self.base + off) as usize,
            len: bytes,
        })
    }

    /// Read consecutive pages starting at `first_page` into `buf`.
    pub fn read(&self, first_page: u64, buf: &mut [u8]) -> io::Result<()> {
        let pid = self.pid;
        self.transfer(first_page, buf.len(), |done, remote| {
            process_vm_readv(pid, &mut [IoSliceMut::new(&mut buf[done..])], &[remote])
        })
    }

    /// Write consecutive pages starting at `first_page` from `buf`. Writing
    /// into the MAP_PRIVATE mapping gives the process private copies.
    pub fn write(&self, first_page: u64, buf: &[u8]) -> io::Result<()> {
        let pid = self.pid;
        self.transfer(first_page, buf.len(), |done, remote| {
            process_vm_writev(pid, &[IoSlice::new(&buf[done..])], &[remote])
        })
    }

    /// Move `len` bytes at `first_page` with `call(done, rest_of_remote)`
    /// until all are moved (the calls may move less than asked).
    fn transfer(
        &self,
        first_page: u64,
        len: usize,
        mut call: impl FnMut(usize, RemoteIoVec) -> nix::Result<usize>,
    ) -> io::Result<()> {
        let remote = self.remote(first_page, len)?;
        let mut done = 0;
        while done < len {
            let rest = RemoteIoVec {
                base: remote.base + done,
                len: len - done,
            };
            match call(done, rest)? {
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                n => done += n,
            }
        }
        Ok(())
    }
}

/// A private, writable mapping of a whole file in this process, as QEMU
/// maps guest RAM; unmapped when dropped (tests only).
#[cfg(test)]
pub(crate) struct PrivateMap {
    ptr: std::ptr::NonNull<std::ffi::c_void>,
    len: usize,
}

#[cfg(test)]
impl PrivateMap {
    pub(crate) fn new(file: &std::fs::File, len: usize) -> Self {
        use std::os::fd::AsFd;
        // SAFETY: a fresh private mapping of a file the caller owns; it is
        // unmapped in `drop`, and `bytes` borrows it no longer than `self`.
        let ptr = unsafe {
            nix::sys::mman::mmap(
                None,
                std::num::NonZeroUsize::new(len).expect("a non-empty mapping"),
                nix::sys::mman::ProtFlags::PROT_READ | nix::sys::mman::ProtFlags::PROT_WRITE,
                nix::sys::mman::MapFlags::MAP_PRIVATE,
                file.as_fd(),
                0,
            )
            .expect("mmap")
        };
        Self { ptr, len }
    }

    pub(crate) fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` maps `len` readable and writable bytes until drop.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr() as *mut u8, self.len) }
    }
}

#[cfg(test)]
impl Drop for PrivateMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`; no borrow of it outlives `self`.
        let _ = unsafe { nix::sys::mman::munmap(self.ptr, self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Map a file MAP_PRIVATE in this process, write two pages, and check
    /// that exactly those are reported, and that reads and writes through
    /// the remote calls see and change the mapping.
    #[test]
    fn finds_private_pages_of_a_private_file_mapping() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ram");
        let len = 32 * PAGE;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        f.write_all_at(&vec![5u8; len], 0).unwrap();
        let mut map = PrivateMap::new(&f, len);
        let mem = map.bytes();
        let _ = mem[0]; // fault in a shared page: not private
        mem[3 * PAGE] = 1;
        mem[17 * PAGE + 9] = 2;

        let me = std::process::id() as i32;
        let ram = GuestRam::find(me, &path, len as u64).unwrap();
        assert_eq!(ram.private_pages().unwrap(), vec![3, 17]);

        let mut page = vec![0u8; PAGE];
        ram.read(17, &mut page).unwrap();
        assert_eq!((page[8], page[9]), (5, 2));
        ram.write(20, &vec![8u8; 2 * PAGE]).unwrap();
        assert_eq!(
            (mem[20 * PAGE], mem[22 * PAGE - 1], mem[22 * PAGE]),
            (8, 8, 5)
        );
        assert_eq!(ram.private_pages().unwrap(), vec![3, 17, 20, 21]);
        assert!(
            ram.read(31, &mut vec![0u8; 2 * PAGE]).is_err(),
            "beyond the end"
        );
        assert!(
            GuestRam::find(me, &path, 8 * PAGE as u64).is_err(),
            "wrong size"
        );
    }
}
