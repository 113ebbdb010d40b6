"""The gateway's torch-free tokenizer gives what the transformers tokenizer gives."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gateway.detokenizer import IncrementalDetokenizer
from gateway.tokenizer import GatewayTokenizer
from tests.fixtures_models import tiny_model_dir, tiny_tokenizer  # noqa: F401

TEXTS = ["def f(x):\n    return x", "", "héllo 🌍 wörld", "<|im_start|>user\nhi<|im_end|>", "  spaces  \t\n"]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort <|im_end|> a list"},
     {"role": "assistant", "content": "sorted(xs)"}, {"role": "user", "content": "thanks"}],
]


@pytest.fixture(scope="module")
def ours(tiny_model_dir):  # noqa: F811
    return GatewayTokenizer(tiny_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(ours, tiny_tokenizer, text):  # noqa: F811
    for special in (True, False):
        ids = tiny_tokenizer.encode(text, add_special_tokens=special)
        assert ours.encode(text, add_special_tokens=special) == ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == tiny_tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, tiny_tokenizer, messages, add_generation_prompt):  # noqa: F811
    kw = dict(add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, **kw) == tiny_tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    assert ours.apply_chat_template(messages, tokenize=True, **kw) == list(
        tiny_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


def test_detokenizer_works_on_it(ours, tiny_tokenizer):  # noqa: F811
    ids = tiny_tokenizer.encode("naïve 🌍 code\n\tpass", add_special_tokens=False)
    detok = IncrementalDetokenizer(ours)
    text = "".join(detok.append([t]) for t in ids) + detok.finish()
    assert text == tiny_tokenizer.decode(ids, skip_special_tokens=True)


def test_the_gateway_never_imports_torch(tiny_model_dir):  # noqa: F811
    code = (
        "import sys; import gateway.server, gateway.http_server, gateway.generation;"
        "from gateway.tokenizer import GatewayTokenizer;"
        f"t = GatewayTokenizer({str(tiny_model_dir)!r}); t.encode('x'); t.decode([5, 6]);"
        "t.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True);"
        "from stepahead.builtin_models import resolve_model;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
