//! What a model's architecture cannot run is a 400 naming the option, and the server stays up (issue:
//! "no request can kill the server"). LFM2's recurrent state is not rolled back over rejected guesses:
//! a partly right `prediction` used to panic its engine thread, and a per-request sparse prefill
//! reached a scoring pass with no state slot.

#[path = "../../engine/tests/common/mod.rs"]
mod common;
mod support;

use serde_json::json;
use support::*;

#[test]
fn lfm2_refuses_prediction_and_sparse_prefill_per_request_and_stays_up() {
    let Some(state) = test_model_state("lfm2-tiny", config(4096, 8, 16)) else { return };
    let addr = serve(state);
    let prompt = "The cache keeps the blocks of earlier prompts, and the cache keeps";
    let plain = post(addr, "/v1/completions", &json!({"model": "lfm2-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}));
    assert_eq!(plain.status, 200, "{}", plain.body);
    let text = plain.json()["choices"][0]["text"].as_str().unwrap().to_string();
    // exact, partly right and wrong predictions: each a 400 naming `prediction`
    let partly = format!("{}{}", &text[..text.len() / 2], " something else entirely");
    for guess in [text.as_str(), partly.as_str(), "no relation at all"] {
        let body = json!({"model": "lfm2-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "prediction": {"type": "content", "content": guess}});
        let a = post(addr, "/v1/completions", &body);
        assert_eq!(a.status, 400, "{}", a.body);
        assert_eq!(a.json()["error"]["param"], "prediction", "{}", a.body);
        assert!(a.json()["error"]["message"].as_str().unwrap().contains("lfm2 has recurrent"), "{}", a.body);
    }
    let chat = post(addr, "/v1/chat/completions", &json!({"model": "lfm2-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "prediction": {"type": "content", "content": "Hello"}}));
    assert_eq!(chat.status, 400, "{}", chat.body);
    assert_eq!(chat.json()["error"]["param"], "prediction", "{}", chat.body);
    // a per-request sparse prefill: 400 naming it; turning it off is fine
    let long = "word ".repeat(600);
    let sparse = post(addr, "/v1/completions", &json!({"model": "lfm2-tiny", "prompt": long, "max_tokens": 2, "reckon": {"spec_prefill": {"keep": 0.3}}}));
    assert_eq!(sparse.status, 400, "{}", sparse.body);
    assert_eq!(sparse.json()["error"]["param"], "reckon.spec_prefill", "{}", sparse.body);
    let off = post(addr, "/v1/completions", &json!({"model": "lfm2-tiny", "prompt": long, "max_tokens": 2, "reckon": {"spec_prefill": false}}));
    assert_eq!(off.status, 200, "{}", off.body);
    // the server is up and gives the same greedy answer
    assert_eq!(get(addr, "/health").status, 200);
    let again = post(addr, "/v1/completions", &json!({"model": "lfm2-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}));
    assert_eq!(again.json()["choices"][0]["text"], text.as_str(), "{}", again.body);
}
