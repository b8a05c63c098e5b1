//! Chunked images in a registry: pushed as an OCI artifact next to their
//! source image, found by tag, fetched one chunk blob at a time.
//!
//! The artifact of the image whose manifest digest is `sha256:H` is the
//! tag `sha256-H.tine` in the same repository (the naming cosign uses for
//! signatures, so registries without the referrers API hold it too). Its
//! config is the [`Index`]; its layers are the distinct chunks, so the
//! registry keeps them as long as the artifact.

use std::sync::Arc;

use futures::StreamExt;
use oci_client::secrets::RegistryAuth;
use oci_client::Client;

use super::{
    chunk_hex, sha256, ChunkRef, Index, ARTIFACT_TYPE, CHUNK_MEDIA_TYPE, INDEX_MEDIA_TYPE,
};
use crate::reference::ImageRef;
use crate::registry::{auth, client, Credentials, RegistryOptions};
use crate::{ImageError, Result};

/// Largest index accepted from a registry (a 1 TiB disk's is ~100 MB).
const MAX_INDEX_BYTES: u64 = 256 << 20;

/// The tag of the artifact of the image with `manifest_digest`.
pub fn artifact_tag(manifest_digest: &str) -> String {
    format!(
        "{}.tine",
        manifest_digest.replacen(':', "-", 1).to_ascii_lowercase()
    )
}

/// Where an image's artifact is: `source` with its tag replaced.
pub fn artifact_ref(source: &ImageRef, manifest_digest: &str) -> Result<ImageRef> {
    let o = source.oci();
    ImageRef::parse(&format!(
        "{}/{}:{}",
        o.registry(),
        o.repository(),
        artifact_tag(manifest_digest)
    ))
}

fn registry_err(
    reference: &ImageRef,
    what: &str,
) -> impl Fn(oci_client::errors::OciDistributionError) -> ImageError {
    let reference = reference.to_string();
    let what = what.to_string();
    move |e| ImageError::Registry {
        reference: reference.clone(),
        detail: format!("{what}: {e}"),
    }
}

/// Fetch blob `digest` of `reference`, at most `max` bytes.
async fn fetch_blob(
    client: &Client,
    reference: &ImageRef,
    digest: &str,
    max: u64,
) -> Result<Vec<u8>> {
    let err = registry_err(reference, &format!("fetching {digest}"));
    let mut stream = client
        .pull_blob_stream(reference.oci(), digest)
        .await
        .map_err(&err)?
        .stream;
    let mut out = Vec::new();
    while let Some(part) = stream.next().await {
        let part = part.map_err(|e| {
            let damaged = e
                .get_ref()
                .is_some_and(|inner| inner.is::<oci_client::errors::DigestError>());
            match damaged {
                true => ImageError::Digest {
                    reference: reference.to_string(),
                    digest: digest.to_string(),
                    detail: format!("damaged in the registry? {e}"),
                },
                false => ImageError::Registry {
                    reference: reference.to_string(),
                    detail: format!("fetching {digest}: {e}"),
                },
            }
        })?;
        out.extend_from_slice(&part);
        if out.len() as u64 > max {
            return Err(ImageError::Digest {
                reference: reference.to_string(),
                digest: digest.to_string(),
                detail: format!("the registry sent more than the {max} bytes expected"),
            });
        }
    }
    Ok(out)
}

/// The index of `source`'s artifact, if the registry has one.
pub async fn find(
    source: &ImageRef,
    manifest_digest: &str,
    opts: &RegistryOptions,
    creds: Option<&Credentials>,
) -> Result<Option<(ImageRef, Index)>> {
    let artifact = artifact_ref(source, manifest_digest)?;
    Ok(find_at(&artifact, opts, creds)
        .await?
        .map(|index| (artifact, index)))
}

/// The index of the chunked artifact at `artifact` (a tag), if the
/// registry has one.
pub async fn find_at(
    artifact: &ImageRef,
    opts: &RegistryOptions,
    creds: Option<&Credentials>,
) -> Result<Option<Index>> {
    let client = client(artifact, opts);
    let pulled: std::result::Result<(bytes::Bytes, String), _> = client
        .pull_manifest_raw(
            artifact.oci(),
            &auth(artifact, opts, creds),
            &["application/vnd.oci.image.manifest.v1+json"],
        )
        .await;
    let Ok((raw, _)) = pulled else {
        return Ok(None);
    };
    let manifest: serde_json::Value =
        serde_json::from_slice(&raw).map_err(|e| ImageError::Registry {
            reference: artifact.to_string(),
            detail: format!("the artifact manifest is not JSON: {e}"),
        })?;
    let config = &manifest["config"];
    if config["mediaType"] != INDEX_MEDIA_TYPE {
        return Ok(None);
    }
    let digest = config["digest"].as_str().unwrap_or_default().to_string();
    chunk_hex(&digest)?;
    let bytes = fetch_blob(&client, artifact, &digest, MAX_INDEX_BYTES).await?;
    if sha256(&bytes) != digest {
        return Err(ImageError::Digest {
            reference: artifact.to_string(),
            digest,
            detail: "the chunk index does not match its digest".into(),
        });
    }
    Ok(Some(Index::from_json(&bytes)?))
}

