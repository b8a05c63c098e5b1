//! One microVM: its lifecycle (boot, pause/resume, snapshot, restore,
//! kill) and its files. Captures (snapshots) are in `capture.rs`.
//!
//! ```text
//!            boot / restore
//!                 │
//!                 ▼      pause        
//!            ┌─Running ◀──────▶ Paused
//!   snapshot │    │     resume     │
//!  (stop,save│    │ kill           │ kill
//!  restart as│    ▼                ▼
//!   a clone) └▶ Running         Stopped (process gone, files removed)
//! ```

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::config::{Artifacts, Machine, Paths, RootDisk};
use crate::disk::{self, BackingFormat};
use crate::driver::{Guest, Probe};
use crate::error::{Error, IoContext, Result};
use crate::netns::Netns;
use crate::process::QemuProcess;
use crate::qemu::{self, Launch};
use crate::qmp::Qmp;
use crate::ram::{GuestRam, WriteTracker};
use crate::snapshot::Snapshot;

/// How long a cold boot may take until the agent answers (TCG: 2–3 s).
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a restored VM may take until the agent answers again.
pub const RESTORE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long QEMU may take to open its QMP socket.
const QMP_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VmState {
    Running,
    Paused,
    Stopped,
}

impl VmState {
    pub fn as_str(self) -> &'static str {
        match self {
            VmState::Running => "running",
            VmState::Paused => "paused",
            VmState::Stopped => "stopped",
        }
    }
}

/// What `vm.json` in the VM's directory records, enough to adopt the VM
/// from another process (the CLI, or the server after a restart).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmRecord {
    pub id: String,
    pub pid: i32,
    pub netns: String,
    pub machine: Machine,
    pub artifacts: Artifacts,
    pub extra_cmdline: Vec<String>,
    /// RAM mapped `share=on` (booted) or MAP_PRIVATE over a snapshot's
    /// frozen RAM (restored).
    pub ram_shared: bool,
    pub ram: PathBuf,
    /// The snapshot this VM was restored from, if any (or last captured
    /// in place: its RAM layers are over this one).
    pub parent: Option<String>,
    /// In-place captures so far: which disk overlay QEMU writes to.
    #[serde(default)]
    pub disk_generation: u32,
    /// The uid (and gid) its jailed QEMU runs as; `None`: not jailed.
    #[serde(default)]
    pub uid: Option<u32>,
    /// The snapshot disks its overlay is layered over, nearest first (see
    /// [`crate::snapshot::SnapshotMeta::disk_over`]); `None`: not recorded.
    #[serde(default)]
    pub disk_over: Option<Vec<PathBuf>>,
    /// It has a virtio-balloon reporting free pages (see
    /// [`crate::snapshot::SnapshotMeta::balloon`]).
    #[serde(default)]
    pub balloon: bool,
}

/// Options for boot and restore.
#[derive(Clone)]
pub struct StartOptions {
    /// Tells when the guest is ready (tried until it passes).
    pub probe: Probe,
    /// Extra kernel command-line words (boot only; a restore reuses the
    /// snapshot's).
    pub extra_cmdline: Vec<String>,
    /// Overrides [`BOOT_TIMEOUT`] / [`RESTORE_TIMEOUT`].
    pub ready_timeout: Option<Duration>,
}

impl StartOptions {
    pub fn new(probe: Probe) -> Self {
        Self {
            probe,
            extra_cmdline: Vec::new(),
            ready_timeout: None,
        }
    }
}

pub struct Vm {
    paths: Paths,
    record: VmRecord,
    /// Shared with whoever talks to the guest ([`Vm::guest`]).
    netns: std::sync::Arc<Netns>,
    process: QemuProcess,
    qmp: Qmp,
    state: VmState,
    /// How long the last capture kept the vCPUs stopped.
    last_stop: Option<Duration>,
    /// Tells when the guest is ready after a (re)start.
    probe: Probe,
    /// The pages the guest wrote since its last capture (clones whose QEMU
    /// this process started, with `track_writes`).
    tracker: Option<std::sync::Arc<WriteTracker>>,
    /// Copies the guest's console into its capped log.
    _console: console::ConsoleReader,
}

fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// The last `max` bytes of a log file, as text.
pub fn log_tail(path: &Path, max: usize) -> String {
    let data = std::fs::read(path).unwrap_or_default();
    let start = data.len().saturating_sub(max);
    String::from_utf8_lossy(&data[start..]).trim().to_string()
}

