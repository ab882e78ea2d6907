"""The engine's checks on one device: plain functions, no pytest, no server.

Each ``check_*`` takes a :class:`Ctx` (the device, a work directory, a tiny
model built there) and raises ``AssertionError`` when the engine misbehaves;
it returns a one-line summary of what it measured. ``tests/gpu/test_gpu.py``
runs them under pytest (marked ``gpu``); ``scripts/gpu_check.py`` runs them on
a bare GPU host that has torch, transformers, safetensors and tokenizers only.

Tolerances (stated once, used below):

* logprobs, sampler (KV cache, one token a step) vs trainer (whole sequence):
  max |diff| <= 1e-4 in float32 on the CPU (the invariant), 1e-3 in float32 on
  CUDA (other kernels, other summation orders), 0.15 in bfloat16 (8 mantissa
  bits: the two paths round activations at different points) with a mean
  |diff| <= 0.02.
* remote equals local (the engine's steps vs the same steps in plain torch:
  transformers' model, ``torch.optim.AdamW``) in float32: every step's loss
  within 1e-4 relative, the final weights within 1e-4 of ``||W||``.
* multi-LoRA batched vs one at a time: losses within 1e-5 relative and
  gradients within 1e-4 of their norm in float32 (bfloat16: 2e-2).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ModelSpec,
    OptimStepOp,
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
    SyncWeightsOp,
)
from treadle.errors import ResourceExhaustedError
from treadle.workers.engine.loop import Engine, EngineConfig
from treadle.workers.trainer import batching, optimizer, trainer
from treadle.workers.trainer.batching import BatchCall, run_batch

#: the device the checks run on: ``TREADLE_TEST_DEVICE`` (e.g. ``cpu``), else ``cuda``
ENV = "TREADLE_TEST_DEVICE"


def device_under_test() -> str:
    return os.environ.get(ENV, "cuda")


@dataclass(frozen=True)
class Ctx:
    device: str
    model_dir: Path  # a tiny random-weight model (``build_tiny_model``)
    work: Path


def logprob_tolerance(device: str, dtype: str) -> tuple[float, float]:
    """(max, mean) |sampler - trainer| allowed (module docstring)."""
    if dtype == "bfloat16":
        return 0.15, 0.02
    return (1e-4, 1e-4) if device == "cpu" else (1e-3, 1e-3)


def _engine(ctx: Ctx, dtype: str, **overrides: object) -> Engine:
    cfg = EngineConfig(
        base_models={"tiny": ctx.model_dir},
        device=ctx.device,
        default_dtype=dtype,
        **{"sampler_slots": 16, **overrides},  # type: ignore[arg-type]
    )
    return Engine(cfg)


def _spec(model_id: str, dtype: str, rank: int = 4, seed: int = 3) -> ModelSpec:
    return ModelSpec(model_id, "t", "tiny", rank, float(2 * rank), seed, dtype)


def _drive(engine: Engine, futs: list[Future[SampleResult]]) -> list[SampleResult]:
    """Step the engine's samplers (the engine thread is not started) until done."""
    while engine.sampler.core.has_work():
        engine.sampler.core.step_all()
    return [f.result(timeout=0) for f in futs]


def _sample(engine: Engine, target: SamplerTarget, op: SampleOp) -> Future[SampleResult]:
    fut = engine.sample(target, op)
    engine.step(between_calls=False)  # admitted, not stepped: the caller steps the sampler
    return fut


def _create(engine: Engine, spec: ModelSpec) -> None:
    """Create a model on an engine whose thread is not started."""
    fut = engine.create_model(spec)
    engine.step(between_calls=False)
    fut.result(timeout=0)


def _sft_datum(rng: np.random.Generator, length: int, vocab: int) -> DatumData:
    toks = rng.integers(3, vocab, size=length + 1)
    return DatumData(toks[:-1], {"target_tokens": toks[1:], "weights": np.ones(length, np.float32)})


# ---- 1. logprob agreement ----------------------------------------------------------------


