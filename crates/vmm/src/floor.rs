//! The floor of every restore: `qemu-system-x86_64` spawned by hand with a
//! snapshot's own files, `migrate-incoming` of its device state, `cont`,
//! until the agent answers `GET /health`. Nothing of tine's lifecycle
//! code runs here; only the same QEMU command line (`qemu::args`). Built
//! for `tine bench` only (feature `bench`).
//!
//! The namespace and the qcow2 overlay are made before the clock starts
//! (they are timed too, as their own stages): the floor is what QEMU and
//! the guest need, the rest is what tine adds.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::disk::{self, BackingFormat};
use crate::driver::{Guest, Probe};
use crate::error::{Error, IoContext, Result};
use crate::netns::Netns;
use crate::process::QemuProcess;
use crate::qemu::{self, Launch};
use crate::qmp::Qmp;
use crate::{Paths, Snapshot};

fn failed(detail: impl Into<String>) -> Error {
    Error::Io {
        context: "restore by hand".into(),
        source: std::io::Error::other(detail.into()),
    }
}

/// Stages of one restore by hand, in ms.
#[derive(Debug, Clone, Default)]
pub struct FloorStages {
    pub netns: f64,
    pub overlay: f64,
    /// Spawn until the QMP greeting was read.
    pub spawn_qmp: f64,
    /// `migrate-incoming` until `query-migrate` says completed.
    pub migrate: f64,
    pub cont: f64,
    /// `cont` until the first 2xx of `/health`.
    pub first_reply: f64,
}

impl FloorStages {
    /// The floor: QEMU spawn + QMP + migrate-incoming + cont + first reply.
    pub fn floor(&self) -> f64 {
        self.spawn_qmp + self.migrate + self.cont + self.first_reply
    }

    pub fn named(&self) -> [(&'static str, f64); 6] {
        [
            ("by hand: netns (outside the floor)", self.netns),
            ("by hand: overlay (outside the floor)", self.overlay),
            ("by hand: QEMU spawn → QMP greeting", self.spawn_qmp),
            ("by hand: migrate-incoming (device state)", self.migrate),
            ("by hand: cont", self.cont),
            ("by hand: cont → first /health reply", self.first_reply),
        ]
    }
}

/// A VM started by hand; [`HandVm::kill`] removes all of it.
pub struct HandVm {
    netns: Netns,
    process: Option<QemuProcess>,
    dir: PathBuf,
}

impl HandVm {
    /// Its QEMU's pid (once started).
    pub fn pid(&self) -> Option<i32> {
        self.process.as_ref().map(|p| p.pid())
    }

    /// Its guest's ports.
    pub fn guest(&self) -> std::io::Result<Guest> {
        Ok(std::sync::Arc::new(self.netns.try_clone()?))
    }