/// Replace `path` with `data` durably: a temp file, fsync, rename, fsync
/// of the directory (≈ 0.5 ms here). A crash leaves the old file or the
/// new one, never a torn one or a rename that did not reach the disk.
/// The `meta.json` of capture `snap_id` of the VM `record` describes, whose
/// files are in `dir` (its device state checksummed).
fn capture_meta(
    record: &VmRecord,
    snap_id: &str,
    dir: &Path,
    parent: Option<String>,
    disk_over: Option<Vec<PathBuf>>,
) -> Result<crate::snapshot::SnapshotMeta> {
    let state = dir.join("state");
    let state_crc =
        crate::checksum::file_crc(&state).ctx(|| format!("reading {}", state.display()))?;
    let mut checksums = std::collections::BTreeMap::from([("state".to_string(), state_crc)]);
    // A root snapshot's RAM file (a booted VM's, frozen).
    let ram = dir.join("ram");
    if ram.exists() {
        let crc = crate::checksum::sparse_crc(&ram).ctx(|| format!("reading {}", ram.display()))?;
        checksums.insert("ram".to_string(), crc);
    }
    Ok(crate::snapshot::SnapshotMeta {
        version: crate::snapshot::META_VERSION,
        id: snap_id.to_string(),
        source_vm: record.id.clone(),
        machine: record.machine,
        artifacts: record.artifacts.clone(),
        extra_cmdline: record.extra_cmdline.clone(),
        created_unix_ms: unix_ms(),
        parent,
        disk_over,
        checksums,
        balloon: record.balloon,
    })
}

/// State that must survive a crash: written through [`tine_durable`].
pub(crate) fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    tine_durable::write(path, data).ctx(|| format!("storing {}", path.display()))
}

fn remove_dir(path: &Path) -> Result<()> {
    match std::fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::Io {
            context: format!("removing {}", path.display()),
            source: e,
        }),
    }
}

/// Files of one VM. The VM directory is tine's (QEMU may only open its
/// disk overlays there); the RAM directory is QEMU's own (its RAM file,
/// sockets and pidfile), so a jailed QEMU can change nothing tine reads
/// back as its own record.
struct VmFiles {
    dir: PathBuf,
    ram_dir: PathBuf,
}

impl VmFiles {
    fn new(paths: &Paths, id: &str) -> Self {
        Self {
            dir: paths.vm_dir(id),
            ram_dir: paths.vm_ram_dir(id),
        }
    }
    /// The first disk overlay.
    fn disk(&self) -> PathBuf {
        self.disk_generation(0)
    }
    /// The overlay after `generation` in-place captures. Each capture
    /// stacks a new file; none is renamed, because QEMU reopens images by
    /// name (read-only, when they become a backing file).
    fn disk_generation(&self, generation: u32) -> PathBuf {
        match generation {
            0 => self.dir.join("disk.qcow2"),
            n => self.dir.join(format!("disk-{n}.qcow2")),
        }
    }
    fn qmp(&self) -> PathBuf {
        self.ram_dir.join("qmp.sock")
    }
    fn console_socket(&self) -> PathBuf {
        self.ram_dir.join("console.sock")
    }
    fn console(&self) -> PathBuf {
        self.dir.join("console.log")
    }
    fn qemu_log(&self) -> PathBuf {
        self.dir.join("qemu.log")
    }
    fn pidfile(&self) -> PathBuf {
        self.ram_dir.join("qemu.pid")
    }
    fn record(&self) -> PathBuf {
        self.dir.join("vm.json")
    }
    /// Where QEMU saves device state during a capture (made by tine and
    /// owned by QEMU's uid; then moved into the snapshot).
    fn state_saving(&self) -> PathBuf {
        self.dir.join("state.saving")
    }

    /// QEMU's command line for `record`: a booted VM maps its RAM shared
    /// and boots; a restored one maps its root RAM privately and waits for
    /// its device state.
    fn launch(&self, record: &VmRecord) -> Launch {
        Launch {
            machine: record.machine,
            artifacts: record.artifacts.clone(),
            disk: self.disk_generation(record.disk_generation),
            disk_readonly: false,
            ram: record.ram.clone(),
            ram_shared: record.ram_shared,
            ram_guarded: false,
            balloon: record.balloon,
            qmp_socket: self.qmp(),
            console: qemu::Console::Socket(self.console_socket()),
            pidfile: self.pidfile(),
            incoming: !record.ram_shared,
            extra_cmdline: record.extra_cmdline.clone(),
            tap_fd: None,
            seccomp: record.uid.is_some(),
        }
    }
}

mod capture;
mod console;
mod driver;
mod salvage;

pub use driver::QemuDriver;

impl Vm {
    fn files(&self) -> VmFiles {
        VmFiles::new(&self.paths, &self.record.id)
    }

    /// The disk overlay QEMU writes to now.
    fn active_disk(&self) -> PathBuf {
        self.files().disk_generation(self.record.disk_generation)
    }

    pub fn id(&self) -> &str {
        &self.record.id
    }
    pub fn state(&self) -> VmState {
        self.state
    }
    /// Whether its next capture reads only the pages written since the
    /// last one ([`crate::ram::tracker`]).
    pub fn tracks_writes(&self) -> bool {
        self.tracker.as_ref().is_some_and(|t| t.armed())
    }
    /// How long the vCPUs stood still during the last in-place capture.
    pub fn last_capture_stop(&self) -> Option<Duration> {
        self.last_stop
    }
    pub fn record(&self) -> &VmRecord {
        &self.record
    }
    pub fn pid(&self) -> i32 {
        self.process.pid()
    }
    /// How QEMU ended, or `None` while it runs.
    pub fn exit_status(&self) -> Option<String> {
        self.process.exit_status()
    }
    pub fn netns(&self) -> &Netns {
        &self.netns
    }
    /// The guest's ports, reachable without holding the VM.
    pub fn guest(&self) -> Guest {
        self.netns.clone()
    }
    pub fn console_log(&self) -> PathBuf {
        self.files().console()
    }
    pub fn dir(&self) -> PathBuf {
        self.files().dir
    }

