//! `package process` messages in proto3 JSON, each with the binary
//! protobuf schema that mirrors it (see [`crate::envd::protobin`]);
//! [`schemas`] maps a method to its request and response.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::envd::proto::{de_bytes, de_opt_u32, de_u32, ser_bytes, EnumValue};
use crate::envd::protobin::{f, rep, Schema, Ty, EMPTY};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessConfig {
    #[serde(default)]
    pub cmd: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub envs: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// Mirrors [`ProcessConfig`].
pub static PROCESS_CONFIG: Schema = Schema {
    fields: &[
        f(1, "cmd", Ty::Str),
        rep(2, "args", Ty::Str),
        f(3, "envs", Ty::StrMap),
        f(4, "cwd", Ty::Str),
    ],
};

#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub struct PtySize {
    #[serde(default, deserialize_with = "de_u32")]
    pub cols: u32,
    #[serde(default, deserialize_with = "de_u32")]
    pub rows: u32,
}

/// Mirrors [`PtySize`].
pub static PTY_SIZE: Schema = Schema {
    fields: &[f(1, "cols", Ty::U32), f(2, "rows", Ty::U32)],
};

#[derive(Debug, Clone, Default, Deserialize)]
pub struct Pty {
    #[serde(default)]
    pub size: Option<PtySize>,
}

/// Mirrors [`Pty`].
pub static PTY: Schema = Schema {
    fields: &[f(1, "size", Ty::Msg(&PTY_SIZE))],
};

#[derive(Debug, Default, Deserialize)]
pub struct StartRequest {
    #[serde(default)]
    pub process: Option<ProcessConfig>,
    #[serde(default)]
    pub pty: Option<Pty>,
    #[serde(default)]
    pub tag: Option<String>,
    #[serde(default)]
    pub stdin: Option<bool>,
}

/// Mirrors [`StartRequest`].
pub static START_REQUEST: Schema = Schema {
    fields: &[
        f(1, "process", Ty::Msg(&PROCESS_CONFIG)),
        f(2, "pty", Ty::Msg(&PTY)),
        f(3, "tag", Ty::Str),
        f(4, "stdin", Ty::Bool),
    ],
};

#[derive(Debug, Clone, Default, Deserialize)]
pub struct ProcessSelector {
    #[serde(default, deserialize_with = "de_opt_u32")]
    pub pid: Option<u32>,
    #[serde(default)]
    pub tag: Option<String>,
}

/// Mirrors [`ProcessSelector`].
pub static SELECTOR: Schema = Schema {
    fields: &[f(1, "pid", Ty::U32), f(2, "tag", Ty::Str)],
};

#[derive(Debug, Default, Deserialize)]
pub struct SelectorRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
}

/// Mirrors [`SelectorRequest`] (`ConnectRequest`, `CloseStdinRequest`, and
/// `StreamInputRequest.start`).
pub static SELECTOR_REQUEST: Schema = Schema {
    fields: &[f(1, "process", Ty::Msg(&SELECTOR))],
};

#[derive(Debug, Serialize)]
pub struct ProcessInfo {
    pub config: ProcessConfig,
    pub pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

/// Mirrors [`ProcessInfo`].
pub static PROCESS_INFO: Schema = Schema {
    fields: &[
        f(1, "config", Ty::Msg(&PROCESS_CONFIG)),
        f(2, "pid", Ty::U32),
        f(3, "tag", Ty::Str),
    ],
};

#[derive(Debug, Serialize)]
pub struct ListResponse {
    pub processes: Vec<ProcessInfo>,
}

/// Mirrors [`ListResponse`].
pub static LIST_RESPONSE: Schema = Schema {
    fields: &[rep(1, "processes", Ty::Msg(&PROCESS_INFO))],
};

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum ProcessEvent {
    Start { pid: u32 },
    Data(DataEvent),
    End(EndEvent),
    Keepalive {},
}

/// Mirrors [`ProcessEvent`] (a oneof).
pub static PROCESS_EVENT: Schema = Schema {
    fields: &[
        f(1, "start", Ty::Msg(&START_EVENT)),
        f(2, "data", Ty::Msg(&DATA_EVENT)),
        f(3, "end", Ty::Msg(&END_EVENT)),
        f(4, "keepalive", Ty::Msg(&EMPTY)),
    ],
};

/// Mirrors [`ProcessEvent::Start`].
pub static START_EVENT: Schema = Schema {
    fields: &[f(1, "pid", Ty::U32)],
};

/// `StartResponse` and `ConnectResponse` both wrap one event.
#[derive(Debug, Serialize)]
pub struct EventResponse<'a> {
    pub event: &'a ProcessEvent,
}

