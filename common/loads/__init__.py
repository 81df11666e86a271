"""Load snapshots of DP ranks: the struct (`snapshot`), the shared-memory board (`board`), and
the multi-node relay (`relay`)."""
