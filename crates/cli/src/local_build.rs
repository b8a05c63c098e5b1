//! Template builds run in this process by the one build engine, the server
//! crate's [`run::execute`] (the same that runs the SDK's `Template`
//! builds): `tine template build` with a Dockerfile or with `--run`,
//! `--start`, `--ready` and `--from-image`, and the image benchmark. Each
//! option is a build step or a part of the plan, so every build is cached
//! step by step, logged the same way and recorded as a build.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use tine_server::builds::{self, files::ContextStore, run, steps::Step};
use tine_server::db::{BuildStatus, Db};
use tine_server::templates::{Templates, DEFAULT_TEMPLATE};
use tine_vmm::{Machine, Paths};

/// What a build starts from.
pub enum From {
    /// `base`.
    Template,
    /// An OCI image (pulled if it is not in the local store).
    Image(String),
}

pub struct Request {
    pub name: String,
    pub machine: Machine,
    pub base: From,
    pub steps: Vec<Step>,
    pub start: Option<String>,
    pub ready: Option<String>,
    pub ready_timeout: Duration,
    pub no_cache: bool,
    pub registry: crate::image::RegistryArgs,
    /// Where `COPY` steps' archives are (none without them).
    pub files: Arc<ContextStore>,
    /// No progress lines (benchmarks).
    pub quiet: bool,
}

/// The steps of `tine template build --run CMD…`: each command as root,
/// and root for the start and ready commands too (sandboxes of the
/// template still run as `user`).
pub fn root_steps(run: &[String]) -> Vec<Step> {
    let mut steps = vec![Step::new("USER", &["root"])];
    steps.extend(run.iter().map(|cmd| Step::new("RUN", &[cmd])));
    steps
}

/// Build `req`; returns the template's snapshot id.
pub async fn build(paths: &Paths, db: Arc<Db>, req: Request) -> anyhow::Result<String> {
    let (base, _daemon) = match &req.base {
        From::Template => (run::Base::Template(DEFAULT_TEMPLATE.into()), None),
        From::Image(reference) => {
            let store = tine_image::ImageStore::new(&paths.data_dir);
            let meta = match store.get(reference) {
                Ok(meta) => meta,
                Err(_) => crate::image::pull(paths, reference, &req.registry, true).await?,
            };
            // The build VM reads a chunked image through the daemon.
            let hold = match meta.chunks {
                Some(_) => Some(crate::image::hold_daemon(paths, &req.registry).await?),
                None => None,
            };
            let base = run::Base::Image {
                reference: reference.clone(),
                credentials: req.registry.credentials(),
            };
            (base, hold)
        }
    };
    let driver: Arc<dyn tine_vmm::Driver> = Arc::new(crate::driver(paths));
    let artifacts = paths.current_artifacts().resolve()?;
    let env = run::BuildEnv {
        driver: driver.clone(),
        artifacts: artifacts.clone(),
        db: db.clone(),
        templates: Arc::new(Templates::new(driver, artifacts, db.clone())),
        files: req.files.clone(),
        data_dir: paths.data_dir.clone(),
        registries: req.registry.options()?,
        // The operator's own build: any registry it names.
        guard_registries: false,
        ready_timeout: req.ready_timeout,
        step_timeout: Duration::from_secs(3600),
        // The default policy with default settings (a server's [network]
        // section does not apply to a build run from the CLI).
        network: Arc::new(
            tine_server::network::Network::new(&Default::default()).map_err(anyhow::Error::msg)?,
        ),
    };
    let row = builds::new_build(
        &db,
        &req.name,
        Vec::new(),
        req.machine,
        BuildStatus::Building,
    )
    .map_err(anyhow::Error::msg)?;
    let plan = run::Plan {
        template: row.template.clone(),
        // The operator's: shared templates are the default team's.
        team: tine_server::db::DEFAULT_TEAM.to_string(),
        build_id: row.id.clone(),
        base,
        steps: req.steps,
        start: req.start,
        ready: req.ready,
        force: req.no_cache,
        machine: req.machine,
    };
    let started = Instant::now();
    let bar = indicatif::ProgressBar::new_spinner();
    if req.quiet {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    } else {
        bar.enable_steady_tick(Duration::from_millis(120));
    }
    let printer = bar.clone();
    let quiet = req.quiet;
    let log: run::Log = Arc::new(move |level, msg: String| {
        if quiet {
            return;
        }
        let line = format!(
            "[{:>6.1}s] {}{msg}",
            started.elapsed().as_secs_f64(),
            match level {
                run::Level::Warn => "warning: ",
                run::Level::Error => "error: ",
                _ => "",
            }
        );
        if printer.is_hidden() {
            eprintln!("{line}");
        } else {
            printer.println(line);
        }
        if msg.starts_with('[') || msg.starts_with("CACHED") || msg.starts_with("FROM") {
            printer.set_message(msg);
        }
    });
    let result = run::execute(&env, &plan, &log).await;
    bar.finish_and_clear();
    builds::conclude(&db, &row, &result);
    if let Some(b) = result.as_ref().ok().filter(|b| !b.cached) {
        run::compact_template(&env, &b.row.id).await;
    }
    match result {
        Ok(b) => {
            if !quiet {
                eprintln!(
                    "template {} built in {:.1} s (snapshot {}, build {})",
                    row.template,
                    started.elapsed().as_secs_f64(),
                    b.row.id,
                    row.id
                );
            }
            Ok(b.row.id)
        }
        Err(f) => bail!(
            "building {} failed at step {}: {}",
            row.template,
            f.step,
            f.message
        ),
    }
}
