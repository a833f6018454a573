"""The host side of a step, cheap and computing what the plain version does: the KV cache manager's block
table rows (what the runner gathers instead of per-request block lists), text decoded when it is read, the end of
a request tested against one set of ids, and the greedy argmax taken in the model's dtype."""

import random

import numpy as np
import pytest
import torch
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer

from kvgate.engine.block_table import BlockTable
from kvgate.common.demo import ensure_demo_model
from kvgate.engine.detokenizer import IncrementalDetokenizer
from kvgate.engine.kv_cache_manager import KVCacheManager
from kvgate.engine.request import Request, RequestStatus
from kvgate.engine.sampler import Sampler, SamplingBatch
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.scheduler import Scheduler
from kvgate.engine.step_inputs import StepInputs


def test_block_table_grows_in_rows_and_columns_and_reuses_released_rows():
    t = BlockTable(max_blocks_per_row=2, rows=2)
    a, b = t.row("a"), t.row("b")
    t.write(a, 0, [7, 8])
    t.write(b, 0, [9])
    c = t.row("c")  # a third request: the table doubles its rows
    assert len({a, b, c}) == 3 and t.ids.shape[0] == 4
    t.write(a, 2, [10, 11, 12])  # past the columns: they grow, the row keeps what it had
    assert t.ids[a, :5].tolist() == [7, 8, 10, 11, 12] and t.ids[b, 0] == 9
    t.release("a")
    assert "a" not in t.row_of and t.row("d") == a  # a released row is taken again
    assert t.row("d") == a  # asking again gives the same row


@pytest.mark.parametrize("caching", [True, False])
def test_the_scheduled_rows_hold_each_request_s_block_ids(caching):
    """Random requests through the scheduler (prefix hits, chunked prefill, preemption, ends): after every
    schedule, each scheduled request's row holds exactly its block ids, and no two scheduled requests share a
    row; what the runner gathers for a step equals the block lists it used to build."""
    rng = random.Random(1)
    kv = KVCacheManager(40, 4, enable_caching=caching, max_blocks_per_request=4, max_requests=2)
    s = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=24)
    inputs = StepInputs(24, 6, 64, 4, torch.device("cpu"))
    shared = [rng.randrange(100) for _ in range(12)]
    added = checked = 0
    for step in range(300):
        if added < 60 and rng.random() < 0.3:
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(100) for _ in range(rng.randint(1, 30))]
            s.add_request(Request(f"r{added}", prompt, SamplingParams(max_tokens=rng.randint(1, 40)),
                                  max_model_len=200))
            added += 1
        out = s.schedule()
        if out.is_empty:
            continue
        rows = [x.block_row for x in out.scheduled]
        assert len(set(rows)) == len(rows)
        inputs.prepare(out)
        for i, x in enumerate(out.scheduled):
            ids = kv.get_block_ids(x.request.request_id)
            assert ids and out.block_table.ids[x.block_row, :len(ids)].tolist() == ids
            used = -(-(x.start + x.num_new_tokens) // 4)
            assert inputs.view("block_table")[i, :used].tolist() == ids[:used]
            checked += 1
        s.update_from_output(out, {x.request.request_id: rng.randrange(100) for x in out.scheduled if x.samples})
    assert checked > 500 and s.num_preemptions > 0
    assert kv.block_table.ids.shape[0] >= 6  # grown past the two rows it started with


def _demo_tokenizer():
    return AutoTokenizer.from_pretrained(str(ensure_demo_model()))


def test_text_read_late_equals_text_decoded_token_by_token():
    """Without stop strings tokens wait and are decoded when the text is read; the text is the token-by-token
    stream's at every read, including a read that ends inside a multi-byte character (its complete part shows)."""
    tok = _demo_tokenizer()
    rng = random.Random(3)
    for trial in range(40):
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 8))]
        # Printable ASCII, multi-byte characters split into byte tokens, and stray bytes.
        out = []
        for _ in range(rng.randint(1, 60)):
            pick = rng.random()
            out += (tok.encode(rng.choice("é漢😀"), add_special_tokens=False) if pick < 0.2
                    else [rng.randrange(128, 256)] if pick < 0.3 else [rng.randrange(32, 127)])
        out.append(tok.encode("é", add_special_tokens=False)[0])  # ends inside a character
        late = IncrementalDetokenizer(tok, SamplingParams(), prompt)
        stream = DecodeStream(ids=list(prompt[-6:]), skip_special_tokens=True)
        expected = ""
        for i, t in enumerate(out):
            assert late.add_token(t) is None
            expected += stream.step(tok.backend_tokenizer, t) or ""
            if rng.random() < 0.2 or i == len(out) - 1:
                assert late.output_text == expected
    assert late.output_text == expected and late.next_delta(finished=True) == expected


