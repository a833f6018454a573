"""Speculative decoding with a draft model (vLLM's `{"method": "draft_model", "model": PATH, ...}`).

A second, smaller model of the same vocabulary, in the same process, on the target's device and dtype, proposes the
K drafts of each decoding request. Its KV cache is paged like the target's and shares the target's block ids: the
same blocks and slots, its own per-layer tensors of the same number of blocks (its bytes per block are added to the
target's, so the block count stays honest). A request's blocks are allocated by the scheduler for the target's
chunk (its last token + K drafts), which covers every slot the draft writes this step.

Each request remembers how many of its tokens the draft has computed (`DraftState`). Per step, for the step's
drafting requests together: one forward computes what the draft has not (the context when the request first drafts,
less what prefix reuse skips, then usually just the last token, two after a fully accepted run), whose last rows
give the first drafts, then K - 1 single-token forwards give the rest. Rejected drafts need no rollback here: the
draft's computed count is clipped to the target's, and a position is recomputed before it is read.

Prefix reuse: prefix-cache hits carry over to the draft where its K/V in the blocks is known to be valid. The
proposer keeps, per block id, the hash of the block whose content the draft's K/V there was computed for
(`block_hashes`): set at the end of a step for each full block (of known tokens: never the tail, never draft
positions) whose every position the request's draft has computed (its positions below `DraftState.computed`, which
stay valid: those of rejected drafts are clipped off before anything reads them), cleared whenever the draft
writes any position of the block (for any request; a full block is shared only by requests of equal content, and
whoever writes it computes all of it that step, so it is re-set at the step's end). A block's hash chains its
parent's, so an equal hash means equal content of the block and everything before it; the draft's K/V in a block
changes only when the draft writes it, so an equal hash stays valid through eviction, reallocation and the target
writing the block for other content (the draft never wrote it then). When a request first drafts (also after a
preemption, whose blocks are new), its computation starts after the longest run of leading full blocks whose
tracked hash equals the request's own hash of that block (the manager's chained hashes, request.block_hashes: the
hash the pool gives the block; empty with prefix caching off, so nothing is reused then), never the last token,
whose row gives the first draft. Requests that first draft in the same step share too: a later one's run may go
through full blocks that an earlier one's catch-up computes in this step (`pending`), and it then catches up in a
forward after all of the first ones. `stats` counts what the draft computed and what reuse skipped.

Drafts: the argmax for greedy requests; for sampled ones a draw from q, the draft's distribution after the
request's temperature, min-p, top-k and top-p (as the target's rows are processed); q's rows go to the verifier for
the rejection sampler (spec_decode.verify_sampled). The draft runs the torch SDPA path eagerly, on CUDA too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgate.engine.attention import AttentionMetadata
from kvgate.engine.block_table import BlockTable
from kvgate.common.errors import ConfigError
from kvgate.engine.kv_cache_manager import cdiv
from kvgate.engine.kv_quant import allocate_kv_caches, kv_bytes_per_block
from kvgate.common.tokenizer_files import load_tokenizer
from kvgate.engine.loader import load_hf_config, load_model
from kvgate.engine.sampler import Sampler, SamplingBatch
from kvgate.engine.spec_decode import Proposer, SpeculativeConfig


class DraftState:
    """A request's draft-side progress: tokens whose K/V the draft holds, valid while its preemptions are these, its
    leading full blocks whose hash the proposer has recorded as the draft's (`marked`), and the tokens its draft
    skipped at the start by prefix reuse (`reused`)."""

    __slots__ = ("computed", "preemptions", "marked", "reused")

    def __init__(self, preemptions: int) -> None:
        self.computed = 0
        self.preemptions = preemptions
        self.marked = 0
        self.reused = 0


@dataclass
class DraftStats:
    """The draft's work since the proposer was built, in positions (tokens)."""

    computed_tokens: int = 0  # positions the draft ran its forwards over (catching up and drafting)
    catch_up_tokens: int = 0  # of those, the context it caught up on (prefix reuse shrinks these)
    reused_tokens: int = 0  # context positions skipped: a full block's K/V already the draft's (prefix reuse)

    def since(self, before: DraftStats) -> DraftStats:
        return DraftStats(self.computed_tokens - before.computed_tokens,
                          self.catch_up_tokens - before.catch_up_tokens, self.reused_tokens - before.reused_tokens)


