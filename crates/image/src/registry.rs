//! Pulling an image from a registry into the blob store: the manifest (an
//! index resolves to linux/amd64), the config, and every layer not stored
//! yet, each checked against its digest.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use oci_client::Client;
use sha2::{Digest, Sha256};

use crate::reference::{is_loopback, ImageRef};
use crate::{io, ImageError, Result};

/// A user name and password (or token) for one registry.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Credentials {
    pub username: String,
    pub password: String,
    /// In the server's `[registries].credentials`: the teams whose builds
    /// may use these (`"*"`: every team). Empty: none of the API's teams,
    /// only the operator's own commands (`tine image pull`, CLI builds,
    /// captures). A request's own credentials leave it empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub teams: Vec<String>,
}

impl Credentials {
    /// A request's (or a command line's) credentials.
    pub fn new(username: String, password: String) -> Self {
        Self {
            username,
            password,
            teams: Vec::new(),
        }
    }

    /// Whether the operator gave these to `team`'s builds.
    pub fn serves_team(&self, team: &str) -> bool {
        self.teams.iter().any(|t| t == "*" || t == team)
    }
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({}, <redacted>)", self.username)
    }
}

/// How registries are reached (the `[registries]` table of the config).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RegistryOptions {
    /// Registries (`host:port`) spoken to over plain HTTP besides loopback
    /// ones.
    pub insecure: Vec<String>,
    /// Mirrors to try, in order, before a registry (`docker.io` →
    /// `["mirror.lan:5000"]`), so an air-gapped host resolves public
    /// names from its own registry.
    pub mirrors: HashMap<String, Vec<String>>,
    /// Credentials per registry (`host:port`); a request's own win.
    pub credentials: HashMap<String, Credentials>,
    /// For builds through the API: registries at these addresses (IPv4
    /// CIDRs) may be reached though they are not on the internet
    /// (loopback, private, link-local); the server checks it.
    pub allow_private: Vec<String>,
    /// An HTTP proxy every request goes through (the server's guard of a
    /// build's registry requests); never from a config file.
    #[serde(skip)]
    pub proxy: Option<String>,
}

impl RegistryOptions {
    /// These options as `team`'s builds may use them: only the
    /// credentials the operator gave that team.
    pub fn for_team(&self, team: &str) -> RegistryOptions {
        let mut opts = self.clone();
        opts.credentials.retain(|_, c| c.serves_team(team));
        opts
    }

    /// Whether a pull of `reference` with `creds` (a request's) would send
    /// any credentials, at its registry or one of its mirrors.
    pub fn sends_credentials(&self, reference: &ImageRef, creds: Option<&Credentials>) -> bool {
        creds.is_some()
            || self.credentials.contains_key(reference.registry())
            || self
                .mirrors
                .get(reference.registry())
                .into_iter()
                .flatten()
                .any(|m| self.credentials.contains_key(m))
    }
}

/// One layer of a pulled image.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LayerRef {
    pub digest: String,
    pub media_type: String,
    pub size: u64,
}

/// An image resolved in a registry: its manifest, config and layers.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// Where it was found (a mirror, or the registry it names).
    pub at: ImageRef,
    /// Whether `at` is the registry the reference names (a request's
    /// credentials are for that one only).
    pub origin: bool,
    pub manifest_digest: String,
    pub config: serde_json::Value,
    pub layers: Vec<LayerRef>,
}

/// What a pull reports as it goes.
#[derive(Debug, Clone)]
pub enum Progress {
    Manifest {
        layers: usize,
        bytes: u64,
    },
    Layer {
        index: usize,
        digest: String,
        size: u64,
        cached: bool,
    },
    /// The registry has the converted image: only its index was fetched.
    Lazy {
        chunks: usize,
        bytes: u64,
    },
    Converting,
}

/// Make ring rustls' process-wide provider (reqwest is built without one
/// of its own); before any HTTP client is made. Idempotent.
pub(crate) fn install_crypto_provider() {
    // Err: a provider is installed already (ours, or the embedder's).
    let _ = rustls::crypto::ring::default_provider().install_default();
}

