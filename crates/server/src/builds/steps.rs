//! A template build's steps as the E2B SDK sends them (`COPY`, `RUN`,
//! `ENV`, `WORKDIR`, `USER`; every helper such as `pip_install` is a
//! `RUN`), the state they leave for the next step (user, workdir, env),
//! the shell scripts that run them in the build VM, and the cache keys of
//! the layers they make.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// One step of `POST /v2/templates/{id}/builds/{buildID}` (`steps[]`).
/// Keys the SDKs add for themselves (`forceUpload`, `gzip`,
/// `resolveSymlinks`) are ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Step {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files_hash: Option<String>,
    #[serde(default)]
    pub force: bool,
}

/// What a step does, checked.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    Run {
        cmd: String,
        user: Option<String>,
    },
    Copy {
        src: String,
        dest: String,
        owner: Option<String>,
        mode: Option<String>,
        files_hash: String,
    },
    Env(Vec<(String, String)>),
    Workdir(String),
    User(String),
}

impl Op {
    /// Whether the step changes the disk (and so makes a layer); `ENV`,
    /// `WORKDIR` and `USER` only change what later steps run with.
    pub fn makes_layer(&self) -> bool {
        matches!(self, Op::Run { .. } | Op::Copy { .. })
    }
}

impl Step {
    /// A step of `kind` with `args` (no files, not forced).
    pub fn new(kind: &str, args: &[&str]) -> Self {
        Self {
            kind: kind.into(),
            args: args.iter().map(|s| s.to_string()).collect(),
            files_hash: None,
            force: false,
        }
    }

    /// Check the step's arguments (`n` counts from 1, for the message).
    pub fn op(&self, n: usize) -> Result<Op, String> {
        let bad = |what: &str| Err(format!("step {n} ({}): {what}", self.kind));
        let a = &self.args;
        match self.kind.as_str() {
            "RUN" => match a.as_slice() {
                [cmd] => Ok(Op::Run {
                    cmd: cmd.clone(),
                    user: None,
                }),
                [cmd, user] => Ok(Op::Run {
                    cmd: cmd.clone(),
                    user: (!user.is_empty()).then(|| user.clone()),
                }),
                _ => bad("args must be [command] or [command, user]"),
            },
            "COPY" => {
                let (src, dest, owner, mode) = match a.as_slice() {
                    [s, d] => (s, d, "", ""),
                    [s, d, o] => (s, d, o.as_str(), ""),
                    [s, d, o, m] => (s, d, o.as_str(), m.as_str()),
                    _ => return bad("args must be [src, dest, user, mode]"),
                };
                if src.is_empty() || dest.is_empty() {
                    return bad("source and destination are required");
                }
                if src.starts_with('/') || src.split('/').any(|c| c == "..") {
                    return bad("the source must be a path inside the build context");
                }
                if !mode.is_empty()
                    && (mode.len() > 4 || !mode.bytes().all(|b| (b'0'..=b'7').contains(&b)))
                {
                    return bad(&format!("mode {mode:?} is not octal"));
                }
                if !owner.is_empty()
                    && !owner
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"_-.:".contains(&b))
                {
                    return bad(&format!("invalid owner {owner:?}"));
                }
                let files_hash = match &self.files_hash {
                    Some(h) if valid_hash(h) => h.clone(),
                    Some(h) => return bad(&format!("filesHash {h:?} is not a sha256 hex digest")),
                    None => return bad("filesHash is missing"),
                };
                Ok(Op::Copy {
                    src: src.clone(),
                    dest: dest.clone(),
                    owner: (!owner.is_empty()).then(|| owner.to_string()),
                    mode: (!mode.is_empty()).then(|| mode.to_string()),
                    files_hash,
                })
            }
            "ENV" => {
                if a.is_empty() || !a.len().is_multiple_of(2) {
                    return bad("args must be key, value pairs");
                }
                let pairs: Vec<_> = a.chunks(2).map(|p| (p[0].clone(), p[1].clone())).collect();
                if let Some((k, _)) = pairs.iter().find(|(k, _)| !valid_env_name(k)) {
                    return bad(&format!("invalid variable name {k:?}"));
                }
                Ok(Op::Env(pairs))
            }
            "WORKDIR" => match a.as_slice() {
                [d] if !d.is_empty() => Ok(Op::Workdir(d.clone())),
                _ => bad("args must be [path]"),
            },
            "USER" => match a.as_slice() {
                [u] if !u.is_empty()
                    && u.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b)) =>
                {
                    Ok(Op::User(u.clone()))
                }
                _ => bad("args must be [user name]"),
            },
            other => Err(format!(
                "step {n}: unknown step type {other:?} (tine runs COPY, RUN, ENV, WORKDIR, USER)"
            )),
        }
    }
}

