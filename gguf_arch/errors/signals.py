"""How every tool stops on SIGINT, SIGTERM and SIGHUP: the same way, at any moment.

The contract (README's exit codes): the process ends with 128 + the signal (130, 143, 129) and
one stderr line, `error: interrupted (SIGNAME)` and what is left, promptly, wherever it is:

* before the tool's body runs (its own imports: `install` runs first thing in its module) and
  after it returned (interpreter teardown): the line and the exit, at once (nothing is being
  written then);
* in Python code inside `run_cli`: `Interrupted` (a KeyboardInterrupt) is raised there, so the
  `finally` blocks clean up (a conversion removes its partial file) and the tool says what is
  left;
* inside a long call into C (`native_call`: a ggml graph, a call on an RPC server's socket),
  where Python cannot raise until the call returns, which may be never (a stalled server): a
  watcher thread, woken through `signal.set_wakeup_fd`, prints the tool's closing lines
  (`at_stop`: the runner's timings) and the line, and ends the process. A ggml call writes no
  file, so nothing is left half-written by ending it there. The stop signals are blocked in
  the main thread for the duration, so a socket call inside ggml never sees EINTR (ggml's RPC
  client takes that for a lost server and aborts);
* during generation (`graceful_sigint`) the first Ctrl-C only asks the loop to stop after the
  current token (llama-cli's way); a second one ends the process at once, and so does the first
  if the call under way waits on an RPC server (`native_call(may_stall=True)`) and has not
  returned within GRACE_S (a server gone silent). A local graph always returns: the first Ctrl-C
  waits for it however long the machine's load makes it.

A signal during the interpreter's own start-up, before the tool's module runs, is outside this.
"""
from __future__ import annotations

import contextlib
import ctypes  # loaded now: ending the process must not import (the main thread may hold the import lock)
import os
import signal
import sys
import threading
from typing import Callable, Iterator, NoReturn

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Phases of a tool's process. IDLE: not a tool's process (a test calling main() in-process):
# run_cli sets the handlers for its body and restores the caller's after it.
IDLE, STARTUP, RUNNING, FINISHED = "idle", "startup", "running", "finished"
# A first Ctrl-C during generation waits this long for a call on an RPC server to return (the
# loop then stops after that token) before it ends the process itself.
GRACE_S = 5.0


class Interrupted(KeyboardInterrupt):
    """A stop signal, raised where the main thread is, as Ctrl-C raises KeyboardInterrupt (and
    caught wherever that is); `what` says what the run leaves behind (set by whoever knows it)."""

    def __init__(self, signum: int = signal.SIGINT, what: str | None = None) -> None:
        super().__init__(signum, what)
        self.signum, self.what = signum, what

    @classmethod
    def from_exc(cls, exc: BaseException, what: str) -> "Interrupted":
        return cls(getattr(exc, "signum", signal.SIGINT), what)


def interrupted_line(signum: int, what: str | None) -> str:
    return f"error: interrupted ({signal.Signals(signum).name})" + (f"; {what}" if what else "")


class Graceful:
    """Set by the first Ctrl-C inside `graceful_sigint`; the loop it guards stops at its next check."""

    def __init__(self) -> None:
        self.requested = False
        self._seen = 0  # SIGINTs counted by the watcher (the handler and the watcher both see each one)


class _State:
    """The process's stop-signal state (plain attributes: this module loads before the heavy imports)."""

    def __init__(self) -> None:
        self.phase = IDLE
        self.what: str | None = None  # the tool's own "what is left" for an interrupt outside its body
        self.native = 0  # depth of native_call in the main thread
        self.native_calls = 0  # native calls entered so far (which one the main thread is in)
        self.may_stall = False  # the native call under way may wait on a server that went silent
        self.deferred = 0  # depth of `deferred` in the main thread
        self.pending: int | None = None  # a stop signal `checkpoint` raises
        self.graceful: Graceful | None = None
        self.at_stop: Callable[[], list[str]] | None = None  # lines printed before the line when ending at once
        self.ending = threading.Lock()  # one thread ends the process
        self.wakeup_r: int | None = None
        self.result: int | None = None  # FINISHED: the code run_cli returns (None while it prints its line)
        self.late: int | None = None  # a signal that came while run_cli was closing
        self.stop_code: int | None = None  # a tool whose documented stop is not 128 + N (the server's 0)


