"""The ``flexattn`` command: check (every catalogue variant checked and timed here), pictures of a
variant's mask, its generated Triton source, and the paper benchmark.

    flexattn check [--device cpu|cuda] [--seq N] [--only NAME[,NAME]] [--out PATH]
    flexattn show NAME [--seq N] [--png PATH]
    flexattn kernel NAME [--backward | --decode] [--seq N]
    flexattn bench [--mode fwd|bwd|decode|model|fp8|host] [-- BENCHMARK ARGS]
    flexattn list

Mistakes on the command line (an unknown variant, a bad length) get one line that names the
argument and what is valid, and exit status 2; no traceback. The table, the progress bar and the
PNG need the ``cli`` extra (rich, matplotlib): ``pip install 'flexattn[cli]'``.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import importlib
import sys
import time
from pathlib import Path
from typing import Optional

from flexattn.bench import MODES as BENCH_MODES

__all__ = ["main"]

EXTRA_HINT = "pip install 'flexattn[cli]'"
MIN_SEQ, MAX_SEQ = 16, 1 << 17
USAGE_ERROR, FAILED = 2, 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: D102  (argparse's hook)
        # One line naming the argument and what is valid, then exit status 2, as argparse's own.
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class _CommandError(Exception):
    """A failure the user can act on: printed as one line, exit status ``code``."""

    def __init__(self, message: str, code: int = FAILED):
        super().__init__(message)
        self.code = code


def _catalogue() -> dict:
    from flexattn.variants import CATALOGUE

    return CATALOGUE


def _variant_name(text: str) -> str:
    catalogue = _catalogue()
    if text in catalogue:
        return text
    close = difflib.get_close_matches(text, list(catalogue), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise argparse.ArgumentTypeError(
        f"unknown variant '{text}'{hint}; choose from: {', '.join(catalogue)} ('flexattn list' describes them)"
    )


def _variant_names(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected NAME[,NAME...] with no empty names, got '{text}'")
    return [_variant_name(name) for name in names]


def _seq_len(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not MIN_SEQ <= value <= MAX_SEQ:
        raise argparse.ArgumentTypeError(
            f"expected a sequence length in tokens, a whole number from {MIN_SEQ} to {MAX_SEQ}, got '{text}'"
        )
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of 1 or more, got '{text}'")
    return value


def _require(module: str, command: str, purpose: str):
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise _CommandError(f"flexattn {command} needs '{module}' for {purpose}, which is not installed ({err}): "
                            f"{EXTRA_HINT}") from err


# -------------------------------------------------------------------------------------- check


def _default_results(device: str, only: Optional[list[str]]) -> Path:
    """Where results go without --out: check/check-DEVICE under flexattn's cache directory for the whole
    catalogue; a run of --only variants gets a name of its own (check-cpu-only-causal-alibi), so it
    never replaces the full run's results."""
    from flexattn.codegen import cache_dir

    name = f"check-{device}"
    if only:
        joined = "-".join(only)
        if len(joined) > 80:  # a file name must stay short; the digest keeps distinct subsets apart
            joined = f"{len(only)}-variants-{hashlib.sha256(joined.encode()).hexdigest()[:8]}"
        name += f"-only-{joined}"
    return cache_dir() / "check" / name


