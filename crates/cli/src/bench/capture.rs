//! P3 (snapshot after writing to disk) and P4 (pause, then resume).

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tine_vmm::{Driver, Snapshot};

use super::create::{floor_once, ms, server_stages};
use super::report::Row;
use super::{mem, stages, Ctx, Out};
use crate::client::Sandbox;

const CMD_TIMEOUT: Duration = Duration::from_secs(600);

/// Run `cmd` in `sb`; its stdout, or an error if it fails.
pub(super) async fn run(ctx: &Ctx, sb: &Sandbox, cmd: &str) -> anyhow::Result<String> {
    let o = ctx.api.exec(sb, cmd, CMD_TIMEOUT).await?;
    if o.exit_code != 0 {
        bail!(
            "`{cmd}` exited {}: {}",
            o.exit_code,
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&o.stdout).trim().to_string())
}

/// A timed user snapshot, deleted again (the sandbox goes on).
async fn timed_snapshot(
    ctx: &Ctx,
    sb: &Sandbox,
    out: &mut Out,
    label: &str,
) -> anyhow::Result<f64> {
    let mark = stages::mark(ctx.server_log.as_deref());
    let t = Instant::now();
    let sid = ctx.api.snapshot(&sb.id).await?;
    let took = ms(t);
    for (name, v) in stages::since(ctx.server_log.as_deref(), mark) {
        out.stage(format!("{label}: {name}"), v);
    }
    ctx.api.delete_snapshot(&sid).await?;
    Ok(took)
}

pub async fn p3(ctx: &Ctx, out: &mut Out) -> anyhow::Result<()> {
    let n = ctx.iterations(3);
    let w = ctx.args.write_mib;
    let mem = ctx.args.snapshot_memory_mb;
    ctx.step(format!("a {mem} MiB sandbox"));
    let sb = ctx.api.create(ctx.args.cpus, mem).await?;
    let file = "/home/user/tine-bench.bin";
    let fs = run(ctx, &sb, "stat -f -c %T /home/user").await?;
    if fs == "tmpfs" || fs == "ramfs" {
        bail!("/home/user is on {fs}, not on the sandbox disk");
    }
    let avail: u64 = run(ctx, &sb, "df -Pm /home/user | awk 'NR==2 {print $4}'")
        .await?
        .parse()
        .context("df")?;
    if avail < w + 64 {
        bail!("the sandbox disk has {avail} MiB free; {w} MiB do not fit");
    }
    let (mut floor_ms, mut write_ms) = (Vec::new(), Vec::new());
    for i in 1..=n {
        run(ctx, &sb, &format!("rm -f {file}; sync")).await?;
        ctx.step(format!("{i}/{n}: snapshot after writing nothing"));
        floor_ms.push(timed_snapshot(ctx, &sb, out, "nothing written").await?);
        ctx.step(format!("{i}/{n}: dd {w} MiB to the sandbox disk"));
        let t = Instant::now();
        run(
            ctx,
            &sb,
            &format!("dd if=/dev/zero of={file} bs=1M count={w} conv=fsync status=none"),
        )
        .await?;
        out.stage(format!("guest: dd {w} MiB, fsync"), ms(t));
        ctx.step(format!("{i}/{n}: snapshot after writing {w} MiB"));
        write_ms.push(timed_snapshot(ctx, &sb, out, "after dd").await?);
    }
    let mut row = Row::new("P3", format!("snapshot after writing {w} MiB"), "ms")
        .samples(write_ms)
        .floor("the same snapshot after writing nothing", floor_ms)
        .ratio_target(1.2, format!("≤ 1.2× floor and ≤ 100 ms ({mem} MiB guest)"))
        .param("iterations", n)
        .param("written_mib", w)
        .param("memory_mb", mem);
    if let (Some(true), Some(s)) = (row.met, row.summary) {
        row.met = Some(s.p50 <= 100.0);
    }
    out.rows.push(row);
    ctx.api.kill(&sb.id).await?;
    Ok(())
}

