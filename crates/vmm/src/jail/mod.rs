//! The jail every QEMU runs in (on by default, the same under KVM and
//! TCG), after Firecracker's jailer:
//!
//! - its own unprivileged uid and gid from a configured range, no
//!   supplementary groups, no capabilities (the bounding set is dropped
//!   too) and `no_new_privs`;
//! - its own mount namespace whose root is a small read-only tmpfs holding
//!   only what this QEMU opens: `/usr` and the loader's cache (read-only),
//!   the kernel and initramfs (read-only), the files of its disk's backing
//!   chain and of the snapshot it restores (read-only), its own VM and RAM
//!   directories (read-write, owned by its uid), and device nodes made for
//!   it (`null`, `zero`, `random`, `urandom`, `kvm` where used). Every
//!   path keeps the name it has on the host, so QMP commands need no
//!   translation. The tap device is opened by tine and passed in;
//! - a cgroup leaf with CPU, memory, pids (and I/O) limits ([`cgroup`]),
//!   joined right after QEMU starts ([`Prepared::join_cgroup`]);
//! - rlimits: open files, processes, file size, no core dumps;
//! - QEMU's own seccomp filter (`-sandbox`, set on the command line).
//!
//! Everything the child does between fork and exec is in
//! [`Prepared::enter`]: plain system calls on data prepared before the
//! fork, as a forked child of a threaded process must.

pub mod cgroup;
pub mod chain;
pub mod uids;

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::{Accel, Machine};
use crate::error::{Error, IoContext, Result};

/// How VMs are confined. `[jail]` in the server's config.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JailConfig {
    /// Run each QEMU jailed (default on). Off: QEMU runs as tine's user
    /// with tine's view of the host (a loud warning at start).
    pub enabled: bool,
    /// The uids (and gids of the same numbers) VMs run as.
    pub uid_base: u32,
    pub uid_count: u32,
    /// Put each VM in its own cgroup leaf with limits.
    pub cgroups: bool,
    /// The cgroup under which leaves are made (`/sys/fs/cgroup/<this>`).
    pub cgroup_parent: String,
    /// Memory QEMU may use beyond the guest's RAM.
    pub vmm_overhead_mib: u32,
    /// Processes and threads per QEMU.
    pub pids_max: u32,
    /// Open files per QEMU.
    pub nofile: u64,
    /// Disk bandwidth per VM in bytes/s (read, write); none by default.
    pub io_read_bps: Option<u64>,
    pub io_write_bps: Option<u64>,
    /// Console log bytes kept per VM: `console.log` grows to this, then
    /// becomes `console.log.1` (replacing the older one).
    pub console_max_bytes: u64,
}

impl Default for JailConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            uid_base: 900_000,
            uid_count: 65_536,
            cgroups: true,
            cgroup_parent: "tine".into(),
            vmm_overhead_mib: 256,
            pids_max: 512,
            nofile: 4096,
            io_read_bps: None,
            io_write_bps: None,
            console_max_bytes: 1 << 20,
        }
    }
}

impl JailConfig {
    /// Settings that would make a jail no jail, or overflow its range.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.uid_base < 1000 {
            return Err(format!(
                "jail.uid_base must be at least 1000 (a range no system account uses), got {}",
                self.uid_base
            ));
        }
        if self.uid_count == 0 || self.uid_base.checked_add(self.uid_count).is_none() {
            return Err(
                "jail.uid_count must be at least 1 and uid_base + uid_count fit in 32 bits".into(),
            );
        }
        if self.pids_max < 16 || self.nofile < 64 {
            return Err(
                "jail.pids_max must be at least 16 and jail.nofile at least 64 (QEMU needs them)"
                    .into(),
            );
        }
        if self.cgroup_parent.is_empty()
            || self
                .cgroup_parent
                .split('/')
                .any(|c| c.is_empty() || c == "." || c == "..")
        {
            return Err(format!(
                "jail.cgroup_parent {:?} is not a relative cgroup path",
                self.cgroup_parent
            ));
        }
        Ok(())
    }

    /// Off when `TINE_JAIL=0` (the CLI and tests); the server reads its
    /// config file instead. `TINE_JAIL_CGROUPS=0`: jailed without cgroups.
    pub fn from_env() -> Self {
        let off = |var: &str| std::env::var(var).is_ok_and(|v| v == "0" || v == "off");
        Self {
            enabled: !off("TINE_JAIL"),
            cgroups: !off("TINE_JAIL_CGROUPS"),
            ..Self::default()
        }
    }
}

