//! Metrics over time: every running sandbox is sampled every 5 s (E2B's
//! interval) and its samples are kept until it is killed, for
//! `get_metrics(start, end)`.
//!
//! A sandbox keeps at most [`MAX_SAMPLES`]; when full, every second sample
//! of the older half is dropped, so a long-lived sandbox keeps its whole
//! history at a coarser grain and its recent past at full grain, in
//! bounded memory (≈ 100 KiB a sandbox).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::agent::{self, Metrics};
use super::Manager;

/// How often running sandboxes are sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// Samples kept per sandbox (≈ 1 h 25 min at full grain).
pub const MAX_SAMPLES: usize = 1024;

#[derive(Default)]
pub struct Samples {
    by_sandbox: Mutex<HashMap<String, VecDeque<Metrics>>>,
}

impl Samples {
    pub fn record(&self, id: &str, m: Metrics) {
        let mut map = self.by_sandbox.lock().unwrap_or_else(|e| e.into_inner());
        let log = map.entry(id.to_string()).or_default();
        if log.len() >= MAX_SAMPLES {
            thin_older_half(log);
        }
        log.push_back(m);
    }

    /// The samples of `id` taken from `start` to `end` (Unix seconds,
    /// both inclusive, either open), oldest first.
    pub fn range(&self, id: &str, start: Option<i64>, end: Option<i64>) -> Vec<Metrics> {
        let map = self.by_sandbox.lock().unwrap_or_else(|e| e.into_inner());
        map.get(id)
            .map(|log| {
                log.iter()
                    .filter(|m| start.is_none_or(|s| m.timestamp_unix >= s))
                    .filter(|m| end.is_none_or(|e| m.timestamp_unix <= e))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn forget(&self, id: &str) {
        self.by_sandbox
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }
}

/// Drops every second sample of the older half of `log`.
fn thin_older_half(log: &mut VecDeque<Metrics>) {
    let half = log.len() / 2;
    let mut i = 0;
    log.retain(|_| {
        let keep = i >= half || i % 2 == 0;
        i += 1;
        keep
    });
}

impl Manager {
    /// Sample every running sandbox once, all at once.
    pub async fn sample_metrics(&self) {
        let takes = self.all_live().into_iter().map(|(id, l)| async move {
            let m = agent::metrics(&l.guest, &l.access_token).await;
            (id, m)
        });
        for (id, m) in futures::future::join_all(takes).await {
            match m {
                // Only sandboxes still running: one killed meanwhile
                // must not come back.
                Ok(m) if self.live(&id).is_some() => self.samples.record(&id, m),
                Ok(_) => {}
                Err(e) => tracing::debug!(sandbox = %id, "metrics sample failed: {e}"),
            }
        }
    }

    /// Run [`Manager::sample_metrics`] forever.
    pub async fn sample_loop(self: Arc<Self>) {
        let mut tick = tokio::time::interval(SAMPLE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.sample_metrics().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ts: i64) -> Metrics {
        Metrics {
            timestamp: String::new(),
            timestamp_unix: ts,
            cpu_count: 1,
            cpu_used_pct: 0.0,
            mem_used: 0,
            mem_total: 0,
            mem_cache: 0,
            disk_used: 0,
            disk_total: 0,
        }
    }

    #[test]
    fn ranges_are_inclusive_and_a_sandbox_keeps_its_whole_life_in_bounds() {
        let s = Samples::default();
        for t in 0..10 {
            s.record("a", at(100 + 5 * t));
        }
        let ts = |v: Vec<Metrics>| v.iter().map(|m| m.timestamp_unix).collect::<Vec<_>>();
        assert_eq!(ts(s.range("a", Some(110), Some(120))), vec![110, 115, 120]);
        assert_eq!(ts(s.range("a", None, Some(104))), vec![100]);
        assert!(s.range("a", Some(0), Some(99)).is_empty());
        assert!(s.range("b", None, None).is_empty());
        for t in 10..(MAX_SAMPLES as i64 * 4) {
            s.record("a", at(100 + 5 * t));
        }
        let all = ts(s.range("a", None, None));
        assert!(all.len() <= MAX_SAMPLES);
        assert_eq!(all[0], 100, "the first sample survives thinning");
        assert_eq!(*all.last().unwrap(), 100 + 5 * (MAX_SAMPLES as i64 * 4 - 1));
        assert!(all.windows(2).all(|w| w[0] < w[1]));
        s.forget("a");
        assert!(s.range("a", None, None).is_empty());
    }
}
