//! The sandbox manager: every sandbox's lifecycle over the VM driver
//! (`tine_vmm::Driver`). The REST handlers in `crate::api` and the proxy
//! are thin wrappers over [`Manager`]; one job per module:
//!
//! - `lifecycle`: create (restore a template or snapshot, hand the guest
//!   its identity), get, list, kill, timeouts, metrics;
//! - `capture`: pause, resume (`connect`), snapshots, the fork's capture;
//! - `fork`: a fork's children, started here or on other nodes;
//! - `gc`: deleting captures nothing depends on;
//! - `compaction`: folding long capture chains in the background;
//! - `recover`: re-adopting VMs after a server restart;
//! - `sweep`: timeouts, auto-pause and dead VMs, every half second;
//! - `limits`: validation of timeouts, machine shapes, counts, capacity;
//! - `pool`: the warm pool; `agent`: what the server asks of the agent;
//! - `samples`: metrics sampled every 5 s, for `get_metrics(start, end)`.

pub mod agent;
mod capture;
mod compaction;
mod fork;
mod gc;
mod intent;
mod lifecycle;
pub mod limits;
mod pool;
mod recover;
mod samples;
mod sweep;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use tine_vmm::{Driver, Guest, SnapshotRef, VmHandle};

use crate::config::Config;
use crate::db::{Db, DbError};
use crate::model::SandboxRecord;
use crate::templates::{TemplateError, Templates};

pub use fork::ForkResult;
pub use lifecycle::CreateRequest;

/// The envd version our agent implements (advertised as `envdVersion`).
pub const ENVD_VERSION: &str = tine_agent_client::ENVD_VERSION;

/// Why a start was refused for capacity: what is in use and the bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapacityReached {
    /// Sandboxes live, starting, pooled and restored ahead.
    pub used: usize,
    pub asked: usize,
    pub capacity: crate::config::Capacity,
    pub max_sandboxes: usize,
}

impl std::fmt::Display for CapacityReached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.capacity;
        write!(
            f,
            "the host is at capacity: {} sandboxes in use + {} asked > {} ",
            self.used, self.asked, c.sandboxes
        )?;
        match c.by_cpu {
            Some(cpu) if cpu < self.max_sandboxes => write!(
                f,
                "(max_sandboxes_per_core × {} cores = {cpu}); running sandboxes are not affected, try again later or on another host",
                c.cores
            ),
            _ => write!(
                f,
                "(max_sandboxes); running sandboxes are not affected, try again later or on another host"
            ),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("sandbox {0} not found")]
    NotFound(String),
    #[error("{0}")]
    Template(#[from] TemplateError),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("sandbox {id}: {source}")]
    Network {
        id: String,
        #[source]
        source: Box<crate::network::NetworkError>,
    },
    #[error("sandbox {id}: {detail}")]
    Volumes { id: String, detail: String },
    #[error("{0}")]
    Conflict(String),
    /// The host holds all the sandboxes it may ([`crate::config::Capacity`]).
    #[error("{0}")]
    Capacity(CapacityReached),
    /// The host lacks the memory a start needs (`min_free_memory_mb`).
    #[error("{0}")]
    HostMemory(String),
    /// The host's data disk lacks the room a start needs (`min_free_disk_mb`).
    #[error("{0}")]
    HostDisk(String),
    /// A team's limit (`[teams.<name>]`) would be passed.
    #[error("{0}")]
    TeamLimit(String),
    /// The guest's agent does not answer what an operation needs it for
    /// (a pause that must not lose data); the sandbox is left as it was.
    #[error("sandbox {id}: its agent does not answer: {detail}")]
    GuestUnresponsive { id: String, detail: String },
    /// The VM driver failed; its error keeps its kind.
    #[error("sandbox {id}: {context}: {source}")]
    Vm {
        id: String,
        context: &'static str,
        #[source]
        source: Box<tine_vmm::Error>,
    },
    /// The agent in the guest failed or did not answer.
    #[error("sandbox {id}: {context}: {source}")]
    Agent {
        id: String,
        context: &'static str,
        #[source]
        source: Box<tine_agent_client::AgentError>,
    },
    /// A capture pulled from a registry and read lazily had a chunk that
    /// could not be fetched or did not match its digest.
    #[error("{id}: its memory cannot be read from the registry: {detail}")]
    Unreadable { id: String, detail: String },
    /// The database and the files disagree.
    #[error("sandbox {id}: {detail}")]
    Inconsistent { id: String, detail: String },
    #[error(transparent)]
    Db(#[from] DbError),
}

impl SandboxError {
    /// A short label for metrics (`tine_sandbox_create_failures_total`).
    pub fn reason(&self) -> &'static str {
        match self {
            SandboxError::NotFound(_) => "not_found",
            SandboxError::Template(_) => "template",
            SandboxError::InvalidArgument(_) => "invalid",
            SandboxError::Network { .. } => "network",
            SandboxError::Volumes { .. } => "volumes",
            SandboxError::Conflict(_) => "conflict",
            SandboxError::Capacity(_) => "capacity",
            SandboxError::HostMemory(_) => "host_memory",
            SandboxError::HostDisk(_) => "host_disk",
            SandboxError::TeamLimit(_) => "team_limit",
            SandboxError::GuestUnresponsive { .. } | SandboxError::Agent { .. } => "guest",
            SandboxError::Vm { .. } => "vm",
            SandboxError::Unreadable { .. } => "registry",
            SandboxError::Inconsistent { .. } | SandboxError::Db(_) => "internal",
        }
    }

    /// A driver error of sandbox `id` while doing `context`.
    fn vm<'a>(id: &'a str, context: &'static str) -> impl FnOnce(tine_vmm::Error) -> Self + 'a {
        move |source| SandboxError::Vm {
            id: id.to_string(),
            context,
            source: Box::new(source),
        }
    }
    /// An agent error of sandbox `id` while doing `context`.
    fn agent<'a>(
        id: &'a str,
        context: &'static str,
    ) -> impl FnOnce(tine_agent_client::AgentError) -> Self + 'a {
        move |source| SandboxError::Agent {
            id: id.to_string(),
            context,
            source: Box::new(source),
        }
    }
}

