//! Validation of what callers ask for, in one place: timeouts, machine
//! shapes, fork counts, and the capacity left.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use tine_vmm::Machine;

use super::{Manager, SandboxError};
use crate::config::Config;
use crate::db::TeamUsage;

fn invalid<T>(message: String) -> Result<T, SandboxError> {
    Err(SandboxError::InvalidArgument(message))
}

/// A timeout in seconds as the API sends it: not negative, at most
/// `max_timeout_secs`.
pub fn timeout(config: &Config, secs: i64) -> Result<u64, SandboxError> {
    if secs < 0 {
        return invalid(format!("timeout must not be negative, got {secs}"));
    }
    let secs = secs as u64;
    if secs > config.max_timeout_secs {
        return invalid(format!(
            "timeout must be at most {} seconds, got {secs}",
            config.max_timeout_secs
        ));
    }
    Ok(secs)
}

/// An optional timeout (absent: the caller's default applies).
pub fn optional_timeout(config: &Config, secs: Option<i64>) -> Result<Option<u64>, SandboxError> {
    secs.map(|s| timeout(config, s)).transpose()
}

/// The machine shape of a new sandbox: the config's defaults for what is
/// not given, each within the config's bounds.
pub fn machine(
    config: &Config,
    cpu_count: Option<u32>,
    memory_mb: Option<u32>,
) -> Result<Machine, SandboxError> {
    let cpus = cpu_count.unwrap_or(config.default_cpu_count);
    if cpus == 0 || cpus > config.max_cpu_count {
        return invalid(format!(
            "cpuCount must be between 1 and {}, got {cpus}",
            config.max_cpu_count
        ));
    }
    let mem = memory_mb.unwrap_or(config.default_memory_mb);
    if mem < config.min_memory_mb || mem > config.max_memory_mb {
        return invalid(format!(
            "memoryMB must be between {} and {}, got {mem}",
            config.min_memory_mb, config.max_memory_mb
        ));
    }
    Ok(Machine {
        vcpus: cpus,
        memory_mib: memory_shape(mem).min(config.max_memory_mb),
        ..Machine::default()
    })
}

/// The memory a sandbox gets for `asked` MiB: the next of a few sizes
/// (powers of two and 1.5 times them: 128, 192, 256, 384, 512, 768, …).
/// Each (vCPUs, memory) pair of `base` is a template snapshot of its own,
/// built by a cold boot and kept on disk, so sizes are few: a create for
/// 129 MiB gets 192, not a boot of its own. Asking for more never gives
/// less.
pub fn memory_shape(asked: u32) -> u32 {
    let mut size: u32 = 128;
    loop {
        if asked <= size {
            return size;
        }
        let half_step = size + size / 2;
        if asked <= half_step {
            return half_step;
        }
        match size.checked_mul(2) {
            Some(next) => size = next,
            None => return asked,
        }
    }
}

/// How many children a fork may make: 1 to `max_fork_count`.
pub fn fork_count(config: &Config, count: i64) -> Result<usize, SandboxError> {
    let cap = config.max_fork_count;
    match usize::try_from(count) {
        Ok(n) if (1..=cap).contains(&n) => Ok(n),
        _ => invalid(format!("count must be between 1 and {cap}, got {count}")),
    }
}

/// Starts admitted but not yet counted where the limits look (live VMs,
/// sandbox rows). Checks and reservations happen under one lock, so
/// concurrent creates cannot pass a limit together.
#[derive(Default)]
pub(super) struct Admission(std::sync::Mutex<Reserved>);

#[derive(Default)]
struct Reserved {
    /// VM starts admitted and not yet live.
    starts: usize,
    /// Per team: admitted sandboxes whose rows do not yet count as
    /// starting or running.
    teams: HashMap<String, TeamUsage>,
}

fn add(a: &mut TeamUsage, b: TeamUsage, times: u64) {
    a.sandboxes += b.sandboxes * times;
    a.vcpus += b.vcpus * times;
    a.memory_mb += b.memory_mb * times;
}

fn sub(a: &mut TeamUsage, b: TeamUsage, times: u64) {
    a.sandboxes = a.sandboxes.saturating_sub(b.sandboxes * times);
    a.vcpus = a.vcpus.saturating_sub(b.vcpus * times);
    a.memory_mb = a.memory_mb.saturating_sub(b.memory_mb * times);
}

/// Room reserved for `starts` sandboxes of one team; given back when
/// dropped (the sandboxes are live by then, or failed).
pub(super) struct Ticket<'a> {
    admission: &'a Admission,
    starts: usize,
    team: String,
    /// One sandbox's share of the team's usage.
    each: TeamUsage,
    /// Sandboxes whose team share is still reserved here.
    uncounted: AtomicU64,
}

