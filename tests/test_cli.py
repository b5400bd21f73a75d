"""The command line end to end: logits, inspect, make-tiny, chat; bad input gives one line and exit 1."""
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_A, rel_rows

ROOT = Path(__file__).resolve().parents[1]


def dsv4rt(*args, stdin: str = "", env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run the real program, as a user would (a fresh process, its own stdin)."""
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "dsv4rt", *map(str, args)], input=stdin, capture_output=True,
                          text=True, env=full_env, cwd=cwd, timeout=600)


def assert_one_line_error(r: subprocess.CompletedProcess, *fragments: str):
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny"
    r = dsv4rt("make-tiny", out, "--preset", "tiny", "--seed", "3")
    assert r.returncode == 0, r.stderr
    return out


def logits_of(tmp_path, ids: np.ndarray, *flags) -> np.ndarray:
    """What `dsv4rt logits` on tiny-a writes for `ids` with the given flags."""
    np.save(tmp_path / "ids.npy", ids)
    r = dsv4rt("logits", TINY_A, "--ids", tmp_path / "ids.npy", "--out", tmp_path / "o.npy", *flags)
    assert r.returncode == 0, r.stderr
    return np.load(tmp_path / "o.npy")


def test_logits_full_and_chunked_match_golden(tmp_path):
    g = np.load(TINY_A / "golden.npz")
    assert rel_rows(logits_of(tmp_path, g["input_ids"], "--device", "cpu"), g["logits_full"]).max() < 1e-5
    out = logits_of(tmp_path, g["input_ids"], "--device", "cpu", "--chunks", ",".join(map(str, g["chunks"])))
    assert out.dtype == np.float32 and out.shape == g["logits_chunked"].shape
    assert rel_rows(out, g["logits_chunked"]).max() < 1e-5


def test_logits_faithful(tmp_path):
    f = np.load(TINY_A / "faithful_fp32.npz")
    assert rel_rows(logits_of(tmp_path, f["input_ids"], "--numerics", "faithful", "--device", "cpu"), f["logits_full"]).max() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("storage, tol", [("float32", 1e-4), ("bf16", None)])
def test_logits_on_the_gpu(tmp_path, storage, tol):
    g = np.load(TINY_A / "golden.npz")
    out = logits_of(tmp_path, g["input_ids"], "--device", "cuda", "--chunks", ",".join(map(str, g["chunks"])),
                    "--storage", storage)
    err = rel_rows(out, g["logits_chunked"])
    assert err.max() < tol if tol else np.median(err) < 3e-2


@pytest.mark.parametrize("chunks, message", [("40,1", "must be positive and sum to the 160 tokens"),
                                             ("4,x", "--chunks must be comma-separated integers")])
def test_logits_bad_chunks(tmp_path, chunks, message):
    np.save(tmp_path / "ids.npy", np.load(TINY_A / "golden.npz")["input_ids"])
    r = dsv4rt("logits", TINY_A, "--ids", tmp_path / "ids.npy", "--out", tmp_path / "o.npy", "--chunks", chunks)
    assert_one_line_error(r, message)
    assert not (tmp_path / "o.npy").exists() and os.listdir(tmp_path) == ["ids.npy"]


@pytest.mark.parametrize("ids, message", [(np.zeros((2, 3), np.int64), "1-D integer array"),
                                          (np.array([1.5]), "1-D integer array"),
                                          (np.array([7, 512]), "token ids must lie in [0, 512)")])
def test_logits_bad_ids(tmp_path, ids, message):
    np.save(tmp_path / "ids.npy", ids)
    r = dsv4rt("logits", TINY_A, "--ids", tmp_path / "ids.npy", "--out", tmp_path / "o.npy")
    assert_one_line_error(r, message)
    assert not (tmp_path / "o.npy").exists()


def test_logits_cuda_refused_clearly(tmp_path):
    from dsv4rt.cuda.driver import gpu_visible
    if gpu_visible():
        pytest.skip("a GPU is visible")
    np.save(tmp_path / "ids.npy", np.array([1, 2, 3]))
    r = dsv4rt("logits", TINY_A, "--ids", tmp_path / "ids.npy", "--out", tmp_path / "o.npy", "--device", "cuda")
    assert_one_line_error(r, "--device cuda")


def _write_bad(folder: Path, kind: str):
    folder.mkdir()
    (folder / "config.json").write_bytes((TINY_A / "config.json").read_bytes())
    body = (TINY_A / "model.safetensors").read_bytes()
    if kind == "header beyond file":
        (folder / "model.safetensors").write_bytes((10 ** 9).to_bytes(8, "little") + body[8:100])
    elif kind == "header not json":
        (folder / "model.safetensors").write_bytes((5).to_bytes(8, "little") + b"{nope" + b"\0" * 10)
    elif kind == "empty file":
        (folder / "model.safetensors").write_bytes(b"")
    elif kind == "config not json":
        (folder / "model.safetensors").write_bytes(body)
        (folder / "config.json").write_text("{ not json")
    elif kind == "shard escapes":
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../evil.safetensors"}}))
    elif kind == "sizes disagree":
        (folder / "model.safetensors").write_bytes(body)
        cfg = json.loads((TINY_A / "config.json").read_text())
        cfg["q_lora_rank"] = 40
        (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("kind, message", [
    ("header beyond file", "header"), ("header not json", "JSON"), ("empty file", "model.safetensors"),
    ("config not json", "config"), ("shard escapes", "evil.safetensors"), ("sizes disagree", "wq_a"),
    ("no such folder", "does not exist"),
])
@pytest.mark.parametrize("command", ["logits", "inspect"])
def test_bad_checkpoint_gives_one_line(tmp_path, kind, message, command):
    model = tmp_path / "m"
    if kind != "no such folder":
        _write_bad(model, kind)
    np.save(tmp_path / "ids.npy", np.array([1, 2, 3]))
    extra = ["--ids", tmp_path / "ids.npy", "--out", tmp_path / "o.npy"] if command == "logits" else []
    r = dsv4rt(command, model, *extra)
    if kind == "sizes disagree" and command == "inspect":
        assert r.returncode == 0  # inspect lists what is there; only loading checks it against the config
        return
    assert_one_line_error(r, message)
    assert not (tmp_path / "o.npy").exists()


def test_inspect_lists_tensors_kinds_and_counts():
    r = dsv4rt("inspect", TINY_A)
    assert r.returncode == 0, r.stderr
    assert "layers.2.attn.indexer.wq_b.weight" in r.stdout and "F32" in r.stdout
    assert "layer kinds: 0:c16a/hash 1:sliding/hash 2:c4a 3:c16a 4:c4a" in r.stdout
    assert "parameters:" in r.stdout


def test_make_tiny_writes_official_names_and_dtypes(tiny_model):
    from dsv4rt.loader import Checkpoint
    assert sorted(p.name for p in tiny_model.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    with Checkpoint.open(tiny_model) as ck:
        ck.validate()
        assert ck.config.vocab_size == 129280
        assert ck.stored_dtype("embed.weight") == "BF16"
        assert ck.stored_dtype("layers.2.attn.wq_a.weight") == "BF16"
        assert ck.stored_dtype("layers.2.attn.compressor.ape") == "F32"
        assert ck.stored_dtype("layers.0.hc_attn_fn") == "F32"
        assert ck.stored_dtype("layers.2.ffn.gate.bias") == "F32"
        assert ck.stored_dtype("layers.0.ffn.gate.tid2eid") == "I32"
        assert not any(n.startswith("model.") for n in ck.names())


def test_make_tiny_refuses_existing_folder(tiny_model):
    assert_one_line_error(dsv4rt("make-tiny", tiny_model, "--preset", "tiny"), "already exists")
    assert_one_line_error(dsv4rt("make-tiny", tiny_model.parent / "x", "--preset", "huge"), "unknown preset")
    assert not (tiny_model.parent / "x").exists()


def test_make_tiny_is_deterministic(tiny_model, tmp_path):
    assert dsv4rt("make-tiny", tmp_path / "again", "--preset", "tiny", "--seed", "3").returncode == 0
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (tiny_model / "model.safetensors").read_bytes()


def test_chat_one_shot(tiny_model):
    r = dsv4rt("chat", tiny_model, "-p", "Hello", "--max-new-tokens", "6", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    again = dsv4rt("chat", tiny_model, "-p", "Hello", "--max-new-tokens", "6", "--temperature", "0")
    assert r.stdout == again.stdout and r.stdout.strip()


def test_chat_repl_commands_and_end_of_input(tiny_model):
    script = "Hello\n/set temperature 0\n/set top_k 5\n/set bogus 1\n/set top_p 7\n/help\n/system Be brief.\nHi\n/clear\n"
    r = dsv4rt("chat", tiny_model, "--max-new-tokens", "4", "--seed", "1", stdin=script)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for expected in ("(temperature = 0.0)", "(top_k = 5)", "/set: unknown setting 'bogus'",
                     "/set: top_p must be in (0, 1]", "/exit", "(system prompt set)", "(conversation cleared)"):
        assert expected in out
    assert "Traceback" not in r.stderr


def test_chat_exit_command_stops_reading(tiny_model):
    r = dsv4rt("chat", tiny_model, "--max-new-tokens", "2", stdin="/exit\n/help\n")
    assert r.returncode == 0 and "/clear" not in r.stdout


def test_chat_bad_flag_value(tiny_model):
    assert_one_line_error(dsv4rt("chat", tiny_model, "-p", "x", "--top-p", "0"), "top_p")


def test_chat_creates_demo_model_once(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    r = dsv4rt("chat", "-p", "Hi", "--max-new-tokens", "3", "--seed", "0", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("creating the demo model") == 1
    assert (tmp_path / "dsv4rt" / "demo" / "model.safetensors").exists()
    r = dsv4rt("chat", "-p", "Hi", "--max-new-tokens", "3", "--seed", "0", env=env)
    assert r.returncode == 0 and "creating" not in r.stderr


def test_ctrl_c_stops_the_reply_and_the_chat_goes_on(tiny_model):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "dsv4rt", "chat", tiny_model, "--max-new-tokens", "100000"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdin.write(b"Tell me a long story\n")
    p.stdin.flush()
    assert select.select([p.stdout], [], [], 120)[0], "no reply started"
    os.read(p.stdout.fileno(), 1)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(b"/help\n", timeout=120)
    assert p.returncode == 0, err
    assert b"[stopped]" in out and b"/system TEXT" in out and b"Traceback" not in err


def test_flash_slice_preset_has_flash_sizes():
    from dsv4rt.config import from_dict
    from dsv4rt.loader import expected_shapes
    from dsv4rt.tiny import PRESETS
    c = from_dict(PRESETS["flash-slice"])
    assert (c.hidden_size, c.num_heads, c.head_dim, c.q_lora_rank, c.o_groups, c.o_lora_rank) == \
        (4096, 64, 512, 1024, 8, 1024)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.window, c.hc_mult) == (64, 128, 512, 128, 4)
    assert c.ratios == (0, 4, 128, 4, 128, 4, 128, 4) and (c.n_experts, c.n_active, c.moe_inter) == (32, 6, 2048)
    params = sum(int(np.prod(s)) for s in expected_shapes(c).values())
    assert 8.5e9 < params < 8.8e9  # 17 GB of bf16


def test_faithful_numerics_may_ask_for_the_gpu(tmp_path):
    """--numerics faithful has a GPU path: without a GPU the refusal names the device, not the numerics."""
    from dsv4rt.cuda.driver import gpu_visible
    if gpu_visible():
        pytest.skip("a GPU is visible")
    np.save(tmp_path / "ids.npy", np.array([1, 2, 3]))
    r = dsv4rt("logits", TINY_A, "--ids", tmp_path / "ids.npy", "--out", tmp_path / "o.npy", "--device", "cuda",
               "--numerics", "faithful")
    assert_one_line_error(r, "--device cuda: no NVIDIA GPU visible")


def test_flash_slice_in_the_released_format_fits_the_faithful_kernels():
    """`make-tiny --preset flash-slice --format official` (not written here: 8.7 billion draws) stores the attention
    GEMMs and the shared expert in fp8 at multiples of 128 (the prefill fp8 GEMM's tiles), the routed experts in
    fp4 at multiples of 32, defaults to faithful numerics and plans 584-byte main and 68-byte indexer entries."""
    from dsv4rt.config import from_dict
    from dsv4rt.kv.plan import build_plan
    from dsv4rt.loader import expected_shapes
    from dsv4rt.reference import default_numerics
    from dsv4rt.tiny import _FP4, _FP8, PRESETS, QUANTIZATION_CONFIG
    cfg = from_dict(dict(PRESETS["flash-slice"], quantization_config=QUANTIZATION_CONFIG, expert_dtype="fp4"))
    shapes = expected_shapes(cfg)
    fp8 = [s for n, s in shapes.items() if _FP8.search(n)]
    fp4 = [s for n, s in shapes.items() if _FP4.search(n)]
    assert len(fp8) == 8 * 5 + 4 * 1 + 8 * 3 and len(fp4) == 8 * 32 * 3   # 4 c4a layers have an indexer
    assert all(n % 128 == 0 and k % 128 == 0 for n, k in fp8) and all(k % 32 == 0 for _, k in fp4)
    assert default_numerics(cfg) == "faithful"
    kinds = {k.name: k.entry_bytes for k in build_plan(cfg).kinds}
    assert (kinds["window"], kinds["indexer"]) == (584, 68)
