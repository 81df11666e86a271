"""Where each DP rank runs and how the nodes of one service reach each other.

DP ranks are split evenly over `--nnodes` machines: node k runs ranks
[k * dp_size / nnodes, (k + 1) * dp_size / nnodes). Node 0 runs the front end, the controller
and the detokenizer, and binds every cross-node endpoint on `--dist-init-addr` HOST:PORT, so
the other nodes only connect to it and need to know nothing else:

    PORT          detokenizer input   remote schedulers PUSH their TokenBatches here
    PORT + 1      load relay          remote schedulers PUSH LoadSnapshots here; the one PULL
                                      is owned by the controller for load-aware methods, else
                                      by the front end; it writes them into node 0's board
    PORT + 2 + r  scheduler input r   the controller PUSHes rank r's requests (remote r only)

Ranks on node 0 use IPC sockets (`IpcPaths`) as in a single-node service.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import ServerArgs


@dataclass(frozen=True, slots=True)
class Topology:
    nnodes: int
    node_rank: int
    num_ranks: int
    host: str
    port: int

    @classmethod
    def from_args(cls, args: ServerArgs) -> Topology:
        host, port = "127.0.0.1", 0
        if args.dist_init_addr:
            host, _, raw_port = args.dist_init_addr.rpartition(":")
            port = int(raw_port)
        return cls(args.nnodes, args.node_rank, args.num_dp_slots, host, port)

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    def ranks_of(self, node: int) -> range:
        per = self.num_ranks // self.nnodes
        return range(node * per, (node + 1) * per)

    @property
    def local_ranks(self) -> range:
        return self.ranks_of(self.node_rank) if self.multi_node else range(self.num_ranks)

    def on_node0(self, rank: int) -> bool:
        return not self.multi_node or rank in self.ranks_of(0)

    @property
    def detokenizer_tcp(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def load_relay(self) -> str:
        return f"tcp://{self.host}:{self.port + 1}"

    def remote_scheduler_input(self, rank: int) -> str:
        return f"tcp://{self.host}:{self.port + 2 + rank}"
