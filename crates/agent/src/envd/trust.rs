//! `/init`'s `trustCa` (a tine extension): the host's egress CA joins the
//! guest's trust stores, so HTTPS whose headers the host's proxy sets
//! (secrets in `network.rules`) verifies in the guest's programs.
//!
//! - the certificate goes to `/usr/local/share/ca-certificates/`, where
//!   Debian's `update-ca-certificates` keeps it in any bundle it rebuilds;
//! - it is appended to each system bundle that exists (Debian/Alpine,
//!   Fedora/RHEL, BSD-style paths), once;
//! - processes get `SSL_CERT_FILE` and `REQUESTS_CA_BUNDLE` (OpenSSL,
//!   Python's `ssl`, requests, httpx: certifi's own bundle is bypassed)
//!   and `NODE_EXTRA_CA_CERTS` (Node), unless `/init` set them.
//!
//! A guest that has it already (restored from a capture) is left as is:
//! one small file is read.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Where the certificate is kept in the guest.
pub const OWN: &str = "/usr/local/share/ca-certificates/tine-egress-ca.crt";
/// System bundles, in order of preference for `SSL_CERT_FILE`.
const BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
];

/// Install `pem` (once); returns the environment programs need to use it.
pub fn install(pem: &str) -> std::io::Result<BTreeMap<String, String>> {
    install_at(pem, Path::new("/"))
}

fn at(root: &Path, p: &str) -> PathBuf {
    root.join(p.trim_start_matches('/'))
}

fn install_at(pem: &str, root: &Path) -> std::io::Result<BTreeMap<String, String>> {
    let pem = pem.trim();
    if !pem.starts_with("-----BEGIN CERTIFICATE-----")
        || !pem.ends_with("-----END CERTIFICATE-----")
    {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "trustCa is not a PEM certificate",
        ));
    }
    let own = at(root, OWN);
    let fresh = std::fs::read_to_string(&own).map_or(true, |old| old.trim() != pem);
    if fresh {
        std::fs::create_dir_all(own.parent().expect("OWN has a parent"))?;
        std::fs::write(&own, format!("{pem}\n"))?;
    }
    let mut seen = Vec::new();
    let mut first = None;
    for b in BUNDLES {
        let Ok(real) = std::fs::canonicalize(at(root, b)) else {
            continue;
        };
        if seen.contains(&real) {
            continue;
        }
        seen.push(real.clone());
        first.get_or_insert_with(|| b.to_string());
        // Installed already (the file above matched): bundles are not read.
        if !fresh {
            continue;
        }
        let has = std::fs::read_to_string(&real).is_ok_and(|t| t.contains(pem));
        if !has {
            let mut f = std::fs::OpenOptions::new().append(true).open(&real)?;
            f.write_all(format!("\n# tine egress CA\n{pem}\n").as_bytes())?;
        }
    }
    let bundle = first.unwrap_or_else(|| OWN.to_string());
    Ok(BTreeMap::from([
        ("SSL_CERT_FILE".to_string(), bundle.clone()),
        ("REQUESTS_CA_BUNDLE".to_string(), bundle),
        ("NODE_EXTRA_CA_CERTS".to_string(), OWN.to_string()),
    ]))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----";

    #[test]
    fn installs_once_into_every_bundle_and_names_them() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        std::fs::create_dir_all(r.join("etc/ssl/certs")).unwrap();
        std::fs::write(r.join("etc/ssl/certs/ca-certificates.crt"), "SYSTEM\n").unwrap();
        std::os::unix::fs::symlink(
            r.join("etc/ssl/certs/ca-certificates.crt"),
            r.join("etc/ssl/cert.pem"),
        )
        .unwrap();
        let env = install_at(PEM, r).unwrap();
        install_at(PEM, r).unwrap();
        let bundle = std::fs::read_to_string(r.join("etc/ssl/certs/ca-certificates.crt")).unwrap();
        assert!(bundle.starts_with("SYSTEM\n"));
        assert_eq!(
            bundle.matches("BEGIN CERTIFICATE").count(),
            1,
            "once, symlink or not"
        );
        assert_eq!(std::fs::read_to_string(at(r, OWN)).unwrap().trim(), PEM);
        assert_eq!(env["SSL_CERT_FILE"], "/etc/ssl/certs/ca-certificates.crt");
        assert_eq!(env["NODE_EXTRA_CA_CERTS"], OWN);
        assert!(install_at("not a certificate", r).is_err());
    }
}
