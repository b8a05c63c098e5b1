//! `tine bench`: the performance scenarios P1–P15 (docs/benchmarks.md), each with
//! its floor measured in the same run, printed as one table (and written
//! as JSON with `--json`). See docs/benchmarks.md.
//!
//! Files: [`env`] (the server the bench talks to), `crate::client` (its
//! REST client, and `commands.run` through the proxy), `tine_vmm::floor`
//! (restores by hand), [`mem`] (PSS and dirtied RAM from /proc), [`stages`] (per-stage
//! timings from the server's log), [`stats`], [`report`], and one file per
//! scenario group: [`create`] (P1), [`fork`] (P2), [`capture`] (P3, P4),
//! [`memory`] (P5), [`sdk`] (P6), [`proxy`] (P7), [`image`] (P8), [`build`] (P9), [`net`] (P10),
//! [`rollout`] (P11), [`cluster`] (P12, P13), [`volume`] (P14), [`idle`] (P15).

mod build;
mod capture;
mod cluster;
mod create;
mod env;
mod fork;
mod idle;
mod image;
mod mem;
mod memory;
mod net;
mod proxy;
mod report;
mod rollout;
mod sdk;
mod stages;
mod stats;
mod volume;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use tine_vmm::Paths;

use crate::client::Api;
use report::{Report, Row, Stages};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
#[value(rename_all = "UPPER")]
pub enum Scenario {
    P1,
    P2,
    P3,
    P4,
    P5,
    P6,
    P7,
    P8,
    P9,
    P10,
    P11,
    P12,
    P13,
    P14,
    P15,
}

impl Scenario {
    const ALL: [Scenario; 15] = [
        Self::P1,
        Self::P2,
        Self::P3,
        Self::P4,
        Self::P5,
        Self::P6,
        Self::P7,
        Self::P8,
        Self::P9,
        Self::P10,
        Self::P11,
        Self::P12,
        Self::P13,
        Self::P14,
        Self::P15,
    ];

