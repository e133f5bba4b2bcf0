"""Run an exchange under uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from .app import create_app
from .settings import ExchangeSettings


def serve(settings: ExchangeSettings, *, log_level: str = "info", access_log: bool = False) -> None:
    """Serve until interrupted. SIGTERM and Ctrl-C shut down cleanly; SIGKILL loses nothing acked."""
    if not settings.trainer_token:
        raise ValueError("a trainer token is required (--trainer-token or ROLLMARKET_TRAINER_TOKEN)")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=5,
        limit_concurrency=4096,
    )
    uvicorn.Server(config).run()