/// What one QEMU needs inside its jail.
#[derive(Debug, Clone, Default)]
pub struct Needs {
    /// Directories it writes (its VM and RAM directories).
    pub rw_dirs: Vec<PathBuf>,
    /// Files it only reads (kernel, initramfs, a snapshot's RAM and state).
    pub ro_files: Vec<PathBuf>,
    /// The qcow2 overlay whose backing chain it opens.
    pub disk: Option<PathBuf>,
    /// The only files that chain may name (its snapshots' disks, the base
    /// image or its NBD socket): the chain comes from headers a VM could
    /// have written.
    pub chain_allowed: Vec<PathBuf>,
    /// The QEMU binary, if it is not under `/usr`.
    pub binary: Option<PathBuf>,
}

/// One step of building the jail, with host paths already prefixed by the
/// jail root.
#[derive(Debug)]
enum Step {
    Mkdir(CString),
    Touch(CString),
    Bind {
        src: CString,
        dst: CString,
        rw: bool,
    },
    Symlink {
        target: CString,
        link: CString,
    },
    Mknod {
        path: CString,
        mode: libc::mode_t,
        dev: libc::dev_t,
        owned: bool,
    },
}

/// A jail ready for one QEMU child: its uid, its cgroup and the steps.
#[derive(Debug)]
pub struct Prepared {
    pub uid: u32,
    root: CString,
    steps: Vec<Step>,
    cgroup: Option<cgroup::Leaf>,
    nofile: u64,
    nproc: u64,
    fsize: u64,
}

fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("paths have no NUL byte")
}

/// `path` under the jail root `root`.
fn inside(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

/// The mount point every jail's tmpfs goes on (in its own namespace).
pub fn root_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("jail").join("root")
}

