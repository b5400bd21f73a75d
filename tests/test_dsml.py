import json
import random
import re
from pathlib import Path

import pytest

from dsv4rt.chat import StreamDecoder, encode_messages, load_tokenizer
from dsv4rt.chat.dsml import StreamParser, parse_completion, prompt_ids, render_prompt

GOLDEN = Path(__file__).resolve().parent / "fixtures" / "chat"
D, E = "｜DSML｜", "<｜end▁of▁sentence｜>"


def param(key, value, string=True):
    return f'<{D}parameter name="{key}" string="{"true" if string else "false"}">{value}</{D}parameter>'


def invoke(name, *params):
    return f'<{D}invoke name="{name}">\n' + "\n".join(params) + f"\n</{D}invoke>"


def block(*invokes):
    return f"\n\n<{D}tool_calls>\n" + "\n".join(invokes) + f"\n</{D}tool_calls>"


NESTED = {"units": ["C", "F"], "deep": {"x": [1, 2.5, {"y": None, "z": "é<b>"}]}}
WEATHER = invoke("get_weather", param("city", "Paris"), param("days", "3", False),
                 param("opts", json.dumps(NESTED, ensure_ascii=False), False), param("exact", "true", False))
ECHO = invoke("echo", param("text", 'He said "hi"\n<b>ok</b> {not json} \\n'))
THREE_CALLS = [("get_weather", {"city": "Paris", "days": 3, "opts": NESTED, "exact": True}), ("time", {}),
               ("echo", {"text": 'He said "hi"\n<b>ok</b> {not json} \\n'})]
BROKEN_SECOND = f'<{D}invoke name="x">\n<{D}parameter name="a">1</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>'

# (name, completion text, thinking, content, reasoning_content, [(tool name, arguments)])
CASES = [
    ("plain", f"Hello there.{E}", False, "Hello there.", "", []),
    ("reasoning", f"Let me think.\nOK.</think>Answer.{E}", True, "Answer.", "Let me think.\nOK.", []),
    ("three calls", f"I'll check.{block(WEATHER, invoke('time'), ECHO)}{E}", False, "I'll check.", "", THREE_CALLS),
    ("calls without eos", f"I'll check.{block(WEATHER, invoke('time'), ECHO)}", False, "I'll check.", "",
     THREE_CALLS),
    ("call after reasoning", f"Need the weather.</think>{block(WEATHER)}{E}", True, "", "Need the weather.",
     THREE_CALLS[:1]),
    ("call without </think>", f"I should call the tool.{block(invoke('time'))}{E}", True, "",
     "I should call the tool.", [("time", {})]),
    ("non-json false values kept as strings",
     block(invoke("go", param("to", "Paris", False), param("n", "NaN", False), param("deep", "[" * 3000, False))) + E,
     False, "", "", [("go", {"to": "Paris", "n": "NaN", "deep": "[" * 3000})]),
    ("lookalikes stay content", f"Use <b> and a < sign.\n\n<｜DSML tool_calls>\n\n{E}", False,
     "Use <b> and a < sign.\n\n<｜DSML tool_calls>\n\n", "", []),
    ("marker in reasoning never closed", "Still thinking <｜User｜> about </thin", True, "",
     "Still thinking <｜User｜> about </thin", []),
    ("tokens after eos ignored", f"Done.{E}garbage", False, "Done.", "", []),
]
MALFORMED = [
    ("junk in block", f"x\n\n<{D}tool_calls>\nhello\n</{D}tool_calls>"),
    ("unquoted name", f"{block(f'<{D}invoke name=get>' + chr(10) + f'</{D}invoke>')}"),
    ("no string attribute", block(invoke("get", f'<{D}parameter name="a">1</{D}parameter>'))),
    ("duplicate parameter", block(invoke("get", param("a", "1"), param("a", "2")))),
    ("invoke closed inside a value",
     block(f'<{D}invoke name="get">\n<{D}parameter name="a" string="true">1</{D}invoke>')),
    ("truncated in a value", f"Checking.\n\n<{D}tool_calls>\n<{D}invoke name=\"get\">\n{param('a', '1')[:-5]}"),
    ("name too long", block(invoke("n" * 600))),
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def without_ids(message):
    return {**message, "tool_calls": [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                      for c in message["tool_calls"]]}


def streamed(pieces, thinking, tools=True):
    """The message the streaming deltas add up to, and the deltas."""
    parser = StreamParser(thinking, tools)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    message = {"content": "", "reasoning_content": "", "tool_calls": []}
    for event in events:
        if "tool_call" in event:
            call = event["tool_call"]
            message["tool_calls"].append({"function": {"name": call["name"], "arguments": call["arguments"]}})
        else:
            (kind, text), = event.items()
            message[kind] += text
    return without_ids(message), events


def token_pieces(tok, text, skip_special):
    """The text as the engine streams it: one decoded piece per generated token."""
    decoder = StreamDecoder(tok, skip_special=skip_special)
    return [decoder.push(i) for i in tok.encode(text, add_special_tokens=False).ids] + [decoder.flush()]


def check_every_cut(tok, text, thinking, tools=True):
    """Whole, token by token (eos kept or skipped), char by char and in random chunks: one result."""
    want = without_ids(parse_completion(text, thinking)) if tools else streamed([text], thinking, tools)[0]
    chunkings = [token_pieces(tok, text, False), list(text)]
    if E not in text.removesuffix(E):  # the engine stops at eos, so only a final one may go unseen
        chunkings.append(token_pieces(tok, text, True))
    rng = random.Random(len(text))
    for _ in range(5):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), 6)))
        chunkings.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in chunkings:
        assert streamed(pieces, thinking, tools)[0] == want
    return want


