"""``python -m bench`` (console script ``moe-a2a-bench``): every stage of the MoE all-to-all and
the whole layer, per backend, side by side; each path checked against the oracle first, then
timed. The options, the sweeps and examples: ``python -m bench --help`` (bench/cli.py).
"""

from bench.cli import main, parse_args  # noqa: F401  (the console script names bench.__main__:main)

if __name__ == "__main__":
    main()
