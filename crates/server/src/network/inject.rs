//! The injecting proxy: for a connection whose host has header transforms
//! (`network.rules`, [`super::transform`]), the sandbox's egress proxy
//! speaks HTTP itself instead of splicing bytes. HTTPS is terminated with
//! a certificate from the host's egress CA ([`super::ca`], trusted by the
//! guest) and encrypted again to the real destination, whose certificate
//! is verified against the host's trust store (plus
//! `[network] upstream_ca_file`). Each request then gets its headers set,
//! placeholders resolved from the team's secrets at that moment, so a
//! value reaches only the destination: never the guest, its logs or
//! tine's.
//!
//! HTTP/1.1 on both sides (the guest is offered only `http/1.1` by ALPN).
//! Where a request goes is fixed when its connection is: over HTTPS by the
//! TLS server name (the destination must prove it with its certificate);
//! over plain HTTP, for a rule by name, the address the sandboxes'
//! resolver gives for that name (never the address the guest dialled,
//! which it could have pointed anywhere), for a rule by address the
//! address dialled. A request that names another host (`Host`, or an
//! absolute URI; 421), carries two `Host` headers (400), is a `TRACE`,
//! `TRACK` or `CONNECT` (405, a `TRACE` echoes headers back), or goes to a
//! host the policy does not allow (403) is refused. A placeholder naming a
//! secret the team does not have refuses the request (502, and an event
//! on the sandbox): it is never sent with the literal placeholder.

use std::net::SocketAddrV4;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::rustls;

use super::ca::EgressCa;
use super::transform::Piece;
use super::{Egress, Vault};

/// How long the guest's TLS handshake with the proxy may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long dialling and the TLS handshake with the destination may take.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(15);
/// How long the guest may take to send a request's head (and to start the
/// next one on a kept-alive connection).
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// Bytes one header value may have once its placeholders are resolved.
const MAX_RESOLVED: usize = 16 * 1024;

/// What every injecting connection of the host shares.
pub struct Injector {
    pub ca: Arc<EgressCa>,
    /// TLS to destinations, verified against the host's trust store.
    pub upstream: tokio_rustls::TlsConnector,
    pub vault: Arc<dyn Vault>,
}

impl Injector {
    /// The TLS client for destinations, trusting `roots`.
    pub fn upstream_connector(
        roots: Arc<rustls::RootCertStore>,
    ) -> Result<tokio_rustls::TlsConnector, String> {
        let provider = crate::crypto::provider();
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
    }

    /// The host's trust store, plus the certificates in `extra` (PEM), if
    /// any.
    pub fn host_roots(extra: Option<&std::path::Path>) -> Result<rustls::RootCertStore, String> {
        let mut roots = rustls::RootCertStore::empty();
        let native = rustls_native_certs::load_native_certs();
        for e in &native.errors {
            tracing::warn!("the host's trust store: {e}");
        }
        let (_added, _ignored) = roots.add_parsable_certificates(native.certs);
        if let Some(path) = extra {
            use rustls::pki_types::pem::PemObject;
            let certs = rustls::pki_types::CertificateDer::pem_file_iter(path)
                .map_err(|e| format!("network.upstream_ca_file {}: {e}", path.display()))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("network.upstream_ca_file {}: {e}", path.display()))?;
            if certs.is_empty() {
                return Err(format!(
                    "network.upstream_ca_file {}: no certificate in it",
                    path.display()
                ));
            }
            for c in certs {
                roots
                    .add(c)
                    .map_err(|e| format!("network.upstream_ca_file {}: {e}", path.display()))?;
            }
        }
        Ok(roots)
    }
}

/// A stream that first gives back bytes already read from it.
struct Rewind {
    head: Vec<u8>,
    pos: usize,
    inner: TcpStream,
}

impl AsyncRead for Rewind {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.pos < self.head.len() {
            let n = (self.head.len() - self.pos).min(buf.remaining());
            let start = self.pos;
            buf.put_slice(&self.head[start..start + n]);
            self.pos += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Rewind {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

type Body = BoxBody<Bytes, hyper::Error>;

fn text(status: StatusCode, msg: String) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from(format!("tine egress: {msg}\n")))
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain"),
    );
    r.headers_mut()
        .insert("x-tine-egress-error", HeaderValue::from_static("1"));
    r
}

/// The destination side of one guest connection.
enum Upstream {
    Ready(tokio::sync::Mutex<hyper::client::conn::http1::SendRequest<Incoming>>),
    /// Dialling or verifying the destination failed: every request gets
    /// this as a 502.
    Failed(String),
}

/// One guest connection being served.
struct Conn {
    egress: Arc<Egress>,
    inject: Arc<Injector>,
    /// Where its requests go.
    dst: SocketAddrV4,
    /// The host every request on it must name: the TLS server name, or the
    /// first request's `Host` over plain HTTP (`None`: no name; then only
    /// rules by address apply).
    host: Option<String>,
    tls: bool,
    upstream: Upstream,
}

