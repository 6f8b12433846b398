"""One independent float64 forward pass for every architecture stowlm runs (llama dense or with
experts, qwen2, qwen3, qwen2moe, qwen3moe, gemma3, gpt-oss, deepseek2, glm4moe), from a GGUF file's
metadata and dequantized weights, written from llama.cpp's graphs (src/models/*.cpp,
build_moe_ffn, ggml's rope_yarn). It is the exact-arithmetic answer that stowlm and llama.cpp both
approximate with 8-bit activations. numpy, for short sequences: the synthetic-model tests, the
greedy tests' adjudication of a divergence, bench/moe_sensitivity.py.

    FloatModel(path, **overrides).logits(ids, positions=None, last_only=False, kv_f16=False,
                                         eps=0.0, rng=None)

overrides replace a hyperparameter read from the file (window=..., norm_w=...); kv_f16 rounds keys
and values to F16 as an engine's cache holds them; eps > 0 multiplies the residual stream by
(1 + eps * N(0, 1)) after every layer."""
import functools

import numpy as np

from stowlm import GGUFFile
from stowlm.quants import dequantize

ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma3", "gpt-oss", "deepseek2", "glm4moe")
SOFTMAX, SIGMOID, SOFTMAX_WEIGHT = 1, 2, 3  # llama.cpp's expert_gating_func


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def silu(g, u):
    return g / (1 + np.exp(-g)) * u


def gelu(g, u):
    return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u


def swiglu_oai(g, u, alpha=1.702, limit=7.0):
    g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    return g / (1 + np.exp(-alpha * g)) * (u + 1)


def f16(x):
    return x.astype(np.float16).astype(np.float64)


def rope_table(pos, n_rot, base, yarn=None):
    """cos and sin [n, n_rot / 2] of ggml's rope_yarn: pair i turns by pos * base^(-2i/n_rot);
    yarn = (factor, n_ctx_orig, attn_factor) blends interpolated and extrapolated angles over the
    correction dims (beta_fast 32, beta_slow 1, ext_factor 1) and scales both by mscale."""
    i = np.arange(n_rot // 2)
    theta, mscale = np.asarray(pos, np.float64)[:, None] * base ** (-2.0 * i / n_rot), 1.0
    if yarn:
        factor, n_orig, attn_factor = yarn
        corr = lambda beta: n_rot * np.log(n_orig / (beta * 2 * np.pi)) / (2 * np.log(base))  # noqa: E731
        lo, hi = max(0.0, np.floor(corr(32))), min(n_rot - 1.0, np.ceil(corr(1)))
        ramp = 1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)
        theta = theta / factor * (1 - ramp) + theta * ramp
        mscale = attn_factor * (1 + 0.1 * np.log(factor))
    return np.cos(theta) * mscale, np.sin(theta) * mscale


