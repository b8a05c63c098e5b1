//! tine-agent: the process that runs inside every tine sandbox.
//!
//! Inside a VM it is PID 1: [`init`] mounts the pseudo filesystems, loads the
//! kernel modules shipped in the initramfs, switches into the rootfs on
//! virtio-blk and brings up networking. Then (in the VM or as a plain process
//! on the host, which is how most tests run it) it serves the envd-compatible
//! API of [`envd`] on port 49983, and [`reaper`] collects every exited child.

mod envd;
mod init;
mod reaper;

use std::net::SocketAddr;

use anyhow::Context;

/// The port the E2B SDKs expect envd on.
pub const ENVD_PORT: u16 = tine_agent_client::AGENT_PORT;

fn main() {
    let is_init = std::process::id() == 1;
    if let Err(err) = run(is_init) {
        eprintln!("tine-agent: fatal: {err:#}");
        if is_init {
            // PID 1 must not exit: the kernel would panic. Power off instead so
            // the host sees the VM stop and reads the reason in the console log.
            init::power_off();
        }
        std::process::exit(1);
    }
}

fn run(is_init: bool) -> anyhow::Result<()> {
    let args = Args::parse(std::env::args().skip(1))?;
    if is_init {
        init::boot().context("guest init failed")?;
    }
    // `level` or `target=level,...` (no span or field filters: the
    // static agent is built without a regex engine).
    let filter: tracing_subscriber::filter::Targets = std::env::var("TINE_AGENT_LOG")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| "info".parse().expect("a valid filter"));
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                // The guest's stderr is the serial console log: no colour codes.
                .with_ansi(!is_init),
        )
        .with(filter)
        .init();

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(2)
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(async move {
        reaper::global().start()?;
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        tracing::info!(addr = %args.listen, pid1 = is_init, "tine-agent serving");
        envd::serve(listener).await
    })
}

/// Command-line flags. Kept by hand (no clap) so the guest binary stays small
/// and so PID 1, which gets whatever the kernel passes, never fails on them.
struct Args {
    listen: SocketAddr,
}

impl Args {
    fn parse(mut it: impl Iterator<Item = String>) -> anyhow::Result<Self> {
        let mut listen: SocketAddr = ([0, 0, 0, 0], ENVD_PORT).into();
        while let Some(arg) = it.next() {
            match arg.as_str() {
                "--listen" => {
                    let v = it.next().context("--listen needs an address")?;
                    listen = v.parse().with_context(|| format!("bad --listen {v:?}"))?;
                }
                "-h" | "--help" => {
                    println!(
                        "usage: tine-agent [--listen ADDR:PORT]   (default 0.0.0.0:{ENVD_PORT})"
                    );
                    std::process::exit(0);
                }
                // The kernel hands PID 1 any unknown `key=value` words of the
                // command line; ignore them rather than failing the boot.
                _ if std::process::id() == 1 => {}
                other => anyhow::bail!("unknown argument {other:?}"),
            }
        }
        Ok(Self { listen })
    }
}
