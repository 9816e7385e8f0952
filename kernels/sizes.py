"""Host-side size arithmetic of the launchers: ``cdiv`` and ``next_power_of_2``, the formulas of
``triton.cdiv`` and ``triton.next_power_of_2`` as plain functions, and ``round_up``.

Triton's two are ``constexpr_function`` objects, usable inside kernels too, whose call from
Python unwraps every argument first: it costs microseconds, the arithmetic a small fraction of
that, and a launcher makes up to a dozen such calls per op call. The launchers run on every
eager call (and at trace time, on ``torch.SymInt`` sizes, which take the same operators), so
they use these.
"""

from __future__ import annotations


def cdiv(x, y):
    """``ceil(x / y)`` for a non-negative x and a positive y: ``(x + y - 1) // y``."""
    return (x + y - 1) // y


def round_up(n, multiple):
    """n rounded up to a multiple of ``multiple`` (non-negative n, positive multiple)."""
    return cdiv(n, multiple) * multiple


def next_power_of_2(n):
    """The smallest power of 2 >= n (n < 2**64; 0 for n = 0), by the bit trick Triton's uses."""
    n -= 1
    n |= n >> 1
    n |= n >> 2
    n |= n >> 4
    n |= n >> 8
    n |= n >> 16
    n |= n >> 32
    n += 1
    return n
