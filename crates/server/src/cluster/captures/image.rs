//! The OCI image a capture's disk is over: pushed with the capture when
//! other nodes could not fetch its chunks, installed on the pulling node.

use tine_image::chunks::remote;
use tine_image::ImageRef;

use super::{failed, CaptureError, Captures};

impl Captures {
    /// Image `export` (a manifest digest's hex), which capture `id`'s disk
    /// is over, as other nodes install it: with its chunks in a registry
    /// they read. An image whose chunks are only here (converted here) or
    /// are fetched with credentials only this node holds is pushed to the
    /// cluster's repository as `image-<digest>` first; that tag is shared
    /// by every capture on the image and stays when they are deleted.
    /// Also returns the bytes of chunks that push sent.
    pub(super) async fn travelling_image(
        &self,
        id: &str,
        export: &str,
    ) -> Result<(tine_image::ImageMeta, u64), CaptureError> {
        let err = failed(id);
        let store = tine_image::ImageStore::new(&self.paths.data_dir);
        let meta = store.by_digest(export).ok_or_else(|| {
            err(format!(
                "its image sha256:{export} is not in this node's store"
            ))
        })?;
        let remote = meta.chunks.as_ref().and_then(|c| c.remote.clone());
        if let Some(r) = remote.filter(|_| !store.needs_credentials(&meta)) {
            // Still there (a registry emptied since would leave it naming
            // nothing: then its chunks are pushed again, if all are here).
            let r = ImageRef::parse(&r).map_err(|e| err(e.to_string()))?;
            if remote::find_at(&r, &self.opts, None)
                .await
                .map_err(|e| err(format!("image {}: {e}", meta.reference)))?
                .is_some()
            {
                return Ok((meta, 0));
            }
        }
        let target = ImageRef::parse(&format!("{}:image-{export}", self.repo))
            .map_err(|e| err(e.to_string()))?;
        let mut sent = 0;
        let mut pushed = store
            .push_to(&meta, &target, &self.opts, None, &mut |p| {
                if !p.skipped {
                    sent += p.bytes
                }
            })
            .await
            .map_err(|e| {
                err(format!(
                    "pushing the chunks of image {}: {e}",
                    meta.reference
                ))
            })?;
        if let Some(c) = pushed.chunks.as_mut() {
            c.remote = Some(target.to_string());
        }
        tracing::info!(
            capture = id,
            image = %meta.reference,
            artifact = %target,
            mib = sent >> 20,
            "image chunks pushed to the registry with the capture"
        );
        Ok((pushed, sent))
    }

    /// Put `image`, which capture `id`'s disk is over, into this node's
    /// image store if it lacks it: its index only, its chunks come from
    /// the registry on first read, as for a lazy pull.
    pub(super) async fn install_image(
        &self,
        id: &str,
        image: &tine_image::ImageMeta,
    ) -> Result<(), CaptureError> {
        let err = failed(id);
        let store = tine_image::ImageStore::new(&self.paths.data_dir);
        if store.has(&image.manifest_digest) {
            return Ok(());
        }
        let artifact = image
            .chunks
            .as_ref()
            .and_then(|c| c.remote.clone())
            .ok_or_else(|| {
                err(format!(
                    "image {}: its chunks are in no registry",
                    image.reference
                ))
            })?;
        let r = ImageRef::parse(&artifact).map_err(|e| err(e.to_string()))?;
        let index = remote::find_at(&r, &self.opts, None)
            .await
            .map_err(|e| err(format!("image {}: {e}", image.reference)))?
            .ok_or_else(|| {
                err(format!(
                    "image {}: {artifact} is not in the registry",
                    image.reference
                ))
            })?;
        let image = image.clone();
        tokio::task::spawn_blocking(move || store.install(&image, &index))
            .await
            .map_err(|e| err(e.to_string()))?
            .map_err(|e| err(e.to_string()))
    }
}
