"""bf16 end to end on CPU, and the samplers' live metrics in GetServerInfo (issue 5).

A server started with ``default_dtype="bfloat16"`` (``treadle serve --dtype
bfloat16``) loads base weights in bf16; a LoRA model created without a dtype
trains in bf16, and its sampler (and the base sampler) decode in bf16 too, so
trainer and sampler use one dtype for a model. Their logprobs for the same
tokens then agree to bf16 precision.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import treadle
from tests.conftest import make_server
from treadle import rl
from treadle.server.embedded import EmbeddedServer

BF16_TOLERANCE = 0.1  # bf16 has 8 bits of mantissa; cached decode vs one padded forward


@pytest.fixture(scope="module")
def bf16_service(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[tuple[EmbeddedServer, treadle.ServiceClient]]:
    srv = make_server(
        tmp_path_factory.mktemp("bf16"), {"tiny": tiny_model_dir}, default_dtype="bfloat16"
    )
    client = treadle.ServiceClient(srv.address, api_key=srv.api_key)
    yield srv, client
    client.close()
    srv.stop()


def _sft_data(tok: treadle.Tokenizer) -> list[treadle.Datum]:
    seqs = [tok.encode(t) for t in ("12+3=15", "4*5=20", "Hello world")]
    return [
        treadle.Datum(
            model_input=treadle.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
        )
        for s in seqs
    ]


def test_bf16_trains_and_samples_in_one_dtype(
    bf16_service: tuple[EmbeddedServer, treadle.ServiceClient],
) -> None:
    srv, service = bf16_service
    info = service.get_server_info()
    assert [b.dtype for b in info.base_models] == ["bfloat16"]

    tc = service.create_lora_training_client("tiny", rank=4, seed=1)
    tok = tc.get_tokenizer()
    data = _sft_data(tok)
    losses = []
    for _ in range(4):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(treadle.AdamParams(learning_rate=5e-2))
        losses.append(fb.result().metrics["loss:sum"])
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]

    engine = srv.ctx.dispatcher.engine  # type: ignore[attr-defined]
    model = next(iter(engine.models.values()))
    assert model.base.dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for t in model.trainable.values())

    sampler = tc.sync_weights()
    prompt = tok.encode("12+3=")
    params = treadle.SamplingParams(max_tokens=12, temperature=1.0, seed=4)
    result = sampler.sample(prompt, 3, params).result()
    rollouts = [rl.Rollout.from_sequence(prompt, s) for s in result.sequences]
    assert all(len(r.completion_tokens) > 0 for r in rollouts)
    assert {dtype for _, dtype in engine.sampler.core.samplers} == {torch.bfloat16}

    datums = rl.build_datums(rollouts, [0.0] * len(rollouts), include_logprobs=False)
    probe = [
        treadle.Datum(d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"]})
        for d in datums
    ]
    out = tc.forward_logprobs(probe).result()
    for rollout, output in zip(rollouts, out.loss_fn_outputs, strict=True):
        n = len(rollout.completion_tokens)
        diff = np.abs(output.logprobs[-n:] - np.asarray(rollout.completion_logprobs)).max()
        print(f"bf16 max |sampler - trainer| = {diff:.3g}")
        assert diff < BF16_TOLERANCE, diff


def test_server_info_reports_sampler_metrics(
    bf16_service: tuple[EmbeddedServer, treadle.ServiceClient],
) -> None:
    _, service = bf16_service
    base = service.create_sampling_client(base_model="tiny")
    prompt = [5, 6, 7, 8]
    # The first request prefills the prompt; the two sent after it has finished
    # reuse its cached prefix (sent together, all three could prefill at once).
    base.sample(prompt, 4, treadle.SamplingParams(max_tokens=8, seed=0)).result()
    futures = [base.sample(prompt, 4, treadle.SamplingParams(max_tokens=8, seed=s)) for s in (1, 2)]
    for f in futures:
        f.result()
    metrics = {m.base_model: m for m in service.get_server_info().sampler_metrics}
    m = metrics["tiny"]
    assert m.dtype == "bfloat16"
    assert m.tokens_generated >= 3 * 4 * 1 and m.prompt_tokens >= len(prompt)
    assert m.prefix_reused_tokens >= len(prompt) - 1  # the same prompt, three times
    assert m.num_slots > 0 and m.queued_requests == 0 and m.running_rows == 0
    assert 0.0 < m.occupancy <= 1.0
