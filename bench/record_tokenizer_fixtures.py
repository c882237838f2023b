#!/usr/bin/env python3
"""Records llama.cpp's tokenization of a fixed set of texts, as fixtures for reckon's tokenizer tests.

Run with a Python that has llama-cpp-python (which vendors llama.cpp):

    /opt/llamacpp-venv/bin/python bench/record_tokenizer_fixtures.py [--models-dir DIR]

Writes tests/fixtures/tokenizer/<short-name>.json for every known model present in the models directory
($RECKON_HOME, default ~/.cache/reckon/models). Each file holds the model's BOS/EOS/EOG ids and a list of
cases {text, add_special, parse_special, ids, detok, detok_special}, where `detok`/`detok_special` are
llama_detokenize(ids, remove_special=False, unparse_special=False/True) decoded as UTF-8 with replacement.
"""

import argparse
import ctypes
import json
import os
import sys
from pathlib import Path

import llama_cpp

MODELS = {
    "smollm2-135m": ("SmolLM2-135M-Instruct.Q4_1.gguf", "chatml"),
    "qwen2.5-coder-0.5b": ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "chatml"),
    "gemma3-270m": ("gemma-3-270m-q4_k_m.gguf", "gemma"),
}

CHAT = {
    "chatml": [
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    ],
    "gemma": [
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
        "<bos><start_of_turn>user\nWrite a haiku.<end_of_turn>\n<start_of_turn>model\n",
    ],
}

PYTHON = '''import os

class Greeter:
    """Says hello."""

    def __init__(self, name: str) -> None:
        self.name = name

    def greet(self, times=3):
        for i in range(times):
            if i % 2 == 0:
                print(f"Hello, {self.name}! #{i}")
            else:
                print("...")
        return {"ok": True, "n": times}
'''

RUST = '''fn main() {
\tlet v: Vec<u32> = (0..10).map(|x| x * x).collect();
\tfor (i, x) in v.iter().enumerate() {
\t\tif *x > 10 {
\t\t\tprintln!("{i}: {x:>4}");
\t\t}
\t}
    // mixed: four spaces, then a tab
    \tlet s = String::from("tabs\\tand\\nescapes");
}
'''

BASE_TEXTS = [
    "Hello, world! The quick brown fox.",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs; "
    "sphinx of black quartz, judge my vow.",
    PYTHON,
    RUST,
    "12345 3.14159 1,000,000 -42 0x1F 1e-9 2024-06-01 99.9% $1,234.56",
    "Café naïve résumé façade über Ærøskøbing Łódź São Paulo e\u0301 vs \u00e9",
    "你好，世界！日本語のテキストです。한국어 텍스트. 中文和English混合。",
    "مرحبا بالعالم، كيف حالك؟ שלום עולם. Привет, мир! Γειά σου Κόσμε. नमस्ते दुनिया",
    "Emoji: 😀 👍🏽 👨\u200d👩\u200d👧\u200d👦 family, 🏳\ufe0f\u200d🌈 flag, 🇺🇸🇯🇵🇫🇷 flags, ❤\ufe0f, 🧑🏻\u200d💻",
    "   leading and trailing spaces   ",
    "line one\n\n\nline two\n\n\n\n",
    "Windows\r\nline\r\n\r\nendings\r\n",
    "I'm, you'll, DON'T, she'd, we've, they're, it's, 'tis, O'Neil's, I'M, WE'LL, Y'ALL",
    "tabs\tand\t\tspaces  \t \n mixed \u00a0non-breaking\u3000ideographic\u2009thin\u200bzero-width",
    "x² + y³ = z⁴; ∑∫√∞ ≠ ≤ ≥ → ← ½ ⅓ ① Ⅻ ℃ № ™ © ®",
    "https://example.com/path?q=1&r=two#frag user@example.org C:\\Users\\me\\file.txt",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa !!!!!!!!!??? -------- ........ ________",
    "| col a |    col b    |\n|-------|-------------|\n|   1   |      2      |\n" + " " * 40 + "end",
    "<table><tr><td>1</td></tr></table> <b>bold</b> <h1>Title</h1>",
    "before</s>after <s> <unk> <pad> [multimodal] <|endoftext|> <end_of_turn> <|im_end|>",
    "control chars: bell\x07 del\x7f nul\x00 esc\x1b end",
    "",
    " ",
    "\n",
    "\t\t\tindented\n        eight spaces\n\n\n\n\n\n\n\n\n\n\n\n\nmany newlines",
]


def long_text() -> str:
    parts = []
    for i in range(17):
        parts.append(
            f"Section {i + 1}: In {1990 + i * 2}, the team measured {i * 37 % 101} samples at {3.5 + i / 4:.2f} °C. "
            "Results were mixed — some weren't reproducible, others were. "
            f"Café owner Zoë said: «c'est très bien» ({i}/17). 東京で{i}回目の会議。 🚀✨\n"
        )
        if i % 3 == 0:
            parts.append(f"def f{i}(x):\n    return x ** {i} + {i * 1000}\n\n")
        if i % 4 == 1:
            parts.append(f"let v{i} = vec![{', '.join(str(j * i) for j in range(8))}];\n\t// tab-indented\n")
    return "".join(parts)