def resolve_draft(spec: SpeculativeConfig, config, target_hf_config, max_model_len: int) -> tuple[str, object]:
    """The draft model's folder and HF config, checked against the target (vocabulary, tokenizer, positions) before
    any of its weights is read."""
    from kvgate.engine.llm import resolve_model_path  # llm.py imports the engine, which imports this

    path = resolve_model_path(spec.model)
    hf = load_hf_config(path)
    draft_vocab, target_vocab = hf.vocab_size, target_hf_config.vocab_size
    if draft_vocab > target_vocab:
        raise ConfigError(f"--speculative-config: the draft model's vocab_size {draft_vocab} exceeds the target's "
                          f"{target_vocab}: the draft must use the target's tokenizer")
    _check_same_tokenizer(load_tokenizer(path), load_tokenizer(config.model, config.tokenizer))
    limit = getattr(hf, "max_position_embeddings", None)
    if limit is not None and limit < max_model_len:
        raise ConfigError(f"--speculative-config: the draft model's max_position_embeddings {limit} is below "
                          f"max_model_len {max_model_len}")
    return path, hf


class DraftModelProposer(Proposer):
    def __init__(self, spec: SpeculativeConfig, config, target_hf_config, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, kv_quant, read_weights: bool = True, attention_backend: str = "sdpa",
                 graphs: bool = False) -> None:
        """read_weights False: its parameters allocated, not read (loader.load_model; --print-config's profile).
        attention_backend: the target's; "triton" runs the draft through the same kernels (draft_graphs.py), with
        CUDA graphs of its decode forwards when graphs (the target's are captured too)."""
        path, hf = resolve_draft(spec, config, target_hf_config, max_model_len)
        self.k = spec.num_speculative_tokens
        self.device, self.dtype, self.kv_quant = device, dtype, kv_quant
        self.max_model_len, self.block_size = max_model_len, config.block_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.vocab_size, self.target_vocab_size = hf.vocab_size, target_hf_config.vocab_size
        self.model = load_model(hf, path, device, dtype, max_model_len, read_weights=read_weights)
        self.num_layers = hf.num_hidden_layers
        self.layer_windows = self.model.layer_windows  # each layer's sliding window (None: full attention)
        self.triton = None  # draft_graphs.DraftTritonPath on the Triton path
        if attention_backend == "triton":
            from kvgate.engine.draft_graphs import DraftTritonPath
            from kvgate.engine.models.layers import use_fused_kernels

            use_fused_kernels(self.model)
            self.triton = DraftTritonPath(self.model, config.max_num_seqs,
                                          max(config.max_num_batched_tokens, config.max_num_seqs),
                                          cdiv(max_model_len, self.block_size), self.block_size,
                                          device, capture=graphs)
        self.kv_caches: list = []
        self.num_blocks = 0
        # Per block id: the hash of the block content the draft's K/V there was computed for (None: unknown).
        self.block_hashes: list[bytes | None] = []
        self.reuse_prefix = True  # False: no prefix reuse (tests and bench --compare-no-draft-reuse compare)
        self.stats = DraftStats()
        self.sampler = Sampler()

    # -- KV cache ---------------------------------------------------------------------------------

    def bytes_per_block(self, block_size: int) -> int:
        return kv_bytes_per_block(self.model, self.num_layers, block_size, self.dtype, self.kv_quant)

    def allocate_kv_cache(self, num_blocks: int, capture_graphs: bool = False) -> None:
        self.kv_caches = allocate_kv_caches(self.model, self.num_layers, num_blocks, self.block_size, self.dtype,
                                            self.kv_quant, self.device)
        self.num_blocks = num_blocks
        self.block_hashes = [None] * num_blocks
        if capture_graphs and self.triton is not None:
            self.triton.capture(self.kv_caches)

    # -- proposing --------------------------------------------------------------------------------

    def reserve(self, request, limit: int) -> list[int]:
        """Phase one: the number of drafts only (placeholders). The scheduler sizes and allocates the request's
        chunk with it, and fill drafts them once the step's drafting requests are known."""
        return [0] * max(min(self.k, limit, self.max_model_len - request.num_tokens), 0)

    @torch.inference_mode()
    def fill(self, requests: list, drafts: list[list[int]], block_table: BlockTable) -> list[tuple[list, object]]:
        """Phase two: (drafts, q rows [len, target vocab] or None for a greedy request) for each request, as many
        drafts as its placeholders; a request's last token is its only one the target has not computed."""
        dev = self.device
        lengths = [len(d) for d in drafts]
        tables = []
        tracked, bs = self.block_hashes, self.block_size
        # Full blocks (id -> hash) that the step's first catch-up computes, and who may start only after it: those
        # whose reused run goes through such blocks (requests of a shared prefix that first draft together).
        pending: dict[int, bytes] = {}
        first, after = [], []
        for i, r in enumerate(requests):
            state = r.spec_state
            if state is None or state.preemptions != r.num_preemptions:
                state = r.spec_state = DraftState(r.num_preemptions)
            # Rejected drafts of the last step: the draft's K/V holds only what the target accepted.
            state.computed = min(state.computed, r.num_computed_tokens)
            state.marked = min(state.marked, state.computed // bs)
            row = block_table.row_of[r.request_id]
            table = block_table.ids[row, :cdiv(r.num_tokens + lengths[i], bs)].tolist()
            tables.append(table)
            waits = state.computed == 0 and self.reuse_prefix and self._reuse(r, table, pending)
            # Every position the draft writes this step is in these blocks: their old K/V is gone.
            for b in table[state.computed // bs:]:
                tracked[b] = None
            if waits:
                after.append(i)
            else:
                first.append(i)
                hashes = r.block_hashes
                for n in range(state.computed // bs, min(r.num_tokens // bs, len(hashes))):
                    pending[table[n]] = hashes[n]
        for r in requests:  # seeded requests draw their drafts from their own generator, as their tokens
            if r.generator is None and r.sampling_params.seed is not None:
                r.generator = torch.Generator(device=dev)
                r.generator.manual_seed(r.sampling_params.seed)
        sampling = None
        if not all(r.sampling_params.greedy for r in requests):
            sampling = SamplingBatch.build(requests, self.target_vocab_size, dev)
        last: list = [None] * len(requests)
        self._catch_up(requests, tables, first, last)
        self._catch_up(requests, tables, after, last)  # their reused run ends in blocks computed just now
        logits = self.model.compute_logits(torch.stack(last))
        proposed: list[list[int]] = [[] for _ in requests]
        qs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        for j in range(max(lengths)):
            tokens = self._choose(logits, [requests[i] for i in active], sampling, active, qs)
            for i, t in zip(active, tokens):
                proposed[i].append(t)
            active_next = [n for n, i in enumerate(active) if len(proposed[i]) < lengths[i]]
            if not active_next:
                break
            active = [active[n] for n in active_next]
            # The next draft: one token each, the last draft at the position after it.
            seqs, ids = [], []
            for i in active:
                r = requests[i]
                pos = r.num_tokens + len(proposed[i]) - 1
                seqs.append((pos, 1, tables[i]))
                ids.append(proposed[i][-1])
                r.spec_state.computed = pos + 1
            self.stats.computed_tokens += len(seqs)
            logits = self._forward(seqs, ids, [s[0] for s in seqs])
        for r, table in zip(requests, tables):
            self._mark(r, table)
        out = []
        for i, r in enumerate(requests):
            q = torch.stack(qs[i]) if qs[i] else None
            out.append((proposed[i], q))
        return out

    def _reuse(self, request, table: list[int], pending: dict[int, bytes]) -> bool:
        """A request's first drafting (a new DraftState): skip the longest run of its leading full blocks whose K/V
        the draft holds (the block's tracked hash is the request's hash of it) or computes in this step's first
        catch-up (pending), never its last token; True if the run needs pending blocks (it catches up after)."""
        hashes, tracked, bs = request.block_hashes, self.block_hashes, self.block_size
        limit = min((request.num_tokens - 1) // bs, len(hashes))
        n, waits = 0, False
        while n < limit:
            block, block_hash = table[n], hashes[n]
            if tracked[block] != block_hash:
                if pending.get(block) != block_hash:
                    break
                waits = True
            n += 1
        state = request.spec_state
        state.computed = state.reused = n * bs
        state.marked = n
        self.stats.reused_tokens += n * bs
        return waits

    def _mark(self, request, table: list[int]) -> None:
        """After the step's draft forwards: record the request's full blocks (of known tokens) that its draft has
        now computed in full as holding the draft's K/V for their hash."""
        state, hashes = request.spec_state, request.block_hashes
        end = min(min(state.computed, request.num_tokens) // self.block_size, len(hashes))
        for i in range(state.marked, end):
            self.block_hashes[table[i]] = hashes[i]
        state.marked = max(state.marked, end)

    def _catch_up(self, requests: list, tables: list, which: list[int], last: list) -> None:
        """The draft over the tokens it has not computed of requests[i] for i in which, in forwards of at most
        max_num_batched_tokens tokens; last[i]: the hidden row at the request's last token."""
        while which:
            seqs, ids, positions, owners = [], [], [], []
            budget = self.max_num_batched_tokens
            for i in which:
                r = requests[i]
                start = r.spec_state.computed
                n = min(r.num_tokens - start, budget)
                if n <= 0 or last[i] is not None:
                    continue
                seqs.append((start, n, tables[i]))
                ids += r.all_token_ids[start:start + n]
                positions += range(start, start + n)
                owners.append((i, start + n == r.num_tokens))
                r.spec_state.computed = start + n
                budget -= n
                if budget == 0:
                    break
            if not seqs:
                break
            self.stats.computed_tokens += len(ids)
            self.stats.catch_up_tokens += len(ids)
            hidden_rows = self._forward(seqs, ids, positions, all_rows=True)
            end = 0
            for (i, done), (_, n, _) in zip(owners, seqs):
                end += n
                if done:
                    last[i] = hidden_rows[end - 1]

    def _forward(self, seqs: list, ids: list[int], positions, all_rows: bool = False) -> torch.Tensor:
        """One forward of the draft over chunks (computed, new, block ids); the hidden rows (all_rows) or the
        logits of each chunk's last row."""
        dev = self.device
        if self.triton is not None:
            # positions: each chunk's, from seqs; rows that outlive the next forward (all_rows) are copied
            hidden = self.triton.forward(seqs, ids, self.kv_caches, keep=all_rows)
        else:
            meta = AttentionMetadata.for_windows(self.layer_windows, seqs, self.block_size, dev,
                                                 self.model.num_kv_heads, self.num_blocks)
            hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                                torch.tensor(list(positions), dtype=torch.long, device=dev), self.kv_caches, meta)
        if all_rows:
            return hidden
        return self.model.compute_logits(hidden)  # single-token chunks: a row each

    def _choose(self, logits: torch.Tensor, requests: list, sampling: SamplingBatch | None, active: list[int],
                qs: list) -> list[int]:
        """A draft per row: the argmax for greedy requests, else a draw from q (kept in qs for the verifier)."""
        if sampling is None:
            return self.sampler.greedy(logits).tolist()
        if self.vocab_size < self.target_vocab_size:  # q over the target's vocabulary: 0 past the draft's
            pad = logits.new_full((logits.shape[0], self.target_vocab_size - self.vocab_size), float("-inf"))
            logits = torch.cat([logits, pad], dim=-1)
        rows = torch.tensor(active, device=self.device)
        batch = _select_rows(sampling, rows, active)
        probs = self.sampler.probs(logits, batch)
        noise = self.sampler._exponential_noise(probs, batch.generators)
        sampled = probs.div(noise).argmax(dim=-1)
        greedy = logits.argmax(dim=-1)
        tokens = torch.where(batch.greedy, greedy, sampled).tolist()
        for n, (i, r) in enumerate(zip(active, requests)):
            if not r.sampling_params.greedy:
                qs[i].append(probs[n])
        return tokens


def _select_rows(batch: SamplingBatch, rows: torch.Tensor, index: list[int]) -> SamplingBatch:
    """The sampling tensors of some of the batch's rows (the requests still drafting)."""
    pick = lambda t: None if t is None else t.index_select(0, rows)  # noqa: E731
    return SamplingBatch(temperature=pick(batch.temperature), greedy=pick(batch.greedy), top_k=pick(batch.top_k),
                         top_p=pick(batch.top_p), min_p=pick(batch.min_p), banned=[],
                         generators=[batch.generators[i] for i in index], num_logprobs=[None] * len(index),
                         max_top_k=batch.max_top_k)


def _check_same_tokenizer(draft, target) -> None:
    """Every token of the draft's vocabulary has the same id in the target's (its ids mean the same text)."""
    target_vocab = target.get_vocab()
    for token, token_id in draft.get_vocab().items():
        if target_vocab.get(token) != token_id:
            raise ConfigError(f"--speculative-config: the draft model's tokenizer differs from the target's (token "
                              f"{token!r} is id {token_id} in the draft, {target_vocab.get(token)} in the target)")
