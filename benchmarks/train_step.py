"""One training step (``forward_backward`` cross-entropy + ``optim_step`` AdamW)
three ways, in one run: through the SDK, in the engine's own trainer in-process,
and in plain torch (a transformers model + ``torch.optim.AdamW``; PEFT for LoRA).

For each preset (5m, 110m), mode (LoRA rank 16, full fine-tune) and shape
(short: 8 x 128 tokens, long: 4 x 1,024 tokens), three rows:

* torch: ``LlamaForCausalLM`` (PEFT ``LoraConfig(r=16, alpha=16)`` on the same
  seven projections and the unembedding for LoRA, treadle's default targets),
  the same summed weighted token loss, ``loss.backward()``, ``torch.optim.AdamW`` with treadle's default
  hyper-parameters, ``zero_grad(set_to_none=True)``;
* engine: ``treadle.workers.trainer.trainer.forward_backward`` + ``TrainingModel.optim_step``
  on the caller's thread, the code the engine runs for those calls;
* engine-ckpt (only with ``--paths``): the engine with activation checkpointing;
* sdk: an embedded server (its own process) driven through ``treadle.ServiceClient``
  from this process, with the server's default settings (the thread count of
  each pass measured, ``--training-threads measure``, as a user's ``treadle serve``
  runs); a step submits both calls and waits for the step's result;
* sdk-all (with ``--paths``): the same with ``--training-threads all`` (every
  pass on ``--threads``, as the torch row), a tuned row beside the headline.

Each row runs in a fresh process (``--threads`` torch threads), so its peak
memory is that process's peak RSS (``ru_maxrss``; for sdk, the server's
process, which also holds the SQLite op log and gRPC). Times are medians of
``--steps`` steps after ``--warmup`` (2) untimed ones; tokens/s counts every token of the
batch; "cpu ms/step" is the CPU time (user + system, all threads) of the
process(es) doing the work over the timed steps, per step (for sdk: the server's
and the client's), and "cpu vs torch" torch's over it: on a loaded machine the
wall-time ratio swings, the CPU-time ratio much less; "6N" is the fraction of ``6 x params x tokens/s`` in this machine's
matmul rate measured in the same run (LoRA does ~4N of real work: no weight
gradients of the base); "faults/step" the minor page faults of the same
process(es) per timed step. The torch row is plain torch as a user runs it:
no allocator or thread tuning beyond ``--threads``, which every row shares. The
engine and sdk rows run with the engine's default host allocator ("reuse",
``workers.device.host_allocator``: freed memory kept for the next step), as an engine's
process does; plain torch with the same malloc settings gains as much or more
where page faults are a large part of a step (110m full 4 x 1,024, both rows
with them: torch -10%, engine -4%; docs/engine.md).

Rows of one configuration run back to back in separate processes, and a row's
speed moves by a few percent from one process to the next (the 5m full
8 x 128 row: engine 0.96x-1.06x of torch in one run of three rounds, on an
idle machine), so ``--rounds R`` runs each configuration's rows R times, every
other round in reverse order, and reports per path the medians over the
rounds and the median of its per-round ratios to torch ("vs torch",
"cpu vs torch"; the highest peak ratio), with the range of the per-round
tok/s ratios in the last column: a real gap shows in every round.

Needs PEFT for the LoRA baseline (a benchmark-only dependency, the ``bench`` extra)::

    pip install -e '.[bench]'      # or: pip install peft
    python benchmarks/train_step.py                                   # the full table
    python benchmarks/train_step.py --presets 5m --shapes short --steps 3   # quick
    python benchmarks/train_step.py --presets 5m --steps 6 --rounds 3  # the small rows, steadier
    python benchmarks/train_step.py --presets 110m --modes full --profile

``--calls K`` splits each step's batch into K ``forward_backward`` calls (of
n/K rows each) before its one optimizer step, as gradient accumulation does;
plain torch runs K ``backward()`` calls, accumulating into ``.grad`` in place.
Every call after the first keeps its new gradients whole until they are added
(a call that fails leaves no gradient behind): what that costs shows in
``--calls 2`` against ``--calls 1``.

``--profile`` also prints, per configuration, where the engine's step time
goes (torch.profiler over the in-process step: forward, loss, backward,
gradient accumulation, optimizer, metrics).
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import _common  # noqa: E402  (sets the thread budget before torch loads)
import numpy as np  # noqa: E402
import torch  # noqa: E402

THREADS, matmul_gflops, model_dir, table = (
    _common.THREADS,
    _common.matmul_gflops,
    _common.model_dir,
    _common.table,
)

SHAPES = {"short": (8, 128), "long": (4, 1024)}
MODES = ("lora", "full")
RANK = 16
WARMUP = 2


def _batch(n: int, length: int, vocab: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` random sequences: (tokens, next-token targets) of ``length`` each."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(3, vocab, size=length + 1) for _ in range(n)]
    return [(s[:-1], s[1:]) for s in seqs]


def _weights(n: int, length: int) -> np.ndarray:
    return np.full(length, 1.0 / (n * length), dtype=np.float32)  # the token mean


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _usage() -> tuple[float, int]:
    """This process's CPU seconds and minor page faults so far (every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt


def _timed(
    step: Callable[[], None],
    steps: int,
    warmup: int = WARMUP,
    usage: Callable[[], tuple[float, int]] = _usage,
) -> tuple[list[float], float, int]:
    """Wall seconds of each step after ``warmup`` steps, and the CPU seconds
    and minor page faults ``usage()`` counted over them (CPU time is a figure
    a loaded machine disturbs much less)."""
    for _ in range(warmup):
        step()
    out = []
    cpu0, flt0 = usage()
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    cpu1, flt1 = usage()
    return out, cpu1 - cpu0, flt1 - flt0


# ---- the rows (each in its own process) ---------------------------------------------


def _splits(n: int, calls: int) -> list[slice]:
    """The rows of each of ``calls`` forward_backward calls of an ``n``-row batch."""
    if not 1 <= calls <= n or n % calls:
        raise SystemExit(f"--calls {calls}: must divide the batch's {n} rows")
    k = n // calls
    return [slice(i, i + k) for i in range(0, n, k)]


def torch_step(path: Path, mode: str, n: int, length: int, calls: int = 1) -> Callable[[], None]:
    import transformers

    from treadle.common.engine.domain import AdamConfig

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if mode == "lora":
        import peft

        from treadle.workers.model.lora import TARGETS

        cfg = peft.LoraConfig(
            r=RANK, lora_alpha=RANK, lora_dropout=0.0, target_modules=list(TARGETS)
        )
        model = peft.get_peft_model(model, cfg)
    model.train()
    adam = AdamConfig()
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=adam.learning_rate,
        betas=(adam.beta1, adam.beta2),
        eps=adam.eps,
        weight_decay=adam.weight_decay,
    )
    data = _batch(n, length, model.config.vocab_size)
    tokens = torch.from_numpy(np.stack([d[0] for d in data]))
    targets = torch.from_numpy(np.stack([d[1] for d in data]))
    weights = torch.from_numpy(np.stack([_weights(n, length)] * n))

    def step() -> None:
        for rows in _splits(n, calls):
            logits = model(input_ids=tokens[rows]).logits
            nll = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), targets[rows].flatten(), reduction="none"
            )
            (nll * weights[rows].flatten()).sum().backward()
            del logits, nll
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def engine_model(path: Path, mode: str, checkpointing: bool = False):  # type: ignore[no-untyped-def]
    from treadle.common.engine.domain import ModelSpec
    from treadle.workers.engine.base_models import BaseModelRegistry
    from treadle.workers.trainer.trainer import TrainingModel

    base = BaseModelRegistry({"bench": path}).get("bench", torch.float32)
    rank = RANK if mode == "lora" else 0
    spec = ModelSpec("m", "t", "bench", rank, float(rank), 0, "float32")
    return TrainingModel(spec, base, checkpoint_activations=checkpointing)


def engine_op(model, n: int, length: int, rows: slice = slice(None)):  # type: ignore[no-untyped-def]
    from treadle.common.engine.domain import DatumData, ForwardBackwardOp

    data = tuple(
        DatumData(tok.astype(np.int64), {"target_tokens": tgt, "weights": _weights(n, length)})
        for tok, tgt in _batch(n, length, model.cfg.vocab_size)[rows]
    )
    return ForwardBackwardOp(data=data, loss_fn="cross_entropy", loss_config={})


def engine_step(
    path: Path, mode: str, n: int, length: int, calls: int = 1, checkpointing: bool = False
) -> Callable[[], None]:
    from treadle.common.engine.domain import AdamConfig
    from treadle.workers.trainer.trainer import forward_backward

    model = engine_model(path, mode, checkpointing)
    ops = [engine_op(model, n, length, rows) for rows in _splits(n, calls)]

    def step() -> None:
        for op in ops:
            forward_backward(model, op)
        model.optim_step(AdamConfig())

    return step