    /// Cold-boot a VM from kernel + initramfs + a read-only rootfs image,
    /// and wait until its agent answers.
    pub async fn boot(
        paths: &Paths,
        id: &str,
        machine: Machine,
        artifacts: &Artifacts,
        mut opts: StartOptions,
    ) -> Result<Vm> {
        // The clock words go into the VM's record and its snapshots'
        // meta, so a cold boot from a snapshot's disk gets them again.
        let mut words = crate::qemu::guest_clock_cmdline(paths, machine.accel);
        words.append(&mut opts.extra_cmdline);
        opts.extra_cmdline = words;
        Vm::boot_over(paths, id, machine, artifacts, Origin::Boot, opts).await
    }

    /// Cold-boot a VM over the disk of `snapshot` (its memory is not
    /// used): what a sandbox paused without its memory resumes as.
    pub async fn boot_from_disk(
        paths: &Paths,
        id: &str,
        snapshot: &crate::snapshot::Snapshot,
        opts: StartOptions,
    ) -> Result<Vm> {
        let opts = StartOptions {
            extra_cmdline: snapshot.meta.extra_cmdline.clone(),
            ..opts
        };
        Vm::boot_over(
            paths,
            id,
            snapshot.meta.machine,
            &snapshot.meta.artifacts,
            Origin::Disk(snapshot),
            opts,
        )
        .await
    }

    /// Cold-boot with a new overlay over the disk of `origin`'s snapshot,
    /// or over the artifacts' rootfs for [`Origin::Boot`].
    async fn boot_over(
        paths: &Paths,
        id: &str,
        machine: Machine,
        artifacts: &Artifacts,
        origin: Origin<'_>,
        opts: StartOptions,
    ) -> Result<Vm> {
        let disk = match origin {
            Origin::Disk(s) | Origin::Restore(s) => Some(s.disk_path()),
            Origin::Boot => None,
        };
        let artifacts = artifacts.resolve()?;
        let files = VmFiles::new(paths, id);
        let ram_dir = paths.vm_ram_dir(id);
        prepare_dirs(&files.dir, &ram_dir)?;
        let ram = ram_dir.join("ram");
        let result = async {
            match (&disk, &artifacts.rootfs) {
                (Some(qcow2), _) => {
                    disk::create_overlay(qcow2, BackingFormat::Qcow2, &files.disk()).await?
                }
                (None, RootDisk::File(p)) => {
                    disk::create_overlay(p, BackingFormat::Raw, &files.disk()).await?
                }
                // Not opened here: the daemon may start later than this.
                (None, nbd) => {
                    let size = nbd.size().unwrap_or_default();
                    disk::create_overlay_unchecked(
                        nbd.backing(),
                        BackingFormat::Raw,
                        &files.disk(),
                        size,
                    )
                    .await?
                }
            }
            let netns = Netns::create(id).await?;
            let record = VmRecord {
                id: id.to_string(),
                pid: 0,
                netns: netns.name().to_string(),
                machine,
                artifacts: artifacts.clone(),
                extra_cmdline: opts.extra_cmdline.clone(),
                ram_shared: true,
                ram: ram.clone(),
                parent: None,
                disk_generation: 0,
                uid: None,
                disk_over: match origin {
                    Origin::Boot => Some(Vec::new()),
                    Origin::Disk(s) | Origin::Restore(s) => s.disk_lineage(),
                },
                balloon: paths.balloon,
            };
            let mut vm = Vm::launch(
                paths,
                record,
                netns,
                opts.probe.clone(),
                "during boot",
                origin,
            )
            .await?;
            vm.state = VmState::Running;
            vm.wait_ready(opts.ready_timeout.unwrap_or(BOOT_TIMEOUT), "during boot")
                .await?;
            Ok(vm)
        }
        .await;
        if result.is_err() {
            cleanup(paths, id).await;
        }
        result
    }

    /// Start a clone of `snapshot`: its RAM file mapped MAP_PRIVATE, a new
    /// overlay over its frozen disk, its device state loaded over QMP.
    pub async fn restore(
        paths: &Paths,
        id: &str,
        snapshot: &Snapshot,
        opts: StartOptions,
    ) -> Result<Vm> {
        let t = Instant::now();
        let mut vm = Vm::restore_paused(paths, id, snapshot, opts.probe.clone()).await?;
        let loaded = t.elapsed();
        let started = vm.start_restored(opts.ready_timeout).await;
        if started.is_err() {
            cleanup(paths, id).await;
        }
        started?;
        tracing::debug!(
            vm = id,
            loaded_ms = loaded.as_secs_f64() * 1e3,
            ready_ms = t.elapsed().as_secs_f64() * 1e3,
            "restored"
        );
        Ok(vm)
    }

