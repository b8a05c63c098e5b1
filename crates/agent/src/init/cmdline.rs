//! `tine.*` parameters from the kernel command line.
//!
//! The host passes the guest its configuration this way (`tine.ip=`,
//! `tine.gw=`, `tine.hostname=`, `tine.root=`); words with a dot are kernel
//! module parameters to the kernel, so they never reach init as arguments.

use std::collections::HashMap;

#[derive(Debug, Default)]
pub struct Cmdline {
    params: HashMap<String, String>,
}

impl Cmdline {
    pub fn read() -> std::io::Result<Self> {
        Ok(Self::parse(&std::fs::read_to_string("/proc/cmdline")?))
    }

    pub fn parse(line: &str) -> Self {
        let params = line
            .split_whitespace()
            .filter_map(|w| w.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Self { params }
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.params.get(key).map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_key_values_and_ignores_flags() {
        let c = Cmdline::parse("console=ttyS0 quiet tine.ip=10.0.0.2/24 tine.gw=10.0.0.1\n");
        assert_eq!(c.get("tine.ip"), Some("10.0.0.2/24"));
        assert_eq!(c.get("tine.gw"), Some("10.0.0.1"));
        assert_eq!(c.get("console"), Some("ttyS0"));
        assert_eq!(c.get("quiet"), None);
        assert_eq!(c.get("tine.hostname"), None);
    }
}
