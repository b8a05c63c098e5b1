//! Domain mode over HTTPS: the certificate for `D` and `*.D`, given by the
//! operator or made by tine with its own local CA, and the TLS listener.
//!
//! The CA (`<data dir>/tls/ca.crt`, key `ca.key`, 0600) is made once and
//! kept, so clients trust it once (`SSL_CERT_FILE`, `NODE_EXTRA_CA_CERTS`);
//! the server certificate is made anew at every start for the domain of
//! that start.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_rustls::rustls;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde::Deserialize;

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// Serve HTTPS instead of HTTP.
    pub enabled: bool,
    /// PEM certificate chain for the domain and its wildcard; with `key`.
    /// Unset: tine makes one with its local CA.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a PEM {what}: {detail}")]
    Pem {
        path: PathBuf,
        what: &'static str,
        detail: String,
    },
    #[error("tls.cert and tls.key go together: set both or neither")]
    HalfGiven,
    #[error("making the certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("the certificate and key do not make a TLS server: {0}")]
    Rustls(#[from] rustls::Error),
}

/// A TLS server ready to accept, and the CA to trust when tine made it.
pub struct Tls {
    pub acceptor: tokio_rustls::TlsAcceptor,
    pub ca: Option<PathBuf>,
}

/// The host part of a domain (`tine.localhost:8443` → `tine.localhost`).
pub fn domain_host(domain: &str) -> &str {
    match domain.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => domain,
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TlsError + '_ {
    move |source| TlsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The TLS server for `domain`.
pub fn setup(cfg: &TlsConfig, data_dir: &Path, domain: &str) -> Result<Tls, TlsError> {
    let (chain, key, ca) = match (&cfg.cert, &cfg.key) {
        (Some(cert), Some(key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .and_then(|it| it.collect::<Result<Vec<_>, _>>())
                .map_err(|e| TlsError::Pem {
                    path: cert.clone(),
                    what: "certificate chain",
                    detail: e.to_string(),
                })?;
            let key = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::Pem {
                path: key.clone(),
                what: "private key",
                detail: e.to_string(),
            })?;
            (chain, key, None)
        }
        (None, None) => {
            let dir = data_dir.join("tls");
            let (chain, key) = local_certificate(&dir, domain_host(domain))?;
            (chain, key, Some(dir.join("ca.crt")))
        }
        _ => return Err(TlsError::HalfGiven),
    };
    let provider = crate::crypto::provider();
    let mut server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    // HTTP/1.1 only: the proxy splices WebSocket upgrades, which are
    // HTTP/1.1's.
    server.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Tls {
        acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(server)),
        ca,
    })
}

/// Serve `app` over TLS on `listener` until `stop` resolves; then stop
/// accepting (connections in flight are the caller's to wait for).
pub async fn serve(
    listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    app: axum::Router,
    stop: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(stop);
    loop {
        let (tcp, peer) = tokio::select! {
            _ = &mut stop => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: wait, go on.
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        // As in the plain server: no Nagle delay on streamed answers.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(%peer, "TCP_NODELAY: {e}");
        }
        let acceptor = acceptor.clone();
        // As in the plain server, requests know their connection's socket.
        let socket = axum::extract::ConnectInfo(crate::proxy::ClientSocket(
            std::os::fd::AsRawFd::as_raw_fd(&tcp),
        ));
        let app = app.clone();
        tokio::spawn(async move {
            let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => return tracing::debug!(%peer, "TLS handshake failed: {e}"),
                Err(_) => return tracing::debug!(%peer, "TLS handshake timed out"),
            };
            // The router is always ready: each request is a call on a clone.
            let service = hyper::service::service_fn(move |mut req: http::Request<_>| {
                req.extensions_mut().insert(socket);
                tower_service::Service::call(&mut app.clone(), req)
            });
            let builder =
                hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
            if let Err(e) = builder
                .http1_only()
                .serve_connection_with_upgrades(hyper_util::rt::TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%peer, "connection ended: {e}");
            }
        });
    }
}

/// How long a client may take to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The CA's name; the same every time, so a CA rebuilt from its kept key
/// signs certificates that chain to the `ca.crt` clients trust.
fn ca_params() -> rcgen::CertificateParams {
    let mut p = rcgen::CertificateParams::default();
    p.distinguished_name
        .push(rcgen::DnType::CommonName, "tine local CA");
    p.distinguished_name
        .push(rcgen::DnType::OrganizationName, "tine");
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    p.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    p.not_before = time::OffsetDateTime::now_utc() - time::Duration::days(1);
    p.not_after = time::OffsetDateTime::now_utc() + time::Duration::days(3650);
    p
}

