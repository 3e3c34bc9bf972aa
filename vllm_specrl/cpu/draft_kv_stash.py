"""The drafter's KV-sync work of k = 0 steps, held back until drafts are asked for again.

An EAGLE-style drafter attends to its own KV cache, one entry per position, so vLLM
runs its first pass on every step, also when the step drafts nothing (adaptive k or
the batch-size table at k = 0), to keep that cache complete: a pass for drafts that
may never be asked for. Requests that finish before k
returns never needed it. This stash keeps what that pass would have read (the
drafter's input token, position, the target's hidden state and the KV slot, one row
per request per decode step) and hands back, when drafting resumes, the rows of the
requests still in the batch, contiguous and in position order, so one batched pass
writes exactly the entries the skipped passes would have written.

Only one-token decode rows are held (a prompt's draft KV may be shared through the
prefix cache with a request that outlives the one that wrote it, so prefills are
never deferred); memory is bounded by ``max_rows`` (when full, the caller first forgets
the rows of requests that left the batch, then replays), which may be more than one drafter
pass carries: ``ReplayPlan.passes`` cuts a replay into passes. Pure torch and Python: the
vLLM side is ``cpu.deferred_draft_kv``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class _RequestRows:
    """Where one request's held rows are: (step, row) pairs, positions first..first+len-1."""

    first_position: int
    rows: list[tuple[int, int]] = field(default_factory=list)

    @property
    def end_position(self) -> int:
        return self.first_position + len(self.rows)


@dataclass
class ReplayPlan:
    """One batched pass over held rows: per batch row that has any, its rows in position order."""

    batch_rows: list[int]        # indices into the current batch (its block-table rows)
    query_lens: list[int]
    seq_lens: list[int]          # = the first position of the current step's row: the KV length after the pass
    token_ids: torch.Tensor      # the drafter's input at each row (the token after the row's position)
    positions: torch.Tensor
    hidden_states: torch.Tensor  # the target's states the drafter reads at each row
    slots: torch.Tensor          # KV-cache slot of each row

    @property
    def num_rows(self) -> int:
        return int(self.token_ids.shape[0])

    def passes(self, max_rows: int) -> list["ReplayPlan"]:
        """This plan as passes of at most ``max_rows`` rows each, to run in order (what one drafter
        pass can carry). A request whose rows do not fit the current pass is cut at a position: its
        first part's KV is written by that pass, and the next pass's attention reads it (a pass
        ends at KV length ``seq_len``, as a chunked prefill does)."""
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if self.num_rows <= max_rows:
            return [self]
        passes, pieces, room, offset = [], [], max_rows, 0
        for batch_row, rows, seq_len in zip(self.batch_rows, self.query_lens, self.seq_lens):
            first = seq_len - rows
            done = 0
            while done < rows:
                take = min(rows - done, room)
                pieces.append((batch_row, offset + done, take, first + done + take))
                done, room = done + take, room - take
                if room == 0:
                    passes.append(self._subplan(pieces))
                    pieces, room = [], max_rows
            offset += rows
        if pieces:
            passes.append(self._subplan(pieces))
        return passes

    def _subplan(self, pieces: list[tuple[int, int, int, int]]) -> "ReplayPlan":
        """Pieces (batch row, first row in this plan, rows, KV length after them) as one pass."""
        index = torch.cat([torch.arange(start, start + rows) for _, start, rows, _ in pieces])
        rows = (t.index_select(0, index.to(t.device))
                for t in (self.token_ids, self.positions, self.hidden_states, self.slots))
        return ReplayPlan([p[0] for p in pieces], [p[2] for p in pieces], [p[3] for p in pieces], *rows)


