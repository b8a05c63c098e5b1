//! `network.rules`: per-host header transforms, checked at create and
//! `update_network`, and applied by the egress proxy ([`super::inject`]).
//!
//! A rule's key is a domain (`api.example.com`, `*.example.com`), an IPv4
//! address or a CIDR; its transforms set or replace request headers.
//! Header values may carry placeholders that only the proxy resolves:
//! `${e2b.secrets.<name>}` (the team's secret, [`crate::secrets`]) and
//! `${e2b.identity.tokens.<name>}` (a workload identity token the sandbox
//! registered in `iam`, [`crate::identity`]). Any other `${e2b.…}` is refused, so a typo cannot
//! reach the destination as literal text.

use std::net::Ipv4Addr;

use tine_vmm::Net4;

use super::site::Domain;

/// Rules (hosts) one policy may hold, and headers one host may set.
pub const MAX_RULE_HOSTS: usize = 64;
pub const MAX_HEADERS: usize = 32;
/// Bytes of one header value as written (placeholders unresolved).
pub const MAX_VALUE: usize = 8192;

const SECRET: &str = "${e2b.secrets.";
const TOKEN: &str = "${e2b.identity.tokens.";

/// Headers a transform may not set: they frame or route the request.
const RESERVED: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "upgrade",
    "te",
    "trailer",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
];

/// One piece of a header value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    Secret(String),
    /// A workload identity token the sandbox registered (`iam.tokens`).
    Token(String),
}

/// A header to set, its value with placeholders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderSet {
    pub name: http::HeaderName,
    pub value: Vec<Piece>,
}

/// What a rule's key matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostMatch {
    Name(Domain),
    Net(Net4),
}

/// The transforms for one host key, in the order given (a later header of
/// the same name wins).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostRule {
    pub host: HostMatch,
    pub headers: Vec<HeaderSet>,
}

/// The rules of a policy, checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Transforms {
    pub rules: Vec<HostRule>,
}

