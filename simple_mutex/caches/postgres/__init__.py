"""The PostgreSQL tier: one table, one statement per contract step, shared by both faces.

``sync.py`` PostgresCache (psycopg's blocking connections or pool), ``asyncio.py``
AsyncPostgresCache, ``statements.py`` the schema, the statements and how replies read.
"""

from __future__ import annotations

from .asyncio import AsyncPostgresCache
from .sync import PostgresCache, from_url

__all__ = ["AsyncPostgresCache", "PostgresCache", "from_url"]
