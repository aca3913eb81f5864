"""This process's row in ``inference_servers`` (app.gateway.servers_repository): written at
start and every ``HEARTBEAT_S`` with the process's ServerState, removed when it stops. A row
whose heartbeat stops (the process was killed) goes stale and the gateway stops routing to it
(``FRESH_S``). Database calls block: the process runs them in a thread."""

from __future__ import annotations

import logging

from sqlalchemy.exc import SQLAlchemyError

from app.core.db import make_engine, make_session_factory, session_scope
from app.core.settings import Settings
from app.gateway import servers_repository
from app.gateway.protocol import ServerState
from inference.settings import InferenceSettings

log = logging.getLogger(__name__)


class Registration:
    def __init__(self, settings: InferenceSettings, app_settings: Settings) -> None:
        self._settings = settings
        self._engine = make_engine(app_settings.resolved_database_url)
        self._sessions = make_session_factory(self._engine)

    def write(self, state: ServerState) -> bool:
        """Write the row (a fresh heartbeat); False (logged) when the database is unreachable:
        the next heartbeat tries again."""
        try:
            with session_scope(self._sessions) as session:
                servers_repository.register(
                    session,
                    server_id=self._settings.server_id,
                    control_url=self._settings.control_url,
                    bases=self._settings.base_list,
                    state=state.model_dump(mode="json"),
                )
        except SQLAlchemyError as exc:
            log.warning("inference: heartbeat not written: %s", exc)
            return False
        return True

    def remove(self) -> None:
        try:
            with session_scope(self._sessions) as session:
                servers_repository.unregister(session, server_id=self._settings.server_id)
        except SQLAlchemyError as exc:
            log.warning("inference: row not removed (it goes stale instead): %s", exc)
        finally:
            self._engine.dispose()
