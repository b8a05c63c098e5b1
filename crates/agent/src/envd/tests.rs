//! In-process tests of the whole API: the router served on a loopback
//! port, driven with a plain hyper client and `tine_connect`'s client side.

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tine_connect::{Code, Decoder, Frame};

/// One runtime for every test here (the agent's servers live on it).
fn rt() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        crate::reaper::global().start().unwrap();
        rt
    })
}

struct Agent {
    addr: SocketAddr,
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
}

async fn agent() -> Agent {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, super::router()).await });
    Agent {
        addr,
        client: Client::builder(TokioExecutor::new()).build_http(),
    }
}

const ROOT: &str = "Basic cm9vdDo="; // base64("root:")

impl Agent {
    async fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> (u16, Bytes) {
        let mut req = http::Request::builder()
            .method(method)
            .uri(format!("http://{}{}", self.addr, path));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = self
            .client
            .request(req.body(Full::new(body.into())).unwrap())
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.into_body().collect().await.unwrap().to_bytes())
    }

    async fn unary(&self, path: &str, msg: Value) -> (u16, Value) {
        let (status, body) = self
            .request(
                "POST",
                path,
                &[
                    ("content-type", "application/json"),
                    ("authorization", ROOT),
                ],
                msg.to_string(),
            )
            .await;
        (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }

    /// A server-streaming call: its messages and its end-of-stream error.
    async fn stream(
        &self,
        path: &str,
        msg: Value,
        extra: &[(&str, &str)],
    ) -> (Vec<Value>, Option<tine_connect::Error>) {
        let mut headers = vec![
            ("content-type", "application/connect+json"),
            ("authorization", ROOT),
        ];
        headers.retain(|(k, _)| !extra.iter().any(|(e, _)| e == k));
        headers.extend_from_slice(extra);
        let (status, body) = self
            .request(
                "POST",
                path,
                &headers,
                tine_connect::encode_message(&msg).unwrap(),
            )
            .await;
        assert_eq!(status, 200);
        decode_stream(&body)
    }
}

fn decode_stream(body: &[u8]) -> (Vec<Value>, Option<tine_connect::Error>) {
    let mut dec = Decoder::new(64 << 20);
    dec.push(body);
    let mut msgs = Vec::new();
    loop {
        match dec.next_frame().unwrap() {
            Some(Frame::Message(m)) => msgs.push(serde_json::from_slice(&m).unwrap()),
            Some(Frame::End(end)) => {
                dec.finish().unwrap();
                return (msgs, end.error);
            }
            None => panic!("stream without end-of-stream"),
        }
    }
}

fn stdout_of(events: &[Value]) -> Vec<u8> {
    events
        .iter()
        .filter_map(|e| e["event"]["data"]["stdout"].as_str())
        .flat_map(|s| crate::envd::proto::decode_bytes(s).unwrap())
        .collect()
}

#[test]
fn start_sends_start_data_end_in_order() {
    rt().block_on(async {
        let a = agent().await;
        let (events, err) = a.stream("/process.Process/Start", json!({"process": {"cmd": "/bin/sh", "args": ["-c", "echo out; echo err >&2; exit 3"]}}), &[]).await;
        assert!(err.is_none());
        assert!(events[0]["event"]["start"]["pid"].as_u64().unwrap() > 0);
        assert_eq!(stdout_of(&events), b"out\n");
        let stderr: Vec<_> = events.iter().filter_map(|e| e["event"]["data"]["stderr"].as_str()).collect();
        assert_eq!(stderr, vec!["ZXJyCg=="]);
        let end = &events.last().unwrap()["event"]["end"];
        assert_eq!(end, &json!({"exitCode": 3, "exited": true, "status": "exit status 3", "error": "exit status 3"}));
    });
}

#[test]
fn fast_writer_output_is_complete_and_ordered() {
    rt().block_on(async {
        let a = agent().await;
        let (events, err) = a
            .stream(
                "/process.Process/Start",
                json!({"process": {"cmd": "seq", "args": ["1", "300000"]}}),
                &[],
            )
            .await;
        assert!(err.is_none());
        let expected: String = (1..=300000).map(|i| format!("{i}\n")).collect();
        assert_eq!(String::from_utf8(stdout_of(&events)).unwrap(), expected);
    });
}

#[test]
fn deadline_kills_the_process_and_ends_with_deadline_exceeded() {
    rt().block_on(async {
        let a = agent().await;
        let (events, err) = a
            .stream(
                "/process.Process/Start",
                json!({"process": {"cmd": "sleep", "args": ["30"]}}),
                &[("connect-timeout-ms", "300")],
            )
            .await;
        assert_eq!(err.unwrap().code, Code::DeadlineExceeded);
        let end = &events.last().unwrap()["event"]["end"];
        assert_eq!(end["exitCode"], -1);
        assert_eq!(end["status"], "signal: killed");
    });
}

