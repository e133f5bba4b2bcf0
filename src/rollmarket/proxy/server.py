"""Run a capture proxy under uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from .app import create_proxy_app
from .settings import ProxySettings


def serve(settings: ProxySettings, *, log_level: str = "info", access_log: bool = False) -> None:
    """Serve until interrupted. SIGTERM and Ctrl-C finish the calls in flight and write every capture."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = uvicorn.Config(
        create_proxy_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        access_log=access_log,
        # The upstream's own Server and Date headers pass through; uvicorn adds none of its own.
        server_header=False,
        date_header=False,
        proxy_headers=False,
        timeout_graceful_shutdown=30,
        timeout_keep_alive=60,
        limit_concurrency=8192,
    )
    uvicorn.Server(config).run()
