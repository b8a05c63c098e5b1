//! A cgroup leaf per jailed VM: `<root>/<parent>/<vm id>` with its CPU,
//! memory, pids and (when set) I/O limits. Both layouts are handled: the
//! unified v2 hierarchy (a fresh Debian 12) and v1's one hierarchy per
//! controller (some hosts and containers, this project's CI among them).
//!
//! tine moves the QEMU process into its leaf right after it starts,
//! through `cgroup.procs` descriptors opened here (see
//! `Prepared::join_cgroup` for why not before exec).

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::error::{Error, IoContext, Result};

const ROOT: &str = "/sys/fs/cgroup";
/// The v1 hierarchies a leaf is made in (`cpu` may be mounted with
/// `cpuacct`; Debian links `cpu` to it).
const V1_CONTROLLERS: [&str; 4] = ["cpu", "memory", "pids", "blkio"];
/// The controllers a v2 leaf needs enabled above it.
const V2_CONTROLLERS: [&str; 4] = ["cpu", "memory", "pids", "io"];
/// CFS period: limits are in µs per this.
const PERIOD_US: u64 = 100_000;

/// What a leaf allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// CPU time per period, in µs ([`PERIOD_US`] is one full CPU).
    pub cpu_quota_us: u64,
    pub memory_bytes: u64,
    pub pids: u32,
    /// Bytes per second on the data directory's block device, if set and
    /// the device is a real one.
    pub io_bps: Option<(u64, u64)>,
}

impl Limits {
    /// `vcpus` full CPUs plus half a CPU for QEMU's own threads (its main
    /// loop and I/O run beside the vCPUs); the guest's memory plus
    /// `overhead_mib` for QEMU itself (TCG's code cache, device state,
    /// page tables).
    pub fn for_vm(vcpus: u32, memory_mib: u32, overhead_mib: u32, pids: u32) -> Self {
        Self {
            cpu_quota_us: u64::from(vcpus) * PERIOD_US + PERIOD_US / 2,
            memory_bytes: (u64::from(memory_mib) + u64::from(overhead_mib)) << 20,
            pids,
            io_bps: None,
        }
    }
}

/// Which cgroup layout the host has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    V2,
    V1,
}

pub fn layout() -> Option<Layout> {
    if Path::new(ROOT).join("cgroup.controllers").exists() {
        Some(Layout::V2)
    } else if Path::new(ROOT).join("memory").join("cgroup.procs").exists() {
        Some(Layout::V1)
    } else {
        None
    }
}

/// The leaf directories of VM `id` under `parent` (one for v2, one per
/// controller for v1).
pub fn leaf_dirs(layout: Layout, parent: &str, id: &str) -> Vec<PathBuf> {
    match layout {
        Layout::V2 => vec![Path::new(ROOT).join(parent).join(id)],
        Layout::V1 => V1_CONTROLLERS
            .iter()
            .map(|c| Path::new(ROOT).join(c).join(parent).join(id))
            .filter(|d| d.parent().and_then(Path::parent).is_some_and(Path::exists))
            .collect(),
    }
}

/// The cgroup files and values that express `limits`.
pub fn settings(
    layout: Layout,
    limits: &Limits,
    device: Option<(u32, u32)>,
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    match layout {
        Layout::V2 => {
            out.push((
                "cpu.max".into(),
                format!("{} {PERIOD_US}", limits.cpu_quota_us),
            ));
            out.push(("memory.max".into(), limits.memory_bytes.to_string()));
            out.push(("memory.swap.max".into(), "0".into()));
            out.push(("pids.max".into(), limits.pids.to_string()));
            if let (Some((r, w)), Some((maj, min))) = (limits.io_bps, device) {
                out.push(("io.max".into(), format!("{maj}:{min} rbps={r} wbps={w}")));
            }
        }
        Layout::V1 => {
            out.push(("cpu/cpu.cfs_period_us".into(), PERIOD_US.to_string()));
            out.push((
                "cpu/cpu.cfs_quota_us".into(),
                limits.cpu_quota_us.to_string(),
            ));
            out.push((
                "memory/memory.limit_in_bytes".into(),
                limits.memory_bytes.to_string(),
            ));
            out.push(("pids/pids.max".into(), limits.pids.to_string()));
            if let (Some((r, w)), Some((maj, min))) = (limits.io_bps, device) {
                out.push((
                    "blkio/blkio.throttle.read_bps_device".into(),
                    format!("{maj}:{min} {r}"),
                ));
                out.push((
                    "blkio/blkio.throttle.write_bps_device".into(),
                    format!("{maj}:{min} {w}"),
                ));
            }
        }
    }
    out
}

/// A VM's leaf, made and limited, with its `cgroup.procs` files open for
/// the QEMU child to join.
#[derive(Debug)]
pub struct Leaf {
    dirs: Vec<PathBuf>,
    procs: Vec<File>,
}

