//! `[jail]` in the server's config: how VMs are confined. Its own file, so
//! the crate's config ([`crate::config`]) can hold it without importing the
//! jail that imports that config.

use serde::{Deserialize, Serialize};

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
