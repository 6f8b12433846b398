"""Fit: decide what goes where, from the core's exact byte projections, before anything loads.

    placement = stowlm.fit.fit("model.gguf", devices=["cuda:0", "cuda:1", "cpu"])
    print(placement.table()); print(placement.explain())
    model = stowlm.Model("model.gguf", placement=placement)

What fit may decide, in this order, and only where the user did not set it:

1. The context. From the model's training context (capped at ``max_ctx``, default 131072) down in
   steps of 256 to ``fit_ctx`` (default 4096), the largest with which every layer, with its KV
   cache, fits on the devices faster than the slowest kind; below that floor nothing is reduced
   and the weights move instead.
2. Dense weights first on the fastest memory: devices are filled in tiers, GPU memory first, then
   CPU devices with a budget (virtual devices), then the host's RAM (a CPU device without one).
   Experts of mixture-of-experts layers spill first, whole layers at a time, to the spill device
   (the last device of the slowest tier, i.e. the host's RAM when it is listed); then whole
   layers. The output head stays on the last device with layers; an untied input embedding goes
   to the spill device (only the prompt's rows of it are read).
3. The layer split inside a tier: contiguous ranges, each device at most what its free memory
   less its margin holds (weights + the KV of its own layers + its own compute buffer, which
   depends on its layers and on whether it holds the output), the stages balanced by speed (a
   CPU device's threads). A device too small for one layer plus its buffers is left out. Then
   each device's layers in `interleave` ranges that take turns (shorter pipeline stages), if
   the exact projection of that fits too.

Free memory: a virtual device's budget; a CUDA device's free memory (``cudaMemGetInfo``, capped by
its ``mem`` budget); for a CPU device without a budget the host's available RAM (MemAvailable).
Weights on a CPU device are read in place from the mapped file: they count in full against that
device and against the host, because every page of them is read for each token. All CPU devices
together must also fit the host's available RAM less its margin.

Margin: what stays free on each device, by default min(1 GiB, the device's memory / 16): 1 GiB
on an 80 GB GPU or a 24 GiB host, 4 MiB on a 64 MiB virtual device.

The code is in stowlm.placement (decide.py, layers.py, tensor.py and what they share); this module
is its public face.

Every byte count comes from the native planner (the same code that allocates), so a placement
fit accepts allocates exactly what it projects. The search itself works on exact per-layer
weight and KV bytes from the core plus compute-buffer sizes learnt from the projections it
has made, and the answer is always checked by a full projection (a handful per fit).
"""
from __future__ import annotations

from .placement.budgets import (MARGIN_DIVISOR, MARGIN_MAX, FitError, default_margin, fits_one_device,
                                host_available_bytes, physical_ram_bytes)
from .placement.costs import EXPERT_NAME, fingerprint
from .placement.data import Placement
from .placement.decide import fit
from .placement.rules import (CTX_STEP, DEFAULT_FIT_CTX, DEFAULT_MAX_CTX, DEFAULT_N_OUTPUTS, DEFAULT_N_UBATCH,
                              slot_context)
from .placement.search import largest_fitting

__all__ = ["fit", "FitError", "Placement", "default_margin", "DEFAULT_MAX_CTX", "DEFAULT_FIT_CTX", "CTX_STEP",
           "DEFAULT_N_UBATCH", "DEFAULT_N_OUTPUTS", "MARGIN_MAX", "MARGIN_DIVISOR", "EXPERT_NAME", "fingerprint",
           "fits_one_device", "host_available_bytes", "physical_ram_bytes", "largest_fitting", "slot_context"]