    fn id(self) -> &'static str {
        match self {
            Self::P1 => "P1",
            Self::P2 => "P2",
            Self::P3 => "P3",
            Self::P4 => "P4",
            Self::P5 => "P5",
            Self::P6 => "P6",
            Self::P7 => "P7",
            Self::P8 => "P8",
            Self::P9 => "P9",
            Self::P10 => "P10",
            Self::P11 => "P11",
            Self::P12 => "P12",
            Self::P13 => "P13",
            Self::P14 => "P14",
            Self::P15 => "P15",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Self::P1 => "create from a template",
            Self::P2 => "fork into children",
            Self::P3 => "snapshot after writing to disk",
            Self::P4 => "pause, then resume",
            Self::P5 => "memory per idle sandbox",
            Self::P6 => "concurrent creates and commands (Python SDK)",
            Self::P7 => "commands.run through the proxy",
            Self::P8 => "first sandbox of a never-seen image (lazy vs full pull)",
            Self::P9 => "template build: cached and last-step-changed vs cold",
            Self::P10 => "100 MiB download through the egress path vs the host",
            Self::P11 => "RL rollout: episodes that fork at step 3 (Python SDK)",
            Self::P12 => "cluster: a gateway against a node, placement at 1,000 nodes",
            Self::P13 => {
                "cluster: captures through the registry (first create, moved resume, push)"
            }
            Self::P14 => "volume mounted into a sandbox vs its own disk (Python SDK)",
            Self::P15 => "idle sandboxes: host CPU each, and how many a host holds",
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Scenarios to run (default: all of P1–P15).
    #[arg(value_enum, ignore_case = true)]
    scenarios: Vec<Scenario>,
    /// Iterations of every scenario (default: each scenario's own: P1 10,
    /// P2 3, P3 3, P4 5, P5 1, P7 200 calls, P8 1, P9 3, P10 3,
    /// P12 20 creates, P13 3, P14 3; P6, P11 and P15 take none).
    #[arg(long)]
    iterations: Option<usize>,
    /// P6: sandboxes created (and commands run) at once.
    #[arg(long, default_value_t = 50)]
    concurrency: usize,
    /// P6: creates done one at a time for its floor (default: min(10, concurrency)).
    #[arg(long)]
    sequential: Option<usize>,
    /// P11: episodes run at once.
    #[arg(long, default_value_t = 4)]
    episodes: usize,
    /// P11: children each episode forks into at step 3.
    #[arg(long, default_value_t = 4)]
    branches: usize,
    /// P2: children per fork.
    #[arg(long, default_value_t = 16)]
    fork_count: usize,
    /// P14: MiB written and read sequentially on the volume and the disk.
    #[arg(long, default_value_t = 64)]
    volume_mib: usize,
    /// P14: small files created on each.
    #[arg(long, default_value_t = 500)]
    volume_files: usize,
    /// P3: MiB written to the sandbox disk (with dd) before the snapshot.
    #[arg(long, default_value_t = 1024)]
    write_mib: u64,
    /// P3: memory of the snapshotted sandbox (the target is for 512 MiB).
    #[arg(long, default_value_t = 512)]
    snapshot_memory_mb: u32,
    /// P5: idle sandboxes running at once.
    #[arg(long, default_value_t = 32)]
    idle_count: usize,
    /// P15: the capacity its density rows fill (the server's
    /// `max_sandboxes`; default: the server's own default, from its cores).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    density_capacity: Option<u16>,
    /// vCPUs of every sandbox.
    #[arg(long, default_value_t = 1)]
    cpus: u32,
    /// Memory of every sandbox but P3's, in MiB.
    #[arg(long, default_value_t = 256)]
    memory_mb: u32,
    /// The smallest counts that still check every scenario works (CI's
    /// smoke run): beyond the counts given, P12 with 20 calls, 6 spread
    /// creates and 50 simulated nodes of 10 sandboxes, P15 with 2 idle
    /// sandboxes for 5 s. The numbers are not for comparing.
    #[arg(long)]
    smoke: bool,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Use this server instead of starting one (its data dir must be
    /// TINE_DATA_DIR: the floors read its snapshot files and QEMU pids).
    #[arg(long, requires = "api_key")]
    server: Option<String>,
    /// API key for --server.
    #[arg(long, env = "TINE_BENCH_API_KEY")]
    api_key: Option<String>,
}

/// Everything a scenario needs.
pub struct Ctx {
    pub api: std::sync::Arc<Api>,
    /// The server's data dir (snapshots, VM dirs with their qemu.pid).
    pub paths: Paths,
    /// Where VMs started by hand go.
    pub floor_paths: Paths,
    pub args: BenchArgs,
    pub pb: ProgressBar,
    /// The server's log, when the bench started it (per-stage timings).
    pub server_log: Option<PathBuf>,
    /// The server the bench started, if it did (P1 restarts it with a warm
    /// pool).
    pub own: Option<std::sync::Arc<tokio::sync::Mutex<env::OwnServer>>>,
}

impl Ctx {
    /// `normal`, or `smoke` with `--smoke`.
    pub fn count<T>(&self, normal: T, smoke: T) -> T {
        if self.args.smoke {
            smoke
        } else {
            normal
        }
    }

    /// `--iterations`, or the scenario's default.
    pub fn iterations(&self, default: usize) -> usize {
        self.args.iterations.unwrap_or(default).max(1)
    }

    /// The template snapshot (or capture) a sandbox's VM was restored from.
    pub fn parent_snapshot(&self, sandbox_id: &str) -> anyhow::Result<tine_vmm::Snapshot> {
        let path = self.paths.vm_dir(sandbox_id).join("vm.json");
        let rec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).with_context(|| {
                format!(
                    "reading {} (is --server's data dir TINE_DATA_DIR?)",
                    path.display()
                )
            })?)?;
        let parent = rec["parent"]
            .as_str()
            .context("the VM was not restored from a snapshot")?;
        Ok(tine_vmm::Snapshot::open(&self.paths, parent)?)
    }

    /// The QEMU pid of a sandbox.
    pub fn qemu_pid(&self, sandbox_id: &str) -> anyhow::Result<i32> {
        let path = self.paths.vm_ram_dir(sandbox_id).join("qemu.pid");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        text.trim()
            .parse()
            .with_context(|| format!("{} holds no pid", path.display()))
    }

    pub fn step(&self, msg: impl Into<String>) {
        self.pb.set_message(msg.into());
    }
}

