"""Alembic environment: imports only app's metadata; the URL comes from the app settings unless
the caller set sqlalchemy.url on the config (as `grpo db upgrade` and the tests do)."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from app.core.db import make_engine, normalise_url
from app.core.models import Base
from app.core.settings import build_settings

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    return normalise_url(url or build_settings().resolved_database_url)


def run_migrations_offline() -> None:
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(_url())
    with engine.connect() as connection:
        # SQLite cannot ALTER most things in place: batch mode rebuilds tables instead.
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
