//! A small HTTP/1.1 client for OpenAI-compatible servers (reckon, llama-server, vLLM, SGLang), built on
//! hyper: one connection per request, request bodies as JSON, streamed answers read as server-sent
//! events with the arrival time of every network frame. The load generators (`serve`, `soak`) use it;
//! it measures what a client sees, so it never retries and never hides an error.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use std::time::{Duration, Instant};

/// Where a server listens: `http://host:port[/prefix]` (a trailing `/v1` is dropped: paths are given
/// whole, `/v1/completions`).
#[derive(Clone, Debug, PartialEq)]
pub struct Endpoint {
    /// `host:port`, what is connected to and sent as `Host`.
    pub authority: String,
    /// A path prefix before `/v1/...` ("" for most servers).
    pub prefix: String,
}

impl Endpoint {
    pub fn parse(url: &str) -> Result<Endpoint, String> {
        let rest = url.strip_prefix("http://").ok_or_else(|| {
            if url.starts_with("https://") { format!("{url}: https is not supported (measure a server on its plain-HTTP port)") } else { format!("{url}: expected http://host:port") }
        })?;
        let (authority, path) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
        if authority.is_empty() {
            return Err(format!("{url}: no host"));
        }
        let authority = if authority.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok()) && !authority.ends_with(']') { authority.to_string() } else { format!("{authority}:80") };
        let mut prefix = format!("/{}", path.trim_end_matches('/'));
        if prefix.ends_with("/v1") {
            prefix.truncate(prefix.len() - 3);
        }
        let prefix = prefix.trim_end_matches('/').to_string();
        Ok(Endpoint { authority, prefix })
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}{path}", self.authority, self.prefix)
    }
}

/// Why a request did not end with a complete answer, as counted in the tables.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub enum Failure {
    /// No connection (refused, reset before the answer's head).
    Connect,
    /// An HTTP status other than 200: 429, 503, 400, ...
    Status(u16),
    /// No complete answer within the request's timeout.
    Timeout,
    /// The stream carried an error event.
    StreamError,
    /// The body ended without the stream's end (`[DONE]`, `message_stop`, ...) or a finish reason.
    Incomplete,
    /// The connection failed while the body was being read.
    Broken,
}

impl Failure {
    /// `connect`, `http_429`, `timeout`, ...: the key in tables and raw records.
    pub fn kind(&self) -> String {
        match self {
            Failure::Connect => "connect".into(),
            Failure::Status(s) => format!("http_{s}"),
            Failure::Timeout => "timeout".into(),
            Failure::StreamError => "stream_error".into(),
            Failure::Incomplete => "incomplete".into(),
            Failure::Broken => "broken".into(),
        }
    }
}

/// An answer's head and body as received.
pub struct Answer {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    /// Network frames with their arrival times (a non-streamed answer is one or a few frames).
    pub frames: Vec<(Instant, Bytes)>,
}

impl Answer {
    pub fn body(&self) -> Vec<u8> {
        self.frames.iter().flat_map(|(_, b)| b.iter().copied()).collect()
    }

    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.body()).ok()
    }
}

/// What `send` should do with the answer's body.
pub enum Read {
    /// Read it whole.
    All,
    /// Read it frame by frame, handing each to the callback (its arrival time and bytes); the callback
    /// returns false to hang up (the connection is dropped mid-answer, as a client that goes away).
    Each(Box<dyn FnMut(Instant, &Bytes) -> bool + Send>),
}