pub(crate) fn client(reference: &ImageRef, opts: &RegistryOptions) -> Client {
    install_crypto_provider();
    let mut plain: Vec<String> = opts.insecure.clone();
    for r in [reference.registry(), reference.resolved_registry()] {
        if is_loopback(r) {
            plain.push(r.to_string());
        }
    }
    Client::new(ClientConfig {
        protocol: ClientProtocol::HttpsExcept(plain),
        http_proxy: opts.proxy.clone(),
        https_proxy: opts.proxy.clone(),
        ..Default::default()
    })
}

pub(crate) fn auth(
    reference: &ImageRef,
    opts: &RegistryOptions,
    creds: Option<&Credentials>,
) -> RegistryAuth {
    let creds = creds.or_else(|| opts.credentials.get(reference.registry()));
    match creds {
        Some(c) => RegistryAuth::Basic(c.username.clone(), c.password.clone()),
        None => RegistryAuth::Anonymous,
    }
}

/// The path of blob `digest` (`sha256:<hex>`) under `blobs`.
pub fn blob_path(blobs: &Path, digest: &str) -> Result<PathBuf> {
    let hex = digest.strip_prefix("sha256:").unwrap_or_default();
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ImageError::Reference {
            reference: digest.to_string(),
            detail: "not a sha256 digest".into(),
        });
    }
    Ok(blobs.join("sha256").join(hex.to_ascii_lowercase()))
}

/// sha256 of a file, as `sha256:<hex>`.
pub fn file_digest(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("sha256:{:x}", h.finalize()))
}

/// Resolve `reference`, at its registry's mirrors first (in order) and
/// then at the registry itself.
pub async fn resolve(
    reference: &ImageRef,
    opts: &RegistryOptions,
    creds: Option<&Credentials>,
) -> Result<Resolved> {
    for mirror in opts.mirrors.get(reference.registry()).into_iter().flatten() {
        let Ok(at_mirror) = reference.at_registry(mirror) else {
            continue;
        };
        // A request's credentials are for the registry it names, never
        // sent to a mirror (which has its own in the config).
        match resolve_at(&at_mirror, opts, None).await {
            Ok(r) => return Ok(Resolved { origin: false, ..r }),
            Err(e) => tracing::warn!(image = %reference, %mirror, "mirror failed: {e}"),
        }
    }
    resolve_at(reference, opts, creds).await
}

async fn resolve_at(
    reference: &ImageRef,
    opts: &RegistryOptions,
    creds: Option<&Credentials>,
) -> Result<Resolved> {
    let registry_err = |e: oci_client::errors::OciDistributionError| ImageError::Registry {
        reference: reference.to_string(),
        detail: e.to_string(),
    };
    let client = client(reference, opts);
    let (manifest, manifest_digest, config) = client
        .pull_manifest_and_config(reference.oci(), &auth(reference, opts, creds))
        .await
        .map_err(registry_err)?;
    let config: serde_json::Value =
        serde_json::from_str(&config).map_err(|e| ImageError::Registry {
            reference: reference.to_string(),
            detail: format!("the image config is not JSON: {e}"),
        })?;
    check_platform(reference, &config)?;
    let layers: Vec<LayerRef> = manifest
        .layers
        .iter()
        .map(|l| LayerRef {
            digest: l.digest.clone(),
            media_type: l.media_type.clone(),
            size: u64::try_from(l.size).unwrap_or(0),
        })
        .collect();
    Ok(Resolved {
        at: reference.clone(),
        origin: true,
        manifest_digest,
        config,
        layers,
    })
}

