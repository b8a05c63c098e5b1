//! Captures of running sandboxes: pause / resume, snapshots, fork.
//!
//! A capture stops the VM, saves its device state and seals its disk
//! overlay into a snapshot (`tine_vmm::VmHandle::capture`). A pause then
//! frees the VM; a snapshot or fork lets the source continue, re-`/init`ed
//! with the current clock and fresh entropy because its RNG state now
//! also lives in the capture.

use std::sync::Arc;
use std::time::Instant;

use tine_vmm::SnapshotRef;

use super::intent::Intent;
use super::{agent, guest_env, limits, pool, Live, Manager, SandboxError, Source};
use crate::db::{now_ms, SnapshotKind, SnapshotRow};
use crate::model::{SandboxRecord, SandboxState};

impl Manager {
    pub(super) fn capture_row(
        &self,
        rec: &SandboxRecord,
        kind: SnapshotKind,
        id: String,
        names: Vec<String>,
    ) -> Result<SnapshotRow, SandboxError> {
        Ok(SnapshotRow {
            id,
            kind,
            sandbox_id: rec.id.clone(),
            parent_id: self.db.sandbox_snapshot(&rec.id)?,
            names,
            template_id: rec.template_id.clone(),
            cpu_count: rec.cpu_count,
            memory_mb: rec.memory_mb,
            source_token: rec.envd_access_token.clone(),
            created_ms: now_ms(),
        })
    }

    fn running(&self, id: &str, op: &str) -> Result<(SandboxRecord, Arc<Live>), SandboxError> {
        let rec = self.get(id)?;
        if rec.state == SandboxState::Paused {
            return Err(SandboxError::Conflict(format!(
                "sandbox {id} is paused; cannot {op}"
            )));
        }
        let live = self
            .live(id)
            .ok_or_else(|| SandboxError::Conflict(format!("sandbox {id} is not running")))?;
        Ok((rec, live))
    }

    /// Capture the sandbox to disk and free its VM.
    pub async fn pause(&self, id: &str) -> Result<(), SandboxError> {
        self.pause_with(id, true, false).await
    }

