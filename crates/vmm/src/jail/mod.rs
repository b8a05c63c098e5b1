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
//!
//! Besides this file (the config, [`Prepared`] and what tine does on the
//! host): `mounts` plans the jail's mounts (its [`Needs`] as steps),
//! `enter` takes the steps in the child, [`chain`] reads a disk's backing
//! chain, [`uids`] claims the uids and [`cgroup`] makes the leaves.

pub mod cgroup;
pub mod chain;
mod enter;
mod mounts;
pub mod uids;

use std::ffi::CString;
use std::path::{Path, PathBuf};

use crate::config::Machine;
use crate::error::{Error, IoContext, Result};

use mounts::{cstr, plan, Step};

pub mod config;
pub use config::JailConfig;

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
