//! The server's own Prometheus metrics (`GET /metrics`): sandboxes by
//! state, API latency by route, create latency and failures, capture
//! durations, host headroom, bytes through the proxy. Durations are
//! histograms, so dashboards read quantiles, not averages
//! (`deploy/grafana/tine.json`, `deploy/prometheus/alerts.yml`).

use bytes::Bytes;
use http_body_util::BodyExt;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirectionLabel {
    pub direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub method: String,
    pub route: String,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

pub type ByteCounter = Family<DirectionLabel, Counter>;

pub struct Metrics {
    registry: Registry,
    pub proxy_bytes: ByteCounter,
    pub api_latency: Family<RouteLabels, Histogram>,
    pub sandboxes: Family<StateLabel, Gauge>,
    /// The image daemon's chunk cache, as it last reported.
    pub image_cache_bytes: Family<KindLabel, Gauge>,
    pub image_cache_reads: Family<KindLabel, Gauge>,
    pub image_cache_hit_ratio: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// The host's capacity for sandboxes by bound (`total`, `cpu`,
    /// `max_sandboxes`) and what of it is in use.
    pub capacity: Family<KindLabel, Gauge>,
    pub host_cores: Gauge,
    /// Captures through a cluster's registry, since the node started.
    pub captures: Family<KindLabel, Gauge>,
    pub capture_bytes: Family<KindLabel, Gauge>,
    /// Creates that gave a sandbox, from the call to a guest that answers.
    pub create_duration: Histogram,
    /// Creates refused or failed, by [`crate::sandboxes::SandboxError::reason`].
    pub create_failures: Family<ReasonLabel, Counter>,
    /// Captures of running sandboxes by kind (pause, snapshot, fork).
    pub capture_duration: Family<KindLabel, Histogram>,
    /// The host's headroom, read at each scrape.
    pub host_memory_available: Gauge,
    pub host_disk_available: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("tine");
        let proxy_bytes = ByteCounter::default();
        registry.register(
            "proxy_bytes",
            "Bytes through the sandbox proxy (in: to sandboxes)",
            proxy_bytes.clone(),
        );
        let api_latency = Family::<RouteLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.0005, 2.0, 18))
        });
        registry.register(
            "api_request_duration_seconds",
            "REST API latency by route",
            api_latency.clone(),
        );
        let sandboxes = Family::<StateLabel, Gauge>::default();
        registry.register("sandboxes", "Sandboxes by state", sandboxes.clone());
        let image_cache_bytes = Family::<KindLabel, Gauge>::default();
        registry.register(
            "image_cache_bytes",
            "Image chunk store: cached (evictable, bounded by max), pinned (only here), max, fetched (since the daemon started)",
            image_cache_bytes.clone(),
        );
        let image_cache_reads = Family::<KindLabel, Gauge>::default();
        registry.register(
            "image_cache_reads",
            "Chunk reads since the image daemon started: hit, miss (fetched), error; and evictions",
            image_cache_reads.clone(),
        );
        let image_cache_hit_ratio = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "image_cache_hit_ratio",
            "Chunk reads served locally, of all",
            image_cache_hit_ratio.clone(),
        );
        let capacity = Family::<KindLabel, Gauge>::default();
        registry.register(
            "capacity_sandboxes",
            "Sandboxes this host holds: total (the smaller bound), cpu (max_sandboxes_per_core x cores), max_sandboxes; in_use (live, starting, building: what admission counts); pooled (warm pool and restored ahead, which give way)",
            capacity.clone(),
        );
        let host_cores = Gauge::default();
        registry.register(
            "host_cores",
            "Host cores the capacity is computed from",
            host_cores.clone(),
        );
        let captures = Family::<KindLabel, Gauge>::default();
        registry.register(
            "cluster_captures",
            "Captures through the cluster's registry since the node started: pushed, pulled, adopted (paused sandboxes resumed here from another node's capture)",
            captures.clone(),
        );
        let capture_bytes = Family::<KindLabel, Gauge>::default();
        registry.register(
            "cluster_capture_bytes",
            "Bytes of capture chunks since the node started: pushed (sent; the registry had the rest), pulled (fetched)",
            capture_bytes.clone(),
        );
        let create_duration = Histogram::new(exponential_buckets(0.01, 2.0, 14));
        registry.register(
            "sandbox_create_duration_seconds",
            "Sandbox creates that succeeded, from the call to a guest that answers",
            create_duration.clone(),
        );
        let create_failures = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "sandbox_create_failures",
            "Sandbox creates that failed, by reason (capacity, team_limit, host_memory, host_disk, not_found, invalid, network, volumes, guest, vm, internal)",
            create_failures.clone(),
        );
        let capture_duration = Family::<KindLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.01, 2.0, 14))
        });
        registry.register(
            "capture_duration_seconds",
            "Captures of running sandboxes by kind (pause, snapshot, fork): memory and disk written",
            capture_duration.clone(),
        );
        let host_memory_available = Gauge::default();
        registry.register(
            "host_memory_available_bytes",
            "The host's available memory (MemAvailable)",
            host_memory_available.clone(),
        );
        let host_disk_available = Gauge::default();
        registry.register(
            "host_disk_available_bytes",
            "Free space of the data directory's file system",
            host_disk_available.clone(),
        );
        Self {
            registry,
            create_duration,
            create_failures,
            capture_duration,
            host_memory_available,
            host_disk_available,
            captures,
            capture_bytes,
            capacity,
            host_cores,
            proxy_bytes,
            api_latency,
            sandboxes,
            image_cache_bytes,
            image_cache_reads,
            image_cache_hit_ratio,
        }
    }
}

