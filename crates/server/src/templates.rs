//! Templates: a booted, ready VM captured as a snapshot, which `create`
//! restores. For now the only template is `base` (the default rootfs);
//! building templates from commands and images is the issue "Templates…".
//!
//! A snapshot fixes the machine shape, so each `(template, vCPUs, MiB)`
//! that is asked for gets its own snapshot, built on first use (one cold
//! boot) and reused until the artifacts change (their paths are content
//! hashes, and they are part of the snapshot's name).

use std::collections::HashMap;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use tine_vmm::{Artifacts, Machine, Paths, Snapshot, StartOptions, Vm};
use tokio::sync::Mutex;

pub const DEFAULT_TEMPLATE: &str = "base";

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("template '{0}' not found")]
    NotFound(String),
    #[error("building template '{template}': {source}")]
    Build { template: String, source: tine_vmm::Error },
}

pub struct Templates {
    paths: Paths,
    artifacts: Artifacts,
    /// One lock per snapshot name, so concurrent creates build it once.
    building: Mutex<HashMap<String, Arc<Mutex<()>>>>,
}

impl Templates {
    pub fn new(paths: Paths, artifacts: Artifacts) -> Self {
        Self { paths, artifacts, building: Mutex::new(HashMap::new()) }
    }

    pub fn exists(&self, template: &str) -> bool {
        template == DEFAULT_TEMPLATE
    }

    fn snapshot_name(&self, template: &str, machine: Machine) -> String {
        let mut h = Sha256::new();
        for p in [&self.artifacts.kernel, &self.artifacts.initramfs, &self.artifacts.rootfs] {
            h.update(p.display().to_string().as_bytes());
            h.update([0]);
        }
        h.update(machine.accel.as_str());
        let hash: String = h.finalize().iter().take(6).map(|b| format!("{b:02x}")).collect();
        format!("tpl-{template}-{}c-{}m-{hash}", machine.vcpus, machine.memory_mib)
    }

    /// The snapshot to restore for `template` with this machine shape,
    /// built now if it does not exist yet.
    pub async fn snapshot(&self, template: &str, machine: Machine) -> Result<Snapshot, TemplateError> {
        if !self.exists(template) {
            return Err(TemplateError::NotFound(template.to_string()));
        }
        let name = self.snapshot_name(template, machine);
        if let Ok(s) = Snapshot::open(&self.paths, &name) {
            return Ok(s);
        }
        let lock = self.building.lock().await.entry(name.clone()).or_default().clone();
        let _guard = lock.lock().await;
        if let Ok(s) = Snapshot::open(&self.paths, &name) {
            return Ok(s);
        }
        let build_err = |source| TemplateError::Build { template: template.to_string(), source };
        // Leftovers of an interrupted build would make the capture fail.
        let _ = Snapshot::delete(&self.paths, &name);
        let vm_id = format!("build-{}", crate::ids::random_hex(4));
        tracing::info!(template, snapshot = %name, "building template snapshot (cold boot)");
        let vm = Vm::boot(&self.paths, &vm_id, machine, &self.artifacts, StartOptions::default())
            .await
            .map_err(build_err)?;
        let snap = vm.capture_and_kill(&name).await.map_err(build_err)?;
        tracing::info!(snapshot = %name, "template snapshot ready");
        Ok(snap)
    }
}
