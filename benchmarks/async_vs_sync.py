"""Async vs sync RL on a long-tailed batch: the ladder's rungs, measured in one run.

The demo's GRPO task (single-digit addition, "demo" preset, full fine-tune,
SFT warm-up) with a long tail: in every ``groups_per_step`` prompts,
one group's answers run to ``16 L`` tokens and the others to ``L``. Lengths
are forced identically for every variant: each prompt of the (seeded) prompt
stream carries its own ``max_tokens`` and ``ignore_eos`` (EOS does not stop a
sequence; the SFT warm-up's probes stop at EOS as usual), and the reward is
scored on the answer prefix (the answer digits then EOS). ``--server-process``
runs the server as a ``treadle serve`` process of its own.

Variants, each from the same warmed-up state, the same prompt stream, the same
number of train steps and the same thread budget (one torch thread for the
trainer, one for the sampler on a thread of its own, ``--sampler torch-thread``;
``--one-thread`` puts both on the engine thread, ``--sampler-process`` the sampler in
a process of its own, ``--sampler torch-process``):

* rung 0 ``sync_loop``: the batch waits for its long group, decoded with the
  rest of the slots idle;
* rung 2 ``one_step_stale_loop``;
* rung 3 ``async_loop`` with ``max_staleness`` 2 and 4 (``buffer_groups``
  requests kept in flight on a ``latest`` sampler);
* rung 3 with in-flight updates, when ``TrainingClient.sync_weights`` takes
  ``inflight``;
* rung 3 with ``on_stale="wait"`` (the trainer waits for a group the next step
  would make too stale instead of dropping it): ``max_staleness`` 4 alone, and
  2, 4 and 8 with in-flight updates (the bound's price: a tighter one makes the
  trainer wait for more long answers; "max staleness" shows what each allowed).

The train step trains on the scored prefix of each answer (the forced tail
stands for reasoning the reward does not read; ``--train-full`` trains on
every generated token, which makes the trainer dominate on a CPU).

Reported per variant: trained tokens per second (completion tokens of the
rollouts the trainer consumed / wall time), the tokens the sampler generated
per second (dropped rollouts included), the sampler's occupancy (running rows
/ slots, polled from ``GetServerInfo`` every 0.25 s; a sparkline over time), the time the trainer waited for data, the
dropped-stale count, and the final reward (prefix exact match on all 100
problems, fixed seeds). ``--seeds 0 1 2`` repeats everything per seed.

    python benchmarks/async_vs_sync.py [--steps 120] [--seeds 0 1 2] [--train-full]
        [--server-process] [--sampler-process]   # the fastest setup measured
"""

from __future__ import annotations

import argparse
import atexit
import inspect
import itertools
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

#: torch threads of the trainer (the engine thread) and of the sampler (its own thread,
#: unless --one-thread): one core each; the SDK, gRPC and this script share them
THREADS = 1
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
from _procs import treadle_serve  # noqa: E402
from tqdm import tqdm  # noqa: E402

import treadle  # noqa: E402
from treadle import rl  # noqa: E402
from treadle.server.config import ServerConfig  # noqa: E402
from treadle.server.demo import PROBLEMS, Plan, Problem, prompt_tokens, warm_up  # noqa: E402
from treadle.server.embedded import EmbeddedServer  # noqa: E402
from treadle.workers.model.tiny import build_tiny_model  # noqa: E402

L = 4  # short answers: two digits, EOS, one spare
LONG = 16 * L


@contextmanager
def serve(config: ServerConfig, own_process: bool) -> Iterator[tuple[str, str]]:
    """(address, API key) of the benchmark's server: embedded in this process, or,
    with ``own_process``, a ``treadle serve`` process of its own (as a researcher's
    laptop talks to a server elsewhere: the two do not share a GIL)."""
    if not own_process:
        with EmbeddedServer(config) as server:
            yield server.address, str(server.api_key)
        return
    flags = ["--threads", str(config.threads), "--sampler-slots", str(config.sampler_slots)]
    flags += ["--sampler-max-len", str(config.sampler_max_len)]
    flags += [f"--model={name}={path}" for name, path in config.models.items()]
    flags += ["--sampler", config.sampler, "--sampler-threads", str(config.sampler_threads)]
    with treadle_serve(flags, Path(config.data_dir)) as (address, key, _):
        yield address, key