/// One request on a fresh connection. `Err` only for what happened before a status line arrived
/// (`Connect`, `Timeout`) or while reading (`Broken`, `Timeout`).
pub async fn send(ep: &Endpoint, method: &str, path: &str, headers: &[(&str, &str)], body: Option<Vec<u8>>, timeout: Duration, read: Read) -> Result<Answer, Failure> {
    let deadline = tokio::time::Instant::now() + timeout;
    let work = async {
        let stream = tokio::net::TcpStream::connect(&ep.authority).await.map_err(|_| Failure::Connect)?;
        let _ = stream.set_nodelay(true);
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(|_| Failure::Connect)?;
        // The connection task ends when the answer is read or dropped.
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut req = Request::builder().method(method).uri(format!("{}{path}", ep.prefix)).header("host", &ep.authority);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let has_body = body.is_some();
        if has_body {
            req = req.header("content-type", "application/json");
        }
        let req = req.body(Full::new(Bytes::from(body.unwrap_or_default()))).map_err(|_| Failure::Connect)?;
        let resp = sender.send_request(req).await.map_err(|_| Failure::Connect)?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let mut body = resp.into_body();
        let mut frames = Vec::new();
        let mut read = read;
        loop {
            match body.frame().await {
                None => break,
                Some(Err(_)) => return Err(Failure::Broken),
                Some(Ok(frame)) => {
                    let now = Instant::now();
                    if let Ok(data) = frame.into_data() {
                        match &mut read {
                            Read::All => frames.push((now, data)),
                            Read::Each(f) => {
                                let go_on = f(now, &data);
                                frames.push((now, data));
                                if !go_on {
                                    break;
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(Answer { status, headers, frames })
    };
    match tokio::time::timeout_at(deadline, work).await {
        Ok(r) => r,
        Err(_) => Err(Failure::Timeout),
    }
}

/// Splits a server-sent-event stream into events as bytes arrive: `push` returns the complete events
/// (their `event:` name, if any, and their joined `data:` lines), keeping a partial one for the next push.
#[derive(Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SseEvent {
    pub event: Option<String>,
    pub data: String,
}

impl SseParser {
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        loop {
            // an event ends at a blank line: "\n\n" or "\r\n\r\n"
            let end = (0..self.buf.len()).find_map(|i| {
                if self.buf[i..].starts_with(b"\n\n") {
                    Some((i, 2))
                } else if self.buf[i..].starts_with(b"\r\n\r\n") {
                    Some((i, 4))
                } else {
                    None
                }
            });
            let Some((at, sep)) = end else { break };
            let block: Vec<u8> = self.buf.drain(..at + sep).collect();
            let text = String::from_utf8_lossy(&block[..at]);
            let (mut event, mut data) = (None, Vec::new());
            for line in text.lines() {
                if let Some(v) = line.strip_prefix("data:") {
                    data.push(v.strip_prefix(' ').unwrap_or(v).to_string());
                } else if let Some(v) = line.strip_prefix("event:") {
                    event = Some(v.trim().to_string());
                }
            }
            if event.is_some() || !data.is_empty() {
                out.push(SseEvent { event, data: data.join("\n") });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(Endpoint::parse("http://127.0.0.1:8080").unwrap(), Endpoint { authority: "127.0.0.1:8080".into(), prefix: "".into() });
        assert_eq!(Endpoint::parse("http://127.0.0.1:8080/v1/").unwrap(), Endpoint { authority: "127.0.0.1:8080".into(), prefix: "".into() });
        assert_eq!(Endpoint::parse("http://host/api/v1").unwrap(), Endpoint { authority: "host:80".into(), prefix: "/api".into() });
        assert!(Endpoint::parse("https://x:1").unwrap_err().contains("https"));
        assert!(Endpoint::parse("x:1").is_err());
        assert_eq!(Endpoint::parse("http://h:1/v1").unwrap().url("/v1/models"), "http://h:1/v1/models");
    }

    #[test]
    fn sse_events_split_across_frames() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\"").is_empty());
        let ev = p.push(b":1}\n\nevent: ping\ndata: x\r\n\r\ndata: [DO");
        assert_eq!(ev, vec![SseEvent { event: None, data: "{\"a\":1}".into() }, SseEvent { event: Some("ping".into()), data: "x".into() }]);
        assert_eq!(p.push(b"NE]\n\n"), vec![SseEvent { event: None, data: "[DONE]".into() }]);
    }
}
