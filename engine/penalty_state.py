"""Per-request token counts for the repetition, presence and frequency penalties, kept on the logits' device."""

from __future__ import annotations

import torch

from kvgate.engine.request import Request


class PenaltyState:
    """One row per penalized request in two device tensors: prompt_seen [rows, V] (the token occurs in the prompt)
    and output_counts [rows, V] (how often it was generated).

    A row is filled from the request's host lists once, at its first sampled step; after that each step adds the
    tokens it sampled on the device (record), so no step reads earlier output from the host and the next step can
    be queued before this one's tokens come back (async scheduling). A row stays with its request through
    preemption and is reused once the request has finished; the tensors grow by doubling."""

    def __init__(self, vocab_size: int, device: torch.device, initial_rows: int = 8) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.prompt_seen = torch.zeros(initial_rows, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(initial_rows, vocab_size, dtype=torch.float32, device=device)
        self._rows: dict[str, tuple[int, Request]] = {}  # request id -> (row, the request holding it)
        self._free = list(range(initial_rows - 1, -1, -1))

    @property
    def num_rows_in_use(self) -> int:
        return len(self._rows)

    def rows(self, requests: list[Request]) -> list[int]:
        """Each request's row, filled from its prompt and output ids the first time it is asked for."""
        self._release_finished()
        rows = []
        for r in requests:
            entry = self._rows.get(r.request_id)
            if entry is None or entry[1] is not r:
                row = self._allocate()
                self._fill(row, r)
                self._rows[r.request_id] = entry = (row, r)
            rows.append(entry[0])
        return rows

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count the tokens just sampled (rows and tokens on the device, one token a row)."""
        self.output_counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)

    def _release_finished(self) -> None:
        for request_id, (row, request) in list(self._rows.items()):
            if request.is_finished:
                del self._rows[request_id]
                self._free.append(row)

    def _allocate(self) -> int:
        if not self._free:
            n = self.prompt_seen.shape[0]
            self.prompt_seen = torch.cat([self.prompt_seen, torch.zeros_like(self.prompt_seen)])
            self.output_counts = torch.cat([self.output_counts, torch.zeros_like(self.output_counts)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()

    def _fill(self, row: int, request: Request) -> None:
        self.prompt_seen[row].zero_()
        self.output_counts[row].zero_()
        if request.prompt_token_ids:
            self.prompt_seen[row, _to_device(request.prompt_token_ids, self.device)] = True
        if request.output_token_ids:  # a request that sampled before it had a row (e.g. a one-off batch's state)
            ids = _to_device(request.output_token_ids, self.device)
            self.output_counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """From pinned memory without waiting on CUDA (a pageable copy waits for the device's queue)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.long, device=device)
    return torch.tensor(values, dtype=torch.long).pin_memory().to(device, non_blocking=True)
