"""User Python source in a job spec (a python grader's, a python tool's or environment's): parsed
within bounds, so what cannot be parsed is a ValueError (a 422 naming the field), never a crash
of the process that validates it.

Its length is bounded by the field (64,000 characters), but length alone does not bound the
parser: CPython parses and builds the tree recursively, so 40 KB of ``x = 1 + 1 + ... + 1`` or
``x = - - - ... 1`` raised ``RecursionError`` or ``MemoryError`` ("parser stack overflowed") in the
API and answered 500. Those are caught here, and a tree that parsed is also refused past
:data:`MAX_SOURCE_NESTING` levels: the sandbox compiles the source again, to bytecode, and the
compiler recurses over the same tree (CPython gives up near 3,000 levels, fewer the deeper the
stack it starts from), so the bound keeps "validated" meaning "loads in the sandbox".
"""

from __future__ import annotations

import ast

__all__ = ["MAX_SOURCE_NESTING", "parse_source"]

# Levels of the syntax tree: blocks, statements and expressions together (a def holding an if
# holding a call of a sum is 5 or so). Well above written code (Python itself refuses 100
# indentation levels and 200 nested brackets), well below what the compiler handles.
MAX_SOURCE_NESTING = 200

_AST_ONLY = ast.PyCF_ONLY_AST  # parse without compiling to bytecode


def parse_source(source: str, filename: str) -> ast.Module:
    """The syntax tree of ``source``; ValueError saying why when it does not compile or nests
    deeper than MAX_SOURCE_NESTING levels."""
    too_deep = (
        f"source nests too deeply (at most {MAX_SOURCE_NESTING} levels of blocks, statements "
        "and expressions together: split long chains of operators or elif branches)"
    )
    try:
        tree = compile(source, filename, "exec", flags=_AST_ONLY, dont_inherit=True)
    except SyntaxError as exc:
        raise ValueError(f"source does not compile: {exc.msg} (line {exc.lineno})") from None
    except (RecursionError, MemoryError):
        # The parser's own recursion limits ("parser stack overflowed" is a MemoryError): the
        # source is deep, not the process short of memory (it is at most 64,000 characters).
        raise ValueError(too_deep) from None
    if _deeper_than(tree, MAX_SOURCE_NESTING):
        raise ValueError(too_deep)
    assert isinstance(tree, ast.Module)
    return tree


def _deeper_than(tree: ast.AST, limit: int) -> bool:
    """Whether any node lies more than ``limit`` levels below ``tree`` (walked without
    recursion, so a deep tree cannot exhaust this check's own stack)."""
    pending = [(tree, 1)]
    while pending:
        node, depth = pending.pop()
        if depth > limit:
            return True
        pending.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return False
