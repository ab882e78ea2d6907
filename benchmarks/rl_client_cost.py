"""The client's CPU per RL step: the SDK's pure-Python work between "groups sampled"
and "training calls sent", this tree's code against a baseline revision's, in one run.

An RL step of a GRPO loop (``benchmarks/peer_trl.py``'s demo step, ``DapoStep``) runs
on the user's machine, on the step's critical path:

* sample_req: each prompt's ``Sample`` request built (``ModelInput.from_ints``,
  ``_convert.sample_request``, its ``seq_id`` and ``sampler_id``) and serialized;
* decode: each ``SampleResponse`` parsed from wire bytes and converted to the SDK's
  types (``_convert.sample_response_from_wire``), as the gRPC callback does;
* rollouts: ``rl.Rollout.from_sequence`` for every sample, with its reward, in groups;
* datums: GRPO advantages (``rl.group_advantages``), the zero-advantage rollouts left
  out, a fixed permutation split in 4 minibatches, ``rl.build_datums`` with DAPO's
  constant normalisation (``token_sum_constant``: the step's completion tokens / 4);
* encode: each minibatch's ``ForwardBackwardRequest`` (``ppo``, DAPO's clip) built
  (``_convert.forward_backward_request``) and serialized;
* stats: what the loops' ``StepStats`` reads off the rollouts (each rollout's
  staleness, ``rl.staleness_histogram``; the trained tokens; the mean reward).

Two shapes: the demo's (64 prompts x 8 samples, 4 new tokens) and a longer one
(16 x 8, 256 new tokens). The inputs (response bytes, prompts, rewards, the
permutation) are made once here and handed to both sides; each side runs in its own
process, importing the ``treadle`` package from a directory laid out as its import
namespace (``treadle`` -> ``client_sdk``, as pyproject.toml's package-dir maps it):
this tree's, and the baseline revision's (``git archive`` of its ``client_sdk`` into
a temporary directory). Rounds alternate between the two processes, so a slow spell
of a shared host hits both; figures are medians of ``--rounds`` rounds, in ms per RL
step. Before any figure is printed, the benchmark checks that both sides produced
the same bytes: every serialized request (deterministic serialization) of a step.

Run: ``.venv/bin/python benchmarks/rl_client_cost.py [--baseline-rev REV] [--rounds N]``
(default baseline: the merge-base of HEAD with ``main``; HEAD~1 when that is HEAD).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PHASES = ("sample_req", "decode", "rollouts", "datums", "encode", "stats")
#: (name, prompts, samples per prompt, new tokens per sample)
SHAPES = (("demo 64x8x4", 64, 8, 4), ("long 16x8x256", 16, 8, 256))
MINIBATCHES = 4
CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}


# ---- the inputs (made once, by this tree's protobuf classes) --------------------------


def make_inputs(prompts: int, group: int, new_tokens: int, seed: int = 0) -> dict[str, Any]:
    """Prompt token lists, each prompt's ``SampleResponse`` as wire bytes, a reward per
    sample (about half right, so most groups carry advantage), and the permutation of
    rollout indices the minibatches are cut from."""
    import numpy as np

    from treadle.v1 import common_pb2, sampling_pb2
    from treadle.wire.tensors import to_wire

    rng = random.Random(seed)
    prompt_tokens = [[1] + [rng.randrange(3, 500) for _ in range(11)] for _ in range(prompts)]
    responses: list[bytes] = []
    rewards: list[float] = []
    for _ in range(prompts):
        msg = sampling_pb2.SampleResponse()
        for _ in range(group):
            n = new_tokens if rng.random() < 0.7 else rng.randint(1, new_tokens)
            seq = msg.sequences.add()
            to_wire(np.array([rng.randrange(3, 500) for _ in range(n)], dtype=np.int32), seq.tokens)
            to_wire(np.array([-rng.random() * 3 for _ in range(n)], dtype=np.float32), seq.logprobs)
            seq.stop_reason = common_pb2.STOP if n < new_tokens else common_pb2.LENGTH
            span = seq.versions.add()
            span.start, span.length, span.version = 0, n, 7
            rewards.append(float(rng.random() < 0.5))
        responses.append(msg.SerializeToString())
    order = list(range(prompts * group))
    rng.shuffle(order)
    return {
        "prompts": prompt_tokens,
        "responses": responses,
        "rewards": rewards,
        "order": order,
        "group": group,
        "max_tokens": new_tokens,
    }


# ---- one side: a process running the phases with the treadle it imports ---------------


def step(inputs: dict[str, Any]) -> tuple[dict[str, float], list[bytes]]:
    """One RL step's client work, phase by phase: (seconds a phase, the wire bytes)."""
    import numpy as np

    from treadle import _convert, rl
    from treadle.types import ModelInput, SamplingParams
    from treadle.v1 import sampling_pb2

    group = inputs["group"]
    params = SamplingParams(max_tokens=inputs["max_tokens"], temperature=1.0)
    times: dict[str, float] = {}

    t = time.perf_counter()
    sent = []
    for i, prompt in enumerate(inputs["prompts"]):
        request = _convert.sample_request(ModelInput.from_ints(prompt), group, params)
        request.seq_id = i + 1
        request.sampler_id = "sampler-0"
        request.SerializeToString()
        sent.append(request)
    times["sample_req"] = time.perf_counter() - t

    t = time.perf_counter()
    responses = [
        _convert.sample_response_from_wire(sampling_pb2.SampleResponse.FromString(raw))
        for raw in inputs["responses"]
    ]
    times["decode"] = time.perf_counter() - t

    rewards = inputs["rewards"]
    t = time.perf_counter()
    groups = []
    k = 0
    for prompt, response in zip(inputs["prompts"], responses, strict=True):
        rollouts = []
        for seq in response.sequences:
            rollouts.append(rl.Rollout.from_sequence(prompt, seq, reward=rewards[k]))
            k += 1
        groups.append(rl.Group(rl.Prompt(prompt, None), rollouts))
    times["rollouts"] = time.perf_counter() - t

    t = time.perf_counter()
    rollouts = [r for g in groups for r in g.rollouts]
    adv = rl.group_advantages([r.reward for r in rollouts], group)
    denominator = sum(len(r.completion_tokens) for r in rollouts) / MINIBATCHES
    keep = {i for i, a in enumerate(adv) if a != 0.0 and rollouts[i].completion_tokens}
    order = np.array([i for i in inputs["order"] if i in keep], dtype=np.int64)
    minibatches = [
        rl.build_datums(
            [rollouts[i] for i in mb],
            adv[mb],
            aggregation="token_sum_constant",
            loss_constant=denominator,
        )
        for mb in np.array_split(order, MINIBATCHES)
    ]
    times["datums"] = time.perf_counter() - t

    t = time.perf_counter()
    requests = [
        _convert.forward_backward_request("model-0", datums, "ppo", CLIP, 1.0)
        for datums in minibatches
    ]
    for request in requests:
        request.SerializeToString()
    times["encode"] = time.perf_counter() - t

    t = time.perf_counter()
    rl.staleness_histogram(rollouts, 7)
    sum(r.trained_tokens for r in rollouts)
    float(np.mean([r.reward for r in rollouts]))
    times["stats"] = time.perf_counter() - t

    # the bytes compared: every request, map fields (loss_fn_inputs) in a fixed order
    wire = [request.SerializeToString(deterministic=True) for request in sent + requests]
    return times, wire