/// Write `data` to `path` (mode `mode`), through a temporary file.
pub(crate) fn write_private(path: &Path, data: &[u8], mode: u32) -> Result<(), TlsError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    // (Not `with_extension`: ca.crt and ca.key would share one.)
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .map_err(io(&tmp))?;
    f.write_all(data).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// The local CA (made on first use) and a new certificate for `host` and
/// `*.host` signed by it; the chain is the certificate then the CA.
fn local_certificate(
    dir: &Path,
    host: &str,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io(dir))?;
    let (ca_crt, ca_key) = (dir.join("ca.crt"), dir.join("ca.key"));
    let ca_key_pair = if ca_crt.exists() && ca_key.exists() {
        let pem = std::fs::read_to_string(&ca_key).map_err(io(&ca_key))?;
        rcgen::KeyPair::from_pem(&pem)?
    } else {
        let key = rcgen::KeyPair::generate()?;
        let cert = ca_params().self_signed(&key)?;
        write_private(&ca_key, key.serialize_pem().as_bytes(), 0o600)?;
        write_private(&ca_crt, cert.pem().as_bytes(), 0o644)?;
        key
    };
    let ca = ca_params().self_signed(&ca_key_pair)?;
    let ca_der = CertificateDer::from_pem_file(&ca_crt).map_err(|e| TlsError::Pem {
        path: ca_crt.clone(),
        what: "certificate",
        detail: e.to_string(),
    })?;
    let mut leaf = rcgen::CertificateParams::new(vec![host.to_string(), format!("*.{host}")])?;
    leaf.distinguished_name
        .push(rcgen::DnType::CommonName, host);
    leaf.not_before = time::OffsetDateTime::now_utc() - time::Duration::days(1);
    leaf.not_after = time::OffsetDateTime::now_utc() + time::Duration::days(365);
    leaf.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let leaf_key = rcgen::KeyPair::generate()?;
    let cert = leaf.signed_by(&leaf_key, &ca, &ca_key_pair)?;
    let key = PrivateKeyDer::try_from(leaf_key.serialize_der()).map_err(|e| TlsError::Pem {
        path: dir.to_path_buf(),
        what: "generated key",
        detail: e.to_string(),
    })?;
    Ok((vec![cert.der().clone(), ca_der], key))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_local_ca_is_kept_and_signs_for_the_domain_and_its_wildcard() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = TlsConfig::default();
        let first = setup(&cfg, dir.path(), "tine.localhost:8443").unwrap();
        let ca = first.ca.clone().unwrap();
        let ca_pem = std::fs::read(&ca).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let key_mode = std::fs::metadata(dir.path().join("tls/ca.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(key_mode & 0o777, 0o600);
        // A second start keeps the CA.
        setup(&cfg, dir.path(), "other.localhost").unwrap();
        assert_eq!(std::fs::read(&ca).unwrap(), ca_pem);
        // The certificate verifies against the CA, for both names.
        let (chain, _) = local_certificate(&dir.path().join("tls"), "tine.localhost").unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_file(&ca).unwrap())
            .unwrap();
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            crate::crypto::provider(),
        )
        .build()
        .unwrap();
        use rustls::client::danger::ServerCertVerifier;
        for name in [
            "tine.localhost",
            "49983-iabc.tine.localhost",
            "api.tine.localhost",
        ] {
            let server_name = rustls::pki_types::ServerName::try_from(name).unwrap();
            verifier
                .verify_server_cert(
                    &chain[0],
                    &chain[1..],
                    &server_name,
                    &[],
                    rustls::pki_types::UnixTime::now(),
                )
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let other = rustls::pki_types::ServerName::try_from("example.com").unwrap();
        assert!(verifier
            .verify_server_cert(
                &chain[0],
                &chain[1..],
                &other,
                &[],
                rustls::pki_types::UnixTime::now()
            )
            .is_err());
    }

    #[test]
    fn half_a_configured_pair_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = TlsConfig {
            enabled: true,
            cert: Some(dir.path().join("c.pem")),
            key: None,
        };
        assert!(matches!(
            setup(&cfg, dir.path(), "d"),
            Err(TlsError::HalfGiven)
        ));
    }

    #[test]
    fn domain_hosts_drop_the_port() {
        assert_eq!(domain_host("tine.localhost:8443"), "tine.localhost");
        assert_eq!(domain_host("tine.localhost"), "tine.localhost");
    }
}
