//! `tine image pull | push | fetch | list | rm | prune`: OCI images in the
//! local store, which templates run on (`tine template build NAME
//! --from-image REF`), and the image daemon that serves their disks.

use anyhow::Context;
use clap::{Args, Subcommand};
use tine_image::chunks::remote::PushProgress;
use tine_image::nbd::daemon;
use tine_image::registry::Progress;
use tine_image::{Credentials, ImageMeta, ImageStore, RegistryOptions};
use tine_vmm::Paths;

#[derive(Subcommand)]
pub enum ImageCommand {
    /// Pull an image: only its chunk index when its registry has it
    /// converted (`tine image push`), else its layers, converted here.
    Pull {
        reference: String,
        /// Fetch and convert the layers even if a converted form exists.
        #[arg(long)]
        no_lazy: bool,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// Push a converted image next to it in its registry, so that other
    /// hosts start it lazily; its chunks here become evictable cache.
    Push {
        reference: String,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// Read every chunk of an image through the image daemon (fetching
    /// what is missing), as a guest would; reports chunks that fail.
    Fetch { reference: String },
    /// List pulled images and the chunk cache.
    List,
    /// Remove an image (refused while a template or snapshot runs on it).
    Rm { reference: String },
    /// Remove every image no template or snapshot runs on.
    Prune,
    /// Serve the image store's disks over NBD (started on demand).
    #[command(hide = true)]
    NbdDaemon {
        #[arg(long)]
        data_dir: std::path::PathBuf,
    },
}

/// How to reach a registry.
#[derive(Args, Clone, Default)]
pub struct RegistryArgs {
    /// User name for the image's registry.
    #[arg(long)]
    pub username: Option<String>,
    /// Password or token for the image's registry.
    #[arg(long, env = "TINE_REGISTRY_PASSWORD", hide_env_values = true)]
    pub password: Option<String>,
    /// A registry (`host:port`) to speak plain HTTP to (loopback ones
    /// always are); repeatable.
    #[arg(long = "insecure-registry")]
    pub insecure: Vec<String>,
    /// The server's TOML config, for its `[registries]` table (insecure
    /// registries, mirrors, credentials).
    #[arg(long, env = "TINE_CONFIG")]
    pub config: Option<std::path::PathBuf>,
}

impl RegistryArgs {
    /// What the image daemon should be told: only when a config file was
    /// given (else the server's settings stay).
    pub fn daemon_settings(&self) -> anyhow::Result<Option<daemon::Settings>> {
        if self.config.is_none() {
            return Ok(None);
        }
        let cfg = tine_server::Config::load(self.config.as_deref())?;
        let mut settings = cfg.image_daemon();
        settings.registries = self.options()?;
        Ok(Some(settings))
    }

    pub fn options(&self) -> anyhow::Result<RegistryOptions> {
        let mut opts = tine_server::Config::load(self.config.as_deref())?.registries;
        opts.insecure.extend(self.insecure.iter().cloned());
        Ok(opts)
    }

    pub fn credentials(&self) -> Option<Credentials> {
        Some(Credentials::new(
            self.username.clone()?,
            self.password.clone().unwrap_or_default(),
        ))
    }
}

/// When only build layers run on `reference`'s image (the step cache of
/// builds from it, which no template or sandbox uses: those would run on
/// the image too), delete them, so the image can go; returns how many.
/// Anything else on it is left, and `rm` then refuses, naming it.
fn drop_build_layers(paths: &Paths, store: &ImageStore, reference: &str) -> anyhow::Result<usize> {
    let Ok(users) = store.snapshots_on(reference, &paths.snapshots_dir()) else {
        return Ok(0); // (an unknown reference: `rm` says so)
    };
    if users.is_empty() {
        return Ok(0);
    }
    let db = tine_server::db::Db::open(&paths.data_dir.join("tine.db"))?;
    // A layer's row, or a layer whose row is already deleted (its files
    // wait for a collection).
    let is_layer = |id: &String| match db.get_snapshot(id) {
        Ok(Some(row)) => row.kind == tine_server::db::SnapshotKind::Layer,
        Ok(None) => id.starts_with(tine_server::builds::run::LAYER_ID_PREFIX),
        Err(_) => false,
    };
    if !users.iter().all(is_layer) {
        return Ok(0);
    }
    let driver = crate::driver(paths);
    use tine_vmm::Driver as _;
    for id in &users {
        db.hide_snapshot(id)?;
        driver
            .snapshots()
            .delete_snapshot(id)
            .with_context(|| format!("deleting build layer {id}"))?;
    }
    Ok(users.len())
}

/// Make sure the image daemon of `paths` runs; it stays while the result
/// lives.
pub async fn hold_daemon(paths: &Paths, registry: &RegistryArgs) -> anyhow::Result<daemon::Hold> {
    let exe = std::env::current_exe().context("finding the tine binary")?;
    let settings = registry.daemon_settings()?;
    Ok(daemon::ensure(&paths.data_dir, &exe, settings.as_ref()).await?)
}

/// Pull `reference` with a progress bar; the image's metadata.
pub async fn pull(
    paths: &Paths,
    reference: &str,
    registry: &RegistryArgs,
    lazy: bool,
) -> anyhow::Result<ImageMeta> {
    let store = ImageStore::new(&paths.data_dir);
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(format!("pulling {reference}"));
    let mut progress = |p: Progress| match p {
        Progress::Manifest { layers, bytes } => {
            bar.set_length(bytes);
            if bar.is_hidden() {
                eprintln!("{reference}: {layers} layers, {bytes} bytes");
            }
        }
        Progress::Layer {
            index,
            digest,
            size,
            cached,
        } => {
            bar.inc(size);
            if bar.is_hidden() {
                let how = if cached { "stored already" } else { "fetched" };
                eprintln!("layer {} {digest}: {size} bytes {how}", index + 1);
            }
        }
        Progress::Lazy { chunks, bytes } => {
            let line = format!(
                "{reference}: converted in its registry ({chunks} chunks, {bytes} bytes): fetched on first read"
            );
            match bar.is_hidden() {
                true => eprintln!("{line}"),
                false => bar.println(line),
            }
        }
        Progress::Converting => {
            bar.set_message(format!("converting {reference}"));
            if bar.is_hidden() {
                eprintln!("{reference}: converting");
            }
        }
    };
    let started = std::time::Instant::now();
    let meta = store
        .pull(
            reference,
            &registry.options()?,
            registry.credentials().as_ref(),
            lazy,
            &mut progress,
        )
        .await;
    bar.finish_and_clear();
    let meta = meta?;
    eprintln!(
        "{reference}: {} ({} layers, {} bytes) ready in {:.1} s",
        meta.manifest_digest,
        meta.layers.len(),
        meta.size,
        started.elapsed().as_secs_f64()
    );
    Ok(meta)
}

/// Push with a progress bar.
async fn push(store: &ImageStore, reference: &str, registry: &RegistryArgs) -> anyhow::Result<()> {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} chunks")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(format!("pushing {reference}"));
    let (mut sent, mut skipped) = (0u64, 0usize);
    let mut progress = |p: PushProgress| {
        bar.set_length(p.total as u64);
        bar.set_position(p.done as u64);
        match p.skipped {
            true => skipped += 1,
            false => sent += p.bytes,
        }
    };
    let target = store
        .push(
            reference,
            &registry.options()?,
            registry.credentials().as_ref(),
            &mut progress,
        )
        .await;
    bar.finish_and_clear();
    let target = target?;
    eprintln!("pushed {target}: {sent} bytes sent, {skipped} chunks the registry had");
    Ok(())
}

/// Read every stored chunk of `reference` through the daemon.
async fn fetch(paths: &Paths, store: &ImageStore, reference: &str) -> anyhow::Result<i32> {
    let meta = store.get(reference)?;
    let index = store.index(&meta)?;
    let _hold = hold_daemon(paths, &RegistryArgs::default()).await?;
    let export = meta.manifest_digest.trim_start_matches("sha256:");
    let socket = daemon::socket_path(&paths.data_dir);
    let mut client = tine_image::nbd::client::Client::open(&socket, export).await?;
    let bar = indicatif::ProgressBar::new(index.chunks.iter().flatten().count() as u64);
    let mut failed = Vec::new();
    for (i, c) in index.chunks.iter().enumerate() {
        let Some(c) = c else { continue };
        let off = i as u64 * index.chunk_size;
        let len = index.chunk_size.min(index.disk_size - off) as u32;
        if let Err(errno) = client.read(off, len).await? {
            failed.push(format!("chunk {i} ({}): error {errno}", c.digest));
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    if failed.is_empty() {
        eprintln!("{reference}: every chunk read");
        return Ok(0);
    }
    // The daemon writes its statistics every second.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let why = daemon::read_stats(&paths.data_dir)
        .and_then(|s| s.last_error)
        .unwrap_or_default();
    for f in &failed {
        eprintln!("{reference}: {f}");
    }
    eprintln!(
        "{} chunks could not be read; last error: {why}",
        failed.len()
    );
    Ok(1)
}

pub async fn run(cmd: ImageCommand) -> anyhow::Result<i32> {
    let paths = Paths::from_env();
    let store = ImageStore::new(&paths.data_dir);
    match cmd {
        ImageCommand::Pull {
            reference,
            no_lazy,
            registry,
        } => {
            pull(&paths, &reference, &registry, !no_lazy).await?;
        }
        ImageCommand::Push {
            reference,
            registry,
        } => push(&store, &reference, &registry).await?,
        ImageCommand::Fetch { reference } => return fetch(&paths, &store, &reference).await,
        ImageCommand::List => {
            for (reference, meta) in store.list() {
                let disk = match &meta.chunks {
                    Some(c) => format!(
                        "{} chunks, {} bytes, {}",
                        c.count,
                        c.stored_bytes,
                        c.remote.as_deref().unwrap_or("local only")
                    ),
                    None => "ext4 file".into(),
                };
                println!(
                    "{reference}\t{}\t{} bytes\t{disk}",
                    meta.manifest_digest, meta.size
                );
            }
            if let Some(s) = daemon::read_stats(&paths.data_dir) {
                println!(
                    "cache: {} of {} bytes, {} pinned; {} hits, {} misses, {} bytes fetched, {} evictions, {} errors",
                    s.cached_bytes, s.max_bytes, s.pinned_bytes, s.hits, s.misses,
                    s.fetched_bytes, s.evictions, s.errors
                );
            }
        }
        ImageCommand::Rm { reference } => {
            let dropped = drop_build_layers(&paths, &store, &reference)?;
            if dropped > 0 {
                eprintln!("removed {dropped} build layers on {reference} (a step cache no template or sandbox uses)");
            }
            store.remove(&reference, &paths.snapshots_dir())?;
            eprintln!("removed {reference}");
        }
        ImageCommand::Prune => {
            for r in store.prune(&paths.snapshots_dir())? {
                eprintln!("removed {r}");
            }
        }
        ImageCommand::NbdDaemon { data_dir } => daemon::run(&data_dir).await?,
    }
    Ok(0)
}