    /// The first half of [`Vm::restore`]: namespace, overlay, QEMU and the
    /// device state loaded, vCPUs not yet running (state `Paused`). A warm
    /// pool keeps VMs in this state; [`Vm::start_restored`] finishes.
    pub async fn restore_paused(
        paths: &Paths,
        id: &str,
        snapshot: &Snapshot,
        probe: Probe,
    ) -> Result<Vm> {
        let files = VmFiles::new(paths, id);
        prepare_dirs(&files.dir, &paths.vm_ram_dir(id))?;
        let result = async {
            let t = Instant::now();
            let netns = Netns::create(id).await?;
            tracing::debug!(
                vm = id,
                netns_ms = t.elapsed().as_secs_f64() * 1e3,
                "namespace ready"
            );
            Vm::launch_clone(paths, id, netns, snapshot, probe).await
        }
        .await;
        if result.is_err() {
            cleanup(paths, id).await;
        }
        result
    }

    /// Run a VM from [`Vm::restore_paused`] and wait until its agent answers.
    pub async fn start_restored(&mut self, ready_timeout: Option<Duration>) -> Result<()> {
        self.resume().await?;
        self.wait_ready(ready_timeout.unwrap_or(RESTORE_TIMEOUT), "after restore")
            .await
    }

    /// Spawn QEMU for a clone of `snapshot` in `netns` and load the device
    /// state; the clone stays paused.
    async fn launch_clone(
        paths: &Paths,
        id: &str,
        netns: Netns,
        snapshot: &Snapshot,
        probe: Probe,
    ) -> Result<Vm> {
        let files = VmFiles::new(paths, id);
        let t = Instant::now();
        let _ = std::fs::remove_file(files.disk());
        disk::OverlayCache::new(paths.overlay_cache_dir())
            .create_overlay(&snapshot.disk_path(), &files.disk())
            .await?;
        let t_overlay = t.elapsed();
        let meta = &snapshot.meta;
        let record = VmRecord {
            id: id.to_string(),
            pid: 0,
            netns: netns.name().to_string(),
            machine: meta.machine,
            artifacts: meta.artifacts.clone(),
            extra_cmdline: meta.extra_cmdline.clone(),
            ram_shared: false,
            ram: snapshot.ram.clone(),
            parent: Some(meta.id.clone()),
            disk_generation: 0,
            uid: None,
            disk_over: snapshot.disk_lineage(),
            balloon: meta.balloon,
        };
        let mut vm = Vm::launch(
            paths,
            record,
            netns,
            probe,
            "while restoring",
            Origin::Restore(snapshot),
        )
        .await?;
        let t_qmp = t.elapsed();
        if let Err(e) = vm.write_layers(snapshot).await {
            vm.process.kill().await;
            return Err(e);
        }
        let t_layers = t.elapsed();
        // Its RAM is now exactly the snapshot's: what it writes from here
        // on is what its next capture must look at.
        vm.tracker = vm.open_tracking(false).await;
        let t_tracked = t.elapsed();
        let state = snapshot.state_path();
        let loaded = async {
            vm.qmp
                .run(
                    "migrate-incoming",
                    Some(json!({ "uri": format!("file:{}", state.display()) })),
                )
                .await?;
            vm.qmp.wait_migration("loading the device state").await
        }
        .await;
        if let Err(e) = loaded {
            // QEMU usually exits when a stream is bad; report its own words.
            let _ = tokio::time::timeout(Duration::from_secs(2), vm.process.wait()).await;
            return Err(Error::Snapshot {
                path: snapshot.dir.clone(),
                detail: format!(
                    "QEMU could not load the device state: {e}; QEMU said: {:?}",
                    log_tail(&vm.files().qemu_log(), 600)
                ),
            });
        }
        // Loaded but not running (`-S`).
        vm.state = VmState::Paused;
        tracing::debug!(
            vm = id,
            overlay_ms = t_overlay.as_secs_f64() * 1e3,
            qemu_qmp_ms = (t_qmp - t_overlay).as_secs_f64() * 1e3,
            layers_ms = (t_layers - t_qmp).as_secs_f64() * 1e3,
            tracking_ms = (t_tracked - t_layers).as_secs_f64() * 1e3,
            migrate_ms = (t.elapsed() - t_tracked).as_secs_f64() * 1e3,
            tracked = vm.tracker.is_some(),
            "clone loaded"
        );
        Ok(vm)
    }

    /// Write the snapshot's RAM layers into a clone that has not run yet
    /// (its QEMU maps the root RAM file MAP_PRIVATE).
    async fn write_layers(&self, snapshot: &Snapshot) -> Result<()> {
        if snapshot.layers.is_empty() {
            return Ok(());
        }
        let t = Instant::now();
        let snapshot = snapshot.clone();
        let pid = self.pid();
        let pages = crate::blocking(move || snapshot.write_ram_layers(pid)).await?;
        tracing::debug!(
            vm = self.id(),
            pages,
            ms = t.elapsed().as_secs_f64() * 1e3,
            "RAM layers written"
        );
        Ok(())
    }