#[test]
fn keepalives_are_sent_while_idle() {
    rt().block_on(async {
        let a = agent().await;
        let (events, _) = a
            .stream(
                "/process.Process/Start",
                json!({"process": {"cmd": "sleep", "args": ["2.5"]}}),
                &[("keepalive-ping-interval", "1")],
            )
            .await;
        assert!(events.iter().any(|e| e["event"].get("keepalive").is_some()));
        assert!(events.last().unwrap()["event"].get("end").is_some());
    });
}

#[test]
fn users_get_their_ids_and_unknown_users_are_unauthenticated() {
    rt().block_on(async {
        let a = agent().await;
        if nix::unistd::Uid::effective().is_root()
            && nix::unistd::User::from_name("nobody")
                .ok()
                .flatten()
                .is_some()
        {
            let nobody = "Basic bm9ib2R5Og=="; // base64("nobody:")
            let (events, _) = a
                .stream(
                    "/process.Process/Start",
                    json!({"process": {"cmd": "id", "args": ["-u"], "cwd": "/"}}),
                    &[("authorization", nobody)],
                )
                .await;
            let uid = nix::unistd::User::from_name("nobody")
                .unwrap()
                .unwrap()
                .uid
                .as_raw();
            assert_eq!(
                String::from_utf8(stdout_of(&events)).unwrap(),
                format!("{uid}\n")
            );
        }
        let bogus = "Basic bm8tc3VjaC11c2VyOg=="; // base64("no-such-user:")
        let (events, err) = a
            .stream(
                "/process.Process/Start",
                json!({"process": {"cmd": "true"}}),
                &[("authorization", bogus)],
            )
            .await;
        assert!(events.is_empty());
        assert_eq!(err.unwrap().code, Code::Unauthenticated);
    });
}

#[test]
fn bad_input_gets_the_right_errors() {
    rt().block_on(async {
        let a = agent().await;
        let (status, body) = a.unary("/process.Process/Frobnicate", json!({})).await;
        assert_eq!(
            (status, body["code"].as_str()),
            (404, Some("unimplemented"))
        );
        let (status, body) = a
            .request(
                "POST",
                "/filesystem.Filesystem/Stat",
                &[("content-type", "application/json")],
                "{nope",
            )
            .await;
        assert_eq!(status, 400);
        assert_eq!(
            tine_connect::Error::from_unary_response(status, &body).code,
            Code::InvalidArgument
        );
        let (status, body) = a
            .unary(
                "/filesystem.Filesystem/Stat",
                json!({"path": "/nonexistent/tine"}),
            )
            .await;
        assert_eq!((status, body["code"].as_str()), (404, Some("not_found")));
        let (status, body) = a
            .unary(
                "/process.Process/SendSignal",
                json!({"process": {"pid": 999_999}, "signal": "SIGNAL_SIGKILL"}),
            )
            .await;
        assert_eq!((status, body["code"].as_str()), (404, Some("not_found")));
        let (status, _) = a
            .unary(
                "/process.Process/SendSignal",
                json!({"process": {"pid": 1}, "signal": "SIGNAL_BOGUS"}),
            )
            .await;
        assert_eq!(status, 400);
        let (status, body) = a
            .unary(
                "/process.Process/Start",
                json!({"process": {"cmd": "/nonexistent/binary"}}),
            )
            .await;
        assert_eq!(
            status, 415,
            "a stream method with a unary content type: {body}"
        );

        let stream_hdr = [
            ("content-type", "application/connect+json"),
            ("authorization", ROOT),
        ];
        let full = tine_connect::encode_message(&json!({"process": {"cmd": "true"}})).unwrap();
        let (status, body) = a
            .request(
                "POST",
                "/process.Process/Start",
                &stream_hdr,
                full.slice(..full.len() - 2),
            )
            .await;
        assert_eq!(status, 200);
        assert_eq!(decode_stream(&body).1.unwrap().code, Code::InvalidArgument);
        let huge = tine_connect::encode_envelope(0, b"{}").slice(..1);
        let mut oversized = huge.to_vec();
        oversized.extend_from_slice(&u32::MAX.to_be_bytes());
        let (_, body) = a
            .request("POST", "/process.Process/Start", &stream_hdr, oversized)
            .await;
        assert_eq!(decode_stream(&body).1.unwrap().code, Code::InvalidArgument);
        let (_, body) = a
            .request(
                "POST",
                "/process.Process/Start",
                &stream_hdr,
                tine_connect::encode_envelope(0, b"[1,2"),
            )
            .await;
        assert_eq!(decode_stream(&body).1.unwrap().code, Code::InvalidArgument);
        let (events, err) = a
            .stream(
                "/process.Process/Start",
                json!({"process": {"cmd": "/nonexistent/binary"}}),
                &[],
            )
            .await;
        assert!(events.is_empty());
        assert_eq!(err.unwrap().code, Code::InvalidArgument);
        let (_, err) = a
            .stream(
                "/process.Process/Connect",
                json!({"process": {"pid": 999_999}}),
                &[],
            )
            .await;
        assert_eq!(err.unwrap().code, Code::NotFound);

        let (status, body) = a
            .request("GET", "/files?path=/nonexistent/tine", &[], "")
            .await;
        assert_eq!(status, 404);
        assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["code"], 404);
        let (status, _) = a
            .request("GET", "/files?path=/&signature_expiration=soon", &[], "")
            .await;
        assert_eq!(status, 400);
    });
}

