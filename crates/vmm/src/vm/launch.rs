//! Starting a VM's QEMU, for boot and restore alike: its jail and
//! preload, its command line, the process, its QMP connection, and the
//! wait until the guest is ready.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::config::Paths;
use crate::driver::Probe;
use crate::error::{Error, IoContext, Result};
use crate::netns::Netns;
use crate::process::QemuProcess;
use crate::qemu::{self, Launch};
use crate::qmp::Qmp;
use crate::snapshot::Snapshot;

use super::record::save_record;
use super::{console, log_tail, Vm, VmFiles, VmRecord, VmState};

/// How long QEMU may take to open its QMP socket.
const QMP_TIMEOUT: Duration = Duration::from_secs(20);

/// What a launched QEMU starts from, besides its artifacts.
#[derive(Clone, Copy)]
pub(super) enum Origin<'a> {
    /// A cold boot over the base image.
    Boot,
    /// A cold boot over this snapshot's disk.
    Disk(&'a Snapshot),
    /// A restore of this snapshot (its RAM and device state).
    Restore(&'a Snapshot),
}

impl Vm {
    /// Spawn QEMU (jailed unless the jail is off) and connect to its QMP
    /// socket.
    pub(super) async fn launch(
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

    pub(super) async fn wait_ready(
        &mut self,
        timeout: Duration,
        during: &'static str,
    ) -> Result<()> {
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
}

impl VmFiles {
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
        chain_allowed: crate::jail::chain::allowed_disks(
            paths,
            record.disk_over.as_deref(),
            &record.artifacts.rootfs,
        ),
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

pub(super) fn exited(id: &str, files: &VmFiles, status: String, during: &'static str) -> Error {
    Error::QemuExited {
        vm: id.to_string(),
        status,
        during,
        qemu_log: log_tail(&files.qemu_log(), 800),
        console: log_tail(&files.console(), 1500),
    }
}
