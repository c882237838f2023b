//! Short names of the fetched models and their file names in the models directory, kept in step with
//! `scripts/fetch-models`. The directory itself is the caller's (the binary reads `$RECKON_HOME`).

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

pub const DEFAULT_MODEL: &str = "smollm2-135m";

/// (short name, file name in the models directory).
pub const KNOWN_MODELS: [(&str, &str); 4] = [
    ("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("gemma3-270m", "gemma-3-270m-q4_k_m.gguf"),
    ("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
];

/// The path of a known model's file in `dir`, whether or not it has been fetched.
pub fn known_model_path(dir: &Path, name: &str) -> Option<PathBuf> {
    KNOWN_MODELS.iter().find(|(n, _)| *n == name).map(|(_, f)| dir.join(f))
}

/// Resolves `-m`: an existing path, or the short name of a model fetched into `dir`.
pub fn resolve_model(dir: &Path, spec: &str) -> Result<PathBuf> {
    if let Some(path) = known_model_path(dir, spec) {
        if path.exists() {
            return Ok(path);
        }
        return Err(Error::Open {
            path: path.clone(),
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("model {spec:?} is not fetched yet; run `scripts/fetch-models {spec}`"),
            ),
        });
    }
    let path = Path::new(spec);
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    let names: Vec<&str> = KNOWN_MODELS.iter().map(|(n, _)| *n).collect();
    Err(Error::Open {
        path: path.to_path_buf(),
        source: std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("no such file, and not a known model name ({})", names.join(", ")),
        ),
    })
}