#[test]
fn filesystem_calls_and_a_big_streamed_file() {
    rt().block_on(async {
        let a = agent().await;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        let (status, body) = a
            .unary(
                "/filesystem.Filesystem/MakeDir",
                json!({"path": format!("{d}/x/y")}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["entry"]["type"], "FILE_TYPE_DIRECTORY");
        let (status, body) = a
            .unary(
                "/filesystem.Filesystem/MakeDir",
                json!({"path": format!("{d}/x/y")}),
            )
            .await;
        assert_eq!(
            (status, body["code"].as_str()),
            (409, Some("already_exists"))
        );

        // 48 MiB through the raw upload and back through the download.
        let data: Vec<u8> = (0..48u32 << 20)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let path = format!("{d}/x/big.bin");
        let (status, body) = a
            .request(
                "POST",
                &format!("/files?path={path}"),
                &[
                    ("content-type", "application/octet-stream"),
                    ("authorization", ROOT),
                ],
                data.clone(),
            )
            .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let written: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(written[0]["path"], path);
        let (status, got) = a
            .request("GET", &format!("/files?path={path}&username=root"), &[], "")
            .await;
        assert_eq!(status, 200);
        assert!(got == data, "downloaded bytes differ");

        let (_, body) = a
            .unary(
                "/filesystem.Filesystem/ListDir",
                json!({"path": d, "depth": 2}),
            )
            .await;
        let paths: Vec<&str> = body["entries"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["path"].as_str().unwrap())
            .collect();
        assert_eq!(
            paths,
            vec![
                format!("{d}/x"),
                format!("{d}/x/big.bin"),
                format!("{d}/x/y")
            ]
        );
        let (_, body) = a
            .unary("/filesystem.Filesystem/Stat", json!({"path": path}))
            .await;
        assert_eq!(body["entry"]["size"], (48u64 << 20).to_string());
        let (status, body) = a
            .unary(
                "/filesystem.Filesystem/Move",
                json!({"source": path, "destination": format!("{d}/z/moved.bin")}),
            )
            .await;
        assert_eq!(
            (status, body["entry"]["name"].as_str()),
            (200, Some("moved.bin"))
        );
        let (status, _) = a
            .unary(
                "/filesystem.Filesystem/Remove",
                json!({"path": format!("{d}/x")}),
            )
            .await;
        assert_eq!(status, 200);
        let (status, _) = a
            .unary(
                "/filesystem.Filesystem/Remove",
                json!({"path": format!("{d}/x")}),
            )
            .await;
        // Removing what is already gone succeeds, as in envd.
        assert_eq!(status, 200);
    });
}

/// As envd: file calls run as root whoever the user is; what they create
/// belongs to the user; downloads read to end of file (procfs), as gzip
/// when asked, and by byte range.
#[test]
fn file_calls_run_as_root_and_hand_what_they_create_to_the_user() {
    use std::os::unix::fs::MetadataExt;
    let Some(nobody) = nix::unistd::User::from_name("nobody").ok().flatten() else {
        return;
    };
    if !nix::unistd::Uid::effective().is_root() {
        return;
    }
    let as_nobody = "Basic bm9ib2R5Og=="; // base64("nobody:")
    let owner = |p: &std::path::Path| {
        let m = std::fs::metadata(p).unwrap();
        (m.uid(), m.gid())
    };
    let nobody_ids = (nobody.uid.as_raw(), nobody.gid.as_raw());
    rt().block_on(async {
        let a = agent().await;
        // A root-owned 0755 directory the user could not write into.
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        let path = format!("{d}/new/deeper/conf.txt");
        let (status, body) = a
            .request(
                "POST",
                &format!("/files?path={path}&username=nobody"),
                &[("content-type", "application/octet-stream")],
                "v=1",
            )
            .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        assert_eq!(owner(std::path::Path::new(&path)), nobody_ids);
        assert_eq!(owner(&dir.path().join("new/deeper")), nobody_ids);
        assert_eq!(owner(&dir.path().join("new")), nobody_ids);
        assert_eq!(
            owner(dir.path()),
            (0, 0),
            "an existing directory keeps its owner"
        );
        // An existing root-only file is overwritten and handed over.
        let secret = dir.path().join("secret");
        std::fs::write(&secret, b"s").unwrap();
        std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let (status, got) = a
            .request(
                "GET",
                &format!("/files?path={}&username=nobody", secret.display()),
                &[],
                "",
            )
            .await;
        assert_eq!((status, &got[..]), (200, &b"s"[..]));

        // MakeDir and Move as the user, in root's directory.
        let mk = |p: String| {
            http::Request::builder()
                .method("POST")
                .uri(format!("http://{}/filesystem.Filesystem/MakeDir", a.addr))
                .header("content-type", "application/json")
                .header("authorization", as_nobody)
                .body(Full::new(Bytes::from(json!({"path": p}).to_string())))
                .unwrap()
        };
        let resp = a.client.request(mk(format!("{d}/m/n"))).await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(owner(&dir.path().join("m")), nobody_ids);
        let resp = a.client.request(mk(format!("{d}/m/n"))).await.unwrap();
        assert_eq!(resp.status(), 409);
        let resp = a.client.request(mk(path.clone())).await.unwrap();
        assert_eq!(
            resp.status(),
            400,
            "a file in the way is an invalid argument"
        );

        // A procfs file says size 0: it is read to its end, plain, gzip
        // and by range.
        let (status, plain) = a
            .request(
                "GET",
                "/files?path=/proc/self/mountinfo&username=nobody",
                &[],
                "",
            )
            .await;
        assert_eq!(status, 200);
        assert!(plain.len() > 20, "read {} bytes of mountinfo", plain.len());
        let version = std::fs::read("/proc/version").unwrap();
        let (status, zipped) = a
            .request(
                "GET",
                "/files?path=/proc/version&username=nobody",
                &[("accept-encoding", "gzip")],
                "",
            )
            .await;
        assert_eq!(status, 200);
        let mut unzipped = Vec::new();
        std::io::Read::read_to_end(
            &mut flate2::read::GzDecoder::new(&zipped[..]),
            &mut unzipped,
        )
        .unwrap();
        assert_eq!(unzipped, version);
        let (status, part) = a
            .request(
                "GET",
                "/files?path=/proc/version&username=nobody",
                &[("range", "bytes=0-4")],
                "",
            )
            .await;
        assert_eq!((status, &part[..]), (206, &version[..5]));
        let (status, part) = a
            .request(
                "GET",
                &format!("/files?path={path}&username=nobody"),
                &[("range", "bytes=-2")],
                "",
            )
            .await;
        assert_eq!((status, &part[..]), (206, &b"=1"[..]));
        let (status, _) = a
            .request(
                "GET",
                &format!("/files?path={path}&username=nobody"),
                &[("range", "bytes=9-")],
                "",
            )
            .await;
        assert_eq!(status, 416);
        let (status, body) = a
            .request("GET", &format!("/files?path={d}&username=nobody"), &[], "")
            .await;
        assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
        let (status, _) = a
            .request(
                "GET",
                &format!("/files?path={d}/missing&username=nobody"),
                &[],
                "",
            )
            .await;
        assert_eq!(status, 404);
    });
}

#[test]
fn polled_watcher_reports_recursive_events() {
    rt().block_on(async {
        let a = agent().await;
        let dir = tempfile::tempdir().unwrap();
        let (status, body) = a
            .unary(
                "/filesystem.Filesystem/CreateWatcher",
                json!({"path": dir.path(), "recursive": true}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        let id = body["watcherId"].as_str().unwrap().to_string();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        // Wait until the new directory is watched (its create was seen).
        let mut seen = Vec::new();
        let poll = |want: &'static str| {
            let a = &a;
            let id = id.clone();
            async move {
                let mut got = Vec::new();
                for _ in 0..200 {
                    let (_, body) = a
                        .unary(
                            "/filesystem.Filesystem/GetWatcherEvents",
                            json!({"watcherId": id}),
                        )
                        .await;
                    for e in body["events"].as_array().unwrap() {
                        got.push((
                            e["name"].as_str().unwrap().to_string(),
                            e["type"].as_str().unwrap().to_string(),
                        ));
                    }
                    if got.iter().any(|(n, _)| n == want) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(25)).await;
                }
                got
            }
        };
        seen.extend(poll("sub").await);
        std::fs::write(dir.path().join("sub/f.txt"), b"x").unwrap();
        std::fs::remove_file(dir.path().join("sub/f.txt")).unwrap();
        seen.extend(poll("sub/f.txt").await);
        for _ in 0..100 {
            if seen
                .iter()
                .any(|(n, t)| n == "sub/f.txt" && t == "EVENT_TYPE_REMOVE")
            {
                break;
            }
            seen.extend(poll("never").await);
        }
        assert!(
            seen.contains(&("sub".into(), "EVENT_TYPE_CREATE".into())),
            "{seen:?}"
        );
        assert!(
            seen.contains(&("sub/f.txt".into(), "EVENT_TYPE_CREATE".into())),
            "{seen:?}"
        );
        assert!(
            seen.contains(&("sub/f.txt".into(), "EVENT_TYPE_WRITE".into())),
            "{seen:?}"
        );
        assert!(
            seen.contains(&("sub/f.txt".into(), "EVENT_TYPE_REMOVE".into())),
            "{seen:?}"
        );
        let (status, _) = a
            .unary(
                "/filesystem.Filesystem/RemoveWatcher",
                json!({"watcherId": id}),
            )
            .await;
        assert_eq!(status, 200);
        let (status, body) = a
            .unary(
                "/filesystem.Filesystem/GetWatcherEvents",
                json!({"watcherId": id}),
            )
            .await;
        assert_eq!((status, body["code"].as_str()), (404, Some("not_found")));
    });
}

#[test]
fn access_token_is_enforced_after_init() {
    rt().block_on(async {
        let a = agent().await;
        let (status, _) = a
            .request(
                "POST",
                "/init",
                &[("content-type", "application/json")],
                r#"{"accessToken":"sekrit","envVars":{"A":"1"}}"#,
            )
            .await;
        assert_eq!(status, 204);
        let (status, body) = a.request("GET", "/envs", &[], "").await;
        assert_eq!(status, 401);
        assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["code"], 401);
        let (status, body) = a
            .request("GET", "/envs", &[("x-access-token", "sekrit")], "")
            .await;
        assert_eq!(
            (status, serde_json::from_slice::<Value>(&body).unwrap()),
            (200, json!({"A": "1"}))
        );
        let (status, _) = a.unary("/process.Process/List", json!({})).await;
        assert_eq!(status, 401);
        let (status, _) = a.request("GET", "/health", &[], "").await;
        assert_eq!(status, 204);
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), b"signed").unwrap();
        let p = file.path().display().to_string();
        let (status, _) = a.request("GET", &format!("/files?path={p}"), &[], "").await;
        assert_eq!(status, 401);
        let sig = crate::envd::auth::sign(&p, "read", "root", "sekrit", None);
        let url = format!(
            "/files?path={p}&username=root&signature={}",
            sig.replace('+', "%2B").replace('/', "%2F")
        );
        let (status, body) = a.request("GET", &url, &[], "").await;
        assert_eq!((status, &body[..]), (200, &b"signed"[..]));
        let (status, _) = a
            .request(
                "GET",
                &url.replace("username=root", "username=nobody"),
                &[],
                "",
            )
            .await;
        assert_eq!(status, 401);
    });
}

