//! `tine`: the command-line interface.
//!
//! `tine vm ...` drives single microVMs by hand (boot, exec, snapshot,
//! clone, kill), for debugging and for the foundation's own checks;
//! `tine run` boots the default template and runs one command in it;
//! `tine serve` is the server, `tine keys` manages its API keys.

mod bench;
mod client;
mod cluster;
mod dockerfile;
mod image;
mod local_build;
mod sandbox;
mod server;
mod template;
mod vm;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "tine",
    version,
    about = "Self-hosted microVM sandboxes for agentic RL, speaking the E2B API"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Sandboxes of a running server: list, create, fork, pause, resume,
    /// snapshot, kill (E2B_API_URL, E2B_API_KEY).
    #[command(subcommand)]
    Sandbox(sandbox::SandboxCommand),
    /// Drive single microVMs by hand.
    #[command(subcommand)]
    Vm(vm::VmCommand),
    /// Boot the base template, run one command in it, print its output and
    /// remove the VM.
    Run(vm::RunArgs),
    /// Run the server: the E2B-compatible API and the sandbox proxy.
    Serve(server::ServeArgs),
    /// Manage API keys.
    #[command(subcommand)]
    Keys(server::KeysCommand),
    /// Run a cluster gateway: the one endpoint in front of many nodes
    /// (docs/cluster.md).
    Gateway(cluster::GatewayArgs),
    /// A cluster's catalog: API keys, nodes.
    #[command(subcommand)]
    Cluster(cluster::ClusterCommand),
    /// Build, list and delete templates.
    #[command(subcommand)]
    Template(template::TemplateCommand),
    /// Pull, list and remove OCI images (root disks for templates).
    #[command(subcommand)]
    Image(image::ImageCommand),
    /// Run the performance scenarios P1–P15 against their floors (see
    /// docs/benchmarks.md).
    Bench(bench::BenchArgs),
}

/// The QEMU driver over `paths`, with the agent's readiness probe (the
/// same the server uses).
pub fn driver(paths: &tine_vmm::Paths) -> tine_vmm::QemuDriver {
    tine_vmm::QemuDriver::new(paths.clone(), tine_server::sandboxes::agent::probe())
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TINE_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let code = runtime.block_on(async move {
        match cli.command {
            Command::Sandbox(cmd) => sandbox::run(cmd).await,
            Command::Vm(cmd) => vm::run(cmd).await,
            Command::Run(args) => vm::run_once(args).await,
            Command::Serve(args) => server::serve(args).await,
            Command::Keys(cmd) => server::keys(cmd),
            Command::Gateway(args) => cluster::gateway(args).await,
            Command::Cluster(cmd) => cluster::run(cmd).await,
            Command::Template(cmd) => template::run(cmd).await,
            Command::Image(cmd) => image::run(cmd).await,
            Command::Bench(args) => bench::run(args).await,
        }
    })?;
    std::process::exit(code);
}
