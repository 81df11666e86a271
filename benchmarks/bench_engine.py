"""Engine vs Hugging Face `generate`: prefill and decode throughput on CPU, fp32, greedy.

    python benchmarks/bench_engine.py                       # tiny + smollm2, batch 1, 8, 32
    python benchmarks/bench_engine.py --models smollm2 --batch-sizes 1,32
    python benchmarks/bench_engine.py --quick               # tiny model only, ~10-20 s
    python benchmarks/bench_engine.py --threads 1 --clock cpu   # on a machine shared with others

For every (model, batch size B) both sides get the same B prompts of `--prompt-len` random token
ids (equal lengths, so Hugging Face needs no padding) and generate exactly `--new-tokens` tokens
each (greedy; the engine with `ignore_eos`, HF with `min_new_tokens == max_new_tokens`).

* Engine (`EngineCore`, in process, no sockets): prefill time is the time of the first
  `step()` calls until every request holds its first token (with the default
  `--chunked-prefill-size 512` a batch of 32 x 128-token prompts takes 8 extend steps); decode
  time is the rest, until the last request finishes. Prefill tok/s = B * prompt_len / prefill
  time; decode tok/s = B * (new_tokens - 1) / decode time.
* Hugging Face (`AutoModelForCausalLM.generate` on the same folder, batched): prefill time is
  a `max_new_tokens=1` call; decode tok/s = B * (new_tokens - 1) / (full time - prefill time).

Each side runs one untimed warm-up of the same batch and prompts first (4 new tokens), then
`--repeats` timed runs; the best prefill and the best decode time are reported (least disturbed
by the rest of the machine). The "same" column counts
requests whose engine tokens equal HF's exactly (a sanity check that both did the same work;
fp32 rounding can flip a near-tie now and then).

The default full run keeps the per-row work bounded on a 2-core machine: a row generates
min(new_tokens, max_decode_tokens // B) tokens per request (`--max-decode-tokens`, default
2048: batch 32 keeps the default 64 new tokens, `--new-tokens 128` would give it 64); the
table shows the number used per row.

CPU throughput collapses when other processes compete for the cores (OpenMP threads wait for
each other; 2-10x swings were seen), so the header prints the load average before and after
the run and warns when the machine was busy. On a shared machine use `--threads 1 --clock cpu`:
times are then this process's CPU time, which time-slicing with other jobs does not inflate
(memory-bandwidth contention still does, a little). `main(argv)` returns the rows, so tests
can run it in process.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
for _p in (REPO_ROOT, REPO_ROOT / "tests"):  # `common` and `tiny_models` without installing
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

from benchmarks.machine import cpu_model  # noqa: E402

from common.config import ServerArgs  # noqa: E402
from common.engine.engine import EngineCore  # noqa: E402
from common.engine.loader import load_engine_parts  # noqa: E402
from common.messages.sampling import SamplingParams  # noqa: E402
from common.messages.scheduler_input import GenerateRequest  # noqa: E402

MODELS = ("tiny", "smollm2")
# The timer: wall time, or (`--clock cpu`, single-threaded runs only) this process's CPU time,
# which other processes time-slicing the same cores do not inflate.
clock = time.perf_counter


@dataclass
class Timing:
    prefill_s: float
    decode_s: float
    outputs: list[list[int]]


@dataclass
class Row:
    model: str
    batch: int
    prompt_len: int
    new_tokens: int
    engine: Timing
    hf: Timing | None

    @property
    def prefill_tokens(self) -> int:
        return self.batch * self.prompt_len

    @property
    def decode_tokens(self) -> int:
        return self.batch * (self.new_tokens - 1)

    def same_outputs(self) -> int | None:
        if self.hf is None:
            return None
        return sum(a == b for a, b in zip(self.engine.outputs, self.hf.outputs))


# ------------------------------------------------------------------------------------ helpers


def model_folder(name: str, workdir: Path) -> Path:
    if name == "tiny":
        from tiny_models import build_tiny_checkpoint

        return build_tiny_checkpoint(workdir / "tiny-llama", "llama")
    if name == "smollm2":
        from common.model_store.default_model import ensure_default_model

        return ensure_default_model()
    raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")


def random_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Skip the first few ids: the special tokens of both models live there.
    return torch.randint(16, vocab, (batch, prompt_len), generator=g)


# ------------------------------------------------------------------------------------- engine


class EngineBench:
    def __init__(self, path: Path, max_batch: int, max_seq: int, chunked_prefill_size: int):
        page_size = 16
        # Room for every sequence plus a page of headroom each (the scheduler keeps one free
        # page per running request when admitting).
        pages = max_batch * (-(-max_seq // page_size) + 2)
        self.args = ServerArgs(
            model_path=str(path),
            device="cpu",
            dtype="float32",
            page_size=page_size,
            max_total_tokens=pages * page_size,
            max_running_requests=max(max_batch, 1),
            chunked_prefill_size=chunked_prefill_size,
        )
        self.loaded = load_engine_parts(self.args, str(path))
        self.vocab = self.loaded.config.vocab_size
        self.runs = 0

    def run(self, prompts: torch.Tensor, new_tokens: int) -> Timing:
        engine = EngineCore(self.args, self.loaded, tokenizer=None)
        sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        self.runs += 1
        rids = [f"r{self.runs}-{i}" for i in range(prompts.shape[0])]
        for rid, ids in zip(rids, prompts.tolist()):
            engine.add(GenerateRequest(rid=rid, input_ids=ids, sampling=sampling))
        reqs = [engine.reqs[rid] for rid in rids]
        done: dict[str, list[int]] = {}

        def collect(deltas) -> None:
            for d in deltas:
                if d.finished:
                    done[d.rid] = list(reqs[rids.index(d.rid)].output_ids)
                    if d.finish_reason is None or d.finish_reason.type != "length":
                        raise RuntimeError(f"{d.rid} finished early: {d.finish_reason}")

        t0 = clock()
        while not all(r.output_ids for r in reqs):
            collect(engine.step())
        t1 = clock()
        while engine.has_work():
            collect(engine.step())
        t2 = clock()
        outputs = [done[rid] for rid in rids]
        if any(len(o) != new_tokens for o in outputs):
            raise RuntimeError("the engine did not generate exactly new_tokens per request")
        pool = self.loaded.pool.allocator
        assert pool.num_free_pages == pool.num_total_pages, "KV pages leaked"
        return Timing(t1 - t0, t2 - t1, outputs)


# -------------------------------------------------------------------------------- huggingface


class HFBench:
    def __init__(self, path: Path):
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train(False)
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.model.config.eos_token_id
        if isinstance(eos, list):
            eos = eos[0]
        self.pad = gen.pad_token_id if gen.pad_token_id is not None else (eos or 0)

    def _generate(self, prompts: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor]:
        t0 = clock()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=prompts,
                attention_mask=torch.ones_like(prompts),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=self.pad,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        return clock() - t0, out

    def run(self, prompts: torch.Tensor, new_tokens: int) -> Timing:
        prefill_s, _ = self._generate(prompts, 1)
        full_s, out = self._generate(prompts, new_tokens)
        outputs = out[:, prompts.shape[1]:].tolist()
        if any(len(o) != new_tokens for o in outputs):
            raise RuntimeError("HF did not generate exactly new_tokens per request")
        return Timing(prefill_s, max(full_s - prefill_s, 1e-9), outputs)


def best(runs: list[Timing]) -> Timing:
    """Fastest prefill and fastest decode over the timed runs (outputs of the last)."""
    return Timing(min(r.prefill_s for r in runs), min(r.decode_s for r in runs), runs[-1].outputs)


# --------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,smollm2", help=f"comma list of {MODELS}")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-decode-tokens", type=int, default=2048,
                   help="cap on batch * new_tokens per row (the row then uses fewer new tokens)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per side (best is kept)")
    p.add_argument("--chunked-prefill-size", type=int, default=ServerArgs().chunked_prefill_size)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: time by this process's CPU time (needs --threads 1); robust "
                   "on a machine shared with other jobs")
    p.add_argument("--no-hf", action="store_true", help="engine only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="tiny model, batch 1 and 8, 32-token prompts, 16 new tokens")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.models, ns.batch_sizes, ns.prompt_len, ns.new_tokens = "tiny", "1,8", 32, 16
    ns.models = [m.strip() for m in ns.models.split(",") if m.strip()]
    ns.batch_sizes = [int(b) for b in ns.batch_sizes.split(",") if b.strip()]
    for m in ns.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; expected one of {MODELS}")
    if ns.clock == "cpu" and ns.threads != 1:
        p.error("--clock cpu needs --threads 1 (extra threads' spin-waits count as CPU time)")
    if ns.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (decode needs tokens after the first)")
    return ns


def new_tokens_for(batch: int, ns: argparse.Namespace) -> int:
    return max(2, min(ns.new_tokens, ns.max_decode_tokens // batch))


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def header(ns: argparse.Namespace, load_before: str) -> str:
    import transformers

    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    lines = [
        f"# bench_engine  {now}",
        f"# torch {torch.__version__}, transformers {transformers.__version__}, "
        f"python {platform.python_version()}",
        f"# CPU: {cpu_model()} ({os.cpu_count()} logical cores), "
        f"torch threads {torch.get_num_threads()}, dtype float32, greedy, "
        f"{'process CPU time' if ns.clock == 'cpu' else 'wall-clock'} timing",
        f"# prompt {ns.prompt_len} random tokens, up to {ns.new_tokens} new tokens "
        f"(batch x new <= {ns.max_decode_tokens}), engine chunked prefill "
        f"{ns.chunked_prefill_size}, best of {ns.repeats} after a warm-up",
        f"# load average (1/5/15 min): {load_before} before, {load_average()} after",
    ]
    return "\n".join(lines)


def format_table(rows: list[Row]) -> str:
    def rate(tokens: int, seconds: float) -> float:
        return tokens / seconds

    def ratio(a: float, b: float | None) -> str:
        return "-" if b is None else f"{a / b:.2f}x"

    out = [
        "| model | batch | prompt | new | engine prefill tok/s | HF prefill tok/s | prefill "
        "engine/HF | engine decode tok/s | HF decode tok/s | decode engine/HF | same |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ep = rate(r.prefill_tokens, r.engine.prefill_s)
        ed = rate(r.decode_tokens, r.engine.decode_s)
        hp = rate(r.prefill_tokens, r.hf.prefill_s) if r.hf else None
        hd = rate(r.decode_tokens, r.hf.decode_s) if r.hf else None
        same = r.same_outputs()
        out.append(
            f"| {r.model} | {r.batch} | {r.prompt_len} | {r.new_tokens} | {ep:.1f} | "
            f"{'-' if hp is None else f'{hp:.1f}'} | {ratio(ep, hp)} | {ed:.1f} | "
            f"{'-' if hd is None else f'{hd:.1f}'} | {ratio(ed, hd)} | "
            f"{'-' if same is None else f'{same}/{r.batch}'} |"
        )
    return "\n".join(out)


def run_model(name: str, path: Path, ns: argparse.Namespace, log) -> list[Row]:
    max_batch = max(ns.batch_sizes)
    engine = EngineBench(path, max_batch, ns.prompt_len + ns.new_tokens, ns.chunked_prefill_size)
    hf = None if ns.no_hf else HFBench(path)
    rows = []
    for batch in ns.batch_sizes:
        new = new_tokens_for(batch, ns)
        prompts = random_prompts(batch, ns.prompt_len, engine.vocab, ns.seed + batch)
        warm_new = min(new, 4)
        t0 = time.perf_counter()
        engine.run(prompts, warm_new)
        e = best([engine.run(prompts, new) for _ in range(ns.repeats)])
        h = None
        if hf is not None:
            hf.run(prompts, warm_new)
            h = best([hf.run(prompts, new) for _ in range(ns.repeats)])
        rows.append(Row(name, batch, ns.prompt_len, new, e, h))
        log(f"{name} batch {batch}: {time.perf_counter() - t0:.1f} s")
        gc.collect()
    return rows


def main(argv: list[str] | None = None) -> list[Row]:
    global clock
    ns = parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    clock = time.process_time if ns.clock == "cpu" else time.perf_counter

    def log(msg: str) -> None:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)

    start = time.perf_counter()
    load_before = load_average()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        for name in ns.models:
            path = model_folder(name, Path(tmp))
            log(f"{name}: {path}")
            rows.extend(run_model(name, path, ns, log))
            gc.collect()
    print(header(ns, load_before))
    busy = max(float(load_before.split()[0]), os.getloadavg()[0] - 1) if load_before != "n/a" else 0
    if ns.clock == "wall" and busy > 0.5:
        print("# WARNING: other processes were using the CPU; wall-clock numbers are unreliable "
              "on a shared machine (rerun with --threads 1 --clock cpu)")
    print()
    print(format_table(rows))
    print()
    print(f"# total {time.perf_counter() - start:.0f} s")
    return rows


if __name__ == "__main__":
    main()
