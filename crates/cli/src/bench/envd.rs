//! `commands.run` at the wire level: the Connect streaming request envd's
//! `process.Process/Start` takes and the frames it answers, sent either
//! through the server's proxy ([`super::api::Api::exec`]) or straight to the
//! agent inside the VM's network namespace ([`Direct`]).

use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use tine_vmm::netns::Netns;

pub use tine_vmm::guest::ExecOutput;

/// The request the E2B SDK's `commands.run(cmd)` makes (as user `user`).
pub fn start_request(
    cmd: &str,
    token: &str,
    timeout: Duration,
) -> anyhow::Result<Request<Full<Bytes>>> {
    let body = tine_connect::encode_message(&serde_json::json!({
        "process": { "cmd": "/bin/bash", "args": ["-l", "-c", cmd] },
        "stdin": false,
    }))
    .map_err(|e| anyhow::anyhow!("encoding the request: {e}"))?;
    let basic = base64::engine::general_purpose::STANDARD.encode("user:");
    Ok(Request::post("/process.Process/Start")
        .header("content-type", tine_connect::CONTENT_TYPE_STREAM_JSON)
        .header(
            tine_connect::HEADER_TIMEOUT_MS,
            timeout.as_millis().to_string(),
        )
        .header("authorization", format!("Basic {basic}"))
        .header("x-access-token", token)
        .body(Full::new(body))?)
}

/// Decode the answer of `process.Process/Start`.
pub fn parse(status: StatusCode, body: &[u8]) -> Result<ExecOutput, String> {
    let b64 = base64::engine::general_purpose::STANDARD;
    if status != StatusCode::OK {
        let err = tine_connect::Error::from_unary_response(status.as_u16(), body);
        return Err(format!("HTTP {status}: {err}"));
    }
    let mut decoder = tine_connect::Decoder::new(64 << 20);
    decoder.push(body);
    let mut out = ExecOutput::default();
    let mut ended = false;
    while let Some(frame) = decoder.next_frame().map_err(|e| e.to_string())? {
        match frame {
            tine_connect::Frame::Message(json) => {
                let msg: serde_json::Value =
                    serde_json::from_slice(&json).map_err(|e| e.to_string())?;
                let event = &msg["event"];
                if let Some(data) = event.get("data") {
                    for (key, sink) in [("stdout", &mut out.stdout), ("stderr", &mut out.stderr)] {
                        if let Some(s) = data.get(key).and_then(|v| v.as_str()) {
                            sink.extend(b64.decode(s).map_err(|e| e.to_string())?);
                        }
                    }
                } else if let Some(end) = event.get("end") {
                    out.exit_code = end["exitCode"].as_i64().unwrap_or(0) as i32;
                    out.status = end["status"].as_str().unwrap_or_default().to_string();
                    ended = true;
                }
            }
            tine_connect::Frame::End(end) => end.into_result().map_err(|e| e.to_string())?,
        }
    }
    decoder.finish().map_err(|e| e.to_string())?;
    if !ended {
        return Err("the process stream ended without an end event".into());
    }
    Ok(out)
}

/// A kept-alive HTTP/1.1 connection straight to the agent of one VM.
pub struct Direct {
    sender: SendRequest<Full<Bytes>>,
}

impl Direct {
    pub async fn connect(netns: &Netns) -> anyhow::Result<Self> {
        let stream = tine_vmm::guest::connect(netns, Duration::from_secs(2)).await?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Self { sender })
    }

    pub async fn exec(
        &mut self,
        cmd: &str,
        token: &str,
        timeout: Duration,
    ) -> anyhow::Result<ExecOutput> {
        let mut req = start_request(cmd, token, timeout)?;
        req.headers_mut().insert("host", "agent".parse()?);
        self.sender.ready().await?;
        let resp = tokio::time::timeout(timeout, self.sender.send_request(req)).await??;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        parse(status, &body).map_err(anyhow::Error::msg)
    }
}
