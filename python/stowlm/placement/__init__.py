"""Everything that decides where a model's pieces go, and the Placement that records it.

    rules.py          the defaults and checks shared with the engine, and how settings reach the core
    data.py           Placement / DevicePlacement: plain data, JSON files, tables
    budgets.py        each device's room (free memory less its margin), what is short, FitError
    costs.py          the bytes of each piece of the model; the model's fingerprint
    search.py         the shared "largest that fits" searches and the context range
    split.py          cutting a run of layers over devices
    layer_*.py, projection.py, upgrades.py, layers.py, explain.py
                      fit by layers: problem, costs in a layout, search, exact projection,
                      copies and interleave, the placement, and why
    tensor.py         fit by a tensor split (every layer cut over the devices)
    ranks.py          the layers of each device of an MPI job
    decide.py         fit(): settings in, one of the fitters, a Placement out (stowlm.fit is its face)

Nothing here imports stowlm.engine: the engine takes its rules from here.
"""
from .data import FORMAT, PROJECTED_KEYS, DevicePlacement, Placement, format_size
from .rules import SLOT_ALIGN, SPLIT_MODES, check_split_mode, slot_context

__all__ = ["Placement", "DevicePlacement", "SPLIT_MODES", "SLOT_ALIGN", "PROJECTED_KEYS", "FORMAT", "check_split_mode",
           "format_size", "slot_context"]
