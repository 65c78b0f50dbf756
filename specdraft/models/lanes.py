"""The decode loop's rows in lanes: several ``SequenceRows`` of one model behind one ``SequenceRows``.

Most rows share one lane, scored in one batched forward. A row that must compute exactly what it
computes alone (a seeded sampling request: docs/server.md) gets a lane of its own: its prefill and
every forward are a batch of one, shaped as when it decodes alone. In a shared forward a row's
floating-point summation order depends on what else runs: a matmul kernel depends on how many rows
it multiplies (float32, AMD EPYC Zen 4: a 1-row and a 4-row GEMM round differently, and SmolLM2's
logits then differ by about 1e-4), and attention sums over the cache's layout (transformers: the
padding and holes other rows cause; llama.cpp: cells a departed row freed, taken by this row's next
tokens out of order, up to 0.8 logits on SmolLM2 Q4_1). An inverse-CDF sample flips whenever its
uniform falls between the two cumulative sums, and the texts part from there.

Every row of the loop is a row of one lane. Within a lane rows keep the loop's order (new rows are
appended last everywhere), so a lane's rows are a subsequence of the loop's, and a row's index in its
lane is the count of its lane's rows before it.
"""

from __future__ import annotations

from typing import Callable

import torch

from .base import SequenceRows


class RowLanes:
    """B rows over one model: a shared lane (made when its first row joins) and one lane per own row."""

    def __init__(self, new_rows: Callable[[], SequenceRows]):
        self._new_rows = new_rows
        self.shared: SequenceRows | None = None
        self.lane_of: list[SequenceRows] = []  # per row, in the loop's order: the lane holding it
        self.last_hidden: torch.Tensor | None = None
        self.prefill_hidden: list = []

    @property
    def B(self) -> int:
        return len(self.lane_of)

    @property
    def L(self) -> int:
        """The longest lane's cache slots per row."""
        return max((lane.L for lane, _ in self.lanes()), default=0)

    @property
    def lens(self) -> list[int]:
        return [lane.lens[i] for lane, i in self._where()]

    def _where(self) -> list[tuple[SequenceRows, int]]:
        """Per row: (its lane, its index there)."""
        seen: dict[int, int] = {}
        out = []
        for lane in self.lane_of:
            out.append((lane, seen.get(id(lane), 0)))
            seen[id(lane)] = out[-1][1] + 1
        return out

    def lanes(self) -> list[tuple[SequenceRows, list[int]]]:
        """Every lane holding rows, with its rows' indices in the loop (ascending), by first row."""
        out: dict[int, tuple[SequenceRows, list[int]]] = {}
        for r, lane in enumerate(self.lane_of):
            out.setdefault(id(lane), (lane, []))[1].append(r)
        return list(out.values())

    def locate(self, idx: list[int]) -> tuple[SequenceRows, list[int]]:
        """(the lane, their indices there) of rows that share one lane (a draft group's rows)."""
        at = self._where()
        where = [at[r] for r in idx]
        if len({id(lane) for lane, _ in where}) > 1:
            raise ValueError("rows of different lanes")
        return where[0][0], [i for _, i in where]

    def rooms(self) -> list[tuple[tuple[int, int] | None, list[int]]]:
        """Per lane: (its ``draft_room()``, its rows' indices in the loop)."""
        return [(lane.draft_room(), rows) for lane, rows in self.lanes()]

    def draft_room(self) -> tuple[int, int] | None:
        """The shared lane's room (an own lane's is in ``rooms``)."""
        return None if self.shared is None else self.shared.draft_room()

    def add_rows(
        self, prefixes: list[list[int]], hidden: bool = False, own: list[bool] | None = None, start: list | None = None
    ) -> list[int]:
        """Prefill ``prefixes`` as new last rows; ``own[i]``: prefix i gets a lane of its own; ``start``: as
        ``SequenceRows.add_rows`` (None: none). Nothing joins when a prefill fails (the own lanes are
        prefilled first, the shared one last)."""
        own = own or [False] * len(prefixes)
        start = start or [None] * len(prefixes)
        lanes: list = [self._new_rows() if o else None for o in own]
        hid: list = [None] * len(prefixes)
        for i, lane in enumerate(lanes):
            if lane is not None:
                lane.add_rows([prefixes[i]], hidden, **_started([start[i]]))
                hid[i], lane.prefill_hidden = lane.prefill_hidden[0], []
        shared = [i for i, o in enumerate(own) if not o]
        if shared:
            if self.shared is None:
                self.shared = self._new_rows()
            self.shared.add_rows([prefixes[i] for i in shared], hidden, **_started([start[i] for i in shared]))
            for i, h in zip(shared, self.shared.prefill_hidden):
                hid[i], lanes[i] = h, self.shared
            self.shared.prefill_hidden = []
        first = self.B
        self.lane_of += lanes
        self.prefill_hidden = hid
        return list(range(first, self.B))

    def save_prefix(self, r: int):
        """Row r's committed keys and values, copied (its lane's ``save_prefix``)."""
        lane, i = self._where()[r]
        return lane.save_prefix(i)

    def remove_rows(self, idx: list[int]) -> None:
        drop = set(idx)
        for lane, rows in self.lanes():
            gone = [i for i, r in enumerate(rows) if r in drop]
            if gone:
                lane.remove_rows(gone)  # an own lane left empty is let go with its last row
        self.lane_of = [lane for r, lane in enumerate(self.lane_of) if r not in drop]

    def forward(
        self, seqs: list[list[int]], keep: int | None = None, trees: list | None = None, hidden: bool = False
    ) -> torch.Tensor:
        """One forward per lane; logits [B, N, V] (N: the longest feed; ``keep``: each lane's last
        ``keep`` positions), ``last_hidden`` likewise; row r's first len(seqs[r]) positions are real."""
        parts = []
        for lane, rows in self.lanes():
            t = None if trees is None else [trees[r] for r in rows]
            out = lane.forward([seqs[r] for r in rows], keep, t, hidden)
            parts.append((rows, out, lane.last_hidden))
            lane.last_hidden = None
        if len(parts) == 1:  # one lane (the usual case): its tensors as they are
            _, logits, self.last_hidden = parts[0]
            return logits
        self.last_hidden = _merged([(rows, h) for rows, _, h in parts], self.B) if hidden else None
        return _merged([(rows, out) for rows, out, _ in parts], self.B)

    def commit(self, keep: list) -> None:
        for lane, rows in self.lanes():
            lane.commit([keep[r] for r in rows])

    def holes(self) -> int:
        """Masked cache slots over every lane (transformers lanes)."""
        return sum(lane.holes() for lane, _ in self.lanes())


def _started(start: list) -> dict:
    """add_rows' ``start`` argument where a row starts from a saved prefix (none: a backend without them is
    called as before)."""
    return {"start": start} if any(s is not None for s in start) else {}


def _merged(parts: list[tuple[list[int], torch.Tensor]], B: int) -> torch.Tensor:
    """Lanes' [b, n, W] tensors -> one [B, N, W] (zeros past a lane's n), rows in the loop's order."""
    N = max(x.shape[1] for _, x in parts)
    ref = parts[0][1]
    out = ref.new_zeros(B, N, ref.shape[2])
    for rows, x in parts:
        out[torch.tensor(rows, device=out.device), : x.shape[1]] = x
    return out
