//! What a run produced: one row per measured figure, printed as a table
//! and written as JSON.

use std::collections::BTreeMap;

use serde::Serialize;

use super::stats::Summary;

/// One line of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// `P1` … `P7`.
    pub scenario: &'static str,
    /// What was measured (`create`, `fork x16`, `pause`, …).
    pub what: String,
    /// `ms` or `MiB`.
    pub unit: &'static str,
    pub summary: Option<Summary>,
    pub samples: Vec<f64>,
    /// What the floor is, and its samples.
    pub floor_what: String,
    pub floor: Option<Summary>,
    pub floor_samples: Vec<f64>,
    /// The figure compared with the target (usually p50 / floor p50).
    pub ratio: Option<f64>,
    pub target: String,
    /// `None`: the row has no target that this machine can check.
    pub met: Option<bool>,
    pub error: Option<String>,
    /// Counts and sizes used, and anything else worth keeping.
    pub params: BTreeMap<String, serde_json::Value>,
}

impl Row {
    pub fn new(scenario: &'static str, what: impl Into<String>, unit: &'static str) -> Self {
        Self {
            scenario,
            what: what.into(),
            unit,
            summary: None,
            samples: Vec::new(),
            floor_what: String::new(),
            floor: None,
            floor_samples: Vec::new(),
            ratio: None,
            target: String::new(),
            met: None,
            error: None,
            params: BTreeMap::new(),
        }
    }

    /// A row for a scenario that failed before it measured anything.
    pub fn failed(scenario: &'static str, what: impl Into<String>, error: String) -> Self {
        let mut r = Self::new(scenario, what, "ms");
        r.error = Some(error);
        r
    }

    pub fn samples(mut self, samples: Vec<f64>) -> Self {
        self.summary = Summary::of(&samples);
        self.samples = samples;
        self
    }

    pub fn floor(mut self, what: impl Into<String>, samples: Vec<f64>) -> Self {
        self.floor_what = what.into();
        self.floor = Summary::of(&samples);
        self.floor_samples = samples;
        self
    }

    pub fn param(mut self, key: &str, value: impl Serialize) -> Self {
        self.params.insert(
            key.to_string(),
            serde_json::to_value(value).unwrap_or_default(),
        );
        self
    }

    /// p50 / floor p50, met when it is at most `max`.
    pub fn ratio_target(mut self, max: f64, target: impl Into<String>) -> Self {
        self.target = target.into();
        if let (Some(s), Some(f)) = (self.summary, self.floor) {
            if f.p50 > 0.0 {
                let r = s.p50 / f.p50;
                self.ratio = Some(r);
                self.met = Some(r <= max);
            }
        }
        self
    }

    /// p50 / floor p50, shown for information (no target).
    pub fn ratio_only(mut self) -> Self {
        if let (Some(s), Some(f)) = (self.summary, self.floor) {
            if f.p50 > 0.0 {
                self.ratio = Some(s.p50 / f.p50);
            }
        }
        self
    }

    /// p50 − floor p50 (in the row's unit), met when it is at most `max`
    /// (the ratio is still shown).
    pub fn diff_target(mut self, max: f64, target: impl Into<String>) -> Self {
        self.target = target.into();
        if let (Some(s), Some(f)) = (self.summary, self.floor) {
            let d = s.p50 - f.p50;
            if f.p50 > 0.0 {
                self.ratio = Some(s.p50 / f.p50);
            }
            self.met = Some(d <= max);
            self.params.insert(
                "p50_minus_floor".into(),
                serde_json::json!((d * 100.0).round() / 100.0),
            );
        }
        self
    }

    pub fn error(mut self, e: Option<String>) -> Self {
        if e.is_some() {
            self.met = Some(false);
        }
        self.error = e;
        self
    }
}

/// Per-stage timings of one scenario (stage name → summary in ms).
pub type Stages = BTreeMap<String, Summary>;

#[derive(Debug, Serialize)]
pub struct Report {
    pub command: String,
    pub host: Host,
    pub rows: Vec<Row>,
    /// Where the time goes, per scenario (`P1`, `P2`, …).
    pub stages: BTreeMap<String, Stages>,
    /// Wall time of each scenario with its cleanup, in seconds (`P1`,
    /// `P2 (jail off)`, …): where a run's time goes.
    pub seconds: BTreeMap<String, f64>,
}

#[derive(Debug, Serialize)]
pub struct Host {
    pub nproc: usize,
    pub cpu_model: String,
    pub accel: String,
    pub mem_total_mib: u64,
    pub kernel: String,
}

impl Host {
    pub fn probe() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split(':').nth(1))
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let mem_total_mib = meminfo
            .lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map_or(0, |kb| kb / 1024);
        Self {
            nproc: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model,
            accel: tine_vmm::Accel::probe().as_str().to_string(),
            mem_total_mib,
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .to_string(),
        }
    }
}

fn num(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn opt(v: Option<f64>) -> String {
    v.map(num).unwrap_or_else(|| "-".into())
}

impl Report {
    /// The table as Markdown (readable in a terminal and pasteable in docs).
    pub fn table(&self) -> String {
        let mut out = String::from(
            "| id | measured | unit | n | p50 | p90 | p99 | max | floor | floor p50 | ratio | target | met | error |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for r in &self.rows {
            let s = r.summary;
            let met = match r.met {
                Some(true) => "met",
                Some(false) => "NOT met",
                None => "-",
            };
            let err = r
                .error
                .as_deref()
                .unwrap_or("")
                .replace('|', "/")
                .replace('\n', " ");
            let err: String = err.chars().take(160).collect();
            out += &format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                r.scenario,
                r.what,
                r.unit,
                s.map_or(0, |s| s.n),
                opt(s.map(|s| s.p50)),
                opt(s.map(|s| s.p90)),
                opt(s.map(|s| s.p99)),
                opt(s.map(|s| s.max)),
                if r.floor_what.is_empty() {
                    "-"
                } else {
                    &r.floor_what
                },
                opt(r.floor.map(|f| f.p50)),
                r.ratio.map_or("-".into(), |x| format!("{x:.2}")),
                if r.target.is_empty() { "-" } else { &r.target },
                met,
                err,
            );
        }
        out
    }

    /// The per-stage breakdowns as Markdown.
    pub fn stages_table(&self) -> String {
        let mut out = String::new();
        for (scenario, stages) in &self.stages {
            out += &format!("\n{scenario} stages (ms)\n\n| stage | n | p50 | p90 | max |\n|---|---|---|---|---|\n");
            for (name, s) in stages {
                out += &format!(
                    "| {name} | {} | {} | {} | {} |\n",
                    s.n,
                    num(s.p50),
                    num(s.p90),
                    num(s.max)
                );
            }
        }
        out
    }
}
