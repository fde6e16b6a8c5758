"""The ranks' exit guard: installed by the node supervisor as ``sitecustomize.py`` in a directory of
the run's own that it puts first on the job's ``PYTHONPATH`` (:func:`ddpfab.node.agent.exit_guard_env`),
so it works for unmodified scripts, with no flag in their command line. Standard library only.

Why: a rank that finished its work can still die by SIGABRT ("terminate called without an active
exception") while the interpreter finalises: C++ threads of the process group (gloo's AsyncWork,
autograd's workers) take the GIL of an interpreter that is being torn down. It happens even after
``destroy_process_group()``; see pytorch issue 190489 (open: a guard there narrows the window, it
does not close it) and PR 179291 (an atexit ``destroy_process_group``, abandoned). Upstream's own
DDP tutorial scripts hit it in about 5 of 17 runs on 2 gloo nodes, failing jobs that had finished.

What it does, in the rank process only (``LOCAL_RANK`` set by the launcher, and not in a process
the rank started itself: the first process to install it claims :data:`OWNER_VAR`):

- registers an ``atexit`` handler first, so it runs last, after every handler the script and its
  libraries registered (logging, wandb, tempfile finalizers flush or clean up there);
- that handler writes the rank's *done record* (``rank-<LOCAL_RANK>.json`` in
  ``DDPFAB_EXIT_GUARD_DIR``: rank, pid, exit code, restart attempt) once the script's main code has
  returned: data the supervisor reads to tell "finished its work, then aborted at exit" from a
  failure. An exit code it cannot be sure of is recorded as ``null`` (never "finished");
- mode ``on`` (the default, ``ddpfab run --exit-guard off`` turns it off): then destroys the default
  process group if the script left it initialised, flushes every open Python file (a file the
  script never closed would otherwise be flushed by finalisation), and leaves with
  ``os._exit(code)``: the racy finalisation never runs. It does so only when the exit code is
  certain (:func:`final_code`): 0 after a script returned or called ``sys.exit(0)``, 1 after an
  uncaught exception. Otherwise (``KeyboardInterrupt``, ``raise SystemExit(N)`` by name, a
  ``python -m`` module, ``python -c``) the interpreter exits its own way, as without the guard.

Known limit: a script that catches a ``sys.exit(0)`` and then raises ``SystemExit(N)`` by name is
taken to exit 0 (the last ``sys.exit`` call's status).
"""

import atexit
import gc
import importlib.machinery
import importlib.util
import io
import json
import os
import sys
import time

#: "on": record, then leave with os._exit; "record": only write the done record.
MODE_VAR = "DDPFAB_EXIT_GUARD"
#: Where the done records go (the run's remote dir on the node).
DIR_VAR = "DDPFAB_EXIT_GUARD_DIR"
#: The pid of the process the guard is installed in: processes it starts (spawned DataLoader
#: workers) inherit it and stay unguarded.
OWNER_VAR = "DDPFAB_EXIT_GUARD_PID"
MODES = ("on", "record")

#: The status of the script's last ``sys.exit`` call (None: it never called it).
_seen = {"exit_called": False, "status": None, "script": None}


def _exit_status(code):
    """The process status a SystemExit *code* gives: None -> 0, an int -> itself, anything else
    (a message) -> 1."""
    if code is None:
        return 0
    if isinstance(code, int) and not isinstance(code, bool):
        return code
    return 1


def final_code():
    """The exit status the interpreter is about to return, or None when it is not certain or not
    a status at all.

    - an uncaught exception: the interpreter set ``sys.last_value`` before reporting it: 1
      (KeyboardInterrupt: None, Python ends by re-raising SIGINT);
    - a script (``python script.py``) that returned normally: the interpreter deletes
      ``__main__.__file__`` right after, before finalising; it keeps it when a SystemExit ended
      the script (it exits from inside its error report). Then the status is that of the last
      ``sys.exit`` call, and None when the script raised SystemExit by name (not seen here);
    - ``python -m MODULE``, ``python -c``: no such trace: None. Nor where python never ran the
      code: a module it did not find (``sys.argv[0]`` stays ``-m``) or a script it could not open
      (exit 2; like a script that returned, it leaves no ``__file__``, but its file is not there).
    """
    last = getattr(sys, "last_value", None)
    if last is not None:
        return None if isinstance(last, KeyboardInterrupt) else 1
    main = sys.modules.get("__main__")
    script = bool(sys.argv) and sys.argv[0] not in ("", "-", "-c", "-m")
    if main is None or getattr(main, "__spec__", None) is not None or not script:
        return None
    if "__file__" in vars(main):
        return _exit_status(_seen["status"]) if _seen["exit_called"] else None
    # (its path as it was at the start, before the script could chdir; one that deleted itself is
    # not certain either: recorded as null)
    path = _seen["script"] or sys.argv[0]
    return 0 if os.path.isfile(path) and os.access(path, os.R_OK) else None


