"""The worker process (`fanout worker`): one engine, loaded once, fed by the shards of many
jobs. consumer.py is the loop and wires the parts, each an object owning its state:
member.py (this process as an rq worker: registration, heartbeats, the model it serves),
admission.py (taking shards), attempts.py (one attempt of a shard), publish.py (a step's
events to Redis), outage.py (riding out Redis outages), reaper.py (dead workers' shards),
metrics.py. The engine (engine/) is usable on its own."""
