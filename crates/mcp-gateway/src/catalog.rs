//! The MCP servers this template can run: E2B's catalog keys whose servers
//! need no outside account and are installed into the template at build
//! time (crates/mcp-gateway/template). A config naming anything else is
//! refused before anything starts.

use serde_json::{Map, Value};

/// Where the template's recipe installs the servers (overridable for tests).
pub fn servers_dir() -> String {
    std::env::var("MCP_GATEWAY_SERVERS_DIR").unwrap_or_else(|_| "/opt/mcp-gateway".into())
}

/// The memory server's knowledge graph.
pub const MEMORY_FILE: &str = "/var/lib/mcp-gateway/memory.jsonl";

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("the config is not a JSON object: {0}")]
    NotJson(String),
    #[error("unknown or unsupported MCP server {name:?} (this template has: {have})")]
    Unsupported { name: String, have: String },
    #[error("MCP server {server:?}: {msg}")]
    Param { server: String, msg: String },
}

/// One catalog entry: the key of E2B's config, what it runs, its parameters.
pub struct Entry {
    pub key: &'static str,
    pub package: &'static str,
    pub params: &'static str,
    launch: fn(&str, &Map<String, Value>) -> Result<Launch, String>,
}

/// How to start one server as a stdio child.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    pub name: String,
    pub program: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
}

pub const CATALOG: &[Entry] = &[
    Entry {
        key: "fetch",
        package: "mcp-server-fetch==2026.10.24 (PyPI)",
        params: "none",
        launch: fetch,
    },
    Entry {
        key: "filesystem",
        package: "@modelcontextprotocol/server-filesystem@2026.8.31 (npm)",
        params: "paths: [dir, ...] (required)",
        launch: filesystem,
    },
    Entry {
        key: "git",
        package: "mcp-server-git==2026.10.19 (PyPI)",
        params: "paths: [repo] (one repository, optional)",
        launch: git,
    },
    Entry {
        key: "memory",
        package: "@modelcontextprotocol/server-memory@2026.8.31 (npm)",
        params: "none",
        launch: memory,
    },
    Entry {
        key: "sequentialthinking",
        package: "@modelcontextprotocol/server-sequential-thinking@2026.8.31 (npm)",
        params: "none",
        launch: sequentialthinking,
    },
    Entry {
        key: "time",
        package: "mcp-server-time==2026.10.19 (PyPI)",
        params: "localTimezone (optional, default UTC)",
        launch: time,
    },
];

pub fn names() -> String {
    CATALOG.iter().map(|e| e.key).collect::<Vec<_>>().join(", ")
}

pub fn find(name: &str) -> Result<&'static Entry, ConfigError> {
    CATALOG
        .iter()
        .find(|e| e.key == name)
        .ok_or_else(|| ConfigError::Unsupported {
            name: name.to_string(),
            have: names(),
        })
}

/// The servers a config (E2B's `mcp` object) asks for, in key order; the
/// first unknown key or bad parameter is the error.
pub fn resolve(config: &str) -> Result<Vec<Launch>, ConfigError> {
    let v: Value = serde_json::from_str(config).map_err(|e| ConfigError::NotJson(e.to_string()))?;
    let Value::Object(servers) = v else {
        return Err(ConfigError::NotJson(
            "expected {\"server\": {...}, ...}".into(),
        ));
    };
    let mut keys: Vec<_> = servers.keys().collect();
    keys.sort();
    for k in &keys {
        find(k)?;
    }
    keys.into_iter()
        .map(|k| {
            let param_err = |msg: String| ConfigError::Param {
                server: k.clone(),
                msg,
            };
            let params = match &servers[k] {
                Value::Object(m) => m.clone(),
                Value::Null => Map::new(),
                other => return Err(param_err(format!("expected an object, got {other}"))),
            };
            (find(k)?.launch)(k, &params).map_err(param_err)
        })
        .collect()
}

fn node(name: &str, package: &str, args: Vec<String>, env: Vec<(String, String)>) -> Launch {
    let script = format!(
        "{}/node/node_modules/@modelcontextprotocol/{package}/dist/index.js",
        servers_dir()
    );
    Launch {
        name: name.into(),
        program: "node".into(),
        args: [vec![script], args].concat(),
        env,
    }
}

fn python(name: &str, module: &str, args: Vec<String>) -> Launch {
    Launch {
        name: name.into(),
        program: "python3".into(),
        args: [vec!["-m".into(), module.into()], args].concat(),
        env: vec![("PYTHONPATH".into(), format!("{}/python", servers_dir()))],
    }
}

fn only(params: &Map<String, Value>, allowed: &[&str]) -> Result<(), String> {
    match params.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) if allowed.is_empty() => Err(format!("takes no parameters (got {k:?})")),
        Some(k) => Err(format!(
            "unknown parameter {k:?} (it takes: {})",
            allowed.join(", ")
        )),
        None => Ok(()),
    }
}