impl Ticket<'_> {
    /// One of its sandboxes now counts in the database (its row is
    /// starting or running): its team share is no longer reserved here.
    pub(super) fn counted(&self) {
        let mut r = self.admission.0.lock().unwrap_or_else(|e| e.into_inner());
        if self
            .uncounted
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            if let Some(t) = r.teams.get_mut(&self.team) {
                sub(t, self.each, 1);
            }
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut r = self.admission.0.lock().unwrap_or_else(|e| e.into_inner());
        r.starts = r.starts.saturating_sub(self.starts);
        let left = *self.uncounted.get_mut();
        if let Some(t) = r.teams.get_mut(&self.team) {
            sub(t, self.each, left);
            if *t == TeamUsage::default() {
                r.teams.remove(&self.team);
            }
        }
    }
}

impl Manager {
    /// Admit `more` sandboxes of `machine`'s shape for team `team`: room
    /// in the host's capacity (`max_sandboxes` and `max_sandboxes_per_core`;
    /// live VMs and starts admitted before) and in
    /// the team's limits (its starting and running rows and its admitted
    /// starts), reserved until the ticket is dropped.
    pub(super) fn admit(
        &self,
        team: &str,
        more: u64,
        machine: Machine,
    ) -> Result<Ticket<'_>, SandboxError> {
        self.check_host()?;
        // Template builds' VMs hold a slot too (a directory listing: read
        // before the lock); warm-pool VMs hold one until a sandbox needs it.
        let building = self.building_vms();
        let mut r = self.admission.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = self.live_count() + r.starts + building;
        let capacity = self.config.capacity();
        if n + more as usize > capacity.sandboxes {
            return Err(SandboxError::Capacity(super::CapacityReached {
                used: n,
                asked: more as usize,
                capacity,
                max_sandboxes: self.config.max_sandboxes,
            }));
        }
        let mut used = self.db.team_usage(team)?;
        if let Some(reserved) = r.teams.get(team) {
            add(&mut used, *reserved, 1);
        }
        self.check_team(team, used, more, machine)?;
        let each = TeamUsage {
            sandboxes: 1,
            vcpus: u64::from(machine.vcpus),
            memory_mb: u64::from(machine.memory_mib),
        };
        r.starts += more as usize;
        add(r.teams.entry(team.to_string()).or_default(), each, more);
        Ok(Ticket {
            admission: &self.admission,
            starts: more as usize,
            team: team.to_string(),
            each,
            uncounted: AtomicU64::new(more),
        })
    }

    /// The host's capacity, what admission counts against it (live,
    /// starting and building VMs) and the warm pool's VMs (ready, warming
    /// and restored ahead), which give way to starts.
    pub fn capacity(&self) -> (crate::config::Capacity, usize, usize) {
        let (n, pooled) = self.vms_in_use();
        (self.config.capacity(), n, pooled)
    }

    /// VMs of template builds running now.
    fn building_vms(&self) -> usize {
        let ids = self.driver.vm_ids();
        ids.iter().filter(|id| id.starts_with("build-")).count()
    }

    /// Live, starting and building VMs, and the warm pool's (ready and
    /// warming up).
    fn vms_in_use(&self) -> (usize, usize) {
        let starts = self
            .admission
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .starts;
        let pooled = self.pool.len() + self.pool.warming();
        (self.live_count() + starts + self.building_vms(), pooled)
    }

    /// After an admitted start took what it takes from the pool: let go
    /// of pooled VMs beyond what `max_sandboxes` leaves. Returns how many
    /// the pool may still add.
    pub(super) fn fit_pool(&self) -> usize {
        let (n, pooled) = self.vms_in_use();
        let max = self.config.capacity().sandboxes;
        let excess = (n + pooled).saturating_sub(max);
        if excess > 0 {
            self.pool.shrink(excess);
        }
        max.saturating_sub(n + pooled)
    }

    /// The host's memory and the data disk's room, against
    /// `min_free_memory_mb` and `min_free_disk_mb`.
    fn check_host(&self) -> Result<(), SandboxError> {
        let min_mem = self.config.min_free_memory_mb;
        if min_mem > 0 {
            if let Some(avail) = mem_available_mb() {
                if avail < min_mem {
                    return Err(SandboxError::HostMemory(format!(
                        "the host has {avail} MiB of memory available, below min_free_memory_mb ({min_mem}): no VM is started"
                    )));
                }
            }
        }
        let min_disk = self.config.min_free_disk_mb;
        if min_disk > 0 {
            if let Some(free) = self.driver.snapshots().free_disk_bytes() {
                let free = free >> 20;
                if free < min_disk {
                    return Err(SandboxError::HostDisk(format!(
                        "the host's data disk has {free} MiB free, below min_free_disk_mb ({min_disk}): no VM is started"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Room in team `team`'s limits, with `used` in use, for `more`
    /// sandboxes of `machine`'s shape.
    fn check_team(
        &self,
        team: &str,
        used: TeamUsage,
        more: u64,
        machine: Machine,
    ) -> Result<(), SandboxError> {
        let limits = self.config.team_limits(team);
        let over = |what: &str, used: u64, adding: u64, max: u64| {
            SandboxError::TeamLimit(format!(
                "team {team} would exceed its {what}: {used} in use + {adding} asked > {max}"
            ))
        };
        if let Some(max) = limits.max_sandboxes {
            if used.sandboxes + more > max as u64 {
                return Err(over("max_sandboxes", used.sandboxes, more, max as u64));
            }
        }
        let cpus = more * u64::from(machine.vcpus);
        if let Some(max) = limits.max_vcpus {
            if used.vcpus + cpus > max {
                return Err(over("max_vcpus", used.vcpus, cpus, max));
            }
        }
        let mem = more * u64::from(machine.memory_mib);
        if let Some(max) = limits.max_memory_mb {
            if used.memory_mb + mem > max {
                return Err(over("max_memory_mb (MiB)", used.memory_mb, mem, max));
            }
        }
        Ok(())
    }

    /// Room for another user snapshot in team `team`'s
    /// `max_snapshot_bytes` (its snapshots and pause captures on disk).
    pub(super) fn check_team_snapshots(&self, team: &str) -> Result<(), SandboxError> {
        let Some(max) = self.config.team_limits(team).max_snapshot_bytes else {
            return Ok(());
        };
        let used: u64 = self
            .db
            .team_snapshot_ids(team)?
            .iter()
            .map(|id| self.driver.snapshots().snapshot_bytes(id))
            .sum();
        if used >= max {
            return Err(SandboxError::TeamLimit(format!(
                "team {team} would exceed its max_snapshot_bytes: {used} bytes of snapshots on disk, limit {max}"
            )));
        }
        Ok(())
    }
}

/// `MemAvailable` of /proc/meminfo, in MiB.
pub(crate) fn mem_available_mb() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib >> 10)
}

/// Bytes free (to unprivileged writers) on the file system of `dir`.
pub(crate) fn disk_free_bytes(dir: &std::path::Path) -> Option<u64> {
    let s = nix::sys::statvfs::statvfs(dir).ok()?;
    Some(s.blocks_available().saturating_mul(s.fragment_size()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_hosts_available_memory() {
        assert!(mem_available_mb().is_some_and(|m| m > 0));
    }

    #[test]
    fn memory_is_rounded_up_to_a_few_shapes() {
        let shapes: Vec<u32> = [1, 128, 129, 192, 193, 256, 300, 511, 512, 513, 1000, 8192]
            .iter()
            .map(|&m| memory_shape(m))
            .collect();
        assert_eq!(
            shapes,
            [128, 128, 192, 192, 256, 256, 384, 512, 512, 768, 1024, 8192]
        );
        assert_eq!(memory_shape(u32::MAX), u32::MAX);
        let c = Config {
            max_memory_mb: 1000,
            ..Config::default()
        };
        assert_eq!(
            machine(&c, None, Some(900)).unwrap().memory_mib,
            1000,
            "never above the max"
        );
        assert_eq!(machine(&c, None, Some(129)).unwrap().memory_mib, 192);
    }

    #[test]
    fn bounds_are_checked_with_clear_messages() {
        let c = Config::default();
        assert_eq!(timeout(&c, 0).unwrap(), 0);
        let err = timeout(&c, -1).unwrap_err().to_string();
        assert!(err.contains("must not be negative"), "{err}");
        let err = timeout(&c, c.max_timeout_secs as i64 + 1)
            .unwrap_err()
            .to_string();
        assert!(err.contains("at most"), "{err}");
        assert_eq!(optional_timeout(&c, None).unwrap(), None);
        assert!(fork_count(&c, 0).is_err());
        assert!(fork_count(&c, -1).is_err());
        assert!(fork_count(&c, c.max_fork_count as i64 + 1).is_err());
        assert_eq!(fork_count(&c, 2).unwrap(), 2);
        assert!(machine(&c, Some(0), None).is_err());
        assert!(machine(&c, None, Some(c.max_memory_mb + 1)).is_err());
        let m = machine(&c, None, None).unwrap();
        assert_eq!(m.vcpus, c.default_cpu_count);
    }
}
