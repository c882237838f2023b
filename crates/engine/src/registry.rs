//! Where models live: short names of the fetched models and the cache directory (`$RECKON_HOME`,
//! default `~/.cache/reckon/models`), kept in step with `scripts/fetch-models`.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

pub const DEFAULT_MODEL: &str = "smollm2-135m";

/// (short name, file name in the models directory).
pub const KNOWN_MODELS: [(&str, &str); 3] = [
    ("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("gemma3-270m", "gemma-3-270m-q4_k_m.gguf"),
    ("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
];

pub fn models_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("RECKON_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(home);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("reckon").join("models")
}

/// The path of a known model's file, whether or not it has been fetched.
pub fn known_model_path(name: &str) -> Option<PathBuf> {
    KNOWN_MODELS.iter().find(|(n, _)| *n == name).map(|(_, f)| models_dir().join(f))
}

/// Resolves `-m`: an existing path, or the short name of a fetched model.
pub fn resolve_model(spec: &str) -> Result<PathBuf> {
    if let Some(path) = known_model_path(spec) {
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
