"""An OpenAI-compatible HTTP server (``tiergen serve``); needs the ``serve`` extra."""

from tiergen.server.app import create_app
from tiergen.server.serve import listen, serve

__all__ = ["create_app", "listen", "serve"]
