//! The HTTP/1.1 an engine speaks, from dsv4d's side: a request's head written, an answer's
//! head read, and its body's framing taken off as its bytes arrive.
//!
//! Owns: nothing but bytes (pure, no sockets: [`crate::lifecycle::upstream`] has them).
//!
//! Why not hyper's client: its body reader takes a chunk's framing a byte at a time (a
//! `Bytes` split off and dropped for each byte of `40\r\n` and `\r\n`) and hands each piece
//! through a channel; measured with callgrind on the proxy bench's streams of 66 events,
//! that was 2,030 of dsv4d's 4,241 instructions per event. Here a chunk's size line is one
//! search for its line end and its data one split of the read buffer.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode, Version};

/// Most header lines an answer's head may have.
const MAX_HEADERS: usize = 128;
/// Largest answer head, and largest trailer section, read.
pub const MAX_HEAD: usize = 64 * 1024;
/// Longest chunk-size line (with any extensions).
const MAX_SIZE_LINE: usize = 1024;

/// What is wrong with an engine's answer, as HTTP/1.1 reads it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("its answer's head is not HTTP/1.1: {0}")]
    Head(String),
    #[error("its answer's head is larger than {MAX_HEAD} bytes")]
    HeadTooLarge,
    #[error("its answer asks to switch protocols (101), which dsv4d never asked for")]
    Upgrade,
    #[error("its answer's Content-Length is not one number: {0:?}")]
    Length(String),
    #[error("its answer's chunked body is malformed: {0}")]
    Chunk(&'static str),
}

impl From<WireError> for std::io::Error {
    fn from(e: WireError) -> Self {
        std::io::Error::new(std::io::ErrorKind::InvalidData, e)
    }
}

/// Writes the head of `parts` with a body of `body_len` bytes to `out`: the request line,
/// the headers but any framing of the client's, and the body's length.
pub fn encode_request(parts: &http::request::Parts, body_len: usize, out: &mut BytesMut) {
    let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    out.reserve(64 + target.len() + parts.headers.len() * 48);
    out.put_slice(parts.method.as_str().as_bytes());
    out.put_u8(b' ');
    out.put_slice(target.as_bytes());
    out.put_slice(b" HTTP/1.1\r\n");
    for (name, value) in &parts.headers {
        if name == header::CONTENT_LENGTH || name == header::TRANSFER_ENCODING {
            continue;
        }
        out.put_slice(name.as_str().as_bytes());
        out.put_slice(b": ");
        out.put_slice(value.as_bytes());
        out.put_slice(b"\r\n");
    }
    let sends_body = !matches!(
        parts.method,
        Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS | Method::TRACE
    );
    if body_len > 0 || sends_body {
        out.put_slice(b"content-length: ");
        out.put_slice(body_len.to_string().as_bytes());
        out.put_slice(b"\r\n");
    }
    out.put_slice(b"\r\n");
}

/// An answer's head, read.
#[derive(Debug)]
pub struct Head {
    pub parts: http::response::Parts,
    /// How its body is framed.
    pub framing: Framing,
    /// Whether the connection may carry another request after this answer.
    pub reusable: bool,
}

/// How an answer's body is delimited (RFC 9112 6.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body (a HEAD request's answer, 204, 304).
    Empty,
    Length(u64),
    Chunked,
    /// Read until the engine closes the connection (ds4-server's event streams).
    Close,
}

/// What the start of a buffer holds.
#[derive(Debug)]
pub enum Parsed {
    /// An answer's head of this many bytes.
    Head(Head, usize),
    /// An informational answer (`100 Continue`, `103`) of this many bytes, to skip.
    Informational(usize),
    /// Not a whole head yet.
    Partial,
}

