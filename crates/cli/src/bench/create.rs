//! P1: create from a template through the API until the agent answers,
//! against the floor: the same template snapshot restored by hand.

use std::collections::BTreeMap;
use std::time::Instant;

use tine_vmm::{floor, Driver, Snapshot};

use super::report::Row;
use super::{stages, Ctx, Out};

pub fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Restore `snapshot` by hand once (see [`floor`]), recording its stages in
/// `out`; with `init`, also time the agent's `/init` (what tine does after
/// every restore, outside the floor). Returns the floor in ms.
pub async fn floor_once(
    ctx: &Ctx,
    snapshot: &Snapshot,
    out: &mut Out,
    init: bool,
) -> anyhow::Result<f64> {
    let id = floor::vm_id("floor");
    let probe = tine_server::sandboxes::agent::probe();
    let (vm, st) = floor::restore(&ctx.floor_paths, &id, snapshot, probe).await?;
    for (name, v) in st.named() {
        out.stage(name, v);
    }
    out.stage("by hand: floor total", st.floor());
    let mut result = Ok(st.floor());
    if init {
        let t = Instant::now();
        let token = floor::vm_id("token");
        let guest = vm.guest()?;
        match tine_server::sandboxes::agent::init(
            &guest,
            &id,
            BTreeMap::new(),
            &token,
            None,
            Vec::new(),
            None,
        )
        .await
        {
            Ok(()) => out.stage("by hand: /init (outside the floor)", ms(t)),
            Err(e) => result = Err(anyhow::anyhow!("/init of a VM restored by hand: {e}")),
        }
    }
    vm.kill().await;
    result
}

pub fn server_stages(ctx: &Ctx, out: &mut Out, mark: u64) {
    for (name, v) in stages::since(ctx.server_log.as_deref(), mark) {
        out.stage(name, v);
    }
}

pub async fn p1(ctx: &Ctx, out: &mut Out) -> anyhow::Result<()> {
    let n = ctx.iterations(10);
    let (cpus, mem) = (ctx.args.cpus, ctx.args.memory_mb);
    ctx.step("warm-up: a first create (builds the template snapshot if needed)");
    let first = ctx.api.create(cpus, mem).await?;
    let snapshot = ctx.parent_snapshot(&first.id);
    ctx.api.kill(&first.id).await?;
    let snapshot = snapshot?;

    let (mut api_ms, mut floor_ms, mut errors) = (Vec::new(), Vec::new(), Vec::new());
    for i in 1..=n {
        // Alternate floor and create, so drift in the machine's load hits both.
        ctx.step(format!("{i}/{n}: restore by hand"));
        match floor_once(ctx, &snapshot, out, true).await {
            Ok(f) => floor_ms.push(f),
            Err(e) => errors.push(format!("floor: {e:#}")),
        }
        ctx.step(format!("{i}/{n}: create through the API"));
        let mark = stages::mark(ctx.server_log.as_deref());
        let t = Instant::now();
        match ctx.api.create(cpus, mem).await {
            Ok(sb) => {
                let took = ms(t);
                api_ms.push(took);
                out.stage("API: POST /v2/sandboxes", took);
                server_stages(ctx, out, mark);
                ctx.api.kill(&sb.id).await?;
            }
            Err(e) => errors.push(format!("create: {e:#}")),
        }
    }
    out.rows.push(
        Row::new("P1", "create via API until the agent answers", "ms")
            .samples(api_ms)
            .floor(
                "QEMU by hand: spawn + migrate-incoming + first reply",
                floor_ms,
            )
            .ratio_target(1.3, "p50 ≤ 1.3× floor")
            .param("iterations", n)
            .param("cpus", cpus)
            .param("memory_mb", mem)
            .param("snapshot", &snapshot.meta.id)
            .error(errors.first().cloned())
            .param("errors", errors.len())
            .param("pool_size", 0),
    );
    if let Some(own) = &ctx.own {
        ctx.step("restarting the server with a warm pool");
        own.lock().await.restart(POOL_SIZE).await?;
        let warm = with_warm_pool(ctx, &snapshot, n, out).await;
        ctx.step("restarting the server without a warm pool");
        let _ = ctx.api.clean_up(false).await;
        own.lock().await.restart(0).await?;
        out.rows.push(warm?);
        let row = jail_cost(ctx, n, out).await?;
        out.rows.push(row);
    }
    Ok(())
}

