//! Template builds through E2B's Template API: `POST /v3/templates`
//! registers a build, the SDK uploads each `COPY`'s files to a URL this
//! server signs ([`files`]), `POST /v2/templates/{id}/builds/{buildID}`
//! starts it and the SDK polls its status and logs. The build itself runs
//! in VMs ([`run`]), its steps are checked and turned into scripts in
//! [`steps`]; `tine template build -f Dockerfile` goes through the same
//! [`run::execute`] with the steps of [`dockerfile`].
//!
//! A build's template exists (a `template` row in `snapshots`) only once
//! the build is ready; builds that fail leave their finished layers for
//! the next one and nothing else.

pub mod dockerfile;
pub mod files;
pub mod registry_guard;
pub mod run;
pub mod steps;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use tine_vmm::Machine;
use tokio::sync::Semaphore;

use crate::db::{now_ms, BuildRow, BuildStatus, Db, DbError};
use run::{Base, BuildEnv, Level, Log, Plan};
use steps::Step;

/// The E2B SDK's default base image (`Template()` with no `from_*`):
/// tine builds it on its own `base` template.
const E2B_BASE_IMAGE: &str = "e2bdev/base";
/// Log entries kept per build (the oldest go first).
const MAX_LOG_ENTRIES: usize = 20_000;
/// How long the logs of a finished build stay in memory.
const LOG_RETENTION: Duration = Duration::from_secs(3600);

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Conflict(String),
    #[error(transparent)]
    Db(#[from] DbError),
}

/// One log line, as the status route returns it.
#[derive(Debug, Clone)]
pub struct LogEntry {
    pub timestamp: String,
    pub level: Level,
    pub message: String,
}

#[derive(Default)]
struct BuildLog {
    entries: Vec<LogEntry>,
    /// Entries dropped from the front (offsets stay stable).
    dropped: usize,
    finished_at: Option<std::time::Instant>,
}

/// `POST /v2/templates/{id}/builds/{buildID}`, as the SDKs send it.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartRequest {
    pub from_image: Option<String>,
    pub from_template: Option<String>,
    pub from_image_registry: Option<serde_json::Value>,
    #[serde(default)]
    pub force: bool,
    #[serde(default)]
    pub steps: Vec<Step>,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
}

pub struct Builds {
    env: Arc<BuildEnv>,
    db: Arc<Db>,
    slots: Arc<Semaphore>,
    logs: Mutex<HashMap<String, Arc<Mutex<BuildLog>>>>,
    machine_default: Machine,
    /// Layers unused this long are deleted (`None`: kept).
    layer_ttl: Option<Duration>,
}

/// A name the API accepts for a template: 1-64 of a-z, 0-9, `-`, `_`, `.`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b))
}

