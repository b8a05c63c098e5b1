//! `tine gateway` and `tine cluster`: cluster mode's commands
//! (docs/cluster.md).

use std::path::PathBuf;

use clap::{Args, Subcommand};

#[derive(Args)]
pub struct GatewayArgs {
    /// The gateway's TOML config (see docs/cluster.md).
    #[arg(long, short = 'c', env = "TINE_GATEWAY_CONFIG")]
    config: PathBuf,
    /// Address to listen on (overrides the config file).
    #[arg(long)]
    listen: Option<std::net::SocketAddr>,
}

pub async fn gateway(a: GatewayArgs) -> anyhow::Result<i32> {
    let mut cfg = tine_server::gateway::GatewayConfig::load(&a.config)?;
    if let Some(l) = a.listen {
        cfg.listen = l;
    }
    tine_server::gateway::serve(cfg).await?;
    Ok(0)
}

#[derive(Subcommand)]
pub enum ClusterCommand {
    /// Create an API key in the cluster's catalog and print it (the only
    /// time it is shown); gateways accept it at once.
    CreateKey {
        /// The catalog (as the gateways' postgres_url).
        #[arg(long, env = "TINE_POSTGRES_URL")]
        postgres_url: String,
        #[arg(long, default_value = "default")]
        name: String,
        /// The team it acts for.
        #[arg(long, default_value = "default")]
        team: String,
    },
    /// Revoke a key by id; gateways refuse it within 10 s (they cache keys
    /// that long).
    RevokeKey {
        #[arg(long, env = "TINE_POSTGRES_URL")]
        postgres_url: String,
        id: String,
    },
    /// List the nodes the catalog knows: address, capacity, live
    /// sandboxes, seconds since their last heartbeat.
    Nodes {
        #[arg(long, env = "TINE_POSTGRES_URL")]
        postgres_url: String,
    },
    /// List the captures pushed to the cluster's registry: snapshot id,
    /// team, the node that pushed it, MiB it sent, its names.
    Captures {
        #[arg(long, env = "TINE_POSTGRES_URL")]
        postgres_url: String,
    },
}

pub async fn run(cmd: ClusterCommand) -> anyhow::Result<i32> {
    use tine_server::cluster::catalog::Catalog;
    match cmd {
        ClusterCommand::CreateKey {
            postgres_url,
            name,
            team,
        } => {
            anyhow::ensure!(
                tine_server::db::valid_team(&team),
                "a team name is 1-64 of A-Z a-z 0-9 _ -"
            );
            let catalog = Catalog::connect(&postgres_url).await?;
            let (key, plaintext) = catalog.create_key(&name, &team).await?;
            eprintln!("created key {} (team {})", key.id, key.team);
            println!("{plaintext}");
        }
        ClusterCommand::RevokeKey { postgres_url, id } => {
            let catalog = Catalog::connect(&postgres_url).await?;
            anyhow::ensure!(
                catalog.revoke_key(&id).await?,
                "no key {id} (or it is revoked already)"
            );
            eprintln!("revoked key {id}");
        }
        ClusterCommand::Captures { postgres_url } => {
            let catalog = Catalog::connect(&postgres_url).await?;
            println!(
                "{:<28} {:<16} {:<16} {:>8}  NAMES",
                "SNAPSHOT", "TEAM", "NODE", "SENT MiB"
            );
            for c in tine_server::cluster::captures::list(&catalog).await? {
                println!(
                    "{:<28} {:<16} {:<16} {:>8.1}  {}",
                    c.id,
                    c.team,
                    c.node,
                    c.pushed_bytes as f64 / (1 << 20) as f64,
                    c.names.join(",")
                );
            }
        }
        ClusterCommand::Nodes { postgres_url } => {
            let catalog = Catalog::connect(&postgres_url).await?;
            println!(
                "{:<24} {:<28} {:>9} {:>6} {:>8}",
                "NODE", "ADDRESS", "CAPACITY", "LIVE", "SILENT"
            );
            for n in catalog.nodes().await? {
                println!(
                    "{:<24} {:<28} {:>9} {:>6} {:>7.1}s",
                    n.id,
                    n.status.address,
                    n.status.capacity,
                    n.status.live,
                    n.silent_ms as f64 / 1000.0
                );
            }
        }
    }
    Ok(0)
}
