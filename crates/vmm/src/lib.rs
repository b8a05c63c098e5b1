//! tine's VM driver: QEMU `microvm` over QMP (KVM when the host has
//! hardware virtualization, TCG otherwise), one network namespace per VM,
//! snapshots whose RAM clones map copy-on-write.
//!
//! The seam the server uses is [`driver`]: the [`Driver`] and [`VmHandle`]
//! traits, with snapshots described as data; [`QemuDriver`] is the one
//! implementation. Inside, from the bottom up: [`config`] (paths,
//! artifacts, machine shape, accelerator probe), `qemu` (the command
//! line), `process` (spawning and watching QEMU), `qmp` (the control
//! socket), [`netns`] (namespace, tap and veth, and connecting to guest ports),
//! [`firewall`] (the nftables egress rules),
//! [`disk`] (qcow2 overlays), [`ram`] (RAM layers), [`snapshot`] (files of
//! a snapshot), [`compact`] (folding chains) and `vm` (the lifecycle that
//! ties them together). `qemu`, `qmp` and `process` are private; the
//! bench's by-hand restore (its floor) is [`floor`], behind the `bench`
//! feature.

pub mod checksum;
pub mod compact;
pub mod config;
pub mod disk;
pub mod driver;
pub mod error;
pub mod failpoint;
pub mod firewall;
#[cfg(feature = "bench")]
pub mod floor;
pub mod jail;
pub mod netaddr;
pub mod netns;
mod process;
pub mod qcow2;
mod qemu;
mod qmp;
pub mod ram;
pub mod reclaim;
pub mod shim;
pub mod snapshot;
mod sparse;
pub mod travel;
mod vm;

pub use config::{Accel, Artifacts, Machine, Paths, RootDisk};
pub use driver::{
    BoxFuture, Capture, CaptureFailed, Driver, Guest, GuestNet, Probe, SnapshotInfo, SnapshotRef,
    SnapshotStore, VmHandle,
};
pub use error::{Error, ErrorKind, Result};
pub use firewall::{EgressRules, Net4};
pub use jail::JailConfig;
pub use process::cpu_time;
pub use snapshot::Snapshot;
pub use vm::{log_tail, QemuDriver, StartOptions, Vm, VmRecord, VmState};

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
