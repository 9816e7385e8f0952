"""``python -m bench`` (console script ``moe-a2a-bench``): every stage of the MoE all-to-all and
the whole layer, per backend, side by side; checked against the oracle first, then timed.

    python -m bench                       # all stages, the issue's grid (until --budget), one GPU
    python -m bench --sweep deepseek      # DeepSeek-V3 shapes only (fits one call)
    python -m bench --gpus 2              # one process per GPU: adds dispatch, combine, layer
    python -m bench --stages quantize,routing --backends triton,flashinfer --sweep quick
    python -m bench --stages permute --budget 400 --bundle --out results/p
    python -m bench --targets             # PASS/FAIL against the targets stated in the issues

Without a GPU the Triton kernels run in Triton's interpreter on tiny shapes: the outputs are
checked and the same table is printed, but the timings mean nothing. Results (JSON, Markdown,
one PNG; with ``--bundle`` also one .tar.gz of them) go to ``bench/results/`` on a GPU, and on
CPU only when ``--out`` is given.

Run time on a GPU: the default sweep is the issue's grid (T {1,16,128,512,2048,8192} x H
{4096,7168} x E {64,256} x k {4,8} x uniform/skewed routing), too big for one call: ``--budget``
(default 400 s of sweep) stops starting shapes past it, listing the rest as skipped with the
command that runs them; run it a few ``--stages`` (or ``--tokens``) per call. ``--sweep
deepseek`` (H=7168, E=256, k=8 only, about a quarter of it) fits one call.
"""

from bench.cli import main, parse_args  # noqa: F401  (the console script names bench.__main__:main)

if __name__ == "__main__":
    main()
