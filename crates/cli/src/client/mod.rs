//! A small client of tine's REST API and of envd through its proxy (for
//! `tine sandbox` and `tine bench`), with the sandboxes and snapshots it
//! made remembered so that a benchmark can remove them all at the end,
//! whatever happened.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, Context};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tine_agent_client::process::{parse_start_response, start_request, ExecOutput};

/// How long one REST call may take (a fork of 16 under TCG takes seconds).
const CALL_TIMEOUT: Duration = Duration::from_secs(600);

/// What create returns that later calls need.
#[derive(Debug, Clone)]
pub struct Sandbox {
    pub id: String,
    pub token: String,
}

impl Sandbox {
    fn from_json(v: &Value) -> anyhow::Result<Self> {
        let id = v["sandboxID"]
            .as_str()
            .context("no sandboxID in the answer")?
            .to_string();
        let token = v["envdAccessToken"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        Ok(Self { id, token })
    }
}

pub struct Api {
    pub base: String,
    pub key: String,
    client: Client<HttpConnector, Full<Bytes>>,
    sandboxes: Mutex<BTreeSet<String>>,
    snapshots: Mutex<BTreeSet<String>>,
}

impl Api {
    pub fn new(base: &str, key: &str) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            base: base.trim_end_matches('/').to_string(),
            key: key.to_string(),
            client: Client::builder(TokioExecutor::new()).build(connector),
            sandboxes: Mutex::new(BTreeSet::new()),
            snapshots: Mutex::new(BTreeSet::new()),
        }
    }

    async fn send(&self, req: Request<Full<Bytes>>) -> anyhow::Result<(StatusCode, Bytes)> {
        let what = format!("{} {}", req.method(), req.uri().path());
        let resp = tokio::time::timeout(CALL_TIMEOUT, self.client.request(req))
            .await
            .with_context(|| format!("{what}: no answer within {CALL_TIMEOUT:?}"))?
            .with_context(|| what.clone())?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .with_context(|| what.clone())?
            .to_bytes();
        Ok((status, body))
    }

    /// One REST call; a status other than 2xx is an error carrying the body.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        let req = Request::builder()
            .method(method.clone())
            .uri(format!("{}{path}", self.base))
            .header("x-api-key", &self.key)
            .header("content-type", "application/json")
            .body(Full::new(
                body.map(|b| Bytes::from(b.to_string())).unwrap_or_default(),
            ))?;
        let (status, bytes) = self.send(req).await?;
        if !status.is_success() {
            bail!(
                "{method} {path}: HTTP {status}: {}",
                String::from_utf8_lossy(&bytes).trim()
            );
        }
        if bytes.is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&bytes)
            .with_context(|| format!("{method} {path}: the answer is not JSON"))
    }

    /// The server's Prometheus text (`GET /metrics`).
    pub async fn metrics_text(&self) -> anyhow::Result<String> {
        let req = Request::get(format!("{}/metrics", self.base)).body(Full::default())?;
        let (status, body) = self.send(req).await?;
        anyhow::ensure!(status.is_success(), "GET /metrics: HTTP {status}");
        Ok(String::from_utf8_lossy(&body).into_owned())
    }

    pub async fn health(&self) -> bool {
        let Ok(req) = Request::get(format!("{}/health", self.base)).body(Full::default()) else {
            return false;
        };
        matches!(tokio::time::timeout(Duration::from_secs(2), self.send(req)).await, Ok(Ok((s, _))) if s.is_success())
    }

    /// `POST /v2/sandboxes` from the base template with this machine shape.
    pub async fn create(&self, cpus: u32, memory_mb: u32) -> anyhow::Result<Sandbox> {
        self.create_with(cpus, memory_mb, json!({})).await
    }

    /// [`Api::create`] with more fields of the create body (`network`…).
    pub async fn create_with(
        &self,
        cpus: u32,
        memory_mb: u32,
        extra: Value,
    ) -> anyhow::Result<Sandbox> {
        let mut body = json!({ "templateID": "base", "timeout": 1800, "cpuCount": cpus, "memoryMB": memory_mb,
                           "metadata": { "tine-bench": "1" } });
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        let v = self.call(Method::POST, "/v2/sandboxes", Some(body)).await?;
        let sb = Sandbox::from_json(&v)?;
        self.track(&sb.id);
        Ok(sb)
    }

    fn track(&self, id: &str) {
        self.sandboxes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_string());
    }

    pub async fn kill(&self, id: &str) -> anyhow::Result<()> {
        let r = self
            .call(Method::DELETE, &format!("/sandboxes/{id}"), None)
            .await;
        // A 404 means it is gone already.
        if r.is_ok() || r.as_ref().is_err_and(|e| e.to_string().contains("404")) {
            self.sandboxes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(id);
        }
        r.map(drop)
    }

    pub async fn pause(&self, id: &str) -> anyhow::Result<()> {
        self.call(
            Method::POST,
            &format!("/sandboxes/{id}/pause"),
            Some(json!({})),
        )
        .await
        .map(drop)
    }

    pub async fn resume(&self, id: &str) -> anyhow::Result<()> {
        self.call(
            Method::POST,
            &format!("/v2/sandboxes/{id}/connect"),
            Some(json!({ "timeout": 1800 })),
        )
        .await
        .map(drop)
    }

    /// A user snapshot; returns its id.
    pub async fn snapshot(&self, id: &str) -> anyhow::Result<String> {
        let v = self
            .call(
                Method::POST,
                &format!("/sandboxes/{id}/snapshots"),
                Some(json!({})),
            )
            .await?;
        let sid = v["snapshotID"]
            .as_str()
            .context("no snapshotID in the answer")?
            .to_string();
        self.snapshots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(sid.clone());
        Ok(sid)
    }

    pub async fn delete_snapshot(&self, sid: &str) -> anyhow::Result<()> {
        self.call(Method::DELETE, &format!("/templates/{sid}"), None)
            .await?;
        self.snapshots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(sid);
        Ok(())
    }

    /// Fork into `count` children; each is a sandbox or the error it got.
    pub async fn fork(
        &self,
        id: &str,
        count: usize,
    ) -> anyhow::Result<Vec<Result<Sandbox, String>>> {
        let v = self
            .call(
                Method::POST,
                &format!("/sandboxes/{id}/fork"),
                Some(json!({ "count": count, "timeout": 1800 })),
            )
            .await?;
        let items = v.as_array().context("fork did not answer a list")?;
        let mut out = Vec::new();
        for item in items {
            if item.get("sandbox").is_some() {
                let sb = Sandbox::from_json(&item["sandbox"])?;
                self.track(&sb.id);
                out.push(Ok(sb));
            } else {
                out.push(Err(item["error"].to_string()));
            }
        }
        Ok(out)
    }

    /// Every sandbox the server shows (running or paused).
    pub async fn list_all(&self) -> anyhow::Result<Vec<String>> {
        let v = self
            .call(
                Method::GET,
                "/v2/sandboxes?state=running,paused&limit=1000",
                None,
            )
            .await?;
        Ok(v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s["sandboxID"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default())
    }

    /// `commands.run(cmd)` through the server's proxy (what the SDKs do).
    pub async fn exec(
        &self,
        sb: &Sandbox,
        cmd: &str,
        timeout: Duration,
    ) -> anyhow::Result<ExecOutput> {
        let mut req = start_request("user", cmd, Some(&sb.token), timeout);
        *req.uri_mut() = format!("{}/process.Process/Start", self.base).parse()?;
        req.headers_mut().insert("e2b-sandbox-id", sb.id.parse()?);
        let (status, body) = tokio::time::timeout(timeout + Duration::from_secs(5), self.send(req))
            .await
            .context("no answer from the sandbox")??;
        Ok(parse_start_response(status, &body)?)
    }

    /// Remove every sandbox and snapshot this client made (and, with
    /// `everything`, every sandbox the server has: its data dir is ours).
    pub async fn clean_up(&self, everything: bool) -> Vec<String> {
        let mut ids: BTreeSet<String> = self
            .sandboxes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if everything {
            if let Ok(all) = self.list_all().await {
                ids.extend(all);
            }
        }
        let mut errors = Vec::new();
        for id in ids {
            if let Err(e) = self.kill(&id).await {
                if !e.to_string().contains("404") {
                    errors.push(format!("killing {id}: {e:#}"));
                }
            }
        }
        let snaps: Vec<String> = self
            .snapshots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect();
        for sid in snaps {
            if let Err(e) = self.delete_snapshot(&sid).await {
                if !e.to_string().contains("404") {
                    errors.push(format!("deleting snapshot {sid}: {e:#}"));
                }
            }
        }
        errors
    }
}
