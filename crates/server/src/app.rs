//! The server put together: the database, the VM driver, the sandbox
//! manager and its background jobs, and the HTTP app (the proxy in front
//! of the REST router), served until SIGTERM.

use std::sync::Arc;

use anyhow::Context;
use axum::middleware;
use axum::Router;

use crate::state::AppState;
use crate::{api, builds, db, guest_client, proxy, sandboxes, templates, Config};

/// The whole HTTP app: the proxy sees every request first, so sandbox
/// traffic never meets a REST route; the rest goes to the REST router.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .fallback_service(api::router(state.clone()))
        .layer(middleware::from_fn_with_state(state, proxy::route))
}

/// Open the database, re-adopt or clean up the sandboxes of a previous run,
/// and serve until the process ends.
pub async fn serve(config: Config, mut paths: tine_vmm::Paths) -> anyhow::Result<()> {
    config.validate()?;
    // (Here, not in `validate`: the guard sits above the config's layer.)
    builds::registry_guard::parse_allowed(&config.registries.allow_private)
        .map_err(anyhow::Error::msg)?;
    let _lock = lock_data_dir(&paths.data_dir)?;
    paths.jail = config.jail.clone();
    if std::env::var("TINE_JAIL").is_ok_and(|v| v == "0" || v == "off") {
        paths.jail.enabled = false;
    }
    check_isolation(&config, &paths)?;
    // A cluster's nodes may share a host in tests and small setups, and a
    // sandbox moved from one node to another keeps its id: each node's
    // namespaces carry its name. Before any VM is made or recovered.
    if config.cluster.enabled() {
        tine_vmm::netns::set_scope(&config.cluster.node_id_for(config.listen));
    }
    // Before any VM exists: it sets where veth addresses come from.
    let network = Arc::new(
        crate::network::Network::with_ca(&config.network, &paths.data_dir)
            .map_err(anyhow::Error::msg)?,
    );
    // Fail now, not at the first create, when the host cannot take it.
    tine_vmm::netns::host_setup(tine_vmm::netns::pool())
        .await
        .context("setting up the host's firewall for sandboxes (nftables, IPv4 forwarding)")?;
    let artifacts = paths
        .current_artifacts()
        .resolve()
        .context("guest artifacts")?;
    // RAM of captures used to live on tmpfs; it is on disk now.
    let _ = std::fs::remove_dir_all(paths.shm_dir.join("snapshots"));
    let db = Arc::new(db::Db::open(&paths.data_dir.join("tine.db"))?);
    let driver: Arc<dyn tine_vmm::Driver> = Arc::new(tine_vmm::QemuDriver::new(
        paths.clone(),
        sandboxes::agent::probe(),
    ));
    let templates = Arc::new(
        templates::Templates::new(driver.clone(), artifacts.clone(), db.clone())
            .with_max_base_shapes(config.max_base_shapes),
    );
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("listening on {}", config.listen))?;
    let domain = config.domain();
    let tls = if config.tls.enabled {
        let t = crate::tls::setup(&config.tls, &paths.data_dir, &domain)
            .context("setting up TLS for the domain")?;
        match &t.ca {
            Some(ca) => tracing::info!(
                ca = %ca.display(),
                "HTTPS with tine's local CA: clients trust it with SSL_CERT_FILE / NODE_EXTRA_CA_CERTS"
            ),
            None => tracing::info!("HTTPS with the configured certificate"),
        }
        Some(t)
    } else {
        None
    };
    // Image-based sandboxes read their root disks through the image
    // daemon: keep it up as long as this server runs.
    // (Not fatal: sandboxes on `base` need no daemon; the watchdog below
    // keeps trying.)
    let exe = std::env::current_exe().context("finding the tine binary")?;
    let settings = config.image_daemon();
    let hold = tine_image::nbd::daemon::ensure(&paths.data_dir, &exe, Some(&settings))
        .await
        .map_err(|e| tracing::error!("starting the image daemon: {e}"))
        .ok();
    tokio::spawn(keep_image_daemon(paths.data_dir.clone(), exe, hold));
    let default_machine = tine_vmm::Machine {
        vcpus: config.default_cpu_count,
        memory_mib: config.default_memory_mb,
        ..Default::default()
    };
    let build_env = builds::run::BuildEnv {
        driver: driver.clone(),
        artifacts,
        db: db.clone(),
        templates: templates.clone(),
        files: Arc::new(builds::files::ContextStore::new(
            &paths.data_dir,
            config.build_context_max_bytes,
        )),
        data_dir: paths.data_dir.clone(),
        registries: config.registries.clone(),
        guard_registries: true,
        ready_timeout: std::time::Duration::from_secs(config.build_ready_timeout_secs),
        step_timeout: std::time::Duration::from_secs(config.build_step_timeout_secs),
        network: network.clone(),
    };
    let builds = Arc::new(builds::Builds::new(
        build_env,
        config.max_concurrent_builds,
        default_machine,
        (config.build_layer_ttl_secs > 0)
            .then(|| std::time::Duration::from_secs(config.build_layer_ttl_secs)),
    )?);
    let cluster = config.cluster.enabled().then(|| config.cluster.clone());
    let registries = config.registries.clone();
    let config_listen = config.listen;
    let limits = config.clone();
    let volumes = Arc::new(crate::volumes::Volumes::new(
        db.clone(),
        &paths.data_dir,
        Box::new(move |team| {
            let max = limits.volume_max_bytes;
            limits
                .team_limits(team)
                .max_volume_bytes
                .map_or(max, |cap| cap.min(max))
        }),
    ));
    let exports = Arc::new(crate::volumes::Exports::new(volumes.clone()));
    let key_file =
        (config.secrets_key_file.clone()).unwrap_or_else(|| paths.data_dir.join("secrets.key"));
    let secrets = Arc::new(crate::secrets::Secrets::new(
        db.clone(),
        crate::secrets::Cipher::load_or_create(&key_file).context("the key of secrets")?,
    ));
    let identity = Arc::new(
        crate::identity::Identity::open(
            &paths.data_dir.join("identity"),
            &config.identity,
            format!("http://{}", config.listen),
        )
        .context("workload identity keys")?,
    );
    network.set_vault(secrets.clone(), identity.clone(), db.clone());
    let manager = Arc::new(sandboxes::Manager::new(
        config, db, driver, templates, network, exports,
    ));
    manager
        .recover()
        .await
        .context("recovering sandboxes of the previous run")?;
    // Cluster mode: join before serving (PostgreSQL must answer now).
    let listen = config_listen;
    let link = match &cluster {
        Some(c) => {
            let link = Arc::new(
                crate::cluster::node::NodeLink::join(c, listen, &paths.data_dir)
                    .await
                    .context("joining the cluster ([cluster] in the config)")?,
            );
            tracing::info!(node = %link.id, "cluster node: API calls only from gateways");
            // Secrets are the cluster's, in its catalog.
            secrets
                .share(link.catalog().clone())
                .await
                .context("sharing secrets through the catalog")?;
            tokio::spawn(link.clone().run(manager.clone()));
            Some(link)
        }
        None => None,
    };
    let captures = match (&link, cluster.as_ref().and_then(|c| c.registry.as_deref())) {
        (Some(link), Some(repo)) => {
            tracing::info!(registry = repo, "captures travel through the registry");
            Some(Arc::new(crate::cluster::captures::Captures::new(
                &link.id,
                repo,
                registries,
                link.catalog().clone(),
                paths.clone(),
                cluster
                    .as_ref()
                    .and_then(|c| c.durable_pause)
                    .unwrap_or(true),
                cluster.as_ref().and_then(|c| c.lazy_pull).unwrap_or(true),
            )))
        }
        _ => None,
    };
    if let Some(c) = &captures {
        tokio::spawn(c.clone().run(manager.db_arc()));
        tokio::spawn(c.clone().empty_trash());
    }
    tokio::spawn(manager.clone().sweep_loop());
    tokio::spawn(manager.clone().sample_loop());
    tokio::spawn(manager.clone().compaction_loop());
    manager.warm_up();
    let telemetry = manager.telemetry();
    let state = Arc::new(AppState {
        volumes,
        secrets,
        identity,
        client: guest_client::client(manager.clone()),
        manager,
        metrics: telemetry,
        domain,
        data_dir: paths.data_dir.clone(),
        builds,
        idempotency: Default::default(),
        cluster_secret: link.as_ref().map(|l| l.secret.clone()),
        captures,
    });
    tracing::info!(addr = %listener.local_addr()?, "tine server listening");
    let shutdown_manager = state.manager.clone();
    // On SIGTERM/SIGINT stop accepting and let requests in flight finish,
    // but not for long: SDK streams (process output, watches) can stay
    // open indefinitely, and sandboxes outlive the server anyway.
    let stopping = Arc::new(tokio::sync::Notify::new());
    let notify = stopping.clone();
    let stop = async move {
        shutdown_signal().await;
        notify.notify_one();
    };
    let app = router(state);
    let serve = async move {
        match tls {
            Some(t) => {
                crate::tls::serve(listener, t.acceptor, app, stop).await;
                Ok(())
            }
            None => {
                let listener = crate::proxy::TcpListener(listener);
                // Each request knows its connection's socket: the proxy
                // resets it when a sandbox goes mid-stream.
                let app = app.into_make_service_with_connect_info::<crate::proxy::ClientSocket>();
                axum::serve(listener, app)
                    .with_graceful_shutdown(stop)
                    .await
            }
        }
    };
    tokio::select! {
        r = serve => r?,
        _ = async {
            stopping.notified().await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => tracing::warn!("connections still open after {SHUTDOWN_GRACE:?}; closing them"),
    }
    tracing::info!("shutting down: stopping the warm pool (sandboxes keep running)");
    shutdown_manager.shutdown().await;
    Ok(())
}

