//! tine's VM driver: QEMU `microvm` over QMP (KVM when the host has
//! hardware virtualization, TCG otherwise), one network namespace per VM,
//! snapshots whose RAM clones map copy-on-write.
//!
//! Modules, from the bottom up: [`config`] (paths, artifacts, machine
//! shape, accelerator probe), [`qemu`] (the command line), [`process`]
//! (spawning and watching QEMU), [`qmp`] (the control socket), [`netns`]
//! (namespace + tap, and connecting to guest ports), [`disk`] (qcow2
//! overlays), [`ram`] (RAM layers), [`snapshot`] (files of a snapshot), [`guest`] (HTTP to the
//! agent) and [`vm`] (the lifecycle that ties them together).

pub mod compact;
pub mod config;
pub mod disk;
pub mod error;
pub mod guest;
pub mod netns;
pub mod process;
pub mod qemu;
pub mod qmp;
pub mod ram;
pub mod snapshot;
pub mod vm;

pub use config::{Accel, Artifacts, Machine, Paths};

/// Run blocking file and process-memory work (RAM layers, compaction) off
/// the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Io {
            context: "a blocking task".into(),
            source: std::io::Error::other(e.to_string()),
        })?
}
pub use error::{Error, Result};
pub use snapshot::Snapshot;
pub use vm::{StartOptions, Vm, VmState};
