//! P5: host memory per idle sandbox of one template, N running, against
//! one sandbox alone (PSS of each QEMU from /proc/PID/smaps_rollup).

use std::time::Duration;

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
    Ok(())
}
