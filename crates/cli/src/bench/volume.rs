//! P14: a volume mounted into a sandbox (NFS from the host) against the
//! sandbox's own disk, through the real E2B Python SDK (`p14.py`): the
//! same guest program on both, in one sandbox, in this run.

use serde::Deserialize;

use super::report::Row;
use super::{Ctx, Out};

const SCRIPT: &str = include_str!("p14.py");

#[derive(Deserialize)]
struct Run {
    write: f64,
    read: f64,
    creates: f64,
}

/// One of a run's rates.
type Metric = fn(&Run) -> f64;

#[derive(Deserialize)]
struct P14Result {
    volume: Vec<Run>,
    disk: Vec<Run>,
    errors: Vec<String>,
}

pub async fn p14(ctx: &Ctx, out: &mut Out) -> anyhow::Result<()> {
    let iterations = ctx.args.iterations.unwrap_or(3).max(1);
    let mib = ctx.args.volume_mib.max(1);
    let files = ctx.args.volume_files.max(1);
    ctx.step(format!(
        "python SDK: {mib} MiB written and read, {files} small files, on a volume and on the own disk, ×{iterations}"
    ));
    let r: P14Result = super::sdk::run_script(
        ctx,
        "p14.py",
        SCRIPT,
        &[
            ("TINE_BENCH_MIB", mib.to_string()),
            ("TINE_BENCH_FILES", files.to_string()),
            ("TINE_BENCH_ITERATIONS", iterations.to_string()),
        ],
    )
    .await?;
    let error = r.errors.first().cloned();
    let target = "≥ 0.5× of the own disk";
    let rows: [(&str, &'static str, Metric); 3] = [
        ("sequential write (1 MiB writes, fsync)", "MiB/s", |x| {
            x.write
        }),
        ("sequential read (page cache dropped)", "MiB/s", |x| x.read),
        (
            "small-file creates (1 KiB each, then sync)",
            "files/s",
            |x| x.creates,
        ),
    ];
    for (what, unit, get) in rows {
        let vol: Vec<f64> = r.volume.iter().map(get).collect();
        let disk: Vec<f64> = r.disk.iter().map(get).collect();
        let mut row = Row::new("P14", format!("volume: {what} (higher is better)"), unit)
            .samples(vol)
            .floor("the sandbox's own disk, same sandbox", disk)
            .ratio_only();
        // Higher is better: met when the volume keeps half the disk's rate.
        row.met = row.ratio.map(|x| x >= 0.5);
        row.target = target.into();
        out.rows.push(
            row.param("mib", mib)
                .param("files", files)
                .param("errors", r.errors.len())
                .error(error.clone()),
        );
    }
    Ok(())
}
