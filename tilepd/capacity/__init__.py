"""`tilepd capacity`: how many batch=1 decode nodes a load needs.

A decode node serves one request at a time, so the low-latency pool is an M/G/c queue
whose service time is the whole request on the node (prefill, KV transfer, decode of
every token). queueing.py has the closed forms (Erlang C with the Allen-Cunneen /
Kingman correction), simulate.py a discrete-event check that also models the router's
queue timeout, sources.py reads the load from the services' Prometheus /metrics.
No torch, no vLLM: this runs on an operator's laptop.
"""
