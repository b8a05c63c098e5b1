//! `tine gateway`: the one endpoint of a cluster. Stateless (any number of
//! replicas): it checks API keys against the catalog in PostgreSQL, places
//! creates on nodes ([`place`]), routes every call about a sandbox, and
//! its envd and port traffic, to the node that holds it, and lists a
//! team's sandboxes across nodes from the catalog ([`rest`]).
//!
//! What it knows is cached in memory (keys for 10 s, where each
//! sandbox lives until it is killed, nodes for a second), so known
//! sandboxes keep answering while PostgreSQL restarts; creates wait for it
//! (503).

mod fork;
mod forward;
mod identity;
pub mod place;
mod rest;
mod volumes;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode};
use serde::Deserialize;

use crate::api::ApiError;
use crate::cluster::catalog::{Catalog, ClusterKey, Node};
use crate::config::TeamLimits;
use forward::{ForwardError, NodeClient};

/// `tine gateway`'s config file.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    pub listen: SocketAddr,
    /// The cluster's catalog (as the nodes' `[cluster] postgres_url`).
    pub postgres_url: String,
    /// The secret the nodes expect (as their `[cluster] secret_file`).
    pub secret_file: PathBuf,
    /// The domain sandboxes are addressed under (`<port>-<id>.<domain>`);
    /// the nodes must be configured with the same one.
    pub domain: Option<String>,
    /// A node silent for longer is down: its capacity is not used and its
    /// sandboxes are reported not running.
    pub node_grace_secs: u64,
    /// While PostgreSQL does not answer, a key checked within this long
    /// still works (so does a key revoked meanwhile); 0: none does.
    pub key_stale_ok_secs: u64,
    pub max_body_bytes: usize,
    /// Cluster-wide team limits (`[teams.<name>]`; `max_sandboxes` is
    /// enforced here across nodes, the rest by each node).
    pub teams: BTreeMap<String, TeamLimits>,
    /// HTTPS for the domain and its wildcard (`[tls]`, as `tine serve`'s);
    /// needs `domain`.
    pub tls: crate::tls::TlsConfig,
    /// Where the gateway keeps tine's local CA when `[tls]` gives no
    /// certificate (`<data_dir>/tls/ca.crt`): gateways sharing it serve
    /// certificates of one CA.
    pub data_dir: PathBuf,
    /// Serve the web console under `/console` (on by default).
    pub console: bool,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            listen: "127.0.0.1:3000".parse().expect("a valid address"),
            postgres_url: String::new(),
            secret_file: PathBuf::from("/etc/tine/cluster.secret"),
            domain: None,
            node_grace_secs: 15,
            key_stale_ok_secs: 60,
            max_body_bytes: 64 << 20,
            teams: BTreeMap::new(),
            tls: Default::default(),
            data_dir: PathBuf::from("/var/lib/tine-gateway"),
            console: true,
        }
    }
}

impl GatewayConfig {
    pub fn load(path: &std::path::Path) -> anyhow::Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let c: GatewayConfig =
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        anyhow::ensure!(!c.postgres_url.is_empty(), "postgres_url is required");
        anyhow::ensure!(
            !c.tls.enabled || c.domain.is_some(),
            "[tls] needs domain: the certificate is for the domain and its wildcard"
        );
        Ok(c)
    }

    fn domain(&self) -> String {
        self.domain
            .clone()
            .unwrap_or_else(|| format!("localhost:{}", self.listen.port()))
    }

    fn team_max(&self, team: &str) -> Option<usize> {
        self.teams
            .get(team)
            .or_else(|| self.teams.get(crate::db::DEFAULT_TEAM))
            .and_then(|l| l.max_sandboxes)
    }
}

/// How long a verified key is trusted without asking PostgreSQL again
/// (how long past that while PostgreSQL does not answer: the config's
/// `key_stale_ok_secs`).
const KEY_FRESH: Duration = Duration::from_secs(10);
/// How long the node list is reused.
const NODES_FRESH: Duration = Duration::from_secs(1);

pub struct Gateway {
    cfg: GatewayConfig,
    domain: String,
    secret: HeaderValue,
    catalog: Catalog,
    client: NodeClient,
    keys: Mutex<HashMap<String, (ClusterKey, Instant)>>,
    /// Sandbox id → (node id, team), for sandboxes not known to be gone.
    routes: Mutex<HashMap<String, (String, String)>>,
    nodes: tokio::sync::Mutex<(Vec<Node>, Option<Instant>)>,
}

