"""Train the built-in byte-level BPE tokenizer offline, from the Python standard library.

The corpus is a deterministic, sorted subset of the stdlib's own `.py` sources (present on
every machine), so the trained tokenizer is identical across runs on the same Python.
Imports of `tokenizers` / `transformers` stay inside functions: the CLI imports this lazily.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Order fixes the ids: pad=0, bos=1, eos=2, im_start=3, im_end=4.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

# ChatML-like: every turn is `<|im_start|>role\ncontent<|im_end|>\n`, after a leading bos.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class CorpusSpec:
    """Which stdlib files feed the trainer: sorted `*.py` paths until `max_bytes` is reached."""

    max_bytes: int
    max_files: int = 10_000


def stdlib_dir() -> Path:
    path = Path(sysconfig.get_paths()["stdlib"])
    if not path.is_dir():
        raise FileNotFoundError(f"the Python standard library directory {path} does not exist")
    return path


def corpus_files(spec: CorpusSpec, root: Path | None = None) -> list[Path]:
    """Deterministic subset: the stdlib's `.py` files outside tests and site-packages, sorted."""
    root = stdlib_dir() if root is None else root
    excluded = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    candidates = sorted(
        p for p in root.rglob("*.py") if not excluded.intersection(p.relative_to(root).parts)
    )
    chosen: list[Path] = []
    total = 0
    for path in candidates:
        if total >= spec.max_bytes or len(chosen) >= spec.max_files:
            break
        chosen.append(path)
        total += path.stat().st_size
    if not chosen:
        raise FileNotFoundError(f"no .py source files found under the stdlib directory {root}")
    return chosen


def _iter_texts(files: list[Path]) -> Iterator[str]:
    for path in files:
        # Some stdlib files are deliberately non-UTF-8 (encoding tests); replace, never skip.
        yield path.read_bytes().decode("utf-8", errors="replace")


def train_bpe(vocab_size: int, corpus: CorpusSpec):
    """A byte-level BPE `tokenizers.Tokenizer` with `vocab_size` entries (specials included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size <= len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for merges beyond 256 bytes")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = corpus_files(corpus)
    tokenizer.train_from_iterator(_iter_texts(files), trainer=trainer, length=len(files))
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Like Llama: encode(text) prepends bos; add_special_tokens=False leaves it out.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return tokenizer


def build_hf_tokenizer(vocab_size: int, corpus: CorpusSpec, model_max_length: int):
    """Train and wrap as a transformers fast tokenizer with specials and the chat template."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(vocab_size, corpus),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
