"""Report writers: the console / Markdown table, the JSON file, the PNG plots.

JSON layout: ``{"meta": {gpu, driver, torch, triton, flashinfer, date, command, limits, ...},
"records": [record, ...]}`` with the records of bench/runner.py.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
from typing import Optional

import torch

INTERPRETER_WARNING = ("NO GPU: Triton kernels ran in the interpreter on tiny shapes; the outputs "
                       "are checked, the timings MEAN NOTHING.")


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------

def _version(module: str) -> Optional[str]:
    try:
        from importlib.metadata import version
        return version(module)
    except Exception:
        return None


def driver_version() -> Optional[str]:
    """The NVIDIA driver version through nvidia-ml-py; None without it or without a driver."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else version
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def gpu_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu (Triton interpreter)"


def make_meta(device: torch.device, num_gpus: int, limits: dict, command: str) -> dict:
    import triton
    return {
        "gpu": gpu_name(device), "num_gpus": num_gpus, "driver": driver_version(),
        "torch": torch.__version__, "triton": triton.__version__,
        "flashinfer": _version("flashinfer-python"),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command, "limits": limits,
        "interpreter": device.type != "cuda",
    }


# ---------------------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------------------

def _fmt(value, spec: str, empty: str = "-") -> str:
    return empty if value is None else format(value, spec)


def _ok(record: dict) -> str:
    return {True: "ok", False: "FAIL", None: "n/a"}[record["ok"]]


_SHORT_KEYS = {"tokens": "T", "hidden": "H", "experts": "E", "top_k": "k", "ep_size": "R"}


def _shape_text(shape: dict) -> str:
    """``T=512 H=7168 E=256 k=8 uniform``: numbers with a short key, names as they are."""
    return " ".join(f"{_SHORT_KEYS[k]}={v}" if k in _SHORT_KEYS else
                    (str(v) if isinstance(v, str) else f"{k}={v}") for k, v in shape.items())


def table_rows(records: list[dict], with_targets: bool) -> tuple[list[str], list[list[str]]]:
    header = ["stage", "shape", "backend", "ok", "time us", "p20-p80 us", "bytes", "GB/s",
              "% limit", "x FI", "x torch"]
    if with_targets:
        header.append("target")
    header.append("note")
    rows = []
    for r in records:
        remote = f" ({r['remote_bytes']:,} remote)" if r["remote_bytes"] else ""
        row = [r["stage"], _shape_text(r["shape"]), r["backend"], _ok(r),
               _fmt(r["time_us"], ".1f"),
               "-" if r["p20_us"] is None else f"{r['p20_us']:.1f}-{r['p80_us']:.1f}",
               f"{r['bytes']:,}{remote}", _fmt(r["gbps"], ".0f"), _fmt(r["pct_of_limit"], ".0f"),
               _fmt(r.get("speedup_vs_flashinfer"), ".2f"), _fmt(r.get("speedup_vs_torch"), ".2f")]
        if with_targets:
            passed = r.get("target_pass", "absent")
            row.append("" if passed == "absent" else
                       f"{ {True: 'PASS', False: 'FAIL', None: 'not run'}[passed]}: {r['target']}")
        row.append(r["note"])
        rows.append(row)
    return header, rows


def format_table(records: list[dict], meta: dict, with_targets: bool = False) -> str:
    """The console table (plain text, aligned columns)."""
    header, rows = table_rows(records, with_targets)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else \
        [len(h) for h in header]
    widths[-1] = min(widths[-1], 120)
    lines = []
    if meta.get("interpreter"):
        lines.append(INTERPRETER_WARNING)
    lines.append(f"{meta['gpu']} x{meta['num_gpus']}  limits: {_limits_text(meta['limits'])}")
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(str(c)[:w].ljust(w) for c, w in zip(row, widths)).rstrip())
    if meta.get("interpreter"):
        lines.append(INTERPRETER_WARNING)
    return "\n".join(lines)


def _limits_text(limits: dict) -> str:
    parts = [f"HBM copy {limits['hbm_gbps']:.0f} GB/s" if "hbm_gbps" in limits else "",
             f"NVLink peer store {limits['nvlink_gbps']:.0f} GB/s" if "nvlink_gbps" in limits
             else ""]
    return ", ".join(p for p in parts if p) or "not measured"


