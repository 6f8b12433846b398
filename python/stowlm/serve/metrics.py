"""What the server counts, and /metrics: the engine's counters and the server's own (responses by
path and status, time to the first token) in Prometheus's text format."""
from __future__ import annotations

import time
from typing import Dict, Mapping, Optional, Tuple

__all__ = ["Metrics"]


class Metrics:
    def __init__(self):
        self.http: Dict[Tuple[str, int], int] = {}
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.started = time.time()
        self.embed_inputs = self.embed_tokens = 0

    def embedded(self, inputs: int, tokens: int) -> None:
        self.embed_inputs += inputs
        self.embed_tokens += tokens

    def count(self, path: str, status: int) -> None:
        key = (path, status)
        self.http[key] = self.http.get(key, 0) + 1

    def first_token(self, t_start: float) -> None:
        """A request's first token came now (t_start: when the request was submitted)."""
        self.ttft_sum += time.perf_counter() - t_start
        self.ttft_count += 1

    def prometheus(self, st: Optional[Mapping]) -> str:
        """The text of /metrics, from the engine's stats() (None: an embeddings server's, which has
        no engine) and these counts."""
        lines = []

        def metric(name, kind, help_, value, labels=""):
            lines.append(f"# HELP stowlm_{name} {help_}")
            lines.append(f"# TYPE stowlm_{name} {kind}")
            lines.append(f"stowlm_{name}{labels} {value}")

        if st is None:
            metric("embedding_inputs_total", "counter", "Inputs embedded.", self.embed_inputs)
            metric("embedding_tokens_total", "counter", "Tokens of the inputs embedded.", self.embed_tokens)
            return self._http(lines)

        metric("requests_total", "counter", "Generation requests accepted by the engine.", st["requests_total"])
        metric("prompt_tokens_total", "counter", "Prompt tokens of accepted requests (tokens in).",
               st["prompt_tokens_total"])
        metric("prompt_tokens_evaluated_total", "counter", "Prompt tokens evaluated (less than tokens in by what "
               "cached prefixes saved).", st["prompt_tokens_evaluated"])
        metric("completion_tokens_total", "counter", "Generated tokens (tokens out).", st["completion_tokens_total"])
        metric("draft_tokens_total", "counter", "Speculative draft tokens checked.", st["drafted_total"])
        metric("draft_tokens_accepted_total", "counter", "Speculative draft tokens kept.", st["accepted_total"])
        metric("tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.",
               f"{st['tokens_per_second']:.3f}")
        metric("queue_length", "gauge", "Requests waiting for a slot.", st["queue_length"])
        metric("slots_busy", "gauge", "Slots generating or evaluating a prompt.", st["slots_busy"])
        metric("slots", "gauge", "Slots (sequences served at once).", st["slots"])
        metric("kv_cells_used", "gauge", "KV cache cells in use, every slot.", st["kv_cells_used"])
        metric("kv_cells", "gauge", "KV cache cells.", st["kv_cells"])
        metric("time_to_first_token_seconds_sum", "counter", "Sum of times to the first token.",
               f"{self.ttft_sum:.6f}")
        metric("time_to_first_token_seconds_count", "counter", "Requests with a first token.", self.ttft_count)
        return self._http(lines)

    def _http(self, lines) -> str:
        lines.append("# HELP stowlm_http_responses_total HTTP responses by path and status.")
        lines.append("# TYPE stowlm_http_responses_total counter")
        for (path, status), n in sorted(self.http.items()):
            lines.append(f'stowlm_http_responses_total{{path="{path}",status="{status}"}} {n}')
        return "\n".join(lines) + "\n"
