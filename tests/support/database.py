"""Raw SQL against a test database, to arrange or inspect states the store's API never shows."""

from __future__ import annotations

from typing import Any

from sqlalchemy import create_engine, text


def run_sql(url: str, statement: str, **params: Any) -> list[Any]:
    """Run ``statement`` with ``params`` in its own committed transaction on a connection of
    its own; the rows it returns (none for a statement without rows)."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            result = conn.execute(text(statement), params)
            return list(result) if result.returns_rows else []
    finally:
        engine.dispose()
