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
from click.testing import CliRunner, Result

from conftest import TINY_A, rel_rows
from dsv4rt.cli import main

ROOT = Path(__file__).resolve().parents[1]


def dsv4rt(*args, stdin: str = "", env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run the real program, as a user would (a fresh process, its own stdin)."""
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "dsv4rt", *map(str, args)], input=stdin, capture_output=True,
                          text=True, env=full_env, cwd=cwd, timeout=600)


def run(*args, env: dict | None = None) -> Result:
    """The command line in this process (click's runner): argument checks need no fresh interpreter."""
    return CliRunner(env=env).invoke(main, [str(a) for a in args], catch_exceptions=False)


def assert_one_line_error(r: subprocess.CompletedProcess | Result, *fragments: str, code: int = 1) -> str:
    status = r.returncode if isinstance(r, subprocess.CompletedProcess) else r.exit_code
    assert status == code, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny"
    r = run("make-tiny", out, "--preset", "tiny", "--seed", "3")
    assert r.exit_code == 0, r.stderr
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


@pytest.fixture
def unreadable_weights(tmp_path) -> Path:
    """tiny-a's config beside weights that fail to load: an option error here shows it came first."""
    model = tmp_path / "m"
    _write_bad(model, "header not json")
    return model


@pytest.mark.parametrize("chunks, message", [
    ("40,1", "--chunks: chunk sizes [40, 1] must be positive and sum to the 160 tokens"),
    ("200,-40", "--chunks: chunk sizes [200, -40] must be positive and sum to the 160 tokens"),
    ("4,x", "--chunks must be comma-separated integers, got '4,x'")])
def test_logits_bad_chunks_before_loading(tmp_path, unreadable_weights, chunks, message):
    np.save(tmp_path / "ids.npy", np.load(TINY_A / "golden.npz")["input_ids"])
    r = run("logits", unreadable_weights, "--ids", tmp_path / "ids.npy", "--out", tmp_path / "o.npy", "--chunks", chunks)
    assert assert_one_line_error(r) == f"error: {message}"
    assert sorted(os.listdir(tmp_path)) == ["ids.npy", "m"]


@pytest.mark.parametrize("ids, message", [(np.zeros((2, 3), np.int64), "1-D integer array"),
                                          (np.array([1.5]), "1-D integer array"),
                                          (np.array([], np.int64), "non-empty"),
                                          (np.array([7, 512]), "--ids: token ids must lie in [0, 512), got 7..512"),
                                          (np.array([-1, 5]), "--ids: token ids must lie in [0, 512), got -1..5")])
def test_logits_bad_ids_before_loading(tmp_path, unreadable_weights, ids, message):
    np.save(tmp_path / "ids.npy", ids)
    r = run("logits", unreadable_weights, "--ids", tmp_path / "ids.npy", "--out", tmp_path / "o.npy")
    assert_one_line_error(r, "--ids: ", message)
    assert not (tmp_path / "o.npy").exists()


def test_logits_ids_that_are_not_a_file(tmp_path):
    os.mkfifo(tmp_path / "ids.npy")  # reading it would wait for a writer forever
    r = run("logits", TINY_A, "--ids", tmp_path / "ids.npy", "--out", tmp_path / "o.npy")
    assert assert_one_line_error(r) == f"error: --ids: {tmp_path / 'ids.npy'}: is a FIFO, not a regular file"
    (tmp_path / "x.npy").write_bytes(b"not numpy")
    r = run("logits", TINY_A, "--ids", tmp_path / "x.npy", "--out", tmp_path / "o.npy")
    assert_one_line_error(r, f"--ids: {tmp_path / 'x.npy'}: not a readable .npy file")


def test_logits_cuda_refused_clearly(tmp_path):
    from dsv4rt.cuda.driver import gpu_visible
    if gpu_visible():
        pytest.skip("a GPU is visible")
    np.save(tmp_path / "ids.npy", np.array([1, 2, 3]))
    r = run("logits", TINY_A, "--ids", tmp_path / "ids.npy", "--out", tmp_path / "o.npy", "--device", "cuda")
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
    r = run(command, model, *extra)
    if kind == "sizes disagree" and command == "inspect":
        assert r.exit_code == 0  # inspect lists what is there; only loading checks it against the config
        return
    assert_one_line_error(r, message)
    assert not (tmp_path / "o.npy").exists()


def test_inspect_lists_tensors_kinds_and_counts():
    r = run("inspect", TINY_A)
    assert r.exit_code == 0, r.stderr
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
    assert_one_line_error(run("make-tiny", tiny_model, "--preset", "tiny"), "already exists")
    r = run("make-tiny", tiny_model.parent / "x", "--preset", "huge")
    assert assert_one_line_error(r, code=2) == \
        "error: Invalid value for '--preset': 'huge' is not one of 'demo', 'flash-slice', 'tiny'."
    assert not (tiny_model.parent / "x").exists()


def test_make_tiny_help_lists_the_presets():
    from dsv4rt.tiny import PRESETS
    r = run("make-tiny", "--help")
    assert r.exit_code == 0 and f"[{'|'.join(PRESETS)}]" in r.stdout, r.stdout


def test_make_tiny_is_deterministic(tiny_model, tmp_path):
    assert run("make-tiny", tmp_path / "again", "--preset", "tiny", "--seed", "3").exit_code == 0
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
    assert_one_line_error(run("chat", tiny_model, "-p", "x", "--top-p", "0"), "top_p")


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


def test_fast_numerics_are_taken(tmp_path):
    """tiny-a stores no weight in fp8, so fast computes faithful's logits; fast plans faithful's caches."""
    f = np.load(TINY_A / "faithful_fp32.npz")
    out = logits_of(tmp_path, f["input_ids"], "--numerics", "fast", "--device", "cpu")
    assert rel_rows(out, f["logits_full"]).max() < 1e-4
    plans = {}
    for numerics in ("faithful", "fast"):
        r = run("plan", "--model", TINY_A, "--context", 4096, "--numerics", numerics, "--json")
        assert r.exit_code == 0, r.stderr
        plans[numerics] = json.loads(r.stdout)
    assert plans["fast"].pop("numerics") == "fast" and plans["faithful"].pop("numerics") == "faithful"
    assert plans["fast"] == plans["faithful"]


@pytest.mark.parametrize("args", [["chat", TINY_A, "-p", "hi"], ["generate", TINY_A, "--prompts", "p.txt"],
                                  ["logits", TINY_A, "--ids", "ids.npy", "--out", "o.npy"], ["serve", TINY_A],
                                  ["plan", "--model", TINY_A]], ids=lambda a: a[0])
def test_numerics_are_checked(args):
    r = run(*args, "--numerics", "fastest")
    assert assert_one_line_error(r, code=2) == \
        "error: Invalid value for '--numerics': 'fastest' is not one of 'exact', 'faithful', 'fast'."


def test_faithful_numerics_may_ask_for_the_gpu(tmp_path):
    """--numerics faithful has a GPU path: without a GPU the refusal names the device, not the numerics."""
    from dsv4rt.cuda.driver import gpu_visible
    if gpu_visible():
        pytest.skip("a GPU is visible")
    np.save(tmp_path / "ids.npy", np.array([1, 2, 3]))
    r = run("logits", TINY_A, "--ids", tmp_path / "ids.npy", "--out", tmp_path / "o.npy", "--device", "cuda",
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


# --- every value checked before any model is loaded, naming its option or key --------------------

@pytest.mark.parametrize("change, message", [
    ({"layer_types": 5}, "key 'layer_types' must be a list of strings, got 5"),
    ({"compress_ratios": [[4]] * 5, "layer_types": None}, "key 'compress_ratios' must be a list of integers, got [[4], [4], [4], [4], [4]]"),
    ({"eos_token_id": [[1]]}, "key 'eos_token_id' must be an id or a non-empty list of ids, got [[1]]"),
    ({"rope_theta": float("nan"), "rope_parameters": None}, "key 'rope_theta' must be a finite number above 1, got nan"),
    ({"rope_theta": -1.0, "rope_parameters": None}, "key 'rope_theta' must be a finite number above 1, got -1.0"),
    ({"rms_norm_eps": -1e-6}, "key 'rms_norm_eps' must be a finite number in (0, 1), got -1e-06"),
    ({"routed_scaling_factor": float("nan")}, "key 'routed_scaling_factor' must be a finite number in (0, 100], got nan"),
    ({"rope_scaling": {"type": "yarn", "factor": 0, "original_max_position_embeddings": 64}, "rope_parameters": None},
     "key 'rope_scaling.factor' must be a finite number of at least 1, got 0"),
])
@pytest.mark.parametrize("command", ["inspect", "logits", "plan"])
def test_bad_config_value_gives_one_line_naming_file_and_key(tmp_path, change, message, command):
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes((TINY_A / "model.safetensors").read_bytes())
    cfg = json.loads((TINY_A / "config.json").read_text())
    cfg.update(change)
    (model / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    np.save(tmp_path / "ids.npy", np.array([1, 2, 3]))
    args = {"inspect": ["inspect", model], "plan": ["plan", "--model", model, "--context", 64],
            "logits": ["logits", model, "--ids", tmp_path / "ids.npy", "--out", tmp_path / "o.npy"]}[command]
    assert assert_one_line_error(run(*args)) == f"error: {model / 'config.json'}: {message}"
    assert not (tmp_path / "o.npy").exists()


@pytest.fixture
def prompts(tmp_path) -> Path:
    (tmp_path / "prompts.txt").write_text("Hello\nHow are you?\n")
    return tmp_path / "prompts.txt"


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0, got -1.0"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0, got inf"),
    (["--seed", "-1"], "--seed must be an integer from 0 to 2**64 - 1, got -1"),
    (["--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--top-k", "-3"], "--top-k must be an integer >= 0, got -3"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
])
def test_generate_checks_sampling_options_before_loading(tmp_path, prompts, flags, message):
    r = run("generate", tmp_path / "no-such-model", "--prompts", prompts, *flags)
    assert assert_one_line_error(r) == f"error: {message}"


def test_generate_checks_the_prompts_file_before_loading(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    r = run("generate", tmp_path / "no-such-model", "--prompts", tmp_path / "fifo")
    assert assert_one_line_error(r) == f"error: --prompts: {tmp_path / 'fifo'}: is a FIFO, not a regular file"
    (tmp_path / "blank.txt").write_text("\n  \n")
    r = run("generate", tmp_path / "no-such-model", "--prompts", tmp_path / "blank.txt")
    assert assert_one_line_error(r) == f"error: --prompts: {tmp_path / 'blank.txt'}: no prompts (one per line)"
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    r = run("generate", tmp_path / "no-such-model", "--prompts", tmp_path / "latin1.txt")
    assert assert_one_line_error(r) == f"error: --prompts: {tmp_path / 'latin1.txt'}: not UTF-8 text"


def test_generate_takes_top_k_and_top_p(tiny_model, prompts):
    """top-k 1 leaves the argmax alone, whatever the temperature; so does a top-p that keeps one token."""
    def tokens(*flags):
        r = run("generate", tiny_model, "--prompts", prompts, "--max-new-tokens", 5, "--json", "--device", "cpu",
                "--seed", 1, *flags)
        assert r.exit_code == 0, r.stderr
        return [json.loads(line)["token_ids"] for line in r.stdout.splitlines()]
    greedy = tokens("--temperature", 0)
    assert tokens("--temperature", 5, "--top-k", 1) == greedy
    assert tokens("--temperature", 0.01, "--top-p", 1e-9) == greedy


def test_option_type_errors_are_one_line():
    r = run("generate", "m", "--prompts", "p", "--seed", "abc")
    assert assert_one_line_error(r, code=2) == "error: Invalid value for '--seed': 'abc' is not a valid integer."
    assert assert_one_line_error(run("no-such-command"), code=2) == "error: No such command 'no-such-command'."


@pytest.mark.parametrize("args, message", [
    (["decode", "--batch", "1,0"], "Invalid value for '--batch': '1,0' is not a comma-separated list of positive whole numbers"),
    (["decode", "--context", "inf"], "Invalid value for '--context': 'inf' is not a comma-separated list of positive whole numbers"),
    (["decode", "--copy-gbps", "nan"], "Invalid value for '--copy-gbps': nan must be a finite number above 0"),
    (["decode", "--reps", "0"], "Invalid value for '--reps': 0 is not in the range x>=1."),
    (["prefill", "--tokens", "x"], "Invalid value for '--tokens': 'x' is not a comma-separated list of positive whole numbers"),
    (["serve", "--prompt-len", "50,10"], "Invalid value for '--prompt-len': '50,10' must be min,max with min <= max"),
    (["serve", "--output-len", "16"], "Invalid value for '--output-len': '16' must be min,max with min <= max"),
    (["serve", "--seed", "-2"], "Invalid value for '--seed': -2 is not in the range 0<=x<=4294967295."),
])
def test_bench_options_are_checked(tmp_path, args, message):
    r = run("bench", args[0], "--model", tmp_path / "no-such-model", *args[1:])
    assert assert_one_line_error(r, code=2) == f"error: {message}"


# --- build: progress per file, one line without the CUDA extras -----------------------------------

def test_build_without_the_cuda_extras(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # what `pip install -e .` alone leaves
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)
    line = assert_one_line_error(run("build", "--arch", "sm_90a"))
    assert line.startswith("error: dsv4rt build needs NVRTC, from the CUDA extras: pip install -e '.[cu13]'"), line


def test_build_shows_progress_per_kernel_file(tmp_path, monkeypatch):
    pytest.importorskip("cuda.bindings")
    from dsv4rt.cuda import build
    src = tmp_path / "src"
    src.mkdir()
    for name in ("rmsnorm.cu", "common.cuh"):
        (src / name).write_bytes((build.source_dir() / name).read_bytes())
    (src / "copy.cu").write_text((src / "rmsnorm.cu").read_text())
    monkeypatch.setattr(build, "source_dir", lambda: src)
    monkeypatch.setenv("DSV4RT_CACHE_DIR", str(tmp_path / "cache"))
    first, again = run("build", "--arch", "sm_90a"), run("build", "--arch", "sm_90a")
    assert first.exit_code == 0 and again.exit_code == 0, first.stderr
    lines = first.stderr.splitlines()
    assert lines[0] == f"building 2 kernel files for sm_90a into {tmp_path / 'cache'}"
    assert lines[1].startswith("[1/2] copy.cu ... compiled in ") and lines[1].endswith(" s")
    assert lines[2].startswith("[2/2] rmsnorm.cu ... compiled in ")
    assert again.stderr.splitlines()[1:] == ["[1/2] copy.cu ... cached", "[2/2] rmsnorm.cu ... cached"]


# --- the demo model ---------------------------------------------------------------------------------

def _first_chat_setup(cache: str, start, results):
    os.environ["XDG_CACHE_HOME"] = cache
    from dsv4rt.cli.chat import _ensure_demo
    start.wait()
    try:
        results.put(str(_ensure_demo()))
    except BaseException as e:
        results.put(f"{type(e).__name__}: {e}")


def test_two_first_chats_at_once_share_one_demo_model(tmp_path):
    """Both build the demo; one rename wins, the other finds the winner's (identical) model in place."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_first_chat_setup, args=(str(tmp_path), start, results)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    demo = tmp_path / "dsv4rt" / "demo"
    assert sorted(results.get(timeout=5) for _ in procs) == [str(demo)] * 2
    assert sorted(p.name for p in demo.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert [p.name for p in (tmp_path / "dsv4rt").iterdir()] == ["demo"]  # the loser's temporary folder is gone


@pytest.mark.parametrize("field, value, message", [
    ("temperature", float("nan"), "temperature must be a finite number >= 0, got nan"),
    ("temperature", True, "temperature must be a finite number >= 0, got True"),
    ("top_p", 0, "top_p must be in (0, 1], got 0"),
    ("top_k", 2.5, "top_k must be an integer >= 0, got 2.5"),
    ("max_new_tokens", np.int64(0), "max_new_tokens must be an integer >= 1, got 0"),
    ("seed", -1, "seed must be an integer from 0 to 2**64 - 1, got -1"),
    ("seed", 2 ** 64, "seed must be an integer from 0 to 2**64 - 1, got 18446744073709551616"),
    ("seed", 1.0, "seed must be an integer from 0 to 2**64 - 1, got 1.0"),
])
def test_sampling_params_check_names_the_field(field, value, message):
    from dsv4rt.reference.sampling import SamplingParams
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value}).check()
    assert str(e.value) == message
    assert SamplingParams(temperature=np.float32(0.5), top_k=np.int32(3), seed=2 ** 64 - 1).check()
