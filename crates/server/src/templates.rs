//! Templates: a booted, ready VM captured as a snapshot, which `create`
//! restores. `base` is the default rootfs as booted, captured here; every
//! other template is made by the one build engine (`crate::builds::run`,
//! for the SDK's `Template` builds and `tine template build` alike) from
//! `base` or an image plus steps, a start command and a ready check.
//! Templates are rows of kind `template` in the snapshots table
//! (`names[0]` is the template's name).
//!
//! A snapshot fixes the machine shape, so `base` gets one snapshot per
//! `(vCPUs, MiB)` asked for, built on first use (one cold boot) and reused
//! until the artifacts or the boot's devices change (both are part of the
//! snapshot's name; the artifacts' paths are content hashes). A built template has the shape it was built
//! with.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tine_agent_client::{AgentError, ExecOutput, AGENT_PORT};
use tine_vmm::{Artifacts, Driver, Machine, RootDisk, SnapshotRef, VmHandle};
use tokio::sync::Mutex;

use crate::db::{now_ms, Db, DbError, SnapshotKind, SnapshotRow};

pub const DEFAULT_TEMPLATE: &str = "base";

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("template '{0}' not found")]
    NotFound(String),
    #[error("invalid template: {0}")]
    Invalid(String),
    #[error("building template '{template}': {detail}")]
    Build { template: String, detail: String },
    /// The VM driver failed; its error keeps its kind.
    #[error("template '{template}': {source}")]
    Vm {
        template: String,
        #[source]
        source: Box<tine_vmm::Error>,
    },
    #[error("building template '{template}': {source}")]
    Agent {
        template: String,
        #[source]
        source: Box<AgentError>,
    },
    /// A new machine shape of `base` past `max_base_shapes`.
    #[error("{0}")]
    TooManyShapes(String),
    #[error(transparent)]
    Db(#[from] DbError),
}

pub struct Templates {
    driver: Arc<dyn Driver>,
    artifacts: Artifacts,
    db: Arc<Db>,
    /// One lock per snapshot name, so concurrent creates build it once.
    building: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// Machine shapes of `base` this host keeps a snapshot of, at most
    /// (each is a cold boot and a RAM file on disk); 0: no bound.
    max_base_shapes: std::sync::atomic::AtomicUsize,
}