/// Time to write `bytes` to a new file in `dir` (no fsync, as QEMU's
/// migration to a file does not either), in ms.
fn write_floor(dir: &std::path::Path, bytes: u64) -> anyhow::Result<f64> {
    let path = dir.join(format!("bench-write-{}", std::process::id()));
    let chunk = vec![0x5au8; 1 << 20];
    let t = Instant::now();
    let mut f =
        std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        f.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    drop(f);
    let took = ms(t);
    let _ = std::fs::remove_file(&path);
    Ok(took)
}

/// The capture sandbox `id` is paused in, as the server's database names
/// it. (Not the newest `p-<id>-*` directory: a background compaction
/// renames files into an older capture after a newer one exists, and
/// that older capture is then garbage.)
fn pause_capture(ctx: &Ctx, id: &str) -> anyhow::Result<Snapshot> {
    let db = tine_server::db::Db::open(&ctx.paths.data_dir.join("tine.db"))?;
    let capture = db
        .sandbox_snapshot(id)?
        .with_context(|| format!("the paused sandbox {id} names no capture"))?;
    Ok(Snapshot::open(&ctx.paths, &capture)?)
}

pub async fn p4(ctx: &Ctx, out: &mut Out) -> anyhow::Result<()> {
    let n = ctx.iterations(5);
    let mem = ctx.args.memory_mb;
    let sb = ctx.api.create(ctx.args.cpus, mem).await?;
    run(ctx, &sb, "true").await?;
    let (mut pause_ms, mut write_ms, mut resume_ms, mut floor_ms, mut dirty_mib) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 1..=n {
        ctx.step(format!("{i}/{n}: pause"));
        let dirty = mem::dirty_ram_bytes(ctx.qemu_pid(&sb.id)?)?;
        dirty_mib.push(dirty as f64 / (1 << 20) as f64);
        write_ms.push(write_floor(&ctx.paths.data_dir, dirty)?);
        let mark = stages::mark(ctx.server_log.as_deref());
        let t = Instant::now();
        ctx.api.pause(&sb.id).await?;
        pause_ms.push(ms(t));
        server_stages(ctx, out, mark);

        let (floor, resume) = floor_then_resume(ctx, &sb, out, &format!("{i}/{n}")).await?;
        floor_ms.push(floor);
        resume_ms.push(resume);
    }
    let mut pause = Row::new("P4", "pause", "ms")
        .samples(pause_ms)
        .floor("writing the dirtied RAM to a file", write_ms)
        .param("iterations", n)
        .param("memory_mb", mem)
        .param("dirtied_mib", dirty_mib);
    pause.target = "≤ 100 ms + floor".into();
    if let (Some(s), Some(f)) = (pause.summary, pause.floor) {
        pause.ratio = Some(s.p50 / f.p50.max(1e-3));
        pause.met = Some(s.p50 <= 100.0 + f.p50);
    }
    out.rows.push(pause);
    out.rows.push(
        Row::new("P4", "resume (connect) until the agent answers", "ms")
            .samples(resume_ms)
            .floor("the pause capture restored by hand", floor_ms)
            .ratio_target(1.3, "p50 ≤ 1.3× floor")
            .param("iterations", n),
    );
    ctx.api.kill(&sb.id).await?;
    out.rows
        .push(match timer_across_pause(ctx, n.min(3)).await {
            Ok(row) => row,
            Err(e) => Row::failed("P4", TIMER_ROW, format!("{e:#}")),
        });
    if let Some(own) = &ctx.own {
        ctx.step("restarting the server with resume_ahead = 1");
        own.lock().await.resume_ahead = 1;
        own.lock().await.restart(0).await?;
        let ahead = resume_ahead(ctx, n, out).await;
        ctx.step("restarting the server without resume_ahead");
        let _ = ctx.api.clean_up(false).await;
        own.lock().await.resume_ahead = 0;
        own.lock().await.restart(0).await?;
        out.rows.push(ahead?);
    }
    Ok(())
}

/// For paused `sb`: its pause capture restored by hand (the floor), then
/// the timed resume through the API and one command; both in ms.
async fn floor_then_resume(
    ctx: &Ctx,
    sb: &Sandbox,
    out: &mut Out,
    step: &str,
) -> anyhow::Result<(f64, f64)> {
    ctx.step(format!("{step}: floor: the pause capture restored by hand"));
    let capture = pause_capture(ctx, &sb.id)?;
    let floor = floor_once(ctx, &capture, out, false).await?;
    ctx.step(format!("{step}: resume"));
    let mark = stages::mark(ctx.server_log.as_deref());
    let t = Instant::now();
    ctx.api.resume(&sb.id).await?;
    let resume = ms(t);
    server_stages(ctx, out, mark);
    run(ctx, sb, "true").await?;
    Ok((floor, resume))
}

