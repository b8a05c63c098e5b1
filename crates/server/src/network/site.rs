//! The names a sandbox's network policy is made of and that the egress
//! proxy and the header transforms also use: a domain pattern, and what
//! the operator set for every sandbox.

use std::net::Ipv4Addr;

use tine_vmm::Net4;

/// A domain pattern: `example.com`, or `*.example.com` for its subdomains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Domain {
    name: String,
    wildcard: bool,
}

impl Domain {
    pub(super) fn parse(s: &str) -> Option<Domain> {
        let s = s.trim_end_matches('.').to_ascii_lowercase();
        let (wildcard, name) = match s.strip_prefix("*.") {
            Some(rest) => (true, rest.to_string()),
            None => (false, s),
        };
        let ok_label = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        if name.is_empty() || name.len() > 253 || !name.split('.').all(ok_label) {
            return None;
        }
        Some(Domain { name, wildcard })
    }

    /// `*.example.com`: `Some("example.com")`.
    pub fn wildcard_of(&self) -> Option<&str> {
        self.wildcard.then_some(self.name.as_str())
    }

    pub fn matches(&self, host: &str) -> bool {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        if self.wildcard {
            host.len() > self.name.len()
                && host.ends_with(&self.name)
                && host.as_bytes()[host.len() - self.name.len() - 1] == b'.'
        } else {
            host == self.name
        }
    }
}

/// What the operator set for every sandbox.
#[derive(Debug, Clone, Default)]
pub struct Site {
    /// Not-internet ranges sandboxes may reach anyway.
    pub opened: Vec<Net4>,
    /// Where the gateway's DNS goes (`None`: no resolver known).
    pub resolver: Option<Ipv4Addr>,
}

impl Site {
    /// Not on the internet, and not opened by the operator.
    pub fn is_blocked(&self, ip: Ipv4Addr) -> bool {
        self.blocked(ip)
    }

    pub(super) fn blocked(&self, ip: Ipv4Addr) -> bool {
        tine_vmm::firewall::NOT_INTERNET
            .iter()
            .any(|n| n.contains(ip))
            && !self.opened.iter().any(|n| n.contains(ip))
    }
}