/// Mirrors [`EventResponse`].
pub static EVENT_RESPONSE: Schema = Schema {
    fields: &[f(1, "event", Ty::Msg(&PROCESS_EVENT))],
};

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum DataEvent {
    Stdout(#[serde(serialize_with = "ser_bytes")] bytes::Bytes),
    Stderr(#[serde(serialize_with = "ser_bytes")] bytes::Bytes),
    Pty(#[serde(serialize_with = "ser_bytes")] bytes::Bytes),
}

/// Mirrors [`DataEvent`] (a oneof).
pub static DATA_EVENT: Schema = Schema {
    fields: &[
        f(1, "stdout", Ty::Bytes),
        f(2, "stderr", Ty::Bytes),
        f(3, "pty", Ty::Bytes),
    ],
};

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndEvent {
    pub exit_code: i32,
    pub exited: bool,
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Mirrors [`EndEvent`].
pub static END_EVENT: Schema = Schema {
    fields: &[
        f(1, "exitCode", Ty::S32),
        f(2, "exited", Ty::Bool),
        f(3, "status", Ty::Str),
        f(4, "error", Ty::Str),
    ],
};

#[derive(Debug, Default, Deserialize)]
pub struct ProcessInput {
    #[serde(default, deserialize_with = "de_opt_bytes")]
    pub stdin: Option<Vec<u8>>,
    #[serde(default, deserialize_with = "de_opt_bytes")]
    pub pty: Option<Vec<u8>>,
}

/// Mirrors [`ProcessInput`].
pub static PROCESS_INPUT: Schema = Schema {
    fields: &[f(1, "stdin", Ty::Bytes), f(2, "pty", Ty::Bytes)],
};

fn de_opt_bytes<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
    de_bytes(d).map(Some)
}

#[derive(Debug, Default, Deserialize)]
pub struct SendInputRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
    #[serde(default)]
    pub input: Option<ProcessInput>,
}

/// Mirrors [`SendInputRequest`].
pub static SEND_INPUT_REQUEST: Schema = Schema {
    fields: &[
        f(1, "process", Ty::Msg(&SELECTOR)),
        f(2, "input", Ty::Msg(&PROCESS_INPUT)),
    ],
};

#[derive(Debug, Default, Deserialize)]
pub struct StreamInputRequest {
    #[serde(default)]
    pub start: Option<SelectorRequest>,
    #[serde(default)]
    pub data: Option<StreamInputData>,
}

/// Mirrors [`StreamInputRequest`] (a oneof; `keepalive` has no struct
/// member, serde ignores it).
pub static STREAM_INPUT_REQUEST: Schema = Schema {
    fields: &[
        f(1, "start", Ty::Msg(&SELECTOR_REQUEST)),
        f(2, "data", Ty::Msg(&STREAM_INPUT_DATA)),
        f(3, "keepalive", Ty::Msg(&EMPTY)),
    ],
};

#[derive(Debug, Default, Deserialize)]
pub struct StreamInputData {
    #[serde(default)]
    pub input: Option<ProcessInput>,
}

/// Mirrors [`StreamInputData`].
pub static STREAM_INPUT_DATA: Schema = Schema {
    fields: &[f(2, "input", Ty::Msg(&PROCESS_INPUT))],
};

#[derive(Debug, Default, Deserialize)]
pub struct SendSignalRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
    #[serde(default)]
    pub signal: Option<EnumValue>,
}

/// `enum Signal`: the values of [`SendSignalRequest::signal`].
pub const SIGNAL: &[(&str, i64)] = &[
    ("SIGNAL_UNSPECIFIED", 0),
    ("SIGNAL_SIGTERM", 15),
    ("SIGNAL_SIGKILL", 9),
];

/// Mirrors [`SendSignalRequest`].
pub static SEND_SIGNAL_REQUEST: Schema = Schema {
    fields: &[
        f(1, "process", Ty::Msg(&SELECTOR)),
        f(2, "signal", Ty::Enum(SIGNAL)),
    ],
};

#[derive(Debug, Default, Deserialize)]
pub struct UpdateRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
    #[serde(default)]
    pub pty: Option<Pty>,
}

