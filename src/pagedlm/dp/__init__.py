"""Data parallelism: replicas of one model's engine as Ray actors, behind the engine client the server uses.

`wire.py` (the messages over Ray), `actor.py` (`EngineReplica`, the actor body), `client.py` (`ReplicaClient`,
the front end's proxy of one actor, and its `RemoteStream`), `prefix_index.py` (prompt block hashes and what each
replica caches), `placement.py` (which replica takes a request: pure policy, the model router uses it too),
`replica_set.py` (`ReplicaSet`: the replicas as one engine, retries on a lost replica), `cluster.py` (Ray: join
or start a local cluster, launch the actors), `launch.py` (`launch_replica_set`, and `RayWatch`, which restarts a
local Ray that went down, or joins a cluster again when it is back).

Nothing is imported here, so that `placement` stays light for the router.
"""
