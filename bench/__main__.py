"""``python -m bench`` (console script ``moe-a2a-bench``): every stage of the MoE all-to-all and
the whole layer, per backend, side by side; checked against the oracle first, then timed.

    python -m bench                       # all stages, DeepSeek-V3 shapes, one GPU
    python -m bench --gpus 2              # one process per GPU: adds dispatch, combine, layer
    python -m bench --stages quantize,routing --backends triton,flashinfer --sweep quick
    python -m bench --sweep full --stages permute --budget 400 --bundle --out results/p
    python -m bench --targets             # PASS/FAIL against the targets stated in the issues

Without a GPU the Triton kernels run in Triton's interpreter on tiny shapes: the outputs are
checked and the same table is printed, but the timings mean nothing. Results (JSON, Markdown,
one PNG; with ``--bundle`` also one .tar.gz of them) go to ``bench/results/`` on a GPU, and on
CPU only when ``--out`` is given.

Run time on a GPU: the default sweep is sized for a few minutes per call (1 GPU, and
``--gpus 2``), and ``--budget`` (default 400 s of sweep) stops starting shapes past it, listing
the rest as skipped with the command that runs them. ``--sweep full`` (the issue's whole grid,
about 4x the default) is meant to be run a few ``--stages`` per call.
"""

from bench.cli import main, parse_args  # noqa: F401  (the console script names bench.__main__:main)

if __name__ == "__main__":
    main()
