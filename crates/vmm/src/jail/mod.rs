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

use serde::{Deserialize, Serialize};

use crate::config::Machine;
use crate::error::{Error, IoContext, Result};

use mounts::{cstr, plan, Step};

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
