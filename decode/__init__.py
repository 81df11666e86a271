"""What only the decode side of a PD deployment does: the prealloc -> transfer -> running
queues (and the retracted queue) that receive KV from prefill and continue generation.

The colocated engine it builds on lives in `common/`; `pdserve decode` arrives with the PD
disaggregation work (see README, "Status").
"""
