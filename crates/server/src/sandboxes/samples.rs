//! Metrics over time: every running sandbox is sampled every 5 s (E2B's
//! interval) and its samples are kept until it is killed, for
//! `get_metrics(start, end)`.
//!
//! An idle guest is not woken for it: each interval first reads its QEMU's
//! CPU time on the host. The guest's agent is asked (CPU, memory, disk as
//! the guest sees them) when QEMU used more than [`ACTIVE_SHARE`] of a core
//! since the last sample, when its QEMU is a new process, and at least
//! every [`ASK_GUEST_EVERY`]; otherwise the sample repeats the last memory
//! and disk figures the guest gave, with the CPU use measured on the host
//! (QEMU's CPU time over the interval, per vCPU). Asking every 5 s was most
//! of what an idle sandbox cost the host (docs/benchmarks.md, P15).
//!
//! A sandbox keeps at most [`MAX_SAMPLES`]; when full, every second sample
//! of the older half is dropped, so a long-lived sandbox keeps its whole
//! history at a coarser grain and its recent past at full grain, in
//! bounded memory (≈ 100 KiB a sandbox).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::agent::{self, Metrics};
use super::Manager;

/// How often running sandboxes are sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// Samples kept per sandbox (≈ 1 h 25 min at full grain).
pub const MAX_SAMPLES: usize = 1024;
/// An idle sandbox's guest is still asked at least this often.
pub const ASK_GUEST_EVERY: Duration = Duration::from_secs(60);
/// A sandbox whose QEMU used more than this share of one host core since
/// the last sample was busy: its guest is asked. An idle 2-vCPU TCG guest
/// uses about 0.2 %, one metrics request about 10 ms of QEMU time.
pub const ACTIVE_SHARE: f64 = 0.01;

#[derive(Default)]
pub struct Samples {
    by_sandbox: Mutex<HashMap<String, VecDeque<Metrics>>>,
    seen: Mutex<HashMap<String, Seen>>,
}

/// What the sampling of one sandbox last saw.
struct Seen {
    /// Its QEMU process and that process's CPU time, when last sampled.
    pid: i32,
    cpu: Duration,
    at: Instant,
    /// The guest's last answer, and when it was asked.
    guest: Metrics,
    asked: Instant,
}

/// How one sandbox is sampled this interval.
#[derive(Debug, PartialEq)]
enum Take {
    /// Ask the guest's agent.
    Guest,
    /// Repeat the guest's last memory and disk figures, with this CPU use
    /// (% of its vCPUs) measured on the host.
    Repeat { cpu_used_pct: f64 },
}

