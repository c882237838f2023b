//! Test support for the kernel tests: the SIMD cap and the required level come from the environment here
//! (`scripts/test` reruns the unit tests under `RECKON_SIMD=avx2`; CI sets `RECKON_REQUIRE_SIMD` to what
//! its host has). Only tests read these variables.

use super::{simd_level, SimdLevel};

/// The unit tests' SIMD cap: `RECKON_SIMD`, else none.
pub(crate) fn cap_from_env() -> SimdLevel {
    std::env::var("RECKON_SIMD").ok().and_then(|v| SimdLevel::from_name(&v)).unwrap_or(SimdLevel::Avx512)
}

/// For a test that needs kernels of `level`: whether they run here (within the cap). If not, the test
/// skips with a note, unless `RECKON_REQUIRE_SIMD` names `level` or a higher one: then it fails (CI sets
/// what its host has, so a skip there is a defect, not a pass).
pub(crate) fn test_needs(level: SimdLevel, what: &str) -> bool {
    if simd_level() >= level {
        return true;
    }
    if let Some(required) = required_by_env() {
        assert!(required < level, "{what} needs {} kernels, which RECKON_REQUIRE_SIMD={} requires; here they are {}", level.name(), required.name(), simd_level().name());
    }
    eprintln!("note: no {} kernels here; {what} skipped", level.name());
    false
}

fn required_by_env() -> Option<SimdLevel> {
    let v = std::env::var("RECKON_REQUIRE_SIMD").ok().filter(|v| !v.is_empty())?;
    Some(SimdLevel::from_name(&v).unwrap_or_else(|| panic!("RECKON_REQUIRE_SIMD={v:?}: not scalar, avx2, avxvnni or avx512")))
}

/// The kernel tests loop over `available_levels()`; this one fails where the level CI requires is
/// missing, rather than letting those loops quietly cover less.
#[test]
fn the_required_simd_level_is_present() {
    if let Some(required) = required_by_env() {
        assert!(simd_level() >= required, "RECKON_REQUIRE_SIMD={} but the kernels run {}", required.name(), simd_level().name());
        // AVX-VNNI is not part of the AVX-512 level: requiring it means its kernels run.
        assert!(required != SimdLevel::AvxVnni || simd_level() == SimdLevel::AvxVnni, "RECKON_REQUIRE_SIMD=avxvnni but the kernels run {}", simd_level().name());
    }
}
