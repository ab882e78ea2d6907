"""``create_server(config) -> (server, port)``: the whole server, wired once.

Applies the database migrations, starts the engine, restores every live model
from its last checkpoint, and registers the services, health checking and
reflection. Port 0 binds any free port (tests).
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from treadle.common.db import models as db
from treadle.common.engine.messages import CreateModelCall
from treadle.common.store import make_store, storage_path_str
from treadle.server.accounting.quotas import Quotas
from treadle.server.accounting.step_metrics import StepMetricsRecorder
from treadle.server.accounting.usage import UsageMeter
from treadle.server.auth import Authenticator, AuthInterceptor, bootstrap_default_tenant
from treadle.server.config import ServerConfig
from treadle.server.context import ServerContext
from treadle.server.db import make_engine, make_session_factory, queries, tenancy, upgrade_to_head
from treadle.server.dispatch import Backend, InProcessDispatcher
from treadle.server.metrics import ServerMetrics
from treadle.server.restarts import RestorePoint
from treadle.server.rpc import convert
from treadle.server.rpc.info_servicer import InfoServicer
from treadle.server.rpc.interceptors import DecodeInterceptor, ErrorInterceptor, ObserveInterceptor
from treadle.server.rpc.sampling_servicer import SamplingServicer
from treadle.server.rpc.session_servicer import SessionServicer
from treadle.server.rpc.training_servicer import TrainingServicer
from treadle.v1 import (
    sampling_pb2,
    sampling_pb2_grpc,
    server_pb2,
    server_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
    training_pb2,
    training_pb2_grpc,
)
from treadle.wire.channel import channel_options
from treadle.workers.device import host_allocator
from treadle.workers.engine import flags as engine_flags
from treadle.workers.engine.collector import EngineCollector
from treadle.workers.engine.loop import EngineConfig
from treadle.workers.engine.staging import StagedEngine
from treadle.workers.group.launch import build_engine, restart_or_exit

log = logging.getLogger("treadle.server")

SERVICE_NAMES = (
    training_pb2.DESCRIPTOR.services_by_name["TrainingService"].full_name,
    sampling_pb2.DESCRIPTOR.services_by_name["SamplingService"].full_name,
    server_pb2.DESCRIPTOR.services_by_name["ServerService"].full_name,
    session_pb2.DESCRIPTOR.services_by_name["SessionService"].full_name,
)


def prepare_process(config: ServerConfig) -> None:
    """What this process sets before its threads start when it will run the engine
    on the CPU: the host allocator (``workers.device.host_allocator``; the engine sets it
    too, but by then other threads may have malloc arenas of their own)."""
    if not config.broker and config.device == "cpu":
        host_allocator.configure(config.host_allocator)


def engine_config(config: ServerConfig) -> EngineConfig:
    return engine_flags.engine_config(config, config.models, config.checkpoint_root)


async def restore_models(ctx: ServerContext) -> int:
    """Bring every live model back at its last checkpoint (or its creation state)."""
    restored = 0
    with ctx.session() as s:
        rows = s.query(db.Model).filter(db.Model.status == "active").all()
        plans = []
        for row in rows:
            ckpt = row.last_checkpoint
            spec = convert.model_spec(row)
            plans.append(
                (
                    spec,
                    ckpt.storage_path if ckpt else None,
                    ckpt.seq_id if ckpt else 0,
                    ckpt.uri if ckpt else "",
                )
            )
    for spec, path, seq, uri in plans:
        try:
            await ctx.dispatcher.call(
                CreateModelCall(spec, storage_path_str(path) if path else None, seq + 1)
            )
        except Exception as err:  # a model we cannot restore is marked lost, not hidden
            log.error("could not restore model %s: %s", spec.model_id, err)
            with ctx.session() as s:
                queries.set_model_status(s, spec.model_id, "lost")
            ctx.owners[spec.model_id] = spec.tenant_id  # still its tenant's: load_state restores it
            continue
        ctx.owners[spec.model_id] = spec.tenant_id
        status = ctx.dispatcher.model_status(spec.model_id)
        if status.next_seq_id == seq + 1:  # back at its checkpoint (not adopted live on a worker)
            ctx.restored[spec.model_id] = RestorePoint(seq, status.version, uri)
        with ctx.session() as s:
            queries.update_model_progress(s, spec.model_id, version=status.version)
        restored += 1
    return restored


def bind_port(server: grpc.aio.Server, config: ServerConfig) -> int:
    """Plaintext, or TLS when the config names a certificate and key."""
    address = f"{config.host}:{config.port}"
    if config.tls_cert is None or config.tls_key is None:
        return server.add_insecure_port(address)
    credentials = grpc.ssl_server_credentials(
        [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())]
    )
    return server.add_secure_port(address, credentials)


async def create_context(config: ServerConfig, dispatcher: Backend | None = None) -> ServerContext:
    """Everything but the transports: the database (migrated), the default tenant,
    the store, the engine's dispatcher and every live model restored. Its
    ``service`` is what the transports call; the caller starts ``usage`` and
    ``lifecycle`` (``create_server`` does)."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    db_engine = make_engine(config.resolved_database_url)
    upgrade_to_head(db_engine)
    sessions = make_session_factory(db_engine)
    default_key = bootstrap_default_tenant(
        sessions, config.data_dir, auth=config.auth, preset_key=config.bootstrap_api_key
    )

    def quota_overrides(tenant_id: str) -> dict[str, int | None]:
        with sessions() as s:
            return tenancy.quota_overrides(s, tenant_id)

    usage = UsageMeter(sessions, config.usage_flush_s)
    # An S3 store stages checkpoints under checkpoint_root, where the engine writes them.
    store = make_store(
        config.store,
        local_root=config.checkpoint_root,
        endpoint_url=config.s3_endpoint_url,
        staging=config.checkpoint_root,
    )
    if dispatcher is None and config.broker:
        from treadle.server.celery.dispatch import CeleryDispatcher
        from treadle.workers.engine.base_models import BaseModelRegistry

        dispatcher = CeleryDispatcher(
            config.broker,
            sessions,
            BaseModelRegistry(config.models),
            worker_timeout_s=config.worker_timeout_s,
            store=store,
            replay_log_bytes=config.replay_log_bytes,
            sampler_placement=config.sampler_placement,
            keep_versions=config.keep_versions,
        )
    if dispatcher is None:
        options = engine_config(config)
        engine = build_engine(options, on_lost=restart_or_exit(options)).start()
        # with a remote store (S3), checkpoints move through local staging off the
        # engine thread; with a local one, storage paths are the engine's directories
        staged = StagedEngine(engine, store) if not store.is_local else None
        dispatcher = InProcessDispatcher(engine, staged)
    ctx = ServerContext(
        config=config,
        sessions=sessions,
        dispatcher=dispatcher,
        catalog=dispatcher,
        engine_metrics=dispatcher,
        draining=dispatcher,
        store=store,
        auth=Authenticator(
            sessions, default_key.tenant_id, enabled=config.auth, cache_s=config.auth_cache_s
        ),
        quotas=Quotas(config.quota_limits, overrides=quota_overrides),
        usage=usage,
        step_metrics=StepMetricsRecorder(db_engine.begin, config.usage_flush_s),
        default_key=default_key,
    )
    if config.metrics_port is not None:
        ctx.metrics = ServerMetrics()
        if isinstance(dispatcher, InProcessDispatcher):  # else each worker serves its engine's
            ctx.metrics.registry.register(EngineCollector(dispatcher.engine))
    restored = await restore_models(ctx)
    if restored:
        log.info("restored %d model(s) from their last checkpoints", restored)
    return ctx