def check_logprob_agreement(ctx: Ctx, dtype: str) -> str:
    """Sampled tokens' logprobs (KV-cached decode) equal the trainer's forward's."""
    engine = _engine(ctx, dtype)
    _create(engine, _spec("m", dtype))
    prompt = np.arange(5, 17)
    params = SamplingConfig(max_tokens=24, seed=11, ignore_eos=True, temperature=0.9)
    fut = _sample(engine, SamplerTarget("tiny", "m"), SampleOp(prompt, 4, params))
    (result,) = _drive(engine, [fut])
    worst, total, n = 0.0, 0.0, 0
    for seq in result.sequences:
        full = np.concatenate([prompt, seq.tokens])
        datum = DatumData(full[:-1], {"target_tokens": full[1:]})
        res = engine.executor.apply(
            engine.models["m"], 1, ForwardLogprobsOp((datum,), temperature=0.9)
        )
        ref = np.asarray(res.logprobs[0])[prompt.size - 1 :]
        diff = np.abs(np.asarray(seq.logprobs, np.float64) - ref)
        worst, total, n = max(worst, float(diff.max())), total + float(diff.sum()), n + diff.size
    max_tol, mean_tol = logprob_tolerance(ctx.device, dtype)
    mean = total / n
    assert worst <= max_tol and mean <= mean_tol, (
        f"{dtype}: max |diff| {worst:.2e} (<= {max_tol}), mean {mean:.2e} (<= {mean_tol})"
    )
    return f"{dtype}: {n} tokens, max |diff| {worst:.1e}, mean {mean:.1e}"


# ---- 2. remote equals local --------------------------------------------------------------


def _hf_model(ctx: Ctx) -> torch.nn.Module:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ctx.model_dir))
    return model.to(device=ctx.device, dtype=torch.float32).train()


def _hf_logprobs(model: torch.nn.Module, datum: DatumData, device: str) -> torch.Tensor:
    tokens = torch.as_tensor(datum.tokens, device=device)[None]
    logits = model(input_ids=tokens).logits[0].float()
    targets = torch.as_tensor(datum.inputs["target_tokens"], device=device)
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]


def _ppo_loss(lp: torch.Tensor, datum: DatumData, device: str) -> torch.Tensor:
    """docs/losses.md's PPO: sum of w * -min(r A, clip(r, 0.8, 1.28) A)."""
    inp = {
        k: torch.as_tensor(v, device=device, dtype=torch.float32) for k, v in datum.inputs.items()
    }
    ratio = torch.exp(lp - inp["logprobs"])
    adv = inp["advantages"]
    return (inp["weights"] * -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)).sum()


def check_remote_equals_local(ctx: Ctx, loss: str, steps: int = 3) -> str:
    """A full fine-tune's ``steps`` optimizer steps (two ForwardBackward calls each)
    through the engine equal the same steps in plain torch on the same device."""
    engine = _engine(ctx, "float32")
    _create(engine, _spec("m", "float32", rank=0))
    model = engine.models["m"]
    ref = _hf_model(ctx)
    adam = AdamConfig(learning_rate=1e-3, eps=1e-5, weight_decay=0.01)
    opt = torch.optim.AdamW(
        ref.parameters(),
        lr=adam.learning_rate,
        betas=(adam.beta1, adam.beta2),
        eps=adam.eps,
        weight_decay=adam.weight_decay,
    )
    rng = np.random.default_rng(0)
    vocab = model.cfg.vocab_size
    seq = 1
    worst_loss = 0.0
    for _ in range(steps):
        opt.zero_grad()
        for _call in range(2):
            data = [_sft_datum(rng, int(rng.integers(8, 20)), vocab) for _ in range(3)]
            if loss == "ppo":
                data = [
                    DatumData(
                        d.tokens,
                        d.inputs
                        | {
                            "logprobs": rng.normal(-4.0, 0.3, d.tokens.size).astype(np.float32),
                            "advantages": rng.normal(0, 1, d.tokens.size).astype(np.float32),
                        },
                    )
                    for d in data
                ]
            config = (
                {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28} if loss == "ppo" else {}
            )
            op = ForwardBackwardOp(tuple(data), "ppo" if loss == "ppo" else "cross_entropy", config)
            got = engine.executor.apply(model, seq, op)
            seq += 1
            want = torch.zeros((), device=ctx.device)
            for d in data:
                lp = _hf_logprobs(ref, d, ctx.device)
                want = want + (_ppo_loss(lp, d, ctx.device) if loss == "ppo" else -lp.sum())
            want.backward()
            want_f = float(want.detach())
            rel = abs(got.metrics["loss:sum"] - want_f) / max(1.0, abs(want_f))
            worst_loss = max(worst_loss, rel)
        engine.executor.apply(model, seq, OptimStepOp(adam))
        seq += 1
        opt.step()
    mine = dict(model.params.named_tensors())
    theirs = dict(ref.named_parameters())
    with torch.no_grad():
        num = sum(float((mine[n] - theirs[n]).float().norm()) ** 2 for n in mine if n in theirs)
        den = sum(float(theirs[n].float().norm()) ** 2 for n in mine if n in theirs)
    rel_w = math.sqrt(num / den)
    assert worst_loss <= 1e-4, f"{loss}: a step's loss differs by {worst_loss:.2e} relative"
    assert rel_w <= 1e-4, f"{loss}: weights differ by {rel_w:.2e} of ||W|| after {steps} steps"
    return f"{loss} x{steps} steps: loss rel {worst_loss:.1e}, ||dW||/||W|| {rel_w:.1e}"


