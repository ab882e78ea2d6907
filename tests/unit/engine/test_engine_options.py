"""The engine options are declared once, in ``EngineOptions``: ``ServerConfig``,
``WorkerConfig`` and the ``EngineConfig`` they become all extend it without declaring
an option again, and the flags default to the options' defaults."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest

from treadle.server.config import ServerConfig
from treadle.workers.engine import flags
from treadle.workers.engine.loop import EngineConfig
from treadle.workers.engine.options import ENGINE_FIELDS, EngineOptions
from treadle.workers.worker.config import WorkerConfig


def _declared_by(cls: type) -> set[str]:
    """The fields ``cls`` itself declares (a redeclared option counts)."""
    return set(cls.__dict__.get("__annotations__", {}))


def test_server_worker_and_engine_configs_extend_the_one_engine_options_class() -> None:
    assert len(ENGINE_FIELDS) == len(set(ENGINE_FIELDS)) == 26
    for config in (ServerConfig, WorkerConfig, EngineConfig):
        assert issubclass(config, EngineOptions)
        own = _declared_by(config)
        assert own, config
        assert not own & set(ENGINE_FIELDS), (config, own & set(ENGINE_FIELDS))
        assert set(ENGINE_FIELDS) <= {f.name for f in dataclasses.fields(config)}


def test_an_engine_config_takes_its_base_models_first_and_the_options_by_name() -> None:
    config = EngineConfig({"tiny": "/m"}, threads=2, sampler_prefill_slots=4)
    assert (config.base_models, config.threads, config.sampler_prefill_slots) == (
        {"tiny": "/m"},
        2,
        4,
    )
    assert config.keep_versions == EngineOptions().keep_versions


def test_the_flags_default_to_the_options_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("TREADLE_")]:
        monkeypatch.delenv(name)
    parser = argparse.ArgumentParser()
    flags.add_engine_flags(parser)
    settings = flags.engine_settings(parser.parse_args([]))
    defaults = dataclasses.asdict(EngineOptions())
    # --device and --dtype default to "auto", resolved on the host: not compared
    resolved_here = {"device", "default_dtype"}
    assert {k: v for k, v in settings.items() if k not in resolved_here} == {
        k: defaults[k] for k in settings if k not in resolved_here
    }
    assert set(ENGINE_FIELDS) - set(settings) == {"max_tokens_per_call"}  # not a flag


def test_an_on_off_variable_turns_its_option_on_and_zero_turns_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for value, on in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv("TREADLE_ACTIVATION_CHECKPOINTING", value)
        parser = argparse.ArgumentParser()
        flags.add_engine_flags(parser)
        assert parser.parse_args([]).activation_checkpointing is on, value