/// Change `path`'s owner to `uid:uid` and its mode to `mode`.
pub fn own(path: &Path, uid: u32, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    // chown and chmod follow links; a link here was planted by a jail.
    let meta = std::fs::symlink_metadata(path).ctx(|| format!("stat {}", path.display()))?;
    if meta.file_type().is_symlink() {
        return Err(jail_err(
            &path.display().to_string(),
            "is a symbolic link, not a file tine made; refusing to hand it over",
        ));
    }
    std::os::unix::fs::chown(path, Some(uid), Some(uid))
        .ctx(|| format!("chown {} to {uid}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .ctx(|| format!("chmod {}", path.display()))
}

/// Make a file the jail wrote shared: root's, readable by every jail
/// (snapshot files; only jails that bind them can reach them).
pub fn share(path: &Path) -> Result<()> {
    own(path, 0, 0o644)
}

/// Plan the mounts for `needs`: what is bound where, which directories
/// hold the mount points. Pure apart from reading the disk chain and
/// whether the host's `/lib` & co. are links.
fn plan(root: &Path, data_dir: &Path, needs: &Needs, accel: Accel) -> Result<Vec<Step>> {
    // (host path, read-write?)
    let mut binds: Vec<(PathBuf, bool)> = vec![(PathBuf::from("/usr"), false)];
    if Path::new("/etc/ld.so.cache").exists() {
        binds.push(("/etc/ld.so.cache".into(), false));
    }
    binds.extend(needs.rw_dirs.iter().map(|d| (d.clone(), true)));
    binds.extend(needs.ro_files.iter().map(|f| (f.clone(), false)));
    if let Some(b) = &needs.binary {
        binds.push((b.clone(), false));
    }
    if let Some(disk) = &needs.disk {
        let below = chain::below_within(disk, &needs.chain_allowed).map_err(|e| {
            jail_err(
                &disk.display().to_string(),
                format!("{e}; refusing to start"),
            )
        })?;
        for b in below {
            match b {
                chain::Backing::File(p) => binds.push((p, false)),
                chain::Backing::Socket(p) => {
                    // Connecting needs write access to the socket; only
                    // jails that bind it can reach it (the data directory
                    // is 0700).
                    use std::os::unix::fs::PermissionsExt;
                    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666))
                        .ctx(|| format!("chmod {}", p.display()))?;
                    binds.push((p, false));
                }
            }
        }
    }
    let mut steps = Vec::new();
    let mut dirs: Vec<PathBuf> = Vec::new();
    let add_parents = |p: &Path, dirs: &mut Vec<PathBuf>| {
        for a in p.ancestors().skip(1) {
            if a != Path::new("/") && !dirs.iter().any(|d| d == a) {
                dirs.push(a.to_path_buf());
            }
        }
    };
    // Top-level links or directories the loader and the binary expect.
    let mut links = Vec::new();
    for top in ["/lib", "/lib64", "/bin", "/sbin"] {
        let p = Path::new(top);
        match std::fs::read_link(p) {
            Ok(target) => links.push((target, p.to_path_buf())),
            Err(_) if p.is_dir() => binds.push((p.to_path_buf(), false)),
            Err(_) => {}
        }
    }
    // Resolve, drop duplicates and anything inside another bound directory.
    let mut resolved: Vec<(PathBuf, bool, bool)> = Vec::new(); // (path, rw, is_dir)
    for (p, rw) in binds {
        let p = std::fs::canonicalize(&p).ctx(|| format!("jail: {} is missing", p.display()))?;
        let is_dir = p.is_dir();
        if let Some(existing) = resolved.iter_mut().find(|(q, _, _)| *q == p) {
            existing.1 |= rw;
        } else {
            resolved.push((p, rw, is_dir));
        }
    }
    let covered = |p: &Path, all: &[(PathBuf, bool, bool)]| {
        all.iter()
            .any(|(q, _, dir)| *dir && q != p && p.starts_with(q))
    };
    let kept: Vec<(PathBuf, bool, bool)> = resolved
        .iter()
        .filter(|(p, _, _)| !covered(p, &resolved))
        .cloned()
        .collect();
    for (p, rw, is_dir) in &kept {
        add_parents(p, &mut dirs);
        // Files tine wrote before jails (or QEMU wrote 0640) must be
        // readable by the jail's uid; the data directory itself is 0700.
        if !rw && !is_dir && p.starts_with(data_dir) {
            use std::os::unix::fs::PermissionsExt;
            if let Ok(m) = std::fs::metadata(p) {
                let mode = m.permissions().mode();
                if m.is_file() && mode & 0o004 == 0 {
                    std::fs::set_permissions(
                        p,
                        std::fs::Permissions::from_mode((mode | 0o444) & 0o7777),
                    )
                    .ctx(|| format!("chmod {}", p.display()))?;
                }
            }
        }
    }
    add_parents(Path::new("/dev/null"), &mut dirs);
    dirs.sort_by_key(|d| d.components().count());
    for d in &dirs {
        steps.push(Step::Mkdir(cstr(&inside(root, d))));
    }
    for (target, link) in links {
        steps.push(Step::Symlink {
            target: cstr(&target),
            link: cstr(&inside(root, &link)),
        });
    }
    for (p, rw, is_dir) in kept {
        let dst = cstr(&inside(root, &p));
        steps.push(if is_dir {
            Step::Mkdir(dst.clone())
        } else {
            Step::Touch(dst.clone())
        });
        steps.push(Step::Bind {
            src: cstr(&p),
            dst,
            rw,
        });
    }
    let chr = libc::S_IFCHR;
    for (name, major, minor) in [
        ("null", 1, 3),
        ("zero", 1, 5),
        ("random", 1, 8),
        ("urandom", 1, 9),
    ] {
        steps.push(Step::Mknod {
            path: cstr(&inside(root, &Path::new("/dev").join(name))),
            mode: chr | 0o666,
            dev: libc::makedev(major, minor),
            owned: false,
        });
    }
    if accel == Accel::Kvm {
        steps.push(Step::Mknod {
            path: cstr(&inside(root, Path::new("/dev/kvm"))),
            mode: chr | 0o600,
            dev: libc::makedev(10, 232),
            owned: true,
        });
    }
    Ok(steps)
}

