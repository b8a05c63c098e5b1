//! P12: cluster mode. A cluster of 3 nodes and 1 gateway on this machine
//! (`scripts/cluster.sh`, its own dir and ports): create and
//! `commands.run` through the gateway against the same calls straight to
//! a node (`p12.py`, the real Python SDK), the spread of creates over the
//! nodes; then the control plane at scale, in the same PostgreSQL: 1,000
//! nodes and 100,000 sandboxes as rows, placement latency and routing
//! lookups per second. P13: captures through the cluster's registry, on
//! a cluster of its own (`p13.py`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Deserialize;
use tine_server::cluster::catalog::{Catalog, NodeStatus, SandboxRow};

use super::report::Row;
use super::{Ctx, Out};

const SCRIPT: &str = include_str!("p12.py");
const P13_SCRIPT: &str = include_str!("p13.py");
/// Ports of the bench's cluster (apart from the tests' 5433/3100/3200).
const PG_PORT: u16 = 5434;
const NODE_PORT: u16 = 3300;
const GATEWAY_PORT: u16 = 3400;
const REGISTRY_PORT: u16 = 5057;
const SIM_NODES: usize = 1000;
const SIM_PER_NODE: usize = 100;

#[derive(Deserialize)]
struct P12Result {
    create_gateway: Vec<f64>,
    create_node: Vec<f64>,
    run_gateway: Vec<f64>,
    run_node: Vec<f64>,
    spread: std::collections::BTreeMap<String, usize>,
    errors: Vec<String>,
}

/// `scripts/cluster.sh` of this source tree (`TINE_CLUSTER_SCRIPT` overrides).
fn script() -> PathBuf {
    std::env::var_os("TINE_CLUSTER_SCRIPT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../scripts/cluster.sh"
            ))
        })
}

struct Cluster {
    dir: PathBuf,
}

impl Cluster {
    async fn cmd(&self, args: &[&str]) -> anyhow::Result<String> {
        let exe = std::env::current_exe()?;
        let out = tokio::process::Command::new("bash")
            .arg(script())
            .args(args)
            .env("TINE_CLUSTER_DIR", &self.dir)
            .env("TINE_CLUSTER_PG_PORT", PG_PORT.to_string())
            .env("TINE_CLUSTER_NODE_PORT", NODE_PORT.to_string())
            .env("TINE_CLUSTER_GATEWAY_PORT", GATEWAY_PORT.to_string())
            .env("TINE_CLUSTER_REGISTRY_PORT", REGISTRY_PORT.to_string())
            .env("TINE_CLUSTER_SKIP_SETUP", "1")
            .env("TINE_BIN", exe)
            .output()
            .await
            .context("running scripts/cluster.sh")?;
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        anyhow::ensure!(
            out.status.success(),
            "cluster.sh {}: {}",
            args.join(" "),
            err.lines().rev().take(5).collect::<Vec<_>>().join(" | ")
        );
        Ok(err)
    }
}

fn pg_url() -> String {
    format!("postgresql://postgres@127.0.0.1:{PG_PORT}/tine")
}

pub async fn p12(ctx: &Ctx, out: &mut Out) -> anyhow::Result<()> {
    with_cluster(ctx, "P12", out, measure).await
}

pub async fn p13(ctx: &Ctx, out: &mut Out) -> anyhow::Result<()> {
    with_cluster(ctx, "P13", out, captures).await
}

/// `f` on a fresh cluster of 3 nodes and 1 gateway, taken down after.
async fn with_cluster<F>(ctx: &Ctx, id: &str, out: &mut Out, f: F) -> anyhow::Result<()>
where
    F: AsyncFnOnce(&Ctx, &Cluster, &str, &mut Out) -> anyhow::Result<()>,
{
    let cluster = Cluster {
        dir: ctx.floor_paths.data_dir.join("cluster"),
    };
    ctx.step(format!(
        "{id}: a cluster of 3 nodes and 1 gateway (scripts/cluster.sh up)"
    ));
    let _ = cluster.cmd(&["down"]).await;
    // A fresh registry and catalog: what a push sends is not what an
    // earlier run left there.
    let _ = std::fs::remove_dir_all(cluster.dir.join("registry"));
    let up = cluster
        .cmd(&["up", "--nodes", "3", "--gateways", "1"])
        .await;
    let result = match up {
        Ok(text) => f(ctx, &cluster, &text, out).await,
        Err(e) => Err(e),
    };
    if let Err(e) = cluster.cmd(&["down"]).await {
        tracing::warn!("{id}: cluster.sh down: {e:#}");
    }
    result
}

