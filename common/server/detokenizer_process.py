"""The detokenizer process: token ids in, text deltas out.

    PULL detokenizer_input (TokenBatch | control replies)
      -> per request: IncrementalDetokenizer -> stop-string trimming and hold-back
    PUSH frontend_input    (TextBatch | control replies, passed through)

Per-request state lives from a request's first delta to its finished delta. Text that could
still turn out to be the start of a stop string is held back until it cannot; when a stop
string ends the request, the text is cut where it begins (unless `no_stop_trim`).
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import zmq

from common.config import ServerArgs
from common.engine.detokenizer import IncrementalDetokenizer, find_stop_string, hold_back_len
from common.engine.tokenizer import Tokenizer
from common.messages import detokenizer_input, frontend_input, launch
from common.messages.detokenizer_input import TokenDelta
from common.messages.frontend_input import TextDelta
from common.server.ipc import IpcPaths
from common.server.topology import Topology
from common.server.process_utils import configure_logging, die_with_parent, report

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    decoder: IncrementalDetokenizer
    text: str = ""
    emitted: int = 0  # characters of `text` already sent
    stopped_at: int | None = None


class Detokenizer:
    """The in-process core: turns TokenDeltas into TextDeltas."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.streams: dict[str, _Stream] = {}

    def process(self, delta: TokenDelta) -> TextDelta:
        stream = self.streams.get(delta.rid)
        if stream is None:
            stream = self.streams[delta.rid] = _Stream(
                IncrementalDetokenizer(self.tokenizer, delta.skip_special_tokens)
            )
        checked = len(stream.text)
        stream.text += stream.decoder.push(delta.new_ids)
        if delta.finished:
            stream.text += stream.decoder.flush()
            del self.streams[delta.rid]
        end = len(stream.text)
        if delta.stop and not delta.no_stop_trim:
            cut = find_stop_string(stream.text, delta.stop, checked)
            if cut is not None:
                end = max(cut, stream.emitted)
            elif not delta.finished:
                end -= hold_back_len(stream.text, delta.stop)
        text = stream.text[stream.emitted : end] if end > stream.emitted else ""
        stream.emitted = max(stream.emitted, end)
        return TextDelta(
            rid=delta.rid,
            text=text,
            new_ids=delta.new_ids,
            prompt_tokens=delta.prompt_tokens,
            completion_tokens=delta.completion_tokens,
            finished=delta.finished,
            finish_reason=delta.finish_reason,
            output_logprobs=delta.output_logprobs,
            output_top_logprobs=delta.output_top_logprobs,
            input_logprobs=delta.input_logprobs,
            input_top_logprobs=delta.input_top_logprobs,
            input_logprob_start=delta.input_logprob_start,
            dp_rank=delta.dp_rank,
        )


def run_detokenizer_process(
    args: ServerArgs, model_path: str, ipc: IpcPaths, ready: Connection
) -> None:
    die_with_parent()
    configure_logging(args.log_level, "detokenizer")
    try:
        core = Detokenizer(Tokenizer.from_model_path(model_path))
        ctx = zmq.Context()
        recv = ctx.socket(zmq.PULL)
        recv.bind(ipc.detokenizer_input)
        topo = Topology.from_args(args)
        if topo.multi_node:
            recv.bind(topo.detokenizer_tcp)  # schedulers of the other nodes
        send = ctx.socket(zmq.PUSH)
        send.connect(ipc.frontend_input)
    except Exception as exc:
        report(ready, launch.StartupFailed(name="detokenizer", error=f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    report(ready, launch.ProcessReady(name="detokenizer"))
    try:
        while True:
            msg = detokenizer_input.decoder.decode(recv.recv())
            if isinstance(msg, detokenizer_input.TokenBatch):
                out = frontend_input.TextBatch(deltas=[core.process(d) for d in msg.deltas])
                send.send(frontend_input.encoder.encode(out))
            else:
                send.send(frontend_input.encoder.encode(msg))
    except Exception:
        logger.critical("detokenizer crashed:\n%s", traceback.format_exc())
        raise SystemExit(1) from None