def rope(x, table, neox):
    """Rotates the first n_rot dims of every head of x [n, heads, d]: NeoX halves or adjacent pairs."""
    c, s = (t[:, None] for t in table)
    r = 2 * c.shape[-1]
    ia, ib = (np.s_[..., : r // 2], np.s_[..., r // 2: r]) if neox else (np.s_[..., 0:r:2], np.s_[..., 1:r:2])
    y, a, b = x.copy(), x[ia], x[ib]
    y[ia], y[ib] = a * c - b * s, a * s + b * c
    return y


def attention(q, k, v, pos, scale, window=0, sinks=None):
    """q [n, H, dk], k [n, HKV, dk], v [n, HKV, dv] -> [n, H * dv]. Causal by position; window: a
    key is seen while q_pos - k_pos < window; sinks [H]: one more logit per head in the softmax
    denominator, with no value."""
    n, H, _ = q.shape
    HKV = k.shape[1]
    s = np.einsum("ighd,jgd->ghij", q.reshape(n, HKV, H // HKV, -1), k) * scale
    d = pos[:, None] - pos[None, :]
    s = np.where((d >= 0) & (d < window) if window else d >= 0, s, -np.inf)
    sk = np.full((HKV, H // HKV, 1, 1), -np.inf) if sinks is None else sinks.reshape(HKV, H // HKV, 1, 1)
    m = np.maximum(s.max(-1, keepdims=True), sk)
    p = np.exp(s - m)
    p /= p.sum(-1, keepdims=True) + np.exp(sk - m)
    return np.einsum("ghij,jgd->ighd", p, v).reshape(n, -1)


class FloatModel:
    def __init__(self, path, **overrides):
        self.file = GGUFFile(path)
        md = self.file.metadata
        self.arch = a = md["general.architecture"]
        if a not in ARCHS:
            raise ValueError(f"{path}: float reference has no {a!r} architecture")
        g = lambda key, default=None: md.get(f"{a}.{key}", default)  # noqa: E731
        self.info, self.cache = {t[0]: t for t in self.file.tensors}, {}
        self.n_embd, self.n_layer = g("embedding_length"), g("block_count")
        self.eps = g("attention.layer_norm_rms_epsilon")
        self.n_head, self.n_head_kv = g("attention.head_count"), g("attention.head_count_kv")
        self.head_dim = g("attention.key_length_mla", g("attention.key_length", self.n_embd // self.n_head))
        self.n_rot, self.base = g("rope.dimension_count", self.head_dim), g("rope.freq_base", 10000.0)
        self.window = g("attention.sliding_window", 0)
        self.neox = a not in ("llama", "deepseek2")
        self.n_used, self.w_scale = g("expert_used_count", 0), g("expert_weights_scale", 0.0)
        self.groups, self.groups_used = g("expert_group_count", 0), g("expert_group_used_count", 0)
        self.gating = SOFTMAX_WEIGHT if a == "gpt-oss" else \
            g("expert_gating_func", 0) or (SIGMOID if a == "glm4moe" else SOFTMAX)
        self.norm_w = g("expert_weights_norm", a in ("llama", "qwen3moe"))
        self.yarn, self.kq_mscale = None, 1.0
        if g("rope.scaling.type") == "yarn":
            factor, log_mul = g("rope.scaling.factor"), g("rope.scaling.yarn_log_multiplier", 0.0)
            if a == "deepseek2":  # models/deepseek2.cpp undoes the converter's factor 0.1
                log_mul = float(np.float32(log_mul) / np.float32(0.1))
            ms = lambda m: 1 + 0.1 * m * np.log(factor)  # noqa: E731
            # attn_factor as llama_context derives it, divided by the ms(1) that rope_yarn multiplies back
            af = (ms(log_mul if a == "deepseek2" and log_mul != 1 else 1) / ms(log_mul) if log_mul else ms(1)) / ms(1)
            self.yarn = (factor, g("rope.scaling.original_context_length"), af)
            self.kq_mscale = af * ms(1) * ms(log_mul)  # deepseek2's kq_scale: its square / sqrt(dk)
        for key, val in overrides.items():
            if not hasattr(self, key):
                raise AttributeError(f"FloatModel has no hyperparameter {key!r}")
            setattr(self, key, val)

    def has(self, name):
        return name in self.info

    def W(self, name):
        """Dequantized once, kept as float32 (exact; products run in float64)."""
        if name not in self.cache:
            t = self.info[name]
            self.cache[name] = dequantize(self.file.tensor_data(name), t[1], t[2])
        return self.cache[name]

    def lin(self, name, x):
        y = x @ self.W(name + ".weight").astype(np.float64).T
        return y + self.W(name + ".bias") if self.has(name + ".bias") else y

    def norm(self, name, x):
        return rms(x, self.W(name + ".weight"), self.eps)

    def swa(self, il):
        return bool(self.window) and (il % 6 < 5 if self.arch == "gemma3" else
                                      il % 2 == 0 if self.arch == "gpt-oss" else False)

    # ---- attention ----------------------------------------------------------------------
    def attn(self, p, h, pos, il, kv_f16):
        n, hd = len(h), self.head_dim
        q, k, v = (self.lin(p + f"attn_{t}", h).reshape(n, -1, hd) for t in "qkv")
        if self.has(p + "attn_q_norm.weight"):
            q, k = self.norm(p + "attn_q_norm", q), self.norm(p + "attn_k_norm", k)
        base = 10000.0 if self.arch == "gemma3" and self.swa(il) else self.base
        table = rope_table(pos, self.n_rot, base, self.yarn)
        q, k = rope(q, table, self.neox), rope(k, table, self.neox)
        if kv_f16:
            k, v = f16(k), f16(v)
        sinks = self.W(p + "attn_sinks.weight") if self.has(p + "attn_sinks.weight") else None
        o = attention(q, k, v, pos, 1 / np.sqrt(hd), self.window if self.swa(il) else 0, sinks)
        return self.lin(p + "attn_output", o)

    def mla(self, p, h, pos, kv_f16):
        """deepseek2's multi-head latent attention in its plain (not absorbed) form: per head,
        keys [attn_k_b^T c | shared roped k_pe], values attn_v_b c, c the normed latent."""
        n, H, r = len(h), self.n_head, self.n_rot
        nope, kvl = self.head_dim - r, self.W(p + "attn_kv_a_norm.weight").shape[0]
        q = self.lin(p + "attn_q", h) if self.has(p + "attn_q.weight") else \
            self.lin(p + "attn_q_b", self.norm(p + "attn_q_a_norm", self.lin(p + "attn_q_a", h)))
        q, kv = q.reshape(n, H, -1), self.lin(p + "attn_kv_a_mqa", h)
        table = rope_table(pos, r, self.base, self.yarn)
        c, k_pe = self.norm(p + "attn_kv_a_norm", kv[:, :kvl]), rope(kv[:, None, kvl:], table, False)
        if kv_f16:
            c, k_pe = f16(c), f16(k_pe)
        k = np.concatenate([np.einsum("hcd,jc->jhd", self.W(p + "attn_k_b.weight"), c),
                            np.broadcast_to(k_pe, (n, H, r))], -1)
        v = np.einsum("hvc,jc->jhv", self.W(p + "attn_v_b.weight"), c)
        q = np.concatenate([q[..., :nope], rope(q[..., nope:], table, False)], -1)
        o = attention(q, k, v, pos, self.kq_mscale ** 2 / np.sqrt(self.head_dim))
        return self.lin(p + "attn_output", o)

    # ---- feed-forward -------------------------------------------------------------------
    def ffn(self, p, h, act):
        return self.lin(p + "ffn_down", act(self.lin(p + "ffn_gate", h), self.lin(p + "ffn_up", h)))

    def route(self, p, h):
        """build_moe_ffn's selection: gated probs, + exp_probs_b for the choice only, best groups
        (sum of each group's top 2), top k; weights from the unbiased probs."""
        logits = self.lin(p + "ffn_gate_inp", h)
        probs = {SOFTMAX: softmax, SIGMOID: lambda z: 1 / (1 + np.exp(-z))}.get(self.gating, lambda z: z)(logits)
        score = probs + (self.W(p + "exp_probs_b.bias") if self.has(p + "exp_probs_b.bias") else 0)
        if self.groups > 1:
            grouped = score.reshape(len(h), self.groups, -1)
            top2 = np.sort(grouped, -1)[..., -2:].sum(-1)
            lost = np.argsort(-top2, -1, kind="stable")[:, self.groups_used:]
            np.put_along_axis(grouped, lost[..., None], -np.inf, 1)
            score = grouped.reshape(len(h), -1)
        sel = np.argsort(-score, -1, kind="stable")[:, : self.n_used]
        w = np.take_along_axis(probs, sel, -1)
        if self.gating == SOFTMAX_WEIGHT:
            w = softmax(w)
        if self.norm_w:
            w = w / np.maximum(w.sum(-1, keepdims=True), 6.103515625e-5)
        return sel, w * (self.w_scale if self.w_scale not in (0.0, 1.0) else 1.0)

    def moe(self, p, h):
        sel, w = self.route(p, h)
        act = swiglu_oai if self.arch == "gpt-oss" else silu
        out = np.zeros_like(h)
        for e in np.unique(sel):
            rows, slot = np.nonzero(sel == e)
            y = [h[rows] @ self.W(p + f"ffn_{t}_exps.weight")[e].T
                 + (self.W(p + f"ffn_{t}_exps.bias")[e] if self.has(p + f"ffn_{t}_exps.bias") else 0)
                 for t in ("gate", "up")]
            y = act(*y) @ self.W(p + "ffn_down_exps.weight")[e].T
            y += self.W(p + "ffn_down_exps.bias")[e] if self.has(p + "ffn_down_exps.bias") else 0
            out[rows] += w[rows, slot, None] * y
        if self.has(p + "ffn_gate_shexp.weight"):
            sh = self.lin(p + "ffn_down_shexp", silu(self.lin(p + "ffn_gate_shexp", h), self.lin(p + "ffn_up_shexp", h)))
            if self.has(p + "ffn_gate_inp_shexp.weight"):  # qwen2moe: sigmoid-gated
                sh *= 1 / (1 + np.exp(-(h @ self.W(p + "ffn_gate_inp_shexp.weight"))))[:, None]
            out += sh
        return out

    # ---- the model ----------------------------------------------------------------------
    def logits(self, ids, positions=None, last_only=False, kv_f16=False, eps=0.0, rng=None):
        """Logits [len(ids), vocab] (or of the last position) for one causal sequence."""
        x = self.hidden(ids, positions, last_only, kv_f16, eps, rng)
        lg = x @ self.W("output.weight" if self.has("output.weight") else "token_embd.weight").astype(np.float64).T
        return lg[0] if last_only else lg

    def hidden(self, ids, positions=None, last_only=False, kv_f16=False, eps=0.0, rng=None):
        """The final hidden states [len(ids), n_embd] (or [1, n_embd]: the last position's), after
        the output norm: what the head multiplies and what embeddings pool."""
        pos = np.arange(len(ids)) if positions is None else np.asarray(positions)
        gemma = self.arch == "gemma3"
        x = self.W("token_embd.weight")[ids].astype(np.float64) * (np.sqrt(self.n_embd) if gemma else 1)
        for il in range(self.n_layer):
            p = f"blk.{il}."
            h = self.norm(p + "attn_norm", x)
            a = self.mla(p, h, pos, kv_f16) if self.arch == "deepseek2" else self.attn(p, h, pos, il, kv_f16)
            x = x + (self.norm(p + "post_attention_norm", a) if gemma else a)
            # the FFN's input norm: ffn_norm, or post_attention_norm where that names it (gpt-oss, glm4moe)
            h = self.norm(p + ("ffn_norm" if self.has(p + "ffn_norm.weight") else "post_attention_norm"), x)
            f = self.moe(p, h) if self.has(p + "ffn_gate_inp.weight") else self.ffn(p, h, gelu if gemma else silu)
            x = x + (self.norm(p + "post_ffw_norm", f) if gemma else f)
            if eps:
                x = x * (1 + eps * rng.standard_normal(x.shape))
        return self.norm("output_norm", x[-1:] if last_only else x)


@functools.lru_cache(maxsize=1)
def float_model(path):
    """The FloatModel of one file, kept while the same file is asked for again (its weights are
    dequantized once)."""
    return FloatModel(path)