class Task:
    def __init__(self, tok: treadle.Tokenizer) -> None:
        self.tok = tok

    def prompts(self, seed: int, groups_per_step: int) -> Iterator[rl.Prompt]:
        """The same stream for every variant: one long group in every ``groups_per_step``."""
        rng = random.Random(seed)
        for i in itertools.count():
            p = rng.choice(PROBLEMS)
            n = LONG if i % groups_per_step == groups_per_step - 1 else L
            params = treadle.SamplingParams(
                max_tokens=n, temperature=1.0, seed=rng.getrandbits(31), ignore_eos=True
            )
            yield rl.Prompt(prompt_tokens(self.tok, p), p, params)

    def reward(self, p: Problem, seq: treadle.SampledSequence) -> float:
        """The answer prefix: the answer's tokens then EOS."""
        want = [*self.tok.encode(p.answer), self.tok.eos_token_id]
        return float(list(seq.tokens[: len(want)]) == want)

    def evaluate(self, sampler: treadle.SamplingClient, samples: int = 4) -> float:
        params = [
            treadle.SamplingParams(max_tokens=L, temperature=1.0, seed=i, ignore_eos=True)
            for i in range(100)
        ]
        futs = [
            sampler.sample(prompt_tokens(self.tok, p), samples, params[i])
            for i, p in enumerate(PROBLEMS)
        ]
        return float(
            np.mean(
                [
                    self.reward(p, s)
                    for p, f in zip(PROBLEMS, futs, strict=True)
                    for s in f.result(300).sequences
                ]
            )
        )


