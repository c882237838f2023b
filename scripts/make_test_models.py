#!/usr/bin/env python3
"""Small seeded random-weight GGUF files, one per architecture reckon runs beyond its three fetched
models, written with PyPI's `gguf` package (the writer llama.cpp's converters use). Run through
scripts/make-test-models, which pins the package versions (the files' bytes, and so the parity
fixtures' sha256s, depend on them).

Each file has its architecture's real tensor layout and every metadata key llama.cpp reads for it, a real
tokenizer's metadata copied from a fetched model (so text round trips; Qwen3's four added tokens named),
the architecture's real chat template where one is at hand (Llama 3.2's, Qwen3's, Phi-3.5's), and the quant types of a real
Q4_K_M download (Q4_K with Q6_K for attn_v / ffn_down / output, F32 norms and router), or Q8_0/F16 where
a file says so. K-quant blocks are written as seeded random bytes with their scales chosen for a
weight standard deviation near 1/sqrt(fan-in): `gguf` quantizes only the legacy types, and random
weights need no quantizer to be a valid random model.

    make_test_models.py OUTDIR [--only NAME ...] [--moe-big] [--sizes]

`--moe-big` also writes qwen3moe-big.gguf (>= 1 GiB of experts, for the MoE speed row); not for tests.
`--only NAME ...` writes just those files (any of the names here, `--moe-big`'s and `--sizes`' included).

`--sizes` writes, instead of the small files (add `--moe-big` or `--only` for more), random-weight files
of the real shapes of models people run, for benchmarks at the memory limit; not for tests, not in CI:

    llama3.2-3b-shape    llama     28 x 3072, 24/8 heads of 128, ffn 8192, vocab 128256, tied     1.9 GiB
    llama3.1-8b-shape    llama     32 x 4096, 32/8 heads of 128, ffn 14336, vocab 128256          4.6 GiB
    qwen2.5-7b-shape     qwen2     28 x 3584, 28/4 heads of 128, q/k/v biases, ffn 18944,
                                   vocab 152064 (a third architecture, and the widest ffn)        4.4 GiB
    qwen3-30b-a3b-shape  qwen3moe  48 x 2048, 32/4 heads of 128, 128 experts of 768, top 8,
                                   vocab 151936                                                  17.3 GiB

Their types are those llama.cpp's quantizer (llama-quant.cpp, llama_tensor_get_type) gives a Q4_K_M
file of that shape: Q4_K by default; Q6_K for output.weight, and for token_embd.weight where it is
tied (it is the output too), else Q4_K; attn_v and ffn_down (the experts' ffn_down_exps alike) Q6_K
in layer i of n where i < n/8, i >= 7n/8 or (i - n/8) % 3 == 2 (its use_more_bits: about half the
layers), else Q4_K; norms, biases, the router and rope_freqs F32 (1-D tensors and ffn_gate_inp are not
quantized). Its 8-expert rules (Q8_0 attn_v / attn_k) do not apply to 128 experts. The sizes come
out close to the published Q4_K_M downloads'. There is no Llama 3 tokenizer here: the llama files take
Qwen's first 128,000 BPE tokens (with the merges among them) and Llama 3's 256 special tokens at their
ids, `llama-bpe` pre-tokenizer, Llama 3.2's template; the Qwen files take Qwen's, with [PADn] fillers
up to their vocabulary. These files are written streaming (Streamer): the tensor infos first, then
each tensor's bytes as they are made, in chunks of rows, so the 17 GiB file takes about 0.5 GiB of
memory. Their stamp names SIZES_VERSION beside RECIPE_VERSION.
"""
import argparse, hashlib, importlib.metadata, json, os, sys
import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

# Bumped whenever a recipe changes, so an old file is rewritten.
RECIPE_VERSION = 5
# The sub-blocks' output projections write the residual stream this much louder than 1/sqrt(fan-in):
# with tied embeddings a random model otherwise repeats its input token (x stays near its embedding).
RESIDUAL_STD = 4.0
MODELS_DIR = os.environ.get("RECKON_HOME") or os.path.expanduser("~/.cache/reckon/models")
TOKENIZERS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",  # GPT-2 style BPE, 49,152 tokens
    "qwen2": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",  # Qwen's BPE, 151,936 ids (Qwen3 shares it)
}


