//! The HTTP API over raw HTTP on a loopback port, on the tiny random model (a real byte-level BPE
//! tokenizer and ChatML template, random weights): chat and text completions streamed and not (the same
//! greedy text both ways), token-id prompts, multi-part content, log-probabilities, usage, the context
//! clamp, and the metrics a finished request leaves. Never skipped; the tests that need real text are in
//! http_real_model.rs.

#[path = "../../engine/tests/common/mod.rs"]
mod common;
mod support;

use reckon_engine::template::ChatMessage;
use serde_json::{json, Value};
use support::*;

const HAIKU: &str = "Write a haiku about caches.";

#[test]
fn health_models_and_metrics() {
    let addr = tiny_server(config(2048, 16, 64));
    let health = get(addr, "/health");
    assert_eq!((health.status, health.body.as_str()), (200, "ok"));
    let models = get(addr, "/v1/models");
    assert_eq!(models.status, 200);
    let m = models.json();
    assert_eq!(m["object"], "list");
    assert_eq!((m["data"][0]["id"].as_str(), m["data"][0]["object"].as_str()), (Some(TINY), Some("model")), "{m}");
    assert_eq!(m["data"][0]["max_model_len"], 2048);
    let blocks = config(2048, 16, 64).num_blocks;
    let metrics = Metrics::read(addr, TINY);
    for line in [
        format!("vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"f16\",model_name=\"tiny\",num_gpu_blocks=\"{blocks}\"}} 1"),
        format!("reckon_kv_blocks_free{{model_name=\"tiny\"}} {blocks}"),
        "reckon_request_success_total{model_name=\"tiny\"} 0".to_string(),
        "reckon_request_aborted_total{model_name=\"tiny\"} 0".to_string(),
        "reckon_time_to_first_token_seconds_count 0".to_string(),
    ] {
        assert!(metrics.text.lines().any(|l| l == line), "missing {line:?} in\n{}", metrics.text);
    }
    assert!(metrics.idle());
}

/// Non-streamed and streamed answers to the same greedy request: the same text, usage that counts the
/// templated prompt, OpenAI's envelopes, and the metrics of three finished requests.
#[test]
fn chat_completions_streamed_and_not() {
    let state = tiny_state(config(2048, 16, 64));
    let rendered = state.template.render(&[ChatMessage::new("user", HAIKU)], true).unwrap();
    assert_eq!(rendered, format!("<|im_start|>user\n{HAIKU}<|im_end|>\n<|im_start|>assistant\n"));
    let prompt = state.tokenizer.encode(&rendered, true, true).unwrap();
    assert_eq!(prompt[0], state.tokenizer.token_id("<|im_start|>").unwrap(), "the template's specials are tokens");
    let addr = serve(state);

    let a = post(addr, "/v1/chat/completions", &tiny_chat(HAIKU, 16, json!({})));
    assert_eq!(a.status, 200, "{}", a.body);
    let a = a.json();
    assert_eq!((a["object"].as_str(), a["model"].as_str()), (Some("chat.completion"), Some(TINY)));
    assert!(a["id"].as_str().unwrap().starts_with("chatcmpl-"), "{a}");
    let choice = &a["choices"][0];
    assert_eq!((choice["index"].as_u64(), choice["message"]["role"].as_str()), (Some(0), Some("assistant")));
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(choice["logprobs"], Value::Null);
    let text = choice["message"]["content"].as_str().unwrap().to_string();
    assert!(!text.is_empty());
    let usage = &a["usage"];
    assert_eq!((usage["prompt_tokens"].as_u64(), usage["completion_tokens"].as_u64()), (Some(prompt.len() as u64), Some(16)), "{usage}");
    assert_eq!(usage["total_tokens"].as_u64(), Some(prompt.len() as u64 + 16));
    let again = post(addr, "/v1/chat/completions", &tiny_chat(HAIKU, 16, json!({}))).json();
    assert_eq!(again["choices"][0]["message"]["content"], text.as_str(), "greedy is deterministic");

    // streamed: a role chunk, the same text chunk by chunk, the finish chunk, usage, [DONE]
    let s = post(addr, "/v1/chat/completions", &tiny_chat(HAIKU, 16, json!({"stream": true, "stream_options": {"include_usage": true}})));
    assert_eq!(s.status, 200);
    assert!(s.header("content-type").is_some_and(|t| t.starts_with("text/event-stream")), "{}", s.head);
    let (chunks, done) = sse_chunks(&s);
    assert!(done, "{}", s.body);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk" && c["id"] == id && c["model"] == TINY), "{chunks:?}");
    assert_eq!(streamed_text(&chunks), text);
    assert_eq!(streamed_finish(&chunks).as_deref(), Some("length"));
    let last = chunks.last().unwrap();
    assert_eq!((last["choices"].as_array().map(Vec::len), last["usage"]["completion_tokens"].as_u64()), (Some(0), Some(16)), "{last}");
    assert_eq!(last["usage"]["prompt_tokens"].as_u64(), Some(prompt.len() as u64));

    // without include_usage there is no usage chunk
    let s = post(addr, "/v1/chat/completions", &tiny_chat(HAIKU, 16, json!({"stream": true})));
    let (chunks, done) = sse_chunks(&s);
    assert!(done && chunks.iter().all(|c| c.get("usage").is_none()), "{}", s.body);
    assert_eq!(streamed_text(&chunks), text);

    let m = wait_for_metrics(addr, TINY, "an idle engine", Metrics::idle);
    assert_eq!(m.value("reckon_request_success_total"), 4.0, "{}", m.text);
    assert_eq!(m.value("reckon_request_aborted_total"), 0.0);
    assert_eq!(m.value("reckon_generation_tokens_total"), 64.0);
    assert!(m.text.contains("reckon_time_to_first_token_seconds_count 4\n"), "{}", m.text);
    assert!(m.text.contains("reckon_e2e_request_latency_seconds_count 4\n"), "{}", m.text);
}

