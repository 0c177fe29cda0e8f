"""A process that has imported torch once and forks Ray's Python workers from it.

Every rank of a run is a Ray worker process that imports torch (about 1.7 CPU-seconds, most of a
rank's start on a small model) and the modules a rank builds its model with. On a cluster elastic
starts on this machine (the local provider's nodes, which share this machine's network), the
driver starts one zygote beside the head; it imports them once and waits on a Unix socket. Each
raylet starts its workers through `start_worker.py`, which hands the zygote the worker's command
line, environment, working directory and standard streams; the zygote forks, and the child, with
all of it applied, runs Ray's `default_worker.py` as `python` would have. Forking before any of
those modules has started a thread of its own is what a DataLoader's workers do too. The zygote
never imports Ray: its C++ configuration reads the `RAY_*` environment once, when imported, and a
worker's job id is one of those variables (the raylet sets it per worker; a worker forked with
Ray imported dies at once in its core worker: docs/benchmarks.md, session 29).

    python zygote.py --dir=DIR --parent=PID [--preload=MODULE,...]

A recipe's model can name more (`recipe_modules`: a Hugging Face model's `transformers`, about 3.5
CPU-seconds per rank beyond torch); a module that fails to import here is left to the rank, which
reports it as it would have.

The raylet keeps the process it started (`start_worker.py`) as its handle on the worker: it lives
exactly as long as the child, passes SIGTERM, SIGINT and SIGHUP on, and exits with the child's
status; the child dies with it if it is killed (a pidfd it watches), and registers with the raylet
under its own pid (Ray's registration names the process, and kills go there). DIR is the zygote's
own: it listens on `DIR/socket`, and while a worker runs `DIR/workers/<the stand-in's pid>` holds
its pid, so that a node's removal kills the workers of the stand-ins below its raylet with them
(`LocalCluster.remove_node`). It ends on SIGTERM, removing DIR, and is sent one when the process
that started it (`--parent`) dies, however it dies (PR_SET_PDEATHSIG).

Protocol (one connection per worker): the client sends one JSON object {"argv", "env", "cwd",
"pid"} (4-byte length first) with its stdin, stdout and stderr attached (SCM_RIGHTS); the zygote
answers {"pid": CHILD} once forked, and {"status": WAITSTATUS} when the child has exited.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys

_PR_SET_PDEATHSIG = 1
# What a rank imports in its setup (`RankWorker.setup`) and for a checkpoint (`_checkpoint_modules`).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.device_mesh", "elastic.models", "elastic.train.data",
           "elastic.train.diloco", "elastic.train.outer_sync", "torch.distributed.checkpoint",
           "torch.distributed.checkpoint.staging", "torch.distributed.checkpoint.state_dict")


def recipe_modules(model) -> tuple[str, ...]:
    """What a rank of a recipe's `model` section imports beyond PRELOAD: for `model.hf`,
    transformers' model classes and, for a local directory, its architecture's module (from its
    config.json). Nothing for our GPT (in PRELOAD) nor for a user's `model.factory` (a user's module
    may start threads or read its environment when imported)."""
    if not getattr(model, "hf", None):
        return ()
    out = ["elastic.models.hf", "transformers.modeling_utils", "transformers.models.auto.modeling_auto"]
    try:
        with open(os.path.join(os.path.expanduser(model.hf), "config.json")) as f:
            kind = str(json.load(f)["model_type"]).replace("-", "_")
        if kind.isidentifier():
            out.append(f"transformers.models.{kind}.modeling_{kind}")
    except (OSError, ValueError, KeyError, TypeError):
        pass   # a hub name or object storage: the classes above are most of it
    return tuple(out)


def send_message(sock: socket.socket, obj: dict, fds: list[int] = ()) -> None:
    data = json.dumps(obj).encode()
    payload = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [payload], list(fds))
    else:
        sock.sendall(payload)


def recv_message(sock: socket.socket, fds: int = 0) -> tuple[dict | None, list[int]]:
    """One message and the descriptors that came with it; (None, []) at the end of the stream."""
    got: list[int] = []
    buf = b""
    while len(buf) < 4 or len(buf) < 4 + struct.unpack("!I", buf[:4])[0]:
        if fds and not got:
            chunk, new, _, _ = socket.recv_fds(sock, 1 << 16, fds)
            got += new
        else:
            chunk = sock.recv(1 << 16)
        if not chunk:
            for fd in got:
                os.close(fd)
            return None, []
        buf += chunk
    return json.loads(buf[4:]), got


def _child(conn: socket.socket, listener: socket.socket, request: dict, streams: list[int], children: dict) -> None:
    """In the forked child: become the worker the raylet asked for, and never return. The
    zygote's own descriptors go first (its socket, the other workers' pidfds and connections: a
    sibling's connection held here would keep its stand-in waiting on this worker's life once
    the zygote is gone)."""
    code = 1
    try:
        listener.close()
        conn.close()
        for pidfd, (_, _, other) in children.items():
            os.close(pidfd)
            other.close()
        for target, fd in enumerate(streams):
            os.dup2(fd, target)
        for fd in streams:
            if fd > 2:
                os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        os.setpgid(0, 0)   # as Ray's workers run: a process group of their own
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))   # as `python` reads it at start
        _follow(request["pid"])
        argv = request["argv"]
        sys.argv = argv[:]
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        sys.stdin = os.fdopen(0, "r", closefd=False)
        import runpy

        try:
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _follow(pid: int) -> None:
    """Die when `pid` (the raylet's handle on this worker) does, whatever kills it."""
    import threading

    try:
        fd = os.pidfd_open(pid)
    except OSError:
        os._exit(1)   # gone already

    def watch() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="zygote-client-watch", daemon=True).start()


