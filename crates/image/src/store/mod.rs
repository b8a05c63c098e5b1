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
//!
//! The parts: the store's layout and lookups here; `pull` (pulls, lazy
//! or converted, and images installed from another host), `convert`
//! (layers to an ext4 disk cut into chunks), `push` (an image's chunks to
//! a registry) and `remove` (`rm` and `prune`).

mod convert;
mod pull;
mod push;
mod remove;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::chunks::Index;
use crate::reference::ImageRef;
use crate::registry::LayerRef;
use crate::{io, ImageError, Result};

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

    /// The chunk index of a chunked image.
    pub fn index(&self, meta: &ImageMeta) -> Result<Index> {
        let path = self.image_dir(&meta.manifest_digest).join("index.json");
        let bytes = std::fs::read(&path).map_err(io(format!("reading {}", path.display())))?;
        Index::from_json(&bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::convert::convert;
    use super::*;
    use crate::{chunks, registry};
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