FUZZ_POOLS = [
    ["the", "The", "quick", "fox", "HELLO", "naïve", "Zoë", "x", "I", "a"],
    ["0", "7", "42", "123", "2024", "3.14", "1,000", "٣", "²", "½", "Ⅻ", "१२"],
    [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2009", "\u200b", " \n ", "\x0b", "\x0c"],
    [".", ",", "!", "?", "...", "—", "-", "(", ")", "[", "]", "{", "}", "<", ">", "/", "\\", "|", "$", "%", "&", "*", "+", "=", "~", "^", "`", "@", "#", "«", "»", "¿", "。", "、"],
    ["'s", "'S", "'t", "'re", "'RE", "'ve", "'m", "'ll", "'LL", "'d", "'D", "'", "''", "'x"],
    ["é", "ñ", "ß", "Ω", "ж", "ÿ", "Å", "e\u0301", "\u0301", "ﬁ"],
    ["你好", "世界", "日本語", "カタカナ", "ひらがな", "한국어", "中"],
    ["مرحبا", "שלום", "नमस्ते", "क्षत्रिय", "ไทย", "ཀ", "ሰላም"],
    ["😀", "👍🏽", "👨\u200d👩\u200d👧", "🏳\ufe0f\u200d🌈", "🇺🇸", "❤\ufe0f", "🚀", "\U0001F9D1\U0001F3FB\u200d\U0001F4BB"],
    ["\x00", "\x01", "\x07", "\x1b", "\x1f", "\x7f", "\u0085", "\ufeff", "\ue000", "\U0010fffd"],
    ["∑", "√", "∞", "≠", "→", "©", "™", "°", "€", "£", "¥", "§", "¶", "•"],
]


def fuzz_texts(n: int, specials: list, seed: int) -> list:
    import random

    rng = random.Random(seed)
    pools = FUZZ_POOLS + [specials]
    texts = []
    for _ in range(n):
        k = rng.randint(1, 24)
        texts.append("".join(rng.choice(rng.choice(pools)) for _ in range(k)))
    return texts


def detokenize(vocab, ids, unparse_special):
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 + 32 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, unparse_special)
    if n < 0:
        size = -n
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, unparse_special)
    return buf.raw[:n].decode("utf-8", errors="replace")


SPECIALS = {
    "chatml": ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "</s>", "<tool_call>", "<|fim_pad|>", "<reponame>", "<|im_end|>>", "<|im_start"],
    "gemma": ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "</s>", "<s>", "<b>", "<unused3>", "[multimodal]", "<td>", "<end_of_turn"],
}


def record(path: Path, chat_style: str, fuzz: int = 0, seed: int = 0) -> dict:
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    texts = BASE_TEXTS + CHAT[chat_style] + [long_text()]
    if fuzz:
        texts = fuzz_texts(fuzz, SPECIALS[chat_style], seed)
    cases = []
    for text in texts:
        for add_special, parse_special in [(False, False), (True, True)]:
            ids = llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)
            cases.append(
                {
                    "text": text,
                    "add_special": add_special,
                    "parse_special": parse_special,
                    "ids": ids,
                    "detok": detokenize(vocab, ids, False),
                    "detok_special": detokenize(vocab, ids, True),
                }
            )

    def tok(fn):
        t = fn(vocab)
        return None if t < 0 else t

    return {
        "model": path.name,
        "recorded_with": f"llama-cpp-python {llama_cpp.__version__}",
        "n_vocab": n_vocab,
        "bos": tok(llama_cpp.llama_vocab_bos),
        "eos": tok(llama_cpp.llama_vocab_eos),
        "eog": [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)],
        "cases": cases,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    default_dir = os.environ.get("RECKON_HOME") or os.path.expanduser("~/.cache/reckon/models")
    ap.add_argument("--models-dir", default=default_dir)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests/fixtures/tokenizer"))
    ap.add_argument("--fuzz", type=int, default=0, help="record N random texts instead of the fixed set")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, (file, chat_style) in MODELS.items():
        path = Path(args.models_dir) / file
        if not path.exists():
            print(f"skip {name}: {path} not found", file=sys.stderr)
            continue
        data = record(path, chat_style, args.fuzz, args.seed)
        dest = out / f"{name}.json"
        # One case per line keeps the files reviewable and diffs small.
        head = {k: v for k, v in data.items() if k != "cases"}
        lines = [json.dumps(head, ensure_ascii=False)[:-1] + ', "cases": [']
        lines += [json.dumps(c, ensure_ascii=False) + ("," if i + 1 < len(data["cases"]) else "") for i, c in enumerate(data["cases"])]
        lines.append("]}")
        dest.write_text("\n".join(lines) + "\n", encoding="utf-8")
        n_long = max(len(c["ids"]) for c in data["cases"])
        print(f"{name}: {len(data['cases'])} cases (longest {n_long} tokens) -> {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
