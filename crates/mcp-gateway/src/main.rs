//! `mcp-gateway`: the MCP gateway of tine's `mcp-gateway` template, what
//! E2B's `Sandbox.create(mcp={...})` runs in the sandbox.
//!
//!   mcp-gateway --config JSON   check, start `serve` detached, wait until ready
//!   mcp-gateway serve           the gateway: MCP over streamable HTTP on :50005/mcp
//!   mcp-gateway pull NAME...    exit 0 if every NAME is in this template's catalog
//!
//! Exit codes: 0 ok, 1 the gateway failed to start, 2 a bad config or usage.

mod catalog;
mod gateway;
mod http;
mod launch;

use anyhow::Context;

const USAGE: &str = "usage: mcp-gateway --config JSON | serve | pull NAME...";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let result = match args.as_slice() {
        ["--config", config] => launch::run(config),
        [c] if c.starts_with("--config=") => launch::run(&c["--config=".len()..]),
        ["serve"] => serve(),
        ["pull", names @ ..] if !names.is_empty() => pull(names),
        ["--help" | "-h"] => {
            println!("{USAGE}\n\nservers in this template:");
            for e in catalog::CATALOG {
                println!("  {:<20} {:<62} {}", e.key, e.package, e.params);
            }
            Ok(())
        }
        _ => {
            eprintln!("mcp-gateway: {USAGE}");
            std::process::exit(2);
        }
    };
    if let Err(e) = result {
        eprintln!("mcp-gateway: {e:#}");
        let bad_config = e.downcast_ref::<catalog::ConfigError>().is_some();
        std::process::exit(if bad_config { 2 } else { 1 });
    }
}

/// The servers are in the template already; `pull` checks the names.
fn pull(names: &[&str]) -> anyhow::Result<()> {
    for n in names {
        catalog::find(n)?;
        println!("{n}: installed in this template");
    }
    Ok(())
}

#[tokio::main]
async fn serve() -> anyhow::Result<()> {
    let dir = launch::state_dir();
    let config = std::fs::read_to_string(dir.join("config.json"))
        .with_context(|| format!("reading {}", dir.join("config.json").display()))?;
    let token = std::fs::read_to_string(dir.join(".token"))
        .with_context(|| format!("reading {}", dir.join(".token").display()))?;
    let launches = catalog::resolve(&config)?;
    // Started together (an interpreter's start is slow in a TCG guest).
    let mut starting = Vec::new();
    for l in launches {
        eprintln!(
            "mcp-gateway: starting {}: {} {}",
            l.name,
            l.program,
            l.args.join(" ")
        );
        starting.push(tokio::spawn(
            async move { gateway::Backend::start(&l).await },
        ));
    }
    let mut backends = Vec::new();
    for s in starting {
        backends.push(s.await??);
    }
    let gw = gateway::Gateway::new(backends).await?;
    eprintln!("mcp-gateway: tools: {}", gw.tool_names().join(", "));
    let addr = launch::listen_addr();
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("listening on {addr}"))?;
    eprintln!("mcp-gateway: serving MCP on http://{addr}/mcp");
    axum::serve(
        listener,
        http::app(http::mcp_service(gw), token.trim().to_string()),
    )
    .await?;
    Ok(())
}
