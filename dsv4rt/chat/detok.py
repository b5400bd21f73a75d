"""Streaming detokenization that never emits half a UTF-8 character."""
import codecs
import functools


def _byte_level_alphabet():
    """GPT-2 byte-level BPE: printable bytes stand for themselves, the others for U+0100 onward."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(rest)}
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()
@functools.cache  # a tokenizers.Tokenizer hashes and compares by identity: one entry per tokenizer object
def _shared(tokenizer) -> tuple:
    """(its special ids, bytes of the tokens seen so far): what every decoder of one tokenizer shares. Walking the
    added tokens for the special ids takes about a millisecond, which a server would otherwise pay per request,
    and the token bytes cache fills once."""
    return frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special), {}


class StreamDecoder:
    """Feed token ids one at a time; get back only text whose UTF-8 bytes are complete.

    Works on each token's bytes with an incremental UTF-8 decoder, so the cost per token is constant and the
    concatenated output equals `tokenizer.decode(ids)`.
    """

    def __init__(self, tokenizer, skip_special=True):
        self._tokenizer = tokenizer
        special, self._bytes_of = _shared(tokenizer)
        self._skip = special if skip_special else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id) -> str:
        token_id = int(token_id)
        if token_id in self._skip:
            return ""
        return self._utf8.decode(self._token_bytes(token_id))

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text

    def _token_bytes(self, token_id):
        data = self._bytes_of.get(token_id)
        if data is None:
            token = self._tokenizer.id_to_token(token_id)
            if token is None:
                raise ValueError(f"token id {token_id} is outside the tokenizer's vocabulary")
            try:
                data = bytes(_BYTE_OF_CHAR[c] for c in token)
            except KeyError:
                # Like the tokenizers ByteLevel decoder: a token outside the byte alphabet (e.g. <｜User｜>) is literal text.
                data = token.encode()
            self._bytes_of[token_id] = data
        return data
