//! The files of one VM: its directory (tine's) and its RAM directory
//! (QEMU's), the logs in them, making and removing them, and listing the
//! VMs that have one.

use std::path::{Path, PathBuf};

use crate::config::Paths;
use crate::error::{Error, IoContext, Result};
use crate::process::QemuProcess;

/// Files of one VM. The VM directory is tine's (QEMU may only open its
/// disk overlays there); the RAM directory is QEMU's own (its RAM file,
/// sockets and pidfile), so a jailed QEMU can change nothing tine reads
/// back as its own record.
pub(super) struct VmFiles {
    pub(super) dir: PathBuf,
    pub(super) ram_dir: PathBuf,
}

impl VmFiles {
    pub(super) fn new(paths: &Paths, id: &str) -> Self {
        Self {
            dir: paths.vm_dir(id),
            ram_dir: paths.vm_ram_dir(id),
        }
    }
    /// The first disk overlay.
    pub(super) fn disk(&self) -> PathBuf {
        self.disk_generation(0)
    }
    /// The overlay after `generation` in-place captures. Each capture
    /// stacks a new file; none is renamed, because QEMU reopens images by
    /// name (read-only, when they become a backing file).
    pub(super) fn disk_generation(&self, generation: u32) -> PathBuf {
        match generation {
            0 => self.dir.join("disk.qcow2"),
            n => self.dir.join(format!("disk-{n}.qcow2")),
        }
    }
    pub(super) fn qmp(&self) -> PathBuf {
        self.ram_dir.join("qmp.sock")
    }
    pub(super) fn console_socket(&self) -> PathBuf {
        self.ram_dir.join("console.sock")
    }
    pub(super) fn console(&self) -> PathBuf {
        self.dir.join("console.log")
    }
    pub(super) fn qemu_log(&self) -> PathBuf {
        self.dir.join("qemu.log")
    }
    pub(super) fn pidfile(&self) -> PathBuf {
        self.ram_dir.join("qemu.pid")
    }
    pub(super) fn record(&self) -> PathBuf {
        self.dir.join("vm.json")
    }
    /// Where QEMU saves device state during a capture (made by tine and
    /// owned by QEMU's uid; then moved into the snapshot).
    pub(super) fn state_saving(&self) -> PathBuf {
        self.dir.join("state.saving")
    }
}

/// The last `max` bytes of a log file, as text.
pub fn log_tail(path: &Path, max: usize) -> String {
    let data = std::fs::read(path).unwrap_or_default();
    let start = data.len().saturating_sub(max);
    String::from_utf8_lossy(&data[start..]).trim().to_string()
}

pub(super) fn remove_dir(path: &Path) -> Result<()> {
    match std::fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::Io {
            context: format!("removing {}", path.display()),
            source: e,
        }),
    }
}

pub(super) fn prepare_dirs(dir: &Path, ram_dir: &Path) -> Result<()> {
    if dir.exists() {
        return Err(Error::Io {
            context: format!("VM directory {}", dir.display()),
            source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
        });
    }
    std::fs::create_dir_all(dir).ctx(|| format!("creating {}", dir.display()))?;
    std::fs::create_dir_all(ram_dir).ctx(|| format!("creating {}", ram_dir.display()))
}

/// The pid of VM `id`'s QEMU, if one runs (its pidfile names a process
/// whose command line names the VM's directory).
pub(super) fn cleanup_pid(paths: &Paths, id: &str) -> Option<i32> {
    let dir = paths.vm_dir(id);
    let pid = std::fs::read_to_string(VmFiles::new(paths, id).pidfile()).ok()?;
    let pid = pid.trim().parse::<i32>().ok()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    String::from_utf8_lossy(&cmdline)
        .contains(&dir.display().to_string())
        .then_some(pid)
}

/// Remove whatever VM `id` left behind (process, namespace, files), for
/// failed starts and for cleaning up after a crash.
pub(crate) async fn cleanup(paths: &Paths, id: &str) {
    let dir = paths.vm_dir(id);
    if let Some(pid) = cleanup_pid(paths, id) {
        if let Ok(p) = QemuProcess::adopt(pid) {
            p.kill().await;
        }
    }
    let _ = crate::netns::delete_by_name(&crate::netns::name_of(id)).await;
    crate::jail::release(&paths.jail, &paths.data_dir, id);
    let _ = remove_dir(&dir);
    let _ = remove_dir(&paths.vm_ram_dir(id));
}

/// IDs of all VMs that have a directory.
pub(crate) fn list(paths: &Paths) -> Vec<String> {
    let mut ids: Vec<String> = std::fs::read_dir(paths.vms_dir())
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    ids.sort();
    ids
}
