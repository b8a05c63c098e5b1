//! The local image store, `$TINE_DATA_DIR/images`:
//!
//! ```text
//! blobs/sha256/<hex>         layers, content-addressed (shared by images)
//! chunks/sha256/<hex>        chunks of converted disks (shared by images)
//! <manifest hex>/meta.json   what the image is: reference, config, layers
//! <manifest hex>/index.json  its root disk as a list of chunks
//! <manifest hex>/auth.json   credentials to fetch its chunks (0600; only
//!                            when a request gave some)
//! refs.json                  reference → manifest digest
//! ```
//!
//! A pull looks for the converted image in the registry first (see
//! [`crate::chunks::remote`]): if it is there, only the index is fetched
//! and the chunks come on first read. Otherwise the layers are fetched,
//! applied and converted here, and the image's chunks are pinned until it
//! is pushed.
//!
//! A converted image appears at once (its directory is renamed into
//! place), so a crash mid-pull leaves only a `.tmp-…-<pid>` directory,
//! removed by the next conversion once that process is gone. Two pulls of
//! one image at once each convert in their own directory; the first to
//! finish is kept.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::chunks::{self, remote, Index};
use crate::layers;
use crate::reference::ImageRef;
use crate::registry::{self, Credentials, LayerRef, Progress, RegistryOptions, Resolved};
use crate::{io, ImageError, Result};

/// The smallest root disk an image gets (sparse: unused space costs
/// nothing); the guest writes into its overlay up to this size.
const MIN_DISK: u64 = 4 << 30;

/// What of the image config a sandbox uses.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageConfig {
    /// `KEY=value` pairs.
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub user: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
}

impl ImageConfig {
    fn from_json(config: &serde_json::Value) -> Self {
        let c = &config["config"];
        let strings = |v: &serde_json::Value| -> Vec<String> {
            v.as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default()
        };
        let text = |v: &serde_json::Value| v.as_str().filter(|s| !s.is_empty()).map(String::from);
        Self {
            env: strings(&c["Env"]),
            working_dir: text(&c["WorkingDir"]),
            user: text(&c["User"]),
            entrypoint: strings(&c["Entrypoint"]),
            cmd: strings(&c["Cmd"]),
        }
    }

    /// `Env` as a map (a later duplicate wins).
    pub fn env_map(&self) -> BTreeMap<String, String> {
        self.env
            .iter()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }
}

/// One image in the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageMeta {
    /// The reference it was first pulled as.
    pub reference: String,
    pub manifest_digest: String,
    pub config: ImageConfig,
    pub layers: Vec<LayerRef>,
    /// The ext4 root disk of an image converted before chunking existed
    /// (still booted from the file when `chunks` is None).
    pub rootfs: PathBuf,
    /// Bytes of the layers (compressed, as in the registry).
    pub size: u64,
    /// The root disk as chunks (`index.json`), served by the image daemon.
    #[serde(default)]
    pub chunks: Option<Chunked>,
}

/// A chunked root disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunked {
    pub disk_size: u64,
    /// Distinct chunks and their compressed bytes.
    pub count: usize,
    pub stored_bytes: u64,
    /// The artifact in a registry its chunks can be fetched from; None:
    /// they exist only here (pinned in the local store).
    pub remote: Option<String>,
}

impl Chunked {
    fn of(index: &Index, remote: Option<String>) -> Self {
        Self {
            disk_size: index.disk_size,
            count: index.unique().len(),
            stored_bytes: index.stored_bytes(),
            remote,
        }
    }
}

pub struct ImageStore {
    dir: PathBuf,
}

fn hex(digest: &str) -> &str {
    digest.strip_prefix("sha256:").unwrap_or(digest)
}

impl ImageStore {
    /// The store under `data_dir`.
    pub fn new(data_dir: &Path) -> Self {
        Self {
            dir: data_dir.join("images"),
        }
    }

    fn blobs(&self) -> PathBuf {
        self.dir.join("blobs")
    }

    fn image_dir(&self, digest: &str) -> PathBuf {
        self.dir.join(hex(digest))
    }

    fn refs_path(&self) -> PathBuf {
        self.dir.join("refs.json")
    }

    fn refs(&self) -> BTreeMap<String, String> {
        std::fs::read(self.refs_path())
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }

