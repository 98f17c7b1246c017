"""The results of ``flexattn check`` as a table: the cells and footnotes that both the terminal table (rich) and the
Markdown file show, so the two never disagree."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

__all__ = ["table", "to_markdown", "write_results", "failures"]

DENSE_MARK = "†"
DENSE_NOTE = (f"{DENSE_MARK} SDPA cannot express this variant (a score_mod, attention sinks, or a mask other "
              "than causal): the ratio is against SDPA's flash kernel on full attention at the same sizes, "
              "i.e. what a dense kernel costs, so it includes the blocks the mask lets flexattn skip.")


def _err(x: Optional[float]) -> str:
    return "-" if x is None else ("inf" if math.isinf(x) else f"{x:.1e}")


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def _ratio(baseline_ms: Optional[float], ours_ms: Optional[float]) -> Optional[str]:
    if not baseline_ms or not ours_ms:
        return None
    return f"{baseline_ms / ours_ms:.2f}x"


def failures(report: dict) -> list[dict]:
    return [row for row in report["rows"] if not row.get("ok")]


def table(report: dict) -> tuple[list[str], list[list[str]], list[str]]:
    """``(headers, rows of cells, footnotes)``. GPU columns appear when any row has GPU timings."""
    rows = report["rows"]
    gpu = _has_gpu_columns(rows)
    headers = ["variant", "sparsity", "fwd err", "grad err", "fwd ms", "bwd ms", "backend"]
    if gpu:
        headers += ["x SDPA fwd", "x SDPA bwd", "x torch fwd", "x torch bwd"]
    headers.append("check")
    notes: list[str] = []

    def note(text: str) -> str:
        if text not in notes:
            notes.append(text)
        return f"[{notes.index(text) + 1}]"

    cells = []
    for row in rows:
        if "error" in row:
            line = [row["variant"], "-", "-", "-", "-", "-", "-"] + (["-"] * 4 if gpu else [])
            line.append(f"FAIL {note(row['variant'] + ': ' + row['error'])}")
            cells.append(line)
            continue
        backend = row["backend"] if row.get("backend_bwd", row["backend"]) == row["backend"] else \
            f"{row['backend']} / bwd {row['backend_bwd']}"
        line = [row["variant"], f"{row['sparsity']:.1f}%", _err(row["fwd_err"]), _err(row["grad_err"]),
                _ms(row["fwd_ms"]), _ms(row["bwd_ms"]), backend]
        if gpu:
            for key in ("sdpa", "torch_flex"):
                base = row.get(key)
                if base is None:
                    line += ["-", "-"]
                    continue
                mark = DENSE_MARK if base.get("kind") == "dense" else ""
                for phase in ("fwd", "bwd"):
                    ratio = _ratio(base.get(f"{phase}_ms"), row[f"{phase}_ms"])
                    if ratio is None:
                        who = "SDPA" if key == "sdpa" else "torch's compiled flex_attention"
                        line.append("n/a " + note(f"{who} cannot run {row['variant']}: {base.get('error') or 'no timing'}"))
                    else:
                        line.append(ratio + mark)
        tol = row["tolerance"]
        line.append("ok" if row["ok"] else f"FAIL (> {tol:.0e})")
        cells.append(line)
    footnotes = [f"[{i + 1}] {text}" for i, text in enumerate(notes)]
    if gpu and any(row.get("sdpa", {}).get("kind") == "dense" for row in rows):
        footnotes.append(DENSE_NOTE)
    return headers, cells, footnotes


def describe(report: dict) -> str:
    env, sizes = report["env"], report["sizes"]
    return (f"flexattn {env['flexattn']} on {env['device']} ({env['device_name']}), torch {env['torch']}, "
            f"triton {env['triton']}; B={sizes['B']} H={sizes['H']} L={sizes['L']} D={sizes['D']} {sizes['dtype']}. "
            "err: norm-wise relative error against the float64 reference (grad err: the largest over "
            f"q, k, v and learnable tensors), tolerance {_tolerance(report)}; ms: median of warm calls"
            + ("; x: baseline time / flexattn time." if _has_gpu_columns(report["rows"]) else "."))


def _has_gpu_columns(rows: list[dict]) -> bool:
    return any("sdpa" in row or "torch_flex" in row for row in rows)


def _tolerance(report: dict) -> str:
    tolerances = sorted({row["tolerance"] for row in report["rows"]})
    return ", ".join(f"{t:.0e}" for t in tolerances) or "-"


def to_markdown(report: dict) -> str:
    headers, cells, footnotes = table(report)
    lines = ["# flexattn check", "", describe(report), "",
             "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |" for line in cells]
    if footnotes:
        lines += [""] + [note + "  " for note in footnotes]
    return "\n".join(lines) + "\n"


def _jsonable(obj):
    """Plain JSON: inf and NaN (an error where a gradient is missing) become the strings "inf"/"nan"."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def write_results(report: dict, out: Path) -> tuple[Path, Path]:
    """``out`` with .json and .md suffixes (a given suffix is replaced)."""
    stem = out.with_suffix("") if out.suffix in (".json", ".md") else out
    stem.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = Path(f"{stem}.json"), Path(f"{stem}.md")
    json_path.write_text(json.dumps(_jsonable(report), indent=1, allow_nan=False) + "\n")
    md_path.write_text(to_markdown(report))
    return json_path, md_path