#[test]
fn a_full_disk_is_507() {
    rt().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let mounted = nix::mount::mount(
            Some("tmpfs"),
            dir.path(),
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=1m"),
        );
        if mounted.is_err() {
            return; // needs root (CI runs as root)
        }
        struct Unmount<'a>(&'a std::path::Path);
        impl Drop for Unmount<'_> {
            fn drop(&mut self) {
                let _ = nix::mount::umount2(self.0, nix::mount::MntFlags::MNT_DETACH);
            }
        }
        let _guard = Unmount(dir.path());
        let a = agent().await;
        let path = dir.path().join("too-big.bin");
        let (status, body) = a
            .request(
                "POST",
                &format!("/files?path={}", path.display()),
                &[
                    ("content-type", "application/octet-stream"),
                    ("authorization", ROOT),
                ],
                vec![7u8; 3 << 20],
            )
            .await;
        assert_eq!(status, 507, "{}", String::from_utf8_lossy(&body));
        assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["code"], 507);
    });
}

/// A server stream read frame by frame while it is still open.
struct OpenStream {
    body: hyper::body::Incoming,
    dec: Decoder,
}

impl OpenStream {
    async fn next(&mut self) -> Option<Frame> {
        loop {
            if let Some(f) = self.dec.next_frame().unwrap() {
                return Some(f);
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.dec.push(&data);
                    }
                }
                _ => return None,
            }
        }
    }

    async fn next_msg(&mut self) -> Value {
        match self.next().await {
            Some(Frame::Message(m)) => serde_json::from_slice(&m).unwrap(),
            other => panic!("expected a message, got {other:?}"),
        }
    }
}

