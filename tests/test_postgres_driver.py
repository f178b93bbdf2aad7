"""Opening a PostgreSQL store: ``postgresql://`` means psycopg 3, and a missing driver says
which extra to install."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import POSTGRES_SKIP_REASON, POSTGRES_URL, builtins_only
from hermes_core import GatewayConfig, SessionStore
from hermes_core.testing import fresh_plugin_manager

WITHOUT_PSYCOPG = textwrap.dedent("""
    import sys
    sys.modules["psycopg"] = None  # as if hermes-sessions[postgres] were not installed
    from hermes_core import GatewayConfig, HermesError, SessionStore
    config = GatewayConfig.from_dict({"storage": {"url": sys.argv[1]}})
    try:
        SessionStore.open(config)
    except HermesError as exc:
        print(type(exc).__name__, exc)
        sys.exit(3)
""")


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["postgresql", "postgresql+psycopg"])
def test_a_missing_driver_names_the_extra_to_install(scheme: str) -> None:
    url = f"{scheme}://hermes@127.0.0.1:1/none"
    done = subprocess.run([sys.executable, "-c", WITHOUT_PSYCOPG, url], env=builtins_only(),
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stdout.startswith("StoreUnavailableError ")
    assert "the PostgreSQL driver psycopg cannot be imported" in done.stdout
    assert "install hermes-sessions[postgres]" in done.stdout


@pytest.mark.skipif(not POSTGRES_URL, reason=POSTGRES_SKIP_REASON)
def test_a_plain_postgresql_url_uses_psycopg_3(empty_database: str, hermes_home: Path) -> None:
    url = empty_database.replace("postgresql+psycopg://", "postgresql://", 1)
    assert url.startswith("postgresql://")
    config = GatewayConfig.from_dict(
        {"storage": {"url": url}}, environ={"HERMES_HOME": str(hermes_home)}
    )
    with SessionStore.open(config, plugins=fresh_plugin_manager(hermes_home)) as store:
        assert store.health()["backend"] == "postgresql"