pub fn valid_tag(tag: &str) -> bool {
    !tag.is_empty()
        && tag.len() <= 64
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// A UUID (v4 layout) for a build id: the SDK parses build ids of tags as
/// UUIDs.
fn uuid() -> String {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).expect("the OS has randomness");
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = steps::hex(&b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

impl Builds {
    /// Builds that were running when the server last stopped have ended.
    pub fn new(
        env: BuildEnv,
        max_concurrent: usize,
        machine_default: Machine,
        layer_ttl: Option<Duration>,
    ) -> Result<Self, DbError> {
        let db = env.db.clone();
        let n = db.fail_unfinished_builds("the server stopped during the build")?;
        if n > 0 {
            tracing::warn!("{n} template builds ended by a server restart");
        }
        Ok(Self {
            env: Arc::new(env),
            db,
            slots: Arc::new(Semaphore::new(max_concurrent)),
            logs: Mutex::new(HashMap::new()),
            machine_default,
            layer_ttl,
        })
    }

    pub fn files(&self) -> &files::ContextStore {
        &self.env.files
    }

    pub fn db(&self) -> &Db {
        &self.db
    }

    /// `POST /v3/templates`: register a build of `name` (`name:tag` adds
    /// a tag); it waits for its start request.
    pub fn request(
        &self,
        name: &str,
        tags: Vec<String>,
        machine: Machine,
    ) -> Result<BuildRow, BuildError> {
        self.prune_logs();
        self.expire_layers();
        new_build(&self.db, name, tags, machine, BuildStatus::Waiting)
    }

    /// The build `build_id` of `template`.
    pub fn get(&self, template: &str, build_id: &str) -> Result<BuildRow, BuildError> {
        match self.db.get_build(build_id)? {
            Some(b) if b.template == template => Ok(b),
            _ => Err(BuildError::NotFound(format!(
                "build {build_id} of template {template} not found"
            ))),
        }
    }

    /// Whether `template` has been registered for a build (uploads are
    /// taken for it).
    pub fn known(&self, template: &str) -> Result<bool, BuildError> {
        Ok(!self.db.list_builds(template)?.is_empty())
    }

    /// `POST /v2/templates/{id}/builds/{buildID}`: check the request and
    /// run the build in the background.
    pub fn start(
        self: &Arc<Self>,
        template: &str,
        build_id: &str,
        team: &str,
        req: StartRequest,
    ) -> Result<(), BuildError> {
        let build = self.get(template, build_id)?;
        if build.status != BuildStatus::Waiting {
            return Err(BuildError::Conflict(format!(
                "build {build_id} has started already (status {})",
                build.status.as_str()
            )));
        }
        let plan = self.plan(&build, team, req)?;
        // Started builds have a log; a build stays `waiting` until it has
        // a build slot.
        let log = self
            .log_sink(build_id)
            .ok_or_else(|| BuildError::Conflict(format!("build {build_id} has started already")))?;
        let this = self.clone();
        tokio::spawn(async move { this.run(build, plan, log).await });
        Ok(())
    }

    /// The build's checked plan; every error here is the caller's.
    fn plan(&self, build: &BuildRow, team: &str, req: StartRequest) -> Result<Plan, BuildError> {
        let invalid = |m: String| BuildError::Invalid(m);
        let mut machine = self.machine_default;
        machine.vcpus = build.cpu_count;
        machine.memory_mib = build.memory_mb;
        let base = match (req.from_image, req.from_template) {
            (Some(_), Some(_)) => {
                return Err(invalid("give fromImage or fromTemplate, not both".into()))
            }
            (Some(image), None) => {
                let repo = image.split([':', '@']).next().unwrap_or_default();
                if repo == E2B_BASE_IMAGE || repo == format!("docker.io/{E2B_BASE_IMAGE}") {
                    Base::Template(crate::templates::DEFAULT_TEMPLATE.into())
                } else {
                    tine_image::ImageRef::parse(&image)
                        .map_err(|e| invalid(format!("fromImage {image:?}: {e}")))?;
                    Base::Image {
                        reference: image,
                        credentials: registry_credentials(req.from_image_registry.as_ref())?,
                    }
                }
            }
            (None, Some(t)) => {
                if !self.env.templates.exists(&t) {
                    return Err(invalid(format!("fromTemplate: template {t:?} not found")));
                }
                if t != crate::templates::DEFAULT_TEMPLATE {
                    // A built template fixes the machine shape.
                    if let Ok(Some(row)) = self.env.templates.find(&t) {
                        machine.vcpus = row.cpu_count;
                        machine.memory_mib = row.memory_mb;
                    }
                }
                Base::Template(t)
            }
            (None, None) => Base::Template(crate::templates::DEFAULT_TEMPLATE.into()),
        };
        for (i, step) in req.steps.iter().enumerate() {
            let op = step.op(i + 1).map_err(invalid)?;
            if let steps::Op::Copy {
                files_hash, src, ..
            } = &op
            {
                if self.env.files.digest(team, files_hash).is_none() {
                    return Err(invalid(format!(
                        "step {} (COPY {src}): the files with hash {files_hash} were not uploaded",
                        i + 1
                    )));
                }
            }
        }
        Ok(Plan {
            template: build.template.clone(),
            team: team.to_string(),
            build_id: build.id.clone(),
            base,
            steps: req.steps,
            start: req.start_cmd.filter(|s| !s.trim().is_empty()),
            ready: req.ready_cmd.filter(|s| !s.trim().is_empty()),
            force: req.force,
            machine,
        })
    }

    /// Run a started build to its end and record how it ended.
    async fn run(self: Arc<Self>, build: BuildRow, plan: Plan, log: Log) {
        let waiting = self.slots.available_permits() == 0;
        if waiting {
            log(Level::Info, "waiting for a free build slot".into());
        }
        let _slot = self.slots.clone().acquire_owned().await;
        if let Err(e) = self
            .db
            .set_build_status(&build.id, BuildStatus::Building, None, None)
        {
            tracing::error!(build = %build.id, "recording a build's start: {e}");
        }
        let result = run::execute(&self.env, &plan, &log).await;
        conclude(&self.db, &build, &result);
        if let Some(l) = self
            .logs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&build.id)
        {
            l.lock().unwrap_or_else(|e| e.into_inner()).finished_at =
                Some(std::time::Instant::now());
        }
        // (Still holding the build slot: compaction is the build's work.)
        if let Ok(built) = &result {
            if !built.cached {
                run::compact_template(&self.env, &built.row.id).await;
            }
        }
    }

    /// A new log for build `build_id`; `None` when it has one (started).
    fn log_sink(&self, build_id: &str) -> Option<Log> {
        let log = Arc::new(Mutex::new(BuildLog::default()));
        {
            let mut logs = self.logs.lock().unwrap_or_else(|e| e.into_inner());
            if logs.contains_key(build_id) {
                return None;
            }
            logs.insert(build_id.to_string(), log.clone());
        }
        let id = build_id.to_string();
        Some(Arc::new(move |level, message| {
            tracing::debug!(build = %id, "{message}");
            let mut l = log.lock().unwrap_or_else(|e| e.into_inner());
            if l.entries.len() >= MAX_LOG_ENTRIES {
                l.entries.remove(0);
                l.dropped += 1;
            }
            l.entries.push(LogEntry {
                timestamp: rfc3339_now(),
                level,
                message,
            });
        }))
    }

    /// Up to `limit` log entries from `offset` on (entries counted from
    /// the build's first). Logs of builds from before a restart are gone.
    pub fn logs(&self, build_id: &str, offset: usize, limit: usize) -> Vec<LogEntry> {
        let Some(log) = self
            .logs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(build_id)
            .cloned()
        else {
            return Vec::new();
        };
        let l = log.lock().unwrap_or_else(|e| e.into_inner());
        let from = offset.saturating_sub(l.dropped).min(l.entries.len());
        l.entries[from..].iter().take(limit).cloned().collect()
    }

    /// A conflict if a build of `template` is running (its end would
    /// publish the template again).
    pub fn check_not_building(&self, template: &str) -> Result<(), BuildError> {
        if self
            .db
            .list_builds(template)?
            .iter()
            .any(|b| b.status == BuildStatus::Building)
        {
            return Err(BuildError::Conflict(format!(
                "a build of template {template} is running; delete it once the build has ended"
            )));
        }
        Ok(())
    }

    /// Forget the builds of `template` (it is being deleted); returns how
    /// many there were.
    pub fn forget(&self, template: &str) -> Result<usize, BuildError> {
        Ok(self.db.delete_builds(template)?)
    }

    /// Delete layers no build used within the TTL (their files go with
    /// the server's next garbage collection, once nothing sits on them).
    fn expire_layers(&self) {
        let Some(ttl) = self.layer_ttl else {
            return;
        };
        let cutoff = now_ms() - ttl.as_millis() as i64;
        match self.db.expire_layers(cutoff) {
            Ok(0) => {}
            Ok(n) => tracing::info!("{n} build layers unused for {} s expired", ttl.as_secs()),
            Err(e) => tracing::warn!("expiring build layers: {e}"),
        }
    }

    fn prune_logs(&self) {
        self.logs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, l| {
                let l = l.lock().unwrap_or_else(|e| e.into_inner());
                l.finished_at.is_none_or(|t| t.elapsed() < LOG_RETENTION)
            });
    }
}

