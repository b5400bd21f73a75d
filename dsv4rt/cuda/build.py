"""NVRTC compilation of cuda_src/ to CUBIN, with an on-disk cache keyed by everything that shapes the binary."""
from __future__ import annotations

import functools
import hashlib
import importlib.resources
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack

FORMAT_VERSION = 1
# -lineinfo keeps profiler and sanitizer reports readable; -v puts registers and spills in the log.
OPTIONS = ("--std=c++17", "-lineinfo", "--ptxas-options=-v")
INSTANTIATE = "// dsv4rt-instantiate:"
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


class KernelBuildError(RuntimeError):
    pass


@dataclass
class Module:
    cubin: bytes
    lowered: dict[str, str]
    log: str
    key: str
    cached: bool


def source_dir() -> Path:
    packaged = importlib.resources.files("dsv4rt") / "cuda_src"
    return Path(str(packaged)) if packaged.is_dir() else Path(__file__).resolve().parents[2] / "cuda_src"


def kernel_sources(src_dir: Path | None = None) -> list[Path]:
    return sorted(Path(src_dir or source_dir()).glob("*.cu"))


def instantiations(source: str) -> list[str]:
    return [e for line in source.splitlines() if line.startswith(INSTANTIATE)
            for e in line[len(INSTANTIATE):].split()]


@functools.cache
def declared(source: str) -> tuple[str, ...]:
    """Every instantiation cuda_src/`source`.cu declares: launchers compile them as one module."""
    return tuple(instantiations((source_dir() / f"{source}.cu").read_text()))