    /// Track the writes of this clone: one that has not run yet (its RAM
    /// is its snapshot's, so tracking starts armed), or one `adopted` from
    /// another tine process (disarmed until its next capture). Without the
    /// shim's userfaultfd, or if the kernel refuses, its captures compare
    /// every private page instead.
    async fn open_tracking(&self, adopted: bool) -> Option<std::sync::Arc<WriteTracker>> {
        let keep = self.paths.track_writes;
        if self.record.ram_shared || (!adopted && !keep) || !crate::ram::tracker::supported() {
            return None;
        }
        let pid = self.pid();
        let root = self.record.ram.clone();
        let bytes = u64::from(self.record.machine.memory_mib) << 20;
        let opened = crate::blocking(move || {
            let ram = GuestRam::find(pid, &root, bytes)
                .ctx(|| format!("finding the guest RAM of QEMU {pid}"))?;
            let t = if adopted {
                WriteTracker::reattach(&ram)
            } else {
                WriteTracker::attach(&ram)
            };
            let t = t.ctx(|| format!("tracking the writes of QEMU {pid}"))?;
            match t {
                // Adopted with tracking now off: lift the old protection,
                // whose markers would read as swapped pages to the compare.
                Some(t) if !keep => t
                    .protect_all(false)
                    .map(|()| None)
                    .ctx(|| format!("lifting QEMU {pid}'s write protection")),
                t => Ok(t),
            }
        })
        .await;
        match opened {
            Ok(t) => {
                if t.is_none() && keep {
                    tracing::debug!(vm = self.id(), "QEMU has no userfaultfd: no write tracking");
                }
                t.map(std::sync::Arc::new)
            }
            Err(e) => {
                tracing::warn!(
                    vm = self.id(),
                    "no write tracking; captures compare every page: {e}"
                );
                None
            }
        }
    }

    fn save_record(&self) -> Result<()> {
        save_record(&self.files(), &self.record)
    }