pub fn valid_hash(h: &str) -> bool {
    h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit())
}

fn valid_env_name(k: &str) -> bool {
    !k.is_empty()
        && !k.starts_with(|c: char| c.is_ascii_digit())
        && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// What the steps so far leave for the next: who runs it, where, with
/// which variables.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct State {
    pub user: String,
    pub workdir: String,
    pub env: BTreeMap<String, String>,
}

impl Default for State {
    /// E2B's defaults: user `user` in `/home/user`.
    fn default() -> Self {
        Self {
            user: "user".into(),
            workdir: "/home/user".into(),
            env: BTreeMap::new(),
        }
    }
}

impl State {
    pub fn apply(&mut self, op: &Op) {
        match op {
            Op::Env(pairs) => self.env.extend(pairs.iter().cloned()),
            Op::Workdir(d) => self.workdir = self.resolve(d),
            Op::User(u) => self.user = u.clone(),
            Op::Run { .. } | Op::Copy { .. } => {}
        }
    }

    /// `path` against the workdir, normalized (`.` and `..` folded).
    pub fn resolve(&self, path: &str) -> String {
        let joined = if path.starts_with('/') {
            path.to_string()
        } else {
            format!("{}/{path}", self.workdir)
        };
        let mut parts: Vec<&str> = Vec::new();
        for c in joined.split('/') {
            match c {
                "" | "." => {}
                ".." => {
                    parts.pop();
                }
                c => parts.push(c),
            }
        }
        let mut out = format!("/{}", parts.join("/"));
        if path.ends_with('/') && out != "/" {
            out.push('/');
        }
        out
    }

    /// The lines that give a script this state's variables and workdir.
    fn prologue(&self) -> String {
        let mut s = String::new();
        for (k, v) in &self.env {
            s.push_str(&format!("export {k}={}\n", quote(v)));
        }
        s.push_str(&format!("cd {} || exit 1\n", quote(&self.workdir)));
        s
    }
}

/// `s` as one single-quoted shell word.
pub fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The script (run as root) that creates the workdir, owned by the step's
/// user when it makes it.
pub fn mkdir_workdir(state: &State) -> String {
    // `/` stays `/` (trimmed, it would be the empty path).
    let d = match state.workdir.trim_end_matches('/') {
        "" => "/".to_string(),
        d => quote(d),
    };
    format!(
        "[ -d {d} ] || {{ mkdir -p {d} && chown {} {d}; }}",
        quote(&state.user)
    )
}

/// The script of a `RUN` step (run as the step's user).
pub fn run_script(state: &State, cmd: &str) -> String {
    format!("{}{cmd}\n", state.prologue())
}

