//! Constrained decoding with llguidance (the engine llama.cpp and vLLM use): a request may carry a
//! compiled `Constraint`, and at each of its sampling steps the tokens the grammar cannot take next get
//! a logit of -inf before the sampler sees them; the sampled token then advances the grammar. When the
//! grammar is complete only end-of-generation is allowed, so the answer ends there.
//!
//! `GrammarCompiler` holds llguidance's view of the vocabulary (a token trie built from every token's
//! bytes, control tokens marked so no grammar text can match them); it is built once per model and
//! compiles each request's grammar (a JSON Schema or a Lark grammar with `%json` schemas in it).

use crate::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;

/// What a constrained answer must match.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// The answer is one JSON value valid under this schema.
    JsonSchema(serde_json::Value),
    /// llguidance's Lark dialect (`%json { schema }` embeds a schema).
    Lark(String),
}

/// How JSON is written under a constraint: Python's `json.dumps` spacing (what the models saw in
/// training and what Qwen's template writes calls with), no free whitespace (a small model given free
/// whitespace may emit newlines for ever), and schema keywords llguidance does not enforce accepted
/// rather than refused (agents' tool schemas carry `format`, `$schema` and the like).
pub fn json_options() -> serde_json::Value {
    serde_json::json!({ "whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": true })
}

/// `schema` with `json_options` as its `x-guidance` (kept if it has its own).
pub fn with_json_options(schema: &serde_json::Value) -> serde_json::Value {
    let mut s = schema.clone();
    if let Some(obj) = s.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(json_options);
    }
    s
}

/// The vocabulary as llguidance sees it.
struct Vocab {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => self.tokenizer.encode(text, false, false).unwrap_or_else(|_| self.trie.greedy_tokenize(s)),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// Compiles grammars for one model's vocabulary.
pub struct GrammarCompiler {
    factory: ParserFactory,
    /// Logits per step (the model's vocabulary, which may be larger than the tokenizer's).
    logits_len: usize,
}

impl GrammarCompiler {
    /// Builds the token trie for `tokenizer` (once per model: it walks the whole vocabulary).
    /// `logits_len`: the model's output size.
    pub fn new(tokenizer: Arc<Tokenizer>, logits_len: usize) -> Result<Self, String> {
        let n = tokenizer.vocab_size();
        let eos = tokenizer.eos_id().ok_or("the tokenizer has no end-of-sequence token; constrained decoding needs one")?;
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                if tokenizer.is_control(id) {
                    // llguidance's marker for special tokens: grammar text never matches them
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend(tokenizer.token_bytes(id, true));
                    w
                } else {
                    tokenizer.token_bytes(id, false)
                }
            })
            .collect();
        let info = TokRxInfo::new(n as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(Vocab { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(GrammarCompiler { factory, logits_len })
    }

    /// A fresh constraint for one request; an error says what is wrong with the grammar.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint, String> {
        let top = match grammar {
            Grammar::JsonSchema(schema) => TopLevelGrammar::from_json_schema(with_json_options(schema)),
            Grammar::Lark(source) => TopLevelGrammar::from_lark(source.clone()),
        };
        let parser = self.factory.create_parser(top).map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Constraint { matcher, logits_len: self.logits_len, advanced: 0, fail_after: None })
    }
}

/// One request's grammar state.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    logits_len: usize,
    /// Tokens advanced so far, and `failing_after`'s count.
    advanced: usize,
    fail_after: Option<usize>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

impl Constraint {
    /// Sets the logits of the tokens the grammar cannot take next to -inf (end-of-generation only, once
    /// the grammar is complete).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        debug_assert_eq!(logits.len(), self.logits_len);
        if self.fail_after.is_some_and(|n| self.advanced >= n) {
            return Err(format!("a failure injected after {} tokens (Constraint::failing_after)", self.advanced));
        }
        let allowed = self.matcher.compute_mask_or_eos().map_err(|e| e.to_string())?;
        // the tokens past the tokenizer's vocabulary (padding rows of the output matrix) are never allowed
        let n = allowed.len().min(logits.len());
        logits[n..].fill(f32::NEG_INFINITY);
        allowed.iter_unset_entries(|id| {
            if id < n {
                logits[id] = f32::NEG_INFINITY;
            }
        });
        Ok(())
    }

    /// Whether the grammar is complete (only end-of-generation may follow).
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Advances the grammar by the sampled token.
    pub fn advance(&mut self, token: u32) -> Result<(), String> {
        if self.matcher.is_stopped() {
            return Ok(()); // the end-of-generation token after a complete answer
        }
        self.advanced += 1;
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }

    /// This constraint, made to fail its mask once `tokens` tokens were advanced: the engine's handling
    /// of a grammar that fails mid-answer is tested with it (llguidance gives no grammar that does).
    pub fn failing_after(mut self, tokens: usize) -> Constraint {
        self.fail_after = Some(tokens);
        self
    }
}
