//! Create, get, list, kill, timeouts and metrics of sandboxes.

use std::collections::BTreeMap;
use std::sync::Arc;

use tine_vmm::{Machine, SnapshotRef, VmHandle};

use super::{agent, guest_env, limits, pool, Manager, SandboxError, Source};
use crate::db::{now_ms, ListFilter, SnapshotKind};
use crate::model::{SandboxRecord, SandboxState};

/// What `create` is asked for (parsed from the E2B request, not validated).
#[derive(Debug, Clone, Default)]
pub struct CreateRequest {
    pub template_id: String,
    pub timeout_secs: Option<i64>,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub auto_pause: bool,
    /// `autoResume` and `autoPauseMemory: false`.
    pub lifecycle: crate::model::Lifecycle,
    pub cpu_count: Option<u32>,
    pub memory_mb: Option<u32>,
    /// Its network policy (checked already); `None` takes the default, or
    /// the policy of the sandbox a snapshot was taken of.
    pub network: Option<crate::network::NetworkPolicy>,
    /// The team of the key that asks (empty: `default`).
    pub team: String,
    /// Volumes to mount (checked already: each the team's, paths apart).
    pub volume_mounts: Vec<crate::volumes::VolumeMount>,
    /// Workload identity tokens (checked already).
    pub iam: crate::identity::Iam,
}