def format_markdown(records: list[dict], meta: dict, with_targets: bool = False) -> str:
    header, rows = table_rows(records, with_targets)
    escape = lambda text: str(text).replace("|", "\\|")  # noqa: E731
    lines = [f"# MoE all-to-all bench: {meta['gpu']} x{meta['num_gpus']}, {meta['date']}", ""]
    if meta.get("interpreter"):
        lines += [f"**{INTERPRETER_WARNING}**", ""]
    lines += [f"- command: `{meta['command']}`",
              f"- torch {meta['torch']}, triton {meta['triton']}, flashinfer {meta['flashinfer']},"
              f" driver {meta['driver']}",
              f"- limits: {_limits_text(meta['limits'])}",
              "- time: median, p20-p80 in microseconds (timing method per row in the JSON: "
              "cuda_graph replay only for paths declared free of host syncs "
              "(cuda_graph_l2_flushed: an L2 flush before each call, its time subtracted), "
              "else eager calls after an L2 flush); "
              "GB/s = effective bandwidth, the bytes formula of each stage (bench/stages.py, "
              "bench/transport.py) / time; % limit = ideal time at the measured limits / time, "
              "counting HBM bytes once (gather_rows reads each token row k times, mostly from "
              "L2: its GB/s may exceed the HBM limit, its % limit counts the row once); the "
              "limit is a torch copy_, which a tuned kernel can beat by a few %; x FI, x torch ="
              " speed-up against FlashInfer's best row and torch",
              "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(escape(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------

# Panels per row of the one plot file.
PLOT_COLUMNS = 3


def result_stem(meta: dict) -> str:
    """``<gpu>-<n>gpu-<date>``, file-name safe."""
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", meta["gpu"]).strip("-").lower()
    date = meta["date"].replace(":", "").replace("-", "")
    return f"{gpu}-{meta['num_gpus']}gpu-{date}"


def write_results(records: list[dict], meta: dict, out_dir: str,
                  with_targets: bool = False, plots: bool = True) -> list[str]:
    """Write ``<stem>.json``, ``<stem>.md`` and the plots into ``out_dir``; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, result_stem(meta))
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(format_markdown(records, meta, with_targets))
    written = [stem + ".json", stem + ".md"]
    if plots:
        written += write_plots(records, meta, stem)
    return written


def write_plots(records: list[dict], meta: dict, stem: str) -> list[str]:
    """One PNG, ``<stem>.png``, with a panel per stage (and op): time against tokens per rank,
    one line per backend and remaining shape. Skipped, with a message, when matplotlib is
    missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: plots skipped (pip install matplotlib)",
              file=sys.stderr)
        return []
    panels: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for r in records:
        if r["time_us"] is None or "tokens" not in r["shape"]:
            continue
        panel = r["stage"] + ("-" + r["shape"]["op"] if "op" in r["shape"] else "")
        rest = {k: v for k, v in r["shape"].items() if k not in ("tokens", "op")}
        line = f"{r['backend']} {_shape_text(rest)}"
        panels.setdefault(panel, {}).setdefault(line, []).append((r["shape"]["tokens"],
                                                                  r["time_us"]))
    if not panels:
        return []
    columns = min(PLOT_COLUMNS, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(7 * columns, 5 * rows), squeeze=False)
    for ax, (panel, lines) in zip(axes.flat, sorted(panels.items())):
        for label, points in sorted(lines.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("time (us)" + (", interpreter: meaningless" if meta.get("interpreter")
                                     else ""))
        ax.set_title(panel)
        ax.legend(fontsize=5, ncol=2)
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"{meta['gpu']} x{meta['num_gpus']}, {meta['date']}")
    path = f"{stem}.png"
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return [path]


# ---------------------------------------------------------------------------------------------
# README headline (written by the bench from its own result files)
# ---------------------------------------------------------------------------------------------

README_START = "<!-- bench:headline:start (written by python -m bench --readme-from) -->"
README_END = "<!-- bench:headline:end -->"
# Tokens per rank shown for the cross-rank stages in the headline.
HEADLINE_TOKENS = (16, 2048)


def _headline_records(records: list[dict], num_gpus: int) -> list[dict]:
    """The rows with a stated target and, for multi-GPU runs, the cross-rank rows at
    ``HEADLINE_TOKENS``; each with every backend's row of the same stage and shape."""
    keys = []
    for r in records:
        wanted = ("target" in r) or (num_gpus > 1 and r["stage"] != "layer"
                                     and r["shape"].get("tokens") in HEADLINE_TOKENS)
        key = (r["stage"], json.dumps(r["shape"], sort_keys=True))
        if wanted and key not in keys:
            keys.append(key)
    return [r for key in keys for r in records
            if (r["stage"], json.dumps(r["shape"], sort_keys=True)) == key and r["ok"] is not None]


def format_headline(results: list[dict]) -> str:
    """Markdown for the README: per result file, its GPU, date and command, then the headline
    rows (time, GB/s, speed-up against FlashInfer, target verdict)."""
    lines = []
    for result in results:
        meta, records = result["meta"], result["records"]
        lines += [f"**{meta['gpu']} x{meta['num_gpus']}, {meta['date']}** "
                  f"(`{meta['command']}`; limits: {_limits_text(meta['limits'])})", "",
                  "| stage | shape | backend | ok | time us | GB/s | x FI | target |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in _headline_records(records, meta["num_gpus"]):
            passed = r.get("target_pass", "absent")
            verdict = "" if passed == "absent" else \
                f"{ {True: 'PASS', False: 'FAIL', None: 'not run'}[passed]}: {r['target']}"
            lines.append("| " + " | ".join([
                r["stage"], _shape_text(r["shape"]), r["backend"], _ok(r),
                _fmt(r["time_us"], ".1f"), _fmt(r["gbps"], ".0f"),
                _fmt(r.get("speedup_vs_flashinfer"), ".2f"), verdict]).replace("\n", " ") + " |")
        lines.append("")
    return "\n".join(lines)


def update_readme(readme_path: str, result_paths: list[str]) -> None:
    """Replace the README's headline section (between ``README_START`` and ``README_END``)
    with ``format_headline`` of the given result JSON files, their measured rows judged
    against the current targets (``bench.targets``)."""
    from bench.targets import judge_targets
    results = []
    for path in result_paths:
        with open(path) as f:
            results.append(json.load(f))
        judge_targets(results[-1]["records"])
    with open(readme_path) as f:
        text = f.read()
    if README_START not in text or README_END not in text:
        raise SystemExit(f"{readme_path} has no headline markers ({README_START} ... "
                         f"{README_END})")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    links = ", ".join(f"`{os.path.relpath(p, os.path.dirname(readme_path) or '.')}`"
                      for p in result_paths)
    body = f"\nFrom {links} (full tables beside them).\n\n" + format_headline(results)
    with open(readme_path, "w") as f:
        f.write(head + README_START + body + README_END + tail)