/// Run the gateway until SIGTERM/SIGINT.
pub async fn serve(cfg: GatewayConfig) -> anyhow::Result<()> {
    let secret = crate::cluster::read_secret(&cfg.secret_file)?;
    let catalog = Catalog::connect(&cfg.postgres_url)
        .await
        .context("connecting to the cluster catalog (postgres_url)")?;
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("listening on {}", cfg.listen))?;
    let g = Arc::new(Gateway {
        domain: cfg.domain(),
        secret: HeaderValue::from_str(&secret)
            .context("the cluster secret is not a header value")?,
        catalog,
        client: forward::client(),
        keys: Mutex::default(),
        routes: Mutex::default(),
        nodes: tokio::sync::Mutex::new((Vec::new(), None)),
        cfg,
    });
    tokio::spawn(g.clone().refresh_nodes());
    let app = axum::Router::new().fallback(handle).with_state(g.clone());
    let stop = async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).expect("a SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    let addr = listener.local_addr()?;
    if g.cfg.tls.enabled {
        let t = crate::tls::setup(&g.cfg.tls, &g.cfg.data_dir, &g.domain)
            .context("setting up TLS for the domain")?;
        match &t.ca {
            Some(ca) => {
                tracing::info!(%addr, ca = %ca.display(), "tine gateway listening (HTTPS, tine's local CA)")
            }
            None => tracing::info!(%addr, "tine gateway listening (HTTPS)"),
        }
        crate::tls::serve(listener, t.acceptor, app, stop).await;
        return Ok(());
    }
    tracing::info!(%addr, "tine gateway listening");
    // Small writes of streamed answers (process output) go out at once.
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY: {e}");
        }
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(stop)
        .await?;
    Ok(())
}

