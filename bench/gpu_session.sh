#!/usr/bin/env bash
# The one prepared script a session with a GPU machine runs there (issue 26): the CUDA tests and
# stowlm against llama.cpp's CUDA build on the same GPU, logs and figures into $OUT, within ~8
# minutes (SESSION_SECONDS, default 480; every step runs under `timeout`).
#
#   bash bench/gpu_session.sh            # on the GPU machine, the last device call
#   bash bench/gpu_session.sh --no-gpu   # here: every step that needs no GPU (tests/test_gpu_session.py)
#
# What it does: prints nvidia-smi, the CPU (model name, amx_int8), Python and nvcc; moves the
# carried files out of .carry/ and joins the models (bench/carry_models.py --receive, --assemble);
# installs the carried gguf wheel (the tests' oracles and the model tools need it; the image has
# none); checks cuBLAS (llama.cpp's CUDA backend needs libcublas.so.13); installs the carried
# prebuilt extension and stowlm-bench when they were built from this tree's sources for this
# Python, else builds them (sm_90 only, ~minutes of device time); writes the MoE and architecture
# test models from smollm2 with the carried ../shared/tools; runs
#   STOWLM_REQUIRE_GPU=1 pytest tests/test_cuda_ops.py tests/test_cuda_math.py tests/test_cuda_models.py
#       -k "<deselects the cases of models not present>"
# with tests/test_cuda_build.py (nvcc only, no GPU) beside it in the background, then
# bench/gpu_compare.py (3 rounds, pp512/tg128, smollm2-135m, qwen2.5-coder-0.5b and qwen3moe-tiny
# where present, qwen2.5-coder-0.5b otherwise by its shape twin: its carried header, random weights
# written there by bench/shape_twin.py; plus stowlm-bench -v's kernels per token). $OUT gets session.log,
# pytest_gpu.log, pytest_build.log, gpu_compare.md and gpu_compare.json (5 of the 8 files a call
# brings back).
#
# ---- carrying (each device call takes the ~2 MiB tree plus at most ~62 MiB of ignored files) ----
# Here, once, from the repository root (the checkout the session was started in: a call sends
# that one, also when a helper calls from another worktree):
#   P312=$HOME/.pyenv/versions/3.12.1/bin/python3; $P312 -m pip install nanobind  # the device's Python is 3.12
#   cmake -S . -B build-py312 -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90 -DPython_EXECUTABLE=$P312
#   cmake --build build-py312 --target _core stowlm-bench              # _core 5.9 MB, stowlm-bench 6.1 MB
#                                       # (rebuild after any change to csrc/, cuda/ or stowlm_bench.cpp:
#                                       # a build from other sources is not used there but rebuilt, minutes)
#   python3 bench/carry_models.py smollm2-135m                         # 93.8 MiB -> 2 pieces
#   python3 bench/carry_models.py --extras --prebuilt build-py312      # peer 42.7 MiB, prebuilt 22.9 MiB,
#                                                                      # shared 0.5 MiB, gguf wheel 0.1 MiB,
#                                                                      # twins 2.5 MiB (qwen2.5-coder, gemma3)
#   python3 bench/carry_models.py --plan                               # prints the calls below
# Then the device calls, each right after the other (a machine idle for 30 s is given back and the
# next call starts a bare one, the carried files lost):
#   1. carry [".carry/manifest.json", ".carry/llama.cpp-cuda-sm90.tar.xz", ".carry/prebuilt",
#      ".carry/shared", ".carry/wheels"]  command: python3 bench/carry_models.py --receive
#   2. carry [".carry/manifest.json", ".carry/smollm2-135m.gguf.part00"]
#      command: python3 bench/carry_models.py --receive
#   3. carry [".carry/manifest.json", ".carry/smollm2-135m.gguf.part01"]
#      command: bash bench/gpu_session.sh        timeout_s 560
#   then give_back. The figures come back in $OUT (gpu_compare.md: the table for the README).
#   If a CUDA model test fails there: STOWLM_CUDA_GRAPHS=0 (no graphs) and STOWLM_CUDA_FUSION=0
#   (no fused kernels) in a rerun of that test tell which part; tests/test_cuda_ops.py checks each
#   fused kernel against the kernels it replaces.
#   Knobs: COMPARE_ROUNDS (gpu_compare's rounds, default 3, 0: none); FA_VARIANTS (kernel
#   experiments, each VAR=VALUE: its GPU tests, a gpu_compare column, op times; default
#   "STOWLM_CUDA_FA_TILED=1 STOWLM_CUDA_PDL=1"; STOWLM_CUDA_FA_WARPS=16 is another; "" for none); PROFILE (ncu on the kernels matching this regex, default flash_attn, 0: none; into
#   session.log: $OUT brings back at most 8 files); BIG_MOE=1 runs item 4 below at the end with
#   what is left of SESSION_SECONDS, BIG_MOE_ARGS adds to its arguments (--no-variants, --no-sweep).
#   Optional, with 7 minutes of device time left, right after call 3 on the same warm machine:
#   4. command: PYTHONPATH=python python3 bench/big_moe_compare.py --rounds 1 --out $OUT
#      (writes the Qwen3-30B-A3B-shaped big-moe.gguf with the carried shared tools, fits it on
#      cuda:0[mem=8GiB] + cpu, and runs stowlm-bench -- the fitted placement, prompts' experts
#      staged on the GPU and not, and with the host computing 25% and 35% of each staged layer's
#      experts itself while the GPU copies in the rest (STOWLM_MOE_CPU_SHARE; --old-variants: the
#      unpinned and GGUF-layout rows of the first run instead) -- beside llama-bench with the same
#      layers and -ot ...=CPU; the issue's item 6: the share that wins becomes the default).
# From call 2 on each reply must say warm: true (the call found the machine of the call before);
# otherwise the stash went back with the old machine: start again at call 1.
# (--plan packs small pieces into the same call where they fit.) Worth carrying, in this order:
# smollm2-135m (98 MB, 2 pieces): the dense tests, the split and batching tests, and the source of
# every generated test model (qwen3moe-tiny, gptoss-tiny, deepseek2-tiny, glm4moe-tiny, ~40 s of
# CPU to write; carrying qwen3moe-tiny instead is one more 36 MB call). gemma3-270m (253 MB, 5
# pieces) and qwen2.5-coder-0.5b (491 MB, 9 pieces) only when the device time allows: each piece
# is one more call, and their test cases and comparison rows are skipped without them.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
MODE=gpu
case "${1:-}" in
    "") ;;
    --no-gpu) MODE=nogpu ;;
    *) echo "usage: bash bench/gpu_session.sh [--no-gpu]" >&2; exit 2 ;;
