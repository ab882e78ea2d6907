"""The sharded full fine-tune on an FSDP2 without
``FSDPModule.set_reduce_scatter_unused_params``, as torch 2.11's (the GPU host's:
its ``torch/distributed/fsdp/_fully_shard/_fully_shard.py`` has no such method;
2.13, which we develop on, has it): ``fsdp.build`` goes without it, and two ranks still equal
one (``test_fsdp``'s steps, a call rank 1 has no datum of included), since every
rank's pass gives every weight a gradient."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.fsdp import FSDPModule

from tests.unit.trainer import test_fsdp
from tests.unit.trainer.two_ranks import on_two_ranks
from treadle.workers.model.tiny import build_tiny_model

pytestmark = pytest.mark.slow


def _rank_on_fsdp_of_torch_2_11(rank: int, model_dir: Path, out: Path) -> None:
    del FSDPModule.set_reduce_scatter_unused_params  # this process only
    assert not hasattr(FSDPModule, "set_reduce_scatter_unused_params")
    test_fsdp._rank(rank, model_dir, out)


def test_fsdp_without_the_unused_params_setter_equals_one_rank(tmp_path: Path) -> None:
    model_dir = build_tiny_model(
        tmp_path / "tiny", "tiny", 0, overrides={"vocab_size": 97, "intermediate_size": 99}
    )
    on_two_ranks(_rank_on_fsdp_of_torch_2_11, model_dir, tmp_path)
