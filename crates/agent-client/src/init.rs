//! `POST /init`: what the host tells a guest after every create, restore
//! and capture. The agent parses the same [`InitRequest`].

use std::collections::BTreeMap;
use std::future::Future;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::Full;
use hyper::Request;
use serde::{Deserialize, Serialize};

use crate::{call, AgentError, Result, CALL_TIMEOUT};

/// The `/init` body (envd's fields, plus tine's `hostname` and
/// `machineId`; unknown fields are ignored).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InitRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env_vars: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_token: Option<String>,
    /// RFC 3339; the guest clock is set to it when it is off by over a second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_workdir: Option<String>,
    /// Base64 bytes mixed into the kernel's entropy pool (fresh randomness
    /// for a restored snapshot, whose pool would otherwise repeat).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entropy: Option<String>,
    /// tine extension: the guest's new host name (each sandbox its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// tine extension: the new `/etc/machine-id` (32 hex digits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine_id: Option<String>,
    /// tine extension: volumes to mount over NFS (each mounted unless its
    /// path is a mount point already, as in a guest restored from memory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mounts: Option<Vec<GuestMount>>,
    /// tine extension: a CA certificate (PEM) the guest adds to its trust
    /// stores: the host's egress CA, for HTTPS whose headers the host's
    /// proxy transforms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trust_ca: Option<String>,
    /// Accepted for compatibility; tine has no hyperloop server.
    #[serde(
        default,
        rename = "hyperloopIP",
        skip_serializing_if = "Option::is_none"
    )]
    pub hyperloop_ip: Option<String>,
}

/// A volume the guest mounts: NFSv3 from `addr:port` (NFS and MOUNT on
/// the one port) at `path`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GuestMount {
    pub path: String,
    pub addr: String,
    pub port: u16,
}

impl InitRequest {
    /// A guest's identity as sandbox `sandbox_id`: its env vars and access
    /// token, the host's current time, 64 fresh random bytes, the sandbox
    /// id as host name and, hashed, as machine-id.
    pub fn identity(
        sandbox_id: &str,
        env_vars: BTreeMap<String, String>,
        access_token: &str,
    ) -> Result<Self> {
        let mut entropy = [0u8; 64];
        getrandom::fill(&mut entropy).map_err(|e| AgentError::Protocol {
            what: "/init",
            detail: format!("host entropy: {e}"),
        })?;
        Ok(Self {
            env_vars: Some(env_vars),
            access_token: Some(access_token.to_string()),
            timestamp: Some(rfc3339_now()),
            entropy: Some(base64::engine::general_purpose::STANDARD.encode(entropy)),
            hostname: Some(sandbox_id.to_string()),
            machine_id: Some(machine_id(sandbox_id)),
            ..Self::default()
        })
    }
}

/// 32 hex digits derived from the sandbox id.
pub fn machine_id(sandbox_id: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(sandbox_id.as_bytes())
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn rfc3339_now() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// `POST /init` with `body`. `previous_token` is the token the guest holds
/// now (none for a fresh template), needed to be allowed to replace it.
pub async fn init(
    conn: impl Future<Output = std::io::Result<tokio::net::TcpStream>>,
    body: &InitRequest,
    previous_token: Option<&str>,
) -> Result<()> {
    let json = serde_json::to_vec(body).map_err(|e| AgentError::Protocol {
        what: "/init",
        detail: e.to_string(),
    })?;
    let mut req = Request::post("/init")
        .header("host", "agent")
        .header("content-type", "application/json");
    if let Some(t) = previous_token {
        req = req.header("x-access-token", t);
    }
    let req = req
        .body(Full::new(Bytes::from(json)))
        .map_err(|e| AgentError::Protocol {
            what: "/init",
            detail: e.to_string(),
        })?;
    call("/init", conn, req, CALL_TIMEOUT).await.map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_round_trips_through_the_agents_parse() {
        let env = BTreeMap::from([("A".to_string(), "1".to_string())]);
        let req = InitRequest::identity("sbx1", env.clone(), "tok").unwrap();
        let json = serde_json::to_value(&req).unwrap();
        assert_eq!(json["envVars"]["A"], "1");
        assert_eq!(json["accessToken"], "tok");
        assert_eq!(json["hostname"], "sbx1");
        assert_eq!(json["machineId"].as_str().unwrap().len(), 32);
        assert!(
            json.get("defaultUser").is_none(),
            "unset fields are left out"
        );
        let back: InitRequest = serde_json::from_value(json).unwrap();
        assert_eq!(back, req);
        let other = InitRequest::identity("sbx1", env, "tok").unwrap();
        assert_ne!(other.entropy, req.entropy, "fresh entropy every time");
        assert_eq!(other.machine_id, req.machine_id);
    }
}
