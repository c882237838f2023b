//! What this CPU can do, asked in one place: the features the kernels need, detected once, and the SIMD
//! level every kernel dispatches on (the best one the CPU has, capped for the process by `set_simd_cap`).

use std::sync::OnceLock;

/// Instruction-set level of the SIMD kernels. Ordered: a level runs every kernel of the levels below it,
/// except that `Avx512` never runs `AvxVnni`'s (AVX-512 CPUs before Sapphire Rapids lack AVX-VNNI, and
/// at `Avx512` the packed matmul has its own kernels).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// Portable reference code, mirrors ggml's generic C.
    Scalar,
    /// AVX2 + FMA + F16C (x86-64-v3).
    Avx2,
    /// Avx2 plus AVX-VNNI (`vpdpbusd` on 256-bit registers, VEX-encoded): Intel client cores since Alder
    /// Lake, Xeons since Sapphire Rapids, AMD Zen 5. Only the packed matmul has kernels of its own here;
    /// everything else runs its AVX2 code.
    AvxVnni,
    /// AVX-512 F/BW/VL/DQ/VNNI on top of Avx2 (`vpdpbusd`, `vpdpwssd`). Types without an AVX-512 kernel
    /// use their AVX2 one at this level.
    Avx512,
}

impl SimdLevel {
    pub const ALL: [SimdLevel; 4] = [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::AvxVnni, SimdLevel::Avx512];

    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::AvxVnni => "avxvnni",
            SimdLevel::Avx512 => "avx512",
        }
    }

    /// `scalar`, `avx2`, `avxvnni` or `avx512`.
    pub fn from_name(name: &str) -> Option<SimdLevel> {
        SimdLevel::ALL.into_iter().find(|l| l.name().eq_ignore_ascii_case(name))
    }

    /// The best level this CPU supports, whatever the cap.
    pub fn detected() -> SimdLevel {
        CpuFeatures::get().best_level()
    }

    /// Whether this CPU has the features of `self` (the kernels of a level check this before running).
    pub fn is_available(self) -> bool {
        let f = CpuFeatures::get();
        match self {
            SimdLevel::AvxVnni => f.avxvnni && SimdLevel::Avx2 <= SimdLevel::detected(),
            _ => self <= SimdLevel::detected(),
        }
    }
}

/// The x86 features the kernels use, as the CPU reports them (all false on other architectures).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuFeatures {
    pub avx2: bool,
    pub fma: bool,
    pub f16c: bool,
    pub avx512f: bool,
    pub avx512bw: bool,
    pub avx512vl: bool,
    pub avx512dq: bool,
    pub avx512vnni: bool,
    pub avxvnni: bool,
}

impl CpuFeatures {
    /// This CPU's features, detected on first use.
    pub fn get() -> &'static CpuFeatures {
        static FEATURES: OnceLock<CpuFeatures> = OnceLock::new();
        FEATURES.get_or_init(CpuFeatures::detect)
    }

    #[cfg(target_arch = "x86_64")]
    fn detect() -> CpuFeatures {
        use std::arch::is_x86_feature_detected as has;
        CpuFeatures {
            avx2: has!("avx2"),
            fma: has!("fma"),
            f16c: has!("f16c"),
            avx512f: has!("avx512f"),
            avx512bw: has!("avx512bw"),
            avx512vl: has!("avx512vl"),
            avx512dq: has!("avx512dq"),
            avx512vnni: has!("avx512vnni"),
            avxvnni: has!("avxvnni"),
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn detect() -> CpuFeatures {
        CpuFeatures::default()
    }

    /// The best kernel level these features allow.
    pub fn best_level(&self) -> SimdLevel {
        if !(self.avx2 && self.fma && self.f16c) {
            SimdLevel::Scalar
        } else if self.avx512f && self.avx512bw && self.avx512vl && self.avx512vnni && self.avx512dq {
            SimdLevel::Avx512
        } else if self.avxvnni {
            SimdLevel::AvxVnni
        } else {
            SimdLevel::Avx2
        }
    }

    /// The ISA names of the features present, for logs and benchmark stamps.
    pub fn describe(&self) -> String {
        let all = [
            ("avx2", self.avx2),
            ("fma", self.fma),
            ("f16c", self.f16c),
            ("avx512f", self.avx512f),
            ("avx512bw", self.avx512bw),
            ("avx512vl", self.avx512vl),
            ("avx512dq", self.avx512dq),
            ("avx512vnni", self.avx512vnni),
            ("avxvnni", self.avxvnni),
        ];
        all.iter().filter(|(_, on)| *on).map(|(n, _)| *n).collect::<Vec<_>>().join(" ")
    }
}

static CAP: OnceLock<SimdLevel> = OnceLock::new();

/// Caps every kernel at `level` for the rest of the process: to measure what each level buys, or to run
/// the AVX2 paths (AMD Zen 2/3, older Intel) on an AVX-512 machine. Call before any kernel runs; returns
/// false (and changes nothing) if the level was already fixed by then.
pub fn set_simd_cap(level: SimdLevel) -> bool {
    CAP.set(level).is_ok() || *CAP.get().expect("set or present") == level
}

/// The cap in force (`Avx512`, i.e. none, unless `set_simd_cap` said otherwise). The library's own unit
/// tests take it from `RECKON_SIMD`, so the AVX2 paths are tested on AVX-512 machines too.
pub fn simd_cap() -> SimdLevel {
    *CAP.get_or_init(default_cap)
}

#[cfg(not(test))]
fn default_cap() -> SimdLevel {
    SimdLevel::Avx512
}

#[cfg(test)]
fn default_cap() -> SimdLevel {
    tests::cap_from_env()
}

/// The level the kernels use: the best this CPU supports, within the cap (a cap of `AvxVnni` on an
/// AVX-512 CPU without AVX-VNNI gives `Avx2`).
pub fn simd_level() -> SimdLevel {
    static ACTIVE: OnceLock<SimdLevel> = OnceLock::new();
    *ACTIVE.get_or_init(|| {
        let level = simd_cap().min(SimdLevel::detected());
        if level.is_available() {
            level
        } else {
            SimdLevel::Avx2
        }
    })
}

/// Whether code of `level` may run: the CPU has it and the cap (`set_simd_cap`, `--simd`) allows it. Every
/// kernel that picks between a vector path and a portable one asks this (or `simd_level`), so that
/// `--simd scalar` runs portable code throughout; FMA and F16C paths count as `Avx2` (the level
/// requires them). Each vector path gives its portable code's bits, tested.
pub fn allows(level: SimdLevel) -> bool {
    simd_level() >= level
}

/// All levels usable on this CPU, lowest first (whatever the cap: tests compare them).
pub fn available_levels() -> Vec<SimdLevel> {
    SimdLevel::ALL.into_iter().filter(|l| l.is_available()).collect()
}

#[cfg(test)]
#[path = "cpu_tests.rs"]
pub(crate) mod tests;
