//! Stamps the binary with the commit it was built from (`reckon --version`, and the raw files of `reckon
//! lab`), so every measurement names the code that made it.
use std::process::Command;

fn main() {
    let git = |args: &[&str]| {
        Command::new("git").args(args).output().ok().filter(|o| o.status.success()).map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    println!("cargo:rustc-env=RECKON_COMMIT={commit}{}", if dirty { "-dirty" } else { "" });
    // The sources too: an edit that is not staged changes neither HEAD nor the index, and a binary built
    // from it must still say "-dirty".
    for path in [".git/HEAD", ".git/index", "src", "crates", "tools", "Cargo.toml", "Cargo.lock"] {
        println!("cargo:rerun-if-changed={path}");
    }
    if let Some(head) = git(&["symbolic-ref", "-q", "HEAD"]) {
        println!("cargo:rerun-if-changed=.git/{head}");
    }
}
