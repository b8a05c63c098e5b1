//! After a (re)start of the server: the VMs of sandboxes the database says
//! are running are adopted; the others are marked killed and cleaned up,
//! and so is every VM no sandbox owns.

use std::collections::HashSet;

use super::capture::PauseIntent;
use super::{Manager, SandboxError};
use crate::db::ListFilter;
use crate::model::SandboxState;

impl Manager {
    /// Adopt the VMs of sandboxes the database says are alive; mark the
    /// others dead and clean up after them.
    pub async fn recover(&self) -> Result<(), SandboxError> {
        let filter = ListFilter {
            states: vec![SandboxState::Starting, SandboxState::Running],
            limit: usize::MAX >> 1,
            ..Default::default()
        };
        for rec in self.db.list_sandboxes(&filter)? {
            // An operation the crash cut short, if any.
            let pause = self
                .db
                .intent(&rec.id)?
                .and_then(|i| i.parse::<PauseIntent>().ok());
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
                    if let Some(p) = &pause {
                        // The pause did not get as far as its QEMU's exit:
                        // the VM goes on, a half-written capture goes.
                        let _ = self.driver.delete_snapshot(&p.capture);
                        self.db.set_intent(&rec.id, None)?;
                        self.event(
                            &rec.id,
                            "pause_failed",
                            "cut short by a server restart; the sandbox keeps running",
                        );
                    }
                    // The firewall lives in the namespace; the egress proxy
                    // (if any) lived in the previous process.
                    let guest = vm.guest();
                    if let Err(e) = self.network.apply(&rec.id, &guest, &rec.network).await {
                        tracing::warn!(sandbox = %rec.id, "re-applying its network policy: {e}");
                    }
                    self.add_live(&rec, vm);
                    self.event(&rec.id, "adopted", "after a server restart");
                    tracing::info!(sandbox = %rec.id, "adopted after restart");
                }
                Err(detail) => {
                    self.driver.cleanup(&rec.id).await;
                    if let Some(p) = &pause {
                        if self.finish_pause(&rec, p)? {
                            tracing::info!(sandbox = %rec.id, "a pause cut short by the restart, completed");
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
        self.remove_unowned_vms().await;
        Ok(())
    }

    /// VMs no sandbox owns: a previous run's warm pool, template builds or
    /// creates that were cut short.
    async fn remove_unowned_vms(&self) {
        let mut owned: HashSet<String> = self
            .live
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect();
        owned.extend(self.pool.ids());
        for id in self.driver.vm_ids() {
            if !owned.contains(&id) {
                tracing::info!(vm = %id, "removing a VM no sandbox owns");
                self.driver.cleanup(&id).await;
            }
        }
    }
}
