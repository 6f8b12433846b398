"""Device specs and virtual CPU devices with hard memory budgets."""
import os
import subprocess
import sys

import pytest

import stowlm

from conftest import subprocess_env
from stowlm.devices import DeviceSpec, parse_bytes, parse_device, parse_devices


def test_parse_plain_and_indexed():
    assert parse_device("cpu") == DeviceSpec("cpu", 0, 0, 0)
    assert parse_device("cpu:3") == DeviceSpec("cpu", 3, 0, 0)
    assert parse_device(" CPU:1 ") == DeviceSpec("cpu", 1, 0, 0)


def test_parse_options():
    d = parse_device("cpu:0[threads=1,mem=512MiB]")
    assert d == DeviceSpec("cpu", 0, 1, 512 * 1024 * 1024)
    assert parse_device("cpu:2[mem=1.5GiB]").mem_bytes == int(1.5 * (1 << 30))
    assert parse_device("cpu[ threads = 4 ]").threads == 4
    assert str(d) == "cpu:0[threads=1,mem=512MiB]"
    assert parse_device(str(d)) == d
    s = parse_device("cpu:1[threads=2,speed=1.5]")
    assert s.speed == 1.5 and s.as_tuple() == ("cpu", 1, 2, 0, -1) and parse_device(str(s)) == s
    for bad in ("cpu[speed=0]", "cpu[speed=-1]", "cpu[speed=fast]", "cpu[speed=inf]"):
        with pytest.raises(ValueError, match="speed must be a positive number"):
            parse_device(bad)


@pytest.mark.parametrize("text,unit", [("1000", 1), ("2k", 1024), ("3MB", 1000**2), ("4GiB", 1 << 30)])
def test_parse_bytes(text, unit):
    assert parse_bytes(text) == int(text.rstrip("kKMGBi")) * unit


@pytest.mark.parametrize("bad,needle", [
    ("gpu:0", "unknown kind"),
    ("cpu:0[threads=0]", "threads"),
    ("cpu:0[threads=x]", "threads"),
    ("cpu:0[mem=lots]", "memory size"),
    ("cpu:0[color=red]", "unknown option 'color'"),
    ("cpu:0[mem]", "key=value"),
    ("cpu:-1", "cannot parse device"),
])
def test_bad_specs_name_the_problem(bad, needle):
    with pytest.raises(ValueError, match=needle):
        parse_device(bad)


def test_device_lists():
    specs = parse_devices("cpu:0[threads=1,mem=1GiB],cpu:1[threads=1,mem=2GiB]")
    assert [s.name for s in specs] == ["cpu:0", "cpu:1"]
    assert [s.mem_bytes for s in specs] == [1 << 30, 2 << 30]
    assert parse_devices(None) == [DeviceSpec()]
    assert parse_devices("auto")[-1] == DeviceSpec()  # every CUDA device (none here), then the CPU
    assert parse_devices(["cpu:0", DeviceSpec("cpu", 1)])[1].index == 1
    with pytest.raises(ValueError, match="more than once"):
        parse_devices(["cpu:0", "cpu:0[mem=1GiB]"])
    with pytest.raises(ValueError, match="empty"):
        parse_devices([])


def test_virtual_device_refuses_past_budget(model_path):
    """A weight share larger than the budget fails naming the device and both byte counts."""
    import stowlm
    from stowlm.engine import plan

    path = model_path("smollm2-135m")
    need = plan(path, ["cpu:0", "cpu:1"], n_ctx=64, n_ubatch=8)
    w1 = need[1]["weights"]
    budget = w1 - 4096
    with pytest.raises(MemoryError) as e:
        stowlm.Model(path, devices=["cpu:0", f"cpu:1[threads=1,mem={budget}]"])
    msg = str(e.value)
    assert "cpu:1" in msg and str(w1) in msg and str(budget) in msg, msg
    # Exactly enough is enough.
    m = stowlm.Model(path, devices=["cpu:0", f"cpu:1[threads=1,mem={w1}]"])
    assert m._m.device_used() == [need[0]["weights"], w1]


def test_cuda_device_without_a_gpu_is_a_clear_error(model_path):
    from stowlm import devices

    found, why = devices.cuda_devices()
    if found:
        pytest.skip(f"this machine has CUDA devices: {[d['name'] for d in found]}")
    assert [d["kind"] for d in devices.list_devices()] == ["cpu"]
    with pytest.raises(RuntimeError, match="no CUDA device is present"):
        stowlm.Model(model_path("smollm2-135m"), devices=["cuda:0"])
    # the process stays usable
    assert stowlm.Model(model_path("smollm2-135m"), devices=["cpu:0[threads=1]"]).n_layer == 30


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_default_threads_follow_the_cores_the_process_may_use():
    """A process bound to one core (taskset, a cpuset, mpirun's binding) runs one thread, not one
    per core of the machine."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); from stowlm import _core, devices; "
            "print(_core.engine.default_threads(), devices.list_devices()[0]['threads'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                         timeout=60, check=True).stdout.split()
    assert out == ["1", "1"]
