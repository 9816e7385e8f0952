"""kernels.sizes: the launchers' cdiv / next_power_of_2 give Triton's results."""

import triton

from kernels.sizes import cdiv, next_power_of_2, round_up


def test_same_as_triton():
    for n in list(range(0, 4100)) + [2**31 - 1, 2**31, 2**31 + 1, 2**40 + 3, 2**63 - 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 7, 16, 128, 1000, 2**20):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
            assert round_up(n, d) == triton.cdiv(n, d) * d, (n, d)
