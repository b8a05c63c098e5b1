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
}

#[derive(Subcommand)]
pub enum KeysCommand {
    /// Create an API key and print it (the only time it is shown).
    Create {
        #[arg(long, default_value = "default")]
        name: String,
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
    tine_server::serve(config, Paths::from_env()).await?;
    Ok(0)
}

pub fn keys(cmd: KeysCommand) -> anyhow::Result<i32> {
    let db = Db::open(&Paths::from_env().data_dir.join("tine.db"))?;
    match cmd {
        KeysCommand::Create { name } => {
            let k = db.create_key(&name)?;
            eprintln!("created key {} ({name}); it is shown only now:", k.key.id);
            println!("{}", k.plaintext);
        }
        KeysCommand::List => {
            for k in db.list_keys()? {
                let state = if k.revoked_ms.is_some() {
                    "revoked"
                } else {
                    "active"
                };
                println!("{}\t{}…\t{state}\t{}", k.id, k.prefix, k.name);
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
