"""A Placement: what fit decided, as plain data that loads exactly as it says.

Per device (in pipeline order: layers flow from the first to the last) its layer ranges (one,
or `interleave` of them taking turns with the other devices'), the tensor overrides that put
weights there, its free memory and margin, and the bytes the core projects for it; for the
whole model n_ctx, n_ubatch, n_outputs, kv_type and the override list in the order it is
applied. ``to_json()`` / ``from_json()`` round-trip it;
``stowlm.Model(path, placement=...)``, ``stowlm.LLM(..., placement=...)`` and
``stowlm run --placement FILE`` load it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..devices import DeviceSpec, parse_device, parse_devices
from .rules import DEFAULT_KV_TYPE, DEFAULT_MOE_OFFLOAD_MIN, DEFAULT_N_COPIES, check_split_mode, layer_devices
from .split import describe_layers, describe_runs

PROJECTED_KEYS = ("weights", "kv", "compute", "copies", "total")
FORMAT = "stowlm-placement/1"


@dataclass
class DevicePlacement:
    spec: str                                # "cpu:1[threads=1,mem=64MiB]"
    layers: List[Tuple[int, int]]            # (first, last) inclusive, in order; []: no layers
    expert_layers: List[int] = field(default_factory=list)  # layers whose experts live here
    overrides: List[str] = field(default_factory=list)      # regexes that put weights here
    free: int = 0
    margin: int = 0
    projected: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(PROJECTED_KEYS, 0))
    allocated: Optional[int] = None          # filled by a verified load (stowlm fit --verify)
    note: str = ""                           # why it is left out, when it is
    # tensor split: {"share": fraction, kind: (this device's, the model's)} for q_heads,
    # kv_heads, ffn_rows, experts, shexp_rows (summed over layers) and vocab
    shard: Optional[Dict[str, object]] = None

    @property
    def name(self) -> str:
        return self.device.name

    @property
    def device(self) -> DeviceSpec:
        return parse_device(self.spec)

    def __post_init__(self):
        self.layers = [tuple(r) for r in self.layers or []]

    @property
    def n_layers(self) -> int:
        return sum(last - first + 1 for first, last in self.layers)

    def holds(self, layer: int) -> bool:
        return any(first <= layer <= last for first, last in self.layers)

    def describe_layers(self) -> str:
        return describe_runs(self.layers)

    @property
    def used(self) -> bool:
        """Holds anything (layers or weights placed by override): the model loads onto it."""
        return self.projected["total"] > 0 or self.n_layers > 0 or bool(self.overrides)

    def to_dict(self) -> dict:
        d = {"name": self.name, "spec": self.spec, "layers": [list(r) for r in self.layers] or None,
             "expert_layers": list(self.expert_layers), "overrides": list(self.overrides), "free": self.free,
             "margin": self.margin, "projected": dict(self.projected)}
        if self.allocated is not None:
            d["allocated"] = self.allocated
        if self.note:
            d["note"] = self.note
        if self.shard is not None:
            d["shard"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.shard.items()}
        return d


@dataclass
class Placement:
    model: Dict[str, object]     # path, arch, n_layer, fingerprint (which file it was made for)
    n_ctx: int
    n_ubatch: int
    n_outputs: int
    kv_type: str
    devices: List[DevicePlacement]
    tensor_overrides: List[str] = field(default_factory=list)  # "REGEX=DEVICE", first match wins
    decisions: List[str] = field(default_factory=list)         # what fit decided and why
    host: Optional[Dict[str, int]] = None  # CPU devices share the host's RAM: free, margin, projected
    n_copies: int = DEFAULT_N_COPIES       # asked for: copies of the tensors that cross devices
    n_seq: int = 1                         # sequences (server slots) sharing the context
    pipeline: Optional[Dict[str, object]] = None  # what the core makes of it: n_copies, reason (off)
    split_mode: str = "layer"              # "tensor"/"tensor-sum": every layer cut over the used devices
    tensor_split: Optional[List[float]] = None  # tensor mode: share per used device
    interleave: int = 1                    # layer ranges per device, the devices taking turns
    moe_offload_min: int = DEFAULT_MOE_OFFLOAD_MIN  # micro-batches that run RAM-resident experts on the GPU

    # -- what the engine is given ------------------------------------------------------------
    @property
    def used_devices(self) -> List[DevicePlacement]:
        return [d for d in self.devices if d.used]

    @property
    def device_specs(self) -> List[DeviceSpec]:
        return [d.device for d in self.used_devices]

    @property
    def layer_split(self) -> List[int]:
        return [d.n_layers for d in self.used_devices]

    def device_difference(self, devices) -> str:
        """How a device list (as fit takes it) differs from the placement's devices, in any order;
        "" when it names the same devices with the same options."""
        mine = {d.name: d.device for d in self.devices}
        given = {d.name: d for d in parse_devices(devices)}
        out = [f"{given[n]} is not one of its devices" for n in given if n not in mine]
        out += [f"its {n} is {mine[n]}, not {given[n]}" for n in given if n in mine and mine[n] != given[n]]
        out += [f"its {mine[n]} is not in the list" for n in mine if n not in given]
        return "; ".join(out)

    # -- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {"format": FORMAT, "model": dict(self.model), "n_ctx": self.n_ctx, "n_ubatch": self.n_ubatch,
             "n_outputs": self.n_outputs, "kv_type": self.kv_type, "n_copies": self.n_copies, "n_seq": self.n_seq,
             "split_mode": self.split_mode, "interleave": self.interleave, "moe_offload_min": self.moe_offload_min,
             "tensor_overrides": list(self.tensor_overrides),
             "devices": [dev.to_dict() for dev in self.devices], "decisions": list(self.decisions)}
        if self.tensor_split is not None:
            d["tensor_split"] = list(self.tensor_split)
        if self.host is not None:
            d["host"] = dict(self.host)
        if self.pipeline is not None:
            d["pipeline"] = dict(self.pipeline)
        return d

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path) -> None:
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def from_json(cls, text: str, source: str = "placement") -> "Placement":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}: not valid JSON ({e})") from None
        return cls.from_dict(data, source)

    @classmethod
    def load(cls, path) -> "Placement":
        path = os.fspath(path)
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"placement file {path!r} cannot be read: {e.strerror}") from None
        return cls.from_json(text, source=path)

    @classmethod
    def from_dict(cls, data, source: str = "placement") -> "Placement":
        return cls(**_fields(data, source))

    # -- for people -------------------------------------------------------------------------------
    def table(self) -> str:
        if self.split_mode != "layer":
            return self._tensor_table()
        head = ["device", "layers", "expert layers", "weights", "KV", "compute", "copies", "total", "free after",
                "margin"]
        rows = []
        for d in self.devices:
            p = d.projected
            layers = d.describe_layers() or "-"
            experts = describe_layers(d.expert_layers) if d.expert_layers else "-"
            if not d.used:
                rows.append([d.name, "left out", "-", "-", "-", "-", "-", "-", format_size(d.free), format_size(d.margin)])
                continue
            row = [d.name, layers, experts] + [format_size(p[k]) for k in PROJECTED_KEYS] + \
                  [format_size(d.free - p["total"]), format_size(d.margin)]
            rows.append(row + _allocated(d))
        return _render(head, rows, 3) + "\n" + self.summary()

    def _tensor_table(self) -> str:
        """Each device's share of every kind of tensor and of the KV cache, and its bytes. "out rows":
        the rows of n_embd the output projections give (split_mode="tensor"; "-" when the partial
        products are summed instead)."""
        head = ["device", "share", "heads", "KV heads", "FFN rows", "experts", "out rows", "vocab", "weights", "KV",
                "compute", "total", "free after", "margin"]
        kv_all = sum(d.projected["kv"] for d in self.devices) or 1
        rows = []

        def pct(part):
            mine, whole = part
            return f"{mine / whole:.0%}" if whole else "-"

        for d in self.devices:
            if d.shard is None:
                rows.append([d.name, "left out"] + ["-"] * 10 + [format_size(d.free), format_size(d.margin)])
                continue
            s, p = d.shard, d.projected
            row = [d.name, f"{s['share']:.1%}", pct(s["q_heads"]), f"{p['kv'] / kv_all:.0%}" if s["kv_heads"][1] else "-",
                   pct(s["ffn_rows"]), pct(s.get("expert_rows", s["experts"])), pct(s.get("embd_rows", (0, 0))),
                   pct(s["vocab"])] + \
                  [format_size(p[k]) for k in ("weights", "kv", "compute", "total")] + \
                  [format_size(d.free - p["total"]), format_size(d.margin)]
            rows.append(row + _allocated(d))
        return _render(head, rows, 1) + "\n" + self.summary()

    def summary(self) -> str:
        if self.split_mode != "layer":
            used = [d for d in self.devices if d.shard is not None]
            total = sum(d.projected["total"] for d in used)
            return (f"fit: n_ctx {self.n_ctx}, {'tensor split' if self.split_mode == 'tensor' else 'tensor-sum split'} " +
                    ":".join(f"{d.shard['share']:.0%}" for d in used) + " over " + ", ".join(d.name for d in used) +
                    f"; {format_size(total)} in all")
        parts = []
        for d in self.used_devices:
            what = f"layers {d.describe_layers()}" if d.layers else "no layers"
            spilled = [x for x in d.expert_layers if not d.holds(x)]
            if spilled:
                what += f" + experts of {describe_layers(spilled)}"
            parts.append(f"{d.name} {what}")
        used = sum(d.projected["total"] for d in self.used_devices)
        # CPU devices without a budget all draw on the host's RAM: count it once.
        host = [d for d in self.used_devices if d.device.kind == "cpu" and not d.device.mem_bytes]
        free = sum(d.free for d in self.used_devices if d not in host) + (max(d.free for d in host) if host else 0)
        pipe = ""
        if self.pipeline is not None and len(self.used_devices) > 1:
            pipe = (f"; pipelined ({self.pipeline['n_copies']} copies)" if self.pipeline["n_copies"] > 1
                    else "; not pipelined")
        return (f"fit: n_ctx {self.n_ctx}, " + "; ".join(parts) +
                f"; {format_size(used)} of {format_size(free)} free" + pipe)

    def explain(self) -> str:
        return "\n".join("- " + d for d in self.decisions)

    def __str__(self) -> str:
        return self.table()


def format_size(n: int) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{sign}{n / size:.1f} {unit}"
    return f"{sign}{n} B"


def _fields(data, source: str) -> dict:
    """The fields of a Placement from the dict of its JSON file, each checked (errors name the file
    and the field)."""
    r = _Reader(source)
    r.dict(data, "the placement")
    if data.get("format", FORMAT) != FORMAT:
        raise ValueError(f"{source}: format {data.get('format')!r} is not {FORMAT!r}")
    model = r.dict(data.get("model"), "model")
    for key in ("arch", "fingerprint"):
        r.str(model.get(key), f"model.{key}")
    r.int(model.get("n_layer"), "model.n_layer", 1)
    check_split_mode(data.get("split_mode", "layer"), f"{source}: split_mode")
    items = r.list(data.get("devices"), "devices")
    if not items:
        raise ValueError(f"{source}: devices is empty")
    devices = [_device(r, dd, f"devices[{i}]", source) for i, dd in enumerate(items)]
    names = [d.name for d in devices]
    for n in names:
        if names.count(n) > 1:
            raise ValueError(f"{source}: device {n} appears more than once")
    # The ranges must be exactly those the core makes of the counts and the interleave.
    split_mode = r.str(data.get("split_mode", "layer"), "split_mode")
    interleave = r.int(data.get("interleave", 1), "interleave", 1)
    if split_mode == "layer":
        counts = [d.n_layers for d in devices]
        if sum(counts) != model["n_layer"]:
            raise ValueError(f"{source}: the layer ranges cover {sum(counts)} layers, model.n_layer is "
                             f"{model['n_layer']}")
        owner = {l: i for i, d in enumerate(devices) for first, last in d.layers for l in range(first, last + 1)}
        used = [i for i, c in enumerate(counts) if c]
        want, v = layer_devices([counts[i] for i in used], interleave)
        if v != interleave or [owner.get(l) for l in range(model["n_layer"])] != [used[i] for i in want]:
            raise ValueError(f"{source}: the devices' layer ranges are not those of their counts {counts} with "
                             f"interleave {interleave} (in device order, each device's layers in {interleave} "
                             "chunks, the devices taking turns)")
    elif any(d.layers for d in devices):
        raise ValueError(f"{source}: a tensor split gives no device layer ranges")
    overrides = [r.str(x, "tensor_overrides[]") for x in r.list(data.get("tensor_overrides", []),
                                                                "tensor_overrides")]
    for o in overrides:
        pattern, sep, dev = o.rpartition("=")
        if not sep or not pattern or dev not in names:
            raise ValueError(f"{source}: tensor_overrides entry {o!r} is not REGEX=DEVICE with a device "
                             f"of the placement ({', '.join(names)})")
    n_ubatch = r.int(data.get("n_ubatch"), "n_ubatch", 1)
    host = data.get("host")
    if host is not None:
        r.dict(host, "host")
        host = {k: r.int(v, f"host.{k}", 0) for k, v in host.items()}
    tensor_split = data.get("tensor_split")
    if tensor_split is not None:
        tensor_split = [float(x) for x in r.list(tensor_split, "tensor_split")]
    pipeline = data.get("pipeline")
    if pipeline is not None:
        r.dict(pipeline, "pipeline")
        pipeline = {"n_copies": r.int(pipeline.get("n_copies"), "pipeline.n_copies", 1),
                    "reason": r.str(pipeline.get("reason", ""), "pipeline.reason", allow_empty=True)}
    return dict(model=dict(model), n_ctx=r.int(data.get("n_ctx"), "n_ctx", 1), n_ubatch=n_ubatch,
                n_outputs=r.int(data.get("n_outputs", n_ubatch), "n_outputs", 1),
                kv_type=r.str(data.get("kv_type", DEFAULT_KV_TYPE), "kv_type"), devices=devices,
                tensor_overrides=overrides,
                decisions=[r.str(x, "decisions[]", allow_empty=True) for x in r.list(data.get("decisions", []),
                                                                                   "decisions")],
                host=host, n_copies=r.int(data.get("n_copies", DEFAULT_N_COPIES), "n_copies", 1),
                n_seq=r.int(data.get("n_seq", 1), "n_seq", 1), pipeline=pipeline,
                split_mode=split_mode, tensor_split=tensor_split, interleave=interleave,
                moe_offload_min=r.int(data.get("moe_offload_min", DEFAULT_MOE_OFFLOAD_MIN), "moe_offload_min", 0))


def _device(r: "_Reader", dd, where: str, source: str) -> DevicePlacement:
    """One entry of the file's devices."""
    r.dict(dd, where)
    spec = r.str(dd.get("spec", dd.get("name")), f"{where}.spec")
    try:
        dev = parse_device(spec)
    except ValueError as e:
        raise ValueError(f"{source}: {where}.spec: {e}") from None
    if "name" in dd and dd["name"] != dev.name:
        raise ValueError(f"{source}: {where}.name {dd['name']!r} does not match its spec {spec!r}")
    layers = dd.get("layers") or []
    r.list(layers, f"{where}.layers")
    one = len(layers) == 2 and not isinstance(layers[0], list)  # [first, last], as before interleaving
    ranges = []
    for j, rng in enumerate([layers] if one else layers):
        if not isinstance(rng, list) or len(rng) != 2:
            raise ValueError(f"{source}: {where}.layers must be a list of [first, last] ranges or null, "
                             f"got {dd.get('layers')!r}")
        at = f"{where}.layers" + ("" if one else f"[{j}]")
        first = r.int(rng[0], f"{at}[0]", 0)
        ranges.append((first, r.int(rng[1], f"{at}[1]", first)))
    layers = ranges
    projected = r.dict(dd.get("projected", {}), f"{where}.projected")
    proj = {k: r.int(projected.get(k, 0), f"{where}.projected.{k}", 0) for k in PROJECTED_KEYS}
    return DevicePlacement(
        spec=str(dev), layers=layers,
        expert_layers=[r.int(x, f"{where}.expert_layers[]", 0)
                       for x in r.list(dd.get("expert_layers", []), f"{where}.expert_layers")],
        overrides=[r.str(x, f"{where}.overrides[]") for x in r.list(dd.get("overrides", []),
                                                                    f"{where}.overrides")],
        free=r.int(dd.get("free", 0), f"{where}.free", 0),
        margin=r.int(dd.get("margin", 0), f"{where}.margin", 0), projected=proj,
        allocated=None if dd.get("allocated") is None else r.int(dd["allocated"], f"{where}.allocated", 0),
        note=r.str(dd.get("note", ""), f"{where}.note", allow_empty=True),
        shard=_shard(dd.get("shard"), where))


