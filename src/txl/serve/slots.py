"""The model runner's preallocated generation buffers: rows seated in slots, stepped by the captured decode step.

Shape legend: R slots (rows the buffers hold), C columns of each slot's ring, L layers, m a row's rows read, d
d_model, H heads, D head width, V vocabulary.

A generation row steps inside the buffers (``txl.captured_step``): each layer's memory, keys and values in a ring of
C columns per slot, all rows writing the same column each step. So a row is seated (its rows copied into a free slot,
ending just behind the column the next step writes) when it first steps, stays there while it steps every round,
and is unseated (its rows copied out, ``Seat.saved``) in a round that steps others without it: a row that missed a
step would fall behind the shared column. Seating and unseating happen between steps, one copy of the row each;
a step copies nothing but the new column. The buffers grow (by doubling: more slots, a longer ring), and the
graphs are captured again, only when the rows outgrow them.
"""

from __future__ import annotations

import torch

from txl.captured_step import StepGraphs, bucket_for

__all__ = ["Seat", "Slots"]


class Seat:
    """One generation row: in a slot of ``Slots``, or out of them with its rows in ``saved``."""

    def __init__(self, slots: Slots) -> None:
        self.slots = slots
        self.slot: int | None = None
        self.length = 0
        """The rows it has read (its memory and keys), as the ring holds them while seated."""
        self.saved: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def take(self, b: int = 0) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Its memory (L, m, d) and keys, values (L, m, H, D), as ``Rows.take`` gives a row's (``b``: its index in a
        result's ``row``, always 0)."""
        if self.slot is None:
            assert self.saved is not None
            return self.saved
        return self.slots.take(self)


