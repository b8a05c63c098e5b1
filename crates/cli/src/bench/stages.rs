//! Per-stage timings that the server logs (with `tine_vmm=debug`): every
//! log line with `<name>_ms=<number>` fields becomes samples of the stage
//! `server: <message>: <name>`.

use std::path::Path;

/// The size of the log now (stages are read from there on).
pub fn mark(log: Option<&Path>) -> u64 {
    log.and_then(|p| std::fs::metadata(p).ok())
        .map_or(0, |m| m.len())
}

/// Stage samples logged since `from`.
pub fn since(log: Option<&Path>, from: u64) -> Vec<(String, f64)> {
    let Some(log) = log else { return Vec::new() };
    let data = std::fs::read(log).unwrap_or_default();
    let start = (from as usize).min(data.len());
    parse(&String::from_utf8_lossy(&data[start..]))
}

fn parse(text: &str) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    for line in text.lines() {
        // `<time> <LEVEL> <target>: <message> k=v k=v`
        let Some((_, rest)) = line.split_once(": ") else {
            continue;
        };
        let message: Vec<&str> = rest
            .split_whitespace()
            .take_while(|w| !w.contains('='))
            .collect();
        for word in rest.split_whitespace() {
            let Some((k, v)) = word.split_once('=') else {
                continue;
            };
            let Some(name) = k.strip_suffix("_ms") else {
                continue;
            };
            if let Ok(v) = v.parse::<f64>() {
                out.push((format!("server: {}: {name}", message.join(" ")), v));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tracing_lines() {
        let log = "2025-01-01T00:00:00Z DEBUG tine_vmm::vm: clone launched vm=\"i1\" overlay_ms=12.5 qemu_qmp_ms=40\n\
                   2025-01-01T00:00:00Z  INFO tine_server: listening addr=127.0.0.1:1\n";
        let s = parse(log);
        assert_eq!(
            s,
            vec![
                ("server: clone launched: overlay".to_string(), 12.5),
                ("server: clone launched: qemu_qmp".to_string(), 40.0)
            ]
        );
    }
}