/// Every request: sandbox traffic to its node, the REST API to [`rest`].
async fn handle(State(g): State<Arc<Gateway>>, mut req: Request) -> Response {
    strip_internal(req.headers_mut());
    let path = req.uri().path().to_string();
    if let Some(t) = crate::proxy::target(req.headers(), &path, &g.domain) {
        return g.sandbox_traffic(&t.sandbox, req).await;
    }
    if crate::proxy::names_no_sandbox(&req) {
        return g.any_node(req).await;
    }
    if path == "/health" {
        return (StatusCode::OK, "ok").into_response();
    }
    if g.cfg.console && crate::console::handles(&path) {
        return crate::console::respond(req.method(), &path);
    }
    if path.starts_with("/.well-known/") {
        return identity::well_known(&g, req).await;
    }
    // Volume content calls carry the volume's token, not an API key.
    if let Some(id) = volumes::content_volume(&path) {
        return volumes::content(&g, id, req).await;
    }
    let key = match g.authenticate(req.headers()).await {
        Ok(k) => k,
        Err(e) => return e.into_response(),
    };
    rest::route(&g, key, req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// Remove every `x-tine-*` header a client sent: those are how a gateway
/// speaks to its nodes (the cluster secret, the caller's team, adopt, fork
/// from a capture, locate), and a node trusts them next to the secret the
/// gateway adds.
fn strip_internal(headers: &mut http::HeaderMap) {
    let internal: Vec<http::HeaderName> = headers
        .keys()
        .filter(|k| k.as_str().starts_with("x-tine-"))
        .cloned()
        .collect();
    for k in internal {
        headers.remove(k);
    }
}

impl Gateway {
    /// The caller's key, from `X-API-KEY` or `Authorization: Bearer`.
    async fn authenticate(&self, headers: &http::HeaderMap) -> Result<ClusterKey, ApiError> {
        let plaintext = crate::api::api_key_of(headers)?;
        let hash = crate::db::key_hash(plaintext);
        let cached = self
            .keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&hash)
            .cloned();
        if let Some((k, at)) = &cached {
            if at.elapsed() < KEY_FRESH {
                return Ok(k.clone());
            }
        }
        match self.catalog.verify_key(plaintext).await {
            Ok(Some(k)) => {
                self.keys
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(hash, (k.clone(), Instant::now()));
                Ok(k)
            }
            Ok(None) => {
                self.keys
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&hash);
                Err(ApiError::unauthorized("invalid API key"))
            }
            // PostgreSQL is down: a key seen lately still works (a key
            // revoked meanwhile too, for that long).
            Err(e) => match cached {
                Some((k, at)) if at.elapsed() < self.key_stale_ok() => Ok(k),
                _ => Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    e.to_string(),
                )),
            },
        }
    }

    /// The nodes as last read: [`Gateway::refresh_nodes`] reads them every
    /// [`NODES_FRESH`] in the background, so a create does not wait for
    /// the list; read here only when that loop has fallen behind.
    async fn nodes(&self) -> Vec<Node> {
        let stale = self
            .nodes
            .lock()
            .await
            .1
            .is_none_or(|t| t.elapsed() >= NODES_FRESH * 3);
        if stale {
            self.read_nodes().await;
        }
        self.nodes.lock().await.0.clone()
    }

    /// The nodes, read again (for up to a second) when none holds
    /// `template`: a snapshot taken a moment ago, through another gateway,
    /// reaches the catalog with its node's next heartbeat.
    async fn nodes_holding(&self, template: &str) -> Vec<Node> {
        let held = |nodes: &[Node]| {
            nodes
                .iter()
                .any(|n| n.status.templates.iter().any(|t| t == template))
        };
        let mut nodes = self.nodes().await;
        for _ in 0..4 {
            if held(&nodes) {
                break;
            }
            self.read_nodes().await;
            nodes = self.nodes().await;
            if !held(&nodes) {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
        nodes
    }

    async fn read_nodes(&self) {
        match self.catalog.nodes().await {
            Ok(n) => *self.nodes.lock().await = (n, Some(Instant::now())),
            Err(e) => tracing::warn!("listing nodes: {e}"),
        }
    }

    /// Keep the node list fresh, forever.
    async fn refresh_nodes(self: Arc<Self>) {
        loop {
            self.read_nodes().await;
            tokio::time::sleep(NODES_FRESH).await;
        }
    }

    async fn node(&self, id: &str) -> Option<Node> {
        self.nodes().await.into_iter().find(|n| n.id == id)
    }

    fn key_stale_ok(&self) -> Duration {
        Duration::from_secs(self.cfg.key_stale_ok_secs)
    }

    fn grace_ms(&self) -> i64 {
        (self.cfg.node_grace_secs * 1000) as i64
    }

    /// Where sandbox `id` lives: (node, team), from the cache or the
    /// catalog.
    async fn locate(&self, id: &str) -> Result<Option<(String, String)>, ApiError> {
        if let Some(r) = self
            .routes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
        {
            return Ok(Some(r.clone()));
        }
        let found = self
            .catalog
            .locate(id)
            .await
            .map_err(|e| ApiError::unavailable(e.to_string()))?;
        if let Some(r) = &found {
            self.remember(id, &r.0, &r.1);
        }
        Ok(found)
    }

    fn remember(&self, id: &str, node: &str, team: &str) {
        let mut routes = self.routes.lock().unwrap_or_else(|e| e.into_inner());
        // Bounded: forgetting costs one catalog lookup.
        if routes.len() >= 1_000_000 {
            routes.clear();
        }
        routes.insert(id.to_string(), (node.to_string(), team.to_string()));
    }

    fn forget(&self, id: &str) {
        self.routes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }

    /// envd or port traffic for sandbox `id`, to its node as it came (the
    /// node's proxy checks the sandbox's own tokens).
    async fn sandbox_traffic(&self, id: &str, req: Request) -> Response {
        let node = match self.locate(id).await {
            Ok(Some((node, _))) => node,
            Ok(None) => return crate::proxy::not_found(id),
            Err(e) => return e.into_response(),
        };
        let Some(n) = self.node(&node).await else {
            return crate::proxy::not_found(id);
        };
        match forward::forward(&self.client, &n.id, &n.status.address, req, &[], &[]).await {
            Ok(r) => {
                if matches!(r.status(), StatusCode::NOT_FOUND | StatusCode::BAD_GATEWAY) {
                    // Perhaps not there any more (E2B's answer for an
                    // unknown sandbox is a 502): the next request reads
                    // the catalog again, at the cost of one lookup.
                    self.forget(id);
                }
                r
            }
            Err(e) => {
                // Its node is down: the next request reads the catalog
                // again (the sandbox may have been resumed elsewhere).
                self.forget(id);
                e.into_response()
            }
        }
    }

    /// A sandbox request that names no sandbox ([`crate::proxy::names_no_sandbox`]):
    /// each healthy node is asked, with the request's head alone
    /// ([`crate::proxy::LOCATE_HEADER`]), whether the sandbox it is for is
    /// there; the request (its body streamed, never held here) then goes to
    /// the node that has it. Nothing is read from the client before a node
    /// has recognised its signature or token.
    async fn any_node(&self, req: Request) -> Response {
        let nodes: Vec<Node> = self
            .nodes()
            .await
            .into_iter()
            .filter(|n| place::healthy(n, self.grace_ms()))
            .collect();
        let asks = nodes.iter().map(|n| {
            let mut ask = http::Request::new(Body::empty());
            *ask.method_mut() = req.method().clone();
            *ask.uri_mut() = req.uri().clone();
            *ask.headers_mut() = req.headers().clone();
            for h in [
                http::header::CONTENT_LENGTH,
                http::header::TRANSFER_ENCODING,
            ] {
                ask.headers_mut().remove(h);
            }
            let extra = [
                (crate::cluster::SECRET_HEADER, self.secret.clone()),
                (crate::proxy::LOCATE_HEADER, HeaderValue::from_static("1")),
            ];
            async move {
                let r = forward::forward(&self.client, &n.id, &n.status.address, ask, &extra, &[]);
                (n, r.await)
            }
        });
        let mut last = None;
        for (n, answer) in futures::future::join_all(asks).await {
            match answer {
                Ok(r)
                    if r.status() == StatusCode::NO_CONTENT
                        && r.headers().contains_key(crate::proxy::LOCATED_HEADER) =>
                {
                    return forward::forward(&self.client, &n.id, &n.status.address, req, &[], &[])
                        .await
                        .unwrap_or_else(ForwardError::into_response);
                }
                Ok(mut r)
                    if r.headers()
                        .contains_key(crate::proxy::NO_SUCH_SANDBOX_HEADER) =>
                {
                    r.headers_mut().remove(crate::proxy::NO_SUCH_SANDBOX_HEADER);
                    last = Some(r)
                }
                // The node that has the sandbox refused (an expired
                // signature, …): its answer is the answer.
                Ok(r) => return r,
                Err(e) => {
                    if last.is_none() {
                        last = Some(e.into_response())
                    }
                }
            }
        }
        last.unwrap_or_else(|| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "no node of the cluster is up",
            )
            .into_response()
        })
    }

    /// `req` to node `n` on behalf of `team`.
    async fn to_node(
        &self,
        n: &Node,
        team: &str,
        req: http::Request<Body>,
    ) -> Result<Response, ForwardError> {
        self.send(n, team, req, &["x-api-key", "authorization"])
            .await
    }

    /// [`Gateway::to_node`] keeping `Authorization` (a volume's token).
    async fn to_node_with_token(
        &self,
        n: &Node,
        team: &str,
        req: http::Request<Body>,
    ) -> Result<Response, ForwardError> {
        self.send(n, team, req, &["x-api-key"]).await
    }

    /// `req` to node `n` as a call of `team`, without the `drop` headers.
    async fn send(
        &self,
        n: &Node,
        team: &str,
        req: http::Request<Body>,
        drop: &[&str],
    ) -> Result<Response, ForwardError> {
        let team = HeaderValue::from_str(team).unwrap_or_else(|_| HeaderValue::from_static("-"));
        forward::forward(
            &self.client,
            &n.id,
            &n.status.address,
            req,
            &[
                (crate::cluster::SECRET_HEADER, self.secret.clone()),
                (crate::cluster::TEAM_HEADER, team),
            ],
            drop,
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The attack: a client names itself another team, asks for an adopt
    /// or a fork from some capture, or poses as a locate, through the
    /// gateway that then adds the cluster secret.
    #[test]
    fn a_clients_internal_headers_never_reach_a_node() {
        let mut h = http::HeaderMap::new();
        for (k, v) in [
            (crate::cluster::TEAM_HEADER, "victims"),
            (crate::cluster::ADOPT_HEADER, "1"),
            (crate::cluster::FORK_FROM_HEADER, "cap-of-another-team"),
            (crate::cluster::SPREAD_HEADER, "1"),
            (crate::cluster::SECRET_HEADER, "guess"),
            (crate::proxy::LOCATE_HEADER, "1"),
            ("X-Tine-Anything", "x"),
            ("x-api-key", "e2b_k"),
            ("e2b-sandbox-id", "i1"),
        ] {
            h.insert(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        strip_internal(&mut h);
        let left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(left.len(), 2, "{left:?}");
        assert!(h.contains_key("x-api-key") && h.contains_key("e2b-sandbox-id"));
    }
}