def _write_record(directory, code):
    env = os.environ
    record = {"rank": env.get("RANK"), "local_rank": env.get("LOCAL_RANK"), "pid": os.getpid(), "code": code,
              "restart": env.get("TORCHELASTIC_RESTART_COUNT", "0"), "time": time.time()}
    path = os.path.join(directory, "rank-%s.json" % env.get("LOCAL_RANK"))
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as fh:
        fh.write(json.dumps(record) + "\n")
    os.replace(tmp, path)


def _destroy_process_group():
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the work is done; a failed teardown must not change the exit
        pass


def _flush_open_files():
    """Flush every open Python file object, as finalisation would have when it freed them."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - closed or broken: nothing left to save
            pass
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads obj.__class__, and some objects warn or run
        # code on that (torch.distributed.reduce_op prints a FutureWarning in every rank)
        if issubclass(type(obj), (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)):
            try:
                if not obj.closed:
                    obj.flush()
            except Exception:  # noqa: BLE001
                pass


def _at_exit(mode, directory, owner):
    if os.getpid() != owner:  # a forked child that returned: not the rank
        return
    code = final_code()
    try:
        _write_record(directory, code)
    except OSError:
        pass  # no record: the supervisor counts this rank as not finished, never the other way
    if mode != "on" or code is None:
        return
    _destroy_process_group()
    _flush_open_files()
    os._exit(code)


def install(environ=None):
    """Install the guard in this process if it is a rank of a ddpfab job; True if it did."""
    env = os.environ if environ is None else environ
    mode, directory = env.get(MODE_VAR), env.get(DIR_VAR)
    if mode not in MODES or not directory or not env.get("LOCAL_RANK", "").isdigit() or env.get(OWNER_VAR):
        return False
    env[OWNER_VAR] = str(os.getpid())
    argv = getattr(sys, "argv", None)  # set already when site runs (not on python 3.6: then at exit)
    if argv and argv[0]:  # the script not yet opened
        _seen["script"] = os.path.abspath(argv[0])
    real_exit = sys.exit

    def exit(status=None):  # noqa: A001 - sys.exit, its status noted
        _seen["exit_called"], _seen["status"] = True, status
        real_exit(status)

    sys.exit = exit
    atexit.register(_at_exit, mode, directory, os.getpid())
    return True


def _chain(here):
    """Run the sitecustomize this one shadows (Debian's, a venv's), as Python would have."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def _debugger():
    """``ddpfab run --pdb``: the debugger hooks (:mod:`ddpfab.node.rankpdb`, written beside this
    file as ``ddpfab_rankpdb``), in the ranks it names."""
    try:
        import ddpfab_rankpdb

        ddpfab_rankpdb.install()
    except Exception as exc:  # noqa: BLE001 - the rank runs on, without a debugger, and says so
        sys.stderr.write("ddpfab: no debugger in this rank (%s: %s)\n" % (type(exc).__name__, exc))


def _debugpy():
    """``ddpfab run --debugpy``: debugpy (:mod:`ddpfab.node.rankdebugpy`, written beside this file
    as ``ddpfab_rankdebugpy``) in the ranks it names: they wait here for a client."""
    try:
        import ddpfab_rankdebugpy

        ddpfab_rankdebugpy.install()
    except Exception as exc:  # noqa: BLE001 - the rank runs on, without a debugger, and says so
        sys.stderr.write("ddpfab: no debugpy in this rank (%s: %s)\n" % (type(exc).__name__, exc))


if __name__ == "sitecustomize":
    install()
    if os.environ.get("DDPFAB_PDB"):
        _debugger()
    if os.environ.get("DDPFAB_DEBUGPY"):
        _debugpy()
    _chain(os.path.dirname(os.path.abspath(__file__)))
