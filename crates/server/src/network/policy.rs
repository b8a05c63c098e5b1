//! A sandbox's network policy as the E2B API states it, checked and
//! compiled into the firewall's terms ([`tine_vmm::EgressRules`]) and the
//! egress proxy's decision ([`Compiled::allows`]).
//!
//! Semantics (the SDK's, `e2b/sandbox/sandbox_api.py`):
//! - with no `allowOut`/`denyOut` everything on the internet is allowed;
//! - an entry is an IPv4 address, a CIDR or a domain name (`*.` matches
//!   every subdomain); `allowOut` wins over `denyOut`;
//! - a domain is matched by name (TLS SNI, HTTP Host) on ports 80 and 443,
//!   never by resolving it, so a raw IP does not pass a domain rule;
//! - `dnsServers` opens those IPs when `allowOut` names a domain;
//! - `allow_internet_access = false` is `denyOut: ["0.0.0.0/0"]`.
//!
//! On top of that, and before any of it, the ranges that are not the
//! internet (private, loopback, link-local, multicast…) stay closed unless
//! the operator opened them ([`crate::config::NetworkConfig`]).

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddrV4};

use serde::{Deserialize, Serialize};
use tine_vmm::{EgressRules, Net4};

use super::site::{Domain, Site};
use super::transform::Transforms;
use super::tunnel::EgressProxyConfig;

/// Entries one list (`allowOut`, `denyOut`) may hold.
pub const MAX_ENTRIES: usize = 256;
/// `dnsServers` entries (the SDK documents 10).
pub const MAX_DNS_SERVERS: usize = 10;
/// `httpsPorts` entries.
pub const MAX_HTTPS_PORTS: usize = 64;
/// What `allow_internet_access = false` adds to `denyOut`.
pub const ALL_TRAFFIC: &str = "0.0.0.0/0";

/// The policy as stored with the sandbox and shown as `network` by
/// `GET /sandboxes/{id}` (E2B's `SandboxNetworkConfig`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicy {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_out: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deny_out: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns_servers: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_public_traffic: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask_request_host: Option<String>,
    /// Per-host rules: header transforms (`super::transform`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rules: Option<BTreeMap<String, Vec<serde_json::Value>>>,
    /// Sandbox ports that serve TLS themselves: the proxy speaks HTTPS to
    /// them (without verifying their certificates).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub https_ports: Option<Vec<u16>>,
    /// A SOCKS5 proxy all outbound TCP goes through (`super::tunnel`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_proxy: Option<EgressProxyConfig>,
}

impl NetworkPolicy {
    /// The policy as the API shows it: the proxy without its password or
    /// CA.
    pub fn shown(&self) -> Self {
        Self {
            egress_proxy: self.egress_proxy.as_ref().map(EgressProxyConfig::shown),
            ..self.clone()
        }
    }
}

/// One list, split into addresses and names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector {
    pub nets: Vec<Net4>,
    pub domains: Vec<Domain>,
}

impl Selector {
    fn parse(field: &str, entries: &[String]) -> Result<Selector, String> {
        if entries.len() > MAX_ENTRIES {
            return Err(format!(
                "network.{field} has {} entries; at most {MAX_ENTRIES} are allowed",
                entries.len()
            ));
        }
        let mut out = Selector::default();
        for e in entries {
            let t = e.trim();
            if t.is_empty() {
                return Err(format!("network.{field} has an empty entry"));
            }
            let looks_numeric = t
                .bytes()
                .all(|b| b.is_ascii_digit() || b == b'.' || b == b'/');
            if t.contains(':') {
                return Err(format!(
                    "network.{field}: {t:?}: IPv6 addresses are not supported (sandboxes have IPv4 only)"
                ));
            } else if looks_numeric || t.contains('/') {
                out.nets.push(Net4::parse(t).ok_or_else(|| {
                    format!("network.{field}: {t:?} is not a valid IPv4 address or CIDR")
                })?);
            } else {
                out.domains.push(
                    Domain::parse(t).ok_or_else(|| {
                        format!("network.{field}: {t:?} is not a valid domain name")
                    })?,
                );
            }
        }
        Ok(out)
    }

    fn has_ip(&self, ip: Ipv4Addr) -> bool {
        self.nets.iter().any(|n| n.contains(ip))
    }

    fn has_name(&self, name: Option<&str>) -> bool {
        name.is_some_and(|n| self.domains.iter().any(|d| d.matches(n)))
    }
}

/// A checked policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compiled {
    pub allow: Selector,
    pub deny: Selector,
    pub dns_servers: Option<Vec<Ipv4Addr>>,
    /// Header transforms of `rules`, applied by the injecting proxy.
    pub transforms: Transforms,
    /// Where outbound TCP is tunnelled (checked).
    pub egress_proxy: Option<EgressProxyConfig>,
}

