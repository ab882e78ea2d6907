"""The torch sampler's decode step reads the device once per step.

On CUDA every read of a device value (``.cpu()``, ``.tolist()``, ``.item()``,
``bool()``/``int()`` of a tensor, ``torch.equal``) makes the host wait for the
GPU. The step must choose every row's token on the device and read all of them
back in one copy, whatever the batch mixes (several sets of base weights, LoRA
rows beside base rows, greedy and truncated sampling). The same code runs on
the CPU, so the reads are counted here, on the CPU, with a torch function mode;
reads of the step's own host copy (its values once on the host) are not device
reads and are not counted.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch

from tests.gpu.checks_sync import DeviceReads
from treadle.common.engine.domain import SampleOp, SampleResult, SamplingConfig
from treadle.workers.engine.base_models import BaseModelRegistry
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.model.lora import LoraAdapter
from treadle.workers.sampler.backend import SampleJob
from treadle.workers.sampler.state import SamplerLimits
from treadle.workers.sampler.torch_sampler import TorchSampler

torch.set_num_threads(1)


def test_a_decode_step_reads_the_device_once(tiny_model_dir: Path) -> None:
    base = BaseModelRegistry({"tiny": tiny_model_dir}).get("tiny", torch.float32)
    limits = SamplerLimits(num_slots=16, max_len=96, prepack=False)  # prepacking: the CPU only
    sampler = TorchSampler(base, limits=limits)
    adapter = LoraAdapter(base.cfg, 4, 8.0, seed=1, requires_grad=False)
    for b in adapter.b:  # a non-zero update, so the LoRA rows differ from the base ones
        for t in b.values():
            t.normal_(0, 0.05)
    snapshots = [
        WeightSnapshot(None, 0, base.params, None),  # base rows
        WeightSnapshot("lora", 1, base.params, adapter),  # LoRA rows in the same forward
        WeightSnapshot("full", 2, base.params.clone(), None),  # other weights: another forward
    ]
    params = [
        SamplingConfig(max_tokens=40, seed=1, ignore_eos=True),
        SamplingConfig(max_tokens=40, seed=2, ignore_eos=True, top_k=5, top_p=0.9),
        SamplingConfig(max_tokens=40, temperature=0.0, ignore_eos=True),
    ]
    futures = []
    rng = np.random.default_rng(0)
    for snap, p in zip(snapshots, params, strict=True):
        for _ in range(2):
            fut: Future[SampleResult] = Future()
            prompt = rng.integers(3, base.cfg.vocab_size, 6)
            sampler.submit(SampleJob(sampler.base, SampleOp(prompt, 2, p), snap), fut)
            futures.append(fut)
    while sampler.queue or sampler.prefilling:
        sampler.step()
    rows = len(sampler.running)
    assert rows == 12
    for _ in range(5):
        before = [len(r.tokens) for r in sampler.running]
        with DeviceReads() as mode:
            sampler.step()
        assert [len(r.tokens) for r in sampler.running] == [n + 1 for n in before]
        assert mode.reads == ["cpu"], mode.reads  # one copy for all 12 rows, 2 forwards
    while sampler.has_work():
        sampler.step()
    for fut in futures:
        assert all(s.tokens.size == 40 for s in fut.result(0).sequences)


def test_the_counter_sees_a_per_row_read() -> None:
    """The mode catches what the test guards against (else it could not fail)."""
    logits_B_V = torch.randn(4, 10)
    with DeviceReads() as mode:
        tokens = [int(row.argmax()) for row in logits_B_V]
    assert len(tokens) == 4 and mode.reads == ["__int__"] * 4
