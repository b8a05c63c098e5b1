//! `tine image pull | list | rm`: OCI images in the local store, which
//! templates run on (`tine template build NAME --from-image REF`).

use clap::{Args, Subcommand};
use tine_image::registry::Progress;
use tine_image::{Credentials, ImageMeta, ImageStore, RegistryOptions};
use tine_vmm::Paths;

#[derive(Subcommand)]
pub enum ImageCommand {
    /// Pull an image from its registry and convert it to a root disk.
    Pull {
        reference: String,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// List pulled images.
    List,
    /// Remove an image (refused while a template or snapshot runs on it).
    Rm { reference: String },
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
    fn options(&self) -> anyhow::Result<RegistryOptions> {
        let mut opts = tine_server::Config::load(self.config.as_deref())?.registries;
        opts.insecure.extend(self.insecure.iter().cloned());
        Ok(opts)
    }

    fn credentials(&self) -> Option<Credentials> {
        Some(Credentials {
            username: self.username.clone()?,
            password: self.password.clone().unwrap_or_default(),
        })
    }
}

/// Pull `reference` with a progress bar; the image's metadata.
pub async fn pull(
    paths: &Paths,
    reference: &str,
    registry: &RegistryArgs,
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
    };
    let started = std::time::Instant::now();
    let meta = store
        .pull(
            reference,
            &registry.options()?,
            registry.credentials().as_ref(),
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

pub async fn run(cmd: ImageCommand) -> anyhow::Result<i32> {
    let paths = Paths::from_env();
    let store = ImageStore::new(&paths.data_dir);
    match cmd {
        ImageCommand::Pull {
            reference,
            registry,
        } => {
            pull(&paths, &reference, &registry).await?;
        }
        ImageCommand::List => {
            for (reference, meta) in store.list() {
                println!("{reference}\t{}\t{} bytes", meta.manifest_digest, meta.size);
            }
        }
        ImageCommand::Rm { reference } => {
            store.remove(&reference, &paths.snapshots_dir())?;
            eprintln!("removed {reference}");
        }
    }
    Ok(0)
}
