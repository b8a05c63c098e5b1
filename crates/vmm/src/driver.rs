//! The seam between the sandbox manager and a VMM: [`Driver`] starts, adopts
//! and cleans up VMs and manages their snapshots; [`VmHandle`] is one VM.
//! QEMU ([`crate::QemuDriver`]) is the one implementation; tests of the
//! server use an in-memory fake. Everything the manager needs to know of a
//! snapshot is data ([`SnapshotInfo`]); what a driver needs to restore one
//! stays inside its [`SnapshotRef`].
//!
//! The driver knows nothing of the agent in the guest: readiness is a
//! [`Probe`] its caller gives, and the caller talks to guest ports
//! through [`GuestNet`].

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::{Artifacts, Machine};
use crate::error::{Error, Result};
use crate::firewall::EgressRules;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One VM's network: connects to its guest's TCP ports, and holds the
/// guest's way out and its firewall.
pub trait GuestNet: Send + Sync {
    fn connect(&self, port: u16) -> BoxFuture<'_, std::io::Result<tokio::net::TcpStream>>;
    /// Replace what the guest may reach (atomically); with `open` false
    /// the rules are loaded but nothing is forwarded yet (a later call with
    /// the same rules and `open` only lets the guest out).
    fn set_egress<'a>(&'a self, rules: &'a EgressRules, open: bool) -> BoxFuture<'a, Result<()>>;
    /// Listen on `port` of the guest's gateway (an egress proxy's end of
    /// [`EgressRules::proxy_port`]).
    fn listen(&self, port: u16) -> std::io::Result<tokio::net::TcpListener>;
    /// Connect to `addr` from the guest's side of the host, so the host's
    /// rules for guests apply (an egress proxy's upstream).
    fn connect_out(
        &self,
        addr: std::net::SocketAddrV4,
    ) -> BoxFuture<'_, std::io::Result<tokio::net::TcpStream>>;
    /// Run `f` on a thread inside the guest's network namespace and wait
    /// for it: sockets it creates belong to that namespace (a server
    /// bound on the gateway address for this guest alone).
    fn run_inside(&self, f: Box<dyn FnOnce() + Send>) -> std::io::Result<()>;
}

/// A VM's guest network, shared with whoever talks to the guest.
pub type Guest = Arc<dyn GuestNet>;

/// One readiness check of a guest (the driver retries it until it passes,
/// the VM dies, or the start's deadline passes).
pub type Probe = Arc<dyn Fn(Guest) -> BoxFuture<'static, bool> + Send + Sync>;

/// Try `probe` on `guest` until it passes (true), or `gone` says the VM
/// died or `timeout` passes (false). Retries back off from 1 to 25 ms.
pub(crate) async fn wait_ready(
    probe: &Probe,
    guest: &Guest,
    timeout: Duration,
    gone: impl Fn() -> bool,
) -> bool {
    let deadline = Instant::now() + timeout;
    let mut delay = Duration::from_millis(1);
    loop {
        if probe(guest.clone()).await {
            return true;
        }
        if gone() || Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(25));
    }
}

/// What the manager knows of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub id: String,
    /// The machine shape every VM restored from it has.
    pub machine: Machine,
    /// RAM layers over its root (0 for a root snapshot such as a template).
    pub layers: usize,
    /// Size of the root filesystem image it runs on.
    pub disk_size_mb: u32,
    /// Bytes of guest pages its RAM layers hold over the root (written
    /// into every VM restored from it, each its own private copy).
    pub layer_bytes: u64,
    /// Bytes its root RAM file holds on disk (its holes left out).
    pub root_ram_bytes: u64,
    /// The root RAM file every VM restored from it maps.
    pub memory_file: std::path::PathBuf,
}

/// An opened snapshot: its [`SnapshotInfo`] and whatever the driver that
/// opened it needs to restore it (held open, so it still restores after
/// garbage collection removed its ancestors' files).
#[derive(Clone)]
pub struct SnapshotRef {
    info: SnapshotInfo,
    inner: Arc<dyn Any + Send + Sync>,
}

impl SnapshotRef {
    pub fn new(info: SnapshotInfo, inner: impl Any + Send + Sync) -> Self {
        Self {
            info,
            inner: Arc::new(inner),
        }
    }
    pub fn info(&self) -> &SnapshotInfo {
        &self.info
    }
    pub fn id(&self) -> &str {
        &self.info.id
    }
    /// The driver's own handle, if this snapshot is of type `T`.
    pub fn inner<T: Any>(&self) -> Option<&T> {
        self.inner.downcast_ref()
    }
}

impl std::fmt::Debug for SnapshotRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.info.fmt(f)
    }
}

/// A capture of a VM that goes on running.
#[derive(Debug, Clone)]
pub struct Capture {
    pub snapshot: SnapshotRef,
    /// How long the vCPUs stood still.
    pub vcpus_stopped: Duration,
}

/// A [`VmHandle::capture_and_kill`] that failed.
pub struct CaptureFailed {
    pub error: Error,
    /// The VM, if the capture failed before its QEMU exited: whole, and
    /// running again if it was running. `None`: it is gone.
    pub vm: Option<Box<dyn VmHandle>>,
}

impl CaptureFailed {
    /// A failure after which the VM is gone.
    pub fn gone(error: Error) -> Self {
        Self { error, vm: None }
    }

    /// For callers that do not keep the VM: remove it, give the error.
    pub async fn discard(self) -> Error {
        if let Some(vm) = self.vm {
            let _ = vm.kill().await;
        }
        self.error
    }
}

