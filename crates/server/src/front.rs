//! The front door: a thread of its own accepts every connection and serves `/health` probes on a
//! single-threaded runtime of its own; every other connection goes to the async workers as it came.
//!
//! Why: under a flood the workers' run queue holds a thousand connections, and the workers share the cores
//! with the engine's compute threads, so a probe that joined that queue waited behind all of them (up to
//! 115 ms on SmolLM2, docs/reliability.md). A thread that only accepts and peeks sleeps almost always, so
//! the kernel runs it as soon as a connection arrives, and a probe's answer no longer depends on the queue.
//!
//! A connection is a probe when its first bytes are `GET /health` (a space or `?` next). The front runtime
//! serves such a connection with the whole router, so a client that keeps it alive and sends other
//! requests on it is still answered (by the front thread); load balancers and kubelets open a connection
//! per probe.

use axum::Router;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// What a connection must begin with to be served by the front thread.
const PROBE: &[u8] = b"GET /health";

/// How long the front thread waits for a new connection's first bytes before handing it to the workers.
const PEEK_FOR: Duration = Duration::from_millis(50);

/// Connections handed over by the front thread: give it to `axum::serve` on the workers' runtime.
pub struct Incoming {
    rx: UnboundedReceiver<(std::net::TcpStream, SocketAddr)>,
    local: SocketAddr,
}

impl axum::serve::Listener for Incoming {
    type Io = TcpStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (TcpStream, SocketAddr) {
        loop {
            let Some((stream, addr)) = self.rx.recv().await else {
                // the front thread is gone (its runtime failed to start): nothing will come
                return std::future::pending().await;
            };
            // registers the socket with the runtime polling this listener
            if let Ok(stream) = TcpStream::from_std(stream) {
                return (stream, addr);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}

/// Starts the front thread on `listener` (non-blocking, already listening) and returns what it hands to
/// the workers. `router` serves the probes.
/// Answers every connection with 503 while the model loads (`/health` is readiness: a probe sees
/// "loading" rather than a refused connection), on a thread of its own, until `stop`.
pub struct LoadingResponder {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<std::net::TcpListener>,
}

impl LoadingResponder {
    pub fn start(listener: std::net::TcpListener) -> std::io::Result<LoadingResponder> {
        use std::io::{Read, Write};
        use std::sync::atomic::Ordering;
        listener.set_nonblocking(true)?;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new().name("reckon-loading".into()).spawn(move || {
            const BODY: &str = r#"{"error":{"message":"the model is loading","type":"service_unavailable","param":null,"code":503}}"#;
            while !flag.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut conn, _)) => {
                        // read the request head (so closing does not reset the connection), then answer
                        let _ = conn.set_nonblocking(false);
                        let _ = conn.set_read_timeout(Some(std::time::Duration::from_millis(500)));
                        let (mut head, mut buf) = (Vec::new(), [0u8; 4096]);
                        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 65536 {
                            match conn.read(&mut buf) {
                                Ok(n) if n > 0 => head.extend_from_slice(&buf[..n]),
                                _ => break,
                            }
                        }
                        let reply = format!("HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{BODY}", BODY.len());
                        let _ = conn.write_all(reply.as_bytes());
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(std::time::Duration::from_millis(10)),
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
                }
            }
            listener
        })?;
        Ok(LoadingResponder { stop, thread })
    }

    /// Stops answering and gives the listener back (connections that arrive meanwhile wait in its queue).
    pub fn stop(self) -> std::io::Result<std::net::TcpListener> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().map_err(|_| std::io::Error::other("the loading responder panicked"))
    }
}

pub fn spawn(listener: std::net::TcpListener, router: Router) -> std::io::Result<Incoming> {
    listener.set_nonblocking(true)?;
    let local = listener.local_addr()?;
    let (to_workers, rx) = unbounded_channel();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    std::thread::Builder::new().name("reckon-front".into()).spawn(move || rt.block_on(front(listener, local, router, to_workers)))?;
    Ok(Incoming { rx, local })
}

type Handoff = UnboundedSender<(std::net::TcpStream, SocketAddr)>;

async fn front(listener: std::net::TcpListener, local: SocketAddr, router: Router, to_workers: Handoff) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else { return };
    let (to_front, rx) = unbounded_channel();
    tokio::spawn(async move {
        let _ = axum::serve(Incoming { rx, local }, router).await;
    });
    loop {
        let (stream, addr) = match listener.accept().await {
            Ok(c) => c,
            // out of file descriptors and the like: what axum's own listener does, without its 1 s wait
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let (to_workers, to_front) = (to_workers.clone(), to_front.clone());
        tokio::spawn(async move {
            let probe = is_probe(&stream).await;
            let Ok(stream) = stream.into_std() else { return };
            let _ = if probe { to_front.send((stream, addr)) } else { to_workers.send((stream, addr)) };
        });
    }
}

