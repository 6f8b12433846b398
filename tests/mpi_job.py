"""What tests/test_mpi.py runs on every rank under mpirun (and, with --local, in one process over
virtual devices with the same layer split, for the reference). argv[1]: JSON arguments."""
import json
import os
import sys
import time

import numpy as np

import stowlm
import stowlm.mpi as mpi


def calls(model, n_copies, n_seq=2):
    """Every kind of call that changes the KV cache, with the logits each returns."""
    ctx = stowlm.Context(model, n_ctx=512, n_ubatch=16, n_seq=n_seq)
    rng = np.random.default_rng(7)
    ids = lambda n: [int(t) for t in rng.integers(1, model.n_vocab, n)]  # noqa: E731
    out = {}
    prompt = ids(40)  # 3 micro-batches of 16 tokens
    out["prompt"] = ctx.eval_batch(prompt, [0] * 40, rows=list(range(40)))
    out["decode"] = ctx.eval_batch(ids(1), [0])
    other = ids(20)
    out["two_seqs"] = ctx.eval_batch(other + ids(1), [1] * 20 + [0], rows=[5, 19, 20])
    ctx.kv_truncate(30, seq=0)
    out["after_truncate"] = ctx.eval_batch(ids(5), [0] * 5, rows=list(range(5)))
    ctx.clear(1)
    out["after_clear"] = ctx.eval_batch(other[:17], [1] * 17, rows=[16])
    out["pipeline"] = np.array([ctx.pipeline["n_copies"]])
    return out


def main():
    args = json.loads(sys.argv[1])
    path, mode = args["model"], args["mode"]
    if args.get("local"):
        devices, split = args["local_devices"], args["layer_split"]
    else:
        devices, split = mpi.start(path, devices=args.get("devices"), layer_split=args.get("layer_split"))
    try:
        if mode == "logits":
            res = {}
            for nc in (4, 1):
                model = stowlm.Model(path, devices=devices, layer_split=split, n_copies=nc)
                for k, v in calls(model, nc).items():
                    res[f"{k}/{nc}"] = v
            np.savez(args["out"], **res)
        elif mode == "generate":
            llm = stowlm.LLM(path, devices=devices, layer_split=split, fit=False, progress=False)
            out = llm.generate(args["prompt"], max_tokens=args["max_tokens"], temperature=0)
            with open(args["out"], "w") as f:
                json.dump({"text": out.text, "tokens": out.tokens}, f)
        elif mode == "embed":  # pooled hidden states, several inputs a pass
            llm = stowlm.LLM(path, devices=devices, layer_split=split, fit=False, progress=False, embedding=True,
                             n_seq=2, n_ctx=512)
            with open(args["out"], "w") as f:
                json.dump(llm.embed(args["texts"]), f)
        elif mode == "forever":  # until a rank is killed
            llm = stowlm.LLM(path, devices=devices, layer_split=split, fit=False, progress=False)
            llm.generate("Once upon a time", max_tokens=4, temperature=0)
            if not args.get("local"):
                with open(args["out"] + ".tmp", "w") as f:
                    json.dump({"hosts": mpi.init().hosts, "pids": mpi.init().pids}, f)
                os.replace(args["out"] + ".tmp", args["out"])
            t0 = time.time()
            while time.time() - t0 < 300:
                llm.generate("Once upon a time", max_tokens=64, temperature=0)
    finally:
        mpi.finish()


if __name__ == "__main__":
    main()