/// Reads the answer's head at the start of `buf`, to a request of `method`.
pub fn parse_head(buf: &[u8], method: &Method) -> Result<Parsed, WireError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut res = httparse::Response::new(&mut headers);
    let n = match res.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD => {
            return Err(WireError::HeadTooLarge)
        }
        Ok(httparse::Status::Partial) => return Ok(Parsed::Partial),
        Err(e) => return Err(WireError::Head(e.to_string())),
    };
    let code = res.code.unwrap_or(0);
    let status =
        StatusCode::from_u16(code).map_err(|_| WireError::Head(format!("status {code}")))?;
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err(WireError::Upgrade);
    }
    if status.is_informational() {
        return Ok(Parsed::Informational(n));
    }
    let version = match res.version {
        Some(0) => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    let mut map = HeaderMap::with_capacity(res.headers.len());
    for h in res.headers.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes())
            .map_err(|_| WireError::Head(format!("header name {:?}", h.name)))?;
        let value = HeaderValue::from_bytes(h.value)
            .map_err(|_| WireError::Head(format!("the value of {name}")))?;
        map.append(name, value);
    }
    let framing = framing(method, status, &map)?;
    let reusable = framing != Framing::Close && keeps_alive(version, &map);
    let (mut parts, ()) = http::Response::new(()).into_parts();
    parts.status = status;
    parts.version = version;
    parts.headers = map;
    Ok(Parsed::Head(
        Head {
            parts,
            framing,
            reusable,
        },
        n,
    ))
}

/// The body's framing, by RFC 9112 6.3: none, chunked (the last transfer coding), a length
/// (all values agreeing), or until the close.
fn framing(method: &Method, status: StatusCode, h: &HeaderMap) -> Result<Framing, WireError> {
    if method == Method::HEAD
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok(Framing::Empty);
    }
    if h.contains_key(header::TRANSFER_ENCODING) {
        let last = h
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .flat_map(|v| v.as_bytes().split(|&b| b == b','))
            .map(<[u8]>::trim_ascii)
            .rfind(|c| !c.is_empty());
        return Ok(match last {
            Some(c) if c.eq_ignore_ascii_case(b"chunked") => Framing::Chunked,
            _ => Framing::Close,
        });
    }
    let mut length = None;
    for v in h.get_all(header::CONTENT_LENGTH) {
        for part in v.as_bytes().split(|&b| b == b',') {
            let text = std::str::from_utf8(part.trim_ascii()).unwrap_or("");
            let n: u64 = text
                .parse()
                .map_err(|_| WireError::Length(String::from_utf8_lossy(v.as_bytes()).into()))?;
            if length.is_some_and(|l| l != n) {
                return Err(WireError::Length(
                    String::from_utf8_lossy(v.as_bytes()).into(),
                ));
            }
            length = Some(n);
        }
    }
    Ok(length.map_or(Framing::Close, Framing::Length))
}

/// Whether the connection stays open after the answer, by its version and `Connection`.
fn keeps_alive(version: Version, h: &HeaderMap) -> bool {
    let has = |token: &[u8]| {
        h.get_all(header::CONNECTION)
            .iter()
            .flat_map(|v| v.as_bytes().split(|&b| b == b','))
            .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
    };
    match version {
        Version::HTTP_10 => has(b"keep-alive"),
        _ => !has(b"close"),
    }
}

/// Takes a body's framing off as its bytes arrive: each call hands on the next piece of data
/// the buffer holds.
#[derive(Debug)]
pub struct Decoder {
    state: State,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// So many bytes of a known length left.
    Length(u64),
    /// A chunk's size line next.
    Size,
    /// So many bytes of a chunk's data left.
    Data(u64),
    /// The CRLF after a chunk's data next.
    DataEnd,
    /// Trailer lines (read and dropped) until the empty one; so many bytes of them so far.
    Trailers(usize),
    /// Everything until the close.
    Close,
    Done,
}

/// What the buffer gave.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded {
    Data(Bytes),
    /// The buffer holds no more of the body: read more.
    More,
    /// The body is whole.
    Done,
}

impl Decoder {
    pub fn new(framing: Framing) -> Decoder {
        let state = match framing {
            Framing::Empty | Framing::Length(0) => State::Done,
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::Size,
            Framing::Close => State::Close,
        };
        Decoder { state }
    }

    /// Whether the whole body has been read.
    pub fn done(&self) -> bool {
        self.state == State::Done
    }

    /// The body's bytes still to come, when that is known.
    pub fn remaining(&self) -> Option<u64> {
        match self.state {
            State::Length(n) => Some(n),
            State::Done => Some(0),
            _ => None,
        }
    }

