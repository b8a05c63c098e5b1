//! P2: fork a running sandbox into N children (all answering), against N
//! restores of the same template done one after the other.

use std::time::{Duration, Instant};

use anyhow::Context;
use tine_vmm::{floor, Driver, Snapshot, SnapshotRef};

use super::create::{ms, server_stages};
use super::report::Row;
use super::{stages, Ctx, Out};

/// N restores of `snapshot` one after the other (the driver's `restore`,
/// each until its agent answers), all kept running until the last; then
/// removed.
async fn sequential_restores(ctx: &Ctx, snapshot: &Snapshot, count: usize) -> anyhow::Result<f64> {
    let driver = crate::driver(&ctx.floor_paths);
    let snapshot = SnapshotRef::from(snapshot.clone());
    let mut vms = Vec::new();
    let t = Instant::now();
    let mut result = Ok(());
    for j in 0..count {
        ctx.step(format!("floor: restore {}/{count}", j + 1));
        match driver.restore(&floor::vm_id("seq"), &snapshot).await {
            Ok(vm) => vms.push(vm),
            Err(e) => {
                result = Err(anyhow::Error::from(e).context("sequential restore"));
                break;
            }
        }
    }
    let took = ms(t);
    for vm in vms {
        let _ = vm.kill().await;
    }
    result.map(|()| took)
}

/// What the source's capture took, from the server's event `captured … in
/// N ms (vCPUs stopped M ms)`: (N, M). N runs from the stop to the layer on
/// disk and the source's reseed (`/init`) answered; M is the part its vCPUs
/// stood still.
fn source_capture_ms(ctx: &Ctx, source: &str) -> anyhow::Result<(f64, f64)> {
    let db = tine_server::db::Db::open(&ctx.paths.data_dir.join("tine.db"))?;
    let ev = db
        .events(source)?
        .into_iter()
        .rev()
        .find(|e| e.kind == "captured")
        .context("no captured event")?;
    let number_after = |word: &str| -> anyhow::Result<f64> {
        let rest = ev
            .detail
            .split_once(word)
            .context("unexpected event detail")?
            .1;
        let n = rest.split(" ms").next().unwrap_or_default();
        Ok(n.trim().parse()?)
    };
    Ok((number_after(" in ")?, number_after("stopped ")?))
}

pub async fn p2(ctx: &Ctx, out: &mut Out) -> anyhow::Result<()> {
    let n = ctx.iterations(3);
    let k = ctx.args.fork_count;
    let (cpus, mem) = (ctx.args.cpus, ctx.args.memory_mb);
    let (mut fork_ms, mut floor_ms, mut paused_ms, mut busy_ms, mut errors) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut snapshot: Option<Snapshot> = None;
    for i in 1..=n {
        ctx.step(format!("{i}/{n}: source sandbox"));
        let src = ctx.api.create(cpus, mem).await?;
        if snapshot.is_none() {
            snapshot = Some(ctx.parent_snapshot(&src.id)?);
        }
        let out_src = ctx
            .api
            .exec(&src, "echo ready", Duration::from_secs(60))
            .await?;
        anyhow::ensure!(out_src.exit_code == 0, "the source does not run commands");

        ctx.step(format!("{i}/{n}: fork x{k}"));
        let mark = stages::mark(ctx.server_log.as_deref());
        let t = Instant::now();
        let forked = ctx.api.fork(&src.id, k).await;
        let took = ms(t);
        match forked {
            Ok(children) => {
                server_stages(ctx, out, mark);
                let failed: Vec<String> = children
                    .iter()
                    .filter_map(|c| c.as_ref().err().cloned())
                    .collect();
                let ok: Vec<_> = children.into_iter().filter_map(Result::ok).collect();
                ctx.step(format!(
                    "{i}/{n}: checking that the {} children answer",
                    ok.len()
                ));
                let mut silent = 0;
                for c in &ok {
                    match ctx.api.exec(c, "true", Duration::from_secs(60)).await {
                        Ok(o) if o.exit_code == 0 => {}
                        _ => silent += 1,
                    }
                }
                if failed.is_empty() && silent == 0 {
                    fork_ms.push(took);
                    out.stage("API: POST /sandboxes/{id}/fork", took);
                } else {
                    errors.push(format!(
                        "{} children failed ({:?}), {silent} did not answer",
                        failed.len(),
                        failed.first()
                    ));
                }
                match source_capture_ms(ctx, &src.id) {
                    Ok((busy, stopped)) => {
                        busy_ms.push(busy);
                        paused_ms.push(stopped);
                    }
                    Err(e) => errors.push(format!("source pause time: {e:#}")),
                }
                for c in ok {
                    let _ = ctx.api.kill(&c.id).await;
                }
            }
            Err(e) => errors.push(format!("fork: {e:#}")),
        }
        ctx.api.kill(&src.id).await?;

        ctx.step(format!("{i}/{n}: floor: {k} restores one after the other"));
        let snap = snapshot.as_ref().expect("set above");
        match sequential_restores(ctx, snap, k).await {
            Ok(v) => {
                floor_ms.push(v);
                out.stage(format!("floor: {k} sequential restores"), v);
            }
            Err(e) => errors.push(format!("{e:#}")),
        }
    }
    let first_error = errors.first().cloned();
    out.rows.push(
        Row::new("P2", format!("fork x{k}, all answering"), "ms")
            .samples(fork_ms)
            .floor(
                format!("{k} sequential restores (Driver::restore)"),
                floor_ms,
            )
            .ratio_target(0.5, "total ≤ 0.5× floor")
            .param("iterations", n)
            .param("children", k)
            .param("memory_mb", mem)
            .error(first_error.clone())
            .param("errors", errors.len()),
    );
    let mut paused =
        Row::new("P2", "source paused during fork (vCPUs stopped)", "ms").samples(paused_ms);
    paused.target = "≤ 50 ms".into();
    paused.met = paused.summary.map(|s| s.p50 <= 50.0);
    out.rows
        .push(paused.param("source", "server event 'captured … (vCPUs stopped N ms)'"));
    out.rows.push(
        Row::new(
            "P2",
            "source capture until layer written and source reseeded",
            "ms",
        )
        .samples(busy_ms)
        .param("source", "server event 'captured … in N ms'"),
    );
    Ok(())
}
