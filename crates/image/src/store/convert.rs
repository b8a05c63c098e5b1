//! Converting an image here: its layers applied into a tree, made an ext4
//! root disk and cut into chunks, in a work directory moved into place
//! whole.

use std::path::{Path, PathBuf};

use super::{hex, Chunked, ImageMeta};
use crate::chunks;
use crate::layers;
use crate::registry;
use crate::{io, ImageError, Result};

/// The smallest root disk an image gets (sparse: unused space costs
/// nothing); the guest writes into its overlay up to this size.
const MIN_DISK: u64 = 4 << 30;

/// A fresh work directory for an image (`.tmp-<digest>-<n>-<pid>`).
pub(super) fn work_dir(store: &Path, digest: &str) -> PathBuf {
    remove_abandoned(store);
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let work = store.join(format!(
        ".tmp-{}-{n}-{}",
        &hex(digest)[..16],
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&work);
    work
}

/// Write `meta` into `work` and move it into place as the image's
/// directory, unless another pull of the same image finished first.
pub(super) fn finish(store: &Path, work: &Path, meta: &ImageMeta) -> Result<()> {
    let json = serde_json::to_vec_pretty(meta).unwrap_or_default();
    std::fs::write(work.join("meta.json"), json).map_err(io("writing meta.json"))?;
    let final_dir = store.join(hex(&meta.manifest_digest));
    if final_dir.exists() {
        return std::fs::remove_dir_all(work).map_err(io("removing a duplicate conversion"));
    }
    std::fs::rename(work, &final_dir).map_err(io(format!("storing {}", final_dir.display())))
}

/// Apply the layers of `meta` into a tree, make its ext4 root disk and cut
/// that into chunks; the image directory appears whole or not at all.
pub(super) fn convert(store: &Path, mut meta: ImageMeta) -> Result<ImageMeta> {
    let work = work_dir(store, &meta.manifest_digest);
    let tree = work.join("tree");
    std::fs::create_dir_all(&tree).map_err(io(format!("creating {}", tree.display())))?;
    let result = (|| {
        for layer in &meta.layers {
            let blob = registry::blob_path(&store.join("blobs"), &layer.digest)?;
            layers::apply(&blob, &tree).map_err(|e| ImageError::Layer {
                reference: meta.reference.clone(),
                digest: layer.digest.clone(),
                detail: error_chain(&e),
            })?;
        }
        // Where the guest's init mounts its filesystems.
        for d in ["proc", "sys", "dev", "run", "tmp", "etc"] {
            let p = tree.join(d);
            if std::fs::symlink_metadata(&p).is_err() {
                std::fs::create_dir_all(&p).map_err(io(format!("creating {}", p.display())))?;
            }
        }
        let image = work.join("rootfs.ext4");
        mkfs(&tree, &image)?;
        std::fs::remove_dir_all(&tree).map_err(io(format!("removing {}", tree.display())))?;
        let dir = chunks::chunk_dir(store);
        let index = chunks::build(&image, &dir)?;
        std::fs::write(work.join("index.json"), index.to_json())
            .map_err(io("writing index.json"))?;
        meta.chunks = Some(Chunked::of(&index, None));
        finish(store, &work, &meta)?;
        // A chunk this image shares with a cached one may have been
        // evicted before its pin was written: now pinned, write it again.
        let image = store.join(hex(&meta.manifest_digest)).join("rootfs.ext4");
        if image.exists() {
            let missing = index
                .unique()
                .iter()
                .any(|c| chunks::chunk_hex(&c.digest).is_ok_and(|h| !dir.join(h).exists()));
            if missing {
                chunks::build(&image, &dir)?;
            }
            std::fs::remove_file(&image).map_err(io("removing the converted ext4"))?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&work);
    }
    result.map(|()| meta)
}

/// An error with its causes (the `tar` crate wraps the cause it names).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(&format!(": {s}"));
        source = s.source();
    }
    out
}

/// Remove conversion directories (`.tmp-<digest>-<n>-<pid>`) of processes that
/// are gone (a pull that crashed).
fn remove_abandoned(store: &Path) {
    for e in std::fs::read_dir(store).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(".tmp-")
            .and_then(|r| r.rsplit_once('-'))
            .map(|(_, pid)| pid.to_string())
        else {
            continue;
        };
        if !Path::new("/proc").join(&pid).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Bytes the files under `dir` take (apparent sizes).
fn tree_size(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}

/// `mkfs.ext4 -d tree` into a sparse image at least [`MIN_DISK`] large.
fn mkfs(tree: &Path, image: &Path) -> Result<()> {
    let size = (tree_size(tree) * 2).max(MIN_DISK);
    let out = std::process::Command::new("mkfs.ext4")
        .args([
            "-q",
            "-F",
            "-t",
            "ext4",
            "-L",
            "tine-root",
            "-m",
            "0",
            "-E",
            "root_owner=0:0",
            "-d",
        ])
        .arg(tree)
        .arg(image)
        .arg(format!("{}k", size >> 10))
        .output()
        .map_err(io("running mkfs.ext4"))?;
    if !out.status.success() {
        return Err(ImageError::Io {
            context: "mkfs.ext4".into(),
            source: std::io::Error::other(String::from_utf8_lossy(&out.stderr).into_owned()),
        });
    }
    Ok(())
}