def serve(inputs_path: str) -> None:
    """The side's loop: a command a line on stdin ("run SHAPE" / "digest SHAPE"), a
    JSON answer a line on stdout."""
    import treadle

    with open(inputs_path, "rb") as f:
        inputs = pickle.load(f)
    print(json.dumps({"treadle": treadle.__file__}), flush=True)
    for line in sys.stdin:
        command, shape = line.split(maxsplit=1)
        shape = shape.strip()
        if command == "run":
            times, _ = step(inputs[shape])
            print(json.dumps(times), flush=True)
        elif command == "digest":
            _, wire = step(inputs[shape])
            digest = hashlib.sha256(b"".join(len(w).to_bytes(8, "little") + w for w in wire))
            print(json.dumps({"sha256": digest.hexdigest(), "messages": len(wire)}), flush=True)


# ---- the driver ---------------------------------------------------------------------


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()


def default_baseline() -> str:
    head = _git("rev-parse", "HEAD")
    try:
        base = _git("merge-base", "HEAD", "main")
    except subprocess.CalledProcessError:
        base = head
    return base if base != head else _git("rev-parse", "HEAD~1")


def namespace(root: Path, client_sdk: Path) -> Path:
    """A directory whose ``treadle`` is ``client_sdk`` (pyproject.toml's package-dir)."""
    ns = root / "ns"
    ns.mkdir(parents=True)
    (ns / "treadle").symlink_to(client_sdk, target_is_directory=True)
    return ns


