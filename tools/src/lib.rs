//! What the developer tools share. The tools keep the environment variables they had when they were
//! examples of the engine crate (so an old and a new build can be run side by side in one script):
//! `RECKON_NUMERICS=ggml|packed`, `RECKON_SIMD=avx2|scalar` and `RECKON_HUGE_PAGES=0`. They are read
//! here, in the binaries, and passed to the library.

use reckon_engine::gguf::GgufFile;
use reckon_engine::kernels::cpu::{set_simd_cap, SimdLevel};
use reckon_engine::model::{LoadOptions, Model, Numerics};

/// The numerics `RECKON_NUMERICS` asks for, else the CPU's default.
pub fn numerics() -> Numerics {
    match std::env::var("RECKON_NUMERICS").map(|v| v.to_ascii_lowercase()).as_deref() {
        Ok("ggml") => Numerics::Ggml,
        Ok("packed") => Numerics::Packed,
        _ => Numerics::default_for_cpu(),
    }
}

/// Applies `RECKON_SIMD` and `RECKON_HUGE_PAGES`; call first.
pub fn init_process() {
    if let Some(level) = std::env::var("RECKON_SIMD").ok().and_then(|v| SimdLevel::from_name(&v)) {
        set_simd_cap(level);
    }
    if std::env::var("RECKON_HUGE_PAGES").is_ok_and(|v| v == "0") {
        reckon_engine::huge_buf::set_huge_pages(false);
    }
}

/// Sets up the process and loads the model at `path` with `numerics()`.
pub fn load_model(path: &str) -> Model {
    init_process();
    Model::load_with(GgufFile::open(path).expect("model file"), LoadOptions::from(numerics())).expect("load")
}