    pub async fn kill(mut self) {
        if let Some(p) = self.process.take() {
            p.kill().await;
        }
        let name = self.netns.name().to_string();
        drop(self.netns);
        let _ = crate::netns::delete_by_name(&name).await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Restore `snapshot` by hand as VM `id` under `paths` (a data dir no
/// server owns), timing each stage; `probe` tells when the guest answers.
pub async fn restore(
    paths: &Paths,
    id: &str,
    snapshot: &Snapshot,
    probe: Probe,
) -> Result<(HandVm, FloorStages)> {
    let dir = paths.vm_dir(id);
    std::fs::create_dir_all(&dir).ctx(|| format!("creating {}", dir.display()))?;
    let mut st = FloorStages::default();
    let t = Instant::now();
    let netns = match Netns::create(id).await {
        Ok(n) => n,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
    };
    st.netns = ms(t);
    let mut vm = HandVm {
        netns,
        process: None,
        dir: dir.clone(),
    };
    match run(&mut vm, snapshot, probe, &mut st).await {
        Ok(()) => Ok((vm, st)),
        Err(e) => {
            let log = crate::log_tail(&dir.join("qemu.log"), 400);
            vm.kill().await;
            Err(failed(format!("{e} (QEMU said: {log:?})")))
        }
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

async fn run(
    vm: &mut HandVm,
    snapshot: &Snapshot,
    probe: Probe,
    st: &mut FloorStages,
) -> Result<()> {
    let mut qmp = load(vm, snapshot, st).await?;
    let t = Instant::now();
    qmp.run("cont", None).await?;
    st.cont = ms(t);

    let t = Instant::now();
    let process = vm.process.as_ref().expect("set by load");
    let guest = vm.guest().ctx(|| "opening the namespace".into())?;
    let gone = || process.exit_status().is_some();
    if !crate::driver::wait_ready(&probe, &guest, Duration::from_secs(60), gone).await {
        return Err(failed("the guest was not ready within 60 s"));
    }
    st.first_reply = ms(t);
    Ok(())
}

/// Restore `snapshot` by hand as VM `id` and leave it stopped: QEMU with
/// the guest loaded and no vCPU running (the floor of an idle sandbox's
/// host CPU: what QEMU itself costs). Its pid is [`HandVm::pid`].
pub async fn restore_stopped(paths: &Paths, id: &str, snapshot: &Snapshot) -> Result<HandVm> {
    let dir = paths.vm_dir(id);
    std::fs::create_dir_all(&dir).ctx(|| format!("creating {}", dir.display()))?;
    let netns = match Netns::create(id).await {
        Ok(n) => n,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
    };
    let mut vm = HandVm {
        netns,
        process: None,
        dir: dir.clone(),
    };
    match load(&mut vm, snapshot, &mut FloorStages::default()).await {
        Ok(_) => Ok(vm),
        Err(e) => {
            let log = crate::log_tail(&dir.join("qemu.log"), 400);
            vm.kill().await;
            Err(failed(format!("{e} (QEMU said: {log:?})")))
        }
    }
}

/// QEMU started over `snapshot`'s files with its device state loaded, its
/// vCPUs stopped; its QMP connection.
async fn load(vm: &mut HandVm, snapshot: &Snapshot, st: &mut FloorStages) -> Result<Qmp> {
    let dir = vm.dir.clone();
    let t = Instant::now();
    disk::create_overlay(
        &snapshot.disk_path(),
        BackingFormat::Qcow2,
        &dir.join("disk.qcow2"),
    )
    .await?;
    st.overlay = ms(t);
    let meta = &snapshot.meta;
    let launch = Launch {
        machine: meta.machine,
        artifacts: meta.artifacts.clone(),
        disk: dir.join("disk.qcow2"),
        disk_readonly: false,
        ram: snapshot.ram.clone(),
        ram_shared: false,
        // The floor preloads nothing: its balloon's discards fail (QEMU
        // logs them), which a run of a few seconds does not notice.
        ram_guarded: false,
        balloon: meta.balloon,
        qmp_socket: dir.join("qmp.sock"),
        console: qemu::Console::File(dir.join("console.log")),
        pidfile: dir.join("qemu.pid"),
        tap_fd: None,
        seccomp: false,
        incoming: true,
        extra_cmdline: meta.extra_cmdline.clone(),
    };

    let t = Instant::now();
    let process = QemuProcess::spawn(
        &qemu::binary(),
        &qemu::args(&launch),
        &vm.netns,
        &dir.join("qemu.log"),
        None,
        None,
        None,
    )?;
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut qmp = loop {
        if let Some(status) = process.exit_status() {
            vm.process = Some(process);
            return Err(failed(format!("QEMU exited before QMP answered: {status}")));
        }
        match Qmp::connect(&launch.qmp_socket, process.pid()).await {
            Ok(q) => break q,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(1)).await
            }
            Err(e) => {
                vm.process = Some(process);
                return Err(e.into());
            }
        }
    };
    vm.process = Some(process);
    st.spawn_qmp = ms(t);

    let t = Instant::now();
    // A capture of a restored VM: its RAM layers go in first, as in a
    // real restore.
    let pid = vm.process.as_ref().expect("set above").pid();
    let layered = snapshot.clone();
    crate::blocking(move || layered.write_ram_layers(pid)).await?;
    let uri = format!("file:{}", snapshot.state_path().display());
    qmp.run("migrate-incoming", Some(json!({ "uri": uri })))
        .await?;
    qmp.wait_migration("loading the device state").await?;
    st.migrate = ms(t);
    Ok(qmp)
}

/// A fresh id for a VM made by hand.
pub fn vm_id(what: &str) -> String {
    let mut b = [0u8; 4];
    let _ = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b));
    format!(
        "bench-{what}-{}",
        b.iter().map(|x| format!("{x:02x}")).collect::<String>()
    )
}