class OccupancyProbe:
    """Polls the sampler's occupancy while a variant runs."""

    def __init__(self, service: treadle.ServiceClient, every_s: float = 0.25) -> None:
        self.service, self.every_s = service, every_s
        self.samples: list[tuple[float, float]] = []
        self.generated: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self._stop.wait(self.every_s):
            info = self.service.get_server_info()
            busy = [m.running_rows / max(m.num_slots, 1) for m in info.sampler_metrics]
            made = sum(m.tokens_generated for m in info.sampler_metrics)
            self.samples.append((time.perf_counter() - t0, max(busy, default=0.0)))
            self.generated.append((time.perf_counter() - t0, made))

    def generated_per_s(self) -> float:
        """Tokens the sampler generated per second while the variant ran."""
        if len(self.generated) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self.generated[0], self.generated[-1]
        return (n1 - n0) / max(t1 - t0, 1e-9)

    def __enter__(self) -> OccupancyProbe:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(5)

    def mean(self) -> float:
        return float(np.mean([s for _, s in self.samples])) if self.samples else 0.0

    def sparkline(self, width: int = 24) -> str:
        if not self.samples:
            return ""
        bars = " ▁▂▃▄▅▆▇█"
        vals = np.array([s for _, s in self.samples])
        chunks = np.array_split(vals, min(width, len(vals)))
        return "".join(bars[min(8, int(round(c.mean() * 8)))] for c in chunks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--steps",
        type=int,
        default=120,
        help="train steps per variant (rung 3's first steps fill its pipeline; 30 steps "
        "measured ~10%% below the steady state)",
    )
    ap.add_argument("--groups-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument(
        "--buffer-groups",
        type=int,
        default=0,
        help="rung 3's requests in flight or finished but not taken (default: one and a "
        "half steps' groups plus one; fewer leave the sampler short of rows between takes, "
        "more keep more rows decoding, which makes each decode step slower and the long "
        "answers staler: docs/async_rl.md has the sweep)",
    )
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument(
        "--train-full",
        action="store_true",
        help="train on every generated token (default: on the scored answer prefix)",
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument(
        "--one-thread",
        action="store_true",
        help="sampler and trainer share the engine thread (default: the sampler steps on a "
        "thread of its own, so sampling overlaps training)",
    )
    ap.add_argument(
        "--sampler-process",
        action="store_true",
        help="the sampler steps in a process of its own (`--sampler torch-process`: no GIL shared "
        "with training) instead of on a thread of its own",
    )
    ap.add_argument(
        "--server-process",
        action="store_true",
        help="run the server as a `treadle serve` process of its own (default: embedded in "
        "this process, sharing its GIL with the loops)",
    )
    ap.add_argument("--variants", nargs="+", default=None)
    args = ap.parse_args()
    args.buffer_groups = args.buffer_groups or args.groups_per_step * 3 // 2 + 1
    inflight_ok = "inflight" in inspect.signature(treadle.TrainingClient.sync_weights).parameters

    data = Path(tempfile.mkdtemp(prefix="treadle-async-bench-"))
    atexit.register(shutil.rmtree, data, ignore_errors=True)
    config = ServerConfig(
        data_dir=data / "data",
        models={"demo": build_tiny_model(data / "model", preset="demo", seed=0)},
        port=0,
        threads=THREADS,
        sampler_slots=args.groups_per_step * args.group_size * 2,
        sampler_max_len=LONG + 16,
        sampler="torch-process"
        if args.sampler_process
        else ("torch" if args.one_thread else "torch-thread"),
        sampler_threads=THREADS,
    )
    G, P = args.group_size, args.groups_per_step
    grpo = rl.grpo_train_step(adam=treadle.AdamParams(learning_rate=args.lr))

    def prefix_step(trainer: treadle.TrainingClient, groups: list[rl.Group]) -> dict[str, float]:
        """GRPO on the scored prefix of each answer (the forced tail is padding)."""
        n = 3  # two digits + EOS: the longest answer the reward reads
        cut = [rl.Group(g.prompt, [_prefix(r, n) for r in g.rollouts]) for g in groups]
        return grpo(trainer, cut)

    train_step = grpo if args.train_full else prefix_step
    rows: list[list[object]] = []
    results: dict[str, list[tuple[float, float]]] = {}
    t_all = time.perf_counter()
    with (
        serve(config, args.server_process) as (address, api_key),
        treadle.ServiceClient(address, api_key=api_key) as service,
    ):
        task = Task(service.get_tokenizer("demo"))
        for seed in args.seeds:
            # one warm-up per seed, every variant starts from its saved state
            trainer = service.create_training_client("demo", seed=seed)
            t0 = time.perf_counter()
            warm_up(trainer, task.tok, Plan(), random.Random(seed), tqdm(disable=True))
            start = trainer.save_state(f"warm-{seed}").result(300).path
            before = task.evaluate(trainer.sync_weights())
            print(
                f"seed {seed}: warm-up {time.perf_counter() - t0:.0f} s, "
                f"prefix reward {before:.3f}",
                file=sys.stderr,
            )

            def common(seed: int = seed) -> dict[str, object]:
                return dict(
                    prompts=task.prompts(seed, P),
                    reward_fn=task.reward,
                    steps=args.steps,
                    groups_per_step=P,
                    group_size=G,
                    train_step=train_step,
                )

            def rung3(ms: int, inflight: bool = False, wait: bool = False) -> Callable:
                def run(model: treadle.TrainingClient) -> Iterator[rl.StepStats]:
                    model.sync_weights().sampler_id  # noqa: B018 - a version for `latest`
                    latest = service.create_sampling_client(
                        weights=f"treadle://{model.model_id}/latest"
                    )
                    kw: dict[str, object] = {"inflight": True} if inflight else {}
                    if wait:
                        kw["on_stale"] = "wait"
                    return rl.async_loop(
                        model,
                        latest,
                        buffer_groups=args.buffer_groups,
                        max_staleness=ms,
                        **kw,
                        **common(),
                    )

                return run

            variants: dict[str, Callable] = {
                "rung 0 sync": lambda tr: rl.sync_loop(tr, **common()),
                "rung 2 one-step-stale": lambda tr: rl.one_step_stale_loop(tr, **common()),
                "rung 3 max_staleness 2": rung3(2),
                "rung 3 max_staleness 4": rung3(4),
                "rung 3 max_staleness 16": rung3(16),
            }
            if inflight_ok and "inflight" in inspect.signature(rl.async_loop).parameters:
                variants["rung 3 ms 4 + in-flight"] = rung3(4, inflight=True)
            if "on_stale" in inspect.signature(rl.async_loop).parameters:
                variants["rung 3 ms 4, wait"] = rung3(4, wait=True)
                variants["rung 3 ms 2 + in-flight, wait"] = rung3(
                    2, inflight=inflight_ok, wait=True
                )
                variants["rung 3 ms 4 + in-flight, wait"] = rung3(
                    4, inflight=inflight_ok, wait=True
                )
                variants["rung 3 ms 8 + in-flight, wait"] = rung3(
                    8, inflight=inflight_ok, wait=True
                )
            for name, make in variants.items():
                if args.variants and not any(v in name for v in args.variants):
                    continue
                tr = service.create_training_client_from_state(start)
                with OccupancyProbe(service) as probe:
                    t0 = time.perf_counter()
                    stats = list(make(tr))
                    wall = time.perf_counter() - t0
                final = task.evaluate(tr.sync_weights())
                tokens = sum(s.trained_tokens for s in stats)
                stale = float(np.mean([rl_counter(s.staleness) for s in stats]))
                worst = max((max(s.staleness, default=0) for s in stats), default=0)
                results.setdefault(name, []).append((tokens / wall, final))
                rows.append(
                    [
                        seed,
                        name,
                        f"{tokens / wall:.0f}",
                        f"{wall:.1f}",
                        f"{probe.generated_per_s():.0f}",
                        f"{probe.mean():.2f}",
                        probe.sparkline(),
                        f"{sum(s.wait_data_s for s in stats):.1f}",
                        f"{sum(s.sampler_wait_s for s in stats):.1f}",
                        sum(s.dropped_stale for s in stats),
                        f"{stale:.2f}",
                        worst,
                        f"{before:.3f}",
                        f"{final:.3f}",
                    ]
                )
                print(" | ".join(str(c) for c in rows[-1]), file=sys.stderr)
                service.delete_model(tr.model_id)

    headers = [
        "seed",
        "variant",
        "trained tok/s",
        "wall s",
        "generated tok/s",
        "occupancy",
        "occupancy over time",
        "trainer wait s",
        "sampler wait s",
        "dropped",
        "mean staleness",
        "max staleness",
        "reward before",
        "final reward",
    ]
    print(_table(headers, rows))
    base = results.get("rung 0 sync")
    if base:
        print("\nper variant, mean over seeds (speed-up vs rung 0 | final reward ± std):")
        b = np.mean([t for t, _ in base])
        for name, res in results.items():
            tps, fin = np.array([t for t, _ in res]), np.array([f for _, f in res])
            print(
                f"  {name:<26} {tps.mean():>7.0f} tok/s  x{tps.mean() / b:.2f}  "
                f"reward {fin.mean():.3f} ± {fin.std():.3f}"
            )
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s")
    return 0


def rl_counter(hist: dict[int, int]) -> float:
    """Mean staleness of a step's histogram (per rollout)."""
    n = sum(hist.values())
    return sum(k * v for k, v in hist.items()) / n if n else 0.0


def _prefix(r: rl.Rollout, n: int) -> rl.Rollout:
    versions = r.token_versions()[:n]
    return rl.Rollout(
        r.prompt_tokens, r.completion_tokens[:n], r.completion_logprobs[:n], r.reward, versions
    )

    def set_postfix(self, **kw: object) -> None: ...


def _table(headers: list[str], rows: list[list[object]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
