"""Where does an engine decode step go?  Per-step milliseconds by category, engine vs HF.

    python benchmarks/profile_engine_step.py --model smollm2 --batch-sizes 1,32
    python benchmarks/profile_engine_step.py --threads 1 --clock cpu      # on a shared machine
    python benchmarks/profile_engine_step.py --model tiny --batch-sizes 1,8 --steps 4

For each batch size B: B random prompts of `--prompt-len` tokens are prefilled, a few decode
steps warm up, then `--steps` decode steps of `EngineCore.step()` are
  1. timed plainly (ms/step),
  2. timed by phase (runner._build, model forward, sampler, scheduler + postprocess),
  3. timed op by op (`--ops profiler`: torch.profiler self CPU times, wall-based, light;
     `--ops dispatch`: a TorchDispatchMode that reads `--clock` around every aten op, robust
     to time-slicing but adding ~10-30 us per op, which inflates the many small ops),
  4. run under cProfile (Python functions by own time).
For comparison the Hugging Face model's decode forward (`model(next_ids, past_key_values=cache)`
in a loop: the per-token work of `generate`, without its logits processors) is timed plainly
and op by op.

Categories (ms/step):
  gemm         linear / mm / addmm / matmul / bmm: the projections and the LM head
  kv gather    index / index_select / embedding: for the engine, reading every request's whole
               context out of the paged pool in every layer (k_cache[kv_slots])
  kv write/cat index_put_ / index_copy_ / cat: the engine's pool writes and RoPE concat; HF's
               DynamicCache torch.cat (which copies the whole cache every step) and RoPE concat
  attention    scaled_dot_product_attention
  other ops    everything else (norms, RoPE arithmetic, SiLU, adds, argmax, views ...)
  host         plain step time minus the op times: Python (module calls, runner._build,
               scheduler, sampler, postprocess) and dispatcher overhead. Clamped at 0; the
               op timer adds a few microseconds per op, so treat it as an estimate.

`--clock cpu` (only with `--threads 1`) times by this process's CPU time, which other jobs
sharing the cores do not inflate; wall-clock timings on a busy machine can be off by 2-10x.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
for _p in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench_engine import EngineBench, model_folder, random_prompts  # noqa: E402
from common.engine.engine import EngineCore  # noqa: E402
from common.messages.sampling import SamplingParams  # noqa: E402
from common.messages.scheduler_input import GenerateRequest  # noqa: E402

CATEGORIES = ("gemm", "kv gather", "kv write/cat", "attention", "other ops", "host")
_GEMM = {"linear", "mm", "addmm", "matmul", "bmm", "baddbmm"}
_GATHER = {"index", "index_select", "gather", "embedding"}
_WRITE = {"index_put_", "_index_put_impl_", "index_copy_", "cat"}

clock = time.perf_counter


def category(op: str) -> str:
    if op in _GEMM:
        return "gemm"
    if op in _GATHER:
        return "kv gather"
    if op in _WRITE:
        return "kv write/cat"
    if "scaled_dot_product" in op:
        return "attention"
    return "other ops"


class OpTimer(TorchDispatchMode):
    """Accumulates `clock()` time and call counts per aten op (outermost dispatch only)."""

    def __init__(self):
        super().__init__()
        self.time: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t = clock()
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.time[name] += clock() - t
        self.calls[name] += 1
        return out


OP_TIMER = "profiler"


def _profiler_times(run_steps) -> tuple[dict[str, float], dict[str, int]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_steps()
    times, calls = {}, {}
    for evt in prof.key_averages():
        if not evt.key.startswith("aten::"):
            continue
        name = evt.key[len("aten::"):]
        times[name] = evt.self_cpu_time_total / 1e6
        calls[name] = evt.count
    # Self times: a composite op (linear) keeps only its own overhead, its mm counts as gemm.
    return times, calls


def op_report(run_steps, steps: int, step_ms: float, top: int):
    if OP_TIMER == "dispatch":
        timer = OpTimer()
        with timer:
            run_steps()
        times, calls = timer.time, timer.calls
    else:
        times, calls = _profiler_times(run_steps)
    cats = defaultdict(float)
    for name, t in times.items():
        cats[category(name)] += t * 1e3 / steps
    cats["host"] = max(step_ms - sum(cats.values()), 0.0)
    ops = sorted(times.items(), key=lambda kv: -kv[1])[:top]
    ops = [(name, t * 1e3 / steps, calls[name] // steps) for name, t in ops]
    return {k: cats[k] for k in CATEGORIES}, ops


def cprofile_top(fn, n: int) -> str:
    pr = cProfile.Profile(clock)
    pr.enable()
    fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(n)
    lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
    return "\n".join(lines[start:start + n + 1])


def timed_steps(step, steps: int) -> float:
    t0 = clock()
    for _ in range(steps):
        step()
    return (clock() - t0) * 1e3 / steps


# ------------------------------------------------------------------------------- engine side


def engine_ready(bench: EngineBench, prompts: torch.Tensor, new_tokens: int) -> EngineCore:
    """An engine whose B requests are prefilled (each holds its first token)."""
    engine = EngineCore(bench.args, bench.loaded, tokenizer=None)
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts.tolist()):
        engine.add(GenerateRequest(rid=f"p{i}", input_ids=ids, sampling=sampling))
    reqs = list(engine.reqs.values())
    while not all(r.output_ids for r in reqs):
        engine.step()
    return engine


def profile_engine(bench: EngineBench, prompts: torch.Tensor, steps: int, warm: int, top: int):
    engine = engine_ready(bench, prompts, warm + 4 * steps + 4)
    for _ in range(warm):
        engine.step()
    step_ms = timed_steps(engine.step, steps)

    phases: dict[str, float] = defaultdict(float)
    runner, sampler = engine.runner, engine.sampler

    def timed(name, fn):
        def wrapper(*a, **k):
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                phases[name] += clock() - t
        return wrapper

    # Instance attributes shadow the methods / module for the phase run only.
    runner._build = timed("runner._build", runner._build)
    runner.model = timed("model forward", runner.model)
    sampler.sample = timed("sampler", sampler.sample)
    total = timed_steps(engine.step, steps)
    del runner._build, sampler.sample
    runner.model = bench.loaded.model
    phase_ms = {k: v * 1e3 / steps for k, v in phases.items()}
    phase_ms["scheduler + postprocess"] = max(total - sum(phase_ms.values()), 0.0)

    def run():
        for _ in range(steps):
            engine.step()

    cats, ops = op_report(run, steps, step_ms, top)
    py = cprofile_top(run, top)
    while engine.has_work():
        engine.step()
    return step_ms, phase_ms, cats, ops, py


# ----------------------------------------------------------------------------------- HF side


def profile_hf(model, prompts: torch.Tensor, steps: int, warm: int, top: int):
    from transformers import DynamicCache

    batch, prompt_len = prompts.shape
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=prompts, past_key_values=cache, use_cache=True, logits_to_keep=1)
        state = {
            "next": out.logits[:, -1].argmax(-1, keepdim=True),
            "mask": torch.ones(batch, prompt_len + 1, dtype=torch.long),
        }

        def step():
            o = model(input_ids=state["next"], past_key_values=cache, attention_mask=state["mask"],
                      use_cache=True, logits_to_keep=1)
            state["next"] = o.logits[:, -1].argmax(-1, keepdim=True)
            state["mask"] = torch.cat([state["mask"], state["mask"].new_ones(batch, 1)], dim=1)

        def run():
            for _ in range(steps):
                step()

        for _ in range(warm):
            step()
        step_ms = timed_steps(step, steps)
        cats, ops = op_report(run, steps, step_ms, top)
    return step_ms, cats, ops


def fmt(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in d.items())


def main(argv: list[str] | None = None) -> None:
    global clock, OP_TIMER
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", choices=("tiny", "smollm2"))
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=8, help="decode steps per measurement")
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--ops", choices=("profiler", "dispatch"), default=None,
                   help="op timer (default: profiler with the wall clock, dispatch with cpu)")
    p.add_argument("--no-hf", action="store_true")
    ns = p.parse_args(argv)
    if ns.clock == "cpu" and ns.threads != 1:
        p.error("--clock cpu needs --threads 1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    clock = time.process_time if ns.clock == "cpu" else time.perf_counter
    OP_TIMER = ns.ops or ("dispatch" if ns.clock == "cpu" else "profiler")
    batches = [int(b) for b in ns.batch_sizes.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        path = model_folder(ns.model, Path(tmp))
        max_seq = ns.prompt_len + ns.warm + 4 * ns.steps + 8
        bench = EngineBench(path, max(batches), max_seq, 512)
        hf = None
        if not ns.no_hf:
            import transformers
            from transformers import AutoModelForCausalLM

            transformers.utils.logging.disable_progress_bar()
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train(False)
        print(f"# {ns.model}, prompt {ns.prompt_len}, torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, {ns.clock} clock, {OP_TIMER} op timer, "
              f"{ns.steps} decode steps "
              "per measurement; all numbers ms per decode step")
        for b in batches:
            prompts = random_prompts(b, ns.prompt_len, bench.vocab, seed=b)
            step_ms, phase_ms, cats, ops, py = profile_engine(bench, prompts, ns.steps, ns.warm,
                                                              ns.top)
            print(f"\n## batch {b}: engine decode step {step_ms:.1f} ms "
                  f"({b * 1e3 / step_ms:.1f} tok/s)")
            print(f"phases: {fmt(phase_ms)}")
            print(f"by category: {fmt(cats)}")
            print("top ops (ms/step, calls/step):")
            for name, ms, calls in ops:
                print(f"  {ms:8.2f}  {calls:5d}  {name}")
            print("cProfile, by own time over the steps:")
            print(py)
            if hf is not None:
                hf_ms, hf_cats, hf_ops = profile_hf(hf, prompts, ns.steps, ns.warm, ns.top)
                print(f"\n## batch {b}: HF decode forward {hf_ms:.1f} ms "
                      f"({b * 1e3 / hf_ms:.1f} tok/s)")
                print(f"by category: {fmt(hf_cats)}")
                print("top ops (ms/step, calls/step):")
                for name, ms, calls in hf_ops:
                    print(f"  {ms:8.2f}  {calls:5d}  {name}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
