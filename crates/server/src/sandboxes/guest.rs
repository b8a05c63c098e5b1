//! What the server asks of the agent in a sandbox: `/init` after every
//! restore (env vars, access token, clock, entropy) and `/metrics`.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::Full;
use hyper::Request;
use serde::{Deserialize, Serialize};
use tine_vmm::guest;
use tine_vmm::netns::Netns;

const CALL_TIMEOUT: Duration = Duration::from_secs(10);

fn rfc3339_now() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .expect("now formats as RFC 3339")
}

/// `POST /init`: the guest's identity (`sandbox_id` becomes its host name
/// and, hashed, its machine-id), env vars, access token, the current time
/// and fresh entropy. `previous_token` is the token the guest has now (none
/// for a fresh template), needed to be allowed to replace it.
pub async fn init(
    netns: &Netns,
    sandbox_id: &str,
    env_vars: &BTreeMap<String, String>,
    access_token: &str,
    previous_token: Option<&str>,
) -> Result<(), String> {
    use sha2::Digest;
    let machine_id: String = sha2::Sha256::digest(sandbox_id.as_bytes())
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut entropy = [0u8; 64];
    getrandom::fill(&mut entropy).map_err(|e| format!("host entropy: {e}"))?;
    let body = serde_json::json!({
        "envVars": env_vars,
        "accessToken": access_token,
        "timestamp": rfc3339_now(),
        "entropy": base64::engine::general_purpose::STANDARD.encode(entropy),
        "hostname": sandbox_id,
        "machineId": machine_id,
    });
    let mut req = Request::post("/init")
        .header("host", "agent")
        .header("content-type", "application/json");
    if let Some(t) = previous_token {
        req = req.header("x-access-token", t);
    }
    let req = req
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("valid request");
    let (status, body) = tokio::time::timeout(CALL_TIMEOUT, guest::request(netns, req))
        .await
        .map_err(|_| "the agent did not answer /init".to_string())?
        .map_err(|e| format!("/init: {e}"))?;
    if !status.is_success() {
        return Err(format!(
            "/init answered {status}: {}",
            String::from_utf8_lossy(&body)
        ));
    }
    Ok(())
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

#[derive(Deserialize)]
struct AgentMetrics {
    ts: i64,
    cpu_count: u64,
    cpu_used_pct: f64,
    mem_total: u64,
    mem_used: u64,
    #[serde(default)]
    mem_cache: u64,
    disk_used: u64,
    disk_total: u64,
}

pub async fn metrics(netns: &Netns, token: &str) -> Result<Metrics, String> {
    let req = Request::get("/metrics")
        .header("host", "agent")
        .header("x-access-token", token)
        .body(Full::new(Bytes::new()))
        .expect("valid request");
    let (status, body) = tokio::time::timeout(CALL_TIMEOUT, guest::request(netns, req))
        .await
        .map_err(|_| "the agent did not answer /metrics".to_string())?
        .map_err(|e| format!("/metrics: {e}"))?;
    if !status.is_success() {
        return Err(format!("/metrics answered {status}"));
    }
    let m: AgentMetrics =
        serde_json::from_slice(&body).map_err(|e| format!("/metrics body: {e}"))?;
    let ts =
        time::OffsetDateTime::from_unix_timestamp(m.ts).unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    Ok(Metrics {
        timestamp: ts
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default(),
        timestamp_unix: m.ts,
        cpu_count: m.cpu_count,
        cpu_used_pct: m.cpu_used_pct,
        mem_used: m.mem_used,
        mem_total: m.mem_total,
        mem_cache: m.mem_cache,
        disk_used: m.disk_used,
        disk_total: m.disk_total,
    })
}