/// Whether the connection's first bytes are a `/health` request; false when they do not come within
/// `PEEK_FOR`. Reads nothing (peeks), so the server that gets the connection sees it whole.
async fn is_probe(stream: &TcpStream) -> bool {
    let deadline = tokio::time::Instant::now() + PEEK_FOR;
    let mut buf = [0u8; PROBE.len() + 1];
    loop {
        let n = match tokio::time::timeout_at(deadline, stream.peek(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => n,
            _ => return false,
        };
        if n == buf.len() {
            return buf.starts_with(PROBE) && matches!(buf[PROBE.len()], b' ' | b'?');
        }
        if !PROBE.starts_with(&buf[..n]) {
            return false;
        }
        // a request line split across packets: peek returns at once while those bytes wait, so sleep
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use std::io::{Read, Write};
    use std::time::Instant;

    fn get_path(addr: SocketAddr, path: &str) -> String {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        write!(s, "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    /// While the model loads, every request gets 503 with an OpenAI-shaped error and Retry-After; after
    /// `stop` the same listener serves the router.
    #[test]
    fn the_port_answers_503_while_loading_then_serves() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let loading = LoadingResponder::start(listener).unwrap();
        for path in ["/health", "/v1/models"] {
            let answer = get_path(addr, path);
            assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
            assert!(answer.contains("retry-after: 1") && answer.contains(r#""message":"the model is loading""#), "{answer}");
        }
        let listener = loading.stop().unwrap();
        let incoming = spawn(listener, Router::new().route("/health", get(|| async { "ok" }))).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let router = Router::new().route("/health", get(|| async { "ok" }));
        rt.spawn(async move { axum::serve(incoming, router).await });
        let answer = get_path(addr, "/health");
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("ok"), "{answer}");
    }

    /// The workers' only thread is blocked for 3 s by a handler; a probe sent meanwhile is answered by the
    /// front thread at once, and the blocked request and others still reach the workers.
    #[test]
    fn a_probe_is_answered_while_the_workers_are_blocked() {
        let router = Router::new()
            .route("/health", get(|| async { "ok from health" }))
            .route("/block", get(|| async {
                std::thread::sleep(Duration::from_secs(3));
                "unblocked"
            }))
            .route("/other", get(|| async { "other" }));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let incoming = spawn(listener, router.clone()).unwrap();
        let addr = axum::serve::Listener::local_addr(&incoming).unwrap();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move { axum::serve(incoming, router).await.unwrap() });
        });
        assert!(get_path(addr, "/other").ends_with("other"));
        let blocked = std::thread::spawn(move || get_path(addr, "/block"));
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        let health = get_path(addr, "/health");
        let took = t.elapsed();
        assert!(health.starts_with("HTTP/1.1 200") && health.ends_with("ok from health"), "{health}");
        assert!(took < Duration::from_millis(1500), "the probe waited {took:?} for the blocked workers");
        assert!(!blocked.is_finished(), "the workers should still be blocked when the probe is answered");
        assert!(blocked.join().unwrap().ends_with("unblocked"));
        // a query string is a probe too; a path that only begins with /health is not
        assert!(get_path(addr, "/health?x=1").ends_with("ok from health"));
        assert!(get_path(addr, "/healthz").starts_with("HTTP/1.1 404"));
    }

    #[test]
    fn only_a_get_of_health_is_a_probe() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            for (sent, probe) in [
                (&b"GET /health HTTP/1.1\r\n"[..], true),
                (b"GET /health?full=1 HTTP/1.1\r\n", true),
                (b"GET /healthz HTTP/1.1\r\n", false),
                (b"POST /health HTTP/1.1\r\n", false),
                (b"GET /v1/models HTTP/1.1\r\n", false),
                (b"", false),
            ] {
                let mut client = std::net::TcpStream::connect(addr).unwrap();
                let (server, _) = listener.accept().await.unwrap();
                client.write_all(sent).unwrap();
                assert_eq!(is_probe(&server).await, probe, "{}", String::from_utf8_lossy(sent));
            }
            // the request line split across two writes
            let mut client = std::net::TcpStream::connect(addr).unwrap();
            let (server, _) = listener.accept().await.unwrap();
            client.write_all(b"GET /hea").unwrap();
            let later = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(10));
                client.write_all(b"lth HTTP/1.1\r\n").unwrap();
                client
            });
            assert!(is_probe(&server).await);
            drop(later.join());
        });
    }
}