/// The jail's cost on a create: the same creates with the server jailed
/// and restarted with `[jail] enabled = false`, in blocks on, off, off, on
/// (so a drift in the machine's load over the run hits both sides alike).
async fn jail_cost(ctx: &Ctx, n: usize, out: &mut Out) -> anyhow::Result<Row> {
    let own = ctx.own.as_ref().expect("only with the bench's own server");
    let (cpus, mem) = (ctx.args.cpus, ctx.args.memory_mb);
    let block = n.div_ceil(2);
    let initial = own.lock().await.jail;
    let (mut on, mut off, mut errors) = (Vec::new(), Vec::new(), Vec::new());
    for (b, jail) in [true, false, false, true].into_iter().enumerate() {
        if own.lock().await.jail != jail {
            ctx.step(format!(
                "restarting the server with the jail {}",
                on_off(jail)
            ));
            let mut server = own.lock().await;
            server.jail = jail;
            server.restart(0).await?;
        }
        for i in 1..=block {
            ctx.step(format!(
                "block {}/4, jail {} {i}/{block}: create through the API",
                b + 1,
                on_off(jail)
            ));
            let mark = stages::mark(ctx.server_log.as_deref());
            let t = Instant::now();
            match ctx.api.create(cpus, mem).await {
                Ok(sb) => {
                    let took = ms(t);
                    let label = if jail { "jail on" } else { "jail off" };
                    out.stage(format!("API: POST /v2/sandboxes ({label})"), took);
                    for (name, v) in stages::since(ctx.server_log.as_deref(), mark) {
                        out.stage(format!("{name} ({label})"), v);
                    }
                    if jail { &mut on } else { &mut off }.push(took);
                    ctx.api.kill(&sb.id).await?;
                }
                Err(e) => errors.push(format!("create, jail {}: {e:#}", on_off(jail))),
            }
        }
    }
    if own.lock().await.jail != initial {
        ctx.step("restarting the server as it was");
        let mut server = own.lock().await;
        server.jail = initial;
        server.restart(0).await?;
    }
    Ok(
        Row::new("P1", "create via API, jail on (vs jail off)", "ms")
            .samples(on)
            .floor("the same create with [jail] enabled = false", off)
            .diff_target(5.0, "p50 on − off ≤ 5 ms")
            .param("iterations", 2 * block)
            .param("order", "blocks of creates: jail on, off, off, on")
            .error(errors.first().cloned()),
    )
}

fn on_off(jail: bool) -> &'static str {
    if jail {
        "on"
    } else {
        "off"
    }
}

/// Warm VMs the server keeps for the warm-pool row of P1.
const POOL_SIZE: usize = 2;

/// Wait until the server's warm pool has `POOL_SIZE` VMs (and no sandbox
/// runs), plus a moment for the last one to finish loading.
async fn pool_full(ctx: &Ctx) -> anyhow::Result<()> {
    let deadline = Instant::now() + std::time::Duration::from_secs(120);
    while crate::driver(&ctx.paths).vm_ids().len() < POOL_SIZE {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the warm pool did not fill within 120 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    Ok(())
}

/// P1 again, with the server restarted with a warm pool: creates that took
/// a pooled VM (its id was a VM dir before the create) are the samples;
/// the others are counted as misses.
async fn with_warm_pool(
    ctx: &Ctx,
    snapshot: &Snapshot,
    n: usize,
    out: &mut Out,
) -> anyhow::Result<Row> {
    let (cpus, mem) = (ctx.args.cpus, ctx.args.memory_mb);
    let (mut hits, mut floor_ms, mut misses) = (Vec::new(), Vec::new(), 0usize);
    for i in 1..=n {
        ctx.step(format!("warm pool {i}/{n}: waiting for the pool"));
        pool_full(ctx).await?;
        ctx.step(format!("warm pool {i}/{n}: restore by hand"));
        floor_ms.push(floor_once(ctx, snapshot, out, false).await?);
        ctx.step(format!("warm pool {i}/{n}: create through the API"));
        let pooled: std::collections::HashSet<String> =
            crate::driver(&ctx.paths).vm_ids().into_iter().collect();
        let t = Instant::now();
        let sb = ctx.api.create(cpus, mem).await?;
        let took = ms(t);
        if pooled.contains(&sb.id) {
            hits.push(took);
            out.stage("API: POST /v2/sandboxes (warm pool hit)", took);
        } else {
            misses += 1;
        }
        ctx.api.kill(&sb.id).await?;
    }
    Ok(Row::new("P1", "create via API, warm pool (hits)", "ms")
        .samples(hits)
        .floor(
            "QEMU by hand: spawn + migrate-incoming + first reply",
            floor_ms,
        )
        .ratio_target(0.5, "p50 ≤ 0.5× floor")
        .param("iterations", n)
        .param("pool_size", POOL_SIZE)
        .param("pool_misses", misses))
}