_STATE = _State()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def end_process(code: int, lines: list[str]) -> NoReturn:
    """Print `lines` on stderr and end the process now (no interpreter teardown: the main thread
    may be inside C). Whoever comes second waits for the first to finish the job."""
    if not _STATE.ending.acquire(blocking=False):
        threading.Event().wait()  # another thread is ending the process
    # Python's own buffers only from the main thread: another thread could wait forever on a
    # stream's lock that the main thread holds (a write to a full pipe). What the tools print as
    # they go (tokens, lines) is flushed as it is written.
    for stream in (sys.stdout, sys.stderr) if _main_thread() else ():
        with contextlib.suppress(Exception):  # a closed or broken stream: the exit code still says it
            stream.flush()
    text = "".join(line + "\n" for line in lines).encode("utf-8", "backslashreplace")
    with contextlib.suppress(OSError):
        os.write(2, text)
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)  # what C code (ggml's printf) buffered
    os._exit(code)


def _end_on_signal(signum: int, what: str | None) -> NoReturn:
    extra = []
    if _STATE.at_stop is not None:
        with contextlib.suppress(Exception):
            extra = _STATE.at_stop()
    if _STATE.stop_code is not None:  # a stop is that tool's normal end: its code, no error line
        end_process(_STATE.stop_code, [*extra, f"stopping ({signal.Signals(signum).name})"])
    end_process(128 + signum, [*extra, interrupted_line(signum, what)])


def _outside_the_body(signum: int) -> None:
    """Before the tool's body and after it: the line and the exit at once (nothing is being written)."""
    s = _STATE
    if s.phase == FINISHED and s.result is None:
        s.late = signum  # run_cli is printing its line: `finished` decides
    elif s.phase == FINISHED and s.result:
        end_process(s.result, [])  # the run failed or was interrupted and said so: its code stands
    elif s.phase in (STARTUP, FINISHED):
        _end_on_signal(signum, s.what)


def _handler(signum: int, _frame: object) -> None:
    """Runs in the main thread, between two Python bytecodes (also inside a ctypes callback)."""
    s = _STATE
    if s.phase in (STARTUP, FINISHED):
        _outside_the_body(signum)
        return
    g = s.graceful
    if signum == signal.SIGINT and g is not None and not (g.requested and s.wakeup_r is None):
        g.requested = True  # a second one: the watcher counts it (without one, the next line does)
        return
    if s.native:  # inside a ctypes callback of a native call: Python cannot unwind through C
        _end_on_signal(signum, s.what)
    if s.deferred:
        s.pending = s.pending or signum  # raised at the next checkpoint
        return
    raise Interrupted(signum)


def _idle_sigint(signum: int, frame: object) -> None:
    """Outside a tool's process (no watcher): graceful_sigint's handler counts for itself."""
    g = _STATE.graceful
    if g is None or g.requested:
        raise KeyboardInterrupt
    g.requested = True


def _on_byte(signum: int) -> None:
    """The watcher's view of one signal: it acts where the main thread may not run Python soon."""
    s = _STATE
    if signum not in STOP_SIGNALS:
        return
    if s.phase in (STARTUP, FINISHED):
        _outside_the_body(signum)
        return
    g = s.graceful
    if signum == signal.SIGINT and g is not None:
        g._seen += 1
        g.requested = True
        if g._seen == 1:
            if s.native and s.may_stall:  # the loop looks at `requested` when this call returns: if it does
                _end_if_still_in(s.native_calls, signum)
            return
        _end_on_signal(signum, s.what)  # a second Ctrl-C: at once, wherever the main thread is
    if s.phase == RUNNING and s.native:
        _end_on_signal(signum, s.what)


def _end_if_still_in(call: int, signum: int) -> None:
    """After GRACE_S, end the process if the main thread is still inside native call number
    `call` (a token that takes longer, a server that went silent): a Ctrl-C is never ignored."""
    def check() -> None:
        if _STATE.native and _STATE.native_calls == call and _STATE.phase == RUNNING:
            _end_on_signal(signum, _STATE.what)
    timer = threading.Timer(GRACE_S, check)
    timer.daemon = True
    timer.start()


