//! Sandbox lifecycle: create (restore a template snapshot, hand the guest
//! its identity), timeouts, kill, and re-adoption after a server restart.
//! The REST handlers in [`crate::api`] are thin wrappers over [`Manager`].

mod capture;
mod compaction;
pub mod guest;
pub mod model;
mod pool;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tine_vmm::netns::Netns;
use tine_vmm::{Machine, Paths, StartOptions, Vm};

use crate::config::Config;
use crate::db::{now_ms, Db, DbError, ListFilter};
use crate::templates::{TemplateError, Templates};
use model::{SandboxRecord, SandboxState};

/// The envd version our agent implements (advertised as `envdVersion`).
pub const ENVD_VERSION: &str = "0.6.4";

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("sandbox {0} not found")]
    NotFound(String),
    #[error("{0}")]
    Template(#[from] TemplateError),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    Conflict(String),
    #[error("capacity reached: {0} sandboxes are running (max_sandboxes)")]
    Capacity(usize),
    #[error("sandbox {id}: {detail}")]
    Vm { id: String, detail: String },
    #[error(transparent)]
    Db(#[from] DbError),
}

/// What `create` is asked for (already parsed from the E2B request).
#[derive(Debug, Clone, Default)]
pub struct CreateRequest {
    pub template_id: String,
    pub timeout_secs: Option<u64>,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub auto_pause: bool,
    pub cpu_count: Option<u32>,
    pub memory_mb: Option<u32>,
}

/// A sandbox whose VM is running.
pub struct Live {
    vm: tokio::sync::Mutex<Option<Vm>>,
    /// For the proxy: reach guest ports without locking the VM.
    pub netns: Netns,
    pub access_token: String,
    /// Differs for every VM process the sandbox runs in (new on resume and
    /// after a capture), so the proxy never reuses a connection to an
    /// earlier one.
    incarnation: std::sync::atomic::AtomicU64,
}

impl Live {
    pub fn incarnation(&self) -> u64 {
        self.incarnation.load(std::sync::atomic::Ordering::Relaxed)
    }
    fn renew(&self) {
        self.incarnation
            .store(next_incarnation(), std::sync::atomic::Ordering::Relaxed);
    }
}

fn next_incarnation() -> u64 {
    INCARNATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

static INCARNATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

pub struct Manager {
    pub config: Config,
    db: Arc<Db>,
    paths: Paths,
    templates: Templates,
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
    chains: tokio::sync::RwLock<()>,
    /// A collection was skipped because chains were in use; the sweep
    /// runs it.
    gc_pending: std::sync::atomic::AtomicBool,
}

/// Where a new sandbox's VM comes from.
struct Source {
    snapshot: tine_vmm::Snapshot,
    /// Its row in the snapshots table (templates included).
    snapshot_id: Option<String>,
    /// The token the guest already holds (it must be sent to replace it).
    previous_token: Option<String>,
    /// A template: the warm pool serves it.
    template: bool,
}

impl Manager {
    pub fn new(config: Config, db: Arc<Db>, paths: Paths, templates: Templates) -> Self {
        let pool = Arc::new(pool::WarmPool::new(config.pool_size, paths.clone()));
        Self {
            db,
            paths,
            templates,
            live: RwLock::new(HashMap::new()),
            ops: std::sync::Mutex::new(HashMap::new()),
            pool,
            starts: tokio::sync::Semaphore::new(config.max_concurrent_starts.max(1)),
            compactions: Default::default(),
            chains: tokio::sync::RwLock::new(()),
            gc_pending: Default::default(),
            config,
        }
    }

    /// Build the default template's snapshot and fill its warm pool (in
    /// the background, so the server answers meanwhile).
    pub fn warm_up(self: &Arc<Self>) {
        if self.config.pool_size == 0 {
            return;
        }
        let m = self.clone();
        tokio::spawn(async move {
            let machine = Machine {
                vcpus: m.config.default_cpu_count,
                memory_mib: m.config.default_memory_mb,
                ..Machine::default()
            };
            match m
                .templates
                .snapshot(crate::templates::DEFAULT_TEMPLATE, machine)
                .await
            {
                Ok((snap, _)) => m.pool.refill(snap),
                Err(e) => tracing::warn!("warm-up of the default template failed: {e}"),
            }
        });
    }

    /// Kill the warm pool's VMs (sandboxes keep running and are adopted by
    /// the next start).
    pub async fn shutdown(&self) {
        self.pool.drain().await;
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

    /// Restore `source` as VM `rec.id` (or run `pooled`, already restored
    /// under that id) and hand the guest its identity.
    async fn start_vm(
        &self,
        rec: &SandboxRecord,
        source: &Source,
        pooled: Option<pool::Pooled>,
    ) -> Result<(Vm, Netns), String> {
        let _slot = self.starts.acquire().await.map_err(|e| e.to_string())?;
        // A pooled guest holds the token of its warm-up `/init`.
        let previous_token = match &pooled {
            Some(p) => Some(p.token.clone()),
            None => source.previous_token.clone(),
        };
        let vm = match pooled.map(|p| p.vm) {
            Some(mut vm) => match vm.start_restored(None).await {
                Ok(()) => vm,
                Err(e) => {
                    let _ = vm.kill().await;
                    return Err(e.to_string());
                }
            },
            None => {
                let _chains = self.chains.read().await;
                Vm::restore(
                    &self.paths,
                    &rec.id,
                    &source.snapshot,
                    StartOptions::default(),
                )
                .await
                .map_err(|e| e.to_string())?
            }
        };
        let netns = vm.netns().try_clone().map_err(|e| e.to_string())?;
        if let Err(e) = guest::init(
            &netns,
            &rec.id,
            &guest_env(rec),
            &rec.envd_access_token,
            previous_token.as_deref(),
        )
        .await
        {
            let _ = vm.kill().await;
            return Err(e);
        }
        Ok((vm, netns))
    }

    fn add_live(&self, rec: &SandboxRecord, vm: Vm, netns: Netns) {
        let live = Arc::new(Live {
            vm: tokio::sync::Mutex::new(Some(vm)),
            netns,
            access_token: rec.envd_access_token.clone(),
            incarnation: next_incarnation().into(),
        });
        self.live
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(rec.id.clone(), live);
    }

    fn remove_live(&self, id: &str) -> Option<Arc<Live>> {
        self.live
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id)
    }

    pub fn db(&self) -> &Db {
        &self.db
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

    fn event(&self, id: &str, kind: &str, detail: &str) {
        if let Err(e) = self.db.add_event(id, kind, detail) {
            tracing::warn!(sandbox = id, kind, "recording an event failed: {e}");
        }
    }

    fn validate(&self, req: &CreateRequest) -> Result<Machine, SandboxError> {
        let c = &self.config;
        let bad = |m: String| Err(SandboxError::InvalidArgument(m));
        let cpus = req.cpu_count.unwrap_or(c.default_cpu_count);
        if cpus == 0 || cpus > c.max_cpu_count {
            return bad(format!(
                "cpuCount must be between 1 and {}, got {cpus}",
                c.max_cpu_count
            ));
        }
        let mem = req.memory_mb.unwrap_or(c.default_memory_mb);
        if mem < c.min_memory_mb || mem > c.max_memory_mb {
            return bad(format!(
                "memoryMB must be between {} and {}, got {mem}",
                c.min_memory_mb, c.max_memory_mb
            ));
        }
        if let Some(t) = req.timeout_secs {
            if t > c.max_timeout_secs {
                return bad(format!(
                    "timeout must be at most {} seconds, got {t}",
                    c.max_timeout_secs
                ));
            }
        }
        Ok(Machine {
            vcpus: cpus,
            memory_mib: mem,
            ..Machine::default()
        })
    }

    fn check_capacity(&self, more: usize) -> Result<(), SandboxError> {
        let n = self.live_count();
        if n + more > self.config.max_sandboxes {
            return Err(SandboxError::Capacity(n));
        }
        Ok(())
    }

    /// A template name, or the id of a user snapshot (E2B's
    /// `Sandbox.create(snapshot_id)`), with the machine shape to use.
    async fn resolve(
        &self,
        template_id: &str,
        machine: Machine,
    ) -> Result<(Source, Machine), SandboxError> {
        if let Some(row) = self.db.get_snapshot(template_id)? {
            if row.kind == crate::db::SnapshotKind::Snapshot {
                let snapshot = tine_vmm::Snapshot::open(&self.paths, &row.id).map_err(|e| {
                    SandboxError::Vm {
                        id: row.id.clone(),
                        detail: e.to_string(),
                    }
                })?;
                let m = snapshot.meta.machine;
                let source = Source {
                    snapshot,
                    snapshot_id: Some(row.id),
                    previous_token: Some(row.source_token),
                    template: false,
                };
                return Ok((source, m));
            }
        }
        let (snapshot, row) = self.templates.snapshot(template_id, machine).await?;
        let m = snapshot.meta.machine;
        Ok((
            Source {
                snapshot,
                snapshot_id: Some(row.id),
                previous_token: None,
                template: true,
            },
            m,
        ))
    }

    fn new_record(
        &self,
        template_id: &str,
        machine: Machine,
        req: &CreateRequest,
    ) -> SandboxRecord {
        let now = now_ms();
        let timeout = req.timeout_secs.unwrap_or(self.config.default_timeout_secs);
        SandboxRecord {
            id: crate::ids::sandbox_id(),
            template_id: template_id.to_string(),
            alias: Some(template_id.to_string()),
            client_id: "tine".into(),
            state: SandboxState::Starting,
            metadata: req.metadata.clone(),
            env_vars: req.env_vars.clone(),
            cpu_count: machine.vcpus,
            memory_mb: machine.memory_mib,
            disk_size_mb: 0,
            envd_version: ENVD_VERSION.into(),
            envd_access_token: crate::ids::random_hex(24),
            started_at_ms: now,
            end_at_ms: now + (timeout as i64) * 1000,
            auto_pause: req.auto_pause,
            error: None,
        }
    }

    /// Create a sandbox: restore the template (or snapshot), give the guest
    /// its env vars, access token, clock and fresh entropy, and start its
    /// timeout.
    pub async fn create(&self, req: CreateRequest) -> Result<SandboxRecord, SandboxError> {
        let machine = self.validate(&req)?;
        self.check_capacity(1)?;
        let (source, machine) = self.resolve(&req.template_id, machine).await?;
        let mut rec = self.new_record(&req.template_id, machine, &req);
        // Template creates take a pre-restored VM when one is ready.
        let pooled = if source.template {
            self.pool.take(&source.snapshot.meta.id)
        } else {
            None
        };
        if source.template {
            self.pool.refill(source.snapshot.clone());
        }
        if let Some(p) = &pooled {
            rec.id = p.vm.id().to_string();
        }
        self.launch(rec, &source, req.timeout_secs, pooled).await
    }

    /// Insert `rec`, start its VM from `source`, make it live.
    async fn launch(
        &self,
        mut rec: SandboxRecord,
        source: &Source,
        timeout_secs: Option<u64>,
        pooled: Option<pool::Pooled>,
    ) -> Result<SandboxRecord, SandboxError> {
        let id = rec.id.clone();
        rec.disk_size_mb = disk_size_mb(&source.snapshot.meta.artifacts.rootfs);
        self.db.insert_sandbox(&rec)?;
        self.db
            .set_sandbox_snapshot(&id, source.snapshot_id.as_deref())?;
        self.event(&id, "create", &format!("from {}", source.snapshot.meta.id));
        let (vm, netns) = match self.start_vm(&rec, source, pooled).await {
            Ok(v) => v,
            Err(detail) => {
                self.db.set_state(
                    &id,
                    &[SandboxState::Starting],
                    SandboxState::Failed,
                    Some(&detail),
                )?;
                self.event(&id, "failed", &detail);
                self.gc();
                return Err(SandboxError::Vm { id, detail });
            }
        };
        // The timeout runs from the moment the sandbox is ready.
        let timeout = timeout_secs.unwrap_or(self.config.default_timeout_secs) as i64;
        rec.started_at_ms = now_ms();
        rec.end_at_ms = rec.started_at_ms + timeout * 1000;
        self.db.set_times(&id, rec.started_at_ms, rec.end_at_ms)?;
        self.db
            .set_state(&id, &[SandboxState::Starting], SandboxState::Running, None)?;
        rec.state = SandboxState::Running;
        self.add_live(&rec, vm, netns);
        self.event(&id, "running", "");
        Ok(rec)
    }

    /// A sandbox the E2B API may show (running or paused).
    pub fn get(&self, id: &str) -> Result<SandboxRecord, SandboxError> {
        match self.db.get_sandbox(id)? {
            Some(r) if r.state.e2b().is_some() => Ok(r),
            _ => Err(SandboxError::NotFound(id.to_string())),
        }
    }

    pub fn list(&self, filter: &ListFilter) -> Result<Vec<SandboxRecord>, SandboxError> {
        Ok(self.db.list_sandboxes(filter)?)
    }

    /// Kill a sandbox and free everything it held. `reason` is recorded.
    pub async fn kill(&self, id: &str, reason: &str) -> Result<(), SandboxError> {
        let _op = self.lock(id).await;
        let rec = self.get(id)?;
        if let Some(live) = self.remove_live(id) {
            let vm = live.vm.lock().await.take();
            if let Some(vm) = vm {
                if let Err(e) = vm.kill().await {
                    tracing::warn!(sandbox = id, "cleanup after kill: {e}");
                    tine_vmm::vm::cleanup(&self.paths, id).await;
                }
            }
        }
        self.db
            .set_state(id, &[rec.state], SandboxState::Killed, Some(reason))?;
        self.event(id, "killed", reason);
        self.gc();
        Ok(())
    }

    /// Delete the files of captures nothing depends on any more.
    pub fn gc(&self) {
        use std::sync::atomic::Ordering;
        let Ok(_exclusive) = self.chains.try_write() else {
            self.gc_pending.store(true, Ordering::Relaxed);
            return;
        };
        self.gc_pending.store(false, Ordering::Relaxed);
        loop {
            let ids = match self.db.collectable_snapshots() {
                Ok(ids) if !ids.is_empty() => ids,
                Ok(_) => return,
                Err(e) => {
                    tracing::warn!("snapshot gc: {e}");
                    return;
                }
            };
            for id in ids {
                if let Err(e) = tine_vmm::Snapshot::delete(&self.paths, &id) {
                    tracing::warn!(snapshot = %id, "deleting snapshot files: {e}");
                    return;
                }
                let _ = self.db.remove_snapshot_row(&id);
                tracing::debug!(snapshot = %id, "snapshot files deleted");
            }
        }
    }

    /// Let the sandbox live `secs` more seconds from now.
    pub fn set_timeout(&self, id: &str, secs: u64) -> Result<(), SandboxError> {
        if secs > self.config.max_timeout_secs {
            return Err(SandboxError::InvalidArgument(format!(
                "timeout must be at most {} seconds, got {secs}",
                self.config.max_timeout_secs
            )));
        }
        let rec = self.get(id)?;
        self.db.set_end_at(&rec.id, now_ms() + secs as i64 * 1000)?;
        self.event(id, "timeout", &format!("{secs} s from now"));
        Ok(())
    }

    /// The serial console (kernel and agent) of a live sandbox.
    pub fn console_log(&self, id: &str) -> Result<String, SandboxError> {
        self.get(id)?;
        let path = self.paths.vm_dir(id).join("console.log");
        Ok(String::from_utf8_lossy(&std::fs::read(path).unwrap_or_default()).into_owned())
    }

    /// Kill sandboxes whose time is up and forget those whose VM died.
    pub async fn sweep(&self) {
        if self.gc_pending.load(std::sync::atomic::Ordering::Relaxed) {
            self.gc();
        }
        let now = now_ms();
        let ids: Vec<(String, Arc<Live>)> = self
            .live
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (id, live) in ids {
            let rec = self.db.get_sandbox(&id).ok().flatten();
            let expired = rec.as_ref().is_some_and(|r| r.end_at_ms <= now);
            let auto_pause = rec.as_ref().is_some_and(|r| r.auto_pause);
            let died = match live.vm.try_lock() {
                Ok(guard) => guard.as_ref().and_then(|vm| vm.exit_status()),
                Err(_) => None, // busy: someone is working on it
            };
            if expired && auto_pause {
                if let Err(e) = self.pause(&id).await {
                    tracing::warn!(sandbox = %id, "auto-pause at timeout failed: {e}");
                    let _ = self
                        .kill(&id, &format!("timeout (auto-pause failed: {e})"))
                        .await;
                }
            } else if expired {
                let _ = self.kill(&id, "timeout").await;
            } else if let Some(status) = died {
                let _ = self
                    .kill(&id, &format!("VM exited unexpectedly ({status})"))
                    .await;
            }
        }
    }

    /// After a (re)start: adopt the VMs of sandboxes the database says are
    /// alive; mark the others dead and clean up after them.
    pub async fn recover(&self) -> Result<(), SandboxError> {
        let filter = ListFilter {
            states: vec![SandboxState::Starting, SandboxState::Running],
            limit: usize::MAX >> 1,
            ..Default::default()
        };
        for rec in self.db.list_sandboxes(&filter)? {
            let adopted = if rec.state == SandboxState::Running {
                Vm::adopt(&self.paths, &rec.id)
                    .await
                    .map_err(|e| e.to_string())
            } else {
                Err("the server stopped while it was starting".to_string())
            };
            match adopted
                .and_then(|vm| Ok((vm.netns().try_clone().map_err(|e| e.to_string())?, vm)))
            {
                // (VM directories that belong to no sandbox are removed below.)
                Ok((netns, vm)) => {
                    self.add_live(&rec, vm, netns);
                    self.event(&rec.id, "adopted", "after a server restart");
                    tracing::info!(sandbox = %rec.id, "adopted after restart");
                }
                Err(detail) => {
                    tine_vmm::vm::cleanup(&self.paths, &rec.id).await;
                    let why = format!("lost across a server restart: {detail}");
                    self.db
                        .set_state(&rec.id, &[rec.state], SandboxState::Killed, Some(&why))?;
                    self.event(&rec.id, "killed", &why);
                    tracing::warn!(sandbox = %rec.id, "{why}");
                }
            }
        }
        // RAM of captures used to live on tmpfs; it is on disk now.
        let _ = std::fs::remove_dir_all(self.paths.shm_dir.join("snapshots"));
        // VMs no sandbox owns: a previous run's warm pool, template builds
        // or creates that were cut short.
        let owned: std::collections::HashSet<String> = self
            .live
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect();
        let pooled = self.pool.ids();
        for id in tine_vmm::vm::list(&self.paths) {
            if !owned.contains(&id) && !pooled.contains(&id) {
                tracing::info!(vm = %id, "removing a VM no sandbox owns");
                tine_vmm::vm::cleanup(&self.paths, &id).await;
            }
        }
        Ok(())
    }

    /// Run [`Manager::sweep`] forever.
    pub async fn sweep_loop(self: Arc<Self>) {
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            self.sweep().await;
        }
    }

    /// Usage of a live sandbox, from its agent.
    pub async fn metrics(&self, id: &str) -> Result<guest::Metrics, SandboxError> {
        let rec = self.get(id)?;
        let live = self
            .live(id)
            .ok_or_else(|| SandboxError::Conflict(format!("sandbox {id} is not running")))?;
        guest::metrics(&live.netns, &rec.envd_access_token)
            .await
            .map_err(|detail| SandboxError::Vm {
                id: id.to_string(),
                detail,
            })
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

fn disk_size_mb(image: &std::path::Path) -> u32 {
    std::fs::metadata(image)
        .map(|m| (m.len() >> 20) as u32)
        .unwrap_or(0)
}
