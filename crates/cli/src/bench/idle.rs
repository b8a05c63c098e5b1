//! P15: what an idle sandbox costs the host's CPU, and how many idle
//! sandboxes a host holds before it refuses creates.

use std::time::{Duration, Instant};

use anyhow::Context;

use super::report::Row;
use super::stats::Summary;
use super::{Ctx, Out};
use crate::client::Sandbox;

/// Idle sandboxes measured at once, and for how long.
const IDLE: usize = 16;
const IDLE_SECS: u64 = 60;
/// The target: host CPU per idle sandbox, in % of one core.
const IDLE_TARGET_PCT: f64 = 0.3;

pub async fn p15(ctx: &Ctx, out: &mut Out) -> anyhow::Result<()> {
    // E2B's default sandbox has 2 vCPUs: measured with both shapes, so the
    // second vCPU's idle cost shows.
    for cpus in [2, 1] {
        let row = idle_cost(ctx, cpus).await;
        out.rows.push(row.unwrap_or_else(|e| {
            Row::failed("P15", format!("idle cost, {cpus} vCPUs"), format!("{e:#}"))
        }));
        let _ = ctx.api.clean_up(false).await;
    }
    // Density restarts the server with the default capacity: only the
    // bench's own (with --server it is left out, as P1's warm-pool row is).
    if ctx.own.is_none() {
        return Ok(());
    }
    match density(ctx).await {
        Ok(rows) => out.rows.extend(rows),
        Err(e) => out
            .rows
            .push(Row::failed("P15", "density", format!("{e:#}"))),
    }
    Ok(())
}

/// utime + stime of a process, in seconds.
fn cpu_secs(pid: i32) -> anyhow::Result<f64> {
    tine_vmm::cpu_time(pid)
        .map(|t| t.as_secs_f64())
        .with_context(|| format!("reading /proc/{pid}/stat"))
}

/// `IDLE` sandboxes of `cpus` vCPUs left idle for `IDLE_SECS`: each one's
/// QEMU CPU time over that window, in % of a core. The floor is the same
/// machine loaded by hand and left stopped (no vCPU runs): QEMU's own cost.
async fn idle_cost(ctx: &Ctx, cpus: u32) -> anyhow::Result<Row> {
    let (idle, idle_secs) = (ctx.count(IDLE, 2), ctx.count(IDLE_SECS, 5));
    ctx.step(format!(
        "idle cost: creating {idle} sandboxes of {cpus} vCPUs"
    ));
    let mut sandboxes = Vec::new();
    for _ in 0..idle {
        sandboxes.push(ctx.api.create(cpus, ctx.args.memory_mb).await?);
    }
    for sb in &sandboxes {
        super::capture::run(ctx, sb, "true").await?;
    }
    let snapshot = ctx.parent_snapshot(&sandboxes[0].id)?;
    let id = tine_vmm::floor::vm_id("idle");
    let floor = tine_vmm::floor::restore_stopped(&ctx.floor_paths, &id, &snapshot).await?;
    let result = async {
        let floor_pid = floor.pid().context("the stopped QEMU has no pid")?;
        let pids = sandboxes
            .iter()
            .map(|sb| ctx.qemu_pid(&sb.id))
            .collect::<anyhow::Result<Vec<_>>>()?;
        // Let the creates' after-effects (page faults, reporting) settle.
        tokio::time::sleep(Duration::from_secs(5)).await;
        ctx.step(format!(
            "idle cost: {idle} idle sandboxes of {cpus} vCPUs for {idle_secs} s"
        ));
        let before = pids
            .iter()
            .map(|&p| cpu_secs(p))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let floor_before = cpu_secs(floor_pid)?;
        let t = Instant::now();
        tokio::time::sleep(Duration::from_secs(idle_secs)).await;
        let secs = t.elapsed().as_secs_f64();
        let after = pids
            .iter()
            .map(|&p| cpu_secs(p))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let floor_pct = (cpu_secs(floor_pid)? - floor_before) / secs * 100.0;
        let pct: Vec<f64> = before
            .iter()
            .zip(&after)
            .map(|(b, a)| (a - b) / secs * 100.0)
            .collect();
        let mean = pct.iter().sum::<f64>() / pct.len() as f64;
        let mut row = Row::new(
            "P15",
            format!("idle host CPU per sandbox, {cpus} vCPUs"),
            "% core",
        )
        .samples(pct)
        .floor(
            "the same machine loaded and stopped (QEMU alone)",
            vec![floor_pct],
        )
        .ratio_only()
        .param("sandboxes", idle)
        .param("seconds", idle_secs)
        .param("vcpus", cpus)
        .param("mean_pct", (mean * 1000.0).round() / 1000.0);
        row.target = format!("mean ≤ {IDLE_TARGET_PCT} % of a core");
        row.met = Some(mean <= IDLE_TARGET_PCT);
        anyhow::Ok(row)
    }
    .await;
    floor.kill().await;
    for sb in &sandboxes {
        let _ = ctx.api.kill(&sb.id).await;
    }
    result
}

