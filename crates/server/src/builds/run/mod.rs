//! Running a build: its base (a template snapshot, or an OCI image booted
//! once), then each step in a build VM, each `RUN`/`COPY` sealed as a
//! layer (a capture of the VM, disk and memory) under a key that hashes
//! its parent, the step, the state it ran with and the archive it copied.
//! A build restores the newest layer whose key matches instead of running
//! what made it, so an unchanged prefix costs one restore; the finished
//! template (start command running, ready check passed) is one capture
//! more. A failed step kills the VM; the layers before it stay, for the
//! next build.
//!
//! Here: the base and the steps; `finish.rs`: start command, ready check,
//! the template capture and its compaction; `output.rs`: a step's output
//! as log lines.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tine_agent_client::{ExecOutput, InitRequest, AGENT_PORT};
use tine_vmm::{Artifacts, Driver, Machine, SnapshotRef, VmHandle};

mod finish;
mod output;

pub use finish::compact_template;

use super::files::ContextStore;
use super::rfc3339_now;
use super::steps::{self, key_of, layer_key, Op, State, Step};
use crate::db::{now_ms, Db, SnapshotKind, SnapshotRow};
use crate::templates::{BuildImage, Templates};
use output::{tail, LineLog};

/// How a build layer's snapshot id begins (`lyr-<key>-<random>`).
pub const LAYER_ID_PREFIX: &str = "lyr-";

/// What a build needs of the host.
pub struct BuildEnv {
    pub driver: Arc<dyn Driver>,
    pub artifacts: Artifacts,
    pub db: Arc<Db>,
    pub templates: Arc<Templates>,
    pub files: Arc<ContextStore>,
    pub data_dir: std::path::PathBuf,
    pub registries: tine_image::RegistryOptions,
    /// Registry requests go through [`super::registry_guard`] (builds for
    /// API callers; the operator's CLI builds reach any registry).
    pub guard_registries: bool,
    /// How long a ready check may keep failing.
    pub ready_timeout: Duration,
    /// How long one step may run.
    pub step_timeout: Duration,
    /// Build VMs get the default policy (the internet, not the host).
    pub network: Arc<crate::network::Network>,
}

/// Where a build starts.
#[derive(Debug, Clone)]
pub enum Base {
    /// A template (`base`, or one built earlier): its snapshot is restored.
    Template(String),
    /// An OCI image, pulled if needed and booted.
    Image {
        reference: String,
        credentials: Option<tine_image::Credentials>,
    },
}

/// One build, checked.
#[derive(Debug, Clone)]
pub struct Plan {
    pub template: String,
    /// The team whose build this is: its build contexts, its registry
    /// credentials, its copies of private images.
    pub team: String,
    pub build_id: String,
    pub base: Base,
    pub steps: Vec<Step>,
    pub start: Option<String>,
    pub ready: Option<String>,
    /// Rebuild everything (`skip_cache`).
    pub force: bool,
    pub machine: Machine,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
}

impl Level {
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Debug => "debug",
            Level::Info => "info",
            Level::Warn => "warn",
            Level::Error => "error",
        }
    }
}

pub type Log = Arc<dyn Fn(Level, String) + Send + Sync>;

/// Why a build failed, and where: `"base"`, a step number counted from 1,
/// or `"finalize"` (start command, ready check, capture), as the SDK reads
/// `reason.step`.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct Failure {
    pub step: String,
    pub message: String,
}

fn fail(step: impl ToString, message: impl ToString) -> Failure {
    Failure {
        step: step.to_string(),
        message: message.to_string(),
    }
}

/// What a finished build made: the template's snapshot row, and the key
/// of everything that went into it.
pub struct Built {
    pub row: SnapshotRow,
    pub key: String,
    pub cached: bool,
}

/// Run `plan`. Every step is checked before anything runs.
pub async fn execute(env: &BuildEnv, plan: &Plan, log: &Log) -> Result<Built, Failure> {
    let ops = plan
        .steps
        .iter()
        .enumerate()
        .map(|(i, s)| s.op(i + 1).map_err(|e| fail(i + 1, e)))
        .collect::<Result<Vec<_>, _>>()?;
    let started = Instant::now();
    let mut build = Runner {
        env,
        plan,
        log,
        vm: None,
        workdir_made: None,
    };
    let result = build.run(&ops).await;
    if let Some(vm) = build.vm.take() {
        let _ = vm.kill().await;
    }
    match &result {
        Ok(b) => log(
            Level::Info,
            format!(
                "template {} ready in {:.1} s{}",
                plan.template,
                started.elapsed().as_secs_f64(),
                if b.cached { " (every step cached)" } else { "" }
            ),
        ),
        Err(f) => log(
            Level::Error,
            format!("build failed at step {}: {}", f.step, f.message),
        ),
    }
    result
}