/// Text completions: a text prompt streamed and not (the same text), and the same prompt as token ids.
#[test]
fn text_completions_take_text_or_token_ids() {
    let state = tiny_state(config(2048, 16, 64));
    let ids = state.tokenizer.encode("The capital of France is", true, true).unwrap();
    let addr = serve(state);
    let body = json!({ "model": TINY, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 8, "ignore_eos": true });
    let c = post(addr, "/v1/completions", &body);
    assert_eq!(c.status, 200, "{}", c.body);
    let c = c.json();
    assert_eq!((c["object"].as_str(), c["usage"]["completion_tokens"].as_u64()), (Some("text_completion"), Some(8)));
    assert_eq!(c["usage"]["prompt_tokens"].as_u64(), Some(ids.len() as u64));
    assert!(c["id"].as_str().unwrap().starts_with("cmpl-"), "{c}");
    assert_eq!(c["choices"][0]["finish_reason"], "length");
    let full = c["choices"][0]["text"].as_str().unwrap().to_string();

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let s = post(addr, "/v1/completions", &streamed);
    let (chunks, done) = sse_chunks(&s);
    assert!(done, "{}", s.body);
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"), "{chunks:?}");
    assert_eq!(streamed_text(&chunks), full);
    assert_eq!(streamed_finish(&chunks).as_deref(), Some("length"));

    // the same prompt as token ids: the same tokens, the same greedy text
    let mut by_ids = body.clone();
    by_ids["prompt"] = json!(ids);
    let t = post(addr, "/v1/completions", &by_ids);
    assert_eq!(t.status, 200, "{}", t.body);
    let t = t.json();
    assert_eq!(t["usage"]["prompt_tokens"].as_u64(), Some(ids.len() as u64));
    assert_eq!(t["choices"][0]["text"], full.as_str());
    // the vocabulary's last id is valid
    by_ids["prompt"] = json!([262, 3]);
    assert_eq!(post(addr, "/v1/completions", &by_ids).status, 200);
}

