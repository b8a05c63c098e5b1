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
use http::{header, HeaderMap, StatusCode};
use hyper_util::rt::TokioIo;

use crate::api::ApiError;
use crate::state::AppState;

mod signed;
mod stream_end;

use signed::{Refusal, SignedQuery};
use stream_end::EndsWithSandbox;
pub use stream_end::{ClientSocket, TcpListener};

/// The port `E2b-Sandbox-Port` defaults to: the agent's.
pub const ENVD_PORT: u16 = tine_agent_client::AGENT_PORT;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub sandbox: String,
    pub port: u16,
}

/// Paths of the REST API. Some SDK versions (2.7 to 2.25) send the
/// sandbox headers on API calls too (`POST /sandboxes/{id}/connect`):
/// those stay with the API. envd has none of these paths.
fn is_api_path(path: &str) -> bool {
    const API: [&str; 6] = [
        "/sandboxes",
        "/v2/",
        "/v3/",
        "/templates",
        "/snapshots",
        "/build-files",
    ];
    API.iter().any(|p| path.starts_with(p))
}

/// Which sandbox port, if any, a request for `path` is for.
pub fn target(headers: &HeaderMap, path: &str, domain: &str) -> Option<Target> {
    let by_header = headers
        .get("e2b-sandbox-id")
        .and_then(|v| v.to_str().ok())
        .filter(|_| !is_api_path(path));
    if let Some(id) = by_header {
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
    if let Some(t) = target(req.headers(), req.uri().path(), &state.domain) {
        return proxy(state, t, req).await;
    }
    let locating = is_locate(&state, &req);
    match signed_target(&state, &req) {
        Some(Ok(t)) if locating => return located(&t),
        // A signed URL on the API's own origin (the console's too): what
        // the guest answers is never content of that origin.
        Some(Ok(t)) => return as_download(proxy(state, t, req).await),
        Some(Err(Refusal::Invalid)) => {
            return no_such_sandbox(error(
                StatusCode::UNAUTHORIZED,
                Refusal::Invalid.message().into(),
                false,
            ))
        }
        Some(Err(refusal)) => {
            return error(StatusCode::UNAUTHORIZED, refusal.message().into(), false)
        }
        None => {}
    }
    match token_target(&state, &req) {
        Some(Some(t)) if locating => located(&t),
        Some(Some(t)) => proxy(state, t, req).await,
        Some(None) => no_such_sandbox(error(
            StatusCode::BAD_GATEWAY,
            "The sandbox of this X-Access-Token was not found".into(),
            is_rpc(req.uri().path()),
        )),
        None => next.run(req).await,
    }
}

/// On a request that names no sandbox, from a cluster's gateway (with the
/// cluster secret): "which sandbox is this for, if it is here?" The node
/// answers 204 with the sandbox in [`LOCATED_HEADER`] (or as it would
/// answer the request: [`NO_SUCH_SANDBOX_HEADER`]), without reading the
/// body; the gateway then streams the request to that node alone.
pub const LOCATE_HEADER: &str = "x-tine-locate";
/// The sandbox of a [`LOCATE_HEADER`] request.
pub const LOCATED_HEADER: &str = "x-tine-located";

fn is_locate(state: &AppState, req: &Request) -> bool {
    let given = req
        .headers()
        .get(CLUSTER_SECRET_HEADER)
        .and_then(|v| v.to_str().ok());
    req.headers().contains_key(LOCATE_HEADER)
        && matches!((&state.cluster_secret, given), (Some(s), Some(g)) if secret_matches(s, g))
}

fn located(t: &Target) -> Response {
    let mut r = StatusCode::NO_CONTENT.into_response();
    if let Ok(v) = http::HeaderValue::from_str(&t.sandbox) {
        r.headers_mut().insert(LOCATED_HEADER, v);
    }
    r
}

/// The header that carries the cluster secret from a gateway to a node.
pub const CLUSTER_SECRET_HEADER: &str = "x-tine-cluster-secret";

/// Whether `given` is the cluster secret, compared in constant time (over
/// their SHA-256, so lengths leak nothing either).
pub fn secret_matches(secret: &str, given: &str) -> bool {
    use sha2::{Digest, Sha256};
    same_secret(
        &Sha256::digest(secret.as_bytes()),
        &Sha256::digest(given.as_bytes()),
    )
}

/// A guest's answer made inert for the origin it is served on: a browser
/// that follows a signed `/files` URL on the API host saves the bytes
/// (whatever type, script or page the guest claims) and never renders or
/// runs them there. Root in the guest can replace envd, so the guest's own
/// headers are not trusted; a file name it gives is kept.
fn as_download(mut resp: Response) -> Response {
    use http::HeaderValue;
    let h = resp.headers_mut();
    let disposition = h
        .get(header::CONTENT_DISPOSITION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(';'))
        .map(|(_, params)| format!("attachment;{params}"))
        .and_then(|v| HeaderValue::from_str(&v).ok())
        .unwrap_or(HeaderValue::from_static("attachment"));
    h.insert(header::CONTENT_DISPOSITION, disposition);
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static("sandbox"),
    );
    resp
}