impl Metrics {
    /// Copy a cluster node's capture counts in.
    pub fn set_captures(&self, s: &crate::cluster::captures::Stats) {
        use std::sync::atomic::Ordering::Relaxed;
        let as_i64 =
            |v: &std::sync::atomic::AtomicU64| i64::try_from(v.load(Relaxed)).unwrap_or(i64::MAX);
        for (kind, v) in [
            ("pushed", &s.pushed),
            ("pulled", &s.pulled),
            ("adopted", &s.adopted),
        ] {
            self.captures
                .get_or_create(&KindLabel { kind })
                .set(as_i64(v));
        }
        for (kind, v) in [("pushed", &s.pushed_bytes), ("pulled", &s.pulled_bytes)] {
            self.capture_bytes
                .get_or_create(&KindLabel { kind })
                .set(as_i64(v));
        }
    }

    /// Copy the image daemon's statistics in.
    pub fn set_image_cache(&self, s: &tine_image::chunks::cache::CacheStats) {
        let as_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        for (kind, v) in [
            ("cached", s.cached_bytes),
            ("pinned", s.pinned_bytes),
            ("max", s.max_bytes),
            ("fetched", s.fetched_bytes),
        ] {
            self.image_cache_bytes
                .get_or_create(&KindLabel { kind })
                .set(as_i64(v));
        }
        for (kind, v) in [
            ("hit", s.hits),
            ("miss", s.misses),
            ("error", s.errors),
            ("eviction", s.evictions),
        ] {
            self.image_cache_reads
                .get_or_create(&KindLabel { kind })
                .set(as_i64(v));
        }
        let all = s.hits + s.misses;
        if all > 0 {
            self.image_cache_hit_ratio.set(s.hits as f64 / all as f64);
        }
    }

    /// Copy the host's capacity in.
    pub fn set_capacity(
        &self,
        c: crate::config::Capacity,
        max_sandboxes: usize,
        admitted: usize,
        pooled: usize,
    ) {
        let as_i64 = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        let mut kinds = vec![
            ("total", c.sandboxes),
            ("max_sandboxes", max_sandboxes),
            ("in_use", admitted),
            ("pooled", pooled),
        ];
        kinds.extend(c.by_cpu.map(|v| ("cpu", v)));
        for (kind, v) in kinds {
            self.capacity
                .get_or_create(&KindLabel { kind })
                .set(as_i64(v));
        }
        self.host_cores.set(as_i64(c.cores));
    }

    /// Read the host's free memory and the free space under `data_dir`.
    pub fn set_host(&self, data_dir: &std::path::Path) {
        let mib = |v: u64| i64::try_from(v.saturating_mul(1 << 20)).unwrap_or(i64::MAX);
        if let Some(mb) = crate::sandboxes::limits::mem_available_mb() {
            self.host_memory_available.set(mib(mb));
        }
        if let Some(free) = crate::sandboxes::limits::disk_free_bytes(data_dir) {
            self.host_disk_available
                .set(i64::try_from(free).unwrap_or(i64::MAX));
        }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// `body`, counting its bytes into `counter` as they pass.
pub fn counted<B>(
    body: B,
    counter: ByteCounter,
    direction: &'static str,
) -> impl http_body::Body<Data = Bytes, Error = B::Error>
where
    B: http_body::Body<Data = Bytes>,
{
    body.map_frame(move |frame| {
        if let Some(data) = frame.data_ref() {
            counter
                .get_or_create(&DirectionLabel { direction })
                .inc_by(data.len() as u64);
        }
        frame
    })
}
