"""Where a compiled model step's time goes: kernel time by name, GPU idle time between kernels, and
the host's own cost of one block. GPU only; one implementation and mode per run.

    python -m benchmarks.model_profile --impl flexattn --mode compile --seq 4k
    python -m benchmarks.model_profile --impl torch --mode reduce-overhead
    python -m benchmarks.model_profile --impl sdpa --seq 16k --timeline

The model, shapes and modes are those of ``python -m flexattn.bench --mode model`` (flexattn/bench/model.py),
causal mask. It prints:

* the unprofiled step time (steps back to back, waited on at the end);
* from ``torch.profiler`` (CUDA activity only, so the host is not slowed): the span of a step, the
  sum of its kernels' times, the GPU's idle time between kernels, the largest gaps (the kernels on
  either side) and the kernels that take the most time;
* in compile mode, the host time of one compiled block's forward (grad mode and no_grad), measured
  while the GPU is kept busy by a long sleep kernel: the host's own cost, which the GPU waits for
  whenever it exceeds the GPU time of the work it launches (a step then is host-bound).

With ``--timeline`` it prints instead where an unprofiled step's time goes, phase by phase (the
blocks' forwards, the head and loss, the blocks' backwards, the optimizer), from CUDA events recorded
at each block's forward and at each gradient reaching a block's output: the GPU time of each phase in
steps run back to back, against the same step run behind a long sleep kernel (the host far ahead, and
the GPU rested), and the host time of each phase. A phase longer back to back than behind the sleep
either waited for the host or ran at lower clocks; the host column and the SM clock (NVML, where
torch can read it) tell which. On the H200 a sustained step runs at its 700 W power cap, so kernels
that spend more energy per unit of work also run at lower clocks (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

import torch

from flexattn.bench import model as M

SLEEP_CYCLES = 400_000_000  # about 0.2 s of GPU time: longer than the host calls timed behind it


def _no_marks(name: str) -> None:
    pass


def _step_fn(impl: str, mode: str, seq: str, device, marks=_no_marks):
    """The model and one training step of it; ``marks(name)`` is called at the step's phases (the
    timeline's CUDA events)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    batch, length = M.SHAPES[seq]
    model = M.GPT(32768, 768, 12, 12, M.attention_for(impl, "compile", "causal", batch, length, device))
    model = model.to(device, torch.bfloat16)
    options = dict(fullgraph=True, **({"mode": "reduce-overhead"} if mode == "reduce-overhead" else {}))
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, 32768, (batch, length), device=device)

    def step():
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        logits = model(tokens)
        marks("head")
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        marks("backward start")
        loss.backward()
        marks("backward end")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        marks("end")

    return model, step, batch, length


def _kernel_report(step, steps: int = 3, top: int = 12) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        print("no CUDA kernels were recorded")
        return
    by_name, count = collections.Counter(), collections.Counter()
    for start, end, name in spans:
        by_name[name] += end - start
        count[name] += 1
    gaps, gap_count = collections.Counter(), collections.Counter()
    idle, last_end, last_name = 0.0, spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > last_end:
            key = f"{last_name[:50]} -> {name[:50]}"
            gaps[key] += start - last_end
            gap_count[key] += 1
            idle += start - last_end
        if end > last_end:
            last_end, last_name = end, name
    span = spans[-1][1] - spans[0][0]
    print(f"per step: span {span / steps / 1e3:.2f} ms, kernels {sum(by_name.values()) / steps / 1e3:.2f} ms, "
          f"GPU idle {idle / steps / 1e3:.2f} ms, {len(spans) / steps:.0f} kernels")
    for key, t in gaps.most_common(8):
        print(f"  gap {t / steps:8.1f} us x{gap_count[key] // steps:3d}  {key}")
    for name, t in by_name.most_common(top):
        print(f"  {t / steps / 1e3:8.3f} ms x{count[name] // steps:4d}  {name[:100]}")


class _Marks:
    """CUDA events and host times at named points of a step, in the order they happen."""

    def __init__(self):
        self.points = None  # [(name, event, host time)] while a step is recorded

    def __call__(self, name: str) -> None:
        if self.points is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points.append((name, event, time.perf_counter()))


