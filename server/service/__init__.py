"""The transport-free service layer: what the server does, written once.

Both transports (the gRPC servicers, the tinker-compatible HTTP routes) are
thin translators over it: they authenticate the caller, turn their wire
requests into the domain types of ``service.types`` (or the engine's, in
``treadle.common.engine.domain``), call one method with the caller's tenant, and turn
the domain result (or the ``TreadleError`` raised) back into their wire.
Ordering and dedupe of training calls, tenant walls, quotas, usage, the
model lifecycle and the database writes that follow an applied call all live
here, so both transports behave the same.

``Service(ctx)`` is made once per server (``ServerContext.service``): its
quota and usage meter is shared by every transport.
"""

from __future__ import annotations

from treadle.server.accounting.metering import CallMeter
from treadle.server.context import ServerContext
from treadle.server.service.checkpoints import CheckpointService
from treadle.server.service.info import InfoService
from treadle.server.service.models import ModelService
from treadle.server.service.op_endings import OpEndings
from treadle.server.service.ordered import CallHandle, OrderedPipeline
from treadle.server.service.runs import RunService
from treadle.server.service.sampling import SamplingService
from treadle.server.service.sessions import SessionService
from treadle.server.service.training import TrainingService

__all__ = [
    "CallHandle",
    "CheckpointService",
    "InfoService",
    "ModelService",
    "RunService",
    "SamplingService",
    "Service",
    "SessionService",
    "TrainingService",
]


class Service:
    """The whole service layer of one server."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        #: quotas and usage of every call that reaches the engine, for every transport
        self.meter = CallMeter(ctx.quotas, ctx.usage)
        self.checkpoints = CheckpointService(ctx)
        self.models = ModelService(ctx, self.checkpoints)
        #: the ends of ordered calls, written behind their answers (in-process engine)
        self.op_endings = OpEndings(ctx.connection)
        self.sampling = SamplingService(ctx, self.meter)
        self.training = TrainingService(
            ctx, OrderedPipeline(ctx, self.meter, self.op_endings), self.checkpoints, self.sampling
        )
        self.sessions = SessionService(ctx)
        self.info = InfoService(ctx)
        #: a run's usage, cost and curves
        self.runs = RunService(ctx)
