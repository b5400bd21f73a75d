"""DeepSeek V4 inference without PyTorch. `dsv4rt.Engine` and `dsv4rt.SamplingParams` are the serving API;
they load on first use, so `import dsv4rt` stays cheap for the command line."""


def __getattr__(name: str):
    if name == "Engine":
        from .engine import Engine
        return Engine
    if name == "SamplingParams":
        from .reference.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'dsv4rt' has no attribute '{name}'")
