"""The KV-event sequencer alone: sequence numbers in, actions out, no ZeroMQ (the socket-level behaviour is in
test_precise_index.py and test_kv_events_hostile.py)."""

from __future__ import annotations

from kvgate.epp.kv_events.sequencer import (GAP_LOST, MAX_HELD, OPEN_END, RECONNECTED, REPLAY_FAILED, RESTARTED,
                                            Apply, AskReplay, Hold, ReplayFilled, Reset, Sequencer)

P = b"batch"


def applies(*seqs: int) -> list[Apply]:
    return [Apply(s, P) for s in seqs]


def at(last: int, replayable: bool = True, max_held_bytes: int = 1 << 20) -> Sequencer:
    """A sequencer that has applied batches 0..last."""
    s = Sequencer(replayable, max_held_bytes)
    for seq in range(last + 1):
        assert s.live(seq, P) == applies(seq)
    return s


def test_batches_in_order_apply_and_the_first_may_start_anywhere_without_a_replay_socket():
    s = Sequencer(replayable=False, max_held_bytes=100)
    assert s.connected() == []
    assert s.live(7, P) == applies(7)
    assert s.live(8, P) == applies(8) and s.last_seq == 8


def test_connecting_asks_for_the_whole_history_once():
    s = Sequencer(replayable=True, max_held_bytes=100)
    assert s.connected() == [AskReplay(0, OPEN_END)] and not AskReplay(0, OPEN_END).for_gap
    assert s.connected() == []  # a replay is under way already
    assert at(0).connected() == []  # the engine's numbering is known


def test_a_gap_is_replayed_while_live_batches_are_held():
    s = at(2)
    ask = s.live(5, P)
    assert ask == [AskReplay(3, 5), Hold(5)] and ask[0].for_gap and s.replaying
    assert s.live(6, P) == [Hold(6)]
    for seq in (3, 4):
        s.replayed(seq, P)
    assert s.replay_ended() == [ReplayFilled(), *applies(3, 4, 5, 6)]
    assert not s.replaying and s.last_seq == 6


def test_batches_both_replayed_and_held_apply_once():
    s = at(2)
    s.live(4, P)
    for seq in (3, 4, 3):  # the replay goes on past the gap, and gives 3 twice
        s.replayed(seq, P)
    assert s.replay_ended() == [ReplayFilled(), *applies(3, 4)]
    s = Sequencer(replayable=True, max_held_bytes=100)
    s.connected()
    assert s.live(2, P) == [Hold(2)]  # published while the history was answered
    for seq in (0, 1, 2):
        s.replayed(seq, P)
    assert s.replay_ended() == [ReplayFilled(), *applies(0, 1, 2)]
    assert s.live(3, P) == applies(3)


def test_a_gap_without_a_replay_socket_drops_the_blocks_and_goes_on():
    s = at(2, replayable=False)
    assert s.live(5, P) == [Reset(GAP_LOST), *applies(5)]
    assert s.live(6, P) == applies(6)


def test_a_replay_missing_batches_drops_the_blocks_and_takes_the_held_run_as_it_is():
    s = at(2)
    s.live(5, P)
    s.live(6, P)
    s.replayed(4, P)  # 3 fell out of the engine's buffer
    actions = s.replay_ended()
    assert actions[0] == Reset(REPLAY_FAILED, why="the replay buffer no longer holds the missing batches, or they "
                               "were over the bound on bytes held")
    assert actions[1:] == applies(5, 6) and s.last_seq == 6


def test_an_unanswered_replay_gives_up_and_its_late_answer_is_ignored():
    s = at(2)
    s.live(5, P)
    assert s.replay_timed_out() == [Reset(REPLAY_FAILED, why="no answer"), *applies(5)]
    s.replayed(3, P)
    s.replayed(4, P)
    assert s.replay_ended() == [] and s.last_seq == 5
    assert s.live(6, P) == applies(6)


