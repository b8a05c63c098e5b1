//! `network.egress_proxy`: a sandbox's outbound TCP tunnelled through a
//! SOCKS5 proxy its owner runs ("bring your own proxy"). The firewall
//! sends every new TCP connection of the guest to the sandbox's egress
//! proxy, which applies the policy first (a connection `denyOut` blocks
//! never reaches the SOCKS5 proxy, and header transforms still apply) and
//! then dials the destination through the SOCKS5 proxy instead of
//! directly: with RFC 1929 credentials when given, over TLS when asked
//! (verified, TLS 1.2 or newer, never falling back to plaintext). It
//! fails closed: no proxy, no connection. UDP (DNS, QUIC) is not
//! tunnelled. The guest sees none of it.

use std::net::{SocketAddr, SocketAddrV4};
use std::pin::Pin;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::rustls;

use super::site::Site;

/// Bytes of a CA certificate the request may carry.
pub const MAX_CA_CERT: usize = 8192;

/// TLS to the proxy (`tls` of `egressProxy`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProxyTls {
    #[serde(default)]
    pub enabled: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_cert: Option<String>,
}

/// `egressProxy` as the API states it (kept with the sandbox, password
/// included; shown without the password and the CA).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EgressProxyConfig {
    pub address: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<ProxyTls>,
}

impl EgressProxyConfig {
    /// `(host, port)` of the address, checked.
    pub fn host_port(&self) -> Result<(String, u16), String> {
        let a = self.address.trim();
        let (host, port) = a
            .rsplit_once(':')
            .ok_or_else(|| format!("network.egress_proxy.address {a:?} must be host:port"))?;
        let port: u16 = port
            .parse()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| format!("network.egress_proxy.address {a:?}: bad port"))?;
        let ok_host = !host.is_empty()
            && host.len() <= 253
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'_');
        if !ok_host {
            return Err(format!(
                "network.egress_proxy.address {a:?}: the host must be a name or an IPv4 address"
            ));
        }
        Ok((host.to_ascii_lowercase(), port))
    }

    /// Every field's bounds.
    pub fn check(&self) -> Result<(), String> {
        self.host_port()?;
        let len_ok = |s: &Option<String>| s.as_ref().is_none_or(|v| (1..=255).contains(&v.len()));
        if !len_ok(&self.username) || !len_ok(&self.password) {
            return Err("network.egress_proxy: username and password are 1-255 bytes".into());
        }
        if self.password.is_some() && self.username.is_none() {
            return Err("network.egress_proxy.password needs a username".into());
        }
        if let Some(t) = &self.tls {
            if t.server_name
                .as_ref()
                .is_some_and(|n| n.is_empty() || n.len() > 253)
            {
                return Err("network.egress_proxy.tls.server_name is 1-253 bytes".into());
            }
            if let Some(ca) = &t.ca_cert {
                if ca.len() > MAX_CA_CERT {
                    return Err(format!(
                        "network.egress_proxy.tls.ca_cert is at most {MAX_CA_CERT} bytes"
                    ));
                }
                parse_pem(ca)?;
            }
        }
        Ok(())
    }

    /// What the API shows: no password, no CA.
    pub fn shown(&self) -> Self {
        Self {
            password: None,
            tls: self.tls.as_ref().filter(|t| t.enabled).map(|t| ProxyTls {
                enabled: true,
                server_name: t.server_name.clone(),
                ca_cert: None,
            }),
            ..self.clone()
        }
    }

    fn tls_enabled(&self) -> bool {
        self.tls.as_ref().is_some_and(|t| t.enabled)
    }
}

fn parse_pem(pem: &str) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, String> {
    use rustls::pki_types::pem::PemObject;
    let certs = rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("network.egress_proxy.tls.ca_cert: {e}"))?;
    if certs.is_empty() {
        return Err("network.egress_proxy.tls.ca_cert holds no PEM certificate".into());
    }
    Ok(certs)
}

/// A stream to a destination, direct or through the proxy.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}
pub type Stream = Pin<Box<dyn Io>>;

/// A checked proxy, ready to dial through.
pub struct Tunnel {
    host: String,
    port: u16,
    auth: Option<(String, String)>,
    tls: Option<(
        tokio_rustls::TlsConnector,
        rustls::pki_types::ServerName<'static>,
    )>,
}