/// A sandbox whose VM is running.
pub struct Live {
    vm: tokio::sync::Mutex<Option<Box<dyn VmHandle>>>,
    /// For the proxy: reach guest ports without locking the VM.
    pub guest: Guest,
    pub access_token: String,
    /// Required of `get_host` traffic (`allowPublicTraffic: false`).
    pub traffic_token: Option<String>,
    /// The Host the guest's services see (`maskRequestHost`, `${PORT}`
    /// replaced by the port).
    pub mask_host: Option<String>,
    /// Ports whose servers speak TLS (`httpsPorts`).
    pub https_ports: Vec<u16>,
    /// Cancelled when the VM leaves (kill, pause): requests and streams
    /// proxied into it end at once instead of hanging.
    pub gone: tokio_util::sync::CancellationToken,
    /// Differs for every VM process the sandbox runs in (new on resume and
    /// after a capture that moved it), so the proxy never reuses a
    /// connection to an earlier one.
    incarnation: AtomicU64,
}

impl Live {
    pub fn incarnation(&self) -> u64 {
        self.incarnation.load(Ordering::Relaxed)
    }
    fn renew(&self) {
        self.incarnation
            .store(next_incarnation(), Ordering::Relaxed);
    }
}

fn next_incarnation() -> u64 {
    INCARNATIONS.fetch_add(1, Ordering::Relaxed)
}

static INCARNATIONS: AtomicU64 = AtomicU64::new(1);

pub struct Manager {
    pub config: Config,
    db: Arc<Db>,
    driver: Arc<dyn Driver>,
    templates: Arc<Templates>,
    network: Arc<crate::network::Network>,
    /// NFS servers of the volumes mounted into sandboxes.
    exports: Arc<crate::volumes::Exports>,
    live: RwLock<HashMap<String, Arc<Live>>>,
    /// One lock per sandbox: lifecycle operations on it run one at a time.
    ops: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    pool: Arc<pool::WarmPool>,
    /// Bounds VM starts running at once: past a few per core they only
    /// slow each other down until agents time out; beyond it they queue.
    starts: tokio::sync::Semaphore,
    compactions: compaction::Compactions,
    /// Held shared while a VM opens a capture chain (a restore until its
    /// QEMU has loaded, a capture while it reads its parent's); garbage
    /// collection takes it exclusively, so it never deletes a file that a
    /// start or capture is about to open.
    chains: Arc<tokio::sync::RwLock<()>>,
    /// A collection was skipped because chains were in use; the sweep
    /// runs it.
    gc_pending: AtomicBool,
    samples: samples::Samples,
    /// Starts admitted under the capacity and team limits, not yet live.
    admission: limits::Admission,
    /// Create and capture timings for `/metrics` (the app serves these).
    metrics: Arc<crate::metrics::Metrics>,
}

