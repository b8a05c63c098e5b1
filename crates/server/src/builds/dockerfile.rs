//! A Dockerfile as a template build's steps, the way the E2B SDK's
//! `from_dockerfile` turns one into steps: one `FROM`; `USER root` and
//! `WORKDIR /` first; `RUN`, `COPY`/`ADD` of local files (one step per
//! source), `ENV`, `ARG` (an `ENV`), `WORKDIR`, `USER`; `CMD` and
//! `ENTRYPOINT` become the start command; `USER user` and
//! `WORKDIR /home/user` last unless the file set them. Multi-stage builds,
//! `COPY --from` and remote `ADD` are refused. Our own parser: the format
//! is small, and the crates that parse it keep Docker's whole AST, which
//! this does not need.

use super::steps::{quote, Step};

/// What a Dockerfile builds.
#[derive(Debug, Clone, PartialEq)]
pub struct Dockerfile {
    pub from: String,
    pub steps: Vec<Step>,
    pub start: Option<String>,
    /// Instructions that were ignored, with their line.
    pub warnings: Vec<String>,
}

/// Parse `text`; an error names the line.
pub fn parse(text: &str) -> Result<Dockerfile, String> {
    let mut from: Option<String> = None;
    let mut steps = vec![step("USER", &["root"]), step("WORKDIR", &["/"])];
    let (mut user_set, mut workdir_set) = (false, false);
    let (mut entrypoint, mut cmd): (Option<Form>, Option<Form>) = (None, None);
    let mut warnings = Vec::new();
    for (line_no, line) in logical_lines(text) {
        let err = |m: &str| Err(format!("Dockerfile line {line_no}: {m}"));
        let (word, rest) = match line.split_once(char::is_whitespace) {
            Some((w, r)) => (w, r.trim()),
            None => (line.as_str(), ""),
        };
        let instr = word.to_ascii_uppercase();
        if rest.is_empty() && !matches!(instr.as_str(), "EXPOSE" | "VOLUME") {
            return err(&format!("{instr} needs arguments"));
        }
        match instr.as_str() {
            "FROM" => {
                if from.is_some() {
                    return err("multi-stage builds (a second FROM) are not supported");
                }
                let words: Vec<&str> = rest
                    .split_whitespace()
                    .filter(|w| !w.starts_with("--"))
                    .collect();
                match words.as_slice() {
                    [image] | [image, _, _] => from = Some(image.to_string()),
                    _ => return err("FROM takes an image (and `AS name`)"),
                }
            }
            _ if from.is_none() => return err(&format!("{instr} before FROM")),
            "RUN" => {
                let (flags, body) = split_flags(rest);
                if let Some(f) = flags.iter().find(|f| {
                    !f.starts_with("--mount")
                        && !f.starts_with("--network")
                        && !f.starts_with("--security")
                }) {
                    return err(&format!("RUN flag {f} is not supported"));
                }
                let cmd = match Form::parse(body) {
                    Form::Exec(words) => {
                        words.iter().map(|w| quote(w)).collect::<Vec<_>>().join(" ")
                    }
                    Form::Shell(s) => s,
                };
                steps.push(step("RUN", &[&cmd]));
            }
            "COPY" | "ADD" => {
                let (flags, body) = split_flags(rest);
                let (mut chown, mut chmod) = (String::new(), String::new());
                for f in flags {
                    if let Some(v) = f.strip_prefix("--chown=") {
                        chown = v.to_string();
                    } else if let Some(v) = f.strip_prefix("--chmod=") {
                        if !(3..=4).contains(&v.len())
                            || !v.bytes().all(|b| (b'0'..=b'7').contains(&b))
                        {
                            return err(&format!("--chmod={v} is not an octal mode"));
                        }
                        chmod = format!("{:0>4}", v);
                    } else if f.starts_with("--from") {
                        return err("COPY --from (multi-stage) is not supported");
                    } else if !f.starts_with("--link") {
                        return err(&format!("{instr} flag {f} is not supported"));
                    }
                }
                let words = match Form::parse(body) {
                    Form::Exec(w) => w,
                    Form::Shell(s) => s.split_whitespace().map(str::to_string).collect(),
                };
                if words.len() < 2 {
                    return err(&format!("{instr} needs a source and a destination"));
                }
                let (dest, srcs) = words.split_last().expect("two words at least");
                for src in srcs {
                    if src.contains("://") {
                        return err(&format!("{instr} of a URL ({src}) is not supported"));
                    }
                    if src.starts_with("<<") {
                        return err("heredoc sources are not supported");
                    }
                    let src = src.trim_start_matches("./");
                    let src = if src.is_empty() { "." } else { src };
                    steps.push(step("COPY", &[src, dest, &chown, &chmod]));
                }
            }
            "ENV" => {
                let pairs =
                    env_pairs(rest).map_err(|m| format!("Dockerfile line {line_no}: {m}"))?;
                let flat: Vec<&str> = pairs
                    .iter()
                    .flat_map(|(k, v)| [k.as_str(), v.as_str()])
                    .collect();
                steps.push(step("ENV", &flat));
            }
            "ARG" => {
                let (k, v) = rest.split_once('=').unwrap_or((rest, ""));
                steps.push(step("ENV", &[k.trim(), unquote(v.trim()).as_str()]));
            }
            "WORKDIR" => {
                workdir_set = true;
                steps.push(step("WORKDIR", &[rest]));
            }
            "USER" => {
                user_set = true;
                steps.push(step("USER", &[rest]));
            }
            "CMD" => cmd = Some(Form::parse(rest)),
            "ENTRYPOINT" => entrypoint = Some(Form::parse(rest)),
            "EXPOSE" | "VOLUME" | "LABEL" | "MAINTAINER" | "HEALTHCHECK" | "STOPSIGNAL"
            | "SHELL" | "ONBUILD" => {
                warnings.push(format!("line {line_no}: {instr} is ignored"));
            }
            other => return err(&format!("unknown instruction {other}")),
        }
    }
    let Some(from) = from else {
        return Err("Dockerfile has no FROM".into());
    };
    if !user_set {
        steps.push(step("USER", &["user"]));
    }
    if !workdir_set {
        steps.push(step("WORKDIR", &["/home/user"]));
    }
    Ok(Dockerfile {
        from,
        steps,
        start: start_command(entrypoint, cmd),
        warnings,
    })
}

