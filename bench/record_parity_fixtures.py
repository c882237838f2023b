#!/usr/bin/env python3
"""Record llama.cpp's behaviour on the three real models, and on the synthetic files of the other
architectures (scripts/make-test-models), as parity fixtures for reckon's tests.

For each model and prompt: llama.cpp's tokenization and its greedy continuation (64 tokens, raw: it goes
on past end-of-generation tokens), with the top-1/top-2 logit gap at each step; plus teacher-forced top-1
next-token predictions over a ~2,000-token text. Written to tests/fixtures/parity/<model>.json.

Run with a python that has llama-cpp-python built for this CPU (see bench/setup-llamacpp):
    /opt/llamacpp-venv/bin/python bench/record_parity_fixtures.py [MODEL ...]
"""
import json, os, sys
import numpy as np
import jinja2
import llama_cpp

import llamacpp_norepack  # noqa: F401  (per-row kernels, see that module)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS_DIR = os.environ.get("RECKON_HOME") or os.path.expanduser("~/.cache/reckon/models")
MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3-270m": "gemma-3-270m-q4_k_m.gguf",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
}
# Synthetic random-weight files of the other architectures (scripts/make-test-models writes them): five
# plain prompts and a shorter teacher-forced text, so their fixtures stay small.
TEST_MODELS_DIR = os.environ.get("RECKON_TEST_MODELS") or os.path.expanduser("~/.cache/reckon/test-models")
SYNTHETIC = ["llama3-tiny", "llama-tied-tiny", "qwen3-tiny", "qwen3moe-tiny", "phi3-tiny", "lfm2-tiny"]
SYNTHETIC_PROMPTS = 5
SYNTHETIC_TEACHER_TOKENS = 512
N_GREEDY = 64
LONG_PROMPT_TOKENS = 1500
TEACHER_TOKENS = 2000

