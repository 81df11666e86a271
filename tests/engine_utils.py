"""Drive an in-process EngineCore the way the scheduler process does, for tests.

`EngineHarness` records every token and, per request, the logits row that produced each
sampled token, so tests can compare them with Hugging Face's forward pass.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from common.config import ServerArgs
from common.engine.engine import EngineCore
from common.engine.loader import load_engine_parts
from common.engine.tokenizer import Tokenizer
from common.messages.sampling import SamplingParams
from common.messages.scheduler_input import GenerateRequest


def greedy(max_new_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, **kw)


class EngineHarness:
    def __init__(self, model_dir: str | Path, **server_args):
        server_args.setdefault("max_total_tokens", 4096)
        server_args.setdefault("device", "cpu")
        self.args = ServerArgs(model_path=str(model_dir), **server_args)
        self.engine = EngineCore(
            self.args, load_engine_parts(self.args, str(model_dir)),
            Tokenizer.from_model_path(model_dir),
        )
        self.outputs: dict[str, list[int]] = defaultdict(list)
        self.finish: dict[str, object] = {}
        self.deltas: dict[str, list] = defaultdict(list)
        self.logits: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._capture_logits()

    def _capture_logits(self) -> None:
        runner = self.engine.runner
        original = runner.forward

        def forward(segments):
            logits, where = original(segments)
            for seg, loc in zip(segments, where):
                if loc is not None and seg.completes_fill:
                    self.logits[seg.req.rid].append(logits[loc.first + loc.count - 1].clone())
            return logits, where

        runner.forward = forward

    def add(self, rid: str, input_ids: list[int], sampling: SamplingParams, **kw) -> None:
        self._collect(self.engine.add(
            GenerateRequest(rid=rid, input_ids=input_ids, sampling=sampling, **kw)
        ))

    def abort(self, rid: str) -> None:
        self._collect(self.engine.abort(rid))

    def step(self) -> None:
        self._collect(self.engine.step())

    def run(self, max_steps: int = 10_000, on_step=None) -> None:
        steps = 0
        while self.engine.has_work():
            self.step()
            steps += 1
            if on_step is not None:
                on_step(steps)
            assert steps < max_steps, "engine did not finish"

    def _collect(self, deltas) -> None:
        for d in deltas:
            self.outputs[d.rid].extend(d.new_ids)
            self.deltas[d.rid].append(d)
            if d.finished:
                self.finish[d.rid] = d.finish_reason

    @property
    def pool_whole(self) -> bool:
        alloc = self.engine.pool.allocator
        return alloc.num_free_pages == alloc.num_total_pages
