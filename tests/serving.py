"""The in-process server of the serving tests (test_server, test_server_hardening): uvicorn on a free loopback port
in a daemon thread, started and stopped around the module (a helper, not a test module)."""

import contextlib
import socket
import threading
import time


@contextlib.contextmanager
def running(srv):
    """Serve ``srv`` (a glm_jax.serve.app.Server) on 127.0.0.1:<free port>; sets ``srv.port`` / ``srv.base``; yields
    the server thread (stopped, joined up to 30 s, on exit)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv.port = sock.getsockname()[1]
    uv = uvicorn.Server(srv.uvicorn_config())
    th = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    for _ in range(200):
        if uv.started:
            break
        time.sleep(0.05)
    srv.base = f"http://127.0.0.1:{srv.port}"
    try:
        yield th
    finally:
        uv.should_exit = True
        th.join(timeout=30)