    /// Spawn QEMU (jailed unless the jail is off) and connect to its QMP
    /// socket.
    async fn launch(
        paths: &Paths,
        mut record: VmRecord,
        netns: Netns,
        probe: Probe,
        during: &'static str,
        origin: Origin<'_>,
    ) -> Result<Vm> {
        let files = VmFiles::new(paths, &record.id);
        let _ = std::fs::remove_file(files.qmp());
        let _ = std::fs::remove_file(files.console_socket());
        let binary = resolve_binary(&qemu::binary());
        let t = Instant::now();
        let preload = preload_for(paths, &record);
        let jail = if paths.jail.enabled {
            Some(std::sync::Arc::new(prepare_jail(
                paths,
                &files,
                &mut record,
                origin,
                &binary,
                preload.as_ref().map(|p| p.lib.as_path()),
            )?))
        } else {
            None
        };
        let tap = netns
            .open_tap()
            .ctx(|| format!("opening the tap of {}", netns.name()))?;
        tracing::debug!(
            vm = %record.id,
            jail_ms = t.elapsed().as_secs_f64() * 1e3,
            "jail and tap ready"
        );
        let mut launch = files.launch(&record);
        launch.tap_fd = Some(tap.as_raw_fd());
        launch.ram_guarded = preload.as_ref().is_some_and(|p| p.guard_ram.is_some());
        let process = QemuProcess::spawn(
            &binary.display().to_string(),
            &qemu::args(&launch),
            &netns,
            &files.qemu_log(),
            jail.clone(),
            Some(tap.as_raw_fd()),
            preload.as_ref(),
        )?;
        drop(tap);
        record.pid = process.pid();
        // Into its cgroup while it starts (see `Prepared::join_cgroup`).
        let pid = process.pid();
        let joining = jail.map(|j| tokio::task::spawn_blocking(move || j.join_cgroup(pid)));
        save_record(&files, &record)?;
        let deadline = Instant::now() + QMP_TIMEOUT;
        let qmp = loop {
            if let Some(status) = process.exit_status() {
                return Err(exited(&record.id, &files, status, during));
            }
            match Qmp::connect(&files.qmp(), pid).await {
                Ok(q) => break q,
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(1)).await
                }
                Err(e) => return Err(e.into()),
            }
        };
        if launch.ram_guarded {
            let ram = record.ram.clone();
            let checked = crate::blocking(move || {
                crate::shim::check_read_only(pid, &ram)
                    .ctx(|| format!("checking how QEMU {pid} opened {}", ram.display()))
            })
            .await;
            if let Err(e) = checked {
                process.kill().await;
                return Err(e);
            }
        }
        if let Some(joining) = joining {
            let joined = joining.await.map_err(|e| Error::Io {
                context: "joining the cgroup".into(),
                source: std::io::Error::other(e.to_string()),
            })?;
            if let Err(e) = joined {
                process.kill().await;
                return Err(e).ctx(|| format!("moving QEMU {pid} into its cgroup"));
            }
        }
        let console = console::start(
            files.console_socket(),
            pid,
            files.console(),
            paths.jail.console_max_bytes,
        );
        Ok(Vm {
            paths: paths.clone(),
            record,
            netns: std::sync::Arc::new(netns),
            process,
            qmp,
            state: VmState::Paused,
            last_stop: None,
            probe,
            tracker: None,
            _console: console,
        })
    }

    async fn wait_ready(&mut self, timeout: Duration, during: &'static str) -> Result<()> {
        if self.poll_ready(timeout).await {
            return Ok(());
        }
        let files = self.files();
        if let Some(status) = self.process.exit_status() {
            return Err(exited(self.id(), &files, status, during));
        }
        Err(Error::NotReady {
            vm: self.id().to_string(),
            secs: timeout.as_secs(),
            console: log_tail(&files.console(), 1500),
        })
    }

    /// Try the probe until it passes (true), QEMU exits or `timeout`
    /// passes (false).
    async fn poll_ready(&self, timeout: Duration) -> bool {
        let process = &self.process;
        let gone = || process.exit_status().is_some();
        crate::driver::wait_ready(&self.probe, &self.guest(), timeout, gone).await
    }

    /// Stop the vCPUs (the VM keeps its memory and process).
    pub async fn pause(&mut self) -> Result<()> {
        self.require(&[VmState::Running], "pause")?;
        self.qmp.run("stop", None).await?;
        self.state = VmState::Paused;
        Ok(())
    }

    /// Run the vCPUs again after [`Vm::pause`].
    pub async fn resume(&mut self) -> Result<()> {
        self.require(&[VmState::Paused], "resume")?;
        self.qmp.run("cont", None).await?;
        self.state = VmState::Running;
        Ok(())
    }

    /// If QEMU stopped the guest on its own while tine has it running (a
    /// disk write failed: QEMU's `werror=enospc` stops the guest rather
    /// than fail the write), let it run again and say why it had stopped
    /// (QEMU's run state, such as `io-error`). `None`: it runs, or tine
    /// stopped it.
    pub async fn check_running(&mut self) -> Result<Option<String>> {
        if self.state != VmState::Running || self.process.exit_status().is_some() {
            return Ok(None);
        }
        #[derive(serde::Deserialize)]
        struct Status {
            running: bool,
            status: String,
        }
        let st: Status = self.qmp.execute("query-status", None).await?;
        if st.running {
            return Ok(None);
        }
        tracing::warn!(vm = self.id(), status = %st.status, "QEMU had stopped the guest; continuing it");
        self.qmp.run("cont", None).await?;
        Ok(Some(st.status))
    }

    fn require(&self, allowed: &[VmState], op: &'static str) -> Result<()> {
        if let Some(status) = self.process.exit_status() {
            return Err(exited(self.id(), &self.files(), status, "unexpectedly"));
        }
        if allowed.contains(&self.state) {
            Ok(())
        } else {
            Err(Error::InvalidState {
                vm: self.id().to_string(),
                state: self.state.as_str(),
                op,
            })
        }
    }

    /// Kill QEMU and remove everything that belongs to this VM: process,
    /// namespace (with its tap), directory and RAM file. Snapshots taken
    /// from it stay.
    pub async fn kill(self) -> Result<()> {
        self.process.kill().await;
        drop(self.qmp);
        let id = self.record.id.clone();
        let paths = self.paths.clone();
        let netns = self.netns.name().to_string();
        drop(self.netns);
        crate::jail::release(&paths.jail, &paths.data_dir, &id);
        crate::netns::delete_by_name(&netns).await?;
        remove_dir(&paths.vm_dir(&id))?;
        remove_dir(&paths.vm_ram_dir(&id))?;
        Ok(())
    }

    /// Take over a VM that another process started (its `vm.json`).
    pub async fn adopt(paths: &Paths, id: &str, probe: Probe) -> Result<Vm> {
        let files = VmFiles::new(paths, id);
        let bytes = std::fs::read(files.record())
            .ctx(|| format!("no VM {id} ({})", files.record().display()))?;
        let record: VmRecord = serde_json::from_slice(&bytes).map_err(|e| Error::Io {
            context: format!("{} is corrupt", files.record().display()),
            source: e.into(),
        })?;
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", record.pid)).unwrap_or_default();
        let needle = files.qmp().display().to_string();
        if !String::from_utf8_lossy(&cmdline).contains(&needle) {
            return Err(Error::QemuExited {
                vm: id.to_string(),
                status: format!("pid {} is gone", record.pid),
                during: "before it was adopted",
                qemu_log: log_tail(&files.qemu_log(), 600),
                console: log_tail(&files.console(), 600),
            });
        }
        let process = QemuProcess::adopt(record.pid)?;
        let netns = Netns::open(&record.netns)?;
        let mut qmp = Qmp::connect(&files.qmp(), record.pid).await?;
        let status: serde_json::Value = qmp.execute("query-status", None).await?;
        let state = if status["running"].as_bool() == Some(true) {
            VmState::Running
        } else {
            VmState::Paused
        };
        let console = console::start(
            files.console_socket(),
            record.pid,
            files.console(),
            paths.jail.console_max_bytes,
        );
        let mut vm = Vm {
            paths: paths.clone(),
            record,
            netns: std::sync::Arc::new(netns),
            process,
            qmp,
            state,
            last_stop: None,
            probe,
            tracker: None,
            _console: console,
        };
        vm.reconcile_disk().await?;
        vm.tracker = vm.open_tracking(true).await;
        Ok(vm)
    }

    /// After a crash between a capture's disk seal and its record's save,
    /// QEMU writes to the next overlay while the record names the one
    /// before: ask QEMU which file it writes and catch the record up.
    async fn reconcile_disk(&mut self) -> Result<()> {
        let blocks: serde_json::Value = self.qmp.execute("query-block", None).await?;
        let Some(root) = blocks
            .as_array()
            .and_then(|b| b.iter().find(|d| d["device"] == "root"))
        else {
            return Ok(());
        };
        // The top image's file: a plain path, or (its backing opened by
        // another name than its header's) a `json:` description.
        let writes =
            root["inserted"]["file"]
                .as_str()
                .and_then(|f| match f.strip_prefix("json:") {
                    Some(spec) => serde_json::from_str::<serde_json::Value>(spec)
                        .ok()
                        .and_then(|v| v["file"]["filename"].as_str().map(PathBuf::from)),
                    None => Some(PathBuf::from(f)),
                });
        let next = self
            .files()
            .disk_generation(self.record.disk_generation + 1);
        if writes.as_deref() != Some(next.as_path()) {
            return Ok(());
        }
        // The sealed overlay under it, as its header names it.
        let sealed = root["inserted"]["image"]["backing-filename"]
            .as_str()
            .map(PathBuf::from);
        tracing::warn!(
            vm = self.id(),
            generation = self.record.disk_generation + 1,
            "QEMU writes to a newer disk overlay than its record named (a capture cut short): record updated"
        );
        self.record.disk_generation += 1;
        self.record.disk_over = match (self.record.disk_over.take(), sealed) {
            (Some(below), Some(sealed)) => Some(std::iter::once(sealed).chain(below).collect()),
            _ => None,
        };
        self.save_record()
    }
}

