//! P5: host memory per idle sandbox of one template, N running, against
//! one sandbox alone (PSS of each QEMU from /proc/PID/smaps_rollup); and
//! how much of what a guest frees goes back to the host (the balloon's
//! free page reporting).

use std::time::{Duration, Instant};

use super::capture::run;
use super::create::ms;
use super::report::Row;
use super::{mem, Ctx, Out};

/// Time for a fresh sandbox to settle (the agent's first work after /init,
/// page faults of the restore).
const SETTLE: Duration = Duration::from_secs(3);

pub async fn p5(ctx: &Ctx, out: &mut Out) -> anyhow::Result<()> {
    let n = ctx.iterations(1);
    let count = ctx.args.idle_count.max(2);
    let (cpus, memory) = (ctx.args.cpus, ctx.args.memory_mb);
    let (mut alone, mut marginal, mut each) = (Vec::new(), Vec::new(), Vec::new());
    for i in 1..=n {
        ctx.step(format!("{i}/{n}: one sandbox alone"));
        let first = ctx.api.create(cpus, memory).await?;
        tokio::time::sleep(SETTLE).await;
        let pss_alone = mem::pss_mib(ctx.qemu_pid(&first.id)?)?;
        let mut ids = vec![first.id.clone()];
        for j in 2..=count {
            ctx.step(format!("{i}/{n}: idle sandbox {j}/{count}"));
            ids.push(ctx.api.create(cpus, memory).await?.id);
        }
        ctx.step(format!("{i}/{n}: {count} idle sandboxes settling"));
        tokio::time::sleep(SETTLE).await;
        let mut total = 0.0;
        for id in &ids {
            let p = mem::pss_mib(ctx.qemu_pid(id)?)?;
            total += p;
            each.push(p);
        }
        alone.push(pss_alone);
        marginal.push((total - pss_alone) / (count - 1) as f64);
        out.stage(
            format!("PSS total of {count} sandboxes (MiB, not ms)"),
            total,
        );
        for id in ids {
            ctx.api.kill(&id).await?;
        }
    }
    out.rows.push(
        Row::new(
            "P5",
            format!("marginal PSS per idle sandbox, {count} running"),
            "MiB",
        )
        .samples(marginal)
        .floor("PSS of one sandbox alone", alone)
        .ratio_target(0.5, "≤ 0.5× the first one")
        .param("iterations", n)
        .param("sandboxes", count)
        .param("memory_mb", memory),
    );
    out.rows.push(
        Row::new("P5", format!("PSS of each sandbox, {count} running"), "MiB")
            .samples(each)
            .param(
                "note",
                "information: KVM target ≤ 16 MiB each cannot be checked under TCG",
            ),
    );
    given_back(ctx, out, n).await
}

/// MiB a guest writes to tmpfs and deletes again in [`given_back`] (a
/// 256 MiB guest's /dev/shm holds half its RAM).
const FREED_MIB: u64 = 96;
/// How long the host may take to get freed memory back (reports start
/// about 2 s after the free, 64 MiB per round trip).
const GIVE_BACK_WAIT: Duration = Duration::from_secs(30);

/// A sandbox's PSS after its guest wrote and deleted [`FREED_MIB`]: what
/// the write took and what the delete gave back.
async fn given_back(ctx: &Ctx, out: &mut Out, n: usize) -> anyhow::Result<()> {
    let (cpus, memory) = (ctx.args.cpus, ctx.args.memory_mb);
    let (mut taken, mut returned) = (Vec::new(), Vec::new());
    for i in 1..=n {
        ctx.step(format!(
            "{i}/{n}: a guest writes and deletes {FREED_MIB} MiB"
        ));
        let sb = ctx.api.create(cpus, memory).await?;
        tokio::time::sleep(SETTLE).await;
        let pid = ctx.qemu_pid(&sb.id)?;
        let idle = mem::pss_mib(pid)?;
        let file = "/dev/shm/bench-fill";
        run(
            ctx,
            &sb,
            &format!("head -c {FREED_MIB}M /dev/urandom > {file}"),
        )
        .await?;
        let full = mem::pss_mib(pid)?;
        run(ctx, &sb, &format!("rm {file}")).await?;
        let t = Instant::now();
        let mut last = full;
        let freed = loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let now = mem::pss_mib(pid)?;
            // Settled: no change in a second, after something came back.
            if (now < full - 1.0 && (last - now).abs() < 0.5) || t.elapsed() > GIVE_BACK_WAIT {
                break now;
            }
            last = now;
        };
        out.stage("delete to memory given back, ±1 s (ms)", ms(t));
        taken.push(full - idle);
        returned.push(full - freed);
        ctx.api.kill(&sb.id).await?;
    }
    out.rows.push(
        Row::new(
            "P5",
            format!("PSS given back after the guest deletes a {FREED_MIB} MiB tmpfs file"),
            "MiB",
        )
        .samples(returned)
        .floor(format!("PSS the {FREED_MIB} MiB file took"), taken)
        .ratio_only()
        .param("iterations", n)
        .param("memory_mb", memory)
        .param(
            "note",
            "information: ratio 1 = all given back (virtio-balloon free page reporting; \
             TINE_BALLOON=0 turns it off for new templates)",
        ),
    );
    Ok(())
}