# ---- 3. multi-LoRA batched -----------------------------------------------------------------


def check_multi_lora_batched(ctx: Ctx, dtype: str, tenants: int = 4) -> str:
    """``tenants`` LoRA models' ForwardBackward calls as one batched pass equal the
    same calls one at a time: losses and gradients."""
    engine = _engine(ctx, dtype)
    rng = np.random.default_rng(1)
    ops = []
    for i in range(tenants):
        _create(engine, _spec(f"m{i}", dtype, rank=4 + 4 * i, seed=i))
        vocab = engine.models[f"m{i}"].cfg.vocab_size
        data = tuple(_sft_datum(rng, int(rng.integers(6, 24)), vocab) for _ in range(2))
        ops.append(ForwardBackwardOp(data, "cross_entropy", {}))
    models = [engine.models[f"m{i}"] for i in range(tenants)]
    for m in models:  # distinct adapters: B away from zero
        with torch.no_grad():
            for name, t in m.trainable.items():
                if "lora_B" in name:
                    t.normal_(0, 0.02, generator=torch.Generator(t.device).manual_seed(len(name)))
    single = [trainer.forward_backward(m, op) for m, op in zip(models, ops, strict=True)]
    grads = [{n: t.grad.clone() for n, t in m.trainable.items()} for m in models]
    for m in models:
        m.optimizer.zero_grad()
    calls = [BatchCall(m, op) for m, op in zip(models, ops, strict=True)]
    run_batch(calls, lambda _op: None)
    tol = 2e-2 if dtype == "bfloat16" else 1e-4
    worst_g, worst_l = 0.0, 0.0
    for call, one, g, m in zip(calls, single, grads, models, strict=True):
        assert not isinstance(call.outcome, Exception), call.outcome
        a, b = call.outcome.metrics["loss:sum"], one.metrics["loss:sum"]
        worst_l = max(worst_l, abs(a - b) / max(1.0, abs(b)))
        num = sum(float((m.trainable[n].grad.float() - g[n].float()).norm()) ** 2 for n in g)
        den = sum(float(g[n].float().norm()) ** 2 for n in g)
        worst_g = max(worst_g, math.sqrt(num / max(den, 1e-30)))
    assert worst_l <= tol / 10 and worst_g <= tol, (
        f"{dtype}: loss rel {worst_l:.2e}, gradient rel {worst_g:.2e} (tol {tol})"
    )
    return f"{dtype} x{tenants}: loss rel {worst_l:.1e}, grad rel {worst_g:.1e}"


# ---- 4. continuous batching -----------------------------------------------------------------


def check_continuous_batching(ctx: Ctx, dtype: str) -> str:
    """Requests sampled together (rows joining and leaving the running batch) draw
    the same tokens as each one alone, with the same seeds."""
    prompts = [np.arange(5, 5 + n) for n in (7, 12, 4, 15)]
    lengths = [9, 17, 5, 12]

    def op(i: int) -> SampleOp:
        return SampleOp(
            prompts[i], 2, SamplingConfig(max_tokens=lengths[i], seed=100 + i, ignore_eos=True)
        )

    together_engine = _engine(ctx, dtype)
    together = _drive(
        together_engine,
        [_sample(together_engine, SamplerTarget("tiny"), op(i)) for i in range(len(prompts))],
    )
    alone_engine = _engine(ctx, dtype)
    alone = [
        _drive(alone_engine, [_sample(alone_engine, SamplerTarget("tiny"), op(i))])[0]
        for i in range(len(prompts))
    ]
    tokens = 0
    for a, b in zip(together, alone, strict=True):
        for s, t in zip(a.sequences, b.sequences, strict=True):
            np.testing.assert_array_equal(s.tokens, t.tokens)
            tokens += s.tokens.size
    return f"{dtype}: {tokens} tokens, identical together and alone"


