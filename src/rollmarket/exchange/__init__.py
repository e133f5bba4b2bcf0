"""The rollout exchange: a durable HTTP service workers lease jobs from and trainers fetch from."""

from .app import create_app
from .service import Exchange
from .settings import ExchangeSettings
from .store import FetchFilter, Store
from .stores.sqlite import SqliteStore

__all__ = ["Exchange", "ExchangeSettings", "FetchFilter", "SqliteStore", "Store", "create_app"]
