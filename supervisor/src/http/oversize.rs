//! A 413, not hyper's 431, for a `Content-Length` too large for hyper to hold.
//!
//! Owns: a client connection's socket, wrapped so that a request refused by hyper's own
//! parser for its `Content-Length` gets the same 413 `body_too_large` as any body over
//! `api.max_body`. Must not: change anything else that goes by (every other byte passes
//! through as it is), or cost a request more than a copy of its first bytes.
//!
//! Why: hyper keeps the two largest `u64` values for itself (chunked, and unknown), so it
//! refuses `Content-Length: 18446744073709551614` and `...615` while parsing, before dsv4d
//! sees the request, and answers by itself `431 Request Header Fields Too Large`, the answer
//! to a head that is too large: that tells a client to shorten its headers, not its body.
//! It offers no hook for its automatic answers, so this wrapper keeps the bytes read since
//! the last write (a request's head, as clients wait for an answer before the next one), and
//! when hyper writes its automatic 431 and those bytes declare such a length, writes the 413
//! in its place. hyper closes the connection after an automatic answer; what else it writes
//! on it is dropped.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::http::http_error::ApiError;

/// How much of what a client sends before an answer is kept: well past any request head
/// that hyper parses (its own limit is far higher, but such a head gets 431 for its size).
const KEPT: usize = 8 * 1024;

/// What hyper's automatic answer to a too-large head begins with.
const HYPER_431: &[u8] = b"HTTP/1.1 431 ";

/// The smallest `Content-Length` hyper refuses: `u64::MAX - 1`.
const HYPER_MAX_LEN: u64 = u64::MAX - 2;

/// A client connection; see the module header.
pub struct Guarded<S> {
    inner: S,
    /// Bytes read since the last write, up to [`KEPT`].
    kept: Vec<u8>,
    /// Whether the last call was a write: the next read begins a new `kept`.
    wrote: bool,
    /// The 413 on its way out in place of hyper's 431, and how much of it went.
    answer: Option<(Bytes, usize)>,
    /// hyper's 431 was replaced: what it writes after it goes nowhere.
    replaced: bool,
    /// `api.max_body`, for the message.
    max_body: u64,
}

impl<S> Guarded<S> {
    pub fn new(inner: S, max_body: u64) -> Guarded<S> {
        Guarded {
            inner,
            kept: Vec::new(),
            wrote: false,
            answer: None,
            replaced: false,
            max_body,
        }
    }

    /// Whether a write of `first` (its first bytes) is hyper's automatic 431 for a length it
    /// cannot hold; if so, the 413 to send instead is made ready.
    fn replace(&mut self, first: &[u8]) -> bool {
        if self.answer.is_some() {
            return true;
        }
        if !first.starts_with(HYPER_431) {
            return false;
        }
        let Some(len) = declared_length(&self.kept) else {
            return false;
        };
        if len <= HYPER_MAX_LEN {
            return false;
        }
        self.answer = Some((too_large(len, self.max_body), 0));
        true
    }

    /// Sends the 413 in place of hyper's bytes; `Ready` once it has gone whole.
    fn poll_answer(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>>
    where
        S: AsyncWrite + Unpin,
    {
        while let Some((bytes, sent)) = self.answer.as_mut() {
            if *sent == bytes.len() {
                self.answer = None;
                self.replaced = true;
                break;
            }
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &bytes[*sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *sent += n;
        }
        Poll::Ready(Ok(()))
    }
}

/// The value of the first `Content-Length` header in `head`, if it is a number (one that
/// does not fit a `u64` counts as `u64::MAX`: hyper refuses it too, as invalid).
fn declared_length(head: &[u8]) -> Option<u64> {
    let end = head
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or(head.len());
    head[..end].split(|b| *b == b'\n').skip(1).find_map(|line| {
        let colon = line.iter().position(|b| *b == b':')?;
        let (name, value) = line.split_at(colon);
        if !name.eq_ignore_ascii_case(b"content-length") {
            return None;
        }
        let value = value[1..].trim_ascii();
        if value.is_empty() || !value.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let n = value.iter().try_fold(0u64, |n, d| {
            n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
        });
        Some(n.unwrap_or(u64::MAX))
    })
}

/// The whole 413 answer, in the OpenAI error shape the proxy gives bodies over the limit.
fn too_large(len: u64, max_body: u64) -> Bytes {
    let error = ApiError::new(
        http::StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        "body_too_large",
        format!("the request body of {len} bytes is larger than api.max_body ({max_body} bytes)"),
    );
    let body = error.body();
    let head = format!(
        "HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let mut whole = head.into_bytes();
    whole.extend_from_slice(&body);
    Bytes::from(whole)
}

impl<S: AsyncRead + Unpin> AsyncRead for Guarded<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        let new = &buf.filled()[before..];
        if !new.is_empty() {
            if this.wrote {
                this.wrote = false;
                this.kept.clear();
            }
            let room = KEPT.saturating_sub(this.kept.len());
            this.kept.extend_from_slice(&new[..new.len().min(room)]);
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Guarded<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.replaced || this.replace(buf) {
            ready!(this.poll_answer(cx))?;
            return Poll::Ready(Ok(buf.len()));
        }
        this.wrote = true;
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let first = bufs.iter().find(|b| !b.is_empty()).map(|b| &b[..]);
        if this.replaced || first.is_some_and(|f| this.replace(f)) {
            ready!(this.poll_answer(cx))?;
            return Poll::Ready(Ok(bufs.iter().map(|b| b.len()).sum()));
        }
        this.wrote = true;
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_answer(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_answer(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_declared_length_is_read_from_the_head_only() {
        for (head, want) in [
            (
                &b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 42\r\n\r\n"[..],
                Some(42),
            ),
            (
                b"POST / HTTP/1.1\r\ncontent-length:18446744073709551615\r\n\r\n",
                Some(u64::MAX),
            ),
            (b"POST / HTTP/1.1\r\nCONTENT-LENGTH:  7 \r\n\r\n", Some(7)),
            // Past u64: hyper says 400 for it; as a number here, it is as large as can be.
            (
                b"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n",
                Some(u64::MAX),
            ),
            (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", None),
            (b"POST / HTTP/1.1\r\nX-Content-Length: 5\r\n\r\n", None),
            // A body that looks like a header does not count.
            (
                b"POST / HTTP/1.1\r\nHost: x\r\n\r\nContent-Length: 9\r\n",
                None,
            ),
            (b"GET /Content-Length:5 HTTP/1.1\r\n\r\n", None),
        ] {
            assert_eq!(
                declared_length(head),
                want,
                "{:?}",
                String::from_utf8_lossy(head)
            );
        }
    }

    #[test]
    fn the_answer_is_a_whole_413_in_the_openai_shape() {
        let a = too_large(u64::MAX, 1024);
        let text = std::str::from_utf8(&a).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(
            head.starts_with("HTTP/1.1 413 Payload Too Large\r\n"),
            "{head}"
        );
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "body_too_large");
        assert_eq!(
            v["error"]["message"],
            "the request body of 18446744073709551615 bytes is larger than api.max_body \
             (1024 bytes)"
        );
    }
}
