"""The serving engine: requests, a continuous-batching scheduler over the paged KV cache, model runners."""
from .engine import Engine, RequestOutput
from .loop import EngineLoop, TokenStream
from .prefix import PrefixCache, block_hashes
from .request import Request, Status
from .runner import CpuRunner, Runner
from .scheduler import Scheduler, Step

__all__ = ["CpuRunner", "Engine", "EngineLoop", "PrefixCache", "Request", "RequestOutput", "Runner", "Scheduler", "Status",
           "Step", "TokenStream", "block_hashes"]
