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


@main.command()
@click.option("--arch", help="target, e.g. sm_90a (default: the GPU's)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def build(arch, as_json):
    """Compile every kernel to CUBIN and fill the kernel cache."""
    from ..cuda.build import KernelBuildError, build_all, cache_dir, ptxas_report
    if arch is None:
        arch = _gpu_arch()
    elif not re.fullmatch(r"sm_\d{2,3}[af]?", arch):
        raise ValueError(f"--arch must look like sm_90a, got '{arch}'")
    try:
        built = build_all(arch)
    except KernelBuildError as e:
        click.echo(f"error: {e}", err=True)  # the whole NVRTC log: its file(line) entries are the point
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
