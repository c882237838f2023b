//! The one way a lab command starts `reckon serve` and waits for it (`lab serve`, `soak`, `quality`,
//! `cluster`), and the one readiness test for a server it is given by URL: `/health` answering 200.
//! The port of `reckon serve` opens before the model is loaded and answers 503 meanwhile, so a TCP
//! connect or a `/v1/models` request is not readiness. A server that exits or never gets ready is an
//! error with the tail of its log, not ten minutes of waiting and a pointer to a file.

use anyhow::{Context, Result};
use reckon_lab::http::{self, Endpoint, Read};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long a model may take to load before the lab gives up (a 17 GiB file read cold from disk).
pub const READY_TIMEOUT: Duration = Duration::from_secs(600);

/// A `reckon serve` child with its output in a log file; stopped (SIGKILL) on drop.
pub struct ServerProcess {
    child: std::process::Child,
    /// `http://127.0.0.1:PORT`
    pub url: String,
    pub log: PathBuf,
}

impl ServerProcess {
    /// Starts `reckon serve -m MODEL --port PORT EXTRA...` on a free loopback port, its stdout and stderr
    /// in `log`, and returns once `/health` answers 200.
    pub fn start(model: &str, extra: &[String], log: &Path) -> Result<ServerProcess> {
        let port = free_port()?;
        Self::start_with(&["serve", "-m", model, "--port", &port.to_string()], extra, port, log)
    }

    /// Starts this binary with `args` then `extra`, serving on `port`, and waits for it as `start`.
    pub fn start_with(args: &[&str], extra: &[String], port: u16, log: &Path) -> Result<ServerProcess> {
        let file = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = std::process::Command::new(std::env::current_exe()?);
        cmd.args(args).args(extra).stdin(std::process::Stdio::null()).stdout(file.try_clone()?).stderr(file);
        let child = cmd.spawn().context("starting reckon serve")?;
        let mut server = ServerProcess { child, url: format!("http://127.0.0.1:{port}"), log: log.to_path_buf() };
        wait_ready(&server.url.clone(), READY_TIMEOUT, Some(&mut server))?;
        Ok(server)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (`libc::SIGTERM`, `libc::SIGKILL`) to the server.
    pub fn signal(&self, signal: i32) -> Result<()> {
        send_signal(self.pid(), signal)
    }

    /// Waits for the server to exit (after a signal), and its status.
    pub fn wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child.wait().ok()
    }

    /// The exit status, if the server has exited.
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `signal` to process `pid` (no `kill` subprocess).
pub fn send_signal(pid: u32, signal: i32) -> Result<()> {
    // SAFETY: kill(2) takes a pid and a signal number and touches no memory of this process.
    let r = unsafe { libc::kill(pid as libc::pid_t, signal) };
    anyhow::ensure!(r == 0, "signal {signal} to process {pid}: {}", std::io::Error::last_os_error());
    Ok(())
}

pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Waits until `url`'s `/health` answers 200, for at most `timeout`. With `server` (a child this command
/// started), its exit ends the wait at once, and every failure quotes its log's last lines. A server
/// given by URL that has no `/health` (404) is taken as ready: not every OpenAI-compatible server has one.
pub fn wait_ready(url: &str, timeout: Duration, mut server: Option<&mut ServerProcess>) -> Result<()> {
    let ep = Endpoint::parse(url).map_err(|e| anyhow::anyhow!("{url}: {e}"))?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let started = Instant::now();
    loop {
        let last = match rt.block_on(http::send(&ep, "GET", "/health", &[], None, Duration::from_secs(5), Read::All)) {
            Ok(a) if a.status == 200 => return Ok(()),
            Ok(a) if a.status == 404 && server.is_none() => return Ok(()),
            Ok(a) => format!("{} {}", a.status, String::from_utf8_lossy(&a.body()).trim()),
            Err(e) => format!("{e:?}"),
        };
        if let Some(s) = server.as_deref_mut() {
            if let Some(status) = s.try_wait() {
                anyhow::bail!("reckon serve exited ({status}) before it was ready; the end of {}:\n{}", s.log.display(), log_tail(&s.log, 20));
            }
        }
        if started.elapsed() > timeout {
            let tail = server.as_deref().map_or(String::new(), |s| format!("; the end of {}:\n{}", s.log.display(), log_tail(&s.log, 20)));
            anyhow::bail!("{url}/health did not answer 200 within {} s (last: {last}){tail}", timeout.as_secs());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The last `n` lines of a log file (what there is, if it cannot be read whole).
pub fn log_tail(path: &Path, n: usize) -> String {
    let text = std::fs::read(path).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_else(|e| format!("({e})"));
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
