"""Tools a model may call during a multi-turn rollout, served as a service.

``core`` (the tool table, argument checks, time-outs; no sockets), ``builtin`` (the
``calculator`` and the sandboxed ``python``), ``serde`` (protobuf at the edge),
``servicer`` (``ToolService`` over gRPC), ``client`` (``ToolClient`` with the
in-process, gRPC and HTTP implementations) and ``server`` (``rlfleet serve tools``).
See docs/tools.md.
"""
