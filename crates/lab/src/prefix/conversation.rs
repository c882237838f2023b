//! The agent session replayed by `reckon lab prefix`: a system prompt with tool definitions, then user
//! turns of seeded pseudo-random coding-agent prose. Sizes are in the model's own tokens.

use reckon_engine::sampler::Rng;
use reckon_engine::tokenizer::Tokenizer;
use reckon_engine::Result;

const WORDS: &[&str] = &[
    "the", "function", "returns", "a", "list", "of", "files", "under", "src", "when", "cache", "is", "empty", "fix", "bug", "in",
    "parser", "so", "that", "it", "handles", "nested", "blocks", "test", "fails", "with", "index", "out", "range", "please", "rename",
    "variable", "config", "loader", "should", "read", "environment", "before", "defaults", "add", "logging", "request", "handler",
    "timeout", "retry", "three", "times", "then", "give", "up", "error", "message", "must", "name", "path", "and", "line", "number",
    "refactor", "module", "into", "smaller", "functions", "keep", "public", "api", "stable", "benchmark", "shows", "regression",
    "after", "last", "commit", "check", "allocation", "loop", "hot", "profile", "says", "most", "time", "spent", "hashing", "keys",
    "write", "unit", "for", "edge", "case", "where", "input", "has", "trailing", "whitespace", "update", "readme", "example",
];

const TOOLS: &[&str] = &[
    "read_file", "write_file", "list_directory", "search_code", "run_tests", "run_command", "apply_patch", "git_diff", "git_log",
    "open_url", "find_symbol", "format_code", "lint", "build_project", "install_package", "ask_user",
];

/// Seeded words until `text` reaches `n_tokens` of this tokenizer (checked every few words).
fn grow_to(tok: &Tokenizer, rng: &mut Rng, mut text: String, n_tokens: usize) -> Result<String> {
    while tok.encode(&text, false, false)?.len() < n_tokens {
        for _ in 0..8 {
            text.push(' ');
            text.push_str(WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]);
        }
        text.push('.');
    }
    Ok(text)
}

fn words(rng: &mut Rng, n: usize) -> String {
    (0..n).map(|_| WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]).collect::<Vec<_>>().join(" ")
}

/// A coding agent's system prompt with JSON tool schemas, about `n_tokens` long. With `timestamp`, it
/// starts with the given turn's wall-clock time (the classic prefix-cache breaker).
pub fn system_prompt(tok: &Tokenizer, n_tokens: usize, timestamp: Option<usize>) -> Result<String> {
    let mut rng = Rng::new(7);
    let mut text = String::new();
    if let Some(turn) = timestamp {
        text.push_str(&format!("Current time: 2026-12-01T09:{:02}:{:02}Z.\n", 10 + turn / 60, turn % 60));
    }
    text.push_str("You are a coding agent working in the user's repository. Call tools to read and change code.\n# Tools\n");
    let mut i = 0;
    while tok.encode(&text, false, false)?.len() < n_tokens {
        let name = TOOLS[i % TOOLS.len()];
        text.push_str(&format!(
            "{{\"name\": \"{name}_{i}\", \"description\": \"{}\", \"parameters\": {{\"type\": \"object\", \"properties\": {{\"path\": {{\"type\": \"string\", \"description\": \"{}\"}}, \"limit\": {{\"type\": \"integer\"}}}}, \"required\": [\"path\"]}}}}\n",
            words(&mut rng, 14),
            words(&mut rng, 8)
        ));
        i += 1;
    }
    Ok(text)
}

/// User message `turn` of session `session`: between `min` and `max` tokens.
pub fn user_turn(tok: &Tokenizer, session: usize, turn: usize, min: usize, max: usize) -> Result<String> {
    let mut rng = Rng::new(1000 + 97 * session as u64 + turn as u64);
    let n = min + (rng.next_u64() % (max - min + 1) as u64) as usize;
    grow_to(tok, &mut rng, format!("Task {}: ", turn + 1), n)
}
