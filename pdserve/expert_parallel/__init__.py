"""Expert parallelism inside one service: N rank processes, experts sharded by rank, attention
data-parallel (each rank runs its own requests), MoE layers exchanging tokens by dispatch/combine.

- ``group``: the rank processes of a service and their torch.distributed group;
- ``experts``: the experts implementation registered with transformers' experts interface, and
  the sharding of a model's experts by rank;
- ``all_to_all_dispatch`` / ``deepep_dispatch``: how tokens reach their experts' rank and back;
- ``lockstep``: every rank runs one forward per tick, a filler when it has no work;
- ``rank_model``: one rank's model, its forwards run through the lockstep.

Running a service as such a group (``pdserve.hosting.ep_service``) and rank 0's routers
(``pdserve.hosting.rank_router``) live with the hosting code.
"""
