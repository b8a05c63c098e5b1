//! Pulling an image: taken as its index when the registry has it
//! converted, else fetched and converted here; and an image converted on
//! another host installed as its index.

use super::convert::{convert, finish, work_dir};
use super::{Chunked, ImageConfig, ImageMeta, ImageStore};
use crate::chunks::{remote, Index};
use crate::reference::ImageRef;
use crate::registry::{self, Credentials, Progress, RegistryOptions, Resolved};
use crate::{io, ImageError, Result};

impl ImageStore {
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
}