def test_numbering_going_back_or_repeating_is_a_restarted_engine():
    s = at(7, replayable=False)
    assert s.live(0, P) == [Reset(RESTARTED, seq=0, last=7), *applies(0)]
    assert s.live(0, P) == [Reset(RESTARTED, seq=0, last=0), *applies(0)]  # a duplicate too
    r = at(7)
    assert r.live(3, P) == [Reset(RESTARTED, seq=3, last=7), AskReplay(0, 3), Hold(3)]  # its history first


def test_live_batches_held_are_bounded_by_count():
    s = at(0)
    s.live(2, P)
    for seq in range(3, MAX_HELD + 2):
        assert s.live(seq, P) == [Hold(seq)]
    actions = s.live(MAX_HELD + 2, P)  # one over: the replay gives up, the held run applies as it is
    assert actions == [Reset(REPLAY_FAILED, why="too many batches held"), *applies(*range(2, MAX_HELD + 3))]
    assert not s.replaying


def test_live_batches_held_are_bounded_by_bytes():
    s = at(0, max_held_bytes=10)
    four = b"1234"
    assert s.live(2, four) == [AskReplay(1, 2), Hold(2)]
    assert s.live(3, four) == [Hold(3)]
    assert s.live(4, four) == [Reset(REPLAY_FAILED, why="too many batches held"), Apply(2, four), Apply(3, four),
                               Apply(4, four)]


def test_replayed_batches_are_bounded_by_bytes_and_a_hole_fails_the_replay():
    s = at(0, max_held_bytes=10)
    s.live(4, b"x")
    for seq in (1, 2, 3):
        s.replayed(seq, b"12345")  # the third is over 10 bytes: not kept, a hole
    assert s.replay_ended() == [Reset(REPLAY_FAILED, why="the replay buffer no longer holds the missing batches, "
                                      "or they were over the bound on bytes held"), Apply(4, b"x")]


def test_a_first_replay_takes_what_the_buffer_still_holds_up_to_its_first_hole():
    s = Sequencer(replayable=True, max_held_bytes=100)
    s.connected()
    for seq in (5, 6, 8):  # 0-4 fell out of the buffer; 7 is missing
        s.replayed(seq, P)
    assert s.replay_ended() == applies(5, 6)  # not a filled replay: nothing counted as ok
    assert s.live(9, P) == [AskReplay(7, 9), Hold(9)]  # the rest is a gap again


def test_a_first_replay_of_an_empty_buffer_waits_for_the_next_batch():
    s = Sequencer(replayable=True, max_held_bytes=100)
    s.connected()
    assert s.replay_ended() == [ReplayFilled()] and s.last_seq is None
    assert s.live(0, P) == applies(0)


def test_a_reconnection_drops_the_blocks_and_reads_the_history_again():
    s = at(3)
    s.live(6, P)
    assert s.reconnected() == [Reset(RECONNECTED)] and not s.replaying and s.last_seq is None
    assert s.connected() == [AskReplay(0, OPEN_END)]


def test_a_malformed_batch_keeps_the_numbering():
    """Whether a payload decodes is the subscriber's business: the batch counts as applied, so the next one is
    no gap (a replay would give the same bytes again)."""
    s = at(0)
    assert s.live(1, b"\xc1 not msgpack") == [Apply(1, b"\xc1 not msgpack")]
    assert s.live(2, P) == applies(2)


def test_quarantine_forgets_the_replay_and_resumes_after_the_batch_that_failed():
    s = at(2)
    s.live(5, P)
    s.live(6, P)
    s.replayed(3, P)
    s.replayed(4, P)
    assert s.replay_ended() == [ReplayFilled(), *applies(3, 4, 5, 6)]
    s.quarantine(failed_seq=3)  # applying 3 raised: 4-6 were never applied
    assert s.last_seq == 3 and not s.replaying
    assert s.live(7, P) == [AskReplay(4, 7), Hold(7)]  # so they are asked for again


def test_quarantine_outside_an_apply_keeps_the_numbering():
    s = at(2)
    s.live(5, P)
    s.quarantine(failed_seq=None)
    assert not s.replaying and s.last_seq == 2
    assert s.live(3, P) == applies(3)