/// `binary` as a path: itself if it names one, else found on `PATH`.
fn resolve_binary(binary: &str) -> PathBuf {
    if binary.contains('/') {
        return PathBuf::from(binary);
    }
    std::env::var_os("PATH")
        .and_then(|path| {
            std::env::split_paths(&path)
                .map(|d| d.join(binary))
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| PathBuf::from(binary))
}

/// What a launched QEMU starts from, besides its artifacts.
#[derive(Clone, Copy)]
enum Origin<'a> {
    /// A cold boot over the base image.
    Boot,
    /// A cold boot over this snapshot's disk.
    Disk(&'a Snapshot),
    /// A restore of this snapshot (its RAM and device state).
    Restore(&'a Snapshot),
}

/// The files the backing chain of an overlay made over the snapshot disks
/// `disk_over` (nearest first) may name: those disks and the base image
/// `rootfs`. The chain is read from qcow2 headers, which a VM
/// that was captured could have written; nothing else is let into its
/// jail or read by tine. For an overlay over a snapshot from before tine
/// recorded that (`None`), any snapshot's disk.
pub(crate) fn allowed_disks(
    paths: &Paths,
    disk_over: Option<&[PathBuf]>,
    rootfs: &RootDisk,
) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = match disk_over {
        Some(disks) => disks.to_vec(),
        None => std::fs::read_dir(paths.snapshots_dir())
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path().join("disk.qcow2"))
            .collect(),
    };
    out.push(match rootfs {
        RootDisk::File(p) => p.clone(),
        RootDisk::Nbd { socket, .. } => socket.clone(),
    });
    out
}