#[derive(Deserialize)]
struct P13Result {
    create_first: Vec<f64>,
    create_holder: Vec<f64>,
    fetched_bytes: Vec<f64>,
    create_whole: Vec<f64>,
    whole_bytes: Vec<f64>,
    capture_bytes: f64,
    resume_moved: Vec<f64>,
    resume_local: Vec<f64>,
    push_ms: Vec<f64>,
    errors: Vec<String>,
}

/// P13: captures through the registry (`p13.py`).
async fn captures(ctx: &Ctx, cluster: &Cluster, up: &str, out: &mut Out) -> anyhow::Result<()> {
    let (key, secret, gateway, nodes) = endpoints(cluster, up)?;
    let n = ctx.iterations(3);
    let mem_mib = 32;
    let write_mib = ctx.args.write_mib.min(256);
    ctx.step(format!(
        "P13: creates from a snapshot on nodes that lack it, {n} resumes moved and local, pushes after writing {write_mib} MiB"
    ));
    let r: P13Result = super::sdk::run_script(
        ctx,
        "p13.py",
        P13_SCRIPT,
        &[
            ("E2B_API_URL", gateway.clone()),
            ("E2B_SANDBOX_URL", gateway),
            ("E2B_API_KEY", key),
            ("TINE_BENCH_NODES", nodes),
            ("TINE_BENCH_SECRET", secret),
            ("TINE_BENCH_N", n.to_string()),
            ("TINE_BENCH_MEM_MIB", mem_mib.to_string()),
            ("TINE_BENCH_WRITE_MIB", write_mib.to_string()),
            ("TINE_POSTGRES_URL", pg_url()),
            (
                "TINE_BIN",
                std::env::current_exe()?.to_string_lossy().into_owned(),
            ),
            // To restart a node with `lazy_pull = false`.
            (
                "TINE_BENCH_CLUSTER_SH",
                script().to_string_lossy().into_owned(),
            ),
            (
                "TINE_CLUSTER_DIR",
                cluster.dir.to_string_lossy().into_owned(),
            ),
            ("TINE_CLUSTER_PG_PORT", PG_PORT.to_string()),
            ("TINE_CLUSTER_NODE_PORT", NODE_PORT.to_string()),
            ("TINE_CLUSTER_GATEWAY_PORT", GATEWAY_PORT.to_string()),
            ("TINE_CLUSTER_REGISTRY_PORT", REGISTRY_PORT.to_string()),
            ("TINE_CLUSTER_SKIP_SETUP", "1".into()),
        ],
    )
    .await?;
    let error = r.errors.first().cloned();
    let mib = |v: &[f64]| {
        v.iter()
            .map(|b| b / (1u64 << 20) as f64)
            .collect::<Vec<_>>()
    };
    let capture_mib = vec![r.capture_bytes / (1u64 << 20) as f64];
    for (how, times, fetched) in [
        ("read lazily (the default)", r.create_first, r.fetched_bytes),
        (
            "fetched whole first (lazy_pull = false)",
            r.create_whole,
            r.whole_bytes,
        ),
    ] {
        let mut first = Row::new(
            "P13",
            format!("first create from a snapshot ({mem_mib} MiB written to memory and disk) on a node that never saw it, {how}"),
            "ms",
        )
        .samples(times)
        .floor("a create from it on the node that made it", r.create_holder.clone())
        .param("fetched_mib", mib(&fetched));
        first.target = "(measured; no target)".into();
        if let (Some(s), Some(f)) = (first.summary, first.floor) {
            first.ratio = Some(s.p50 / f.p50);
        }
        out.rows.push(first.error(error.clone()));
        let mut moved = Row::new(
            "P13",
            format!("MiB that first create fetched, {how}"),
            "MiB",
        )
        .samples(mib(&fetched))
        .floor(
            "what the capture's push sent (its chunks the registry lacked)",
            capture_mib.clone(),
        );
        moved.target = "(measured; no target)".into();
        if let (Some(s), Some(f)) = (moved.summary, moved.floor) {
            moved.ratio = Some(s.p50 / f.p50);
        }
        out.rows.push(moved.error(error.clone()));
    }
    let mut moved = Row::new(
        "P13",
        "resume on another node (its pause capture adopted)",
        "ms",
    )
    .samples(r.resume_moved)
    .floor("a resume on its own node", r.resume_local);
    moved.target = "(measured; no target)".into();
    if let (Some(s), Some(f)) = (moved.summary, moved.floor) {
        moved.ratio = Some(s.p50 / f.p50);
    }
    out.rows.push(moved.error(error.clone()));
    let mut push = Row::new(
        "P13",
        format!("background push of a pause capture after writing {write_mib} MiB to disk"),
        "ms",
    )
    .samples(r.push_ms);
    push.target = "(measured; no target)".into();
    out.rows.push(push.error(error));
    Ok(())
}

