"""An independent float64 forward pass of a real GGUF model (llama with or without experts,
qwen2, gemma3), from the file's metadata and dequantized weights: the exact-arithmetic answer
that both stowlm and llama.cpp approximate with 8-bit activations. Slow (numpy), for a few
short sequences: used where the fixtures cannot decide (a near-tied greedy step), and by
bench/moe_sensitivity.py."""
import numpy as np

from stowlm import GGUFFile
from stowlm.quants import dequantize


class FloatModel:
    def __init__(self, path):
        self.file = GGUFFile(path)
        md = self.file.metadata
        self.arch = a = md["general.architecture"]
        if a not in ("llama", "qwen2", "gemma3"):
            raise ValueError(f"{path}: float reference has no {a!r} architecture")
        self.info = {t[0]: t for t in self.file.tensors}
        self.n_embd, self.n_layer = md[f"{a}.embedding_length"], md[f"{a}.block_count"]
        self.n_head, self.n_head_kv = md[f"{a}.attention.head_count"], md[f"{a}.attention.head_count_kv"]
        self.head_dim = md.get(f"{a}.attention.key_length", self.n_embd // self.n_head)
        self.eps = md[f"{a}.attention.layer_norm_rms_epsilon"]
        self.base = md.get(f"{a}.rope.freq_base", 10000.0)
        self.window = md.get(f"{a}.attention.sliding_window", 0)
        self.n_used = md.get(f"{a}.expert_used_count", 0)

    def W(self, name):
        t = self.info[name]
        return dequantize(self.file.tensor_data(name), t[1], t[2]).astype(np.float64)

    def has(self, name):
        return name in self.info

    def rms(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos, base):
        """NeoX halves for qwen2/gemma3, adjacent pairs for llama (as the GGUF converters store q/k)."""
        d = x.shape[-1]
        th = pos[:, None, None] * base ** (-2.0 * np.arange(d // 2) / d)
        c, s = np.cos(th), np.sin(th)
        y = np.empty_like(x)
        if self.arch == "llama":
            a, b, ia, ib = x[..., 0::2], x[..., 1::2], np.s_[..., 0::2], np.s_[..., 1::2]
        else:
            a, b, ia, ib = x[..., : d // 2], x[..., d // 2:], np.s_[..., : d // 2], np.s_[..., d // 2:]
        y[ia], y[ib] = a * c - b * s, a * s + b * c
        return y

    def ffn(self, p, h):
        silu = lambda g: g / (1 + np.exp(-g))  # noqa: E731
        if not self.n_used:
            g, u = h @ self.W(p + "ffn_gate.weight").T, h @ self.W(p + "ffn_up.weight").T
            if self.arch == "gemma3":
                act = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
            else:
                act = silu(g)
            return (act * u) @ self.W(p + "ffn_down.weight").T
        # Mixtral-style experts: softmax over all, top k, renormalised, SiLU-gated.
        logits = h @ self.W(p + "ffn_gate_inp.weight").T
        pr = np.exp(logits - logits.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        ge, ue, de = (self.W(p + f"ffn_{t}_exps.weight") for t in ("gate", "up", "down"))
        out = np.zeros_like(h)
        for t in range(len(h)):
            sel = np.argsort(-pr[t], kind="stable")[: self.n_used]
            for e, we in zip(sel, pr[t, sel] / pr[t, sel].sum()):
                out[t] += we * (de[e] @ (silu(ge[e] @ h[t]) * (ue[e] @ h[t])))
        return out

    def logits(self, ids, last_only=False, eps=0.0, rng=None):
        """Logits [len(ids), vocab] (or of the last position) for one causal sequence. eps > 0
        multiplies the residual stream by (1 + eps * N(0, 1)) after every layer."""
        n, gemma = len(ids), self.arch == "gemma3"
        H, HKV, hd = self.n_head, self.n_head_kv, self.head_dim
        pos = np.arange(n, dtype=np.float64)
        embd = self.W("token_embd.weight")  # also the output matrix where the file ties them
        x = embd[ids]
        if gemma:
            x = x * np.sqrt(self.n_embd)
        for il in range(self.n_layer):
            p = f"blk.{il}."
            swa = gemma and il % 6 < 5
            h = self.rms(x, self.W(p + "attn_norm.weight"))
            q, k, v = (h @ self.W(p + f"attn_{t}.weight").T
                       + (self.W(p + f"attn_{t}.bias") if self.has(p + f"attn_{t}.bias") else 0) for t in "qkv")
            q, k, v = q.reshape(n, H, hd), k.reshape(n, HKV, hd), v.reshape(n, HKV, hd)
            if gemma:
                q, k = self.rms(q, self.W(p + "attn_q_norm.weight")), self.rms(k, self.W(p + "attn_k_norm.weight"))
            base = 10000.0 if swa else self.base
            q, k = self.rope(q, pos, base), self.rope(k, pos, base)
            visible = pos[None, :] <= pos[:, None]
            if swa:
                visible &= (pos[:, None] - pos[None, :]) < self.window
            out = np.zeros((n, H, hd))
            for hh in range(H):
                kh = hh // (H // HKV)
                s = np.where(visible, q[:, hh] @ k[:, kh].T / np.sqrt(hd), -np.inf)
                pr = np.exp(s - s.max(-1, keepdims=True))
                out[:, hh] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kh]
            a = out.reshape(n, H * hd) @ self.W(p + "attn_output.weight").T
            x = x + (self.rms(a, self.W(p + "post_attention_norm.weight")) if gemma else a)
            f = self.ffn(p, self.rms(x, self.W(p + "ffn_norm.weight")))
            x = x + (self.rms(f, self.W(p + "post_ffw_norm.weight")) if gemma else f)
            if eps:
                x = x * (1 + eps * rng.standard_normal(x.shape))
        x = self.rms(x[-1:] if last_only else x, self.W("output_norm.weight"))
        out_w = self.W("output.weight") if self.has("output.weight") else embd
        lg = x @ out_w.T
        return lg[0] if last_only else lg