/// Start the image daemon again if it dies (QEMU's NBD clients reconnect
/// within a minute), holding it for the server's lifetime.
async fn keep_image_daemon(
    data_dir: std::path::PathBuf,
    exe: std::path::PathBuf,
    mut hold: Option<tine_image::nbd::daemon::Hold>,
) {
    let socket = tine_image::nbd::daemon::socket_path(&data_dir);
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        if tokio::net::UnixStream::connect(&socket).await.is_ok() {
            continue;
        }
        tracing::warn!("the image daemon is gone; starting it again");
        match tine_image::nbd::daemon::ensure(&data_dir, &exe, None).await {
            Ok(h) => drop(hold.replace(h)),
            Err(e) => {
                tracing::error!("restarting the image daemon: {e}");
                tokio::time::sleep(std::time::Duration::from_secs(30)).await;
            }
        }
    }
}

/// How long requests in flight may take to finish after SIGTERM.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(3);

/// SIGINT or SIGTERM.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("installing a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// One server per data directory: a second one would adopt (and clean up
/// after) the first one's sandboxes. The lock lasts as long as the returned
/// handle, i.e. the process.
fn lock_data_dir(dir: &std::path::Path) -> anyhow::Result<nix::fcntl::Flock<std::fs::File>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("server.lock");
    let file =
        std::fs::File::create(&path).with_context(|| format!("opening {}", path.display()))?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(|_| {
        anyhow::anyhow!(
            "another tine server is using {} (it holds {})",
            dir.display(),
            path.display()
        )
    })
}

