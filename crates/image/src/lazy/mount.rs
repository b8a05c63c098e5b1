//! Mounting the lazy captures of a data directory, and forgetting the
//! captures nothing reads any more.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use super::fs::{Inodes, LazyFs};
use super::{descriptors_dir, lock, mount_dir, Descriptor};
use crate::chunks::cache::ChunkCache;
use crate::{io, Result};

/// The mounted filesystem; dropping it unmounts.
pub struct Mounted {
    _session: fuser::BackgroundSession,
    open: Arc<Mutex<HashMap<String, usize>>>,
    descriptors: PathBuf,
}

impl Mounted {
    /// Files some process (a QEMU) has open or mapped.
    pub fn open_files(&self) -> usize {
        lock(&self.open).values().sum()
    }

    /// Forget captures whose snapshot is gone, when nothing reads them
    /// (a minute after registration at the earliest: a restore in flight
    /// registers before its snapshot exists). Until then the cluster
    /// keeps their chunks in the registry.
    pub fn forget_unused(&self) {
        let old = SystemTime::now() - Duration::from_secs(60);
        for e in std::fs::read_dir(&self.descriptors)
            .into_iter()
            .flatten()
            .flatten()
        {
            let path = e.path();
            if path.extension() != Some(OsStr::new("json")) {
                continue;
            }
            let young = e
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t > old);
            let d: Option<Descriptor> = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            let gone = d.is_none_or(|d| {
                !d.snapshot_dir.join("meta.json").exists()
                    && !lock(&self.open).contains_key(&d.capture)
            });
            if gone && !young {
                let _ = std::fs::remove_file(&path);
                let _ = std::fs::remove_file(path.with_extension("error"));
            }
        }
    }
}

/// Mount the lazy files of `data_dir` (a stale mount of a daemon that died
/// is detached first). Reads run on `rt`.
pub fn mount(
    data_dir: &Path,
    cache: Arc<ChunkCache>,
    rt: tokio::runtime::Handle,
) -> Result<Mounted> {
    let at = mount_dir(data_dir);
    let _ = nix::mount::umount2(&at, nix::mount::MntFlags::MNT_DETACH);
    std::fs::create_dir_all(&at).map_err(io(format!("creating {}", at.display())))?;
    let descriptors = descriptors_dir(data_dir);
    std::fs::create_dir_all(&descriptors)
        .map_err(io(format!("creating {}", descriptors.display())))?;
    let open = Arc::new(Mutex::new(HashMap::new()));
    let fs = LazyFs {
        descriptors: descriptors.clone(),
        cache,
        rt,
        inodes: Mutex::new(Inodes::default()),
        open: open.clone(),
    };
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::FSName("tine-lazy".into()),
        fuser::MountOption::RO,
        fuser::MountOption::NoDev,
        fuser::MountOption::NoSuid,
        fuser::MountOption::NoExec,
        fuser::MountOption::DefaultPermissions,
    ];
    // The jailed QEMUs run as their own uids.
    config.acl = fuser::SessionACL::All;
    let session = fuser::spawn_mount(fs, &at, &config).map_err(io(format!(
        "mounting the lazy captures on {}",
        at.display()
    )))?;
    Ok(Mounted {
        _session: session,
        open,
        descriptors,
    })
}
