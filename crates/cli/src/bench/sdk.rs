//! P6: N concurrent creates, then N concurrent `commands.run("echo")`,
//! through the real E2B Python SDK (`p6.py`), against the same calls made
//! one at a time.
//!
//! The Python is `TINE_BENCH_PYTHON`, else the venv `tests/e2e/setup.sh`
//! installs (`$TINE_DATA_DIR/venv`), else a venv of the bench's own that it
//! makes once with the pinned SDK (a host set up only by `scripts/run.sh`
//! has no test venv).

use std::path::PathBuf;

use anyhow::{bail, Context};
use serde::Deserialize;

use super::report::Row;
use super::{Ctx, Out};

const SCRIPT: &str = include_str!("p6.py");

#[derive(Deserialize)]
struct P6Result {
    sequential_create: Vec<f64>,
    sequential_run: Vec<f64>,
    concurrent_create: Vec<f64>,
    concurrent_run: Vec<f64>,
    errors: Vec<String>,
}

/// The SDK version the bench's own venv gets (tests/e2e/setup.sh pins the
/// same one).
const E2B_PY_VERSION: &str = "2.63.0";

/// A Python with the E2B SDK: see the module docs.
async fn python(ctx: &Ctx) -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("TINE_BENCH_PYTHON").map(PathBuf::from) {
        if !p.exists() {
            bail!("TINE_BENCH_PYTHON={} does not exist", p.display());
        }
        return Ok(p);
    }
    let tests = tine_vmm::Paths::from_env().data_dir.join("venv/bin/python");
    if tests.exists() {
        return Ok(tests);
    }
    let venv = ctx.floor_paths.data_dir.join("sdk-venv");
    let py = venv.join("bin/python");
    let has_sdk = |py: &PathBuf| {
        let py = py.clone();
        async move {
            tokio::process::Command::new(&py)
                .args(["-c", &format!("import importlib.metadata as m; assert m.version('e2b') == '{E2B_PY_VERSION}'")])
                .output()
                .await
                .is_ok_and(|o| o.status.success())
        }
    };
    if py.exists() && has_sdk(&py).await {
        return Ok(py);
    }
    ctx.step(format!(
        "installing the E2B Python SDK {E2B_PY_VERSION} into {} (once)",
        venv.display()
    ));
    let made = tokio::process::Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .output()
        .await;
    if !made.as_ref().is_ok_and(|o| o.status.success()) {
        bail!("P6 needs python3 with venv: apt-get install python3-venv (or run tests/e2e/setup.sh, or set TINE_BENCH_PYTHON)");
    }
    let pip = tokio::process::Command::new(&py)
        .args(["-m", "pip", "install", "--disable-pip-version-check", "-q"])
        .arg(format!("e2b=={E2B_PY_VERSION}"))
        .output()
        .await
        .context("running pip")?;
    if !pip.status.success() {
        let err = String::from_utf8_lossy(&pip.stderr);
        bail!(
            "installing e2b=={E2B_PY_VERSION} failed ({}); run tests/e2e/setup.sh or set TINE_BENCH_PYTHON",
            err.lines().last().unwrap_or("no output")
        );
    }
    Ok(py)
}

/// The concurrent latencies against the one-at-a-time p50 scaled by
/// `n / cores` (n requests share `cores` cores): met when there was no
/// error and p99 ≤ 3× that.
fn row(what: String, conc: Vec<f64>, seq: &[f64], n: usize, cores: usize, errors: usize) -> Row {
    let scale = n as f64 / cores as f64;
    let mut r = Row::new("P6", what, "ms").samples(conc).floor(
        format!("one at a time × {n}/{cores} cores"),
        seq.iter().map(|v| v * scale).collect(),
    );
    r.target = "no error; p99 ≤ 3× floor".into();
    if let (Some(s), Some(f)) = (r.summary, r.floor) {
        r.ratio = Some(s.p99 / f.p50);
        r.met = Some(errors == 0 && s.n == n && s.p99 <= 3.0 * f.p50);
    }
    r.param("concurrency", n)
        .param("sequential", seq.len())
        .param(
            "sequential_p50_ms",
            super::stats::Summary::of(seq).map(|s| s.p50),
        )
}

/// Run the bench's Python `script` (saved as `name`) with the SDK pointed
/// at the bench's server and `env`; its last line of output is its result.
pub(super) async fn run_script<T: serde::de::DeserializeOwned>(
    ctx: &Ctx,
    name: &str,
    script: &str,
    env: &[(&str, String)],
) -> anyhow::Result<T> {
    let py = python(ctx).await?;
    let path = ctx.floor_paths.data_dir.join(name);
    std::fs::create_dir_all(&ctx.floor_paths.data_dir)?;
    std::fs::write(&path, script)?;
    let output = tokio::process::Command::new(&py)
        .arg(&path)
        .env("E2B_API_URL", &ctx.api.base)
        .env("E2B_SANDBOX_URL", &ctx.api.base)
        .env("E2B_VOLUME_API_URL", &ctx.api.base)
        .env("E2B_API_KEY", &ctx.api.key)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .env_remove("E2B_DOMAIN")
        .env_remove("E2B_DEBUG")
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("running {}", py.display()))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or("")).with_context(|| {
        format!(
            "the SDK script printed no result ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )
    })
}

pub async fn p6(ctx: &Ctx, out: &mut Out) -> anyhow::Result<()> {
    let n = ctx.args.concurrency.max(1);
    let seq = ctx.args.sequential.unwrap_or(n.min(10)).max(1);
    ctx.step(format!(
        "python SDK: {seq} creates + echo one at a time, then {n} at once"
    ));
    let r: P6Result = run_script(
        ctx,
        "p6.py",
        SCRIPT,
        &[
            ("TINE_BENCH_CONCURRENCY", n.to_string()),
            ("TINE_BENCH_SEQUENTIAL", seq.to_string()),
        ],
    )
    .await?;
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let errors = r.errors.len();
    let first = r.errors.first().cloned();
    out_rows(
        out,
        row(
            format!("{n} concurrent creates (SDK)"),
            r.concurrent_create,
            &r.sequential_create,
            n,
            cores,
            errors,
        ),
        &first,
    );
    out_rows(
        out,
        row(
            format!("{n} concurrent commands.run(\"echo\") (SDK)"),
            r.concurrent_run,
            &r.sequential_run,
            n,
            cores,
            errors,
        ),
        &first,
    );
    Ok(())
}

fn out_rows(out: &mut Out, row: Row, error: &Option<String>) {
    out.rows.push(row.error(error.clone()));
}
