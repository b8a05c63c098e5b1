//! Which guest pages were written since the last capture, without reading
//! every private page: userfaultfd write-protection in asynchronous mode
//! (`UFFD_FEATURE_WP_ASYNC`, Linux 6.7) read back with `PAGEMAP_SCAN`.
//!
//! A userfaultfd acts on the address space of the process that created
//! it, so QEMU must make it: clones' QEMUs preload a small shim
//! (`shim/tine-shim.c`, see [`crate::shim`]) whose
//! constructor creates one and leaves it open. tine takes a copy with
//! `pidfd_getfd`, negotiates the asynchronous mode, registers the guest RAM
//! mapping and write-protects all of it. From then on the kernel clears a
//! page's protection on its first write (QEMU's own stores under TCG, a
//! KVM fault, a device's DMA into guest RAM alike) without waking anyone,
//! and one `PAGEMAP_SCAN` of the stopped VM returns exactly the pages
//! written since the last scan and protects them again, atomically.
//!
//! The one rule callers keep: the protection is armed only when the VM's
//! RAM equals the snapshot it will be captured over (right after a
//! restore has written its layers, and at each capture while the VM is
//! stopped). A capture that fails after its scan must [`disarm`] it, and
//! the next capture compares every private page as without tracking.
//!
//! [`disarm`]: WriteTracker::disarm

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use super::layer::PAGE;
use super::GuestRam;

const UFFD_API: u64 = 0xAA;
const UFFD_USER_MODE_ONLY: libc::c_int = 1;
const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;
const PAGE_IS_WPALLOWED: u64 = 1 << 0;
const PAGE_IS_WRITTEN: u64 = 1 << 1;
const PAGE_IS_PRESENT: u64 = 1 << 3;
const PAGE_IS_SWAPPED: u64 = 1 << 4;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

/// `struct pm_scan_arg` (linux/fs.h).
#[repr(C)]
#[derive(Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// `struct page_region` (linux/fs.h).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

const UFFDIO_API: libc::c_ulong =
    nix::request_code_readwrite!(0xAA, 0x3F, std::mem::size_of::<UffdioApi>()) as _;
const UFFDIO_REGISTER: libc::c_ulong =
    nix::request_code_readwrite!(0xAA, 0x00, std::mem::size_of::<UffdioRegister>()) as _;
const UFFDIO_WRITEPROTECT: libc::c_ulong =
    nix::request_code_readwrite!(0xAA, 0x06, std::mem::size_of::<UffdioWriteprotect>()) as _;
const PAGEMAP_SCAN: libc::c_ulong =
    nix::request_code_readwrite!(b'f', 16, std::mem::size_of::<PmScanArg>()) as _;

/// Whether this kernel has asynchronous write-protection, probed once
/// with a userfaultfd of tine's own (a VM's failure is only that VM's).
pub fn supported() -> bool {
    static SUPPORTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        // SAFETY: a plain system call; the descriptor is checked and owned
        // once.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_userfaultfd,
                libc::O_CLOEXEC | libc::O_NONBLOCK | UFFD_USER_MODE_ONLY,
            )
        };
        if fd < 0 {
            return false;
        }
        // SAFETY: `fd` was just returned to us and nothing else owns it.
        let uffd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let mut api = UffdioApi {
            api: UFFD_API,
            features: UFFD_FEATURE_WP_ASYNC,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API takes a `struct uffdio_api`.
        unsafe { ioctl(&uffd, UFFDIO_API, &mut api) }.is_ok()
    })
}

/// Regions asked for per `PAGEMAP_SCAN` call.
const REGIONS: usize = 4096;

/// Tracks the writes to one QEMU's guest RAM.
#[derive(Debug)]
pub struct WriteTracker {
    uffd: OwnedFd,
    pagemap: File,
    base: u64,
    len: u64,
    armed: AtomicBool,
}

/// `ioctl(fd, request, arg)`.
///
/// # Safety
/// `T` must be the `#[repr(C)]` struct `request` is defined with, and any
/// memory `arg` points the kernel at must be valid for the call.
unsafe fn ioctl<T>(
    fd: &impl AsRawFd,
    request: libc::c_ulong,
    arg: &mut T,
) -> io::Result<libc::c_int> {
    // SAFETY: the caller's promise above; `arg` lives for the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, arg as *mut T) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// The descriptor number of the userfaultfd the shim left open in `pid`.
fn find_uffd(pid: i32) -> io::Result<Option<i32>> {
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let entry = entry?;
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if target.as_os_str() == "anon_inode:[userfaultfd]" {
            return Ok(entry.file_name().to_str().and_then(|n| n.parse().ok()));
        }
    }
    Ok(None)
}

