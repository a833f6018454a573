"""The order of one endpoint's event batches: which to apply, when to ask for a replay, when the blocks must go.

Pure: batches in (their 8-byte sequence numbers, their payloads unread), actions out, no sockets, threads or
clocks (the subscriber times the replay out and tells `replay_timed_out`). One `Sequencer` per endpoint stream.

vLLM numbers an engine's batches from 0:
  - the next number applies (`Apply`);
  - a number further on is a gap: when the engine has a replay socket, `AskReplay(start, upto)` asks for the
    missing [start, upto) and live batches are held (`Hold`, at most `MAX_HELD` of them and `max_held_bytes`)
    until the replay ends; if it covers the gap, the batches apply in order and the index stays exact; if not
    (no replay socket, the batches fell out of its buffer, no answer, past a bound) the endpoint's blocks go
    (`Reset`) and are rebuilt from the held run and the batches that follow;
  - a number at or below the last one applied means the engine restarted (numbering from 0 again): `Reset`;
  - on connecting, and on the first batch seen when it is not 0, the whole history is asked for (`OPEN_END`):
    an EPP that starts after its engines learns what they hold at once, idle engines included; a buffer that no
    longer reaches back to 0 gives what it still holds.
The subscriber counts what it does from the actions (stats "gaps", "replays_ok", "replays_failed", "restarts"):
counted when done, so a batch never acted on (its stream quarantined first) is never counted.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_HELD = 1000  # live (or replayed) batches held per endpoint while a replay is under way
OPEN_END = 1 << 63  # a replay asked for on connecting: no live batch bounds it

# Why a Reset drops the endpoint's blocks
RESTARTED = "restarted"  # the numbering went back: a new engine behind the address
GAP_LOST = "gap_lost"  # a gap and no replay socket to fill it
REPLAY_FAILED = "replay_failed"  # a replay that could not fill the gap
RECONNECTED = "reconnected"  # after a disconnection a restarted engine may have published past the old number


@dataclass(frozen=True)
class Apply:
    """Decode batch `seq` and apply it to the endpoint's blocks."""

    seq: int
    payload: bytes


@dataclass(frozen=True)
class Hold:
    """Batch `seq` waits for the replay under way (applied, or dropped with the blocks, when it ends)."""

    seq: int


@dataclass(frozen=True)
class AskReplay:
    """Ask the replay socket for the batches from `start` on; the gap ends before `upto` (OPEN_END: on
    connecting, everything the buffer holds is wanted)."""

    start: int
    upto: int

    @property
    def for_gap(self) -> bool:
        return self.upto != OPEN_END


@dataclass(frozen=True)
class ReplayFilled:
    """The replay's answer covers the gap: the batches that follow (Apply) keep the index exact."""


@dataclass(frozen=True)
class Reset:
    """Drop the endpoint's blocks: which the engine holds is unknown until later batches rebuild them."""

    cause: str  # RESTARTED, GAP_LOST, REPLAY_FAILED or RECONNECTED
    seq: int | None = None  # RESTARTED: the batch whose number went back ...
    last: int | None = None  # ... to or below this one, the last applied
    why: str = ""  # REPLAY_FAILED: why the replay could not fill the gap


Action = Apply | Hold | AskReplay | ReplayFilled | Reset