/// Set on the answer to a request naming no sandbox whose secrets match
/// none of this server's: a cluster gateway asks the next node.
pub const NO_SUCH_SANDBOX_HEADER: &str = "x-tine-no-such-sandbox";

fn no_such_sandbox(mut r: Response) -> Response {
    r.headers_mut()
        .insert(NO_SUCH_SANDBOX_HEADER, http::HeaderValue::from_static("1"));
    r
}

/// A request for some sandbox that does not say which (a signed `/files`
/// URL against `E2B_SANDBOX_URL`, an envd call with only its
/// `X-Access-Token`): only the server holding the sandbox can tell, by its
/// secrets. A cluster gateway asks its nodes in turn.
pub fn names_no_sandbox(req: &Request) -> bool {
    let signed = matches!(SignedQuery::of(req), Some(Ok(_)));
    signed || (is_envd_path(req.uri().path()) && req.headers().contains_key("x-access-token"))
}

/// Paths only envd serves (`/health` and `/metrics` are the server's own
/// too, and stay with it).
fn is_envd_path(path: &str) -> bool {
    path.starts_with("/process.Process/")
        || path.starts_with("/filesystem.Filesystem/")
        || matches!(path, "/files" | "/envs" | "/init")
}

/// An envd request that names no sandbox but carries a sandbox's
/// `X-Access-Token`: SDKs 2.7 to 2.2x send no `E2b-Sandbox-Id` after
/// `Sandbox.connect` (only after create). The token identifies the
/// sandbox: running ones are compared in constant time each, then paused
/// ones (so auto-resume and "not found" answer as for a named sandbox).
/// `Some(None)`: no sandbox has that token.
fn token_target(state: &AppState, req: &Request) -> Option<Option<Target>> {
    if !is_envd_path(req.uri().path()) {
        return None;
    }
    let token = req.headers().get("x-access-token")?.as_bytes();
    let matches = |t: &str| same_secret(token, t.as_bytes());
    let found = state
        .manager
        .find_live(|live| matches(&live.access_token))
        .or_else(|| {
            let paused = state.manager.db().paused_tokens().ok()?;
            paused
                .into_iter()
                .find(|(_, t)| matches(t))
                .map(|(id, _)| id)
        });
    Some(found.map(|sandbox| Target {
        sandbox,
        port: ENVD_PORT,
    }))
}