/// Serve `conn` (whose first bytes, `head`, were read already) as an
/// HTTP proxy that applies the sandbox's transforms.
pub(super) async fn serve(
    conn: TcpStream,
    head: Vec<u8>,
    dst: SocketAddrV4,
    name: Option<String>,
    egress: Arc<Egress>,
    inject: Arc<Injector>,
) -> std::io::Result<()> {
    let tls = head.first() == Some(&0x16);
    let stream = Rewind {
        head,
        pos: 0,
        inner: conn,
    };
    if !tls {
        let host = name.map(|n| n.trim_end_matches('.').to_ascii_lowercase());
        let (dst, upstream) = match plain_destination(&egress, dst, host.as_deref()).await {
            Ok(to) => (to, dial_plain(&egress, to).await),
            Err(e) => (dst, Upstream::Failed(e)),
        };
        let c = Arc::new(Conn {
            egress,
            inject,
            dst,
            host,
            tls: false,
            upstream,
        });
        return http(TokioIo::new(stream), c).await;
    }
    let start = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), stream),
    )
    .await
    .map_err(|_| std::io::Error::other("the guest's TLS hello timed out"))??;
    let sni = start
        .client_hello()
        .server_name()
        .map(str::to_ascii_lowercase);
    let host = sni.clone().unwrap_or_else(|| dst.ip().to_string());
    let config = inject
        .ca
        .server_config(&host)
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let guest_tls = tokio::time::timeout(HANDSHAKE_TIMEOUT, start.into_stream(config))
        .await
        .map_err(|_| std::io::Error::other("the guest's TLS handshake timed out"))??;
    let upstream = dial_tls(&egress, &inject, dst, &host).await;
    let c = Arc::new(Conn {
        egress,
        inject,
        dst,
        host: sni,
        tls: true,
        upstream,
    });
    http(TokioIo::new(guest_tls), c).await
}

/// Where plain HTTP naming `host` goes: for a rule by name, an address the
/// sandboxes' resolver gives for it that the policy allows
/// ([`Egress::named_destination`]); otherwise the address the guest
/// dialled.
async fn plain_destination(
    egress: &Egress,
    dst: SocketAddrV4,
    host: Option<&str>,
) -> Result<SocketAddrV4, String> {
    match host.filter(|h| egress.policy.transforms.by_name(h)) {
        Some(name) => egress.named_destination(dst, name).await,
        None => Ok(dst),
    }
}

async fn handshake<S>(io: S, what: &str) -> Upstream
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    match hyper::client::conn::http1::handshake(TokioIo::new(io)).await {
        Ok((sender, conn)) => {
            tokio::spawn(conn);
            Upstream::Ready(tokio::sync::Mutex::new(sender))
        }
        Err(e) => Upstream::Failed(format!("{what}: {e}")),
    }
}

async fn dial_plain(egress: &Egress, dst: SocketAddrV4) -> Upstream {
    match tokio::time::timeout(UPSTREAM_TIMEOUT, egress.dial(dst)).await {
        Ok(Ok(tcp)) => handshake(tcp, &format!("{dst}")).await,
        Ok(Err(e)) => Upstream::Failed(format!("connecting to {dst}: {e}")),
        Err(_) => Upstream::Failed(format!("connecting to {dst} timed out")),
    }
}

async fn dial_tls(egress: &Egress, inject: &Injector, dst: SocketAddrV4, host: &str) -> Upstream {
    let name = match rustls::pki_types::ServerName::try_from(host.to_string()) {
        Ok(n) => n,
        Err(e) => return Upstream::Failed(format!("{host:?} is not a TLS server name: {e}")),
    };
    let dial = async {
        let tcp = egress
            .dial(dst)
            .await
            .map_err(|e| format!("connecting to {dst}: {e}"))?;
        inject
            .upstream
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS to {host} ({dst}): {e}"))
    };
    match tokio::time::timeout(UPSTREAM_TIMEOUT, dial).await {
        Ok(Ok(tls)) => handshake(tls, host).await,
        Ok(Err(e)) => Upstream::Failed(e),
        Err(_) => Upstream::Failed(format!("connecting to {host} ({dst}) timed out")),
    }
}

async fn http<S>(io: TokioIo<S>, c: Arc<Conn>) -> std::io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req| {
        let c = c.clone();
        async move { Ok::<_, std::convert::Infallible>(handle(&c, req).await) }
    });
    hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .keep_alive(true)
        .serve_connection(io, service)
        .await
        .map_err(std::io::Error::other)
}

/// Why a header value could not be made.
enum Unresolved {
    /// A placeholder names what the sandbox does not have.
    Missing(String),
    /// Reading or minting failed (the detail is logged, not sent).
    Failed { what: String, error: String },
}