struct Runner<'a> {
    env: &'a BuildEnv,
    plan: &'a Plan,
    log: &'a Log,
    /// The build VM, once a step had to run.
    vm: Option<Box<dyn VmHandle>>,
    /// A workdir known to exist on the build VM's disk (or on the layer
    /// it will be restored from).
    workdir_made: Option<String>,
}

impl Runner<'_> {
    fn info(&self, msg: String) {
        (self.log)(Level::Info, msg)
    }

    async fn run(&mut self, ops: &[Op]) -> Result<Built, Failure> {
        let (mut parent, mut key, mut state) = self.base().await?;
        let mut forced = self.plan.force;
        let n = ops.len();
        let mut all_cached = true;
        for (i, (op, step)) in ops.iter().zip(&self.plan.steps).enumerate() {
            let num = i + 1;
            let shown = format!("[{num}/{n}] {} {}", step.kind, step.args.join(" "));
            forced |= step.force;
            if !op.makes_layer() {
                state.apply(op);
                self.info(shown.clone());
                continue;
            }
            let content =
                match op {
                    Op::Copy {
                        files_hash, src, ..
                    } => Some(
                        self.env
                            .files
                            .digest(&self.plan.team, files_hash)
                            .ok_or_else(|| {
                                fail(
                        num,
                        format!("COPY {src}: the files for hash {files_hash} were not uploaded"),
                    )
                            })?,
                    ),
                    _ => None,
                };
            key = layer_key(&key, op, &state, content.as_deref());
            if !forced && self.vm.is_none() {
                if let Some(row) = self.env.db.find_layer(&key).map_err(|e| fail(num, e))? {
                    if self.env.driver.snapshots().open_snapshot(&row.id).is_ok() {
                        let _ = self.env.db.touch_snapshot(&row.id);
                        self.info(format!("CACHED {shown}"));
                        parent = row.id;
                        // That step ran in this workdir, so its layer has it.
                        self.workdir_made = Some(state.workdir.clone());
                        continue;
                    }
                }
            }
            all_cached = false;
            self.info(shown.clone());
            self.ensure_vm(&parent, num).await?;
            let t = Instant::now();
            self.step(op, &state, content.as_deref(), num).await?;
            parent = self.seal(&key, Some(parent), num).await?;
            self.info(format!(
                "[{num}/{n}] done in {:.1} s",
                t.elapsed().as_secs_f64()
            ));
        }
        self.finish(parent, key, state, all_cached && !forced).await
    }

    /// The snapshot the first step starts from, its key, and the state.
    async fn base(&mut self) -> Result<(String, String, State), Failure> {
        let machine = self.plan.machine;
        match &self.plan.base {
            Base::Template(name) => {
                self.info(format!("FROM template {name}"));
                let (_, row) = self
                    .env
                    .templates
                    .snapshot(name, machine)
                    .await
                    .map_err(|e| fail("base", e))?;
                let key = key_of(&["template", &row.id]);
                Ok((row.id, key, State::default()))
            }
            Base::Image {
                reference,
                credentials,
            } => {
                let meta = self.pull(reference, credentials.as_ref()).await?;
                let mut state = State::default();
                if let Some(wd) = meta
                    .config
                    .working_dir
                    .as_deref()
                    .filter(|w| w.starts_with('/'))
                {
                    state.workdir = wd.to_string();
                }
                let a = &self.env.artifacts;
                let key = key_of(&[
                    "image",
                    &meta.manifest_digest,
                    &a.kernel.display().to_string(),
                    &a.initramfs.display().to_string(),
                    machine.accel.as_str(),
                    &machine.vcpus.to_string(),
                    &machine.memory_mib.to_string(),
                ]);
                if !self.plan.force {
                    if let Some(row) = self.env.db.find_layer(&key).map_err(|e| fail("base", e))? {
                        if self.env.driver.snapshots().open_snapshot(&row.id).is_ok() {
                            let _ = self.env.db.touch_snapshot(&row.id);
                            self.info(format!(
                                "CACHED FROM {reference} ({})",
                                meta.manifest_digest
                            ));
                            return Ok((row.id, key, state));
                        }
                    }
                }
                self.info(format!(
                    "FROM {reference}: booting {}",
                    meta.manifest_digest
                ));
                let image = BuildImage::new(meta, &self.env.data_dir);
                let mut artifacts = self.env.artifacts.clone();
                artifacts.rootfs = image.disk.clone();
                let vm_id = format!("build-{}", crate::ids::random_hex(4));
                let vm = self
                    .env
                    .driver
                    .boot(&vm_id, machine, &artifacts)
                    .await
                    .map_err(|e| fail("base", format!("booting {reference}: {e}")))?;
                self.vm = Some(vm);
                self.open_network("base").await?;
                crate::templates::prepare_image(self.vm(), &self.plan.template, &image.meta)
                    .await
                    .map_err(|e| fail("base", e))?;
                let id = self.seal(&key, None, "base").await?;
                Ok((id, key, state))
            }
        }
    }

    /// Pull `reference` for this build's team: with the request's
    /// credentials or those the operator gave the team. When the registry
    /// cannot be reached or refuses, the local copy serves only a team
    /// that pulled it itself, or any team if it was pulled without
    /// credentials (another team's private image stays theirs).
    async fn pull(
        &self,
        reference: &str,
        creds: Option<&tine_image::Credentials>,
    ) -> Result<tine_image::ImageMeta, Failure> {
        let store = tine_image::ImageStore::new(&self.env.data_dir);
        let team = self.plan.team.as_str();
        let mut opts = self.env.registries.for_team(team);
        let _guard = match self.env.guard_registries {
            true => {
                let allowed = super::registry_guard::parse_allowed(&opts.allow_private)
                    .map_err(|e| fail("base", e))?;
                if let Ok(r) = tine_image::ImageRef::parse(reference) {
                    super::registry_guard::precheck(r.resolved_registry(), &allowed)
                        .await
                        .map_err(|e| fail("base", format!("image {reference}: {e}")))?;
                }
                let g = super::registry_guard::RegistryGuard::start(allowed)
                    .await
                    .map_err(|e| fail("base", format!("the registry guard: {e}")))?;
                opts.proxy = Some(g.url());
                Some(g)
            }
            false => None,
        };
        // Lazily (chunks on first read through the image daemon) unless
        // the pull needs credentials the daemon does not hold.
        let lazy = creds.is_none();
        let log = self.log.clone();
        let mut progress = move |p: tine_image::registry::Progress| {
            if let tine_image::registry::Progress::Manifest { layers, bytes } = p {
                log(
                    Level::Info,
                    format!("pulling {layers} layers ({bytes} bytes)"),
                );
            }
        };
        let err = match store
            .pull(reference, &opts, creds, lazy, &mut progress)
            .await
        {
            Ok(m) => {
                let private = tine_image::ImageRef::parse(reference)
                    .map(|r| opts.sends_credentials(&r, creds))
                    .unwrap_or(true);
                let owner = if private { team } else { crate::db::ANY_TEAM };
                self.env
                    .db
                    .grant_image(&m.manifest_digest, owner)
                    .map_err(|e| fail("base", e))?;
                return Ok(m);
            }
            Err(e) => e,
        };
        let local = store.get(reference).ok().filter(|m| {
            self.env
                .db
                .image_granted(&m.manifest_digest, team)
                .unwrap_or(false)
        });
        match local {
            Some(m) => {
                (self.log)(
                    Level::Warn,
                    format!("{reference}: {err}; using the local copy"),
                );
                Ok(m)
            }
            None => Err(fail("base", format!("image {reference}: {err}"))),
        }
    }

    fn vm(&self) -> &dyn VmHandle {
        self.vm.as_deref().expect("the build VM is running")
    }

    /// Restore `parent` as the build VM unless one runs.
    async fn ensure_vm(&mut self, parent: &str, num: usize) -> Result<(), Failure> {
        if self.vm.is_some() {
            return Ok(());
        }
        let snap: SnapshotRef = self
            .env
            .driver
            .snapshots()
            .open_snapshot(parent)
            .map_err(|e| fail(num, format!("opening layer {parent}: {e}")))?;
        let vm_id = format!("build-{}", crate::ids::random_hex(4));
        let vm = self
            .env
            .driver
            .restore(&vm_id, &snap)
            .await
            .map_err(|e| fail(num, format!("restoring layer {parent}: {e}")))?;
        self.vm = Some(vm);
        self.open_network(num).await?;
        // The clock of a restored guest is the capture's.
        self.init(
            InitRequest {
                timestamp: Some(rfc3339_now()),
                ..Default::default()
            },
            num,
        )
        .await
    }

    /// Let the build VM out to the internet (steps run `apt`, `pip`…).
    async fn open_network(&self, step: impl ToString + Copy) -> Result<(), Failure> {
        self.env
            .network
            .apply_default(&self.vm().guest(), true)
            .await
            .map_err(|e| fail(step, e))
    }

    async fn init(&self, req: InitRequest, step: impl ToString + Copy) -> Result<(), Failure> {
        let guest = self.vm().guest();
        tine_agent_client::init(guest.connect(AGENT_PORT), &req, None)
            .await
            .map_err(|e| fail(step, format!("the build VM's agent: {e}")))
    }

    async fn exec(
        &self,
        user: &str,
        script: &str,
        timeout: Duration,
        step: impl ToString + Copy,
    ) -> Result<ExecOutput, Failure> {
        let guest = self.vm().guest();
        tine_agent_client::process::exec(guest.connect(AGENT_PORT), user, script, None, timeout)
            .await
            .map_err(|e| fail(step, format!("the build VM's agent: {e}")))
    }

    /// Create the workdir (as root, owned by the step's user) unless this
    /// VM made it already.
    async fn ensure_workdir(
        &mut self,
        state: &State,
        step: impl ToString + Copy,
    ) -> Result<(), Failure> {
        if self.workdir_made.as_deref() == Some(state.workdir.as_str()) {
            return Ok(());
        }
        let mk = self
            .exec(
                "root",
                &steps::mkdir_workdir(state),
                Duration::from_secs(60),
                step,
            )
            .await?;
        if mk.exit_code != 0 {
            return Err(fail(
                step,
                format!("creating workdir {}: {}", state.workdir, tail(&mk)),
            ));
        }
        self.workdir_made = Some(state.workdir.clone());
        Ok(())
    }

    /// Run a step's script; its output goes to the log, a failure names
    /// the step and ends with the output's tail.
    async fn step(
        &mut self,
        op: &Op,
        state: &State,
        content: Option<&str>,
        num: usize,
    ) -> Result<(), Failure> {
        self.ensure_workdir(state, num).await?;
        let (user, script, what) = match op {
            Op::Run { cmd, user } => (
                user.clone().unwrap_or_else(|| state.user.clone()),
                steps::run_script(state, cmd),
                format!("RUN {cmd}"),
            ),
            Op::Copy {
                src,
                dest,
                owner,
                mode,
                ..
            } => {
                let digest = content.expect("a COPY has its archive");
                let archive = format!("/tmp/.tine-context-{}.tar", &digest[..16]);
                let data = tokio::fs::read(self.env.files.archive_path(digest))
                    .await
                    .map_err(|e| fail(num, format!("reading the build context: {e}")))?;
                let guest = self.vm().guest();
                tine_agent_client::files::write(
                    guest.connect(AGENT_PORT),
                    "root",
                    &archive,
                    data.into(),
                    None,
                )
                .await
                .map_err(|e| fail(num, format!("COPY {src}: uploading the context: {e}")))?;
                (
                    "root".to_string(),
                    steps::copy_script(
                        state,
                        &archive,
                        src,
                        dest,
                        owner.as_deref(),
                        mode.as_deref(),
                    ),
                    format!("COPY {src} {dest}"),
                )
            }
            _ => unreachable!("only RUN and COPY run"),
        };
        // Output goes to the log line by line as it comes (the SDK shows it
        // while the step runs).
        let mut lines = LineLog::new(self.log.clone());
        let guest = self.vm().guest();
        let out = tine_agent_client::process::exec_streaming(
            guest.connect(AGENT_PORT),
            &user,
            &script,
            self.env.step_timeout,
            &mut |o, e| lines.push(o, e),
        )
        .await
        .map_err(|e| fail(num, format!("the build VM's agent: {e}")))?;
        lines.flush();
        if out.exit_code != 0 {
            return Err(fail(
                num,
                format!(
                    "{what} (as {user}) exited with {}: {}",
                    out.exit_code,
                    tail(&out)
                ),
            ));
        }
        Ok(())
    }

    /// Capture the build VM as the layer with key `key` over `parent`.
    async fn seal(
        &mut self,
        key: &str,
        parent: Option<String>,
        step: impl ToString + Copy,
    ) -> Result<String, Failure> {
        let id = format!(
            "{LAYER_ID_PREFIX}{}-{}",
            &key[..20],
            crate::ids::random_hex(3)
        );
        let vm = self.vm.as_mut().expect("the build VM is running");
        if let Err(e) = vm.capture(&id).await {
            // No half layer stays behind.
            let _ = self.env.driver.snapshots().delete_snapshot(&id);
            return Err(fail(step, format!("capturing the layer: {e}")));
        }
        let row = SnapshotRow {
            id: id.clone(),
            kind: SnapshotKind::Layer,
            sandbox_id: String::new(),
            parent_id: parent,
            names: vec![self.plan.template.clone()],
            template_id: key.to_string(),
            cpu_count: self.plan.machine.vcpus,
            memory_mb: self.plan.machine.memory_mib,
            source_token: String::new(),
            created_ms: now_ms(),
        };
        self.env
            .db
            .insert_snapshot(&row)
            .map_err(|e| fail(step, e))?;
        Ok(id)
    }
}