fn step(kind: &str, args: &[&str]) -> Step {
    Step::new(kind, args)
}

/// Lines joined at trailing backslashes, without comments and blanks,
/// each with the number of its first physical line.
fn logical_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut cur: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let t = raw.trim();
        if t.starts_with('#') || (t.is_empty() && cur.is_none()) {
            continue;
        }
        let (start, mut acc) = cur.take().unwrap_or((i + 1, String::new()));
        match t.strip_suffix('\\') {
            Some(part) => {
                acc.push_str(part);
                acc.push(' ');
                cur = Some((start, acc));
            }
            None => {
                acc.push_str(t);
                out.push((start, acc.trim().to_string()));
            }
        }
    }
    if let Some((start, acc)) = cur {
        out.push((start, acc.trim().to_string()));
    }
    out
}

/// Leading `--flag[=value]` words, and the rest.
fn split_flags(s: &str) -> (Vec<String>, &str) {
    let mut flags = Vec::new();
    let mut rest = s.trim_start();
    while rest.starts_with("--") {
        let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
        flags.push(rest[..end].to_string());
        rest = rest[end..].trim_start();
    }
    (flags, rest)
}

#[derive(Debug, Clone)]
enum Form {
    Exec(Vec<String>),
    Shell(String),
}

impl Form {
    /// The JSON-array (exec) form when it is one, else the shell form.
    fn parse(s: &str) -> Form {
        if s.trim_start().starts_with('[') {
            if let Ok(words) = serde_json::from_str::<Vec<String>>(s.trim()) {
                return Form::Exec(words);
            }
        }
        Form::Shell(s.trim().to_string())
    }

    fn shell(&self) -> String {
        match self {
            Form::Exec(w) => w.iter().map(|w| quote(w)).collect::<Vec<_>>().join(" "),
            Form::Shell(s) => s.clone(),
        }
    }
}

/// Docker's rules: an exec `ENTRYPOINT` takes `CMD` as arguments, a
/// shell one ignores it.
fn start_command(entrypoint: Option<Form>, cmd: Option<Form>) -> Option<String> {
    match (entrypoint, cmd) {
        (Some(e @ Form::Shell(_)), _) | (Some(e), None) => Some(e.shell()),
        (Some(e), Some(Form::Exec(c))) => Some(format!("{} {}", e.shell(), Form::Exec(c).shell())),
        (Some(e), Some(Form::Shell(c))) => Some(format!("{} /bin/sh -c {}", e.shell(), quote(&c))),
        (None, Some(c)) => Some(c.shell()),
        (None, None) => None,
    }
}

