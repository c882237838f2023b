//! Options and loading shared by the subcommands.

use anyhow::{Context, Result};
use clap::Args;
use reckon_engine::engine::EngineConfig;
use reckon_engine::gguf::GgufFile;
use reckon_engine::kernels::cpu::{set_simd_cap, SimdLevel};
use reckon_engine::kv::{KvDtypes, KvWindow};
use reckon_engine::model::{LoadOptions, Model, Numerics};
use reckon_engine::registry::{resolve_model, DEFAULT_MODEL};
use reckon_engine::sampler::SamplingParams;
use reckon_engine::template::ChatTemplate;
use reckon_engine::tokenizer::Tokenizer;
use std::path::PathBuf;

#[derive(Args, Clone)]
pub struct ModelArgs {
    /// A GGUF file path, or a fetched model's short name (smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b).
    #[arg(short = 'm', long = "model", default_value = DEFAULT_MODEL)]
    pub model: String,
    /// Worker threads (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// Matmul arithmetic: `packed` (repacked weights, integer kernels; the default where the CPU has
    /// AVX2 or AVX-512 VNNI) or `ggml` (llama.cpp's per-row kernels: logits bit-identical to llama.cpp's
    /// CPU path, see docs/correctness.md).
    #[arg(long, value_enum)]
    pub numerics: Option<NumericsArg>,
    /// Highest SIMD level the kernels may use: `avx512`, `avxvnni` (AVX2 with AVX-VNNI), `avx2` or
    /// `scalar` (default: the best this CPU has). For measuring what each level buys, or running the
    /// AVX2 paths on an AVX-512 machine.
    #[arg(long, value_enum)]
    pub simd: Option<SimdArg>,
    /// Keep weights and the KV cache on ordinary 4 KiB pages (by default they are advised onto 2 MiB
    /// pages where the kernel allows).
    #[arg(long)]
    pub no_huge_pages: bool,
    /// Write named activations of the last token of every forward step to this directory as raw f32
    /// (`{name}-{layer}.f32`), to compare with llama.cpp's (bench/llamacpp_tensors.py). Debugging only.
    #[arg(long)]
    pub dump_dir: Option<PathBuf>,
    /// How the KV cache stores keys and values: `f16`, `q8_0` or `q4_0` (ggml's 32-value blocks with an
    /// f16 scale), or `K,V` separately (`q8_0,q4_0`; f16 pairs with f16 only). Quantized cells are read
    /// by integer attention kernels (docs/kv-lab.md).
    #[arg(long, default_value = "f16")]
    pub kv_dtype: String,
    /// A StreamingLLM window: every sequence attends to its first `--kv-sinks` tokens and its last N
    /// (whole blocks: N to N + block size - 1), and blocks between them return to the pool, so a
    /// sequence's KV memory is bounded however long it runs. Tokens keep their original positions.
    #[arg(long, value_name = "N")]
    pub kv_window: Option<usize>,
    /// With --kv-window: the leading tokens every query still attends to (the attention sinks; rounded up
    /// to whole blocks).
    #[arg(long, default_value_t = 4, requires = "kv_window")]
    pub kv_sinks: usize,
    /// Block-sparse attention over the history (after Quest): a query at depth reads its first
    /// --sparse-sinks and last --sparse-local positions, and of the blocks between them the N positions'
    /// worth whose keys can score highest against its block's first query (an upper bound from each block's per-dimension key
    /// range). Saves attention time at depth, not memory; output differs from full attention
    /// (docs/kv-lab.md). Any --kv-dtype (bounds from the keys as stored); not with --kv-window.
    #[arg(long, value_name = "N", conflicts_with = "kv_window")]
    pub sparse_attention: Option<usize>,
    /// With --sparse-attention: recent positions every query reads (N in whole blocks before its own block, then that block up to itself).
    #[arg(long, value_name = "N", default_value_t = 512, requires = "sparse_attention")]
    pub sparse_local: usize,
    /// With --sparse-attention: leading positions every query reads (rounded up to whole blocks).
    #[arg(long, value_name = "N", default_value_t = 16, requires = "sparse_attention")]
    pub sparse_sinks: usize,
    /// Keep every position's keys in sliding-window layers too (Gemma-3's 512-token layers). By default
    /// those layers get block tables of their own that release what leaves their window (vLLM's hybrid
    /// KV allocator); --kv-window and --prefix-cache-dir imply this flag.
    #[arg(long)]
    pub no_hybrid_kv: bool,
    /// Speculative decoding: `ngram` (prompt lookup: the longest suffix of the sequence seen before
    /// proposes what followed it; also searched in a request's `prediction`), `draft[:MODEL]` (a smaller
    /// model of the same vocabulary guesses ahead; MODEL or --spec-draft), `auto` (n-gram guesses, and
    /// with --spec-draft the draft model's where no n-gram matches, only as many as the engine's measured
    /// step cost and each request's acceptance say pay) or `off`. Greedy and seeded output is the same
    /// tokens either way (docs/speculative.md). Default: `auto` for `serve`, `run` and `chat`, `off` for
    /// `bench` and the labs (which measure one thing at a time).
    #[arg(long, value_parser = parse_spec_arg)]
    pub spec: Option<(SpecArg, Option<String>)>,
    /// The draft model of `--spec draft` and `--spec auto` (a name from `reckon models` or a path).
    #[arg(long, value_name = "MODEL")]
    pub spec_draft: Option<String>,
    /// Sparse prefill (SpecPrefill, docs/spec-prefill.md): a new prompt suffix (beyond a prefix-cache
    /// hit) of at least --spec-prefill-min-tokens is scored by the first --spec-prefill-layers layers of
    /// --spec-prefill-scorer (or the model itself), and only this share of its chunks is prefilled, each
    /// token at its own position. Off by default; the answer then depends on what was dropped.
    #[arg(long, value_name = "SHARE")]
    pub spec_prefill_keep: Option<f64>,
    /// Thin only a new suffix (beyond a prefix-cache hit) of at least this many tokens: shorter ones
    /// keep too few chunks to hold what matters (docs/spec-prefill.md: at 2k, keep 0.2 lost 4 of 5
    /// needles; at 4k 1 of 5).
    #[arg(long, default_value_t = 4096, requires = "spec_prefill_keep")]
    pub spec_prefill_min_tokens: usize,
    #[arg(long, default_value_t = 4, requires = "spec_prefill_keep")]
    pub spec_prefill_layers: usize,
    /// While idle, recompute the full prompts of recent sparse prefills, so a later turn finds the whole
    /// prefix in the cache (any arriving request stops it at once).
    #[arg(long, requires = "spec_prefill_keep")]
    pub spec_prefill_recover: bool,
    /// Recovery computes at most this many tokens a step: a request arriving mid-slice waits for at
    /// most one slice.
    #[arg(long, default_value_t = 128, value_name = "TOKENS")]
    pub spec_prefill_recover_slice: usize,
    /// Score prompts with this smaller model of the same vocabulary (SpecPrefill's draft; default: the
    /// model's own first layers).
    #[arg(long, value_name = "MODEL", requires = "spec_prefill_keep")]
    pub spec_prefill_scorer: Option<String>,
    /// What `--spec` is when not given (set by the command before it reads the options).
    #[arg(skip = SpecArg::Off)]
    pub default_spec: SpecArg,
    /// Most tokens guessed per step.
    #[arg(long, default_value_t = 4)]
    pub spec_k: usize,
    /// Shortest and longest suffix the n-gram proposer matches, `MIN-MAX`.
    #[arg(long, default_value = "2-4")]
    pub spec_ngram: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecArg {
    Off,
    Ngram,
    /// A draft model's guesses.
    Draft,
    /// Guesses (n-gram, and a draft model's where one is given), only those the engine's own step-cost
    /// measurements say pay.
    Auto,
}

/// `--spec`: `off`, `ngram`, `auto`, `draft` or `draft:MODEL`.
fn parse_spec_arg(s: &str) -> std::result::Result<(SpecArg, Option<String>), String> {
    let mode = match s.split_once(':') {
        Some(("draft", m)) if !m.is_empty() => return Ok((SpecArg::Draft, Some(m.to_string()))),
        Some(_) => None,
        None => match s {
            "off" => Some(SpecArg::Off),
            "ngram" => Some(SpecArg::Ngram),
            "auto" => Some(SpecArg::Auto),
            "draft" => Some(SpecArg::Draft),
            _ => None,
        },
    };
    mode.map(|m| (m, None)).ok_or_else(|| format!("'{s}': one of off, ngram, auto, draft, draft:MODEL"))
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum NumericsArg {
    Packed,
    Ggml,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum SimdArg {
    Avx512,
    #[value(name = "avxvnni")]
    AvxVnni,
    Avx2,
    Scalar,
}

impl ModelArgs {
    /// The numerics asked for, else packed where it runs.
    pub fn numerics(&self) -> Numerics {
        match self.numerics {
            Some(NumericsArg::Packed) => Numerics::Packed,
            Some(NumericsArg::Ggml) => Numerics::Ggml,
            None => Numerics::default_for_cpu(),
        }
    }

    /// The process-wide options (threads, SIMD cap, huge pages): call once, before loading a model.
    /// Returns the number of worker threads.
    pub fn init_process(&self) -> Result<usize> {
        if let Some(simd) = self.simd {
            let level = match simd {
                SimdArg::Avx512 => SimdLevel::Avx512,
                SimdArg::AvxVnni => SimdLevel::AvxVnni,
                SimdArg::Avx2 => SimdLevel::Avx2,
                SimdArg::Scalar => SimdLevel::Scalar,
            };
            anyhow::ensure!(level != SimdLevel::AvxVnni || level.is_available(), "--simd avxvnni: this CPU has no AVX-VNNI (or no AVX2)");
            anyhow::ensure!(set_simd_cap(level), "--simd: the kernels already chose their level");
        }
        reckon_engine::huge_buf::set_huge_pages(!self.no_huge_pages);
        init_threads(self.threads)
    }

    /// `--kv-dtype`, checked against the model's heads and the KV block size.
    pub fn kv_dtypes(&self, cfg: &reckon_engine::model::ModelConfig, block_size: usize) -> Result<KvDtypes> {
        let d = KvDtypes::parse(&self.kv_dtype).map_err(|e| anyhow::anyhow!("--kv-dtype: {e}"))?;
        d.check_shape(cfg.head_dim, block_size).map_err(|e| anyhow::anyhow!("--kv-dtype: {e}"))?;
        Ok(d)
    }

    /// `--kv-window` and `--kv-sinks`.
    /// The KV choices for `model` with blocks of `block_size` (`disk_tier`: a prefix-cache directory is
    /// in use).
    pub fn kv_choice(&self, cfg: &reckon_engine::model::ModelConfig, block_size: usize, disk_tier: bool) -> Result<KvChoice> {
        let dtypes = self.kv_dtypes(cfg, block_size)?;
        let sparse = self.sparse_attention()?;
        // An architecture that cannot speculate (`model::capabilities`: LFM2's conv state is not rolled
        // back) gets the command's default speculation off (said at start); `--spec` given is refused by
        // the engine's check.
        let spec = if !cfg.capabilities.speculation && self.spec.is_none() && self.default_spec != SpecArg::Off {
            tracing::warn!("speculative decoding is off: {}", cfg.capabilities.limitation);
            None
        } else {
            self.spec()?
        };
        Ok(KvChoice { spec, spec_prefill: self.spec_prefill()?, dtypes, window: self.kv_window()?, sparse, hybrid: !self.no_hybrid_kv, disk_tier })
    }

    /// `--spec-prefill-keep` and its settings, or none.
    pub fn spec_prefill(&self) -> Result<Option<reckon_engine::engine::sparse::SparsePrefillConfig>> {
        let Some(keep) = self.spec_prefill_keep else { return Ok(None) };
        anyhow::ensure!(keep > 0.0 && keep <= 1.0, "--spec-prefill-keep {keep}: a share in (0, 1]");
        anyhow::ensure!(self.spec_prefill_layers >= 1, "--spec-prefill-layers must be at least 1");
        let base = reckon_engine::engine::sparse::SparsePrefillConfig::default();
        Ok(Some(reckon_engine::engine::sparse::SparsePrefillConfig { keep, min_tokens: self.spec_prefill_min_tokens, layers: self.spec_prefill_layers, recover: self.spec_prefill_recover, recover_slice: self.spec_prefill_recover_slice.max(1), ..base }))
    }

    /// The speculative decoding every request gets (`--spec`), or none.
    pub fn spec(&self) -> Result<Option<reckon_engine::engine::spec::SpecConfig>> {
        let (lo, hi) = self.spec_ngram.split_once('-').with_context(|| format!("--spec-ngram '{}': MIN-MAX", self.spec_ngram))?;
        let (min_n, max_n): (usize, usize) = (lo.trim().parse()?, hi.trim().parse()?);
        anyhow::ensure!(min_n >= 1 && min_n <= max_n, "--spec-ngram '{}': need 1 <= MIN <= MAX", self.spec_ngram);
        anyhow::ensure!(self.spec_k >= 1, "--spec-k must be at least 1");
        let mode = self.spec_mode();
        let draft = self.draft_model_name()?.is_some();
        Ok((mode != SpecArg::Off).then_some(reckon_engine::engine::spec::SpecConfig { k: self.spec_k, min_n, max_n, auto: mode == SpecArg::Auto, draft }))
    }

    /// `--spec`, or the command's default.
    pub fn spec_mode(&self) -> SpecArg {
        self.spec.as_ref().map_or(self.default_spec, |s| s.0)
    }

    /// The draft model to load, if speculation uses one: `--spec draft:MODEL` or `--spec-draft MODEL`.
    pub fn draft_model_name(&self) -> Result<Option<&str>> {
        let named = self.spec.as_ref().and_then(|s| s.1.as_deref()).or(self.spec_draft.as_deref());
        match self.spec_mode() {
            SpecArg::Draft => Ok(Some(named.context("--spec draft needs a model: --spec draft:MODEL or --spec-draft MODEL")?)),
            SpecArg::Auto => Ok(named),
            SpecArg::Off | SpecArg::Ngram => {
                anyhow::ensure!(named.is_none(), "--spec-draft goes with --spec draft or --spec auto");
                Ok(None)
            }
        }
    }

    pub fn kv_window(&self) -> Result<Option<KvWindow>> {
        let Some(window) = self.kv_window else { return Ok(None) };
        anyhow::ensure!(window > 0, "--kv-window must be at least 1");
        Ok(Some(KvWindow { window, sinks: self.kv_sinks }))
    }

    /// `--sparse-attention` and its settings, or none.
    pub fn sparse_attention(&self) -> Result<Option<reckon_engine::kv::SparseAttention>> {
        let Some(budget) = self.sparse_attention else { return Ok(None) };
        anyhow::ensure!(budget > 0 && self.sparse_local > 0, "--sparse-attention and --sparse-local must be at least 1");
        Ok(Some(reckon_engine::kv::SparseAttention { budget, local: self.sparse_local, sinks: self.sparse_sinks }))
    }

    /// The options a model is loaded with.
    pub fn load_options(&self) -> LoadOptions {
        LoadOptions { numerics: self.numerics(), dump_dir: self.dump_dir.clone() }
    }

    /// Loads the model file with the chosen options (a note on stderr where packed is not available).
    pub fn load_model(&self, path: &std::path::Path) -> Result<Model> {
        let file = GgufFile::open(path).with_context(|| format!("loading {}", path.display()))?;
        load_model_file(file, path, self.load_options())
    }
}

fn load_model_file(file: GgufFile, path: &std::path::Path, options: LoadOptions) -> Result<Model> {
    let wanted = options.numerics;
    let model = Model::load_with(file, options).with_context(|| format!("loading {}", path.display()))?;
    if model.numerics() != wanted {
        eprintln!("note: this CPU has no {} kernels (AVX2 or AVX-512 VNNI); running {} numerics", wanted.name(), model.numerics().name());
    }
    Ok(model)
}

/// Sampling choices. Each one not given takes the model file's recommendation (`general.sampling.*`)
/// or else llama.cpp's default; `serve` gives the same values to requests that omit the field.
#[derive(Args, Clone, Default)]
pub struct SamplingArgs {
    /// 0 = greedy [default: the model's general.sampling.temp, else 0.8].
    #[arg(long)]
    pub temperature: Option<f32>,
    /// 0 = disabled [default: the model's, else 40].
    #[arg(long)]
    pub top_k: Option<usize>,
    /// [default: the model's, else 0.95]
    #[arg(long)]
    pub top_p: Option<f32>,
    /// [default: the model's, else 0.05]
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Repetition penalty (1.0 = off), over the last --penalty-last-n tokens [default: the model's, else 1.0].
    #[arg(long)]
    pub repeat_penalty: Option<f32>,
    /// [default: 0]
    #[arg(long)]
    pub presence_penalty: Option<f32>,
    /// [default: 0]
    #[arg(long)]
    pub frequency_penalty: Option<f32>,
    /// Tokens the penalties look back over, 0 = all [default: the model's, else 64].
    #[arg(long)]
    pub penalty_last_n: Option<usize>,
    /// Random seed (default: from the clock; for `serve`, each request's own or the clock).
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// The model's recommended sampling with these flags over it (seed 0 when none was given).
    pub fn over(&self, model: &SamplingParams) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature.unwrap_or(model.temperature),
            top_k: self.top_k.unwrap_or(model.top_k),
            top_p: self.top_p.unwrap_or(model.top_p),
            min_p: self.min_p.unwrap_or(model.min_p),
            repetition_penalty: self.repeat_penalty.unwrap_or(model.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(model.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(model.frequency_penalty),
            penalty_last_n: self.penalty_last_n.unwrap_or(model.penalty_last_n),
            seed: self.seed.unwrap_or(0),
        }
    }

    /// What `run` and `chat` sample with: `over` the model's, the seed from the clock unless given.
    pub fn params(&self, model: &SamplingParams) -> SamplingParams {
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
        });
        SamplingParams { seed, ..self.over(model) }
    }
}

/// One line of the sampling values in force, for `info` and the server's start line.
pub fn describe_sampling(p: &SamplingParams) -> String {
    format!("temperature {}, top_k {}, top_p {}, min_p {}, repeat_penalty {} over {}, presence {}, frequency {}", p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, match p.penalty_last_n { 0 => "all".to_string(), n => n.to_string() }, p.presence_penalty, p.frequency_penalty)
}

fn init_threads(threads: Option<usize>) -> Result<usize> {
    let n = threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    anyhow::ensure!(n >= 1, "--threads must be at least 1");
    anyhow::ensure!(reckon_engine::pool::init_global(n), "the thread pool was already started");
    Ok(n)
}

/// What a raw result file names besides its command: the commit this binary was built from, the CPU
/// model and the ISA extensions the kernels choose between.
pub fn stamp() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| info.lines().find(|l| l.split(':').next().map(str::trim) == Some(name)).and_then(|l| l.split_once(':')).map(|(_, v)| v.trim().to_string()).unwrap_or_else(|| "unknown".into());
    // "AMD EPYC" alone names no generation: family and model do (26/2 is Zen 5, 25/1 Zen 3).
    let cpu = format!("{} (family {}, model {}, {} logical CPUs)", field("model name"), field("cpu family"), field("model"), info.lines().filter(|l| l.starts_with("processor")).count());
    let features = reckon_engine::kernels::cpu::CpuFeatures::get();
    format!("commit: {}\ncpu: {cpu}\nisa: {}\nkernels: {}\n", env!("RECKON_COMMIT"), features.describe(), reckon_engine::kernels::cpu::simd_level().name())
}

/// Where fetched models live: `$RECKON_HOME`, default `~/.cache/reckon/models` (as scripts/fetch-models).
pub fn models_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("RECKON_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(home);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("reckon").join("models")
}

pub fn model_path(spec: &str) -> Result<PathBuf> {
    Ok(resolve_model(&models_dir(), spec)?)
}

/// A byte size with a unit (`512MiB`, `2GiB`, `1GB`, `100B`); `None` without a unit.
pub fn byte_size(spec: &str, flag: &str) -> Result<Option<usize>> {
    let s = spec.trim();
    let units = [("GiB", 1usize << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("GB", 1_000_000_000), ("MB", 1_000_000), ("B", 1)];
    for (unit, scale) in units {
        if let Some(n) = s.strip_suffix(unit) {
            let n: f64 = n.trim().parse().with_context(|| format!("{flag}: '{spec}' is not a number of {unit}"))?;
            anyhow::ensure!(n >= 0.0, "{flag}: '{spec}' is negative");
            return Ok(Some((n * scale as f64) as usize));
        }
    }
    Ok(None)
}

/// `--kv-memory` in tokens, given the KV bytes one token takes.
pub fn kv_tokens(spec: &str, bytes_per_token: usize) -> Result<usize> {
    match byte_size(spec, "--kv-memory")? {
        Some(bytes) => Ok(bytes / bytes_per_token),
        None => spec.trim().parse().with_context(|| format!("--kv-memory: '{spec}' is neither a size (512MiB, 2GiB) nor a token count")),
    }
}

/// How the engine keeps keys and values, from `ModelArgs` (and whether a disk tier is in use).
pub struct KvChoice {
    pub spec_prefill: Option<reckon_engine::engine::sparse::SparsePrefillConfig>,
    pub spec: Option<reckon_engine::engine::spec::SpecConfig>,
    pub dtypes: KvDtypes,
    pub window: Option<KvWindow>,
    pub sparse: Option<reckon_engine::kv::SparseAttention>,
    pub hybrid: bool,
    pub disk_tier: bool,
}

/// The engine's KV cache and step budget (`serve`, `lab`).
#[derive(Args, Clone)]
pub struct KvArgs {
    /// KV cache budget: bytes with a unit (`512MiB`, `2GiB`) or a token count (`32768`).
    #[arg(long, default_value = "1GiB")]
    pub kv_memory: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Token budget of one engine step (prefill chunks plus decodes).
    #[arg(long, default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// Prompt tokens of a step that also decodes (default: --max-batch-tokens): a prompt that arrives
    /// while other requests decode is prefilled in chunks this size, which bounds how long it stalls
    /// their next tokens (at the cost of more steps that carry a chunk).
    #[arg(long)]
    pub max_prefill_while_decoding: Option<usize>,
    /// Keep the thread pool's workers spinning between engine steps (by default they park while the
    /// engine sends a step's token events, which on a 2-core host kept those wake-ups from preempting
    /// the engine thread).
    #[arg(long)]
    pub no_pool_rest: bool,
    /// A hybrid recurrent model (LFM2): keep the recurrent state after every N-th block of a sequence.
    /// A prefix-cache hit resumes from such a block, so hits come in steps of N blocks, and the
    /// snapshots take 1/N of one snapshot per block of --kv-memory.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub state_snapshot_every: u32,
}

impl KvArgs {
    /// KV blocks the budget holds for a model whose tokens take `bytes_per_token` of KV each.
    pub fn num_blocks(&self, bytes_per_token: usize) -> Result<usize> {
        anyhow::ensure!(self.block_size > 0, "--block-size must be at least 1");
        let blocks = kv_tokens(&self.kv_memory, bytes_per_token)? / self.block_size;
        anyhow::ensure!(blocks > 0, "--kv-memory {} holds no block of {} tokens", self.kv_memory, self.block_size);
        Ok(blocks)
    }

    /// The engine's configuration for this cache (of `kv_dtypes` cells, for a model of `cfg`) and these
    /// limits.
    #[allow(clippy::too_many_arguments)]
    /// `layout` is the model's KV layout this configuration gets (`EngineConfig::kv_layout`): a block is
    /// one of its pages.
    /// With a draft model, a block also holds its keys and values.
    pub fn engine_config(&self, model: &Model, draft: Option<&Model>, kv: &KvChoice, max_model_len: usize, max_running: usize, max_waiting: usize, prefix_caching: bool) -> Result<EngineConfig> {
        let cfg = &model.config;
        let kv_dtypes = kv.dtypes;
        let mut config = EngineConfig {
            block_size: self.block_size,
            num_blocks: 0,
            kv_dtypes,
            max_batch_tokens: self.max_batch_tokens.max(1),
            max_prefill_tokens_while_decoding: self.max_prefill_while_decoding.map_or(usize::MAX, |n| n.max(1)),
            max_running: max_running.max(1),
            max_waiting,
            max_model_len,
            prefix_caching,
            rest_pool_between_steps: !self.no_pool_rest,
            kv_window: kv.window,
            sparse_attention: kv.sparse,
            hybrid_kv: kv.hybrid,
            spec: kv.spec.clone(),
            spec_prefill: kv.spec_prefill,
            slow_state: Default::default(),
            state_snapshot_every: self.state_snapshot_every as usize,
        };
        let layout = config.kv_layout(model, kv.disk_tier);
        let draft_bytes = draft.map_or(0, |d| kv_dtypes.bytes_per_token(d.config.n_layers, d.config.kv_dim()));
        // sparse attention's key bounds (2 × kv_dim f32) and picks (a u32 per budget block) per block and
        // layer, counted per token
        let bs = self.block_size.max(1);
        let bounds_bytes = kv.sparse.map_or(0, |s| reckon_engine::kv::KvStorage::sparse_state_bytes_per_block(layout.slots(), cfg.kv_dim(), s.budget_blocks(bs)).div_ceil(bs));
        // a hybrid model's conv-state snapshot at every N-th block's end (`kv::conv_state`), per token
        let every = self.state_snapshot_every.max(1) as usize;
        let snapshot_bytes = cfg.short_conv.as_ref().map_or(0, |sc| (sc.state_len(cfg.d_model) * 4).div_ceil(bs * every));
        config.num_blocks = self.num_blocks(kv_dtypes.bytes_per_token(layout.slots(), cfg.kv_dim()) + draft_bytes + bounds_bytes + snapshot_bytes)?;
        Ok(config)
    }
}

/// Everything needed to turn text into tokens and back around a model.
pub struct Loaded {
    pub model: Model,
    /// The sampling the model file recommends (`general.sampling.*` over llama.cpp's defaults).
    pub sampling: reckon_engine::sampler::ModelSampling,
    /// The draft model of speculative decoding (`--spec draft`, `--spec-draft`).
    pub draft: Option<Model>,
    /// The scorer of sparse prefill (`--spec-prefill-scorer`).
    pub scorer: Option<Model>,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    /// The model file.
    pub model_path: std::path::PathBuf,
}

/// A model's tokenizer and chat template, without its weights (a client that renders and tokenizes
/// prompts as the server does).
pub fn load_tokenizer(name: &str) -> Result<(Tokenizer, ChatTemplate)> {
    let path = model_path(name)?;
    let file = GgufFile::open(&path).with_context(|| format!("loading {}", path.display()))?;
    let tokenizer = Tokenizer::from_gguf(&file).with_context(|| format!("tokenizer of {}", path.display()))?;
    let text = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).unwrap_or("").to_string();
    let template = ChatTemplate::from_gguf(&file, &text(tokenizer.bos_id()), &text(tokenizer.eos_id()))?;
    Ok((tokenizer, template))
}

/// Sets up the process (`ModelArgs::init_process`) and loads the model, its tokenizer and template.
pub fn load(args: &ModelArgs) -> Result<Loaded> {
    args.init_process()?;
    let path = model_path(&args.model)?;
    let mut files = vec![path.clone()];
    for name in args.draft_model_name()?.into_iter().chain(args.spec_prefill_scorer.as_deref()) {
        files.push(model_path(name)?);
    }
    check_fits(&files, mem_available())?;
    let file = GgufFile::open(&path).with_context(|| format!("loading {}", path.display()))?;
    let tokenizer = Tokenizer::from_gguf(&file).with_context(|| format!("tokenizer of {}", path.display()))?;
    let text = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).unwrap_or("").to_string();
    let template = ChatTemplate::from_gguf(&file, &text(tokenizer.bos_id()), &text(tokenizer.eos_id()))?;
    let sampling = SamplingParams::from_gguf(&file);
    for s in &sampling.skipped {
        eprintln!("note: {}: {s}", path.display());
    }
    let model = load_model_file(file, &path, args.load_options())?;
    let draft = match args.draft_model_name()? {
        Some(name) => Some(load_draft(name, &tokenizer, args)?),
        None => None,
    };
    let scorer = match &args.spec_prefill_scorer {
        Some(name) => Some(load_draft(name, &tokenizer, args)?),
        None => None,
    };
    Ok(Loaded { model, sampling, draft, scorer, tokenizer, template, model_path: path.canonicalize().unwrap_or(path) })
}

