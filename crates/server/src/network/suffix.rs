//! The public suffix list (<https://publicsuffix.org>): names under which
//! anyone may register a name of their own (`com`, `co.uk`, `vercel.app`,
//! `github.io`). A header transform that carries a secret may not match
//! `*.<public suffix>`: every site under it would get the secret.
//!
//! Read from Debian's `publicsuffix` package (installed by
//! scripts/setup-host.sh and the container image) at its first use. The
//! format is the list's own: one rule a line, `*.` for every name one
//! label below, `!` for an exception to such a rule, `//` comments.

use std::collections::HashSet;
use std::sync::OnceLock;

/// Where Debian's `publicsuffix` package puts the list.
pub const DEFAULT_LIST: &str = "/usr/share/publicsuffix/public_suffix_list.dat";

#[derive(Debug, Default)]
pub struct Suffixes {
    rules: HashSet<String>,
    /// `*.ck` is kept as `ck`.
    wildcards: HashSet<String>,
    /// `!www.ck` is kept as `www.ck`.
    exceptions: HashSet<String>,
}

impl Suffixes {
    pub fn parse(text: &str) -> Self {
        let mut s = Suffixes::default();
        for line in text.lines() {
            // A rule is the first word of its line.
            let Some(rule) = line.split_whitespace().next() else {
                continue;
            };
            if rule.starts_with("//") {
                continue;
            }
            let rule = rule.to_ascii_lowercase();
            if let Some(r) = rule.strip_prefix('!') {
                s.exceptions.insert(r.to_string());
            } else if let Some(r) = rule.strip_prefix("*.") {
                s.wildcards.insert(r.to_string());
            } else {
                s.rules.insert(rule);
            }
        }
        s
    }

    /// Whether `name` is a public suffix. A single label is (a top-level
    /// domain, listed or not).
    pub fn is_public(&self, name: &str) -> bool {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        if self.exceptions.contains(&name) {
            return false;
        }
        if self.rules.contains(&name) || !name.contains('.') {
            return true;
        }
        name.split_once('.')
            .is_some_and(|(_, parent)| self.wildcards.contains(parent))
    }

    pub fn len(&self) -> usize {
        self.rules.len() + self.wildcards.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The list at [`DEFAULT_LIST`], read once; `None` when it cannot be read
/// (then no wildcard carries a secret: tine cannot tell which are safe).
pub fn list() -> Option<&'static Suffixes> {
    static LIST: OnceLock<Option<Suffixes>> = OnceLock::new();
    LIST.get_or_init(|| match std::fs::read_to_string(DEFAULT_LIST) {
        Ok(text) => Some(Suffixes::parse(&text)).filter(|s| !s.is_empty()),
        Err(e) => {
            tracing::warn!(
                "the public suffix list {DEFAULT_LIST} cannot be read ({e}): \
                 header transforms with secrets must name their hosts exactly"
            );
            None
        }
    })
    .as_ref()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIST: &str =
        "// comment\ncom\nco.uk\n*.ck\n!www.ck\n// ===BEGIN PRIVATE===\nvercel.app\n";

    #[test]
    fn suffixes_rules_wildcards_and_exceptions() {
        let s = Suffixes::parse(LIST);
        for public in [
            "com",
            "co.uk",
            "vercel.app",
            "anything.ck",
            "VERCEL.app.",
            "org",
        ] {
            assert!(s.is_public(public), "{public}");
        }
        for private in [
            "example.com",
            "foo.vercel.app",
            "www.ck",
            "a.b.ck",
            "bbc.co.uk",
        ] {
            assert!(!s.is_public(private), "{private}");
        }
    }

    /// (scripts/setup-host.sh installs Debian's `publicsuffix`.)
    #[test]
    fn the_hosts_list() {
        let s = list().expect("the public suffix list is installed");
        assert!(s.is_public("github.io") && s.is_public("com") && s.is_public("vercel.app"));
        assert!(!s.is_public("api.openai.com"));
    }
}