class Side:
    def __init__(self, label: str, ns: Path, inputs_path: Path) -> None:
        self.label = label
        env = {**os.environ, "PYTHONPATH": str(ns), "PYTHONDONTWRITEBYTECODE": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(inputs_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ns,
        )
        hello = self._read()
        where = Path(hello["treadle"]).resolve().parent
        if where != (ns / "treadle").resolve():
            raise SystemExit(f"{label}: imported treadle from {where}, not {ns / 'treadle'}")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.label}: the side's process ended (see its stderr above)")
        return json.loads(line)

    def ask(self, command: str, shape: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{command} {shape}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    return "\n".join([line, rule, *body])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", default=None, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds a side and shape")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return

    rev = args.baseline_rev or default_baseline()
    rev_name = _git("rev-parse", "--short", rev)
    with tempfile.TemporaryDirectory(prefix="rl_client_cost_") as tmp:
        root = Path(tmp)
        base_src = root / "base"
        base_src.mkdir()
        archive = subprocess.run(
            ["git", "archive", rev, "client_sdk"], cwd=REPO, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(base_src)], input=archive, check=True)
        base_ns = namespace(root / "base_ns", base_src / "client_sdk")
        cur_ns = namespace(root / "cur_ns", REPO / "client_sdk")

        inputs = {name: make_inputs(p, g, n) for name, p, g, n in SHAPES}
        inputs_path = root / "inputs.pickle"
        inputs_path.write_bytes(pickle.dumps(inputs))

        sides = [
            Side(f"baseline {rev_name}", base_ns, inputs_path),
            Side("this tree", cur_ns, inputs_path),
        ]
        try:
            for name, *_ in SHAPES:
                digests = [side.ask("digest", name) for side in sides]
                if digests[0] != digests[1]:
                    raise SystemExit(
                        f"{name}: the two sides' wire bytes differ: {digests[0]} vs {digests[1]}"
                    )
                print(
                    f"{name}: {digests[0]['messages']} requests a step, the same bytes on both "
                    f"sides (sha256 {digests[0]['sha256'][:16]})"
                )
            results: dict[str, dict[str, dict[str, list[float]]]] = {}
            for name, *_ in SHAPES:
                per_side: dict[str, dict[str, list[float]]] = {
                    s.label: {p: [] for p in PHASES} for s in sides
                }
                for r in range(args.warmup + args.rounds):
                    ordered = sides if r % 2 == 0 else sides[::-1]
                    for side in ordered:
                        times = side.ask("run", name)
                        if r >= args.warmup:
                            for p in PHASES:
                                per_side[side.label][p].append(times[p])
                results[name] = per_side
        finally:
            for side in sides:
                side.close()

    base_label, cur_label = sides[0].label, sides[1].label
    rows = []
    for name, *_ in SHAPES:
        per_side = results[name]
        for p in (*PHASES, "total"):
            if p == "total":
                b = statistics.median(map(sum, zip(*per_side[base_label].values(), strict=True)))
                c = statistics.median(map(sum, zip(*per_side[cur_label].values(), strict=True)))
            else:
                b = statistics.median(per_side[base_label][p])
                c = statistics.median(per_side[cur_label][p])
            rows.append([name, p, f"{b * 1e3:.2f}", f"{c * 1e3:.2f}", f"{b / c:.2f}x"])
    print()
    print(f"client CPU per RL step, ms (median of {args.rounds} rounds, alternating sides)")
    print(table(["shape", "phase", base_label, cur_label, "speed-up"], rows))


if __name__ == "__main__":
    main()
