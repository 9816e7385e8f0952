"""No rank left hanging: the host-side agreement of a :class:`~a2a.alltoall.MoEAlltoall`'s
collective calls, over the process group's key-value store.

Before any data moves, every collective call (the constructor, ``prepare``, ``dispatch``,
``combine``) makes the ranks agree that every rank reached the same call and that every rank's
arguments passed its checks. Each rank writes a small status (which call, its signature, its
error if any) under a key of its own and waits, with a deadline, for the other ranks' keys:

- all arrived, all fine: the call goes on;
- all arrived, some rank rejected its arguments or is at another call (out of step): every
  rank raises, naming the ranks and their reasons; nothing was sent and the object stays
  usable (the failing rank raises its own exception);
- a rank did not arrive within ``timeout`` seconds: every rank that waited raises
  :class:`PeerTimeout` naming the missing ranks, and the object becomes unusable (a rank that
  arrives late finds the verdict and raises too, instead of entering a collective alone);
- a rank whose object broke (a timeout, an error while data moved) poisons its next call:
  the other ranks raise there, naming it, instead of waiting.

Why a store and not a collective of the group: a store wait takes a deadline and tells which
ranks are missing; a collective would wait for the group's own timeout (30 minutes by default)
and could not say who. The store is the group's own (``ProcessGroup.get_group_store()``, the
same for gloo and NCCL groups), so nothing is set up besides it.

Keys (under the group store's prefix): ``moe_a2a/objects/<rank>`` counts the objects each rank
made on the group (the n-th object of every rank is the same object: construction is
collective); ``moe_a2a/<object>/<call>/{s<rank>, verdict, done}`` hold one call's statuses,
its verdict (set once with ``compare_set``: "go", or "dead" with the missing ranks, so that the
ranks that waited and a late one reach the same decision) and the count of ranks done with
it. The last rank done deletes the call's keys, so nothing grows with the calls.
"""

from __future__ import annotations

import datetime
import json
from typing import Optional

import torch.distributed as dist

from a2a.protocol import CollectiveTimeout

KEY_ROOT = "moe_a2a"
VERDICT_GO = "go"


class PeerTimeout(CollectiveTimeout):
    """Some ranks did not reach a collective call of a MoEAlltoall within its ``timeout``; the
    object is unusable on every rank that knows it."""


class PeerRejected(ValueError):
    """Some other rank rejected its arguments of a collective call (or is at another call), so
    no rank moved any data; the object stays usable."""


class BrokenAlltoall(RuntimeError):
    """The MoEAlltoall cannot be used any more (a peer timed out, or data movement failed on
    some rank); construct a new one on every rank."""