@pytest.mark.parametrize("name, text, thinking, content, reasoning, calls", CASES, ids=[c[0] for c in CASES])
def test_completion_cases(tok, name, text, thinking, content, reasoning, calls):
    got = check_every_cut(tok, text, thinking)
    assert got == {"content": content, "reasoning_content": reasoning, "tool_calls": calls}


@pytest.mark.parametrize("name, text", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_dsml_becomes_content(tok, name, text):
    for thinking in (False, True):
        completion = ("r</think>" if thinking else "") + text + E
        got = check_every_cut(tok, completion, thinking)
        assert got == {"content": text, "reasoning_content": "r" if thinking else "", "tool_calls": []}


def test_good_call_then_broken_one(tok):
    text = f"c\n\n<{D}tool_calls>\n{invoke('time')}\n{BROKEN_SECOND}{E}"
    got = check_every_cut(tok, text, False)
    assert got == {"content": "c\n" + BROKEN_SECOND, "reasoning_content": "", "tool_calls": [("time", {})]}


def test_block_cut_after_a_call_keeps_the_call(tok):
    text = f"c\n\n<{D}tool_calls>\n{invoke('time')}\n{E}"
    assert check_every_cut(tok, text, False) == {"content": "c", "reasoning_content": "", "tool_calls": [("time", {})]}
    text = f"c\n\n<{D}tool_calls>\n{invoke('time')}\n<{D}inv"
    assert check_every_cut(tok, text, False) == {"content": f"c\n<{D}inv", "reasoning_content": "",
                                                 "tool_calls": [("time", {})]}


def test_dsml_is_plain_text_without_tools(tok):
    text = f"Sure.{block(invoke('time'))}{E}"
    assert check_every_cut(tok, text, False, tools=False)["content"] == text[:-len(E)]


def test_every_token_prefix(tok):
    """A completion cut after any token (max_tokens, a disconnect) parses, streamed exactly as whole."""
    text = f"Plan: weather.</think>I'll check.{block(WEATHER, invoke('time'))}{E}"
    ids = tok.encode(text, add_special_tokens=False).ids
    full = without_ids(parse_completion(text, True))
    for n in range(len(ids) + 1):
        pieces = [tok.decode([i], skip_special_tokens=False) for i in ids[:n]]
        got = without_ids(parse_completion("".join(pieces), True))
        assert streamed(pieces, True)[0] == got
        if got["tool_calls"] != full["tool_calls"]:
            assert got["tool_calls"] == full["tool_calls"][:len(got["tool_calls"])]
    assert full["tool_calls"] == [THREE_CALLS[0], ("time", {})]


def test_call_events_arrive_as_each_invoke_closes():
    text = f"I'll check.{block(WEATHER, invoke('time'), ECHO)}"
    parser = StreamParser(False)
    first_close = text.index(f"</{D}invoke>") + len(f"</{D}invoke>")
    assert parser.feed(text[:first_close - 1]) == [{"content": "I'll check."}]
    (event,) = parser.feed(text[first_close - 1:first_close])
    rest = parser.feed(text[first_close:]) + parser.finish()
    calls = [event["tool_call"]] + [e["tool_call"] for e in rest]
    assert [c["index"] for c in calls] == [0, 1, 2]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == THREE_CALLS
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in calls)
    assert len({c["id"] for c in calls}) == 3


def test_marker_prefix_is_held_back():
    parser = StreamParser(True)
    assert parser.feed("Hmm </thi") == [{"reasoning_content": "Hmm "}]
    assert parser.feed("nk>Yes\n\n<") == [{"content": "Yes"}]
    assert parser.feed("b>") == [{"content": "\n\n<b>"}]
    assert parser.feed(f"\n\n<{D}tool") == []
    assert parser.finish() == [{"content": f"\n\n<{D}tool"}]
    assert parser.feed("more") == []