/// A copy of descriptor `fd` of process `pid` (`pidfd_getfd`, as root).
fn take_fd(pid: i32, fd: i32) -> io::Result<OwnedFd> {
    // SAFETY: plain system calls with integer arguments; each returned
    // descriptor is checked and owned exactly once.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid, 0);
        if pidfd < 0 {
            return Err(io::Error::last_os_error());
        }
        let pidfd = OwnedFd::from_raw_fd(pidfd as i32);
        let got = libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0);
        if got < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(OwnedFd::from_raw_fd(got as i32))
    }
}

impl WriteTracker {
    /// Start tracking `ram`: `None` if its QEMU has no userfaultfd (started
    /// without the shim), an error if the kernel refuses. Every page is
    /// write-protected, so call it when the RAM equals the VM's parent.
    pub fn attach(ram: &GuestRam) -> io::Result<Option<Self>> {
        let Some(tracker) = Self::open(ram, false)? else {
            return Ok(None);
        };
        tracker.protect_all(true)?;
        tracker.confirm();
        Ok(Some(tracker))
    }

    /// Take over the tracking another tine process set up in `ram`'s QEMU
    /// (a VM adopted after a restart). What was written before is unknown,
    /// so it starts disarmed: the next capture compares every page and
    /// arms it.
    pub fn reattach(ram: &GuestRam) -> io::Result<Option<Self>> {
        Self::open(ram, true)
    }

