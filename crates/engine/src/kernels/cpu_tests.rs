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
    // the kernels run the best level this CPU has within the cap (AVX-VNNI is below AVX-512 in the
    // order, and missing on AVX-512 CPUs without it: a cap of avxvnni there gives avx2)
    let (cap, level) = (cap_from_env(), simd_level());
    let best = super::available_levels().into_iter().filter(|&l| l <= cap).max();
    assert_eq!(Some(level), best, "cap {}, available {:?}", cap.name(), super::available_levels());
    if let Some(required) = required_by_env() {
        assert!(simd_level() >= required, "RECKON_REQUIRE_SIMD={} but the kernels run {}", required.name(), simd_level().name());
        // AVX-VNNI is not part of the AVX-512 level: requiring it means its kernels run.
        assert!(required != SimdLevel::AvxVnni || simd_level() == SimdLevel::AvxVnni, "RECKON_REQUIRE_SIMD=avxvnni but the kernels run {}", simd_level().name());
    }
}

/// `--simd scalar` (a cap of `Scalar`) runs portable code everywhere: no routine takes its AVX2 or
/// AVX-512 path above the cap (`scripts/test` runs this under `RECKON_SIMD=scalar` and `avx2`). The ggml
/// math routines once took their AVX2 path whatever the cap.
#[test]
fn no_vector_path_runs_above_the_cap() {
    use crate::kernels::ggml::math;
    let level = simd_level();
    assert_eq!(super::allows(SimdLevel::Avx2), level >= SimdLevel::Avx2);
    #[cfg(target_arch = "x86_64")]
    {
        assert!(!math::avx2_available() || level >= SimdLevel::Avx2, "the ggml math's AVX2 path runs under a cap of {}", cap_from_env().name());
        assert!(!math::avx512_available() || level >= SimdLevel::Avx512, "the ggml math's AVX-512 path runs under a cap of {}", cap_from_env().name());
        // and within the cap they do run
        assert_eq!(math::avx2_available(), level >= SimdLevel::Avx2);
    }
}