esac
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-$REPO/gpu_session_out}
mkdir -p "$OUT" || exit 1
LOG=$OUT/session.log
: > "$LOG"
export STOWLM_CARRIED=${STOWLM_CARRIED:-$HOME/.cache/stowlm/carried}
STASH=$STOWLM_CARRIED
MODELS=${STOWLM_CACHE:-$HOME/.cache/stowlm}/models
CARRY=${CARRY_DIR:-$REPO/.carry}
BUDGET=${SESSION_SECONDS:-480}
FA_VARIANTS=${FA_VARIANTS-STOWLM_CUDA_FA_TILED=1 STOWLM_CUDA_PDL=1}
START=$SECONDS
SUMMARY=()

log() { echo "[$(date -u +%H:%M:%S) +$((SECONDS - START))s] $*" | tee -a "$LOG"; }

# step NAME LIMIT OUTFILE CMD...: CMD under timeout (cut to what is left of the budget), its output
# into OUTFILE (the session log when empty) and on the terminal; the exit status is kept.
step() {
    local name=$1 limit=$2 out=${3:-$LOG}
    shift 3
    local left=$((BUDGET - (SECONDS - START) - 20))
    ((limit > left)) && limit=$left
    if ((limit < 10)); then
        log "SKIP $name: the session's $BUDGET s are spent"
        SUMMARY+=("$name: skipped, no time left")
        return 124
    fi
    log "== $name (limit ${limit} s): $*"
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$out"
    local rc=${PIPESTATUS[0]}
    log "== $name: exit $rc$( ((rc == 124)) && echo ' (timed out)')"
    SUMMARY+=("$name: exit $rc")
    return "$rc"
}

have_model() { [ -f "$MODELS/$1.gguf" ]; }

log "gpu_session ($MODE) in $REPO; OUT=$OUT; stash $STASH; models $MODELS; budget $BUDGET s"

