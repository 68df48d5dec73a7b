"""The rules every HTTP port of the synchronizer (status page, metrics) serves under.

They answer without the run's token, so anyone who reaches them may connect: with no timeout and
no cap, about 1,030 idle connections to them took every descriptor of a process limited to 1024,
and new gRPC joins timed out and checkpoints failed (EMFILE) until those connections closed.
Now a connection that sends nothing for ``idle_timeout`` seconds is closed, and at most
``max_connections`` are served at once per port (a connection beyond them is closed as soon as
it is accepted), so both ports together hold at most a few dozen descriptors, whatever a client
does; the synchronizer also raises its descriptor limit at start (main.py).
"""

from __future__ import annotations

import socketserver
import sys
import threading

IDLE_TIMEOUT_S = 5.0  # a reload every 2 s or a scrape sends its request at once; silence is not a client
MAX_CONNECTIONS = 32  # per port: a few browsers and a scraper, with room to spare


class BoundedServer(socketserver.ThreadingMixIn):
    """A threading socket server (mixed in before ``HTTPServer`` or ``WSGIServer``) that serves at
    most ``max_connections`` connections at once and closes the others on accept. The idle timeout
    is the handler's (``timeout``, applied to each read: :func:`limited_handler`)."""

    daemon_threads = True  # an idle connection never holds up a stop
    block_on_close = False

    def __init__(self, *args, max_connections: int = MAX_CONNECTIONS, **kwargs) -> None:
        self.slots = threading.BoundedSemaphore(max_connections)
        super().__init__(*args, **kwargs)

    def verify_request(self, request, client_address) -> bool:
        return self.slots.acquire(blocking=False)  # False: socketserver closes it at once

    def process_request(self, request, client_address) -> None:
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started (none left?): it never releases its slot itself
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address) -> None:
        # a client that went silent (closed at its timeout) or away is routine, not a traceback
        if not isinstance(sys.exc_info()[1], (TimeoutError, ConnectionError)):
            super().handle_error(request, client_address)  # type: ignore[misc]  # a mixin: the server class it is mixed into has it


def limited_handler(handler: type, idle_timeout: float) -> type:
    """``handler`` (a ``StreamRequestHandler`` class) whose reads time out after ``idle_timeout``
    seconds of silence, closing the connection."""
    return type(handler.__name__, (handler,), {"timeout": idle_timeout})


def serve_in_background(server: socketserver.BaseServer, name: str) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
    thread.start()
    return thread