async def create_server(
    config: ServerConfig, dispatcher: Backend | None = None
) -> tuple[grpc.aio.Server, int, ServerContext]:
    ctx = await create_context(config, dispatcher)
    server = grpc.aio.server(
        # ObserveInterceptor first: it times, counts and logs every answer, errors too.
        # ErrorInterceptor next: it answers for whatever the ones after it raise.
        # DecodeInterceptor last: a request that does not parse is refused after auth.
        interceptors=[
            ObserveInterceptor(ctx.metrics),
            ErrorInterceptor(ctx.instance_id),
            AuthInterceptor(ctx.auth),
            DecodeInterceptor(),
        ],
        options=channel_options(config.max_message_bytes),
    )
    training_pb2_grpc.add_TrainingServiceServicer_to_server(TrainingServicer(ctx), server)
    sampling_pb2_grpc.add_SamplingServiceServicer_to_server(SamplingServicer(ctx), server)
    server_pb2_grpc.add_ServerServiceServicer_to_server(InfoServicer(ctx), server)
    session_pb2_grpc.add_SessionServiceServicer_to_server(SessionServicer(ctx), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in (*SERVICE_NAMES, ""):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = bind_port(server, config)
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    if config.http_port is not None:  # the tinker-compatible API, in this event loop
        from treadle.server.http.app import start_http

        ctx.http = await start_http(ctx, config.host, config.http_port)
    if ctx.usage is not None:  # written to the database every usage_flush_s; closed at stop
        ctx.usage.start()
    if ctx.step_metrics is not None:  # a run's curves, written like usage
        ctx.step_metrics.start()
    if ctx.metrics is not None and config.metrics_port is not None:
        ctx.metrics.serve(config.metrics_host, config.metrics_port)  # closed by ctx.metrics.close()
    ctx.lifecycle.start()  # the idle-model sweeper (stopped by ctx.lifecycle.stop())
    return server, port, ctx