def group_store(group: Optional[dist.ProcessGroup]) -> dist.Store:
    """The key-value store of ``group`` (None = the default group)."""
    pg = dist.group.WORLD if group is None else group
    if not hasattr(pg, "get_group_store"):
        raise TypeError(f"{type(pg).__name__} has no get_group_store() (a torch.distributed "
                        f"ProcessGroup of torch >= 2.7 has): MoEAlltoall agrees over it")
    return pg.get_group_store()


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class Agreement:
    """The agreements of one MoEAlltoall on this rank (see the module docstring).

    Construct it on every rank at the same time (it numbers the object); then every rank calls
    :meth:`agree` for the same sequence of collective calls.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], ep_rank: int, ep_size: int,
                 timeout: float):
        self.ep_rank, self.ep_size, self.timeout = ep_rank, ep_size, timeout
        self.store = group_store(group)
        number = self.store.add(f"{KEY_ROOT}/objects/{ep_rank}", 1)
        self.prefix = f"{KEY_ROOT}/{number}/"
        self.calls = 0
        self.broken: Optional[str] = None

    # -----------------------------------------------------------------------------------------

    def check_usable(self) -> None:
        """Raise :class:`BrokenAlltoall` when this object broke on this rank."""
        if self.broken is not None:
            raise BrokenAlltoall(f"rank {self.ep_rank}: this MoEAlltoall is unusable "
                                 f"({self.broken}); construct a new one on every rank")

    def agree(self, what: str, signature: str, error: Optional[BaseException]) -> None:
        """Agree with every rank on call ``what`` (with ``signature``, which every rank must
        give alike, e.g. the payload dtype) before any data moves; ``error``: this rank's
        rejection of its arguments, or None. Returns when every rank arrived and is fine;
        raises otherwise (on every rank: see the module docstring)."""
        self.check_usable()
        call = self.calls
        self.calls += 1
        keys = self._call_keys(call)
        mine = {"what": what, "signature": signature,
                "error": None if error is None else describe(error)}
        self.store.set(keys[self.ep_rank], json.dumps(mine))
        arrived = self._wait(keys[:self.ep_size])
        if arrived:
            verdict = self._decide(call, VERDICT_GO)
        else:
            missing = self._missing(keys[:self.ep_size])
            verdict = self._decide(call, json.dumps({"missing": missing, "by": self.ep_rank}))
        if verdict != VERDICT_GO:
            self._done(call)
            self._fail_dead(what, call, json.loads(verdict))
        statuses = [json.loads(value) for value in self.store.multi_get(keys[:self.ep_size])]
        self._done(call)
        self._judge(what, call, statuses, error)

    def poison(self, reason: str, *, tell_peers: bool = True) -> None:
        """This rank's object broke (``reason``): mark it unusable here and, with
        ``tell_peers``, make the next call fail on every other rank, naming this one, instead of
        waiting for it. Without (objects that do not agree on their calls) only this rank
        knows."""
        if self.broken is not None:
            return
        self.broken = reason
        if not tell_peers:
            return
        call = self.calls
        keys = self._call_keys(call)
        status = {"what": None, "signature": None, "error": None, "broken": reason}
        try:
            self.store.set(keys[self.ep_rank], json.dumps(status))
            self._decide(call, json.dumps({"missing": [], "by": self.ep_rank,
                                           "broken": reason}))
            self._done(call)
        except (RuntimeError, OSError):  # the store itself is gone: the peers time out instead
            pass

    # -----------------------------------------------------------------------------------------

    def _call_keys(self, call: int) -> list[str]:
        """[status of rank 0 .. R-1, verdict, done] of call ``call``."""
        base = f"{self.prefix}{call}/"
        statuses = [f"{base}s{rank}" for rank in range(self.ep_size)]
        return statuses + [f"{base}verdict", f"{base}done"]

    def _wait(self, keys: list[str]) -> bool:
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout))
            return True
        except (RuntimeError, OSError):  # DistStoreError on the deadline
            return False

    def _missing(self, keys: list[str]) -> list[int]:
        return [rank for rank, key in enumerate(keys) if not self.store.check([key])]

    def _decide(self, call: int, proposal: str) -> str:
        """The call's verdict: ``proposal`` if this rank decides first, else the one set."""
        verdict = self.store.compare_set(self._call_keys(call)[-2], "", proposal)
        return verdict.decode() if isinstance(verdict, bytes) else verdict

    def _done(self, call: int) -> None:
        """Count this rank done with ``call``; the last one deletes the call's keys."""
        keys = self._call_keys(call)
        if self.store.add(keys[-1], 1) == self.ep_size:
            for key in keys:
                self.store.delete_key(key)

    def _fail_dead(self, what: str, call: int, verdict: dict) -> None:
        me, by = self.ep_rank, verdict["by"]
        if "broken" in verdict:
            self.broken = f"{what} (collective call {call}): rank {by} broke"
            raise BrokenAlltoall(f"rank {me}: {what} (collective call {call} of this "
                                 f"MoEAlltoall): the MoEAlltoall of rank(s) [{by}] broke "
                                 f"({verdict['broken']}); nothing was sent. It is now unusable "
                                 f"on every rank: construct a new one")
        if by == me:
            reason = (f"rank(s) {verdict['missing']} did not arrive within "
                      f"timeout={self.timeout} s")
        else:
            reason = (f"rank {by} gave up waiting for rank(s) {verdict['missing']} after "
                      f"timeout={self.timeout} s")
        self.broken = f"{what} (collective call {call}): {reason}"
        raise PeerTimeout(f"rank {me}: {what} (collective call {call} of this MoEAlltoall): "
                          f"{reason}; nothing was sent. This MoEAlltoall is now unusable on "
                          f"every rank: construct a new one")

    def _judge(self, what: str, call: int, statuses: list[dict],
               error: Optional[BaseException]) -> None:
        me = self.ep_rank
        broken = {rank: s["broken"] for rank, s in enumerate(statuses) if s.get("broken")}
        if broken:
            self.broken = f"rank(s) {sorted(broken)} broke: {broken}"
            raise BrokenAlltoall(f"rank {me}: {what}: the MoEAlltoall of rank(s) "
                                 f"{sorted(broken)} broke ({broken}); nothing was sent. It is "
                                 f"now unusable on every rank: construct a new one")
        calls = [s["what"] for s in statuses]
        if len(set(calls)) > 1:
            listed = ", ".join(f"rank {rank}: {name}" for rank, name in enumerate(calls))
            raise PeerRejected(f"rank {me}: {what}: the ranks are at different collective calls "
                               f"of this MoEAlltoall ({listed}); nothing was sent. Every rank "
                               f"must make the same sequence of calls")
        rejected = {rank: s["error"] for rank, s in enumerate(statuses) if s["error"]}
        if error is not None:
            raise error
        if rejected:
            listed = "; ".join(f"rank {rank}: {msg}" for rank, msg in sorted(rejected.items()))
            raise PeerRejected(f"rank {me}: {what}: rank(s) {sorted(rejected)} rejected their "
                               f"arguments, so no rank moved any data ({listed})")
        signatures = [s["signature"] for s in statuses]
        if len(set(signatures)) > 1:
            listed = "; ".join(f"rank {rank}: {sig}" for rank, sig in enumerate(signatures))
            raise PeerRejected(f"rank {me}: {what}: the ranks disagree ({listed}); nothing was "
                               f"sent. Pass the same to every rank")
