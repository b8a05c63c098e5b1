//! The sandbox proxy: requests for a sandbox's port go into that sandbox.
//!
//! A request is for a sandbox when it carries `E2b-Sandbox-Id` (and
//! optionally `E2b-Sandbox-Port`, default 49983: the agent), which is how
//! the SDKs address envd through `E2B_SANDBOX_URL`, or when its Host is
//! `<port>-<sandboxID>.<domain>`, which is what `get_host(port)` gives.
//! Bodies stream both ways (nothing is buffered) and WebSocket (any HTTP
//! upgrade) connections are spliced through.
//!
//! Requests to the agent must carry the sandbox's `X-Access-Token` (or, for
//! `/files`, a valid signature made with it): the proxy checks before
//! anything reaches the guest. Requests to any other port of a sandbox
//! created with `allowPublicTraffic: false` must carry its
//! `e2b-traffic-access-token` (removed before the request goes on), and
//! see the Host its `maskRequestHost` gives, if it gave one. Ports in its
//! `httpsPorts` are reached over TLS.
//!
//! Connections into sandboxes are pooled: see [`crate::guest_client`].

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use http::{header, HeaderMap, StatusCode};
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};

use crate::state::AppState;

/// The port `E2b-Sandbox-Port` defaults to: the agent's.
pub const ENVD_PORT: u16 = tine_agent_client::AGENT_PORT;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub sandbox: String,
    pub port: u16,
}

/// Which sandbox port, if any, a request is for.
pub fn target(headers: &HeaderMap, domain: &str) -> Option<Target> {
    if let Some(id) = headers.get("e2b-sandbox-id").and_then(|v| v.to_str().ok()) {
        let port = headers
            .get("e2b-sandbox-port")
            .and_then(|v| v.to_str().ok())
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or(ENVD_PORT);
        return Some(Target {
            sandbox: id.trim().to_string(),
            port,
        });
    }
    let host = headers.get(header::HOST)?.to_str().ok()?;
    let host_name = host.rsplit_once(':').map_or(host, |(h, p)| {
        if p.bytes().all(|b| b.is_ascii_digit()) {
            h
        } else {
            host
        }
    });
    let domain_name = domain.rsplit_once(':').map_or(domain, |(h, _)| h);
    let (label, rest) = host_name.split_once('.')?;
    if !rest.eq_ignore_ascii_case(domain_name) {
        return None;
    }
    let (port, id) = label.split_once('-')?;
    Some(Target {
        sandbox: id.to_string(),
        port: port.parse().ok()?,
    })
}

/// Middleware in front of the REST router: sandbox traffic is proxied,
/// everything else goes on to the API.
pub async fn route(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    match target(req.headers(), &state.domain) {
        Some(t) => proxy(state, t, req).await,
        None => next.run(req).await,
    }
}

fn error(status: StatusCode, message: String, connect_style: bool) -> Response {
    let body = if connect_style {
        let code = if status == StatusCode::UNAUTHORIZED {
            "unauthenticated"
        } else {
            "unavailable"
        };
        serde_json::json!({ "code": code, "message": message })
    } else {
        serde_json::json!({ "code": status.as_u16(), "message": message })
    };
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// Connect RPC paths look like `/package.Service/Method`.
fn is_rpc(path: &str) -> bool {
    path.trim_start_matches('/')
        .split('/')
        .next()
        .is_some_and(|s| s.contains('.'))
}

/// Signature of a `/files` URL as the SDK makes it: `v1_` + unpadded
/// base64 of sha256(`path:operation:user:token[:expiration]`).
pub fn file_signature(
    path: &str,
    operation: &str,
    user: &str,
    token: &str,
    expiration: Option<i64>,
) -> String {
    let text = match expiration {
        Some(exp) => format!("{path}:{operation}:{user}:{token}:{exp}"),
        None => format!("{path}:{operation}:{user}:{token}"),
    };
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(Sha256::digest(text.as_bytes()))
    )
}

/// Compare secrets in time that depends on their lengths only.
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The header that carries a sandbox's traffic access token.
pub const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";

/// Check (and strip) the traffic token, and mask the Host, of a request to
/// a port other than the agent's.
fn admit_traffic(live: &crate::sandboxes::Live, port: u16, req: &mut Request) -> bool {
    if let Some(token) = &live.traffic_token {
        let given = req.headers_mut().remove(TRAFFIC_TOKEN_HEADER);
        if !given.is_some_and(|g| same_secret(g.as_bytes(), token.as_bytes())) {
            return false;
        }
    }
    if let Some(mask) = &live.mask_host {
        let host = mask.replace("${PORT}", &port.to_string());
        if let Ok(v) = http::HeaderValue::from_str(&host) {
            req.headers_mut().insert(header::HOST, v);
        }
    }
    true
}

