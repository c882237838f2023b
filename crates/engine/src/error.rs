//! The engine's one error type. Every failure a user can cause (a broken model file, bad input) is one of
//! these, with a message that names the problem; panics are reserved for broken invariants.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot open model file {path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error("invalid GGUF file: {0}")]
    Gguf(String),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("model metadata: {0}")]
    Metadata(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T> = std::result::Result<T, Error>;
