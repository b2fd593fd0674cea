"""rlfleet.weightsync: moving the actor's weights from the trainer to the rollout replicas.

One package for both ends, so that a reader finds every part of weight sync here:

* :mod:`~rlfleet.weightsync.wire`: what both ends agree on: the transport names and
  codes (once), the bucketed chunk stream, the bulk plane's offer / plan / commit
  and their protobuf conversion;
* :mod:`~rlfleet.weightsync.sender`: the trainer side: :func:`push_weights` to many
  replicas in buckets, each over the best transport it can take (shared memory,
  TCP, gRPC), and :func:`send_update` to one;
* :mod:`~rlfleet.weightsync.receiver`: the rollout side: :class:`WeightReceiver`
  (stage, verify, check, swap) and :class:`BulkReceiver` (the bulk plane);
* :mod:`~rlfleet.weightsync.tcp`, :mod:`~rlfleet.weightsync.shm`: the two bulk
  transports, sender and receiver halves;
* :mod:`~rlfleet.weightsync.checksum`: per-tensor CRC-32C and the value scan, done
  as the bytes move;
* :mod:`~rlfleet.weightsync.lora`: a LoRA actor's updates: adapter names on the wire
  and the merge into the replica's base weights.

Imports are per module (``from rlfleet.weightsync.sender import push_weights``): the
wire format imports without torch, the ends with it.
"""
