"""`dsv4rt build`: compile every kernel ahead of time into the kernel cache."""
from __future__ import annotations

import json
import re
import sys

import click

from . import main


def _compute_capability() -> tuple[int, int]:
    from cuda.bindings import driver

    def call(result):
        if result[0] != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(result[0])
        return result[1] if len(result) > 1 else None

    call(driver.cuInit(0))
    dev = call(driver.cuDeviceGet(0))
    attr = driver.CUdevice_attribute
    return tuple(call(driver.cuDeviceGetAttribute(a, dev)) for a in (
        attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))


def _gpu_arch() -> str:
    from ..cuda.build import device_arch
    try:
        return device_arch(_compute_capability())
    except Exception:  # no cuda-bindings, no driver library, no device: all mean the same to the user
        raise RuntimeError("no GPU visible; pass --arch (e.g. sm_90a)") from None


def _need_nvrtc() -> None:
    from ..cuda.build import _nvrtc_version
    try:
        from cuda.bindings import nvrtc  # noqa: F401 (checked on every call: the version below is cached)
        _nvrtc_version()
    except Exception as e:  # no cuda-bindings, or no NVRTC library for it to load
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"dsv4rt build needs NVRTC, from the CUDA extras: pip install -e '.[cu13]' "
                           f"('.[cu12]' on a CUDA 12 driver) ({reason})") from None


def _progress(i: int, n: int, path, module=None, seconds: float = 0.0) -> None:
    """build_all's progress, a line per kernel file on stderr: a first build takes minutes."""
    if module is None:
        click.echo(f"[{i:{len(str(n))}d}/{n}] {path.name} ... ", nl=False, err=True)
    else:
        click.echo("cached" if module.cached else f"compiled in {seconds:.1f} s", err=True)


@main.command()
@click.option("--arch", help="target, e.g. sm_90a (default: the GPU's)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def build(arch, as_json):
    """Compile every kernel to CUBIN and fill the kernel cache."""
    if arch is not None and not re.fullmatch(r"sm_\d{2,3}[af]?", arch):
        raise ValueError(f"--arch must look like sm_90a, got '{arch}'")
    _need_nvrtc()
    from ..cuda.build import KernelBuildError, build_all, cache_dir, kernel_sources, ptxas_report
    if arch is None:
        arch = _gpu_arch()
    click.echo(f"building {len(kernel_sources())} kernel files for {arch} into {cache_dir()}", err=True)
    try:
        built = build_all(arch, progress=_progress)
    except KernelBuildError as e:
        click.echo(f"\nerror: {e}", err=True)  # the whole NVRTC log: its file(line) entries are the point
        sys.exit(1)
    rows = []
    for file, module, seconds in built:
        report = ptxas_report(module.log)
        names = {sym: expr for expr, sym in module.lowered.items()}
        rows.append(dict(file=file, arch=arch, cached=module.cached, seconds=round(seconds, 3),
                         kernels=[dict(name=names.get(sym, sym), symbol=sym, **r) for sym, r in report.items()]))
    if as_json:
        click.echo(json.dumps(dict(arch=arch, cache=str(cache_dir()), files=rows), indent=1))
        return
    click.echo(f"{'file':24s} {'kernels':>7s} {'regs':>5s} {'spill B':>8s} {'cache':>8s} {'s':>7s}")
    for r in rows:
        k = r["kernels"]
        click.echo(f"{r['file']:24s} {len(k):7d} {max((x['registers'] for x in k), default=0):5d} "
                   f"{sum(x['spill_stores'] + x['spill_loads'] for x in k):8d} "
                   f"{'hit' if r['cached'] else 'compiled':>8s} {r['seconds']:7.3f}")
    click.echo(f"{arch}, cache {cache_dir()}")
