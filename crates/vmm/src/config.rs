//! Where tine keeps its files, which artifacts a VM boots from, and the
//! machine shape (vCPUs, memory, accelerator).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Directories tine uses. `data_dir` holds artifacts (kernel, images),
/// snapshots and one directory per VM (QMP socket, console log, disk
/// overlay: on the same filesystem as snapshots, so sealing a disk into a
/// snapshot is a rename); `shm_dir` holds guest RAM files (tmpfs).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Paths {
    pub data_dir: PathBuf,
    pub shm_dir: PathBuf,
    /// How VMs under these directories are confined.
    #[serde(default)]
    pub jail: crate::jail::config::JailConfig,
    /// Track the pages clones write (see [`crate::ram::tracker`]) so a
    /// capture reads only those; off: it compares every private page.
    #[serde(default = "yes")]
    pub track_writes: bool,
    /// Give booted VMs a virtio-balloon with free page reporting, so
    /// their guests hand freed pages back (clones keep their snapshot's
    /// device set).
    #[serde(default = "yes")]
    pub balloon: bool,
    /// Boot TCG guests on the TSC clocksource (see
    /// [`crate::qemu::guest_clock_cmdline`]).
    #[serde(default = "yes")]
    pub guest_tsc: bool,
}

fn yes() -> bool {
    true
}

/// A switch that is on unless the variable says `0` or `off`.
fn env_switch(var: &str) -> bool {
    std::env::var(var).map_or(true, |v| v != "0" && v != "off")
}

fn env_dir(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(default))
}

impl Paths {
    /// From `TINE_DATA_DIR` (`/var/lib/tine`) and `TINE_SHM_DIR`
    /// (`/dev/shm/tine`).
    pub fn from_env() -> Self {
        Self {
            data_dir: env_dir("TINE_DATA_DIR", "/var/lib/tine"),
            shm_dir: env_dir("TINE_SHM_DIR", "/dev/shm/tine"),
            jail: crate::jail::config::JailConfig::from_env(),
            track_writes: env_switch("TINE_TRACK_WRITES"),
            balloon: env_switch("TINE_BALLOON"),
            guest_tsc: env_switch("TINE_GUEST_TSC"),
        }
    }

    pub fn vms_dir(&self) -> PathBuf {
        self.data_dir.join("vms")
    }
    pub fn vm_dir(&self, id: &str) -> PathBuf {
        self.vms_dir().join(id)
    }
    pub fn vm_ram_dir(&self, id: &str) -> PathBuf {
        self.shm_dir.join("vms").join(id)
    }
    pub fn snapshots_dir(&self) -> PathBuf {
        self.data_dir.join("snapshots")
    }
    pub fn snapshot_dir(&self, id: &str) -> PathBuf {
        self.snapshots_dir().join(id)
    }
    /// Blank qcow2 overlays, one per backing disk (see
    /// [`crate::disk::OverlayCache`]).
    pub fn overlay_cache_dir(&self) -> PathBuf {
        self.data_dir.join("overlay-cache")
    }
    /// Files tine writes for QEMU to load (the write-tracking shim).
    pub fn lib_dir(&self) -> PathBuf {
        self.data_dir.join("lib")
    }
    /// Frozen RAM of a snapshot lives with the snapshot on disk: a paused
    /// sandbox must not hold memory, and captures survive a host reboot.
    /// Clones map it MAP_PRIVATE and share its pages in the page cache.
    pub fn snapshot_ram(&self, id: &str) -> PathBuf {
        self.snapshot_dir(id).join("ram")
    }

    /// The kernel, initramfs and base rootfs that `scripts/setup-host.sh`
    /// last built (symlinks under `<data_dir>/current`).
    pub fn current_artifacts(&self) -> Artifacts {
        let cur = self.data_dir.join("current");
        Artifacts {
            kernel: cur.join("vmlinuz"),
            initramfs: cur.join("initramfs.cpio"),
            rootfs: RootDisk::File(cur.join("rootfs-base.ext4")),
        }
    }
}

/// What a VM boots from. Paths are canonicalized by [`Artifacts::resolve`]
/// so a snapshot records the exact files, not the moving `current` links.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Artifacts {
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    /// Read-only base image; each VM writes to its own qcow2 overlay on it.
    pub rootfs: RootDisk,
}

/// The read-only disk under every VM's overlay.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum RootDisk {
    /// A raw image file (`base`, or an image converted before chunks).
    File(PathBuf),
    /// An export of the image daemon's NBD server (a chunked OCI image),
    /// read through QEMU's own NBD client.
    Nbd {
        socket: PathBuf,
        export: String,
        size: u64,
    },
}

impl From<PathBuf> for RootDisk {
    fn from(p: PathBuf) -> Self {
        RootDisk::File(p)
    }
}

impl From<&str> for RootDisk {
    fn from(p: &str) -> Self {
        RootDisk::File(p.into())
    }
}

impl RootDisk {
    /// What `qemu-img create -b` takes: the file, or a `json:` block
    /// spec for the export. The NBD client reconnects for a minute if the
    /// daemon restarts, so a guest sees a pause, not an I/O error.
    pub fn backing(&self) -> String {
        match self {
            RootDisk::File(p) => p.display().to_string(),
            RootDisk::Nbd { socket, export, .. } => format!(
                "json:{}",
                serde_json::json!({
                    "file.driver": "nbd",
                    "file.server.type": "unix",
                    "file.server.path": socket,
                    "file.export": export,
                    "file.reconnect-delay": 60,
                })
            ),
        }
    }

    /// Bytes the guest sees (None: the file is missing).
    pub fn size(&self) -> Option<u64> {
        match self {
            RootDisk::File(p) => std::fs::metadata(p).ok().map(|m| m.len()),
            RootDisk::Nbd { size, .. } => Some(*size),
        }
    }
}

impl Artifacts {
    pub fn resolve(&self) -> Result<Self> {
        let check = |what: &'static str, p: &Path| -> Result<PathBuf> {
            std::fs::canonicalize(p).map_err(|_| Error::MissingArtifact {
                what,
                path: p.to_path_buf(),
            })
        };
        Ok(Self {
            kernel: check("guest kernel", &self.kernel)?,
            initramfs: check("initramfs", &self.initramfs)?,
            rootfs: match &self.rootfs {
                RootDisk::File(p) => RootDisk::File(check("rootfs image", p)?),
                nbd => nbd.clone(),
            },
        })
    }
}

/// Which QEMU accelerator runs the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    /// KVM only when the CPU has hardware virtualization (vmx/svm in
    /// `/proc/cpuinfo`) and `/dev/kvm` opens; otherwise TCG. `TINE_ACCEL`
    /// (`kvm` or `tcg`) overrides the probe.
    pub fn probe() -> Self {
        match std::env::var("TINE_ACCEL").ok().as_deref() {
            Some("kvm") => return Accel::Kvm,
            Some("tcg") => return Accel::Tcg,
            _ => {}
        }
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let hw = cpuinfo
            .lines()
            .filter(|l| l.starts_with("flags"))
            .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"));
        let kvm_opens = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .is_ok();
        if hw && kvm_opens {
            Accel::Kvm
        } else {
            Accel::Tcg
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// The shape of a VM. Snapshots record it; clones must match it exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Machine {
    pub vcpus: u32,
    pub memory_mib: u32,
    pub accel: Accel,
}

impl Default for Machine {
    fn default() -> Self {
        Self {
            vcpus: 1,
            memory_mib: 512,
            accel: Accel::probe(),
        }
    }
}
