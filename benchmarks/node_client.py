"""The same training loop from Node (@treadle/client) and from Python (treadle), against
one server, in one run: Node's steps/s over Python's.

A step is ``forward_backward`` (cross-entropy on a fixed batch of 8 datums x 64
tokens) then ``optim_step``, both submitted at once and the step awaited, as a user's
loop does, on a new LoRA model (rank 16) of the "5m" preset (~4.6M parameters, random
weights, built on the spot). The server is a ``treadle serve`` process of its own
(``--threads 2``), so both clients pay the same loopback gRPC and the same engine.

Noise control: rounds alternate the two clients (a block of steps each, the order
flipping every round), each block after three warm-up steps on its own new model
(the connection, Node's JIT, the model's first calls), so
a slow spell of a shared machine hits both; medians of per-step times. The Node
client runs as ``node clients/node/dist/bench/fb_optim.js`` (built here with tsc;
needs ``npm ci`` in clients/node first). Target: Node >= 0.9 x Python.

    python benchmarks/node_client.py                  # ~1-2 min on 2 CPU cores
    python benchmarks/node_client.py --preset tiny --rounds 6 --json out.json

Exit status 0 when the target is met.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import treadle

ROOT = Path(__file__).resolve().parents[1]
NODE_DIR = ROOT / "clients" / "node"
TARGET = 0.9
LR, RANK, BASE, WARMUP = 1e-4, 16, "bench", 3


def make_data(n: int, length: int, vocab: int) -> list[dict]:
    """``n`` datums of ``length`` tokens, weights 1/(n*length) (the token mean), as JSON."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        tokens = rng.integers(3, vocab, size=length + 1)
        out.append(
            {
                "modelInput": [int(t) for t in tokens[:-1]],
                "lossFnInputs": {
                    "target_tokens": [int(t) for t in tokens[1:]],
                    "weights": [1.0 / (n * length)] * length,
                },
            }
        )
    return out


def start_server(tmp: Path, preset: str, threads: int) -> tuple[subprocess.Popen[str], str, str]:
    treadle_bin = Path(sys.executable).parent / "treadle"
    model = tmp / "model"
    subprocess.run(
        [treadle_bin, "make-model", "--tiny", "--preset", preset, model],
        check=True,
        capture_output=True,
    )
    proc = subprocess.Popen(
        [
            treadle_bin,
            "serve",
            "--model",
            f"{BASE}={model}",
            "--port",
            "0",
            "--http-port",
            "-1",
            "--data-dir",
            tmp / "data",
            "--threads",
            str(threads),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    address = key_file = None
    deadline = time.monotonic() + 180
    while (address is None or key_file is None) and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit("treadle serve exited before it was ready")
        if m := re.search(r"serving .* on [\w.-]+:(\d+)", line):
            address = f"127.0.0.1:{m.group(1)}"
        if m := re.search(r"API key is in (\S+)", line):
            key_file = m.group(1)
    if address is None or key_file is None:
        raise SystemExit("treadle serve did not start")
    return proc, address, Path(key_file).read_text().strip()


def python_block(address: str, key: str, data: list[dict], steps: int) -> list[float]:
    datums = [
        treadle.Datum(
            model_input=treadle.ModelInput.from_ints(d["modelInput"]),
            loss_fn_inputs=d["lossFnInputs"],
        )
        for d in data
    ]
    with treadle.ServiceClient(address, api_key=key, session=False) as service:
        trainer = service.create_lora_training_client(BASE, rank=RANK, seed=0)
        adam = treadle.AdamParams(learning_rate=LR)

        def step() -> None:
            fb = trainer.forward_backward(datums, "cross_entropy")
            trainer.optim_step(adam).result()
            fb.result()

        for _ in range(WARMUP):
            step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        service.delete_model(trainer.model_id)
    return times


def node_block(spec_path: Path) -> list[float]:
    proc = subprocess.run(
        ["node", NODE_DIR / "dist" / "bench" / "fb_optim.js", spec_path],
        capture_output=True,
        text=True,
        check=True,
    )
    return list(json.loads(proc.stdout)["times"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="5m", choices=["tiny", "demo", "5m"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per block")
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    subprocess.run(
        [NODE_DIR / "node_modules" / ".bin" / "tsc", "-p", NODE_DIR], check=True, cwd=NODE_DIR
    )
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        proc, address, key = start_server(tmp, args.preset, args.threads)
        try:
            with treadle.ServiceClient(address, api_key=key, session=False) as service:
                vocab = service.get_server_info().base_models[0].vocab_size
            data = make_data(8, 64, vocab)
            spec = tmp / "spec.json"
            spec.write_text(
                json.dumps(
                    {
                        "address": address,
                        "apiKey": key,
                        "baseModel": BASE,
                        "rank": RANK,
                        "lr": LR,
                        "steps": args.steps,
                        "warmup": WARMUP,
                        "data": data,
                    }
                )
            )
            times: dict[str, list[float]] = {"python": [], "node": []}
            for r in range(args.rounds):
                for client in ("python", "node") if r % 2 == 0 else ("node", "python"):
                    block = (
                        python_block(address, key, data, args.steps)
                        if client == "python"
                        else node_block(spec)
                    )
                    times[client] += block
        finally:
            proc.terminate()
            proc.wait(timeout=60)

    py, node = (statistics.median(times[c]) for c in ("python", "node"))
    ratio = py / node  # steps/s ratio = inverse of the time ratio
    print(
        f"fb + optim step, {args.preset} preset, LoRA rank {RANK}, 8 x 64 tokens, "
        f"{args.rounds} rounds x {args.steps} steps, medians"
    )
    print("client   ms/step  steps/s")
    print(f"python  {py * 1e3:8.1f} {1 / py:8.2f}")
    print(f"node    {node * 1e3:8.1f} {1 / node:8.2f}")
    print(f"node / python steps/s: {ratio:.3f} (target >= {TARGET})")
    if args.json is not None:
        args.json.write_text(json.dumps({"times": times, "ratio": ratio}, indent=2) + "\n")
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
