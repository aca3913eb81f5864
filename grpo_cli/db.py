"""Database migrations through Alembic, with the URL taken from the settings."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

import migrations


def alembic_config(database_url: str) -> Config:
    folder = Path(migrations.__file__).parent
    config = Config(
        str(folder.parent / "alembic.ini") if (folder.parent / "alembic.ini").exists() else None
    )
    config.set_main_option("script_location", str(folder))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    config.attributes["configure_logger"] = False
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    command.downgrade(alembic_config(database_url), revision)
