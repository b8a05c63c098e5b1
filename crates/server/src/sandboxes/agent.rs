//! What the server asks of the agent in a sandbox, through the VM driver's
//! guest network: `/init` after every restore (identity, clock, entropy),
//! `/metrics`, and the readiness probe the driver runs after every start.

use std::collections::BTreeMap;

use serde::Serialize;
use tine_agent_client::{AgentError, InitRequest, AGENT_PORT};
use tine_vmm::{Guest, Probe};

/// The readiness probe for every VM the server starts: the agent answers
/// `GET /health`.
pub fn probe() -> Probe {
    std::sync::Arc::new(|guest: Guest| {
        Box::pin(async move { tine_agent_client::healthy(guest.connect(AGENT_PORT)).await })
    })
}

/// `/init` with the identity of sandbox `sandbox_id` (host name,
/// machine-id, env vars, access token, clock, fresh entropy).
/// `previous_token` is the token the guest has now (none for a fresh
/// template), needed to be allowed to replace it.
pub async fn init(
    guest: &Guest,
    sandbox_id: &str,
    env_vars: BTreeMap<String, String>,
    access_token: &str,
    previous_token: Option<&str>,
    mounts: Vec<tine_agent_client::GuestMount>,
    trust_ca: Option<&str>,
) -> Result<(), AgentError> {
    let mut body = InitRequest::identity(sandbox_id, env_vars, access_token)?;
    body.mounts = (!mounts.is_empty()).then_some(mounts);
    body.trust_ca = trust_ca.map(str::to_string);
    tine_agent_client::init(guest.connect(AGENT_PORT), &body, previous_token).await
}

/// `/init` with only the CA the guest should add to its trust stores (a
/// running sandbox whose new policy transforms HTTPS).
pub async fn trust_ca(guest: &Guest, access_token: &str, pem: &str) -> Result<(), AgentError> {
    let body = InitRequest {
        trust_ca: Some(pem.to_string()),
        ..Default::default()
    };
    tine_agent_client::init(guest.connect(AGENT_PORT), &body, Some(access_token)).await
}

/// One usage sample, in the shape of E2B's `SandboxMetric`.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Metrics {
    pub timestamp: String,
    pub timestamp_unix: i64,
    pub cpu_count: u64,
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// Now, in the host's clock (ranges are asked in it): RFC 3339 and Unix
/// seconds.
pub fn stamp_now() -> (String, i64) {
    let now = crate::db::now_ms() / 1000;
    let ts =
        time::OffsetDateTime::from_unix_timestamp(now).unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    let text = ts
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default();
    (text, now)
}

pub async fn metrics(guest: &Guest, token: &str) -> Result<Metrics, AgentError> {
    let m = tine_agent_client::metrics(guest.connect(AGENT_PORT), token).await?;
    let (timestamp, timestamp_unix) = stamp_now();
    Ok(Metrics {
        timestamp,
        timestamp_unix,
        cpu_count: m.cpu_count,
        cpu_used_pct: m.cpu_used_pct,
        mem_used: m.mem_used,
        mem_total: m.mem_total,
        mem_cache: m.mem_cache,
        disk_used: m.disk_used,
        disk_total: m.disk_total,
    })
}