/// What one scenario produced (rows survive a later error).
#[derive(Default)]
pub struct Out {
    pub rows: Vec<Row>,
    stage_samples: BTreeMap<String, Vec<f64>>,
}

impl Out {
    pub fn stage(&mut self, name: impl Into<String>, ms: f64) {
        self.stage_samples.entry(name.into()).or_default().push(ms);
    }

    fn stages(&self) -> Stages {
        self.stage_samples
            .iter()
            .filter_map(|(k, v)| Some((k.clone(), stats::Summary::of(v)?)))
            .collect()
    }
}

async fn run_scenario(ctx: &Ctx, s: Scenario, out: &mut Out) -> anyhow::Result<()> {
    match s {
        Scenario::P1 => create::p1(ctx, out).await,
        Scenario::P2 => fork::p2(ctx, out).await,
        Scenario::P3 => capture::p3(ctx, out).await,
        Scenario::P4 => capture::p4(ctx, out).await,
        Scenario::P5 => memory::p5(ctx, out).await,
        Scenario::P6 => sdk::p6(ctx, out).await,
        Scenario::P7 => proxy::p7(ctx, out).await,
        Scenario::P8 => image::p8(ctx, out).await,
        Scenario::P9 => build::p9(ctx, out).await,
        Scenario::P10 => net::p10(ctx, out).await,
        Scenario::P11 => rollout::p11(ctx, out).await,
        Scenario::P12 => cluster::p12(ctx, out).await,
        Scenario::P13 => cluster::p13(ctx, out).await,
        Scenario::P14 => volume::p14(ctx, out).await,
        Scenario::P15 => idle::p15(ctx, out).await,
    }
}

/// Run the scenarios; returns the report. Sandboxes and VMs made are removed
/// after each scenario, whatever happened.
async fn run_all(ctx: &Ctx, scenarios: &[Scenario], multi: &MultiProgress, report: &mut Report) {
    run_pass(ctx, scenarios, multi, report, false).await;
    // The jail's cost: fork and resume again with the bench's own server
    // restarted with `[jail] enabled = false` (P1 measures its own).
    let again: Vec<Scenario> = scenarios
        .iter()
        .copied()
        .filter(|s| matches!(s, Scenario::P2 | Scenario::P4))
        .collect();
    if let (Some(own), false) = (&ctx.own, again.is_empty()) {
        if set_jail(own, false).await.is_ok() {
            run_pass(ctx, &again, multi, report, true).await;
        }
        if let Err(e) = set_jail(own, true).await {
            report.rows.push(Row::failed(
                "P4",
                "restarting with the jail on",
                format!("{e:#}"),
            ));
        }
    }
}

/// Restart the bench's own server with its jail on or off.
async fn set_jail(
    own: &std::sync::Arc<tokio::sync::Mutex<env::OwnServer>>,
    on: bool,
) -> anyhow::Result<()> {
    let mut server = own.lock().await;
    server.jail = on;
    let pool = server.pool_size;
    server.restart(pool).await
}

async fn run_pass(
    ctx: &Ctx,
    scenarios: &[Scenario],
    multi: &MultiProgress,
    report: &mut Report,
    jail_off: bool,
) {
    let tag = if jail_off { " (jail off)" } else { "" };
    for &s in scenarios {
        let pb = multi.add(ProgressBar::new_spinner());
        pb.set_style(
            ProgressStyle::with_template("{spinner} {prefix:.bold} [{elapsed}] {msg}")
                .expect("valid template"),
        );
        pb.set_prefix(format!("{} {}{tag}", s.id(), s.title()));
        pb.enable_steady_tick(Duration::from_millis(200));
        let ctx = ctx.with_progress(pb.clone());
        let mut out = Out::default();
        let started = std::time::Instant::now();
        let result = run_scenario(&ctx, s, &mut out).await;
        ctx.step("cleaning up");
        let leftovers = ctx.api.clean_up(false).await;
        env::clean_hand_vms(&ctx.floor_paths).await;
        if let Err(e) = result {
            out.rows
                .push(Row::failed(s.id(), "scenario failed", format!("{e:#}")));
        }
        if !leftovers.is_empty() {
            out.rows
                .push(Row::failed(s.id(), "cleanup", leftovers.join("; ")));
        }
        let met = out.rows.iter().filter(|r| r.met == Some(true)).count();
        let errors = out.rows.iter().filter(|r| r.error.is_some()).count();
        pb.finish_with_message(format!(
            "done: {} rows, {met} targets met, {errors} errors",
            out.rows.len()
        ));
        let secs = started.elapsed().as_secs_f64();
        report
            .seconds
            .insert(format!("{}{tag}", s.id()), (secs * 10.0).round() / 10.0);
        let stages = out.stages();
        if !stages.is_empty() {
            report.stages.insert(format!("{}{tag}", s.id()), stages);
        }
        for row in &mut out.rows {
            row.what.push_str(tag);
        }
        report.rows.extend(out.rows);
    }
}