# ---- the machine ---------------------------------------------------------------------------------
{
    echo "--- nvidia-smi"
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || true
    echo "--- CPU"
    lscpu 2>/dev/null | grep -E '^(Model name|CPU\(s\)|Thread|Socket|L3)' || grep -m1 'model name' /proc/cpuinfo
    if grep -q -w amx_int8 /proc/cpuinfo; then echo "amx_int8: present"; else echo "amx_int8: absent"; fi
    echo "--- software"
    "$PY" --version 2>&1
    command -v nvcc >/dev/null && nvcc --version | tail -2
    cmake --version 2>/dev/null | head -1
    free -g 2>/dev/null | head -2
} 2>&1 | tee -a "$LOG"
if [ "$MODE" = gpu ] && ! nvidia-smi -L >/dev/null 2>&1; then
    log "no GPU answers nvidia-smi: the GPU steps will fail or skip; run with --no-gpu to check the rest"
fi

# ---- what was carried ----------------------------------------------------------------------------
if [ -f "$CARRY/manifest.json" ]; then
    KEEP=()
    [ "$MODE" = nogpu ] && KEEP=(--keep)  # here the carried folder is the one being prepared: leave it
    step "receive" 120 "" "$PY" bench/carry_models.py --dir "$CARRY" --stash "$STASH" --receive "${KEEP[@]}"
fi
if [ -f "$STASH/manifest.json" ]; then
    step "assemble" 120 "" "$PY" bench/carry_models.py --dir "$CARRY" --stash "$STASH" --assemble --to "$MODELS"
else
    log "nothing carried ($STASH/manifest.json missing): models only from $MODELS"
