//! Serde helpers for proto3 JSON: clients may send 32-bit integers as
//! numbers or strings, `bytes` in standard or URL-safe base64, and enums by
//! name or number. Output uses the canonical forms.

use base64::engine::{general_purpose, DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use base64::Engine;
use serde::{Deserialize, Deserializer, Serializer};

const LENIENT: GeneralPurposeConfig =
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent);
const STD_LENIENT: GeneralPurpose = GeneralPurpose::new(&base64::alphabet::STANDARD, LENIENT);
const URL_LENIENT: GeneralPurpose = GeneralPurpose::new(&base64::alphabet::URL_SAFE, LENIENT);

#[derive(Deserialize)]
#[serde(untagged)]
enum NumOrStr {
    Num(u64),
    Str(String),
}

pub fn de_u32<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let n = match NumOrStr::deserialize(d)? {
        NumOrStr::Num(n) => n,
        NumOrStr::Str(s) => s.trim().parse().map_err(serde::de::Error::custom)?,
    };
    u32::try_from(n).map_err(serde::de::Error::custom)
}

pub fn de_opt_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    de_u32(d).map(Some)
}

/// Decodes proto3 JSON `bytes`.
pub fn decode_bytes(s: &str) -> Result<Vec<u8>, base64::DecodeError> {
    STD_LENIENT.decode(s).or_else(|_| URL_LENIENT.decode(s))
}

pub fn de_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    let s = String::deserialize(d)?;
    decode_bytes(&s).map_err(serde::de::Error::custom)
}

pub fn ser_bytes<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&general_purpose::STANDARD.encode(b))
}

/// An enum given as a name (`"SIGNAL_SIGKILL"`) or a number (`9`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum EnumValue {
    Num(i64),
    Name(String),
}

impl EnumValue {
    pub fn resolve(&self, names: &[(&str, i64)]) -> Option<i64> {
        match self {
            EnumValue::Num(n) => Some(*n),
            EnumValue::Name(s) => names.iter().find(|(n, _)| n == s).map(|(_, v)| *v),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct T {
        #[serde(deserialize_with = "de_u32")]
        n: u32,
        #[serde(deserialize_with = "de_bytes")]
        b: Vec<u8>,
    }

    #[test]
    fn lenient_input() {
        let t: T = serde_json::from_str(r#"{"n":"42","b":"aGk"}"#).unwrap();
        assert_eq!((t.n, t.b.as_slice()), (42, &b"hi"[..]));
        let t: T = serde_json::from_str(r#"{"n":7,"b":"_-8="}"#).unwrap();
        assert_eq!((t.n, t.b), (7, vec![0xff, 0xef]));
        assert!(serde_json::from_str::<T>(r#"{"n":-1,"b":""}"#).is_err());
        assert!(serde_json::from_str::<T>(r#"{"n":1,"b":"***"}"#).is_err());
        let e: EnumValue = serde_json::from_str("\"SIGNAL_SIGKILL\"").unwrap();
        assert_eq!(e.resolve(&[("SIGNAL_SIGKILL", 9)]), Some(9));
        let e: EnumValue = serde_json::from_str("15").unwrap();
        assert_eq!(e.resolve(&[]), Some(15));
    }
}
