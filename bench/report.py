"""Report writers: the terminal table, the Markdown table, the JSON and CSV files, the PNG plot,
the README headline.

The terminal table fits :data:`TERMINAL_WIDTH` columns: rows are grouped under their stage and
shape, long notes are cut, and the rows of paths that can never run on this machine are
summarised in a few lines; the Markdown and JSON files keep every row with its full note.

JSON layout: ``{"meta": {gpu, driver, torch, triton, flashinfer, date, command, limits, ...},
"records": [record, ...]}`` with the records of bench/runner.py. The CSV (``--csv``) has one
line per record under the column names of FlashInfer's own benchmark CSV (:data:`CSV_COLUMNS`).
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import re
import sys
import textwrap
from typing import Optional

import torch

from bench.targets import VERDICTS, judge_targets

# The verdicts' column in the terminal's list of targets.
VERDICT_WIDTH = max(len(v) for v in VERDICTS.values())

INTERPRETER_WARNING = ("NO GPU: Triton kernels ran in the interpreter on tiny shapes; the outputs "
                       "are checked, the timings MEAN NOTHING.")
# Columns of the terminal output.
TERMINAL_WIDTH = 120
# Notes of rows whose path cannot run on this machine at all (summarised in the terminal).
NEVER_HERE_PREFIXES = ("not available: ", "not run: ")


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


def make_meta(device: torch.device, num_gpus: int, limits: dict, command: str,
              not_applied: Optional[list[str]] = None) -> dict:
    """The run's metadata; ``not_applied``: the options given that did not apply here, each
    with the reason (bench.cli.options_not_applied)."""
    import triton
    return {
        "gpu": gpu_name(device), "num_gpus": num_gpus, "driver": driver_version(),
        "torch": torch.__version__, "triton": triton.__version__,
        "flashinfer": _version("flashinfer-python"),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command, "limits": limits,
        "interpreter": device.type != "cuda",
        "not_applied": list(not_applied or []),
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
            row.append(_verdict_and_target(r))
        row.append(r["note"])
        rows.append(row)
    return header, rows


def _us(value: Optional[float]) -> str:
    """Microseconds for the terminal: one decimal below 1000, none above."""
    if value is None:
        return "-"
    return f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def _verdict(record: dict) -> str:
    passed = record.get("target_pass", "absent")
    return "" if passed == "absent" else VERDICTS[passed]


def _verdict_and_target(record: dict) -> str:
    """"VERDICT: the targets' text" for a row a target applies to, else ""."""
    verdict = _verdict(record)
    return f"{verdict}: {record['target']}" if verdict else ""


def _cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters: cut (at a space when one is near the end of
    what fits) and marked with "..."."""
    if len(text) <= width:
        return text
    head = text[:max(width - 3, 0)]
    space = head.rfind(" ")
    if space > len(head) - 16 and head[:space].strip():
        head = head[:space]
    return head.rstrip(" ,;:") + "..."


def never_runs_here(record: dict) -> bool:
    """A row whose path cannot run on this machine at all (its backend is unavailable here, or
    the path is not run by construction), as opposed to one that failed, was skipped by
    --budget or could not be checked."""
    return record["ok"] is None and record["note"].startswith(NEVER_HERE_PREFIXES)


def _short_reason(note: str) -> str:
    """The head of a "not available: ..." note: its first clause, without the detail in
    parentheses."""
    for prefix in NEVER_HERE_PREFIXES:
        if note.startswith(prefix):
            note = note[len(prefix):]
    for stop in (" (", "; ", ". "):
        note = note.split(stop, 1)[0]
    return note