# The models' own chat templates, as llama.cpp keeps them for its tests (models/templates/, fetched from
# the models' Hugging Face repositories by its scripts/get_chat_template.py), out of the llama-cpp-python
# sdist on PyPI that bench/setup-llamacpp builds.
SDIST = ("llama_cpp_python-0.3.36.tar.gz", "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
TEMPLATES = {
    "llama3.2": ("meta-llama-Llama-3.2-3B-Instruct.jinja", "5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4"),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"),
    "phi3.5": ("microsoft-Phi-3.5-mini-instruct.jinja", "78d976a442bcde2f0be15aafbb8e3050e1104f86732266f68403251b89982a90"),
    "lfm2.5": ("LFM2.5-Instruct.jinja", "f05bf4b967dc993bdc7a2fe6e43759ee218eb0eb340d68b063e1c4f8ad148176"),
}
# Qwen3's vocabulary is Qwen2.5's with four of its padding ids named (its tokenizer.json's added tokens).
QWEN3_TOKENS = {151665: "<tool_response>", 151666: "</tool_response>", 151667: "<think>", 151668: "</think>"}


def chat_template(name):
    import tarfile, urllib.request
    cache = os.path.join(os.path.dirname(MODELS_DIR.rstrip("/")), SDIST[0])
    if not os.path.exists(cache) or sha256_of(cache) != SDIST[1]:
        index = "https://pypi.org/simple/llama-cpp-python/"
        req = urllib.request.Request(index, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        files = json.load(urllib.request.urlopen(req, timeout=120))["files"]
        url = next(f["url"] for f in files if f["filename"] == SDIST[0])
        urllib.request.urlretrieve(url, cache + ".tmp")
        if sha256_of(cache + ".tmp") != SDIST[1]:
            sys.exit(f"{url}: sha256 mismatch")
        os.replace(cache + ".tmp", cache)
    member, digest = TEMPLATES[name]
    with tarfile.open(cache) as tar:
        data = tar.extractfile(f"llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/{member}").read()
    if digest is not None and hashlib.sha256(data).hexdigest() != digest:
        sys.exit(f"{member}: sha256 mismatch")
    return data.decode()


class Rng:
    def __init__(self, seed):
        self.g = np.random.Generator(np.random.PCG64(seed))

    def normal(self, shape, std):
        return (self.g.standard_normal(shape) * std).astype(np.float32)

    def bytes(self, shape):
        return self.g.integers(0, 256, size=shape, dtype=np.uint8)


def f16_bytes(x):
    return np.asarray(x, dtype=np.float16).view(np.uint8).reshape(*np.shape(x), 2)


def q4_k(rng, rows, cols, std):
    """Random Q4_K rows (144-byte blocks of 256: d, dmin, 12 packed 6-bit scale/min bytes, 128 nibble
    bytes). A weight is d*sc*q - dmin*m, sc, m in 0..63, q in 0..15; dmin = 7.5 d centres it, and its
    standard deviation is then about 257 d."""
    nb = cols // 256
    d = np.abs(rng.normal((rows, nb), 0.2)) + 1.0
    d = d * std / 257.0
    blocks = np.concatenate([f16_bytes(d), f16_bytes(d * 7.5), rng.bytes((rows, nb, 12 + 128))], axis=2)
    return blocks.reshape(rows, nb * 144)


def q6_k(rng, rows, cols, std):
    """Random Q6_K rows (210-byte blocks of 256: 128 low-nibble bytes, 64 high-bit bytes, 16 int8
    scales, d). A weight is d*scale*(q - 32), q in 0..63; scales drawn from 8..63 give a standard
    deviation near 729 d."""
    nb = cols // 256
    q = rng.bytes((rows, nb, 192))
    scales = (rng.bytes((rows, nb, 16)) % 56 + 8).astype(np.uint8)
    d = (np.abs(rng.normal((rows, nb), 0.2)) + 1.0) * std / 729.0
    blocks = np.concatenate([q, scales, f16_bytes(d)], axis=2)
    return blocks.reshape(rows, nb * 210)


class Writer:
    """Adds tensors in a quant type, shaped as numpy (rows, cols) = GGUF [cols, rows]."""

    def __init__(self, w, rng):
        self.w, self.rng = w, rng

    def matrix(self, name, rows, cols, qtype, std=None, experts=None):
        std = std if std is not None else 1.0 / np.sqrt(cols)
        lead = (experts,) if experts else ()
        if qtype in (Q.Q4_K, Q.Q6_K):
            make = q4_k if qtype == Q.Q4_K else q6_k
            parts = [make(self.rng, rows, cols, std) for _ in range(experts or 1)]
            data = np.stack(parts) if experts else parts[0]
            self.w.add_tensor(name, data, raw_dtype=qtype)
        elif qtype == Q.Q8_0:
            data = gguf.quants.quantize(self.rng.normal(lead + (rows, cols), std), Q.Q8_0)
            self.w.add_tensor(name, data, raw_dtype=Q.Q8_0)
        elif qtype == Q.F16:
            self.w.add_tensor(name, self.rng.normal(lead + (rows, cols), std).astype(np.float16))
        elif qtype == Q.F32:
            self.w.add_tensor(name, self.rng.normal(lead + (rows, cols), std))
        else:
            raise ValueError(qtype)

    def norm(self, name, n):
        self.w.add_tensor(name, 1.0 + self.rng.normal((n,), 0.1))

    def vector(self, name, values):
        self.w.add_tensor(name, np.asarray(values, dtype=np.float32))


class Streamer:
    """Writer's interface for files too big to hold: each call adds only the tensor's info (final shape,
    type, byte size) and a generator of its bytes; `write_data`, once the header, KV and tensor infos are
    written, makes and writes the tensors one at a time, in chunks of rows, so the process holds at most a
    chunk (CHUNK bytes and its temporaries) however large the file. The draws happen in file order, so a
    seed still makes the same bytes."""

    CHUNK = 64 << 20

    def __init__(self, w, rng):
        self.w, self.rng, self.parts = w, rng, []

    def _add(self, name, shape, dtype, nbytes, qtype, rows, row_bytes, make):
        self.w.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=qtype)
        self.parts.append((nbytes, rows, max(1, self.CHUNK // row_bytes), make))

    def matrix(self, name, rows, cols, qtype, std=None, experts=None):
        std = std if std is not None else 1.0 / np.sqrt(cols)
        lead = (experts,) if experts else ()
        total = rows * (experts or 1)  # experts' rows are drawn alike: one run over all of them
        if qtype in (Q.Q4_K, Q.Q6_K):
            make = q4_k if qtype == Q.Q4_K else q6_k
            row_bytes = cols // 256 * (144 if qtype == Q.Q4_K else 210)
            self._add(name, lead + (rows, row_bytes), np.uint8, total * row_bytes, qtype, total, row_bytes,
                      lambda n: make(self.rng, n, cols, std))
        elif qtype == Q.F32:
            self._add(name, lead + (rows, cols), np.float32, total * cols * 4, None, total, cols * 4,
                      lambda n: self.rng.normal((n, cols), std))
        else:
            raise ValueError(qtype)

    def norm(self, name, n):
        self._add(name, (n,), np.float32, 4 * n, None, 1, 4 * n, lambda _: 1.0 + self.rng.normal((n,), 0.1))

    def bias(self, name, n, std=0.1):
        self._add(name, (n,), np.float32, 4 * n, None, 1, 4 * n, lambda _: self.rng.normal((n,), std))

    def vector(self, name, values):
        values = np.asarray(values, dtype=np.float32)
        self._add(name, values.shape, np.float32, values.nbytes, None, 1, values.nbytes, lambda _: values)

    def write_data(self):
        """After `write_ti_data_to_file`: each tensor at the next multiple of the alignment, padded after,
        as GGUFWriter.write_tensor_data places them (it would want each tensor whole)."""
        fout = self.w.fout[0]
        for nbytes, rows, step, make in self.parts:
            self.w.write_padding(fout, fout.tell())
            written = 0
            for r0 in range(0, rows, step):
                chunk = make(min(step, rows - r0))
                chunk.tofile(fout)
                written += chunk.nbytes
                del chunk
            assert written == nbytes, (written, nbytes)
            self.w.write_padding(fout, nbytes)


def copy_tokenizer(w, source, template=None, rename=None):
    """The source model's tokenizer keys; `template` (a TEMPLATES name) replaces its chat template and
    `rename` ({id: text}) names tokens (user-defined, as added tokens are)."""
    path = os.path.join(MODELS_DIR, TOKENIZERS[source])
    if not os.path.exists(path):
        sys.exit(f"{path} is missing: scripts/fetch-models first (its tokenizer is copied)")
    r = gguf.GGUFReader(path)
    n_vocab = 0
    for key, field in r.fields.items():
        if not key.startswith("tokenizer.") or (template and key == "tokenizer.chat_template"):
            continue
        main = field.types[0]
        if main == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            values = field.contents()
            for i, text in (rename or {}).items():
                if key == "tokenizer.ggml.tokens":
                    values[i] = text
                elif key == "tokenizer.ggml.token_type":
                    values[i] = 4  # USER_DEFINED
            w.add_key_value(key, values, main, sub)
            if key == "tokenizer.ggml.tokens":
                n_vocab = len(field.data)
        else:
            w.add_key_value(key, field.contents(), main)
    if template:
        w.add_chat_template(chat_template(template))
    return n_vocab


def llama3_freq_factors(rot_dim, base, factor=8.0, low=1.0, high=4.0, original=8192):
    """Llama 3.1's frequency factors, as convert_hf_to_gguf writes them into rope_freqs.weight."""
    freqs = 1.0 / (base ** (np.arange(0, rot_dim, 2, dtype=np.float32) / rot_dim))
    low_wl, high_wl = original / low, original / high
    out = []
    for f in freqs:
        wl = 2 * np.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(factor)
        else:
            smooth = (original / wl - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return out


def common_keys(w, arch, *, layers, d, heads, kv_heads, ff, ctx, head_dim=None, rope_base=10000.0, rot=None, eps=1e-5):
    w.add_context_length(ctx)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(rope_base)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_dimension_count(rot if rot is not None else (head_dim or d // heads))
    w.add_file_type(15)  # MOSTLY_Q4_K_M


def attention(t, i, d, q_dim, kv_dim, v_type=Q.Q6_K, qk_type=Q.Q4_K, o_type=Q.Q4_K):
    t.matrix(f"blk.{i}.attn_q.weight", q_dim, d, qk_type)
    t.matrix(f"blk.{i}.attn_k.weight", kv_dim, d, qk_type)
    t.matrix(f"blk.{i}.attn_v.weight", kv_dim, d, v_type)
    t.matrix(f"blk.{i}.attn_output.weight", d, q_dim, o_type, std=RESIDUAL_STD / np.sqrt(q_dim))


def ffn(t, i, d, ff, types=(Q.Q4_K, Q.Q4_K, Q.Q6_K)):
    t.matrix(f"blk.{i}.ffn_gate.weight", ff, d, types[0])
    t.matrix(f"blk.{i}.ffn_up.weight", ff, d, types[1])
    t.matrix(f"blk.{i}.ffn_down.weight", d, ff, types[2], std=RESIDUAL_STD / np.sqrt(ff))


def embeddings(t, n_vocab, d, embd_type=Q.Q4_K, output_type=Q.Q6_K, tied=False):
    # tied: the logits are x·E, so E's spread is theirs (std 0.25 x sqrt(256) = 4), and a quiet E keeps
    # the residual stream from staying near the input token's own row (a model that repeats its input)
    t.matrix("token_embd.weight", n_vocab, d, embd_type, std=0.25 if tied else 1.0)
    t.norm("output_norm.weight", d)
    if not tied:
        # a wide spread of logits, so greedy steps are decided and not near-ties
        t.matrix("output.weight", n_vocab, d, output_type, std=4.0 / np.sqrt(d))


def llama3(w, t):
    """Llama 3.x: GQA, rope_freqs (llama3 scaling factors), base 500,000, untied output."""
    L, d, H, KV, ff, hd = 3, 256, 4, 2, 512, 64
    n_vocab = copy_tokenizer(w, "smollm2", template="llama3.2")
    common_keys(w, "llama", layers=L, d=d, heads=H, kv_heads=KV, ff=ff, ctx=8192, rope_base=500000.0)
    w.add_vocab_size(n_vocab)
    embeddings(t, n_vocab, d)
    t.vector("rope_freqs.weight", llama3_freq_factors(hd, 500000.0))
    for i in range(L):
        t.norm(f"blk.{i}.attn_norm.weight", d)
        attention(t, i, d, H * hd, KV * hd)
        t.norm(f"blk.{i}.ffn_norm.weight", d)
        ffn(t, i, d, ff)


def llama_tied(w, t):
    """A llama with tied embeddings, all Q8_0 as a Q8_0 download is (Mistral-7B's block: llama.cpp reads
    no sliding window for the llama architecture). No F16 matrices: neither reckon's F16 dot nor
    llama.cpp's (tinyBLAS at any batch) is the per-row path the ggml numerics reproduce bit for bit."""
    L, d, H, KV, ff, hd = 2, 256, 8, 2, 768, 32
    n_vocab = copy_tokenizer(w, "smollm2")
    common_keys(w, "llama", layers=L, d=d, heads=H, kv_heads=KV, ff=ff, ctx=8192, rope_base=1000000.0)
    w.add_file_type(7)  # MOSTLY_Q8_0
    embeddings(t, n_vocab, d, embd_type=Q.Q8_0, tied=True)
    for i in range(L):
        t.norm(f"blk.{i}.attn_norm.weight", d)
        attention(t, i, d, H * hd, KV * hd, v_type=Q.Q8_0, qk_type=Q.Q8_0, o_type=Q.Q8_0)
        t.norm(f"blk.{i}.ffn_norm.weight", d)
        ffn(t, i, d, ff, types=(Q.Q8_0, Q.Q8_0, Q.Q8_0))


def qwen3_attention(t, i, d, H, KV, hd):
    """Qwen3's attention sub-block and the norm before its feed-forward (qwen3 and qwen3moe)."""
    t.norm(f"blk.{i}.attn_norm.weight", d)
    attention(t, i, d, H * hd, KV * hd)
    t.norm(f"blk.{i}.attn_q_norm.weight", hd)
    t.norm(f"blk.{i}.attn_k_norm.weight", hd)
    t.norm(f"blk.{i}.ffn_norm.weight", d)


def qwen3(w, t):
    """Qwen3: per-head q/k RMSNorm, head size set apart from d_model/heads, GQA, tied embeddings."""
    L, d, H, KV, ff, hd = 3, 256, 8, 2, 512, 64
    n_vocab = copy_tokenizer(w, "qwen2", template="qwen3", rename=QWEN3_TOKENS)
    common_keys(w, "qwen3", layers=L, d=d, heads=H, kv_heads=KV, ff=ff, ctx=40960, head_dim=hd, rope_base=1000000.0, eps=1e-6)
    embeddings(t, n_vocab, d, embd_type=Q.Q6_K, tied=True)
    for i in range(L):
        qwen3_attention(t, i, d, H, KV, hd)
        ffn(t, i, d, ff)


def qwen3moe_recipe(L, d, H, KV, hd, n_expert, n_used, ff_exp):
    def make(w, t):
        n_vocab = copy_tokenizer(w, "qwen2", template="qwen3", rename=QWEN3_TOKENS)
        common_keys(w, "qwen3moe", layers=L, d=d, heads=H, kv_heads=KV, ff=3 * d, ctx=40960, head_dim=hd, rope_base=1000000.0, eps=1e-6)
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_used)
        w.add_expert_feed_forward_length(ff_exp)
        embeddings(t, n_vocab, d)
        for i in range(L):
            qwen3_attention(t, i, d, H, KV, hd)
            # the router stays F32, as llama.cpp's quantizer leaves it
            t.matrix(f"blk.{i}.ffn_gate_inp.weight", n_expert, d, Q.F32, std=2.0 / np.sqrt(d))
            t.matrix(f"blk.{i}.ffn_gate_exps.weight", ff_exp, d, Q.Q4_K, experts=n_expert)
            t.matrix(f"blk.{i}.ffn_up_exps.weight", ff_exp, d, Q.Q4_K, experts=n_expert)
            t.matrix(f"blk.{i}.ffn_down_exps.weight", d, ff_exp, Q.Q6_K, std=RESIDUAL_STD / np.sqrt(ff_exp), experts=n_expert)
    make.__doc__ = f"Qwen3-MoE: qwen3's attention, {n_expert} experts of {ff_exp}, top {n_used}, normalised softmax weights."
    return make


def phi3(w, t):
    """Phi-3 / Phi-4-mini: fused qkv and gate_up, partial rotary (48 of 64), q scaled before attention,
    short/long rope factors (llama.cpp uses the short ones up to the original context)."""
    L, d, H, KV, ff, hd, rot = 3, 256, 4, 2, 512, 64, 48
    n_vocab = copy_tokenizer(w, "smollm2", template="phi3.5")
    common_keys(w, "phi3", layers=L, d=d, heads=H, kv_heads=KV, ff=ff, ctx=131072, rope_base=10000.0, rot=rot)
    w.add_rope_scaling_orig_ctx_len(4096)
    embeddings(t, n_vocab, d)
    t.vector("rope_factors_short.weight", 1.0 + np.abs(t.rng.normal((rot // 2,), 0.3)))
    t.vector("rope_factors_long.weight", 1.0 + np.abs(t.rng.normal((rot // 2,), 3.0)))
    for i in range(L):
        t.norm(f"blk.{i}.attn_norm.weight", d)
        t.matrix(f"blk.{i}.attn_qkv.weight", H * hd + 2 * KV * hd, d, Q.Q4_K)
        t.matrix(f"blk.{i}.attn_output.weight", d, H * hd, Q.Q4_K, std=RESIDUAL_STD / np.sqrt(H * hd))
        t.norm(f"blk.{i}.ffn_norm.weight", d)
        t.matrix(f"blk.{i}.ffn_up.weight", 2 * ff, d, Q.Q4_K)
        t.matrix(f"blk.{i}.ffn_down.weight", d, ff, Q.Q6_K, std=RESIDUAL_STD / np.sqrt(ff))


def lfm2(w, t):
    """LFM2 (Liquid's hybrid): most layers a gated short convolution over the last 3 positions (its state:
    2 positions per channel and layer, beside the KV cache), the others GQA attention with q/k norms;
    every layer a SwiGLU feed-forward. LFM2-350M's pattern, shortened: conv conv attn conv attn conv."""
    L, d, H, KV, ff, hd = 6, 256, 4, 2, 512, 64
    attn = {2, 4}
    n_vocab = copy_tokenizer(w, "smollm2", template="lfm2.5")
    common_keys(w, "lfm2", layers=L, d=d, heads=H, kv_heads=KV, ff=ff, ctx=32768, rope_base=1000000.0)
    w.add_head_count_kv([KV if i in attn else 0 for i in range(L)])
    w.add_shortconv_l_cache(3)
    w.add_vocab_size(n_vocab)
    t.matrix("token_embd.weight", n_vocab, d, Q.Q4_K, std=0.25)
    t.norm("token_embd_norm.weight", d)  # llama.cpp's name for LFM2's final norm
    for i in range(L):
        t.norm(f"blk.{i}.attn_norm.weight", d)
        if i in attn:
            attention(t, i, d, H * hd, KV * hd)
            t.norm(f"blk.{i}.attn_q_norm.weight", hd)
            t.norm(f"blk.{i}.attn_k_norm.weight", hd)
        else:
            t.matrix(f"blk.{i}.shortconv.conv.weight", d, 3, Q.F32, std=0.5)
            t.matrix(f"blk.{i}.shortconv.in_proj.weight", 3 * d, d, Q.Q4_K, std=2.0 / np.sqrt(d))
            t.matrix(f"blk.{i}.shortconv.out_proj.weight", d, d, Q.Q4_K, std=RESIDUAL_STD / np.sqrt(d))
        t.norm(f"blk.{i}.ffn_norm.weight", d)
        ffn(t, i, d, ff)


# name -> (architecture, recipe, seed)
MODELS = {
    "llama3-tiny": ("llama", llama3, 1),
    "llama-tied-tiny": ("llama", llama_tied, 2),
    "qwen3-tiny": ("qwen3", qwen3, 3),
    "qwen3moe-tiny": ("qwen3moe", qwen3moe_recipe(2, 256, 4, 2, 64, 8, 2, 256), 4),
    "phi3-tiny": ("phi3", phi3, 5),
    "lfm2-tiny": ("lfm2", lfm2, 7),
}
# 48 layers x 64 experts x 3 x 768x1024 Q4_K/Q6_K: about 1.3 GiB of experts, 8 of 64 active
BIG = {"qwen3moe-big": ("qwen3moe", qwen3moe_recipe(24, 1024, 16, 4, 64, 64, 8, 768), 6)}


# --sizes: the real shapes of models people run, for benchmarks at the memory limit (not for tests).
# Bumped whenever one of these recipes changes (RECIPE_VERSION, which the small files' bytes name, is not).
SIZES_VERSION = 1


def q4_k_m_more_bits(i, n):
    """llama.cpp's Q4_K_M type for the i-th of n attn_v (or the ffn_down of layer i of n, experts' too):
    Q6_K in the first and last eighths of the layers and every third layer between, else Q4_K
    (llama-quant.cpp's use_more_bits; its 8-expert Q8_0 attn_v / attn_k rule does not arise here)."""
    more = i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2
    return Q.Q6_K if more else Q.Q4_K


# Llama 3's 256 special tokens (ids 128000-128255), by name where the Llama 3.1 / 3.2 tokenizer names them
LLAMA3_SPECIAL = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>",
                  6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>",
                  10: "<|python_tag|>"}


def llama3_special_tokens():
    out, reserved = [], 0
    for i in range(256):
        if i in LLAMA3_SPECIAL:
            out.append(LLAMA3_SPECIAL[i])
        else:
            out.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return out


def shaped_tokenizer(w, n_vocab, llama3=False, template=None, rename=None):
    """A `gpt2` BPE tokenizer of exactly n_vocab ids, out of Qwen's (151,936 ids: 151,643 BPE tokens, its
    specials, then [PADn] fillers). Qwen-shaped: Qwen's keys as they are, filled up with more [PADn]
    (unused) ids where the model's vocabulary is larger. Llama 3-shaped (there is no Llama 3 tokenizer
    here): Qwen's first n_vocab - 256 BPE tokens with the merges among them, then Llama 3's 256 special
    tokens at their ids (<|begin_of_text|> 128000 as BOS, added; <|eot_id|> 128009 as EOS), the
    `llama-bpe` pre-tokenizer and `template`. Text tokenizes and decodes; it is not Llama 3's split."""
    path = os.path.join(MODELS_DIR, TOKENIZERS["qwen2"])
    if not os.path.exists(path):
        sys.exit(f"{path} is missing: scripts/fetch-models first (its tokenizer is copied)")
    fields = {k: f for k, f in gguf.GGUFReader(path).fields.items() if k.startswith("tokenizer.")}
    tokens = fields.pop("tokenizer.ggml.tokens").contents()
    types = fields.pop("tokenizer.ggml.token_type").contents()
    merges = fields.pop("tokenizer.ggml.merges").contents()
    for i, text in (rename or {}).items():
        tokens[i], types[i] = text, 4  # USER_DEFINED, as added tokens are
    if llama3:
        n_bpe = n_vocab - 256
        if any(t != 1 for t in types[:n_bpe]):
            sys.exit(f"{path}: its first {n_bpe} tokens are not all plain BPE tokens")
        tokens, types = tokens[:n_bpe] + llama3_special_tokens(), types[:n_bpe] + [3] * 256  # CONTROL
        kept = set(tokens[:n_bpe])
        merges = [m for m in merges if (lambda a, b: a in kept and b in kept and a + b in kept)(*m.split(" ", 1))]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("llama-bpe")
        w.add_bos_token_id(n_bpe)
        w.add_eos_token_id(n_bpe + 9)
        w.add_add_bos_token(True)
    else:
        for i in range(len(tokens), n_vocab):
            tokens.append(f"[PAD{i}]")
            types.append(5)  # UNUSED, as Qwen's own fillers
        del tokens[n_vocab:], types[n_vocab:]
        for key, field in fields.items():
            if not (template and key == "tokenizer.chat_template"):
                w.add_key_value(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if template:
        w.add_chat_template(chat_template(template))
    return len(tokens)


def llama3_shape(L, d, H, KV, ff, tied, rope_factor):
    def make(w, t):
        hd = d // H
        n_vocab = shaped_tokenizer(w, 128256, llama3=True, template="llama3.2")
        common_keys(w, "llama", layers=L, d=d, heads=H, kv_heads=KV, ff=ff, ctx=131072, rope_base=500000.0)
        w.add_vocab_size(n_vocab)
        # tied: the one matrix is the output too, and Q4_K_M gives it the output's Q6_K
        embeddings(t, n_vocab, d, embd_type=Q.Q6_K if tied else Q.Q4_K, tied=tied)
        t.vector("rope_freqs.weight", llama3_freq_factors(hd, 500000.0, factor=rope_factor))
        for i in range(L):
            t.norm(f"blk.{i}.attn_norm.weight", d)
            attention(t, i, d, H * hd, KV * hd, v_type=q4_k_m_more_bits(i, L))
            t.norm(f"blk.{i}.ffn_norm.weight", d)
            ffn(t, i, d, ff, types=(Q.Q4_K, Q.Q4_K, q4_k_m_more_bits(i, L)))
    make.__doc__ = f"Llama 3.x, {L} x {d}, {H}/{KV} heads of {d // H}, ffn {ff}, {'tied' if tied else 'untied'}, rope factor {rope_factor}."
    return make


def qwen2_shape(L, d, H, KV, ff, n_vocab, tied):
    def make(w, t):
        hd = d // H
        n = shaped_tokenizer(w, n_vocab)  # and Qwen2.5's own template, as the source file has it
        common_keys(w, "qwen2", layers=L, d=d, heads=H, kv_heads=KV, ff=ff, ctx=32768, rope_base=1000000.0, eps=1e-6)
        embeddings(t, n, d, embd_type=Q.Q6_K if tied else Q.Q4_K, tied=tied)
        for i in range(L):
            t.norm(f"blk.{i}.attn_norm.weight", d)
            attention(t, i, d, H * hd, KV * hd, v_type=q4_k_m_more_bits(i, L))
            t.bias(f"blk.{i}.attn_q.bias", H * hd)
            t.bias(f"blk.{i}.attn_k.bias", KV * hd)
            t.bias(f"blk.{i}.attn_v.bias", KV * hd)
            t.norm(f"blk.{i}.ffn_norm.weight", d)
            ffn(t, i, d, ff, types=(Q.Q4_K, Q.Q4_K, q4_k_m_more_bits(i, L)))
    make.__doc__ = f"Qwen2, {L} x {d}, {H}/{KV} heads of {d // H} with q/k/v biases, ffn {ff}, vocab {n_vocab}."
    return make


def qwen3moe_shape(L, d, H, KV, hd, n_expert, n_used, ff_exp, ff_dense):
    def make(w, t):
        n_vocab = shaped_tokenizer(w, 151936, template="qwen3", rename=QWEN3_TOKENS)
        common_keys(w, "qwen3moe", layers=L, d=d, heads=H, kv_heads=KV, ff=ff_dense, ctx=40960, head_dim=hd, rope_base=1000000.0, eps=1e-6)
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_used)
        w.add_expert_feed_forward_length(ff_exp)
        embeddings(t, n_vocab, d)
        for i in range(L):
            t.norm(f"blk.{i}.attn_norm.weight", d)
            attention(t, i, d, H * hd, KV * hd, v_type=q4_k_m_more_bits(i, L))
            t.norm(f"blk.{i}.attn_q_norm.weight", hd)
            t.norm(f"blk.{i}.attn_k_norm.weight", hd)
            t.norm(f"blk.{i}.ffn_norm.weight", d)
            t.matrix(f"blk.{i}.ffn_gate_inp.weight", n_expert, d, Q.F32, std=2.0 / np.sqrt(d))
            t.matrix(f"blk.{i}.ffn_gate_exps.weight", ff_exp, d, Q.Q4_K, experts=n_expert)
            t.matrix(f"blk.{i}.ffn_up_exps.weight", ff_exp, d, Q.Q4_K, experts=n_expert)
            t.matrix(f"blk.{i}.ffn_down_exps.weight", d, ff_exp, q4_k_m_more_bits(i, L), std=RESIDUAL_STD / np.sqrt(ff_exp), experts=n_expert)
    make.__doc__ = f"Qwen3-MoE, {L} x {d}, {H}/{KV} heads of {hd}, {n_expert} experts of {ff_exp}, top {n_used}."
    return make


SIZES = {
    "llama3.2-3b-shape": ("llama", llama3_shape(28, 3072, 24, 8, 8192, tied=True, rope_factor=32.0), 11),
    "llama3.1-8b-shape": ("llama", llama3_shape(32, 4096, 32, 8, 14336, tied=False, rope_factor=8.0), 12),
    "qwen2.5-7b-shape": ("qwen2", qwen2_shape(28, 3584, 28, 4, 18944, 152064, tied=False), 13),
    "qwen3-30b-a3b-shape": ("qwen3moe", qwen3moe_shape(48, 2048, 32, 4, 128, 128, 8, 768, 6144), 14),
}


def write(outdir, name, arch, recipe, seed, stream=False):
    path = os.path.join(outdir, f"{name}.gguf")
    version = f"{RECIPE_VERSION}+sizes{SIZES_VERSION}" if stream else f"{RECIPE_VERSION}"
    stamp = f"{version}:{importlib.metadata.version('gguf')}:{np.__version__}"
    stamp_path = path + ".recipe"
    if os.path.exists(path) and os.path.exists(stamp_path) and open(stamp_path).read() == stamp:
        return path, False
    tmp = path + ".tmp"
    w = gguf.GGUFWriter(tmp, arch)
    # not the architecture's name: llama.cpp sets token attributes by model name ("phi3" wants "</s>")
    w.add_name(f"reckon synthetic model {seed}")
    w.add_description(f"seeded random weights (seed {seed}), scripts/make-test-models recipe {version}: not a trained model")
    if stream:
        t = Streamer(w, Rng(seed))
        recipe(w, t)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        t.write_data()
    else:
        recipe(w, Writer(w, Rng(seed)))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    with open(stamp_path, "w") as f:
        f.write(stamp)
    return path, True


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--moe-big", action="store_true")
    ap.add_argument("--sizes", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    todo = {} if args.sizes else dict(MODELS)
    if args.moe_big:
        todo.update(BIG)
    if args.sizes:
        todo.update(SIZES)
    if args.only:
        known = {**MODELS, **BIG, **SIZES}
        unknown = [n for n in args.only if n not in known]
        if unknown:
            sys.exit(f"--only: no such file {unknown}; known: {', '.join(known)}")
        todo = {n: known[n] for n in args.only}
    manifest_path = os.path.join(args.outdir, "MANIFEST.json")
    manifest = json.load(open(manifest_path)) if os.path.exists(manifest_path) else {}
    for name, (arch, recipe, seed) in todo.items():
        path, fresh = write(args.outdir, name, arch, recipe, seed, stream=name in SIZES)
        manifest[name] = {"architecture": arch, "file": os.path.basename(path), "bytes": os.path.getsize(path)}
        print(f"{'wrote' if fresh else 'kept '} {path} ({os.path.getsize(path) >> 20} MiB)", file=sys.stderr)
        with open(manifest_path, "w") as f:
            json.dump(manifest, f, indent=1)


if __name__ == "__main__":
    main()
