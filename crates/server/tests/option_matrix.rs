//! The option matrix: every architecture (the tiny llama, scripts/make-test-models' synthetic files, the
//! fetched Qwen2.5-Coder-0.5B and Gemma-3-270M) x combinations of every per-request option on every API,
//! in process. Each request gets either a 400 naming one of the options it carries that this model or
//! server cannot take, or a 200 whose greedy answer is what the options promise: the plain answer (a
//! prediction exact, partly right or wrong; logprobs; a seed at temperature 0; a cache salt; n = 1;
//! echo false; sparse prefill on a prompt below its threshold or off), cut where a stop string, a stop
//! token id or max_tokens 1 cuts it; or, under a grammar (a JSON schema, a required tool call), an
//! answer the grammar allows. Combinations are drawn by proptest from a fixed seed (the same cases on
//! every run; a failure shrinks to its smallest combination). Speculation (n-gram) is on wherever the
//! architecture can roll back, so the plain answers and the predictions go through verification.
//! A model that is not there is skipped with a note, unless RECKON_REQUIRE_MODELS=1.

#[path = "../../engine/tests/common/mod.rs"]
mod common;
mod support;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use reckon_engine::engine::{Completion, GenerateParams};
use reckon_engine::gguf::GgufFile;
use reckon_engine::model::ModelConfig;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use support::*;