PLAIN_PROMPTS = [
    ("plain", "The capital of France is"),
    ("story", "Once upon a time, in a small village by the sea,"),
    ("code_python", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    ("code_rust", "fn main() {\n    let v: Vec<i32> = (1..=10).collect();\n"),
    ("unicode", "Café, naïve, résumé — “quotes” and ‘apostrophes’. Ünïcödé: "),
    ("emoji", "I love 🍕 and 🎉! Family: 👨‍👩‍👧‍👦, flags: 🇫🇷🇯🇵. Next:"),
    ("cjk", "日本語のテキスト：東京は日本の首都です。中文：北京是中国的首都。"),
    ("numbers", "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13"),
    ("whitespace", "  Leading spaces\n\n\nand multiple newlines\r\n\tTabbed line"),
    ("json", '{"name": "reckon", "version": 1, "features": ['),
]
CHATS = [
    ("chat_haiku", [{"role": "user", "content": "Write a haiku about caches."}]),
    ("chat_system", [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "What is 17 * 23? Answer briefly."}]),
]
# The synthetic files' templates (Llama 3.2's, Qwen3's, Phi-3.5's) with tools, a tool round trip and, where
# the template reads it, enable_thinking=false; rendered as Hugging Face transformers renders them
# (`hf_render`). Names and arguments match crates/engine/tests/parity_real.rs's `chat_case`.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_CHATS = [
    ("chat_tools", [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "What is the weather in Paris?"}], [WEATHER], {}),
    ("chat_tool_result", [{"role": "user", "content": "What is the weather in Paris?"},
                          {"role": "assistant", "content": "", "tool_calls": [
                              {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                          {"role": "tool", "content": "{\"temp_c\": 21}", "tool_call_id": "call_1", "name": "get_weather"}],
     [WEATHER], {}),
    ("chat_no_think", [{"role": "user", "content": "What is 17 * 23?"}], [], {"enable_thinking": False}),
]

# Gemma-3-270M's GGUF has no chat template. Its prompts are rendered by llama.cpp's own built-in "gemma"
# template (llama_chat_apply_template), an independent renderer of Gemma's turn format, so the fixture
# checks reckon's fallback template rather than copying it.
GEMMA_BUILTIN = "gemma"


def llama_cpp_builtin_chat(name, messages):
    import ctypes
    arr = (llama_cpp.llama_chat_message * len(messages))()
    keep = []
    for i, m in enumerate(messages):
        role, content = m["role"].encode(), m["content"].encode()
        keep += [role, content]
        arr[i].role, arr[i].content = role, content
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(name.encode(), arr, len(messages), True, buf, len(buf))
    assert 0 < n <= len(buf), n
    return buf.raw[:n].decode()


def sha256_of(path):
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cpu_description():
    """The CPU model and the ISA extensions ggml's x86 kernels choose between: llama.cpp's arithmetic
    depends on them, so a fixture names the ones it was recorded with."""
    model, flags = "unknown", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    isa = [x for x in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx512_vnni", "avx512_bf16") if x in flags]
    return {"cpu": model, "isa": isa}


def license_text(name):
    with open(f"/usr/share/common-licenses/{name}", encoding="utf-8") as f:
        return f.read()


def cut_to_tokens(llm, text, n):
    """The longest prefix of `text` (at a line end) that tokenizes to at most n tokens."""
    lines = text.splitlines(keepends=True)
    out = ""
    for line in lines:
        if len(llm.tokenize((out + line).encode(), add_bos=False)) > n:
            break
        out += line
    return out


def chat_text(llm, meta, messages):
    tmpl = meta.get("tokenizer.chat_template")
    if tmpl is None:
        return llama_cpp_builtin_chat(GEMMA_BUILTIN, messages)
    env = jinja2.Environment(trim_blocks=False, lstrip_blocks=False)
    bos = llm.detokenize([llm.token_bos()], special=True).decode() if llm.token_bos() >= 0 else ""
    eos = llm.detokenize([llm.token_eos()], special=True).decode() if llm.token_eos() >= 0 else ""
    return env.from_string(tmpl).render(messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)


def hf_render(tmpl, messages, tools, kwargs, bos, eos):
    """A template rendered as transformers' apply_chat_template does (its sandboxed environment with
    trim_blocks, lstrip_blocks and loopcontrols; tojson as json.dumps without key sorting). No
    strftime_now: Llama 3.2's template then dates itself "26 Jul 2024", and the test puts that date in
    place of today's in reckon's render."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    import jinja2.ext

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(tmpl).render(messages=messages, tools=tools or None, add_generation_prompt=True,
                                        bos_token=bos, eos_token=eos, **kwargs)


def top2_gap(logits):
    top = np.argpartition(-logits, 2)[:2]
    a, b = sorted(logits[top], reverse=True)
    return float(a - b)


def greedy(llm, tokens):
    llm.reset()
    llm.eval(tokens)
    out, gaps = [], []
    for _ in range(N_GREEDY):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        t = int(np.argmax(logits))
        out.append(t)
        gaps.append(round(top2_gap(logits), 4))
        llm.eval([t])
    return out, gaps


def teacher_forced(llm, tokens):
    llm.reset()
    llm.eval(tokens)
    scores = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    return [int(x) for x in scores.argmax(axis=1)], [round(top2_gap(s), 4) for s in scores]


def record(name):
    synthetic = name in SYNTHETIC
    file = f"{name}.gguf" if synthetic else MODELS[name]
    path = os.path.join(TEST_MODELS_DIR if synthetic else MODELS_DIR, file)
    # n_batch = 1: every token goes through llama.cpp's decode path (per-row vec_dot kernels). Larger batches
    # switch Q8_0/Q5_0/Q4_0 matmuls to llamafile's tinyBLAS, whose different summation order flips ~2% of
    # teacher-forced top-1 predictions against llama.cpp's own one-token path (measured on SmolLM2).
    llm = llama_cpp.Llama(model_path=path, n_ctx=4096, n_batch=1, n_ubatch=1, n_threads=2, logits_all=True,
                          verbose=False)
    meta = llm.metadata
    if synthetic:
        prompts = [(n, t, False) for n, t in PLAIN_PROMPTS[:SYNTHETIC_PROMPTS]]
        tmpl = meta.get("tokenizer.chat_template")
        if tmpl is not None:
            bos = llm.detokenize([llm.token_bos()], special=True).decode() if llm.token_bos() >= 0 else ""
            eos = llm.detokenize([llm.token_eos()], special=True).decode() if llm.token_eos() >= 0 else ""
            for n, msgs in CHATS:
                prompts.append((n, hf_render(tmpl, msgs, [], {}, bos, eos), True))
            for n, msgs, tools, kwargs in TOOL_CHATS:
                if kwargs and not all(k in tmpl for k in kwargs):
                    continue
                prompts.append((n, hf_render(tmpl, msgs, tools, kwargs, bos, eos), True))
    else:
        prompts = [(n, t, False) for n, t in PLAIN_PROMPTS]
        prompts += [(n, chat_text(llm, meta, msgs), True) for n, msgs in CHATS]
        prompts.append(("long_1500", cut_to_tokens(llm, license_text("Apache-2.0"), LONG_PROMPT_TOKENS), False))
    cases = []
    for pname, text, chat in prompts:
        # BOS as the GGUF says (add_bos), special tokens parsed, as llama.cpp's completion tools do.
        tokens = llm.tokenize(text.encode(), add_bos=True, special=True)
        cont, gaps = greedy(llm, tokens)
        cases.append({"name": pname, "text": text, "chat": chat, "tokens": tokens, "greedy": cont, "greedy_top2_gap": gaps})
        print(f"{name} {pname}: {len(tokens)} prompt tokens", file=sys.stderr)
    tf_text = cut_to_tokens(llm, license_text("GPL-3"), SYNTHETIC_TEACHER_TOKENS if synthetic else TEACHER_TOKENS)
    tf_tokens = llm.tokenize(tf_text.encode(), add_bos=True, special=False)
    argmax, gaps = teacher_forced(llm, tf_tokens)
    fixture = {
        "model": name,
        "file": file,
        "synthetic": synthetic,
        "model_sha256": sha256_of(path),
        "llama_cpp_python": llama_cpp.__version__,
        "recorded_on": cpu_description(),
        "use_extra_bufts": False,
        "n_batch": 1,
        "n_greedy": N_GREEDY,
        "prompts": cases,
        "teacher_forced": {"text": tf_text, "tokens": tf_tokens, "argmax": argmax, "top2_gap": gaps},
    }
    out = os.path.join(ROOT, "tests", "fixtures", "parity", f"{name}.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, indent=None, separators=(",", ":"))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    for n in sys.argv[1:] or list(MODELS) + SYNTHETIC:
        record(n)
