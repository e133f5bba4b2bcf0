"""Store backends: SQLite (a file, the default) and PostgreSQL (a URL; several exchange replicas
can share it). `open_store` picks one from what `--db` names."""

from __future__ import annotations

from pathlib import Path

from ..settings import ExchangeSettings
from ..store import Store, StoreError

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres_url(db: str | Path) -> bool:
    """Whether `db` names a PostgreSQL database rather than a SQLite file."""
    return isinstance(db, str) and db.startswith(POSTGRES_SCHEMES)


def _postgres():
    try:
        from . import postgres
    except ImportError as exc:
        raise StoreError(f"a postgresql:// database needs psycopg 3: pip install 'rollmarket[postgres]' "
                         f"({exc})") from exc
    return postgres


def check_store(db: str | Path) -> None:
    """Fail early with a StoreError when `db` is a PostgreSQL URL that cannot be used (a missing
    extra, a bad URL, a server that is down); brings its schema up to date. SQLite needs nothing."""
    if is_postgres_url(db):
        _postgres().prepare(str(db))


def open_store(db: str | Path, settings: ExchangeSettings) -> Store:
    """The store for `db`: a postgresql:// URL gives a PostgresStore, anything else a SQLite file.

    The PostgreSQL backend is imported only here, so a core install without the `postgres` extra
    serves SQLite and names the extra when asked for a URL."""
    if is_postgres_url(db):
        return _postgres().PostgresStore(str(db), settings)
    from .sqlite import SqliteStore

    return SqliteStore(db, settings)