/// Mirrors [`UpdateRequest`].
pub static UPDATE_REQUEST: Schema = Schema {
    fields: &[
        f(1, "process", Ty::Msg(&SELECTOR)),
        f(2, "pty", Ty::Msg(&PTY)),
    ],
};

/// The empty responses (`SendInputResponse {}` and friends).
#[derive(Debug, Serialize)]
pub struct Empty {}

/// Request and response schemas of `process.Process/<method>` (the
/// [`Empty`] struct's schema is [`EMPTY`]).
pub fn schemas(method: &str) -> Option<(&'static Schema, &'static Schema)> {
    Some(match method {
        "List" => (&EMPTY, &LIST_RESPONSE),
        "Start" => (&START_REQUEST, &EVENT_RESPONSE),
        "Connect" => (&SELECTOR_REQUEST, &EVENT_RESPONSE),
        "Update" => (&UPDATE_REQUEST, &EMPTY),
        "StreamInput" => (&STREAM_INPUT_REQUEST, &EMPTY),
        "SendInput" => (&SEND_INPUT_REQUEST, &EMPTY),
        "SendSignal" => (&SEND_SIGNAL_REQUEST, &EMPTY),
        "CloseStdin" => (&SELECTOR_REQUEST, &EMPTY),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_serialize_as_oneofs() {
        let j = |e: &ProcessEvent| serde_json::to_string(&EventResponse { event: e }).unwrap();
        assert_eq!(
            j(&ProcessEvent::Start { pid: 7 }),
            r#"{"event":{"start":{"pid":7}}}"#
        );
        assert_eq!(
            j(&ProcessEvent::Data(DataEvent::Stdout(
                bytes::Bytes::from_static(b"hi\n")
            ))),
            r#"{"event":{"data":{"stdout":"aGkK"}}}"#
        );
        assert_eq!(
            j(&ProcessEvent::Keepalive {}),
            r#"{"event":{"keepalive":{}}}"#
        );
        let end = EndEvent {
            exit_code: -1,
            exited: false,
            status: "signal: killed".into(),
            error: Some("signal: killed".into()),
        };
        assert_eq!(
            j(&ProcessEvent::End(end)),
            r#"{"event":{"end":{"exitCode":-1,"exited":false,"status":"signal: killed","error":"signal: killed"}}}"#
        );
    }

    #[test]
    fn requests_parse_like_the_sdks_send_them() {
        let r: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"]},"stdin":false}"#,
        )
        .unwrap();
        assert_eq!(r.process.unwrap().args[2], "echo hi");
        let r: SendInputRequest =
            serde_json::from_str(r#"{"process":{"pid":"12"},"input":{"pty":"aGk="}}"#).unwrap();
        assert_eq!(r.process.unwrap().pid, Some(12));
        assert_eq!(r.input.unwrap().pty.unwrap(), b"hi");
        let r: UpdateRequest =
            serde_json::from_str(r#"{"process":{"tag":"t"},"pty":{"size":{"cols":80,"rows":24}}}"#)
                .unwrap();
        assert_eq!(r.pty.unwrap().size.unwrap().rows, 24);
    }
}