/// One VM.
#[async_trait::async_trait]
pub trait VmHandle: Send + Sync {
    fn id(&self) -> &str;
    /// The host process the VM runs in; it changes when a capture moves
    /// the VM into a new one (connections to the old one are gone).
    fn process_id(&self) -> i32;
    /// How the VM's process ended, or `None` while it runs.
    fn exit_status(&self) -> Option<String>;
    /// The file its RAM is mapped from (a snapshot's frozen RAM, which may
    /// be read lazily from a registry: why a VM died can be there).
    fn memory_file(&self) -> Option<std::path::PathBuf>;
    /// Its guest's ports.
    fn guest(&self) -> Guest;
    /// Run a VM that was restored paused, until its guest is ready.
    async fn start(&mut self) -> Result<()>;
    /// Stop its vCPUs (it keeps its memory and process).
    async fn pause(&mut self) -> Result<()>;
    /// Let its vCPUs run if they are stopped (after a pause, or a capture
    /// cut short by a crash of the server); nothing if they run.
    async fn ensure_running(&mut self) -> Result<()>;
    /// If QEMU stopped the guest on its own while it should run (a failed
    /// disk write), run it again and say QEMU's reason (`io-error`, ...).
    async fn check_running(&mut self) -> Result<Option<String>>;
    /// Capture it as snapshot `snapshot_id`; it goes on (running if it was).
    async fn capture(&mut self, snapshot_id: &str) -> Result<Capture>;
    /// Capture it as snapshot `snapshot_id`, then remove it. A capture
    /// that fails while the VM can go on gives it back (a full disk must
    /// not cost the sandbox that was being paused).
    async fn capture_and_kill(
        self: Box<Self>,
        snapshot_id: &str,
    ) -> std::result::Result<SnapshotRef, CaptureFailed>;
    /// Stop it and remove everything it held (its snapshots stay).
    async fn kill(self: Box<Self>) -> Result<()>;
}

/// Starts, restores, adopts and cleans up VMs.
#[async_trait::async_trait]
pub trait Driver: Send + Sync {
    /// Cold-boot VM `id` from `artifacts`; it runs and its guest is ready.
    async fn boot(
        &self,
        id: &str,
        machine: Machine,
        artifacts: &Artifacts,
    ) -> Result<Box<dyn VmHandle>>;
    /// Cold-boot VM `id` over the disk of `snapshot`, with its kernel and
    /// machine but not its memory; it runs and its guest is ready.
    async fn boot_from_disk(&self, id: &str, snapshot: &SnapshotRef) -> Result<Box<dyn VmHandle>>;
    /// Restore VM `id` from `snapshot` with its vCPUs stopped (a warm pool
    /// keeps VMs so); [`VmHandle::start`] runs it.
    async fn restore_paused(&self, id: &str, snapshot: &SnapshotRef) -> Result<Box<dyn VmHandle>>;
    /// Restore VM `id` from `snapshot` and run it until its guest is ready;
    /// nothing of it is left when this fails.
    async fn restore(&self, id: &str, snapshot: &SnapshotRef) -> Result<Box<dyn VmHandle>>;
    /// Take over VM `id`, started by an earlier process.
    async fn adopt(&self, id: &str) -> Result<Box<dyn VmHandle>>;
    /// Remove whatever VM `id` left behind (after a crash or a failed start).
    async fn cleanup(&self, id: &str);
    /// Finish capture `snapshot_id` of VM `id` if a crash cut it short
    /// after the VM's QEMU exited (its disk is in the capture by then);
    /// says whether the capture is whole. Call before [`Driver::cleanup`].
    fn salvage_capture(&self, id: &str, snapshot_id: &str) -> Result<bool>;
    /// What a boot adds to the machine beyond its shape and artifacts
    /// (optional devices, which its snapshots keep): part of a template's
    /// name, so changing it builds the template again.
    fn boot_devices(&self) -> String;
    /// Ids of every VM that has files here.
    fn vm_ids(&self) -> Vec<String>;
    /// The serial console (kernel and agent) of VM `id`.
    fn console_log(&self, id: &str) -> String;
    /// Where this driver keeps snapshots.
    fn snapshots(&self) -> &dyn SnapshotStore;
}

/// Keeps snapshots on disk: opens, measures, deletes, compacts and
/// materializes them, and finds what nothing needs. A [`Driver`] starts VMs
/// from what its store holds ([`Driver::snapshots`]).
#[async_trait::async_trait]
pub trait SnapshotStore: Send + Sync {
    /// Open snapshot `id`, checking that its files are whole.
    fn open_snapshot(&self, id: &str) -> Result<SnapshotRef>;
    /// Delete every file of snapshot `id` (gone already is fine).
    fn delete_snapshot(&self, id: &str) -> Result<()>;
    /// Snapshots with files here that nothing needs: not in `keep`, not
    /// under a VM here, not under a snapshot that is needed, and older
    /// than `grace` (see [`crate::reclaim`]).
    fn unneeded_snapshots(
        &self,
        keep: &std::collections::HashSet<String>,
        grace: Duration,
    ) -> Vec<String>;
    /// Remove temp files of snapshot rewrites (compaction, materializing)
    /// cut short, older than `grace`; returns how many.
    fn remove_stale_temp_files(&self, grace: Duration) -> usize;
    /// Bytes free (to unprivileged writers) where VMs and snapshots are
    /// kept; `None` if unknown.
    fn free_disk_bytes(&self) -> Option<u64>;
    /// Bytes snapshot `id`'s files take on disk (0 if unknown).
    fn snapshot_bytes(&self, id: &str) -> u64;
    /// Fold snapshot `id`'s chain onto its root; returns the root, or `None`
    /// when there was nothing to fold.
    async fn compact(&self, id: &str) -> Result<Option<String>>;
    /// Give snapshot `id` its whole RAM as its own file, so the many VMs
    /// restored from it share its pages; false when it already had it.
    async fn materialize(&self, id: &str) -> Result<bool>;
}