/// A header value with its placeholders resolved, now.
async fn resolve(c: &Conn, pieces: &[Piece]) -> Result<String, Unresolved> {
    let mut value = String::new();
    for piece in pieces {
        match piece {
            Piece::Text(t) => value.push_str(t),
            _ if value.len() > MAX_RESOLVED => break,
            Piece::Secret(name) => match c.inject.vault.reveal(&c.egress.team, name).await {
                Ok(Some(v)) => value.push_str(&v),
                Ok(None) => {
                    return Err(Unresolved::Missing(format!(
                        "secret {name:?}, which does not exist"
                    )))
                }
                Err(error) => {
                    return Err(Unresolved::Failed {
                        what: format!("reading secret {name:?}"),
                        error,
                    })
                }
            },
            Piece::Token(name) => {
                let spec = c.egress.iam.get(name).ok_or_else(|| {
                    Unresolved::Missing(format!(
                        "workload identity token {name:?}, which the sandbox did not register"
                    ))
                })?;
                let token = c
                    .inject
                    .vault
                    .mint(&c.egress.team, &c.egress.sandbox, &spec.audience)
                    .map_err(|error| Unresolved::Failed {
                        what: format!("minting token {name:?}"),
                        error,
                    })?;
                value.push_str(&token);
            }
        }
    }
    if value.len() > MAX_RESOLVED {
        return Err(Unresolved::Failed {
            what: "a header value over 16 KiB".into(),
            error: format!("{} bytes", value.len()),
        });
    }
    Ok(value)
}

/// The host a request names (`Host` without its port).
fn host_of(req: &Request<Incoming>) -> Option<String> {
    let h = req.headers().get(http::header::HOST)?.to_str().ok()?;
    let h = match h.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => h,
    };
    Some(h.trim_end_matches('.').to_ascii_lowercase())
}

async fn handle(c: &Conn, mut req: Request<Incoming>) -> Response<Body> {
    if matches!(req.method().as_str(), "TRACE" | "TRACK" | "CONNECT") {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            format!(
                "{} is not forwarded to a host with header transforms",
                req.method()
            ),
        );
    }
    if req.headers().get_all(http::header::HOST).iter().count() > 1 {
        return text(StatusCode::BAD_REQUEST, "more than one Host header".into());
    }
    let named = host_of(&req);
    // An absolute URI names the host too (and wins over Host upstream).
    let in_uri = req
        .uri()
        .host()
        .map(|h| h.trim_end_matches('.').to_ascii_lowercase());
    // HTTPS without a server name is for the address dialled (rules by
    // address only).
    let expected = c
        .host
        .clone()
        .or_else(|| c.tls.then(|| c.dst.ip().to_string()));
    for h in [&named, &in_uri].into_iter().flatten() {
        if let Some(e) = expected.as_ref().filter(|e| *e != h) {
            return text(
                StatusCode::MISDIRECTED_REQUEST,
                format!("this connection is for {e}, not {h:?}"),
            );
        }
    }
    // Origin-form upstream, whatever the guest sent.
    *req.uri_mut() = crate::uri::origin_form(req.uri());
    let host = c.host.clone();
    let ip = *c.dst.ip();
    if !c.egress.policy.allows(&c.egress.site, ip, host.as_deref()) {
        return text(
            StatusCode::FORBIDDEN,
            "blocked by the sandbox's network policy".into(),
        );
    }
    if let Some(headers) = c.egress.policy.transforms.for_request(ip, host.as_deref()) {
        for h in headers {
            let value = match resolve(c, &h.value).await {
                Ok(v) => v,
                Err(Unresolved::Missing(what)) => {
                    let msg = format!(
                        "request to {} refused: header {} names {what}",
                        host.as_deref().unwrap_or("?"),
                        h.name
                    );
                    c.egress.note(&*c.inject.vault, &msg);
                    return text(StatusCode::BAD_GATEWAY, msg);
                }
                Err(Unresolved::Failed { what, error }) => {
                    tracing::error!(sandbox = %c.egress.sandbox, "egress: {what}: {error}");
                    return text(StatusCode::BAD_GATEWAY, format!("{what} failed"));
                }
            };
            match HeaderValue::from_str(&value) {
                Ok(mut v) => {
                    v.set_sensitive(true);
                    req.headers_mut().insert(h.name.clone(), v);
                }
                Err(_) => {
                    return text(
                        StatusCode::BAD_GATEWAY,
                        format!("header {} would not be a valid header value", h.name),
                    )
                }
            }
        }
    }
    let sender = match &c.upstream {
        Upstream::Ready(s) => s,
        Upstream::Failed(e) => return text(StatusCode::BAD_GATEWAY, e.clone()),
    };
    let mut sender = sender.lock().await;
    // The destination closed its side: so does this connection, and the
    // guest's client opens another.
    let closing = |msg: String| {
        let mut r = text(StatusCode::BAD_GATEWAY, msg);
        r.headers_mut()
            .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        r
    };
    if sender.ready().await.is_err() {
        return closing("the destination closed the connection".into());
    }
    match sender.send_request(req).await {
        Ok(resp) => resp.map(|b| b.boxed()),
        Err(e) => closing(format!("forwarding: {e}")),
    }
}
