"""What a job's setup decided, for people: the table of ranks, devices, layers and bytes, and the
reasons behind it."""
from __future__ import annotations

from typing import List

from ..placement.data import format_size
from .stages import Setup


def layer_ranges(split: List[int]) -> List[str]:
    out, start = [], 0
    for n in split:
        out.append(f"{start}-{start + n - 1}" if n else "-")
        start += n
    return out


def table(s: Setup) -> str:
    """Per rank: its host, devices, layers and bytes (the core's projection)."""
    rows = [("rank", "host", "device", "layers", "weights", "KV", "compute", "total", "room", "free")]
    for d, spec, layers in zip(s.described, s.devices, layer_ranges(s.layer_split)):
        p = d.get("projected") or {}
        rows.append((str(d["rank"]), d["host"], spec.name, layers, format_size(p.get("weights", 0)),
                     format_size(p.get("kv", 0)), format_size(p.get("compute", 0)), format_size(p.get("total", 0)),
                     format_size(d.get("room", 0)), format_size(d["free"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    hosts = sorted(set(d["host"] for d in s.described))
    lines.append(f"mpi: {len(set(d['rank'] for d in s.described))} ranks on {len(hosts)} host(s) "
                 f"({', '.join(hosts)}); n_ctx {s.n_ctx}; layers " + "; ".join(f"{spec.name} {r}" for spec, r in
                                                              zip(s.devices, layer_ranges(s.layer_split))))
    return "\n".join(lines)


def explain(s: Setup) -> List[str]:
    out = []
    for d, spec in zip(s.described, s.devices):
        out.append(f"{spec.name} (rank {d['rank']} on {d['host']}): {format_size(d['free'])} free ({d['source']}), "
                   f"{format_size(d.get('share', d['free']))} its share, margin {format_size(d.get('margin', 0))}")
    out += s.decisions
    out.append("the output head stays with the last layer; the input embedding goes with the first layer, or with "
               "the output head when the two are tied")
    return out