/// Claim the VM's uid (a restart of the same VM keeps it), hand it its
/// files and plan its jail. The VM directory stays tine's (`root:<gid>`,
/// `0710`: QEMU may open its overlays there, not add or remove files).
fn prepare_jail(
    paths: &Paths,
    files: &VmFiles,
    record: &mut VmRecord,
    origin: Origin<'_>,
    binary: &Path,
    preload: Option<&Path>,
) -> Result<crate::jail::Prepared> {
    use crate::jail;
    let cfg = &paths.jail;
    let uid = match record.uid {
        Some(uid) => uid,
        None => jail::uids::claim(
            &paths.data_dir,
            &paths.vms_dir(),
            &record.id,
            cfg.uid_base,
            cfg.uid_count,
        )?,
    };
    record.uid = Some(uid);
    let disk = files.disk_generation(record.disk_generation);
    std::os::unix::fs::chown(&files.dir, Some(0), Some(uid))
        .ctx(|| format!("chown {}", files.dir.display()))?;
    std::fs::set_permissions(
        &files.dir,
        std::os::unix::fs::PermissionsExt::from_mode(0o710),
    )
    .ctx(|| format!("chmod {}", files.dir.display()))?;
    jail::own(&files.ram_dir, uid, 0o700)?;
    jail::own(&disk, uid, 0o600)?;
    let mut ro = vec![
        record.artifacts.kernel.clone(),
        record.artifacts.initramfs.clone(),
    ];
    if !record.ram_shared {
        ro.push(record.ram.clone());
    }
    if let Origin::Restore(s) = origin {
        ro.push(s.state_path());
    }
    ro.extend(preload.map(Path::to_path_buf));
    let binary = std::fs::canonicalize(binary)
        .ok()
        .filter(|b| !b.starts_with("/usr"));
    let needs = jail::Needs {
        rw_dirs: vec![files.dir.clone(), files.ram_dir.clone()],
        ro_files: ro,
        disk: Some(disk),
        chain_allowed: allowed_disks(paths, record.disk_over.as_deref(), &record.artifacts.rootfs),
        binary,
    };
    jail::Prepared::new(
        cfg,
        &paths.data_dir,
        &record.id,
        uid,
        &record.machine,
        &needs,
    )
}

/// What a clone's QEMU preloads ([`crate::shim`]): the shim, for write
/// tracking ([`crate::ram::tracker`]) and, with a balloon, to guard its
/// RAM file. `None` for booted VMs (their capture is the whole RAM file),
/// when neither is wanted, or if the shim cannot be written (the clone
/// then runs without tracking, and its balloon's discards fail).
fn preload_for(paths: &Paths, record: &VmRecord) -> Option<crate::shim::Preload> {
    if record.ram_shared {
        return None;
    }
    let track = paths.track_writes && {
        let ok = crate::ram::tracker::supported();
        if !ok {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                tracing::warn!(
                    "no write tracking on this host: its kernel has no asynchronous userfaultfd \
                     write-protection (UFFD_FEATURE_WP_ASYNC, Linux 6.7); captures compare every \
                     private page"
                )
            });
        }
        ok
    };
    if !track && !record.balloon {
        return None;
    }
    let lib = crate::shim::install(&paths.lib_dir())
        .inspect_err(|e| {
            tracing::warn!(
                dir = %paths.lib_dir().display(),
                "cannot write the QEMU shim; no write tracking, no memory given back: {e}"
            )
        })
        .ok()?;
    Some(crate::shim::Preload {
        lib,
        guard_ram: record.balloon.then(|| record.ram.clone()),
    })
}

fn save_record(files: &VmFiles, record: &VmRecord) -> Result<()> {
    write_atomic(
        &files.record(),
        &serde_json::to_vec_pretty(record).expect("record serializes"),
    )
}

fn prepare_dirs(dir: &Path, ram_dir: &Path) -> Result<()> {
    if dir.exists() {
        return Err(Error::Io {
            context: format!("VM directory {}", dir.display()),
            source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
        });
    }
    std::fs::create_dir_all(dir).ctx(|| format!("creating {}", dir.display()))?;
    std::fs::create_dir_all(ram_dir).ctx(|| format!("creating {}", ram_dir.display()))
}

fn exited(id: &str, files: &VmFiles, status: String, during: &'static str) -> Error {
    Error::QemuExited {
        vm: id.to_string(),
        status,
        during,
        qemu_log: log_tail(&files.qemu_log(), 800),
        console: log_tail(&files.console(), 1500),
    }
}

/// Remove whatever VM `id` left behind (process, namespace, files), for
/// failed starts and for cleaning up after a crash.
/// The pid of VM `id`'s QEMU, if one runs (its pidfile names a process
/// whose command line names the VM's directory).
fn cleanup_pid(paths: &Paths, id: &str) -> Option<i32> {
    let dir = paths.vm_dir(id);
    let pid = std::fs::read_to_string(VmFiles::new(paths, id).pidfile()).ok()?;
    let pid = pid.trim().parse::<i32>().ok()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    String::from_utf8_lossy(&cmdline)
        .contains(&dir.display().to_string())
        .then_some(pid)
}

pub(crate) use salvage::salvage_capture;

pub(crate) async fn cleanup(paths: &Paths, id: &str) {
    let dir = paths.vm_dir(id);
    if let Some(pid) = cleanup_pid(paths, id) {
        if let Ok(p) = QemuProcess::adopt(pid) {
            p.kill().await;
        }
    }
    let _ = crate::netns::delete_by_name(&crate::netns::name_of(id)).await;
    crate::jail::release(&paths.jail, &paths.data_dir, id);
    let _ = remove_dir(&dir);
    let _ = remove_dir(&paths.vm_ram_dir(id));
}

/// IDs of all VMs that have a directory.
pub(crate) fn list(paths: &Paths) -> Vec<String> {
    let mut ids: Vec<String> = std::fs::read_dir(paths.vms_dir())
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    ids.sort();
    ids
}
