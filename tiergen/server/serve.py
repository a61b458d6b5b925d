"""Run the app on uvicorn until Ctrl-C or SIGTERM: in-flight requests get a grace period,
then the scheduler stops, cancelling what is left."""

from __future__ import annotations

import gc
import socket
import sys
from collections.abc import Sequence

import uvicorn

from tiergen.engine.llm import LLM
from tiergen.errors import TiergenError
from tiergen.server.app import PREFIX_CACHE_BYTES, create_app

GRACEFUL_SHUTDOWN_S = 10  # then unfinished requests are cancelled


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket; port 0 picks a free one."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise TiergenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000, *, model_names: Sequence[str] = (),
          max_queue: int = 256, default_max_tokens: int = 256, chat_template: str | None = None,
          verbose: bool = False, api_key: str | None = None,
          queue_timeout: float | None = None, prefix_cache: int = PREFIX_CACHE_BYTES,
          prefix_cache_disk: int = 0) -> None:
    """Serve ``llm`` over HTTP (OpenAI's API) until interrupted."""
    sock = listen(host, port)
    app = create_app(llm, model_names, max_queue=max_queue, default_max_tokens=default_max_tokens,
                     chat_template=chat_template, api_key=api_key, queue_timeout=queue_timeout,
                     prefix_cache=prefix_cache, prefix_cache_disk=prefix_cache_disk)
    config = uvicorn.Config(app, log_level="info" if verbose else "warning", access_log=verbose,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    bound_host, bound_port = sock.getsockname()[:2]
    print(f"tiergen: serving {app.state.server.model_names[0]} on http://{bound_host}:{bound_port} "
          "(OpenAI API under /v1; Ctrl-C stops)", file=sys.stderr, flush=True)
    # the model's objects live as long as the process: frozen, the garbage collector's full
    # collections no longer walk them while holding up the event loop
    gc.collect()
    gc.freeze()
    uvicorn.Server(config).run(sockets=[sock])
