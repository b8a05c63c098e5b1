//! Background compaction of capture chains.
//!
//! Every capture of a running sandbox is a RAM and disk layer over the one
//! it ran on, so pausing and resuming (or forking forks) builds chains, and
//! restores read through all of them. Once a capture has more layers than
//! `compact_after_layers`, it is queued here and folded onto its template
//! by the driver (`tine_vmm::Driver::compact`); its row then names the template as
//! parent, and captures only it used become garbage for [`Manager::gc`].

use std::collections::VecDeque;
use std::sync::Arc;

use super::Manager;

#[derive(Default)]
pub(super) struct Compactions {
    queue: std::sync::Mutex<VecDeque<String>>,
    wake: tokio::sync::Notify,
}

impl Manager {
    /// Queue `snapshot` for compaction if its chain is longer than allowed.
    pub(super) fn maybe_compact(&self, snapshot: &tine_vmm::SnapshotRef) {
        let limit = self.config.compact_after_layers;
        if limit == 0 || snapshot.info().layers <= limit {
            return;
        }
        let id = snapshot.id().to_string();
        let mut queue = self
            .compactions
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if !queue.contains(&id) {
            queue.push_back(id);
        }
        drop(queue);
        self.compactions.wake.notify_one();
    }

    /// Compact queued captures, one at a time, for the server's lifetime.
    pub async fn compaction_loop(self: Arc<Self>) {
        loop {
            let next = self
                .compactions
                .queue
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop_front();
            let Some(id) = next else {
                self.compactions.wake.notified().await;
                continue;
            };
            match self.driver.snapshots().compact(&id).await {
                Ok(Some(root)) => {
                    if let Err(e) = self.db.set_snapshot_parent(&id, &root) {
                        tracing::warn!(snapshot = %id, "recording the compaction: {e}");
                    }
                    self.gc();
                }
                Ok(None) => {}
                // Deleted meanwhile, or damaged: nothing to fold.
                Err(e) => tracing::warn!(snapshot = %id, "compaction failed: {e}"),
            }
        }
    }
}