impl Tunnel {
    /// `cfg` (checked), with TLS to it verified against `ca_cert` or else
    /// the host's trust store (`host_roots`).
    pub fn new(
        cfg: &EgressProxyConfig,
        host_roots: &Arc<rustls::RootCertStore>,
    ) -> Result<Self, String> {
        cfg.check()?;
        let (host, port) = cfg.host_port()?;
        let tls = if cfg.tls_enabled() {
            let t = cfg.tls.clone().unwrap_or_default();
            let roots = match &t.ca_cert {
                Some(pem) => {
                    let mut r = rustls::RootCertStore::empty();
                    for c in parse_pem(pem)? {
                        r.add(c)
                            .map_err(|e| format!("network.egress_proxy.tls.ca_cert: {e}"))?;
                    }
                    Arc::new(r)
                }
                None => host_roots.clone(),
            };
            let provider = crate::crypto::provider();
            let config = rustls::ClientConfig::builder_with_provider(provider)
                .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
                .map_err(|e| e.to_string())?
                .with_root_certificates(roots)
                .with_no_client_auth();
            let name = t.server_name.clone().unwrap_or_else(|| host.clone());
            let name = rustls::pki_types::ServerName::try_from(name.clone())
                .map_err(|_| format!("network.egress_proxy.tls: {name:?} is not a server name"))?;
            Some((tokio_rustls::TlsConnector::from(Arc::new(config)), name))
        } else {
            None
        };
        let auth = cfg
            .username
            .clone()
            .map(|u| (u, cfg.password.clone().unwrap_or_default()));
        Ok(Self {
            host,
            port,
            auth,
            tls,
        })
    }

    /// The proxy's address: resolved on the host now, refused when it is
    /// not on the internet (or a range the operator opened).
    pub async fn resolve(&self, site: &Site) -> std::io::Result<SocketAddrV4> {
        let addrs = tokio::net::lookup_host((self.host.as_str(), self.port)).await?;
        let v4: Vec<SocketAddrV4> = addrs
            .filter_map(|a| match a {
                SocketAddr::V4(v) => Some(v),
                SocketAddr::V6(_) => None,
            })
            .collect();
        let first = v4.first().copied().ok_or_else(|| {
            std::io::Error::other(format!("egress proxy {} has no IPv4 address", self.host))
        })?;
        if site.is_blocked(*first.ip()) {
            return Err(std::io::Error::other(format!(
                "egress proxy {} resolves to {}, which is not on the internet",
                self.host,
                first.ip()
            )));
        }
        Ok(first)
    }

    /// A stream to `dst` through the proxy, the proxy dialled from
    /// `guest`'s namespace.
    pub async fn dial(
        &self,
        guest: &tine_vmm::Guest,
        site: &Site,
        dst: SocketAddrV4,
    ) -> std::io::Result<Stream> {
        let addr = self.resolve(site).await?;
        let tcp = guest.connect_out(addr).await?;
        let target = (dst.ip().to_string(), dst.port());
        let target = (target.0.as_str(), target.1);
        let err =
            |e: tokio_socks::Error| std::io::Error::other(format!("egress proxy {addr}: {e}"));
        match &self.tls {
            Some((connector, name)) => {
                let tls = connector.connect(name.clone(), tcp).await.map_err(|e| {
                    std::io::Error::other(format!("TLS to egress proxy {addr}: {e}"))
                })?;
                socks(tls, target, self.auth.as_ref()).await.map_err(err)
            }
            None => socks(tcp, target, self.auth.as_ref()).await.map_err(err),
        }
    }
}

/// The SOCKS5 handshake over `s` for a CONNECT to `target`.
async fn socks<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    s: S,
    target: (&str, u16),
    auth: Option<&(String, String)>,
) -> Result<Stream, tokio_socks::Error> {
    use tokio_socks::tcp::Socks5Stream;
    Ok(match auth {
        Some((u, p)) => {
            Box::pin(Socks5Stream::connect_with_password_and_socket(s, target, u, p).await?)
        }
        None => Box::pin(Socks5Stream::connect_with_socket(s, target).await?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(v: serde_json::Value) -> Result<EgressProxyConfig, String> {
        let c: EgressProxyConfig = serde_json::from_value(v).map_err(|e| e.to_string())?;
        c.check().map(|_| c)
    }

    #[test]
    fn addresses_credentials_and_tls_are_checked() {
        let c = cfg(
            serde_json::json!({"address": "Proxy.test:1080", "username": "u", "password": "p",
            "tls": {"enabled": true, "serverName": "proxy.test"}}),
        )
        .unwrap();
        assert_eq!(c.host_port().unwrap(), ("proxy.test".into(), 1080));
        let shown = c.shown();
        assert_eq!(shown.password, None);
        assert_eq!(
            shown.tls.unwrap().server_name.as_deref(),
            Some("proxy.test")
        );
        for (v, needle) in [
            (serde_json::json!({"address": "proxy.test"}), "host:port"),
            (serde_json::json!({"address": "proxy.test:0"}), "bad port"),
            (
                serde_json::json!({"address": "a b:1080"}),
                "name or an IPv4",
            ),
            (
                serde_json::json!({"address": "p:1", "password": "x"}),
                "needs a username",
            ),
            (
                serde_json::json!({"address": "p:1", "username": ""}),
                "1-255",
            ),
            (
                serde_json::json!({"address": "p:1", "tls": {"enabled": true, "caCert": "junk"}}),
                "no PEM",
            ),
            (
                serde_json::json!({"address": "p:1", "port": 3}),
                "unknown field",
            ),
        ] {
            let e = cfg(v.clone()).unwrap_err();
            assert!(e.contains(needle), "{v}: {e}");
        }
    }
}