/// OpenAI's `prediction`: the client's guess of the answer is checked in bulk (speculative decoding). The
/// text is the same; usage says how many predicted tokens were kept and rejected; /metrics counts them;
/// a malformed prediction is a 400 naming the field. /metrics also reports KV bytes per layer type.
#[test]
fn a_prediction_is_checked_in_bulk_and_reported_in_usage() {
    let addr = tiny_server(config(2048, 16, 64));
    let body = json!({ "model": TINY, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 24, "ignore_eos": true });
    let plain = post(addr, "/v1/completions", &body).json();
    let text = plain["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(plain["usage"]["completion_tokens_details"]["accepted_prediction_tokens"], 0, "{plain}");
    let mut predicted = body.clone();
    predicted["prediction"] = json!({ "type": "content", "content": text });
    let c = post(addr, "/v1/completions", &predicted);
    assert_eq!(c.status, 200, "{}", c.body);
    let c = c.json();
    assert_eq!(c["choices"][0]["text"], text.as_str());
    let details = &c["usage"]["completion_tokens_details"];
    assert!(details["accepted_prediction_tokens"].as_u64().unwrap() > 0, "{c}");
    let metrics = Metrics::read(addr, TINY);
    let accepted = metrics.text.lines().find(|l| l.starts_with("vllm:spec_decode_num_accepted_tokens_total")).expect("the counter");
    assert_eq!(accepted.rsplit(' ').next().unwrap().parse::<u64>().unwrap(), details["accepted_prediction_tokens"].as_u64().unwrap());
    assert!(metrics.text.lines().any(|l| l.starts_with("reckon_kv_bytes_per_token{layer_type=\"full\",model_name=\"tiny\"}")), "{}", metrics.text);
    // the kept guesses by position sum to the kept guesses; the first position kept at least one
    let per_pos: Vec<u64> = metrics.text.lines().filter(|l| l.starts_with("vllm:spec_decode_num_accepted_tokens_per_pos{")).map(|l| l.rsplit(' ').next().unwrap().parse().unwrap()).collect();
    assert_eq!(per_pos.len(), 16, "{}", metrics.text);
    assert!(per_pos[0] > 0);
    assert_eq!(per_pos.iter().sum::<u64>(), details["accepted_prediction_tokens"].as_u64().unwrap());
    assert!(metrics.text.contains("reckon_spec_step_cost_seconds{model_name=\"tiny\",term=\"per_token\"}"), "{}", metrics.text);
    // content parts work as a string does; anything else is refused
    predicted["prediction"] = json!({ "type": "content", "content": [{ "type": "text", "text": text }] });
    assert_eq!(post(addr, "/v1/completions", &predicted).json()["choices"][0]["text"], text.as_str());
    for bad in [json!({ "type": "content" }), json!({ "type": "text", "content": "x" }), json!("just text")] {
        predicted["prediction"] = bad;
        let r = post(addr, "/v1/completions", &predicted);
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.json()["error"]["param"], "prediction", "{}", r.body);
    }
}