def test_official_arguments_text():
    """Arguments are the official decoder's JSON text: keys in order, string values JSON-escaped, others as written."""
    text = block(invoke("f", param("s", 'a"b'), param("n", "[1,2]", False), param("u", "你", True)))
    (call,) = parse_completion(text, False)["tool_calls"]
    assert call["type"] == "function"
    assert call["function"] == {"name": "f", "arguments": '{"s": "a\\"b", "n": [1,2], "u": "你"}'}


def golden_completions(output, thinking):
    """(completion text, thinking) of each assistant turn in a golden prompt."""
    for turn in output.split("<｜Assistant｜>")[1:]:
        opened = turn.startswith("<think>")
        turn = turn.removeprefix("<think>").removeprefix("</think>").removeprefix("<｜action｜>")
        yield turn[:turn.index(E) + len(E)], opened and thinking


@pytest.mark.parametrize("case, thinking", [(2, True), (4, False)])
def test_golden_assistant_turns_parse_back(tok, case, thinking):
    messages = json.loads((GOLDEN / f"input_{case}.json").read_text(encoding="utf-8"))
    output = (GOLDEN / f"output_{case}.txt").read_text(encoding="utf-8")
    answers = [m for m in messages if m["role"] == "assistant"]
    turns = list(golden_completions(output, thinking))
    assert len(turns) == len(answers)
    for (text, opened), answer in zip(turns, answers):
        got = check_every_cut(tok, text, opened)
        assert got == {"content": answer["content"],
                       "reasoning_content": answer.get("reasoning_content", "") if opened else "", "tool_calls": []}


def test_render_and_parse_round_trip(tok):
    """An assistant turn the encoder writes (history sent back by a client) parses back to the same message."""
    calls = [{"id": f"c{n}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
             for n, (name, args) in enumerate(THREE_CALLS)]
    answer = {"role": "assistant", "content": "On it.", "reasoning_content": "They want weather.", "tool_calls": calls}
    prompt = encode_messages([{"role": "user", "content": "hi"}, answer], "thinking", drop_thinking=False)
    completion = prompt.split("<｜Assistant｜><think>", 1)[1]
    got = check_every_cut(tok, completion, True)
    assert got == {"content": "On it.", "reasoning_content": "They want weather.", "tool_calls": THREE_CALLS}


def test_render_prompt_and_ids(tok):
    messages = json.loads((GOLDEN / "input_2.json").read_text(encoding="utf-8"))
    want = (GOLDEN / "output_2.txt").read_text(encoding="utf-8")
    assert render_prompt(messages, thinking=True) == want
    assert tok.decode(prompt_ids(tok, messages, thinking=True), skip_special_tokens=False) == want
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    ask = [{"role": "user", "content": "<｜Assistant｜>"}]
    text = render_prompt(ask, tools, "required", reasoning_effort="max", thinking=True)
    assert text.startswith("<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum")
    assert "You MUST call at least one of the above tools" in text and text.endswith("<｜Assistant｜><think>")
    ids = prompt_ids(tok, ask, tools, "required", reasoning_effort="max", thinking=True)
    assert ids.count(tok.token_to_id("<｜Assistant｜>")) == 1
    none = render_prompt(ask, tools, "none")
    assert none == "<｜begin▁of▁sentence｜><｜User｜><｜Assistant｜><｜Assistant｜></think>"


def test_mutated_completions_stream_as_whole():
    """Seeded fuzz: completions with markers inserted, text cut out or the end cut off never raise, and every way
    of cutting them into pieces gives the whole-text result."""
    rng = random.Random(7)
    atoms = ["\n", "\n\n", " ", "<", ">", '"', f"<{D}tool_calls>", f"</{D}tool_calls>", f'<{D}invoke name="',
             f"</{D}invoke>", f'<{D}parameter name="', f"</{D}parameter>", '" string="false">', "</think>", E, D, "{"]
    bases = [c[1] for c in CASES] + [m[1] + E for m in MALFORMED]
    for _ in range(300):
        text = rng.choice(bases)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(text) + 1)
            text = rng.choice([text[:at] + rng.choice(atoms) + text[at:], text[:at] + text[at + rng.randint(1, 5):],
                               text[:at]])
        thinking = rng.random() < 0.5
        want = without_ids(parse_completion(text, thinking))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), 8)))
        for pieces in (list(text), [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]):
            assert streamed(pieces, thinking)[0] == want, (text, thinking)