def run_row(spec: dict) -> None:
    """A child process: build one row's step, time it, print one JSON line."""
    torch.set_num_threads(spec["threads"])
    if (
        spec["path"] != "torch"
    ):  # what the engine's process does (``workers.device.host_allocator``)
        from treadle.workers.device import host_allocator

        host_allocator.configure("reuse")
    make = {
        "torch": torch_step,
        "engine": engine_step,
        "engine-ckpt": functools.partial(engine_step, checkpointing=True),
    }[spec["path"]]
    step = make(Path(spec["dir"]), spec["mode"], spec["n"], spec["length"], spec["calls"])
    times, cpu, faults = _timed(step, spec["steps"], spec["warmup"])
    print(
        json.dumps({"times": times, "cpu_s": cpu, "minflt": faults, "peak_mb": _peak_mb()}),
        flush=True,
    )
    if spec.get("profile"):
        from train_step_profile import profile_engine

        model = engine_model(Path(spec["dir"]), spec["mode"])
        profile_engine(model, engine_op(model, spec["n"], spec["length"]), spec["mode"])


def serve(spec: dict) -> None:
    """A child process: an embedded server; prints its address, then its CPU
    seconds so far for each line "cpu" the parent writes, and its peak RSS at "peak"."""
    import tempfile

    from treadle.server.config import ServerConfig
    from treadle.server.embedded import EmbeddedServer

    with tempfile.TemporaryDirectory(prefix="treadle-train-step-") as tmp:
        cfg = ServerConfig(
            data_dir=Path(tmp),
            models={"bench": Path(spec["dir"])},
            port=0,
            threads=spec["threads"],
            # the headline row runs the server's default ("measure"); sdk-all fixes "all"
            training_threads="all" if spec["path"] == "sdk-all" else "measure",
        )
        with EmbeddedServer(cfg) as server:
            hello = {"address": server.address, "api_key": server.api_key}
            print(json.dumps(hello), flush=True)
            while sys.stdin.readline().strip() == "cpu":
                cpu, faults = _usage()
                print(json.dumps({"cpu_s": cpu, "minflt": faults}), flush=True)
            print(json.dumps({"peak_mb": _peak_mb()}), flush=True)


