"""`dsv4rt chat` on the Engine: the tokens the Engine samples for the same prompt and seed, an interrupted
reply that leaves history and cache as a fresh run of that history, turns that fail and a REPL that
goes on, /set checked like the options, the random-weights banner."""
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import rel_rows, used_pages
from dsv4rt.chat.session import ChatSession, Reply
from dsv4rt.cli import main
from dsv4rt.engine import Engine
from dsv4rt.reference.sampling import SamplingParams
from dsv4rt.tiny import make_tiny

ROOT = Path(__file__).resolve().parents[1]
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=8, seed=11)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("chat") / "tiny", "tiny", seed=3)


class LastLogits:
    """Wraps the reference model: keeps the logits of the last position of every forward."""

    def __init__(self, model):
        self.model, self.rows = model, []

    def new_state(self):
        return self.model.new_state()

    def forward(self, state, ids):
        logits = self.model.forward(state, ids)
        self.rows.append((state.pos, logits[-1]))
        return logits


def engine_text(engine: Engine, ids: list[int], params: SamplingParams):
    (out,) = engine.generate([ids], params)
    return out


def test_a_reply_is_what_the_engine_samples_for_the_prompt_and_seed(tiny):
    session = ChatSession(Engine(tiny), SAMPLED, system="Be brief.")
    ids = session.prompt_ids([{"role": "user", "content": "Hello"}])
    out = Reply()
    text = "".join(session.reply("Hello", out))
    expected = engine_text(Engine(tiny), ids, SAMPLED)
    assert out.tokens == len(expected.token_ids) + (expected.finish_reason == "stop")
    assert text == expected.text and out.content == expected.text
    assert session.messages == [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": text}]


@pytest.mark.parametrize("how", ["close", "KeyboardInterrupt"])
def test_an_interrupted_reply_is_kept_and_the_next_turn_is_a_fresh_run_of_the_history(tiny, how):
    engine = Engine(tiny)
    session = ChatSession(engine, SamplingParams(temperature=0.9, max_new_tokens=10_000, seed=4))
    pieces, out = session.reply("Tell me a story", Reply()), None
    for n, _ in enumerate(pieces):
        if n == 3:
            break
    if how == "close":
        pieces.close()
    else:
        with pytest.raises(KeyboardInterrupt):
            pieces.throw(KeyboardInterrupt)
    assert not engine.has_unfinished()
    assert used_pages(engine) == 0
    partial = session.messages[-1]
    assert partial["role"] == "assistant" and len(session.messages) == 2
    engine.runner.model = recording = LastLogits(engine.model)
    session.params = SAMPLED
    out = Reply()
    second = "".join(session.reply("And then?", out))
    history = [{"role": "user", "content": "Tell me a story"}, partial, {"role": "user", "content": "And then?"}]
    fresh = ChatSession(Engine(tiny), SAMPLED)
    ids = fresh.prompt_ids(history)
    first_sampled = next(row for pos, row in recording.rows if pos == len(ids))
    assert rel_rows(first_sampled[None], engine.model.logits_chunked(ids)[-1:]).max() <= 1e-5
    assert second == engine_text(fresh.engine, ids, SAMPLED).text


def test_a_failing_turn_leaves_the_history_and_the_next_turn_works(tiny, capsys):
    from dsv4rt.cli.chat import _say
    engine = Engine(tiny)
    session = ChatSession(engine, SamplingParams(temperature=0, max_new_tokens=4))
    run = engine.runner.run

    def out_of_memory(step):
        raise MemoryError
    engine.runner.run = out_of_memory
    assert not _say(session, "Hello")
    assert capsys.readouterr().err == "error: out of host memory\n"
    assert session.messages == [] and not engine.has_unfinished()
    engine.runner.run = run
    assert _say(session, "Hello") and len(session.messages) == 2


def test_a_message_beyond_the_context_is_refused_before_any_work(tiny):
    engine = Engine(tiny, max_len=64)
    session = ChatSession(engine, SamplingParams(max_new_tokens=100))
    with pytest.raises(ValueError, match="the message is too long: the prompt would be .* the context holds 64"):
        next(session.reply("word " * 80, Reply()))
    assert engine.loop.steps == 0 and session.messages == []
    ids, params = session.turn_request("Hi")
    assert params.max_new_tokens == 64 - len(ids)      # the reply is cut to the context left


def chat(*args, stdin=""):
    return CliRunner().invoke(main, ["chat", *map(str, args)], input=stdin)


def test_piped_repl_survives_bad_settings_and_a_too_long_message(tiny):
    script = "/set seed -1\n/set temperature nan\n/set top_k x\n" + "word " * 70_000 + "\nHello\n"
    r = chat(tiny, "--max-new-tokens", "3", "--temperature", "0", stdin=script)
    assert r.exit_code == 0, r.output
    assert "/set: seed must be an integer from 0 to 2**64 - 1, got -1\n" in r.stdout
    assert "/set: temperature must be a finite number >= 0, got nan\n" in r.stdout
    assert "/set: top_k must be an integer, got 'x'\n" in r.stdout
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: the message is too long: the prompt would be ")
    reply = r.stdout.rsplit("got 'x'\n", 1)[1]
    (expected,) = Engine(tiny).generate([ChatSession(Engine(tiny)).prompt_ids([{"role": "user", "content": "Hello"}])],
                                        SamplingParams(temperature=0, max_new_tokens=3))
    assert reply == expected.text + "\n"


def test_one_shot_gives_the_engine_tokens_and_the_demo_banner_says_random(tiny, monkeypatch):
    import dsv4rt.cli.chat as chat_cli
    r = chat(tiny, "-p", "Hello", "--seed", "5", "--max-new-tokens", "6")
    session = ChatSession(Engine(tiny))
    expected = engine_text(session.engine, session.prompt_ids([{"role": "user", "content": "Hello"}]),
                           SamplingParams(max_new_tokens=6, seed=5))
    assert r.exit_code == 0 and r.stdout == expected.text + "\n" and r.stderr == ""
    monkeypatch.setattr(chat_cli, "_ensure_demo", lambda: Path(tiny))
    r = chat("-p", "Hello", "--max-new-tokens", "2")
    assert r.exit_code == 0 and "random weights" in r.stderr
    r = chat("--max-new-tokens", "2", stdin="Hi\n")
    assert r.exit_code == 0 and "random weights" in r.stderr


def test_interactive_chat_on_a_terminal_gives_the_engine_tokens(tiny):
    """The REPL with a real terminal on stdin (the prompt, the banner on stdout)."""
    leader, follower = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "dsv4rt", "chat", str(tiny), "--seed", "9", "--max-new-tokens", "5"],
                         stdin=follower, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    os.close(follower)
    os.write(leader, b"Hello\n")
    os.write(leader, b"\x04")                    # Ctrl-D: the end of input
    try:
        out, err = p.communicate(timeout=120)
    finally:
        os.close(leader)
    assert p.returncode == 0, err
    session = ChatSession(Engine(tiny))
    expected = engine_text(session.engine, session.prompt_ids([{"role": "user", "content": "Hello"}]),
                           SamplingParams(max_new_tokens=5, seed=9))
    text = out.decode()
    assert text.startswith(f"dsv4rt chat: {tiny} on the CPU. /help for commands")
    assert f">>> {expected.text}\n>>> " in text
    assert "random" not in text


@pytest.mark.gpu
def test_chat_on_the_gpu_gives_the_gpu_engine_tokens(tiny):
    """The chat's GPU engine steps in the engine loop's thread: the same tokens as its own generate."""
    from dsv4rt.cli.chat import _engine
    engine = _engine(Path(tiny), "cuda", None, 8192)
    session = ChatSession(engine, SAMPLED)
    ids = session.prompt_ids([{"role": "user", "content": "Hello"}])
    text = "".join(session.reply("Hello", Reply()))
    assert text == engine_text(engine, ids, SAMPLED).text
    engine.runner.close()
    engine.runner.model.rt.close()
