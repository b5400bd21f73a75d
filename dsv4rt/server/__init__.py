"""`dsv4rt serve`: an OpenAI-compatible HTTP server (Starlette on uvicorn) over the Engine."""
from .app import Server

__all__ = ["Server"]
