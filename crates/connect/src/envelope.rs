//! The streaming envelope: 1 flag byte, a 4-byte big-endian length, the
//! payload. An incremental [`Decoder`] turns arbitrary chunks of a body into
//! frames and refuses messages above a size limit before buffering them.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::Serialize;

use crate::EndStream;

/// Flag bit: the payload is compressed. tine never sets it and rejects it.
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Flag bit: this is the end-of-stream message.
pub const FLAG_END_STREAM: u8 = 0x02;

const HEADER_LEN: usize = 5;

/// Builds one envelope around `payload`.
pub fn encode_envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(HEADER_LEN + payload.len());
    out.put_u8(flags);
    // Payloads above 4 GiB are not something either side ever builds; the
    // length saturates rather than wrapping so a peer sees a bad frame.
    out.put_u32(u32::try_from(payload.len()).unwrap_or(u32::MAX));
    out.put_slice(payload);
    out.freeze()
}

/// Serializes `msg` as JSON into a message envelope (a request on the
/// client side, a response on the server side).
pub fn encode_message<T: Serialize>(msg: &T) -> Result<Bytes, serde_json::Error> {
    Ok(encode_envelope(0, &serde_json::to_vec(msg)?))
}

/// The end-of-stream envelope.
pub fn encode_end_stream(end: &EndStream) -> Bytes {
    // An `EndStream` of strings always serializes.
    encode_envelope(
        FLAG_END_STREAM,
        &serde_json::to_vec(end).unwrap_or_else(|_| b"{}".to_vec()),
    )
}

/// One decoded envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// A message; its payload is the JSON of the message.
    Message(Bytes),
    /// The end-of-stream message, parsed.
    End(EndStream),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("message of {len} bytes is larger than the limit of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("compressed messages are not supported")]
    Compressed,
    #[error("unknown envelope flags {0:#04x}")]
    BadFlags(u8),
    #[error("invalid end-of-stream message: {0}")]
    BadEndStream(String),
    #[error("stream ended inside a message ({0} bytes left over)")]
    Truncated(usize),
}

/// One envelope: its flags and its payload as sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    pub flags: u8,
    pub payload: Bytes,
}

/// Parses an end-of-stream payload (empty means success).
pub fn parse_end_stream(payload: &[u8]) -> Result<EndStream, FrameError> {
    if payload.is_empty() {
        return Ok(EndStream::ok());
    }
    serde_json::from_slice(payload).map_err(|e| FrameError::BadEndStream(e.to_string()))
}

/// Incremental envelope decoder.
///
/// Feed it body chunks with [`Decoder::push`], take frames with
/// [`Decoder::next_frame`], and call [`Decoder::finish`] at the end of the
/// body to learn whether it stopped in the middle of a frame.
#[derive(Debug)]
pub struct Decoder {
    buf: BytesMut,
    max_message: usize,
}

impl Decoder {
    pub fn new(max_message: usize) -> Self {
        Self {
            buf: BytesMut::new(),
            max_message,
        }
    }

    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete envelope as it is on the wire (the compressed flag
    /// is allowed here; the caller decompresses). `Ok(None)` when more
    /// bytes are needed. Errors are final.
    pub fn next_envelope(&mut self) -> Result<Option<Envelope>, FrameError> {
        if self.buf.len() < HEADER_LEN {
            return Ok(None);
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if flags & !(FLAG_END_STREAM | FLAG_COMPRESSED) != 0 {
            return Err(FrameError::BadFlags(flags));
        }
        if len > self.max_message {
            return Err(FrameError::TooLarge {
                len,
                max: self.max_message,
            });
        }
        if self.buf.len() < HEADER_LEN + len {
            return Ok(None);
        }
        self.buf.advance(HEADER_LEN);
        Ok(Some(Envelope {
            flags,
            payload: self.buf.split_to(len).freeze(),
        }))
    }

    /// The next complete frame, `Ok(None)` when more bytes are needed.
    /// Compressed frames are refused. Errors are final: the stream is
    /// unusable after one.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        if self.buf.first().is_some_and(|f| f & FLAG_COMPRESSED != 0) {
            return Err(FrameError::Compressed);
        }
        let Some(env) = self.next_envelope()? else {
            return Ok(None);
        };
        if env.flags & FLAG_END_STREAM != 0 {
            return Ok(Some(Frame::End(parse_end_stream(&env.payload)?)));
        }
        Ok(Some(Frame::Message(env.payload)))
    }

    /// Call at the end of the body: an error if bytes of a partial frame
    /// are left.
    pub fn finish(&self) -> Result<(), FrameError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(FrameError::Truncated(self.buf.len()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Code, Error};

    #[test]
    fn round_trip_byte_by_byte() {
        let mut wire = Vec::new();
        wire.extend_from_slice(&encode_message(&serde_json::json!({"a": 1})).unwrap());
        wire.extend_from_slice(&encode_envelope(0, b""));
        wire.extend_from_slice(&encode_end_stream(&EndStream::err(Error::new(
            Code::NotFound,
            "x",
        ))));
        let mut dec = Decoder::new(1024);
        let mut frames = Vec::new();
        for b in wire {
            dec.push(&[b]);
            while let Some(f) = dec.next_frame().unwrap() {
                frames.push(f);
            }
        }
        dec.finish().unwrap();
        assert_eq!(frames.len(), 3);
        assert_eq!(frames[0], Frame::Message(Bytes::from_static(br#"{"a":1}"#)));
        assert_eq!(frames[1], Frame::Message(Bytes::new()));
        match &frames[2] {
            Frame::End(end) => assert_eq!(end.error.as_ref().unwrap().code, Code::NotFound),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn header_layout() {
        let env = encode_envelope(FLAG_END_STREAM, b"{}");
        assert_eq!(&env[..], &[2, 0, 0, 0, 2, b'{', b'}']);
    }

    #[test]
    fn oversized_is_refused_before_buffering() {
        let mut dec = Decoder::new(10);
        dec.push(&[0, 0, 0x10, 0, 0]);
        assert_eq!(
            dec.next_frame(),
            Err(FrameError::TooLarge {
                len: 0x100000,
                max: 10
            })
        );
    }

    #[test]
    fn truncated_is_reported() {
        let mut dec = Decoder::new(100);
        dec.push(&[0, 0, 0, 0, 5, b'{']);
        assert_eq!(dec.next_frame(), Ok(None));
        assert_eq!(dec.finish(), Err(FrameError::Truncated(6)));
        let mut dec = Decoder::new(100);
        dec.push(&[0, 0]);
        assert_eq!(dec.finish(), Err(FrameError::Truncated(2)));
    }

    #[test]
    fn bad_flags_and_compression() {
        let mut dec = Decoder::new(100);
        dec.push(&[1, 0, 0, 0, 0]);
        assert_eq!(dec.next_frame(), Err(FrameError::Compressed));
        let mut dec = Decoder::new(100);
        dec.push(&[0x80, 0, 0, 0, 0]);
        assert_eq!(dec.next_frame(), Err(FrameError::BadFlags(0x80)));
        let mut dec = Decoder::new(100);
        dec.push(&[1, 0, 0, 0, 1, 9]);
        assert_eq!(
            dec.next_envelope(),
            Ok(Some(Envelope {
                flags: 1,
                payload: Bytes::from_static(&[9])
            }))
        );
        let mut dec = Decoder::new(100);
        dec.push(&encode_envelope(FLAG_END_STREAM, b"not json"));
        assert!(matches!(dec.next_frame(), Err(FrameError::BadEndStream(_))));
    }
}
