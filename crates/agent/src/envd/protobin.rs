//! Binary protobuf for clients that use Connect's default codec
//! (`application/proto`, `application/connect+proto`).
//!
//! The handlers speak proto3 JSON only; this module transcodes at the edge
//! between the binary wire format and the JSON value the handlers read and
//! write, driven by a schema table per message (field number, JSON name,
//! type). Unknown fields are skipped, as proto3 requires.
//!
//! This module is the generic codec ([`Schema`], [`decode`], [`encode`]).
//! Each service's tables sit next to the serde structs they mirror:
//! `package process` in [`super::process::proto`], `package filesystem` in
//! [`super::filesystem`] and its `entry` and `watch` modules; `schemas` in
//! [`super`]
//! finds a call's pair.

use base64::Engine;
use serde_json::{Map, Value};

#[derive(Debug, Clone, Copy)]
pub enum Ty {
    Str,
    Bytes,
    Bool,
    U32,
    S32,
    I64,
    Enum(&'static [(&'static str, i64)]),
    Msg(&'static Schema),
    /// `map<string, string>`
    StrMap,
    /// `google.protobuf.Timestamp` (RFC 3339 in JSON)
    Timestamp,
}

#[derive(Debug)]
pub struct Field {
    pub num: u32,
    pub name: &'static str,
    pub ty: Ty,
    pub repeated: bool,
}

#[derive(Debug)]
pub struct Schema {
    pub fields: &'static [Field],
}

