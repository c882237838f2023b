//! Parity debugging aid: with `RECKON_DUMP_DIR` set, named activations of the last token of each forward
//! step are written there as raw f32 (`{name}-{layer}.f32`, overwritten every step), to compare with
//! llama.cpp's graph tensors (bench/llamacpp_tensors.py). Costs one cached env lookup when unset.
use std::path::PathBuf;
use std::sync::OnceLock;

fn dir() -> Option<&'static PathBuf> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| std::env::var_os("RECKON_DUMP_DIR").map(PathBuf::from)).as_ref()
}

/// Whether dumping is on (to skip building names when it is not).
pub fn enabled() -> bool {
    dir().is_some()
}

/// `rows`: `[n, width]` activations; the last row is written.
pub fn dump(name: &str, layer: usize, rows: &[f32], n: usize) {
    let Some(dir) = dir() else { return };
    if n == 0 {
        return;
    }
    let width = rows.len() / n;
    let last = &rows[(n - 1) * width..n * width];
    let bytes: Vec<u8> = last.iter().flat_map(|x| x.to_le_bytes()).collect();
    let _ = std::fs::write(dir.join(format!("{name}-{layer}.f32")), bytes);
}