impl NetworkPolicy {
    /// The policy of a create or update request. `allow_internet_access =
    /// false` becomes `0.0.0.0/0` in `denyOut`.
    pub fn from_request(
        mut self,
        allow_internet_access: Option<bool>,
    ) -> Result<(NetworkPolicy, Compiled), String> {
        if allow_internet_access == Some(false) {
            let deny = self.deny_out.get_or_insert_with(Vec::new);
            if !deny.iter().any(|d| d == ALL_TRAFFIC) {
                deny.push(ALL_TRAFFIC.to_string());
            }
        }
        let compiled = self.compile()?;
        Ok((self, compiled))
    }

    /// Check every field.
    pub fn compile(&self) -> Result<Compiled, String> {
        let allow = Selector::parse("allow_out", self.allow_out.as_deref().unwrap_or(&[]))?;
        let deny = Selector::parse("deny_out", self.deny_out.as_deref().unwrap_or(&[]))?;
        let dns_servers = match &self.dns_servers {
            None => None,
            Some(list) if list.len() > MAX_DNS_SERVERS => {
                return Err(format!(
                    "network.dns_servers has {} entries; at most {MAX_DNS_SERVERS} are allowed",
                    list.len()
                ))
            }
            Some(list) => Some(
                list.iter()
                    .map(|s| {
                        s.trim().parse::<Ipv4Addr>().map_err(|_| {
                            format!("network.dns_servers: {s:?} is not an IPv4 address")
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
        };
        let transforms = match &self.rules {
            Some(rules) => Transforms::parse(rules)?,
            None => Transforms::default(),
        };
        if let Some(ports) = &self.https_ports {
            if ports.len() > MAX_HTTPS_PORTS || ports.contains(&0) {
                return Err(format!(
                    "network.https_ports takes at most {MAX_HTTPS_PORTS} ports, each 1-65535"
                ));
            }
        }
        if let Some(mask) = &self.mask_request_host {
            if mask.is_empty() || mask.len() > 253 || mask.chars().any(|c| c.is_control()) {
                return Err(
                    "network.mask_request_host must be a host name of at most 253 characters"
                        .into(),
                );
            }
        }
        if let Some(p) = &self.egress_proxy {
            p.check()?;
        }
        Ok(Compiled {
            allow,
            deny,
            dns_servers,
            transforms,
            egress_proxy: self.egress_proxy.clone(),
        })
    }

    /// Every workload identity token the rules name is in `iam`.
    pub fn check_tokens(&self, iam: &crate::identity::Iam) -> Result<(), String> {
        self.compile()?.transforms.check_tokens(iam)
    }

    /// Whether `get_host` traffic needs the traffic access token.
    pub fn private_traffic(&self) -> bool {
        self.allow_public_traffic == Some(false)
    }
}

/// Port of the gateway the egress proxy listens on.
pub const PROXY_PORT: u16 = 15080;

impl Compiled {
    /// Whether any rule is by name, or any request is transformed (then
    /// ports 80/443 go to the proxy).
    pub fn by_name(&self) -> bool {
        !self.allow.domains.is_empty()
            || !self.deny.domains.is_empty()
            || !self.transforms.is_empty()
            || self.egress_proxy.is_some()
    }

    /// The egress proxy's decision for a connection to `ip` naming `name`.
    pub fn allows(&self, site: &Site, ip: Ipv4Addr, name: Option<&str>) -> bool {
        if site.blocked(ip) {
            return false;
        }
        if self.allow.has_ip(ip) || self.allow.has_name(name) {
            return true;
        }
        !(self.deny.has_ip(ip) || self.deny.has_name(name))
    }

    /// The firewall of a sandbox with this policy.
    pub fn rules(&self, site: &Site) -> EgressRules {
        let mut allow = self.allow.nets.clone();
        let names_allowed = !self.allow.domains.is_empty();
        if names_allowed {
            allow.extend(
                self.dns_servers
                    .iter()
                    .flatten()
                    .map(|ip| Net4::new(*ip, 32)),
            );
        }
        // The gateway's resolver: reachable when the policy lets its address
        // out, or (E2B's default nameserver) when names are allowed and no
        // servers were named.
        let resolver = site.resolver.filter(|r| {
            let by_ip = self.allow.has_ip(*r) || !self.deny.has_ip(*r);
            by_ip || (names_allowed && self.dns_servers.is_none())
        });
        EgressRules {
            blocked: tine_vmm::firewall::NOT_INTERNET.to_vec(),
            opened: site.opened.clone(),
            allow,
            deny: self.deny.nets.clone(),
            resolver: resolver.map(|r| SocketAddrV4::new(r, 53)),
            proxy_port: self.by_name().then_some(PROXY_PORT),
            tunnel_all: self.egress_proxy.is_some(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(allow: &[&str], deny: &[&str]) -> NetworkPolicy {
        NetworkPolicy {
            allow_out: Some(allow.iter().map(|s| s.to_string()).collect()),
            deny_out: Some(deny.iter().map(|s| s.to_string()).collect()),
            ..Default::default()
        }
    }

    fn site() -> Site {
        Site {
            opened: vec![Net4::parse("10.99.1.0/24").unwrap()],
            resolver: Some(Ipv4Addr::new(10, 255, 255, 53)),
        }
    }

    const INET: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);

    #[test]
    fn default_policy_opens_the_internet_only() {
        let c = NetworkPolicy::default().compile().unwrap();
        let s = site();
        assert!(c.allows(&s, INET, None));
        assert!(!c.allows(&s, Ipv4Addr::new(10, 99, 0, 10), None));
        assert!(
            c.allows(&s, Ipv4Addr::new(10, 99, 1, 10), None),
            "opened by the operator"
        );
        assert!(!c.allows(&s, Ipv4Addr::new(169, 254, 169, 254), None));
        assert!(!c.allows(&s, Ipv4Addr::new(127, 0, 0, 1), None));
        let r = c.rules(&s);
        assert!(r.deny.is_empty() && r.allow.is_empty());
        assert_eq!(r.resolver, Some("10.255.255.53:53".parse().unwrap()));
        assert_eq!(r.proxy_port, None);
    }

    #[test]
    fn allow_wins_over_deny_but_not_over_blocked_ranges() {
        let c = policy(&["203.0.113.10", "10.99.0.10"], &[ALL_TRAFFIC])
            .compile()
            .unwrap();
        let s = site();
        assert!(c.allows(&s, INET, None));
        assert!(!c.allows(&s, Ipv4Addr::new(203, 0, 113, 11), None));
        assert!(!c.allows(&s, Ipv4Addr::new(10, 99, 0, 10), None));
        assert_eq!(c.rules(&s).resolver, None, "DNS is denied with everything");
    }

    #[test]
    fn domains_match_by_name_not_by_address() {
        let c = policy(&["example.test", "*.pkg.test"], &[ALL_TRAFFIC])
            .compile()
            .unwrap();
        let s = site();
        assert!(c.allows(&s, INET, Some("example.test")));
        assert!(c.allows(&s, INET, Some("EXAMPLE.test.")));
        assert!(c.allows(&s, INET, Some("a.b.pkg.test")));
        assert!(!c.allows(&s, INET, Some("pkg.test")));
        assert!(!c.allows(&s, INET, Some("other.test")));
        assert!(
            !c.allows(&s, INET, None),
            "a raw IP does not pass a domain rule"
        );
        assert!(!c.allows(&s, Ipv4Addr::new(10, 99, 0, 10), Some("example.test")));
        let r = c.rules(&s);
        assert_eq!(r.proxy_port, Some(PROXY_PORT));
        assert!(
            r.resolver.is_some(),
            "names allowed: the default nameserver is open"
        );
    }

    #[test]
    fn dns_servers_open_their_addresses_when_names_are_allowed() {
        let mut p = policy(&["example.test"], &[ALL_TRAFFIC]);
        p.dns_servers = Some(vec!["1.1.1.1".into()]);
        let r = p.compile().unwrap().rules(&site());
        assert!(r.allow.contains(&Net4::parse("1.1.1.1").unwrap()));
        assert_eq!(r.resolver, None, "named servers replace the gateway's");
    }

    #[test]
    fn internet_access_false_denies_all_traffic() {
        let (p, c) = NetworkPolicy::default().from_request(Some(false)).unwrap();
        assert_eq!(p.deny_out.as_deref(), Some(&[ALL_TRAFFIC.to_string()][..]));
        assert!(!c.allows(&site(), INET, None));
    }

    #[test]
    fn bad_input_is_refused_with_a_message() {
        let err = |p: NetworkPolicy| p.compile().unwrap_err();
        assert!(err(policy(&["10.0.0.0/33"], &[])).contains("not a valid IPv4"));
        assert!(err(policy(&["300.1.1.1"], &[])).contains("not a valid IPv4"));
        assert!(err(policy(&[""], &[])).contains("empty entry"));
        assert!(err(policy(&["bad domain"], &[])).contains("not a valid domain"));
        assert!(err(policy(&["::1"], &[])).contains("IPv6"));
        let many: Vec<String> = (0..=MAX_ENTRIES)
            .map(|i| format!("1.2.{}.{}", i / 256, i % 256))
            .collect();
        let refs: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(err(policy(&[], &refs)).contains("at most"));
        let p = NetworkPolicy {
            rules: Some(BTreeMap::from([(
                "api test".to_string(),
                vec![serde_json::json!({"transform": {"headers": {"a": "b"}}})],
            )])),
            ..Default::default()
        };
        assert!(err(p).contains("not a domain"));
        let p = NetworkPolicy {
            https_ports: Some(vec![0]),
            ..Default::default()
        };
        assert!(err(p).contains("https_ports"));
        let p: NetworkPolicy =
            serde_json::from_value(serde_json::json!({"egressProxy": {"address": "p"}})).unwrap();
        assert!(err(p).contains("host:port"));
        let p: NetworkPolicy = serde_json::from_value(serde_json::json!({
            "egressProxy": {"address": "p:1080", "username": "u", "password": "secret"}
        }))
        .unwrap();
        let c = p.compile().unwrap();
        assert!(c.by_name() && c.rules(&site()).tunnel_all);
        assert!(!serde_json::to_string(&p.shown())
            .unwrap()
            .contains("secret"));
    }
}
