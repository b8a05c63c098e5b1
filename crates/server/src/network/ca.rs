//! The host's egress CA: the certificate authority whose certificates the
//! injecting proxy ([`super::inject`]) presents to guests for the hosts
//! whose requests it transforms. Every guest trusts it (the agent installs
//! it at `/init`); its key never leaves the host.
//!
//! ```text
//! <data>/egress-ca/ca.crt   the certificate guests trust (0644)
//! <data>/egress-ca/ca.key   its key (0600)
//! ```
//!
//! Certificates for hosts are made on first use (ECDSA P-256, a day's
//! validity on each side of now) and kept in memory, a bounded number.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::sign::CertifiedKey;

/// Host certificates kept; past it the cache starts over.
const MAX_LEAVES: usize = 4096;
/// How long a host certificate is valid (it is remade after).
const LEAF_DAYS: i64 = 7;

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("egress CA in {dir}: {detail}")]
    Files { dir: String, detail: String },
    #[error("making a certificate: {0}")]
    Generate(#[from] rcgen::Error),
}

pub struct EgressCa {
    pem: String,
    der: CertificateDer<'static>,
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
    provider: Arc<rustls::crypto::CryptoProvider>,
    leaves: Mutex<HashMap<String, (i64, Arc<CertifiedKey>)>>,
}

impl std::fmt::Debug for EgressCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EgressCa(..)")
    }
}

/// The CA's name: the same every time, so one rebuilt from its kept key
/// signs certificates that chain to the `ca.crt` guests trust.
fn ca_params() -> rcgen::CertificateParams {
    let mut p = rcgen::CertificateParams::default();
    p.distinguished_name
        .push(rcgen::DnType::CommonName, "tine egress CA");
    p.distinguished_name
        .push(rcgen::DnType::OrganizationName, "tine");
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    p.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    p.not_before = time::OffsetDateTime::now_utc() - time::Duration::days(1);
    p.not_after = time::OffsetDateTime::now_utc() + time::Duration::days(3650);
    p
}

impl EgressCa {
    /// The CA kept in `dir`, made when there is none.
    pub fn load_or_create(dir: &Path) -> Result<Self, CaError> {
        use std::os::unix::fs::DirBuilderExt;
        let err = |detail: String| CaError::Files {
            dir: dir.display().to_string(),
            detail,
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| err(e.to_string()))?;
        let (crt, key_path) = (dir.join("ca.crt"), dir.join("ca.key"));
        let key = if crt.exists() && key_path.exists() {
            let pem = std::fs::read_to_string(&key_path).map_err(|e| err(e.to_string()))?;
            rcgen::KeyPair::from_pem(&pem)?
        } else {
            let key = rcgen::KeyPair::generate()?;
            let cert = ca_params().self_signed(&key)?;
            let write = |p: &Path, d: &[u8], m| {
                crate::tls::write_private(p, d, m).map_err(|e| err(e.to_string()))
            };
            write(&key_path, key.serialize_pem().as_bytes(), 0o600)?;
            write(&crt, cert.pem().as_bytes(), 0o644)?;
            tracing::info!(dir = %dir.display(), "made the egress CA");
            key
        };
        let pem = std::fs::read_to_string(&crt).map_err(|e| err(e.to_string()))?;
        let der = rustls::pki_types::pem::PemObject::from_pem_slice(pem.as_bytes())
            .map_err(|e| err(format!("ca.crt: {e}")))?;
        let cert = ca_params().self_signed(&key)?;
        Ok(Self {
            pem,
            der,
            cert,
            key,
            provider: crate::crypto::provider(),
            leaves: Mutex::new(HashMap::new()),
        })
    }

    /// The certificate guests trust, PEM.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// A certificate for `host` (a name, or an IPv4 address), signed by
    /// the CA, with the CA after it.
    pub fn leaf(&self, host: &str) -> Result<Arc<CertifiedKey>, CaError> {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        {
            let leaves = self.leaves.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((made, ck)) = leaves.get(&host) {
                if now - made < (LEAF_DAYS - 1) * 86_400 {
                    return Ok(ck.clone());
                }
            }
        }
        let mut p = rcgen::CertificateParams::new(vec![host.clone()])?;
        p.distinguished_name.push(rcgen::DnType::CommonName, &host);
        p.not_before = time::OffsetDateTime::now_utc() - time::Duration::days(1);
        p.not_after = time::OffsetDateTime::now_utc() + time::Duration::days(LEAF_DAYS);
        p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        let key = rcgen::KeyPair::generate()?;
        let cert = p.signed_by(&key, &self.cert, &self.key)?;
        let der_key = PrivateKeyDer::try_from(key.serialize_der()).map_err(|e| CaError::Files {
            dir: "(memory)".into(),
            detail: e.to_string(),
        })?;
        let signing = self
            .provider
            .key_provider
            .load_private_key(der_key)
            .map_err(|e| CaError::Files {
                dir: "(memory)".into(),
                detail: e.to_string(),
            })?;
        let ck = Arc::new(CertifiedKey::new(
            vec![cert.der().clone(), self.der.clone()],
            signing,
        ));
        let mut leaves = self.leaves.lock().unwrap_or_else(|e| e.into_inner());
        if leaves.len() >= MAX_LEAVES {
            leaves.clear();
        }
        leaves.insert(host, (now, ck.clone()));
        Ok(ck)
    }

    /// A TLS server config that presents `host`'s certificate, HTTP/1.1
    /// only (the injecting proxy speaks HTTP/1.1 to both sides).
    pub fn server_config(&self, host: &str) -> Result<Arc<rustls::ServerConfig>, CaError> {
        let ck = self.leaf(host)?;
        let mut c = rustls::ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .expect("the default provider supports the default versions")
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(Fixed(ck)));
        c.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(c))
    }
}

#[derive(Debug)]
struct Fixed(Arc<CertifiedKey>);

impl rustls::server::ResolvesServerCert for Fixed {
    fn resolve(&self, _: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::client::danger::ServerCertVerifier;

    #[test]
    fn the_ca_is_kept_and_its_leaves_chain_to_it() {
        let dir = tempfile::tempdir().unwrap();
        let a = EgressCa::load_or_create(dir.path()).unwrap();
        let mode = |n: &str| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::metadata(dir.path().join(n))
                .unwrap()
                .permissions()
                .mode()
                & 0o777
        };
        assert_eq!((mode("ca.key"), mode("ca.crt")), (0o600, 0o644));
        let b = EgressCa::load_or_create(dir.path()).unwrap();
        assert_eq!(a.pem(), b.pem(), "kept across restarts");
        let leaf = b.leaf("API.Example.test.").unwrap();
        assert_eq!(leaf.cert.len(), 2);
        assert!(
            Arc::ptr_eq(&leaf, &b.leaf("api.example.test").unwrap()),
            "cached"
        );
        // The leaf verifies against the CA the guest trusts.
        let mut roots = rustls::RootCertStore::empty();
        roots.add(a.der.clone()).unwrap();
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            a.provider.clone(),
        )
        .build()
        .unwrap();
        let name = rustls::pki_types::ServerName::try_from("api.example.test").unwrap();
        verifier
            .verify_server_cert(
                &leaf.cert[0],
                &leaf.cert[1..],
                &name,
                &[],
                rustls::pki_types::UnixTime::now(),
            )
            .expect("the leaf chains to the CA");
        let other = rustls::pki_types::ServerName::try_from("other.test").unwrap();
        assert!(verifier
            .verify_server_cert(
                &leaf.cert[0],
                &[],
                &other,
                &[],
                rustls::pki_types::UnixTime::now()
            )
            .is_err());
    }
}