/// Refuse to run where isolation was required and is missing; say loudly
/// what is weaker than it could be. The data directory becomes 0700: its
/// files are reachable only by tine and, through their jails, by the VMs
/// they belong to.
fn check_isolation(config: &Config, paths: &tine_vmm::Paths) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(&paths.data_dir)?;
    std::fs::set_permissions(&paths.data_dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("chmod 0700 {}", paths.data_dir.display()))?;
    let accel = tine_vmm::Accel::probe();
    if accel == tine_vmm::Accel::Tcg {
        if config.require_kvm {
            anyhow::bail!(
                "require_kvm is set and this host has no usable KVM (no vmx/svm, or /dev/kvm does not open)"
            );
        }
        tracing::warn!(
            "WARNING: guests run under TCG (no KVM here). QEMU's security policy treats only KVM \
             guests as a security boundary: a bug in TCG or an emulated device is a way out of the \
             guest. The jail confines what such a QEMU could do next; set require_kvm = true to \
             refuse TCG. See docs/security.md."
        );
    }
    if !paths.jail.enabled {
        tracing::warn!(
            "WARNING: the jail is off ([jail] enabled = false or TINE_JAIL=0): every QEMU runs as \
             tine's own user with tine's view of the host"
        );
    }
    Ok(())
}
