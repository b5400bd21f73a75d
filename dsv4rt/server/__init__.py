"""`dsv4rt serve`: an OpenAI-compatible HTTP server (Starlette on uvicorn) over the Engine, which runs in a
process of its own (process.py)."""
from .app import Server
from .backend import LocalEngine
from .process import EngineProcess

__all__ = ["EngineProcess", "LocalEngine", "Server"]
