//! The sweep, every half second: sandboxes whose time is up are killed (or
//! paused, with `autoPause`), sandboxes whose VM died are killed, a
//! skipped garbage collection runs, and the warm pool lets go of templates
//! that are gone.

use std::sync::Arc;
use std::time::Duration;

use super::Manager;
use crate::db::now_ms;

/// How often the sweep runs.
const SWEEP_EVERY: Duration = Duration::from_millis(500);

/// How often running guests are checked for a stop QEMU made on its own.
const GUEST_CHECK_EVERY: Duration = Duration::from_secs(10);

/// How often the files on disk are reconciled with the database.
const RECONCILE_EVERY: Duration = Duration::from_secs(300);

/// When an auto-pause failed but left the sandbox running, the next try.
const AUTO_PAUSE_RETRY: Duration = Duration::from_secs(30);

impl Manager {
    /// Kill sandboxes whose time is up and forget those whose VM died.
    pub async fn sweep(&self) {
        self.gc_if_pending();
        // Pooled VMs of rebuilt or deleted templates.
        self.pool
            .retain(|snapshot| matches!(self.db.get_snapshot(snapshot), Ok(Some(_))))
            .await;
        let now = now_ms();
        for (id, live) in self.all_live() {
            let rec = self.db.get_sandbox(&id).ok().flatten();
            let expired = rec.as_ref().is_some_and(|r| r.end_at_ms <= now);
            let auto_pause = rec.as_ref().is_some_and(|r| r.auto_pause);
            let keep_memory = !rec
                .as_ref()
                .is_some_and(|r| r.lifecycle.auto_pause_disk_only);
            let died = match live.vm.try_lock() {
                Ok(guard) => guard.as_ref().and_then(|vm| {
                    let status = vm.exit_status()?;
                    // A capture read lazily ends QEMU with SIGBUS on a page it
                    // could not fetch or check (tine_image::lazy).
                    let lazy = vm
                        .memory_file()
                        .and_then(|f| tine_image::lazy::read_failure(&f));
                    Some(match lazy {
                        Some(why) => format!("{status}; its memory could not be read: {why}"),
                        None => status,
                    })
                }),
                Err(_) => None, // busy: someone is working on it
            };
            if expired && auto_pause {
                let mut paused = self.pause_with(&id, keep_memory, false).await;
                if let Err(super::SandboxError::GuestUnresponsive { .. }) = &paused {
                    // Its disk cannot be synced: keep its memory rather
                    // than lose what the page cache holds.
                    tracing::warn!(sandbox = %id, "auto-pause without memory refused (agent silent); pausing with memory");
                    paused = self.pause_with(&id, true, false).await;
                }
                if let Err(e) = paused {
                    if self.live(&id).is_some() {
                        // The sandbox is whole and running (a full disk,
                        // say): try again in a while rather than lose it.
                        tracing::warn!(sandbox = %id, "auto-pause at timeout failed, retried in {AUTO_PAUSE_RETRY:?}: {e}");
                        let retry = now + AUTO_PAUSE_RETRY.as_millis() as i64;
                        let _ = self.db.set_end_at(&id, retry);
                    } else {
                        tracing::warn!(sandbox = %id, "auto-pause at timeout failed: {e}");
                        let _ = self
                            .kill(&id, &format!("timeout (auto-pause failed: {e})"))
                            .await;
                    }
                }
            } else if expired {
                let _ = self.kill(&id, "timeout").await;
            } else if let Some(status) = died {
                tracing::warn!(sandbox = %id, "VM exited unexpectedly ({status})");
                let _ = self
                    .kill(&id, &format!("VM exited unexpectedly ({status})"))
                    .await;
            }
        }
    }

    /// Run [`Manager::sweep`] forever, and every [`RECONCILE_EVERY`]
    /// [`Manager::reconcile`]; [`Manager::check_guests`] runs in a loop of
    /// its own (a QEMU slow to answer must not hold up timeouts).
    pub async fn sweep_loop(self: Arc<Self>) {
        let checks = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(GUEST_CHECK_EVERY).await;
                checks.check_guests().await;
            }
        });
        let mut last_reconcile = std::time::Instant::now();
        loop {
            tokio::time::sleep(SWEEP_EVERY).await;
            self.sweep().await;
            if last_reconcile.elapsed() >= RECONCILE_EVERY {
                last_reconcile = std::time::Instant::now();
                self.reconcile().await;
            }
        }
    }

    /// Guests that QEMU stopped on its own (a disk write failed: the
    /// host's disk is full, say) are reported and let run again; while the
    /// cause lasts, QEMU stops them again and each check reports it.
    pub async fn check_guests(&self) {
        for (id, live) in self.all_live() {
            let Ok(mut guard) = live.vm.try_lock() else {
                continue; // busy: someone is working on it
            };
            let Some(vm) = guard.as_mut() else { continue };
            match vm.check_running().await {
                Ok(Some(status)) => {
                    let why = if status == "io-error" {
                        "a disk write failed (is the host's disk full?)"
                    } else {
                        "not by tine"
                    };
                    self.event(
                        &id,
                        "guest_stopped",
                        &format!("QEMU had stopped the guest ({status}: {why}); it runs again"),
                    );
                }
                Ok(None) => {}
                Err(e) => tracing::debug!(sandbox = %id, "checking its guest runs: {e}"),
            }
        }
    }

    /// What the start's recovery does that can also go wrong later:
    /// snapshot files nothing needs are deleted.
    pub async fn reconcile(&self) {
        let n = self.reclaim_snapshots(super::recover::RECLAIM_GRACE).await;
        if n > 0 {
            tracing::info!("reconcile: {n} snapshot directories nothing needed were removed");
        }
    }
}
