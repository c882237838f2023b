//! reckon's lab: benchmarks and the statistics behind every figure reckon reports.

pub mod bandwidth;
pub mod bench;
pub mod cluster;
pub mod eviction;
pub mod http;
pub mod kv;
pub mod prefix;
pub mod quality;
pub mod report;
pub mod serve;
pub mod soak;
pub mod spec;
pub mod spec_prefill;
pub mod stats;

#[derive(Debug, thiserror::Error)]
pub enum LabError {
    #[error(transparent)]
    Engine(#[from] reckon_engine::Error),
    #[error("request failed: {0}")]
    Request(String),
    #[error("plot: {0}")]
    Plot(String),
    /// The sandbox could not run a program as it should (bwrap failed, a limit could not be set).
    #[error("sandbox: {0}")]
    Sandbox(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}
