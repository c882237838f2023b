//! reckon's lab: benchmarks and the statistics behind every figure reckon reports.

pub mod bench;
pub mod stats;