/// `ENV a=b c="d e"` or the old `ENV a b c`.
fn env_pairs(s: &str) -> Result<Vec<(String, String)>, String> {
    let words = shell_words(s)?;
    if !words.first().is_some_and(|w| w.contains('=')) {
        let (k, v) = s
            .split_once(char::is_whitespace)
            .ok_or("ENV needs a name and a value")?;
        return Ok(vec![(k.to_string(), v.trim().to_string())]);
    }
    words
        .into_iter()
        .map(|w| match w.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => Err(format!("ENV {w:?} is not NAME=value")),
        })
        .collect()
}

/// Split on blanks, honouring double and single quotes and backslashes.
fn shell_words(s: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut has = false;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' | '\'' => {
                has = true;
                loop {
                    match chars.next() {
                        Some(q) if q == c => break,
                        Some('\\') if c == '"' => cur.extend(chars.next()),
                        Some(x) => cur.push(x),
                        None => return Err(format!("unterminated quote in {s:?}")),
                    }
                }
            }
            '\\' => {
                has = true;
                cur.extend(chars.next());
            }
            c if c.is_whitespace() => {
                if has {
                    out.push(std::mem::take(&mut cur));
                    has = false;
                }
            }
            c => {
                has = true;
                cur.push(c);
            }
        }
    }
    if has {
        out.push(cur);
    }
    Ok(out)
}

fn unquote(s: &str) -> String {
    shell_words(s)
        .ok()
        .and_then(|w| w.into_iter().next())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(d: &Dockerfile) -> Vec<(String, Vec<String>)> {
        d.steps
            .iter()
            .map(|s| (s.kind.clone(), s.args.clone()))
            .collect()
    }

    #[test]
    fn turns_a_dockerfile_into_the_sdks_steps() {
        let d = parse(
            "# comment\nFROM --platform=linux/amd64 127.0.0.1:5000/app:v1 AS build\n\
             ARG V=1\nENV A=b C=\"d e\"\nWORKDIR /app\nCOPY --chown=user --chmod=755 a.sh b/ ./\n\
             RUN apt-get update && \\\n    echo hi\nRUN [\"echo\", \"x y\"]\nUSER user\nEXPOSE 80\n\
             ENTRYPOINT [\"python\"]\nCMD [\"app.py\"]\n",
        )
        .unwrap();
        assert_eq!(d.from, "127.0.0.1:5000/app:v1");
        let s = |k: &str, a: &[&str]| {
            (
                k.to_string(),
                a.iter().map(|x| x.to_string()).collect::<Vec<_>>(),
            )
        };
        assert_eq!(
            kinds(&d),
            vec![
                s("USER", &["root"]),
                s("WORKDIR", &["/"]),
                s("ENV", &["V", "1"]),
                s("ENV", &["A", "b", "C", "d e"]),
                s("WORKDIR", &["/app"]),
                s("COPY", &["a.sh", "./", "user", "0755"]),
                s("COPY", &["b/", "./", "user", "0755"]),
                s("RUN", &["apt-get update &&  echo hi"]),
                s("RUN", &["'echo' 'x y'"]),
                s("USER", &["user"]),
            ]
        );
        assert_eq!(d.start.as_deref(), Some("'python' 'app.py'"));
        assert_eq!(d.warnings, vec!["line 11: EXPOSE is ignored"]);
    }

    #[test]
    fn adds_the_default_user_and_workdir() {
        let d = parse("FROM x\nRUN true\nCMD echo hi\n").unwrap();
        let last: Vec<_> = kinds(&d).into_iter().rev().take(2).collect();
        assert_eq!(last[0].0, "WORKDIR");
        assert_eq!(last[0].1, ["/home/user"]);
        assert_eq!(last[1].1, ["user"]);
        assert_eq!(d.start.as_deref(), Some("echo hi"));
    }

    #[test]
    fn errors_name_the_line() {
        for (text, want) in [
            ("RUN x\n", "line 1: RUN before FROM"),
            ("FROM a\nFROM b\n", "line 2: multi-stage"),
            ("FROM a\nCOPY --from=b x y\n", "line 2: COPY --from"),
            ("FROM a\nADD https://x/y /y\n", "line 2: ADD of a URL"),
            (
                "FROM a\nFROBNICATE x\n",
                "line 2: unknown instruction FROBNICATE",
            ),
            ("FROM a\nRUN\n", "line 2: RUN needs arguments"),
            ("FROM a\nCOPY x\n", "needs a source and a destination"),
            ("FROM a\nENV A=\"x\n", "unterminated quote"),
            ("# nothing\n", "no FROM"),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }
}