/// The choice for a sandbox whose QEMU is `pid` and has used `cpu` by `now`.
fn plan(seen: Option<&Seen>, pid: i32, cpu: Option<Duration>, now: Instant) -> Take {
    let (Some(seen), Some(cpu)) = (seen, cpu) else {
        return Take::Guest;
    };
    let wall = now.saturating_duration_since(seen.at).as_secs_f64();
    if seen.pid != pid
        || now.saturating_duration_since(seen.asked) >= ASK_GUEST_EVERY
        || wall <= 0.0
    {
        return Take::Guest;
    }
    let share = cpu.saturating_sub(seen.cpu).as_secs_f64() / wall;
    if share > ACTIVE_SHARE {
        return Take::Guest;
    }
    let vcpus = seen.guest.cpu_count.max(1) as f64;
    Take::Repeat {
        cpu_used_pct: (share * 100.0 / vcpus * 100.0).round() / 100.0,
    }
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
        self.seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }

    /// The QEMU CPU time of `id`'s process `pid` read at `now`, and what
    /// to do about it; the guest's answer comes back through [`Self::asked`].
    fn plan(&self, id: &str, pid: i32, cpu: Option<Duration>, now: Instant) -> Take {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let take = plan(seen.get(id), pid, cpu, now);
        if let (Take::Repeat { .. }, Some(s), Some(cpu)) = (&take, seen.get_mut(id), cpu) {
            s.cpu = cpu;
            s.at = now;
        }
        take
    }

    /// The guest of `id` answered `m` for the interval planned at `now`.
    fn asked(&self, id: &str, pid: i32, cpu: Option<Duration>, now: Instant, m: &Metrics) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        match cpu {
            Some(cpu) => {
                seen.insert(
                    id.to_string(),
                    Seen {
                        pid,
                        cpu,
                        at: now,
                        guest: m.clone(),
                        asked: now,
                    },
                );
            }
            None => {
                seen.remove(id);
            }
        }
    }

    /// The guest's last answer for `id`, stamped now, with `cpu_used_pct`.
    fn repeat(&self, id: &str, cpu_used_pct: f64) -> Option<Metrics> {
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let (timestamp, timestamp_unix) = agent::stamp_now();
        seen.get(id).map(|s| Metrics {
            timestamp,
            timestamp_unix,
            cpu_used_pct,
            ..s.guest.clone()
        })
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
    /// Sample every running sandbox once, all at once; idle guests are
    /// not woken (see the module's doc).
    pub async fn sample_metrics(&self) {
        let takes = self.all_live().into_iter().map(|(id, l)| async move {
            // A VM busy with a lifecycle step (pause, capture) is skipped.
            let pid = l.vm.try_lock().ok()?.as_ref()?.process_id();
            let now = Instant::now();
            let cpu = tine_vmm::cpu_time(pid);
            let m = match self.samples.plan(&id, pid, cpu, now) {
                Take::Repeat { cpu_used_pct } => self.samples.repeat(&id, cpu_used_pct)?,
                Take::Guest => match agent::metrics(&l.guest, &l.access_token).await {
                    Ok(m) => {
                        self.samples.asked(&id, pid, cpu, now, &m);
                        m
                    }
                    Err(e) => {
                        tracing::debug!(sandbox = %id, "metrics sample failed: {e}");
                        return None;
                    }
                },
            };
            Some((id, m))
        });
        for (id, m) in futures::future::join_all(takes).await.into_iter().flatten() {
            // Only sandboxes still running: one killed meanwhile must not
            // come back.
            if self.live(&id).is_some() {
                self.samples.record(&id, m);
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

    #[test]
    fn an_idle_guest_is_asked_once_a_minute_a_busy_or_new_one_at_once() {
        let t0 = Instant::now();
        let s = |cpu_ms: u64, sampled: Duration, asked: Duration| Seen {
            pid: 7,
            cpu: Duration::from_millis(cpu_ms),
            at: t0 + sampled,
            guest: Metrics {
                cpu_count: 2,
                ..at(0)
            },
            asked: t0 + asked,
        };
        let secs = Duration::from_secs;
        let ms = Duration::from_millis;
        // Nothing seen yet, or the process is gone: ask.
        assert_eq!(plan(None, 7, Some(ms(5)), t0), Take::Guest);
        assert_eq!(
            plan(Some(&s(0, secs(0), secs(0))), 7, None, t0 + secs(5)),
            Take::Guest
        );
        // Idle: 10 ms in 5 s is 0.2 % of a core, 0.1 % of each of 2 vCPUs.
        assert_eq!(
            plan(Some(&s(0, secs(0), secs(0))), 7, Some(ms(10)), t0 + secs(5)),
            Take::Repeat { cpu_used_pct: 0.1 }
        );
        // Busy: 100 ms in 5 s is 2 % of a core.
        assert_eq!(
            plan(
                Some(&s(0, secs(0), secs(0))),
                7,
                Some(ms(100)),
                t0 + secs(5)
            ),
            Take::Guest
        );
        // A new QEMU (resumed), or a minute since the guest was asked.
        assert_eq!(
            plan(Some(&s(0, secs(0), secs(0))), 8, Some(ms(0)), t0 + secs(5)),
            Take::Guest
        );
        assert_eq!(
            plan(
                Some(&s(0, secs(55), secs(0))),
                7,
                Some(ms(0)),
                t0 + secs(60)
            ),
            Take::Guest
        );
    }

    #[test]
    fn a_repeated_sample_keeps_the_guests_figures_and_takes_the_hosts_cpu() {
        let samples = Samples::default();
        let t0 = Instant::now();
        let m = Metrics {
            cpu_count: 2,
            mem_used: 123,
            disk_used: 456,
            cpu_used_pct: 50.0,
            ..at(0)
        };
        assert!(samples.repeat("a", 1.0).is_none());
        assert_eq!(samples.plan("a", 7, Some(Duration::ZERO), t0), Take::Guest);
        samples.asked("a", 7, Some(Duration::ZERO), t0, &m);
        let later = t0 + Duration::from_secs(5);
        let Take::Repeat { cpu_used_pct } =
            samples.plan("a", 7, Some(Duration::from_millis(20)), later)
        else {
            panic!("an idle guest is not asked");
        };
        let r = samples.repeat("a", cpu_used_pct).unwrap();
        assert_eq!((r.mem_used, r.disk_used, r.cpu_count), (123, 456, 2));
        assert_eq!(r.cpu_used_pct, 0.2);
        assert!(r.timestamp_unix > 0);
        // The next interval is measured from this one.
        assert_eq!(
            samples.plan(
                "a",
                7,
                Some(Duration::from_millis(20)),
                later + Duration::from_secs(5)
            ),
            Take::Repeat { cpu_used_pct: 0.0 }
        );
        samples.forget("a");
        assert_eq!(
            samples.plan("a", 7, Some(Duration::ZERO), later),
            Take::Guest
        );
    }
}