impl Templates {
    pub fn new(driver: Arc<dyn Driver>, artifacts: Artifacts, db: Arc<Db>) -> Self {
        Self {
            driver,
            artifacts,
            db,
            building: Mutex::new(HashMap::new()),
            max_base_shapes: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// Bound the machine shapes of `base` (`max_base_shapes`).
    pub fn with_max_base_shapes(self, max: usize) -> Self {
        self.max_base_shapes
            .store(max, std::sync::atomic::Ordering::Relaxed);
        self
    }

    /// Refuse a new shape of `base` when `max_base_shapes` of them are on
    /// disk already, naming the shapes there are.
    fn check_new_shape(&self, name: &str) -> Result<(), TemplateError> {
        let max = self
            .max_base_shapes
            .load(std::sync::atomic::Ordering::Relaxed);
        if max == 0 {
            return Ok(());
        }
        let prefix = format!("tpl-{DEFAULT_TEMPLATE}-");
        // Only shapes of the same artifacts and devices count: older ones
        // are no longer restored, and go when nothing needs them.
        let hash = name.rsplit_once('-').map_or("", |(_, h)| h);
        let mut shapes: Vec<String> = self
            .db
            .all_snapshot_ids()?
            .into_iter()
            .filter(|id| id.starts_with(&prefix) && id.ends_with(hash) && id != name)
            .collect();
        if shapes.len() < max {
            return Ok(());
        }
        shapes.sort();
        let held: Vec<&str> = shapes
            .iter()
            .filter_map(|id| id.strip_prefix(&prefix))
            .filter_map(|rest| rest.rsplit_once('-').map(|(shape, _)| shape))
            .collect();
        Err(TemplateError::TooManyShapes(format!(
            "this host keeps {} machine shapes of '{DEFAULT_TEMPLATE}' (max_base_shapes = {max}), each a snapshot of its own: ask for one of them ({}) or use a template of your own",
            shapes.len(),
            held.join(", ")
        )))
    }

    pub fn exists(&self, template: &str) -> bool {
        template == DEFAULT_TEMPLATE || matches!(self.find(template), Ok(Some(_)))
    }

    /// A built template by name (its newest build) or `name:tag`.
    pub fn find(&self, template: &str) -> Result<Option<SnapshotRow>, TemplateError> {
        if let Some((name, tag)) = template.rsplit_once(':') {
            let Some(id) = self.db.tag_snapshot(name, tag)? else {
                return Ok(None);
            };
            return Ok(self.db.get_snapshot(&id)?);
        }
        Ok(self.db.find_template(template, None)?)
    }

    fn base_snapshot_name(&self, machine: Machine) -> String {
        let mut h = Sha256::new();
        for p in [
            self.artifacts.kernel.display().to_string(),
            self.artifacts.initramfs.display().to_string(),
            self.artifacts.rootfs.backing(),
        ] {
            h.update(p.as_bytes());
            h.update([0]);
        }
        h.update(machine.accel.as_str());
        h.update(self.driver.boot_devices());
        let hash: String = h
            .finalize()
            .iter()
            .take(6)
            .map(|b| format!("{b:02x}"))
            .collect();
        format!(
            "tpl-{DEFAULT_TEMPLATE}-{}c-{}m-{hash}",
            machine.vcpus, machine.memory_mib
        )
    }

    /// The snapshot to restore for `template` (and its row). `base` is
    /// built for `machine` now if needed; other templates have their own
    /// shape.
    pub async fn snapshot(
        &self,
        template: &str,
        machine: Machine,
    ) -> Result<(SnapshotRef, SnapshotRow), TemplateError> {
        if template != DEFAULT_TEMPLATE {
            let row = self
                .find(template)?
                .ok_or_else(|| TemplateError::NotFound(template.into()))?;
            let snap = self
                .driver
                .snapshots()
                .open_snapshot(&row.id)
                .map_err(|source| TemplateError::Vm {
                    template: template.into(),
                    source: Box::new(source),
                })?;
            return Ok((snap, row));
        }
        let name = self.base_snapshot_name(machine);
        let row = |m: Machine| SnapshotRow {
            id: name.clone(),
            kind: SnapshotKind::Template,
            sandbox_id: String::new(),
            parent_id: None,
            names: vec![DEFAULT_TEMPLATE.into()],
            template_id: DEFAULT_TEMPLATE.into(),
            cpu_count: m.vcpus,
            memory_mb: m.memory_mib,
            source_token: String::new(),
            created_ms: now_ms(),
        };
        if let Ok(s) = self.driver.snapshots().open_snapshot(&name) {
            self.db.insert_snapshot(&row(machine))?;
            return Ok((s, row(machine)));
        }
        let lock = self
            .building
            .lock()
            .await
            .entry(name.clone())
            .or_default()
            .clone();
        let _guard = lock.lock().await;
        if let Ok(s) = self.driver.snapshots().open_snapshot(&name) {
            return Ok((s, row(machine)));
        }
        self.check_new_shape(&name)?;
        // Leftovers of an interrupted build would make the capture fail.
        let _ = self.driver.snapshots().delete_snapshot(&name);
        tracing::info!(snapshot = %name, "building the base template snapshot (cold boot)");
        let snap = boot_and_capture(self.driver.as_ref(), &self.artifacts, machine, &name).await?;
        self.db.insert_snapshot(&row(machine))?;
        tracing::info!(snapshot = %name, "template snapshot ready");
        Ok((snap, row(machine)))
    }
}

/// An image a template is built on, and how VMs reach its root disk.
#[derive(Debug, Clone)]
pub struct BuildImage {
    pub meta: tine_image::ImageMeta,
    pub disk: RootDisk,
}

impl BuildImage {
    /// `meta` under the data directory `data_dir`: a chunked image is
    /// read through the image daemon's NBD socket (which must be running
    /// while VMs on it do: see [`tine_image::nbd::daemon::ensure`]).
    pub fn new(meta: tine_image::ImageMeta, data_dir: &std::path::Path) -> Self {
        let disk = match &meta.chunks {
            Some(c) => RootDisk::Nbd {
                socket: tine_image::nbd::daemon::socket_path(data_dir),
                export: meta
                    .manifest_digest
                    .trim_start_matches("sha256:")
                    .to_string(),
                size: c.disk_size,
            },
            None => RootDisk::File(meta.rootfs.clone()),
        };
        Self { meta, disk }
    }
}

/// Cold-boot `base` for `machine` and capture it as snapshot `snap_id`:
/// the `base` template of that shape. (Every other template is built by
/// the build engine, `crate::builds::run`, which starts from this one.)
async fn boot_and_capture(
    driver: &dyn Driver,
    artifacts: &Artifacts,
    machine: Machine,
    snap_id: &str,
) -> Result<SnapshotRef, TemplateError> {
    let vm_err = |source| TemplateError::Vm {
        template: DEFAULT_TEMPLATE.into(),
        source: Box::new(source),
    };
    let vm_id = format!("build-{}", crate::ids::random_hex(4));
    let vm = driver
        .boot(&vm_id, machine, artifacts)
        .await
        .map_err(vm_err)?;
    match vm.capture_and_kill(snap_id).await {
        Ok(snapshot) => Ok(snapshot),
        Err(failed) => Err(vm_err(failed.discard().await)),
    }
}

/// The shell command that gives an image without a `user` account one
/// (uid 1000, home `/home/user`), as E2B's sandboxes have: the SDKs run
/// commands as `user` unless told otherwise. It goes into the template's
/// writable layer, not the image.
const ADD_USER: &str = "id user >/dev/null 2>&1 || { \
    grep -q '^user:' /etc/group || echo 'user:x:1000:' >> /etc/group; \
    echo 'user:x:1000:1000::/home/user:/bin/sh' >> /etc/passwd; \
    mkdir -p /home/user && chown 1000:1000 /home/user; }";

/// Give the guest of an image build the image's `Env` and `WorkingDir`
/// (the agent keeps them, so every sandbox of the template has them), and
/// a `user` account if the image has none.
pub(crate) async fn prepare_image(
    vm: &dyn VmHandle,
    template: &str,
    image: &tine_image::ImageMeta,
) -> Result<(), TemplateError> {
    let agent_err = |source| TemplateError::Agent {
        template: template.to_string(),
        source: Box::new(source),
    };
    let init = tine_agent_client::InitRequest {
        env_vars: Some(image.config.env_map()),
        default_workdir: image.config.working_dir.clone(),
        ..Default::default()
    };
    let guest = vm.guest();
    tine_agent_client::init(guest.connect(AGENT_PORT), &init, None)
        .await
        .map_err(agent_err)?;
    let out = exec_root(vm, template, ADD_USER, Duration::from_secs(60)).await?;
    if out.exit_code != 0 {
        return Err(TemplateError::Build {
            template: template.to_string(),
            detail: format!(
                "adding the user account exited with {}: {}",
                out.exit_code,
                String::from_utf8_lossy(&out.stderr)
            ),
        });
    }
    Ok(())
}

/// Run `cmd` as root in the build VM (no access token: a build's guest
/// has none).
async fn exec_root(
    vm: &dyn VmHandle,
    template: &str,
    cmd: &str,
    timeout: Duration,
) -> Result<ExecOutput, TemplateError> {
    let guest = vm.guest();
    tine_agent_client::process::exec(guest.connect(AGENT_PORT), "root", cmd, None, timeout)
        .await
        .map_err(|source| TemplateError::Agent {
            template: template.to_string(),
            source: Box::new(source),
        })
}

/// Delete template `name` (all its rows); files go once unused.
pub fn delete(db: &Db, name: &str) -> Result<bool, TemplateError> {
    if name == DEFAULT_TEMPLATE {
        return Err(TemplateError::Invalid(format!(
            "'{DEFAULT_TEMPLATE}' is built in"
        )));
    }
    Ok(db.delete_snapshot(name)?)
}