fn authorized(req: &Request, token: &str) -> bool {
    if let Some(given) = req.headers().get("x-access-token") {
        return same_secret(given.as_bytes(), token.as_bytes());
    }
    if req.uri().path() != "/files" {
        return false;
    }
    let query: Vec<(String, String)> =
        serde_urlencoded::from_str(req.uri().query().unwrap_or("")).unwrap_or_default();
    let get = |k: &str| {
        query
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
    };
    let (Some(sig), Some(path)) = (get("signature"), get("path")) else {
        return false;
    };
    let expiration = match get("signature_expiration") {
        Some(e) => match e.parse::<i64>() {
            Ok(e) if e >= crate::db::now_ms() / 1000 => Some(e),
            _ => return false,
        },
        None => None,
    };
    let operation = if req.method() == http::Method::GET {
        "read"
    } else {
        "write"
    };
    let expected = file_signature(
        path,
        operation,
        get("username").unwrap_or(""),
        token,
        expiration,
    );
    same_secret(expected.as_bytes(), sig.as_bytes())
}

async fn proxy(state: Arc<AppState>, t: Target, mut req: Request) -> Response {
    let rpc = is_rpc(req.uri().path());
    let Some(live) = state.manager.live(&t.sandbox) else {
        return error(
            StatusCode::BAD_GATEWAY,
            format!("The sandbox {} was not found", t.sandbox),
            rpc,
        );
    };
    if t.port == ENVD_PORT && !authorized(&req, &live.access_token) {
        return error(
            StatusCode::UNAUTHORIZED,
            "missing or invalid X-Access-Token for this sandbox".into(),
            rpc,
        );
    }
    if t.port != ENVD_PORT && !admit_traffic(&live, t.port, &mut req) {
        return error(
            StatusCode::FORBIDDEN,
            format!(
                "sandbox {} accepts traffic only with its {TRAFFIC_TOKEN_HEADER}",
                t.sandbox
            ),
            rpc,
        );
    }
    let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
    let scheme = if live.https_ports.contains(&t.port) {
        "https"
    } else {
        "http"
    };
    let uri = format!(
        "{scheme}://{}-{}.vm:{}{path}",
        t.sandbox,
        live.incarnation(),
        t.port
    );
    *req.uri_mut() = match uri.parse() {
        Ok(u) => u,
        Err(_) => return error(StatusCode::BAD_REQUEST, "invalid request path".into(), rpc),
    };
    let upgrade = req
        .headers()
        .contains_key(header::UPGRADE)
        .then(|| hyper::upgrade::on(&mut req));
    let counter = state.metrics.proxy_bytes.clone();
    let req = req.map(|b| Body::new(crate::metrics::counted(b, counter.clone(), "in")));
    let mut resp = match state.client.request(req).await {
        Ok(r) => r,
        Err(e) if e.is_connect() => {
            return error(
                StatusCode::BAD_GATEWAY,
                format!(
                    "The sandbox {} is running but port {} is not open",
                    t.sandbox, t.port
                ),
                rpc,
            )
        }
        Err(e) => {
            return error(
                StatusCode::BAD_GATEWAY,
                format!("sandbox {}: {e}", t.sandbox),
                rpc,
            )
        }
    };
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(client_side) = upgrade {
            let guest_side = hyper::upgrade::on(&mut resp);
            tokio::spawn(async move {
                if let (Ok(c), Ok(g)) = (client_side.await, guest_side.await) {
                    let _ =
                        tokio::io::copy_bidirectional(&mut TokioIo::new(c), &mut TokioIo::new(g))
                            .await;
                }
            });
        }
    }
    resp.map(|b| Body::new(crate::metrics::counted(b, counter, "out")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn targets_from_headers_and_hosts() {
        let d = "localhost:3000";
        assert_eq!(
            target(&headers(&[("e2b-sandbox-id", "iabc")]), d),
            Some(Target {
                sandbox: "iabc".into(),
                port: 49983
            })
        );
        assert_eq!(
            target(
                &headers(&[("e2b-sandbox-id", "iabc"), ("e2b-sandbox-port", "8080")]),
                d
            ),
            Some(Target {
                sandbox: "iabc".into(),
                port: 8080
            })
        );
        assert_eq!(
            target(&headers(&[("host", "8000-iabc.localhost:3000")]), d),
            Some(Target {
                sandbox: "iabc".into(),
                port: 8000
            })
        );
        assert_eq!(target(&headers(&[("host", "127.0.0.1:3000")]), d), None);
        assert_eq!(
            target(&headers(&[("host", "8000-iabc.example.com")]), d),
            None
        );
        assert_eq!(target(&headers(&[("host", "x-iabc.localhost")]), d), None);
    }

    #[test]
    fn signature_matches_the_sdk_formula() {
        // Python SDK: "v1_" + base64(sha256(b"/a:read::tok")).rstrip("=").
        assert_eq!(
            file_signature("/a", "read", "", "tok", None),
            "v1_2/gNbgFPxFSqkheS/SD0NHlzA121E/nxkOtc/ovxeoI"
        );
    }
}