/// Content as a list of parts: the text parts are joined; images, audio and files are a 400 on every
/// API (these models read text only), not dropped.
#[test]
fn multi_part_content_is_joined_text() {
    let addr = tiny_server(config(2048, 16, 64));
    let answer = |content: Value| {
        let body = json!({ "model": TINY, "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 6, "ignore_eos": true });
        let a = post(addr, "/v1/chat/completions", &body);
        assert_eq!(a.status, 200, "{}", a.body);
        let a = a.json();
        (a["usage"]["prompt_tokens"].as_u64().unwrap(), a["choices"][0]["message"]["content"].as_str().unwrap().to_string())
    };
    let plain = answer(json!(HAIKU));
    let parts = answer(json!([{"type": "text", "text": "Write a haiku "}, {"type": "text", "text": "about caches."}]));
    assert_eq!(parts, plain);
    // an image (or audio, a file) is refused naming the field, never dropped: the answer would be about a
    // picture the model never saw
    for part in [json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}), json!({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}), json!({"type": "file", "file": {}})] {
        let body = json!({ "model": TINY, "messages": [{"role": "user", "content": [{"type": "text", "text": HAIKU}, part]}], "max_tokens": 2 });
        let a = post(addr, "/v1/chat/completions", &body);
        assert_eq!((a.status, a.json()["error"]["param"].as_str()), (400, Some("messages")), "{}", a.body);
        assert!(a.json()["error"]["message"].as_str().unwrap().contains("text only"), "{}", a.body);
    }
    let r = post(addr, "/v1/responses", &json!({"model": TINY, "input": [{"role": "user", "content": [{"type": "input_text", "text": HAIKU}, {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}], "max_output_tokens": 2}));
    assert_eq!((r.status, r.json()["error"]["param"].as_str()), (400, Some("input")), "{}", r.body);
    let m = post(addr, "/v1/messages", &json!({"model": TINY, "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text", "text": HAIKU}, {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}));
    assert_eq!((m.status, m.json()["error"]["type"].as_str()), (400, Some("invalid_request_error")), "{}", m.body);
    assert!(m.json()["error"]["message"].as_str().unwrap().contains("text only"), "{}", m.body);
    // a system message and an earlier assistant turn as parts too
    let body = json!({ "model": TINY, "temperature": 0, "max_tokens": 2, "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "user", "content": HAIKU}]});
    assert_eq!(post(addr, "/v1/chat/completions", &body).status, 200);
}

/// Log-probabilities on both APIs: greedy picks the top alternative, entries line up with the tokens.
#[test]
fn logprobs_on_both_apis() {
    let addr = tiny_server(config(2048, 16, 64));
    let l = post(addr, "/v1/chat/completions", &tiny_chat(HAIKU, 6, json!({"logprobs": true, "top_logprobs": 3})));
    assert_eq!(l.status, 200, "{}", l.body);
    let l = l.json();
    let entries = l["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(entries.len(), 6);
    for e in entries {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!((&e["token"], &e["logprob"], &e["bytes"]), (&top[0]["token"], &top[0]["logprob"], &top[0]["bytes"]), "greedy picks the top alternative: {e}");
        let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(lps.windows(2).all(|w| w[0] >= w[1]) && lps[0] <= 0.0, "{e}");
        assert!(!e["bytes"].as_array().unwrap().is_empty());
    }
    // the tokens' bytes spell the text (each token's own text may be part of a character)
    let bytes: Vec<u8> = entries.iter().flat_map(|e| e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8)).collect();
    assert_eq!(String::from_utf8_lossy(&bytes), l["choices"][0]["message"]["content"].as_str().unwrap());
    // logprobs without alternatives
    let l = post(addr, "/v1/chat/completions", &tiny_chat(HAIKU, 2, json!({"logprobs": true}))).json();
    assert!(l["choices"][0]["logprobs"]["content"].as_array().unwrap().iter().all(|e| e["top_logprobs"].as_array().unwrap().is_empty()), "{l}");

    // streamed: each text chunk carries its tokens' entries
    let s = post(addr, "/v1/chat/completions", &tiny_chat(HAIKU, 6, json!({"logprobs": true, "top_logprobs": 1, "stream": true})));
    let (chunks, done) = sse_chunks(&s);
    assert!(done);
    let n: usize = chunks.iter().filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array()).map(Vec::len).sum();
    assert_eq!(n, 6, "{}", s.body);

    // text completions' (legacy) log-probabilities: parallel lists, offsets into the text
    let body = json!({ "model": TINY, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 8, "ignore_eos": true, "logprobs": 2 });
    let c = post(addr, "/v1/completions", &body);
    assert_eq!(c.status, 200, "{}", c.body);
    let c = c.json();
    let lp = &c["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(tokens.len(), 8, "{lp}");
    assert_eq!((lp["token_logprobs"].as_array().unwrap().len(), lp["top_logprobs"].as_array().unwrap().len()), (8, 8));
    let mut offset = 0;
    for (i, token) in tokens.iter().enumerate() {
        assert_eq!(lp["text_offset"][i].as_u64(), Some(offset as u64), "{lp}");
        offset += token.chars().count();
        let chosen = lp["token_logprobs"][i].as_f64().unwrap();
        let top = lp["top_logprobs"][i].as_object().unwrap();
        // two byte tokens that are not UTF-8 on their own both read as U+FFFD, so a map may hold one key
        assert!((1..=2).contains(&top.len()), "{top:?}");
        assert!(top.values().all(|v| v.as_f64().unwrap() <= chosen), "greedy picks the top alternative: {top:?}");
        if !token.contains('\u{FFFD}') {
            assert_eq!(top.get(*token).and_then(Value::as_f64), Some(chosen), "{top:?}");
        }
    }
}

/// A `max_tokens` beyond what the context leaves is clamped to it (agents ask for 32,000 whatever the
/// model), not refused; so is no `max_tokens` at all.
#[test]
fn max_tokens_beyond_the_context_is_clamped() {
    let addr = tiny_server(config(64, 16, 64));
    for (path, body) in [
        ("/v1/chat/completions", tiny_chat("Hi", 100_000, json!({}))),
        ("/v1/chat/completions", tiny_chat("Hi", 100_000, json!({"max_tokens": null, "max_completion_tokens": 32_000}))),
        ("/v1/chat/completions", json!({ "model": TINY, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "ignore_eos": true })),
        ("/v1/completions", json!({ "model": TINY, "prompt": "Hi", "temperature": 0, "max_tokens": 100_000, "ignore_eos": true })),
    ] {
        let a = post(addr, path, &body);
        assert_eq!(a.status, 200, "{body}: {}", a.body);
        let a = a.json();
        assert_eq!(a["choices"][0]["finish_reason"], "length", "{a}");
        let (prompt, completion) = (a["usage"]["prompt_tokens"].as_u64().unwrap(), a["usage"]["completion_tokens"].as_u64().unwrap());
        assert_eq!(prompt + completion, 64, "{body}: {a}");
    }
}

/// reckon's extension object (`"reckon": {"spec_prefill": false | {"keep": x}}`, docs/spec-prefill.md):
/// accepted on chat, completions and responses, and anything malformed is a 400 naming the field.
#[test]
fn the_reckon_extension_is_validated() {
    let addr = tiny_server(config(2048, 16, 64));
    for ok in [json!({"spec_prefill": false}), json!({"spec_prefill": {"keep": 0.3}}), json!({}), Value::Null] {
        let r = post(addr, "/v1/chat/completions", &tiny_chat(HAIKU, 4, json!({"reckon": ok})));
        assert_eq!(r.status, 200, "{ok}: {}", r.body);
    }
    let r = post(addr, "/v1/responses", &json!({"model": TINY, "input": HAIKU, "max_output_tokens": 4, "reckon": {"spec_prefill": {"keep": 0.5}}}));
    assert_eq!(r.status, 200, "{}", r.body);
    for (bad, param) in [
        (json!({"spec_prefill": {"keep": 0}}), "reckon.spec_prefill"),
        (json!({"spec_prefill": {"keep": 1.5}}), "reckon.spec_prefill"),
        (json!({"spec_prefill": true}), "reckon.spec_prefill"),
        (json!({"spec_prefill": {"keep": 0.5, "x": 1}}), "reckon.spec_prefill"),
        (json!({"spec_prefil": false}), "reckon"),
        (json!("on"), "reckon"),
    ] {
        let r = post(addr, "/v1/completions", &json!({"model": TINY, "prompt": HAIKU, "max_tokens": 4, "reckon": bad}));
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{bad}: {}", r.body);
    }
}

/// What a request gets for the sampling fields it omits: the server's defaults (`reckon serve`'s flags,
/// else the model file's, else llama.cpp's), on every API. Before, an omitted field took OpenAI's
/// (temperature 1, no cuts), and SmolLM2 answered README's question with near gibberish.
#[test]
fn omitted_sampling_fields_take_the_servers_defaults_on_every_api() {
    use reckon_engine::sampler::SamplingParams;
    let mut state = tiny_state(config(2048, 16, 64));
    // a server whose default is greedy: requests without a temperature give greedy tokens, whatever their seed
    state.sampling = reckon_server::SamplingDefaults { params: SamplingParams::greedy(), seed: None };
    let addr = serve(state);
    let text = |path: &str, body: Value| {
        let a = post(addr, path, &body);
        assert_eq!(a.status, 200, "{path}: {}", a.body);
        let j = a.json();
        match path {
            "/v1/chat/completions" => j["choices"][0]["message"]["content"].as_str().unwrap().to_string(),
            "/v1/completions" => j["choices"][0]["text"].as_str().unwrap().to_string(),
            "/v1/messages" => j["content"][0]["text"].as_str().unwrap().to_string(),
            _ => j["output"][0]["content"][0]["text"].as_str().unwrap().to_string(),
        }
    };
    let bodies = [
        ("/v1/chat/completions", json!({"model": TINY, "messages": [{"role": "user", "content": HAIKU}], "max_tokens": 16, "ignore_eos": true})),
        ("/v1/completions", json!({"model": TINY, "prompt": HAIKU, "max_tokens": 16, "ignore_eos": true})),
        ("/v1/messages", json!({"model": TINY, "messages": [{"role": "user", "content": HAIKU}], "max_tokens": 16})),
        ("/v1/responses", json!({"model": TINY, "input": HAIKU, "max_output_tokens": 16})),
    ];
    for (path, body) in bodies {
        let mut greedy = body.clone();
        greedy["temperature"] = json!(0);
        let want = text(path, greedy);
        for seed in [1, 2, 3] {
            let mut b = body.clone();
            // the Messages and Responses APIs have no seed: their draws differ by the clock
            b["seed"] = json!(seed);
            if path == "/v1/messages" || path == "/v1/responses" {
                b.as_object_mut().unwrap().remove("seed");
            }
            assert_eq!(text(path, b), want, "{path}, seed {seed}: an omitted temperature is the server's 0");
        }
        // a field the request gives wins over the default
        let hot: Vec<String> = (0..4).map(|seed| {
            let mut b = body.clone();
            b["temperature"] = json!(1.0);
            if path != "/v1/messages" && path != "/v1/responses" {
                b["seed"] = json!(seed);
            }
            text(path, b)
        }).collect();
        assert!(hot.iter().any(|t| *t != want), "{path}: temperature 1 on random weights draws other tokens: {hot:?}");
    }
    let m = get(addr, "/v1/models").json();
    assert_eq!((m["data"][0]["sampling_defaults"]["temperature"].as_f64(), m["data"][0]["sampling_defaults"]["top_k"].as_u64()), (Some(0.0), Some(40)), "{m}");
}

/// vLLM's and llama-server's sampling extensions on chat and completions: those reckon has are used,
/// those it has not are a 400 naming the field unless their value changes nothing; never ignored.
#[test]
fn sampling_extensions_are_used_or_refused() {
    let addr = tiny_server(config(2048, 16, 64));
    let chat = |extra: Value| post(addr, "/v1/chat/completions", &tiny_chat(HAIKU, 12, extra));
    let content = |a: Answer| {
        assert_eq!(a.status, 200, "{}", a.body);
        a.json()["choices"][0]["message"]["content"].as_str().unwrap().to_string()
    };
    let greedy = content(chat(json!({})));
    // top_k 1 at temperature 1 keeps only the most likely token: the greedy tokens, whatever the seed
    for seed in 0..3 {
        assert_eq!(content(chat(json!({"temperature": 1.0, "top_k": 1, "seed": seed}))), greedy, "top_k is used");
    }
    // min_p 1 keeps only tokens as likely as the most likely one: greedy again
    assert_eq!(content(chat(json!({"temperature": 1.0, "min_p": 1.0, "seed": 5}))), greedy, "min_p is used");
    // a strong repetition penalty over the whole history changes greedy text that repeats tokens
    let penalized = content(chat(json!({"repetition_penalty": 100.0, "repeat_last_n": -1})));
    assert_ne!(penalized, greedy, "repetition_penalty is used");
    assert_eq!(content(chat(json!({"repeat_penalty": 100.0, "repeat_last_n": -1}))), penalized, "llama-server's name is the same field");
    assert_eq!(content(chat(json!({"repeat_penalty": 100.0, "repeat_last_n": 0}))), greedy, "repeat_last_n 0 turns penalties off");
    // values the engine refuses, in OpenAI's shape
    let a = chat(json!({"repetition_penalty": 0.0}));
    assert_eq!((a.status, a.json()["error"]["param"].as_str()), (400, Some("repetition_penalty")), "{}", a.body);
    let a = chat(json!({"min_p": 2.0}));
    assert_eq!((a.status, a.json()["error"]["param"].as_str()), (400, Some("min_p")), "{}", a.body);
    // samplers reckon does not have: refused unless neutral
    for (field, bad, neutral) in [
        ("typical_p", json!(0.5), json!(1.0)),
        ("mirostat", json!(2), json!(0)),
        ("logit_bias", json!({"5": 10}), json!({})),
        ("dry_multiplier", json!(0.8), json!(0.0)),
        ("echo", json!(true), json!(false)),
        ("suffix", json!("return x"), json!("")),
        ("min_tokens", json!(4), json!(0)),
    ] {
        let a = chat(json!({ field: bad }));
        assert_eq!(a.status, 400, "{field}: {}", a.body);
        let e = &a.json()["error"];
        assert_eq!(e["param"].as_str(), Some(field), "{e}");
        assert!(e["message"].as_str().unwrap().contains("not supported"), "{e}");
        assert_eq!(content(chat(json!({ field: neutral }))), greedy, "{field} = {neutral} changes nothing");
        let c = post(addr, "/v1/completions", &json!({"model": TINY, "prompt": HAIKU, "max_tokens": 4, field: bad}));
        assert_eq!(c.status, 400, "completions, {field}: {}", c.body);
    }
    // vLLM's stop_token_ids end the answer at such a token: with every id listed, at the first one
    let every: Vec<u32> = (0..263).collect();
    let a = post(addr, "/v1/completions", &json!({"model": TINY, "prompt": HAIKU, "max_tokens": 12, "temperature": 0, "ignore_eos": true, "stop_token_ids": every})).json();
    assert_eq!((a["choices"][0]["finish_reason"].as_str(), a["usage"]["completion_tokens"].as_u64()), (Some("stop"), Some(1)), "{a}");
}

/// The inter-token histogram counts every request's tokens, whichever API and answer mode carried them
/// (it once counted streamed chat and text completions only).
#[test]
fn every_api_feeds_the_inter_token_histogram() {
    let addr = tiny_server(config(2048, 16, 64));
    let requests = [
        ("/v1/chat/completions", json!({"model": TINY, "messages": [{"role": "user", "content": HAIKU}], "max_tokens": 6, "temperature": 0, "ignore_eos": true})),
        ("/v1/completions", json!({"model": TINY, "prompt": HAIKU, "max_tokens": 5, "temperature": 0, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}})),
        ("/v1/messages", json!({"model": TINY, "messages": [{"role": "user", "content": HAIKU}], "max_tokens": 7, "temperature": 0})),
        ("/v1/messages", json!({"model": TINY, "messages": [{"role": "user", "content": HAIKU}], "max_tokens": 4, "temperature": 0, "stream": true})),
        ("/v1/responses", json!({"model": TINY, "input": HAIKU, "max_output_tokens": 8, "temperature": 0})),
        ("/v1/responses", json!({"model": TINY, "input": HAIKU, "max_output_tokens": 3, "temperature": 0, "stream": true})),
    ];
    let mut gaps = 0;
    for (path, body) in requests {
        let a = post(addr, path, &body);
        assert_eq!(a.status, 200, "{path}: {}", a.body);
        let m = wait_for_metrics(addr, TINY, "an idle engine", Metrics::idle);
        let generated = m.value("reckon_generation_tokens_total") as u64;
        gaps += 1;
        let count = m.text.lines().find_map(|l| l.strip_prefix("reckon_inter_token_latency_seconds_count ")).unwrap().parse::<u64>().unwrap();
        // every token after each request's first is one gap
        assert_eq!(count, generated - gaps, "{path}, {}: {}", if body.get("stream").is_some() { "streamed" } else { "whole" }, m.text);
    }
}

/// A served model name is a label value like any other: quotes, backslashes and newlines in it are
/// escaped as Prometheus' text format says (they broke the hand-written exposition), and the answer
/// names that format's content type.
#[test]
fn metrics_escape_the_model_name() {
    let mut state = tiny_state(config(2048, 16, 64));
    state.model_id = "odd\"name\\x\ny".into();
    let addr = serve(state);
    let a = get(addr, "/metrics");
    assert_eq!(a.status, 200);
    assert_eq!(a.header("content-type"), Some("text/plain; version=0.0.4"), "{}", a.head);
    let escaped = r#"model_name="odd\"name\\x\ny""#;
    assert!(a.body.lines().any(|l| l == format!("vllm:num_requests_running{{{escaped}}} 0")), "{}", a.body);
    // every sample line is `name{labels} value` with its label values closed where they should be
    for line in a.body.lines().filter(|l| !l.starts_with('#')) {
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line:?}"));
        assert!(value.parse::<f64>().is_ok() || value == "+Inf", "{line:?}");
        assert!(!series.contains('{') || series.ends_with('}'), "{line:?}");
    }
}

/// What routers in front of workers read: SGLang's router takes the model name from /model_info and
/// /server_info (and their old /get_* names), the load from /get_load; the cache reset answers as vLLM's
/// and SGLang's do; the Gateway API Inference Extension's endpoint picker reads the LoRA gauge's labels.
#[test]
fn router_facing_endpoints_and_the_lora_gauge() {
    let addr = tiny_server(config(2048, 16, 64));
    for path in ["/model_info", "/get_model_info"] {
        let m = get(addr, path).json();
        assert_eq!((m["served_model_name"].as_str(), m["is_generation"].as_bool(), m["max_context_length"].as_u64()), (Some(TINY), Some(true), Some(2048)), "{path}: {m}");
    }
    for path in ["/server_info", "/get_server_info"] {
        let s = get(addr, path).json();
        assert_eq!((s["served_model_name"].as_str(), s["page_size"].as_u64(), s["dp_size"].as_u64()), (Some(TINY), Some(16), Some(1)), "{path}: {s}");
        assert_eq!(s["max_total_num_tokens"].as_u64(), Some(config(2048, 16, 64).num_blocks as u64 * 16));
    }
    let load = get(addr, "/get_load").json();
    assert_eq!(load, json!([{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]));
    // a prompt fills the cache; with nothing running, a reset empties it
    assert_eq!(post(addr, "/v1/chat/completions", &tiny_chat(HAIKU, 4, json!({}))).status, 200);
    wait_for_metrics(addr, TINY, "the prompt's blocks in the cache", |m| m.value("reckon_prefix_cache_blocks") >= 2.0);
    for path in ["/flush_cache", "/reset_prefix_cache"] {
        let r = post(addr, path, &json!({}));
        assert_eq!(r.status, 200, "{path}: {}", r.body);
    }
    let metrics = Metrics::read(addr, TINY);
    assert!(metrics.text.lines().any(|l| l.starts_with("vllm:lora_requests_info{max_lora=\"0\",model_name=\"tiny\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"}")), "{}", metrics.text);
    // (the stats are published after the engine's step, which can answer the client first: poke the
    // engine, then wait for them)
    assert_eq!(post(addr, "/v1/completions", &json!({"model": TINY, "prompt": [1, 2, 3], "max_tokens": 1})).status, 200);
    wait_for_metrics(addr, TINY, "the reset to drop the cached blocks", |m| m.value("reckon_prefix_cache_blocks") < 2.0);
}
