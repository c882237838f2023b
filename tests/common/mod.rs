//! What the binary's end-to-end tests share.

/// Whether the default model (SmolLM2) is fetched; a missing model skips the test with a note, or fails
/// it under RECKON_REQUIRE_MODELS=1 (CI).
pub fn default_model_fetched() -> bool {
    model_fetched("smollm2-135m")
}

/// Whether the known model `name` is fetched (as `default_model_fetched`).
pub fn model_fetched(name: &str) -> bool {
    let dir = std::env::var_os("RECKON_HOME").map(std::path::PathBuf::from).unwrap_or_else(|| std::path::PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/reckon/models"));
    let model = reckon_engine::registry::known_model_path(&dir, name).expect("known model");
    if !model.exists() {
        assert!(std::env::var("RECKON_REQUIRE_MODELS").is_err(), "{} is missing", model.display());
        eprintln!("note: {} not found; skipping", model.display());
        return false;
    }
    true
}
