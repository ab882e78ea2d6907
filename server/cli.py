"""The ``treadle`` command: serve, worker-less embedded server, tiny models, demo."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from treadle.common.logs import configure_logging
from treadle.errors import TreadleError

if TYPE_CHECKING:
    import grpc

    from treadle.server.context import ServerContext


def _serve(args: argparse.Namespace) -> int:
    from treadle.server.app import create_server, prepare_process
    from treadle.server.config import config_from_args

    config = config_from_args(args)
    if not config.models:
        print(
            "treadle serve: no base model; pass --model DIR (make one with `treadle make-model --tiny DIR`)",
            file=sys.stderr,
        )
        return 2
    if config.node_rank > 0:  # another host of a group: its ranks only, no server
        from treadle.server.app import engine_config
        from treadle.workers.group.launch import run_node

        return run_node(engine_config(config))
    prepare_process(config)

    from treadle.common.db.engine import shown_url

    async def main() -> None:
        server, port, ctx = await create_server(config)
        await server.start()
        print(
            f"treadle: serving {', '.join(config.models)} on {config.host}:{port}"
            f"{' (TLS)' if config.tls else ''} "
            f"(data in {config.data_dir.resolve()}, database {shown_url(ctx.config.resolved_database_url)})",
            flush=True,
        )
        if ctx.http is not None:
            print(
                f"treadle: tinker-compatible HTTP API on "
                f"{'https' if config.tls else 'http'}://{config.host}:{ctx.http.port} "
                "(TINKER_BASE_URL; the key as TINKER_API_KEY=tml-<key>)",
                flush=True,
            )
            print(
                f"treadle: web console on {'https' if config.tls else 'http'}://{config.host}:"
                f"{ctx.http.port}/console (sign in with an API key)",
                flush=True,
            )
        _print_key(ctx)
        if ctx.metrics is not None and ctx.metrics.endpoint is not None:
            print(
                f"treadle: metrics on http://{config.metrics_host}:{ctx.metrics.endpoint.port}/metrics",
                flush=True,
            )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            if stop.is_set():  # the second signal: no more waiting
                print("treadle: stopping now, without checkpointing", flush=True)
                os._exit(1)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        await stop.wait()
        await graceful_stop(server, ctx)

    asyncio.run(main())
    return 0


async def graceful_stop(server: grpc.aio.Server, ctx: ServerContext) -> None:
    """Checkpoint every loaded model, then stop: a planned restart loses nothing
    (``ModelLifecycle.shutdown``, docs/restarts.md)."""
    loaded, timeout = len(ctx.owners), ctx.config.drain_timeout_s
    if ctx.dispatcher.engine_in_process:
        print(
            f"treadle: stopping; checkpointing {loaded} loaded model(s) first "
            f"(at most {timeout:g} s; signal again to stop now)",
            flush=True,
        )
    idle, forced = await ctx.lifecycle.shutdown(timeout, lambda: server.stop(grace=2))
    if ctx.http is not None:
        await ctx.http.stop()
    for model_id in forced:
        print(
            f"treadle: model {model_id} was not idle after {timeout:g} s: checkpointed what "
            "is applied (gradients of a step not taken are dropped)",
            flush=True,
        )
    await ctx.service.op_endings.close()  # the last ends of calls (they count usage)
    if ctx.usage is not None:
        await ctx.usage.close()  # the last usage counters
    if ctx.step_metrics is not None:
        await ctx.step_metrics.close()  # the last calls' metrics
    ctx.dispatcher.close()
    if ctx.metrics is not None:
        ctx.metrics.close()
    if ctx.dispatcher.engine_in_process:
        print(f"treadle: stopped; {len(idle) + len(forced)} model(s) checkpointed", flush=True)


def _worker(args: argparse.Namespace) -> int:
    from treadle.workers.worker.celery_worker import run_worker
    from treadle.workers.worker.config import worker_config_from_args

    return run_worker(worker_config_from_args(args))


def _print_key(ctx: ServerContext) -> None:
    """Where the default tenant's key is, so a local client can use it."""
    key = ctx.default_key
    if not ctx.config.auth:
        print("treadle: --no-auth: every caller is the default tenant", flush=True)
    elif key is not None and key.key is not None:
        path = key.path.resolve()
        print(
            f"treadle: the default tenant's API key is in {path} "
            f"(export TREADLE_API_KEY=$(cat {path}))",
            flush=True,
        )
    else:
        print(
            "treadle: API keys are required; make one with `treadle admin create-key default` "
            "or `treadle admin create-tenant NAME`",
            flush=True,
        )


def _make_model(args: argparse.Namespace) -> int:
    from treadle.workers.model.tiny import build_tiny_model

    if not args.tiny:
        print(
            "treadle make-model: only --tiny models can be built here (no downloads)",
            file=sys.stderr,
        )
        return 2
    path = build_tiny_model(Path(args.dir), preset=args.preset, seed=args.seed, arch=args.arch)
    print(f"treadle: wrote a {args.preset} {args.arch} model with random weights to {path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from treadle.server.demo import DemoOptions, run_demo

    return run_demo(
        DemoOptions(
            data_dir=Path(args.data_dir),
            quick=args.quick,
            seed=args.seed,
            out=Path(args.out) if args.out else None,
            sampler=args.sampler,
            http_port=args.http_port,
        )
    )


def build_parser() -> argparse.ArgumentParser:
    from treadle.server.config import add_server_flags
    from treadle.workers.worker.config import add_worker_flags

    parser = argparse.ArgumentParser(
        prog="treadle", description="Self-hosted RL training-as-a-service for LLMs"
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log at INFO: one line per call answered"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve", help="run the embedded server (SQLite, local checkpoints, in-process engine)"
    )
    add_server_flags(serve)
    serve.set_defaults(fn=_serve)

    worker = sub.add_parser(
        "worker",
        help="run an engine as a Celery worker of a distributed server (--broker, --database-url)",
    )
    add_worker_flags(worker)
    worker.set_defaults(fn=_worker)

    make = sub.add_parser(
        "make-model", help="build a small Llama-style model locally (random weights)"
    )
    make.add_argument("dir")
    make.add_argument(
        "--tiny", action="store_true", help="random weights and a character tokenizer, no downloads"
    )
    make.add_argument("--preset", default="tiny", choices=["tiny", "demo", "5m", "110m"])
    make.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3"])
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(fn=_make_model)

    demo = sub.add_parser(
        "demo", help="server + tiny model + a real RL loop (SFT warm-up, then GRPO)"
    )
    demo.add_argument("--data-dir", default="treadle-data/demo")
    demo.add_argument(
        "--out", default=None, help="reward-curve PNG (default: DATA_DIR/reward_curve.png)"
    )
    demo.add_argument("--quick", action="store_true", help="a shorter run (for tests)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--sampler",
        default="torch",
        help="the sampler backend: torch (default), torch-thread, torch-process or vllm; "
        "see docs/backends.md",
    )
    demo.add_argument(
        "--http-port",
        type=int,
        default=0,
        help="port of the web console (/console) while the demo runs; 0 = any free port "
        "(default), -1 = off",
    )
    demo.set_defaults(fn=_demo)

    from treadle.server.admin import add_admin_parser

    add_admin_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(
        getattr(args, "log_format", "text"), verbose=args.verbose, process=args.command
    )
    try:
        return int(args.fn(args))
    except TreadleError as err:
        print(f"treadle: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        print(
            f"treadle: {err.name} is missing; install the server: pip install 'treadle[server]'",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