/// Fetch every chunk of `index` that `dir` lacks from the artifact at
/// `reference`, each checked against its digest before it is kept.
/// Returns the bytes fetched.
pub async fn fetch_all(
    reference: &ImageRef,
    index: &Index,
    dir: &std::path::Path,
    opts: &RegistryOptions,
    creds: Option<&Credentials>,
) -> Result<u64> {
    use super::cache::Fetch;
    std::fs::create_dir_all(dir).map_err(crate::io(format!("creating {}", dir.display())))?;
    let remote = RegistryChunks::new(reference.clone(), opts, creds);
    let mut fetched = 0;
    for (i, c) in index.chunks.iter().enumerate() {
        let Some(c) = c else { continue };
        let path = dir.join(chunk_hex(&c.digest)?);
        if path.exists() {
            continue;
        }
        let data = remote.fetch(c).await?;
        if sha256(&data) != c.digest {
            return Err(ImageError::Damaged {
                image: reference.to_string(),
                index: i,
                digest: c.digest.clone(),
                detail: "in the registry: its bytes do not match their digest".into(),
            });
        }
        super::write_atomic(&path, &data)?;
        fetched += data.len() as u64;
    }
    Ok(fetched)
}

/// Chunks fetched from an artifact in a registry.
pub struct RegistryChunks {
    reference: ImageRef,
    client: Client,
    auth: RegistryAuth,
    authed: tokio::sync::OnceCell<()>,
}

impl RegistryChunks {
    pub fn new(
        reference: ImageRef,
        opts: &RegistryOptions,
        creds: Option<&Credentials>,
    ) -> Arc<Self> {
        Arc::new(Self {
            client: client(&reference, opts),
            auth: auth(&reference, opts, creds),
            reference,
            authed: tokio::sync::OnceCell::new(),
        })
    }
}

#[async_trait::async_trait]
impl super::cache::Fetch for RegistryChunks {
    async fn fetch(&self, chunk: &ChunkRef) -> Result<Vec<u8>> {
        self.authed
            .get_or_init(|| async {
                let registry = self.reference.oci().resolve_registry().to_string();
                self.client
                    .store_auth_if_needed(&registry, &self.auth)
                    .await;
            })
            .await;
        fetch_blob(&self.client, &self.reference, &chunk.digest, chunk.size).await
    }
}

/// What a push reports as it goes.
#[derive(Debug, Clone)]
pub struct PushProgress {
    pub done: usize,
    pub total: usize,
    pub bytes: u64,
    pub skipped: bool,
}

/// Push `index` and its chunks (from `chunks_dir`) as the artifact
/// `target`; chunks the registry has already are not sent. Returns the
/// manifest's URL.
pub async fn push(
    target: &ImageRef,
    index: &Index,
    chunks_dir: &std::path::Path,
    opts: &RegistryOptions,
    creds: Option<&Credentials>,
    progress: &mut (dyn FnMut(PushProgress) + Send),
) -> Result<String> {
    let client = client(target, opts);
    let err = |what: &str| registry_err(target, what);
    client
        .auth(
            target.oci(),
            &auth(target, opts, creds),
            oci_client::RegistryOperation::Push,
        )
        .await
        .map_err(err("authenticating to push"))?;
    let chunks = index.unique();
    for (done, c) in chunks.iter().enumerate() {
        let skipped = client
            .blob_exists(target.oci(), &c.digest)
            .await
            .map_err(err("checking a chunk"))?;
        if !skipped {
            let path = chunks_dir.join(chunk_hex(&c.digest)?);
            let data = tokio::fs::read(&path).await.map_err(crate::io(format!(
                "reading chunk {} (is the image fully local? `tine image fetch` it first)",
                path.display()
            )))?;
            if sha256(&data) != c.digest {
                return Err(ImageError::Damaged {
                    image: target.to_string(),
                    index: done,
                    digest: c.digest.clone(),
                    detail: "in the local store".into(),
                });
            }
            client
                .push_blob(target.oci(), data, &c.digest)
                .await
                .map_err(err(&format!("pushing chunk {}", c.digest)))?;
        }
        progress(PushProgress {
            done: done + 1,
            total: chunks.len(),
            bytes: c.size,
            skipped,
        });
    }
    let index_json = index.to_json();
    let index_digest = sha256(&index_json);
    let index_size = index_json.len();
    if !client
        .blob_exists(target.oci(), &index_digest)
        .await
        .map_err(err("checking the index"))?
    {
        client
            .push_blob(target.oci(), index_json, &index_digest)
            .await
            .map_err(err("pushing the index"))?;
    }
    let layers: Vec<serde_json::Value> = chunks
        .iter()
        .map(|c| serde_json::json!({"mediaType": CHUNK_MEDIA_TYPE, "digest": c.digest, "size": c.size}))
        .collect();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": INDEX_MEDIA_TYPE, "digest": index_digest, "size": index_size},
        "layers": layers,
    });
    client
        .push_manifest_raw(
            target.oci(),
            serde_json::to_vec(&manifest).unwrap_or_default(),
            http::HeaderValue::from_static("application/vnd.oci.image.manifest.v1+json"),
        )
        .await
        .map_err(err("pushing the artifact manifest"))
}