    fn save_refs(&self, refs: &BTreeMap<String, String>) -> Result<()> {
        let path = self.refs_path();
        let tmp = path.with_extension("tmp");
        let json = serde_json::to_vec_pretty(refs).unwrap_or_default();
        std::fs::write(&tmp, json).map_err(io(format!("writing {}", tmp.display())))?;
        std::fs::rename(&tmp, &path).map_err(io(format!("writing {}", path.display())))
    }

    fn read_meta(&self, digest: &str) -> Result<ImageMeta> {
        let path = self.image_dir(digest).join("meta.json");
        let bytes = std::fs::read(&path).map_err(io(format!("reading {}", path.display())))?;
        serde_json::from_slice(&bytes).map_err(|e| ImageError::Io {
            context: format!("{} is corrupt", path.display()),
            source: e.into(),
        })
    }

    /// An image by reference (as pulled) or manifest digest.
    pub fn get(&self, reference: &str) -> Result<ImageMeta> {
        let refs = self.refs();
        let key = ImageRef::parse(reference).map(|r| r.canonical()).ok();
        let digest = key
            .and_then(|k| refs.get(&k).cloned())
            .or_else(|| refs.values().find(|d| d.as_str() == reference).cloned())
            .ok_or_else(|| ImageError::NotFound(reference.to_string()))?;
        self.read_meta(&digest)
    }

    /// Every reference with its image.
    pub fn list(&self) -> Vec<(String, ImageMeta)> {
        self.refs()
            .into_iter()
            .filter_map(|(r, d)| Some((r, self.read_meta(&d).ok()?)))
            .collect()
    }