const PROMPT: &str = "Write one sentence about caches.";
/// The answers' length: long enough for a stop string and a stop token to fall inside.
const MAX_TOKENS: usize = 8;
/// Cases drawn per model.
const CASES: u32 = 28;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Api {
    Chat,
    ChatStream,
    Completions,
    CompletionsStream,
    Responses,
    Messages,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Guess {
    None,
    Exact,
    Partly,
    Wrong,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Grammar {
    None,
    JsonSchema,
    Tools,
}

/// One request's options; which ones apply depends on the API (`body`).
#[derive(Clone, Debug)]
struct Options {
    api: Api,
    prediction: Guess,
    /// Chat's `logprobs` + `top_logprobs`, completions' `logprobs`.
    logprobs: Option<usize>,
    seed: Option<u64>,
    cache_salt: bool,
    n: Option<usize>,
    echo: Option<bool>,
    /// None: MAX_TOKENS; else 0 or 1.
    max_tokens: Option<usize>,
    /// reckon.spec_prefill: None, false, or {"keep": 0.5}.
    spec_prefill: Option<bool>,
    /// A stop string: the plain answer's text at this fraction of its length, two characters.
    stop_at: Option<f64>,
    /// A stop token id (completions): the plain answer's token at this index.
    stop_id_at: Option<usize>,
    grammar: Grammar,
}

fn options() -> impl Strategy<Value = Options> {
    let api = prop_oneof![Just(Api::Chat), Just(Api::ChatStream), Just(Api::Completions), Just(Api::CompletionsStream), Just(Api::Responses), Just(Api::Messages)];
    let guess = prop_oneof![3 => Just(Guess::None), 1 => Just(Guess::Exact), 1 => Just(Guess::Partly), 1 => Just(Guess::Wrong)];
    let grammar = prop_oneof![6 => Just(Grammar::None), 1 => Just(Grammar::JsonSchema), 1 => Just(Grammar::Tools)];
    (
        (api, guess, prop::option::weighted(0.3, 0..4usize), prop::option::weighted(0.3, 0..1000u64), prop::bool::weighted(0.3)),
        (prop::option::weighted(0.25, 1..3usize), prop::option::weighted(0.25, any::<bool>()), prop::option::weighted(0.2, 0..2usize), prop::option::weighted(0.25, any::<bool>())),
        (prop::option::weighted(0.3, 0.1..0.9f64), prop::option::weighted(0.3, 1..MAX_TOKENS), grammar),
    )
        .prop_map(|((api, prediction, logprobs, seed, cache_salt), (n, echo, max_tokens, spec_prefill), (stop_at, stop_id_at, grammar))| Options { api, prediction, logprobs, seed, cache_salt, n, echo, max_tokens, spec_prefill, stop_at, stop_id_at, grammar })
}

/// A model served in process, with what its answers must be compared to.
struct Served {
    name: String,
    addr: SocketAddr,
    recurrent: bool,
    /// The plain greedy answers' texts, per API and max_tokens.
    plain: std::sync::Mutex<HashMap<(Api, usize), String>>,
    /// The plain completion's token ids and their texts (for stop token ids).
    completion_ids: Vec<u32>,
    completion_pieces: Vec<String>,
}

fn serve_model(name: &str) -> Option<Served> {
    let file = match name {
        "tiny" => GgufFile::from_vec(tiny_gguf()).unwrap(),
        "qwen2.5-coder-0.5b" | "gemma3-270m" => common::open_real_model(name)?,
        _ => common::open_test_model(name)?,
    };
    let model_config = ModelConfig::from_gguf(&file).unwrap();
    let caps = model_config.capabilities;
    let mut config = config(2048, 8, 64);
    config.num_blocks = 1024;
    if caps.speculation {
        config.spec = Some(Default::default());
    }
    let state = state_with_detokenizer(file, name, config, |t| t);
    let tokenizer = state.tokenizer.clone();
    let engine = state.engine.clone();
    let addr = serve(state);
    // the completion's tokens, straight from the engine (greedy is greedy whatever the server's defaults)
    let prompt = tokenizer.encode(PROMPT, true, true).unwrap();
    let c = Completion::wait(engine.submit(GenerateParams { ignore_eos: true, ..GenerateParams::greedy(prompt, MAX_TOKENS) }).unwrap().1).unwrap();
    let completion_pieces = c.ids.iter().map(|&id| String::from_utf8_lossy(&tokenizer.token_bytes(id, false)).into_owned()).collect();
    Some(Served { name: name.to_string(), addr, recurrent: !caps.speculation, plain: Default::default(), completion_ids: c.ids, completion_pieces })
}

impl Served {
    /// The request for `o` (one API's fields), and the options it carries that must be refused here,
    /// by the name the API's error gives them.
    fn body(&self, o: &Options, plain: &str) -> (String, Value, Vec<&'static str>) {
        let mut refused = Vec::new();
        // (a tool call in the tiny model's byte tokens takes about 80)
        let max_tokens = o.max_tokens.unwrap_or(if o.grammar == Grammar::None { MAX_TOKENS } else { 120 });
        if max_tokens == 0 {
            refused.push(if o.api == Api::Responses { "max_output_tokens" } else { "max_tokens" });
        }
        let schema = json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"], "additionalProperties": false});
        let (path, mut body) = match o.api {
            Api::Chat | Api::ChatStream | Api::Completions | Api::CompletionsStream => {
                let chat = matches!(o.api, Api::Chat | Api::ChatStream);
                let mut b = if chat {
                    json!({"model": self.name, "messages": [{"role": "user", "content": PROMPT}]})
                } else {
                    json!({"model": self.name, "prompt": PROMPT})
                };
                b["max_tokens"] = json!(max_tokens);
                b["ignore_eos"] = json!(true);
                b["stream"] = json!(matches!(o.api, Api::ChatStream | Api::CompletionsStream));
                let guess = match o.prediction {
                    Guess::None => None,
                    Guess::Exact => Some(plain.to_string()),
                    Guess::Partly => Some(format!("{} and then something else entirely", plain.chars().take(plain.chars().count() / 2).collect::<String>())),
                    Guess::Wrong => Some("Zebras migrate across the savanna every spring.".to_string()),
                };
                if let Some(g) = guess {
                    b["prediction"] = json!({"type": "content", "content": g});
                    if self.recurrent {
                        refused.push("prediction");
                    }
                }
                if let Some(k) = o.logprobs {
                    if chat {
                        b["logprobs"] = json!(true);
                        b["top_logprobs"] = json!(k);
                    } else {
                        b["logprobs"] = json!(k);
                    }
                }
                if let Some(n) = o.n {
                    b["n"] = json!(n);
                    if n != 1 {
                        refused.push("n");
                    }
                }
                if let Some(e) = o.echo {
                    b["echo"] = json!(e);
                    if e {
                        refused.push("echo");
                    }
                }
                if let Some(s) = o.seed {
                    b["seed"] = json!(s);
                }
                if o.cache_salt {
                    b["cache_salt"] = json!("tenant-1");
                }
                if let Some(at) = o.stop_id_at.filter(|_| !chat) {
                    b["stop_token_ids"] = json!([self.completion_ids[at]]);
                }
                match (o.grammar, chat) {
                    (Grammar::JsonSchema, true) => b["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}),
                    (Grammar::JsonSchema, false) => b["structured_outputs"] = json!({"json": schema}),
                    (Grammar::Tools, true) => {
                        b["tools"] = json!([{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]);
                        b["tool_choice"] = json!("required");
                    }
                    _ => {}
                }
                (if chat { "/v1/chat/completions" } else { "/v1/completions" }, b)
            }
            Api::Responses => {
                let mut b = json!({"model": self.name, "input": PROMPT, "max_output_tokens": max_tokens});
                match o.grammar {
                    Grammar::JsonSchema => b["text"] = json!({"format": {"type": "json_schema", "name": "c", "schema": schema}}),
                    Grammar::Tools => {
                        b["tools"] = json!([{"type": "function", "name": "get_weather", "parameters": schema}]);
                        b["tool_choice"] = json!("required");
                    }
                    Grammar::None => {}
                }
                ("/v1/responses", b)
            }
            Api::Messages => {
                let mut b = json!({"model": self.name, "max_tokens": max_tokens, "messages": [{"role": "user", "content": PROMPT}]});
                match o.grammar {
                    Grammar::JsonSchema => b["output_config"] = json!({"format": {"type": "json_schema", "schema": schema}}),
                    Grammar::Tools => {
                        b["tools"] = json!([{"name": "get_weather", "input_schema": schema}]);
                        b["tool_choice"] = json!({"type": "any"});
                    }
                    Grammar::None => {}
                }
                ("/v1/messages", b)
            }
        };
        body["temperature"] = json!(0);
        if let Some(on) = o.spec_prefill {
            body["reckon"] = if on { json!({"spec_prefill": {"keep": 0.5}}) } else { json!({"spec_prefill": false}) };
            if on && self.recurrent {
                refused.push("reckon.spec_prefill");
            }
        }
        if let Some(at) = o.stop_at {
            let chars: Vec<char> = plain.chars().collect();
            let i = ((chars.len() as f64 * at) as usize).min(chars.len().saturating_sub(2));
            let stop: String = chars[i..(i + 2).min(chars.len())].iter().collect();
            if !stop.trim().is_empty() && o.api != Api::Responses {
                body[if o.api == Api::Messages { "stop_sequences" } else { "stop" }] = json!([stop]);
            }
        }
        (path.to_string(), body, refused)
    }

    /// The answer's text (and whether a tool was called) in `api`'s shape.
    fn text(&self, api: Api, a: &Answer) -> (String, bool) {
        match api {
            Api::ChatStream | Api::CompletionsStream => {
                let (chunks, done) = sse_chunks(a);
                assert!(done, "{}", a.body);
                let called = chunks.iter().any(|c| !c["choices"][0]["delta"]["tool_calls"].is_null());
                (streamed_text(&chunks), called)
            }
            Api::Chat => {
                let m = &a.json()["choices"][0]["message"];
                (m["content"].as_str().unwrap_or("").to_string(), m["tool_calls"].as_array().is_some_and(|c| !c.is_empty()))
            }
            Api::Completions => (a.json()["choices"][0]["text"].as_str().unwrap().to_string(), false),
            Api::Responses => {
                let out = a.json()["output"].as_array().unwrap().clone();
                let text = out.iter().filter(|i| i["type"] == "message").flat_map(|i| i["content"].as_array().unwrap().clone()).filter_map(|p| p["text"].as_str().map(str::to_string)).collect();
                (text, out.iter().any(|i| i["type"] == "function_call"))
            }
            Api::Messages => {
                let content = a.json()["content"].as_array().unwrap().clone();
                (content.iter().filter_map(|b| b["text"].as_str()).collect(), content.iter().any(|b| b["type"] == "tool_use"))
            }
        }
    }

    /// The plain greedy answer of `api` at `max_tokens` (asked once).
    fn plain(&self, api: Api, max_tokens: usize) -> String {
        if let Some(t) = self.plain.lock().unwrap().get(&(api, max_tokens)) {
            return t.clone();
        }
        let o = Options { api, prediction: Guess::None, logprobs: None, seed: None, cache_salt: false, n: None, echo: None, max_tokens: Some(max_tokens), spec_prefill: None, stop_at: None, stop_id_at: None, grammar: Grammar::None };
        let (path, body, _) = self.body(&o, "");
        let a = post(self.addr, &path, &body);
        assert_eq!(a.status, 200, "{}: plain {api:?}: {}", self.name, a.body);
        let text = self.text(api, &a).0;
        self.plain.lock().unwrap().insert((api, max_tokens), text.clone());
        text
    }

    fn check(&self, o: &Options) -> Result<(), TestCaseError> {
        let max_tokens = o.max_tokens.unwrap_or(if o.grammar == Grammar::None { MAX_TOKENS } else { 120 });
        let full = self.plain(o.api, MAX_TOKENS);
        let (path, body, refused) = self.body(o, &full);
        let a = post(self.addr, &path, &body);
        let what = format!("{} {path} {body}", self.name);
        if !refused.is_empty() {
            prop_assert_eq!(a.status, 400, "{}: {}", what, a.body);
            // Anthropic's errors carry no param: the message names the option
            let named = match o.api {
                Api::Messages => refused.iter().any(|r| a.json()["error"]["message"].as_str().unwrap_or("").starts_with(r)),
                _ => refused.iter().any(|r| a.json()["error"]["param"] == *r),
            };
            prop_assert!(named, "{}: refused {:?}, got {}", what, refused, a.body);
            return Ok(());
        }
        prop_assert_eq!(a.status, 200, "{}: {}", what, a.body);
        let (text, called) = self.text(o.api, &a);
        match o.grammar {
            Grammar::Tools if !matches!(o.api, Api::Completions | Api::CompletionsStream) && max_tokens > 1 => prop_assert!(called, "{}: no tool call: {}", what, a.body),
            Grammar::JsonSchema => {
                // (cut short by max_tokens or a stop, the value may be unfinished: a prefix of one)
                prop_assert!(text.is_empty() || text.starts_with('{'), "{}: {:?}", what, text);
            }
            _ => {
                let mut want = if max_tokens == MAX_TOKENS { full.clone() } else { self.plain(o.api, max_tokens) };
                if matches!(o.api, Api::Completions | Api::CompletionsStream) {
                    if let Some(at) = o.stop_id_at {
                        let id = self.completion_ids[at];
                        let first = self.completion_ids.iter().position(|&t| t == id).unwrap();
                        if first < max_tokens {
                            want = self.completion_pieces[..first].concat();
                        }
                    }
                }
                if let Some(stop) = body["stop"].get(0).or(body["stop_sequences"].get(0)).and_then(Value::as_str) {
                    if let Some(i) = want.find(stop) {
                        want.truncate(i);
                    }
                }
                prop_assert_eq!(text, want, "{}: {}", what, a.body);
            }
        }
        Ok(())
    }
}

fn matrix(name: &str) {
    let Some(served) = serve_model(name) else { return };
    let served = Arc::new(served);
    let config = Config { cases: CASES, failure_persistence: None, rng_algorithm: RngAlgorithm::ChaCha, ..Config::default() };
    let mut runner = TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]));
    if let Err(e) = runner.run(&options(), |o| served.check(&o)) {
        panic!("{name}: {e}");
    }
    // and each option at least once on every API, alone
    for api in [Api::Chat, Api::ChatStream, Api::Completions, Api::CompletionsStream, Api::Responses, Api::Messages] {
        let base = Options { api, prediction: Guess::None, logprobs: None, seed: None, cache_salt: false, n: None, echo: None, max_tokens: None, spec_prefill: None, stop_at: None, stop_id_at: None, grammar: Grammar::None };
        let each = [
            Options { prediction: Guess::Exact, ..base.clone() },
            Options { prediction: Guess::Partly, ..base.clone() },
            Options { prediction: Guess::Wrong, ..base.clone() },
            Options { logprobs: Some(2), ..base.clone() },
            Options { seed: Some(5), ..base.clone() },
            Options { cache_salt: true, ..base.clone() },
            Options { n: Some(2), ..base.clone() },
            Options { echo: Some(true), ..base.clone() },
            Options { max_tokens: Some(0), ..base.clone() },
            Options { max_tokens: Some(1), ..base.clone() },
            Options { spec_prefill: Some(true), ..base.clone() },
            Options { stop_at: Some(0.5), ..base.clone() },
            Options { stop_id_at: Some(4), ..base.clone() },
            Options { grammar: Grammar::JsonSchema, ..base.clone() },
            Options { grammar: Grammar::Tools, ..base.clone() },
        ];
        for o in each {
            if let Err(e) = served.check(&o) {
                panic!("{name}: {o:?}: {e}");
            }
        }
    }
    // the server is up after all of it
    assert_eq!(get(served.addr, "/health").status, 200);
}

#[test]
fn option_matrix_tiny_llama() {
    matrix("tiny");
}

#[test]
fn option_matrix_synthetic_architectures() {
    for name in ["llama3-tiny", "llama-tied-tiny", "qwen3-tiny", "qwen3moe-tiny", "phi3-tiny", "lfm2-tiny"] {
        matrix(name);
    }
}

#[test]
fn option_matrix_qwen2() {
    matrix("qwen2.5-coder-0.5b");
}

#[test]
fn option_matrix_gemma3() {
    matrix("gemma3-270m");
}
