"""The gateway's torch-free tokenizer gives what the transformers tokenizer gives, on the
built-in `tiny` (trained here) and on the real `smollm2-135m` (converted from its GGUF)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gateway.detokenizer import IncrementalDetokenizer
from gateway.tokenizer import GatewayTokenizer
from tests.fixtures_models import smollm2_model_dir, tiny_model_dir  # noqa: F401

TEXTS = ["def f(x):\n    return x", "", "héllo 🌍 wörld", "<|im_start|>user\nhi<|im_end|>", "  spaces  \t\n",
         " The capital of France is Paris.", "日本語のテキスト\r\nand Ünïcödé", "<|endoftext|>x<|im_end|>", "a" * 300]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort <|im_end|> a list"},
     {"role": "assistant", "content": "sorted(xs)"}, {"role": "user", "content": "thanks"}],
]


@pytest.fixture(scope="module", params=["tiny", "smollm2-135m"])
def model_dir(request):
    return request.getfixturevalue({"tiny": "tiny_model_dir", "smollm2-135m": "smollm2_model_dir"}[request.param])


@pytest.fixture(scope="module")
def ours(model_dir):
    return GatewayTokenizer(model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    """The transformers tokenizer of the same directory (the oracle)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(ours, hf_tokenizer, text):
    for special in (True, False):
        ids = hf_tokenizer.encode(text, add_special_tokens=special)
        assert ours.encode(text, add_special_tokens=special) == ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, hf_tokenizer, messages, add_generation_prompt):
    kw = dict(add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, **kw) == hf_tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    assert ours.apply_chat_template(messages, tokenize=True, **kw) == list(
        hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


def test_continuing_the_final_message_matches_transformers(ours, hf_tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, here is"}]
    kw = dict(add_generation_prompt=False, continue_final_message=True)
    ours_text = ours.apply_chat_template(messages, **kw)
    assert ours_text == hf_tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    assert ours_text.endswith("Sure, here is")  # open: no end-of-turn after it


THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n"
                     "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                     "{% endif %}{% endif %}")  # the part of Qwen3's template that reads enable_thinking


def test_template_kwargs_reach_the_template_as_in_transformers(tiny_model_dir, tmp_path):  # noqa: F811
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(tiny_model_dir, tmp_path / "m")
    (tmp_path / "m" / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    ours, hf = GatewayTokenizer(tmp_path / "m"), AutoTokenizer.from_pretrained(tmp_path / "m")
    messages = CONVERSATIONS[0]
    for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        assert ours.apply_chat_template(messages, add_generation_prompt=True, **kwargs) == expected
    assert "<think>" in ours.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)


def test_detokenizer_works_on_it(ours, hf_tokenizer):
    ids = hf_tokenizer.encode("naïve 🌍 code\n\tpass", add_special_tokens=False)
    detok = IncrementalDetokenizer(ours)
    text = "".join(detok.append([t]) for t in ids) + detok.finish()
    assert text == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_the_gateway_never_imports_torch(tiny_model_dir):  # noqa: F811
    code = (
        "import sys; import gateway.server, gateway.http_server, gateway.generation;"
        "from gateway.tokenizer import GatewayTokenizer;"
        f"t = GatewayTokenizer({str(tiny_model_dir)!r}); t.encode('x'); t.decode([5, 6]);"
        "t.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True);"
        "from model_zoo.builtin_models import resolve_model;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_a_template_that_drops_the_final_message_cannot_continue_it(tiny_model_dir, tmp_path):  # noqa: F811
    import shutil

    from gateway.generation import Frontend
    from gateway.metrics import GatewayMetrics
    from gateway.validation import ValidationError
    from stepahead import codec
    from stepahead.v1 import scheduler_pb2

    shutil.copytree(tiny_model_dir, tmp_path / "m")
    (tmp_path / "m" / "chat_template.jinja").write_text("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}")
    hello = scheduler_pb2.WorkerHello(model_name="m", max_model_len=64, vocab_size=100)
    front = Frontend(GatewayTokenizer(tmp_path / "m"), codec.worker_info_from_proto(hello), None, 1 << 20,
                     GatewayMetrics())
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    with pytest.raises(ValidationError) as refused:
        front.render_chat(messages, False, continue_final_message=True)
    assert refused.value.field == "continue_final_message" and "cannot continue it" in refused.value.reason
    assert front.render_chat(messages, False)  # without it the template renders


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_into_the_text_even_inside_a_character(ours, hf_tokenizer, text):
    """OpenAI's logprobs `bytes`: each token's own bytes, which join into the text's UTF-8 also
    where a character spans tokens (the token's text alone shows U+FFFD there); the oracle is
    the transformers tokenizer's byte-level vocabulary."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    ids = ours.encode(text, add_special_tokens=False)
    got = [ours.token_bytes(i) for i in ids]
    assert b"".join(got) == text.encode()
    special = set(hf_tokenizer.all_special_ids) | set(hf_tokenizer.added_tokens_decoder)
    want = [hf_tokenizer.convert_ids_to_tokens(i).encode() if i in special else
            bytes(byte_of[c] for c in hf_tokenizer.convert_ids_to_tokens(i)) for i in ids]
    assert got == want


def test_token_bytes_of_a_sentencepiece_tokenizer_with_byte_fallback(tmp_path):
    """Llama-2's kind: `▁` for spaces and a `<0xHH>` token per byte for what the vocabulary lacks."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he"):
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [("▁", "h")], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = GatewayTokenizer(tmp_path)
    text = "hello wörld 👨"
    ids = ours.encode(text, add_special_tokens=False)
    got = [ours.token_bytes(i) for i in ids]
    assert ours.decode(ids) == text and b"".join(got) == b" " + text.encode()  # the leading ▁ is a space
    assert got[ids.index(vocab["<0xF0>"])] == b"\xf0" and ours.token_bytes(vocab["</s>"]) == b"</s>"