    /// Pause; without `keep_memory` only the disk counts (the guest's
    /// file systems are synced first) and the next resume cold-boots
    /// from it: processes and connections are gone, files stay. With
    /// `require_healthy` (E2B's `requireHealthyGuest`) the pause is refused
    /// (503) while the agent does not answer; a pause without memory
    /// always is, since its sync needs the agent. A refused pause leaves
    /// the sandbox running.
    ///
    /// The capture itself is the same (tine has no disk-only capture):
    /// its RAM is written and then never read.
    pub async fn pause_with(
        &self,
        id: &str,
        keep_memory: bool,
        require_healthy: bool,
    ) -> Result<(), SandboxError> {
        let op = self.lock(id).await;
        let (mut rec, live) = self.running(id, "pause it again")?;
        let unresponsive = |detail: String| SandboxError::GuestUnresponsive {
            id: id.to_string(),
            detail,
        };
        if !keep_memory {
            // Without the sync, writes still in the page cache would be lost.
            let out = tine_agent_client::process::exec(
                live.guest.connect(tine_agent_client::AGENT_PORT),
                "root",
                "sync",
                Some(&rec.envd_access_token),
                std::time::Duration::from_secs(30),
            )
            .await
            .map_err(|e| {
                unresponsive(format!(
                    "syncing its disk before a pause without memory: {e}"
                ))
            })?;
            if out.exit_code != 0 {
                return Err(unresponsive(format!(
                    "sync before a pause without memory exited with {}",
                    out.exit_code
                )));
            }
        } else if require_healthy {
            let healthy = tokio::time::timeout(
                std::time::Duration::from_secs(5),
                tine_agent_client::healthy(live.guest.connect(tine_agent_client::AGENT_PORT)),
            )
            .await
            .unwrap_or(false);
            if !healthy {
                return Err(unresponsive("no answer to /health within 5 s".into()));
            }
        }
        let vm = live
            .vm
            .lock()
            .await
            .take()
            .ok_or_else(|| SandboxError::Conflict(format!("sandbox {id} is busy")))?;
        let row = self.capture_row(
            &rec,
            SnapshotKind::Pause,
            format!("p-{id}-{}", crate::ids::random_hex(4)),
            vec![],
        )?;
        let t = Instant::now();
        // A crash from here on is finished by `recover`, from this.
        let intent = Intent::Pause {
            capture: row.id.clone(),
            keep_memory,
        };
        if let Err(e) = self.db.set_intent(id, Some(&intent.to_string())) {
            *live.vm.lock().await = Some(vm);
            return Err(e.into());
        }
        crate::failpoint::hit("pause.before_capture");
        let captured = {
            let _chains = self.chains.read().await;
            vm.capture_and_kill(&row.id).await
        };
        if captured.is_ok() {
            crate::failpoint::hit("pause.after_capture");
        }
        let snapshot = match captured {
            Ok(snapshot) => {
                self.remove_live(id);
                self.timed_capture(SnapshotKind::Pause, t);
                snapshot
            }
            Err(failed) if failed.vm.is_some() => {
                // It failed before the VM's QEMU exited (a full disk while
                // writing its state or memory): the sandbox keeps running.
                *live.vm.lock().await = failed.vm;
                let _ = self.db.set_intent(id, None);
                let e =
                    SandboxError::vm(id, "pause failed; the sandbox keeps running")(failed.error);
                self.event(id, "pause_failed", &e.to_string());
                return Err(e);
            }
            Err(failed) => {
                self.remove_live(id);
                let e = SandboxError::vm(id, "pause failed, the VM is gone")(failed.error);
                let why = e.to_string();
                self.db.set_state(
                    id,
                    &[SandboxState::Running],
                    SandboxState::Killed,
                    Some(&why),
                    ("killed", &why),
                )?;
                return Err(e);
            }
        };
        rec.lifecycle.paused_disk_only = !keep_memory;
        let detail = format!("{} in {} ms", row.id, t.elapsed().as_millis());
        self.db
            .set_paused(id, &row, &rec.lifecycle, ("paused", &detail))?;
        self.gc();
        self.maybe_compact(&snapshot);
        if keep_memory {
            self.restore_ahead(id, snapshot, op);
        }
        Ok(())
    }

    /// Load `capture` (what sandbox `id` was just paused into) into a
    /// stopped QEMU under the sandbox's id, in the background, for its
    /// resume (`resume_ahead`; see `pool.rs`). The pause's lock of the
    /// sandbox, `op`, goes with it: the pause has answered, and the
    /// sandbox's next operation (its resume, a kill) waits for this.
    fn restore_ahead(&self, id: &str, capture: SnapshotRef, op: tokio::sync::OwnedMutexGuard<()>) {
        if self.fit_pool() == 0 || !self.pool.reserve_ahead() {
            return;
        }
        let (pool, chains) = (self.pool.clone(), self.chains.clone());
        let id = id.to_string();
        tokio::spawn(async move {
            let _op = op;
            let _chains = chains.read().await;
            pool.restore_ahead(&id, &capture).await;
        });
    }

    /// After a restart: finish the capture of `rec` that `intent` says was
    /// in flight when the server died with its VM already gone. If the
    /// capture is whole, the sandbox becomes paused there (resumable) and
    /// this says true; one that is not is deleted (unless a VM still
    /// needs its files) and this says false.
    pub(super) async fn finish_capture(
        &self,
        rec: &SandboxRecord,
        intent: &Intent,
    ) -> Result<bool, SandboxError> {
        let capture = intent.capture();
        if let Err(e) = self.driver.snapshots().open_snapshot(capture) {
            tracing::warn!(sandbox = %rec.id, capture, "the cut-short capture is not whole: {e}");
            self.discard_capture(capture).await?;
            return Ok(false);
        }
        let names = match intent {
            Intent::Capture { names, .. } => names.clone(),
            Intent::Pause { .. } => vec![],
        };
        let row = self.capture_row(rec, intent.kind(), capture.to_string(), names)?;
        let mut lifecycle = rec.lifecycle;
        lifecycle.paused_disk_only = matches!(
            intent,
            Intent::Pause {
                keep_memory: false,
                ..
            }
        );
        let detail = format!(
            "{capture}: its {} was cut short by a server restart and completed from its capture",
            intent.kind().as_str()
        );
        Ok(self
            .db
            .set_paused(&rec.id, &row, &lifecycle, ("paused", &detail))?)
    }