/// An answer the proxy gives itself (the request never reached a guest):
/// on Connect RPC paths in Connect's shape (`{"code": "<name>", "message"}`,
/// what envd's clients read), elsewhere as the API's [`ApiError`]
/// (`{"code": <status>, "message"}`).
fn error(status: StatusCode, message: String, connect_style: bool) -> Response {
    let mut resp = if connect_style {
        let code = if status == StatusCode::UNAUTHORIZED {
            "unauthenticated"
        } else {
            "unavailable"
        };
        let body = serde_json::json!({ "code": code, "message": message });
        (
            status,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response()
    } else {
        ApiError::new(status, message).into_response()
    };
    // The request's body was not read: the connection cannot carry
    // another request, and a client that is not told would reuse it.
    resp.headers_mut()
        .insert(header::CONNECTION, http::HeaderValue::from_static("close"));
    resp
}

/// Connect RPC paths look like `/package.Service/Method`.
fn is_rpc(path: &str) -> bool {
    path.trim_start_matches('/')
        .split('/')
        .next()
        .is_some_and(|s| s.contains('.'))
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

/// Whether a request to the agent may pass: it carries the sandbox's
/// `X-Access-Token`, or is a `/files` request signed with it.
fn authorized(req: &Request, token: &str) -> Result<(), &'static str> {
    if let Some(given) = req.headers().get("x-access-token") {
        return if same_secret(given.as_bytes(), token.as_bytes()) {
            Ok(())
        } else {
            Err("invalid access token")
        };
    }
    match SignedQuery::of(req) {
        None => Err("missing access token or file signature"),
        Some(Err(refusal)) => Err(refusal.message()),
        Some(Ok(q)) => q
            .check(token, crate::db::now_ms() / 1000)
            .map_err(Refusal::message),
    }
}

/// A signed `/files` URL that names no sandbox (the SDK's URL against
/// `E2B_SANDBOX_URL`): the sandbox whose token made the signature.
fn signed_target(state: &AppState, req: &Request) -> Option<Result<Target, Refusal>> {
    let q = match SignedQuery::of(req)? {
        Ok(q) => q,
        // No signature: not a sandbox request; the API answers.
        Err(_) => return None,
    };
    let found = state
        .manager
        .find_live(|live| q.signed_with(&live.access_token));
    Some(found.ok_or(Refusal::Invalid).map(|sandbox| Target {
        sandbox,
        port: ENVD_PORT,
    }))
}

/// Why a request for a sandbox that is not live gets no answer from it.
enum Unreachable {
    /// E2B's "The sandbox was not found" (killed, paused without
    /// auto-resume, never existed).
    NotFound,
    Refused(StatusCode, String),
}

/// E2B's answer for a sandbox that is not running, byte for byte: clients
/// compare the message, and the id is a field of its own.
pub fn not_found(id: &str) -> Response {
    #[derive(serde::Serialize)]
    struct NotFound<'a> {
        message: &'static str,
        #[serde(rename = "sandboxId")]
        sandbox_id: &'a str,
        code: u16,
    }
    let body = serde_json::to_string(&NotFound {
        message: "The sandbox was not found",
        sandbox_id: id,
        code: StatusCode::BAD_GATEWAY.as_u16(),
    })
    .unwrap_or_default();
    (
        StatusCode::BAD_GATEWAY,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CONNECTION, "close"),
        ],
        body,
    )
        .into_response()
}

/// Whether a request for a sandbox that is not running may resume it: it
/// is paused with `autoResume` (with its memory), and the request carries
/// what it would need to reach it. Otherwise the answer is E2B's "not
/// found".
fn may_wake(state: &AppState, t: &Target, req: &Request) -> Result<(), Unreachable> {
    let rec = state
        .manager
        .get(&t.sandbox)
        .map_err(|_| Unreachable::NotFound)?;
    let wakes = rec.state == crate::model::SandboxState::Paused
        && rec.lifecycle.auto_resume
        && !rec.lifecycle.paused_disk_only;
    if !wakes {
        return Err(Unreachable::NotFound);
    }
    if t.port == ENVD_PORT {
        authorized(req, &rec.envd_access_token)
            .map_err(|m| Unreachable::Refused(StatusCode::UNAUTHORIZED, m.to_string()))?;
    } else if let Some(token) = &rec.traffic_token {
        let given = req.headers().get(TRAFFIC_TOKEN_HEADER);
        if !given.is_some_and(|g| same_secret(g.as_bytes(), token.as_bytes())) {
            return Err(Unreachable::Refused(
                StatusCode::FORBIDDEN,
                format!(
                    "sandbox {} accepts traffic only with its {TRAFFIC_TOKEN_HEADER}",
                    t.sandbox
                ),
            ));
        }
    }
    Ok(())
}

/// Resume sandbox `id` for a request ([`may_wake`] said it may).
async fn wake(state: &AppState, id: &str) -> Result<Arc<crate::sandboxes::Live>, Unreachable> {
    tracing::info!(sandbox = %id, "auto-resume on traffic");
    state.manager.connect(id, None, true).await.map_err(|e| {
        Unreachable::Refused(StatusCode::BAD_GATEWAY, format!("auto-resume of {id}: {e}"))
    })?;
    state.manager.live(id).ok_or(Unreachable::NotFound)
}