impl Agent {
    async fn open(&self, path: &str, msg: Value) -> OpenStream {
        let req = http::Request::builder()
            .method("POST")
            .uri(format!("http://{}{}", self.addr, path))
            .header("content-type", "application/connect+json")
            .header("authorization", ROOT)
            .body(Full::new(tine_connect::encode_message(&msg).unwrap()))
            .unwrap();
        let resp = self.client.request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        OpenStream {
            body: resp.into_body(),
            dec: Decoder::new(64 << 20),
        }
    }
}

#[test]
fn tags_list_input_and_many_clients() {
    rt().block_on(async {
        let a = agent().await;
        let mut first = a
            .open(
                "/process.Process/Start",
                json!({"process": {"cmd": "cat"}, "stdin": true, "tag": "t1"}),
            )
            .await;
        let pid = first.next_msg().await["event"]["start"]["pid"]
            .as_u64()
            .unwrap();
        let (_, list) = a.unary("/process.Process/List", json!({})).await;
        let me = list["processes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["pid"] == pid)
            .unwrap()
            .clone();
        assert_eq!(me["tag"], "t1");
        assert_eq!(me["config"]["cmd"], "cat");

        let mut second = a
            .open(
                "/process.Process/Connect",
                json!({"process": {"tag": "t1"}}),
            )
            .await;
        assert_eq!(
            second.next_msg().await["event"]["start"]["pid"].as_u64(),
            Some(pid)
        );
        let (status, _) = a
            .unary(
                "/process.Process/SendInput",
                json!({"process": {"pid": pid}, "input": {"stdin": "aGVsbG8K"}}),
            )
            .await;
        assert_eq!(status, 200);
        assert_eq!(
            first.next_msg().await["event"]["data"]["stdout"],
            "aGVsbG8K"
        );
        assert_eq!(
            second.next_msg().await["event"]["data"]["stdout"],
            "aGVsbG8K"
        );
        // A PTY operation on a pipe process is a failed precondition.
        let (status, body) = a
            .unary(
                "/process.Process/Update",
                json!({"process": {"pid": pid}, "pty": {"size": {"cols": 10, "rows": 10}}}),
            )
            .await;
        assert_eq!(
            (status, body["code"].as_str()),
            (400, Some("failed_precondition"))
        );
        // The first client leaves; the process goes on for the second.
        drop(first);
        let (status, _) = a
            .unary(
                "/process.Process/CloseStdin",
                json!({"process": {"pid": pid}}),
            )
            .await;
        assert_eq!(status, 200);
        let end = second.next_msg().await;
        assert_eq!(end["event"]["end"]["exitCode"], 0, "{end}");
        assert!(matches!(second.next().await, Some(Frame::End(e)) if e.error.is_none()));
        let (_, list) = a.unary("/process.Process/List", json!({})).await;
        assert!(!list["processes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["pid"] == pid));
    });
}

#[test]
fn stream_input_takes_a_client_stream() {
    rt().block_on(async {
        let a = agent().await;
        let mut proc = a
            .open(
                "/process.Process/Start",
                json!({"process": {"cmd": "cat"}, "stdin": true}),
            )
            .await;
        let pid = proc.next_msg().await["event"]["start"]["pid"]
            .as_u64()
            .unwrap();
        let mut body = Vec::new();
        body.extend_from_slice(
            &tine_connect::encode_message(&json!({"start": {"process": {"pid": pid}}})).unwrap(),
        );
        body.extend_from_slice(
            &tine_connect::encode_message(&json!({"data": {"input": {"stdin": "YWI="}}})).unwrap(),
        );
        body.extend_from_slice(&tine_connect::encode_message(&json!({"keepalive": {}})).unwrap());
        body.extend_from_slice(
            &tine_connect::encode_message(&json!({"data": {"input": {"stdin": "Ywo="}}})).unwrap(),
        );
        let (status, resp) = a
            .request(
                "POST",
                "/process.Process/StreamInput",
                &[
                    ("content-type", "application/connect+json"),
                    ("authorization", ROOT),
                ],
                body,
            )
            .await;
        assert_eq!(status, 200);
        let (msgs, err) = decode_stream(&resp);
        assert_eq!(
            (msgs, err),
            (vec![json!({})], None),
            "exactly one empty message, then a clean end"
        );
        let mut out = Vec::new();
        while out.len() < 4 {
            let m = proc.next_msg().await;
            out.extend(
                crate::envd::proto::decode_bytes(m["event"]["data"]["stdout"].as_str().unwrap())
                    .unwrap(),
            );
        }
        assert_eq!(out, b"abc\n");
        let (status, _) = a
            .unary(
                "/process.Process/SendSignal",
                json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGTERM"}),
            )
            .await;
        assert_eq!(status, 200);
        let end = proc.next_msg().await;
        assert_eq!(end["event"]["end"]["status"], "signal: terminated");
        assert_eq!(end["event"]["end"]["exited"], false);
    });
}

#[test]
fn pty_start_resize_and_input() {
    rt().block_on(async {
        let a = agent().await;
        let mut p = a.open("/process.Process/Start", json!({"process": {"cmd": "/bin/sh", "envs": {"PS1": ""}}, "pty": {"size": {"cols": 70, "rows": 20}}})).await;
        let pid = p.next_msg().await["event"]["start"]["pid"].as_u64().unwrap();
        let (status, _) = a.unary("/process.Process/Update", json!({"process": {"pid": pid}, "pty": {"size": {"cols": 99, "rows": 11}}})).await;
        assert_eq!(status, 200);
        let (status, _) = a.unary("/process.Process/SendInput", json!({"process": {"pid": pid}, "input": {"pty": "c3R0eSBzaXplOyBleGl0IDQK"}})).await; // "stty size; exit 4\n"
        assert_eq!(status, 200);
        let mut out = Vec::new();
        let end = loop {
            let m = p.next_msg().await;
            if let Some(data) = m["event"]["data"]["pty"].as_str() {
                out.extend(crate::envd::proto::decode_bytes(data).unwrap());
            } else if m["event"].get("end").is_some() {
                break m;
            }
        };
        assert!(String::from_utf8_lossy(&out).contains("11 99"), "{}", String::from_utf8_lossy(&out));
        assert_eq!(end["event"]["end"]["exitCode"], 4);
    });
}

#[test]
fn the_last_output_before_exit_is_never_lost() {
    rt().block_on(async {
        let a = agent().await;
        let runs = (0..60).map(|_| a.stream("/process.Process/Start", json!({"process": {"cmd": "/bin/sh", "args": ["-c", "echo 1; echo 2; pwd"], "cwd": "/tmp"}}), &[]));
        for (events, err) in futures::future::join_all(runs).await {
            assert!(err.is_none());
            assert_eq!(String::from_utf8(stdout_of(&events)).unwrap(), "1\n2\n/tmp\n");
        }
    });
}

#[test]
fn init_sets_defaults_time_and_entropy() {
    rt().block_on(async {
        let a = agent().await;
        let now = crate::envd::time::format_system_time(std::time::SystemTime::now());
        let body = json!({
            "envVars": {"FROM_INIT": "yes"},
            "defaultUser": "root",
            "defaultWorkdir": "/tmp",
            "timestamp": now,
            "entropy": "c29tZSBmcmVzaCByYW5kb21uZXNz",
            "hyperloopIP": "10.0.0.1",
            "volumeMounts": []
        });
        let (status, resp) = a
            .request(
                "POST",
                "/init",
                &[("content-type", "application/json")],
                body.to_string(),
            )
            .await;
        assert_eq!(status, 204, "{}", String::from_utf8_lossy(&resp));
        // No Authorization header: the default user and workdir from /init.
        let msg = tine_connect::encode_message(
            &json!({"process": {"cmd": "/bin/sh", "args": ["-c", "id -u; pwd; echo $FROM_INIT"]}}),
        )
        .unwrap();
        let (status, resp) = a
            .request(
                "POST",
                "/process.Process/Start",
                &[("content-type", "application/connect+json")],
                msg,
            )
            .await;
        assert_eq!(status, 200);
        let (events, err) = decode_stream(&resp);
        assert!(err.is_none(), "{err:?}");
        assert_eq!(
            String::from_utf8(stdout_of(&events)).unwrap(),
            "0\n/tmp\nyes\n"
        );
        for bad in [
            json!({"timestamp": "yesterday"}),
            json!({"defaultUser": "no-such-user-tine"}),
            json!({"entropy": "***"}),
            json!({"defaultWorkdir": "relative"}),
        ] {
            let (status, _) = a
                .request(
                    "POST",
                    "/init",
                    &[("content-type", "application/json")],
                    bad.to_string(),
                )
                .await;
            assert_eq!(status, 400, "{bad}");
        }
        let (status, resp) = a.request("GET", "/metrics", &[], "").await;
        let m: Value = serde_json::from_slice(&resp).unwrap();
        assert_eq!(status, 200);
        assert!(
            m["mem_total"].as_u64().unwrap() > 0
                && m["disk_total"].as_u64().unwrap() > 0
                && m["ts"].as_i64().unwrap() > 0
        );
    });
}

fn gzip(data: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(data).unwrap();
    enc.finish().unwrap()
}

#[test]
fn compressed_requests_and_binary_protobuf() {
    rt().block_on(async {
        let a = agent().await;
        let body = gzip(br#"{"path":"/"}"#);
        let (status, resp) = a
            .request(
                "POST",
                "/filesystem.Filesystem/Stat",
                &[
                    ("content-type", "application/json"),
                    ("content-encoding", "gzip"),
                    ("authorization", ROOT),
                ],
                body,
            )
            .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
        assert_eq!(
            serde_json::from_slice::<Value>(&resp).unwrap()["entry"]["path"],
            "/"
        );
        let (status, _) = a
            .request(
                "POST",
                "/filesystem.Filesystem/Stat",
                &[
                    ("content-type", "application/json"),
                    ("content-encoding", "br"),
                ],
                "{}",
            )
            .await;
        assert_eq!(status, 501);
        let (status, _) = a
            .request(
                "POST",
                "/filesystem.Filesystem/Stat",
                &[
                    ("content-type", "application/json"),
                    ("content-encoding", "gzip"),
                ],
                "not gzip",
            )
            .await;
        assert_eq!(status, 400);

        // A compressed envelope on a stream, answered in binary protobuf.
        let msg = crate::envd::protobin::encode(
            crate::envd::schemas("process.Process", "Start").unwrap().0,
            &json!({"process": {"cmd": "echo", "args": ["z"]}}),
        )
        .unwrap();
        let env = tine_connect::encode_envelope(tine_connect::FLAG_COMPRESSED, &gzip(&msg));
        let hdrs = [
            ("content-type", "application/connect+proto"),
            ("connect-content-encoding", "gzip"),
            ("authorization", ROOT),
        ];
        let (status, resp) = a
            .request("POST", "/process.Process/Start", &hdrs, env.clone())
            .await;
        assert_eq!(status, 200);
        let mut dec = Decoder::new(1 << 20);
        dec.push(&resp);
        let resp_schema = crate::envd::schemas("process.Process", "Start").unwrap().1;
        let mut events = Vec::new();
        while let Some(Frame::Message(m)) = dec.next_frame().unwrap() {
            events.push(crate::envd::protobin::decode(resp_schema, &m).unwrap());
        }
        assert!(events[0]["event"]["start"]["pid"].as_u64().unwrap() > 0);
        assert_eq!(events[1]["event"]["data"]["stdout"], "ego=");
        assert_eq!(events.last().unwrap()["event"]["end"]["exited"], true);
        // Without the encoding header a compressed envelope is refused.
        let (_, resp) = a
            .request(
                "POST",
                "/process.Process/Start",
                &[
                    ("content-type", "application/connect+proto"),
                    ("authorization", ROOT),
                ],
                env,
            )
            .await;
        assert_eq!(decode_stream(&resp).1.unwrap().code, Code::InvalidArgument);
    });
}

/// Garbage to every method in every encoding: every request gets an answer
/// (a panic would drop the connection instead) and the agent stays healthy.
#[test]
fn garbage_never_takes_the_agent_down() {
    rt().block_on(async {
        let a = agent().await;
        let methods = [
            ("process.Process", "List"),
            ("process.Process", "Start"),
            ("process.Process", "Connect"),
            ("process.Process", "Update"),
            ("process.Process", "StreamInput"),
            ("process.Process", "SendInput"),
            ("process.Process", "SendSignal"),
            ("process.Process", "CloseStdin"),
            ("filesystem.Filesystem", "Stat"),
            ("filesystem.Filesystem", "MakeDir"),
            ("filesystem.Filesystem", "Move"),
            ("filesystem.Filesystem", "ListDir"),
            ("filesystem.Filesystem", "Remove"),
            ("filesystem.Filesystem", "WatchDir"),
            ("filesystem.Filesystem", "CreateWatcher"),
            ("filesystem.Filesystem", "GetWatcherEvents"),
            ("filesystem.Filesystem", "RemoveWatcher"),
        ];
        // Methods that change things only see text that is never a valid
        // binary request (a random path could otherwise be removed).
        let mutating = ["Start", "MakeDir", "Move", "Remove"];
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut rand_bytes = |n: usize| -> Vec<u8> {
            (0..n)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect()
        };
        let nobody = "Basic bm9ib2R5Og=="; // base64("nobody:")
        for (service, method) in methods {
            let path = format!("/{service}/{method}");
            for round in 0..12 {
                let mut body = rand_bytes(round * 7 % 61);
                if mutating.contains(&method) {
                    body.retain(|b| b.is_ascii_graphic() && *b != b'{' && *b != b'[');
                }
                let mut enveloped =
                    tine_connect::encode_envelope((round % 4) as u8, &body).to_vec();
                if round % 3 == 0 {
                    enveloped.truncate(enveloped.len() / 2);
                }
                let cases: Vec<(&str, Vec<u8>)> = if mutating.contains(&method) {
                    vec![
                        ("application/json", body.clone()),
                        ("application/connect+json", enveloped),
                    ]
                } else {
                    vec![
                        ("application/json", body.clone()),
                        ("application/proto", body.clone()),
                        ("application/connect+json", enveloped.clone()),
                        ("application/connect+proto", enveloped),
                        ("text/plain", body.clone()),
                    ]
                };
                for (ct, payload) in cases {
                    let req = http::Request::builder()
                        .method("POST")
                        .uri(format!("http://{}{}", a.addr, path))
                        .header("content-type", ct)
                        .header("authorization", nobody)
                        .header("connect-timeout-ms", "2000")
                        .body(Full::new(Bytes::from(payload)))
                        .unwrap();
                    let resp = a
                        .client
                        .request(req)
                        .await
                        .unwrap_or_else(|e| panic!("{path} {ct}: no answer: {e}"));
                    let status = resp.status().as_u16();
                    let body =
                        tokio::time::timeout(Duration::from_secs(10), resp.into_body().collect())
                            .await;
                    assert!(
                        body.is_ok_and(|b| b.is_ok()),
                        "{path} {ct}: the answer did not complete"
                    );
                    assert!(
                        status < 500 || status == 501,
                        "{path} {ct}: status {status}"
                    );
                }
            }
        }
        let (status, _) = a.request("GET", "/health", &[], "").await;
        assert_eq!(status, 204);
    });
}