/// Bytes of the qcow2 image's virtual disk (0 if unreadable).
fn virtual_size(path: &Path) -> u64 {
    crate::qcow2::read(path).map_or(0, |h| h.virtual_size)
}

impl Prepared {
    /// Claim a uid, make the cgroup leaf and plan the mounts for VM `id`.
    /// The caller owns the VM's directories to [`Prepared::uid`] before
    /// spawning.
    pub fn new(
        config: &JailConfig,
        data_dir: &Path,
        id: &str,
        uid: u32,
        machine: &Machine,
        needs: &Needs,
    ) -> Result<Prepared> {
        let root = root_dir(data_dir);
        std::fs::create_dir_all(&root).ctx(|| format!("creating {}", root.display()))?;
        let steps = plan(&root, data_dir, needs, machine.accel)?;
        let cgroup = if config.cgroups {
            let mut limits = cgroup::Limits::for_vm(
                machine.vcpus,
                machine.memory_mib,
                config.vmm_overhead_mib,
                config.pids_max,
            );
            if config.io_read_bps.is_some() || config.io_write_bps.is_some() {
                limits.io_bps = Some((
                    config.io_read_bps.unwrap_or(u64::MAX / 2),
                    config.io_write_bps.unwrap_or(u64::MAX / 2),
                ));
            }
            match cgroup::Leaf::create(&config.cgroup_parent, id, &limits, data_dir) {
                Ok(leaf) => Some(leaf),
                Err(e) => {
                    cgroup::remove(&config.cgroup_parent, id);
                    return Err(e);
                }
            }
        } else {
            None
        };
        // No file QEMU writes may outgrow the larger of its disk and its
        // RAM (plus qcow2's metadata): a backstop under the guest's own
        // full-disk limit.
        let disk = needs.disk.as_deref().map(virtual_size).unwrap_or(0);
        let ram = u64::from(machine.memory_mib) << 20;
        let big = disk.max(ram);
        let fsize = big.saturating_add(big / 8).saturating_add(64 << 20);
        Ok(Prepared {
            uid,
            root: cstr(&root),
            steps,
            cgroup,
            nofile: config.nofile,
            nproc: u64::from(config.pids_max),
            fsize,
        })
    }

    /// Move process `pid` (all its threads) into the VM's cgroup leaf.
    ///
    /// Done by tine right after QEMU starts, while it waits for QMP, not by
    /// the child before exec: a move takes the kernel's cgroup threadgroup
    /// lock for writing, which waits for an RCU grace period (≈ 10 ms here
    /// when no move happened recently) and would sit on every create's
    /// critical path. What QEMU allocated before the move (its libraries
    /// and early heap) stays charged to tine's cgroup.
    pub fn join_cgroup(&self, pid: i32) -> std::io::Result<()> {
        use std::io::Write;
        if let Some(leaf) = &self.cgroup {
            for mut f in leaf.procs_files() {
                f.write_all(pid.to_string().as_bytes())?;
            }
        }
        Ok(())
    }

    pub fn cgroup_dirs(&self) -> Vec<PathBuf> {
        self.cgroup
            .as_ref()
            .map(|c| c.dirs().to_vec())
            .unwrap_or_default()
    }

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

/// Undo what a jail left on the host for VM `id` (after QEMU is gone):
/// its cgroup leaf and its uid claim.
pub fn release(config: &JailConfig, data_dir: &Path, id: &str) {
    if config.cgroups {
        cgroup::remove(&config.cgroup_parent, id);
    }
    uids::release_vm(data_dir, id);
}

/// An error of setting up a jail.
pub fn jail_err(id: &str, detail: impl std::fmt::Display) -> Error {
    Error::Io {
        context: format!("jail of VM {id}"),
        source: std::io::Error::other(detail.to_string()),
    }
}