/// The script (run as root) of a `COPY` step: `archive` (the uploaded
/// context, tar or tar.gz) is unpacked in a scratch directory and `src`
/// (a path or glob relative to the context) is copied as Docker does: a
/// directory's contents into `dest`, a file into `dest` when it is a
/// directory (or ends in `/`, or several sources match), else as `dest`.
/// The copies get the owner (default: the step's user) and mode.
pub fn copy_script(
    state: &State,
    archive: &str,
    src: &str,
    dest: &str,
    owner: Option<&str>,
    mode: Option<&str>,
) -> String {
    let dest = state.resolve(dest);
    let owner = owner.map_or_else(|| state.user.clone(), str::to_string);
    let mut s = String::from(
        "set -e\nctx=$(mktemp -d /tmp/.tine-ctx.XXXXXX)\ntrap 'rm -rf \"$ctx\"' EXIT\n",
    );
    s.push_str(&format!(
        "tar --no-same-owner -xf {} -C \"$ctx\"\nrm -f {}\ncd \"$ctx\"\n",
        quote(archive),
        quote(archive)
    ));
    // The source is a glob: expand it unquoted, but only in the context.
    let glob = src
        .chars()
        .map(|c| match c {
            '*' | '?' | '[' | ']' => c.to_string(),
            c if c.is_ascii_alphanumeric() || "/._-".contains(c) => c.to_string(),
            c => format!("\\{c}"),
        })
        .collect::<String>();
    s.push_str(&format!(
        "set -- {glob}\n[ -e \"$1\" ] || [ -L \"$1\" ] || {{ echo {} >&2; exit 66; }}\n",
        quote(&format!(
            "COPY {src}: no such file in the uploaded build context"
        ))
    ));
    s.push_str(&format!("dest={}\n", quote(&dest)));
    // `fix` gives one copied path its owner and mode.
    s.push_str(&format!("fix() {{ chown -hR {} \"$1\"", quote(&owner)));
    if let Some(m) = mode {
        s.push_str(&format!("; chmod -R {m} \"$1\""));
    }
    s.push_str("; }\n");
    s.push_str(
        "d=${dest%/}; [ -e \"$d\" ] && new=0 || new=1\n\
         case \"$dest\" in */) into=1 ;; *) into=$([ $# -gt 1 ] && echo 1 || echo 0) ;; esac\n\
         for f in \"$@\"; do\n\
           if [ -d \"$f\" ] && [ ! -L \"$f\" ]; then\n\
             mkdir -p \"$dest\"\n\
             for e in \"$f\"/* \"$f\"/.[!.]* \"$f\"/..?*; do [ -e \"$e\" ] || [ -L \"$e\" ] || continue; cp -a \"$e\" \"$dest/\"; fix \"$dest/${e##*/}\"; done\n\
           elif [ \"$into\" = 1 ] || [ -d \"$dest\" ]; then\n\
             mkdir -p \"$dest\"; cp -a \"$f\" \"$dest/\"; fix \"$dest/${f##*/}\"\n\
           else\n\
             mkdir -p \"$(dirname \"$dest\")\"; cp -a \"$f\" \"$dest\"; fix \"$dest\"\n\
           fi\n\
         done\n\
         if [ \"$new\" = 1 ] && [ -d \"$d\" ]; then fix \"$d\"; fi\n",
    );
    s
}

/// The key of the layer after a step: the parent's key, the step as it
/// runs (kind, arguments, the state it runs with) and, for `COPY`, the
/// sha256 of the uploaded archive (not the SDK's `filesHash`, which the
/// server cannot check).
pub fn layer_key(parent: &str, op: &Op, state: &State, content: Option<&str>) -> String {
    // The SDK's files hash is left out: the archive's digest stands for
    // the files (and the two SDKs hash the same files differently).
    let op = match op {
        Op::Copy {
            src,
            dest,
            owner,
            mode,
            ..
        } => Op::Copy {
            src: src.clone(),
            dest: dest.clone(),
            owner: owner.clone(),
            mode: mode.clone(),
            files_hash: String::new(),
        },
        other => other.clone(),
    };
    let mut h = Sha256::new();
    h.update(parent.as_bytes());
    h.update([0]);
    h.update(format!("{op:?}").as_bytes());
    h.update([0]);
    h.update(serde_json::to_vec(state).expect("state serializes"));
    h.update([0]);
    h.update(content.unwrap_or_default().as_bytes());
    hex(&h.finalize())
}

