//! After a (re)start of the server, and periodically: the database, the
//! files on disk and the running QEMU processes are brought to agree.
//!
//! At start, the VMs of sandboxes the database says are running are
//! adopted (and continued, if a capture cut short left them stopped); an
//! operation a crash cut short (its intent, see `intent.rs`) is finished
//! from its files or undone; sandboxes whose VM is gone are marked killed;
//! VMs no sandbox owns are removed. Then, at start and every few minutes,
//! snapshot directories nothing needs are deleted (never one a row, an
//! intent, a VM or a needed snapshot depends on).

use std::collections::HashSet;
use std::time::Duration;

use super::intent::Intent;
use super::{agent, guest_env, Manager, SandboxError};
use crate::db::ListFilter;
use crate::model::{SandboxRecord, SandboxState};

/// How old a snapshot directory nothing names must be before it is
/// reclaimed: an operation (a build's step, say) may be writing it.
pub(super) const RECLAIM_GRACE: Duration = Duration::from_secs(600);

impl Manager {
    /// Adopt the VMs of sandboxes the database says are alive; mark the
    /// others dead and clean up after them.
    pub async fn recover(&self) -> Result<(), SandboxError> {
        let filter = ListFilter {
            states: vec![SandboxState::Starting, SandboxState::Running],
            limit: usize::MAX >> 1,
            ..Default::default()
        };
        // Sandboxes whose files are kept for the next start to try again.
        let mut deferred = HashSet::new();
        for rec in self.db.list_sandboxes(&filter)? {
            // An operation the crash cut short, if any.
            let intent = self
                .db
                .intent(&rec.id)?
                .and_then(|i| i.parse::<Intent>().ok());
            let adopted = if rec.state == SandboxState::Running {
                self.driver.adopt(&rec.id).await.map_err(|e| e.to_string())
            } else {
                Err("the server stopped while it was starting".to_string())
            };
            match adopted {
                // (VM directories that belong to no sandbox are removed below.)
                Ok(mut vm) => {
                    // A capture cut short by the restart left its vCPUs
                    // stopped: the sandbox is running, so is its VM.
                    if let Err(e) = vm.ensure_running().await {
                        tracing::warn!(sandbox = %rec.id, "continuing its VM: {e}");
                    }
                    let guest = vm.guest();
                    if let Some(intent) = &intent {
                        self.settle_beside_vm(&rec, intent, &guest).await?;
                    }
                    // The firewall lives in the namespace; the egress proxy
                    // (if any) lived in the previous process.
                    if let Err(e) = self.network.apply(&rec, &guest, &rec.network).await {
                        tracing::warn!(sandbox = %rec.id, "re-applying its network policy: {e}");
                    }
                    // Its volume servers too (the guest reconnects).
                    if let Err(e) = self.exports.serve(&rec.id, &guest, &rec.volume_mounts) {
                        tracing::warn!(sandbox = %rec.id, "serving its volumes again: {e}");
                    }
                    self.add_live(&rec, vm);
                    self.event(&rec.id, "adopted", "after a server restart");
                    tracing::info!(sandbox = %rec.id, "adopted after restart");
                }
                Err(detail) => {
                    if let Some(intent) = &intent {
                        // Its disk may be half-way into the capture. If the
                        // capture cannot be finished now (a full disk, a
                        // damaged file), nothing of it or of the VM is
                        // removed: the next start tries again.
                        if let Err(e) = self.driver.salvage_capture(&rec.id, intent.capture()) {
                            let why = format!(
                                "its {} was cut short by a restart and cannot be finished now ({e}); its files are kept and the next start tries again",
                                intent.kind().as_str()
                            );
                            tracing::error!(sandbox = %rec.id, "{why}");
                            self.event(&rec.id, "recovery_deferred", &why);
                            deferred.insert(rec.id.clone());
                            continue;
                        }
                    }
                    self.driver.cleanup(&rec.id).await;
                    if let Some(intent) = &intent {
                        if self.finish_capture(&rec, intent).await? {
                            self.resume_recovered(&rec.id, intent).await;
                            continue;
                        }
                    }
                    let why = format!("lost across a server restart: {detail}");
                    self.db.set_state(
                        &rec.id,
                        &[rec.state],
                        SandboxState::Killed,
                        Some(&why),
                        ("killed", &why),
                    )?;
                    tracing::warn!(sandbox = %rec.id, "{why}");
                }
            }
        }
        self.remove_unowned_vms(&deferred).await;
        // Rows of captures whose files a collection cut short had deleted.
        self.gc();
        self.reclaim_snapshots(RECLAIM_GRACE).await;
        Ok(())
    }