async fn proxy(state: Arc<AppState>, t: Target, mut req: Request) -> Response {
    let rpc = is_rpc(req.uri().path());
    // The client's connection, reset if the sandbox goes mid-body (HTTP/1
    // only: an HTTP/2 connection carries other streams).
    let client = (req.version() <= http::Version::HTTP_11)
        .then(|| {
            req.extensions()
                .get::<axum::extract::ConnectInfo<ClientSocket>>()
        })
        .flatten()
        .map(|c| c.0);
    let live = match state.manager.live(&t.sandbox) {
        Some(live) => live,
        None => {
            let woken = match may_wake(&state, &t, &req) {
                Ok(()) => wake(&state, &t.sandbox).await,
                Err(e) => Err(e),
            };
            match woken {
                Ok(live) => live,
                Err(Unreachable::NotFound) => return not_found(&t.sandbox),
                Err(Unreachable::Refused(status, message)) => return error(status, message, rpc),
            }
        }
    };
    if t.port == ENVD_PORT {
        if let Err(message) = authorized(&req, &live.access_token) {
            return error(StatusCode::UNAUTHORIZED, message.into(), rpc);
        }
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
    let sent = tokio::select! {
        r = state.client.request(req) => r,
        _ = live.gone.cancelled() => {
            return not_found(&t.sandbox)
        }
    };
    let mut resp = match sent {
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
    let connect_stream = stream_end::is_connect_stream(resp.headers());
    let gone = live.gone.clone();
    resp.map(|b| {
        let b = EndsWithSandbox::new(b, gone, t.sandbox.clone(), connect_stream, client);
        Body::new(crate::metrics::counted(b, counter, "out"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a guest whose envd was replaced answers to a signed URL: a
    /// page with script, claiming to be HTML, inline.
    #[test]
    fn a_guests_page_is_a_download_on_the_api_origin() {
        let hostile = Response::builder()
            .header(header::CONTENT_TYPE, "text/html; charset=utf-8")
            .header(header::CONTENT_DISPOSITION, "inline; filename=\"x.html\"")
            .header(header::CONTENT_SECURITY_POLICY, "script-src *")
            .body(Body::from("<script>steal(document.cookie)</script>"))
            .unwrap();
        let r = as_download(hostile);
        let h = r.headers();
        assert_eq!(h[header::CONTENT_TYPE], "application/octet-stream");
        assert_eq!(
            h[header::CONTENT_DISPOSITION],
            "attachment; filename=\"x.html\""
        );
        assert_eq!(h[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
        assert_eq!(h[header::CONTENT_SECURITY_POLICY], "sandbox");
        assert_eq!(h.get_all(header::CONTENT_SECURITY_POLICY).iter().count(), 1);
        let plain = as_download(Response::new(Body::empty()));
        assert_eq!(plain.headers()[header::CONTENT_DISPOSITION], "attachment");
    }

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
            target(&headers(&[("e2b-sandbox-id", "iabc")]), "/health", d),
            Some(Target {
                sandbox: "iabc".into(),
                port: 49983
            })
        );
        assert_eq!(
            target(
                &headers(&[("e2b-sandbox-id", "iabc"), ("e2b-sandbox-port", "8080")]),
                "/",
                d
            ),
            Some(Target {
                sandbox: "iabc".into(),
                port: 8080
            })
        );
        assert_eq!(
            target(
                &headers(&[("host", "8000-iabc.localhost:3000")]),
                "/sandboxes",
                d
            ),
            Some(Target {
                sandbox: "iabc".into(),
                port: 8000
            })
        );
        assert_eq!(
            target(&headers(&[("host", "127.0.0.1:3000")]), "/", d),
            None
        );
        assert_eq!(
            target(&headers(&[("host", "8000-iabc.example.com")]), "/", d),
            None
        );
        assert_eq!(
            target(&headers(&[("host", "x-iabc.localhost")]), "/", d),
            None
        );
        // An API call that carries the sandbox headers stays with the API.
        let h = headers(&[("e2b-sandbox-id", "iabc"), ("e2b-sandbox-port", "49983")]);
        assert_eq!(target(&h, "/sandboxes/iabc/connect", d), None);
        assert_eq!(target(&h, "/v2/sandboxes/iabc/connect", d), None);
        assert!(target(&h, "/process.Process/Start", d).is_some());
    }
}
