//! `tine template build -f Dockerfile [CONTEXT] NAME`: the Dockerfile's
//! steps (the same the SDK's `from_dockerfile` sends), each `COPY`'s
//! sources packed from the context, built by the server crate's build
//! runner in this process, with a line per step and its log.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tine_server::builds::{self, dockerfile, files::ContextStore, run};
use tine_server::db::{BuildStatus, Db};
use tine_server::templates::{Templates, DEFAULT_TEMPLATE};
use tine_vmm::{Machine, Paths};

pub struct Args {
    pub file: PathBuf,
    pub context: Option<PathBuf>,
    pub name: String,
    pub machine: Machine,
    pub ready: Option<String>,
    pub ready_timeout: Duration,
    pub no_cache: bool,
    pub registry: crate::image::RegistryArgs,
}

pub async fn build(paths: &Paths, db: Arc<Db>, a: Args) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading {}", a.file.display()))?;
    let parsed = dockerfile::parse(&text).map_err(anyhow::Error::msg)?;
    for w in &parsed.warnings {
        eprintln!("warning: {}: {w}", a.file.display());
    }
    let context = match &a.context {
        Some(c) => c.clone(),
        None => a
            .file
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| ".".into()),
    };
    let files = Arc::new(ContextStore::new(&paths.data_dir, u64::MAX));
    let mut steps = parsed.steps.clone();
    for s in steps.iter_mut().filter(|s| s.kind == "COPY") {
        let archive = pack(&context, &s.args[0])?;
        s.files_hash = Some(files.insert_local(archive.path())?);
    }
    let repo = parsed.from.split([':', '@']).next().unwrap_or_default();
    let (base, _daemon) = if parsed.from == DEFAULT_TEMPLATE || repo == "e2bdev/base" {
        (run::Base::Template(DEFAULT_TEMPLATE.into()), None)
    } else {
        let meta = crate::image::pull(paths, &parsed.from, &a.registry, true).await?;
        let hold = match meta.chunks {
            Some(_) => Some(crate::image::hold_daemon(paths, &a.registry).await?),
            None => None,
        };
        let base = run::Base::Image {
            reference: parsed.from.clone(),
            credentials: a.registry.credentials(),
        };
        (base, hold)
    };
    let driver: Arc<dyn tine_vmm::Driver> = Arc::new(crate::driver(paths));
    let artifacts = paths.current_artifacts().resolve()?;
    let env = run::BuildEnv {
        driver: driver.clone(),
        artifacts: artifacts.clone(),
        db: db.clone(),
        templates: Arc::new(Templates::new(driver, artifacts, db.clone())),
        files,
        data_dir: paths.data_dir.clone(),
        registries: a.registry.options()?,
        ready_timeout: a.ready_timeout,
        step_timeout: Duration::from_secs(3600),
        // The default policy with default settings (a server's [network]
        // section does not apply to a build run from the CLI).
        network: Arc::new(
            tine_server::network::Network::new(&Default::default()).map_err(anyhow::Error::msg)?,
        ),
    };
    let row = builds::new_build(&db, &a.name, Vec::new(), a.machine, BuildStatus::Building)
        .map_err(anyhow::Error::msg)?;
    let plan = run::Plan {
        template: row.template.clone(),
        build_id: row.id.clone(),
        base,
        steps,
        start: parsed.start.clone(),
        ready: a.ready.clone(),
        force: a.no_cache,
        machine: a.machine,
    };
    let started = Instant::now();
    let bar = indicatif::ProgressBar::new_spinner();
    bar.enable_steady_tick(Duration::from_millis(120));
    let printer = bar.clone();
    let log: run::Log = Arc::new(move |level, msg: String| {
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
            eprintln!(
                "template {} built in {:.1} s (snapshot {}, build {})",
                row.template,
                started.elapsed().as_secs_f64(),
                b.row.id,
                row.id
            );
            Ok(())
        }
        Err(f) => bail!(
            "building {} failed at step {}: {}",
            row.template,
            f.step,
            f.message
        ),
    }
}

/// A tar of the context's `src` (a path, or a glob: then the whole
/// context), with names relative to the context, as the SDK packs them.
fn pack(context: &Path, src: &str) -> anyhow::Result<tempfile::NamedTempFile> {
    let tmp = tempfile::NamedTempFile::new()?;
    let mut t = tar::Builder::new(tmp.reopen()?);
    t.follow_symlinks(false);
    let rel = src.trim_end_matches('/');
    if src.contains(['*', '?', '[']) || rel == "." || rel.is_empty() {
        t.append_dir_all(".", context)
            .with_context(|| format!("packing the build context {}", context.display()))?;
    } else {
        let path = context.join(rel);
        let meta = std::fs::symlink_metadata(&path).with_context(|| {
            format!("COPY {src}: not in the build context {}", context.display())
        })?;
        if meta.is_dir() {
            t.append_dir_all(rel, &path)
        } else {
            t.append_path_with_name(&path, rel)
        }
        .with_context(|| format!("packing {}", path.display()))?;
    }
    t.finish()?;
    Ok(tmp)
}