impl Ctx {
    fn with_progress(&self, pb: ProgressBar) -> Ctx {
        Ctx {
            api: self.api.clone(),
            paths: self.paths.clone(),
            floor_paths: self.floor_paths.clone(),
            args: self.args.clone(),
            pb,
            server_log: self.server_log.clone(),
            own: self.own.clone(),
        }
    }
}

pub async fn run(args: BenchArgs) -> anyhow::Result<i32> {
    let mut scenarios = if args.scenarios.is_empty() {
        Scenario::ALL.to_vec()
    } else {
        args.scenarios.clone()
    };
    scenarios.sort();
    scenarios.dedup();
    let base = Paths::from_env();
    let floor_paths = env::floor_paths(&base);
    env::clean_hand_vms(&floor_paths).await;

    let multi = MultiProgress::new();
    let mut own = None;
    let (url, key, paths, server_log) = match (&args.server, &args.api_key) {
        (Some(url), Some(key)) => (url.clone(), key.clone(), base.clone(), None),
        _ => {
            let pb = multi.add(ProgressBar::new_spinner());
            pb.set_message("starting tine serve");
            pb.enable_steady_tick(Duration::from_millis(200));
            let s = env::OwnServer::start(&base, args.cpus, args.memory_mb, 0).await?;
            pb.finish_with_message(format!(
                "tine serve on {} (data dir {}, log {})",
                s.url,
                s.paths.data_dir.display(),
                s.log.display()
            ));
            let r = (
                s.url.clone(),
                s.key.clone(),
                s.paths.clone(),
                Some(s.log.clone()),
            );
            own = Some(std::sync::Arc::new(tokio::sync::Mutex::new(s)));
            r
        }
    };
    let ctx = Ctx {
        api: std::sync::Arc::new(Api::new(&url, &key)),
        paths,
        floor_paths,
        args: args.clone(),
        pb: ProgressBar::hidden(),
        server_log,
        own: own.clone(),
    };
    if own.is_some() {
        // Sandboxes of an interrupted earlier run (the data dir is ours).
        let _ = ctx.api.clean_up(true).await;
    }

    let mut report = Report {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        host: report::Host::probe(),
        rows: Vec::new(),
        stages: BTreeMap::new(),
        seconds: BTreeMap::new(),
    };
    let interrupted = tokio::select! {
        _ = run_all(&ctx, &scenarios, &multi, &mut report) => false,
        _ = tokio::signal::ctrl_c() => true,
    };
    if interrupted {
        eprintln!("interrupted: removing the sandboxes and VMs of this run");
        let _ = ctx.api.clean_up(own.is_some()).await;
        env::clean_hand_vms(&ctx.floor_paths).await;
    }
    if let Some(s) = &own {
        let _ = ctx.api.clean_up(true).await;
        s.lock().await.stop().await;
    }
    if interrupted {
        return Ok(130);
    }

    println!("{}", report.table());
    println!("{}", report.stages_table());
    println!(
        "seconds per scenario (with its cleanup): {}",
        report
            .seconds
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "host: {} × {} ({}), {} MiB; accelerator {}",
        report.host.nproc,
        report.host.cpu_model,
        report.host.kernel,
        report.host.mem_total_mib,
        report.host.accel
    );
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    let errors = report.rows.iter().filter(|r| r.error.is_some()).count();
    Ok(if errors > 0 { 1 } else { 0 })
}
