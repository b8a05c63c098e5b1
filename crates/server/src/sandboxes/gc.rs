//! Garbage collection of captures: the files of snapshots that no sandbox,
//! template or other snapshot depends on any more (the database tracks the
//! chain) are deleted.

use std::sync::atomic::Ordering;

use super::{Manager, SandboxError};

impl Manager {
    /// Delete the files of captures nothing depends on any more. When a
    /// start or capture is opening a chain, it is left to the next sweep.
    pub fn gc(&self) {
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
                if let Err(e) = self.driver.snapshots().delete_snapshot(&id) {
                    tracing::warn!(snapshot = %id, "deleting snapshot files: {e}");
                    return;
                }
                crate::failpoint::hit("gc.after_delete");
                let _ = self.db.remove_snapshot_row(&id);
                tracing::debug!(snapshot = %id, "snapshot files deleted");
            }
        }
    }

    /// Run a collection that an earlier one had to skip.
    pub(super) fn gc_if_pending(&self) {
        if self.gc_pending.load(Ordering::Relaxed) {
            self.gc();
        }
    }

    /// `DELETE /templates/{id}`: a user snapshot, or a template by name;
    /// its files go once nothing uses them.
    pub fn delete_snapshot(&self, id: &str) -> Result<(), SandboxError> {
        if id == crate::templates::DEFAULT_TEMPLATE {
            return Err(SandboxError::InvalidArgument(format!(
                "template '{id}' is built in"
            )));
        }
        if !self.db.delete_snapshot(id)? {
            return Err(SandboxError::NotFound(format!("snapshot or template {id}")));
        }
        // A deleted template's tags go with it.
        self.db.delete_tags(id)?;
        self.gc();
        Ok(())
    }
}
