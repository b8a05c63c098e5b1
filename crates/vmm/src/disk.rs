//! qcow2 overlays: every VM writes into its own overlay over a read-only
//! backing image (the template's rootfs, or a snapshot's frozen overlay).

use std::ffi::OsStr;
use std::path::Path;
use std::process::Stdio;

use crate::error::{Error, IoContext, Result};

/// Format of a backing file, as `qemu-img -F` wants it.
#[derive(Debug, Clone, Copy)]
pub enum BackingFormat {
    Raw,
    Qcow2,
}

impl BackingFormat {
    fn as_str(self) -> &'static str {
        match self {
            BackingFormat::Raw => "raw",
            BackingFormat::Qcow2 => "qcow2",
        }
    }
}

/// Create `path` as a qcow2 overlay over `backing` (absolute path kept in
/// the header), with the backing file's virtual size.
pub async fn create_overlay(
    backing: impl AsRef<OsStr>,
    format: BackingFormat,
    path: &Path,
) -> Result<()> {
    qemu_img_create(backing.as_ref(), format, path, None).await
}

/// Create `path` as a qcow2 overlay of `size` bytes over `backing` without
/// opening `backing` (`-u`): it may be an image a running QEMU holds.
pub async fn create_overlay_unchecked(
    backing: impl AsRef<OsStr>,
    format: BackingFormat,
    path: &Path,
    size: u64,
) -> Result<()> {
    qemu_img_create(backing.as_ref(), format, path, Some(size)).await
}

async fn qemu_img_create(
    backing: &OsStr,
    format: BackingFormat,
    path: &Path,
    size: Option<u64>,
) -> Result<()> {
    let mut cmd = tokio::process::Command::new("qemu-img");
    cmd.args(["create", "-q", "-f", "qcow2", "-F", format.as_str(), "-b"])
        .arg(backing);
    if size.is_some() {
        cmd.arg("-u");
    }
    cmd.arg(path);
    if let Some(size) = size {
        cmd.arg(size.to_string());
    }
    run(cmd, || {
        format!(
            "qemu-img create {} over {}",
            path.display(),
            backing.to_string_lossy()
        )
    })
    .await
}

/// Rebase `path` onto `backing`, copying into it every cluster in which its
/// old backing chain differs from the new backing (qemu-img's safe mode).
pub async fn rebase(path: &Path, backing: impl AsRef<OsStr>, format: BackingFormat) -> Result<()> {
    let backing = backing.as_ref();
    let mut cmd = tokio::process::Command::new("qemu-img");
    cmd.args(["rebase", "-q", "-f", "qcow2", "-F", format.as_str(), "-b"])
        .arg(backing)
        .arg(path);
    run(cmd, || {
        format!(
            "qemu-img rebase {} onto {}",
            path.display(),
            Path::new(backing).display()
        )
    })
    .await
}

/// Point `path`'s header at `backing` without reading either (`-u`): only
/// the name of the disk below changes, its contents must be the same.
pub async fn rebase_unchecked(
    path: &Path,
    backing: impl AsRef<OsStr>,
    format: BackingFormat,
) -> Result<()> {
    let backing = backing.as_ref();
    let mut cmd = tokio::process::Command::new("qemu-img");
    cmd.args([
        "rebase",
        "-q",
        "-u",
        "-f",
        "qcow2",
        "-F",
        format.as_str(),
        "-b",
    ])
    .arg(backing)
    .arg(path);
    run(cmd, || {
        format!(
            "qemu-img rebase -u {} onto {}",
            path.display(),
            Path::new(backing).display()
        )
    })
    .await
}

async fn run(mut cmd: tokio::process::Command, what: impl FnOnce() -> String) -> Result<()> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .await
        .ctx(|| "running qemu-img (is qemu-utils installed?)".into())?;
    if !out.status.success() {
        return Err(Error::Io {
            context: what(),
            source: std::io::Error::other(String::from_utf8_lossy(&out.stderr).trim().to_string()),
        });
    }
    Ok(())
}

/// Blank overlays kept for the disks VMs are restored over, so that a
/// restore copies one (≈ 200 KiB, a fraction of a millisecond) instead of
/// running `qemu-img create` (≈ 10 ms of a process start on every create,
/// resume and fork child). A blank overlay holds only a header, the
/// backing file's name and size, and empty tables: every overlay over the
/// same backing file starts as the same bytes.
///
/// An entry is used only when its header names the backing file asked for
/// (a hash collision or a damaged entry is a miss, never a wrong disk);
/// entries are written through a temp name and renamed, so none is read
/// half written. [`OverlayCache::prune`] removes entries whose backing
/// file is gone.
pub struct OverlayCache {
    dir: std::path::PathBuf,
}

impl OverlayCache {
    pub fn new(dir: std::path::PathBuf) -> Self {
        Self { dir }
    }

    fn entry(&self, backing: &Path) -> std::path::PathBuf {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        backing.hash(&mut h);
        self.dir.join(format!("{:016x}.qcow2", h.finish()))
    }

