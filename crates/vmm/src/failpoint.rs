//! Named failpoints for crash tests: `TINE_FAILPOINTS=name[,name…]` makes
//! the process (the server) kill itself (SIGKILL, as a crash would) when it
//! reaches one of them. Compiled in debug builds only (what the end-to-end
//! tests run); in a release build [`hit`] does nothing. Here, in the
//! bottom crate, so the VM driver's steps can have them too.
//!
//! The points:
//! - `pause.before_capture`: the pause's intent is recorded, the VM not
//!   yet captured; `pause.after_capture`: the capture is on disk and the
//!   VM gone, the database not yet updated;
//! - `snapshot.before_capture`, `snapshot.after_capture`,
//!   `fork.before_capture`, `fork.after_capture`: the same for a capture
//!   of a sandbox that goes on running (after it, the VM runs again);
//! - `resume.after_start`: a paused sandbox's VM runs, the database still
//!   says paused;
//! - `compact.after_layer` (in the driver): a compaction replaced the
//!   snapshot's RAM layer with the merged one, not yet its disk or
//!   `meta.json`;
//! - `gc.after_delete`: a collected capture's files are deleted, its row
//!   is not;
//! - `capture.after_exit` (in the driver): a capture's QEMU has exited and
//!   its disk moved into the capture, whose `meta.json` is not written.

/// Die here if failpoint `name` is set.
#[cfg(debug_assertions)]
pub fn hit(name: &str) {
    let Ok(set) = std::env::var("TINE_FAILPOINTS") else {
        return;
    };
    if set.split(',').any(|p| p.trim() == name) {
        tracing::error!("failpoint {name}: the server kills itself");
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    }
}

#[cfg(not(debug_assertions))]
pub fn hit(_name: &str) {}
