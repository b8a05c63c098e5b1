//! The server's own Prometheus metrics (`GET /metrics`): sandboxes by
//! state, API latency by route, bytes through the proxy.

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

pub type ByteCounter = Family<DirectionLabel, Counter>;

pub struct Metrics {
    registry: Registry,
    pub proxy_bytes: ByteCounter,
    pub api_latency: Family<RouteLabels, Histogram>,
    pub sandboxes: Family<StateLabel, Gauge>,
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
        Self {
            registry,
            proxy_bytes,
            api_latency,
            sandboxes,
        }
    }
}

impl Metrics {
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
