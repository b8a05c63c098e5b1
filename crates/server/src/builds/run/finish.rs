//! The end of a build: the template's env and workdir for the agent, the
//! start command, the ready check, the capture as the template; and the
//! compaction of its chain once it is ready.

use std::time::{Duration, Instant};

use tine_agent_client::InitRequest;

use super::output::tail;
use super::{fail, rfc3339_now, BuildEnv, Built, Failure, Runner};
use crate::builds::steps::{self, key_of, State};
use crate::db::{now_ms, SnapshotKind, SnapshotRow};

impl Runner<'_> {
    /// Start command, ready check, capture as the template.
    pub(super) async fn finish(
        &mut self,
        parent: String,
        key: String,
        state: State,
        cached: bool,
    ) -> Result<Built, Failure> {
        let p = self.plan;
        let start = p.start.clone().unwrap_or_default();
        let ready = p.ready.clone().unwrap_or_default();
        let key = key_of(&[
            &key,
            &start,
            &ready,
            &serde_json::to_string(&state).unwrap_or_default(),
        ]);
        if cached {
            if let Some(id) = self
                .env
                .db
                .ready_build_with_key(&p.template, &key)
                .map_err(|e| fail("finalize", e))?
            {
                if let (Ok(Some(row)), Ok(_)) = (
                    self.env.db.get_snapshot(&id),
                    self.env.driver.snapshots().open_snapshot(&id),
                ) {
                    self.info("CACHED start and ready commands: the template is unchanged".into());
                    return Ok(Built {
                        row,
                        key,
                        cached: true,
                    });
                }
            }
        }
        self.ensure_vm(&parent, 0)
            .await
            .map_err(|f| fail("finalize", f.message))?;
        // Sandboxes of the template get its variables and workdir.
        self.init(
            InitRequest {
                env_vars: Some(state.env.clone()),
                default_workdir: Some(state.workdir.clone()),
                timestamp: Some(rfc3339_now()),
                ..Default::default()
            },
            "finalize",
        )
        .await?;
        self.ensure_workdir(&state, "finalize").await?;
        if let Some(start) = &p.start {
            self.info(format!("start command: {start}"));
            let script = steps::run_script(
                &state,
                &format!(
                    "nohup setsid bash -lc {} > /tmp/tine-start.log 2>&1 < /dev/null &",
                    steps::quote(start)
                ),
            );
            let out = self
                .exec(&state.user, &script, Duration::from_secs(60), "finalize")
                .await?;
            if out.exit_code != 0 {
                return Err(fail("finalize", format!("start command: {}", tail(&out))));
            }
        }
        if let Some(ready) = &p.ready {
            self.info(format!("waiting for the ready command: {ready}"));
            let deadline = Instant::now() + self.env.ready_timeout;
            loop {
                let script = steps::run_script(&state, ready);
                let out = self
                    .exec(&state.user, &script, Duration::from_secs(60), "finalize")
                    .await?;
                if out.exit_code == 0 {
                    break;
                }
                if Instant::now() > deadline {
                    let log = self
                        .exec(
                            "root",
                            "tail -c 2000 /tmp/tine-start.log 2>/dev/null",
                            Duration::from_secs(10),
                            "finalize",
                        )
                        .await
                        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                        .unwrap_or_default();
                    return Err(fail(
                        "finalize",
                        format!(
                            "the ready command `{ready}` did not pass within {} s (last exit code {}){}",
                            self.env.ready_timeout.as_secs(),
                            out.exit_code,
                            if log.is_empty() { String::new() } else { format!("; start command output: {log}") }
                        ),
                    ));
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        let id = format!(
            "tpl-{}-{}",
            p.template.replace(['/', ':', '.'], "-"),
            crate::ids::random_hex(4)
        );
        self.info("capturing the template".into());
        let vm = self.vm.take().expect("the build VM is running");
        if let Err(failed) = vm.capture_and_kill(&id).await {
            let e = failed.discard().await;
            let _ = self.env.driver.snapshots().delete_snapshot(&id);
            return Err(fail("finalize", format!("capturing the template: {e}")));
        }
        let row = SnapshotRow {
            id,
            kind: SnapshotKind::Template,
            sandbox_id: String::new(),
            parent_id: Some(parent),
            names: vec![p.template.clone()],
            template_id: p.template.clone(),
            cpu_count: p.machine.vcpus,
            memory_mb: p.machine.memory_mib,
            source_token: String::new(),
            created_ms: now_ms(),
        };
        Ok(Built {
            row,
            key,
            cached: false,
        })
    }
}

/// Fold the chain of layers under template capture `id` onto its root, so
/// a create restores one layer whatever the step count (the build is
/// ready before this: it changes how the capture is stored, not what it
/// holds, and restores may read it meanwhile).
pub async fn compact_template(env: &BuildEnv, id: &str) {
    let t = Instant::now();
    match env.driver.snapshots().compact(id).await {
        Ok(Some(root)) => {
            if let Err(e) = env.db.set_snapshot_parent(id, &root) {
                tracing::warn!(snapshot = %id, "recording the compaction: {e}");
            }
            tracing::info!(snapshot = %id, root = %root, ms = t.elapsed().as_millis() as u64, "template compacted");
        }
        Ok(None) => {}
        Err(e) => tracing::warn!(snapshot = %id, "compacting the template: {e}"),
    }
}
