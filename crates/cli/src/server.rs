//! `tine serve` and `tine keys ...`.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::bail;
use clap::{Args, Subcommand};
use tine_server::db::Db;
use tine_vmm::Paths;

#[derive(Args)]
pub struct ServeArgs {
    /// TOML config file (see docs/configuration.md).
    #[arg(long, short = 'c', env = "TINE_CONFIG")]
    config: Option<PathBuf>,
    /// Address to listen on (overrides the config file).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Domain returned to SDKs for get_host(): <port>-<id>.<domain>.
    #[arg(long)]
    domain: Option<String>,
    /// Serve HTTPS for the domain and `*.<domain>` (domain mode: SDKs need
    /// only E2B_DOMAIN). Without --tls-cert/--tls-key, tine's own CA signs
    /// the certificate; its path is printed, to be trusted by clients.
    #[arg(long)]
    tls: bool,
    /// PEM certificate chain for the domain and its wildcard.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

#[derive(Subcommand)]
pub enum KeysCommand {
    /// Create an API key and print it (the only time it is shown).
    Create {
        #[arg(long, default_value = "default")]
        name: String,
        /// The team it acts for: it sees and changes only that team's
        /// sandboxes, snapshots and templates (and the shared base ones).
        #[arg(long, default_value = "default")]
        team: String,
    },
    /// List API keys (their ids and first characters).
    List,
    /// Revoke a key by id.
    Revoke { id: String },
}

pub async fn serve(a: ServeArgs) -> anyhow::Result<i32> {
    let mut config = tine_server::Config::load(a.config.as_deref())?;
    if let Some(l) = a.listen {
        config.listen = l;
    }
    if let Some(d) = a.domain {
        config.domain = Some(d);
    }
    if a.tls || a.tls_cert.is_some() {
        config.tls.enabled = true;
    }
    if a.tls_cert.is_some() {
        config.tls.cert = a.tls_cert;
        config.tls.key = a.tls_key;
    }
    if config.tls.enabled {
        let domain = config.domain();
        let data_dir = Paths::from_env().data_dir;
        eprintln!("domain mode over HTTPS: point the SDKs at it with");
        eprintln!("  export E2B_DOMAIN={domain}");
        if config.tls.cert.is_none() {
            let ca = data_dir.join("tls/ca.crt");
            eprintln!(
                "  export SSL_CERT_FILE={0} NODE_EXTRA_CA_CERTS={0}",
                ca.display()
            );
        }
        eprintln!(
            "  (names under {} must resolve to this host: see docs/domain-mode.md)",
            tine_server::tls::domain_host(&domain)
        );
    }
    tine_server::serve(config, Paths::from_env()).await?;
    Ok(0)
}

pub fn keys(cmd: KeysCommand) -> anyhow::Result<i32> {
    let db = Db::open(&Paths::from_env().data_dir.join("tine.db"))?;
    match cmd {
        KeysCommand::Create { name, team } => {
            if !tine_server::db::valid_team(&team) {
                bail!("a team name is 1 to 64 letters, digits, '-' or '_', got {team:?}");
            }
            let k = db.create_team_key(&name, &team)?;
            eprintln!(
                "created key {} ({name}, team {team}); it is shown only now:",
                k.key.id
            );
            println!("{}", k.plaintext);
        }
        KeysCommand::List => {
            for k in db.list_keys()? {
                let state = if k.revoked_ms.is_some() {
                    "revoked"
                } else {
                    "active"
                };
                println!(
                    "{}\t{}…\t{state}\t{}\tteam {}",
                    k.id, k.prefix, k.name, k.team
                );
            }
        }
        KeysCommand::Revoke { id } => {
            if !db.revoke_key(&id)? {
                bail!("no active key {id}");
            }
            eprintln!("revoked {id}");
        }
    }
    Ok(0)
}