fn cg_err(path: &Path, detail: impl std::fmt::Display) -> Error {
    Error::Io {
        context: format!("cgroup {}", path.display()),
        source: std::io::Error::other(detail.to_string()),
    }
}

/// Enable `controllers` for the children of `dir` (each one alone: a
/// controller the host lacks must not stop the others).
fn enable_controllers(dir: &Path) {
    let control = dir.join("cgroup.subtree_control");
    for c in V2_CONTROLLERS {
        let _ = std::fs::write(&control, format!("+{c}"));
    }
}

/// The major:minor of the block device holding `path`, if it is one.
fn block_device(path: &Path) -> Option<(u32, u32)> {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(path).ok()?.dev();
    let (maj, min) = (libc::major(dev), libc::minor(dev));
    Path::new(&format!("/sys/dev/block/{maj}:{min}"))
        .exists()
        .then_some((maj, min))
}

impl Leaf {
    /// Make VM `id`'s leaf under `parent`, set `limits`, open its procs.
    pub fn create(parent: &str, id: &str, limits: &Limits, data_dir: &Path) -> Result<Leaf> {
        let layout = layout().ok_or_else(|| {
            cg_err(
                Path::new(ROOT),
                "no cgroup hierarchy is mounted (set jail.cgroups = false to run without)",
            )
        })?;
        let dirs = leaf_dirs(layout, parent, id);
        if layout == Layout::V2 {
            enable_controllers(Path::new(ROOT));
            let p = Path::new(ROOT).join(parent);
            std::fs::create_dir_all(&p).ctx(|| format!("creating {}", p.display()))?;
            enable_controllers(&p);
        }
        let mut leaf = Leaf {
            dirs: Vec::new(),
            procs: Vec::new(),
        };
        for d in &dirs {
            match std::fs::create_dir_all(d) {
                Ok(()) => leaf.dirs.push(d.clone()),
                Err(e) => return Err(e).ctx(|| format!("creating {}", d.display())),
            }
        }
        let device = limits.io_bps.and_then(|_| block_device(data_dir));
        let base = match layout {
            Layout::V2 => Path::new(ROOT).join(parent).join(id),
            Layout::V1 => PathBuf::from(ROOT),
        };
        for (file, value) in settings(layout, limits, device) {
            let path = match layout {
                Layout::V2 => base.join(&file),
                Layout::V1 => {
                    let (ctrl, name) = file.split_once('/').expect("v1 settings name a controller");
                    base.join(ctrl).join(parent).join(id).join(name)
                }
            };
            if !path.exists() {
                // memory.swap.max without swap accounting, for one.
                tracing::debug!(file = %path.display(), "cgroup file missing; limit not set");
                continue;
            }
            std::fs::write(&path, &value)
                .map_err(|e| cg_err(&path, format!("writing {value:?}: {e}")))?;
        }
        for d in &leaf.dirs {
            let procs = d.join("cgroup.procs");
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&procs)
                .ctx(|| format!("opening {}", procs.display()))?;
            leaf.procs.push(f);
        }
        Ok(leaf)
    }

    /// The `cgroup.procs` files of every hierarchy.
    pub fn procs_files(&self) -> impl Iterator<Item = &File> {
        self.procs.iter()
    }

    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }
}

/// Remove VM `id`'s leaf (its processes must be gone). Missing is fine.
pub fn remove(parent: &str, id: &str) {
    let Some(layout) = layout() else { return };
    for d in leaf_dirs(layout, parent, id) {
        // A process may take a moment to leave after SIGKILL.
        for _ in 0..50 {
            match std::fs::remove_dir(&d) {
                Ok(()) => break,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_follow_the_machine() {
        let l = Limits::for_vm(2, 512, 256, 512);
        assert_eq!(l.cpu_quota_us, 250_000);
        assert_eq!(l.memory_bytes, 768 << 20);
        let v2 = settings(Layout::V2, &l, Some((8, 0)));
        assert!(v2.contains(&("cpu.max".into(), "250000 100000".into())));
        assert!(v2.contains(&("memory.max".into(), (768u64 << 20).to_string())));
        assert!(v2.contains(&("pids.max".into(), "512".into())));
        assert!(
            !v2.iter().any(|(f, _)| f == "io.max"),
            "no io limit unless set"
        );
        let io = Limits {
            io_bps: Some((1, 2)),
            ..l
        };
        assert!(settings(Layout::V2, &io, Some((8, 0)))
            .contains(&("io.max".into(), "8:0 rbps=1 wbps=2".into())));
        assert!(!settings(Layout::V2, &io, None)
            .iter()
            .any(|(f, _)| f == "io.max"));
        let v1 = settings(Layout::V1, &l, None);
        assert!(v1.contains(&("cpu/cpu.cfs_quota_us".into(), "250000".into())));
        assert!(v1.contains(&(
            "memory/memory.limit_in_bytes".into(),
            (768u64 << 20).to_string()
        )));
    }
}