def cache_dir() -> Path:
    if os.environ.get("DSV4RT_CACHE_DIR"):
        return Path(os.environ["DSV4RT_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsv4rt" / "kernels"


WGMMA_ARCH = "sm_90a"   # the target of Hopper's warpgroup MMA (and the tensor maps that feed it here)


def device_arch(compute_capability: tuple[int, int]) -> str:
    """The 'a' targets unlock arch-specific instructions (wgmma, setmaxnreg); such a cubin runs on that arch alone."""
    major, minor = compute_capability
    return f"sm_{major}{minor}a" if (major, minor) in ((9, 0), (10, 0)) else f"sm_{major}{minor}"


def _headers(path: Path, src_dir: Path, seen: dict[str, bytes]) -> dict[str, bytes]:
    """Every quoted include reachable from path, as name -> bytes; <...> headers belong to the NVRTC version."""
    for inc in _INCLUDE.findall(path.read_text(errors="replace")):
        found = next((p for p in (path.parent / inc, src_dir / inc) if p.is_file()), None)
        if found is not None and inc not in seen:
            seen[inc] = found.read_bytes()
            _headers(found, src_dir, seen)
    return seen


@functools.cache
def _nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc
    return tuple(_check(nvrtc.nvrtcVersion()))


def _flags(arch: str, defines: dict | None) -> list[str]:
    # NVRTC >= 12.9 keeps its own cache and leaves the ptxas report out on its hits; ours makes it redundant.
    no_cache = ["--no-cache"] if _nvrtc_version() >= (12, 9) else []
    return [f"-arch={arch}", *OPTIONS, *no_cache,
            *(f"-D{k}" if v is None else f"-D{k}={v}" for k, v in (defines or {}).items())]


def cache_key(name: str, arch: str, name_expressions=(), defines=None, src_dir=None) -> str:
    src_dir = Path(src_dir or source_dir())
    path = src_dir / f"{name}.cu"
    blob = msgpack.packb([FORMAT_VERSION, _nvrtc_version(), arch, path.name, path.read_bytes(),
                          sorted(_headers(path, src_dir, {}).items()), _flags(arch, defines), list(name_expressions)])
    return hashlib.sha256(blob).hexdigest()


def compile_module(name: str, arch: str, name_expressions=(), defines=None, src_dir=None) -> Module:
    src_dir = Path(src_dir or source_dir())
    key = cache_key(name, arch, name_expressions, defines, src_dir)
    entry = cache_dir() / f"{key}.msgpack"
    hit = _read_entry(entry, name_expressions)
    if hit is not None:
        return Module(hit["cubin"], hit["lowered"], hit["log"], key, cached=True)
    cubin, lowered, log = _nvrtc_compile(src_dir / f"{name}.cu", arch, list(name_expressions),
                                         _flags(arch, defines), src_dir)
    _write_atomic(entry, msgpack.packb({"cubin": cubin, "lowered": lowered, "log": log}))
    return Module(cubin, lowered, log, key, cached=False)


def build_all(arch: str, src_dir=None, progress=None) -> list[tuple[str, Module, float]]:
    """Every kernel file compiled or taken from the cache, as (file name, module, seconds). `progress`, if given,
    hears of each file twice: progress(i, n, path) before it and progress(i, n, path, module, seconds) after."""
    sources = kernel_sources(src_dir)
    out = []
    for i, path in enumerate(sources, 1):
        if progress is not None:
            progress(i, len(sources), path)
        t0 = time.perf_counter()
        module = compile_module(path.stem, arch, instantiations(path.read_text()), src_dir=path.parent)
        seconds = time.perf_counter() - t0
        if progress is not None:
            progress(i, len(sources), path, module, seconds)
        out.append((path.name, module, seconds))
    return out


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_PROPS = re.compile(r"Function properties for (\S+)")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def ptxas_report(log: str) -> dict[str, dict[str, int]]:
    """Kernel symbol -> registers, spill_stores, spill_loads, stack (bytes), from `ptxas -v` lines."""
    report, current = {}, None
    for line in log.splitlines():
        if m := _PTXAS_ENTRY.search(line):
            current = m[1]
            report[current] = dict(registers=0, spill_stores=0, spill_loads=0, stack=0)
        elif m := _PTXAS_PROPS.search(line):
            current = m[1]
        elif current in report and (m := _PTXAS_STACK.search(line)):
            report[current].update(stack=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        elif current in report and (m := _PTXAS_REGS.search(line)):
            report[current]["registers"] = int(m[1])
    return report


def _check(result):
    from cuda.bindings import nvrtc
    err, *values = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
    return values[0] if len(values) == 1 else values


def _nvrtc_compile(path: Path, arch: str, name_expressions: list[str], flags: list[str],
                   src_dir: Path) -> tuple[bytes, dict[str, str], str]:
    from cuda import pathfinder
    from cuda.bindings import nvrtc
    cuda_include = pathfinder.find_nvidia_header_directory("cudart")
    if cuda_include is None:
        raise RuntimeError("CUDA headers not found (cuda_bf16.h); install dsv4rt[cu13] or dsv4rt[cu12]")
    options = [o.encode() for o in (*flags, f"-I{src_dir}", f"-I{cuda_include}")]
    prog = _check(nvrtc.nvrtcCreateProgram(path.read_bytes(), path.name.encode(), 0, [], []))
    try:
        for expr in name_expressions:
            _check(nvrtc.nvrtcAddNameExpression(prog, expr.encode()))
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        log = bytes(_check(nvrtc.nvrtcGetProgramLogSize(prog)))
        _check(nvrtc.nvrtcGetProgramLog(prog, log))
        log = log.rstrip(b"\0").decode(errors="replace").strip()
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelBuildError(f"cannot compile {path.name} for {arch}:\n{log}")
        cubin = bytes(_check(nvrtc.nvrtcGetCUBINSize(prog)))
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin))
        lowered = {e: _check(nvrtc.nvrtcGetLoweredName(prog, e.encode())).decode() for e in name_expressions}
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return cubin, lowered, log


def _read_entry(path: Path, name_expressions) -> dict | None:
    """A cache entry, or None when it is missing or unreadable (then it is rebuilt and replaced)."""
    try:
        entry = msgpack.unpackb(path.read_bytes())
        ok = (entry["cubin"].startswith(b"\x7fELF") and isinstance(entry["log"], str)
              and all(isinstance(entry["lowered"].get(e), str) for e in name_expressions))
    except Exception:  # whatever a truncated or foreign file raises, the answer is to rebuild
        return None
    return entry if ok else None


def _write_atomic(path: Path, data: bytes) -> None:
    """Temp file beside the entry, then rename: concurrent writers store the same bytes and readers never see a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
