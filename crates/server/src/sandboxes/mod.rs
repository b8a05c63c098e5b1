//! Sandbox lifecycle: create (restore a template snapshot, hand the guest
//! its identity), timeouts, kill, and re-adoption after a server restart.
//! The REST handlers in [`crate::api`] are thin wrappers over [`Manager`].

pub mod guest;
pub mod model;

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
}

pub struct Manager {
    pub config: Config,
    db: Arc<Db>,
    paths: Paths,
    templates: Templates,
    live: RwLock<HashMap<String, Arc<Live>>>,
}

impl Manager {
    pub fn new(config: Config, db: Arc<Db>, paths: Paths, templates: Templates) -> Self {
        Self { config, db, paths, templates, live: RwLock::new(HashMap::new()) }
    }

    pub fn db(&self) -> &Db {
        &self.db
    }

    pub fn live(&self, id: &str) -> Option<Arc<Live>> {
        self.live.read().unwrap_or_else(|e| e.into_inner()).get(id).cloned()
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
            return bad(format!("cpuCount must be between 1 and {}, got {cpus}", c.max_cpu_count));
        }
        let mem = req.memory_mb.unwrap_or(c.default_memory_mb);
        if mem < c.min_memory_mb || mem > c.max_memory_mb {
            return bad(format!("memoryMB must be between {} and {}, got {mem}", c.min_memory_mb, c.max_memory_mb));
        }
        if let Some(t) = req.timeout_secs {
            if t > c.max_timeout_secs {
                return bad(format!("timeout must be at most {} seconds, got {t}", c.max_timeout_secs));
            }
        }
        if !self.templates.exists(&req.template_id) {
            return Err(TemplateError::NotFound(req.template_id.clone()).into());
        }
        Ok(Machine { vcpus: cpus, memory_mib: mem, ..Machine::default() })
    }

    /// Create a sandbox: restore the template, give the guest its env vars,
    /// access token, clock and fresh entropy, and start its timeout.
    pub async fn create(&self, req: CreateRequest) -> Result<SandboxRecord, SandboxError> {
        let machine = self.validate(&req)?;
        let id = crate::ids::sandbox_id();
        {
            let live = self.live.read().unwrap_or_else(|e| e.into_inner());
            if live.len() >= self.config.max_sandboxes {
                return Err(SandboxError::Capacity(live.len()));
            }
        }
        let now = now_ms();
        let timeout = req.timeout_secs.unwrap_or(self.config.default_timeout_secs);
        let mut rec = SandboxRecord {
            id: id.clone(),
            template_id: req.template_id.clone(),
            alias: Some(req.template_id.clone()),
            client_id: "tine".into(),
            state: SandboxState::Starting,
            metadata: req.metadata,
            env_vars: req.env_vars,
            cpu_count: machine.vcpus,
            memory_mb: machine.memory_mib,
            disk_size_mb: 0,
            envd_version: ENVD_VERSION.into(),
            envd_access_token: crate::ids::random_hex(24),
            started_at_ms: now,
            end_at_ms: now + (timeout as i64) * 1000,
            auto_pause: req.auto_pause,
            error: None,
        };
        let snapshot = self.templates.snapshot(&req.template_id, machine).await?;
        rec.disk_size_mb = disk_size_mb(&snapshot.meta.artifacts.rootfs);
        self.db.insert_sandbox(&rec)?;
        self.event(&id, "create", &format!("template {}", req.template_id));

        let started = async {
            let vm = Vm::restore(&self.paths, &id, &snapshot, StartOptions::default())
                .await
                .map_err(|e| e.to_string())?;
            let netns = vm.netns().try_clone().map_err(|e| e.to_string())?;
            if let Err(e) = guest::init(&netns, &rec.env_vars, &rec.envd_access_token, None).await {
                let _ = vm.kill().await;
                return Err(e);
            }
            Ok((vm, netns))
        }
        .await;
        let (vm, netns) = match started {
            Ok(v) => v,
            Err(detail) => {
                self.db.set_state(&id, &[SandboxState::Starting], SandboxState::Failed, Some(&detail))?;
                self.event(&id, "failed", &detail);
                return Err(SandboxError::Vm { id, detail });
            }
        };
        // The timeout runs from the moment the sandbox is ready.
        rec.started_at_ms = now_ms();
        rec.end_at_ms = rec.started_at_ms + (timeout as i64) * 1000;
        self.db.set_times(&id, rec.started_at_ms, rec.end_at_ms)?;
        self.db.set_state(&id, &[SandboxState::Starting], SandboxState::Running, None)?;
        rec.state = SandboxState::Running;
        let live = Arc::new(Live {
            vm: tokio::sync::Mutex::new(Some(vm)),
            netns,
            access_token: rec.envd_access_token.clone(),
        });
        self.live.write().unwrap_or_else(|e| e.into_inner()).insert(id.clone(), live);
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
        let live = self.live.write().unwrap_or_else(|e| e.into_inner()).remove(id);
        let Some(live) = live else {
            // Paused sandboxes have no VM; anything else is unknown.
            let rec = self.get(id)?;
            self.db.set_state(id, &[rec.state], SandboxState::Killed, Some(reason))?;
            self.event(id, "killed", reason);
            return Ok(());
        };
        let vm = live.vm.lock().await.take();
        if let Some(vm) = vm {
            if let Err(e) = vm.kill().await {
                tracing::warn!(sandbox = id, "cleanup after kill: {e}");
                tine_vmm::vm::cleanup(&self.paths, id).await;
            }
        }
        self.db.set_state(id, &[SandboxState::Running, SandboxState::Paused], SandboxState::Killed, Some(reason))?;
        self.event(id, "killed", reason);
        Ok(())
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
        let now = now_ms();
        let ids: Vec<(String, Arc<Live>)> = self
            .live
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (id, live) in ids {
            let expired = matches!(self.db.get_sandbox(&id), Ok(Some(r)) if r.end_at_ms <= now);
            let died = match live.vm.try_lock() {
                Ok(guard) => guard.as_ref().and_then(|vm| vm.exit_status()),
                Err(_) => None, // busy: someone is working on it
            };
            if expired {
                let _ = self.kill(&id, "timeout").await;
            } else if let Some(status) = died {
                let _ = self.kill(&id, &format!("VM exited unexpectedly ({status})")).await;
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
                Vm::adopt(&self.paths, &rec.id).await.map_err(|e| e.to_string())
            } else {
                Err("the server stopped while it was starting".to_string())
            };
            match adopted.and_then(|vm| Ok((vm.netns().try_clone().map_err(|e| e.to_string())?, vm))) {
                Ok((netns, vm)) => {
                    let live = Arc::new(Live {
                        vm: tokio::sync::Mutex::new(Some(vm)),
                        netns,
                        access_token: rec.envd_access_token.clone(),
                    });
                    self.live.write().unwrap_or_else(|e| e.into_inner()).insert(rec.id.clone(), live);
                    self.event(&rec.id, "adopted", "after a server restart");
                    tracing::info!(sandbox = %rec.id, "adopted after restart");
                }
                Err(detail) => {
                    tine_vmm::vm::cleanup(&self.paths, &rec.id).await;
                    let why = format!("lost across a server restart: {detail}");
                    self.db.set_state(&rec.id, &[rec.state], SandboxState::Killed, Some(&why))?;
                    self.event(&rec.id, "killed", &why);
                    tracing::warn!(sandbox = %rec.id, "{why}");
                }
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
        let live = self.live(id).ok_or_else(|| SandboxError::Conflict(format!("sandbox {id} is not running")))?;
        guest::metrics(&live.netns, &rec.envd_access_token)
            .await
            .map_err(|detail| SandboxError::Vm { id: id.to_string(), detail })
    }
}

fn disk_size_mb(image: &std::path::Path) -> u32 {
    std::fs::metadata(image).map(|m| (m.len() >> 20) as u32).unwrap_or(0)
}