/// P4's resume again, with the server restoring each paused sandbox's
/// capture ahead (`resume_ahead`): after each pause the bench waits until
/// the sandbox's VM directory is back (the restore ahead), then measures
/// the floor and the resume as P4 does. The floor does the whole restore;
/// the resume does not, as P1's warm pool: its own target.
async fn resume_ahead(ctx: &Ctx, n: usize, out: &mut Out) -> anyhow::Result<Row> {
    let sb = ctx.api.create(ctx.args.cpus, ctx.args.memory_mb).await?;
    run(ctx, &sb, "true").await?;
    let (mut resume_ms, mut floor_ms) = (Vec::new(), Vec::new());
    for i in 1..=n {
        ctx.step(format!("resume ahead {i}/{n}: pause"));
        ctx.api.pause(&sb.id).await?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while !crate::driver(&ctx.paths).vm_ids().contains(&sb.id) {
            anyhow::ensure!(
                Instant::now() < deadline,
                "no VM was restored ahead of the resume within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let step = format!("resume ahead {i}/{n}");
        let (floor, resume) = floor_then_resume(ctx, &sb, out, &step).await?;
        floor_ms.push(floor);
        resume_ms.push(resume);
    }
    ctx.api.kill(&sb.id).await?;
    Ok(
        Row::new("P4", "resume, restored ahead (resume_ahead = 1)", "ms")
            .samples(resume_ms)
            .floor("the pause capture restored by hand", floor_ms)
            .ratio_target(
                1.0,
                "p50 ≤ floor (the floor restores; this resume does not)",
            )
            .param("iterations", n)
            .param("resume_ahead", 1),
    )
}

const TIMER_ROW: &str = "a guest `sleep 2` paused 350 ms in: fires after resume";

/// How long after a resume a guest timer fires, against the time it had
/// left: `sleep 2` is started in the guest, the sandbox is paused 350 ms
/// later and resumed at once. The floor is the time the sleep had left
/// (2 s less the host time from its start to the pause); the sample is the
/// guest's wall clock when it fired (set from the host's at the resume)
/// less the host's clock when the resume returned.
async fn timer_across_pause(ctx: &Ctx, n: usize) -> anyhow::Result<Row> {
    const SLEEP_MS: f64 = 2000.0;
    let sb = ctx.api.create(ctx.args.cpus, ctx.args.memory_mb).await?;
    let wall = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    let (mut fired_ms, mut left_ms) = (Vec::new(), Vec::new());
    for i in 1..=n {
        ctx.step(format!(
            "timer {i}/{n}: sleep 2 in the guest, pause, resume"
        ));
        run(
            ctx,
            &sb,
            "rm -f /tmp/tine-fired; setsid sh -c 'sleep 2; date +%s.%N > /tmp/tine-fired' \
             </dev/null >/dev/null 2>&1 &",
        )
        .await?;
        let started = wall();
        tokio::time::sleep(Duration::from_millis(350)).await;
        let paused = wall();
        ctx.api.pause(&sb.id).await?;
        ctx.api.resume(&sb.id).await?;
        let resumed = wall();
        let deadline = Instant::now() + Duration::from_secs(60);
        let fired = loop {
            let out = run(ctx, &sb, "cat /tmp/tine-fired 2>/dev/null || true").await?;
            if let Ok(secs) = out.trim().parse::<f64>() {
                break secs * 1000.0;
            }
            anyhow::ensure!(Instant::now() < deadline, "the guest's sleep never ended");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        left_ms.push(SLEEP_MS - (paused - started));
        fired_ms.push(fired - resumed);
    }
    ctx.api.kill(&sb.id).await?;
    Ok(Row::new("P4", TIMER_ROW, "ms")
        .samples(fired_ms)
        .floor("the time the sleep had left at the pause", left_ms)
        .ratio_target(1.1, "p50 ≤ 1.1× the time left")
        .param("iterations", n))
}
