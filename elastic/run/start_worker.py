"""Stand-in for Ray's `setup_worker.py` on a cluster elastic starts: starts a Python worker.

A raylet starts each Python worker as `python setup_worker.py [FLAGS] default_worker.py ARGS
--serialized-runtime-env-context=JSON --language=PYTHON`. Ray's script imports most of Ray (its
constants, logging, the runtime env context and its protobuf messages: ~0.8 s of CPU) only to read
the context, set its environment variables and exec `bash -c "exec python default_worker.py ..."`,
which imports Ray again. A cluster elastic starts has no runtime env agent (`idle_agent.py`), so the
context is the empty one: no command prefix, no variables, this interpreter. `elastic.run.cluster`
has its raylets run this file instead:

    python -S start_worker.py [FLAGS] default_worker.py ARGS --serialized-runtime-env-context=JSON --language=L

It execs the worker directly (`python [FLAGS] default_worker.py ARGS`) when the context is the empty
one and the language Python, and otherwise Ray's own script with the arguments it was given
(`--setup-worker=PATH` names it), so anything but the plain case takes Ray's path. A run file, not a
module: stdlib only, started with -S so it costs a few milliseconds.
"""

from __future__ import annotations

import json
import os
import sys

_OWN = ("--serialized-runtime-env-context", "--language")


def plain_command(args: list[str]) -> list[str] | None:
    """The worker's command line where Ray's script would only exec it as it is; None otherwise."""
    rest, own = [], {}
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        if name in _OWN:
            if not eq:
                if i + 1 >= len(args):
                    return None
                i, value = i + 1, args[i + 1]
            own[name] = value
        else:
            rest.append(args[i])
        i += 1
    if own.get("--language") != "PYTHON":
        return None
    try:
        context = json.loads(own.get("--serialized-runtime-env-context") or "{}")
    except ValueError:
        return None
    if not isinstance(context, dict):
        return None
    plain = (not context.get("command_prefix") and not context.get("env_vars")
             and context.get("py_executable") in (None, sys.executable)
             and not context.get("override_worker_entrypoint") and not context.get("java_jars"))
    unknown = set(context) - {"command_prefix", "env_vars", "py_executable", "override_worker_entrypoint", "java_jars"}
    return [sys.executable, *rest] if plain and not unknown else None


def main(argv: list[str]) -> None:
    opts = {}
    while argv and argv[0].startswith(("--setup-worker=", "--zygote=")):
        name, _, value = argv.pop(0).partition("=")
        opts[name] = value
    command = plain_command(argv)
    if command is None:
        command = [sys.executable, opts["--setup-worker"], *argv]
    elif "--zygote" in opts and not command[1].startswith("-"):
        through_zygote(opts["--zygote"], command[1:])   # returns only where the zygote cannot be reached
    os.execv(command[0], command)


def through_zygote(path: str, argv: list[str]) -> None:
    """Have the zygote at `path` fork the worker (`zygote.py`), then stand for it until it exits,
    and exit as it did. Returns (nothing started) where the zygote cannot be reached."""
    import signal
    import socket

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from zygote import recv_message, send_message

    child, pending = None, []

    def forward(sig, _frame):
        if child is None:
            pending.append(sig)   # the zygote has not said which process it forked yet
            return
        try:
            os.kill(child, sig)
        except ProcessLookupError:
            pass

    passed_on = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    for sig in passed_on:
        signal.signal(sig, forward)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        send_message(sock, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "pid": os.getpid()},
                     fds=[0, 1, 2])
        started, _ = recv_message(sock)
    except OSError:
        started = None
    if started is None:   # no zygote, or it ended before forking: start the worker as Ray does
        sock.close()
        for sig in passed_on:
            signal.signal(sig, signal.SIG_DFL)
        for sig in pending:
            os.kill(os.getpid(), sig)
        return
    child = started["pid"]
    for sig in pending:
        forward(sig, None)
    ended, _ = recv_message(sock)   # its exit (a signal passed on meanwhile does not interrupt this: PEP 475)
    status = ended["status"] if ended else 1 << 8
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
