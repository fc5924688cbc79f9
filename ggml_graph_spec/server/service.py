"""The running server: uvicorn on a socket bound before the model loads (so /health answers 503
while it does), the engine thread once it is loaded, and an orderly stop.

    service = Service(server, sock)      # serving: /health is 503 "Loading model"
    service.attach(engine, template, props)   # serving the model
    service.stop()                       # new requests 503, in-flight ones end, uvicorn exits

uvicorn runs in its own thread, so it installs no signal handlers: the caller (cli.py) owns the
signals and calls stop().
"""
from __future__ import annotations

import socket
import threading

import uvicorn

from ..text.chat_template import ChatTemplate
from .app import Server, build_app
from .connections import protocol
from .engine import Engine

# How long a stop waits for open connections to end once every job has ended (uvicorn's
# timeout_graceful_shutdown), and for each thread.
STOP_GRACE_S = 5.0


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (IPv4 or IPv6 by the host's form); OSError when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


class Service:
    def __init__(self, server: Server, sock: socket.socket) -> None:
        self.server, self.sock = server, sock
        settings = server.settings
        config = uvicorn.Config(build_app(server), log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=int(STOP_GRACE_S), timeout_keep_alive=5,
                                http=protocol(settings.header_timeout, settings.max_connections))
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="kimi-k3-http", daemon=True)
        self.engine: Engine | None = None
        self.http_failure: BaseException | None = None
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def _serve(self) -> None:
        try:
            self._uvicorn.run(sockets=[self.sock])
        except BaseException as exc:  # noqa: BLE001 - reported by the thread that waits on the service
            self.http_failure = exc

    def attach(self, engine: Engine, template: ChatTemplate, props: dict) -> None:
        engine.start()
        self.engine = engine
        self.server.ready(engine, template, props)

    def alive(self) -> bool:
        return self._thread.is_alive() and (self.engine is None or self.engine.failure is None)

    def stop(self) -> bool:
        """Stop accepting, end every job at the engine's next step (503 to the waiting ones, an
        error event to streams), close the connections, end both threads. The engine is waited
        for whole (the model must not close under a step); uvicorn for STOP_GRACE_S and a margin.
        False if uvicorn outlived that."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine.join()
        self._uvicorn.should_exit = True
        self._thread.join(STOP_GRACE_S * 2)
        self.sock.close()
        return not self._thread.is_alive()