def _cmd_check(args, parser) -> int:
    import torch

    from flexattn.cli.check import default_sizes, run_check
    from flexattn.cli.report import describe, failures, table, write_results

    _require("rich", "check", "its table and progress bar")
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: 'cuda' is not available here (torch.cuda.is_available() is False); "
                     "choose 'cpu'")
    if device == "cpu":
        # One thread: on a shared machine a second OpenMP thread that waits for a busy core made CPU
        # timings swing 10 to 100x; one thread held them steady.
        torch.set_num_threads(args.threads)
    sizes = default_sizes(device, args.seq)
    names = args.only or list(_catalogue())
    if args.out is None:
        args.out = _default_results(device, args.only)

    err = Console(stderr=True)
    start = time.perf_counter()
    with Progress(TextColumn("[bold]{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task("starting", total=len(names))
        report = run_check(names, device, sizes, torch_flex=not args.no_torch_flex,
                         on_start=lambda name: progress.update(task, description=name),
                         on_done=lambda row: progress.advance(task))
    report["seconds"] = round(time.perf_counter() - start, 1)

    headers, cells, footnotes = table(report)
    out = Console()
    if not out.is_terminal:  # a log or a pipe: the whole table, not one squeezed into 80 columns
        out = Console(width=max(out.width, 200))
    grid = Table(title=f"flexattn check: {len(names)} variants on {device}", title_justify="left")
    for i, header in enumerate(headers):
        grid.add_column(header, justify="left" if i in (0, len(headers) - 1) or header == "backend" else "right",
                        no_wrap=i == 0)  # names stay whole; numbers' headers may wrap
    for line in cells:
        line = [escape(cell) for cell in line]  # a name or message with [brackets] is text, not markup
        grid.add_row(*[f"[red]{cell}[/red]" if cell.startswith("FAIL") else cell for cell in line])
    out.print(grid)
    for note in footnotes:
        out.print(note, markup=False, highlight=False)
    out.print(describe(report), markup=False, highlight=False)
    json_path, md_path = write_results(report, Path(args.out))
    failed = failures(report)
    verdict = (f"{len(failed)} of {len(names)} variants FAILED: {', '.join(row['variant'] for row in failed)}"
               if failed else f"all {len(names)} variants within tolerance")
    out.print(f"{verdict} ({report['seconds']} s). Results: {json_path} and {md_path}", markup=False, highlight=False)
    return FAILED if failed else 0


# ---------------------------------------------------------------------------------------- show


def _cmd_show(args, parser) -> int:
    from flexattn.cli.picture import text_picture, variant_mask, write_png

    variant = _catalogue()[args.name]
    L = args.seq
    inst = variant.make(1, 1, L, L, "cpu")
    bm, tokens = variant_mask(inst, L, L)
    bq, bkv = bm.BLOCK_SIZE
    print(f"{variant.name}: {variant.summary}")
    print(f"BlockMask at Q_LEN = KV_LEN = {L} (batch 0, head 0), {bq}x{bkv} blocks, sparsity {bm.sparsity():.1f}%: "
          "█ full (mask_mod skipped), ░ partial (mask_mod runs), blank: never computed")
    print(text_picture(bm))
    token_picture = getattr(importlib.import_module("flexattn.variants"), "picture", None)
    if token_picture is not None and inst.mask_mod is not None and L <= 64:
        # Shorter than a block: one picture cell per token says more than a single block.
        print("token by token (# attends, - does not):")
        print(token_picture(inst.mask_mod, L, L))
    if inst.mask_mod is None:
        print("(no mask_mod: every block is full)")
    if inst.score_mod is not None or inst.sinks is not None:
        print("(its score_mod or attention sinks change the scores, not which blocks run)")
    if args.no_png:
        return 0
    _require("matplotlib", "show", "the PNG (pass --no-png for the text picture only)")
    path = Path(args.png) if args.png else Path(f"{variant.name}_{L}.png")
    write_png(path, f"{variant.name}: {variant.summary}", tokens, bm)
    print(f"wrote {path}")
    return 0


# ---------------------------------------------------------------------------------------- kernel


def _cmd_kernel(args, parser) -> int:
    from flexattn.cli.kernel_source import kernel_source

    variant = _catalogue()[args.name]
    if args.explain:
        return _explain(variant, args)
    kind = "backward" if args.backward else "decode" if args.decode else "forward"
    if kind == "decode" and not variant.decode:
        parser.error(f"argument --decode: variant '{variant.name}' has no decoding form (its Variant.decode is "
                     "False); drop --decode for its forward kernel")
    B, H, L = 1, args.heads, args.seq
    inst = variant.make(B, H, L, L, "cpu")
    source = kernel_source(inst.score_mod, inst.mask_mod, B, H, L, L, kind)
    print(f"# flexattn kernel {variant.name} ({kind}): {variant.summary}")
    print(f"# generated for B={B} H={H} Q_LEN=KV_LEN={L} (the lengths decide int32 or int64 index arithmetic)")
    if inst.sinks is not None:
        print("# attention sinks are folded into the output outside the kernel, through its log-sum-exp")
    print(source, end="" if source.endswith("\n") else "\n")
    return 0


def _explain(variant, args) -> int:
    import torch

    from flexattn.cli.kernel_source import explain

    device = "cuda" if torch.cuda.is_available() else "cpu"
    B, H, L = 1, args.heads, args.seq
    inst = variant.make(B, H, L, L, device)
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    print(f"# flexattn kernel {variant.name} --explain: B={B} H={H} Q_LEN=KV_LEN={L} D={args.head_dim} {args.dtype} "
          f"on {where} (torch {torch.__version__}, Triton {triton_version})")
    for stage, choice in explain(inst.score_mod, inst.mask_mod, B, H, L, L, args.head_dim, getattr(torch, args.dtype),
                                 device):
        print(f"{stage:9s} {choice}")
    return 0


# ---------------------------------------------------------------------------------------- bench

def _cmd_bench(args, parser) -> int:
    import torch

    from flexattn.bench import run_mode

    wants_help = {"-h", "--help"} & set(args.bench_args)  # the benchmark's own --help needs no GPU
    if not torch.cuda.is_available() and not wants_help:
        raise _CommandError(
            f"the benchmark (--mode {args.mode}) needs a CUDA GPU, and this machine has none "
            "(torch.cuda.is_available() is False); "
            "on a CPU, 'flexattn check' checks every variant and times the PyTorch backend", USAGE_ERROR)
    return run_mode(args.mode, args.bench_args)


# ---------------------------------------------------------------------------------------- list


def _cmd_list(args, parser) -> int:
    catalogue = _catalogue()
    width = max(len(name) for name in catalogue)
    for name, variant in catalogue.items():
        flags = [getattr(variant, "family", "")] + [flag for flag in ("paper", "decode") if getattr(variant, flag, False)]
        print(f"{name:<{width}}  {variant.summary}  [{', '.join(f for f in flags if f)}]")
    return 0


# ---------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    import flexattn

    parser = _Parser(prog="flexattn", description="Attention variants through flexattn: check, time, draw and read "
                     "them. 'flexattn COMMAND --help' describes each command.")
    parser.add_argument("--version", action="version", version=f"flexattn {flexattn.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)

    check = commands.add_parser(
        "check", help="every catalogue variant on this machine's device: errors vs float64, times, speed-ups",
        description="Runs every variant of flexattn.variants.CATALOGUE (forward and backward) on the local device "
        "with a progress bar, checks output and gradients against the float64 reference, times them (on a GPU also "
        "SDPA's flash kernel and torch's compiled flex_attention), prints a table and writes it as JSON and Markdown. "
        "Exits 1 if any variant's error exceeds its dtype's tolerance.")
    check.add_argument("--device", choices=("cpu", "cuda"), default=None,
                       help="default: cuda when there is a GPU, else cpu")
    check.add_argument("--seq", type=_seq_len, default=None, metavar="N",
                       help="sequence length (default: 1024 on a CPU, sized to finish in well under a minute; "
                            "4096 on a GPU)")
    check.add_argument("--only", type=_variant_names, default=None, metavar="NAME[,NAME]",
                       help="run these variants only ('flexattn list' names them)")
    check.add_argument("--out", default=None, metavar="PATH",
                       help="write PATH.json and PATH.md (default: check/check-DEVICE under flexattn's cache "
                            "directory; with --only, check/check-DEVICE-only-NAMES)")
    check.add_argument("--threads", type=_positive_int, default=1, metavar="N",
                       help="CPU threads for torch (default 1: timings stay steady on a shared machine)")
    check.add_argument("--no-torch-flex", action="store_true", help="GPU: skip torch's compiled flex_attention")
    check.set_defaults(run=_cmd_check)

    show = commands.add_parser("show", help="the variant's BlockMask as text, and a PNG of its mask and blocks",
                               description="Prints the BlockMask of a variant as text and writes a PNG: the "
                               "token-level mask next to the block map (full, partial and empty blocks).")
    show.add_argument("name", type=_variant_name, metavar="NAME", help="a catalogue variant ('flexattn list')")
    show.add_argument("--seq", type=_seq_len, default=1024, metavar="N", help="Q_LEN = KV_LEN (default 1024)")
    show.add_argument("--png", default=None, metavar="PATH", help="where to write the PNG (default: NAME_N.png here)")
    show.add_argument("--no-png", action="store_true", help="the text picture only")
    show.set_defaults(run=_cmd_show)

    kernel = commands.add_parser("kernel", help="the generated Triton source of a variant's kernels",
                                 description="Prints the Triton source flexattn generates for a variant (nothing "
                                 "is launched): the forward kernel by default.")
    kernel.add_argument("name", type=_variant_name, metavar="NAME", help="a catalogue variant ('flexattn list')")
    which = kernel.add_mutually_exclusive_group()
    which.add_argument("--backward", action="store_true", help="the backward kernels (dK/dV, dQ) instead")
    which.add_argument("--decode", action="store_true", help="the split-KV decoding kernels instead")
    which.add_argument("--explain", action="store_true",
                       help="which kernels a call takes on this machine (Gluon on Hopper, or the portable "
                       "Triton ones, and why), for --seq, --heads, --head-dim and --dtype")
    kernel.add_argument("--seq", type=_seq_len, default=1024, metavar="N", help="Q_LEN = KV_LEN (default 1024)")
    kernel.add_argument("--heads", type=_positive_int, default=4, metavar="H", help="query heads (default 4)")
    kernel.add_argument("--head-dim", type=_positive_int, default=128, metavar="D", help="--explain: head dim (default 128)")
    kernel.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                        help="--explain: the inputs' dtype (default bfloat16)")
    kernel.set_defaults(run=_cmd_kernel)

    bench = commands.add_parser(
        "bench", help="the paper benchmark on a CUDA GPU (forward; --mode bwd, decode, model, fp8, host)",
        description="Runs the FlexAttention paper's benchmark on a CUDA GPU, side by side with torch's compiled "
        "flex_attention and SDPA. Arguments after '--' go to the benchmark itself "
        "(e.g. flexattn bench --mode bwd -- --out bwd.json; '-- --help' lists them).")
    bench.add_argument("--mode", choices=tuple(BENCH_MODES), default="fwd",
                       help="fwd: forward (default); bwd: forward and backward; decode: one query token; "
                       "model: a GPT-style training step; fp8: FP8 forward and FP8-cache decoding; "
                       "host: warm calls' host time and the first call's time")
    bench.set_defaults(run=_cmd_bench)

    listing = commands.add_parser("list", help="the catalogue's variants with their one-line summaries",
                                  description="Lists flexattn.variants.CATALOGUE: name, summary, [family, flags].")
    listing.set_defaults(run=_cmd_list)
    parser.commands = {"check": check, "show": show, "kernel": kernel, "bench": bench, "list": listing}
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:  # the benchmark's own arguments
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if passthrough and args.command != "bench":
        parser.error(f"arguments after '--' are for 'flexattn bench' only, got {' '.join(passthrough)}")
    args.bench_args = passthrough
    sub = parser.commands[args.command]  # its errors name the command
    try:
        return args.run(args, sub)
    except _CommandError as err:
        print(f"flexattn {args.command}: error: {err}", file=sys.stderr)
        return err.code
    except KeyboardInterrupt:
        print(f"flexattn {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        from flexattn.errors import FlexAttentionError

        if not isinstance(err, FlexAttentionError):
            raise
        print(f"flexattn {args.command}: error: {type(err).__name__}: {err}", file=sys.stderr)
        return FAILED


if __name__ == "__main__":
    sys.exit(main())