impl Transforms {
    /// Check `network.rules` (host → list of `{"transform": {"headers":
    /// {...}}}`).
    pub fn parse(
        rules: &std::collections::BTreeMap<String, Vec<serde_json::Value>>,
    ) -> Result<Self, String> {
        if rules.len() > MAX_RULE_HOSTS {
            return Err(format!(
                "network.rules has {} hosts; at most {MAX_RULE_HOSTS} are allowed",
                rules.len()
            ));
        }
        let mut out = Vec::new();
        for (key, list) in rules {
            let host = host_match(key)?;
            let mut headers = Vec::new();
            for rule in list {
                headers.extend(rule_headers(key, rule)?);
            }
            if headers.iter().any(HeaderSet::is_sensitive) {
                check_sensitive_host(key, &host)?;
            }
            if headers.len() > MAX_HEADERS {
                return Err(format!(
                    "network.rules[{key:?}] sets {} headers; at most {MAX_HEADERS}",
                    headers.len()
                ));
            }
            if !headers.is_empty() {
                out.push(HostRule { host, headers });
            }
        }
        Ok(Self { rules: out })
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Every workload identity token a header names must be registered
    /// in the sandbox's `iam`.
    pub fn check_tokens(&self, iam: &crate::identity::Iam) -> Result<(), String> {
        for r in &self.rules {
            for h in &r.headers {
                for p in &h.value {
                    if let Piece::Token(name) = p {
                        if !iam.contains_key(name) {
                            return Err(format!(
                                "network.rules: header {} names workload identity token {name:?}, \
                                 which the sandbox's iam.tokens does not register",
                                h.name
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The headers to set on a request to `ip` for `host` (every matching
    /// rule, in order), or `None` when no rule matches.
    pub fn for_request(&self, ip: Ipv4Addr, host: Option<&str>) -> Option<Vec<&HeaderSet>> {
        let mut matched = false;
        let mut out: Vec<&HeaderSet> = Vec::new();
        for r in &self.rules {
            let hit = match &r.host {
                HostMatch::Name(d) => host.is_some_and(|h| d.matches(h)),
                HostMatch::Net(n) => n.contains(ip),
            };
            if hit {
                matched = true;
                for h in &r.headers {
                    out.retain(|o| o.name != h.name);
                    out.push(h);
                }
            }
        }
        matched.then_some(out)
    }

    /// Whether a rule by name matches `host`.
    pub fn by_name(&self, host: &str) -> bool {
        self.rules
            .iter()
            .any(|r| matches!(&r.host, HostMatch::Name(d) if d.matches(host)))
    }

    /// Whether a connection to `ip` naming `host` goes through the
    /// injecting proxy.
    pub fn intercepts(&self, ip: Ipv4Addr, host: Option<&str>) -> bool {
        self.for_request(ip, host).is_some()
    }
}

impl HeaderSet {
    /// Whether the value carries a secret or a workload identity token.
    pub fn is_sensitive(&self) -> bool {
        self.value.iter().any(|p| !matches!(p, Piece::Text(_)))
    }
}

/// A rule that carries a secret goes only to hosts it names: by address,
/// the guest would choose which site it reaches (one address serves many
/// names behind a shared front end, with valid certificates); by a
/// wildcard over a public suffix, anyone could own a matching name.
fn check_sensitive_host(key: &str, host: &HostMatch) -> Result<(), String> {
    let where_ = format!("network.rules[{key:?}]");
    match host {
        HostMatch::Net(_) => Err(format!(
            "{where_}: a rule that carries a secret or an identity token must name its host \
             (an address serves whichever site the sandbox names to it)"
        )),
        HostMatch::Name(d) => match (d.wildcard_of(), super::suffix::list()) {
            (None, _) => Ok(()),
            (Some(base), Some(list)) if !list.is_public(base) => Ok(()),
            (Some(base), Some(_)) => Err(format!(
                "{where_}: {base} is a public suffix (anyone can own a name under it): \
                 a rule that carries a secret or an identity token must name its hosts"
            )),
            (Some(_), None) => Err(format!(
                "{where_}: without the public suffix list ({}), a rule that carries a secret \
                 or an identity token must name its host exactly",
                super::suffix::DEFAULT_LIST
            )),
        },
    }
}

fn host_match(key: &str) -> Result<HostMatch, String> {
    let k = key.trim();
    let numeric = !k.is_empty()
        && k.bytes()
            .all(|b| b.is_ascii_digit() || b == b'.' || b == b'/');
    if numeric {
        return Net4::parse(k)
            .map(HostMatch::Net)
            .ok_or_else(|| format!("network.rules: {key:?} is not a valid IPv4 address or CIDR"));
    }
    Domain::parse(k).map(HostMatch::Name).ok_or_else(|| {
        format!("network.rules: {key:?} is not a domain name, an IPv4 address or a CIDR")
    })
}

fn rule_headers(key: &str, rule: &serde_json::Value) -> Result<Vec<HeaderSet>, String> {
    let where_ = format!("network.rules[{key:?}]");
    let obj = rule
        .as_object()
        .ok_or_else(|| format!("{where_}: each rule is an object"))?;
    if let Some(k) = obj.keys().find(|k| k.as_str() != "transform") {
        return Err(format!(
            "{where_}: unknown rule field {k:?} (tine knows \"transform\")"
        ));
    }
    let Some(t) = obj.get("transform").filter(|t| !t.is_null()) else {
        return Ok(Vec::new());
    };
    let t = t
        .as_object()
        .ok_or_else(|| format!("{where_}.transform must be an object"))?;
    if let Some(k) = t.keys().find(|k| k.as_str() != "headers") {
        return Err(format!(
            "{where_}.transform: {k:?} is not supported (tine transforms headers)"
        ));
    }
    let Some(h) = t.get("headers").filter(|h| !h.is_null()) else {
        return Ok(Vec::new());
    };
    let h = h
        .as_object()
        .ok_or_else(|| format!("{where_}.transform.headers must map names to strings"))?;
    let mut out = Vec::new();
    for (name, value) in h {
        let value = value
            .as_str()
            .ok_or_else(|| format!("{where_}.transform.headers[{name:?}] must be a string"))?;
        if name.contains("${") {
            return Err(format!(
                "{where_}: header name {name:?}: placeholders go in header values only"
            ));
        }
        let hn = http::HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("{where_}: {name:?} is not a valid header name"))?;
        if RESERVED.contains(&hn.as_str()) {
            return Err(format!(
                "{where_}: header {name:?} frames or routes the request; a transform cannot set it"
            ));
        }
        out.push(HeaderSet {
            name: hn,
            value: parse_value(&format!("{where_}.transform.headers[{name:?}]"), value)?,
        });
    }
    Ok(out)
}

/// Split a header value into text and placeholders.
pub fn parse_value(where_: &str, value: &str) -> Result<Vec<Piece>, String> {
    if value.len() > MAX_VALUE {
        return Err(format!(
            "{where_}: {} bytes; at most {MAX_VALUE}",
            value.len()
        ));
    }
    if value.chars().any(|c| c.is_control() && c != '\t') {
        return Err(format!(
            "{where_}: control characters cannot be in a header"
        ));
    }
    let mut out = Vec::new();
    let mut rest = value;
    while let Some(at) = rest.find("${e2b.") {
        if at > 0 {
            out.push(Piece::Text(rest[..at].to_string()));
        }
        let tail = &rest[at..];
        let end = tail
            .find('}')
            .ok_or_else(|| format!("{where_}: a placeholder is not closed with '}}'"))?;
        let inner = &tail[..end];
        if let Some(name) = inner.strip_prefix(SECRET) {
            if !crate::secrets::valid_name(name) || name.contains('$') {
                return Err(format!(
                    "{where_}: {:?} does not name a secret",
                    &tail[..=end]
                ));
            }
            out.push(Piece::Secret(name.to_string()));
        } else if let Some(name) = inner.strip_prefix(TOKEN) {
            if !crate::secrets::valid_name(name) || name.contains('$') {
                return Err(format!(
                    "{where_}: {:?} does not name a token",
                    &tail[..=end]
                ));
            }
            out.push(Piece::Token(name.to_string()));
        } else {
            return Err(format!(
                "{where_}: unknown placeholder {:?} (tine resolves ${{e2b.secrets.<name>}})",
                &tail[..=end]
            ));
        }
        rest = &tail[end + 1..];
    }
    if !rest.is_empty() {
        out.push(Piece::Text(rest.to_string()));
    }
    Ok(out)
}

/// Whether `s` carries a secret placeholder (refused where it would reach
/// the guest: env vars, metadata, commands' environments).
pub fn has_placeholder(s: &str) -> bool {
    s.contains(SECRET)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rules(v: serde_json::Value) -> Result<Transforms, String> {
        let m: std::collections::BTreeMap<String, Vec<serde_json::Value>> =
            serde_json::from_value(v).unwrap();
        Transforms::parse(&m)
    }

    #[test]
    fn placeholders_split_and_rules_match_by_name_or_address() {
        let t = rules(json!({
            "api.test": [
                {"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.key-1}"}}},
                {"transform": {"headers": {"authorization": "Token ${e2b.secrets.k2}!", "X-A": "${HOME}"}}}
            ],
            "203.0.113.0/24": [{"transform": {"headers": {"X-Net": "n"}}}],
            "*.pkg.test": [{}]
        }))
        .unwrap();
        let ip = Ipv4Addr::new(198, 51, 100, 1);
        let got = t.for_request(ip, Some("API.test")).unwrap();
        assert_eq!(
            got.len(),
            2,
            "a later rule's header replaces an earlier one"
        );
        let by = |n: &str| got.iter().find(|h| h.name.as_str() == n).unwrap();
        assert_eq!(
            by("authorization").value,
            vec![
                Piece::Text("Token ".into()),
                Piece::Secret("k2".into()),
                Piece::Text("!".into())
            ]
        );
        assert_eq!(by("x-a").value, vec![Piece::Text("${HOME}".into())]);
        assert!(t.for_request(ip, Some("other.test")).is_none());
        assert!(
            t.for_request(ip, Some("a.pkg.test")).is_none(),
            "no transform, no rule"
        );
        let net = t.for_request(Ipv4Addr::new(203, 0, 113, 9), None).unwrap();
        assert_eq!(net[0].name.as_str(), "x-net");
    }

    #[test]
    fn bad_rules_are_refused_with_a_message() {
        let err = |v| rules(v).unwrap_err();
        let h = |k: &str, v: &str| json!({ "api.test": [{"transform": {"headers": {k: v}}}] });
        assert!(err(json!({"not a domain!": []})).contains("not a domain"));
        assert!(err(json!({"10.0.0.0/40": []})).contains("IPv4"));
        assert!(err(h("Host", "x")).contains("cannot set"));
        assert!(err(h("Bad Name", "x")).contains("valid header name"));
        assert!(err(h("X-${e2b.secrets.a}", "x")).contains("values only"));
        assert!(err(h("X", "a\r\nb")).contains("control"));
        assert!(err(h("X", "${e2b.secrets.a")).contains("not closed"));
        assert!(err(h("X", "${e2b.secrets.}")).contains("does not name"));
        assert!(err(h("X", "${e2b.secret.a}")).contains("unknown placeholder"));
        assert!(err(h("X", "${e2b.identity.tokens.}")).contains("does not name a token"));
        let t = rules(h("X", "Bearer ${e2b.identity.tokens.aws}")).unwrap();
        assert!(t
            .check_tokens(&Default::default())
            .unwrap_err()
            .contains("does not register"));
        let iam = crate::identity::parse_iam(
            &json!({"tokens": {"aws": {"audience": "a", "tokenType": "JWT-SVID"}}}),
        )
        .unwrap();
        t.check_tokens(&iam).unwrap();
        assert!(err(json!({"api.test": [{"transform": {"body": "x"}}]})).contains("not supported"));
        assert!(err(json!({"api.test": [{"match": 1}]})).contains("unknown rule field"));
        assert!(has_placeholder("x ${e2b.secrets.a}"));
        assert!(!has_placeholder("${HOME}"));
    }

    /// The attack: a secret keyed by an address (or every address), or by
    /// a wildcard over a public suffix, reaches whatever site the guest
    /// names there. Plain headers may still go by address.
    #[test]
    fn a_secret_goes_only_to_hosts_it_names() {
        let secret = |host: &str| {
            rules(
                json!({ host: [{"transform": {"headers": {"Authorization": "${e2b.secrets.k}"}}}] }),
            )
        };
        for host in ["0.0.0.0/0", "203.0.113.7", "10.0.0.0/8"] {
            let e = secret(host).unwrap_err();
            assert!(e.contains(host) && e.contains("must name its host"), "{e}");
        }
        let e = rules(
            json!({"1.2.3.4": [{"transform": {"headers": {"X": "${e2b.identity.tokens.t}"}}}]}),
        )
        .unwrap_err();
        assert!(e.contains("identity token"), "{e}");
        for host in ["*.vercel.app", "*.com", "*.github.io"] {
            let e = secret(host).unwrap_err();
            assert!(e.contains("public suffix") && e.contains(&host[2..]), "{e}");
        }
        secret("api.example.com").unwrap();
        secret("*.internal.example.com").unwrap();
        secret("*.myapp.vercel.app").unwrap();
        rules(json!({"0.0.0.0/0": [{"transform": {"headers": {"X-Plain": "p"}}}]})).unwrap();
    }
}
