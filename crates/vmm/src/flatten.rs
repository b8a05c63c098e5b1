//! Flattening a clone's capture into a RAM file.
//!
//! A VM restored from a snapshot maps the snapshot's RAM file MAP_PRIVATE
//! (`share=off`), so `x-ignore-shared` does not skip its RAM and QEMU writes
//! all of it into the device-state stream. Clones of such a capture would
//! each copy all of that RAM out of the stream and share nothing. So the
//! stream is replayed once into a helper QEMU whose RAM is a new file
//! mapped `share=on` (QEMU loads pages into it like into any RAM), and that
//! paused helper saves its device state again with `x-ignore-shared`: the
//! result is a frozen RAM file plus a small state, like a first capture,
//! and clones map it MAP_PRIVATE and share its pages.
//!
//! Cost: the stream holds the VM's non-zero pages, so this grows with the
//! RAM the guest uses, not with what changed since the parent capture
//! (writing only the changed pages needs RAM the VM maps shared; see the
//! issue notes).

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::config::{Artifacts, Machine};
use crate::error::{Error, Result};
use crate::netns::Netns;
use crate::process::QemuProcess;
use crate::qemu::{self, Launch};
use crate::qmp::Qmp;

pub(crate) struct Flatten<'a> {
    /// The VM's namespace (its tap is free: the VM's QEMU has exited).
    pub netns: &'a Netns,
    pub machine: Machine,
    pub artifacts: &'a Artifacts,
    /// The capture's sealed disk (opened read-only).
    pub disk: &'a Path,
    /// Where the helper's socket and logs go.
    pub work_dir: &'a Path,
}

impl Flatten<'_> {
    /// Replay `stream` into a new RAM file `ram`, writing the small device
    /// state to `state`.
    pub async fn run(&self, stream: &Path, ram: &Path, state: &Path) -> Result<()> {
        let qmp_socket = self.work_dir.join("flatten-qmp.sock");
        let log = self.work_dir.join("flatten-qemu.log");
        let launch = Launch {
            machine: self.machine,
            artifacts: self.artifacts.clone(),
            disk: self.disk.to_path_buf(),
            disk_readonly: true,
            ram: ram.to_path_buf(),
            ram_shared: true,
            qmp_socket: qmp_socket.clone(),
            console_log: self.work_dir.join("flatten-console.log"),
            pidfile: self.work_dir.join("flatten-qemu.pid"),
            incoming: true,
            extra_cmdline: Vec::new(),
        };
        let _ = std::fs::remove_file(&qmp_socket);
        let process = QemuProcess::spawn(&qemu::binary(), &qemu::args(&launch), self.netns, &log)?;
        let result = self.drive(&process, &qmp_socket, stream, state).await;
        if tokio::time::timeout(Duration::from_secs(10), process.wait())
            .await
            .is_err()
        {
            process.kill().await;
        }
        result.map_err(|e| Error::Snapshot {
            path: stream.to_path_buf(),
            detail: format!(
                "flattening RAM: {e}; the helper QEMU said {:?}",
                crate::vm::log_tail(&log, 600)
            ),
        })
    }

    async fn drive(
        &self,
        process: &QemuProcess,
        socket: &Path,
        stream: &Path,
        state: &Path,
    ) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut qmp = loop {
            match Qmp::connect(socket).await {
                Ok(q) => break q,
                Err(e) if Instant::now() > deadline || process.exit_status().is_some() => {
                    return Err(e.into())
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(1)).await,
            }
        };
        // The stream was saved without `x-ignore-shared` (so it carries all
        // RAM and QEMU accepts it into shared RAM); the new state is saved
        // with it, leaving RAM in the file.
        qmp.run(
            "migrate-incoming",
            Some(json!({ "uri": format!("file:{}", stream.display()) })),
        )
        .await?;
        qmp.wait_migration("replaying the RAM stream").await?;
        qmp.set_migrate_capability("x-ignore-shared", true).await?;
        qmp.run(
            "migrate",
            Some(json!({ "uri": format!("file:{}", state.display()) })),
        )
        .await?;
        qmp.wait_migration("saving the flattened device state")
            .await?;
        let _ = qmp.run("quit", None).await;
        Ok(())
    }
}
