//! `tine sandbox …`: sandboxes of a running `tine serve`, through its REST
//! API (`E2B_API_URL`, default `http://127.0.0.1:3000`, and `E2B_API_KEY`,
//! the same variables the E2B SDKs read).

use std::time::Instant;

use anyhow::Context;
use clap::{Args, Subcommand};
use hyper::Method;
use serde_json::{json, Value};

use crate::client::Api;

#[derive(Subcommand)]
pub enum SandboxCommand {
    /// List running and paused sandboxes.
    List,
    /// Create a sandbox from a template or snapshot id; prints its id.
    Create(CreateArgs),
    /// Capture a running sandbox and start N children from the capture;
    /// the source keeps running. Prints one child id per line.
    Fork {
        id: String,
        /// How many children (the server caps it at `max_fork_count`).
        #[arg(short = 'n', long, default_value_t = 1)]
        count: usize,
        /// Lifetime of each child in seconds.
        #[arg(long)]
        timeout: Option<u64>,
    },
    /// Pause a sandbox: capture it to disk and free its VM.
    Pause { id: String },
    /// Resume a paused sandbox.
    Resume {
        id: String,
        #[arg(long)]
        timeout: Option<u64>,
    },
    /// Take a snapshot of a running sandbox (it keeps running); prints the
    /// snapshot id, which `create --template` accepts.
    Snapshot { id: String },
    /// Kill sandboxes.
    Kill {
        #[arg(required = true)]
        ids: Vec<String>,
    },
}

#[derive(Args)]
pub struct CreateArgs {
    #[arg(long, default_value = "base")]
    template: String,
    /// Lifetime in seconds.
    #[arg(long)]
    timeout: Option<u64>,
    #[arg(long)]
    cpus: Option<u32>,
    #[arg(long)]
    memory_mb: Option<u32>,
}

fn api() -> anyhow::Result<Api> {
    let url = std::env::var("E2B_API_URL").unwrap_or_else(|_| "http://127.0.0.1:3000".into());
    let key = std::env::var("E2B_API_KEY")
        .ok()
        .filter(|k| !k.is_empty())
        .context("E2B_API_KEY is not set (create one with `tine keys create`)")?;
    Ok(Api::new(&url, &key))
}

pub async fn run(cmd: SandboxCommand) -> anyhow::Result<i32> {
    let api = api()?;
    match cmd {
        SandboxCommand::List => list(&api).await,
        SandboxCommand::Create(a) => create(&api, a).await,
        SandboxCommand::Fork { id, count, timeout } => fork(&api, &id, count, timeout).await,
        SandboxCommand::Pause { id } => pause(&api, &id).await,
        SandboxCommand::Resume { id, timeout } => resume(&api, &id, timeout).await,
        SandboxCommand::Snapshot { id } => snapshot(&api, &id).await,
        SandboxCommand::Kill { ids } => kill(&api, ids).await,
    }
}

/// `list`: one line per running or paused sandbox.
async fn list(api: &Api) -> anyhow::Result<i32> {
    let v = api
        .call(
            Method::GET,
            "/v2/sandboxes?state=running,paused&limit=1000",
            None,
        )
        .await?;
    println!(
        "{:<24} {:<8} {:<28} {:>4} {:>7}  STARTED",
        "ID", "STATE", "TEMPLATE", "CPU", "MEM_MB"
    );
    for s in v.as_array().into_iter().flatten() {
        println!(
            "{:<24} {:<8} {:<28} {:>4} {:>7}  {}",
            s["sandboxID"].as_str().unwrap_or("?"),
            s["state"].as_str().unwrap_or("?"),
            s["templateID"].as_str().unwrap_or("?"),
            s["cpuCount"].as_u64().unwrap_or(0),
            s["memoryMB"].as_u64().unwrap_or(0),
            s["startedAt"].as_str().unwrap_or("")
        );
    }
    Ok(0)
}

/// The body of `POST /v2/sandboxes`: only the options given.
fn create_body(a: &CreateArgs) -> Value {
    let mut body = json!({ "templateID": a.template });
    if let Some(t) = a.timeout {
        body["timeout"] = t.into();
    }
    if let Some(c) = a.cpus {
        body["cpuCount"] = c.into();
    }
    if let Some(m) = a.memory_mb {
        body["memoryMB"] = m.into();
    }
    body
}

/// `create`: prints the new sandbox's id.
async fn create(api: &Api, a: CreateArgs) -> anyhow::Result<i32> {
    let body = create_body(&a);
    let t = Instant::now();
    let v = api.call(Method::POST, "/v2/sandboxes", Some(body)).await?;
    println!("{}", field(&v, "sandboxID")?);
    eprintln!("created in {} ms", t.elapsed().as_millis());
    Ok(0)
}

/// `fork`: prints one child id per line; exit code 1 when a child failed.
async fn fork(api: &Api, id: &str, count: usize, timeout: Option<u64>) -> anyhow::Result<i32> {
    let mut body = json!({ "count": count });
    if let Some(t) = timeout {
        body["timeout"] = t.into();
    }
    let t = Instant::now();
    let v = api
        .call(Method::POST, &format!("/sandboxes/{id}/fork"), Some(body))
        .await?;
    let failed = print_children(&v)?;
    eprintln!(
        "forked {id} into {} of {count} in {} ms",
        count - failed,
        t.elapsed().as_millis()
    );
    Ok(i32::from(failed > 0))
}

/// Prints the id of each child in a fork's answer (and the error of each
/// failed one to stderr); returns how many failed.
fn print_children(v: &Value) -> anyhow::Result<usize> {
    let mut failed = 0;
    for item in v.as_array().context("fork did not answer a list")? {
        match item["sandbox"].get("sandboxID").and_then(Value::as_str) {
            Some(child) => println!("{child}"),
            None => {
                failed += 1;
                eprintln!("a child failed: {}", item["error"]);
            }
        }
    }
    Ok(failed)
}

async fn pause(api: &Api, id: &str) -> anyhow::Result<i32> {
    let t = Instant::now();
    api.pause(id).await?;
    eprintln!("paused {id} in {} ms", t.elapsed().as_millis());
    Ok(0)
}

async fn resume(api: &Api, id: &str, timeout: Option<u64>) -> anyhow::Result<i32> {
    let body = timeout.map_or_else(|| json!({}), |t| json!({ "timeout": t }));
    let t = Instant::now();
    api.call(
        Method::POST,
        &format!("/v2/sandboxes/{id}/connect"),
        Some(body),
    )
    .await?;
    eprintln!("resumed {id} in {} ms", t.elapsed().as_millis());
    Ok(0)
}

/// `snapshot`: prints the snapshot id.
async fn snapshot(api: &Api, id: &str) -> anyhow::Result<i32> {
    let t = Instant::now();
    println!("{}", api.snapshot(id).await?);
    eprintln!("snapshot of {id} in {} ms", t.elapsed().as_millis());
    Ok(0)
}

/// `kill`: tries every id; exit code 1 when any failed.
async fn kill(api: &Api, ids: Vec<String>) -> anyhow::Result<i32> {
    let mut failed = false;
    for id in ids {
        match api
            .call(Method::DELETE, &format!("/sandboxes/{id}"), None)
            .await
        {
            Ok(_) => eprintln!("killed {id}"),
            Err(e) => {
                failed = true;
                eprintln!("{e:#}");
            }
        }
    }
    Ok(i32::from(failed))
}

fn field<'a>(v: &'a Value, name: &str) -> anyhow::Result<&'a str> {
    v[name]
        .as_str()
        .with_context(|| format!("no {name} in the answer: {v}"))
}
