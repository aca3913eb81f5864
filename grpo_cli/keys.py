"""`grpo keys`: the operator's commands on API keys, straight on the database (like `grpo db`):
create one (shown once), list them, revoke one. A revocation holds at once in every API process
(it bumps the revocation counter the API processes share through Redis; without Redis they
cache no key: app.sessions.revocations)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from app.core.settings import Settings


class KeysError(Exception):
    """A refusal of `grpo keys`, printed as it is (exit status 2)."""


def add_keys_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = sub.add_parser("keys", help="API keys.")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="Create a key (printed once).")
    create.add_argument("--project", default="default", help="Project name (created if new).")
    create.add_argument("--name", default=None, help="A label for the key.")
    create.add_argument(
        "--tinker",
        action="store_true",
        help="Print the key as the Tinker SDK takes it (tml-<key>, X-API-Key; docs/tinker.md).",
    )
    listing = keys_sub.add_parser("list", help="List keys (ids, prefixes, projects; no secret).")
    listing.add_argument("--project", default=None, help="Only this project's keys.")
    revoke = keys_sub.add_parser(
        "revoke", help="Revoke a key: from now on every API process answers it 401."
    )
    revoke.add_argument(
        "key", help="The key's id (key_...), or the key itself (grpo_... or tml-grpo_...)."
    )


def run_keys(args: argparse.Namespace, settings: Settings) -> int:
    """Run one `grpo keys` command in one unit of work; what it prints is printed once that
    committed (a key is shown, or said revoked, only once it is)."""
    from app.core.db import make_engine, make_session_factory, session_scope

    commands = {"create": _create, "list": _list, "revoke": _revoke}
    engine = make_engine(settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            out, note = commands[args.keys_command](session, args, settings)
    except KeysError as exc:
        print(f"grpo keys {args.keys_command}: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.dispose()
    print(out)
    if note:
        print(note, file=sys.stderr)
    return 0


def _create(session: Session, args: argparse.Namespace, _settings: Settings) -> tuple[str, str]:
    from app.sessions.service import create_key

    created = create_key(session, args.project, args.name)
    note = f"(key {created.key_id} for project '{created.project_name}'; it is shown only once)"
    if args.tinker:  # the same project key, in the form the tinker SDK checks for
        from app.tinker.deps import tinker_key

        return tinker_key(created.plaintext), note
    return created.plaintext, note


def _list(session: Session, args: argparse.Namespace, _settings: Settings) -> tuple[str, str]:
    from app.sessions import repository as keys_repo

    project_id = None
    if args.project is not None:
        found = keys_repo.find_project_by_name(session, name=args.project)
        if found is None:
            raise KeysError(f"no project {args.project!r}")
        project_id = found.id
    lines = ["ID\tPREFIX\tPROJECT\tNAME\tCREATED\tREVOKED"]
    for key in keys_repo.list_keys(session, project_id=project_id):
        revoked = key.revoked_at.isoformat() if key.revoked_at else "-"
        created = key.created_at.isoformat()
        lines.append(
            f"{key.id}\t{key.prefix}\t{key.project_id}\t{key.name or '-'}\t{created}\t{revoked}"
        )
    return "\n".join(lines), ""


def _revoke(session: Session, args: argparse.Namespace, settings: Settings) -> tuple[str, str]:
    from app.core.security import split_key
    from app.sessions import repository as keys_repo
    from app.sessions.revocations import revocation_epoch
    from app.sessions.service import revoke_key
    from app.tinker.deps import TINKER_KEY_PREFIX

    given = args.key.strip().removeprefix(TINKER_KEY_PREFIX)  # a key in its Tinker form too
    parts = split_key(given)
    if parts is not None:  # the key itself: its prefix names it (the operator holds the DB)
        key = keys_repo.find_key_by_prefix(session, prefix=parts[0])
    else:
        key = keys_repo.find_key_by_id(session, key_id=given)
    if key is None:
        raise KeysError(f"no key {given[:48]!r} (give its id, key_..., or the key itself)")
    revoked = revoke_key(
        session, key=key, revocations=revocation_epoch(settings.resolved_redis_url)
    )
    return f"revoked {revoked.id} (project {revoked.project_id})", ""