/// Where a new sandbox's VM comes from.
struct Source {
    snapshot: SnapshotRef,
    /// Its row in the snapshots table (templates included).
    snapshot_id: Option<String>,
    /// The token the guest already holds (it must be sent to replace it).
    previous_token: Option<String>,
    /// A template: the warm pool serves it.
    template: bool,
    /// Boot over the snapshot's disk instead of restoring its memory (a
    /// sandbox paused without memory).
    cold_boot: bool,
}

impl Manager {
    pub fn new(
        config: Config,
        db: Arc<Db>,
        driver: Arc<dyn Driver>,
        templates: Arc<Templates>,
        network: Arc<crate::network::Network>,
        exports: Arc<crate::volumes::Exports>,
    ) -> Self {
        let pool = Arc::new(pool::WarmPool::new(
            config.pool_size,
            config.resume_ahead,
            driver.clone(),
            network.clone(),
        ));
        Self {
            db,
            driver,
            templates,
            network,
            exports,
            live: RwLock::new(HashMap::new()),
            ops: std::sync::Mutex::new(HashMap::new()),
            pool,
            starts: tokio::sync::Semaphore::new(config.max_concurrent_starts.max(1)),
            compactions: Default::default(),
            chains: Default::default(),
            gc_pending: Default::default(),
            samples: Default::default(),
            admission: Default::default(),
            metrics: Default::default(),
            config,
        }
    }

    /// Sandboxes' networking (policies, egress proxies).
    pub fn network(&self) -> &crate::network::Network {
        &self.network
    }

    pub fn templates(&self) -> &Templates {
        &self.templates
    }

    pub fn db(&self) -> &Db {
        &self.db
    }

    /// The server's Prometheus metrics, which creates and captures feed.
    pub fn telemetry(&self) -> Arc<crate::metrics::Metrics> {
        self.metrics.clone()
    }

    pub fn db_arc(&self) -> Arc<Db> {
        self.db.clone()
    }

    pub fn live(&self, id: &str) -> Option<Arc<Live>> {
        self.live
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
    }

    pub fn live_count(&self) -> usize {
        self.live.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    async fn lock(&self, id: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let m = self
            .ops
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(id.to_string())
            .or_default()
            .clone();
        m.lock_owned().await
    }

    fn add_live(&self, rec: &SandboxRecord, vm: Box<dyn VmHandle>) {
        let live = Arc::new(Live {
            guest: vm.guest(),
            vm: tokio::sync::Mutex::new(Some(vm)),
            access_token: rec.envd_access_token.clone(),
            traffic_token: rec.traffic_token.clone(),
            mask_host: rec.network.mask_request_host.clone(),
            https_ports: rec.network.https_ports.clone().unwrap_or_default(),
            gone: Default::default(),
            incarnation: next_incarnation().into(),
        });
        self.live
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(rec.id.clone(), live);
    }

    /// Every running sandbox, as it is now.
    pub(crate) fn all_live(&self) -> Vec<(String, Arc<Live>)> {
        self.live
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(id, l)| (id.clone(), l.clone()))
            .collect()
    }

    /// The first live sandbox `pred` accepts (each is asked once).
    pub fn find_live(&self, pred: impl Fn(&Live) -> bool) -> Option<String> {
        self.live
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|(_, live)| pred(live))
            .map(|(id, _)| id.clone())
    }

    /// What the host holds for sandbox `id`'s VM: its egress proxy and
    /// its volume servers.
    fn release_host_side(&self, id: &str) {
        self.network.release(id);
        self.exports.release(id);
    }

    fn remove_live(&self, id: &str) -> Option<Arc<Live>> {
        self.release_host_side(id);
        let live = self
            .live
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        if let Some(l) = &live {
            l.gone.cancel();
        }
        live
    }

    fn event(&self, id: &str, kind: &str, detail: &str) {
        if let Err(e) = self.db.add_event(id, kind, detail) {
            tracing::warn!(sandbox = id, kind, "recording an event failed: {e}");
        }
    }
}

/// Env vars every sandbox gets (as E2B sets them), then the user's.
fn guest_env(rec: &SandboxRecord) -> BTreeMap<String, String> {
    let mut env = BTreeMap::from([
        ("E2B_SANDBOX".to_string(), "true".to_string()),
        ("E2B_SANDBOX_ID".to_string(), rec.id.clone()),
        ("E2B_TEMPLATE_ID".to_string(), rec.template_id.clone()),
    ]);
    env.extend(rec.env_vars.clone());
    env
}
