"""ServiceClient: the entry point of the SDK, one per server connection."""

from __future__ import annotations

import hashlib
import os
import tempfile
import weakref
from pathlib import Path
from typing import Any

import grpc

from treadle import _convert
from treadle._local_key import local_api_key
from treadle._ordering import RESYNC_LOG_BYTES
from treadle._rpc import Caller, error_from_rpc, make_channel
from treadle.errors import InvalidArgumentError
from treadle.futures import APIFuture
from treadle.sampling_client import SamplingClient
from treadle.session import SessionKeeper
from treadle.tokenizer import Tokenizer
from treadle.training_client import TrainingClient
from treadle.types import ModelInfo, ServerInfo
from treadle.v1 import (
    sampling_pb2_grpc,
    server_pb2_grpc,
    training_pb2_grpc,
)

DEFAULT_ADDRESS = "localhost:50051"


class ServiceClient:
    """Connects to a treadle server.

    ``address`` defaults to env ``TREADLE_ADDRESS`` or ``localhost:50051``; the API
    key to env ``TREADLE_API_KEY``, and, for a server on this machine (a loopback
    address) when neither is given, to the key ``treadle serve`` wrote in its data
    dir (``$TREADLE_DATA_DIR`` or ``./treadle-data``, file ``api_key``), so a
    script run beside a local server needs no key. ``root_certificates`` (PEM
    bytes) turns on TLS.

    The client opens a session with the server when it creates its first model
    and heart-beats every ``heartbeat_s`` seconds (default: what the server asks,
    10 s; env ``TREADLE_HEARTBEAT_S``) from a daemon thread: models created
    through it stay loaded while it lives, however long the client thinks between
    calls. ``session=False`` opts out (then only calls keep a model loaded; an
    unloaded model comes back on its next call anyway). ``close()`` ends the session.

    When the server restarts and brings a model back at its last checkpoint,
    behind calls it had answered, the next call on the model raises
    ``ServerRestartedError`` at once (the model, its step and seq_id, the
    checkpoint); ``TrainingClient.resync()`` continues from there.
    ``auto_resync=True`` instead keeps every ordered request since each model's
    last ``save_state`` (at most ``resync_log_bytes`` per model) and replays
    the lost ones with their own seq_ids, so the loop goes on where it was.
    See docs/restarts.md.
    """

    def __init__(
        self,
        address: str | None = None,
        api_key: str | None = None,
        *,
        root_certificates: bytes | None = None,
        timeout_s: float | None = None,
        max_retries: int = 5,
        session: bool = True,
        heartbeat_s: float | None = None,
        auto_resync: bool = False,
        resync_log_bytes: int = RESYNC_LOG_BYTES,
    ) -> None:
        self.address = address or os.environ.get("TREADLE_ADDRESS", DEFAULT_ADDRESS)
        self.auto_resync = auto_resync
        self.resync_log_bytes = resync_log_bytes
        self._channel = make_channel(self.address, root_certificates)
        api_key = api_key or os.environ.get("TREADLE_API_KEY") or local_api_key(self.address)
        self._caller = Caller(api_key, max_retries=max_retries, timeout_s=timeout_s)
        self._training = training_pb2_grpc.TrainingServiceStub(self._channel)
        self._sampling = sampling_pb2_grpc.SamplingServiceStub(self._channel)
        self._server = server_pb2_grpc.ServerServiceStub(self._channel)
        self._tokenizers: dict[str, Tokenizer] = {}
        self._session = SessionKeeper(self._channel, self._caller, heartbeat_s) if session else None
        # Garbage-collected without close(): stop the heartbeats and close the
        # channel (no call to the server from a finalizer: the session lapses).
        self._release = weakref.finalize(self, _release, self._session, self._channel)

    @property
    def server_instance(self) -> str:
        """The id of the server process that answered last (new at each restart)."""
        return self._caller.server_instance

    @property
    def session_id(self) -> str | None:
        """The id of this client's session with the server (opened on first use)."""
        return self._session.ensure() if self._session is not None else None

    # ---- training clients -------------------------------------------------------

    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int = 0,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        *,
        alpha: float | None = None,
        dtype: str | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> TrainingClient:
        """A LoRA model on ``base_model``: an adapter of ``rank`` (scale ``alpha / rank``,
        alpha defaults to rank) on the modules the flags name, as in the tinker SDK:
        the MLP (gate/up/down), attention (q/k/v/o) and the unembedding (output head).

        The head matters most on a base whose head is not pretrained (the random-weight
        presets): without it the logits cannot sharpen and supervised loss stalls
        (docs/lora.md has measured ranks and learning rates).

        ``user_metadata``: your own string notes on the run, kept with it and
        returned by ``get_model_info`` (as the tinker SDK's ``user_metadata``).
        """
        if rank < 1:
            raise InvalidArgumentError(
                "rank: a LoRA rank must be at least 1 (use create_training_client for full fine-tuning)"
            )
        if not (train_mlp or train_attn or train_unembed):
            raise InvalidArgumentError(
                "train_mlp, train_attn, train_unembed: at least one must be True "
                "(all False leaves the adapter nothing to train)"
            )
        return self._create(
            base_model=base_model,
            lora_rank=rank,
            lora_alpha=alpha or 0.0,
            seed=seed,
            dtype=dtype or "",
            train_attn=train_attn,
            train_mlp=train_mlp,
            train_unembed=train_unembed,
            user_metadata=user_metadata or {},
        )

    def create_training_client(
        self,
        base_model: str,
        seed: int = 0,
        *,
        dtype: str | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> TrainingClient:
        """A full fine-tune: every weight trains (and every published version is a copy)."""
        return self._create(
            base_model=base_model,
            lora_rank=0,
            seed=seed,
            dtype=dtype or "",
            user_metadata=user_metadata or {},
        )

    def create_training_client_from_state(
        self,
        path: str,
        *,
        weights_only: bool = False,
        user_metadata: dict[str, str] | None = None,
    ) -> TrainingClient:
        """A new model initialised from a ``treadle://`` checkpoint (weights,
        optimizer state and step; with ``weights_only``, fresh Adam moments)."""
        return self._create(
            from_state=path, weights_only=weights_only, user_metadata=user_metadata or {}
        )

    def _create(self, **fields: Any) -> TrainingClient:
        if self._session is not None:
            fields["session_id"] = self._session.ensure()
        info = self._caller.call(
            self._training.CreateModel,
            _convert.create_model_request(**fields),
            _convert.model_info_from_wire,
        ).result()
        return TrainingClient(self, info)

    def get_training_client(self, model_id: str) -> TrainingClient:
        """Reattach to an existing model (continues at the server's next seq_id)."""
        return TrainingClient(self, self.get_model_info(model_id))

    def get_model_info(self, model_id: str) -> ModelInfo:
        return self._caller.call(
            self._training.GetModelInfo,
            _convert.model_info_request(model_id),
            _convert.model_info_from_wire,
        ).result()

    def list_models(self) -> list[ModelInfo]:
        return self._caller.call(
            self._training.ListModels,
            _convert.list_models_request(),
            lambda r: [_convert.model_info_from_wire(m) for m in r.models],
        ).result()

    def restore_model(self, model_id: str) -> ModelInfo:
        """Load a model the server unloaded for idling back from its checkpoint now
        (any call on it would do the same, transparently)."""
        return self._caller.call(
            self._training.RestoreModel,
            _convert.restore_model_request(model_id),
            _convert.model_info_from_wire,
        ).result()

    def delete_checkpoint(self, path: str) -> None:
        """Delete a ``treadle://<model_id>/state/<name>`` checkpoint and its files."""
        self._caller.call(
            self._training.DeleteCheckpoint,
            _convert.delete_checkpoint_request(path),
            lambda r: None,
        ).result()

    def delete_model(self, model_id: str) -> None:
        self._caller.call(
            self._training.DeleteModel,
            _convert.delete_model_request(model_id),
            lambda r: None,
        ).result()

    # ---- sampling ----------------------------------------------------------------

    def create_sampling_client(
        self,
        base_model: str | None = None,
        *,
        weights: str | None = None,
        model_path: str | None = None,
        placement: str | None = None,
    ) -> SamplingClient:
        """A sampler on ``base_model`` (no adapter), or on ``weights``: a
        ``treadle://<model_id>/v/<version>`` path (pinned) or
        ``treadle://<model_id>/latest`` (follows every ``sync_weights``).
        ``model_path`` is the tinker name for ``weights``.

        ``placement`` (a distributed server, docs/topologies.md): ``"colocated"``
        samples on the model's own worker, ``"pool"`` on the sampler workers of its
        base (with none: FailedPreconditionError naming the base, at once; a sampler
        whose pool workers are gone later answers UnavailableError when it samples),
        ``"auto"`` on the pool when there is one; None: the server's
        ``--sampler-placement``."""
        weights = weights or model_path
        if (base_model is None) == (weights is None):
            raise InvalidArgumentError(
                "create_sampling_client: give exactly one of base_model or weights"
            )
        request = _convert.create_sampler_request(base_model, weights, placement)
        info = self._caller.call(self._sampling.CreateSampler, request, _convert.sampler_from_wire)
        info.result()  # surface NOT_FOUND etc. here, where the user asked
        return SamplingClient(self, info)

    # ---- server ------------------------------------------------------------------

    def get_server_info(self) -> ServerInfo:
        return self._caller.call(
            self._server.GetServerInfo,
            _convert.server_info_request(),
            _convert.server_info_from_wire,
        ).result()

    def get_server_info_async(self) -> APIFuture[ServerInfo]:
        return APIFuture(
            self._caller.call(
                self._server.GetServerInfo,
                _convert.server_info_request(),
                _convert.server_info_from_wire,
            )
        )

    def get_tokenizer(self, base_model: str) -> Tokenizer:
        """Download (once) and load a base model's tokenizer files."""
        if base_model in self._tokenizers:
            return self._tokenizers[base_model]
        key = hashlib.sha256(f"{self.address}|{base_model}".encode()).hexdigest()[:16]
        cache_root = Path(os.environ.get("TREADLE_CACHE_DIR", Path.home() / ".cache" / "treadle"))
        directory = cache_root / "tokenizers" / key
        directory.mkdir(parents=True, exist_ok=True)
        files: dict[str, bytearray] = {}
        stream = self._server.GetTokenizer(
            _convert.tokenizer_request(base_model),
            metadata=self._caller.call_metadata(),
        )
        try:
            for chunk in stream:
                files.setdefault(chunk.file_name, bytearray()).extend(chunk.data)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        for name, data in files.items():
            # Atomic per file: other clients (threads, processes) may be loading the
            # same cached tokenizer while this one refreshes it.
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".part-")
            with os.fdopen(fd, "wb") as out:
                out.write(bytes(data))
            os.replace(tmp, directory / Path(name).name)
        tok = Tokenizer(directory)
        self._tokenizers[base_model] = tok
        return tok

    def close(self) -> None:
        """End the session, close the channel; no heartbeat thread is left running."""
        if self._session is not None:
            self._session.end()
        self._release()  # closes the channel: a beat in flight ends now
        if self._session is not None:
            self._session.join(timeout=5.0)

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release(session: SessionKeeper | None, channel: grpc.Channel) -> None:
    """What a client holds, let go: its heartbeats stopped, its channel closed."""
    if session is not None:
        session.stop()
    channel.close()