class _Reader:
    """Type checks for fields of a placement file, each error naming the file and the field."""

    def __init__(self, source: str):
        self.source = source

    def _bad(self, what: str, expected: str, value) -> ValueError:
        return ValueError(f"{self.source}: {what} must be {expected}, got {value!r}")

    def dict(self, v, what):
        if not isinstance(v, dict):
            raise self._bad(what, "an object", v)
        return v

    def list(self, v, what):
        if not isinstance(v, list):
            raise self._bad(what, "a list", v)
        return v

    def str(self, v, what, allow_empty=False):
        if not isinstance(v, str) or (not v and not allow_empty):
            raise self._bad(what, "a non-empty string" if not allow_empty else "a string", v)
        return v

    def int(self, v, what, minimum=None):
        if isinstance(v, bool) or not isinstance(v, int) or (minimum is not None and v < minimum):
            raise self._bad(what, "an integer" + (f" >= {minimum}" if minimum is not None else ""), v)
        return v


def _shard(data, where: str) -> Optional[Dict[str, object]]:
    if data is None:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("share"), (int, float)):
        raise ValueError(f"{where}.shard must be an object with a share")
    out: Dict[str, object] = {"share": float(data["share"])}
    for k, v in data.items():
        if k == "share":
            continue
        if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v)):
            raise ValueError(f"{where}.shard.{k} must be [this device's, the model's]")
        out[k] = (v[0], v[1])
    return out


def _allocated(d: DevicePlacement) -> List[str]:
    """The table's last cell after a verified load: what the device allocated against the projection."""
    if d.allocated is None:
        return []
    total = d.projected["total"]
    return ["allocated " + format_size(d.allocated) + (" (= projected)" if d.allocated == total
                                                       else " (projected " + format_size(total) + ")")]


def _render(head: List[str], rows: List[list], left: int) -> str:
    """Columns padded to their widest cell, the first `left` left-aligned; a row's extra cell trails."""
    width = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(width[i]) if i < left else str(c).rjust(width[i])
                               for i, c in enumerate(r[:len(head)])) + ("  " + r[len(head)] if len(r) > len(head) else "")
                     for r in [head] + rows)
