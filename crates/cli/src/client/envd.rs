//! `commands.run` at the wire level: the Connect streaming request envd's
//! `process.Process/Start` takes and the frames it answers, sent either
//! through the server's proxy ([`super::Api::exec`]) or straight to the
//! agent inside the VM's network namespace ([`Direct`]).

use std::time::Duration;

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
    Ok(tine_vmm::guest::start_request(
        "user",
        cmd,
        Some(token),
        timeout,
    ))
}

/// Decode the answer of `process.Process/Start`.
pub fn parse(status: StatusCode, body: &[u8]) -> Result<ExecOutput, String> {
    tine_vmm::guest::parse_start_response(status, body)
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
