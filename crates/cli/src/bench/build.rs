//! P9: a template build of five steps through the Template API (as the
//! SDK drives it: `POST /v3/templates`, the start request, status polls),
//! cold (a new first step, so no layer is reused), again unchanged (every
//! step cached), and with only its last step changed.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use hyper::Method;
use serde_json::{json, Value};

use super::create::ms;
use super::report::Row;
use super::{Ctx, Out};

const NAME: &str = "bench-p9";

/// The five steps; `first` and `last` make them new where asked.
fn steps(first: &str, last: &str) -> Value {
    let run = |cmd: String| json!({ "type": "RUN", "args": [cmd, "root"], "force": false });
    json!([
        run(format!("echo {first} > /opt/first && dd if=/dev/urandom of=/opt/blob bs=1M count=16 status=none")),
        { "type": "ENV", "args": ["P9", "yes"], "force": false },
        run("seq 1 200000 > /opt/numbers".into()),
        run("sha256sum /opt/blob /opt/numbers > /opt/sums".into()),
        run(format!("echo {last} > /opt/last")),
    ])
}

/// One build through the API, timed from the request to `ready`.
async fn build(ctx: &Ctx, steps: Value) -> anyhow::Result<f64> {
    let t = Instant::now();
    let b = ctx
        .api
        .call(
            Method::POST,
            "/v3/templates",
            Some(
                json!({ "name": NAME, "cpuCount": ctx.args.cpus, "memoryMB": ctx.args.memory_mb }),
            ),
        )
        .await?;
    let id = b["buildID"].as_str().context("no buildID")?.to_string();
    ctx.api
        .call(
            Method::POST,
            &format!("/v2/templates/{NAME}/builds/{id}"),
            Some(json!({ "fromTemplate": "base", "force": false, "steps": steps })),
        )
        .await?;
    let deadline = Instant::now() + Duration::from_secs(1800);
    loop {
        let s = ctx
            .api
            .call(
                Method::GET,
                &format!("/templates/{NAME}/builds/{id}/status"),
                None,
            )
            .await?;
        match s["status"].as_str() {
            Some("ready") => return Ok(ms(t)),
            Some("error") => bail!("build failed: {}", s["reason"]["message"]),
            _ if Instant::now() > deadline => bail!("build {id} did not finish"),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

pub async fn p9(ctx: &Ctx, out: &mut Out) -> anyhow::Result<()> {
    let n = ctx.iterations(3);
    let (mut cold, mut cached, mut last) = (Vec::new(), Vec::new(), Vec::new());
    let mut error = None;
    for i in 0..n {
        let nonce = format!(
            "{:x}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_nanos()
        );
        let r: anyhow::Result<()> = async {
            ctx.step(format!("{}/{n}: cold build", i + 1));
            cold.push(build(ctx, steps(&nonce, "a")).await?);
            ctx.step(format!("{}/{n}: unchanged", i + 1));
            cached.push(build(ctx, steps(&nonce, "a")).await?);
            ctx.step(format!("{}/{n}: last step changed", i + 1));
            last.push(build(ctx, steps(&nonce, "b")).await?);
            Ok(())
        }
        .await;
        if let Err(e) = r {
            error = Some(format!("{e:#}"));
            break;
        }
    }
    let _ = ctx
        .api
        .call(Method::DELETE, &format!("/templates/{NAME}"), None)
        .await;
    out.rows.push(
        Row::new("P9", "5-step template build, every step cached", "ms")
            .samples(cached)
            .floor("the same build, cold", cold.clone())
            .ratio_target(0.1, "≤ 0.1× cold")
            .error(error.clone()),
    );
    out.rows.push(
        Row::new("P9", "5-step template build, last step changed", "ms")
            .samples(last)
            .floor("the same build, cold", cold)
            .ratio_target(0.3, "≤ 0.3× cold")
            .error(error),
    );
    Ok(())
}
