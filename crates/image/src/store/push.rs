//! Pushing a converted image's chunks to a registry, so that other hosts
//! start it lazily.

use super::{Chunked, ImageMeta, ImageStore};
use crate::chunks::{self, remote};
use crate::reference::ImageRef;
use crate::registry::{Credentials, RegistryOptions};
use crate::{ImageError, Result};

impl ImageStore {
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
}