    /// The next piece of the body in `buf`, taken off it with its framing.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, WireError> {
        loop {
            match self.state {
                State::Done => return Ok(Decoded::Done),
                // Nothing to read (a poll before the engine's next bytes): no search.
                _ if buf.is_empty() => return Ok(Decoded::More),
                State::Close => return Ok(Decoded::Data(buf.split().freeze())),
                State::Length(n) | State::Data(n) => {
                    let (data, left) = take(buf, n);
                    self.state = match (self.state, left) {
                        (State::Length(_), 0) => State::Done,
                        (State::Length(_), left) => State::Length(left),
                        (_, 0) => State::DataEnd,
                        (_, left) => State::Data(left),
                    };
                    return Ok(Decoded::Data(data));
                }
                State::Size => {
                    let Some(line) = line(buf, MAX_SIZE_LINE, "a chunk-size line too long")? else {
                        return Ok(Decoded::More);
                    };
                    let size = chunk_size(&buf[..line])?;
                    buf.advance(line + 2);
                    self.state = if size == 0 {
                        State::Trailers(0)
                    } else {
                        State::Data(size)
                    };
                }
                State::DataEnd => {
                    if buf.len() < 2 {
                        return Ok(Decoded::More);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(WireError::Chunk("no CRLF after a chunk's data"));
                    }
                    buf.advance(2);
                    self.state = State::Size;
                }
                State::Trailers(seen) => {
                    let room = MAX_HEAD.saturating_sub(seen);
                    let Some(line) = line(buf, room, "trailers too large")? else {
                        return Ok(Decoded::More);
                    };
                    buf.advance(line + 2);
                    self.state = match line {
                        0 => State::Done,
                        _ => State::Trailers(seen + line + 2),
                    };
                }
            }
        }
    }

    /// The connection closed: the end of a body read until the close, else a cut.
    pub fn closed(&mut self) -> Result<(), std::io::Error> {
        match self.state {
            State::Close | State::Done => {
                self.state = State::Done;
                Ok(())
            }
            _ => Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the engine closed the connection before the answer's end",
            )),
        }
    }
}

/// Up to `n` bytes off the front of `buf`, and how many of the `n` are left to come.
fn take(buf: &mut BytesMut, n: u64) -> (Bytes, u64) {
    let k = usize::try_from(n).unwrap_or(usize::MAX).min(buf.len());
    (buf.split_to(k).freeze(), n - k as u64)
}

/// The length of the CRLF-ended line at the start of `buf` (without its CRLF), `None` if it
/// has not all arrived; an error if it is longer than `max` or ends in a bare LF.
fn line(buf: &[u8], max: usize, too_long: &'static str) -> Result<Option<usize>, WireError> {
    let window = &buf[..buf.len().min(max + 2)];
    match memchr::memchr(b'\n', window) {
        Some(0) => Err(WireError::Chunk("a line ends in a bare LF")),
        Some(i) if window[i - 1] == b'\r' => Ok(Some(i - 1)),
        Some(_) => Err(WireError::Chunk("a line ends in a bare LF")),
        None if window.len() > max + 1 => Err(WireError::Chunk(too_long)),
        None => Ok(None),
    }
}