# ---- 5. in-flight updates ----------------------------------------------------------------


def check_inflight_spans(ctx: Ctx, dtype: str) -> str:
    """A ``latest`` request running across an in-flight SyncWeights reports two
    version spans; a pinned one stays on its version."""
    engine = _engine(ctx, dtype)
    _create(engine, _spec("m", dtype))
    prompt = np.arange(5, 17)
    op = SampleOp(prompt, 2, SamplingConfig(max_tokens=12, seed=7, ignore_eos=True))
    latest = _sample(engine, SamplerTarget("tiny", "m"), op)
    pinned = _sample(engine, SamplerTarget("tiny", "m", version=0), op)
    (sampler,) = engine.sampler.core.samplers.values()

    def latest_rows() -> list:
        return [r for r in sampler.running if r.request.latest_of == "m"]

    while not latest_rows() or len(latest_rows()[0].tokens) < 4:
        sampler.step()
    model = engine.models["m"]
    rng = np.random.default_rng(2)
    data = (_sft_datum(rng, 20, model.cfg.vocab_size),)
    engine.executor.apply(model, 1, ForwardBackwardOp(data, "cross_entropy", {}))
    engine.executor.apply(model, 2, OptimStepOp(AdamConfig(learning_rate=5e-2)))
    engine.executor.apply(
        model, 3, SyncWeightsOp(inflight=True)
    )  # swaps at once: no sampler thread
    a, b = _drive(engine, [latest, pinned])
    for s in a.sequences:
        assert s.versions == ((0, 4, 0), (4, 8, 1)), s.versions
    for s in b.sequences:
        assert s.versions == ((0, 12, 0),), s.versions
    return f"{dtype}: latest rows (0,4,v0)+(4,8,v1), pinned (0,12,v0)"


# ---- 6. out of memory ---------------------------------------------------------------------


def _oom_source(device: str) -> Callable[[], None]:
    """Something that runs out of memory: a real allocation beyond the GPU, or on
    the CPU (where an allocation failure is not torch's OutOfMemoryError) the error
    itself, injected."""
    if device.startswith("cuda"):

        def allocate() -> None:
            free, total = torch.cuda.mem_get_info(torch.device(device))
            torch.empty(int(total) * 2, dtype=torch.uint8, device=device)

        return allocate

    def inject() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 TiB (injected)")

    return inject


