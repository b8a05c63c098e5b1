//! `tine template build -f Dockerfile [CONTEXT] NAME`: the Dockerfile's
//! steps (the same the SDK's `from_dockerfile` sends), each `COPY`'s
//! sources packed from the context, built by the one build engine
//! ([`crate::local_build`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tine_server::builds::{dockerfile, files::ContextStore};
use tine_server::db::Db;
use tine_server::templates::DEFAULT_TEMPLATE;
use tine_vmm::{Machine, Paths};

use crate::local_build::{From, Request};

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
        s.files_hash = Some(files.insert_local(tine_server::db::DEFAULT_TEAM, archive.path())?);
    }
    let repo = parsed.from.split([':', '@']).next().unwrap_or_default();
    let base = if parsed.from == DEFAULT_TEMPLATE || repo == "e2bdev/base" {
        From::Template
    } else {
        From::Image(parsed.from.clone())
    };
    crate::local_build::build(
        paths,
        db,
        Request {
            name: a.name,
            machine: a.machine,
            base,
            steps,
            start: parsed.start.clone(),
            ready: a.ready,
            ready_timeout: a.ready_timeout,
            no_cache: a.no_cache,
            registry: a.registry,
            files,
            quiet: false,
        },
    )
    .await
    .map(|_| ())
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