/// One `gauge{kind="…"} value` of the server's metrics.
fn gauge(text: &str, name: &str, kind: &str) -> Option<f64> {
    let prefix = format!("{name}{{kind=\"{kind}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
}

/// Host memory in use (MemTotal − MemAvailable), MiB.
fn host_memory_used_mib() -> f64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kib = |key: &str| {
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (kib("MemTotal:") - kib("MemAvailable:")) / 1024.0
}

/// The host's CPU busy over `window`, in % of all cores.
async fn host_cpu_busy_pct(window: Duration) -> f64 {
    fn sample() -> (f64, f64) {
        let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let v: Vec<f64> = text
            .lines()
            .next()
            .unwrap_or("")
            .split_whitespace()
            .skip(1)
            .filter_map(|x| x.parse().ok())
            .collect();
        let total: f64 = v.iter().sum();
        let idle = v.get(3).copied().unwrap_or(0.0) + v.get(4).copied().unwrap_or(0.0);
        (total, idle)
    }
    let (t0, i0) = sample();
    tokio::time::sleep(window).await;
    let (t1, i1) = sample();
    if t1 > t0 {
        (1.0 - (i1 - i0) / (t1 - t0)) * 100.0
    } else {
        0.0
    }
}

/// `commands.run("true")` on 10 sandboxes picked at random, 3 times each.
async fn exec_samples(ctx: &Ctx, live: &[Sandbox], seed: &mut u64) -> anyhow::Result<Vec<f64>> {
    let mut samples = Vec::new();
    for _ in 0..10 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        let sb = &live[(*seed % live.len() as u64) as usize];
        for _ in 0..3 {
            let t = Instant::now();
            super::capture::run(ctx, sb, "true").await?;
            samples.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(samples)
}

/// Creates idle sandboxes until the server refuses one (its capacity, with
/// the defaults: `max_sandboxes_per_core` and `max_sandboxes`, or
/// `--density-capacity`), with
/// `commands.run("true")` timed at 25 %, 50 % and 100 % of that count
/// against one sandbox live.
async fn density(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    let own = ctx.own.as_ref().context(
        "needs the bench's own server (not --server): it restarts it with the default capacity",
    )?;
    {
        let mut server = own.lock().await;
        server.max_sandboxes = ctx.args.density_capacity.map(usize::from);
        server.restart(0).await?;
    }
    let result = density_at_capacity(ctx).await;
    let _ = ctx.api.clean_up(false).await;
    let mut server = own.lock().await;
    server.max_sandboxes = Some(super::env::BENCH_MAX_SANDBOXES);
    let pool = server.pool_size;
    server.restart(pool).await?;
    result
}

async fn density_at_capacity(ctx: &Ctx) -> anyhow::Result<Vec<Row>> {
    let (cpus, mem) = (2, ctx.args.memory_mb);
    let metrics = ctx.api.metrics_text().await?;
    let capacity = gauge(&metrics, "tine_capacity_sandboxes", "total")
        .context("the server reports no tine_capacity_sandboxes")? as usize;
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut live = vec![ctx.api.create(cpus, mem).await?];
    ctx.step("density: commands.run(true) with one sandbox live");
    let alone = exec_samples(ctx, &live, &mut seed).await?;
    let mut rows = Vec::new();
    let marks = [(capacity / 4, "25 %"), (capacity / 2, "50 %")];
    let refused = loop {
        if let Some((_, label)) = marks.iter().find(|(n, _)| *n == live.len() && *n > 1) {
            ctx.step(format!(
                "density: commands.run(true) with {} live ({label})",
                live.len()
            ));
            let s = exec_samples(ctx, &live, &mut seed).await?;
            rows.push(exec_row(
                &format!("{label} of capacity"),
                live.len(),
                s,
                &alone,
            ));
        }
        ctx.step(format!(
            "density: creating sandbox {} (capacity {capacity})",
            live.len() + 1
        ));
        match ctx.api.create(cpus, mem).await {
            Ok(sb) => live.push(sb),
            Err(e) if format!("{e:#}").contains("HTTP 429") => break format!("{e:#}"),
            Err(e) => return Err(e),
        }
        anyhow::ensure!(
            live.len() <= capacity + 1,
            "{} sandboxes created, past the reported capacity {capacity}",
            live.len()
        );
    };
    let memory = host_memory_used_mib();
    let busy = host_cpu_busy_pct(Duration::from_secs(ctx.count(10, 2))).await;
    ctx.step(format!(
        "density: commands.run(true) with {} live (100 %)",
        live.len()
    ));
    let s = exec_samples(ctx, &live, &mut seed).await?;
    let mut full = exec_row("100 % of capacity", live.len(), s, &alone);
    if let (Some(s), Some(f)) = (Summary::of(&full.samples), Summary::of(&full.floor_samples)) {
        let r = s.p99 / f.p99.max(1e-3);
        full.params.insert(
            "p99_ratio".into(),
            serde_json::json!((r * 100.0).round() / 100.0),
        );
        full.target = "p99 ≤ 3× one sandbox live".into();
        full.met = Some(r <= 3.0);
    }
    rows.push(full);
    let mut held = Row::new(
        "P15",
        "idle sandboxes held until a create is refused",
        "sandboxes",
    )
    .samples(vec![live.len() as f64])
    .param("capacity", capacity)
    .param("vcpus", cpus)
    .param("memory_mb", mem)
    .param("host_memory_used_mib", memory.round())
    .param("host_cpu_busy_pct_10s", (busy * 10.0).round() / 10.0)
    .param("refusal", refused);
    held.target = "refused with 429 at capacity".into();
    held.met = Some(live.len() == capacity);
    rows.push(held);
    Ok(rows)
}

fn exec_row(label: &str, live: usize, samples: Vec<f64>, alone: &[f64]) -> Row {
    Row::new("P15", format!("commands.run(\"true\"), {label}"), "ms")
        .samples(samples)
        .floor("the same with one sandbox live", alone.to_vec())
        .ratio_only()
        .param("live_sandboxes", live)
}