/// A singular field.
pub const fn f(num: u32, name: &'static str, ty: Ty) -> Field {
    Field {
        num,
        name,
        ty,
        repeated: false,
    }
}
/// A `repeated` field.
pub const fn rep(num: u32, name: &'static str, ty: Ty) -> Field {
    Field {
        num,
        name,
        ty,
        repeated: true,
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ProtoError(String);

fn err<T>(m: impl Into<String>) -> Result<T, ProtoError> {
    Err(ProtoError(m.into()))
}

// ---- decoding: binary → JSON ----

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn varint(&mut self) -> Result<u64, ProtoError> {
        let mut v = 0u64;
        for i in 0..10 {
            let Some((&b, rest)) = self.buf.split_first() else {
                return err("truncated varint");
            };
            self.buf = rest;
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        err("varint too long")
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ProtoError> {
        if n > self.buf.len() {
            return err("truncated field");
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
}

fn scalar_from_varint(ty: Ty, v: u64) -> Result<Value, ProtoError> {
    Ok(match ty {
        Ty::Bool => Value::Bool(v != 0),
        Ty::U32 => Value::from(v as u32),
        Ty::S32 => Value::from(((v >> 1) as i64) ^ -((v & 1) as i64)),
        Ty::I64 => Value::String((v as i64).to_string()),
        Ty::Enum(names) => {
            let n = v as i32 as i64;
            names
                .iter()
                .find(|(_, x)| *x == n)
                .map(|(s, _)| Value::from(*s))
                .unwrap_or(Value::from(n))
        }
        _ => return err("unexpected varint"),
    })
}

/// Decodes one message into its proto3 JSON object.
pub fn decode(schema: &Schema, bytes: &[u8]) -> Result<Value, ProtoError> {
    let mut r = Reader { buf: bytes };
    let mut out = Map::new();
    while !r.buf.is_empty() {
        let key = r.varint()?;
        let (num, wire) = ((key >> 3) as u32, (key & 7) as u8);
        let field = schema.fields.iter().find(|f| f.num == num);
        let value = match (wire, field) {
            (0, Some(f)) => Some(scalar_from_varint(f.ty, r.varint()?)?),
            (0, None) => {
                r.varint()?;
                None
            }
            (1, _) => {
                r.take(8)?;
                None
            }
            (5, _) => {
                r.take(4)?;
                None
            }
            (2, f) => {
                let n = usize::try_from(r.varint()?)
                    .map_err(|_| ProtoError("length overflow".into()))?;
                let data = r.take(n)?;
                match f {
                    None => None,
                    Some(f) => match f.ty {
                        Ty::Str => {
                            Some(Value::String(String::from_utf8(data.to_vec()).map_err(
                                |_| ProtoError(format!("field {} is not UTF-8", f.name)),
                            )?))
                        }
                        Ty::Bytes => Some(Value::String(
                            base64::engine::general_purpose::STANDARD.encode(data),
                        )),
                        Ty::Msg(s) => Some(decode(s, data)?),
                        Ty::Timestamp => Some(decode_timestamp(data)?),
                        Ty::StrMap => {
                            let entry = decode(&MAP_ENTRY, data)?;
                            let k = entry
                                .get("key")
                                .and_then(Value::as_str)
                                .unwrap_or("")
                                .to_string();
                            let v = entry
                                .get("value")
                                .cloned()
                                .unwrap_or(Value::String(String::new()));
                            let map = out
                                .entry(f.name)
                                .or_insert_with(|| Value::Object(Map::new()));
                            if let Value::Object(m) = map {
                                m.insert(k, v);
                            }
                            None
                        }
                        // Packed repeated scalars.
                        ty if f.repeated => {
                            let mut pr = Reader { buf: data };
                            let arr = out
                                .entry(f.name)
                                .or_insert_with(|| Value::Array(Vec::new()));
                            while !pr.buf.is_empty() {
                                let v = scalar_from_varint(ty, pr.varint()?)?;
                                if let Value::Array(a) = arr {
                                    a.push(v);
                                }
                            }
                            None
                        }
                        _ => return err(format!("field {} has the wrong wire type", f.name)),
                    },
                }
            }
            (w, _) => return err(format!("unsupported wire type {w}")),
        };
        if let (Some(v), Some(f)) = (value, field) {
            if f.repeated {
                let arr = out
                    .entry(f.name)
                    .or_insert_with(|| Value::Array(Vec::new()));
                if let Value::Array(a) = arr {
                    a.push(v);
                }
            } else {
                out.insert(f.name.to_string(), v);
            }
        }
    }
    Ok(Value::Object(out))
}

static MAP_ENTRY: Schema = Schema {
    fields: &[f(1, "key", Ty::Str), f(2, "value", Ty::Str)],
};
static TIMESTAMP: Schema = Schema {
    fields: &[f(1, "seconds", Ty::I64), f(2, "nanos", Ty::U32)],
};

fn decode_timestamp(data: &[u8]) -> Result<Value, ProtoError> {
    let v = decode(&TIMESTAMP, data)?;
    let secs = v
        .get("seconds")
        .and_then(Value::as_str)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0i64);
    let nanos = v.get("nanos").and_then(Value::as_u64).unwrap_or(0) as u32;
    Ok(Value::String(super::time::format_rfc3339(
        secs,
        nanos.min(999_999_999),
    )))
}

// ---- encoding: JSON → binary ----

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_key(out: &mut Vec<u8>, num: u32, wire: u8) {
    put_varint(out, (u64::from(num) << 3) | u64::from(wire));
}

fn put_len(out: &mut Vec<u8>, num: u32, data: &[u8]) {
    put_key(out, num, 2);
    put_varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

fn as_i64(v: &Value) -> Option<i64> {
    v.as_i64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
        .or_else(|| v.as_u64().map(|u| u as i64))
}

fn encode_one(out: &mut Vec<u8>, field: &Field, v: &Value) -> Result<(), ProtoError> {
    let bad = || {
        ProtoError(format!(
            "field {} has an unexpected JSON value {v}",
            field.name
        ))
    };
    match field.ty {
        Ty::Str => put_len(out, field.num, v.as_str().ok_or_else(bad)?.as_bytes()),
        Ty::Bytes => {
            let b = super::proto::decode_bytes(v.as_str().ok_or_else(bad)?).map_err(|_| bad())?;
            put_len(out, field.num, &b);
        }
        Ty::Bool => {
            put_key(out, field.num, 0);
            put_varint(out, u64::from(v.as_bool().ok_or_else(bad)?));
        }
        Ty::U32 => {
            put_key(out, field.num, 0);
            put_varint(
                out,
                u64::from(u32::try_from(as_i64(v).ok_or_else(bad)?).map_err(|_| bad())?),
            );
        }
        Ty::S32 => {
            let n = as_i64(v).ok_or_else(bad)?;
            put_key(out, field.num, 0);
            put_varint(out, ((n << 1) ^ (n >> 63)) as u64);
        }
        Ty::I64 => {
            put_key(out, field.num, 0);
            put_varint(out, as_i64(v).ok_or_else(bad)? as u64);
        }
        Ty::Enum(names) => {
            let n = match v {
                Value::String(s) => names
                    .iter()
                    .find(|(x, _)| x == s)
                    .map(|(_, n)| *n)
                    .ok_or_else(bad)?,
                other => as_i64(other).ok_or_else(bad)?,
            };
            put_key(out, field.num, 0);
            put_varint(out, n as u64);
        }
        Ty::Msg(s) => put_len(out, field.num, &encode(s, v)?),
        Ty::Timestamp => {
            let d = super::time::parse_rfc3339(v.as_str().ok_or_else(bad)?).unwrap_or_default();
            let ts =
                serde_json::json!({"seconds": d.as_secs().to_string(), "nanos": d.subsec_nanos()});
            put_len(out, field.num, &encode(&TIMESTAMP, &ts)?);
        }
        Ty::StrMap => {
            for (k, val) in v.as_object().ok_or_else(bad)? {
                let entry = serde_json::json!({"key": k, "value": val});
                put_len(out, field.num, &encode(&MAP_ENTRY, &entry)?);
            }
        }
    }
    Ok(())
}

/// Encodes a proto3 JSON object as a binary message.
pub fn encode(schema: &Schema, v: &Value) -> Result<Vec<u8>, ProtoError> {
    let obj = v
        .as_object()
        .ok_or_else(|| ProtoError("message is not a JSON object".into()))?;
    let mut out = Vec::new();
    for field in schema.fields {
        let Some(val) = obj.get(field.name) else {
            continue;
        };
        if val.is_null() {
            continue;
        }
        if field.repeated {
            for item in val
                .as_array()
                .ok_or_else(|| ProtoError(format!("field {} is not an array", field.name)))?
            {
                encode_one(&mut out, field, item)?;
            }
        } else {
            encode_one(&mut out, field, val)?;
        }
    }
    Ok(out)
}

/// The empty message: `List`'s request, the `…Response {}` of unary
/// calls, and the `start`/`keepalive` members of stream oneofs (each
/// service's `Empty` struct and `Keepalive {}` variants).
pub static EMPTY: Schema = Schema { fields: &[] };

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envd::filesystem::{ENTRY_RESPONSE, PATH_REQUEST};
    use crate::envd::process::proto::{EVENT_RESPONSE, SEND_SIGNAL_REQUEST, START_REQUEST};
    use serde_json::json;

    #[test]
    fn round_trips_every_kind_of_field() {
        let start = json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"], "envs": {"A": "1", "B": "2"}, "cwd": "/tmp"}, "pty": {"size": {"cols": 80, "rows": 24}}, "tag": "t", "stdin": false});
        let bin = encode(&START_REQUEST, &start).unwrap();
        assert_eq!(decode(&START_REQUEST, &bin).unwrap(), start);
        let end = json!({"event": {"end": {"exitCode": -1, "exited": false, "status": "signal: killed"}}});
        assert_eq!(
            decode(&EVENT_RESPONSE, &encode(&EVENT_RESPONSE, &end).unwrap()).unwrap(),
            end
        );
        let keepalive = json!({"event": {"keepalive": {}}});
        let bin = encode(&EVENT_RESPONSE, &keepalive).unwrap();
        assert_eq!(
            bin,
            vec![0x0a, 0x02, 0x22, 0x00],
            "an empty oneof message is still present"
        );
        assert_eq!(decode(&EVENT_RESPONSE, &bin).unwrap(), keepalive);
        let entry = json!({"entry": {"name": "a", "type": "FILE_TYPE_FILE", "path": "/a", "size": "5", "mode": 420, "permissions": "-rw-r--r--", "owner": "u", "group": "g", "modifiedTime": "2023-11-14T22:13:20.000000500Z", "metadata": {"k": "v"}, "isSymlink": true}});
        assert_eq!(
            decode(&ENTRY_RESPONSE, &encode(&ENTRY_RESPONSE, &entry).unwrap()).unwrap(),
            entry
        );
        let sig = json!({"process": {"pid": 7}, "signal": "SIGNAL_SIGKILL"});
        assert_eq!(
            encode(&SEND_SIGNAL_REQUEST, &sig).unwrap(),
            vec![0x0a, 0x02, 0x08, 0x07, 0x10, 0x09]
        );
    }

    #[test]
    fn known_bytes_and_bad_input() {
        // protoc --encode: StartRequest{process{cmd:"ls"}, stdin:true}
        let bin = [0x0a, 0x04, 0x0a, 0x02, b'l', b's', 0x20, 0x01];
        assert_eq!(
            decode(&START_REQUEST, &bin).unwrap(),
            json!({"process": {"cmd": "ls"}, "stdin": true})
        );
        // Unknown fields of every wire type are skipped.
        let with_unknown = [
            0x78, 0x01, 0x81, 0x01, 1, 2, 3, 4, 5, 6, 7, 8, 0x85, 0x01, 1, 2, 3, 4, 0x0a, 0x00,
        ];
        assert_eq!(
            decode(&START_REQUEST, &with_unknown).unwrap(),
            json!({"process": {}})
        );
        for bad in [
            &[0x0a, 0x05, 0x0a][..],
            &[0x0a][..],
            &[0xff; 11][..],
            &[0x0b][..],
            &[0x0a, 0x02, 0x0a, 0x01][..],
        ] {
            assert!(decode(&START_REQUEST, bad).is_err(), "{bad:?}");
        }
        assert!(
            decode(&PATH_REQUEST, &[0x0a, 0x01, 0xff]).is_err(),
            "invalid UTF-8"
        );
    }
}
