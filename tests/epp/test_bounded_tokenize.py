"""The EPP tokenizes only a character prefix of a long prompt (epp/kv_events/tokenize.py prefix_tokens), and the
ids it keeps are exactly the first ids of the whole prompt's tokenization: checked against full tokenization for
the byte tokenizer and for byte-level BPEs trained here, with and without splitting the text into words first,
on random text (hypothesis) and on real text (Python sources)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.epp.kv_events.tokenize import PromptTokenizer
from kvgate.epp.types import LLMRequest

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SPECIALS = ["<s>", "</s>", "<|user|>", "<|end|>", "<|assistant|>"]


def _sources(count: int = 25) -> list[str]:
    import transformers

    files = sorted((Path(transformers.__file__).parent / "models").rglob("*.py"))
    return [f.read_text(errors="replace") for f in files[:count]]


def _train_bpe(folder: Path, split_words: bool) -> str:
    """A 3000-entry byte-level BPE trained on transformers' sources; `split_words` = GPT-2's regex pre-split,
    else the whole text is one word (merges may cross spaces, as with tokenizers that do not pre-split)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_words)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_sources(), trainers.BpeTrainer(
        vocab_size=3000, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("KVGATE_CACHE_DIR", str(tmp_path_factory.mktemp("kvgate-cache")))
    found = {"byte": PromptTokenizer(),
             "bpe": PromptTokenizer(_train_bpe(tmp_path_factory.mktemp("bpe"), split_words=True)),
             "bpe-unsplit": PromptTokenizer(_train_bpe(tmp_path_factory.mktemp("bpe1"), split_words=False))}
    yield found
    mp.undo()


def _check(tok: PromptTokenizer, body: dict, limit: int) -> None:
    request = LLMRequest("r", "m", "m", "", body=body)
    full = tok.tokens(request)
    got = tok.prefix_tokens(request, limit)
    assert full is not None and got is not None
    if got.complete:
        assert got.ids == full and got.count == len(full)
    else:
        assert len(got.ids) == limit < len(full), (len(got.ids), limit, len(full))
        assert got.ids == full[:limit]
        assert got.count > limit


ALPHABET = st.sampled_from([*"aaaabbbcde  \n\t.,;:()=_-'\"0123456789", "é", "ß", "日本", "🌍", "    ", "\n\n",
                            "def ", "self.", "return ", *SPECIALS])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["byte", "bpe", "bpe-unsplit"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(ALPHABET, min_size=1, max_size=600), limit=st.integers(1, 120), chat=st.booleans())
def test_the_kept_ids_are_the_whole_prompts_first_ids_on_random_text(tokenizers, name, parts, limit, chat):
    text = "".join(parts)
    body = {"messages": [{"role": "system", "content": text[:40]}, {"role": "user", "content": text}]} if chat \
        else {"prompt": text}
    _check(tokenizers[name], body, limit)


@pytest.mark.parametrize("name", ["byte", "bpe", "bpe-unsplit"])
def test_the_kept_ids_are_the_whole_prompts_first_ids_on_real_text(tokenizers, name):
    rng = random.Random(0)
    sources = _sources(200)[100:]  # not the training text
    for _ in range(40):
        text = rng.choice(sources)
        start = rng.randrange(len(text))
        text = text[start:start + rng.randrange(200, 20000)]
        limit = rng.choice([16, 64, 256, 1024])
        _check(tokenizers[name], {"prompt": text}, limit)
        _check(tokenizers[name], {"messages": [{"role": "user", "content": text}]}, limit)


def test_only_a_prefix_of_a_long_prompt_is_tokenized(tokenizers):
    """Work bounded by the limit, not by the prompt: a 4 MiB prompt costs what its first ~limit tokens cost."""
    tok = tokenizers["byte"]
    calls = []
    real = tok._bounded_encoder._backend

    class Counting:
        def encode_batch(self, texts, **kw):
            calls.append(len(texts[0]))
            return real.encode_batch(texts, **kw)

    tok._bounded_encoder._backend = Counting()
    try:
        text = "word " * (800 * 1024)  # 4 MB
        got = tok.prefix_tokens(LLMRequest("r", "m", "m", "", body={"prompt": text}), 4096)
    finally:
        tok._bounded_encoder._backend = real
    assert len(got.ids) == 4096 and not got.complete
    assert sum(calls) <= 2 * (4096 + tok.cut_margin), calls
    assert abs(got.count - len(text)) < 0.01 * len(text)  # estimated from the part tokenized (a token a byte)
