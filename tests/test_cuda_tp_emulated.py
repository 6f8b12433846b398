"""Tensor parallelism with CUDA devices without a GPU: tests/native/cuda_tp_emulated.cpp runs
cuda/cuda_engine.cpp's LOCAL_IDS and ALL_REDUCE (partials gathered by peer copies, uploads and
copy_to_host, summed in shard order) and the shard weights models/model_tp.cpp uploads, on the
emulated device of tests/native/emulated_cuda.cpp, for a dense model, an MoE model and an MLA MoE
model over [cuda:0, cuda:1], [cuda:0, cpu:0], [cpu:0, cuda:0] and [cuda:0, cpu:0, cuda:1], even and
uneven: the logits of the same split over CPU devices bit for bit, exact memory accounting. Like
tests/test_cuda_engine_emulated.py it links the core library of a CUDA-enabled build, and is
skipped, with the reason, where there is none."""
from test_cuda_engine_emulated import build_and_run

MODELS = ["smollm2-135m", "qwen3moe-tiny", "deepseek2-tiny", "gemma3-270m", "gptoss-tiny", "glm4moe-tiny"]


def test_tensor_parallel_on_emulated_cuda_devices(model_path, tmp_path):
    build_and_run("cuda_tp_emulated", MODELS, model_path, tmp_path, timeout=600)
