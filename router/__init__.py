"""The L2 entry point of a PD deployment: picks a prefill and a decode service per request,
injects bootstrap_host/bootstrap_port/bootstrap_room, and relays the decode side's answer.

`pdserve router` arrives after the PD services (see README, "Status").
"""
