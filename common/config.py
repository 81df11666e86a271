"""Server arguments: one frozen dataclass, its command-line flags, and start-up validation.

Every flag has one field of the same name (dashes become underscores). Values that depend on
the model or the machine (context length, KV capacity, dtype) are resolved by the scheduler at
start-up and reported back; `GET /get_server_info` shows both the arguments and those values.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("auto", "tcp", "torch", "fake")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_BALANCE_METHODS = (
    "auto", "round_robin", "follow_bootstrap_room", "total_requests", "total_tokens",
)


class ConfigError(ValueError):
    """A flag has a value we cannot run with; the message names the flag."""


@dataclass(frozen=True, slots=True)
class ServerArgs:
    model_path: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "auto"
    dtype: str = "auto"
    page_size: int = 16
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    max_running_requests: int = 64
    chunked_prefill_size: int = 512
    context_length: int | None = None
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "auto"
    disaggregation_bootstrap_timeout: float = 300.0
    disaggregation_waiting_timeout: float = 300.0
    disaggregation_transfer_timeout: float = 300.0
    disaggregation_heartbeat_interval: float = 2.0
    dp_size: int = 1
    max_ep_size: int | None = None
    load_balance_method: str = "auto"
    load_refresh_interval: float = 0.02
    load_publish_steps: int = 8
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    remote_rank_timeout: float = 30.0
    random_seed: int = 0
    graceful_shutdown_timeout: float = 30.0
    log_level: str = "info"
    torch_num_threads: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.port, 0 <= self.port < 65536, "--port must be in [0, 65535]"),
            (self.device, self.device in ("auto", "cpu", "cuda") or self.device.startswith(
                "cuda:"), "--device must be auto, cpu, cuda or cuda:N"),
            (self.dtype, self.dtype in DTYPES, f"--dtype must be one of {DTYPES}"),
            (self.page_size, self.page_size >= 1, "--page-size must be >= 1"),
            (self.max_total_tokens, self.max_total_tokens is None or self.max_total_tokens >= 1,
             "--max-total-tokens must be >= 1"),
            (self.mem_fraction_static, self.mem_fraction_static is None
             or 0 < self.mem_fraction_static < 1, "--mem-fraction-static must be in (0, 1)"),
            (self.max_running_requests, self.max_running_requests >= 1,
             "--max-running-requests must be >= 1"),
            (self.chunked_prefill_size, self.chunked_prefill_size == -1
             or self.chunked_prefill_size >= 1,
             "--chunked-prefill-size must be >= 1, or -1 to disable chunking"),
            (self.context_length, self.context_length is None or self.context_length >= 2,
             "--context-length must be >= 2"),
            (self.disaggregation_mode, self.disaggregation_mode in DISAGGREGATION_MODES,
             f"--disaggregation-mode must be one of {DISAGGREGATION_MODES}"),
            (self.disaggregation_bootstrap_port, 0 < self.disaggregation_bootstrap_port < 65536,
             "--disaggregation-bootstrap-port must be in [1, 65535]"),
            (self.disaggregation_transfer_backend,
             self.disaggregation_transfer_backend in TRANSFER_BACKENDS,
             f"--disaggregation-transfer-backend must be one of {TRANSFER_BACKENDS}"),
            *[(getattr(self, f"disaggregation_{name}"), getattr(self, f"disaggregation_{name}") > 0,
               f"--disaggregation-{name.replace('_', '-')} must be > 0")
              for name in ("bootstrap_timeout", "waiting_timeout", "transfer_timeout",
                           "heartbeat_interval")],
            (self.dp_size, self.dp_size >= 1, "--dp-size must be >= 1"),
            (self.max_ep_size, self.max_ep_size is None or self.max_ep_size >= self.dp_size,
             "--max-ep-size must be >= --dp-size"),
            (self.load_balance_method, self.load_balance_method in LOAD_BALANCE_METHODS,
             f"--load-balance-method must be one of {LOAD_BALANCE_METHODS}"),
            (self.load_refresh_interval, self.load_refresh_interval >= 0,
             "--load-refresh-interval must be >= 0"),
            (self.load_publish_steps, self.load_publish_steps >= 1,
             "--load-publish-steps must be >= 1"),
            (self.nnodes, self.nnodes >= 1, "--nnodes must be >= 1"),
            (self.node_rank, 0 <= self.node_rank < self.nnodes,
             "--node-rank must be in [0, --nnodes)"),
            (self.dist_init_addr, self.nnodes == 1 or _host_port(self.dist_init_addr),
             "--dist-init-addr HOST:PORT is required with --nnodes > 1"),
            (self.dp_size, self.nnodes == 1 or (
                self.dp_size % self.nnodes == 0 and self.num_dp_slots == self.dp_size),
             "with --nnodes > 1, --dp-size must be a multiple of --nnodes (and --max-ep-size, "
             "if set, equal to --dp-size)"),
            (self.remote_rank_timeout, self.remote_rank_timeout > 0,
             "--remote-rank-timeout must be > 0"),
            (self.graceful_shutdown_timeout, self.graceful_shutdown_timeout >= 0,
             "--graceful-shutdown-timeout must be >= 0"),
        ]
        for value, ok, message in checks:
            if not ok:
                raise ConfigError(f"{message} (got {value!r})")

    @property
    def num_dp_slots(self) -> int:
        """Worker slots of the DP controller: --max-ep-size, of which --dp-size start active."""
        return self.max_ep_size or self.dp_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _host_port(addr: str | None) -> bool:
    if not addr or ":" not in addr:
        return False
    host, _, port = addr.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536 - 1024


def add_server_args(parser: argparse.ArgumentParser) -> None:
    d = ServerArgs()
    a = parser.add_argument
    a("--model-path", default=d.model_path,
      help="Hugging Face-format model folder; default: the embedded SmolLM2-135M-Instruct")
    a("--served-model-name", default=d.served_model_name,
      help="model name reported by /v1/models (default: the folder name)")
    a("--host", default=d.host)
    a("--port", type=int, default=d.port)
    a("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    a("--dtype", default=d.dtype, choices=DTYPES,
      help="auto: float32 on CPU, bfloat16 on CUDA")
    a("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    a("--max-total-tokens", type=int, default=d.max_total_tokens,
      help="KV pool capacity in tokens (default: from --mem-fraction-static)")
    a("--mem-fraction-static", type=float, default=d.mem_fraction_static,
      help="share of free memory for the KV pool (default 0.85 on CUDA, 0.1 on CPU)")
    a("--max-running-requests", type=int, default=d.max_running_requests)
    a("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
      help="max prompt tokens per extend batch; -1 disables chunked prefill")
    a("--context-length", type=int, default=d.context_length,
      help="max prompt + output tokens (default: the model's max_position_embeddings)")
    a("--disaggregation-mode", default=d.disaggregation_mode, choices=DISAGGREGATION_MODES,
      help="null: colocated; prefill/decode: one side of a PD pair (same as `pdserve prefill` "
           "/ `pdserve decode`)")
    a("--disaggregation-bootstrap-port", type=int, default=d.disaggregation_bootstrap_port,
      help="prefill: port of the bootstrap server where DP ranks register and decode asks "
           "for the topology")
    a("--disaggregation-transfer-backend", default=d.disaggregation_transfer_backend,
      choices=TRANSFER_BACKENDS,
      help="KV transfer: tcp (CPU pools), torch (torch.distributed: NCCL on GPUs, gloo on "
           "CPU), fake (no bytes; benchmarks); auto: tcp on CPU, torch on GPU")
    a("--disaggregation-bootstrap-timeout", type=float,
      default=d.disaggregation_bootstrap_timeout,
      help="seconds a request may wait for its PD peer to meet it (prefill: decode's page "
           "indices; decode: prefill topology and free pages)")
    a("--disaggregation-waiting-timeout", type=float, default=d.disaggregation_waiting_timeout,
      help="decode: seconds from sending the page indices to the first KV byte")
    a("--disaggregation-transfer-timeout", type=float, default=d.disaggregation_transfer_timeout,
      help="seconds a KV transfer may take once started")
    a("--disaggregation-heartbeat-interval", type=float,
      default=d.disaggregation_heartbeat_interval,
      help="decode: seconds between checks of each prefill's bootstrap server; two misses "
           "mark it dead and fail its requests")
    a("--dp-size", type=int, default=d.dp_size,
      help="data-parallel scheduler processes; > 1 adds a DataParallelController")
    a("--max-ep-size", type=int, default=d.max_ep_size,
      help="DP worker slots (>= --dp-size); slots beyond --dp-size start reserved and can be "
           "activated at run time")
    a("--load-balance-method", default=d.load_balance_method, choices=LOAD_BALANCE_METHODS,
      help="how the DP controller picks a rank; auto: round_robin, or follow_bootstrap_room "
           "on prefill")
    a("--load-refresh-interval", type=float, default=d.load_refresh_interval,
      help="seconds between load-budget refreshes of total_requests/total_tokens (0: every "
           "request)")
    a("--load-publish-steps", type=int, default=d.load_publish_steps,
      help="a rank publishes its load snapshot at least every N steps (and after every "
           "prefill batch, and when idle)")
    a("--nnodes", type=int, default=d.nnodes,
      help="machines sharing the DP ranks of one service; node 0 runs the HTTP front end")
    a("--node-rank", type=int, default=d.node_rank)
    a("--dist-init-addr", default=d.dist_init_addr,
      help="HOST:PORT of node 0; it binds PORT and the ports just above it for the other "
           "nodes' schedulers")
    a("--remote-rank-timeout", type=float, default=d.remote_rank_timeout,
      help="with --nnodes > 1: seconds without a new load snapshot from a rank on another "
           "node before node 0 marks it unavailable (its requests fail with 503); it is "
           "active again once its snapshots resume")
    a("--random-seed", type=int, default=d.random_seed)
    a("--graceful-shutdown-timeout", type=float, default=d.graceful_shutdown_timeout,
      help="seconds SIGTERM waits for in-flight requests before aborting them")
    a("--log-level", default=d.log_level, choices=("debug", "info", "warning", "error"))
    a("--torch-num-threads", type=int, default=d.torch_num_threads,
      help="intra-op threads of the scheduler process (default: torch's choice)")


def server_args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    return ServerArgs(**{k: v for k, v in vars(ns).items() if k in names})
