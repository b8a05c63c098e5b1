//! OCI images as tine root disks.
//!
//! `tine image pull REF` resolves a reference in a registry (OCI or Docker
//! v2 manifests; a multi-arch index resolves to linux/amd64), fetches the
//! config and the layers into a content-addressed blob store (a layer that
//! several images share is stored once; every blob's digest is checked as
//! it is written), applies the layers in order into a tree (whiteouts,
//! opaque directories, hardlinks, symlinks, xattrs, owners, device nodes,
//! setuid bits) and makes an ext4 image of it with `mkfs.ext4 -d`, the same
//! way the `base` rootfs is made, which every VM mounts through its own
//! qcow2 overlay. The image's `Env`, `WorkingDir`, `User`, `Entrypoint` and
//! `Cmd` are kept with it.
//!
//! Modules: [`reference`] (what a reference names, which registries speak
//! plain HTTP), [`registry`] (the pull), [`layers`] (applying layer
//! tarballs), [`store`] (the files under `$TINE_DATA_DIR/images`).
//!
//! Why ext4 and not erofs: the guest kernel mounts either, but the base
//! rootfs is ext4 built by `mkfs.ext4 -d` already, e2fsprogs is on every
//! Debian host, and bookworm's `mkfs.erofs` (1.5) has no way to keep
//! xattrs and owners from a tree without extra flags we would have to
//! test separately; one format means one code path in the guest.

pub mod chunks;
pub mod layers;
pub mod lazy;
pub mod nbd;
pub mod reference;
pub mod registry;
pub mod store;

pub use reference::ImageRef;
pub use registry::{Credentials, RegistryOptions};
pub use store::{ImageConfig, ImageMeta, ImageStore};

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("invalid image reference {reference:?}: {detail}")]
    Reference { reference: String, detail: String },
    #[error("image {reference}: {detail}")]
    Registry { reference: String, detail: String },
    #[error("image {reference} is for {found}, not linux/amd64")]
    Platform { reference: String, found: String },
    #[error("image {reference}: blob {digest} does not match its digest ({detail})")]
    Digest {
        reference: String,
        digest: String,
        detail: String,
    },
    #[error("image {reference}: layer {digest}: {detail}")]
    Layer {
        reference: String,
        digest: String,
        detail: String,
    },
    #[error("image {image}: chunk {index} ({digest}): {detail}")]
    Chunk {
        image: String,
        index: usize,
        digest: String,
        detail: String,
    },
    /// A chunk whose bytes do not match its digest (or do not
    /// decompress): fetching it again gives the same bytes.
    #[error("image {image}: chunk {index} ({digest}) is damaged: {detail}")]
    Damaged {
        image: String,
        index: usize,
        digest: String,
        detail: String,
    },
    #[error("image {0} is not in the local store (tine image pull it first)")]
    NotFound(String),
    #[error("image {reference} is used by {users}")]
    InUse { reference: String, users: String },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = ImageError> = std::result::Result<T, E>;

pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ImageError {
    let context = context.into();
    move |source| ImageError::Io { context, source }
}