    /// `connect`: a running sandbox is returned as is (its timeout moved to
    /// `timeout_secs` from now if given); a paused one is restored.
    /// Returns the record and whether it was resumed.
    ///
    /// Without `memory` (the SDK's `on_resume="reboot"`), or when it was
    /// paused without its memory, a paused sandbox cold-boots over its disk.
    pub async fn connect(
        &self,
        id: &str,
        timeout_secs: Option<i64>,
        memory: bool,
    ) -> Result<(SandboxRecord, bool), SandboxError> {
        let timeout_secs = limits::optional_timeout(&self.config, timeout_secs)?;
        let _op = self.lock(id).await;
        let mut rec = self.get(id)?;
        let timeout = timeout_secs.unwrap_or(self.config.default_timeout_secs) as i64;
        if rec.state == SandboxState::Running {
            if timeout_secs.is_some() {
                rec.end_at_ms = rec.end_at_ms.max(now_ms() + timeout * 1000);
                self.db.set_end_at(id, rec.end_at_ms)?;
            }
            return Ok((rec, false));
        }
        let snap_id = self
            .db
            .sandbox_snapshot(id)?
            .ok_or_else(|| SandboxError::Inconsistent {
                id: id.to_string(),
                detail: "paused without a capture".into(),
            })?;
        // Held until it runs (its row counts as running from then on).
        let _ticket = self.admit(&rec.team, 1, rec_machine(&rec))?;
        // Paused without its memory: a cold boot over its disk, whose
        // guest has no token yet.
        let cold_boot = rec.lifecycle.paused_disk_only || !memory;
        // Opened (its chain's files held open) while no garbage collection
        // runs: a compaction of this capture may have just made its
        // ancestors garbage, and its meta.json read before that names them.
        let snapshot = {
            let _chains = self.chains.read().await;
            self.driver.snapshots().open_snapshot(&snap_id)
        }
        .map_err(SandboxError::vm(id, "cannot resume"))?;
        // Its VM restored ahead (killed if this resume cannot use it: its
        // id is about to be used again); taken before the pool is fitted
        // to the limit, which could let it go.
        let ahead = self
            .pool
            .take_ahead(id, (!cold_boot).then_some(snap_id.as_str()))
            .await
            .map(|vm| pool::Pooled {
                vm,
                token: rec.envd_access_token.clone(),
            });
        let _ = self.fit_pool();
        let source = Source {
            snapshot,
            snapshot_id: Some(snap_id),
            previous_token: (!cold_boot).then(|| rec.envd_access_token.clone()),
            template: false,
            cold_boot,
        };
        let t = Instant::now();
        let vm = self
            .start_vm(&rec, &source, ahead)
            .await
            .map_err(|e| match e {
                SandboxError::Vm { id, source, .. } => SandboxError::Vm {
                    id,
                    context: "resume failed (still paused)",
                    source,
                },
                other => other,
            })?;
        crate::failpoint::hit("resume.after_start");
        rec.end_at_ms = now_ms() + timeout * 1000;
        rec.lifecycle.paused_disk_only = false;
        let how = if cold_boot {
            "cold-booted from its disk"
        } else {
            "resumed"
        };
        let detail = format!("{how} in {} ms", t.elapsed().as_millis());
        self.db
            .set_resumed(id, rec.end_at_ms, &rec.lifecycle, ("resumed", &detail))?;
        rec.state = SandboxState::Running;
        self.add_live(&rec, vm);
        Ok((rec, true))
    }