    /// The VM of `rec` outlived the crash that cut `intent` short: a pause
    /// is undone (the VM goes on); a capture that is whole is kept (as if
    /// its request had finished), one that is not is dropped. Either way
    /// the guest is reseeded: its clock stood still during the capture.
    async fn settle_beside_vm(
        &self,
        rec: &SandboxRecord,
        intent: &Intent,
        guest: &tine_vmm::Guest,
    ) -> Result<(), SandboxError> {
        let capture = intent.capture();
        let kind = intent.kind().as_str();
        let whole = self.driver.snapshots().open_snapshot(capture).is_ok();
        match intent {
            Intent::Capture { names, .. } if whole => {
                let row =
                    self.capture_row(rec, intent.kind(), capture.to_string(), names.clone())?;
                self.db.record_capture(&rec.id, &row)?;
                self.event(
                    &rec.id,
                    "captured",
                    &format!("{capture}: cut short by a server restart, completed from its files"),
                );
            }
            _ => {
                self.discard_capture(capture).await?;
                self.db.set_intent(&rec.id, None)?;
                self.event(
                    &rec.id,
                    &format!("{kind}_failed"),
                    "cut short by a server restart; the sandbox keeps running",
                );
            }
        }
        let token = &rec.envd_access_token;
        let reseeded = agent::init(
            guest,
            &rec.id,
            guest_env(rec),
            token,
            Some(token),
            Vec::new(),
            None,
        )
        .await;
        if let Err(e) = reseeded {
            tracing::warn!(sandbox = %rec.id, "reseeding its guest after a cut-short {kind}: {e}");
        }
        Ok(())
    }

    /// A sandbox whose VM was lost in a capture that is whole is paused
    /// there; if it was running (a snapshot or fork, not a pause), it runs
    /// again. A resume that fails leaves it paused (the next connect tries).
    async fn resume_recovered(&self, id: &str, intent: &Intent) {
        if matches!(intent, Intent::Pause { .. }) {
            tracing::info!(sandbox = %id, "a pause cut short by the restart, completed");
            return;
        }
        match self.connect(id, None, true).await {
            Ok(_) => {
                tracing::info!(sandbox = %id, "its VM was lost in a cut-short capture; resumed from it")
            }
            Err(e) => tracing::warn!(sandbox = %id, "resuming from its cut-short capture: {e}"),
        }
    }

    /// Delete the files of capture `id` that an operation cut short, unless
    /// something needs them (a VM's disk sealed into it, say).
    pub(super) async fn discard_capture(&self, id: &str) -> Result<(), SandboxError> {
        let _exclusive = self.chains.write().await;
        let keep: HashSet<String> = self.db.all_snapshot_ids()?.into_iter().collect();
        if keep.contains(id) {
            return Ok(());
        }
        if self
            .driver
            .snapshots()
            .unneeded_snapshots(&keep, Duration::ZERO)
            .iter()
            .any(|u| u == id)
        {
            if let Err(e) = self.driver.snapshots().delete_snapshot(id) {
                tracing::warn!(snapshot = %id, "deleting a cut-short capture: {e}");
            }
        } else {
            tracing::info!(snapshot = %id, "a cut-short capture is kept: a VM's disk is layered on it");
        }
        Ok(())
    }

    /// Delete snapshot directories nothing needs and older than `grace`:
    /// captures a crash cut short, build layers whose row was never
    /// written. Returns how many. While a start or capture holds the
    /// chains, nothing is done (the next round tries again): waiting would
    /// hold up every start behind it.
    pub async fn reclaim_snapshots(&self, grace: Duration) -> usize {
        let Ok(_exclusive) = self.chains.try_write() else {
            return 0;
        };
        let keep = match self.kept_snapshots() {
            Ok(keep) => keep,
            Err(e) => {
                tracing::warn!("reclaiming snapshot files: {e}");
                return 0;
            }
        };
        // (A rewrite in flight has younger files than the grace.)
        self.driver.snapshots().remove_stale_temp_files(grace);
        let unneeded = self.driver.snapshots().unneeded_snapshots(&keep, grace);
        for id in &unneeded {
            tracing::info!(snapshot = %id, "removing snapshot files nothing needs (left by a crash or an interrupted build)");
            if let Err(e) = self.driver.snapshots().delete_snapshot(id) {
                tracing::warn!(snapshot = %id, "removing snapshot files: {e}");
            }
        }
        unneeded.len()
    }

    /// Snapshots the database needs: every row, and the capture of every
    /// operation in flight.
    fn kept_snapshots(&self) -> Result<HashSet<String>, SandboxError> {
        // Intents first: an operation that ends in between has written its
        // row by the time the rows are read.
        let mut keep: HashSet<String> = self
            .db
            .intents()?
            .into_iter()
            .filter_map(|(_, i)| i.parse::<Intent>().ok())
            .map(|i| i.capture().to_string())
            .collect();
        keep.extend(self.db.all_snapshot_ids()?);
        Ok(keep)
    }

    /// VMs no sandbox owns: a previous run's warm pool, template builds or
    /// creates that were cut short.
    async fn remove_unowned_vms(&self, deferred: &HashSet<String>) {
        let mut owned: HashSet<String> = self
            .live
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect();
        owned.extend(self.pool.ids());
        owned.extend(deferred.iter().cloned());
        for id in self.driver.vm_ids() {
            if !owned.contains(&id) {
                tracing::info!(vm = %id, "removing a VM no sandbox owns");
                self.driver.cleanup(&id).await;
            }
        }
    }
}