def sdk_row(spec: dict) -> dict:
    import treadle

    proc = subprocess.Popen(
        [sys.executable, __file__, "--_serve", json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        hello = json.loads(proc.stdout.readline())
        with treadle.ServiceClient(hello["address"], api_key=hello["api_key"]) as service:
            vocab = service.get_server_info().base_models[0].vocab_size
            batch = [
                treadle.Datum(
                    model_input=treadle.ModelInput.from_ints(tok),
                    loss_fn_inputs={
                        "target_tokens": tgt,
                        "weights": _weights(spec["n"], spec["length"]),
                    },
                )
                for tok, tgt in _batch(spec["n"], spec["length"], vocab)
            ]
            trainer = (
                service.create_lora_training_client("bench", rank=RANK)
                if spec["mode"] == "lora"
                else service.create_training_client("bench")
            )
            adam = treadle.AdamParams()

            def step() -> None:
                fbs = [
                    trainer.forward_backward(batch[rows], "cross_entropy")
                    for rows in _splits(spec["n"], spec["calls"])
                ]
                trainer.optim_step(adam).result()
                for fb in fbs:
                    fb.result()

            def usage() -> tuple[float, int]:  # the server's and this client's: the SDK's work
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write("cpu\n")
                proc.stdin.flush()
                server = json.loads(proc.stdout.readline())
                cpu, faults = _usage()
                return float(server["cpu_s"]) + cpu, int(server["minflt"]) + faults

            times, cpu_s, faults = _timed(step, spec["steps"], spec["warmup"], usage)
        proc.stdin.write("peak\n")
        proc.stdin.flush()
        peak = json.loads(proc.stdout.readline())["peak_mb"]
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)
    return {"times": times, "cpu_s": cpu_s, "minflt": faults, "peak_mb": peak}


def child_row(spec: dict) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--_row", json.dumps(spec)],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout.splitlines()
    for line in out[1:]:
        print(line)
    return json.loads(out[0])


# ---- the parent ---------------------------------------------------------------------


def _x(v: float) -> str:
    return f"{v:.2f}x"


def configuration(
    spec: dict, paths: list[str], rounds: int, profile: bool
) -> list[tuple[str, dict]]:
    """One configuration's rows, ``rounds`` times (every other round in reverse
    order, so no path always runs first or last): per path the medians over the
    rounds of its ms/step, CPU ms/step and faults/step, the median of its
    per-round ratios to that round's torch row, the highest peak and peak ratio,
    and the range of its per-round tok/s ratios ("-" for one round)."""
    runs: dict[str, list[dict]] = {p: [] for p in paths}
    for r in range(rounds):
        for which in paths if r % 2 == 0 else paths[::-1]:
            prof = profile and r == 0 and which == "engine"
            one = {**spec, "path": which, "profile": prof}
            res = sdk_row(one) if which.startswith("sdk") else child_row(one)
            runs[which].append(
                {
                    "ms": statistics.median(res["times"]) * 1e3,
                    "cpu_ms": res["cpu_s"] / spec["steps"] * 1e3,
                    "faults": res["minflt"] / spec["steps"],
                    "peak_mb": res["peak_mb"],
                }
            )
            if rounds > 1:
                got = runs[which][-1]
                print(
                    f"  round {r + 1} {which}: {got['ms']:,.0f} ms/step, "
                    f"{got['cpu_ms']:,.0f} cpu ms/step, {got['faults']:,.0f} faults/step, "
                    f"peak {got['peak_mb']:,.0f} MB",
                    flush=True,
                )
    out = []
    for which, got in runs.items():
        base = runs.get("torch")
        med = {k: statistics.median(g[k] for g in got) for k in ("ms", "cpu_ms", "faults")}
        row = {**med, "peak_mb": max(g["peak_mb"] for g in got)}
        row.update(rel="-", rel_cpu="-", rel_mb="-", spread="-")
        if base:
            rel = [b["ms"] / g["ms"] for g, b in zip(got, base, strict=True)]
            rel_cpu = [b["cpu_ms"] / g["cpu_ms"] for g, b in zip(got, base, strict=True)]
            rel_mb = [g["peak_mb"] / b["peak_mb"] for g, b in zip(got, base, strict=True)]
            row.update(rel=_x(statistics.median(rel)), rel_cpu=_x(statistics.median(rel_cpu)))
            row["rel_mb"] = _x(max(rel_mb))
            if rounds > 1:
                row["spread"] = f"{_x(min(rel))}-{_x(max(rel))}"
        out.append((which, row))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="5m,110m")
    ap.add_argument("--modes", default="lora,full")
    ap.add_argument("--shapes", default="short,long")
    ap.add_argument("--paths", default="torch,engine,sdk")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--calls", type=int, default=1, help="forward_backward calls a step (accumulation)"
    )
    ap.add_argument(
        "--rounds", type=int, default=1, help="each configuration's rows R times, order alternated"
    )
    ap.add_argument("--warmup", type=int, default=WARMUP, help="untimed steps before them")
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--model-dir", default=None, help="a directory per preset: DIR/<preset>")
    ap.add_argument("--profile", action="store_true", help="where the engine's step time goes")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--_row", help=argparse.SUPPRESS)
    ap.add_argument("--_serve", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._row:
        run_row(json.loads(args._row))
        return 0
    if args._serve:
        serve(json.loads(args._serve))
        return 0

    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    torch.set_num_threads(args.threads)  # the matmul rate at the rows' thread budget
    gflops = matmul_gflops()
    rows, records = [], []
    for preset in args.presets.split(","):
        given = str(Path(args.model_dir) / preset) if args.model_dir else None
        path = model_dir(preset, given)
        n_params = _param_count(path)
        for mode in args.modes.split(","):
            for shape in args.shapes.split(","):
                n, length = SHAPES[shape]
                spec = {
                    "dir": str(path),
                    "mode": mode,
                    "n": n,
                    "length": length,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "calls": args.calls,
                    "threads": args.threads,
                }
                for which, res in configuration(
                    spec, args.paths.split(","), args.rounds, args.profile
                ):
                    tps = n * length / (res["ms"] / 1e3)
                    frac = 6 * n_params * tps / (gflops * 1e9)
                    row = [preset, mode, shape, which, res["ms"], tps, res["rel"], res["cpu_ms"]]
                    row += [res["rel_cpu"], res["faults"], f"{frac:.0%}", res["peak_mb"]]
                    row += [res["rel_mb"], res["spread"]]
                    rows.append(row)
                    records.append(dict(zip(HEADERS, rows[-1], strict=True)))
                    print(table(HEADERS, rows[-1:]).splitlines()[-1], flush=True)
    print(
        f"\ntrain step: started {started}, {args.threads} torch threads, {args.calls} "
        f"forward_backward call(s) a step, {args.steps} steps "
        f"per row (median, after {args.warmup} warm-up), {args.rounds} round(s) a "
        f"configuration, matmul {gflops:.0f} GFLOP/s\n"
    )
    print(table(HEADERS, rows))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2) + "\n")
    return 0


HEADERS = [
    "preset",
    "mode",
    "shape",
    "path",
    "ms/step",
    "tok/s",
    "vs torch",
    "cpu ms/step",
    "cpu vs torch",
    "faults/step",
    "6N",
    "peak MB",
    "peak vs torch",
    "vs torch, rounds",
]


def _param_count(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                total += int(np.prod(st.get_slice(k).get_shape()))
    return total


if __name__ == "__main__":
    sys.exit(main())