/// A chunk-size line's size: hex digits, then any extensions (`;name=value`), which mean
/// nothing to dsv4d.
fn chunk_size(line: &[u8]) -> Result<u64, WireError> {
    let (mut size, mut digits) = (0u64, 0);
    for &b in line {
        let d = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            b'A'..=b'F' => b - b'A' + 10,
            _ => break,
        };
        if digits == 15 {
            return Err(WireError::Chunk("a chunk size is too large"));
        }
        size = size << 4 | u64::from(d);
        digits += 1;
    }
    let rest = line[digits..].trim_ascii_start();
    if digits == 0 || !(rest.is_empty() || rest[0] == b';') {
        return Err(WireError::Chunk("a chunk size is not hexadecimal"));
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(method: Method, uri: &str, headers: &[(&str, &str)]) -> http::request::Parts {
        let mut b = http::Request::builder().method(method).uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    /// A request (method, target, headers), its body's length, and its head as written.
    type Case = (
        Method,
        &'static str,
        &'static [(&'static str, &'static str)],
        usize,
        &'static str,
    );

    #[test]
    fn a_request_head_has_its_line_its_headers_and_its_own_length() {
        let cases: &[Case] = &[
            (
                Method::POST,
                "/v1/chat/completions?x=1",
                &[("host", "127.0.0.1:9"), ("content-length", "99")],
                12,
                "POST /v1/chat/completions?x=1 HTTP/1.1\r\nhost: 127.0.0.1:9\r\n\
                 content-length: 12\r\n\r\n",
            ),
            (
                Method::GET,
                "/health",
                &[],
                0,
                "GET /health HTTP/1.1\r\n\r\n",
            ),
            (
                Method::POST,
                "/slots/0?action=erase",
                &[("transfer-encoding", "chunked")],
                0,
                "POST /slots/0?action=erase HTTP/1.1\r\ncontent-length: 0\r\n\r\n",
            ),
            (
                Method::GET,
                "http://engine/props",
                &[("x-a", "1"), ("x-a", "2")],
                0,
                "GET /props HTTP/1.1\r\nx-a: 1\r\nx-a: 2\r\n\r\n",
            ),
        ];
        for (method, uri, headers, len, want) in cases {
            let mut out = BytesMut::new();
            encode_request(&request(method.clone(), uri, headers), *len, &mut out);
            assert_eq!(std::str::from_utf8(&out).unwrap(), *want, "{method} {uri}");
        }
    }

    fn head(text: &str, method: Method) -> Result<Head, WireError> {
        match parse_head(text.as_bytes(), &method)? {
            Parsed::Head(h, n) => {
                assert_eq!(n, text.len());
                Ok(h)
            }
            other => panic!("{other:?} for {text:?}"),
        }
    }

    #[test]
    fn an_answer_head_says_how_its_body_is_framed_and_whether_the_connection_stays() {
        use Framing::*;
        let cases: &[(&str, Method, Framing, bool)] = &[
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
                Method::POST,
                Length(5),
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                Method::POST,
                Chunked,
                true,
            ),
            // ds4-server: no length, no chunks: the close ends it.
            (
                "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n",
                Method::POST,
                Close,
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
                Method::POST,
                Chunked,
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
                Method::POST,
                Close,
                false,
            ),
            // Transfer-Encoding wins over a length beside it.
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
                Method::POST,
                Chunked,
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 7, 7\r\n\r\n",
                Method::POST,
                Length(7),
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\n",
                Method::POST,
                Length(5),
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: Keep-Alive, CLOSE\r\n\r\n",
                Method::POST,
                Length(5),
                false,
            ),
            (
                "HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\n",
                Method::POST,
                Length(5),
                false,
            ),
            (
                "HTTP/1.0 200 OK\r\nContent-Length: 5\r\nConnection: keep-alive\r\n\r\n",
                Method::POST,
                Length(5),
                true,
            ),
            ("HTTP/1.1 204 No Content\r\n\r\n", Method::POST, Empty, true),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
                Method::HEAD,
                Empty,
                true,
            ),
        ];
        for (text, method, framing, reusable) in cases {
            let h = head(text, method.clone()).unwrap();
            assert_eq!((h.framing, h.reusable), (*framing, *reusable), "{text:?}");
        }
        let h = head(
            "HTTP/1.1 503 Busy\r\nX-A: 1\r\nx-a: 2\r\nContent-Length: 0\r\n\r\n",
            Method::GET,
        )
        .unwrap();
        assert_eq!(h.parts.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(h.parts.headers.get_all("x-a").iter().count(), 2);
    }

    #[test]
    fn a_bad_or_unfinished_head_is_named_and_an_informational_one_skipped() {
        let m = Method::POST;
        assert!(matches!(
            parse_head(b"HTTP/1.1 200 OK\r\nContent-Le", &m),
            Ok(Parsed::Partial)
        ));
        assert!(matches!(
            parse_head(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n", &m),
            Ok(Parsed::Informational(25))
        ));
        assert_eq!(
            parse_head(b"HTTP/1.1 101 Switching\r\n\r\n", &m).unwrap_err(),
            WireError::Upgrade
        );
        assert!(matches!(
            parse_head(b"SSH-2.0-OpenSSH\r\n\r\n", &m),
            Err(WireError::Head(_))
        ));
        assert!(matches!(
            parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\n", &m),
            Err(WireError::Length(_))
        ));
        assert!(matches!(
            parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", &m),
            Err(WireError::Length(_))
        ));
        let mut huge = b"HTTP/1.1 200 OK\r\n".to_vec();
        huge.extend(std::iter::repeat_n(b'a', MAX_HEAD));
        assert_eq!(parse_head(&huge, &m).unwrap_err(), WireError::HeadTooLarge);
    }

    /// Decodes `wire` fed in pieces of `step` bytes: the body and whether it ended.
    fn decode_in_steps(
        framing: Framing,
        wire: &[u8],
        step: usize,
    ) -> Result<(Vec<u8>, bool), WireError> {
        let mut d = Decoder::new(framing);
        let mut buf = BytesMut::new();
        let mut body = Vec::new();
        let mut fed = 0;
        loop {
            match d.decode(&mut buf)? {
                Decoded::Data(b) => body.extend_from_slice(&b),
                Decoded::Done => return Ok((body, true)),
                Decoded::More if fed == wire.len() => return Ok((body, false)),
                Decoded::More => {
                    let k = step.min(wire.len() - fed);
                    buf.extend_from_slice(&wire[fed..fed + k]);
                    fed += k;
                }
            }
        }
    }

    #[test]
    fn a_body_comes_out_whole_however_its_bytes_are_split() {
        let chunked: &[u8] = b"5\r\nhello\r\n1;ext=\"a;b\"\r\n \r\n10\r\n0123456789abcdef\r\n0\r\nX-Trailer: 1\r\n\r\n";
        let cases: &[(Framing, &[u8], &[u8], bool)] = &[
            (Framing::Chunked, chunked, b"hello 0123456789abcdef", true),
            (Framing::Chunked, b"0\r\n\r\n", b"", true),
            (Framing::Chunked, b"3\r\nabc\r\n", b"abc", false),
            (Framing::Length(4), b"abcd", b"abcd", true),
            (Framing::Length(6), b"abcd", b"abcd", false),
            (Framing::Close, b"data: x\n\n", b"data: x\n\n", false),
            (Framing::Empty, b"", b"", true),
        ];
        for (framing, wire, want, ended) in cases {
            for step in 1..=wire.len().max(1) {
                let (body, done) = decode_in_steps(*framing, wire, step).unwrap();
                assert_eq!(
                    (body.as_slice(), done),
                    (*want, *ended),
                    "{framing:?} step {step}"
                );
            }
        }
    }

    #[test]
    fn bytes_after_a_body_stay_in_the_buffer() {
        let mut d = Decoder::new(Framing::Chunked);
        let mut buf = BytesMut::from(&b"2\r\nab\r\n0\r\n\r\nHTTP/1.1"[..]);
        assert_eq!(
            d.decode(&mut buf).unwrap(),
            Decoded::Data(Bytes::from_static(b"ab"))
        );
        assert_eq!(d.decode(&mut buf).unwrap(), Decoded::Done);
        assert_eq!(&buf[..], b"HTTP/1.1");
        let mut d = Decoder::new(Framing::Length(2));
        let mut buf = BytesMut::from(&b"abcd"[..]);
        assert_eq!(
            d.decode(&mut buf).unwrap(),
            Decoded::Data(Bytes::from_static(b"ab"))
        );
        assert_eq!(d.decode(&mut buf).unwrap(), Decoded::Done);
        assert_eq!(&buf[..], b"cd");
    }

    #[test]
    fn a_malformed_chunk_is_named() {
        let cases: &[(&[u8], &str)] = &[
            (b"zz\r\n", "a chunk size is not hexadecimal"),
            (b"\r\n", "a chunk size is not hexadecimal"),
            (b"5\nhello", "a line ends in a bare LF"),
            (b"2\r\nabXY", "no CRLF after a chunk's data"),
            (b"ffffffffffffffff\r\n", "a chunk size is too large"),
        ];
        for (wire, want) in cases {
            let err = decode_in_steps(Framing::Chunked, wire, wire.len()).unwrap_err();
            assert_eq!(
                err,
                WireError::Chunk(want),
                "{:?}",
                String::from_utf8_lossy(wire)
            );
        }
        let long = vec![b'1'; MAX_SIZE_LINE + 8];
        assert_eq!(
            decode_in_steps(Framing::Chunked, &long, 7).unwrap_err(),
            WireError::Chunk("a chunk-size line too long")
        );
    }

    #[test]
    fn a_close_ends_only_a_body_read_until_the_close() {
        assert!(Decoder::new(Framing::Close).closed().is_ok());
        assert!(Decoder::new(Framing::Empty).closed().is_ok());
        for f in [Framing::Chunked, Framing::Length(3)] {
            let e = Decoder::new(f).closed().unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{f:?}");
        }
    }
}