/// The key `cluster.sh up` printed, the cluster secret, the gateway's URL
/// and the nodes' URLs (comma-separated).
fn endpoints(cluster: &Cluster, up: &str) -> anyhow::Result<(String, String, String, String)> {
    let key = up
        .lines()
        .find_map(|l| l.strip_prefix("export E2B_API_KEY="))
        .context("cluster.sh up printed no key")?
        .to_string();
    let secret = std::fs::read_to_string(cluster.dir.join("secret"))?;
    let gateway = format!("http://127.0.0.1:{}", GATEWAY_PORT + 1);
    let nodes = (1..=3)
        .map(|i| format!("http://127.0.0.1:{}", NODE_PORT + i))
        .collect::<Vec<_>>()
        .join(",");
    Ok((key, secret.trim().to_string(), gateway, nodes))
}

async fn measure(ctx: &Ctx, cluster: &Cluster, up: &str, out: &mut Out) -> anyhow::Result<()> {
    let (key, secret, gateway, nodes) = endpoints(cluster, up)?;
    let n = ctx.iterations(20);
    let calls = ctx.count(200, 20);
    let spread = ctx.count(30, 6);
    ctx.step(format!(
        "P12: {n} creates and {calls} commands.run through the gateway and straight to a node, then {spread} creates"
    ));
    let r: P12Result = super::sdk::run_script(
        ctx,
        "p12.py",
        SCRIPT,
        &[
            ("E2B_API_URL", gateway.clone()),
            ("E2B_SANDBOX_URL", gateway.clone()),
            ("E2B_API_KEY", key),
            ("TINE_BENCH_NODES", nodes),
            ("TINE_BENCH_SECRET", secret),
            ("TINE_BENCH_N", n.to_string()),
            ("TINE_BENCH_CALLS", calls.to_string()),
            ("TINE_BENCH_SPREAD", spread.to_string()),
        ],
    )
    .await?;
    let error = r.errors.first().cloned();
    let mut create = Row::new("P12", "create through the gateway (SDK)", "ms")
        .samples(r.create_gateway)
        .floor(
            "straight to the nodes in turn (SDK, cluster secret)",
            r.create_node,
        );
    create.target = "p50 ≤ 1.05× floor".into();
    if let (Some(s), Some(f)) = (create.summary, create.floor) {
        create.ratio = Some(s.p50 / f.p50);
        create.met = Some(error.is_none() && s.p50 <= 1.05 * f.p50);
    }
    out.rows.push(create.error(error.clone()));
    let mut run = Row::new(
        "P12",
        "commands.run(\"true\") through the gateway (SDK)",
        "ms",
    )
    .samples(r.run_gateway)
    .floor("through the node's own proxy", r.run_node);
    run.target = "p50 ≤ floor + 1 ms".into();
    if let (Some(s), Some(f)) = (run.summary, run.floor) {
        run.ratio = Some(s.p50 / f.p50);
        run.met = Some(error.is_none() && s.p50 <= f.p50 + 1.0);
        run = run.param("added_p50_ms", s.p50 - f.p50);
    }
    out.rows.push(run.error(error.clone()));
    let counts: Vec<f64> = r.spread.values().map(|&c| c as f64).collect();
    let mut spread_row = Row::new("P12", format!("{spread} creates over 3 nodes"), "sandboxes")
        .samples(counts.clone())
        .param("per_node", &r.spread);
    spread_row.target = "every node gets some".into();
    spread_row.met = Some(r.spread.len() == 3 && counts.iter().sum::<f64>() == spread as f64);
    out.rows.push(spread_row.error(error));
    out.rows.extend(control_plane(ctx).await?);
    Ok(())
}