/// Register a build of `name` (`name:tag` adds a tag) in `status`.
pub fn new_build(
    db: &Db,
    name: &str,
    tags: Vec<String>,
    machine: Machine,
    status: BuildStatus,
) -> Result<BuildRow, BuildError> {
    let (name, mut tags) = match name.split_once(':') {
        Some((n, t)) => (n, std::iter::once(t.to_string()).chain(tags).collect()),
        None => (name, tags),
    };
    if !valid_name(name) {
        return Err(BuildError::Invalid(format!(
            "template name {name:?}: use 1-64 of a-z, 0-9, '-', '_', '.'"
        )));
    }
    if name == crate::templates::DEFAULT_TEMPLATE {
        return Err(BuildError::Invalid(format!(
            "template '{name}' is built in"
        )));
    }
    if let Some(t) = tags.iter().find(|t| !valid_tag(t)) {
        return Err(BuildError::Invalid(format!(
            "tag {t:?}: use 1-64 of letters, digits, '-', '_', '.'"
        )));
    }
    if tags.is_empty() {
        tags.push("default".into());
    }
    tags.dedup();
    let row = BuildRow {
        id: uuid(),
        template: name.to_string(),
        status,
        reason: None,
        reason_step: None,
        tags,
        cpu_count: machine.vcpus,
        memory_mb: machine.memory_mib,
        snapshot_id: None,
        created_ms: now_ms(),
        finished_ms: None,
    };
    db.insert_build(&row)?;
    Ok(row)
}