fn paths(params: &Map<String, Value>, required: bool) -> Result<Vec<String>, String> {
    let list = match params.get("paths") {
        None if !required => return Ok(Vec::new()),
        None => return Err("needs \"paths\": a list of directories".into()),
        Some(Value::Array(a)) => a,
        Some(other) => return Err(format!("\"paths\" must be a list of strings, got {other}")),
    };
    let out: Option<Vec<String>> = list
        .iter()
        .map(|p| p.as_str().map(str::to_string))
        .collect();
    match out {
        Some(v) if required && v.is_empty() => Err("\"paths\" is empty".into()),
        Some(v) => Ok(v),
        None => Err("\"paths\" must be a list of strings".into()),
    }
}

fn filesystem(name: &str, p: &Map<String, Value>) -> Result<Launch, String> {
    only(p, &["paths"])?;
    Ok(node(name, "server-filesystem", paths(p, true)?, vec![]))
}

fn memory(name: &str, p: &Map<String, Value>) -> Result<Launch, String> {
    only(p, &[])?;
    Ok(node(
        name,
        "server-memory",
        vec![],
        vec![("MEMORY_FILE_PATH".into(), MEMORY_FILE.into())],
    ))
}

fn sequentialthinking(name: &str, p: &Map<String, Value>) -> Result<Launch, String> {
    only(p, &[])?;
    let quiet = vec![("DISABLE_THOUGHT_LOGGING".into(), "true".into())];
    Ok(node(name, "server-sequential-thinking", vec![], quiet))
}

fn time(name: &str, p: &Map<String, Value>) -> Result<Launch, String> {
    only(p, &["localTimezone"])?;
    let tz = match p.get("localTimezone") {
        None => "UTC",
        Some(Value::String(s)) => s,
        Some(other) => return Err(format!("\"localTimezone\" must be a string, got {other}")),
    };
    Ok(python(
        name,
        "mcp_server_time",
        vec![format!("--local-timezone={tz}")],
    ))
}

fn fetch(name: &str, p: &Map<String, Value>) -> Result<Launch, String> {
    only(p, &[])?;
    Ok(python(name, "mcp_server_fetch", vec![]))
}

fn git(name: &str, p: &Map<String, Value>) -> Result<Launch, String> {
    only(p, &["paths"])?;
    match paths(p, false)?.as_slice() {
        [] => Ok(python(name, "mcp_server_git", vec![])),
        [repo] => Ok(python(
            name,
            "mcp_server_git",
            vec![format!("--repository={repo}")],
        )),
        _ => Err("this gateway serves one repository: give one path".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_servers_in_key_order() {
        let l = resolve(r#"{"time": {}, "memory": {}}"#).unwrap();
        assert_eq!(
            l.iter().map(|l| l.name.as_str()).collect::<Vec<_>>(),
            ["memory", "time"]
        );
        assert_eq!(l[1].args, ["-m", "mcp_server_time", "--local-timezone=UTC"]);
        assert!(
            l[0].args[0].ends_with("/server-memory/dist/index.js"),
            "{:?}",
            l[0]
        );
        assert_eq!(
            l[0].env,
            [("MEMORY_FILE_PATH".to_string(), MEMORY_FILE.to_string())]
        );
    }

    #[test]
    fn unknown_server_named_with_what_there_is() {
        let e = resolve(r#"{"time": {}, "nosuch": {}}"#).unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown or unsupported MCP server \"nosuch\" (this template has: fetch, filesystem, git, memory, sequentialthinking, time)"
        );
        // Catalog entries that need an account are not in this template.
        assert!(matches!(
            resolve(r#"{"github": {"personalAccessToken": "x"}}"#),
            Err(ConfigError::Unsupported { .. })
        ));
        assert!(matches!(
            resolve(r#"{"github/owner/repo": {}}"#),
            Err(ConfigError::Unsupported { .. })
        ));
    }

    #[test]
    fn parameters_checked() {
        let fs = resolve(r#"{"filesystem": {"paths": ["/home/user", "/tmp"]}}"#).unwrap();
        assert_eq!(&fs[0].args[1..], ["/home/user", "/tmp"]);
        for bad in [
            r#"{"filesystem": {}}"#,
            r#"{"filesystem": {"paths": "/tmp"}}"#,
            r#"{"filesystem": {"paths": [1]}}"#,
            r#"{"memory": {"x": 1}}"#,
            r#"{"time": 3}"#,
            r#"{"git": {"paths": ["/a", "/b"]}}"#,
        ] {
            assert!(
                matches!(resolve(bad), Err(ConfigError::Param { .. })),
                "{bad}"
            );
        }
        assert!(matches!(resolve("[]"), Err(ConfigError::NotJson(_))));
        assert!(matches!(resolve("{"), Err(ConfigError::NotJson(_))));
        let git = resolve(r#"{"git": {"paths": ["/repo"]}, "fetch": null}"#).unwrap();
        assert_eq!(git[1].args, ["-m", "mcp_server_git", "--repository=/repo"]);
    }
}
