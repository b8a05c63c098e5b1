//! `package process` messages in proto3 JSON.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::envd::proto::{de_bytes, de_opt_u32, de_u32, ser_bytes, EnumValue};

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

#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub struct PtySize {
    #[serde(default, deserialize_with = "de_u32")]
    pub cols: u32,
    #[serde(default, deserialize_with = "de_u32")]
    pub rows: u32,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct Pty {
    #[serde(default)]
    pub size: Option<PtySize>,
}

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

#[derive(Debug, Clone, Default, Deserialize)]
pub struct ProcessSelector {
    #[serde(default, deserialize_with = "de_opt_u32")]
    pub pid: Option<u32>,
    #[serde(default)]
    pub tag: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub struct SelectorRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
}

#[derive(Debug, Serialize)]
pub struct ProcessInfo {
    pub config: ProcessConfig,
    pub pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct ListResponse {
    pub processes: Vec<ProcessInfo>,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum ProcessEvent {
    Start { pid: u32 },
    Data(DataEvent),
    End(EndEvent),
    Keepalive {},
}

/// `StartResponse` and `ConnectResponse` both wrap one event.
#[derive(Debug, Serialize)]
pub struct EventResponse<'a> {
    pub event: &'a ProcessEvent,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum DataEvent {
    Stdout(#[serde(serialize_with = "ser_bytes")] bytes::Bytes),
    Stderr(#[serde(serialize_with = "ser_bytes")] bytes::Bytes),
    Pty(#[serde(serialize_with = "ser_bytes")] bytes::Bytes),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndEvent {
    pub exit_code: i32,
    pub exited: bool,
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub struct ProcessInput {
    #[serde(default, deserialize_with = "de_opt_bytes")]
    pub stdin: Option<Vec<u8>>,
    #[serde(default, deserialize_with = "de_opt_bytes")]
    pub pty: Option<Vec<u8>>,
}

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

#[derive(Debug, Default, Deserialize)]
pub struct StreamInputRequest {
    #[serde(default)]
    pub start: Option<SelectorRequest>,
    #[serde(default)]
    pub data: Option<StreamInputData>,
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamInputData {
    #[serde(default)]
    pub input: Option<ProcessInput>,
}

#[derive(Debug, Default, Deserialize)]
pub struct SendSignalRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
    #[serde(default)]
    pub signal: Option<EnumValue>,
}

#[derive(Debug, Default, Deserialize)]
pub struct UpdateRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
    #[serde(default)]
    pub pty: Option<Pty>,
}

/// The empty responses (`SendInputResponse {}` and friends).
#[derive(Debug, Serialize)]
pub struct Empty {}

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
