"""The declarative base every table is declared on (app.core.models, app.core.tinker_tables),
and the column type of autoincrement ids."""

from __future__ import annotations

from typing import Any, ClassVar

from sqlalchemy import JSON, BigInteger, Integer
from sqlalchemy.orm import DeclarativeBase

# BigInteger autoincrement ids are plain INTEGER on SQLite (where only INTEGER PRIMARY KEY
# auto-increments) and BIGSERIAL elsewhere.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {dict[str, Any]: JSON, list[Any]: JSON}