    /// Pull `reference`. An image already here is not fetched again;
    /// with `lazy`, an image whose converted form the registry has is
    /// taken as its index only; otherwise its layers are fetched (those
    /// not stored yet) and converted here.
    pub async fn pull(
        &self,
        reference: &str,
        opts: &RegistryOptions,
        creds: Option<&Credentials>,
        lazy: bool,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<ImageMeta> {
        let r = ImageRef::parse(reference)?;
        let resolved = registry::resolve(&r, opts, creds).await?;
        let digest = resolved.manifest_digest.clone();
        let meta = match self.read_meta(&digest) {
            Ok(meta) => meta,
            Err(_) => {
                let creds = creds.filter(|_| resolved.origin);
                let found = match lazy {
                    true => remote::find(&resolved.at, &digest, opts, creds).await?,
                    false => None,
                };
                match found {
                    Some((artifact, index)) => {
                        progress(Progress::Lazy {
                            chunks: index.unique().len(),
                            bytes: index.stored_bytes(),
                        });
                        self.store_lazy(&r, &resolved, &artifact, &index, creds)?
                    }
                    None => {
                        self.pull_and_convert(&r, &resolved, opts, creds, progress)
                            .await?
                    }
                }
            }
        };
        let mut refs = self.refs();
        refs.insert(r.canonical(), digest);
        self.save_refs(&refs)?;
        Ok(meta)
    }

    fn new_meta(&self, r: &ImageRef, resolved: &Resolved) -> ImageMeta {
        ImageMeta {
            reference: r.canonical(),
            manifest_digest: resolved.manifest_digest.clone(),
            config: ImageConfig::from_json(&resolved.config),
            size: resolved.layers.iter().map(|l| l.size).sum(),
            layers: resolved.layers.clone(),
            rootfs: self
                .image_dir(&resolved.manifest_digest)
                .join("rootfs.ext4"),
            chunks: None,
        }
    }

    async fn pull_and_convert(
        &self,
        r: &ImageRef,
        resolved: &Resolved,
        opts: &RegistryOptions,
        creds: Option<&Credentials>,
        progress: &mut (dyn FnMut(Progress) + Send),
    ) -> Result<ImageMeta> {
        registry::fetch_layers(resolved, opts, creds, &self.blobs(), progress).await?;
        progress(Progress::Converting);
        let (store, m) = (self.dir.clone(), self.new_meta(r, resolved));
        tokio::task::spawn_blocking(move || convert(&store, m))
            .await
            .map_err(|e| ImageError::Io {
                context: "converting an image".into(),
                source: std::io::Error::other(e),
            })?
    }

    /// Record an image whose chunks are in `artifact`: its index (and the
    /// request's credentials, private to root) and nothing else.
    fn store_lazy(
        &self,
        r: &ImageRef,
        resolved: &Resolved,
        artifact: &ImageRef,
        index: &Index,
        creds: Option<&Credentials>,
    ) -> Result<ImageMeta> {
        let mut meta = self.new_meta(r, resolved);
        meta.chunks = Some(Chunked::of(index, Some(artifact.to_string())));
        self.record_lazy(&meta, index, creds)?;
        Ok(meta)
    }

    /// Write `meta` (whose chunks are remote) and `index` into the store.
    fn record_lazy(
        &self,
        meta: &ImageMeta,
        index: &Index,
        creds: Option<&Credentials>,
    ) -> Result<()> {
        let work = work_dir(&self.dir, &meta.manifest_digest);
        std::fs::create_dir_all(&work).map_err(io(format!("creating {}", work.display())))?;
        let result = (|| {
            std::fs::write(work.join("index.json"), index.to_json())
                .map_err(io("writing index.json"))?;
            if let Some(c) = creds {
                let json = serde_json::to_vec(c).unwrap_or_default();
                crate::nbd::daemon::write_private(&work.join("auth.json"), &json)?;
            }
            finish(&self.dir, &work, meta)
        })();
        if result.is_err() {
            let _ = std::fs::remove_dir_all(&work);
        }
        result
    }

    /// The image whose manifest digest is `digest` (`sha256:` optional).
    pub fn by_digest(&self, digest: &str) -> Option<ImageMeta> {
        self.read_meta(digest).ok()
    }

    /// Whether the store has the image whose manifest digest is `digest`.
    pub fn has(&self, digest: &str) -> bool {
        self.by_digest(digest).is_some()
    }

    /// Whether the chunks of `meta` are fetched with credentials this
    /// store keeps for it (another host would lack them).
    pub fn needs_credentials(&self, meta: &ImageMeta) -> bool {
        self.image_dir(&meta.manifest_digest)
            .join("auth.json")
            .exists()
    }

    /// Record image `meta`, converted on another host, whose chunks are in
    /// the registry artifact `meta.chunks.remote` and listed by `index`:
    /// they are fetched on first read, as for a lazy pull. An image the
    /// store has already is kept as it is.
    pub fn install(&self, meta: &ImageMeta, index: &Index) -> Result<()> {
        if self.has(&meta.manifest_digest) {
            return Ok(());
        }
        if meta
            .chunks
            .as_ref()
            .and_then(|c| c.remote.as_ref())
            .is_none()
        {
            return Err(ImageError::Registry {
                reference: meta.reference.clone(),
                detail: "its chunks are in no registry".into(),
            });
        }
        self.record_lazy(meta, index, None)?;
        let mut refs = self.refs();
        if let Ok(r) = ImageRef::parse(&meta.reference) {
            refs.entry(r.canonical())
                .or_insert_with(|| meta.manifest_digest.clone());
            self.save_refs(&refs)?;
        }
        Ok(())
    }

    /// The chunk index of a chunked image.
    pub fn index(&self, meta: &ImageMeta) -> Result<Index> {
        let path = self.image_dir(&meta.manifest_digest).join("index.json");
        let bytes = std::fs::read(&path).map_err(io(format!("reading {}", path.display())))?;
        Index::from_json(&bytes)
    }

    /// Push the converted image `reference` to its registry, next to the
    /// image, so that other hosts start it lazily; its chunks then count
    /// as cache here. Returns the artifact's reference.
    pub async fn push(
        &self,
        reference: &str,
        opts: &RegistryOptions,
        creds: Option<&Credentials>,
        progress: &mut (dyn FnMut(remote::PushProgress) + Send),
    ) -> Result<String> {
        let meta = self.get(reference)?;
        let source = ImageRef::parse(&meta.reference)?;
        let target = remote::artifact_ref(&source, &meta.manifest_digest)?;
        self.push_to(&meta, &target, opts, creds, progress).await?;
        Ok(target.to_string())
    }

    /// Push the chunks of image `meta` as the artifact `target`; an image
    /// whose chunks were only here fetches them from `target` from now on
    /// (they count as cache). Returns the image as the store now has it.
    pub async fn push_to(
        &self,
        meta: &ImageMeta,
        target: &ImageRef,
        opts: &RegistryOptions,
        creds: Option<&Credentials>,
        progress: &mut (dyn FnMut(remote::PushProgress) + Send),
    ) -> Result<ImageMeta> {
        let mut meta = meta.clone();
        let Some(chunked) = meta.chunks.clone() else {
            return Err(ImageError::Registry {
                reference: meta.reference.clone(),
                detail: "converted before chunked images existed: tine image rm and pull it again"
                    .into(),
            });
        };
        let index = self.index(&meta)?;
        remote::push(
            target,
            &index,
            &chunks::chunk_dir(&self.dir),
            opts,
            creds,
            progress,
        )
        .await?;
        if chunked.remote.is_none() {
            meta.chunks = Some(Chunked {
                remote: Some(target.to_string()),
                ..chunked
            });
            let path = self.image_dir(&meta.manifest_digest).join("meta.json");
            chunks::write_atomic(&path, &serde_json::to_vec_pretty(&meta).unwrap_or_default())?;
        }
        Ok(meta)
    }

    /// Forget `reference`; the image's files go when no other reference
    /// names it, unless a snapshot in `snapshots_dir` (a `meta.json` that
    /// name its root disk) still runs on it.
    pub fn remove(&self, reference: &str, snapshots_dir: &Path) -> Result<()> {
        let meta = self.get(reference)?;
        let mut refs = self.refs();
        let digest = meta.manifest_digest.clone();
        let named: Vec<String> = refs
            .iter()
            .filter(|(_, d)| **d == digest)
            .map(|(r, _)| r.clone())
            .collect();
        let key = ImageRef::parse(reference)
            .map(|r| r.canonical())
            .ok()
            .filter(|k| refs.contains_key(k));
        let last = named.len() <= 1 || key.is_none();
        if last {
            let users = snapshots_using(snapshots_dir, hex(&digest));
            if !users.is_empty() {
                return Err(ImageError::InUse {
                    reference: reference.to_string(),
                    users: format!("snapshots {}", users.join(", ")),
                });
            }
        }
        match key {
            Some(k) => {
                refs.remove(&k);
            }
            None => refs.retain(|_, d| *d != digest),
        }
        self.save_refs(&refs)?;
        if !refs.values().any(|d| *d == digest) {
            let dir = self.image_dir(&digest);
            std::fs::remove_dir_all(&dir).map_err(io(format!("removing {}", dir.display())))?;
            self.remove_unused_blobs(&refs)?;
        }
        Ok(())
    }

    /// Delete layer blobs and chunks no remaining image lists.
    fn remove_unused_blobs(&self, refs: &BTreeMap<String, String>) -> Result<()> {
        let mut used = std::collections::HashSet::new();
        for digest in refs.values() {
            if let Ok(m) = self.read_meta(digest) {
                if m.chunks.is_some() {
                    let index = self.index(&m)?;
                    used.extend(
                        index
                            .unique()
                            .into_iter()
                            .map(|c| hex(&c.digest).to_string()),
                    );
                }
                used.extend(m.layers.into_iter().map(|l| hex(&l.digest).to_string()));
            }
        }
        for dir in [self.blobs().join("sha256"), chunks::chunk_dir(&self.dir)] {
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if !used.contains(&name) {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
        Ok(())
    }

    /// Images no snapshot in `snapshots_dir` runs on, removed with every
    /// reference to them; returns the references removed.
    pub fn prune(&self, snapshots_dir: &Path) -> Result<Vec<String>> {
        let mut removed = Vec::new();
        for (reference, meta) in self.list() {
            if snapshots_using(snapshots_dir, hex(&meta.manifest_digest)).is_empty()
                && self.remove(&reference, snapshots_dir).is_ok()
            {
                removed.push(reference);
            }
        }
        Ok(removed)
    }
}

/// Snapshot ids under `snapshots_dir` whose `meta.json` names the image
/// with manifest hex `needle` (its rootfs path or its NBD export).
fn snapshots_using(snapshots_dir: &Path, needle: &str) -> Vec<String> {
    std::fs::read_dir(snapshots_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("meta.json")).is_ok_and(|m| m.contains(needle))
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// A fresh work directory for an image (`.tmp-<digest>-<n>-<pid>`).
fn work_dir(store: &Path, digest: &str) -> PathBuf {
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
fn finish(store: &Path, work: &Path, meta: &ImageMeta) -> Result<()> {
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
fn convert(store: &Path, mut meta: ImageMeta) -> Result<ImageMeta> {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A gzip layer with `files`, stored as a blob; its [`LayerRef`].
    fn blob(store: &Path, files: &[(&str, &[u8])]) -> LayerRef {
        let mut tar = tar::Builder::new(Vec::new());
        for (name, data) in files {
            let mut h = tar::Header::new_gnu();
            h.set_path(name).unwrap();
            h.set_mode(0o644);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(0);
            h.set_size(data.len() as u64);
            h.set_cksum();
            tar.append(&h, *data).unwrap();
        }
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &tar.into_inner().unwrap()).unwrap();
        let data = gz.finish().unwrap();
        let digest = format!("sha256:{:x}", sha2::Sha256::digest(&data));
        let path = registry::blob_path(&store.join("blobs"), &digest).unwrap();
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &data).unwrap();
        LayerRef {
            digest,
            media_type: "application/vnd.oci.image.layer.v1.tar+gzip".into(),
            size: data.len() as u64,
        }
    }

    fn debugfs_cat(image: &Path, path: &str) -> String {
        let out = std::process::Command::new("debugfs")
            .args(["-R", &format!("cat {path}")])
            .arg(image)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    use sha2::Digest as _;

    #[test]
    fn convert_makes_an_ext4_disk_and_rm_frees_unused_layers() {
        let data = tempfile::tempdir().unwrap();
        let store = ImageStore::new(data.path());
        let dir = data.path().join("images");
        let layers = vec![
            blob(&dir, &[("etc/os", b"lower"), ("opt/a", b"a")]),
            blob(&dir, &[("etc/os", b"upper")]),
        ];
        let digest = format!("sha256:{}", "ab".repeat(32));
        let meta = ImageMeta {
            reference: "127.0.0.1:5000/t:v1".into(),
            manifest_digest: digest.clone(),
            config: ImageConfig::from_json(&serde_json::json!({
                "config": { "Env": ["A=1", "B=x=y"], "WorkingDir": "/opt" }
            })),
            size: 0,
            rootfs: store.image_dir(&digest).join("rootfs.ext4"),
            layers,
            chunks: None,
        };
        let meta = convert(&dir, meta).unwrap();
        assert!(!meta.rootfs.exists(), "only chunks are kept");
        let index = store.index(&meta).unwrap();
        assert_eq!(meta.chunks.as_ref().unwrap().remote, None);
        let disk = data.path().join("disk");
        chunks::assemble(&index, &chunks::chunk_dir(&dir), &disk).unwrap();
        assert_eq!(debugfs_cat(&disk, "/etc/os"), "upper");
        assert_eq!(debugfs_cat(&disk, "/opt/a"), "a");
        assert_eq!(meta.config.env_map()["B"], "x=y");
        assert_eq!(meta.config.working_dir.as_deref(), Some("/opt"));
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
            .collect();
        assert!(leftovers.is_empty(), "the work directory is gone");

        let refs = BTreeMap::from([(meta.reference.clone(), digest.clone())]);
        store.save_refs(&refs).unwrap();
        assert_eq!(store.get("127.0.0.1:5000/t:v1").unwrap(), meta);
        assert_eq!(store.get(&digest).unwrap(), meta);
        // A snapshot that runs on it keeps it.
        let snaps = data.path().join("snapshots");
        std::fs::create_dir_all(snaps.join("s1")).unwrap();
        let uses = format!("{{\"export\": \"{}\"}}", hex(&digest));
        std::fs::write(snaps.join("s1/meta.json"), uses).unwrap();
        let err = store.remove("127.0.0.1:5000/t:v1", &snaps).unwrap_err();
        assert!(err.to_string().contains("s1"), "{err}");
        std::fs::remove_dir_all(snaps.join("s1")).unwrap();
        store.remove("127.0.0.1:5000/t:v1", &snaps).unwrap();
        assert!(!store.image_dir(&digest).exists());
        for d in ["blobs/sha256", "chunks/sha256"] {
            assert_eq!(std::fs::read_dir(dir.join(d)).unwrap().count(), 0, "{d}");
        }
        assert!(matches!(
            store.get("127.0.0.1:5000/t:v1"),
            Err(ImageError::NotFound(_))
        ));
    }
}