/// Record how `build` ended; a ready one's template is published.
pub fn conclude(db: &Db, build: &BuildRow, result: &Result<run::Built, run::Failure>) {
    let ended = match result {
        Ok(built) => publish(db, &build.template, &build.id, &build.tags, built)
            .and_then(|()| db.set_build_key(&build.id, &built.key))
            .and_then(|()| {
                db.set_build_status(&build.id, BuildStatus::Ready, None, Some(&built.row.id))
            })
            .map(|_| ()),
        Err(f) => db
            .set_build_status(
                &build.id,
                BuildStatus::Error,
                Some((&f.message, Some(&f.step))),
                None,
            )
            .map(|_| ()),
    };
    if let Err(e) = ended {
        tracing::error!(build = %build.id, "recording the end of a build: {e}");
        let _ = db.set_build_status(
            &build.id,
            BuildStatus::Error,
            Some((&e.to_string(), Some("finalize"))),
            None,
        );
    }
}

/// Make a built template visible: insert its row (a cached build reuses
/// its capture), point each tag at it, hide the template's older
/// captures that no tag points at any more.
pub fn publish(
    db: &Db,
    template: &str,
    build_id: &str,
    tags: &[String],
    built: &run::Built,
) -> Result<(), DbError> {
    if !built.cached {
        db.insert_snapshot(&built.row)?;
    }
    for tag in tags {
        db.set_tag(template, tag, &built.row.id, build_id)?;
    }
    for old in db.list_templates()? {
        if old.names.first().map(String::as_str) == Some(template)
            && old.id != built.row.id
            && !db.is_tagged(&old.id)?
        {
            db.hide_snapshot(&old.id)?;
        }
    }
    Ok(())
}

/// `fromImageRegistry`: user name and password of a registry (`type`
/// `registry`); AWS and GCP registries are not supported.
fn registry_credentials(
    v: Option<&serde_json::Value>,
) -> Result<Option<tine_image::Credentials>, BuildError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    match v.get("type").and_then(|t| t.as_str()) {
        Some("registry") => {
            let field = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string);
            match (field("username"), field("password")) {
                (Some(username), Some(password)) => {
                    Ok(Some(tine_image::Credentials::new(username, password)))
                }
                _ => Err(BuildError::Invalid("fromImageRegistry: username and password are required".into())),
            }
        }
        Some(t @ ("aws" | "gcp")) => Err(BuildError::Invalid(format!(
            "fromImageRegistry type {t:?} is not supported by tine: use a registry with a user name and password"
        ))),
        other => Err(BuildError::Invalid(format!("fromImageRegistry: unknown type {other:?}"))),
    }
}

pub fn rfc3339_now() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_ids_are_uuids() {
        let u = uuid();
        assert_eq!(u.len(), 36);
        assert_eq!(u.as_bytes()[14], b'4');
        assert_ne!(u, uuid());
    }

    #[test]
    fn registry_credentials_are_checked() {
        let j = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap();
        assert!(registry_credentials(None).unwrap().is_none());
        let c = registry_credentials(Some(&j(
            r#"{"type":"registry","username":"u","password":"p"}"#,
        )))
        .unwrap()
        .unwrap();
        assert_eq!((c.username.as_str(), c.password.as_str()), ("u", "p"));
        let e = registry_credentials(Some(&j(r#"{"type":"aws","awsRegion":"x"}"#))).unwrap_err();
        assert!(e.to_string().contains("not supported"), "{e}");
        assert!(registry_credentials(Some(&j(r#"{"type":"registry","username":"u"}"#))).is_err());
    }
}