/// Refuses, before anything is read or allocated, model files whose weights together are more than this
/// machine can hold (`available` bytes, the kernel's MemAvailable): every weight is read each token, and
/// what does not fit ends in an OOM kill while loading or in a disk read per token. Unknown memory
/// (no /proc/meminfo) is not refused.
fn check_fits(files: &[PathBuf], available: Option<u64>) -> Result<()> {
    let Some(available) = available else { return Ok(()) };
    let mut need = 0u64;
    for f in files {
        need += std::fs::metadata(f).with_context(|| format!("{}", f.display()))?.len();
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let what = files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(" + ");
    anyhow::ensure!(need <= available, "{what}: {:.1} GiB of weights, and this machine has {:.1} GiB of memory available (MemAvailable): they do not fit. Use a smaller quantization or a machine with more memory.", gib(need), gib(available));
    Ok(())
}

/// The kernel's estimate of the memory available to a new process, in bytes (Linux' MemAvailable).
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = text.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?.trim().strip_suffix("kB")?.trim().parse().ok()?;
    Some(kib * 1024)
}

/// The draft model `name`, checked to share the model's vocabulary token for token.
pub fn load_draft(name: &str, tokenizer: &Tokenizer, args: &ModelArgs) -> Result<Model> {
    let path = model_path(name)?;
    let file = GgufFile::open(&path).with_context(|| format!("loading draft model {}", path.display()))?;
    let theirs = Tokenizer::from_gguf(&file).with_context(|| format!("tokenizer of {}", path.display()))?;
    let n = tokenizer.vocab_size();
    anyhow::ensure!(theirs.vocab_size() == n, "draft model {}: {} tokens, the model has {n}", path.display(), theirs.vocab_size());
    if let Some(i) = (0..n as u32).find(|&i| theirs.token_text(i) != tokenizer.token_text(i)) {
        anyhow::bail!("draft model {}: token {i} is {:?}, the model's is {:?}: not the same vocabulary", path.display(), theirs.token_text(i), tokenizer.token_text(i));
    }
    load_model_file(file, &path, args.load_options())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_model_larger_than_the_memory_is_refused_before_it_is_read() {
        let dir = std::env::temp_dir().join(format!("reckon-oversized-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("big.gguf");
        // a sparse file: 64 GiB by its size, nothing on disk
        std::fs::File::create(&path).unwrap().set_len(64 << 30).unwrap();
        let err = super::check_fits(&[path.clone()], Some(24 << 30)).unwrap_err().to_string();
        assert!(err.contains("64.0 GiB of weights") && err.contains("24.0 GiB of memory available"), "{err}");
        assert!(super::check_fits(&[path.clone()], Some(65 << 30)).is_ok());
        assert!(super::check_fits(&[path.clone()], None).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn kv_memory_takes_sizes_and_token_counts() {
        assert_eq!(super::kv_tokens("1MiB", 1024).unwrap(), 1024);
        assert_eq!(super::kv_tokens("2GiB", 1 << 20).unwrap(), 2048);
        assert_eq!(super::kv_tokens("5000", 7).unwrap(), 5000);
        assert!(super::kv_tokens("lots", 7).is_err());
    }
}
