//! Captures through the registry: a node of a cluster with `[cluster]
//! registry` pushes each persistent snapshot (`create_snapshot`), each
//! template it builds and (durable pause, on by default) the capture of
//! each sandbox paused with its memory there in the background
//! ([`Captures::run`]); any node asked for a template or snapshot it lacks
//! pulls it ([`Captures::ensure_local`]), and a node a gateway sends the
//! `connect` of a paused sandbox whose own node is down or full adopts it
//! from its capture ([`Captures::adopt`]): same id, tokens, metadata and
//! network policy; the catalog records the move and the old node drops
//! its copy when it is back.
//!
//! A capture travels self-contained ([`tine_vmm::travel`]: device state,
//! whole RAM, disk flattened onto the base rootfs or, for a sandbox on an
//! OCI image, onto the image, whose chunks then travel too: the artifact
//! the node read them from, or `<repo>:image-<digest>` when they were only
//! on the node; a pulling node records the image in its store, reads it
//! lazily through its own image daemon and fetches the capture's disk
//! whole, since its header names that daemon), each file as a chunked
//! artifact of its own (`<repo>:<id>.<file>`: 1 MiB zstd chunks named by
//! their sha256, zero chunks not stored, chunks the registry has already
//! not sent again), and the catalog keeps what a node needs to install it
//! (`tine_captures`: team, names, the snapshot row and meta, the
//! artifacts). A pull reads the capture's RAM and disk lazily through the
//! image daemon ([`tine_image::lazy`]: each chunk fetched and checked when
//! first read; a damaged one ends the VM that read it and refuses later
//! restores), or with `lazy_pull = false` fetches every chunk, checks each
//! against its digest and the files against the snapshot's checksums
//! before the snapshot exists on the node. Either way a damaged chunk is
//! an error naming the capture and the chunk, never a guest with wrong
//! bytes.
//!
//! The parts:
//! - `push`: the push loop ([`Captures::run`]) and a fork's push;
//! - `pull`: pulling a capture (lazily or whole) as a template, snapshot
//!   or fork source ([`Captures::ensure_local`], [`Captures::fork_source`]);
//! - `adopt`: taking over a paused sandbox from its capture
//!   ([`Captures::adopt`]);
//! - `image`: the OCI image a capture's disk is over, pushed and
//!   installed with it;
//! - `table`: the catalog's `tine_captures` table ([`forget`], [`list`],
//!   [`snapshots_of`]).

mod adopt;
mod image;
mod pull;
mod push;
mod table;

pub use table::{forget, list, snapshots_of};

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;

use serde::{Deserialize, Serialize};
use tine_image::RegistryOptions;
use tine_vmm::snapshot::SnapshotMeta;

use super::catalog::{Catalog, CatalogError};
use crate::db::{SnapshotKind, SnapshotRow};

#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("capture {id}: {detail}")]
    Failed { id: String, detail: String },
    #[error(transparent)]
    Catalog(#[from] CatalogError),
}

fn failed(id: &str) -> impl Fn(String) -> CaptureError + '_ {
    move |detail| CaptureError::Failed {
        id: id.to_string(),
        detail,
    }
}

/// What the catalog keeps of a pushed capture.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    /// `snapshot` or `template`.
    pub kind: String,
    /// A template's `(name, tag)`s.
    #[serde(default)]
    pub tags: Vec<(String, String)>,
    pub sandbox_id: String,
    pub template_id: String,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub source_token: String,
    pub created_ms: i64,
    pub meta: SnapshotMeta,
    /// The artifact of each file, by file name.
    pub files: BTreeMap<String, String>,
    /// Bytes of chunks the push sent (the rest the registry had).
    pub pushed_bytes: u64,
    /// A pause capture's sandbox, as it was paused.
    #[serde(default)]
    pub sandbox: Option<crate::model::SandboxRecord>,
    /// The OCI image the capture's disk is over, its chunks in the
    /// registry artifact `image.chunks.remote` (None: over the base rootfs).
    #[serde(default)]
    pub image: Option<tine_image::ImageMeta>,
}

impl Record {
    /// The snapshot row of this capture installed here as `id`.
    fn row(
        &self,
        id: &str,
        kind: SnapshotKind,
        sandbox_id: String,
        names: Vec<String>,
    ) -> SnapshotRow {
        SnapshotRow {
            id: id.to_string(),
            kind,
            sandbox_id,
            parent_id: None,
            names,
            template_id: self.template_id.clone(),
            cpu_count: self.cpu_count,
            memory_mb: self.memory_mb,
            source_token: self.source_token.clone(),
            created_ms: self.created_ms,
        }
    }
}

/// A pushed capture as `tine cluster captures` lists it.
#[derive(Debug, Clone)]
pub struct Listed {
    pub id: String,
    pub team: String,
    pub names: Vec<String>,
    pub node: String,
    pub pushed_bytes: u64,
}

pub struct Captures {
    pub(super) node: String,
    /// `host:port/path` of the repository.
    repo: String,
    pub(super) opts: RegistryOptions,
    pub(super) catalog: Catalog,
    pub(super) paths: tine_vmm::Paths,
    /// Staging for pushes and pulls (`<data>/captures`).
    work: PathBuf,
    /// One pull at a time: two creates from one capture pull it once.
    pulls: tokio::sync::Mutex<()>,
    /// Push the captures of paused sandboxes too.
    durable_pause: bool,
    /// Read pulled captures' RAM and disk lazily.
    lazy_pull: bool,
    stats: Stats,
}

/// What a node's captures moved since it started (its `/metrics`).
#[derive(Debug, Default)]
pub struct Stats {
    pub pushed: AtomicU64,
    pub pushed_bytes: AtomicU64,
    pub pulled: AtomicU64,
    pub pulled_bytes: AtomicU64,
    pub adopted: AtomicU64,
}

impl Captures {
    pub fn new(
        node: &str,
        repo: &str,
        opts: RegistryOptions,
        catalog: Catalog,
        paths: tine_vmm::Paths,
        durable_pause: bool,
        lazy_pull: bool,
    ) -> Self {
        let work = paths.data_dir.join("captures");
        // Left by a run that stopped mid-way.
        let _ = std::fs::remove_dir_all(&work);
        Captures {
            node: node.to_string(),
            repo: repo.trim_end_matches('/').to_string(),
            opts,
            catalog,
            paths,
            work,
            pulls: tokio::sync::Mutex::new(()),
            durable_pause,
            lazy_pull,
            stats: Stats::default(),
        }
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }
}