def _watch(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            _on_byte(signum)


def _start_watcher() -> None:
    if _STATE.wakeup_r is not None:
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    _STATE.wakeup_r = r
    threading.Thread(target=_watch, args=(r,), daemon=True, name="kimi-k3-signals").start()


def _set_handlers() -> dict[int, object]:
    return {s: signal.signal(s, _handler) for s in STOP_SIGNALS}


def _standard_streams() -> None:
    """A closed stdout or stderr (`>&-`) reads as /dev/null, and its descriptor is taken by
    /dev/null: else the next file opened (an output GGUF) would get descriptor 1, and C code
    printing to stdout (ggml does) would write into it. A closed stdin stays None: the end of input.
    A path given with bytes that are not UTF-8 (legal on Linux) is printed back as those bytes,
    never a UnicodeEncodeError at the "wrote OUT" line after the work is done."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            if getattr(sys, name) is None:
                setattr(sys, name, open(fd, "w", closefd=False))
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(errors="surrogateescape")


def install(what: str | None = None, stop_code: int | None = None) -> None:
    """The first thing a console script's module does, before its heavy imports: from here on a
    stop signal ends the process with the documented line and code (`stop_code`: a tool whose
    documented end on a stop signal is that code, the server's 0, with a `stopping (SIGNAME)`
    line). Not in a process that imported the module for another purpose (a test runner calling
    main() in-process keeps its own handlers; run_cli sets them around the body there)."""
    if _STATE.phase != IDLE or not _main_thread() or "pytest" in sys.modules:
        return
    _STATE.phase, _STATE.what, _STATE.stop_code = STARTUP, what, stop_code
    _standard_streams()  # first: the watcher's pipe must not take a closed stdout's descriptor
    _set_handlers()
    _start_watcher()


@contextlib.contextmanager
def tool_body(what: str | None) -> Iterator[None]:
    """run_cli's body: stop signals raise Interrupted there (or end a native call at once)."""
    if not _main_thread():
        yield
        return
    if _STATE.phase == IDLE:  # a main() called in-process: set up for the body only
        previous = _set_handlers()
        try:
            _STATE.phase, _STATE.what = RUNNING, what
            yield
        finally:
            _STATE.phase, _STATE.what, _STATE.at_stop = IDLE, None, None
            for s, handler in previous.items():
                signal.signal(s, handler)
        return
    _STATE.phase, _STATE.what = RUNNING, what
    try:
        yield
    finally:
        _STATE.phase, _STATE.what, _STATE.result = FINISHED, "the run had already completed", None


def finished(code: int) -> None:
    """The code run_cli returns. A signal from the end of the body on leaves a failure's code as
    it is (its line is out); after a success it ends the process with its own code and line."""
    s = _STATE
    if s.phase != FINISHED:
        return
    s.result = code
    if s.late is not None and code == 0:
        _end_on_signal(s.late, s.what)


def at_stop(lines: Callable[[], list[str]] | None) -> None:
    """Lines to print before the interrupted line when the process is ended at once (the
    runner's timings, which it prints itself when the interrupt unwinds through Python)."""
    _STATE.at_stop = lines


def _block(how: int) -> None:
    signal.pthread_sigmask(how, STOP_SIGNALS)


@contextlib.contextmanager
def native_call(may_stall: bool = False) -> Iterator[None]:
    """The main thread is about to spend long in C: a stop signal ends the process from the
    watcher thread instead of waiting for the call to return. may_stall: the call waits on an
    RPC server, which may never answer (a first Ctrl-C during generation then waits GRACE_S)."""
    s = _STATE
    if s.phase != RUNNING or s.wakeup_r is None or not _main_thread():
        yield
        return
    if s.native == 0:
        _block(signal.SIG_BLOCK)
        s.native_calls += 1
        s.may_stall = False
    s.native += 1
    s.may_stall = s.may_stall or may_stall
    try:
        yield
    finally:
        s.native -= 1
        if s.native == 0:
            s.may_stall = False
            _block(signal.SIG_UNBLOCK)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """While inside, a stop signal is raised at the next `checkpoint` instead of between any two
    bytecodes. For code whose main thread waits on other threads: raised inside threading's or
    queue's own code (between a Condition's wait and its lock's re-acquisition), KeyboardInterrupt
    breaks the lock ("release unlocked lock", a RuntimeError instead of the interrupt, exit 1)."""
    s = _STATE
    s.deferred += 1
    try:
        yield
    finally:
        s.deferred -= 1
    if not s.deferred:
        checkpoint()  # the outermost region left normally: a signal since the last checkpoint


def checkpoint() -> None:
    """Raise the stop signal that came inside `deferred`, if one did: a safe point of the caller."""
    s = _STATE
    if s.pending is not None and _main_thread():
        signum, s.pending = s.pending, None
        raise Interrupted(signum)


@contextlib.contextmanager
def graceful_sigint() -> Iterator[Graceful]:
    """While inside, the first Ctrl-C asks the caller to stop (`requested`) instead of raising."""
    g, previous = Graceful(), _STATE.graceful
    _STATE.graceful = g
    idle = _STATE.phase == IDLE and _main_thread()
    old = signal.signal(signal.SIGINT, _idle_sigint) if idle else None
    try:
        yield g
    finally:
        _STATE.graceful = previous
        if idle:
            signal.signal(signal.SIGINT, old)
