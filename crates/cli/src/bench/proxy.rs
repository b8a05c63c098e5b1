//! P7: `commands.run("true")` round trip through the server and its proxy,
//! against the same call made straight to the agent of the same VM through
//! its network namespace. Both sides keep their connection alive (as the
//! SDKs do) and the calls alternate, so load drift hits both alike.

use std::time::{Duration, Instant};

use anyhow::bail;

use super::create::ms;
use super::report::Row;
use super::{Ctx, Out};
use tine_agent_client::process::Direct;

const TIMEOUT: Duration = Duration::from_secs(30);

pub async fn p7(ctx: &Ctx, out: &mut Out) -> anyhow::Result<()> {
    let n = ctx.iterations(200);
    let sb = ctx.api.create(ctx.args.cpus, ctx.args.memory_mb).await?;
    let guest = crate::driver(&ctx.paths).guest_of(&sb.id)?;
    let conn = guest.connect(tine_agent_client::AGENT_PORT);
    let mut direct = tokio::time::timeout(Duration::from_secs(2), Direct::connect(conn))
        .await
        .map_err(|_| anyhow::anyhow!("connecting straight to the agent timed out"))??;
    // Warm both paths (connections, the guest's page cache for bash).
    for _ in 0..3 {
        ctx.api.exec(&sb, "true", TIMEOUT).await?;
        direct.exec("true", &sb.token, TIMEOUT).await?;
    }
    let (mut via_proxy, mut straight) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 1..=n {
        if i % 10 == 1 {
            ctx.step(format!("{i}/{n}"));
        }
        let t = Instant::now();
        let a = ctx.api.exec(&sb, "true", TIMEOUT).await?;
        via_proxy.push(ms(t));
        let t = Instant::now();
        let b = direct.exec("true", &sb.token, TIMEOUT).await?;
        straight.push(ms(t));
        if a.exit_code != 0 || b.exit_code != 0 {
            bail!(
                "`true` exited {} (proxy) / {} (direct)",
                a.exit_code,
                b.exit_code
            );
        }
    }
    let mut row = Row::new("P7", "commands.run(\"true\") via server + proxy", "ms")
        .samples(via_proxy)
        .floor("the same call straight to the agent (netns)", straight)
        .param("calls", n);
    row.target = "proxy adds ≤ 2 ms p50".into();
    if let (Some(s), Some(f)) = (row.summary, row.floor) {
        row.ratio = Some(s.p50 / f.p50);
        row.met = Some(s.p50 - f.p50 <= 2.0);
        row = row.param("added_p50_ms", s.p50 - f.p50);
    }
    out.rows.push(row);
    ctx.api.kill(&sb.id).await?;
    Ok(())
}
