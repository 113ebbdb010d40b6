"""The gateway's tokenizer: Hugging Face `tokenizers` plus the chat template, without torch.

`transformers.AutoTokenizer` imports torch when it is installed; the gateway must not (it
is a control-plane process). This reads the same files a Hugging Face checkpoint ships
(`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja` or the config's
`chat_template`) and offers the few methods the gateway uses, with the same results as
the transformers tokenizer: `encode`, `decode`, `apply_chat_template` (rendered by
transformers' own torch-free jinja renderer, with the special tokens as variables).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import re
import threading
from pathlib import Path

from tokenizers import Tokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from stepahead.limits import SPECIAL_TOKEN_KEYS

_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))  # transformers' clean_up_tokenization


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: the character each byte is written as in a
    byte-level vocabulary -> that byte (printable bytes stand for themselves, the others are
    moved to 256 and up)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(moved)}}


_BYTE_OF_CHAR = _byte_of_char()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_kinds(decoder: dict | None) -> set[str]:
    """The decoder steps of a tokenizer.json (`ByteLevel`, `ByteFallback`, `Metaspace`, and
    `Replace` of SentencePiece's `▁` by a space as `Metaspace`)."""
    if not decoder:
        return set()
    if decoder.get("type") == "Sequence":
        return set().union(*(_decoder_kinds(d) for d in decoder.get("decoders") or ()))
    if decoder.get("type") == "Replace" and (decoder.get("pattern") or {}).get("String") == "▁":
        return {"Metaspace"}
    return {decoder.get("type")}


def _token_text(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):  # an AddedToken as saved
        return value["content"]
    return None


class HeapTrim:
    """Hands the heap freed by refused requests back to the OS, once, a moment after a refusal.

    A refused request still leaves its body, its parse and its strings freed in glibc's
    arenas; glibc keeps such memory for reuse, so a burst of large refusals would leave the
    gateway that much bigger while idle. `malloc_trim` returns it; it walks every arena, so
    it runs at most once per `delay_s`, on a timer thread, never on an event loop. A no-op
    where the C library has no `malloc_trim` (not glibc).
    """

    def __init__(self, delay_s: float = 1.0) -> None:
        self._delay_s = delay_s
        self._pending = self._asked = False
        self._lock = threading.Lock()
        name = ctypes.util.find_library("c")
        try:
            self._trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
        except OSError:
            self._trim = None

    def soon(self) -> None:
        if self._trim is None:
            return
        with self._lock:
            self._asked = True
            if self._pending:
                return
            self._pending = True
        self._start()

    def _start(self) -> None:
        timer = threading.Timer(self._delay_s, self._run)
        timer.daemon = True
        timer.start()

    def _run(self) -> None:
        with self._lock:
            self._asked = False
        gc.collect(1)  # a refusal's exception and traceback keep its body in a cycle until collected
        self._trim(0)
        with self._lock:  # refused while this one waited or ran: their memory may still have been held
            again = self._pending = self._asked
        if again:
            self._start()


HEAP_TRIM = HeapTrim()


class GatewayTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self.model_dir = model_dir.resolve()  # /v1/models gives it as `root` (a client loads the tokenizer there)
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = model_dir / "chat_template.jinja"
        self.chat_template: str | None = (
            template_path.read_text() if template_path.is_file() else config.get("chat_template")
        )
        self.special_tokens_map = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        decoder = self._tokenizer.decoder  # its own JSON, not the whole tokenizer's
        self._decoder = _decoder_kinds(json.loads(decoder.__getstate__()) if decoder is not None else None)
        self._added = self._tokenizer.get_added_tokens_decoder()  # id -> AddedToken (specials among them)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        text = self._tokenizer.decode(ids if isinstance(ids, list) else list(ids),
                                      skip_special_tokens=skip_special_tokens)
        if self._clean_up_spaces:
            for before, after in _CLEANUPS:
                text = text.replace(before, after)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprobs `bytes`), also when they are part
        of a UTF-8 character, which its text alone cannot show: a byte-level BPE piece through
        GPT-2's byte alphabet, a byte-fallback piece `<0xHH>` its byte, a SentencePiece piece
        with `▁` as a space, an added (special) token its content; otherwise the UTF-8 of the
        token decoded alone."""
        added = self._added.get(token_id)
        if added is not None:
            return added.content.encode()
        piece = self._tokenizer.id_to_token(token_id)
        if piece is not None:
            if "ByteLevel" in self._decoder and all(c in _BYTE_OF_CHAR for c in piece):
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            if "ByteFallback" in self._decoder and (hexa := _BYTE_FALLBACK.fullmatch(piece)):
                return bytes((int(hexa[1], 16),))
            if "Metaspace" in self._decoder:
                return piece.replace("▁", " ").encode()
        return self.decode([token_id]).encode()

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=with_added_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = False, tools: list[dict] | None = None,
                            continue_final_message: bool = False, **template_kwargs) -> str | list[int]:
        """transformers' `apply_chat_template`: `template_kwargs` are more variables for the template."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        rendered, _ = render_jinja_template(
            conversations=[messages], chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt, tools=tools, continue_final_message=continue_final_message,
            **template_kwargs, **self.special_tokens_map,
        )
        text = rendered[0]
        return self.encode(text, add_special_tokens=False) if tokenize else text