def listen(path: str) -> socket.socket:
    """The Unix socket at `path`, listening: bound before the imports, so that a worker asked for
    meanwhile waits for them (connected, unanswered) rather than importing everything itself."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    return listener


def _note(workers: str, stand_in: int, pid: int | None) -> None:
    """Record (or, with None, forget) the worker forked for `stand_in`."""
    path = os.path.join(workers, str(stand_in))
    if pid is None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    with open(f"{path}.tmp", "w") as f:
        f.write(str(pid))
    os.replace(f"{path}.tmp", path)


def workers_of(workers: str, stand_ins: list[int]) -> list[int]:
    """The pids of the workers forked for these stand-ins (`DIR` of `--workers`), where running."""
    out = []
    for pid in stand_ins:
        try:
            with open(os.path.join(workers, str(pid))) as f:
                out.append(int(f.read()))
        except (OSError, ValueError):
            continue
    return out


def serve(listener: socket.socket, workers: str) -> None:
    """Fork a worker for each request on `listener`, note it in `workers`, report each one's exit."""
    children: dict[int, tuple[int, int, socket.socket]] = {}   # pidfd -> (pid, stand-in's pid, connection)
    while True:
        ready, _, _ = select.select([listener, *children], [], [])
        for r in ready:
            if r is listener:
                conn, _ = listener.accept()
                try:
                    request, streams = recv_message(conn, fds=3)
                except OSError:
                    conn.close()
                    continue
                if request is None or len(streams) != 3:
                    for fd in streams:
                        os.close(fd)
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    _child(conn, listener, request, streams, children)
                for fd in streams:
                    os.close(fd)
                _note(workers, request["pid"], pid)
                children[os.pidfd_open(pid)] = (pid, request["pid"], conn)
                try:
                    send_message(conn, {"pid": pid})
                except OSError:
                    pass   # the client is gone: the child follows it
            else:
                pid, stand_in, conn = children.pop(r)
                os.close(r)
                _, status = os.waitpid(pid, 0)
                _note(workers, stand_in, None)
                try:
                    send_message(conn, {"status": status})
                except OSError:
                    pass
                conn.close()


def main(argv: list[str]) -> None:
    args = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    import ctypes

    folder = args["dir"]

    def end(*_):
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, end)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(args.get("parent", os.getppid())):
        end()   # the process that started us died before we could follow it
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    listener = listen(os.path.join(folder, "socket"))
    # numpy (which torch imports) loads OpenBLAS, which starts a pool of threads unless told not to:
    # the workers fork from one thread (their numpy does no heavy algebra; torch has its own).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    for name in filter(None, args.get("preload", "").split(",")):
        try:
            importlib.import_module(name)
        except Exception:   # noqa: BLE001 - a missing extra: the rank that needs it says so
            pass
    serve(listener, os.path.join(folder, "workers"))


if __name__ == "__main__":
    main(sys.argv[1:])
