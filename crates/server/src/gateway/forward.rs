//! Forwarding a request to a node and its response back, streamed both
//! ways.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, Request, StatusCode};
use hyper_util::rt::TokioIo;

/// The gateway's pooled HTTP client to nodes.
pub type NodeClient =
    hyper_util::client::legacy::Client<hyper_util::client::legacy::connect::HttpConnector, Body>;

pub fn client() -> NodeClient {
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.set_nodelay(true);
    http.set_connect_timeout(Some(std::time::Duration::from_secs(3)));
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(std::time::Duration::from_secs(60))
        .pool_timer(hyper_util::rt::TokioTimer::new())
        .build(http)
}

/// Headers that belong to one connection, not to the request.
const HOP_BY_HOP: [&str; 7] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// The hop-by-hop headers an upgrade keeps on both sides.
fn names_upgrade(h: &str) -> bool {
    h == "connection" || h == "upgrade"
}

/// Why a node gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// Nothing reached the node (refused, unreachable): safe to send
    /// elsewhere.
    #[error("node {0} is unreachable: {1}")]
    Unreachable(String, String),
    /// The request may have reached it.
    #[error("node {0} failed mid-request: {1}")]
    Failed(String, String),
}

impl ForwardError {
    /// 503 in E2B's error shape.
    pub fn into_response(self) -> Response {
        crate::api::ApiError::unavailable(self.to_string()).into_response()
    }
}

/// `req` sent to the node at `address` (`http://host:port`) as it is, with
/// `extra` headers set and `drop` headers removed; the Host header is kept
/// (the node's proxy reads `<port>-<id>.<domain>` from it). An upgrade
/// (WebSocket) keeps its `Connection`/`Upgrade` headers, and once the node
/// answers 101 both connections are spliced together.
pub async fn forward(
    client: &NodeClient,
    node: &str,
    address: &str,
    mut req: Request<Body>,
    extra: &[(&'static str, HeaderValue)],
    drop: &[&str],
) -> Result<Response, ForwardError> {
    let client_side = req
        .headers()
        .contains_key(http::header::UPGRADE)
        .then(|| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    parts.uri = format!("{address}{path}")
        .parse()
        .map_err(|e| ForwardError::Unreachable(node.into(), format!("bad node address: {e}")))?;
    parts.version = http::Version::HTTP_11;
    let upgrading = client_side.is_some();
    for h in HOP_BY_HOP
        .iter()
        .filter(|h| !(upgrading && names_upgrade(h)))
        .chain(drop)
    {
        parts.headers.remove(*h);
    }
    for (name, value) in extra {
        parts.headers.insert(*name, value.clone());
    }
    let mut resp = client
        .request(Request::from_parts(parts, body))
        .await
        .map_err(|e| {
            if e.is_connect() {
                ForwardError::Unreachable(node.into(), e.to_string())
            } else {
                ForwardError::Failed(node.into(), e.to_string())
            }
        })?;
    let switched = resp.status() == StatusCode::SWITCHING_PROTOCOLS;
    if let (true, Some(client_side)) = (switched, client_side) {
        let node_side = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            if let (Ok(c), Ok(n)) = (client_side.await, node_side.await) {
                let (mut c, mut n) = (TokioIo::new(c), TokioIo::new(n));
                let _ = tokio::io::copy_bidirectional(&mut c, &mut n).await;
            }
        });
    }
    let (mut parts, body) = resp.into_parts();
    for h in HOP_BY_HOP
        .iter()
        .filter(|h| !(switched && names_upgrade(h)))
    {
        parts.headers.remove(*h);
    }
    Ok(Response::from_parts(parts, Body::new(body)))
}
