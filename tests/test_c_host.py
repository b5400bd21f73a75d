"""examples/c_host: a C program that embeds CPython and hands dsv4rt its own context, stream and arena. Here it
is built with `make` and its errors are checked; on a GPU it writes the CPU engine's greedy reply and takes
next to no device memory outside the arena."""
import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "c_host"
REPO = EXAMPLE.parents[1]
TINY_A = REPO / "tests" / "fixtures" / "tiny-a"
USAGE = ("usage: host MODEL_DIR [--prompt TEXT] [--max-new-tokens N] [--arena-mib N] [--kv-mib N] "
         "[--dtype bf16|float32]\n")

# The driver calls the host makes, answering as a device with 8 of 16 GiB free would; cuda-bindings, which
# needs many more, then finds no usable driver, as on a machine without one.
STAND_IN_DRIVER = r"""
#include <stddef.h>
#include <string.h>
int cuInit(unsigned f) { (void)f; return 0; }
int cuDeviceGet(int *d, int o) { *d = o; return 0; }
int cuDeviceGetName(char *n, int len, int d) { (void)d; strncpy(n, "stand-in", len); return 0; }
int cuCtxCreate_v2(void **c, unsigned f, int d) { (void)f; (void)d; *c = (void *)0x1000; return 0; }
int cuCtxDestroy_v2(void *c) { (void)c; return 0; }
int cuStreamCreate(void **s, unsigned f) { (void)f; *s = (void *)0x2000; return 0; }
int cuStreamDestroy_v2(void *s) { (void)s; return 0; }
int cuMemAlloc_v2(unsigned long long *p, size_t n) { (void)n; *p = 0x7f0000000000ULL; return 0; }
int cuMemFree_v2(unsigned long long p) { (void)p; return 0; }
int cuMemGetInfo_v2(size_t *f, size_t *t) { *f = (size_t)8 << 30; *t = (size_t)16 << 30; return 0; }
int cuGetErrorName(int r, const char **s) { (void)r; *s = "CUDA_ERROR_UNKNOWN"; return 0; }
"""


def build(tmp_path: Path, *make_args: str) -> Path:
    src = tmp_path / "c_host"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("host"))
    r = subprocess.run(["make", "-C", str(src), *make_args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return src / "host"


def run(host: Path, *args: str, timeout: int = 120, **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.run([str(host), *args], capture_output=True, encoding="utf-8", timeout=timeout,
                          env={**os.environ, "PYTHONPATH": path, **env})


def driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def host(tmp_path_factory) -> Path:
    """Built as the example's README says: plain `make`, python3 and its python3-config from the PATH."""
    return build(tmp_path_factory.mktemp("c-host"))


def test_bad_arguments_give_one_line_and_exit_2(host, tmp_path):
    cases = [((), USAGE),
             ((str(TINY_A), "--max-new-tokens", "x"), "host: --max-new-tokens must be a positive integer, got 'x'\n"),
             ((str(TINY_A), "--arena-mib", "0"), "host: --arena-mib must be a positive integer, got '0'\n"),
             ((str(TINY_A), "--kv-mib"), "host: --kv-mib needs a value\n"),
             ((str(TINY_A), "--dtype", "fp8"), "host: --dtype must be bf16 or float32, got 'fp8'\n"),
             ((str(TINY_A), "--top-k", "5"), "host: unexpected argument '--top-k'\n" + USAGE),
             ((str(TINY_A), str(TINY_A)), f"host: unexpected argument '{TINY_A}'\n" + USAGE),
             ((str(tmp_path / "nowhere"),), f"host: model directory '{tmp_path / 'nowhere'}' does not exist\n")]
    for args, stderr in cases:
        r = run(host, *args)
        assert (r.returncode, r.stdout, r.stderr) == (2, "", stderr), args


@pytest.mark.skipif(driver_present(), reason="this machine has a CUDA driver")
def test_without_a_driver_the_host_says_so(host):
    r = run(host, str(TINY_A))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == ("host: cannot load the CUDA driver (libcuda.so.1: cannot open shared object file: No such "
                        "file or directory): this host needs an NVIDIA GPU and its driver\n")


@pytest.mark.skipif(driver_present(), reason="cuda-bindings could find the real driver beside the stand-in")
def test_the_embedded_python_finds_dsv4rt_and_reports_its_error_in_one_line(host, tmp_path):
    (tmp_path / "driver.c").write_text(STAND_IN_DRIVER)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"), str(tmp_path / "driver.c")],
                   check=True, timeout=60)
    r = run(host, str(TINY_A), "--arena-mib", "64", LD_LIBRARY_PATH=str(tmp_path))
    assert r.returncode == 1
    assert r.stdout == "device: stand-in\narena: 64 MiB at 0x7f0000000000, stream 0x2000\n"
    # dsv4rt was imported (numpy and all, from the interpreter make was run with) and its Runtime raised
    assert r.stderr.startswith("host: dsv4rt: CudaError: no CUDA driver") and r.stderr.count("\n") == 1, r.stderr


def test_without_python3_config_the_interpreter_s_own_flags_build_it(tmp_path):
    host = build(tmp_path, f"PYTHON={sys.executable}", "PYTHON_CONFIG=/nonexistent/python3-config")
    r = run(host)
    assert (r.returncode, r.stderr) == (2, USAGE)


def test_missing_python_headers_stop_make_with_the_fix(tmp_path):
    src = tmp_path / "c_host"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("host"))
    (tmp_path / "python3-config").write_text("#!/bin/sh\necho -I/nonexistent/include\n")
    (tmp_path / "python3-config").chmod(0o755)
    r = subprocess.run(["make", "-C", str(src), f"PYTHON_CONFIG={tmp_path / 'python3-config'}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert ("/nonexistent/include/Python.h is missing: install the Python headers "
            "(Debian, Ubuntu: apt-get install python3-dev).  Stop.") in r.stderr


@pytest.mark.gpu
def test_host_replies_from_its_own_context_stream_and_arena(tmp_path):
    from dsv4rt.chat import encode_prompt_ids
    from dsv4rt.engine import Engine
    from dsv4rt.reference.sampling import SamplingParams
    from dsv4rt.tiny import make_tiny
    model = make_tiny(tmp_path / "tiny", "tiny")
    host = build(tmp_path, f"PYTHON={sys.executable}")
    prompt = "Write a haiku about GPUs."
    r = run(host, str(model), "--prompt", prompt, "--max-new-tokens", "12", "--arena-mib", "4096",
            "--kv-mib", "2048", "--dtype", "float32", timeout=900)
    print(r.stdout, r.stderr)    # the figures for the closing note (pytest -s)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    head, text = r.stdout.split("\nreply:\n", 1)
    fields = {key: value.strip() for key, _, value in (line.partition(":") for line in head.splitlines())}

    cpu = Engine(model)          # the float32 GPU engine gives the CPU engine's greedy tokens
    ids = encode_prompt_ids(cpu.tokenizer, [{"role": "user", "content": prompt}])
    (want,) = cpu.generate([ids], SamplingParams(temperature=0, max_new_tokens=12))
    assert fields["token ids"] == " ".join(map(str, want.token_ids))
    assert text == want.text + "\n"

    share = float(fields["dsv4rt's share of the arena"].removesuffix(" MiB"))
    outside = float(fields["taken outside the arena while dsv4rt ran"].removesuffix(" MiB"))
    assert share > 2048          # the KV cache, weights and workspaces all came from the arena...
    assert outside < 512         # ...and outside it only the driver's own (kernel code, graphs, cuBLAS state)