def check_oom(ctx: Ctx, dtype: str) -> str:
    """Out of memory in a ForwardBackward, an OptimStep-free model's SyncWeights
    and a sample: RESOURCE_EXHAUSTED with a message; the model stays at its last
    applied step (gradients and version as before); another model and the
    sampler keep serving."""
    engine = _engine(ctx, dtype).start()
    try:
        for name in ("a", "b"):
            engine.create_model(_spec(name, dtype)).result(timeout=300)
        rng = np.random.default_rng(3)
        vocab = engine.models["a"].cfg.vocab_size
        fb = ForwardBackwardOp((_sft_datum(rng, 12, vocab),), "cross_entropy", {})
        engine.submit("a", 1, fb, "d1").result(timeout=300)
        before = {n: t.grad.clone() for n, t in engine.models["a"].trainable.items()}
        used = torch.cuda.memory_allocated(ctx.device) if ctx.device.startswith("cuda") else 0

        real = trainer.forward_hidden
        boom = _oom_source(ctx.device)

        def failing(*args: object, **kwargs: object) -> torch.Tensor:
            boom()
            return real(*args, **kwargs)  # type: ignore[arg-type]

        trainer.forward_hidden = failing  # type: ignore[assignment]
        try:
            err = engine.submit("a", 2, fb, "d2").exception(timeout=300)
        finally:
            trainer.forward_hidden = real  # type: ignore[assignment]
        assert isinstance(err, ResourceExhaustedError), repr(err)
        assert "out of device memory" in str(err), str(err)
        model = engine.models["a"]
        assert model.version == 0
        for n, t in model.trainable.items():
            assert torch.equal(t.grad, before[n]), f"{n}: the failed call changed a gradient"
        if ctx.device.startswith("cuda"):
            assert torch.cuda.memory_allocated(ctx.device) <= used + (1 << 20)
        # an optim_step that runs out (its scratch is its first large allocation): no change
        real_scratch = optimizer._scratch

        def failing_scratch(*args: object, **kwargs: object) -> torch.Tensor | None:
            boom()
            return real_scratch(*args, **kwargs)  # type: ignore[arg-type]

        optimizer._scratch = failing_scratch  # type: ignore[assignment]
        try:
            step = OptimStepOp(AdamConfig(learning_rate=1e-3))
            err = engine.submit("a", 3, step, "d3").exception(timeout=300)
        finally:
            optimizer._scratch = real_scratch  # type: ignore[assignment]
        assert isinstance(err, ResourceExhaustedError), repr(err)
        assert model.version == 0 and model.optimizer.step_count == 0
        for n, t in model.trainable.items():
            assert torch.equal(t.grad, before[n]), f"{n}: the failed step changed a gradient"
        # a batched pass of two models (the engine is idle: no call in flight) fails
        # whole, each call RESOURCE_EXHAUSTED, no gradient added
        calls = [BatchCall(engine.models["a"], fb), BatchCall(engine.models["b"], fb)]
        batching.forward_hidden = failing  # type: ignore[assignment]
        try:
            run_batch(calls, lambda _op: None)
        finally:
            batching.forward_hidden = real  # type: ignore[assignment]
        for call in calls:
            assert isinstance(call.outcome, ResourceExhaustedError), repr(call.outcome)
        for n, t in model.trainable.items():
            assert torch.equal(t.grad, before[n]), f"{n}: the failed batch changed a gradient"
        assert all(t.grad is None for t in engine.models["b"].trainable.values())
        # the model goes on from its last applied call; the other model serves too
        engine.submit("a", 4, fb, "d4").result(timeout=300)
        engine.submit("a", 5, OptimStepOp(AdamConfig(learning_rate=1e-3)), "d5").result(timeout=300)
        engine.submit("b", 1, fb, "e1").result(timeout=300)
        assert engine.models["a"].version == 1

        # a sample that runs out of memory fails alone; the next one is served
        sampler_step = None

        def sample() -> Future[SampleResult]:
            op = SampleOp(
                np.arange(5, 12), 2, SamplingConfig(max_tokens=6, seed=1, ignore_eos=True)
            )
            return engine.sample(SamplerTarget("tiny", "b"), op)

        sample().result(timeout=300)  # the sampler exists now
        (sampler,) = engine.sampler.core.samplers.values()
        sampler_step = sampler.step

        def failing_step() -> None:
            boom()

        sampler.step = failing_step  # type: ignore[method-assign]
        try:
            err = sample().exception(timeout=300)
        finally:
            sampler.step = sampler_step  # type: ignore[method-assign]
        assert isinstance(err, ResourceExhaustedError), repr(err)
        assert len(sample().result(timeout=300).sequences) == 2
    finally:
        engine.stop()
    return f"{dtype}: forward_backward, optim_step, batched pass, sample -> RESOURCE_EXHAUSTED; model at its step"


#: every check and the arguments it runs with: (name, function, kwargs)
from tests.gpu.checks_sync import check_decode_reads, check_memory_sizing  # noqa: E402

CHECKS: list[tuple[str, Callable[..., str], dict[str, object]]] = [
    ("logprob agreement fp32", check_logprob_agreement, {"dtype": "float32"}),
    ("logprob agreement bf16", check_logprob_agreement, {"dtype": "bfloat16"}),
    ("remote = local SFT", check_remote_equals_local, {"loss": "sft"}),
    ("remote = local PPO", check_remote_equals_local, {"loss": "ppo"}),
    ("multi-LoRA batched fp32", check_multi_lora_batched, {"dtype": "float32"}),
    ("multi-LoRA batched bf16", check_multi_lora_batched, {"dtype": "bfloat16"}),
    ("continuous batching", check_continuous_batching, {"dtype": "float32"}),
    ("in-flight update spans", check_inflight_spans, {"dtype": "float32"}),
    ("out of memory", check_oom, {"dtype": "float32"}),
    ("decode reads once a step", check_decode_reads, {"dtype": "float32"}),
    ("memory sizing", check_memory_sizing, {"dtype": "float32"}),
]
