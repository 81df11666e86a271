"""What only the prefill side of a PD deployment does: the bootstrap server (rank registration
and topology queries) and the bootstrap -> forward -> inflight queues that hand KV to decode.

The colocated engine it builds on lives in `common/`; `pdserve prefill` arrives with the PD
disaggregation work (see README, "Status").
"""