def summarise_never_here(records: list[dict], width: int = TERMINAL_WIDTH) -> list[str]:
    """Lines summarising the rows :func:`never_runs_here`: one per backend and reason, with the
    stages and the row count (none when there are no such rows)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        if never_runs_here(r):
            groups.setdefault((r["backend"], _short_reason(r["note"])), []).append(r)
    if not groups:
        return []
    total = sum(len(rows) for rows in groups.values())
    lines = [f"n/a here: {total} rows that cannot run on this machine (each one, with its full "
             f"reason, in the Markdown and JSON files):"]
    for (backend, reason), rows in groups.items():
        stages = ", ".join(dict.fromkeys(r["stage"] for r in rows))
        who = stages if backend == "*" else f"{stages} {backend}"
        lines.append(_cut(f"  {who} x {len(rows)}: {reason}", width))
    return lines


TERMINAL_HEADER = ["backend", "ok", "time us", "p20-p80 us", "GB/s", "% limit", "x FI",
                   "x torch"]


def _terminal_row(r: dict, with_targets: bool) -> list[str]:
    row = [r["backend"], _ok(r), _us(r["time_us"]),
           "-" if r["p20_us"] is None else f"{_us(r['p20_us'])}-{_us(r['p80_us'])}",
           _fmt(r["gbps"], ".0f"), _fmt(r["pct_of_limit"], ".0f"),
           _fmt(r.get("speedup_vs_flashinfer"), ".2f"), _fmt(r.get("speedup_vs_torch"), ".2f")]
    if with_targets:
        row.append(_verdict(r) or "-")
    return row


def _group_line(stage: str, shape: dict, rows: list[dict]) -> str:
    line = f"{stage} {_shape_text(shape)}".rstrip()
    counted = next((r for r in rows if r["bytes"]), None)
    if counted is not None:
        remote = f", {counted['remote_bytes']:,} remote" if counted["remote_bytes"] else ""
        line += f" ({counted['bytes']:,} bytes{remote})"
    return line


def format_table(records: list[dict], meta: dict, with_targets: bool = False,
                 width: int = TERMINAL_WIDTH) -> str:
    """The terminal table, at most ``width`` columns: per stage and shape a heading line
    (with the bytes an ideal kernel moves), then one line per backend; long notes cut, the
    rows that can never run here summarised after it (:func:`summarise_never_here`), and
    with ``with_targets`` the judged rows listed with their targets."""
    shown = [r for r in records if not never_runs_here(r)]
    header = TERMINAL_HEADER + (["target"] if with_targets else [])
    rows = [_terminal_row(r, with_targets) for r in shown]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else \
        [len(h) for h in header]
    # indent, cells and their separators, the separator before the note
    note_width = width - (2 + sum(widths) + 2 * len(widths))

    def line(cells: list[str], note: str) -> str:
        text = "  " + "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))
        if note and note_width > 0:
            text += "  " + _cut(note, note_width)
        return text.rstrip()[:width]

    lines = []
    if meta.get("interpreter"):
        lines.append(INTERPRETER_WARNING)
    lines.append(_cut(f"{meta['gpu']} x{meta['num_gpus']}  limits: "
                      f"{_limits_text(meta['limits'])}", width))
    lines.append(line(header, "note"))
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(shown):
        groups.setdefault((r["stage"], json.dumps(r["shape"], sort_keys=True)), []).append(i)
    for (stage, _), members in groups.items():
        lines.append(_cut(_group_line(stage, shown[members[0]]["shape"],
                                      [shown[i] for i in members]), width))
        lines += [line(rows[i], shown[i]["note"]) for i in members]
    lines += summarise_never_here(records, width)
    if with_targets:
        lines += _target_lines(records, width)
    if any(len(r["note"]) > note_width for r in shown):
        lines.append("(notes cut to fit: the Markdown and JSON files have them in full)")
    if meta.get("interpreter"):
        lines.append(INTERPRETER_WARNING)
    return "\n".join(lines)


def _target_lines(records: list[dict], width: int) -> list[str]:
    """The rows a target applies to, each with its verdict, time and the targets' text."""
    judged = [r for r in records if _verdict(r)]
    if not judged:
        return ["targets: no row of this run has a stated target"]
    counts = {v: sum(_verdict(r) == v for r in judged) for v in VERDICTS.values()}
    lines = ["targets: " + ", ".join(f"{n} {v}" for v, n in counts.items() if n)]
    for r in judged:  # wrapped, not cut: the target's text says what passed or failed
        lines += textwrap.wrap(f"{_verdict(r):<{VERDICT_WIDTH}}  {r['stage']} "
                               f"{_shape_text(r['shape'])} "
                               f"{r['backend']} {_us(r['time_us'])} us: {r['target']}", width,
                               initial_indent="  ", subsequent_indent=" " * (VERDICT_WIDTH + 4))
    return lines


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
    if meta.get("not_applied"):
        lines += [f"- not applied here: {'; '.join(meta['not_applied'])}"]
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

