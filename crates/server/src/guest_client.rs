//! The pooled HTTP client the proxy sends into sandboxes with.
//!
//! hyper-util's client keeps idle HTTP/1.1 connections per authority. The
//! authority names the sandbox *and* the VM process it runs in
//! (`<id>-<incarnation>.vm:<port>`), so a connection to a VM that was
//! paused, captured or replaced is never reused; [`GuestConnector`]
//! resolves it through the sandbox's guest network (the VM driver's). An
//! `https` URI (a port in the sandbox's `httpsPorts`) gets TLS on top
//! (`crate::guest_tls`).

use std::time::Duration;

use axum::body::Body;
use hyper_util::rt::TokioIo;

use crate::sandboxes::Manager;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Idle pooled connections into a sandbox are closed after this.
const POOL_IDLE: Duration = Duration::from_secs(30);

/// The pooled HTTP client the proxy sends with.
pub type GuestClient = hyper_util::client::legacy::Client<GuestConnector, Body>;

pub fn client(manager: std::sync::Arc<Manager>) -> GuestClient {
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(POOL_IDLE)
        .pool_timer(hyper_util::rt::TokioTimer::new())
        .build(GuestConnector { manager })
}

/// Opens TCP connections to `<id>-<incarnation>.vm:<port>` inside the
/// sandbox's network namespace.
#[derive(Clone)]
pub struct GuestConnector {
    manager: std::sync::Arc<Manager>,
}

/// A connection into a sandbox, as hyper-util's client wants it.
pub enum GuestStream {
    Plain(TokioIo<tokio::net::TcpStream>),
    Tls(Box<TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>>),
}

/// Call `$method` on whichever stream `$s` holds.
macro_rules! either {
    ($s:expr, $method:ident($($arg:expr),*)) => {
        match $s.get_mut() {
            GuestStream::Plain(io) => std::pin::Pin::new(io).$method($($arg),*),
            GuestStream::Tls(io) => std::pin::Pin::new(&mut **io).$method($($arg),*),
        }
    };
}

impl hyper_util::client::legacy::connect::Connection for GuestStream {
    fn connected(&self) -> hyper_util::client::legacy::connect::Connected {
        hyper_util::client::legacy::connect::Connected::new()
    }
}

impl hyper::rt::Read for GuestStream {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        either!(self, poll_read(cx, buf))
    }
}

impl hyper::rt::Write for GuestStream {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        either!(self, poll_write(cx, buf))
    }
    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        either!(self, poll_flush(cx))
    }
    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        either!(self, poll_shutdown(cx))
    }
}

impl tower_service::Service<http::Uri> for GuestConnector {
    type Response = GuestStream;
    type Error = std::io::Error;
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = std::io::Result<GuestStream>> + Send>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let manager = self.manager.clone();
        Box::pin(async move {
            let gone = || std::io::Error::new(std::io::ErrorKind::NotFound, "sandbox VM gone");
            let host = uri.host().ok_or_else(gone)?;
            let (id, incarnation) = host
                .trim_end_matches(".vm")
                .rsplit_once('-')
                .ok_or_else(gone)?;
            let live = manager.live(id).ok_or_else(gone)?;
            if live.incarnation().to_string() != incarnation {
                return Err(gone());
            }
            let port = uri.port_u16().unwrap_or(80);
            let stream = tokio::time::timeout(CONNECT_TIMEOUT, live.guest.connect(port))
                .await
                .map_err(|_| {
                    std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out")
                })??;
            if uri.scheme() != Some(&http::uri::Scheme::HTTPS) {
                return Ok(GuestStream::Plain(TokioIo::new(stream)));
            }
            let name = tokio_rustls::rustls::pki_types::ServerName::try_from(host.to_string())
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
            let tls = tokio::time::timeout(
                CONNECT_TIMEOUT,
                crate::guest_tls::connector().connect(name, stream),
            )
            .await
            .map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::TimedOut, "TLS handshake timed out")
            })??;
            Ok(GuestStream::Tls(Box::new(TokioIo::new(tls))))
        })
    }
}