    fn open(ram: &GuestRam, again: bool) -> io::Result<Option<Self>> {
        let pid = ram.pid();
        let Some(fd) = find_uffd(pid)? else {
            return Ok(None);
        };
        let uffd = take_fd(pid, fd)?;
        let mut api = UffdioApi {
            api: UFFD_API,
            features: UFFD_FEATURE_WP_ASYNC,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API takes a `struct uffdio_api`.
        match unsafe { ioctl(&uffd, UFFDIO_API, &mut api) } {
            Ok(_) => {}
            // Negotiated once, by the process that attached first.
            Err(e) if again && e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("UFFDIO_API (WP_ASYNC): {e}"),
                ))
            }
        }
        let (base, len) = ram.range();
        let mut reg = UffdioRegister {
            range: UffdioRange { start: base, len },
            mode: UFFDIO_REGISTER_MODE_WP,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER takes a `struct uffdio_register`.
        unsafe { ioctl(&uffd, UFFDIO_REGISTER, &mut reg) }
            .map_err(|e| io::Error::new(e.kind(), format!("UFFDIO_REGISTER: {e}")))?;
        let pagemap = File::open(format!("/proc/{pid}/pagemap"))?;
        Ok(Some(Self {
            uffd,
            pagemap,
            base,
            len,
            armed: AtomicBool::new(false),
        }))
    }

    /// Write-protect every page, or (`on` false) none. Protection alone
    /// does not make [`WriteTracker::written`] trustworthy: see
    /// [`WriteTracker::confirm`].
    pub fn protect_all(&self, on: bool) -> io::Result<()> {
        self.protect(0, self.len / PAGE as u64, on)
    }

    /// The protection now starts at the VM's parent: the capture whose scan
    /// (or [`WriteTracker::protect_all`]) set it became the VM's parent.
    pub fn confirm(&self) {
        self.armed.store(true, Ordering::Release);
    }

    /// Whether [`WriteTracker::written`] can be trusted.
    pub fn armed(&self) -> bool {
        self.armed.load(Ordering::Acquire)
    }

    /// Forget what was tracked.
    pub fn disarm(&self) {
        self.armed.store(false, Ordering::Release);
    }

    /// The pages (ascending, counted from the start of guest RAM) written
    /// since the last scan or [`WriteTracker::protect_all`], protected again
    /// by the same call. The VM must be stopped. The tracker is disarmed
    /// until [`WriteTracker::confirm`]: if the capture that called this does
    /// not finish (fails, or is dropped), the next one compares every page.
    ///
    /// Pages dropped from the mapping since (the balloon's discards, which
    /// QEMU makes with `MADV_DONTNEED`) are among them: a dropped page
    /// reads the root file again, which may differ from the parent chain.
    /// The shim lifts the protection of what QEMU drops, so they are the
    /// only pages with no entry at all (every other page has one since
    /// [`WriteTracker::protect_all`]: present, swapped or a protection
    /// marker). The first scan's kernel fast path (Linux 6.18) already
    /// counts such a page as written and protects it; the page categories
    /// the kernel documents do not say so, so a second scan asks for them
    /// by category and protects what it finds.
    pub fn written(&self) -> io::Result<Vec<u64>> {
        self.disarm();
        let mut pages = Vec::new();
        self.scan(
            PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC,
            0,
            PAGE_IS_WRITTEN,
            PAGE_IS_WRITTEN,
            |first, last| {
                pages.extend(first..last);
                Ok(())
            },
        )?;
        let mut dropped = Vec::new();
        let none = PAGE_IS_PRESENT | PAGE_IS_SWAPPED;
        self.scan(0, none, none, PAGE_IS_WPALLOWED, |first, last| {
            dropped.push((first, last));
            Ok(())
        })?;
        for &(first, last) in &dropped {
            self.protect(first, last, true)?;
            pages.extend(first..last);
        }
        if !dropped.is_empty() {
            pages.sort_unstable();
            pages.dedup();
        }
        Ok(pages)
    }

    /// Write-protect (or not) pages `[first, last)`.
    fn protect(&self, first: u64, last: u64, on: bool) -> io::Result<()> {
        let mut wp = UffdioWriteprotect {
            range: UffdioRange {
                start: self.base + first * PAGE as u64,
                len: (last - first) * PAGE as u64,
            },
            mode: if on { UFFDIO_WRITEPROTECT_MODE_WP } else { 0 },
        };
        // SAFETY: UFFDIO_WRITEPROTECT takes a `struct uffdio_writeprotect`.
        unsafe { ioctl(&self.uffd, UFFDIO_WRITEPROTECT, &mut wp) }
            .map_err(|e| io::Error::new(e.kind(), format!("UFFDIO_WRITEPROTECT: {e}")))?;
        Ok(())
    }

    /// One `PAGEMAP_SCAN` over the whole RAM (in as many calls as it
    /// takes): `found(first, last)` for each run of matching pages.
    fn scan(
        &self,
        flags: u64,
        inverted: u64,
        mask: u64,
        returned: u64,
        mut found: impl FnMut(u64, u64) -> io::Result<()>,
    ) -> io::Result<()> {
        let mut regions = vec![PageRegion::default(); REGIONS];
        let end = self.base + self.len;
        let mut start = self.base;
        while start < end {
            let mut arg = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                flags,
                start,
                end,
                vec: regions.as_mut_ptr() as u64,
                vec_len: REGIONS as u64,
                category_inverted: inverted,
                category_mask: mask,
                return_mask: returned,
                ..Default::default()
            };
            // SAFETY: PAGEMAP_SCAN takes a `struct pm_scan_arg`, and writes at
            // most `vec_len` `struct page_region`s to `vec`: `regions` has
            // that many and outlives the call.
            let n = unsafe { ioctl(&self.pagemap, PAGEMAP_SCAN, &mut arg) }
                .map_err(|e| io::Error::new(e.kind(), format!("PAGEMAP_SCAN: {e}")))?;
            for r in &regions[..n as usize] {
                let first = (r.start - self.base) / PAGE as u64;
                let last = (r.end - self.base) / PAGE as u64;
                found(first, last)?;
            }
            if arg.walk_end <= start {
                return Err(io::Error::other("PAGEMAP_SCAN made no progress"));
            }
            start = arg.walk_end;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn request_numbers_match_the_kernel_headers() {
        // The values <linux/userfaultfd.h> and <linux/fs.h> (6.7) define.
        assert_eq!(UFFDIO_API, 0xc018_aa3f);
        assert_eq!(UFFDIO_REGISTER, 0xc020_aa00);
        assert_eq!(UFFDIO_WRITEPROTECT, 0xc018_aa06);
        assert_eq!(PAGEMAP_SCAN, 0xc060_6610);
        assert_eq!(std::mem::size_of::<PageRegion>(), 24);
    }

    /// A process that maps a file MAP_PRIVATE and touches pages on
    /// request (`w N`: write page N, `r N`: read it).
    struct Toucher {
        child: std::process::Child,
        out: std::io::BufReader<std::process::ChildStdout>,
    }

    impl Toucher {
        fn start(file: &Path, len: usize, preload: Option<&Path>) -> Self {
            use std::io::BufRead;
            let script = "import mmap,sys\n\
                f=open(sys.argv[1],'r+b')\n\
                m=mmap.mmap(f.fileno(),int(sys.argv[2]),flags=mmap.MAP_PRIVATE,prot=mmap.PROT_READ|mmap.PROT_WRITE)\n\
                print('ready',flush=True)\n\
                for line in sys.stdin:\n    \
                    op,p=line.split();a=int(p)*4096\n    \
                    if op=='w': m[a]=(m[a]+1)%256\n    \
                    elif op=='d': m.madvise(mmap.MADV_DONTNEED,a,4096)\n    \
                    else: m[a]\n    \
                    print('ok',flush=True)\n";
            let mut cmd = std::process::Command::new("python3");
            cmd.args(["-c", script])
                .arg(file)
                .arg(len.to_string())
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped());
            if let Some(shim) = preload {
                cmd.env("LD_PRELOAD", shim);
            }
            let mut child = cmd.spawn().expect("python3 runs");
            let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
            let mut line = String::new();
            out.read_line(&mut line).unwrap();
            assert_eq!(line.trim(), "ready");
            Self { child, out }
        }

        fn touch(&mut self, ops: &[(&str, u64)]) {
            use std::io::{BufRead, Write};
            let stdin = self.child.stdin.as_mut().unwrap();
            for (op, page) in ops {
                writeln!(stdin, "{op} {page}").unwrap();
                stdin.flush().unwrap();
                let mut line = String::new();
                self.out.read_line(&mut line).unwrap();
                assert_eq!(line.trim(), "ok");
            }
        }
    }

    impl Drop for Toucher {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// The shim in another process, the asynchronous write-protection and
    /// the scan, end to end: exactly the written pages come back, a read
    /// is not a write, and each scan starts a new interval.
    #[test]
    fn reports_exactly_the_pages_another_process_wrote() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ram");
        let len = 64 * PAGE;
        std::fs::write(&file, vec![5u8; len]).unwrap();
        let shim = crate::shim::install(dir.path()).unwrap();

        let mut p = Toucher::start(&file, len, Some(&shim));
        // Page 7 is private before tracking starts: it must not show up
        // until written again.
        p.touch(&[("w", 7), ("r", 9)]);
        let ram = GuestRam::find(p.child.id() as i32, &file, len as u64).unwrap();
        let t = WriteTracker::attach(&ram)
            .expect("the kernel supports WP_ASYNC and PAGEMAP_SCAN")
            .expect("the shim left a userfaultfd in the process");
        assert!(t.armed());
        assert_eq!(t.written().unwrap(), Vec::<u64>::new());
        p.touch(&[("w", 3), ("r", 10), ("w", 40), ("w", 41), ("w", 63)]);
        assert_eq!(t.written().unwrap(), vec![3, 40, 41, 63]);
        assert_eq!(
            t.written().unwrap(),
            Vec::<u64>::new(),
            "a scan protects again"
        );
        p.touch(&[("w", 3), ("w", 7), ("r", 40), ("w", 0)]);
        assert_eq!(t.written().unwrap(), vec![0, 3, 7]);
        // The writes landed (the mapping is still the process's own).
        let mut page = vec![0u8; PAGE];
        ram.read(3, &mut page).unwrap();
        assert_eq!(page[0], 7);
        assert!(!t.armed(), "a scan disarms until confirmed");
        t.confirm();
        t.protect_all(true).unwrap();
        assert_eq!(t.written().unwrap(), Vec::<u64>::new());

        // Another tracker of the same process (a restarted tine) starts
        // disarmed, and once armed sees the same writes.
        drop(t);
        let again = WriteTracker::reattach(&ram).unwrap().expect("still there");
        assert!(!again.armed());
        again.protect_all(true).unwrap();
        p.touch(&[("w", 12)]);
        assert_eq!(again.written().unwrap(), vec![12]);
        // Pages dropped from the mapping (a balloon's discard: QEMU's
        // MADV_DONTNEED through the shim) read the file again, so they
        // count, whether written in this interval (20), an earlier one
        // (12, protected since) or never (22, only read). Dropped, they
        // are protected again.
        p.touch(&[("w", 20), ("d", 20), ("d", 12), ("r", 22), ("d", 22)]);
        assert_eq!(again.written().unwrap(), vec![12, 20, 22]);
        assert_eq!(again.written().unwrap(), Vec::<u64>::new());
        p.touch(&[("r", 12), ("w", 20)]);
        assert_eq!(again.written().unwrap(), vec![20]);
        ram.read(12, &mut page).unwrap();
        assert_eq!(page[0], 5, "a dropped page reads the file again");
        // Protected pages the process never wrote may carry markers that
        // the page map shows as swapped (how many depends on what the
        // kernel had mapped); without protection it shows exactly the
        // private ones again (what a full compare relies on).
        let private = vec![0, 3, 7, 20, 40, 41, 63];
        let marked = ram.private_pages().unwrap();
        assert!(private.iter().all(|p| marked.contains(p)), "{marked:?}");
        again.protect_all(false).unwrap();
        assert_eq!(ram.private_pages().unwrap(), private);

        // Without the shim there is nothing to track with.
        let plain = Toucher::start(&file, len, None);
        let ram = GuestRam::find(plain.child.id() as i32, &file, len as u64).unwrap();
        assert!(WriteTracker::attach(&ram).unwrap().is_none());
    }
}
