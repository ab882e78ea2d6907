"""Placement across workers, for real: three tenants run the RL loop (sample ->
forward_backward -> optim_step -> sync) at the same time on two workers; each
sees only its own models, weights and checkpoints; a checkpoint saved through
one worker loads through the other with identical weights and optimizer state
(and then trains identically)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import treadle
from treadle import rl
from treadle.errors import NotFoundError

from .cluster import BASE, TENANTS, Cluster, datum, saved_state

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _rl_loop(c: Cluster, tenant: str, seed: int, steps: int, out: dict[str, object]) -> None:
    """The SDK loop of one tenant: sample -> reward -> forward_backward -> optim_step -> sync."""
    service = c.client(tenant)
    tok = service.get_tokenizer(BASE)
    trainer = service.create_lora_training_client(BASE, rank=4, seed=seed)
    prompts, group = ["12+3=", "7+8="], 4
    adam = treadle.AdamParams(learning_rate=1e-2)
    versions = []
    for step in range(steps):
        sampler = trainer.sync_weights()
        futures = [
            sampler.sample(
                tok.encode(p), group, treadle.SamplingParams(max_tokens=4, seed=seed * 100 + step)
            )
            for p in prompts
        ]
        rollouts, rewards = [], []
        for p, fut in zip(prompts, futures, strict=True):
            for seq in fut.result().sequences:
                rewards.append(float(sum(ch.isdigit() for ch in tok.decode(seq.tokens))))
                rollouts.append(rl.Rollout.from_sequence(tok.encode(p), seq))
                versions.extend(span.version for span in seq.versions)
        adv = rl.group_advantages(np.array(rewards), group)
        data = rl.build_datums(rollouts, adv, aggregation="token_mean")
        fb = trainer.forward_backward(
            data, "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}
        )
        result = trainer.optim_step(adam)
        assert np.isfinite(fb.result().metrics["loss:sum"])
        assert result.result().step == step + 1
    trainer.sync_weights()
    out.update(model_id=trainer.model_id, versions=versions, info=trainer.get_info())


def test_three_tenants_two_workers(cluster: Cluster, tmp_path: Path) -> None:
    c = cluster
    # This module's name sorts first in the folder: the cluster's two workers are
    # still empty, so "least loaded first" is visible in where the models land.
    assert len(c.workers) == 2 and c.sql("SELECT id FROM models") == [], "run before the others"
    t0 = time.monotonic()
    results: dict[str, dict[str, object]] = {t: {} for t in TENANTS}
    errors: list[BaseException] = []

    def run(tenant: str, seed: int) -> None:
        try:
            _rl_loop(c, tenant, seed, 2, results[tenant])
        except BaseException as err:  # surfaced below, with the workers' logs
            errors.append(err)

    threads = [threading.Thread(target=run, args=(t, i)) for i, t in enumerate(TENANTS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(240)
    if errors:
        raise AssertionError(f"{errors[0]!r}\n{c.log_tail()}") from errors[0]
    loop_s = time.monotonic() - t0

    models = {t: str(results[t]["model_id"]) for t in TENANTS}
    for t in TENANTS:
        info = results[t]["info"]
        assert info.status == "active" and info.version == 2  # type: ignore[attr-defined]
        assert set(results[t]["versions"]) == {0, 1}  # type: ignore[arg-type]
    # placed least loaded first: both workers host models
    placed = {m: c.worker_of(m) for m in models.values()}
    assert set(placed.values()) == set(c.workers), placed

    # tenants are walls, across workers too
    for t in TENANTS:
        service = c.client(t)
        assert [m.model_id for m in service.list_models()] == [models[t]]
        for other in TENANTS:
            if other == t:
                continue
            with pytest.raises(NotFoundError):
                service.get_model_info(models[other])
            with pytest.raises(NotFoundError):
                service.create_sampling_client(weights=f"treadle://{models[other]}/v/1")

    # a checkpoint saved through one worker loads through the other, identically
    loads: dict[str, int] = {}
    for w in placed.values():
        loads[w] = loads.get(w, 0) + 1
    busy = max(loads, key=lambda w: loads[w])
    tenant = next(t for t in TENANTS if placed[models[t]] == busy)
    service = c.client(tenant)
    original = service.get_training_client(models[tenant])
    saved = original.save_state("portable").result()
    copy = service.create_training_client_from_state(saved.path)
    assert c.worker_of(copy.model_id) != busy  # the other worker, the least loaded one
    assert copy.get_info().version == 2
    copy.save_state("portable").result()
    a, b = saved_state(c, original.model_id, "portable"), saved_state(c, copy.model_id, "portable")
    assert a.keys() == b.keys() and any(k.startswith("o.") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # and they train on identically: same step, same optimizer moments
    tok = service.get_tokenizer(BASE)
    data = [datum(tok.encode("12+3=15")), datum(tok.encode("7+8=15"))]
    for tc in (original, copy):
        tc.forward_backward(data, "cross_entropy").result()
        assert tc.optim_step(treadle.AdamParams(learning_rate=1e-2)).result().step == 3
    out = [tc.forward_logprobs(data).result().loss_fn_outputs for tc in (original, copy)]
    for x, y in zip(out[0], out[1], strict=True):
        np.testing.assert_array_equal(x.logprobs, y.logprobs)
    # an export comes down from the worker through the store
    exported = copy.export_weights(tmp_path / "peft")
    assert (exported / "adapter_model.safetensors").is_file()
    assert (exported / "adapter_config.json").is_file()
    # streamed rollouts through a worker: each sample once, as sampled without a stream
    sampler = copy.sync_weights()
    params = treadle.SamplingParams(max_tokens=6, seed=11)
    prompt = tok.encode("4+4=")
    with sampler.sample_stream_sync(prompt, 3, params) as stream:
        streamed = {s.index: s.sequence for s in stream}
    whole = sampler.sample(prompt, 3, params).result().sequences
    assert sorted(streamed) == [0, 1, 2]
    for i, seq in enumerate(whole):
        np.testing.assert_array_equal(streamed[i].tokens, seq.tokens)
        np.testing.assert_allclose(streamed[i].logprobs, seq.logprobs, atol=1e-6)
    print(f"\n{c.name}: 3 tenants x 2 RL steps on 2 workers in {loop_s:.1f} s")
