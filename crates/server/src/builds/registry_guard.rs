//! The way out for registry requests made for an API caller's build
//! (`fromImage`): an HTTP proxy on loopback that the registry client's
//! requests, redirects included, all go through. Each request's host is
//! resolved once, its addresses are checked as a sandbox's egress is (not
//! the internet: loopback, private, link-local, … refused), and the
//! checked address is the one dialled. So a key cannot make the server
//! connect to its own network and read the answer back in a build log.
//! Addresses the operator lists in `[registries] allow_private` (CIDRs:
//! a registry on the LAN, or on loopback in tests) pass.
//!
//! HTTPS goes through as `CONNECT` (the TLS is the client's, end to end);
//! plain HTTP (`insecure` registries) as absolute-form requests, sent on to
//! the checked address in origin form. hyper serves both.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tine_vmm::Net4;
use tokio::net::{TcpListener, TcpStream};

type Body = BoxBody<Bytes, hyper::Error>;

/// A running guard; dropping it stops it (connections in flight end with
/// the build's pull).
pub struct RegistryGuard {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RegistryGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RegistryGuard {
    /// Listen on an ephemeral loopback port.
    pub async fn start(allowed: Vec<Net4>) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let allowed = Arc::new(allowed);
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let allowed = allowed.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let allowed = allowed.clone();
                        async move { Ok::<_, Infallible>(handle(req, &allowed).await) }
                    });
                    let conn = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), service)
                        .with_upgrades();
                    if let Err(e) = conn.await {
                        tracing::debug!("registry guard: {e}");
                    }
                });
            }
        });
        Ok(Self { addr, task })
    }

    /// The proxy URL for the registry client.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Parse `[registries] allow_private` (CIDRs or addresses).
pub fn parse_allowed(list: &[String]) -> Result<Vec<Net4>, String> {
    list.iter()
        .map(|s| {
            Net4::parse(s.trim()).ok_or_else(|| {
                format!("[registries] allow_private: {s:?} is not an IPv4 address or CIDR")
            })
        })
        .collect()
}

/// Whether a registry at `ip` may be reached for an API caller.
pub fn permitted(ip: IpAddr, allowed: &[Net4]) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            !tine_vmm::firewall::NOT_INTERNET
                .iter()
                .any(|n| n.contains(v4))
                || allowed.iter().any(|n| n.contains(v4))
        }
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => permitted(IpAddr::V4(v4), allowed),
            // Public unicast only (2000::/3).
            None => (v6.segments()[0] & 0xe000) == 0x2000,
        },
    }
}

/// The first address of `host` that may be reached, resolved once.
async fn checked(host: &str, port: u16, allowed: &[Net4]) -> Result<SocketAddr, String> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| format!("resolving {host}: {e}"))?
        .collect();
    addrs
        .iter()
        .copied()
        .find(|a| permitted(a.ip(), allowed))
        .ok_or_else(|| {
            format!(
                "registry {host}:{port} is not on the internet ({}): a build through the API \
                 reaches such a registry only where [registries] allow_private lists it",
                addrs
                    .iter()
                    .map(|a| a.ip().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
}

/// Check `registry` (`host[:port]`, as an image reference names it) before
/// a pull: the same check the guard makes on every connection, with the
/// error the build log shows (a client does not show a proxy's refusal).
pub async fn precheck(registry: &str, allowed: &[Net4]) -> Result<(), String> {
    let (host, port) = registry
        .rsplit_once(':')
        .and_then(|(h, p)| Some((h, p.parse().ok()?)))
        .unwrap_or((registry, 443));
    checked(host, port, allowed).await.map(|_| ())
}

fn text(status: StatusCode, msg: String) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(msg)).map_err(|e| match e {}).boxed());
    *r.status_mut() = status;
    r
}

async fn handle(req: Request<Incoming>, allowed: &[Net4]) -> Response<Body> {
    let Some(authority) = req.uri().authority().cloned() else {
        return text(
            StatusCode::BAD_REQUEST,
            "a proxy request names its host".into(),
        );
    };
    let connect = req.method() == Method::CONNECT;
    let port = authority
        .port_u16()
        .unwrap_or(if connect { 443 } else { 80 });
    let to = match checked(authority.host(), port, allowed).await {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!("registry guard: {e}");
            return text(StatusCode::FORBIDDEN, e);
        }
    };
    if connect {
        tokio::spawn(async move {
            match hyper::upgrade::on(req).await {
                Ok(up) => {
                    if let Ok(mut server) = TcpStream::connect(to).await {
                        let _ =
                            tokio::io::copy_bidirectional(&mut TokioIo::new(up), &mut server).await;
                    }
                }
                Err(e) => tracing::debug!("registry guard: CONNECT upgrade: {e}"),
            }
        });
        return Response::new(Full::new(Bytes::new()).map_err(|e| match e {}).boxed());
    }
    forward(req, to).await.unwrap_or_else(|e| {
        text(
            StatusCode::BAD_GATEWAY,
            format!("registry {authority}: {e}"),
        )
    })
}

/// A plain HTTP request, sent on to `to` in origin form.
async fn forward(mut req: Request<Incoming>, to: SocketAddr) -> Result<Response<Body>, String> {
    let tcp = TcpStream::connect(to)
        .await
        .map_err(|e| format!("connecting to {to}: {e}"))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    *req.uri_mut() = crate::uri::origin_form(req.uri());
    for h in ["proxy-connection", "proxy-authorization"] {
        req.headers_mut().remove(h);
    }
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    Ok(resp.map(|b| b.boxed()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_internet_and_what_the_operator_opened() {
        let lan = parse_allowed(&["192.168.7.0/24".into()]).unwrap();
        for (ip, ok) in [
            ("203.0.113.5", true),
            ("8.8.8.8", true),
            ("127.0.0.1", false),
            ("10.1.2.3", false),
            ("169.254.169.254", false),
            ("192.168.7.9", true),
            ("192.168.8.1", false),
            ("::1", false),
            ("fe80::1", false),
            ("fd00::1", false),
            ("::ffff:127.0.0.1", false),
            ("2001:db8::1", true),
        ] {
            assert_eq!(permitted(ip.parse().unwrap(), &lan), ok, "{ip}");
        }
        assert!(parse_allowed(&["nope".into()]).is_err());
    }

    /// The attack: a build's registry names the server's own loopback; the
    /// guard answers 403 and never connects.
    #[tokio::test]
    async fn a_loopback_registry_is_refused_unless_opened() {
        let target = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let port = target.local_addr().unwrap().port();
        let e = checked("127.0.0.1", port, &[]).await.unwrap_err();
        assert!(
            e.contains("not on the internet") && e.contains("allow_private"),
            "{e}"
        );
        let e = checked("localhost", port, &[]).await.unwrap_err();
        assert!(e.contains("not on the internet"), "{e}");
        let e = precheck(&format!("127.0.0.1:{port}"), &[])
            .await
            .unwrap_err();
        assert!(e.contains("not on the internet"), "{e}");
        precheck("203.0.113.9:5000", &[]).await.unwrap();
        let open = parse_allowed(&["127.0.0.1/32".into()]).unwrap();
        precheck(&format!("127.0.0.1:{port}"), &open).await.unwrap();
        assert_eq!(
            checked("127.0.0.1", port, &open).await.unwrap(),
            SocketAddr::from(([127, 0, 0, 1], port))
        );
    }
}