    /// Capture a running sandbox (it keeps running) as a snapshot of
    /// `kind`; returns its row and the opened snapshot.
    pub(super) async fn capture_running(
        &self,
        id: &str,
        kind: SnapshotKind,
        names: Vec<String>,
    ) -> Result<(SnapshotRow, SnapshotRef), SandboxError> {
        let (rec, live) = self.running(id, "capture it")?;
        let prefix = if kind == SnapshotKind::Fork {
            "f"
        } else {
            "snap"
        };
        let row = self.capture_row(
            &rec,
            kind,
            format!("{prefix}-{}", crate::ids::random_hex(8)),
            names,
        )?;
        let mut guard = live.vm.lock().await;
        let vm = guard
            .as_mut()
            .ok_or_else(|| SandboxError::Conflict(format!("sandbox {id} is busy")))?;
        let t = Instant::now();
        let pid = vm.process_id();
        // A crash from here on is finished (or undone) by `recover`.
        let intent = Intent::Capture {
            capture: row.id.clone(),
            kind: kind.as_str().to_string(),
            names: row.names.clone(),
        };
        self.db.set_intent(id, Some(&intent.to_string()))?;
        crate::failpoint::hit(&format!("{}.before_capture", kind.as_str()));
        let captured = {
            let _chains = self.chains.read().await;
            vm.capture(&row.id).await
        };
        let capture = match captured {
            Ok(c) => c,
            Err(e) => {
                let _ = self.db.set_intent(id, None);
                return Err(SandboxError::vm(id, "capture")(e));
            }
        };
        crate::failpoint::hit(&format!("{}.after_capture", kind.as_str()));
        self.timed_capture(kind, t);
        if vm.process_id() != pid {
            // A new process: connections to the old one are gone.
            live.renew();
        }
        // The source's clock stood still and its RNG state is now shared
        // with whatever starts from the capture: reseed it, while the
        // capture is recorded (it is whole whether or not the reseed works).
        let (reseeded, recorded) = tokio::join!(
            agent::init(
                &live.guest,
                &rec.id,
                guest_env(&rec),
                &rec.envd_access_token,
                Some(&rec.envd_access_token),
                Vec::new(),
                None,
            ),
            async { self.db.record_capture(id, &row) }
        );
        let reseeded = reseeded.map_err(SandboxError::agent(
            id,
            "reseeding the source after its capture",
        ));
        drop(guard);
        recorded?;
        reseeded?;
        self.event(
            id,
            "captured",
            &format!(
                "{} in {} ms (vCPUs stopped {} ms)",
                row.id,
                t.elapsed().as_millis(),
                capture.vcpus_stopped.as_millis()
            ),
        );
        self.maybe_compact(&capture.snapshot);
        Ok((row, capture.snapshot))
    }

    /// Count a capture that took from `since` until now.
    fn timed_capture(&self, kind: SnapshotKind, since: Instant) {
        self.metrics
            .capture_duration
            .get_or_create(&crate::metrics::KindLabel {
                kind: kind.as_str(),
            })
            .observe(since.elapsed().as_secs_f64());
    }

    /// A user snapshot of a running sandbox, restorable by its id.
    pub async fn snapshot(
        &self,
        id: &str,
        name: Option<String>,
    ) -> Result<SnapshotRow, SandboxError> {
        let _op = self.lock(id).await;
        self.check_team_snapshots(&self.get(id)?.team)?;
        let (row, _) = self
            .capture_running(id, SnapshotKind::Snapshot, name.into_iter().collect())
            .await?;
        Ok(row)
    }

    pub fn list_snapshots(
        &self,
        sandbox_id: Option<&str>,
    ) -> Result<Vec<SnapshotRow>, SandboxError> {
        Ok(self.db.list_snapshots(sandbox_id)?)
    }
}

/// The machine shape a sandbox record runs with.
pub(super) fn rec_machine(rec: &SandboxRecord) -> tine_vmm::Machine {
    tine_vmm::Machine {
        vcpus: rec.cpu_count,
        memory_mib: rec.memory_mb,
        ..tine_vmm::Machine::default()
    }
}