def _marked(model, marks: _Marks) -> None:
    """Hooks that mark each block's forward and each gradient reaching a block's output."""
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda mod, args, i=i: marks(f"forward {i}"))

        def grad_mark(mod, args, out, i=i):
            if out.requires_grad:
                out.register_hook(lambda grad: marks(f"backward {i}"))

        block.register_forward_hook(grad_mark)


_PHASES = (("forward", "forward 0", "head"), ("head and loss", "head", "backward start"),
           ("backward", "backward start", "backward end"), ("optimizer", "backward end", "end"))


def _timeline(impl: str, mode: str, seq: str, device, rounds: int = 3) -> None:
    marks = _Marks()
    model, step, batch, length = _step_fn(impl, mode, seq, device, marks)
    _marked(model, marks)

    for _ in range(6):
        step()
    torch.cuda.synchronize()
    steps = {"back to back": [], "behind a sleep": []}
    clocks = []
    for _ in range(rounds):
        for kind in steps:
            torch.cuda.synchronize()
            recorded = []
            for _ in range(4):
                if kind == "behind a sleep":
                    torch.cuda.synchronize()
                    torch.cuda._sleep(SLEEP_CYCLES)
                marks.points = []
                step()
                recorded.append(marks.points)
                marks.points = None
            torch.cuda.synchronize()
            if kind == "back to back":
                try:
                    clocks.append(torch.cuda.clock_rate(device))
                except Exception:  # noqa: BLE001 - NVML not available: no clock column
                    pass
            steps[kind] += [{name: (event, host) for name, event, host in points} for points in recorded]

    def phase_times(points, first, last):
        (e0, h0), (e1, h1) = points[first], points[last]
        return e0.elapsed_time(e1), (h1 - h0) * 1e3

    print(f"{impl}, {mode}, {batch} x {length} tokens, {torch.cuda.get_device_name()}: median ms of "
          f"{len(steps['back to back'])} steps" + (f"; SM clock after back-to-back steps {min(clocks)}-{max(clocks)} MHz"
                                                   if clocks else ""))
    print(f"  {'phase':16s} {'GPU, back to back':>18s} {'GPU, behind a sleep':>20s} {'host':>8s}")
    total = [0.0, 0.0, 0.0]
    for name, first, last in _PHASES:
        row = []
        for kind in steps:
            row.append(statistics.median(phase_times(p, first, last)[0] for p in steps[kind]))
        row.append(statistics.median(phase_times(p, first, last)[1] for p in steps["back to back"]))
        total = [t + r for t, r in zip(total, row)]
        print(f"  {name:16s} {row[0]:18.2f} {row[1]:20.2f} {row[2]:8.2f}")
    print(f"  {'step':16s} {total[0]:18.2f} {total[1]:20.2f} {total[2]:8.2f}")
    block = len(model.blocks) - 2  # one inside the backward: from its output's gradient to its input's
    one = [statistics.median(phase_times(p, f"backward {block}", f"backward {block - 1}")[0] for p in steps[kind])
           for kind in steps]
    print(f"  block {block}'s backward: {one[0]:.3f} ms back to back, {one[1]:.3f} behind a sleep")


def _host_us(fn, calls: int) -> float:
    """Host time per call of ``fn`` while the GPU is busy: never waited on."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return host * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.model_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=M.IMPLS, default="flexattn")
    parser.add_argument("--mode", choices=("compile", "reduce-overhead"), default="compile")
    parser.add_argument("--seq", choices=tuple(M.SHAPES), default="4k")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--timeline", action="store_true",
                        help="phase by phase: GPU time back to back and behind a sleep, host time")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the model profile needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    if args.timeline:
        _timeline(args.impl, args.mode, args.seq, device)
        return 0
    model, step, batch, length = _step_fn(args.impl, args.mode, args.seq, device)
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    print(f"{args.impl}, {args.mode}, {batch} x {length} tokens, {torch.cuda.get_device_name()}: "
          f"step {(time.perf_counter() - start) / 10 * 1e3:.2f} ms unprofiled")
    _kernel_report(step)
    if args.mode == "compile":
        block = model.blocks[0]
        x = torch.randn(batch, length, 768, device=device, dtype=torch.bfloat16, requires_grad=True)
        print(f"host: one block's forward {_host_us(lambda: block(x), 20):.0f} us (grad mode)")
        with torch.no_grad():
            print(f"host: one block's forward {_host_us(lambda: block(x), 20):.0f} us (no_grad)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
