"""The program a sandboxed python grader runs (passed to the interpreter with ``-c``, so the
sandbox needs no file of the worker). Line protocol on stdin/stdout, one JSON object a line:

- first line in: ``{"source": "...", "cpu_s": N}``; out: ``{"ready": true}`` or ``{"error": ...}``
- then per request in: ``{"id": i, "sample": {...}, "item": {...}}``; out: ``{"id": i,
  "score": x}`` or ``{"id": i, "error": "Type: message"}`` (``x`` always a float; ``i`` a
  random string per request, so code in the sandbox cannot write a later request's reply).
- with ``"call": "name"`` in the first line (an agent's tool), the source defines that function
  instead of ``grade``; a request is ``{"id": i, "arguments": {...}}`` (passed as keywords) and
  the reply ``{"id": i, "value": "text"}`` (a string result as it is, anything else as JSON).

The user's ``print`` goes nowhere (``sys.stdout`` is replaced), so only this program writes
the protocol. Before each call the CPU-time limit is moved to what this process has used plus
``cpu_s``: a long-lived process gets the same budget for every call, and a call over it is
killed by the kernel (SIGXCPU), which the parent sees as the process dying.
"""

import io
import json
import os
import resource
import sys
from typing import Any

MAX_ERROR_CHARS = 500
MAX_PRINTED_CHARS = 1 << 20


class _Discard(io.TextIOBase):
    """Where the sandboxed code's prints go (a grader's, a tool's, an environment's): nowhere;
    past MAX_PRINTED_CHARS in one call it raises, so code that floods its output fails instead
    of running on."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, text: str) -> int:
        self.written += len(text)
        if self.written > MAX_PRINTED_CHARS:
            raise OSError(f"the sandboxed code printed more than {MAX_PRINTED_CHARS} characters")
        return len(text)


def _send(out: Any, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _cpu_used() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _processes() -> int:
    """Processes this sandbox holds (its own pid namespace: /proc lists only them)."""
    return sum(name.isdigit() for name in os.listdir("/proc"))


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w")
    sys.stdout = sys.stderr = _Discard()
    setup = json.loads(sys.stdin.readline())
    cpu_s = float(setup["cpu_s"])
    namespace = {"__name__": "grader"}
    entry = setup.get("call") or "grade"
    try:
        exec(compile(setup["source"], "grader.py", "exec"), namespace)
        grade = namespace[entry]
        if not callable(grade):
            raise TypeError(f"{entry} is not a function")
    except BaseException as exc:
        _send(protocol, {"error": f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]})
        return
    _send(protocol, {"ready": True})
    main_pid = os.getpid()
    baseline = _processes()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout = sys.stderr = _Discard()
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        soft = int(_cpu_used() + cpu_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (min(soft, hard), hard))
        try:
            reply: dict[str, Any]
            if "arguments" in request:
                value = grade(**request["arguments"])
                reply = {"value": value if isinstance(value, str) else json.dumps(value)}
            else:
                reply = {"score": float(grade(request["sample"], request["item"]))}
        except BaseException as exc:
            # The sample scores 0 and the next one goes on.
            reply = {"error": f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]}
        if os.getpid() != main_pid:
            os._exit(0)  # a process the grader forked: it never speaks the protocol
        reply["id"] = request.get("id")  # the parent pairs replies with requests by it
        if _processes() > baseline:
            # The grader left processes behind: this sandbox is spent; the parent replaces it.
            reply["spent"] = "the grader left processes running"
        _send(protocol, reply)


main()
