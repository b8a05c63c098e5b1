//! P11: an RL rollout through the real E2B Python SDK (`p11.py`):
//! episodes that fork into branches at step 3, against the same steps run
//! in one sandbox with no snapshot or fork, both in this run.

use serde::Deserialize;

use super::report::Row;
use super::{Ctx, Out};

const SCRIPT: &str = include_str!("p11.py");

#[derive(Deserialize)]
struct Phase {
    /// Per episode, ms.
    episode: Vec<f64>,
    /// Per step (files.write + commands.run), ms.
    steps: Vec<f64>,
    fork: Vec<f64>,
    create: Vec<f64>,
    errors: Vec<String>,
    wall_s: f64,
    /// The host's busy CPU seconds over the phase.
    cpu_s: f64,
}

impl Phase {
    fn per_minute(&self) -> f64 {
        self.episode.len() as f64 / self.wall_s.max(1e-9) * 60.0
    }
    fn cpu_per_episode(&self) -> f64 {
        self.cpu_s / (self.episode.len().max(1) as f64)
    }
}

#[derive(Deserialize)]
struct P11Result {
    straight: Phase,
    branching: Phase,
}

pub async fn p11(ctx: &Ctx, out: &mut Out) -> anyhow::Result<()> {
    let episodes = ctx.args.episodes.max(1);
    let branches = ctx.args.branches.max(1);
    ctx.step(format!(
        "python SDK: {episodes} episodes at once, straight, then forking into {branches} at step 3"
    ));
    let r: P11Result = super::sdk::run_script(
        ctx,
        "p11.py",
        SCRIPT,
        &[
            ("TINE_BENCH_EPISODES", episodes.to_string()),
            ("TINE_BENCH_BRANCHES", branches.to_string()),
        ],
    )
    .await?;
    let (b, s) = (&r.branching, &r.straight);
    let steps = 5 + 2 * branches;
    let errors: Vec<String> = b.errors.iter().chain(&s.errors).cloned().collect();
    let error = errors.first().cloned();
    let floor = format!("the same {steps} steps in one sandbox, no fork");
    let reported = "reported (no target)";

    let mut rate = Row::new("P11", "episodes per minute (higher is better)", "ep/min")
        .samples(vec![b.per_minute()])
        .floor(floor.clone(), vec![s.per_minute()]);
    rate.ratio = Some(b.per_minute() / s.per_minute().max(1e-9));
    rate.target = reported.into();
    out.rows.push(
        rate.param("episodes", episodes)
            .param("branches", branches)
            .param("wall_s", b.wall_s)
            .param("floor_wall_s", s.wall_s)
            .param("errors", errors.len())
            .error(error.clone()),
    );
    let mut episode = Row::new(
        "P11",
        format!("episode: {episodes} at once, each forking into {branches} at step 3"),
        "ms",
    )
    .samples(b.episode.clone())
    .floor(floor.clone(), s.episode.clone())
    .ratio_target(f64::INFINITY, reported);
    episode.met = None;
    out.rows.push(episode);
    let mut step = Row::new("P11", "step: files.write + commands.run", "ms")
        .samples(b.steps.clone())
        .floor(format!("steps of {floor}"), s.steps.clone())
        .ratio_target(f64::INFINITY, reported);
    step.met = None;
    out.rows.push(step);
    let mut cpu = Row::new("P11", "host CPU seconds per episode", "s")
        .samples(vec![b.cpu_per_episode()])
        .floor(floor, vec![s.cpu_per_episode()])
        .ratio_target(f64::INFINITY, reported);
    cpu.met = None;
    out.rows
        .push(cpu.param("cpu_s", b.cpu_s).param("floor_cpu_s", s.cpu_s));
    // The breakdown: what a branching episode spends outside its steps.
    let mut fork = Row::new("P11", format!("fork ×{branches} at step 3 (SDK)"), "ms")
        .samples(b.fork.clone())
        .floor("create (SDK), same run", b.create.clone())
        .ratio_target(f64::INFINITY, reported);
    fork.met = None;
    out.rows.push(fork);
    Ok(())
}
