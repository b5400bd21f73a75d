from .detok import StreamDecoder
from .encoding import encode_messages, encode_prompt_ids
from .tokenizer import ASSISTANT, BOS, END_THINK, EOS, THINK, USER, load_tokenizer, tokenizer_json_path

__all__ = [
    "ASSISTANT", "BOS", "END_THINK", "EOS", "THINK", "USER",
    "StreamDecoder", "encode_messages", "encode_prompt_ids", "load_tokenizer", "tokenizer_json_path",
]
