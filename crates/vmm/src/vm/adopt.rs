//! Adopting: taking over a VM whose QEMU another process started (the
//! CLI, or the server before a restart), from its `vm.json`.

use std::path::PathBuf;

use crate::config::Paths;
use crate::driver::Probe;
use crate::error::{Error, IoContext, Result};
use crate::netns::Netns;
use crate::process::QemuProcess;
use crate::qmp::Qmp;

use super::{console, log_tail, Vm, VmFiles, VmRecord, VmState};

impl Vm {
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
