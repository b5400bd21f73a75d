"""Kernel build without a GPU: every kernel compiles to spill-free CUBIN; the cache is keyed, atomic and self-healing."""
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

pytest.importorskip("cuda.bindings")

from dsv4rt.cuda import build  # noqa: E402
from dsv4rt.cuda.build import (KernelBuildError, build_all, cache_dir, cache_key, compile_module,  # noqa: E402
                               instantiations, kernel_sources, ptxas_report, source_dir)

ROOT = Path(__file__).resolve().parents[1]
ARCH = "sm_90a"
RMSNORM = ["rmsnorm<float>", "rmsnorm<__nv_bfloat16>"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "kernels"
    monkeypatch.setenv("DSV4RT_CACHE_DIR", str(d))
    return d


@pytest.fixture
def src(tmp_path) -> Path:
    d = tmp_path / "src"
    shutil.copytree(source_dir(), d)
    return d


def dsv4rt(*args, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv4rt", *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **env))


def test_every_kernel_compiles_to_cubin_without_spills():
    built = build_all(ARCH)
    assert [f for f, _, _ in built] == [p.name for p in kernel_sources()]
    assert "rmsnorm.cu" in [f for f, _, _ in built]
    for file, module, _ in built:
        assert module.cubin.startswith(b"\x7fELF"), file
        report = ptxas_report(module.log)
        exprs = instantiations((source_dir() / file).read_text())
        assert exprs and sorted(module.lowered) == sorted(exprs), file
        assert set(module.lowered.values()) <= set(report), (file, module.log)
        for symbol, r in report.items():
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (file, symbol, module.log)
            assert r["registers"] > 0, (file, symbol, module.log)


def test_ptxas_report_reads_spills_and_both_register_formats():
    log = """ptxas info    : Compiling entry function '_Z1ai' for 'sm_90a'
ptxas info    : Function properties for _Z1ai
ptxas         .     48 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 128 bytes smem
ptxas info    : Function properties for _Z6helperv
ptxas         .     16 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function '_Z1bv' for 'sm_90'
ptxas info    : Function properties for _Z1bv
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, 380 bytes cmem[0]"""
    assert ptxas_report(log) == {
        "_Z1ai": dict(registers=255, spill_stores=8, spill_loads=12, stack=48),
        "_Z1bv": dict(registers=40, spill_stores=0, spill_loads=0, stack=0)}


def test_second_compile_is_a_cache_hit_without_nvrtc(monkeypatch, cache):
    first = compile_module("rmsnorm", ARCH, RMSNORM)
    assert not first.cached and (cache / f"{first.key}.msgpack").is_file()

    def no_nvrtc(*_):
        raise AssertionError("NVRTC called on a cache hit")
    monkeypatch.setattr(build, "_nvrtc_compile", no_nvrtc)
    again = compile_module("rmsnorm", ARCH, RMSNORM)
    assert again.cached
    assert (again.cubin, again.lowered, again.log, again.key) == (first.cubin, first.lowered, first.log, first.key)


def test_key_covers_every_included_header(src):
    keys = [cache_key("rmsnorm", ARCH, RMSNORM, src_dir=src)]
    with open(src / "common.cuh", "a") as f:
        f.write('\n#include "inner.cuh"\n')
    (src / "inner.cuh").write_text("#pragma once\n")
    keys.append(cache_key("rmsnorm", ARCH, RMSNORM, src_dir=src))
    (src / "inner.cuh").write_text("#pragma once\n// changed\n")
    keys.append(cache_key("rmsnorm", ARCH, RMSNORM, src_dir=src))
    assert len(set(keys)) == 3
    assert cache_key("rmsnorm", ARCH, RMSNORM, src_dir=src) == keys[-1]


def test_key_covers_arch_options_defines_and_names(monkeypatch):
    base = cache_key("rmsnorm", ARCH, RMSNORM)
    assert cache_key("rmsnorm", ARCH, RMSNORM) == base
    others = [cache_key("rmsnorm", "sm_90", RMSNORM), cache_key("rmsnorm", "sm_100a", RMSNORM),
              cache_key("rmsnorm", ARCH, RMSNORM, {"DSV4RT_TEST": 1}), cache_key("rmsnorm", ARCH, RMSNORM[:1])]
    monkeypatch.setattr(build, "OPTIONS", tuple(o for o in build.OPTIONS if o != "-lineinfo"))
    others.append(cache_key("rmsnorm", ARCH, RMSNORM))
    assert len({base, *others}) == 1 + len(others)


def test_cache_location(monkeypatch, tmp_path, cache):
    assert cache_dir() == cache
    m = compile_module("rmsnorm", ARCH, RMSNORM)
    assert [p.name for p in cache.iterdir()] == [f"{m.key}.msgpack"]
    monkeypatch.delenv("DSV4RT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "dsv4rt" / "kernels"


def test_compile_error_names_file_and_line(tmp_path, cache):
    d = tmp_path / "bad"
    d.mkdir()
    shutil.copy(source_dir() / "common.cuh", d)
    (d / "bug.cu").write_text('#include "common.cuh"\n\ntemplate <typename T>\n__global__ void bug(T* x) {\n'
                              "    x[0] = no_such_name;\n}\n")
    with pytest.raises(KernelBuildError) as e:
        compile_module("bug", ARCH, ["bug<float>"], src_dir=d)
    lines = str(e.value).splitlines()
    assert lines[0] == "cannot compile bug.cu for sm_90a:"
    assert any("bug.cu(5)" in line and "error" in line for line in lines[1:]), str(e.value)
    assert not cache.exists() or not any(cache.iterdir())


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong-shape", "empty"])
def test_corrupt_entry_is_rebuilt(cache, damage):
    good = compile_module("rmsnorm", ARCH, RMSNORM)
    entry = cache / f"{good.key}.msgpack"
    data = entry.read_bytes()
    entry.write_bytes({"truncate": data[:len(data) // 2], "garbage": b"\xc1" * 64,
                       "wrong-shape": msgpack.packb({"cubin": "not bytes"}), "empty": b""}[damage])
    rebuilt = compile_module("rmsnorm", ARCH, RMSNORM)
    assert not rebuilt.cached and rebuilt.cubin == good.cubin
    assert msgpack.unpackb(entry.read_bytes())["cubin"] == good.cubin
    assert compile_module("rmsnorm", ARCH, RMSNORM).cached


def test_two_processes_build_the_same_new_kernel(src, cache):
    args = ("rmsnorm", ARCH, RMSNORM, {"DSV4RT_TEST_FRESH": 1}, src)
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        a, b = pool.starmap(compile_module, [args, args])
    assert a.cubin == b.cubin and a.cubin.startswith(b"\x7fELF") and a.key == b.key
    assert [p.name for p in cache.iterdir()] == [f"{a.key}.msgpack"]
    hit = compile_module(*args)
    assert hit.cached and hit.cubin == a.cubin


def test_cli_build_json(cache):
    r = dsv4rt("build", "--arch", ARCH, "--json", DSV4RT_CACHE_DIR=str(cache))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    files = {f["file"]: f for f in out["files"]}
    assert out["arch"] == ARCH and not files["rmsnorm.cu"]["cached"]
    assert sorted(k["name"] for k in files["rmsnorm.cu"]["kernels"]) == sorted(RMSNORM)
    table = dsv4rt("build", "--arch", ARCH, DSV4RT_CACHE_DIR=str(cache))
    assert table.returncode == 0, table.stderr
    assert any(line.startswith("rmsnorm.cu") and " hit " in line for line in table.stdout.splitlines()), table.stdout


def test_cli_build_without_arch_or_gpu(cache):
    r = dsv4rt("build", DSV4RT_CACHE_DIR=str(cache), CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == ["error: no GPU visible; pass --arch (e.g. sm_90a)"]
    assert r.stdout == ""


def test_cli_build_rejects_a_malformed_arch(cache):
    r = dsv4rt("build", "--arch", "sm90", DSV4RT_CACHE_DIR=str(cache))
    assert r.returncode == 1 and r.stderr.strip().splitlines() == ["error: --arch must look like sm_90a, got 'sm90'"]