class Slots:
    """The rings of the rows stepping together, and the graphs that step them (``StepGraphs``)."""

    def __init__(self, model, graphs: StepGraphs, *, table, window: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        """``table``: (need, clamp_len) -> the model's positional table L x (N, H, D) for ``need`` distances (the
        decoder's, shared with its eager steps)."""
        c = model.config
        self.model, self.graphs, self.grow_table = model, graphs, table
        self.L, self.d, self.H, self.D = c.n_layer, c.d_model, c.n_head, c.d_head
        self.window, self.device, self.dtype = window, device, dtype
        self.R = self.C = 0
        self.col = 0  # the column the next step writes (the device's ``cols`` holds the same)
        self.seats: list[Seat | None] = []
        self.index: tuple[tuple[int, ...], torch.Tensor | None] = ((), None)  # the last step's slots, on the device

    # -- the buffers -------------------------------------------------------------------------------------------
    def _allocate(self, R: int, C: int) -> None:
        """Buffers of R slots and C columns (zeros: a slot no row holds computes finite nonsense, never NaN)."""
        L, d, H, D = self.L, self.d, self.H, self.D
        z = dict(device=self.device, dtype=self.dtype)
        self.memory = torch.zeros(L, R, C, d, **z)  # (L, R, C, d): layer l's rings are memory[l], a view
        self.keys = torch.zeros(L, R, C, H, D, **z)  # (L, R, C, H, D)
        self.values = torch.zeros(L, R, C, H, D, **z)
        self.ids = torch.zeros(R, 1, dtype=torch.long, device=self.device)  # (R, 1) each slot's input
        self.lens = torch.zeros(R, dtype=torch.long, device=self.device)  # (R,) each slot's rows read
        self.cols = torch.zeros(1, dtype=torch.long, device=self.device)  # (1,) the column the next step writes
        self.table = self.grow_table(C, self.model)
        self.R, self.C, self.col = R, C, 0
        self.seats = [None] * R
        self.index = ((), None)
        self.graphs.clear()

    def _fit(self, rows: int, longest: int) -> None:
        """Room for ``rows`` slots and a row of ``longest`` rows read (plus the one the step writes): else buffers
        twice as large (at least), every seated row copied over."""
        R, C = self.R, self.C
        need_r, need_c = bucket_for(rows), longest + 2  # the ring keeps a column spare: the query's own
        if need_r <= R and need_c <= C:
            return
        R = max(R, need_r)
        C = C if need_c <= C else max(2 * C, 1 << (need_c + 64 - 1).bit_length())
        seated = [s for s in self.seats if s is not None]
        for s in seated:
            self.unseat(s)
        self._allocate(R, C)
        for s in seated:
            self.seat(s, *s.saved)

    # -- rows in and out ---------------------------------------------------------------------------------------
    def _columns(self, m: int) -> torch.Tensor:
        """(m,) the columns of a seated row's m rows, oldest first: those just behind ``col``."""
        return (torch.arange(m, device=self.device) + (self.col - m)) % self.C

    def take(self, seat: Seat) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """A seated row's memory (L, m, d) and keys, values (L, m, H, D): copies, out of its ring."""
        cols, s = self._columns(seat.length), seat.slot
        return (self.memory[:, s].index_select(1, cols),
                (self.keys[:, s].index_select(1, cols), self.values[:, s].index_select(1, cols)))

    def seat(self, seat: Seat, memory: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Copy a row (memory (L, m, d), its keys and values or None: projected here) into the lowest free slot,
        its rows just behind the column the next step writes. The buffers must have room (``_fit``)."""
        s = self.seats.index(None)
        m = memory.size(1)
        memory = memory.to(self.device, self.dtype)
        if kv is None:  # keys of other weights, or none kept: projected once from the memory
            k, v = zip(*(layer.attn.keys_values(memory[l][None]) for l, layer in enumerate(self.model.layers)))
            kv = torch.cat(k), torch.cat(v)  # (L, m, H, D) each
        cols = self._columns(m)
        self.memory[:, s].index_copy_(1, cols, memory)
        self.keys[:, s].index_copy_(1, cols, kv[0].to(self.device, self.dtype))
        self.values[:, s].index_copy_(1, cols, kv[1].to(self.device, self.dtype))
        self.lens[s].fill_(m)
        self.seats[s] = seat
        seat.slot, seat.length, seat.saved = s, m, None

    def unseat(self, seat: Seat) -> None:
        """Copy a row out of its slot (``Seat.saved``) and free the slot."""
        seat.saved = self.take(seat)
        self.lens[seat.slot].fill_(0)
        self.seats[seat.slot] = None
        seat.slot = None

    # -- a step ------------------------------------------------------------------------------------------------
    def step(self, seats: list[Seat], parts: list, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of ``seats`` (each seated, or seated now from ``parts[i]``: memory and keys/values, when not yet)
        on their (B, 1) input ``ids``: (B, V) log-probs and (B,) greedy tokens, rows in the order given. Seated
        rows not among them are unseated first."""
        given = {id(s) for s in seats}
        for s in self.seats:
            if s is not None and id(s) not in given:
                self.unseat(s)
        B = bucket_for(len(seats))
        while any(s is not None for s in self.seats[B:]):  # rows left: the last seated moved down, into the bucket
            last = max(s.slot for s in self.seats if s is not None)
            moved = self.seats[last]
            self.unseat(moved)
            self.seat(moved, *moved.saved)
        incoming = [(s, p) for s, p in zip(seats, parts) if s.slot is None]
        longest = max([s.length for s in seats if s.slot is not None] + [p[0].size(1) for _, p in incoming])
        self._fit(len(seats), longest)
        for s, (memory, kv) in incoming:
            self.seat(s, memory, kv)
        slots = tuple(s.slot for s in seats)  # all below B
        if self.index[0] != slots:  # made when the rows change, not every step (a host copy)
            self.index = (slots, torch.tensor(slots, device=self.device))
        idx = self.index[1]
        self.ids.index_copy_(0, idx, ids)  # the rows' inputs into their slots (on the device)
        log_probs, greedy = self.graphs(B, self.ids, self.memory.unbind(0), self.keys.unbind(0),
                                        self.values.unbind(0), self.table, self.lens, self.cols)
        self.col = (self.col + 1) % self.C
        for s in seats:
            s.length = min(s.length + 1, self.window)
        return log_probs.index_select(0, idx), greedy.index_select(0, idx)  # (B', V), (B',)
