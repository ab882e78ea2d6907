"""The engine options are declared once: ``ServerConfig`` and ``WorkerConfig`` extend
``EngineOptions``, and each option names a field of the ``EngineConfig`` it becomes."""

from __future__ import annotations

import dataclasses

from treadle.server.config import ServerConfig
from treadle.workers.engine.loop import EngineConfig
from treadle.workers.engine.options import ENGINE_FIELDS, EngineOptions
from treadle.workers.worker.config import WorkerConfig


def test_server_and_worker_configs_extend_the_one_engine_options_class() -> None:
    for config in (ServerConfig, WorkerConfig):
        assert issubclass(config, EngineOptions)
        own = {f.name for f in dataclasses.fields(config)} - set(ENGINE_FIELDS)
        assert own and not own & set(ENGINE_FIELDS)


def test_every_engine_option_is_a_field_of_engine_config() -> None:
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(ENGINE_FIELDS) <= engine
    assert len(ENGINE_FIELDS) == len(set(ENGINE_FIELDS)) == 18