    /// Create `path` as a qcow2 overlay over the qcow2 image `backing`,
    /// from the cache (filled first when it has no entry for `backing`).
    pub async fn create_overlay(&self, backing: &Path, path: &Path) -> Result<()> {
        match self.warm(backing).await {
            Ok(entry) => match std::fs::copy(&entry, path) {
                Ok(_) => return Ok(()),
                Err(e) => tracing::warn!(entry = %entry.display(), %e, "copying a cached overlay"),
            },
            Err(e) => tracing::warn!(backing = %backing.display(), %e, "caching a blank overlay"),
        }
        create_overlay(backing, BackingFormat::Qcow2, path).await
    }

    /// Make sure the cache holds a blank overlay over `backing` (a capture
    /// calls this so that its restore finds one); returns the entry.
    pub async fn warm(&self, backing: &Path) -> Result<std::path::PathBuf> {
        static TEMP: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let entry = self.entry(backing);
        if qcow2_backing_file(&entry).ok().flatten().as_deref() == Some(backing) {
            return Ok(entry);
        }
        std::fs::create_dir_all(&self.dir).ctx(|| format!("creating {}", self.dir.display()))?;
        let n = TEMP.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = entry.with_extension(format!("tmp{}-{n}", std::process::id()));
        let made = async {
            create_overlay(backing, BackingFormat::Qcow2, &tmp).await?;
            std::fs::rename(&tmp, &entry).ctx(|| format!("renaming {}", tmp.display()))
        }
        .await;
        if made.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        made.map(|()| entry)
    }

    /// Remove entries whose backing file is gone and temp files older than
    /// `grace`; returns how many were removed.
    pub fn prune(&self, grace: std::time::Duration) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        let mut removed = 0;
        for path in entries.flatten().map(|e| e.path()) {
            let stale = if path.extension().is_some_and(|e| e == "qcow2") {
                !matches!(qcow2_backing_file(&path), Ok(Some(b)) if b.exists())
            } else {
                std::fs::symlink_metadata(&path)
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age >= grace)
            };
            if stale && std::fs::remove_file(&path).is_ok() {
                removed += 1;
            }
        }
        removed
    }
}

/// A qcow2 header ([`crate::qcow2`]), its errors as the driver's.
fn qcow2_header(path: &Path) -> Result<crate::qcow2::Header> {
    crate::qcow2::read(path).map_err(|e| Error::Io {
        context: e.to_string(),
        source: match e {
            crate::qcow2::HeaderError::Io { source, .. } => source,
            _ => std::io::ErrorKind::InvalidData.into(),
        },
    })
}

/// The backing file a qcow2 image's header names (`None`: it has none).
pub fn qcow2_backing_file(path: &Path) -> Result<Option<std::path::PathBuf>> {
    use std::os::unix::ffi::OsStrExt;
    Ok(qcow2_header(path)?
        .backing
        .map(|name| std::path::PathBuf::from(OsStr::from_bytes(&name))))
}

/// The virtual size recorded in a qcow2 image's header.
pub fn qcow2_virtual_size(path: &Path) -> Result<u64> {
    Ok(qcow2_header(path)?.virtual_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qemu_img_info(path: &Path) -> serde_json::Value {
        let out = std::process::Command::new("qemu-img")
            .args(["info", "--output=json", "-U"])
            .arg(path)
            .output()
            .expect("qemu-img");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    #[tokio::test]
    async fn cached_overlays_name_their_own_backing_file() {
        let dir = tempfile::tempdir().unwrap();
        let cache = OverlayCache::new(dir.path().join("cache"));
        let mut bases = Vec::new();
        for (name, size) in [("a.qcow2", "64M"), ("b.qcow2", "32M")] {
            let base = dir.path().join(name);
            let ok = std::process::Command::new("qemu-img")
                .args(["create", "-q", "-f", "qcow2"])
                .arg(&base)
                .arg(size)
                .status()
                .unwrap();
            assert!(ok.success());
            bases.push(base);
        }
        // The first overlay over each base is made by qemu-img, the rest
        // are copies; every one names its own base and has its size.
        for round in 0..3 {
            for (i, base) in bases.iter().enumerate() {
                let over = dir.path().join(format!("over-{round}-{i}.qcow2"));
                cache.create_overlay(base, &over).await.unwrap();
                let info = qemu_img_info(&over);
                assert_eq!(info["backing-filename"], base.display().to_string());
                assert_eq!(info["virtual-size"], [64u64 << 20, 32 << 20][i]);
                assert_eq!(
                    qcow2_backing_file(&over).unwrap().as_deref(),
                    Some(base.as_path())
                );
            }
        }
        // An entry that names another backing file is a miss, not used.
        let entry = cache.entry(&bases[0]);
        std::fs::copy(cache.entry(&bases[1]), &entry).unwrap();
        let over = dir.path().join("after-damage.qcow2");
        cache.create_overlay(&bases[0], &over).await.unwrap();
        assert_eq!(
            qemu_img_info(&over)["backing-filename"],
            bases[0].display().to_string()
        );
        // Entries whose backing file is gone are pruned.
        std::fs::remove_file(&bases[1]).unwrap();
        assert_eq!(cache.prune(std::time::Duration::from_secs(60)), 1);
        assert!(cache.entry(&bases[0]).exists());
        assert!(!cache.entry(&bases[1]).exists());
    }
}