fi
[ -d "$STASH/shared" ] && export STOWLM_SHARED=$STASH/shared  # fixtures and tools for the tests
# Shape twins of the models too big to carry (bench/shape_twin.py: their headers, random weights
# written here in seconds): the same work per token, for the comparison only, never the tests.
for t in "$STASH"/twins/*.twin; do
    [ -f "$t" ] || continue
    n=$(basename "$t" .twin)
    have_model "$n" || have_model "$n-twin" || step "twin $n" 60 "" "$PY" bench/shape_twin.py fill "$t" "$MODELS/$n-twin.gguf"
done

SITE=${TMPDIR:-/tmp}/stowlm-site
if ! "$PY" -c "import gguf" 2>/dev/null; then
    if ls "$STASH"/wheels/*.whl >/dev/null 2>&1; then
        step "gguf wheel" 60 "" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "$STASH"/wheels/*.whl && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$SITE
    else
        log "no gguf package and no carried wheel: tests that use gguf oracles will fail"
    fi
fi

{
    echo "--- cuBLAS (llama.cpp's CUDA backend links libcublas.so.13)"
    ldconfig -p 2>/dev/null | grep -i cublas || echo "ldconfig -p: no cublas"
    "$PY" -c "import sys; sys.path.insert(0, 'bench'); import gpu_compare as g; w, looked = g.find_cublas(); \
print('cuBLAS for the peer:', 'MISSING (looked at ' + looked + ')' if w is None else (w or 'on the loader path'))"
} 2>&1 | tee -a "$LOG"

# ---- stowlm: the carried build, or a build here ----------------------------------------------------
step "prebuilt check" 60 "" "$PY" bench/carry_models.py --stash "$STASH" --check-prebuilt
PREBUILT_OK=$?
if ((PREBUILT_OK == 0)); then
    if [ "$MODE" = gpu ]; then
        mkdir -p build && cp "$STASH"/prebuilt/_core.*.so python/stowlm/ && cp "$STASH"/prebuilt/stowlm-bench build/ &&
            log "installed the carried build: $(ls "$STASH"/prebuilt | tr '\n' ' ')"
    else
        log "--no-gpu: would install $(ls "$STASH"/prebuilt | tr '\n' ' ')into python/stowlm/ and build/"
    fi
elif [ "$MODE" = gpu ]; then
    step "configure" 120 "" cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
        "-DPython_EXECUTABLE=$(command -v "$PY")" &&
        step "build" 420 "" cmake --build build -j "$(nproc)" --target _core stowlm-bench
else
    log "--no-gpu: would build with cmake (-DCMAKE_CUDA_ARCHITECTURES=90) there"
fi
# the checkout's python/ once it holds an extension (carried or built here); else an installed stowlm
if ls python/stowlm/_core*.so >/dev/null 2>&1; then export PYTHONPATH=$REPO/python${PYTHONPATH:+:$PYTHONPATH}; fi
step "import" 60 "" "$PY" -c "from stowlm import _core; print('stowlm', _core.__file__); \
print('CUDA kernels:', hasattr(_core, 'cuda_ops'), 'devices:', _core.cuda.devices())"

# ---- test models ---------------------------------------------------------------------------------
GENERATED="qwen3moe-tiny gptoss-tiny deepseek2-tiny glm4moe-tiny"
if have_model smollm2-135m && [ -n "${STOWLM_SHARED:-}" ]; then
    # conftest's get_model writes them with the shared tools and checks their sha256
    step "generated models" 180 "" "$PY" -c "import sys; sys.path.insert(0, 'tests'); from conftest import get_model
for n in '$GENERATED'.split(): print(get_model(n))"
else
    log "smollm2-135m or the shared tools not carried: no generated test models"
fi
ls -la "$MODELS" 2>&1 | tee -a "$LOG"

# -k: drop the cases of the models that are not there (their names are in the test ids)
KEXPR=""
declare -A KEY=([gemma3-270m]=gemma3 [qwen2.5-coder-0.5b]=qwen2.5 [qwen3moe-tiny]=qwen3moe [gptoss-tiny]=gptoss
                [deepseek2-tiny]=deepseek2 [glm4moe-tiny]=glm4moe)
for m in "${!KEY[@]}"; do
    have_model "$m" || KEXPR="${KEXPR:+$KEXPR and }not ${KEY[$m]}"
done
GPU_TESTS=(tests/test_cuda_ops.py tests/test_cuda_math.py)
if have_model smollm2-135m; then GPU_TESTS+=(tests/test_cuda_models.py); else log "no smollm2-135m: test_cuda_models.py left out"; fi
KARGS=()
[ -n "$KEXPR" ] && KARGS=(-k "$KEXPR")
log "GPU tests: ${GPU_TESTS[*]} ${KEXPR:+-k \"$KEXPR\"}"

# ---- tests -----------------------------------------------------------------------------------------
if [ "$MODE" = gpu ]; then
    # nvcc-only checks beside the GPU tests, on the CPU cores the GPU tests leave idle
    (timeout -k 10 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda_build.py > "$OUT/pytest_build.log" 2>&1
     echo "exit $?" >> "$OUT/pytest_build.log") &
    BUILD_TESTS=$!
    # -v: a test per line as it ends, so a log cut by the timeout still says how far it got
    PER_TEST=()
    "$PY" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout 150)
    step "GPU tests" 240 "$OUT/pytest_gpu.log" env STOWLM_REQUIRE_GPU=1 "$PY" -m pytest -v -p no:cacheprovider -rfEs \
        --durations=15 "${PER_TEST[@]}" "${GPU_TESTS[@]}" "${KARGS[@]}"
    GPU_RC=$?
    if ((GPU_RC != 0 && GPU_RC != 124)); then
        # which part broke a failing case: rerun the first few with graphs off, then fused kernels off
        mapfile -t FAILED < <(grep -oE '^(FAILED|ERROR) tests/[^ ]+' "$OUT/pytest_gpu.log" | awk '{print $2}' | sort -u | head -12)
        if ((${#FAILED[@]} > 0)); then
            for knob in STOWLM_CUDA_GRAPHS=0 STOWLM_CUDA_FUSION=0 "STOWLM_CUDA_GRAPHS=0 STOWLM_CUDA_FUSION=0"; do
                echo "=== rerun with $knob" >> "$OUT/pytest_diag.log"
                # shellcheck disable=SC2086
                step "GPU failures with $knob" 60 "$OUT/pytest_diag.log" env STOWLM_REQUIRE_GPU=1 $knob "$PY" -m pytest \
                    -q -p no:cacheprovider -rfE -x --tb=line "${FAILED[@]}"
            done
        fi
    fi
    # each kernel experiment (FA_VARIANTS): its tests and the models' against llama.cpp and the CPU
    for fav in $FA_VARIANTS; do
        step "GPU tests with $fav" 90 "" env STOWLM_REQUIRE_GPU=1 "$fav" "$PY" -m pytest -q -p no:cacheprovider -rfE \
            --tb=line "${GPU_TESTS[@]}" \
            -k "(flash_attn or decoding or arch_models or same_logits or matches_llama or tensor_split) ${KEXPR:+and ($KEXPR)}"
    done
    log "waiting for test_cuda_build.py (the comparison wants a quiet machine)"
    wait "$BUILD_TESTS"
    tail -3 "$OUT/pytest_build.log" | tee -a "$LOG"
    SUMMARY+=("test_cuda_build: $(tail -1 "$OUT/pytest_build.log")")
else
    step "GPU tests (collected only)" 120 "$OUT/pytest_gpu.log" "$PY" -m pytest -q -p no:cacheprovider --collect-only \
        "${GPU_TESTS[@]}" tests/test_cuda_build.py "${KARGS[@]}"
fi

# ---- stowlm against llama.cpp ---------------------------------------------------------------------
PEER=()
[ -f "$STASH/llama.cpp-cuda-sm90.tar.xz" ] && PEER=(--peer-tar "$STASH/llama.cpp-cuda-sm90.tar.xz")
CMODELS=()  # issue 26's three models: each itself, else its shape twin
for m in smollm2-135m qwen2.5-coder-0.5b qwen3moe-tiny; do
    if have_model "$m"; then CMODELS+=(-m "$m"); elif have_model "$m-twin"; then CMODELS+=(-m "$MODELS/$m-twin.gguf"); fi
done
if [ "$MODE" = gpu ]; then
    if [ "${COMPARE_ROUNDS:-3}" != 0 ]; then
        VARIANT=()
        for fav in $FA_VARIANTS; do VARIANT+=(--variant "${fav/=/ }=$fav"); done  # label: no '=' in it
        step "gpu_compare" 360 "" "$PY" bench/gpu_compare.py --device cuda --out "$OUT" --rounds "${COMPARE_ROUNDS:-3}" \
            "${VARIANT[@]}" "${PEER[@]}" "${CMODELS[@]}"
    fi
else
    [ ${#CMODELS[@]} -eq 0 ] && CMODELS=(-m smollm2-135m)
    step "gpu_compare (cpu)" 240 "" "$PY" bench/gpu_compare.py --device cpu --out "$OUT" "${PEER[@]}" "${CMODELS[@]}" \
        -p 16 -n 4 -r 1 --rounds 1 -t 2
fi

# ---- where a step's time goes: each op's kernels timed, graphs off (stowlm-bench -v) ----------------
if [ "$MODE" = gpu ] && [ -x build/stowlm-bench ]; then
    for m in smollm2-135m qwen3moe-tiny; do
        have_model "$m" && step "op times $m" 60 "" env STOWLM_CUDA_GRAPHS=0 build/stowlm-bench -m "$MODELS/$m.gguf" \
            -dev cuda:0 -p 512 -n 128 -r 1 -o json -v
    done
    for fav in $FA_VARIANTS; do
        have_model smollm2-135m && step "op times smollm2-135m with $fav" 60 "" env STOWLM_CUDA_GRAPHS=0 "$fav" \
            build/stowlm-bench -m "$MODELS/smollm2-135m.gguf" -dev cuda:0 -p 512 -n 128 -r 1 -o json -v
    done
    # the dearest kernel's counters (PROFILE, a kernel name regex; default the attention kernel, the
    # dearest on 2026-11-28; PROFILE=0: none): what bounds it (memory, latency, occupancy)
    NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
    if [ -n "$NCU" ] && [ "${PROFILE:-flash_attn}" != 0 ] && have_model smollm2-135m; then
        # the last layer's launch in a 512-token prompt, then the first in a one-token step
        step "ncu ${PROFILE:-flash_attn}" 90 "" env STOWLM_CUDA_GRAPHS=0 "$NCU" \
            --kernel-name "regex:${PROFILE:-flash_attn}" --launch-skip 29 --launch-count 2 --section SpeedOfLight \
            --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy --section WarpStateStats \
            --section SchedulerStats build/stowlm-bench -m "$MODELS/smollm2-135m.gguf" -dev cuda:0 -p 512,1 -n 0 \
            -r 1 --no-warmup -o json
    fi
fi

# ---- the big MoE (issue 26 item 6) with what is left of the budget, when asked (BIG_MOE=1) ---------
if [ "$MODE" = gpu ] && [ "${BIG_MOE:-0}" = 1 ]; then
    mkdir -p "$OUT/big"
    # shellcheck disable=SC2086
    step "big MoE" 600 "" "$PY" bench/big_moe_compare.py --rounds 1 --out "$OUT/big" ${BIG_MOE_ARGS:-} "${PEER[@]}"
fi

log "summary:"
for s in "${SUMMARY[@]}"; do log "  $s"; done
log "files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