/// 1,000 nodes and 100,000 sandboxes as rows in the catalog: placement
/// (the node list, the choice, the reservation) and lookups of a sandbox's
/// node (the gateway's cache miss).
async fn control_plane(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    let catalog = std::sync::Arc::new(Catalog::connect(&pg_url()).await?);
    let (sim_nodes, per_node) = (ctx.count(SIM_NODES, 50), ctx.count(SIM_PER_NODE, 10));
    ctx.step(format!(
        "P12: {sim_nodes} nodes and {} sandboxes as catalog rows",
        sim_nodes * per_node
    ));
    let node_id = |i: usize| format!("sim-node-{i:04}");
    let started = Instant::now();
    for i in 0..sim_nodes {
        let status = NodeStatus {
            address: format!("http://10.{}.{}.1:3000", i / 250, i % 250),
            cores: 64,
            capacity: 6400,
            live: per_node,
            templates: vec!["base".into()],
            ..Default::default()
        };
        catalog.heartbeat(&node_id(i), &status).await?;
        let at = catalog.now_ms().await?;
        let rows: Vec<SandboxRow> = (0..per_node)
            .map(|j| SandboxRow {
                id: format!("isim{i:04}{j:04}"),
                team: format!("team-{}", (i * per_node + j) % 100),
                state: "running".into(),
                template_id: "base".into(),
                started_ms: at,
                metadata: Default::default(),
                detail: serde_json::json!({"sandboxID": format!("isim{i:04}{j:04}")}),
            })
            .collect();
        catalog.publish(&node_id(i), at, &rows).await?;
    }
    let load_s = started.elapsed().as_secs_f64();
    let result = async {
        ctx.step("P12: placements and lookups".to_string());
        // What a create waits for: the choice among the nodes a gateway
        // holds (it reads the list once a second in the background) and the
        // reservation; and that background read on its own.
        let mut place = Vec::new();
        let mut list = Vec::new();
        let mut nodes = catalog.nodes().await?;
        for k in 0..ctx.count(300, 30) {
            if k % 20 == 0 {
                let t = Instant::now();
                nodes = catalog.nodes().await?;
                list.push(t.elapsed().as_secs_f64() * 1000.0);
            }
            let t = Instant::now();
            let n = tine_server::gateway::place::choose(&nodes, "base", 600_000, &[], |len| {
                k * 7919 % len
            })
            .context("no node chosen")?
            .id
            .clone();
            let res = catalog.reserve("team-bench", Some(1_000_000), &n).await?;
            place.push(t.elapsed().as_secs_f64() * 1000.0);
            if let Some(r) = res {
                catalog.release(&r).await?;
            }
        }
        let secs = ctx.count(5.0, 1.0);
        let deadline = Instant::now() + Duration::from_secs_f64(secs);
        let tasks = (0..8u64).map(|t| {
            let c = catalog.clone();
            tokio::spawn(async move {
                let mut done = 0u64;
                let mut x = t * 1_000_003 + 17;
                while Instant::now() < deadline {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let i = (x >> 33) as usize % sim_nodes;
                    let j = (x >> 13) as usize % per_node;
                    if c.locate(&format!("isim{i:04}{j:04}")).await?.is_some() {
                        done += 1;
                    }
                }
                anyhow::Ok(done)
            })
        });
        let mut found = 0u64;
        for t in futures::future::join_all(tasks).await {
            found += t??;
        }
        anyhow::Ok((place, list, found as f64 / secs))
    }
    .await;
    ctx.step("P12: removing the simulated rows".to_string());
    for i in 0..sim_nodes {
        let _ = catalog.forget_node(&node_id(i)).await;
    }
    let (place, list, lookups) = result?;
    let mut p = Row::new(
        "P12",
        format!(
            "placement (choice + reservation) among {sim_nodes} nodes, {} sandboxes",
            sim_nodes * per_node
        ),
        "ms",
    )
    .samples(place)
    .param("catalog_load_s", load_s);
    p.target = "(measured; no target)".into();
    let mut l = Row::new(
        "P12",
        format!("a gateway's read of the {sim_nodes} nodes (once a second)"),
        "ms",
    )
    .samples(list);
    l.target = "(measured; no target)".into();
    let lookups_row = Row::new(
        "P12",
        "sandbox → node lookups in the catalog (8 at once)",
        "lookups/s",
    )
    .samples(vec![lookups])
    .param("sandboxes", sim_nodes * per_node);
    Ok(vec![p, l, lookups_row])
}