class Sequencer:
    """One endpoint stream's sequence numbers and the replay under way; each method returns the actions to take,
    in order."""

    def __init__(self, replayable: bool, max_held_bytes: int) -> None:
        self.replayable = replayable  # the endpoint has a replay socket
        self.max_held_bytes = max_held_bytes
        self.last_seq: int | None = None  # the last batch handed out to apply
        self.replay_until: int | None = None  # while a replay is under way: the `upto` it was asked with
        self._replayed: dict[int, bytes] = {}
        self._replayed_bytes = 0
        self._held: list[tuple[int, bytes]] = []
        self._held_bytes = 0

    @property
    def replaying(self) -> bool:
        return self.replay_until is not None

    # -- what the subscriber reports -------------------------------------------------------------------------

    def live(self, seq: int, payload: bytes) -> list[Action]:
        """A batch off the SUB socket."""
        out: list[Action] = []
        self._live(seq, payload, out)
        return out

    def replayed(self, seq: int, payload: bytes) -> None:
        """One batch of the replay's answer, kept until it ends; a late answer (no replay under way) is ignored.
        Bounded: past either bound the rest is missing, and `replay_ended` sees a hole."""
        if self.replay_until is None:
            return
        if len(self._replayed) < MAX_HELD and self._replayed_bytes + len(payload) <= self.max_held_bytes \
                and seq not in self._replayed:
            self._replayed[seq] = payload
            self._replayed_bytes += len(payload)

    def replay_ended(self) -> list[Action]:
        """The replay's end marker: apply what it filled, then the held live batches."""
        out: list[Action] = []
        if self.replay_until is None:
            return out  # the end of a replay already given up on
        first_time = self.last_seq is None
        replayed, held, upto = self._replayed, self._held, self.replay_until
        if upto == OPEN_END:  # asked on connecting: whatever the buffer holds
            upto = max(replayed, default=-1) + 1
        start = 0 if first_time else self.last_seq + 1
        if first_time and start not in replayed:  # history older than the buffer: learn what is left
            start = min(replayed, default=upto)
        needed = range(start, upto)
        if all(s in replayed for s in needed):
            out.append(ReplayFilled())
        elif first_time:  # a hole in what came back: apply the run from the oldest, the rest is a gap again
            end = start
            while end in replayed and end < upto:
                end += 1
            needed = range(start, end)
        else:
            self._give_up(out, "the replay buffer no longer holds the missing batches, or they were over the bound "
                          "on bytes held")
            return out
        self._forget_replay()
        for s in needed:
            self._apply(s, replayed[s], out)
        for s, payload in held:
            if self.last_seq is not None and s <= self.last_seq and s in replayed:
                continue  # published while the replay was answered: already applied from it
            self._live(s, payload, out)
        return out

    def replay_timed_out(self) -> list[Action]:
        """The replay under way went unanswered for too long."""
        out: list[Action] = []
        self._give_up(out, "no answer")
        return out

    def connected(self) -> list[Action]:
        """The SUB socket connected: learn what the engine holds now, not at its next batch (an idle engine may
        send none)."""
        if self.last_seq is None and self.replayable and self.replay_until is None:
            return [self._ask(0, OPEN_END, [])]
        return []

    def reconnected(self) -> list[Action]:
        """Connected again after a disconnection: the engine behind the address may have restarted and published
        past the old number, so the blocks go and the history is read again as on a first connection."""
        self._forget_replay()
        self.last_seq = None
        return [Reset(RECONNECTED)]

    def quarantine(self, failed_seq: int | None) -> None:
        """Acting on this stream's actions raised: the replay under way is forgotten (the subscriber drops the
        blocks); the numbering resumes after `failed_seq`, the batch whose Apply failed, when there was one."""
        self._forget_replay()
        if failed_seq is not None:
            self.last_seq = failed_seq

    # -- the rules -------------------------------------------------------------------------------------------

    def _live(self, seq: int, payload: bytes, out: list[Action]) -> None:
        if self.replay_until is not None:  # a replay is under way: hold live batches (bounded)
            if len(self._held) < MAX_HELD and self._held_bytes + len(payload) <= self.max_held_bytes:
                self._held.append((seq, payload))
                self._held_bytes += len(payload)
                out.append(Hold(seq))
            else:
                self._give_up(out, "too many batches held")
                self._live(seq, payload, out)
            return
        last = self.last_seq
        if last is not None and seq <= last:  # numbering went back: a new engine behind the address
            out.append(Reset(RESTARTED, seq=seq, last=last))
            self.last_seq = last = None
        expected = 0 if last is None else last + 1
        if seq > expected and self.replayable:
            out.append(self._ask(expected, seq, [(seq, payload)]))
            out.append(Hold(seq))
            return
        if seq > expected and last is not None:  # a gap nobody can fill
            out.append(Reset(GAP_LOST))
            self.last_seq = None
        self._apply(seq, payload, out)

    def _apply(self, seq: int, payload: bytes, out: list[Action]) -> None:
        # the numbering goes on from this batch even when it turns out malformed (a replay gives the same bytes)
        self.last_seq = seq
        out.append(Apply(seq, payload))

    def _ask(self, start: int, upto: int, held: list[tuple[int, bytes]]) -> AskReplay:
        self.replay_until = upto
        self._replayed, self._replayed_bytes = {}, 0
        self._held, self._held_bytes = held, sum(len(payload) for _, payload in held)
        return AskReplay(start, upto)

    def _give_up(self, out: list[Action], why: str) -> None:
        """The replay cannot fill the gap: the blocks go, and the held run is taken as it is, from its first
        batch."""
        held = self._held
        self._forget_replay()
        out.append(Reset(REPLAY_FAILED, why=why))
        self.last_seq = None
        for i, (s, payload) in enumerate(held):
            if i == 0:
                self.last_seq = s - 1
            self._live(s, payload, out)

    def _forget_replay(self) -> None:
        self.replay_until, self._replayed, self._held = None, {}, []
        self._held_bytes = self._replayed_bytes = 0
