//! Entering the jail, in the forked child before exec: the mount
//! namespace and its root, rlimits, capabilities and the uid.

use super::mounts::Step;
use super::Prepared;

impl Prepared {
    /// Enter the jail: run in the forked child, before exec.
    ///
    /// # Safety
    /// Only between fork and exec of a child; it only makes system calls
    /// on memory prepared before the fork (no allocation, no locks).
    pub unsafe fn enter(&self) -> std::io::Result<()> {
        fn check(r: libc::c_int) -> std::io::Result<()> {
            if r < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(())
            }
        }
        let none = std::ptr::null::<libc::c_char>();
        // SAFETY: (for the whole block) every pointer passed is a
        // NUL-terminated string owned by `self` (alive for the call) or
        // null where the call allows it; no call keeps a pointer past its
        // return.
        unsafe {
            check(libc::unshare(libc::CLONE_NEWNS))?;
            check(libc::mount(
                none,
                c"/".as_ptr(),
                none,
                libc::MS_REC | libc::MS_SLAVE,
                std::ptr::null(),
            ))?;
            check(libc::mount(
                c"tmpfs".as_ptr(),
                self.root.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID,
                c"mode=0755,size=1m,nr_inodes=4096".as_ptr().cast(),
            ))?;
            for step in &self.steps {
                match step {
                    Step::Mkdir(p) => {
                        if libc::mkdir(p.as_ptr(), 0o755) < 0
                            && std::io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST)
                        {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    Step::Touch(p) => {
                        let fd = libc::open(
                            p.as_ptr(),
                            libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                            0o600,
                        );
                        check(fd)?;
                        libc::close(fd);
                    }
                    Step::Bind { src, dst, rw } => {
                        check(libc::mount(
                            src.as_ptr(),
                            dst.as_ptr(),
                            none,
                            libc::MS_BIND | libc::MS_REC,
                            std::ptr::null(),
                        ))?;
                        let mut flags =
                            libc::MS_BIND | libc::MS_REMOUNT | libc::MS_NOSUID | libc::MS_NODEV;
                        if !rw {
                            flags |= libc::MS_RDONLY;
                        }
                        check(libc::mount(
                            none,
                            dst.as_ptr(),
                            none,
                            flags,
                            std::ptr::null(),
                        ))?;
                    }
                    Step::Symlink { target, link } => {
                        check(libc::symlink(target.as_ptr(), link.as_ptr()))?
                    }
                    Step::Mknod {
                        path,
                        mode,
                        dev,
                        owned,
                    } => {
                        check(libc::mknod(path.as_ptr(), *mode, *dev))?;
                        // mknod's mode passes through the umask.
                        check(libc::chmod(path.as_ptr(), *mode & 0o777))?;
                        if *owned {
                            check(libc::chown(path.as_ptr(), self.uid, self.uid))?;
                        }
                    }
                }
            }
            // The tmpfs becomes the root; the host's tree is detached.
            check(libc::chdir(self.root.as_ptr()))?;
            check(
                libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) as libc::c_int,
            )?;
            check(libc::umount2(c".".as_ptr(), libc::MNT_DETACH))?;
            check(libc::chdir(c"/".as_ptr()))?;
            check(libc::mount(
                none,
                c"/".as_ptr(),
                none,
                libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID,
                std::ptr::null(),
            ))?;
            let limit = |res, n: u64| {
                let r = libc::rlimit {
                    rlim_cur: n,
                    rlim_max: n,
                };
                check(libc::setrlimit(res, &r))
            };
            limit(libc::RLIMIT_NOFILE, self.nofile)?;
            limit(libc::RLIMIT_NPROC, self.nproc)?;
            limit(libc::RLIMIT_CORE, 0)?;
            limit(libc::RLIMIT_FSIZE, self.fsize)?;
            // Past the size limit a write fails (EFBIG) instead of
            // killing QEMU.
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            for cap in 0..64 {
                libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0);
            }
            check(libc::setgroups(0, std::ptr::null()))?;
            check(libc::setresgid(self.uid, self.uid, self.uid))?;
            check(libc::setresuid(self.uid, self.uid, self.uid))?;
            check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
        }
        Ok(())
    }
}
