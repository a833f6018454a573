"""One endpoint's engine-hash map alone: decoded events in, index Deltas out, the shared block budget."""

from __future__ import annotations

from collections import Counter

from kvgate.epp.kv_events.decode import Cleared, Removed, Stored
from kvgate.epp.kv_events.engine_hashes import RECENTLY_REMOVED, BlockBudget, EngineHashes
from kvgate.epp.prefix.hashing import chain, root_hash

A = "10.0.0.1:8000"
BS = 4
TOKENS = list(range(12))
OURS = chain(TOKENS, BS, root_hash(None, None))  # 3 blocks


def deltas(table: EngineHashes, *events) -> list:
    out: list = []
    table.apply(list(events), A, 1, out)
    return out


def test_stored_blocks_are_keyed_by_our_hashes_and_removed_by_the_engines():
    table = EngineHashes()
    [d] = deltas(table, Stored([11, 12], None, TOKENS[:8], BS))
    assert list(d.added) == OURS[:2] and d.block_size == BS and not d.cleared
    [d] = deltas(table, Stored([13], 12, TOKENS[8:], BS))  # the chain continues from the parent's hash
    assert list(d.added) == OURS[2:]
    [d] = deltas(table, Removed([12, 99]))  # 99: never stored, ignored
    assert list(d.removed) == [OURS[1]] and table.stats["blocks_removed"] == 1
    assert table.budget.used == 2 and table.stats["blocks_stored"] == 3


def test_stored_then_removed_in_one_batch_nets_out():
    table = EngineHashes()
    [d] = deltas(table, Stored([11], None, TOKENS[:4], BS), Removed([11]))
    assert not d.added and not d.removed
    [d] = deltas(table, Stored([11], None, TOKENS[:4], BS))
    [d] = deltas(table, Removed([11]), Stored([21], None, TOKENS[:4], BS))  # gone and back: no change
    assert not d.added and not d.removed


def test_an_epp_hash_leaves_with_the_last_engine_block_holding_it():
    table = EngineHashes()
    deltas(table, Stored([11], None, TOKENS[:4], BS), Stored([21], None, TOKENS[:4], BS))
    [d] = deltas(table, Removed([11]))
    assert not d.removed and table.count == {OURS[0]: 1}
    [d] = deltas(table, Removed([21]))
    assert list(d.removed) == [OURS[0]]


def test_a_child_of_a_recently_removed_parent_is_still_keyed_and_an_unknown_parent_is_an_orphan():
    table = EngineHashes()
    deltas(table, Stored([11], None, TOKENS[:4], BS), Removed([11]))
    [d] = deltas(table, Stored([12], 11, TOKENS[4:8], BS))
    assert list(d.added) == [OURS[1]]
    [d] = deltas(table, Stored([50, 51], 49, TOKENS[:8], BS))
    assert not d.added and table.stats["orphan_blocks"] == 2
    deltas(table, Removed([12]), *(Stored([1000 + i], None, [i] * BS, BS) for i in range(RECENTLY_REMOVED)),
           Removed([1000 + i for i in range(RECENTLY_REMOVED)]))
    assert table.parent(12) is None  # pushed out of the recently removed ones


def test_all_blocks_cleared_starts_a_cleared_delta():
    table = EngineHashes()
    first, second = deltas(table, Stored([11], None, TOKENS[:4], BS), Cleared(), Stored([21], None, TOKENS[:4], BS))
    assert list(first.added) == OURS[:1] and not first.cleared
    assert second.cleared and list(second.added) == OURS[:1]
    assert table.ours == {21: OURS[0]} and table.budget.used == 1


def test_the_budget_is_shared_and_given_back_on_clear():
    budget, stats = BlockBudget(3), Counter()
    a, b = EngineHashes(budget, stats), EngineHashes(budget, stats)
    deltas(a, Stored([11, 12], None, TOKENS[:8], BS))
    [d] = deltas(b, Stored([11, 12], None, TOKENS[:8], BS))
    assert list(d.added) == OURS[:1] and stats["blocks_over_budget"] == 1 and budget.full()
    a.clear()
    assert budget.used == 1 and not budget.full()
    [d] = deltas(b, Stored([12], 11, TOKENS[4:8], BS))
    assert list(d.added) == OURS[1:2] and stats["blocks_stored"] == 4
