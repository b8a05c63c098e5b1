//! One microVM: its lifecycle (boot, pause/resume, snapshot, restore,
//! kill) and its files.
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
//!
//! This file holds the [`Vm`] type, its state, its start options and the
//! calls that move it between states (pause, resume, kill). The rest,
//! one job a file:
//!
//! - `boot`: cold boots, from the artifacts or over a snapshot's disk;
//! - `restore`: starting a clone of a snapshot (RAM layers, device
//!   state) and tracking its writes;
//! - `launch`: what boot and restore share: QEMU's jail and command line,
//!   spawning it, connecting to QMP, waiting until the guest is ready;
//! - `adopt`: taking over a QEMU another process started (the server
//!   after a restart, the CLI);
//! - `capture`: capturing a VM into a snapshot; `salvage`: finishing a
//!   capture whose QEMU had exited when the process doing it died;
//! - `record`: the VM's record (`vm.json`) and durable writes;
//! - `files`: the VM's directories and files, listing VMs and removing
//!   what one left behind;
//! - `console`: the guest's serial console into a capped log;
//! - `qemu_driver`: [`QemuDriver`], the [`crate::Driver`] over all of this.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::Paths;
use crate::driver::{Guest, Probe};
use crate::error::{Error, Result};
use crate::netns::Netns;
use crate::process::QemuProcess;
use crate::qmp::Qmp;
use crate::ram::WriteTracker;

mod adopt;
mod boot;
mod capture;
mod console;
mod files;
mod launch;
mod qemu_driver;
mod record;
mod restore;
mod salvage;

pub use files::log_tail;
pub(crate) use files::{cleanup, list};
use files::{remove_dir, VmFiles};
use launch::exited;
pub use qemu_driver::QemuDriver;
pub(crate) use record::write_atomic;
pub use record::VmRecord;
pub(crate) use salvage::salvage_capture;

/// How long a cold boot may take until the agent answers (TCG: 2–3 s).
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a restored VM may take until the agent answers again.
pub const RESTORE_TIMEOUT: Duration = Duration::from_secs(30);

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
}