impl Manager {
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
                Ok((snap, _)) => m.pool.refill(snap, m.fit_pool()),
                Err(e) => tracing::warn!("warm-up of the default template failed: {e}"),
            }
        });
    }

    /// Kill the warm pool's VMs (sandboxes keep running and are adopted by
    /// the next start).
    pub async fn shutdown(&self) {
        self.pool.drain().await;
    }

    /// Restore `source` as VM `rec.id` (or run `pooled`, already restored
    /// under that id) and hand the guest its identity.
    pub(super) async fn start_vm(
        &self,
        rec: &SandboxRecord,
        source: &Source,
        pooled: Option<pool::Pooled>,
    ) -> Result<Box<dyn VmHandle>, SandboxError> {
        let _slot = self.starts.acquire().await;
        // A pooled guest holds the token of its warm-up `/init`.
        let previous_token = match &pooled {
            Some(p) => Some(p.token.clone()),
            None => source.previous_token.clone(),
        };
        let vm = match pooled.map(|p| p.vm) {
            Some(mut vm) => match vm.start().await {
                Ok(()) => vm,
                Err(e) => {
                    let _ = vm.kill().await;
                    return Err(SandboxError::vm(&rec.id, "starting a pooled VM")(e));
                }
            },
            None if source.cold_boot => {
                let _chains = self.chains.read().await;
                self.driver
                    .boot_from_disk(&rec.id, &source.snapshot)
                    .await
                    .map_err(SandboxError::vm(&rec.id, "boot from disk"))?
            }
            None => {
                let _chains = self.chains.read().await;
                self.driver
                    .restore(&rec.id, &source.snapshot)
                    .await
                    .map_err(SandboxError::vm(&rec.id, "restore"))?
            }
        };
        let guest = vm.guest();
        let mounts = match self.exports.serve(&rec.id, &guest, &rec.volume_mounts) {
            Ok(m) => m,
            Err(detail) => {
                let _ = vm.kill().await;
                return Err(SandboxError::Volumes {
                    id: rec.id.clone(),
                    detail,
                });
            }
        };
        let init = || {
            agent::init(
                &guest,
                &rec.id,
                guest_env(rec),
                &rec.envd_access_token,
                previous_token.as_deref(),
                mounts.clone(),
                self.network.trust_for(&rec.network),
            )
        };
        // The guest forwards nothing until its policy is in place, so the
        // firewall and the guest's identity can be set at once; a guest
        // that mounts volumes waits for the firewall that lets it.
        let (network, init) = match mounts.is_empty() {
            true => tokio::join!(self.network.apply(rec, &guest, &rec.network), init()),
            false => match self.network.apply(rec, &guest, &rec.network).await {
                Ok(()) => (Ok(()), init().await),
                Err(e) => (Err(e), Ok(())),
            },
        };
        if let Err(source) = network {
            self.release_host_side(&rec.id);
            let _ = vm.kill().await;
            return Err(SandboxError::Network {
                id: rec.id.clone(),
                source: Box::new(source),
            });
        }
        if let Err(e) = init {
            self.release_host_side(&rec.id);
            let _ = vm.kill().await;
            return Err(SandboxError::agent(
                &rec.id,
                "handing the guest its identity",
            )(e));
        }
        Ok(vm)
    }

    /// A template name, or the id of a user snapshot (E2B's
    /// `Sandbox.create(snapshot_id)`), with the machine shape to use.
    async fn resolve(
        &self,
        template_id: &str,
        machine: Machine,
    ) -> Result<(Source, Machine), SandboxError> {
        if let Some(row) = self.db.get_snapshot(template_id)? {
            if row.kind == SnapshotKind::Snapshot {
                // Not while garbage collection runs (see `connect`).
                let snapshot = {
                    let _chains = self.chains.read().await;
                    self.driver.snapshots().open_snapshot(&row.id)
                }
                .map_err(SandboxError::vm(template_id, "opening the snapshot"))?;
                readable(template_id, &snapshot)?;
                let m = snapshot.info().machine;
                let source = Source {
                    snapshot,
                    snapshot_id: Some(row.id),
                    previous_token: Some(row.source_token),
                    template: false,
                    cold_boot: false,
                };
                return Ok((source, m));
            }
        }
        let (snapshot, row) = self.templates.snapshot(template_id, machine).await?;
        readable(template_id, &snapshot)?;
        let m = snapshot.info().machine;
        let source = Source {
            snapshot,
            snapshot_id: Some(row.id),
            previous_token: None,
            template: true,
            cold_boot: false,
        };
        Ok((source, m))
    }

    /// The sandbox snapshot `snapshot_id` was taken of.
    fn snapshot_source(
        &self,
        snapshot_id: Option<&str>,
    ) -> Result<Option<SandboxRecord>, SandboxError> {
        let Some(row) = snapshot_id
            .map(|s| self.db.get_snapshot(s))
            .transpose()?
            .flatten()
        else {
            return Ok(None);
        };
        Ok(self.db.get_sandbox(&row.sandbox_id)?)
    }

    pub(super) fn new_record(
        &self,
        template_id: &str,
        machine: Machine,
        req: &CreateRequest,
        timeout_secs: Option<u64>,
    ) -> SandboxRecord {
        let now = now_ms();
        let timeout = timeout_secs.unwrap_or(self.config.default_timeout_secs);
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
            envd_version: super::ENVD_VERSION.into(),
            envd_access_token: crate::ids::random_hex(24),
            started_at_ms: now,
            end_at_ms: now + (timeout as i64) * 1000,
            auto_pause: req.auto_pause,
            error: None,
            traffic_token: req
                .network
                .as_ref()
                .is_some_and(|n| n.private_traffic())
                .then(|| crate::ids::random_hex(24)),
            network: req.network.clone().unwrap_or_default(),
            lifecycle: crate::model::Lifecycle {
                paused_disk_only: false,
                ..req.lifecycle
            },
            team: req.team.clone(),
            volume_mounts: req.volume_mounts.clone(),
            iam: req.iam.clone(),
        }
    }

    /// Create a sandbox: restore the template (or snapshot), give the guest
    /// its env vars, access token, clock and fresh entropy, and start its
    /// timeout.
    pub async fn create(&self, req: CreateRequest) -> Result<SandboxRecord, SandboxError> {
        let started = std::time::Instant::now();
        let made = self.create_once(req).await;
        match &made {
            Ok(_) => self
                .metrics
                .create_duration
                .observe(started.elapsed().as_secs_f64()),
            Err(e) => {
                self.metrics
                    .create_failures
                    .get_or_create(&crate::metrics::ReasonLabel { reason: e.reason() })
                    .inc();
            }
        }
        made
    }

    async fn create_once(&self, mut req: CreateRequest) -> Result<SandboxRecord, SandboxError> {
        let machine = limits::machine(&self.config, req.cpu_count, req.memory_mb)?;
        let timeout = limits::optional_timeout(&self.config, req.timeout_secs)?;
        if req.team.is_empty() {
            req.team = crate::db::DEFAULT_TEAM.to_string();
        }
        // Before a template may be built for the shape; again after, as a
        // snapshot brings its own shape.
        let mut ticket = self.admit(&req.team, 1, machine)?;
        let (source, resolved) = self.resolve(&req.template_id, machine).await?;
        if resolved != machine {
            drop(ticket);
            ticket = self.admit(&req.team, 1, resolved)?;
        }
        let machine = resolved;
        if !source.template {
            if let Some(from) = self.snapshot_source(source.snapshot_id.as_deref())? {
                req.network = req.network.or(Some(from.network));
                if req.iam.is_empty() {
                    req.iam = from.iam;
                }
                // Its guest has the snapshot's volumes mounted: they stay
                // first (their ports), the request's others follow.
                let mut mounts = from.volume_mounts;
                for m in std::mem::take(&mut req.volume_mounts) {
                    if !mounts.iter().any(|o| o.path == m.path) {
                        mounts.push(m);
                    }
                }
                req.volume_mounts = mounts;
            }
        }
        let mut rec = self.new_record(&req.template_id, machine, &req, timeout);
        // Template creates take a pre-restored VM when one is ready.
        let pooled = if source.template {
            self.pool.take(source.snapshot.id())
        } else {
            None
        };
        let room = self.fit_pool();
        if source.template {
            self.pool.refill(source.snapshot.clone(), room);
        }
        if let Some(p) = &pooled {
            rec.id = p.vm.id().to_string();
        }
        self.launch(rec, &source, timeout, pooled, &ticket).await
    }

    /// Insert `rec`, start its VM from `source`, make it live.
    pub(super) async fn launch(
        &self,
        mut rec: SandboxRecord,
        source: &Source,
        timeout_secs: Option<u64>,
        pooled: Option<pool::Pooled>,
        ticket: &limits::Ticket<'_>,
    ) -> Result<SandboxRecord, SandboxError> {
        let id = rec.id.clone();
        rec.disk_size_mb = source.snapshot.info().disk_size_mb;
        self.db.insert_sandbox(&rec)?;
        ticket.counted();
        self.db
            .set_sandbox_snapshot(&id, source.snapshot_id.as_deref())?;
        self.event(&id, "create", &format!("from {}", source.snapshot.id()));
        let vm = match self.start_vm(&rec, source, pooled).await {
            Ok(v) => v,
            Err(e) => {
                let detail = e.to_string();
                self.db.set_state(
                    &id,
                    &[SandboxState::Starting],
                    SandboxState::Failed,
                    Some(&detail),
                    ("failed", &detail),
                )?;
                self.gc();
                return Err(e);
            }
        };
        // The timeout runs from the moment the sandbox is ready.
        let timeout = timeout_secs.unwrap_or(self.config.default_timeout_secs) as i64;
        rec.started_at_ms = now_ms();
        rec.end_at_ms = rec.started_at_ms + timeout * 1000;
        self.db.set_times(&id, rec.started_at_ms, rec.end_at_ms)?;
        self.db.set_state(
            &id,
            &[SandboxState::Starting],
            SandboxState::Running,
            None,
            ("running", ""),
        )?;
        rec.state = SandboxState::Running;
        self.add_live(&rec, vm);
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
        // A paused sandbox's VM restored ahead of its resume.
        let _ = self.pool.take_ahead(id, None).await;
        if let Some(live) = self.remove_live(id) {
            let vm = live.vm.lock().await.take();
            if let Some(vm) = vm {
                if let Err(e) = vm.kill().await {
                    tracing::warn!(sandbox = id, "cleanup after kill: {e}");
                    self.driver.cleanup(id).await;
                }
            }
        }
        self.db.set_state(
            id,
            &[rec.state],
            SandboxState::Killed,
            Some(reason),
            ("killed", reason),
        )?;
        self.samples.forget(id);
        self.gc();
        Ok(())
    }

    /// Let the sandbox live `secs` more seconds from now.
    pub fn set_timeout(&self, id: &str, secs: i64) -> Result<(), SandboxError> {
        let secs = limits::timeout(&self.config, secs)?;
        let rec = self.get(id)?;
        // As E2B: only a running sandbox has a timeout to move (SDKs before
        // 2.3 resume a sandbox when this fails).
        if rec.state != SandboxState::Running {
            return Err(SandboxError::NotFound(id.to_string()));
        }
        self.db.set_end_at(&rec.id, now_ms() + secs as i64 * 1000)?;
        self.event(id, "timeout", &format!("{secs} s from now"));
        Ok(())
    }

    /// Replace the egress part of sandbox `id`'s network policy: at once in
    /// its running VM, and in the record a resume or restart applies.
    pub async fn update_network(
        &self,
        id: &str,
        mut policy: crate::network::NetworkPolicy,
    ) -> Result<(), SandboxError> {
        let _op = self.lock(id).await;
        let rec = self.get(id)?;
        policy.allow_public_traffic = rec.network.allow_public_traffic;
        policy.mask_request_host = rec.network.mask_request_host.clone();
        policy.https_ports = rec.network.https_ports.clone();
        policy
            .check_tokens(&rec.iam)
            .map_err(SandboxError::InvalidArgument)?;
        if let Some(live) = self.live(id) {
            self.network
                .apply(&rec, &live.guest, &policy)
                .await
                .map_err(|source| SandboxError::Network {
                    id: id.to_string(),
                    source: Box::new(source),
                })?;
            // HTTPS it now transforms must verify in the guest.
            if let Some(pem) = self.network.trust_for(&policy) {
                agent::trust_ca(&live.guest, &rec.envd_access_token, pem)
                    .await
                    .map_err(SandboxError::agent(id, "installing the egress CA"))?;
            }
        }
        self.db.set_network(id, &policy)?;
        self.event(
            id,
            "network",
            &serde_json::to_string(&policy.shown()).unwrap_or_default(),
        );
        Ok(())
    }

    /// The serial console (kernel and agent) of a live sandbox.
    pub fn console_log(&self, id: &str) -> Result<String, SandboxError> {
        self.get(id)?;
        Ok(self.driver.console_log(id))
    }

    /// Usage of a live sandbox, from its agent.
    /// The samples taken from `start` to `end` (Unix seconds, inclusive).
    /// Without a range, a running sandbox with no sample yet is sampled
    /// now, so a new sandbox shows one at once.
    pub async fn metrics(
        &self,
        id: &str,
        start: Option<i64>,
        end: Option<i64>,
    ) -> Result<Vec<agent::Metrics>, SandboxError> {
        let rec = self.get(id)?;
        let samples = self.samples.range(id, start, end);
        if !samples.is_empty() || start.is_some() || end.is_some() {
            return Ok(samples);
        }
        let Some(live) = self.live(id) else {
            return Ok(samples);
        };
        let m = agent::metrics(&live.guest, &rec.envd_access_token)
            .await
            .map_err(SandboxError::agent(id, "reading metrics"))?;
        self.samples.record(id, m.clone());
        Ok(vec![m])
    }
}

/// Refuse a snapshot whose RAM is read lazily from a registry
/// ([`tine_image::lazy`]) and had a chunk fail: every VM restored from it
/// would end at the first touch of that page.
fn readable(template_id: &str, snapshot: &SnapshotRef) -> Result<(), SandboxError> {
    match tine_image::lazy::read_failure(&snapshot.info().memory_file) {
        Some(detail) => Err(SandboxError::Unreadable {
            id: template_id.to_string(),
            detail,
        }),
        None => Ok(()),
    }
}