def test_stop_strings_still_decode_every_token():
    tok = _demo_tokenizer()
    d = IncrementalDetokenizer(tok, SamplingParams(stop=["lo w"]), tok.encode("x", add_special_tokens=False))
    stop = None
    for t in tok.encode("hello world", add_special_tokens=False):
        stop = d.add_token(t)
        if stop is not None:  # the request ends here
            break
    assert stop == "lo w" and d.output_text == "hel"


@pytest.mark.parametrize("params,tokens,status,reason", [
    (dict(max_tokens=9, stop_token_ids=[5]), [1, 5], RequestStatus.FINISHED_STOPPED, 5),
    (dict(max_tokens=9, eos_token_ids=(2,)), [1, 2], RequestStatus.FINISHED_STOPPED, None),
    (dict(max_tokens=9, eos_token_ids=(2,), ignore_eos=True), [2, 2, 2], None, None),
    (dict(max_tokens=9, eos_token_ids=(2,), ignore_eos=True, stop_token_ids=[2]), [2], RequestStatus.FINISHED_STOPPED, 2),
    (dict(max_tokens=9, eos_token_ids=(2,), min_tokens=3), [2, 2, 2], RequestStatus.FINISHED_STOPPED, None),
    (dict(max_tokens=9, stop_token_ids=[5], min_tokens=2), [5, 1, 5], RequestStatus.FINISHED_STOPPED, 5),
    (dict(max_tokens=2), [1, 2], RequestStatus.FINISHED_LENGTH, None),
])
def test_check_stop_ends_a_request_as_before(params, tokens, status, reason):
    r = Request("r", [0, 0], SamplingParams(**params), max_model_len=100)
    ended = []
    for t in tokens:
        r.append_output_token(t)
        ended.append(r.check_stop())
    assert ended[:-1] == [False] * (len(tokens) - 1)
    assert ended[-1] == (status is not None)
    if status is not None:
        assert r.status == status and r.stop_reason == reason


def test_greedy_argmax_in_bf16_equals_the_float32_path():
    torch.manual_seed(0)
    logits = torch.randn(64, 1000).to(torch.bfloat16)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the first index either way
    reqs = [Request(f"r{i}", [1], SamplingParams(temperature=0.0), max_model_len=10) for i in range(64)]
    batch = SamplingBatch.build(reqs, 1000, torch.device("cpu"))
    assert batch.all_greedy and batch.temperature is None
    tokens, _ = Sampler()(logits, batch)
    assert torch.equal(tokens, logits.float().argmax(dim=-1)) and tokens[3] == 10
    # With logprobs the float32 path runs, and picks the same tokens.
    reqs[0] = Request("r0", [1], SamplingParams(temperature=0.0, logprobs=1), max_model_len=10)
    tokens2, device_lps = Sampler()(logits, SamplingBatch.build(reqs, 1000, torch.device("cpu")))
    lps = device_lps.entries()
    assert torch.equal(tokens2, tokens) and lps[0] is not None and np.isfinite(list(lps[0].values())[0].logprob)
