"""Training routes: models, forward_backward, optim_step, weights.

Each work route answers ``{request_id}`` as soon as the service layer has
admitted the call (so NOT_FOUND, a bad ``seq_id`` or a quota's 429 come back on
the request itself) and leaves the result to ``retrieve_future``. Ordering,
dedupe, tenancy, quotas and usage are the service layer's
(``server.service``): a call here is the same call as over gRPC.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

from fastapi import Depends, Request

from treadle.common.engine.domain import ForwardBackwardOp, ForwardResult
from treadle.common.engine.losses import CONTRACTS, unserved_loss
from treadle.errors import InvalidArgumentError, TreadleError
from treadle.server.http import wire
from treadle.server.http.auth import tenant
from treadle.server.http.futures import Encoder
from treadle.server.http.state import HttpState, api_router, state
from treadle.server.service import CallHandle, run_metadata
from treadle.server.service.types import NewModel, OrderedCall, parse

router = api_router()


async def _await(handle: CallHandle[Any]) -> Any:
    return await handle


async def submit(
    st: HttpState,
    tenant_id: str,
    method: Callable[..., Awaitable[Any]],
    *args: Any,
    encode: Encoder,
    model_id: str = "",
) -> dict[str, Any]:
    """Start an ordered call; answer once it is admitted (its refusal is the answer)."""
    handle: CallHandle[Any] = CallHandle.start(method, tenant_id, *args)
    await handle.admitted()
    request_id = st.futures.start(tenant_id, _await(handle), encode)
    return {"request_id": request_id, "model_id": model_id or None}


def _seq_id(body: dict[str, Any]) -> int:
    seq = wire.field(body, "seq_id", int)
    if seq < 1:
        raise InvalidArgumentError(f"seq_id: must be >= 1 (got {seq})")
    return int(seq)


def _call(st: HttpState, tenant_id: str, body: dict[str, Any], payload: Any) -> OrderedCall:
    model_id = st.names.model_id(tenant_id, body.get("model_id"))
    return OrderedCall(model_id, _seq_id(body), wire.digest(payload))


# ---- models ----------------------------------------------------------------------


@router.post("/create_model")
async def create_model(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    body = wire.json_body(await request.body())
    base_model = wire.field(body, "base_model", str)
    session_id = wire.field(body, "session_id", str, "")
    model_seq_id = wire.field(body, "model_seq_id", int, 0)
    _check_optimizer(body.get("optimizer_config"))
    metadata = run_metadata.check(body.get("user_metadata"))
    lora = body.get("lora_config")
    if lora is not None and not isinstance(lora, dict):
        raise InvalidArgumentError("lora_config: expected an object")
    if lora is None:
        req = NewModel(
            base_model=base_model, lora_rank=0, session_id=session_id, user_metadata=metadata
        )
    else:
        rank = wire.field(lora, "rank", int)
        if rank < 1:
            raise InvalidArgumentError(f"lora_config.rank: must be >= 1 (got {rank})")
        req = NewModel(
            base_model=base_model,
            lora_rank=rank,
            seed=wire.field(lora, "seed", int, 0),
            modules=(
                wire.field(lora, "train_attn", bool, True),
                wire.field(lora, "train_mlp", bool, True),
                wire.field(lora, "train_unembed", bool, True),
            ),
            session_id=session_id,
            user_metadata=metadata,
        )
    sdk_id = f"{session_id}:train:{model_seq_id}" if session_id else ""

    async def run() -> str:
        info = await st.service.models.create(tenant_id, req)
        if sdk_id:
            st.names.alias(tenant_id, sdk_id, info.model_id)
        return info.model_id

    return {"request_id": st.futures.once(tenant_id, ("create", sdk_id), run, _model_id)}


def _model_id(model_id: str) -> dict[str, Any]:
    return {"type": "create_model", "model_id": model_id}


def _check_optimizer(config: Any) -> None:
    if config is None:
        return
    if not isinstance(config, dict) or config.get("type", "adamw") != "adamw":
        kind = config.get("type") if isinstance(config, dict) else config
        raise InvalidArgumentError(
            f"optimizer_config: {kind!r} is not supported; treadle trains with AdamW"
        )


@router.post("/get_info")
async def get_info(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    body = wire.json_body(await request.body())
    model_id = st.names.model_id(tenant_id, body.get("model_id"))
    info = st.service.models.info(tenant_id, model_id)
    directory = st.ctx.config.models.get(info.base_model)
    arch = {m.name: m.arch for m in st.service.info.base_models()}.get(info.base_model)
    return {
        "type": "get_info",
        "model_id": body["model_id"],
        "model_data": {
            "arch": arch,
            "model_name": info.base_model,
            "tokenizer_id": str(Path(directory).resolve()) if directory else None,
        },
        "is_lora": info.is_lora,
        "lora_rank": info.lora_rank if info.is_lora else None,
        "model_name": info.base_model,
    }


@router.post("/unload_model")
async def unload_model(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    """Ends the model (tinker's unload ends the training run); its checkpoints stay."""
    body = wire.json_body(await request.body())
    model_id = st.names.model_id(tenant_id, body.get("model_id"))
    st.service.models.info(tenant_id, model_id)  # 404 now, not in the future

    async def run() -> str:
        await st.service.models.delete(tenant_id, model_id)
        return model_id

    rid = st.futures.start(
        tenant_id, run(), lambda m: {"type": "unload_model", "model_id": body["model_id"]}
    )
    return {"request_id": rid, "model_id": body["model_id"]}


# ---- forward_backward / optim_step ---------------------------------------------------


@router.post("/forward_backward")
async def forward_backward(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    raw = wire.decompress(await request.body(), request.headers.get("content-encoding"))
    if "json" in request.headers.get("content-type", ""):
        raise InvalidArgumentError(
            "body: forward_backward takes a protobuf tinker_public.ForwardBackwardRequest "
            "(Content-Type: application/x-protobuf), as tinker SDK >= 0.25 sends it"
        )
    msg = wire.parse_forward_backward(raw)
    call = _call(st, tenant_id, {"model_id": msg.model_id, "seq_id": msg.seq_id}, raw)
    op = parse(lambda: wire.forward_backward_op(msg))
    loss_fn = msg.loss_fn
    weights = _ce_weights(msg) if msg.forward_only and loss_fn == "cross_entropy" else None

    def encode(result: ForwardResult) -> bytes:
        return wire.forward_output(result, weights)

    if msg.forward_only:
        method = st.service.training.forward_logprobs
    else:
        method = st.service.training.forward_backward
    answer = await submit(st, tenant_id, method, call, op, encode=encode, model_id=msg.model_id)
    if not msg.forward_only and loss_fn not in CONTRACTS:
        # A loss we do not serve is a 400 on the request itself, naming the loss and
        # why; the call has taken its seq_id first (its recorded answer is the same
        # error), so the model's next call does not wait on a gap and the SDK's
        # TrainingClient goes on.
        raise unserved_loss(loss_fn)
    return answer


def _ce_weights(msg: Any) -> list[Any] | None:
    """forward() with cross_entropy reports its loss:sum too (from the logprobs)."""
    try:
        op = wire.forward_backward_op(type(msg)(data=msg.data, loss_fn="cross_entropy"))
    except TreadleError:
        return None
    assert isinstance(op, ForwardBackwardOp)
    return [d.inputs.get("weights") for d in op.data]


@router.post("/optim_step")
async def optim_step(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    body = wire.json_body(await request.body())
    call = _call(st, tenant_id, body, body)
    adam = parse(lambda: wire.adam(body))
    return await submit(
        st,
        tenant_id,
        st.service.training.optim_step,
        call,
        adam,
        encode=lambda r: {"type": "optim_step", "metrics": wire.metrics(r.metrics)},
        model_id=body.get("model_id", ""),
    )


# ---- weights -----------------------------------------------------------------------


def _name(body: dict[str, Any], seq_id: int, prefix: str) -> str:
    path = body.get("path")
    if path is None:
        return f"{prefix}-{seq_id:06d}"
    if not isinstance(path, str):
        raise InvalidArgumentError("path: expected a string (a checkpoint name)")
    return path


@router.post("/save_weights")
async def save_weights(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    """Weights and optimizer state (tinker's save_state), as a treadle checkpoint."""
    body = wire.json_body(await request.body())
    call = _call(st, tenant_id, body, body)
    name = _name(body, call.seq_id, "state")
    sdk_model = body["model_id"]
    return await submit(
        st,
        tenant_id,
        st.service.training.save_state,
        call,
        name,
        encode=lambda r: {"type": "save_weights", "path": st.names.weights_path(sdk_model, name)},
        model_id=sdk_model,
    )


#: tinker's ``SamplingClientKind`` -> the sampler a save makes (``sync_weights``)
SAMPLER_KINDS = {"snapshot": "version", "inflight": "latest"}


def _sampler_kind(body: dict[str, Any], ephemeral: bool) -> str:
    """The sampler the save makes: "version" (a snapshot), "latest" (the model's
    one inflight target) or "" (a named save makes none)."""
    kind = body.get("kind", "snapshot")
    if kind is None:
        kind = "snapshot"
    if kind not in SAMPLER_KINDS:
        raise InvalidArgumentError(f"kind: {kind!r}; choose from {sorted(SAMPLER_KINDS)}")
    if not ephemeral:
        if kind == "inflight":
            raise InvalidArgumentError(
                "kind: 'inflight' makes a sampling client (sampling_session_seq_id); "
                "a named save (path) is a snapshot"
            )
        return ""
    return SAMPLER_KINDS[kind]


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    """Publishes the weights as a new version (treadle's sync_weights): named, or
    with ``sampling_session_seq_id`` a sampler on them at once: pinned to the new
    version (``kind="snapshot"``), or following the model's latest weights
    (``kind="inflight"``: every inflight client of the model reads that one target,
    which each later inflight save moves, in flight for sequences being sampled)."""
    body = wire.json_body(await request.body())
    call = _call(st, tenant_id, body, body)
    sdk_model = body["model_id"]
    ephemeral = body.get("sampling_session_seq_id") is not None
    sampler = parse(lambda: _sampler_kind(body, ephemeral))
    name = None if ephemeral else _name(body, call.seq_id, "sampler")

    def encode(outcome: Any) -> dict[str, Any]:
        if ephemeral:
            return {"type": "save_weights_for_sampler", "sampling_session_id": outcome.sampler_id}
        assert name is not None
        path = st.names.sampler_path(tenant_id, call.model_id, name, outcome.version)
        return {
            "type": "save_weights_for_sampler",
            "path": path.replace(call.model_id, sdk_model, 1),
        }

    answer = await submit(
        st,
        tenant_id,
        st.service.training.sync_weights,
        call,
        sampler == "latest",
        sampler,
        encode=encode,
        model_id=sdk_model,
    )
    if isinstance(sampler, TreadleError):
        # A 400 on the request itself; the call took its seq_id first (its recorded
        # answer is the same error), so the model's next call does not wait on a gap.
        raise sampler
    return answer


@router.post("/load_weights")
async def load_weights(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    """Into an existing model (``model_id`` + ``seq_id``, an ordered call), or a new
    model made from the checkpoint (``session_id`` + ``model_seq_id``)."""
    body = wire.json_body(await request.body())
    uri = st.names.state_uri(tenant_id, body.get("path"))
    optimizer = wire.field(body, "optimizer", bool, True)
    if body.get("model_id") is not None:
        call = _call(st, tenant_id, body, body)
        sdk_model = body["model_id"]
        return await submit(
            st,
            tenant_id,
            partial(st.service.training.load_state, optimizer=optimizer),
            call,
            uri,
            encode=lambda r: {"type": "load_weights", "path": body["path"], "model_id": sdk_model},
            model_id=sdk_model,
        )
    session_id = wire.field(body, "session_id", str)
    model_seq_id = wire.field(body, "model_seq_id", int)
    metadata = run_metadata.check(body.get("user_metadata"))
    sdk_id = f"{session_id}:train:{model_seq_id}"

    async def run() -> str:
        info = await st.service.models.create(
            tenant_id,
            NewModel(
                from_state=uri,
                session_id=session_id,
                weights_only=not optimizer,
                user_metadata=metadata,
            ),
        )
        st.names.alias(tenant_id, sdk_id, info.model_id)
        return info.model_id

    rid = st.futures.once(
        tenant_id,
        ("create", sdk_id),
        run,
        lambda _: {"type": "load_weights", "path": body["path"], "model_id": sdk_id},
    )
    return {"request_id": rid, "model_id": sdk_id}
