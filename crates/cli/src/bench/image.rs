//! P8: the first sandbox of an image this host has never seen, started
//! lazily from the image's converted form in its registry, against a full
//! pull and conversion of the same image followed by the same start; and
//! the bytes the lazy start fetched against the whole converted image.
//!
//! Each side gets a fresh data dir of its own (an empty store and cache)
//! and its own image daemon; "start" is `tine template build --from-image`
//! with no commands: boot on the image, add the `user` account, capture.
//! The image is the `base` rootfs tarball as one layer, pushed to Debian's
//! docker-registry on loopback, converted, started once and pushed by a
//! third host (so the artifact carries the order a boot reads chunks in,
//! which the lazy side prefetches).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tine_image::nbd::daemon;
use tine_image::{ImageRef, ImageStore, RegistryOptions};
use tine_server::db::Db;
use tine_vmm::{Machine, Paths};

use super::create::ms;
use super::env::{free_port, link_artifacts};
use super::report::Row;
use super::{Ctx, Out};

struct Registry {
    child: Child,
    dir: PathBuf,
    host: String,
}

impl Registry {
    async fn start(dir: &Path) -> anyhow::Result<Self> {
        let bin = ["/usr/bin/docker-registry", "/usr/sbin/docker-registry"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .context("P8 needs Debian's docker-registry (tests/e2e/setup.sh installs it)")?;
        std::fs::create_dir_all(dir)?;
        let port = free_port()?;
        let config = dir.join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog: {{level: error}}\n\
                 storage: {{filesystem: {{rootdirectory: {}/data}}}}\n\
                 http: {{addr: '127.0.0.1:{port}'}}\n",
                dir.display()
            ),
        )?;
        let child = Command::new(bin)
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting docker-registry")?;
        let host = format!("127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(30);
        while tokio::net::TcpStream::connect(&host).await.is_err() {
            if Instant::now() > deadline {
                bail!("docker-registry did not listen on {host}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(Self {
            child,
            dir: dir.to_path_buf(),
            host,
        })
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A fresh host: its own data dir, with the guest artifacts linked in.
fn host(ctx: &Ctx, root: &Path, name: &str) -> anyhow::Result<Paths> {
    let paths = Paths {
        data_dir: root.join(name),
        shm_dir: PathBuf::from(format!("{}-p8-{name}", ctx.paths.shm_dir.display())),
        jail: ctx.paths.jail.clone(),
        track_writes: ctx.paths.track_writes,
        balloon: ctx.paths.balloon,
        guest_tsc: ctx.paths.guest_tsc,
    };
    let _ = std::fs::remove_dir_all(&paths.data_dir);
    link_artifacts(&Paths::from_env(), &paths)?;
    Ok(paths)
}

fn stop_daemon(paths: &Paths) {
    let _ = Command::new("pkill")
        .arg("-f")
        .arg(format!(
            "image nbd-daemon --data-dir {}$",
            paths.data_dir.display()
        ))
        .status();
}

/// Pull `reference` into `paths` (lazily or not), then build a template on
/// it; returns the milliseconds taken and the daemon's statistics.
async fn first_start(
    ctx: &Ctx,
    paths: &Paths,
    reference: &str,
    lazy: bool,
) -> anyhow::Result<(f64, tine_image::chunks::cache::CacheStats)> {
    let exe = std::env::current_exe()?;
    let settings = daemon::Settings::default();
    let t = Instant::now();
    let store = ImageStore::new(&paths.data_dir);
    store
        .pull(
            reference,
            &RegistryOptions::default(),
            None,
            lazy,
            &mut |_| {},
        )
        .await?;
    let _hold = daemon::ensure(&paths.data_dir, &exe, Some(&settings)).await?;
    let db = std::sync::Arc::new(Db::open(&paths.data_dir.join("tine.db"))?);
    let request = crate::local_build::Request {
        name: "p8".into(),
        machine: Machine {
            vcpus: ctx.args.cpus,
            memory_mib: ctx.args.memory_mb,
            ..Machine::default()
        },
        base: crate::local_build::From::Image(reference.to_string()),
        steps: Vec::new(),
        start: None,
        ready: None,
        ready_timeout: Duration::from_secs(120),
        no_cache: true,
        registry: Default::default(),
        files: std::sync::Arc::new(tine_server::builds::files::ContextStore::new(
            &paths.data_dir,
            u64::MAX,
        )),
        quiet: true,
    };
    crate::local_build::build(paths, db, request).await?;
    let elapsed = ms(t);
    // The daemon writes its statistics every second.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let stats = daemon::read_stats(&paths.data_dir).unwrap_or_default();
    Ok((elapsed, stats))
}

pub async fn p8(ctx: &Ctx, out: &mut Out) -> anyhow::Result<()> {
    let n = ctx.iterations(1);
    let root = ctx
        .floor_paths
        .data_dir
        .parent()
        .unwrap_or(Path::new("/tmp"))
        .join("bench-p8");
    let _ = std::fs::remove_dir_all(&root);
    let registry = Registry::start(&root.join("registry")).await?;
    let base = std::fs::canonicalize(Paths::from_env().data_dir.join("current/rootfs-base.ext4"))?;
    let tar = base.with_extension("tar");
    ctx.step(format!("pushing {} as an image", tar.display()));
    let reference = format!("{}/bench/debian:v1", registry.host);
    let layer = std::fs::read(&tar).with_context(|| format!("reading {}", tar.display()))?;
    let image_bytes = layer.len() as u64;
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": []},
    });
    tine_image::registry::push_image(
        &ImageRef::parse(&reference)?,
        vec![(layer, "application/vnd.oci.image.layer.v1.tar".into())],
        serde_json::to_vec(&config)?,
        &RegistryOptions::default(),
        None,
    )
    .await?;
    // Host a converts it, starts it once (its daemon records the order the
    // boot reads chunks in) and pushes it with that order.
    ctx.step("converting, starting and pushing it once (host a)");
    let a = host(ctx, &root, "a")?;
    first_start(ctx, &a, &reference, false).await?;
    let store = ImageStore::new(&a.data_dir);
    let opts = RegistryOptions::default();
    store.push(&reference, &opts, None, &mut |_| {}).await?;
    let meta = store.get(&reference)?;
    let reads = a
        .data_dir
        .join("images")
        .join(meta.manifest_digest.trim_start_matches("sha256:"))
        .join(daemon::READS);
    let boot_order = std::fs::read(&reads)
        .ok()
        .and_then(|b| serde_json::from_slice::<Vec<usize>>(&b).ok())
        .map_or(0, |o| o.len());
    let stored = meta.chunks.as_ref().map_or(0, |c| c.stored_bytes);

    let (mut eager, mut lazy, mut fetched) = (Vec::new(), Vec::new(), Vec::new());
    let mut errors = Vec::new();
    for i in 0..n {
        for lazy_side in [false, true] {
            let name = format!("{}{i}", if lazy_side { "lazy" } else { "eager" });
            ctx.step(format!("{name}: pull and first start"));
            let paths = host(ctx, &root, &name)?;
            let result = first_start(ctx, &paths, &reference, lazy_side).await;
            stop_daemon(&paths);
            let _ = std::fs::remove_dir_all(&paths.data_dir);
            match result {
                Ok((t, stats)) if lazy_side => {
                    lazy.push(t);
                    fetched.push(stats.fetched_bytes as f64 / (1 << 20) as f64);
                }
                Ok((t, _)) => eager.push(t),
                Err(e) => errors.push(format!("{name}: {e:#}")),
            }
        }
    }
    stop_daemon(&a);
    drop(registry);
    let _ = std::fs::remove_dir_all(&root);
    let error = (!errors.is_empty()).then(|| errors.join("; "));
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    out.rows.push(
        Row::new("P8", "first sandbox of a new image, lazy", "ms")
            .samples(lazy)
            .floor("full pull + convert, then the same start", eager)
            .param("image_tar_mib", mib(image_bytes))
            .param("boot_order_chunks", boot_order)
            .ratio_target(0.3, "≤ 0.3× the full pull")
            .error(error.clone()),
    );
    out.rows.push(
        Row::new("P8", "bytes fetched by the lazy start", "MiB")
            .samples(fetched)
            .floor(
                "the whole converted image (distinct chunks, compressed)",
                vec![mib(stored)],
            )
            .param("image_tar_mib", mib(image_bytes))
            .ratio_target(0.2, "≤ 20 % of the image")
            .error(error),
    );
    Ok(())
}
