"""The GPU check: one run on a bare GPU host, one table.

Runs from a source checkout with torch, transformers, safetensors and
tokenizers only (no server packages, no network, no install): it maps the
checkout's folders onto the ``treadle`` package itself and drives the engine
in-process. ``scripts/gpu_check.sh`` is the one command; ``--smoke`` runs the
same code at tiny sizes (on the CPU when there is no GPU) to prove it runs.

Rows of the table:

* ``tests/gpu``: every check of ``tests/gpu/checks.py`` (pass/FAIL, its summary);
* ``decode``: tokens/s of the engine's torch sampler vs transformers'
  ``generate`` on the same device, for the 110m preset and a ~0.5B Qwen2-style
  config built here (random weights, bf16), batch 64 and 256, 32-token prompts,
  256 new tokens, EOS off (target on an H100/H200: >= 3x at batch 256, 0.5B);
* ``train``: one forward_backward (cross-entropy) + optim_step of the engine vs
  the same step in plain torch (transformers' model, a plain LoRA module,
  ``torch.optim.AdamW(fused=True)``), with MFU against ``--peak-tflops`` (6N
  flops a token for a full fine-tune, 4N for LoRA: no weight gradients of the
  base), on the 0.5B config: LoRA rank 32 and full fine-tune at 8 x 512 tokens
  (target: <= 1.1x plain torch), and the trainer's table, LoRA rank 16 and full
  fine-tune at 8 x 128 and 4 x 1,024 tokens;
* ``tenants``: four LoRA models' small forward_backward calls (2 x 64 tokens
  each) as one batched pass vs one after another (target: >= 2x);
* ``sweep``: N = 8 LoRA runs of one tenant (ranks 8 and 16), each doing a GRPO
  step (sample, forward_backward, optim_step, sync_weights), all in flight vs
  one after another, with their logprobs compared (``benchmarks/sweep.py``'s
  runs; ``scripts/gpu_sweep.py``) (target: >= 2.8x);
* ``ranks``: ``--ranks 2`` (one GPU a rank, NCCL) against one rank, a full
  fine-tune of the train model at its longest case: step time, losses, rank
  0's peak; skipped with the reason on a host with fewer than two GPUs;
* ``episodes``: three turns of an agent episode on the sweep's model, each
  turn's history kept (``cache_completion``): the share of turns 2-3's prompt
  reused (target: >= 0.9; FAIL below it or when a turn's tokens differ from a
  fresh prefill of its history), and the logprobs' largest difference
  (``scripts/gpu_episodes.py``); the sampler pool (issue 37) needs several
  workers and is not a row of a one-host check;
* ``peak memory`` of each part, engine vs reference
  (``torch.cuda.max_memory_allocated``).

Times are medians over ``--reps`` repetitions after a warm-up, with the device
synchronised around each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _map_package() -> None:
    """Make ``import treadle`` (client_sdk/) and ``treadle.workers`` (workers/) work
    from the source tree, as the installed package lays them out."""
    shim = Path(tempfile.mkdtemp(prefix="treadle-src-"))
    (shim / "treadle").symlink_to(ROOT / "client_sdk", target_is_directory=True)
    sys.path[:0] = [str(shim), str(ROOT)]
    import treadle

    treadle.__path__.append(str(ROOT))  # treadle.workers -> workers/, as package-dir says


_map_package()

import gpu_episodes  # noqa: E402  (scripts/, beside this file)
import gpu_sweep  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from gpu_plain_torch import add_lora  # noqa: E402

from tests.gpu import checks  # noqa: E402
from treadle.common.engine.domain import (  # noqa: E402
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ModelSpec,
    OptimStepOp,
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
)
from treadle.workers.engine.loop import Engine, EngineConfig  # noqa: E402
from treadle.workers.group.launch import build_engine  # noqa: E402
from treadle.workers.model.tiny import build_tiny_model  # noqa: E402
from treadle.workers.trainer import trainer  # noqa: E402
from treadle.workers.trainer.batching import BatchCall, run_batch  # noqa: E402

#: a Qwen2-0.5B-shaped config (random weights): 24 layers, 896 wide, GQA 14/2, 152k vocab
QWEN2_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 151_936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}


@dataclass(frozen=True)
class Sizes:
    decode_models: tuple[str, ...]  # "110m" | "0.5b" | a tiny preset
    batches: tuple[int, ...]
    prompt: int
    new_tokens: int
    train_model: str
    train_cases: tuple[tuple[int, int, int], ...]  # (LoRA rank or 0: full, rows, length)
    tenant_rows: int
    tenant_len: int
    sweep_model: str
    sweep_runs: int
    sweep_steps: int


TRAIN_CASES = ((32, 8, 512), (0, 8, 512), (16, 8, 128), (0, 8, 128), (16, 4, 1024), (0, 4, 1024))
FULL = Sizes(("110m", "0.5b"), (64, 256), 32, 256, "0.5b", TRAIN_CASES, 2, 64, "110m", 8, 3)
SMOKE = Sizes(("tiny", "demo"), (2, 4), 8, 8, "demo", ((32, 2, 16), (0, 2, 16)), 1, 8, "tiny", 2, 1)


@dataclass
class Row:
    part: str
    case: str
    engine: str
    reference: str = ""
    ratio: str = ""
    note: str = ""


class Run:
    def __init__(self, device: str, dtype: torch.dtype, work: Path, args: argparse.Namespace):
        self.device = device
        self.dtype = dtype
        self.work = work
        self.args = args
        self.rows: list[Row] = []
        self.peaks: list[Row] = []  # the peak memory rows, printed last
        self.models: dict[str, Path] = {}

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)

    def timed(
        self, fn: Callable[[], Any], reps: int, warm: Callable[[], Any] | None = None
    ) -> float:
        (warm or fn)()  # warm-up
        times = []
        for _ in range(reps):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def reset_peak(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> str:
        if not self.device.startswith("cuda"):
            return "n/a (cpu)"
        return f"{torch.cuda.max_memory_allocated(self.device) / 2**30:.2f} GiB"

    def peak_row(self, case: str, engine: str, reference: str) -> None:
        """A ``peak memory`` row: the engine's peak and the reference's, and their ratio."""
        ratio = ""
        if engine.endswith(" GiB") and reference.endswith(" GiB"):
            ref = float(reference.split()[0])
            ratio = f"{float(engine.split()[0]) / ref:.2f}x" if ref else ""
        self.peaks.append(Row("peak memory", case, engine, reference, ratio))

    def model(self, name: str) -> Path:
        if name not in self.models:
            out = self.work / name
            if name == "0.5b":
                build_tiny_model(out, preset="110m", arch="qwen2", overrides=QWEN2_05B)
            else:
                build_tiny_model(out, preset=name, seed=0)
            self.models[name] = out
        return self.models[name]

    def engine(self, name: str, **overrides: Any) -> Engine:
        dtype = str(self.dtype).removeprefix("torch.")
        cfg = EngineConfig(
            base_models={name: self.model(name)},
            device=self.device,
            default_dtype=dtype,
            **overrides,
        )
        return Engine(cfg)

    def guarded(self, part: str, case: str, fn: Callable[[], None]) -> None:
        """Run one part; a failure becomes a FAIL row and the run goes on."""
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as err:
            traceback.print_exc()
            self.rows.append(Row(part, case, "FAIL", note=f"{type(err).__name__}: {err}"[:160]))
        print(f"[{time.perf_counter() - t0:6.1f}s] {part} {case}", file=sys.stderr, flush=True)

    # ---- tests/gpu ------------------------------------------------------------------------------

    def gpu_tests(self) -> None:
        ctx = checks.Ctx(self.device, self.model("tiny"), self.work)
        for name, fn, kwargs in checks.CHECKS:
            t0 = time.perf_counter()
            try:
                summary = fn(ctx, **kwargs)
                verdict = "pass"
            except Exception as err:
                traceback.print_exc()
                summary, verdict = f"{type(err).__name__}: {err}"[:160], "FAIL"
            spent = time.perf_counter() - t0
            self.rows.append(Row("tests/gpu", name, verdict, note=f"{summary} ({spent:.1f}s)"))

    # ---- decode ---------------------------------------------------------------------------------

    def decode(self, name: str, batch: int) -> None:
        s = self.args.sizes
        engine = self.engine(
            name,
            sampler_slots=batch,
            sampler_max_len=s.prompt + s.new_tokens + 8,
            sampler_max_prefill_tokens=max(512, batch * s.prompt),
            sampler_prefill_slots=min(batch, 64),
        )
        vocab = engine.bases.config(name).vocab_size
        rng = np.random.default_rng(0)
        prompts = rng.integers(3, min(vocab, 30_000), size=(batch, s.prompt))

        def engine_run(new: int) -> None:
            futs: list[Future[SampleResult]] = []
            for i in range(batch):
                params = SamplingConfig(max_tokens=new, seed=i, ignore_eos=True)
                futs.append(engine.sample(SamplerTarget(name), SampleOp(prompts[i], 1, params)))
            engine.step(between_calls=False)  # admitted, not stepped
            while engine.sampler.core.has_work():
                engine.sampler.core.step_all()
            for fut in futs:
                assert fut.result(timeout=0).sequences[0].tokens.size == new

        self.reset_peak()
        mine = self.timed(lambda: engine_run(s.new_tokens), 1, lambda: engine_run(8))
        engine_peak = self.peak()
        ref = self.hf_model(name)
        ids = torch.as_tensor(prompts, device=self.device)
        mask = torch.ones_like(ids)

        def hf_run(new: int = s.new_tokens) -> None:
            out = ref.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new,
                min_new_tokens=new,  # EOS off
                pad_token_id=0,
            )
            assert out.shape[1] == s.prompt + new

        self.reset_peak()
        theirs = self.timed(hf_run, 1, lambda: hf_run(8))
        self.peak_row(f"decode {name} batch {batch} (vs HF generate)", engine_peak, self.peak())
        tokens = batch * s.new_tokens
        self.rows.append(
            Row(
                "decode",
                f"{name} batch {batch}",
                f"{tokens / mine:,.0f} tok/s",
                f"{tokens / theirs:,.0f} tok/s",
                f"{theirs / mine:.2f}x",
                f"engine peak {engine_peak}, HF peak {self.peak()}",
            )
        )

    def hf_model(self, name: str) -> torch.nn.Module:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(str(self.model(name)))
        return model.to(device=self.device, dtype=self.dtype).eval()

    # ---- training step ---------------------------------------------------------------------------

    def train(self, rank: int, rows: int, length: int) -> None:
        s = self.args.sizes
        name = s.train_model
        dtype = str(self.dtype).removeprefix("torch.")
        engine = self.engine(name)
        mode = "lora" if rank else "full"
        checks._create(engine, ModelSpec("m", "t", name, rank, float(rank), 0, dtype))
        model = engine.models["m"]
        vocab = model.cfg.vocab_size
        rng = np.random.default_rng(0)
        toks = rng.integers(3, min(vocab, 30_000), size=(rows, length + 1))
        data = tuple(
            DatumData(t[:-1], {"target_tokens": t[1:], "weights": np.ones(length, np.float32)})
            for t in toks
        )
        fb = ForwardBackwardOp(data, "cross_entropy", {})
        adam = AdamConfig(learning_rate=1e-5)
        seq = iter(range(1, 10**6))

        def engine_step() -> None:
            engine.executor.apply(model, next(seq), fb)
            engine.executor.apply(model, next(seq), OptimStepOp(adam))

        self.reset_peak()
        mine = self.timed(engine_step, self.args.reps)
        engine_peak = self.peak()
        n_params = model.cfg.num_params()

        ref = self.hf_model(name).train()
        params = add_lora(ref, rank) if mode == "lora" else list(ref.parameters())
        opt = torch.optim.AdamW(params, lr=1e-5, fused=self.device.startswith("cuda"))
        ids = torch.as_tensor(toks, device=self.device)

        def torch_step() -> None:
            logits = ref(input_ids=ids[:, :-1]).logits.float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])
            (-lp.sum()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        self.reset_peak()
        theirs = self.timed(torch_step, self.args.reps)
        case = f"{name} {f'LoRA r{rank}' if rank else 'full FT'} {rows}x{length}"
        self.peak_row(f"train {case} (vs plain torch)", engine_peak, self.peak())
        tokens = rows * length
        flops = (4 if mode == "lora" else 6) * n_params * tokens
        peak = self.args.peak_tflops * 1e12
        self.rows.append(
            Row(
                "train",
                case,
                f"{mine * 1e3:.1f} ms (MFU {flops / mine / peak:.1%})",
                f"{theirs * 1e3:.1f} ms (MFU {flops / theirs / peak:.1%})",
                f"{mine / theirs:.2f}x time",
                f"engine peak {engine_peak}, torch peak {self.peak()}",
            )
        )

    # ---- four tenants ------------------------------------------------------------------------------

    def tenants(self) -> None:
        s = self.args.sizes
        name = s.train_model
        dtype = str(self.dtype).removeprefix("torch.")
        engine = self.engine(name)
        rng = np.random.default_rng(0)
        ops, models = [], []
        for i in range(4):
            checks._create(engine, ModelSpec(f"m{i}", f"t{i}", name, 8, 8.0, i, dtype))
            models.append(engine.models[f"m{i}"])
            vocab = models[-1].cfg.vocab_size
            toks = rng.integers(3, min(vocab, 30_000), size=(s.tenant_rows, s.tenant_len + 1))
            ones = np.ones(s.tenant_len, np.float32)
            data = tuple(DatumData(t[:-1], {"target_tokens": t[1:], "weights": ones}) for t in toks)
            ops.append(ForwardBackwardOp(data, "cross_entropy", {}))

        def one_by_one() -> None:
            for m, op in zip(models, ops, strict=True):
                trainer.forward_backward(m, op)

        def batched() -> None:
            calls = [BatchCall(m, op) for m, op in zip(models, ops, strict=True)]
            run_batch(calls, lambda _op: None)
            for c in calls:
                assert not isinstance(c.outcome, Exception), c.outcome

        self.reset_peak()
        seq_t = self.timed(one_by_one, self.args.reps)
        seq_peak = self.peak()
        self.reset_peak()
        bat_t = self.timed(batched, self.args.reps)
        self.peak_row("tenants (batched vs one by one)", self.peak(), seq_peak)
        self.rows.append(
            Row(
                "tenants",
                f"4 x LoRA fwd+bwd {s.tenant_rows}x{s.tenant_len} on {name}",
                f"batched {bat_t * 1e3:.1f} ms",
                f"one by one {seq_t * 1e3:.1f} ms",
                f"{seq_t / bat_t:.2f}x faster",
                f"peak batched {self.peak()}, one by one {seq_peak}",
            )
        )

    # ---- a worker of two ranks -----------------------------------------------------------------

    def ranks(self) -> None:
        """``--ranks 2`` (one GPU a rank, NCCL): a full fine-tune's step on 2 ranks vs 1,
        its loss and step time, and rank 0's peak memory. A host with fewer than
        two GPUs runs one rank: the row says so and why."""
        if self.device.startswith("cuda") and torch.cuda.device_count() < 2:
            self.rows.append(
                Row(
                    "ranks",
                    "--ranks 2 (full FT)",
                    "skipped",
                    note=f"needs 2 GPUs or more; this host has {torch.cuda.device_count()} "
                    "(a single-GPU host runs one rank)",
                )
            )
            return
        s = self.args.sizes
        name, (_, rows, length) = s.train_model, s.train_cases[-1]
        out = {n: self._ranks_run(n, name, rows, length) for n in (1, 2)}
        (t1, l1, p1), (t2, l2, p2) = out[1], out[2]
        diff = max(abs(a - b) / abs(b) for a, b in zip(l2, l1, strict=True))
        self.rows.append(
            Row(
                "ranks",
                f"--ranks 2, {name} full FT {rows}x{length}",
                f"2 ranks {t2 * 1e3:.1f} ms",
                f"1 rank {t1 * 1e3:.1f} ms",
                f"{t1 / t2:.2f}x faster",
                f"losses max rel diff {diff:.1e}; rank 0 peak {p2} vs {p1}",
            )
        )

    def _ranks_run(
        self, n: int, name: str, rows: int, length: int
    ) -> tuple[float, list[float], str]:
        dtype = str(self.dtype).removeprefix("torch.")
        cfg = EngineConfig(
            base_models={name: self.model(name)},
            device=self.device,
            default_dtype=dtype,
            ranks=n,
            collective_timeout_s=120.0,
        )
        engine = build_engine(cfg)
        checks._create(engine, ModelSpec("m", "t", name, 0, 0.0, 0, dtype))
        model = engine.models["m"]
        rng = np.random.default_rng(0)
        toks = rng.integers(3, min(model.cfg.vocab_size, 30_000), size=(rows, length + 1))
        ones = np.ones(length, np.float32)
        data = tuple(DatumData(t[:-1], {"target_tokens": t[1:], "weights": ones}) for t in toks)
        fb = ForwardBackwardOp(data, "cross_entropy", {})
        adam = OptimStepOp(AdamConfig(learning_rate=1e-5))
        seq = iter(range(1, 10**6))
        losses: list[float] = []

        def step() -> None:
            result = engine.executor.apply(model, next(seq), fb)
            losses.append(result.metrics["loss:sum"])  # type: ignore[union-attr]
            engine.executor.apply(model, next(seq), adam)

        self.reset_peak()
        spent = self.timed(step, self.args.reps)
        peak = self.peak()
        engine.stop()
        return spent, losses, peak

    # ---- a sweep of one tenant ---------------------------------------------------------------------

    def sweep(self) -> None:
        s = self.args.sizes
        out = gpu_sweep.sweep(
            self.model(s.sweep_model),
            self.device,
            str(self.dtype).removeprefix("torch."),
            runs=s.sweep_runs,
            steps=s.sweep_steps,
            reset_peak=self.reset_peak,
            peak=self.peak,
        )
        flight, seq = out["in flight"], out["one after another"]
        self.rows.append(
            Row(
                "sweep",
                f"{s.sweep_runs} LoRA runs (r8/r16) of one tenant on {s.sweep_model}, GRPO steps",
                f"in flight {flight.wall_s:.2f} s",
                f"one after another {seq.wall_s:.2f} s",
                f"{seq.wall_s / flight.wall_s:.2f}x faster",
                f"trained tok/s {flight.trained / flight.train_s:,.0f} vs "
                f"{seq.trained / seq.train_s:,.0f}; logprobs max |diff| {out.diff:.1e}; "
                f"{flight.passes}",
            )
        )
        self.peak_row("sweep (in flight vs one after another)", out.peaks[0], out.peaks[1])

    # ---- agent episodes: a turn prefills only its observation ------------------------------------

    def episodes(self) -> None:
        name = self.args.sizes.sweep_model
        out = gpu_episodes.probe(self.model(name), self.device, self.dtype)
        ok = out.reused >= 0.9 and out.tokens_equal
        self.rows.append(
            Row(
                "episodes",
                f"{gpu_episodes.TURNS} turns on {name}, history kept (cache_completion)",
                f"reused {out.reused:.2f} of turns 2+" if ok else "FAIL",
                "fresh prefill of each history",
                "",
                f"prefill reused {out.reused:.3f} (target >= 0.9); tokens equal: "
                f"{out.tokens_equal}; logprobs max |diff| {out.logprob_diff:.1e}",
            )
        )

    def table(self) -> str:
        head = Row("part", "case", "engine", "reference", "ratio", "note")
        rows = [head, *self.rows, *self.peaks]
        cols = ("part", "case", "engine", "reference", "ratio")
        widths = {c: max(len(getattr(r, c)) for r in rows) for c in cols}
        lines = []
        for i, r in enumerate(rows):
            cells = [getattr(r, c).ljust(widths[c]) for c in cols]
            lines.append("| " + " | ".join(cells) + f" | {r.note} |")
            if i == 0:
                lines.append("|" + "|".join("-" * (widths[c] + 2) for c in cols) + "|---|")
        return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, same code path")
    parser.add_argument(
        "--device", default="", help="default: cuda, or cpu with --smoke and no GPU"
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200 SXM: 989)"
    )
    parser.add_argument(
        "--reps", type=int, default=0, help="timed repetitions (default 5; smoke 1)"
    )
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated parts to skip: tests,decode,train,tenants,sweep,ranks,episodes",
    )
    args = parser.parse_args()
    args.sizes = SMOKE if args.smoke else FULL
    args.reps = args.reps or (1 if args.smoke else 5)
    device = args.device or ("cuda" if torch.cuda.is_available() or not args.smoke else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device (use --smoke on the CPU)", file=sys.stderr)
        return 2
    os.environ[checks.ENV] = device
    skip = set(filter(None, args.skip.split(",")))
    dtype = torch.bfloat16 if device.startswith("cuda") or not args.smoke else torch.float32
    gpu = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="treadle-gpu-check-") as tmp:
        run = Run(device, dtype, Path(tmp), args)
        if "tests" not in skip:
            run.guarded("tests/gpu", "all", run.gpu_tests)
        if "decode" not in skip:
            for name in args.sizes.decode_models:
                for batch in args.sizes.batches:
                    run.guarded(
                        "decode", f"{name} {batch}", lambda n=name, b=batch: run.decode(n, b)
                    )
        if "train" not in skip:
            for rank, rows, length in args.sizes.train_cases:
                run.guarded(
                    "train",
                    f"r{rank} {rows}x{length}",
                    lambda r=rank, n=rows, t=length: run.train(r, n, t),
                )
        if "tenants" not in skip:
            run.guarded("tenants", "4", run.tenants)
        if "sweep" not in skip:
            run.guarded("sweep", str(args.sizes.sweep_runs), run.sweep)
        if "ranks" not in skip:
            run.guarded("ranks", "2", run.ranks)
        if "episodes" not in skip:
            run.guarded("episodes", "3 turns", run.episodes)
        print(
            f"\ntreadle GPU check: {gpu}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}, "
            f"{time.strftime('%Y-%m-%d')}, {time.perf_counter() - t0:.0f}s{' (smoke sizes)' if args.smoke else ''}\n"
        )
        print(run.table())
        failed = [r for r in run.rows if r.engine == "FAIL"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