/// Fetch the layers of `image` not in `blobs` yet; returns the bytes
/// fetched.
pub async fn fetch_layers(
    image: &Resolved,
    opts: &RegistryOptions,
    creds: Option<&Credentials>,
    blobs: &Path,
    progress: &mut (dyn FnMut(Progress) + Send),
) -> Result<u64> {
    let reference = &image.at;
    let client = client(reference, opts);
    let creds = creds.filter(|_| image.origin);
    client
        .store_auth_if_needed(
            reference.oci().resolve_registry(),
            &auth(reference, opts, creds),
        )
        .await;
    progress(Progress::Manifest {
        layers: image.layers.len(),
        bytes: image.layers.iter().map(|l| l.size).sum(),
    });
    std::fs::create_dir_all(blobs.join("sha256"))
        .map_err(io(format!("creating {}", blobs.display())))?;
    let mut fetched = 0;
    for (index, layer) in image.layers.iter().enumerate() {
        let path = blob_path(blobs, &layer.digest)?;
        let cached = path.exists();
        if !cached {
            fetch_blob(&client, reference, layer, &path).await?;
            fetched += layer.size;
        }
        progress(Progress::Layer {
            index,
            digest: layer.digest.clone(),
            size: layer.size,
            cached,
        });
    }
    Ok(fetched)
}

/// Download one layer next to `path`, check its digest, move it in place.
async fn fetch_blob(
    client: &Client,
    reference: &ImageRef,
    layer: &LayerRef,
    path: &Path,
) -> Result<()> {
    let partial = path.with_extension("partial");
    let file = tokio::fs::File::create(&partial)
        .await
        .map_err(io(format!("creating {}", partial.display())))?;
    let pulled = client
        .pull_blob(reference.oci(), layer.digest.as_str(), file)
        .await;
    if let Err(e) = pulled {
        let _ = std::fs::remove_file(&partial);
        return Err(match e {
            oci_client::errors::OciDistributionError::DigestError(d) => ImageError::Digest {
                reference: reference.to_string(),
                digest: layer.digest.clone(),
                detail: d.to_string(),
            },
            other => ImageError::Registry {
                reference: reference.to_string(),
                detail: format!("fetching layer {}: {other}", layer.digest),
            },
        });
    }
    let check = partial.clone();
    let actual = tokio::task::spawn_blocking(move || file_digest(&check))
        .await
        .map_err(|e| ImageError::Io {
            context: "hashing a layer".into(),
            source: std::io::Error::other(e),
        })?
        .map_err(io(format!("reading {}", partial.display())))?;
    if actual != layer.digest {
        let _ = std::fs::remove_file(&partial);
        return Err(ImageError::Digest {
            reference: reference.to_string(),
            digest: layer.digest.clone(),
            detail: format!("got {actual}"),
        });
    }
    std::fs::rename(&partial, path).map_err(io(format!("storing {}", path.display())))
}

/// An image config for another platform than linux/amd64 is refused.
fn check_platform(reference: &ImageRef, config: &serde_json::Value) -> Result<()> {
    let os = config["os"].as_str().unwrap_or("linux");
    let arch = config["architecture"].as_str().unwrap_or("amd64");
    if os != "linux" || arch != "amd64" {
        return Err(ImageError::Platform {
            reference: reference.to_string(),
            found: format!("{os}/{arch}"),
        });
    }
    Ok(())
}

/// Push an image made of `layers` (bytes, media type) and `config` (an
/// image config JSON) as `reference`; for benchmarks and tests that need
/// an image in a registry of their own. Returns the manifest's URL.
pub async fn push_image(
    reference: &ImageRef,
    layers: Vec<(Vec<u8>, String)>,
    config: Vec<u8>,
    opts: &RegistryOptions,
    creds: Option<&Credentials>,
) -> Result<String> {
    let client = client(reference, opts);
    let layers: Vec<oci_client::client::ImageLayer> = layers
        .into_iter()
        .map(|(data, media_type)| oci_client::client::ImageLayer::new(data, media_type, None))
        .collect();
    let config = oci_client::client::Config::new(
        config,
        "application/vnd.oci.image.config.v1+json".into(),
        None,
    );
    client
        .push(
            reference.oci(),
            &layers,
            config,
            &auth(reference, opts, creds),
            None,
        )
        .await
        .map(|r| r.manifest_url)
        .map_err(|e| ImageError::Registry {
            reference: reference.to_string(),
            detail: format!("pushing: {e}"),
        })
}