# The CSV's columns: first those of FlashInfer's benchmark CSV (benchmarks/flashinfer_benchmark.py
# writes routines/flashinfer_benchmark_utils.py's output columns; times in milliseconds,
# bandwidth in TB/s, dtypes as torch names), so that rows can be laid beside FlashInfer's, then
# ours.
FLASHINFER_CSV_COLUMNS = ("routine", "median_time", "std_time", "tb_per_sec", "backend",
                          "num_tokens", "hidden_size", "num_experts", "top_k", "ep_size",
                          "input_dtype", "quant_dtype", "case_tag")
OUR_CSV_COLUMNS = ("p20_time", "p80_time", "pct_of_limit", "ok", "timing", "gpu", "note")
CSV_COLUMNS = FLASHINFER_CSV_COLUMNS + OUR_CSV_COLUMNS
# Shape entries that name the op a stage row times (the CSV's routine: "<stage>_<entry>").
_ROUTINE_KEYS = ("op", "method", "scope")
# Payload dtype names of the records -> torch's names, as FlashInfer writes them.
_TORCH_DTYPES = {"bf16": "torch.bfloat16", "fp32": "torch.float32", "int32": "torch.int32",
                 "nvfp4": "torch.bfloat16"}
_QUANT_DTYPES = {"nvfp4_linear": "nvfp4", "nvfp4_swizzled": "nvfp4", "mxfp8": "mxfp8"}


def csv_row(record: dict) -> dict:
    """One record in :data:`CSV_COLUMNS` (missing values empty, as FlashInfer leaves them)."""
    shape = record["shape"]
    variant = next((shape[k] for k in _ROUTINE_KEYS if k in shape), None)
    ms = lambda us: "" if us is None else us / 1e3  # noqa: E731
    quant = shape.get("quant", shape.get("payload"))
    quant = _QUANT_DTYPES.get(shape.get("op"), "" if quant in (None, "bf16") else quant)
    named = ("tokens", "hidden", "experts", "top_k", "ep_size", "quant", "payload")
    extra = {k: v for k, v in shape.items() if k not in named + _ROUTINE_KEYS}
    # EP size: the simulated one of the local prepare, the process count of cross-rank stages
    ep_size = shape.get("ep_size", record["num_gpus"] if record.get("distributed") else "")
    return {
        "routine": record["stage"] + (f"_{variant}" if variant else ""),
        "median_time": ms(record["time_us"]), "std_time": ms(record.get("std_us")),
        "tb_per_sec": "" if record["gbps"] is None else record["gbps"] / 1e3,
        "backend": record["backend"], "num_tokens": shape.get("tokens", ""),
        "hidden_size": shape.get("hidden", ""), "num_experts": shape.get("experts", ""),
        "top_k": shape.get("top_k", ""), "ep_size": ep_size,
        "input_dtype": _TORCH_DTYPES.get(record["dtype"], record["dtype"]),
        "quant_dtype": quant,
        "case_tag": " ".join(f"{k}={v}" for k, v in extra.items()),
        "p20_time": ms(record["p20_us"]), "p80_time": ms(record["p80_us"]),
        "pct_of_limit": "" if record["pct_of_limit"] is None else record["pct_of_limit"],
        "ok": {True: "ok", False: "FAIL", None: "n/a"}[record["ok"]],
        "timing": record["timing"] or "", "gpu": record["gpu"], "note": record["note"],
    }


def write_csv(records: list[dict], path: str) -> str:
    """Write ``records`` to ``path`` as CSV (:data:`CSV_COLUMNS`, one line per record);
    returns the path."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(csv_row(r) for r in records)
    return path


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
            verdict = _verdict_and_target(r)
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
    results = []
    for path in result_paths:
        with open(path) as f:
            result = json.load(f)
        if result["meta"].get("interpreter"):
            raise SystemExit(f"--readme-from {path}: an interpreter-mode result (no GPU: the "
                             f"kernels ran in Triton's interpreter, its timings mean nothing); "
                             f"the README's headline takes results of GPU runs only")
        judge_targets(result["records"])
        if not _headline_records(result["records"], result["meta"]["num_gpus"]):
            raise SystemExit(f"--readme-from {path}: no row for the headline (no timed row of a "
                             f"shape with a target, and no cross-rank row at T in "
                             f"{HEADLINE_TOKENS}); run the sweeps that have them, e.g. "
                             f"--sweep deepseek or --sweep transport --gpus 2")
        results.append(result)
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