/// Key of anything else (the base, the finished template): a hash of parts.
pub fn key_of(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0]);
    }
    hex(&h.finalize())
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(kind: &str, args: &[&str]) -> Step {
        Step::new(kind, args)
    }

    #[test]
    fn parses_what_the_sdk_sends() {
        let s: Step = serde_json::from_str(
            r#"{"forceUpload":true,"type":"COPY","args":["a.txt","/app/","root","0755"],"filesHash":"2b2e000000000000000000000000000000000000000000000000000000000000","force":false,"gzip":false}"#,
        )
        .unwrap();
        assert_eq!(
            s.op(1).unwrap(),
            Op::Copy {
                src: "a.txt".into(),
                dest: "/app/".into(),
                owner: Some("root".into()),
                mode: Some("0755".into()),
                files_hash: "2b2e000000000000000000000000000000000000000000000000000000000000"
                    .into()
            }
        );
        assert_eq!(
            step("RUN", &["echo a && echo b", "root"]).op(2).unwrap(),
            Op::Run {
                cmd: "echo a && echo b".into(),
                user: Some("root".into())
            }
        );
        assert_eq!(
            step("ENV", &["A", "1", "B", "2"]).op(3).unwrap(),
            Op::Env(vec![("A".into(), "1".into()), ("B".into(), "2".into())])
        );
    }

    #[test]
    fn refuses_bad_steps_naming_them() {
        for (s, want) in [
            (step("RUN", &[]), "step 4 (RUN)"),
            (step("ENV", &["A"]), "key, value pairs"),
            (step("ENV", &["1A", "x"]), "invalid variable name"),
            (
                step("COPY", &["../x", "/a", "", ""]),
                "inside the build context",
            ),
            (step("COPY", &["x", "/a", "", "9"]), "not octal"),
            (step("COPY", &["x", "/a", "", ""]), "filesHash is missing"),
            (step("USER", &["a b"]), "user name"),
            (step("FROB", &["x"]), "unknown step type \"FROB\""),
        ] {
            let e = s.op(4).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn state_follows_env_workdir_user() {
        let mut st = State::default();
        st.apply(&Op::Workdir("app".into()));
        assert_eq!(st.workdir, "/home/user/app");
        st.apply(&Op::Workdir("../x/./y".into()));
        assert_eq!(st.workdir, "/home/user/x/y");
        st.apply(&Op::Workdir("/srv".into()));
        st.apply(&Op::User("root".into()));
        st.apply(&Op::Env(vec![("A".into(), "it's".into())]));
        assert_eq!(st.resolve("d/"), "/srv/d/");
        let script = run_script(&st, "echo $A");
        assert!(
            script.contains("export A='it'\\''s'\ncd '/srv' || exit 1\necho $A"),
            "{script}"
        );
    }

    #[test]
    fn keys_change_with_step_state_and_content() {
        let st = State::default();
        let run = Op::Run {
            cmd: "x".into(),
            user: None,
        };
        let k = layer_key("p", &run, &st, None);
        assert_eq!(k, layer_key("p", &run, &st, None));
        assert_ne!(k, layer_key("q", &run, &st, None));
        assert_ne!(
            k,
            layer_key(
                "p",
                &Op::Run {
                    cmd: "y".into(),
                    user: None
                },
                &st,
                None
            )
        );
        let mut st2 = st.clone();
        st2.apply(&Op::Env(vec![("A".into(), "1".into())]));
        assert_ne!(k, layer_key("p", &run, &st2, None));
        assert_ne!(
            layer_key("p", &run, &st, Some("a")),
            layer_key("p", &run, &st, Some("b"))
        );
    }

    #[test]
    fn the_root_workdir_is_not_the_empty_path() {
        let root = State {
            workdir: "/".into(),
            ..State::default()
        };
        assert_eq!(
            mkdir_workdir(&root),
            "[ -d / ] || { mkdir -p / && chown 'user' /; }"
        );
        let app = State {
            workdir: "/app/".into(),
            ..State::default()
        };
        assert!(
            mkdir_workdir(&app).starts_with("[ -d '/app' ]"),
            "{}",
            mkdir_workdir(&app)
        );
    }
}