@dataclass
class StashCounters:
    steps_deferred: int = 0
    rows_deferred: int = 0
    rows_replayed: int = 0
    rows_dropped: int = 0        # held for requests that finished, were preempted or skipped a step
    replays: int = 0
    replay_passes: int = 0       # drafter passes the replays took (more than one where a replay's rows do not fit one)
    prompt_passes: int = 0       # k = 0 steps whose prompt chunks were passed alone, their decodes held
    forgets: int = 0             # times a full stash made room by dropping requests that left the batch
    held_early: int = 0          # steps held before vLLM gathered the drafter's inputs (of steps_deferred)

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class DraftKVStash:
    """Decode rows whose draft-KV write was deferred, by request."""

    def __init__(self, max_rows: int):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        self.counters = StashCounters()
        self._clear()

    def _clear(self) -> None:
        self._steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._requests: dict[str, _RequestRows] = {}
        self.rows = 0

    def clear(self) -> int:
        """Forget every held row (the drafter was repaired: the engine core recomputes the batch's KV);
        the rows dropped."""
        dropped = self.rows
        self.counters.rows_dropped += dropped
        self._clear()
        return dropped

    def fits(self, num_rows: int) -> bool:
        return self.rows + num_rows <= self.max_rows

    def add_step(self, req_ids: list[str], positions: list[int], token_ids: torch.Tensor,
                 position_tensor: torch.Tensor, hidden_states: torch.Tensor, slots: torch.Tensor,
                 hidden_states_owned: bool = False) -> None:
        """Hold one decode step: row i is request ``req_ids[i]`` at ``positions[i]``. The tensors are
        copied (they are the runner's buffers), but ``hidden_states`` where the caller made it for
        the stash (``hidden_states_owned``: exactly these rows, nothing else holds it)."""
        n = len(req_ids)
        if not self.fits(n):
            raise ValueError(f"{n} rows do not fit ({self.rows} of {self.max_rows} held): flush first")
        step = len(self._steps)
        hidden = hidden_states if hidden_states_owned and hidden_states.shape[0] == n else hidden_states[:n].clone()
        self._steps.append((token_ids[:n].clone(), position_tensor[:n].clone(), hidden, slots[:n].clone()))
        for row, (rid, pos) in enumerate(zip(req_ids, positions)):
            held = self._requests.get(rid)
            if held is None or held.end_position != pos:
                # New, or not contiguous (it skipped a step or restarted): its older rows
                # cannot be replayed as one run of positions, so they are dropped.
                if held is not None:
                    self.counters.rows_dropped += len(held.rows)
                held = self._requests[rid] = _RequestRows(pos)
            held.rows.append((step, row))
        self.rows += n
        self.counters.steps_deferred += 1
        self.counters.rows_deferred += n

    def _step_offsets(self) -> list[int]:
        """Where each held step's rows start in the concatenation of all of them."""
        offsets, total = [], 0
        for ids, *_ in self._steps:
            offsets.append(total)
            total += int(ids.shape[0])
        return offsets

    def _gathered(self, index: list[int]) -> tuple[torch.Tensor, ...]:
        """Rows ``index`` of the held steps' concatenated (token ids, positions, hidden states, slots)."""
        gather = torch.tensor(index, dtype=torch.long)
        return tuple(torch.cat([st[j] for st in self._steps]).index_select(0, gather.to(self._steps[0][j].device))
                     for j in range(4))

    def forget_absent(self, req_ids: list[str]) -> int:
        """Drop the rows of requests not in ``req_ids`` (the current batch: they finished or were
        preempted, and their draft KV is never read) and pack the rest; returns the rows freed.
        Called when the stash is full, before replaying: with k held at 0 through a long bulk,
        most held rows belong to requests that ended without drafting again, and replaying
        them to make room was draft-KV upkeep the deferral exists to skip."""
        present = set(req_ids)
        gone = [rid for rid in self._requests if rid not in present]
        owned = sum(len(h.rows) for h in self._requests.values())
        if not gone and owned == self.rows:
            return 0
        for rid in gone:
            self.counters.rows_dropped += len(self._requests.pop(rid).rows)
        offsets = self._step_offsets()
        index = [offsets[step] + row for held in self._requests.values() for step, row in held.rows]
        freed = self.rows - len(index)
        self.counters.forgets += 1
        self._steps = [self._gathered(index)] if index else []
        self.rows, at = len(index), 0
        for held in self._requests.values():
            held.rows = [(0, at + i) for i in range(len(held.rows))]
            at += len(held.rows)
        return freed

    def take(self, req_ids: list[str], start_positions: list[int]) -> ReplayPlan | None:
        """The held rows of the batch's requests (request i's current step starts at
        ``start_positions[i]``), and forget everything held: rows of requests not in the
        batch, or whose held rows do not end right before their current step, are dropped."""
        if not self._steps:
            return None
        offsets = self._step_offsets()
        index: list[int] = []
        batch_rows, query_lens, seq_lens = [], [], []
        kept = 0
        for i, (rid, start) in enumerate(zip(req_ids, start_positions)):
            held = self._requests.get(rid)
            if held is None or held.end_position != start:
                continue
            batch_rows.append(i)
            query_lens.append(len(held.rows))
            seq_lens.append(start)
            index.extend(offsets[step] + row for step, row in held.rows)
            kept += len(held.rows)
        held_rows = sum(len(h.rows) for h in self._requests.values())
        self.counters.rows_dropped += held_rows - kept
        gathered = self._gathered(index) if index else None
        self._clear()
        if gathered is None:
            return None
        self.counters.rows_replayed += kept
        self.counters.replays += 1
        return ReplayPlan(batch_rows, query_lens, seq_lens, *gathered)
